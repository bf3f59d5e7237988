/* A growable NUL-terminated byte string. Appends never fail: on out-of-memory the buffer sets oom and ignores
 * later appends, so a builder checks once at the end. The caller owns p (free it). Zero-initialise to start. */
#ifndef BATON_COMMON_STRBUF_H
#define BATON_COMMON_STRBUF_H

#include <stddef.h>

typedef struct bt_strbuf {
    char *p;
    size_t n, cap;
    int oom;
} bt_strbuf;

/* Appends n bytes of s (which may hold NULs); p stays NUL-terminated. */
void bt_strbuf_put(bt_strbuf *b, const char *s, size_t n);

/* Appends the C string s. */
void bt_strbuf_puts(bt_strbuf *b, const char *s);

#endif
