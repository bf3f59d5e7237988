/* The llama-family forward pass over one ragged batch (DESIGN 4.3), written once against bt_backend.
 * A batch concatenates the new tokens of several sequences; each token names its position and its sequence,
 * each sequence brings its block table, and logits are computed only for the rows asked for. A sequence's logits
 * are bit-identical whatever else is in the batch and however its prompt was chunked. */
#ifndef BATON_ENGINE_FORWARD_H
#define BATON_ENGINE_FORWARD_H

#include <stdint.h>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/kv_pool.h"
#include "engine/model.h"

typedef struct bt_seq_view {
    const int32_t *block_table; /* [n_blocks] KV block ids; slot of position p = table[p / 16] * 16 + p % 16 */
    int32_t n_blocks;
    /* Optional (NULL: block_table serves every layer): the table of the sliding-window layers' block space
     * (engine/kv_groups.h); entries before the window of a token's position may be BT_BM_NO_BLOCK (-1). */
    const int32_t *local_table; /* [n_local_blocks] */
    int32_t n_local_blocks;
} bt_seq_view;

typedef struct bt_batch {
    int32_t n_tokens;
    const int32_t *tokens;      /* [n_tokens] */
    const int32_t *pos;         /* [n_tokens] position of each token in its sequence */
    const int32_t *seq;         /* [n_tokens] index into seqs */
    const bt_seq_view *seqs;    /* [n_seqs] */
    int32_t n_seqs;
    const int32_t *logit_rows;  /* [n_logits] token indices whose logits are wanted */
    int32_t n_logits;
    /* Optional (n_hidden 0: none): token indices whose final hidden state (after the output norm, before the output
     * matrix) is wanted, written to hidden[n_hidden][n_embd] (host memory): embeddings. */
    const int32_t *hidden_rows;
    int32_t n_hidden;
    float *hidden;
} bt_batch;

typedef struct bt_forward bt_forward;

/* Scratch for batches of up to max_tokens tokens. The model and backend must outlive it. profile = 1: wall time per
 * op kind, logged when the forward pass is destroyed (BATON_PROFILE). BT_ERR_NOMEM; BT_ERR_UNSUPPORTED when the
 * model needs an op the backend lacks (gemma3: geglu, scale). */
bt_status bt_forward_create(const bt_model *m, bt_backend *be, int32_t max_tokens, int profile, bt_forward **out);

/* The edge only: *profile = 1 when BATON_PROFILE=1, 0 when it is 0, unset or empty; BT_ERR_INVALID (naming the
 * variable) for any other value. Can't block. */
bt_status bt_forward_profile_from_env(int *profile);
void bt_forward_destroy(bt_forward *fw);
/* Forgets the op times summed so far (BATON_PROFILE), e.g. those of a warm-up pass. Can't fail. */
void bt_forward_profile_reset(bt_forward *fw);
int32_t bt_forward_max_tokens(const bt_forward *fw);

/* Steps run so far on the backend's lanes: decode steps of at least 4 sequences per lane (each sequence's last token,
 * possibly followed by speculative drafts, every token with its logits, no layer hook) are split over the lanes by
 * sequence, each lane running every op of its share on one thread. Bit-identical to running the step whole. */
int64_t bt_forward_lane_steps(const bt_forward *fw);

/* Runs the batch: writes each token's K/V into kv at its slot, logits[n_logits][n_vocab] for logit_rows and the
 * final hidden states of hidden_rows (per row, bit-identical whatever else is in the batch).
 * Every position before a token's own (in its sequence) must already be in kv or earlier in this batch.
 * Errors: BT_ERR_INVALID (too many tokens, token id or position out of range, block table too short, block id
 * outside the pool; nothing is written), BT_ERR_NOMEM, or the backend's error. */
bt_status bt_forward_run(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits);

/* Called after layer `layer` wrote the batch's K/V into the pool (before its attention runs), on the thread that runs
 * bt_forward_run. Used by prefill nodes to push each layer's KV as soon as it exists (DESIGN 2, step 5). */
typedef void (*bt_forward_layer_fn)(void *user, int32_t layer);

/* Sets (fn != NULL) or clears the layer hook for the following runs. */
void bt_forward_set_layer_hook(bt_forward *fw, bt_forward_layer_fn fn, void *user);

#endif
