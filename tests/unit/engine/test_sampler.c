/* Sampler tests (engine/sampler.c, included so the test needs only baton_common): exact distributions against a
 * straightforward full-sort reference, chi-square goodness of fit of the draws, determinism under any call order,
 * penalties and logit bias, raw top-n logprobs, n > 1 streams, stop / max_tokens, parameter validation, and a
 * micro-benchmark printout. */
#include "engine/sampler.c"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "test_util.h"

static uint64_t rng_state = 0x5EED5A3B1E5ull;

static double urand(void) { return (double)(test_rand_next(&rng_state) >> 11) * 0x1p-53; }

static double nrand(void)
{
    double u1 = urand(), u2 = urand();
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static bt_sampler_seq *mkseq(const bt_sampling *sp, int32_t n_vocab, const int32_t *prompt, int32_t n_prompt,
                             int32_t index)
{
    bt_sampler_seq *s = NULL;
    bt_status st = bt_sampler_seq_create(sp, n_vocab, prompt, n_prompt, NULL, 0, index, &s);
    if (st) fprintf(stderr, "bt_sampler_seq_create: %s\n", bt_last_error());
    return s;
}

/* ---- the reference: every step spelled out, full sort, double precision ---- */

static const float *ref_key;
static int ref_cmp(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (ref_key[x] != ref_key[y]) return ref_key[x] > ref_key[y] ? -1 : 1;
    return (x > y) - (x < y);
}

/* Patched logits exactly as the formulas say (float arithmetic in the same order as vLLM's). */
static void ref_patch(const bt_sampling *sp, const float *logits, int32_t n, const int32_t *prompt, int32_t n_prompt,
                      const int32_t *gen, int32_t n_gen, float *v)
{
    for (int32_t i = 0; i < n; i++) v[i] = logits[i];
    for (int32_t b = 0; b < sp->n_logit_bias; b++) v[sp->logit_bias[b].id] += sp->logit_bias[b].bias;
    for (int32_t i = 0; i < n; i++) {
        int32_t count = 0, seen = 0;
        for (int32_t j = 0; j < n_gen; j++) count += gen[j] == i;
        for (int32_t j = 0; j < n_prompt; j++) seen |= prompt[j] == i;
        if (count || seen) v[i] = v[i] > 0.0f ? v[i] / sp->repetition_penalty : v[i] * sp->repetition_penalty;
        v[i] -= sp->frequency_penalty * (float)count;
        v[i] -= sp->presence_penalty * (float)(count > 0);
    }
}

static void ref_probs(const bt_sampling *sp, const float *logits, int32_t n, const int32_t *prompt, int32_t n_prompt,
                      const int32_t *gen, int32_t n_gen, double *p)
{
    float *v = malloc(sizeof *v * (size_t)n);
    int32_t *ord = malloc(sizeof *ord * (size_t)n);
    ref_patch(sp, logits, n, prompt, n_prompt, gen, n_gen, v);
    for (int32_t i = 0; i < n; i++) ord[i] = i;
    ref_key = v;
    qsort(ord, (size_t)n, sizeof *ord, ref_cmp);
    for (int32_t i = 0; i < n; i++) p[i] = 0;
    if (sp->temperature < 1e-5f || sp->top_k == 1 || n == 1) {
        p[ord[0]] = 1;
        goto out;
    }
    double vmax = v[ord[0]];
    int32_t k = 0; /* survivors: ord[0, k) */
    for (int32_t j = 0; j < n; j++) /* min-p: p_i / p_max >= min_p */
        if (sp->min_p <= 0.0f || ((double)v[ord[j]] - vmax) / sp->temperature >= log((double)sp->min_p))
            ord[k++] = ord[j];
    if (sp->top_k > 0 && sp->top_k < k) k = sp->top_k;
    double z = 0;
    for (int32_t j = 0; j < k; j++) z += exp(((double)v[ord[j]] - vmax) / sp->temperature);
    if (sp->top_p < 1.0f) {
        double acc = 0;
        int32_t kk = 0;
        while (kk < k && acc < sp->top_p) acc += exp(((double)v[ord[kk++]] - vmax) / sp->temperature) / z;
        k = kk;
        z = 0;
        for (int32_t j = 0; j < k; j++) z += exp(((double)v[ord[j]] - vmax) / sp->temperature);
    }
    for (int32_t j = 0; j < k; j++) p[ord[j]] = exp(((double)v[ord[j]] - vmax) / sp->temperature) / z;
out:
    free(v);
    free(ord);
}

/* Compares bt_sampler_probs with the reference; returns the largest absolute difference, or 1 when the kept sets
 * differ. */
static double probs_vs_ref(const bt_sampling *sp, const float *logits, int32_t n, const int32_t *prompt,
                           int32_t n_prompt, const int32_t *gen, int32_t n_gen)
{
    bt_sampler_seq *s = mkseq(sp, n, prompt, n_prompt, 0);
    if (!s) return 1;
    for (int32_t j = 0; j < n_gen; j++) bt_sampler_seq_accept(s, gen[j], NULL);
    float *scratch = malloc(sizeof *scratch * (size_t)bt_sampler_scratch_floats(n));
    float *probs = malloc(sizeof *probs * (size_t)n);
    double *ref = malloc(sizeof *ref * (size_t)n);
    bt_sampler_probs(s, logits, scratch, probs);
    ref_probs(sp, logits, n, prompt, n_prompt, gen, n_gen, ref);
    double worst = 0;
    for (int32_t i = 0; i < n; i++) {
        if ((probs[i] > 0) != (ref[i] > 0)) {
            worst = 1;
            break;
        }
        double d = fabs(probs[i] - ref[i]);
        if (d > worst) worst = d;
    }
    free(scratch);
    free(probs);
    free(ref);
    bt_sampler_seq_free(s);
    return worst;
}

static void test_exact_distribution_random(void)
{
    static const float temps[] = {0.0f, 0.7f, 1.0f, 1.3f, 2.9f};
    static const float top_ps[] = {1.0f, 0.91f, 0.537f, 0.2718f, 0.993f};
    static const float min_ps[] = {0.0f, 0.013f, 0.097f, 0.43f};
    static const int32_t sizes[] = {1, 2, 7, 64, 1000, 5000, 49152};
    int trials = 0;
    for (int t = 0; t < 400; t++) {
        int32_t n = sizes[t % 7 == 6 ? (t % 3 == 0 ? 6 : 5) : t % 6];
        if (n == 49152 && t > 120) n = 3000; /* a few full-size vocabularies are enough */
        float *logits = malloc(sizeof *logits * (size_t)n);
        double scale = 0.5 + 4.0 * urand();
        int quantise = t % 3 == 0; /* many exact ties */
        for (int32_t i = 0; i < n; i++) {
            double x = nrand() * scale;
            logits[i] = quantise ? (float)(floor(x * 4) / 4) : (float)x;
        }
        bt_sampling sp = bt_sampling_default();
        sp.temperature = temps[test_rand_next(&rng_state) % 5];
        sp.top_p = top_ps[test_rand_next(&rng_state) % 5];
        sp.min_p = min_ps[test_rand_next(&rng_state) % 4];
        int32_t ks[] = {0, 0, 1, 2, 5, 50, n - 1, n, n + 5};
        sp.top_k = ks[test_rand_next(&rng_state) % 9];
        if (sp.top_k < 0) sp.top_k = 0;
        int32_t prompt[64], gen[64], n_prompt = 0, n_gen = 0;
        if (t % 2) {
            sp.repetition_penalty = (float)(0.5 + 1.5 * urand());
            sp.frequency_penalty = (float)(4 * urand() - 2);
            sp.presence_penalty = (float)(4 * urand() - 2);
            n_prompt = (int32_t)(test_rand_next(&rng_state) % 64);
            n_gen = (int32_t)(test_rand_next(&rng_state) % 64);
            for (int32_t j = 0; j < n_prompt; j++) prompt[j] = (int32_t)(test_rand_next(&rng_state) % (uint64_t)n);
            for (int32_t j = 0; j < n_gen; j++) gen[j] = (int32_t)(test_rand_next(&rng_state) % (uint64_t)n);
        }
        if (t % 4 == 1) {
            sp.n_logit_bias = (int32_t)(test_rand_next(&rng_state) % 20);
            if (sp.n_logit_bias > n) sp.n_logit_bias = n;
            for (int32_t b = 0; b < sp.n_logit_bias; b++) {
                sp.logit_bias[b].id = (int32_t)(((uint64_t)b * 7919u + (uint64_t)t) % (uint64_t)n);
                for (int32_t c = 0; c < b; c++) /* keep ids distinct */
                    if (sp.logit_bias[c].id == sp.logit_bias[b].id) sp.logit_bias[b].id = -1;
                sp.logit_bias[b].bias = (float)(20 * urand() - 10);
            }
            int32_t kept = 0;
            for (int32_t b = 0; b < sp.n_logit_bias; b++)
                if (sp.logit_bias[b].id >= 0) sp.logit_bias[kept++] = sp.logit_bias[b];
            sp.n_logit_bias = kept;
        }
        double worst = probs_vs_ref(&sp, logits, n, prompt, n_prompt, gen, n_gen);
        CHECK_MSG(worst <= 2e-5, "trial %d n=%d T=%g top_k=%d top_p=%g min_p=%g: max |p - ref| = %g", t, (int)n,
                  sp.temperature, (int)sp.top_k, sp.top_p, sp.min_p, worst);
        trials++;
        free(logits);
    }
    CHECK(trials == 400);
}

/* ---- chi-square goodness of fit of the actual draws ---- */

/* Upper critical value of chi-square with df degrees of freedom at significance 1e-4 (Wilson-Hilferty). */
static double chi2_crit_1e4(int df)
{
    const double z = 3.7190;
    double a = 2.0 / (9.0 * df);
    return df * pow(1 - a + z * sqrt(a), 3);
}

/* Draws `draws` tokens from s at positions 0.. and tests the counts against the reference distribution p. Tokens
 * of probability 0 must never come out; bins are merged (most likely first) until each expects >= 20 draws.
 * Returns 1 when the fit passes. */
static int chi2_fit(const bt_sampler_seq *s, const float *logits, int32_t n, const double *p, int draws,
                    const char *what)
{
    float *scratch = malloc(sizeof *scratch * (size_t)bt_sampler_scratch_floats(n));
    int64_t *count = calloc((size_t)n, sizeof *count);
    int impossible = 0;
    for (int i = 0; i < draws; i++) {
        int32_t id = bt_sampler_sample(s, logits, i, scratch, NULL);
        count[id]++;
        impossible += p[id] <= 0;
    }
    int32_t *ord = malloc(sizeof *ord * (size_t)n);
    float *pk = malloc(sizeof *pk * (size_t)n);
    for (int32_t i = 0; i < n; i++) {
        ord[i] = i;
        pk[i] = (float)p[i];
    }
    ref_key = pk;
    qsort(ord, (size_t)n, sizeof *ord, ref_cmp);
    double stat = 0, e = 0, o = 0;
    int bins = 0;
    for (int32_t j = 0; j < n && p[ord[j]] > 0; j++) {
        e += p[ord[j]] * draws;
        o += (double)count[ord[j]];
        int last = j + 1 == n || p[ord[j + 1]] <= 0;
        if (e >= 20 || last) {
            stat += (o - e) * (o - e) / (e > 0 ? e : 1e-300);
            bins++;
            e = o = 0;
        }
    }
    int df = bins > 1 ? bins - 1 : 1;
    double crit = chi2_crit_1e4(df);
    fprintf(stderr, "  chi2 %-34s bins %5d  stat %9.2f  crit(1e-4) %9.2f%s\n", what, bins, stat, crit,
            impossible ? "  IMPOSSIBLE TOKENS DRAWN" : "");
    free(scratch);
    free(count);
    free(ord);
    free(pk);
    return !impossible && (bins == 1 || stat < crit);
}

static void test_chi_square(void)
{
    /* 16 logits in no particular id order, so "most likely" and "lowest id" disagree */
    static const float base[16] = {0.3f, 2.0f, -1.0f, 1.4f, -4.0f, 0.7f, 1.5f, -0.2f,
                                   -2.5f, 0.0f, 1.0f, -1.3f, 0.5f, -3.0f, -0.5f, -2.0f};
    struct {
        const char *name;
        float t, top_p, min_p;
        int32_t top_k;
        float rep, freq, pres;
        int bias;
    } cfg[] = {
        {"T=1", 1.0f, 1.0f, 0.0f, 0, 1, 0, 0, 0},
        {"T=0.5", 0.5f, 1.0f, 0.0f, 0, 1, 0, 0, 0},
        {"T=2.5", 2.5f, 1.0f, 0.0f, 0, 1, 0, 0, 0},
        {"top_k=5", 1.0f, 1.0f, 0.0f, 5, 1, 0, 0, 0},
        {"top_p=0.8", 1.0f, 0.8f, 0.0f, 0, 1, 0, 0, 0},
        {"min_p=0.1", 1.0f, 1.0f, 0.1f, 0, 1, 0, 0, 0},
        {"T=1.3 top_k=8 top_p=0.9", 1.3f, 0.9f, 0.0f, 8, 1, 0, 0, 0},
        {"T=0.8 min_p=0.05 top_p=0.7", 0.8f, 0.7f, 0.05f, 0, 1, 0, 0, 0},
        {"T=1.7 top_k=10 top_p=0.95 min_p=0.02", 1.7f, 0.95f, 0.02f, 10, 1, 0, 0, 0},
        {"penalties + bias, top_p=0.9", 1.0f, 0.9f, 0.0f, 0, 1.3f, 0.4f, 0.6f, 1},
    };
    const int draws = 200000;
    const int32_t prompt[] = {1, 3, 3, 6}, gen[] = {1, 10, 10, 10, 5};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        bt_sampling sp = bt_sampling_default();
        sp.temperature = cfg[c].t;
        sp.top_p = cfg[c].top_p;
        sp.min_p = cfg[c].min_p;
        sp.top_k = cfg[c].top_k;
        sp.repetition_penalty = cfg[c].rep;
        sp.frequency_penalty = cfg[c].freq;
        sp.presence_penalty = cfg[c].pres;
        sp.seed = 20261129u + c;
        if (cfg[c].bias) {
            sp.n_logit_bias = 2;
            sp.logit_bias[0] = (bt_logit_bias){.id = 4, .bias = 5.0f};
            sp.logit_bias[1] = (bt_logit_bias){.id = 6, .bias = -1.5f};
        }
        int hist = cfg[c].rep != 1 || cfg[c].freq != 0 || cfg[c].pres != 0;
        bt_sampler_seq *s = mkseq(&sp, 16, prompt, hist ? 4 : 0, 0);
        REQUIRE(s);
        if (hist)
            for (int j = 0; j < 5; j++) bt_sampler_seq_accept(s, gen[j], NULL);
        double p[16];
        ref_probs(&sp, base, 16, prompt, hist ? 4 : 0, gen, hist ? 5 : 0, p);
        CHECK_MSG(chi2_fit(s, base, 16, p, draws, cfg[c].name), "%s", cfg[c].name);
        bt_sampler_seq_free(s);
    }

    /* a wider, LM-like vocabulary through the candidate/heap paths */
    const int32_t n = 4096;
    float *logits = malloc(sizeof *logits * n);
    for (int32_t i = 0; i < n; i++) logits[i] = (float)(nrand() * 2.0);
    logits[17] = 9.0f;
    logits[3000] = 8.2f;
    struct {
        const char *name;
        float t, top_p, min_p;
        int32_t top_k;
    } wide[] = {
        {"4096: T=1 top_p=0.9", 1.0f, 0.9f, 0.0f, 0},
        {"4096: T=1.2 top_k=300 top_p=0.97", 1.2f, 0.97f, 0.0f, 300},
        {"4096: T=1.5 min_p=0.002", 1.5f, 1.0f, 0.002f, 0},
    };
    for (size_t c = 0; c < sizeof wide / sizeof wide[0]; c++) {
        bt_sampling sp = bt_sampling_default();
        sp.temperature = wide[c].t;
        sp.top_p = wide[c].top_p;
        sp.min_p = wide[c].min_p;
        sp.top_k = wide[c].top_k;
        sp.seed = 77 + c;
        bt_sampler_seq *s = mkseq(&sp, n, NULL, 0, 0);
        REQUIRE(s);
        double *p = malloc(sizeof *p * n);
        ref_probs(&sp, logits, n, NULL, 0, NULL, 0, p);
        CHECK_MSG(chi2_fit(s, logits, n, p, 60000, wide[c].name), "%s", wide[c].name);
        free(p);
        bt_sampler_seq_free(s);
    }
    free(logits);
}

/* The draw itself must be an exact inverse CDF: with u fixed, the token is the one whose cumulative interval
 * (in draw order) holds u. Checked on a tiny case by hand: weights 1 : 3 after top-k 2. */
static void test_draw_by_hand(void)
{
    const float logits[4] = {0.0f, logf(3.0f), -5.0f, -6.0f};
    bt_sampling sp = bt_sampling_default();
    sp.temperature = 1.0f;
    sp.top_k = 2;
    float scratch[8];
    for (int64_t pos = 0; pos < 200; pos++) {
        double u = bt_rng_uniform(sp.seed, pos);
        int32_t want = u < 0.75 ? 1 : 0; /* draw order is most likely first */
        CHECK(bt_sample(&sp, logits, 4, pos, scratch, NULL) == want);
    }
}

/* ---- determinism ---- */

/* Logits that depend on (sequence, position, previous token): a stand-in for a model. */
static void fake_logits(int seq, int64_t pos, int32_t prev, int32_t n, float *out)
{
    uint64_t st = (uint64_t)seq * 1000003u + (uint64_t)pos * 7919u + (uint64_t)prev * 104729u + 1;
    for (int32_t i = 0; i < n; i++) {
        uint64_t r = test_rand_next(&st);
        out[i] = (float)((double)(r >> 40) / (double)(1ull << 24) * 6.0 - 3.0);
    }
    out[(prev * 31 + 7) % n] += 2.0f;
}

#define DET_SEQS 5
#define DET_STEPS 48
#define DET_VOCAB 700

static void run_sequences(const int *order, int n_order, int32_t toks[DET_SEQS][DET_STEPS])
{
    bt_sampling sp[DET_SEQS];
    bt_sampler_seq *s[DET_SEQS];
    int step[DET_SEQS] = {0};
    int32_t prompt[3] = {5, 9, 5};
    for (int q = 0; q < DET_SEQS; q++) {
        sp[q] = bt_sampling_default();
        sp[q].temperature = 0.6f + 0.3f * (float)q;
        sp[q].seed = 1000 + (uint64_t)q;
        sp[q].top_p = q % 2 ? 0.9f : 1.0f;
        sp[q].top_k = q == 2 ? 40 : 0;
        sp[q].min_p = q == 3 ? 0.05f : 0.0f;
        sp[q].repetition_penalty = q >= 3 ? 1.2f : 1.0f;
        sp[q].frequency_penalty = q == 4 ? 0.5f : 0.0f;
        sp[q].presence_penalty = q == 1 ? 0.7f : 0.0f;
        s[q] = mkseq(&sp[q], DET_VOCAB, prompt, 3, 0);
    }
    float logits[DET_VOCAB], scratch[2 * DET_VOCAB];
    for (int k = 0; k < n_order; k++) {
        int q = order[k];
        int64_t pos = 3 + step[q];
        int32_t prev = step[q] ? toks[q][step[q] - 1] : 5;
        fake_logits(q, pos, prev, DET_VOCAB, logits);
        int32_t id = bt_sampler_sample(s[q], logits, pos, scratch, NULL);
        bt_sampler_seq_accept(s[q], id, NULL);
        toks[q][step[q]++] = id;
    }
    for (int q = 0; q < DET_SEQS; q++) bt_sampler_seq_free(s[q]);
}

static void test_determinism_any_order(void)
{
    int order[DET_SEQS * DET_STEPS];
    int32_t alone[DET_SEQS][DET_STEPS], mixed[DET_SEQS][DET_STEPS], again[DET_SEQS][DET_STEPS];
    int k = 0;
    for (int q = 0; q < DET_SEQS; q++) /* each sequence alone, one after another */
        for (int j = 0; j < DET_STEPS; j++) order[k++] = q;
    run_sequences(order, k, alone);
    for (int trial = 0; trial < 3; trial++) {
        int left[DET_SEQS];
        for (int q = 0; q < DET_SEQS; q++) left[q] = DET_STEPS;
        for (k = 0; k < DET_SEQS * DET_STEPS;) { /* random interleaving, like batches of varying composition */
            int q = (int)(test_rand_next(&rng_state) % DET_SEQS);
            if (!left[q]) continue;
            left[q]--;
            order[k++] = q;
        }
        run_sequences(order, k, trial ? again : mixed);
        CHECK(!memcmp(alone, trial ? again : mixed, sizeof alone));
    }
    int distinct = 0;
    for (int j = 1; j < DET_STEPS; j++) distinct += alone[1][j] != alone[1][0];
    CHECK(distinct > 0); /* the sequences really sample */

    /* bt_sample (stateless) and a history-free bt_sampler_seq agree token for token */
    bt_sampling sp = bt_sampling_default();
    sp.temperature = 0.9f;
    sp.top_p = 0.95f;
    sp.seed = 42;
    bt_sampler_seq *s = mkseq(&sp, DET_VOCAB, NULL, 0, 0);
    REQUIRE(s);
    float logits[DET_VOCAB], scratch[2 * DET_VOCAB];
    int same = 1;
    for (int64_t pos = 0; pos < 100; pos++) {
        fake_logits(9, pos, 0, DET_VOCAB, logits);
        float lp;
        bt_sample_out out;
        int32_t a = bt_sample(&sp, logits, DET_VOCAB, pos, scratch, &lp);
        int32_t b = bt_sampler_sample(s, logits, pos, scratch, &out);
        same &= a == b && out.id == b;
    }
    CHECK(same);
    bt_sampler_seq_free(s);
}

/* ---- penalties and bias by hand ---- */

static void test_penalties_by_hand(void)
{
    const float logits[5] = {1.0f, -1.0f, 2.0f, 0.5f, 0.0f};
    bt_sampling sp = bt_sampling_default();
    sp.temperature = 1.0f;
    sp.repetition_penalty = 2.0f;
    sp.frequency_penalty = 0.5f;
    sp.presence_penalty = 0.25f;
    sp.n_logit_bias = 1;
    sp.logit_bias[0] = (bt_logit_bias){.id = 3, .bias = 1.5f};
    const int32_t prompt[] = {0, 0, 4};
    bt_sampler_seq *s = mkseq(&sp, 5, prompt, 3, 0);
    REQUIRE(s);
    bt_finish f;
    CHECK(bt_sampler_seq_accept(s, 1, &f) == BT_OK && f == BT_FINISH_NONE);
    CHECK(bt_sampler_seq_accept(s, 1, &f) == BT_OK);
    CHECK(bt_sampler_seq_accept(s, 3, &f) == BT_OK);
    /* token 0: prompt, positive: 1 / 2 = 0.5
     * token 1: generated twice, negative: -1 * 2 = -2, - 0.5 * 2 = -3, - 0.25 = -3.25
     * token 2: unseen: 2
     * token 3: bias 0.5 + 1.5 = 2, generated once: 2 / 2 = 1, - 0.5 = 0.5, - 0.25 = 0.25
     * token 4: prompt, zero: 0 * 2 = 0 */
    const double want_l[5] = {0.5, -3.25, 2.0, 0.25, 0.0};
    double z = 0, want[5];
    for (int i = 0; i < 5; i++) z += exp(want_l[i]);
    for (int i = 0; i < 5; i++) want[i] = exp(want_l[i]) / z;
    float probs[5], scratch[10];
    bt_sampler_probs(s, logits, scratch, probs);
    for (int i = 0; i < 5; i++) CHECK_MSG(fabs(probs[i] - want[i]) < 1e-6, "token %d: %g vs %g", i, probs[i], want[i]);

    /* rollback forgets generated tokens: back to a single accepted 1 */
    CHECK(bt_sampler_seq_rollback(s, 2) == BT_OK);
    CHECK(bt_sampler_seq_n_generated(s) == 1);
    const double want_l2[5] = {0.5, -2.0 - 0.5 - 0.25, 2.0, 2.0, 0.0};
    z = 0;
    for (int i = 0; i < 5; i++) z += exp(want_l2[i]);
    bt_sampler_probs(s, logits, scratch, probs);
    for (int i = 0; i < 5; i++) CHECK(fabs(probs[i] - exp(want_l2[i]) / z) < 1e-6);
    CHECK(bt_sampler_seq_rollback(s, 2) == BT_ERR_INVALID);
    bt_sampler_seq_free(s);

    /* greedy honours bias and penalties: -100 removes the argmax, +100 forces a token */
    sp = bt_sampling_default();
    sp.n_logit_bias = 1;
    sp.logit_bias[0] = (bt_logit_bias){.id = 2, .bias = -100.0f};
    CHECK(bt_sample(&sp, logits, 5, 0, scratch, NULL) == 0);
    sp.logit_bias[0] = (bt_logit_bias){.id = 1, .bias = 100.0f};
    CHECK(bt_sample(&sp, logits, 5, 0, scratch, NULL) == 1);
    sp = bt_sampling_default();
    sp.presence_penalty = 2.0f;
    s = mkseq(&sp, 5, NULL, 0, 0);
    REQUIRE(s);
    CHECK(bt_sampler_sample(s, logits, 0, scratch, NULL) == 2);
    bt_sampler_seq_accept(s, 2, NULL);
    CHECK(bt_sampler_sample(s, logits, 1, scratch, NULL) == 0); /* 2 - 2 = 0 < 1 */
    bt_sampler_seq_free(s);

    /* frequency/presence count only generated tokens: a prompt-only token is untouched */
    sp = bt_sampling_default();
    sp.frequency_penalty = 2.0f;
    const int32_t p2[] = {2, 2, 2};
    s = mkseq(&sp, 5, p2, 3, 0);
    REQUIRE(s);
    CHECK(bt_sampler_sample(s, logits, 0, scratch, NULL) == 2);
    bt_sampler_seq_free(s);

    /* ties: lowest id under greedy and top_k 1 */
    const float tie[4] = {0.0f, 3.0f, 3.0f, 3.0f};
    sp = bt_sampling_default();
    CHECK(bt_sample(&sp, tie, 4, 0, scratch, NULL) == 1);
    sp.temperature = 1.0f;
    sp.top_k = 1;
    CHECK(bt_sample(&sp, tie, 4, 0, scratch, NULL) == 1);
}

/* Greedy over vocabularies of every size up to a few blocks of the argmax pass (2,048 ids), against a plain scan:
 * the maximum in the tail, ties within and across blocks (the lowest id), -inf everywhere, NaN (never the maximum;
 * first: id 0). */
static int32_t ref_argmax(const float *x, int32_t n)
{
    if (x[0] != x[0]) return 0;
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best] || (x[best] != x[best] && x[i] == x[i])) best = i;
    return best;
}

static void test_greedy_argmax(void)
{
    const int32_t nmax = 5000;
    float *x = malloc(sizeof *x * (size_t)nmax), *scratch = malloc(sizeof *scratch * 2 * (size_t)nmax);
    REQUIRE(x && scratch);
    bt_sampling sp = bt_sampling_default();
    uint64_t st = 7;
    const int32_t sizes[] = {1, 2, 3, 15, 16, 17, 31, 2047, 2048, 2049, 4096, 4111, 5000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int32_t n = sizes[k];
        for (int trial = 0; trial < 12; trial++) {
            for (int32_t i = 0; i < n; i++) x[i] = (float)(test_rand_next(&st) % 64) - 32.0f; /* many ties */
            if (trial == 1) x[n - 1] = 100.0f;                                              /* the last id */
            if (trial == 2 && n > 2) x[n - 1] = x[n / 2] = 100.0f; /* a tie across blocks */
            if (trial == 3)
                for (int32_t i = 0; i < n; i++) x[i] = -INFINITY;
            if (trial == 4) x[test_rand_next(&st) % n] = NAN;
            if (trial == 5) x[0] = NAN;
            if (trial == 6 && n > 1) x[1] = NAN, x[n - 1] = 1000.0f; /* a NaN early must not hide a later maximum */
            if (trial == 7)
                for (int32_t i = 0; i < n; i++) x[i] = NAN;
            if (trial == 8 && n > 1) x[0] = -INFINITY, x[n - 1] = -1e30f;
            int32_t got = bt_sample(&sp, x, n, 0, scratch, NULL), want = ref_argmax(x, n);
            CHECK_MSG(got == want, "n %d trial %d: greedy %d, want %d", n, trial, got, want);
        }
    }
    free(x);
    free(scratch);
}

/* ---- logprobs ---- */

static void test_top_logprobs(void)
{
    for (int t = 0; t < 40; t++) {
        int32_t n = t < 20 ? 1 + t * 3 : 2000 + t * 997;
        float *logits = malloc(sizeof *logits * (size_t)n), *scratch = malloc(sizeof(float) * 2 * (size_t)n);
        for (int32_t i = 0; i < n; i++) {
            double x = nrand() * 3;
            logits[i] = t % 2 ? (float)(floor(x * 2) / 2) : (float)x; /* odd trials: many ties */
        }
        bt_sampling sp = bt_sampling_default();
        sp.temperature = 1.0f;
        sp.logprobs = true;
        sp.top_logprobs = t % 21;
        sp.seed = (uint64_t)t;
        sp.repetition_penalty = 1.5f; /* logprobs ignore processing: raw log-softmax */
        sp.n_logit_bias = 1;
        sp.logit_bias[0] = (bt_logit_bias){.id = 0, .bias = 7.0f};
        int32_t prompt[2] = {0, n - 1};
        bt_sampler_seq *s = mkseq(&sp, n, prompt, 2, 0);
        REQUIRE(s);
        bt_sample_out out;
        int32_t id = bt_sampler_sample(s, logits, t, scratch, &out);
        double m = -INFINITY, z = 0;
        for (int32_t i = 0; i < n; i++) m = fmax(m, logits[i]);
        for (int32_t i = 0; i < n; i++) z += exp((double)logits[i] - m);
        double lse = m + log(z);
        int32_t *ord = malloc(sizeof *ord * (size_t)n);
        for (int32_t i = 0; i < n; i++) ord[i] = i;
        ref_key = logits;
        qsort(ord, (size_t)n, sizeof *ord, ref_cmp);
        int32_t rank = 0;
        while (ord[rank] != id) rank++;
        CHECK(out.id == id);
        CHECK_MSG(fabs(out.logprob - (logits[id] - lse)) < 1e-5, "chosen logprob %g vs %g", out.logprob,
                  logits[id] - lse);
        CHECK(fabs(bt_logprob(logits, n, id) - (logits[id] - lse)) < 1e-5);
        CHECK(out.rank == rank + 1);
        int32_t want_n = sp.top_logprobs < n ? sp.top_logprobs : n;
        CHECK(out.n_top == want_n);
        for (int32_t j = 0; j < out.n_top && j < want_n; j++) {
            CHECK_MSG(out.top[j].id == ord[j], "top[%d] id %d vs %d", (int)j, (int)out.top[j].id, (int)ord[j]);
            CHECK(fabs(out.top[j].logprob - (logits[ord[j]] - lse)) < 1e-5);
        }
        free(ord);
        free(logits);
        free(scratch);
        bt_sampler_seq_free(s);
    }
    /* logprobs off: nothing reported */
    bt_sampling sp = bt_sampling_default();
    bt_sampler_seq *s = mkseq(&sp, 3, NULL, 0, 0);
    REQUIRE(s);
    const float l3[3] = {1, 2, 3};
    float scratch[6];
    bt_sample_out out;
    CHECK(bt_sampler_sample(s, l3, 0, scratch, &out) == 2 && out.n_top == 0 && out.rank == 0);
    bt_sampler_seq_free(s);
}

/* ---- n > 1 ---- */

static void test_parallel_samples(void)
{
    enum { N = 4, V = 1000, STEPS = 32 };
    bt_sampling sp = bt_sampling_default();
    sp.temperature = 1.0f;
    sp.top_p = 0.95f;
    sp.n = N;
    sp.seed = 31337;
    sp.presence_penalty = 0.3f;
    sp.repetition_penalty = 1.1f; /* the prompt's token set is copied by fork */
    const int32_t prompt[] = {1, 2, 3};
    float logits[V], scratch[2 * V];
    int32_t toks[2][N][STEPS];
    for (int run = 0; run < 2; run++) {
        bt_sampler_seq *s[N];
        s[0] = mkseq(&sp, V, prompt, 3, 0);
        REQUIRE(s[0]);
        for (int i = 1; i < N; i++) REQUIRE(bt_sampler_seq_fork(s[0], i, &s[i]) == BT_OK);
        /* run 0 steps samples in order, run 1 in reverse: order must not matter */
        for (int j = 0; j < STEPS; j++) {
            for (int k = 0; k < N; k++) {
                int i = run ? N - 1 - k : k;
                fake_logits(0, 3 + j, j ? toks[run][i][j - 1] : 3, V, logits);
                toks[run][i][j] = bt_sampler_sample(s[i], logits, 3 + j, scratch, NULL);
                bt_sampler_seq_accept(s[i], toks[run][i][j], NULL);
            }
        }
        for (int i = 0; i < N; i++) bt_sampler_seq_free(s[i]);
    }
    CHECK(!memcmp(toks[0], toks[1], sizeof toks[0]));
    for (int a = 0; a < N; a++)
        for (int b = a + 1; b < N; b++) CHECK_MSG(memcmp(toks[0][a], toks[0][b], sizeof toks[0][a]), "%d == %d", a, b);

    /* sample 0 of n draws what an n = 1 request with the same seed draws */
    sp.n = 1;
    bt_sampler_seq *one = mkseq(&sp, V, prompt, 3, 0);
    REQUIRE(one);
    int same = 1;
    for (int j = 0; j < STEPS; j++) {
        fake_logits(0, 3 + j, j ? toks[0][0][j - 1] : 3, V, logits);
        int32_t id = bt_sampler_sample(one, logits, 3 + j, scratch, NULL);
        same &= id == toks[0][0][j];
        bt_sampler_seq_accept(one, id, NULL);
    }
    CHECK(same);
    bt_sampler_seq_free(one);

    /* the streams are independent: over many positions their uniforms are uncorrelated and uniform */
    double sxy = 0, sx = 0, sy = 0;
    int same_bucket = 0;
    const int M = 100000;
    for (int64_t pos = 0; pos < M; pos++) {
        double x = bt_rng_uniform_stream(9, 0, pos), y = bt_rng_uniform_stream(9, 1, pos);
        sx += x;
        sy += y;
        sxy += x * y;
        same_bucket += (int)(x * 10) == (int)(y * 10);
    }
    double cov = sxy / M - (sx / M) * (sy / M);
    CHECK_MSG(fabs(cov / (1.0 / 12)) < 0.02, "stream correlation %g", cov * 12);
    CHECK(fabs(sx / M - 0.5) < 0.005 && fabs(sy / M - 0.5) < 0.005);
    CHECK(abs(same_bucket - M / 10) < 600);
    CHECK(bt_rng_uniform_stream(9, 0, 5) == bt_rng_uniform(9, 5));
}

/* ---- stop ids, eos, max_tokens ---- */

static void test_finish(void)
{
    bt_sampling sp = bt_sampling_default();
    sp.max_tokens = 4;
    sp.n_stop_ids = 2;
    sp.stop_ids[0] = 7;
    sp.stop_ids[1] = 8;
    const int32_t eos[] = {0, 1};
    bt_sampler_seq *s = NULL;
    REQUIRE(bt_sampler_seq_create(&sp, 10, NULL, 0, eos, 2, 0, &s) == BT_OK);
    bt_finish f;
    CHECK(bt_sampler_seq_remaining(s) == 4);
    CHECK(bt_sampler_seq_accept(s, 5, &f) == BT_OK && f == BT_FINISH_NONE);
    CHECK(bt_sampler_seq_accept(s, 8, &f) == BT_OK && f == BT_FINISH_STOP);
    CHECK(bt_sampler_seq_rollback(s, 1) == BT_OK);
    CHECK(bt_sampler_seq_accept(s, 1, &f) == BT_OK && f == BT_FINISH_STOP);
    CHECK(bt_sampler_seq_rollback(s, 1) == BT_OK);
    CHECK(bt_sampler_seq_accept(s, 5, &f) == BT_OK && f == BT_FINISH_NONE);
    CHECK(bt_sampler_seq_accept(s, 5, &f) == BT_OK && f == BT_FINISH_NONE);
    CHECK(bt_sampler_seq_remaining(s) == 1);
    CHECK(bt_sampler_seq_accept(s, 7, &f) == BT_OK && f == BT_FINISH_STOP); /* stop beats length */
    CHECK(bt_sampler_seq_rollback(s, 1) == BT_OK);
    CHECK(bt_sampler_seq_accept(s, 6, &f) == BT_OK && f == BT_FINISH_LENGTH);
    CHECK(bt_sampler_seq_remaining(s) == 0);
    CHECK(bt_sampler_seq_accept(s, 10, &f) == BT_ERR_INVALID);
    CHECK(bt_sampler_seq_params(s)->max_tokens == 4);
    bt_sampler_seq_free(s);

    sp = bt_sampling_default();
    sp.ignore_eos = true;
    REQUIRE(bt_sampler_seq_create(&sp, 10, NULL, 0, eos, 2, 0, &s) == BT_OK);
    CHECK(bt_sampler_seq_remaining(s) == INT32_MAX);
    for (int i = 0; i < 1000; i++) { /* long histories grow */
        CHECK(bt_sampler_seq_accept(s, i % 2, &f) == BT_OK);
        if (f != BT_FINISH_NONE) break;
    }
    CHECK(f == BT_FINISH_NONE && bt_sampler_seq_n_generated(s) == 1000);
    bt_sampler_seq_free(s);
}

/* ---- validation ---- */

/* Applies invalid case i to sp and returns the field the error must name, or NULL past the last case. */
static const char *invalid_case(int i, bt_sampling *sp)
{
    switch (i) {
    case 0: sp->temperature = -0.1f; return "temperature";
    case 1: sp->temperature = NAN; return "temperature";
    case 2: sp->temperature = 101.0f; return "temperature";
    case 3: sp->top_k = -1; return "top_k";
    case 4: sp->top_p = 0.0f; return "top_p";
    case 5: sp->top_p = 1.01f; return "top_p";
    case 6: sp->min_p = -0.5f; return "min_p";
    case 7: sp->min_p = 1.5f; return "min_p";
    case 8: sp->repetition_penalty = 0.0f; return "repetition_penalty";
    case 9: sp->repetition_penalty = NAN; return "repetition_penalty";
    case 10: sp->frequency_penalty = 2.5f; return "frequency_penalty";
    case 11: sp->presence_penalty = -2.01f; return "presence_penalty";
    case 12: sp->n_logit_bias = BT_MAX_LOGIT_BIAS + 1; return "logit_bias";
    case 13: sp->n_logit_bias = 1; sp->logit_bias[0].id = -3; return "logit_bias";
    case 14: sp->n_logit_bias = 1; sp->logit_bias[0].id = 100; return "logit_bias"; /* vocabulary of 100 */
    case 15: sp->n_logit_bias = 1; sp->logit_bias[0] = (bt_logit_bias){1, 101.0f}; return "logit_bias";
    case 16: sp->n_logit_bias = 2; sp->logit_bias[0].id = 4; sp->logit_bias[1].id = 4; return "logit_bias";
    case 17: sp->logprobs = true; sp->top_logprobs = 21; return "top_logprobs";
    case 18: sp->logprobs = true; sp->top_logprobs = -1; return "top_logprobs";
    case 19: sp->top_logprobs = 3; return "top_logprobs"; /* without logprobs */
    case 20: sp->n = 0; return "n must";
    case 21: sp->n = BT_MAX_N + 1; return "n must";
    case 22: sp->max_tokens = -1; return "max_tokens";
    case 23: sp->n_stop_ids = BT_MAX_STOP_IDS + 1; return "stop_token_ids";
    case 24: sp->n_stop_ids = 1; sp->stop_ids[0] = 100; return "stop_token_ids";
    case 25: sp->n_stop_ids = 1; sp->stop_ids[0] = -1; return "stop_token_ids";
    default: return NULL;
    }
}

static void test_invalid_params(void)
{
    int n_cases = 0;
    for (int i = 0;; i++) {
        bt_sampling sp = bt_sampling_default();
        const char *field = invalid_case(i, &sp);
        if (!field) break;
        n_cases++;
        bt_sampler_seq *s = NULL;
        bt_clear_error();
        bt_status st = bt_sampler_seq_create(&sp, 100, NULL, 0, NULL, 0, 0, &s);
        CHECK_MSG(st == BT_ERR_INVALID && !s && strstr(bt_last_error(), field), "case %d (%s): status %d, message '%s'",
                  i, field, (int)st, bt_last_error());
    }
    CHECK(n_cases == 26);
    bt_sampling sp = bt_sampling_default();
    CHECK(bt_sampling_check(&sp) == BT_OK);
    sp.n_logit_bias = 1;
    sp.logit_bias[0] = (bt_logit_bias){.id = 100, .bias = 1.0f};
    CHECK(bt_sampling_check(&sp) == BT_OK); /* ids are range-checked only against a vocabulary */
    CHECK(bt_sampling_check_vocab(&sp, 101) == BT_OK);
    CHECK(bt_sampling_check_vocab(&sp, 100) == BT_ERR_INVALID);
    sp = bt_sampling_default();
    sp.n = 2;
    bt_sampler_seq *s = NULL, *f = NULL;
    CHECK(bt_sampler_seq_create(&sp, 10, NULL, 0, NULL, 0, 2, &s) == BT_ERR_INVALID && !s);
    REQUIRE(bt_sampler_seq_create(&sp, 10, NULL, 0, NULL, 0, 1, &s) == BT_OK);
    CHECK(bt_sampler_seq_fork(s, 2, &f) == BT_ERR_INVALID && !f);
    const int32_t bad_eos[] = {10};
    CHECK(bt_sampler_seq_create(&sp, 10, NULL, 0, bad_eos, 1, 0, &f) == BT_ERR_INVALID && !f);
    const int32_t bad_prompt[] = {3, 10};
    bt_sampler_seq *g = NULL;
    CHECK(bt_sampler_seq_create(&sp, 10, bad_prompt, 2, NULL, 0, 0, &g) == BT_ERR_INVALID && !g);
    bt_sampler_seq_free(s);
}

/* ---- micro-benchmark (a printout, not an assertion) ---- */

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); /* CPU time: steadier than wall time on a shared machine */
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int fullsort_cmp(const void *a, const void *b)
{
    const float *x = a, *y = b;
    return (*x < *y) - (*x > *y);
}

static void bench(void)
{
    enum { V = 49152 };
    float *peaked = malloc(sizeof *peaked * V), *flat = malloc(sizeof *flat * V);
    float *scratch = malloc(sizeof *scratch * 2 * V);
    /* peaked: like a language model's next-token logits, a few dozen plausible tokens well above a noisy floor;
     * flat: a heavy tail holding most of the mass (the nucleus is thousands of tokens), the hard case */
    for (int i = 0; i < V; i++) {
        peaked[i] = (float)(nrand() * 2.0);
        flat[i] = (float)(nrand() * 2.5);
    }
    for (int i = 0; i < 40; i++) peaked[(i * 6151 + 11) % V] = 18.0f - 0.3f * (float)i + (float)nrand() * 0.2f;
    for (int i = 0; i < 8; i++) flat[(i * 6151) % V] = 10.0f - (float)i;
    struct {
        const char *name;
        const float *logits;
        float t, top_p, min_p;
        int32_t top_k;
        float rep;
        int logprobs;
    } cfg[] = {
        {"greedy", peaked, 0.0f, 1.0f, 0.0f, 0, 1.0f, 0},
        {"T 1 (no truncation)", peaked, 1.0f, 1.0f, 0.0f, 0, 1.0f, 0},
        {"top_p 0.9", peaked, 1.0f, 0.9f, 0.0f, 0, 1.0f, 0},
        {"top_p 0.9, flat logits", flat, 1.0f, 0.9f, 0.0f, 0, 1.0f, 0},
        {"top_p 0.95 T 1.5, flat logits", flat, 1.5f, 0.95f, 0.0f, 0, 1.0f, 0},
        {"top_k 50", peaked, 1.0f, 1.0f, 0.0f, 50, 1.0f, 0},
        {"top_k 50 top_p 0.9", peaked, 1.0f, 0.9f, 0.0f, 50, 1.0f, 0},
        {"min_p 0.05", peaked, 1.0f, 1.0f, 0.05f, 0, 1.0f, 0},
        {"top_p 0.9 + penalties (2k history)", peaked, 1.0f, 0.9f, 0.0f, 0, 1.1f, 0},
        {"greedy + top 20 logprobs", peaked, 0.0f, 1.0f, 0.0f, 0, 1.0f, 1},
    };
    int32_t *hist = malloc(sizeof *hist * 2048);
    for (int i = 0; i < 2048; i++) hist[i] = (int32_t)(test_rand_next(&rng_state) % V);
    const int iters = 60;
    fprintf(stderr, "  sampler micro-benchmark, vocabulary %d, ns per sample:\n", V);
    volatile int32_t sink = 0;
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        bt_sampling sp = bt_sampling_default();
        sp.temperature = cfg[c].t;
        sp.top_p = cfg[c].top_p;
        sp.min_p = cfg[c].min_p;
        sp.top_k = cfg[c].top_k;
        sp.repetition_penalty = cfg[c].rep;
        if (cfg[c].rep != 1.0f) sp.frequency_penalty = 0.2f;
        sp.logprobs = cfg[c].logprobs;
        sp.top_logprobs = cfg[c].logprobs ? 20 : 0;
        bt_sampler_seq *s = mkseq(&sp, V, hist, cfg[c].rep != 1.0f ? 1024 : 0, 0);
        if (!s) continue;
        if (cfg[c].rep != 1.0f)
            for (int i = 1024; i < 2048; i++) bt_sampler_seq_accept(s, hist[i], NULL);
        bt_sample_out out;
        sink += bt_sampler_sample(s, cfg[c].logits, 0, scratch, &out); /* warm-up */
        double ns = INFINITY;
        for (int round = 0; round < 5; round++) { /* best of 5 rounds */
            double t0 = now_ns();
            for (int i = 0; i < iters; i++) sink += bt_sampler_sample(s, cfg[c].logits, i, scratch, &out);
            ns = fmin(ns, (now_ns() - t0) / iters);
        }
        fprintf(stderr, "    %-38s %10.0f ns\n", cfg[c].name, ns);
        bt_sampler_seq_free(s);
    }
    /* what a full sort of the vocabulary costs, for comparison */
    double t0 = now_ns();
    for (int i = 0; i < 20; i++) {
        memcpy(scratch, flat, sizeof *flat * V);
        qsort(scratch, V, sizeof *scratch, fullsort_cmp);
        sink += (int32_t)scratch[0];
    }
    fprintf(stderr, "    %-38s %10.0f ns\n", "(reference: qsort of the vocabulary)", (now_ns() - t0) / 20);
    (void)sink;
    free(hist);
    free(peaked);
    free(flat);
    free(scratch);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "bench")) { /* the printout alone, for profiling */
        bench();
        return 0;
    }
    RUN(test_invalid_params);
    RUN(test_draw_by_hand);
    RUN(test_penalties_by_hand);
    RUN(test_greedy_argmax);
    RUN(test_exact_distribution_random);
    RUN(test_top_logprobs);
    RUN(test_finish);
    RUN(test_parallel_samples);
    RUN(test_determinism_any_order);
    RUN(test_chi_square);
    bench();
    return test_summary();
}
