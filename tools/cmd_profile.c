/* `baton profile`: measures this machine with the real engine (the continuous-batching scheduler the nodes run) and
 * writes the planner's and the simulator's profile (router/planner.h): prefill step time against prompt tokens per
 * step (prompts of several lengths, alone and several at once), decode step time against batch size and total
 * context, and the KV copy bandwidth of the shared-memory transport (one-sided puts into a mapped pool are memory
 * copies; a UCX measurement from `baton kvx-bench --json` can be merged with --kvx-json). Each model is a least-
 * squares fit over the median step of each measured shape (fit_robust); the raw points go into the file's "samples". */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/paths.h"
#include "engine/backend_cpu.h"
#include "engine/forward.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "router/planner.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "tools/engine_env.h"

#define PF_MAX_POINTS 4096
#define PF_SWEEP_TOKENS 8192 /* prompt tokens one decode-sweep point may cost */
#define PF_MAX_REPS 20       /* --reps bound */

typedef struct pf_points {
    double x[PF_MAX_POINTS * 2]; /* [n][k] regressors */
    double y[PF_MAX_POINTS];     /* step seconds */
    int rep[PF_MAX_POINTS];      /* the repetition (--reps) that measured it */
    int n, k, cur_rep;
} pf_points;

static void pf_add(pf_points *p, double x0, double x1, double y)
{
    if (p->n >= PF_MAX_POINTS) return;
    p->x[p->n * p->k] = x0;
    if (p->k > 1) p->x[p->n * p->k + 1] = x1;
    p->rep[p->n] = p->cur_rep;
    p->y[p->n++] = y;
}

static void pf_emit(void *user, const bt_sched_event *ev) { (void)user, (void)ev; }

/* Submits n_req prompts of plen tokens, max_tokens gen each, and steps the scheduler to idle, recording every step:
 * prompt-only steps into pre (tokens), decode-only steps of all n_req sequences into dec (batch, total context).
 * Where the prompts took several chunked steps, the first sequences finish their outputs before the last ones: those
 * tail steps of fewer sequences are left out. They were measured at one or two contexts each, at the end of a long
 * run of prompt chunks, and read up to 2x the sweep's own steps of a larger batch (a batch of 6 at 3,117 context
 * tokens 17 ms, the sweep's batch of 8 at 4,125 13 ms), which made the batch points (batch_points) jump about. */
/* Returns 0, or -3 when the engine failed (bt_last_error says why). */
static int run_batch(bt_sched *s, const bt_model *m, int n_req, int plen, int gen, uint64_t seed, pf_points *pre,
                     pf_points *dec)
{
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)plen);
    if (!prompt) return -3;
    bt_req_params p = bt_req_params_default();
    p.sampling.max_tokens = gen;
    p.sampling.ignore_eos = 1;
    for (int i = 0; i < n_req; i++) {
        for (int k = 0; k < plen; k++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            prompt[k] = (int32_t)((seed >> 33) % (uint64_t)m->hp.n_vocab);
        }
        if (bt_sched_submit(s, prompt, plen, &p, pf_emit, NULL, NULL)) {
            free(prompt);
            return -3;
        }
    }
    free(prompt);
    bt_sched_stats a, b;
    bt_sched_get_stats(s, &a);
    while (!bt_sched_idle(s)) {
        int running = a.running;
        int64_t ctx = a.kv_tokens_used;
        double t0 = bench_now_s();
        if (bt_sched_step(s) < 0) return -3;
        double dt = bench_now_s() - t0;
        bt_sched_get_stats(s, &b);
        uint64_t ptoks = b.computed_prompt_tokens - a.computed_prompt_tokens;
        uint64_t gtoks = b.generated_tokens - a.generated_tokens;
        /* prompt steps only from the prefill sweep (one output token each: no decode row ever mixes in) */
        if (!dec && pre && ptoks > 0) pf_add(pre, (double)ptoks, (double)gtoks, dt);
        else if (dec && ptoks == 0 && gtoks > 0 && running == n_req) pf_add(dec, (double)running, (double)ctx, dt);
        a = b;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median_of(double *v, int m)
{
    qsort(v, (size_t)m, sizeof *v, cmp_double);
    return m % 2 ? v[m / 2] : (v[m / 2 - 1] + v[m / 2]) / 2;
}

/* What each prompt ending adds to a prefill step: one more row of logits (the output matrix times its hidden state) and
 * its sampling (greedy, as bench-serve asks). Every step of the prefill sweep ends at least one prompt, so the sweep's
 * fit cannot separate the two from fixed_s (its seq_s came out 0). Here the same PF_END_TOKENS-token pass runs with 0,
 * 1 and PF_END_ROWS logits rows in turn: the first row pays for reading the output matrix (*first_s: that stays in
 * fixed_s, which every fitted step paid), each further row only its arithmetic. *seq_s = the further row's cost plus
 * a sampling. Returns 0, or -3 when the engine failed. */
#define PF_END_TOKENS 16
#define PF_END_ROWS 4
#define PF_END_REPS 31
static int measure_prompt_end(const bt_model *m, bt_backend *be, double *seq_s, double *first_s, double *sample_s)
{
    const bt_hparams *hp = &m->hp;
    bt_forward *fw = NULL;
    bt_kv_pool *kv = NULL;
    float *logits = NULL, *scratch = NULL;
    int rc = -3;
    if (bt_forward_create(m, be, PF_END_TOKENS, 0, &fw) ||
        bt_kv_pool_create(hp, BT_KV_F16, bt_kv_block_stride(hp, BT_KV_F16) * (size_t)hp->n_layer * 2, NULL, &kv))
        goto out;
    logits = malloc(sizeof(float) * PF_END_ROWS * (size_t)hp->n_vocab);
    scratch = malloc(sizeof(float) * (size_t)bt_sampler_scratch_floats(hp->n_vocab));
    int32_t block = 0;
    if (!logits || !scratch || bt_kv_pool_alloc(kv, 1, &block)) goto out;
    int32_t tok[PF_END_TOKENS], pos[PF_END_TOKENS], seq[PF_END_TOKENS], rows[PF_END_ROWS];
    for (int i = 0; i < PF_END_TOKENS; i++) tok[i] = (int32_t)((i * 7919 + 17) % hp->n_vocab), pos[i] = i, seq[i] = 0;
    for (int i = 0; i < PF_END_ROWS; i++) rows[i] = PF_END_TOKENS - PF_END_ROWS + i;
    bt_seq_view sv = {.block_table = &block, .n_blocks = 1};
    bt_batch b = {.n_tokens = PF_END_TOKENS, .tokens = tok, .pos = pos, .seq = seq, .seqs = &sv, .n_seqs = 1,
                  .logit_rows = rows};
    const int n_rows[3] = {0, 1, PF_END_ROWS};
    double t[3][PF_END_REPS], samp[PF_END_REPS];
    for (int r = -2; r < PF_END_REPS; r++) /* two rounds of warm-up; the variants interleave so drift hits all alike */
        for (int k = 0; k < 3; k++) {
            b.n_logits = n_rows[k];
            double t0 = bench_now_s();
            if (bt_forward_run(fw, kv, &b, logits)) goto out;
            if (r >= 0) t[k][r] = bench_now_s() - t0;
        }
    bt_sampling sp = bt_sampling_default();
    volatile int32_t sink = 0;
    for (int r = 0; r < PF_END_REPS; r++) {
        double t0 = bench_now_s();
        sink += bt_sample(&sp, logits, hp->n_vocab, PF_END_TOKENS, scratch, NULL);
        samp[r] = bench_now_s() - t0;
    }
    (void)sink;
    double m0 = median_of(t[0], PF_END_REPS), m1 = median_of(t[1], PF_END_REPS), mk = median_of(t[2], PF_END_REPS);
    *first_s = m1 > m0 ? m1 - m0 : 0;
    *sample_s = median_of(samp, PF_END_REPS);
    *seq_s = (mk > m1 ? (mk - m1) / (PF_END_ROWS - 1) : 0) + *sample_s;
    rc = 0;
out:
    free(logits);
    free(scratch);
    bt_kv_pool_destroy(kv);
    bt_forward_destroy(fw);
    return rc;
}

/* Median copy bandwidth (bytes/s) and per-copy latency of KV-sized copies: what a shared-memory put costs. */
static void measure_copy(double block_bytes, double *bytes_s, double *latency_s)
{
    size_t big = (size_t)64 << 20;
    char *src = malloc(big), *dst = malloc(big);
    *bytes_s = *latency_s = 0;
    if (!src || !dst) {
        free(src);
        free(dst);
        return;
    }
    memset(src, 1, big);
    memset(dst, 2, big);
    double bw[7], lat[7];
    size_t small = block_bytes > 64 ? (size_t)block_bytes : 64;
    for (int r = 0; r < 7; r++) {
        double t0 = bench_now_s();
        memcpy(dst, src, big);
        bw[r] = (double)big / (bench_now_s() - t0);
        t0 = bench_now_s();
        for (int i = 0; i < 100; i++) memcpy(dst + (size_t)i * small % (big - small), src, small);
        lat[r] = (bench_now_s() - t0) / 100 - (double)small / bw[r];
        if (lat[r] < 0) lat[r] = 0;
        src[r]++;
    }
    *bytes_s = bench_median(bw, 7);
    *latency_s = bench_median(lat, 7);
    free(src);
    free(dst);
}

static void host_describe(int threads, char *out, size_t cap)
{
    char cpu[160] = "unknown CPU", line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            const char *c = strchr(line, ':');
            if (c) snprintf(cpu, sizeof cpu, "%s", c + 2);
            cpu[strcspn(cpu, "\n")] = '\0';
            break;
        }
    if (f) fclose(f);
    long mem_kb = 0;
    f = fopen("/proc/meminfo", "r");
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemTotal: %ld kB", &mem_kb) == 1) break;
    if (f) fclose(f);
    snprintf(out, cap, "%s, %ld CPUs online, %.1f GiB memory, %d engine threads", cpu, sysconf(_SC_NPROCESSORS_ONLN),
             (double)mem_kb / (1 << 20), threads);
}

/* {"kvx-bench JSON" -> a transport}: reads "transport" (or "tls") and a bandwidth in bytes/s or GB/s. 0 on success. */
static int merge_kvx(const char *path, plan_profile_t *p)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "baton profile: cannot open %s: %s\n", path, strerror(errno));
        return -1;
    }
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) return -1;
    buf[n] = '\0';
    cJSON *j = cJSON_Parse(buf);
    free(buf);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "transport");
    if (!t) t = cJSON_GetObjectItemCaseSensitive(j, "tls");
    const cJSON *bw = cJSON_GetObjectItemCaseSensitive(j, "bytes_s"), *gb = cJSON_GetObjectItemCaseSensitive(j, "gb_s");
    const cJSON *lat = cJSON_GetObjectItemCaseSensitive(j, "latency_s");
    double bytes_s = cJSON_IsNumber(bw) ? bw->valuedouble : cJSON_IsNumber(gb) ? gb->valuedouble * 1e9 : 0;
    if (!cJSON_IsString(t) || !(bytes_s > 0) || p->n_xfer >= PLAN_MAX_TRANSPORTS) {
        fprintf(stderr, "baton profile: %s: want {\"transport\": NAME, \"bytes_s\" or \"gb_s\": N, \"latency_s\": S}\n", path);
        cJSON_Delete(j);
        return -1;
    }
    plan_transport_t *x = &p->xfer[p->n_xfer++];
    snprintf(x->name, sizeof x->name, "%s", t->valuestring);
    x->bytes_s = bytes_s;
    x->latency_s = cJSON_IsNumber(lat) ? lat->valuedouble : 0;
    cJSON_Delete(j);
    return 0;
}

static void usage(FILE *o)
{
    fprintf(o,
            "usage: baton profile [--model PATH] [--threads N] [--out FILE] [--reps N] [--max-batch N]\n"
            "                     [--max-context N] [--idle-reps N] [--kvx-json FILE]\n"
            "Measures this machine with the real engine and writes the profile the SLA planner (baton-router\n"
            "--planner-profile) and `baton simulate --profile` read:\n"
            "  prefill step time = fixed_s + tokens * token_s + prompts * seq_s\n"
            "                                                      (prompts of 16..512 tokens, 1 and 4 at once;\n"
            "                                                      seq_s: each prompt ending's logits row and\n"
            "                                                      sampling, timed apart on a 16-token pass)\n"
            "  decode step time  = fixed_s + batch * seq_s + total_context * ctx_token_s\n"
            "                                                      (batches of 1..--max-batch, contexts to --max-context;\n"
            "                                                      decode.batch_s: the step less its context term at\n"
            "                                                      each batch measured, which the simulator follows)\n"
            "  KV transfer time  = latency_s + bytes / bytes_s     (shm: memory copy of KV blocks; more transports\n"
            "                                                      from `--kvx-json`, a JSON object with transport,\n"
            "                                                      bytes_s or gb_s, latency_s)\n"
            "  spread           how steps scatter around their shape's median (the simulator draws each step's time)\n"
            "  idle             what a 128-token prompt step costs more after the node idled 0.1, 0.3, 1 and 2 s\n"
            "Each model is a least-squares fit over the shapes measured: per shape, the median step of each\n"
            "repetition, then the median of those (the least of two); the points are kept under \"samples\".\n"
            "About 45 s per repetition on 2 cores; --reps N sweeps every shape N times in turn (default 1; 3 on a\n"
            "shared machine).\n"
            "Progress goes to stderr; the profile to --out (default: stdout).\n"
            "  --threads N      engine threads (default: as the nodes, every core)\n"
            "  --idle-reps N    repetitions of the idle measurement (default 6, about 4 s each; 0 = skip it)\n"
            "  --max-batch N    largest decode batch measured (default 32)\n"
            "  --max-context N  longest prompt in the decode sweep (default 512; batch x context stays under\n"
            "                   8192 tokens)\n");
}

static int parse_long(const char *a, const char *v, long lo, long hi, long *out)
{
    char *e = NULL;
    errno = 0;
    long x = strtol(v, &e, 10);
    if (!*v || *e || errno || x < lo || x > hi) {
        fprintf(stderr, "baton profile: %s wants a whole number from %ld to %ld, not '%s'\n", a, lo, hi, v);
        return -1;
    }
    *out = x;
    return 0;
}

/* The shapes: points of equal regressors (decode: same batch, context per sequence within 16 tokens of the group's
 * first point) share a group. Sets group[i] for every point, numbered in first-seen order; returns how many. */
static int group_points(const pf_points *p, int dec_shape, int *group)
{
    int ng = 0;
    for (int i = 0; i < p->n; i++) group[i] = -1;
    for (int i = 0; i < p->n; i++) {
        if (group[i] >= 0) continue;
        for (int j = i; j < p->n; j++) {
            int same = p->x[j * p->k] == p->x[i * p->k];
            if (same && p->k > 1 && dec_shape)
                same = fabs(p->x[j * 2 + 1] / p->x[j * 2] - p->x[i * 2 + 1] / p->x[i * 2]) < 16;
            else if (same && p->k > 1)
                same = p->x[j * 2 + 1] == p->x[i * 2 + 1];
            if (same && group[j] < 0) group[j] = ng;
        }
        ng++;
    }
    return ng;
}

/* Steps measured on a shared machine carry other processes' time (batch-1 decode steps from 6 to 31 ms in one run,
 * and a build next door slowed every shape it overlapped by 1.5-2.5x for tens of seconds): the fit takes, for each
 * group of equal regressors (decode: same batch, context per sequence within 16 tokens), the median step of each
 * repetition and then, over three or more repetitions, the median of those medians (over two, the least).
 * Repetitions sweep every shape in turn, so a burst of outside load spoils one repetition of a shape, not all of
 * them, and the median of three sets it aside. The least of the medians, which this took before, is biased low: on
 * a quiet machine (others 0% of the CPUs, 9 profiles of 3 repetitions) it sat 2-7% under the median for prefill
 * steps and 4-17% for decode steps, and the serving run it predicts is a typical run, not the luckiest of three
 * (the simulator came out 2-19% optimistic on every cell). Points are weighted by
 * 1 / y^2 so that the fit minimises relative error (small and large steps count alike). c2 >= 0 fixes the second
 * coefficient (measured apart): each group's step less x1 * c2 is fitted on x0 alone. */
static int fit_robust(const pf_points *p, int dec_shape, double c2, double *c)
{
    static double gx[PF_MAX_POINTS * 2], gy[PF_MAX_POINTS], gw[PF_MAX_POINTS], ys[PF_MAX_POINTS];
    static int group[PF_MAX_POINTS], members[PF_MAX_POINTS];
    int ng = group_points(p, dec_shape, group);
    for (int g = 0; g < ng; g++) {
        int m = 0;
        double sx0 = 0, sx1 = 0;
        for (int j = 0; j < p->n; j++) {
            if (group[j] != g) continue;
            members[m++] = j;
            sx0 += p->x[j * p->k];
            if (p->k > 1) sx1 += p->x[j * 2 + 1];
        }
        double meds[PF_MAX_REPS], best = INFINITY;
        int n_meds = 0;
        for (int a = 0; a < m && n_meds < PF_MAX_REPS; a++) { /* each repetition's median; members in measuring order */
            int rep = p->rep[members[a]], q = 0;
            if (a && p->rep[members[a - 1]] == rep) continue;
            for (int b = a; b < m && p->rep[members[b]] == rep; b++) ys[q++] = p->y[members[b]];
            meds[n_meds] = median_of(ys, q);
            if (meds[n_meds] < best) best = meds[n_meds];
            n_meds++;
        }
        if (n_meds >= 3) best = median_of(meds, n_meds);
        gx[g * p->k] = sx0 / m;
        if (p->k > 1) gx[g * 2 + 1] = sx1 / m;
        gy[g] = c2 >= 0 && p->k > 1 ? best - gx[g * 2 + 1] * c2 : best;
        gw[g] = gy[g] > 0 ? 1.0 / (gy[g] * gy[g]) : 0;
    }
    if (!(c2 >= 0) && plan_fit_linear(gx, p->k, gy, gw, ng, c) == 0) return 0;
    /* the second coefficient is given, or its regressor did not vary (a short sweep: one context per sequence, or
     * one prompt per step): fit the first alone, the second's coefficient c2 or 0 */
    for (int i = 0; i < ng; i++) gx[i] = gx[i * p->k];
    if (plan_fit_linear(gx, 1, gy, gw, ng, c)) return -1;
    c[2] = c2 >= 0 ? c2 : 0;
    return 0;
}

/* How the steps of one shape scatter, for the simulator (prefill.spread, decode.spread): over every shape with 3 or
 * more points, ln(step / the shape's median) (an odd shape's middle point left out), pooled; the 90th percentile
 * of those over 1.2816 (where a normal puts it), since the tail is what the latency percentiles read and outside
 * load skews it up. 0 without points. */
static double spread_of(const pf_points *p, int dec_shape)
{
    static int group[PF_MAX_POINTS];
    static double r[PF_MAX_POINTS], ys[PF_MAX_POINTS];
    int ng = group_points(p, dec_shape, group), nr = 0;
    for (int g = 0; g < ng; g++) {
        int m = 0;
        for (int j = 0; j < p->n; j++)
            if (group[j] == g) ys[m++] = p->y[j];
        if (m < 3) continue;
        double med = median_of(ys, m); /* sorts ys: an odd group's middle point is its median, no residual */
        for (int j = 0; j < m; j++)
            if (ys[j] > 0 && med > 0 && !(m % 2 && j == m / 2)) r[nr++] = log(ys[j] / med);
    }
    if (nr < 3) return 0;
    qsort(r, (size_t)nr, sizeof *r, cmp_double);
    double q90 = r[(int)(0.9 * (nr - 1))];
    return q90 > 0 ? q90 / 1.2816 : 0;
}

/* What idleness costs the next step (the simulator's idle points): a CPU that sat idle runs its next tens of
 * milliseconds slower (measured on a 2-vCPU cloud VM: a 128-token prompt step took 20-35% longer after 0.3-1.5 s
 * idle, a 512-token one about the same absolute extra). Each repetition times one PF_IDLE_TOKENS-token prompt step
 * back to back (after an unmeasured one) and one after each idle gap in turn; extra = the median after the gap less
 * the median back to back (at least 0). Returns 0, or -3 when the engine failed. */
#define PF_IDLE_TOKENS 128
#define PF_IDLE_GAPS 4
static const double pf_idle_gaps[PF_IDLE_GAPS] = {0.1, 0.3, 1.0, 2.0};
static int measure_idle(bt_sched *s, const bt_model *m, int reps, plan_profile_t *p)
{
    double ref[PF_MAX_REPS], t[PF_IDLE_GAPS][PF_MAX_REPS];
    for (int r = 0; r < reps; r++)
        for (int g = -1; g < PF_IDLE_GAPS; g++) {
            uint64_t seed = (uint64_t)(7000 + r * 10 + g);
            if (g < 0 && run_batch(s, m, 1, PF_IDLE_TOKENS, 1, seed + 1000, NULL, NULL)) return -3;
            if (g >= 0) usleep((useconds_t)(pf_idle_gaps[g] * 1e6));
            double t0 = bench_now_s();
            if (run_batch(s, m, 1, PF_IDLE_TOKENS, 1, seed, NULL, NULL)) return -3;
            (g < 0 ? ref : t[g])[r] = bench_now_s() - t0;
        }
    p->idle_step_s = median_of(ref, reps);
    for (int g = 0; g < PF_IDLE_GAPS; g++) {
        double e = median_of(t[g], reps) - p->idle_step_s;
        p->idle_gap_s[g] = pf_idle_gaps[g];
        p->idle_extra_s[g] = e > 0 ? e : 0;
    }
    p->n_idle = PF_IDLE_GAPS;
    return 0;
}

/* The decode steps' table by batch size (plan_profile_t.batch_s): for each batch with PF_BATCH_MIN_STEPS or more
 * measured steps, the median step less its context term. The line's fit misses small batches by 10-20% on a CPU
 * (a lone row 1.15x the line, 2-8 rows 0.9x, 9 rows a step up where a vector tile of 8 rows fills), and the
 * simulator's batches are small at light load. */
#define PF_BATCH_MIN_STEPS 3
static void batch_points(const pf_points *dec, plan_profile_t *p)
{
    static double v[PF_MAX_POINTS];
    p->n_batch = 0;
    for (int32_t b = 1; p->n_batch < PLAN_MAX_BATCH_POINTS; b++) {
        int m = 0, more = 0;
        for (int i = 0; i < dec->n; i++) {
            int32_t bi = (int32_t)dec->x[2 * i];
            if (bi == b) v[m++] = dec->y[i] - dec->x[2 * i + 1] * p->decode_ctx_s;
            else if (bi > b) more = 1;
        }
        if (m >= PF_BATCH_MIN_STEPS) {
            double t = median_of(v, m);
            if (t > 0) {
                p->batch_b[p->n_batch] = b;
                p->batch_s[p->n_batch++] = t;
            }
        }
        if (!more) break;
    }
}

static char *samples_json(const pf_points *pre, const pf_points *dec)
{
    cJSON *o = cJSON_CreateObject(), *a = cJSON_AddArrayToObject(o, "prefill_tokens_prompts_s"),
          *b = cJSON_AddArrayToObject(o, "decode_batch_ctx_s");
    for (int i = 0; a && i < pre->n; i++) {
        double v[3] = {pre->x[2 * i], pre->x[2 * i + 1], pre->y[i]};
        cJSON_AddItemToArray(a, cJSON_CreateDoubleArray(v, 3));
    }
    for (int i = 0; b && i < dec->n; i++) {
        double v[3] = {dec->x[2 * i], dec->x[2 * i + 1], dec->y[i]};
        cJSON_AddItemToArray(b, cJSON_CreateDoubleArray(v, 3));
    }
    char *t = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return t;
}

int cmd_profile(int argc, char **argv)
{
    const char *model_path = NULL, *out_path = NULL, *kvx = NULL;
    long threads = 0, reps = 1, max_batch = 32, max_ctx = 512, idle_reps = 6;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "baton profile: unknown option or missing value: '%s'\n", a);
            usage(stderr);
            return 2;
        }
        i++;
        int bad = 0;
        if (!strcmp(a, "--model")) model_path = v;
        else if (!strcmp(a, "--out")) out_path = v;
        else if (!strcmp(a, "--kvx-json")) kvx = v;
        else if (!strcmp(a, "--threads")) bad = parse_long(a, v, 0, 256, &threads);
        else if (!strcmp(a, "--reps")) bad = parse_long(a, v, 1, PF_MAX_REPS, &reps);
        else if (!strcmp(a, "--idle-reps")) bad = parse_long(a, v, 0, PF_MAX_REPS, &idle_reps);
        else if (!strcmp(a, "--max-batch")) bad = parse_long(a, v, 1, 256, &max_batch);
        else if (!strcmp(a, "--max-context")) bad = parse_long(a, v, 64, 8192, &max_ctx);
        else {
            fprintf(stderr, "baton profile: unknown option '%s'\n", a);
            return 2;
        }
        if (bad) return 2;
    }
    cli_engine_env env;
    if (cli_engine_env_read("profile", (int)threads, &env)) return 2;
    char def[4096];
    if (!model_path) {
        if (bt_default_model_path(def, sizeof def)) {
            fprintf(stderr, "baton profile: %s\n", bt_last_error());
            return 1;
        }
        model_path = def;
    }
    bt_model *m;
    if (bt_model_load(model_path, &m)) {
        fprintf(stderr, "baton profile: %s\n", bt_last_error());
        return 2;
    }
    bt_backend *be;
    if (bt_backend_cpu_create(&env.cpu, &be)) {
        fprintf(stderr, "baton profile: %s\n", bt_last_error());
        bt_model_free(m);
        return 1;
    }
    int nth = bt_backend_cpu_threads(be);
    bt_sched_config cfg = {0};
    cfg.max_batch_tokens = BT_SCHED_DEFAULT_BATCH_TOKENS;
    cfg.disable_prefix_cache = 1; /* every measured token is computed */
    size_t per_tok = bt_kv_block_stride(&m->hp, BT_KV_F16) * (size_t)m->hp.n_layer / BT_KV_BLOCK;
    cfg.kv_mem = per_tok * (size_t)(max_batch * (max_ctx + 64) + 4096);
    bt_sched *s;
    if (bt_sched_create(m, be, &cfg, &s)) {
        fprintf(stderr, "baton profile: %s\n", bt_last_error());
        bt_backend_destroy(be);
        bt_model_free(m);
        return 1;
    }
    static pf_points pre = {.k = 2}, dec = {.k = 2};
    int rc = 0;
    double t_start = bench_now_s();
    const int plens[] = {16, 64, 128, 256, 384, 512};
    fprintf(stderr, "profile: warm-up\n");
    rc = run_batch(s, m, 2, 128, 2, 99, NULL, NULL); /* first steps fault pages in and fill caches: not measured */
    /* each repetition sweeps every shape, so that outside load that comes and goes hits one repetition of a shape
     * (fit_robust sets a disturbed repetition's median aside) */
    for (long r = 0; r < reps && !rc; r++) {
        pre.cur_rep = dec.cur_rep = (int)r;
        for (size_t i = 0; i < sizeof plens / sizeof *plens && !rc; i++)
            for (int k = 1; k <= 4 && !rc; k += 3) {
                fprintf(stderr, "profile: prefill %d x %d tokens (%.0f s)\n", k, plens[i], bench_now_s() - t_start);
                rc = run_batch(s, m, k, plens[i], 1, (uint64_t)(r * 100 + i * 7 + k), &pre, NULL);
            }
        /* a decode batch of b sequences of context c costs its b * c prompt tokens first: past PF_SWEEP_TOKENS only
         * the short contexts are measured, which keeps a repetition near 45 s on 2 cores */
        for (long b = 1; b <= max_batch && !rc; b *= 2)
            for (long c = 32; c <= max_ctx && !rc; c *= 4) {
                if (b * c > PF_SWEEP_TOKENS && c > 32) continue;
                fprintf(stderr, "profile: decode batch %ld, context %ld (%.0f s)\n", b, c, bench_now_s() - t_start);
                rc = run_batch(s, m, (int)b, (int)c, 12, (uint64_t)(r * 1000 + b * 13 + c), NULL, &dec);
            }
    }
    plan_profile_t p;
    memset(&p, 0, sizeof p);
    double c[3];
    double seq_s = 0, first_s = 0, sample_s = 0;
    if (!rc && idle_reps > 0) {
        fprintf(stderr, "profile: a prompt step after idling 0.1-2 s (%.0f s)\n", bench_now_s() - t_start);
        rc = measure_idle(s, m, (int)idle_reps, &p);
    }
    if (!rc) {
        fprintf(stderr, "profile: a prompt's logits row and sampling (%.0f s)\n", bench_now_s() - t_start);
        rc = measure_prompt_end(m, be, &seq_s, &first_s, &sample_s);
    }
    if (!rc && (fit_robust(&pre, 0, seq_s, c) || !(c[1] > 0))) {
        fprintf(stderr, "baton profile: the prefill steps did not fit a line (%d points)\n", pre.n);
        rc = -1;
    } else if (!rc) {
        p.prefill_fixed_s = c[0];
        p.prefill_token_s = c[1];
        p.prefill_seq_s = c[2];
    }
    if (!rc && (fit_robust(&dec, 1, -1, c) || !(c[0] > 0))) {
        fprintf(stderr, "baton profile: the decode steps did not fit (%d points)\n", dec.n);
        rc = -1;
    } else if (!rc) {
        p.decode_fixed_s = c[0];
        p.decode_seq_s = c[1];
        p.decode_ctx_s = c[2];
        batch_points(&dec, &p);
        p.prefill_spread = spread_of(&pre, 0);
        p.decode_spread = spread_of(&dec, 1);
    }
    if (!rc) {
        p.kv_bytes_per_token = (double)per_tok;
        p.chunk_tokens = BT_SCHED_DEFAULT_BATCH_TOKENS;
        p.max_running = 256;
        p.kv_tokens = (int64_t)((size_t)BT_SCHED_DEFAULT_KV_MEM / per_tok); /* a node's default --kv-mem */
        fprintf(stderr, "profile: KV copy bandwidth (%.0f s)\n", bench_now_s() - t_start);
        plan_transport_t *x = &p.xfer[p.n_xfer++];
        snprintf(x->name, sizeof x->name, "shm");
        measure_copy((double)per_tok * BT_KV_BLOCK, &x->bytes_s, &x->latency_s);
        if (kvx && merge_kvx(kvx, &p)) rc = -2;
        host_describe(nth, p.host, sizeof p.host);
        const char *base = strrchr(model_path, '/');
        snprintf(p.model, sizeof p.model, "%.127s", base ? base + 1 : model_path);
    }
    bt_sched_destroy(s);
    bt_backend_destroy(be);
    bt_model_free(m);
    if (rc) {
        /* the fit failures printed their own line; an engine failure has not */
        if (rc == -3) fprintf(stderr, "baton profile: %s\n", bt_last_error());
        return rc == -2 ? 2 : 1;
    }
    char *sj = samples_json(&pre, &dec);
    char *txt = plan_profile_to_json(&p, sj);
    free(sj);
    if (!txt) {
        fprintf(stderr, "baton profile: out of memory\n");
        return 1;
    }
    FILE *f = out_path ? fopen(out_path, "w") : stdout;
    if (!f || fprintf(f, "%s\n", txt) < 0 || (out_path && fclose(f))) {
        fprintf(stderr, "baton profile: cannot write %s: %s\n", out_path ? out_path : "stdout", strerror(errno));
        free(txt);
        return 1;
    }
    free(txt);
    fprintf(stderr,
            "profile: prefill %.2f ms + %.3f ms/token + %.3f ms/prompt (sampling %.3f of it; the first logits row, "
            "%.2f ms, is in the fixed cost; %.0f tok/s marginal); decode %.2f ms + %.3f ms/seq + %.5f "
            "ms/context token; shm %.1f GB/s; %d prefill and %d decode steps in %.0f s\n",
            p.prefill_fixed_s * 1e3, p.prefill_token_s * 1e3, p.prefill_seq_s * 1e3, sample_s * 1e3, first_s * 1e3,
            1 / p.prefill_token_s, p.decode_fixed_s * 1e3,
            p.decode_seq_s * 1e3, p.decode_ctx_s * 1e3, p.xfer[0].bytes_s / 1e9, pre.n, dec.n, bench_now_s() - t_start);
    fprintf(stderr, "profile: steps scatter by %.0f%% (prefill) and %.0f%% (decode) around their shape's median",
            100 * p.prefill_spread, 100 * p.decode_spread);
    if (p.n_idle) {
        fprintf(stderr, "; a %.1f ms prompt step takes", p.idle_step_s * 1e3);
        for (int i = 0; i < p.n_idle; i++)
            fprintf(stderr, "%s +%.1f ms after %.1f s idle", i ? "," : "", p.idle_extra_s[i] * 1e3, p.idle_gap_s[i]);
    }
    fprintf(stderr, "\n");
    return 0;
}
