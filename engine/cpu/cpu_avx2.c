/* AVX2 + FMA + F16C kernels. Compiled with -mavx2 -mfma -mf16c; called only when the CPU has them.
 * Quantized dots: u8 x s8 pairs with maddubs (no saturation: |w| <= 63 or sign-folded) then madd to int32; the
 * per-block integer result is exact, then scaled and accumulated in float lanes. Each kernel is written once for a
 * compile-time row count NR, so every activation row sees the same instruction sequence for any NR. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

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

AI int hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

AI float h2f(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* u8 x s8 -> 8 int32 lanes, each the sum of 4 adjacent products */
AI __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* s8 x s8 (w in -128..127, a in -127..127) */
AI __m256i dot_s8s8(__m256i w, __m256i a)
{
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

/* 16 packed nibbles -> 32 bytes: low nibbles first (elements 0..15), then high nibbles (16..31) */
AI __m256i unpack_nibbles(const uint8_t *qs)
{
    __m128i x = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(0x0f));
}

/* bit i of the little-endian word at p -> byte i = 0x10 or 0 */
AI __m256i qh_to_bytes(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
                                    _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll,
                                                      0x0101010101010101ll, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

#define ACT32(r, i) ((const bt_block_q8_32 *)((const char *)act + (size_t)(r) * act_stride) + (i))
#define ACT256(r, i) ((const bt_block_q8_256 *)((const char *)act + (size_t)(r) * act_stride) + (i))

/* Dispatches a runtime nr to kernel instances with constant NR. */
#define NR_DISPATCH(kernel)                                                                                    \
    switch (nr) {                                                                                              \
    case 1: kernel(n, w_row, act, act_stride, 1, out, out_stride); break;                                      \
    case 2: kernel(n, w_row, act, act_stride, 2, out, out_stride); break;                                      \
    case 3: kernel(n, w_row, act, act_stride, 3, out, out_stride); break;                                      \
    default: kernel(n, w_row, act, act_stride, 4, out, out_stride); break;                                     \
    }

#define KERNEL_ARGS int64_t n, const void *w_row, const void *act, size_t act_stride, const int NR, float *out, \
                    size_t out_stride

/* Legacy 32-element blocks. OFFSET: value subtracted from every unsigned weight code (Q4_0: 8, Q5_0: 16), folded
 * into the integer dot as -OFFSET * sum(a) in lane 0. HAS_MIN: add m * d_a * sum(a) per block. */
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
    default: { /* Q8_0 */
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        q = _mm256_loadu_si256((const __m256i *)b->qs);
            dw = h2f(b->d);
        break;
    }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const bt_block_q8_32 *a = ACT32(r, i);
        __m256i av = _mm256_loadu_si256((const __m256i *)a->qs);
        __m256i p = type == BT_TYPE_Q8_0 ? dot_s8s8(q, av) : dot_u8s8(q, av);
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
    BT_CPU_DOT_ROWS_DECL(avx2, ty) { NR_DISPATCH(kern_##ty) }

LEGACY(q4_0, BT_TYPE_Q4_0)
LEGACY(q4_1, BT_TYPE_Q4_1)
LEGACY(q5_0, BT_TYPE_Q5_0)
LEGACY(q5_1, BT_TYPE_Q5_1)
LEGACY(q8_0, BT_TYPE_Q8_0)

/* ---- 16-bit activations, legacy types ----
 * Weight codes widen to int16 with their offset applied (Q4_0: q - 8, Q5_0: q - 16); madd_epi16 against the
 * int16 activations gives int32 lanes of 4 products each, |lane| <= 4 * 128 * 32767 < 2^24, so the conversion to
 * float is exact and only the float accumulation order differs from the scalar reference. */

#define ACT16(r, i) ((const bt_block_q16_32 *)((const char *)act + (size_t)(r) * act_stride) + (i))

AI void legacy16_step(const void *w_row, int64_t i, const void *act, size_t act_stride, const int NR, const int type,
                      __m256 *acc, __m128 *accm)
{
    __m256i q;
    float dw = 0.0f;
    __m128 wsc = _mm_setzero_ps(); /* [d, m] of Q4_1/Q5_1 blocks */
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
        int32_t dm;
        memcpy(&dm, b, 4);
        q = unpack_nibbles(b->qs);
        wsc = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
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
        int32_t dm;
        memcpy(&dm, b, 4);
        q = _mm256_or_si256(unpack_nibbles(b->qs), qh_to_bytes(b->qh));
        wsc = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        break;
    }
    default: { /* Q8_0 */
        const bt_block_q8_0 *b = (const bt_block_q8_0 *)w_row + i;
        q = _mm256_loadu_si256((const __m256i *)b->qs);
        dw = h2f(b->d);
        break;
    }
    }
    __m256i lo, hi;
    if (type == BT_TYPE_Q8_0) {
        lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    } else {
        lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
        hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
        if (offset) {
            lo = _mm256_sub_epi16(lo, _mm256_set1_epi16((short)offset));
            hi = _mm256_sub_epi16(hi, _mm256_set1_epi16((short)offset));
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const bt_block_q16_32 *a = ACT16(r, i);
        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)a->qs)),
                                     _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(a->qs + 16))));
        if (type == BT_TYPE_Q4_1 || type == BT_TYPE_Q5_1) {
            /* [d, m] * [d_a, ds]: block scale and min term in one multiply (the same products as the reference) */
            __m128 sc = _mm_mul_ps(wsc, _mm_castpd_ps(_mm_load_sd((const double *)&a->d)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(sc), acc[r]);
            accm[r] = _mm_add_ps(accm[r], sc); /* lane 1 sums the min terms */
        } else {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * a->d), acc[r]);
        }
    }
}

/* Even and odd blocks in two accumulator sets, as legacy_kernel; the order depends only on n. */
AI void legacy16_kernel(KERNEL_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    __m256 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    __m128 accm0[BT_CPU_MAX_NR], accm1[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc0[r] = acc1[r] = _mm256_setzero_ps();
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
        __m128 m = _mm_add_ps(accm0[r], accm1[r]);
        out[(size_t)r * out_stride] = hsum_ps(_mm256_add_ps(acc0[r], acc1[r])) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1));
    }
}

#define LEGACY16(ty, TYPE)                                                                                     \
    AI void kern16_##ty(KERNEL_ARGS) { legacy16_kernel(n, w_row, act, act_stride, NR, out, out_stride, TYPE); } \
    BT_CPU_DOT_ROWS_DECL(avx2, ty##_q16) { NR_DISPATCH(kern16_##ty) }

LEGACY16(q4_0, BT_TYPE_Q4_0)
LEGACY16(q4_1, BT_TYPE_Q4_1)
LEGACY16(q5_0, BT_TYPE_Q5_0)
LEGACY16(q5_1, BT_TYPE_Q5_1)
LEGACY16(q8_0, BT_TYPE_Q8_0)

/* Q4_K / Q5_K: per super-block, sum_j sc_j * dot_j in int32 lanes (maddubs then madd by the scale), mins from the
 * activation's 16-element sums. */
AI void qk45_kernel(KERNEL_ARGS, const int has_qh)
{
    const int64_t nb = n / BT_QK_K;
    __m256 acc[BT_CPU_MAX_NR];
    float accm[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.0f;
    }
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
        const float dw = h2f(d16), dmin = h2f(dmin16);
        __m256i isum[BT_CPU_MAX_NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
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
            const __m256i sl = _mm256_set1_epi16(sc[2 * c]), sh = _mm256_set1_epi16(sc[2 * c + 1]);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                __m256i a0 = _mm256_loadu_si256((const __m256i *)ACT256(r, i)->s[2 * c].qs);
                __m256i a1 = _mm256_loadu_si256((const __m256i *)ACT256(r, i)->s[2 * c + 1].qs);
                __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), sl);
                __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), sh);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(pl, ph));
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q8_256 *a = ACT256(r, i);
            int summ = 0;
            for (int j = 0; j < 8; j++) summ += mn[j] * a->s[j].sum;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(dw * a->s[0].d), acc[r]);
            accm[r] += dmin * a->s[0].d * (float)summ;
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = hsum_ps(acc[r]) - accm[r];
}

AI void kern_q4_k(KERNEL_ARGS) { qk45_kernel(n, w_row, act, act_stride, NR, out, out_stride, 0); }
AI void kern_q5_k(KERNEL_ARGS) { qk45_kernel(n, w_row, act, act_stride, NR, out, out_stride, 1); }
BT_CPU_DOT_ROWS_DECL(avx2, q4_k) { NR_DISPATCH(kern_q4_k) }
BT_CPU_DOT_ROWS_DECL(avx2, q5_k) { NR_DISPATCH(kern_q5_k) }

/* Q6_K: unsigned 6-bit codes times activations, scaled per 16 elements (the two 128-bit lanes of a 32-byte chunk
 * carry two scales); the -32 offset is folded in as -32 * sum_k sc_k * bsum_k in lane 0. */
AI void kern_q6_k(KERNEL_ARGS)
{
    const int64_t nb = n / BT_QK_K;
    __m256 acc[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; i++) {
        const bt_block_q6_k *b = (const bt_block_q6_k *)w_row + i;
        const float dw = h2f(b->d);
        __m256i isum[BT_CPU_MAX_NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                __m256i lo = (s & 1) ? ql1 : ql0;
                if (s >> 1) lo = _mm256_srli_epi16(lo, 4);
                __m256i q = _mm256_or_si256(_mm256_and_si256(lo, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), m2), 4));
                int k = 8 * h + 2 * s;
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16(b->scales[k + 1]), _mm_set1_epi16(b->scales[k]));
                #pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const int8_t *aq = ACT256(r, i)->s[4 * h + s].qs;
                    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)aq));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scv));
                }
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q8_256 *a = ACT256(r, i);
            int off = 0;
            for (int k = 0; k < 16; k++) off += b->scales[k] * bt_q8k_bsum(a, k);
            __m256i s = _mm256_sub_epi32(isum[r], _mm256_castsi128_si256(_mm_cvtsi32_si128(32 * off)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * a->s[0].d), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = hsum_ps(acc[r]);
}
BT_CPU_DOT_ROWS_DECL(avx2, q6_k) { NR_DISPATCH(kern_q6_k) }

/* ---- 16-bit activations, K-quants ----
 * Weight codes widen to int16 and are multiplied by their sub-block scale in int16 (Q4_K/Q5_K: 31 * 63 = 1953,
 * Q6_K: 32 * 128 = 4096, both < 2^15); madd_epi16 with the activations gives int32 lanes. The lanes are widened to
 * int64 and summed exactly once per super-block (Q6_K: per 128-element half), so the integer result equals the
 * reference's int64 and the float step is the reference's own expression: these kernels are bit-identical to
 * the scalar reference. Lane bounds: Q4_K/Q5_K 32 products per lane per super-block, 32 * 1953 * 32767
 * = 2047806432 < 2^31; Q6_K 16 products per half, 16 * 4096 * 32767 = 2147418112 < 2^31. */

#define ACT16K(r, i) ((const bt_block_q16_256 *)((const char *)act + (size_t)(r) * act_stride) + (i))

/* exact sum of 8 int32 lanes as int64 lanes, added to acc */
AI __m256i widen_add_epi64(__m256i acc, __m256i v)
{
    return _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                                                  _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1))));
}

AI int64_t hsum_epi64(__m256i v)
{
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
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
        __m256i isum[BT_CPU_MAX_NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
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
            const __m256i sl = _mm256_set1_epi16(sc[2 * c]), sh = _mm256_set1_epi16(sc[2 * c + 1]);
            /* sub-block 2c = elements 64c + 0..31 (lo), sub-block 2c + 1 = 64c + 32..63 (hi) */
            const __m256i w0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)), sl);
            const __m256i w1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)), sl);
            const __m256i w2 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)), sh);
            const __m256i w3 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1)), sh);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                const int16_t *aq = ACT16K(r, i)->s[2 * c].qs, *aq2 = ACT16K(r, i)->s[2 * c + 1].qs;
                __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)aq));
                __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(aq + 16)));
                __m256i p2 = _mm256_madd_epi16(w2, _mm256_loadu_si256((const __m256i *)aq2));
                __m256i p3 = _mm256_madd_epi16(w3, _mm256_loadu_si256((const __m256i *)(aq2 + 16)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_add_epi32(p0, p1),
                                                                     _mm256_add_epi32(p2, p3)));
            }
        }
        const float dw = h2f(d16), dmin = h2f(dmin16);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const bt_block_q16_256 *a = ACT16K(r, i);
            int64_t sumi = hsum_epi64(widen_add_epi64(_mm256_setzero_si256(), isum[r])), summ = 0;
            for (int j = 0; j < 8; j++) summ += (int64_t)mn[j] * a->s[j].sum;
            acc[r] += dw * a->s[0].d * (float)sumi - dmin * a->s[0].d * (float)summ;
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = acc[r];
}

AI void kern16_q4_k(KERNEL_ARGS) { qk45_q16_kernel(n, w_row, act, act_stride, NR, out, out_stride, 0); }
AI void kern16_q5_k(KERNEL_ARGS) { qk45_q16_kernel(n, w_row, act, act_stride, NR, out, out_stride, 1); }
BT_CPU_DOT_ROWS_DECL(avx2, q4_k_q16) { NR_DISPATCH(kern16_q4_k) }
BT_CPU_DOT_ROWS_DECL(avx2, q5_k_q16) { NR_DISPATCH(kern16_q5_k) }

AI void kern16_q6_k(KERNEL_ARGS)
{
    const int64_t nb = n / BT_QK_K;
    float acc[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi16(32);
    for (int64_t i = 0; i < nb; i++) {
        const bt_block_q6_k *b = (const bt_block_q6_k *)w_row + i;
        __m256i i64[BT_CPU_MAX_NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) i64[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i isum[BT_CPU_MAX_NR];
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256();
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                __m256i lo = (s & 1) ? ql1 : ql0;
                if (s >> 1) lo = _mm256_srli_epi16(lo, 4);
                __m256i q = _mm256_or_si256(_mm256_and_si256(lo, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), m2), 4));
                int k = 8 * h + 2 * s; /* elements 128h + 32s + 0..15 use scales[k], + 16..31 scales[k + 1] */
                __m256i w0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(q)), off);
                __m256i w1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1)), off);
                w0 = _mm256_mullo_epi16(w0, _mm256_set1_epi16(b->scales[k]));
                w1 = _mm256_mullo_epi16(w1, _mm256_set1_epi16(b->scales[k + 1]));
                #pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    const int16_t *aq = ACT16K(r, i)->s[4 * h + s].qs;
                    __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)aq));
                    __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(aq + 16)));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(p0, p1));
                }
            }
            #pragma GCC unroll 4
            for (int r = 0; r < NR; r++) i64[r] = widen_add_epi64(i64[r], isum[r]);
        }
        const float dw = h2f(b->d);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[r] += dw * ACT16K(r, i)->s[0].d * (float)hsum_epi64(i64[r]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) out[(size_t)r * out_stride] = acc[r];
}
BT_CPU_DOT_ROWS_DECL(avx2, q6_k_q16) { NR_DISPATCH(kern16_q6_k) }

/* Float weights: two 8-lane accumulators per row (16 elements per step), 8-element step, then a scalar tail. */
AI __m256 load_w8(const void *w, int64_t i, const int type)
{
    if (type == BT_TYPE_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (type == BT_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI float load_w1(const void *w, int64_t i, const int type)
{
    if (type == BT_TYPE_F32) return ((const float *)w)[i];
    if (type == BT_TYPE_F16) return bt_fp16_to_f32(((const uint16_t *)w)[i]);
    return bt_bf16_to_f32(((const uint16_t *)w)[i]);
}

AI void float_kernel(KERNEL_ARGS, const int type)
{
    __m256 acc0[BT_CPU_MAX_NR], acc1[BT_CPU_MAX_NR];
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 w0 = load_w8(w_row, i, type), w1 = load_w8(w_row, i + 8, type);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
            acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), acc0[r]);
            acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i + 8), acc1[r]);
        }
    }
    if (i + 8 <= n) {
        __m256 w0 = load_w8(w_row, i, type);
        #pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
            acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i), acc0[r]);
        }
        i += 8;
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const float *x = (const float *)((const char *)act + (size_t)r * act_stride);
        float s = hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
        for (int64_t j = i; j < n; j++) s += load_w1(w_row, j, type) * x[j];
        out[(size_t)r * out_stride] = s;
    }
}

AI void kern_f32(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_F32); }
AI void kern_f16(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_F16); }
AI void kern_bf16(KERNEL_ARGS) { float_kernel(n, w_row, act, act_stride, NR, out, out_stride, BT_TYPE_BF16); }
BT_CPU_DOT_ROWS_DECL(avx2, f32) { NR_DISPATCH(kern_f32) }
BT_CPU_DOT_ROWS_DECL(avx2, f16) { NR_DISPATCH(kern_f16) }
BT_CPU_DOT_ROWS_DECL(avx2, bf16) { NR_DISPATCH(kern_bf16) }

/* ---- activation quantization (same bytes as the scalar reference) ---- */

/* Quantizes 32 floats with the inverse scale id into 32 int8 (round half even); returns their sum. */
AI int quant32(const float *x, __m256 id, int8_t *q)
{
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    int s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
    /* packs interleave 128-bit lanes; the permute restores element order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return s;
}

AI __m256 abs_max8(const float *x, int n, __m256 m)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    return m;
}

AI float hmax_ps(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void bt_cpu_avx2_quantize_q8_32(int64_t n, const float *x, bt_block_q8_32 *y)
{
    for (int64_t i = 0; i < n / BT_QK; i++, x += BT_QK) {
        float amax = hmax_ps(abs_max8(x, BT_QK, _mm256_setzero_ps()));
        float d = amax / 127.0f;
        float id = bt_act_inv_scale(d);
        y[i].d = d;
        int s = quant32(x, _mm256_set1_ps(id), y[i].qs);
        y[i].sum = s;
        y[i].ds = d * (float)s;
        y[i].sum_lo = 0;
    }
}

void bt_cpu_avx2_quantize_q8_256(int64_t n, const float *x, bt_block_q8_256 *y)
{
    for (int64_t i = 0; i < n / BT_QK_K; i++, x += BT_QK_K) {
        float amax = hmax_ps(abs_max8(x, BT_QK_K, _mm256_setzero_ps()));
        float d = amax / 127.0f;
        float id = bt_act_inv_scale(d);
        __m256 idv = _mm256_set1_ps(id);
        for (int c = 0; c < 8; c++) {
            bt_block_q8_32 *sl = &y[i].s[c];
            quant32(x + 32 * c, idv, sl->qs);
            __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sl->qs));
            __m256i q2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sl->qs + 16)));
            sl->sum_lo = hsum_epi32(_mm256_madd_epi16(q, _mm256_set1_epi16(1)));
            sl->sum = sl->sum_lo + hsum_epi32(_mm256_madd_epi16(q2, _mm256_set1_epi16(1)));
        }
        bt_q8k_finish(&y[i], d);
    }
}

/* Quantizes 32 floats with the inverse scale id into 32 int16 (round half even; |codes| <= 32767 so packs never
 * saturates); s[0], s[1] get the sums of elements 0..15 and 16..31. */
AI void quant16x32(const float *x, __m256 id, int16_t *q, int *s)
{
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    s[0] = hsum_epi32(_mm256_add_epi32(i0, i1));
    s[1] = hsum_epi32(_mm256_add_epi32(i2, i3));
    /* packs interleaves 64-bit quarters [a0-3, b0-3, a4-7, b4-7]; the permute restores element order */
    _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xd8));
}

void bt_cpu_avx2_quantize_q16_32(int64_t n, const float *x, bt_block_q16_32 *y)
{
    for (int64_t i = 0; i < n / BT_QK; i++, x += BT_QK) {
        float amax = hmax_ps(abs_max8(x, BT_QK, _mm256_setzero_ps()));
        float d = amax / 32767.0f;
        float id = bt_act_inv_scale(d);
        int s[2];
        quant16x32(x, _mm256_set1_ps(id), y[i].qs, s);
        y[i].d = d;
        y[i].sum = s[0] + s[1];
        y[i].ds = d * (float)(s[0] + s[1]);
        y[i].sum_lo = 0;
    }
}

void bt_cpu_avx2_quantize_q16_256(int64_t n, const float *x, bt_block_q16_256 *y)
{
    for (int64_t i = 0; i < n / BT_QK_K; i++, x += BT_QK_K) {
        float amax = hmax_ps(abs_max8(x, BT_QK_K, _mm256_setzero_ps()));
        float d = amax / 32767.0f;
        float id = bt_act_inv_scale(d);
        __m256 idv = _mm256_set1_ps(id);
        for (int c = 0; c < 8; c++) {
            int s[2];
            quant16x32(x + 32 * c, idv, y[i].s[c].qs, s);
            y[i].s[c].sum_lo = s[0], y[i].s[c].sum = s[0] + s[1];
        }
        bt_q16k_finish(&y[i], d);
    }
}

/* ---- conversions ---- */

void bt_cpu_avx2_fp16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = bt_fp16_to_f32(x[i]);
}

void bt_cpu_avx2_f32_to_fp16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = bt_f32_to_fp16(x[i]);
}

void bt_cpu_avx2_bf16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i))), 16));
    for (; i < n; i++) y[i] = bt_bf16_to_f32(x[i]);
}

void bt_cpu_avx2_f32_to_bf16(int64_t n, const float *x, uint16_t *y)
{
    int64_t i = 0;
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(0x7fff)), lsb), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, absm), inf);
        __m256i qn = _mm256_or_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, qn, nan);
        __m256i p = _mm256_packus_epi32(r, r); /* values < 65536: no saturation */
        p = _mm256_permute4x64_epi64(p, 0x08);
        _mm_storeu_si128((__m128i *)(y + i), _mm256_castsi256_si128(p));
    }
    for (; i < n; i++) y[i] = bt_f32_to_bf16(x[i]);
}

/* The 8 lanes of dot8 are the 8 lanes of one register; mul and add stay separate (no FMA) to round as the scalar
 * reference does. */
void bt_cpu_avx2_attn_scores(int64_t n, const float *q, const float *k, size_t k_stride, int64_t nk, float scale,
                             float *out)
{
    for (int64_t j = 0; j < nk; j++) {
        const float *kr = k + (size_t)j * k_stride;
        __m256 l = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) l = _mm256_add_ps(l, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kr + i)));
        __m128 lo = _mm256_castps256_ps128(l), hi = _mm256_extractf128_ps(l, 1);
        /* [l0 + l1, l2 + l3, l4 + l5, l6 + l7] */
        __m128 p = _mm_add_ps(_mm_shuffle_ps(lo, hi, 0x88), _mm_shuffle_ps(lo, hi, 0xdd));
        __m128 s = _mm_add_ps(p, _mm_movehdup_ps(p)); /* lanes 0, 2: (l0+l1)+(l2+l3), (l4+l5)+(l6+l7) */
        out[j] = (_mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_movehl_ps(s, s))) * scale;
    }
}

/* acc stays in registers across the nv rows, 32 elements at a time; per element the same mul, then add, in j order */
void bt_cpu_avx2_attn_accum(int64_t n, const float *w, const float *v, size_t v_stride, int64_t nv, float *acc)
{
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8);
        __m256 a2 = _mm256_loadu_ps(acc + i + 16), a3 = _mm256_loadu_ps(acc + i + 24);
        for (int64_t j = 0; j < nv; j++) {
            const float *vr = v + (size_t)j * v_stride + i;
            __m256 wj = _mm256_set1_ps(w[j]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wj, _mm256_loadu_ps(vr)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wj, _mm256_loadu_ps(vr + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wj, _mm256_loadu_ps(vr + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wj, _mm256_loadu_ps(vr + 24)));
        }
        _mm256_storeu_ps(acc + i, a0), _mm256_storeu_ps(acc + i + 8, a1);
        _mm256_storeu_ps(acc + i + 16, a2), _mm256_storeu_ps(acc + i + 24, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(acc + i);
        for (int64_t j = 0; j < nv; j++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + (size_t)j * v_stride + i)));
        _mm256_storeu_ps(acc + i, a);
    }
    for (; i < n; i++)
        for (int64_t j = 0; j < nv; j++) acc[i] += w[j] * v[(size_t)j * v_stride + i];
}

/* ---- attention and elementwise ops: the arithmetic of the scalar references, the 16 lanes of their sums in two
 * registers ---- */

AI __m256 exp8(__m256 x)
{
    __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(BT_EXP_LO), _CMP_LT_OQ);
    __m256 hi = _mm256_cmp_ps(x, _mm256_set1_ps(BT_EXP_HI), _CMP_GT_OQ);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(BT_EXP_LOG2E));
    __m256 nf = _mm256_sub_ps(_mm256_add_ps(t, _mm256_set1_ps(BT_EXP_MAGIC)), _mm256_set1_ps(BT_EXP_MAGIC));
    __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-BT_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-BT_EXP_LN2_LO), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(BT_EXP_P5), r, _mm256_set1_ps(BT_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BT_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BT_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BT_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(BT_EXP_P0));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(nf), 23);
    __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), lo);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), hi);
    return _mm256_blendv_ps(y, x, nan);
}

/* tree16 of the scalar reference, lanes 0..7 in lo and 8..15 in hi */
AI float tree16_2(__m256 lo, __m256 hi)
{
    __m256 b = _mm256_add_ps(lo, hi);
    __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* 8 elements of row j of a KV block from element i, dequantized as kv_elem of the scalar reference does; sm: U8
 * only, the (scale, min) pairs of the rows of `which` as floats (kv_sm_f32) */
AI __m256 kv_load8(const bt_cpu_kv_rows *kv, const int which, const int type, int64_t n, int j, int64_t i,
                   const float *sm)
{
    const void *base = which ? kv->v : kv->k;
    size_t e = (size_t)j * (size_t)n + (size_t)i;
    if (type == BT_CPU_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + e)));
    if (type == BT_CPU_KV_U8) {
        __m128i codes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + e));
        __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
        return _mm256_fmadd_ps(_mm256_set1_ps(sm[2 * j]), c, _mm256_set1_ps(sm[2 * j + 1]));
    }
    return _mm256_loadu_ps((const float *)base + e);
}

/* The fp16 (scale, min) pairs of nk U8 rows as floats, out[2 * nk]: one exact conversion per block, not two scalar
 * ones per 8-element load (as the AVX-512 kernel does). */
AI void kv_sm_f32(const uint16_t *sm, int nk, float *out)
{
    uint16_t h[2 * BT_CPU_ATTN_BLOCK] = {0};
    memcpy(h, sm, sizeof(uint16_t) * 2 * (size_t)nk);
    for (int i = 0; i < 2 * BT_CPU_ATTN_BLOCK; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
}

/* query heads handled together: each K/V element is loaded and converted once for all of them (4: GQA groups of 4,
 * as Gemma 3, Llama 3 and Mistral have, in one pass) */
#define ATTN_NH 4

/* tree16 of 4 keys at once from their b (lanes t + (t + 8) of the 16 lanes of a dot, as tree16's first step): the
 * 128-bit halves of two keys' b added (c_t = b_t + b_(t+4)), then c_0 + c_2 and c_1 + c_3 side by side. Returns
 * [d0 d1 of b[0], d0 d1 of b[2] | d0 d1 of b[1], d0 d1 of b[3]], where each key's tree16 is d0 + d1. */
AI __m256 tree16_x4(const __m256 *b)
{
    const __m256 c01 = _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
    const __m256 c23 = _mm256_add_ps(_mm256_permute2f128_ps(b[2], b[3], 0x20), _mm256_permute2f128_ps(b[2], b[3], 0x31));
    return _mm256_add_ps(_mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* tree16 * scale of 8 keys' b, in key order */
AI __m256 tree16_x8(const __m256 *b, float scale)
{
    const __m256 g0 = tree16_x4(b), g1 = tree16_x4(b + 4);
    /* d0 + d1 of keys [0 2 4 6 | 1 3 5 7] */
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(g0, g1, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_mul_ps(_mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), _mm256_set1_ps(scale));
}

/* The reference's running max over a block's 16 scores (lanes 0-7 in s0, 8-15 in s1; -inf past nk) from m, to the
 * bit: vmaxps returns its second operand where the first is NaN, so a NaN score is passed over as the reference's
 * s[j] > mn passes it (a NaN m stays), and equal values other than zeros have the same bits. Zeros are the one tie
 * whose pick shows (+0 against -0): the reference keeps the first of m, s[0], s[1], ... that is zero, which the
 * vector max does not track, so a zero maximum is looked up again in that order (it gives the same exp of every
 * difference either way, but m is stored). */
AI float max16(__m256 s0, __m256 s1, float m)
{
    const __m256 x = _mm256_max_ps(s1, _mm256_max_ps(s0, _mm256_set1_ps(m)));
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    const float mx = _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
    if (mx != 0.0f || m == 0.0f) return mx != 0.0f ? mx : m;
    float s[16];
    _mm256_storeu_ps(s, s0);
    _mm256_storeu_ps(s + 8, s1);
    return bt_cpu_first_zero16(s, mx);
}

/* attn_heads8's V pass over elements [i, i + 16 * SL) of NH heads (SL * NH <= 6 slices: 12 accumulators at most,
 * beside the NH weights and a V vector). */
AI void v_slices(int64_t n, const int NH, const int SL, int64_t i, const bt_cpu_kv_rows *kv, const float *vsm, int nk,
                 const float (*w)[16], const __m256 *c, float *acc, const int type, const bt_cpu_pf *pfv)
{
    __m256 a[ATTN_NH][8];
#pragma GCC unroll 8
    for (int u = 0; u < 2 * SL; u++) {
        if (u % 2 == 0) bt_cpu_pf_part(pfv, (int)(i / 16) + u / 2);
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++)
            a[h][u] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)h * (size_t)n + (size_t)i + 8 * (size_t)u), c[h]);
    }
    for (int j = 0; j < nk; j++) {
        __m256 wv[ATTN_NH];
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) wv[h] = _mm256_broadcast_ss(&w[h][j]);
#pragma GCC unroll 8
        for (int u = 0; u < 2 * SL; u++) {
            const __m256 v = kv_load8(kv, 1, type, n, j, i + 8 * u, vsm);
#pragma GCC unroll 4
            for (int h = 0; h < NH; h++) a[h][u] = _mm256_fmadd_ps(wv[h], v, a[h][u]);
        }
    }
#pragma GCC unroll 8
    for (int u = 0; u < 2 * SL; u++)
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) _mm256_storeu_ps(acc + (size_t)h * (size_t)n + (size_t)i + 8 * (size_t)u, a[h][u]);
}

/* attn_block for NH (1..ATTN_NH) query heads. Per key, each head's 16 dot lanes (mul over elements 0..15, then fma,
 * as the scalar reference) in two registers, lanes 0-7 and 8-15, whose sum is kept (tree16's first step); the
 * scores of 8 keys are then reduced together. */
AI void attn_heads8(int64_t n, const int NH, const float *q, float scale, const bt_cpu_kv_rows *kv, const float *ksm,
                    const float *vsm, int nk, float *m, float *l, float *acc, const int type, int pf)
{
    const void *pf_k = pf ? kv->pf_k : NULL, *pf_v = pf ? kv->pf_v : NULL;
    const bt_cpu_pf pfk = bt_cpu_pf_plan(pf_k, kv->pf_bytes, nk), pfv = bt_cpu_pf_plan(pf_v, kv->pf_bytes, (int)(n / 16));
    __m256 b[ATTN_NH][BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < nk; j++) {
        bt_cpu_pf_part(&pfk, j);
        __m256 lo[ATTN_NH], hi[ATTN_NH];
        const __m256 k0 = kv_load8(kv, 0, type, n, j, 0, ksm), k1 = kv_load8(kv, 0, type, n, j, 8, ksm);
        for (int h = 0; h < NH; h++) {
            lo[h] = _mm256_mul_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)n), k0);
            hi[h] = _mm256_mul_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)n + 8), k1);
        }
        for (int64_t i = 16; i < n; i += 16) {
            const __m256 ka = kv_load8(kv, 0, type, n, j, i, ksm), kb = kv_load8(kv, 0, type, n, j, i + 8, ksm);
            for (int h = 0; h < NH; h++) {
                lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)n + (size_t)i), ka, lo[h]);
                hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * (size_t)n + (size_t)i + 8), kb, hi[h]);
            }
        }
        for (int h = 0; h < NH; h++) b[h][j] = _mm256_add_ps(lo[h], hi[h]);
    }
    for (int j = nk; j < (nk > 8 ? 16 : 8); j++) /* masked out below whatever their dots */
        for (int h = 0; h < NH; h++) b[h][j] = _mm256_setzero_ps();
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nk), idx));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nk - 8), idx));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    float w[ATTN_NH][16], mn[8] = {0}, dm[8] = {0}, cs[8];
    __m256 s0[ATTN_NH], s1[ATTN_NH], c[ATTN_NH];
    for (int h = 0; h < NH; h++) {
        s0[h] = _mm256_blendv_ps(ninf, tree16_x8(b[h], scale), valid0);
        s1[h] = nk > 8 ? _mm256_blendv_ps(ninf, tree16_x8(b[h] + 8, scale), valid1) : ninf;
        mn[h] = max16(s0[h], s1[h], m[h]);
        dm[h] = m[h] - mn[h];
    }
    /* every head's rescale exp(m - mn) in one exp8, lane h */
    _mm256_storeu_ps(cs, exp8(_mm256_loadu_ps(dm)));
    for (int h = 0; h < NH; h++) {
        const __m256 vmn = _mm256_set1_ps(mn[h]);
        c[h] = _mm256_set1_ps(cs[h]);
        const __m256 w0 = exp8(_mm256_sub_ps(s0[h], vmn)), w1 = exp8(_mm256_sub_ps(s1[h], vmn));
        l[h] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(l[h]), _mm_set_ss(cs[h]), _mm_set_ss(tree16_2(w0, w1))));
        _mm256_storeu_ps(w[h], w0);
        _mm256_storeu_ps(w[h] + 8, w1);
        m[h] = mn[h];
    }
    /* acc = acc * c, then fmaf(w_j, V_j, acc) for j ascending: each head's element i is one chain of nk fmas in the
     * reference's order, so chains only come side by side, SL * 16 elements of every head at a time (2 * SL * NH
     * chains in flight; the fma's latency needs ~8 of them to keep both pipes busy) */
    const int SL = NH == 1 ? 4 : NH <= 3 ? 2 : 1;
    int64_t i = 0;
    for (; i + 16 * SL <= n; i += 16 * SL)
        v_slices(n, NH, SL, i, kv, vsm, nk, (const float(*)[16])w, c, acc, type, &pfv);
    for (; i < n; i += 16) v_slices(n, NH, 1, i, kv, vsm, nk, (const float(*)[16])w, c, acc, type, &pfv);
}

AI void attn_block8(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk, float *m,
                    float *l, float *acc, const int type)
{
    float ksm[2 * BT_CPU_ATTN_BLOCK], vsm[2 * BT_CPU_ATTN_BLOCK]; /* U8: (scale, min) of each row as floats */
    if (type == BT_CPU_KV_U8) {
        kv_sm_f32(kv->k_sm, nk, ksm);
        kv_sm_f32(kv->v_sm, nk, vsm);
    }
    for (int h = 0; h < nq; h += ATTN_NH) {
        const float *qh = q + (size_t)h * (size_t)n;
        float *ah = acc + (size_t)h * (size_t)n;
        switch (nq - h < ATTN_NH ? nq - h : ATTN_NH) {
        case 1: attn_heads8(n, 1, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        case 2: attn_heads8(n, 2, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        case 3: attn_heads8(n, 3, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        default: attn_heads8(n, 4, qh, scale, kv, ksm, vsm, nk, m + h, l + h, ah, type, h == 0); break;
        }
    }
}

void bt_cpu_avx2_attn_block(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk,
                            float *m, float *l, float *acc)
{
    if (n % 16 || nk < 1 || nk > 16) { /* 16-lane rows only; the reference covers the rest with the same bits */
        bt_cpu_pf_all(kv->pf_k, kv->pf_bytes); /* the hints this kernel promises, in one go */
        bt_cpu_pf_all(kv->pf_v, kv->pf_bytes);
        bt_cpu_scalar_attn_block(n, nq, q, scale, kv, nk, m, l, acc);
        return;
    }
    switch (kv->type) {
    case BT_CPU_KV_F16: attn_block8(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_F16); break;
    case BT_CPU_KV_U8: attn_block8(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_U8); break;
    default: attn_block8(n, nq, q, scale, kv, nk, m, l, acc, BT_CPU_KV_F32); break;
    }
}

/* ---- attn_block_rows: BT_CPU_ATTN_ROWS query rows in the lanes of two vectors (rows 0-7, 8-15) ---- */

/* c_t of tree16 (b_t + b_(t+4), b_t = x_t + x_(t+8)) of the rows of NV row vectors against key row k, for T values
 * of t from t0 (T * NV = 2: 8 chains in flight). Lane x_t of a row is its chain over elements t, t + 16, ...: the
 * product of the first, then fmas, as the reference's x[t]; k[i] is broadcast, qt holds element i of the 16 rows. */
AI void rows_c(const int64_t n, const int NV, const int T, const float *qt, const float *k, int t0, __m256 (*c)[2])
{
    __m256 x[2][4][2];
#pragma GCC unroll 2
    for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 4
        for (int e = 0; e < 4; e++) {
            const int ln = t0 + tt + (e & 1) * 8 + (e >> 1) * 4; /* t, t + 8, t + 4, t + 12 */
            const __m256 kb = _mm256_broadcast_ss(k + ln);
#pragma GCC unroll 2
            for (int h = 0; h < NV; h++)
                x[tt][e][h] = _mm256_mul_ps(_mm256_loadu_ps(qt + BT_CPU_ATTN_ROWS * ln + 8 * h), kb);
        }
#pragma GCC unroll 16
    for (int64_t i = 16; i < n; i += 16)
#pragma GCC unroll 2
        for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 4
            for (int e = 0; e < 4; e++) {
                const int64_t ln = i + t0 + tt + (e & 1) * 8 + (e >> 1) * 4;
                const __m256 kb = _mm256_broadcast_ss(k + ln);
#pragma GCC unroll 2
                for (int h = 0; h < NV; h++)
                    x[tt][e][h] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(qt + BT_CPU_ATTN_ROWS * ln + 8 * h), kb, x[tt][e][h]);
            }
#pragma GCC unroll 2
    for (int tt = 0; tt < T; tt++)
#pragma GCC unroll 2
        for (int h = 0; h < NV; h++)
            c[tt][h] = _mm256_add_ps(_mm256_add_ps(x[tt][0][h], x[tt][1][h]), _mm256_add_ps(x[tt][2][h], x[tt][3][h]));
}

/* R (1..4) rows' V pass from row r0: acc = acc * c, then fma(w_j, V_j, acc) for j ascending, 24 elements a step,
 * then 8 (n is a multiple of 16) */
AI void rows_v(const int64_t n, const int R, int r0, const float *v, int nk, const float (*w)[8], const float *cs,
               float *acc)
{
    int64_t i = 0;
    for (; i + 24 <= n; i += 24) {
        __m256 a[4][3];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 3
            for (int u = 0; u < 3; u++)
                a[r][u] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)(i + 8 * u)),
                                        _mm256_set1_ps(cs[r0 + r]));
        for (int j = 0; j < nk; j++) {
            const float *vj = v + (size_t)j * (size_t)n + (size_t)i;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256 wr = _mm256_broadcast_ss(&w[j][r0 + r]);
#pragma GCC unroll 3
                for (int u = 0; u < 3; u++) a[r][u] = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vj + 8 * u), a[r][u]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 3
            for (int u = 0; u < 3; u++)
                _mm256_storeu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)(i + 8 * u), a[r][u]);
    }
    for (; i < n; i += 8) {
        __m256 a[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            a[r] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i), _mm256_set1_ps(cs[r0 + r]));
        for (int j = 0; j < nk; j++)
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w[j][r0 + r]),
                                       _mm256_loadu_ps(v + (size_t)j * (size_t)n + (size_t)i), a[r]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm256_storeu_ps(acc + (size_t)(r0 + r) * (size_t)n + (size_t)i, a[r]);
    }
}

/* The softmax step and V pass of nr (1..8) rows, one lane each, from their 16 score vectors s (key j: -inf past
 * nk). The reference's order: mn = m, then for j < nk mn = max(s_j, mn), which vmaxps with s_j first gives to the
 * bit (the second operand where equal, zeros of either sign included, or where s_j is NaN: mn stays); c = exp(m -
 * mn); w_j = exp(s_j - mn); l = fma(l, c, tree16(w)), the tree vertical over the key vectors. */
AI void rows_softmax_v(const int64_t n, int nr, const __m256 *s, const float *v, int nk, float *m, float *l, float *acc)
{
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 m0 = _mm256_maskload_ps(m, mask);
    __m256 mn = m0;
    for (int j = 0; j < nk; j++) mn = _mm256_max_ps(s[j], mn);
    const __m256 c = exp8(_mm256_sub_ps(m0, mn));
    float w[BT_CPU_ATTN_BLOCK][8] __attribute__((aligned(32))), cs[8] __attribute__((aligned(32)));
    __m256 wv[BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        wv[j] = exp8(_mm256_sub_ps(s[j], mn));
        _mm256_store_ps(w[j], wv[j]);
    }
    __m256 b[8];
    for (int t = 0; t < 8; t++) b[t] = _mm256_add_ps(wv[t], wv[t + 8]);
    for (int t = 0; t < 4; t++) b[t] = _mm256_add_ps(b[t], b[t + 4]);
    const __m256 tw = _mm256_add_ps(_mm256_add_ps(b[0], b[2]), _mm256_add_ps(b[1], b[3]));
    _mm256_maskstore_ps(l, mask, _mm256_fmadd_ps(_mm256_maskload_ps(l, mask), c, tw));
    _mm256_maskstore_ps(m, mask, mn);
    _mm256_store_ps(cs, c);
    for (int r0 = 0; r0 < nr; r0 += 4) switch (nr - r0 < 4 ? nr - r0 : 4) {
        case 1: rows_v(n, 1, r0, v, nk, (const float(*)[8])w, cs, acc); break;
        case 2: rows_v(n, 2, r0, v, nk, (const float(*)[8])w, cs, acc); break;
        case 3: rows_v(n, 3, r0, v, nk, (const float(*)[8])w, cs, acc); break;
        default: rows_v(n, 4, r0, v, nk, (const float(*)[8])w, cs, acc); break;
        }
}

/* NV row vectors (1: nr <= 8) */
AI void rows_block(const int64_t n, const int NV, int nr, const float *qt, float scale, const float *k, const float *v,
                   int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint)
{
    /* the hints' K and V lines, a sixteenth of each per key of the score pass */
    const bt_cpu_pf pfk = bt_cpu_pf_plan(hint ? hint->pf_k : NULL, hint ? hint->pf_bytes : 0, BT_CPU_ATTN_BLOCK);
    const bt_cpu_pf pfv = bt_cpu_pf_plan(hint ? hint->pf_v : NULL, hint ? hint->pf_bytes : 0, BT_CPU_ATTN_BLOCK);
    __m256 s[2][BT_CPU_ATTN_BLOCK];
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
        bt_cpu_pf_part(&pfk, j);
        bt_cpu_pf_part(&pfv, j);
        if (j >= nk) {
            s[0][j] = s[1][j] = _mm256_set1_ps(-INFINITY);
            continue;
        }
        const float *kj = k + (size_t)j * (size_t)n;
        __m256 c[4][2];
        if (NV == 1) {
            rows_c(n, 1, 2, qt, kj, 0, c);
            rows_c(n, 1, 2, qt, kj, 2, c + 2);
        } else {
            for (int t = 0; t < 4; t++) rows_c(n, 2, 1, qt, kj, t, c + t);
        }
#pragma GCC unroll 2
        for (int h = 0; h < NV; h++)
            s[h][j] = _mm256_mul_ps(_mm256_add_ps(_mm256_add_ps(c[0][h], c[2][h]), _mm256_add_ps(c[1][h], c[3][h])),
                                    _mm256_set1_ps(scale));
    }
#pragma GCC unroll 2
    for (int h = 0; h < NV; h++) {
        const int rows = nr - 8 * h < 8 ? nr - 8 * h : 8;
        rows_softmax_v(n, rows, s[h], v, nk, m + 8 * h, l + 8 * h, acc + (size_t)(8 * h) * (size_t)n);
    }
}

void bt_cpu_avx2_attn_block_rows(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                 int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint)
{
    if (n % 16 || n < 16 || n > 256 || nk < 1 || nk > BT_CPU_ATTN_BLOCK || nr < 1 || nr > BT_CPU_ATTN_ROWS) {
        bt_cpu_pf_all(hint ? hint->pf_k : NULL, hint ? hint->pf_bytes : 0); /* the hints, in one go */
        bt_cpu_pf_all(hint ? hint->pf_v : NULL, hint ? hint->pf_bytes : 0);
        bt_cpu_attn_block_rows_ref(n, nr, qt, scale, k, v, nk, m, l, acc, NULL);
        return;
    }
    /* the head sizes models have, unrolled; any other multiple of 16 in a loop */
#define ROWS_N(N)                                                                                              \
    (nr > 8 ? rows_block(N, 2, nr, qt, scale, k, v, nk, m, l, acc, hint)                                      \
            : rows_block(N, 1, nr, qt, scale, k, v, nk, m, l, acc, hint))
    switch (n) {
    case 64: ROWS_N(64); break;
    case 128: ROWS_N(128); break;
    case 256: ROWS_N(256); break;
    default: ROWS_N(n); break;
    }
#undef ROWS_N
}

void bt_cpu_avx2_swiglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 e = exp8(_mm256_xor_ps(gv, sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    if (i < n) bt_cpu_scalar_swiglu(n - i, g + i, u + i, out + i);
}

void bt_cpu_avx2_geglu(int64_t n, const float *g, const float *u, float *out)
{
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), a = _mm256_set1_ps(BT_GELU_A), k = _mm256_set1_ps(BT_GELU_K);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 z = _mm256_mul_ps(_mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), a), x, x), k);
        __m256 d = _mm256_add_ps(one, exp8(z));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, d), _mm256_loadu_ps(u + i)));
    }
    if (i < n) bt_cpu_scalar_geglu(n - i, g + i, u + i, out + i);
}

void bt_cpu_avx2_rmsnorm(int64_t n, const float *x, const float *w, float eps, float *out)
{
    if (n % 8) {
        bt_cpu_scalar_rmsnorm(n, x, w, eps, out);
        return;
    }
    __m256d l0 = _mm256_setzero_pd(), l1 = _mm256_setzero_pd(); /* lanes 0..3, 4..7 */
    for (int64_t i = 0; i < n; i += 8) {
        __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        l0 = _mm256_add_pd(l0, _mm256_mul_pd(v0, v0));
        l1 = _mm256_add_pd(l1, _mm256_mul_pd(v1, v1));
    }
    __m256d b = _mm256_add_pd(l0, l1);
    __m128d c = _mm_add_pd(_mm256_castpd256_pd128(b), _mm256_extractf128_pd(b, 1));
    double ss = _mm_cvtsd_f64(_mm_add_sd(c, _mm_unpackhi_pd(c, c)));
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    __m256 sv = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
}

const bt_cpu_ops bt_cpu_ops_avx2 = {
    .isa = BT_CPU_ISA_AVX2,
    .name = "avx2",
    BT_CPU_AVX2_SHARED_SLOTS,
    BT_CPU_AVX2_GEMM_SLOTS(avx2), /* cpu_avx2_gemm.c */
};

/* Everything but the GEMM is the AVX2 table's: the AVX-VNNI dot instructions serve the tiled matmuls only. */
const bt_cpu_ops bt_cpu_ops_avx2_vnni = {
    .isa = BT_CPU_ISA_AVX2_VNNI,
    .name = "avx2-vnni",
    BT_CPU_AVX2_SHARED_SLOTS,
    BT_CPU_AVX2_GEMM_SLOTS(avx2_vnni), /* cpu_avx2_gemm.c built again with BT_AVX2_GEMM_VNNI (cpu_avx2_vnni_gemm.c) */
};
