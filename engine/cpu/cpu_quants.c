/* Scalar references: dequantization, activation quantization, dot products. Compiled with -ffp-contract=off so
 * the float arithmetic is exactly the one written (dequantization must match gguf-py bit for bit). */
#include "engine/cpu/cpu_quants.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "engine/cpu/cpu_fp16.h"

_Static_assert(sizeof(bt_block_q4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(bt_block_q4_1) == 20, "Q4_1 block");
_Static_assert(sizeof(bt_block_q5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(bt_block_q5_1) == 24, "Q5_1 block");
_Static_assert(sizeof(bt_block_q8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(bt_block_q4_k) == 144, "Q4_K block");
_Static_assert(sizeof(bt_block_q5_k) == 176, "Q5_K block");
_Static_assert(sizeof(bt_block_q6_k) == 210, "Q6_K block");
_Static_assert(sizeof(bt_block_q8_32) == 48, "Q8_32 activation block");
_Static_assert(sizeof(bt_block_q8_256) == 8 * sizeof(bt_block_q8_32), "Q8_256 activation block: 8 Q8_32 slices");
_Static_assert(sizeof(bt_block_q16_256) == 8 * sizeof(bt_block_q16_32), "Q16_256 activation block: 8 Q16_32 slices");

static bt_cpu_act_fmt act_format8(uint32_t t)
{
    switch (t) {
    case BT_TYPE_F32:
    case BT_TYPE_F16:
    case BT_TYPE_BF16: return BT_ACT_F32;
    case BT_TYPE_Q4_0:
    case BT_TYPE_Q4_1:
    case BT_TYPE_Q5_0:
    case BT_TYPE_Q5_1:
    case BT_TYPE_Q8_0: return BT_ACT_Q8_32;
    case BT_TYPE_Q4_K:
    case BT_TYPE_Q5_K:
    case BT_TYPE_Q6_K: return BT_ACT_Q8_256;
    default: return BT_ACT_NONE;
    }
}

bt_cpu_act_fmt bt_cpu_act_format(uint32_t t, int act_bits)
{
    if (act_bits == 0) act_bits = BT_CPU_ACT_BITS_DEFAULT;
    if (act_bits != 8 && act_bits != 16) return BT_ACT_NONE;
    bt_cpu_act_fmt f = act_format8(t);
    if (act_bits == 8 || f == BT_ACT_NONE || f == BT_ACT_F32) return f;
    return f == BT_ACT_Q8_32 ? BT_ACT_Q16_32 : BT_ACT_Q16_256;
}

int bt_cpu_block_elems(uint32_t t)
{
    switch (act_format8(t)) {
    case BT_ACT_F32: return 1;
    case BT_ACT_Q8_32: return BT_QK;
    case BT_ACT_Q8_256: return BT_QK_K;
    default: return 0;
    }
}

size_t bt_cpu_row_bytes(uint32_t t, int64_t n)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    int be = bt_cpu_block_elems(t);
    if (!ti || be == 0 || n < 0 || n % be) return 0;
    return (size_t)(n / be) * ti->block_bytes;
}

size_t bt_cpu_act_row_bytes(uint32_t t, int act_bits, int64_t n)
{
    if (n < 0) return 0;
    switch (bt_cpu_act_format(t, act_bits)) {
    case BT_ACT_F32: return (size_t)n * sizeof(float);
    case BT_ACT_Q8_32: return (size_t)(n / BT_QK) * sizeof(bt_block_q8_32);
    case BT_ACT_Q8_256: return (size_t)(n / BT_QK_K) * sizeof(bt_block_q8_256);
    case BT_ACT_Q16_32: return (size_t)(n / BT_QK) * sizeof(bt_block_q16_32);
    case BT_ACT_Q16_256: return (size_t)(n / BT_QK_K) * sizeof(bt_block_q16_256);
    default: return 0;
    }
}

/* ---- dequantization ---- */

static void dequant_q4_0(int64_t nb, const bt_block_q4_0 *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK) {
        float d = bt_fp16_to_f32(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[i].qs[j] & 0x0f) - 8);
            y[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(int64_t nb, const bt_block_q4_1 *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK) {
        float d = bt_fp16_to_f32(b[i].d), m = bt_fp16_to_f32(b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[i].qs[j] & 0x0f) + m;
            y[j + 16] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

static uint32_t load_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void dequant_q5_0(int64_t nb, const bt_block_q5_0 *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK) {
        float d = bt_fp16_to_f32(b[i].d);
        uint32_t qh = load_u32le(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
            int hi = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = d * (float)(lo - 16);
            y[j + 16] = d * (float)(hi - 16);
        }
    }
}

static void dequant_q5_1(int64_t nb, const bt_block_q5_1 *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK) {
        float d = bt_fp16_to_f32(b[i].d), m = bt_fp16_to_f32(b[i].m);
        uint32_t qh = load_u32le(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
            int hi = (b[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            y[j] = d * (float)lo + m;
            y[j + 16] = d * (float)hi + m;
        }
    }
}

static void dequant_q8_0(int64_t nb, const bt_block_q8_0 *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK) {
        float d = bt_fp16_to_f32(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

static void dequant_q4_k(int64_t nb, const bt_block_q4_k *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK_K) {
        float d = bt_fp16_to_f32(b[i].d), dmin = bt_fp16_to_f32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            bt_q4k_scale_min(b[i].scales, j, &sc, &m);
            float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = b[i].qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)((q[l] >> shift) & 0x0f) - ml;
        }
    }
}

static void dequant_q5_k(int64_t nb, const bt_block_q5_k *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK_K) {
        float d = bt_fp16_to_f32(b[i].d), dmin = bt_fp16_to_f32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            bt_q4k_scale_min(b[i].scales, j, &sc, &m);
            float dl = d * (float)sc, ml = dmin * (float)m;
            const uint8_t *q = b[i].qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            for (int l = 0; l < 32; l++) {
                int v = ((q[l] >> shift) & 0x0f) | ((b[i].qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dl * (float)v - ml;
            }
        }
    }
}

/* 6-bit value of element e (0..255) of a Q6_K block, before the -32 offset */
static inline int q6k_value(const bt_block_q6_k *b, int e)
{
    int h = e / 128, s = (e % 128) / 32, l = e % 32;
    int lo = (b->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0f;
    int hi = (b->qh[32 * h + l] >> (2 * s)) & 3;
    return lo | hi << 4;
}

static void dequant_q6_k(int64_t nb, const bt_block_q6_k *b, float *y)
{
    for (int64_t i = 0; i < nb; i++, y += BT_QK_K) {
        float d = bt_fp16_to_f32(b[i].d);
        for (int e = 0; e < BT_QK_K; e++) {
            float dl = d * (float)b[i].scales[e / 16];
            y[e] = dl * (float)(q6k_value(&b[i], e) - 32);
        }
    }
}

int bt_cpu_dequantize_row_ref(uint32_t t, int64_t n, const void *x, float *y)
{
    int64_t nb32 = n / BT_QK, nb256 = n / BT_QK_K;
    switch (t) {
    case BT_TYPE_F32: memcpy(y, x, (size_t)n * sizeof(float)); return 0;
    case BT_TYPE_F16:
        for (int64_t i = 0; i < n; i++) y[i] = bt_fp16_to_f32(((const uint16_t *)x)[i]);
        return 0;
    case BT_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) y[i] = bt_bf16_to_f32(((const uint16_t *)x)[i]);
        return 0;
    case BT_TYPE_Q4_0: dequant_q4_0(nb32, x, y); return 0;
    case BT_TYPE_Q4_1: dequant_q4_1(nb32, x, y); return 0;
    case BT_TYPE_Q5_0: dequant_q5_0(nb32, x, y); return 0;
    case BT_TYPE_Q5_1: dequant_q5_1(nb32, x, y); return 0;
    case BT_TYPE_Q8_0: dequant_q8_0(nb32, x, y); return 0;
    case BT_TYPE_Q4_K: dequant_q4_k(nb256, x, y); return 0;
    case BT_TYPE_Q5_K: dequant_q5_k(nb256, x, y); return 0;
    case BT_TYPE_Q6_K: dequant_q6_k(nb256, x, y); return 0;
    default: return -1;
    }
}

/* ---- activation quantization ---- */

/* round to nearest, ties to even, for |v| < 2^22 (the SIMD paths' cvtps rounding) */
static inline int round_even(float v)
{
    return (int)((v + 12582912.0f) - 12582912.0f);
}

static float abs_max(const float *x, int n)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* Codes of 32 elements with the inverse scale id (bt_act_inv_scale), their sum and the sum of the first 16. At 16
 * bits d = max|x| / 32767 and |x * (1 / d)| <= 32767 * (1 + 2^-22) < 32767.5, so codes stay within +-32767. */
#define ACT_CODES(name, T)                                                                                     \
    static void name(const float *x, float id, T *q, int32_t *sum, int32_t *sum_lo)                            \
    {                                                                                                          \
        int32_t s = 0;                                                                                         \
        for (int i = 0; i < BT_QK; i++) {                                                                      \
            q[i] = (T)round_even(x[i] * id);                                                                   \
            s += q[i];                                                                                         \
            if (i == 15) *sum_lo = s;                                                                          \
        }                                                                                                      \
        *sum = s;                                                                                              \
    }
ACT_CODES(codes8, int8_t)
ACT_CODES(codes16, int16_t)

/* Per-32 blocks (d = max|x| / maxq, ds = d * sum, sum_lo 0; |sum| < 2^21 at 16 bits: ds is exact) and K-quant
 * super-blocks (8 such slices under the super-block's d) at 8 or 16 bits. */
#define ACT_QUANT_REF(bits, maxq)                                                                              \
    void bt_cpu_quantize_q##bits##_32_ref(int64_t n, const float *x, bt_block_q##bits##_32 *y)                 \
    {                                                                                                          \
        for (int64_t i = 0; i < n / BT_QK; i++) {                                                              \
            const float *xb = x + i * BT_QK;                                                                   \
            y[i].d = abs_max(xb, BT_QK) / (maxq);                                                              \
            codes##bits(xb, bt_act_inv_scale(y[i].d), y[i].qs, &y[i].sum, &y[i].sum_lo);                       \
            y[i].ds = y[i].d * (float)y[i].sum;                                                                \
            y[i].sum_lo = 0;                                                                                   \
        }                                                                                                      \
    }                                                                                                          \
    void bt_cpu_quantize_q##bits##_256_ref(int64_t n, const float *x, bt_block_q##bits##_256 *y)               \
    {                                                                                                          \
        for (int64_t i = 0; i < n / BT_QK_K; i++) {                                                            \
            const float *xb = x + i * BT_QK_K;                                                                 \
            float d = abs_max(xb, BT_QK_K) / (maxq), id = bt_act_inv_scale(d);                                 \
            for (int s = 0; s < 8; s++)                                                                        \
                codes##bits(xb + BT_QK * s, id, y[i].s[s].qs, &y[i].s[s].sum, &y[i].s[s].sum_lo);              \
            bt_q##bits##k_finish(&y[i], d);                                                                    \
        }                                                                                                      \
    }
ACT_QUANT_REF(8, 127.0f)
ACT_QUANT_REF(16, 32767.0f)

/* ---- dot products ---- */

static float dot_q4_0(int64_t nb, const bt_block_q4_0 *w, const bt_block_q8_32 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++)
            s += ((w[i].qs[j] & 0x0f) - 8) * a[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * a[i].qs[j + 16];
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)s;
    }
    return acc;
}

static float dot_q4_1(int64_t nb, const bt_block_q4_1 *w, const bt_block_q8_32 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += (w[i].qs[j] & 0x0f) * a[i].qs[j] + (w[i].qs[j] >> 4) * a[i].qs[j + 16];
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)s + bt_fp16_to_f32(w[i].m) * a[i].ds;
    }
    return acc;
}

static float dot_q5_0(int64_t nb, const bt_block_q5_0 *w, const bt_block_q8_32 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        uint32_t qh = load_u32le(w[i].qh);
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (w[i].qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
            int hi = (w[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            s += (lo - 16) * a[i].qs[j] + (hi - 16) * a[i].qs[j + 16];
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)s;
    }
    return acc;
}

static float dot_q5_1(int64_t nb, const bt_block_q5_1 *w, const bt_block_q8_32 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        uint32_t qh = load_u32le(w[i].qh);
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (w[i].qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
            int hi = (w[i].qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            s += lo * a[i].qs[j] + hi * a[i].qs[j + 16];
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)s + bt_fp16_to_f32(w[i].m) * a[i].ds;
    }
    return acc;
}

static float dot_q8_0(int64_t nb, const bt_block_q8_0 *w, const bt_block_q8_32 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t s = 0;
        for (int j = 0; j < 32; j++) s += w[i].qs[j] * a[i].qs[j];
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)s;
    }
    return acc;
}

static float dot_q4_k(int64_t nb, const bt_block_q4_k *w, const bt_block_q8_256 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            bt_q4k_scale_min(w[i].scales, j, &sc, &m);
            const uint8_t *q = w[i].qs + 32 * (j / 2);
            int shift = 4 * (j & 1), s = 0;
            for (int l = 0; l < 32; l++) s += ((q[l] >> shift) & 0x0f) * a[i].s[j].qs[l];
            sumi += sc * s;
            summ += m * a[i].s[j].sum;
        }
        const float ad = a[i].s[0].d;
        acc += bt_fp16_to_f32(w[i].d) * ad * (float)sumi - bt_fp16_to_f32(w[i].dmin) * ad * (float)summ;
    }
    return acc;
}

static float dot_q5_k(int64_t nb, const bt_block_q5_k *w, const bt_block_q8_256 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            bt_q4k_scale_min(w[i].scales, j, &sc, &m);
            const uint8_t *q = w[i].qs + 32 * (j / 2);
            int shift = 4 * (j & 1), s = 0;
            for (int l = 0; l < 32; l++) {
                int v = ((q[l] >> shift) & 0x0f) | ((w[i].qh[l] >> j) & 1) << 4;
                s += v * a[i].s[j].qs[l];
            }
            sumi += sc * s;
            summ += m * a[i].s[j].sum;
        }
        const float ad = a[i].s[0].d;
        acc += bt_fp16_to_f32(w[i].d) * ad * (float)sumi - bt_fp16_to_f32(w[i].dmin) * ad * (float)summ;
    }
    return acc;
}

static float dot_q6_k(int64_t nb, const bt_block_q6_k *w, const bt_block_q8_256 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t sumi = 0;
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += (q6k_value(&w[i], 16 * k + l) - 32) * bt_q8k_qs(&a[i], 16 * k)[l];
            sumi += w[i].scales[k] * s;
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].s[0].d * (float)sumi;
    }
    return acc;
}

/* 16-bit activations. Weight code of element e of legacy block b, offset included (Q4_0: q - 8, Q5_0: q - 16). */
static inline int legacy_code(uint32_t t, const void *w, int64_t b, int e)
{
    int j = e & 15, hi = e >> 4;
    switch (t) {
    case BT_TYPE_Q4_0: {
        const bt_block_q4_0 *x = (const bt_block_q4_0 *)w + b;
        return ((x->qs[j] >> (4 * hi)) & 0x0f) - 8;
    }
    case BT_TYPE_Q4_1: {
        const bt_block_q4_1 *x = (const bt_block_q4_1 *)w + b;
        return (x->qs[j] >> (4 * hi)) & 0x0f;
    }
    case BT_TYPE_Q5_0: {
        const bt_block_q5_0 *x = (const bt_block_q5_0 *)w + b;
        return (((x->qs[j] >> (4 * hi)) & 0x0f) | (int)((load_u32le(x->qh) >> e) & 1) << 4) - 16;
    }
    case BT_TYPE_Q5_1: {
        const bt_block_q5_1 *x = (const bt_block_q5_1 *)w + b;
        return ((x->qs[j] >> (4 * hi)) & 0x0f) | (int)((load_u32le(x->qh) >> e) & 1) << 4;
    }
    default: return ((const bt_block_q8_0 *)w + b)->qs[e]; /* Q8_0 */
    }
}

/* Legacy types: per block s = sum q_w * q_a in int32 (|q_w| <= 128, |q_a| <= 32767: |s| <= 32 * 128 * 32767
 * < 2^28), then acc += d_w * d_a * s (+ m_w * d_a * sum q_a for Q4_1/Q5_1), as the 8-bit path. The weight
 * scales d, m are the first fp16 fields of every legacy block. */
static float dot16_legacy(uint32_t t, int64_t nb, const void *w, const bt_block_q16_32 *a)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    int has_min = t == BT_TYPE_Q4_1 || t == BT_TYPE_Q5_1;
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *blk = (const uint8_t *)w + (size_t)i * ti->block_bytes;
        uint16_t d16, m16;
        memcpy(&d16, blk, 2);
        int32_t s = 0;
        for (int e = 0; e < BT_QK; e++) s += legacy_code(t, w, i, e) * a[i].qs[e];
        if (has_min) {
            memcpy(&m16, blk + 2, 2);
            acc += bt_fp16_to_f32(d16) * a[i].d * (float)s + bt_fp16_to_f32(m16) * a[i].ds;
        } else {
            acc += bt_fp16_to_f32(d16) * a[i].d * (float)s;
        }
    }
    return acc;
}

/* Q4_K / Q5_K: per 32-element sub-block s_j = sum q * q_a in int32 (|s_j| <= 32 * 31 * 32767 < 2^25); the
 * super-block sum of sc_j * s_j (sc_j <= 63) and of m_j * bsum_j go through int64 (up to 8 * 63 * 2^25 > 2^31),
 * so the integer part is exact; each becomes a float once per super-block. */
static float dot16_qk45(int has_qh, int64_t nb, const void *w, const bt_block_q16_256 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *scales, *qs, *qh = NULL;
        uint16_t d16, dmin16;
        if (has_qh) {
            const bt_block_q5_k *b = (const bt_block_q5_k *)w + i;
            scales = b->scales, qs = b->qs, qh = b->qh, d16 = b->d, dmin16 = b->dmin;
        } else {
            const bt_block_q4_k *b = (const bt_block_q4_k *)w + i;
            scales = b->scales, qs = b->qs, d16 = b->d, dmin16 = b->dmin;
        }
        int64_t sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            bt_q4k_scale_min(scales, j, &sc, &m);
            const uint8_t *q = qs + 32 * (j / 2);
            int shift = 4 * (j & 1);
            int32_t s = 0;
            for (int l = 0; l < 32; l++) {
                int v = (q[l] >> shift) & 0x0f;
                if (has_qh) v |= ((qh[l] >> j) & 1) << 4;
                s += v * a[i].s[j].qs[l];
            }
            sumi += (int64_t)sc * s;
            summ += (int64_t)m * a[i].s[j].sum;
        }
        acc += bt_fp16_to_f32(d16) * a[i].s[0].d * (float)sumi - bt_fp16_to_f32(dmin16) * a[i].s[0].d * (float)summ;
    }
    return acc;
}

/* Q6_K: per 16-element sub-block s_k = sum (q - 32) * q_a, |s_k| <= 16 * 32 * 32767 < 2^24; sum of scale_k * s_k
 * (|scale| <= 128) in int64. */
static float dot16_q6_k(int64_t nb, const bt_block_q6_k *w, const bt_block_q16_256 *a)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int64_t sumi = 0;
        for (int k = 0; k < 16; k++) {
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += (q6k_value(&w[i], 16 * k + l) - 32) * bt_q16k_qs(&a[i], 16 * k)[l];
            sumi += (int64_t)w[i].scales[k] * s;
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].s[0].d * (float)sumi;
    }
    return acc;
}

float bt_cpu_vec_dot_ref(uint32_t t, int act_bits, int64_t n, const void *w_row, const void *act_row)
{
    switch (bt_cpu_act_format(t, act_bits)) {
    case BT_ACT_Q16_32: return dot16_legacy(t, n / BT_QK, w_row, act_row);
    case BT_ACT_Q16_256:
        if (t == BT_TYPE_Q6_K) return dot16_q6_k(n / BT_QK_K, w_row, act_row);
        return dot16_qk45(t == BT_TYPE_Q5_K, n / BT_QK_K, w_row, act_row);
    case BT_ACT_NONE: return 0.0f;
    default: break;
    }
    const float *xf = act_row;
    float acc = 0.0f;
    switch (t) {
    case BT_TYPE_F32:
        for (int64_t i = 0; i < n; i++) acc += ((const float *)w_row)[i] * xf[i];
        return acc;
    case BT_TYPE_F16:
        for (int64_t i = 0; i < n; i++) acc += bt_fp16_to_f32(((const uint16_t *)w_row)[i]) * xf[i];
        return acc;
    case BT_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) acc += bt_bf16_to_f32(((const uint16_t *)w_row)[i]) * xf[i];
        return acc;
    case BT_TYPE_Q4_0: return dot_q4_0(n / BT_QK, w_row, act_row);
    case BT_TYPE_Q4_1: return dot_q4_1(n / BT_QK, w_row, act_row);
    case BT_TYPE_Q5_0: return dot_q5_0(n / BT_QK, w_row, act_row);
    case BT_TYPE_Q5_1: return dot_q5_1(n / BT_QK, w_row, act_row);
    case BT_TYPE_Q8_0: return dot_q8_0(n / BT_QK, w_row, act_row);
    case BT_TYPE_Q4_K: return dot_q4_k(n / BT_QK_K, w_row, act_row);
    case BT_TYPE_Q5_K: return dot_q5_k(n / BT_QK_K, w_row, act_row);
    case BT_TYPE_Q6_K: return dot_q6_k(n / BT_QK_K, w_row, act_row);
    default: return 0.0f;
    }
}

/* The 12 scale bytes of a Q4_K super-block from its 8 six-bit scales and mins (inverse of bt_q4k_scale_min). */
static void q4k_pack_scales(const uint8_t sc[8], const uint8_t m[8], uint8_t out[12])
{
    memset(out, 0, 12);
    for (int j = 0; j < 4; j++) {
        out[j] = sc[j] & 63;
        out[j + 4] = m[j] & 63;
    }
    for (int j = 4; j < 8; j++) {
        out[j + 4] = (uint8_t)((sc[j] & 15) | ((m[j] & 15) << 4));
        out[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        out[j] |= (uint8_t)((m[j] >> 4) << 6);
    }
}

static uint8_t round_6bit(float v)
{
    long r = lrintf(v);
    return (uint8_t)(r < 0 ? 0 : r > 63 ? 63 : r);
}

/* The 32 values x of a 5-bit block as codes q = clamp(round((x - m) * id) + off, 0, 31) into qs (low 4 bits, element
 * j and j + 16 in one byte) and qh (bit 4 of element j at bit j, little endian): Q5_0 (m 0, off 16) and Q5_1 (off 0). */
static void pack_5bit(const float *x, float m, float id, int off, uint8_t qs[16], uint8_t qh[4])
{
    uint32_t h = 0;
    for (int j = 0; j < 16; j++) {
        int lo = (int)lrintf((x[j] - m) * id) + off, hi = (int)lrintf((x[j + 16] - m) * id) + off;
        lo = lo < 0 ? 0 : lo > 31 ? 31 : lo;
        hi = hi < 0 ? 0 : hi > 31 ? 31 : hi;
        qs[j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
        h |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

void bt_cpu_quantize_row_q5_0(int64_t n, const float *x, bt_block_q5_0 *y)
{
    for (int64_t b = 0; b < n / BT_QK; b++, x += BT_QK) {
        float big = 0;
        for (int i = 0; i < BT_QK; i++) big = fabsf(x[i]) > fabsf(big) ? x[i] : big;
        y[b].d = bt_f32_to_fp16(big / -16.0f);
        float d = bt_fp16_to_f32(y[b].d);
        pack_5bit(x, 0.0f, d != 0.0f ? 1.0f / d : 0.0f, 16, y[b].qs, y[b].qh);
    }
}

void bt_cpu_quantize_row_q5_1(int64_t n, const float *x, bt_block_q5_1 *y)
{
    for (int64_t b = 0; b < n / BT_QK; b++, x += BT_QK) {
        float lo = x[0], hi = x[0];
        for (int i = 1; i < BT_QK; i++) {
            lo = x[i] < lo ? x[i] : lo;
            hi = x[i] > hi ? x[i] : hi;
        }
        y[b].d = bt_f32_to_fp16((hi - lo) / 31.0f);
        y[b].m = bt_f32_to_fp16(lo);
        float d = bt_fp16_to_f32(y[b].d);
        pack_5bit(x, bt_fp16_to_f32(y[b].m), d != 0.0f ? 1.0f / d : 0.0f, 0, y[b].qs, y[b].qh);
    }
}

/* Q4_K and Q5_K: per 32-element sub-block a min/max fit with `levels` steps (15 or 31), stored as 6-bit multiples of
 * the super-block's fp16 d and dmin, then each code the nearest level under the stored scale and min. */
static void fit_qk45(const float *x, int levels, uint16_t *d16, uint16_t *dmin16, uint8_t sc[8], uint8_t m[8],
                     uint8_t q[BT_QK_K])
{
    float scale[8], mins[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float lo = x[32 * j], hi = x[32 * j];
        for (int i = 1; i < 32; i++) {
            lo = x[32 * j + i] < lo ? x[32 * j + i] : lo;
            hi = x[32 * j + i] > hi ? x[32 * j + i] : hi;
        }
        if (lo > 0) lo = 0; /* the min only subtracts */
        scale[j] = (hi - lo) / (float)levels;
        mins[j] = -lo;
        max_scale = scale[j] > max_scale ? scale[j] : max_scale;
        max_min = mins[j] > max_min ? mins[j] : max_min;
    }
    *d16 = bt_f32_to_fp16(max_scale / 63.0f);
    *dmin16 = bt_f32_to_fp16(max_min / 63.0f);
    float d = bt_fp16_to_f32(*d16), dmin = bt_fp16_to_f32(*dmin16);
    for (int j = 0; j < 8; j++) {
        sc[j] = d > 0 ? round_6bit(scale[j] / d) : 0;
        m[j] = dmin > 0 ? round_6bit(mins[j] / dmin) : 0;
        float es = d * (float)sc[j], em = dmin * (float)m[j];
        for (int i = 0; i < 32; i++) {
            long v = es > 0 ? lrintf((x[32 * j + i] + em) / es) : 0;
            q[32 * j + i] = (uint8_t)(v < 0 ? 0 : v > levels ? levels : v);
        }
    }
}

void bt_cpu_quantize_row_q4_k(int64_t n, const float *x, bt_block_q4_k *y)
{
    for (int64_t b = 0; b < n / BT_QK_K; b++, x += BT_QK_K) {
        uint8_t sc[8], m[8], q[BT_QK_K];
        fit_qk45(x, 15, &y[b].d, &y[b].dmin, sc, m, q);
        q4k_pack_scales(sc, m, y[b].scales);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) y[b].qs[32 * c + l] = (uint8_t)(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
    }
}

void bt_cpu_quantize_row_q5_k(int64_t n, const float *x, bt_block_q5_k *y)
{
    for (int64_t b = 0; b < n / BT_QK_K; b++, x += BT_QK_K) {
        uint8_t sc[8], m[8], q[BT_QK_K];
        fit_qk45(x, 31, &y[b].d, &y[b].dmin, sc, m, q);
        q4k_pack_scales(sc, m, y[b].scales);
        memset(y[b].qh, 0, sizeof y[b].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                const uint8_t lo = q[64 * c + l], hi = q[64 * c + 32 + l]; /* sub-blocks 2c and 2c + 1 */
                y[b].qs[32 * c + l] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                y[b].qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
            }
    }
}

void bt_cpu_quantize_row_q6_k(int64_t n, const float *x, bt_block_q6_k *y)
{
    for (int64_t b = 0; b < n / BT_QK_K; b++, x += BT_QK_K) {
        float sub[16], big = 0;
        for (int k = 0; k < 16; k++) {
            float amax = 0;
            for (int i = 0; i < 16; i++) amax = fabsf(x[16 * k + i]) > amax ? fabsf(x[16 * k + i]) : amax;
            sub[k] = amax / 31.0f; /* levels -32..31: 31 steps on the positive side */
            big = sub[k] > big ? sub[k] : big;
        }
        y[b].d = bt_f32_to_fp16(big / 127.0f);
        float d = bt_fp16_to_f32(y[b].d);
        uint8_t q[BT_QK_K];
        for (int k = 0; k < 16; k++) {
            long sc = d > 0 ? lrintf(sub[k] / d) : 0;
            y[b].scales[k] = (int8_t)(sc > 127 ? 127 : sc);
            float es = d * (float)y[b].scales[k];
            for (int i = 0; i < 16; i++) {
                long v = es > 0 ? lrintf(x[16 * k + i] / es) : 0;
                q[16 * k + i] = (uint8_t)((v < -32 ? -32 : v > 31 ? 31 : v) + 32);
            }
        }
        /* the inverse of q6k_value: low 4 bits in ql, high 2 in qh */
        memset(y[b].ql, 0, sizeof y[b].ql);
        memset(y[b].qh, 0, sizeof y[b].qh);
        for (int e = 0; e < BT_QK_K; e++) {
            int h = e / 128, sub_i = (e % 128) / 32, l = e % 32;
            y[b].ql[64 * h + 32 * (sub_i & 1) + l] |= (uint8_t)((q[e] & 15) << (4 * (sub_i >> 1)));
            y[b].qh[32 * h + l] |= (uint8_t)((q[e] >> 4) << (2 * sub_i));
        }
    }
}
