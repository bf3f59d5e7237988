/* Tiled GEMM kernels over packed weights (layouts in cpu_gemm.c) for aarch64 NEON with the Armv8.6 int8 matrix
 * multiply (FEAT_I8MM: Graviton 3 and 4, Grace, Neoverse V1/V2/N2, Apple M2 and later). One smmla multiplies a
 * 2x8 matrix of int8 by the transpose of another 2x8 and adds the 2x2 int32 result: 32 multiply-accumulates, twice
 * what sdot does per instruction.
 *
 * Operands. For each block the 16 weight rows' codes are rearranged once into W[m][p]: rows 2p and 2p + 1 (p < 8),
 * eight elements each of octet m (m < 4), as 16 signed bytes. The packed dwords are already 4 elements of one row,
 * so two zips (32-bit, then for the 16-bit byte layouts 16-bit first) build every operand without a table. The
 * element order inside an octet follows the layout (the nibble 16-bit layout stores 4k, 4k+2, 4k+1, 4k+3); the
 * activations of a pair of rows are put in the same order, A[m] = [8 codes of row r0 | 8 codes of row r1], so
 * mmla(A[m], W[m][p]) = [a0.w2p, a0.w2p+1, a1.w2p, a1.w2p+1] summed over the octet.
 *
 *   8-bit activations (int8): one smmla per (octet, row pair).
 *   16-bit activations (|a| <= 32767): a = 256 * hi + lo with hi = a >> 8 (signed byte) and lo = a & 255 (unsigned
 *     byte), so dot(w, a) = 256 * smmla(hi, w) + usmmla(lo, w): two instructions for 32 multiply-accumulates, where
 *     smlal by lane (cpu_neon_gemm.c) does 4.
 *
 * Every integer sum is exact (|256 * hi part| < 32 * 128 * 128 * 256 = 2^27), so a block's isum equals the one
 * bt_cpu_gemm_packed_ref computes, and the float steps are the shared ones of cpu_neon_gemm.h: the same bits. */
#include <arm_neon.h>

#include "engine/cpu/cpu_impl.h"
#include "engine/cpu/cpu_neon_gemm.h"

/* ---- weight operands: W[m][p] = rows 2p, 2p + 1 of octet m ---- */

/* Two 64-byte vectors X, Y of 16 row dwords (X: 4 elements of every row, Y: the next 4) into the 8 row-pair
 * operands [row 2p: X dword, Y dword | row 2p + 1: X dword, Y dword], as raw bytes. */
AI void pair_dwords(const uint8_t *x, const uint8_t *y, uint8x16_t out[8])
{
    for (int i = 0; i < 4; i++) { /* rows 4i .. 4i + 3 */
        const uint32x4_t a = vreinterpretq_u32_u8(vld1q_u8(x + 16 * i)), b = vreinterpretq_u32_u8(vld1q_u8(y + 16 * i));
        out[2 * i] = vreinterpretq_u8_u32(vzip1q_u32(a, b));
        out[2 * i + 1] = vreinterpretq_u8_u32(vzip2q_u32(a, b));
    }
}

/* 16-bit byte layout (word j of 32-byte vector k = elements 2k, 2k + 1 of row j): vectors 4m .. 4m + 3 into octet
 * m's 8 row-pair operands, elements in order. */
AI void octet_words(const uint8_t *v, int8x16_t out[8])
{
    for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
        const uint16x8_t v0 = vreinterpretq_u16_u8(vld1q_u8(v + 16 * h)),
                         v1 = vreinterpretq_u16_u8(vld1q_u8(v + 32 + 16 * h)),
                         v2 = vreinterpretq_u16_u8(vld1q_u8(v + 64 + 16 * h)),
                         v3 = vreinterpretq_u16_u8(vld1q_u8(v + 96 + 16 * h));
        const uint32x4_t p1 = vreinterpretq_u32_u16(vzip1q_u16(v0, v1)), p2 = vreinterpretq_u32_u16(vzip2q_u16(v0, v1)),
                         q1 = vreinterpretq_u32_u16(vzip1q_u16(v2, v3)), q2 = vreinterpretq_u32_u16(vzip2q_u16(v2, v3));
        out[4 * h + 0] = vreinterpretq_s8_u32(vzip1q_u32(p1, q1));
        out[4 * h + 1] = vreinterpretq_s8_u32(vzip2q_u32(p1, q1));
        out[4 * h + 2] = vreinterpretq_s8_u32(vzip1q_u32(p2, q2));
        out[4 * h + 3] = vreinterpretq_s8_u32(vzip2q_u32(p2, q2));
    }
}

/* Adds the fifth bits of a high-bit plane layout (Q5_0, Q5_1; plane: the block's 64 plane bytes) to the nibble
 * operands: 16 into byte b of W[j][p] (j < 2, low nibbles) and of W[j + 2][p] (high nibbles) where set. Byte b holds
 * row 2p + b / 8's element of code vector 2j + (b % 8) / 4, byte b % 4 of its dword, so its bit is in plane byte
 * 32j + 16 ((b % 8) / 4) + 4 (b % 2) + p / 2 (8 more for the high nibble), bit 4 (p % 2) + 2 (b / 8) + (b % 4) / 2
 * (bt_gl_plane_elem: the word of operand 4k + (b % 2), + 2 for high nibbles, lane 2 row + (b % 4) / 2). */
AI void add_plane(const uint8_t *plane, int8x16_t w[4][8])
{
    static const uint8_t base[16] = {0, 4, 0, 4, 16, 20, 16, 20, 0, 4, 0, 4, 16, 20, 16, 20};
    static const uint8_t bit[16] = {1, 1, 2, 2, 1, 1, 2, 2, 4, 4, 8, 8, 4, 4, 8, 8};
    const uint8x16x4_t tab = {{vld1q_u8(plane), vld1q_u8(plane + 16), vld1q_u8(plane + 32), vld1q_u8(plane + 48)}};
    const uint8x16_t c16 = vdupq_n_u8(16), bits[2] = {vld1q_u8(bit), vshlq_n_u8(vld1q_u8(bit), 4)};
    for (int j = 0; j < 2; j++)
        for (int q = 0; q < 4; q++) {
            const uint8x16_t idx = vaddq_u8(vld1q_u8(base), vdupq_n_u8((uint8_t)(32 * j + q)));
            const uint8x16_t lo = vqtbl4q_u8(tab, idx), hi = vqtbl4q_u8(tab, vaddq_u8(idx, vdupq_n_u8(8)));
            for (int o = 0; o < 2; o++) { /* p = 2q + o */
                int8x16_t *wl = &w[j][2 * q + o], *wh = &w[j + 2][2 * q + o];
                *wl = vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(*wl), vandq_u8(vtstq_u8(lo, bits[o]), c16)));
                *wh = vreinterpretq_s8_u8(vorrq_u8(vreinterpretq_u8_s8(*wh), vandq_u8(vtstq_u8(hi, bits[o]), c16)));
            }
        }
}

/* Block b's operands W[m][p]; returns the integer offset per activation sum to take off (Q4_0: 8, Q5_0: 16). */
AI int weight_operands(const uint8_t *codes, const int type, const int bits16, int8x16_t w[4][8])
{
    if (bt_gl_byte_codes(type, bits16)) {
        if (bits16) { /* Q8_0, Q5_K, Q6_K: 16 vectors of 32 bytes */
            for (int m = 0; m < 4; m++) octet_words(codes + 128 * m, w[m]);
            return 0;
        }
        /* Q8_0 (codes + 128: flipped back to signed), Q5_1 and Q5_K (0..31) and Q6_K (q, 0..63: made q - 32): 8
         * vectors of 64 bytes, vector k = elements 4k .. 4k + 3 */
        const uint8x16_t flip = vdupq_n_u8(type == BT_TYPE_Q8_0 ? 0x80 : 0);
        const uint8x16_t sub = vdupq_n_u8(type == BT_TYPE_Q6_K ? 32 : 0);
        for (int m = 0; m < 4; m++) {
            uint8x16_t t[8];
            pair_dwords(codes + 128 * m, codes + 128 * m + 64, t);
            for (int p = 0; p < 8; p++) w[m][p] = vreinterpretq_s8_u8(vsubq_u8(veorq_u8(t[p], flip), sub));
        }
        return 0;
    }
    /* nibbles: 4 vectors of 64 bytes, vector k's low nibbles are elements 4k .. (the layout's order), high ones
     * 16 + the same; octets 0, 1 = low nibbles of vectors (0, 1), (2, 3); octets 2, 3 = their high nibbles */
    const uint8x16_t m4 = vdupq_n_u8(0x0f);
    for (int j = 0; j < 2; j++) {
        uint8x16_t t[8];
        pair_dwords(codes + 128 * j, codes + 128 * j + 64, t);
        for (int p = 0; p < 8; p++) {
            w[j][p] = vreinterpretq_s8_u8(vandq_u8(t[p], m4));
            w[j + 2][p] = vreinterpretq_s8_u8(vshrq_n_u8(t[p], 4));
        }
    }
    if (bt_gl_plane(type, bits16)) add_plane(codes + 256, w);
    return type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q5_0 ? 16 : 0;
}

/* ---- results: the 2x2 tiles of a row pair into each activation row's 4 vectors of 4 weight rows ---- */

AI void split_rows(const int32x4_t t[8], int32x4_t r0[4], int32x4_t r1[4])
{
    for (int i = 0; i < 4; i++) {
        const int64x2_t a = vreinterpretq_s64_s32(t[2 * i]), b = vreinterpretq_s64_s32(t[2 * i + 1]);
        r0[i] = vreinterpretq_s32_s64(vzip1q_s64(a, b));
        r1[i] = vreinterpretq_s32_s64(vzip2q_s64(a, b));
    }
}

/* A row pair's block ends into acc0 and, when both, acc1: t holds the 2x2 tiles of the block's integer dots (for
 * Q6_K of its second half, half0 those of its first); ad, ads: each row's activation d and d * sum. */
AI void pair_accumulate(const int32x4_t t[8], const int32x4_t half0[8], const int type, const float ad[2],
                        const float ads[2], const int both, const float32x4_t d[4], const float32x4_t m[4], int mins,
                        float32x4_t acc0[4], float32x4_t acc1[4])
{
    int32x4_t s0[4], s1[4];
    split_rows(t, s0, s1);
    if (type == BT_TYPE_Q6_K) {
        int32x4_t h0[4], h1[4];
        split_rows(half0, h0, h1);
        block_accumulate_q6k(acc0, h0, s0, d, m, ad[0]);
        if (both) block_accumulate_q6k(acc1, h1, s1, d, m, ad[1]);
        return;
    }
    block_accumulate(acc0, s0, d, m, ad[0], ads[0], mins);
    if (both) block_accumulate(acc1, s1, d, m, ad[1], ads[1], mins);
}

/* ---- one pair of activation rows (r0, r1; r1 == r0 for an odd last row) against block b's operands ---- */

/* 8-bit activations: one smmla per (octet, row pair); Q4_0's offset (codes q + 8) starts every sum; Q6_K's two
 * halves (octets 0, 1 and 2, 3) are summed apart. */
AI void pair8(const void *act, size_t act_stride, int r0, int r1, int64_t b, const int8x16_t w[4][8], int off,
              const float32x4_t d[4], const float32x4_t m[4], int mins, float32x4_t acc0[4], float32x4_t acc1[4],
              const int type)
{
    const int8_t *q0 = bt_gl_act8_qs(act, act_stride, r0, b), *q1 = bt_gl_act8_qs(act, act_stride, r1, b);
    int8x16_t a[4];
    for (int h = 0; h < 2; h++) {
        const int64x2_t x = vreinterpretq_s64_s8(vld1q_s8(q0 + 16 * h)), y = vreinterpretq_s64_s8(vld1q_s8(q1 + 16 * h));
        a[2 * h] = vreinterpretq_s8_s64(vzip1q_s64(x, y));
        a[2 * h + 1] = vreinterpretq_s8_s64(vzip2q_s64(x, y));
    }
    const int32_t o0 = off ? -off * BT_GL_ACT8(act, act_stride, r0, b)->sum : 0,
                  o1 = off ? -off * BT_GL_ACT8(act, act_stride, r1, b)->sum : 0;
    const int32x4_t init = {o0, o0, o1, o1};
    int32x4_t t[8], half0[8];
    for (int p = 0; p < 8; p++) t[p] = init;
    for (int mm = 0; mm < 4; mm++) {
        if (type == BT_TYPE_Q6_K && mm == 2)
            for (int p = 0; p < 8; p++) half0[p] = t[p], t[p] = vdupq_n_s32(0);
        for (int p = 0; p < 8; p++) t[p] = vmmlaq_s32(t[p], a[mm], w[mm][p]);
    }
    float ad[2], ads[2];
    bt_gl_act8_scales(act, act_stride, r0, b, &ad[0], &ads[0]);
    bt_gl_act8_scales(act, act_stride, r1, b, &ad[1], &ads[1]);
    pair_accumulate(t, half0, type, ad, ads, r1 != r0, d, m, mins, acc0, acc1);
}

/* Row r's 32 activations of block b as low bytes lo[0..1] and high bytes hi[0..1] (16 elements each), in the
 * element order of the weight operands. */
AI void split16(const int16_t *qs, const int nibble_order, uint8x16_t lo[2], uint8x16_t hi[2])
{
    static const uint8_t order[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int h = 0; h < 2; h++) {
        uint8x16x2_t v = vld2q_u8((const uint8_t *)(qs + 16 * h)); /* little endian: val[0] low bytes */
        if (nibble_order) {
            const uint8x16_t idx = vld1q_u8(order);
            v.val[0] = vqtbl1q_u8(v.val[0], idx);
            v.val[1] = vqtbl1q_u8(v.val[1], idx);
        }
        lo[h] = v.val[0];
        hi[h] = v.val[1];
    }
}

/* The octet operands [8 of row r0 | 8 of row r1] of two rows' 16-element halves x, y */
AI void pair_rows(uint8x16_t x, uint8x16_t y, uint8x16_t *first, uint8x16_t *second)
{
    const uint64x2_t a = vreinterpretq_u64_u8(x), b = vreinterpretq_u64_u8(y);
    *first = vreinterpretq_u8_u64(vzip1q_u64(a, b));
    *second = vreinterpretq_u8_u64(vzip2q_u64(a, b));
}

/* 16-bit activations: smmla on the high bytes, usmmla on the low ones, isum = 256 * high + low; Q6_K's two halves
 * are summed apart; Q4_0's offset comes off the exact sum. */
AI void pair16(const void *act, size_t act_stride, int r0, int r1, int64_t b, const int8x16_t w[4][8], int off,
               const float32x4_t d[4], const float32x4_t m[4], int mins, float32x4_t acc0[4], float32x4_t acc1[4],
               const int type)
{
    const int nibble_order = !bt_gl_byte_codes(type, 1);
    uint8x16_t lo0[2], lo1[2], hi0[2], hi1[2], alo[4], ahi[4];
    split16(bt_gl_act16_qs(act, act_stride, r0, b), nibble_order, lo0, hi0);
    split16(bt_gl_act16_qs(act, act_stride, r1, b), nibble_order, lo1, hi1);
    for (int h = 0; h < 2; h++) {
        pair_rows(lo0[h], lo1[h], &alo[2 * h], &alo[2 * h + 1]);
        pair_rows(hi0[h], hi1[h], &ahi[2 * h], &ahi[2 * h + 1]);
    }
    int32x4_t tl[8], th[8], half0[8];
    for (int p = 0; p < 8; p++) tl[p] = th[p] = vdupq_n_s32(0);
    for (int mm = 0; mm < 4; mm++) {
        if (type == BT_TYPE_Q6_K && mm == 2) /* Q6_K: elements 0..15 have their own d */
            for (int p = 0; p < 8; p++) {
                half0[p] = vaddq_s32(vshlq_n_s32(th[p], 8), tl[p]);
                tl[p] = th[p] = vdupq_n_s32(0);
            }
        for (int p = 0; p < 8; p++) {
            th[p] = vmmlaq_s32(th[p], vreinterpretq_s8_u8(ahi[mm]), w[mm][p]);
            tl[p] = vusmmlaq_s32(tl[p], alo[mm], w[mm][p]);
        }
    }
    int32x4_t t[8];
    for (int p = 0; p < 8; p++) t[p] = vaddq_s32(vshlq_n_s32(th[p], 8), tl[p]);
    if (off) { /* Q4_0: codes are q + 8, so 8 * sum(a) comes off (Q5_0: q, 16 * sum(a)) */
        const int32_t o0 = off * BT_GL_ACT16(act, act_stride, r0, b)->sum,
                      o1 = off * BT_GL_ACT16(act, act_stride, r1, b)->sum;
        const int32x4_t o = {o0, o0, o1, o1};
        for (int p = 0; p < 8; p++) t[p] = vsubq_s32(t[p], o);
    }
    float ad[2], ads[2];
    bt_gl_act16_scales(act, act_stride, r0, b, &ad[0], &ads[0]);
    bt_gl_act16_scales(act, act_stride, r1, b, &ad[1], &ads[1]);
    pair_accumulate(t, half0, type, ad, ads, r1 != r0, d, m, mins, acc0, acc1);
}

/* A 16-row group times nr activation rows: block by block, the weight operands once, then every pair of rows. */
AI void gemm(int64_t n, const void *group, const void *act, size_t act_stride, int nr, float *out, size_t out_stride,
             int n_valid, const void *next, const int type, const int bits16)
{
    const size_t cb = bt_gl_code_bytes(type, bits16);
    const int mins = bt_gl_has_min(type);
    const int64_t nb = n / BT_QK;
    float32x4_t acc[BT_CPU_GEMM_NR][4];
    acc_zero(acc, nr);
    for (int64_t b = 0; b < nb; b++) {
        bt_gl_prefetch_block(next, b, type, bits16);
        int8x16_t w[4][8];
        const int off = weight_operands(bt_gl_codes(group, b, type, cb), type, bits16, w);
        float32x4_t d[4], m[4];
        block_scales(group, b, type, cb, d, m);
        for (int r = 0; r < nr; r += 2) {
            const int r1 = r + 1 < nr ? r + 1 : r;
            if (bits16) pair16(act, act_stride, r, r1, b, w, off, d, m, mins, acc[r], acc[r1], type);
            else pair8(act, act_stride, r, r1, b, w, off, d, m, mins, acc[r], acc[r1], type);
        }
    }
    store_all(out, out_stride, acc, nr, n_valid);
}

AI void gemm8(int64_t n, const void *group, const void *act, size_t act_stride, int nr, float *out,
              size_t out_stride, int n_valid, const void *next, const int type)
{
    gemm(n, group, act, act_stride, nr, out, out_stride, n_valid, next, type, 0);
}

AI void gemm16(int64_t n, const void *group, const void *act, size_t act_stride, int nr, float *out,
               size_t out_stride, int n_valid, const void *next, const int type)
{
    gemm(n, group, act, act_stride, nr, out, out_stride, n_valid, next, type, 1);
}

#define I8MM_GEMM(name, fn, TYPE)                                                                              \
    BT_CPU_GEMM_DECL(neon_i8mm, name) { fn(n, group, act, act_stride, nr, out, out_stride, n_valid, next, TYPE); }

I8MM_GEMM(q4_0, gemm8, BT_TYPE_Q4_0)
I8MM_GEMM(q4_1, gemm8, BT_TYPE_Q4_1)
I8MM_GEMM(q8_0, gemm8, BT_TYPE_Q8_0)
I8MM_GEMM(q5_1, gemm8, BT_TYPE_Q5_1)
I8MM_GEMM(q4_k, gemm8, BT_TYPE_Q4_K)
I8MM_GEMM(q5_k, gemm8, BT_TYPE_Q5_K)
I8MM_GEMM(q6_k, gemm8, BT_TYPE_Q6_K)
I8MM_GEMM(q4_0_q16, gemm16, BT_TYPE_Q4_0)
I8MM_GEMM(q4_1_q16, gemm16, BT_TYPE_Q4_1)
I8MM_GEMM(q8_0_q16, gemm16, BT_TYPE_Q8_0)
I8MM_GEMM(q5_1_q16, gemm16, BT_TYPE_Q5_1)
I8MM_GEMM(q5_0_q16, gemm16, BT_TYPE_Q5_0)
I8MM_GEMM(q4_k_q16, gemm16, BT_TYPE_Q4_K)
I8MM_GEMM(q6_k_q16, gemm16, BT_TYPE_Q6_K)
I8MM_GEMM(q5_k_q16, gemm16, BT_TYPE_Q5_K)

/* Everything but the GEMM is the NEON table's. */
const bt_cpu_ops bt_cpu_ops_neon_i8mm = {
    .isa = BT_CPU_ISA_NEON_I8MM,
    .name = "neon-i8mm",
    BT_CPU_NEON_SHARED_SLOTS,
    .gemm8 = {
        [BT_TYPE_Q4_0] = bt_cpu_neon_i8mm_gemm_q4_0,
        [BT_TYPE_Q4_1] = bt_cpu_neon_i8mm_gemm_q4_1,
        [BT_TYPE_Q8_0] = bt_cpu_neon_i8mm_gemm_q8_0,
        [BT_TYPE_Q5_1] = bt_cpu_neon_i8mm_gemm_q5_1,
        [BT_TYPE_Q4_K] = bt_cpu_neon_i8mm_gemm_q4_k,
        [BT_TYPE_Q5_K] = bt_cpu_neon_i8mm_gemm_q5_k,
        [BT_TYPE_Q6_K] = bt_cpu_neon_i8mm_gemm_q6_k,
    },
    .gemm16 = {
        [BT_TYPE_Q4_0] = bt_cpu_neon_i8mm_gemm_q4_0_q16,
        [BT_TYPE_Q4_1] = bt_cpu_neon_i8mm_gemm_q4_1_q16,
        [BT_TYPE_Q8_0] = bt_cpu_neon_i8mm_gemm_q8_0_q16,
        [BT_TYPE_Q4_K] = bt_cpu_neon_i8mm_gemm_q4_k_q16,
        [BT_TYPE_Q6_K] = bt_cpu_neon_i8mm_gemm_q6_k_q16,
        [BT_TYPE_Q5_K] = bt_cpu_neon_i8mm_gemm_q5_k_q16,
        [BT_TYPE_Q5_1] = bt_cpu_neon_i8mm_gemm_q5_1_q16,
        [BT_TYPE_Q5_0] = bt_cpu_neon_i8mm_gemm_q5_0_q16,
    },
};
