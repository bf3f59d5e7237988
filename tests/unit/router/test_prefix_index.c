/* router/prefix_index.c: leading-match counts, the per-node LRU bound and its eviction order, incarnations, forget,
 * and a randomized comparison with a plain reference LRU. */
#include "router/router.h"
#include "test_util.h"

#include <stdio.h>

#include <stdlib.h>
#include <string.h>

static void test_match_prefix(void)
{
    rtr_pindex_t *x;
    REQUIRE(rtr_pindex_create(&x) == BT_OK);
    const uint64_t a[] = {11, 12, 13}, other[] = {11, 99, 13}, b[] = {21, 22};
    CHECK(rtr_pindex_match(x, "d1", 7, a, 3) == 0);
    rtr_pindex_insert(x, "d1", 7, 100, a, 3);
    CHECK(rtr_pindex_match(x, "d1", 7, a, 3) == 3);
    CHECK(rtr_pindex_match(x, "d1", 7, a, 2) == 2);
    CHECK(rtr_pindex_match(x, "d1", 7, other, 3) == 1); /* leading blocks only: a chain breaks at the first miss */
    CHECK(rtr_pindex_match(x, "d1", 7, b, 2) == 0);
    CHECK(rtr_pindex_match(x, "d2", 7, a, 3) == 0);     /* per node */
    CHECK(rtr_pindex_match(x, "d1", 8, a, 3) == 0);     /* another incarnation knows nothing */
    CHECK(rtr_pindex_match(x, "d1", 7, NULL, 0) == 0);
    rtr_pindex_insert(x, "d1", 7, 100, a, 3);           /* again: no duplicates */
    CHECK(rtr_pindex_size(x, "d1") == 3);
    rtr_pindex_destroy(x);
}

static void test_lru_bound_and_order(void)
{
    rtr_pindex_t *x;
    REQUIRE(rtr_pindex_create(&x) == BT_OK);
    const uint64_t a[] = {1, 2, 3}, b[] = {4, 5, 6};
    rtr_pindex_insert(x, "n", 1, 4, a, 3);
    rtr_pindex_insert(x, "n", 1, 4, b, 3);
    CHECK(rtr_pindex_size(x, "n") == 4);
    /* a's tail went first (3, then 2): its first block stays, as chains are trimmed from the end */
    CHECK(rtr_pindex_match(x, "n", 1, a, 3) == 1);
    CHECK(rtr_pindex_match(x, "n", 1, b, 3) == 3);
    /* touching a again makes it the most recent: b's tail goes */
    rtr_pindex_insert(x, "n", 1, 4, a, 1);
    const uint64_t c[] = {7};
    rtr_pindex_insert(x, "n", 1, 4, c, 1);
    CHECK(rtr_pindex_size(x, "n") == 4);
    CHECK(rtr_pindex_match(x, "n", 1, a, 1) == 1 && rtr_pindex_match(x, "n", 1, c, 1) == 1);
    CHECK(rtr_pindex_match(x, "n", 1, b, 3) == 2);
    /* a chain longer than the capacity keeps its head */
    const uint64_t longc[] = {100, 101, 102, 103, 104, 105};
    rtr_pindex_insert(x, "n", 1, 4, longc, 6);
    CHECK(rtr_pindex_size(x, "n") == 4 && rtr_pindex_match(x, "n", 1, longc, 6) == 4);
    /* asking is not using: matching b did not save it */
    CHECK(rtr_pindex_match(x, "n", 1, b, 3) == 0);
    rtr_pindex_destroy(x);
}

static void test_forget_and_reset(void)
{
    rtr_pindex_t *x;
    REQUIRE(rtr_pindex_create(&x) == BT_OK);
    const uint64_t a[] = {1, 2, 3};
    rtr_pindex_insert(x, "p", 5, 10, a, 3);
    rtr_pindex_insert(x, "d", 5, 10, a, 3);
    rtr_pindex_forget(x, "p");
    CHECK(rtr_pindex_size(x, "p") == 0 && rtr_pindex_match(x, "p", 5, a, 3) == 0);
    CHECK(rtr_pindex_match(x, "d", 5, a, 3) == 3); /* others untouched */
    rtr_pindex_forget(x, "nobody");
    /* restarted node (new start time): starts empty */
    rtr_pindex_insert(x, "d", 6, 10, a, 1);
    CHECK(rtr_pindex_size(x, "d") == 1 && rtr_pindex_match(x, "d", 6, a, 3) == 1);
    /* resized node: the old bound no longer holds, start again */
    rtr_pindex_insert(x, "d", 6, 2, a + 1, 1);
    CHECK(rtr_pindex_size(x, "d") == 1);
    /* capacity 0: the default applies */
    rtr_pindex_insert(x, "z", 1, 0, a, 3);
    CHECK(rtr_pindex_size(x, "z") == 3);
    rtr_pindex_destroy(x);
}

/* Reference: an array in recency order (index 0 = most recent). */
typedef struct ref_lru {
    uint64_t *h;
    size_t n, cap;
} ref_lru_t;

static void ref_touch(ref_lru_t *r, uint64_t h)
{
    size_t i = 0;
    while (i < r->n && r->h[i] != h) i++;
    if (i == r->n) {
        if (r->n < r->cap) r->n++;
        i = r->n - 1; /* a new entry overwrites the least recent when full */
    }
    memmove(r->h + 1, r->h, i * sizeof *r->h);
    r->h[0] = h;
}

static int ref_has(const ref_lru_t *r, uint64_t h)
{
    for (size_t i = 0; i < r->n; i++)
        if (r->h[i] == h) return 1;
    return 0;
}

static void test_random_against_reference(void)
{
    rtr_pindex_t *x;
    REQUIRE(rtr_pindex_create(&x) == BT_OK);
    enum { CAP = 300 };
    ref_lru_t ref = {.h = calloc(CAP, sizeof(uint64_t)), .cap = CAP};
    REQUIRE(ref.h);
    uint64_t seed = 42;
    uint64_t chain[40];
    for (int round = 0; round < 2000; round++) {
        size_t n = 1 + test_rand_next(&seed) % 40;
        for (size_t i = 0; i < n; i++) chain[i] = test_rand_next(&seed) % 2000; /* small universe: many repeats */
        rtr_pindex_insert(x, "n", 1, CAP, chain, n);
        for (size_t i = n; i-- > 0;) ref_touch(&ref, chain[i]);
        CHECK(rtr_pindex_size(x, "n") == ref.n);
        if (round % 50 == 0)
            for (uint64_t h = 0; h < 2000; h++)
                if (ref_has(&ref, h) != (rtr_pindex_match(x, "n", 1, &h, 1) == 1)) {
                    CHECK_MSG(0, "round %d: hash %llu disagrees", round, (unsigned long long)h);
                    round = 1 << 30;
                    break;
                }
    }
    free(ref.h);
    rtr_pindex_destroy(x);
}

/* The first-block hint: the last RTR_PINDEX_HOLDERS nodes sent a chain, by id hash and incarnation. */
static void test_holders_hint(void)
{
    rtr_pindex_t *x;
    REQUIRE(rtr_pindex_create(&x) == BT_OK);
    uint64_t a[3] = {0x1111, 0x2222, 0x3333}, b[1] = {0x4444};
    uint32_t idh[RTR_PINDEX_HOLDERS];
    int64_t st[RTR_PINDEX_HOLDERS];
    CHECK(rtr_pindex_holders(x, a[0], idh, st) == 0);
    rtr_pindex_insert(x, "p1", 7, 0, a, 3);
    rtr_pindex_insert(x, "p1", 7, 0, a, 2); /* again: one entry */
    REQUIRE(rtr_pindex_holders(x, a[0], idh, st) == 1);
    CHECK(idh[0] == rtr_pindex_id_hash("p1") && st[0] == 7);
    CHECK(rtr_pindex_holders(x, a[1], idh, st) == 0); /* only chains' first blocks are hinted */
    rtr_pindex_insert(x, "p2", 1, 0, b, 1);
    char id[16];
    for (int i = 0; i < 6; i++) {
        snprintf(id, sizeof id, "n%d", i);
        rtr_pindex_insert(x, id, 0, 0, a, 1);
    }
    size_t n = rtr_pindex_holders(x, a[0], idh, st);
    CHECK(n == RTR_PINDEX_HOLDERS);
    for (size_t i = 0; i < n; i++) { /* the most recent four: n2..n5 */
        int found = 0;
        for (int k = 2; k < 6; k++) {
            snprintf(id, sizeof id, "n%d", k);
            found |= idh[i] == rtr_pindex_id_hash(id);
        }
        CHECK(found);
    }
    REQUIRE(rtr_pindex_holders(x, b[0], idh, st) == 1);
    CHECK(idh[0] == rtr_pindex_id_hash("p2") && st[0] == 1);
    rtr_pindex_destroy(x);
}

int main(void)
{
    RUN(test_holders_hint);
    RUN(test_match_prefix);
    RUN(test_lru_bound_and_order);
    RUN(test_forget_and_reset);
    RUN(test_random_against_reference);
    return test_summary();
}
