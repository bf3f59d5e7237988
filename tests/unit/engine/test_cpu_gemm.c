/* The tiled GEMM over packed weights (bt_cpu_pack, engine/cpu/cpu_gemm.c and cpu_avx512_gemm.c): SIMD kernels
 * bit-identical to the scalar reference of the packed arithmetic and within float-order tolerance of the unpacked
 * scalar dot products; and batch invariance (DESIGN 4.3) of every matmul path, packed where the ISA packs: a row's
 * outputs are bit-identical alone or among N - 1 other rows of any content, at any thread count. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"
#include "test_isa.h"

/* Q5_0 packs into the Q8_0 layout at 8 bits (bt_cpu_pack_layout) */
static const uint32_t packed_types[] = {BT_TYPE_Q4_0, BT_TYPE_Q4_1, BT_TYPE_Q8_0, BT_TYPE_Q4_K,
                                        BT_TYPE_Q5_K, BT_TYPE_Q6_K, BT_TYPE_Q5_0, BT_TYPE_Q5_1};

/* K-quant layouts take rows of whole 256-element super-blocks */
static int kquant(uint32_t t)
{
    return t == BT_TYPE_Q4_K || t == BT_TYPE_Q5_K || t == BT_TYPE_Q6_K;
}
#define N_PACKED ((int)(sizeof packed_types / sizeof packed_types[0]))

static int64_t rand_range(uint64_t *s, int64_t lo, int64_t hi) /* [lo, hi] */
{
    return lo + (int64_t)(test_rand_next(s) % (uint64_t)(hi - lo + 1));
}

static uint8_t *make_weights(uint32_t t, int64_t n_in, int64_t n_out, uint64_t *s)
{
    size_t wb = bt_cpu_row_bytes(t, n_in);
    uint8_t *w = malloc(wb * (size_t)n_out);
    if (w)
        for (int64_t o = 0; o < n_out; o++) test_fill_row(t, n_in, w + wb * (size_t)o, s);
    return w;
}

/* Packed kernels: bit-identical to bt_cpu_gemm_packed_ref for every nr and n_valid, and within 1e-5 of
 * sum |w * x| of the unpacked scalar reference dot (same quantized activations, so only float order differs). */
static void test_gemm_matches_refs(void)
{
    uint64_t s = 51;
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int k = 0; k < 2 * N_PACKED; k++) {
            uint32_t t = packed_types[k % N_PACKED];
            int bits = k < N_PACKED ? 8 : 16;
            if (!bt_cpu_pack_supported(ops, t, bits)) continue;
            for (int rep = 0; rep < 6; rep++) {
                int64_t n_in = kquant(t) ? 256 * rand_range(&s, 1, 6) : 32 * rand_range(&s, 1, 48);
                int64_t n_out = rand_range(&s, 1, 70), n_rows = rand_range(&s, 1, 20); /* up to 2 tiles of 9-16 */
                uint8_t *w = make_weights(t, n_in, n_out, &s);
                size_t ab = bt_cpu_act_row_bytes(t, bits, n_in), wb = bt_cpu_row_bytes(t, n_in);
                float *x = malloc(sizeof(float) * (size_t)(n_in * n_rows));
                uint8_t *xq = malloc(ab * (size_t)n_rows);
                float *out = malloc(sizeof(float) * (size_t)(n_out * n_rows)), ref[BT_CPU_GEMM_NR * 16];
                float *wd = malloc(sizeof(float) * (size_t)n_in);
                REQUIRE(w && x && xq && out && wd);
                test_fill_act(n_in * n_rows, x, &s);
                bt_cpu_packed p;
                REQUIRE(bt_cpu_pack(ops, NULL, t, bits, n_in, n_out, w, &p) == BT_OK);
                CHECK(p.group_bytes % 64 == 0 && ((uintptr_t)p.data & 63) == 0);
                bt_cpu_matmul mm = {.ops = ops, .wtype = t, .n_in = n_in, .n_out = n_out, .n_rows = n_rows, .w = w,
                                    .x = x, .xq = xq, .out = out, .act_bits = bits, .wp = &p};
                REQUIRE(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
                int bad_ref = 0, bad_tol = 0;
                for (int64_t r0 = 0; r0 < n_rows; r0 += BT_CPU_GEMM_NR) {
                    int nr = (int)(n_rows - r0 < BT_CPU_GEMM_NR ? n_rows - r0 : BT_CPU_GEMM_NR);
                    for (int64_t g = 0; g * 16 < n_out; g++) {
                        int nv = (int)(n_out - 16 * g < 16 ? n_out - 16 * g : 16);
                        bt_cpu_gemm_packed_ref(&p, g, xq + (size_t)r0 * ab, ab, nr, ref, 16, nv);
                        for (int r = 0; r < nr; r++)
                            for (int j = 0; j < nv; j++)
                                if (bt_f32_bits(ref[r * 16 + j]) != bt_f32_bits(out[(r0 + r) * n_out + 16 * g + j]))
                                    bad_ref++;
                    }
                }
                for (int64_t r = 0; r < n_rows; r++)
                    for (int64_t o = 0; o < n_out; o++) {
                        float d = bt_cpu_vec_dot_ref(t, bits, n_in, w + wb * (size_t)o, xq + ab * (size_t)r);
                        REQUIRE(bt_cpu_dequantize_row_ref(t, n_in, w + wb * (size_t)o, wd) == 0);
                        double mag = 0;
                        for (int64_t i = 0; i < n_in; i++) mag += fabs((double)wd[i] * x[r * n_in + i]);
                        if (fabs((double)d - out[r * n_out + o]) > 1e-5 * mag + 1e-30) bad_tol++;
                    }
                CHECK_MSG(bad_ref == 0 && bad_tol == 0, "%s %s/%d n_in=%lld n_out=%lld: %d differ from the packed "
                          "reference, %d beyond tolerance", ops->name, bt_ggml_type_name(t), bits, (long long)n_in,
                          (long long)n_out, bad_ref, bad_tol);
                bt_cpu_packed_free(&p);
                free(w), free(x), free(xq), free(out), free(wd);
            }
        }
    }
}

/* Each kernel called directly at every width nr = 1..bt_cpu_gemm_nr (each has its own chain count and unrolling),
 * with and without a group to prefetch, on a group with n_valid < 16 too: bit-identical to the reference, and
 * rows past n_valid and past nr untouched. */
static void test_gemm_each_width(void)
{
    uint64_t s = 59;
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int k = 0; k < 6 * N_PACKED; k++) {
            uint32_t t = packed_types[k % N_PACKED];
            int bits = k % (2 * N_PACKED) < N_PACKED ? 8 : 16, fixed = k / (2 * N_PACKED);
            if (!bt_cpu_pack_supported(ops, t, bits)) continue;
            uint32_t l = bt_cpu_pack_layout(t, bits);
            bt_cpu_gemm_fn gemm = bits == 8 ? ops->gemm8[l] : ops->gemm16[l];
            /* a random length, then two fixed ones: for the legacy types 19 blocks (the AVX2 16-bit Q5 scratch
             * passes take 8 blocks at a time: 8 + 8 + 3) and 16 (two whole chunks) */
            int64_t n_in = fixed == 1   ? (kquant(t) ? 256 * 3 : 32 * 19)
                           : fixed == 2 ? (kquant(t) ? 256 : 32 * 16)
                           : kquant(t)  ? 256 * rand_range(&s, 1, 3)
                                        : 32 * rand_range(&s, 1, 20);
            int64_t n_out = 16 + rand_range(&s, 1, 15); /* 2 groups, last partial */
            uint8_t *w = make_weights(t, n_in, n_out, &s);
            size_t ab = bt_cpu_act_row_bytes(t, bits, n_in);
            float *x = malloc(sizeof(float) * (size_t)(n_in * BT_CPU_GEMM_NR_MAX));
            uint8_t *xq = malloc(ab * BT_CPU_GEMM_NR_MAX);
            REQUIRE(w && x && xq);
            test_fill_act(n_in * BT_CPU_GEMM_NR_MAX, x, &s);
            for (int r = 0; r < BT_CPU_GEMM_NR_MAX; r++)
                bt_cpu_prepare_act_row(ops, t, bits, n_in, x + r * n_in, xq + (size_t)r * ab);
            bt_cpu_packed p;
            REQUIRE(bt_cpu_pack(ops, NULL, t, bits, n_in, n_out, w, &p) == BT_OK);
            int bad = 0;
            for (int nr = 1; nr <= bt_cpu_gemm_nr(ops); nr++)
                for (int g = 0; g < 2; g++) {
                    int nv = g ? (int)(n_out - 16) : 16;
                    const char *grp = (const char *)p.data + (size_t)g * p.group_bytes;
                    float out[(BT_CPU_GEMM_NR_MAX + 1) * 16], ref[BT_CPU_GEMM_NR_MAX * 16];
                    for (int i = 0; i < (BT_CPU_GEMM_NR_MAX + 1) * 16; i++) out[i] = -7.0f;
                    gemm(n_in, grp, xq, ab, nr, out, 16, nv, g ? NULL : (const char *)p.data + p.group_bytes);
                    bt_cpu_gemm_packed_ref(&p, g, xq, ab, nr, ref, 16, nv);
                    for (int r = 0; r <= BT_CPU_GEMM_NR_MAX; r++)
                        for (int j = 0; j < 16; j++) {
                            int set = r < nr && j < nv;
                            if (set ? bt_f32_bits(out[r * 16 + j]) != bt_f32_bits(ref[r * 16 + j]) : out[r * 16 + j] != -7.0f)
                                bad++;
                        }
                }
            CHECK_MSG(bad == 0, "%s %s/%d n_in=%lld n_out=%lld: %d outputs wrong", ops->name, bt_ggml_type_name(t),
                      bits, (long long)n_in, (long long)n_out, bad);
            bt_cpu_packed_free(&p);
            free(w), free(x), free(xq);
        }
    }
}

/* Q5_0's nibble and high-bit plane layout (16-bit activations) gives the bits the Q8_0 layout of the same values
 * (codes q - 16, the same d) gives, which is how Q5_0 was packed before it had a layout of its own. */
static void test_q5_0_plane_matches_q8_0(void)
{
    uint64_t s = 61;
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!bt_cpu_pack_supported(ops, BT_TYPE_Q5_0, 16) || !bt_cpu_pack_supported(ops, BT_TYPE_Q8_0, 16)) continue;
        for (int rep = 0; rep < 4; rep++) {
            int64_t n_in = 32 * rand_range(&s, 1, 40), n_out = rand_range(&s, 1, 50), n_rows = rand_range(&s, 1, 20);
            int64_t nb = n_in / 32;
            bt_block_q5_0 *w5 = (bt_block_q5_0 *)make_weights(BT_TYPE_Q5_0, n_in, n_out, &s);
            bt_block_q8_0 *w8 = malloc(sizeof *w8 * (size_t)(nb * n_out));
            float *x = malloc(sizeof(float) * (size_t)(n_in * n_rows));
            float *o5 = malloc(sizeof(float) * (size_t)(n_out * n_rows)), *o8 = malloc(sizeof(float) * (size_t)(n_out * n_rows));
            uint8_t *xq = malloc(bt_cpu_act_row_bytes(BT_TYPE_Q5_0, 16, n_in) * (size_t)n_rows);
            REQUIRE(w5 && w8 && x && o5 && o8 && xq);
            REQUIRE(bt_cpu_act_row_bytes(BT_TYPE_Q5_0, 16, n_in) == bt_cpu_act_row_bytes(BT_TYPE_Q8_0, 16, n_in));
            for (int64_t i = 0; i < nb * n_out; i++) {
                uint32_t qh = (uint32_t)w5[i].qh[0] | (uint32_t)w5[i].qh[1] << 8 | (uint32_t)w5[i].qh[2] << 16 |
                              (uint32_t)w5[i].qh[3] << 24;
                w8[i].d = w5[i].d;
                for (int e = 0; e < 32; e++) {
                    int nib = e < 16 ? w5[i].qs[e] & 15 : w5[i].qs[e - 16] >> 4;
                    w8[i].qs[e] = (int8_t)((nib | (int)((qh >> e) & 1) << 4) - 16);
                }
            }
            test_fill_act(n_in * n_rows, x, &s);
            bt_cpu_packed p5, p8;
            REQUIRE(bt_cpu_pack(ops, NULL, BT_TYPE_Q5_0, 16, n_in, n_out, w5, &p5) == BT_OK);
            REQUIRE(bt_cpu_pack(ops, NULL, BT_TYPE_Q8_0, 16, n_in, n_out, w8, &p8) == BT_OK);
            CHECK(p5.wtype == BT_TYPE_Q5_0 && p5.group_bytes * 32 < p8.group_bytes * 21); /* 352 vs 544 per block */
            bt_cpu_matmul mm = {.ops = ops, .wtype = BT_TYPE_Q5_0, .n_in = n_in, .n_out = n_out, .n_rows = n_rows,
                                .w = w5, .x = x, .xq = xq, .out = o5, .act_bits = 16, .wp = &p5};
            REQUIRE(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
            mm.wtype = BT_TYPE_Q8_0, mm.w = w8, mm.out = o8, mm.wp = &p8;
            REQUIRE(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
            int bad = 0;
            for (int64_t i = 0; i < n_out * n_rows; i++) bad += bt_f32_bits(o5[i]) != bt_f32_bits(o8[i]);
            CHECK_MSG(bad == 0, "%s n_in=%lld n_out=%lld n_rows=%lld: %d outputs differ from the Q8_0 layout's",
                      ops->name, (long long)n_in, (long long)n_out, (long long)n_rows, bad);
            bt_cpu_packed_free(&p5), bt_cpu_packed_free(&p8);
            free(w5), free(w8), free(x), free(o5), free(o8), free(xq);
        }
    }
}

/* Rows of +-1 for the extremes tests, 5 patterns by row r: -1, +1, alternating, alternating the other way, +-1 by
 * pairs. At 8 bits they quantize to +-127 exactly. */
static void fill_pm1(float *x, int n_rows, int n_in)
{
    for (int r = 0; r < n_rows; r++)
        for (int i = 0; i < n_in; i++)
            x[r * n_in + i] = r % 5 == 0 ? -1.0f : r % 5 == 1 ? 1.0f : r % 5 == 2 ? (i & 1 ? 1.0f : -1.0f)
                            : r % 5 == 3 ? (i & 1 ? -1.0f : 1.0f) : (i & 2 ? -1.0f : 1.0f);
}

enum { EXT_ROWS = 5, EXT_OUT = 20 };

/* Every ISA that packs type t at `bits`: the matmul of x (EXT_ROWS rows of n_in) by w (EXT_OUT rows), bit-identical
 * to the packed reference, and each row again alone (the one-row kernels: AVX2's 16-bit nibble path sums two of its
 * operands scaled by 16 and 256, gemm16_span); out (EXT_ROWS x EXT_OUT) keeps the last ISA's outputs; *tested counts
 * the ISAs run. */
static void check_packed(uint32_t t, int bits, int n_in, const void *w, const float *x, float *out, int *tested)
{
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!bt_cpu_pack_supported(ops, t, bits)) continue;
        size_t ab = bt_cpu_act_row_bytes(t, bits, n_in);
        uint8_t *xq = malloc(ab * EXT_ROWS);
        float ref[BT_CPU_GEMM_NR * 16], one[EXT_OUT];
        REQUIRE(xq);
        bt_cpu_packed p;
        REQUIRE(bt_cpu_pack(ops, NULL, t, bits, n_in, EXT_OUT, w, &p) == BT_OK);
        bt_cpu_matmul mm = {.ops = ops, .wtype = t, .n_in = n_in, .n_out = EXT_OUT, .n_rows = EXT_ROWS, .w = w,
                            .x = x, .xq = xq, .out = out, .act_bits = bits, .wp = &p};
        REQUIRE(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
        int bad = 0, bad_one = 0;
        for (int64_t g = 0; g * 16 < EXT_OUT; g++) {
            int nv = (int)(EXT_OUT - 16 * g < 16 ? EXT_OUT - 16 * g : 16);
            bt_cpu_gemm_packed_ref(&p, g, xq, ab, EXT_ROWS, ref, 16, nv);
            for (int r = 0; r < EXT_ROWS; r++)
                for (int j = 0; j < nv; j++)
                    bad += bt_f32_bits(ref[r * 16 + j]) != bt_f32_bits(out[r * EXT_OUT + 16 * g + j]);
        }
        for (int r = 0; r < EXT_ROWS; r++) {
            bt_cpu_matmul m1 = mm;
            m1.n_rows = 1, m1.x = x + (size_t)r * (size_t)n_in, m1.out = one;
            REQUIRE(bt_cpu_matmul_run(NULL, &m1) == BT_OK);
            for (int o = 0; o < EXT_OUT; o++) bad_one += bt_f32_bits(one[o]) != bt_f32_bits(out[r * EXT_OUT + o]);
        }
        CHECK_MSG(bad == 0 && bad_one == 0, "%s %s/%d: %d outputs differ from the packed reference, %d alone",
                  ops->name, bt_ggml_type_name(t), bits, bad, bad_one);
        bt_cpu_packed_free(&p);
        free(xq);
        (*tested)++;
    }
}

/* Q8_0 at 8-bit activations at the ends of both ranges: codes -128 and 127 against activations of +-127, so that a
 * pair of products reaches 2 * 128 * 127 (AVX2 feeds |q| and the activation with q's sign to vpmaddubsw, which
 * saturates past 32767). Bit-identical to the packed reference and to the exact integer dot times the scales. */
static void test_q8_0_extremes(void)
{
    enum { N_IN = 96 };
    bt_block_q8_0 w[EXT_OUT * N_IN / 32];
    for (int o = 0; o < EXT_OUT; o++)
        for (int b = 0; b < N_IN / 32; b++) {
            bt_block_q8_0 *blk = &w[o * (N_IN / 32) + b];
            blk->d = bt_f32_to_fp16(0.5f);
            for (int e = 0; e < 32; e++) /* all -128, all 127, or alternating, by row */
                blk->qs[e] = (int8_t)(o % 3 == 0 ? -128 : o % 3 == 1 ? 127 : (e + b) & 1 ? -128 : 127);
        }
    float x[EXT_ROWS * N_IN], out[EXT_ROWS * EXT_OUT];
    fill_pm1(x, EXT_ROWS, N_IN);
    int tested = 0;
    check_packed(BT_TYPE_Q8_0, 8, N_IN, w, x, out, &tested);
    /* every ISA's outputs are the reference's bits (check_packed), so the last one's stand for all: row r's output
     * o is 0.5 * (1 / 127) * sum(q * a) per block */
    int bad_exact = 0;
    for (int r = 0; tested && r < EXT_ROWS; r++)
        for (int o = 0; o < EXT_OUT; o++) {
            double want = 0;
            for (int b = 0; b < N_IN / 32; b++) {
                long isum = 0;
                for (int e = 0; e < 32; e++)
                    isum += (long)w[o * (N_IN / 32) + b].qs[e] * (x[r * N_IN + 32 * b + e] > 0 ? 127 : -127);
                want += 0.5 * (1.0 / 127.0) * (double)isum;
            }
            bad_exact += fabs(out[r * EXT_OUT + o] - want) > 1e-4 * fabs(want) + 1e-6;
        }
    CHECK_MSG(bad_exact == 0, "%d outputs differ from the exact dot", bad_exact);
    CHECK(tested > 0 || !test_isa_covers(BT_CPU_ISA_AVX2)); /* AVX2 and AVX-512 pack Q8_0 at 8 bits */
}

/* The nibble layouts (Q4_0, Q4_1, Q4_K) at 8-bit activations at the ends of both ranges: every code 15 (or 0, or the
 * two by nibble) against activations of +-127, so that each int16 lane of AVX2's per-block sums (dot8_nib_rows: 16
 * products of a row's block) reaches 16 * 15 * 127 = 30480, near 2^15. Then at 16 bits (activations of +-32767), where
 * AVX2's one-row pass sums a block's 8 products of codes times 256 in an int32 lane (15 * 256 * 32767 * 8, about half
 * of 2^31). Bit-identical to the packed reference, whose integer dot is exact. */
static void test_nibble_extremes(void)
{
    enum { N_IN = 512 };
    static const uint32_t types[] = {BT_TYPE_Q4_0, BT_TYPE_Q4_1, BT_TYPE_Q4_K};
    float x[EXT_ROWS * N_IN], out[EXT_ROWS * EXT_OUT];
    fill_pm1(x, EXT_ROWS, N_IN);
    int tested = 0;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const uint32_t t = types[k];
        const size_t wb = bt_cpu_row_bytes(t, N_IN);
        uint8_t *w = calloc(EXT_OUT, wb);
        REQUIRE(w);
        for (int o = 0; o < EXT_OUT; o++) { /* codes all 15, all 0, or 15 in the low nibbles only, by row */
            const uint8_t code = o % 3 == 0 ? 0xff : o % 3 == 1 ? 0x00 : 0x0f;
            uint8_t *row = w + wb * (size_t)o;
            if (t == BT_TYPE_Q4_K) {
                for (int sb = 0; sb < N_IN / 256; sb++) {
                    bt_block_q4_k *blk = (bt_block_q4_k *)row + sb;
                    blk->d = bt_f32_to_fp16(0.5f), blk->dmin = bt_f32_to_fp16(0.25f);
                    for (int i = 0; i < 12; i++) blk->scales[i] = (uint8_t)(0x3f - 5 * i);
                    for (int i = 0; i < 128; i++) blk->qs[i] = code;
                }
                continue;
            }
            for (int b = 0; b < N_IN / 32; b++) {
                uint8_t *qs;
                if (t == BT_TYPE_Q4_0) {
                    bt_block_q4_0 *blk = (bt_block_q4_0 *)row + b;
                    blk->d = bt_f32_to_fp16(0.5f), qs = blk->qs;
                } else {
                    bt_block_q4_1 *blk = (bt_block_q4_1 *)row + b;
                    blk->d = bt_f32_to_fp16(0.5f), blk->m = bt_f32_to_fp16(-0.25f), qs = blk->qs;
                }
                for (int i = 0; i < 16; i++) qs[i] = code;
            }
        }
        check_packed(t, 8, N_IN, w, x, out, &tested);
        check_packed(t, 16, N_IN, w, x, out, &tested);
        free(w);
    }
    CHECK(tested > 0 || !test_isa_covers(BT_CPU_ISA_AVX2));
}

/* Every type, both precisions, every ISA (packed wherever the ISA packs the type): N random rows in 1..70 on a
 * random thread count; then each row alone on another thread count, and among rows of fresh random content. The
 * single and 5-row runs carry a next-run prefetch hint (bt_cpu_matmul.then: its own weights, and a buffer that is
 * no packed matrix), which must not change a bit. */
static void test_gemm_batch_invariance(void)
{
    uint64_t s = 53;
    bt_pool *pools[4] = {0};
    for (int i = 0; i < 4; i++) REQUIRE(bt_pool_create(i + 1, &pools[i]) == BT_OK);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (size_t kk = 0; kk < 2 * N_CPU_TEST_TYPES; kk++) {
            uint32_t t = cpu_test_types[kk % N_CPU_TEST_TYPES];
            int bits = kk < N_CPU_TEST_TYPES ? 16 : 8;
            int be = bt_cpu_block_elems(t);
            int64_t n_in = be == 1 ? rand_range(&s, 1, 300) : be * rand_range(&s, 1, be == 32 ? 12 : 2);
            int64_t n_out = rand_range(&s, 1, 70), n_rows = rand_range(&s, 1, isa == 0 ? 24 : 70);
            uint8_t *w = make_weights(t, n_in, n_out, &s);
            size_t ab = bt_cpu_act_row_bytes(t, bits, n_in);
            float *x = malloc(sizeof(float) * (size_t)(n_in * n_rows)), *x2 = malloc(sizeof(float) * (size_t)(n_in * 5));
            uint8_t *xq = malloc(ab * (size_t)(n_rows > 5 ? n_rows : 5)); /* m5 below reuses it */
            float *out = malloc(sizeof(float) * (size_t)(n_out * n_rows)), *one = malloc(sizeof(float) * (size_t)(n_out * 5));
            REQUIRE(w && x && x2 && xq && out && one);
            test_fill_act(n_in * n_rows, x, &s);
            bt_cpu_packed p = {0};
            int packed = bt_cpu_pack_supported(ops, t, bits);
            if (packed) REQUIRE(bt_cpu_pack(ops, pools[rand_range(&s, 0, 3)], t, bits, n_in, n_out, w, &p) == BT_OK);
            bt_cpu_matmul mm = {.ops = ops, .wtype = t, .n_in = n_in, .n_out = n_out, .n_rows = n_rows, .w = w,
                                .x = x, .xq = xq, .out = out, .act_bits = bits, .wp = packed ? &p : NULL};
            REQUIRE(bt_cpu_matmul_run(pools[rand_range(&s, 0, 3)], &mm) == BT_OK);
            int bad = 0;
            for (int64_t r = 0; r < n_rows; r++) {
                /* alone */
                bt_cpu_matmul m1 = mm;
                m1.n_rows = 1, m1.x = x + r * n_in, m1.out = one;
                if (packed) m1.then = (bt_cpu_next_hint){p.data, (n_out + BT_CPU_PACK_ROWS - 1) / BT_CPU_PACK_ROWS,
                                                         p.group_bytes};
                REQUIRE(bt_cpu_matmul_run(pools[rand_range(&s, 0, 3)], &m1) == BT_OK);
                for (int64_t o = 0; o < n_out; o++)
                    if (bt_f32_bits(one[o]) != bt_f32_bits(out[r * n_out + o])) bad++;
                /* at a random position among 4 rows of other content */
                int pos = (int)rand_range(&s, 0, 4);
                test_fill_act(n_in * 5, x2, &s);
                memcpy(x2 + pos * n_in, x + r * n_in, sizeof(float) * (size_t)n_in);
                bt_cpu_matmul m5 = mm;
                m5.n_rows = 5, m5.x = x2, m5.out = one;
                m5.then = (bt_cpu_next_hint){w, 3, 4096};
                REQUIRE(bt_cpu_matmul_run(pools[rand_range(&s, 0, 3)], &m5) == BT_OK);
                for (int64_t o = 0; o < n_out; o++)
                    if (bt_f32_bits(one[pos * n_out + o]) != bt_f32_bits(out[r * n_out + o])) bad++;
            }
            CHECK_MSG(bad == 0, "%s %s/%d%s n_in=%lld n_out=%lld n_rows=%lld: %d outputs depend on the batch",
                      ops->name, bt_ggml_type_name(t), bits, packed ? " packed" : "", (long long)n_in,
                      (long long)n_out, (long long)n_rows, bad);
            bt_cpu_packed_free(&p);
            free(w), free(x), free(x2), free(xq), free(out), free(one);
        }
    }
    for (int i = 0; i < 4; i++) bt_pool_destroy(pools[i]);
}

/* An ISA whose packing of type t (16 rows of n_in, 16-bit activations) differs from the portable one: *mine is the
 * ISA's, *portable the one bt_cpu_pack makes without ops; the ISA's matmul refuses the portable packing and runs its
 * own. The caller frees both. */
static void check_own_packing(const bt_cpu_ops *ops, uint32_t t, int64_t n_in, uint64_t *s, bt_cpu_packed *portable,
                              bt_cpu_packed *mine)
{
    uint8_t *w = make_weights(t, n_in, 16, s);
    float x[256], o[16];
    uint8_t xq[1024];
    REQUIRE(w && n_in <= 256 && bt_cpu_act_row_bytes(t, 16, n_in) <= sizeof xq);
    test_fill_act(n_in, x, s);
    REQUIRE(bt_cpu_pack(NULL, NULL, t, 16, n_in, 16, w, portable) == BT_OK);
    REQUIRE(bt_cpu_pack(ops, NULL, t, 16, n_in, 16, w, mine) == BT_OK);
    bt_cpu_matmul mm = {.ops = ops, .wtype = t, .n_in = n_in, .n_out = 16, .n_rows = 1, .w = w, .x = x, .xq = xq,
                        .out = o, .act_bits = 16, .wp = portable};
    CHECK(bt_cpu_matmul_run(NULL, &mm) == BT_ERR_INVALID);
    mm.wp = mine;
    CHECK(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
    free(w);
}

/* Packed weights must match the matmul they serve; unsupported types are refused. */
static void test_pack_checks(void)
{
    uint64_t s = 57;
    const bt_cpu_ops *best = NULL; /* a covered ISA with packed kernels (AVX2 or AVX-512) */
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++)
        if (bt_cpu_pack_supported(bt_cpu_ops_get((bt_cpu_isa)isa), BT_TYPE_Q4_1, 16) && test_isa_covers((bt_cpu_isa)isa))
            best = bt_cpu_ops_get((bt_cpu_isa)isa);
    CHECK(!bt_cpu_pack_supported(bt_cpu_ops_get(BT_CPU_ISA_SCALAR), BT_TYPE_Q4_1, 16));
    bt_cpu_packed p;
    CHECK(bt_cpu_pack(NULL, NULL, BT_TYPE_F16, 16, 256, 16, "", &p) == BT_ERR_UNSUPPORTED); /* no packed layout */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_K, 16, 128, 16) == 0); /* Q4_K rows come in 256-element super-blocks */
    CHECK(bt_cpu_pack(NULL, NULL, BT_TYPE_Q4_K, 8, 128, 16, "", &p) == BT_ERR_INVALID);
    /* every ISA with packed kernels packs the K-quants at both precisions, in super-units of the same size */
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        const bt_cpu_ops *o = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!o || !bt_cpu_pack_supported(o, BT_TYPE_Q4_1, 16)) continue;
        CHECK_MSG(bt_cpu_pack_supported(o, BT_TYPE_Q4_K, 8) && bt_cpu_pack_supported(o, BT_TYPE_Q5_K, 8) &&
                      bt_cpu_pack_supported(o, BT_TYPE_Q6_K, 8), "%s lacks an 8-bit K-quant kernel", o->name);
    }
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_K, 8, 512, 16) == bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_K, 16, 512, 16));
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q6_K, 8, 256, 16) == 128 + 4 * (64 + 2 * 512));
    /* K-quants: a super-unit per 256 elements: fp32 A and B of 16 rows, then 4 pairs of 64 scale bytes + 2 blocks */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_K, 16, 512, 20) == 2 * 2 * (128 + 4 * (64 + 2 * 512))); /* 2 groups */
    /* AVX-512 packs Q5_K at 16 bits with a high-bit plane (320 code bytes per block, 1.05x the GGUF rows), its kernel
     * refuses the byte layout, and the other ISAs keep the bytes */
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) { /* the tables of this build's ISAs, run or not */
        const bt_cpu_ops *o = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!o) continue;
        CHECK(o->gemm16_planes == (isa == BT_CPU_ISA_AVX512 ? 1u << BT_TYPE_Q5_K : 0u));
        CHECK(bt_cpu_pack_bytes(o, BT_TYPE_Q5_K, 8, 512, 20) == bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_K, 8, 512, 20));
    }
    const bt_cpu_ops *avx512 = bt_cpu_ops_get(BT_CPU_ISA_AVX512);
    if (avx512) {
        CHECK(bt_cpu_pack_bytes(avx512, BT_TYPE_Q5_K, 16, 512, 20) == 2 * 2 * (128 + 4 * (64 + 2 * 320)));
        CHECK(bt_cpu_pack_bytes(avx512, BT_TYPE_Q5_K, 16, 512, 16) * 100 < 105 * 16 * bt_cpu_row_bytes(BT_TYPE_Q5_K, 512));
    }
    if (avx512 && test_isa_covers(BT_CPU_ISA_AVX512)) {
        bt_cpu_packed pb = {0}, pp = {0};
        check_own_packing(avx512, BT_TYPE_Q5_K, 256, &s, &pb, &pp);
        CHECK(!pb.planes && pp.planes && pp.group_bytes < pb.group_bytes);
        bt_cpu_packed_free(&pb);
        bt_cpu_packed_free(&pp);
    }
    /* AVX2 (and AVX-VNNI, the same kernels) lay the Q5_0 / Q5_1 high-bit planes out in nibble-vector order, in the
     * same bytes; bt_cpu_matmul_check refuses the word order the other ISAs read for their ops */
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        const bt_cpu_ops *o = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!o) continue;
        const int nib = isa == BT_CPU_ISA_AVX2 || isa == BT_CPU_ISA_AVX2_VNNI;
        CHECK(o->plane_nibbles == nib);
        CHECK(bt_cpu_pack_plane_nibbles(o, BT_TYPE_Q5_0, 16) == nib && bt_cpu_pack_plane_nibbles(o, BT_TYPE_Q5_1, 0) == nib);
        CHECK(!bt_cpu_pack_plane_nibbles(o, BT_TYPE_Q5_0, 8) && !bt_cpu_pack_plane_nibbles(o, BT_TYPE_Q4_1, 16));
        CHECK(bt_cpu_pack_bytes(o, BT_TYPE_Q5_0, 16, 640, 32) == bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 16, 640, 32));
    }
    const bt_cpu_ops *avx2 = bt_cpu_ops_get(BT_CPU_ISA_AVX2);
    if (avx2 && test_isa_covers(BT_CPU_ISA_AVX2)) {
        bt_cpu_packed pw = {0}, pn = {0};
        check_own_packing(avx2, BT_TYPE_Q5_0, 64, &s, &pw, &pn);
        CHECK(!pw.plane_nib && pn.plane_nib && pw.group_bytes == pn.group_bytes);
        bt_cpu_packed_free(&pw);
        bt_cpu_packed_free(&pn);
    }
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q6_K, 16, 128, 16) == 0);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q6_K, 16, 256, 16) == 128 + 4 * (64 + 2 * 512));
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_K, 16, 512, 16) == 2 * (128 + 4 * (64 + 2 * 256))); /* 1.06x the GGUF rows */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_1, 16, 48, 16) == 0);
    /* Q5_0 and Q5_1 at 16 bits: nibbles and a 64-byte high-bit plane per block, the GGUF blocks' size (352 and 384
     * bytes per 16 rows x 32 elements); at 8 bits bytes as the Q8_0 layout (544) and Q5_1's (576) */
    CHECK(bt_cpu_pack_layout(BT_TYPE_Q5_0, 16) == BT_TYPE_Q5_0 && bt_cpu_pack_layout(BT_TYPE_Q5_0, 0) == BT_TYPE_Q5_0);
    CHECK(bt_cpu_pack_layout(BT_TYPE_Q5_0, 8) == BT_TYPE_Q8_0 && bt_cpu_pack_layout(BT_TYPE_Q5_1, 8) == BT_TYPE_Q5_1);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 16, 64, 16) == 64 + 2 * 320 && 2 * 352 == 64 + 2 * 320);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 16, 96, 16) == 2 * (64 + 2 * 320)); /* an odd last block: a whole unit */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 16, 640, 32) == 2 * 20 * 352);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 16, 640, 32) == 32 * bt_cpu_row_bytes(BT_TYPE_Q5_0, 640)); /* 1.00x */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_1, 16, 576, 16) == 18 * 384);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_1, 16, 576, 16) == 16 * bt_cpu_row_bytes(BT_TYPE_Q5_1, 576)); /* 1.00x */
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_0, 8, 64, 16) == 64 + 2 * 512);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q5_1, 8, 576, 16) == 18 * 576);
    if (!best) return; /* the packing ISA's own entry runs the rest, or reports its skip */
    uint8_t *w = make_weights(BT_TYPE_Q4_1, 64, 20, &s);
    REQUIRE(w);
    float x[2 * 64] = {0}, out[2 * 20];
    uint8_t xq[2 * 256];
    REQUIRE(bt_cpu_pack(NULL, NULL, BT_TYPE_Q4_1, 16, 64, 20, w, &p) == BT_OK);
    CHECK(bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_1, 16, 64, 20) == 2 * p.group_bytes);
    bt_cpu_matmul mm = {.ops = best, .wtype = BT_TYPE_Q4_1, .n_in = 64, .n_out = 20, .n_rows = 2, .w = w, .x = x,
                        .xq = xq, .out = out, .act_bits = 16, .wp = &p};
    CHECK(bt_cpu_matmul_check(&mm) == BT_OK);
    mm.act_bits = 8; /* layout made for 16-bit activations */
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.act_bits = 0; /* 0 means 16 */
    CHECK(bt_cpu_matmul_check(&mm) == BT_OK);
    mm.n_out = 19;
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.n_out = 20, mm.ops = bt_cpu_ops_get(BT_CPU_ISA_SCALAR); /* no kernel to run it */
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    /* packing into the caller's memory gives the same bytes and leaves the memory to the caller */
    size_t bytes = bt_cpu_pack_bytes(NULL, BT_TYPE_Q4_1, 16, 64, 20);
    uint8_t *mem = aligned_alloc(64, bytes + 64);
    REQUIRE(mem);
    memset(mem, 0xcd, bytes + 64);
    bt_cpu_packed q;
    CHECK(bt_cpu_pack_into(NULL, NULL, BT_TYPE_Q4_1, 16, 64, 20, w, mem + 8, &q) == BT_ERR_INVALID); /* misaligned */
    CHECK(bt_cpu_pack_into(NULL, NULL, BT_TYPE_Q4_1, 16, 64, 20, w, NULL, &q) == BT_ERR_INVALID);
    CHECK(bt_cpu_pack_into(NULL, NULL, BT_TYPE_F16, 16, 256, 16, "", mem, &q) == BT_ERR_UNSUPPORTED);
    REQUIRE(bt_cpu_pack_into(NULL, NULL, BT_TYPE_Q4_1, 16, 64, 20, w, mem, &q) == BT_OK);
    CHECK(q.data == mem && !q.owns_data && p.owns_data);
    CHECK(q.group_bytes == p.group_bytes && !memcmp(mem, p.data, bytes));
    CHECK(mem[bytes] == 0xcd); /* nothing written past the packed size */
    bt_cpu_packed_free(&q); /* clears q; mem stays valid (ASan: no double free below) */
    CHECK(q.data == NULL);
    free(mem);
    bt_cpu_packed_free(&p);
    CHECK(p.data == NULL);
    bt_cpu_packed_free(&p);
    free(w);
}

/* The dot-instruction rate behind the compute roofline: positive wherever the ISA runs (any such CPU does well over
 * 1e9 multiply-accumulates a second; the aarch64 tests run under qemu-user here, at ~0.5-2e9, so 1e7 there), 8-bit
 * above the 16-bit rate where vpdpbusd serves it (AVX-512, AVX-VNNI) or vpmaddubsw (AVX2: 32 MACs against vpmaddwd's 16),
 * 0 for scalar code. */
static void test_dot_rate(void)
{
    CHECK(bt_cpu_dot_macs_rate(BT_CPU_ISA_SCALAR, 16) == 0);
    for (int isa = BT_CPU_ISA_AVX2; isa < BT_CPU_ISA_COUNT; isa++) {
        double r16 = bt_cpu_dot_macs_rate((bt_cpu_isa)isa, 16), r8 = bt_cpu_dot_macs_rate((bt_cpu_isa)isa, 8);
        if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) {
            CHECK(r16 == 0 && r8 == 0);
            continue;
        }
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const double floor = isa >= BT_CPU_ISA_NEON ? 1e7 : 1e9;
        CHECK_MSG(r16 > floor && r8 > floor, "%s: %g %g MAC/s", bt_cpu_isa_name((bt_cpu_isa)isa), r16, r8);
        if (isa == BT_CPU_ISA_AVX512 || isa == BT_CPU_ISA_AVX2_VNNI || isa == BT_CPU_ISA_AVX2)
            CHECK_MSG(r8 > 1.2 * r16, "%s: 8-bit %g vs 16-bit %g MAC/s", bt_cpu_isa_name((bt_cpu_isa)isa), r8, r16);
        /* every thread of a pool at once (3 threads: more than a 2-CPU host has, where they still line up or
         * time out, and finish), and no pool is one thread */
        bt_pool *pool;
        REQUIRE(bt_pool_create(3, &pool) == BT_OK);
        double all = bt_cpu_dot_macs_rate_all(pool, (bt_cpu_isa)isa, 16);
        CHECK_MSG(all > floor, "%s: %g MAC/s on 3 threads", bt_cpu_isa_name((bt_cpu_isa)isa), all);
        CHECK(bt_cpu_dot_macs_rate_all(NULL, (bt_cpu_isa)isa, 8) > floor);
        bt_pool_destroy(pool);
    }
    bt_pool *pool;
    REQUIRE(bt_pool_create(2, &pool) == BT_OK);
    CHECK(bt_cpu_dot_macs_rate_all(pool, BT_CPU_ISA_SCALAR, 16) == 0);
    bt_pool_destroy(pool);
}

/* The CPU vendor as /proc/cpuinfo names it (the kernel's own CPUID read), and the engine's tile rows: between 1
 * and what the kernels take, fewer only where the ISA asks for it on this vendor. */
static void test_gemm_tile(void)
{
#if defined(__x86_64__) || defined(__i386__)
    FILE *f = fopen("/proc/cpuinfo", "r"); /* x86 only: under qemu-user an aarch64 build would read the host's */
    int amd = -1;
    if (f) {
        char line[512];
        while (amd < 0 && fgets(line, sizeof line, f))
            if (!strncmp(line, "vendor_id", 9)) amd = strstr(line, "AuthenticAMD") != NULL;
        fclose(f);
    }
    if (amd >= 0)
        CHECK_MSG(bt_cpu_vendor_amd() == amd, "CPUID vendor AMD %d, /proc/cpuinfo %d", bt_cpu_vendor_amd(), amd);
    else
        fprintf(stderr, "  test_gemm_tile: no vendor_id in /proc/cpuinfo, the vendor read not checked\n");
#else
    CHECK(bt_cpu_vendor_amd() == 0);
#endif
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!ops) continue;
        int nr = bt_cpu_gemm_nr(ops), tile = bt_cpu_gemm_tile(ops);
        /* on every vendor, so that a wrong AMD tile fails on Intel hosts too */
        CHECK_MSG(ops->gemm_tile_amd >= 0 && ops->gemm_tile_amd <= nr && nr <= BT_CPU_GEMM_NR_MAX,
                  "%s: AMD tile %d, nr %d", bt_cpu_isa_name((bt_cpu_isa)isa), ops->gemm_tile_amd, nr);
        CHECK_MSG(tile >= 1 && tile <= nr, "%s: tile %d, nr %d", bt_cpu_isa_name((bt_cpu_isa)isa), tile, nr);
    }
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_pack_checks);
    RUN(test_gemm_matches_refs);
    RUN(test_nibble_extremes);
    RUN(test_gemm_each_width);
    RUN(test_q5_0_plane_matches_q8_0);
    RUN(test_q8_0_extremes);
    RUN(test_gemm_batch_invariance);
    RUN(test_dot_rate);
    RUN(test_gemm_tile);
    test_isa_report();
    return test_summary();
}
