/* tests kvtransfer/kvx_layout.c and the descriptor format of kvx_pool.c (one process, no peer). */
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "kvtransfer/kvx.h"
#include "test_util.h"

static const kvx_layout_t L = {.n_layers = 3, .n_blocks = 16, .block_stride = 256, .fingerprint = 0xabc};

static void test_layout(void)
{
    uint64_t bytes = 0;
    CHECK(kvx_layout_check(&L, &bytes) == BT_OK && bytes == 3 * 16 * 256);
    kvx_layout_t bad = L;
    bad.n_blocks = 0;
    CHECK(kvx_layout_check(&bad, NULL) == BT_ERR_INVALID);
    bad = L;
    bad.block_stride = UINT64_MAX / 2;
    CHECK(kvx_layout_check(&bad, NULL) == BT_ERR_INVALID);
    CHECK(kvx_layout_offset(&L, 2, 5) == (2 * 16 + 5) * 256);
    kvx_layout_t r = L;
    r.n_blocks = 40; /* pools may differ in size */
    CHECK(kvx_layout_compatible(&L, &r) == BT_OK);
    r.fingerprint++;
    CHECK(kvx_layout_compatible(&L, &r) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "fingerprint") != NULL);
    r = L;
    r.n_layers = 4;
    CHECK(kvx_layout_compatible(&L, &r) == BT_ERR_INVALID);
    r = L;
    r.block_stride = 512;
    CHECK(kvx_layout_compatible(&L, &r) == BT_ERR_INVALID);
}

static size_t count_runs(const uint32_t *s, const uint32_t *d, size_t n)
{
    size_t runs = n ? 1 : 0;
    for (size_t i = 1; i < n; i++)
        if (s[i] != s[i - 1] + 1 || d[i] != d[i - 1] + 1) runs++;
    return runs;
}

static void test_plan(void)
{
    kvx_layout_t r = L;
    r.n_blocks = 32;
    uint32_t src[] = {0, 1, 2, 5, 6, 9};
    uint32_t dst[] = {10, 11, 12, 20, 22, 23};
    kvx_plan_t p;
    REQUIRE(kvx_plan_build(&L, &r, src, dst, 6, &p) == BT_OK);
    CHECK(p.n_runs == 4); /* {0-2 -> 10-12}, {5 -> 20}, {6 -> 22}, {9 -> 23} */
    CHECK(p.runs[0].n_blocks == 3 && p.runs[1].n_blocks == 1 && p.runs[3].src_block == 9);
    kvx_range_t rg = kvx_plan_range(&p, 1, 0);
    CHECK(rg.local_off == (16 + 0) * 256 && rg.remote_off == (32 + 10) * 256 && rg.len == 3 * 256);
    kvx_plan_free(&p);
    kvx_plan_free(&p);

    uint32_t oob[] = {0, 16};
    CHECK(kvx_plan_build(&L, &r, oob, dst, 2, &p) == BT_ERR_INVALID);
    uint32_t oob_dst[] = {1, 32};
    CHECK(kvx_plan_build(&L, &r, src, oob_dst, 2, &p) == BT_ERR_INVALID);
    uint32_t dup[] = {3, 3};
    CHECK(kvx_plan_build(&L, &r, src, dup, 2, &p) == BT_ERR_INVALID);
    CHECK(kvx_plan_build(&L, &r, src, dst, 0, &p) == BT_ERR_INVALID);
    kvx_layout_t other = r;
    other.fingerprint = 1;
    CHECK(kvx_plan_build(&L, &other, src, dst, 2, &p) == BT_ERR_INVALID);

    /* Random block sets: runs equal the independent count, ranges cover exactly the named blocks. */
    uint64_t seed = 7;
    kvx_layout_t big = {.n_layers = 2, .n_blocks = 200, .block_stride = 64, .fingerprint = 1};
    for (int iter = 0; iter < 200; iter++) {
        uint32_t s[100], d[100];
        size_t n = 1 + test_rand_next(&seed) % 100;
        uint8_t used[200] = {0};
        for (size_t i = 0; i < n; i++) {
            s[i] = (uint32_t)(test_rand_next(&seed) % 200);
            if (i && test_rand_next(&seed) % 3) { /* often continue a run */
                d[i] = d[i - 1] + 1;
                s[i] = s[i - 1] + 1 < 200 ? s[i - 1] + 1 : s[i];
            } else {
                d[i] = (uint32_t)(test_rand_next(&seed) % 200);
            }
            while (d[i] >= 200 || used[d[i]]) d[i] = (uint32_t)(test_rand_next(&seed) % 200);
            used[d[i]] = 1;
        }
        REQUIRE(kvx_plan_build(&big, &big, s, d, n, &p) == BT_OK);
        CHECK(p.n_runs == count_runs(s, d, n));
        size_t k = 0;
        for (size_t run = 0; run < p.n_runs; run++) {
            kvx_range_t x = kvx_plan_range(&p, 1, run);
            for (uint32_t b = 0; b < p.runs[run].n_blocks; b++, k++) {
                CHECK(x.local_off + b * 64 == kvx_layout_offset(&big, 1, s[k]));
                CHECK(x.remote_off + b * 64 == kvx_layout_offset(&big, 1, d[k]));
            }
        }
        CHECK(k == n);
        kvx_plan_free(&p);
    }
}

static void test_descriptor(void)
{
    kvx_context_t *ctx = NULL;
    kvx_pool_t *pool = NULL;
    REQUIRE(kvx_context_create(NULL, &ctx) == BT_OK);
    if (kvx_pool_create(ctx, &L, &pool) != BT_OK) {
        CHECK_MSG(0, "%s", bt_last_error());
        kvx_context_destroy(ctx);
        return;
    }
    size_t len;
    const uint8_t *desc = kvx_pool_descriptor(pool, &len);
    kvx_desc_t d;
    REQUIRE(kvx_desc_parse(desc, len, &d) == BT_OK);
    CHECK(d.layout.n_layers == 3 && d.layout.n_blocks == 16 && d.layout.block_stride == 256);
    CHECK(d.layout.fingerprint == 0xabc && d.len == 3 * 16 * 256);
    CHECK(d.base == (uint64_t)(uintptr_t)kvx_pool_base(pool));
    CHECK(d.worker_addr_len > 0 && d.rkey_len > 0);
    /* Pool memory is zeroed and writable. */
    uint8_t *base = kvx_pool_base(pool);
    CHECK(base[0] == 0 && base[3 * 16 * 256 - 1] == 0);
    base[100] = 7;

    uint8_t *copy = malloc(len + 16);
    REQUIRE(copy != NULL);
    /* Every truncation is refused. */
    int truncated_ok = 0;
    for (size_t n = 0; n < len; n++)
        if (kvx_desc_parse(desc, n, &d) == BT_OK) truncated_ok++;
    CHECK(truncated_ok == 0);
    /* Trailing bytes are refused. */
    memcpy(copy, desc, len);
    CHECK(kvx_desc_parse(copy, len + 1, &d) == BT_ERR_FORMAT);
    /* Every single-bit flip is refused. */
    int flipped_ok = 0;
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit += 3) {
            memcpy(copy, desc, len);
            copy[i] ^= (uint8_t)(1u << bit);
            if (kvx_desc_parse(copy, len, &d) == BT_OK) flipped_ok++;
        }
    }
    CHECK(flipped_ok == 0);
    /* A garbled length with a fixed-up checksum is still refused by the length checks. */
    memcpy(copy, desc, len);
    copy[20] ^= 1;
    uint32_t crc = bt_crc32c(0, copy, len - 4);
    memcpy(copy + len - 4, &crc, 4);
    CHECK(kvx_desc_parse(copy, len, &d) == BT_ERR_FORMAT);
    CHECK(kvx_desc_parse(NULL, 0, &d) == BT_ERR_FORMAT);
    /* A garbage descriptor never becomes a peer. */
    kvx_peer_t *peer = NULL;
    memcpy(copy, desc, len);
    copy[len / 2] ^= 0x40;
    CHECK(kvx_peer_get(ctx, 1, copy, len, &peer) == BT_ERR_FORMAT && peer == NULL);
    free(copy);

    kvx_layout_t bad = L;
    bad.n_layers = 0;
    kvx_pool_t *p2 = NULL;
    CHECK(kvx_pool_create(ctx, &bad, &p2) == BT_ERR_INVALID && p2 == NULL);
    CHECK(kvx_pool_destroy(pool) == BT_OK);
    kvx_context_destroy(ctx);
}

int main(void)
{
    RUN(test_layout);
    RUN(test_plan);
    RUN(test_descriptor);
    return test_summary();
}
