/* tests engine/block_manager.c: allocation, refcounts, copy-on-write, contiguous runs, LRU eviction, prefix hits,
 * exhaustion, truncation, the sliding window, and a randomized stress run against a reference model of refcounts
 * and of the KV slots' contents. The invariant checker runs after every step. Includes the .c to reach the
 * refcounts (it needs only baton_common). */
#include "engine/block_manager.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

#define FP 0x5eedf00dULL

static bt_bm *mk(int32_t n_blocks, int32_t window, int disable_cache)
{
    bt_bm_config cfg = {.n_blocks = n_blocks, .window = window, .fingerprint = FP,
                        .disable_prefix_cache = disable_cache};
    bt_bm *bm = NULL;
    if (bt_bm_create(&cfg, &bm) != BT_OK) return NULL;
    return bm;
}

#define INVARIANTS(bm) CHECK_MSG(bt_bm_check(bm) == BT_OK, "%s", bt_last_error())

/* After a test frees its sequences every block must be free or cached. */
static void check_all_back(bt_bm *bm)
{
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    INVARIANTS(bm);
    CHECK_MSG(st.blocks_used == 0 && st.n_seqs == 0 && st.blocks_free + st.blocks_cached == st.blocks_total,
              "used %d free %d cached %d of %d, %d seqs", st.blocks_used, st.blocks_free, st.blocks_cached,
              st.blocks_total, st.n_seqs);
}

static void fill_tokens(int32_t *t, int32_t n, int32_t base)
{
    for (int32_t i = 0; i < n; i++) t[i] = base + i;
}

static const int32_t *table_of(bt_bm *bm, int32_t seq, int32_t *n)
{
    return bt_bm_seq_table(bm, seq, n);
}

static void test_create_errors(void)
{
    bt_bm *bm = NULL;
    bt_bm_config cfg = {.n_blocks = 0};
    CHECK(bt_bm_create(&cfg, &bm) == BT_ERR_INVALID && bm == NULL);
    cfg.n_blocks = 4;
    cfg.window = -1;
    CHECK(bt_bm_create(&cfg, &bm) == BT_ERR_INVALID && bm == NULL);
    bt_bm_destroy(NULL);
    bm = mk(1, 0, 0);
    REQUIRE(bm != NULL);
    INVARIANTS(bm);
    int32_t n;
    CHECK(bt_bm_seq_table(bm, 0, &n) == NULL && n == 0);
    CHECK(bt_bm_seq_len(bm, 7) == -1);
    int32_t t[1] = {1};
    CHECK(bt_bm_seq_append(bm, 3, 1, t, NULL) == BT_ERR_INVALID);
    bt_bm_seq_free(bm, 3); /* ignored */
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_alloc_free_refcount(void)
{
    bt_bm *bm = mk(64, 0, 0);
    REQUIRE(bm != NULL);
    int32_t tok[200], a, b, n;
    fill_tokens(tok, 200, 100);
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    bt_bm_copy cow;
    CHECK(bt_bm_seq_blocks_needed(bm, a, 40) == 3);
    REQUIRE(bt_bm_seq_append(bm, a, 40, tok, &cow) == BT_OK);
    CHECK(cow.src == -1);
    const int32_t *t = table_of(bm, a, &n);
    CHECK(n == 3 && t[0] == 0 && t[1] == 1 && t[2] == 2);
    CHECK(bt_bm_seq_len(bm, a) == 40 && bt_bm_seq_computed(bm, a) == 0);
    INVARIANTS(bm);
    for (int i = 40; i < 48; i++) REQUIRE(bt_bm_seq_append(bm, a, 1, tok + i, &cow) == BT_OK);
    CHECK(bt_bm_seq_blocks_needed(bm, a, 1) == 1);
    CHECK(bt_bm_seq_append(bm, a, 1, tok + 48, &cow) == BT_OK);
    t = table_of(bm, a, &n);
    CHECK(n == 4 && t[3] == 3 && bt_bm_count_runs(t, n) == 1);

    REQUIRE(bt_bm_seq_create(bm, &b) == BT_OK);
    CHECK(b != a);
    REQUIRE(bt_bm_seq_append(bm, b, 17, tok, &cow) == BT_OK);
    t = table_of(bm, b, &n);
    CHECK(n == 2 && t[0] == 4 && t[1] == 5);
    /* a grows: 5 is taken, so it continues at the smallest free run */
    REQUIRE(bt_bm_seq_append(bm, a, 16, tok, &cow) == BT_OK);
    t = table_of(bm, a, &n);
    CHECK(n == 5 && t[4] == 6);
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_used == 7 && st.blocks_free == 57 && st.blocks_cached == 0 && st.n_seqs == 2);
    CHECK(bm->refcount[0] == 1 && bm->refcount[6] == 1 && bm->refcount[7] == 0);
    INVARIANTS(bm);
    bt_bm_seq_free(bm, a);
    INVARIANTS(bm);
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_used == 2 && st.n_seqs == 1);
    bt_bm_seq_free(bm, b);
    /* no set_computed: nothing was hashed, so everything is free, not cached */
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_free == 64 && st.blocks_hashed == 0);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_fork_copy_on_write(void)
{
    bt_bm *bm = mk(64, 0, 0);
    REQUIRE(bm != NULL);
    int32_t tok[64], a, b, c, n;
    fill_tokens(tok, 64, 7);
    bt_bm_copy cow;
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, a, 20, tok, &cow) == BT_OK); /* blocks 0, 1 (partial) */
    REQUIRE(bt_bm_seq_set_computed(bm, a, 20) == BT_OK);
    REQUIRE(bt_bm_seq_fork(bm, a, &b) == BT_OK);
    CHECK(bt_bm_seq_len(bm, b) == 20 && bt_bm_seq_computed(bm, b) == 20);
    CHECK(bm->refcount[0] == 2 && bm->refcount[1] == 2);
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_used == 2 && st.blocks_shared == 2 && st.n_seqs == 2);
    INVARIANTS(bm);

    /* the first writer into the shared partial block gets a private copy */
    CHECK(bt_bm_seq_blocks_needed(bm, a, 1) == 1);
    CHECK(bt_bm_seq_append(bm, a, 1, tok + 20, NULL) == BT_ERR_INVALID); /* a copy is due: must be reportable */
    REQUIRE(bt_bm_seq_append(bm, a, 1, tok + 20, &cow) == BT_OK);
    CHECK(cow.src == 1 && cow.dst == 2);
    const int32_t *t = table_of(bm, a, &n);
    CHECK(n == 2 && t[0] == 0 && t[1] == 2);
    CHECK(bm->refcount[0] == 2 && bm->refcount[1] == 1 && bm->refcount[2] == 1);
    /* the other is now alone in block 1 and writes in place */
    CHECK(bt_bm_seq_blocks_needed(bm, b, 1) == 0);
    REQUIRE(bt_bm_seq_append(bm, b, 1, tok + 40, &cow) == BT_OK);
    CHECK(cow.src == -1);
    t = table_of(bm, b, &n);
    CHECK(n == 2 && t[0] == 0 && t[1] == 1);
    bt_bm_get_stats(bm, &st);
    CHECK(st.cow_copies == 1 && st.blocks_shared == 1);
    INVARIANTS(bm);

    /* a fork on a block boundary never copies: the next token opens a new block */
    REQUIRE(bt_bm_seq_append(bm, b, 11, tok + 41, &cow) == BT_OK); /* b: 32 tokens */
    REQUIRE(bt_bm_seq_fork(bm, b, &c) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, c, 1, tok, &cow) == BT_OK);
    CHECK(cow.src == -1);
    REQUIRE(bt_bm_seq_append(bm, b, 1, tok, &cow) == BT_OK);
    CHECK(cow.src == -1);
    bt_bm_get_stats(bm, &st);
    CHECK(st.cow_copies == 1);
    INVARIANTS(bm);

    /* n = 4 samples of one prompt: three copies, the last writer keeps the original */
    int32_t p, kids[3];
    REQUIRE(bt_bm_seq_create(bm, &p) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, p, 37, tok, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, p, 37) == BT_OK);
    for (int i = 0; i < 3; i++) REQUIRE(bt_bm_seq_fork(bm, p, &kids[i]) == BT_OK);
    int32_t last = table_of(bm, p, &n)[2];
    CHECK(bm->refcount[last] == 4);
    int copies = 0;
    int32_t seqs[4] = {kids[0], kids[1], p, kids[2]};
    for (int i = 0; i < 4; i++) {
        REQUIRE(bt_bm_seq_append(bm, seqs[i], 1, tok + i, &cow) == BT_OK);
        if (cow.src >= 0) {
            CHECK(cow.src == last && cow.dst != last);
            copies++;
        }
        INVARIANTS(bm);
    }
    CHECK(copies == 3 && bm->refcount[last] == 1);
    CHECK(table_of(bm, kids[2], &n)[2] == last);
    for (int i = 0; i < 4; i++) CHECK(bm->refcount[table_of(bm, seqs[i], &n)[0]] == 4);
    bt_bm_seq_free(bm, a);
    bt_bm_seq_free(bm, b);
    bt_bm_seq_free(bm, c);
    for (int i = 0; i < 4; i++) bt_bm_seq_free(bm, seqs[i]);
    check_all_back(bm);
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_cached == 2); /* a's first block, and p's second (p's first duplicates a's: unpublished) */
    bt_bm_destroy(bm);
}

static void test_contiguous_runs(void)
{
    bt_bm *bm = mk(64, 0, 1);
    REQUIRE(bm != NULL);
    int32_t tok[64 * 16], s[8], n;
    fill_tokens(tok, 64 * 16, 0);
    bt_bm_copy cow;
    for (int i = 0; i < 8; i++) {
        REQUIRE(bt_bm_seq_create(bm, &s[i]) == BT_OK);
        REQUIRE(bt_bm_seq_append(bm, s[i], 64, tok, &cow) == BT_OK); /* 4 blocks each: 0..31 */
        const int32_t *t = table_of(bm, s[i], &n);
        CHECK(n == 4 && t[0] == 4 * i && bt_bm_count_runs(t, n) == 1);
    }
    /* fragment: holes of 4 at 4..7, 12..15, 20..23, plus the free tail 32..63 */
    bt_bm_seq_free(bm, s[1]);
    bt_bm_seq_free(bm, s[3]);
    bt_bm_seq_free(bm, s[5]);
    INVARIANTS(bm);
    int32_t x, y, z, w;
    /* 3 blocks: the smallest run that fits is a hole of 4 */
    REQUIRE(bt_bm_seq_create(bm, &x) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, x, 48, tok, &cow) == BT_OK);
    const int32_t *t = table_of(bm, x, &n);
    CHECK(n == 3 && t[0] == 4 && bt_bm_count_runs(t, n) == 1);
    /* growing x by one extends its run (block 7) */
    REQUIRE(bt_bm_seq_append(bm, x, 1, tok, &cow) == BT_OK);
    t = table_of(bm, x, &n);
    CHECK(n == 4 && t[3] == 7 && bt_bm_count_runs(t, n) == 1);
    /* 10 blocks: only the tail fits them in one run, though lower holes are free */
    REQUIRE(bt_bm_seq_create(bm, &y) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, y, 160, tok, &cow) == BT_OK);
    t = table_of(bm, y, &n);
    CHECK(n == 10 && t[0] == 32 && bt_bm_count_runs(t, n) == 1);
    /* y grows by 3 blocks in one append: extension again */
    REQUIRE(bt_bm_seq_append(bm, y, 48, tok, &cow) == BT_OK);
    t = table_of(bm, y, &n);
    CHECK(n == 13 && bt_bm_count_runs(t, n) == 1);
    INVARIANTS(bm);
    /* fill the tail so only the holes 12..15 and 20..23 remain free besides 45..63 */
    REQUIRE(bt_bm_seq_create(bm, &z) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, z, 19 * 16, tok, &cow) == BT_OK);
    t = table_of(bm, z, &n);
    CHECK(n == 19 && t[0] == 45 && bt_bm_count_runs(t, n) == 1);
    /* 6 blocks with no run of 6: two runs (the largest first), not six scattered ids */
    REQUIRE(bt_bm_seq_create(bm, &w) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, w, 96, tok, &cow) == BT_OK);
    t = table_of(bm, w, &n);
    CHECK(n == 6 && bt_bm_count_runs(t, n) == 2);
    CHECK(t[0] == 12 && t[3] == 15 && t[4] == 20 && t[5] == 21);
    INVARIANTS(bm);
    int32_t ids[] = {3, 4, 5, 9, BT_BM_NO_BLOCK, 10, 2};
    CHECK(bt_bm_count_runs(ids, 7) == 3);
    CHECK(bt_bm_count_runs(ids, 0) == 0);
    int32_t all[] = {s[0], s[2], s[4], s[6], s[7], x, y, z, w};
    for (int i = 0; i < 9; i++) bt_bm_seq_free(bm, all[i]);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

/* A sequence holding one full computed block (17 tokens from base) that is freed at once: one cached block. */
static int32_t cache_one(bt_bm *bm, int32_t base)
{
    int32_t tok[17], s, n;
    bt_bm_copy cow;
    fill_tokens(tok, 17, base);
    if (bt_bm_seq_create(bm, &s) != BT_OK || bt_bm_seq_append(bm, s, 17, tok, &cow) != BT_OK ||
        bt_bm_seq_set_computed(bm, s, 17) != BT_OK)
        return -1;
    int32_t b = bt_bm_seq_table(bm, s, &n)[0];
    bt_bm_seq_free(bm, s);
    return b;
}

static int32_t probe_base(bt_bm *bm, int32_t base, int32_t n_tokens)
{
    int32_t tok[256];
    fill_tokens(tok, n_tokens, base);
    return bt_bm_prefix_probe(bm, tok, n_tokens, NULL);
}

static void test_lru_eviction_order(void)
{
    bt_bm *bm = mk(8, 0, 0);
    REQUIRE(bm != NULL);
    int32_t bx = cache_one(bm, 1000), by = cache_one(bm, 2000), bz = cache_one(bm, 3000);
    REQUIRE(bx >= 0 && by >= 0 && bz >= 0);
    CHECK(bx != by && by != bz && bx != bz);
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_cached == 3 && st.blocks_free == 5 && st.evictions == 0);
    CHECK(probe_base(bm, 1000, 17) == 1 && probe_base(bm, 2000, 17) == 1 && probe_base(bm, 3000, 17) == 1);
    INVARIANTS(bm);

    /* reusing y's block moves it out of the LRU list */
    int32_t tok[256], s, hit, n;
    bt_bm_copy cow;
    fill_tokens(tok, 17, 2000);
    REQUIRE(bt_bm_seq_create(bm, &s) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, s, tok, 17, &hit) == BT_OK);
    CHECK(hit == 16 && table_of(bm, s, &n)[0] == by && bm->refcount[by] == 1);
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_cached == 2 && st.blocks_used == 1);
    INVARIANTS(bm);

    /* exhaust the free blocks: 6 more tokens blocks (5 free + 1 eviction); x goes first, then z */
    int32_t big;
    fill_tokens(tok, 256, 5000);
    REQUIRE(bt_bm_seq_create(bm, &big) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, big, 96, tok, &cow) == BT_OK);
    bt_bm_get_stats(bm, &st);
    CHECK(st.evictions == 1 && st.blocks_free == 0 && st.blocks_cached == 1);
    CHECK(probe_base(bm, 1000, 17) == 0 && probe_base(bm, 3000, 17) == 1);
    const int32_t *t = table_of(bm, big, &n);
    int has_x = 0;
    for (int i = 0; i < n; i++) has_x |= t[i] == bx;
    CHECK(has_x);
    INVARIANTS(bm);
    REQUIRE(bt_bm_seq_append(bm, big, 16, tok + 96, &cow) == BT_OK);
    bt_bm_get_stats(bm, &st);
    CHECK(st.evictions == 2 && st.blocks_cached == 0 && probe_base(bm, 3000, 17) == 0);
    /* y is in use, so nothing is left to evict */
    CHECK(!bt_bm_can_allocate(bm, 1));
    CHECK(bt_bm_seq_append(bm, big, 16, tok + 112, &cow) == BT_ERR_EXHAUSTED);
    INVARIANTS(bm);
    bt_bm_seq_free(bm, s);
    bt_bm_seq_free(bm, big);
    check_all_back(bm);

    /* a freed sequence's blocks enter the list tail first, so a long prefix is evicted from its end */
    bt_bm_cache_reset(bm);
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_cached == 0 && st.blocks_free == 8 && st.blocks_hashed == 0);
    fill_tokens(tok, 65, 9000);
    REQUIRE(bt_bm_seq_create(bm, &s) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, s, 65, tok, &cow) == BT_OK); /* 5 blocks, 4 full */
    REQUIRE(bt_bm_seq_set_computed(bm, s, 65) == BT_OK);
    bt_bm_seq_free(bm, s);
    CHECK(probe_base(bm, 9000, 65) == 4);
    /* take 4 free + 2 evicted */
    REQUIRE(bt_bm_seq_create(bm, &s) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, s, 96, tok + 100, &cow) == BT_OK);
    CHECK(probe_base(bm, 9000, 65) == 2); /* blocks 0 and 1 of the prefix survive */
    bt_bm_seq_free(bm, s);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_prefix_hits_across_sequences(void)
{
    enum { PREFIX = 512 };
    bt_bm *bm = mk(256, 0, 0);
    REQUIRE(bm != NULL);
    int32_t pa[PREFIX + 40], pb[PREFIX + 40], a, b, c, hit, n;
    uint64_t seed = 11;
    for (int i = 0; i < PREFIX + 40; i++) pa[i] = pb[i] = (int32_t)(test_rand_next(&seed) % 32000);
    for (int i = PREFIX; i < PREFIX + 40; i++) pb[i] = (int32_t)(test_rand_next(&seed) % 32000);
    bt_bm_copy cow;

    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, a, pa, PREFIX + 20, &hit) == BT_OK);
    CHECK(hit == 0 && bt_bm_seq_len(bm, a) == 0);
    /* chunked prefill: two chunks, each published once computed */
    REQUIRE(bt_bm_seq_append(bm, a, 300, pa, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, a, 300) == BT_OK);
    CHECK(probe_base(bm, 0, 0) == 0);
    CHECK(bt_bm_prefix_probe(bm, pa, PREFIX + 20, NULL) == 300 / 16);
    REQUIRE(bt_bm_seq_append(bm, a, PREFIX + 20 - 300, pa + 300, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, a, PREFIX + 20) == BT_OK);
    INVARIANTS(bm);

    /* b shares the 512-token prefix: 32 blocks come from the cache, only its suffix is computed */
    int32_t ev = -1;
    CHECK(bt_bm_prefix_probe(bm, pb, PREFIX + 30, &ev) == 32 && ev == 0);
    REQUIRE(bt_bm_seq_create(bm, &b) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, b, pb, PREFIX + 30, &hit) == BT_OK);
    CHECK(hit == PREFIX && bt_bm_seq_len(bm, b) == PREFIX && bt_bm_seq_computed(bm, b) == PREFIX);
    const int32_t *ta = table_of(bm, a, &n);
    const int32_t *tb = table_of(bm, b, &n);
    CHECK(n == 32);
    for (int i = 0; i < 32; i++) CHECK(ta[i] == tb[i] && bm->refcount[ta[i]] == 2);
    int32_t a_first = ta[0];
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    CHECK(st.prefix_queries == 2 && st.prefix_hit_blocks == 32 && st.prefix_hit_tokens == PREFIX);
    CHECK(st.prefix_query_tokens == (uint64_t)(PREFIX + 20 + PREFIX + 30));
    CHECK(st.prefix_query_blocks == (uint64_t)((PREFIX + 19) / 16 + (PREFIX + 29) / 16));
    REQUIRE(bt_bm_seq_append(bm, b, 30, pb + PREFIX, &cow) == BT_OK);
    CHECK(cow.src == -1);
    REQUIRE(bt_bm_seq_set_computed(bm, b, PREFIX + 30) == BT_OK);
    INVARIANTS(bm);

    /* an exact 512-token prompt: the last block is recomputed so the last token has logits */
    REQUIRE(bt_bm_seq_create(bm, &c) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, c, pa, PREFIX, &hit) == BT_OK);
    CHECK(hit == PREFIX - 16);
    REQUIRE(bt_bm_seq_append(bm, c, 16, pa + PREFIX - 16, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, c, PREFIX) == BT_OK);
    /* the duplicate of block 31 is not published: the table keeps a's */
    CHECK(!bm->in_table[table_of(bm, c, &n)[31]] && bm->in_table[ta[31]]);
    INVARIANTS(bm);

    /* after everyone leaves the prefix stays cached and the next request still hits it */
    bt_bm_seq_free(bm, a);
    bt_bm_seq_free(bm, b);
    bt_bm_seq_free(bm, c);
    check_all_back(bm);
    CHECK(bt_bm_prefix_probe(bm, pb, PREFIX + 30, &ev) == 33 && ev == 33);
    CHECK(bt_bm_can_allocate(bm, 256));
    REQUIRE(bt_bm_seq_create(bm, &b) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, b, pb, PREFIX + 30, &hit) == BT_OK);
    CHECK(hit == PREFIX + 16);
    CHECK(!bt_bm_can_allocate(bm, 256) && bt_bm_can_allocate(bm, 256 - 33));
    bt_bm_seq_free(bm, b);

    /* another model's fingerprint shares nothing */
    bt_bm_config cfg = {.n_blocks = 8, .fingerprint = FP + 1};
    bt_bm *other = NULL;
    REQUIRE(bt_bm_create(&cfg, &other) == BT_OK);
    REQUIRE(bt_bm_seq_create(other, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(other, a, 32, pa, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(other, a, 32) == BT_OK);
    CHECK(bt_bm_prefix_probe(other, pa, 40, NULL) == 2 && bt_bm_prefix_probe(bm, pa, 40, NULL) == 2);
    CHECK(!bt_prefix_hash_eq(other->hash[table_of(other, a, &n)[0]], bm->hash[a_first]));
    bt_bm_seq_free(other, a);
    check_all_back(other);
    bt_bm_destroy(other);

    /* with the cache disabled nothing is published or matched, though queries are counted */
    bt_bm *cold = mk(64, 0, 1);
    REQUIRE(cold != NULL);
    REQUIRE(bt_bm_seq_create(cold, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(cold, a, 64, pa, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(cold, a, 64) == BT_OK);
    REQUIRE(bt_bm_seq_create(cold, &b) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(cold, b, pa, 64, &hit) == BT_OK);
    CHECK(hit == 0);
    bt_bm_get_stats(cold, &st);
    CHECK(st.blocks_hashed == 0 && st.prefix_queries == 1 && st.prefix_hit_blocks == 0);
    bt_bm_seq_free(cold, a);
    bt_bm_seq_free(cold, b);
    check_all_back(cold);
    bt_bm_destroy(cold);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_exhaustion_and_preemption(void)
{
    bt_bm *bm = mk(10, 0, 0);
    REQUIRE(bm != NULL);
    int32_t tok[200], a, b, c, n;
    fill_tokens(tok, 200, 1);
    bt_bm_copy cow;
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, a, 100, tok, &cow) == BT_OK); /* 7 blocks */
    REQUIRE(bt_bm_seq_set_computed(bm, a, 100) == BT_OK);
    REQUIRE(bt_bm_seq_create(bm, &b) == BT_OK);
    CHECK(bt_bm_seq_blocks_needed(bm, b, 64) == 4);
    CHECK(bt_bm_can_allocate(bm, 3) && !bt_bm_can_allocate(bm, 4));
    bt_bm_stats before, after;
    bt_bm_get_stats(bm, &before);
    CHECK(bt_bm_seq_append(bm, b, 64, tok, &cow) == BT_ERR_EXHAUSTED);
    CHECK(strstr(bt_last_error(), "exhausted") != NULL);
    bt_bm_get_stats(bm, &after);
    CHECK(bt_bm_seq_len(bm, b) == 0 && before.blocks_used == after.blocks_used &&
          before.blocks_free == after.blocks_free && before.blocks_cached == after.blocks_cached);
    INVARIANTS(bm);

    /* copy-on-write also needs a block: a fork of a full pool cannot write its partial block */
    REQUIRE(bt_bm_seq_append(bm, b, 48, tok, &cow) == BT_OK); /* 3 blocks: pool full */
    REQUIRE(bt_bm_seq_fork(bm, a, &c) == BT_OK);
    CHECK(bt_bm_seq_blocks_needed(bm, c, 1) == 1);
    CHECK(bt_bm_seq_append(bm, c, 1, tok, &cow) == BT_ERR_EXHAUSTED);
    CHECK(bt_bm_seq_len(bm, c) == 100 && cow.src == -1);
    INVARIANTS(bm);

    /* the scheduler preempts a victim (recompute): its full blocks stay cached, the request retries later */
    bt_bm_seq_free(bm, c);
    bt_bm_seq_free(bm, a);
    INVARIANTS(bm);
    bt_bm_get_stats(bm, &after);
    CHECK(after.blocks_cached == 6 && after.blocks_free == 1);
    int32_t hit;
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_match_prefix(bm, a, tok, 100, &hit) == BT_OK);
    CHECK(hit == 96); /* the resumed victim recomputes only its last 4 tokens */
    REQUIRE(bt_bm_seq_append(bm, a, 4, tok + 96, &cow) == BT_OK);
    bt_bm_get_stats(bm, &after);
    CHECK(after.blocks_free == 0 && after.blocks_used == 10);
    (void)table_of(bm, a, &n);
    bt_bm_seq_free(bm, a);
    bt_bm_seq_free(bm, b);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_truncate(void)
{
    bt_bm *bm = mk(32, 0, 0);
    REQUIRE(bm != NULL);
    int32_t tok[100], a, b, n;
    fill_tokens(tok, 100, 50);
    bt_bm_copy cow;
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, a, 40, tok, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, a, 40) == BT_OK);
    /* speculative drafts 40..47 then a rejection back to 43 */
    REQUIRE(bt_bm_seq_append(bm, a, 8, tok + 40, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_truncate(bm, a, 43) == BT_OK);
    CHECK(bt_bm_seq_len(bm, a) == 43 && bt_bm_seq_computed(bm, a) == 40);
    CHECK(bt_bm_seq_truncate(bm, a, 44) == BT_ERR_INVALID);
    INVARIANTS(bm);
    /* back into a published block: it keeps its hash until written */
    REQUIRE(bt_bm_seq_truncate(bm, a, 20) == BT_OK);
    CHECK(bt_bm_seq_computed(bm, a) == 20 && bt_bm_prefix_probe(bm, tok, 40, NULL) == 2);
    INVARIANTS(bm);
    /* shared by a fork, the first write copies it and the original stays published */
    REQUIRE(bt_bm_seq_fork(bm, a, &b) == BT_OK);
    int32_t blk1 = table_of(bm, a, &n)[1];
    int32_t other[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    REQUIRE(bt_bm_seq_append(bm, a, 8, other, &cow) == BT_OK);
    CHECK(cow.src == blk1 && cow.dst != blk1);
    CHECK(bm->in_table[blk1] && bt_bm_prefix_probe(bm, tok, 40, NULL) == 2);
    /* held alone, the write unpublishes it */
    REQUIRE(bt_bm_seq_append(bm, b, 8, other, &cow) == BT_OK);
    CHECK(cow.src == -1 && !bm->in_table[blk1] && bt_bm_prefix_probe(bm, tok, 40, NULL) == 1);
    INVARIANTS(bm);
    /* writing different tokens then publishing gives the new chain */
    REQUIRE(bt_bm_seq_set_computed(bm, b, 28) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, b, 4, other, &cow) == BT_OK);
    REQUIRE(bt_bm_seq_set_computed(bm, b, 32) == BT_OK);
    int32_t chain[40];
    memcpy(chain, tok, 20 * sizeof *chain);
    memcpy(chain + 20, other, 8 * sizeof *chain);
    memcpy(chain + 28, other, 4 * sizeof *chain);
    CHECK(bt_bm_prefix_probe(bm, chain, 33, NULL) == 2);
    INVARIANTS(bm);
    REQUIRE(bt_bm_seq_truncate(bm, a, 0) == BT_OK);
    CHECK(bt_bm_seq_len(bm, a) == 0 && table_of(bm, a, &n) != NULL && n == 0);
    INVARIANTS(bm);
    bt_bm_seq_free(bm, a);
    bt_bm_seq_free(bm, b);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

static void test_sliding_window(void)
{
    bt_bm *bm = mk(32, 32, 0);
    REQUIRE(bm != NULL);
    int32_t tok[200], a, b, n;
    fill_tokens(tok, 200, 3);
    bt_bm_copy cow;
    REQUIRE(bt_bm_seq_create(bm, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(bm, a, 100, tok, &cow) == BT_OK); /* 7 blocks */
    REQUIRE(bt_bm_seq_set_computed(bm, a, 100) == BT_OK);
    CHECK(bt_bm_seq_release_window(bm, a, 101) == -1);
    CHECK(bt_bm_seq_release_window(bm, a, 40) == 0);  /* 40 - 32 = 8: no block ends before 8 */
    CHECK(bt_bm_seq_release_window(bm, a, 100) == 4); /* 68: blocks 0..3 end at or before 68 */
    const int32_t *t = table_of(bm, a, &n);
    CHECK(n == 7 && t[0] == BT_BM_NO_BLOCK && t[3] == BT_BM_NO_BLOCK && t[4] == 4);
    CHECK(bt_bm_count_runs(t, n) == 1);
    CHECK(bt_bm_seq_release_window(bm, a, 100) == 0); /* idempotent */
    bt_bm_stats st;
    bt_bm_get_stats(bm, &st);
    CHECK(st.blocks_used == 3 && st.blocks_cached == 4); /* the released full blocks stay cached */
    INVARIANTS(bm);
    CHECK(bt_bm_seq_truncate(bm, a, 60) == BT_ERR_INVALID);
    REQUIRE(bt_bm_seq_truncate(bm, a, 70) == BT_OK);
    REQUIRE(bt_bm_seq_fork(bm, a, &b) == BT_OK);
    t = table_of(bm, b, &n);
    CHECK(n == 5 && t[0] == BT_BM_NO_BLOCK && t[4] == 4 && bm->refcount[4] == 2);
    REQUIRE(bt_bm_seq_append(bm, b, 60, tok + 70, &cow) == BT_OK);
    CHECK(cow.src == 4);
    REQUIRE(bt_bm_seq_set_computed(bm, b, 130) == BT_OK);
    CHECK(bt_bm_seq_release_window(bm, b, 130) == 2);
    INVARIANTS(bm);
    /* no window configured: nothing is ever released */
    bt_bm *plain = mk(8, 0, 0);
    REQUIRE(plain != NULL);
    REQUIRE(bt_bm_seq_create(plain, &a) == BT_OK);
    REQUIRE(bt_bm_seq_append(plain, a, 100, tok, &cow) == BT_OK);
    CHECK(bt_bm_seq_release_window(plain, a, 100) == 0);
    bt_bm_seq_free(plain, a);
    check_all_back(plain);
    bt_bm_destroy(plain);
    bt_bm_seq_free(bm, 0);
    bt_bm_seq_free(bm, 1);
    check_all_back(bm);
    bt_bm_destroy(bm);
}

/* ---- randomized stress against a reference model ---- */

enum { MAX_SEQS = 24, MAX_LEN = 400 };

typedef struct ref_seq {
    int live;
    int32_t id;
    int32_t len, computed;
    int32_t prompt_len;   /* tok[0, prompt_len) is the prompt; later tokens are "sampled" */
    int32_t tok[MAX_LEN];
    int32_t table[MAX_LEN / 16 + 2];
    int32_t n_table;
} ref_seq;

typedef struct stress {
    bt_bm *bm;
    int32_t n_blocks, window;
    int32_t *ref;       /* [n_blocks] reference refcounts */
    int32_t (*kv)[16];  /* [n_blocks][16] the token whose KV each slot holds: a stand-in for the pool */
    ref_seq seqs[MAX_SEQS];
    int32_t prompts[4][MAX_LEN]; /* shared prefixes, so prompts hit the cache */
    uint64_t rng;
    int failed;
} stress;

static uint32_t rnd(stress *s, uint32_t n)
{
    return (uint32_t)(test_rand_next(&s->rng) % n);
}

static void snapshot(stress *s, ref_seq *r)
{
    int32_t n;
    const int32_t *t = bt_bm_seq_table(s->bm, r->id, &n);
    r->n_table = n;
    if (n) memcpy(r->table, t, (size_t)n * sizeof *t);
}

/* Reconciles the reference refcounts with r's table change from old[n_old]; a block newly taken must have been
 * unreferenced. */
static void account(stress *s, ref_seq *r, const int32_t *old, int32_t n_old, const bt_bm_copy *cow)
{
    snapshot(s, r);
    for (int32_t i = 0; i < n_old; i++)
        if (old[i] >= 0 && (i >= r->n_table || r->table[i] != old[i])) s->ref[old[i]]--;
    for (int32_t i = 0; i < r->n_table; i++) {
        int32_t b = r->table[i];
        if (b < 0 || (i < n_old && old[i] == b)) continue;
        if (s->ref[b] != 0 && !(cow == NULL)) {
            CHECK_MSG(0, "block %d handed out while referenced %d times", b, s->ref[b]);
            s->failed = 1;
        }
        s->ref[b]++;
    }
    if (cow && cow->src >= 0) memcpy(s->kv[cow->dst], s->kv[cow->src], sizeof s->kv[0]);
}

static void write_slots(stress *s, ref_seq *r, int32_t from, int32_t to)
{
    for (int32_t p = from; p < to; p++) s->kv[r->table[p / 16]][p % 16] = r->tok[p];
}

static void verify(stress *s, int32_t op)
{
    if (bt_bm_check(s->bm) != BT_OK) {
        CHECK_MSG(0, "op %d: %s", op, bt_last_error());
        s->failed = 1;
        return;
    }
    for (int32_t b = 0; b < s->n_blocks; b++)
        if (s->ref[b] != s->bm->refcount[b]) {
            CHECK_MSG(0, "op %d: block %d refcount %d, reference %d", op, b, s->bm->refcount[b], s->ref[b]);
            s->failed = 1;
            return;
        }
    for (int i = 0; i < MAX_SEQS; i++) {
        ref_seq *r = &s->seqs[i];
        if (!r->live) continue;
        int32_t n;
        const int32_t *t = bt_bm_seq_table(s->bm, r->id, &n);
        if (bt_bm_seq_len(s->bm, r->id) != r->len || bt_bm_seq_computed(s->bm, r->id) != r->computed ||
            n != r->n_table || (n && memcmp(t, r->table, (size_t)n * sizeof *t))) {
            CHECK_MSG(0, "op %d: seq %d disagrees with the reference", op, r->id);
            s->failed = 1;
            return;
        }
        /* every slot a sequence reads holds that sequence's own token: no sharing bug wrote over it */
        for (int32_t p = 0; p < r->len; p++) {
            int32_t b = t[p / 16];
            if (b >= 0 && s->kv[b][p % 16] != r->tok[p]) {
                CHECK_MSG(0, "op %d: seq %d position %d reads token %d, wrote %d", op, r->id, p, s->kv[b][p % 16],
                          r->tok[p]);
                s->failed = 1;
                return;
            }
        }
    }
}

static ref_seq *pick_live(stress *s)
{
    int start = (int)rnd(s, MAX_SEQS);
    for (int k = 0; k < MAX_SEQS; k++) {
        ref_seq *r = &s->seqs[(start + k) % MAX_SEQS];
        if (r->live) return r;
    }
    return NULL;
}

static ref_seq *pick_slot(stress *s)
{
    for (int k = 0; k < MAX_SEQS; k++)
        if (!s->seqs[k].live) return &s->seqs[k];
    return NULL;
}

static void drop(stress *s, ref_seq *r)
{
    for (int32_t i = 0; i < r->n_table; i++)
        if (r->table[i] >= 0) s->ref[r->table[i]]--;
    bt_bm_seq_free(s->bm, r->id);
    r->live = 0;
}

static void stress_run(int32_t n_blocks, int32_t window, int disable_cache, int ops, uint64_t seed)
{
    stress *s = calloc(1, sizeof *s);
    REQUIRE(s != NULL);
    s->bm = mk(n_blocks, window, disable_cache);
    s->n_blocks = n_blocks;
    s->window = window;
    s->ref = calloc((size_t)n_blocks, sizeof *s->ref);
    s->kv = calloc((size_t)n_blocks, sizeof *s->kv);
    s->rng = seed;
    if (!s->bm || !s->ref || !s->kv) {
        CHECK(0);
        goto out;
    }
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < MAX_LEN; i++) s->prompts[p][i] = (int32_t)rnd(s, 5); /* few values: chance repeats */
    int exhausted = 0, hits = 0, cows = 0, slid = 0, truncs = 0;
    for (int op = 0; op < ops && !s->failed; op++) {
        uint32_t kind = rnd(s, 100);
        ref_seq *r = pick_live(s);
        bt_bm_copy cow = {-1, -1};
        int32_t old[MAX_LEN / 16 + 2], n_old = 0;
        if (r) {
            n_old = r->n_table;
            memcpy(old, r->table, sizeof old);
        }
        if (kind < 15 || !r) { /* admit a prompt sharing a prefix */
            ref_seq *nr = pick_slot(s);
            if (!nr) continue;
            int32_t len = 1 + (int32_t)rnd(s, 200), hit;
            const int32_t *pp = s->prompts[rnd(s, 4)];
            int32_t shared = (int32_t)rnd(s, (uint32_t)len + 1);
            for (int32_t i = 0; i < len; i++) nr->tok[i] = i < shared ? pp[i] : (int32_t)rnd(s, 5);
            REQUIRE(bt_bm_seq_create(s->bm, &nr->id) == BT_OK);
            nr->live = 1;
            nr->len = nr->computed = nr->n_table = 0;
            nr->prompt_len = len;
            REQUIRE(bt_bm_seq_match_prefix(s->bm, nr->id, nr->tok, len, &hit) == BT_OK);
            nr->len = nr->computed = hit;
            hits += hit > 0;
            account(s, nr, NULL, 0, NULL);
            /* the rest of the prompt is reserved by later appends; keep it in tok[] past len */
        } else if (kind < 55) { /* append (a prompt chunk, a decode token or drafts) */
            int32_t n = 1 + (int32_t)rnd(s, kind < 35 ? 4 : 64);
            if (r->len + n > MAX_LEN) n = MAX_LEN - r->len;
            if (n <= 0) {
                drop(s, r);
                verify(s, op);
                continue;
            }
            for (int32_t i = r->len; i < r->len + n; i++)
                if (i >= r->prompt_len) r->tok[i] = (int32_t)rnd(s, 5);
            bt_status st = bt_bm_seq_append(s->bm, r->id, n, r->tok + r->len, &cow);
            if (st == BT_ERR_EXHAUSTED) {
                exhausted++;
                CHECK(!bt_bm_can_allocate(s->bm, bt_bm_seq_blocks_needed(s->bm, r->id, n)));
                ref_seq *victim = pick_live(s); /* preempt someone, maybe r itself */
                drop(s, victim);
            } else {
                REQUIRE(st == BT_OK);
                cows += cow.src >= 0;
                account(s, r, old, n_old, &cow);
                write_slots(s, r, r->len, r->len + n);
                r->len += n;
            }
        } else if (kind < 75) { /* the forward pass ran: mark computed */
            int32_t c = r->computed + (int32_t)rnd(s, (uint32_t)(r->len - r->computed) + 1);
            REQUIRE(bt_bm_seq_set_computed(s->bm, r->id, c) == BT_OK);
            r->computed = c;
        } else if (kind < 82) { /* n > 1 samples */
            ref_seq *nr = pick_slot(s);
            if (!nr) continue;
            REQUIRE(bt_bm_seq_fork(s->bm, r->id, &nr->id) == BT_OK);
            nr->live = 1;
            nr->len = r->len;
            nr->computed = r->computed;
            nr->prompt_len = r->prompt_len;
            memcpy(nr->tok, r->tok, sizeof nr->tok);
            account(s, nr, NULL, 0, NULL);
        } else if (kind < 88) { /* speculative rejection */
            int32_t lo = 0, t;
            int32_t nb;
            const int32_t *tb = bt_bm_seq_table(s->bm, r->id, &nb);
            while (lo < nb && tb[lo] == BT_BM_NO_BLOCK) lo++;
            lo *= 16;
            t = lo + (int32_t)rnd(s, (uint32_t)(r->len - lo) + 1);
            if (t > r->len) t = r->len;
            if (bt_bm_seq_truncate(s->bm, r->id, t) != BT_OK) {
                CHECK_MSG(0, "truncate %d of %d: %s", t, r->len, bt_last_error());
                s->failed = 1;
                break;
            }
            truncs += t < r->len;
            r->len = t;
            if (r->computed > t) r->computed = t;
            account(s, r, old, n_old, NULL);
        } else if (kind < 92 && window) { /* slide the window to the computed edge */
            slid += bt_bm_seq_release_window(s->bm, r->id, r->computed);
            account(s, r, old, n_old, NULL);
        } else if (kind < 97) { /* finish or abort */
            drop(s, r);
        } else {
            if (rnd(s, 4) == 0) bt_bm_cache_reset(s->bm);
            int32_t n = 1 + (int32_t)rnd(s, (uint32_t)n_blocks);
            int ok = bt_bm_can_allocate(s->bm, n);
            bt_bm_stats st;
            bt_bm_get_stats(s->bm, &st);
            CHECK(ok == (n <= st.blocks_free + st.blocks_cached));
        }
        verify(s, op);
    }
    for (int i = 0; i < MAX_SEQS; i++)
        if (s->seqs[i].live) drop(s, &s->seqs[i]);
    verify(s, ops);
    check_all_back(s->bm);
    bt_bm_stats st;
    bt_bm_get_stats(s->bm, &st);
    fprintf(stderr, "  stress %d blocks window %d cache %s: %d ops, %d exhaustions, %d admissions with hits, "
            "%d copies, %d truncations, %d window releases, %llu evictions, %llu/%llu prefix tokens hit\n", n_blocks,
            window, disable_cache ? "off" : "on", ops, exhausted, hits, cows, truncs, slid, (unsigned long long)st.evictions, (unsigned long long)st.prefix_hit_tokens,
            (unsigned long long)st.prefix_query_tokens);
    CHECK(exhausted > 0 || n_blocks > 100);
    CHECK(disable_cache || hits > 0 || n_blocks < 4);
    CHECK(truncs > 0 && (slid > 0 || !window));
out:
    bt_bm_destroy(s->bm);
    free(s->ref);
    free(s->kv);
    free(s);
}

static void test_stress(void)
{
    stress_run(48, 0, 0, 20000, 1);
    stress_run(64, 0, 1, 10000, 2);
    stress_run(40, 20, 0, 10000, 3);
    stress_run(300, 0, 0, 10000, 4);
    stress_run(1, 0, 0, 2000, 5);
}

int main(void)
{
    RUN(test_create_errors);
    RUN(test_alloc_free_refcount);
    RUN(test_fork_copy_on_write);
    RUN(test_contiguous_runs);
    RUN(test_lru_eviction_order);
    RUN(test_prefix_hits_across_sequences);
    RUN(test_exhaustion_and_preemption);
    RUN(test_truncate);
    RUN(test_sliding_window);
    RUN(test_stress);
    return test_summary();
}
