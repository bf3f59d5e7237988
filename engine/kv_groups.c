#include "engine/kv_groups.h"

#include <stdlib.h>

struct bt_kvg {
    bt_kvg_config cfg;
    bt_bm *global;
    bt_bm *local;        /* NULL without a window */
    uint8_t *gstate, *lstate; /* [cap_state] prefix scan scratch */
    int32_t cap_state;
};

bt_status bt_kvg_create(const bt_kvg_config *cfg, bt_kvg **out)
{
    if (!cfg || cfg->window < 0) return bt_fail(BT_ERR_INVALID, "KV block spaces: bad configuration");
    bt_kvg *g = calloc(1, sizeof *g);
    if (!g) return bt_fail(BT_ERR_NOMEM, "out of memory for the KV block spaces");
    g->cfg = *cfg;
    bt_bm_config bc = {.n_blocks = cfg->n_blocks, .window = 0, .fingerprint = cfg->fingerprint,
                       .disable_prefix_cache = cfg->disable_prefix_cache};
    bt_status st = bt_bm_create(&bc, &g->global);
    if (st == BT_OK && cfg->window > 0) {
        bc.window = cfg->window;
        st = bt_bm_create(&bc, &g->local);
    }
    if (st != BT_OK) {
        bt_kvg_destroy(g);
        return st;
    }
    *out = g;
    return BT_OK;
}

void bt_kvg_destroy(bt_kvg *g)
{
    if (!g) return;
    bt_bm_destroy(g->global);
    bt_bm_destroy(g->local);
    free(g->gstate);
    free(g->lstate);
    free(g);
}

int bt_kvg_windowed(const bt_kvg *g)
{
    return g->local != NULL;
}

const bt_bm *bt_kvg_global(const bt_kvg *g)
{
    return g->global;
}

const bt_bm *bt_kvg_local(const bt_kvg *g)
{
    return g->local;
}

int bt_kvg_can_allocate(const bt_kvg *g, int32_t n_global, int32_t n_local)
{
    return bt_bm_can_allocate(g->global, n_global) && (!g->local || bt_bm_can_allocate(g->local, n_local));
}

bt_status bt_kvg_seq_create(bt_kvg *g, int32_t *seq_out)
{
    int32_t id, lid;
    bt_status st = bt_bm_seq_create(g->global, &id);
    if (st != BT_OK || !g->local) {
        if (st == BT_OK) *seq_out = id;
        return st;
    }
    if ((st = bt_bm_seq_create(g->local, &lid)) != BT_OK) {
        bt_bm_seq_free(g->global, id);
        return st;
    }
    if (lid != id) { /* both id lists move in lockstep; a difference is a bug, not a runtime condition */
        bt_bm_seq_free(g->global, id);
        bt_bm_seq_free(g->local, lid);
        return bt_fail(BT_ERR_INTERNAL, "KV block spaces disagree on sequence ids (%d vs %d)", id, lid);
    }
    *seq_out = id;
    return BT_OK;
}

void bt_kvg_seq_free(bt_kvg *g, int32_t seq)
{
    bt_bm_seq_free(g->global, seq);
    if (g->local) bt_bm_seq_free(g->local, seq);
}

/* The prefix to reuse: k blocks with the global blocks [0, k) and the local blocks [*first, k) all cached. */
static int32_t choose_prefix(bt_kvg *g, const int32_t *tokens, int32_t n_tokens, int32_t *first, int32_t *ev_g,
                             int32_t *ev_l)
{
    int32_t max = n_tokens > 0 ? (n_tokens - 1) / BT_BM_BLOCK : 0;
    *first = *ev_g = *ev_l = 0;
    if (!g->local) return bt_bm_prefix_probe(g->global, tokens, n_tokens, ev_g);
    if (max > g->cap_state) {
        uint8_t *a = realloc(g->gstate, (size_t)max), *b = a ? realloc(g->lstate, (size_t)max) : NULL;
        if (a) g->gstate = a;
        if (!b) return 0; /* no memory for the scan: reuse nothing (recomputing is always correct) */
        g->lstate = b;
        g->cap_state = max;
    }
    int32_t ng = bt_bm_prefix_scan(g->global, tokens, n_tokens, max, g->gstate);
    int32_t k = 0;
    while (k < ng && g->gstate[k]) k++;
    int32_t nl = bt_bm_prefix_scan(g->local, tokens, n_tokens, k, g->lstate);
    for (; k > 0; k--) {
        int32_t f = bt_kvg_window_first_block(g->cfg.window, k * BT_BM_BLOCK), j = f;
        while (j < k && j < nl && g->lstate[j]) j++;
        if (j == k) {
            *first = f;
            break;
        }
    }
    for (int32_t i = 0; i < k; i++) {
        *ev_g += g->gstate[i] == 2;
        if (i >= *first) *ev_l += g->lstate[i] == 2;
    }
    return k;
}

int32_t bt_kvg_prefix_probe(bt_kvg *g, const int32_t *tokens, int32_t n_tokens, int32_t *evictable_global,
                            int32_t *evictable_local)
{
    int32_t first, eg, el;
    int32_t k = choose_prefix(g, tokens, n_tokens, &first, &eg, &el);
    if (evictable_global) *evictable_global = eg;
    if (evictable_local) *evictable_local = el;
    return k;
}

bt_status bt_kvg_seq_match_prefix(bt_kvg *g, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                  int32_t *n_cached_tokens)
{
    if (!g->local) return bt_bm_seq_match_prefix(g->global, seq, tokens, n_tokens, n_cached_tokens);
    if (n_tokens < 0 || (n_tokens > 0 && !tokens))
        return bt_fail(BT_ERR_INVALID, "prefix match of %d tokens", n_tokens);
    int32_t first, eg, el, cg, cl;
    int32_t k = choose_prefix(g, tokens, n_tokens, &first, &eg, &el);
    bt_status st = bt_bm_seq_match_prefix_range(g->global, seq, tokens, n_tokens, 0, k, &cg);
    if (st != BT_OK) return st;
    if ((st = bt_bm_seq_match_prefix_range(g->local, seq, tokens, n_tokens, first, k, &cl)) != BT_OK) {
        bt_bm_seq_truncate(g->global, seq, 0); /* back to empty */
        return st;
    }
    *n_cached_tokens = cg;
    return BT_OK;
}

int32_t bt_kvg_seq_blocks_needed(const bt_kvg *g, int32_t seq, int32_t n_new, int32_t *n_local)
{
    int32_t n = bt_bm_seq_blocks_needed(g->global, seq, n_new);
    if (n_local) *n_local = g->local ? bt_bm_seq_blocks_needed(g->local, seq, n_new) : 0;
    return n;
}

bt_status bt_kvg_seq_append(bt_kvg *g, int32_t seq, int32_t n_new, const int32_t *tokens, bt_bm_copy *cow_global,
                            bt_bm_copy *cow_local)
{
    if (cow_local) cow_local->src = cow_local->dst = -1;
    if (!g->local) return bt_bm_seq_append(g->global, seq, n_new, tokens, cow_global);
    int32_t nl = 0, ng = bt_kvg_seq_blocks_needed(g, seq, n_new, &nl);
    if (ng < 0 || nl < 0) return bt_fail(BT_ERR_INVALID, "append to unknown sequence %d", seq);
    if (!bt_bm_can_allocate(g->local, nl))
        return bt_fail(BT_ERR_EXHAUSTED, "local-layer KV blocks exhausted: sequence %d needs %d", seq, nl);
    int32_t old = bt_bm_seq_len(g->global, seq);
    bt_status st = bt_bm_seq_append(g->global, seq, n_new, tokens, cow_global);
    if (st != BT_OK) return st;
    if ((st = bt_bm_seq_append(g->local, seq, n_new, tokens, cow_local)) != BT_OK) {
        bt_bm_seq_truncate(g->global, seq, old);
        return st;
    }
    return BT_OK;
}

bt_status bt_kvg_seq_set_computed(bt_kvg *g, int32_t seq, int32_t n_computed)
{
    bt_status st = bt_bm_seq_set_computed(g->global, seq, n_computed);
    if (st != BT_OK || !g->local) return st;
    if ((st = bt_bm_seq_set_computed(g->local, seq, n_computed)) != BT_OK) return st;
    bt_bm_seq_release_window(g->local, seq, bt_bm_seq_computed(g->local, seq));
    return BT_OK;
}

int32_t bt_kvg_seq_release_window(bt_kvg *g, int32_t seq, int32_t pos)
{
    if (!g->local) return bt_bm_seq_len(g->global, seq) < 0 ? -1 : 0;
    return bt_bm_seq_release_window(g->local, seq, pos);
}

bt_status bt_kvg_seq_truncate(bt_kvg *g, int32_t seq, int32_t n_tokens)
{
    /* the local space refuses first (the released window), so a refusal changes nothing */
    if (g->local) {
        bt_status st = bt_bm_seq_truncate(g->local, seq, n_tokens);
        if (st != BT_OK) return st;
    }
    return bt_bm_seq_truncate(g->global, seq, n_tokens);
}

const int32_t *bt_kvg_seq_table(const bt_kvg *g, int32_t seq, int32_t *n_blocks)
{
    return bt_bm_seq_table(g->global, seq, n_blocks);
}

const int32_t *bt_kvg_seq_local_table(const bt_kvg *g, int32_t seq, int32_t *n_blocks)
{
    if (!g->local) {
        *n_blocks = 0;
        return NULL;
    }
    return bt_bm_seq_table(g->local, seq, n_blocks);
}

int32_t bt_kvg_seq_len(const bt_kvg *g, int32_t seq)
{
    return bt_bm_seq_len(g->global, seq);
}

int32_t bt_kvg_seq_computed(const bt_kvg *g, int32_t seq)
{
    return bt_bm_seq_computed(g->global, seq);
}

int32_t bt_kvg_seq_local_blocks(const bt_kvg *g, int32_t seq)
{
    int32_t n = 0, held = 0;
    const int32_t *t = bt_kvg_seq_local_table(g, seq, &n);
    for (int32_t i = 0; i < n; i++) held += t[i] != BT_BM_NO_BLOCK;
    return held;
}

void bt_kvg_cache_reset(bt_kvg *g)
{
    bt_bm_cache_reset(g->global);
    if (g->local) bt_bm_cache_reset(g->local);
}

bt_status bt_kvg_check(const bt_kvg *g)
{
    bt_status st = bt_bm_check(g->global);
    if (st != BT_OK || !g->local) return st;
    if ((st = bt_bm_check(g->local)) != BT_OK) return st;
    bt_bm_stats sg, sl;
    bt_bm_get_stats(g->global, &sg);
    bt_bm_get_stats(g->local, &sl);
    if (sg.n_seqs != sl.n_seqs)
        return bt_fail(BT_ERR_INTERNAL, "KV spaces: %d global sequences, %d local", sg.n_seqs, sl.n_seqs);
    for (int32_t id = 0, found = 0; found < sg.n_seqs; id++) {
        int32_t len = bt_bm_seq_len(g->global, id);
        if (len < 0) {
            if (bt_bm_seq_len(g->local, id) >= 0)
                return bt_fail(BT_ERR_INTERNAL, "KV spaces: sequence %d is live only in the local space", id);
            if (id > (1 << 24)) return bt_fail(BT_ERR_INTERNAL, "KV spaces: live sequences not found");
            continue;
        }
        found++;
        int32_t done = bt_bm_seq_computed(g->global, id), ng, nl;
        bt_bm_seq_table(g->global, id, &ng);
        const int32_t *lt = bt_bm_seq_table(g->local, id, &nl);
        if (bt_bm_seq_len(g->local, id) != len || bt_bm_seq_computed(g->local, id) != done || nl != ng)
            return bt_fail(BT_ERR_INTERNAL, "KV spaces: sequence %d has length/computed/blocks %d/%d/%d globally, "
                           "%d/%d/%d locally", id, len, done, ng, bt_bm_seq_len(g->local, id),
                           bt_bm_seq_computed(g->local, id), nl);
        int32_t released = 0;
        while (released < nl && lt[released] == BT_BM_NO_BLOCK) released++;
        if (released > bt_kvg_window_first_block(g->cfg.window, done))
            return bt_fail(BT_ERR_INTERNAL, "KV spaces: sequence %d released %d local blocks, but a query at %d "
                           "needs blocks from %d", id, released, done,
                           bt_kvg_window_first_block(g->cfg.window, done));
    }
    return BT_OK;
}
