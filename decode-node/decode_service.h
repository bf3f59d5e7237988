/* The decode node's service: baton.v1.Decode/{Run,Abort} over the engine scheduler, with local prefill
 * (colocated mode, DESIGN 2). Run validates the request (INVALID_ARGUMENT naming the problem), submits it to the
 * scheduler and streams each token back from the engine thread; the call's deadline becomes the scheduler
 * deadline; a client cancel (or Decode/Abort by request id) aborts the sequence within one step and its KV blocks
 * return. Records the DESIGN 10 metrics into the node's registry. */
#ifndef BATON_DECODE_SERVICE_H
#define BATON_DECODE_SERVICE_H

#include "common/membership.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "node/node_engine.h"
#include "baton/v1/node.pb-c.h"

#include <stddef.h>
#include <stdint.h>

#define DECODE_MAX_INFLIGHT 1024 /* Run and Embed calls admitted at once (queued + running); beyond: RESOURCE_EXHAUSTED */
#define DECODE_REMOTE_TIMEOUT_MS 120000
#define DECODE_EMBED_MAX_INPUTS 2048      /* sequences per Decode/Embed call (OpenAI's limit per request) */
#define DECODE_EMBED_MAX_TOKENS (1 << 20) /* their tokens together */

typedef struct decode_config {
    const char *model_path;    /* GGUF file; required */
    int threads;               /* compute threads, 0 = all CPUs */
    size_t kv_mem;             /* KV pool bytes, 0 = the scheduler's default */
    int32_t max_batch_tokens;  /* 0 = the scheduler's default */
    int32_t max_inflight;      /* 0 = DECODE_MAX_INFLIGHT */
    int remote_timeout_ms;     /* remote prefill deadline (P's queue, compute and transfer) for requests without
                                * a deadline of their own: 0 = DECODE_REMOTE_TIMEOUT_MS; < 0 = no kvtransfer,
                                * always prefill locally */
    const char *node_id;       /* reported in the first message of each stream */
    const char *spec;          /* speculative decoding (--spec syntax); NULL or "" = none */
    int32_t spec_k_max;        /* 0 = the engine's default (8) */
    metrics_registry_t *metrics; /* must outlive the service */
    bt_rpc_server_t *rpc;      /* not started yet: the methods are added to it */
    mbr_watcher_t *members;    /* the cluster's members (must outlive the service); a prefill hint is followed
                                * only to a prefill node registered there with this model. NULL: hints ignored */
    const bt_tls_files_t *tls; /* calls to prefill nodes: verify them against ca, present cert; NULL = insecure */
    const bt_ne_env_t *env;    /* the environment switches, read at the process's edge; NULL = defaults */
} decode_config_t;

typedef struct decode_service decode_service_t;

/* Loads the model, creates the CPU backend and the scheduler, starts the engine thread, registers the metrics and
 * adds /baton.v1.Decode/Run and /baton.v1.Decode/Abort to cfg->rpc. Returns the model loader's errors (message
 * names the file), BT_ERR_INVALID, BT_ERR_NOMEM; *out set only on success. */
bt_status decode_service_create(const decode_config_t *cfg, decode_service_t **out);

/* Decode/Run's validation, as a pure function of the engine's limits (model fingerprint, vocabulary, context): fills
 * *rp (sampling, stop ids, max_tokens) from q and returns the gRPC code, with a message for the client in err when it
 * is not OK. Reads nothing but ne's limits (fuzzed by tests/fuzz/fuzz_node_request.c). */
bt_rpc_code decode_run_params(const bt_ne_t *ne, const Baton__V1__DecodeRunRequest *q, bt_req_params *rp, char *err,
                              size_t cap);

/* Decode/Embed's validation, pure like decode_run_params: the fingerprint, 1..DECODE_EMBED_MAX_INPUTS inputs of
 * 1..context ids of the vocabulary, at most DECODE_EMBED_MAX_TOKENS in all (*tokens gets their sum). */
bt_rpc_code decode_embed_check(const bt_ne_t *ne, const Baton__V1__DecodeEmbedRequest *q, uint32_t *tokens, char *err,
                               size_t cap);

/* The functions below are the slots of bt_node_service_ops_t (node/node_main.h): svc is a decode_service_t. */

/* Fills what the service knows of the NodeInfo: model fingerprint (16 hex digits, the format Run compares),
 * capacity (KV blocks, block tokens, max running, max context), the kvtransfer pool descriptor. BT_ERR_NOMEM. */
bt_status decode_service_node_info(const void *svc, mbr_node_info_t *info);

/* One line for the start-up log: model, ISA, threads, KV blocks, batch budget, context. */
void decode_service_summary(const void *svc, char *buf, size_t cap);

/* bt_node_load_fn: samples the scheduler's stats into *out and the gauges. Thread-safe. */
void decode_service_load(void *svc, mbr_load_report_t *out);

/* Calls in flight (submitted, not finished). Can't fail. */
int32_t decode_service_inflight(const void *svc);

/* Stops the engine thread (aborting whatever is left) and frees everything. Call after the gRPC server has shut
 * down (every call finished). NULL is a no-op. */
void decode_service_destroy(void *svc);

#endif
