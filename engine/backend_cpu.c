/* The cpu backend: host buffers, kernels from engine/cpu, a fork-join pool for the heavy ops.
 * Work is split by output element (matmul columns, attention (token, head) pairs) and, for attention, at fixed key
 * positions, never by the batch: every value is computed by the same code in the same order whatever the batch
 * holds (DESIGN 4.3). */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/backend_cpu.h"

#include "common/env.h"
#include "engine/backend.h"
#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_hostmem.h"
#include "engine/cpu/cpu_kernels.h"

/* A weight matrix packed for the tiled GEMM, keyed by its data pointer (weights are immutable while the backend
 * uses them). p == NULL marks a weight that could not be packed: it then always runs unpacked, so each weight
 * keeps one arithmetic for the life of the backend. The type, shape and first bytes guard against a freed
 * weight's address being reused by another. */
typedef struct packed_entry {
    const void *key;
    uint32_t type;
    int64_t n_in, n_out;
    uint8_t head[16];
    bt_cpu_packed *p;
    const void *succ; /* key of the weight whose matmul ran right after this one's, last time (NULL: none yet) */
} packed_entry;

/* Rotation angles of one set of rope parameters: a model whose layers differ in them (Gemma 3: base 10,000 on its
 * sliding-window layers, 1,000,000 on the global ones) keeps a table for each. */
typedef struct rope_table {
    float *cs;          /* [cap][n_rot]: cos, sin per rotated pair of each position */
    uint8_t *have;      /* [cap]: row filled */
    int32_t cap, n_rot; /* n_rot 0: unused */
    float base, freq_scale;
} rope_table;

#define ROPE_TABLES 4

/* Lanes (run_lanes): single-threaded views of the backend, one per pool thread, each with its own scratch (xq,
 * attention tasks, rope tables) and no pool; they share the root's packed weights under its lock. */
typedef struct cpu_ctx {
    const bt_cpu_ops *ops;
    bt_pool *pool;   /* NULL in a lane: every op runs on the calling thread */
    struct cpu_ctx *root; /* the backend's own context (itself for the root) */
    pthread_mutex_t pack_mu; /* root only: guards the packed table while lanes run */
    int n_lanes;             /* root only */
    int lanes_on;            /* root only: BATON_CPU_LANES (default 1) */
    bt_backend *lanes;       /* root only: [n_lanes], created with the backend */
    struct lanes_job *job;   /* root only: run_lanes' state, allocated with the lanes */
    int act_bits;    /* activation precision of quantized matmuls: 16 (default, near-exact) or 8 (faster) */
    int repack;      /* pack supported weight types for the tiled GEMM on first use (BATON_CPU_REPACK, default 1) */
    packed_entry *packed; /* open-addressing table, packed_cap slots (a power of two), packed_n used */
    size_t packed_cap, packed_n;
    size_t packed_bytes;  /* memory held by packed copies */
    bt_hostmem_arena *pack_mem; /* root only: where packed copies live, laid end to end on huge pages */
    void *xq;        /* activation quantization scratch */
    size_t xq_bytes;
    const void *prev_key; /* the packed weight of this context's previous matmul (packed_get) */
    struct attn_task *attn_tasks; /* [attn_cap]: segment tasks, then merge items */
    size_t attn_cap;
    float *attn_parts;            /* [attn_parts_cap]: each segment task's accumulators, m and l */
    size_t attn_parts_cap;
    rope_table rope[ROPE_TABLES]; /* one per rope parameter set in use (rope_angles) */
    int rope_next;                /* the table a new parameter set takes when every one is in use */
} cpu_ctx;

static cpu_ctx *C(bt_backend *be)
{
    return be->ctx;
}

/* Packed weights are carved from chunks of this size on huge pages (a layer's matrices are a few hundred KiB each).
 * bench_cpu_kernels --decode-only, 4 runs: the matmuls of a batch-1 decode step took 17% (1 thread) and 12% (2
 * threads) less time than with each matrix on its own 4 KiB pages; at 8 and 16 rows, where the kernel is bound by
 * compute, 0-3%. */
#define PACK_CHUNK_BYTES ((size_t)32 << 20)

/* Frees a packed copy made by packed_get_locked */
static void packed_release(cpu_ctx *c, bt_cpu_packed *p)
{
    bt_hostmem_arena_free(c->pack_mem, p->data);
    bt_cpu_packed_free(p);
    free(p);
}

static void packed_clear(cpu_ctx *c)
{
    for (size_t i = 0; i < c->packed_cap; i++)
        if (c->packed[i].p) packed_release(c, c->packed[i].p);
    free(c->packed);
    c->packed = NULL;
    c->packed_cap = c->packed_n = c->packed_bytes = 0;
}

static size_t packed_slot(const packed_entry *tab, size_t cap, const void *key)
{
    size_t h = (size_t)(((uintptr_t)key >> 5) * 0x9E3779B97F4A7C15ull);
    for (size_t i = h & (cap - 1);; i = (i + 1) & (cap - 1))
        if (tab[i].key == key || !tab[i].key) return i;
}

static bt_status packed_grow(cpu_ctx *c)
{
    size_t cap = c->packed_cap ? 2 * c->packed_cap : 512;
    packed_entry *tab = calloc(cap, sizeof *tab);
    if (!tab) return bt_fail(BT_ERR_NOMEM, "out of memory for the packed weight table");
    for (size_t i = 0; i < c->packed_cap; i++)
        if (c->packed[i].key) tab[packed_slot(tab, cap, c->packed[i].key)] = c->packed[i];
    free(c->packed);
    c->packed = tab;
    c->packed_cap = cap;
    return BT_OK;
}

static void weight_head(const bt_weight *w, uint8_t head[16])
{
    memset(head, 0, 16);
    size_t n = bt_cpu_row_bytes(w->type, w->n_in) * (size_t)w->n_out;
    memcpy(head, w->data, n < 16 ? n : 16);
}

/* packed_get on the root's table c, packing on pool */
static bt_status packed_get_locked(cpu_ctx *c, bt_pool *pool, const bt_weight *w, const bt_cpu_packed **out)
{
    *out = NULL;
    if (!c->repack || !bt_cpu_pack_supported(c->ops, w->type, c->act_bits) || w->n_out <= 0 || !w->data ||
        w->n_in % bt_cpu_block_elems(w->type))
        return BT_OK;
    uint8_t head[16];
    weight_head(w, head);
    packed_entry *e = c->packed_cap ? &c->packed[packed_slot(c->packed, c->packed_cap, w->data)] : NULL;
    if (e && e->key) {
        if (e->type == w->type && e->n_in == w->n_in && e->n_out == w->n_out && !memcmp(e->head, head, 16)) {
            *out = e->p;
            return BT_OK;
        }
        if (e->p) { /* another weight now lives at this address: repack in the same slot */
            c->packed_bytes -= bt_cpu_pack_bytes(c->ops, e->type, c->act_bits, e->n_in, e->n_out);
            packed_release(c, e->p);
        }
    } else {
        if (2 * (c->packed_n + 1) > c->packed_cap) {
            bt_status st = packed_grow(c);
            if (st) return st;
        }
        e = &c->packed[packed_slot(c->packed, c->packed_cap, w->data)];
        c->packed_n++;
    }
    *e = (packed_entry){.key = w->data, .type = w->type, .n_in = w->n_in, .n_out = w->n_out};
    memcpy(e->head, head, 16);
    bt_cpu_packed *p = calloc(1, sizeof *p);
    size_t bytes = bt_cpu_pack_bytes(c->ops, w->type, c->act_bits, w->n_in, w->n_out);
    void *mem = p ? bt_hostmem_arena_alloc(c->pack_mem, bytes) : NULL;
    if (mem && bt_cpu_pack_into(c->ops, pool, w->type, c->act_bits, w->n_in, w->n_out, w->data, mem, p) == BT_OK) {
        e->p = p;
        c->packed_bytes += bytes;
    } else { /* stays unpacked for good */
        bt_hostmem_arena_free(c->pack_mem, mem);
        free(p);
    }
    *out = e->p;
    return BT_OK;
}

/* The root's entry of key, or NULL */
static packed_entry *packed_find(cpu_ctx *r, const void *key)
{
    if (!key || !r->packed_cap) return NULL;
    packed_entry *e = &r->packed[packed_slot(r->packed, r->packed_cap, key)];
    return e->key == key ? e : NULL;
}

/* The packed copy of w for the tiled GEMM, packing it on first use; *out = NULL when w runs unpacked (packing
 * off, no tiled kernel for its type, or packing failed once). Errors only when the table cannot grow. Lanes share
 * the root's table; a lane packs on its own thread (its pool is NULL).
 * *then: where the weights of the matmul that followed w's last time start (bt_cpu_next_hint; zero if none). A
 * forward pass runs its matmuls in the same order every step, so the successor learnt in one step is the next
 * one's. Measured on Zen 4 (2 threads, the 211 matmuls of a SmolLM2 decode step, medians of 9 alternated rounds):
 * 2-3% less time at 1-5 rows, from the next matmul's first groups being on their way while a thread finishes. */
static bt_status packed_get(cpu_ctx *c, const bt_weight *w, const bt_cpu_packed **out, bt_cpu_next_hint *then)
{
    cpu_ctx *r = c->root;
    pthread_mutex_lock(&r->pack_mu);
    bt_status st = packed_get_locked(r, c->pool, w, out);
    *then = (bt_cpu_next_hint){0};
    if (st == BT_OK && *out) {
        packed_entry *prev = packed_find(r, c->prev_key), *e = packed_find(r, w->data);
        if (prev) prev->succ = w->data;
        packed_entry *nx = e ? packed_find(r, e->succ) : NULL;
        /* the next call's head check reads the successor's GGUF bytes, which the packed kernels never touch: ask for
         * them a matmul ahead rather than miss on the caller's serial path (perf: packed_get was ~1% of a batch-1
         * decode's samples, on the thread the other waits for; generate, 8 alternated runs: 6 faster, median 312 -> 321
         * tok/s, near the noise) */
        if (nx) __builtin_prefetch(nx->key, 0, 1);
        if (nx && nx->p)
            *then = (bt_cpu_next_hint){.data = nx->p->data,
                                       .n_groups = (nx->p->n_out + BT_CPU_PACK_ROWS - 1) / BT_CPU_PACK_ROWS,
                                       .group_bytes = nx->p->group_bytes};
        c->prev_key = w->data;
    }
    pthread_mutex_unlock(&r->pack_mu);
    return st;
}

static void ctx_free_scratch(cpu_ctx *c)
{
    free(c->xq);
    free(c->attn_tasks);
    free(c->attn_parts);
    for (int i = 0; i < ROPE_TABLES; i++) {
        free(c->rope[i].cs);
        free(c->rope[i].have);
    }
}

static void cpu_destroy(bt_backend *be)
{
    cpu_ctx *c = C(be);
    for (int i = 0; i < c->n_lanes; i++) {
        ctx_free_scratch(c->lanes[i].ctx);
        free(c->lanes[i].ctx);
    }
    free(c->lanes);
    free(c->job);
    pthread_mutex_destroy(&c->pack_mu);
    packed_clear(c);
    bt_hostmem_arena_destroy(c->pack_mem);
    bt_pool_destroy(c->pool);
    ctx_free_scratch(c);
    free(c);
    free(be);
}

/* Runs fn(ctx, i, n) for i < n on the pool, or in order on this thread for a lane. */
static void run_tasks(cpu_ctx *c, bt_pool_fn fn, void *ctx, int n)
{
    if (c->pool) {
        bt_pool_run_tasks(c->pool, fn, ctx, n);
        return;
    }
    for (int i = 0; i < n; i++) fn(ctx, i, n);
}

static int ctx_threads(const cpu_ctx *c)
{
    return c->pool ? bt_pool_size(c->pool) : 1;
}

static void *cpu_buf_alloc(bt_backend *be, size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

static void cpu_buf_free(bt_backend *be, void *buf) { free(buf); }
static void cpu_buf_copy(bt_backend *be, void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }

static void cpu_embed(bt_backend *be, const bt_weight *w, const int32_t *tokens, int32_t n, float *out)
{
    size_t row = bt_cpu_row_bytes(w->type, w->n_in);
    for (int32_t i = 0; i < n; i++)
        bt_cpu_dequantize_row_ref(w->type, w->n_in, (const uint8_t *)w->data + (size_t)tokens[i] * row,
                                  out + (size_t)i * (size_t)w->n_in);
}

/* Per-row and elementwise ops run on every thread from ELEM_POOL_MIN floats (a prompt chunk's rows); below that (a
 * decode step, whose rows a pool run would cost more than it saves) and on lanes (no pool) the caller runs them.
 * rmsnorm is split by rows and the others at multiples of 64 elements, so every element goes through the same code
 * as in one call: the same bits at any thread count. */
#define ELEM_POOL_MIN 65536

typedef enum { ELEM_RMSNORM, ELEM_SWIGLU, ELEM_GEGLU, ELEM_ADD } elem_kind;

typedef struct elem_job {
    const bt_cpu_ops *ops;
    elem_kind kind;
    const float *a, *b; /* rmsnorm: rows, weights; swiglu/geglu: gate, up; add: the addend (out is the sum) */
    float *out;
    float eps;
    int64_t n_rows, n; /* rmsnorm: n_rows rows of n; the others: n elements */
} elem_job;

static void elem_run(const elem_job *j, int ti, int nt)
{
    if (j->kind == ELEM_RMSNORM) {
        for (int64_t r = j->n_rows * ti / nt; r < j->n_rows * (ti + 1) / nt; r++)
            j->ops->rmsnorm(j->n, j->a + r * j->n, j->b, j->eps, j->out + r * j->n);
        return;
    }
    int64_t units = (j->n + 63) / 64, e0 = units * ti / nt * 64, e1 = units * (ti + 1) / nt * 64;
    if (e1 > j->n) e1 = j->n;
    if (e0 >= e1) return;
    if (j->kind == ELEM_SWIGLU) j->ops->swiglu(e1 - e0, j->a + e0, j->b + e0, j->out + e0);
    else if (j->kind == ELEM_GEGLU) j->ops->geglu(e1 - e0, j->a + e0, j->b + e0, j->out + e0);
    else
        for (int64_t i = e0; i < e1; i++) j->out[i] += j->a[i];
}

static void elem_task(void *ctx, int ti, int nt)
{
    elem_run(ctx, ti, nt);
}

static void elem_go(cpu_ctx *c, const elem_job *j)
{
    if (c->pool && j->n_rows * j->n >= ELEM_POOL_MIN)
        run_tasks(c, elem_task, (void *)j, ctx_threads(c));
    else
        elem_run(j, 0, 1);
}

static void cpu_rmsnorm(bt_backend *be, const float *x, const float *w, int32_t n_rows, int32_t n, float eps,
                        float *out)
{
    elem_job j = {.ops = C(be)->ops, .kind = ELEM_RMSNORM, .a = x, .b = w, .out = out, .eps = eps, .n_rows = n_rows,
                  .n = n};
    elem_go(C(be), &j);
}

static bt_status cpu_matmul(bt_backend *be, const bt_weight *w, const float *bias, const float *x, int32_t n_rows,
                            float *out)
{
    cpu_ctx *c = C(be);
    size_t need = bt_cpu_act_row_bytes(w->type, c->act_bits, w->n_in) * (size_t)n_rows;
    if (need > c->xq_bytes) {
        void *p = realloc(c->xq, need);
        if (!p) return bt_fail(BT_ERR_NOMEM, "out of memory for matmul scratch (%zu bytes)", need);
        c->xq = p;
        c->xq_bytes = need;
    }
    const bt_cpu_packed *wp;
    bt_cpu_next_hint then;
    bt_status st = packed_get(c, w, &wp, &then);
    if (st) return st;
    bt_cpu_matmul mm = {
        .ops = c->ops, .wtype = w->type, .n_in = w->n_in, .n_out = w->n_out, .n_rows = n_rows,
        .w = w->data, .x = x, .xq = c->xq, .out = out, .out_stride = 0, .act_bits = c->act_bits, .wp = wp,
        .then = then,
    };
    st = bt_cpu_matmul_run(c->pool, &mm);
    if (st) return st;
    if (bias)
        for (int32_t r = 0; r < n_rows; r++)
            for (int64_t j = 0; j < w->n_out; j++) out[(size_t)r * (size_t)w->n_out + (size_t)j] += bias[j];
    return BT_OK;
}

static bt_status cpu_matmul_multi(bt_backend *be, const bt_weight *const *ws, const float *const *biases, int n,
                                  const float *x, int32_t n_rows, float *const *outs)
{
    cpu_ctx *c = C(be);
    bt_cpu_matmul mm[4];
    int same = n >= 1 && n <= 4;
    for (int i = 1; i < n && same; i++)
        same = ws[i]->type == ws[0]->type && ws[i]->n_in == ws[0]->n_in;
    if (!same) {
        for (int i = 0; i < n; i++) {
            bt_status st = cpu_matmul(be, ws[i], biases[i], x, n_rows, outs[i]);
            if (st) return st;
        }
        return BT_OK;
    }
    size_t need = bt_cpu_act_row_bytes(ws[0]->type, c->act_bits, ws[0]->n_in) * (size_t)n_rows;
    if (need > c->xq_bytes) {
        void *p = realloc(c->xq, need);
        if (!p) return bt_fail(BT_ERR_NOMEM, "out of memory for matmul scratch (%zu bytes)", need);
        c->xq = p;
        c->xq_bytes = need;
    }
    bt_status st;
    for (int i = 0; i < n; i++) {
        const bt_cpu_packed *wp;
        bt_cpu_next_hint then;
        if ((st = packed_get(c, ws[i], &wp, &then))) return st;
        mm[i] = (bt_cpu_matmul){
            .ops = c->ops, .wtype = ws[i]->type, .n_in = ws[i]->n_in, .n_out = ws[i]->n_out, .n_rows = n_rows,
            .w = ws[i]->data, .x = x, .xq = c->xq, .out = outs[i], .out_stride = 0, .act_bits = c->act_bits,
            .wp = wp, .then = then,
        };
    }
    st = bt_cpu_matmul_run_multi(c->pool, mm, n);
    if (st) return st;
    for (int i = 0; i < n; i++)
        if (biases[i])
            for (int32_t r = 0; r < n_rows; r++)
                for (int64_t j = 0; j < ws[i]->n_out; j++)
                    outs[i][(size_t)r * (size_t)ws[i]->n_out + (size_t)j] += biases[i][j];
    return BT_OK;
}

/* The table of rope parameters (n_rot, base, freq_scale): the one that holds them, else an unused one, else one
 * emptied for them, each in turn (a model with more parameter sets than ROPE_TABLES recomputes angles). NULL when
 * there is nothing to cache: n_rot <= 0 or a parameter not finite (it would never match, and empty a table on every
 * call). */
static rope_table *rope_table_for(cpu_ctx *c, int32_t n_rot, float base, float freq_scale)
{
    if (n_rot <= 0 || !isfinite(base) || !isfinite(freq_scale)) return NULL;
    for (int i = 0; i < ROPE_TABLES; i++) {
        rope_table *t = &c->rope[i];
        if (t->n_rot == n_rot && t->base == base && t->freq_scale == freq_scale) return t;
    }
    rope_table *t = NULL;
    for (int i = 0; i < ROPE_TABLES && !t; i++)
        if (!c->rope[i].n_rot) t = &c->rope[i];
    if (!t) {
        t = &c->rope[c->rope_next];
        c->rope_next = (c->rope_next + 1) % ROPE_TABLES;
    }
    free(t->cs);
    free(t->have);
    *t = (rope_table){.n_rot = n_rot, .base = base, .freq_scale = freq_scale};
    return t;
}

/* cos and sin of the rotation angles of position p in table t, [n_rot / 2][2], computed on first use: rope runs
 * twice per layer at the same positions, and the values depend on nothing but p and the layer's rope parameters. One
 * table per parameter set: with one for all, Gemma 3's switches recomputed every angle (rope 8.3 -> 2.6 ms of a
 * 256-token prompt step). NULL when t is NULL, p < 0 or the table cannot grow: the caller then computes the angles
 * itself, the same way. */
static const float *rope_angles(rope_table *t, int32_t p)
{
    if (!t || p < 0) return NULL;
    const int32_t n_rot = t->n_rot;
    if (p >= t->cap) {
        int32_t cap = t->cap ? t->cap : 1024;
        while (cap <= p) {
            if (cap > (1 << 24)) return NULL;
            cap *= 2;
        }
        float *cs = realloc(t->cs, (size_t)cap * (size_t)n_rot * sizeof *cs);
        if (!cs) return NULL;
        t->cs = cs;
        uint8_t *have = realloc(t->have, (size_t)cap);
        if (!have) return NULL;
        memset(have + t->cap, 0, (size_t)(cap - t->cap));
        t->have = have;
        t->cap = cap;
    }
    float *cs = t->cs + (size_t)p * (size_t)n_rot;
    if (!t->have[p]) {
        for (int32_t i = 0; i < n_rot / 2; i++) {
            double ang = (double)p * t->freq_scale * pow((double)t->base, -2.0 * i / n_rot);
            cs[2 * i] = (float)cos(ang);
            cs[2 * i + 1] = (float)sin(ang);
        }
        t->have[p] = 1;
    }
    return cs;
}

/* Rotates pairs i0 .. i0 + n - 1 of every head of one token, cs/sn of pair i0 + i at tab[2i], tab[2i + 1].
 * Head-major with pairs innermost: contiguous and branch-free, so the compiler vectorizes it. */
static void rope_pairs(float *x, int32_t n_heads, int32_t head_dim, int32_t half, int32_t i0, int32_t n,
                       const float *tab, int neox)
{
    for (int32_t h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * (size_t)head_dim;
        if (neox) {
            float *a = v + i0, *b = v + i0 + half;
            for (int32_t i = 0; i < n; i++) {
                float x0 = a[i], x1 = b[i], cs = tab[2 * i], sn = tab[2 * i + 1];
                a[i] = x0 * cs - x1 * sn;
                b[i] = x0 * sn + x1 * cs;
            }
        } else {
            float *a = v + 2 * i0;
            for (int32_t i = 0; i < n; i++) {
                float x0 = a[2 * i], x1 = a[2 * i + 1], cs = tab[2 * i], sn = tab[2 * i + 1];
                a[2 * i] = x0 * cs - x1 * sn;
                a[2 * i + 1] = x0 * sn + x1 * cs;
            }
        }
    }
}

static void cpu_rope(bt_backend *be, float *x, const int32_t *pos, int32_t n_tokens, int32_t n_heads,
                     int32_t head_dim, int32_t n_rot, float base, float freq_scale, int neox)
{
    int32_t half = n_rot / 2;
    float own[512]; /* angles of one position when the table cannot serve */
    rope_table *table = rope_table_for(C(be), n_rot, base, freq_scale);
    for (int32_t t = 0; t < n_tokens; t++) {
        const float *tab = rope_angles(table, pos[t]);
        if (!tab) { /* the same values, computed here, 256 pairs at a time */
            for (int32_t i0 = 0; i0 < half; i0 += 256) {
                int32_t n = half - i0 < 256 ? half - i0 : 256;
                for (int32_t i = 0; i < n; i++) {
                    double ang = (double)pos[t] * freq_scale * pow((double)base, -2.0 * (i0 + i) / n_rot);
                    own[2 * i] = (float)cos(ang);
                    own[2 * i + 1] = (float)sin(ang);
                }
                rope_pairs(x + (size_t)t * (size_t)n_heads * (size_t)head_dim, n_heads, head_dim, half, i0, n, own,
                           neox);
            }
            continue;
        }
        rope_pairs(x + (size_t)t * (size_t)n_heads * (size_t)head_dim, n_heads, head_dim, half, 0, half, tab, neox);
    }
}

/* Asymmetric 8-bit code of one row of n values: x ~= min + scale * q, q in 0..255, min and scale stored as fp16
 * (min rounded down and scale up, so that every code lands in 0..255). Asymmetric codes use the full 256 levels on
 * rows whose values are not centred on zero, as K rows after RoPE often are: on SmolLM2, top-1 agreement with f16
 * KV over 1,214 teacher-forced positions is 98.6% with symmetric codes and one fp16 scale (2 bytes less per row),
 * below the 99% bar, and 99.3% with these. */
static void quantize_row_u8(const float *x, int32_t n, uint8_t *q, uint16_t *sm)
{
    float lo = x[0], hi = x[0];
    for (int32_t i = 1; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    lo = fmaxf(lo, -65504.0f), hi = fminf(hi, 65504.0f); /* fp16's range (and NaN dropped) */
    uint16_t hl = bt_f32_to_fp16(lo);
    if (bt_fp16_to_f32(hl) > lo) hl = (uint16_t)(hl & 0x8000u ? hl + 1u : hl ? hl - 1u : 0x8001u); /* toward -inf */
    float mn = bt_fp16_to_f32(hl), d = (hi - mn) / 255.0f;
    uint16_t hd = bt_f32_to_fp16(d);
    if (bt_fp16_to_f32(hd) < d) hd++; /* d >= 0: one step up */
    if (hd >= 0x7c00u) hd = 0x7bffu;
    d = bt_fp16_to_f32(hd);
    float inv = d > 0 ? 1.0f / d : 0.0f;
    for (int32_t i = 0; i < n; i++) {
        long v = lrintf((x[i] - mn) * inv);
        q[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    sm[0] = hd;
    sm[1] = hl;
}

static void cpu_kv_write(bt_backend *be, bt_kv_pool *kv, int32_t layer, const float *k, const float *v,
                         int32_t n_tokens, const int32_t *slots)
{
    const bt_cpu_ops *ops = C(be)->ops;
    size_t hd = (size_t)kv->head_dim;
    for (int32_t t = 0; t < n_tokens; t++) {
        uint8_t *blk = bt_kv_block_ptr(kv, layer, slots[t] / BT_KV_BLOCK);
        int32_t off = slots[t] % BT_KV_BLOCK;
        for (int32_t h = 0; h < kv->n_head_kv; h++) {
            size_t row = (size_t)h * BT_KV_BLOCK + (size_t)off, e = row * hd;
            const float *ks = k + ((size_t)t * (size_t)kv->n_head_kv + (size_t)h) * hd;
            const float *vs = v + ((size_t)t * (size_t)kv->n_head_kv + (size_t)h) * hd;
            if (kv->dtype == BT_KV_F32) {
                memcpy((float *)blk + e, ks, hd * 4);
                memcpy((float *)(blk + kv->v_off) + e, vs, hd * 4);
            } else if (kv->dtype == BT_KV_INT8) {
                quantize_row_u8(ks, (int32_t)hd, blk + e, (uint16_t *)(blk + kv->ks_off) + 2 * row);
                quantize_row_u8(vs, (int32_t)hd, blk + kv->v_off + e, (uint16_t *)(blk + kv->vs_off) + 2 * row);
            } else {
                ops->f32_to_fp16((int64_t)hd, ks, (uint16_t *)blk + e); /* same bits as bt_f32_to_fp16 */
                ops->f32_to_fp16((int64_t)hd, vs, (uint16_t *)(blk + kv->v_off) + e);
            }
        }
    }
}

/* Attention work item: query tokens [t0, t0 + n) of one run (consecutive tokens of one sequence at consecutive
 * positions) against kv head g, for the `group` query heads that share it, over the cache blocks of segment seg:
 * each K/V block of that head is read once per token for all of its query heads, straight from the cache in its
 * dtype (ops->attn_block), or for an f16 run of ATTN_WIDEN_MIN tokens or more from an f32 copy made once per block;
 * such a run's blocks that all its tokens see whole go through ops->attn_block_rows, 16 query rows a call.
 * part: offset of its accumulators in the plan's parts, [n * group][hd] then m and l [n * group]. n_seg: the run's
 * segment count (1: the task writes the output itself). As a merge item (after every segment task has run), seg is
 * unused and part is the offset of the run's segment 0 for kv head 0. */
typedef struct attn_task {
    int32_t t0, n, g, seg, n_seg;
    size_t part;
} attn_task;

typedef struct attn_plan {
    const bt_attn_args *a;
    const attn_task *tasks;
    const bt_cpu_ops *ops;
    float *parts;
    int nth; /* threads running the tasks */
} attn_plan;

#define ATTN_CHUNK 8 /* query tokens per work item */
#define ATTN_MIN_TASKS 4 /* per thread, below which runs are cut shorter (attn_chunk) */
#define ATTN_PREFETCH 2   /* blocks ahead */

/* A token's keys are split at fixed positions, every ATTN_SEG_BLOCKS cache blocks (256 tokens), into segments that
 * are reduced apart (running max, sum and weighted V, as ever) and merged in order at the end. The split depends
 * on the token's position alone, so its result never depends on batching or chunking; a token with one segment
 * is computed exactly as without segments. What it buys: at a long context one decode token is segments x kv heads
 * tasks that every thread shares, where 3 kv heads on 2 threads left one thread idle half the time (batch 1 at a
 * 2,048-token context, 6 alternated runs: attention 2.84 -> 2.38 ms per step, decode 150 -> 160 tok/s, medians). */
#define ATTN_SEG_BLOCKS 16
#define ATTN_MERGE_POOL_MIN 65536 /* partial floats below which the caller merges alone (~20 us of work) */

/* A run of at least this many query tokens (a prompt chunk, a verification step) reads each f16 K/V block once per
 * token: the task converts the block to f32 once (ops->fp16_to_f32, exact) and the kernel reads floats, the same
 * values, so the same bits as reading the f16 rows. The kernels then skip a conversion per vector per call:
 * bench_cpu_kernels --attn, hot block (f16 against f32), Intel Xeon (Emerald Rapids): AVX-512 SmolLM2 (head size 64,
 * 3 heads) 213 -> 185 ns a call, Gemma 3 (256, 4 heads) 695 -> 520; AVX2 340 -> 328 and 1,180 -> 1,080. In the
 * engine, SmolLM2's 256-token prompt steps: attention 37.2-38.6 -> 35.8-36.2 ms (BATON_PROFILE, 3 alternated runs). */
#define ATTN_WIDEN_MIN 4

/* Floats of a task's transposed query rows for attn_block_rows (64 rows of 128: 8 queries of a GQA group of 8) */
#define ATTN_ROWS_QT (64 * 128)

/* The largest head size whose prompt blocks go through attn_block_rows. At 256 (Gemma 3) the kernel alone was
 * 0.69-0.80x the time of attn_block per query (bench_cpu_kernels --attn), but a 2,048-token Gemma 3 prompt's
 * attention took as long as before in the engine (BATON_PROFILE, 2 alternated runs each, 213-224 against 230-239 ms
 * a step), so those blocks stay on attn_block; SmolLM2's 64 gained (see attn_block_rows in README). On Zen 4 the
 * AVX-512 kernel at 256 was 1.00-1.14x attn_block's time alone, so AVX-512 keeps the same limit. */
#define ATTN_ROWS_HD 128

_Static_assert(BT_KV_BLOCK == BT_CPU_ATTN_BLOCK, "attn_block takes one cache block at a time");

/* the K and V rows of kv head g in cache block blk */
static bt_cpu_kv_rows attn_rows(const bt_kv_pool *kv, const uint8_t *blk, int32_t g)
{
    size_t e = (size_t)g * BT_KV_BLOCK * (size_t)kv->head_dim;
    bt_cpu_kv_rows r = {0};
    if (kv->dtype == BT_KV_F32) {
        r.type = BT_CPU_KV_F32;
        r.k = (const float *)blk + e;
        r.v = (const float *)(blk + kv->v_off) + e;
    } else if (kv->dtype == BT_KV_INT8) {
        r.type = BT_CPU_KV_U8;
        r.k = blk + e;
        r.v = blk + kv->v_off + e;
        r.k_sm = (const uint16_t *)(blk + kv->ks_off) + 2 * (size_t)g * BT_KV_BLOCK;
        r.v_sm = (const uint16_t *)(blk + kv->vs_off) + 2 * (size_t)g * BT_KV_BLOCK;
    } else {
        r.type = BT_CPU_KV_F16;
        r.k = (const uint16_t *)blk + e;
        r.v = (const uint16_t *)(blk + kv->v_off) + e;
    }
    return r;
}

/* rows r from row j0 on (a sliding window that starts inside the block) */
static bt_cpu_kv_rows rows_from(bt_cpu_kv_rows r, int32_t j0, int32_t hd)
{
    size_t e = (size_t)j0 * (size_t)hd;
    if (r.type == BT_CPU_KV_F32) {
        r.k = (const float *)r.k + e;
        r.v = (const float *)r.v + e;
    } else if (r.type == BT_CPU_KV_U8) {
        r.k = (const uint8_t *)r.k + e;
        r.v = (const uint8_t *)r.v + e;
        r.k_sm += 2 * (size_t)j0;
        r.v_sm += 2 * (size_t)j0;
    } else {
        r.k = (const uint16_t *)r.k + e;
        r.v = (const uint16_t *)r.v + e;
    }
    return r;
}

static void prefetch_rows(const void *p, size_t bytes)
{
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 1);
}

/* A task's accumulators, m and l, rounded up to whole 64-byte lines: tasks on different threads update theirs after
 * every block, and two tasks sharing a line made it move between the cores each time (batch 1 at a 128-1,152-token
 * context, 2 threads: 430 ns per block in the tasks against 279 on one thread; aligned, 312). */
static size_t attn_part_floats(const bt_attn_args *a, int32_t n)
{
    size_t f = (size_t)n * (size_t)(a->n_head / a->n_head_kv) * ((size_t)a->head_dim + 2);
    return (f + 15) & ~(size_t)15;
}

/* attn_block_rows serves this attention's prompt runs: the ISA has it, the head size is a multiple of 16 up to
 * ATTN_ROWS_HD, and the blocks reach the kernel as f32 (an f32 cache, or f16 blocks the task widens) */
static int rows_kernel_applies(const bt_cpu_ops *ops, const bt_kv_pool *kv, int32_t hd)
{
    return ops->attn_block_rows && hd % 16 == 0 && hd <= ATTN_ROWS_HD &&
           (kv->dtype == BT_KV_F32 || kv->dtype == BT_KV_F16);
}

/* Every query of the task sees all of block b: the first is past its last key, and the last query's window (the
 * latest start) starts at or before its first */
static int block_whole(const bt_attn_args *a, const attn_task *tk, int32_t max_pos, int32_t b)
{
    return a->pos[tk->t0] >= (b + 1) * BT_KV_BLOCK - 1 &&
           (a->window <= 0 || max_pos - a->window + 1 <= b * BT_KV_BLOCK);
}

static void attn_task_run(void *ctx, int ti, int n_tasks)
{
    attn_plan *plan = ctx;
    const bt_attn_args *a = plan->a;
    const attn_task *tk = &plan->tasks[ti];
    const bt_kv_pool *kv = a->kv;
    int32_t hd = a->head_dim, group = a->n_head / a->n_head_kv;
    int32_t nq = tk->n * group;
    /* [query][group head][hd] accumulators, then m and l [query][group head] */
    float *acc = plan->parts + tk->part;
    float *m = acc + (size_t)nq * (size_t)hd, *l = m + nq;
    memset(acc, 0, sizeof(float) * (size_t)nq * (size_t)hd);
    for (int32_t i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
    }
    const int32_t *table = a->tables[tk->t0];
    int32_t max_pos = a->pos[tk->t0 + tk->n - 1];
    size_t row_bytes = (size_t)hd * (kv->dtype == BT_KV_F32 ? 4 : kv->dtype == BT_KV_INT8 ? 1 : 2);
    size_t bytes = BT_KV_BLOCK * row_bytes;
    /* Blocks are scattered over the pool, out of the hardware prefetcher's reach, so K and V are prefetched in
     * software: at the start the first two blocks (the first block's lines requested at once rather than as the
     * kernel reaches them), then the block two ahead, and during the last block the first block of the task this
     * thread most likely claims next (tasks are claimed in order, about one per thread at a time). Kernels that
     * can (ops->attn_prefetches) spread these requests over their loops: issued in one burst, part of them were
     * dropped and the kernel stalled on the first V loads (perf: a fifth of attention cycles). Measured on one
     * thread at 8 sequences, alternated runs: spread ~15% less attention time than K before and V after the kernel
     * (itself ~5% less than one burst). */
    int spread = plan->ops->attn_prefetches;
    int32_t b0 = tk->seg * ATTN_SEG_BLOCKS, nb = max_pos / BT_KV_BLOCK + 1;
    if (nb > b0 + ATTN_SEG_BLOCKS) nb = b0 + ATTN_SEG_BLOCKS;
    if (a->window > 0) { /* blocks before the first query's window hold no key any query of the task sees */
        int32_t lo = a->pos[tk->t0] - a->window + 1;
        if (lo > 0 && lo / BT_KV_BLOCK > b0) b0 = lo / BT_KV_BLOCK;
    }
    const attn_task *nt = ti + plan->nth < n_tasks ? &plan->tasks[ti + plan->nth] : NULL;
    /* K then V of the current block as f32 (ATTN_WIDEN_MIN); head sizes are at most 256 (model.c) */
    float wide[2 * BT_KV_BLOCK * 256] __attribute__((aligned(64)));
    const int widen = tk->n >= ATTN_WIDEN_MIN && kv->dtype == BT_KV_F16 && hd <= 256;
    /* The run's blocks that every query of it sees whole (block_whole) go through ops->attn_block_rows,
     * BT_CPU_ATTN_ROWS of the task's query rows a call, from the rows transposed once here (when some block is) */
    float qt[ATTN_ROWS_QT] __attribute__((aligned(64)));
    const int32_t n_chunks = (nq + BT_CPU_ATTN_ROWS - 1) / BT_CPU_ATTN_ROWS;
    int by_rows = rows_kernel_applies(plan->ops, kv, hd) && tk->n >= ATTN_WIDEN_MIN &&
                  (size_t)n_chunks * BT_CPU_ATTN_ROWS * (size_t)hd <= ATTN_ROWS_QT;
    if (by_rows) {
        int any = 0;
        for (int32_t b = b0; b < nb && !any; b++) any = block_whole(a, tk, max_pos, b);
        by_rows = any;
    }
    if (by_rows) {
        memset(qt, 0, sizeof(float) * (size_t)n_chunks * BT_CPU_ATTN_ROWS * (size_t)hd);
        for (int32_t si = 0; si < nq; si++)
            bt_cpu_attn_rows_put(hd, si % BT_CPU_ATTN_ROWS,
                                 a->q + ((size_t)(tk->t0 + si / group) * (size_t)a->n_head + (size_t)tk->g * group +
                                         (size_t)(si % group)) * (size_t)hd,
                                 qt + (size_t)(si / BT_CPU_ATTN_ROWS) * BT_CPU_ATTN_ROWS * (size_t)hd);
    }
    for (int32_t b = b0; b < nb; b++) {
        bt_cpu_kv_rows rows = attn_rows(kv, bt_kv_block_ptr(kv, a->layer, table[b]), tk->g);
        if (b == b0) {
            prefetch_rows(rows.k, bytes);
            prefetch_rows(rows.v, bytes);
            if (nb > b0 + 1) {
                bt_cpu_kv_rows second = attn_rows(kv, bt_kv_block_ptr(kv, a->layer, table[b0 + 1]), tk->g);
                prefetch_rows(second.k, bytes);
                prefetch_rows(second.v, bytes);
            }
        }
        if (widen) { /* the rows some query of the task reads (rows past max_pos may be unwritten) */
            int32_t used = max_pos - b * BT_KV_BLOCK + 1 < BT_KV_BLOCK ? max_pos - b * BT_KV_BLOCK + 1 : BT_KV_BLOCK;
            size_t e = (size_t)BT_KV_BLOCK * (size_t)hd;
            plan->ops->fp16_to_f32((int64_t)used * hd, rows.k, wide);
            plan->ops->fp16_to_f32((int64_t)used * hd, rows.v, wide + e);
            rows = (bt_cpu_kv_rows){.type = BT_CPU_KV_F32, .k = wide, .v = wide + e};
        }
        const int whole = by_rows && block_whole(a, tk, max_pos, b);
        bt_cpu_kv_rows ahead = {0};
        if (b + ATTN_PREFETCH < nb)
            ahead = attn_rows(kv, bt_kv_block_ptr(kv, a->layer, table[b + ATTN_PREFETCH]), tk->g);
        else if (b == nb - 1 && nt && a->tables[nt->t0][nt->seg * ATTN_SEG_BLOCKS] >= 0) /* not window-released */
            ahead = attn_rows(kv, bt_kv_block_ptr(kv, a->layer, a->tables[nt->t0][nt->seg * ATTN_SEG_BLOCKS]), nt->g);
        if (ahead.k && spread) {
            rows.pf_k = ahead.k, rows.pf_v = ahead.v, rows.pf_bytes = bytes;
        } else if (ahead.k) { /* K before the kernel, V after it: two half bursts */
            prefetch_rows(ahead.k, bytes);
        }
        for (int32_t r0 = 0; whole && r0 < nq; r0 += BT_CPU_ATTN_ROWS) /* the hints with the first call */
            plan->ops->attn_block_rows(hd, nq - r0 < BT_CPU_ATTN_ROWS ? nq - r0 : BT_CPU_ATTN_ROWS,
                                       qt + (size_t)r0 * (size_t)hd, a->scale, rows.k, rows.v, BT_KV_BLOCK, m + r0,
                                       l + r0, acc + (size_t)r0 * (size_t)hd, r0 == 0 ? &rows : NULL);
        for (int32_t qi = 0; !whole && qi < tk->n; qi++) {
            int32_t p = a->pos[tk->t0 + qi];
            if (p < b * BT_KV_BLOCK) continue;
            int32_t nkq = p - b * BT_KV_BLOCK + 1 < BT_KV_BLOCK ? p - b * BT_KV_BLOCK + 1 : BT_KV_BLOCK, j0 = 0;
            if (a->window > 0) { /* keys k with p - k < window: from lo = p - window + 1 */
                int32_t lo = p - a->window + 1;
                if (lo >= (b + 1) * BT_KV_BLOCK) continue;
                if (lo > b * BT_KV_BLOCK) j0 = lo - b * BT_KV_BLOCK;
            }
            int32_t si = qi * group;
            const float *q = a->q + ((size_t)(tk->t0 + qi) * (size_t)a->n_head + (size_t)tk->g * group) * (size_t)hd;
            if (j0) {
                bt_cpu_kv_rows part = rows_from(rows, j0, hd);
                plan->ops->attn_block(hd, group, q, a->scale, &part, nkq - j0, m + si, l + si,
                                      acc + (size_t)si * (size_t)hd);
            } else {
                plan->ops->attn_block(hd, group, q, a->scale, &rows, nkq, m + si, l + si,
                                      acc + (size_t)si * (size_t)hd);
            }
            rows.pf_k = rows.pf_v = NULL; /* once per block */
        }
        if (ahead.v && !spread) prefetch_rows(ahead.v, bytes);
    }
    if (tk->n_seg > 1) return; /* merged once every segment is done */
    for (int32_t qi = 0; qi < tk->n; qi++)
        for (int32_t hh = 0; hh < group; hh++) {
            int32_t h = tk->g * group + hh, si = qi * group + hh;
            float *o = a->out + ((size_t)(tk->t0 + qi) * (size_t)a->n_head + (size_t)h) * (size_t)hd;
            float inv = 1.0f / l[si];
            for (int32_t i = 0; i < hd; i++) o[i] = acc[(size_t)si * (size_t)hd + (size_t)i] * inv;
        }
}

/* Merge item ti: the run's segments for kv head g, in segment order. Weights exp(m_s - max m), so a token with a
 * single non-empty segment gets w = exp(0) = 1 and the bits of an unsplit reduction. */
static void attn_merge_run(void *ctx, int ti, int n_tasks)
{
    (void)n_tasks;
    attn_plan *plan = ctx;
    const bt_attn_args *a = plan->a;
    const attn_task *tk = &plan->tasks[ti];
    int32_t hd = a->head_dim, group = a->n_head / a->n_head_kv, nq = tk->n * group;
    size_t chunk = attn_part_floats(a, tk->n);
    for (int32_t qi = 0; qi < tk->n; qi++)
        for (int32_t hh = 0; hh < group; hh++) {
            int32_t si = qi * group + hh;
            float mx = -INFINITY;
            for (int32_t sg = 0; sg < tk->n_seg; sg++) {
                const float *ms = plan->parts + tk->part + ((size_t)sg * (size_t)a->n_head_kv + (size_t)tk->g) * chunk +
                                  (size_t)nq * (size_t)hd;
                if (ms[nq + si] > 0 && ms[si] > mx) mx = ms[si];
            }
            float *o = a->out + ((size_t)(tk->t0 + qi) * (size_t)a->n_head + (size_t)(tk->g * group + hh)) * (size_t)hd;
            float sum = 0;
            int first = 1;
            for (int32_t sg = 0; sg < tk->n_seg; sg++) {
                const float *acc = plan->parts + tk->part + ((size_t)sg * (size_t)a->n_head_kv + (size_t)tk->g) * chunk;
                const float *ms = acc + (size_t)nq * (size_t)hd, *ls = ms + nq;
                if (!(ls[si] > 0)) continue; /* no key of this token in the segment */
                float w = bt_cpu_expf(ms[si] - mx);
                const float *as = acc + (size_t)si * (size_t)hd;
                if (first) {
                    sum = ls[si] * w;
                    for (int32_t i = 0; i < hd; i++) o[i] = as[i] * w;
                    first = 0;
                } else {
                    sum = sum + ls[si] * w;
                    for (int32_t i = 0; i < hd; i++) o[i] = o[i] + as[i] * w;
                }
            }
            float inv = 1.0f / sum;
            for (int32_t i = 0; i < hd; i++) o[i] = o[i] * inv;
        }
}

/* The last token of the run that starts at token t: consecutive tokens of one sequence at consecutive positions, at
 * most chunk of them. */
static int32_t attn_run_end(const bt_attn_args *a, int32_t t, int32_t chunk)
{
    int32_t r = t;
    while (t + 1 < a->n_tokens && a->tables[t + 1] == a->tables[t] && a->pos[t + 1] == a->pos[t] + 1 &&
           t + 1 - r < chunk)
        t++;
    return t;
}

/* Query tokens per work item. base (attn_chunk_base), unless that leaves fewer than ATTN_MIN_TASKS tasks per thread: a
 * verification step of one sequence (its token and 4 drafts) was 3 tasks, one per kv head, so one of 2 threads ran
 * two and the other waited. Then runs are cut shorter, to about as many tasks as that (5 rows: runs of 2, 2 and 1,
 * 9 tasks). Each query token's blocks and their order stay the same, so its bits do not depend on the chunk. */
static int32_t attn_chunk(const bt_attn_args *a, int nth, int32_t base)
{
    size_t tasks = 0, want = (size_t)ATTN_MIN_TASKS * (size_t)nth;
    int32_t longest = 1;
    if (nth < 2) return base;
    for (int32_t t = 0; t < a->n_tokens; t++) {
        int32_t r = t;
        t = attn_run_end(a, t, base);
        tasks += ((size_t)(a->pos[t] / (BT_KV_BLOCK * ATTN_SEG_BLOCKS)) + 1) * (size_t)a->n_head_kv;
        if (tasks >= want) return base; /* enough already (a batch of sequences, a prompt chunk) */
        if (t - r + 1 > longest) longest = t - r + 1;
    }
    if (tasks == 0 || longest == 1) return base;
    size_t split = (want + tasks - 1) / tasks; /* pieces per run */
    int32_t c = (int32_t)(((size_t)longest + split - 1) / split);
    return c < 1 ? 1 : c;
}

/* The most query tokens per work item: ATTN_CHUNK, or twice that where it makes a task's query rows (tokens x GQA
 * group) a whole number of attn_block_rows calls that ATTN_CHUNK does not (an odd group: SmolLM2's 3 heads per KV head
 * are 24 rows, a 16-row call and an 8-row one, which broadcasts each key element for 8 rows instead of 16). */
static int32_t attn_chunk_base(const cpu_ctx *c, const bt_attn_args *a)
{
    const int32_t group = a->n_head / a->n_head_kv, rows = 2 * ATTN_CHUNK * group; /* a multiple of 16 */
    if (!rows_kernel_applies(c->ops, a->kv, a->head_dim) || (ATTN_CHUNK * group) % BT_CPU_ATTN_ROWS == 0)
        return ATTN_CHUNK;
    return (size_t)rows * (size_t)a->head_dim <= ATTN_ROWS_QT ? 2 * ATTN_CHUNK : ATTN_CHUNK;
}

static bt_status cpu_attention(bt_backend *be, const bt_attn_args *a)
{
    cpu_ctx *c = C(be);
    /* count the tasks and their accumulators first */
    int32_t chunk = attn_chunk(a, ctx_threads(c), attn_chunk_base(c, a)); /* query tokens per run */
    size_t n_seg_tasks = 0, n_merge = 0, floats = 0, merge_floats = 0;
    for (int32_t t = 0; t < a->n_tokens;) {
        int32_t r = t;
        t = attn_run_end(a, t, chunk);
        size_t segs = (size_t)(a->pos[t] / (BT_KV_BLOCK * ATTN_SEG_BLOCKS)) + 1;
        size_t run_floats = segs * (size_t)a->n_head_kv * attn_part_floats(a, t - r + 1);
        n_seg_tasks += segs * (size_t)a->n_head_kv;
        floats += run_floats;
        if (segs > 1) {
            n_merge += (size_t)a->n_head_kv;
            merge_floats += run_floats;
        }
        t++;
    }
    if (n_seg_tasks + n_merge > INT32_MAX) return bt_fail(BT_ERR_INVALID, "attention: too many tasks");
    if (n_seg_tasks + n_merge > c->attn_cap) {
        attn_task *t = realloc(c->attn_tasks, (n_seg_tasks + n_merge) * sizeof *t);
        if (!t) return bt_fail(BT_ERR_NOMEM, "attention: out of memory for %zu tasks", n_seg_tasks + n_merge);
        c->attn_tasks = t;
        c->attn_cap = n_seg_tasks + n_merge;
    }
    if (floats > c->attn_parts_cap) {
        void *p = NULL; /* on a line boundary, as every task's part (attn_part_floats) */
        if (posix_memalign(&p, 64, floats * sizeof(float)) != 0) p = NULL;
        if (!p) return bt_fail(BT_ERR_NOMEM, "attention: out of memory for %zu accumulators", floats);
        free(c->attn_parts);
        c->attn_parts = p;
        c->attn_parts_cap = floats;
    }
    /* segment-major within a run: the longer, earlier segments are claimed first */
    attn_task *seg = c->attn_tasks, *merge = c->attn_tasks + n_seg_tasks;
    size_t ns = 0, nm = 0, off = 0;
    for (int32_t t = 0; t < a->n_tokens;) {
        int32_t r = t;
        t = attn_run_end(a, t, chunk);
        int32_t n = t - r + 1, segs = a->pos[t] / (BT_KV_BLOCK * ATTN_SEG_BLOCKS) + 1;
        size_t part = attn_part_floats(a, n);
        if (segs > 1)
            for (int32_t g = 0; g < a->n_head_kv; g++) merge[nm++] = (attn_task){r, n, g, 0, segs, off};
        for (int32_t sg = 0; sg < segs; sg++)
            for (int32_t g = 0; g < a->n_head_kv; g++, off += part) seg[ns++] = (attn_task){r, n, g, sg, segs, off};
        t++;
    }
    attn_plan plan = {a, c->attn_tasks, c->ops, c->attn_parts, ctx_threads(c)};
    run_tasks(c, attn_task_run, &plan, (int)ns);
    if (nm) { /* a decode step's few merges cost less than a fork and join: this thread takes them */
        plan.tasks = merge;
        if (merge_floats < ATTN_MERGE_POOL_MIN)
            for (size_t i = 0; i < nm; i++) attn_merge_run(&plan, (int)i, (int)nm);
        else
            run_tasks(c, attn_merge_run, &plan, (int)nm);
    }
    return BT_OK;
}

typedef struct lanes_job {
    cpu_ctx *c;
    bt_lane_fn fn;
    void *user;
    bt_status st[BT_MAX_LANES];
    char msg[BT_MAX_LANES][256]; /* a lane's error message, recorded on the thread that ran it */
} lanes_job;

static void lane_task(void *arg, int i, int n)
{
    (void)n;
    lanes_job *j = arg;
    j->st[i] = j->fn(&j->c->lanes[i], i, j->user);
    if (j->st[i]) snprintf(j->msg[i], sizeof j->msg[i], "%s", bt_last_error());
}

static int cpu_max_lanes(bt_backend *be)
{
    return C(be)->lanes_on ? C(be)->n_lanes : 0;
}

static bt_status cpu_run_lanes(bt_backend *be, int n_lanes, bt_lane_fn fn, void *user)
{
    cpu_ctx *c = C(be);
    if (n_lanes < 1 || n_lanes > c->n_lanes)
        return bt_fail(BT_ERR_INVALID, "run_lanes: %d lanes (1..%d)", n_lanes, c->n_lanes);
    lanes_job *j = c->job;
    j->c = c, j->fn = fn, j->user = user;
    for (int i = 0; i < n_lanes; i++) j->st[i] = BT_OK;
    bt_pool_run_tasks(c->pool, lane_task, j, n_lanes);
    bt_status st = BT_OK;
    for (int i = 0; i < n_lanes && !st; i++)
        if (j->st[i]) st = bt_fail(j->st[i], "%s", j->msg[i]);
    return st;
}

static void cpu_host_tasks(bt_backend *be, bt_host_task_fn fn, void *user, int n)
{
    run_tasks(C(be), fn, user, n);
}

static int cpu_host_threads(bt_backend *be)
{
    return ctx_threads(C(be));
}

static void cpu_swiglu(bt_backend *be, const float *g, const float *u, int64_t n, float *out)
{
    elem_job j = {.ops = C(be)->ops, .kind = ELEM_SWIGLU, .a = g, .b = u, .out = out, .n_rows = 1, .n = n};
    elem_go(C(be), &j);
}

static void cpu_geglu(bt_backend *be, const float *g, const float *u, int64_t n, float *out)
{
    elem_job j = {.ops = C(be)->ops, .kind = ELEM_GEGLU, .a = g, .b = u, .out = out, .n_rows = 1, .n = n};
    elem_go(C(be), &j);
}

static void cpu_add(bt_backend *be, float *x, const float *y, int64_t n)
{
    elem_job j = {.ops = C(be)->ops, .kind = ELEM_ADD, .a = y, .out = x, .n_rows = 1, .n = n};
    elem_go(C(be), &j);
}

static void cpu_scale(bt_backend *be, float *x, float s, int64_t n)
{
    (void)be;
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

static const bt_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .buf_set = cpu_buf_copy,
    .buf_get = cpu_buf_copy,
    .buf_copy = cpu_buf_copy,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .matmul_multi = cpu_matmul_multi,
    .max_lanes = cpu_max_lanes,
    .run_lanes = cpu_run_lanes,
    .host_tasks = cpu_host_tasks,
    .host_threads = cpu_host_threads,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .geglu = cpu_geglu,
    .add = cpu_add,
    .scale = cpu_scale,
};

bt_status bt_cpu_opts_from_env(bt_cpu_opts *o)
{
    static const char *const bits[] = {"8", "16"}, *const off_on[] = {"0", "1"};
    int isa = -1, wide = 1, repack = 1, lanes = 1;
    bt_status st;
    if ((st = bt_cpu_isa_env(&isa)) || (st = bt_env_choice("BATON_ACT_BITS", bits, 2, 1, &wide)) ||
        (st = bt_env_choice("BATON_CPU_REPACK", off_on, 2, 1, &repack)) ||
        (st = bt_env_choice("BATON_CPU_LANES", off_on, 2, 1, &lanes)))
        return st;
    o->force_isa = isa >= 0;
    o->isa = isa >= 0 ? isa : 0;
    o->act_bits = wide ? 16 : 8;
    o->no_repack = !repack;
    o->no_lanes = !lanes;
    return BT_OK;
}

bt_status bt_backend_cpu_create(const bt_cpu_opts *o, bt_backend **out)
{
    static const bt_cpu_opts defaults = {0};
    if (!o) o = &defaults;
    if (o->act_bits != 0 && o->act_bits != 8 && o->act_bits != 16)
        return bt_fail(BT_ERR_INVALID, "cpu backend: activations are 8 or 16 bits, not %d", o->act_bits);
    bt_cpu_isa isa;
    bt_status st = bt_cpu_isa_select(o->force_isa ? o->isa : -1, &isa);
    if (st) return st;
    int n_threads = o->n_threads;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    bt_backend *be = calloc(1, sizeof *be);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return bt_fail(BT_ERR_NOMEM, "out of memory creating the cpu backend");
    }
    c->ops = bt_cpu_ops_get(isa);
    c->act_bits = o->act_bits ? o->act_bits : 16;
    c->repack = !o->no_repack;
    c->lanes_on = !o->no_lanes;
    if ((st = bt_pool_create(n_threads, &c->pool))) {
        free(be);
        free(c);
        return st;
    }
    if ((st = bt_hostmem_arena_create(PACK_CHUNK_BYTES, &c->pack_mem))) {
        bt_pool_destroy(c->pool);
        free(be);
        free(c);
        return st;
    }
    c->root = c;
    pthread_mutex_init(&c->pack_mu, NULL);
    be->ops = &cpu_ops;
    be->ctx = c;
    int nl = bt_pool_size(c->pool) < BT_MAX_LANES ? bt_pool_size(c->pool) : BT_MAX_LANES;
    if (nl > 1) { /* lanes only make sense with threads to run them on */
        c->lanes = calloc((size_t)nl, sizeof *c->lanes);
        c->job = calloc(1, sizeof *c->job);
        for (int i = 0; c->lanes && c->job && i < nl; i++) {
            cpu_ctx *lc = calloc(1, sizeof *lc);
            if (!lc) break;
            lc->ops = c->ops, lc->act_bits = c->act_bits, lc->repack = c->repack, lc->root = c;
            c->lanes[i] = (bt_backend){.ops = &cpu_ops, .ctx = lc};
            c->n_lanes = i + 1;
        }
        if (c->n_lanes < nl) {
            cpu_destroy(be);
            return bt_fail(BT_ERR_NOMEM, "out of memory for the CPU backend's lanes");
        }
    }
    *out = be;
    return BT_OK;
}

int bt_backend_cpu_act_bits(const bt_backend *be)
{
    return be->ops == &cpu_ops ? ((const cpu_ctx *)be->ctx)->act_bits : 16;
}

const char *bt_backend_cpu_isa(const bt_backend *be)
{
    return be->ops == &cpu_ops ? ((const cpu_ctx *)be->ctx)->ops->name : be->ops->name;
}

/* Counts the model's matrices by weight type. */
/* A matrix of the model, counted by type with its bytes in the file and in the packed copy it would have here */
typedef struct type_tally {
    int n;
    double file_bytes, packed_bytes;
} type_tally;

static void count_matrix(const cpu_ctx *c, const bt_weight *w, type_tally *tally)
{
    if (!w->data || w->n_out <= 1 || w->type >= BT_TYPE_COUNT) return;
    type_tally *t = &tally[w->type];
    t->n++;
    t->file_bytes += (double)bt_cpu_row_bytes(w->type, w->n_in) * (double)w->n_out;
    t->packed_bytes += (double)bt_cpu_pack_bytes(c->ops, w->type, c->act_bits, w->n_in, w->n_out);
}

void bt_backend_cpu_describe(const bt_backend *be, const bt_model *m, char *buf, size_t cap)
{
    if (be->ops != &cpu_ops) {
        snprintf(buf, cap, "%s kernels", be->ops->name);
        return;
    }
    const cpu_ctx *c = be->ctx;
    type_tally tally[BT_TYPE_COUNT] = {{0}};
    for (int32_t l = 0; l < m->hp.n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        const bt_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) count_matrix(c, ws[i], tally);
    }
    count_matrix(c, &m->output, tally);
    size_t used = 0;
    if (cap) buf[0] = 0;
    for (uint32_t t = 0; t < BT_TYPE_COUNT && used < cap; t++) {
        if (!tally[t].n) continue;
        int packed = c->repack && bt_cpu_pack_supported(c->ops, t, c->act_bits);
        /* a packed copy's bytes against the file's: what a memory-bound decode streams more than the file holds */
        char ratio[32] = "";
        if (packed && tally[t].file_bytes > 0)
            snprintf(ratio, sizeof ratio, " (%.2fx the file's bytes)", tally[t].packed_bytes / tally[t].file_bytes);
        int k = snprintf(buf + used, cap - used, "%s%s x%d %s%s", used ? ", " : "", bt_ggml_type_name(t), tally[t].n,
                         packed ? "packed" : c->repack ? "row kernels (no packed layout)" : "row kernels", ratio);
        if (k < 0) break;
        used += (size_t)k;
    }
}

int bt_backend_cpu_threads(const bt_backend *be)
{
    return be->ops == &cpu_ops ? bt_pool_size(((const cpu_ctx *)be->ctx)->pool) : 1;
}
