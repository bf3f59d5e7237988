/* A model's first layers as a GGUF file of their own (`baton model slice`): a draft model for any model, made by
 * early exit (DESIGN 5.5 self-drafting); and the general rewrite behind it, which `baton model quantize` also uses. */
#ifndef BATON_ENGINE_GGUF_SLICE_H
#define BATON_ENGINE_GGUF_SLICE_H

#include <stdint.h>

#include "common/status.h"
#include "engine/gguf.h"

/* Writes to out_path (atomically) a copy of the GGUF file at in_path that keeps layers 0..n_layers-1 (tensors
 * "blk.<i>.*" with i < n_layers) and every other tensor, with "<arch>.block_count" set to n_layers and general.name
 * marked with the layers; every other key is copied with its type. Errors: those of gguf_open; BT_ERR_INVALID
 * (n_layers outside 1..block_count-1, no architecture or block count); BT_ERR_UNSUPPORTED (a key type the writer
 * cannot reproduce, named); BT_ERR_IO; BT_ERR_NOMEM. */
bt_status gguf_slice_layers(const char *in_path, const char *out_path, int32_t n_layers);

/* A tensor as the rewrite will store it: the hook may change its type and data (data then points to n_bytes the hook
 * owns until the next call or the end of the rewrite). */
typedef struct gguf_tensor_out {
    uint32_t type;
    const void *data;
    size_t n_bytes;
} gguf_tensor_out;

typedef struct gguf_rewrite_opts {
    int32_t n_layers;         /* keep layers 0..n_layers-1; 0 keeps every layer */
    const char *name_suffix;  /* appended to general.name; NULL: none (a slice adds its layer range) */
    int file_type;            /* >= 0: the general.file_type to record (when the source has the key) */
    /* optional: called for every kept tensor with *out preset to the source's type, data and size */
    bt_status (*tensor)(void *ud, const gguf_tensor *t, gguf_tensor_out *out);
    void *ud;
} gguf_rewrite_opts;

/* The general form of gguf_slice_layers: copies in_path to out_path (atomically) with every key, the kept layers and
 * each tensor as o->tensor leaves it. Errors: as gguf_slice_layers, and whatever the hook returns. */
bt_status gguf_rewrite(const char *in_path, const char *out_path, const gguf_rewrite_opts *o);

#endif
