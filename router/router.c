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

static bt_status setup_metrics(rtr_t *r)
{
    bt_status st;
    metrics_family_t *f;
    if ((st = metrics_registry_create(&r->metrics))) return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_TTFT, &f)) ||
        (st = metrics_family_histogram(f, NULL, &r->ttft)))
        return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_TPOT, &f)) ||
        (st = metrics_family_histogram(f, NULL, &r->tpot)))
        return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_E2E_LATENCY, &f)) ||
        (st = metrics_family_histogram(f, NULL, &r->e2e)))
        return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_REQUESTS, &r->requests))) return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_PROMPT_TOKENS, &f)) ||
        (st = metrics_family_counter(f, NULL, &r->prompt_tokens)))
        return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_GENERATION_TOKENS, &f)) ||
        (st = metrics_family_counter(f, NULL, &r->generation_tokens)))
        return st;
    if ((st = metrics_std_register(r->metrics, METRICS_STD_MIGRATIONS, &f)) ||
        (st = metrics_family_counter(f, NULL, &r->migrations)))
        return st;
    return BT_OK;
}

bt_status rtr_create(const rtr_config_t *cfg, rtr_t **out)
{
    if (!cfg->model_path || !cfg->etcd) return bt_fail(BT_ERR_INVALID, "--model and --etcd are required");
    rtr_t *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "out of memory");
    r->cfg = *cfg;
    bt_status st;
    if ((st = rtr_model_load(cfg->model_path, cfg->max_context, &r->model))) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        free(r);
        return bt_fail(st, "cannot load %s: %s", cfg->model_path, msg);
    }
    if ((st = setup_metrics(r))) goto fail;
    etcd_config_t ec = {.endpoints = cfg->etcd};
    if ((st = etcd_client_create(&ec, &r->etcd))) goto fail;
    rtr_dispatch_config_t dc = {.etcd = r->etcd, .cluster = cfg->cluster, .max_migrations = cfg->max_migrations,
                                .migrations = r->migrations, .fingerprint = r->model.fingerprint};
    if ((st = rtr_dispatch_create(&dc, &r->dispatch))) goto fail;

    char host[256];
    int port;
    if ((st = rtr_split_hostport(cfg->http_listen, host, sizeof host, &port))) goto fail;
    http_config_t hc = {.address = host, .port = port, .threads = cfg->http_threads, .api_keys = cfg->api_keys,
                        .n_api_keys = cfg->n_api_keys, .metrics = r->metrics};
    if ((st = http_server_create(&hc, &r->http))) goto fail;
    if ((st = rtr_openai_register(r, r->http))) goto fail;
    bt_rpc_server_config_t gc = {.listen = cfg->grpc_listen, .tls_cert_file = cfg->grpc_tls_cert,
                                 .tls_key_file = cfg->grpc_tls_key, .tls_client_ca_file = cfg->grpc_tls_client_ca};
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
    char host[256];
    int port;
    rtr_split_hostport(r->cfg.http_listen, host, sizeof host, &port);
    char ghost[256];
    rtr_split_hostport(r->cfg.grpc_listen, ghost, sizeof ghost, &port);
    /* the harness and the local launcher read this line for the bound ports */
    BT_INFO("router", "listening grpc=%s:%d http=%s:%d model=%s context=%d decode_nodes=%d", ghost,
            bt_rpc_server_port(r->grpc), host, http_server_port(r->http), r->model.name, r->model.n_ctx,
            rtr_dispatch_n_healthy(r->dispatch));
    return BT_OK;
}

void rtr_destroy(rtr_t *r)
{
    if (!r) return;
    atomic_store(&r->stopping, 1);
    if (r->http) http_server_stop(r->http);
    if (r->grpc) bt_rpc_server_shutdown(r->grpc, 0);
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
    free(r);
}
