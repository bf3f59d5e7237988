/* Internal to engine/cpu: where things are in a packed group (layouts in cpu_gemm.c) and in the activation rows the
 * tiled GEMM kernels read, written once for every ISA's kernels (cpu_avx2_gemm.c, cpu_avx512_gemm.c). Plain C: the
 * ISA files include it after <immintrin.h> and their own flags; everything inlines. */
#ifndef BATON_ENGINE_CPU_GEMM_LAYOUT_H
#define BATON_ENGINE_CPU_GEMM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/cpu/cpu_kernels.h"

#define BT_GL_AI static inline __attribute__((always_inline))

/* Activation block b of row r: 8-bit or 16-bit per-32 blocks (legacy weight types, and the K-quants' slices). */
#define BT_GL_ACT8(act, stride, r, b) ((const bt_block_q8_32 *)((const char *)(act) + (size_t)(r) * (stride)) + (b))
#define BT_GL_ACT16(act, stride, r, b) ((const bt_block_q16_32 *)((const char *)(act) + (size_t)(r) * (stride)) + (b))

/* Layouts with a min (Q4_1, Q5_1): one block per unit, fp16 d then fp16 m. */
BT_GL_AI int bt_gl_fp16_min(const int type)
{
    return type == BT_TYPE_Q4_1 || type == BT_TYPE_Q5_1;
}

/* The helpers' bits16 is a layout width: 0 for 8-bit activations, 1 for 16-bit, BT_GL_PLANES for 16-bit in an ISA's
 * variant whose Q5_K carries a high-bit plane (bt_cpu_ops.gemm16_planes); other types read it as 1. */
#define BT_GL_PLANES 2

/* Layouts whose codes are bytes (Q8_0, Q6_K, Q5_1 with 8-bit activations and Q5_K without a plane: 512 code bytes per
 * block), not nibbles. bits16: the layout width (at 8 bits Q6_K's bytes are q, 0..63, at 16 q - 32). */
BT_GL_AI int bt_gl_byte_codes(const int type, const int bits16)
{
    return type == BT_TYPE_Q8_0 || type == BT_TYPE_Q6_K || (type == BT_TYPE_Q5_1 && !bits16) ||
           (type == BT_TYPE_Q5_K && bits16 != BT_GL_PLANES);
}

/* Layouts with a high-bit plane (Q5_0 and Q5_1 with 16-bit activations, Q5_K in the BT_GL_PLANES variant): a block's
 * codes are Q4_0's / Q4_1's 16-bit nibble vectors (256 bytes) followed by 64 bytes holding the fifth bit of each
 * code (cpu_gemm.c): bit i of 32-bit word t is the high bit of int16 lane i (row i / 2) of the block's operand vector
 * t, in the order the nibble kernels produce them (bt_gl_plane_elem); or, where the ISA's plane_nibbles is set
 * (AVX2), the same bits in nibble-vector order (cpu_gemm.c). */
BT_GL_AI int bt_gl_plane(const int type, const int bits16)
{
    return (bits16 && (type == BT_TYPE_Q5_0 || type == BT_TYPE_Q5_1)) ||
           (bits16 == BT_GL_PLANES && type == BT_TYPE_Q5_K);
}

/* The element (0..31) that int16 lane i of operand vector t (0..15) of a 16-bit nibble layout holds, for row i / 2:
 * operand 4k + u is the low nibbles (u = 0, 1) or high nibbles (u = 2, 3) of code vector k, the pairs (4k, 4k+1),
 * (4k+2, 4k+3), (16+4k, 17+4k), (18+4k, 19+4k). */
BT_GL_AI int bt_gl_plane_elem(const int t, const int i)
{
    return 16 * ((t & 3) >> 1) + 4 * (t >> 2) + 2 * (t & 1) + (i & 1);
}

/* Code bytes of one block: 256 (nibbles), 320 (nibbles and the high-bit plane) or 512 (bytes). */
BT_GL_AI size_t bt_gl_code_bytes(const int type, const int bits16)
{
    return bt_gl_byte_codes(type, bits16) ? 512 : bt_gl_plane(type, bits16) ? 320 : 256;
}

/* K-quant layouts (Q4_K, Q5_K, Q6_K): a super-unit per 256-element super-block (cpu_gemm.c), activations in the
 * K-quant format. */
BT_GL_AI int bt_gl_kquant(const int type)
{
    return type == BT_TYPE_Q4_K || type == BT_TYPE_Q5_K || type == BT_TYPE_Q6_K;
}

/* Bytes of a K-quant super-unit: [A: 16 fp32][B: 16 fp32], then four pair units of 64 scale bytes and two blocks of
 * cb code bytes. */
BT_GL_AI size_t bt_gl_kq_super_bytes(const size_t cb)
{
    return 128 + 4 * (64 + 2 * cb);
}

/* The super-unit of block b: A (16 fp32) then B (16 fp32) of its super-block. */
BT_GL_AI const float *bt_gl_kq_super(const uint8_t *group, int64_t b, const size_t cb)
{
    return (const float *)(group + (size_t)(b >> 3) * bt_gl_kq_super_bytes(cb));
}

/* Block b's pair unit: [s0, s1 of the even block][s0, s1 of the odd block] (16 bytes each) [codes][codes]. */
BT_GL_AI const uint8_t *bt_gl_kq_pair(const uint8_t *group, int64_t b, const size_t cb)
{
    return (const uint8_t *)bt_gl_kq_super(group, b, cb) + 128 + (size_t)((b & 7) >> 1) * (64 + 2 * cb);
}

/* Block b's 16 integer scales s0, then its 16 s1 (unsigned for Q4_K and Q5_K, signed for Q6_K). */
BT_GL_AI const uint8_t *bt_gl_kq_bytes(const uint8_t *group, int64_t b, const size_t cb)
{
    return bt_gl_kq_pair(group, b, cb) + 32 * (size_t)(b & 1);
}

/* Layouts whose blocks carry a min term (fp16 for Q4_1 and Q5_1, fp32 for Q4_K and Q5_K). */
BT_GL_AI int bt_gl_has_min(const int type)
{
    return bt_gl_fp16_min(type) || type == BT_TYPE_Q4_K || type == BT_TYPE_Q5_K;
}

/* Block b's unit (not the K-quants): Q4_1 and Q5_1 one block per unit (64 bytes of scales, then cb code bytes),
 * Q4_0, Q5_0 and Q8_0 two (64 bytes of scales, then two blocks of codes). cb: one block's code bytes
 * (bt_gl_code_bytes). */
BT_GL_AI const uint8_t *bt_gl_unit(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    return bt_gl_fp16_min(type) ? group + (size_t)b * (64 + cb) : group + (size_t)(b >> 1) * (64 + 2 * cb);
}

/* Block b's 16 fp16 d (then 16 fp16 m for Q4_1 and Q5_1); not the K-quants (bt_gl_kq_bytes). */
BT_GL_AI const uint16_t *bt_gl_scales(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    return (const uint16_t *)(bt_gl_unit(group, b, type, cb) + (bt_gl_fp16_min(type) ? 0 : 32 * (b & 1)));
}

/* Block b's code vectors. */
BT_GL_AI const uint8_t *bt_gl_codes(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    if (bt_gl_kquant(type)) return bt_gl_kq_pair(group, b, cb) + 64 + cb * (size_t)(b & 1);
    return bt_gl_unit(group, b, type, cb) + 64 + (bt_gl_fp16_min(type) ? 0 : cb * (size_t)(b & 1));
}

/* Bytes of the group per block, for prefetching a group block by block (a unit's or super-unit's bytes over its
 * blocks). */
BT_GL_AI int bt_gl_block_share(const int type, const int bits16)
{
    return type == BT_TYPE_Q4_K   ? 304
           : type == BT_TYPE_Q5_K ? (bits16 == BT_GL_PLANES ? 368 : 560)
           : type == BT_TYPE_Q6_K ? 560
           : type == BT_TYPE_Q4_1 ? 320
           : type == BT_TYPE_Q4_0 ? 288
           : type == BT_TYPE_Q5_0 ? 352
           : type == BT_TYPE_Q5_1 ? (bits16 ? 384 : 576)
                                  : 544;
}

/* Prefetches block b's share of the group at next (NULL: none): a group's bytes spread evenly over its blocks.
 * Into L2, not L1 (locality 2: prefetcht1 on x86, PLDL2KEEP on Arm). An L1 prefetch holds one of the core's few L1
 * miss buffers until memory answers, and at 2-8 activation rows those buffers, shared with the kernel's own loads,
 * bounded how much of the weight read could overlap the arithmetic. Measured on AMD Zen 4, the 211 matmuls of a
 * SmolLM2-135M decode step (weights on huge pages, 16-bit activations, medians of 7-9 alternated rounds): one thread,
 * thread CPU time, 2 rows 6.0-6.5 -> 4.7-4.8 ms, 4 rows 8.5-8.8 -> 6.4; two threads with PACKED_STREAM_ROWS 10 (wall
 * time, best of 6) 1 row 3.12 -> 2.86, 2 rows 3.79 -> 3.16, 4 rows 6.27 -> 4.50, 8 rows 9.77 -> 8.51; 16 rows the
 * same (17.6 ms); AVX2 kernels on the same host, 1 row 4.21 -> 3.61. Locality 1 measured the same as 2, 0 (NTA) as 3. */
BT_GL_AI void bt_gl_prefetch_block(const void *next, int64_t b, const int type, const int bits16)
{
    if (!next) return;
    const int per = bt_gl_block_share(type, bits16);
    const char *p = (const char *)next + (size_t)b * (size_t)per;
#pragma GCC unroll 9
    for (int i = 0; i < per; i += 64) __builtin_prefetch(p + i, 0, 2);
}

/* 8-bit activations of block b of row r. Per-32 blocks (bt_block_q8_32) and the K-quants' super-block slices
 * (bt_block_q8_256: 8 of those blocks sharing the super-block's d) share one layout, so any type's block b is the
 * row's b-th block. */
BT_GL_AI const int8_t *bt_gl_act8_qs(const void *act, size_t stride, int r, int64_t b)
{
    return BT_GL_ACT8(act, stride, r, b)->qs;
}

/* That block's d and d * sum. */
BT_GL_AI void bt_gl_act8_scales(const void *act, size_t stride, int r, int64_t b, float *d, float *ds)
{
    *d = BT_GL_ACT8(act, stride, r, b)->d, *ds = BT_GL_ACT8(act, stride, r, b)->ds;
}

/* The sums of K-quant block b's two 16-element halves (Q6_K's offset of 32 per half). */
BT_GL_AI void bt_gl_act8_half_sums(const void *act, size_t stride, int r, int64_t b, int32_t *s0, int32_t *s1)
{
    const bt_block_q8_32 *a = BT_GL_ACT8(act, stride, r, b);
    *s0 = a->sum_lo, *s1 = a->sum - a->sum_lo;
}

/* 16-bit activations of block b of row r. Per-32 blocks (bt_block_q16_32) and the K-quants' super-block slices
 * (bt_block_q16_256: 8 of those blocks sharing the super-block's d) share one layout, so any type's block b is the
 * row's b-th block. */
BT_GL_AI const int16_t *bt_gl_act16_qs(const void *act, size_t stride, int r, int64_t b)
{
    return BT_GL_ACT16(act, stride, r, b)->qs;
}

/* That block's d and d * sum. */
BT_GL_AI void bt_gl_act16_scales(const void *act, size_t stride, int r, int64_t b, float *d, float *ds)
{
    *d = BT_GL_ACT16(act, stride, r, b)->d, *ds = BT_GL_ACT16(act, stride, r, b)->ds;
}

#endif
