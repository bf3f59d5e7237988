/* The router process: model, metrics, etcd view, HTTP and gRPC listeners; start-up and shutdown order. */
#include "router/router.h"

#include "common/etcd.h"
#include "common/log.h"

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

int rtr_admit(rtr_t *r)
{
    int max = r->cfg.max_inflight > 0 ? r->cfg.max_inflight : RTR_DEFAULT_MAX_INFLIGHT;
    return atomic_load(&r->active_jobs) < max;
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

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* One planner tick: token rates over the window (from the request counters) against the nodes' mean measured rates.
 * Without a measured rate the current node count stands (the planner then has nothing better to say). */
static void planner_tick(rtr_t *r)
{
    double *s = r->samples[r->next_sample];
    s[0] = mono_s();
    s[1] = metrics_counter_value(r->prompt_tokens);
    s[2] = metrics_counter_value(r->generation_tokens);
    r->next_sample = (r->next_sample + 1) % (RTR_PLANNER_WINDOW_S + 1);
    if (r->n_samples < RTR_PLANNER_WINDOW_S + 1) r->n_samples++;
    /* the oldest sample in the ring is about RTR_PLANNER_WINDOW_S seconds old once it is full */
    int oldest = r->n_samples < RTR_PLANNER_WINDOW_S + 1 ? 0 : r->next_sample;
    double *o = r->samples[oldest];
    double dt = s[0] - o[0];
    double prompt_tok_s = dt > 0 ? (s[1] - o[1]) / dt : 0, gen_tok_s = dt > 0 ? (s[2] - o[2]) / dt : 0;
    rtr_cluster_rates_t cr;
    rtr_dispatch_rates(r->dispatch, &cr);
    int np = rtr_planner_replicas(prompt_tok_s, cr.prefill_tok_s, cr.n_prefill);
    int nd = rtr_planner_replicas(gen_tok_s, cr.decode_tok_s, cr.n_decode);
    metrics_gauge_set(r->planner_prefill, np);
    metrics_gauge_set(r->planner_decode, nd);
}

static void *planner_main(void *arg)
{
    rtr_t *r = arg;
    pthread_mutex_lock(&r->planner_mu);
    while (!atomic_load(&r->stopping)) {
        planner_tick(r);
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
    return setup_placement_metrics(r);
}

bt_status rtr_create(const rtr_config_t *cfg, rtr_t **out)
{
    if (!cfg->model_path || !cfg->etcd) return bt_fail(BT_ERR_INVALID, "--model and --etcd are required");
    rtr_t *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->cfg = *cfg;
    pthread_mutex_init(&r->planner_mu, NULL);
    pthread_cond_init(&r->planner_cv, NULL);
    bt_status st;
    if ((st = rtr_model_load(cfg->model_path, cfg->max_context, &r->model))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        pthread_cond_destroy(&r->planner_cv);
        pthread_mutex_destroy(&r->planner_mu);
        free(r);
        return bt_fail(st, "cannot load %s: %s", cfg->model_path, msg);
    }
    if ((st = setup_metrics(r))) goto fail;
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
                        .tls_cert_file = t->cert[0] ? t->cert : NULL, .tls_key_file = t->key[0] ? t->key : NULL};
    if ((st = http_server_create(&hc, &r->http))) goto fail;
    if ((st = rtr_openai_register(r, r->http))) goto fail;
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
    if ((st = bt_rpc_server_start(r->grpc))) return st;
    if (rtr_dispatch_wait_synced(r->dispatch, 2000) != BT_OK)
        BT_WARN("router", "etcd at %s has not answered yet: no decode node known until it does", r->cfg.etcd);
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
    http_server_destroy(r->http);
    bt_rpc_server_destroy(r->grpc);
    rtr_dispatch_destroy(r->dispatch);
    etcd_client_destroy(r->etcd);
    metrics_registry_destroy(r->metrics);
    rtr_model_free(&r->model);
    pthread_cond_destroy(&r->planner_cv);
    pthread_mutex_destroy(&r->planner_mu);
    free(r);
}
