/* The planner thread's tick (router.h, "planner_loop.c"): window rates, the cluster-wide sum through etcd, the
 * profile, planner.c's answer, the gauges. Runs on the planner thread only (its state is that thread's). */
#include "router/router.h"

#include "common/etcd.h"
#include "common/log.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

bt_status rtr_planner_metrics(rtr_t *r)
{
    static const struct {
        const char *name, *help;
        size_t off;
    } g[] = {
        {"baton_planner_observed_request_rate", "Requests per second the planner plans for (all routers, window mean).",
         offsetof(rtr_t, g_plan_rate)},
        {"baton_planner_input_tokens_mean", "Mean prompt tokens per request the planner plans for.", offsetof(rtr_t, g_plan_isl)},
        {"baton_planner_output_tokens_mean", "Mean generated tokens per request the planner plans for.", offsetof(rtr_t, g_plan_osl)},
        {"baton_planner_predicted_ttft_seconds", "p90 time to first token the planner predicts at its desired replicas.",
         offsetof(rtr_t, g_plan_ttft)},
        {"baton_planner_predicted_tpot_seconds", "p90 time per output token the planner predicts at its desired replicas.",
         offsetof(rtr_t, g_plan_tpot)},
        {"baton_planner_routers", "Routers whose load records the planner summed (one answer per cluster).",
         offsetof(rtr_t, g_plan_routers)},
    };
    for (size_t i = 0; i < sizeof g / sizeof *g; i++) {
        bt_status st = metrics_gauge_register(r->metrics, g[i].name, g[i].help, (metrics_gauge_t **)((char *)r + g[i].off));
        if (st) return st;
    }
    return BT_OK;
}

bt_status rtr_planner_init(rtr_t *r)
{
    char host[64] = "router";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    for (char *c = host; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '-' || *c == '.'))
            *c = '_';
    snprintf(r->router_id, sizeof r->router_id, "%s-%ld-%lld", host, (long)getpid(), (long long)wall_ms());
    int window = r->cfg.planner_window_s > 0 ? r->cfg.planner_window_s : PLAN_DEFAULT_DOWN_WINDOW;
    plan_smooth_init(&r->smooth_prefill, window);
    plan_smooth_init(&r->smooth_decode, window);
    if (!r->cfg.planner_profile) return BT_OK;
    FILE *f = fopen(r->cfg.planner_profile, "rb");
    if (!f) return bt_fail(BT_ERR_IO, "--planner-profile %s: %s", r->cfg.planner_profile, strerror(errno));
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) return bt_fail(BT_ERR_NOMEM, "out of memory");
    buf[n] = '\0';
    bt_status st = plan_profile_from_json(buf, &r->plan_file);
    free(buf);
    if (st) return bt_fail(st, "--planner-profile %s: %s", r->cfg.planner_profile, bt_last_error());
    r->has_plan_file = 1;
    return BT_OK;
}

static void planner_key(const rtr_t *r, const char *id, char *key, size_t cap)
{
    snprintf(key, cap, "/baton/%s/planner/%s", r->cfg.cluster ? r->cfg.cluster : MBR_DEFAULT_CLUSTER, id);
}

/* Publishes own and sums every fresh record (own included) into *all; on any etcd error *all = own. */
static void gather(rtr_t *r, const plan_obs_t *own, plan_obs_t *all)
{
    *all = *own;
    double t = mono_s();
    if (t < r->plan_etcd_retry_s) return;
    r->plan_etcd_retry_s = t + RTR_PLANNER_ETCD_RETRY_S; /* cleared below once both calls answered */
    char key[MBR_KEY_MAX];
    planner_key(r, r->router_id, key, sizeof key);
    char val[256];
    int64_t now = wall_ms();
    int len = snprintf(val, sizeof val,
                       "{\"req_s\":%.6g,\"prompt_tok_s\":%.6g,\"gen_tok_s\":%.6g,\"queued\":%.6g,\"timestamp_ms\":%lld}",
                       own->req_s, own->prompt_tok_s, own->gen_tok_s, own->queued, (long long)now);
    if (etcd_put(r->etcd, key, val, (size_t)len, 0, NULL)) return;
    planner_key(r, "", key, sizeof key);
    etcd_range_opts_t o = {.prefix = 1};
    etcd_range_result_t res;
    if (etcd_range(r->etcd, key, &o, &res)) return;
    plan_obs_t sum = {0};
    for (size_t i = 0; i < res.n_kvs; i++) {
        cJSON *j = cJSON_Parse(res.kvs[i].value);
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "req_s"), *b = cJSON_GetObjectItemCaseSensitive(j, "prompt_tok_s");
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "gen_tok_s"), *ts = cJSON_GetObjectItemCaseSensitive(j, "timestamp_ms");
        if (cJSON_IsNumber(ts) && now - (int64_t)ts->valuedouble > RTR_PLANNER_GC_MS)
            etcd_delete(r->etcd, res.kvs[i].key, 0, NULL, NULL); /* best effort: another reader may try again */
        if (cJSON_IsNumber(a) && cJSON_IsNumber(b) && cJSON_IsNumber(c) && cJSON_IsNumber(ts) &&
            now - (int64_t)ts->valuedouble <= RTR_PLANNER_STALE_MS && a->valuedouble >= 0 && b->valuedouble >= 0 &&
            c->valuedouble >= 0) {
            const cJSON *q = cJSON_GetObjectItemCaseSensitive(j, "queued"); /* absent from older routers' records */
            plan_obs_t x = {.req_s = a->valuedouble, .prompt_tok_s = b->valuedouble, .gen_tok_s = c->valuedouble,
                            .queued = cJSON_IsNumber(q) && q->valuedouble > 0 ? q->valuedouble : 0, .routers = 1};
            plan_obs_merge(&sum, &x);
        }
        cJSON_Delete(j);
    }
    etcd_range_result_free(&res);
    r->plan_etcd_retry_s = 0;
    if (sum.routers > 0) *all = sum;
}

void rtr_planner_forget(rtr_t *r)
{
    char key[MBR_KEY_MAX];
    if (!r->router_id[0] || !r->etcd) return;
    planner_key(r, r->router_id, key, sizeof key);
    etcd_delete(r->etcd, key, 0, NULL, NULL);
}

/* The profile to plan with: the file's, else one built from the nodes' fits (the last one seen, when no node has
 * a fit this tick: a fit comes and goes with the node's recent steps). 0 when there has never been one. */
static int profile_of(rtr_t *r, const rtr_cluster_rates_t *cr, plan_profile_t *p)
{
    if (r->has_plan_file) {
        *p = r->plan_file;
        return 1;
    }
    if (!(cr->prefill_token_s > 0)) {
        *p = r->node_profile;
        return r->has_node_profile;
    }
    memset(p, 0, sizeof *p);
    p->prefill_fixed_s = cr->prefill_fixed_s;
    p->prefill_token_s = cr->prefill_token_s;
    /* a node that mixes prompt chunks into every step (overloaded, colocated) never fits decode-only steps: a
     * decode row then costs what any token costs in its general fit */
    p->decode_fixed_s = cr->decode_fixed_s > 0 ? cr->decode_fixed_s : cr->prefill_fixed_s + cr->prefill_token_s;
    p->decode_seq_s = cr->decode_fixed_s > 0 ? cr->decode_row_s : cr->prefill_token_s;
    p->kv_bytes_per_token = r->model.kv_bytes_per_token;
    p->chunk_tokens = PLAN_DEFAULT_CHUNK;
    p->max_running = PLAN_DEFAULT_MAX_RUNNING;
    r->node_profile = *p;
    r->has_node_profile = 1;
    return 1;
}

/* Choices admitted and still waiting for their first token: the backlog the planner drains. */
static double backlog(rtr_t *r)
{
    long n = 0;
    pthread_mutex_lock(&r->adm_mu);
    for (size_t i = 0; i < r->n_adm; i++)
        for (int k = 0; r->adm[i] && k < r->adm[i]->n; k++)
            n += !atomic_load(&r->adm[i]->c[k].started) && !atomic_load(&r->adm[i]->c[k].ended);
    pthread_mutex_unlock(&r->adm_mu);
    return (double)n;
}

void rtr_planner_tick(rtr_t *r)
{
    double *s = r->samples[r->next_sample];
    s[0] = mono_s();
    s[1] = (double)atomic_load(&r->arrival_prompt_tokens);
    s[2] = (double)atomic_load(&r->tokens_seen); /* as they stream: the usage counter moves only as requests end */
    s[3] = (double)atomic_load(&r->arrivals);
    s[4] = (double)atomic_load(&r->finished_choices);
    s[5] = (double)atomic_load(&r->finished_tokens);
    r->next_sample = (r->next_sample + 1) % (RTR_PLANNER_WINDOW_S + 1);
    if (r->n_samples < RTR_PLANNER_WINDOW_S + 1) r->n_samples++;
    /* the oldest sample in the ring is about RTR_PLANNER_WINDOW_S seconds old once it is full */
    int oldest = r->n_samples < RTR_PLANNER_WINDOW_S + 1 ? 0 : r->next_sample;
    double *o = r->samples[oldest];
    double dt = s[0] - o[0];
    plan_obs_t own = {.routers = 1, .queued = backlog(r)};
    if (dt > 0) {
        own.prompt_tok_s = (s[1] - o[1]) / dt;
        own.req_s = (s[3] - o[3]) / dt;
        /* output demand: arrivals times the mean output of the choices that finished in the window (tokens
         * streamed per arrival understate it while a backlog grows); with none finished, admission's mean */
        double fin = s[4] - o[4], mean_out;
        pthread_mutex_lock(&r->adm_mu);
        mean_out = r->mean_out; /* admission's running mean (its prior before any choice finished) */
        pthread_mutex_unlock(&r->adm_mu);
        own.gen_tok_s = own.req_s * (fin > 0 ? (s[5] - o[5]) / fin : mean_out);
    }
    /* admission's measured rate: tokens streamed to clients over the last 5 ticks */
    double *g = r->gen_ring[r->gen_n % 6], *b = r->gen_ring[(r->gen_n + 1) % 6];
    g[0] = s[0];
    g[1] = (double)atomic_load(&r->tokens_seen);
    if (++r->gen_n >= 6 && g[0] > b[0]) atomic_store(&r->gen_rate_milli, (long long)((g[1] - b[1]) / (g[0] - b[0]) * 1e3));

    plan_obs_t all;
    gather(r, &own, &all);
    rtr_cluster_rates_t cr;
    rtr_dispatch_rates(r->dispatch, &cr);
    plan_profile_t prof;
    int np, nd;
    if (profile_of(r, &cr, &prof)) {
        plan_targets_t t = {.ttft_s = r->cfg.ttft_slo_ms / 1000.0, .tpot_s = r->cfg.tpot_slo_ms / 1000.0,
                            .colocated = cr.n_prefill == 0};
        plan_answer_t a;
        plan_compute(&prof, &t, &all, &a);
        np = plan_smooth_tick(&r->smooth_prefill, a.prefill);
        nd = plan_smooth_tick(&r->smooth_decode, a.decode);
        double ttft, tpot; /* at the smoothed counts, which may sit above the raw answer */
        plan_predict(&prof, &t, a.lambda, a.isl, a.osl, t.colocated ? 0 : np, nd, &ttft, &tpot);
        metrics_gauge_set(r->g_plan_ttft, isfinite(ttft) ? ttft : 1e9);
        metrics_gauge_set(r->g_plan_tpot, isfinite(tpot) ? tpot : 1e9);
    } else { /* no step model yet: the throughput rule (the node counts while no rate is measured), smoothed too */
        np = plan_smooth_tick(&r->smooth_prefill, rtr_planner_replicas(all.prompt_tok_s, cr.prefill_tok_s, cr.n_prefill));
        nd = plan_smooth_tick(&r->smooth_decode, rtr_planner_replicas(all.gen_tok_s, cr.decode_tok_s, cr.n_decode));
    }
    metrics_gauge_set(r->planner_prefill, np);
    metrics_gauge_set(r->planner_decode, nd);
    metrics_gauge_set(r->g_plan_rate, all.req_s);
    metrics_gauge_set(r->g_plan_isl, all.req_s > 0 ? all.prompt_tok_s / all.req_s : 0);
    metrics_gauge_set(r->g_plan_osl, all.req_s > 0 ? all.gen_tok_s / all.req_s : 0);
    metrics_gauge_set(r->g_plan_routers, all.routers);
}
