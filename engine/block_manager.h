/* The KV block manager and prefix cache (DESIGN 5.2, 5.3): which KV pool block holds which 16 positions of which
 * sequence. It deals in block ids only and never touches KV bytes; the caller copies blocks when told to
 * (copy-on-write) and runs the forward pass over the block tables it hands out.
 *
 * Blocks. Every block id in [0, n_blocks) is in exactly one state:
 *   used    referenced by one or more sequences (refcount > 0; shared by forks and prefix hits);
 *   cached  refcount 0 but holding a full, computed block whose chained hash is in the prefix table: reusable by a
 *           later prompt with the same prefix, evictable in LRU order;
 *   free    refcount 0 and no hash.
 * Allocation takes free blocks first, preferring contiguous runs of ids (fewer transfer descriptors, DESIGN 6):
 * a sequence's table is extended with the id after its last block when that is free, else with the smallest free
 * run that fits, else with the largest runs; only when free blocks run out are cached blocks evicted, least recently
 * released first. A block is never handed out while referenced.
 *
 * Sequences. A sequence is a manager-assigned small id with a block table (slot of position p =
 * table[p / 16] * 16 + p % 16), its token ids, its length (positions reserved) and how many of those are computed
 * (KV written). The scheduler's life cycle for one request:
 *   bt_bm_seq_create                          empty sequence
 *   bt_bm_seq_match_prefix(prompt)            shares the longest cached prefix; those tokens count as computed
 *   per step: bt_bm_seq_blocks_needed / bt_bm_can_allocate, then bt_bm_seq_append(new tokens) to reserve slots
 *             (perform any copy it reports before the forward pass), run the step,
 *             bt_bm_seq_set_computed(len) to publish newly full blocks in the prefix cache
 *   n > 1 samples: bt_bm_seq_fork after the prompt; the first append into a shared partial block copies it
 *   speculative decoding: append the drafts, run, bt_bm_seq_truncate to the accepted length, then set_computed
 *   sliding-window models: bt_bm_seq_release_window(next position) once per step
 *   finish, abort or preemption victim: bt_bm_seq_free (blocks with hashes stay cached for a later recompute)
 * Errors leave every state unchanged: BT_ERR_INVALID (unknown sequence, bad argument), BT_ERR_EXHAUSTED (not enough
 * free + cached blocks: the scheduler preempts a victim with bt_bm_seq_free and retries), BT_ERR_NOMEM.
 *
 * Threads: owned by one engine thread; no function locks or blocks, so callers must not share a bt_bm between
 * threads (other threads see counters through the scheduler's snapshots). Operations cost O(blocks touched),
 * except allocations that miss the contiguous fast path, which scan a bitmap of n_blocks bits. */
#ifndef BATON_ENGINE_BLOCK_MANAGER_H
#define BATON_ENGINE_BLOCK_MANAGER_H

#include <stdint.h>

#include "common/prefix_hash.h"
#include "common/status.h"

#define BT_BM_BLOCK 16      /* tokens per block: BT_KV_BLOCK and BT_PREFIX_HASH_BLOCK */
#define BT_BM_NO_BLOCK (-1) /* table entry of a block released by the sliding window */

typedef struct bt_bm bt_bm;

typedef struct bt_bm_config {
    int32_t n_blocks;        /* blocks in the KV pool (bt_kv_pool.n_blocks); >= 1 */
    int32_t window;          /* sliding-window size in tokens (attention sees the last `window` positions); 0: none */
    uint64_t fingerprint;    /* bt_model.fingerprint, mixed into every block hash */
    int disable_prefix_cache; /* 1: never publish or match hashes (freed blocks go straight to free) */
} bt_bm_config;

/* A block the caller must copy (every layer, K and V) before the next forward pass. */
typedef struct bt_bm_copy {
    int32_t src, dst; /* src = -1: nothing to copy */
} bt_bm_copy;

typedef struct bt_bm_stats {
    int32_t blocks_total;
    int32_t blocks_used;   /* refcount > 0 */
    int32_t blocks_cached; /* refcount 0, hashed, evictable */
    int32_t blocks_free;   /* refcount 0, no hash */
    int32_t blocks_shared; /* refcount > 1 */
    int32_t blocks_hashed; /* entries in the prefix table (used or cached) */
    int32_t n_seqs;
    uint64_t prefix_queries;        /* bt_bm_seq_match_prefix calls */
    uint64_t prefix_query_blocks;   /* full blocks looked up */
    uint64_t prefix_hit_blocks;     /* of those, found in the cache */
    uint64_t prefix_query_tokens;   /* prompt tokens offered */
    uint64_t prefix_hit_tokens;     /* of those, served from the cache */
    uint64_t evictions;             /* cached blocks evicted to satisfy allocations */
    uint64_t cow_copies;            /* copy-on-write copies reported */
} bt_bm_stats;

/* Creates a manager over cfg->n_blocks blocks, all free. The manager keeps its own free lists: do not also call
 * bt_kv_pool_alloc on the pool it manages. BT_ERR_INVALID (n_blocks < 1, window < 0), BT_ERR_NOMEM. */
bt_status bt_bm_create(const bt_bm_config *cfg, bt_bm **out);

/* Frees the manager and every sequence still in it. NULL is a no-op. */
void bt_bm_destroy(bt_bm *bm);

/* 1 when n more blocks can be allocated now (free + cached >= n), else 0. */
int bt_bm_can_allocate(const bt_bm *bm, int32_t n_blocks);

/* New empty sequence; *seq_out receives its id (small, reused after bt_bm_seq_free). BT_ERR_NOMEM. */
bt_status bt_bm_seq_create(bt_bm *bm, int32_t *seq_out);

/* Releases every block of seq (last block first, so a freed sequence's cached tail is evicted before its head)
 * and forgets seq. Blocks still shared stay with their other holders; hashed blocks become cached. Use it to
 * finish, abort or preempt (recompute) a sequence at any time. Unknown ids are ignored. Can't fail. */
void bt_bm_seq_free(bt_bm *bm, int32_t seq);

/* New sequence sharing all of parent's blocks, tokens and computed state (n > 1 samples). No block is allocated;
 * the first append of either into a shared partial block reports a copy. BT_ERR_INVALID, BT_ERR_NOMEM. */
bt_status bt_bm_seq_fork(bt_bm *bm, int32_t parent, int32_t *child_out);

/* Admission: for an empty seq, looks up the longest run of full prompt blocks in the prefix cache and shares
 * them (refcount++; cached ones leave the LRU list). At most (n_tokens - 1) / 16 blocks match, so at least the
 * last prompt token is always computed (its logits are needed). The matched tokens become seq's first tokens,
 * reserved and computed; *n_cached_tokens (a multiple of 16, may be 0) says where prefill starts. Counts one
 * query. Allocates no block, so it never exhausts. BT_ERR_INVALID (seq not empty), BT_ERR_NOMEM. */
bt_status bt_bm_seq_match_prefix(bt_bm *bm, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                 int32_t *n_cached_tokens);

/* Read-only look-ahead for admission control: the number of blocks bt_bm_seq_match_prefix would share for this
 * prompt, and in *n_evictable (may be NULL) how many of those are now cached, i.e. counted as allocatable by
 * bt_bm_can_allocate until matched. Counts nothing. */
int32_t bt_bm_prefix_probe(const bt_bm *bm, const int32_t *tokens, int32_t n_tokens, int32_t *n_evictable);

/* Block-by-block look-up that does not stop at a miss (for a second block space whose early blocks may have been
 * released, engine/kv_groups.h): state[i] for the prompt's first matchable blocks, at most min(max_blocks,
 * (n_tokens - 1) / 16): 0 not cached, 1 cached and held by a sequence, 2 cached and evictable. Returns how many
 * were filled (0 with the prefix cache disabled). Counts nothing. */
int32_t bt_bm_prefix_scan(const bt_bm *bm, const int32_t *tokens, int32_t n_tokens, int32_t max_blocks,
                          uint8_t *state);

/* bt_bm_seq_match_prefix for an explicit range: seq (empty) gets the prompt's first n_match blocks as computed
 * tokens, sharing the cached blocks [first, n_match), each of which must be in the prefix table (see
 * bt_bm_prefix_scan); entries before first are window-released (BT_BM_NO_BLOCK; first > 0 needs a window). Counts
 * one query. BT_ERR_INVALID (bad range, a block not cached, seq not empty), BT_ERR_NOMEM; nothing changes then. */
bt_status bt_bm_seq_match_prefix_range(bt_bm *bm, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                                       int32_t first, int32_t n_match, int32_t *n_cached_tokens);

/* Blocks bt_bm_seq_append(seq, n_new) would allocate, including a copy-on-write block; -1 for an unknown seq. */
int32_t bt_bm_seq_blocks_needed(const bt_bm *bm, int32_t seq, int32_t n_new);

/* Reserves slots for n_new more tokens of seq (tokens[n_new]: their ids, the inputs at positions len..len+n-1),
 * growing its table. Only the block holding position len can already exist; when it is shared, seq gets a private
 * copy and *cow (may be NULL only
 * when the caller knows no copy can be due) receives the (src, dst) pair to copy before the forward pass;
 * otherwise cow->src = -1. At most one copy per call. BT_ERR_EXHAUSTED (nothing taken; see
 * bt_bm_seq_blocks_needed), BT_ERR_INVALID, BT_ERR_NOMEM. */
bt_status bt_bm_seq_append(bt_bm *bm, int32_t seq, int32_t n_new, const int32_t *tokens, bt_bm_copy *cow);

/* Records that the KV of positions [0, n_computed) of seq is written. Each block that becomes full and computed
 * gets its chained hash and, unless a block with that hash is already cached, is published in the prefix table.
 * Call it after the forward pass, never before: a published block may be shared by the next admission.
 * Lowering n_computed is ignored. BT_ERR_INVALID (n_computed > length, unknown seq), BT_ERR_NOMEM. */
bt_status bt_bm_seq_set_computed(bt_bm *bm, int32_t seq, int32_t n_computed);

/* Shrinks seq to its first n_tokens positions (rejected speculative tokens): blocks past the end are released and
 * the computed count is capped. A now-partial last block that is published stays so until the next append writes
 * into it (then it is unpublished when seq holds it alone, copied when shared). BT_ERR_INVALID (n_tokens > length
 * or inside the released window). */
bt_status bt_bm_seq_truncate(bt_bm *bm, int32_t seq, int32_t n_tokens);

/* Sliding window: releases seq's blocks that lie wholly before pos - window, where pos is the next position to be
 * computed (<= length); their table entries become BT_BM_NO_BLOCK. Returns the number released (0 without a
 * window); -1 for an unknown seq or pos out of range. */
int32_t bt_bm_seq_release_window(bt_bm *bm, int32_t seq, int32_t pos);

/* seq's block table ([*n_blocks] ids, BT_BM_NO_BLOCK for window-released entries), the bt_seq_view of the forward
 * pass; valid until the next call that changes seq. *n_blocks = 0 (and possibly NULL) for an empty or unknown seq. */
const int32_t *bt_bm_seq_table(const bt_bm *bm, int32_t seq, int32_t *n_blocks);

/* Positions reserved / computed; -1 for an unknown seq. */
int32_t bt_bm_seq_len(const bt_bm *bm, int32_t seq);
int32_t bt_bm_seq_computed(const bt_bm *bm, int32_t seq);

/* Drops every hash from the prefix table: cached blocks become free, used blocks stay used. For cold-run
 * comparisons and tests. Can't fail. */
void bt_bm_cache_reset(bt_bm *bm);

/* Counters for metrics (DESIGN 10). Can't fail. */
void bt_bm_get_stats(const bt_bm *bm, bt_bm_stats *st);

/* Number of maximal runs of consecutive ids in ids[n] (each one transfer descriptor per layer); entries of
 * BT_BM_NO_BLOCK are skipped. */
int32_t bt_bm_count_runs(const int32_t *ids, int32_t n);

/* Checks every internal invariant (refcounts against the tables, the free bitmap, the LRU list, the prefix
 * table, the counters). BT_OK, or BT_ERR_INTERNAL with the first violation in bt_last_error(). O(n_blocks +
 * total table length); meant for tests and debug builds. */
bt_status bt_bm_check(const bt_bm *bm);

#endif
