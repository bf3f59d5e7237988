/* engine/cpu/cpu_quants.c references and the SIMD dot products / activation quantizers of every ISA.
 * Byte-for-byte agreement of dequantization with gguf-py is in tests/integration/test_dequant_oracle.py. */
#include <math.h>
#include <stdlib.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"
#include "test_isa.h"

static void test_geometry(void)
{
    for (size_t k = 0; k < N_CPU_TEST_TYPES; k++) {
        uint32_t t = cpu_test_types[k];
        const bt_ggml_type_info *ti = bt_ggml_type_get(t);
        REQUIRE(ti);
        CHECK((uint32_t)bt_cpu_block_elems(t) == ti->block_elems);
        CHECK(bt_cpu_row_bytes(t, 512) == 512 / ti->block_elems * ti->block_bytes);
        CHECK(bt_cpu_act_format(t, 8) != BT_ACT_NONE);
        CHECK(bt_cpu_act_format(t, 0) == bt_cpu_act_format(t, 16));
        CHECK(bt_cpu_act_format(t, 12) == BT_ACT_NONE);
        CHECK(bt_cpu_act_row_bytes(t, 16, 512) >= bt_cpu_act_row_bytes(t, 8, 512));
    }
    CHECK(bt_cpu_act_format(BT_TYPE_Q4_1, 16) == BT_ACT_Q16_32);
    CHECK(bt_cpu_act_format(BT_TYPE_Q4_1, 8) == BT_ACT_Q8_32);
    CHECK(bt_cpu_act_format(BT_TYPE_Q6_K, 0) == BT_ACT_Q16_256);
    CHECK(bt_cpu_act_format(BT_TYPE_F16, 16) == BT_ACT_F32);
    CHECK(bt_cpu_act_row_bytes(BT_TYPE_Q8_0, 0, 64) == 2 * sizeof(bt_block_q16_32));
    CHECK(bt_cpu_act_format(BT_TYPE_Q2_K, 8) == BT_ACT_NONE);
    CHECK(bt_cpu_act_format(BT_TYPE_Q2_K, 16) == BT_ACT_NONE);
    CHECK(bt_cpu_row_bytes(BT_TYPE_Q4_0, 48) == 0);
    CHECK(bt_cpu_dequantize_row_ref(BT_TYPE_Q2_K, 256, NULL, NULL) == -1);
}

/* Hand-built blocks with known values. */
static void test_dequant_known(void)
{
    float y[256];
    bt_block_q4_1 b41 = {.d = bt_f32_to_fp16(0.5f), .m = bt_f32_to_fp16(-1.0f)};
    for (int j = 0; j < 16; j++) b41.qs[j] = (uint8_t)(j | (15 - j) << 4);
    bt_cpu_dequantize_row_ref(BT_TYPE_Q4_1, 32, &b41, y);
    for (int j = 0; j < 16; j++) {
        CHECK(y[j] == 0.5f * (float)j - 1.0f);
        CHECK(y[j + 16] == 0.5f * (float)(15 - j) - 1.0f);
    }
    bt_block_q5_0 b50 = {.d = bt_f32_to_fp16(2.0f), .qh = {0x01, 0, 0, 0x80}};
    memset(b50.qs, 0x00, 16);
    bt_cpu_dequantize_row_ref(BT_TYPE_Q5_0, 32, &b50, y);
    CHECK(y[0] == 0.0f && y[1] == -32.0f && y[31] == 0.0f && y[30] == -32.0f);
    bt_block_q4_k bk = {.d = bt_f32_to_fp16(1.0f), .dmin = bt_f32_to_fp16(1.0f)};
    /* sub-block 5: sc = low nibble of scales[9] | top bits of scales[1] << 4; m = high nibble of scales[9] | ... */
    bk.scales[1] = 0xc0 | 3; /* sc1 = 3, top bits of sc5 = 3 */
    bk.scales[5] = 0x40 | 4; /* m1 = 4, top bits of m5 = 1 */
    bk.scales[9] = 0x72;     /* sc5 low = 2, m5 low = 7 */
    uint8_t sc, m;
    bt_q4k_scale_min(bk.scales, 1, &sc, &m);
    CHECK(sc == 3 && m == 4);
    bt_q4k_scale_min(bk.scales, 5, &sc, &m);
    CHECK(sc == (2 | 3 << 4) && m == (7 | 1 << 4));
    memset(bk.qs, 0x21, sizeof bk.qs); /* low nibble 1, high nibble 2 */
    bt_cpu_dequantize_row_ref(BT_TYPE_Q4_K, 256, &bk, y);
    CHECK(y[32] == 3.0f * 2.0f - 4.0f); /* sub-block 1 = high nibbles of chunk 0 */
    CHECK(y[160] == 50.0f * 2.0f - 23.0f);
    bt_block_q6_k b6;
    memset(&b6, 0, sizeof b6);
    b6.d = bt_f32_to_fp16(1.0f);
    for (int k = 0; k < 16; k++) b6.scales[k] = (int8_t)(k - 8);
    b6.ql[64 + 32 + 5] = 0x90; /* half 1, s = 3 (high nibble of ql[64h + 32 + l]), l = 5 */
    b6.qh[32 + 5] = 0xc0;      /* s = 3 high bits = 3 */
    bt_cpu_dequantize_row_ref(BT_TYPE_Q6_K, 256, &b6, y);
    int e = 128 + 96 + 5;
    CHECK(y[e] == (float)(e / 16 - 8) * (float)((9 | 3 << 4) - 32));
    CHECK(y[0] == -8.0f * -32.0f);
}

/* Rep 5 of the activation tests: the blocks of every other 256 elements (max |x| < 1e-37) have all-zero codes in
 * the reference (bt_act_inv_scale), and the others do not. q8: r32 / r256 are bt_block_q8_32 / _256 rows, else
 * the 16-bit ones. */
static int tiny_codes_zero(int n, int q8, const void *r32, const void *r256)
{
    for (int b = 0; b < n / 32; b++) {
        int tiny = (b / 8) % 2 == 0, nz = 0;
        for (int j = 0; j < 32; j++)
            nz += q8 ? ((const bt_block_q8_32 *)r32)[b].qs[j] != 0 : ((const bt_block_q16_32 *)r32)[b].qs[j] != 0;
        if (tiny ? nz != 0 : nz == 0) return 0;
    }
    for (int b = 0; b < n / 256; b++) {
        int tiny = b % 2 == 0, nz = 0;
        for (int j = 0; j < 256; j++)
            nz += q8 ? bt_q8k_qs((const bt_block_q8_256 *)r256 + b, j)[0] != 0
                     : bt_q16k_qs((const bt_block_q16_256 *)r256 + b, j)[0] != 0;
        if (tiny ? nz != 0 : nz == 0) return 0;
    }
    return 1;
}

static void test_act_quant(void)
{
    enum { N = 2048 };
    float *x = malloc(N * sizeof *x);
    bt_block_q8_32 *r32 = malloc(N / 32 * sizeof *r32), *s32 = malloc(N / 32 * sizeof *s32);
    bt_block_q8_256 *r256 = malloc(N / 256 * sizeof *r256), *s256 = malloc(N / 256 * sizeof *s256);
    REQUIRE(x && r32 && s32 && r256 && s256);
    uint64_t s = 3;
    for (int rep = 0; rep < 20; rep++) {
        test_fill_act(N, x, &s);
        if (rep == 1) memset(x, 0, 64 * sizeof *x);              /* all-zero blocks */
        if (rep == 2) for (int i = 0; i < N; i++) x[i] = (float)(i % 255 - 127) * 0.5f; /* exact ties */
        if (rep == 5) /* every other 256 elements so small that 1 / d overflows: all their codes 0 */
            for (int i = 0; i < N; i++) x[i] *= (i / 256) % 2 ? 1.0f : 1e-38f;
        bt_cpu_quantize_q8_32_ref(N, x, r32);
        bt_cpu_quantize_q8_256_ref(N, x, r256);
        int bad = 0;
        for (int b = 0; b < N / 32; b++) {
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                sum += r32[b].qs[j];
                float err = fabsf(x[32 * b + j] - r32[b].d * (float)r32[b].qs[j]);
                if (err > r32[b].d * 0.5001f + 1e-30f) bad++;
            }
            if (sum != r32[b].sum || r32[b].ds != r32[b].d * (float)sum) bad++;
        }
        for (int b = 0; b < N / 256; b++)
            for (int k = 0; k < 16; k++) {
                int sum = 0;
                for (int j = 0; j < 16; j++) sum += bt_q8k_qs(&r256[b], 16 * k)[j];
                if (sum != bt_q8k_bsum(&r256[b], k)) bad++;
                const bt_block_q8_32 *sl = &r256[b].s[k / 2];
                if (sl->d != r256[b].s[0].d || sl->ds != sl->d * (float)sl->sum) bad++;
            }
        CHECK_MSG(bad == 0, "reference activation quantization off in %d places", bad);
        if (rep == 5) CHECK_MSG(tiny_codes_zero(N, 1, r32, r256), "q8: a tiny block has non-zero codes");
        for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
            if (!test_isa_covers((bt_cpu_isa)isa)) continue;
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            memset(s32, 0xaa, N / 32 * sizeof *s32);
            memset(s256, 0xaa, N / 256 * sizeof *s256);
            ops->quantize_q8_32(N, x, s32);
            ops->quantize_q8_256(N, x, s256);
            CHECK_MSG(!memcmp(r32, s32, N / 32 * sizeof *s32), "%s q8_32 bytes differ (rep %d)", ops->name, rep);
            CHECK_MSG(!memcmp(r256, s256, N / 256 * sizeof *s256), "%s q8_256 bytes differ (rep %d)", ops->name, rep);
        }
    }
    free(x), free(r32), free(s32), free(r256), free(s256);
}

static void test_act_quant16(void)
{
    enum { N = 2048 };
    float *x = malloc(N * sizeof *x);
    bt_block_q16_32 *r32 = malloc(N / 32 * sizeof *r32), *s32 = malloc(N / 32 * sizeof *s32);
    bt_block_q16_256 *r256 = malloc(N / 256 * sizeof *r256), *s256 = malloc(N / 256 * sizeof *s256);
    REQUIRE(x && r32 && s32 && r256 && s256);
    uint64_t s = 5;
    for (int rep = 0; rep < 20; rep++) {
        test_fill_act(N, x, &s);
        if (rep == 1) memset(x, 0, 64 * sizeof *x);
        if (rep == 2) for (int i = 0; i < N; i++) x[i] = (float)(i % 255 - 127) * 0.5f;
        if (rep == 3) /* d = 0.5 and odd multiples of 0.25: exact ties */
            for (int i = 0; i < N; i++) x[i] = i % 32 == 0 ? 16383.5f : (float)(i % 64 - 32) * 0.25f;
        if (rep == 4) for (int i = 0; i < N; i++) x[i] *= 1e-30f; /* tiny (subnormal-adjacent) scales */
        if (rep == 5) /* every other 256 elements so small that 1 / d overflows: all their codes 0 */
            for (int i = 0; i < N; i++) x[i] *= (i / 256) % 2 ? 1.0f : 1e-38f;
        bt_cpu_quantize_q16_32_ref(N, x, r32);
        bt_cpu_quantize_q16_256_ref(N, x, r256);
        int bad = 0, full = 0;
        for (int b = 0; b < N / 32; b++) {
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                sum += r32[b].qs[j];
                full += abs(r32[b].qs[j]) == 32767;
                if (abs(r32[b].qs[j]) > 32767) bad++;
                float err = fabsf(x[32 * b + j] - r32[b].d * (float)r32[b].qs[j]);
                if (err > r32[b].d * 0.51f + 1e-37f) bad++; /* 1 / d rounded: |x * id - x / d| <= 32767 * 2^-23 */
            }
            if (sum != r32[b].sum || r32[b].ds != r32[b].d * (float)sum) bad++;
        }
        for (int b = 0; b < N / 256; b++)
            for (int k = 0; k < 16; k++) {
                int sum = 0;
                for (int j = 0; j < 16; j++) sum += bt_q16k_qs(&r256[b], 16 * k)[j];
                const bt_block_q16_32 *sl = &r256[b].s[k / 2];
                if (sum != (k % 2 ? sl->sum - sl->sum_lo : sl->sum_lo)) bad++;
                if (sl->d != r256[b].s[0].d || sl->ds != sl->d * (float)sl->sum) bad++;
            }
        CHECK_MSG(bad == 0, "reference 16-bit activation quantization off in %d places", bad);
        CHECK(rep == 1 || full >= (rep == 5 ? N / 64 : N / 32)); /* every other non-zero block reaches +-32767 */
        if (rep == 5) CHECK_MSG(tiny_codes_zero(N, 0, r32, r256), "q16: a tiny block has non-zero codes");
        for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
            if (!test_isa_covers((bt_cpu_isa)isa)) continue;
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            memset(s32, 0xaa, N / 32 * sizeof *s32);
            memset(s256, 0xaa, N / 256 * sizeof *s256);
            ops->quantize_q16_32(N, x, s32);
            ops->quantize_q16_256(N, x, s256);
            CHECK_MSG(!memcmp(r32, s32, N / 32 * sizeof *s32), "%s q16_32 bytes differ (rep %d)", ops->name, rep);
            CHECK_MSG(!memcmp(r256, s256, N / 256 * sizeof *s256), "%s q16_256 bytes differ (rep %d)", ops->name,
                      rep);
            /* rows of 1..40 blocks (SIMD paths may take blocks 16 at a time and the rest otherwise); a block's bytes
             * depend on its own 32 elements only, so they are r32's first blocks */
            const int nb = 1 + (rep * 7) % 40;
            memset(s32, 0xaa, N / 32 * sizeof *s32);
            ops->quantize_q16_32(32 * nb, x, s32);
            CHECK_MSG(!memcmp(r32, s32, (size_t)nb * sizeof *s32), "%s q16_32 bytes differ (%d blocks)", ops->name, nb);
            int past = 0; /* nothing written after the row's last block */
            for (size_t i = (size_t)nb * sizeof *s32; i < N / 32 * sizeof *s32; i++)
                past += ((const uint8_t *)s32)[i] != 0xaa;
            CHECK_MSG(past == 0, "%s q16_32 wrote %d bytes past %d blocks", ops->name, past, nb);
        }
    }
    free(x), free(r32), free(s32), free(r256), free(s256);
}

typedef struct dot_case {
    uint32_t t;
    int bits;   /* activation precision, 8 or 16 */
    int64_t n;
    void *w;    /* one weight row */
    float *x;   /* [n] original activations */
    void *xa;   /* prepared activation row (scalar reference quantizer) */
    float *wf;  /* [n] dequantized weights */
    float *xf;  /* [n] dequantized activations (what the integer dot actually sees) */
} dot_case;

static int make_case(dot_case *c, uint32_t t, int bits, int64_t n, uint64_t *s)
{
    c->t = t, c->bits = bits, c->n = n;
    c->w = malloc(bt_cpu_row_bytes(t, n));
    c->x = malloc((size_t)n * sizeof(float));
    c->xa = malloc(bt_cpu_act_row_bytes(t, bits, n));
    c->wf = malloc((size_t)n * sizeof(float));
    c->xf = malloc((size_t)n * sizeof(float));
    if (!c->w || !c->x || !c->xa || !c->wf || !c->xf) return -1;
    test_fill_row(t, n, c->w, s);
    test_fill_act(n, c->x, s);
    bt_cpu_prepare_act_row(bt_cpu_ops_get(BT_CPU_ISA_SCALAR), t, bits, n, c->x, c->xa);
    bt_cpu_dequantize_row_ref(t, n, c->w, c->wf);
    switch (bt_cpu_act_format(t, bits)) {
    case BT_ACT_Q8_32:
        for (int64_t i = 0; i < n; i++) {
            const bt_block_q8_32 *b = (const bt_block_q8_32 *)c->xa + i / 32;
            c->xf[i] = b->d * (float)b->qs[i % 32];
        }
        break;
    case BT_ACT_Q8_256:
        for (int64_t i = 0; i < n; i++) {
            const bt_block_q8_256 *b = (const bt_block_q8_256 *)c->xa + i / 256;
            c->xf[i] = b->s[0].d * (float)bt_q8k_qs(b, (int)(i % 256))[0];
        }
        break;
    case BT_ACT_Q16_32:
        for (int64_t i = 0; i < n; i++) {
            const bt_block_q16_32 *b = (const bt_block_q16_32 *)c->xa + i / 32;
            c->xf[i] = b->d * (float)b->qs[i % 32];
        }
        break;
    case BT_ACT_Q16_256:
        for (int64_t i = 0; i < n; i++) {
            const bt_block_q16_256 *b = (const bt_block_q16_256 *)c->xa + i / 256;
            c->xf[i] = b->s[0].d * (float)bt_q16k_qs(b, (int)(i % 256))[0];
        }
        break;
    default: memcpy(c->xf, c->x, (size_t)n * sizeof(float)); break;
    }
    return 0;
}

static void free_case(dot_case *c)
{
    free(c->w), free(c->x), free(c->xa), free(c->wf), free(c->xf);
}

static int64_t random_n(uint32_t t, uint64_t *s)
{
    int be = bt_cpu_block_elems(t);
    if (be == 1) return 1 + (int64_t)(test_rand_next(s) % 1200);
    return be * (1 + (int64_t)(test_rand_next(s) % (be == 32 ? 80 : 10)));
}

static const int act_bits_list[2] = {8, 16};

/* Scalar reference vs a float64 dot of dequantized weights and the original activations: the difference is
 * bounded by the activation quantization error, |x - xq| <= d_a / 2 per element, plus float rounding. With
 * 16-bit activations the whole error must also stay under 2e-5 of sum |w * x| (8-bit: ~1e-2); the worst ratio is
 * printed. */
static void test_ref_vs_dequantized(void)
{
    uint64_t s = 17;
    for (int bi = 0; bi < 2; bi++) {
        int bits = act_bits_list[bi];
        for (size_t k = 0; k < N_CPU_TEST_TYPES; k++) {
            uint32_t t = cpu_test_types[k];
            int bad = 0;
            double worst = 0;
            for (int rep = 0; rep < 30; rep++) {
                dot_case c;
                REQUIRE(make_case(&c, t, bits, random_n(t, &s), &s) == 0);
                double exact = 0, qerr = 0, mag = 0;
                for (int64_t i = 0; i < c.n; i++) {
                    exact += (double)c.wf[i] * c.x[i];
                    qerr += fabs((double)c.wf[i]) * fabs((double)c.x[i] - c.xf[i]);
                    mag += fabs((double)c.wf[i] * c.x[i]);
                }
                float got = bt_cpu_vec_dot_ref(t, bits, c.n, c.w, c.xa);
                double tol = qerr * 1.001 + 1e-5 * mag + 1e-30;
                double rel = fabs(got - exact) / (mag + 1e-30);
                worst = rel > worst ? rel : worst;
                if (fabs(got - exact) > tol || (bits == 16 && rel > 2e-5)) {
                    if (bad < 3)
                        fprintf(stderr, "%s/%d n=%lld: ref %.9g, float64 %.9g, tol %.3g\n", bt_ggml_type_name(t),
                                bits, (long long)c.n, got, exact, tol);
                    bad++;
                }
                free_case(&c);
            }
            if (bt_cpu_act_format(t, 8) != BT_ACT_F32)
                fprintf(stderr, "  %-5s act %2d bits: worst |ref - float64| = %.2e of sum |w x|\n",
                        bt_ggml_type_name(t), bits, worst);
            CHECK_MSG(bad == 0, "%s/%d: %d reference dots outside the quantization bound", bt_ggml_type_name(t),
                      bits, bad);
        }
    }
}

/* Every ISA vs the scalar reference on random rows: relative to the sum of |terms|, 1e-5 (float accumulation
 * order differs; the per-block integer dots are exact); K-quants with 16-bit activations bit for bit. */
static void test_simd_vs_ref(void)
{
    uint64_t s = 23;
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int bi = 0; bi < 2; bi++) {
            int bits = act_bits_list[bi];
            for (size_t k = 0; k < N_CPU_TEST_TYPES; k++) {
                uint32_t t = cpu_test_types[k];
                int bad = 0;
                for (int rep = 0; rep < 60; rep++) {
                    dot_case c;
                    REQUIRE(make_case(&c, t, bits, random_n(t, &s), &s) == 0);
                    double mag = 0;
                    for (int64_t i = 0; i < c.n; i++) mag += fabs((double)c.wf[i] * c.xf[i]);
                    float ref = bt_cpu_vec_dot_ref(t, bits, c.n, c.w, c.xa);
                    float got = bt_cpu_vec_dot(ops, t, bits, c.n, c.w, c.xa);
                    /* K-quants with 16-bit activations sum exactly in int64 and then follow the reference's float
                     * expression: bit-identical */
                    int exact = bits == 16 && bt_cpu_block_elems(t) == BT_QK_K;
                    if (fabs((double)got - ref) > 1e-5 * mag + 1e-30 ||
                        (exact && bt_f32_bits(got) != bt_f32_bits(ref))) {
                        if (bad < 3)
                            fprintf(stderr, "%s %s/%d n=%lld: %.9g vs ref %.9g (mag %.3g)\n", ops->name,
                                    bt_ggml_type_name(t), bits, (long long)c.n, got, ref, mag);
                        bad++;
                    }
                    free_case(&c);
                }
                CHECK_MSG(bad == 0, "%s %s/%d: %d dots differ from the reference", ops->name, bt_ggml_type_name(t),
                          bits, bad);
            }
        }
    }
}

/* With every scale 1 (and activation scale 1) all partial sums are small integers, exact in float in any order:
 * each ISA must then equal the reference exactly, which checks the integer part of every kernel. */
static void set_unit_scales(uint32_t t, int64_t n, uint8_t *w)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    uint16_t one = 0x3c00;
    for (int64_t b = 0; b < n / (int64_t)ti->block_elems; b++) {
        uint8_t *blk = w + b * ti->block_bytes;
        switch (t) {
        case BT_TYPE_Q4_1:
        case BT_TYPE_Q5_1:
        case BT_TYPE_Q4_K:
        case BT_TYPE_Q5_K: put16(blk, one), put16(blk + 2, one); break;
        case BT_TYPE_Q6_K: put16(blk + 208, one); break;
        default: put16(blk, one); break;
        }
    }
}

/* d = 1 on every activation block. 16-bit codes are cut to |q| <= 127 (sums recomputed) so that every partial sum
 * stays an integer below 2^24; one code of the first block is the extreme 32767 or -32767 (the widening and
 * multiply paths see it). */
static void unit_act_scales(dot_case *c, uint64_t *s)
{
    switch (bt_cpu_act_format(c->t, c->bits)) {
    case BT_ACT_Q8_32: {
        bt_block_q8_32 *a = c->xa;
        for (int64_t b = 0; b < c->n / 32; b++) a[b].d = 1.0f, a[b].ds = (float)a[b].sum;
        break;
    }
    case BT_ACT_Q8_256: {
        bt_block_q8_256 *a = c->xa;
        for (int64_t b = 0; b < c->n / 256; b++) bt_q8k_finish(&a[b], 1.0f);
        break;
    }
    case BT_ACT_Q16_32: {
        bt_block_q16_32 *a = c->xa;
        for (int64_t b = 0; b < c->n / 32; b++) {
            int32_t sum = 0;
            for (int j = 0; j < 32; j++) {
                a[b].qs[j] = (int16_t)(a[b].qs[j] / 256);
                if (b == 0 && j == 7) a[b].qs[j] = test_rand_next(s) & 1 ? 32767 : -32767;
                sum += a[b].qs[j];
            }
            a[b].d = 1.0f, a[b].sum = sum, a[b].ds = (float)sum;
        }
        break;
    }
    default: {
        bt_block_q16_256 *a = c->xa;
        for (int64_t b = 0; b < c->n / 256; b++) {
            for (int k = 0; k < 16; k++) {
                int32_t sum = 0;
                for (int j = 0; j < 16; j++) {
                    int16_t *q = &a[b].s[k / 2].qs[16 * (k % 2) + j];
                    *q = (int16_t)(*q / 256);
                    if (b == 0 && k == 3 && j == 5) *q = test_rand_next(s) & 1 ? 32767 : -32767;
                    sum += *q;
                }
                if (k % 2)
                    a[b].s[k / 2].sum = a[b].s[k / 2].sum_lo + sum;
                else
                    a[b].s[k / 2].sum_lo = sum;
            }
            bt_q16k_finish(&a[b], 1.0f);
        }
        break;
    }
    }
}

static void test_integer_parts_exact(void)
{
    uint64_t s = 29;
    for (int bi = 0; bi < 2; bi++) {
        int bits = act_bits_list[bi];
        for (size_t k = 3; k < N_CPU_TEST_TYPES; k++) { /* quantized types */
            uint32_t t = cpu_test_types[k];
            for (int rep = 0; rep < 20; rep++) {
                dot_case c;
                REQUIRE(make_case(&c, t, bits, random_n(t, &s), &s) == 0);
                set_unit_scales(t, c.n, c.w);
                unit_act_scales(&c, &s);
                float ref = bt_cpu_vec_dot_ref(t, bits, c.n, c.w, c.xa);
                for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
                    if (!test_isa_covers((bt_cpu_isa)isa)) continue;
                    const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
                    float got = bt_cpu_vec_dot(ops, t, bits, c.n, c.w, c.xa);
                    CHECK_MSG(got == ref, "%s %s/%d n=%lld: %.1f vs %.1f", ops->name, bt_ggml_type_name(t), bits,
                              (long long)c.n, got, ref);
                }
                free_case(&c);
            }
        }
    }
}

/* Worst-case magnitudes: every weight code and activation code at its extreme with equal signs, all scales 1.
 * The integer sums reach their proven bounds (see cpu_quants.c); the result must be the exact float64 value
 * rounded, with no wrap-around in any ISA. */
static void test_q16_extremes(void)
{
    for (size_t k = 3; k < N_CPU_TEST_TYPES; k++) {
        uint32_t t = cpu_test_types[k];
        int64_t n = bt_cpu_block_elems(t) * 4;
        const bt_ggml_type_info *ti = bt_ggml_type_get(t);
        uint8_t *w = malloc(bt_cpu_row_bytes(t, n));
        float *wf = malloc((size_t)n * sizeof *wf), *x = malloc((size_t)n * sizeof *x);
        void *xa = malloc(bt_cpu_act_row_bytes(t, 16, n));
        REQUIRE(w && wf && x && xa);
        for (int pass = 0; pass < 2; pass++) { /* all bits set (largest codes), then all clear (most negative) */
            memset(w, pass ? 0x00 : 0xff, bt_cpu_row_bytes(t, n));
            for (int64_t b = 0; b < n / (int64_t)ti->block_elems; b++) {
                uint8_t *blk = w + b * ti->block_bytes;
                if (t == BT_TYPE_Q6_K) {
                    put16(blk + 208, 0x3c00);
                    memset(blk + 192, pass ? 0x80 : 0x7f, 16); /* scales -128 / 127 */
                } else if (t == BT_TYPE_Q4_K || t == BT_TYPE_Q5_K) {
                    put16(blk, 0x3c00), put16(blk + 2, 0);
                    memset(blk + 4, 0xff, 12); /* every 6-bit scale 63 */
                } else {
                    put16(blk, 0x3c00);
                    if (t == BT_TYPE_Q4_1 || t == BT_TYPE_Q5_1) put16(blk + 2, 0);
                    if (t == BT_TYPE_Q8_0) memset(blk + 2, pass ? 0x7f : 0x80, 32); /* codes 127 / -128 */
                }
            }
            bt_cpu_dequantize_row_ref(t, n, w, wf);
            for (int64_t i = 0; i < n; i++) x[i] = wf[i] < 0 ? -1.0f : 1.0f;
            bt_cpu_prepare_act_row(bt_cpu_ops_get(BT_CPU_ISA_SCALAR), t, 16, n, x, xa);
            double want = 0;
            for (int64_t i = 0; i < n; i++) want += fabs((double)wf[i]) * 32767.0; /* codes +-32767, d folded in */
            float d = 1.0f / 32767.0f;
            for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
                if (!test_isa_covers((bt_cpu_isa)isa)) continue;
                const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
                double got = bt_cpu_vec_dot(ops, t, 16, n, w, xa);
                double exp_ = want * d;
                CHECK_MSG(fabs(got - exp_) <= 1e-5 * fabs(exp_), "%s %s pass %d: %.9g vs %.9g", ops->name,
                          bt_ggml_type_name(t), pass, got, exp_);
            }
        }
        free(w), free(wf), free(x), free(xa);
    }
}

/* dot_rows with nr rows gives each row exactly what nr = 1 gives it (the basis of batch invariance). */
static void test_dot_rows_invariant(void)
{
    uint64_t s = 31;
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int bi = 0; bi < 2; bi++) {
            int bits = act_bits_list[bi];
            for (size_t k = 0; k < N_CPU_TEST_TYPES; k++) {
                uint32_t t = cpu_test_types[k];
                int64_t n = random_n(t, &s);
                size_t ab = bt_cpu_act_row_bytes(t, bits, n);
                uint8_t *w = malloc(bt_cpu_row_bytes(t, n)), *xa = malloc(ab * BT_CPU_MAX_NR);
                float *x = malloc((size_t)n * sizeof *x);
                REQUIRE(w && xa && x);
                test_fill_row(t, n, w, &s);
                for (int r = 0; r < BT_CPU_MAX_NR; r++) {
                    test_fill_act(n, x, &s);
                    bt_cpu_prepare_act_row(ops, t, bits, n, x, xa + r * ab);
                }
                bt_cpu_dot_rows_fn dot = bt_cpu_dot_rows_get(ops, t, bits);
                REQUIRE(dot);
                for (int nr = 1; nr <= BT_CPU_MAX_NR; nr++) {
                    float outs[2 * BT_CPU_MAX_NR];
                    dot(n, w, xa, ab, nr, outs, 2);
                    for (int r = 0; r < nr; r++) {
                        float one = bt_cpu_vec_dot(ops, t, bits, n, w, xa + r * ab);
                        CHECK_MSG(bt_f32_bits(one) == bt_f32_bits(outs[2 * r]),
                                  "%s %s/%d nr=%d row %d: %.9g vs %.9g", ops->name, bt_ggml_type_name(t), bits, nr,
                                  r, outs[2 * r], one);
                    }
                }
                free(w), free(xa), free(x);
            }
        }
    }
}

/* bt_cpu_quantize_row_q4_k: every element dequantizes back to within half a step of the sub-block's stored scale
 * (plus the rounding of that scale), the scale bytes round-trip through bt_q4k_scale_min, and an all-zero row
 * stays zero. */
static void test_quantize_q4_k(void)
{
    uint64_t s = 61;
    enum { N = 4 * BT_QK_K };
    float x[N], y[N];
    bt_block_q4_k q[N / BT_QK_K];
    for (int rep = 0; rep < 20; rep++) {
        float spread = rep % 4 == 0 ? 1e-3f : rep % 4 == 1 ? 1.0f : 30.0f;
        for (int i = 0; i < N; i++) x[i] = ((float)(test_rand_next(&s) % 20001) / 10000.0f - (rep & 1 ? 0.3f : 1.0f)) * spread;
        bt_cpu_quantize_row_q4_k(N, x, q);
        REQUIRE(bt_cpu_dequantize_row_ref(BT_TYPE_Q4_K, N, q, y) == 0);
        int bad = 0;
        for (int b = 0; b < N / BT_QK_K; b++)
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                bt_q4k_scale_min(q[b].scales, j, &sc, &m);
                float step = bt_fp16_to_f32(q[b].d) * (float)sc;
                float lo = x[b * BT_QK_K + 32 * j], hi = lo;
                for (int i = 0; i < 32; i++) {
                    float v = x[b * BT_QK_K + 32 * j + i];
                    lo = v < lo ? v : lo, hi = v > hi ? v : hi;
                }
                /* the stored scale and min are 6-bit multiples of fp16 d, dmin: allow their rounding too */
                float tol = 0.5f * step + 0.02f * (hi - lo) + 1e-6f * spread;
                for (int i = 0; i < 32; i++)
                    if (fabsf(y[b * BT_QK_K + 32 * j + i] - x[b * BT_QK_K + 32 * j + i]) > tol) bad++;
            }
        CHECK_MSG(bad == 0, "rep %d (spread %g): %d elements off by more than half a step", rep, spread, bad);
    }
    for (int i = 0; i < N; i++) x[i] = 0;
    bt_cpu_quantize_row_q4_k(N, x, q);
    REQUIRE(bt_cpu_dequantize_row_ref(BT_TYPE_Q4_K, N, q, y) == 0);
    for (int i = 0; i < N; i++) CHECK(y[i] == 0.0f);
}

/* bt_cpu_quantize_row_q5_0 / _q5_1: every element dequantizes back to within half a step (d, as stored) plus the
 * fp16 rounding of d and m, or, past the ends of the block's grid, to its nearest end (Q5_0's grid d * (q - 16)
 * reaches 16 steps on the side of the largest magnitude but only 15 on the other); an all-zero row stays zero. */
static void test_quantize_q5(void)
{
    uint64_t s = 67;
    enum { N = 8 * BT_QK };
    float x[N], y[N];
    bt_block_q5_0 q0[N / BT_QK];
    bt_block_q5_1 q1[N / BT_QK];
    for (int rep = 0; rep < 40; rep++) {
        int t1 = rep & 1;
        float spread = rep % 6 < 2 ? 1e-3f : rep % 6 < 4 ? 1.0f : 30.0f;
        for (int i = 0; i < N; i++) x[i] = ((float)(test_rand_next(&s) % 20001) / 10000.0f - (rep & 2 ? 0.3f : 1.0f)) * spread;
        if (t1) bt_cpu_quantize_row_q5_1(N, x, q1);
        else bt_cpu_quantize_row_q5_0(N, x, q0);
        REQUIRE(bt_cpu_dequantize_row_ref(t1 ? BT_TYPE_Q5_1 : BT_TYPE_Q5_0, N, t1 ? (void *)q1 : (void *)q0, y) == 0);
        int bad = 0;
        for (int b = 0; b < N / BT_QK; b++) {
            float ds = bt_fp16_to_f32(t1 ? q1[b].d : q0[b].d), d = fabsf(ds), big = 0;
            float g0 = t1 ? bt_fp16_to_f32(q1[b].m) : -16.0f * ds, g1 = t1 ? g0 + 31.0f * ds : 15.0f * ds;
            float glo = g0 < g1 ? g0 : g1, ghi = g0 < g1 ? g1 : g0; /* the grid's ends */
            for (int i = 0; i < BT_QK; i++) big = fabsf(x[b * BT_QK + i]) > big ? fabsf(x[b * BT_QK + i]) : big;
            float tol = 0.5f * d + 2e-3f * big + 1e-7f * spread; /* fp16 rounding of d (and m) over 16-31 steps */
            for (int i = 0; i < BT_QK; i++) {
                float v = x[b * BT_QK + i], past = v < glo ? glo - v : v > ghi ? v - ghi : 0.0f;
                if (fabsf(y[b * BT_QK + i] - v) > tol + past) bad++;
            }
        }
        CHECK_MSG(bad == 0, "Q5_%d rep %d (spread %g): %d elements off by more than half a step", t1, rep, spread, bad);
    }
    for (int i = 0; i < N; i++) x[i] = 0;
    bt_cpu_quantize_row_q5_0(N, x, q0);
    REQUIRE(bt_cpu_dequantize_row_ref(BT_TYPE_Q5_0, N, q0, y) == 0);
    for (int i = 0; i < N; i++) CHECK(y[i] == 0.0f);
    bt_cpu_quantize_row_q5_1(N, x, q1);
    REQUIRE(bt_cpu_dequantize_row_ref(BT_TYPE_Q5_1, N, q1, y) == 0);
    for (int i = 0; i < N; i++) CHECK(y[i] == 0.0f);
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_quantize_q4_k);
    RUN(test_quantize_q5);
    RUN(test_geometry);
    RUN(test_dequant_known);
    RUN(test_act_quant);
    RUN(test_act_quant16);
    RUN(test_ref_vs_dequantized);
    RUN(test_simd_vs_ref);
    RUN(test_integer_parts_exact);
    RUN(test_q16_extremes);
    RUN(test_dot_rows_invariant);
    test_isa_report();
    return test_summary();
}
