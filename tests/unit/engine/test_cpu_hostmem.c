/* engine/cpu/cpu_hostmem.c: huge-page allocations and the chunked arena (alignment, no overlap, chunks released
 * when empty, oversize allocations, contents kept). Leaks show under ASan. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_hostmem.h"
#include "test_util.h"

#define MIB ((size_t)1 << 20)

static void test_huge_alloc(void)
{
    CHECK(bt_hostmem_huge_alloc(0) == NULL);
    char *p = bt_hostmem_huge_alloc(3 * MIB + 5);
    REQUIRE(p != NULL);
    CHECK((uintptr_t)p % BT_HOSTMEM_HUGE_PAGE == 0);
    memset(p, 0x5a, 3 * MIB + 5); /* every byte is writable */
    CHECK(p[3 * MIB + 4] == 0x5a);
    free(p);
}

static void test_arena_bump_and_release(void)
{
    bt_hostmem_arena *a;
    REQUIRE(bt_hostmem_arena_create(3 * MIB, &a) == BT_OK); /* rounds to 4 MiB */
    CHECK(bt_hostmem_arena_reserved(a) == 0);
    CHECK(bt_hostmem_arena_alloc(a, 0) == NULL);
    enum { N = 40 };
    char *p[N];
    size_t sz[N];
    for (int i = 0; i < N; i++) {
        sz[i] = 150000 + 37 * (size_t)i; /* 40 x ~150 KB: two chunks of 4 MiB */
        p[i] = bt_hostmem_arena_alloc(a, sz[i]);
        REQUIRE(p[i] != NULL);
        CHECK((uintptr_t)p[i] % 64 == 0);
        memset(p[i], i + 1, sz[i]);
    }
    CHECK(bt_hostmem_arena_live(a) == N);
    CHECK(bt_hostmem_arena_reserved(a) == 8 * MIB);
    for (int i = 0; i < N; i++) /* no allocation overlaps another: each still holds its own byte */
        for (size_t k = 0; k < sz[i]; k += 997) CHECK_MSG(p[i][k] == (char)(i + 1), "allocation %d byte %zu", i, k);
    /* the first chunk (27 allocations fit in 4 MiB) is released once all of it is freed */
    size_t first_chunk = 0;
    for (int i = 0; i < N; i++)
        if (p[i] >= p[0] && p[i] < p[0] + 4 * MIB) first_chunk++;
    CHECK(first_chunk == 27);
    for (int i = 0; i < N; i++)
        if (p[i] >= p[0] && p[i] < p[0] + 4 * MIB) bt_hostmem_arena_free(a, p[i]);
    CHECK(bt_hostmem_arena_reserved(a) == 4 * MIB);
    CHECK(bt_hostmem_arena_live(a) == N - first_chunk);
    /* the open chunk starts over once empty and is kept */
    for (int i = 0; i < N; i++)
        if (!(p[i] >= p[0] && p[i] < p[0] + 4 * MIB)) bt_hostmem_arena_free(a, p[i]);
    CHECK(bt_hostmem_arena_live(a) == 0);
    CHECK(bt_hostmem_arena_reserved(a) == 4 * MIB);
    char *q = bt_hostmem_arena_alloc(a, 64);
    REQUIRE(q != NULL);
    CHECK((uintptr_t)q % BT_HOSTMEM_HUGE_PAGE == 0); /* first bytes of the reused chunk */
    bt_hostmem_arena_free(a, q);
    bt_hostmem_arena_free(a, NULL);
    bt_hostmem_arena_destroy(a);
}

static void test_arena_oversize(void)
{
    bt_hostmem_arena *a;
    REQUIRE(bt_hostmem_arena_create(2 * MIB, &a) == BT_OK);
    char *small = bt_hostmem_arena_alloc(a, 1000);
    char *big = bt_hostmem_arena_alloc(a, 5 * MIB + 1); /* a chunk of its own, 6 MiB */
    char *small2 = bt_hostmem_arena_alloc(a, 1000);
    REQUIRE(small && big && small2);
    CHECK(small2 == small + 1024); /* the open chunk stayed open */
    CHECK((uintptr_t)big % BT_HOSTMEM_HUGE_PAGE == 0);
    CHECK(bt_hostmem_arena_reserved(a) == 8 * MIB);
    memset(big, 7, 5 * MIB + 1);
    bt_hostmem_arena_free(a, big);
    CHECK(bt_hostmem_arena_reserved(a) == 2 * MIB);
    memset(small, 1, 1000); /* still ours (ASan flags a use after free) */
    memset(small2, 2, 1000);
    bt_hostmem_arena_destroy(a); /* frees live allocations too */
}

static void test_arena_open_chunk_replaced_when_full(void)
{
    bt_hostmem_arena *a;
    REQUIRE(bt_hostmem_arena_create(2 * MIB, &a) == BT_OK);
    char *x = bt_hostmem_arena_alloc(a, 1500000);
    REQUIRE(x != NULL);
    bt_hostmem_arena_free(a, x); /* open chunk empty again, kept */
    char *y = bt_hostmem_arena_alloc(a, 1500000);
    CHECK(y == x);
    char *z = bt_hostmem_arena_alloc(a, 1500000); /* does not fit: a new open chunk */
    REQUIRE(z != NULL);
    CHECK(bt_hostmem_arena_reserved(a) == 4 * MIB);
    bt_hostmem_arena_free(a, y); /* the old chunk is no longer open: released */
    CHECK(bt_hostmem_arena_reserved(a) == 2 * MIB);
    char *w = bt_hostmem_arena_alloc(a, 400000); /* still fits after z */
    CHECK(w == z + 1500032);
    bt_hostmem_arena_free(a, z);
    bt_hostmem_arena_free(a, w);
    CHECK(bt_hostmem_arena_live(a) == 0);
    bt_hostmem_arena_destroy(a);
    bt_hostmem_arena_destroy(NULL);
}

int main(void)
{
    RUN(test_huge_alloc);
    RUN(test_arena_bump_and_release);
    RUN(test_arena_oversize);
    RUN(test_arena_open_chunk_replaced_when_full);
    return test_summary();
}
