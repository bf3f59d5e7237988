/* HTTP/1.1 server over libmicrohttpd, with routes, body limits, JSON and OpenAI-style errors, optional bearer API
 * keys, a built-in /metrics route, deferred answers and Server-Sent Events (SSE) streams.
 *
 * Threads: libmicrohttpd runs an epoll thread pool (MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME);
 * handlers run on those threads, so a handler must not block for long. Work that takes time answers later from
 * another thread, either with http_request_defer() (one answer) or http_stream_start() (SSE). While a connection
 * waits for such an answer it is suspended and costs no thread.
 *
 * Lifecycle: http_server_create -> http_server_route (any number) -> http_server_start -> ... ->
 * http_server_stop -> http_server_destroy. Routes are fixed once started.
 *
 * Before a handler runs, the server itself answers: 404 (unknown path), 405 with Allow (known path, other
 * method), 401 (HTTP_ROUTE_AUTH route without a valid key), 413 (body over max_body, decided from
 * Content-Length before the body is read, or while reading a chunked body), 503 with Retry-After (the body does
 * not fit the memory budget), all with OpenAI-style JSON errors. A connection is closed when its request has not
 * fully arrived within read_timeout_s (slow-loris clients), and one client address holds at most max_per_ip.
 * HEAD is served by the GET route. libmicrohttpd sends with MSG_NOSIGNAL: no SIGPIPE handling is needed.
 *
 * Errors: BT_ERR_INVALID (bad argument), BT_ERR_IO (cannot bind or start), BT_ERR_NOMEM, BT_ERR_UNAVAILABLE
 * (server stopping), BT_ERR_PEER (the client went away), BT_ERR_EXHAUSTED (a stream's buffer is full).
 * bt_last_error() says which. */
#ifndef BATON_COMMON_HTTP_H
#define BATON_COMMON_HTTP_H

#include "common/metrics.h"
#include "common/status.h"

#include <cjson/cJSON.h>
#include <stddef.h>

#define HTTP_DEFAULT_THREADS 4
#define HTTP_DEFAULT_MAX_CONNECTIONS 1024
#define HTTP_DEFAULT_MAX_BODY (4u << 20)
#define HTTP_DEFAULT_HEARTBEAT_MS 15000
#define HTTP_DEFAULT_STREAM_BUFFER (4u << 20)
#define HTTP_DEFAULT_TIMEOUT_S 60
#define HTTP_DEFAULT_MAX_PER_IP 256         /* connections one client address may hold */
#define HTTP_DEFAULT_READ_TIMEOUT_S 30      /* a request's headers and body must arrive within this */
#define HTTP_DEFAULT_MAX_MEMORY (256u << 20) /* request bodies + SSE buffers, all connections together */

typedef struct http_config {
    const char *address;           /* numeric IPv4 or IPv6 address or host name to bind; required (DESIGN 9) */
    int port;                      /* 0: pick a free port; http_server_port() tells which */
    unsigned threads;              /* MHD worker threads; 0 = HTTP_DEFAULT_THREADS */
    unsigned max_connections;      /* 0 = HTTP_DEFAULT_MAX_CONNECTIONS; over it new connections are closed */
    size_t max_body;               /* request body limit in bytes (413 beyond); 0 = HTTP_DEFAULT_MAX_BODY */
    unsigned heartbeat_ms;         /* SSE ": ping" after this long without data; 0 = HTTP_DEFAULT_HEARTBEAT_MS */
    size_t stream_buffer;          /* bytes an SSE stream may queue for a slow client; 0 = default */
    unsigned timeout_s;            /* idle connection timeout (not counted while suspended); 0 = default */
    unsigned max_per_ip;           /* connections per client address (more are closed at once); 0 = default */
    unsigned read_timeout_s;       /* from a connection's start (or its previous answer) to a complete request:
                                    * past it the connection is closed, however slowly bytes trickle; 0 = default */
    size_t max_memory;             /* bytes all request bodies and SSE buffers may hold; a body over it gets 503,
                                    * an SSE stream BT_ERR_EXHAUSTED; 0 = default */
    const char *const *api_keys;   /* n_api_keys accepted bearer keys for HTTP_ROUTE_AUTH routes; none: no check */
    size_t n_api_keys;
    metrics_registry_t *metrics;   /* non-NULL: GET /metrics serves it (no API key); must outlive the server */
    const char *tls_cert_file;     /* PEM chain + key: HTTPS instead of HTTP (read at create); NULL = plain HTTP */
    const char *tls_key_file;
} http_config_t;

typedef struct http_server http_server_t;
typedef struct http_request http_request_t;
typedef struct http_stream http_stream_t;

/* A route handler, called on an MHD thread once the whole body has arrived. It must, before returning, answer
 * (http_respond*), start a stream (http_stream_start) or defer (http_request_defer); if it does none, the client
 * gets 500. req is valid only during the call unless deferred. */
typedef void (*http_handler_fn)(http_request_t *req, void *arg);

#define HTTP_ROUTE_AUTH 1u   /* require `Authorization: Bearer <key>` when the server has API keys (else 401) */
#define HTTP_ROUTE_PREFIX 2u /* path matches every path that starts with it (e.g. "/v1/models/") */

/* Creates a server (binds nothing yet). Config strings and keys are copied. BT_ERR_INVALID / BT_ERR_NOMEM. */
bt_status http_server_create(const http_config_t *cfg, http_server_t **out);

/* Adds a route for method ("GET", "POST", ...) and path; exact routes win over prefix routes, longer prefixes
 * over shorter ones. A known path with another method gets 405, an unknown path 404. Only before start.
 * Returns BT_ERR_INVALID (started, duplicate, bad argument) or BT_ERR_NOMEM. */
bt_status http_server_route(http_server_t *s, const char *method, const char *path, unsigned flags,
                            http_handler_fn fn, void *arg);

/* Binds and starts serving. BT_ERR_IO when the address cannot be bound (message says why). */
bt_status http_server_start(http_server_t *s);

/* Bytes request bodies and SSE buffers hold now (what max_memory bounds). Lock-free. */
size_t http_server_memory(const http_server_t *s);

/* The bound port (the one picked when config port was 0); 0 before start. */
int http_server_port(const http_server_t *s);

/* Stops serving: stops accepting, ends every open stream (their gone callbacks fire), answers deferred requests
 * with 503 (waiting up to 2 s for those connections to drain), then stops libmicrohttpd. Blocks until its threads
 * have exited; must not be called from a handler or a gone callback. Streams
 * and deferred requests still held by producers stay valid (their calls return BT_ERR_UNAVAILABLE or
 * BT_ERR_PEER) until the producer ends or answers them. Idempotent. */
void http_server_stop(http_server_t *s);

/* Stops if needed and frees the server. Producers must have ended their streams and answered their deferred
 * requests first. NULL is a no-op. */
void http_server_destroy(http_server_t *s);

/* Request accessors; valid while req is (in the handler, or until a deferred request is answered). */
const char *http_request_method(const http_request_t *req);
const char *http_request_path(const http_request_t *req);
/* The body (NUL-terminated; *len without the NUL may be NULL). Never NULL: "" when there is none. */
const char *http_request_body(const http_request_t *req, size_t *len);
/* A header (case-insensitive name) or query argument; NULL when absent. Only inside the handler. */
const char *http_request_header(http_request_t *req, const char *name);
const char *http_request_query(http_request_t *req, const char *key);
/* Parses the body as JSON into *out (caller frees with cJSON_Delete). BT_ERR_FORMAT, with a message fit for a 400
 * answer, when it is not JSON, not an object, has a string holding \u0000 (C strings would cut it short) or an
 * object holding one key twice (cJSON would take the first silently). */
bt_status http_request_json(const http_request_t *req, cJSON **out);

/* What http_request_json does to a body of len bytes (which need not be NUL-terminated). */
bt_status http_json_parse(const char *body, size_t len, cJSON **out);

/* Adds a header to the answer that follows (e.g. Retry-After). Copied. BT_ERR_NOMEM / BT_ERR_INVALID. */
bt_status http_response_header(http_request_t *req, const char *name, const char *value);

/* Answers with status and body (copied). Exactly one answer per request; for a deferred request it may be
 * called from any thread and ends the caller's hold on req (req is invalid afterwards, even on error).
 * Returns BT_ERR_INVALID (already answered), BT_ERR_NOMEM. */
bt_status http_respond(http_request_t *req, int status, const char *content_type, const void *body, size_t len);
/* Answers with json printed compactly, Content-Type application/json. json stays the caller's. */
bt_status http_respond_json(http_request_t *req, int status, const cJSON *json);
/* Answers with an OpenAI-style error body {"error":{"message","type","param":null,"code"}}. type and code NULL:
 * defaults by status: type invalid_request_error with code invalid_request (400), invalid_api_key (401),
 * not_found (404), method_not_allowed (405), request_too_large (413); rate_limit_error/rate_limit_exceeded (429);
 * server_error with internal_error (500 and other 5xx) or service_unavailable (503). message NULL: the reason
 * phrase. Adds `WWW-Authenticate: Bearer` to a 401. */
bt_status http_respond_error(http_request_t *req, int status, const char *message, const char *type,
                             const char *code);

/* Keeps req after the handler returns, to answer later from any thread with http_respond*; the connection is
 * suspended meanwhile (a client disconnect is not noticed until the answer is written). If the server stops
 * first, the client gets 503 and the later answer is dropped (still call it, to release req). Only in the
 * handler. BT_ERR_INVALID (already answered or deferred). */
bt_status http_request_defer(http_request_t *req);

/* For a deferred request: 1 when its client has gone (the connection closed, reset, or the client shut down its
 * sending side: a suspended connection does not notice by itself), or the server dropped the request; 0 while the
 * client waits. Looks at the socket without reading from it; any thread; does not block. */
int http_request_client_gone(http_request_t *req);

/* Called at most once, under the stream's lock, when the connection closes before the stream's end was sent
 * (client disconnect, network error, server stop). It must only flag or signal (no http_stream_* calls, no
 * blocking). Never called after http_stream_end returns. */
typedef void (*http_stream_gone_fn)(http_stream_t *st, void *arg);

/* Starts an SSE answer (200, Content-Type text/event-stream, Cache-Control no-cache, chunked). *out is the
 * producer's handle: use it from any thread, and call http_stream_end exactly once. Only in the handler.
 * BT_ERR_INVALID (already answered), BT_ERR_UNAVAILABLE (stopping), BT_ERR_NOMEM. */
bt_status http_stream_start(http_request_t *req, http_stream_gone_fn on_gone, void *arg, http_stream_t **out);

/* Queues one event `data: <data>\n\n` (a data line per line of data) and wakes the connection. Does not block.
 * BT_ERR_PEER when the client is gone, BT_ERR_EXHAUSTED when the client reads too slowly (buffer full), both
 * final: the producer should abort and end the stream. */
bt_status http_stream_send(http_stream_t *st, const char *data, size_t len);
/* Same, with an `event: <name>` line first. */
bt_status http_stream_send_event(http_stream_t *st, const char *event, const char *data, size_t len);
/* Queues bytes as they are (already SSE-formatted by the caller). */
bt_status http_stream_send_raw(http_stream_t *st, const void *bytes, size_t len);

/* True once the client has gone (the gone callback has fired or would have). Lock-free. */
int http_stream_client_gone(const http_stream_t *st);

/* Ends the stream after the queued bytes are sent, and releases the producer's handle (st is invalid
 * afterwards). The caller sends any final event (OpenAI: "data: [DONE]") before. Can't fail. */
void http_stream_end(http_stream_t *st);

/* Status reason phrase ("Not Found"); "Unknown" for codes it does not know. */
const char *http_status_text(int status);

#endif
