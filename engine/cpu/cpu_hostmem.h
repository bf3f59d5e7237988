/* Host memory for big, long-lived buffers that every decode step reads through: packed weights (~100 MB streamed per
 * step) and KV pools (blocks read all over the pool). Backed by transparent huge pages where the kernel offers them
 * (THP "always" or "madvise"): with 4 KiB pages every 4 KiB read costs a TLB miss and stops the hardware
 * prefetcher at the page edge. Where THP is off the memory is ordinary and nothing else changes. */
#ifndef BATON_CPU_HOSTMEM_H
#define BATON_CPU_HOSTMEM_H

#include <stddef.h>

#include "common/status.h"

#define BT_HOSTMEM_HUGE_PAGE ((size_t)2 << 20)

/* bytes (> 0) aligned to BT_HOSTMEM_HUGE_PAGE and hinted for huge pages; NULL when out of memory. Free with free().
 * Pages are not touched here. */
void *bt_hostmem_huge_alloc(size_t bytes);

/* A bump allocator over huge-page chunks, for many buffers of a few hundred KiB each (a layer's weight matrices)
 * that would each be too small to fill a huge page of its own. Not thread-safe: the caller serializes. */
typedef struct bt_hostmem_arena bt_hostmem_arena;

/* chunk_bytes is rounded up to BT_HOSTMEM_HUGE_PAGE; an allocation larger than a chunk gets a chunk of its own.
 * BT_ERR_NOMEM on failure (*out untouched). */
bt_status bt_hostmem_arena_create(size_t chunk_bytes, bt_hostmem_arena **out);

/* bytes (> 0), 64-byte aligned, contents undefined; NULL when out of memory or bytes is 0. */
void *bt_hostmem_arena_alloc(bt_hostmem_arena *a, size_t bytes);

/* Frees p (from this arena; NULL is a no-op). A chunk goes back to the system when its last allocation is freed,
 * except the chunk being filled, which starts over empty. */
void bt_hostmem_arena_free(bt_hostmem_arena *a, void *p);

/* Bytes of chunks currently held (address space; the kernel backs only the touched pages). */
size_t bt_hostmem_arena_reserved(const bt_hostmem_arena *a);

/* Number of allocations not yet freed. */
size_t bt_hostmem_arena_live(const bt_hostmem_arena *a);

/* Frees every chunk, live allocations included. NULL is a no-op. */
void bt_hostmem_arena_destroy(bt_hostmem_arena *a);

#endif
