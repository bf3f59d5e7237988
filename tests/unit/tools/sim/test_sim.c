/* tools/sim: conservation (every request finishes, is rejected at admission or fails, failures and migrations
 * included), determinism (same seed, same report), and sanity of the model against the profile's arithmetic. */
#include "tools/sim/sim.h"
#include "router/router.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static plan_profile_t profile(void)
{
    plan_profile_t p;
    memset(&p, 0, sizeof p);
    p.prefill_fixed_s = 0.01;
    p.prefill_token_s = 0.0005;
    p.decode_fixed_s = 0.02;
    p.decode_seq_s = 0.0005;
    p.decode_ctx_s = 1e-7;
    p.kv_bytes_per_token = 20000;
    p.chunk_tokens = 512;
    p.max_running = 64;
    p.kv_tokens = 40000;
    p.n_xfer = 1;
    snprintf(p.xfer[0].name, sizeof p.xfer[0].name, "tcp");
    p.xfer[0].bytes_s = 1e9;
    p.xfer[0].latency_s = 0.0005;
    return p;
}

typedef struct gen {
    uint64_t s;
    double t, rate;
    long n, max;
    int groups;
} gen_t;

static int next(void *ud, sim_arrival_t *a)
{
    gen_t *g = ud;
    if (g->n >= g->max) return 1;
    g->s = g->s * 6364136223846793005ull + 1442695040888963407ull;
    double u = (double)(g->s >> 11) / 9007199254740992.0;
    g->t += -log(1 - u) / g->rate;
    memset(a, 0, sizeof *a);
    a->t = g->t;
    a->prompt_tokens = 50 + (int32_t)((g->s >> 20) % 400);
    a->output_tokens = 1 + (int32_t)((g->s >> 40) % 100);
    if (g->groups) {
        a->prefix_group = 1 + (uint32_t)((g->s >> 50) % (uint64_t)g->groups);
        a->prefix_tokens = 64;
    }
    g->n++;
    return 0;
}

static sim_config_t config(int np, int nd)
{
    sim_config_t c;
    memset(&c, 0, sizeof c);
    c.profile = profile();
    c.n_prefill = np;
    c.n_decode = nd;
    c.slo_ttft_s = 1;
    c.slo_tpot_s = 0.1;
    c.overhead_s = 0.005;
    c.seed = 7;
    return c;
}

static int conserved(const sim_result_t *r) { return r->arrived == r->finished + r->rejected + r->failed; }

static void test_conservation(void)
{
    const int shapes[][2] = {{0, 1}, {0, 4}, {2, 2}, {4, 8}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        sim_config_t c = config(shapes[i][0], shapes[i][1]);
        gen_t g = {.s = 1, .rate = 20, .max = 3000};
        sim_result_t r;
        REQUIRE(sim_run(&c, next, &g, &r) == BT_OK);
        CHECK_MSG(r.arrived == 3000 && conserved(&r), "%d+%d: %llu arrived, %llu finished, %llu rejected, %llu failed",
                  shapes[i][0], shapes[i][1], (unsigned long long)r.arrived, (unsigned long long)r.finished,
                  (unsigned long long)r.rejected, (unsigned long long)r.failed);
        CHECK(r.ttft.n == r.finished && r.e2e.n == r.finished);
        CHECK(r.n_plan > 0 && r.plan[r.n_plan - 1].decode >= 1);
        sim_result_free(&r);
    }
}

/* Overload (admission rejects), failures with and without repair (migrations, failed requests): still conserved. */
static void test_conservation_under_failures(void)
{
    sim_config_t c = config(2, 6);
    c.fails[0] = (sim_fail_t){.t = 20, .decode = 1, .count = 3, .repair_s = 10};
    c.fails[1] = (sim_fail_t){.t = 40, .decode = 0, .count = 1, .repair_s = 0};
    c.fails[2] = (sim_fail_t){.t = 60, .decode = 1, .count = 5, .repair_s = 0};
    c.n_fails = 3;
    c.max_migrations = 1;
    gen_t g = {.s = 3, .rate = 60, .max = 8000, .groups = 5};
    c.use_prefix_index = 1;
    sim_result_t r;
    REQUIRE(sim_run(&c, next, &g, &r) == BT_OK);
    CHECK(conserved(&r));
    CHECK_MSG(r.migrations > 0, "no migration");
    CHECK(r.rejected > 0); /* 60 req/s overloads one surviving decode node: admission sheds */
    int fails = 0;
    for (int i = 0; i < r.n_nodes; i++) fails += r.nodes[i].failures;
    CHECK(fails == 9);
    sim_result_free(&r);
}

static void test_deterministic(void)
{
    sim_result_t a, b;
    sim_config_t c = config(3, 5);
    c.fails[0] = (sim_fail_t){.t = 30, .decode = 1, .count = 1, .repair_s = 5};
    c.n_fails = 1;
    c.use_prefix_index = 1;
    gen_t g1 = {.s = 11, .rate = 30, .max = 4000, .groups = 3}, g2 = g1;
    REQUIRE(sim_run(&c, next, &g1, &a) == BT_OK);
    REQUIRE(sim_run(&c, next, &g2, &b) == BT_OK);
    CHECK(a.events == b.events && a.finished == b.finished && a.migrations == b.migrations && a.good == b.good);
    CHECK(!memcmp(a.ttft.bins, b.ttft.bins, sizeof a.ttft.bins) && !memcmp(a.tpot.bins, b.tpot.bins, sizeof a.tpot.bins));
    CHECK(a.sim_end_s == b.sim_end_s && a.n_plan == b.n_plan);
    for (int i = 0; i < a.n_nodes; i++) CHECK(a.nodes[i].busy_s == b.nodes[i].busy_s);
    sim_result_free(&b);
    c.seed = 8; /* another router seed: another run */
    gen_t g3 = {.s = 11, .rate = 30, .max = 4000, .groups = 3};
    REQUIRE(sim_run(&c, next, &g3, &b) == BT_OK);
    CHECK(memcmp(a.ttft.bins, b.ttft.bins, sizeof a.ttft.bins) != 0);
    sim_result_free(&a);
    sim_result_free(&b);
}

/* One request on an idle colocated node: TTFT is one prefill step, TPOT one decode step (context grows slowly). */
static void test_single_request_timing(void)
{
    sim_config_t c = config(0, 1);
    gen_t g = {.s = 5, .rate = 1, .max = 1};
    sim_result_t r;
    REQUIRE(sim_run(&c, next, &g, &r) == BT_OK);
    REQUIRE(r.finished == 1);
    /* the lone request's prompt length is between 50 and 449: one chunk */
    double ttft = r.ttft.sum, lo = c.profile.prefill_fixed_s + 50 * c.profile.prefill_token_s,
           hi = c.profile.prefill_fixed_s + 450 * c.profile.prefill_token_s;
    CHECK_MSG(ttft >= lo && ttft <= hi, "ttft %g not in [%g, %g]", ttft, lo, hi);
    if (r.tpot.n) {
        double step1 = c.profile.decode_fixed_s + c.profile.decode_seq_s;
        CHECK_MSG(fabs(r.tpot.sum - step1) < 0.001, "tpot %g vs step %g", r.tpot.sum, step1);
    }
    sim_result_free(&r);
}

/* The serving path's constants: request_s delays a request's start (TTFT grows by it, TPOT does not), and its
 * per-token CPU on a one-host cluster lengthens every step by that much per row. */
static void test_serving_path(void)
{
    sim_config_t c = config(0, 1);
    gen_t g = {.s = 5, .rate = 1, .max = 1};
    sim_result_t base, path;
    REQUIRE(sim_run(&c, next, &g, &base) == BT_OK);
    c.profile.request_s = 0.01;
    c.profile.path_token_s = 0.002;
    c.profile.path_step_s = 0.0007;
    g = (gen_t){.s = 5, .rate = 1, .max = 1};
    REQUIRE(sim_run(&c, next, &g, &path) == BT_OK);
    REQUIRE(base.finished == 1 && path.finished == 1);
    /* the lone request's first token: +10 ms of path, +2 ms for its row (its prompt step has no decode rows) */
    CHECK_MSG(fabs(path.ttft.sum - base.ttft.sum - 0.012) < 1e-9, "ttft %g vs %g", path.ttft.sum, base.ttft.sum);
    /* each decode step: +2 ms for its one row, +0.7 ms for the step */
    if (base.tpot.n)
        CHECK_MSG(fabs(path.tpot.sum - base.tpot.sum - 0.0027) < 1e-9, "tpot %g vs %g", path.tpot.sum, base.tpot.sum);
    sim_result_free(&base);
    sim_result_free(&path);
}

/* A prompt ending's logits row and sampling (prefill.seq_s) are paid once, by the step that ends the prompt: the lone
 * request's TTFT grows by exactly that, colocated and on a prefill node alike, and its decode steps do not. */
static void test_prompt_end_cost(void)
{
    for (int np = 0; np <= 1; np++) {
        sim_config_t c = config(np, 1);
        c.prefill_mode = np ? RTR_PREFILL_REMOTE : RTR_PREFILL_AUTO;
        gen_t g = {.s = 5, .rate = 1, .max = 1};
        sim_result_t base, ended;
        REQUIRE(sim_run(&c, next, &g, &base) == BT_OK);
        c.profile.prefill_seq_s = 0.003;
        g = (gen_t){.s = 5, .rate = 1, .max = 1};
        REQUIRE(sim_run(&c, next, &g, &ended) == BT_OK);
        REQUIRE(base.finished == 1 && ended.finished == 1);
        CHECK_MSG(fabs(ended.ttft.sum - base.ttft.sum - 0.003) < 1e-9, "%d prefill nodes: ttft %g vs %g", np,
                  ended.ttft.sum, base.ttft.sum);
        if (base.tpot.n)
            CHECK_MSG(fabs(ended.tpot.sum - base.tpot.sum) < 1e-9, "tpot %g vs %g", ended.tpot.sum, base.tpot.sum);
        sim_result_free(&base);
        sim_result_free(&ended);
    }
}

/* Idleness costs the next step what the profile's idle points say: the lone request's prompt step starts on a node
 * idle since the start, so its TTFT grows by plan_idle_extra_s for that gap; the decode steps that follow start
 * back to back and pay nothing. */
static void test_idle_cost(void)
{
    sim_config_t c = config(0, 1);
    gen_t g = {.s = 5, .rate = 1, .max = 1};
    sim_result_t base, idle;
    REQUIRE(sim_run(&c, next, &g, &base) == BT_OK);
    double t_arrive = g.t;
    c.profile.idle_step_s = 0.5; /* longer than the step: it pays its share */
    c.profile.n_idle = 2;
    c.profile.idle_gap_s[0] = 0.1, c.profile.idle_extra_s[0] = 0.01;
    c.profile.idle_gap_s[1] = 1.0, c.profile.idle_extra_s[1] = 0.03;
    g = (gen_t){.s = 5, .rate = 1, .max = 1};
    REQUIRE(sim_run(&c, next, &g, &idle) == BT_OK);
    REQUIRE(base.finished == 1 && idle.finished == 1);
    double want = plan_idle_extra_s(&c.profile, t_arrive, base.ttft.sum);
    CHECK_MSG(want > 0, "the arrival at %g s should find the node idle", t_arrive);
    CHECK_MSG(fabs(idle.ttft.sum - base.ttft.sum - want) < 1e-9, "ttft %g vs %g + %g", idle.ttft.sum, base.ttft.sum,
              want);
    if (base.tpot.n) CHECK_MSG(fabs(idle.tpot.sum - base.tpot.sum) < 1e-9, "tpot %g vs %g", idle.tpot.sum, base.tpot.sum);
    sim_result_free(&base);
    sim_result_free(&idle);
}

/* Steps scatter around the model's value (prefill.spread, decode.spread): the median TTFT stays where it was, the
 * tail grows, every request is still accounted for, and the same seed gives the same run. */
static void test_step_spread(void)
{
    sim_config_t c = config(0, 2);
    c.profile.prefill_fixed_s = 0.2; /* prompt steps of nearly one length: the TTFT's spread is the steps' */
    c.profile.prefill_token_s = 1e-5;
    gen_t g = {.s = 3, .rate = 0.5, .max = 2000};
    sim_result_t base, a, b;
    REQUIRE(sim_run(&c, next, &g, &base) == BT_OK);
    c.profile.prefill_spread = c.profile.decode_spread = 0.2;
    g = (gen_t){.s = 3, .rate = 0.5, .max = 2000};
    REQUIRE(sim_run(&c, next, &g, &a) == BT_OK);
    g = (gen_t){.s = 3, .rate = 0.5, .max = 2000};
    REQUIRE(sim_run(&c, next, &g, &b) == BT_OK);
    CHECK(conserved(&a) && a.finished == base.finished);
    double p50 = sim_hist_quantile(&base.ttft, 0.5), p50s = sim_hist_quantile(&a.ttft, 0.5);
    double p90 = sim_hist_quantile(&base.ttft, 0.9), p90s = sim_hist_quantile(&a.ttft, 0.9);
    CHECK_MSG(fabs(p50s / p50 - 1) < 0.1, "ttft p50 %g with spread vs %g without", p50s, p50);
    /* a normal's 90th percentile at 0.2: x1.29 */
    CHECK_MSG(p90s > p90 * 1.15, "ttft p90 %g with spread vs %g without", p90s, p90);
    CHECK(!memcmp(a.ttft.bins, b.ttft.bins, sizeof a.ttft.bins) && !memcmp(a.tpot.bins, b.tpot.bins, sizeof a.tpot.bins));
    CHECK(a.events == b.events && a.sim_end_s == b.sim_end_s);
    sim_result_free(&base);
    sim_result_free(&a);
    sim_result_free(&b);
}

/* Fixed arrivals: (time, prompt, output) triples. */
typedef struct fixed {
    const double (*a)[3];
    int n, i;
} fixed_t;

static int next_fixed(void *ud, sim_arrival_t *a)
{
    fixed_t *f = ud;
    if (f->i >= f->n) return 1;
    memset(a, 0, sizeof *a);
    a->t = f->a[f->i][0];
    a->prompt_tokens = (int32_t)f->a[f->i][1];
    a->output_tokens = (int32_t)f->a[f->i][2];
    f->i++;
    return 0;
}

/* Sum of the TTFTs of a 1P+1D run of the given arrivals. */
static double ttft_sum_1p1d(const sim_config_t *c, const double (*arr)[3], int n)
{
    fixed_t f = {arr, n, 0};
    sim_result_t r;
    if (sim_run(c, next_fixed, &f, &r) != BT_OK) {
        CHECK_MSG(0, "sim_run failed");
        return NAN;
    }
    CHECK(r.finished == (uint64_t)n);
    double t = r.ttft.sum;
    sim_result_free(&r);
    return t;
}

static sim_config_t config_1p1d(double decode_fixed_s)
{
    sim_config_t c = config(1, 1);
    c.prefill_mode = RTR_PREFILL_REMOTE;
    c.profile.decode_fixed_s = decode_fixed_s;
    c.profile.decode_ctx_s = 0; /* every step of one row is as long */
    return c;
}

/* A decode node sees a remote prefill's KV between its steps: B's KV lands while A's decode step is in flight, so
 * B's first token waits for that step's end (more than nothing, at most one step), where an idle node would have
 * sent it at once. */
static void test_kv_arrival_waits_for_step(void)
{
    sim_config_t c = config_1p1d(0.1);
    double step = c.profile.decode_fixed_s + c.profile.decode_seq_s;
    const double a[][3] = {{0.0, 100, 50}}, b[][3] = {{0.3, 100, 5}}, ab[][3] = {{0.0, 100, 50}, {0.3, 100, 5}};
    double ta = ttft_sum_1p1d(&c, a, 1), tb = ttft_sum_1p1d(&c, b, 1), tab = ttft_sum_1p1d(&c, ab, 2);
    double wait = tab - ta - tb;
    CHECK_MSG(wait > 1e-6 && wait <= step + 1e-9, "B waited %g s for a step of %g s", wait, step);
}

/* A remote prefill's TTFT in parts: the serving path (request_s), its time on the prefill node, then until the
 * decode node emits the token. B's last part holds its wait for A's decode step, so it is longer than A's. */
static void test_remote_ttft_parts(void)
{
    sim_config_t c = config_1p1d(0.1);
    c.profile.request_s = 0.004;
    const double ab[][3] = {{0.0, 100, 50}, {0.3, 100, 5}};
    fixed_t f = {ab, 2, 0};
    sim_result_t r;
    if (sim_run(&c, next_fixed, &f, &r) != BT_OK) {
        CHECK_MSG(0, "sim_run failed");
        return;
    }
    CHECK(r.prefill_node.n == 2 && r.after_prefill.n == 2);
    double parts = 2 * c.profile.request_s + r.prefill_node.sum + r.after_prefill.sum;
    CHECK_MSG(fabs(r.ttft.sum - parts) < 1e-9, "ttft %g s, parts %g s", r.ttft.sum, parts);
    double prompt_step = c.profile.prefill_fixed_s + 100 * c.profile.prefill_token_s;
    CHECK_MSG(fabs(r.prefill_node.sum - 2 * prompt_step) < 1e-9, "on P %g s, want 2 x %g s", r.prefill_node.sum,
              prompt_step);
    CHECK(sim_hist_quantile(&r.after_prefill, 1.0) > 1.5 * sim_hist_quantile(&r.after_prefill, 0.0));
    sim_result_free(&r);
}

/* On one host with the decode node pinned away, the router and the client take a share of the prefill node's core
 * (path_prefill_token_s per streamed token): B's prompt step, run while A streams a row every 2.5 ms, stretches by
 * 1 / (1 - 400 x 0.0005) = 1.25; A's, run before anything streams, does not. */
static void test_path_on_prefill_core(void)
{
    sim_config_t c = config_1p1d(0.002);
    double step = c.profile.decode_fixed_s + c.profile.decode_seq_s;
    const double ab[][3] = {{0.0, 100, 400}, {0.3, 100, 5}}, a[][3] = {{0.0, 100, 400}};
    double base = ttft_sum_1p1d(&c, ab, 2), ta = ttft_sum_1p1d(&c, a, 1);
    c.profile.path_prefill_token_s = 0.0005;
    double shared = ttft_sum_1p1d(&c, ab, 2), ta2 = ttft_sum_1p1d(&c, a, 1);
    CHECK_MSG(fabs(ta2 - ta) < 1e-9, "A's ttft %g vs %g", ta2, ta);
    double prompt_step = c.profile.prefill_fixed_s + 100 * c.profile.prefill_token_s;
    double want = prompt_step * (1 / (1 - 0.0005 / step) - 1), got = shared - base;
    /* B's first token still waits for a step boundary: within one step of the stretch */
    CHECK_MSG(fabs(got - want) <= step + 1e-9, "B's ttft grew %g s, want %g s", got, want);
}

static void test_bad_config(void)
{
    sim_config_t c = config(1, 0);
    gen_t g = {.s = 1, .rate = 1, .max = 1};
    sim_result_t r;
    CHECK(sim_run(&c, next, &g, &r) == BT_ERR_INVALID);
    c = config(1, 1);
    c.profile.prefill_token_s = 0;
    CHECK(sim_run(&c, next, &g, &r) == BT_ERR_INVALID);
}

int main(void)
{
    RUN(test_conservation);
    RUN(test_conservation_under_failures);
    RUN(test_deterministic);
    RUN(test_single_request_timing);
    RUN(test_serving_path);
    RUN(test_prompt_end_cost);
    RUN(test_idle_cost);
    RUN(test_step_spread);
    RUN(test_kv_arrival_waits_for_step);
    RUN(test_path_on_prefill_core);
    RUN(test_remote_ttft_parts);
    RUN(test_bad_config);
    return test_summary();
}
