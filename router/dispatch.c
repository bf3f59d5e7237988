/* Decode-node choice, Decode/Run and migration (DESIGN 3, 7).
 *
 * Choice: among decode nodes in the etcd view not already failed for this request, two picked at random (power of
 * two choices, so that many routers reading the same stale load do not herd onto one node); the one with more KV
 * headroom and fewer running sequences wins. Running counts add this router's own in-flight calls, which are more
 * recent than the node's last load report. Migration: when a stream fails before its end, the choice is run again
 * without that node and the new call carries the prompt plus every token already delivered, so the node continues
 * exactly after them; responses are placed by their offset, so nothing is delivered twice or skipped. */
#include "router/router.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define MAX_TRACKED 256
#define POLL_MS 50

typedef struct node_slot {
    char node_id[MBR_NODE_ID_MAX];
    char grpc_addr[128];
    int64_t started_ms;
    bt_rpc_channel_t *ch;
    int inflight;
} node_slot_t;

struct rtr_dispatch {
    mbr_watcher_t *watcher;
    char fingerprint[32];    /* the router's model; "" = accept any */
    int max_migrations;
    metrics_counter_t *migrations;
    pthread_mutex_t mu;
    node_slot_t slots[MAX_TRACKED]; /* channels and in-flight counts by node (a restarted node gets a new slot) */
    int n_slots;
    uint64_t rng;
};

bt_status rtr_dispatch_create(const rtr_dispatch_config_t *cfg, rtr_dispatch_t **out)
{
    rtr_dispatch_t *d = calloc(1, sizeof *d);
    if (!d) return bt_fail(BT_ERR_NOMEM, "out of memory");
    d->max_migrations = cfg->max_migrations > 0 ? cfg->max_migrations : RTR_DEFAULT_MIGRATIONS;
    snprintf(d->fingerprint, sizeof d->fingerprint, "%s", cfg->fingerprint ? cfg->fingerprint : "");
    d->migrations = cfg->migrations;
    pthread_mutex_init(&d->mu, NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    d->rng = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec;
    bt_status st = mbr_watcher_create(cfg->etcd, cfg->cluster, NULL, &d->watcher);
    if (st) {
        pthread_mutex_destroy(&d->mu);
        free(d);
        return st;
    }
    *out = d;
    return BT_OK;
}

void rtr_dispatch_destroy(rtr_dispatch_t *d)
{
    if (!d) return;
    mbr_watcher_destroy(d->watcher);
    for (int i = 0; i < d->n_slots; i++) bt_rpc_channel_destroy(d->slots[i].ch);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

bt_status rtr_dispatch_wait_synced(rtr_dispatch_t *d, int timeout_ms)
{
    return mbr_watcher_wait_synced(d->watcher, timeout_ms);
}

/* A decode node with an address, serving the router's model (a node of another model is never routed to). */
static int usable(const rtr_dispatch_t *d, const mbr_node_t *n)
{
    return n->info.role == MBR_ROLE_DECODE && n->info.grpc_addr[0] &&
           (!d->fingerprint[0] || !strcasecmp(n->info.model, d->fingerprint));
}

int rtr_dispatch_n_healthy(rtr_dispatch_t *d)
{
    mbr_node_t *nodes;
    size_t n;
    if (mbr_watcher_snapshot(d->watcher, &nodes, &n)) return 0;
    int k = 0;
    for (size_t i = 0; i < n; i++) k += usable(d, &nodes[i]);
    mbr_nodes_free(nodes, n);
    return k;
}

/* Slot of a node, created on first use; under d->mu. NULL when the table is full of live calls. */
static node_slot_t *slot_get(rtr_dispatch_t *d, const mbr_node_info_t *info)
{
    for (int i = 0; i < d->n_slots; i++) {
        node_slot_t *s = &d->slots[i];
        if (!strcmp(s->node_id, info->node_id) && !strcmp(s->grpc_addr, info->grpc_addr) &&
            s->started_ms == info->started_ms)
            return s;
    }
    node_slot_t *s = NULL;
    if (d->n_slots < MAX_TRACKED) {
        s = &d->slots[d->n_slots++];
    } else {
        for (int i = 0; i < d->n_slots && !s; i++)
            if (!d->slots[i].inflight) s = &d->slots[i];
        if (!s) return NULL;
        bt_rpc_channel_destroy(s->ch);
    }
    memset(s, 0, sizeof *s);
    snprintf(s->node_id, sizeof s->node_id, "%s", info->node_id);
    snprintf(s->grpc_addr, sizeof s->grpc_addr, "%s", info->grpc_addr);
    s->started_ms = info->started_ms;
    bt_rpc_channel_config_t cc = {.target = info->grpc_addr, .keepalive_ms = 10000};
    if (bt_rpc_channel_create(&cc, &s->ch)) {
        d->n_slots--;
        return NULL;
    }
    return s;
}

static int inflight_of(rtr_dispatch_t *d, const mbr_node_info_t *info)
{
    for (int i = 0; i < d->n_slots; i++)
        if (!strcmp(d->slots[i].node_id, info->node_id) && d->slots[i].started_ms == info->started_ms)
            return d->slots[i].inflight;
    return 0;
}

/* Higher is better: free fraction of the KV pool minus the busy fraction of the batch. */
static double score(rtr_dispatch_t *d, const mbr_node_t *n)
{
    double total = (double)(n->has_load && n->load.kv_blocks_total ? n->load.kv_blocks_total : n->info.kv_blocks_total);
    double free_blocks = n->has_load ? (double)n->load.kv_blocks_free : total;
    double headroom = total > 0 ? free_blocks / total : 1.0;
    int64_t running = n->has_load ? n->load.running_seqs + n->load.queued_requests : 0;
    int local = inflight_of(d, &n->info);
    if (local > running) running = local;
    double cap = n->info.max_running > 0 ? (double)n->info.max_running : 64.0;
    return headroom - (double)running / cap;
}

static uint64_t next_rand(rtr_dispatch_t *d)
{
    d->rng ^= d->rng << 13;
    d->rng ^= d->rng >> 7;
    d->rng ^= d->rng << 17;
    return d->rng;
}

typedef struct picked {
    node_slot_t *slot;
    char fingerprint[128];
} picked_t;

static int excluded(char (*ex)[MBR_NODE_ID_MAX], int n_ex, const char *id)
{
    for (int i = 0; i < n_ex; i++)
        if (!strcmp(ex[i], id)) return 1;
    return 0;
}

/* Picks a node and counts the call in flight on it. BT_ERR_UNAVAILABLE when none is left. */
static bt_status pick(rtr_dispatch_t *d, char (*ex)[MBR_NODE_ID_MAX], int n_ex, picked_t *out)
{
    mbr_node_t *nodes;
    size_t n;
    bt_status st = mbr_watcher_snapshot(d->watcher, &nodes, &n);
    if (st) return st;
    size_t idx[MAX_TRACKED];
    size_t k = 0;
    for (size_t i = 0; i < n && k < MAX_TRACKED; i++)
        if (usable(d, &nodes[i]) && !excluded(ex, n_ex, nodes[i].info.node_id)) idx[k++] = i;
    if (!k) {
        mbr_nodes_free(nodes, n);
        return bt_fail(BT_ERR_UNAVAILABLE, "no healthy decode node");
    }
    pthread_mutex_lock(&d->mu);
    size_t a = idx[next_rand(d) % k], b = a;
    if (k > 1) {
        size_t j = next_rand(d) % (k - 1);
        b = idx[j];
        if (b == a) b = idx[k - 1];
        if (score(d, &nodes[b]) > score(d, &nodes[a])) a = b;
    }
    node_slot_t *s = slot_get(d, &nodes[a].info);
    if (s) s->inflight++;
    pthread_mutex_unlock(&d->mu);
    if (s) {
        out->slot = s;
        snprintf(out->fingerprint, sizeof out->fingerprint, "%s", nodes[a].info.model);
    }
    mbr_nodes_free(nodes, n);
    return s ? BT_OK : bt_fail(BT_ERR_NOMEM, "cannot open a channel to a decode node");
}

static void unpick(rtr_dispatch_t *d, picked_t *p)
{
    pthread_mutex_lock(&d->mu);
    p->slot->inflight--;
    pthread_mutex_unlock(&d->mu);
}

/* Codes after which another node may do better: the node died, restarted, shed the request or serves another
 * model (FAILED_PRECONDITION: fingerprint mismatch). */
static int retryable(bt_rpc_code c)
{
    return c == BT_RPC_UNAVAILABLE || c == BT_RPC_FAILED_PRECONDITION || c == BT_RPC_INTERNAL ||
           c == BT_RPC_UNKNOWN || c == BT_RPC_ABORTED || c == BT_RPC_CANCELLED || c == BT_RPC_RESOURCE_EXHAUSTED ||
           c == BT_RPC_DATA_LOSS;
}

bt_status rtr_dispatch_run(rtr_dispatch_t *d, const Baton__V1__DecodeRunRequest *tmpl, const rtr_run_ops_t *ops,
                           rtr_run_result_t *res)
{
    memset(res, 0, sizeof *res);
    char ex[8][MBR_NODE_ID_MAX];
    int n_ex = 0;
    int32_t *done = NULL; /* tokens delivered so far */
    size_t n_done = 0, cap_done = 0;
    bt_status ret = BT_OK;
    for (int attempt = 0;; attempt++) {
        picked_t p;
        bt_status st = pick(d, ex, n_ex, &p);
        if (st) {
            res->code = BT_RPC_UNAVAILABLE;
            snprintf(res->message, sizeof res->message, "%s", n_ex ? "no healthy decode node left" : bt_last_error());
            ret = BT_ERR_UNAVAILABLE;
            break;
        }
        if (attempt > 0) {
            res->migrations++;
            metrics_counter_inc(d->migrations);
            BT_INFO("router", "request %s: continuing on node %s after %zu tokens (attempt %d)", tmpl->request_id,
                    p.slot->node_id, n_done, attempt + 1);
        }
        Baton__V1__DecodeRunRequest req = *tmpl;
        req.model_fingerprint = p.fingerprint;
        req.generated_token_ids = done;
        req.n_generated_token_ids = n_done;
        bt_rpc_stream_t *s = NULL;
        st = bt_rpc_stream_open(p.slot->ch, "/baton.v1.Decode/Run", &req.base,
                                &baton__v1__decode_run_response__descriptor, 0, NULL, &s);
        if (st) {
            unpick(d, &p);
            res->code = BT_RPC_INTERNAL;
            snprintf(res->message, sizeof res->message, "%s", bt_last_error());
            ret = st;
            break;
        }
        int finished = 0, stopped = 0, cancelled = 0;
        bt_rpc_result_t rr = {0};
        for (;;) {
            if (ops->cancelled && ops->cancelled(ops->ud)) {
                cancelled = 1;
                break;
            }
            ProtobufCMessage *m = NULL;
            int ready = 0;
            st = bt_rpc_stream_next_wait(s, POLL_MS, &m, &ready);
            if (st == BT_OK && !ready) continue;
            if (st != BT_OK || !m) {
                bt_rpc_stream_result(s, &rr);
                if (st == BT_OK && !finished) { /* ended OK without a finish reason: treat as a stop */
                    res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_STOP;
                    finished = 1;
                }
                if (st != BT_OK && rr.code == BT_RPC_OK) rr.code = bt_rpc_code_from_status(st);
                break;
            }
            Baton__V1__DecodeRunResponse *r = (Baton__V1__DecodeRunResponse *)m;
            size_t off = r->offset;
            /* skip what was already delivered; a gap cannot be filled: treat it as a failure of this node */
            if (off > n_done) {
                protobuf_c_message_free_unpacked(m, NULL);
                rr.code = BT_RPC_DATA_LOSS;
                snprintf(rr.message, sizeof rr.message, "node skipped tokens %zu..%zu", n_done, off);
                st = BT_ERR_PEER;
                break;
            }
            size_t skip = n_done - off;
            if (skip < r->n_token_ids) {
                size_t nn = r->n_token_ids - skip;
                if (n_done + nn > cap_done) {
                    size_t c = cap_done ? cap_done * 2 : 256;
                    while (c < n_done + nn) c *= 2;
                    int32_t *q = realloc(done, c * sizeof *q);
                    if (!q) {
                        protobuf_c_message_free_unpacked(m, NULL);
                        ret = bt_fail(BT_ERR_NOMEM, "out of memory");
                        cancelled = 1;
                        break;
                    }
                    done = q;
                    cap_done = c;
                }
                memcpy(done + n_done, r->token_ids + skip, nn * sizeof *done);
                n_done += nn;
                Baton__V1__TokenLogprob *const *lps = r->n_logprobs > skip ? r->logprobs + skip : NULL;
                size_t n_lps = r->n_logprobs > skip ? r->n_logprobs - skip : 0;
                if (ops->on_tokens(ops->ud, r->token_ids + skip, nn, lps, n_lps)) stopped = 1;
            }
            if (r->finish_reason != BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) {
                res->finish = r->finish_reason;
                if (r->usage) res->cached_prompt_tokens = r->usage->cached_prompt_tokens;
                finished = 1;
            }
            protobuf_c_message_free_unpacked(m, NULL);
            if (stopped || finished) break;
        }
        if (stopped || cancelled || (!finished && st == BT_OK)) bt_rpc_stream_cancel(s);
        bt_rpc_stream_close(s);
        unpick(d, &p);
        if (stopped) {
            res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
            break;
        }
        if (cancelled) {
            if (ret == BT_OK) ret = bt_fail(BT_ERR_CANCELLED, "client went away");
            res->code = BT_RPC_CANCELLED;
            break;
        }
        if (finished) break;
        if (tmpl->max_tokens && n_done >= tmpl->max_tokens) { /* it died after the last token: nothing left to do */
            res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH;
            break;
        }
        BT_WARN("router", "request %s: decode node %s failed after %zu tokens: %s %s", tmpl->request_id,
                p.slot->node_id, n_done, bt_rpc_code_str(rr.code), rr.message);
        res->code = rr.code;
        snprintf(res->message, sizeof res->message, "decode node %.60s: %.180s", p.slot->node_id, rr.message);
        if (!retryable(rr.code) || attempt >= d->max_migrations) {
            ret = bt_rpc_status_from_code(rr.code);
            if (ret == BT_OK) ret = BT_ERR_PEER;
            break;
        }
        if (n_ex < 8) snprintf(ex[n_ex++], MBR_NODE_ID_MAX, "%s", p.slot->node_id);
    }
    if (ret == BT_OK) {
        res->code = BT_RPC_OK;
        res->message[0] = '\0';
    }
    free(done);
    return ret;
}
