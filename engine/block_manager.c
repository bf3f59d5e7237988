#include "engine/block_manager.h"

#include <stdlib.h>
#include <string.h>

#include "engine/kv_pool.h"

_Static_assert(BT_BM_BLOCK == BT_KV_BLOCK, "block manager and KV pool disagree on the block size");
_Static_assert(BT_BM_BLOCK == BT_PREFIX_HASH_BLOCK, "block manager and prefix hash disagree on the block size");

typedef struct bm_seq {
    int live;
    int32_t len;          /* positions reserved */
    int32_t computed;     /* positions whose KV is written */
    int32_t n_released;   /* leading table entries released by the sliding window */
    int32_t n_table, cap_table;
    int32_t *table;       /* [n_table] block ids; n_table == ceil(len / 16) */
    int32_t cap_tokens;
    int32_t *tokens;      /* [len] input token ids */
    int32_t n_hashed, cap_hashes;
    bt_prefix_hash *hashes; /* [n_hashed] chain hashes of blocks 0..; n_hashed == computed / 16 */
    int32_t next_free;    /* free-id list link while !live */
} bm_seq;

struct bt_bm {
    bt_bm_config cfg;
    int32_t n_blocks;
    int32_t *refcount;      /* [n_blocks] */
    uint8_t *in_table;      /* [n_blocks] 1 when the block's hash is in htab */
    bt_prefix_hash *hash;   /* [n_blocks] valid while in_table */
    int32_t *lru_prev, *lru_next; /* [n_blocks] links of the cached list; head = least recently released */
    int32_t lru_head, lru_tail;
    uint64_t *free_bits;    /* [n_words] bit b set: block b is free (refcount 0, no hash); padding bits 0 */
    int32_t n_words;
    int32_t n_free, n_cached, n_used, n_shared;
    int32_t *htab;          /* [hmask + 1] open addressing, linear probing; block ids, -1 empty */
    uint32_t hmask;
    int32_t n_hashed;
    int32_t *run_start, *run_len; /* scratch for allocation: up to n_blocks / 2 + 1 runs */
    uint64_t *run_key;
    bm_seq *seqs;
    int32_t cap_seqs, free_seq, n_live;
    uint64_t prefix_queries, prefix_query_blocks, prefix_hit_blocks, prefix_query_tokens, prefix_hit_tokens;
    uint64_t evictions, cow_copies;
};

static int32_t blocks_for(int32_t n_tokens)
{
    return (n_tokens + BT_BM_BLOCK - 1) / BT_BM_BLOCK;
}

/* ---- free bitmap ---- */

static inline int bit_get(const bt_bm *bm, int32_t b)
{
    return (int)((bm->free_bits[b >> 6] >> (b & 63)) & 1);
}

static inline void bit_set(bt_bm *bm, int32_t b)
{
    bm->free_bits[b >> 6] |= 1ULL << (b & 63);
}

static inline void bit_clear(bt_bm *bm, int32_t b)
{
    bm->free_bits[b >> 6] &= ~(1ULL << (b & 63));
}

/* First free block >= from, or n_blocks. */
static int32_t next_free_bit(const bt_bm *bm, int32_t from)
{
    if (from >= bm->n_blocks) return bm->n_blocks;
    int32_t w = from >> 6;
    uint64_t word = bm->free_bits[w] & (~0ULL << (from & 63));
    for (;;) {
        if (word) {
            int32_t b = (w << 6) + __builtin_ctzll(word);
            return b < bm->n_blocks ? b : bm->n_blocks;
        }
        if (++w >= bm->n_words) return bm->n_blocks;
        word = bm->free_bits[w];
    }
}

/* First non-free block >= from, or n_blocks (padding bits are 0, so the scan stops at the end). */
static int32_t next_used_bit(const bt_bm *bm, int32_t from)
{
    if (from >= bm->n_blocks) return bm->n_blocks;
    int32_t w = from >> 6;
    uint64_t word = ~bm->free_bits[w] & (~0ULL << (from & 63));
    for (;;) {
        if (word) {
            int32_t b = (w << 6) + __builtin_ctzll(word);
            return b < bm->n_blocks ? b : bm->n_blocks;
        }
        if (++w >= bm->n_words) return bm->n_blocks;
        word = ~bm->free_bits[w];
    }
}

/* ---- prefix table ---- */

static inline uint32_t hslot(const bt_bm *bm, bt_prefix_hash h)
{
    return (uint32_t)h.lo & bm->hmask;
}

static int32_t htab_find(const bt_bm *bm, bt_prefix_hash h)
{
    for (uint32_t i = hslot(bm, h);; i = (i + 1) & bm->hmask) {
        int32_t b = bm->htab[i];
        if (b < 0) return -1;
        if (bt_prefix_hash_eq(bm->hash[b], h)) return b;
    }
}

/* b's hash must be set and absent from the table; the table never fills (capacity >= 2 * n_blocks). */
static void htab_insert(bt_bm *bm, int32_t b)
{
    uint32_t i = hslot(bm, bm->hash[b]);
    while (bm->htab[i] >= 0) i = (i + 1) & bm->hmask;
    bm->htab[i] = b;
    bm->in_table[b] = 1;
    bm->n_hashed++;
}

/* Removes b (which is in the table) with backward-shift deletion, so probes need no tombstones. */
static void htab_remove(bt_bm *bm, int32_t b)
{
    uint32_t i = hslot(bm, bm->hash[b]);
    while (bm->htab[i] != b) i = (i + 1) & bm->hmask;
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & bm->hmask;
        int32_t e = bm->htab[j];
        if (e < 0) break;
        uint32_t home = hslot(bm, bm->hash[e]);
        /* e may move back to i only if its home is not cyclically inside (i, j] */
        int inside = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!inside) {
            bm->htab[i] = e;
            i = j;
        }
    }
    bm->htab[i] = -1;
    bm->in_table[b] = 0;
    bm->n_hashed--;
}

/* ---- LRU list of cached blocks ---- */

static void lru_push_tail(bt_bm *bm, int32_t b)
{
    bm->lru_prev[b] = bm->lru_tail;
    bm->lru_next[b] = -1;
    if (bm->lru_tail >= 0)
        bm->lru_next[bm->lru_tail] = b;
    else
        bm->lru_head = b;
    bm->lru_tail = b;
}

static void lru_unlink(bt_bm *bm, int32_t b)
{
    int32_t p = bm->lru_prev[b], n = bm->lru_next[b];
    if (p >= 0)
        bm->lru_next[p] = n;
    else
        bm->lru_head = n;
    if (n >= 0)
        bm->lru_prev[n] = p;
    else
        bm->lru_tail = p;
    bm->lru_prev[b] = bm->lru_next[b] = -1;
}

/* ---- block state transitions ---- */

/* refcount++ of a block that is used or cached (a prefix hit or a fork). */
static void block_ref(bt_bm *bm, int32_t b)
{
    if (bm->refcount[b] == 0) { /* cached: reused, leaves the LRU list */
        lru_unlink(bm, b);
        bm->n_cached--;
        bm->n_used++;
    } else if (bm->refcount[b] == 1) {
        bm->n_shared++;
    }
    bm->refcount[b]++;
}

/* refcount--; at 0 a hashed block becomes cached (most recently released), any other becomes free. */
static void block_unref(bt_bm *bm, int32_t b)
{
    if (--bm->refcount[b] == 1) {
        bm->n_shared--;
        return;
    }
    if (bm->refcount[b] > 0) return;
    bm->n_used--;
    if (bm->in_table[b]) {
        lru_push_tail(bm, b);
        bm->n_cached++;
    } else {
        bit_set(bm, b);
        bm->n_free++;
    }
}

static void take_free(bt_bm *bm, int32_t b)
{
    bit_clear(bm, b);
    bm->n_free--;
    bm->n_used++;
    bm->refcount[b] = 1;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Takes k blocks (k <= n_free + n_cached, checked by the caller) into out[k] with refcount 1. hint is the id
 * that would extend the caller's table contiguously (-1: none). */
static void alloc_blocks(bt_bm *bm, int32_t k, int32_t hint, int32_t *out)
{
    int32_t got = 0;
    /* 1. extend the sequence's last run */
    if (hint >= 0)
        while (got < k && hint + got < bm->n_blocks && bit_get(bm, hint + got)) {
            take_free(bm, hint + got);
            out[got] = hint + got;
            got++;
        }
    /* 2. the smallest free run that fits the rest, else 3. the largest runs first */
    int32_t rem = k - got;
    if (rem > 0 && bm->n_free > 0) {
        int32_t n_runs = 0, best = -1;
        for (int32_t s = next_free_bit(bm, 0); s < bm->n_blocks;) {
            int32_t e = next_used_bit(bm, s);
            int32_t l = e - s;
            if (l >= rem && (best < 0 || l < bm->run_len[best])) {
                bm->run_start[n_runs] = s;
                bm->run_len[n_runs] = l;
                best = n_runs++;
                if (l == rem) break;
            } else if (l < rem) {
                bm->run_start[n_runs] = s;
                bm->run_len[n_runs] = l;
                n_runs++;
            }
            s = next_free_bit(bm, e);
        }
        if (best >= 0) {
            for (int32_t i = 0; i < rem; i++) {
                take_free(bm, bm->run_start[best] + i);
                out[got++] = bm->run_start[best] + i;
            }
        } else {
            /* longest first, then lowest start: (INT32_MAX - len, start) sorts ascending */
            for (int32_t i = 0; i < n_runs; i++)
                bm->run_key[i] = (uint64_t)(INT32_MAX - bm->run_len[i]) << 32 | (uint32_t)bm->run_start[i];
            qsort(bm->run_key, (size_t)n_runs, sizeof *bm->run_key, cmp_u64);
            for (int32_t r = 0; r < n_runs && got < k; r++) {
                int32_t s = (int32_t)(uint32_t)bm->run_key[r], l = INT32_MAX - (int32_t)(bm->run_key[r] >> 32);
                for (int32_t i = 0; i < l && got < k; i++) {
                    take_free(bm, s + i);
                    out[got++] = s + i;
                }
            }
        }
    }
    /* 4. evict cached blocks, least recently released first; ascending ids make the most of any adjacency */
    int32_t first_evicted = got;
    while (got < k) {
        int32_t b = bm->lru_head;
        lru_unlink(bm, b);
        htab_remove(bm, b);
        bm->n_cached--;
        bm->n_used++;
        bm->refcount[b] = 1;
        bm->evictions++;
        out[got++] = b;
    }
    if (got - first_evicted > 1) qsort(out + first_evicted, (size_t)(got - first_evicted), sizeof *out, cmp_i32);
}

/* ---- sequences ---- */

static bm_seq *seq_get(const bt_bm *bm, int32_t id)
{
    if (id < 0 || id >= bm->cap_seqs || !bm->seqs[id].live) return NULL;
    return &bm->seqs[id];
}

/* Grows *arr (elements of size sz, capacity *cap) to hold at least n. Nothing changes on failure. */
static int reserve(void **arr, int32_t *cap, int32_t n, size_t sz)
{
    if (n <= *cap) return 0;
    int32_t c = *cap ? *cap : 8;
    while (c < n) c = c > INT32_MAX / 2 ? n : c * 2;
    void *p = realloc(*arr, (size_t)c * sz);
    if (!p) return -1;
    *arr = p;
    *cap = c;
    return 0;
}

static bt_status seq_reserve(bm_seq *s, int32_t n_tokens, int32_t n_table, int32_t n_hashes)
{
    if (reserve((void **)&s->tokens, &s->cap_tokens, n_tokens, sizeof *s->tokens) ||
        reserve((void **)&s->table, &s->cap_table, n_table, sizeof *s->table) ||
        reserve((void **)&s->hashes, &s->cap_hashes, n_hashes, sizeof *s->hashes))
        return bt_fail(BT_ERR_NOMEM, "out of memory for a sequence of %d tokens", n_tokens);
    return BT_OK;
}

static void seq_clear(bm_seq *s)
{
    free(s->tokens);
    free(s->table);
    free(s->hashes);
    memset(s, 0, sizeof *s);
}

bt_status bt_bm_create(const bt_bm_config *cfg, bt_bm **out)
{
    if (!cfg || cfg->n_blocks < 1 || cfg->window < 0 || cfg->n_blocks > INT32_MAX / 4)
        return bt_fail(BT_ERR_INVALID, "block manager: bad configuration (n_blocks %d, window %d)",
                       cfg ? cfg->n_blocks : 0, cfg ? cfg->window : 0);
    bt_bm *bm = calloc(1, sizeof *bm);
    if (!bm) return bt_fail(BT_ERR_NOMEM, "out of memory for the block manager");
    int32_t n = cfg->n_blocks;
    bm->cfg = *cfg;
    bm->n_blocks = n;
    bm->n_words = (n + 63) / 64;
    uint32_t hcap = 16;
    while (hcap < 2u * (uint32_t)n) hcap *= 2;
    bm->hmask = hcap - 1;
    int32_t max_runs = n / 2 + 1;
    bm->refcount = calloc((size_t)n, sizeof *bm->refcount);
    bm->in_table = calloc((size_t)n, sizeof *bm->in_table);
    bm->hash = calloc((size_t)n, sizeof *bm->hash);
    bm->lru_prev = malloc((size_t)n * sizeof *bm->lru_prev);
    bm->lru_next = malloc((size_t)n * sizeof *bm->lru_next);
    bm->free_bits = calloc((size_t)bm->n_words, sizeof *bm->free_bits);
    bm->htab = malloc((size_t)hcap * sizeof *bm->htab);
    bm->run_start = malloc((size_t)max_runs * sizeof *bm->run_start);
    bm->run_len = malloc((size_t)max_runs * sizeof *bm->run_len);
    bm->run_key = malloc((size_t)max_runs * sizeof *bm->run_key);
    if (!bm->refcount || !bm->in_table || !bm->hash || !bm->lru_prev || !bm->lru_next || !bm->free_bits ||
        !bm->htab || !bm->run_start || !bm->run_len || !bm->run_key) {
        bt_bm_destroy(bm);
        return bt_fail(BT_ERR_NOMEM, "out of memory for a block manager of %d blocks", n);
    }
    for (int32_t b = 0; b < n; b++) {
        bm->lru_prev[b] = bm->lru_next[b] = -1;
        bit_set(bm, b);
    }
    memset(bm->htab, 0xff, (size_t)hcap * sizeof *bm->htab);
    bm->lru_head = bm->lru_tail = -1;
    bm->n_free = n;
    bm->free_seq = -1;
    *out = bm;
    return BT_OK;
}

void bt_bm_destroy(bt_bm *bm)
{
    if (!bm) return;
    for (int32_t i = 0; i < bm->cap_seqs; i++) seq_clear(&bm->seqs[i]);
    free(bm->seqs);
    free(bm->refcount);
    free(bm->in_table);
    free(bm->hash);
    free(bm->lru_prev);
    free(bm->lru_next);
    free(bm->free_bits);
    free(bm->htab);
    free(bm->run_start);
    free(bm->run_len);
    free(bm->run_key);
    free(bm);
}

int bt_bm_can_allocate(const bt_bm *bm, int32_t n_blocks)
{
    return n_blocks <= bm->n_free + bm->n_cached;
}

static bt_status seq_new(bt_bm *bm, int32_t *id_out)
{
    if (bm->free_seq < 0) {
        int32_t old = bm->cap_seqs, cap = old;
        if (reserve((void **)&bm->seqs, &cap, old + 1, sizeof *bm->seqs))
            return bt_fail(BT_ERR_NOMEM, "out of memory for sequence %d", old);
        memset(bm->seqs + old, 0, (size_t)(cap - old) * sizeof *bm->seqs);
        for (int32_t i = cap - 1; i >= old; i--) {
            bm->seqs[i].next_free = bm->free_seq;
            bm->free_seq = i;
        }
        bm->cap_seqs = cap;
    }
    int32_t id = bm->free_seq;
    bm->free_seq = bm->seqs[id].next_free;
    bm->seqs[id].live = 1;
    bm->seqs[id].next_free = -1;
    bm->n_live++;
    *id_out = id;
    return BT_OK;
}

bt_status bt_bm_seq_create(bt_bm *bm, int32_t *seq_out)
{
    return seq_new(bm, seq_out);
}

static void seq_release(bt_bm *bm, bm_seq *s, int32_t id)
{
    for (int32_t i = s->n_table - 1; i >= s->n_released; i--) block_unref(bm, s->table[i]);
    int32_t *tokens = s->tokens, *table = s->table;
    bt_prefix_hash *hashes = s->hashes;
    int32_t ct = s->cap_tokens, cb = s->cap_table, ch = s->cap_hashes;
    memset(s, 0, sizeof *s);
    if (ct > 16384) { /* don't let one long sequence pin its buffers on an idle id */
        free(tokens);
        free(table);
        free(hashes);
        tokens = table = NULL;
        hashes = NULL;
        ct = cb = ch = 0;
    }
    /* keep the buffers for the id's next user */
    s->tokens = tokens;
    s->table = table;
    s->hashes = hashes;
    s->cap_tokens = ct;
    s->cap_table = cb;
    s->cap_hashes = ch;
    s->next_free = bm->free_seq;
    bm->free_seq = id;
    bm->n_live--;
}

void bt_bm_seq_free(bt_bm *bm, int32_t seq)
{
    bm_seq *s = seq_get(bm, seq);
    if (s) seq_release(bm, s, seq);
}

bt_status bt_bm_seq_fork(bt_bm *bm, int32_t parent, int32_t *child_out)
{
    if (!seq_get(bm, parent)) return bt_fail(BT_ERR_INVALID, "fork of unknown sequence %d", parent);
    int32_t id = -1;
    bt_status st = seq_new(bm, &id);
    if (st != BT_OK) return st;
    bm_seq *p = &bm->seqs[parent], *c = &bm->seqs[id]; /* after seq_new: it may move the array */
    st = seq_reserve(c, p->len, p->n_table, p->n_hashed);
    if (st != BT_OK) {
        seq_release(bm, c, id);
        return st;
    }
    if (p->len) memcpy(c->tokens, p->tokens, (size_t)p->len * sizeof *c->tokens);
    if (p->n_table) memcpy(c->table, p->table, (size_t)p->n_table * sizeof *c->table);
    if (p->n_hashed) memcpy(c->hashes, p->hashes, (size_t)p->n_hashed * sizeof *c->hashes);
    c->len = p->len;
    c->computed = p->computed;
    c->n_released = p->n_released;
    c->n_table = p->n_table;
    c->n_hashed = p->n_hashed;
    for (int32_t i = c->n_released; i < c->n_table; i++) block_ref(bm, c->table[i]);
    *child_out = id;
    return BT_OK;
}

/* Hashes the prompt's matchable blocks into hashes[] until the first miss; returns the number of hits. */
static int32_t prefix_walk(const bt_bm *bm, const int32_t *tokens, int32_t n_tokens, bt_prefix_hash *hashes,
                           int32_t *n_evictable)
{
    int32_t max_blocks = n_tokens > 0 ? (n_tokens - 1) / BT_BM_BLOCK : 0, hits = 0, evictable = 0;
    bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
    if (bm->cfg.disable_prefix_cache) max_blocks = 0;
    for (; hits < max_blocks; hits++) {
        bt_prefix_hash h = bt_prefix_hash_block(prev, tokens + (size_t)hits * BT_BM_BLOCK, bm->cfg.fingerprint);
        int32_t b = htab_find(bm, h);
        if (b < 0) break;
        if (bm->refcount[b] == 0) evictable++;
        if (hashes) hashes[hits] = h;
        prev = h;
    }
    if (n_evictable) *n_evictable = evictable;
    return hits;
}

int32_t bt_bm_prefix_probe(const bt_bm *bm, const int32_t *tokens, int32_t n_tokens, int32_t *n_evictable)
{
    return prefix_walk(bm, tokens, n_tokens, NULL, n_evictable);
}

bt_status bt_bm_seq_match_prefix(bt_bm *bm, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                 int32_t *n_cached_tokens)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s) return bt_fail(BT_ERR_INVALID, "prefix match on unknown sequence %d", seq);
    if (s->len != 0) return bt_fail(BT_ERR_INVALID, "prefix match on sequence %d of %d tokens", seq, s->len);
    if (n_tokens < 0 || (n_tokens > 0 && !tokens))
        return bt_fail(BT_ERR_INVALID, "prefix match of %d tokens", n_tokens);
    int32_t max_blocks = n_tokens > 0 ? (n_tokens - 1) / BT_BM_BLOCK : 0;
    bt_status st = seq_reserve(s, 0, 0, max_blocks);
    if (st != BT_OK) return st;
    int32_t hits = prefix_walk(bm, tokens, n_tokens, s->hashes, NULL);
    st = seq_reserve(s, hits * BT_BM_BLOCK, hits, hits);
    if (st != BT_OK) return st;
    for (int32_t i = 0; i < hits; i++) {
        int32_t b = htab_find(bm, s->hashes[i]);
        block_ref(bm, b);
        s->table[i] = b;
    }
    if (hits) memcpy(s->tokens, tokens, (size_t)hits * BT_BM_BLOCK * sizeof *tokens);
    s->n_table = s->n_hashed = hits;
    s->len = s->computed = hits * BT_BM_BLOCK;
    bm->prefix_queries++;
    bm->prefix_query_blocks += (uint64_t)max_blocks;
    bm->prefix_hit_blocks += (uint64_t)hits;
    bm->prefix_query_tokens += (uint64_t)n_tokens;
    bm->prefix_hit_tokens += (uint64_t)hits * BT_BM_BLOCK;
    *n_cached_tokens = hits * BT_BM_BLOCK;
    return BT_OK;
}

int32_t bt_bm_prefix_scan(const bt_bm *bm, const int32_t *tokens, int32_t n_tokens, int32_t max_blocks,
                          uint8_t *state)
{
    int32_t n = n_tokens > 0 ? (n_tokens - 1) / BT_BM_BLOCK : 0;
    if (bm->cfg.disable_prefix_cache || !tokens) n = 0;
    if (n > max_blocks) n = max_blocks;
    bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
    for (int32_t i = 0; i < n; i++) {
        prev = bt_prefix_hash_block(prev, tokens + (size_t)i * BT_BM_BLOCK, bm->cfg.fingerprint);
        int32_t b = htab_find(bm, prev);
        state[i] = b < 0 ? 0 : bm->refcount[b] == 0 ? 2 : 1;
    }
    return n;
}

bt_status bt_bm_seq_match_prefix_range(bt_bm *bm, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                       int32_t first, int32_t n_match, int32_t *n_cached_tokens)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s) return bt_fail(BT_ERR_INVALID, "prefix match on unknown sequence %d", seq);
    if (s->len != 0) return bt_fail(BT_ERR_INVALID, "prefix match on sequence %d of %d tokens", seq, s->len);
    int32_t max_blocks = n_tokens > 0 ? (n_tokens - 1) / BT_BM_BLOCK : 0;
    if (n_tokens < 0 || (n_tokens > 0 && !tokens) || n_match < 0 || n_match > max_blocks || first < 0 ||
        first > n_match || (first > 0 && bm->cfg.window <= 0) || (n_match > 0 && bm->cfg.disable_prefix_cache))
        return bt_fail(BT_ERR_INVALID, "prefix match of blocks [%d, %d) of a %d-token prompt", first, n_match,
                       n_tokens);
    bt_status st = seq_reserve(s, n_match * BT_BM_BLOCK, n_match, n_match);
    if (st != BT_OK) return st;
    bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
    for (int32_t i = 0; i < n_match; i++) {
        prev = bt_prefix_hash_block(prev, tokens + (size_t)i * BT_BM_BLOCK, bm->cfg.fingerprint);
        s->hashes[i] = prev;
        if (i >= first && htab_find(bm, prev) < 0)
            return bt_fail(BT_ERR_INVALID, "prefix match: block %d of the prompt is not cached", i);
    }
    for (int32_t i = 0; i < n_match; i++) {
        int32_t b = BT_BM_NO_BLOCK;
        if (i >= first) {
            b = htab_find(bm, s->hashes[i]);
            block_ref(bm, b);
        }
        s->table[i] = b;
    }
    if (n_match) memcpy(s->tokens, tokens, (size_t)n_match * BT_BM_BLOCK * sizeof *tokens);
    s->n_table = s->n_hashed = n_match;
    s->n_released = first;
    s->len = s->computed = n_match * BT_BM_BLOCK;
    bm->prefix_queries++;
    bm->prefix_query_blocks += (uint64_t)max_blocks;
    bm->prefix_hit_blocks += (uint64_t)n_match;
    bm->prefix_query_tokens += (uint64_t)n_tokens;
    bm->prefix_hit_tokens += (uint64_t)n_match * BT_BM_BLOCK;
    *n_cached_tokens = n_match * BT_BM_BLOCK;
    return BT_OK;
}

/* The block an append into s would write first, when that block already exists and is shared. */
static int cow_due(const bt_bm *bm, const bm_seq *s)
{
    if (s->len % BT_BM_BLOCK == 0) return 0;
    int32_t b = s->table[s->len / BT_BM_BLOCK];
    return bm->refcount[b] > 1;
}

int32_t bt_bm_seq_blocks_needed(const bt_bm *bm, int32_t seq, int32_t n_new)
{
    const bm_seq *s = seq_get(bm, seq);
    if (!s || n_new < 0) return -1;
    if (n_new == 0) return 0;
    return blocks_for(s->len + n_new) - s->n_table + cow_due(bm, s);
}

/* Id that would extend s's table contiguously after entry idx - 1, or -1. */
static int32_t extend_hint(const bm_seq *s, int32_t idx)
{
    if (idx <= 0 || s->table[idx - 1] < 0) return -1;
    return s->table[idx - 1] + 1;
}

bt_status bt_bm_seq_append(bt_bm *bm, int32_t seq, int32_t n_new, const int32_t *tokens, bt_bm_copy *cow)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s) return bt_fail(BT_ERR_INVALID, "append to unknown sequence %d", seq);
    if (n_new < 0 || (n_new > 0 && !tokens) || n_new > INT32_MAX - s->len - BT_BM_BLOCK)
        return bt_fail(BT_ERR_INVALID, "append of %d tokens to sequence %d", n_new, seq);
    if (cow) cow->src = cow->dst = -1;
    if (n_new == 0) return BT_OK;
    int cow_now = cow_due(bm, s);
    if (cow_now && !cow)
        return bt_fail(BT_ERR_INVALID, "append to sequence %d needs a copy-on-write but no place to report it", seq);
    int32_t need_table = blocks_for(s->len + n_new);
    int32_t need = need_table - s->n_table + cow_now;
    if (!bt_bm_can_allocate(bm, need))
        return bt_fail(BT_ERR_EXHAUSTED, "KV blocks exhausted: sequence %d needs %d, %d free and %d cached of %d",
                       seq, need, bm->n_free, bm->n_cached, bm->n_blocks);
    bt_status st = seq_reserve(s, s->len + n_new, need_table, 0);
    if (st != BT_OK) return st;
    if (!cow_now && s->len % BT_BM_BLOCK) {
        int32_t b = s->table[s->len / BT_BM_BLOCK];
        if (bm->in_table[b]) htab_remove(bm, b); /* held alone and about to be overwritten (after a truncate) */
    }
    if (cow_now) {
        int32_t idx = s->len / BT_BM_BLOCK, old = s->table[idx], dst;
        alloc_blocks(bm, 1, extend_hint(s, idx), &dst);
        block_unref(bm, old); /* still >= 1: the other holders keep it */
        s->table[idx] = dst;
        cow->src = old;
        cow->dst = dst;
        bm->cow_copies++;
    }
    int32_t k = need_table - s->n_table;
    if (k > 0) {
        alloc_blocks(bm, k, extend_hint(s, s->n_table), s->table + s->n_table);
        s->n_table = need_table;
    }
    memcpy(s->tokens + s->len, tokens, (size_t)n_new * sizeof *tokens);
    s->len += n_new;
    return BT_OK;
}

bt_status bt_bm_seq_set_computed(bt_bm *bm, int32_t seq, int32_t n_computed)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s) return bt_fail(BT_ERR_INVALID, "set_computed on unknown sequence %d", seq);
    if (n_computed > s->len)
        return bt_fail(BT_ERR_INVALID, "sequence %d: %d computed of %d reserved", seq, n_computed, s->len);
    if (n_computed <= s->computed) return BT_OK;
    int32_t full = n_computed / BT_BM_BLOCK;
    bt_status st = seq_reserve(s, 0, 0, full);
    if (st != BT_OK) return st;
    for (int32_t i = s->n_hashed; i < full; i++) {
        bt_prefix_hash prev = i ? s->hashes[i - 1] : BT_PREFIX_HASH_ROOT;
        bt_prefix_hash h = bt_prefix_hash_block(prev, s->tokens + (size_t)i * BT_BM_BLOCK, bm->cfg.fingerprint);
        s->hashes[i] = h;
        int32_t b = s->table[i];
        /* a duplicate of an already cached block stays unpublished: the table maps each hash to one block */
        if (!bm->cfg.disable_prefix_cache && b >= 0 && !bm->in_table[b] && htab_find(bm, h) < 0) {
            bm->hash[b] = h;
            htab_insert(bm, b);
        }
    }
    s->n_hashed = full;
    s->computed = n_computed;
    return BT_OK;
}

bt_status bt_bm_seq_truncate(bt_bm *bm, int32_t seq, int32_t n_tokens)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s) return bt_fail(BT_ERR_INVALID, "truncate of unknown sequence %d", seq);
    if (n_tokens < 0 || n_tokens > s->len || n_tokens < s->n_released * BT_BM_BLOCK)
        return bt_fail(BT_ERR_INVALID, "sequence %d: truncate to %d of %d tokens (%d released by the window)", seq,
                       n_tokens, s->len, s->n_released * BT_BM_BLOCK);
    int32_t keep = blocks_for(n_tokens);
    for (int32_t i = s->n_table - 1; i >= keep; i--) block_unref(bm, s->table[i]);
    s->n_table = keep;
    s->len = n_tokens;
    if (s->computed > n_tokens) s->computed = n_tokens;
    if (s->n_hashed > s->computed / BT_BM_BLOCK) s->n_hashed = s->computed / BT_BM_BLOCK;
    /* a published block now partial keeps its hash: its KV still matches until bt_bm_seq_append writes it */
    return BT_OK;
}

int32_t bt_bm_seq_release_window(bt_bm *bm, int32_t seq, int32_t pos)
{
    bm_seq *s = seq_get(bm, seq);
    if (!s || pos < 0 || pos > s->len) return -1;
    if (bm->cfg.window <= 0 || pos - bm->cfg.window <= 0) return 0;
    int32_t upto = (pos - bm->cfg.window) / BT_BM_BLOCK; /* blocks [0, upto) end at or before pos - window */
    if (upto > s->n_table) upto = s->n_table;
    int32_t released = 0;
    for (int32_t i = s->n_released; i < upto; i++) {
        block_unref(bm, s->table[i]);
        s->table[i] = BT_BM_NO_BLOCK;
        released++;
    }
    if (upto > s->n_released) s->n_released = upto;
    return released;
}

const int32_t *bt_bm_seq_table(const bt_bm *bm, int32_t seq, int32_t *n_blocks)
{
    const bm_seq *s = seq_get(bm, seq);
    *n_blocks = s ? s->n_table : 0;
    return s ? s->table : NULL;
}

int32_t bt_bm_seq_len(const bt_bm *bm, int32_t seq)
{
    const bm_seq *s = seq_get(bm, seq);
    return s ? s->len : -1;
}

int32_t bt_bm_seq_computed(const bt_bm *bm, int32_t seq)
{
    const bm_seq *s = seq_get(bm, seq);
    return s ? s->computed : -1;
}

void bt_bm_cache_reset(bt_bm *bm)
{
    while (bm->lru_head >= 0) {
        int32_t b = bm->lru_head;
        lru_unlink(bm, b);
        htab_remove(bm, b);
        bm->n_cached--;
        bit_set(bm, b);
        bm->n_free++;
    }
    for (uint32_t i = 0; i <= bm->hmask; i++) {
        int32_t b = bm->htab[i];
        if (b >= 0) bm->in_table[b] = 0;
        bm->htab[i] = -1;
    }
    bm->n_hashed = 0;
}

void bt_bm_get_stats(const bt_bm *bm, bt_bm_stats *st)
{
    memset(st, 0, sizeof *st);
    st->blocks_total = bm->n_blocks;
    st->blocks_used = bm->n_used;
    st->blocks_cached = bm->n_cached;
    st->blocks_free = bm->n_free;
    st->blocks_shared = bm->n_shared;
    st->blocks_hashed = bm->n_hashed;
    st->n_seqs = bm->n_live;
    st->prefix_queries = bm->prefix_queries;
    st->prefix_query_blocks = bm->prefix_query_blocks;
    st->prefix_hit_blocks = bm->prefix_hit_blocks;
    st->prefix_query_tokens = bm->prefix_query_tokens;
    st->prefix_hit_tokens = bm->prefix_hit_tokens;
    st->evictions = bm->evictions;
    st->cow_copies = bm->cow_copies;
}

int32_t bt_bm_count_runs(const int32_t *ids, int32_t n)
{
    int32_t runs = 0, prev = BT_BM_NO_BLOCK;
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] == BT_BM_NO_BLOCK) continue;
        if (prev == BT_BM_NO_BLOCK || ids[i] != prev + 1) runs++;
        prev = ids[i];
    }
    return runs;
}

/* ---- invariant checker ---- */

#define CHECK_INV(cond, ...)                                                                                    \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            st = bt_fail(BT_ERR_INTERNAL, "block manager invariant: " __VA_ARGS__);                            \
            goto out;                                                                                          \
        }                                                                                                      \
    } while (0)

bt_status bt_bm_check(const bt_bm *bm)
{
    bt_status st = BT_OK;
    int32_t n = bm->n_blocks;
    int32_t *refs = calloc((size_t)n, sizeof *refs);
    int32_t *stamp = malloc((size_t)n * sizeof *stamp);
    uint8_t *in_lru = calloc((size_t)n, 1);
    if (!refs || !stamp || !in_lru) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory checking the block manager");
        goto out;
    }
    for (int32_t b = 0; b < n; b++) stamp[b] = -1;

    int32_t live = 0;
    for (int32_t id = 0; id < bm->cap_seqs; id++) {
        const bm_seq *s = &bm->seqs[id];
        if (!s->live) continue;
        live++;
        CHECK_INV(s->len >= 0 && s->computed >= 0 && s->computed <= s->len, "seq %d: computed %d of %d", id,
                  s->computed, s->len);
        CHECK_INV(s->n_table == blocks_for(s->len), "seq %d: %d blocks for %d tokens", id, s->n_table, s->len);
        CHECK_INV(s->n_hashed == s->computed / BT_BM_BLOCK, "seq %d: %d hashes for %d computed", id, s->n_hashed,
                  s->computed);
        CHECK_INV(s->n_released >= 0 && s->n_released <= s->n_table && (s->n_released == 0 || bm->cfg.window > 0),
                  "seq %d: %d blocks released of %d", id, s->n_released, s->n_table);
        bt_prefix_hash prev = BT_PREFIX_HASH_ROOT;
        for (int32_t i = 0; i < s->n_table; i++) {
            int32_t b = s->table[i];
            if (i < s->n_released) {
                CHECK_INV(b == BT_BM_NO_BLOCK, "seq %d: released entry %d holds block %d", id, i, b);
            } else {
                CHECK_INV(b >= 0 && b < n, "seq %d: entry %d is block %d", id, i, b);
                CHECK_INV(stamp[b] != id, "seq %d holds block %d twice", id, b);
                stamp[b] = id;
                refs[b]++;
            }
            if (i < s->n_hashed) {
                bt_prefix_hash h = bt_prefix_hash_block(prev, s->tokens + (size_t)i * BT_BM_BLOCK,
                                                        bm->cfg.fingerprint);
                CHECK_INV(bt_prefix_hash_eq(h, s->hashes[i]), "seq %d: stale hash of block %d", id, i);
                CHECK_INV(b < 0 || !bm->in_table[b] || bt_prefix_hash_eq(bm->hash[b], h),
                          "seq %d: block %d (entry %d) is cached under another prefix", id, b, i);
                prev = h;
            }
        }
    }
    CHECK_INV(live == bm->n_live, "%d live sequences, counted %d", live, bm->n_live);

    int32_t cached = 0;
    for (int32_t b = bm->lru_head, p = -1; b >= 0; p = b, b = bm->lru_next[b]) {
        CHECK_INV(b < n && !in_lru[b], "LRU list is corrupt at block %d", b);
        CHECK_INV(bm->lru_prev[b] == p, "LRU back link of block %d", b);
        in_lru[b] = 1;
        cached++;
        if (bm->lru_next[b] < 0) CHECK_INV(bm->lru_tail == b, "LRU tail is %d, list ends at %d", bm->lru_tail, b);
    }
    if (bm->lru_head < 0) CHECK_INV(bm->lru_tail < 0, "LRU list empty but tail %d", bm->lru_tail);

    int32_t used = 0, free_n = 0, shared = 0, hashed = 0;
    for (int32_t b = 0; b < n; b++) {
        CHECK_INV(bm->refcount[b] == refs[b], "block %d: refcount %d but %d holders", b, bm->refcount[b], refs[b]);
        int fr = bit_get(bm, b);
        if (bm->refcount[b] > 0) {
            used++;
            shared += bm->refcount[b] > 1;
            CHECK_INV(!fr && !in_lru[b], "block %d is used and also free or cached", b);
        } else if (bm->in_table[b]) {
            CHECK_INV(in_lru[b] && !fr, "cached block %d is not (only) on the LRU list", b);
        } else {
            CHECK_INV(fr && !in_lru[b], "free block %d is not (only) in the free bitmap", b);
            free_n++;
        }
        if (bm->in_table[b]) {
            hashed++;
            CHECK_INV(htab_find(bm, bm->hash[b]) == b, "block %d's hash maps elsewhere", b);
        }
    }
    for (int32_t b = n; b < bm->n_words * 64; b++) CHECK_INV(!bit_get(bm, b), "padding bit %d set", b);
    int32_t entries = 0;
    for (uint32_t i = 0; i <= bm->hmask; i++) {
        int32_t b = bm->htab[i];
        if (b < 0) continue;
        entries++;
        CHECK_INV(b < n && bm->in_table[b], "prefix table slot %u holds block %d not marked hashed", i, b);
    }
    CHECK_INV(used == bm->n_used && cached == bm->n_cached && free_n == bm->n_free && shared == bm->n_shared,
              "counters used/cached/free/shared %d/%d/%d/%d, counted %d/%d/%d/%d", bm->n_used, bm->n_cached,
              bm->n_free, bm->n_shared, used, cached, free_n, shared);
    CHECK_INV(used + cached + free_n == n, "%d used + %d cached + %d free != %d blocks", used, cached, free_n, n);
    CHECK_INV(hashed == bm->n_hashed && entries == hashed, "%d blocks hashed, %d table entries, counter %d", hashed,
              entries, bm->n_hashed);
out:
    free(refs);
    free(stamp);
    free(in_lru);
    return st;
}
