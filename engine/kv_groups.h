/* KV block spaces per layer group (DESIGN 5.2, sliding-window release): a model whose local (sliding-window)
 * layers see only the last `window` positions keeps their KV in a second block space, so that a sequence holds
 * local-layer blocks only for the positions the next token can still see.
 *
 * The pool is unchanged (engine/kv_pool.h: [layer][n_blocks][stride]). Its block ids are managed twice, by two
 * block managers over the same id range: the global space owns the global layers' stride of every id, the local
 * space owns the local layers' stride of every id. Block b of the global space and block b of the local space are
 * different bytes and belong to different sequences, independently. A sequence has one table per space:
 *   global table  every position (as before);
 *   local table   entries before the window of the next position are BT_BM_NO_BLOCK: released as the sequence
 *                 computes (bt_kvg_seq_set_computed publishes, then releases, so a released full block stays in
 *                 the local prefix cache until evicted).
 * Prefix cache: both spaces publish under the same chained hashes. A cached prefix of k blocks is reused only when
 * the global blocks [0, k) and the local blocks of the window before position 16k, [max(0, (16k - window) / 16),
 * k), are all cached; the longest such k is taken (a shorter prefix is recomputed, never served wrong). A space
 * never publishes a block whose KV was not written (see bt_kvg_seq_release_window for KV that arrives from
 * elsewhere).
 * A model without a window (window 0) has only the global space and behaves exactly as one bt_bm.
 *
 * Sequence ids are the global manager's; the local manager's ids are kept equal (both are created and freed
 * together). Threads and errors as engine/block_manager.h: one engine thread; errors leave every state unchanged. */
#ifndef BATON_ENGINE_KV_GROUPS_H
#define BATON_ENGINE_KV_GROUPS_H

#include <stdint.h>

#include "common/status.h"
#include "engine/block_manager.h"

typedef struct bt_kvg bt_kvg;

typedef struct bt_kvg_config {
    int32_t n_blocks;         /* ids in the pool; both spaces have this many */
    int32_t window;           /* local layers' window in tokens; 0: one space (no local layers or no release) */
    uint64_t fingerprint;
    int disable_prefix_cache;
} bt_kvg_config;

/* BT_ERR_INVALID (bad config), BT_ERR_NOMEM. */
bt_status bt_kvg_create(const bt_kvg_config *cfg, bt_kvg **out);
void bt_kvg_destroy(bt_kvg *g);

/* 1 when the local space exists. */
int bt_kvg_windowed(const bt_kvg *g);

/* The managers (local: NULL without a window), for stats and tests. */
const bt_bm *bt_kvg_global(const bt_kvg *g);
const bt_bm *bt_kvg_local(const bt_kvg *g);

/* 1 when n_global blocks of the global space and n_local of the local one can be allocated now. */
int bt_kvg_can_allocate(const bt_kvg *g, int32_t n_global, int32_t n_local);

bt_status bt_kvg_seq_create(bt_kvg *g, int32_t *seq_out);
void bt_kvg_seq_free(bt_kvg *g, int32_t seq);

/* The prefix bt_kvg_seq_match_prefix would reuse, in blocks (g only for its scratch), and how many of its blocks are now evictable in each
 * space (counted as allocatable by bt_kvg_can_allocate until matched; either pointer may be NULL). Counts nothing. */
int32_t bt_kvg_prefix_probe(bt_kvg *g, const int32_t *tokens, int32_t n_tokens, int32_t *evictable_global,
                            int32_t *evictable_local);

/* Admission of an empty seq: shares the prefix bt_kvg_prefix_probe names (global blocks from 0, local blocks of
 * the window before its end); *n_cached_tokens = 16 * blocks. BT_ERR_INVALID, BT_ERR_NOMEM. */
bt_status bt_kvg_seq_match_prefix(bt_kvg *g, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                  int32_t *n_cached_tokens);

/* Blocks bt_kvg_seq_append(seq, n_new) would take in each space; -1 for an unknown seq. */
int32_t bt_kvg_seq_blocks_needed(const bt_kvg *g, int32_t seq, int32_t n_new, int32_t *n_local);

/* Reserves n_new more positions in both spaces. A copy-on-write is reported per space: cow_global->src >= 0 means
 * copy that block pair in the global layers, cow_local in the local layers. BT_ERR_EXHAUSTED when either space
 * lacks blocks (nothing taken), BT_ERR_INVALID, BT_ERR_NOMEM. On BT_ERR_NOMEM a reported cow_global must still be
 * performed (the sequence then holds its copy). */
bt_status bt_kvg_seq_append(bt_kvg *g, int32_t seq, int32_t n_new, const int32_t *tokens, bt_bm_copy *cow_global,
                            bt_bm_copy *cow_local);

/* KV of [0, n_computed) written: publishes newly full blocks in both spaces, then releases the local blocks that
 * lie wholly before n_computed - window (no later query sees them). BT_ERR_INVALID, BT_ERR_NOMEM. */
bt_status bt_kvg_seq_set_computed(bt_kvg *g, int32_t seq, int32_t n_computed);

/* Releases the local blocks wholly before pos - window without publishing anything: for KV that arrived from
 * another node with only its last window of local-layer positions, call it before bt_kvg_seq_set_computed so that
 * blocks that were never written are not published. Returns the number released, -1 for a bad seq or pos. */
int32_t bt_kvg_seq_release_window(bt_kvg *g, int32_t seq, int32_t pos);

/* Both spaces to n_tokens (speculative rollback). BT_ERR_INVALID as bt_bm_seq_truncate (not into the released
 * window). */
bt_status bt_kvg_seq_truncate(bt_kvg *g, int32_t seq, int32_t n_tokens);

/* The tables (local: NULL without a window) and the counts. */
const int32_t *bt_kvg_seq_table(const bt_kvg *g, int32_t seq, int32_t *n_blocks);
const int32_t *bt_kvg_seq_local_table(const bt_kvg *g, int32_t seq, int32_t *n_blocks);
int32_t bt_kvg_seq_len(const bt_kvg *g, int32_t seq);
int32_t bt_kvg_seq_computed(const bt_kvg *g, int32_t seq);
/* Local blocks seq holds (window-released entries excluded); 0 without a window. */
int32_t bt_kvg_seq_local_blocks(const bt_kvg *g, int32_t seq);

void bt_kvg_cache_reset(bt_kvg *g);

/* Both managers' invariants (bt_bm_check), plus: every live sequence exists in both with the same length, computed
 * count and table length, and no local block that a query at the next position could see was released. */
bt_status bt_kvg_check(const bt_kvg *g);

/* First local table entry a query at pos still needs (entries before it may be released). */
static inline int32_t bt_kvg_window_first_block(int32_t window, int32_t pos)
{
    return window > 0 && pos > window ? (pos - window) / BT_BM_BLOCK : 0;
}

#endif
