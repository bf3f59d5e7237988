/* Tiled GEMM kernels over packed weights (layouts in cpu_gemm.c) for aarch64 NEON + dot product. Each block's 16
 * rows are decoded once for up to BT_CPU_GEMM_NR activation rows:
 *   8-bit activations: the packed dwords (4 codes of one row) are exactly what `sdot` by lane wants: one
 *     instruction multiplies 4 codes of 4 rows by 4 broadcast activation codes, no horizontal sums;
 *   16-bit activations: the codes are widened to 16 bits per element for the 16 rows (vld4/vld2 de-interleave the
 *     dwords/words of the layout) and multiplied by each broadcast activation with smlal by lane; Q5_0 and Q5_1 add
 *     their fifth bits (16) to the nibbles as bytes, from the plane word of each element (tbl, tst).
 * The integer dot is exact, then per output element acc = fma((float)isum, d_w * d_a, acc) and, for layouts with a
 * min, acc = fma(m_w, ds_a, acc): the bits of bt_cpu_gemm_packed_ref. */
#include <arm_neon.h>

#include "engine/cpu/cpu_impl.h"
#include "engine/cpu/cpu_neon_gemm.h"

/* ---- 8-bit activations: codes as 8 quads of 4 elements x 16 rows (quad k: elements 4k .. 4k + 3) ---- */

/* Block b's codes into c[k][i] (quad k, rows 4i .. 4i + 3) as signed bytes, and the integer offset to take off
 * (Q4_0: 8 * sum(a)). Q8_0's stored q + 128 is flipped back to q and Q6_K's q (0..63) made q - 32, so no offset. */
AI int decode8(const uint8_t *codes, const int type, int8x16_t c[8][4])
{
    if (bt_gl_byte_codes(type, 0)) {
        const uint8x16_t flip = vdupq_n_u8(type == BT_TYPE_Q8_0 ? 0x80 : 0);
        const uint8x16_t sub = vdupq_n_u8(type == BT_TYPE_Q6_K ? 32 : 0);
        for (int k = 0; k < 8; k++)
            for (int i = 0; i < 4; i++)
                c[k][i] = vreinterpretq_s8_u8(vsubq_u8(veorq_u8(vld1q_u8(codes + 64 * k + 16 * i), flip), sub));
        return 0;
    }
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 4; i++) {
            uint8x16_t v = vld1q_u8(codes + 64 * k + 16 * i);
            c[k][i] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f)));  /* elements 4k + t */
            c[k + 4][i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));           /* elements 16 + 4k + t */
        }
    return type == BT_TYPE_Q4_0 ? 8 : 0;
}

AI void gemm8(int64_t n, const void *group, const void *act, size_t act_stride, int nr, float *out,
              size_t out_stride, int n_valid, const void *next, const int type)
{
    const size_t cb = bt_gl_code_bytes(type, 0);
    const int mins = bt_gl_has_min(type);
    const int64_t nb = n / BT_QK;
    float32x4_t acc[BT_CPU_GEMM_NR][4];
    acc_zero(acc, nr);
    for (int64_t b = 0; b < nb; b++) {
        bt_gl_prefetch_block(next, b, type, 0);
        int8x16_t c[8][4];
        const int off = decode8(bt_gl_codes(group, b, type, cb), type, c);
        float32x4_t d[4], m[4];
        block_scales(group, b, type, cb, d, m);
        for (int r = 0; r < nr; r++) {
            const int8_t *qs = bt_gl_act8_qs(act, act_stride, r, b);
            const int8x16_t a0 = vld1q_s8(qs), a1 = vld1q_s8(qs + 16);
            float ad, ads;
            bt_gl_act8_scales(act, act_stride, r, b, &ad, &ads);
            int32x4_t isum[4], half0[4]; /* Q6_K: quads 0..3 (elements 0..15) have their own d */
            for (int i = 0; i < 4; i++) {
                int32x4_t s = vdupq_n_s32(off ? -off * BT_GL_ACT8(act, act_stride, r, b)->sum : 0);
                s = vdotq_laneq_s32(s, c[0][i], a0, 0);
                s = vdotq_laneq_s32(s, c[1][i], a0, 1);
                s = vdotq_laneq_s32(s, c[2][i], a0, 2);
                s = vdotq_laneq_s32(s, c[3][i], a0, 3);
                if (type == BT_TYPE_Q6_K) half0[i] = s, s = vdupq_n_s32(0);
                s = vdotq_laneq_s32(s, c[4][i], a1, 0);
                s = vdotq_laneq_s32(s, c[5][i], a1, 1);
                s = vdotq_laneq_s32(s, c[6][i], a1, 2);
                isum[i] = vdotq_laneq_s32(s, c[7][i], a1, 3);
            }
            if (type == BT_TYPE_Q6_K)
                block_accumulate_q6k(acc[r], half0, isum, d, m, ad);
            else
                block_accumulate(acc[r], isum, d, m, ad, ads, mins);
        }
    }
    store_all(out, out_stride, acc, nr, n_valid);
}

/* ---- 16-bit activations: codes as 32 elements x 16 rows of int16 (c[e][0]: rows 0..7, c[e][1]: rows 8..15) ---- */

AI void widen16(uint8x16_t v, int16x8_t out[2])
{
    out[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v)));
    out[1] = vreinterpretq_s16_u16(vmovl_high_u8(v));
}

AI void widen16_signed(uint8x16_t v, int16x8_t out[2])
{
    int8x16_t s = vreinterpretq_s8_u8(v);
    out[0] = vmovl_s8(vget_low_s8(s));
    out[1] = vmovl_high_s8(s);
}

/* The fifth bits of element e of the 16 rows of a high-bit plane layout (Q5_0, Q5_1) as bytes 0 or 16, row r in byte
 * r. Element e is lane 2r + (e & 1) of an operand t (bt_gl_plane_elem): byte r / 4 of plane word t, bit
 * 2 (r % 4) + (e & 1). */
AI uint8x16_t plane_bytes(const uint8_t *plane, const int e)
{
    static const uint8_t idx[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
    static const uint8_t bit[16] = {1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64, 1, 4, 16, 64};
    const int t = 4 * ((e & 15) >> 2) + 2 * (e >> 4) + ((e >> 1) & 1);
    uint32_t w;
    memcpy(&w, plane + 4 * t, 4);
    const uint8x16_t x = vqtbl1q_u8(vreinterpretq_u8_u32(vdupq_n_u32(w)), vld1q_u8(idx));
    const uint8x16_t bits = vld1q_u8(bit);
    return vandq_u8(vtstq_u8(x, (e & 1) ? vshlq_n_u8(bits, 1) : bits), vdupq_n_u8(16));
}

/* Block b's codes; returns the integer offset to take off (Q4_0: 8, Q5_0: 16). */
AI int decode16(const uint8_t *codes, const int type, int16x8_t c[32][2])
{
    if (bt_gl_byte_codes(type, 1)) { /* vector k (32 bytes): word j = elements 2k, 2k + 1 of row j */
        for (int k = 0; k < 16; k++) {
            uint8x16x2_t v = vld2q_u8(codes + 32 * k);
            if (type == BT_TYPE_Q8_0 || type == BT_TYPE_Q6_K) { /* signed codes (Q5_1's and Q5_K's are 0..31) */
                widen16_signed(v.val[0], c[2 * k]);
                widen16_signed(v.val[1], c[2 * k + 1]);
            } else {
                widen16(v.val[0], c[2 * k]);
                widen16(v.val[1], c[2 * k + 1]);
            }
        }
        return 0;
    }
    static const int pair_order[4] = {0, 2, 1, 3}; /* byte t of a dword holds element 4k + pair_order[t] */
    for (int k = 0; k < 4; k++) {
        uint8x16x4_t v = vld4q_u8(codes + 64 * k); /* val[t]: byte t of every row's dword */
        for (int t = 0; t < 4; t++) {
            const int e = 4 * k + pair_order[t];
            uint8x16_t lo = vandq_u8(v.val[t], vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v.val[t], 4);
            if (bt_gl_plane(type, 1)) {
                lo = vorrq_u8(lo, plane_bytes(codes + 256, e));
                hi = vorrq_u8(hi, plane_bytes(codes + 256, e + 16));
            }
            widen16(lo, c[e]);
            widen16(hi, c[e + 16]);
        }
    }
    return type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q5_0 ? 16 : 0;
}

AI void gemm16(int64_t n, const void *group, const void *act, size_t act_stride, int nr, float *out,
               size_t out_stride, int n_valid, const void *next, const int type)
{
    const size_t cb = bt_gl_code_bytes(type, 1);
    const int mins = bt_gl_has_min(type);
    const int64_t nb = n / BT_QK;
    float32x4_t acc[BT_CPU_GEMM_NR][4];
    acc_zero(acc, nr);
    for (int64_t b = 0; b < nb; b++) {
        bt_gl_prefetch_block(next, b, type, 1);
        int16x8_t c[32][2];
        const int off = decode16(bt_gl_codes(group, b, type, cb), type, c);
        float32x4_t d[4], m[4];
        block_scales(group, b, type, cb, d, m);
        for (int r = 0; r < nr; r++) {
            const int16_t *qs = bt_gl_act16_qs(act, act_stride, r, b);
            float ad, ads;
            bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads);
            int32x4_t s[4], half0[4];
            for (int i = 0; i < 4; i++) s[i] = vdupq_n_s32(0);
            for (int e8 = 0; e8 < 32; e8 += 8) {
                if (type == BT_TYPE_Q6_K && e8 == 16) /* Q6_K: elements 0..15 have their own d */
                    for (int i = 0; i < 4; i++) half0[i] = s[i], s[i] = vdupq_n_s32(0);
                const int16x8_t a = vld1q_s16(qs + e8);
#define BT_NEON_MAC16(L)                                                                                       \
    s[0] = vmlal_laneq_s16(s[0], vget_low_s16(c[e8 + L][0]), a, L);                                           \
    s[1] = vmlal_high_laneq_s16(s[1], c[e8 + L][0], a, L);                                                     \
    s[2] = vmlal_laneq_s16(s[2], vget_low_s16(c[e8 + L][1]), a, L);                                           \
    s[3] = vmlal_high_laneq_s16(s[3], c[e8 + L][1], a, L);
                BT_NEON_MAC16(0) BT_NEON_MAC16(1) BT_NEON_MAC16(2) BT_NEON_MAC16(3)
                BT_NEON_MAC16(4) BT_NEON_MAC16(5) BT_NEON_MAC16(6) BT_NEON_MAC16(7)
#undef BT_NEON_MAC16
            }
            if (off) {
                /* the block's activation sum: a->sum for legacy blocks (Q4_0 and Q5_0 are never K-quants) */
                const int32x4_t o = vdupq_n_s32(off * BT_GL_ACT16(act, act_stride, r, b)->sum);
                for (int i = 0; i < 4; i++) s[i] = vsubq_s32(s[i], o);
            }
            if (type == BT_TYPE_Q6_K) {
                block_accumulate_q6k(acc[r], half0, s, d, m, ad);
                continue;
            }
            block_accumulate(acc[r], s, d, m, ad, ads, mins);
        }
    }
    store_all(out, out_stride, acc, nr, n_valid);
}

#define NEON_GEMM(name, fn, TYPE)                                                                              \
    BT_CPU_GEMM_DECL(neon, name) { fn(n, group, act, act_stride, nr, out, out_stride, n_valid, next, TYPE); }

NEON_GEMM(q4_0, gemm8, BT_TYPE_Q4_0)
NEON_GEMM(q4_1, gemm8, BT_TYPE_Q4_1)
NEON_GEMM(q8_0, gemm8, BT_TYPE_Q8_0)
NEON_GEMM(q5_1, gemm8, BT_TYPE_Q5_1)
NEON_GEMM(q4_k, gemm8, BT_TYPE_Q4_K)
NEON_GEMM(q5_k, gemm8, BT_TYPE_Q5_K)
NEON_GEMM(q6_k, gemm8, BT_TYPE_Q6_K)
NEON_GEMM(q4_0_q16, gemm16, BT_TYPE_Q4_0)
NEON_GEMM(q4_1_q16, gemm16, BT_TYPE_Q4_1)
NEON_GEMM(q8_0_q16, gemm16, BT_TYPE_Q8_0)
NEON_GEMM(q5_1_q16, gemm16, BT_TYPE_Q5_1)
NEON_GEMM(q5_0_q16, gemm16, BT_TYPE_Q5_0)
NEON_GEMM(q4_k_q16, gemm16, BT_TYPE_Q4_K)
NEON_GEMM(q6_k_q16, gemm16, BT_TYPE_Q6_K)
NEON_GEMM(q5_k_q16, gemm16, BT_TYPE_Q5_K)
