/* One sequence through the forward pass, for the CLI (`generate`, `bench`, `logits`): owns a backend, scratch,
 * and a KV pool sized for n_ctx tokens. The serving path uses the scheduler instead. */
#ifndef BATON_TOOLS_SEQ_RUNNER_H
#define BATON_TOOLS_SEQ_RUNNER_H

#include <stdint.h>

#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "tools/engine_env.h"

typedef struct seq_runner {
    const bt_model *model;
    bt_backend *be;
    bt_forward *fw;
    bt_kv_pool *kv;
    int32_t *table;   /* [n_blocks] block table of the one sequence */
    int32_t n_blocks;
    int32_t n_ctx;
    int32_t chunk;    /* most tokens per forward call */
    int32_t n_past;   /* positions already in the KV cache */
    float *logits;    /* [chunk][n_vocab] */
} seq_runner;

/* env: the backend's options (threads included) and profiling; chunk = prefill chunk size. Errors from the
 * backend, forward and pool constructors. */
bt_status seq_runner_init(seq_runner *r, const bt_model *m, const cli_engine_env *env, int32_t n_ctx, int32_t chunk,
                          bt_kv_dtype dtype);
void seq_runner_free(seq_runner *r);

/* Feeds tokens[n] at the next positions. When all_logits is set, r->logits gets every fed position's logits
 * (n must then be <= chunk); otherwise only the last one's, at r->logits. BT_ERR_INVALID past n_ctx. */
bt_status seq_runner_feed(seq_runner *r, const int32_t *tokens, int32_t n, int all_logits);

/* Forgets the positions from n on (0 <= n <= n_past; others are clamped): the next feed starts at n and overwrites
 * their KV, as a rejected speculative draft's. */
void seq_runner_rewind(seq_runner *r, int32_t n);

/* Forgets the sequence (positions restart at 0). */
void seq_runner_reset(seq_runner *r);

#endif
