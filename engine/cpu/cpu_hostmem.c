/* Huge-page host memory and the chunked arena over it (cpu_hostmem.h). */
#define _GNU_SOURCE
#include "engine/cpu/cpu_hostmem.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define ARENA_ALIGN 64

void *bt_hostmem_huge_alloc(size_t bytes)
{
    void *p = NULL;
    if (bytes == 0 || posix_memalign(&p, BT_HOSTMEM_HUGE_PAGE, bytes) != 0) return NULL;
    /* a hint only: EINVAL where THP is compiled out, and the memory works the same */
    (void)madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

typedef struct arena_chunk {
    char *base;
    size_t size, used;
    size_t live; /* allocations in this chunk not yet freed */
} arena_chunk;

struct bt_hostmem_arena {
    size_t chunk_bytes;
    arena_chunk *chunks; /* [n]; the open chunk (the one being filled) is chunks[open] when open >= 0 */
    size_t n, cap;
    long open;
    size_t live;
};

static size_t round_up(size_t x, size_t to)
{
    return (x + to - 1) / to * to;
}

bt_status bt_hostmem_arena_create(size_t chunk_bytes, bt_hostmem_arena **out)
{
    bt_hostmem_arena *a = calloc(1, sizeof *a);
    if (!a) return bt_fail(BT_ERR_NOMEM, "out of memory for a host memory arena");
    a->chunk_bytes = round_up(chunk_bytes ? chunk_bytes : 1, BT_HOSTMEM_HUGE_PAGE);
    a->open = -1;
    *out = a;
    return BT_OK;
}

/* Adds a chunk of size bytes; its index, or -1 when out of memory. */
static long chunk_add(bt_hostmem_arena *a, size_t size)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 8;
        arena_chunk *c = realloc(a->chunks, cap * sizeof *c);
        if (!c) return -1;
        a->chunks = c;
        a->cap = cap;
    }
    char *base = bt_hostmem_huge_alloc(size);
    if (!base) return -1;
    a->chunks[a->n] = (arena_chunk){.base = base, .size = size};
    return (long)a->n++;
}

void *bt_hostmem_arena_alloc(bt_hostmem_arena *a, size_t bytes)
{
    if (!a || bytes == 0 || bytes > SIZE_MAX - BT_HOSTMEM_HUGE_PAGE) return NULL;
    bytes = round_up(bytes, ARENA_ALIGN);
    long i;
    if (bytes > a->chunk_bytes) { /* its own chunk; the open one stays open */
        if ((i = chunk_add(a, round_up(bytes, BT_HOSTMEM_HUGE_PAGE))) < 0) return NULL;
        a->chunks[i].used = bytes;
    } else {
        if (a->open < 0 || a->chunks[a->open].size - a->chunks[a->open].used < bytes) {
            if ((i = chunk_add(a, a->chunk_bytes)) < 0) return NULL;
            /* the chunk it replaces is released once empty */
            if (a->open >= 0 && a->chunks[a->open].live == 0) {
                free(a->chunks[a->open].base);
                a->chunks[a->open] = a->chunks[--a->n];
                if (i == (long)a->n) i = a->open;
            }
            a->open = i;
        }
        i = a->open;
        a->chunks[i].used += bytes;
    }
    a->chunks[i].live++;
    a->live++;
    return a->chunks[i].base + a->chunks[i].used - bytes;
}

void bt_hostmem_arena_free(bt_hostmem_arena *a, void *p)
{
    if (!a || !p) return;
    for (size_t i = 0; i < a->n; i++) {
        arena_chunk *c = &a->chunks[i];
        if ((char *)p < c->base || (char *)p >= c->base + c->size) continue;
        a->live--;
        if (--c->live > 0) return;
        if ((long)i == a->open) {
            c->used = 0;
            return;
        }
        free(c->base);
        *c = a->chunks[--a->n];
        if (a->open == (long)a->n) a->open = (long)i;
        return;
    }
}

size_t bt_hostmem_arena_reserved(const bt_hostmem_arena *a)
{
    size_t s = 0;
    for (size_t i = 0; a && i < a->n; i++) s += a->chunks[i].size;
    return s;
}

size_t bt_hostmem_arena_live(const bt_hostmem_arena *a)
{
    return a ? a->live : 0;
}

void bt_hostmem_arena_destroy(bt_hostmem_arena *a)
{
    if (!a) return;
    for (size_t i = 0; i < a->n; i++) free(a->chunks[i].base);
    free(a->chunks);
    free(a);
}
