#include "common/strbuf.h"

#include <stdlib.h>
#include <string.h>

void bt_strbuf_put(bt_strbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = c;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void bt_strbuf_puts(bt_strbuf *b, const char *s)
{
    bt_strbuf_put(b, s, strlen(s));
}
