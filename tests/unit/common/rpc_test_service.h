/* A test implementation of baton.v1.Generation over common/rpc, shared by test_rpc and rpc_test_server.
 *   Tokenize:   echo: token_ids = the bytes of text. text "hang": no answer until the call is cancelled
 *               (the cancel callback finishes it).
 *   Generate:   max_tokens messages, token_ids = {i}, from a producer thread; the last has finish_reason LENGTH.
 *               prompt text selects a mode: "" fast, "slow" (2 ms between messages), "hang" (one message, then
 *               wait for the cancel), "fail" (3 messages then INVALID_ARGUMENT), "meta:KEY" (one message whose text
 *               is request metadata KEY), "peer" (one message whose text is the caller's verified certificate
 *               identity, bt_rpc_call_peer_identity, or "<none>").
 *   Detokenize: text = "cancelled=C finished=F active=A" (counters of Generate/Tokenize calls).
 *   ListModels: one model "test" whose `created` is the call's remaining deadline in ms (-1: none). */
#ifndef BATON_TEST_RPC_SERVICE_H
#define BATON_TEST_RPC_SERVICE_H

#include "common/rpc.h"

#include <pthread.h>
#include <stdatomic.h>

typedef struct rpc_test_svc {
    atomic_int cancelled; /* calls whose cancellation the service saw (send refused or callback) */
    atomic_int finished;  /* calls finished, any status */
    atomic_long sent;     /* messages sent */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int active;           /* producer threads and hanging unary calls not yet finished */
} rpc_test_svc;

void rpc_test_svc_init(rpc_test_svc *svc);
void rpc_test_svc_destroy(rpc_test_svc *svc);

/* Adds the four Generation methods. */
bt_status rpc_test_svc_register(rpc_test_svc *svc, bt_rpc_server_t *srv);

/* Waits until no call is active, up to timeout_ms. Returns 1 when idle. */
int rpc_test_svc_wait_idle(rpc_test_svc *svc, int timeout_ms);

#endif
