/* router/placement.c: the local-vs-remote prefill cost model, admission arithmetic and the planner's replica count;
 * plus the KV bytes per token rmodel.c derives from the default model (skipped when it is not cached). */
#include "router/router.h"
#include "test_util.h"

#include <math.h>
#include <string.h>

#define SMOL_KV_BYTES 23040.0 /* DESIGN 5.1: SmolLM2-135M, f16, 30 layers * 2 * 3 kv heads * 64 * 2 bytes */

static int near(double a, double b) { return fabs(a - b) <= 1e-9 * (1 + fabs(b)); }

/* A measured node: 1000 tok/s, 10 ms steps, 1 GB/s. */
static rtr_place_node_t node(const char *id, int64_t queued, int64_t running)
{
    rtr_place_node_t n = {.node_id = id, .queued_prefill_tokens = queued, .running_seqs = running,
                          .prefill_tok_s = 1000, .step_s = 0.01, .kv_transfer_bytes_s = 1e9};
    return n;
}

static rtr_place_decision_t decide(int64_t prompt, rtr_place_node_t d, const rtr_place_node_t *p, size_t np,
                                   rtr_prefill_mode mode, rtr_place_cand_t *cands)
{
    rtr_place_input_t in = {.prompt_tokens = prompt, .decode = d, .prefill = p, .n_prefill = np, .mode = mode,
                            .overhead_s = RTR_PLACE_DEFAULT_OVERHEAD_MS / 1000.0, .kv_bytes_per_token = SMOL_KV_BYTES};
    rtr_place_decision_t dec;
    rtr_place_decide(&in, cands, &dec);
    return dec;
}

static void test_idle_decode_stays_local(void)
{
    rtr_place_node_t p = node("p", 0, 0);
    rtr_place_cand_t c[1];
    const int64_t prompts[] = {1, 16, 500, 4000};
    for (size_t i = 0; i < sizeof prompts / sizeof *prompts; i++) {
        rtr_place_decision_t dec = decide(prompts[i], node("d", 0, 0), &p, 1, RTR_PREFILL_AUTO, c);
        /* same rate and step on both sides: remote only adds transfer and overhead */
        CHECK_MSG(!dec.remote && dec.best == 0, "prompt %lld went remote", (long long)prompts[i]);
        CHECK(dec.interference_s == 0);
        CHECK(near(dec.local_own_s, 0.01 + prompts[i] / 1000.0));
        CHECK(near(dec.cost_local_s, dec.local_own_s));
        CHECK(near(c[0].cost_s, 0.01 + prompts[i] / 1000.0 + prompts[i] * SMOL_KV_BYTES / 1e9 + 0.005));
        CHECK(near(dec.ttft_s, dec.local_own_s));
    }
}

static void test_busy_decode_sends_long_prompts_away(void)
{
    rtr_place_node_t p = node("p", 0, 0);
    rtr_place_cand_t c[1];
    rtr_place_decision_t dec = decide(2, node("d", 0, 2), &p, 1, RTR_PREFILL_AUTO, c);
    CHECK_MSG(!dec.remote, "2 tokens: local %.4f remote %.4f", dec.cost_local_s, c[0].cost_s);
    CHECK(near(dec.local_own_s, 0.002)); /* busy: no idle step */
    CHECK(near(dec.interference_s, 2 * 2 / 1000.0));
    /* a speculating decode node gains 3 tokens per step: each running sequence loses three times as much */
    rtr_place_node_t spec = node("d", 0, 2);
    spec.tokens_per_step = 3;
    dec = decide(2, spec, &p, 1, RTR_PREFILL_AUTO, c);
    CHECK(near(dec.interference_s, 3 * 2 * 2 / 1000.0));
    dec = decide(1000, node("d", 0, 2), &p, 1, RTR_PREFILL_AUTO, c);
    CHECK_MSG(dec.remote && dec.best == 0, "1000 tokens: local %.4f remote %.4f", dec.cost_local_s, c[0].cost_s);
    CHECK(near(dec.cost_local_s, 1.0 + 2.0));
    CHECK(near(dec.ttft_s, c[0].cost_s));
    CHECK(near(c[0].transfer_s, 1000 * SMOL_KV_BYTES / 1e9));

    /* the same with nothing measured anywhere: defaults on both sides, same answer */
    rtr_place_node_t d0 = {.node_id = "d", .running_seqs = 2}, p0 = {.node_id = "p"};
    CHECK(!decide(2, d0, &p0, 1, RTR_PREFILL_AUTO, c).remote);
    CHECK(decide(1000, d0, &p0, 1, RTR_PREFILL_AUTO, c).remote);

    /* the crossover sits at a few tokens: find it and check it is small */
    int64_t cross = 0;
    for (int64_t n = 1; n < 1000 && !cross; n++)
        if (decide(n, node("d", 0, 2), &p, 1, RTR_PREFILL_AUTO, c).remote) cross = n;
    CHECK_MSG(cross > 2 && cross < 16, "crossover at %lld tokens", (long long)cross);
}

static void test_shorter_queue_wins(void)
{
    rtr_place_node_t p[2] = {node("long", 10000, 0), node("short", 100, 0)};
    rtr_place_cand_t c[2];
    rtr_place_decision_t dec = decide(1000, node("d", 0, 4), p, 2, RTR_PREFILL_AUTO, c);
    CHECK(dec.remote && dec.best == 1);
    CHECK(c[0].cost_s > c[1].cost_s);
    CHECK(near(c[0].queue_s, 10.0) && near(c[1].queue_s, 0.1));
    /* order does not matter */
    rtr_place_node_t q[2] = {p[1], p[0]};
    CHECK(decide(1000, node("d", 0, 4), q, 2, RTR_PREFILL_AUTO, c).best == 0);
    /* a D with its own long queue: remote even for a D with no running decode */
    dec = decide(200, node("d", 5000, 0), p + 1, 1, RTR_PREFILL_AUTO, c);
    CHECK(dec.remote);
}

static void test_cached_prefix(void)
{
    rtr_place_node_t p[2] = {node("cold", 0, 0), node("warm", 0, 0)};
    p[1].cached_tokens = 960;
    rtr_place_cand_t c[2];
    rtr_place_decision_t dec = decide(1000, node("d", 0, 2), p, 2, RTR_PREFILL_AUTO, c);
    CHECK(dec.best == 1 && dec.remote);
    CHECK(c[1].uncached_tokens == 40 && c[0].uncached_tokens == 1000);
    CHECK(c[1].cost_s < c[0].cost_s);
    /* transfer counts what D lacks, not what P lacks */
    CHECK(near(c[1].transfer_s, c[0].transfer_s));

    /* D holding the prefix itself: little to compute, little interference: local */
    rtr_place_node_t d = node("d", 0, 2);
    d.cached_tokens = 992;
    dec = decide(1000, d, p, 2, RTR_PREFILL_AUTO, c);
    CHECK(!dec.remote && dec.uncached_local == 8);
    CHECK(near(c[0].transfer_s, 8 * SMOL_KV_BYTES / 1e9));

    /* a fully cached prompt still computes its last token */
    d.cached_tokens = 1000;
    dec = decide(1000, d, NULL, 0, RTR_PREFILL_AUTO, NULL);
    CHECK(dec.uncached_local == 1 && dec.best == -1 && !dec.remote);
}

static void test_unknown_rates(void)
{
    rtr_place_node_t d = {.node_id = "d"}, p = {.node_id = "p"};
    rtr_place_cand_t c[1];
    rtr_place_decision_t dec = decide(300, d, &p, 1, RTR_PREFILL_AUTO, c);
    CHECK(dec.d_rate == RTR_PLACE_DEFAULT_RATE && dec.d_step_s == RTR_PLACE_DEFAULT_STEP_S);
    CHECK(c[0].rate == RTR_PLACE_DEFAULT_RATE && c[0].step_s == RTR_PLACE_DEFAULT_STEP_S);
    CHECK(c[0].bps == RTR_PLACE_DEFAULT_XFER_BPS);
    CHECK(near(dec.local_own_s, RTR_PLACE_DEFAULT_STEP_S + 1.0));
    CHECK(!dec.remote && isfinite(c[0].cost_s));

    /* P measured, D not: D is assumed as fast as the prefill nodes */
    p.prefill_tok_s = 2000;
    dec = decide(300, d, &p, 1, RTR_PREFILL_AUTO, c);
    CHECK(dec.d_rate == 2000 && c[0].rate == 2000);
    /* D measured, P not: P is assumed as fast as D */
    d.prefill_tok_s = 500;
    p.prefill_tok_s = 0;
    dec = decide(300, d, &p, 1, RTR_PREFILL_AUTO, c);
    CHECK(dec.d_rate == 500 && c[0].rate == 500);
    /* negative counts from a confused node count as zero */
    d.queued_prefill_tokens = -5;
    d.running_seqs = -1;
    dec = decide(300, d, NULL, 0, RTR_PREFILL_AUTO, NULL);
    CHECK(near(dec.local_own_s, RTR_PLACE_DEFAULT_STEP_S + 300 / 500.0) && dec.interference_s == 0);
}

static void test_forced_modes(void)
{
    rtr_place_node_t p = node("p", 0, 0);
    rtr_place_cand_t c[1];
    rtr_place_decision_t dec = decide(4000, node("d", 0, 8), &p, 1, RTR_PREFILL_LOCAL, c);
    CHECK(!dec.remote && dec.best == 0); /* still costed, for the log */
    CHECK(near(dec.best_ttft_s, dec.local_own_s));
    dec = decide(4, node("d", 0, 0), &p, 1, RTR_PREFILL_REMOTE, c);
    CHECK(dec.remote && dec.best == 0 && near(dec.best_ttft_s, c[0].cost_s));
    dec = decide(4, node("d", 0, 0), NULL, 0, RTR_PREFILL_REMOTE, NULL);
    CHECK(!dec.remote && dec.best == -1 && dec.reason && strstr(dec.reason, "no prefill node"));
    dec = decide(4, node("d", 0, 0), NULL, 0, RTR_PREFILL_AUTO, NULL);
    CHECK(!dec.remote && dec.reason);

    rtr_prefill_mode m;
    CHECK(rtr_prefill_mode_parse("auto", &m) == BT_OK && m == RTR_PREFILL_AUTO);
    CHECK(rtr_prefill_mode_parse("local", &m) == BT_OK && m == RTR_PREFILL_LOCAL);
    CHECK(rtr_prefill_mode_parse("remote", &m) == BT_OK && m == RTR_PREFILL_REMOTE);
    CHECK(rtr_prefill_mode_parse("Remote", &m) == BT_ERR_INVALID && rtr_prefill_mode_parse("", &m) == BT_ERR_INVALID);
    CHECK(!strcmp(rtr_prefill_mode_name(RTR_PREFILL_REMOTE), "remote"));
}

static void test_slo_arithmetic(void)
{
    /* D with 3000 queued tokens at 1000 tok/s: 4 s locally with this prompt; an idle P takes about 1.04 s */
    rtr_place_node_t p = node("p", 0, 0);
    rtr_place_cand_t c[1];
    rtr_place_decision_t dec = decide(1000, node("d", 3000, 1), &p, 1, RTR_PREFILL_AUTO, c);
    CHECK(near(dec.local_own_s, 4.0));
    CHECK(near(dec.best_ttft_s, c[0].cost_s) && dec.best_ttft_s < 1.1);
    CHECK(!rtr_place_within_slo(dec.best_ttft_s, 0.5));
    CHECK(rtr_place_within_slo(dec.best_ttft_s, 2.0));
    CHECK(rtr_place_within_slo(dec.best_ttft_s, 0)); /* no SLO */
    /* forced local: the remote path does not count */
    dec = decide(1000, node("d", 3000, 1), &p, 1, RTR_PREFILL_LOCAL, c);
    CHECK(near(dec.best_ttft_s, 4.0) && !rtr_place_within_slo(dec.best_ttft_s, 2.0));
    /* interference is the other requests' cost, not this one's TTFT */
    dec = decide(1000, node("d", 0, 50), NULL, 0, RTR_PREFILL_AUTO, NULL);
    CHECK(near(dec.best_ttft_s, 1.0) && dec.cost_local_s > 50);
}

static void test_planner_replicas(void)
{
    CHECK(rtr_planner_replicas(0, 1000, 3) == 1);
    CHECK(rtr_planner_replicas(999, 1000, 0) == 1);
    CHECK(rtr_planner_replicas(1001, 1000, 0) == 2);
    CHECK(rtr_planner_replicas(5000, 1000, 0) == 5);
    CHECK(rtr_planner_replicas(5000, 0, 3) == 3);  /* unmeasured: keep what is there */
    CHECK(rtr_planner_replicas(5000, 0, 0) == 1);
    CHECK(rtr_planner_replicas(NAN, 1000, 0) == 1);
}

static void test_model_kv_bytes(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("test_model_kv_bytes: default model not cached (run deploy/fetch-model.sh)");
        return;
    }
    rtr_model_t m;
    REQUIRE(rtr_model_load(path, 0, &m) == BT_OK);
    CHECK(m.n_layer == 30 && m.n_head_kv == 3 && m.head_dim == 64);
    CHECK(m.kv_bytes_per_token == SMOL_KV_BYTES);
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)m.fingerprint_u64);
    CHECK(!strcmp(hex, m.fingerprint));
    rtr_model_free(&m);
}

/* Prefill candidates past 64 nodes: before, the router weighed the first 64 in view order and never used the rest. */
static void test_prefill_candidates(void)
{
    size_t out[RTR_MAX_PREFILL_CANDIDATES], scratch[300];
    unsigned char holds[300] = {0};
    uint64_t rng = 42;
    size_t k = rtr_prefill_candidates(10, NULL, RTR_MAX_PREFILL_CANDIDATES, &rng, scratch, out);
    CHECK(k == 10);
    for (size_t i = 0; i < k; i++) CHECK(out[i] == i);
    CHECK(rng == 42); /* no draw when everyone fits */

    const size_t n = 300;
    holds[7] = holds[250] = holds[299] = 1;
    int seen[300] = {0};
    for (int round = 0; round < 400; round++) {
        k = rtr_prefill_candidates(n, holds, RTR_MAX_PREFILL_CANDIDATES, &rng, scratch, out);
        REQUIRE(k == RTR_MAX_PREFILL_CANDIDATES);
        CHECK(out[0] == 7 && out[1] == 250 && out[2] == 299); /* prefix holders first */
        unsigned char dup[300] = {0};
        for (size_t i = 0; i < k; i++) {
            REQUIRE(out[i] < n);
            CHECK_MSG(!dup[out[i]], "index %zu twice", out[i]);
            dup[out[i]] = 1;
            seen[out[i]]++;
        }
    }
    /* every node is drawn, about evenly: 400 rounds x 61 draws over 297 nodes, ~82 each */
    int lo = 1 << 30, hi = 0;
    for (size_t i = 0; i < n; i++) {
        if (holds[i]) continue;
        if (seen[i] < lo) lo = seen[i];
        if (seen[i] > hi) hi = seen[i];
    }
    CHECK_MSG(lo >= 40 && hi <= 130, "draws per node %d..%d", lo, hi);
    /* more holders than room: the first max of them */
    memset(holds, 1, sizeof holds);
    k = rtr_prefill_candidates(n, holds, RTR_MAX_PREFILL_CANDIDATES, &rng, scratch, out);
    CHECK(k == RTR_MAX_PREFILL_CANDIDATES && out[0] == 0 && out[63] == 63);
}

int main(void)
{
    RUN(test_prefill_candidates);
    RUN(test_idle_decode_stays_local);
    RUN(test_busy_decode_sends_long_prompts_away);
    RUN(test_shorter_queue_wins);
    RUN(test_cached_prefix);
    RUN(test_unknown_rates);
    RUN(test_forced_modes);
    RUN(test_slo_arithmetic);
    RUN(test_planner_replicas);
    RUN(test_model_kv_bytes);
    return test_summary();
}
