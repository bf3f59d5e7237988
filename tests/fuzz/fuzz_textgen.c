/* libFuzzer target: router/textgen.c, stop strings over incremental detokenization, and rtr_utf8_sanitize.
 * Input: byte 0 = number of stop strings (mod 5); per stop string one length byte (mod 16, + 1) and its bytes;
 * the rest is token ids, two bytes each (little endian, mod the vocabulary). Checked: every release is valid
 * UTF-8, the text released never contains a stop string, and sanitizing is idempotent on arbitrary bytes. Stop
 * strings that are not valid UTF-8 are skipped: the APIs refuse them (a stop string starting inside a character
 * made textgen release half of one; found by this fuzzer). */
#define _GNU_SOURCE /* memmem */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "fuzz_router_model.h"

/* Valid UTF-8, NUL bytes allowed (a byte token can stand for one): each NUL-free run sanitizes to itself. */
static int valid_utf8(const char *s, size_t n)
{
    for (size_t at = 0; at <= n;) {
        size_t k = strnlen(s + at, n - at);
        char *t = rtr_utf8_sanitize(s + at, k);
        int ok = t && strlen(t) == k && !memcmp(t, s + at, k);
        free(t);
        if (!ok) return 0;
        at += k + 1;
    }
    return 1;
}

static void check_sanitize(const uint8_t *data, size_t size)
{
    char *a = rtr_utf8_sanitize((const char *)data, size);
    if (!a) return;
    char *b = rtr_utf8_sanitize(a, strlen(a));
    if (b && strcmp(a, b)) abort();
    free(b);
    free(a);
}

/* Appends a release to all[] after checking it. */
static void take(char **all, size_t *n_all, const char *t, size_t len)
{
    if (len && !valid_utf8(t, len)) {
        fprintf(stderr, "BAD release of %zu bytes:", len);
        for (size_t i = 0; i < len; i++) fprintf(stderr, " %02x", (unsigned char)t[i]);
        fprintf(stderr, "\n");
        abort();
    }
    char *p = realloc(*all, *n_all + len + 1);
    if (!p) abort();
    memcpy(p + *n_all, t, len);
    *n_all += len;
    p[*n_all] = 0;
    *all = p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check_sanitize(data, size);
    if (size < 1) return 0;
    size_t at = 1;
    char stops[RTR_MAX_STOP][17];
    const char *sp[RTR_MAX_STOP];
    int n_stop = data[0] % 5;
    for (int i = 0; i < n_stop; i++) {
        size_t len = at < size ? (size_t)(data[at++] % 16) + 1 : 1;
        if (at + len > size) len = size - at;
        memcpy(stops[i], data + at, len);
        stops[i][len] = 0; /* an embedded NUL shortens it, as a C string would */
        at += len;
        sp[i] = stops[i];
        if (!valid_utf8(stops[i], strlen(stops[i]))) return 0; /* both APIs refuse such stop strings */
    }
    rtr_textgen_t tg;
    rtr_textgen_init(&tg, fuzz_model.tok, sp, n_stop);
    char *all = NULL;
    size_t n_all = 0;
    const char *t;
    size_t len;
    int stopped = 0;
    for (; at + 1 < size && !stopped; at += 2) {
        int32_t id = (int32_t)((data[at] | data[at + 1] << 8) % (unsigned)tok_n_vocab(fuzz_model.tok));
        int rc = rtr_textgen_push(&tg, id, &t, &len);
        if (rc < 0) continue;
        take(&all, &n_all, t, len);
        stopped = rc == 1;
    }
    if (!stopped) {
        rtr_textgen_finish(&tg, &t, &len);
        take(&all, &n_all, t, len);
    }
    for (int i = 0; i < tg.n_stop && all; i++)
        if (memmem(all, n_all, tg.stops[i], tg.stop_len[i])) abort();
    free(all);
    rtr_textgen_free(&tg);
    return 0;
}
