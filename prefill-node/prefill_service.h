/* The prefill node's service: baton.v1.Prefill/{Run,Abort} (DESIGN 2 step 5, 3, 6).
 *
 * Run validates the request and its KV destination (layout fingerprint, block count, the decode node's pool
 * descriptor), connects to the decode node's pool through kvtransfer, and submits the prompt to the scheduler with
 * max_tokens 1: prompts are batched and chunked with everything else, and served from the prefix cache. In the step
 * that computes a prompt's last tokens, each layer's blocks are pushed as soon as that layer's K/V exist (the
 * forward pass's layer hook), so the transfer overlaps the rest of the step. The reply (first token, its logprobs,
 * the epoch, bytes moved) goes out once the decode node acknowledged the blocks; until then the blocks stay held.
 * Errors: INVALID_ARGUMENT / FAILED_PRECONDITION naming the field; UNAVAILABLE when the transfer failed (the decode
 * node then prefills locally); DEADLINE_EXCEEDED; CANCELLED when the decode node gave up. */
#ifndef BATON_PREFILL_SERVICE_H
#define BATON_PREFILL_SERVICE_H

#include "common/membership.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "node/node_engine.h"
#include "baton/v1/node.pb-c.h"

#include <stddef.h>
#include <stdint.h>

#define PREFILL_MAX_INFLIGHT 1024
#define PREFILL_DEFAULT_BATCH_TOKENS 1024

typedef struct prefill_config {
    const char *model_path;      /* GGUF file; required */
    int threads;                 /* compute threads, 0 = all CPUs */
    size_t kv_mem;               /* KV pool bytes, 0 = default */
    int32_t max_batch_tokens;    /* 0 = PREFILL_DEFAULT_BATCH_TOKENS */
    const char *node_id;
    metrics_registry_t *metrics; /* must outlive the service */
    bt_rpc_server_t *rpc;        /* not started yet: the methods are added to it */
    mbr_watcher_t *members;      /* the cluster's members (must outlive the service); KV is pushed only to a decode
                                  * node registered there with this model and the very pool descriptor the request
                                  * names. NULL: every destination is refused */
    const bt_ne_env_t *env;      /* the environment switches, read at the process's edge; NULL = defaults */
} prefill_config_t;

typedef struct prefill_service prefill_service_t;

/* Loads the model, starts the engine and kvtransfer (required: BT_ERR_UNAVAILABLE without UCX), registers
 * metrics and adds the Prefill methods to cfg->rpc. *out set only on success. */
bt_status prefill_service_create(const prefill_config_t *cfg, prefill_service_t **out);

/* Prefill/Run's validation of the request itself, as a pure function of the engine's limits (model fingerprint,
 * vocabulary, context, KV layout): fills *rp and returns the gRPC code, with a message in err when it is not OK. The
 * destination's membership and the caller's identity are checked apart (they need the cluster). Fuzzed by
 * tests/fuzz/fuzz_node_request.c. */
bt_rpc_code prefill_check_request(const bt_ne_t *ne, const Baton__V1__PrefillRunRequest *q, bt_req_params *rp,
                                  char *err, size_t cap);

/* The slots of bt_node_service_ops_t (node/node_main.h): svc is a prefill_service_t. */
/* Model fingerprint, capacity and the kvtransfer descriptor. BT_ERR_NOMEM. */
bt_status prefill_service_node_info(const void *svc, mbr_node_info_t *info);
void prefill_service_summary(const void *svc, char *buf, size_t cap);
/* bt_node_load_fn: queue, measured prefill rate, step time and transfer bandwidth; the gauges. */
void prefill_service_load(void *svc, mbr_load_report_t *out);
int32_t prefill_service_inflight(const void *svc);
/* Call after the gRPC server has shut down. NULL is a no-op. */
void prefill_service_destroy(void *svc);

#endif
