/* A model's first layers as a GGUF file of their own (`baton model slice`): a draft model for any model, made by
 * early exit (DESIGN 5.5 self-drafting). */
#ifndef BATON_ENGINE_GGUF_SLICE_H
#define BATON_ENGINE_GGUF_SLICE_H

#include <stdint.h>

#include "common/status.h"

/* Writes to out_path (atomically) a copy of the GGUF file at in_path that keeps layers 0..n_layers-1 (tensors
 * "blk.<i>.*" with i < n_layers) and every other tensor, with "<arch>.block_count" set to n_layers and general.name
 * marked with the layers; every other key is copied with its type. Errors: those of gguf_open; BT_ERR_INVALID
 * (n_layers outside 1..block_count-1, no architecture or block count); BT_ERR_UNSUPPORTED (a key type the writer
 * cannot reproduce, named); BT_ERR_IO; BT_ERR_NOMEM. */
bt_status gguf_slice_layers(const char *in_path, const char *out_path, int32_t n_layers);

#endif
