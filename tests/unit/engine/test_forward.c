/* engine/model.c, engine/forward.c, engine/backend_cpu.c, engine/kv_pool.c on tiny random models:
 * batch invariance (alone vs batched with 7 others, chunks of 1/7/64), decode steps on lanes, ISA agreement, bad
 * input. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/backend_cpu.h"
#include "engine/forward.h"
#include "engine/ggml_type.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "test_isa.h"
#include "test_engine_env.h"
#include "test_util.h"
#include "tiny_model.h"

typedef struct env {
    bt_model *m;
    bt_backend *be;
    bt_forward *fw;
    bt_kv_pool *kv;
} env;

static int env_open(env *e, const char *path, int threads, int max_tokens)
{
    memset(e, 0, sizeof *e);
    if (bt_model_load(path, &e->m)) return -1;
    if (test_backend_cpu(threads, &e->be)) return -1;
    if (bt_forward_create(e->m, e->be, max_tokens, 0, &e->fw)) return -1;
    size_t per_block = bt_kv_block_stride(&e->m->hp, BT_KV_F16) * (size_t)e->m->hp.n_layer;
    if (bt_kv_pool_create(&e->m->hp, BT_KV_F16, per_block * 256, NULL, &e->kv)) return -1;
    return 0;
}

static void env_close(env *e)
{
    bt_kv_pool_destroy(e->kv);
    bt_forward_destroy(e->fw);
    bt_backend_destroy(e->be);
    bt_model_free(e->m);
}

static const char *tiny_path(const char *name, tiny_model_opts *o)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", test_tmpdir(), name);
    if (tiny_model_write(path, o) != 0) return NULL;
    return path;
}

/* A sequence: tokens, its own blocks, logits of every position. */
typedef struct seq {
    int32_t len;
    int32_t tokens[200];
    int32_t table[16];
    int32_t n_blocks;
    float *logits; /* [len][n_vocab] */
} seq;

static void seq_make(seq *s, env *e, int32_t len, uint64_t seed)
{
    s->len = len;
    for (int32_t i = 0; i < len; i++) s->tokens[i] = (int32_t)(test_rand_next(&seed) % (uint64_t)e->m->hp.n_vocab);
    s->n_blocks = (len + BT_KV_BLOCK - 1) / BT_KV_BLOCK;
    bt_kv_pool_alloc(e->kv, s->n_blocks, s->table);
    s->logits = calloc((size_t)len * (size_t)e->m->hp.n_vocab, sizeof(float));
}

static void seq_free(seq *s, env *e)
{
    bt_kv_pool_release(e->kv, s->n_blocks, s->table);
    free(s->logits);
}

/* Feeds s alone in chunks of `chunk`, logits of every position into s->logits. */
static int run_alone(env *e, seq *s, int32_t chunk)
{
    int32_t V = e->m->hp.n_vocab;
    bt_seq_view sv = {.block_table = s->table, .n_blocks = s->n_blocks};
    for (int32_t done = 0; done < s->len; done += chunk) {
        int32_t n = s->len - done < chunk ? s->len - done : chunk;
        int32_t pos[256], sq[256], rows[256];
        for (int32_t i = 0; i < n; i++) {
            pos[i] = done + i;
            sq[i] = 0;
            rows[i] = i;
        }
        bt_batch b = {n, s->tokens + done, pos, sq, &sv, 1, rows, n, NULL, 0, NULL};
        if (bt_forward_run(e->fw, e->kv, &b, s->logits + (size_t)done * (size_t)V)) return -1;
    }
    return 0;
}

/* Feeds 8 sequences step by step in mixed batches: each step takes up to 5 tokens of each unfinished sequence
 * (so sequences are at different positions and lengths), in an order that rotates every step. */
static int run_mixed(env *e, seq *ss, int n)
{
    int32_t V = e->m->hp.n_vocab;
    int32_t done[8] = {0};
    bt_seq_view sv[8];
    for (int i = 0; i < n; i++) sv[i] = (bt_seq_view){.block_table = ss[i].table, .n_blocks = ss[i].n_blocks};
    float *out = malloc(sizeof(float) * 64 * (size_t)V);
    int rc = 0;
    for (int step = 0;; step++) {
        int32_t tok[64], pos[64], sq[64], rows[64], who[64], at[64];
        int32_t nt = 0;
        for (int k = 0; k < n; k++) {
            int i = (k + step) % n;
            int32_t take = 1 + (i + step) % 5;
            for (int32_t t = 0; t < take && done[i] < ss[i].len; t++) {
                tok[nt] = ss[i].tokens[done[i]];
                pos[nt] = done[i];
                sq[nt] = i;
                rows[nt] = nt;
                who[nt] = i;
                at[nt] = done[i];
                done[i]++;
                nt++;
            }
        }
        if (nt == 0) break;
        bt_batch b = {nt, tok, pos, sq, sv, n, rows, nt, NULL, 0, NULL};
        if (bt_forward_run(e->fw, e->kv, &b, out)) {
            rc = -1;
            break;
        }
        for (int32_t r = 0; r < nt; r++)
            memcpy(ss[who[r]].logits + (size_t)at[r] * (size_t)V, out + (size_t)r * (size_t)V, sizeof(float) * (size_t)V);
    }
    free(out);
    return rc;
}

static void test_batch_invariance(void)
{
    tiny_model_opts o = {0};
    const char *path = tiny_path("inv", &o);
    REQUIRE(path != NULL);
    env e;
    REQUIRE(env_open(&e, path, 2, 64) == 0);
    int32_t V = e.m->hp.n_vocab;
    int32_t lens[8] = {100, 37, 5, 64, 1, 90, 17, 33};
    seq alone[8], mixed[8];
    for (int i = 0; i < 8; i++) {
        seq_make(&alone[i], &e, lens[i], 1000 + (uint64_t)i);
        seq_make(&mixed[i], &e, lens[i], 1000 + (uint64_t)i);
    }
    for (int i = 0; i < 8; i++) REQUIRE(run_alone(&e, &alone[i], 64) == 0);
    REQUIRE(run_mixed(&e, mixed, 8) == 0);
    for (int i = 0; i < 8; i++)
        CHECK_MSG(memcmp(alone[i].logits, mixed[i].logits, sizeof(float) * (size_t)lens[i] * (size_t)V) == 0,
                  "sequence %d: batched logits differ from alone", i);
    /* chunks of 1, 7 and 64 tokens give the same bits as one 100-token batch */
    seq ref;
    seq_make(&ref, &e, 100, 1000);
    bt_forward_destroy(e.fw);
    REQUIRE(bt_forward_create(e.m, e.be, 128, 0, &e.fw) == BT_OK);
    REQUIRE(run_alone(&e, &ref, 100) == 0);
    int32_t chunks[3] = {1, 7, 64};
    for (int c = 0; c < 3; c++) {
        REQUIRE(run_alone(&e, &alone[0], chunks[c]) == 0);
        CHECK_MSG(memcmp(ref.logits, alone[0].logits, sizeof(float) * 100 * (size_t)V) == 0, "chunk %d differs",
                  chunks[c]);
    }
    /* thread count does not change the bits either */
    bt_backend *be1;
    REQUIRE(test_backend_cpu(1, &be1) == BT_OK);
    bt_forward *fw1;
    REQUIRE(bt_forward_create(e.m, be1, 64, 0, &fw1) == BT_OK);
    bt_forward *keep = e.fw;
    e.fw = fw1;
    REQUIRE(run_alone(&e, &alone[0], 64) == 0);
    CHECK(memcmp(ref.logits, alone[0].logits, sizeof(float) * 100 * (size_t)V) == 0);
    e.fw = keep;
    bt_forward_destroy(fw1);
    bt_backend_destroy(be1);
    seq_free(&ref, &e);
    for (int i = 0; i < 8; i++) {
        seq_free(&alone[i], &e);
        seq_free(&mixed[i], &e);
    }
    CHECK(e.kv->n_free == e.kv->n_blocks);
    env_close(&e);
}

/* Decode steps of 16 sequences (one token each, at different positions) run split over the backend's lanes, and give
 * the bits each sequence gets fed one token at a time alone (never on lanes): with 2 lanes and, on 3 threads, with 3
 * lanes of unequal size; BATON_CPU_LANES=0 keeps them whole (same bits). */
static void test_lanes(void)
{
    enum { NS = 16, D = 6 };
    tiny_model_opts o = {0};
    const char *path = tiny_path("lanes", &o);
    REQUIRE(path != NULL);
    bt_backend *bad = NULL;
    setenv("BATON_CPU_LANES", "2", 1);
    CHECK(test_backend_cpu(2, &bad) == BT_ERR_INVALID && bad == NULL);
    CHECK(strstr(bt_last_error(), "BATON_CPU_LANES") != NULL);
    unsetenv("BATON_CPU_LANES");
    for (int cfg = 0; cfg < 3; cfg++) {
        int threads = cfg == 1 ? 3 : 2, lanes_off = cfg == 2;
        if (lanes_off) setenv("BATON_CPU_LANES", "0", 1);
        env e;
        REQUIRE(env_open(&e, path, threads, 64) == 0);
        unsetenv("BATON_CPU_LANES");
        int32_t V = e.m->hp.n_vocab;
        seq lane[NS], solo[NS];
        bt_seq_view sv[NS];
        for (int i = 0; i < NS; i++) {
            int32_t len = 20 + 3 * i;
            seq_make(&lane[i], &e, len, 500 + (uint64_t)i);
            seq_make(&solo[i], &e, len, 500 + (uint64_t)i);
            sv[i] = (bt_seq_view){.block_table = lane[i].table, .n_blocks = lane[i].n_blocks};
            REQUIRE(run_alone(&e, &solo[i], 1) == 0);
            seq pre = lane[i];
            pre.len = len - D; /* the prompt, then D decode steps of all sequences together */
            REQUIRE(run_alone(&e, &pre, 7) == 0);
        }
        CHECK(bt_forward_lane_steps(e.fw) == 0);
        float *out = malloc(sizeof(float) * NS * (size_t)V);
        REQUIRE(out != NULL);
        for (int d = 0; d < D; d++) {
            int32_t tok[NS], pos[NS], sq[NS], rows[NS];
            for (int i = 0; i < NS; i++) {
                pos[i] = lane[i].len - D + d;
                tok[i] = lane[i].tokens[pos[i]];
                sq[i] = rows[i] = i;
            }
            bt_batch b = {NS, tok, pos, sq, sv, NS, rows, NS, NULL, 0, NULL};
            REQUIRE(bt_forward_run(e.fw, e.kv, &b, out) == BT_OK);
            for (int i = 0; i < NS; i++)
                memcpy(lane[i].logits + (size_t)pos[i] * (size_t)V, out + (size_t)i * (size_t)V, sizeof(float) * (size_t)V);
        }
        CHECK_MSG(bt_forward_lane_steps(e.fw) == (lanes_off ? 0 : D), "%d threads: %lld of %d steps on lanes", threads,
                  (long long)bt_forward_lane_steps(e.fw), D);
        for (int i = 0; i < NS; i++) {
            size_t off = (size_t)(lane[i].len - D) * (size_t)V;
            CHECK_MSG(memcmp(lane[i].logits + off, solo[i].logits + off, sizeof(float) * D * (size_t)V) == 0,
                      "%d threads, sequence %d: logits on lanes differ from alone", threads, i);
            seq_free(&lane[i], &e);
            seq_free(&solo[i], &e);
        }
        free(out);
        CHECK(e.kv->n_free == e.kv->n_blocks);
        env_close(&e);
    }
}

/* Decode steps that verify speculative drafts: 16 sequences, sequence i feeding its last 1 + (i + d) % 4 tokens, every
 * token with its logits, still run on lanes (a sequence's rows on one lane) and give each sequence's solo bits. */
static void test_lanes_multi_row(void)
{
    enum { NS = 16, D = 3, R = 4 };
    tiny_model_opts o = {0};
    const char *path = tiny_path("lanes-multi", &o);
    REQUIRE(path != NULL);
    for (int threads = 2; threads <= 3; threads++) {
        env e;
        REQUIRE(env_open(&e, path, threads, 128) == 0);
        int32_t V = e.m->hp.n_vocab;
        seq lane[NS], solo[NS];
        bt_seq_view sv[NS];
        int32_t fed[NS];
        for (int i = 0; i < NS; i++) {
            int32_t len = 30 + 5 * i;
            seq_make(&lane[i], &e, len, 900 + (uint64_t)i);
            seq_make(&solo[i], &e, len, 900 + (uint64_t)i);
            sv[i] = (bt_seq_view){.block_table = lane[i].table, .n_blocks = lane[i].n_blocks};
            REQUIRE(run_alone(&e, &solo[i], 1) == 0);
            seq pre = lane[i];
            pre.len = len - D * R;
            REQUIRE(run_alone(&e, &pre, 7) == 0);
            fed[i] = pre.len;
        }
        int64_t lanes0 = bt_forward_lane_steps(e.fw);
        float *out = malloc(sizeof(float) * NS * R * (size_t)V);
        REQUIRE(out != NULL);
        for (int d = 0; d < D; d++) {
            int32_t tok[NS * R], pos[NS * R], sq[NS * R], rows[NS * R], nt = 0;
            for (int i = 0; i < NS; i++) {
                int32_t r = 1 + (i + d) % R;
                for (int32_t k = 0; k < r; k++, nt++) {
                    pos[nt] = fed[i] + k;
                    tok[nt] = lane[i].tokens[pos[nt]];
                    sq[nt] = i;
                    rows[nt] = nt;
                }
                fed[i] += r;
            }
            bt_batch b = {nt, tok, pos, sq, sv, NS, rows, nt, NULL, 0, NULL};
            REQUIRE(bt_forward_run(e.fw, e.kv, &b, out) == BT_OK);
            for (int32_t t = 0; t < nt; t++)
                memcpy(lane[sq[t]].logits + (size_t)pos[t] * (size_t)V, out + (size_t)t * (size_t)V,
                       sizeof(float) * (size_t)V);
        }
        CHECK_MSG(bt_forward_lane_steps(e.fw) - lanes0 == D, "%d threads: %lld of %d steps on lanes", threads,
                  (long long)(bt_forward_lane_steps(e.fw) - lanes0), D);
        for (int i = 0; i < NS; i++) {
            int32_t from = lane[i].len - D * R, to = fed[i];
            size_t off = (size_t)from * (size_t)V;
            CHECK_MSG(memcmp(lane[i].logits + off, solo[i].logits + off, sizeof(float) * (size_t)(to - from) * (size_t)V) == 0,
                      "%d threads, sequence %d: multi-row logits on lanes differ from alone", threads, i);
            seq_free(&lane[i], &e);
            seq_free(&solo[i], &e);
        }
        free(out);
        env_close(&e);
    }
}

/* Logits of a 40-token prompt on the tiny model at path, with BATON_CPU_ISA=isa; NULL on error. */
static float *isa_logits(const char *path, const char *isa, int32_t *V)
{
    setenv("BATON_CPU_ISA", isa, 1);
    env e;
    if (env_open(&e, path, 2, 64) != 0) return NULL;
    *V = e.m->hp.n_vocab;
    seq s;
    seq_make(&s, &e, 40, 7);
    float *res = run_alone(&e, &s, 64) == 0 ? s.logits : NULL;
    if (!res) free(s.logits);
    s.logits = NULL;
    seq_free(&s, &e);
    env_close(&e);
    return res;
}

/* Each covered SIMD ISA agrees with the scalar reference within quantization-order tolerance, for several weight
 * types (the scalar entry has no SIMD path to compare: the avx2 and avx512 entries run this), and avx2-vnni gives
 * avx2's logits bit for bit. */
static void test_isa_agreement(void)
{
    uint32_t types[] = {BT_TYPE_Q4_1, BT_TYPE_Q8_0, BT_TYPE_Q4_0, BT_TYPE_Q5_0, BT_TYPE_Q5_1, BT_TYPE_Q4_K, BT_TYPE_Q5_K,
                        BT_TYPE_Q6_K, BT_TYPE_F16};
    const char *entry = getenv("BATON_CPU_ISA");
    char keep[16] = "";
    if (entry) snprintf(keep, sizeof keep, "%s", entry);
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        const char *name = bt_cpu_isa_name((bt_cpu_isa)isa);
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
            tiny_model_opts o = {.matrix_type = types[t], .n_embd = 256, .n_head = 4, .n_ff = 256, .tied = 0};
            const char *path = tiny_path("isa", &o);
            REQUIRE(path != NULL);
            int32_t V = 0;
            float *ref = isa_logits(path, "scalar", &V), *got = isa_logits(path, name, &V);
            REQUIRE(ref && got);
            /* Activations are re-quantized (16-bit) before every matmul, so a last-bit difference in float
             * accumulation order can flip a rounding and grow through the layers: compare in RMS, not bitwise.
             * Measured: up to 1.8e-4 (AVX2 Q4_1), 1e-4 (AVX-512 Q8_0), 0 for the K-quants; 1e-3 leaves 5x. */
            double d2 = 0, v2 = 0;
            for (size_t i = 0; i < (size_t)40 * (size_t)V; i++) {
                d2 += ((double)ref[i] - got[i]) * ((double)ref[i] - got[i]);
                v2 += (double)ref[i] * ref[i];
            }
            fprintf(stderr, "  %s %s: vs scalar relative RMS difference %.2e\n", name, bt_ggml_type_name(types[t]),
                    sqrt(d2 / v2));
            CHECK_MSG(sqrt(d2 / v2) < 1e-3, "%s %s: vs scalar relative RMS difference %g", name,
                      bt_ggml_type_name(types[t]), sqrt(d2 / v2));
            if (isa == BT_CPU_ISA_AVX2_VNNI) { /* the AVX2 kernels with other dot instructions: the same bits */
                float *avx2 = isa_logits(path, "avx2", &V);
                REQUIRE(avx2);
                CHECK_MSG(!memcmp(avx2, got, sizeof(float) * 40 * (size_t)V), "avx2-vnni %s: logits differ from avx2's",
                          bt_ggml_type_name(types[t]));
                free(avx2);
            }
            free(ref);
            free(got);
        }
    }
    if (entry)
        setenv("BATON_CPU_ISA", keep, 1);
    else
        unsetenv("BATON_CPU_ISA");
}

/* The kernel line a node and `baton bench` print: each weight type's count, path, and the packed copy's bytes against
 * the file's (Q5_K: AVX-512's plane variant 1.05x, the bytes of the other ISAs 1.59x; no packed kernels: row
 * kernels). */
static void test_describe(void)
{
    tiny_model_opts o = {.matrix_type = BT_TYPE_Q5_K, .n_embd = 256, .n_head = 4, .n_ff = 256, .tied = 0};
    const char *path = tiny_path("describe", &o);
    REQUIRE(path != NULL);
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!test_isa_covers((bt_cpu_isa)isa)) continue;
        bt_cpu_opts opts = {.n_threads = 1, .force_isa = 1, .isa = isa};
        bt_backend *be;
        REQUIRE(bt_backend_cpu_create(&opts, &be) == BT_OK);
        char line[512];
        bt_backend_cpu_describe(be, m, line, sizeof line);
        const char *want = isa == BT_CPU_ISA_SCALAR   ? "Q5_K x15 row kernels (no packed layout)"
                           : isa == BT_CPU_ISA_AVX512 ? "Q5_K x15 packed (1.05x the file's bytes)"
                                                      : "Q5_K x15 packed (1.59x the file's bytes)";
        CHECK_MSG(strstr(line, want) != NULL, "%s: '%s' lacks '%s'", bt_cpu_isa_name((bt_cpu_isa)isa), line, want);
        bt_backend_destroy(be);
    }
    bt_model_free(m);
}

static void test_bad_batches(void)
{
    tiny_model_opts o = {0};
    const char *path = tiny_path("bad", &o);
    REQUIRE(path != NULL);
    env e;
    REQUIRE(env_open(&e, path, 1, 8) == 0);
    int32_t table[2] = {0, 1}, bad_table[1] = {100000};
    bt_seq_view sv = {.block_table = table, .n_blocks = 2}, bsv = {.block_table = bad_table, .n_blocks = 1};
    int32_t tok[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, pos[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8}, sq[9] = {0}, rows[1] = {0};
    float logits[256];
    bt_batch b = {9, tok, pos, sq, &sv, 1, rows, 1, NULL, 0, NULL};
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_ERR_INVALID); /* more than max_tokens */
    b.n_tokens = 1;
    int32_t big = 256;
    b.tokens = &big;
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "token id 256") != NULL);
    b.tokens = tok;
    int32_t far = 32;
    b.pos = &far;
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_ERR_INVALID);
    b.pos = pos;
    b.seqs = &bsv;
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "outside the pool") != NULL);
    b.seqs = &sv;
    int32_t badrow = 3;
    b.logit_rows = &badrow;
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_ERR_INVALID);
    b.logit_rows = rows;
    CHECK(bt_forward_run(e.fw, e.kv, &b, logits) == BT_OK);
    for (int i = 0; i < 256; i++) CHECK(isfinite(logits[i]));
    int32_t ids[300];
    CHECK(bt_kv_pool_alloc(e.kv, e.kv->n_free + 1, ids) == BT_ERR_EXHAUSTED);
    env_close(&e);
}

/* gemma3 on a tiny model with a sliding window of 8 and every second layer global (sliding_window_pattern 2):
 * hyper-parameters and per-layer window and RoPE base as loaded; batch invariance (alone vs mixed batches, chunks of
 * 1, 7 and 64 vs one batch) across the window's edge; the window's meaning: positions < 8 see every key either way,
 * so they equal a model whose window exceeds the context, and later positions differ; load errors name the key or
 * tensor. */
static void test_gemma3(void)
{
    tiny_model_opts o = {.arch = "gemma3", .swa_window = 8, .swa_pattern = 2};
    const char *path = tiny_path("gemma3", &o);
    REQUIRE(path != NULL);
    env e;
    REQUIRE(env_open(&e, path, 2, 128) == 0);
    const bt_hparams *hp = &e.m->hp;
    CHECK(hp->gemma == 1 && hp->rope_neox == 1 && hp->swa_window == 8 && hp->swa_pattern == 2);
    CHECK(fabsf(hp->embd_scale - 8.0f) < 1e-6f && fabsf(hp->attn_scale - 0.25f) < 1e-7f); /* sqrt(64), 1/sqrt(16) */
    CHECK(e.m->layers[0].window == 8 && e.m->layers[0].rope_base == 10000.0f);
    CHECK(e.m->layers[1].window == 0 && e.m->layers[1].rope_base == 10000.0f);
    CHECK(e.m->layers[0].q_norm.data && e.m->layers[1].post_ffn_norm.data);
    int32_t V = hp->n_vocab;
    int32_t lens[8] = {100, 37, 5, 64, 1, 90, 17, 33};
    seq alone[8], mixed[8];
    for (int i = 0; i < 8; i++) {
        seq_make(&alone[i], &e, lens[i], 2000 + (uint64_t)i);
        seq_make(&mixed[i], &e, lens[i], 2000 + (uint64_t)i);
    }
    for (int i = 0; i < 8; i++) REQUIRE(run_alone(&e, &alone[i], 100) == 0);
    REQUIRE(run_mixed(&e, mixed, 8) == 0);
    for (int i = 0; i < 8; i++)
        CHECK_MSG(memcmp(alone[i].logits, mixed[i].logits, sizeof(float) * (size_t)lens[i] * (size_t)V) == 0,
                  "gemma3 sequence %d: batched logits differ from alone", i);
    seq ref;
    seq_make(&ref, &e, 100, 2000);
    REQUIRE(run_alone(&e, &ref, 100) == 0);
    int32_t chunks[3] = {1, 7, 64};
    for (int c = 0; c < 3; c++) {
        REQUIRE(run_alone(&e, &alone[0], chunks[c]) == 0);
        CHECK_MSG(memcmp(ref.logits, alone[0].logits, sizeof(float) * 100 * (size_t)V) == 0, "gemma3 chunk %d differs",
                  chunks[c]);
    }
    /* the same weights with a window wider than the context */
    tiny_model_opts wide = o;
    wide.swa_window = 1000;
    env w;
    REQUIRE(env_open(&w, tiny_path("gemma3-wide", &wide), 2, 128) == 0);
    seq ws;
    seq_make(&ws, &w, 100, 2000);
    REQUIRE(run_alone(&w, &ws, 100) == 0);
    CHECK(memcmp(ws.logits, ref.logits, sizeof(float) * 8 * (size_t)V) == 0);
    int differ = 0;
    for (int32_t p = 8; p < 100; p++)
        differ += memcmp(ws.logits + (size_t)p * V, ref.logits + (size_t)p * V, sizeof(float) * (size_t)V) != 0;
    CHECK_MSG(differ == 92, "only %d of 92 positions past the window changed", differ);
    seq_free(&ws, &w);
    env_close(&w);
    /* a backend without the ops gemma3 needs is refused up front, not called through NULL */
    bt_backend_ops lacking = *e.be->ops;
    lacking.geglu = NULL;
    bt_backend fake = {&lacking, e.be->ctx};
    bt_forward *fw2 = NULL;
    CHECK(bt_forward_create(e.m, &fake, 8, 0, &fw2) == BT_ERR_UNSUPPORTED && fw2 == NULL &&
          strstr(bt_last_error(), "geglu"));
    seq_free(&ref, &e);
    for (int i = 0; i < 8; i++) {
        seq_free(&alone[i], &e);
        seq_free(&mixed[i], &e);
    }
    env_close(&e);
    /* without the pattern key, every sixth layer is global */
    tiny_model_opts six = {.arch = "gemma3", .n_layer = 7};
    bt_model *m = NULL;
    REQUIRE(bt_model_load(tiny_path("gemma3-six", &six), &m) == BT_OK);
    for (int l = 0; l < 7; l++) CHECK(m->layers[l].window == (l == 5 ? 0 : 8));
    bt_model_free(m);
    m = NULL;
    tiny_model_opts bad = {.arch = "gemma3", .skip_tensor = "blk.1.attn_k_norm.weight"};
    CHECK(bt_model_load(tiny_path("gemma3-nonorm", &bad), &m) == BT_ERR_FORMAT &&
          strstr(bt_last_error(), "blk.1.attn_k_norm.weight"));
    tiny_model_opts nowin = {.arch = "gemma3", .swa_window = -1};
    CHECK(bt_model_load(tiny_path("gemma3-nowin", &nowin), &m) == BT_ERR_NOT_FOUND &&
          strstr(bt_last_error(), "gemma3.attention.sliding_window"));
    tiny_model_opts cap = {.arch = "gemma3", .softcap = 30.0f};
    CHECK(bt_model_load(tiny_path("gemma3-cap", &cap), &m) == BT_ERR_UNSUPPORTED &&
          strstr(bt_last_error(), "final_logit_softcapping"));
    CHECK(m == NULL);
}

static void test_bad_models(void)
{
    bt_model *m = NULL;
    tiny_model_opts o = {.arch = "gpt2"};
    const char *path = tiny_path("arch", &o);
    CHECK(bt_model_load(path, &m) == BT_ERR_UNSUPPORTED && strstr(bt_last_error(), "gpt2"));
    tiny_model_opts o2 = {.skip_tensor = "blk.1.ffn_up.weight"};
    path = tiny_path("missing", &o2);
    CHECK(bt_model_load(path, &m) == BT_ERR_FORMAT && strstr(bt_last_error(), "blk.1.ffn_up.weight"));
    tiny_model_opts o3 = {.matrix_type = BT_TYPE_Q2_K, .n_embd = 256, .n_ff = 256};
    path = tiny_path("q2k", &o3);
    CHECK(bt_model_load(path, &m) == BT_ERR_UNSUPPORTED && strstr(bt_last_error(), "Q2_K"));
    CHECK(bt_model_load("/nonexistent.gguf", &m) == BT_ERR_IO);
    CHECK(m == NULL);
}

/* int8 KV: half the bytes of f16 (plus an fp16 scale and min), batch invariance still holds, logits stay close to f16's. */
static void test_int8_kv(void)
{
    tiny_model_opts o = {0};
    const char *path = tiny_path("i8", &o);
    REQUIRE(path != NULL);
    env e;
    REQUIRE(env_open(&e, path, 2, 64) == 0);
    int32_t V = e.m->hp.n_vocab;
    size_t f16 = bt_kv_block_stride(&e.m->hp, BT_KV_F16), i8 = bt_kv_block_stride(&e.m->hp, BT_KV_INT8);
    CHECK(i8 * 8 == f16 * 5); /* head_dim 16 here: 2*16 codes + 2 fp16 (scale, min) per token-head vs 2*32 bytes */
    seq ref;
    seq_make(&ref, &e, 60, 3);
    REQUIRE(run_alone(&e, &ref, 64) == 0);
    bt_kv_pool *i8pool;
    REQUIRE(bt_kv_pool_create(&e.m->hp, BT_KV_INT8, i8 * (size_t)e.m->hp.n_layer * 64, NULL, &i8pool) == BT_OK);
    bt_kv_pool *keep = e.kv;
    e.kv = i8pool;
    seq a, b;
    seq_make(&a, &e, 60, 3);
    seq_make(&b, &e, 60, 3);
    REQUIRE(run_alone(&e, &a, 64) == 0);
    REQUIRE(run_alone(&e, &b, 7) == 0);
    CHECK(memcmp(a.logits, b.logits, sizeof(float) * 60 * (size_t)V) == 0);
    double d2 = 0, v2 = 0;
    for (size_t i = 0; i < (size_t)60 * (size_t)V; i++) {
        d2 += ((double)a.logits[i] - ref.logits[i]) * ((double)a.logits[i] - ref.logits[i]);
        v2 += (double)ref.logits[i] * ref.logits[i];
    }
    CHECK_MSG(sqrt(d2 / v2) < 0.05, "int8 KV vs f16 relative RMS %g", sqrt(d2 / v2));
    seq_free(&a, &e);
    seq_free(&b, &e);
    e.kv = keep;
    bt_kv_pool_destroy(i8pool);
    seq_free(&ref, &e);
    env_close(&e);
}

static void test_default_model_loads(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("test_default_model_loads: default model not cached (run deploy/fetch-model.sh)");
        return;
    }
    bt_model *m;
    REQUIRE(bt_model_load(path, &m) == BT_OK);
    CHECK(m->hp.n_layer == 30 && m->hp.n_embd == 576 && m->hp.n_head == 9 && m->hp.n_head_kv == 3);
    CHECK(m->hp.head_dim == 64 && m->hp.n_vocab == 49152 && m->hp.n_ff == 1536);
    CHECK(m->output.data == m->tok_embd.data); /* tied */
    CHECK(bt_kv_block_stride(&m->hp, BT_KV_F16) == 12288); /* DESIGN 5.1 */
    CHECK(bt_kv_block_stride(&m->hp, BT_KV_INT8) == 6144 + 384); /* 8-bit codes + fp16 scale/min: 53.1% */
    bt_model_free(m);
}

int main(void)
{
    if (!test_isa_begin()) return test_summary();
    RUN(test_batch_invariance);
    RUN(test_lanes);
    RUN(test_lanes_multi_row);
    RUN(test_isa_agreement);
    RUN(test_describe);
    RUN(test_bad_batches);
    RUN(test_bad_models);
    RUN(test_gemma3);
    RUN(test_int8_kv);
    RUN(test_default_model_loads);
    test_isa_report();
    return test_summary();
}
