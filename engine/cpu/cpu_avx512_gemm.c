/* AVX-512 VNNI tiled GEMM over packed weights (layouts in cpu_gemm.c): a 16-row group times up to BT_CPU_GEMM_NR
 * (8) activation rows, here 16 (bt_cpu_ops_avx512.gemm_nr). Each code vector holds 4 codes (8-bit layouts) or 2
 * int16 codes (16-bit) of each of the 16 rows; the matching activation dword is broadcast from memory, so vpdpbusd /
 * vpdpwssd leave each row's block dot in its own lane with no horizontal sum. Each code vector is decoded once and
 * at once used by every row of the tile, one integer chain per row or more (CHAINS); per lane and block the integer
 * dot is exact whatever the chains, then converted and accumulated exactly as bt_cpu_gemm_packed_ref does, so nr
 * never changes a bit.
 * Measured on Zen 4 (bench_cpu_kernels --gemm): the decode ops (and, shifts) issue beside vpdpwssd; what costs
 * are the float ops per block and row (mul, fma, and for Q4_1 the min fma) and, at 16 rows, waiting on the weights
 * from memory, hence the prefetch of the next group (~60% -> ~78% of the vpdpwssd rate for Q4_1).
 * Q5_0 and Q5_1 with 16-bit activations are Q4_0 / Q4_1 nibbles plus a high-bit plane whose 32-bit word t is the
 * lane mask of operand t: one masked vpaddw of 16 per operand, loaded straight into a mask register. Q5_K is packed
 * the same way for this ISA alone (Q4_K's nibbles and the plane: bt_cpu_ops_avx512.gemm16_planes).
 * Lane bounds per block: 8-bit 32 * 255 * 127 < 2^21, 16-bit 32 * 128 * 32767 < 2^28 (Q8_0; beyond 2^24 the
 * conversion rounds, identically in the reference). */
#include <assert.h>
#include <immintrin.h>
#include <string.h>

#include "engine/cpu/cpu_gemm_layout.h"
#include "engine/cpu/cpu_impl.h"

#define AI static inline __attribute__((always_inline))

#define ACT8(r, b) BT_GL_ACT8(act, act_stride, r, b)
#define ACT16(r, b) BT_GL_ACT16(act, act_stride, r, b)

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

#define GEMM_ARGS int64_t n, const void *group, const void *next, const void *act, size_t act_stride, const int NR, \
                  float *out, size_t out_stride, int n_valid

/* The 16 integer scales at p as floats: signed bytes (Q6_K) or unsigned */
AI __m512 kq_scale_ps(const uint8_t *p, const int type)
{
    const __m128i v = _mm_load_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(type == BT_TYPE_Q6_K ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

/* The 16 rows' d and m of block b as floats (m zero for types without one; for Q6_K the two halves' d). K-quants:
 * d = A * s0, m = -(B * s1) or A * s1 (Q6_K), as cpu_gemm.c's kq_scales. */
AI void load_w_scales(const uint8_t *group, int64_t b, const int type, const size_t cb, __m512 *dw, __m512 *mw)
{
    if (bt_gl_kquant(type)) {
        const float *sup = bt_gl_kq_super(group, b, cb);
        const uint8_t *s = bt_gl_kq_bytes(group, b, cb);
        const __m512 a = _mm512_load_ps(sup);
        *dw = _mm512_mul_ps(a, kq_scale_ps(s, type));
        if (type == BT_TYPE_Q6_K) {
            *mw = _mm512_mul_ps(a, kq_scale_ps(s + BT_CPU_PACK_ROWS, type));
        } else { /* the sign flipped exactly, as -(x) */
            const __m512 m = _mm512_mul_ps(_mm512_load_ps(sup + BT_CPU_PACK_ROWS), kq_scale_ps(s + BT_CPU_PACK_ROWS, type));
            *mw = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32((int)0x80000000u)));
        }
        return;
    }
    const uint16_t *sc = bt_gl_scales(group, b, type, cb);
    *dw = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)sc));
    *mw = bt_gl_fp16_min(type) ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(sc + BT_CPU_PACK_ROWS)))
                               : _mm512_setzero_ps();
}

/* Integer chains per activation row: vpdpwssd / vpdpbusd take 4-6 cycles (~6 on an Intel Xeon, Emerald Rapids) at 2
 * a cycle, so 12 or more chains must be in flight: 4 for one row, 2 per row at 2-8 rows (16 chains and 8 float
 * accumulators fit in 32 registers at 8 rows; Q6_K, which also keeps its first half's sums, spills some to the stack
 * there, and measured no slower for it), 1 per row at 9-16 rows (bt_cpu_ops_avx512.gemm_nr; 8-bit Q6_K keeps 2
 * and runs those as two tiles). One chain per row from 4 rows on measured slower in most cases at 4-8 rows
 * (`bench_cpu_kernels --gemm --batch 4,8,16`, Intel Xeon with AMX, 2026-12-03; e.g. Q4_1 at 4 rows 59% against 71%
 * of the vpdpwssd rate then measured on 8 chains): a chain's latency is not hidden by the other rows' instructions
 * alone. A tile of 16 rows decodes each code vector once for 16 and needs no chain merge: on the Emerald Rapids
 * host, 16 rows in one call against two of 8 (bench_cpu_kernels --gemm, % of the 16-chain vpdpwssd rate) Q4_1
 * 576x1536 62-65 -> 66-67%, Q8_0 576x1536 67-70 -> 71-73%, Gemma 3's 640x262144 Q8_0 output matrix 57-60 -> 63-69%,
 * Q5_0 640x2048 52 -> 60%, Q4_K 46-48 -> 50%; Q4_0 about the same. The compiler spills some of the 16 rows'
 * activation pointers (registers run out), which costs less than what the wider tile saves. */
#define CHAINS(NR) ((NR) == 1 ? 4 : (NR) <= 8 ? 2 : 1)

/* Accumulator start of a block's integer dot: 0, or -off * sum(a) when the codes carry an offset (Q4_0: 8; Q5_0
 * with 16-bit activations: 16; Q8_0 with 8-bit activations: 128), so that the chain ends at the exact isum with no
 * subtraction. */
AI __m512i chain_init(int off, int32_t sum)
{
    return off ? _mm512_set1_epi32(-off * sum) : _mm512_setzero_si512();
}

/* acc = fma((float)isum, dw * d_a, acc), then for Q4_1 acc = fma(mw, ds_a, acc): bt_cpu_gemm_packed_ref's order */
AI __m512 block_accum(__m512 acc, __m512i isum, __m512 dw, __m512 mw, const int mins, float a_d, float a_ds)
{
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(a_d)), acc);
    return mins ? _mm512_fmadd_ps(mw, _mm512_set1_ps(a_ds), acc) : acc;
}

/* The rows' outputs two groups on: a matrix with many groups (the 49152-row output) writes each row's 64 bytes of
 * a group far apart (measured: a few % at 16 rows on the output matrix) */
AI void prefetch_out(const int NR, float *out, size_t out_stride)
{
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) __builtin_prefetch(out + (size_t)r * out_stride + 2 * BT_CPU_PACK_ROWS, 1, 3);
}

AI void store_rows(const int NR, const __m512 *acc, float *out, size_t out_stride, int n_valid)
{
    const __mmask16 k = (__mmask16)((1u << n_valid) - 1);
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) _mm512_mask_storeu_ps(out + (size_t)r * out_stride, k, acc[r]);
}

/* 8-bit activations: 8 code vectors per block (Q4: low and high nibbles of 4 loaded vectors), code vector i
 * paired with activation dword i. K-quants read their activations in the K-quant format; Q6_K's two halves (code
 * vectors 0..3 and 4..7) go to the even and the odd chains, each started at -32 * its activation sum. */
AI void gemm8_kernel(GEMM_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    const size_t cb = bt_gl_code_bytes(type, 0);
    const int mins = bt_gl_has_min(type), off = type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q8_0 ? 128 : 0;
    const int q6k = type == BT_TYPE_Q6_K;
    const int NC = q6k && CHAINS(NR) < 2 ? 2 : CHAINS(NR); /* Q6_K: its halves on the even and the odd chains */
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[BT_CPU_GEMM_NR_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    prefetch_out(NR, out, out_stride);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *cp = bt_gl_codes(group, b, type, cb);
        bt_gl_prefetch_block(next, b, type, 0);
        __m512i s[BT_CPU_GEMM_NR_MAX][4];
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            if (q6k) {
                int32_t h0, h1;
                bt_gl_act8_half_sums(act, act_stride, r, b, &h0, &h1);
                s[r][0] = chain_init(32, h0), s[r][1] = chain_init(32, h1);
            } else {
                s[r][0] = chain_init(off, off ? ACT8(r, b)->sum : 0);
                s[r][1] = _mm512_setzero_si512();
            }
#pragma GCC unroll 4
            for (int c = 2; c < NC; c++) s[r][c] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) { /* code vectors k and k + 4 */
            __m512i c0, c1;
            if (bt_gl_byte_codes(type, 0)) {
                c0 = _mm512_load_si512(cp + 64 * k), c1 = _mm512_load_si512(cp + 64 * (k + 4));
            } else {
                __m512i v = _mm512_load_si512(cp + 64 * k);
                c0 = _mm512_and_si512(v, m4), c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
#pragma GCC unroll 16
            for (int r = 0; r < NR; r++) {
                const int8_t *aq = bt_gl_act8_qs(act, act_stride, r, b);
                s[r][(2 * k) % NC] = dpbusd_b(s[r][(2 * k) % NC], c0, aq + 4 * k);
                s[r][(2 * k + 1) % NC] = dpbusd_b(s[r][(2 * k + 1) % NC], c1, aq + 4 * k + 16);
            }
        }
        __m512 dw, mw;
        load_w_scales(group, b, type, cb, &dw, &mw);
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            float ad, ads;
            bt_gl_act8_scales(act, act_stride, r, b, &ad, &ads);
            if (q6k) { /* acc = fma(isum0, d0 * d_a, acc), then the same for the second half */
                __m512i h0 = s[r][0], h1 = s[r][1];
                if (NC == 4) h0 = _mm512_add_epi32(h0, s[r][2]), h1 = _mm512_add_epi32(h1, s[r][3]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_mul_ps(dw, _mm512_set1_ps(ad)), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), _mm512_mul_ps(mw, _mm512_set1_ps(ad)), acc[r]);
                continue;
            }
            __m512i t = s[r][0];
#pragma GCC unroll 4
            for (int c = 1; c < NC; c++) t = _mm512_add_epi32(t, s[r][c]);
            acc[r] = block_accum(acc[r], t, dw, mw, mins, ad, ads);
        }
    }
    store_rows(NR, acc, out, out_stride, n_valid);
}

/* Chain (4k + u) % NC of every row += operand vector o[u] (u < 4) times the row's activation dword i_u of block b,
 * row by row: each row's activation pointer serves 4 products. The 16 rows' pointers do not fit in the registers;
 * one operand at a time across the rows reloaded them from the stack ~100 times a block at 16 rows. The integer sums
 * are exact in any order, so the bits are the same. bench_cpu_kernels --gemm --isa avx512 --bits 16 --threads 1,
 * Intel Xeon (Emerald Rapids), 3 alternated runs, % of the vpdpwssd rate: Q8_0 576x1536 at 16 rows 67-73 -> 72-74%,
 * Gemma 3's 640x262144 Q8_0 output at 64 rows 62-65 -> 63-69%, Q6_K at 64 rows 38-54 -> 57-60%, Q4_1 576x1536 at 16
 * rows 62-68 -> 65-69%, Q5_0 640x2048 57-60 -> 61-63%. */
AI void dot16_rows4(const int NR, const int NC, __m512i (*s)[4], const int k, const __m512i *o, const void *act,
                    size_t act_stride, int64_t b, const int i0, const int i1, const int i2, const int i3)
{
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) {
        const int16_t *p = bt_gl_act16_qs(act, act_stride, r, b);
        s[r][(4 * k) % NC] = dpwssd_b(s[r][(4 * k) % NC], o[0], p + 2 * i0);
        s[r][(4 * k + 1) % NC] = dpwssd_b(s[r][(4 * k + 1) % NC], o[1], p + 2 * i1);
        s[r][(4 * k + 2) % NC] = dpwssd_b(s[r][(4 * k + 2) % NC], o[2], p + 2 * i2);
        s[r][(4 * k + 3) % NC] = dpwssd_b(s[r][(4 * k + 3) % NC], o[3], p + 2 * i3);
    }
}

/* Operand vector o of a high-bit plane layout (Q5_0, Q5_1) with its fifth bits: 16 added to the int16 lanes whose bit
 * is set in the plane's word at w (one masked add; the mask register loads straight from the word). */
AI __m512i add_plane(__m512i o, const uint32_t *w, const __m512i c16)
{
    return _mm512_mask_add_epi16(o, _load_mask32((__mmask32 *)w), o, c16);
}

/* 16-bit activations: 16 int16-pair code vectors per block, used by every row as soon as they are decoded, 4 at a
 * time (the live set is 4 operands: a nibble layout's loaded vector and its 4 operands, or 4 byte-code vectors). */
AI void gemm16_kernel(GEMM_ARGS, const int type)
{
    const int W = type == BT_TYPE_Q5_K ? BT_GL_PLANES : 1; /* layout width: Q5_K's plane variant (gemm16_planes) */
    const int64_t nb = n / BT_QK;
    const size_t cb = bt_gl_code_bytes(type, W);
    const int mins = bt_gl_has_min(type), off = type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q5_0 ? 16 : 0;
    const int NC = CHAINS(NR), plane = bt_gl_plane(type, W);
    const __m512i m4 = _mm512_set1_epi32(0x000f000f), c16 = _mm512_set1_epi16(16);
    __m512 acc[BT_CPU_GEMM_NR_MAX];
#pragma GCC unroll 16
    for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
    prefetch_out(NR, out, out_stride);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *cp = bt_gl_codes(group, b, type, cb);
        bt_gl_prefetch_block(next, b, type, W);
        __m512i s[BT_CPU_GEMM_NR_MAX][4];
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            s[r][0] = chain_init(off, off ? ACT16(r, b)->sum : 0);
#pragma GCC unroll 4
            for (int c = 1; c < NC; c++) s[r][c] = _mm512_setzero_si512();
        }
        /* the block's weight scales before its codes (Q6_K needs them at mid-block): loaded at the end, where they
         * are used, the other types measured ~4% slower at 16 rows (Q4_1, Q5_0, Q4_K; bench_cpu_kernels --gemm) */
        __m512 dw, mw;
        load_w_scales(group, b, type, cb, &dw, &mw);
        if (bt_gl_byte_codes(type, W)) {
#pragma GCC unroll 4
            for (int k = 0; k < 16; k += 4) { /* codes 2k .. 2k + 7 */
                __m512i c[4];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++)
                    c[u] = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(cp + 32 * (k + u))));
                dot16_rows4(NR, NC, s, k / 4, c, act, act_stride, b, k, k + 1, k + 2, k + 3);
                if (type == BT_TYPE_Q6_K && k == 4) {
                    /* the first half's fma now, acc = fma(isum0, d0 * d_a, acc): the reference's order, and no
                     * register holds its sums through the second half (at 16 rows 48 vectors would be live) */
#pragma GCC unroll 16
                    for (int r = 0; r < NR; r++) {
                        __m512i h0 = s[r][0];
#pragma GCC unroll 4
                        for (int c2 = 1; c2 < NC; c2++) h0 = _mm512_add_epi32(h0, s[r][c2]);
#pragma GCC unroll 4
                        for (int c2 = 0; c2 < NC; c2++) s[r][c2] = _mm512_setzero_si512();
                        float ad, ads;
                        bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads);
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_mul_ps(dw, _mm512_set1_ps(ad)), acc[r]);
                    }
                }
            }
        } else {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) { /* low nibbles: codes 4k .. 4k+3, high ones 16 + the same */
                const __m512i v = _mm512_load_si512(cp + 64 * k);
                __m512i o[4] = {_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 8), m4),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_srli_epi16(v, 12)};
                if (plane) {
                    const uint32_t *hw = (const uint32_t *)(cp + 256) + 4 * k; /* words of operands 4k .. 4k+3 */
#pragma GCC unroll 4
                    for (int u = 0; u < 4; u++) o[u] = add_plane(o[u], hw + u, c16);
                }
                dot16_rows4(NR, NC, s, k, o, act, act_stride, b, 2 * k, 2 * k + 1, 2 * k + 8, 2 * k + 9);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < NR; r++) {
            __m512i t = s[r][0];
#pragma GCC unroll 4
            for (int c = 1; c < NC; c++) t = _mm512_add_epi32(t, s[r][c]);
            float ad, ads;
            bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads);
            if (type == BT_TYPE_Q6_K) { /* the second half: acc = fma(isum1, d1 * d_a, acc) */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(mw, _mm512_set1_ps(ad)), acc[r]);
                continue;
            }
            acc[r] = block_accum(acc[r], t, dw, mw, mins, ad, ads);
        }
    }
    store_rows(NR, acc, out, out_stride, n_valid);
}

#define GEMM_CASE(kernel, TYPE, k)                                                                             \
    case k: kernel(n, group, next, act, act_stride, k, out, out_stride, n_valid, TYPE); return;

#define GEMM_DISPATCH(kernel, TYPE)                                                                            \
    switch (nr) {                                                                                              \
        GEMM_CASE(kernel, TYPE, 1) GEMM_CASE(kernel, TYPE, 2) GEMM_CASE(kernel, TYPE, 3)                       \
        GEMM_CASE(kernel, TYPE, 4) GEMM_CASE(kernel, TYPE, 5) GEMM_CASE(kernel, TYPE, 6)                       \
        GEMM_CASE(kernel, TYPE, 7)                                                                             \
    default: kernel(n, group, next, act, act_stride, 8, out, out_stride, n_valid, TYPE); return;                     \
    }

/* 9..16 rows (bt_cpu_ops_avx512.gemm_nr) */
#define GEMM_DISPATCH16(kernel, TYPE)                                                                          \
    switch (nr) {                                                                                              \
        GEMM_CASE(kernel, TYPE, 9) GEMM_CASE(kernel, TYPE, 10) GEMM_CASE(kernel, TYPE, 11)                     \
        GEMM_CASE(kernel, TYPE, 12) GEMM_CASE(kernel, TYPE, 13) GEMM_CASE(kernel, TYPE, 14)                    \
        GEMM_CASE(kernel, TYPE, 15) GEMM_CASE(kernel, TYPE, 16)                                                \
    default: break;                                                                                            \
    }                                                                                                          \
    GEMM_DISPATCH(kernel, TYPE)

/* 8-bit Q6_K keeps two chains a row (its halves' sums), 32 at 16 rows: 9-16 rows run as two near-equal tiles */
#define GEMM(ty, TYPE)                                                                                         \
    BT_CPU_GEMM_DECL(avx512, ty)                                                                               \
    {                                                                                                          \
        assert(nr >= 1 && nr <= BT_CPU_GEMM_NR_MAX);                                                           \
        if (TYPE == BT_TYPE_Q6_K && nr > 8) {                                                                  \
            const int h = (nr + 1) / 2;                                                                        \
            bt_cpu_avx512_gemm_##ty(n, group, act, act_stride, h, out, out_stride, n_valid, next);             \
            bt_cpu_avx512_gemm_##ty(n, group, (const char *)act + (size_t)h * act_stride, act_stride, nr - h,  \
                                    out + (size_t)h * out_stride, out_stride, n_valid, NULL);                  \
            return;                                                                                            \
        }                                                                                                      \
        GEMM_DISPATCH16(gemm8_kernel, TYPE)                                                                    \
    }                                                                                                          \
    BT_CPU_GEMM_DECL(avx512, ty##_q16)                                                                         \
    {                                                                                                          \
        assert(nr >= 1 && nr <= BT_CPU_GEMM_NR_MAX);                                                           \
        GEMM_DISPATCH16(gemm16_kernel, TYPE)                                                                   \
    }

GEMM(q4_0, BT_TYPE_Q4_0)
GEMM(q4_1, BT_TYPE_Q4_1)
GEMM(q8_0, BT_TYPE_Q8_0)
GEMM(q5_1, BT_TYPE_Q5_1)
GEMM(q4_k, BT_TYPE_Q4_K)
GEMM(q5_k, BT_TYPE_Q5_K)
GEMM(q6_k, BT_TYPE_Q6_K)
BT_CPU_GEMM_DECL(avx512, q5_0_q16)
{
    assert(nr >= 1 && nr <= BT_CPU_GEMM_NR_MAX);
    GEMM_DISPATCH16(gemm16_kernel, BT_TYPE_Q5_0)
}

