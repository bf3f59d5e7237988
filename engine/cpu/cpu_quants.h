/* GGUF weight block formats, 8- and 16-bit activation blocks, and the scalar reference kernels on them.
 * These references are the oracle every SIMD kernel is tested against; they favour plainness over speed.
 * Little-endian layouts as stored in GGUF files (fp16 scales kept as raw uint16 bits). Sizes match
 * bt_ggml_type_get(t)->block_bytes (static-asserted in cpu_quants.c). A row of n elements holds n / QK blocks;
 * every function here requires n to be a multiple of the type's block size (checked by callers such as
 * bt_cpu_matmul_check), and none of them can fail. */
#ifndef BATON_ENGINE_CPU_QUANTS_H
#define BATON_ENGINE_CPU_QUANTS_H

#include <float.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/ggml_type.h"

#define BT_QK 32   /* elements per legacy block (Q4_0..Q8_0) and per Q8_32 activation block */
#define BT_QK_K 256 /* elements per K-quant super-block and per Q8_256 activation block */

/* w[i] = d * (q[i] - 8); element j in the low nibble of qs[j], element j+16 in the high nibble */
typedef struct { uint16_t d; uint8_t qs[16]; } bt_block_q4_0;
/* w[i] = d * q[i] + m; nibble order as Q4_0 */
typedef struct { uint16_t d, m; uint8_t qs[16]; } bt_block_q4_1;
/* w[i] = d * (q[i] - 16); low 4 bits as Q4_0, bit 4 of element i is bit i of the little-endian qh word */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } bt_block_q5_0;
/* w[i] = d * q[i] + m; bits as Q5_0 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } bt_block_q5_1;
/* w[i] = d * q[i] */
typedef struct { uint16_t d; int8_t qs[32]; } bt_block_q8_0;
/* 8 sub-blocks of 32: w = (d * sc[j]) * q - (dmin * m[j]), 6-bit sc/m packed in scales[12] (see
 * bt_q4k_scale_min); qs[32*c + l] holds element 64c + l (low nibble) and 64c + 32 + l (high nibble). */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } bt_block_q4_k;
/* as Q4_K plus a fifth bit: bit j of qh[l] is bit 4 of element 32j + l */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } bt_block_q5_k;
/* 16 sub-blocks of 16: w = (d * scales[e/16]) * (q - 32), q 6-bit. For half h (128 elements) and l < 32, shift
 * s < 4: element 128h + 32s + l takes low bits from ql[64h + l + 32(s&1)] (nibble s>>1) and high bits
 * (qh[32h + l] >> 2s) & 3. */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } bt_block_q6_k;

/* Activations quantized for legacy weight types: x[i] ~= d * qs[i], |qs| <= 127, sum = sum of qs, ds = d * sum
 * (the factor of a weight block's min; d and ds adjacent so a kernel loads both at once). sum_lo = the sum of
 * qs[0..15] in a K-quant slice (bt_block_q8_256; Q6_K's halves), 0 otherwise. */
typedef struct { float d, ds; int32_t sum, sum_lo; int8_t qs[BT_QK]; } bt_block_q8_32;
/* Activations quantized for K-quant weight types: a super-block of 256 elements as 8 per-32 blocks (slices) that
 * share the super-block's d, each with its own sum, ds = d * sum and sum_lo. The packed kernels thus address
 * K-quant activations exactly as the legacy types' (one address per row and block: the super-block layout needed
 * three, and its Q4_K kernel ran ~20% slower than Q4_1's). ds: the sum is below 2^21, exact in float, so the
 * product is the one bt_cpu_gemm_packed_ref forms from the sum. */
typedef struct { bt_block_q8_32 s[8]; } bt_block_q8_256;

/* 16-bit activation blocks (the accurate path): as Q8_32 / Q8_256 with |qs| <= 32767. Sums need 32 bits
 * (32 * 32767 < 2^21); the fields before qs keep it 16-byte aligned within a block. */
typedef struct { float d, ds; int32_t sum, sum_lo; int16_t qs[BT_QK]; } bt_block_q16_32;
typedef struct { bt_block_q16_32 s[8]; } bt_block_q16_256;

/* element i (0..255) of a K-quant super-block; a run from it stays within its slice up to the next multiple of 32 */
static inline const int8_t *bt_q8k_qs(const bt_block_q8_256 *a, int i)
{
    return a->s[i >> 5].qs + (i & 31);
}

static inline const int16_t *bt_q16k_qs(const bt_block_q16_256 *a, int i)
{
    return a->s[i >> 5].qs + (i & 31);
}

/* the sum of 16-element run k (0..15) of an 8-bit K-quant super-block */
static inline int32_t bt_q8k_bsum(const bt_block_q8_256 *a, int k)
{
    const bt_block_q8_32 *s = &a->s[k >> 1];
    return k & 1 ? s->sum - s->sum_lo : s->sum_lo;
}

/* Sets every slice's d and ds once its codes, sum and sum_lo are written. */
static inline void bt_q8k_finish(bt_block_q8_256 *y, float d)
{
    for (int s = 0; s < 8; s++) y->s[s].d = d, y->s[s].ds = d * (float)y->s[s].sum;
}

static inline void bt_q16k_finish(bt_block_q16_256 *y, float d)
{
    for (int s = 0; s < 8; s++) y->s[s].d = d, y->s[s].ds = d * (float)y->s[s].sum;
}

/* The inverse scale that quantizes an activation block of scale d (max |x| / 127 or / 32767): 1 / d, or 0 when that is
 * not a finite number (d == 0; d below ~2.9e-39, a block whose max |x| is under ~1e-34, where 1 / d overflows; NaN),
 * so that the block's codes are all 0 rather than a float-to-int conversion of inf or NaN, undefined in C and
 * different on each ISA. Every ISA's quantizers use it (AVX-512's vector form: bt_cpu_avx512_quantize_q16_32). */
static inline float bt_act_inv_scale(float d)
{
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    return id <= FLT_MAX ? id : 0.0f;
}

/* Unpacks the 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block. */
static inline void bt_q4k_scale_min(const uint8_t *scales, int j, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[j + 4] & 0x0f) | ((scales[j - 4] >> 2) & 0x30));
        *m = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 2) & 0x30));
    }
}

/* Activation precision: bits per quantized activation code. 16 (the default, also selected by 0) keeps a quantized
 * dot within ~2e-5 of sum |w * x| of the float result (measured <= 1.3e-5); 8 is faster and up to ~3e-3 off,
 * enough to flip near-tied greedy tokens after 30 layers. */
#define BT_CPU_ACT_BITS_DEFAULT 16

/* Activation formats a weight type's dot product consumes. */
typedef enum bt_cpu_act_fmt {
    BT_ACT_NONE = -1,   /* weight type not supported by these kernels, or bad act_bits */
    BT_ACT_F32 = 0,     /* plain floats (F32, F16, BF16 weights, whatever act_bits says) */
    BT_ACT_Q8_32 = 1,   /* bt_block_q8_32 per 32 elements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), act_bits 8 */
    BT_ACT_Q8_256 = 2,  /* bt_block_q8_256 per 256 elements (Q4_K, Q5_K, Q6_K), act_bits 8 */
    BT_ACT_Q16_32 = 3,  /* bt_block_q16_32 per 32 elements (legacy types), act_bits 16 */
    BT_ACT_Q16_256 = 4, /* bt_block_q16_256 per 256 elements (K-quants), act_bits 16 */
} bt_cpu_act_fmt;

/* Activation format for weight type t at precision act_bits (8, 16, or 0 for 16); BT_ACT_NONE if these kernels
 * do not handle t or act_bits is not 0, 8 or 16. */
bt_cpu_act_fmt bt_cpu_act_format(uint32_t t, int act_bits);

/* Elements per weight block of t (1 for float types), 0 when unsupported. */
int bt_cpu_block_elems(uint32_t t);

/* Bytes of a weight row of n elements of type t; 0 when t is unknown or n is not a multiple of its block. */
size_t bt_cpu_row_bytes(uint32_t t, int64_t n);

/* Bytes of an activation row of n elements prepared for weight type t at precision act_bits (n * 4 for float
 * weight types); 0 when unsupported. A 16-bit row is never smaller than an 8-bit one, so scratch sized for 16
 * serves both. */
size_t bt_cpu_act_row_bytes(uint32_t t, int act_bits, int64_t n);

/* Scalar reference dequantization of one row: y[n] from n elements of type t at x. Bit-identical to gguf-py's
 * gguf.quants.dequantize. Returns 0, or -1 when t is not one of the supported types. */
int bt_cpu_dequantize_row_ref(uint32_t t, int64_t n, const void *x, float *y);

/* Quantizes n floats (n % 256 == 0) to Q4_K: per 32-element sub-block a scale (max - min) / 15 and a min -min(x, 0),
 * both stored as 6-bit multiples of the super-block's fp16 d and dmin, then each code is the nearest 4-bit level
 * under the stored (rounded) scale and min. A plain min/max fit, not llama.cpp's search: a little more error, the
 * same format. NaN inputs give unspecified codes. */
void bt_cpu_quantize_row_q4_k(int64_t n, const float *x, bt_block_q4_k *y);
/* The same fit with 5-bit codes (0..31) for Q5_K. */
void bt_cpu_quantize_row_q5_k(int64_t n, const float *x, bt_block_q5_k *y);
/* Quantizes n floats (n % 32 == 0) to Q5_0: per block d = (the value of largest magnitude) / -16 in fp16, then each
 * code the nearest level q in [0, 31] of d * (q - 16) under that rounded d. NaN inputs give unspecified codes. */
void bt_cpu_quantize_row_q5_0(int64_t n, const float *x, bt_block_q5_0 *y);
/* Quantizes n floats (n % 32 == 0) to Q5_1: per block m = min and d = (max - min) / 31 in fp16, then each code the
 * nearest q in [0, 31] of d * q + m under those rounded values. NaN inputs give unspecified codes. */
void bt_cpu_quantize_row_q5_1(int64_t n, const float *x, bt_block_q5_1 *y);
/* Quantizes n floats (n % 256 == 0) to Q6_K: per 16-element sub-block s = max |x| / 31, stored as an int8 multiple
 * of the super-block's fp16 d = max s / 127, then each value the nearest level q - 32 (q in [0, 63]) under the
 * stored scale. A plain max fit, not llama.cpp's search. NaN inputs give unspecified codes. */
void bt_cpu_quantize_row_q6_k(int64_t n, const float *x, bt_block_q6_k *y);

/* Scalar reference activation quantizers: d = max|x| / 127, qs = round-half-even(x * (1 / d)). x must be finite
 * (a NaN or infinity gives unspecified codes, and different ISAs may then disagree). */
void bt_cpu_quantize_q8_32_ref(int64_t n, const float *x, bt_block_q8_32 *y);   /* y[n/32] */
void bt_cpu_quantize_q8_256_ref(int64_t n, const float *x, bt_block_q8_256 *y); /* y[n/256] */
/* The same with d = max|x| / 32767 and int16 codes. */
void bt_cpu_quantize_q16_32_ref(int64_t n, const float *x, bt_block_q16_32 *y);   /* y[n/32] */
void bt_cpu_quantize_q16_256_ref(int64_t n, const float *x, bt_block_q16_256 *y); /* y[n/256] */

/* Scalar reference dot product of one weight row (n elements of type t) with one activation row in the format
 * bt_cpu_act_format(t, act_bits). Per block: an exact integer dot, then float accumulation in block order.
 * Returns 0 for unsupported types. */
float bt_cpu_vec_dot_ref(uint32_t t, int act_bits, int64_t n, const void *w_row, const void *act_row);

#endif
