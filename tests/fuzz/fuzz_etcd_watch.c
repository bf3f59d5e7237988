/* libFuzzer target: the etcd watch stream splitter (etcd_lines_feed, common/etcd_json.c) and the watch line parser.
 * Input: byte 0 seeds the chunking, byte 1 the line limit (16..4111 bytes), the rest is the stream. The stream is
 * fed in chunks of pseudo-random sizes, each an exact-size copy so that ASan sees any read past a chunk; the lines
 * delivered must equal the stream split on '\n' directly (a reference), stopping with BT_ERR_EXHAUSTED at the first
 * line longer than the limit and with BT_ERR_CANCELLED after a line starting with '!' (the reader drops the stream).
 * Every delivered line is parsed as a watch message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/etcd_json.h"

typedef struct seen {
    const uint8_t *ref; /* the stream */
    size_t ref_len;
    size_t pos;         /* where the next expected line starts in ref */
    size_t n_lines;
} seen_t;

static int on_line(void *ud, const char *line, size_t len)
{
    seen_t *s = ud;
    const uint8_t *start = s->ref + s->pos;
    const uint8_t *nl = memchr(start, '\n', s->ref_len - s->pos);
    if (!nl || (size_t)(nl - start) != len || memcmp(start, line, len)) abort(); /* not the next reference line */
    s->pos += len + 1;
    s->n_lines++;
    etcd_watch_msg_t m;
    if (etcd_json_parse_watch(line, len, &m) == BT_OK) etcd_watch_msg_free(&m);
    return len && line[0] == '!';
}

/* What the reference split expects: the number of lines delivered and the final status. */
static bt_status expect(const uint8_t *p, size_t n, size_t limit, size_t *lines)
{
    *lines = 0;
    for (size_t start = 0;;) {
        const uint8_t *nl = memchr(p + start, '\n', n - start);
        size_t len = nl ? (size_t)(nl - (p + start)) : n - start;
        if (len > limit) return BT_ERR_EXHAUSTED;
        if (!nl) return BT_OK;
        ++*lines;
        if (len && p[start] == '!') return BT_ERR_CANCELLED;
        start += len + 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    uint32_t rng = data[0] * 2654435761u + 1;
    size_t limit = 16 + (size_t)data[1] * 16;
    const uint8_t *stream = data + 2;
    size_t n = size - 2;
    etcd_lines_t sp = {.limit = limit};
    seen_t s = {.ref = stream, .ref_len = n};
    bt_status st = BT_OK;
    for (size_t off = 0; off < n && st == BT_OK;) {
        rng = rng * 1103515245u + 12345u;
        size_t chunk = 1 + (rng >> 16) % 64;
        if (chunk > n - off) chunk = n - off;
        char *c = malloc(chunk);
        if (!c) break;
        memcpy(c, stream + off, chunk);
        st = etcd_lines_feed(&sp, c, chunk, on_line, &s);
        free(c);
        off += chunk;
    }
    size_t want_lines;
    bt_status want = expect(stream, n, limit, &want_lines);
    if (st != want || s.n_lines != want_lines) abort();
    etcd_lines_free(&sp);
    return 0;
}
