/* kvtransfer (libbaton_kvx): moves paged KV blocks from one process's pool into another's over UCX.
 *
 * Roles: the sender (a prefill node) pushes; the receiver (a decode node) registers an expectation for the
 * blocks it handed out, under an epoch, and learns by an active message sent after the sender's flush that they
 * arrived. On the one-sided paths (MAPPED, PUT) the sender first claims the epoch and block list and writes
 * nothing until the receiver confirms them. Epochs are random 64-bit values: only the sender that was told one can
 * claim or complete it. The receiver checks the epoch, the block list and (optionally) a crc32c per block, ends the
 * expectation and answers; the sender's push completes only with that answer. So a dead, stale or unhappy
 * receiver always surfaces as an error status on the sender within the push's deadline, and a dead sender ends
 * the receiver's expectation (at once when the expectation names the sender's peer, else at its deadline).
 *
 * Deadlines: a push that misses its deadline closes the endpoint to that peer (no byte of it can land later).
 * Give the receiver's expectation a deadline >= the sender's push deadline before reusing its blocks.
 *
 * Threads: each kvx_context_t runs one progress thread that owns the UCX worker's progress (worker event fd +
 * ucp_worker_arm). Every kvx_* function is thread-safe unless it says otherwise. Completion callbacks run on the
 * progress thread with no kvx lock held: they may call any kvx function except kvx_context_destroy and the
 * *_wait functions, and must not block for long.
 *
 * Layout (DESIGN 5.1): one contiguous pool per node, layer-major:
 *   offset(layer, block) = (layer * n_blocks + block) * block_stride
 * so a run of consecutive block ids is one contiguous byte range in every layer.
 *
 * Transports come from UCX_TLS (tcp, sm, rc, ...). Shared memory with peer-failure detection needs
 * UCX_POSIX_ERROR_HANDLING=y and UCX_SYSV_ERROR_HANDLING=y; kvx_context_create sets them (UCX_MM_ERROR_HANDLING)
 * and a 200 ms UCX keepalive unless the environment names them. */
#ifndef BATON_KVTRANSFER_KVX_H
#define BATON_KVTRANSFER_KVX_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* ---- layout ------------------------------------------------------------------------------------------ */

typedef struct kvx_layout {
    uint32_t n_layers;
    uint32_t n_blocks;     /* blocks per layer in this pool (may differ between sender and receiver) */
    uint64_t block_stride; /* bytes of one block in one layer: K then V */
    uint64_t fingerprint;  /* caller's digest of dtype, block size, heads, head_dim, layers and model */
} kvx_layout_t;

/* Checks that the layout is non-empty and its size fits in 64 bits (and in size_t); stores the pool size in
 * bytes in *bytes when bytes is not NULL. BT_ERR_INVALID with a message otherwise. */
bt_status kvx_layout_check(const kvx_layout_t *layout, uint64_t *bytes);

/* BT_OK when blocks can move from `local` into `remote`: same layer count, block stride and fingerprint.
 * Otherwise BT_ERR_INVALID with a message naming the first field that differs. */
bt_status kvx_layout_compatible(const kvx_layout_t *local, const kvx_layout_t *remote);

/* Byte offset of (layer, block); the caller guarantees both are in range. */
static inline uint64_t kvx_layout_offset(const kvx_layout_t *l, uint32_t layer, uint32_t block)
{
    return ((uint64_t)layer * l->n_blocks + block) * l->block_stride;
}

/* ---- plan: which byte ranges move, per layer --------------------------------------------------------- */

/* A run of n_blocks consecutive source blocks that lands on n_blocks consecutive destination blocks. */
typedef struct kvx_run {
    uint32_t src_block;
    uint32_t dst_block;
    uint32_t n_blocks;
} kvx_run_t;

typedef struct kvx_range {
    uint64_t local_off;  /* from the sender's pool base */
    uint64_t remote_off; /* from the receiver's pool base */
    uint64_t len;
} kvx_range_t;

typedef struct kvx_plan {
    kvx_layout_t local, remote;
    size_t n_blocks; /* blocks moved */
    size_t n_runs;   /* puts per layer */
    kvx_run_t *runs; /* [n_runs], in the order of the block lists */
} kvx_plan_t;

/* Most blocks one transfer may carry. */
#define KVX_MAX_BLOCKS 65536u

/* Builds the plan that moves src_blocks[i] to dst_blocks[i] for i < n, coalescing runs where both sides are
 * consecutive. Refuses (BT_ERR_INVALID, nothing allocated) incompatible layouts, n == 0 or > KVX_MAX_BLOCKS,
 * ids out of range on either side and a destination block named twice. Fills *out on success only;
 * BT_ERR_NOMEM on allocation failure. Does not block. */
bt_status kvx_plan_build(const kvx_layout_t *local, const kvx_layout_t *remote, const uint32_t *src_blocks,
                         const uint32_t *dst_blocks, size_t n, kvx_plan_t *out);

/* The byte ranges of run `run` in layer `layer` (both in range). Can't fail. */
kvx_range_t kvx_plan_range(const kvx_plan_t *plan, uint32_t layer, size_t run);

/* Frees the runs; the plan may be freed twice or zero-initialised. */
void kvx_plan_free(kvx_plan_t *plan);

/* ---- context ----------------------------------------------------------------------------------------- */

typedef struct kvx_context kvx_context_t;
typedef struct kvx_pool kvx_pool_t;
typedef struct kvx_peer kvx_peer_t;
typedef struct kvx_push kvx_push_t;
typedef struct kvx_expect kvx_expect_t;

/* How a push moves bytes to a peer (chosen per peer when it connects).
 * MAPPED: the remote pool is mapped into this process (shared memory: ucp_rkey_ptr works): plain memcpy, truly
 *   one-sided. PUT: ucp_put_nbx (native RDMA: rc, dc, cuda_ipc). AM: eager active messages that the receiver
 *   copies into its pool after checking epoch and block ownership (tcp: UCX 1.13 emulates put over tcp with
 *   target-side replies that abort the target process when the initiator dies mid-transfer, so puts are avoided).
 * AUTO picks MAPPED when possible, else AM; set PUT (or BATON_KVX_DATA_PATH=put) on RDMA fabrics. */
typedef enum kvx_data_path {
    KVX_PATH_AUTO = 0,
    KVX_PATH_MAPPED,
    KVX_PATH_PUT,
    KVX_PATH_AM,
} kvx_data_path_t;

typedef struct kvx_context_opts {
    const char *name;           /* for logs and the UCX worker name; NULL = "kvx" */
    uint32_t keepalive_ms;      /* UCX keepalive (peer death on idle shared memory); 0 = 200 ms */
    kvx_data_path_t data_path;  /* AUTO: MAPPED where possible, else AM (kvx_context_opts_from_env: the variable) */
    uint32_t max_peers;         /* cached peers at most (LRU: the least recently used idle one is closed when a new
                                 * one is needed); 0 = KVX_DEFAULT_MAX_PEERS */
} kvx_context_opts_t;

#define KVX_DEFAULT_MAX_PEERS 128 /* node ids come from requests: bounded so that made-up ids cannot grow it */

/* The edge only: when o->data_path is AUTO, sets it from BATON_KVX_DATA_PATH=auto|mapped|put|am (unset or empty:
 * AUTO). BT_ERR_INVALID naming the variable for any other value (o unchanged). Can't block. */
bt_status kvx_context_opts_from_env(kvx_context_opts_t *o);

/* Creates the UCX context and worker and starts the progress thread. opts may be NULL. Of the environment only UCX's
 * own UCX_* variables count (UCX reads them; where one is set, the defaults chosen here yield to it).
 * BT_ERR_UNAVAILABLE when UCX cannot start (no transport, bad UCX_TLS); *out set on success only. */
bt_status kvx_context_create(const kvx_context_opts_t *opts, kvx_context_t **out);

/* Stops the progress thread and releases everything the context still holds (peers, pools, pushes and
 * expectations are force-closed; no callback runs after this starts). Pools and handles of this context must
 * not be used afterwards. NULL is a no-op. Blocks until UCX has closed its endpoints (bounded). */
void kvx_context_destroy(kvx_context_t *ctx);

/* Live object and traffic counters (for metrics and leak tests). */
typedef struct kvx_stats {
    uint64_t pushes_ok, pushes_failed;
    uint64_t expects_ok, expects_failed;
    uint64_t stale_completions; /* completions whose epoch no expectation held */
    uint64_t crc_mismatches;
    uint64_t dropped_writes;    /* AM data for no pending epoch or outside its blocks: not written */
    uint64_t puts;              /* ranges posted (copies, puts or data messages, whatever the data path) */
    uint64_t am_data_received;  /* data messages received: nonzero only where a sender used the AM data path */
    uint64_t bytes_pushed;
    uint64_t peers_built;
    uint64_t peers_evicted;     /* idle peers closed to keep the cache within max_peers */
    uint32_t live_peers, live_eps, live_rkeys, live_pushes, live_expects, live_requests;
} kvx_stats_t;

/* Copies the counters. Can't fail. */
void kvx_context_stats(kvx_context_t *ctx, kvx_stats_t *out);

/* ---- pool -------------------------------------------------------------------------------------------- */

/* Allocates and registers a pool of kvx_layout_check() bytes with UCP_MEM_MAP_ALLOCATE (shared-memory puts
 * are then one-sided) and packs its descriptor. BT_ERR_INVALID for a bad layout, BT_ERR_NOMEM / BT_ERR_IO when
 * UCX cannot map it. The memory is zero-filled; the pool belongs to ctx. */
bt_status kvx_pool_create(kvx_context_t *ctx, const kvx_layout_t *layout, kvx_pool_t **out);

/* Where a pool's memory lives. */
typedef enum kvx_mem_type {
    KVX_MEM_HOST = 0,
    KVX_MEM_CUDA = 1, /* device memory (cudaMalloc): UCS_MEMORY_TYPE_CUDA, moved by cuda_ipc, gdr_copy, or rc with
                       * GPUDirect RDMA */
} kvx_mem_type_t;

/* Registers existing memory of kvx_layout_check() bytes at mem (of type mt) as a pool and packs its descriptor; the
 * caller keeps the memory, which must outlive the pool, and its contents are left as they are. A CUDA pool is only
 * read and written by the transport: pushes from it need the put path (else BT_ERR_UNSUPPORTED) and carry no
 * checksums, and data messages into it are dropped. BT_ERR_INVALID for a
 * bad layout or a NULL mem; BT_ERR_UNSUPPORTED when this UCX cannot register that memory type (a UCX built without
 * CUDA support, as Debian's is: `ucx_info -d` lists no cuda_copy / cuda_ipc / gdr_copy transport); BT_ERR_NOMEM /
 * BT_ERR_IO otherwise. The pool belongs to ctx. */
bt_status kvx_pool_register(kvx_context_t *ctx, const kvx_layout_t *layout, void *mem, kvx_mem_type_t mt,
                            kvx_pool_t **out);

/* Unregisters the pool. Pushes from it and expectations into it must be destroyed first; UCX requests of
 * destroyed pushes are waited for (up to 5 s, blocking), then BT_ERR_INVALID and nothing is freed.
 * NULL is a no-op returning BT_OK. */
bt_status kvx_pool_destroy(kvx_pool_t *pool);

/* Base address of the pool's memory, valid until kvx_pool_destroy. */
void *kvx_pool_base(const kvx_pool_t *pool);
const kvx_layout_t *kvx_pool_layout(const kvx_pool_t *pool);

/* The pool's exported descriptor (worker address, base, rkey, layout) as bytes for etcd or a protobuf field.
 * Owned by the pool. Can't fail. */
const void *kvx_pool_descriptor(const kvx_pool_t *pool, size_t *len);

/* Blocks currently held by pending expectations on this pool (0 when every expectation has ended). */
size_t kvx_pool_blocks_pending(const kvx_pool_t *pool);

/* Parsed view of a descriptor; pointers point into the parsed bytes. */
typedef struct kvx_desc {
    kvx_layout_t layout;
    uint64_t instance; /* random per context: a restarted node gets a new one */
    uint64_t base;     /* remote virtual address of the pool */
    uint64_t len;
    const void *worker_addr;
    size_t worker_addr_len;
    const void *rkey;
    size_t rkey_len;
} kvx_desc_t;

/* Parses and validates a descriptor: magic, version, every length, the layout and a crc32c over all bytes.
 * BT_ERR_FORMAT (with the reason) for truncated, oversized or garbled input. Does not allocate. */
bt_status kvx_desc_parse(const void *bytes, size_t len, kvx_desc_t *out);

/* ---- peer -------------------------------------------------------------------------------------------- */

/* Returns the cached peer for node_id, or connects one (endpoint in PEER error mode + unpacked rkey) from
 * the descriptor when none is cached, the cached one failed, or the descriptor changed. The caller owns one
 * reference: kvx_peer_release(). BT_ERR_FORMAT for a bad descriptor, BT_ERR_PEER when UCX cannot connect.
 * Does not wait for the connection. */
bt_status kvx_peer_get(kvx_context_t *ctx, uint64_t node_id, const void *desc, size_t desc_len, kvx_peer_t **out);

/* Drops a reference. NULL is a no-op. */
void kvx_peer_release(kvx_peer_t *peer);

/* The node left (etcd delete, shutdown): drops its cached peer, closes the endpoint and unmaps its pool.
 * Pushes still running to it end with BT_ERR_CANCELLED. Returns BT_ERR_NOT_FOUND when nothing was cached. */
bt_status kvx_peer_forget(kvx_context_t *ctx, uint64_t node_id);

/* BT_OK while usable, BT_ERR_PEER once UCX reported the remote dead or a push to it timed out. */
bt_status kvx_peer_status(const kvx_peer_t *peer);

/* The remote pool's layout from its descriptor. */
const kvx_layout_t *kvx_peer_layout(const kvx_peer_t *peer);

/* The data path pushes to this peer use (never KVX_PATH_AUTO). */
kvx_data_path_t kvx_peer_data_path(const kvx_peer_t *peer);
const char *kvx_data_path_name(kvx_data_path_t path);

/* ---- push (sender) ----------------------------------------------------------------------------------- */

enum {
    KVX_F_CRC = 1u << 0, /* push: send a crc32c per block; expect: require and verify them */
};

/* Completion: exactly once per push or expectation unless it was destroyed first. st is BT_OK, or
 * BT_ERR_TIMEOUT (deadline), BT_ERR_PEER (remote died), BT_ERR_STALE (receiver no longer holds the epoch),
 * BT_ERR_FORMAT (checksum or block list mismatch), BT_ERR_CANCELLED. */
typedef void (*kvx_push_cb)(kvx_push_t *push, bt_status st, void *arg);

typedef struct kvx_push_args {
    const uint32_t *src_blocks; /* [n_blocks] in the local pool */
    const uint32_t *dst_blocks; /* [n_blocks] in the remote pool, as the receiver handed them out */
    size_t n_blocks;
    uint64_t epoch;      /* the receiver's epoch for these blocks */
    uint32_t flags;      /* KVX_F_CRC */
    uint32_t timeout_ms; /* deadline from creation; 0 = 30 s */
    kvx_push_cb cb;      /* optional */
    void *cb_arg;
    /* Optional (layer_group NULL: every layer moves the lists above). A model whose sliding-window layers have their
     * own block space: each layer l with layer_group[l] != 0 moves local_src_blocks[i] -> local_dst_blocks[i]
     * instead (n_local_blocks >= 1), the others move the lists above. The receiver's expectation must name the
     * same map and lists. */
    const uint8_t *layer_group; /* [n_layers] */
    const uint32_t *local_src_blocks, *local_dst_blocks;
    size_t n_local_blocks;
} kvx_push_args_t;

/* Validates and plans a push of `pool`'s blocks into `peer`'s pool. Layout mismatch, out-of-range or
 * duplicate ids: BT_ERR_INVALID before any byte moves; a failed peer: BT_ERR_PEER. Nothing is posted yet.
 * The caller owns the push: kvx_push_destroy(). The peer must belong to the pool's context. */
bt_status kvx_push_create(kvx_pool_t *pool, kvx_peer_t *peer, const kvx_push_args_t *args, kvx_push_t **out);

/* Posts the puts of one layer (call when the layer's KV is computed; any order, each layer once). After the
 * last layer the push flushes, notifies the receiver and waits for its acknowledgement. Returns BT_OK, or the
 * push's failure status once it has failed (stop computing for it), BT_ERR_INVALID for a bad or repeated layer.
 * Does not wait for the network (on the MAPPED path it does the copies itself). Not thread-safe for one push. */
bt_status kvx_push_layer(kvx_push_t *push, uint32_t layer);

/* Posts every layer not yet posted. */
bt_status kvx_push_all(kvx_push_t *push);

/* Blocks until the push completes and its callback has returned; returns its status. Not from a callback. */
bt_status kvx_push_wait(kvx_push_t *push);

/* Nanoseconds from creation to completion (or to now while running): for baton_kv_transfer_seconds. */
uint64_t kvx_push_elapsed_ns(const kvx_push_t *push);

/* Bytes the push moves in all: each layer's list's blocks times the block stride. Can't fail. */
uint64_t kvx_push_bytes(const kvx_push_t *push);

/* Contiguous ranges posted so far, one put (or copy, or message) each: plan runs x layers posted. */
size_t kvx_push_puts(const kvx_push_t *push);
const kvx_plan_t *kvx_push_plan(const kvx_push_t *push);

/* The failure reason once failed ("" otherwise); valid until destroy. */
const char *kvx_push_error(const kvx_push_t *push);

/* Releases the push. If it is still running it is cancelled: its callback is dropped and no completion
 * message is sent (the receiver's expectation stays pending until it is destroyed or times out); puts already
 * posted may still land on the PUT and MAPPED paths. Blocks while its callback runs on another thread.
 * NULL is a no-op. */
void kvx_push_destroy(kvx_push_t *push);

/* ---- expectation (receiver) -------------------------------------------------------------------------- */

typedef void (*kvx_expect_cb)(kvx_expect_t *expect, bt_status st, void *arg);

typedef struct kvx_expect_args {
    const uint32_t *blocks; /* [n_blocks] destination blocks in this pool, in the sender's dst order */
    size_t n_blocks;
    uint64_t epoch;      /* 0 = a fresh random epoch (read it with kvx_expect_epoch); hand it only to the sender */
    uint32_t flags;      /* KVX_F_CRC: require per-block checksums and verify them */
    uint32_t timeout_ms; /* deadline from creation; 0 = 30 s */
    kvx_peer_t *sender;  /* optional: the sender's peer; its death ends the expectation with BT_ERR_PEER */
    kvx_expect_cb cb;    /* optional */
    void *cb_arg;
    /* Optional, as in kvx_push_args_t: layers with layer_group[l] != 0 receive local_blocks (n_local_blocks >= 1,
     * in the sender's order) instead of blocks. Both lists count as pending. */
    const uint8_t *layer_group; /* [n_layers] */
    const uint32_t *local_blocks;
    size_t n_local_blocks;
} kvx_expect_args_t;

/* Registers that blocks of `pool` will be written under an epoch. BT_ERR_INVALID for ids out of range, n == 0,
 * duplicate ids or an epoch already pending. The blocks count as pending until the expectation ends (success,
 * error, deadline or destroy). The caller owns it: kvx_expect_destroy(). */
bt_status kvx_expect_create(kvx_pool_t *pool, const kvx_expect_args_t *args, kvx_expect_t **out);

uint64_t kvx_expect_epoch(const kvx_expect_t *expect);

/* Blocks until the expectation ends and its callback has returned; returns its status. Not from a callback. */
bt_status kvx_expect_wait(kvx_expect_t *expect);

/* For a receiver that told the sender to stop (it cancelled the call that asked for the bytes): returns once no
 * byte of this epoch can land any more. Unclaimed (no sender asked to write one-sidedly; AM data is checked on
 * arrival): ends the expectation at once, as destroy would, and returns BT_OK; a later claim is refused and late
 * data dropped. Claimed (MAPPED or PUT path: the sender may be writing): waits for the expectation to end by itself
 * (the sender's completion message, the sender's death, or its deadline) and returns BT_OK, or BT_ERR_TIMEOUT when
 * it is still pending after timeout_ms (writes may still land). Blocks; not from a callback. Call destroy after. */
bt_status kvx_expect_settle(kvx_expect_t *expect, uint32_t timeout_ms);

/* The failure reason once failed ("" otherwise); valid until destroy. */
const char *kvx_expect_error(const kvx_expect_t *expect);

/* Ends the expectation if pending (its epoch becomes stale: a later completion for it is ignored and the
 * sender gets BT_ERR_STALE; no callback) and frees it. NULL is a no-op. */
void kvx_expect_destroy(kvx_expect_t *expect);

#endif
