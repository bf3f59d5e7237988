/* Run-call handling that the prefill and decode services share: the call's reference counts, the list of calls in
 * flight (for Abort by request id), the admission bound, submission to the scheduler with its undo, the cancel
 * callback, and the conversion of a call's deadline into a timeout.
 *
 * A role's call struct embeds a bt_call_t as its first member. Two references keep it alive: the RPC handler's,
 * which bt_calls_submit drops once the cancel callback is registered, and the engine side's, which the role drops
 * with bt_call_done after answering. The cancel callback only asks the scheduler to abort, so it never takes the
 * call's lock; bt_call_finish takes it so that the callback is never registered after the call finished.
 * Lock order: a bt_calls_t's mu, then a call's mu, never the other way. */
#ifndef BATON_NODE_CALLS_H
#define BATON_NODE_CALLS_H

#include "common/list.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "engine/scheduler.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define BT_CALL_ID_MAX 128

typedef struct bt_call bt_call_t;
typedef struct bt_calls bt_calls_t;

/* Frees the role's call (the bt_call_t lives inside it). Runs once, when the last reference goes. */
typedef void (*bt_call_free_fn)(bt_call_t *c);

struct bt_call {
    bt_calls_t *calls;
    bt_rpc_call_t *rpc;
    atomic_int refs;
    pthread_mutex_t mu;       /* finished; roles may guard their own call state with it too */
    int finished;             /* bt_rpc_call_finish done */
    atomic_ullong sched_id;   /* the scheduler's request id: 0 until bt_sched_submit returned or a hook of the
                               * scheduler's that runs earlier (decode's remote prefill) stored it */
    atomic_int abort_pending; /* Abort or a client cancel arrived; read after submission and by the role */
    char request_id[BT_CALL_ID_MAX];
    bt_call_free_fn free_fn;
    bt_list_node link;        /* in calls->list, under calls->mu */
};

struct bt_calls {
    pthread_mutex_t mu;          /* the list */
    bt_list list;                /* bt_call_t by link: calls in flight */
    bt_sched *sched;             /* set by the role once its engine exists, before the first call */
    const char *log;             /* log tag of the role */
    int32_t max_inflight;
    atomic_int inflight;                /* admitted and not yet done */
    atomic_llong queued_prefill_tokens; /* prompt tokens of calls that have no first token yet */
    metrics_counter_t *rejected, *invalid; /* what bt_calls_reject counts; NULL counts nothing */
};

/* Initialises an empty list admitting at most max_inflight calls. log must outlive l. Can't fail. */
void bt_calls_init(bt_calls_t *l, int32_t max_inflight, const char *log);
/* Frees the lock; every call must be done. */
void bt_calls_destroy(bt_calls_t *l);

/* Counts one call in flight: 1, or 0 (nothing counted) when max_inflight are already in flight. Can't block. */
int bt_calls_admit(bt_calls_t *l);
/* Returns an admission that never became a submitted call. */
void bt_calls_leave(bt_calls_t *l);
/* Calls admitted and not yet done. Can't fail. */
int32_t bt_calls_inflight(const bt_calls_t *l);
/* Prompt tokens still waiting for their first token, never negative. Can't fail. */
int64_t bt_calls_queued_prefill_tokens(const bt_calls_t *l);

/* Refuses a call that was never submitted: counts it (RESOURCE_EXHAUSTED as rejected, anything else as invalid),
 * logs at debug level and finishes the RPC with code and msg. */
void bt_calls_reject(bt_calls_t *l, bt_rpc_call_t *rpc, bt_rpc_code code, const char *request_id, const char *msg);

/* Sets up c for rpc with both references (the handler's and the engine side's). request_id is truncated to
 * BT_CALL_ID_MAX - 1 bytes. Can't fail. */
void bt_call_init(bt_call_t *c, bt_calls_t *l, bt_rpc_call_t *rpc, const char *request_id, bt_call_free_fn free_fn);
/* One more reference, for a helper thread that outlives the engine's events. */
void bt_call_ref(bt_call_t *c);
/* Drops a reference; the last one calls free_fn. */
void bt_call_unref(bt_call_t *c);

/* Lists c, counts queued_tokens as waiting for prefill and submits ids to the scheduler with on_event(c, ...).
 * Then takes over from the handler: aborts at once if an Abort came meanwhile, registers the cancel callback unless
 * the call already finished, and drops the handler's reference, so the handler must not touch c afterwards.
 * On a scheduler error everything is undone (unlisted, uncounted, the call freed, the admission returned) and the
 * RPC is rejected with the error; the status is returned. The call must have been admitted. */
bt_status bt_calls_submit(bt_calls_t *l, bt_call_t *c, const int32_t *ids, int32_t n, const bt_req_params *rp,
                          bt_sched_emit_fn on_event, int64_t queued_tokens);

/* Prefill is over for n_tokens of queued prompt (first token or end). Can't fail. */
void bt_calls_prefilled(bt_calls_t *l, int64_t n_tokens);

/* Unlists c (so Abort no longer finds it), then finishes its RPC with code and msg (NULL when OK). Once per call. */
void bt_call_finish(bt_call_t *c, bt_rpc_code code, const char *msg);
/* Whether bt_call_finish ran. Takes the call's lock. */
int bt_call_finished(bt_call_t *c);
/* After answering: returns the admission and drops the engine side's reference. */
void bt_call_done(bt_call_t *c);

/* Marks every call in flight named request_id as aborting and asks the scheduler to abort those already submitted.
 * Returns how many it found. Can't block beyond the list lock. */
int bt_calls_abort(bt_calls_t *l, const char *request_id);
/* bt_rpc_handler_fn for /baton.v1.<Role>/Abort (ud: the bt_calls_t): answers AbortResponse{found}. */
void bt_calls_abort_handler(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg);

/* The call's deadline on the scheduler's clock (bt_sched_now seconds), or 0 when the client set none. */
double bt_call_deadline(const bt_rpc_call_t *rpc);
/* Milliseconds from now to deadline (seconds, 0 = none): none_ms without a deadline, else at least 1 (a deadline
 * already past still gets one try) and at most INT32_MAX. */
int bt_deadline_timeout_ms(double deadline, double now, int none_ms);

#endif
