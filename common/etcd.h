/* etcd v3 client over the JSON gateway (etcd 3.4: POST /v3/...), built on libcurl + cJSON.
 *
 * One etcd_client_t is shared by every thread of a process: calls are thread-safe and each one blocks for at
 * most the configured timeout (default 2 s, DESIGN 3), across all endpoints it tries. Endpoints fail over in
 * order: a call that cannot connect, times out, or gets "unavailable" moves on to the next endpoint, and the
 * client sticks to the last one that answered. With a user name set, the client authenticates on first use,
 * sends `Authorization: <token>`, and re-authenticates once per call when etcd says the token is invalid or
 * expired.
 *
 * Errors: BT_ERR_UNAVAILABLE (no endpoint reachable), BT_ERR_TIMEOUT (deadline passed), BT_ERR_NOT_FOUND
 * (missing key for etcd_get, unknown or expired lease), BT_ERR_FORMAT (malformed answer: bad JSON, wrong types,
 * bad base64), BT_ERR_EXHAUSTED (answer larger than the response limit), BT_ERR_INVALID (bad argument, or etcd
 * said invalid argument), BT_ERR_STALE (compacted revision), BT_ERR_PEER (any other etcd error, including
 * authentication refused). bt_last_error() holds etcd's message. Keys are NUL-terminated strings; values are
 * byte ranges. */
#ifndef BATON_COMMON_ETCD_H
#define BATON_COMMON_ETCD_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define ETCD_DEFAULT_TIMEOUT_MS 2000
#define ETCD_DEFAULT_MAX_RESPONSE (16u << 20)

typedef struct etcd_config {
    const char *endpoints;   /* comma-separated, e.g. "http://10.0.0.1:2379,https://10.0.0.2:2379"; no scheme = http */
    const char *user;        /* NULL or "": no authentication */
    const char *password;
    const char *ca_file;     /* TLS: CA bundle to verify the server (NULL: system default) */
    const char *cert_file;   /* TLS client certificate (mTLS), PEM; NULL: none */
    const char *key_file;    /* TLS client key, PEM */
    int insecure_skip_verify; /* TLS: do not verify the server certificate (tests only) */
    int timeout_ms;          /* per call, all endpoints together; 0 = ETCD_DEFAULT_TIMEOUT_MS */
    size_t max_response;     /* largest accepted answer (or watch line) in bytes; 0 = ETCD_DEFAULT_MAX_RESPONSE */
} etcd_config_t;

typedef struct etcd_client etcd_client_t;

/* Creates a client; contacts nothing yet. The config strings are copied. Returns BT_ERR_INVALID (no endpoint,
 * bad timeout) or BT_ERR_NOMEM; *out is set only on success. */
bt_status etcd_client_create(const etcd_config_t *cfg, etcd_client_t **out);

/* Frees the client. Every watch on it must have been stopped first. NULL is a no-op. */
void etcd_client_destroy(etcd_client_t *c);

/* The endpoint the next call will try first (the last one that answered). Valid until the client is destroyed. */
const char *etcd_client_endpoint(etcd_client_t *c);

/* One key-value pair; key and value are NUL-terminated copies (the NUL is not counted in the lengths). */
typedef struct etcd_kv {
    char *key;
    size_t key_len;
    char *value;
    size_t value_len;
    int64_t create_revision;
    int64_t mod_revision;
    int64_t version; /* number of modifications since creation */
    int64_t lease;   /* 0 = none */
} etcd_kv_t;

typedef struct etcd_range_result {
    int64_t revision; /* store revision the answer was read at */
    int64_t count;    /* keys in the range (may exceed n_kvs when limited) */
    int more;
    etcd_kv_t *kvs;
    size_t n_kvs;
} etcd_range_result_t;

/* Frees what a range result owns and zeroes it. Can't fail. */
void etcd_range_result_free(etcd_range_result_t *r);

typedef struct etcd_range_opts {
    int prefix;       /* every key that starts with key */
    int64_t limit;    /* 0 = no limit */
    int64_t revision; /* 0 = latest */
    int keys_only;
    int count_only;
} etcd_range_opts_t;

/* Reads one key (opts NULL) or a range. Blocks up to the timeout. *out is filled only on success and owned by
 * the caller (etcd_range_result_free). A missing key is success with n_kvs == 0. */
bt_status etcd_range(etcd_client_t *c, const char *key, const etcd_range_opts_t *opts, etcd_range_result_t *out);

/* Reads one key's value into a new NUL-terminated buffer owned by the caller (free()). BT_ERR_NOT_FOUND when the
 * key does not exist. mod_revision may be NULL. Blocks up to the timeout. */
bt_status etcd_get(etcd_client_t *c, const char *key, char **value, size_t *value_len, int64_t *mod_revision);

/* Writes key = value, attached to lease (0 = none). revision (may be NULL) gets the new store revision.
 * BT_ERR_NOT_FOUND when the lease does not exist. Blocks up to the timeout. */
bt_status etcd_put(etcd_client_t *c, const char *key, const void *value, size_t value_len, int64_t lease,
                   int64_t *revision);

/* Deletes one key or every key with the prefix. deleted and revision may be NULL; deleting nothing is success. */
bt_status etcd_delete(etcd_client_t *c, const char *key, int prefix, int64_t *deleted, int64_t *revision);

typedef enum etcd_cmp_target {
    ETCD_CMP_VERSION = 0,
    ETCD_CMP_CREATE = 1, /* create_revision; 0 = key absent */
    ETCD_CMP_MOD = 2,
    ETCD_CMP_VALUE = 3,
    ETCD_CMP_LEASE = 4,
} etcd_cmp_target;

typedef enum etcd_cmp_result {
    ETCD_CMP_EQUAL = 0,
    ETCD_CMP_GREATER = 1,
    ETCD_CMP_LESS = 2,
    ETCD_CMP_NOT_EQUAL = 3,
} etcd_cmp_result;

typedef struct etcd_cmp {
    etcd_cmp_target target;
    etcd_cmp_result result;
    const char *key;
    int64_t number;    /* for VERSION, CREATE, MOD, LEASE */
    const void *value; /* for VALUE */
    size_t value_len;
} etcd_cmp_t;

typedef enum etcd_op_type {
    ETCD_OP_PUT = 0,
    ETCD_OP_DELETE = 1,
} etcd_op_type;

typedef struct etcd_op {
    etcd_op_type type;
    const char *key;
    int prefix; /* DELETE only */
    const void *value;
    size_t value_len;
    int64_t lease;
} etcd_op_t;

/* Atomically: if every comparison holds, applies the `then` ops, else the `otherwise` ops. succeeded (required)
 * says which branch ran; revision may be NULL. Blocks up to the timeout. */
bt_status etcd_txn(etcd_client_t *c, const etcd_cmp_t *cmp, size_t n_cmp, const etcd_op_t *then, size_t n_then,
                   const etcd_op_t *otherwise, size_t n_otherwise, int *succeeded, int64_t *revision);

/* Grants a lease of ttl_s seconds (etcd raises tiny TTLs to its minimum, 2 s with default timing).
 * id gets the lease id; granted_ttl (may be NULL) the TTL etcd granted. */
bt_status etcd_lease_grant(etcd_client_t *c, int64_t ttl_s, int64_t *id, int64_t *granted_ttl);

/* Renews a lease once. ttl (may be NULL) gets the renewed TTL. BT_ERR_NOT_FOUND when the lease has expired or
 * never existed (etcd answers without a TTL): the caller must grant a new lease and re-put its keys. */
bt_status etcd_lease_keepalive(etcd_client_t *c, int64_t id, int64_t *ttl);

/* Revokes a lease, deleting its keys. BT_ERR_NOT_FOUND when the lease does not exist. */
bt_status etcd_lease_revoke(etcd_client_t *c, int64_t id);

/* Remaining and granted TTL of a lease in seconds; either pointer may be NULL. BT_ERR_NOT_FOUND when the lease
 * has expired or never existed. */
bt_status etcd_lease_timetolive(etcd_client_t *c, int64_t id, int64_t *ttl, int64_t *granted_ttl);

/* Authenticates now with the configured user (normally done on demand). BT_ERR_INVALID without a user,
 * BT_ERR_PEER when etcd refuses the credentials. */
bt_status etcd_authenticate(etcd_client_t *c);

typedef enum etcd_event_type {
    ETCD_EVENT_PUT = 0,
    ETCD_EVENT_DELETE = 1, /* also lease expiry */
} etcd_event_type;

typedef struct etcd_event {
    etcd_event_type type;
    etcd_kv_t kv;      /* for DELETE only key and mod_revision are set */
    etcd_kv_t prev_kv; /* valid when has_prev_kv */
    int has_prev_kv;
} etcd_event_t;

typedef struct etcd_watch_ops {
    /* Required. A batch of events in revision order; the pointers are valid only during the call. */
    void (*on_events)(void *arg, const etcd_event_t *events, size_t n_events);
    /* Optional. Called before the first connection when the watch was started at revision 0, and whenever the
     * revision to resume from has been compacted away: reload the state (for example with a range) and return
     * the revision to watch from (the range's revision + 1). An error makes the watch back off and call it
     * again. Without it a watch started at 0 begins at "now" and a compacted resume skips to the oldest kept
     * revision. */
    bt_status (*resync)(void *arg, int64_t *start_revision);
    /* Optional. connected = 1 once the stream is established, 0 when it is lost (the watch then reconnects
     * and resumes from the last revision seen + 1). */
    void (*on_state)(void *arg, int connected);
    void *arg;
} etcd_watch_ops_t;

typedef struct etcd_watch etcd_watch_t;

/* Starts watching key (or every key with that prefix) from start_revision (0 = see resync above) on a new
 * thread; the callbacks run on that thread, one at a time. The watch survives etcd restarts and endpoint
 * failures until stopped. ops is copied. Returns BT_ERR_INVALID, BT_ERR_NOMEM or BT_ERR_INTERNAL (thread);
 * *out is set only on success. */
bt_status etcd_watch_start(etcd_client_t *c, const char *key, int prefix, int64_t start_revision,
                           const etcd_watch_ops_t *ops, etcd_watch_t **out);

/* Stops the watch and joins its thread (returns promptly, within the time a callback takes). Must not be
 * called from a callback of this watch. NULL is a no-op. */
void etcd_watch_stop(etcd_watch_t *w);

#endif
