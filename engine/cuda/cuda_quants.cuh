/* GGUF block formats and their dequantization in 32-element chunks, for the cuda kernels (engine/cuda/backend_cuda.cu)
 * and, compiled for the host, for tests/unit/engine/test_cuda_quants.cu, which checks every type bit for bit against
 * the CPU scalar reference (engine/cpu/cpu_quants.c) on a machine without a GPU. */
#ifndef BATON_ENGINE_CUDA_QUANTS_CUH
#define BATON_ENGINE_CUDA_QUANTS_CUH

#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- GGUF block formats (engine/cpu/cpu_quants.h has the same layouts and the scalar references) ---- */

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q6_K = 14, T_BF16 = 30,
};

struct blk_q4_0 { uint16_t d; uint8_t qs[16]; };
struct blk_q4_1 { uint16_t d, m; uint8_t qs[16]; };
struct blk_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct blk_q5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct blk_q8_0 { uint16_t d; int8_t qs[32]; };
struct blk_q4_k { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct blk_q6_k { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

/* elements per block and bytes per block; 0 for a type this backend does not run */
static inline void type_geom(uint32_t t, int *elems, int *bytes)
{
    *elems = 0, *bytes = 0;
    switch (t) {
    case T_F32: *elems = 1, *bytes = 4; break;
    case T_F16: case T_BF16: *elems = 1, *bytes = 2; break;
    case T_Q4_0: *elems = 32, *bytes = 18; break;
    case T_Q4_1: *elems = 32, *bytes = 20; break;
    case T_Q5_0: *elems = 32, *bytes = 22; break;
    case T_Q5_1: *elems = 32, *bytes = 24; break;
    case T_Q8_0: *elems = 32, *bytes = 34; break;
    case T_Q4_K: *elems = 256, *bytes = 144; break;
    case T_Q6_K: *elems = 256, *bytes = 210; break;
    default: break;
    }
}

static inline size_t row_bytes(uint32_t t, int64_t n)
{
    int e, b;
    type_geom(t, &e, &b);
    if (!e || n % e) return 0;
    return (size_t)(n / e) * (size_t)b;
}

__host__ __device__ __forceinline__ float h2f(uint16_t h)
{
    return __half2float(__ushort_as_half(h));
}

__host__ __device__ __forceinline__ float bf2f(uint16_t h)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float((uint32_t)h << 16);
#else
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

__host__ __device__ __forceinline__ uint32_t ld_u16x2(const uint8_t *p) /* 4 bytes at a 2-byte aligned address */
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Dequantizes chunk c (elements 32c .. 32c+31) of a weight row of type T into y[32]. Every type is walked in these
 * 32-element chunks: one legacy block, or one sub-block of 32 of a K-quant super-block. */
template <int T>
__host__ __device__ __forceinline__ void deq_chunk(const uint8_t *row, int64_t c, float *y)
{
    if (T == T_F32) {
        const float *p = (const float *)row + 32 * c;
        for (int j = 0; j < 32; j++) y[j] = p[j];
    } else if (T == T_F16) {
        const uint16_t *p = (const uint16_t *)row + 32 * c;
        for (int j = 0; j < 32; j++) y[j] = h2f(p[j]);
    } else if (T == T_BF16) {
        const uint16_t *p = (const uint16_t *)row + 32 * c;
        for (int j = 0; j < 32; j++) y[j] = bf2f(p[j]);
    } else if (T == T_Q4_0) {
        const blk_q4_0 *b = (const blk_q4_0 *)row + c;
        float d = h2f(b->d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b->qs[j] & 0x0f) - 8);
            y[j + 16] = d * (float)((b->qs[j] >> 4) - 8);
        }
    } else if (T == T_Q4_1) {
        const blk_q4_1 *b = (const blk_q4_1 *)row + c;
        float d = h2f(b->d), m = h2f(b->m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b->qs[j] & 0x0f) + m;
            y[j + 16] = d * (float)(b->qs[j] >> 4) + m;
        }
    } else if (T == T_Q5_0 || T == T_Q5_1) {
        float d, m = 0;
        const uint8_t *qs, *qhp;
        if (T == T_Q5_0) {
            const blk_q5_0 *b = (const blk_q5_0 *)row + c;
            d = h2f(b->d), qs = b->qs, qhp = b->qh;
        } else {
            const blk_q5_1 *b = (const blk_q5_1 *)row + c;
            d = h2f(b->d), m = h2f(b->m), qs = b->qs, qhp = b->qh;
        }
        uint32_t qh = ld_u16x2(qhp);
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
            int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            if (T == T_Q5_0) {
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
            } else {
                y[j] = d * (float)lo + m;
                y[j + 16] = d * (float)hi + m;
            }
        }
    } else if (T == T_Q8_0) {
        const blk_q8_0 *b = (const blk_q8_0 *)row + c;
        float d = h2f(b->d);
        for (int j = 0; j < 32; j++) y[j] = (float)b->qs[j] * d;
    } else if (T == T_Q4_K) {
        const blk_q4_k *b = (const blk_q4_k *)row + c / 8;
        int j = (int)(c % 8);
        uint8_t sc, m;
        if (j < 4) {
            sc = b->scales[j] & 63;
            m = b->scales[j + 4] & 63;
        } else {
            sc = (uint8_t)((b->scales[j + 4] & 0x0f) | ((b->scales[j - 4] >> 2) & 0x30));
            m = (uint8_t)((b->scales[j + 4] >> 4) | ((b->scales[j] >> 2) & 0x30));
        }
        float dl = h2f(b->d) * (float)sc, ml = h2f(b->dmin) * (float)m;
        const uint8_t *q = b->qs + 32 * (j / 2);
        int shift = 4 * (j & 1);
        for (int l = 0; l < 32; l++) y[l] = dl * (float)((q[l] >> shift) & 0x0f) - ml;
    } else if (T == T_Q6_K) {
        const blk_q6_k *b = (const blk_q6_k *)row + c / 8;
        int e0 = (int)(c % 8) * 32, h = e0 / 128, s = (e0 % 128) / 32;
        float d = h2f(b->d);
        const uint8_t *ql = b->ql + 64 * h + 32 * (s & 1), *qh = b->qh + 32 * h;
        for (int l = 0; l < 32; l++) {
            int lo = (ql[l] >> (4 * (s >> 1))) & 0x0f, hi = (qh[l] >> (2 * s)) & 3;
            y[l] = d * (float)b->scales[(e0 + l) / 16] * (float)((lo | hi << 4) - 32);
        }
    }
}

/* Bytes per block and elements per block of a quantized type T, at compile time (0 for the float types). */
template <int T>
__host__ __device__ constexpr int blk_bytes()
{
    return T == T_Q4_0 ? 18 : T == T_Q4_1 ? 20 : T == T_Q5_0 ? 22 : T == T_Q5_1 ? 24 : T == T_Q8_0 ? 34
         : T == T_Q4_K ? 144 : T == T_Q6_K ? 210 : 0;
}

template <int T>
__host__ __device__ constexpr int blk_elems()
{
    return T == T_Q4_K || T == T_Q6_K ? 256 : 32;
}

/* Most bytes tile_span returns (a Q6_K super-block), rounded up to a multiple of 4: the row stride of a staged tile. */
#define TILE_SPAN_MAX 212

/* The bytes of one weight row that the K tile [k0, min(k0 + 128, ke)) of quantized type T reads (k0 a multiple of
 * 128, ke of 32): *len bytes from byte *off of the row, starting at chunk *c0, so that deq_chunk<T>(copy, c - *c0)
 * on a copy of them equals deq_chunk<T>(row, c). Whole blocks: 1 to 4 legacy blocks, or the one K-quant super-block
 * that holds the tile. *off and *len are even, and multiples of 4 for a whole tile of any type but Q6_K (the kernel
 * copies words when they are, halves otherwise). */
template <int T>
__host__ __device__ inline void tile_span(int64_t k0, int64_t ke, size_t *off, int *len, int64_t *c0)
{
    const int64_t end = k0 + 128 < ke ? k0 + 128 : ke;
    const int64_t b0 = k0 / blk_elems<T>(), b1 = (end + blk_elems<T>() - 1) / blk_elems<T>();
    *off = (size_t)b0 * (size_t)blk_bytes<T>();
    *len = (int)(b1 - b0) * blk_bytes<T>();
    *c0 = b0 * (blk_elems<T>() / 32);
}

/* Bytes of the tile of one whole K step (128 elements) of type T: four legacy blocks, or the K-quant super-block
 * that holds it (what tile_span returns for a step that ends before the row does). */
template <int T>
__host__ __device__ constexpr int full_span()
{
    return blk_elems<T>() == 32 ? 4 * blk_bytes<T>() : blk_bytes<T>();
}

/* Thread tid's share (of NT threads) of copying units of type U, upr per row, of `rows` rows at stride rb from base
 * into raw, row r at raw + r * TILE_SPAN_MAX; consecutive threads copy consecutive units (the global reads
 * coalesce). UPR > 0 makes the count a compile-time constant: an index's row and offset are then a multiply-high and
 * a shift instead of a run-time division (about 20 instructions, which bounded the matmul's decode rate on the GPU:
 * it is issue-bound). */
template <typename U, int UPR, int NT>
__host__ __device__ inline void copy_units(unsigned char *raw, const uint8_t *base, size_t rb, int rows, int upr,
                                           int tid)
{
    const int n = UPR > 0 ? UPR : upr;
    for (int e = tid; e < rows * n; e += NT) {
        int r = e / n, o = e - r * n;
        ((U *)(raw + r * TILE_SPAN_MAX))[o] = ((const U *)(base + (size_t)r * rb))[o];
    }
}

/* Thread tid's share of copying the tile bytes [off, off + len) of weight rows n0 .. n0 + rows - 1 (rows <= BN)
 * into raw: words, or halves where the bytes are only 2-byte aligned; a whole tile of BN rows, the common case, with
 * the units per row known at compile time. Every path copies the same bytes (test_cuda_quants). */
template <int T, int BN, int NT>
__host__ __device__ inline void stage_tile(unsigned char *raw, const uint8_t *w, size_t rb, int64_t n0, int rows,
                                           size_t off, int len, int tid)
{
    constexpr int FULL = full_span<T>();
    const uint8_t *base = w + (size_t)n0 * rb + off;
    const bool words = ((uintptr_t)w | rb | off | (size_t)len) % 4 == 0, whole = len == FULL && rows == BN;
    if (whole && words)
        copy_units<uint32_t, FULL / 4, NT>(raw, base, rb, BN, 0, tid);
    else if (whole)
        copy_units<uint16_t, FULL / 2, NT>(raw, base, rb, BN, 0, tid);
    else if (words)
        copy_units<uint32_t, 0, NT>(raw, base, rb, rows, len / 4, tid);
    else
        copy_units<uint16_t, 0, NT>(raw, base, rb, rows, len / 2, tid);
}

#endif
