/* tests engine/kv_groups.c: the sliding-window layers' block space. Release as the window moves, the prefix-reuse
 * rule (a prefix is reused only as far as the local window before its end is still cached), preemption and
 * recompute, truncation for speculative rollback, exhaustion, the pass-through without a window, and a randomized
 * run against a model of what every block holds. The invariant checkers run after every step. Includes the .c files
 * to reach the managers' internals (it needs only baton_common). */
#include "engine/block_manager.c"
#include "engine/kv_groups.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define FP 0x5eedf00dULL
#define W 64 /* window: 4 blocks */

static bt_kvg *mk(int32_t n_blocks, int32_t window)
{
    bt_kvg_config cfg = {.n_blocks = n_blocks, .window = window, .fingerprint = FP};
    bt_kvg *g = NULL;
    if (bt_kvg_create(&cfg, &g) != BT_OK) return NULL;
    return g;
}

#define INVARIANTS(g) CHECK_MSG(bt_kvg_check(g) == BT_OK, "%s", bt_last_error())

static void fill(int32_t *t, int32_t n, int32_t base)
{
    for (int32_t i = 0; i < n; i++) t[i] = base + i;
}

static int32_t local_held(const bt_kvg *g, int32_t seq)
{
    return bt_kvg_seq_local_blocks(g, seq);
}

static int32_t leading_released(const bt_kvg *g, int32_t seq)
{
    int32_t n, r = 0;
    const int32_t *t = bt_kvg_seq_local_table(g, seq, &n);
    while (r < n && t[r] == BT_BM_NO_BLOCK) r++;
    return r;
}

/* Computes tokens [len, len + n) of seq (append, then set_computed). */
static bt_status step(bt_kvg *g, int32_t seq, const int32_t *tokens, int32_t n)
{
    int32_t len = bt_kvg_seq_len(g, seq);
    bt_bm_copy c, lc;
    bt_status st = bt_kvg_seq_append(g, seq, n, tokens + len, &c, &lc);
    if (st != BT_OK) return st;
    return bt_kvg_seq_set_computed(g, seq, len + n);
}

static void test_no_window_passthrough(void)
{
    bt_kvg *g = mk(16, 0);
    REQUIRE(g != NULL);
    CHECK(!bt_kvg_windowed(g) && bt_kvg_local(g) == NULL);
    int32_t seq, tok[100], n;
    fill(tok, 100, 1);
    REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
    CHECK(step(g, seq, tok, 100) == BT_OK);
    CHECK(bt_kvg_seq_local_table(g, seq, &n) == NULL && n == 0);
    CHECK(bt_kvg_seq_local_blocks(g, seq) == 0);
    CHECK(bt_kvg_seq_release_window(g, seq, 100) == 0);
    bt_kvg_seq_table(g, seq, &n);
    CHECK(n == 7);
    INVARIANTS(g);
    bt_kvg_seq_free(g, seq);
    /* the same prompt again: every full block but the one holding the last token comes from the cache */
    int32_t cached = -1;
    REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
    CHECK(bt_kvg_prefix_probe(g, tok, 100, NULL, NULL) == 6);
    CHECK(bt_kvg_seq_match_prefix(g, seq, tok, 100, &cached) == BT_OK && cached == 96);
    INVARIANTS(g);
    bt_kvg_seq_free(g, seq);
    bt_kvg_destroy(g);
}

static void test_release_as_window_moves(void)
{
    bt_kvg *g = mk(64, W);
    REQUIRE(g != NULL);
    CHECK(bt_kvg_windowed(g));
    int32_t seq, tok[400];
    fill(tok, 400, 7);
    REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
    /* a prompt in chunks of 48, then decoding one token at a time */
    int32_t done = 0;
    while (done < 400) {
        int32_t n = done < 240 ? 48 : 1;
        REQUIRE(step(g, seq, tok, n) == BT_OK);
        done += n;
        INVARIANTS(g);
        int32_t nb = (done + 15) / 16, first = bt_kvg_window_first_block(W, done);
        CHECK_MSG(leading_released(g, seq) == first && local_held(g, seq) == nb - first,
                  "at %d: released %d (want %d), held %d", done, leading_released(g, seq), first,
                  local_held(g, seq));
    }
    bt_bm_stats gs, ls;
    bt_bm_get_stats(bt_kvg_global(g), &gs);
    bt_bm_get_stats(bt_kvg_local(g), &ls);
    /* 400 tokens: 25 global blocks; the local space holds the window before 400 (blocks 21..24) */
    CHECK_MSG(gs.blocks_used == 25 && ls.blocks_used == 4, "global %d local %d", gs.blocks_used, ls.blocks_used);
    /* released full blocks stay cached, published under their hashes */
    CHECK(ls.blocks_cached == 21);
    /* a query position inside the released window is refused by truncate; nothing changes */
    CHECK(bt_kvg_seq_truncate(g, seq, 100) == BT_ERR_INVALID);
    CHECK(bt_kvg_seq_len(g, seq) == 400);
    INVARIANTS(g);
    bt_kvg_seq_free(g, seq);
    bt_bm_get_stats(bt_kvg_local(g), &ls);
    CHECK(ls.blocks_used == 0 && ls.blocks_cached == 25);
    bt_kvg_destroy(g);
}

/* Evicts the local space's `n` least recently released cached blocks, as allocations by other sequences would. */
static void evict_local(bt_kvg *g, int32_t n)
{
    int32_t got = 0;
    while (got < n && g->local->lru_head >= 0) {
        int32_t b = g->local->lru_head;
        lru_unlink(g->local, b);
        htab_remove(g->local, b);
        g->local->n_cached--;
        bit_set(g->local, b);
        g->local->n_free++;
        got++;
    }
}

static void test_prefix_reuse_rules(void)
{
    int32_t tok[200], cached, seq, ev_g, ev_l;
    fill(tok, 200, 100);
    for (int scenario = 0; scenario < 4; scenario++) {
        bt_kvg *g = mk(40, W);
        REQUIRE(g != NULL);
        REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
        for (int32_t d = 0; d < 160; d += 32) REQUIRE(step(g, seq, tok, 32) == BT_OK);
        /* blocks 0..5 were released as the window moved (oldest first), 6..9 go on the free */
        bt_kvg_seq_free(g, seq);
        INVARIANTS(g);
        int32_t want = 0;
        if (scenario == 0) want = 10;                   /* everything cached */
        if (scenario == 1) evict_local(g, 6), want = 10; /* blocks 0..5 gone: nothing the window needs */
        if (scenario == 2) evict_local(g, 7), want = 0;  /* block 9 too: no k has its window cached */
        if (scenario == 3) bt_bm_cache_reset(g->local), want = 0; /* no local KV at all: recompute */
        INVARIANTS(g);
        REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
        CHECK_MSG(bt_kvg_prefix_probe(g, tok, 170, &ev_g, &ev_l) == want, "scenario %d: probe %d, want %d", scenario,
                  bt_kvg_prefix_probe(g, tok, 170, NULL, NULL), want);
        CHECK(ev_g == want);
        CHECK(ev_l == (want ? 4 : 0));
        REQUIRE(bt_kvg_seq_match_prefix(g, seq, tok, 170, &cached) == BT_OK);
        CHECK(cached == want * 16);
        CHECK(leading_released(g, seq) == bt_kvg_window_first_block(W, want * 16));
        INVARIANTS(g);
        REQUIRE(step(g, seq, tok, 170 - cached) == BT_OK);
        INVARIANTS(g);
        /* a shorter prompt (130 tokens: 8 matchable blocks) needs local blocks 4..7: cached in scenario 0 only */
        int32_t s2;
        REQUIRE(bt_kvg_seq_create(g, &s2) == BT_OK);
        REQUIRE(bt_kvg_seq_match_prefix(g, s2, tok, 130, &cached) == BT_OK);
        int32_t want2 = scenario == 0 ? 8 : scenario == 1 ? 0 : 0;
        if (scenario >= 1) {
            /* blocks 4 and 5 are gone locally; the recompute of scenario 2/3 published them again only if its
             * window passed over them: it computed 0..169 from scratch, so 0..9 are cached locally again */
            want2 = scenario == 1 ? 0 : 8;
        }
        CHECK_MSG(cached == want2 * 16, "scenario %d: shorter prompt reused %d tokens, want %d", scenario, cached,
                  want2 * 16);
        INVARIANTS(g);
        bt_kvg_seq_free(g, s2);
        bt_kvg_seq_free(g, seq);
        INVARIANTS(g);
        bt_kvg_destroy(g);
    }
}

static void test_truncate_for_speculation(void)
{
    bt_kvg *g = mk(32, W);
    REQUIRE(g != NULL);
    int32_t seq, tok[300];
    fill(tok, 300, 3);
    REQUIRE(bt_kvg_seq_create(g, &seq) == BT_OK);
    REQUIRE(step(g, seq, tok, 150) == BT_OK);
    /* the last token plus 5 drafts, then 2 of them accepted */
    bt_bm_copy c, lc;
    REQUIRE(bt_kvg_seq_append(g, seq, 6, tok + 150, &c, &lc) == BT_OK);
    CHECK(bt_kvg_seq_len(g, seq) == 156);
    REQUIRE(bt_kvg_seq_truncate(g, seq, 153) == BT_OK);
    REQUIRE(bt_kvg_seq_set_computed(g, seq, 153) == BT_OK);
    INVARIANTS(g);
    CHECK(leading_released(g, seq) == bt_kvg_window_first_block(W, 153));
    /* drafts crossing a block boundary, all rejected */
    REQUIRE(bt_kvg_seq_append(g, seq, 12, tok + 153, &c, &lc) == BT_OK);
    REQUIRE(bt_kvg_seq_truncate(g, seq, 154) == BT_OK);
    REQUIRE(bt_kvg_seq_set_computed(g, seq, 154) == BT_OK);
    INVARIANTS(g);
    int32_t n;
    bt_kvg_seq_table(g, seq, &n);
    CHECK(n == 10);
    bt_kvg_seq_local_table(g, seq, &n);
    CHECK(n == 10);
    bt_kvg_seq_free(g, seq);
    bt_kvg_destroy(g);
}

static void test_exhaustion_and_preemption(void)
{
    bt_kvg *g = mk(12, W);
    REQUIRE(g != NULL);
    int32_t a, b, tok[400], cached;
    fill(tok, 400, 50);
    REQUIRE(bt_kvg_seq_create(g, &a) == BT_OK);
    REQUIRE(bt_kvg_seq_create(g, &b) == BT_OK);
    REQUIRE(step(g, a, tok, 128) == BT_OK); /* 8 global blocks, 4 local */
    CHECK(step(g, b, tok + 200, 80) == BT_ERR_EXHAUSTED); /* 5 more global blocks: only 4 */
    CHECK(bt_kvg_seq_len(g, b) == 0);
    INVARIANTS(g);
    /* preempt a (its blocks stay cached), run b, then recompute a from the cache */
    bt_kvg_seq_free(g, a);
    CHECK(step(g, b, tok + 200, 80) == BT_OK);
    INVARIANTS(g);
    bt_kvg_seq_free(g, b);
    REQUIRE(bt_kvg_seq_create(g, &a) == BT_OK);
    REQUIRE(bt_kvg_seq_match_prefix(g, a, tok, 129, &cached) == BT_OK);
    /* b's 5 blocks evicted a's oldest global blocks (LRU): what is left decides the reuse */
    CHECK(cached % 16 == 0 && cached <= 128);
    INVARIANTS(g);
    REQUIRE(step(g, a, tok, 129 - cached) == BT_OK);
    INVARIANTS(g);
    bt_kvg_seq_free(g, a);
    bt_bm_stats gs, ls;
    bt_bm_get_stats(bt_kvg_global(g), &gs);
    bt_bm_get_stats(bt_kvg_local(g), &ls);
    CHECK(gs.blocks_used == 0 && ls.blocks_used == 0 && gs.n_seqs == 0 && ls.n_seqs == 0);
    bt_kvg_destroy(g);
}

/* ---- randomized run against a model of block contents ---- */

#define R_SEQS 6
#define R_MAXLEN 640

typedef struct rseq {
    int32_t id; /* -1: none */
    int32_t n_prompt, target;
    int32_t tokens[R_MAXLEN];
} rseq;

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* content[space][block]: chain hash of the full block last "written" there (lo bits), 0: none */
static uint64_t *content[2];

static void write_blocks(bt_kvg *g, int32_t seq, int32_t from, int32_t to)
{
    int32_t ng, nl;
    const int32_t *gt = bt_kvg_seq_table(g, seq, &ng), *lt = bt_kvg_seq_local_table(g, seq, &nl);
    const bm_seq *s = &g->global->seqs[seq];
    for (int32_t j = from / 16; j < to / 16; j++) { /* blocks that became full */
        bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
        for (int32_t i = 0; i <= j; i++) prev = bt_prefix_hash_block(prev, s->tokens + i * 16, FP);
        content[0][gt[j]] = prev.lo | 1;
        if (lt[j] >= 0) content[1][lt[j]] = prev.lo | 1;
    }
}

/* Every block a sequence's next query reads holds the KV of that sequence's own prefix. */
static int verify_contents(bt_kvg *g, int32_t seq)
{
    int32_t ng, nl, done = bt_kvg_seq_computed(g, seq);
    const int32_t *gt = bt_kvg_seq_table(g, seq, &ng), *lt = bt_kvg_seq_local_table(g, seq, &nl);
    const bm_seq *s = &g->global->seqs[seq];
    bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
    int32_t first = bt_kvg_window_first_block(W, done);
    for (int32_t j = 0; j < done / 16; j++) {
        prev = bt_prefix_hash_block(prev, s->tokens + j * 16, FP);
        if (content[0][gt[j]] != (prev.lo | 1)) return 0;
        if (j >= first && (lt[j] < 0 || content[1][lt[j]] != (prev.lo | 1))) return 0;
    }
    return 1;
}

static void test_random(void)
{
    const int32_t NB = 96;
    bt_kvg *g = mk(NB, W);
    REQUIRE(g != NULL);
    content[0] = calloc(NB, sizeof(uint64_t));
    content[1] = calloc(NB, sizeof(uint64_t));
    rseq *rs = calloc(R_SEQS, sizeof *rs);
    REQUIRE(content[0] && content[1] && rs);
    uint64_t rng = 0x1234567ULL;
    for (int i = 0; i < R_SEQS; i++) rs[i].id = -1;
    int bad = 0, reused = 0;
    for (int it = 0; it < 6000 && !bad; it++) {
        rseq *r = &rs[rng_next(&rng) % R_SEQS];
        if (r->id < 0) { /* admit a prompt sharing a prefix with a family of 3 */
            int fam = (int)(rng_next(&rng) % 3);
            r->n_prompt = 20 + (int32_t)(rng_next(&rng) % 300);
            r->target = r->n_prompt + (int32_t)(rng_next(&rng) % 200);
            int32_t shared = (int32_t)(rng_next(&rng) % (uint64_t)r->n_prompt);
            for (int32_t i = 0; i < r->target; i++)
                r->tokens[i] = i < shared ? fam * 1000 + i : (int32_t)(rng_next(&rng) % 5000) + 10000;
            int32_t cached;
            if (bt_kvg_seq_create(g, &r->id) != BT_OK) { bad = 1; break; }
            if (bt_kvg_seq_match_prefix(g, r->id, r->tokens, r->n_prompt, &cached) != BT_OK) { bad = 2; break; }
            reused += cached > 0;
            if (!verify_contents(g, r->id)) { bad = 3; break; }
        } else if (rng_next(&rng) % 10 == 0) { /* finish or preempt */
            bt_kvg_seq_free(g, r->id);
            r->id = -1;
        } else {
            int32_t len = bt_kvg_seq_len(g, r->id);
            if (len >= r->target) {
                bt_kvg_seq_free(g, r->id);
                r->id = -1;
            } else {
                int32_t n = len < r->n_prompt ? 1 + (int32_t)(rng_next(&rng) % 64) : 1;
                if (len + n > r->target) n = r->target - len;
                int32_t drafts = len >= r->n_prompt ? (int32_t)(rng_next(&rng) % 4) : 0;
                if (len + n + drafts > r->target) drafts = 0;
                bt_bm_copy c, lc;
                bt_status st = bt_kvg_seq_append(g, r->id, n + drafts, r->tokens + len, &c, &lc);
                if (st == BT_ERR_EXHAUSTED) { /* preempt this one */
                    bt_kvg_seq_free(g, r->id);
                    r->id = -1;
                } else if (st != BT_OK) {
                    bad = 4;
                } else {
                    if (drafts && bt_kvg_seq_truncate(g, r->id, len + n) != BT_OK) bad = 5;
                    write_blocks(g, r->id, len, len + n);
                    if (bt_kvg_seq_set_computed(g, r->id, len + n) != BT_OK) bad = 6;
                    if (!bad && !verify_contents(g, r->id)) bad = 7;
                }
            }
        }
        if (!bad && bt_kvg_check(g) != BT_OK) {
            fprintf(stderr, "iteration %d: %s\n", it, bt_last_error());
            bad = 8;
        }
    }
    CHECK_MSG(!bad, "random run failed (%d)", bad);
    CHECK_MSG(reused > 50, "only %d admissions reused a prefix", reused);
    for (int i = 0; i < R_SEQS; i++)
        if (rs[i].id >= 0) bt_kvg_seq_free(g, rs[i].id);
    INVARIANTS(g);
    free(rs);
    free(content[0]);
    free(content[1]);
    bt_kvg_destroy(g);
}

int main(void)
{
    RUN(test_no_window_passthrough);
    RUN(test_release_as_window_moves);
    RUN(test_prefix_reuse_rules);
    RUN(test_truncate_for_speculation);
    RUN(test_exhaustion_and_preemption);
    RUN(test_random);
    return test_summary();
}
