/* Private to libbaton_kvx: object layouts and the locking rules shared by its files.
 *
 * Locking: ctx->mu guards every field below and every UCX call. The progress thread holds it while it calls
 * ucp_worker_progress, so every UCX callback (request completion, endpoint error, active message) runs with
 * ctx->mu held and must not take it. User callbacks run on the progress thread with ctx->mu released. */
#ifndef BATON_KVTRANSFER_KVX_INTERNAL_H
#define BATON_KVTRANSFER_KVX_INTERNAL_H

#include <pthread.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "common/list.h"
#include "kvtransfer/kvx.h"

#define KVX_DEFAULT_TIMEOUT_MS 30000u
#define KVX_AM_DONE 0x4b01u /* sender -> receiver after the flush: epoch, block list digest, checksums */
#define KVX_AM_ACK 0x4b02u  /* receiver -> sender: the verdict */
#define KVX_AM_DATA 0x4b03u /* sender -> receiver on the AM data path: one range of one layer */
#define KVX_AM_CLAIM 0x4b04u /* sender -> receiver before any byte moves one-sidedly: epoch and block list */
#define KVX_DONE_AM 0x100u  /* DONE flag: the data came as KVX_AM_DATA (receiver counts the bytes) */
#define KVX_ERRLEN 200

/* An object waiting for its user callback; holds a reference on it. */
typedef struct kvx_notify {
    struct kvx_notify *next;
    int kind;    /* KVX_OBJ_PUSH or KVX_OBJ_EXPECT */
    int pending; /* queued or running: *_wait() returns only after the callback */
} kvx_notify_t;

enum { KVX_OBJ_PUSH = 1, KVX_OBJ_EXPECT = 2 };

/* An endpoint close that UCX has not finished yet; keeps its peer alive until then. */
typedef struct kvx_closing {
    struct kvx_closing *next;
    void *req;
    kvx_peer_t *peer;
} kvx_closing_t;

struct kvx_context {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* broadcast when anything ends or a user callback returns */
    pthread_t thread;
    int thread_started;
    int stopping;
    int sleeping; /* progress thread is in poll(): writers must kick wake_fd */
    int wake_fd;
    int efd;
    char name[64];
    uint32_t keepalive_ms;
    kvx_data_path_t data_path;

    ucp_context_h ucp;
    ucp_worker_h worker;
    ucp_address_t *worker_addr;
    size_t worker_addr_len;
    uint64_t instance;
    uint64_t next_push_id;

    kvx_pool_t *pools;
    kvx_peer_t *peers; /* cache: healthy peers only, most recently used first */
    uint32_t n_peers, max_peers;
    kvx_peer_t *dead;  /* failed peers whose endpoint still has to be closed */
    bt_list pushes;  /* kvx_push_t by link */
    bt_list expects; /* kvx_expect_t by link */
    kvx_notify_t *notify_head, *notify_tail;
    kvx_closing_t *closing;
    const void *cb_running; /* object whose user callback is running now */

    kvx_stats_t stats;
};

struct kvx_pool {
    kvx_context_t *ctx;
    kvx_pool_t *next;
    kvx_layout_t layout;
    uint64_t bytes;
    ucp_mem_h memh;
    void *base;
    kvx_mem_type_t mem_type; /* KVX_MEM_CUDA: only RMA puts touch it (no host copies, no checksums read here) */
    uint8_t *desc;
    size_t desc_len;
    size_t pending_blocks;
    int users; /* pushes and expectations alive on it */
};

struct kvx_peer {
    kvx_context_t *ctx;
    kvx_peer_t *next; /* in ctx->peers or ctx->dead */
    int refs;
    int cached;
    int failed;
    int close_posted;
    uint64_t node_id;
    uint8_t *desc; /* copy; d points into it */
    size_t desc_len;
    kvx_desc_t d;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    kvx_data_path_t path;
    uint8_t *mapped; /* KVX_PATH_MAPPED: the remote pool in our address space */
    int copying;     /* memcpy into `mapped` in progress without mu: the rkey must stay */
    char err[KVX_ERRLEN];
};

/* CLAIMING: MAPPED and PUT pushes wait for the receiver to confirm that it holds the epoch for exactly these
 * blocks before any byte is written (AM pushes skip it: the receiver checks every data message). */
enum { KVX_PUSH_CLAIMING = 0, KVX_PUSH_POSTING, KVX_PUSH_FLUSHING, KVX_PUSH_ACKING, KVX_PUSH_DONE };

/* One block list of a push: the plan that moves it, its destination ids and their checksums. Zeroed: no list. */
typedef struct kvx_push_list {
    kvx_plan_t plan;
    uint32_t *dst_blocks; /* [plan.n_blocks] copy, for the block-list digest */
    uint32_t *crcs;       /* [n_layers][plan.n_blocks] per-layer block checksums when KVX_F_CRC */
} kvx_push_list_t;

/* One block list of an expectation. Zeroed: no list. */
typedef struct kvx_expect_list {
    uint32_t *blocks; /* [n] in the sender's order */
    uint32_t *sorted; /* [n] ascending (AM data ownership checks) */
    size_t n;
} kvx_expect_list_t;

struct kvx_push {
    kvx_context_t *ctx;
    bt_list_node link; /* in ctx->pushes */
    kvx_notify_t notify;
    int refs; /* user + outstanding UCX requests with callbacks + notify queue */
    int user_gone;
    int state;
    bt_status status;
    uint64_t id;
    uint64_t epoch;
    uint32_t flags;
    uint64_t deadline_ms;
    uint64_t start_ns;
    uint64_t end_ns;
    kvx_pool_t *pool;
    kvx_peer_t *peer;
    /* lists[1] moves the layers marked in layer_group (sliding-window layers with their own block space), lists[0]
     * the others; layer_group NULL: every layer moves lists[0] and lists[1] is zeroed */
    kvx_push_list_t lists[2];
    uint8_t *layer_group; /* [n_layers] 1: the layer moves lists[1] */
    uint8_t *layer_done;  /* [n_layers] */
    uint32_t layers_posted;
    uint32_t digest;      /* of the destination lists and the layer map: CLAIM and DONE carry it */
    uint8_t *am_hdrs;     /* AM path: [n_layers][n_runs] data headers, alive until the push is freed */
    uint8_t *msg;         /* DONE message, alive until the push is freed */
    uint8_t claim[32];    /* CLAIM message, alive until the push is freed */
    size_t msg_len;
    size_t puts;
    int64_t test_flip_layer; /* test hook: >= 0 flips a bit of the first source block of that layer after its
                                checksum is taken, to simulate corruption in flight; -1 otherwise */
    kvx_push_cb cb;
    void *cb_arg;
    char err[KVX_ERRLEN];
};

struct kvx_expect {
    kvx_context_t *ctx;
    bt_list_node link; /* in ctx->expects */
    kvx_notify_t notify;
    int refs; /* user + notify queue */
    int done;
    bt_status status;
    uint64_t epoch;
    uint32_t flags;
    uint64_t deadline_ms;
    kvx_pool_t *pool;
    kvx_peer_t *sender;
    kvx_expect_list_t lists[2]; /* as a push's: lists[1] for the layers in layer_group, else zeroed */
    uint8_t *layer_group;       /* [n_layers] 1: the layer's blocks are lists[1]'s (NULL: all are lists[0]'s) */
    uint32_t blocks_crc;        /* kvx_lists_digest of the lists and the layer map */
    uint64_t bytes_received; /* AM data path */
    int claimed;             /* a sender claimed the epoch (one sender per expectation) */
    kvx_expect_cb cb;
    void *cb_arg;
    char err[KVX_ERRLEN];
};

uint64_t kvx_now_ms(void);
uint64_t kvx_now_ns(void);

/* Wakes the progress thread if it sleeps (call with mu held). */
void kvx_kick(kvx_context_t *ctx);

/* Queues obj's user callback (takes a reference) and wakes waiters. mu held. */
void kvx_notify_push(kvx_context_t *ctx, kvx_notify_t *n);

/* Ends a push / expectation with a status and message (first call wins). mu held. */
void kvx_push_finish(kvx_push_t *p, bt_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void kvx_expect_finish(kvx_expect_t *e, bt_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void kvx_push_unref(kvx_push_t *p);
void kvx_expect_unref(kvx_expect_t *e);

/* Marks a peer failed: fails its pushes and the expectations bound to it, drops it from the cache and queues
 * its endpoint for a forced close by the progress thread. mu held; safe inside UCX callbacks. */
void kvx_peer_fail(kvx_peer_t *peer, bt_status st, const char *why);
void kvx_peer_unref(kvx_peer_t *peer);

/* Progress-thread housekeeping: closes failed peers' endpoints, reaps finished closes. mu held. */
void kvx_peers_reap(kvx_context_t *ctx);

/* Deadline sweep; returns ms until the next deadline (UINT64_MAX when none). mu held. */
uint64_t kvx_deadlines(kvx_context_t *ctx, uint64_t now_ms);

/* Active message handlers registered by the context. */
/* 64 bits from the kernel's CSPRNG, never 0. Epochs come from it: a receiver's epoch is a capability that only
 * the sender it was handed to knows, so nobody else can claim or complete it. */
uint64_t kvx_random_u64(void);

ucs_status_t kvx_am_claim_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param);
ucs_status_t kvx_am_done_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param);
ucs_status_t kvx_am_data_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param);
ucs_status_t kvx_am_ack_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                           const ucp_am_recv_param_t *param);

/* Little-endian field access for the wire formats. */
static inline void kvx_put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kvx_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvx_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t kvx_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvx_get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t kvx_get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* crc32c of a block id list as little-endian u32s. */
uint32_t kvx_blocks_digest(const uint32_t *blocks, size_t n);
/* Digest of a transfer's destination lists: kvx_blocks_digest(blocks, n) without a layer map, else that chained
 * with the second list and the map. */
uint32_t kvx_lists_digest(const uint32_t *blocks, size_t n, const uint32_t *lblocks, size_t nl,
                          const uint8_t *layer_group, uint32_t n_layers);

#endif
