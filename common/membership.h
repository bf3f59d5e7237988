/* Cluster membership in etcd (DESIGN 8).
 *
 * Keys: /baton/<cluster>/nodes/<node_id> holds a NodeInfo JSON and /baton/<cluster>/load/<node_id> a LoadReport
 * JSON, both under the node's lease. A node keeps one mbr_registration_t: a background thread grants the lease
 * (TTL 5 s by default), renews it every TTL/3, writes load reports at most 4 times a second and at least once a
 * heartbeat (1 s) even when nothing changed, so that a report's age tells a frozen node from an idle one; notices
 * a lost lease (keepalive answered without a TTL) and registers again at once with a new lease; while etcd does not
 * answer it retries every 0.25-1 s (jittered), without ever giving up, so that it is back within about a second of
 * etcd answering (a long backoff would leave it out of routing for that long after every etcd outage).
 * The router keeps one mbr_watcher_t: it reads the prefix once, then watches it, holds the view of every node in
 * memory, calls join/update/leave callbacks, and keeps its last view while etcd is unreachable. With a rejoin
 * grace set, it also probes etcd twice a second and, when a node's lease vanishes while etcd is coming back from
 * an outage (every lease of the cluster expires together then), keeps that node in the view for the grace period
 * instead of dropping it, since the node re-registers within about a second. */
#ifndef BATON_COMMON_MEMBERSHIP_H
#define BATON_COMMON_MEMBERSHIP_H

#include "common/etcd.h"
#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define MBR_DEFAULT_CLUSTER "default"
#define MBR_DEFAULT_TTL_S 5
#define MBR_LOAD_MIN_INTERVAL_MS 250 /* at most 4 load writes per second per node */
#define MBR_LOAD_REFRESH_MS 1000     /* small load changes are coalesced into one write per second */
#define MBR_BACKOFF_MAX_MS 1000     /* retry period cap while etcd does not answer (jittered) */
#define MBR_LOAD_HEARTBEAT_MS 1000  /* an unchanged load report is written again this often */
#define MBR_PROBE_MS 500            /* the watcher's etcd probe period (with a rejoin grace set) */
#define MBR_NODE_ID_MAX 64
#define MBR_KEY_MAX 256

typedef enum mbr_role {
    MBR_ROLE_UNKNOWN = 0,
    MBR_ROLE_PREFILL = 1,
    MBR_ROLE_DECODE = 2,
} mbr_role;

/* "prefill", "decode", or "unknown". */
const char *mbr_role_name(mbr_role role);

/* What a node publishes about itself; changes only when the node restarts or reconfigures. */
typedef struct mbr_node_info {
    char node_id[MBR_NODE_ID_MAX]; /* letters, digits, '.', '_', '-'; unique in the cluster */
    mbr_role role;
    char model[128];               /* model fingerprint: nodes serving different weights never pair */
    char grpc_addr[128];           /* host:port of the node's gRPC server */
    char http_addr[128];           /* host:port of /health and /metrics */
    uint8_t *ucx_desc;             /* opaque kvtransfer descriptor (UCX worker address, pool, rkey); owned */
    size_t ucx_desc_len;
    int64_t kv_blocks_total;       /* capacity: KV pool size in blocks */
    int64_t kv_block_tokens;       /* tokens per KV block */
    int64_t max_running;           /* most sequences in one batch */
    int64_t max_context;           /* tokens */
    char version[32];              /* baton version string */
    int64_t started_ms;            /* wall-clock start time in ms: tells a restarted node from the old one */
} mbr_node_info_t;

/* A node's current load, published often. */
typedef struct mbr_load_report {
    int64_t queued_requests;
    int64_t queued_prefill_tokens;
    int64_t running_seqs;
    int64_t kv_blocks_free;
    int64_t kv_blocks_total;
    double prefill_tok_s; /* measured prefill rate, tokens per second */
    double decode_tok_s;  /* measured decode rate, tokens per second (all sequences) */
    double kv_transfer_bytes_s; /* measured KV push bandwidth of a prefill node, bytes per second (0 = unknown) */
    double step_s;        /* mean engine step time in seconds while busy (0 = unknown) */
    double tokens_per_step; /* tokens a decoding sequence gains per step: 1 without speculative decoding, more with
                             * it (0 = unknown, read as 1) */
    /* The node's fitted step model (issue 22): an engine step of n tokens takes step_fixed_s + n * step_token_s,
     * fitted by the node's scheduler over its own recent steps (0 = not fitted yet); decode_fixed_s and
     * decode_row_s are the same fit over steps of decode rows only. The planner's profile when it has no file. */
    double step_fixed_s, step_token_s, decode_fixed_s, decode_row_s;
    int64_t timestamp_ms; /* wall clock when measured; set by the publisher when 0 */
} mbr_load_report_t;

/* Frees info->ucx_desc and clears it. Can't fail. */
void mbr_node_info_free(mbr_node_info_t *info);

/* Deep copy into dst (dst's old contents are not freed). BT_ERR_NOMEM; dst is set only on success. */
bt_status mbr_node_info_copy(const mbr_node_info_t *src, mbr_node_info_t *dst);

/* NodeInfo <-> JSON. to_json returns a new string owned by the caller (free()). from_json returns BT_ERR_FORMAT
 * for bad JSON, missing node_id or role, wrong field types, overlong strings, bad base64; unknown fields are
 * ignored. *out is set only on success and owns its ucx_desc. */
bt_status mbr_node_info_to_json(const mbr_node_info_t *info, char **out);
bt_status mbr_node_info_from_json(const char *json, size_t len, mbr_node_info_t *out);

/* LoadReport <-> JSON, same rules (every field optional, absent = 0). */
bt_status mbr_load_to_json(const mbr_load_report_t *load, char **out);
bt_status mbr_load_from_json(const char *json, size_t len, mbr_load_report_t *out);

/* True when b differs from a enough to publish at once rather than with the next 1 s refresh: queued or
 * running counts moving by >= max(2, 25 %) or to/from 0, free KV blocks moving by >= 10 % of the pool, queued
 * prefill tokens moving by >= max(256, 25 %). Can't fail. */
int mbr_load_large_change(const mbr_load_report_t *a, const mbr_load_report_t *b);

/* Writes "/baton/<cluster>/<kind>/<node_id>" (kind "nodes" or "load"). BT_ERR_INVALID when a part is empty, has
 * a '/' or the key does not fit in cap. */
bt_status mbr_key(char *buf, size_t cap, const char *cluster, const char *kind, const char *node_id);

typedef enum mbr_reg_state {
    MBR_REG_PENDING = 0,    /* not registered yet, or the lease was lost: registering */
    MBR_REG_REGISTERED = 1, /* the records are in etcd under a live lease */
    MBR_REG_ETCD_DOWN = 2,  /* etcd does not answer; the lease may still be alive; retrying with backoff */
} mbr_reg_state;

typedef struct mbr_config {
    const char *cluster;      /* NULL = MBR_DEFAULT_CLUSTER */
    int ttl_s;                /* 0 = MBR_DEFAULT_TTL_S; etcd's minimum is 2 */
    int load_min_interval_ms; /* 0 = MBR_LOAD_MIN_INTERVAL_MS */
    int load_refresh_ms;      /* 0 = MBR_LOAD_REFRESH_MS */
    int backoff_max_ms;       /* 0 = MBR_BACKOFF_MAX_MS */
    int load_heartbeat_ms;    /* 0 = MBR_LOAD_HEARTBEAT_MS */
    /* Optional; called on the registration thread whenever the state changes (lease is 0 unless registered). */
    void (*on_state)(void *arg, mbr_reg_state state, int64_t lease);
    void *arg;
} mbr_config_t;

typedef struct mbr_registration mbr_registration_t;

/* Starts registering info (copied) under a new lease on a background thread and returns at once; the first
 * attempt happens immediately. The client must outlive the registration. BT_ERR_INVALID (bad node id, cluster
 * or TTL), BT_ERR_NOMEM, BT_ERR_INTERNAL; *out is set only on success. */
bt_status mbr_registration_create(etcd_client_t *c, const mbr_config_t *cfg, const mbr_node_info_t *info,
                                  mbr_registration_t **out);

/* Stops the thread (waiting for an etcd call in flight: up to the etcd timeout). With deregister, revokes the
 * lease so the node disappears at once (blocks up to the etcd timeout again; errors are ignored: the lease then
 * expires by itself). NULL is a no-op. */
void mbr_registration_destroy(mbr_registration_t *r, int deregister);

/* Replaces the published NodeInfo (copied); written at once. BT_ERR_INVALID when the node id changes, NOMEM. */
bt_status mbr_registration_update_info(mbr_registration_t *r, const mbr_node_info_t *info);

/* Hands over the latest load (copied); never blocks on etcd. The thread writes it when it differs from what
 * was last written: large changes within MBR_LOAD_MIN_INTERVAL_MS, others with the next refresh, and never
 * more often than 4 times a second. Can't fail. */
void mbr_registration_publish_load(mbr_registration_t *r, const mbr_load_report_t *load);

/* Current state and lease (lease may be NULL). Can't fail. */
mbr_reg_state mbr_registration_state(mbr_registration_t *r, int64_t *lease);

/* Waits until registered or timeout_ms passes: BT_OK or BT_ERR_TIMEOUT. */
bt_status mbr_registration_wait(mbr_registration_t *r, int timeout_ms);

/* One node as the watcher sees it. */
typedef struct mbr_node {
    mbr_node_info_t info;
    mbr_load_report_t load; /* zero until has_load */
    int has_load;
    int64_t lease;          /* lease of the NodeInfo key */
    int64_t mod_revision;   /* etcd revision of the last change to either record */
    int64_t seen_ms;        /* monotonic ms (CLOCK_MONOTONIC of this process) when either record last arrived */
    int held;               /* its lease vanished while etcd was coming back: kept for the rejoin grace */
} mbr_node_t;

typedef struct mbr_watch_ops {
    /* All optional; they run on the watcher's thread, one at a time, with no watcher lock held (they may call
     * the watcher's query functions). The node pointer is valid only during the call. */
    void (*on_join)(void *arg, const mbr_node_t *node);
    void (*on_update)(void *arg, const mbr_node_t *node); /* NodeInfo or load changed */
    void (*on_leave)(void *arg, const mbr_node_t *node);  /* the last state known */
    void (*on_connection)(void *arg, int connected);      /* the etcd watch stream went up or down */
    void *arg;
} mbr_watch_ops_t;

typedef struct mbr_watcher mbr_watcher_t;

/* Starts watching /baton/<cluster>/ (cluster NULL = default) on a background thread and returns at once; the
 * view fills as soon as etcd answers (see mbr_watcher_wait_synced). ops may be NULL. The client must outlive
 * the watcher. BT_ERR_INVALID, BT_ERR_NOMEM, BT_ERR_INTERNAL; *out is set only on success. */
bt_status mbr_watcher_create(etcd_client_t *c, const char *cluster, const mbr_watch_ops_t *ops,
                             mbr_watcher_t **out);

/* Turns on the rejoin grace (grace_ms > 0; call once, right after create): a probe thread asks etcd for a count
 * every MBR_PROBE_MS, and a node whose NodeInfo is deleted while etcd is recovering (the probe or the watch failed
 * and etcd answered again less than grace_ms ago, or no probe has succeeded for 3 periods) stays in the view,
 * marked held, until it registers again (no callback: it never left) or grace_ms pass (then on_leave). A node
 * deleted while etcd is steadily answering leaves at once. Callbacks may then also run on the probe thread, still
 * one at a time. BT_ERR_INTERNAL (thread), BT_ERR_INVALID (called twice). */
bt_status mbr_watcher_set_rejoin_grace(mbr_watcher_t *w, int grace_ms);

/* For how long etcd has answered without a break, in ms (the watch stream up and, with a rejoin grace, every probe
 * answered); 0 while it does not answer. What a reader of node ages (seen_ms) checks first: while etcd is away,
 * every record ages. Can't fail. */
int64_t mbr_watcher_confirmed_ms(mbr_watcher_t *w);

/* Stops the watch thread and frees the view. Not from a callback. NULL is a no-op. */
void mbr_watcher_destroy(mbr_watcher_t *w);

/* Waits until the initial read of the prefix has completed: BT_OK or BT_ERR_TIMEOUT. */
bt_status mbr_watcher_wait_synced(mbr_watcher_t *w, int timeout_ms);

/* Deep copy of every node in the view, ordered by node id; free with mbr_nodes_free. An empty view gives
 * *nodes = NULL, *n = 0. BT_ERR_NOMEM. Works while etcd is unreachable (last view). */
bt_status mbr_watcher_snapshot(mbr_watcher_t *w, mbr_node_t **nodes, size_t *n);

/* Deep copy of one node: BT_ERR_NOT_FOUND, BT_ERR_NOMEM. Free out->info with mbr_node_info_free. */
bt_status mbr_watcher_get(mbr_watcher_t *w, const char *node_id, mbr_node_t *out);

/* Number of nodes in the view. Can't fail. */
size_t mbr_watcher_count(mbr_watcher_t *w);

/* 1 while the watch stream to etcd is up. Can't fail. */
int mbr_watcher_connected(mbr_watcher_t *w);

void mbr_nodes_free(mbr_node_t *nodes, size_t n);

#endif
