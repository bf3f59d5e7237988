/* The cuda backend (engine/backend.h) as a plugin: kernels and their host glue, built into libbaton_cuda.so.
 *
 * Memory. buf_alloc is device memory (cudaMalloc); the forward pass keeps its activations there. The forward pass
 * also hands over host pointers: model weights (the GGUF mapping), norm weights and biases, token ids, positions,
 * KV slots and block tables, and the logits it wants back. Every op therefore asks the driver what a pointer is
 * (cudaPointerGetAttributes): weights living on the host get a device copy on first use, kept for the backend's
 * life and keyed by the pointer (backend.h allows derived copies keyed by the pointer); other host inputs are staged
 * into scratch per call, and a host output (logits) is computed in scratch and copied back before the op returns.
 * One stream, in order: ops are asynchronous except the ones that return data to the host.
 *
 * Batch invariance. No kernel's arithmetic for one row depends on how many rows there are: the matmul runs one
 * tensor-core kernel for every row count (rows padded to the 16-row MMA tile, K walked in the same 16-wide steps in
 * the same order), attention splits each query's keys at fixed positions (every 256) and merges the parts in order,
 * and every reduction (rmsnorm, attention dots) has a fixed shape set by the row length alone.
 *
 * Errors of ops that return void (kernel launch failures) are kept and returned by the next matmul or attention. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_plugin.h"

using namespace nvcuda;

#include "engine/cuda/cuda_quants.cuh"

/* ---- embed: one thread per output element chunk of 32 ---- */

template <int T>
__global__ void k_embed(const uint8_t *w, size_t rb, const int32_t *tokens, int32_t n, int64_t n_in, float *out)
{
    int64_t chunks = n_in / 32;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= chunks * n) return;
    int64_t t = i / chunks, c = i % chunks;
    float y[32];
    deq_chunk<T>(w + (size_t)tokens[t] * rb, c, y);
    float *o = out + t * n_in + 32 * c;
    for (int j = 0; j < 32; j++) o[j] = y[j];
}

/* ---- matmul: out[M][N] = x[M][K] . W[N][K]^T, tensor cores on f16 tiles dequantized on the fly ----
 * A block of 128 threads (4 warps) owns BN = 64 output columns and BM rows (16 for decode-sized M, 64 otherwise);
 * grid = (N / 64, M / BM). Each K step of BK = 128 copies the 64-row weight tile's raw GGUF blocks to shared memory
 * (coalesced word loads), dequantizes it there (each thread two 32-element chunks, to f16) and loads the BM x 128
 * activation tile (f32 -> f16),
 * then every warp runs 8 WMMA 16x16x16 steps in K order. Each output element accumulates in f32 over the same K
 * steps in the same order whatever BM is: a row's bits do not depend on the batch. A row whose activations would
 * overflow f16 is first scaled by a power of two (k_row_scale), undone exactly in the epilogue.
 * K is split into fixed slices of MM_KSPLIT elements (grid.z), each written as an f32 partial and summed in slice
 * order by k_matmul_reduce: a batch-1 decode of a 4096-wide matrix then has 4x the blocks reading weights at once
 * (bytes in flight are what a memory-bound kernel needs), and the split depends on K alone, never on the row count.
 * Why WMMA on dequantized tiles rather than cuBLASLt: one kernel serves decode and prefill (batch invariance between
 * a decode row and a prefill chunk in the same step), reads the GGUF blocks once without a dequantized copy of the
 * model in HBM, and needs no extra library in the carry folder. */
#define MM_BN 64
#define MM_BK 128
#define MM_THREADS 128
#define MM_KSPLIT 1024 /* K elements per slice (a multiple of MM_BK) */

/* out: [M][N] when K fits one slice (bias added here), else partials [slice][M][N] (bias added by the reduce) */
/* xs[m]: row m's activation scale (a power of two, see k_row_scale), applied before the f16 rounding and undone in
 * the epilogue */
template <int T, int BM>
__global__ void __launch_bounds__(MM_THREADS) k_matmul(const uint8_t *w, size_t rb, const float *bias, const float *x,
                                                       const float *xs, int32_t M, int64_t N, int64_t K, float *out)
{
    __shared__ __align__(32) half sw[MM_BN][MM_BK + 8];
    __shared__ __align__(32) half sx[BM][MM_BK + 8];
    /* the tile's raw GGUF bytes, row by row (quantized types), then the epilogue's output staging: 48,384 bytes of
     * static shared memory in all for BM = 64, under the 48 KiB limit */
    __shared__ __align__(32) unsigned char raw[MM_BN * TILE_SPAN_MAX];
    float(*so)[16 * 16] = reinterpret_cast<float(*)[16 * 16]>(raw);
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int64_t n0 = (int64_t)blockIdx.x * MM_BN;
    const int32_t m0 = blockIdx.y * BM;
    /* decode tile: warp w owns columns 16w..; prefill tile: warp w owns rows 16w.., all 4 column tiles */
    constexpr int NF = BM == 16 ? 1 : 4;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) wmma::fill_fragment(acc[f], 0.0f);
    const int64_t kb = (int64_t)blockIdx.z * MM_KSPLIT, ke = kb + MM_KSPLIT < K ? kb + MM_KSPLIT : K;
    if (gridDim.z > 1) {
        out += (size_t)blockIdx.z * (size_t)M * (size_t)N;
        bias = NULL;
    }
    /* the tile's rows past M (a decode tile of 1 row: 15 of 16) stay zero: zeroed once here, not staged every step
     * (the first step's barrier orders these stores before any MMA reads them) */
    const int mrows = M - m0 < BM ? M - m0 : BM;
    for (int q = tid; q < (BM - mrows) * MM_BK / 2; q += MM_THREADS)
        *(half2 *)&sx[mrows + 2 * q / MM_BK][2 * q % MM_BK] = __float2half2_rn(0.0f);
    for (int64_t k0 = kb; k0 < ke; k0 += MM_BK) {
        /* quantized weights: the tile's raw bytes first, row after row, consecutive threads reading consecutive
         * words (coalesced; the blocks' own fields are only 2-byte aligned), then dequantized from shared memory */
        size_t off = 0;
        int len = 0;
        int64_t c0 = 0;
        if constexpr (blk_bytes<T>() > 0) {
            tile_span<T>(k0, ke, &off, &len, &c0);
            stage_tile<T, MM_BN, MM_THREADS>(raw, w, rb, n0, N - n0 < MM_BN ? (int)(N - n0) : MM_BN, off, len, tid);
            __syncthreads();
        }
        /* weights: 64 rows x 4 chunks = 256 chunks, two per thread */
        for (int i = tid; i < MM_BN * (MM_BK / 32); i += MM_THREADS) {
            int r = i / (MM_BK / 32), cc = i % (MM_BK / 32);
            int64_t c = k0 / 32 + cc;
            float y[32];
            if (n0 + r < N && 32 * c < ke) {
                if constexpr (blk_bytes<T>() > 0)
                    deq_chunk<T>(raw + r * TILE_SPAN_MAX, c - c0, y);
                else
                    deq_chunk<T>(w + (size_t)(n0 + r) * rb, c, y);
            } else {
                for (int j = 0; j < 32; j++) y[j] = 0.0f;
            }
            /* f16 eight at a time: one 16-byte store and four paired conversions instead of 8 and 8 */
#pragma unroll
            for (int j = 0; j < 32; j += 8) {
                __align__(16) half2 h[4];
#pragma unroll
                for (int q = 0; q < 4; q++) h[q] = __floats2half2_rn(y[j + 2 * q], y[j + 2 * q + 1]);
                *(uint4 *)&sw[r][32 * cc + j] = *(const uint4 *)h;
            }
        }
        /* activations in pairs (K is a multiple of 32, type_ok): half the loads, conversions and stores of one element
         * at a time, which cost 10% of decode and 25% of prefill on an H200; the rows past M were zeroed once */
        for (int q = tid; q < mrows * MM_BK / 2; q += MM_THREADS) {
            int r = 2 * q / MM_BK, kk = 2 * q % MM_BK;
            half2 h = __float2half2_rn(0.0f);
            if (k0 + kk < ke) {
                const float *xr = x + (size_t)(m0 + r) * (size_t)K + (size_t)(k0 + kk);
                h = __floats2half2_rn(xr[0] * xs[m0 + r], xr[1] * xs[m0 + r]);
            }
            *(half2 *)&sx[r][kk] = h;
        }
        __syncthreads();
        for (int ks = 0; ks < MM_BK; ks += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
            if (BM == 16) {
                wmma::load_matrix_sync(fa, &sx[0][ks], MM_BK + 8);
                wmma::load_matrix_sync(fb, &sw[16 * warp][ks], MM_BK + 8);
                wmma::mma_sync(acc[0], fa, fb, acc[0]);
            } else {
                wmma::load_matrix_sync(fa, &sx[16 * warp][ks], MM_BK + 8);
#pragma unroll
                for (int f = 0; f < NF; f++) {
                    wmma::load_matrix_sync(fb, &sw[16 * f][ks], MM_BK + 8);
                    wmma::mma_sync(acc[f], fa, fb, acc[f]);
                }
            }
        }
        __syncthreads();
    }
    /* unrolled: the accumulators must stay in registers (a loop over f indexes them, which puts them on the stack) */
#pragma unroll
    for (int f = 0; f < NF; f++) {
        int rr = BM == 16 ? 0 : 16 * warp, cb = BM == 16 ? 16 * warp : 16 * f;
        wmma::store_matrix_sync(so[warp], acc[f], 16, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            int r = e / 16, cidx = e % 16;
            int32_t m = m0 + rr + r;
            int64_t n = n0 + cb + cidx;
            if (m < M && n < N)
                out[(size_t)m * (size_t)N + (size_t)n] = so[warp][e] * (1.0f / xs[m]) + (bias ? bias[n] : 0.0f);
        }
        __syncwarp();
    }
}

/* xs[m] = 1, or for a row whose largest |x| passes 2^14 the power of two that brings it to [2^13, 2^14): f16 (max
 * 65504) cannot hold such activations, and a power of two scales without rounding. One block of 256 per row;
 * depends on the row alone. */
__global__ void k_row_scale(const float *x, int64_t K, float *xs)
{
    __shared__ float part[256];
    const float *xr = x + (size_t)blockIdx.x * (size_t)K;
    float mx = 0.0f;
    for (int64_t i = threadIdx.x; i < K; i += 256) mx = fmaxf(mx, fabsf(xr[i]));
    part[threadIdx.x] = mx;
    __syncthreads();
    for (int h = 128; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + h]);
        __syncthreads();
    }
    if (threadIdx.x) return;
    float s = 1.0f;
    mx = part[0];
    if (isfinite(mx))
        while (mx * s >= 16384.0f) s *= 0.5f;
    xs[blockIdx.x] = s;
}

/* out[m][n] = sum over slices s in order of part[s][m][n] (+ bias[n]) */
__global__ void k_matmul_reduce(const float *part, int n_slices, const float *bias, int64_t MN, int64_t N, float *out)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float s = part[i];
    for (int z = 1; z < n_slices; z++) s += part[(size_t)z * (size_t)MN + (size_t)i];
    out[i] = s + (bias ? bias[i % N] : 0.0f);
}

/* ---- rmsnorm: one block of 256 threads per row; fixed-shape reduction ---- */

__global__ void k_rmsnorm(const float *x, const float *w, int32_t n, float eps, float *out)
{
    __shared__ double part[256];
    const float *xr = x + (size_t)blockIdx.x * (size_t)n;
    float *orow = out + (size_t)blockIdx.x * (size_t)n;
    double s = 0;
    for (int32_t i = threadIdx.x; i < n; i += 256) s += (double)xr[i] * xr[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int h = 128; h > 0; h /= 2) {
        if ((int)threadIdx.x < h) part[threadIdx.x] += part[threadIdx.x + h];
        __syncthreads();
    }
    float scale = (float)(1.0 / sqrt(part[0] / (double)n + eps));
    for (int32_t i = threadIdx.x; i < n; i += 256) orow[i] = xr[i] * scale * w[i];
}

/* ---- rope: one thread per (token, head, pair), angles in double as the cpu backend computes them ---- */

__global__ void k_rope(float *x, const int32_t *pos, int32_t n_tokens, int32_t n_heads, int32_t head_dim,
                       int32_t n_rot, float base, float freq_scale, int neox)
{
    int32_t half_rot = n_rot / 2;
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n_tokens * n_heads * half_rot) return;
    int32_t pr = (int32_t)(i % half_rot);
    int64_t th = i / half_rot;
    int32_t t = (int32_t)(th / n_heads);
    float *v = x + th * head_dim;
    double ang = (double)pos[t] * freq_scale * pow((double)base, -2.0 * pr / n_rot);
    float cs = (float)cos(ang), sn = (float)sin(ang);
    float *a = neox ? v + pr : v + 2 * pr, *b = neox ? v + pr + half_rot : v + 2 * pr + 1;
    float x0 = *a, x1 = *b;
    *a = x0 * cs - x1 * sn;
    *b = x0 * sn + x1 * cs;
}

/* ---- element-wise ---- */

__global__ void k_swiglu(const float *g, const float *u, int64_t n, float *out)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

__global__ void k_geglu(const float *g, const float *u, int64_t n, float *out)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double v = g[i];
    double y = 0.5 * v * (1.0 + tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    out[i] = (float)y * u[i];
}

__global__ void k_add(float *x, const float *y, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

__global__ void k_scale(float *x, float s, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s; /* one float multiply: the CPU's bits exactly */
}

/* ---- KV pool ---- */

struct kv_geom {
    uint8_t *base;
    int32_t n_blocks, n_head_kv, head_dim, dtype; /* dtype: bt_kv_dtype */
    size_t block_stride, v_off, ks_off, vs_off;
};

static kv_geom kv_of(const bt_kv_pool *kv)
{
    kv_geom g;
    g.base = kv->base, g.n_blocks = kv->n_blocks, g.n_head_kv = kv->n_head_kv, g.head_dim = kv->head_dim;
    g.dtype = (int32_t)kv->dtype, g.block_stride = kv->block_stride, g.v_off = kv->v_off;
    g.ks_off = kv->ks_off, g.vs_off = kv->vs_off;
    return g;
}

__device__ __forceinline__ uint8_t *kv_block(const kv_geom &g, int32_t layer, int32_t block)
{
    return g.base + ((size_t)layer * (size_t)g.n_blocks + (size_t)block) * g.block_stride;
}

/* Asymmetric 8-bit code of one row, as engine/backend_cpu.c's quantize_row_u8 (fp16 min rounded down, scale up). */
__device__ void quantize_row_u8(const float *x, int32_t n, uint8_t *q, uint16_t *sm)
{
    float lo = x[0], hi = x[0];
    for (int32_t i = 1; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    lo = fmaxf(lo, -65504.0f), hi = fminf(hi, 65504.0f);
    uint16_t hl = __half_as_ushort(__float2half_rn(lo));
    if (h2f(hl) > lo) hl = (uint16_t)(hl & 0x8000u ? hl + 1u : hl ? hl - 1u : 0x8001u);
    float mn = h2f(hl), d = (hi - mn) / 255.0f;
    uint16_t hd = __half_as_ushort(__float2half_rn(d));
    if (h2f(hd) < d) hd++;
    if (hd >= 0x7c00u) hd = 0x7bffu;
    d = h2f(hd);
    float inv = d > 0 ? 1.0f / d : 0.0f;
    for (int32_t i = 0; i < n; i++) {
        float v = rintf((x[i] - mn) * inv);
        q[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    sm[0] = hd;
    sm[1] = hl;
}

/* grid (n_tokens, n_head_kv), head_dim threads (f16/f32) or one thread (int8 rows need their min and max) */
__global__ void k_kv_write(kv_geom g, int32_t layer, const float *k, const float *v, const int32_t *slots)
{
    int32_t t = blockIdx.x, h = blockIdx.y, hd = g.head_dim;
    uint8_t *blk = kv_block(g, layer, slots[t] / 16);
    size_t row = (size_t)h * 16 + (size_t)(slots[t] % 16), e = row * (size_t)hd;
    const float *ks = k + ((size_t)t * (size_t)g.n_head_kv + (size_t)h) * (size_t)hd;
    const float *vs = v + ((size_t)t * (size_t)g.n_head_kv + (size_t)h) * (size_t)hd;
    if (g.dtype == BT_KV_INT8) {
        if (threadIdx.x) return;
        quantize_row_u8(ks, hd, blk + e, (uint16_t *)(blk + g.ks_off) + 2 * row);
        quantize_row_u8(vs, hd, blk + g.v_off + e, (uint16_t *)(blk + g.vs_off) + 2 * row);
        return;
    }
    for (int32_t i = threadIdx.x; i < hd; i += blockDim.x) {
        if (g.dtype == BT_KV_F32) {
            ((float *)blk)[e + i] = ks[i];
            ((float *)(blk + g.v_off))[e + i] = vs[i];
        } else {
            ((half *)blk)[e + i] = __float2half_rn(ks[i]);
            ((half *)(blk + g.v_off))[e + i] = __float2half_rn(vs[i]);
        }
    }
}

/* Element i of row j (which 0: K, 1: V) of kv head h in a block. */
__device__ __forceinline__ float kv_elem(const kv_geom &g, const uint8_t *blk, int which, int32_t h, int32_t j,
                                         int32_t i)
{
    size_t row = (size_t)h * 16 + (size_t)j, e = row * (size_t)g.head_dim + (size_t)i;
    const uint8_t *base = which ? blk + g.v_off : blk;
    if (g.dtype == BT_KV_F16) return __half2float(((const half *)base)[e]);
    if (g.dtype == BT_KV_F32) return ((const float *)base)[e];
    const uint16_t *sm = (const uint16_t *)(blk + (which ? g.vs_off : g.ks_off)) + 2 * row;
    return fmaf(h2f(sm[0]), (float)base[e], h2f(sm[1]));
}

/* ---- paged attention (decode and prefill) ----
 * Block per (token, query head, segment of 256 key positions), 4 warps. Warp w takes the keys k = s0 + w, s0 + w + 4,
 * ... of the segment; each lane holds head_dim / 32 of q and of its V accumulator (head_dim <= 256); a key's dot is
 * a fixed butterfly over the warp, softmax runs online per warp, and the 4 warps merge in warp order. Segments are
 * written as (acc, m, l) parts and k_attn_merge combines them in segment order: the split depends on the token's
 * position alone, never on the batch. Reads K/V straight from the pool's blocks through the token's block table. */
#define ATTN_SEG 256
#define ATTN_WARPS 4
#define ATTN_MAX_PER_LANE 8

struct attn_dev_args {
    kv_geom g;
    int32_t layer, n_tokens, n_head, n_head_kv, head_dim, window, n_seg;
    float scale;
    const float *q;
    const int32_t *pos;
    const int32_t *table_off; /* [n_tokens] offset of each token's block table in tables */
    const int32_t *tables;
    float *parts; /* [n_tokens][n_head][n_seg][head_dim + 2] */
};

__global__ void __launch_bounds__(ATTN_WARPS * 32) k_attn(attn_dev_args a)
{
    __shared__ float wacc[ATTN_WARPS][256];
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    int32_t t = blockIdx.x, h = blockIdx.y, seg = blockIdx.z;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int32_t hd = a.head_dim, per = (hd + 31) / 32, kvh = h / (a.n_head / a.n_head_kv);
    int32_t p = a.pos[t];
    int32_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
    int32_t s0 = seg * ATTN_SEG, s1 = s0 + ATTN_SEG - 1 < p ? s0 + ATTN_SEG - 1 : p;
    if (s0 < lo) s0 = lo;
    const float *q = a.q + ((size_t)t * (size_t)a.n_head + (size_t)h) * (size_t)hd;
    const int32_t *table = a.tables + a.table_off[t];
    float qr[ATTN_MAX_PER_LANE], acc[ATTN_MAX_PER_LANE];
    for (int i = 0; i < per; i++) {
        int32_t d = lane + 32 * i;
        qr[i] = d < hd ? q[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int32_t k = s0 + warp; k <= s1; k += ATTN_WARPS) {
        const uint8_t *blk = kv_block(a.g, a.layer, table[k / 16]);
        int32_t j = k % 16;
        float s = 0.0f;
        for (int i = 0; i < per; i++) {
            int32_t d = lane + 32 * i;
            if (d < hd) s = fmaf(qr[i], kv_elem(a.g, blk, 0, kvh, j, d), s);
        }
        for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
        s *= a.scale;
        float mn = fmaxf(m, s), c = expf(m - mn), w = expf(s - mn);
        l = l * c + w;
        for (int i = 0; i < per; i++) {
            int32_t d = lane + 32 * i;
            float vv = d < hd ? kv_elem(a.g, blk, 1, kvh, j, d) : 0.0f;
            acc[i] = fmaf(w, vv, acc[i] * c);
        }
        m = mn;
    }
    for (int i = 0; i < per; i++)
        if (lane + 32 * i < hd) wacc[warp][lane + 32 * i] = acc[i];
    if (lane == 0) wm[warp] = m, wl[warp] = l;
    __syncthreads();
    if (warp) return;
    float mx = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; w++)
        if (wl[w] > 0) mx = fmaxf(mx, wm[w]);
    float L = 0.0f;
    float o[ATTN_MAX_PER_LANE];
    for (int i = 0; i < per; i++) o[i] = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++) {
        if (!(wl[w] > 0)) continue;
        float f = expf(wm[w] - mx);
        L += wl[w] * f;
        for (int i = 0; i < per; i++)
            if (lane + 32 * i < hd) o[i] = fmaf(wacc[w][lane + 32 * i], f, o[i]);
    }
    size_t slot = ((size_t)t * (size_t)a.n_head + (size_t)h) * (size_t)a.n_seg + (size_t)seg;
    float *part = a.parts + slot * (size_t)(hd + 2);
    for (int i = 0; i < per; i++)
        if (lane + 32 * i < hd) part[lane + 32 * i] = o[i];
    if (lane == 0) part[hd] = mx, part[hd + 1] = L;
}

/* grid (n_tokens, n_head), 32 threads: the token's segments in order */
__global__ void k_attn_merge(attn_dev_args a, float *out)
{
    int32_t t = blockIdx.x, h = blockIdx.y, hd = a.head_dim, lane = threadIdx.x;
    int32_t p = a.pos[t], nseg = p / ATTN_SEG + 1;
    const float *parts = a.parts + ((size_t)t * (size_t)a.n_head + (size_t)h) * (size_t)a.n_seg * (size_t)(hd + 2);
    int32_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
    int32_t sg0 = lo / ATTN_SEG;
    float mx = -INFINITY;
    for (int32_t s = sg0; s < nseg; s++) {
        const float *ps = parts + (size_t)s * (size_t)(hd + 2);
        if (ps[hd + 1] > 0) mx = fmaxf(mx, ps[hd]);
    }
    float L = 0.0f;
    float *o = out + ((size_t)t * (size_t)a.n_head + (size_t)h) * (size_t)hd;
    for (int32_t d = lane; d < hd; d += 32) o[d] = 0.0f;
    for (int32_t s = sg0; s < nseg; s++) {
        const float *ps = parts + (size_t)s * (size_t)(hd + 2);
        if (!(ps[hd + 1] > 0)) continue;
        float f = expf(ps[hd] - mx);
        L += ps[hd + 1] * f;
        for (int32_t d = lane; d < hd; d += 32) o[d] = fmaf(ps[d], f, o[d]);
    }
    float inv = 1.0f / L;
    for (int32_t d = lane; d < hd; d += 32) o[d] *= inv;
}

/* ---- host side ---- */

/* a device copy of a host-resident weight; its first bytes guard against a freed weight's address being reused by
 * another tensor (as the cpu backend's packed copies do) */
struct wentry {
    const void *key;
    size_t bytes;
    uint8_t head[16];
    void *dev;
};

static void head_of(const void *p, size_t bytes, uint8_t head[16])
{
    memset(head, 0, 16);
    memcpy(head, p, bytes < 16 ? bytes : 16);
}

/* scratch slots for staged host inputs and outputs */
enum { S_X, S_OUT, S_PART, S_SCALE, S_I0, S_I1, S_I2, S_AI, S_ATTN, S_COUNT };

struct cuda_ctx {
    bt_cuda_host host;
    int device;
    cudaStream_t stream;
    wentry *w;
    size_t w_cap, w_n, w_bytes;
    void *scratch[S_COUNT];
    size_t scratch_cap[S_COUNT];
    /* the host bytes last staged into each slot by dev_in (valid while shadow_bytes > 0): a step's positions, slots
     * and block tables are the same for every layer, so they cross once per step instead of once per op */
    void *shadow[S_COUNT];
    size_t shadow_bytes[S_COUNT], shadow_cap[S_COUNT];
    int32_t *h_ints; /* host staging for block tables */
    size_t h_ints_cap;
    struct buf_range *bufs; /* see in_bufs */
    size_t n_bufs, bufs_cap;
    bt_status err; /* first error of a void op, returned by the next op that returns a status */
    char err_msg[256];
};

static cuda_ctx *CX(bt_backend *be)
{
    return (cuda_ctx *)be->ctx;
}

static bt_status cfail(cuda_ctx *c, bt_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bt_status cfail(cuda_ctx *c, bt_status st, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return c->host.fail(st, "%s", msg);
}

/* records the first error of a void op */
static void keep_err(cuda_ctx *c, bt_status st, const char *what, cudaError_t e)
{
    if (c->err) return;
    c->err = st;
    snprintf(c->err_msg, sizeof c->err_msg, "cuda: %s: %s", what, e == cudaSuccess ? "" : cudaGetErrorString(e));
}

static bt_status take_err(cuda_ctx *c)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) keep_err(c, BT_ERR_INTERNAL, "kernel launch", e);
    if (!c->err) return BT_OK;
    bt_status st = c->err;
    c->err = BT_OK;
    return c->host.fail(st, "%s", c->err_msg);
}

/* The buffers buf_alloc handed out, [n_bufs] sorted by start: the pointers ops receive are checked here first, so
 * the driver is asked (cudaPointerGetAttributes, about a microsecond) only about host memory and foreign pointers. */
struct buf_range {
    uintptr_t start, end;
};

static int in_bufs(const cuda_ctx *c, const void *p)
{
    uintptr_t a = (uintptr_t)p;
    size_t lo = 0, hi = c->n_bufs;
    while (lo < hi) { /* the last range starting at or before a */
        size_t mid = (lo + hi) / 2;
        if (c->bufs[mid].start <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo > 0 && a < c->bufs[lo - 1].end;
}

static int is_dev_ptr(const void *p)
{
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return at.type == cudaMemoryTypeDevice || at.type == cudaMemoryTypeManaged;
}

static int is_dev(const cuda_ctx *c, const void *p)
{
    return in_bufs(c, p) || is_dev_ptr(p);
}

static void *scratch(cuda_ctx *c, int slot, size_t bytes)
{
    if (bytes <= c->scratch_cap[slot]) return c->scratch[slot];
    /* the stream may still read the old buffer: wait before freeing it */
    cudaStreamSynchronize(c->stream);
    cudaFree(c->scratch[slot]);
    c->shadow_bytes[slot] = 0;
    size_t cap = bytes < 4096 ? 4096 : bytes + bytes / 2;
    if (cudaMalloc(&c->scratch[slot], cap) != cudaSuccess) {
        cudaGetLastError();
        c->scratch[slot] = NULL;
        c->scratch_cap[slot] = 0;
        return NULL;
    }
    c->scratch_cap[slot] = cap;
    return c->scratch[slot];
}

/* p as a device pointer: itself, or bytes of host memory staged into scratch slot (NULL on failure) */
static const void *dev_in(cuda_ctx *c, const void *p, size_t bytes, int slot)
{
    if (!p || is_dev(c, p)) return p;
    if (bytes && bytes == c->shadow_bytes[slot] && !memcmp(c->shadow[slot], p, bytes)) return c->scratch[slot];
    void *d = scratch(c, slot, bytes);
    if (!d) return NULL;
    /* from pageable memory: returns once the source has been read, so the caller may reuse it */
    cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, c->stream);
    c->shadow_bytes[slot] = 0;
    if (bytes > c->shadow_cap[slot]) {
        void *sh = realloc(c->shadow[slot], bytes);
        if (!sh) return d; /* no shadow: the next call copies again */
        c->shadow[slot] = sh;
        c->shadow_cap[slot] = bytes;
    }
    memcpy(c->shadow[slot], p, bytes);
    c->shadow_bytes[slot] = bytes;
    return d;
}

static size_t wslot(const wentry *tab, size_t cap, const void *key)
{
    size_t h = (size_t)(((uintptr_t)key >> 5) * 0x9E3779B97F4A7C15ull);
    for (size_t i = h & (cap - 1);; i = (i + 1) & (cap - 1))
        if (tab[i].key == key || !tab[i].key) return i;
}

/* The device copy of an immutable host tensor of `bytes` at p (the pointer itself when it is device memory). */
static const void *weight_dev(cuda_ctx *c, const void *p, size_t bytes)
{
    if (!p) return p;
    /* a key in the table is host memory (uploaded before; with unified addressing no device pointer equals it), so
     * the common case, a weight used before, needs no question to the driver */
    int known = c->w_cap && c->w[wslot(c->w, c->w_cap, p)].key == p;
    if (!known && is_dev(c, p)) return p;
    uint8_t head[16];
    head_of(p, bytes, head);
    if (known) {
        wentry *e = &c->w[wslot(c->w, c->w_cap, p)];
        if (e->bytes >= bytes && !memcmp(e->head, head, 16)) return e->dev;
    }
    if (2 * (c->w_n + 1) > c->w_cap) {
        size_t cap = c->w_cap ? 2 * c->w_cap : 1024;
        wentry *tab = (wentry *)calloc(cap, sizeof *tab);
        if (!tab) return NULL;
        for (size_t i = 0; i < c->w_cap; i++)
            if (c->w[i].key) tab[wslot(tab, cap, c->w[i].key)] = c->w[i];
        free(c->w);
        c->w = tab;
        c->w_cap = cap;
    }
    wentry *e = &c->w[wslot(c->w, c->w_cap, p)];
    if (e->key) { /* same address, another tensor or more bytes wanted: replace */
        cudaStreamSynchronize(c->stream);
        cudaFree(e->dev);
        c->w_bytes -= e->bytes;
        c->w_n--;
    }
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 4) != cudaSuccess) {
        cudaGetLastError();
        e->key = NULL;
        return NULL;
    }
    /* on the backend's stream: a plain cudaMemcpy from pageable memory may return before its DMA lands, and the
     * non-blocking stream would not wait for it */
    if (cudaMemcpyAsync(d, p, bytes, cudaMemcpyHostToDevice, c->stream) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(d);
        e->key = NULL;
        return NULL;
    }
    e->key = p, e->bytes = bytes, e->dev = d;
    memcpy(e->head, head, 16);
    c->w_n++;
    c->w_bytes += bytes;
    return d;
}

static unsigned blocks_for(int64_t n, int per)
{
    return (unsigned)((n + per - 1) / per);
}

static void cu_destroy(bt_backend *be)
{
    cuda_ctx *c = CX(be);
    cudaStreamSynchronize(c->stream);
    for (size_t i = 0; i < c->w_cap; i++)
        if (c->w[i].key) cudaFree(c->w[i].dev);
    free(c->w);
    for (int i = 0; i < S_COUNT; i++) {
        cudaFree(c->scratch[i]);
        free(c->shadow[i]);
    }
    free(c->h_ints);
    free(c->bufs);
    cudaStreamDestroy(c->stream);
    free(c);
    free(be);
}

static void *cu_buf_alloc(bt_backend *be, size_t bytes)
{
    cuda_ctx *c = CX(be);
    if (c->n_bufs == c->bufs_cap) {
        size_t cap = c->bufs_cap ? 2 * c->bufs_cap : 64;
        struct buf_range *r = (struct buf_range *)realloc(c->bufs, cap * sizeof *r);
        if (!r) return NULL;
        c->bufs = r;
        c->bufs_cap = cap;
    }
    void *p = NULL;
    if (!bytes) bytes = 256;
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    size_t i = c->n_bufs;
    while (i > 0 && c->bufs[i - 1].start > (uintptr_t)p) {
        c->bufs[i] = c->bufs[i - 1];
        i--;
    }
    c->bufs[i].start = (uintptr_t)p, c->bufs[i].end = (uintptr_t)p + bytes;
    c->n_bufs++;
    return p;
}

static void cu_buf_free(bt_backend *be, void *buf)
{
    cuda_ctx *c = CX(be);
    if (!buf) return;
    for (size_t i = 0; i < c->n_bufs; i++)
        if (c->bufs[i].start == (uintptr_t)buf) {
            memmove(&c->bufs[i], &c->bufs[i + 1], (c->n_bufs - i - 1) * sizeof *c->bufs);
            c->n_bufs--;
            break;
        }
    cudaStreamSynchronize(c->stream);
    cudaFree(buf);
}

static void cu_buf_set(bt_backend *be, void *dst, const void *src, size_t bytes)
{
    cuda_ctx *c = CX(be);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) keep_err(c, BT_ERR_INTERNAL, "buf_set", e);
}

static void cu_buf_get(bt_backend *be, void *dst, const void *src, size_t bytes)
{
    cuda_ctx *c = CX(be);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) keep_err(c, BT_ERR_INTERNAL, "buf_get", e);
}

static void cu_buf_copy(bt_backend *be, void *dst, const void *src, size_t bytes)
{
    cuda_ctx *c = CX(be);
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream);
    if (e != cudaSuccess) keep_err(c, BT_ERR_INTERNAL, "buf_copy", e);
}

#define TYPE_SWITCH(t, F, ...)                                    \
    switch (t) {                                                  \
    case T_F32: F<T_F32> __VA_ARGS__; break;                      \
    case T_F16: F<T_F16> __VA_ARGS__; break;                      \
    case T_BF16: F<T_BF16> __VA_ARGS__; break;                    \
    case T_Q4_0: F<T_Q4_0> __VA_ARGS__; break;                    \
    case T_Q4_1: F<T_Q4_1> __VA_ARGS__; break;                    \
    case T_Q5_0: F<T_Q5_0> __VA_ARGS__; break;                    \
    case T_Q5_1: F<T_Q5_1> __VA_ARGS__; break;                    \
    case T_Q8_0: F<T_Q8_0> __VA_ARGS__; break;                    \
    case T_Q4_K: F<T_Q4_K> __VA_ARGS__; break;                    \
    case T_Q6_K: F<T_Q6_K> __VA_ARGS__; break;                    \
    default: break;                                               \
    }

static int type_ok(uint32_t t, int64_t n_in)
{
    int e, b;
    type_geom(t, &e, &b);
    return e && n_in % 32 == 0 && n_in % e == 0;
}

static void cu_embed(bt_backend *be, const bt_weight *w, const int32_t *tokens, int32_t n, float *out)
{
    cuda_ctx *c = CX(be);
    if (!type_ok(w->type, w->n_in)) {
        keep_err(c, BT_ERR_UNSUPPORTED, "embed: weight type not supported", cudaSuccess);
        return;
    }
    size_t rb = row_bytes(w->type, w->n_in);
    const uint8_t *wd = (const uint8_t *)weight_dev(c, w->data, rb * (size_t)w->n_out);
    const int32_t *tk = (const int32_t *)dev_in(c, tokens, (size_t)n * 4, S_I0);
    if (!wd || !tk) {
        keep_err(c, BT_ERR_NOMEM, "embed: out of device memory", cudaSuccess);
        return;
    }
    int64_t total = (int64_t)n * (w->n_in / 32);
    TYPE_SWITCH(w->type, k_embed, <<<blocks_for(total, 128), 128, 0, c->stream>>>(wd, rb, tk, n, w->n_in, out));
}

static void cu_rmsnorm(bt_backend *be, const float *x, const float *w, int32_t n_rows, int32_t n, float eps,
                       float *out)
{
    cuda_ctx *c = CX(be);
    const float *wd = (const float *)weight_dev(c, w, (size_t)n * 4);
    if (!wd) {
        keep_err(c, BT_ERR_NOMEM, "rmsnorm: out of device memory", cudaSuccess);
        return;
    }
    if (n_rows > 0) k_rmsnorm<<<n_rows, 256, 0, c->stream>>>(x, wd, n, eps, out);
}

/* out, or the slices' partials in part ([slices][M][N]) then their ordered sum into out */
template <int T>
static void launch_matmul(cuda_ctx *c, const uint8_t *w, size_t rb, const float *bias, const float *x, float *xs,
                          int32_t M, int64_t N, int64_t K, float *part, float *out)
{
    k_row_scale<<<M, 256, 0, c->stream>>>(x, K, xs);
    unsigned slices = blocks_for(K, MM_KSPLIT);
    float *dst = slices > 1 ? part : out;
    /* 16-row tiles up to 16 rows: the same per-element arithmetic as the 64-row tiles (see k_matmul) */
    if (M <= 16)
        k_matmul<T, 16><<<dim3(blocks_for(N, MM_BN), 1, slices), MM_THREADS, 0, c->stream>>>(w, rb, bias, x, xs, M, N,
                                                                                             K, dst);
    else
        k_matmul<T, 64><<<dim3(blocks_for(N, MM_BN), blocks_for(M, 64), slices), MM_THREADS, 0, c->stream>>>(
            w, rb, bias, x, xs, M, N, K, dst);
    if (slices > 1)
        k_matmul_reduce<<<blocks_for((int64_t)M * N, 256), 256, 0, c->stream>>>(part, (int)slices, bias, (int64_t)M * N,
                                                                                 N, out);
}

static bt_status cu_matmul(bt_backend *be, const bt_weight *w, const float *bias, const float *x, int32_t n_rows,
                           float *out)
{
    cuda_ctx *c = CX(be);
    bt_status st = take_err(c);
    if (st) return st;
    if (!type_ok(w->type, w->n_in))
        return cfail(c, BT_ERR_UNSUPPORTED, "cuda matmul: weight type %u with rows of %lld not supported", w->type,
                     (long long)w->n_in);
    if (n_rows <= 0) return BT_OK;
    if (n_rows > 65535 * 64) return cfail(c, BT_ERR_INVALID, "cuda matmul: %d rows", n_rows);
    size_t rb = row_bytes(w->type, w->n_in);
    size_t xb = (size_t)n_rows * (size_t)w->n_in * 4, ob = (size_t)n_rows * (size_t)w->n_out * 4;
    const uint8_t *wd = (const uint8_t *)weight_dev(c, w->data, rb * (size_t)w->n_out);
    const float *bd = (const float *)weight_dev(c, bias, (size_t)w->n_out * 4);
    const float *xd = (const float *)dev_in(c, x, xb, S_X);
    int out_host = !is_dev(c, out);
    float *od = out_host ? (float *)scratch(c, S_OUT, ob) : out;
    size_t slices = (size_t)blocks_for(w->n_in, MM_KSPLIT);
    float *part = slices > 1 ? (float *)scratch(c, S_PART, slices * ob) : NULL;
    float *xs = (float *)scratch(c, S_SCALE, (size_t)n_rows * 4);
    if (!wd || (bias && !bd) || !xd || !od || (slices > 1 && !part) || !xs)
        return cfail(c, BT_ERR_NOMEM, "cuda matmul: out of device memory");
    TYPE_SWITCH(w->type, launch_matmul, (c, wd, rb, bd, xd, xs, n_rows, w->n_out, w->n_in, part, od));
    if (out_host) {
        cudaError_t e = cudaMemcpyAsync(out, od, ob, cudaMemcpyDeviceToHost, c->stream);
        if (e == cudaSuccess) e = cudaStreamSynchronize(c->stream);
        if (e != cudaSuccess) return cfail(c, BT_ERR_INTERNAL, "cuda matmul: %s", cudaGetErrorString(e));
    }
    return take_err(c);
}

static void cu_rope(bt_backend *be, float *x, const int32_t *pos, int32_t n_tokens, int32_t n_heads,
                    int32_t head_dim, int32_t n_rot, float base, float freq_scale, int neox)
{
    cuda_ctx *c = CX(be);
    const int32_t *pd = (const int32_t *)dev_in(c, pos, (size_t)n_tokens * 4, S_I1);
    if (!pd) {
        keep_err(c, BT_ERR_NOMEM, "rope: out of device memory", cudaSuccess);
        return;
    }
    int64_t n = (int64_t)n_tokens * n_heads * (n_rot / 2);
    if (n > 0)
        k_rope<<<blocks_for(n, 128), 128, 0, c->stream>>>(x, pd, n_tokens, n_heads, head_dim, n_rot, base, freq_scale,
                                                            neox);
}

static void cu_kv_write(bt_backend *be, bt_kv_pool *kv, int32_t layer, const float *k, const float *v,
                        int32_t n_tokens, const int32_t *slots)
{
    cuda_ctx *c = CX(be);
    if (!is_dev(c, kv->base)) {
        keep_err(c, BT_ERR_UNSUPPORTED, "kv_write: the KV pool is not in device memory", cudaSuccess);
        return;
    }
    const int32_t *sd = (const int32_t *)dev_in(c, slots, (size_t)n_tokens * 4, S_I2);
    if (!sd) {
        keep_err(c, BT_ERR_NOMEM, "kv_write: out of device memory", cudaSuccess);
        return;
    }
    if (n_tokens <= 0) return;
    int th = kv->dtype == BT_KV_INT8 ? 32 : (kv->head_dim < 256 ? kv->head_dim : 256);
    k_kv_write<<<dim3(n_tokens, kv->n_head_kv), th, 0, c->stream>>>(kv_of(kv), layer, k, v, sd);
}

static bt_status cu_attention(bt_backend *be, const bt_attn_args *a)
{
    cuda_ctx *c = CX(be);
    bt_status st = take_err(c);
    if (st) return st;
    if (a->n_tokens <= 0) return BT_OK;
    if (a->head_dim > 32 * ATTN_MAX_PER_LANE)
        return cfail(c, BT_ERR_UNSUPPORTED, "cuda attention: head_dim %d > %d", a->head_dim, 32 * ATTN_MAX_PER_LANE);
    if (!is_dev(c, a->kv->base))
        return cfail(c, BT_ERR_UNSUPPORTED, "cuda attention: the KV pool is not in device memory");
    /* host staging: positions, then each run of tokens sharing a block table gets one copy of its used entries */
    int32_t T = a->n_tokens, max_pos = 0;
    size_t need = 2 * (size_t)T;
    for (int32_t t = 0; t < T; t++) {
        if (a->pos[t] > max_pos) max_pos = a->pos[t];
        need += (size_t)(a->pos[t] / 16 + 1);
    }
    if (need > c->h_ints_cap) {
        int32_t *p = (int32_t *)realloc(c->h_ints, need * 4);
        if (!p) return cfail(c, BT_ERR_NOMEM, "cuda attention: out of memory for block tables");
        c->h_ints = p;
        c->h_ints_cap = need;
    }
    int32_t *hp = c->h_ints, *hoff = hp + T, *htab = hp + 2 * T;
    memcpy(hp, a->pos, (size_t)T * 4);
    int32_t used = 0;
    for (int32_t t = 0; t < T;) {
        int32_t r = t, mp = a->pos[t];
        while (t + 1 < T && a->tables[t + 1] == a->tables[r]) {
            t++;
            if (a->pos[t] > mp) mp = a->pos[t];
        }
        int32_t nb = mp / 16 + 1;
        memcpy(htab + used, a->tables[r], (size_t)nb * 4);
        for (int32_t i = r; i <= t; i++) hoff[i] = used;
        used += nb;
        t++;
    }
    const int32_t *dints = (const int32_t *)dev_in(c, hp, (2 * (size_t)T + (size_t)used) * 4, S_AI);
    int32_t n_seg = max_pos / ATTN_SEG + 1;
    size_t parts_bytes = (size_t)T * (size_t)a->n_head * (size_t)n_seg * (size_t)(a->head_dim + 2) * 4;
    float *parts = (float *)scratch(c, S_ATTN, parts_bytes);
    if (!dints || !parts) return cfail(c, BT_ERR_NOMEM, "cuda attention: out of device memory for its scratch");
    attn_dev_args d;
    d.g = kv_of(a->kv);
    d.layer = a->layer, d.n_tokens = T, d.n_head = a->n_head, d.n_head_kv = a->n_head_kv, d.head_dim = a->head_dim;
    d.window = a->window, d.n_seg = n_seg, d.scale = a->scale, d.q = a->q, d.pos = dints, d.table_off = dints + T;
    d.tables = dints + 2 * T, d.parts = parts;
    /* segments past a token's own position (or before its window) write empty parts (l = 0) that the merge skips */
    k_attn<<<dim3(T, a->n_head, n_seg), ATTN_WARPS * 32, 0, c->stream>>>(d);
    k_attn_merge<<<dim3(T, a->n_head), 32, 0, c->stream>>>(d, a->out);
    return take_err(c);
}

static void cu_swiglu(bt_backend *be, const float *g, const float *u, int64_t n, float *out)
{
    if (n > 0) k_swiglu<<<blocks_for(n, 256), 256, 0, CX(be)->stream>>>(g, u, n, out);
}

static void cu_geglu(bt_backend *be, const float *g, const float *u, int64_t n, float *out)
{
    if (n > 0) k_geglu<<<blocks_for(n, 256), 256, 0, CX(be)->stream>>>(g, u, n, out);
}

static void cu_add(bt_backend *be, float *x, const float *y, int64_t n)
{
    if (n > 0) k_add<<<blocks_for(n, 256), 256, 0, CX(be)->stream>>>(x, y, n);
}

static void cu_scale(bt_backend *be, float *x, float s, int64_t n)
{
    if (n > 0) k_scale<<<blocks_for(n, 256), 256, 0, CX(be)->stream>>>(x, s, n);
}

static bt_backend_ops make_ops(void)
{
    bt_backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.device_memory = 1;
    o.destroy = cu_destroy;
    o.buf_alloc = cu_buf_alloc;
    o.buf_free = cu_buf_free;
    o.buf_set = cu_buf_set;
    o.buf_get = cu_buf_get;
    o.buf_copy = cu_buf_copy;
    o.embed = cu_embed;
    o.rmsnorm = cu_rmsnorm;
    o.matmul = cu_matmul;
    o.matmul_multi = NULL; /* the forward pass calls matmul per weight */
    o.rope = cu_rope;
    o.kv_write = cu_kv_write;
    o.attention = cu_attention;
    o.swiglu = cu_swiglu;
    o.geglu = cu_geglu;
    o.add = cu_add;
    o.scale = cu_scale;
    o.max_lanes = NULL;
    o.run_lanes = NULL;
    return o;
}

static const bt_backend_ops cuda_ops = make_ops();

/* ---- the tensor-core rate this matmul's instructions can reach: WMMA 16x16x16 f16 -> f32 from registers ---- */

__global__ void __launch_bounds__(256) k_mma_peak(int iters, float *sink)
{
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4];
    wmma::fill_fragment(fa, __float2half(0.001f * (threadIdx.x % 7)));
    wmma::fill_fragment(fb, __float2half(0.002f));
    for (int f = 0; f < 4; f++) wmma::fill_fragment(acc[f], 0.0f);
    for (int i = 0; i < iters; i++)
        for (int f = 0; f < 4; f++) wmma::mma_sync(acc[f], fa, fb, acc[f]); /* 4 chains hide the mma latency */
    float s = 0;
    for (int f = 0; f < 4; f++)
        for (int e = 0; e < acc[f].num_elements; e++) s += acc[f].x[e];
    if (s == 12345.0f) sink[0] = s; /* keeps the loop */
}

extern "C" __attribute__((visibility("default"))) bt_status bt_cuda_plugin_mma_tflops(bt_backend *be, double *out)
{
    cuda_ctx *c = CX(be);
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c->device);
    float *sink = (float *)scratch(c, S_OUT, 4);
    cudaEvent_t e0, e1;
    if (!sink || cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess)
        return cfail(c, BT_ERR_INTERNAL, "cuda: cannot time the mma rate");
    const int iters = 1024, blocks = sms * 8; /* about 6e14 FLOP: ~1 s at the expected rate */
    k_mma_peak<<<blocks, 256, 0, c->stream>>>(16, sink); /* warm-up */
    cudaEventRecord(e0, c->stream);
    k_mma_peak<<<blocks, 256, 0, c->stream>>>(iters, sink);
    cudaEventRecord(e1, c->stream);
    cudaError_t e = cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (e != cudaSuccess || ms <= 0) return cfail(c, BT_ERR_INTERNAL, "cuda: mma rate: %s", cudaGetErrorString(e));
    double flops = 2.0 * 16 * 16 * 16 * 4 * (double)iters * 8 /* warps */ * blocks;
    *out = flops / (ms * 1e-3) / 1e12;
    return BT_OK;
}

extern "C" __attribute__((visibility("default"))) bt_status bt_cuda_plugin_create(const bt_cuda_host *host, int device,
                                                                                  bt_backend **out)
{
    if (!host || host->abi != BT_CUDA_PLUGIN_ABI || host->backend_ops_size != sizeof(bt_backend_ops))
        return host ? host->fail(BT_ERR_INVALID, "libbaton_cuda.so was built for another version of baton")
                    : BT_ERR_INVALID;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        cudaGetLastError();
        if (e == cudaErrorInsufficientDriver)
            return host->fail(BT_ERR_UNAVAILABLE, "cuda: no usable GPU: no NVIDIA driver, or one older than this "
                              "build's CUDA %d.%d runtime needs", CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        return host->fail(BT_ERR_UNAVAILABLE, "cuda: no usable GPU (%s)",
                          e != cudaSuccess ? cudaGetErrorString(e) : "no device");
    }
    if (device < 0 || device >= n)
        return host->fail(BT_ERR_UNAVAILABLE, "cuda: device %d does not exist (%d found)", device, n);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return host->fail(BT_ERR_UNAVAILABLE, "cuda: cannot use device %d: %s", device, cudaGetErrorString(e));
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major < 8)
        return host->fail(BT_ERR_UNSUPPORTED, "cuda: device %d (%s) is sm_%d%d; this build needs sm_80 or newer",
                          device, prop.name, prop.major, prop.minor);
    bt_backend *be = (bt_backend *)calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return host->fail(BT_ERR_NOMEM, "out of memory creating the cuda backend");
    }
    c->host = *host;
    c->device = device;
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        free(be);
        free(c);
        return host->fail(BT_ERR_UNAVAILABLE, "cuda: cannot create a stream: %s", cudaGetErrorString(e));
    }
    be->ops = &cuda_ops;
    be->ctx = c;
    *out = be;
    return BT_OK;
}
