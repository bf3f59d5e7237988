/* tests common/crc32c.c: published vectors, chaining, and the SSE4.2 path against the table code. */
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "test_util.h"

static void test_known_vectors(void)
{
    unsigned char buf[32];
    CHECK(bt_crc32c(0, "", 0) == 0);
    CHECK(bt_crc32c(0, "123456789", 9) == 0xE3069283u);
    CHECK(bt_crc32c_sw(0, "123456789", 9) == 0xE3069283u);
    /* RFC 3720 B.4 iSCSI vectors. */
    memset(buf, 0, sizeof buf);
    CHECK(bt_crc32c(0, buf, 32) == 0x8A9136AAu);
    memset(buf, 0xff, sizeof buf);
    CHECK(bt_crc32c(0, buf, 32) == 0x62A8AB43u);
    for (int i = 0; i < 32; i++) buf[i] = (unsigned char)i;
    CHECK(bt_crc32c(0, buf, 32) == 0x46DD794Eu);
    CHECK(bt_crc32c_sw(0, buf, 32) == 0x46DD794Eu);
    for (int i = 0; i < 32; i++) buf[i] = (unsigned char)(31 - i);
    CHECK(bt_crc32c(0, buf, 32) == 0x113FDB5Cu);
    CHECK(bt_crc32c(0, "a", 1) == 0xC1D04330u);
}

static void test_chaining_and_paths(void)
{
    uint64_t seed = 42;
    size_t n = 70000;
    unsigned char *buf = malloc(n + 8);
    REQUIRE(buf != NULL);
    for (size_t i = 0; i < n + 8; i++) buf[i] = (unsigned char)test_rand_next(&seed);
    for (int iter = 0; iter < 200; iter++) {
        size_t off = test_rand_next(&seed) % 8;
        size_t len = test_rand_next(&seed) % (n - 8);
        size_t cut = len ? test_rand_next(&seed) % len : 0;
        uint32_t whole = bt_crc32c_sw(0, buf + off, len);
        CHECK(bt_crc32c(0, buf + off, len) == whole);
        CHECK(bt_crc32c(bt_crc32c(0, buf + off, cut), buf + off + cut, len - cut) == whole);
        CHECK(bt_crc32c_sw(bt_crc32c_sw(0, buf + off, cut), buf + off + cut, len - cut) == whole);
    }
    /* One flipped bit always changes the checksum. */
    uint32_t ref = bt_crc32c(0, buf, 4096);
    buf[100] ^= 4;
    CHECK(bt_crc32c(0, buf, 4096) != ref);
    fprintf(stderr, "crc32c hardware path: %s\n", bt_crc32c_hw_available() ? "sse4.2" : "none");
    free(buf);
}

int main(void)
{
    RUN(test_known_vectors);
    RUN(test_chaining_and_paths);
    return test_summary();
}
