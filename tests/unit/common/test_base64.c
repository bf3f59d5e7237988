#include "common/base64.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static void test_known_vectors(void)
{
    static const char *const plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
    static const char *const enc[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
    for (int i = 0; i < 7; i++) {
        char *s;
        REQUIRE(base64_encode(plain[i], strlen(plain[i]), &s) == BT_OK);
        CHECK(strcmp(s, enc[i]) == 0);
        CHECK(base64_encoded_len(strlen(plain[i])) == strlen(enc[i]));
        free(s);
        uint8_t *d;
        size_t n;
        REQUIRE(base64_decode(enc[i], strlen(enc[i]), &d, &n) == BT_OK);
        CHECK(n == strlen(plain[i]) && memcmp(d, plain[i], n) == 0 && d[n] == 0);
        free(d);
    }
}

static void test_random_round_trip(void)
{
    uint64_t seed = 42;
    uint8_t buf[300];
    for (int iter = 0; iter < 500; iter++) {
        size_t n = test_rand_next(&seed) % sizeof buf;
        for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)test_rand_next(&seed);
        char *s;
        REQUIRE(base64_encode(buf, n, &s) == BT_OK);
        uint8_t *d;
        size_t m;
        REQUIRE(base64_decode(s, strlen(s), &d, &m) == BT_OK);
        CHECK(m == n && memcmp(d, buf, n) == 0);
        free(s);
        free(d);
    }
}

static void test_rejects_bad_input(void)
{
    static const char *const bad[] = {"Zg=", "Z===", "Zm9v!A==", "=Zm9", "Zg==Zg==", "Zm=v", "Zm\n9v"};
    for (int i = 0; i < 7; i++) {
        uint8_t *d = NULL;
        size_t n = 77;
        CHECK_MSG(base64_decode(bad[i], strlen(bad[i]), &d, &n) == BT_ERR_FORMAT, "%s", bad[i]);
        CHECK(d == NULL && n == 77);
    }
}

int main(void)
{
    RUN(test_known_vectors);
    RUN(test_random_round_trip);
    RUN(test_rejects_bad_input);
    return test_summary();
}
