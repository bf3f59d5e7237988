/* The attention inner loops of the op tables (attn_scores, attn_accum, attn_block) and the exp-based elementwise
 * ops: every ISA bit-identical to the scalar reference, so attention results do not depend on the ISA or on how
 * queries are grouped into work items; the reference itself checked against float64 math. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"
#include "test_isa.h"

static void test_attn_ops_match_scalar(void)
{
    uint64_t s = 61;
    const bt_cpu_ops *ref = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int rep = 0; rep < 40; rep++) {
            int64_t n = 8 * (1 + (int64_t)(test_rand_next(&s) % 32)), nk = 1 + (int64_t)(test_rand_next(&s) % 20);
            size_t stride = (size_t)n + 8 * (test_rand_next(&s) % 3);
            float *q = malloc(sizeof(float) * (size_t)n), *k = malloc(sizeof(float) * stride * (size_t)nk);
            float *a = malloc(sizeof(float) * (size_t)nk), *b = malloc(sizeof(float) * (size_t)nk);
            float *acc_a = malloc(sizeof(float) * (size_t)n), *acc_b = malloc(sizeof(float) * (size_t)n);
            REQUIRE(q && k && a && b && acc_a && acc_b);
            test_fill_act(n, q, &s);
            test_fill_act((int64_t)stride * nk, k, &s);
            test_fill_act(n, acc_a, &s);
            memcpy(acc_b, acc_a, sizeof(float) * (size_t)n);
            ref->attn_scores(n, q, k, stride, nk, 0.125f, a);
            ops->attn_scores(n, q, k, stride, nk, 0.125f, b);
            int bad = 0;
            for (int64_t j = 0; j < nk; j++) bad += bt_f32_bits(a[j]) != bt_f32_bits(b[j]);
            ref->attn_accum(n, a, k, stride, nk, acc_a);
            ops->attn_accum(n, a, k, stride, nk, acc_b);
            for (int64_t i = 0; i < n; i++) bad += bt_f32_bits(acc_a[i]) != bt_f32_bits(acc_b[i]);
            CHECK_MSG(bad == 0, "%s n=%lld nk=%lld: %d values differ from scalar", ops->name, (long long)n,
                      (long long)nk, bad);
            free(q), free(k), free(a), free(b), free(acc_a), free(acc_b);
        }
    }
}

static double ulp_diff(float a, double ref)
{
    float r = (float)ref;
    double ulp = ldexp(1.0, (r == 0 ? -149 : ilogbf(r) - 23) < -149 ? -149 : ilogbf(r) - 23);
    return fabs((double)a - ref) / ulp;
}

/* bt_cpu_expf within 2 ulp of exp over its finite range, its edges as documented; swiglu of every ISA equals the
 * scalar reference bit for bit, including edge values. */
static void test_expf_and_swiglu(void)
{
    double worst = 0;
    for (float x = -86.5f; x <= 88.0f; x += 0.001373f) {
        double u = ulp_diff(bt_cpu_expf(x), exp((double)x));
        if (u > worst) worst = u;
    }
    fprintf(stderr, "  bt_cpu_expf: worst %.2f ulp\n", worst);
    CHECK(worst <= 2.0);
    CHECK(bt_cpu_expf(0.0f) == 1.0f);
    CHECK(bt_cpu_expf(-INFINITY) == 0.0f && bt_cpu_expf(-87.0f) == 0.0f);
    CHECK(isinf(bt_cpu_expf(INFINITY)) && isinf(bt_cpu_expf(88.5f)));
    CHECK(isnan(bt_cpu_expf(NAN)));

    uint64_t s = 17;
    const bt_cpu_ops *ref = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    enum { N = 1000 };
    float g[N], u[N], a[N], b[N];
    for (int i = 0; i < N; i++) {
        g[i] = test_randf(&s) * (i < 500 ? 8.0f : 120.0f);
        u[i] = test_randf(&s) * 4.0f;
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 90.0f, g[3] = -90.0f, g[4] = INFINITY, g[5] = -INFINITY, g[6] = -86.5f;
    ref->swiglu(N, g, u, a);
    for (int i = 0; i < N; i++) {
        double x = g[i], want = x / (1.0 + exp(-x)) * u[i];
        if (isfinite(g[i]))
            CHECK_MSG(fabs(a[i] - want) <= 1e-6 * fabs(want) + 1e-30, "swiglu(%g, %g) = %g, want %g", g[i], u[i],
                      a[i], want);
    }
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int n = 1; n <= N; n += 97) {
            ops->swiglu(n, g, u, b);
            int bad = 0;
            for (int i = 0; i < n; i++) bad += bt_f32_bits(a[i]) != bt_f32_bits(b[i]);
            CHECK_MSG(bad == 0, "%s swiglu n=%d: %d values differ from scalar", ops->name, n, bad);
        }
        memcpy(b, g, sizeof b);
        ops->swiglu(N, b, u, b); /* in place */
        CHECK(memcmp(a, b, sizeof b) == 0);
    }
}

/* geglu (gemma3's GeGLU): the scalar reference against float64 gelu_tanh(g) * u, computed as g / (1 + exp(-2y)) * u,
 * y = sqrt(2/pi) (g + 0.044715 g^3) (equal to 0.5 g (1 + tanh(y)) * u, without its cancellation for g < 0), over the
 * range activations take and far beyond it (|g| up to 120: the tails, where gelu is g or -0): within 2e-6 of the
 * value plus 1e-7 of |g u| (in the negative tail gelu falls below 1e-7 of g, and exp's argument carries float
 * rounding of a few ulp of |z| ~ 20-60; measured max 5.1e-7 relative where gelu >= 1e-3 |g|); every ISA bit for
 * bit equal to the scalar reference, in place too. */
static void test_geglu(void)
{
    uint64_t s = 23;
    const bt_cpu_ops *ref = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    enum { N = 1000 };
    float g[N], u[N], a[N], b[N];
    for (int i = 0; i < N; i++) {
        g[i] = test_randf(&s) * (i < 700 ? 6.0f : 120.0f);
        u[i] = test_randf(&s) * 4.0f;
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 90.0f, g[3] = -90.0f, g[4] = 1e-30f, g[5] = -5.5f, g[6] = 3e12f, g[7] = -3e12f;
    ref->geglu(N, g, u, a);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        double x = g[i], y = sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x), want = x / (1.0 + exp(-2.0 * y)) * u[i];
        double err = fabs(a[i] - want);
        if (fabs(want) >= 1e-3 * fabs(x * u[i]) && err > worst * fabs(want)) worst = err / fabs(want);
        CHECK_MSG(err <= 2e-6 * fabs(want) + 1e-7 * fabs(x * u[i]) + 1e-30, "geglu(%g, %g) = %.9g, want %.9g", g[i],
                  u[i], a[i], want);
    }
    fprintf(stderr, "  geglu: worst relative error %.2e against float64 where gelu(g) >= 1e-3 |g|\n", worst);
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int n = 1; n <= N; n += 97) {
            ops->geglu(n, g, u, b);
            int bad = 0;
            for (int i = 0; i < n; i++) bad += bt_f32_bits(a[i]) != bt_f32_bits(b[i]);
            CHECK_MSG(bad == 0, "%s geglu n=%d: %d values differ from scalar", ops->name, n, bad);
        }
        memcpy(b, g, sizeof b);
        ops->geglu(N, b, u, b); /* in place */
        CHECK(memcmp(a, b, sizeof b) == 0);
    }
}

/* A random KV block of nk rows of n elements in type t, and the float values it stands for. */
typedef struct kv_case {
    bt_cpu_kv_rows rows;
    void *k, *v;
    uint16_t ksm[2 * BT_CPU_ATTN_BLOCK], vsm[2 * BT_CPU_ATTN_BLOCK]; /* U8: fp16 (scale, min) per row */
    double kf[BT_CPU_ATTN_BLOCK * 256], vf[BT_CPU_ATTN_BLOCK * 256];
} kv_case;

static void kv_case_fill(kv_case *c, bt_cpu_kv_type t, int64_t n, uint64_t *s)
{
    size_t ne = BT_CPU_ATTN_BLOCK * (size_t)n, es = t == BT_CPU_KV_F32 ? 4 : t == BT_CPU_KV_F16 ? 2 : 1;
    c->k = malloc(ne * es);
    c->v = malloc(ne * es);
    REQUIRE(c->k && c->v);
    for (int w = 0; w < 2; w++) {
        void *d = w ? c->v : c->k;
        uint16_t *sm = w ? c->vsm : c->ksm;
        double *f = w ? c->vf : c->kf;
        for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) { /* subnormal, small and (for V) large scales */
            sm[2 * j] = bt_f32_to_fp16(j == 5 ? 3e-6f : 0.004f + 0.011f * (float)(j % 4) + (w && j == 9 ? 1.5f : 0.0f));
            sm[2 * j + 1] = bt_f32_to_fp16(-2.5f + 0.1f * (float)j);
        }
        for (size_t e = 0; e < ne; e++) {
            float x = test_randf(s) * 3.0f;
            size_t j = e / (size_t)n;
            if (t == BT_CPU_KV_F32) {
                ((float *)d)[e] = x;
                f[e] = x;
            } else if (t == BT_CPU_KV_F16) {
                ((uint16_t *)d)[e] = bt_f32_to_fp16(x);
                f[e] = bt_fp16_to_f32(((uint16_t *)d)[e]);
            } else {
                uint8_t code = (uint8_t)test_rand_next(s);
                ((uint8_t *)d)[e] = code;
                /* the dequantization attn_block defines, rounded as it is */
                f[e] = fmaf(bt_fp16_to_f32(sm[2 * j]), (float)code, bt_fp16_to_f32(sm[2 * j + 1]));
            }
        }
    }
    c->rows = (bt_cpu_kv_rows){.type = t, .k = c->k, .v = c->v, .k_sm = c->ksm, .v_sm = c->vsm};
}

/* attn_block of every ISA is bit-identical to the scalar reference, over several blocks in a row, for every KV
 * dtype, head size, query count and block fill, with and without prefetch hints; the reference agrees with float64
 * softmax attention. Every fourth
 * case repeats block 0, so later blocks leave the running max as it is (the no-rescale path of the SIMD kernels). */
static void test_attn_block(void)
{
    uint64_t s = 99;
    /* 48, 80, 96: head sizes whose V pass runs 32-element steps and then a 16-element one (AVX2, 1-3 heads) */
    const int64_t ns[] = {8, 16, 24, 48, 64, 72, 80, 96, 128, 256};
    enum { N_NS = sizeof ns / sizeof ns[0] };
    double worst = 0;
    for (int rep = 0; rep < 3 * N_NS * 3; rep++) {
        bt_cpu_kv_type t = (bt_cpu_kv_type)(rep % 3);
        int64_t n = ns[(rep / 3) % N_NS];
        int nq = 1 + (int)(test_rand_next(&s) % 16), nblk = 1 + (int)(test_rand_next(&s) % 4);
        int nk_last = 1 + (int)(test_rand_next(&s) % BT_CPU_ATTN_BLOCK);
        kv_case *kc = malloc(sizeof(kv_case) * (size_t)nblk);
        float *q = malloc(sizeof(float) * (size_t)(nq * n));
        float *acc[BT_CPU_ISA_COUNT];
        float m[BT_CPU_ISA_COUNT][16], l[BT_CPU_ISA_COUNT][16];
        REQUIRE(kc && q);
        test_fill_act(nq * n, q, &s);
        for (int b = 0; b < nblk; b++) kv_case_fill(&kc[b], t, n, &s);
        if (rep % 2) /* prefetch hints (the next block's rows, or block 0's): they must not change a bit */
            for (int b = 0; b < nblk; b++) {
                const kv_case *nx = &kc[(b + 1) % nblk];
                kc[b].rows.pf_k = nx->k, kc[b].rows.pf_v = nx->v;
                kc[b].rows.pf_bytes = BT_CPU_ATTN_BLOCK * (size_t)n * (t == BT_CPU_KV_F32 ? 4 : t == BT_CPU_KV_F16 ? 2 : 1);
            }
        int rep0 = rep % 4 == 3; /* every block is block 0 */
        for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
            acc[isa] = calloc((size_t)(nq * n), sizeof(float));
            REQUIRE(acc[isa]);
            for (int h = 0; h < nq; h++) m[isa][h] = -INFINITY, l[isa][h] = 0;
            if (isa != 0 && !test_isa_covers((bt_cpu_isa)isa)) continue; /* scalar: the reference, always */
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            for (int b = 0; b < nblk; b++)
                ops->attn_block(n, nq, q, 0.125f, &kc[rep0 ? 0 : b].rows, b == nblk - 1 ? nk_last : BT_CPU_ATTN_BLOCK,
                                m[isa], l[isa], acc[isa]);
            if (isa == 0) continue;
            int bad = 0;
            for (int h = 0; h < nq; h++)
                bad += bt_f32_bits(m[0][h]) != bt_f32_bits(m[isa][h]) || bt_f32_bits(l[0][h]) != bt_f32_bits(l[isa][h]);
            for (int64_t i = 0; i < nq * n; i++) bad += bt_f32_bits(acc[0][i]) != bt_f32_bits(acc[isa][i]);
            CHECK_MSG(bad == 0, "%s attn_block type %d n=%lld nq=%d blocks=%d last=%d: %d values differ from scalar",
                      ops->name, (int)t, (long long)n, nq, nblk, nk_last, bad);
        }
        for (int h = 0; h < nq; h++) { /* float64 softmax attention over the same dequantized K/V */
            int nkeys = (nblk - 1) * BT_CPU_ATTN_BLOCK + nk_last;
            double *sc = malloc(sizeof(double) * (size_t)nkeys), mx = -INFINITY, sum = 0;
            REQUIRE(sc);
            for (int key = 0; key < nkeys; key++) {
                const kv_case *c = &kc[rep0 ? 0 : key / BT_CPU_ATTN_BLOCK];
                int j = key % BT_CPU_ATTN_BLOCK;
                double d = 0;
                for (int64_t i = 0; i < n; i++) d += (double)q[h * n + i] * c->kf[j * n + i];
                sc[key] = d * 0.125;
                if (sc[key] > mx) mx = sc[key];
            }
            for (int key = 0; key < nkeys; key++) sum += sc[key] = exp(sc[key] - mx);
            for (int64_t i = 0; i < n; i++) {
                double o = 0, mag = 0;
                for (int key = 0; key < nkeys; key++) {
                    double v = kc[rep0 ? 0 : key / BT_CPU_ATTN_BLOCK].vf[(key % BT_CPU_ATTN_BLOCK) * n + i];
                    o += sc[key] * v / sum;
                    mag += sc[key] * fabs(v) / sum;
                }
                double got = (double)acc[0][h * n + i] / l[0][h], e = fabs(got - o) / (mag + 1e-30);
                if (e > worst) worst = e;
            }
            free(sc);
        }
        for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) free(acc[isa]);
        for (int b = 0; b < nblk; b++) free(kc[b].k), free(kc[b].v);
        free(kc), free(q);
    }
    fprintf(stderr, "  attn_block vs float64: worst error %.2e of sum |w v|\n", worst);
    CHECK(worst < 5e-5); /* float32 scores of up to ~160 in magnitude: ~1e-5 */
}

/* Scores that are all zeros of both signs: the running max keeps the first zero of m and the block's scores, in key
 * order, as the reference does (+0 and -0 compare equal, so a max that picks either passes every output test but the
 * stored m). q is -0, so a key of +1s scores -0 and one of -1s +0; two runs of two blocks: -0 then +0 by key, then
 * all +0 (m stays -0), and +0 then -0, then all -0 (m stays +0). */
static void test_attn_block_zero_scores(void)
{
    enum { N = 64, NQ = 3 };
    static float k[4][BT_CPU_ATTN_BLOCK * N], v[BT_CPU_ATTN_BLOCK * N], q[NQ * N];
    uint64_t s = 5;
    for (int i = 0; i < NQ * N; i++) q[i] = -0.0f;
    for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++)
        for (int i = 0; i < N; i++) {
            k[0][j * N + i] = j & 1 ? -1.0f : 1.0f; /* -0, +0, -0, ... */
            k[1][j * N + i] = -1.0f;                /* all +0 */
            k[2][j * N + i] = j & 1 ? 1.0f : -1.0f; /* +0, -0, ... */
            k[3][j * N + i] = 1.0f;                 /* all -0 */
        }
    test_fill_act(BT_CPU_ATTN_BLOCK * N, v, &s);
    for (int run = 0; run < 2; run++) {
        float m[BT_CPU_ISA_COUNT][NQ], l[BT_CPU_ISA_COUNT][NQ], acc[BT_CPU_ISA_COUNT][NQ * N];
        for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
            if (isa != 0 && !test_isa_covers((bt_cpu_isa)isa)) continue;
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            for (int h = 0; h < NQ; h++) m[isa][h] = -INFINITY, l[isa][h] = 0;
            memset(acc[isa], 0, sizeof acc[isa]);
            for (int b = 0; b < 2; b++) {
                bt_cpu_kv_rows rows = {.type = BT_CPU_KV_F32, .k = k[2 * run + b], .v = v};
                ops->attn_block(N, NQ, q, 0.125f, &rows, BT_CPU_ATTN_BLOCK, m[isa], l[isa], acc[isa]);
            }
            if (isa == 0) {
                CHECK(bt_f32_bits(m[0][0]) == bt_f32_bits(run ? 0.0f : -0.0f)); /* the reference's own pick */
                continue;
            }
            int bad = 0;
            for (int h = 0; h < NQ; h++)
                bad += bt_f32_bits(m[0][h]) != bt_f32_bits(m[isa][h]) || bt_f32_bits(l[0][h]) != bt_f32_bits(l[isa][h]);
            for (int i = 0; i < NQ * N; i++) bad += bt_f32_bits(acc[0][i]) != bt_f32_bits(acc[isa][i]);
            CHECK_MSG(bad == 0, "%s attn_block, zero scores, run %d: %d values differ from scalar", ops->name, run, bad);
        }
    }
}

/* attn_block_rows of every ISA that has one equals its definition (the scalar attn_block on each row in turn) bit
 * for bit: every head size it unrolls or loops over, 1 to 16 rows (one or two row vectors, a V pass ending in a
 * partial group of 4), every block fill, several blocks in a row (the running max moving or not), rows of zeros
 * (scores of +0 and -0 ties) and a NaN row, with and without prefetch hints; the lanes past nr hold garbage that
 * must not leak into any result. */
static void test_attn_block_rows(void)
{
    uint64_t s = 123;
    const int64_t ns[] = {16, 32, 48, 64, 80, 96, 128, 192, 256};
    enum { N_NS = sizeof ns / sizeof ns[0], MAXN = 256, R = BT_CPU_ATTN_ROWS };
    static float qt[MAXN * R], k[4][BT_CPU_ATTN_BLOCK * MAXN], v[4][BT_CPU_ATTN_BLOCK * MAXN];
    static float acc[2][R * MAXN];
    int ran = 0;
    for (int rep = 0; rep < 12 * N_NS; rep++) {
        const int64_t n = ns[rep % N_NS];
        const int nr = 1 + (int)(test_rand_next(&s) % R), nblk = 1 + (int)(test_rand_next(&s) % 4);
        /* a scale that is not a power of two, so applying it anywhere but to the tree16 sum changes bits */
        const float scale = 1.0f / sqrtf((float)n + (float)(rep % 3));
        test_fill_act(MAXN * R, qt, &s);
        for (int i = 0; i < n; i++) /* row 1 all zeros: its scores tie at zero; row 2 NaN where rep says */
            qt[R * i + 1] = rep % 3 ? 0.0f : -0.0f, qt[R * i + 2] = rep % 7 == 5 ? NAN : qt[R * i + 2];
        for (int b = 0; b < nblk; b++) {
            test_fill_act(BT_CPU_ATTN_BLOCK * MAXN, k[b], &s);
            test_fill_act(BT_CPU_ATTN_BLOCK * MAXN, v[b], &s);
            if (rep % 5 == 4) /* large keys: the running max moves block to block */
                for (int i = 0; i < BT_CPU_ATTN_BLOCK * MAXN; i++) k[b][i] *= (float)(b + 1) * 4.0f;
            if (rep % 3 == 0) /* keys of one sign each (even +, odd -): against row 1's -0 they score -0 and +0 */
                for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++)
                    for (int i = 0; i < MAXN; i++)
                        k[b][j * MAXN + i] = (j & 1 ? -1.0f : 1.0f) * (fabsf(k[b][j * MAXN + i]) + 0.01f);
        }
        const int nk_last = 1 + (int)(test_rand_next(&s) % BT_CPU_ATTN_BLOCK);
        bt_cpu_kv_rows hints[4]; /* every other case: the next block's rows as prefetch hints */
        for (int b = 0; b < nblk; b++)
            hints[b] = (bt_cpu_kv_rows){.pf_k = k[(b + 1) % nblk], .pf_v = v[(b + 1) % nblk],
                                        .pf_bytes = BT_CPU_ATTN_BLOCK * (size_t)n * sizeof(float)};
        for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
            if (!test_isa_covers((bt_cpu_isa)isa)) continue;
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            if (!ops->attn_block_rows) continue;
            float m[2][R], l[2][R];
            for (int w = 0; w < 2; w++) {
                for (int r = 0; r < R; r++) m[w][r] = -INFINITY, l[w][r] = 0;
                memset(acc[w], 0, sizeof acc[w]);
                for (int b = 0; b < nblk; b++) {
                    const int nk = b == nblk - 1 ? nk_last : BT_CPU_ATTN_BLOCK;
                    if (w == 0)
                        bt_cpu_attn_block_rows_ref(n, nr, qt, scale, k[b], v[b], nk, m[0], l[0], acc[0], NULL);
                    else
                        ops->attn_block_rows(n, nr, qt, scale, k[b], v[b], nk, m[1], l[1], acc[1],
                                             rep % 2 ? &hints[b] : NULL);
                }
            }
            int bad = 0;
            for (int r = 0; r < nr; r++)
                bad += bt_f32_bits(m[0][r]) != bt_f32_bits(m[1][r]) || bt_f32_bits(l[0][r]) != bt_f32_bits(l[1][r]);
            for (int64_t i = 0; i < nr * n; i++) bad += bt_f32_bits(acc[0][i]) != bt_f32_bits(acc[1][i]);
            for (int r = nr; r < R; r++) bad += bt_f32_bits(m[1][r]) != bt_f32_bits(-INFINITY) || l[1][r] != 0;
            for (int64_t i = nr * n; i < R * n; i++) bad += acc[1][i] != 0;
            CHECK_MSG(bad == 0, "%s attn_block_rows n=%lld nr=%d blocks=%d last=%d: %d values differ from the reference",
                      ops->name, (long long)n, nr, nblk, nk_last, bad);
            ran++;
        }
    }
    /* the reference is the scalar attn_block on the row alone */
    float q[64], mr = -INFINITY, lr = 0, ar[64] = {0}, mq = -INFINITY, lq = 0, aq[64] = {0};
    for (int i = 0; i < 64; i++) q[i] = test_randf(&s);
    bt_cpu_attn_rows_put(64, 0, q, qt);
    const bt_cpu_kv_rows rows = {.type = BT_CPU_KV_F32, .k = k[0], .v = v[0]};
    bt_cpu_attn_block_rows_ref(64, 1, qt, 0.125f, k[0], v[0], 11, &mr, &lr, ar, NULL);
    bt_cpu_ops_get(BT_CPU_ISA_SCALAR)->attn_block(64, 1, q, 0.125f, &rows, 11, &mq, &lq, aq);
    CHECK(bt_f32_bits(mr) == bt_f32_bits(mq) && bt_f32_bits(lr) == bt_f32_bits(lq) && memcmp(ar, aq, sizeof ar) == 0);
    fprintf(stderr, "  attn_block_rows: %d ISA cases against the reference\n", ran);
}

/* rmsnorm of every ISA equals the scalar reference bit for bit (in place too); the reference is within float
 * rounding of the float64 formula. */
static void test_rmsnorm(void)
{
    uint64_t s = 5;
    const bt_cpu_ops *ref = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    for (int rep = 0; rep < 30; rep++) {
        int64_t n = rep < 20 ? 8 * (1 + (int64_t)(test_rand_next(&s) % 100)) : 1 + (int64_t)(test_rand_next(&s) % 300);
        float *x = malloc(sizeof(float) * (size_t)n), *w = malloc(sizeof(float) * (size_t)n);
        float *a = malloc(sizeof(float) * (size_t)n), *b = malloc(sizeof(float) * (size_t)n);
        REQUIRE(x && w && a && b);
        test_fill_act(n, x, &s);
        test_fill_act(n, w, &s);
        ref->rmsnorm(n, x, w, 1e-5f, a);
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
        double sc = 1.0 / sqrt(ss / (double)n + 1e-5f);
        for (int64_t i = 0; i < n; i++)
            CHECK(fabs(a[i] - x[i] * sc * w[i]) <= 4e-7 * fabs(x[i] * sc * w[i]) + 1e-30);
        for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
            if (!test_isa_covers((bt_cpu_isa)isa)) continue;
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            memcpy(b, x, sizeof(float) * (size_t)n);
            ops->rmsnorm(n, b, w, 1e-5f, b);
            CHECK_MSG(memcmp(a, b, sizeof(float) * (size_t)n) == 0, "%s rmsnorm n=%lld differs from scalar", ops->name,
                      (long long)n);
        }
        free(x), free(w), free(a), free(b);
    }
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_rmsnorm);
    RUN(test_attn_ops_match_scalar);
    RUN(test_expf_and_swiglu);
    RUN(test_geglu);
    RUN(test_attn_block);
    RUN(test_attn_block_zero_scores);
    RUN(test_attn_block_rows);
    test_isa_report();
    return test_summary();
}
