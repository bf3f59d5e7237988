/* What prefill and decode nodes share (DESIGN 1): command-line flags with BATON_* environment fallbacks, the gRPC
 * server and the HTTP listener (/health, /metrics), the metrics registry, etcd registration (membership) with
 * periodic load reports, and SIGINT/SIGTERM handling with a clean shutdown.
 *
 * bt_node_main (node_main.h) runs, for either role:
 *   bt_node_flags_parse -> bt_ne_env_read (the engine's switches without a flag, node_engine.h)
 *   -> bt_node_create (first: it blocks SIGINT/SIGTERM for every thread created later)
 *   -> the role's service adds its gRPC methods (bt_node_rpc) and metrics (bt_node_metrics)
 *   -> bt_node_start -> bt_node_wait (returns on SIGINT/SIGTERM) -> bt_node_stop -> service teardown
 *   -> bt_node_destroy.
 * State lives in the bt_node_t; nothing is global. Library target baton_node (node/CMakeLists.txt).
 * Names in node/: bt_node_* for this runtime and bt_node_main, bt_ne_* for the engine host (node_engine.h),
 * bt_call_* / bt_calls_* for Run-call handling (calls.h); types end in _t, callback types in _fn. */
#ifndef BATON_NODE_NODE_H
#define BATON_NODE_NODE_H

#include "common/membership.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define BT_NODE_ADDR_MAX 256
#define BT_NODE_DEFAULT_ETCD "http://127.0.0.1:2379"
#define BT_NODE_DEFAULT_LISTEN "127.0.0.1:0"
#define BT_NODE_DEFAULT_GRACE_MS 5000 /* calls in flight get this long to finish at shutdown */
#define BT_NODE_LOAD_PERIOD_MS 100    /* load sampling (gauges); etcd writes are throttled by membership */

/* Parsed flags. Precedence: flag, then environment variable, then default. */
typedef struct bt_node_flags {
    char model[4096];                  /* --model / BATON_MODEL; default: the cached default model */
    char etcd[1024];                   /* --etcd / BATON_ETCD: endpoints; "" after "none" = no registration */
    char cluster[64];                  /* --cluster / BATON_CLUSTER (default "default") */
    char node_id[MBR_NODE_ID_MAX];     /* --node-id / BATON_NODE_ID (default <role>-<host>-<pid>) */
    char grpc_listen[BT_NODE_ADDR_MAX]; /* --grpc-listen / BATON_GRPC_LISTEN (default 127.0.0.1:0) */
    char http_listen[BT_NODE_ADDR_MAX]; /* --http-listen / BATON_HTTP_LISTEN (default 127.0.0.1:0) */
    int threads;                       /* --threads / BATON_THREADS: compute threads, 0 = all CPUs */
    int device;                        /* --device / BATON_DEVICE: -1 the CPU (default), else the CUDA device */
    size_t kv_mem;                     /* --kv-mem / BATON_KV_MEM: KV pool bytes (K/M/G suffixes), 0 = default */
    int32_t max_batch_tokens;          /* --max-batch-tokens / BATON_MAX_BATCH_TOKENS, 0 = default */
    int log_level;                     /* --log-level / BATON_LOG: bt_log_level, -1 = unchanged */
    int grace_ms;                      /* --grace-ms / BATON_GRACE_MS: drain time at shutdown */
    char spec[1100];                   /* --spec / BATON_SPEC (decode nodes): none|ngram|draft:PATH|self:L */
    int32_t spec_k_max;                /* --spec-k-max / BATON_SPEC_K_MAX: drafts per sequence per step, 0 = 8 */
    /* --tls-cert/--tls-key/--tls-ca (BATON_TLS_*): all three = mTLS on the gRPC server (clients must present a
     * certificate from the CA) and on this node's own calls to other nodes */
    bt_tls_files_t tls;
    int insecure;                      /* --insecure / BATON_INSECURE=1: allow a non-loopback listener without mTLS */
    char etcd_user[128];               /* --etcd-user / BATON_ETCD_USER; "" = no etcd authentication */
    char etcd_password[BT_TLS_SECRET_MAX]; /* read from --etcd-password-file / BATON_ETCD_PASSWORD_FILE */
    bt_tls_files_t etcd_tls;           /* --etcd-ca/--etcd-cert/--etcd-key: TLS to etcd (https:// endpoints) */
} bt_node_flags_t;

/* Parses argv into *f. *help is set to 1 (and nothing else checked) on --help / -h. Returns BT_ERR_INVALID with a
 * message naming the flag or variable (unknown flag, missing value, bad number or address). Can't block. */
bt_status bt_node_flags_parse(bt_node_flags_t *f, mbr_role role, int argc, char **argv, int *help);

/* Writes the flag summary for prog ("baton-decode"). */
void bt_node_usage(FILE *out, const char *prog);

/* Splits "host:port" or "[v6]:port" into host (without brackets) and port. BT_ERR_INVALID when malformed. */
bt_status bt_node_split_addr(const char *addr, char *host, size_t host_cap, int *port);

typedef struct bt_node bt_node_t;

/* Load sampling, called every BT_NODE_LOAD_PERIOD_MS on the node's load thread: fill *out (the node publishes it
 * to etcd) and update the role's gauges. Must be quick and thread-safe with respect to the role's service. */
typedef void (*bt_node_load_fn)(void *ud, mbr_load_report_t *out);

/* Blocks SIGINT/SIGTERM (so call it before any other thread starts), creates the metrics registry, the etcd client
 * (unless etcd is "") and the gRPC server bound to grpc_listen (not yet serving). f is copied. Returns
 * BT_ERR_INVALID (bad address), BT_ERR_IO (cannot bind), BT_ERR_NOMEM; *out set only on success. */
bt_status bt_node_create(const bt_node_flags_t *f, mbr_role role, bt_node_t **out);

/* Accessors; valid until bt_node_destroy. */
metrics_registry_t *bt_node_metrics(bt_node_t *n);
/* The cluster's members as this node's etcd watch sees them (NULL without etcd): the peers it may believe. */
mbr_watcher_t *bt_node_members(bt_node_t *n);
bt_rpc_server_t *bt_node_rpc(bt_node_t *n);
const bt_node_flags_t *bt_node_flags(const bt_node_t *n);
/* The published addresses ("127.0.0.1:41234"); the HTTP one is "" before bt_node_start. */
const char *bt_node_grpc_addr(const bt_node_t *n);
const char *bt_node_http_addr(const bt_node_t *n);

/* Starts serving: gRPC (health SERVING), HTTP (/health, /metrics), the load thread (load may be NULL), and etcd
 * registration of info with the node's id, role, addresses, version and start time filled in (the caller fills the
 * model fingerprint and capacity). Logs one line "<prog> ready: <summary> | node ... listening grpc=A http=B ...".
 * Returns BT_ERR_IO (HTTP bind), BT_ERR_NOMEM, BT_ERR_INTERNAL; on failure the node must still be stopped. Does not
 * wait for etcd: registration retries in the background while the node serves. */
bt_status bt_node_start(bt_node_t *n, const mbr_node_info_t *info, bt_node_load_fn load, void *load_ud,
                        const char *summary);

/* Blocks until SIGINT or SIGTERM arrives (or bt_node_request_stop); returns the signal number (0 for a request). */
int bt_node_wait(bt_node_t *n);

/* Wakes bt_node_wait from any thread. Can't fail. */
void bt_node_request_stop(bt_node_t *n);

/* Drains and stops: /health answers 503 and gRPC health NOT_SERVING, the etcd records are deleted (lease revoked),
 * the load thread stops, gRPC calls get grace_ms to finish and are then cancelled (the service's cancel callbacks
 * must still finish them, so its engine must keep running until this returns), and the HTTP listener stops.
 * Blocks; idempotent. */
void bt_node_stop(bt_node_t *n, int grace_ms);

/* Stops if needed and frees everything (the metrics registry too: the service must be gone). NULL is a no-op. */
void bt_node_destroy(bt_node_t *n);

#endif
