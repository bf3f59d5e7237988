/* engine/cuda (libbaton_cuda.so through engine/backend_cuda.c) against the CPU scalar references and the CPU
 * backend: every op within a stated bound, the forward pass (top-1 agrees with the CPU backend's but for near ties;
 * the CPU backend is itself checked against the float64 logit oracle in tests/integration), batch invariance on the
 * GPU, and with --bench the decode bandwidth and prefill rate. Needs a GPU: registered with ctest only when CMake saw
 * one (tests/CMakeLists.txt), run by tools/gpu-check.sh on a lent GPU machine. Exits 77 ("SKIP: no CUDA device")
 * when started without one.
 *
 * Bounds (why): matmul runs f16 x f16 products with f32 accumulation, so |gpu - ref| <= 4e-3 * sum |w x| + 1e-6
 * against a float64 dot of the CPU-dequantized weights; element-wise ops, rmsnorm and rope differ from the CPU only by
 * the last bits of expf/tanh/FMA contraction: 2e-6 relative (+ 1e-6 absolute); attention (f32 dot, expf): 2e-5 of the
 * largest |V|; f16 KV writes are bit-identical, int8 codes within one step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/backend.h"
#include "engine/backend_cpu.h"
#include "engine/backend_cuda.h"
#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_quants.h"
#include "engine/forward.h"
#include "engine/ggml_type.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/scheduler.h"
#include "engine/tokenizer.h"
#include "test_util.h"
#include "tiny_model.h"

static bt_backend *gpu, *cpu;
static uint64_t rng = 0x1234567;

static float frand(void) /* uniform in [-1, 1) */
{
    return (float)((double)(test_rand_next(&rng) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void *dev_from(const void *host, size_t bytes)
{
    void *d = gpu->ops->buf_alloc(gpu, bytes);
    if (d && host) gpu->ops->buf_set(gpu, d, host, bytes);
    return d;
}

static void to_host(void *host, const void *dev, size_t bytes)
{
    gpu->ops->buf_get(gpu, host, dev, bytes);
}

static void put16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

/* n_out rows of n_in random weights of type t, with sane scales (random bytes elsewhere) */
static uint8_t *rand_weight(uint32_t t, int64_t n_in, int64_t n_out, size_t *bytes_out)
{
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    size_t nb = (size_t)(n_in / ti->block_elems) * (size_t)n_out, bytes = nb * ti->block_bytes;
    uint8_t *w = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)test_rand_next(&rng);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *p = w + b * ti->block_bytes;
        uint16_t d = bt_f32_to_fp16(0.002f + 0.02f * fabsf(frand())), m = bt_f32_to_fp16(-0.1f * fabsf(frand()));
        switch (t) {
        case BT_TYPE_F32: { float v = frand() * 0.1f; memcpy(p, &v, 4); break; }
        case BT_TYPE_F16: put16(p, bt_f32_to_fp16(frand() * 0.1f)); break;
        case BT_TYPE_BF16: put16(p, bt_f32_to_bf16(frand() * 0.1f)); break;
        case BT_TYPE_Q4_0: case BT_TYPE_Q5_0: case BT_TYPE_Q8_0: put16(p, d); break;
        case BT_TYPE_Q4_1: case BT_TYPE_Q5_1: case BT_TYPE_Q4_K: put16(p, d), put16(p + 2, m); break;
        case BT_TYPE_Q6_K: put16(p + 208, bt_f32_to_fp16(0.0005f + 0.001f * fabsf(frand()))); break;
        default: break;
        }
    }
    *bytes_out = bytes;
    return w;
}

static const uint32_t all_types[] = {BT_TYPE_F32, BT_TYPE_F16, BT_TYPE_BF16, BT_TYPE_Q4_0, BT_TYPE_Q4_1,
                                     BT_TYPE_Q5_0, BT_TYPE_Q5_1, BT_TYPE_Q8_0, BT_TYPE_Q4_K, BT_TYPE_Q6_K};
#define N_TYPES (int)(sizeof all_types / sizeof all_types[0])

/* matmul of every type and several shapes against a float64 dot of the CPU-dequantized weights, plus invariance:
 * each row's bits alone equal its bits in the batch (16-row and 64-row tiles) */
static void test_matmul(void)
{
    static const int64_t shapes[][2] = {{256, 64}, {512, 200}, {1024, 96}, {2048, 130}};
    static const int32_t rows[] = {1, 5, 16, 17, 70};
    for (int ti = 0; ti < N_TYPES; ti++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            uint32_t t = all_types[ti];
            int64_t K = shapes[si][0], N = shapes[si][1];
            size_t wb;
            uint8_t *w = rand_weight(t, K, N, &wb);
            float *deq = malloc((size_t)(K * N) * 4);
            size_t rb = wb / (size_t)N;
            for (int64_t r = 0; r < N; r++) bt_cpu_dequantize_row_ref(t, K, w + (size_t)r * rb, deq + r * K);
            bt_weight W = {.type = t, .n_in = K, .n_out = N, .data = w};
            float *bias = malloc((size_t)N * 4);
            for (int64_t j = 0; j < N; j++) bias[j] = frand();
            int32_t M = 70;
            float *x = malloc((size_t)(M * K) * 4), *out = malloc((size_t)(M * N) * 4), *one = malloc((size_t)N * 4);
            for (int64_t i = 0; i < M * K; i++) x[i] = frand();
            float *xd = dev_from(x, (size_t)(M * K) * 4), *od = dev_from(NULL, (size_t)(M * N) * 4);
            double worst = 0;
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                int32_t m = rows[ri];
                CHECK(gpu->ops->matmul(gpu, &W, bias, xd, m, od) == BT_OK);
                to_host(out, od, (size_t)(m * N) * 4);
                for (int32_t r = 0; r < m; r++)
                    for (int64_t j = 0; j < N; j++) {
                        double ref = bias[j], mag = 0;
                        for (int64_t k = 0; k < K; k++) {
                            ref += (double)deq[j * K + k] * x[r * K + k];
                            mag += fabs((double)deq[j * K + k] * x[r * K + k]);
                        }
                        double err = fabs(out[r * N + j] - ref), lim = 4e-3 * mag + 1e-6;
                        if (err / (lim) > worst) worst = err / lim;
                    }
                /* invariance: the last row alone, through the host-output path too */
                CHECK(gpu->ops->matmul(gpu, &W, bias, xd + (size_t)(m - 1) * (size_t)K, 1, one) == BT_OK);
                CHECK_MSG(!memcmp(one, out + (size_t)(m - 1) * (size_t)N, (size_t)N * 4),
                          "type %s K %lld rows %d: a row alone differs from the same row in the batch",
                          bt_ggml_type_name(t), (long long)K, m);
            }
            CHECK_MSG(worst <= 1.0, "matmul %s K %lld N %lld: error %.3g of the bound", bt_ggml_type_name(t),
                      (long long)K, (long long)N, worst);
            printf("op matmul %-5s K=%-5lld N=%-4lld worst error %.3f of bound\n", bt_ggml_type_name(t), (long long)K,
                   (long long)N, worst);
            gpu->ops->buf_free(gpu, xd);
            gpu->ops->buf_free(gpu, od);
            free(w), free(deq), free(bias), free(x), free(out), free(one);
        }
}

/* activations past f16's range (up to 2e5): scaled per row by a power of two inside the matmul, same bound */
static void test_matmul_large(void)
{
    int64_t K = 512, N = 64;
    size_t wb;
    uint8_t *w = rand_weight(BT_TYPE_Q8_0, K, N, &wb);
    float *deq = malloc((size_t)(K * N) * 4), x[3 * 512], out[3 * 64];
    for (int64_t r = 0; r < N; r++)
        bt_cpu_dequantize_row_ref(BT_TYPE_Q8_0, K, w + (size_t)r * (wb / (size_t)N), deq + r * K);
    for (int i = 0; i < 3 * 512; i++) x[i] = frand() * (i < 512 ? 2e5f : i < 1024 ? 1.0f : 7e4f);
    bt_weight W = {.type = BT_TYPE_Q8_0, .n_in = K, .n_out = N, .data = w};
    float *xd = dev_from(x, sizeof x), *od = dev_from(NULL, sizeof out);
    CHECK(gpu->ops->matmul(gpu, &W, NULL, xd, 3, od) == BT_OK);
    to_host(out, od, sizeof out);
    double worst = 0;
    for (int r = 0; r < 3; r++)
        for (int64_t j = 0; j < N; j++) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                ref += (double)deq[j * K + k] * x[r * K + k];
                mag += fabs((double)deq[j * K + k] * x[r * K + k]);
            }
            double e = fabs(out[r * N + j] - ref) / (4e-3 * mag + 1e-6);
            if (e > worst || e != e) worst = e != e ? INFINITY : e;
        }
    CHECK_MSG(worst <= 1.0, "matmul of large activations: %.3g of the bound", worst);
    printf("op matmul large activations worst error %.3f of bound\n", worst);
    gpu->ops->buf_free(gpu, xd), gpu->ops->buf_free(gpu, od);
    free(w), free(deq);
}

static double rel_err(const float *a, const float *b, size_t n) /* max |a - b| / (|b| + 1e-6 / 2e-6) in units */
{
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]) / (2e-6 * fabs((double)b[i]) + 1e-6);
        if (e > worst || e != e) worst = e != e ? INFINITY : e;
    }
    return worst;
}

static void test_embed(void)
{
    for (int ti = 0; ti < N_TYPES; ti++) {
        uint32_t t = all_types[ti];
        int64_t K = 512, V = 300;
        size_t wb;
        uint8_t *w = rand_weight(t, K, V, &wb);
        bt_weight W = {.type = t, .n_in = K, .n_out = V, .data = w};
        int32_t tok[5] = {0, 299, 17, 17, 150};
        float ref[5 * 512], got[5 * 512];
        cpu->ops->embed(cpu, &W, tok, 5, ref);
        float *od = dev_from(NULL, sizeof got);
        gpu->ops->embed(gpu, &W, tok, 5, od);
        to_host(got, od, sizeof got);
        double e = rel_err(got, ref, 5 * 512);
        CHECK_MSG(e <= 1.0, "embed %s: %.3g", bt_ggml_type_name(t), e);
        printf("op embed %-5s worst error %.3f of bound\n", bt_ggml_type_name(t), e);
        gpu->ops->buf_free(gpu, od);
        free(w);
    }
}

/* rmsnorm, rope (both layouts), swiglu, geglu, add, scale against the CPU backend */
static void test_elementwise(void)
{
    enum { R = 9, N = 4096 };
    float *x = malloc(R * N * 4), *y = malloc(R * N * 4), *w = malloc(N * 4), *ref = malloc(R * N * 4),
          *got = malloc(R * N * 4);
    for (int i = 0; i < R * N; i++) x[i] = frand() * 3, y[i] = frand() * 3;
    for (int i = 0; i < N; i++) w[i] = frand();
    float *xd = dev_from(x, R * N * 4), *yd = dev_from(y, R * N * 4), *od = dev_from(NULL, R * N * 4);
    double e;

    cpu->ops->rmsnorm(cpu, x, w, R, N, 1e-5f, ref);
    gpu->ops->rmsnorm(gpu, xd, w, R, N, 1e-5f, od);
    to_host(got, od, R * N * 4);
    CHECK_MSG((e = rel_err(got, ref, R * N)) <= 1.0, "rmsnorm %.3g", e);
    printf("op rmsnorm worst error %.3f of bound\n", e);

    cpu->ops->swiglu(cpu, x, y, R * N, ref);
    gpu->ops->swiglu(gpu, xd, yd, R * N, od);
    to_host(got, od, R * N * 4);
    CHECK_MSG((e = rel_err(got, ref, R * N)) <= 1.0, "swiglu %.3g", e);
    printf("op swiglu worst error %.3f of bound\n", e);

    cpu->ops->geglu(cpu, x, y, R * N, ref);
    gpu->ops->geglu(gpu, xd, yd, R * N, od);
    to_host(got, od, R * N * 4);
    CHECK_MSG((e = rel_err(got, ref, R * N)) <= 1.0, "geglu %.3g", e);
    printf("op geglu worst error %.3f of bound\n", e);

    memcpy(ref, x, R * N * 4);
    cpu->ops->add(cpu, ref, y, R * N);
    gpu->ops->buf_copy(gpu, od, xd, R * N * 4);
    gpu->ops->add(gpu, od, yd, R * N);
    to_host(got, od, R * N * 4);
    CHECK_MSG((e = rel_err(got, ref, R * N)) <= 1.0, "add %.3g", e);
    printf("op add worst error %.3f of bound\n", e);

    memcpy(ref, x, R * N * 4);
    cpu->ops->scale(cpu, ref, 25.298221f, R * N);
    gpu->ops->buf_copy(gpu, od, xd, R * N * 4);
    gpu->ops->scale(gpu, od, 25.298221f, R * N);
    to_host(got, od, R * N * 4);
    CHECK_MSG(!memcmp(got, ref, R * N * 4), "scale differs from the CPU's bits");
    printf("op scale bit-identical: %s\n", memcmp(got, ref, R * N * 4) ? "no" : "yes");

    /* rope: 9 tokens x 32 heads x 128, positions up to 30000, rotating 96 of 128 dims */
    int32_t pos[R] = {0, 1, 2, 100, 255, 256, 4095, 17000, 30000};
    for (int neox = 0; neox < 2; neox++) {
        memcpy(ref, x, R * N * 4);
        cpu->ops->rope(cpu, ref, pos, R, 32, 128, 96, 10000.0f, 0.5f, neox);
        gpu->ops->buf_set(gpu, od, x, R * N * 4);
        gpu->ops->rope(gpu, od, pos, R, 32, 128, 96, 10000.0f, 0.5f, neox);
        to_host(got, od, R * N * 4);
        double worst = 0;
        for (int i = 0; i < R * N; i++) {
            double d = fabs((double)got[i] - ref[i]) / 1e-5; /* |x| <= 3, angles within 1 ulp of float */
            if (d > worst) worst = d;
        }
        CHECK_MSG(worst <= 1.0, "rope neox=%d %.3g", neox, worst);
        printf("op rope neox=%d worst error %.3f of bound\n", neox, worst);
    }
    gpu->ops->buf_free(gpu, xd), gpu->ops->buf_free(gpu, yd), gpu->ops->buf_free(gpu, od);
    free(x), free(y), free(w), free(ref), free(got);
}

/* kv_write and attention: the same K/V written by both backends into their pools (CPU: host, GPU: device), then
 * attention for a prefill chunk and decode tokens of three sequences (one past 256 positions: several segments), with
 * and without a window, against the CPU backend. */
static void attn_case(bt_kv_dtype dt, int32_t window)
{
    bt_hparams hp = {.n_layer = 2, .n_head = 8, .n_head_kv = 2, .head_dim = 128};
    size_t stride = bt_kv_block_stride(&hp, dt), bytes = stride * 2 * 64;
    bt_kv_pool *kc, *kg;
    void *gmem = gpu->ops->buf_alloc(gpu, bytes);
    REQUIRE(gmem);
    REQUIRE(bt_kv_pool_create(&hp, dt, bytes, NULL, &kc) == BT_OK);
    REQUIRE(bt_kv_pool_create(&hp, dt, bytes, gmem, &kg) == BT_OK);
    uint8_t *zeros = calloc(1, kg->bytes); /* the CPU pool starts zeroed: so does this one, for the byte compare */
    gpu->ops->buf_set(gpu, gmem, zeros, kg->bytes);
    free(zeros);
    /* sequences: lengths 600 (40 blocks), 37, 5 */
    static const int32_t lens[3] = {600, 37, 5};
    int32_t tables[3][40], nb[3];
    for (int s = 0; s < 3; s++) {
        nb[s] = (lens[s] + 15) / 16;
        bt_kv_pool_alloc(kc, nb[s], tables[s]);
        bt_kv_pool_alloc(kg, nb[s], tables[s]); /* same ids: both pools start empty */
    }
    int32_t KVW = hp.n_head_kv * hp.head_dim, QW = hp.n_head * hp.head_dim;
    int32_t total = lens[0] + lens[1] + lens[2];
    float *k = malloc((size_t)total * KVW * 4), *v = malloc((size_t)total * KVW * 4);
    int32_t *slots = malloc((size_t)total * 4);
    for (int32_t i = 0; i < total * KVW; i++) k[i] = frand() * 2, v[i] = frand() * 2;
    int32_t t = 0;
    for (int s = 0; s < 3; s++)
        for (int32_t p = 0; p < lens[s]; p++, t++) slots[t] = tables[s][p / 16] * 16 + p % 16;
    float *kd = dev_from(k, (size_t)total * KVW * 4), *vd = dev_from(v, (size_t)total * KVW * 4);
    cpu->ops->kv_write(cpu, kc, 1, k, v, total, slots);
    gpu->ops->kv_write(gpu, kg, 1, kd, vd, total, slots);
    uint8_t *pool = malloc(kg->bytes);
    to_host(pool, kg->base, kg->bytes);
    size_t diff = 0;
    for (size_t i = 0; i < kg->bytes; i++) {
        int d = (int)pool[i] - (int)kc->base[i];
        if (dt == BT_KV_INT8 ? abs(d) > 1 : d != 0) diff++;
    }
    /* int8: fp16 scale and min bytes can differ by a carry too; count only gross disagreement */
    CHECK_MSG(dt == BT_KV_INT8 ? diff < kg->bytes / 1000 : diff == 0, "kv_write %s: %zu bytes differ",
              bt_kv_dtype_name(dt), diff);
    /* queries: the last 20 positions of sequence 0 (a chunk), the last token of the others */
    enum { NQ = 22 };
    int32_t qpos[NQ];
    const int32_t *qtab[NQ];
    for (int i = 0; i < 20; i++) qpos[i] = 580 + i, qtab[i] = tables[0];
    qpos[20] = 36, qtab[20] = tables[1];
    qpos[21] = 4, qtab[21] = tables[2];
    float *q = malloc((size_t)NQ * QW * 4), *ref = malloc((size_t)NQ * QW * 4), *got = malloc((size_t)NQ * QW * 4);
    for (int i = 0; i < NQ * QW; i++) q[i] = frand();
    float *qd = dev_from(q, (size_t)NQ * QW * 4), *od = dev_from(NULL, (size_t)NQ * QW * 4);
    bt_attn_args a = {.kv = kc, .layer = 1, .n_tokens = NQ, .n_head = hp.n_head, .n_head_kv = hp.n_head_kv,
                      .head_dim = hp.head_dim, .scale = 1.0f / sqrtf(128.0f), .window = window, .q = q, .pos = qpos,
                      .tables = qtab, .out = ref};
    CHECK(cpu->ops->attention(cpu, &a) == BT_OK);
    a.kv = kg, a.q = qd, a.out = od;
    CHECK(gpu->ops->attention(gpu, &a) == BT_OK);
    to_host(got, od, (size_t)NQ * QW * 4);
    double worst = 0;
    for (int i = 0; i < NQ * QW; i++) {
        double e = fabs((double)got[i] - ref[i]) / (2e-5 * 2.0);
        if (e > worst || e != e) worst = e != e ? INFINITY : e;
    }
    CHECK_MSG(worst <= 1.0, "attention %s window %d: %.3g", bt_kv_dtype_name(dt), window, worst);
    printf("op kv_write+attention kv=%s window=%d worst error %.3f of bound\n", bt_kv_dtype_name(dt), window, worst);
    /* invariance: the decode token of sequence 2 alone */
    a.n_tokens = 1, a.q = qd + (size_t)21 * QW, a.pos = qpos + 21, a.tables = qtab + 21;
    float one[8 * 128];
    a.out = od;
    CHECK(gpu->ops->attention(gpu, &a) == BT_OK);
    to_host(one, od, sizeof one);
    CHECK_MSG(!memcmp(one, got + (size_t)21 * QW, sizeof one), "attention: a token alone differs from batched");
    gpu->ops->buf_free(gpu, kd), gpu->ops->buf_free(gpu, vd), gpu->ops->buf_free(gpu, qd), gpu->ops->buf_free(gpu, od);
    free(k), free(v), free(slots), free(pool), free(q), free(ref), free(got);
    bt_kv_pool_destroy(kc);
    bt_kv_pool_destroy(kg);
    gpu->ops->buf_free(gpu, gmem);
}

static void test_attention(void)
{
    attn_case(BT_KV_F16, 0);
    attn_case(BT_KV_F16, 100);
    attn_case(BT_KV_F32, 0);
    attn_case(BT_KV_INT8, 0);
}

static double now_s(void);

/* ---- forward pass ---- */

typedef struct fenv {
    bt_model *m;
    bt_backend *be;
    bt_forward *fw;
    bt_kv_pool *kv;
    void *kvmem;
} fenv;

static int fenv_open(fenv *e, bt_model *m, bt_backend *be)
{
    memset(e, 0, sizeof *e);
    e->m = m, e->be = be;
    if (bt_forward_create(m, be, 128, 0, &e->fw)) return -1;
    size_t bytes = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer * 64;
    if (be == gpu && !(e->kvmem = be->ops->buf_alloc(be, bytes))) return -1;
    return bt_kv_pool_create(&m->hp, BT_KV_F16, bytes, e->kvmem, &e->kv) ? -1 : 0;
}

static void fenv_close(fenv *e)
{
    bt_kv_pool_destroy(e->kv);
    if (e->kvmem) e->be->ops->buf_free(e->be, e->kvmem);
    bt_forward_destroy(e->fw);
}

/* Runs the n tokens of one sequence (positions p0..) with logits of each into logits[n][V]. */
static int run_seq(fenv *e, const int32_t *table, int32_t n_blocks, const int32_t *tokens, int32_t p0, int32_t n,
                   float *logits)
{
    int32_t pos[128], seqi[128], rows[128];
    for (int32_t i = 0; i < n; i++) pos[i] = p0 + i, seqi[i] = 0, rows[i] = i;
    bt_seq_view sv = {.block_table = table, .n_blocks = n_blocks};
    bt_batch b = {.n_tokens = n, .tokens = tokens, .pos = pos, .seq = seqi, .seqs = &sv, .n_seqs = 1,
                  .logit_rows = rows, .n_logits = n};
    return bt_forward_run(e->fw, e->kv, &b, logits) ? -1 : 0;
}

/* The first L (<= 120) tokens on both backends: a prompt of 60 in chunks of 24, then teacher-forced decode steps;
 * top-1 agreement and relative L2 error of the logits of every position. */
static void compare_forward(bt_model *m, const int32_t *tokens, int32_t L, const char *label)
{
    fenv ec, eg;
    REQUIRE(fenv_open(&ec, m, cpu) == 0);
    REQUIRE(fenv_open(&eg, m, gpu) == 0);
    int32_t V = m->hp.n_vocab, table[8], tg[8];
    bt_kv_pool_alloc(ec.kv, 8, table);
    bt_kv_pool_alloc(eg.kv, 8, tg);
    float *lc = malloc((size_t)L * V * 4), *lg = malloc((size_t)L * V * 4);
    int ok = 1, gpu_steps = 0;
    double gpu_s = 0;
    for (int32_t p = 0; p < L && ok;) {
        int32_t n = p < 60 ? (60 - p < 24 ? 60 - p : 24) : 1;
        if (p + n > L) n = L - p;
        ok = run_seq(&ec, table, 8, tokens + p, p, n, lc + (size_t)p * V) == 0;
        double t0 = now_s();
        ok = ok && run_seq(&eg, tg, 8, tokens + p, p, n, lg + (size_t)p * V) == 0;
        if (n == 1) gpu_s += now_s() - t0, gpu_steps++; /* decode steps, logits on the host included */
        p += n;
    }
    if (gpu_steps)
        printf("forward %s: %.3f ms per decode step on the backend under test (%d layers; host overhead shows here)\n",
               label, gpu_s / gpu_steps * 1e3, m->hp.n_layer);
    CHECK_MSG(ok, "forward %s: %s", label, bt_last_error());
    /* A position where the two top-1s differ is a near tie when the CPU's own logits put the GPU's pick within 8x
     * the position's RMS logit error of its top-1: f16 tiles move every logit a little, and a 4-layer slice of a
     * real model has flat distributions where that flips the order. Every other disagreement is a failure. */
    int agree = 0, ties = 0;
    double d2 = 0, v2 = 0;
    for (int32_t p = 0; p < L; p++) {
        const float *c = lc + (size_t)p * V, *g = lg + (size_t)p * V;
        int ac = 0, ag = 0;
        double pd2 = 0;
        for (int32_t j = 1; j < V; j++) {
            if (c[j] > c[ac]) ac = j;
            if (g[j] > g[ag]) ag = j;
        }
        for (int32_t j = 0; j < V; j++) {
            double d = (double)g[j] - c[j];
            pd2 += d * d, v2 += (double)c[j] * c[j];
        }
        d2 += pd2;
        double rms = sqrt(pd2 / V), margin = (double)c[ac] - c[ag];
        if (ac == ag) {
            agree++;
        } else {
            int tie = margin <= 8 * rms;
            ties += tie;
            printf("forward %s: position %d: top-1 %d (cpu) vs %d (gpu), cpu margin %.4f, rms logit error %.4f: %s\n",
                   label, p, ac, ag, margin, rms, tie ? "near tie" : "DISAGREES");
        }
    }
    double rel = sqrt(d2 / (v2 > 0 ? v2 : 1));
    printf("forward %s: top-1 agreement %d/%d (%d near ties), relative L2 error of logits %.2e\n", label, agree, L,
           ties, rel);
    CHECK_MSG(agree + ties == L, "forward %s: %d of %d top-1s differ beyond a near tie", label, L - agree - ties, L);
    CHECK_MSG(agree >= (95 * L + 99) / 100, "forward %s: top-1 agreement %d/%d", label, agree, L);
    CHECK_MSG(rel < 2e-2, "forward %s: relative L2 error %.3g", label, rel);
    free(lc), free(lg);
    fenv_close(&ec);
    fenv_close(&eg);
}

static void forward_case(uint32_t mtype, const char *arch)
{
    char path[512], label[64];
    tiny_model_opts o = {.arch = arch, .matrix_type = mtype, .n_embd = 256, .n_head = 4, .n_head_kv = 2,
                         .n_ff = 512, .n_vocab = 512, .n_layer = 2, .seed = 7 + mtype};
    tiny_model_defaults(&o);
    snprintf(path, sizeof path, "%s/fw_%s_%s.gguf", test_tmpdir(), bt_ggml_type_name(mtype), arch);
    REQUIRE(tiny_model_write(path, &o) == 0);
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    int32_t tokens[100];
    for (int i = 0; i < 100; i++) tokens[i] = (int32_t)(test_rand_next(&rng) % (uint64_t)m->hp.n_vocab);
    snprintf(label, sizeof label, "tiny %s %s", arch, bt_ggml_type_name(mtype));
    compare_forward(m, tokens, 100, label);
    bt_model_free(m);
}

/* A real model's first layers ($BATON_TEST_MODEL, written by `baton model slice`: tools/gpu-check-prepare.sh) on
 * real text: real activation ranges, GQA and head sizes. Not run without the variable. */
static void test_real_model(void)
{
    const char *path = getenv("BATON_TEST_MODEL");
    if (!path || !*path) {
        printf("model: BATON_TEST_MODEL not set: not run\n");
        return;
    }
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    tok_tokenizer *tok;
    REQUIRE(tok_create(m->file, &tok) == BT_OK);
    static const char text[] =
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
        "faster than scribes. Within fifty years presses operated in more than two hundred cities across Europe, "
        "and the price of books fell sharply. Literacy spread, scientific results travelled between scholars, and "
        "the Reformation used pamphlets to reach ordinary readers. def fib(n):\n    return n if n < 2 else "
        "fib(n - 1) + fib(n - 2)\n";
    tok_ids ids = {0};
    REQUIRE(tok_encode(tok, text, sizeof text - 1, TOK_ADD_SPECIAL, &ids) == BT_OK);
    int32_t L = ids.n < 120 ? (int32_t)ids.n : 120;
    char label[200];
    snprintf(label, sizeof label, "%s (%d layers)", m->name, m->hp.n_layer);
    compare_forward(m, ids.ids, L, label);
    tok_ids_free(&ids);
    tok_free(tok);
    bt_model_free(m);
}

static void test_forward(void)
{
    static const uint32_t types[] = {BT_TYPE_Q4_0, BT_TYPE_Q4_1, BT_TYPE_Q8_0, BT_TYPE_Q4_K, BT_TYPE_Q6_K,
                                     BT_TYPE_F16, BT_TYPE_BF16};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) forward_case(types[i], "llama");
    forward_case(BT_TYPE_Q4_1, "qwen2"); /* neox rope and q/k/v biases */
}

/* A decode token of sequence A alone, then the same step batched with a 40-token prompt chunk of B and a decode token
 * of C (a 41-row matmul: 64-row tiles): A's logits are bit-identical. */
static void test_batch_invariance(void)
{
    char path[512];
    tiny_model_opts o = {.n_embd = 256, .n_head = 4, .n_head_kv = 2, .n_ff = 512, .n_vocab = 512, .seed = 99};
    tiny_model_defaults(&o);
    snprintf(path, sizeof path, "%s/inv.gguf", test_tmpdir());
    REQUIRE(tiny_model_write(path, &o) == 0);
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    fenv e;
    REQUIRE(fenv_open(&e, m, gpu) == 0);
    int32_t V = m->hp.n_vocab, ta[4], tb[4], tc[4];
    bt_kv_pool_alloc(e.kv, 4, ta), bt_kv_pool_alloc(e.kv, 4, tb), bt_kv_pool_alloc(e.kv, 4, tc);
    int32_t toks[64];
    for (int i = 0; i < 64; i++) toks[i] = (int32_t)(test_rand_next(&rng) % (uint64_t)V);
    float *scratch = malloc((size_t)64 * V * 4), *alone = malloc((size_t)V * 4), *batched = malloc((size_t)64 * V * 4);
    /* A: 30-token prompt, C: 10-token prompt */
    REQUIRE(run_seq(&e, ta, 4, toks, 0, 30, scratch) == 0);
    REQUIRE(run_seq(&e, tc, 4, toks + 30, 0, 10, scratch) == 0);
    REQUIRE(run_seq(&e, ta, 4, toks + 40, 30, 1, alone) == 0);
    /* the same step again, batched (A's token at 30 is rewritten with the same K/V) */
    int32_t tok[42], pos[42], seq[42], rows[42];
    tok[0] = toks[40], pos[0] = 30, seq[0] = 0;
    for (int i = 0; i < 40; i++) tok[1 + i] = toks[i], pos[1 + i] = i, seq[1 + i] = 1;
    tok[41] = toks[41], pos[41] = 10, seq[41] = 2;
    for (int i = 0; i < 42; i++) rows[i] = i;
    bt_seq_view sv[3] = {{.block_table = ta, .n_blocks = 4}, {.block_table = tb, .n_blocks = 4}, {.block_table = tc, .n_blocks = 4}};
    bt_batch b = {.n_tokens = 42, .tokens = tok, .pos = pos, .seq = seq, .seqs = sv, .n_seqs = 3, .logit_rows = rows,
                  .n_logits = 42};
    REQUIRE(bt_forward_run(e.fw, e.kv, &b, batched) == BT_OK);
    CHECK_MSG(!memcmp(alone, batched, (size_t)V * 4), "decode logits differ between alone and batched");
    printf("batch invariance: decode row alone vs batched with 41 others: %s\n",
           memcmp(alone, batched, (size_t)V * 4) ? "DIFFERENT" : "bit-identical");
    free(scratch), free(alone), free(batched);
    fenv_close(&e);
    bt_model_free(m);
}

/* ---- the scheduler on the GPU: its KV pool in device memory (bt_backend_kv_pool_create), prefix cache and
 * copy-on-write through buf_copy, logits to the host sampler. 16 requests alone, then all at once with a tight
 * token budget (mixed prefill and decode steps): every token and logprob identical. ---- */

typedef struct sout {
    int32_t tokens[48];
    float logprobs[48];
    int32_t n;
} sout;

static void sched_collect(void *user, const bt_sched_event *ev)
{
    sout *o = user;
    if (ev->token >= 0 && o->n < 48) {
        o->logprobs[o->n] = ev->logprob;
        o->tokens[o->n++] = ev->token;
    }
}

static bt_sched *sched_make(bt_model *m, size_t blocks, int32_t budget)
{
    bt_sched_config cfg = {0};
    cfg.kv_mem = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer * blocks;
    cfg.max_batch_tokens = budget;
    bt_sched *s = NULL;
    if (bt_sched_create(m, gpu, &cfg, &s) != BT_OK) fprintf(stderr, "sched: %s\n", bt_last_error());
    return s;
}

static void sched_run(bt_sched *s)
{
    for (int guard = 0; guard < 100000 && !bt_sched_idle(s); guard++)
        if (bt_sched_step(s) < 0) break;
}

static void test_scheduler(void)
{
    enum { N = 16 };
    char path[512];
    tiny_model_opts o = {.n_embd = 256, .n_head = 4, .n_head_kv = 2, .n_ff = 512, .n_vocab = 512, .seed = 5};
    tiny_model_defaults(&o);
    snprintf(path, sizeof path, "%s/sched.gguf", test_tmpdir());
    REQUIRE(tiny_model_write(path, &o) == 0);
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    static int32_t prompts[N][100];
    static int32_t lens[N];
    static bt_req_params ps[N];
    static sout alone[N], together[N];
    uint64_t seed = 11;
    for (int i = 0; i < N; i++) {
        lens[i] = 1 + (int32_t)(test_rand_next(&seed) % 99);
        for (int32_t k = 0; k < lens[i]; k++)
            prompts[i][k] = i % 4 == 3 && k < 40 ? prompts[0][k % lens[0]] /* shared prefixes */
                                              : (int32_t)(test_rand_next(&seed) % 512);
        ps[i] = bt_req_params_default();
        ps[i].sampling.max_tokens = 8 + i % 24;
        ps[i].sampling.ignore_eos = 1;
        ps[i].sampling.logprobs = 1;
        if (i % 2) ps[i].sampling.temperature = 0.8f, ps[i].sampling.seed = 100 + (uint64_t)i;
    }
    for (int i = 0; i < N; i++) {
        bt_sched *s = sched_make(m, 64, 512);
        REQUIRE(s);
        REQUIRE(bt_sched_submit(s, prompts[i], lens[i], &ps[i], sched_collect, &alone[i], NULL) == BT_OK);
        sched_run(s);
        bt_sched_destroy(s);
    }
    bt_sched *s = sched_make(m, 256, 64);
    REQUIRE(s);
    for (int i = 0; i < N; i++)
        REQUIRE(bt_sched_submit(s, prompts[i], lens[i], &ps[i], sched_collect, &together[i], NULL) == BT_OK);
    sched_run(s);
    bt_sched_destroy(s);
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += alone[i].n != ps[i].sampling.max_tokens || together[i].n != alone[i].n ||
               memcmp(alone[i].tokens, together[i].tokens, sizeof(int32_t) * (size_t)alone[i].n) ||
               memcmp(alone[i].logprobs, together[i].logprobs, sizeof(float) * (size_t)alone[i].n);
    printf("scheduler on the GPU: %d of %d requests identical alone and together\n", N - bad, N);
    CHECK_MSG(bad == 0, "scheduler: %d of %d requests differ from their solo runs", bad, N);
    bt_model_free(m);
}

/* ---- forward-pass speed (group "speed": prints figures, asserts only that the runs succeed) ---- */

/* Rows [0, n) of one step: row i is token toks[i] of sequence seq[i] at position pos[i]; the logits of the rows in
 * lrows come back to the host, as the scheduler asks for them. */
static int speed_step(fenv *e, const bt_seq_view *sv, int32_t n_seqs, const int32_t *toks, const int32_t *pos,
                      const int32_t *seq, int32_t n, const int32_t *lrows, int32_t n_logits, float *logits)
{
    bt_batch b = {.n_tokens = n, .tokens = toks, .pos = pos, .seq = seq, .seqs = sv, .n_seqs = n_seqs,
                  .logit_rows = lrows, .n_logits = n_logits};
    return bt_forward_run(e->fw, e->kv, &b, logits) ? -1 : 0;
}

/* On backend be: a 512-token prompt in chunks of 128 (last row's logits), 32 decode steps of that sequence, then 16
 * sequences of 16-token prompts and 32 decode steps of all 16 (every row's logits). */
static void speed_on(bt_model *m, bt_backend *be, const char *label, const char *where)
{
    enum { S = 16, STEPS = 32 };
    const int32_t V = m->hp.n_vocab;
    int32_t toks[512], pos[512], seq[512], lrows[S], table[S * 4];
    float *logits = malloc((size_t)S * (size_t)V * 4);
    REQUIRE(logits);
    for (int i = 0; i < 512; i++) toks[i] = (int32_t)(((int64_t)i * 7919 + 13) % V), seq[i] = 0;
    fenv e;
    REQUIRE(fenv_open(&e, m, be) == 0);
    REQUIRE(bt_kv_pool_alloc(e.kv, 34, table) == BT_OK); /* 544 positions */
    bt_seq_view one = {.block_table = table, .n_blocks = 34};
    int ok = 1;
    double t0 = now_s();
    for (int32_t p = 0; p < 512 && ok; p += 128) {
        for (int i = 0; i < 128; i++) pos[i] = p + i;
        int32_t last = 127;
        ok = speed_step(&e, &one, 1, toks + p, pos, seq, 128, &last, 1, logits) == 0;
    }
    double t_pre = now_s() - t0;
    t0 = now_s();
    for (int s = 0; s < STEPS && ok; s++) {
        int32_t p = 512 + s, zero = 0;
        ok = speed_step(&e, &one, 1, &toks[s], &p, &zero, 1, &zero, 1, logits) == 0;
    }
    double t_one = (now_s() - t0) / STEPS;
    fenv_close(&e);
    CHECK_MSG(ok, "speed %s on %s: %s", label, where, bt_last_error());
    REQUIRE(fenv_open(&e, m, be) == 0);
    REQUIRE(bt_kv_pool_alloc(e.kv, S * 4, table) == BT_OK);
    bt_seq_view sv[S];
    for (int i = 0; i < S; i++) sv[i] = (bt_seq_view){.block_table = table + 4 * i, .n_blocks = 4};
    for (int half = 0; half < 2 && ok; half++) { /* the prompts: 8 sequences x 16 tokens per step */
        for (int i = 0; i < 128; i++) seq[i] = 8 * half + i / 16, pos[i] = i % 16;
        for (int i = 0; i < 8; i++) lrows[i] = 16 * i + 15;
        ok = speed_step(&e, sv, S, toks + 128 * half, pos, seq, 128, lrows, 8, logits) == 0;
    }
    t0 = now_s();
    for (int s = 0; s < STEPS && ok; s++) {
        for (int i = 0; i < S; i++) seq[i] = i, pos[i] = 16 + s, lrows[i] = i;
        ok = speed_step(&e, sv, S, toks + s, pos, seq, S, lrows, S, logits) == 0;
    }
    double t_many = (now_s() - t0) / STEPS;
    fenv_close(&e);
    free(logits);
    CHECK_MSG(ok, "speed %s on %s: %s", label, where, bt_last_error());
    printf("speed %s on %s: prefill 512 %.0f tok/s; decode 1 sequence %.3f ms/step (%.0f tok/s), %d sequences "
           "%.3f ms/step (%.0f tok/s)\n", label, where, 512 / t_pre, t_one * 1e3, 1 / t_one, S, t_many * 1e3,
           S / t_many);
}

/* The real model's first layers ($BATON_TEST_MODEL) or else a tiny model, on the backend under test and on the CPU
 * backend (this machine's cores), in one process: what the forward pass gives end to end, host work and logits'
 * copies included, where --bench measures one matmul. */
static void test_speed(void)
{
    const char *path = getenv("BATON_TEST_MODEL");
    char tiny[512];
    if (!path || !*path) {
        tiny_model_opts o = {.matrix_type = BT_TYPE_Q4_1, .n_embd = 256, .n_head = 4, .n_head_kv = 2, .n_ff = 512,
                             .n_vocab = 512, .n_layer = 2, .seed = 9};
        tiny_model_defaults(&o);
        snprintf(tiny, sizeof tiny, "%s/speed.gguf", test_tmpdir());
        REQUIRE(tiny_model_write(tiny, &o) == 0);
        path = tiny;
    }
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    char label[200];
    snprintf(label, sizeof label, "%s (%d layers)", m->name, m->hp.n_layer);
    speed_on(m, gpu, label, "the backend under test");
    speed_on(m, cpu, label, "the CPU backend");
    bt_model_free(m);
}

/* ---- benchmark ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sync_gpu(void *dev)
{
    float f;
    to_host(&f, dev, 4);
}

/* Device-to-device copy bandwidth (read + write bytes) and the WMMA rate, then per weight type the matmul's weight
 * bandwidth at 1 and 16 rows (decode: weight bytes / time, against the copy bandwidth) and its rate at 512 rows
 * (prefill, against the WMMA rate). */
static int bench(void)
{
    size_t big = (size_t)1 << 30;
    void *a = gpu->ops->buf_alloc(gpu, big), *b = gpu->ops->buf_alloc(gpu, big);
    if (!a || !b) return 1;
    gpu->ops->buf_copy(gpu, b, a, big);
    sync_gpu(b);
    double t0 = now_s();
    for (int i = 0; i < 10; i++) gpu->ops->buf_copy(gpu, b, a, big);
    sync_gpu(b);
    double copy_bw = 2.0 * (double)big * 10 / (now_s() - t0);
    printf("bench copy: %.1f GB/s (device-to-device, read + write)\n", copy_bw / 1e9);
    gpu->ops->buf_free(gpu, b);
    double peak = 0;
    if (bt_backend_cuda_mma_tflops(gpu, &peak) == BT_OK)
        printf("bench mma: %.1f TFLOP/s (WMMA f16 -> f32 from registers, the matmul's instruction)\n", peak);
    else
        printf("bench mma: not measured: %s\n", bt_last_error());
    static const uint32_t types[] = {BT_TYPE_Q4_0, BT_TYPE_Q4_1, BT_TYPE_Q8_0, BT_TYPE_Q4_K, BT_TYPE_Q6_K, BT_TYPE_F16,
                                     BT_TYPE_BF16};
    /* per type 4 matrices of 8192 inputs and ~256 MiB each (one random matrix copied 4 times: 1 GiB read per pass,
     * far past the 60 MB L2), so each launch streams enough that host overhead hides behind it */
    const int64_t K = 8192;
    const int nm = 4;
    float *x = malloc((size_t)K * 512 * 4);
    for (int64_t i = 0; i < K * 512; i++) x[i] = frand();
    float *xd = dev_from(x, (size_t)K * 512 * 4);
    const char *only = getenv("BATON_BENCH_TYPES"); /* e.g. "Q4_1,Q8_0": those types alone */
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const bt_ggml_type_info *inf = bt_ggml_type_get(types[ti]);
        if (only && !test_list_has(only, bt_ggml_type_name(types[ti]))) continue;
        size_t rowb = (size_t)(K / inf->block_elems) * inf->block_bytes;
        int64_t N = (int64_t)((big / nm) / rowb) / 64 * 64;
        size_t wb;
        uint8_t *w = rand_weight(types[ti], K, N, &wb);
        bt_weight W[4];
        for (int i = 0; i < nm; i++) {
            gpu->ops->buf_set(gpu, (uint8_t *)a + (size_t)i * wb, w, wb);
            W[i] = (bt_weight){.type = types[ti], .n_in = K, .n_out = N, .data = (uint8_t *)a + (size_t)i * wb};
        }
        free(w);
        float *od = dev_from(NULL, (size_t)N * 512 * 4);
        if (!od) return 1;
        static const int32_t decode_rows[] = {1, 16};
        for (size_t di = 0; di < 2; di++) {
            int32_t M = decode_rows[di];
            gpu->ops->matmul(gpu, &W[0], NULL, xd, M, od);
            sync_gpu(od);
            int reps = 5;
            t0 = now_s();
            for (int r = 0; r < reps; r++)
                for (int i = 0; i < nm; i++) gpu->ops->matmul(gpu, &W[i], NULL, xd, M, od);
            sync_gpu(od);
            double dt = now_s() - t0, bw = (double)wb * nm * reps / dt;
            printf("bench decode %-5s %2d rows: %.1f GB/s of weights = %.1f%% of copy bandwidth (%.3f ms per "
                   "%lld x %lld matrix, %.0f MB)\n", bt_ggml_type_name(types[ti]), M, bw / 1e9, 100.0 * bw / copy_bw,
                   dt / reps / nm * 1e3, (long long)N, (long long)K, (double)wb / 1e6);
        }
        int32_t M = 512;
        gpu->ops->matmul(gpu, &W[0], NULL, xd, M, od);
        sync_gpu(od);
        t0 = now_s();
        for (int i = 0; i < nm; i++) gpu->ops->matmul(gpu, &W[i], NULL, xd, M, od);
        sync_gpu(od);
        double dt = now_s() - t0;
        double tf = 2.0 * M * (double)N * K * nm / dt / 1e12;
        printf("bench prefill %-5s: %.1f TFLOP/s at %d rows = %.1f%% of the measured mma rate (datasheet dense f16: "
               "~989)\n", bt_ggml_type_name(types[ti]), tf, M, peak > 0 ? 100.0 * tf / peak : 0.0);
        gpu->ops->buf_free(gpu, od);
    }
    gpu->ops->buf_free(gpu, xd), gpu->ops->buf_free(gpu, a);
    free(x);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* lines in order with stderr's when both go to one file */
    int device = 0;
    const char *d = getenv("BATON_CUDA_DEVICE");
    if (d && *d) device = atoi(d);
    /* BATON_TEST_CUDA_AS_CPU=1 (ctest's test_backend_cuda_harness): a second CPU backend stands in for the GPU, so
     * that this file's own logic (shapes, bounds, the invariance and scheduler checks) runs where no GPU is */
    const char *as_cpu = getenv("BATON_TEST_CUDA_AS_CPU");
    if (as_cpu && !strcmp(as_cpu, "1")) {
        if (bt_backend_cpu_create(NULL, &gpu) != BT_OK) return 1;
        if (argc > 1 && !strcmp(argv[1], "--bench")) return 0;
    } else if (bt_backend_cuda_create(device, &gpu) != BT_OK) {
        printf("SKIP: no CUDA device: %s\n", bt_last_error());
        return TEST_SKIPPED;
    }
    if (bt_backend_cpu_create(NULL, &cpu) != BT_OK) return 1;
    if (argc > 1 && !strcmp(argv[1], "--bench")) {
        int rc = bench();
        bt_backend_destroy(gpu);
        bt_backend_destroy(cpu);
        return rc;
    }
    /* names on the command line pick groups (tools/gpu-check.sh runs each in its own process: a crash in one
     * leaves the others' results) */
    static const struct { const char *name; void (*fn)(void); } groups[] = {
        {"embed", test_embed}, {"elementwise", test_elementwise}, {"matmul", test_matmul},
        {"matmul", test_matmul_large},
        {"attention", test_attention}, {"forward", test_forward}, {"invariance", test_batch_invariance},
        {"model", test_real_model}, {"scheduler", test_scheduler}, {"speed", test_speed},
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        int want = argc < 2;
        for (int i = 1; i < argc; i++) want |= !strcmp(argv[i], groups[g].name);
        if (!want) continue;
        int before = test_failures;
        groups[g].fn();
        fprintf(stderr, "%s test_%s\n", test_failures == before ? "ok  " : "FAIL", groups[g].name);
    }
    bt_backend_destroy(gpu);
    bt_backend_destroy(cpu);
    return test_summary();
}
