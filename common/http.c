/* HTTP server over libmicrohttpd with SSE streaming; see http.h.
 *
 * Locking: server->mu (route-independent lists, stopping flag) is taken before a request's or a stream's mu,
 * never after. MHD_resume_connection is only called under the owner's mu while its `suspended` flag is set,
 * and the flag is cleared when the connection closes, so nothing resumes a connection MHD has freed. */
#include "common/http.h"

#include "common/list.h"
#include "common/log.h"
#include "common/tls.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define HTTP_STOP_DRAIN_MS 2000 /* how long stop waits for streams to close and deferred requests to get 503 */

typedef struct route {
    char *method;
    char *path;
    size_t path_len;
    unsigned flags;
    http_handler_fn fn;
    void *arg;
} route_t;

/* One open connection, for the read deadline: listed from MHD's start notice to its close notice, under the
 * server's mu. MHD closes the socket only after the close notice, so shutdown() on a listed fd is safe. */
typedef struct conn_track {
    MHD_socket fd;
    atomic_ullong since_ms; /* when the connection started or its last answer was done */
    atomic_int busy;        /* a request has fully arrived and is being answered: no read deadline */
    int shut;
    bt_list_node link; /* in the server's conns */
} conn_track_t;

struct http_server {
    char *address;
    int cfg_port;
    unsigned threads, max_connections, heartbeat_ms, timeout_s, max_per_ip, read_timeout_s;
    size_t max_body, stream_buffer, max_memory;
    atomic_size_t mem_used;    /* bytes reserved by request bodies and SSE buffers */
    bt_list conns;             /* conn_track_t, under mu */
    char **keys;
    size_t n_keys;
    metrics_registry_t *metrics;
    char *tls_cert, *tls_key; /* PEM text: HTTPS when set */

    route_t *routes;
    size_t n_routes;

    struct MHD_Daemon *daemon;
    int port;
    int started;

    pthread_mutex_t mu;
    pthread_cond_t cv;     /* wakes the heartbeat thread on stop */
    atomic_int stopping;
    bt_list streams;                   /* struct http_stream: open streams (heartbeats, stop) */
    bt_list deferred;                  /* http_request_t: requests answered later (stop) */
    pthread_t hb_thread;
    int hb_running;
};

enum req_state {
    REQ_NEW,      /* handler has not answered yet */
    REQ_ANSWERED, /* resp holds the answer, not yet queued */
    REQ_DEFERRED, /* waiting for http_respond from another thread */
    REQ_STREAM,   /* resp is the SSE answer, not yet queued */
    REQ_QUEUED,   /* handed to MHD */
    REQ_DROPPED,  /* deferred but the server stopped (503 sent); a late answer is discarded */
};

typedef struct hdr {
    char *name, *value;
} hdr_t;

struct http_request {
    http_server_t *srv;
    struct MHD_Connection *conn; /* NULL once the connection is done */
    char *method, *path;
    const route_t *route;
    char *body;
    size_t body_len, body_cap, discarded;
    int too_large, handled, over_budget;
    size_t mem; /* bytes of body reserved against the server's memory budget */
    hdr_t *hdrs;
    size_t n_hdrs;

    pthread_mutex_t mu; /* guards state, resp, resp_status, suspended, conn for deferred answers */
    enum req_state state;
    struct MHD_Response *resp;
    unsigned resp_status;
    int suspended;
    int producer; /* a deferred answer is still owed (the producer holds a reference) */
    atomic_int refs;
    bt_list_node deferred_link; /* in the server's deferred list while an answer is owed */
    struct http_stream *stream; /* holds one reference */
};

struct http_stream {
    pthread_mutex_t mu;
    struct MHD_Connection *conn; /* NULL once detached from the connection */
    char *buf;
    size_t off, len, cap, max;
    int ended, suspended, closing, detached;
    atomic_int gone;
    uint64_t last_ms; /* last time bytes were queued or written (heartbeat clock) */
    http_stream_gone_fn on_gone;
    void *gone_arg;
    atomic_int refs; /* producer + response + request */
    http_server_t *srv;
    bt_list_node link; /* in the server's streams from http_stream_start until detached */
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

const char *http_status_text(int status)
{
    const char *s = status > 0 ? MHD_get_reason_phrase_for((unsigned)status) : NULL;
    return s && *s ? s : "Unknown";
}

static void mhd_logger(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = 0;
    BT_DEBUG("http", "libmicrohttpd: %s", msg);
}

/* ---- server lifecycle ---- */

static void metrics_route(http_request_t *req, void *arg);

bt_status http_server_create(const http_config_t *cfg, http_server_t **out)
{
    if (!cfg || !cfg->address || !*cfg->address) return bt_fail(BT_ERR_INVALID, "http: a listen address is required");
    if (cfg->port < 0 || cfg->port > 65535) return bt_fail(BT_ERR_INVALID, "http: bad port %d", cfg->port);
    http_server_t *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    atomic_init(&s->stopping, 0);
    s->cfg_port = cfg->port;
    s->threads = cfg->threads ? cfg->threads : HTTP_DEFAULT_THREADS;
    s->max_connections = cfg->max_connections ? cfg->max_connections : HTTP_DEFAULT_MAX_CONNECTIONS;
    s->max_body = cfg->max_body ? cfg->max_body : HTTP_DEFAULT_MAX_BODY;
    s->heartbeat_ms = cfg->heartbeat_ms ? cfg->heartbeat_ms : HTTP_DEFAULT_HEARTBEAT_MS;
    s->stream_buffer = cfg->stream_buffer ? cfg->stream_buffer : HTTP_DEFAULT_STREAM_BUFFER;
    s->timeout_s = cfg->timeout_s ? cfg->timeout_s : HTTP_DEFAULT_TIMEOUT_S;
    s->max_per_ip = cfg->max_per_ip ? cfg->max_per_ip : HTTP_DEFAULT_MAX_PER_IP;
    s->read_timeout_s = cfg->read_timeout_s ? cfg->read_timeout_s : HTTP_DEFAULT_READ_TIMEOUT_S;
    s->max_memory = cfg->max_memory ? cfg->max_memory : HTTP_DEFAULT_MAX_MEMORY;
    atomic_init(&s->mem_used, 0);
    s->metrics = cfg->metrics;
    if (s->max_connections < s->threads) s->max_connections = s->threads;
    if (!(s->address = strdup(cfg->address))) goto oom;
    if (!cfg->tls_cert_file != !cfg->tls_key_file) {
        http_server_destroy(s);
        return bt_fail(BT_ERR_INVALID, "http: HTTPS needs both a certificate and a key file");
    }
    if (cfg->tls_cert_file) {
        bt_status st = bt_tls_load_file("https certificate", cfg->tls_cert_file, &s->tls_cert);
        if (!st) st = bt_tls_load_file("https key", cfg->tls_key_file, &s->tls_key);
        if (st) {
            http_server_destroy(s);
            return st;
        }
    }
    if (cfg->n_api_keys) {
        if (!cfg->api_keys) goto invalid;
        if (!(s->keys = calloc(cfg->n_api_keys, sizeof *s->keys))) goto oom;
        for (size_t i = 0; i < cfg->n_api_keys; i++) {
            if (!cfg->api_keys[i] || !*cfg->api_keys[i]) goto invalid;
            if (!(s->keys[i] = strdup(cfg->api_keys[i]))) goto oom;
            s->n_keys = i + 1;
        }
    }
    if (s->metrics) {
        bt_status st = http_server_route(s, "GET", "/metrics", 0, metrics_route, s);
        if (st != BT_OK) {
            http_server_destroy(s);
            return st;
        }
    }
    *out = s;
    return BT_OK;
invalid:
    http_server_destroy(s);
    return bt_fail(BT_ERR_INVALID, "http: empty API key");
oom:
    http_server_destroy(s);
    return bt_fail(BT_ERR_NOMEM, "http: out of memory");
}

bt_status http_server_route(http_server_t *s, const char *method, const char *path, unsigned flags,
                            http_handler_fn fn, void *arg)
{
    if (!s || !method || !*method || !path || path[0] != '/' || !fn)
        return bt_fail(BT_ERR_INVALID, "http: bad route arguments");
    if (s->started) return bt_fail(BT_ERR_INVALID, "http: routes are fixed once the server started");
    for (size_t i = 0; i < s->n_routes; i++) {
        const route_t *r = &s->routes[i];
        if (strcmp(r->method, method) == 0 && strcmp(r->path, path) == 0 &&
            (r->flags & HTTP_ROUTE_PREFIX) == (flags & HTTP_ROUTE_PREFIX))
            return bt_fail(BT_ERR_INVALID, "http: route %s %s registered twice", method, path);
    }
    route_t *nr = realloc(s->routes, (s->n_routes + 1) * sizeof *nr);
    if (!nr) return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    s->routes = nr;
    route_t *r = &nr[s->n_routes];
    r->method = strdup(method);
    r->path = strdup(path);
    if (!r->method || !r->path) {
        free(r->method);
        free(r->path);
        return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    }
    r->path_len = strlen(path);
    r->flags = flags;
    r->fn = fn;
    r->arg = arg;
    s->n_routes++;
    return BT_OK;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls);
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe);
static void *heartbeat_main(void *arg);

/* Reserves n bytes of the memory budget: 1, or 0 when they do not fit. */
static int mem_take(http_server_t *s, size_t n)
{
    size_t cur = atomic_load(&s->mem_used);
    do {
        if (n > s->max_memory || cur > s->max_memory - n) return 0;
    } while (!atomic_compare_exchange_weak(&s->mem_used, &cur, cur + n));
    return 1;
}

static void mem_give(http_server_t *s, size_t n)
{
    if (n) atomic_fetch_sub(&s->mem_used, n);
}

size_t http_server_memory(const http_server_t *s)
{
    return s ? atomic_load((atomic_size_t *)&s->mem_used) : 0;
}

/* MHD's start and close notices: the connection list the read deadline walks. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    http_server_t *s = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        conn_track_t *t = ci ? calloc(1, sizeof *t) : NULL;
        *socket_context = t;
        if (!t) return; /* untracked: only the idle timeout applies */
        t->fd = ci->connect_fd;
        atomic_init(&t->since_ms, now_ms());
        atomic_init(&t->busy, 0);
        pthread_mutex_lock(&s->mu);
        bt_list_push_front(&s->conns, &t->link);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    conn_track_t *t = *socket_context;
    if (!t) return;
    pthread_mutex_lock(&s->mu);
    bt_list_remove(&s->conns, &t->link);
    pthread_mutex_unlock(&s->mu);
    *socket_context = NULL;
    free(t);
}

static conn_track_t *conn_track_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* Under s->mu: closes every connection whose request is overdue (headers or body still trickling in). */
static void reap_slow_locked(http_server_t *s, uint64_t now)
{
    uint64_t limit = (uint64_t)s->read_timeout_s * 1000u;
    BT_LIST_FOR(t, &s->conns, conn_track_t, link) {
        if (t->shut || atomic_load(&t->busy) || now - atomic_load(&t->since_ms) < limit) continue;
        shutdown(t->fd, SHUT_RDWR); /* MHD sees the end of the stream and closes the connection itself */
        t->shut = 1;
    }
}

/* MHD's accept policy: no new connection once stop began. (MHD_quiesce_daemon did this by taking the listen socket
 * out of each pool thread's epoll set, racing the threads that do the same: libmicrohttpd 0.9.75 then aborted the
 * process with "Failed to remove listen FD from epoll set", seen once in test_http.) */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t len)
{
    (void)addr;
    (void)len;
    const http_server_t *s = cls;
    return atomic_load(&s->stopping) ? MHD_NO : MHD_YES;
}

bt_status http_server_start(http_server_t *s)
{
    if (!s) return bt_fail(BT_ERR_INVALID, "http: no server");
    if (s->started) return bt_fail(BT_ERR_INVALID, "http: already started");
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", s->cfg_port);
    int gai = getaddrinfo(s->address, port_text, &hints, &ai);
    if (gai != 0 || !ai) return bt_fail(BT_ERR_IO, "http: cannot resolve %s: %s", s->address, gai_strerror(gai));
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_OptionItem tls[3] = {{MHD_OPTION_END, 0, NULL}, {MHD_OPTION_END, 0, NULL}, {MHD_OPTION_END, 0, NULL}};
    if (s->tls_cert) { /* libmicrohttpd with GnuTLS (Debian 12: MHD_FEATURE_TLS) */
        flags |= MHD_USE_TLS;
        tls[0] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, s->tls_key};
        tls[1] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, s->tls_cert};
    }
    s->daemon = MHD_start_daemon(flags, (uint16_t)s->cfg_port, on_accept, s, on_access, s,
                                 MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                 MHD_OPTION_THREAD_POOL_SIZE, s->threads,
                                 MHD_OPTION_CONNECTION_LIMIT, s->max_connections,
                                 MHD_OPTION_PER_IP_CONNECTION_LIMIT, s->max_per_ip,
                                 MHD_OPTION_NOTIFY_CONNECTION, on_connection, s,
                                 MHD_OPTION_CONNECTION_TIMEOUT, s->timeout_s,
                                 MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024u,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                                 MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, s,
                                 MHD_OPTION_ARRAY, tls,
                                 MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->daemon) return bt_fail(BT_ERR_IO, "http: cannot listen on %s:%d (in use or not permitted)", s->address,
                                   s->cfg_port);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = info ? info->port : s->cfg_port;
    if (pthread_create(&s->hb_thread, NULL, heartbeat_main, s) != 0) {
        MHD_stop_daemon(s->daemon);
        s->daemon = NULL;
        return bt_fail(BT_ERR_IO, "http: cannot start the heartbeat thread");
    }
    s->hb_running = 1;
    s->started = 1;
    BT_INFO("http", "listening on %s port %d%s", s->address, s->port, s->tls_cert ? " (HTTPS)" : "");
    return BT_OK;
}

int http_server_port(const http_server_t *s)
{
    return s ? s->port : 0;
}

/* Under s->mu: a stream or a deferred request still has to close or get its 503. */
static int draining_locked(const http_server_t *s)
{
    return !bt_list_empty(&s->streams) || !bt_list_empty(&s->deferred);
}

void http_server_stop(http_server_t *s)
{
    if (!s || !s->daemon) return;
    atomic_store(&s->stopping, 1); /* no new connections (on_accept) */
    pthread_mutex_lock(&s->mu);
    BT_LIST_FOR(st, &s->streams, struct http_stream, link) {
        pthread_mutex_lock(&st->mu);
        st->closing = 1;
        if (st->suspended && st->conn) {
            st->suspended = 0;
            MHD_resume_connection(st->conn);
        }
        pthread_mutex_unlock(&st->mu);
    }
    BT_LIST_FOR(r, &s->deferred, http_request_t, deferred_link) {
        pthread_mutex_lock(&r->mu);
        if (r->suspended && r->conn) {
            r->suspended = 0;
            MHD_resume_connection(r->conn);
        }
        pthread_mutex_unlock(&r->mu);
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (s->hb_running) {
        pthread_join(s->hb_thread, NULL);
        s->hb_running = 0;
    }
    /* let resumed connections close their streams and send their 503s, for a bounded time */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += HTTP_STOP_DRAIN_MS / 1000;
    deadline.tv_nsec += (long)(HTTP_STOP_DRAIN_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (draining_locked(s) && pthread_cond_timedwait(&s->cv, &s->mu, &deadline) == 0) {
    }
    if (draining_locked(s)) BT_WARN("http", "stopping with connections still draining");
    pthread_mutex_unlock(&s->mu);
    MHD_stop_daemon(s->daemon);
    s->daemon = NULL;
}

void http_server_destroy(http_server_t *s)
{
    if (!s) return;
    http_server_stop(s);
    for (size_t i = 0; i < s->n_routes; i++) {
        free(s->routes[i].method);
        free(s->routes[i].path);
    }
    free(s->routes);
    for (size_t i = 0; i < s->n_keys; i++) free(s->keys[i]);
    free(s->keys);
    free(s->address);
    free(s->tls_cert);
    if (s->tls_key) memset(s->tls_key, 0, strlen(s->tls_key));
    free(s->tls_key);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- requests ---- */

static void stream_release(struct http_stream *st);

static void request_release(http_request_t *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    mem_give(r->srv, r->mem);
    if (r->resp) MHD_destroy_response(r->resp);
    if (r->stream) stream_release(r->stream);
    for (size_t i = 0; i < r->n_hdrs; i++) {
        free(r->hdrs[i].name);
        free(r->hdrs[i].value);
    }
    free(r->hdrs);
    free(r->body);
    free(r->method);
    free(r->path);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

const char *http_request_method(const http_request_t *req)
{
    return req->method;
}

const char *http_request_path(const http_request_t *req)
{
    return req->path;
}

const char *http_request_body(const http_request_t *req, size_t *len)
{
    if (len) *len = req->body_len;
    return req->body ? req->body : "";
}

const char *http_request_header(http_request_t *req, const char *name)
{
    return req->conn ? MHD_lookup_connection_value(req->conn, MHD_HEADER_KIND, name) : NULL;
}

const char *http_request_query(http_request_t *req, const char *key)
{
    return req->conn ? MHD_lookup_connection_value(req->conn, MHD_GET_ARGUMENT_KIND, key) : NULL;
}

bt_status http_request_json(const http_request_t *req, cJSON **out)
{
    size_t len;
    const char *body = http_request_body(req, &len);
    return http_json_parse(body, len, out);
}

/* 1 when a JSON string in s holds the escape \u0000: cJSON keeps C strings, so the text after it would silently
 * vanish. s is valid JSON (cJSON accepted it). */
static int json_has_nul_escape(const char *s, size_t n)
{
    int in_string = 0;
    for (size_t i = 0; i < n; i++) {
        if (!in_string) {
            in_string = s[i] == '"';
        } else if (s[i] == '"') {
            in_string = 0;
        } else if (s[i] == '\\') {
            if (i + 5 < n && s[i + 1] == 'u' && !memcmp(s + i + 2, "0000", 4)) return 1;
            i++; /* the escaped character */
        }
    }
    return 0;
}

static int cmp_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The first key that appears twice in an object of j (at any depth) into dup, or "" when none does; cJSON would
 * silently take the first. Sorting keeps it O(n log n) for objects of many keys. BT_ERR_NOMEM. */
static bt_status json_duplicate_key(const cJSON *j, char *dup, size_t cap)
{
    size_t n = 0;
    for (const cJSON *c = j->child; c; c = c->next) n++;
    if (cJSON_IsObject(j) && n > 1) {
        char **names = malloc(n * sizeof *names);
        if (!names) return bt_fail(BT_ERR_NOMEM, "out of memory");
        size_t k = 0;
        for (const cJSON *c = j->child; c; c = c->next) names[k++] = c->string ? c->string : "";
        qsort(names, n, sizeof *names, cmp_names);
        for (size_t i = 1; i < n && !*dup; i++)
            if (!strcmp(names[i - 1], names[i])) snprintf(dup, cap, "%s", names[i]);
        free(names);
    }
    for (const cJSON *c = j->child; c && !*dup; c = c->next) {
        bt_status st = json_duplicate_key(c, dup, cap);
        if (st) return st;
    }
    return BT_OK;
}

bt_status http_json_parse(const char *body, size_t len, cJSON **out)
{
    if (len == 0) return bt_fail(BT_ERR_FORMAT, "request body is empty; expected a JSON object");
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (j && end) { /* trailing bytes other than whitespace (or an embedded NUL) make it invalid */
        while (end < body + len && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n')) end++;
        if (end != body + len) {
            cJSON_Delete(j);
            j = NULL;
        }
    }
    if (!j) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        return bt_fail(BT_ERR_FORMAT, "request body is not valid JSON (near byte %zu)", at);
    }
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return bt_fail(BT_ERR_FORMAT, "request body must be a JSON object");
    }
    if (json_has_nul_escape(body, len)) {
        cJSON_Delete(j);
        return bt_fail(BT_ERR_FORMAT, "request body holds \\u0000 in a string: NUL characters are not accepted");
    }
    char dup[128] = "";
    bt_status st = json_duplicate_key(j, dup, sizeof dup);
    if (st || *dup) {
        cJSON_Delete(j);
        return st ? st : bt_fail(BT_ERR_FORMAT, "request body has the key '%s' twice in one object", dup);
    }
    *out = j;
    return BT_OK;
}

bt_status http_response_header(http_request_t *req, const char *name, const char *value)
{
    if (!req || !name || !*name || !value) return bt_fail(BT_ERR_INVALID, "http: bad header");
    hdr_t *nh = realloc(req->hdrs, (req->n_hdrs + 1) * sizeof *nh);
    if (!nh) return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    req->hdrs = nh;
    nh[req->n_hdrs].name = strdup(name);
    nh[req->n_hdrs].value = strdup(value);
    if (!nh[req->n_hdrs].name || !nh[req->n_hdrs].value) {
        free(nh[req->n_hdrs].name);
        free(nh[req->n_hdrs].value);
        return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    }
    req->n_hdrs++;
    return BT_OK;
}

static void add_headers(http_request_t *req, struct MHD_Response *resp)
{
    for (size_t i = 0; i < req->n_hdrs; i++) MHD_add_response_header(resp, req->hdrs[i].name, req->hdrs[i].value);
}

/* Hands an answer to the request: stored for the MHD thread to queue, resuming the connection if it waits.
 * Takes ownership of resp in every case. */
static bt_status request_answer(http_request_t *req, unsigned status, struct MHD_Response *resp)
{
    pthread_mutex_lock(&req->mu);
    int was_deferred = req->producer;
    if (was_deferred && (req->state == REQ_DROPPED || !req->conn)) {
        /* the server stopped or the client left while we worked: nobody to answer */
        req->producer = 0;
        pthread_mutex_unlock(&req->mu);
        MHD_destroy_response(resp);
        request_release(req);
        return BT_OK;
    }
    if (req->state != REQ_NEW && req->state != REQ_DEFERRED) {
        pthread_mutex_unlock(&req->mu);
        MHD_destroy_response(resp);
        return bt_fail(BT_ERR_INVALID, "http: request answered twice");
    }
    req->resp = resp;
    req->resp_status = status;
    req->state = REQ_ANSWERED;
    if (req->suspended && req->conn) {
        req->suspended = 0;
        MHD_resume_connection(req->conn);
    }
    req->producer = 0;
    pthread_mutex_unlock(&req->mu);
    if (was_deferred) request_release(req);
    return BT_OK;
}

bt_status http_respond(http_request_t *req, int status, const char *content_type, const void *body, size_t len)
{
    if (!req) return bt_fail(BT_ERR_INVALID, "http: no request");
    if (status < 100 || status > 999) { /* still answer, so a deferred request is released */
        bt_status st = http_respond_error(req, 500, "internal error: bad status", NULL, NULL);
        return st == BT_OK ? bt_fail(BT_ERR_INVALID, "http: bad status %d", status) : st;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)(len ? body : ""), MHD_RESPMEM_MUST_COPY);
    if (!resp) {
        if (req->producer) { /* the caller's hold ends even on error */
            pthread_mutex_lock(&req->mu);
            int owed = req->producer;
            req->producer = 0;
            pthread_mutex_unlock(&req->mu);
            if (owed) request_release(req);
        }
        return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    }
    if (content_type) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    add_headers(req, resp);
    return request_answer(req, (unsigned)status, resp);
}

bt_status http_respond_json(http_request_t *req, int status, const cJSON *json)
{
    char *text = json ? cJSON_PrintUnformatted(json) : NULL;
    if (!text) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                                  "\"param\":null,\"code\":\"internal_error\"}}";
        http_respond(req, 500, "application/json", oom, sizeof oom - 1);
        return bt_fail(BT_ERR_NOMEM, "http: cannot print JSON");
    }
    bt_status st = http_respond(req, status, "application/json", text, strlen(text));
    cJSON_free(text);
    return st;
}

bt_status http_respond_error(http_request_t *req, int status, const char *message, const char *type,
                             const char *code)
{
    const char *dtype = "invalid_request_error", *dcode = NULL;
    switch (status) {
    case 400: dcode = "invalid_request"; break;
    case 401: dcode = "invalid_api_key"; break;
    case 404: dcode = "not_found"; break;
    case 405: dcode = "method_not_allowed"; break;
    case 413: dcode = "request_too_large"; break;
    case 429: dtype = "rate_limit_error"; dcode = "rate_limit_exceeded"; break;
    case 503: dtype = "server_error"; dcode = "service_unavailable"; break;
    default:
        if (status >= 500) {
            dtype = "server_error";
            dcode = "internal_error";
        }
    }
    cJSON *root = cJSON_CreateObject();
    cJSON *err = cJSON_AddObjectToObject(root, "error");
    if (err) {
        cJSON_AddStringToObject(err, "message", message ? message : http_status_text(status));
        cJSON_AddStringToObject(err, "type", type ? type : dtype);
        cJSON_AddNullToObject(err, "param");
        if (code || dcode)
            cJSON_AddStringToObject(err, "code", code ? code : dcode);
        else
            cJSON_AddNullToObject(err, "code");
    }
    if (status == 401) http_response_header(req, "WWW-Authenticate", "Bearer");
    bt_status st = http_respond_json(req, status, root);
    cJSON_Delete(root);
    return st;
}

bt_status http_request_defer(http_request_t *req)
{
    if (!req) return bt_fail(BT_ERR_INVALID, "http: no request");
    http_server_t *s = req->srv;
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&req->mu);
    if (req->state != REQ_NEW || req->producer) {
        pthread_mutex_unlock(&req->mu);
        pthread_mutex_unlock(&s->mu);
        return bt_fail(BT_ERR_INVALID, "http: request already answered or deferred");
    }
    req->state = REQ_DEFERRED;
    req->producer = 1;
    atomic_fetch_add(&req->refs, 1);
    bt_list_push_front(&s->deferred, &req->deferred_link);
    pthread_mutex_unlock(&req->mu);
    pthread_mutex_unlock(&s->mu);
    return BT_OK;
}

/* The peer closed or reset fd: a zero-length peek is its FIN; pipelined bytes (a next request) mean it is there. */
static int socket_closed(MHD_socket fd)
{
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return 0;
    if (n == 0) return 1;
    return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

int http_request_client_gone(http_request_t *req)
{
    if (!req) return 1;
    pthread_mutex_lock(&req->mu);
    int gone = req->state == REQ_DROPPED || !req->conn;
    /* while suspended MHD neither reads nor closes the socket: it stays valid under req->mu */
    if (!gone && req->suspended) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(req->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        gone = ci && socket_closed(ci->connect_fd);
    }
    pthread_mutex_unlock(&req->mu);
    return gone;
}

/* ---- streams ---- */

static void stream_release(struct http_stream *st)
{
    if (atomic_fetch_sub(&st->refs, 1) != 1) return;
    mem_give(st->srv, st->cap);
    free(st->buf);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

/* Detaches a stream from its connection (idempotent): unlinks it from the server and fires the gone callback
 * when the stream's end was not delivered. */
static void stream_detach(struct http_stream *st, int completed_ok)
{
    http_server_t *s = st->srv;
    pthread_mutex_lock(&s->mu);
    pthread_mutex_lock(&st->mu);
    if (bt_list_remove(&s->streams, &st->link)) pthread_cond_broadcast(&s->cv);
    if (!st->detached) {
        st->detached = 1;
        st->conn = NULL;
        st->suspended = 0;
        if (!completed_ok) {
            atomic_store(&st->gone, 1);
            if (!st->ended && st->on_gone) st->on_gone(st, st->gone_arg);
        }
    }
    pthread_mutex_unlock(&st->mu);
    pthread_mutex_unlock(&s->mu);
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *out, size_t max)
{
    struct http_stream *st = cls;
    pthread_mutex_lock(&st->mu);
    if (st->len > st->off) {
        size_t n = st->len - st->off;
        if (n > max) n = max;
        memcpy(out, st->buf + st->off, n);
        st->off += n;
        if (st->off == st->len) st->off = st->len = 0;
        st->last_ms = now_ms();
        pthread_mutex_unlock(&st->mu);
        return (ssize_t)n;
    }
    if (st->closing || !st->conn) {
        pthread_mutex_unlock(&st->mu);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (st->ended) {
        pthread_mutex_unlock(&st->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    /* nothing to send: park the connection until a producer or the heartbeat resumes it */
    st->suspended = 1;
    MHD_suspend_connection(st->conn);
    pthread_mutex_unlock(&st->mu);
    return 0;
}

static void stream_response_free(void *cls)
{
    struct http_stream *st = cls;
    stream_detach(st, 0);
    stream_release(st);
}

bt_status http_stream_start(http_request_t *req, http_stream_gone_fn on_gone, void *arg, http_stream_t **out)
{
    if (!req || !out) return bt_fail(BT_ERR_INVALID, "http: bad stream arguments");
    http_server_t *s = req->srv;
    if (req->state != REQ_NEW || req->producer)
        return bt_fail(BT_ERR_INVALID, "http: request already answered or deferred");
    struct http_stream *st = calloc(1, sizeof *st);
    if (!st) return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    pthread_mutex_init(&st->mu, NULL);
    st->conn = req->conn;
    st->srv = s;
    st->max = s->stream_buffer;
    st->on_gone = on_gone;
    st->gone_arg = arg;
    st->last_ms = now_ms();
    atomic_init(&st->gone, 0);
    atomic_init(&st->refs, 1);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_reader, st, stream_response_free);
    if (!resp) {
        stream_release(st);
        return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    }
    atomic_store(&st->refs, 3); /* producer, response, request */
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    add_headers(req, resp);

    pthread_mutex_lock(&s->mu);
    if (atomic_load(&s->stopping)) {
        pthread_mutex_unlock(&s->mu);
        atomic_store(&st->refs, 1);
        st->detached = 1;
        MHD_destroy_response(resp); /* runs stream_response_free, which frees st */
        return bt_fail(BT_ERR_UNAVAILABLE, "http: server is stopping");
    }
    bt_list_push_front(&s->streams, &st->link);
    pthread_mutex_unlock(&s->mu);

    pthread_mutex_lock(&req->mu);
    req->stream = st;
    req->resp = resp;
    req->resp_status = MHD_HTTP_OK;
    req->state = REQ_STREAM;
    pthread_mutex_unlock(&req->mu);
    *out = st;
    return BT_OK;
}

static bt_status stream_queue(http_stream_t *st, const char *const *parts, const size_t *lens, size_t n_parts)
{
    size_t need = 0;
    for (size_t i = 0; i < n_parts; i++) need += lens[i];
    pthread_mutex_lock(&st->mu);
    bt_status rc = BT_OK;
    if (atomic_load(&st->gone) || st->detached) {
        rc = bt_fail(BT_ERR_PEER, "http: stream client is gone");
        goto out;
    }
    if (st->closing) {
        rc = bt_fail(BT_ERR_UNAVAILABLE, "http: server is stopping");
        goto out;
    }
    if (st->ended) {
        rc = bt_fail(BT_ERR_INVALID, "http: stream already ended");
        goto out;
    }
    size_t pending = st->len - st->off;
    if (pending + need > st->max) {
        rc = bt_fail(BT_ERR_EXHAUSTED, "http: client reads too slowly (%zu bytes pending)", pending);
        goto out;
    }
    if (st->off && st->len + need > st->cap) { /* compact before growing */
        memmove(st->buf, st->buf + st->off, pending);
        st->off = 0;
        st->len = pending;
    }
    if (st->len + need > st->cap) {
        size_t cap = st->cap ? st->cap : 1024;
        while (cap < st->len + need) cap *= 2;
        if (!mem_take(st->srv, cap - st->cap)) {
            rc = bt_fail(BT_ERR_EXHAUSTED, "http: the server's memory budget for streams is spent");
            goto out;
        }
        char *nb = realloc(st->buf, cap);
        if (!nb) {
            mem_give(st->srv, cap - st->cap);
            rc = bt_fail(BT_ERR_NOMEM, "http: out of memory");
            goto out;
        }
        st->buf = nb;
        st->cap = cap;
    }
    for (size_t i = 0; i < n_parts; i++) {
        memcpy(st->buf + st->len, parts[i], lens[i]);
        st->len += lens[i];
    }
    st->last_ms = now_ms();
    if (st->suspended && st->conn) {
        st->suspended = 0;
        MHD_resume_connection(st->conn);
    }
out:
    pthread_mutex_unlock(&st->mu);
    return rc;
}

bt_status http_stream_send_raw(http_stream_t *st, const void *bytes, size_t len)
{
    if (!st || (!bytes && len)) return bt_fail(BT_ERR_INVALID, "http: bad stream arguments");
    const char *p = bytes;
    return stream_queue(st, &p, &len, 1);
}

/* Formats [event: name\n] data: line\n ... \n into one allocation and queues it. */
static bt_status send_event(http_stream_t *st, const char *event, const char *data, size_t len)
{
    if (!st || (!data && len)) return bt_fail(BT_ERR_INVALID, "http: bad stream arguments");
    if (event && strpbrk(event, "\r\n")) return bt_fail(BT_ERR_INVALID, "http: event name has a newline");
    size_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += data[i] == '\n';
    size_t cap = (event ? strlen(event) + 8 : 0) + len + lines * 7 + 2;
    char stackbuf[1024];
    char *out = cap <= sizeof stackbuf ? stackbuf : malloc(cap);
    if (!out) return bt_fail(BT_ERR_NOMEM, "http: out of memory");
    size_t n = 0;
    if (event) n += (size_t)sprintf(out, "event: %s\n", event);
    size_t start = 0;
    for (size_t i = 0; i <= len; i++) {
        if (i == len || data[i] == '\n') {
            size_t end = i;
            if (end > start && data[end - 1] == '\r') end--; /* CRLF inside data: one line */
            memcpy(out + n, "data: ", 6);
            n += 6;
            memcpy(out + n, data + start, end - start);
            n += end - start;
            out[n++] = '\n';
            start = i + 1;
        }
    }
    out[n++] = '\n';
    const char *p = out;
    bt_status st2 = stream_queue(st, &p, &n, 1);
    if (out != stackbuf) free(out);
    return st2;
}

bt_status http_stream_send(http_stream_t *st, const char *data, size_t len)
{
    return send_event(st, NULL, data, len);
}

bt_status http_stream_send_event(http_stream_t *st, const char *event, const char *data, size_t len)
{
    return send_event(st, event, data, len);
}

int http_stream_client_gone(const http_stream_t *st)
{
    return st ? atomic_load((atomic_int *)&st->gone) : 1;
}

void http_stream_end(http_stream_t *st)
{
    if (!st) return;
    pthread_mutex_lock(&st->mu);
    st->ended = 1;
    if (st->suspended && st->conn) {
        st->suspended = 0;
        MHD_resume_connection(st->conn);
    }
    pthread_mutex_unlock(&st->mu);
    stream_release(st);
}

static void *heartbeat_main(void *arg)
{
    http_server_t *s = arg;
    uint64_t tick = s->heartbeat_ms / 4;
    if (tick < 5) tick = 5;
    if (tick > 1000) tick = 1000;
    static const char ping[] = ": ping\n\n";
    pthread_mutex_lock(&s->mu);
    while (!atomic_load(&s->stopping)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + tick * 1000000u;
        ts.tv_sec += (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        if (atomic_load(&s->stopping)) break;
        uint64_t now = now_ms();
        reap_slow_locked(s, now);
        BT_LIST_FOR(st, &s->streams, struct http_stream, link) {
            pthread_mutex_lock(&st->mu);
            if (st->conn && !st->ended && !st->closing && st->len == st->off &&
                now - st->last_ms >= s->heartbeat_ms) {
                size_t need = sizeof ping - 1;
                if (st->cap < need && mem_take(s, 1024 - st->cap)) {
                    char *nb = realloc(st->buf, 1024);
                    if (nb) {
                        st->buf = nb;
                        st->cap = 1024;
                    } else {
                        mem_give(s, 1024 - st->cap);
                    }
                }
                if (st->cap >= need) {
                    memcpy(st->buf, ping, need);
                    st->off = 0;
                    st->len = need;
                    st->last_ms = now;
                    if (st->suspended) {
                        st->suspended = 0;
                        MHD_resume_connection(st->conn);
                    }
                }
            }
            pthread_mutex_unlock(&st->mu);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- the MHD callbacks ---- */

static void metrics_route(http_request_t *req, void *arg)
{
    http_server_t *s = arg;
    char *text;
    size_t len;
    if (metrics_expose(s->metrics, &text, &len) != BT_OK) {
        http_respond_error(req, 500, "cannot render metrics", NULL, NULL);
        return;
    }
    http_respond(req, 200, METRICS_CONTENT_TYPE, text, len);
    free(text);
}

/* Finds the route for path+method. *known: some route serves this path (405 vs 404); allow gets its methods. */
static const route_t *find_route(const http_server_t *s, const char *path, const char *method, int *known,
                                 char *allow, size_t allow_cap)
{
    size_t best = 0;
    int found_any = 0;
    size_t plen = strlen(path);
    for (size_t i = 0; i < s->n_routes; i++) {
        const route_t *r = &s->routes[i];
        size_t score = 0;
        if (!(r->flags & HTTP_ROUTE_PREFIX)) {
            if (strcmp(r->path, path) == 0) score = SIZE_MAX;
        } else if (plen >= r->path_len && memcmp(r->path, path, r->path_len) == 0) {
            score = r->path_len;
        }
        if (score && score >= best) {
            best = score;
            found_any = 1;
        }
    }
    *known = found_any;
    allow[0] = 0;
    if (!found_any) return NULL;
    const route_t *hit = NULL;
    const char *want = strcmp(method, "HEAD") == 0 ? "GET" : method;
    for (size_t i = 0; i < s->n_routes; i++) {
        const route_t *r = &s->routes[i];
        size_t score = 0;
        if (!(r->flags & HTTP_ROUTE_PREFIX)) {
            if (strcmp(r->path, path) == 0) score = SIZE_MAX;
        } else if (plen >= r->path_len && memcmp(r->path, path, r->path_len) == 0) {
            score = r->path_len;
        }
        if (score != best) continue;
        if (!hit && strcmp(r->method, want) == 0) hit = r;
        size_t used = strlen(allow);
        snprintf(allow + used, allow_cap - used, "%s%s", used ? ", " : "", r->method);
    }
    return hit;
}

static int key_ok(const http_server_t *s, const char *auth)
{
    if (!auth || strncasecmp(auth, "Bearer ", 7) != 0) return 0;
    const char *given = auth + 7;
    while (*given == ' ') given++;
    size_t glen = strlen(given);
    int ok = 0;
    for (size_t k = 0; k < s->n_keys; k++) {
        const char *key = s->keys[k];
        size_t klen = strlen(key);
        unsigned char diff = (unsigned char)(glen != klen);
        for (size_t i = 0; i < klen; i++) diff |= (unsigned char)(key[i] ^ (i < glen ? given[i] : 0));
        ok |= diff == 0;
    }
    return ok;
}

/* Queues the stored answer (or a fallback) on the connection's thread. */
static enum MHD_Result queue_answer(http_request_t *req, struct MHD_Connection *conn)
{
    struct MHD_Response *resp = req->resp;
    unsigned status = req->resp_status;
    req->resp = NULL;
    req->state = REQ_QUEUED;
    enum MHD_Result rc = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* Answers early with an error before or during the upload (the handler is never called). */
static enum MHD_Result early_error(http_request_t *req, struct MHD_Connection *conn, int status, const char *msg,
                                   const char *allow)
{
    if (allow && *allow) http_response_header(req, "Allow", allow);
    http_respond_error(req, status, msg, NULL, NULL);
    req->handled = 1;
    pthread_mutex_lock(&req->mu);
    enum MHD_Result rc = req->state == REQ_ANSWERED ? queue_answer(req, conn) : MHD_NO;
    pthread_mutex_unlock(&req->mu);
    return rc;
}

/* The server is stopping under a deferred request: 503 now; the producer's late answer is discarded. */
static enum MHD_Result queue_503(struct MHD_Connection *conn)
{
    static const char body[] = "{\"error\":{\"message\":\"server is shutting down\",\"type\":\"server_error\","
                               "\"param\":null,\"code\":\"service_unavailable\"}}";
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(sizeof body - 1, (void *)body, MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_SERVICE_UNAVAILABLE, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* The memory budget for bodies is spent: 503 with Retry-After, before the body is read. */
static enum MHD_Result early_busy(http_request_t *req, struct MHD_Connection *conn)
{
    http_response_header(req, "Retry-After", "1");
    return early_error(req, conn, 503, "server busy: too much request data in flight, retry later", NULL);
}

/* Phase 1, headers only: route, method, API key and declared body size are decided before any body is read. */
static enum MHD_Result access_begin(http_server_t *s, struct MHD_Connection *conn, const char *url,
                                   const char *method, void **con_cls)
{
    http_request_t *req = calloc(1, sizeof *req);
    if (!req) return MHD_NO;
    pthread_mutex_init(&req->mu, NULL);
    atomic_init(&req->refs, 1);
    req->srv = s;
    req->conn = conn;
    req->method = strdup(method);
    req->path = strdup(url);
    *con_cls = req;
    if (!req->method || !req->path) return MHD_NO; /* on_completed frees req */
    int known;
    char allow[256];
    req->route = find_route(s, req->path, req->method, &known, allow, sizeof allow);
    if (!known) return early_error(req, conn, 404, "no such endpoint", NULL);
    if (!req->route) return early_error(req, conn, 405, "method not allowed on this endpoint", allow);
    if ((req->route->flags & HTTP_ROUTE_AUTH) && s->n_keys &&
        !key_ok(s, MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION)))
        return early_error(req, conn, 401, "invalid or missing API key", NULL);
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        unsigned long long n = strtoull(cl, NULL, 10);
        if (n > s->max_body) return early_error(req, conn, 413, "request body too large", NULL);
        if (n) {
            if (!mem_take(s, (size_t)n + 1)) return early_busy(req, conn);
            req->mem = (size_t)n + 1;
            req->body = malloc((size_t)n + 1);
            if (!req->body) return early_error(req, conn, 500, "out of memory", NULL);
            req->body_cap = (size_t)n + 1;
        }
    }
    return MHD_YES;
}

/* Phase 2, once per piece of the body: appended up to max_body; past it the rest is read and dropped. */
static enum MHD_Result access_body(http_server_t *s, http_request_t *req, const char *data, size_t *size)
{
    size_t n = *size;
    *size = 0;
    if (req->handled) return MHD_YES; /* already answered: drop the rest */
    if (req->too_large || req->body_len + n > s->max_body) {
        req->too_large = 1;
        req->discarded += n;
        /* a chunked body that never ends: stop reading it */
        return req->discarded > 4 * s->max_body + (1u << 20) ? MHD_NO : MHD_YES;
    }
    if (req->over_budget) return MHD_YES;
    if (req->body_len + n + 1 > req->body_cap) {
        size_t cap = req->body_cap ? req->body_cap : 4096;
        while (cap < req->body_len + n + 1) cap *= 2;
        if (!mem_take(s, cap - req->mem)) {
            req->over_budget = 1;
            return MHD_YES;
        }
        req->mem = cap;
        char *nb = realloc(req->body, cap);
        if (!nb) {
            req->too_large = 1;
            return MHD_YES;
        }
        req->body = nb;
        req->body_cap = cap;
    }
    memcpy(req->body + req->body_len, data, n);
    req->body_len += n;
    req->body[req->body_len] = 0;
    return MHD_YES;
}

/* Phase 3, the body is complete: the route's handler runs, then its answer is queued or the connection waits. */
static enum MHD_Result access_handle(http_server_t *s, http_request_t *req, struct MHD_Connection *conn)
{
    req->handled = 1;
    if (req->too_large) return early_error(req, conn, 413, "request body too large", NULL);
    if (req->over_budget) return early_busy(req, conn);
    conn_track_t *t = conn_track_of(conn);
    if (t) atomic_store(&t->busy, 1);
    req->route->fn(req, req->route->arg);
    pthread_mutex_lock(&req->mu);
    enum MHD_Result rc = MHD_YES;
    switch (req->state) {
    case REQ_ANSWERED:
    case REQ_STREAM:
        rc = queue_answer(req, conn);
        break;
    case REQ_DEFERRED:
        if (atomic_load(&s->stopping)) {
            req->state = REQ_DROPPED;
            pthread_mutex_unlock(&req->mu);
            return queue_503(conn);
        }
        req->suspended = 1;
        MHD_suspend_connection(conn);
        break;
    default:
        pthread_mutex_unlock(&req->mu);
        BT_ERROR("http", "handler for %s %s did not answer", req->method, req->path);
        return early_error(req, conn, 500, "the handler did not answer", NULL);
    }
    pthread_mutex_unlock(&req->mu);
    return rc;
}

/* Phase 4, resumed after a deferral: the answer is queued, or the server is stopping (503), or it was spurious. */
static enum MHD_Result access_resume(http_server_t *s, http_request_t *req, struct MHD_Connection *conn)
{
    pthread_mutex_lock(&req->mu);
    if (req->state == REQ_ANSWERED) {
        enum MHD_Result rc = queue_answer(req, conn);
        pthread_mutex_unlock(&req->mu);
        return rc;
    }
    if (req->state != REQ_DEFERRED) {
        pthread_mutex_unlock(&req->mu);
        return MHD_NO;
    }
    if (!atomic_load(&s->stopping)) { /* spurious wake-up */
        req->suspended = 1;
        MHD_suspend_connection(conn);
        pthread_mutex_unlock(&req->mu);
        return MHD_YES;
    }
    req->state = REQ_DROPPED;
    pthread_mutex_unlock(&req->mu);
    return queue_503(conn);
}

/* libmicrohttpd calls this several times per request; which phase it is follows from what the request holds. */
static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls)
{
    http_server_t *s = cls;
    http_request_t *req = *con_cls;
    if (!req) return access_begin(s, conn, url, method, con_cls);
    if (*upload_data_size) return access_body(s, req, upload_data, upload_data_size);
    if (!req->handled) return access_handle(s, req, conn);
    return access_resume(s, req, conn);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    http_server_t *s = cls;
    http_request_t *req = *con_cls;
    conn_track_t *t = conn_track_of(conn);
    if (t) { /* a keep-alive connection's next request gets a fresh deadline */
        atomic_store(&t->since_ms, now_ms());
        atomic_store(&t->busy, 0);
    }
    if (!req) return;
    *con_cls = NULL;
    if (req->stream) stream_detach(req->stream, toe == MHD_REQUEST_TERMINATED_COMPLETED_OK);
    pthread_mutex_lock(&s->mu);
    if (bt_list_remove(&s->deferred, &req->deferred_link)) pthread_cond_broadcast(&s->cv);
    pthread_mutex_lock(&req->mu);
    req->conn = NULL;
    req->suspended = 0;
    pthread_mutex_unlock(&req->mu);
    pthread_mutex_unlock(&s->mu);
    request_release(req);
}
