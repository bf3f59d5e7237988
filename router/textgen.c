/* Incremental detokenization with stop strings (DESIGN 2 step 7). The tokenizer's stream releases complete UTF-8
 * characters; this adds a hold-back buffer: text that ends with the beginning of some stop string stays held until
 * the next tokens either complete the stop string (it is cut, with everything after it) or rule it out. */
#include "router/router.h"

#include <stdlib.h>
#include <string.h>

static int reserve(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *p = realloc(*buf, c);
    if (!p) return -1;
    *buf = p;
    *cap = c;
    return 0;
}

void rtr_textgen_init(rtr_textgen_t *tg, const tok_tokenizer *tok, const char *const *stops, int n_stop)
{
    memset(tg, 0, sizeof *tg);
    tok_stream_init(&tg->ts, tok, TOK_SKIP_SPECIAL);
    for (int i = 0; i < n_stop && i < RTR_MAX_STOP; i++) {
        if (!stops[i] || !*stops[i]) continue;
        tg->stops[tg->n_stop] = stops[i];
        tg->stop_len[tg->n_stop] = strlen(stops[i]);
        tg->n_stop++;
    }
    tg->stop_index = -1;
}

void rtr_textgen_free(rtr_textgen_t *tg)
{
    tok_stream_free(&tg->ts);
    free(tg->held);
    free(tg->out);
    memset(tg, 0, sizeof *tg);
}

/* Moves held[0..n) to out (NUL-terminated) and keeps the rest held. */
static int release(rtr_textgen_t *tg, size_t n, const char **text, size_t *len)
{
    if (reserve(&tg->out, &tg->out_cap, n + 1)) return -1;
    if (n) memcpy(tg->out, tg->held, n); /* held is NULL before the first piece: memcpy(x, NULL, 0) is undefined */
    tg->out[n] = '\0';
    if (tg->n_held > n) memmove(tg->held, tg->held + n, tg->n_held - n);
    tg->n_held -= n;
    *text = tg->out;
    *len = n;
    return 0;
}

/* The earliest complete stop string in held whose match includes bytes from old on (the ones just added): releases
 * the text before it, drops the rest and stops: 1. 0 when there is none, BT_ERR_NOMEM. */
static int cut_at_stop(rtr_textgen_t *tg, size_t old, const char **text, size_t *len)
{
    size_t best = SIZE_MAX;
    int which = -1;
    for (int i = 0; i < tg->n_stop; i++) {
        size_t L = tg->stop_len[i];
        if (L > tg->n_held) continue;
        size_t from = old + 1 > L ? old + 1 - L : 0;
        for (size_t p = from; p + L <= tg->n_held && p < best; p++) {
            if (!memcmp(tg->held + p, tg->stops[i], L)) {
                best = p;
                which = i;
                break;
            }
        }
    }
    if (which < 0) return 0;
    tg->stopped = 1;
    tg->stop_index = which;
    if (release(tg, best, text, len)) return BT_ERR_NOMEM;
    tg->n_held = 0;
    return 1;
}

int rtr_textgen_push(rtr_textgen_t *tg, int32_t id, const char **text, size_t *len)
{
    *text = "";
    *len = 0;
    if (tg->stopped) return 1;
    const char *piece;
    size_t n;
    bt_status st = tok_stream_push(&tg->ts, id, &piece, &n);
    if (st) return st;
    if (!n) return 0;
    size_t old = tg->n_held;
    if (reserve(&tg->held, &tg->held_cap, old + n)) return BT_ERR_NOMEM;
    memcpy(tg->held + old, piece, n);
    tg->n_held += n;
    if (!tg->n_stop) return release(tg, tg->n_held, text, len) ? BT_ERR_NOMEM : 0;

    int stop = cut_at_stop(tg, old, text, len);
    if (stop) return stop;
    /* Hold back the longest suffix that is a proper prefix of a stop string. */
    size_t keep = 0;
    for (int i = 0; i < tg->n_stop; i++) {
        size_t L = tg->stop_len[i];
        size_t max = L - 1 < tg->n_held ? L - 1 : tg->n_held;
        for (size_t k = max; k > keep; k--) {
            if (!memcmp(tg->held + tg->n_held - k, tg->stops[i], k)) {
                keep = k;
                break;
            }
        }
    }
    return release(tg, tg->n_held - keep, text, len) ? BT_ERR_NOMEM : 0;
}

void rtr_textgen_finish(rtr_textgen_t *tg, const char **text, size_t *len)
{
    *text = "";
    *len = 0;
    if (tg->stopped) return;
    const char *tail;
    size_t n;
    tok_stream_flush(&tg->ts, &tail, &n);
    size_t old = tg->n_held;
    if (n && reserve(&tg->held, &tg->held_cap, tg->n_held + n) == 0) {
        memcpy(tg->held + tg->n_held, tail, n);
        tg->n_held += n;
    }
    /* the tail (an incomplete character flushed as U+FFFD) can complete a stop string too (fuzz_textgen) */
    int stop = n ? cut_at_stop(tg, old, text, len) : 0;
    if (stop == 1) return;
    if (stop < 0 || release(tg, tg->n_held, text, len)) {
        *text = "";
        *len = 0;
    }
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when it is not one. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t L;
    unsigned min;
    if (c >= 0xC2 && c <= 0xDF) L = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) L = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) L = 4, min = 0x10000;
    else return 0;
    if (n < L) return 0;
    unsigned cp = c & (0x7F >> L);
    for (size_t i = 1; i < L; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return L;
}

char *rtr_utf8_sanitize(const char *s, size_t len)
{
    char *out = malloc(len * 3 + 1);
    if (!out) return NULL;
    size_t o = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        size_t L = utf8_seq(u + i, len - i);
        if (L && !(L == 1 && u[i] == 0)) {
            memcpy(out + o, u + i, L);
            o += L;
            i += L;
        } else if (L == 1) { /* NUL: drop, keeps C strings whole */
            i++;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    out[o] = '\0';
    return out;
}
