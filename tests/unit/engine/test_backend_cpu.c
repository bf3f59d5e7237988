/* engine/backend_cpu.c, the attention op over long contexts, where each token's keys are reduced in segments of 256
 * positions and merged: results against float64 softmax attention, and bit-identical however the tokens are
 * batched (one per call, prompt chunks at any offset, mixed with another sequence) and on 1 or 2 threads; the same
 * with a sliding window (bt_attn_args.window: keys k with p - k < window) that starts inside blocks and segments;
 * and the per-row and elementwise ops, the same bits on 1, 2 and 3 threads; rope with alternating parameter sets;
 * host_tasks runs each part once. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/backend_cpu.h"
#include "engine/cpu/cpu_fp16.h"
#include "engine/kv_pool.h"
#include "test_engine_env.h"
#include "test_util.h"

#define N_HEAD 6
#define N_KV 2
#define HD_MAX 256
static int32_t HD = 64; /* the fixture's head size: 64, and other sizes in test_head_size_* */
#define LEN 700 /* 44 blocks: three segments of 16 blocks */
#define ROW (N_HEAD * HD)

typedef struct fixture {
    int32_t window; /* bt_attn_args.window of every call */
    bt_hparams hp;
    bt_kv_pool *kv;
    bt_backend *be[2]; /* 1 and 2 threads */
    int32_t table[2][64];
    float *k[2], *v[2]; /* [LEN][N_KV][HD] as written */
    float *q[2];        /* [LEN][N_HEAD][HD] */
} fixture;

static int fixture_open(fixture *f, bt_kv_dtype dtype, uint64_t seed)
{
    memset(f, 0, sizeof *f);
    f->hp.n_layer = 1, f->hp.n_head = N_HEAD, f->hp.n_head_kv = N_KV, f->hp.head_dim = HD;
    size_t per_block = bt_kv_block_stride(&f->hp, dtype);
    if (bt_kv_pool_create(&f->hp, dtype, per_block * 128, NULL, &f->kv)) return -1;
    if (test_backend_cpu(1, &f->be[0]) || test_backend_cpu(2, &f->be[1])) return -1;
    int32_t nb = (LEN + BT_KV_BLOCK - 1) / BT_KV_BLOCK, ids[128];
    if (bt_kv_pool_alloc(f->kv, 2 * nb, ids)) return -1;
    for (int i = 2 * nb - 1; i > 0; i--) { /* tables scattered over the pool, interleaved */
        int j = (int)(test_rand_next(&seed) % (uint64_t)(i + 1));
        int32_t t = ids[i];
        ids[i] = ids[j], ids[j] = t;
    }
    for (int s = 0; s < 2; s++) {
        for (int32_t b = 0; b < nb; b++) f->table[s][b] = ids[2 * b + s];
        f->k[s] = malloc(sizeof(float) * LEN * N_KV * HD);
        f->v[s] = malloc(sizeof(float) * LEN * N_KV * HD);
        f->q[s] = malloc(sizeof(float) * LEN * ROW);
        if (!f->k[s] || !f->v[s] || !f->q[s]) return -1;
        for (int i = 0; i < LEN * N_KV * HD; i++) {
            f->k[s][i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 2e-3f;
            f->v[s][i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 1e-3f;
        }
        for (int i = 0; i < LEN * ROW; i++) f->q[s][i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 2e-3f;
        int32_t slots[LEN];
        for (int32_t p = 0; p < LEN; p++) slots[p] = f->table[s][p / BT_KV_BLOCK] * BT_KV_BLOCK + p % BT_KV_BLOCK;
        f->be[0]->ops->kv_write(f->be[0], f->kv, 0, f->k[s], f->v[s], LEN, slots);
    }
    return 0;
}

static void fixture_close(fixture *f)
{
    for (int i = 0; i < 2; i++) {
        if (f->be[i]) bt_backend_destroy(f->be[i]);
        free(f->k[i]), free(f->v[i]), free(f->q[i]);
    }
    bt_kv_pool_destroy(f->kv);
}

/* Attention of n tokens (sequence seq[i], position pos[i]) on backend be, out [n][ROW]. */
static bt_status attend(fixture *f, bt_backend *be, int n, const int *seq, const int32_t *pos, float *out)
{
    float *q = malloc(sizeof(float) * (size_t)n * ROW);
    const int32_t **tables = malloc(sizeof *tables * (size_t)n);
    if (!q || !tables) return BT_ERR_NOMEM;
    for (int i = 0; i < n; i++) {
        memcpy(q + (size_t)i * ROW, f->q[seq[i]] + (size_t)pos[i] * ROW, sizeof(float) * ROW);
        tables[i] = f->table[seq[i]];
    }
    bt_attn_args a = {.kv = f->kv, .layer = 0, .n_tokens = n, .n_head = N_HEAD, .n_head_kv = N_KV, .head_dim = HD,
                      .scale = 0.125f, .window = f->window, .q = q, .pos = pos, .tables = tables, .out = out};
    bt_status st = be->ops->attention(be, &a);
    free(q);
    free(tables);
    return st;
}

/* The K or V element as stored: f16 rounds, f32 keeps it */
static double stored(bt_kv_dtype dtype, float x)
{
    return dtype == BT_KV_F16 ? (double)bt_fp16_to_f32(bt_f32_to_fp16(x)) : (double)x;
}

static void check_dtype(bt_kv_dtype dtype, int32_t window)
{
    fixture f;
    REQUIRE(fixture_open(&f, dtype, 0x5eed + (uint64_t)dtype + (uint64_t)window) == 0);
    f.window = window;
    float *ref = malloc(sizeof(float) * LEN * ROW), *got = malloc(sizeof(float) * LEN * ROW);
    REQUIRE(ref && got);
    /* one token per call on 1 thread: the decode path */
    for (int32_t p = 0; p < LEN; p++) {
        int sq = 0;
        REQUIRE(attend(&f, f.be[0], 1, &sq, &p, ref + (size_t)p * ROW) == BT_OK);
    }
    /* float64 attention at positions around the segment edges (f32 and f16: exact stored values) */
    static const int32_t probe[] = {0, 7, 255, 256, 257, 300, 511, 512, 513, 699};
    double worst = 0;
    for (size_t pi = 0; dtype != BT_KV_INT8 && pi < sizeof probe / sizeof probe[0]; pi++) {
        int32_t p = probe[pi];
        for (int h = 0; h < N_HEAD; h++) {
            int g = h / (N_HEAD / N_KV);
            const float *qh = f.q[0] + (size_t)p * ROW + (size_t)h * HD;
            double *w = malloc(sizeof(double) * (size_t)(p + 1)), mx = -INFINITY, sum = 0;
            REQUIRE(w);
            int32_t j0 = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0; /* the first key in the window */
            for (int32_t j = j0; j <= p; j++) {
                double d = 0;
                for (int i = 0; i < HD; i++) d += (double)qh[i] * stored(dtype, f.k[0][((size_t)j * N_KV + g) * HD + i]);
                w[j] = d * 0.125;
                mx = w[j] > mx ? w[j] : mx;
            }
            for (int32_t j = j0; j <= p; j++) sum += (w[j] = exp(w[j] - mx));
            for (int i = 0; i < HD; i++) {
                double o = 0;
                for (int32_t j = j0; j <= p; j++) o += w[j] * stored(dtype, f.v[0][((size_t)j * N_KV + g) * HD + i]);
                o /= sum;
                double err = fabs(o - (double)ref[(size_t)p * ROW + (size_t)h * HD + (size_t)i]);
                worst = err > worst ? err : worst;
            }
            free(w);
        }
    }
    CHECK_MSG(worst < 2e-6, "%s head size %d window %d: max abs error %g against float64", bt_kv_dtype_name(dtype), HD,
              window, worst);
    /* prompt chunks of several sizes and offsets (runs straddle the segment edges), on 1 and 2 threads; calls of
     * 5 and 8 tokens on 2 threads are cut into shorter runs (attn_chunk: too few tasks per thread), as a
     * verification step's token and drafts are */
    static const int32_t chunks[][2] = {{LEN, 0}, {64, 0}, {37, 4}, {8, 252}, {5, 3}, {150, 100}};
    for (int bi = 0; bi < 2; bi++)
        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
            int32_t chunk = chunks[ci][0], start = chunks[ci][1], pos[LEN];
            int seqs[LEN] = {0};
            if (start > 0) { /* the tokens before the first chunk, one call */
                for (int32_t i = 0; i < start; i++) pos[i] = i;
                REQUIRE(attend(&f, f.be[bi], start, seqs, pos, got) == BT_OK);
            }
            for (int32_t done = start; done < LEN; done += chunk) {
                int32_t n = LEN - done < chunk ? LEN - done : chunk;
                for (int32_t i = 0; i < n; i++) pos[i] = done + i;
                REQUIRE(attend(&f, f.be[bi], n, seqs, pos, got + (size_t)done * ROW) == BT_OK);
            }
            CHECK_MSG(!memcmp(got + (size_t)start * ROW, ref + (size_t)start * ROW,
                              sizeof(float) * (size_t)(LEN - start) * ROW),
                      "%s head size %d window %d: chunks of %d from %d on %d thread(s) differ from one token per call",
                      bt_kv_dtype_name(dtype), HD, window, chunk, start, bi + 1);
        }
    /* mixed with the other sequence: runs of 1..9 tokens of each, alternating */
    float *mix = malloc(sizeof(float) * 2 * 9 * ROW);
    REQUIRE(mix);
    int32_t at[2] = {0, 0};
    int mismatch = 0;
    for (uint64_t s = 11; at[0] < LEN;) {
        int seqs[18];
        int32_t pos[18], n = 0;
        for (int sq = 0; sq < 2; sq++) {
            int32_t take = 1 + (int32_t)(test_rand_next(&s) % 9);
            for (int32_t t = 0; t < take && at[sq] < LEN; t++) seqs[n] = sq, pos[n++] = at[sq]++;
        }
        REQUIRE(attend(&f, f.be[1], n, seqs, pos, mix) == BT_OK);
        for (int32_t i = 0; i < n; i++)
            if (seqs[i] == 0 && memcmp(mix + (size_t)i * ROW, ref + (size_t)pos[i] * ROW, sizeof(float) * ROW))
                mismatch++;
    }
    CHECK_MSG(mismatch == 0, "%s: %d tokens differ when batched with another sequence", bt_kv_dtype_name(dtype),
              mismatch);
    free(mix);
    free(ref);
    free(got);
    fixture_close(&f);
}

static void test_long_context_attention(void)
{
    check_dtype(BT_KV_F32, 0);
    check_dtype(BT_KV_F16, 0);
    check_dtype(BT_KV_INT8, 0);
}

/* Windows that start mid-block (both: 300 and 100 are no multiple of 16), span segments (300: a token's window
 * crosses the 256-position edges), leave every earlier block (1: the token alone) and that exceed the context
 * (1000: the same bits as no window). Two dtype/window pairs only (f16, the default, and int8, whose per-row scales
 * move with the window's first row): under qemu (make test-neon) each check_dtype takes about 40 s. */
static void test_sliding_window_attention(void)
{
    check_dtype(BT_KV_F16, 300);
    check_dtype(BT_KV_INT8, 100);
    /* a window wider than the context changes nothing */
    fixture f;
    REQUIRE(fixture_open(&f, BT_KV_F16, 99) == 0);
    float *a = malloc(sizeof(float) * LEN * ROW), *b = malloc(sizeof(float) * LEN * ROW);
    int32_t pos[LEN];
    int seqs[LEN] = {0};
    REQUIRE(a && b);
    for (int32_t p = 0; p < LEN; p++) pos[p] = p;
    REQUIRE(attend(&f, f.be[1], LEN, seqs, pos, a) == BT_OK);
    f.window = 1000;
    REQUIRE(attend(&f, f.be[1], LEN, seqs, pos, b) == BT_OK);
    CHECK(!memcmp(a, b, sizeof(float) * LEN * ROW));
    /* and a window of 1 returns each token's own V */
    f.window = 1;
    REQUIRE(attend(&f, f.be[1], LEN, seqs, pos, b) == BT_OK);
    int bad = 0;
    for (int32_t p = 0; p < LEN; p++)
        for (int h = 0; h < N_HEAD; h++)
            for (int i = 0; i < HD; i++) {
                float v = f.v[0][((size_t)p * N_KV + (size_t)(h / (N_HEAD / N_KV))) * HD + (size_t)i];
                bad += fabsf(b[(size_t)p * ROW + (size_t)h * HD + (size_t)i] - bt_fp16_to_f32(bt_f32_to_fp16(v))) > 0;
            }
    CHECK_MSG(bad == 0, "window 1: %d outputs differ from the token's own value", bad);
    free(a);
    free(b);
    fixture_close(&f);
}

/* Sliding window (bt_attn_args.window): against float64 attention over the keys p - window < k <= p only, f32 KV */
static void test_window_attention(void)
{
    fixture f;
    REQUIRE(fixture_open(&f, BT_KV_F32, 0x77) == 0);
    static const int32_t windows[] = {1, 5, 100, 512};
    static const int32_t probe[] = {0, 3, 99, 300, 699};
    double worst = 0;
    float out[N_HEAD * HD_MAX];
    for (size_t wi = 0; wi < sizeof windows / sizeof windows[0]; wi++)
        for (size_t pi = 0; pi < sizeof probe / sizeof probe[0]; pi++) {
            int32_t p = probe[pi], win = windows[wi], k0 = p - win + 1 > 0 ? p - win + 1 : 0;
            const int32_t *tables[1] = {f.table[0]};
            bt_attn_args a = {.kv = f.kv, .layer = 0, .n_tokens = 1, .n_head = N_HEAD, .n_head_kv = N_KV,
                              .head_dim = HD, .scale = 0.125f, .window = win, .q = f.q[0] + (size_t)p * ROW, .pos = &p,
                              .tables = tables, .out = out};
            REQUIRE(f.be[0]->ops->attention(f.be[0], &a) == BT_OK);
            for (int h = 0; h < N_HEAD; h++) {
                int g = h / (N_HEAD / N_KV);
                const float *qh = f.q[0] + (size_t)p * ROW + (size_t)h * HD;
                double w[LEN], mx = -INFINITY, sum = 0;
                for (int32_t j = k0; j <= p; j++) {
                    double d = 0;
                    for (int i = 0; i < HD; i++) d += (double)qh[i] * f.k[0][((size_t)j * N_KV + g) * HD + i];
                    w[j] = d * 0.125;
                    mx = w[j] > mx ? w[j] : mx;
                }
                for (int32_t j = k0; j <= p; j++) sum += (w[j] = exp(w[j] - mx));
                for (int i = 0; i < HD; i++) {
                    double o = 0;
                    for (int32_t j = k0; j <= p; j++) o += w[j] * f.v[0][((size_t)j * N_KV + g) * HD + i];
                    double err = fabs(o / sum - (double)out[h * HD + i]);
                    worst = err > worst ? err : worst;
                }
            }
        }
    CHECK_MSG(worst < 2e-6, "window attention: max abs error %g against float64", worst);
    fixture_close(&f);
}

/* geglu against float64 gelu_tanh(g) * u (as g / (1 + exp(-2y)) * u: 0.5 g (1 + tanh(y)) cancels for g < 0), within
 * the kernel's bound (test_cpu_attn.c): 2e-6 of the value plus 1e-7 of |g u|, the negative tail's exp carrying the
 * float rounding of its argument */
static void test_geglu(void)
{
    bt_backend *be;
    REQUIRE(test_backend_cpu(1, &be) == 0);
    enum { N = 1000 };
    float g[N], u[N], out[N];
    uint64_t seed = 3;
    for (int i = 0; i < N; i++) {
        g[i] = (float)((int)(test_rand_next(&seed) % 20001) - 10000) * 1e-3f;
        u[i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 1e-3f;
    }
    be->ops->geglu(be, g, u, N, out);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        double x = g[i], y = sqrt(2 / M_PI) * (x + 0.044715 * x * x * x), ref = x / (1 + exp(-2 * y)) * u[i];
        bad += fabs(ref - out[i]) > 2e-6 * fabs(ref) + 1e-7 * fabs(x * u[i]) + 1e-30;
    }
    CHECK_MSG(bad == 0, "geglu: %d of %d values outside the bound", bad, N);
    bt_backend_destroy(be);
}

/* rmsnorm, swiglu, geglu and add of a prompt chunk's size run split over the threads (from 65,536 floats): the bits
 * of one thread's single call, for row counts and lengths that are no multiple of the split (301 rows of 576, and
 * 173,377 elements), on 2 and 3 threads; a decode step's size too. */
static void test_elementwise_split(void)
{
    bt_backend *be[3];
    for (int t = 0; t < 3; t++) REQUIRE(test_backend_cpu(t + 1, &be[t]) == 0);
    enum { ROWS = 301, E = 576, N = ROWS * E + 1 };
    float *x = malloc(sizeof(float) * N), *y = malloc(sizeof(float) * N), *w = malloc(sizeof(float) * E);
    float *ref = malloc(sizeof(float) * N), *out = malloc(sizeof(float) * N);
    REQUIRE(x && y && w && ref && out);
    uint64_t seed = 5;
    for (int i = 0; i < N; i++) {
        x[i] = (float)((int)(test_rand_next(&seed) % 20001) - 10000) * 1e-3f;
        y[i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 1e-3f;
    }
    for (int i = 0; i < E; i++) w[i] = 0.5f + (float)(test_rand_next(&seed) % 1000) * 1e-3f;
    static const int32_t row_counts[] = {ROWS, 3};
    static const char *const names[] = {"rmsnorm", "swiglu", "geglu", "add"};
    for (int op = 0; op < 4; op++)
        for (int rc = 0; rc < 2; rc++) {
            int32_t rows = row_counts[rc];
            int64_t n = rc == 0 ? N : (int64_t)rows * E;
            for (int t = 0; t < 3; t++) {
                float *o = t == 0 ? ref : out;
                if (op == 3) memcpy(o, x, sizeof(float) * (size_t)n);
                else memset(o, 0xff, sizeof(float) * (size_t)n); /* NaN: a value no split wrote */
                if (op == 0) be[t]->ops->rmsnorm(be[t], x, w, rows, E, 1e-5f, o);
                if (op == 1) be[t]->ops->swiglu(be[t], x, y, n, o);
                if (op == 2) be[t]->ops->geglu(be[t], x, y, n, o);
                if (op == 3) be[t]->ops->add(be[t], o, y, n);
                if (t == 0) continue;
                int bad = 0;
                for (int64_t i = 0; i < (op == 0 ? (int64_t)rows * E : n); i++) bad += bt_f32_bits(o[i]) != bt_f32_bits(ref[i]);
                CHECK_MSG(bad == 0, "%s, %d rows, %d threads: %d values differ from one thread", names[op], rows, t + 1,
                          bad);
            }
        }
    /* in place, as the forward pass norms q and k */
    memcpy(out, x, sizeof(float) * ROWS * E);
    be[1]->ops->rmsnorm(be[1], out, w, ROWS, E, 1e-5f, out);
    be[0]->ops->rmsnorm(be[0], x, w, ROWS, E, 1e-5f, ref);
    CHECK(memcmp(out, ref, sizeof(float) * ROWS * E) == 0);
    free(x), free(y), free(w), free(ref), free(out);
    for (int t = 0; t < 3; t++) bt_backend_destroy(be[t]);
}

/* host_tasks: every part runs exactly once, on the backend's threads (2 of them take part with 2 threads), and
 * host_threads says how many there are */
typedef struct host_job {
    _Atomic int runs[64];
    _Atomic long threads[64]; /* each part's thread id */
    int n;
} host_job;

static void host_part(void *user, int i, int n)
{
    host_job *j = user;
    if (n != j->n || i < 0 || i >= n) return;
    atomic_fetch_add(&j->runs[i], 1);
    atomic_store(&j->threads[i], (long)pthread_self());
    for (volatile int spin = 0; spin < 200000; spin++) { /* long enough that one thread cannot take every part */
    }
}

static void test_host_tasks(void)
{
    for (int t = 1; t <= 3; t++) {
        bt_backend *be = NULL;
        REQUIRE(test_backend_cpu(t, &be) == 0);
        REQUIRE(be->ops->host_tasks && be->ops->host_threads);
        CHECK_MSG(be->ops->host_threads(be) == t, "host_threads %d with %d threads", be->ops->host_threads(be), t);
        static const int counts[] = {1, 2, 7, 64};
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            static host_job j;
            memset(&j, 0, sizeof j);
            j.n = counts[c];
            be->ops->host_tasks(be, host_part, &j, j.n);
            int once = 0, distinct = 0;
            for (int i = 0; i < j.n; i++) {
                once += atomic_load(&j.runs[i]) == 1;
                int seen = 0;
                for (int k = 0; k < i; k++) seen |= atomic_load(&j.threads[k]) == atomic_load(&j.threads[i]);
                distinct += !seen;
            }
            CHECK_MSG(once == j.n, "%d threads, %d parts: %d ran exactly once", t, j.n, once);
            if (j.n == 64) CHECK_MSG(distinct >= (t < 2 ? 1 : 2), "%d threads, %d parts on %d threads", t, j.n, distinct);
        }
        bt_backend_destroy(be);
    }
}

/* rope with several parameter sets in turn (as Gemma 3's local and global layers): each call gives the bits of a
 * fresh backend that only ever saw its set, for more sets than the backend keeps angle tables for (4), a wider
 * rotation after a narrower one, and positions past the first table size (1,024); and within float rounding of the
 * rotation in float64. */
static void test_rope_parameter_sets(void)
{
    static const struct {
        int32_t head_dim, n_rot;
        float base, freq_scale;
        int neox;
    } sets[] = {/* 0 and 1 differ in base alone (Gemma 3's two kinds of layer), 0 and 4 in freq_scale alone, 0 and 2
                 * in n_rot (and layout); 7 sets against the backend's 4 tables */
                {64, 64, 10000.0f, 1.0f, 1},    {64, 64, 1000000.0f, 1.0f, 1},  {64, 32, 10000.0f, 1.0f, 0},
                {128, 128, 500000.0f, 1.0f, 0}, {64, 64, 10000.0f, 0.5f, 1},    {128, 96, 10000.0f, 1.0f, 1},
                {64, 64, 1000000.0f, 0.125f, 1}};
    enum { NS = sizeof sets / sizeof sets[0], T = 5, H = 3, MAXD = 128 };
    static const int32_t pos[T] = {0, 7, 1023, 1024, 4999};
    bt_backend *shared;
    REQUIRE(test_backend_cpu(1, &shared) == 0);
    float x[T * H * MAXD], got[T * H * MAXD], want[T * H * MAXD];
    uint64_t seed = 11;
    for (int i = 0; i < T * H * MAXD; i++) x[i] = (float)((int)(test_rand_next(&seed) % 2001) - 1000) * 1e-3f;
    for (int round = 0; round < 3; round++)
        for (int si = 0; si < NS; si++) {
            int s = round == 1 ? NS - 1 - si : si; /* the second round in reverse order */
            int32_t hd = sets[s].head_dim, n = T * H * hd;
            memcpy(got, x, sizeof(float) * (size_t)n);
            shared->ops->rope(shared, got, pos, T, H, hd, sets[s].n_rot, sets[s].base, sets[s].freq_scale,
                              sets[s].neox);
            bt_backend *fresh;
            REQUIRE(test_backend_cpu(1, &fresh) == 0);
            memcpy(want, x, sizeof(float) * (size_t)n);
            fresh->ops->rope(fresh, want, pos, T, H, hd, sets[s].n_rot, sets[s].base, sets[s].freq_scale,
                             sets[s].neox);
            bt_backend_destroy(fresh);
            CHECK_MSG(memcmp(got, want, sizeof(float) * (size_t)n) == 0, "rope set %d (round %d): bits differ from a "
                      "fresh backend", s, round);
            int bad = 0;
            for (int t = 0; t < T; t++)
                for (int h = 0; h < H; h++)
                    for (int32_t i = 0; i < sets[s].n_rot / 2; i++) {
                        const float *v = x + ((size_t)t * H + (size_t)h) * (size_t)hd;
                        const float *o = got + ((size_t)t * H + (size_t)h) * (size_t)hd;
                        int32_t a = sets[s].neox ? i : 2 * i, b = sets[s].neox ? i + sets[s].n_rot / 2 : 2 * i + 1;
                        double ang = (double)pos[t] * sets[s].freq_scale *
                                     pow((double)sets[s].base, -2.0 * i / sets[s].n_rot);
                        double r0 = v[a] * cos(ang) - v[b] * sin(ang), r1 = v[a] * sin(ang) + v[b] * cos(ang);
                        bad += fabs(o[a] - r0) > 1e-6 || fabs(o[b] - r1) > 1e-6;
                    }
            CHECK_MSG(bad == 0, "rope set %d (round %d): %d values off the float64 rotation", s, round, bad);
            int moved = 0; /* dims past n_rot stay as they were */
            for (int t = 0; t < T * H; t++)
                for (int32_t i = sets[s].n_rot; i < hd; i++) moved += got[(size_t)t * (size_t)hd + (size_t)i] !=
                                                                      x[(size_t)t * (size_t)hd + (size_t)i];
            CHECK_MSG(moved == 0, "rope set %d: %d unrotated values changed", s, moved);
        }
    bt_backend_destroy(shared);
}

/* Other head sizes on f16, whose prompt runs the backend widens to f32 once per block (ATTN_WIDEN_MIN): 80 (not a
 * multiple of 16: the 16-lane kernels hand it to the scalar reference) and 256 (the largest, Gemma 3's). */
static void check_head_size(int32_t hd)
{
    HD = hd;
    check_dtype(BT_KV_F16, 0);
    check_dtype(BT_KV_F16, 300);
    HD = 64;
}

static void test_head_size_80(void)
{
    check_head_size(80);
}

static void test_head_size_256(void)
{
    check_head_size(HD_MAX);
}

int main(void)
{
    RUN(test_long_context_attention);
    RUN(test_sliding_window_attention);
    RUN(test_window_attention);
    RUN(test_head_size_80);
    RUN(test_head_size_256);
    RUN(test_geglu);
    RUN(test_rope_parameter_sets);
    RUN(test_elementwise_split);
    RUN(test_host_tasks);
    return test_summary();
}
