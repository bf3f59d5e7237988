/* Scalar references: dequantization, activation quantization, dot products. Compiled with -ffp-contract=off so
 * the float arithmetic is exactly the one written (dequantization must match gguf-py bit for bit). */
#include "engine/cpu/cpu_quants.h"

#include <math.h>

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
_Static_assert(sizeof(bt_block_q8_256) == 292, "Q8_256 activation block");

bt_cpu_act_fmt bt_cpu_act_format(uint32_t t)
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

int bt_cpu_block_elems(uint32_t t)
{
    switch (bt_cpu_act_format(t)) {
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

size_t bt_cpu_act_row_bytes(uint32_t t, int64_t n)
{
    switch (bt_cpu_act_format(t)) {
    case BT_ACT_F32: return (size_t)n * sizeof(float);
    case BT_ACT_Q8_32: return (size_t)(n / BT_QK) * sizeof(bt_block_q8_32);
    case BT_ACT_Q8_256: return (size_t)(n / BT_QK_K) * sizeof(bt_block_q8_256);
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

static float quantize_block(const float *x, int n, int8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)round_even(x[i] * id);
    return d;
}

void bt_cpu_quantize_q8_32_ref(int64_t n, const float *x, bt_block_q8_32 *y)
{
    for (int64_t i = 0; i < n / BT_QK; i++) {
        y[i].d = quantize_block(x + i * BT_QK, BT_QK, y[i].qs);
        int32_t s = 0;
        for (int j = 0; j < BT_QK; j++) s += y[i].qs[j];
        y[i].sum = s;
        y[i].ds = y[i].d * (float)s;
        y[i].reserved = 0;
    }
}

void bt_cpu_quantize_q8_256_ref(int64_t n, const float *x, bt_block_q8_256 *y)
{
    for (int64_t i = 0; i < n / BT_QK_K; i++) {
        y[i].d = quantize_block(x + i * BT_QK_K, BT_QK_K, y[i].qs);
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y[i].qs[16 * k + j];
            y[i].bsums[k] = (int16_t)s;
        }
    }
}

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
            for (int l = 0; l < 32; l++) s += ((q[l] >> shift) & 0x0f) * a[i].qs[32 * j + l];
            sumi += sc * s;
            summ += m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)sumi - bt_fp16_to_f32(w[i].dmin) * a[i].d * (float)summ;
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
                s += v * a[i].qs[32 * j + l];
            }
            sumi += sc * s;
            summ += m * (a[i].bsums[2 * j] + a[i].bsums[2 * j + 1]);
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)sumi - bt_fp16_to_f32(w[i].dmin) * a[i].d * (float)summ;
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
            for (int l = 0; l < 16; l++) s += (q6k_value(&w[i], 16 * k + l) - 32) * a[i].qs[16 * k + l];
            sumi += w[i].scales[k] * s;
        }
        acc += bt_fp16_to_f32(w[i].d) * a[i].d * (float)sumi;
    }
    return acc;
}

float bt_cpu_vec_dot_ref(uint32_t t, int64_t n, const void *w_row, const void *act_row)
{
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
