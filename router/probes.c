/* Liveness, readiness and drain (DESIGN 14): what an orchestrator asks the router before it sends traffic and
 * after it decides to stop a replica.
 *
 *   live   the process answers: /live and /health stay 200 until it exits
 *   ready  not draining and at least one decode node in the view: /ready 200, gRPC health "" SERVING;
 *          otherwise /ready 503 and NOT_SERVING, so a load balancer sends nothing that would fail with 503
 *   drain  on SIGTERM: readiness goes false, new requests are refused with 503 / UNAVAILABLE, and requests in
 *          flight get up to --grace-ms to finish before the shutdown cancels what is left */
#include "router/router.h"

#include "common/log.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

int rtr_ready(rtr_t *r)
{
    return !atomic_load(&r->draining) && rtr_dispatch_n_healthy(r->dispatch) > 0;
}

const char *rtr_not_ready_reason(rtr_t *r)
{
    return atomic_load(&r->draining) ? "the router is shutting down" : "no healthy decode node";
}

bt_status rtr_probes_metrics(rtr_t *r)
{
    static const char *const role[] = {"role"};
    metrics_desc_t dd = {.name = "baton_router_nodes",
                         .help = "Healthy nodes in the router's view of the cluster, by role (what the planner's "
                                 "desired replicas compare with).",
                         .type = METRICS_GAUGE, .label_names = role, .n_labels = 1};
    metrics_family_t *f;
    bt_status st;
    const char *pre[] = {"prefill"}, *dec[] = {"decode"};
    if ((st = metrics_family_register(r->metrics, &dd, &f)) || (st = metrics_family_gauge(f, pre, &r->nodes_prefill)) ||
        (st = metrics_family_gauge(f, dec, &r->nodes_decode)))
        return st;
    return metrics_gauge_register(r->metrics, "baton_router_ready",
                                  "1 while the router takes requests (a decode node is in view and it is not "
                                  "draining), else 0: what /ready and gRPC health say.",
                                  &r->ready_gauge);
}

void rtr_probes_tick(rtr_t *r)
{
    int ready = rtr_ready(r);
    if (ready != atomic_exchange(&r->grpc_ready, ready)) bt_rpc_server_set_health(r->grpc, "", ready);
    rtr_cluster_rates_t cr;
    rtr_dispatch_rates(r->dispatch, &cr);
    metrics_gauge_set(r->nodes_prefill, cr.n_prefill);
    metrics_gauge_set(r->nodes_decode, cr.n_decode);
    metrics_gauge_set(r->ready_gauge, ready);
}

static void h_live(http_request_t *req, void *arg)
{
    (void)arg;
    static const char body[] = "{\"status\":\"alive\"}";
    http_respond(req, 200, "application/json", body, sizeof body - 1);
}

static void h_ready(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    int n = rtr_dispatch_n_healthy(r->dispatch), draining = atomic_load(&r->draining);
    int ready = !draining && n > 0;
    char buf[160];
    int len = snprintf(buf, sizeof buf, "{\"status\":\"%s\",\"decode_nodes\":%d,\"active_requests\":%d}",
                       ready ? "ready" : draining ? "draining" : "no decode node", n, atomic_load(&r->active_jobs));
    if (!ready) http_response_header(req, "Retry-After", "1");
    http_respond(req, ready ? 200 : 503, "application/json", buf, (size_t)len);
}

bt_status rtr_probes_register(rtr_t *r, http_server_t *s)
{
    bt_status st;
    if ((st = http_server_route(s, "GET", "/live", 0, h_live, r))) return st;
    return http_server_route(s, "GET", "/ready", 0, h_ready, r);
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void rtr_drain(rtr_t *r, int grace_ms)
{
    atomic_store(&r->draining, 1);
    rtr_probes_tick(r);
    int n0 = atomic_load(&r->active_jobs);
    double t0 = mono_s(), until = t0 + (grace_ms > 0 ? grace_ms : 0) / 1000.0;
    BT_INFO("router", "draining: %d request(s) in flight, grace %d ms", n0, grace_ms);
    while (atomic_load(&r->active_jobs) > 0 && mono_s() < until) usleep(20000);
    int left = atomic_load(&r->active_jobs);
    if (left) BT_WARN("router", "grace of %d ms over: cancelling %d request(s)", grace_ms, left);
    else BT_INFO("router", "drained %d request(s) in %.2f s", n0, mono_s() - t0);
}
