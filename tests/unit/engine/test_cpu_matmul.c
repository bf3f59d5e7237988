/* bt_cpu_matmul: agreement with per-element dot products, argument checks, and batch invariance (DESIGN 4.3):
 * a row's outputs are bit-identical whether it is multiplied alone or among 63 other rows, at any thread count. */
#include <stdlib.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"
#include "test_isa.h"

typedef struct mm_fixture {
    uint32_t t;
    int bits;    /* activation precision */
    int64_t n_in, n_out, n_rows;
    uint8_t *w;  /* [n_out][row bytes] */
    float *x;    /* [n_rows][n_in] */
    uint8_t *xq; /* [n_rows][act row bytes] */
    float *out;  /* [n_rows][n_out] */
} mm_fixture;

static int fixture_init(mm_fixture *f, uint32_t t, int bits, int64_t n_in, int64_t n_out, int64_t n_rows,
                        uint64_t *s)
{
    f->t = t, f->bits = bits, f->n_in = n_in, f->n_out = n_out, f->n_rows = n_rows;
    size_t wb = bt_cpu_row_bytes(t, n_in);
    f->w = malloc(wb * (size_t)n_out);
    f->x = malloc(sizeof(float) * (size_t)(n_in * n_rows));
    f->xq = malloc(bt_cpu_act_row_bytes(t, bits, n_in) * (size_t)n_rows);
    f->out = malloc(sizeof(float) * (size_t)(n_out * n_rows));
    if (!f->w || !f->x || !f->xq || !f->out) return -1;
    for (int64_t o = 0; o < n_out; o++) test_fill_row(t, n_in, f->w + wb * (size_t)o, s);
    test_fill_act(n_in * n_rows, f->x, s);
    return 0;
}

static void fixture_free(mm_fixture *f)
{
    free(f->w), free(f->x), free(f->xq), free(f->out);
}

static bt_cpu_matmul fixture_mm(const mm_fixture *f, const bt_cpu_ops *ops, int64_t row0, int64_t n_rows, float *out)
{
    bt_cpu_matmul mm = {.ops = ops, .wtype = f->t, .n_in = f->n_in, .n_out = f->n_out, .n_rows = n_rows,
                        .w = f->w, .x = f->x + row0 * f->n_in, .xq = f->xq, .out = out, .act_bits = f->bits};
    return mm;
}

static void test_matmul_matches_dots(void)
{
    uint64_t s = 41;
    bt_pool *pool = NULL;
    REQUIRE(bt_pool_create(3, &pool) == BT_OK);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (size_t kk = 0; kk < 2 * N_CPU_TEST_TYPES; kk++) { /* every type with 16-, then 8-bit activations */
            size_t k = kk % N_CPU_TEST_TYPES;
            int bits = kk < N_CPU_TEST_TYPES ? 16 : 8;
            uint32_t t = cpu_test_types[k];
            int be = bt_cpu_block_elems(t) == 1 ? 1 : bt_cpu_block_elems(t);
            mm_fixture f;
            REQUIRE(fixture_init(&f, t, bits, be == 1 ? 77 : 2 * be, 13, 7, &s) == 0);
            bt_cpu_matmul mm = fixture_mm(&f, ops, 0, f.n_rows, f.out);
            REQUIRE(bt_cpu_matmul_run(pool, &mm) == BT_OK);
            size_t ab = bt_cpu_act_row_bytes(t, bits, f.n_in), wb = bt_cpu_row_bytes(t, f.n_in);
            uint8_t *xa = malloc(ab);
            REQUIRE(xa);
            int bad = 0;
            for (int64_t r = 0; r < f.n_rows; r++) {
                bt_cpu_prepare_act_row(ops, t, bits, f.n_in, f.x + r * f.n_in, xa);
                for (int64_t o = 0; o < f.n_out; o++) {
                    float d = bt_cpu_vec_dot(ops, t, bits, f.n_in, f.w + wb * (size_t)o, xa);
                    if (bt_f32_bits(d) != bt_f32_bits(f.out[r * f.n_out + o])) bad++;
                }
            }
            CHECK_MSG(bad == 0, "%s %s/%d: %d outputs differ from vec_dot", ops->name, bt_ggml_type_name(t), bits,
                      bad);
            free(xa);
            fixture_free(&f);
        }
    }
    bt_pool_destroy(pool);
}

static void test_matmul_checks(void)
{
    const bt_cpu_ops *ops = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    float x[64] = {0}, out[4];
    uint8_t w[4096] = {0}, xq[4096];
    bt_cpu_matmul mm = {.ops = ops, .wtype = BT_TYPE_Q2_K, .n_in = 256, .n_out = 1, .n_rows = 1,
                        .w = w, .x = x, .xq = xq, .out = out};
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_UNSUPPORTED);
    mm.wtype = BT_TYPE_Q4_1, mm.n_in = 48;
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.n_in = 32, mm.xq = NULL;
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.xq = xq, mm.out_stride = 0;
    CHECK(bt_cpu_matmul_check(&mm) == BT_OK);
    mm.n_out = 2, mm.out_stride = 1;
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.n_out = 1, mm.out_stride = 0, mm.act_bits = 12;
    CHECK(bt_cpu_matmul_check(&mm) == BT_ERR_INVALID);
    mm.act_bits = 8;
    CHECK(bt_cpu_matmul_check(&mm) == BT_OK);
    mm.wtype = BT_TYPE_F32, mm.xq = NULL, mm.n_in = 3, mm.n_out = 1, mm.out_stride = 0;
    CHECK(bt_cpu_matmul_run(NULL, &mm) == BT_OK);
}

/* 64 rows multiplied together on 3 threads vs each row alone on 1 and 2 threads, plus a batch of 5 rows at
 * an odd offset with a padded output stride: every output bit-identical. */
static void test_batch_invariance(void)
{
    uint64_t s = 43;
    bt_pool *p1 = NULL, *p2 = NULL, *p3 = NULL;
    REQUIRE(bt_pool_create(1, &p1) == BT_OK && bt_pool_create(2, &p2) == BT_OK && bt_pool_create(3, &p3) == BT_OK);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (size_t kk = 0; kk < 2 * N_CPU_TEST_TYPES; kk++) { /* every type with 16-, then 8-bit activations */
            size_t k = kk % N_CPU_TEST_TYPES;
            int bits = kk < N_CPU_TEST_TYPES ? 16 : 8;
            uint32_t t = cpu_test_types[k];
            int be = bt_cpu_block_elems(t);
            int64_t n_in = be == 1 ? 200 : (be == 32 ? 192 : 512);
            int64_t n_rows = isa == 0 ? 16 : 64; /* the scalar path is slow under sanitizers */
            mm_fixture f;
            REQUIRE(fixture_init(&f, t, bits, n_in, 37, n_rows, &s) == 0);
            bt_cpu_matmul mm = fixture_mm(&f, ops, 0, n_rows, f.out);
            REQUIRE(bt_cpu_matmul_run(p3, &mm) == BT_OK);
            float one[37], padded[5 * 40];
            uint8_t *xq1 = malloc(bt_cpu_act_row_bytes(t, bits, n_in) * 5);
            REQUIRE(xq1);
            int bad = 0;
            for (int64_t r = 0; r < n_rows; r++) {
                bt_cpu_matmul m1 = fixture_mm(&f, ops, r, 1, one);
                m1.xq = xq1;
                REQUIRE(bt_cpu_matmul_run(r % 2 ? p1 : p2, &m1) == BT_OK);
                for (int o = 0; o < 37; o++)
                    if (bt_f32_bits(one[o]) != bt_f32_bits(f.out[r * 37 + o])) bad++;
            }
            bt_cpu_matmul m5 = fixture_mm(&f, ops, 3, 5, padded);
            m5.xq = xq1, m5.out_stride = 40;
            REQUIRE(bt_cpu_matmul_run(p2, &m5) == BT_OK);
            for (int r = 0; r < 5; r++)
                for (int o = 0; o < 37; o++)
                    if (bt_f32_bits(padded[r * 40 + o]) != bt_f32_bits(f.out[(r + 3) * 37 + o])) bad++;
            CHECK_MSG(bad == 0, "%s %s/%d: %d outputs depend on the batch", ops->name, bt_ggml_type_name(t), bits,
                      bad);
            free(xq1);
            fixture_free(&f);
        }
    }
    bt_pool_destroy(p1), bt_pool_destroy(p2), bt_pool_destroy(p3);
}

/* q/k/v-style: three weight matrices on the same activations in one run == three separate runs, bit for bit. */
static void test_matmul_multi(void)
{
    uint64_t s = 47;
    bt_pool *pool = NULL;
    REQUIRE(bt_pool_create(2, &pool) == BT_OK);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (size_t kk = 0; kk < 2 * N_CPU_TEST_TYPES; kk++) { /* every type with 16-, then 8-bit activations */
            size_t k = kk % N_CPU_TEST_TYPES;
            int bits = kk < N_CPU_TEST_TYPES ? 16 : 8;
            uint32_t t = cpu_test_types[k];
            int64_t n_in = bt_cpu_block_elems(t) == 256 ? 512 : 256, n_rows = 9;
            static const int64_t n_outs[3] = {64, 16, 33};
            mm_fixture f[3];
            for (int m = 0; m < 3; m++) REQUIRE(fixture_init(&f[m], t, bits, n_in, n_outs[m], n_rows, &s) == 0);
            bt_cpu_matmul mms[3];
            float *sep[3];
            for (int m = 0; m < 3; m++) {
                mms[m] = fixture_mm(&f[m], ops, 0, n_rows, f[m].out);
                mms[m].x = f[0].x, mms[m].xq = f[0].xq;
                sep[m] = malloc(sizeof(float) * (size_t)(n_rows * n_outs[m]));
                REQUIRE(sep[m]);
                bt_cpu_matmul one = mms[m];
                one.out = sep[m];
                REQUIRE(bt_cpu_matmul_run(pool, &one) == BT_OK);
            }
            REQUIRE(bt_cpu_matmul_run_multi(pool, mms, 3) == BT_OK);
            int bad = 0;
            for (int m = 0; m < 3; m++)
                for (int64_t i = 0; i < n_rows * n_outs[m]; i++)
                    if (bt_f32_bits(sep[m][i]) != bt_f32_bits(f[m].out[i])) bad++;
            CHECK_MSG(bad == 0, "%s %s/%d: %d multi outputs differ", ops->name, bt_ggml_type_name(t), bits, bad);
            if (bt_cpu_act_format(t, 8) != BT_ACT_F32) {
                mms[2].act_bits = bits == 8 ? 16 : 8;
                CHECK(bt_cpu_matmul_run_multi(pool, mms, 3) != BT_OK);
                mms[2].act_bits = bits;
            }
            mms[1].n_in = n_in * 2;
            CHECK(bt_cpu_matmul_run_multi(pool, mms, 3) != BT_OK);
            for (int m = 0; m < 3; m++) free(sep[m]), fixture_free(&f[m]);
        }
    }
    bt_pool_destroy(pool);
}

/* BATON_CPU_ISA is read once at the edge (bt_cpu_isa_env); bt_cpu_isa_select takes what it read. */
static void test_isa_select(void)
{
    bt_cpu_isa isa;
    int want = 99;
    const char *entry = getenv("BATON_CPU_ISA"); /* this ctest entry's ISA (test_isa.h), restored below */
    char keep[16] = "";
    if (entry) snprintf(keep, sizeof keep, "%s", entry);
    setenv("BATON_CPU_ISA", "scalar", 1);
    CHECK(bt_cpu_isa_env(&want) == BT_OK && want == BT_CPU_ISA_SCALAR);
    CHECK(bt_cpu_isa_select(want, &isa) == BT_OK && isa == BT_CPU_ISA_SCALAR);
    setenv("BATON_CPU_ISA", "bogus", 1);
    CHECK(bt_cpu_isa_env(&want) == BT_ERR_INVALID && want == -1);
    CHECK(strstr(bt_last_error(), "BATON_CPU_ISA='bogus'") != NULL);
    for (int i = 1; i < BT_CPU_ISA_COUNT; i++) {
        if (bt_cpu_isa_supported((bt_cpu_isa)i)) continue;
        setenv("BATON_CPU_ISA", bt_cpu_isa_name((bt_cpu_isa)i), 1); /* named, but this CPU lacks it */
        CHECK(bt_cpu_isa_env(&want) == BT_ERR_UNSUPPORTED && want == -1);
        CHECK(bt_cpu_isa_select(i, &isa) == BT_ERR_UNSUPPORTED);
    }
    unsetenv("BATON_CPU_ISA");
    CHECK(bt_cpu_isa_env(&want) == BT_OK && want == -1);
    CHECK(bt_cpu_isa_select(want, &isa) == BT_OK && bt_cpu_isa_supported(isa));
    fprintf(stderr, "best ISA here: %s\n", bt_cpu_isa_name(isa));
    if (entry) setenv("BATON_CPU_ISA", keep, 1);
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_isa_select);
    RUN(test_matmul_checks);
    RUN(test_matmul_matches_dots);
    RUN(test_batch_invariance);
    RUN(test_matmul_multi);
    test_isa_report();
    return test_summary();
}
