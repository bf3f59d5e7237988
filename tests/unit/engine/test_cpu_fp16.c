/* engine/cpu/cpu_fp16.h and the row conversions of every ISA: exact rounding, and SIMD == scalar bit for bit
 * (the F16C hardware conversion doubles as an independent oracle for the scalar fp16 rounding). */
#include <math.h>
#include <stdlib.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"
#include "test_isa.h"

static void test_fp16_known_values(void)
{
    CHECK(bt_f32_to_fp16(1.0f) == 0x3c00);
    CHECK(bt_f32_to_fp16(-2.0f) == 0xc000);
    CHECK(bt_f32_to_fp16(65504.0f) == 0x7bff);
    CHECK(bt_f32_to_fp16(65519.99f) == 0x7bff);
    CHECK(bt_f32_to_fp16(65520.0f) == 0x7c00);
    CHECK(bt_f32_to_fp16(-INFINITY) == 0xfc00);
    CHECK(bt_f32_to_fp16(0x1p-24f) == 0x0001);
    CHECK(bt_f32_to_fp16(0x1p-25f) == 0x0000);             /* tie to even: 0 */
    CHECK(bt_f32_to_fp16(0x1.8p-24f) == 0x0002);           /* 1.5 units: tie to even 2 */
    CHECK(bt_f32_to_fp16(0x1.001p-25f) == 0x0001);         /* just above half a unit */
    CHECK(bt_f32_to_fp16(0x1.ffcp-15f) == 0x0400);         /* tie between subnormal 1023 and 1024: even */
    CHECK(bt_f32_to_fp16(1.0f + 0x1p-11f) == 0x3c00);      /* tie to even */
    CHECK(bt_f32_to_fp16(1.0f + 0x1.8p-11f) == 0x3c01);      /* 0.75 ulp -> 1 ulp */
    CHECK((bt_f32_to_fp16(NAN) & 0x7e00) == 0x7e00);
    CHECK(bt_fp16_to_f32(0x0001) == 0x1p-24f);
    CHECK(bt_fp16_to_f32(0x03ff) == 0x1.ff8p-15f);
    CHECK(bt_fp16_to_f32(0xfbff) == -65504.0f);
    CHECK(isinf(bt_fp16_to_f32(0x7c00)));
    CHECK(isnan(bt_fp16_to_f32(0x7c01)));
    CHECK(bt_bf16_to_f32(0x3f80) == 1.0f);
    CHECK(bt_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);       /* tie to even */
    CHECK(bt_f32_to_bf16(1.0f + 0x1.8p-8f) == 0x3f81);
    CHECK(bt_f32_to_bf16(0x1.ff8p+127f) == 0x7f80);        /* overflow to infinity */
    CHECK((bt_f32_to_bf16(NAN) & 0x7fc0) == 0x7fc0);
}

static void test_fp16_roundtrip_all(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = bt_fp16_to_f32((uint16_t)h);
        uint16_t back = bt_f32_to_fp16(f);
        if (isnan(f)) {
            if ((back & 0x7c00) != 0x7c00 || !(back & 0x3ff)) bad++;
        } else if (back != h) {
            bad++;
        }
        uint16_t bb = bt_f32_to_bf16(bt_bf16_to_f32((uint16_t)h));
        if (!isnan(bt_bf16_to_f32((uint16_t)h)) && bb != h) bad++;
    }
    CHECK_MSG(bad == 0, "%d halves do not round-trip", bad);
}

/* Nearest-even reference through double arithmetic, for finite non-overflowing inputs. */
static void test_fp16_rounding_is_nearest(void)
{
    uint64_t s = 7;
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t bits = (uint32_t)test_rand_next(&s);
        bits = (bits & 0x80000000u) | (0x33000000u + bits % (0x47800000u - 0x33000000u)); /* 2^-25 .. 65536 */
        float f = bt_f32_from_bits(bits);
        uint16_t h = bt_f32_to_fp16(f);
        double v = fabs((double)f), got = fabs((double)bt_fp16_to_f32(h));
        if (isinf(got)) {
            if (v < 65520.0) bad++;
            continue;
        }
        double up = fabs((double)bt_fp16_to_f32((uint16_t)((h & 0x7fff) + 1)));
        double dn = (h & 0x7fff) ? fabs((double)bt_fp16_to_f32((uint16_t)((h & 0x7fff) - 1))) : -1.0;
        if (fabs(v - got) > fabs(v - up) || (dn >= 0 && fabs(v - got) > fabs(v - dn))) bad++;
    }
    CHECK_MSG(bad == 0, "%d f32->fp16 results are not nearest", bad);
}

static void test_rows_match_scalar(void)
{
    enum { N = 4099 };
    float *f = malloc(N * sizeof *f), *g = malloc(N * sizeof *g), *ref = malloc(N * sizeof *ref);
    uint16_t *h = malloc(N * sizeof *h), *h2 = malloc(N * sizeof *h2);
    REQUIRE(f && g && h && h2 && ref);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        uint64_t s = 11;
        int bad = 0;
        for (int rep = 0; rep < 40; rep++) {
            /* every fp16 pattern once per 16 reps; float patterns over the whole range */
            for (int i = 0; i < N; i++) h[i] = (uint16_t)(rep * N + i);
            ops->fp16_to_f32(N, h, g);
            bt_cpu_ops_get(BT_CPU_ISA_SCALAR)->fp16_to_f32(N, h, ref);
            ops->bf16_to_f32(N, h, f);
            for (int i = 0; i < N; i++) {
                if (bt_f32_bits(g[i]) != bt_f32_bits(ref[i])) bad++;
                if (bt_f32_bits(f[i]) != bt_f32_bits(bt_bf16_to_f32(h[i]))) bad++;
            }
            for (int i = 0; i < N; i++) {
                uint32_t b = (uint32_t)test_rand_next(&s);
                if (i % 3 == 0) b = (b & 0x8000ffffu) | (0x30000000u + (b >> 8) % 0x18000000u); /* near fp16 */
                f[i] = bt_f32_from_bits(b);
            }
            ops->f32_to_fp16(N, f, h);
            ops->f32_to_bf16(N, f, h2);
            for (int i = 0; i < N; i++) {
                if (h[i] != bt_f32_to_fp16(f[i])) {
                    if (bad < 5)
                        fprintf(stderr, "%s f32_to_fp16(%08x) = %04x, scalar %04x\n", ops->name, bt_f32_bits(f[i]),
                                h[i], bt_f32_to_fp16(f[i]));
                    bad++;
                }
                if (h2[i] != bt_f32_to_bf16(f[i])) bad++;
            }
        }
        CHECK_MSG(bad == 0, "%s: %d conversions differ from scalar", ops->name, bad);
    }
    free(f), free(g), free(ref), free(h), free(h2);
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_fp16_known_values);
    RUN(test_fp16_roundtrip_all);
    RUN(test_fp16_rounding_is_nearest);
    RUN(test_rows_match_scalar);
    test_isa_report();
    return test_summary();
}
