/* `baton bench`: engine throughput on one sequence: prefill tok/s at 128 and 512 prompt tokens, decode tok/s at
 * batch 1, the machine's memory read bandwidth, and the decode roofline (weight bytes per token / bandwidth).
 * Each figure is the median of --reps runs. --concurrency: the continuous-batching scheduler at N sequences, with
 * the decode roofline at each N (memory and matmul compute). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/paths.h"
#include "engine/backend_cpu.h"
#include "engine/cpu/cpu_hostmem.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/cpu_pool.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "tools/bench_spec.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/seq_runner.h"

/* 64-byte loads written with GCC's generic vectors, so every ISA's compiler emits its widest loads */
typedef uint64_t bw_vec __attribute__((vector_size(64)));

/* Vectors read ahead by software prefetch (2 KiB): on the Intel Xeon hosts of 2026-12 the hardware prefetcher alone
 * read 17-24 GB/s on 2 threads where prefetching reached 31-33, and the packed kernels prefetch likewise. */
#define BW_AHEAD 32

typedef struct bw_job {
    const bw_vec *buf;
    size_t n;          /* 64-byte vectors */
    uint64_t sums[256];
} bw_job;

static void bw_worker(void *ctx, int ith, int nth)
{
    bw_job *j = ctx;
    size_t lo = j->n * (size_t)ith / (size_t)nth, hi = j->n * (size_t)(ith + 1) / (size_t)nth;
    bw_vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (size_t i = lo; i + 4 <= hi; i += 4) {
        if (i + BW_AHEAD + 4 <= hi) /* every line once, as the packed kernels prefetch their next group */
            for (int k = 0; k < 4; k++) __builtin_prefetch(&j->buf[i + BW_AHEAD + k], 0, 3);
        s0 += j->buf[i];
        s1 += j->buf[i + 1];
        s2 += j->buf[i + 2];
        s3 += j->buf[i + 3];
    }
    bw_vec t = s0 + s1 + s2 + s3;
    j->sums[ith] = t[0] + t[7];
}

/* Device-to-device copy bandwidth of a device backend (--device cuda), bytes read + written per second over 512 MiB
 * buffers (the decode roofline's bandwidth there); 0 when the buffers cannot be had. */
static double device_copy_bandwidth(bt_backend *be)
{
    size_t bytes = (size_t)512 << 20;
    void *a = be->ops->buf_alloc(be, bytes), *b = be->ops->buf_alloc(be, bytes);
    double bw = 0;
    if (a && b) {
        float sync;
        be->ops->buf_copy(be, b, a, bytes);
        be->ops->buf_get(be, &sync, b, sizeof sync);
        double t0 = bench_now_s();
        for (int i = 0; i < 10; i++) be->ops->buf_copy(be, b, a, bytes);
        be->ops->buf_get(be, &sync, b, sizeof sync);
        bw = 2.0 * (double)bytes * 10 / (bench_now_s() - t0);
    }
    if (a) be->ops->buf_free(be, a);
    if (b) be->ops->buf_free(be, b);
    return bw;
}

/* Best read bandwidth in bytes/s (a roofline is an upper bound, and a run another process interrupted only reads
 * slower) over a buffer of `bytes` (rounded up to 2 MiB) with n_threads threads, on huge
 * pages as the engine's weights and KV pool are (bench_cpu_kernels --memory-only: 4 KiB pages read 5-15% slower
 * here). Each run reads the whole buffer once, as a decode step reads the weights. */
static double measure_bandwidth(int n_threads, int reps, size_t bytes)
{
    bytes = (bytes + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    bw_vec *buf = bt_hostmem_huge_alloc(bytes);
    bt_pool *pool;
    if (!buf || bt_pool_create(n_threads, &pool)) {
        free(buf);
        return 0;
    }
    memset(buf, 1, bytes);
    bw_job j = {.buf = buf, .n = bytes / sizeof(bw_vec)};
    double best = 0;
    bt_pool_run(pool, bw_worker, &j); /* one untimed pass: page faults, and the caches as a step finds them */
    for (int r = 0; r < reps; r++) {
        double t0 = bench_now_s();
        bt_pool_run(pool, bw_worker, &j);
        double rate = bytes / (bench_now_s() - t0);
        best = rate > best ? rate : best;
    }
    bt_pool_destroy(pool);
    free(buf);
    return best;
}

/* The decode roofline's bandwidth: the faster of reading 512 MiB (memory) and reading a buffer of the weights' size
 * over and over, as decode does (a host whose last-level cache holds a share of the weights serves them faster than
 * memory: decode batch 1 read the weights at ~37 GB/s on an Intel Xeon whose 512 MiB read ran at ~35). */
typedef struct bw_pair {
    double mem, ws; /* bytes/s: 512 MiB, working set */
} bw_pair;

static bw_pair measure_decode_bandwidth(int n_threads, size_t weight_bytes)
{
    bw_pair b = {measure_bandwidth(n_threads, 5, (size_t)512 << 20), measure_bandwidth(n_threads, 5, weight_bytes)};
    return b;
}

static double bw_best(bw_pair b)
{
    return b.ws > b.mem ? b.ws : b.mem;
}

typedef struct conc_track {
    int64_t generated;
    int32_t first_seen;
    double last_first_token; /* when the last request got its first token */
} conc_track;

static void conc_emit(void *user, const bt_sched_event *ev)
{
    conc_track *t = user;
    if (ev->token < 0) return;
    t->generated++;
    if (ev->index == 0) {
        t->first_seen++;
        t->last_first_token = bench_now_s();
    }
}

/* Offline continuous batching: n requests of plen random prompt tokens and `gen` output tokens each, submitted at
 * once and stepped on this thread. Fills the prefill and decode rates (tok/s). Returns 0 on success. */
static int bench_concurrency(const bt_model *m, bt_backend *be, int profile, FILE *trace, int n, int plen, int gen,
                             bt_kv_dtype dtype, int full_local, const int32_t *toks, double *prefill, double *decode,
                             double *kv_util, double *kv_peak, long *decode_steps)
{
    bt_sched_config cfg = {0};
    cfg.profile = profile;
    cfg.step_trace = trace;
    cfg.kv_full_local = full_local;
    cfg.kv_dtype = dtype;
    cfg.kv_mem = bt_kv_block_stride(&m->hp, dtype) * (size_t)m->hp.n_layer *
                 (size_t)(n * ((plen + gen) / BT_KV_BLOCK + 2));
    cfg.max_batch_tokens = BT_SCHED_DEFAULT_BATCH_TOKENS;
    cfg.disable_prefix_cache = 1; /* distinct work per request, as distinct prompts would be */
    bt_sched *s;
    if (bt_sched_create(m, be, &cfg, &s)) return -1;
    if (bt_sched_warmup(s)) { /* as a node starts: the weights packed before the first timed step */
        bt_sched_destroy(s);
        return -1;
    }
    conc_track t = {0};
    bt_req_params p = bt_req_params_default();
    p.sampling.max_tokens = gen;
    p.sampling.ignore_eos = 1;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)plen);
    if (!prompt) {
        bt_sched_destroy(s);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < plen; k++) prompt[k] = toks[(k * 7 + i * 13) % 512];
        if (bt_sched_submit(s, prompt, plen, &p, conc_emit, &t, NULL)) {
            free(prompt);
            bt_sched_destroy(s);
            return -1;
        }
    }
    free(prompt);
    double t0 = bench_now_s();
    double util_sum = 0;
    int util_n = 0;
    double full_s = 0, pure_s = 0;
    int64_t full_tokens = 0, pure_tokens = 0;
    long full_n = 0, pure_n = 0;
    int prompts_done = 0;
    while (!bt_sched_idle(s)) {
        double step_t0 = bench_now_s();
        int64_t gen_before = t.generated;
        if (bt_sched_step(s) < 0) {
            bt_sched_destroy(s);
            return -1;
        }
        double ts = bench_now_s();
        int64_t made = t.generated - gen_before;
        if (prompts_done) { /* a decode-only step; full: all n sequences decoded in it */
            pure_s += ts - step_t0;
            pure_tokens += made;
            pure_n++;
            if (made == n) {
                full_s += ts - step_t0;
                full_tokens += made;
                full_n++;
            }
        }
        prompts_done = t.first_seen == n; /* every later step decodes only */
        bt_sched_stats st;
        bt_sched_get_stats(s, &st);
        if (st.kv_blocks_used > 0) { /* tokens held / slots of the blocks holding them */
            util_sum += (double)st.kv_tokens_used / ((double)st.kv_blocks_used * BT_KV_BLOCK);
            util_n++;
        }
    }
    *prefill = (double)plen * n / (t.last_first_token - t0);
    /* decode: steps in which all n sequences decoded and no prompt was computed, as llama-batched-bench's generation
     * phase and the roofline count them. Not counted: tokens that early requests made while later prompts were still
     * computing (those steps' time went mostly to prefill) and the drain, where the requests that started first have
     * finished and fewer than n sequences decode. With too few output tokens for a full step (staggered prompts), the
     * decode-only steps of the drain. */
    *decode = full_s > 0 ? (double)full_tokens / full_s : pure_s > 0 ? (double)pure_tokens / pure_s : 0;
    *decode_steps = full_n ? full_n : pure_n;
    *kv_util = util_n ? util_sum / util_n : 0;
    bt_sched_stats fin;
    bt_sched_get_stats(s, &fin);
    *kv_peak = (double)fin.kv_bytes_peak;
    bt_sched_destroy(s);
    return 0;
}

typedef struct ttft_track {
    double t_first;
} ttft_track;

static void ttft_emit(void *user, const bt_sched_event *ev)
{
    ttft_track *t = user;
    if (ev->token >= 0 && ev->index == 0) t->t_first = bench_now_s();
}

/* Prefix cache: time to first token of a prompt of `shared` + 32 tokens, cold, then of a second prompt that shares
 * the first `shared` tokens. Returns 0 on success. */
static int bench_prefix(const bt_model *m, bt_backend *be, int profile, int shared, const int32_t *toks,
                        double *cold, double *warm, int32_t *cached)
{
    bt_sched_config cfg = {0};
    cfg.profile = profile;
    cfg.kv_mem = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer * (size_t)(2 * (shared + 64) / 16);
    cfg.max_batch_tokens = BT_SCHED_DEFAULT_BATCH_TOKENS;
    bt_sched *s;
    if (bt_sched_create(m, be, &cfg, &s)) return -1;
    int32_t n = shared + 32;
    int32_t *a = malloc(sizeof(int32_t) * (size_t)n), *b = malloc(sizeof(int32_t) * (size_t)n);
    /* the warm-up token (weights packed, as a node starts) is never cached, so the cold prompt stays cold */
    if (!a || !b || bt_sched_warmup(s)) {
        if (!a || !b) bt_fail(BT_ERR_NOMEM, "out of memory for a %d-token prompt", n);
        free(a), free(b);
        bt_sched_destroy(s);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        a[i] = toks[i % 512];
        b[i] = i < shared ? a[i] : toks[(i * 31 + 7) % 512];
    }
    bt_req_params p = bt_req_params_default();
    p.sampling.max_tokens = 1;
    ttft_track ta = {0}, tb = {0};
    int rc = 0;
    double t0 = bench_now_s();
    if (bt_sched_submit(s, a, n, &p, ttft_emit, &ta, NULL)) rc = -1;
    while (!rc && !bt_sched_idle(s))
        if (bt_sched_step(s) < 0) rc = -1;
    double t1 = bench_now_s();
    if (!rc && bt_sched_submit(s, b, n, &p, ttft_emit, &tb, NULL)) rc = -1;
    while (!rc && !bt_sched_idle(s))
        if (bt_sched_step(s) < 0) rc = -1;
    bt_sched_stats st;
    bt_sched_get_stats(s, &st);
    *cold = ta.t_first - t0;
    *warm = tb.t_first - t1;
    *cached = (int32_t)st.prefix_hit_tokens;
    free(a);
    free(b);
    bt_sched_destroy(s);
    return rc;
}

/* --step-rows N: the forward pass of one sequence's step of 1..N rows (its next token and up to N - 1 drafts, every
 * row's logits, as a speculative verification computes them) after a prompt of prompt_n tokens; the KV of the rows is
 * dropped after each step, as a rejected draft's is. Each repetition times every size in turn (the median of 8
 * steps), so drift on a shared host spreads over all sizes; ms[R - 1] gets the median over repetitions. */
static int bench_step_rows(seq_runner *r, const int32_t *toks, int32_t prompt_n, int max_rows, long reps, double *ms)
{
    enum { STEPS = 8 };
    double per[100][64];
    seq_runner_reset(r);
    if (seq_runner_feed(r, toks, prompt_n, 0)) return -1;
    for (long k = 0; k < reps; k++)
        for (int rows = 1; rows <= max_rows; rows++) {
            double t[STEPS];
            for (int s = 0; s < STEPS; s++) {
                int32_t ids[64];
                for (int i = 0; i < rows; i++) ids[i] = toks[(prompt_n + 7 * s + i) % 8192];
                double t0 = bench_now_s();
                if (seq_runner_feed(r, ids, rows, 1)) return -1;
                t[s] = bench_now_s() - t0;
                seq_runner_rewind(r, prompt_n);
            }
            per[k][rows - 1] = bench_median(t, STEPS);
        }
    for (int rows = 1; rows <= max_rows; rows++) {
        double v[100];
        for (long k = 0; k < reps; k++) v[k] = per[k][rows - 1];
        ms[rows - 1] = bench_median(v, (int)reps) * 1e3;
    }
    return 0;
}

static int report_step_rows(const bt_model *m, seq_runner *r, const int32_t *toks, int32_t prompt_n, int max_rows,
                            long reps, const char *json)
{
    double ms[64];
    fprintf(stderr, "baton bench: %s, %s kernels, %d threads: steps of 1..%d rows after a %d-token prompt, %ld reps\n",
            m->name, bt_backend_cpu_isa(r->be), bt_backend_cpu_threads(r->be), max_rows, prompt_n, reps);
    if (bench_step_rows(r, toks, prompt_n, max_rows, reps, ms)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        return 1;
    }
    printf("%-6s %10s %12s\n", "rows", "step ms", "vs 1 row");
    for (int i = 0; i < max_rows; i++) printf("%-6d %10.3f %11.2fx\n", i + 1, ms[i], ms[i] / ms[0]);
    printf("curve (tools/spec_replay.py --curve): ");
    for (int i = 0; i < max_rows; i++) printf("%s%.2f", i ? "," : "", ms[i]);
    printf("\n");
    if (!json) return 0;
    FILE *f = fopen(json, "w");
    if (!f) {
        fprintf(stderr, "baton bench: cannot write %s: %s\n", json, strerror(errno));
        return 1;
    }
    fprintf(f, "{\"model\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"act_bits\": %d, \"prompt_tokens\": %d, "
               "\"reps\": %ld, \"step_ms\": [",
            m->name, bt_backend_cpu_isa(r->be), bt_backend_cpu_threads(r->be), bt_backend_cpu_act_bits(r->be), prompt_n,
            reps);
    for (int i = 0; i < max_rows; i++) fprintf(f, "%s%.4f", i ? ", " : "", ms[i]);
    fprintf(f, "]}\n");
    fclose(f);
    return 0;
}

int cmd_bench(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) /* speculative decoding on and off: its own options (tools/cmd_bench_spec.c) */
        if (!strcmp(argv[i], "--spec")) return bench_spec_main(argc, argv);
    const char *model_path = NULL, *json = NULL, *conc = NULL, *kv_name = "f16", *kv_window = "release";
    int device = -1;
    long threads = 0, reps = 5, decode_n = 128, prefix = 0, prompt_n = 128, step_rows = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            printf("usage: baton bench [--model PATH] [--threads N] [--device cpu|cuda:N] [--reps N] [--decode-tokens N]\n"
                   "                  [--json FILE]\n"
                   "                  [--concurrency N[,N...] [--prompt-tokens N] [--kv-dtype f16|f32|int8]]\n"
                   "Prefill tok/s (128 and 512 prompt tokens), decode tok/s (batch 1), memory bandwidth and the\n"
                   "decode roofline; every figure is the median of --reps runs (default 5), after a one-token\n"
                   "warm-up that packs the weights as a node does at start-up.\n"
                   "--concurrency 1,4,16,64 instead runs N requests (--prompt-tokens prompt tokens, default 128,\n"
                   "and --decode-tokens output tokens each) through the continuous-batching scheduler and reports\n"
                   "aggregate tok/s: prefill until the last prompt is done, decode over the steps in which all N\n"
                   "sequences decode and no prompt is computed; with the decode roofline at each N: the lower of\n"
                   "memory (weights once per step plus each sequence's KV, at the measured bandwidth) and compute\n"
                   "(the matmuls' multiply-accumulates at the measured rate of the dot instruction on every\n"
                   "thread). --kv-dtype: the KV cache's element type for these runs (default f16).\n"
                   "--kv-window release|full: a model with sliding-window layers holds their KV only for the\n"
                   "window (default) or for every position; the KV MiB column is the most KV bytes the run held at\n"
                   "once, per sequence.\n"
                   "--step-rows N times the forward pass of one sequence's step of 1..N rows (its next token and\n"
                   "up to N - 1 speculative drafts, with every row's logits) after --prompt-tokens (default 128)\n"
                   "prompt tokens: the step-cost curve that tools/spec_replay.py --curve takes (1 <= N <= 64).\n"
                   "--prefix N measures time to first token of an (N + 32)-token prompt, cold and with its first N\n"
                   "tokens in the prefix cache.\n"
                   "BATON_PROFILE=1 in the environment logs, for every engine run, the milliseconds per step spent\n"
                   "in each op kind (matmuls, attention, rope, ...) and in the whole forward pass, decode steps and\n"
                   "prompt steps apart.\n"
                   "BATON_STEP_TRACE=DIR writes each --concurrency N's engine steps (every rep) to\n"
                   "DIR/bench-cN-PID.steps, one line per step as the nodes write theirs: start, wall and forward\n"
                   "ms, the wait before it, tokens, sequences, decode-only, drafts, context (tools/step_trace.py DIR).\n"
                   "Decode steps of at least 4 sequences per thread run on lanes (each thread takes a share of\n"
                   "the sequences through every op); BATON_CPU_LANES=0 runs every op split over the threads.\n"
                   "--spec ngram|draft:PATH|self:L compares decoding with and without speculation on a workload of\n"
                   "prompts (see baton bench --spec ngram --help).\n");
            return 0;
        }
        if (!v) {
            fprintf(stderr, "baton bench: unknown option or missing value: '%s'\n", a);
            return 2;
        }
        i++;
        char *end = NULL;
        errno = 0;
        if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--threads")) threads = strtol(v, &end, 10);
        else if (!strcmp(a, "--device")) {
            if (cli_device_parse("bench", v, &device)) return 2;
        }
        else if (!strcmp(a, "--reps")) reps = strtol(v, &end, 10);
        else if (!strcmp(a, "--decode-tokens")) decode_n = strtol(v, &end, 10);
        else if (!strcmp(a, "--concurrency")) conc = v;
        else if (!strcmp(a, "--kv-dtype")) kv_name = v;
        else if (!strcmp(a, "--kv-window")) kv_window = v;
        else if (!strcmp(a, "--prefix")) prefix = strtol(v, &end, 10);
        else if (!strcmp(a, "--prompt-tokens")) prompt_n = strtol(v, &end, 10);
        else if (!strcmp(a, "--step-rows")) step_rows = strtol(v, &end, 10);
        else {
            fprintf(stderr, "baton bench: unknown option '%s'\n", a);
            return 2;
        }
        if (end && (end == v || *end || errno)) { /* a number option's value is all digits */
            fprintf(stderr, "baton bench: %s wants a number, not '%s'\n", a, v);
            return 2;
        }
        if (threads < 0 || threads > 256 || reps < 1 || reps > 100 || decode_n < 1 || decode_n > 4096 ||
            prompt_n < 1 || prompt_n > 8192 || step_rows < 0 || step_rows > 64 ||
            (!strcmp(a, "--step-rows") && step_rows < 1)) {
            fprintf(stderr, "baton bench: value out of range for %s\n", a);
            return 2;
        }
    }
    if (strcmp(kv_window, "release") && strcmp(kv_window, "full")) {
        fprintf(stderr, "baton bench: --kv-window must be release or full, not '%s'\n", kv_window);
        return 2;
    }
    int full_local = !strcmp(kv_window, "full");
    int kv_dtype = bt_kv_dtype_from_name(kv_name);
    if (kv_dtype < 0) {
        fprintf(stderr, "baton bench: --kv-dtype must be f16, f32 or int8, not '%s'\n", kv_name);
        return 2;
    }
    cli_engine_env env;
    if (cli_engine_env_read("bench", (int)threads, &env)) return 1;
    env.device = device;
    if (step_rows && (conc || prefix > 0)) {
        fprintf(stderr, "baton bench: --step-rows runs alone (not with --concurrency or --prefix)\n");
        return 2;
    }
    if (device >= 0 && (conc || prefix > 0)) {
        fprintf(stderr, "baton bench: --concurrency and --prefix run on the CPU backend only (their rooflines are "
                        "the CPU's)\n");
        return 2;
    }
    char def[4096];
    if (!model_path) {
        if (bt_default_model_path(def, sizeof def)) {
            fprintf(stderr, "baton bench: %s\n", bt_last_error());
            return 1;
        }
        model_path = def;
    }
    bt_model *m;
    if (bt_model_load(model_path, &m)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        return 1;
    }
    seq_runner r;
    int32_t ctx = 512 + (int32_t)decode_n + 16;
    if (step_rows && prompt_n + step_rows > ctx) ctx = (int32_t)(prompt_n + step_rows);
    if (seq_runner_init(&r, m, &env, ctx, 512, BT_KV_F16)) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
        bt_model_free(m);
        return 1;
    }
    int nth = bt_backend_cpu_threads(r.be);
    if (prefix > 0) {
        if (prefix > 4096) prefix = 4096;
        int32_t *ptoks = malloc(sizeof(int32_t) * 512);
        for (int i = 0; i < 512; i++) ptoks[i] = (int32_t)((i * 2654435761u) % (uint32_t)m->hp.n_vocab);
        double cold[100], warm[100];
        int32_t cached = 0;
        int prc = 0;
        for (long k = 0; k < reps && !prc; k++)
            if (bench_prefix(m, r.be, env.profile, (int)prefix, ptoks, &cold[k], &warm[k], &cached)) prc = 1;
        if (prc) {
            fprintf(stderr, "baton bench: %s\n", bt_last_error());
        } else {
            double c = bench_median(cold, (int)reps), w = bench_median(warm, (int)reps);
            printf("prefix cache: %ld shared + 32 new tokens: TTFT cold %.1f ms, warm %.1f ms (%d tokens cached): "
                   "%.1fx faster\n", prefix, c * 1e3, w * 1e3, cached, c / w);
        }
        free(ptoks);
        seq_runner_free(&r);
        bt_model_free(m);
        return prc;
    }
    if (conc) {
        int32_t *ctoks = malloc(sizeof(int32_t) * 512);
        uint64_t cs = 777;
        for (int i = 0; i < 512; i++) {
            cs = cs * 6364136223846793005ull + 1442695040888963407ull;
            ctoks[i] = (int32_t)((cs >> 33) % (uint64_t)m->hp.n_vocab);
        }
        /* Rooflines of decode at n sequences: every step streams the weights once and each sequence's KV (f16, at
         * the run's mean context), at the measured bandwidth; and the matmuls' multiply-accumulates at the measured
         * rate of the dot instruction on every thread at once (bt_cpu_dot_macs_rate_all: threads sharing a core's
         * vector units get less than n times one thread's rate). Attention's arithmetic and the elementwise ops are
         * left out, so these are upper bounds. */
        bt_cpu_isa isa = BT_CPU_ISA_SCALAR;
        for (int i = BT_CPU_ISA_SCALAR; i < BT_CPU_ISA_COUNT; i++)
            if (!strcmp(bt_cpu_isa_name((bt_cpu_isa)i), bt_backend_cpu_isa(r.be))) isa = (bt_cpu_isa)i;
        int act_bits = bt_backend_cpu_act_bits(r.be);
        double wbytes = (double)bt_model_weight_bytes(m);
        double bw = bw_best(measure_decode_bandwidth(nth, (size_t)wbytes)), macs_tok = (double)bt_model_matmul_macs(m);
        double mac_one = bt_cpu_dot_macs_rate(isa, act_bits), mac_rate = 0;
        bt_pool *rate_pool = NULL;
        if (nth > 1 && bt_pool_create(nth, &rate_pool) == BT_OK) {
            mac_rate = bt_cpu_dot_macs_rate_all(rate_pool, isa, act_bits);
            bt_pool_destroy(rate_pool);
        }
        /* no dot instruction (scalar) measures 0 either way; otherwise 0 here means no pool or memory for the
         * measurement, and one thread's rate times n stands in for it, said so */
        const int rate_measured = nth == 1 || mac_rate > 0 || mac_one <= 0;
        if (mac_rate <= 0) mac_rate = mac_one * nth;
        double kv_seq = (double)bt_kv_block_stride(&m->hp, (bt_kv_dtype)kv_dtype) * m->hp.n_layer / BT_KV_BLOCK *
                        ((double)prompt_n + (double)decode_n / 2);
        double compute_roof = mac_rate > 0 ? mac_rate / macs_tok : 0;
        int lanes = r.be->ops->max_lanes ? r.be->ops->max_lanes(r.be) : 0;
        printf("%s kernels, %d threads (decode lanes: %d), %d-bit activations; memory %.1f GB/s; matmul dot rate "
               "%.1f GMAC/s %s %d threads at once (%.1f on one; %.1f MMAC per token: compute roofline %.0f tok/s); "
               "%ld prompt + %ld output tokens per request, %s KV\n",
               bt_backend_cpu_isa(r.be), nth, lanes, act_bits, bw / 1e9, mac_rate / 1e9,
               rate_measured ? "on" : "estimated for", nth, mac_one / 1e9, macs_tok / 1e6, compute_roof, prompt_n,
               decode_n, kv_name);
        printf("%-12s %16s %16s %14s %10s %15s %13s %14s\n", "concurrency", "prefill tok/s", "decode tok/s",
               "vs batch 1", "KV util", "roofline tok/s", "roof vs 1", "KV MiB/seq");
        double base = 0;
        int crc = 0;
        FILE *jf = json ? fopen(json, "w") : NULL;
        if (jf) fprintf(jf, "{\"model\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"decode_lanes\": %d, "
                        "\"act_bits\": %d, \"bandwidth_gb_s\": %.2f, \"dot_gmac_s\": %.2f, "
                        "\"dot_gmac_s_one_thread\": %.2f, \"dot_rate_measured\": %s, "
                        "\"compute_roofline_tok_s\": %.2f, \"prompt_tokens\": %ld, \"decode_tokens\": %ld, "
                        "\"kv_dtype\": \"%s\", \"runs\": [",
                        m->name, bt_backend_cpu_isa(r.be), nth, lanes, act_bits, bw / 1e9, mac_rate / 1e9,
                        mac_one / 1e9, rate_measured ? "true" : "false", compute_roof, prompt_n, decode_n, kv_name);
        double roof_base = 0;
        const char *trace_dir = getenv("BATON_STEP_TRACE");
        char *list = strdup(conc), *save = NULL;
        int first = 1;
        for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            int n = atoi(tok);
            if (n < 1 || n > 1024) {
                fprintf(stderr, "baton bench: bad concurrency '%s'\n", tok);
                crc = 2;
                break;
            }
            double pre[100], dec[100], util[100], kvp[100];
            long dsteps = 0; /* the same in every rep: the scheduler's steps do not depend on timing */
            FILE *trace = NULL; /* BATON_STEP_TRACE=DIR: every rep's steps at this concurrency, as nodes write them */
            if (trace_dir && *trace_dir) {
                char path[4096];
                snprintf(path, sizeof path, "%s/bench-c%d-%ld.steps", trace_dir, n, (long)getpid());
                if (!(trace = fopen(path, "w"))) {
                    fprintf(stderr, "baton bench: BATON_STEP_TRACE: cannot create %s: %s\n", path, strerror(errno));
                    crc = 1;
                    break;
                }
                fprintf(trace, "# %s\n", BT_SCHED_TRACE_FIELDS);
                fprintf(stderr, "baton bench: step trace of concurrency %d: %s\n", n, path);
            }
            for (long k = 0; k < reps; k++)
                if (bench_concurrency(m, r.be, env.profile, trace, n, (int)prompt_n, (int)decode_n,
                                      (bt_kv_dtype)kv_dtype, full_local, ctoks, &pre[k], &dec[k], &util[k], &kvp[k],
                                      &dsteps)) {
                    fprintf(stderr, "baton bench: %s\n", bt_last_error());
                    crc = 1;
                    break;
                }
            if (trace && fclose(trace) != 0 && !crc) {
                fprintf(stderr, "baton bench: BATON_STEP_TRACE: writing the trace failed: %s\n", strerror(errno));
                crc = 1;
            }
            if (crc) break;
            double p = bench_median(pre, (int)reps), d = bench_median(dec, (int)reps), u = bench_median(util, (int)reps);
            double roof = bw > 0 ? n * bw / (wbytes + n * kv_seq) : 0;
            if (compute_roof > 0 && compute_roof < roof) roof = compute_roof;
            if (first) base = d, roof_base = roof;
            double kv_mib = bench_median(kvp, (int)reps) / n / (1024.0 * 1024.0);
            printf("%-12d %16.1f %16.1f %13.2fx %9.1f%% %15.0f %12.2fx %14.2f\n", n, p, d, base > 0 ? d / base : 0,
                   100 * u, roof, roof_base > 0 ? roof / roof_base : 0, kv_mib);
            if (jf) fprintf(jf, "%s{\"concurrency\": %d, \"prefill_tok_s\": %.2f, \"decode_tok_s\": %.2f, "
                            "\"decode_steps\": %ld, \"kv_utilization\": %.4f, \"roofline_tok_s\": %.2f, "
                            "\"kv_peak_bytes_per_seq\": %.0f}",
                            first ? "" : ", ", n, p, d, dsteps, u, roof, kv_mib * 1024.0 * 1024.0);
            first = 0;
        }
        if (jf) {
            fprintf(jf, "]}\n");
            fclose(jf);
        }
        free(list);
        free(ctoks);
        seq_runner_free(&r);
        bt_model_free(m);
        return crc;
    }
    int32_t *toks = malloc(sizeof(int32_t) * 8192);
    uint64_t seed = 12345;
    for (int i = 0; i < 8192; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        toks[i] = (int32_t)((seed >> 33) % (uint64_t)m->hp.n_vocab);
    }
    if (step_rows) {
        int src = report_step_rows(m, &r, toks, (int32_t)prompt_n, (int)step_rows, reps, json);
        free(toks);
        seq_runner_free(&r);
        bt_model_free(m);
        return src;
    }
    fprintf(stderr, "baton bench: %s, %s kernels, %d threads, %ld reps\n", m->name, bt_backend_cpu_isa(r.be), nth, reps);
    double pre128[100], pre512[100], dec[100];
    bt_sampling sp = bt_sampling_default();
    float *scratch = malloc(sizeof(float) * 2 * (size_t)m->hp.n_vocab);
    int rc = 0;
    /* One token through every layer first, as a node warms up at start-up (bt_sched_warmup): it packs the weights
     * and builds the tables, which otherwise fell in rep 1 (SmolLM2's prefill128 at ~270 tok/s against ~1,600)
     * and in BATON_PROFILE's prompt-step averages (their matmul and output times, by up to a half). */
    double warm_ms = bench_now_s();
    seq_runner_reset(&r);
    if (seq_runner_feed(&r, toks, 1, 0)) rc = 1;
    bt_forward_profile_reset(r.fw);
    warm_ms = (bench_now_s() - warm_ms) * 1e3;
    if (!rc) fprintf(stderr, "  warm-up: %.0f ms (one token through every layer: first-use work done)\n", warm_ms);
    for (long k = 0; k < reps && !rc; k++) {
        int lens[2] = {128, 512};
        for (int p = 0; p < 2; p++) {
            seq_runner_reset(&r);
            double t0 = bench_now_s();
            if (seq_runner_feed(&r, toks, lens[p], 0)) rc = 1;
            double dt = bench_now_s() - t0;
            (p == 0 ? pre128 : pre512)[k] = lens[p] / dt;
        }
        /* decode after a 128-token prompt */
        seq_runner_reset(&r);
        if (seq_runner_feed(&r, toks, 128, 0)) rc = 1;
        double t0 = bench_now_s();
        for (long i = 0; i < decode_n && !rc; i++) {
            int32_t id = bt_sample(&sp, r.logits, m->hp.n_vocab, r.n_past, scratch, NULL);
            if (seq_runner_feed(&r, &id, 1, 0)) rc = 1;
        }
        dec[k] = decode_n / (bench_now_s() - t0);
        fprintf(stderr, "  rep %ld: prefill128 %.1f tok/s, prefill512 %.1f tok/s, decode %.1f tok/s\n", k + 1,
                pre128[k], pre512[k], dec[k]);
    }
    if (rc) {
        fprintf(stderr, "baton bench: %s\n", bt_last_error());
    } else {
        int on_device = r.be->ops->device_memory && r.be->ops->buf_copy;
        double wbytes = (double)bt_model_weight_bytes(m);
        bw_pair bp1 = {0, 0}, bpn = {0, 0};
        if (on_device) {
            bp1.mem = bpn.mem = device_copy_bandwidth(r.be);
        } else {
            bp1 = measure_decode_bandwidth(1, (size_t)wbytes);
            bpn = nth > 1 ? measure_decode_bandwidth(nth, (size_t)wbytes) : bp1;
        }
        double bw1 = bw_best(bp1), bwn = bw_best(bpn);
        double p128 = bench_median(pre128, (int)reps), p512 = bench_median(pre512, (int)reps), d = bench_median(dec, (int)reps);
        double roof = bwn / wbytes; /* tokens/s if decode only streamed the weights once per token */
        printf("model               %s\n", m->name);
        char kinds[512];
        bt_backend_cpu_describe(r.be, m, kinds, sizeof kinds);
        printf("kernels             %s, %d threads, %d-bit activations: %s\n", bt_backend_cpu_isa(r.be), nth,
               bt_backend_cpu_act_bits(r.be), kinds);
        printf("prefill 128 tokens  %8.1f tok/s   (median of %ld)\n", p128, reps);
        printf("prefill 512 tokens  %8.1f tok/s\n", p512);
        printf("decode batch 1      %8.1f tok/s   (%.2f ms/token, %ld tokens after a 128-token prompt)\n", d,
               1000.0 / d, decode_n);
        if (on_device)
            printf("memory bandwidth    %8.1f GB/s (%s device-to-device copy, read + write)\n", bwn / 1e9,
                   r.be->ops->name);
        else
            printf("memory bandwidth    %8.1f GB/s on 1 thread, %.1f GB/s on %d (best of a 512 MiB read: %.1f, %.1f; and "
                   "of a %.0f MB read, the weights' size: %.1f, %.1f)\n",
                   bw1 / 1e9, bwn / 1e9, nth, bp1.mem / 1e9, bpn.mem / 1e9, wbytes / 1e6, bp1.ws / 1e9, bpn.ws / 1e9);
        printf("weights per token   %8.1f MB\n", wbytes / 1e6);
        printf("decode roofline     %8.1f tok/s   (achieved %.0f%%)\n", roof, 100.0 * d / roof);
        if (json) {
            FILE *f = fopen(json, "w");
            if (!f) {
                fprintf(stderr, "baton bench: cannot write %s: %s\n", json, strerror(errno));
                rc = 1;
            } else {
                fprintf(f,
                        "{\"model\": \"%s\", \"isa\": \"%s\", \"threads\": %d, \"reps\": %ld, "
                        "\"prefill128_tok_s\": %.2f, \"prefill512_tok_s\": %.2f, \"decode_tok_s\": %.2f, "
                        "\"bandwidth_1t_gb_s\": %.2f, \"bandwidth_gb_s\": %.2f, \"bandwidth_512mib_gb_s\": %.2f, "
                        "\"bandwidth_weights_size_gb_s\": %.2f, \"weight_bytes_per_token\": %.0f, "
                        "\"decode_roofline_tok_s\": %.2f, \"decode_roofline_fraction\": %.4f, \"warmup_ms\": %.1f}\n",
                        m->name, bt_backend_cpu_isa(r.be), nth, reps, p128, p512, d, bw1 / 1e9, bwn / 1e9,
                        bpn.mem / 1e9, bpn.ws / 1e9, wbytes, roof, d / roof, warm_ms);
                fclose(f);
            }
        }
    }
    free(scratch);
    free(toks);
    seq_runner_free(&r);
    bt_model_free(m);
    return rc;
}
