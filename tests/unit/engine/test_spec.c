/* engine/spec.c: --spec parsing, the n-gram index (matches, longest first, most recent occurrence, incremental over
 * a growing sequence, against a brute-force search), the adaptive-k rule, the drafting check, the step-cost curve
 * and the plan of a decode-only step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/spec.h"
#include "test_util.h"

static void test_parse(void)
{
    bt_spec_config c = bt_spec_config_default();
    CHECK(c.kind == BT_SPEC_NONE && c.k_max == BT_SPEC_K_DEFAULT && c.ngram_min == 1 && c.ngram_max == 4);
    CHECK(bt_spec_parse("ngram", &c) == BT_OK && c.kind == BT_SPEC_NGRAM);
    CHECK(bt_spec_parse("ngram:3-6", &c) == BT_OK && c.kind == BT_SPEC_NGRAM && c.ngram_min == 3 && c.ngram_max == 6);
    CHECK(bt_spec_parse("self:8", &c) == BT_OK && c.kind == BT_SPEC_SELF && c.self_layers == 8);
    CHECK(bt_spec_parse("draft:/m/small.gguf", &c) == BT_OK && c.kind == BT_SPEC_DRAFT &&
          !strcmp(c.draft_path, "/m/small.gguf"));
    CHECK(bt_spec_parse("none", &c) == BT_OK && c.kind == BT_SPEC_NONE);
    const char *bad[] = {"", "ngrams", "self:", "self:0", "self:3x", "draft:", "eagle", "ngram:", "ngram:3",
                         "ngram:0-2", "ngram:4-2", "ngram:2-9", "ngram:2-4x", "ngram:-4", NULL};
    for (int i = 0; bad[i]; i++) {
        CHECK_MSG(bt_spec_parse(bad[i], &c) == BT_ERR_INVALID, "'%s' accepted", bad[i]);
        CHECK(strstr(bt_last_error(), "--spec") != NULL);
    }
    CHECK(!strcmp(bt_spec_kind_name(BT_SPEC_SELF), "self"));
}

/* What prompt lookup should propose, by brute force: the most recent earlier occurrence of the longest matching
 * suffix of n in [nmin, nmax], continued by up to k tokens that exist. */
static int32_t brute(const int32_t *t, int32_t n_tok, int32_t nmin, int32_t nmax, int32_t k, int32_t *out)
{
    for (int32_t n = nmax; n >= nmin; n--) {
        if (n > n_tok - 1) continue;
        for (int32_t end = n_tok - 2; end >= n - 1; end--) {
            if (memcmp(t + end - n + 1, t + n_tok - n, sizeof(int32_t) * (size_t)n)) continue;
            int32_t m = 0;
            while (m < k && end + 1 + m < n_tok) {
                out[m] = t[end + 1 + m];
                m++;
            }
            return m;
        }
    }
    return 0;
}

static void test_ngram_basics(void)
{
    bt_proposer *p = NULL;
    REQUIRE(bt_spec_ngram_create(1, 3, &p) == BT_OK);
    void *st = NULL;
    REQUIRE(p->ops->seq_open(p, &st) == BT_OK);
    /* "5 6 7 8 9 5 6 7": the suffix "5 6 7" occurred at 0..2, followed by 8 9 5 6 7 */
    int32_t t[] = {5, 6, 7, 8, 9, 5, 6, 7};
    bt_spec_item it = {.state = st, .tokens = t, .n_tokens = 8, .k = 4};
    p->ops->propose(p, &it, 1);
    CHECK(it.n_drafts == 4 && it.drafts[0] == 8 && it.drafts[1] == 9 && it.drafts[2] == 5 && it.drafts[3] == 6);
    /* k bounds the drafts, and they never run past the sequence's end */
    it.k = 16;
    p->ops->propose(p, &it, 1);
    CHECK(it.n_drafts == 5);
    /* no earlier occurrence of the last token: nothing */
    int32_t u[] = {1, 2, 3, 4};
    void *st2 = NULL;
    REQUIRE(p->ops->seq_open(p, &st2) == BT_OK);
    bt_spec_item it2 = {.state = st2, .tokens = u, .n_tokens = 4, .k = 4};
    p->ops->propose(p, &it2, 1);
    CHECK(it2.n_drafts == 0);
    /* longest first: "1 2 | 9 ... 2 | 7 ... 1 2": the 2-gram "1 2" wins over the more recent 1-gram "2" */
    int32_t w[] = {1, 2, 9, 2, 7, 1, 2};
    void *st3 = NULL;
    REQUIRE(p->ops->seq_open(p, &st3) == BT_OK);
    bt_spec_item it3 = {.state = st3, .tokens = w, .n_tokens = 7, .k = 1};
    p->ops->propose(p, &it3, 1);
    CHECK(it3.n_drafts == 1 && it3.drafts[0] == 9 && it3.cls == 0);
    /* only a 1-token match ("7 ... 7"): its drafts are the weak class */
    int32_t x[] = {7, 3, 4, 1, 7};
    void *st4 = NULL;
    REQUIRE(p->ops->seq_open(p, &st4) == BT_OK);
    bt_spec_item it4 = {.state = st4, .tokens = x, .n_tokens = 5, .k = 2};
    p->ops->propose(p, &it4, 1);
    CHECK(it4.n_drafts == 2 && it4.drafts[0] == 3 && it4.drafts[1] == 4 && it4.cls == 1);
    p->ops->seq_close(p, st4);
    p->ops->seq_close(p, st);
    p->ops->seq_close(p, st2);
    p->ops->seq_close(p, st3);
    p->ops->seq_close(p, NULL);
    bt_proposer_destroy(p);
    CHECK(bt_spec_ngram_create(0, 3, &p) == BT_ERR_INVALID);
    CHECK(bt_spec_ngram_create(3, 2, &p) == BT_ERR_INVALID);
    CHECK(bt_spec_ngram_create(1, 9, &p) == BT_ERR_INVALID);
}

/* A sequence growing a token at a time over a small alphabet (many repeats) proposes exactly what brute force finds
 * at every length, with the index kept incrementally. */
static void test_ngram_incremental_vs_brute(void)
{
    enum { LEN = 3000 };
    static int32_t t[LEN];
    uint64_t seed = 42;
    for (int trial = 0; trial < 3; trial++) {
        int32_t nmin = 1 + trial % 2, nmax = 2 + trial;
        bt_proposer *p = NULL;
        REQUIRE(bt_spec_ngram_create(nmin, nmax, &p) == BT_OK);
        void *st = NULL;
        REQUIRE(p->ops->seq_open(p, &st) == BT_OK);
        int bad = 0;
        for (int32_t n = 1; n <= LEN; n++) {
            /* mostly copies of an earlier stretch, sometimes a fresh token */
            uint64_t r = test_rand_next(&seed);
            if (n > 10 && r % 4) t[n - 1] = t[n - 1 - (int32_t)(1 + (r >> 8) % 9)];
            else t[n - 1] = (int32_t)((r >> 16) % (trial == 2 ? 50000 : 12));
            if (r % 3) continue; /* propose at some lengths only: the index must catch up over several tokens */
            bt_spec_item it = {.state = st, .tokens = t, .n_tokens = n, .k = 1 + (int32_t)(r % 7)};
            int32_t want[16];
            int32_t nw = brute(t, n, nmin, nmax, it.k, want);
            p->ops->propose(p, &it, 1);
            if (it.n_drafts != nw || memcmp(it.drafts, want, sizeof(int32_t) * (size_t)nw)) bad++;
        }
        CHECK_MSG(bad == 0, "n-grams %d..%d: %d proposals differ from brute force", nmin, nmax, bad);
        p->ops->seq_close(p, st);
        bt_proposer_destroy(p);
    }
}

static void test_adaptive_k(void)
{
    bt_spec_stats st;
    bt_spec_stats_init(&st);
    CHECK(fabsf(bt_spec_alpha(&st) - 0.5f) < 1e-6f && fabsf(bt_spec_alpha_at(&st, 5) - 0.5f) < 1e-6f);
    /* cost unknown: 0.5, 0.25, 0.125 > 0.1 floor: k = 3 */
    CHECK(bt_spec_choose_k(&st, 8, 0, 1) == 3);
    CHECK(bt_spec_choose_k(&st, 2, 0, 1) == 2);
    /* every draft kept: every position's alpha rises (untried ones follow the last tried) and k reaches k_max */
    for (int i = 0; i < 20; i++) bt_spec_stats_update(&st, 4, 4);
    CHECK(bt_spec_alpha(&st) > 0.95f && bt_spec_alpha_at(&st, 7) > 0.95f);
    CHECK(bt_spec_choose_k(&st, 8, 0, 1) == 8);
    CHECK(bt_spec_choose_k(&st, 8, 0.5, 1) == 8);
    /* a copying run: the first draft kept half the time, but once it is, the next ones always: the chain of
     * positions drafts far more than one rate for all positions (0.5^k) would */
    bt_spec_stats run;
    bt_spec_stats_init(&run);
    for (int i = 0; i < 20; i++) bt_spec_stats_update(&run, 6, i % 2 ? 6 : 0);
    CHECK(fabsf(bt_spec_alpha(&run) - 0.5f) < 0.1f && bt_spec_alpha_at(&run, 3) > 0.9f);
    CHECK(bt_spec_choose_k(&run, 8, 0.3, 1) == 8);
    /* a compute-bound step: the threshold nears 1; a sequence kept at 0.8 drafts nothing */
    double thr = bt_spec_threshold(0.003, 0.001, 0.001, 0, 64, 64);
    CHECK(thr > 0.9 && thr < 1);
    bt_spec_stats mid;
    bt_spec_stats_init(&mid);
    mid.hits[0] = 8, mid.tries[0] = 10;
    CHECK(bt_spec_choose_k(&mid, 8, thr, 1) == 0);
    CHECK(bt_spec_choose_k(&mid, 8, 0.5, 1) == 2); /* 0.8 then 0.8 * ~0.79 */
    CHECK(bt_spec_threshold(0.003, 0, 0, 0, 1, 1) == 0);
    /* a draft model's round (1 ms) on a 4 ms batch-1 step: a draft must be accepted more than 1 time in 4 */
    CHECK(fabs(bt_spec_threshold(0.004, 0, 0, 0.001, 1, 1) - 0.25) < 1e-9);
    /* a draft row dearer than a sequence's own row (a batch-1 step has idle compute a draft row must pay for):
     * 4 sequences at 6 ms, a draft row 0.7 ms: a draft must be kept more than 0.7 * 4 / 6 of the time */
    CHECK(fabs(bt_spec_threshold(0.002, 0.001, 0.0007, 0, 4, 4) - 0.0028 / 0.006) < 1e-9);
    /* every draft rejected: k falls to 0, then a single probe every 16 steps while drafting is cheap */
    for (int i = 0; i < 20; i++) bt_spec_stats_update(&st, 4, 0);
    CHECK(bt_spec_alpha(&st) < 0.1f);
    st.probe_every = 16;
    st.idle_steps = 0;
    int probes = 0;
    for (int i = 0; i < 64; i++) probes += bt_spec_choose_k(&st, 8, 0.01, 1);
    CHECK(probes == 4);
    probes = 0;
    for (int i = 0; i < 64; i++) probes += bt_spec_choose_k(&st, 8, 0.9, 1);
    CHECK(probes == 0);
    /* each missed probe doubles the wait (up to 512 steps); a hit brings it back to 16 */
    bt_spec_stats_update(&st, 1, 0);
    CHECK(st.probe_every == 32);
    for (int i = 0; i < 20; i++) bt_spec_stats_update(&st, 1, 0);
    CHECK(st.probe_every == 512);
    bt_spec_stats fresh;
    bt_spec_stats_init_from(&fresh, &st); /* a new sequence inherits the proposer-wide estimate, not the wait */
    CHECK(fresh.probe_every == 16 && bt_spec_alpha(&fresh) < 0.1f && fresh.tries[0] == 2);
    /* probes the caller forbids (a draft model that has not seen the sequence) never happen */
    probes = 0;
    for (int i = 0; i < 64; i++) probes += bt_spec_choose_k(&fresh, 8, 0.01, 0);
    CHECK(probes == 0);
    bt_spec_stats_update(&st, 2, 1);
    CHECK(st.probe_every == 16);
    /* the proposer-wide estimate: a few misses leave it near 0.5, many bring it under the 0.1 floor */
    bt_spec_stats g;
    bt_spec_global_init(&g);
    for (int i = 0; i < 3; i++) bt_spec_global_update(&g, 4, 0);
    CHECK(bt_spec_alpha(&g) > 0.3f);
    for (int i = 0; i < 60; i++) bt_spec_global_update(&g, 4, 0);
    CHECK(bt_spec_alpha(&g) < 0.1f);
    /* proposing nothing leaves the estimate alone */
    float a = bt_spec_alpha(&st);
    bt_spec_stats_update(&st, 0, 0);
    CHECK(bt_spec_alpha(&st) == a);
}

/* The drafting check, up to BT_SPEC_CURVE_SEQS sequences: it raises the threshold only where drafting steps were
 * slower per emitted token than plain steps of the same size, and lets it fall back once plain steps come again. */
static void test_check(void)
{
    bt_spec_check c;
    bt_spec_check_init(&c);
    CHECK(bt_spec_check_factor(&c, 1) == 1 && bt_spec_check_factor(&c, 16) == 1 && bt_spec_check_factor(&c, 500) == 1);
    /* nothing to compare with: a drafting step alone changes nothing */
    bt_spec_check_add(&c, 8, 8, 2, 0.020);
    CHECK(bt_spec_check_factor(&c, 8) == 1);
    /* batch 1 copying: 5 ms plain, 9 ms for 1 + 4 kept drafts (1.8 ms per token): the factor stays 1 */
    for (int i = 0; i < 50; i++) {
        bt_spec_check_add(&c, 1, 0, 0, 0.005);
        bt_spec_check_add(&c, 1, 8, 4, 0.009);
    }
    CHECK(bt_spec_check_factor(&c, 1) == 1);
    /* 8 sequences, compute-bound: 8 ms plain (1 ms per token), 12 ms with 4 drafts of which 2 kept (1.2 ms): the
     * factor climbs to its cap; other sizes are untouched */
    for (int i = 0; i < 10; i++) bt_spec_check_add(&c, 8, 0, 0, 0.008);
    for (int i = 0; i < 60; i++) bt_spec_check_add(&c, 8, 4, 2, 0.012);
    CHECK(bt_spec_check_factor(&c, 8) == BT_SPEC_CHECK_MAX);
    CHECK(bt_spec_check_factor(&c, 7) == 1 && bt_spec_check_factor(&c, 1) == 1);
    /* plain steps only from then on: the factor decays back toward 1 (drafting is tried again) */
    for (int i = 0; i < 600; i++) bt_spec_check_add(&c, 8, 0, 0, 0.008);
    CHECK(bt_spec_check_factor(&c, 8) < 1.8);
    /* drafting that now pays lowers it the rest of the way */
    for (int i = 0; i < 60; i++) bt_spec_check_add(&c, 8, 4, 4, 0.009);
    CHECK(bt_spec_check_factor(&c, 8) == 1);
    /* above BT_SPEC_CURVE_SEQS the check decides steps instead: the factor stays 1 there */
    for (int i = 0; i < 10; i++) bt_spec_check_add(&c, 20, 0, 0, 0.020);
    for (int i = 0; i < 10; i++) bt_spec_check_add(&c, 30, 8, 0, 0.040);
    CHECK(bt_spec_check_factor(&c, 17) == 1 && bt_spec_check_factor(&c, 31) == 1);
    /* nonsense input is ignored */
    bt_spec_check_add(&c, 0, 4, 4, 0.01);
    bt_spec_check_add(&c, 4, 4, 4, -1);
    CHECK(bt_spec_check_factor(&c, 0) == 1 && bt_spec_check_factor(&c, 4) == 1);
}

/* Runs n decisions of the check for steps of n_seqs sequences, each step taking plain_s (no drafts) or draft_s (with
 * 4 drafts of which kept are kept); returns how many drafted. */
static int check_run(bt_spec_check *c, int32_t n_seqs, int n, double plain_s, double draft_s, int kept)
{
    int drafted = 0;
    for (int i = 0; i < n; i++) {
        int d = bt_spec_check_may_draft(c, n_seqs);
        drafted += d;
        if (d) bt_spec_check_add(c, n_seqs, 4, kept, draft_s);
        else bt_spec_check_add(c, n_seqs, 0, 0, plain_s);
    }
    return drafted;
}

/* Above BT_SPEC_CURVE_SEQS the check decides each decode-only step: plain until drafting was measured (on the
 * alternate steps), then the kind that emitted tokens faster, with 1 step in BT_SPEC_CHECK_ALTERNATE of the other
 * kind; it follows a change of which kind is faster, sizes are kept apart, and one noisy step does not flip it. */
static void test_check_decides(void)
{
    bt_spec_check c;
    bt_spec_check_init(&c);
    CHECK(bt_spec_check_may_draft(&c, 1) == 1 && bt_spec_check_may_draft(&c, BT_SPEC_CURVE_SEQS) == 1);
    CHECK(bt_spec_check_may_draft(&c, 12) == 0); /* nothing measured: a plain step */
    bt_spec_check_add(&c, 12, 0, 0, 0.024);
    /* plain measured, drafting not yet: only the alternate step drafts */
    int first = 0;
    for (int i = 2; i <= BT_SPEC_CHECK_ALTERNATE && !first; i++)
        if (bt_spec_check_may_draft(&c, 12)) first = i;
    CHECK(first == BT_SPEC_CHECK_ALTERNATE);
    /* 12 sequences: 24 ms plain (2 ms a token); 30 ms with 4 drafts of which 1 kept (2.31 ms): drafting loses, and
     * only the alternate steps draft */
    int drafted = check_run(&c, 12, 320, 0.024, 0.030, 1);
    CHECK(drafted >= 320 / BT_SPEC_CHECK_ALTERNATE - 2 && drafted <= 320 / BT_SPEC_CHECK_ALTERNATE + 3);
    /* other sizes decide on their own measurements */
    CHECK(bt_spec_check_may_draft(&c, 13) == 0);
    /* steps with prompt chunks ask without deciding: drafting does not pay at 12, is unmeasured at 13, and is
     * the threshold's business up to BT_SPEC_CURVE_SEQS */
    CHECK(!bt_spec_check_pays(&c, 12) && !bt_spec_check_pays(&c, 13) && bt_spec_check_pays(&c, BT_SPEC_CURVE_SEQS));
    /* the same size with drafting that pays (26 ms for 12 + 4 tokens, 1.63 ms a token): it turns to drafting once
     * a few alternate steps (here 4 or 5) have brought the drafting average below the plain one */
    drafted = check_run(&c, 12, 320, 0.024, 0.026, 4);
    CHECK(drafted >= 320 - 320 / BT_SPEC_CHECK_ALTERNATE - 5 * BT_SPEC_CHECK_ALTERNATE);
    drafted = check_run(&c, 12, 160, 0.024, 0.026, 4);
    CHECK(drafted >= 160 - 160 / BT_SPEC_CHECK_ALTERNATE - 1);
    CHECK(bt_spec_check_pays(&c, 12));
    /* one step slowed tenfold by the host does not turn drafting off */
    bt_spec_check_add(&c, 12, 4, 4, 0.26);
    CHECK(check_run(&c, 12, 8, 0.024, 0.026, 4) >= 7);
    /* sizes from 17 share by powers of two: 20 and 30 are one size, 40 another */
    bt_spec_check_init(&c);
    bt_spec_check_add(&c, 20, 0, 0, 0.040);
    bt_spec_check_add(&c, 20, 4, 4, 0.030);
    CHECK(bt_spec_check_may_draft(&c, 30) == 1 && bt_spec_check_may_draft(&c, 40) == 0);
}

/* The curve keeps what steps took, follows a faster step at once and a slower one slowly (a noisy step cannot
 * price a size out for good), and estimates what it has not seen from the nearest measured smaller step and the
 * measured slope before it, kept within a quarter of the fitted row cost and all of it. */
static void test_curve(void)
{
    static bt_spec_curve c;
    bt_spec_curve_init(&c);
    double cost[12];
    /* nothing measured: the fitted model */
    bt_spec_curve_costs(&c, 2, 3, 0.004, 0.0005, cost);
    CHECK(fabs(cost[0] - 0.005) < 1e-9 && fabs(cost[3] - 0.0065) < 1e-9);
    /* one sample does not count yet (it may be a noisy one); of two, the faster */
    bt_spec_curve_add(&c, 1, 0, 0.030);
    bt_spec_curve_costs(&c, 1, 0, 0.004, 0.0005, cost);
    CHECK(fabs(cost[0] - 0.0045) < 1e-9);
    bt_spec_curve_add(&c, 1, 0, 0.005);
    bt_spec_curve_add(&c, 1, 3, 0.0047); /* 4 rows faster than 1, as the prefetching kernels make it */
    bt_spec_curve_add(&c, 1, 3, 0.0047);
    bt_spec_curve_add(&c, 1, 8, 0.008);
    bt_spec_curve_add(&c, 1, 8, 0.009);
    bt_spec_curve_costs(&c, 1, 10, 0.004, 0.0005, cost);
    CHECK(fabs(cost[0] - 0.005) < 1e-7 && fabs(cost[3] - 0.0047) < 1e-7 && fabs(cost[8] - 0.008) < 1e-7);
    /* 1: one measured step before it, the fitted row; 5: 0..3 fell, so a quarter of it; 10: 3..8 rose 0.66 ms a
     * row, more than the fitted 0.5 */
    CHECK(fabs(cost[1] - 0.0055) < 1e-7 && fabs(cost[5] - 0.00495) < 1e-7 && fabs(cost[10] - 0.009) < 1e-7);
    /* a slope between the bounds is the curve's own: 2 sequences, 0 and 2 extra rows measured, 0.3 ms a row */
    bt_spec_curve_add(&c, 2, 0, 0.005);
    bt_spec_curve_add(&c, 2, 0, 0.005);
    bt_spec_curve_add(&c, 2, 2, 0.0056);
    bt_spec_curve_add(&c, 2, 2, 0.0056);
    bt_spec_curve_costs(&c, 2, 4, 0.004, 0.0005, cost);
    CHECK(fabs(cost[1] - 0.0055) < 1e-7 && fabs(cost[4] - 0.0062) < 1e-7);
    /* a step hit by noise (10x) moves the estimate by 5% of at most twice it; a faster one by 30% of the gap */
    bt_spec_curve_add(&c, 1, 0, 0.05);
    CHECK(fabs(c.t[0][0] - 0.00525) < 1e-7);
    bt_spec_curve_add(&c, 1, 0, 0.004);
    CHECK(fabs(c.t[0][0] - (0.00525 - 0.3 * 0.00125)) < 1e-7);
    /* outside the table or nonsense: ignored; sizes beyond it use the fit */
    bt_spec_curve_add(&c, 0, 0, 0.001);
    bt_spec_curve_add(&c, BT_SPEC_CURVE_SEQS + 1, 0, 0.001);
    bt_spec_curve_add(&c, 2, BT_SPEC_CURVE_EXTRA + 1, 0.001);
    bt_spec_curve_add(&c, 2, 0, -1);
    bt_spec_curve_add(&c, 2, 0, -1);
    bt_spec_curve_costs(&c, 2, 0, 0.004, 0.0005, cost);
    CHECK(fabs(cost[0] - 0.005) < 1e-9);
    bt_spec_curve_costs(&c, BT_SPEC_CURVE_SEQS + 1, 0, 0.004, 0, cost);
    CHECK(fabs(cost[0] - 0.004) < 1e-9);
}

/* The plan takes the drafts that make a step's expected tokens per second highest, most likely first, each
 * sequence's as a prefix. */
static void test_plan(void)
{
    bt_spec_stats hi, lo, none;
    bt_spec_stats_init(&hi);
    bt_spec_stats_init(&lo);
    bt_spec_stats_init(&none);
    for (int i = 0; i < 20; i++) {
        bt_spec_stats_update(&hi, 8, 8); /* alpha ~1 everywhere */
        bt_spec_stats_update(&lo, 1, 0); /* alpha ~0 */
    }
    double lin[17];
    for (int e = 0; e <= 16; e++) lin[e] = 0.004 + 0.0005 * (1 + e); /* a row 1/9 of a step */
    /* batch 1, a copying sequence: every draft on offer pays */
    bt_spec_cand c1 = {.st = &hi, .avail = 8};
    CHECK(bt_spec_plan(&c1, 1, 1, lin, 8) == 8 && c1.k == 8);
    /* the 9th row starts a new GEMM tile (costs 1.4 ms, not 0.5): 7 drafts are worth more than 8 */
    double tile[9];
    for (int e = 0; e <= 8; e++) tile[e] = e < 8 ? 0.0045 + 0.0003 * e : 0.0082;
    CHECK(bt_spec_plan(&c1, 1, 1, tile, 8) == 7 && c1.k == 7);
    /* a sequence whose drafts are never kept drafts nothing when rows cost something ... */
    bt_spec_cand c2 = {.st = &lo, .avail = 8};
    CHECK(bt_spec_plan(&c2, 1, 1, lin, 8) == 0 && c2.k == 0);
    /* ... nor where rows cost nothing (4 rows as fast as 1): a draft kept less than 1 time in 10 is never planned */
    double free4[9] = {0.005, 0.005, 0.005, 0.005, 0.008, 0.009, 0.010, 0.011, 0.012};
    CHECK(bt_spec_plan(&c2, 1, 1, free4, 8) == 0 && c2.k == 0);
    /* free rows do take drafts of 0.2 (no more than are free: the 4th row costs) */
    bt_spec_stats fifth;
    bt_spec_stats_init(&fifth);
    for (int i = 0; i < 40; i++) bt_spec_stats_update(&fifth, 1, i % 5 == 0);
    bt_spec_cand c5 = {.st = &fifth, .avail = 8};
    CHECK(bt_spec_plan(&c5, 1, 1, free4, 8) == 1 && c5.k == 1);
    /* several sequences: the sure drafts first; nothing on offer, nothing taken */
    bt_spec_cand cs[3] = {{.st = &lo, .avail = 4}, {.st = &hi, .avail = 3}, {.st = &none, .avail = 0}};
    CHECK(bt_spec_plan(cs, 3, 3, lin, 7) == 3 && cs[0].k == 0 && cs[1].k == 3 && cs[2].k == 0);
    /* compute-bound: a row costs as much as a sequence's share of the step, so no 50% draft pays */
    double bound[5];
    for (int e = 0; e <= 4; e++) bound[e] = 0.001 * (4 + e);
    bt_spec_stats half;
    bt_spec_stats_init(&half);
    bt_spec_cand ch[2] = {{.st = &half, .avail = 2}, {.st = &half, .avail = 2}};
    CHECK(bt_spec_plan(ch, 2, 4, bound, 4) == 0);
    /* a sequence idle past its probe interval probes with one draft where a row is cheap, not where it is dear */
    bt_spec_stats idle;
    bt_spec_stats_init(&idle);
    for (int i = 0; i < 20; i++) bt_spec_stats_update(&idle, 1, 0);
    idle.idle_steps = 0;
    int probes = 0;
    for (int i = 0; i < 600; i++) {
        bt_spec_cand ci = {.st = &idle, .avail = 4};
        probes += bt_spec_plan(&ci, 1, 1, lin, 4);
    }
    CHECK(probes >= 1 && probes <= 3);
    idle.idle_steps = 0;
    probes = 0;
    for (int i = 0; i < 600; i++) {
        bt_spec_cand ci = {.st = &idle, .avail = 4};
        probes += bt_spec_plan(&ci, 1, 4, bound, 4);
    }
    CHECK(probes == 0);
}

int main(void)
{
    RUN(test_parse);
    RUN(test_ngram_basics);
    RUN(test_ngram_incremental_vs_brute);
    RUN(test_adaptive_k);
    RUN(test_check);
    RUN(test_check_decides);
    RUN(test_curve);
    RUN(test_plan);
    return test_summary();
}
