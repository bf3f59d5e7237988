/* Run-call handling shared by the node services (see calls.h). */
#include "node/calls.h"

#include "baton/v1/node.pb-c.h"
#include "common/log.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

void bt_calls_init(bt_calls_t *l, int32_t max_inflight, const char *log)
{
    memset(l, 0, sizeof *l);
    pthread_mutex_init(&l->mu, NULL);
    l->log = log;
    l->max_inflight = max_inflight;
    atomic_init(&l->inflight, 0);
    atomic_init(&l->queued_prefill_tokens, 0);
}

void bt_calls_destroy(bt_calls_t *l) { pthread_mutex_destroy(&l->mu); }

int bt_calls_admit(bt_calls_t *l)
{
    if (atomic_fetch_add(&l->inflight, 1) < l->max_inflight) return 1;
    atomic_fetch_sub(&l->inflight, 1);
    return 0;
}

void bt_calls_leave(bt_calls_t *l) { atomic_fetch_sub(&l->inflight, 1); }

int32_t bt_calls_inflight(const bt_calls_t *l) { return atomic_load(&l->inflight); }

int64_t bt_calls_queued_prefill_tokens(const bt_calls_t *l)
{
    long long qp = atomic_load(&l->queued_prefill_tokens);
    return qp > 0 ? qp : 0;
}

void bt_calls_prefilled(bt_calls_t *l, int64_t n_tokens) { atomic_fetch_sub(&l->queued_prefill_tokens, n_tokens); }

void bt_calls_reject(bt_calls_t *l, bt_rpc_call_t *rpc, bt_rpc_code code, const char *request_id, const char *msg)
{
    metrics_counter_t *counter = code == BT_RPC_RESOURCE_EXHAUSTED ? l->rejected : l->invalid;
    if (counter) metrics_counter_inc(counter);
    BT_DEBUG(l->log, "request %s refused: %s: %s", request_id, bt_rpc_code_str(code), msg);
    bt_rpc_call_finish(rpc, code, msg);
}

void bt_call_init(bt_call_t *c, bt_calls_t *l, bt_rpc_call_t *rpc, const char *request_id, bt_call_free_fn free_fn)
{
    c->calls = l;
    c->rpc = rpc;
    atomic_init(&c->refs, 2);
    pthread_mutex_init(&c->mu, NULL);
    c->finished = 0;
    atomic_init(&c->sched_id, 0);
    atomic_init(&c->abort_pending, 0);
    snprintf(c->request_id, sizeof c->request_id, "%s", request_id);
    c->free_fn = free_fn;
    c->link.prev = c->link.next = NULL;
}

void bt_call_ref(bt_call_t *c) { atomic_fetch_add(&c->refs, 1); }

void bt_call_unref(bt_call_t *c)
{
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    pthread_mutex_destroy(&c->mu);
    c->free_fn(c);
}

static void list_insert(bt_calls_t *l, bt_call_t *c)
{
    pthread_mutex_lock(&l->mu);
    bt_list_push_front(&l->list, &c->link);
    pthread_mutex_unlock(&l->mu);
}

static void list_remove(bt_calls_t *l, bt_call_t *c)
{
    pthread_mutex_lock(&l->mu);
    bt_list_remove(&l->list, &c->link);
    pthread_mutex_unlock(&l->mu);
}

/* The RPC's cancel callback: the engine ends the request within a step and its final event answers the call. */
static void on_cancel(void *ud, bt_rpc_call_t *rpc)
{
    (void)rpc;
    bt_call_t *c = ud;
    atomic_store(&c->abort_pending, 1);
    uint64_t id = atomic_load(&c->sched_id);
    if (id) bt_sched_abort(c->calls->sched, id);
}

/* Undoes what bt_calls_submit did before the scheduler refused, then refuses the call. */
static void submit_failed(bt_calls_t *l, bt_call_t *c, bt_status st, int64_t queued_tokens)
{
    char rid[BT_CALL_ID_MAX], err[400];
    bt_rpc_call_t *rpc = c->rpc;
    snprintf(rid, sizeof rid, "%s", c->request_id);
    snprintf(err, sizeof err, "%s", bt_last_error());
    list_remove(l, c);
    bt_calls_prefilled(l, queued_tokens);
    bt_calls_leave(l);
    atomic_store(&c->refs, 1); /* the engine side never got its reference */
    bt_call_unref(c);
    bt_calls_reject(l, rpc, st == BT_ERR_EXHAUSTED ? BT_RPC_RESOURCE_EXHAUSTED : bt_rpc_code_from_status(st), rid,
                    err);
}

bt_status bt_calls_submit(bt_calls_t *l, bt_call_t *c, const int32_t *ids, int32_t n, const bt_req_params *rp,
                          bt_sched_emit_fn on_event, int64_t queued_tokens)
{
    atomic_fetch_add(&l->queued_prefill_tokens, queued_tokens);
    list_insert(l, c);
    uint64_t id = 0;
    bt_status st = bt_sched_submit(l->sched, ids, n, rp, on_event, c, &id);
    if (st != BT_OK) {
        submit_failed(l, c, st, queued_tokens);
        return st;
    }
    atomic_store(&c->sched_id, id);
    if (atomic_load(&c->abort_pending)) bt_sched_abort(l->sched, id); /* Abort arrived before the id was known */
    pthread_mutex_lock(&c->mu);
    if (!c->finished) bt_rpc_call_on_cancel(c->rpc, on_cancel, c);
    pthread_mutex_unlock(&c->mu);
    bt_call_unref(c);
    return BT_OK;
}

void bt_call_finish(bt_call_t *c, bt_rpc_code code, const char *msg)
{
    /* unlisted first: once the client sees the end of the call, Abort must no longer find it */
    list_remove(c->calls, c);
    pthread_mutex_lock(&c->mu);
    c->finished = 1;
    bt_rpc_call_finish(c->rpc, code, msg);
    pthread_mutex_unlock(&c->mu);
}

int bt_call_finished(bt_call_t *c)
{
    pthread_mutex_lock(&c->mu);
    int f = c->finished;
    pthread_mutex_unlock(&c->mu);
    return f;
}

void bt_call_done(bt_call_t *c)
{
    bt_calls_leave(c->calls);
    bt_call_unref(c);
}

int bt_calls_abort(bt_calls_t *l, const char *request_id)
{
    int found = 0;
    pthread_mutex_lock(&l->mu);
    BT_LIST_FOR(c, &l->list, bt_call_t, link) {
        if (strcmp(c->request_id, request_id) != 0) continue;
        atomic_store(&c->abort_pending, 1);
        uint64_t id = atomic_load(&c->sched_id);
        if (id) bt_sched_abort(l->sched, id);
        found++;
    }
    pthread_mutex_unlock(&l->mu);
    return found;
}

void bt_calls_abort_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    bt_calls_t *l = ud;
    const Baton__V1__AbortRequest *q = (const Baton__V1__AbortRequest *)msg;
    Baton__V1__AbortResponse r = BATON__V1__ABORT_RESPONSE__INIT;
    if (q->request_id[0]) r.found = bt_calls_abort(l, q->request_id) > 0;
    BT_DEBUG(l->log, "abort %s: %s", q->request_id, r.found ? "found" : "unknown or finished");
    bt_rpc_call_send(call, &r.base);
    bt_rpc_call_finish(call, BT_RPC_OK, NULL);
}

double bt_call_deadline(const bt_rpc_call_t *rpc)
{
    int64_t dl = bt_rpc_call_deadline_ms(rpc);
    return dl == INT64_MAX ? 0.0 : (double)dl / 1000.0;
}

int bt_deadline_timeout_ms(double deadline, double now, int none_ms)
{
    if (deadline <= 0) return none_ms;
    double left = deadline - now;
    if (left <= 0.001) return 1;
    return left * 1000.0 < INT32_MAX ? (int)(left * 1000.0) : INT32_MAX;
}
