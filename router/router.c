/* The router process: model, metrics, etcd view, HTTP and gRPC listeners; start-up and shutdown order. */
#include "router/router.h"

#include "common/etcd.h"
#include "common/log.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

bt_status rtr_split_hostport(const char *s, char *host, size_t cap, int *port)
{
    const char *colon = s ? strrchr(s, ':') : NULL;
    if (!colon || colon == s) return bt_fail(BT_ERR_INVALID, "'%s' is not host:port", s ? s : "");
    const char *h = s;
    size_t hl = (size_t)(colon - s);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') { /* [v6]:port */
        h++;
        hl -= 2;
    }
    if (hl + 1 > cap) return bt_fail(BT_ERR_INVALID, "host in '%s' is too long", s);
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || p < 0 || p > 65535) return bt_fail(BT_ERR_INVALID, "bad port in '%s'", s);
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (int)p;
    return BT_OK;
}

/* ---- admission (see router.h) ---- */

/* Cluster token rates for the prediction: measured, reported or the floor, whichever is highest. */
static void admit_rates(rtr_t *r, double *decode_tok_s, double *prefill_tok_s)
{
    rtr_cluster_rates_t cr;
    rtr_dispatch_rates(r->dispatch, &cr);
    double measured = (double)atomic_load(&r->gen_rate_milli) / 1000.0;
    rtr_admit_rates(measured, cr.decode_tok_s, cr.prefill_tok_s, cr.n_decode, cr.n_prefill, decode_tok_s, prefill_tok_s);
}

/* Under adm_mu: the tokens that compete with a new choice of o tokens, and the prompt tokens not started yet. */
static void admit_backlog(rtr_t *r, int64_t o, double *compete, double *pending_prompt)
{
    double w = 0, pp = 0;
    for (size_t k = 0; k < r->n_adm; k++) {
        const rtr_adm_t *a = r->adm[k];
        for (int i = 0; i < a->n; i++) {
            if (atomic_load(&a->c[i].ended)) continue;
            int64_t rem = a->expect_out - atomic_load(&a->c[i].got);
            if (rem > 0) w += (double)(rem < o ? rem : o);
            if (!atomic_load(&a->c[i].started)) pp += (double)a->n_prompt;
        }
    }
    *compete = w;
    *pending_prompt = pp;
}

static double predict_locked(rtr_t *r, int n, int64_t n_prompt, int64_t o, double dr, double pr)
{
    double w, pp;
    admit_backlog(r, o, &w, &pp);
    return rtr_admit_queue_s(pp, w, n, n_prompt, o, dr, pr);
}

double rtr_admit_predict_s(rtr_t *r, int n, int64_t n_prompt, int64_t o)
{
    double dr, pr;
    admit_rates(r, &dr, &pr);
    pthread_mutex_lock(&r->adm_mu);
    double t = predict_locked(r, n, n_prompt, o, dr, pr);
    pthread_mutex_unlock(&r->adm_mu);
    return t;
}

static int max_choices(const rtr_t *r)
{
    return r->cfg.max_inflight > 0 ? r->cfg.max_inflight : RTR_DEFAULT_MAX_INFLIGHT;
}

static double max_queue(const rtr_t *r)
{
    return r->cfg.max_queue_s == 0 ? RTR_DEFAULT_MAX_QUEUE_S : r->cfg.max_queue_s;
}

/* Under adm_mu: 1 when n more choices of o tokens fit both bounds; else msg and *retry set. */
static int admit_check_locked(rtr_t *r, int n, int64_t n_prompt, int64_t o, double dr, double pr, char *msg,
                              size_t cap, int *retry)
{
    if (r->active_choices + n > max_choices(r)) {
        snprintf(msg, cap, "too many requests in progress (%d choices running, at most %d): retry later",
                 r->active_choices, max_choices(r));
        *retry = 1;
        return 0;
    }
    double bound = max_queue(r);
    if (bound < 0) return 1;
    double t = predict_locked(r, n, n_prompt, o, dr, pr);
    if (t <= bound) return 1;
    snprintf(msg, cap, "overloaded: predicted queue time %.1f s exceeds the bound of %.0f s: retry later", t, bound);
    double wait = ceil(t - bound);
    *retry = wait < 1 ? 1 : wait > 60 ? 60 : (int)wait;
    return 0;
}

int rtr_admit_quick(rtr_t *r, char *msg, size_t cap, int *retry_after_s)
{
    double dr, pr;
    admit_rates(r, &dr, &pr);
    pthread_mutex_lock(&r->adm_mu);
    int ok = admit_check_locked(r, 1, 0, RTR_ADMIT_QUICK_OUT, dr, pr, msg, cap, retry_after_s);
    pthread_mutex_unlock(&r->adm_mu);
    return ok;
}

/* Expected output tokens of one choice of g. */
static int64_t expected_out(const rtr_t *r, const rtr_gen_t *g)
{
    if (g->ignore_eos) return g->max_tokens;
    int64_t mean = (int64_t)ceil(r->mean_out);
    return mean < (int64_t)g->max_tokens ? mean : (int64_t)g->max_tokens;
}

int rtr_admit_gen(rtr_t *r, const rtr_gen_t *g, rtr_adm_t **out, char *msg, size_t cap, int *retry_after_s)
{
    int n = g->n > 0 ? g->n : 1;
    rtr_adm_t *a = calloc(1, sizeof *a + (size_t)n * sizeof a->c[0]);
    if (!a) {
        snprintf(msg, cap, "out of memory");
        *retry_after_s = 1;
        return 0;
    }
    a->n = n;
    a->n_prompt = (int64_t)g->n_prompt;
    double dr, pr;
    admit_rates(r, &dr, &pr);
    pthread_mutex_lock(&r->adm_mu);
    a->expect_out = expected_out(r, g);
    int ok = admit_check_locked(r, n, a->n_prompt, a->expect_out, dr, pr, msg, cap, retry_after_s);
    if (ok && r->n_adm == r->cap_adm) {
        size_t nc = r->cap_adm ? 2 * r->cap_adm : 64;
        rtr_adm_t **na = realloc(r->adm, nc * sizeof *na);
        if (na) {
            r->adm = na;
            r->cap_adm = nc;
        } else {
            ok = 0;
            snprintf(msg, cap, "out of memory");
            *retry_after_s = 1;
        }
    }
    if (ok) {
        atomic_fetch_add(&r->arrivals, n);
        atomic_fetch_add(&r->arrival_prompt_tokens, (long long)a->n_prompt * n);
        a->slot = r->n_adm;
        r->adm[r->n_adm++] = a;
        r->active_choices += n;
    }
    pthread_mutex_unlock(&r->adm_mu);
    if (!ok) {
        free(a);
        return 0;
    }
    *out = a;
    return 1;
}

void rtr_admit_choice_end(rtr_t *r, rtr_adm_t *a, int i, uint32_t n_tokens, int natural)
{
    if (!a || i < 0 || i >= a->n || atomic_exchange(&a->c[i].ended, 1)) return;
    if (natural) {
        atomic_fetch_add(&r->finished_choices, 1);
        atomic_fetch_add(&r->finished_tokens, n_tokens);
    }
    pthread_mutex_lock(&r->adm_mu);
    r->active_choices--;
    if (natural) r->mean_out += ((double)n_tokens - r->mean_out) / 16.0;
    if (r->mean_out < 1) r->mean_out = 1;
    pthread_mutex_unlock(&r->adm_mu);
}

void rtr_admit_release(rtr_t *r, rtr_adm_t *a)
{
    if (!a) return;
    for (int i = 0; i < a->n; i++) rtr_admit_choice_end(r, a, i, 0, 0);
    pthread_mutex_lock(&r->adm_mu);
    size_t k = a->slot;
    r->adm[k] = r->adm[--r->n_adm];
    r->adm[k]->slot = k;
    pthread_mutex_unlock(&r->adm_mu);
    free(a);
}

void rtr_count_request(rtr_t *r, const char *status)
{
    metrics_counter_t *c = NULL;
    const char *labels[1] = {status};
    if (metrics_family_counter(r->requests, labels, &c) == BT_OK) metrics_counter_inc(c);
}

int rtr_slo_admit(rtr_t *r, const rtr_gen_t *g, char *msg, size_t cap)
{
    if (r->cfg.ttft_slo_ms <= 0) return 1;
    double ttft;
    if (rtr_dispatch_predict_ttft(r->dispatch, g->prompt, g->n_prompt, &ttft) != BT_OK) return 1;
    double slo = r->cfg.ttft_slo_ms / 1000.0;
    if (rtr_place_within_slo(ttft, slo)) return 1;
    snprintf(msg, cap, "predicted time to first token %.1f ms exceeds the TTFT SLO of %.1f ms: retry later",
             ttft * 1000.0, r->cfg.ttft_slo_ms);
    return 0;
}

/* Predicted TTFT buckets: the SLOs people set sit between 50 ms and a few seconds. */
static const double ttft_buckets[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};

static bt_status setup_placement_metrics(rtr_t *r)
{
    static const char *const choice[] = {"choice"};
    metrics_desc_t dd = {.name = "baton_router_prefill_decisions_total",
                         .help = "Prefill placements decided by the router, by choice (local or remote).",
                         .type = METRICS_COUNTER, .label_names = choice, .n_labels = 1};
    metrics_family_t *f;
    bt_status st;
    const char *local[] = {"local"}, *remote[] = {"remote"};
    if ((st = metrics_family_register(r->metrics, &dd, &f)) || (st = metrics_family_counter(f, local, &r->decisions_local)) ||
        (st = metrics_family_counter(f, remote, &r->decisions_remote)))
        return st;
    if ((st = metrics_histogram_register(r->metrics, "baton_router_predicted_ttft_seconds",
                                         "Time to first token the placement cost model predicted for its choice.",
                                         ttft_buckets, sizeof ttft_buckets / sizeof *ttft_buckets, &r->predicted_ttft)))
        return st;
    const char *pre[] = {"prefill"}, *dec[] = {"decode"};
    if ((st = metrics_std_register(r->metrics, METRICS_STD_PLANNER_DESIRED_REPLICAS, &f)) ||
        (st = metrics_family_gauge(f, pre, &r->planner_prefill)) || (st = metrics_family_gauge(f, dec, &r->planner_decode)))
        return st;
    return BT_OK;
}

static void *planner_main(void *arg)
{
    rtr_t *r = arg;
    pthread_mutex_lock(&r->planner_mu);
    while (!atomic_load(&r->stopping)) {
        rtr_planner_tick(r);
        rtr_probes_tick(r);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        pthread_cond_timedwait(&r->planner_cv, &r->planner_mu, &ts);
    }
    pthread_mutex_unlock(&r->planner_mu);
    return NULL;
}

static bt_status setup_metrics(rtr_t *r)
{
    bt_status st;
    if ((st = metrics_registry_create(&r->metrics))) return st;
    if ((st = metrics_std_histogram(r->metrics, METRICS_STD_TTFT, &r->ttft))) return st;
    if ((st = metrics_std_histogram(r->metrics, METRICS_STD_TPOT, &r->tpot))) return st;
    if ((st = metrics_std_histogram(r->metrics, METRICS_STD_E2E_LATENCY, &r->e2e))) return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_REQUESTS, &r->requests))) return st;
    if ((st = metrics_std_counter(r->metrics, METRICS_STD_PROMPT_TOKENS, &r->prompt_tokens))) return st;
    if ((st = metrics_std_counter(r->metrics, METRICS_STD_GENERATION_TOKENS, &r->generation_tokens))) return st;
    if ((st = metrics_std_counter(r->metrics, METRICS_STD_MIGRATIONS, &r->migrations))) return st;
    if ((st = setup_placement_metrics(r))) return st;
    return rtr_planner_metrics(r);
}

bt_status rtr_create(const rtr_config_t *cfg, rtr_t **out)
{
    if (!cfg->model_path || !cfg->etcd) return bt_fail(BT_ERR_INVALID, "--model and --etcd are required");
    if (cfg->served_model_name) {
        const char *n = cfg->served_model_name;
        const size_t cap = sizeof(((rtr_model_t *)0)->name);
        int ok = *n && strlen(n) < cap;
        for (const char *p = n; ok && *p; p++) ok = *p > ' ' && *p < 127;
        if (!ok)
            return bt_fail(BT_ERR_INVALID, "--served-model-name: '%.200s' must be 1 to %zu printable characters "
                           "without spaces", n, cap - 1);
    }
    rtr_t *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->cfg = *cfg;
    pthread_mutex_init(&r->planner_mu, NULL);
    pthread_cond_init(&r->planner_cv, NULL);
    pthread_mutex_init(&r->adm_mu, NULL);
    r->mean_out = RTR_ADMIT_PRIOR_OUT;
    bt_status st;
    if ((st = rtr_model_load_tmpl(cfg->model_path, cfg->max_context, cfg->chat_template, &r->model))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        pthread_cond_destroy(&r->planner_cv);
        pthread_mutex_destroy(&r->planner_mu);
        pthread_mutex_destroy(&r->adm_mu);
        free(r);
        return bt_fail(st, "cannot load %s: %s", cfg->model_path, msg);
    }
    if (cfg->served_model_name) snprintf(r->model.name, sizeof r->model.name, "%s", cfg->served_model_name);
    if ((st = rtr_model_tools_init(&r->model, cfg->model_path, cfg->chat_template, cfg->tool_call_parser))) goto fail;
    if ((st = setup_metrics(r)) || (st = rtr_probes_metrics(r)) || (st = rtr_planner_init(r))) goto fail;
    etcd_config_t ec = {.endpoints = cfg->etcd, .user = cfg->etcd_user, .password = cfg->etcd_password};
    bt_tls_etcd_paths(&cfg->etcd_tls, &ec.ca_file, &ec.cert_file, &ec.key_file);
    if ((st = etcd_client_create(&ec, &r->etcd))) goto fail;
    rtr_dispatch_config_t dc = {.etcd = r->etcd, .cluster = cfg->cluster, .max_migrations = cfg->max_migrations,
                                .migrations = r->migrations, .fingerprint = r->model.fingerprint,
                                .fingerprint_u64 = r->model.fingerprint_u64, .prefill_mode = cfg->prefill_mode,
                                .remote_overhead_s = cfg->remote_prefill_overhead_ms / 1000.0,
                                .kv_bytes_per_token = r->model.kv_bytes_per_token, .decision_log = cfg->decision_log,
                                .decisions_local = r->decisions_local, .decisions_remote = r->decisions_remote,
                                .predicted_ttft = r->predicted_ttft, .load_stale_ms = cfg->load_stale_ms,
                                .stall_ms = cfg->stall_ms, .rejoin_grace_ms = cfg->rejoin_grace_ms,
                                .request_timeout_ms = cfg->request_timeout_ms, .tls = &r->cfg.tls};
    if ((st = rtr_dispatch_create(&dc, &r->dispatch))) goto fail;

    char host[256];
    int port;
    if ((st = rtr_split_hostport(cfg->http_listen, host, sizeof host, &port))) goto fail;
    const bt_tls_files_t *t = &r->cfg.tls;
    http_config_t hc = {.address = host, .port = port, .threads = cfg->http_threads, .api_keys = cfg->api_keys,
                        .n_api_keys = cfg->n_api_keys, .metrics = r->metrics,
                        .max_connections = cfg->http_max_connections, .max_per_ip = cfg->http_max_per_ip,
                        .timeout_s = cfg->http_idle_timeout_s, .read_timeout_s = cfg->http_read_timeout_s,
                        .max_memory = cfg->http_max_memory,
                        .tls_cert_file = t->cert[0] ? t->cert : NULL, .tls_key_file = t->key[0] ? t->key : NULL};
    if ((st = http_server_create(&hc, &r->http))) goto fail;
    if ((st = rtr_openai_register(r, r->http))) goto fail;
    if ((st = rtr_probes_register(r, r->http))) goto fail;
    /* the public gRPC API: server TLS with the router's certificate; client certificates only with --grpc-tls-client-ca */
    bt_rpc_server_config_t gc = {.listen = cfg->grpc_listen, .tls_cert_file = cfg->grpc_tls_cert,
                                 .tls_key_file = cfg->grpc_tls_key, .tls_client_ca_file = cfg->grpc_tls_client_ca};
    if (!gc.tls_cert_file && t->cert[0]) {
        gc.tls_cert_file = t->cert;
        gc.tls_key_file = t->key;
    }
    if ((st = bt_rpc_server_create(&gc, &r->grpc))) goto fail;
    if ((st = rtr_grpc_register(r, r->grpc))) goto fail;
    *out = r;
    return BT_OK;
fail:
    {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        rtr_destroy(r);
        return bt_fail(st, "%s", msg);
    }
}

bt_status rtr_start(rtr_t *r)
{
    bt_status st;
    if ((st = http_server_start(r->http))) return st;
    atomic_store(&r->grpc_ready, 1); /* the server starts SERVING: the first tick corrects it */
    if ((st = bt_rpc_server_start(r->grpc))) return st;
    if (rtr_dispatch_wait_synced(r->dispatch, 2000) != BT_OK)
        BT_WARN("router", "etcd at %s has not answered yet: no decode node known until it does", r->cfg.etcd);
    rtr_probes_tick(r);
    if (pthread_create(&r->planner, NULL, planner_main, r) == 0) r->planner_started = 1;
    else BT_WARN("router", "cannot start the planner thread: planner gauges stay unset");
    char host[256];
    int port;
    rtr_split_hostport(r->cfg.http_listen, host, sizeof host, &port);
    char ghost[256];
    rtr_split_hostport(r->cfg.grpc_listen, ghost, sizeof ghost, &port);
    /* the harness and the local launcher read this line for the bound ports */
    BT_INFO("router", "listening grpc=%s:%d http=%s:%d model=%s context=%d decode_nodes=%d", ghost,
            bt_rpc_server_port(r->grpc), host, http_server_port(r->http), r->model.name, r->model.n_ctx,
            rtr_dispatch_n_healthy(r->dispatch));
    char slo[64] = "none";
    if (r->cfg.ttft_slo_ms > 0) snprintf(slo, sizeof slo, "%.0f ms", r->cfg.ttft_slo_ms);
    BT_INFO("router", "prefill placement %s, remote overhead %.1f ms, KV %.0f bytes/token, TTFT SLO %s",
            rtr_prefill_mode_name(r->cfg.prefill_mode), r->cfg.remote_prefill_overhead_ms, r->model.kv_bytes_per_token,
            slo);
    return BT_OK;
}

void rtr_destroy(rtr_t *r)
{
    if (!r) return;
    atomic_store(&r->stopping, 1);
    if (r->http) http_server_stop(r->http);
    if (r->grpc) bt_rpc_server_shutdown(r->grpc, 0);
    if (r->planner_started) {
        pthread_mutex_lock(&r->planner_mu);
        pthread_cond_signal(&r->planner_cv);
        pthread_mutex_unlock(&r->planner_mu);
        pthread_join(r->planner, NULL);
        r->planner_started = 0;
    }
    /* jobs notice `stopping` within one poll and end their streams */
    for (int i = 0; i < 500 && atomic_load(&r->active_jobs) > 0; i++) usleep(10000);
    if (atomic_load(&r->active_jobs) > 0) {
        BT_WARN("router", "%d request(s) still running at exit", atomic_load(&r->active_jobs));
        return; /* leave the rest: freeing under running threads would be worse */
    }
    rtr_planner_forget(r);
    http_server_destroy(r->http);
    bt_rpc_server_destroy(r->grpc);
    rtr_dispatch_destroy(r->dispatch);
    etcd_client_destroy(r->etcd);
    metrics_registry_destroy(r->metrics);
    rtr_model_free(&r->model);
    pthread_cond_destroy(&r->planner_cv);
    pthread_mutex_destroy(&r->planner_mu);
    pthread_mutex_destroy(&r->adm_mu);
    free(r->adm);
    free(r);
}
