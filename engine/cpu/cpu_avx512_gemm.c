/* AVX-512 VNNI tiled GEMM over packed weights (layouts in cpu_gemm.c): a 16-row group times up to 4 activation
 * rows. Each 512-bit code vector holds 4 codes of each of the 16 rows; the matching 4 activation codes (8-bit) or
 * 2 (16-bit) are broadcast, so vpdpbusd / vpdpwssd leave each row's block dot in its own lane with no horizontal
 * sum. A block's codes are decoded once and used for every activation row of the tile. Per lane and block the
 * integer dot is exact (two chains added, so their order is irrelevant), then converted and accumulated exactly as
 * bt_cpu_gemm_packed_ref does, whatever nr is. Lane bounds per block: 8-bit 32 * 255 * 127 < 2^21, 16-bit
 * 32 * 128 * 32767 < 2^28 (Q8_0; beyond 2^24 the conversion rounds, identically in the reference). */
#include <immintrin.h>
#include <string.h>

#include "engine/cpu/cpu_impl.h"

#define AI static inline __attribute__((always_inline))

#define ACT8(r, b) ((const bt_block_q8_32 *)((const char *)act + (size_t)(r) * act_stride) + (b))
#define ACT16(r, b) ((const bt_block_q16_32 *)((const char *)act + (size_t)(r) * act_stride) + (b))

/* acc + (u8 x s8 | s16 x s16) products of w with the 4-byte word at p broadcast: written as inline asm because
 * GCC keeps the broadcast as a separate load instead of the instruction's {1to16} memory operand */
AI __m512i dpbusd_b(__m512i acc, __m512i w, const void *p)
{
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

AI __m512i dpwssd_b(__m512i acc, __m512i w, const void *p)
{
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

#define GEMM_ARGS int64_t n, const void *group, const void *act, size_t act_stride, const int NR, float *out, \
                  size_t out_stride, int n_valid

/* Block b of a packed group (layout in cpu_gemm.c): its 16 d (then 16 m for Q4_1) and its code vectors. */
AI const uint8_t *unit_base(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    return type == BT_TYPE_Q4_1 ? group + (size_t)b * (64 + cb) : group + (size_t)(b >> 1) * (64 + 2 * cb);
}

AI const uint16_t *blk_scales(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    return (const uint16_t *)(unit_base(group, b, type, cb) + (type == BT_TYPE_Q4_1 ? 0 : 32 * (b & 1)));
}

AI const uint8_t *blk_codes(const uint8_t *group, int64_t b, const int type, const size_t cb)
{
    return unit_base(group, b, type, cb) + 64 + (type == BT_TYPE_Q4_1 ? 0 : cb * (size_t)(b & 1));
}

AI void store_rows(const int NR, const int mins, const __m512 *acc, const __m512 *accm, float *out,
                   size_t out_stride, int n_valid)
{
    const __mmask16 k = (__mmask16)((1u << n_valid) - 1);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        _mm512_mask_storeu_ps(out + (size_t)r * out_stride, k, mins ? _mm512_add_ps(acc[r], accm[r]) : acc[r]);
}

/* 8-bit activations: 8 code vectors per block (Q4: low and high nibbles of 4 loaded vectors). */
AI void gemm8_kernel(GEMM_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    const size_t cb = type == BT_TYPE_Q8_0 ? 512 : 256;
    const int mins = type == BT_TYPE_Q4_1, off = type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q8_0 ? 128 : 0;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[BT_CPU_MAX_NR], accm[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *cp = blk_codes(group, b, type, cb);
        const uint16_t *sc = blk_scales(group, b, type, cb);
        __m512i c[8];
        if (type == BT_TYPE_Q8_0) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) c[k] = _mm512_load_si512(cp + 64 * k);
        } else {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m512i v = _mm512_load_si512(cp + 64 * k);
                c[k] = _mm512_and_si512(v, m4);
                c[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sc));
        const __m512 mw = mins ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + BT_CPU_PACK_ROWS)))
                               : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q8_32 *a = ACT8(r, b);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                s0 = dpbusd_b(s0, c[k], a->qs + 4 * k);
                s1 = dpbusd_b(s1, c[k + 1], a->qs + 4 * k + 4);
            }
            __m512i s = _mm512_add_epi32(s0, s1);
            if (off) s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * a->sum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a->d)), acc[r]);
            if (mins) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->ds), accm[r]);
        }
    }
    store_rows(NR, mins, acc, accm, out, out_stride, n_valid);
}

/* 16-bit activations: 16 int16-pair vectors per block, decoded in two halves of 8 to stay within the registers.
 * Vector i of a half pairs with activation dword idx[i] (dword = 2 int16 codes). */
AI void gemm16_kernel(GEMM_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    const size_t cb = type == BT_TYPE_Q8_0 ? 512 : 256;
    const int mins = type == BT_TYPE_Q4_1, off = type == BT_TYPE_Q4_0 ? 8 : 0;
    const __m512i m4 = _mm512_set1_epi32(0x000f000f);
    __m512 acc[BT_CPU_MAX_NR], accm[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *cp = blk_codes(group, b, type, cb);
        const uint16_t *sc = blk_scales(group, b, type, cb);
        __m512i s0[BT_CPU_MAX_NR], s1[BT_CPU_MAX_NR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) s0[r] = s1[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m512i c[8];
            int idx[8];
            if (type == BT_TYPE_Q8_0) {
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) { /* vector k: codes 4k .. 4k+3 */
                    int k = 4 * h + q;
                    __m512i v = _mm512_load_si512(cp + 64 * k);
                    c[2 * q] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), idx[2 * q] = 2 * k;
                    c[2 * q + 1] = _mm512_srai_epi16(v, 8), idx[2 * q + 1] = 2 * k + 1;
                }
            } else {
#pragma GCC unroll 2
                for (int q = 0; q < 2; q++) { /* vector k: low nibbles codes 4k .. 4k+3, high ones 16 + same */
                    int k = 2 * h + q;
                    __m512i v = _mm512_load_si512(cp + 64 * k);
                    c[4 * q] = _mm512_and_si512(v, m4), idx[4 * q] = 2 * k;
                    c[4 * q + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), m4), idx[4 * q + 1] = 2 * k + 1;
                    c[4 * q + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), idx[4 * q + 2] = 2 * k + 8;
                    c[4 * q + 3] = _mm512_srli_epi16(v, 12), idx[4 * q + 3] = 2 * k + 9;
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const int16_t *aq = ACT16(r, b)->qs;
#pragma GCC unroll 4
                for (int i = 0; i < 8; i += 2) {
                    s0[r] = dpwssd_b(s0[r], c[i], aq + 2 * idx[i]);
                    s1[r] = dpwssd_b(s1[r], c[i + 1], aq + 2 * idx[i + 1]);
                }
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sc));
        const __m512 mw = mins ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + BT_CPU_PACK_ROWS)))
                               : _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q16_32 *a = ACT16(r, b);
            __m512i s = _mm512_add_epi32(s0[r], s1[r]);
            if (off) s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * a->sum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a->d)), acc[r]);
            if (mins) accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->ds), accm[r]);
        }
    }
    store_rows(NR, mins, acc, accm, out, out_stride, n_valid);
}

#define GEMM_DISPATCH(kernel, TYPE)                                                                            \
    switch (nr) {                                                                                              \
    case 1: kernel(n, group, act, act_stride, 1, out, out_stride, n_valid, TYPE); break;                       \
    case 2: kernel(n, group, act, act_stride, 2, out, out_stride, n_valid, TYPE); break;                       \
    case 3: kernel(n, group, act, act_stride, 3, out, out_stride, n_valid, TYPE); break;                       \
    default: kernel(n, group, act, act_stride, 4, out, out_stride, n_valid, TYPE); break;                      \
    }

#define GEMM(ty, TYPE)                                                                                         \
    BT_CPU_GEMM_DECL(avx512, ty) { GEMM_DISPATCH(gemm8_kernel, TYPE) }                                         \
    BT_CPU_GEMM_DECL(avx512, ty##_q16) { GEMM_DISPATCH(gemm16_kernel, TYPE) }

GEMM(q4_0, BT_TYPE_Q4_0)
GEMM(q4_1, BT_TYPE_Q4_1)
GEMM(q8_0, BT_TYPE_Q8_0)
