/* The compute backend interface (DESIGN 4.2): a table of function pointers plus a context. The forward pass
 * (engine/forward.c) is written once against it; `cpu` is the first implementation, `cuda` follows.
 * Tensors are plain pointers into memory the backend can address (host memory for cpu); shapes are documented
 * at each slot. Every op must be batch-invariant: a row's result may not depend on the other rows.
 *
 * Threads: the ops of one backend are called from one thread at a time (the engine thread); a backend spreads an op
 * over its own threads, and run_lanes is the only way to run ops of one backend concurrently. Weights (bt_weight.data)
 * must stay at a fixed address and unchanged while a backend uses them: backends may keep derived copies keyed by
 * the pointer (the CPU backend's packed layouts). The CPU backend's constructor lives in engine/backend_cpu.h. */
#ifndef BATON_ENGINE_BACKEND_H
#define BATON_ENGINE_BACKEND_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/status.h"
#include "engine/kv_pool.h"
#include "engine/model.h"

typedef struct bt_backend bt_backend;

/* Attention over paged KV for one step (causal: a token at position p sees positions 0..p of its sequence; with a
 * window w > 0 only positions k with p - k < w, i.e. the last w positions up to p: Gemma's sliding window). */
typedef struct bt_attn_args {
    const bt_kv_pool *kv;
    int32_t layer;
    int32_t n_tokens;
    int32_t n_head, n_head_kv, head_dim;
    float scale;                   /* 1 / sqrt(head_dim) (the model's attention scale) */
    int32_t window;                /* 0: unlimited; else a query at p attends to keys k <= p with p - k < window */
    const float *q;                /* [n_tokens][n_head][head_dim], rotated */
    const int32_t *pos;            /* [n_tokens] */
    const int32_t *const *tables;  /* [n_tokens] -> that token's sequence block table */
    float *out;                    /* [n_tokens][n_head][head_dim] */
} bt_attn_args;

/* The body run on one lane by run_lanes: lane is a backend handle valid during the call. */
typedef bt_status (*bt_lane_fn)(bt_backend *lane, int i, void *user);

/* A part of host work run by host_tasks: part i of n. */
typedef void (*bt_host_task_fn)(void *user, int i, int n);

#define BT_MAX_LANES 64

typedef struct bt_backend_ops {
    const char *name;
    /* 1: buffers (buf_alloc) are device memory the host cannot dereference; copy them with buf_set/get/copy only,
     * and put the KV pool there (bt_backend_kv_pool_create). 0: host memory (cpu). */
    int device_memory;
    void (*destroy)(bt_backend *be);

    /* Buffers the ops operate on. alloc returns NULL on failure; set/get copy from/to host memory. */
    void *(*buf_alloc)(bt_backend *be, size_t bytes);
    void (*buf_free)(bt_backend *be, void *buf);
    void (*buf_set)(bt_backend *be, void *dst, const void *host_src, size_t bytes);
    void (*buf_get)(bt_backend *be, void *host_dst, const void *src, size_t bytes);
    /* Optional (NULL: memcpy): copies between two buffers of this backend (device memory for cuda). */
    void (*buf_copy)(bt_backend *be, void *dst, const void *src, size_t bytes);

    /* out[n][w->n_in] = rows tokens[i] of the embedding matrix w, dequantized. */
    void (*embed)(bt_backend *be, const bt_weight *w, const int32_t *tokens, int32_t n, float *out);
    /* out[r][n] = x[r][n] / rms(x[r]) * w[n], r < n_rows. out may equal x. */
    void (*rmsnorm)(bt_backend *be, const float *x, const float *w, int32_t n_rows, int32_t n, float eps, float *out);
    /* out[r][w->n_out] = x[r][w->n_in] . W^T (+ bias[w->n_out] when bias is non-NULL). */
    bt_status (*matmul)(bt_backend *be, const bt_weight *w, const float *bias, const float *x, int32_t n_rows,
                        float *out);
    /* Optional (NULL = call matmul n times): several matmuls of the same input x, e.g. q/k/v or gate/up;
     * outs[i][r][ws[i]->n_out] (+ biases[i] when non-NULL). Results are identical to separate matmul calls. */
    bt_status (*matmul_multi)(bt_backend *be, const bt_weight *const *ws, const float *const *biases, int n,
                              const float *x, int32_t n_rows, float *const *outs);
    /* Rotates x[n_tokens][n_heads][head_dim] in place at positions pos[] (first n_rot dims of each head). */
    void (*rope)(bt_backend *be, float *x, const int32_t *pos, int32_t n_tokens, int32_t n_heads, int32_t head_dim,
                 int32_t n_rot, float base, float freq_scale, int neox);
    /* Stores k, v [n_tokens][n_head_kv][head_dim] into the pool at slots[i] = block * 16 + offset for layer. */
    void (*kv_write)(bt_backend *be, bt_kv_pool *kv, int32_t layer, const float *k, const float *v,
                     int32_t n_tokens, const int32_t *slots);
    /* BT_ERR_NOMEM when its scratch cannot be had (the output is then undefined). */
    bt_status (*attention)(bt_backend *be, const bt_attn_args *a);
    /* out[i] = silu(g[i]) * u[i], i < n. out may equal g. */
    void (*swiglu)(bt_backend *be, const float *g, const float *u, int64_t n, float *out);
    /* out[i] = gelu_tanh(g[i]) * u[i], i < n, gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
     * out may equal g. Used by gemma3 (GeGLU). */
    void (*geglu)(bt_backend *be, const float *g, const float *u, int64_t n, float *out);
    /* x[i] += y[i], i < n. */
    void (*add)(bt_backend *be, float *x, const float *y, int64_t n);
    /* x[i] *= s, i < n. Used by gemma3 (embedding rows times sqrt(n_embd)). */
    void (*scale)(bt_backend *be, float *x, float s, int64_t n);
    /* Optional (NULL: not offered; max_lanes 0: none now). run_lanes calls fn(lane, i, user) for i < n_lanes
     * concurrently, lane i being a single-threaded view of be: the same weights, its own scratch, every op run on
     * the lane's thread. Work that splits into independent parts (the sequences of a decode step) then runs with no
     * fork and join per op. Each op computes exactly what it computes on be. Returns the first lane's error.
     * Lane handles must not be destroyed or used outside fn. */
    int (*max_lanes)(bt_backend *be);
    bt_status (*run_lanes)(bt_backend *be, int n_lanes, bt_lane_fn fn, void *user);
    /* Optional (NULL: the caller runs the parts itself, one after another). host_tasks runs fn(user, i, n) for
     * every i < n on the backend's host threads (the calling thread among them) and returns when all are done:
     * the caller's own host work that splits into independent parts, such as sampling the rows of a step, while the
     * threads would otherwise wait for the next op. host_threads: how many threads run them (parts beyond that
     * only queue). Not to be called from inside an op or a lane. */
    void (*host_tasks)(bt_backend *be, bt_host_task_fn fn, void *user, int n);
    int (*host_threads)(bt_backend *be);
} bt_backend_ops;

struct bt_backend {
    const bt_backend_ops *ops;
    void *ctx;
};

/* Destroys any backend; NULL allowed. */
static inline void bt_backend_destroy(bt_backend *be)
{
    if (be) be->ops->destroy(be);
}

/* A KV pool of mem_bytes in the memory be computes on: as bt_kv_pool_create(hp, dtype, mem_bytes, NULL, out) for a
 * host backend, in one buf_alloc buffer for a device backend (the pool then owns it: own_memory = 2). Destroy it with
 * bt_backend_kv_pool_destroy. Errors as bt_kv_pool_create; BT_ERR_NOMEM when the device buffer cannot be had. */
static inline bt_status bt_backend_kv_pool_create(bt_backend *be, const bt_hparams *hp, bt_kv_dtype dtype,
                                                  size_t mem_bytes, bt_kv_pool **out)
{
    if (!be->ops->device_memory) return bt_kv_pool_create(hp, dtype, mem_bytes, NULL, out);
    void *mem = be->ops->buf_alloc(be, mem_bytes);
    if (!mem) return bt_fail(BT_ERR_NOMEM, "%s: cannot allocate a KV pool of %zu bytes", be->ops->name, mem_bytes);
    bt_status st = bt_kv_pool_create(hp, dtype, mem_bytes, mem, out);
    if (st) {
        be->ops->buf_free(be, mem);
        return st;
    }
    (*out)->own_memory = 2;
    return BT_OK;
}

/* Destroys a pool from bt_backend_kv_pool_create (or bt_kv_pool_create); NULL allowed. */
static inline void bt_backend_kv_pool_destroy(bt_backend *be, bt_kv_pool *p)
{
    if (p && p->own_memory == 2) {
        be->ops->buf_free(be, p->base);
        p->own_memory = 0;
    }
    bt_kv_pool_destroy(p);
}

/* Copies bytes between two buffers of be (memcpy for a host backend). */
static inline void bt_backend_copy(bt_backend *be, void *dst, const void *src, size_t bytes)
{
    if (be->ops->buf_copy)
        be->ops->buf_copy(be, dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

#endif
