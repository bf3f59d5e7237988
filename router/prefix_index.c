/* The router's approximate per-node prefix index (DESIGN 7): per node, a set of block hashes with LRU order and a
 * capacity. Storage per node is one array of entries linked twice by index (LRU list, hash-bucket chains), so
 * growing it is a realloc and eviction reuses the evicted slot. It is approximate by design: the node's own cache
 * may have evicted a block the router still lists (or kept one it dropped); a wrong guess costs some latency, never
 * correctness, because the node computes whatever it lacks. */
#include "router/router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NIL (-1)

typedef struct pi_entry {
    uint64_t h;
    int32_t prev, next; /* LRU list: prev is more recent */
    int32_t chain;      /* next entry in the same bucket */
} pi_entry_t;

typedef struct pi_node {
    char id[MBR_NODE_ID_MAX];
    int64_t started_ms;    /* incarnation: a restarted node's cache is empty */
    int64_t cap;
    pi_entry_t *e;         /* [n_alloc] */
    int32_t n, n_alloc;
    int32_t *bucket;       /* [n_bucket] head entry per bucket, a power of two >= n_alloc */
    uint32_t n_bucket;
    int32_t head, tail;    /* most and least recently used */
} pi_node_t;

/* Which nodes were last sent a chain that starts with hash h: a hint that lets a decision among many nodes find the
 * likely prefix holders without looking every node up (rtr_pindex_holders). Fixed size, no eviction order beyond
 * overwriting: a stale or lost hint only costs cache affinity. */
#define PI_FIRST_SLOTS (1u << 16)
#define PI_FIRST_PROBE 8
typedef struct pi_first {
    uint64_t h;                          /* 0 = empty (a SipHash output of 0 is merely never hinted) */
    uint32_t idh[RTR_PINDEX_HOLDERS];    /* id_hash of the node's id */
    int64_t started[RTR_PINDEX_HOLDERS];
    uint8_t n, next;                     /* holders kept; the one overwritten next */
} pi_first_t;

struct rtr_pindex {
    pthread_mutex_t mu;
    pi_first_t *first;     /* [PI_FIRST_SLOTS], NULL without memory (no hints) */
    pi_node_t *nodes;      /* [n_nodes] */
    size_t n_nodes, cap_nodes;
    /* node id -> index in nodes, open addressing, rebuilt whenever nodes changes (a node joins or is forgotten):
     * a decision looks up every candidate, and a linear scan of a thousand ids per lookup dominated simulations
     * of large clusters. NULL (no memory) falls back to the scan. */
    int32_t *slot;         /* [n_slot], NIL = empty; n_slot a power of two > 2 * n_nodes */
    uint32_t n_slot;
};

static uint32_t id_hash(const char *id)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 16777619u;
    return h;
}

static void slots_rebuild(rtr_pindex_t *x)
{
    uint32_t n = 16;
    while (n <= 2 * x->n_nodes) n *= 2;
    if (n != x->n_slot) {
        int32_t *s = realloc(x->slot, n * sizeof *s);
        if (!s) {
            free(x->slot);
            x->slot = NULL;
            x->n_slot = 0;
            return;
        }
        x->slot = s;
        x->n_slot = n;
    }
    for (uint32_t i = 0; i < n; i++) x->slot[i] = NIL;
    for (size_t i = 0; i < x->n_nodes; i++) {
        uint32_t k = id_hash(x->nodes[i].id) & (n - 1);
        while (x->slot[k] != NIL) k = (k + 1) & (n - 1);
        x->slot[k] = (int32_t)i;
    }
}

bt_status rtr_pindex_create(rtr_pindex_t **out)
{
    rtr_pindex_t *x = calloc(1, sizeof *x);
    if (!x) return bt_fail(BT_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&x->mu, NULL);
    x->first = calloc(PI_FIRST_SLOTS, sizeof *x->first); /* NULL: no hints, everything else works */
    *out = x;
    return BT_OK;
}

static void node_clear(pi_node_t *nd)
{
    free(nd->e);
    free(nd->bucket);
    nd->e = NULL;
    nd->bucket = NULL;
    nd->n = nd->n_alloc = 0;
    nd->n_bucket = 0;
    nd->head = nd->tail = NIL;
}

void rtr_pindex_destroy(rtr_pindex_t *x)
{
    if (!x) return;
    for (size_t i = 0; i < x->n_nodes; i++) node_clear(&x->nodes[i]);
    free(x->nodes);
    free(x->slot);
    free(x->first);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

static pi_node_t *node_find(rtr_pindex_t *x, const char *id)
{
    if (x->slot) {
        for (uint32_t k = id_hash(id) & (x->n_slot - 1); x->slot[k] != NIL; k = (k + 1) & (x->n_slot - 1))
            if (!strcmp(x->nodes[x->slot[k]].id, id)) return &x->nodes[x->slot[k]];
        return NULL;
    }
    for (size_t i = 0; i < x->n_nodes; i++)
        if (!strcmp(x->nodes[i].id, id)) return &x->nodes[i];
    return NULL;
}

static uint32_t bucket_of(const pi_node_t *nd, uint64_t h)
{
    /* the hashes are SipHash outputs: already uniform, the low bits will do */
    return (uint32_t)(h & (nd->n_bucket - 1));
}

static int32_t entry_find(const pi_node_t *nd, uint64_t h)
{
    if (!nd->n_bucket) return NIL;
    for (int32_t i = nd->bucket[bucket_of(nd, h)]; i != NIL; i = nd->e[i].chain)
        if (nd->e[i].h == h) return i;
    return NIL;
}

static void lru_unlink(pi_node_t *nd, int32_t i)
{
    pi_entry_t *e = &nd->e[i];
    if (e->prev != NIL) nd->e[e->prev].next = e->next;
    else nd->head = e->next;
    if (e->next != NIL) nd->e[e->next].prev = e->prev;
    else nd->tail = e->prev;
    e->prev = e->next = NIL;
}

static void lru_push_front(pi_node_t *nd, int32_t i)
{
    pi_entry_t *e = &nd->e[i];
    e->prev = NIL;
    e->next = nd->head;
    if (nd->head != NIL) nd->e[nd->head].prev = i;
    nd->head = i;
    if (nd->tail == NIL) nd->tail = i;
}

static void chain_unlink(pi_node_t *nd, int32_t i)
{
    int32_t *p = &nd->bucket[bucket_of(nd, nd->e[i].h)];
    while (*p != i) p = &nd->e[*p].chain;
    *p = nd->e[i].chain;
}

static void chain_link(pi_node_t *nd, int32_t i)
{
    uint32_t b = bucket_of(nd, nd->e[i].h);
    nd->e[i].chain = nd->bucket[b];
    nd->bucket[b] = i;
}

/* Makes room for one more entry below the capacity: doubles the arrays and rebuilds the chains. 0 on NOMEM. */
static int node_grow(pi_node_t *nd)
{
    int64_t want = nd->n_alloc ? (int64_t)nd->n_alloc * 2 : 64;
    if (want > nd->cap) want = nd->cap;
    pi_entry_t *e = realloc(nd->e, (size_t)want * sizeof *e);
    if (!e) return 0;
    nd->e = e;
    nd->n_alloc = (int32_t)want;
    uint32_t nb = 64;
    while (nb < (uint32_t)want) nb *= 2;
    if (nb != nd->n_bucket) {
        int32_t *b = malloc(nb * sizeof *b);
        if (!b) return 0;
        free(nd->bucket);
        nd->bucket = b;
        nd->n_bucket = nb;
        for (uint32_t k = 0; k < nb; k++) b[k] = NIL;
        for (int32_t i = 0; i < nd->n; i++) chain_link(nd, i);
    }
    return 1;
}

/* Adds h as most recently used, evicting the least recently used entry when full. 0 on NOMEM. */
static int node_touch(pi_node_t *nd, uint64_t h)
{
    int32_t i = entry_find(nd, h);
    if (i != NIL) {
        lru_unlink(nd, i);
        lru_push_front(nd, i);
        return 1;
    }
    if (nd->n >= nd->cap) {
        i = nd->tail; /* reuse the evicted slot: the array never exceeds the capacity */
        lru_unlink(nd, i);
        chain_unlink(nd, i);
    } else {
        if (nd->n == nd->n_alloc && !node_grow(nd)) return 0;
        i = nd->n++;
    }
    nd->e[i].h = h;
    chain_link(nd, i);
    lru_push_front(nd, i);
    return 1;
}

/* The node's record for this incarnation and capacity, created or reset as needed; NULL on NOMEM. */
static pi_node_t *node_get(rtr_pindex_t *x, const char *id, int64_t started_ms, int64_t cap)
{
    pi_node_t *nd = node_find(x, id);
    if (nd && (nd->started_ms != started_ms || nd->cap != cap)) {
        node_clear(nd); /* restarted or resized: what it held is gone, or the bound no longer holds */
        nd->started_ms = started_ms;
        nd->cap = cap;
    }
    if (nd) return nd;
    if (x->n_nodes == x->cap_nodes) {
        size_t c = x->cap_nodes ? x->cap_nodes * 2 : 8;
        pi_node_t *q = realloc(x->nodes, c * sizeof *q);
        if (!q) return NULL;
        x->nodes = q;
        x->cap_nodes = c;
    }
    nd = &x->nodes[x->n_nodes++];
    memset(nd, 0, sizeof *nd);
    snprintf(nd->id, sizeof nd->id, "%s", id);
    nd->started_ms = started_ms;
    nd->cap = cap;
    nd->head = nd->tail = NIL;
    slots_rebuild(x);
    return nd;
}

size_t rtr_pindex_match(rtr_pindex_t *x, const char *node_id, int64_t started_ms, const uint64_t *h, size_t n)
{
    size_t k = 0;
    pthread_mutex_lock(&x->mu);
    pi_node_t *nd = node_find(x, node_id);
    if (nd && nd->started_ms == started_ms)
        while (k < n && entry_find(nd, h[k]) != NIL) k++;
    pthread_mutex_unlock(&x->mu);
    return k;
}

/* The hint slot of h: its own, else an empty one in its probe window, else the window's first (overwritten). */
static pi_first_t *first_slot(rtr_pindex_t *x, uint64_t h, int create)
{
    if (!x->first || !h) return NULL;
    uint32_t k0 = (uint32_t)(h >> 40) & (PI_FIRST_SLOTS - 1);
    pi_first_t *empty = NULL;
    for (uint32_t j = 0; j < PI_FIRST_PROBE; j++) {
        pi_first_t *f = &x->first[(k0 + j) & (PI_FIRST_SLOTS - 1)];
        if (f->h == h) return f;
        if (!f->h && !empty) empty = f;
    }
    if (!create) return NULL;
    pi_first_t *f = empty ? empty : &x->first[k0];
    memset(f, 0, sizeof *f);
    f->h = h;
    return f;
}

static void first_note(rtr_pindex_t *x, uint64_t h, const char *node_id, int64_t started_ms)
{
    pi_first_t *f = first_slot(x, h, 1);
    if (!f) return;
    uint32_t idh = id_hash(node_id);
    for (uint8_t i = 0; i < f->n; i++)
        if (f->idh[i] == idh && f->started[i] == started_ms) return;
    uint8_t i = f->n < RTR_PINDEX_HOLDERS ? f->n++ : f->next;
    if (f->n == RTR_PINDEX_HOLDERS && i == f->next) f->next = (uint8_t)((f->next + 1) % RTR_PINDEX_HOLDERS);
    f->idh[i] = idh;
    f->started[i] = started_ms;
}

uint32_t rtr_pindex_id_hash(const char *node_id)
{
    return id_hash(node_id);
}

size_t rtr_pindex_holders(rtr_pindex_t *x, uint64_t h0, uint32_t *idh, int64_t *started)
{
    pthread_mutex_lock(&x->mu);
    pi_first_t *f = first_slot(x, h0, 0);
    size_t n = f ? f->n : 0;
    for (size_t i = 0; i < n; i++) {
        idh[i] = f->idh[i];
        started[i] = f->started[i];
    }
    pthread_mutex_unlock(&x->mu);
    return n;
}

void rtr_pindex_insert(rtr_pindex_t *x, const char *node_id, int64_t started_ms, int64_t capacity, const uint64_t *h,
                       size_t n)
{
    if (capacity <= 0) capacity = RTR_PINDEX_DEFAULT_CAPACITY;
    if (capacity > INT32_MAX / 2) capacity = INT32_MAX / 2;
    pthread_mutex_lock(&x->mu);
    if (n) first_note(x, h[0], node_id, started_ms);
    pi_node_t *nd = node_get(x, node_id, started_ms, capacity);
    /* last block first, so the first block is the most recent and eviction trims the chain from its tail */
    for (size_t i = n; nd && i-- > 0;)
        if (!node_touch(nd, h[i])) {
            node_clear(nd); /* harmless: the node just looks cold to the router */
            break;
        }
    pthread_mutex_unlock(&x->mu);
}

void rtr_pindex_forget(rtr_pindex_t *x, const char *node_id)
{
    pthread_mutex_lock(&x->mu);
    pi_node_t *nd = node_find(x, node_id);
    if (nd) {
        node_clear(nd);
        *nd = x->nodes[--x->n_nodes];
        slots_rebuild(x);
    }
    pthread_mutex_unlock(&x->mu);
}

size_t rtr_pindex_size(rtr_pindex_t *x, const char *node_id)
{
    pthread_mutex_lock(&x->mu);
    pi_node_t *nd = node_find(x, node_id);
    size_t n = nd ? (size_t)nd->n : 0;
    pthread_mutex_unlock(&x->mu);
    return n;
}
