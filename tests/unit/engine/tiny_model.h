/* Tiny random-weight llama models written with engine/gguf_writer, so engine tests run in milliseconds. */
#ifndef BATON_TESTS_TINY_MODEL_H
#define BATON_TESTS_TINY_MODEL_H

#include <stdint.h>

typedef struct tiny_model_opts {
    const char *arch;     /* default "llama" */
    int n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab; /* defaults 2, 64, 4, 2, 128, 256 */
    uint32_t matrix_type; /* bt_ggml_type of the projection matrices, default Q4_1 */
    uint32_t embd_type;   /* default Q8_0 */
    int tied;             /* no output.weight (default 1) */
    const char *skip_tensor; /* leave this tensor out (to test errors) */
    /* arch "gemma3": its extra tensors (q/k norms, post-norms) and keys; sliding_window (default 8; -1: key left
     * out), sliding_window_pattern (0: key left out, the architecture's 6 applies), final_logit_softcapping (0: key
     * left out) */
    int swa_window, swa_pattern;
    float softcap;
    uint64_t seed;
} tiny_model_opts;

/* Fills defaults for zero fields. */
void tiny_model_defaults(tiny_model_opts *o);

/* Writes a model to path; returns 0 on success. */
int tiny_model_write(const char *path, const tiny_model_opts *o);

#endif
