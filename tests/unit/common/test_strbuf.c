#include "common/strbuf.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

/* Appends across several growths equal one memcpy'd reference; embedded NULs are kept; p stays terminated. */
static void test_appends_and_growth(void)
{
    bt_strbuf b = {0};
    char want[5000];
    size_t n = 0;
    uint64_t seed = 7;
    for (int i = 0; i < 200; i++) {
        char piece[25];
        size_t k = (size_t)(test_rand_next(&seed) % sizeof piece);
        for (size_t j = 0; j < k; j++) piece[j] = (char)(test_rand_next(&seed) % 256);
        bt_strbuf_put(&b, piece, k);
        memcpy(want + n, piece, k);
        n += k;
        REQUIRE(!b.oom);
        CHECK(b.n == n && b.cap > b.n && b.p[b.n] == 0);
    }
    CHECK(!memcmp(b.p, want, n));
    bt_strbuf_puts(&b, "tail");
    CHECK(b.n == n + 4 && !strcmp(b.p + n, "tail"));
    free(b.p);
}

/* An empty append to an empty buffer still gives a terminated string. */
static void test_empty(void)
{
    bt_strbuf b = {0};
    bt_strbuf_puts(&b, "");
    REQUIRE(b.p);
    CHECK(b.n == 0 && b.p[0] == 0 && !b.oom);
    free(b.p);
}

int main(void)
{
    RUN(test_appends_and_growth);
    RUN(test_empty);
    return test_summary();
}
