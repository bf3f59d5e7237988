/* router/textgen.c: incremental detokenization with stop strings held back across token boundaries, and
 * rtr_utf8_sanitize. Uses the default model's tokenizer (skipped when it is not cached). */
#include "router/router.h"
#include "test_util.h"

#include <stdlib.h>
#include <string.h>

static tok_tokenizer *tok;

/* Feeds text's tokens one by one; returns the released text (malloc'd), *stopped_at = token index of the stop
 * (-1 none), and checks nothing released is ever a prefix of a later stop match. */
static char *run(const char *text, const char *const *stops, int n_stop, int *stopped_at)
{
    tok_ids ids = {0};
    if (tok_encode(tok, text, strlen(text), 0, &ids)) return NULL;
    rtr_textgen_t tg;
    rtr_textgen_init(&tg, tok, stops, n_stop);
    size_t cap = strlen(text) + 64, n = 0;
    char *out = calloc(1, cap);
    *stopped_at = -1;
    for (size_t i = 0; i < ids.n; i++) {
        const char *t;
        size_t len;
        int rc = rtr_textgen_push(&tg, ids.ids[i], &t, &len);
        CHECK(rc >= 0);
        memcpy(out + n, t, len);
        n += len;
        if (rc == 1) {
            *stopped_at = (int)i;
            const char *t2;
            size_t l2;
            CHECK(rtr_textgen_push(&tg, ids.ids[i], &t2, &l2) == 1 && l2 == 0); /* nothing after a stop */
            break;
        }
    }
    if (*stopped_at < 0) {
        const char *t;
        size_t len;
        rtr_textgen_finish(&tg, &t, &len);
        memcpy(out + n, t, len);
        n += len;
    }
    out[n] = '\0';
    rtr_textgen_free(&tg);
    tok_ids_free(&ids);
    return out;
}

static void test_no_stops_round_trip(void)
{
    const char *texts[] = {"Hello world", "The capital of France is Paris. It is big.", "naïve café — 日本語 🎉 ok",
                           "   spaces\n\nand\ttabs  "};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) {
        int at;
        char *out = run(texts[i], NULL, 0, &at);
        REQUIRE(out);
        CHECK_MSG(!strcmp(out, texts[i]), "'%s' != '%s'", out, texts[i]);
        CHECK(at == -1);
        free(out);
    }
}

static void test_stop_across_tokens(void)
{
    const char *text = "The capital of France is Paris. It is big.";
    const char *stops[] = {"is Par", "zzz"};
    int at;
    char *out = run(text, stops, 2, &at);
    REQUIRE(out);
    CHECK_MSG(!strcmp(out, "The capital of France "), "got '%s'", out);
    CHECK(at >= 0);
    free(out);
    /* earliest match wins among several stops */
    const char *stops2[] = {"big", "France"};
    out = run(text, stops2, 2, &at);
    CHECK_MSG(!strcmp(out, "The capital of "), "got '%s'", out);
    free(out);
    /* a stop inside one token's text */
    const char *stops3[] = {"apit"};
    out = run(text, stops3, 1, &at);
    CHECK_MSG(!strcmp(out, "The c"), "got '%s'", out);
    free(out);
    /* multi-byte stop */
    const char *stops4[] = {"日本"};
    out = run("naïve café — 日本語 ok", stops4, 1, &at);
    CHECK_MSG(!strcmp(out, "naïve café — "), "got '%s'", out);
    free(out);
}

static void test_partial_match_released_at_end(void)
{
    /* "big" is held back (it could start "big!"), then released when the text ends without the stop */
    const char *text = "It is big";
    const char *stops[] = {"big!"};
    tok_ids ids = {0};
    REQUIRE(tok_encode(tok, text, strlen(text), 0, &ids) == BT_OK);
    rtr_textgen_t tg;
    rtr_textgen_init(&tg, tok, stops, 1);
    char out[64] = "";
    size_t n = 0;
    for (size_t i = 0; i < ids.n; i++) {
        const char *t;
        size_t len;
        CHECK(rtr_textgen_push(&tg, ids.ids[i], &t, &len) == 0);
        memcpy(out + n, t, len);
        n += len;
    }
    out[n] = '\0';
    CHECK_MSG(!strcmp(out, "It is "), "held back wrongly: '%s'", out);
    const char *t;
    size_t len;
    rtr_textgen_finish(&tg, &t, &len);
    CHECK(len == 3 && !memcmp(t, "big", 3));
    rtr_textgen_free(&tg);
    tok_ids_free(&ids);
}

/* A stop string that only the flushed tail completes: an incomplete character at the end is released as U+FFFD, so a
 * stop string "\xEF\xBF\xBD" must cut there too (fuzz_textgen found it released). */
static void test_stop_in_flushed_tail(void)
{
    const char *text = "ab \xE6\x9D"; /* ends inside a character */
    tok_ids ids = {0};
    REQUIRE(tok_encode(tok, text, strlen(text), 0, &ids) == BT_OK && ids.n >= 2);
    const char *stops[] = {"\xEF\xBF\xBD"};
    rtr_textgen_t tg;
    rtr_textgen_init(&tg, tok, stops, 1);
    char out[64] = "";
    size_t n = 0;
    const char *t;
    size_t len;
    for (size_t i = 0; i < ids.n; i++) {
        CHECK(rtr_textgen_push(&tg, ids.ids[i], &t, &len) == 0);
        memcpy(out + n, t, len);
        n += len;
    }
    rtr_textgen_finish(&tg, &t, &len);
    memcpy(out + n, t, len);
    n += len;
    out[n] = 0;
    CHECK_MSG(!strcmp(out, "ab "), "released '%s'", out);
    CHECK(tg.stopped && tg.stop_index == 0);
    rtr_textgen_free(&tg);
    /* without the stop string the tail comes out as U+FFFD */
    rtr_textgen_init(&tg, tok, NULL, 0);
    n = 0;
    for (size_t i = 0; i < ids.n; i++) {
        CHECK(rtr_textgen_push(&tg, ids.ids[i], &t, &len) == 0);
        memcpy(out + n, t, len);
        n += len;
    }
    rtr_textgen_finish(&tg, &t, &len);
    memcpy(out + n, t, len);
    out[n + len] = 0;
    CHECK_MSG(!strcmp(out, "ab \xEF\xBF\xBD"), "released '%s'", out);
    CHECK(!tg.stopped && tg.stop_index == -1);
    rtr_textgen_free(&tg);
    tok_ids_free(&ids);
}

static void test_utf8_sanitize(void)
{
    char *s = rtr_utf8_sanitize("ok \xC3\xA9 \xFF end \xE6\x97", 14);
    CHECK_MSG(!strcmp(s, "ok \xC3\xA9 \xEF\xBF\xBD end \xEF\xBF\xBD\xEF\xBF\xBD"), "got '%s'", s);
    free(s);
    s = rtr_utf8_sanitize("\xED\xA0\x80", 3); /* a surrogate */
    CHECK(!strcmp(s, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"));
    free(s);
}

int main(void)
{
    RUN(test_utf8_sanitize);
    const char *path = test_default_model();
    if (!path) {
        test_skip("tokenizer tests: default model not cached (run deploy/fetch-model.sh)");
        return test_summary();
    }
    if (tok_load(path, &tok) != BT_OK) {
        fprintf(stderr, "cannot load %s: %s\n", path, bt_last_error());
        return 1;
    }
    RUN(test_no_stops_round_trip);
    RUN(test_stop_across_tokens);
    RUN(test_partial_match_released_at_end);
    RUN(test_stop_in_flushed_tail);
    tok_free(tok);
    return test_summary();
}
