/* aarch64 NEON kernels (Advanced SIMD + the Armv8.2 dot product). Compiled with -march=armv8.2-a+dotprod; called
 * only when the CPU has them (bt_cpu_isa_supported reads the kernel's hwcaps).
 * Quantized dots: each block's integer dot is exact (sdot on int8 codes and int8 activations, smull/smlal on int16
 * activations) and the float part is the scalar reference's, written the same way in the same order, so these
 * kernels give the scalar reference's bits (stronger than the 1e-5 the tests allow). A block's weights are decoded
 * once for all nr activation rows, and every row sees the same instruction sequence whatever nr is.
 * Attention, rmsnorm, swiglu, the quantizers and the conversions follow the bit-exact recipes of cpu_kernels.h. */
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_impl.h"

#define AI static inline __attribute__((always_inline))

/* ---- small helpers ---- */

AI uint32_t load_u32le(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    return x;
}

/* bit i of the 16-bit word w -> byte i = 0x10 or 0 (i < 16) */
AI uint8x16_t bits_to_0x10(uint32_t w)
{
    static const uint8_t mask[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t b = vcombine_u8(vdup_n_u8((uint8_t)(w & 0xff)), vdup_n_u8((uint8_t)((w >> 8) & 0xff)));
    return vandq_u8(vtstq_u8(b, vld1q_u8(mask)), vdupq_n_u8(0x10));
}

/* The 32 codes of a legacy block as int8 (elements 0..15 in *lo, 16..31 in *hi), offsets included where the
 * scalar reference includes them (Q4_0: q - 8, Q5_0: q - 16). */
AI void legacy_codes(uint32_t t, const void *w, int64_t b, int8x16_t *lo, int8x16_t *hi)
{
    switch (t) {
    case BT_TYPE_Q4_0: {
        uint8x16_t q = vld1q_u8(((const bt_block_q4_0 *)w + b)->qs);
        *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f))), vdupq_n_s8(8));
        *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), vdupq_n_s8(8));
        return;
    }
    case BT_TYPE_Q4_1: {
        uint8x16_t q = vld1q_u8(((const bt_block_q4_1 *)w + b)->qs);
        *lo = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f)));
        *hi = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
        return;
    }
    case BT_TYPE_Q5_0: {
        const bt_block_q5_0 *x = (const bt_block_q5_0 *)w + b;
        uint8x16_t q = vld1q_u8(x->qs);
        uint32_t qh = load_u32le(x->qh);
        *lo = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(0x0f)), bits_to_0x10(qh))),
                       vdupq_n_s8(16));
        *hi = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q, 4), bits_to_0x10(qh >> 16))), vdupq_n_s8(16));
        return;
    }
    case BT_TYPE_Q5_1: {
        const bt_block_q5_1 *x = (const bt_block_q5_1 *)w + b;
        uint8x16_t q = vld1q_u8(x->qs);
        uint32_t qh = load_u32le(x->qh);
        *lo = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(0x0f)), bits_to_0x10(qh)));
        *hi = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q, 4), bits_to_0x10(qh >> 16)));
        return;
    }
    default: { /* Q8_0 */
        const bt_block_q8_0 *x = (const bt_block_q8_0 *)w + b;
        *lo = vld1q_s8(x->qs);
        *hi = vld1q_s8(x->qs + 16);
        return;
    }
    }
}

/* exact sum of 16 int8 x int8 products pairs (two vectors each) */
AI int32_t dot32_s8(int8x16_t w0, int8x16_t w1, const int8_t *a)
{
    int32x4_t s = vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(a));
    s = vdotq_s32(s, w1, vld1q_s8(a + 16));
    return vaddvq_s32(s);
}

/* exact sum of 16 int8 weights times 16 int16 activations (|sum| < 2^31 for every caller) */
AI int32x4_t mac16_s8s16(int32x4_t s, int8x16_t w, const int16_t *a)
{
    int16x8_t w0 = vmovl_s8(vget_low_s8(w)), w1 = vmovl_high_s8(w);
    int16x8_t a0 = vld1q_s16(a), a1 = vld1q_s16(a + 8);
    s = vmlal_s16(s, vget_low_s16(w0), vget_low_s16(a0));
    s = vmlal_high_s16(s, w0, a0);
    s = vmlal_s16(s, vget_low_s16(w1), vget_low_s16(a1));
    return vmlal_high_s16(s, w1, a1);
}

/* ---- float weight types (8 lanes, one fixed order per output: batch-invariant, within 1e-5 of the reference) */

AI float32x4_t load_w4(uint32_t t, const void *w, int64_t i)
{
    if (t == BT_TYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)w + i)));
    if (t == BT_TYPE_BF16) return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)w + i), 16));
    return vld1q_f32((const float *)w + i);
}

AI float w_scalar(uint32_t t, const void *w, int64_t i)
{
    if (t == BT_TYPE_F16) return bt_fp16_to_f32(((const uint16_t *)w)[i]);
    if (t == BT_TYPE_BF16) return bt_bf16_to_f32(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

AI void dot_rows_float(uint32_t t, int64_t n, const void *w_row, const void *act, size_t act_stride, int nr,
                       float *out, size_t out_stride)
{
    for (int r = 0; r < nr; r++) {
        const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
        float32x4_t s0 = vdupq_n_f32(0.0f), s1 = s0;
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            s0 = vfmaq_f32(s0, load_w4(t, w_row, i), vld1q_f32(x + i));
            s1 = vfmaq_f32(s1, load_w4(t, w_row, i + 4), vld1q_f32(x + i + 4));
        }
        float acc = vaddvq_f32(vaddq_f32(s0, s1));
        for (; i < n; i++) acc = fmaf(w_scalar(t, w_row, i), x[i], acc);
        out[(size_t)r * out_stride] = acc;
    }
}

BT_CPU_DOT_ROWS_DECL(neon, f32) { dot_rows_float(BT_TYPE_F32, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, f16) { dot_rows_float(BT_TYPE_F16, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, bf16) { dot_rows_float(BT_TYPE_BF16, n, w_row, act, act_stride, nr, out, out_stride); }

/* ---- legacy quantized types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) ---- */

AI void dot_rows_legacy(uint32_t t, int bits, int64_t n, const void *w_row, const void *act, size_t act_stride,
                        int nr, float *out, size_t out_stride)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    const int has_min = t == BT_TYPE_Q4_1 || t == BT_TYPE_Q5_1;
    float acc[BT_CPU_MAX_NR] = {0};
    for (int64_t b = 0; b < n / BT_QK; b++) {
        const uint8_t *blk = (const uint8_t *)w_row + (size_t)b * ti->block_bytes;
        uint16_t d16, m16 = 0;
        memcpy(&d16, blk, 2);
        if (has_min) memcpy(&m16, blk + 2, 2);
        const float dw = bt_fp16_to_f32(d16), mw = bt_fp16_to_f32(m16);
        int8x16_t lo, hi;
        legacy_codes(t, w_row, b, &lo, &hi);
        for (int r = 0; r < nr; r++) {
            const char *arow = (const char *)act + (size_t)r * act_stride;
            int32_t s;
            float ad, ads;
            if (bits == 8) {
                const bt_block_q8_32 *a = (const bt_block_q8_32 *)arow + b;
                s = dot32_s8(lo, hi, a->qs);
                ad = a->d, ads = a->ds;
            } else {
                const bt_block_q16_32 *a = (const bt_block_q16_32 *)arow + b;
                s = vaddvq_s32(mac16_s8s16(mac16_s8s16(vdupq_n_s32(0), lo, a->qs), hi, a->qs + 16));
                ad = a->d, ads = a->ds;
            }
            if (has_min)
                acc[r] += dw * ad * (float)s + mw * ads;
            else
                acc[r] += dw * ad * (float)s;
        }
    }
    for (int r = 0; r < nr; r++) out[(size_t)r * out_stride] = acc[r];
}

#define LEGACY_DOT_ROWS(ty, TYPE)                                                                              \
    BT_CPU_DOT_ROWS_DECL(neon, ty) { dot_rows_legacy(TYPE, 8, n, w_row, act, act_stride, nr, out, out_stride); } \
    BT_CPU_DOT_ROWS_DECL(neon, ty##_q16)                                                                       \
    {                                                                                                          \
        dot_rows_legacy(TYPE, 16, n, w_row, act, act_stride, nr, out, out_stride);                             \
    }

LEGACY_DOT_ROWS(q4_0, BT_TYPE_Q4_0)
LEGACY_DOT_ROWS(q4_1, BT_TYPE_Q4_1)
LEGACY_DOT_ROWS(q5_0, BT_TYPE_Q5_0)
LEGACY_DOT_ROWS(q5_1, BT_TYPE_Q5_1)
LEGACY_DOT_ROWS(q8_0, BT_TYPE_Q8_0)

/* ---- K-quants (Q4_K, Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins; Q6_K: 16 of 16) ---- */

/* The 32 codes (0..31) of sub-block j of a Q4_K / Q5_K super-block (qh NULL for Q4_K). */
AI void qk45_codes(const uint8_t *qs, const uint8_t *qh, int j, int8x16_t *c0, int8x16_t *c1)
{
    const uint8_t *q = qs + 32 * (j / 2);
    uint8x16_t a = vld1q_u8(q), b = vld1q_u8(q + 16);
    if (j & 1) {
        a = vshrq_n_u8(a, 4), b = vshrq_n_u8(b, 4);
    } else {
        a = vandq_u8(a, vdupq_n_u8(0x0f)), b = vandq_u8(b, vdupq_n_u8(0x0f));
    }
    if (qh) {
        const int8x16_t sh = vdupq_n_s8((int8_t)(4 - j)); /* bit j of qh[l] -> bit 4 */
        a = vorrq_u8(a, vandq_u8(vshlq_u8(vld1q_u8(qh), sh), vdupq_n_u8(0x10)));
        b = vorrq_u8(b, vandq_u8(vshlq_u8(vld1q_u8(qh + 16), sh), vdupq_n_u8(0x10)));
    }
    *c0 = vreinterpretq_s8_u8(a), *c1 = vreinterpretq_s8_u8(b);
}

/* The 16 values (q - 32) of sub-block k (0..15) of a Q6_K super-block. */
AI int8x16_t q6k_codes(const bt_block_q6_k *w, int k)
{
    const int h = k / 8, s = (k % 8) / 2, half = 16 * (k & 1);
    uint8x16_t lo = vld1q_u8(w->ql + 64 * h + 32 * (s & 1) + half);
    lo = (s >> 1) ? vshrq_n_u8(lo, 4) : vandq_u8(lo, vdupq_n_u8(0x0f));
    uint8x16_t hi = vld1q_u8(w->qh + 32 * h + half);
    hi = vandq_u8(vshlq_u8(hi, vdupq_n_s8((int8_t)(-2 * s))), vdupq_n_u8(3));
    return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
}

AI void dot_rows_qk45(int has_qh, int bits, int64_t n, const void *w_row, const void *act, size_t act_stride,
                      int nr, float *out, size_t out_stride)
{
    float acc[BT_CPU_MAX_NR] = {0};
    for (int64_t i = 0; i < n / BT_QK_K; i++) {
        const uint8_t *scales, *qs, *qh = NULL;
        uint16_t d16, dmin16;
        if (has_qh) {
            const bt_block_q5_k *b = (const bt_block_q5_k *)w_row + i;
            scales = b->scales, qs = b->qs, qh = b->qh, d16 = b->d, dmin16 = b->dmin;
        } else {
            const bt_block_q4_k *b = (const bt_block_q4_k *)w_row + i;
            scales = b->scales, qs = b->qs, d16 = b->d, dmin16 = b->dmin;
        }
        int8x16_t c[8][2];
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            qk45_codes(qs, qh, j, &c[j][0], &c[j][1]);
            bt_q4k_scale_min(scales, j, &sc[j], &m[j]);
        }
        const float d = bt_fp16_to_f32(d16), dmin = bt_fp16_to_f32(dmin16);
        for (int r = 0; r < nr; r++) {
            const char *arow = (const char *)act + (size_t)r * act_stride;
            if (bits == 8) {
                const bt_block_q8_256 *a = (const bt_block_q8_256 *)arow + i;
                int32_t sumi = 0, summ = 0;
                for (int j = 0; j < 8; j++) {
                    sumi += sc[j] * dot32_s8(c[j][0], c[j][1], a->s[j].qs);
                    summ += m[j] * a->s[j].sum;
                }
                acc[r] += d * a->s[0].d * (float)sumi - dmin * a->s[0].d * (float)summ;
            } else {
                const bt_block_q16_256 *a = (const bt_block_q16_256 *)arow + i;
                int64_t sumi = 0, summ = 0;
                for (int j = 0; j < 8; j++) {
                    int32x4_t s = mac16_s8s16(vdupq_n_s32(0), c[j][0], a->s[j].qs);
                    s = mac16_s8s16(s, c[j][1], a->s[j].qs + 16);
                    sumi += (int64_t)sc[j] * vaddvq_s32(s);
                    summ += (int64_t)m[j] * a->s[j].sum;
                }
                acc[r] += d * a->s[0].d * (float)sumi - dmin * a->s[0].d * (float)summ;
            }
        }
    }
    for (int r = 0; r < nr; r++) out[(size_t)r * out_stride] = acc[r];
}

AI void dot_rows_q6k(int bits, int64_t n, const void *w_row, const void *act, size_t act_stride, int nr, float *out,
                     size_t out_stride)
{
    float acc[BT_CPU_MAX_NR] = {0};
    for (int64_t i = 0; i < n / BT_QK_K; i++) {
        const bt_block_q6_k *w = (const bt_block_q6_k *)w_row + i;
        int8x16_t c[16];
        for (int k = 0; k < 16; k++) c[k] = q6k_codes(w, k);
        const float d = bt_fp16_to_f32(w->d);
        for (int r = 0; r < nr; r++) {
            const char *arow = (const char *)act + (size_t)r * act_stride;
            if (bits == 8) {
                const bt_block_q8_256 *a = (const bt_block_q8_256 *)arow + i;
                int32_t sumi = 0;
                for (int k = 0; k < 16; k++)
                    sumi += w->scales[k] * vaddvq_s32(vdotq_s32(vdupq_n_s32(0), c[k], vld1q_s8(bt_q8k_qs(a, 16 * k))));
                acc[r] += d * a->s[0].d * (float)sumi;
            } else {
                const bt_block_q16_256 *a = (const bt_block_q16_256 *)arow + i;
                int64_t sumi = 0;
                for (int k = 0; k < 16; k++)
                    sumi += (int64_t)w->scales[k] *
                            vaddvq_s32(mac16_s8s16(vdupq_n_s32(0), c[k], bt_q16k_qs(a, 16 * k)));
                acc[r] += d * a->s[0].d * (float)sumi;
            }
        }
    }
    for (int r = 0; r < nr; r++) out[(size_t)r * out_stride] = acc[r];
}

BT_CPU_DOT_ROWS_DECL(neon, q4_k) { dot_rows_qk45(0, 8, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, q5_k) { dot_rows_qk45(1, 8, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, q6_k) { dot_rows_q6k(8, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, q4_k_q16) { dot_rows_qk45(0, 16, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, q5_k_q16) { dot_rows_qk45(1, 16, n, w_row, act, act_stride, nr, out, out_stride); }
BT_CPU_DOT_ROWS_DECL(neon, q6_k_q16) { dot_rows_q6k(16, n, w_row, act, act_stride, nr, out, out_stride); }

/* ---- activation quantization (same bytes as the scalar reference) ---- */

AI float abs_max(const float *x, int n)
{
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(x + i)));
    return vmaxvq_f32(m);
}

/* 8 floats times id, rounded half to even (vcvtnq: the reference's round_even for |v| < 2^22) */
AI int32x4_t round4(const float *x, float32x4_t id)
{
    return vcvtnq_s32_f32(vmulq_f32(vld1q_f32(x), id));
}

/* n (a multiple of 16) floats -> int8 codes with inverse scale id; returns their sum */
AI int32_t quant8(const float *x, int n, float id, int8_t *q)
{
    const float32x4_t idv = vdupq_n_f32(id);
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < n; i += 16) {
        int32x4_t a = round4(x + i, idv), b = round4(x + i + 4, idv), c = round4(x + i + 8, idv),
                  d = round4(x + i + 12, idv);
        s = vaddq_s32(s, vaddq_s32(vaddq_s32(a, b), vaddq_s32(c, d)));
        int16x8_t ab = vcombine_s16(vmovn_s32(a), vmovn_s32(b)), cd = vcombine_s16(vmovn_s32(c), vmovn_s32(d));
        vst1q_s8(q + i, vcombine_s8(vmovn_s16(ab), vmovn_s16(cd)));
    }
    return vaddvq_s32(s);
}

/* n (a multiple of 8) floats -> int16 codes; returns their sum */
AI int32_t quant16(const float *x, int n, float id, int16_t *q)
{
    const float32x4_t idv = vdupq_n_f32(id);
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < n; i += 8) {
        int32x4_t a = round4(x + i, idv), b = round4(x + i + 4, idv);
        s = vaddq_s32(s, vaddq_s32(a, b));
        vst1q_s16(q + i, vcombine_s16(vmovn_s32(a), vmovn_s32(b)));
    }
    return vaddvq_s32(s);
}

void bt_cpu_neon_quantize_q8_32(int64_t n, const float *x, bt_block_q8_32 *y)
{
    for (int64_t i = 0; i < n / BT_QK; i++) {
        const float *xb = x + i * BT_QK;
        float d = abs_max(xb, BT_QK) / 127.0f;
        float id = bt_act_inv_scale(d);
        int32_t s = quant8(xb, BT_QK, id, y[i].qs);
        y[i].d = d;
        y[i].sum = s;
        y[i].ds = d * (float)s;
        y[i].sum_lo = 0;
    }
}

void bt_cpu_neon_quantize_q8_256(int64_t n, const float *x, bt_block_q8_256 *y)
{
    for (int64_t i = 0; i < n / BT_QK_K; i++) {
        const float *xb = x + i * BT_QK_K;
        float d = abs_max(xb, BT_QK_K) / 127.0f;
        float id = bt_act_inv_scale(d);
        for (int s = 0; s < 8; s++) {
            y[i].s[s].sum_lo = quant8(xb + 32 * s, 16, id, y[i].s[s].qs);
            y[i].s[s].sum = y[i].s[s].sum_lo + quant8(xb + 32 * s + 16, 16, id, y[i].s[s].qs + 16);
        }
        bt_q8k_finish(&y[i], d);
    }
}

void bt_cpu_neon_quantize_q16_32(int64_t n, const float *x, bt_block_q16_32 *y)
{
    for (int64_t i = 0; i < n / BT_QK; i++) {
        const float *xb = x + i * BT_QK;
        float d = abs_max(xb, BT_QK) / 32767.0f;
        float id = bt_act_inv_scale(d);
        int32_t s = quant16(xb, BT_QK, id, y[i].qs);
        y[i].d = d;
        y[i].sum = s;
        y[i].ds = d * (float)s;
        y[i].sum_lo = 0;
    }
}

void bt_cpu_neon_quantize_q16_256(int64_t n, const float *x, bt_block_q16_256 *y)
{
    for (int64_t i = 0; i < n / BT_QK_K; i++) {
        const float *xb = x + i * BT_QK_K;
        float d = abs_max(xb, BT_QK_K) / 32767.0f;
        float id = bt_act_inv_scale(d);
        for (int s = 0; s < 8; s++) {
            y[i].s[s].sum_lo = quant16(xb + 32 * s, 16, id, y[i].s[s].qs);
            y[i].s[s].sum = y[i].s[s].sum_lo + quant16(xb + 32 * s + 16, 16, id, y[i].s[s].qs + 16);
        }
        bt_q16k_finish(&y[i], d);
    }
}

/* ---- row conversions (the bits of cpu_fp16.h's scalar functions) ---- */

void bt_cpu_neon_fp16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x + i))));
    for (; i < n; i++) y[i] = bt_fp16_to_f32(x[i]);
}

void bt_cpu_neon_f32_to_fp16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1_u16(y + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
    for (; i < n; i++) y[i] = bt_f32_to_fp16(x[i]);
}

void bt_cpu_neon_bf16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_u32((uint32_t *)(y + i), vshll_n_u16(vld1_u16(x + i), 16));
    for (; i < n; i++) y[i] = bt_bf16_to_f32(x[i]);
}

/* round to nearest even on the bits; a NaN keeps its top bits and is made quiet */
void bt_cpu_neon_f32_to_bf16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint32x4_t v = vld1q_u32((const uint32_t *)(x + i));
        uint32x4_t odd = vandq_u32(vshrq_n_u32(v, 16), vdupq_n_u32(1));
        uint32x4_t rounded = vshrq_n_u32(vaddq_u32(vaddq_u32(v, vdupq_n_u32(0x7fff)), odd), 16);
        uint32x4_t nan = vcgtq_u32(vandq_u32(v, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
        uint32x4_t quiet = vorrq_u32(vshrq_n_u32(v, 16), vdupq_n_u32(0x40));
        vst1_u16(y + i, vmovn_u32(vbslq_u32(nan, quiet, rounded)));
    }
    for (; i < n; i++) y[i] = bt_f32_to_bf16(x[i]);
}

/* ---- exp, rmsnorm, swiglu (bit-identical to the scalar versions) ---- */

/* bt_cpu_expf on 4 lanes: the same operations, fused where the scalar one calls fmaf */
AI float32x4_t expf4(float32x4_t x)
{
    float32x4_t t = vmulq_f32(x, vdupq_n_f32(BT_EXP_LOG2E));
    float32x4_t nf = vsubq_f32(vaddq_f32(t, vdupq_n_f32(BT_EXP_MAGIC)), vdupq_n_f32(BT_EXP_MAGIC));
    float32x4_t r = vfmaq_f32(x, nf, vdupq_n_f32(-BT_EXP_LN2_HI));
    r = vfmaq_f32(r, nf, vdupq_n_f32(-BT_EXP_LN2_LO));
    float32x4_t p = vfmaq_f32(vdupq_n_f32(BT_EXP_P4), vdupq_n_f32(BT_EXP_P5), r);
    p = vfmaq_f32(vdupq_n_f32(BT_EXP_P3), p, r);
    p = vfmaq_f32(vdupq_n_f32(BT_EXP_P2), p, r);
    p = vfmaq_f32(vdupq_n_f32(BT_EXP_P1), p, r);
    p = vfmaq_f32(vdupq_n_f32(BT_EXP_P0), p, r);
    p = vfmaq_f32(r, p, vmulq_f32(r, r));
    p = vaddq_f32(p, vdupq_n_f32(1.0f));
    int32x4_t e = vshlq_n_s32(vcvtq_s32_f32(nf), 23);
    float32x4_t y = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), e));
    y = vbslq_f32(vcltq_f32(x, vdupq_n_f32(BT_EXP_LO)), vdupq_n_f32(0.0f), y);
    y = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(BT_EXP_HI)), vdupq_n_f32(INFINITY), y);
    return vbslq_f32(vceqq_f32(x, x), y, x); /* NaN stays NaN */
}

void bt_cpu_neon_swiglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t gv = vld1q_f32(g + i), uv = vld1q_f32(u + i);
        float32x4_t den = vaddq_f32(vdupq_n_f32(1.0f), expf4(vnegq_f32(gv)));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(gv, den), uv));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + bt_cpu_expf(-g[i])) * u[i];
}

void bt_cpu_neon_geglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        float32x4_t x = vld1q_f32(g + i);
        float32x4_t t = vmulq_f32(vmulq_f32(x, x), vdupq_n_f32(BT_GELU_A));
        float32x4_t z = vmulq_f32(vfmaq_f32(x, t, x), vdupq_n_f32(BT_GELU_K));
        float32x4_t d = vaddq_f32(vdupq_n_f32(1.0f), expf4(z));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(x, d), vld1q_f32(u + i)));
    }
    if (i < n) bt_cpu_scalar_geglu(n - i, g + i, u + i, out + i);
}

void bt_cpu_neon_rmsnorm(int64_t n, const float *x, const float *w, float eps, float *out)
{
    /* lanes l[i % 8] as four float64x2: (l0, l1), (l2, l3), (l4, l5), (l6, l7); the squares are exact in double */
    float64x2_t l01 = vdupq_n_f64(0), l23 = l01, l45 = l01, l67 = l01;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + i + 4);
        float64x2_t a0 = vcvt_f64_f32(vget_low_f32(a)), a1 = vcvt_high_f64_f32(a);
        float64x2_t b0 = vcvt_f64_f32(vget_low_f32(b)), b1 = vcvt_high_f64_f32(b);
        l01 = vaddq_f64(l01, vmulq_f64(a0, a0)), l23 = vaddq_f64(l23, vmulq_f64(a1, a1));
        l45 = vaddq_f64(l45, vmulq_f64(b0, b0)), l67 = vaddq_f64(l67, vmulq_f64(b1, b1));
    }
    double l[8];
    vst1q_f64(l, l01), vst1q_f64(l + 2, l23), vst1q_f64(l + 4, l45), vst1q_f64(l + 6, l67);
    for (; i < n; i++) l[i % 8] += (double)x[i] * x[i];
    double b[4];
    for (int t = 0; t < 4; t++) b[t] = l[t] + l[t + 4];
    double ss = (b[0] + b[2]) + (b[1] + b[3]);
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    const float32x4_t sv = vdupq_n_f32(scale);
    for (i = 0; i + 4 <= n; i += 4) vst1q_f32(out + i, vmulq_f32(vmulq_f32(vld1q_f32(x + i), sv), vld1q_f32(w + i)));
    for (; i < n; i++) out[i] = x[i] * scale * w[i];
}

/* ---- attention ---- */

void bt_cpu_neon_attn_scores(int64_t n, const float *q, const float *k, size_t k_stride, int64_t nk, float scale,
                             float *out)
{
    for (int64_t j = 0; j < nk; j++) {
        const float *kr = k + (size_t)j * k_stride;
        float32x4_t l0 = vdupq_n_f32(0.0f), l1 = l0; /* lanes 0..3 and 4..7 */
        for (int64_t i = 0; i < n; i += 8) {
            l0 = vaddq_f32(l0, vmulq_f32(vld1q_f32(q + i), vld1q_f32(kr + i)));
            l1 = vaddq_f32(l1, vmulq_f32(vld1q_f32(q + i + 4), vld1q_f32(kr + i + 4)));
        }
        /* ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
        float32x4_t p = vpaddq_f32(l0, l1);
        float32x4_t pp = vpaddq_f32(p, p);
        out[j] = (vgetq_lane_f32(pp, 0) + vgetq_lane_f32(pp, 1)) * scale;
    }
}

void bt_cpu_neon_attn_accum(int64_t n, const float *w, const float *v, size_t v_stride, int64_t nv, float *acc)
{
    for (int64_t j = 0; j < nv; j++) {
        const float *vr = v + (size_t)j * v_stride;
        const float32x4_t wj = vdupq_n_f32(w[j]);
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) vst1q_f32(acc + i, vaddq_f32(vld1q_f32(acc + i), vmulq_f32(wj, vld1q_f32(vr + i))));
        for (; i < n; i++) acc[i] += w[j] * vr[i];
    }
}

/* 4 elements i .. i + 3 of row j of a KV block (which = 0: K, 1: V), dequantized exactly as the reference */
AI float32x4_t kv4(const bt_cpu_kv_rows *kv, int which, int64_t n, int j, int64_t i)
{
    const void *base = which ? kv->v : kv->k;
    size_t e = (size_t)j * (size_t)n + (size_t)i;
    switch (kv->type) {
    case BT_CPU_KV_F16: return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)base + e)));
    case BT_CPU_KV_U8: {
        const uint16_t *sm = (which ? kv->v_sm : kv->k_sm) + 2 * j;
        uint32_t c4;
        memcpy(&c4, (const uint8_t *)base + e, 4);
        uint16x4_t c16 = vget_low_u16(vmovl_u8(vcreate_u8((uint64_t)c4)));
        float32x4_t code = vcvtq_f32_u32(vmovl_u16(c16));
        return vfmaq_f32(vdupq_n_f32(bt_fp16_to_f32(sm[1])), vdupq_n_f32(bt_fp16_to_f32(sm[0])), code);
    }
    default: return vld1q_f32((const float *)base + e);
    }
}

/* kv4 with a U8 block's (scale, min) pairs already as floats (sm: [nk][2] of `which`) */
AI float32x4_t kv4f(const bt_cpu_kv_rows *kv, int which, int64_t n, int j, int64_t i, const float *sm)
{
    if (kv->type != BT_CPU_KV_U8) return kv4(kv, which, n, j, i);
    uint32_t c4;
    memcpy(&c4, (const uint8_t *)(which ? kv->v : kv->k) + (size_t)j * (size_t)n + (size_t)i, 4);
    float32x4_t code = vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8((uint64_t)c4)))));
    return vfmaq_f32(vdupq_n_f32(sm[2 * j + 1]), vdupq_n_f32(sm[2 * j]), code);
}

/* tree16 of the reference over four vectors x0..x3 (lanes 0..15) */
AI float tree16v(float32x4_t x0, float32x4_t x1, float32x4_t x2, float32x4_t x3)
{
    float32x4_t c = vaddq_f32(vaddq_f32(x0, x2), vaddq_f32(x1, x3));  /* b_t = x_t + x_{t+8}, c_t = b_t + b_{t+4} */
    float32x2_t d = vadd_f32(vget_low_f32(c), vget_high_f32(c)); /* d_t = c_t + c_{t+2} */
    return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

static float tree16(const float *x)
{
    return tree16v(vld1q_f32(x), vld1q_f32(x + 4), vld1q_f32(x + 8), vld1q_f32(x + 12));
}

/* attn_block for one query head, any n (a multiple of 4): the reference's arithmetic, one key at a time */
static void attn_head1(int64_t n, const float *qh, float scale, const bt_cpu_kv_rows *kv, int nk, float *m, float *l,
                       float *ah)
{
    float s[BT_CPU_ATTN_BLOCK], w[BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        if (j >= nk) {
            s[j] = -INFINITY;
            continue;
        }
        float32x4_t x[4];
        for (int t = 0; t < 4; t++)
            x[t] = 4 * t < n ? vmulq_f32(vld1q_f32(qh + 4 * t), kv4(kv, 0, n, j, 4 * t)) : vdupq_n_f32(0.0f);
        for (int64_t i = 16; i < n; i += 16)
            for (int t = 0; t < 4; t++)
                if (i + 4 * t < n) x[t] = vfmaq_f32(x[t], vld1q_f32(qh + i + 4 * t), kv4(kv, 0, n, j, i + 4 * t));
        s[j] = tree16v(x[0], x[1], x[2], x[3]) * scale;
    }
    float mn = *m;
    for (int j = 0; j < nk; j++) mn = s[j] > mn ? s[j] : mn;
    float c = bt_cpu_expf(*m - mn);
    const float32x4_t mnv = vdupq_n_f32(mn);
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j += 4) vst1q_f32(w + j, expf4(vsubq_f32(vld1q_f32(s + j), mnv)));
    *l = fmaf(*l, c, tree16(w));
    const float32x4_t cv = vdupq_n_f32(c);
    for (int64_t i = 0; i < n; i += 4) {
        float32x4_t a = vmulq_f32(vld1q_f32(ah + i), cv);
        for (int j = 0; j < nk; j++) a = vfmaq_f32(a, vdupq_n_f32(w[j]), kv4(kv, 1, n, j, i));
        vst1q_f32(ah + i, a);
    }
    *m = mn;
}

#define ATTN_NH 4 /* query heads handled together: each K/V element is loaded and converted once for all of them */

/* attn_block for NH (1..ATTN_NH) query heads of n a multiple of 16, the arithmetic of attn_head1: per key, 16 dot
 * lanes of each head in 4 registers (NH x 4 <= 16 accumulators beside the key's 4); V in slices of 16 elements of
 * every head. */
AI void attn_heads(int64_t n, const int NH, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk, float *m,
                   float *l, float *acc)
{
    float w[ATTN_NH][BT_CPU_ATTN_BLOCK], c[ATTN_NH], s[ATTN_NH][BT_CPU_ATTN_BLOCK];
    float ksm[2 * BT_CPU_ATTN_BLOCK], vsm[2 * BT_CPU_ATTN_BLOCK]; /* U8: each row's (scale, min) as floats, once */
    if (kv->type == BT_CPU_KV_U8)
        for (int j = 0; j < 2 * nk; j++) ksm[j] = bt_fp16_to_f32(kv->k_sm[j]), vsm[j] = bt_fp16_to_f32(kv->v_sm[j]);
    for (int j = 0; j < nk; j++) {
        float32x4_t x[ATTN_NH][4];
        for (int t = 0; t < 4; t++) {
            const float32x4_t k = kv4f(kv, 0, n, j, 4 * t, ksm);
            for (int h = 0; h < NH; h++) x[h][t] = vmulq_f32(vld1q_f32(q + (size_t)h * (size_t)n + 4 * t), k);
        }
        for (int64_t i = 16; i < n; i += 16)
            for (int t = 0; t < 4; t++) {
                const float32x4_t k = kv4f(kv, 0, n, j, i + 4 * t, ksm);
                for (int h = 0; h < NH; h++)
                    x[h][t] = vfmaq_f32(x[h][t], vld1q_f32(q + (size_t)h * (size_t)n + (size_t)i + 4 * t), k);
            }
        for (int h = 0; h < NH; h++) s[h][j] = tree16v(x[h][0], x[h][1], x[h][2], x[h][3]) * scale;
    }
    for (int h = 0; h < NH; h++) {
        for (int j = nk; j < BT_CPU_ATTN_BLOCK; j++) s[h][j] = -INFINITY;
        float mn = m[h];
        for (int j = 0; j < nk; j++) mn = s[h][j] > mn ? s[h][j] : mn;
        c[h] = bt_cpu_expf(m[h] - mn);
        const float32x4_t mnv = vdupq_n_f32(mn);
        for (int j = 0; j < BT_CPU_ATTN_BLOCK; j += 4)
            vst1q_f32(w[h] + j, expf4(vsubq_f32(vld1q_f32(s[h] + j), mnv)));
        l[h] = fmaf(l[h], c[h], tree16(w[h]));
        m[h] = mn;
    }
    for (int64_t i = 0; i < n; i += 16) {
        float32x4_t a[ATTN_NH][4];
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < 4; t++)
                a[h][t] = vmulq_f32(vld1q_f32(acc + (size_t)h * (size_t)n + (size_t)i + 4 * t), vdupq_n_f32(c[h]));
        for (int j = 0; j < nk; j++)
            for (int t = 0; t < 4; t++) {
                const float32x4_t v = kv4f(kv, 1, n, j, i + 4 * t, vsm);
                for (int h = 0; h < NH; h++) a[h][t] = vfmaq_f32(a[h][t], vdupq_n_f32(w[h][j]), v);
            }
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < 4; t++) vst1q_f32(acc + (size_t)h * (size_t)n + (size_t)i + 4 * t, a[h][t]);
    }
}

void bt_cpu_neon_attn_block(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk,
                            float *m, float *l, float *acc)
{
    if (n % 16) { /* head sizes that are not a multiple of 16: one head at a time */
        for (int h = 0; h < nq; h++) attn_head1(n, q + (size_t)h * (size_t)n, scale, kv, nk, m + h, l + h, acc + (size_t)h * (size_t)n);
        return;
    }
    for (int h = 0; h < nq; h += ATTN_NH) {
        const float *qh = q + (size_t)h * (size_t)n;
        float *ah = acc + (size_t)h * (size_t)n;
        switch (nq - h < ATTN_NH ? nq - h : ATTN_NH) {
        case 1: attn_heads(n, 1, qh, scale, kv, nk, m + h, l + h, ah); break;
        case 2: attn_heads(n, 2, qh, scale, kv, nk, m + h, l + h, ah); break;
        case 3: attn_heads(n, 3, qh, scale, kv, nk, m + h, l + h, ah); break;
        default: attn_heads(n, 4, qh, scale, kv, nk, m + h, l + h, ah); break;
        }
    }
}

/* ---- attn_block_rows: BT_CPU_ATTN_ROWS query rows in the lanes of four vectors (rows 0-3, 4-7, 8-11, 12-15) ---- */

/* c_t of tree16 ((x_t + x_(t+8)) + (x_(t+4) + x_(t+12))) of the rows of NV row vectors against key row k, for T
 * values of t from t0 (T * NV <= 4: up to 16 chains). Lane x_t of a row is its chain over elements t, t + 16, ...:
 * the product of the first, then fmas by K's element, as the reference's x[t]. */
AI void rows_c(const int64_t n, const int NV, const int T, const float *qt, const float *k, int t0,
               float32x4_t (*c)[4])
{
    float32x4_t x[4][4][4];
    for (int tt = 0; tt < T; tt++)
        for (int e = 0; e < 4; e++) {
            const int ln = t0 + tt + (e & 1) * 8 + (e >> 1) * 4; /* t, t + 8, t + 4, t + 12 */
            for (int h = 0; h < NV; h++) x[tt][e][h] = vmulq_n_f32(vld1q_f32(qt + BT_CPU_ATTN_ROWS * ln + 4 * h), k[ln]);
        }
    for (int64_t i = 16; i < n; i += 16)
        for (int tt = 0; tt < T; tt++)
            for (int e = 0; e < 4; e++) {
                const int64_t ln = i + t0 + tt + (e & 1) * 8 + (e >> 1) * 4;
                for (int h = 0; h < NV; h++)
                    x[tt][e][h] = vfmaq_n_f32(x[tt][e][h], vld1q_f32(qt + BT_CPU_ATTN_ROWS * ln + 4 * h), k[ln]);
            }
    for (int tt = 0; tt < T; tt++)
        for (int h = 0; h < NV; h++)
            c[tt][h] = vaddq_f32(vaddq_f32(x[tt][0][h], x[tt][1][h]), vaddq_f32(x[tt][2][h], x[tt][3][h]));
}

/* NV (1..4) row vectors, nr rows. The reference's softmax step on every row at once: mn = m, then for j < nk mn =
 * s_j > mn ? s_j : mn (a compare and select: NEON's fmax would pass a NaN score on), c = exp(m - mn), w_j = exp(s_j
 * - mn), l = fma(l, c, tree16(w)) with the tree vertical over the key vectors; then each row's V pass, 16 elements
 * of 4 rows at a time. */
AI void rows_block4(const int64_t n, const int NV, int nr, const float *qt, float scale, const float *k,
                    const float *v, int nk, float *m, float *l, float *acc)
{
    const int T = NV == 1 ? 4 : NV == 2 ? 2 : 1;
    float32x4_t s[BT_CPU_ATTN_BLOCK][4];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        if (j >= nk) {
            for (int h = 0; h < NV; h++) s[j][h] = vdupq_n_f32(-INFINITY);
            continue;
        }
        const float *kj = k + (size_t)j * (size_t)n;
        float32x4_t c[4][4];
        for (int t = 0; t < 4; t += T) rows_c(n, NV, T, qt, kj, t, c + t);
        for (int h = 0; h < NV; h++)
            s[j][h] = vmulq_n_f32(vaddq_f32(vaddq_f32(c[0][h], c[2][h]), vaddq_f32(c[1][h], c[3][h])), scale);
    }
    float mv[BT_CPU_ATTN_ROWS] = {0}, lv[BT_CPU_ATTN_ROWS] = {0}, cs[BT_CPU_ATTN_ROWS];
    float w[BT_CPU_ATTN_BLOCK][BT_CPU_ATTN_ROWS];
    memcpy(mv, m, sizeof(float) * (size_t)nr);
    memcpy(lv, l, sizeof(float) * (size_t)nr);
    for (int h = 0; h < NV; h++) {
        const float32x4_t m0 = vld1q_f32(mv + 4 * h);
        float32x4_t mn = m0, wv[BT_CPU_ATTN_BLOCK];
        for (int j = 0; j < nk; j++) mn = vbslq_f32(vcgtq_f32(s[j][h], mn), s[j][h], mn);
        const float32x4_t c = expf4(vsubq_f32(m0, mn));
        for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
            wv[j] = expf4(vsubq_f32(s[j][h], mn));
            vst1q_f32(w[j] + 4 * h, wv[j]);
        }
        for (int t = 0; t < 8; t++) wv[t] = vaddq_f32(wv[t], wv[t + 8]);
        for (int t = 0; t < 4; t++) wv[t] = vaddq_f32(wv[t], wv[t + 4]);
        const float32x4_t tw = vaddq_f32(vaddq_f32(wv[0], wv[2]), vaddq_f32(wv[1], wv[3]));
        vst1q_f32(lv + 4 * h, vfmaq_f32(tw, vld1q_f32(lv + 4 * h), c));
        vst1q_f32(mv + 4 * h, mn);
        vst1q_f32(cs + 4 * h, c);
    }
    memcpy(m, mv, sizeof(float) * (size_t)nr);
    memcpy(l, lv, sizeof(float) * (size_t)nr);
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int R = nr - r0 < 4 ? nr - r0 : 4;
        for (int64_t i = 0; i < n; i += 16) {
            float32x4_t a[4][4];
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++)
                    a[r][u] = vmulq_n_f32(vld1q_f32(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i + 4 * u), cs[r0 + r]);
            for (int j = 0; j < nk; j++) {
                const float *vj = v + (size_t)j * (size_t)n + (size_t)i;
                for (int r = 0; r < R; r++)
                    for (int u = 0; u < 4; u++) a[r][u] = vfmaq_n_f32(a[r][u], vld1q_f32(vj + 4 * u), w[j][r0 + r]);
            }
            for (int r = 0; r < R; r++)
                for (int u = 0; u < 4; u++) vst1q_f32(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i + 4 * u, a[r][u]);
        }
    }
}

void bt_cpu_neon_attn_block_rows(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                 int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint)
{
    if (n % 16 || n < 16 || n > 256 || nk < 1 || nk > BT_CPU_ATTN_BLOCK || nr < 1 || nr > BT_CPU_ATTN_ROWS) {
        bt_cpu_attn_block_rows_ref(n, nr, qt, scale, k, v, nk, m, l, acc, NULL);
        return;
    }
    (void)hint; /* NEON leaves the prefetches to the caller (attn_prefetches 0) */
    switch ((nr + 3) / 4) {
    case 1: rows_block4(n, 1, nr, qt, scale, k, v, nk, m, l, acc); break;
    case 2: rows_block4(n, 2, nr, qt, scale, k, v, nk, m, l, acc); break;
    case 3: rows_block4(n, 3, nr, qt, scale, k, v, nk, m, l, acc); break;
    default: rows_block4(n, 4, nr, qt, scale, k, v, nk, m, l, acc); break;
    }
}

const bt_cpu_ops bt_cpu_ops_neon = {
    .isa = BT_CPU_ISA_NEON,
    .name = "neon",
    BT_CPU_NEON_SHARED_SLOTS,
    /* cpu_neon_gemm.c */
    .gemm8 = {
        [BT_TYPE_Q4_0] = bt_cpu_neon_gemm_q4_0,
        [BT_TYPE_Q4_1] = bt_cpu_neon_gemm_q4_1,
        [BT_TYPE_Q8_0] = bt_cpu_neon_gemm_q8_0,
        [BT_TYPE_Q5_1] = bt_cpu_neon_gemm_q5_1,
        [BT_TYPE_Q4_K] = bt_cpu_neon_gemm_q4_k,
        [BT_TYPE_Q5_K] = bt_cpu_neon_gemm_q5_k,
        [BT_TYPE_Q6_K] = bt_cpu_neon_gemm_q6_k,
    },
    .gemm16 = {
        [BT_TYPE_Q4_0] = bt_cpu_neon_gemm_q4_0_q16,
        [BT_TYPE_Q4_1] = bt_cpu_neon_gemm_q4_1_q16,
        [BT_TYPE_Q8_0] = bt_cpu_neon_gemm_q8_0_q16,
        [BT_TYPE_Q4_K] = bt_cpu_neon_gemm_q4_k_q16,
        [BT_TYPE_Q6_K] = bt_cpu_neon_gemm_q6_k_q16,
        [BT_TYPE_Q5_K] = bt_cpu_neon_gemm_q5_k_q16,
        [BT_TYPE_Q5_1] = bt_cpu_neon_gemm_q5_1_q16,
        [BT_TYPE_Q5_0] = bt_cpu_neon_gemm_q5_0_q16,
    },
};
