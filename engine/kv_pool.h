/* The node's KV pool (DESIGN 5.1): one contiguous allocation of fixed-size blocks of 16 token slots, layer-major so
 * that a run of consecutive block ids is one contiguous byte range per layer:
 *   offset(layer, block) = (layer * n_blocks + block) * block_stride
 *   block: K then V, each [kv_head][token_in_block][head_dim] of dtype; for int8, then the K and the V
 *          (scale, min) pairs, each [kv_head][token_in_block][2] fp16: x = min + scale * q, q an unsigned byte
 * This module owns the memory and the byte layout plus a plain free-list allocator; reference counts, prefix caching
 * and preemption belong to the block manager built on top of it. Not thread-safe: the engine thread owns it. */
#ifndef BATON_ENGINE_KV_POOL_H
#define BATON_ENGINE_KV_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/model.h"

#define BT_KV_BLOCK 16 /* token slots per block */

typedef enum bt_kv_dtype {
    BT_KV_F16 = 0,  /* default */
    BT_KV_F32 = 1,
    BT_KV_INT8 = 2, /* 8-bit codes with a per-token-per-head fp16 scale and min: 53.1% of f16's bytes at head_dim 64 */
} bt_kv_dtype;

/* "f16", "f32", "int8". */
const char *bt_kv_dtype_name(bt_kv_dtype d);
/* Parses a dtype name; -1 when unknown. */
int bt_kv_dtype_from_name(const char *name);

typedef struct bt_kv_pool {
    bt_kv_dtype dtype;
    int32_t n_layer, n_head_kv, head_dim;
    int32_t n_blocks;
    size_t elem_size;     /* bytes per K or V element */
    size_t block_stride;  /* bytes of one block of one layer */
    size_t v_off;         /* offset of V within a block */
    size_t ks_off, vs_off; /* int8: offsets of the K and V fp16 (scale, min) pairs within a block (0 otherwise) */
    uint8_t *base;        /* [n_layer][n_blocks][block_stride] */
    size_t bytes;
    int own_memory;       /* 1 when base was allocated here; 2: a backend's device buffer (engine/backend.h) */
    int32_t *free_ids;    /* stack of free block ids, lowest ids on top so runs come out contiguous */
    int32_t n_free;
} bt_kv_pool;

/* Bytes of one block of one layer for this model and dtype. */
size_t bt_kv_block_stride(const bt_hparams *hp, bt_kv_dtype dtype);

/* Creates a pool of as many blocks as fit in mem_bytes (at least one; BT_ERR_INVALID when not even one fits).
 * When mem is non-NULL the pool lives there (e.g. memory registered with UCX) and the caller keeps ownership.
 * BT_ERR_NOMEM when the allocation fails. */
bt_status bt_kv_pool_create(const bt_hparams *hp, bt_kv_dtype dtype, size_t mem_bytes, void *mem, bt_kv_pool **out);
void bt_kv_pool_destroy(bt_kv_pool *p);

/* Takes n free blocks into ids[n] (ascending, contiguous when possible). BT_ERR_EXHAUSTED, with nothing taken,
 * when fewer than n are free. */
bt_status bt_kv_pool_alloc(bt_kv_pool *p, int32_t n, int32_t *ids);

/* Returns blocks to the free list. Ids must have come from bt_kv_pool_alloc and not been released since. */
void bt_kv_pool_release(bt_kv_pool *p, int32_t n, const int32_t *ids);

/* Start of (layer, block): K at offset 0, V at v_off (int8 scales at ks_off / vs_off). */
static inline uint8_t *bt_kv_block_ptr(const bt_kv_pool *p, int32_t layer, int32_t block)
{
    return p->base + ((size_t)layer * (size_t)p->n_blocks + (size_t)block) * p->block_stride;
}

#endif
