/* AVX2 tiled GEMM over packed weights (layouts in cpu_gemm.c): a 16-row group times up to 16 activation rows
 * (bt_cpu_ops_avx2.gemm_nr), taken in passes of up to AVX2_NR (4) rows so that every integer sum stays in one of the
 * 16 ymm registers (the group is read again by each later pass, from L1: a group of the default model is 6-16 KB; the
 * high-bit plane layouts' later passes read the int16 operands the first one stored instead, gemm16_many).
 *
 * A 64-byte code vector (dword j = row j) is two ymm halves: rows 0-7 and rows 8-15. The activation dword it pairs
 * with is broadcast, so each row's block dot stays in its own lane with no horizontal sum, as on AVX-512:
 *   16-bit activations: vpmaddwd (s16 x s16, pairs summed into s32) then vpaddd: the same exact integer as
 *     vpdpwssd;
 *   8-bit activations, nibble codes (Q4_0, Q4_1, Q4_K): vpmaddubsw (u8 code 0..15 x s8, pairs summed into s16:
 *     |sum| <= 2 * 15 * 128, so it never saturates), the block's 8 of them added in int16 (vpaddw: 16 products per
 *     lane, |sum| <= 16 * 15 * 128 < 2^15, exact), then once per block vpmaddwd against ones (s32): the same integer
 *     as vpdpbusd.
 *   8-bit activations, byte codes (Q5_1, Q5_K: 0..31, Q6_K: 0..63, vpmaddubsw then vpmaddwd against ones then vpaddd
 *     per operand: 4 and 2 results per int16 lane would fit, but a second set of sums does not fit the registers at
 *     4 rows; Q8_0: code + 128, which would saturate
 *     vpmaddubsw, so the code is made signed again and vpmaddubsw takes |q| times the activation with q's sign,
 *     vpsignb: |pair| <= 2 * 128 * 127 < 2^15, since 8-bit activations are -127..127). That is the exact sum of
 *     q * a, which the reference reaches as sum((q + 128) * a) - 128 * sum(a). Q5_0 at 8 bits is packed as Q8_0.
 * Q4_K is packed as a Q4_1 with fp32 scales and reads its activations in the K-quant format (Q5_K and Q6_K: bytes).
 * Q5_0 and Q5_1 (16-bit activations) are Q4_0 / Q4_1 nibbles plus a high-bit plane, packed for AVX2 in nibble-vector
 * order (bt_cpu_ops.plane_nibbles): the nibbles become bytes, each byte's fifth bit is shifted from the code vector's
 * 16 plane bytes to bit 4 and or-ed in (3 ops for 32 codes, serving every row of the pass: FIFTH_BIT), and the bytes
 * split into the int16 operands.
 * Built with BT_AVX2_GEMM_VNNI (cpu_avx2_vnni_gemm.c, the avx2-vnni table), each chain is one VEX instruction:
 * vpdpwssd for 16-bit activations, vpdpbusd for 8-bit ones (Q8_0 takes its stored code + 128 as the unsigned
 * operand and starts its sums at -128 * sum(a), as the reference does): the same exact integers.
 * Per lane and block the integer dot is exact, then converted and accumulated exactly as bt_cpu_gemm_packed_ref
 * does (fma of the converted sum by d_w * d_a, then for Q4_1 fma of m_w by the activation's d * sum), so neither
 * the pass split nor nr changes a bit. */
#include <immintrin.h>

#include "engine/cpu/cpu_gemm_layout.h"
#include "engine/cpu/cpu_impl.h"

#define AI static inline __attribute__((always_inline))

/* rows per pass: 2 integer sums per row in registers, beside an operand pair, a broadcast, a product and a mask (the
 * float accumulators, touched once a block, live on the stack); GEMM_PASSES dispatches 1 to 4. Once the nibble
 * operands were unpacked in program order (nib16), 4 rows spill next to nothing, and an 8-row tile is 2 passes
 * instead of 3+3+2: per vpmaddwd, Q4_1 16-bit, 2.89 -> 2.73 vector ALU instructions (objdump of the block loop).
 * bench_cpu_kernels --gemm --isa avx2 --batch 8, one thread, AMD Zen 3 (EPYC, family 25 model 1), fastest of 3
 * alternated runs, 3 rows (4 for Q8_0) -> 4: 16-bit Q4_0 0.92x, Q4_1 0.91-0.94x, Q4_K 0.93x, Q5_0 0.82-0.92x, Q5_1
 * 0.90x, Q5_K 0.89x, Q6_K 0.89x; 8-bit Q4_0 0.95-0.98x, Q4_1 0.93-0.96x, Q4_K 0.94x, Q5_1 0.81x, Q5_K 0.85x, Q6_K
 * 0.89x; Q8_0 (4 rows before too) 0.96-1.00x. (On Zen 4, before nib16, the types other than Q8_0 spilled their
 * operands with 4 rows and ran 2-3% slower, session 20; not re-measured on Zen 4 since.) With AVX-VNNI a chain needs no
 * temporary register either. */
#define AVX2_NR 4

#ifdef BT_AVX2_GEMM_VNNI
#define AVX2_GEMM_DECL(ty) BT_CPU_GEMM_DECL(avx2_vnni, ty)
#else
#define AVX2_GEMM_DECL(ty) BT_CPU_GEMM_DECL(avx2, ty)
#endif

#define ACT8(r, b) BT_GL_ACT8(act, act_stride, r, b)
#define ACT16(r, b) BT_GL_ACT16(act, act_stride, r, b)

#define GEMM_ARGS                                                                                              \
    int64_t n, const void *group, const void *next, const void *act, size_t act_stride, const int NR, float *out, \
        size_t out_stride, int n_valid

/* Integer sums of a block start at -off * sum(a) when the codes carry an offset (Q4_0: 8, Q5_0: 16), else 0. */
AI __m256i chain_init(int off, int32_t sum)
{
    return off ? _mm256_set1_epi32(-off * sum) : _mm256_setzero_si256();
}

/* acc = fma((float)isum, dw * d_a, acc), then for Q4_1 acc = fma(mw, ds_a, acc): bt_cpu_gemm_packed_ref's order */
AI __m256 block_accum(__m256 acc, __m256i isum, __m256 dw, __m256 mw, const int mins, float a_d, float a_ds)
{
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(a_d)), acc);
    return mins ? _mm256_fmadd_ps(mw, _mm256_set1_ps(a_ds), acc) : acc;
}

/* The 16 scales at sc as two halves (rows 0-7, 8-15). */
AI void load_scales(const uint16_t *sc, __m256 *lo, __m256 *hi)
{
    *lo = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)sc));
    *hi = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(sc + 8)));
}

AI void store_rows(const int NR, const __m256 (*acc)[2], float *out, size_t out_stride, int n_valid)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_valid), idx);
    const __m256i k_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(n_valid - 8), idx);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        float *o = out + (size_t)r * out_stride;
        if (n_valid == BT_CPU_PACK_ROWS) {
            _mm256_storeu_ps(o, acc[r][0]);
            _mm256_storeu_ps(o + 8, acc[r][1]);
        } else {
            _mm256_maskstore_ps(o, k_lo, acc[r][0]);
            _mm256_maskstore_ps(o + 8, k_hi, acc[r][1]);
        }
    }
}

/* The 8 integer scales at p as floats: signed bytes (Q6_K) or unsigned */
AI __m256 kq_scale8_ps(const uint8_t *p, const int type)
{
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(type == BT_TYPE_Q6_K ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* The 16 rows' d and m of block b as two halves each (m zero for types without one). */
AI void load_w_scales(const uint8_t *group, int64_t b, const int type, const size_t cb, __m256 *d, __m256 *m)
{
    if (bt_gl_kquant(type)) { /* Q4_K, Q5_K: d = A * s0, m = -(B * s1); Q6_K: the halves' d, A * s0 and A * s1 */
        const float *sup = bt_gl_kq_super(group, b, cb);
        const uint8_t *s = bt_gl_kq_bytes(group, b, cb);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        for (int h = 0; h < 2; h++) {
            const __m256 a = _mm256_load_ps(sup + 8 * h);
            d[h] = _mm256_mul_ps(a, kq_scale8_ps(s + 8 * h, type));
            if (type == BT_TYPE_Q6_K) {
                m[h] = _mm256_mul_ps(a, kq_scale8_ps(s + 16 + 8 * h, type));
            } else { /* the sign flipped exactly, as -(x) */
                const __m256 x = _mm256_mul_ps(_mm256_load_ps(sup + 16 + 8 * h), kq_scale8_ps(s + 16 + 8 * h, type));
                m[h] = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), sign));
            }
        }
        return;
    }
    const uint16_t *sc = bt_gl_scales(group, b, type, cb);
    load_scales(sc, &d[0], &d[1]);
    if (bt_gl_fp16_min(type))
        load_scales(sc + BT_CPU_PACK_ROWS, &m[0], &m[1]);
    else
        m[0] = m[1] = _mm256_setzero_ps();
}

/* Adds every row's block ends into its float accumulators (ad, ads: the row's activation d and d * sum). */
#define ACCUM_ROWS(SCALES)                                                                                     \
    do {                                                                                                       \
        __m256 dw[2], mw[2];                                                                                   \
        load_w_scales(group, b, type, cb, dw, mw);                                                             \
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)                                                   \
        {                                                                                                      \
            float ad, ads;                                                                                     \
            SCALES;                                                                                            \
            acc[r][0] = block_accum(acc[r][0], s[r][0], dw[0], mw[0], mins, ad, ads);                          \
            acc[r][1] = block_accum(acc[r][1], s[r][1], dw[1], mw[1], mins, ad, ads);                          \
        }                                                                                                      \
    } while (0)

/* Q6_K: acc = fma(isum, d * d_a, acc) for one half's sums (s), d its weight scales (d0 or d1: load_w_scales' d
 * and m): the first half's as soon as its sums are complete, so no register holds them through the second half. */
#define ACCUM_Q6K_HALF(SCALES, d)                                                                              \
    do {                                                                                                       \
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)                                                   \
        {                                                                                                      \
            float ad, ads;                                                                                     \
            SCALES;                                                                                            \
            const __m256 adv = _mm256_set1_ps(ad);                                                             \
            for (int h = 0; h < 2; h++)                                                                        \
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps((d)[h], adv), acc[r][h]); \
        }                                                                                                      \
    } while (0)

/* 16-bit activations: every row's sums += the operand pair (lo, hi) times the row's activation dword idx.
 * The broadcast, products and adds of this and the two 8-bit helpers below are inline asm: written with intrinsics,
 * GCC 12 reassociated the integer adds of a block, computed all the block's products first and spilled them to the
 * stack (75 spill loads and stores in the Q4_1 kernel), which held the kernel at ~45% of the vpmaddwd rate. As asm,
 * each product goes straight into its row's sum: 2-3 rows per pass 46% -> 69% of that rate with the weights in cache,
 * batch 1 43% -> 51% (bench_cpu_kernels --gemm --isa avx2, AMD Zen 4; the sums, exact integers, keep their bits). */
AI void dot16_rows(const int NR, __m256i (*s)[2], __m256i lo, __m256i hi, const void *act, size_t act_stride,
                   int64_t b, const int idx)
{
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const int16_t *p = bt_gl_act16_qs(act, act_stride, r, b) + 2 * idx;
        __m256i a;
#ifdef BT_AVX2_GEMM_VNNI /* vpdpwssd: the product pairs and the add in one instruction ({vex}: not the EVEX form) */
        __asm__ volatile("vpbroadcastd %3, %1\n\t"
                         "%{vex%} vpdpwssd %4, %1, %0\n\t"
                         "%{vex%} vpdpwssd %5, %1, %2"
                         : "+x"(s[r][0]), "=&x"(a), "+x"(s[r][1])
                         : "m"(*(const int32_t *)p), "x"(lo), "x"(hi));
#else
        __m256i t;
        __asm__ volatile("vpbroadcastd %4, %1\n\t"
                         "vpmaddwd %1, %5, %2\n\t"
                         "vpaddd %2, %0, %0\n\t"
                         "vpmaddwd %1, %6, %2\n\t"
                         "vpaddd %2, %3, %3"
                         : "+x"(s[r][0]), "=&x"(a), "=&x"(t), "+x"(s[r][1])
                         : "m"(*(const int32_t *)p), "x"(lo), "x"(hi));
#endif
    }
}

/* Operand j (0..3) of a nibble code vector at v (32 bytes: one half's rows), as int16 lanes: j = 0 the low nibble of
 * each 16-bit word's low byte, 1 of its high byte, 2 the high nibble of the low byte, 3 of the high byte. Volatile
 * asm, as dot16_rows is: GCC kept all 8 operands of a code vector live at once and spilled them (NR = 4: 48 stack
 * accesses per block beside 128 vpmaddwd, 14 now, most of them the float accumulators); in program order each pair
 * dies at its dot16_rows. (ASan does not check loads made through asm operands, as it did the intrinsic loads.) */
AI __m256i nib16(const uint8_t *v, const int j, __m256i m4)
{
    __m256i x;
    if (j == 0)
        __asm__ volatile("vpand %1, %2, %0" : "=x"(x) : "m"(*(const __m256i *)v), "x"(m4));
    else if (j == 3)
        __asm__ volatile("vmovdqa %1, %0\n\tvpsrlw $12, %0, %0" : "=x"(x) : "m"(*(const __m256i *)v));
    else if (j == 1) /* (two statements, not an "i" operand: unoptimised builds may not unroll j to a constant) */
        __asm__ volatile("vmovdqa %1, %0\n\tvpsrlw $8, %0, %0\n\tvpand %2, %0, %0"
                         : "=&x"(x)
                         : "m"(*(const __m256i *)v), "x"(m4));
    else
        __asm__ volatile("vmovdqa %1, %0\n\tvpsrlw $4, %0, %0\n\tvpand %2, %0, %0"
                         : "=&x"(x)
                         : "m"(*(const __m256i *)v), "x"(m4));
    return x;
}

/* Operand j of a nibble code vector as nib16 gives it, times 1 << nib16_shift(j) (one-row passes, gemm16_span): the
 * nibbles of bits 4-7 and 8-11 are masked in place (0x00f0, 0x0f00 per int16 lane: the code times 16 or 256), one
 * instruction with the load instead of three. */
AI int nib16_shift(const int j)
{
    return j == 1 ? 8 : j == 2 ? 4 : 0;
}

AI __m256i nib16_scaled(const uint8_t *v, const int j, __m256i m4, __m256i m4_hi, __m256i m4_mid)
{
    __m256i x;
    if (j == 1)
        __asm__ volatile("vpand %1, %2, %0" : "=x"(x) : "m"(*(const __m256i *)v), "x"(m4_hi));
    else if (j == 2)
        __asm__ volatile("vpand %1, %2, %0" : "=x"(x) : "m"(*(const __m256i *)v), "x"(m4_mid));
    else
        x = nib16(v, j, m4);
    return x;
}

/* Byte codes of a nibble vector (32 bytes of 0..15) with their fifth bits from pb, the code vector's 16 plane bytes
 * in both 128-bit lanes with the high lane's shifted right by 4 (cpu_gemm.c's nibble-vector order, as AVX2 packs
 * it): bit X of each byte of pb belongs to nibble vector X, so a shift left by S = 4 - X takes it to bit 4 (the bits
 * a 16-bit shift carries across the byte boundary land below bit 4 and are masked off) and 16 is or-ed in where it is
 * set: 3 instructions for 32 codes. */
#define FIFTH_BIT(codes, pb, S, c16) _mm256_or_si256((codes), _mm256_and_si256(_mm256_slli_epi16((pb), (S)), (c16)))

/* Modes of gemm16_span: unpack each code vector into its int16 operands in registers (UNPACK), also store them to
 * the scratch (UNPACK_STORE), or load them from it (FROM_SCRATCH: a later pass over the same blocks). The scratch
 * modes serve the high-bit plane layouts only (gemm16_many); other layouts always UNPACK. */
enum { UNPACK, UNPACK_STORE, FROM_SCRATCH };

/* Operand pairs (lo, hi) per block at 16 bits, and blocks per scratch chunk (8 KB of int16 operands: stays in L1
 * beside the group's codes and the pass's activations). */
#define OPS16 16
#define SCRATCH_BLOCKS 8

/* The activation dword operand pair t (0..15) of a 16-bit nibble or plane block pairs with: t = 4k + j, operand j
 * (0..3) of code vector k, pairs with dword 2k + 0, 1, 8, 9. */
AI int op16_idx(const int t)
{
    return 2 * (t >> 2) + (t & 1) + 8 * ((t >> 1) & 1);
}

/* A stored operand, loaded in program order (volatile asm, as nib16: GCC would otherwise load a block's 32 at once
 * and spill them). */
AI __m256i ld16(const __m256i *p)
{
    __m256i x;
    __asm__ volatile("vmovdqa %1, %0" : "=x"(x) : "m"(*p));
    return x;
}

/* Rows 0..NR-1 of act times blocks [b0, b1) of the group, added into acc (the rows' float accumulators). scr: the
 * scratch of the chunk starting at b0 (OPS16 operand pairs per block), read or written as mode says (NULL for
 * UNPACK). */
AI void gemm16_span(const void *group, const void *next, const void *act, size_t act_stride, const int NR,
                    __m256 (*acc)[2], int64_t b0, int64_t b1, const int mode, __m256i *scr, const int type)
{
    const size_t cb = bt_gl_code_bytes(type, 1);
    const int mins = bt_gl_has_min(type), off = type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q5_0 ? 16 : 0;
    const int plane = bt_gl_plane(type, 1), bytes = bt_gl_byte_codes(type, 1);
    const __m256i m4 = _mm256_set1_epi32(0x000f000f), m4b = _mm256_set1_epi8(0x0f), m8 = _mm256_set1_epi16(0x00ff);
    const __m256i m4_hi = _mm256_set1_epi32(0x0f000f00), m4_mid = _mm256_set1_epi32(0x00f000f0);
    const __m256i c16 = _mm256_set1_epi8(16), lane_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *cp = bt_gl_codes(group, b, type, cb);
        /* this block's operand pairs in the scratch */
        __m256i *sp = mode == UNPACK ? NULL : scr + (size_t)(b - b0) * 2 * OPS16;
        bt_gl_prefetch_block(next, b, type, 1);
        __m256i s[AVX2_NR][2];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = chain_init(off, off ? ACT16(r, b)->sum : 0);
        __m256 d0[2], d1[2]; /* Q6_K: the halves' weight scales */
        if (type == BT_TYPE_Q6_K) load_w_scales(group, b, type, cb, d0, d1);
        if (plane && mode == FROM_SCRATCH) {
#pragma GCC unroll 16
            for (int t = 0; t < OPS16; t++)
                dot16_rows(NR, s, ld16(sp + 2 * t), ld16(sp + 2 * t + 1), act, act_stride, b, op16_idx(t));
        } else if (bytes) {
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) { /* codes 2k, 2k+1 of rows 0-7 (bytes 0-15) and 8-15 (bytes 16-31) */
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(cp + 32 * k)));
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(cp + 32 * k + 16)));
                dot16_rows(NR, s, lo, hi, act, act_stride, b, k);
                if (type == BT_TYPE_Q6_K && k == 7) { /* the first half (elements 0..15) */
                    ACCUM_Q6K_HALF(bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads), d0);
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
                }
            }
        } else if (plane) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) { /* low nibbles: codes 4k .. 4k+3, high ones 16 + the same */
                const __m256i vl = _mm256_load_si256((const __m256i *)(cp + 64 * k));
                const __m256i vh = _mm256_load_si256((const __m256i *)(cp + 64 * k + 32));
                /* the code vector's 16 plane bytes (FIFTH_BIT). Each byte's low and high nibble as a byte (nibble
                 * vectors 0 and 1 of rows 0-7, 2 and 3 of rows 8-15), its fifth bit added; int16 lane i of operand
                 * 4k + u is then byte 2i (u even) or 2i + 1 (u odd) of the low (u < 2) or high nibbles */
                const __m256i pb = _mm256_srlv_epi64(
                    _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(cp + 256) + k)), lane_shift);
                const __m256i nl0 = FIFTH_BIT(_mm256_and_si256(vl, m4b), pb, 4, c16);
                const __m256i nh0 = FIFTH_BIT(_mm256_and_si256(_mm256_srli_epi16(vl, 4), m4b), pb, 3, c16);
                const __m256i nl1 = FIFTH_BIT(_mm256_and_si256(vh, m4b), pb, 2, c16);
                const __m256i nh1 = FIFTH_BIT(_mm256_and_si256(_mm256_srli_epi16(vh, 4), m4b), pb, 1, c16);
                const __m256i lo[4] = {_mm256_and_si256(nl0, m8), _mm256_srli_epi16(nl0, 8), _mm256_and_si256(nh0, m8),
                                       _mm256_srli_epi16(nh0, 8)};
                const __m256i hi[4] = {_mm256_and_si256(nl1, m8), _mm256_srli_epi16(nl1, 8), _mm256_and_si256(nh1, m8),
                                       _mm256_srli_epi16(nh1, 8)};
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    if (mode == UNPACK_STORE) /* operand pair t = 4k + j at 2t, 2t + 1 */
                        _mm256_store_si256(sp + 8 * k + 2 * j, lo[j]),
                            _mm256_store_si256(sp + 8 * k + 2 * j + 1, hi[j]);
                    dot16_rows(NR, s, lo[j], hi[j], act, act_stride, b, op16_idx(4 * k + j));
                }
            }
        } else if (NR == 1) {
            /* One row: the sums of operands 1 and 2 (nib16_scaled: codes times 256 and 16) in chains of their own,
             * shifted back once a block. Each is an exact multiple of its scale and stays below 2^31 (8 products of
             * |code * 256 * a| <= 15 * 256 * 32768), so the block's integer is the one the 4 operands give
             * unscaled: 48 -> 32 unpack instructions a block for the vector ALUs, plus 8 to shift back (40 in all),
             * and 3 chains per half, not 1.
             * One thread, one row, AMD Zen 3, 101 alternated runs in one process (median): weights in cache, Q4_0 and
             * Q4_1 576x1536, 1536x576, 576x576 0.91-0.93x the time, Q4_K 0.99x; streamed from memory 0.98-1.04x (one
             * thread's reads bound it there). */
            __m256i sc[3][1][2] = {{{s[0][0], s[0][1]}},
                                   {{_mm256_setzero_si256(), _mm256_setzero_si256()}},
                                   {{_mm256_setzero_si256(), _mm256_setzero_si256()}}};
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const __m256i lo = nib16_scaled(cp + 64 * k, j, m4, m4_hi, m4_mid);
                    const __m256i hi = nib16_scaled(cp + 64 * k + 32, j, m4, m4_hi, m4_mid);
                    dot16_rows(1, sc[nib16_shift(j) / 4], lo, hi, act, act_stride, b, op16_idx(4 * k + j));
                }
            for (int h = 0; h < 2; h++)
                s[0][h] = _mm256_add_epi32(
                    sc[0][0][h],
                    _mm256_srai_epi32(_mm256_add_epi32(sc[1][0][h], _mm256_srai_epi32(sc[2][0][h], 4)), 4));
        } else {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) { /* operand j pairs with activation dword 2k + 0, 1, 8, 9 */
                    const __m256i lo = nib16(cp + 64 * k, j, m4), hi = nib16(cp + 64 * k + 32, j, m4);
                    dot16_rows(NR, s, lo, hi, act, act_stride, b, op16_idx(4 * k + j));
                }
        }
        if (type == BT_TYPE_Q6_K) {
            ACCUM_Q6K_HALF(bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads), d1);
            continue;
        }
        ACCUM_ROWS(bt_gl_act16_scales(act, act_stride, r, b, &ad, &ads));
    }
}

/* Up to AVX2_NR rows: each code vector unpacked in registers, once. */
AI void gemm16_kernel(GEMM_ARGS, const int type)
{
    __m256 acc[AVX2_NR][2];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    gemm16_span(group, next, act, act_stride, NR, acc, 0, n / BT_QK, UNPACK, NULL, type);
    store_rows(NR, (const __m256(*)[2])acc, out, out_stride, n_valid);
}

/* Rows of the pass that starts at row r0 of nr. */
#define PASS_ROWS(nr, r0) ((nr) - (r0) < AVX2_NR ? (nr) - (r0) : AVX2_NR)

/* CALL with NR_ the constant k (1..AVX2_NR): each pass is the code specialised for its row count. */
#define WITH_NR(k, CALL)                                                                                       \
    do {                                                                                                       \
        if ((k) == 1) {                                                                                        \
            enum { NR_ = 1 };                                                                                  \
            CALL;                                                                                              \
        } else if ((k) == 2) {                                                                                 \
            enum { NR_ = 2 };                                                                                  \
            CALL;                                                                                              \
        } else if ((k) == 3) {                                                                                 \
            enum { NR_ = 3 };                                                                                  \
            CALL;                                                                                              \
        } else {                                                                                               \
            enum { NR_ = 4 };                                                                                  \
            CALL;                                                                                              \
        }                                                                                                      \
    } while (0)

/* The passes after the first, rows AVX2_NR .. nr - 1, from the scratch. */
AI void gemm16_scratch_passes(const void *group, const void *act, size_t act_stride, int nr, __m256 (*acc)[2],
                              int64_t b0, int64_t b1, __m256i *scr, const int type)
{
    for (int r0 = AVX2_NR; r0 < nr; r0 += AVX2_NR) {
        const void *a = (const char *)act + (size_t)r0 * act_stride;
        WITH_NR(PASS_ROWS(nr, r0),
                gemm16_span(group, NULL, a, act_stride, NR_, acc + r0, b0, b1, FROM_SCRATCH, scr, type));
    }
}

/* More than AVX2_NR rows (up to bt_cpu_ops_avx2.gemm_nr, 16) of a high-bit plane layout (Q5_0, Q5_1): chunk by chunk
 * of SCRATCH_BLOCKS blocks, the first pass (rows 0-3) unpacks the codes into their int16 operands and stores them,
 * and the passes over the other rows load them, so the plane's ~3.4 ALU instructions per operand half (4.25 before
 * the nibble-vector order) are spent once per group instead of once per 4 rows. Each row's float accumulation runs
 * block by block in the same order whatever the chunking, so no bit changes. bench_cpu_kernels --gemm --isa avx2
 * --bits 16, one thread, AMD Zen 3, fastest of 3 alternated runs, old -> new (16 rows: 2 calls of 8 -> 1 of 16; 8
 * rows: 1 call each): Q5_0 576x1536 16 rows 309 -> 253 us, 640x2048 458 -> 378, 8 rows 157 -> 141 and 231 -> 210;
 * Q5_1 16 rows 311 -> 260. The other layouts unpack in 1-1.5 instructions per operand half, and through the scratch
 * measured no faster (Q4_1, Q4_K) or 3-7% slower (Q8_0, Q6_K): they unpack again in each pass. */
AI void gemm16_many(int64_t n, const void *group, const void *next, const void *act, size_t act_stride, int nr,
                    float *out, size_t out_stride, int n_valid, const int type)
{
    const int64_t nb = n / BT_QK;
    __m256 acc[BT_CPU_GEMM_NR_MAX][2];
    __m256i scr[SCRATCH_BLOCKS * 2 * OPS16];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += SCRATCH_BLOCKS) {
        const int64_t b1 = b0 + SCRATCH_BLOCKS < nb ? b0 + SCRATCH_BLOCKS : nb;
        gemm16_span(group, next, act, act_stride, AVX2_NR, acc, b0, b1, UNPACK_STORE, scr, type);
        gemm16_scratch_passes(group, act, act_stride, nr, acc, b0, b1, scr, type);
    }
    for (int r0 = 0; r0 < nr; r0 += AVX2_NR)
        store_rows(PASS_ROWS(nr, r0), (const __m256(*)[2])(acc + r0), out + (size_t)r0 * out_stride, out_stride,
                   n_valid);
}

/* 8-bit activations: every row's sums += the unsigned operand pair (lo, hi) times the row's activation dword idx. */
AI void dot8_rows(const int NR, __m256i (*s)[2], __m256i lo, __m256i hi, const void *act, size_t act_stride,
                  int64_t b, const int idx)
{
#ifndef BT_AVX2_GEMM_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const int32_t *p = (const int32_t *)(bt_gl_act8_qs(act, act_stride, r, b) + 4 * idx);
        __m256i a;
#ifdef BT_AVX2_GEMM_VNNI /* vpdpbusd: unsigned codes times signed activations, 4 products and the add at once */
        __asm__("vpbroadcastd %3, %1\n\t"
                "%{vex%} vpdpbusd %1, %4, %0\n\t"
                "%{vex%} vpdpbusd %1, %5, %2"
                : "+x"(s[r][0]), "=&x"(a), "+x"(s[r][1])
                : "m"(*p), "x"(lo), "x"(hi));
#else
        __m256i t;
        __asm__("vpbroadcastd %4, %1\n\t"
                "vpmaddubsw %1, %5, %2\n\t"
                "vpmaddwd %7, %2, %2\n\t"
                "vpaddd %2, %0, %0\n\t"
                "vpmaddubsw %1, %6, %2\n\t"
                "vpmaddwd %7, %2, %2\n\t"
                "vpaddd %2, %3, %3"
                : "+x"(s[r][0]), "=&x"(a), "=&x"(t), "+x"(s[r][1])
                : "m"(*p), "x"(lo), "x"(hi), "x"(ones));
#endif
    }
}

#ifndef BT_AVX2_GEMM_VNNI
/* Nibble codes (0..15) against every row's activation dword idx, the vpmaddubsw pairs summed in int16 (w16: each row's
 * two halves) instead of widened to int32 one by one: first sets them, later adds. A block's 8 operands put 16
 * products into each int16 lane, |sum| <= 16 * 15 * 128 = 30720 < 2^15, so the sum is exact and one vpmaddwd against
 * ones per half and block (widen16_rows) gives the integer dot8_rows reaches. Per row, operand and half: 2
 * instructions instead of 3, and one multiply instead of two (the vpmaddwd pairs). */
AI void dot8_nib_rows(const int NR, __m256i (*w16)[2], __m256i lo, __m256i hi, const void *act, size_t act_stride,
                      int64_t b, const int idx, const int first)
{
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        const int32_t *p = (const int32_t *)(bt_gl_act8_qs(act, act_stride, r, b) + 4 * idx);
        __m256i a, t;
        if (first)
            __asm__("vpbroadcastd %3, %1\n\t"
                    "vpmaddubsw %1, %4, %0\n\t"
                    "vpmaddubsw %1, %5, %2"
                    : "=&x"(w16[r][0]), "=&x"(a), "=x"(w16[r][1])
                    : "m"(*p), "x"(lo), "x"(hi));
        else
            __asm__("vpbroadcastd %4, %1\n\t"
                    "vpmaddubsw %1, %5, %2\n\t"
                    "vpaddw %2, %0, %0\n\t"
                    "vpmaddubsw %1, %6, %2\n\t"
                    "vpaddw %2, %3, %3"
                    : "+x"(w16[r][0]), "=&x"(a), "=&x"(t), "+x"(w16[r][1])
                    : "m"(*p), "x"(lo), "x"(hi));
    }
}

/* s = the block's integer start (chain_init) + the int16 sums widened to int32 pairs, per row and half. */
AI void widen16_rows(const int NR, __m256i (*s)[2], const __m256i (*w16)[2])
{
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2; h++) s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(w16[r][h], ones));
}

/* Signed codes w (q of Q8_0) against every row's activation dword idx: |w| times the activation with w's sign.
 * (AVX-VNNI needs none of this: vpdpbusd takes the stored code + 128 with no 16-bit stage to saturate.) */
AI void dot8_signed_rows(const int NR, __m256i (*s)[2], __m256i wl, __m256i wh, const void *act, size_t act_stride,
                         int64_t b, const int idx)
{
    const __m256i ones = _mm256_set1_epi16(1), ul = _mm256_abs_epi8(wl), uh = _mm256_abs_epi8(wh);
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        __m256i a, t;
        __asm__("vpbroadcastd %4, %1\n\t"
                "vpsignb %5, %1, %2\n\t"
                "vpmaddubsw %2, %7, %2\n\t"
                "vpmaddwd %9, %2, %2\n\t"
                "vpaddd %2, %0, %0\n\t"
                "vpsignb %6, %1, %2\n\t"
                "vpmaddubsw %2, %8, %2\n\t"
                "vpmaddwd %9, %2, %2\n\t"
                "vpaddd %2, %3, %3"
                : "+x"(s[r][0]), "=&x"(a), "=&x"(t), "+x"(s[r][1])
                : "m"(*(const int32_t *)(ACT8(r, b)->qs + 4 * idx)), "x"(wl), "x"(wh), "x"(ul), "x"(uh), "x"(ones));
    }
}
#endif

/* 8-bit activations. Nibble layouts (Q4_0, Q4_1, Q4_K): code vector k holds bytes qs[4k .. 4k+3] of each row; its
 * low nibbles pair with activation dword k, its high nibbles with dword k + 4. Byte-code layouts (Q8_0, Q5_1, Q5_K,
 * Q6_K): 8 code vectors of 4 codes per row, code vector i paired with activation dword i. K-quants read their
 * activations in the K-quant format; Q6_K's codes q (0..63: 2 * 63 * 128 < 2^15 in vpmaddubsw) give two sums, code
 * vectors 0..3 and 4..7, each started at -32 * its half's activation sum. */
AI void gemm8_kernel(GEMM_ARGS, const int type)
{
    const int64_t nb = n / BT_QK;
    const size_t cb = bt_gl_code_bytes(type, 0);
#ifdef BT_AVX2_GEMM_VNNI /* Q8_0's stored code + 128 straight into vpdpbusd: the sums start at -128 * sum(a) */
    const int off = type == BT_TYPE_Q4_0 ? 8 : type == BT_TYPE_Q8_0 ? 128 : 0;
#else
    const int q8_signed = type == BT_TYPE_Q8_0, off = type == BT_TYPE_Q4_0 ? 8 : 0;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#endif
    const int mins = bt_gl_has_min(type), q6k = type == BT_TYPE_Q6_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[AVX2_NR][2];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *cp = bt_gl_codes(group, b, type, cb);
        bt_gl_prefetch_block(next, b, type, 0);
        __m256i s[AVX2_NR][2];
        int32_t hs[AVX2_NR][2] = {{0}}; /* Q6_K: the halves' activation sums */
        __m256 d0[2], d1[2]; /* Q6_K: the halves' weight scales */
        if (q6k) load_w_scales(group, b, type, cb, d0, d1);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            if (q6k) bt_gl_act8_half_sums(act, act_stride, r, b, &hs[r][0], &hs[r][1]);
            s[r][0] = s[r][1] = q6k ? chain_init(32, hs[r][0]) : chain_init(off, off ? ACT8(r, b)->sum : 0);
        }
        if (bt_gl_byte_codes(type, 0)) {
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                const __m256i vl = _mm256_load_si256((const __m256i *)(cp + 64 * i));
                const __m256i vh = _mm256_load_si256((const __m256i *)(cp + 64 * i + 32));
#ifndef BT_AVX2_GEMM_VNNI
                if (q8_signed)
                    dot8_signed_rows(NR, s, _mm256_xor_si256(vl, flip), _mm256_xor_si256(vh, flip), act, act_stride,
                                     b, i);
                else
#endif
                    dot8_rows(NR, s, vl, vh, act, act_stride, b, i);
                if (q6k && i == 3) { /* the first half (elements 0..15) */
                    ACCUM_Q6K_HALF(bt_gl_act8_scales(act, act_stride, r, b, &ad, &ads), d0);
#pragma GCC unroll 4
                    for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = chain_init(32, hs[r][1]);
                }
            }
        } else {
#ifndef BT_AVX2_GEMM_VNNI
            __m256i w16[AVX2_NR][2]; /* the block's int16 sums (dot8_nib_rows) */
#endif
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i vl = _mm256_load_si256((const __m256i *)(cp + 64 * k));
                const __m256i vh = _mm256_load_si256((const __m256i *)(cp + 64 * k + 32));
                const __m256i l0 = _mm256_and_si256(vl, m4), l1 = _mm256_and_si256(vh, m4);
                const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(vl, 4), m4);
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(vh, 4), m4);
#ifdef BT_AVX2_GEMM_VNNI
                dot8_rows(NR, s, l0, l1, act, act_stride, b, k);
                dot8_rows(NR, s, h0, h1, act, act_stride, b, k + 4);
#else
                dot8_nib_rows(NR, w16, l0, l1, act, act_stride, b, k, k == 0);
                dot8_nib_rows(NR, w16, h0, h1, act, act_stride, b, k + 4, 0);
#endif
            }
#ifndef BT_AVX2_GEMM_VNNI
            widen16_rows(NR, s, (const __m256i(*)[2])w16);
#endif
        }
        if (q6k) {
            ACCUM_Q6K_HALF(bt_gl_act8_scales(act, act_stride, r, b, &ad, &ads), d1);
            continue;
        }
        ACCUM_ROWS(bt_gl_act8_scales(act, act_stride, r, b, &ad, &ads));
    }
    store_rows(NR, (const __m256(*)[2])acc, out, out_stride, n_valid);
}

/* nr rows in passes of up to AVX2_NR; each pass is the kernel specialised for its row count */
#define GEMM_PASSES(kernel, TYPE)                                                                              \
    for (int r0 = 0; r0 < nr; r0 += AVX2_NR) {                                                                 \
        const int k = PASS_ROWS(nr, r0);                                                                       \
        const void *a = (const char *)act + (size_t)r0 * act_stride;                                           \
        float *o = out + (size_t)r0 * out_stride;                                                              \
        const void *nx = r0 + k >= nr ? next : NULL; /* prefetch the next group once, in the last pass */     \
        WITH_NR(k, kernel(n, group, nx, a, act_stride, NR_, o, out_stride, n_valid, TYPE));                    \
    }

AVX2_GEMM_DECL(q4_0) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q4_0) }
AVX2_GEMM_DECL(q4_1) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q4_1) }
AVX2_GEMM_DECL(q8_0) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q8_0) }
AVX2_GEMM_DECL(q5_1) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q5_1) }
AVX2_GEMM_DECL(q4_k) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q4_K) }
AVX2_GEMM_DECL(q5_k) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q5_K) }
AVX2_GEMM_DECL(q6_k) { GEMM_PASSES(gemm8_kernel, BT_TYPE_Q6_K) }
/* 16 bits: up to AVX2_NR rows in one pass; more in passes of AVX2_NR, through the scratch for the high-bit plane
 * layouts */
#define GEMM16(TYPE)                                                                                           \
    if (nr > AVX2_NR && bt_gl_plane(TYPE, 1))                                                                  \
        gemm16_many(n, group, next, act, act_stride, nr, out, out_stride, n_valid, TYPE);                      \
    else                                                                                                       \
        GEMM_PASSES(gemm16_kernel, TYPE)

AVX2_GEMM_DECL(q4_0_q16) { GEMM16(BT_TYPE_Q4_0) }
AVX2_GEMM_DECL(q4_1_q16) { GEMM16(BT_TYPE_Q4_1) }
AVX2_GEMM_DECL(q8_0_q16) { GEMM16(BT_TYPE_Q8_0) }
AVX2_GEMM_DECL(q4_k_q16) { GEMM16(BT_TYPE_Q4_K) }
AVX2_GEMM_DECL(q5_1_q16) { GEMM16(BT_TYPE_Q5_1) }
AVX2_GEMM_DECL(q5_0_q16) { GEMM16(BT_TYPE_Q5_0) }
AVX2_GEMM_DECL(q6_k_q16) { GEMM16(BT_TYPE_Q6_K) }
AVX2_GEMM_DECL(q5_k_q16) { GEMM16(BT_TYPE_Q5_K) }
