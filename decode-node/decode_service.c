/* baton.v1.Decode over the engine scheduler (see decode_service.h).
 *
 * A Run call becomes a dec_call: the RPC thread validates and submits it; from then on the engine thread owns the
 * stream (emit callbacks send one message per token and finish the call on the last event). Two references keep a
 * dec_call alive: the RPC handler's (until it has registered the cancel callback) and the scheduler's (until the
 * final event). The cancel callback only calls bt_sched_abort, so it never needs the call's lock. */
#include "decode-node/decode_service.h"

#include "baton/v1/node.pb-c.h"
#include "common/log.h"
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
#include <time.h>
#include <unistd.h>

#define DEC_LOG "decode"
#define DEC_MAX_RUNNING 256
#define DEC_MAX_CONTEXT 8192
#define DEC_MAX_EOG 16
#define DEC_DEFAULT_KV_MEM ((size_t)256 << 20) /* the scheduler's default */

typedef struct dec_call dec_call;

enum { RS_OK, RS_ABORTED, RS_CANCELLED, RS_TIMEOUT, RS_ERROR, RS_INVALID, RS_REJECTED, RS_N };
static const char *const RS_NAMES[RS_N] = {"ok", "aborted", "cancelled", "timeout", "error", "invalid", "rejected"};

struct decode_service {
    char node_id[MBR_NODE_ID_MAX];
    char fingerprint[17]; /* model fingerprint as 16 lower-case hex digits */
    bt_model *m;
    bt_backend *be;
    bt_sched *sched;
    int32_t n_vocab, max_context, max_running, max_batch_tokens, max_inflight;
    int64_t kv_blocks_total;
    size_t kv_block_bytes; /* all layers */

    pthread_mutex_t mu; /* guards the list of calls in flight (for Abort by request id) */
    dec_call *calls;
    atomic_int inflight;
    atomic_llong queued_prefill_tokens; /* prompt tokens of calls that have no first token yet */
    atomic_ullong seed_counter;

    metrics_histogram_t *ttft, *tpot, *e2e, *queue_time;
    metrics_counter_t *prompt_tokens, *gen_tokens, *prefix_hits, *prefix_queries;
    metrics_counter_t *requests[RS_N];
    metrics_gauge_t *running, *waiting, *kv_used, *kv_capacity;

    pthread_mutex_t load_mu; /* the load sampler's memory, below */
    double load_t;
    uint64_t load_computed, load_generated, load_hits, load_queries;
    double prefill_rate, decode_rate;
};

struct dec_call {
    decode_service_t *svc;
    bt_rpc_call_t *call;
    atomic_int refs;
    pthread_mutex_t mu; /* orders finish against the cancel callback's registration */
    int finished;
    atomic_ullong req_id; /* scheduler id, 0 until submitted */
    atomic_int abort_pending, abort_rpc;
    atomic_int send_status; /* bt_status of a failed send: the scheduler is asked to abort */
    char request_id[128];
    int logprobs;
    uint32_t n_prev;     /* tokens delivered before (migration): offsets continue after them */
    int32_t n_prompt;    /* the client's prompt tokens */
    int32_t n_submitted; /* prompt + previously delivered tokens, as submitted */
    double t_arrive, t_first, t_last;
    int32_t n_out;
    int sent_first;
    dec_call *prev, *next;
};

/* ---- calls ---- */

static void call_unref(dec_call *c)
{
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void list_remove(decode_service_t *s, dec_call *c)
{
    pthread_mutex_lock(&s->mu);
    if (c->prev) c->prev->next = c->next;
    else if (s->calls == c) s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
    pthread_mutex_unlock(&s->mu);
}

static void on_cancel(void *ud, bt_rpc_call_t *call)
{
    dec_call *c = ud;
    uint64_t id = atomic_load(&c->req_id);
    if (id) bt_sched_abort(c->svc->sched, id);
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

/* Engine thread: one message per token; the last event finishes the call. */
static void on_event(void *user, const bt_sched_event *ev)
{
    dec_call *c = user;
    decode_service_t *s = c->svc;
    double now = bt_sched_now();
    Baton__V1__DecodeRunResponse r = BATON__V1__DECODE_RUN_RESPONSE__INIT;
    Baton__V1__TokenLogprob lp = BATON__V1__TOKEN_LOGPROB__INIT;
    Baton__V1__TokenLogprob *lpp[1] = {&lp};
    Baton__V1__TopLogprob top[BT_MAX_TOP_LOGPROBS];
    Baton__V1__TopLogprob *topp[BT_MAX_TOP_LOGPROBS];
    Baton__V1__Usage usage = BATON__V1__USAGE__INIT;
    int32_t tok = ev->token;
    int final = ev->finish != BT_END_NONE;

    if (ev->token >= 0) {
        if (c->n_out == 0) {
            c->t_first = now;
            metrics_histogram_observe(s->ttft, now - c->t_arrive);
            metrics_histogram_observe(s->queue_time, ev->queue_s);
            metrics_counter_add(s->prompt_tokens, (uint64_t)ev->n_prompt);
            atomic_fetch_sub(&s->queued_prefill_tokens, c->n_submitted);
        }
        c->n_out++;
        c->t_last = now;
        metrics_counter_inc(s->gen_tokens);
        r.offset = c->n_prev + (uint32_t)ev->index;
        r.n_token_ids = 1;
        r.token_ids = &tok;
        if (c->logprobs) {
            lp.token_id = ev->token;
            lp.logprob = ev->detail ? ev->detail->logprob : ev->logprob;
            if (ev->detail && ev->detail->n_top > 0) {
                int32_t nt = ev->detail->n_top < BT_MAX_TOP_LOGPROBS ? ev->detail->n_top : BT_MAX_TOP_LOGPROBS;
                for (int32_t i = 0; i < nt; i++) {
                    baton__v1__top_logprob__init(&top[i]);
                    top[i].token_id = ev->detail->top[i].id;
                    top[i].logprob = ev->detail->top[i].logprob;
                    topp[i] = &top[i];
                }
                lp.n_top = (size_t)nt;
                lp.top = topp;
            }
            r.n_logprobs = 1;
            r.logprobs = lpp;
        }
    }
    if (!final) {
        if (!c->sent_first) r.node_id = s->node_id;
        bt_status st = bt_rpc_call_send(c->call, &r.base);
        c->sent_first = 1;
        if (st != BT_OK && atomic_load(&c->send_status) == BT_OK) {
            atomic_store(&c->send_status, st);
            bt_sched_abort(s->sched, ev->req_id);
        }
        return;
    }

    /* last event */
    if (c->n_out == 0) atomic_fetch_sub(&s->queued_prefill_tokens, c->n_submitted);
    bt_rpc_code code = BT_RPC_OK;
    char msg[256] = "";
    int rs = RS_OK;
    bt_status send_st = atomic_load(&c->send_status);
    switch (ev->finish) {
    case BT_END_STOP: r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_STOP; break;
    case BT_END_LENGTH: r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH; break;
    case BT_END_ABORT:
        if (bt_rpc_call_cancelled(c->call) || send_st == BT_ERR_CANCELLED) {
            code = BT_RPC_CANCELLED;
            rs = RS_CANCELLED;
            snprintf(msg, sizeof msg, "cancelled by the client");
        } else if (send_st == BT_ERR_EXHAUSTED) {
            code = BT_RPC_RESOURCE_EXHAUSTED;
            rs = RS_ABORTED;
            snprintf(msg, sizeof msg, "the client reads too slowly: stream buffer full");
        } else if (send_st != BT_OK) {
            code = BT_RPC_INTERNAL;
            rs = RS_ERROR;
            snprintf(msg, sizeof msg, "sending failed: %s", bt_status_str(send_st));
        } else {
            r.finish_reason = BATON__V1__FINISH_REASON__FINISH_REASON_ABORT; /* Decode/Abort or shutdown */
            rs = RS_ABORTED;
        }
        break;
    case BT_END_TIMEOUT:
        code = BT_RPC_DEADLINE_EXCEEDED;
        rs = RS_TIMEOUT;
        snprintf(msg, sizeof msg, "deadline exceeded after %d generated tokens", c->n_out);
        break;
    default:
        code = BT_RPC_INTERNAL;
        rs = RS_ERROR;
        snprintf(msg, sizeof msg, "engine step failed: %s", bt_status_str(ev->error));
        break;
    }
    if (code == BT_RPC_OK) {
        usage.prompt_tokens = (uint32_t)c->n_prompt;
        usage.completion_tokens = c->n_prev + (uint32_t)c->n_out;
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens;
        usage.cached_prompt_tokens = (uint32_t)(ev->n_cached < c->n_prompt ? ev->n_cached : c->n_prompt);
        r.usage = &usage;
        if (!c->sent_first) r.node_id = s->node_id;
        bt_rpc_call_send(c->call, &r.base);
    }
    metrics_counter_inc(s->requests[rs]);
    metrics_histogram_observe(s->e2e, now - c->t_arrive);
    if (c->n_out >= 2) metrics_histogram_observe(s->tpot, (c->t_last - c->t_first) / (c->n_out - 1));
    if (rs == RS_ERROR) BT_WARN(DEC_LOG, "request %s: %s", c->request_id, msg);
    if (bt_log_enabled(BT_LOG_DEBUG))
        BT_DEBUG(DEC_LOG,
                 "request %s: prompt %d (+%u delivered, %d cached), generated %d, finish %s%s%s, ttft %.3f s, "
                 "e2e %.3f s",
                 c->request_id, c->n_prompt, c->n_prev, ev->n_cached, c->n_out, end_name(ev->finish),
                 msg[0] ? ": " : "", msg, c->n_out ? c->t_first - c->t_arrive : 0.0, now - c->t_arrive);

    /* leave the list first: once the client sees the end of the stream, Abort must no longer find the call */
    list_remove(s, c);
    pthread_mutex_lock(&c->mu);
    c->finished = 1;
    bt_rpc_call_finish(c->call, code, msg[0] ? msg : NULL);
    pthread_mutex_unlock(&c->mu);
    atomic_fetch_sub(&s->inflight, 1);
    call_unref(c);
}

static uint64_t random_seed(decode_service_t *s)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    z += 0x9e3779b97f4a7c15ull * (atomic_fetch_add(&s->seed_counter, 1) + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Fills *rp from the request; returns the gRPC code and a message for the client. */
static bt_rpc_code run_params(decode_service_t *s, const Baton__V1__DecodeRunRequest *q, bt_req_params *rp,
                              char *err, size_t cap)
{
    if (q->model_fingerprint[0] && strcasecmp(q->model_fingerprint, s->fingerprint) != 0) {
        snprintf(err, cap, "model_fingerprint %.32s does not match this node's model %s (%s)", q->model_fingerprint,
                 s->fingerprint, s->m->name);
        return BT_RPC_FAILED_PRECONDITION;
    }
    if (q->n_prompt_token_ids == 0) {
        snprintf(err, cap, "prompt_token_ids is empty");
        return BT_RPC_INVALID_ARGUMENT;
    }
    for (size_t i = 0; i < q->n_prompt_token_ids; i++)
        if (q->prompt_token_ids[i] < 0 || q->prompt_token_ids[i] >= s->n_vocab) {
            snprintf(err, cap, "prompt_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
                     q->prompt_token_ids[i], s->n_vocab);
            return BT_RPC_INVALID_ARGUMENT;
        }
    for (size_t i = 0; i < q->n_generated_token_ids; i++)
        if (q->generated_token_ids[i] < 0 || q->generated_token_ids[i] >= s->n_vocab) {
            snprintf(err, cap, "generated_token_ids[%zu] = %d is outside the vocabulary [0, %d)", i,
                     q->generated_token_ids[i], s->n_vocab);
            return BT_RPC_INVALID_ARGUMENT;
        }
    bt_sampling *sp = &rp->sampling;
    const Baton__V1__SamplingParams *p = q->sampling;
    if (p) {
        if (p->temperature_opt_case == BATON__V1__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE)
            sp->temperature = p->temperature;
        if (p->top_p_opt_case == BATON__V1__SAMPLING_PARAMS__TOP_P_OPT_TOP_P) sp->top_p = p->top_p;
        if (p->top_k_opt_case == BATON__V1__SAMPLING_PARAMS__TOP_K_OPT_TOP_K) sp->top_k = p->top_k;
        if (p->min_p_opt_case == BATON__V1__SAMPLING_PARAMS__MIN_P_OPT_MIN_P) sp->min_p = p->min_p;
        if (p->repetition_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__REPETITION_PENALTY_OPT_REPETITION_PENALTY)
            sp->repetition_penalty = p->repetition_penalty;
        if (p->presence_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__PRESENCE_PENALTY_OPT_PRESENCE_PENALTY)
            sp->presence_penalty = p->presence_penalty;
        if (p->frequency_penalty_opt_case == BATON__V1__SAMPLING_PARAMS__FREQUENCY_PENALTY_OPT_FREQUENCY_PENALTY)
            sp->frequency_penalty = p->frequency_penalty;
        if (p->n_logit_bias > BT_MAX_LOGIT_BIAS) {
            snprintf(err, cap, "sampling.logit_bias has %zu entries (at most %d)", p->n_logit_bias,
                     BT_MAX_LOGIT_BIAS);
            return BT_RPC_INVALID_ARGUMENT;
        }
        for (size_t i = 0; i < p->n_logit_bias; i++) {
            const Baton__V1__LogitBias *e = p->logit_bias[i];
            if (e->token_id < 0 || e->token_id >= s->n_vocab) {
                snprintf(err, cap, "sampling.logit_bias[%zu].token_id = %d is outside the vocabulary [0, %d)", i,
                         e->token_id, s->n_vocab);
                return BT_RPC_INVALID_ARGUMENT;
            }
            sp->logit_bias[i] = (bt_logit_bias){.id = e->token_id, .bias = e->bias};
        }
        sp->n_logit_bias = (int32_t)p->n_logit_bias;
    }
    sp->seed = p && p->seed_opt_case == BATON__V1__SAMPLING_PARAMS__SEED_OPT_SEED ? p->seed : random_seed(s);
    /* sample i of an n > 1 fan-out: its own RNG stream of the same seed */
    if (q->sample_index > (uint32_t)BT_MAX_N - 1) {
        snprintf(err, cap, "sample_index %u is out of range (at most %d)", q->sample_index, BT_MAX_N - 1);
        return BT_RPC_INVALID_ARGUMENT;
    }
    rp->sample_index = (int32_t)q->sample_index;
    sp->n = (int32_t)q->sample_index + 1;
    if (q->n_stop_token_ids > BT_MAX_STOP_IDS) {
        snprintf(err, cap, "stop_token_ids has %zu entries (at most %d)", q->n_stop_token_ids, BT_MAX_STOP_IDS);
        return BT_RPC_INVALID_ARGUMENT;
    }
    sp->n_stop_ids = (int32_t)q->n_stop_token_ids;
    for (size_t i = 0; i < q->n_stop_token_ids; i++) sp->stop_ids[i] = q->stop_token_ids[i];
    sp->ignore_eos = q->ignore_eos;
    sp->logprobs = q->logprobs;
    if (q->top_logprobs > BT_MAX_TOP_LOGPROBS) {
        snprintf(err, cap, "top_logprobs is %u (at most %d)", q->top_logprobs, BT_MAX_TOP_LOGPROBS);
        return BT_RPC_INVALID_ARGUMENT;
    }
    sp->top_logprobs = (int32_t)q->top_logprobs;
    if (bt_sampling_check_vocab(sp, s->n_vocab) != BT_OK) {
        snprintf(err, cap, "%s", bt_last_error());
        return BT_RPC_INVALID_ARGUMENT;
    }
    int64_t n_total = (int64_t)q->n_prompt_token_ids + (int64_t)q->n_generated_token_ids;
    if (q->max_tokens > 0) {
        if (q->n_generated_token_ids >= q->max_tokens) {
            snprintf(err, cap, "max_tokens %u already reached by the %zu generated_token_ids", q->max_tokens,
                     q->n_generated_token_ids);
            return BT_RPC_INVALID_ARGUMENT;
        }
        sp->max_tokens = (int32_t)(q->max_tokens - q->n_generated_token_ids);
    }
    if (n_total >= s->max_context || (q->max_tokens > 0 && n_total + sp->max_tokens > s->max_context)) {
        snprintf(err, cap, "prompt of %lld tokens + max_tokens %u exceeds the context of %d tokens",
                 (long long)n_total, q->max_tokens, s->max_context);
        return BT_RPC_INVALID_ARGUMENT;
    }
    return BT_RPC_OK;
}

static void reject(decode_service_t *s, bt_rpc_call_t *call, bt_rpc_code code, const char *rid, const char *msg)
{
    metrics_counter_inc(s->requests[code == BT_RPC_RESOURCE_EXHAUSTED ? RS_REJECTED : RS_INVALID]);
    BT_DEBUG(DEC_LOG, "request %s refused: %s: %s", rid, bt_rpc_code_str(code), msg);
    bt_rpc_call_finish(call, code, msg);
}

static void run_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    decode_service_t *s = ud;
    const Baton__V1__DecodeRunRequest *q = (const Baton__V1__DecodeRunRequest *)msg;
    double t_arrive = bt_sched_now();
    const char *rid = q->request_id[0] ? q->request_id : "-";
    char err[320];
    bt_req_params rp = bt_req_params_default();
    rp.sampling = bt_sampling_default();
    bt_rpc_code code = run_params(s, q, &rp, err, sizeof err);
    if (code != BT_RPC_OK) {
        reject(s, call, code, rid, err);
        return;
    }
    int64_t dl = bt_rpc_call_deadline_ms(call);
    if (dl != INT64_MAX) rp.deadline = (double)dl / 1000.0;
    if (atomic_fetch_add(&s->inflight, 1) >= s->max_inflight) {
        atomic_fetch_sub(&s->inflight, 1);
        snprintf(err, sizeof err, "decode node %s is at capacity (%d requests in flight)", s->node_id,
                 s->max_inflight);
        reject(s, call, BT_RPC_RESOURCE_EXHAUSTED, rid, err);
        return;
    }
    size_t n = q->n_prompt_token_ids + q->n_generated_token_ids;
    int32_t *ids = malloc(n * sizeof *ids);
    dec_call *c = calloc(1, sizeof *c);
    if (!ids || !c) {
        free(ids);
        free(c);
        atomic_fetch_sub(&s->inflight, 1);
        reject(s, call, BT_RPC_RESOURCE_EXHAUSTED, rid, "out of memory");
        return;
    }
    memcpy(ids, q->prompt_token_ids, q->n_prompt_token_ids * sizeof *ids);
    if (q->n_generated_token_ids)
        memcpy(ids + q->n_prompt_token_ids, q->generated_token_ids, q->n_generated_token_ids * sizeof *ids);
    c->svc = s;
    c->call = call;
    atomic_init(&c->refs, 2);
    pthread_mutex_init(&c->mu, NULL);
    snprintf(c->request_id, sizeof c->request_id, "%s", rid);
    c->logprobs = q->logprobs;
    c->n_prev = (uint32_t)q->n_generated_token_ids;
    c->n_prompt = (int32_t)q->n_prompt_token_ids;
    c->n_submitted = (int32_t)n;
    c->t_arrive = t_arrive;
    atomic_fetch_add(&s->queued_prefill_tokens, c->n_submitted);
    pthread_mutex_lock(&s->mu);
    c->next = s->calls;
    if (s->calls) s->calls->prev = c;
    s->calls = c;
    pthread_mutex_unlock(&s->mu);

    uint64_t id = 0;
    bt_status st = bt_sched_submit(s->sched, ids, (int32_t)n, &rp, on_event, c, &id);
    free(ids);
    if (st != BT_OK) {
        list_remove(s, c);
        atomic_fetch_sub(&s->queued_prefill_tokens, c->n_submitted);
        atomic_fetch_sub(&s->inflight, 1);
        snprintf(err, sizeof err, "%s", bt_last_error());
        pthread_mutex_destroy(&c->mu);
        free(c);
        reject(s, call, st == BT_ERR_EXHAUSTED ? BT_RPC_RESOURCE_EXHAUSTED : bt_rpc_code_from_status(st), rid, err);
        return;
    }
    atomic_store(&c->req_id, id);
    if (atomic_load(&c->abort_pending)) bt_sched_abort(s->sched, id);
    pthread_mutex_lock(&c->mu);
    if (!c->finished) bt_rpc_call_on_cancel(call, on_cancel, c);
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

static void abort_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    decode_service_t *s = ud;
    const Baton__V1__AbortRequest *q = (const Baton__V1__AbortRequest *)msg;
    Baton__V1__AbortResponse r = BATON__V1__ABORT_RESPONSE__INIT;
    if (q->request_id[0]) {
        pthread_mutex_lock(&s->mu);
        for (dec_call *c = s->calls; c; c = c->next) {
            if (strcmp(c->request_id, q->request_id) != 0) continue;
            atomic_store(&c->abort_rpc, 1);
            atomic_store(&c->abort_pending, 1);
            uint64_t id = atomic_load(&c->req_id);
            if (id) bt_sched_abort(s->sched, id);
            r.found = 1;
        }
        pthread_mutex_unlock(&s->mu);
    }
    BT_DEBUG(DEC_LOG, "abort %s: %s", q->request_id, r.found ? "found" : "unknown or finished");
    bt_rpc_call_send(call, &r.base);
    bt_rpc_call_finish(call, BT_RPC_OK, NULL);
}

/* ---- life cycle ---- */

static bt_status register_metrics(decode_service_t *s, metrics_registry_t *reg)
{
    metrics_family_t *f;
    bt_status st;
#define STD_SERIES(id, kind, dst)                                                                                   \
    do {                                                                                                            \
        if ((st = metrics_std_register(reg, id, &f))) return st;                                                    \
        if ((st = metrics_family_##kind(f, NULL, dst))) return st;                                                  \
    } while (0)
    STD_SERIES(METRICS_STD_TTFT, histogram, &s->ttft);
    STD_SERIES(METRICS_STD_TPOT, histogram, &s->tpot);
    STD_SERIES(METRICS_STD_E2E_LATENCY, histogram, &s->e2e);
    STD_SERIES(METRICS_STD_QUEUE_TIME, histogram, &s->queue_time);
    STD_SERIES(METRICS_STD_PROMPT_TOKENS, counter, &s->prompt_tokens);
    STD_SERIES(METRICS_STD_GENERATION_TOKENS, counter, &s->gen_tokens);
    STD_SERIES(METRICS_STD_PREFIX_CACHE_HITS, counter, &s->prefix_hits);
    STD_SERIES(METRICS_STD_PREFIX_CACHE_QUERIES, counter, &s->prefix_queries);
    STD_SERIES(METRICS_STD_RUNNING_SEQUENCES, gauge, &s->running);
    STD_SERIES(METRICS_STD_WAITING_REQUESTS, gauge, &s->waiting);
    STD_SERIES(METRICS_STD_KV_BLOCKS_USED, gauge, &s->kv_used);
    STD_SERIES(METRICS_STD_KV_BLOCKS_CAPACITY, gauge, &s->kv_capacity);
#undef STD_SERIES
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
    snprintf(s->node_id, sizeof s->node_id, "%s", cfg->node_id ? cfg->node_id : "");
    s->max_inflight = cfg->max_inflight > 0 ? cfg->max_inflight : DECODE_MAX_INFLIGHT;
    bt_status st;
    tok_tokenizer *tok = NULL;
    if ((st = bt_model_load(cfg->model_path, &s->m))) {
        bt_fail(st, "cannot load model %s: %s", cfg->model_path, bt_last_error());
        goto fail;
    }
    snprintf(s->fingerprint, sizeof s->fingerprint, "%016" PRIx64, s->m->fingerprint);
    s->n_vocab = s->m->hp.n_vocab;
    s->max_context = s->m->hp.n_ctx_train > 0 && s->m->hp.n_ctx_train < DEC_MAX_CONTEXT ? s->m->hp.n_ctx_train
                                                                                       : DEC_MAX_CONTEXT;
    /* A sequence can never outgrow the pool: clamp the context so that max_tokens 0 ("up to the context") and
     * the capacity published to the router stay servable. */
    s->kv_block_bytes = bt_kv_block_stride(&s->m->hp, BT_KV_F16) * (size_t)s->m->hp.n_layer;
    size_t kv_mem = cfg->kv_mem ? cfg->kv_mem : DEC_DEFAULT_KV_MEM;
    size_t pool_tokens = kv_mem / s->kv_block_bytes * BT_KV_BLOCK;
    if (pool_tokens < BT_KV_BLOCK) {
        st = bt_fail(BT_ERR_INVALID, "--kv-mem %zu bytes holds no KV block of %s (%zu bytes each)", kv_mem,
                     s->m->name, s->kv_block_bytes);
        goto fail;
    }
    if (pool_tokens < (size_t)s->max_context) {
        BT_INFO(DEC_LOG, "context limited to %zu tokens by the KV pool (%zu MiB); raise --kv-mem for %d", pool_tokens,
                kv_mem >> 20, s->max_context);
        s->max_context = (int32_t)pool_tokens;
    }
    s->max_running = DEC_MAX_RUNNING;
    s->max_batch_tokens = cfg->max_batch_tokens > 0 ? cfg->max_batch_tokens : 512;
    if ((st = tok_create(s->m->file, &tok))) {
        bt_fail(st, "cannot read the tokenizer of %s: %s", cfg->model_path, bt_last_error());
        goto fail;
    }
    int32_t eog[DEC_MAX_EOG];
    int32_t n_eog = 0;
    for (int32_t i = 0; i < tok_n_vocab(tok) && n_eog < DEC_MAX_EOG; i++)
        if (tok_is_eog(tok, i)) eog[n_eog++] = i;
    tok_free(tok);
    tok = NULL;
    if ((st = bt_backend_cpu_create(cfg->threads, &s->be))) goto fail;
    bt_sched_config sc = {0};
    sc.kv_mem = cfg->kv_mem;
    sc.max_batch_tokens = s->max_batch_tokens;
    sc.max_running = s->max_running;
    sc.max_context = s->max_context;
    sc.eog_ids = eog;
    sc.n_eog = n_eog;
    if ((st = bt_sched_create(s->m, s->be, &sc, &s->sched))) {
        bt_fail(st, "cannot create the scheduler: %s", bt_last_error());
        goto fail;
    }
    bt_sched_stats ss;
    bt_sched_get_stats(s->sched, &ss);
    s->kv_blocks_total = ss.kv_blocks_total;
    if ((st = register_metrics(s, cfg->metrics))) goto fail;
    metrics_gauge_set(s->kv_capacity, (double)s->kv_blocks_total);
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Decode/Run", BT_RPC_SERVER_STREAMING,
                                       &baton__v1__decode_run_request__descriptor, run_handler, s)))
        goto fail;
    if ((st = bt_rpc_server_add_method(cfg->rpc, "/baton.v1.Decode/Abort", BT_RPC_UNARY,
                                       &baton__v1__abort_request__descriptor, abort_handler, s)))
        goto fail;
    if ((st = bt_sched_start(s->sched))) goto fail;
    s->load_t = bt_sched_now();
    *out = s;
    return BT_OK;
fail:
    tok_free(tok);
    decode_service_destroy(s);
    return st;
}

void decode_service_node_info(const decode_service_t *s, mbr_node_info_t *info)
{
    snprintf(info->model, sizeof info->model, "%s", s->fingerprint);
    info->role = MBR_ROLE_DECODE;
    info->kv_blocks_total = s->kv_blocks_total;
    info->kv_block_tokens = BT_KV_BLOCK;
    info->max_running = s->max_running;
    info->max_context = s->max_context;
}

void decode_service_summary(const decode_service_t *s, char *buf, size_t cap)
{
    snprintf(buf, cap,
             "model %s (fingerprint %s, %d layers, vocab %d) | cpu %s, %d threads, %d-bit activations | "
             "KV %lld blocks x %d tokens (%.0f MiB f16) | batch %d tokens, %d running, context %d",
             s->m->name, s->fingerprint, s->m->hp.n_layer, s->n_vocab, bt_backend_cpu_isa(s->be),
             bt_backend_cpu_threads(s->be), bt_backend_cpu_act_bits(s->be), (long long)s->kv_blocks_total,
             BT_KV_BLOCK, (double)s->kv_block_bytes * (double)s->kv_blocks_total / (1024.0 * 1024.0),
             s->max_batch_tokens, s->max_running, s->max_context);
}

int32_t decode_service_inflight(const decode_service_t *s) { return atomic_load(&s->inflight); }

static double ewma(double old, double v) { return old > 0 ? 0.7 * old + 0.3 * v : v; }

void decode_service_load(void *svc, mbr_load_report_t *out)
{
    decode_service_t *s = svc;
    bt_sched_stats st;
    bt_sched_get_stats(s->sched, &st);
    metrics_gauge_set(s->running, st.running);
    metrics_gauge_set(s->waiting, st.waiting);
    metrics_gauge_set(s->kv_used, st.kv_blocks_used);
    metrics_gauge_set(s->kv_capacity, st.kv_blocks_total);

    pthread_mutex_lock(&s->load_mu);
    double now = bt_sched_now(), dt = now - s->load_t;
    if (st.prefix_hit_tokens > s->load_hits) metrics_counter_add(s->prefix_hits, st.prefix_hit_tokens - s->load_hits);
    if (st.prefix_query_tokens > s->load_queries)
        metrics_counter_add(s->prefix_queries, st.prefix_query_tokens - s->load_queries);
    s->load_hits = st.prefix_hit_tokens;
    s->load_queries = st.prefix_query_tokens;
    if (dt > 0) {
        /* Rates only from intervals with work: an idle node keeps its last measured speed. */
        if (st.computed_prompt_tokens > s->load_computed)
            s->prefill_rate = ewma(s->prefill_rate, (double)(st.computed_prompt_tokens - s->load_computed) / dt);
        if (st.generated_tokens > s->load_generated)
            s->decode_rate = ewma(s->decode_rate, (double)(st.generated_tokens - s->load_generated) / dt);
        s->load_computed = st.computed_prompt_tokens;
        s->load_generated = st.generated_tokens;
        s->load_t = now;
    }
    out->prefill_tok_s = s->prefill_rate;
    out->decode_tok_s = s->decode_rate;
    pthread_mutex_unlock(&s->load_mu);

    int32_t inflight = atomic_load(&s->inflight);
    int32_t queued = inflight - st.running > st.waiting ? inflight - st.running : st.waiting;
    out->queued_requests = queued > 0 ? queued : 0;
    long long qp = atomic_load(&s->queued_prefill_tokens);
    out->queued_prefill_tokens = qp > 0 ? qp : 0;
    out->running_seqs = st.running;
    out->kv_blocks_total = st.kv_blocks_total;
    out->kv_blocks_free = st.kv_blocks_total - st.kv_blocks_used;
}

void decode_service_destroy(decode_service_t *s)
{
    if (!s) return;
    bt_sched_destroy(s->sched); /* aborts what is left; with the RPC server shut down nothing is */
    bt_backend_destroy(s->be);
    bt_model_free(s->m);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->load_mu);
    free(s);
}
