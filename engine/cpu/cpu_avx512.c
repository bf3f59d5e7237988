/* AVX-512 (F, BW, VL, VNNI) kernels. Compiled with those flags; called only when the CPU has them.
 * vpdpbusd multiplies u8 weight codes by s8 activations and accumulates int32 without saturation. Q4_1, Q5_1 and
 * Q8_0 (the default model's types) take two blocks per 512-bit register; Q4_0 and Q5_0 use the 256-bit form with
 * their offset folded into the integer dot; the fifth bits of Q5_x expand with one masked byte move.
 * F32/F16/BF16 use 16-lane FMAs; K-quants and activation quantization reuse the AVX2 kernels.
 * With 16-bit activations (vpdpwssd) every type has its own kernel: legacy types one block per register, K-quants
 * one 32-element run per register; the 16-bit activation quantizer for the legacy types is this file's, the
 * K-quants' is AVX2's. The tiled kernels over packed weights live in cpu_avx512_gemm.c. */
#include <float.h>
#include <immintrin.h>
#include <math.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_impl.h"


#define AI static inline __attribute__((always_inline))

AI float hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI float h2f(uint16_t h)
{
    return _cvtsh_ss(h);
}

AI __m256i unpack_nibbles(const uint8_t *qs)
{
    __m128i x = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
}

AI __m256i qh_to_bytes(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    return _mm256_maskz_mov_epi8((__mmask32)x, _mm256_set1_epi8(0x10));
}

#define ACT32(r, i) ((const bt_block_q8_32 *)((const char *)act + (size_t)(r) * act_stride) + (i))

#define NR_DISPATCH(kernel)                                                                                    \
    switch (nr) {                                                                                              \
    case 1: kernel(n, w_row, act, act_stride, 1, out, out_stride); break;                                      \
    case 2: kernel(n, w_row, act, act_stride, 2, out, out_stride); break;                                      \
    case 3: kernel(n, w_row, act, act_stride, 3, out, out_stride); break;                                      \
    default: kernel(n, w_row, act, act_stride, 4, out, out_stride); break;                                     \
    }

#define KERNEL_ARGS int64_t n, const void *w_row, const void *act, size_t act_stride, const int NR, float *out, \
                    size_t out_stride

/* One block i of the weight row against NR activation rows, into the accumulator set acc/accm. */
AI void legacy_step(const void *w_row, int64_t i, const void *act, size_t act_stride, const int NR, const int type,
                    __m256 *acc, float *accm)
{
    __m256i q;
    float dw, mw = 0.0f;
    int offset = 0;
    switch (type) {
    case BT_TYPE_Q4_0: {
        const bt_block_q4_0 *b = (const bt_block_q4_0 *)w_row + i;
        q = unpack_nibbles(b->qs);
        dw = h2f(b->d);
        offset = 8;
        break;
    }
    case BT_TYPE_Q4_1: {
        const bt_block_q4_1 *b = (const bt_block_q4_1 *)w_row + i;
        q = unpack_nibbles(b->qs);
        dw = h2f(b->d);
        mw = h2f(b->m);
        break;
    }
    case BT_TYPE_Q5_0: {
        const bt_block_q5_0 *b = (const bt_block_q5_0 *)w_row + i;
        q = _mm256_or_si256(unpack_nibbles(b->qs), qh_to_bytes(b->qh));
        dw = h2f(b->d);
        offset = 16;
        break;
    }
    case BT_TYPE_Q5_1: {
        const bt_block_q5_1 *b = (const bt_block_q5_1 *)w_row + i;
        q = _mm256_or_si256(unpack_nibbles(b->qs), qh_to_bytes(b->qh));
        dw = h2f(b->d);
        mw = h2f(b->m);
        break;
    }
    default: { /* Q8_0: codes + 128 as u8 */
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b->qs), _mm256_set1_epi8((char)0x80));
            dw = h2f(b->d);
            offset = 128;
        break;
    }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const bt_block_q8_32 *a = ACT32(r, i);
        __m256i av = _mm256_loadu_si256((const __m256i *)a->qs);
        __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, av);
        if (offset) p = _mm256_sub_epi32(p, _mm256_castsi128_si256(_mm_cvtsi32_si128(offset * a->sum)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a->d), acc[r]);
        if (type == BT_TYPE_Q4_1 || type == BT_TYPE_Q5_1) accm[r] += mw * a->ds;
    }
}

/* Even blocks go to one accumulator set and odd blocks to another, so two FMA chains overlap; the order depends
 * only on n, never on NR. */
AI void legacy_kernel(KERNEL_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    __m256 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    float accm0[BT_CPU_MAX_NR], accm1[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
        accm0[r] = accm1[r] = 0.0f;
    }
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        legacy_step(w_row, i, act, act_stride, NR, type, acc0, accm0);
        legacy_step(w_row, i + 1, act, act_stride, NR, type, acc1, accm1);
    }
    if (i < nb) legacy_step(w_row, i, act, act_stride, NR, type, acc0, accm0);
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        out[(size_t)r * out_stride] = hsum_ps(_mm256_add_ps(acc0[r], acc1[r])) + (accm0[r] + accm1[r]);
}

#define LEGACY(ty, TYPE)                                                                                       \
    AI void kern_##ty(KERNEL_ARGS) { legacy_kernel(n, w_row, act, act_stride, NR, out, out_stride, TYPE); }     \
    BT_CPU_DOT_ROWS_DECL(avx512, ty) { NR_DISPATCH(kern_##ty) }

LEGACY(q4_0, BT_TYPE_Q4_0)
LEGACY(q5_0, BT_TYPE_Q5_0)

/* [lo, the 32 bytes at p]: a masked load fills the upper half without a shuffle (the masked-off lower half of
 * the 64-byte window below p is not accessed) */
AI __m512i load_upper(__m256i lo, const void *p)
{
    return _mm512_mask_loadu_epi64(_mm512_castsi256_si512(lo), 0xf0, (const char *)p - 32);
}

/* Q4_1, Q5_1, Q8_0 two blocks per 512-bit register. Lanes 0..7 belong to block i, lanes 8..15 to block i + 1.
 * Per pair the weight scales [d0, m0, d1, m1] (m = 0 for Q8_0) times the activation's [d0, ds0, d1, ds1] give
 * both block scales and both min terms in one multiply. Q8_0 stays exact in integers: activations are negated
 * where the weight is negative and the weight's absolute value goes in as the u8 operand. */
AI __m512i pair_codes(const void *w_row, int64_t i, const int type, const int second)
{
    if (type == BT_TYPE_Q8_0) {
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        __m256i q0 = _mm256_loadu_si256((const __m256i *)b[0].qs);
        return second ? _mm512_inserti64x4(_mm512_castsi256_si512(q0), _mm256_loadu_si256((const __m256i *)b[1].qs), 1)
                      : _mm512_zextsi256_si512(q0);
    }
    const uint8_t *qs0, *qs1;
    uint32_t h0 = 0, h1 = 0;
    if (type == BT_TYPE_Q4_1) {
        const bt_block_q4_1 *b = (const bt_block_q4_1 *)w_row + i;
        qs0 = b[0].qs, qs1 = second ? b[1].qs : b[0].qs;
    } else {
        const bt_block_q5_1 *b = (const bt_block_q5_1 *)w_row + i;
        qs0 = b[0].qs, qs1 = second ? b[1].qs : b[0].qs;
        memcpy(&h0, b[0].qh, 4);
        if (second) memcpy(&h1, b[1].qh, 4);
    }
    __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)qs0)),
                                        _mm_loadu_si128((const __m128i *)qs1), 1); /* [x0, x1] */
    __m512i u = _mm512_permutex2var_epi64(_mm512_castsi256_si512(t), _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11),
                                          _mm512_castsi256_si512(_mm256_srli_epi16(t, 4))); /* [x0, x0>>4, x1, x1>>4] */
    u = _mm512_and_si512(u, _mm512_set1_epi8(0x0f));
    if (type == BT_TYPE_Q5_1)
        u = _mm512_or_si512(u, _mm512_maskz_mov_epi8((__mmask64)h0 | (__mmask64)h1 << 32, _mm512_set1_epi8(0x10)));
    if (!second) u = _mm512_zextsi256_si512(_mm512_castsi512_si256(u));
    return u;
}

/* [d0, m0, d1, m1] of blocks i and i + 1 (zeros for the absent second block) */
AI __m128 pair_wscales(const void *w_row, int64_t i, const int type, const int second)
{
    __m128i h;
    if (type == BT_TYPE_Q8_0) {
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        h = _mm_cvtsi32_si128(b[0].d);
        if (second) h = _mm_insert_epi16(h, b[1].d, 2);
    } else {
        int32_t dm0, dm1; /* d and m are the first 4 bytes of Q4_1 and Q5_1 blocks */
        size_t bb = type == BT_TYPE_Q4_1 ? sizeof(bt_block_q4_1) : sizeof(bt_block_q5_1);
        const uint8_t *p = (const uint8_t *)w_row + (size_t)i * bb;
        memcpy(&dm0, p, 4);
        h = _mm_cvtsi32_si128(dm0);
        if (second) {
            memcpy(&dm1, p + bb, 4);
            h = _mm_insert_epi32(h, dm1, 1);
        }
    }
    return _mm_cvtph_ps(h);
}

AI __m128 pair_ascales(const bt_block_q8_32 *a, const int second)
{
    __m128d v = _mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)&a[0].d)); /* [d0, ds0] */
    if (second) v = _mm_loadh_pd(v, (const double *)&a[1].d);
    return _mm_castpd_ps(v);
}

AI __m512i pair_act(const bt_block_q8_32 *a, const int second)
{
    __m256i a0 = _mm256_loadu_si256((const __m256i *)a[0].qs);
    return second ? load_upper(a0, a[1].qs) : _mm512_zextsi256_si512(a0);
}

AI void pair_step(const void *w_row, int64_t i, const void *act, size_t act_stride, const int NR, const int type,
                  const int second, __m512 *acc, __m128 *accm)
{
    const __m512i q = pair_codes(w_row, i, type, second);
    const __m512i qa = type == BT_TYPE_Q8_0 ? _mm512_abs_epi8(q) : q;
    const __mmask64 neg = type == BT_TYPE_Q8_0 ? _mm512_movepi8_mask(q) : 0;
    const __m128 ws = pair_wscales(w_row, i, type, second);
    const __m512i lane_idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const bt_block_q8_32 *a = ACT32(r, i);
        __m512i av = pair_act(a, second);
        if (type == BT_TYPE_Q8_0) av = _mm512_mask_sub_epi8(av, neg, _mm512_setzero_si512(), av);
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qa, av);
        __m128 sc = _mm_mul_ps(ws, pair_ascales(a, second)); /* [s0, min0, s1, min1] */
        __m512 scv = _mm512_permutexvar_ps(lane_idx, _mm512_castps128_ps512(sc));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scv, acc[r]);
        if (type != BT_TYPE_Q8_0) accm[r] = _mm_add_ps(accm[r], sc);
    }
}

/* Pairs alternate between two accumulator sets (two FMA chains in flight); an odd last block goes alone into the
 * second set. The sequence depends on n only. */
AI void pair_kernel(KERNEL_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    __m512 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    __m128 accm0[BT_CPU_MAX_NR], accm1[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm512_setzero_ps();
        accm0[r] = accm1[r] = _mm_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        pair_step(w_row, i, act, act_stride, NR, type, 1, acc0, accm0);
        pair_step(w_row, i + 2, act, act_stride, NR, type, 1, acc1, accm1);
    }
    if (i + 2 <= nb) {
        pair_step(w_row, i, act, act_stride, NR, type, 1, acc0, accm0);
        i += 2;
    }
    if (i < nb) pair_step(w_row, i, act, act_stride, NR, type, 0, acc1, accm1);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        __m512 s16 = _mm512_add_ps(acc0[r], acc1[r]);
        float s = hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(s16),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1))));
        __m128 m = _mm_add_ps(accm0[r], accm1[r]);
        float mins = _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 3));
        out[(size_t)r * out_stride] = s + mins;
    }
}

#define PAIRED(ty, TYPE)                                                                                       \
    AI void kern_##ty(KERNEL_ARGS) { pair_kernel(n, w_row, act, act_stride, NR, out, out_stride, TYPE); }       \
    BT_CPU_DOT_ROWS_DECL(avx512, ty) { NR_DISPATCH(kern_##ty) }

PAIRED(q4_1, BT_TYPE_Q4_1)
PAIRED(q5_1, BT_TYPE_Q5_1)
PAIRED(q8_0, BT_TYPE_Q8_0)

/* ---- 16-bit activations, legacy types: one block per 512-bit register ----
 * The 32 weight codes widen to int16 (offset applied: Q4_0 q - 8, Q5_0 q - 16) and vpdpwssd multiplies them by
 * the block's 32 int16 activations into 16 int32 lanes of 2 products, |lane| <= 2 * 128 * 32767 < 2^24: the
 * conversion to float is exact, only the float accumulation order differs from the scalar reference. */

#define ACT16(r, i) ((const bt_block_q16_32 *)((const char *)act + (size_t)(r) * act_stride) + (i))

/* 16 packed nibbles -> 32 int16 (low nibbles are elements 0..15, high nibbles 16..31): one widening shuffle of
 * the broadcast bytes, then a per-half shift */
AI __m512i unpack_nibbles16(const uint8_t *qs)
{
    __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)));
    b = _mm512_srlv_epi16(b, _mm512_set_epi64(0x0004000400040004ll, 0x0004000400040004ll, 0x0004000400040004ll,
                                              0x0004000400040004ll, 0, 0, 0, 0));
    return _mm512_and_si512(b, _mm512_set1_epi16(0x0f));
}

/* bit i of the little-endian word at p -> int16 lane i = 0x10 or 0 */
AI __m512i qh_to_words(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    return _mm512_maskz_mov_epi16((__mmask32)x, _mm512_set1_epi16(0x10));
}

/* [d, m] of a Q4_1/Q5_1 block times the activation's [d, ds] gives the block scale and min term in one multiply
 * (the same products as d * d_a and m * ds); lane 1 of the accm vectors sums the min terms. */
AI void legacy16_step(const void *w_row, int64_t i, const void *act, size_t act_stride, const int NR, const int type,
                      __m512 *acc, __m128 *accm)
{
    __m512i q;
    float dw = 0.0f;
    __m128 wsc = _mm_setzero_ps();
    switch (type) {
    case BT_TYPE_Q4_0: {
        const bt_block_q4_0 *b = (const bt_block_q4_0 *)w_row + i;
        q = _mm512_sub_epi16(unpack_nibbles16(b->qs), _mm512_set1_epi16(8));
        dw = h2f(b->d);
        break;
    }
    case BT_TYPE_Q4_1: {
        const bt_block_q4_1 *b = (const bt_block_q4_1 *)w_row + i;
        int32_t dm;
        memcpy(&dm, b, 4);
        q = unpack_nibbles16(b->qs);
        wsc = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        break;
    }
    case BT_TYPE_Q5_0: {
        const bt_block_q5_0 *b = (const bt_block_q5_0 *)w_row + i;
        q = _mm512_sub_epi16(_mm512_or_si512(unpack_nibbles16(b->qs), qh_to_words(b->qh)), _mm512_set1_epi16(16));
        dw = h2f(b->d);
        break;
    }
    case BT_TYPE_Q5_1: {
        const bt_block_q5_1 *b = (const bt_block_q5_1 *)w_row + i;
        int32_t dm;
        memcpy(&dm, b, 4);
        q = _mm512_or_si512(unpack_nibbles16(b->qs), qh_to_words(b->qh));
        wsc = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        break;
    }
    default: { /* Q8_0 */
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)b->qs));
        dw = h2f(b->d);
        break;
    }
    }
    const int has_min = type == BT_TYPE_Q4_1 || type == BT_TYPE_Q5_1;
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const bt_block_q16_32 *a = ACT16(r, i);
        __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(a->qs));
        if (has_min) {
            __m128 sc = _mm_mul_ps(wsc, _mm_castpd_ps(_mm_load_sd((const double *)&a->d))); /* [s, min, 0, 0] */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_broadcastss_ps(sc), acc[r]);
            accm[r] = _mm_add_ps(accm[r], sc);
        } else {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dw * a->d), acc[r]);
        }
    }
}

/* Even and odd blocks in two accumulator sets (two FMA chains); the order depends only on n, never on NR. */
AI void legacy16_kernel(KERNEL_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    __m512 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    __m128 accm0[BT_CPU_MAX_NR], accm1[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm512_setzero_ps();
        accm0[r] = accm1[r] = _mm_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        legacy16_step(w_row, i, act, act_stride, NR, type, acc0, accm0);
        legacy16_step(w_row, i + 1, act, act_stride, NR, type, acc1, accm1);
    }
    if (i < nb) legacy16_step(w_row, i, act, act_stride, NR, type, acc0, accm0);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        __m512 s16 = _mm512_add_ps(acc0[r], acc1[r]);
        float s = hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(s16),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1))));
        __m128 m = _mm_add_ps(accm0[r], accm1[r]);
        out[(size_t)r * out_stride] = s + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1));
    }
}

#define LEGACY16(ty, TYPE)                                                                                     \
    AI void kern16_##ty(KERNEL_ARGS) { legacy16_kernel(n, w_row, act, act_stride, NR, out, out_stride, TYPE); } \
    BT_CPU_DOT_ROWS_DECL(avx512, ty##_q16) { NR_DISPATCH(kern16_##ty) }

LEGACY16(q4_0, BT_TYPE_Q4_0)
LEGACY16(q4_1, BT_TYPE_Q4_1)
LEGACY16(q5_0, BT_TYPE_Q5_0)
LEGACY16(q5_1, BT_TYPE_Q5_1)
LEGACY16(q8_0, BT_TYPE_Q8_0)

/* ---- 16-bit activations, K-quants: one 32-element run per 512-bit register ----
 * As the AVX2 kernels: codes widen to int16 and take their sub-block scale in int16 (<= 1953 for Q4_K/Q5_K, 4096
 * for Q6_K), vpdpwssd accumulates int32 lanes over the super-block, and the lanes are summed exactly in int64 before
 * the reference's own float expression, so the result is bit-identical to the scalar reference. Lane bounds per
 * super-block: Q4_K/Q5_K 16 products, 16 * 1953 * 32767 < 2^30; Q6_K 16 products, 16 * 4096 * 32767 = 2147418112
 * < 2^31 (every partial sum is bounded by the same figure). */

#define ACT16K(r, i) ((const bt_block_q16_256 *)((const char *)act + (size_t)(r) * act_stride) + (i))

AI int64_t hsum_epi32_exact(__m512i v)
{
    __m512i w = _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)),
                                 _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
    return _mm512_reduce_add_epi64(w);
}

AI void qk45_q16_kernel(KERNEL_ARGS, const int has_qh)
{
    const int64_t nb = n / BT_QK_K;
    float acc[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one8 = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *scales, *qs, *qhp = NULL;
        uint16_t d16, dmin16;
        if (has_qh) {
            const bt_block_q5_k *b = (const bt_block_q5_k *)w_row + i;
            scales = b->scales, qs = b->qs, qhp = b->qh, d16 = b->d, dmin16 = b->dmin;
        } else {
            const bt_block_q4_k *b = (const bt_block_q4_k *)w_row + i;
            scales = b->scales, qs = b->qs, d16 = b->d, dmin16 = b->dmin;
        }
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; j++) bt_q4k_scale_min(scales, j, &sc[j], &mn[j]);
        __m512i isum[BT_CPU_MAX_NR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
        __m256i qh = has_qh ? _mm256_loadu_si256((const __m256i *)qhp) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (has_qh) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one8), 4));
                qh = _mm256_srli_epi16(qh, 1);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(qh, one8), 4));
                qh = _mm256_srli_epi16(qh, 1);
            }
            /* sub-block 2c = elements 64c + 0..31 (lo), sub-block 2c + 1 = 64c + 32..63 (hi) */
            const __m512i w0 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(lo), _mm512_set1_epi16(sc[2 * c]));
            const __m512i w1 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(hi), _mm512_set1_epi16(sc[2 * c + 1]));
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                isum[r] = _mm512_dpwssd_epi32(isum[r], w0, _mm512_loadu_si512(ACT16K(r, i)->s[2 * c].qs));
                isum[r] = _mm512_dpwssd_epi32(isum[r], w1, _mm512_loadu_si512(ACT16K(r, i)->s[2 * c + 1].qs));
            }
        }
        const float dw = h2f(d16), dmin = h2f(dmin16);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q16_256 *a = ACT16K(r, i);
            int64_t sumi = hsum_epi32_exact(isum[r]), summ = 0;
            for (int j = 0; j < 8; j++) summ += (int64_t)mn[j] * a->s[j].sum;
            acc[r] += dw * a->s[0].d * (float)sumi - dmin * a->s[0].d * (float)summ;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = acc[r];
}

AI void kern16_q4_k(KERNEL_ARGS) { qk45_q16_kernel(n, w_row, act, act_stride, NR, out, out_stride, 0); }
AI void kern16_q5_k(KERNEL_ARGS) { qk45_q16_kernel(n, w_row, act, act_stride, NR, out, out_stride, 1); }
BT_CPU_DOT_ROWS_DECL(avx512, q4_k_q16) { NR_DISPATCH(kern16_q4_k) }
BT_CPU_DOT_ROWS_DECL(avx512, q5_k_q16) { NR_DISPATCH(kern16_q5_k) }

AI void kern16_q6_k(KERNEL_ARGS)
{
    const int64_t nb = n / BT_QK_K;
    float acc[BT_CPU_MAX_NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    const __m512i off = _mm512_set1_epi16(32);
    for (int64_t i = 0; i < nb; i++) {
        const bt_block_q6_k *b = (const bt_block_q6_k *)w_row + i;
        __m512i isum[BT_CPU_MAX_NR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                __m256i lo = (s & 1) ? ql1 : ql0;
                if (s >> 1) lo = _mm256_srli_epi16(lo, 4);
                __m256i q = _mm256_or_si256(_mm256_and_si256(lo, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), m2), 4));
                int k = 8 * h + 2 * s; /* elements 128h + 32s + 0..15 use scales[k], + 16..31 scales[k + 1] */
                __m512i scv =
                    _mm512_inserti64x4(_mm512_set1_epi16(b->scales[k]), _mm256_set1_epi16(b->scales[k + 1]), 1);
                __m512i w = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(q), off), scv);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const int16_t *aq = ACT16K(r, i)->s[4 * h + s].qs;
                    isum[r] = _mm512_dpwssd_epi32(isum[r], w, _mm512_loadu_si512(aq));
                }
            }
        }
        const float dw = h2f(b->d);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[r] += dw * ACT16K(r, i)->s[0].d * (float)hsum_epi32_exact(isum[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = acc[r];
}
BT_CPU_DOT_ROWS_DECL(avx512, q6_k_q16) { NR_DISPATCH(kern16_q6_k) }

/* Float weights: two 16-lane accumulators per row (32 elements per step), a 16-element step, then scalar. */
AI __m512 load_w16(const void *w, int64_t i, const int type)
{
    if (type == BT_TYPE_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (type == BT_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AI float load_w1(const void *w, int64_t i, const int type)
{
    if (type == BT_TYPE_F32) return ((const float *)w)[i];
    if (type == BT_TYPE_F16) return bt_fp16_to_f32(((const uint16_t *)w)[i]);
    return bt_bf16_to_f32(((const uint16_t *)w)[i]);
}

AI void float_kernel(KERNEL_ARGS, const int type)
{
    __m512 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 w0 = load_w16(w_row, i, type), w1 = load_w16(w_row, i + 16, type);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
            acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i + 16), acc1[r]);
        }
    }
    if (i + 16 <= n) {
        __m512 w0 = load_w16(w_row, i, type);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
            acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i), acc0[r]);
        }
        i += 16;
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
        __m512 s16 = _mm512_add_ps(acc0[r], acc1[r]);
        float s = hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(s16),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1))));
        for (int64_t j = i; j < n; j++) s += load_w1(w_row, j, type) * x[j];
        out[(size_t)r * out_stride] = s;
    }
}

AI void kern_f32(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_F32); }
AI void kern_f16(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_F16); }
AI void kern_bf16(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_BF16); }
BT_CPU_DOT_ROWS_DECL(avx512, f32) { NR_DISPATCH(kern_f32) }
BT_CPU_DOT_ROWS_DECL(avx512, f16) { NR_DISPATCH(kern_f16) }
BT_CPU_DOT_ROWS_DECL(avx512, bf16) { NR_DISPATCH(kern_bf16) }

/* ---- 16-bit activation quantization: 16 blocks of 32 at a time ---- */

/* Lane j of the result = op over the 16 lanes of v[j] (exact and order-free for max and integer add): a transpose
 * in four halving steps, then the lanes put back in order (step D leaves vector 4j + k in lane 4k + j). */
#define REDUCE16(name, T, OP, CAST_PS, CAST_BACK)                                                              \
    AI T name(const T *v)                                                                                      \
    {                                                                                                          \
        __m512 r[8], t4[4], t2[2];                                                                             \
        for (int p = 0; p < 8; p++) {                                                                          \
            __m512 a = CAST_PS(v[2 * p]), b = CAST_PS(v[2 * p + 1]);                                           \
            r[p] = CAST_PS(OP(CAST_BACK(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0))),                  \
                              CAST_BACK(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)))));                \
        }                                                                                                      \
        for (int p = 0; p < 4; p++)                                                                            \
            t4[p] = CAST_PS(OP(CAST_BACK(_mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0))),  \
                               CAST_BACK(_mm512_shuffle_f32x4(r[2 * p], r[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1))))); \
        for (int p = 0; p < 2; p++)                                                                            \
            t2[p] = CAST_PS(OP(CAST_BACK(_mm512_shuffle_ps(t4[2 * p], t4[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0))),   \
                               CAST_BACK(_mm512_shuffle_ps(t4[2 * p], t4[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2))))); \
        __m512 u = CAST_PS(OP(CAST_BACK(_mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(2, 0, 2, 0))),             \
                              CAST_BACK(_mm512_shuffle_ps(t2[0], t2[1], _MM_SHUFFLE(3, 1, 3, 1)))));           \
        const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);           \
        return CAST_BACK(_mm512_permutexvar_ps(idx, u));                                                       \
    }
#define ID_PS(x) (x)
REDUCE16(reduce16_max_ps, __m512, _mm512_max_ps, ID_PS, ID_PS)
REDUCE16(reduce16_add_epi32, __m512i, _mm512_add_epi32, _mm512_castsi512_ps, _mm512_castps_si512)

/* bt_cpu_quantize_q16_32_ref's bytes: d = amax / 32767 and 1 / d for 16 blocks in one division each, the codes
 * rounded to nearest even by cvtps (|x * id| < 32767.5, so vpmovsdw never saturates), the block sums exact. The
 * AVX2 version's per-block horizontal max, two scalar divisions and two horizontal sums took ~2.5% of a decode
 * step's samples (perf, SmolLM2 at 16 sequences). Blocks past the last 16 take the AVX2 path. */
void bt_cpu_avx512_quantize_q16_32(int64_t n, const float *x, bt_block_q16_32 *y)
{
    const int64_t nb = n / BT_QK;
    int64_t i0 = 0;
    for (; i0 + 16 <= nb; i0 += 16) {
        const float *xb = x + i0 * BT_QK;
        __m512 m[16];
        for (int j = 0; j < 16; j++) {
            __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * j));
            __m512 b = _mm512_abs_ps(_mm512_loadu_ps(xb + 32 * j + 16));
            m[j] = _mm512_max_ps(_mm512_max_ps(_mm512_setzero_ps(), a), b); /* NaN as the AVX2 path: abs_max8 */
        }
        const __m512 d = _mm512_div_ps(reduce16_max_ps(m), _mm512_set1_ps(32767.0f));
        __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                        _mm512_set1_ps(1.0f), d);
        /* bt_act_inv_scale: 0 where 1 / d is not finite */
        id = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(id, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ), id);
        float idf[16];
        _mm512_storeu_ps(idf, id);
        __m512i sv[16];
        for (int j = 0; j < 16; j++) {
            const __m512 idj = _mm512_set1_ps(idf[j]);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * j), idj));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * j + 16), idj));
            _mm256_storeu_si256((__m256i *)y[i0 + j].qs, _mm512_cvtsepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(y[i0 + j].qs + 16), _mm512_cvtsepi32_epi16(q1));
            sv[j] = _mm512_add_epi32(q0, q1);
        }
        const __m512i sums = reduce16_add_epi32(sv);
        const __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sums)); /* |sum| < 2^21: exact */
        float df[16], dsf[16];
        int32_t sf[16];
        _mm512_storeu_ps(df, d), _mm512_storeu_ps(dsf, ds), _mm512_storeu_si512(sf, sums);
        for (int j = 0; j < 16; j++)
            y[i0 + j].d = df[j], y[i0 + j].ds = dsf[j], y[i0 + j].sum = sf[j], y[i0 + j].sum_lo = 0;
    }
    if (i0 < nb) bt_cpu_avx2_quantize_q16_32((nb - i0) * BT_QK, x + i0 * BT_QK, y + i0);
}

void bt_cpu_avx512_fp16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
    for (; i < n; i++) y[i] = bt_fp16_to_f32(x[i]);
}

void bt_cpu_avx512_f32_to_fp16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = bt_f32_to_fp16(x[i]);
}

/* ---- attention and elementwise ops: the arithmetic of the scalar references, 16 lanes at a time ---- */

/* bt_cpu_expf on 16 lanes. may_overflow = 0 when every argument is <= 0 or NaN, as in attention (s_j - mn and
 * m - mn with mn >= both): the > BT_EXP_HI test can never fire there and is left out. */
AI __m512 exp16_core(__m512 x, const int may_overflow)
{
    __mmask16 lo = _mm512_cmp_ps_mask(x, _mm512_set1_ps(BT_EXP_LO), _CMP_LT_OQ);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(BT_EXP_LOG2E));
    __m512 nf = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(BT_EXP_MAGIC)), _mm512_set1_ps(BT_EXP_MAGIC));
    __m512 r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-BT_EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-BT_EXP_LN2_LO), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(BT_EXP_P5), r, _mm512_set1_ps(BT_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BT_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BT_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BT_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(BT_EXP_P0));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(nf), 23);
    __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
    y = _mm512_mask_mov_ps(y, lo, _mm512_setzero_ps());
    if (may_overflow)
        y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(BT_EXP_HI), _CMP_GT_OQ),
                               _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(y, nan, x);
}

AI __m512 exp16(__m512 x)
{
    return exp16_core(x, 1);
}

AI __m512 exp16_nonpos(__m512 x)
{
    return exp16_core(x, 0);
}

/* tree16 of the scalar reference on one register */
AI float tree16_ps(__m512 x)
{
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    __m256 b = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* 16 elements of row j of a KV block from element i, dequantized as kv_elem of the scalar reference does; sm: U8
 * only, the (scale, min) pairs of the rows of `which` as floats (kv_sm_f32) */
AI __m512 kv_load16(const bt_cpu_kv_rows *kv, const int which, const int type, int64_t n, int j, int64_t i,
                    const float *sm)
{
    const void *base = which ? kv->v : kv->k;
    size_t e = (size_t)j * (size_t)n + (size_t)i;
    if (type == BT_CPU_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + e)));
    if (type == BT_CPU_KV_U8) {
        __m128i codes = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + e));
        __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
        return _mm512_fmadd_ps(_mm512_set1_ps(sm[2 * j]), c, _mm512_set1_ps(sm[2 * j + 1]));
    }
    return _mm512_loadu_ps((const float *)base + e);
}

/* The fp16 (scale, min) pairs of nk U8 rows as floats, out[2 * nk]: one exact conversion per block instead of two
 * scalar ones per row load. */
AI void kv_sm_f32(const uint16_t *sm, int nk, float *out)
{
    __mmask32 k = (__mmask32)((1ull << (2 * nk)) - 1u);
    __m512i h = _mm512_maskz_loadu_epi16(k, sm);
    _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
}

/* tree16 of 16 dot registers (keys) is computed in two halves: every step adds the lane pairs the one-register
 * tree adds, several keys per register. Steps 1-3 for 8 keys at once: quarter k of the result holds
 * [d0, d1 of key k, d0, d1 of key 4 + k] (key numbers relative to the first). Step 1 takes a pair of keys at a time
 * (tree16_pair: keys 2p and 2p + 1 into b[p]), so that the dots of a quad of keys can be reduced to two registers
 * before the next quad's are computed; tree16x8_rest finishes steps 2 and 3 from the four b. */
AI __m512 tree16_pair(__m512 x0, __m512 x1)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}

AI __m512 tree16x8_rest(const __m512 *b)
{
    __m512 c[2];
    for (int r = 0; r < 2; r++)
        c[r] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * r], b[2 * r + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Step 4 from the two halves, keys back in lane order. */
AI __m512 tree16_finish(__m512 d0, __m512 d1)
{
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, e);
}

/* query heads handled together: each K/V element is loaded and converted once for all of them. 4 covers the
 * common GQA groups of 4 (Gemma 3, Llama 3, Mistral) in one pass; as 3 + 1 heads, Gemma 3's blocks (head size 256)
 * took 950 ns hot and 2,200 cold (bench_cpu_kernels --attn), with 4: 700 and 1,750. */
#define ATTN_NH 4

/* acc[h] = acc[h] * c[h] (skipped when c is NULL, i.e. all 1), then fmaf(w[h][j], V_j, .) for j ascending */
AI void attn_pv(int64_t n, const int NH, const bt_cpu_kv_rows *kv, const float *vsm, int nk, const float *c,
                float (*wj)[16], float *acc, const int type, const void *pf_v)
{
    const bt_cpu_pf pf = bt_cpu_pf_plan(pf_v, kv->pf_bytes, nk);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a[ATTN_NH][4];
        for (int h = 0; h < NH; h++)
            for (int u = 0; u < 4; u++) {
                a[h][u] = _mm512_loadu_ps(acc + (size_t)h * (size_t)n + (size_t)(i + 16 * u));
                if (c) a[h][u] = _mm512_mul_ps(a[h][u], _mm512_set1_ps(c[h]));
            }
        for (int j = 0; j < nk; j++) {
            if (i == 0) bt_cpu_pf_part(&pf, j);
            __m512 wv[ATTN_NH];
            for (int h = 0; h < NH; h++) wv[h] = _mm512_set1_ps(wj[h][j]);
            for (int u = 0; u < 4; u++) {
                __m512 v = kv_load16(kv, 1, type, n, j, i + 16 * u, vsm);
                for (int h = 0; h < NH; h++) a[h][u] = _mm512_fmadd_ps(wv[h], v, a[h][u]);
            }
        }
        for (int h = 0; h < NH; h++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + (size_t)h * (size_t)n + (size_t)(i + 16 * u), a[h][u]);
    }
    for (; i < n; i += 16) {
        __m512 a[ATTN_NH];
        for (int h = 0; h < NH; h++) {
            a[h] = _mm512_loadu_ps(acc + (size_t)h * (size_t)n + (size_t)i);
            if (c) a[h] = _mm512_mul_ps(a[h], _mm512_set1_ps(c[h]));
        }
        for (int j = 0; j < nk; j++) {
            __m512 v = kv_load16(kv, 1, type, n, j, i, vsm);
            for (int h = 0; h < NH; h++) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(wj[h][j]), v, a[h]);
        }
        for (int h = 0; h < NH; h++) _mm512_storeu_ps(acc + (size_t)h * (size_t)n + (size_t)i, a[h]);
    }
}

/* attn_block for NH (1..ATTN_NH) query heads, n a multiple of 16. K in passes of KQ keys: KQ x NH registers of dot
 * lanes, each pass reduced to KQ / 2 registers per head (tree16_pair) before the next. 8 keys a pass for up to 3
 * heads; 4 heads take quads (32 dot registers would not fit beside q; quads for 3 heads measured ~6% slower). */
AI void attn_heads(int64_t n, const int NH, const float *q, float scale, const bt_cpu_kv_rows *kv, const float *ksm,
                   const float *vsm, int nk, float *m, float *l, float *acc, const int type, int pf)
{
    const void *pf_k = pf ? kv->pf_k : NULL, *pf_v = pf ? kv->pf_v : NULL;
    const int KQ = NH > 3 ? 4 : 8, n_it = (16 / KQ) * (int)(n / 16);
    const bt_cpu_pf pfk = bt_cpu_pf_plan(pf_k, kv->pf_bytes, n_it);
    __m512 d[2][ATTN_NH];
    for (int s = 0; s < 2; s++) {
        if (s == 1 && nk <= 8) { /* keys 8..15 are masked out below whatever their dots */
            for (int h = 0; h < NH; h++) d[1][h] = _mm512_setzero_ps();
            break;
        }
        __m512 b[ATTN_NH][4];
        for (int u = 0; u < 8 / KQ; u++) { /* keys 8s + KQ u .. 8s + KQ u + KQ - 1 */
            __m512 x[ATTN_NH][8], qv[ATTN_NH];
            int rows[8];
            const int k0 = 8 * s + KQ * u, it0 = (k0 / KQ) * (int)(n / 16);
            for (int jj = 0; jj < KQ; jj++) rows[jj] = k0 + jj < nk ? k0 + jj : nk - 1;
            for (int h = 0; h < NH; h++) qv[h] = _mm512_loadu_ps(q + (size_t)h * (size_t)n);
            bt_cpu_pf_part(&pfk, it0);
#pragma GCC unroll 8
            for (int jj = 0; jj < KQ; jj++) {
                __m512 kk = kv_load16(kv, 0, type, n, rows[jj], 0, ksm);
                for (int h = 0; h < NH; h++) x[h][jj] = _mm512_mul_ps(qv[h], kk);
            }
            for (int64_t i = 16; i < n; i += 16) {
                for (int h = 0; h < NH; h++) qv[h] = _mm512_loadu_ps(q + (size_t)h * (size_t)n + (size_t)i);
                bt_cpu_pf_part(&pfk, it0 + (int)(i / 16));
#pragma GCC unroll 8
                for (int jj = 0; jj < KQ; jj++) {
                    __m512 kk = kv_load16(kv, 0, type, n, rows[jj], i, ksm);
                    for (int h = 0; h < NH; h++) x[h][jj] = _mm512_fmadd_ps(qv[h], kk, x[h][jj]);
                }
            }
            for (int h = 0; h < NH; h++)
                for (int p = 0; p < KQ / 2; p++) b[h][u * (KQ / 2) + p] = tree16_pair(x[h][2 * p], x[h][2 * p + 1]);
        }
        for (int h = 0; h < NH; h++) d[s][h] = tree16x8_rest(b[h]);
    }
    __mmask16 valid = (__mmask16)((1u << nk) - 1u);
    float wj[ATTN_NH][16];
    __m512 sc[ATTN_NH];
    int same = 1; /* no head's max moves: c = bt_cpu_expf(0) = 1 exactly, so l and acc need no rescale */
    for (int h = 0; h < NH; h++) {
        sc[h] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, tree16_finish(d[0][h], d[1][h]),
                                   _mm512_set1_ps(scale));
        same &= isfinite(m[h]) && !_mm512_cmp_ps_mask(sc[h], _mm512_set1_ps(m[h]), _CMP_GT_OQ);
    }
    if (same) {
        for (int h = 0; h < NH; h++) {
            __m512 w = exp16_nonpos(_mm512_sub_ps(sc[h], _mm512_set1_ps(m[h])));
            l[h] += tree16_ps(w); /* fmaf(l, 1, t) */
            _mm512_storeu_ps(wj[h], w);
        }
        attn_pv(n, NH, kv, vsm, nk, NULL, wj, acc, type, pf_v);
        return;
    }
    float mn[ATTN_NH], cs[16];
    __m512 dm = _mm512_setzero_ps();
    for (int h = 0; h < NH; h++) {
        float bm = _mm512_reduce_max_ps(sc[h]);
        if (bm == 0.0f) { /* the reduction may pick -0 or +0 */
            float sv[16];
            _mm512_storeu_ps(sv, sc[h]);
            bm = bt_cpu_first_zero16(sv, bm);
        }
        mn[h] = bm > m[h] ? bm : m[h];
        dm = _mm512_mask_mov_ps(dm, (__mmask16)(1u << h), _mm512_set1_ps(m[h] - mn[h]));
    }
    _mm512_storeu_ps(cs, exp16_nonpos(dm)); /* c of every head at once */
    for (int h = 0; h < NH; h++) {
        __m512 w = exp16_nonpos(_mm512_sub_ps(sc[h], _mm512_set1_ps(mn[h])));
        l[h] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(l[h]), _mm_set_ss(cs[h]), _mm_set_ss(tree16_ps(w))));
        _mm512_storeu_ps(wj[h], w);
        m[h] = mn[h];
    }
    attn_pv(n, NH, kv, vsm, nk, cs, wj, acc, type, pf_v);
}

AI void attn_block16(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk, float *m,
                     float *l, float *acc, const int type)
{
    float ksm[32], vsm[32]; /* U8: (scale, min) of each row as floats */
    if (type == BT_CPU_KV_U8) {
        kv_sm_f32(kv->k_sm, nk, ksm);
        kv_sm_f32(kv->v_sm, nk, vsm);
    }
    for (int h = 0; h < nq; h += ATTN_NH) {
        const float *qh = q + (size_t)h * (size_t)n;
        float *ah = acc + (size_t)h * (size_t)n;
        switch (nq - h < ATTN_NH ? nq - h : ATTN_NH) {
        case 1: attn_heads(n, 1, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        case 2: attn_heads(n, 2, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        case 3: attn_heads(n, 3, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        default: attn_heads(n, 4, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        }
    }
}

/* ---- attn_block_rows: the BT_CPU_ATTN_ROWS (16) query rows in the lanes of one vector ----
 * The AVX2 kernel's arithmetic (cpu_avx2.c) on one 16-lane vector instead of two 8-lane ones: half the instructions
 * of the score and V passes. bench_cpu_kernels --attn, Zen 4, 3 runs, per query row against the AVX2 kernel this
 * table used before: head size 64 (3 heads) 0.77-0.84x, 128 (4) 0.84-0.95x, 256 (4) 0.87-0.96x; SmolLM2's
 * 2,048-token prompt in the engine: attention 0.76-0.79x a 512-token step. */

/* c_t (t = t0 .. t0 + T - 1) of tree16 (b_t = x_t + x_(t+8), c_t = b_t + b_(t+4)) of the 16 rows against key row k.
 * Lane r of x_t is row r's chain over elements t, t + 16, ...: the product of the first, then fmas, as the
 * reference's x[t]; qt holds element i of the 16 rows in one vector, k[i] is broadcast. T = 4: 16 chains. */
AI void rows16_c(const int64_t n, const int T, const float *qt, const float *k, int t0, __m512 *c)
{
    __m512 x[4][4];
#pragma GCC unroll 4
    for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            const int ln = t0 + tt + (e & 1) * 8 + (e >> 1) * 4; /* t, t + 8, t + 4, t + 12 */
            x[tt][e] = _mm512_mul_ps(_mm512_loadu_ps(qt + BT_CPU_ATTN_ROWS * ln), _mm512_set1_ps(k[ln]));
        }
#pragma GCC unroll 16
    for (int64_t i = 16; i < n; i += 16)
#pragma GCC unroll 4
        for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 4
            for (int e = 0; e < 4; e++) {
                const int64_t ln = i + t0 + tt + (e & 1) * 8 + (e >> 1) * 4;
                x[tt][e] =
                    _mm512_fmadd_ps(_mm512_loadu_ps(qt + BT_CPU_ATTN_ROWS * ln), _mm512_set1_ps(k[ln]), x[tt][e]);
            }
#pragma GCC unroll 4
    for (int tt = 0; tt < T; tt++)
        c[tt] = _mm512_add_ps(_mm512_add_ps(x[tt][0], x[tt][1]), _mm512_add_ps(x[tt][2], x[tt][3]));
}

/* R (1..4) rows' V pass from row r0: acc = acc * c, then fma(w_j, V_j, acc) for j ascending, 64 elements a step,
 * then 16 (n is a multiple of 16) */
AI void rows16_v(const int64_t n, const int R, int r0, const float *v, int nk, const float (*w)[16], const float *cs,
                 float *acc)
{
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++)
                a[r][u] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)(i + 16 * u)),
                                        _mm512_set1_ps(cs[r0 + r]));
        for (int j = 0; j < nk; j++) {
            const float *vj = v + (size_t)j * (size_t)n + (size_t)i;
            __m512 vv[4];
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) vv[u] = _mm512_loadu_ps(vj + 16 * u);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512 wr = _mm512_set1_ps(w[j][r0 + r]);
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) a[r][u] = _mm512_fmadd_ps(wr, vv[u], a[r][u]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++)
                _mm512_storeu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)(i + 16 * u), a[r][u]);
    }
    for (; i < n; i += 16) {
        __m512 a[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i),
                                 _mm512_set1_ps(cs[r0 + r]));
        for (int j = 0; j < nk; j++) {
            const __m512 vj = _mm512_loadu_ps(v + (size_t)j * (size_t)n + (size_t)i);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[j][r0 + r]), vj, a[r]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i, a[r]);
    }
}

/* The 16 rows (nr of them real) against one block: the score pass, then the softmax step and V pass in the
 * reference's order, as the AVX2 kernel (rows_softmax_v): mn = max(s_j, mn) for j < nk, vmaxps with s_j first
 * giving the reference's bits (the second operand where equal or where s_j is NaN); c = exp(m - mn); w_j = exp(s_j
 * - mn); l = fma(l, c, tree16(w)), the tree vertical over the key vectors. Lanes past nr are computed from
 * whatever qt holds there (m and l read as 0) and never stored. */
AI void rows16_block(const int64_t n, int nr, const float *qt, float scale, const float *k, const float *v, int nk,
                     float *m, float *l, float *acc, const bt_cpu_kv_rows *hint)
{
    const bt_cpu_pf pfk = bt_cpu_pf_plan(hint ? hint->pf_k : NULL, hint ? hint->pf_bytes : 0, BT_CPU_ATTN_BLOCK);
    const bt_cpu_pf pfv = bt_cpu_pf_plan(hint ? hint->pf_v : NULL, hint ? hint->pf_bytes : 0, BT_CPU_ATTN_BLOCK);
    __m512 s[BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        bt_cpu_pf_part(&pfk, j);
        bt_cpu_pf_part(&pfv, j);
        if (j >= nk) {
            s[j] = _mm512_set1_ps(-INFINITY);
            continue;
        }
        __m512 c[4];
        rows16_c(n, 4, qt, k + (size_t)j * (size_t)n, 0, c);
        s[j] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3])),
                             _mm512_set1_ps(scale));
    }
    const __mmask16 km = (__mmask16)((1u << nr) - 1u);
    const __m512 m0 = _mm512_maskz_loadu_ps(km, m);
    __m512 mn = m0;
    for (int j = 0; j < nk; j++) mn = _mm512_max_ps(s[j], mn);
    const __m512 c = exp16(_mm512_sub_ps(m0, mn));
    float w[BT_CPU_ATTN_BLOCK][16] __attribute__((aligned(64))), cs[16] __attribute__((aligned(64)));
    __m512 wv[BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        wv[j] = exp16(_mm512_sub_ps(s[j], mn));
        _mm512_store_ps(w[j], wv[j]);
    }
    __m512 b[8];
    for (int t = 0; t < 8; t++) b[t] = _mm512_add_ps(wv[t], wv[t + 8]);
    for (int t = 0; t < 4; t++) b[t] = _mm512_add_ps(b[t], b[t + 4]);
    const __m512 tw = _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3]));
    _mm512_mask_storeu_ps(l, km, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(km, l), c, tw));
    _mm512_mask_storeu_ps(m, km, mn);
    _mm512_store_ps(cs, c);
    for (int r0 = 0; r0 < nr; r0 += 4) switch (nr - r0 < 4 ? nr - r0 : 4) {
        case 1: rows16_v(n, 1, r0, v, nk, (const float(*)[16])w, cs, acc); break;
        case 2: rows16_v(n, 2, r0, v, nk, (const float(*)[16])w, cs, acc); break;
        case 3: rows16_v(n, 3, r0, v, nk, (const float(*)[16])w, cs, acc); break;
        default: rows16_v(n, 4, r0, v, nk, (const float(*)[16])w, cs, acc); break;
        }
}

static void bt_cpu_avx512_attn_block_rows(int64_t n, int nr, const float *qt, float scale, const float *k,
                                          const float *v, int nk, float *m, float *l, float *acc,
                                          const bt_cpu_kv_rows *hint)
{
    if (nr <= 8) { /* one 8-lane vector holds them: the AVX2 kernel, same bits, half the lanes (a task's last call) */
        bt_cpu_avx2_attn_block_rows(n, nr, qt, scale, k, v, nk, m, l, acc, hint);
        return;
    }
    if (n % 16 || n < 16 || n > 256 || nk < 1 || nk > BT_CPU_ATTN_BLOCK || nr < 1 || nr > BT_CPU_ATTN_ROWS) {
        bt_cpu_pf_all(hint ? hint->pf_k : NULL, hint ? hint->pf_bytes : 0); /* the hints, in one go */
        bt_cpu_pf_all(hint ? hint->pf_v : NULL, hint ? hint->pf_bytes : 0);
        bt_cpu_attn_block_rows_ref(n, nr, qt, scale, k, v, nk, m, l, acc, NULL);
        return;
    }
    switch (n) { /* the head sizes models have, unrolled; any other multiple of 16 in a loop */
    case 64: rows16_block(64, nr, qt, scale, k, v, nk, m, l, acc, hint); break;
    case 128: rows16_block(128, nr, qt, scale, k, v, nk, m, l, acc, hint); break;
    case 256: rows16_block(256, nr, qt, scale, k, v, nk, m, l, acc, hint); break;
    default: rows16_block(n, nr, qt, scale, k, v, nk, m, l, acc, hint); break;
    }
}

void bt_cpu_avx512_attn_block(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk,
                              float *m, float *l, float *acc)
{
    if (n % 16 || nk < 1 || nk > 16) { /* 16-lane rows only; the reference covers the rest with the same bits */
        bt_cpu_pf_all(kv->pf_k, kv->pf_bytes); /* the hints this kernel promises, in one go */
        bt_cpu_pf_all(kv->pf_v, kv->pf_bytes);
        bt_cpu_scalar_attn_block(n, nq, q, scale, kv, nk, m, l, acc);
        return;
    }
    switch (kv->type) {
    case BT_CPU_KV_F16: attn_block16(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_F16); break;
    case BT_CPU_KV_U8: attn_block16(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_U8); break;
    default: attn_block16(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_F32); break;
    }
}

void bt_cpu_avx512_swiglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(INT32_MIN))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    if (i < n) bt_cpu_scalar_swiglu(n - i, g + i, u + i, out + i);
}

void bt_cpu_avx512_geglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f), a = _mm512_set1_ps(BT_GELU_A), k = _mm512_set1_ps(BT_GELU_K);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 z = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), a), x, x), k);
        __m512 d = _mm512_add_ps(one, exp16(z));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, d), _mm512_loadu_ps(u + i)));
    }
    if (i < n) bt_cpu_scalar_geglu(n - i, g + i, u + i, out + i);
}

void bt_cpu_avx512_rmsnorm(int64_t n, const float *x, const float *w, float eps, float *out)
{
    if (n % 8) {
        bt_cpu_scalar_rmsnorm(n, x, w, eps, out);
        return;
    }
    __m512d l = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 8) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        l = _mm512_add_pd(l, _mm512_mul_pd(v, v));
    }
    __m256d b = _mm256_add_pd(_mm512_castpd512_pd256(l), _mm512_extractf64x4_pd(l, 1));
    __m128d c = _mm_add_pd(_mm256_castpd256_pd128(b), _mm256_extractf128_pd(b, 1));
    double ss = _mm_cvtsd_f64(_mm_add_sd(c, _mm_unpackhi_pd(c, c)));
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    __m512 sv = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), sv), _mm512_loadu_ps(w + i)));
    for (; i < n; i++) out[i] = x[i] * scale * w[i];
}

const bt_cpu_ops bt_cpu_ops_avx512 = {
    .isa = BT_CPU_ISA_AVX512,
    .name = "avx512",
    .quantize_q8_32 = bt_cpu_avx2_quantize_q8_32,
    .quantize_q8_256 = bt_cpu_avx2_quantize_q8_256,
    .quantize_q16_32 = bt_cpu_avx512_quantize_q16_32,
    .quantize_q16_256 = bt_cpu_avx2_quantize_q16_256,
    .fp16_to_f32 = bt_cpu_avx512_fp16_to_f32,
    .f32_to_fp16 = bt_cpu_avx512_f32_to_fp16,
    .bf16_to_f32 = bt_cpu_avx2_bf16_to_f32,
    .f32_to_bf16 = bt_cpu_avx2_f32_to_bf16,
    .attn_scores = bt_cpu_avx2_attn_scores,
    .attn_accum = bt_cpu_avx2_attn_accum,
    .attn_block = bt_cpu_avx512_attn_block,
    .attn_prefetches = 1,
    .attn_block_rows = bt_cpu_avx512_attn_block_rows,
    .swiglu = bt_cpu_avx512_swiglu,
    .geglu = bt_cpu_avx512_geglu,
    .rmsnorm = bt_cpu_avx512_rmsnorm,
    .dot_rows = {
        [BT_TYPE_F32] = bt_cpu_avx512_dot_rows_f32,
        [BT_TYPE_F16] = bt_cpu_avx512_dot_rows_f16,
        [BT_TYPE_BF16] = bt_cpu_avx512_dot_rows_bf16,
        [BT_TYPE_Q4_0] = bt_cpu_avx512_dot_rows_q4_0,
        [BT_TYPE_Q4_1] = bt_cpu_avx512_dot_rows_q4_1,
        [BT_TYPE_Q5_0] = bt_cpu_avx512_dot_rows_q5_0,
        [BT_TYPE_Q5_1] = bt_cpu_avx512_dot_rows_q5_1,
        [BT_TYPE_Q8_0] = bt_cpu_avx512_dot_rows_q8_0,
        [BT_TYPE_Q4_K] = bt_cpu_avx2_dot_rows_q4_k,
        [BT_TYPE_Q5_K] = bt_cpu_avx2_dot_rows_q5_k,
        [BT_TYPE_Q6_K] = bt_cpu_avx2_dot_rows_q6_k,
    },
    .dot_rows16 = {
        [BT_TYPE_Q4_0] = bt_cpu_avx512_dot_rows_q4_0_q16,
        [BT_TYPE_Q4_1] = bt_cpu_avx512_dot_rows_q4_1_q16,
        [BT_TYPE_Q5_0] = bt_cpu_avx512_dot_rows_q5_0_q16,
        [BT_TYPE_Q5_1] = bt_cpu_avx512_dot_rows_q5_1_q16,
        [BT_TYPE_Q8_0] = bt_cpu_avx512_dot_rows_q8_0_q16,
        [BT_TYPE_Q4_K] = bt_cpu_avx512_dot_rows_q4_k_q16,
        [BT_TYPE_Q5_K] = bt_cpu_avx512_dot_rows_q5_k_q16,
        [BT_TYPE_Q6_K] = bt_cpu_avx512_dot_rows_q6_k_q16,
    },
    .gemm8 = {
        [BT_TYPE_Q4_0] = bt_cpu_avx512_gemm_q4_0,
        [BT_TYPE_Q4_1] = bt_cpu_avx512_gemm_q4_1,
        [BT_TYPE_Q8_0] = bt_cpu_avx512_gemm_q8_0,
        [BT_TYPE_Q5_1] = bt_cpu_avx512_gemm_q5_1,
        [BT_TYPE_Q4_K] = bt_cpu_avx512_gemm_q4_k,
        [BT_TYPE_Q5_K] = bt_cpu_avx512_gemm_q5_k,
        [BT_TYPE_Q6_K] = bt_cpu_avx512_gemm_q6_k,
    },
    .gemm16 = {
        [BT_TYPE_Q4_0] = bt_cpu_avx512_gemm_q4_0_q16,
        [BT_TYPE_Q4_1] = bt_cpu_avx512_gemm_q4_1_q16,
        [BT_TYPE_Q8_0] = bt_cpu_avx512_gemm_q8_0_q16,
        [BT_TYPE_Q4_K] = bt_cpu_avx512_gemm_q4_k_q16,
        [BT_TYPE_Q6_K] = bt_cpu_avx512_gemm_q6_k_q16,
        [BT_TYPE_Q5_K] = bt_cpu_avx512_gemm_q5_k_q16,
        [BT_TYPE_Q5_1] = bt_cpu_avx512_gemm_q5_1_q16,
        [BT_TYPE_Q5_0] = bt_cpu_avx512_gemm_q5_0_q16,
    },
    .gemm16_planes = 1u << BT_TYPE_Q5_K,
    .gemm_nr = 16,
    /* AMD Zen 4: 16 chains and 16 float accumulators fill the 32 registers and the kernel spills (~100 stack
     * references a block at 16 rows against ~20 at 8), which Zen 4 pays for and the Intel Xeon measured did not
     * (see CHAINS in cpu_avx512_gemm.c). bench_cpu_kernels --gemm --isa avx512 --threads 1, Zen 4, % of the
     * vpdpwssd rate, 16-bit: 16 rows as one tile against two of 8, Q4_1 576x1536 74 -> 80%, Q8_0 576x49152 71 ->
     * 76%, Q4_K 1536x576 75 -> 77%; 12 rows in one tile run as fast as two of 6. Applied to every AMD CPU; only
     * Zen 4 was measured (Zen 5's full-width units are not). */
    .gemm_tile_amd = 12,
};
