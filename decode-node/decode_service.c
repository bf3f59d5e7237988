/* baton.v1.Decode over the engine scheduler (see decode_service.h).
 *
 * A Run call becomes a dec_call: the RPC thread validates and submits it; from then on the engine thread owns the
 * stream (emit callbacks send one message per token and finish the call on the last event). References, the list
 * of calls in flight and the cancel callback are node/calls.h's; the engine side's reference lasts until the final
 * event. */
#include "decode-node/decode_service.h"

#include "baton/v1/node.pb-c.h"
#include "common/log.h"
#include "node/calls.h"
#include "node/node.h"
#include "node/node_engine.h"
#include "node/peer_check.h"
#include "engine/backend.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/tokenizer.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define DEC_LOG "decode"
#define DEC_MAX_RUNNING 256
#define DEC_PREFILL_POLL_MS 100  /* a waiting remote prefill checks this often whether its request ended */
#define DEC_EXPECT_SLACK_MS 2000 /* the KV expectation outlives the prefill node's push deadline by this much */
#define DEC_EXPECT_MAX_MS 86400000 /* a day: the longest expectation (its timeout is 32-bit milliseconds) */
#define DEC_CANCEL_DRAIN_MS 1000 /* after cancelling a claimed remote prefill: most we wait for its writes to end */

typedef struct dec_call dec_call;

enum { RS_OK, RS_ABORTED, RS_CANCELLED, RS_TIMEOUT, RS_ERROR, RS_INVALID, RS_REJECTED, RS_N };
enum { REMOTE_OK, REMOTE_FALLBACK, REMOTE_REFUSED, REMOTE_N };
static const char *const REMOTE_NAMES[REMOTE_N] = {"ok", "fallback", "refused"};
static const char *const RS_NAMES[RS_N] = {"ok", "aborted", "cancelled", "timeout", "error", "invalid", "rejected"};

struct decode_service {
    char node_id[MBR_NODE_ID_MAX];
    mbr_watcher_t *members; /* which prefill nodes a hint may name (node/peer_check.h); NULL: none */
    bt_ne_t *ne;
    bt_sched *sched; /* ne->sched */
    int32_t n_vocab, max_context;
    bt_remote_prefill remote_hooks;
    int remote_timeout_ms;

    pthread_mutex_t mu;
    bt_calls_t calls;
    bt_rpc_chcache_t *channels;        /* to prefill nodes, by (address, node id); capped, with the node's TLS */

    metrics_histogram_t *ttft, *tpot, *e2e, *queue_time, *remote_seconds;
    metrics_counter_t *prompt_tokens, *gen_tokens, *prefix_hits, *prefix_queries;
    metrics_counter_t *requests[RS_N];
    metrics_counter_t *remote[REMOTE_N];

    pthread_mutex_t load_mu; /* the load sampler's memory, below */
    uint64_t load_hits, load_queries;

    pthread_mutex_t embeds_mu; /* embeds; taken before no other lock of ours */
    bt_list embeds;            /* embed_call by link: Embed calls in flight, for Decode/Abort by request id */
};

struct dec_call {
    bt_call_t base; /* first (calls.h) */
    decode_service_t *svc;
    atomic_int send_status; /* bt_status of a failed send: the scheduler is asked to abort */
    int logprobs;
    uint32_t n_prev;     /* tokens delivered before (migration): offsets continue after them */
    int32_t n_prompt;    /* the client's prompt tokens */
    int32_t n_submitted; /* prompt + previously delivered tokens, as submitted */
    double t_arrive, t_first, t_last;
    int32_t n_out;
    int sent_first;

    /* remote prefill (DESIGN 2 step 4): set by the RPC thread, used by the engine hook and the prefill worker */
    char prefill_node[MBR_NODE_ID_MAX];
    char prefill_addr[BT_NODE_ADDR_MAX];
    int32_t *ids;               /* [n_submitted] prompt + previously delivered tokens */
    uint64_t *hashes;
    size_t n_hashes;
    uint8_t *sampling_pb;       /* the request's SamplingParams, packed, with the seed made explicit */
    size_t sampling_len;
    uint32_t sample_index, top_logprobs;
    char *grammar;              /* the request's grammar, or NULL: the prefill node samples the first token under it */
    int ignore_eos;             /* the request's: under a grammar, whether EOS may come first */
    uint32_t *blocks;           /* destination blocks of the prompt */
    uint32_t n_blocks, skip;
    uint32_t *lblocks;          /* the sliding-window layers' destination blocks from lfirst on (NULL: none) */
    uint32_t lfirst;
    kvx_expect_t *expect;
    double deadline;            /* the call's, monotonic seconds (0 = none) */
};

/* ---- calls ---- */

static void call_free(bt_call_t *base)
{
    dec_call *c = (dec_call *)base;
    free(c->ids);
    free(c->hashes);
    free(c->sampling_pb);
    free(c->grammar);
    free(c->blocks);
    free(c->lblocks);
    free(c);
}

static const char *end_name(bt_end_reason r)
{
    switch (r) {
    case BT_END_STOP: return "stop";
    case BT_END_LENGTH: return "length";
    case BT_END_ABORT: return "abort";
    case BT_END_TIMEOUT: return "timeout";
    case BT_END_ERROR: return "error";
    default: return "none";
    }
}

/* One DecodeRunResponse and the storage its pointers refer to. */
typedef struct run_msg {
    Baton__V1__DecodeRunResponse r;
    int32_t tok;
    Baton__V1__TokenLogprob lp;
    Baton__V1__TokenLogprob *lpp[1];
    Baton__V1__TopLogprob top[BT_MAX_TOP_LOGPROBS];
    Baton__V1__TopLogprob *topp[BT_MAX_TOP_LOGPROBS];
    Baton__V1__Usage usage;
} run_msg;

static void msg_init(run_msg *m)
{
    m->r = (Baton__V1__DecodeRunResponse)BATON__V1__DECODE_RUN_RESPONSE__INIT;
    m->lp = (Baton__V1__TokenLogprob)BATON__V1__TOKEN_LOGPROB__INIT;
    m->lpp[0] = &m->lp;
    m->usage = (Baton__V1__Usage)BATON__V1__USAGE__INIT;
}

/* The first token: time to first token, queue time, prompt tokens; the prompt no longer waits for prefill. */
static void note_first_token(dec_call *c, const bt_sched_event *ev, double now)
{
    decode_service_t *s = c->svc;
    c->t_first = now;
    metrics_histogram_observe(s->ttft, now - c->t_arrive);
    metrics_histogram_observe(s->queue_time, ev->queue_s);
    metrics_counter_add(s->prompt_tokens, (uint64_t)ev->n_prompt);
    bt_calls_prefilled(&s->calls, c->n_submitted);
}

/* Puts the event's token into m at its offset in the whole output, with its logprobs when the client asked. */
static void msg_add_token(dec_call *c, const bt_sched_event *ev, run_msg *m)
{
    m->tok = ev->token;
    m->r.offset = c->n_prev + (uint32_t)ev->index;
    m->r.n_token_ids = 1;
    m->r.token_ids = &m->tok;
    if (!c->logprobs) return;
    m->lp.token_id = ev->token;
    m->lp.logprob = ev->detail ? ev->detail->logprob : ev->logprob;
    if (ev->detail && ev->detail->n_top > 0) {
        int32_t nt = ev->detail->n_top < BT_MAX_TOP_LOGPROBS ? ev->detail->n_top : BT_MAX_TOP_LOGPROBS;
        for (int32_t i = 0; i < nt; i++) {
            baton__v1__top_logprob__init(&m->top[i]);
            m->top[i].token_id = ev->detail->top[i].id;
            m->top[i].logprob = ev->detail->top[i].logprob;
            m->topp[i] = &m->top[i];
        }
        m->lp.n_top = (size_t)nt;
        m->lp.top = m->topp;
    }
    m->r.n_logprobs = 1;
    m->r.logprobs = m->lpp;
}

/* Streams a token message; a failed send (client gone, stream buffer full) aborts the request once. */
static void send_token(dec_call *c, const bt_sched_event *ev, run_msg *m)
{
    if (!c->sent_first) m->r.node_id = c->svc->node_id;
    bt_status st = bt_rpc_call_send(c->base.rpc, &m->r.base);
    c->sent_first = 1;
    if (st != BT_OK && atomic_load(&c->send_status) == BT_OK) {
        atomic_store(&c->send_status, st);
        bt_sched_abort(c->svc->sched, ev->req_id);
    }
}

/* How the request ended, for the client: the status code (msg says why when not OK; m gets the finish reason
 * when OK) and the outcome label *rs for the requests counter. */
static bt_rpc_code end_status(dec_call *c, const bt_sched_event *ev, run_msg *m, char *msg, size_t cap, int *rs)
{
    bt_status send_st = atomic_load(&c->send_status);
    *rs = RS_OK;
    switch (ev->finish) {
    case BT_END_STOP: m->r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_STOP; return BT_RPC_OK;
    case BT_END_LENGTH: m->r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH; return BT_RPC_OK;
    case BT_END_ABORT:
        if (bt_rpc_call_cancelled(c->base.rpc) || send_st == BT_ERR_CANCELLED) {
            *rs = RS_CANCELLED;
            snprintf(msg, cap, "cancelled by the client");
            return BT_RPC_CANCELLED;
        }
        if (send_st == BT_ERR_EXHAUSTED) {
            *rs = RS_ABORTED;
            snprintf(msg, cap, "the client reads too slowly: stream buffer full");
            return BT_RPC_RESOURCE_EXHAUSTED;
        }
        if (send_st != BT_OK) {
            *rs = RS_ERROR;
            snprintf(msg, cap, "sending failed: %s", bt_status_str(send_st));
            return BT_RPC_INTERNAL;
        }
        m->r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_ABORT; /* Decode/Abort or shutdown */
        *rs = RS_ABORTED;
        return BT_RPC_OK;
    case BT_END_TIMEOUT:
        *rs = RS_TIMEOUT;
        snprintf(msg, cap, "deadline exceeded after %d generated tokens", c->n_out);
        return BT_RPC_DEADLINE_EXCEEDED;
    default:
        *rs = RS_ERROR;
        snprintf(msg, cap, "engine step failed: %s", bt_status_str(ev->error));
        return BT_RPC_INTERNAL;
    }
}

/* The last message of a stream that ends well: the finish reason (already in m) with the usage. */
static void send_last(dec_call *c, const bt_sched_event *ev, run_msg *m)
{
    m->usage.prompt_tokens = (uint32_t)c->n_prompt;
    m->usage.completion_tokens = c->n_prev + (uint32_t)c->n_out;
    m->usage.total_tokens = m->usage.prompt_tokens + m->usage.completion_tokens;
    m->usage.cached_prompt_tokens = (uint32_t)(ev->n_cached < c->n_prompt ? ev->n_cached : c->n_prompt);
    m->r.usage = &m->usage;
    if (!c->sent_first) m->r.node_id = c->svc->node_id;
    bt_rpc_call_send(c->base.rpc, &m->r.base);
}

/* The request's end in the metrics (outcome, e2e, time per output token) and the log. */
static void record_end(dec_call *c, const bt_sched_event *ev, int rs, const char *msg, double now)
{
    decode_service_t *s = c->svc;
    metrics_counter_inc(s->requests[rs]);
    metrics_histogram_observe(s->e2e, now - c->t_arrive);
    if (c->n_out >= 2) metrics_histogram_observe(s->tpot, (c->t_last - c->t_first) / (c->n_out - 1));
    if (rs == RS_ERROR) BT_WARN(DEC_LOG, "request %s: %s", c->base.request_id, msg);
    if (bt_log_enabled(BT_LOG_DEBUG))
        BT_DEBUG(DEC_LOG,
                 "request %s: prompt %d (+%u delivered, %d cached), generated %d, finish %s%s%s, ttft %.3f s, "
                 "e2e %.3f s",
                 c->base.request_id, c->n_prompt, c->n_prev, ev->n_cached, c->n_out, end_name(ev->finish),
                 msg[0] ? ": " : "", msg, c->n_out ? c->t_first - c->t_arrive : 0.0, now - c->t_arrive);
}

/* Engine thread: one message per token; the last event finishes the call. */
static void on_event(void *user, const bt_sched_event *ev)
{
    dec_call *c = user;
    decode_service_t *s = c->svc;
    double now = bt_sched_now();
    run_msg m;
    msg_init(&m);
    if (ev->token >= 0) {
        if (c->n_out == 0) note_first_token(c, ev, now);
        c->n_out++;
        c->t_last = now;
        metrics_counter_inc(s->gen_tokens);
        msg_add_token(c, ev, &m);
    }
    if (ev->finish == BT_END_NONE) {
        send_token(c, ev, &m);
        return;
    }
    if (c->n_out == 0) bt_calls_prefilled(&s->calls, c->n_submitted);
    char msg[256] = "";
    int rs;
    bt_rpc_code code = end_status(c, ev, &m, msg, sizeof msg, &rs);
    if (code == BT_RPC_OK) send_last(c, ev, &m);
    record_end(c, ev, rs, msg, now);
    bt_call_finish(&c->base, code, msg[0] ? msg : NULL);
    bt_call_done(&c->base);
}

bt_rpc_code decode_run_params(const bt_ne_t *ne, const Baton__V1__DecodeRunRequest *q, bt_req_params *rp, char *err,
                              size_t cap)
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
    for (size_t i = 0; i < q->n_prompt_token_ids; i++)
        if (q->prompt_token_ids[i] < 0 || q->prompt_token_ids[i] >= ne->n_vocab) {
            snprintf(err, cap, "prompt_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
                     q->prompt_token_ids[i], ne->n_vocab);
            return BT_RPC_INVALID_ARGUMENT;
        }
    for (size_t i = 0; i < q->n_generated_token_ids; i++)
        if (q->generated_token_ids[i] < 0 || q->generated_token_ids[i] >= ne->n_vocab) {
            snprintf(err, cap, "generated_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
                     q->generated_token_ids[i], ne->n_vocab);
            return BT_RPC_INVALID_ARGUMENT;
        }
    bt_sampling *sp = &rp->sampling;
    if (q->n_stop_token_ids > BT_MAX_STOP_IDS) {
        snprintf(err, cap, "stop_token_ids has %zu entries (at most %d)", q->n_stop_token_ids, BT_MAX_STOP_IDS);
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (bt_ne_sampling_from_proto(ne, q->sampling, q->logprobs, q->top_logprobs, q->sample_index,
                                  bt_ne_random_seed(), sp, err, cap))
        return BT_RPC_INVALID_ARGUMENT;
    rp->sample_index = (int32_t)q->sample_index;
    rp->no_spec = q->disable_speculation;
    sp->n_stop_ids = (int32_t)q->n_stop_token_ids;
    for (size_t i = 0; i < q->n_stop_token_ids; i++) sp->stop_ids[i] = q->stop_token_ids[i];
    sp->ignore_eos = q->ignore_eos;
    if (bt_sampling_check_vocab(sp, ne->n_vocab) != BT_OK) {
        snprintf(err, cap, "%s", bt_last_error());
        return BT_RPC_INVALID_ARGUMENT;
    }
    int64_t n_total = (int64_t)q->n_prompt_token_ids + (int64_t)q->n_generated_token_ids;
    if (q->max_tokens > (uint32_t)ne->max_context) { /* also keeps the int32 below from wrapping negative */
        snprintf(err, cap, "max_tokens %u exceeds the context of %d tokens", q->max_tokens, ne->max_context);
        return BT_RPC_INVALID_ARGUMENT;
    }
    if (q->max_tokens > 0) {
        if (q->n_generated_token_ids >= q->max_tokens) {
            snprintf(err, cap, "max_tokens %u already reached by the %zu generated_token_ids", q->max_tokens,
                     q->n_generated_token_ids);
            return BT_RPC_INVALID_ARGUMENT;
        }
        sp->max_tokens = (int32_t)(q->max_tokens - q->n_generated_token_ids);
    }
    if (n_total >= ne->max_context || (q->max_tokens > 0 && n_total + sp->max_tokens > ne->max_context)) {
        snprintf(err, cap, "prompt of %lld tokens + max_tokens %u exceeds the context of %d tokens",
                 (long long)n_total, q->max_tokens, ne->max_context);
        return BT_RPC_INVALID_ARGUMENT;
    }
    /* last: the reference is the caller's to drop once this returned OK */
    if (bt_ne_constraint(ne, q->grammar, &rp->constraint, err, cap)) return BT_RPC_INVALID_ARGUMENT;
    rp->constraint_prefix = (int32_t)q->n_generated_token_ids;
    return BT_RPC_OK;
}

/* ---- remote prefill (DESIGN 2 step 4, 3) ---- */

/* A held channel to the prefill node node_id at addr (with mTLS its certificate must name node_id); give it back
 * with bt_rpc_chcache_release. NULL when addr is malformed or every cached channel is busy (logged). */
static bt_rpc_channel_t *channel_for(decode_service_t *s, const char *addr, const char *node_id)
{
    bt_rpc_channel_t *ch = NULL;
    if (bt_rpc_chcache_get(s->channels, addr, node_id, &ch) != BT_OK) {
        BT_WARN(DEC_LOG, "no channel to prefill node %s: %s", node_id, bt_last_error());
        return NULL;
    }
    return ch;
}

/* Prefill/Run as a cancellable call (the wire format of a unary call): if the request ends meanwhile (client gone,
 * Decode/Abort, deadline), the call is cancelled so that the prefill node drops the prompt (DESIGN 3). Returns as
 * bt_rpc_unary does. */
static bt_status call_prefill(dec_call *c, bt_rpc_channel_t *ch, const ProtobufCMessage *req, int timeout_ms,
                              ProtobufCMessage **resp, bt_rpc_result_t *res)
{
    bt_rpc_stream_t *rs = NULL;
    bt_status st = bt_rpc_stream_open(ch, "/baton.v1.Prefill/Run", req, &baton__v1__prefill_run_response__descriptor,
                                      timeout_ms, NULL, &rs);
    if (st != BT_OK) {
        res->code = BT_RPC_INTERNAL;
        snprintf(res->message, sizeof res->message, "%s", bt_last_error());
        return st;
    }
    ProtobufCMessage *m = NULL, *first = NULL;
    for (;;) {
        int ready = 0;
        st = bt_rpc_stream_next_wait(rs, DEC_PREFILL_POLL_MS, &m, &ready);
        if (st != BT_OK) break;
        if (!ready) {
            if (bt_call_finished(&c->base)) bt_rpc_stream_cancel(rs);
            continue;
        }
        if (!m) break; /* end of the call */
        if (first) protobuf_c_message_free_unpacked(m, NULL);
        else first = m;
    }
    if (bt_rpc_stream_result(rs, res) != BT_OK) {
        res->code = BT_RPC_INTERNAL;
        snprintf(res->message, sizeof res->message, "no result");
    }
    bt_rpc_stream_close(rs);
    if (st == BT_OK && !first) {
        st = BT_ERR_FORMAT;
        snprintf(res->message, sizeof res->message, "the prefill node answered nothing");
    }
    if (st != BT_OK) {
        if (first) protobuf_c_message_free_unpacked(first, NULL);
        return st;
    }
    *resp = first;
    return BT_OK;
}

/* Calls Prefill/Run with the prompt, its sampling and the KV destination in this node's pool. BT_OK with *resp
 * (the caller frees it), else res says why. */
static bt_status request_prefill(dec_call *c, bt_rpc_channel_t *ch, Baton__V1__SamplingParams *sp, int timeout_ms,
                                 ProtobufCMessage **resp, bt_rpc_result_t *res)
{
    decode_service_t *s = c->svc;
    bt_ne_t *ne = s->ne;
    size_t dlen;
    const void *desc = kvx_pool_descriptor(ne->kvx_pool, &dlen);
    Baton__V1__KvDestination d = BATON__V1__KV_DESTINATION__INIT;
    d.decode_node_id = s->node_id;
    d.epoch = kvx_expect_epoch(c->expect);
    d.n_block_ids = c->n_blocks;
    d.block_ids = c->blocks;
    d.layout_fingerprint = ne->layout.fingerprint;
    d.skip_blocks = c->skip;
    if (c->lblocks) {
        d.n_local_block_ids = c->n_blocks - c->lfirst;
        d.local_block_ids = c->lblocks;
        d.local_first_block = c->lfirst;
    }
    d.checksums = 1;
    d.pool_descriptor.data = (uint8_t *)desc;
    d.pool_descriptor.len = dlen;
    Baton__V1__PrefillRunRequest q = BATON__V1__PREFILL_RUN_REQUEST__INIT;
    q.request_id = c->base.request_id;
    q.model_fingerprint = ne->fingerprint;
    q.n_prompt_token_ids = (size_t)c->n_submitted;
    q.prompt_token_ids = c->ids;
    q.n_block_hashes = c->n_hashes;
    q.block_hashes = c->hashes;
    q.sampling = sp;
    q.logprobs = c->logprobs;
    q.top_logprobs = c->top_logprobs;
    q.destination = &d;
    q.sample_index = c->sample_index;
    q.grammar = c->grammar ? c->grammar : "";
    q.ignore_eos = c->ignore_eos;
    memset(res, 0, sizeof *res);
    return call_prefill(c, ch, &q.base, timeout_ms, resp, res);
}

/* The prefill node's answer: valid once the blocks it wrote are verified and its epoch is ours. Fills the first
 * token and its logprobs; else why says what was wrong. */
static bt_status take_answer(dec_call *c, const Baton__V1__PrefillRunResponse *r, int32_t *token, bt_sample_out *so,
                             char *why, size_t cap)
{
    /* P answers only after the decode side acknowledged the blocks, so this returns at once */
    bt_status xs = kvx_expect_wait(c->expect);
    if (xs != BT_OK) {
        snprintf(why, cap, "blocks not verified: %s", kvx_expect_error(c->expect));
        return xs;
    }
    if (r->epoch != kvx_expect_epoch(c->expect)) {
        snprintf(why, cap, "answer for epoch %" PRIu64 ", expected %" PRIu64, r->epoch, kvx_expect_epoch(c->expect));
        return BT_ERR_STALE;
    }
    *token = r->first_token_id;
    so->id = *token;
    if (r->first_logprob) {
        so->logprob = r->first_logprob->logprob;
        size_t nt = r->first_logprob->n_top < BT_MAX_TOP_LOGPROBS ? r->first_logprob->n_top : BT_MAX_TOP_LOGPROBS;
        for (size_t i = 0; i < nt; i++) {
            so->top[i].id = r->first_logprob->top[i]->token_id;
            so->top[i].logprob = r->first_logprob->top[i]->logprob;
        }
        so->n_top = (int32_t)nt;
    }
    return BT_OK;
}

/* After a failed call: waits until the prefill node can no longer write into the blocks, so they can be reused. */
static void wait_out_writes(dec_call *c, const bt_rpc_result_t *res)
{
    /* Alive and past our deadline, it may still be writing: wait for the expectation's own deadline (after the
     * push's). A dead or refusing prefill node writes nothing more. */
    if (res->code == BT_RPC_DEADLINE_EXCEEDED) kvx_expect_wait(c->expect);
    /* We cancelled (the request ended). Before the prefill node's claim nothing can land once the expectation
     * ends; after it, its one-sided writes stop when its push completes (or it dies): wait for that, bounded. */
    if (res->code == BT_RPC_CANCELLED && bt_call_finished(&c->base) &&
        kvx_expect_settle(c->expect, DEC_CANCEL_DRAIN_MS) != BT_OK)
        BT_WARN(DEC_LOG, "request %s: cancelled remote prefill on %s: %s; releasing its blocks anyway",
                c->base.request_id, c->prefill_node, bt_last_error());
}

/* The remote prefill's outcome in the metrics and the log. */
static void record_remote(dec_call *c, bt_status st, double dt, const char *why)
{
    decode_service_t *s = c->svc;
    if (st == BT_OK) {
        metrics_counter_inc(s->remote[REMOTE_OK]);
        metrics_histogram_observe(s->remote_seconds, dt);
        BT_DEBUG(DEC_LOG, "request %s: remote prefill on %s: %d tokens (%u blocks skipped) in %.3f s",
                 c->base.request_id, c->prefill_node, c->n_submitted, c->skip, dt);
    } else {
        metrics_counter_inc(s->remote[REMOTE_FALLBACK]);
        BT_WARN(DEC_LOG, "request %s: remote prefill on %s (%s) failed after %.3f s: %s; prefilling locally",
                c->base.request_id, c->prefill_node, c->prefill_addr, dt, why[0] ? why : bt_status_str(st));
    }
}

/* How long a remote prefill may take from now: what is left of the request's deadline, never more than
 * remote_timeout_ms (past it D prefills locally; the router's requests carry long deadlines since issue 16). */
static int remote_wait_ms(const decode_service_t *s, const dec_call *c, double now)
{
    int left = bt_deadline_timeout_ms(c->deadline, now, s->remote_timeout_ms);
    return left < s->remote_timeout_ms ? left : s->remote_timeout_ms;
}

/* Calls Prefill/Run on the hinted prefill node and waits for its answer and for the blocks' arrival; then tells the
 * scheduler (first token, or local prefill). Runs on its own thread: the wait is the network's. */
static void *prefill_worker(void *arg)
{
    dec_call *c = arg;
    decode_service_t *s = c->svc;
    double t0 = bt_sched_now();
    bt_status st = BT_ERR_UNAVAILABLE;
    char why[400] = "";
    int32_t token = -1;
    bt_sample_out so;
    memset(&so, 0, sizeof so);
    /* The call waits for P's queue and compute as well as the transfer: it gets the request's deadline (P bounds
     * the transfer itself by the KV transfer deadline), at most remote_timeout_ms. */
    int timeout_ms = remote_wait_ms(s, c, t0);
    Baton__V1__SamplingParams *sp = (Baton__V1__SamplingParams *)protobuf_c_message_unpack(
        &baton__v1__sampling_params__descriptor, NULL, c->sampling_len, c->sampling_pb);
    bt_rpc_channel_t *ch = channel_for(s, c->prefill_addr, c->prefill_node);
    if (!sp || !ch) {
        snprintf(why, sizeof why, "%s", !sp ? "cannot re-read the sampling parameters" : "cannot open a channel");
    } else {
        ProtobufCMessage *resp = NULL;
        bt_rpc_result_t res;
        st = request_prefill(c, ch, sp, timeout_ms, &resp, &res);
        if (st == BT_OK) {
            st = take_answer(c, (const Baton__V1__PrefillRunResponse *)resp, &token, &so, why, sizeof why);
            protobuf_c_message_free_unpacked(resp, NULL);
        } else {
            snprintf(why, sizeof why, "%s: %s", bt_rpc_code_str(res.code), res.message);
            wait_out_writes(c, &res);
        }
    }
    if (sp) protobuf_c_message_free_unpacked(&sp->base, NULL);
    bt_rpc_chcache_release(s->channels, ch);
    kvx_expect_destroy(c->expect); /* a pending epoch becomes stale: late completions are ignored */
    c->expect = NULL;
    record_remote(c, st, bt_sched_now() - t0, why);
    bt_sched_remote_done(s->sched, atomic_load(&c->base.sched_id), st, token, st == BT_OK ? &so : NULL);
    bt_call_unref(&c->base);
    return NULL;
}

/* Engine thread, at admission: register where the prompt's KV will land, then hand the call to a worker. */
static int remote_start(void *user, uint64_t sched_id, const int32_t *blocks, int32_t n_blocks, int32_t n_cached,
                        const int32_t *local_blocks, int32_t local_first)
{
    dec_call *c = user;
    decode_service_t *s = c->svc;
    uint32_t skip = (uint32_t)(n_cached / BT_KV_BLOCK);
    if (skip >= (uint32_t)n_blocks || (local_blocks && (local_first < 0 || local_first >= n_blocks))) return 1;
    c->blocks = malloc(sizeof(uint32_t) * (size_t)n_blocks);
    if (!c->blocks) return 1;
    for (int32_t i = 0; i < n_blocks; i++) c->blocks[i] = (uint32_t)blocks[i];
    c->n_blocks = (uint32_t)n_blocks;
    c->skip = skip;
    if (local_blocks) { /* the sliding-window layers: only the window before the first generated position moves */
        c->lblocks = malloc(sizeof(uint32_t) * (size_t)(n_blocks - local_first));
        if (!c->lblocks) return 1;
        for (int32_t i = local_first; i < n_blocks; i++) {
            if (local_blocks[i] < 0) return 1; /* released: cannot happen for a window the scheduler chose */
            c->lblocks[i - local_first] = (uint32_t)local_blocks[i];
        }
        c->lfirst = (uint32_t)local_first;
    }
    atomic_store(&c->base.sched_id, sched_id); /* the worker may need it before bt_sched_submit has returned */
    /* the expectation outlives the prefill node's push deadline (the call's), so no late write can land after it */
    int left_ms = remote_wait_ms(s, c, bt_sched_now());
    if (left_ms > DEC_EXPECT_MAX_MS) left_ms = DEC_EXPECT_MAX_MS;
    kvx_expect_args_t a = {.blocks = c->blocks + skip, .n_blocks = (size_t)(n_blocks - (int32_t)skip),
                           .flags = KVX_F_CRC, .timeout_ms = (uint32_t)left_ms + DEC_EXPECT_SLACK_MS};
    if (c->lblocks) {
        a.layer_group = s->ne->kv_layer_group;
        a.local_blocks = c->lblocks;
        a.n_local_blocks = c->n_blocks - c->lfirst;
    }
    if (kvx_expect_create(s->ne->kvx_pool, &a, &c->expect) != BT_OK) {
        BT_WARN(DEC_LOG, "request %s: cannot expect remote KV (%s); prefilling locally", c->base.request_id,
                bt_last_error());
        return 1;
    }
    bt_call_ref(&c->base);
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, prefill_worker, c);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        kvx_expect_destroy(c->expect);
        c->expect = NULL;
        bt_call_unref(&c->base);
        return 1;
    }
    return 0;
}

/* A prefill hint is a claim by the caller: follow it only to a prefill node registered in this cluster with our
 * model, at the address it registered (never one the caller made up). 0 and c->prefill_node/addr filled, else -1
 * with the refusal logged and counted. */
static int remote_verify(dec_call *c, const Baton__V1__PrefillHint *h)
{
    decode_service_t *s = c->svc;
    char why[448];
    mbr_node_t rec;
    bt_status st = bt_peer_lookup(s->members, h->node_id, MBR_ROLE_PREFILL, s->ne->fingerprint, &rec, why, sizeof why);
    if (st == BT_OK && h->grpc_address[0] && strcmp(h->grpc_address, rec.info.grpc_addr) != 0) {
        snprintf(why, sizeof why, "hint address %.128s is not the address %.128s that prefill node '%.64s' registered",
                 h->grpc_address, rec.info.grpc_addr, h->node_id);
        st = BT_ERR_INVALID;
    }
    if (st == BT_OK) {
        snprintf(c->prefill_node, sizeof c->prefill_node, "%s", rec.info.node_id);
        snprintf(c->prefill_addr, sizeof c->prefill_addr, "%s", rec.info.grpc_addr);
    }
    mbr_node_info_free(&rec.info);
    if (st != BT_OK) {
        metrics_counter_inc(s->remote[REMOTE_REFUSED]);
        BT_WARN(DEC_LOG, "request %s: prefill hint refused (%s); prefilling locally", c->base.request_id, why);
        return -1;
    }
    return 0;
}

/* Copies what the prefill worker needs out of the request (it outlives the handler). 0 on success. */
static int remote_prepare(dec_call *c, const Baton__V1__DecodeRunRequest *q, const bt_req_params *rp,
                          const int32_t *ids)
{
    c->ids = malloc(sizeof(int32_t) * (size_t)c->n_submitted);
    if (!c->ids) return -1;
    memcpy(c->ids, ids, sizeof(int32_t) * (size_t)c->n_submitted);
    if (q->n_block_hashes && !q->n_generated_token_ids) {
        c->hashes = malloc(sizeof(uint64_t) * q->n_block_hashes);
        if (!c->hashes) return -1;
        memcpy(c->hashes, q->block_hashes, sizeof(uint64_t) * q->n_block_hashes);
        c->n_hashes = q->n_block_hashes;
    }
    /* the seed is fixed here so that the prefill node samples the first token from the same stream */
    Baton__V1__SamplingParams sp = BATON__V1__SAMPLING_PARAMS__INIT;
    if (q->sampling) sp = *q->sampling;
    sp.seed_opt_case = BATON__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
    sp.seed = rp->sampling.seed;
    c->sampling_len = protobuf_c_message_get_packed_size(&sp.base);
    c->sampling_pb = malloc(c->sampling_len ? c->sampling_len : 1);
    if (!c->sampling_pb) return -1;
    protobuf_c_message_pack(&sp.base, c->sampling_pb);
    c->sample_index = q->sample_index;
    c->top_logprobs = q->top_logprobs;
    c->deadline = rp->deadline;
    if (q->grammar[0] && !(c->grammar = strdup(q->grammar))) return -1;
    c->ignore_eos = q->ignore_eos;
    return 0;
}

/* Builds the call of a checked request and the token ids to submit: the prompt, then the tokens delivered before a
 * migration. NULL when out of memory. */
static dec_call *call_create(decode_service_t *s, bt_rpc_call_t *call, const Baton__V1__DecodeRunRequest *q,
                             const char *rid, int32_t **ids_out)
{
    size_t n = q->n_prompt_token_ids + q->n_generated_token_ids;
    int32_t *ids = malloc(n * sizeof *ids);
    dec_call *c = calloc(1, sizeof *c);
    if (!ids || !c) {
        free(ids);
        free(c);
        return NULL;
    }
    memcpy(ids, q->prompt_token_ids, q->n_prompt_token_ids * sizeof *ids);
    if (q->n_generated_token_ids)
        memcpy(ids + q->n_prompt_token_ids, q->generated_token_ids, q->n_generated_token_ids * sizeof *ids);
    bt_call_init(&c->base, &s->calls, call, rid, call_free);
    c->svc = s;
    c->logprobs = q->logprobs;
    c->n_prev = (uint32_t)q->n_generated_token_ids;
    c->n_prompt = (int32_t)q->n_prompt_token_ids;
    c->n_submitted = (int32_t)n;
    *ids_out = ids;
    return c;
}

/* Decode/Run: check, admit, create the call, pick remote or local prefill, submit; the engine streams the rest. */
static void run_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    decode_service_t *s = ud;
    const Baton__V1__DecodeRunRequest *q = (const Baton__V1__DecodeRunRequest *)msg;
    double t_arrive = bt_sched_now();
    const char *rid = q->request_id[0] ? q->request_id : "-";
    char err[320];
    bt_req_params rp = bt_req_params_default();
    rp.sampling = bt_sampling_default();
    bt_rpc_code code = decode_run_params(s->ne, q, &rp, err, sizeof err);
    if (code != BT_RPC_OK) {
        bt_calls_reject(&s->calls, call, code, rid, err);
        return;
    }
    rp.deadline = bt_call_deadline(call);
    if (!bt_calls_admit(&s->calls)) {
        snprintf(err, sizeof err, "decode node %s is at capacity (%d requests in flight)", s->node_id,
                 s->calls.max_inflight);
        bt_constraint_unref(rp.constraint);
        bt_calls_reject(&s->calls, call, BT_RPC_RESOURCE_EXHAUSTED, rid, err);
        return;
    }
    int32_t *ids = NULL;
    dec_call *c = call_create(s, call, q, rid, &ids);
    if (!c) {
        bt_constraint_unref(rp.constraint);
        bt_calls_leave(&s->calls);
        bt_calls_reject(&s->calls, call, BT_RPC_RESOURCE_EXHAUSTED, rid, "out of memory");
        return;
    }
    c->t_arrive = t_arrive;
    /* remote prefill when the router hinted a prefill node and kvtransfer runs here; otherwise local */
    /* (a migrated request under a grammar prefills here: the prefill node would start the grammar too early) */
    if (q->prefill && (q->prefill->node_id[0] || q->prefill->grpc_address[0]) && s->ne->kvx_pool &&
        s->remote_timeout_ms > 0 && !(rp.constraint && q->n_generated_token_ids) &&
        remote_verify(c, q->prefill) == 0) {
        if (remote_prepare(c, q, &rp, ids) == 0) rp.remote = &s->remote_hooks;
        else BT_WARN(DEC_LOG, "request %s: out of memory preparing a remote prefill; prefilling locally", rid);
    }
    bt_calls_submit(&s->calls, &c->base, ids, c->n_submitted, &rp, on_event, c->n_submitted);
    bt_constraint_unref(rp.constraint); /* the scheduler took its own */
    free(ids);
}

/* ---- Decode/Embed ---- */

/* One Embed call: its inputs run as separate embedding requests of the scheduler; the event that ends the last of
 * them answers. left counts the inputs still running plus the handler's own hold, so the call cannot be answered
 * (and freed) before the handler has registered the cancel callback. */
typedef struct embed_call {
    decode_service_t *svc;
    bt_rpc_call_t *rpc;
    size_t n;
    float *vecs;         /* [n][n_embd] */
    uint64_t *ids;       /* [n] scheduler ids (0: not submitted) */
    atomic_int left;
    atomic_int failed;   /* the first bad outcome: an RS_* (RS_OK while none) */
    bt_status error;     /* with RS_ERROR: the engine's; written once, under failed's first change */
    uint32_t tokens;
    char request_id[BT_CALL_ID_MAX];
    bt_list_node link;   /* in svc->embeds until answered */
} embed_call;

static void embed_free(embed_call *e)
{
    free(e->vecs);
    free(e->ids);
    free(e);
}

/* The call's answer once every input has ended. */
static void embed_answer(embed_call *e)
{
    decode_service_t *s = e->svc;
    pthread_mutex_lock(&s->embeds_mu); /* Abort no longer finds it, so it may be freed below */
    bt_list_remove(&s->embeds, &e->link);
    pthread_mutex_unlock(&s->embeds_mu);
    int rs = atomic_load(&e->failed);
    if (rs == RS_OK) {
        int32_t E = s->ne->m->hp.n_embd;
        Baton__V1__Embedding *emb = calloc(e->n, sizeof *emb);
        Baton__V1__Embedding **embp = calloc(e->n, sizeof *embp);
        if (emb && embp) {
            for (size_t i = 0; i < e->n; i++) {
                baton__v1__embedding__init(&emb[i]);
                emb[i].n_values = (size_t)E;
                emb[i].values = e->vecs + i * (size_t)E;
                embp[i] = &emb[i];
            }
            Baton__V1__DecodeEmbedResponse r = BATON__V1__DECODE_EMBED_RESPONSE__INIT;
            r.n_data = e->n;
            r.data = embp;
            r.prompt_tokens = e->tokens;
            r.node_id = s->node_id;
            if (bt_rpc_call_send(e->rpc, &r.base) != BT_OK) rs = RS_CANCELLED;
            else bt_rpc_call_finish(e->rpc, BT_RPC_OK, NULL);
        } else {
            rs = RS_ERROR;
            bt_rpc_call_finish(e->rpc, BT_RPC_RESOURCE_EXHAUSTED, "out of memory answering the embeddings");
        }
        free(emb);
        free(embp);
        if (rs == RS_CANCELLED) bt_rpc_call_finish(e->rpc, BT_RPC_CANCELLED, "the client went away");
    } else if (rs == RS_TIMEOUT) {
        bt_rpc_call_finish(e->rpc, BT_RPC_DEADLINE_EXCEEDED, "deadline exceeded before every input was computed");
    } else if (rs == RS_ERROR) {
        char msg[200];
        snprintf(msg, sizeof msg, "engine step failed: %s", bt_status_str(e->error));
        BT_WARN(DEC_LOG, "embeddings: %s", msg);
        bt_rpc_call_finish(e->rpc, BT_RPC_INTERNAL, msg);
    } else {
        bt_rpc_call_finish(e->rpc, BT_RPC_CANCELLED, "cancelled");
    }
    metrics_counter_inc(s->requests[rs]);
    if (rs == RS_OK) metrics_counter_add(s->prompt_tokens, e->tokens);
    if (rs == RS_CANCELLED) BT_INFO(DEC_LOG, "embeddings %s: cancelled", e->request_id);
    bt_calls_leave(&s->calls);
    embed_free(e);
}

/* Drops one hold; the last answers. */
static void embed_release(embed_call *e)
{
    if (atomic_fetch_sub(&e->left, 1) == 1) embed_answer(e);
}

/* Records the first bad outcome and asks the scheduler to end the other inputs (their work is wasted now). */
static void embed_fail(embed_call *e, int rs, bt_status err)
{
    int none = RS_OK;
    if (!atomic_compare_exchange_strong(&e->failed, &none, rs)) return;
    e->error = err;
    for (size_t i = 0; i < e->n; i++)
        if (e->ids[i]) bt_sched_abort(e->svc->sched, e->ids[i]);
}

/* Engine thread: an input ended (an embedding request has exactly one event). */
static void embed_event(void *user, const bt_sched_event *ev)
{
    embed_call *e = user;
    if (ev->finish == BT_END_NONE) return;
    if (ev->finish == BT_END_TIMEOUT) embed_fail(e, RS_TIMEOUT, BT_OK);
    else if (ev->finish == BT_END_ERROR) embed_fail(e, RS_ERROR, ev->error);
    else if (ev->finish != BT_END_STOP) embed_fail(e, RS_CANCELLED, BT_OK);
    embed_release(e);
}

static void embed_cancel(void *ud, bt_rpc_call_t *call)
{
    (void)call;
    embed_fail(ud, RS_CANCELLED, BT_OK);
}

/* Cancels the Embed calls in flight named request_id; how many it found. */
static int embed_abort(decode_service_t *s, const char *request_id)
{
    int found = 0;
    pthread_mutex_lock(&s->embeds_mu);
    BT_LIST_FOR(e, &s->embeds, embed_call, link) {
        if (strcmp(e->request_id, request_id)) continue;
        embed_fail(e, RS_CANCELLED, BT_OK);
        found++;
    }
    pthread_mutex_unlock(&s->embeds_mu);
    return found;
}

/* Decode/Abort: the Run calls (node/calls.h) and the Embed calls named by the request id. */
static void abort_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    decode_service_t *s = ud;
    const Baton__V1__AbortRequest *q = (const Baton__V1__AbortRequest *)msg;
    Baton__V1__AbortResponse r = BATON__V1__ABORT_RESPONSE__INIT;
    if (q->request_id[0]) r.found = bt_calls_abort(&s->calls, q->request_id) + embed_abort(s, q->request_id) > 0;
    BT_DEBUG(DEC_LOG, "abort %s: %s", q->request_id, r.found ? "found" : "unknown or finished");
    bt_rpc_call_send(call, &r.base);
    bt_rpc_call_finish(call, BT_RPC_OK, NULL);
}

/* Decode/Embed's validation (the limits and the vocabulary), pure like decode_run_params. */
bt_rpc_code decode_embed_check(const bt_ne_t *ne, const Baton__V1__DecodeEmbedRequest *q, uint32_t *tokens, char *err,
                               size_t cap)
{
    if (q->model_fingerprint[0] && strcasecmp(q->model_fingerprint, ne->fingerprint) != 0) {
        snprintf(err, cap, "model_fingerprint %.32s does not match this node's model %s (%s)", q->model_fingerprint,
                 ne->fingerprint, ne->m->name);
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (q->n_inputs == 0 || q->n_inputs > DECODE_EMBED_MAX_INPUTS) {
        snprintf(err, cap, "inputs holds %zu sequences (1..%d allowed)", q->n_inputs, DECODE_EMBED_MAX_INPUTS);
        return BT_RPC_INVALID_ARGUMENT;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < q->n_inputs; i++) {
        const Baton__V1__TokenIds *t = q->inputs[i];
        size_t n = t ? t->n_ids : 0;
        if (n == 0 || n > (size_t)ne->max_context) {
            snprintf(err, cap, "inputs[%zu] has %zu tokens (1..%d allowed)", i, n, ne->max_context);
            return BT_RPC_INVALID_ARGUMENT;
        }
        for (size_t k = 0; k < n; k++)
            if (t->ids[k] < 0 || t->ids[k] >= ne->n_vocab) {
                snprintf(err, cap, "inputs[%zu].ids[%zu] = %d is outside the vocabulary [0, %d)", i, k, t->ids[k],
                         ne->n_vocab);
                return BT_RPC_INVALID_ARGUMENT;
            }
        total += n;
    }
    if (total > DECODE_EMBED_MAX_TOKENS) {
        snprintf(err, cap, "inputs hold %llu tokens together (at most %d per call)", (unsigned long long)total,
                 DECODE_EMBED_MAX_TOKENS);
        return BT_RPC_INVALID_ARGUMENT;
    }
    *tokens = (uint32_t)total;
    return BT_RPC_OK;
}

/* Decode/Embed: check, admit, submit every input; the event that ends the last one answers. */
static void embed_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    decode_service_t *s = ud;
    const Baton__V1__DecodeEmbedRequest *q = (const Baton__V1__DecodeEmbedRequest *)msg;
    const char *rid = q->request_id[0] ? q->request_id : "-";
    char err[320];
    uint32_t tokens = 0;
    bt_rpc_code code = decode_embed_check(s->ne, q, &tokens, err, sizeof err);
    if (code != BT_RPC_OK) {
        bt_calls_reject(&s->calls, call, code, rid, err);
        return;
    }
    if (!bt_calls_admit(&s->calls)) {
        snprintf(err, sizeof err, "decode node %s is at capacity (%d requests in flight)", s->node_id,
                 s->calls.max_inflight);
        bt_calls_reject(&s->calls, call, BT_RPC_RESOURCE_EXHAUSTED, rid, err);
        return;
    }
    size_t E = (size_t)s->ne->m->hp.n_embd;
    embed_call *e = calloc(1, sizeof *e);
    if (e) {
        e->vecs = malloc(sizeof(float) * E * q->n_inputs);
        e->ids = calloc(q->n_inputs, sizeof *e->ids);
    }
    if (!e || !e->vecs || !e->ids) {
        if (e) embed_free(e);
        bt_calls_leave(&s->calls);
        bt_calls_reject(&s->calls, call, BT_RPC_RESOURCE_EXHAUSTED, rid, "out of memory");
        return;
    }
    e->svc = s;
    e->rpc = call;
    e->n = q->n_inputs;
    e->tokens = tokens;
    snprintf(e->request_id, sizeof e->request_id, "%s", q->request_id);
    atomic_init(&e->failed, RS_OK);
    atomic_init(&e->left, (int)q->n_inputs + 1);
    pthread_mutex_lock(&s->embeds_mu);
    bt_list_push_front(&s->embeds, &e->link);
    pthread_mutex_unlock(&s->embeds_mu);
    double deadline = bt_call_deadline(call);
    for (size_t i = 0; i < q->n_inputs; i++) {
        bt_req_params rp = bt_req_params_default();
        rp.embedding = e->vecs + i * E;
        rp.deadline = deadline;
        uint64_t id = 0;
        if (atomic_load(&e->failed) != RS_OK ||
            bt_sched_submit(s->sched, q->inputs[i]->ids, (int32_t)q->inputs[i]->n_ids, &rp, embed_event, e, &id)) {
            if (atomic_load(&e->failed) == RS_OK) {
                BT_WARN(DEC_LOG, "embeddings %s: input %zu not submitted: %s", rid, i, bt_last_error());
                embed_fail(e, RS_ERROR, BT_ERR_INTERNAL);
            }
            embed_release(e); /* this input never runs */
            continue;
        }
        e->ids[i] = id; /* an abort racing this store only misses an input that then ends by itself */
    }
    bt_rpc_call_on_cancel(call, embed_cancel, e);
    embed_release(e); /* the handler's hold */
}

/* ---- life cycle ---- */

static bt_status register_metrics(decode_service_t *s, metrics_registry_t *reg)
{
    metrics_family_t *f;
    bt_status st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_TTFT, &s->ttft))) return st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_TPOT, &s->tpot))) return st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_E2E_LATENCY, &s->e2e))) return st;
    if ((st = metrics_std_histogram(reg, METRICS_STD_QUEUE_TIME, &s->queue_time))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_PROMPT_TOKENS, &s->prompt_tokens))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_GENERATION_TOKENS, &s->gen_tokens))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_PREFIX_CACHE_HITS, &s->prefix_hits))) return st;
    if ((st = metrics_std_counter(reg, METRICS_STD_PREFIX_CACHE_QUERIES, &s->prefix_queries))) return st;
    if ((st = metrics_histogram_register(reg, "baton_remote_prefill_seconds",
                                         "Time a decode node waited for a remote prefill (call + KV transfer).", NULL,
                                         0, &s->remote_seconds)))
        return st;
    static const char *const result_label[1] = {"result"};
    metrics_desc_t rd = {.name = "baton_remote_prefills_total",
                         .help = "Remote prefills by outcome (fallback: the remote prefill failed and the decode node prefilled "
                                 "locally; refused: the hinted prefill node is not a registered node of this model).",
                         .type = METRICS_COUNTER, .label_names = result_label, .n_labels = 1};
    if ((st = metrics_family_register(reg, &rd, &f))) return st;
    for (int i = 0; i < REMOTE_N; i++) {
        const char *lv[1] = {REMOTE_NAMES[i]};
        if ((st = metrics_family_counter(f, lv, &s->remote[i]))) return st;
    }
    if ((st = metrics_std_register(reg, METRICS_STD_REQUESTS, &f))) return st;
    for (int i = 0; i < RS_N; i++) {
        const char *lv[1] = {RS_NAMES[i]};
        if ((st = metrics_family_counter(f, lv, &s->requests[i]))) return st;
    }
    return BT_OK;
}

bt_status decode_service_create(const decode_config_t *cfg, decode_service_t **out)
{
    if (!cfg || !cfg->model_path || !cfg->metrics || !cfg->rpc)
        return bt_fail(BT_ERR_INVALID, "decode service: model path, metrics and rpc server are required");
    decode_service_t *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory creating the decode service");
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->load_mu, NULL);
    pthread_mutex_init(&s->embeds_mu, NULL);
    snprintf(s->node_id, sizeof s->node_id, "%s", cfg->node_id ? cfg->node_id : "");
    s->members = cfg->members;
    bt_calls_init(&s->calls, cfg->max_inflight > 0 ? cfg->max_inflight : DECODE_MAX_INFLIGHT, DEC_LOG);
    s->remote_timeout_ms = cfg->remote_timeout_ms ? cfg->remote_timeout_ms : DECODE_REMOTE_TIMEOUT_MS;
    s->remote_hooks = (bt_remote_prefill){remote_start};
    const bt_tls_files_t *t = cfg->tls;
    bt_rpc_chcache_config_t chc = {.tls_ca_file = t && t->ca[0] ? t->ca : NULL,
                                   .tls_cert_file = t && t->cert[0] ? t->cert : NULL,
                                   .tls_key_file = t && t->key[0] ? t->key : NULL,
                                   .keepalive_ms = BT_RPC_MIN_KEEPALIVE_MS};
    bt_status st = bt_rpc_chcache_create(&chc, &s->channels);
    if (st) goto fail;
    bt_ne_config_t nc = {.model_path = cfg->model_path, .name = DEC_LOG, .threads = cfg->threads,
                         .kv_mem = cfg->kv_mem, .max_batch_tokens = cfg->max_batch_tokens,
                         .max_running = DEC_MAX_RUNNING, .disable_kvx = cfg->remote_timeout_ms < 0,
                         .spec = cfg->spec, .spec_k_max = cfg->spec_k_max};
    if (cfg->env) nc.env = *cfg->env;
    if ((st = bt_ne_create(&nc, &s->ne))) goto fail;
    s->sched = s->ne->sched;
    s->calls.sched = s->sched;
    s->n_vocab = s->ne->n_vocab;
    s->max_context = s->ne->max_context;
    if ((st = register_metrics(s, cfg->metrics)) || (st = bt_ne_register_metrics(s->ne, cfg->metrics))) goto fail;
    s->calls.rejected = s->requests[RS_REJECTED];
    s->calls.invalid = s->requests[RS_INVALID];
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Decode/Run", BT_RPC_SERVER_STREAMING,
                                       &baton__v1__decode_run_request__descriptor, run_handler, s)))
        goto fail;
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Decode/Abort", BT_RPC_UNARY,
                                       &baton__v1__abort_request__descriptor, abort_handler, s)))
        goto fail;
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Decode/Embed", BT_RPC_UNARY,
                                       &baton__v1__decode_embed_request__descriptor, embed_handler, s)))
        goto fail;
    *out = s;
    return BT_OK;
fail:
    decode_service_destroy(s);
    return st;
}

bt_status decode_service_node_info(const void *svc, mbr_node_info_t *info)
{
    const decode_service_t *s = svc;
    return bt_ne_node_info(s->ne, MBR_ROLE_DECODE, info);
}

void decode_service_summary(const void *svc, char *buf, size_t cap)
{
    const decode_service_t *s = svc;
    bt_ne_summary(s->ne, buf, cap);
}

int32_t decode_service_inflight(const void *svc)
{
    const decode_service_t *s = svc;
    return bt_calls_inflight(&s->calls);
}

void decode_service_load(void *svc, mbr_load_report_t *out)
{
    decode_service_t *s = svc;
    bt_sched_stats st;
    bt_ne_load(s->ne, out, &st);

    pthread_mutex_lock(&s->load_mu);
    if (st.prefix_hit_tokens > s->load_hits) metrics_counter_add(s->prefix_hits, st.prefix_hit_tokens - s->load_hits);
    if (st.prefix_query_tokens > s->load_queries)
        metrics_counter_add(s->prefix_queries, st.prefix_query_tokens - s->load_queries);
    s->load_hits = st.prefix_hit_tokens;
    s->load_queries = st.prefix_query_tokens;
    pthread_mutex_unlock(&s->load_mu);

    int32_t inflight = bt_calls_inflight(&s->calls);
    int32_t queued = inflight - st.running > st.waiting ? inflight - st.running : st.waiting;
    out->queued_requests = queued > 0 ? queued : 0;
    out->queued_prefill_tokens = bt_calls_queued_prefill_tokens(&s->calls);
}

void decode_service_destroy(void *svc)
{
    decode_service_t *s = svc;
    if (!s) return;
    bt_ne_destroy(s->ne); /* aborts what is left; with the RPC server shut down nothing is */
    bt_rpc_chcache_destroy(s->channels);
    bt_calls_destroy(&s->calls);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->load_mu);
    pthread_mutex_destroy(&s->embeds_mu);
    free(s);
}
