/* gRPC glue over gRPC C core 1.51 (everything gRPC-specific in baton lives in common/rpc.c; this header names no
 * gRPC type, so the core API can change under it without touching callers). Messages are protobuf-c messages.
 *
 * Server: bt_rpc_server_create binds an explicit address (port 0 = a free port, reported by
 * bt_rpc_server_port), optionally with TLS or mTLS, and serves with n completion-queue threads. Services add
 * methods before bt_rpc_server_start. When a call arrives, its request is unpacked and the method's handler runs
 * on a completion-queue thread with a call handle. The handler, or any other thread later, answers through the
 * handle: bt_rpc_call_send (queued, sent one at a time in order) and exactly one bt_rpc_call_finish, after which
 * the handle is gone. Handlers must not block for long: hand slow work to another thread. Unknown methods get
 * UNIMPLEMENTED, a request that does not parse gets INVALID_ARGUMENT, both without reaching a handler.
 * grpc.health.v1.Health/Check is built in (bt_rpc_server_set_health).
 *
 * Client: a channel per peer (thread-safe, reconnects by itself); bt_rpc_unary, and bt_rpc_stream_* for
 * server-streaming calls with a blocking receive loop that another thread can cancel.
 *
 * Server sketch (a streaming method whose tokens come from another thread):
 *   static void run(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *req) {
 *       ... hand (call, req fields) to the scheduler; return at once ...
 *   }
 *   scheduler thread: for each token: if (bt_rpc_call_send(call, &resp.base) != BT_OK) abort the sequence;
 *                     at the end:     bt_rpc_call_finish(call, BT_RPC_OK, NULL);
 *   cancel: bt_rpc_call_on_cancel(call, fn, ud) or poll bt_rpc_call_cancelled(call) once per step.
 *   bt_rpc_server_create(&cfg, &srv); bt_rpc_server_add_method(srv, "/baton.v1.Decode/Run",
 *       BT_RPC_SERVER_STREAMING, &baton__v1__decode_run_request__descriptor, run, node); bt_rpc_server_start(srv);
 *   ... bt_rpc_server_shutdown(srv, grace_ms); bt_rpc_server_destroy(srv);
 * Client sketch: bt_rpc_stream_open(ch, "/baton.v1.Decode/Run", &req.base, &baton__v1__decode_run_response__descriptor,
 *   timeout_ms, NULL, &s); while ((st = bt_rpc_stream_next(s, &m)) == BT_OK && m) { use m; free m; }
 *   bt_rpc_stream_close(s);
 *
 * Errors: bt_status, with bt_last_error() set. A failed remote call maps its gRPC code (bt_rpc_status_from_code)
 * and, when asked, reports the code and message in a bt_rpc_result_t. */
#ifndef BATON_COMMON_RPC_H
#define BATON_COMMON_RPC_H

#include "common/status.h"

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* gRPC status codes (same numbers as grpc_status_code and every gRPC implementation). */
typedef enum bt_rpc_code {
    BT_RPC_OK = 0,
    BT_RPC_CANCELLED = 1,
    BT_RPC_UNKNOWN = 2,
    BT_RPC_INVALID_ARGUMENT = 3,
    BT_RPC_DEADLINE_EXCEEDED = 4,
    BT_RPC_NOT_FOUND = 5,
    BT_RPC_ALREADY_EXISTS = 6,
    BT_RPC_PERMISSION_DENIED = 7,
    BT_RPC_RESOURCE_EXHAUSTED = 8,
    BT_RPC_FAILED_PRECONDITION = 9,
    BT_RPC_ABORTED = 10,
    BT_RPC_OUT_OF_RANGE = 11,
    BT_RPC_UNIMPLEMENTED = 12,
    BT_RPC_INTERNAL = 13,
    BT_RPC_UNAVAILABLE = 14,
    BT_RPC_DATA_LOSS = 15,
    BT_RPC_UNAUTHENTICATED = 16,
} bt_rpc_code;

/* Short name ("UNAVAILABLE"); never NULL. */
const char *bt_rpc_code_str(bt_rpc_code code);

/* The gRPC code a server should answer for a bt_status (BT_ERR_INVALID -> INVALID_ARGUMENT, BT_ERR_EXHAUSTED ->
 * RESOURCE_EXHAUSTED, BT_ERR_UNAVAILABLE -> UNAVAILABLE, ...). Can't fail. */
bt_rpc_code bt_rpc_code_from_status(bt_status st);

/* The bt_status a client sees for a gRPC code (UNAVAILABLE -> BT_ERR_UNAVAILABLE, DEADLINE_EXCEEDED ->
 * BT_ERR_TIMEOUT, CANCELLED -> BT_ERR_CANCELLED, UNIMPLEMENTED -> BT_ERR_UNSUPPORTED, others as named, anything
 * else -> BT_ERR_PEER). Can't fail. */
bt_status bt_rpc_status_from_code(bt_rpc_code code);

/* Outcome of a client call as the server (or the local gRPC stack) reported it. */
typedef struct bt_rpc_result {
    bt_rpc_code code;
    char message[256]; /* the status message, truncated */
} bt_rpc_result_t;

/* ---- protobuf-c helpers ---- */

/* Packs msg into a new malloc'd buffer. Returns BT_ERR_NOMEM; *out and *out_len are set only on success. */
bt_status bt_rpc_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *out_len);

/* Unpacks len bytes as a desc message. Returns BT_ERR_FORMAT when they do not parse; free the result with
 * protobuf_c_message_free_unpacked(msg, NULL). */
bt_status bt_rpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                        ProtobufCMessage **out);

/* ---- server ---- */

typedef struct bt_rpc_server bt_rpc_server_t;
typedef struct bt_rpc_call bt_rpc_call_t;

#define BT_RPC_DEFAULT_THREADS 2
#define BT_RPC_DEFAULT_SLOTS 16            /* calls each method can have waiting to be accepted, per thread */
#define BT_RPC_DEFAULT_MAX_MESSAGE (4u << 20) /* largest request accepted, bytes */
#define BT_RPC_DEFAULT_MAX_QUEUED 4096     /* messages one streaming call may have queued for sending */

typedef struct bt_rpc_server_config {
    const char *listen;          /* "host:port", explicit address; port 0 = a free port. Required. */
    int n_threads;               /* completion-queue threads; 0 = BT_RPC_DEFAULT_THREADS */
    int slots_per_method;        /* 0 = BT_RPC_DEFAULT_SLOTS */
    size_t max_message;          /* largest request accepted (bigger: RESOURCE_EXHAUSTED); 0 = default */
    size_t max_queued;           /* bt_rpc_call_send beyond this many unsent messages fails; 0 = default */
    /* TLS: cert_file (PEM chain) + key_file (PEM) turn TLS on. client_ca_file additionally turns on mTLS: clients
     * must present a certificate signed by that CA. All NULL = insecure. */
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_client_ca_file;
} bt_rpc_server_config_t;

/* Called on a completion-queue thread for each new call, with req unpacked from the request (owned by the call,
 * valid until bt_rpc_call_finish; NULL when the method was added with a NULL descriptor: see
 * bt_rpc_call_request_bytes). The handler owns the call: it must call bt_rpc_call_finish exactly once, now or
 * later from any thread, including after the client cancelled. */
typedef void (*bt_rpc_handler_fn)(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *req);

typedef enum bt_rpc_method_kind {
    BT_RPC_UNARY = 0,            /* one response: bt_rpc_call_send once (or never, with an error) then finish */
    BT_RPC_SERVER_STREAMING = 1, /* any number of bt_rpc_call_send then finish */
} bt_rpc_method_kind;

/* Creates the server, binds the address and registers the health service (status "" = SERVING). Serves nothing
 * until bt_rpc_server_start. Returns BT_ERR_INVALID (bad config, unreadable TLS files), BT_ERR_IO (the address
 * cannot be bound) or BT_ERR_NOMEM; *out is set only on success. Calls grpc_init (balanced by destroy). */
bt_status bt_rpc_server_create(const bt_rpc_server_config_t *cfg, bt_rpc_server_t **out);

/* Adds a method, path "/package.Service/Method"; before bt_rpc_server_start only. req_desc: the request type
 * (NULL: the handler gets NULL and reads raw bytes). fn and ud must outlive the server. Returns BT_ERR_INVALID
 * (started, duplicate or malformed path) or BT_ERR_NOMEM. */
bt_status bt_rpc_server_add_method(bt_rpc_server_t *srv, const char *path, bt_rpc_method_kind kind,
                                   const ProtobufCMessageDescriptor *req_desc, bt_rpc_handler_fn fn, void *ud);

/* Starts the completion-queue threads and accepts calls. Returns BT_ERR_INVALID (already started) or
 * BT_ERR_NOMEM / BT_ERR_INTERNAL (threads). */
bt_status bt_rpc_server_start(bt_rpc_server_t *srv);

/* The bound port (the free port chosen when the config said 0). Can't fail. */
int bt_rpc_server_port(const bt_rpc_server_t *srv);

/* Health status of a service name ("" = the whole server); unknown names answer NOT_FOUND. serving: 1 = SERVING,
 * 0 = NOT_SERVING. Thread-safe; returns BT_ERR_NOMEM or BT_ERR_INVALID (name longer than 255 bytes). */
bt_status bt_rpc_server_set_health(bt_rpc_server_t *srv, const char *service, int serving);

/* Stops the server: refuses new calls (health says NOT_SERVING first), gives calls in flight up to grace_ms to
 * finish, cancels the rest (their handlers see the cancel and must still call bt_rpc_call_finish), then waits for
 * every call to be finished and joins the threads. Blocks; idempotent; not concurrent with itself. */
void bt_rpc_server_shutdown(bt_rpc_server_t *srv, int grace_ms);

/* Shuts down (grace 0) if not yet done, frees everything and calls grpc_shutdown. NULL is a no-op. */
void bt_rpc_server_destroy(bt_rpc_server_t *srv);

/* ---- server calls (handles given to handlers) ---- */

/* Queues msg (packed now: the caller keeps msg) for sending after the messages queued before it. Thread-safe,
 * never blocks. Returns BT_ERR_CANCELLED (the client is gone or the deadline passed: stop producing),
 * BT_ERR_EXHAUSTED (max_queued unsent messages: the client reads too slowly), BT_ERR_INVALID (after finish, or a
 * second message on a unary call) or BT_ERR_NOMEM. */
bt_status bt_rpc_call_send(bt_rpc_call_t *call, const ProtobufCMessage *msg);

/* Ends the call with a status once the queued messages are sent (code BT_RPC_OK, or an error code with a message
 * for the client; NULL = none). The handle is invalid once this returns. Thread-safe with respect to the
 * cancellation callback; can't fail (on a cancelled call the status is dropped). */
void bt_rpc_call_finish(bt_rpc_call_t *call, bt_rpc_code code, const char *message);

/* Convenience: finish with the code of st and bt_last_error() as the message (BT_OK -> OK). */
void bt_rpc_call_finish_status(bt_rpc_call_t *call, bt_status st);

/* 1 once the client cancelled, disconnected, or the deadline passed; 0 otherwise. Cheap; any thread. */
int bt_rpc_call_cancelled(const bt_rpc_call_t *call);

/* Registers fn to run once when the call is cancelled (immediately, on this thread, if it already was; else on a
 * completion-queue thread). fn never runs after bt_rpc_call_finish has returned; it may call bt_rpc_call_finish
 * itself. One callback per call; a second replaces the first. */
void bt_rpc_call_on_cancel(bt_rpc_call_t *call, void (*fn)(void *ud, bt_rpc_call_t *call), void *ud);

/* The client's deadline as CLOCK_MONOTONIC milliseconds, or INT64_MAX when it set none. Can't fail. */
int64_t bt_rpc_call_deadline_ms(const bt_rpc_call_t *call);

/* The raw request bytes (valid until finish). Can't fail. */
const uint8_t *bt_rpc_call_request_bytes(const bt_rpc_call_t *call, size_t *len);

/* The method path ("/baton.v1.Decode/Run"). Valid until finish. */
const char *bt_rpc_call_method(const bt_rpc_call_t *call);

/* Copies the first value of request metadata key (lower-case, e.g. "authorization") into buf as a NUL-terminated
 * string. Returns BT_ERR_NOT_FOUND (absent) or BT_ERR_EXHAUSTED (does not fit; buf holds a truncated copy). */
bt_status bt_rpc_call_metadata(const bt_rpc_call_t *call, const char *key, char *buf, size_t buf_len);

/* The peer's address ("ipv4:127.0.0.1:53412") into buf, truncated to fit. Can't fail. */
void bt_rpc_call_peer(const bt_rpc_call_t *call, char *buf, size_t buf_len);

/* The peer's verified identity over mutual TLS: the first subject alternative name of its certificate, else its
 * common name, into buf (truncated to fit). BT_ERR_NOT_FOUND when the call did not come with a verified client
 * certificate. Can't block. */
bt_status bt_rpc_call_peer_identity(const bt_rpc_call_t *call, char *buf, size_t buf_len);

/* 1 when the peer's verified certificate names identity (any SAN exactly or as a wildcard "*.rest" matching
 * "label.rest", or the CN exactly); 0 otherwise (no mTLS). */
int bt_rpc_call_peer_has_identity(const bt_rpc_call_t *call, const char *identity);

/* ---- client ---- */

typedef struct bt_rpc_channel bt_rpc_channel_t;
typedef struct bt_rpc_stream bt_rpc_stream_t;

typedef struct bt_rpc_channel_config {
    const char *target;          /* "host:port" (or any gRPC target URI). Required. */
    /* TLS: ca_file (PEM roots to verify the server; turns TLS on). cert_file + key_file: client certificate for
     * mTLS. server_name: name checked against the server's certificate instead of the target's host (tests). */
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
    size_t max_message;          /* largest response accepted; 0 = BT_RPC_DEFAULT_MAX_MESSAGE */
    /* HTTP/2 pings every keepalive_ms while calls are open (0 = off; at least BT_RPC_MIN_KEEPALIVE_MS, which baton
     * servers accept): a peer that vanished without closing its socket fails the calls with UNAVAILABLE after
     * keepalive_ms + 5 s instead of hanging until the deadline. */
    int keepalive_ms;
} bt_rpc_channel_config_t;

#define BT_RPC_MIN_KEEPALIVE_MS 1000

/* Creates a channel; connects lazily, so an unreachable target shows up as UNAVAILABLE on the first call.
 * Returns BT_ERR_INVALID (no target, unreadable TLS files) or BT_ERR_NOMEM. Calls grpc_init. Thread-safe. */
bt_status bt_rpc_channel_create(const bt_rpc_channel_config_t *cfg, bt_rpc_channel_t **out);

/* Frees the channel; every call on it must have ended (streams closed). NULL is a no-op. */
void bt_rpc_channel_destroy(bt_rpc_channel_t *ch);

/* One unary call: sends req to method, waits up to timeout_ms (<= 0: no deadline) and unpacks the answer as
 * resp_desc into *resp (free with protobuf_c_message_free_unpacked). Blocks. Returns BT_OK, the mapped status of
 * a non-OK gRPC code (bt_last_error() holds "CODE: message"), or BT_ERR_FORMAT when the answer does not parse.
 * result, when not NULL, receives the gRPC code and message in every case. *resp is set only on success. */
bt_status bt_rpc_unary(bt_rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *resp_desc, int timeout_ms, ProtobufCMessage **resp,
                       bt_rpc_result_t *result);

/* Starts a server-streaming call with deadline timeout_ms (<= 0: none). Does not wait for the server. Metadata
 * (key, value, key, value, ..., NULL; may be NULL; keys lower-case) is sent with the request. Returns
 * BT_ERR_INVALID (bad metadata), BT_ERR_NOMEM or BT_ERR_INTERNAL; *out is set only on success. */
bt_status bt_rpc_stream_open(bt_rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int timeout_ms,
                             const char *const *metadata, bt_rpc_stream_t **out);

/* Blocks for the next message. BT_OK with *msg set (free with protobuf_c_message_free_unpacked); BT_OK with
 * *msg = NULL at the end of a stream that finished with OK; else the mapped status of the final code (the stream
 * ended with an error, was cancelled, or its deadline passed) or BT_ERR_FORMAT. Not concurrent with itself. */
bt_status bt_rpc_stream_next(bt_rpc_stream_t *s, ProtobufCMessage **msg);

/* Like bt_rpc_stream_next, but waits at most wait_ms (< 0: no limit; 0: only what has already arrived). When
 * nothing arrived in time it returns BT_OK with *ready = 0 and *msg = NULL, and the stream goes on (call again);
 * otherwise *ready = 1 and the result is bt_rpc_stream_next's. Lets a caller send heartbeats while it waits. */
bt_status bt_rpc_stream_next_wait(bt_rpc_stream_t *s, int wait_ms, ProtobufCMessage **msg, int *ready);

/* The final code and message, once bt_rpc_stream_next returned the end or an error. Returns BT_ERR_INVALID
 * before that. */
bt_status bt_rpc_stream_result(const bt_rpc_stream_t *s, bt_rpc_result_t *result);

/* Cancels the call from any thread: a blocked bt_rpc_stream_next returns BT_ERR_CANCELLED. Idempotent. */
void bt_rpc_stream_cancel(bt_rpc_stream_t *s);

/* Cancels the call if it has not ended, waits for gRPC to release it, and frees it. Not concurrent with
 * bt_rpc_stream_next. NULL is a no-op. */
void bt_rpc_stream_close(bt_rpc_stream_t *s);

/* ---- channel cache ----
 * Channels to peers named by untrusted sources (etcd records, prefill hints), keyed by (target, identity), with
 * the process's TLS settings applied to each. At most capacity channels stay open: a new target closes the least
 * recently used channel that no caller holds (issue 16 item 8: an attacker choosing addresses cannot grow it). */

typedef struct bt_rpc_chcache bt_rpc_chcache_t;

#define BT_RPC_CHCACHE_DEFAULT_CAP 64

typedef struct bt_rpc_chcache_config {
    const char *tls_ca_file;   /* NULL = insecure channels; else TLS verifying servers against this CA (copied) */
    const char *tls_cert_file; /* client certificate + key for mTLS; NULL = none (copied) */
    const char *tls_key_file;
    int keepalive_ms;          /* as bt_rpc_channel_config_t */
    size_t max_message;
    int capacity;              /* open channels at most; 0 = BT_RPC_CHCACHE_DEFAULT_CAP */
} bt_rpc_chcache_config_t;

/* Creates an empty cache (files are read when a channel is made). BT_ERR_NOMEM; *out set only on success. */
bt_status bt_rpc_chcache_create(const bt_rpc_chcache_config_t *cfg, bt_rpc_chcache_t **out);

/* A channel to target, held by the caller until bt_rpc_chcache_release. With TLS, identity (a node id; NULL or ""
 * = the target's host) is the name the server's certificate must carry: a server holding another identity fails
 * the handshake (its calls end UNAVAILABLE). Returns BT_ERR_INVALID (target not host:port: see
 * bt_tls_check_member_addr; unreadable TLS files), BT_ERR_EXHAUSTED (every cached channel is held) or
 * BT_ERR_NOMEM. Thread-safe; does not connect. */
bt_status bt_rpc_chcache_get(bt_rpc_chcache_t *c, const char *target, const char *identity, bt_rpc_channel_t **out);

/* Gives back a channel from bt_rpc_chcache_get (it stays cached). NULL is a no-op. Thread-safe. */
void bt_rpc_chcache_release(bt_rpc_chcache_t *c, bt_rpc_channel_t *ch);

/* Open channels now and channels closed by eviction so far; either pointer may be NULL. */
void bt_rpc_chcache_stats(bt_rpc_chcache_t *c, int *open, uint64_t *evictions);

/* Closes every channel; none may be held. NULL is a no-op. */
void bt_rpc_chcache_destroy(bt_rpc_chcache_t *c);

#endif
