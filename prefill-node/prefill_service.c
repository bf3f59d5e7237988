/* baton.v1.Prefill over the engine scheduler and kvtransfer (see prefill_service.h).
 *
 * A Run call becomes a pf_call. Threads that touch it: the RPC thread (validation, submit), the engine thread (the
 * export hooks, which create the push and post each layer, and the final event), kvtransfer's progress thread (the
 * push's completion) and the service's finisher thread, which answers the call once both the final event and the
 * push's completion are in, releases the held KV blocks and frees the call. The finisher exists so that neither
 * the engine thread nor the progress thread ever waits on the network or on gRPC. */
#include "prefill-node/prefill_service.h"

#include "baton/v1/node.pb-c.h"
#include "common/log.h"
#include "node/calls.h"
#include "node/node_engine.h"
#include "node/peer_check.h"
#include "engine/kv_pool.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define PF_LOG "prefill"
#define PF_DEFAULT_TRANSFER_MS 30000 /* DESIGN 3: KV transfer deadline when the call has none */

typedef struct pf_call pf_call;

enum { PS_OK, PS_TRANSFER_FAILED, PS_CANCELLED, PS_TIMEOUT, PS_ERROR, PS_INVALID, PS_REJECTED, PS_N };
static const char *const PS_NAMES[PS_N] = {"ok", "transfer_failed", "cancelled", "timeout",
                                           "error", "invalid", "rejected"};

struct prefill_service {
    char node_id[MBR_NODE_ID_MAX];
    mbr_watcher_t *members; /* which decode nodes may receive KV (node/peer_check.h); NULL: none */
    bt_ne_t *ne;
    bt_calls_t calls;
    bt_kv_export export_hooks;

    pthread_mutex_t mu; /* the finisher queue */
    pthread_cond_t cv;
    pf_call *done_head, *done_tail;
    int stop;
    pthread_t finisher;
    int finisher_running;

    metrics_counter_t *xfer_bytes, *prompt_tokens, *cached_tokens;
    metrics_counter_t *xfer_descriptors[KVX_PATH_AM + 1]; /* by the data path the peer used (AUTO unused) */
    metrics_histogram_t *xfer_seconds, *prefill_seconds, *queue_time;
    metrics_counter_t *requests[PS_N];

    pthread_mutex_t bw_mu;
    double bw; /* EWMA of bytes / transfer second */
};

struct pf_call {
    bt_call_t base; /* first (calls.h); its mu also guards the fields marked "under mu" */
    prefill_service_t *svc;
    char dest_node[MBR_NODE_ID_MAX];
    uint64_t epoch;
    uint32_t *dst_blocks;       /* [n_prompt_blocks] */
    uint32_t n_dst, skip;
    uint32_t *ldst_blocks;      /* [n_dst - lfirst] the sliding-window layers' destination (NULL: none) */
    uint32_t lfirst;
    uint32_t push_flags;
    int timeout_ms;
    kvx_peer_t *peer;
    int32_t n_prompt;
    int logprobs;
    double t_arrive, t_done;

    /* engine thread, then (after both ends) the finisher */
    kvx_push_t *push;
    int push_failed_early;      /* creating the push failed: message in err */
    int layer_failed;
    bt_status layer_status;     /* why posting a layer failed (the push's own status); message in err */
    double t_begin, t_last_layer; /* push created; last layer posted (monotonic seconds) */
    uint32_t n_layers;
    char err[256];
    int32_t token;
    bt_sample_out so;
    bt_end_reason finish;
    bt_status finish_error;
    int32_t n_cached;
    double queue_s;

    /* under mu */
    int token_done, push_running;
    bt_status push_status;
    pf_call *next_done;
};

static void call_free(bt_call_t *base)
{
    pf_call *c = (pf_call *)base;
    kvx_peer_release(c->peer);
    free(c->dst_blocks);
    free(c->ldst_blocks);
    free(c);
}

/* Hands c to the finisher. Called exactly once per call, by whichever of (final event, push completion) is last. */
static void to_finisher(pf_call *c)
{
    prefill_service_t *s = c->svc;
    pthread_mutex_lock(&s->mu);
    c->next_done = NULL;
    if (s->done_tail) s->done_tail->next_done = c;
    else s->done_head = c;
    s->done_tail = c;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* kvtransfer progress thread: the decode node acknowledged the blocks (or the push failed). */
static void on_push_done(kvx_push_t *push, bt_status st, void *arg)
{
    (void)push;
    pf_call *c = arg;
    pthread_mutex_lock(&c->base.mu);
    c->push_status = st;
    c->push_running = 0;
    int ready = c->token_done;
    pthread_mutex_unlock(&c->base.mu);
    if (ready) to_finisher(c);
}

/* ---- export hooks (engine thread) ---- */

static int export_begin(void *user, const int32_t *blocks, int32_t n_blocks, const int32_t *local_blocks)
{
    pf_call *c = user;
    prefill_service_t *s = c->svc;
    if ((uint32_t)n_blocks != c->n_dst || !local_blocks != !c->ldst_blocks) {
        snprintf(c->err, sizeof c->err, "prompt has %d blocks%s, destination names %u%s", n_blocks,
                 local_blocks ? " with local-layer blocks" : "", c->n_dst, c->ldst_blocks ? " with local-layer blocks" : "");
        c->push_failed_early = 1;
        return 1;
    }
    uint32_t n = c->n_dst - c->skip, nl = c->ldst_blocks ? c->n_dst - c->lfirst : 0;
    uint32_t *src = malloc(sizeof(uint32_t) * (n + nl ? n + nl : 1));
    if (!src) {
        snprintf(c->err, sizeof c->err, "out of memory planning the KV transfer");
        c->push_failed_early = 1;
        return 1;
    }
    for (uint32_t i = 0; i < n; i++) src[i] = (uint32_t)blocks[c->skip + i];
    for (uint32_t i = 0; i < nl; i++) {
        int32_t b = local_blocks[c->lfirst + i];
        if (b < 0) { /* the window this node kept starts later than the decode node asked */
            snprintf(c->err, sizeof c->err, "local-layer block %u was released here before the transfer",
                     c->lfirst + i);
            c->push_failed_early = 1;
            free(src);
            return 1;
        }
        src[n + i] = (uint32_t)b;
    }
    kvx_push_args_t a = {.src_blocks = src, .dst_blocks = c->dst_blocks + c->skip, .n_blocks = n,
                         .epoch = c->epoch, .flags = c->push_flags, .timeout_ms = (uint32_t)c->timeout_ms,
                         .cb = on_push_done, .cb_arg = c};
    if (nl) {
        a.layer_group = s->ne->kv_layer_group;
        a.local_src_blocks = src + n;
        a.local_dst_blocks = c->ldst_blocks;
        a.n_local_blocks = nl;
    }
    pthread_mutex_lock(&c->base.mu);
    c->push_running = 1;
    pthread_mutex_unlock(&c->base.mu);
    c->t_begin = bt_sched_now();
    c->n_layers = s->ne->layout.n_layers;
    bt_status st = kvx_push_create(s->ne->kvx_pool, c->peer, &a, &c->push);
    free(src);
    if (st != BT_OK) {
        pthread_mutex_lock(&c->base.mu);
        c->push_running = 0;
        pthread_mutex_unlock(&c->base.mu);
        c->push = NULL;
        snprintf(c->err, sizeof c->err, "cannot start the KV transfer to %s: %s", c->dest_node, bt_last_error());
        c->push_failed_early = 1;
        return 1;
    }
    return 0;
}

static void export_layer(void *user, int32_t layer)
{
    pf_call *c = user;
    if (c->layer_failed || !c->push) return;
    if (atomic_load(&c->base.abort_pending)) { /* the decode node gave up: no byte more into its blocks */
        c->layer_failed = 1;
        return;
    }
    bt_status st = kvx_push_layer(c->push, (uint32_t)layer);
    if (st != BT_OK) { /* e.g. the receiver refused the claim: nothing was written */
        c->layer_failed = 1;
        c->layer_status = st;
        snprintf(c->err, sizeof c->err, "%s", bt_last_error());
    }
    if ((uint32_t)layer + 1 == c->n_layers) c->t_last_layer = bt_sched_now();
}

/* Engine thread: the request's only token, or its end without one. */
static void on_event(void *user, const bt_sched_event *ev)
{
    pf_call *c = user;
    if (ev->token >= 0) {
        c->token = ev->token;
        if (ev->detail) c->so = *ev->detail;
        c->so.id = ev->token;
        c->so.logprob = ev->detail ? ev->detail->logprob : ev->logprob;
        c->n_cached = ev->n_cached;
        c->queue_s = ev->queue_s;
    }
    if (ev->finish == BT_END_NONE) return; /* max_tokens 1: the token event is the final one */
    c->finish = ev->finish;
    c->finish_error = ev->error;
    c->t_done = bt_sched_now();
    bt_calls_prefilled(&c->svc->calls, c->n_prompt);
    if (c->push && (ev->token < 0 || c->layer_failed)) {
        /* ended without its token (abort, deadline, error) or with layers left unposted after the push started:
         * stop it; the decode node's expectation then times out or is dropped by its own error path */
        kvx_push_destroy(c->push);
        c->push = NULL;
        pthread_mutex_lock(&c->base.mu);
        c->push_running = 0;
        c->push_status = c->layer_status ? c->layer_status : BT_ERR_CANCELLED;
        pthread_mutex_unlock(&c->base.mu);
    }
    pthread_mutex_lock(&c->base.mu);
    c->token_done = 1;
    int ready = !c->push_running;
    pthread_mutex_unlock(&c->base.mu);
    if (ready) to_finisher(c);
}

/* ---- finisher thread ---- */

/* How the call ended, for the decode node: the status code (msg says why when not OK) and the outcome label *ps. */
static bt_rpc_code answer_status(pf_call *c, char *msg, size_t cap, int *ps)
{
    if (c->finish == BT_END_ABORT || atomic_load(&c->base.abort_pending)) {
        *ps = PS_CANCELLED;
        snprintf(msg, cap, "prefill of %s cancelled", c->base.request_id);
        return BT_RPC_CANCELLED;
    }
    if (c->finish == BT_END_TIMEOUT) {
        *ps = PS_TIMEOUT;
        snprintf(msg, cap, "deadline exceeded before the prefill of %s finished", c->base.request_id);
        return BT_RPC_DEADLINE_EXCEEDED;
    }
    if (c->finish == BT_END_ERROR) {
        *ps = PS_ERROR;
        snprintf(msg, cap, "engine step failed: %s", bt_status_str(c->finish_error));
        return BT_RPC_INTERNAL;
    }
    if (c->push_failed_early) {
        *ps = PS_TRANSFER_FAILED;
        snprintf(msg, cap, "%s", c->err);
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (!c->push || c->push_status != BT_OK) {
        *ps = PS_TRANSFER_FAILED;
        snprintf(msg, cap, "KV transfer to %s failed: %s: %s", c->dest_node, bt_status_str(c->push_status),
                 c->push ? kvx_push_error(c->push) : c->err[0] ? c->err : "no transfer");
        return c->push_status == BT_ERR_TIMEOUT ? BT_RPC_DEADLINE_EXCEEDED : BT_RPC_UNAVAILABLE;
    }
    *ps = PS_OK;
    return BT_RPC_OK;
}

/* The reply: the first token with its logprobs when asked, the epoch, the cached tokens and the bytes moved. */
static void send_reply(pf_call *c, uint64_t bytes)
{
    Baton__V1__PrefillRunResponse r = BATON__V1__PREFILL_RUN_RESPONSE__INIT;
    Baton__V1__TokenLogprob lp = BATON__V1__TOKEN_LOGPROB__INIT;
    Baton__V1__TopLogprob top[BT_MAX_TOP_LOGPROBS];
    Baton__V1__TopLogprob *topp[BT_MAX_TOP_LOGPROBS];
    r.first_token_id = c->token;
    if (c->logprobs) {
        lp.token_id = c->token;
        lp.logprob = c->so.logprob;
        int32_t nt = c->so.n_top < BT_MAX_TOP_LOGPROBS ? c->so.n_top : BT_MAX_TOP_LOGPROBS;
        for (int32_t i = 0; i < nt; i++) {
            baton__v1__top_logprob__init(&top[i]);
            top[i].token_id = c->so.top[i].id;
            top[i].logprob = c->so.top[i].logprob;
            topp[i] = &top[i];
        }
        lp.n_top = (size_t)(nt > 0 ? nt : 0);
        lp.top = topp;
        r.first_logprob = &lp;
    }
    r.epoch = c->epoch;
    r.cached_prompt_tokens = (uint32_t)c->n_cached;
    r.transfer_bytes = bytes;
    bt_rpc_call_send(c->base.rpc, &r.base);
}

/* A served prefill in the metrics, the bandwidth estimate of load reports and the debug log. */
static void record_served(pf_call *c, uint64_t bytes)
{
    prefill_service_t *s = c->svc;
    /* Layers stream while the step computes; what the request waits for is the tail from the last layer's post to
     * the decode node's acknowledgement. The whole span is logged beside it. */
    double span = (double)kvx_push_elapsed_ns(c->push) * 1e-9;
    double secs = c->t_begin + span - c->t_last_layer;
    if (secs < 0) secs = 0;
    metrics_counter_add(s->xfer_bytes, bytes);
    metrics_counter_t *desc = s->xfer_descriptors[kvx_peer_data_path(c->peer)];
    if (desc) metrics_counter_add(desc, kvx_push_puts(c->push));
    metrics_histogram_observe(s->xfer_seconds, secs);
    metrics_counter_add(s->prompt_tokens, (uint64_t)c->n_prompt);
    metrics_counter_add(s->cached_tokens, (uint64_t)c->n_cached);
    metrics_histogram_observe(s->queue_time, c->queue_s);
    metrics_histogram_observe(s->prefill_seconds, c->t_done - c->t_arrive);
    if (span > 0 && bytes > 0) {
        pthread_mutex_lock(&s->bw_mu);
        /* bandwidth over the exposed tail plus the last layer's share of the span: a conservative estimate of the
         * path's speed for the router's transfer-time term */
        double v = (double)bytes / (secs + span / c->n_layers);
        s->bw = s->bw > 0 ? 0.8 * s->bw + 0.2 * v : v;
        pthread_mutex_unlock(&s->bw_mu);
    }
    BT_DEBUG(PF_LOG,
             "request %s: %d prompt tokens (%d cached) -> %s epoch %" PRIu64 ": %u blocks (%u of them in the "
             "sliding-window layers), %" PRIu64
             " bytes in %zu descriptors, prefill %.3f s, transfer %.3f s after the last layer (%.3f s streamed)",
             c->base.request_id, c->n_prompt, c->n_cached, c->dest_node, c->epoch, c->n_dst - c->skip,
             c->ldst_blocks ? c->n_dst - c->lfirst : c->n_dst - c->skip, bytes,
             kvx_push_puts(c->push), c->t_done - c->t_arrive, secs, span);
}

/* Finisher thread: answers the call once the token and the transfer are both in. */
static void answer(pf_call *c)
{
    prefill_service_t *s = c->svc;
    char msg[400] = "";
    int ps;
    uint64_t bytes = 0;
    if (c->push) bytes = kvx_push_bytes(c->push);
    bt_rpc_code code = answer_status(c, msg, sizeof msg, &ps);
    if (code == BT_RPC_OK) {
        send_reply(c, bytes);
        record_served(c, bytes);
    } else if (ps != PS_CANCELLED) {
        BT_WARN(PF_LOG, "request %s: %s", c->base.request_id, msg);
    }
    metrics_counter_inc(s->requests[ps]);
    bt_call_finish(&c->base, code, code == BT_RPC_OK ? NULL : msg);
}

static void *finisher_main(void *arg)
{
    prefill_service_t *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->done_head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        pf_call *c = s->done_head;
        if (!c) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        s->done_head = c->next_done;
        if (!s->done_head) s->done_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        uint64_t id = atomic_load(&c->base.sched_id);
        answer(c);
        /* the blocks were held while the transfer could read them: free them only now */
        if (c->push) kvx_push_destroy(c->push);
        c->push = NULL;
        if (id) bt_sched_release_kv(s->ne->sched, id);
        bt_call_done(&c->base);
    }
    return NULL;
}

/* ---- Run ---- */

/* KV goes only into a pool its owner registered: the destination must be a decode node of this cluster serving our
 * model, and the descriptor must be the one it published, byte for byte. */
static bt_rpc_code check_destination(prefill_service_t *s, const Baton__V1__KvDestination *d, char *err, size_t cap)
{
    char why[256];
    mbr_node_t rec;
    if (bt_peer_lookup(s->members, d->decode_node_id, MBR_ROLE_DECODE, s->ne->fingerprint, &rec, why, sizeof why)) {
        snprintf(err, cap, "destination refused: %s", why);
        return BT_RPC_PERMISSION_DENIED;
    }
    int same = bt_peer_desc_matches(&rec, d->pool_descriptor.data, d->pool_descriptor.len);
    mbr_node_info_free(&rec.info);
    if (!same) {
        snprintf(err, cap, "destination refused: destination.pool_descriptor is not the KV pool decode node '%.64s' "
                 "registered", d->decode_node_id);
        return BT_RPC_PERMISSION_DENIED;
    }
    return BT_RPC_OK;
}

/* Under mutual TLS the caller must be the destination itself: a decode node asks for KV only into its own pool. (Without
 * mTLS nobody is verified; the random epoch and the claim before any write still keep a forged destination's pool
 * untouched, see kvtransfer/kvx.h.) */
static bt_rpc_code check_caller(bt_rpc_call_t *call, const Baton__V1__KvDestination *d, char *err, size_t cap)
{
    char who[128];
    if (bt_rpc_call_peer_identity(call, who, sizeof who) != BT_OK) return BT_RPC_OK; /* no mTLS here */
    if (bt_rpc_call_peer_has_identity(call, d->decode_node_id)) return BT_RPC_OK;
    snprintf(err, cap, "destination refused: the caller's certificate names '%.64s', not decode node '%.64s'", who,
             d->decode_node_id);
    return BT_RPC_PERMISSION_DENIED;
}

bt_rpc_code prefill_check_request(const bt_ne_t *ne, const Baton__V1__PrefillRunRequest *q, bt_req_params *rp,
                                  char *err, size_t cap)
{
    if (q->model_fingerprint[0] && strcasecmp(q->model_fingerprint, ne->fingerprint) != 0) {
        snprintf(err, cap, "model_fingerprint %.32s does not match this node's model %s (%s)", q->model_fingerprint,
                 ne->fingerprint, ne->m->name);
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (q->n_prompt_token_ids == 0) {
        snprintf(err, cap, "prompt_token_ids is empty");
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (q->n_prompt_token_ids >= (size_t)ne->max_context) {
        snprintf(err, cap, "prompt of %zu tokens exceeds the context of %d tokens", q->n_prompt_token_ids,
                 ne->max_context);
        return BT_RPC_INVALID_ARGUMENT;
    }
    for (size_t i = 0; i < q->n_prompt_token_ids; i++)
        if (q->prompt_token_ids[i] < 0 || q->prompt_token_ids[i] >= ne->n_vocab) {
            snprintf(err, cap, "prompt_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
                     q->prompt_token_ids[i], ne->n_vocab);
            return BT_RPC_INVALID_ARGUMENT;
        }
    const Baton__V1__KvDestination *d = q->destination;
    if (!d) {
        snprintf(err, cap, "destination is missing");
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (!d->decode_node_id[0] || strlen(d->decode_node_id) >= MBR_NODE_ID_MAX) {
        snprintf(err, cap, "destination.decode_node_id is empty or too long");
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (d->layout_fingerprint != ne->layout.fingerprint) {
        snprintf(err, cap, "destination.layout_fingerprint %016" PRIx64 " differs from this node's KV layout %016" PRIx64
                 " (model, KV dtype, block size, heads, head_dim or layers differ)",
                 d->layout_fingerprint, ne->layout.fingerprint);
        return BT_RPC_FAILED_PRECONDITION;
    }
    size_t n_blocks = (q->n_prompt_token_ids + BT_KV_BLOCK - 1) / BT_KV_BLOCK;
    if (d->n_block_ids != n_blocks) {
        snprintf(err, cap, "destination.block_ids has %zu entries; a prompt of %zu tokens needs %zu", d->n_block_ids,
                 q->n_prompt_token_ids, n_blocks);
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (d->skip_blocks >= n_blocks) {
        snprintf(err, cap, "destination.skip_blocks %u leaves nothing to transfer (%zu blocks)", d->skip_blocks,
                 n_blocks);
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (d->pool_descriptor.len == 0) {
        snprintf(err, cap, "destination.pool_descriptor is empty");
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (ne->kv_window > 0 && d->n_local_block_ids == 0) {
        snprintf(err, cap, "destination.local_block_ids is empty: this node keeps sliding-window layers' KV in their "
                 "own block space and needs the decode node's blocks for them");
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (ne->kv_window <= 0 && d->n_local_block_ids) {
        snprintf(err, cap, "destination.local_block_ids given, but this node has no separate sliding-window block "
                 "space");
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (d->n_local_block_ids) {
        /* the window this node still holds after prefilling: from the block of position n_prompt - window on */
        size_t held = ne->kv_window > 0 && q->n_prompt_token_ids > (size_t)ne->kv_window
                          ? (q->n_prompt_token_ids - (size_t)ne->kv_window) / BT_KV_BLOCK
                          : 0;
        if (d->local_first_block >= n_blocks || d->local_first_block < held ||
            d->n_local_block_ids != n_blocks - d->local_first_block) {
            snprintf(err, cap, "destination.local_block_ids has %zu entries from block %u; a prompt of %zu tokens "
                     "with a %d-token window needs blocks %zu.. (%zu blocks)", d->n_local_block_ids,
                     d->local_first_block, q->n_prompt_token_ids, ne->kv_window, held, n_blocks);
            return BT_RPC_INVALID_ARGUMENT;
        }
    }
    bt_sampling *sp = &rp->sampling;
    if (bt_ne_sampling_from_proto(ne, q->sampling, q->logprobs, q->top_logprobs, q->sample_index,
                                  bt_ne_random_seed(), sp, err, cap))
        return BT_RPC_INVALID_ARGUMENT;
    rp->sample_index = (int32_t)q->sample_index;
    sp->max_tokens = 1;
    sp->ignore_eos = 1; /* stop rules are the decode node's business; the first token is sampled the same */
    rp->hold_kv = 1;
    /* last: the reference is the caller's to drop once this returned OK */
    if (bt_ne_constraint(ne, q->grammar, &rp->constraint, err, cap)) return BT_RPC_INVALID_ARGUMENT;
    if (rp->constraint) sp->ignore_eos = q->ignore_eos; /* under a grammar it decides the mask: sample as D would */
    return BT_RPC_OK;
}

/* Validates q as prefill_check_request does, then its destination against the membership; fills rp. */
static bt_rpc_code check_request(prefill_service_t *s, const Baton__V1__PrefillRunRequest *q, bt_req_params *rp,
                                 char *err, size_t cap)
{
    bt_rpc_code code = prefill_check_request(s->ne, q, rp, err, cap);
    if (code == BT_RPC_OK) code = check_destination(s, q->destination, err, cap);
    rp->kv_export = &s->export_hooks;
    return code;
}

/* Builds the call of a checked request: its copy of the destination and a handle on the decode node's pool.
 * Returns the gRPC code for the client; err says why when it is not OK. */
static bt_rpc_code call_create(prefill_service_t *s, bt_rpc_call_t *call, const Baton__V1__PrefillRunRequest *q,
                               const char *rid, pf_call **out, char *err, size_t cap)
{
    const Baton__V1__KvDestination *d = q->destination;
    pf_call *c = calloc(1, sizeof *c);
    uint32_t *dst = malloc(sizeof(uint32_t) * d->n_block_ids);
    uint32_t *ldst = d->n_local_block_ids ? malloc(sizeof(uint32_t) * d->n_local_block_ids) : NULL;
    kvx_peer_t *peer = NULL;
    bt_status pst = BT_ERR_NOMEM;
    if (c && dst && (ldst || !d->n_local_block_ids)) pst = kvx_peer_get(s->ne->kvx, bt_ne_node_key(d->decode_node_id), d->pool_descriptor.data,
                                     d->pool_descriptor.len, &peer);
    if (pst != BT_OK) {
        snprintf(err, cap, "%s", pst == BT_ERR_NOMEM ? "out of memory" : bt_last_error());
        free(c);
        free(dst);
        free(ldst);
        return pst == BT_ERR_NOMEM    ? BT_RPC_RESOURCE_EXHAUSTED
               : pst == BT_ERR_FORMAT ? BT_RPC_INVALID_ARGUMENT
                                      : BT_RPC_UNAVAILABLE;
    }
    memcpy(dst, d->block_ids, sizeof(uint32_t) * d->n_block_ids);
    if (ldst) memcpy(ldst, d->local_block_ids, sizeof(uint32_t) * d->n_local_block_ids);
    bt_call_init(&c->base, &s->calls, call, rid, call_free);
    c->svc = s;
    snprintf(c->dest_node, sizeof c->dest_node, "%s", d->decode_node_id);
    c->epoch = d->epoch;
    c->dst_blocks = dst;
    c->n_dst = (uint32_t)d->n_block_ids;
    c->skip = d->skip_blocks;
    c->ldst_blocks = ldst;
    c->lfirst = d->local_first_block;
    c->push_flags = d->checksums ? KVX_F_CRC : 0;
    c->peer = peer;
    c->n_prompt = (int32_t)q->n_prompt_token_ids;
    c->logprobs = q->logprobs;
    c->token = -1;
    *out = c;
    return BT_RPC_OK;
}

/* Prefill/Run: check, admit, create the call, submit; the finisher answers it. */
static void run_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    prefill_service_t *s = ud;
    const Baton__V1__PrefillRunRequest *q = (const Baton__V1__PrefillRunRequest *)msg;
    double t_arrive = bt_sched_now();
    const char *rid = q->request_id[0] ? q->request_id : "-";
    char err[400];
    bt_req_params rp = bt_req_params_default();
    rp.sampling = bt_sampling_default();
    bt_rpc_code code = check_request(s, q, &rp, err, sizeof err);
    if (code == BT_RPC_OK) code = check_caller(call, q->destination, err, sizeof err);
    if (code != BT_RPC_OK) {
        bt_constraint_unref(rp.constraint);
        bt_calls_reject(&s->calls, call, code, rid, err);
        return;
    }
    rp.deadline = bt_call_deadline(call);
    int timeout_ms = bt_deadline_timeout_ms(rp.deadline, bt_sched_now(), PF_DEFAULT_TRANSFER_MS);
    if (timeout_ms > PF_DEFAULT_TRANSFER_MS) timeout_ms = PF_DEFAULT_TRANSFER_MS;
    if (!bt_calls_admit(&s->calls)) {
        snprintf(err, sizeof err, "prefill node %s is at capacity (%d requests in flight)", s->node_id,
                 s->calls.max_inflight);
        bt_constraint_unref(rp.constraint);
        bt_calls_reject(&s->calls, call, BT_RPC_RESOURCE_EXHAUSTED, rid, err);
        return;
    }
    pf_call *c = NULL;
    if ((code = call_create(s, call, q, rid, &c, err, sizeof err)) != BT_RPC_OK) {
        bt_constraint_unref(rp.constraint);
        bt_calls_leave(&s->calls);
        bt_calls_reject(&s->calls, call, code, rid, err);
        return;
    }
    c->timeout_ms = timeout_ms;
    c->t_arrive = t_arrive;
    bt_calls_submit(&s->calls, &c->base, q->prompt_token_ids, c->n_prompt, &rp, on_event, c->n_prompt);
    bt_constraint_unref(rp.constraint); /* the scheduler took its own */
}

/* ---- life cycle ---- */

static bt_status register_metrics(prefill_service_t *s, metrics_registry_t *reg)
{
    metrics_family_t *f;
    bt_status st;
    if ((st = metrics_std_counter(reg, METRICS_STD_KV_TRANSFER_BYTES, &s->xfer_bytes))) return st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_KV_TRANSFER_SECONDS, &s->xfer_seconds))) return st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_QUEUE_TIME, &s->queue_time))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_PROMPT_TOKENS, &s->prompt_tokens))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_PREFIX_CACHE_HITS, &s->cached_tokens))) return st;
    static const char *const path_label[] = {"path"};
    metrics_desc_t dd = {.name = "baton_kv_transfer_descriptors_total",
                         .help = "Contiguous ranges posted for KV transfers, by data path (mapped: copies into a "
                                 "mapped shared-memory pool; put: ucp_put_nbx, the RDMA path; am: active messages).",
                         .type = METRICS_COUNTER, .label_names = path_label, .n_labels = 1};
    if ((st = metrics_family_register(reg, &dd, &f))) return st;
    for (int k = KVX_PATH_MAPPED; k <= KVX_PATH_AM; k++) {
        const char *lv[1] = {kvx_data_path_name((kvx_data_path_t)k)};
        if ((st = metrics_family_counter(f, lv, &s->xfer_descriptors[k]))) return st;
    }
    if ((st = metrics_histogram_register(reg, "baton_prefill_seconds",
                                         "Time from a Prefill/Run call's arrival to its first token, in seconds.",
                                         NULL, 0, &s->prefill_seconds)))
        return st;
    if ((st = metrics_std_register(reg, METRICS_STD_REQUESTS, &f))) return st;
    for (int i = 0; i < PS_N; i++) {
        const char *lv[1] = {PS_NAMES[i]};
        if ((st = metrics_family_counter(f, lv, &s->requests[i]))) return st;
    }
    return BT_OK;
}

bt_status prefill_service_create(const prefill_config_t *cfg, prefill_service_t **out)
{
    if (!cfg || !cfg->model_path || !cfg->metrics || !cfg->rpc)
        return bt_fail(BT_ERR_INVALID, "prefill service: model path, metrics and rpc server are required");
    prefill_service_t *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory creating the prefill service");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->bw_mu, NULL);
    bt_calls_init(&s->calls, PREFILL_MAX_INFLIGHT, PF_LOG);
    snprintf(s->node_id, sizeof s->node_id, "%s", cfg->node_id ? cfg->node_id : "");
    s->members = cfg->members;
    s->export_hooks = (bt_kv_export){export_begin, export_layer};
    bt_status st;
    bt_ne_config_t nc = {.model_path = cfg->model_path, .name = PF_LOG, .threads = cfg->threads,
                         .kv_mem = cfg->kv_mem,
                         .max_batch_tokens = cfg->max_batch_tokens > 0 ? cfg->max_batch_tokens
                                                                       : PREFILL_DEFAULT_BATCH_TOKENS};
    if (cfg->env) nc.env = *cfg->env;
    if ((st = bt_ne_create(&nc, &s->ne))) goto fail;
    if (!s->ne->kvx_pool) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "a prefill node needs kvtransfer (UCX) to move KV to decode nodes");
        goto fail;
    }
    s->calls.sched = s->ne->sched;
    if ((st = register_metrics(s, cfg->metrics)) || (st = bt_ne_register_metrics(s->ne, cfg->metrics))) goto fail;
    s->calls.rejected = s->requests[PS_REJECTED];
    s->calls.invalid = s->requests[PS_INVALID];
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Prefill/Run", BT_RPC_UNARY,
                                       &baton__v1__prefill_run_request__descriptor, run_handler, s)))
        goto fail;
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Prefill/Abort", BT_RPC_UNARY,
                                       &baton__v1__abort_request__descriptor, bt_calls_abort_handler, &s->calls)))
        goto fail;
    if (pthread_create(&s->finisher, NULL, finisher_main, s) != 0) {
        st = bt_fail(BT_ERR_INTERNAL, "cannot start the prefill finisher thread");
        goto fail;
    }
    s->finisher_running = 1;
    *out = s;
    return BT_OK;
fail:
    prefill_service_destroy(s);
    return st;
}

bt_status prefill_service_node_info(const void *svc, mbr_node_info_t *info)
{
    const prefill_service_t *s = svc;
    return bt_ne_node_info(s->ne, MBR_ROLE_PREFILL, info);
}

void prefill_service_summary(const void *svc, char *buf, size_t cap)
{
    const prefill_service_t *s = svc;
    bt_ne_summary(s->ne, buf, cap);
}

int32_t prefill_service_inflight(const void *svc)
{
    const prefill_service_t *s = svc;
    return bt_calls_inflight(&s->calls);
}

void prefill_service_load(void *svc, mbr_load_report_t *out)
{
    prefill_service_t *s = svc;
    bt_sched_stats st;
    bt_ne_load(s->ne, out, &st);
    out->queued_prefill_tokens = bt_calls_queued_prefill_tokens(&s->calls);
    out->queued_requests = bt_calls_inflight(&s->calls);
    pthread_mutex_lock(&s->bw_mu);
    out->kv_transfer_bytes_s = s->bw;
    pthread_mutex_unlock(&s->bw_mu);
}

void prefill_service_destroy(void *svc)
{
    prefill_service_t *s = svc;
    if (!s) return;
    /* the gRPC server is down: every call has been answered, so the finisher's queue drains and it exits */
    if (s->finisher_running) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->finisher, NULL);
    }
    bt_ne_destroy(s->ne);
    bt_calls_destroy(&s->calls);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->bw_mu);
    free(s);
}
