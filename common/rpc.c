/* gRPC C core 1.51 glue: see rpc.h. Facts this relies on are in shared/notes/c-apis.md (gRPC section).
 *
 * Server calls are state machines driven by tags on per-thread NEXT completion queues. A bt_rpc_call_t is first a
 * request slot (posted with grpc_server_request_registered_call, or grpc_server_request_call for the catch-all
 * that answers UNIMPLEMENTED), then a live call with up to two batches in flight: RECV_CLOSE_ON_SERVER (started
 * at once; completes on cancel or after the status went out) and one send batch (initial metadata with the first
 * message, then one message at a time, the status with the last one). References: one per batch in flight plus
 * one held by the handler until bt_rpc_call_finish; the last one frees the call. */
#include "common/rpc.h"

#include "common/log.h"
#include "common/tls.h"

#include "grpc/health/v1/health.pb-c.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#pragma GCC diagnostic pop

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RPC_LOG "rpc"
#define RPC_MAX_HEALTH 64
#define RPC_MAX_PEM (1u << 20)

/* ---- codes ---- */

const char *bt_rpc_code_str(bt_rpc_code code)
{
    static const char *names[] = {
        "OK",        "CANCELLED",           "UNKNOWN",   "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
        "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
    };
    if ((unsigned)code < sizeof names / sizeof names[0]) return names[code];
    return "UNKNOWN";
}

bt_rpc_code bt_rpc_code_from_status(bt_status st)
{
    switch (st) {
    case BT_OK: return BT_RPC_OK;
    case BT_ERR_INVALID:
    case BT_ERR_FORMAT: return BT_RPC_INVALID_ARGUMENT;
    case BT_ERR_NOMEM:
    case BT_ERR_EXHAUSTED: return BT_RPC_RESOURCE_EXHAUSTED;
    case BT_ERR_UNSUPPORTED: return BT_RPC_UNIMPLEMENTED;
    case BT_ERR_NOT_FOUND: return BT_RPC_NOT_FOUND;
    case BT_ERR_TIMEOUT: return BT_RPC_DEADLINE_EXCEEDED;
    case BT_ERR_PEER:
    case BT_ERR_UNAVAILABLE: return BT_RPC_UNAVAILABLE;
    case BT_ERR_CANCELLED: return BT_RPC_CANCELLED;
    case BT_ERR_STALE: return BT_RPC_ABORTED;
    case BT_ERR_IO:
    case BT_ERR_INTERNAL: return BT_RPC_INTERNAL;
    }
    return BT_RPC_UNKNOWN;
}

bt_status bt_rpc_status_from_code(bt_rpc_code code)
{
    switch (code) {
    case BT_RPC_OK: return BT_OK;
    case BT_RPC_CANCELLED: return BT_ERR_CANCELLED;
    case BT_RPC_INVALID_ARGUMENT:
    case BT_RPC_OUT_OF_RANGE: return BT_ERR_INVALID;
    case BT_RPC_DEADLINE_EXCEEDED: return BT_ERR_TIMEOUT;
    case BT_RPC_NOT_FOUND: return BT_ERR_NOT_FOUND;
    case BT_RPC_RESOURCE_EXHAUSTED: return BT_ERR_EXHAUSTED;
    case BT_RPC_UNIMPLEMENTED: return BT_ERR_UNSUPPORTED;
    case BT_RPC_UNAVAILABLE: return BT_ERR_UNAVAILABLE;
    case BT_RPC_ABORTED: return BT_ERR_STALE;
    default: return BT_ERR_PEER;
    }
}

/* ---- small helpers ---- */

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static gpr_timespec deadline_after_ms(int timeout_ms)
{
    if (timeout_ms <= 0) return gpr_inf_future(GPR_CLOCK_REALTIME);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

/* Reads a PEM file into a NUL-terminated malloc'd string. */
static bt_status read_pem(const char *path, char **out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return bt_fail(BT_ERR_INVALID, "cannot open %s: %s", path, strerror(errno));
    char *buf = malloc(RPC_MAX_PEM + 1);
    if (!buf) {
        fclose(f);
        return bt_fail(BT_ERR_NOMEM, "out of memory reading %s", path);
    }
    size_t n = fread(buf, 1, RPC_MAX_PEM + 1, f);
    int err = ferror(f);
    fclose(f);
    if (err || n == 0 || n > RPC_MAX_PEM) {
        free(buf);
        return bt_fail(BT_ERR_INVALID, "%s: %s", path, err ? "read error" : n == 0 ? "empty" : "larger than 1 MiB");
    }
    buf[n] = '\0';
    *out = buf;
    return BT_OK;
}

bt_status bt_rpc_pack(const ProtobufCMessage *msg, uint8_t **out, size_t *out_len)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return bt_fail(BT_ERR_NOMEM, "out of memory packing %zu bytes", n);
    protobuf_c_message_pack(msg, buf);
    *out = buf;
    *out_len = n;
    return BT_OK;
}

bt_status bt_rpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                        ProtobufCMessage **out)
{
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, data);
    if (!m) return bt_fail(BT_ERR_FORMAT, "message does not parse as %s", desc->name);
    *out = m;
    return BT_OK;
}

/* Packs a protobuf message into a grpc byte buffer (one slice). NULL when out of memory. */
static grpc_byte_buffer *bb_from_msg(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Copies a byte buffer into a malloc'd array (at least 1 byte allocated). */
static bt_status bb_read_all(grpc_byte_buffer *bb, uint8_t **out, size_t *out_len)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb)) return bt_fail(BT_ERR_FORMAT, "cannot read a gRPC message");
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    size_t n = GRPC_SLICE_LENGTH(s);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) {
        grpc_slice_unref(s);
        return bt_fail(BT_ERR_NOMEM, "out of memory reading a %zu-byte message", n);
    }
    if (n) memcpy(buf, GRPC_SLICE_START_PTR(s), n);
    grpc_slice_unref(s);
    *out = buf;
    *out_len = n;
    return BT_OK;
}

static bt_status bb_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc, ProtobufCMessage **out)
{
    uint8_t *data;
    size_t len;
    bt_status st = bb_read_all(bb, &data, &len);
    if (st != BT_OK) return st;
    st = bt_rpc_unpack(desc, data, len, out);
    free(data);
    return st;
}

static void copy_slice(char *dst, size_t cap, grpc_slice s)
{
    size_t n = GRPC_SLICE_LENGTH(s);
    if (n >= cap) n = cap - 1;
    memcpy(dst, GRPC_SLICE_START_PTR(s), n);
    dst[n] = '\0';
}

/* ---- server types ---- */

enum rpc_tag_kind { TAG_NEW, TAG_SEND, TAG_CLOSE, TAG_SHUTDOWN };

typedef struct rpc_tag {
    enum rpc_tag_kind kind;
    void *obj; /* the call, or the server for TAG_SHUTDOWN */
} rpc_tag;

typedef struct rpc_method {
    char *path;
    bt_rpc_method_kind kind;
    const ProtobufCMessageDescriptor *req_desc;
    bt_rpc_handler_fn fn;
    void *ud;
    void *handle; /* from grpc_server_register_method */
} rpc_method;

typedef struct rpc_send_node {
    grpc_byte_buffer *bb;
    struct rpc_send_node *next;
} rpc_send_node;

struct bt_rpc_call {
    rpc_tag t_new, t_send, t_close;
    bt_rpc_server_t *srv;
    rpc_method *method; /* NULL: the catch-all slot for unregistered methods */
    int cq_idx;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details; /* catch-all slot only */
    grpc_byte_buffer *payload;
    uint8_t *req_bytes;
    size_t req_len;
    ProtobufCMessage *req;
    int64_t deadline_ms;
    int close_cancelled; /* written by gRPC when RECV_CLOSE_ON_SERVER completes */
    int accepted;        /* a client call arrived in this slot (counted in srv->n_calls) */

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;
    atomic_int cancelled;
    int finish_requested, md_sent, status_sent, send_inflight;
    size_t n_sent, n_queued;
    rpc_send_node *q_head, *q_tail;
    grpc_byte_buffer *inflight_bb;
    grpc_status_code status_code;
    grpc_slice status_details;
    void (*cancel_fn)(void *ud, bt_rpc_call_t *call);
    void *cancel_ud;
    int in_cancel_cb;
    pthread_t cancel_thread;
};

typedef struct rpc_health {
    char name[256];
    int serving;
} rpc_health;

struct bt_rpc_server {
    grpc_server *server;
    grpc_completion_queue **cqs;
    pthread_t *threads;
    int n_threads, n_started;
    int slots;
    size_t max_queued;
    int port;
    rpc_method **methods;
    size_t n_methods;
    rpc_tag t_shutdown;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started, shutting_down, shutdown_done, stopped;
    size_t n_objects; /* call objects alive, slots included */
    size_t n_calls;   /* of which accepted calls */
    rpc_health health[RPC_MAX_HEALTH];
    size_t n_health;
};

static void call_unref(bt_rpc_call_t *c);

/* ---- server: slots ---- */

static bt_rpc_call_t *call_alloc(bt_rpc_server_t *srv, rpc_method *m, int cq_idx)
{
    bt_rpc_call_t *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->t_new = (rpc_tag){TAG_NEW, c};
    c->t_send = (rpc_tag){TAG_SEND, c};
    c->t_close = (rpc_tag){TAG_CLOSE, c};
    c->srv = srv;
    c->method = m;
    c->cq_idx = cq_idx;
    c->refs = 1;
    c->status_details = grpc_empty_slice();
    grpc_metadata_array_init(&c->md);
    if (!m) grpc_call_details_init(&c->details);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    return c;
}

static void call_free(bt_rpc_call_t *c)
{
    bt_rpc_server_t *srv = c->srv;
    int was_call = c->accepted;
    if (c->call) grpc_call_unref(c->call);
    grpc_metadata_array_destroy(&c->md);
    if (!c->method) grpc_call_details_destroy(&c->details);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->req) protobuf_c_message_free_unpacked(c->req, NULL);
    free(c->req_bytes);
    for (rpc_send_node *n = c->q_head, *next; n; n = next) {
        next = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    if (c->inflight_bb) grpc_byte_buffer_destroy(c->inflight_bb);
    grpc_slice_unref(c->status_details);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
    /* Last touch of srv: after this signal the shutdown may free it. */
    pthread_mutex_lock(&srv->mu);
    srv->n_objects--;
    if (was_call) srv->n_calls--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

/* Posts a fresh request slot for method m (NULL = catch-all) on queue cq_idx. Caller holds srv->mu. */
static bt_status slot_post_locked(bt_rpc_server_t *srv, rpc_method *m, int cq_idx)
{
    if (srv->shutting_down) return BT_OK;
    bt_rpc_call_t *c = call_alloc(srv, m, cq_idx);
    if (!c) return bt_fail(BT_ERR_NOMEM, "out of memory for a call slot");
    grpc_completion_queue *cq = srv->cqs[cq_idx];
    grpc_call_error err;
    if (m)
        err = grpc_server_request_registered_call(srv->server, m->handle, &c->call, &c->deadline, &c->md,
                                                  &c->payload, cq, cq, &c->t_new);
    else
        err = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md, cq, cq, &c->t_new);
    if (err != GRPC_CALL_OK) {
        grpc_metadata_array_destroy(&c->md);
        if (!m) grpc_call_details_destroy(&c->details);
        pthread_mutex_destroy(&c->mu);
        pthread_cond_destroy(&c->cv);
        free(c);
        return bt_fail(BT_ERR_INTERNAL, "grpc_server_request_call failed: %d", (int)err);
    }
    srv->n_objects++;
    return BT_OK;
}

/* ---- server: sending ---- */

static void queue_drop_locked(bt_rpc_call_t *c)
{
    for (rpc_send_node *n = c->q_head, *next; n; n = next) {
        next = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    c->q_head = c->q_tail = NULL;
    c->n_queued = 0;
}

/* Starts the next send batch if none is in flight: initial metadata with the first batch, one message, and the
 * status once the queue is empty and finish was asked. Caller holds c->mu. */
static void call_flush_locked(bt_rpc_call_t *c)
{
    if (c->send_inflight || c->status_sent || atomic_load(&c->cancelled)) return;
    int want_status = c->finish_requested && c->n_queued <= 1;
    if (!c->q_head && !want_status) return;
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[n].data.send_initial_metadata.count = 0;
        n++;
    }
    grpc_byte_buffer *bb = NULL;
    if (c->q_head) {
        rpc_send_node *node = c->q_head;
        c->q_head = node->next;
        if (!c->q_head) c->q_tail = NULL;
        c->n_queued--;
        bb = node->bb;
        free(node);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = bb;
        n++;
    }
    if (want_status) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = c->status_code;
        ops[n].data.send_status_from_server.status_details = &c->status_details;
        n++;
    }
    c->refs++;
    c->send_inflight = 1;
    c->inflight_bb = bb;
    grpc_call_error err = grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL);
    if (err != GRPC_CALL_OK) {
        BT_ERROR(RPC_LOG, "%s: send batch refused: %d", c->method ? c->method->path : "?", (int)err);
        c->refs--; /* the handler or a batch still holds the call */
        c->send_inflight = 0;
        c->inflight_bb = NULL;
        if (bb) grpc_byte_buffer_destroy(bb);
        atomic_store(&c->cancelled, 1);
        queue_drop_locked(c);
        return;
    }
    c->md_sent = 1;
    if (want_status) c->status_sent = 1;
}

bt_status bt_rpc_call_send(bt_rpc_call_t *c, const ProtobufCMessage *msg)
{
    if (atomic_load(&c->cancelled)) return bt_fail(BT_ERR_CANCELLED, "the call was cancelled");
    grpc_byte_buffer *bb = bb_from_msg(msg);
    rpc_send_node *node = malloc(sizeof *node);
    if (!bb || !node) {
        if (bb) grpc_byte_buffer_destroy(bb);
        free(node);
        return bt_fail(BT_ERR_NOMEM, "out of memory queueing a message");
    }
    node->bb = bb;
    node->next = NULL;
    bt_status st = BT_OK;
    pthread_mutex_lock(&c->mu);
    if (c->finish_requested)
        st = bt_fail(BT_ERR_INVALID, "send after finish");
    else if (atomic_load(&c->cancelled))
        st = bt_fail(BT_ERR_CANCELLED, "the call was cancelled");
    else if (c->method && c->method->kind == BT_RPC_UNARY && c->n_sent > 0)
        st = bt_fail(BT_ERR_INVALID, "second response on unary method %s", c->method->path);
    else if (c->n_queued >= c->srv->max_queued)
        st = bt_fail(BT_ERR_EXHAUSTED, "%zu messages queued: the client reads too slowly", c->n_queued);
    if (st != BT_OK) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        free(node);
        return st;
    }
    if (c->q_tail)
        c->q_tail->next = node;
    else
        c->q_head = node;
    c->q_tail = node;
    c->n_queued++;
    c->n_sent++;
    call_flush_locked(c);
    pthread_mutex_unlock(&c->mu);
    return BT_OK;
}

void bt_rpc_call_finish(bt_rpc_call_t *c, bt_rpc_code code, const char *message)
{
    pthread_mutex_lock(&c->mu);
    /* The cancel callback must not run after finish returns: wait for one running on another thread. */
    while (c->in_cancel_cb && !pthread_equal(c->cancel_thread, pthread_self())) pthread_cond_wait(&c->cv, &c->mu);
    if (c->finish_requested) {
        pthread_mutex_unlock(&c->mu);
        BT_ERROR(RPC_LOG, "bt_rpc_call_finish called twice");
        return;
    }
    c->finish_requested = 1;
    c->cancel_fn = NULL;
    if (atomic_load(&c->cancelled)) {
        queue_drop_locked(c);
    } else {
        c->status_code = (grpc_status_code)code;
        if (message && *message) {
            grpc_slice_unref(c->status_details);
            c->status_details = grpc_slice_from_copied_string(message);
        }
        call_flush_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

void bt_rpc_call_finish_status(bt_rpc_call_t *call, bt_status st)
{
    if (st == BT_OK)
        bt_rpc_call_finish(call, BT_RPC_OK, NULL);
    else
        bt_rpc_call_finish(call, bt_rpc_code_from_status(st), bt_last_error());
}

int bt_rpc_call_cancelled(const bt_rpc_call_t *c)
{
    return atomic_load(&((bt_rpc_call_t *)c)->cancelled);
}

void bt_rpc_call_on_cancel(bt_rpc_call_t *c, void (*fn)(void *ud, bt_rpc_call_t *call), void *ud)
{
    pthread_mutex_lock(&c->mu);
    if (atomic_load(&c->cancelled) && !c->finish_requested && !c->in_cancel_cb) {
        c->in_cancel_cb = 1;
        c->cancel_thread = pthread_self();
        c->cancel_fn = NULL;
        c->refs++; /* fn may finish the call: keep it alive until the flag is cleared */
        pthread_mutex_unlock(&c->mu);
        if (fn) fn(ud, c);
        pthread_mutex_lock(&c->mu);
        c->in_cancel_cb = 0;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        call_unref(c);
        return;
    }
    c->cancel_fn = fn;
    c->cancel_ud = ud;
    pthread_mutex_unlock(&c->mu);
}

int64_t bt_rpc_call_deadline_ms(const bt_rpc_call_t *c)
{
    return c->deadline_ms;
}

const uint8_t *bt_rpc_call_request_bytes(const bt_rpc_call_t *c, size_t *len)
{
    *len = c->req_len;
    return c->req_bytes;
}

const char *bt_rpc_call_method(const bt_rpc_call_t *c)
{
    return c->method ? c->method->path : "";
}

bt_status bt_rpc_call_metadata(const bt_rpc_call_t *c, const char *key, char *buf, size_t buf_len)
{
    for (size_t i = 0; i < c->md.count; i++) {
        if (grpc_slice_str_cmp(c->md.metadata[i].key, key) != 0) continue;
        grpc_slice v = c->md.metadata[i].value;
        if (buf_len == 0) return bt_fail(BT_ERR_EXHAUSTED, "metadata %s does not fit", key);
        copy_slice(buf, buf_len, v);
        if (GRPC_SLICE_LENGTH(v) >= buf_len) return bt_fail(BT_ERR_EXHAUSTED, "metadata %s does not fit", key);
        return BT_OK;
    }
    return bt_fail(BT_ERR_NOT_FOUND, "no metadata %s", key);
}

void bt_rpc_call_peer(const bt_rpc_call_t *c, char *buf, size_t buf_len)
{
    if (buf_len == 0) return;
    char *p = grpc_call_get_peer(c->call);
    snprintf(buf, buf_len, "%s", p ? p : "");
    gpr_free(p);
}

/* Calls fn on each value of the auth-context property name (SAN or CN) until it returns nonzero. */
static int auth_each(grpc_auth_context *ctx, const char *name, int (*fn)(const grpc_auth_property *p, void *ud),
                     void *ud)
{
    grpc_auth_property_iterator it = grpc_auth_context_find_properties_by_name(ctx, name);
    for (const grpc_auth_property *p; (p = grpc_auth_property_iterator_next(&it));)
        if (fn(p, ud)) return 1;
    return 0;
}

typedef struct ident_copy {
    char *buf;
    size_t cap;
} ident_copy;

static int take_first(const grpc_auth_property *p, void *ud)
{
    ident_copy *ic = ud;
    size_t n = p->value_length < ic->cap - 1 ? p->value_length : ic->cap - 1;
    memcpy(ic->buf, p->value, n);
    ic->buf[n] = 0;
    return 1;
}

static int equals_name(const grpc_auth_property *p, void *ud)
{
    const char *want = ud;
    return p->value_length == strlen(want) && !memcmp(p->value, want, p->value_length);
}

/* A DNS name "*.rest" (the whole leftmost label a wildcard, rest of two labels or more) names every identity
 * "label.rest" with one non-empty label before rest: RFC 6125's rule, the one gRPC applies when a client checks a
 * server's name, so a node's identity is checked the same way in both directions. */
static int wildcard_names(const grpc_auth_property *p, void *ud)
{
    const char *want = ud;
    size_t n = p->value_length, wl = strlen(want);
    if (n < 4 || p->value[0] != '*' || p->value[1] != '.' || !memchr(p->value + 2, '.', n - 2)) return 0;
    const char *dot = strchr(want, '.');
    if (!dot || dot == want) return 0;
    size_t rest = wl - (size_t)(dot - want); /* ".rest" */
    return rest == n - 1 && !memcmp(dot, p->value + 1, rest);
}

bt_status bt_rpc_call_peer_identity(const bt_rpc_call_t *c, char *buf, size_t buf_len)
{
    if (buf_len == 0) return bt_fail(BT_ERR_INVALID, "no room for the peer identity");
    buf[0] = 0;
    grpc_auth_context *ctx = grpc_call_auth_context(c->call);
    ident_copy ic = {buf, buf_len};
    int found = ctx && grpc_auth_context_peer_is_authenticated(ctx) &&
                (auth_each(ctx, GRPC_X509_SAN_PROPERTY_NAME, take_first, &ic) ||
                 auth_each(ctx, GRPC_X509_CN_PROPERTY_NAME, take_first, &ic));
    if (ctx) grpc_auth_context_release(ctx);
    return found ? BT_OK : bt_fail(BT_ERR_NOT_FOUND, "the peer presented no verified certificate");
}

int bt_rpc_call_peer_has_identity(const bt_rpc_call_t *c, const char *identity)
{
    grpc_auth_context *ctx = grpc_call_auth_context(c->call);
    int yes = ctx && identity && *identity && grpc_auth_context_peer_is_authenticated(ctx) &&
              (auth_each(ctx, GRPC_X509_SAN_PROPERTY_NAME, equals_name, (void *)identity) ||
               auth_each(ctx, GRPC_X509_SAN_PROPERTY_NAME, wildcard_names, (void *)identity) ||
               auth_each(ctx, GRPC_X509_CN_PROPERTY_NAME, equals_name, (void *)identity));
    if (ctx) grpc_auth_context_release(ctx);
    return yes;
}

static void call_unref(bt_rpc_call_t *c)
{
    pthread_mutex_lock(&c->mu);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) call_free(c);
}

/* ---- server: events ---- */

static void on_send_done(bt_rpc_call_t *c, int ok)
{
    pthread_mutex_lock(&c->mu);
    if (c->inflight_bb) grpc_byte_buffer_destroy(c->inflight_bb);
    c->inflight_bb = NULL;
    c->send_inflight = 0;
    if (!ok) {
        atomic_store(&c->cancelled, 1);
        queue_drop_locked(c);
    } else {
        call_flush_locked(c);
    }
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
}

static void on_close(bt_rpc_call_t *c, int ok)
{
    void (*fn)(void *, bt_rpc_call_t *) = NULL;
    void *ud = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->close_cancelled || !ok) {
        atomic_store(&c->cancelled, 1);
        if (!c->send_inflight) queue_drop_locked(c);
        if (c->cancel_fn && !c->finish_requested) {
            fn = c->cancel_fn;
            ud = c->cancel_ud;
            c->cancel_fn = NULL;
            c->in_cancel_cb = 1;
            c->cancel_thread = pthread_self();
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (fn) {
        fn(ud, c);
        pthread_mutex_lock(&c->mu);
        c->in_cancel_cb = 0;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    call_unref(c);
}

static void on_new(bt_rpc_call_t *c, int ok)
{
    bt_rpc_server_t *srv = c->srv;
    pthread_mutex_lock(&srv->mu);
    if (!ok) {
        /* Shutdown returns unused slots with ok = 0: never re-arm those. */
        pthread_mutex_unlock(&srv->mu);
        call_unref(c);
        return;
    }
    srv->n_calls++;
    c->accepted = 1;
    if (slot_post_locked(srv, c->method, c->cq_idx) != BT_OK)
        BT_ERROR(RPC_LOG, "cannot re-arm a call slot: %s", bt_last_error());
    pthread_mutex_unlock(&srv->mu);

    if (c->deadline.tv_sec == INT64_MAX) {
        c->deadline_ms = INT64_MAX;
    } else {
        gpr_timespec left = gpr_time_sub(c->deadline, gpr_now(c->deadline.clock_type));
        c->deadline_ms = mono_ms() + (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
    }

    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    c->refs++;
    grpc_call_error err = grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL);
    if (err != GRPC_CALL_OK) {
        c->refs--;
        atomic_store(&c->cancelled, 1);
        BT_ERROR(RPC_LOG, "RECV_CLOSE_ON_SERVER refused: %d", (int)err);
    }

    if (!c->method) {
        char path[256];
        copy_slice(path, sizeof path, c->details.method);
        BT_DEBUG(RPC_LOG, "unimplemented method %s", path);
        char msg[300];
        snprintf(msg, sizeof msg, "unknown method %s", path);
        bt_rpc_call_finish(c, BT_RPC_UNIMPLEMENTED, msg);
        return;
    }
    rpc_method *m = c->method;
    if (!c->payload) {
        bt_rpc_call_finish(c, BT_RPC_INVALID_ARGUMENT, "no request message");
        return;
    }
    bt_status st = bb_read_all(c->payload, &c->req_bytes, &c->req_len);
    grpc_byte_buffer_destroy(c->payload);
    c->payload = NULL;
    if (st == BT_OK && m->req_desc) st = bt_rpc_unpack(m->req_desc, c->req_bytes, c->req_len, &c->req);
    if (st != BT_OK) {
        bt_rpc_call_finish(c, BT_RPC_INVALID_ARGUMENT, bt_last_error());
        return;
    }
    m->fn(m->ud, c, c->req);
}

static void *cq_thread(void *arg)
{
    bt_rpc_server_t *srv = arg;
    int idx = -1;
    pthread_mutex_lock(&srv->mu);
    for (int i = 0; i < srv->n_threads; i++)
        if (pthread_equal(srv->threads[i], pthread_self())) idx = i;
    pthread_mutex_unlock(&srv->mu);
    grpc_completion_queue *cq = srv->cqs[idx];
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        rpc_tag *t = ev.tag;
        switch (t->kind) {
        case TAG_NEW: on_new(t->obj, ev.success); break;
        case TAG_SEND: on_send_done(t->obj, ev.success); break;
        case TAG_CLOSE: on_close(t->obj, ev.success); break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_done = 1;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            break;
        }
    }
    return NULL;
}

/* ---- server: health ---- */

static void health_check(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *req)
{
    bt_rpc_server_t *srv = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const Grpc__Health__V1__HealthCheckRequest *)req;
    const char *name = r->service ? r->service : "";
    int found = -1;
    pthread_mutex_lock(&srv->mu);
    for (size_t i = 0; i < srv->n_health; i++)
        if (strcmp(srv->health[i].name, name) == 0) found = srv->health[i].serving;
    pthread_mutex_unlock(&srv->mu);
    if (found < 0) {
        bt_rpc_call_finish(call, BT_RPC_NOT_FOUND, "unknown service");
        return;
    }
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = found ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                        : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    bt_status st = bt_rpc_call_send(call, &resp.base);
    bt_rpc_call_finish_status(call, st);
}

bt_status bt_rpc_server_set_health(bt_rpc_server_t *srv, const char *service, int serving)
{
    if (!service) service = "";
    if (strlen(service) >= sizeof srv->health[0].name)
        return bt_fail(BT_ERR_INVALID, "health service name longer than 255 bytes");
    bt_status st = BT_OK;
    pthread_mutex_lock(&srv->mu);
    size_t i = 0;
    while (i < srv->n_health && strcmp(srv->health[i].name, service) != 0) i++;
    if (i == srv->n_health) {
        if (i == RPC_MAX_HEALTH) {
            st = bt_fail(BT_ERR_NOMEM, "more than %d health service names", RPC_MAX_HEALTH);
            goto out;
        }
        snprintf(srv->health[i].name, sizeof srv->health[i].name, "%s", service);
        srv->n_health++;
    }
    srv->health[i].serving = serving != 0;
out:
    pthread_mutex_unlock(&srv->mu);
    return st;
}

/* ---- server: life cycle ---- */

static grpc_server_credentials *server_creds(const bt_rpc_server_config_t *cfg, bt_status *st)
{
    grpc_server_credentials *creds = NULL;
    char *cert = NULL, *key = NULL, *ca = NULL;
    *st = BT_OK;
    if (!cfg->tls_cert_file && !cfg->tls_key_file && !cfg->tls_client_ca_file)
        return grpc_insecure_server_credentials_create();
    if (!cfg->tls_cert_file || !cfg->tls_key_file) {
        *st = bt_fail(BT_ERR_INVALID, "TLS needs both a certificate and a key file");
        return NULL;
    }
    if ((*st = read_pem(cfg->tls_cert_file, &cert)) != BT_OK) goto out;
    if ((*st = read_pem(cfg->tls_key_file, &key)) != BT_OK) goto out;
    if (cfg->tls_client_ca_file && (*st = read_pem(cfg->tls_client_ca_file, &ca)) != BT_OK) goto out;
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    creds = grpc_ssl_server_credentials_create_ex(ca, &pair, 1,
                                                  ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                     : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
                                                  NULL);
    if (!creds) *st = bt_fail(BT_ERR_INVALID, "gRPC refused the TLS certificate or key");
out:
    free(cert);
    free(key);
    free(ca);
    return creds;
}

static bt_status method_add(bt_rpc_server_t *srv, const char *path, bt_rpc_method_kind kind,
                            const ProtobufCMessageDescriptor *req_desc, bt_rpc_handler_fn fn, void *ud)
{
    if (!path || path[0] != '/' || !strchr(path + 1, '/') || !fn)
        return bt_fail(BT_ERR_INVALID, "method path must look like /package.Service/Method");
    for (size_t i = 0; i < srv->n_methods; i++)
        if (strcmp(srv->methods[i]->path, path) == 0) return bt_fail(BT_ERR_INVALID, "method %s added twice", path);
    rpc_method **ms = realloc(srv->methods, (srv->n_methods + 1) * sizeof *ms);
    if (!ms) return bt_fail(BT_ERR_NOMEM, "out of memory adding a method");
    srv->methods = ms;
    rpc_method *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        return bt_fail(BT_ERR_NOMEM, "out of memory adding a method");
    }
    m->kind = kind;
    m->req_desc = req_desc;
    m->fn = fn;
    m->ud = ud;
    /* Unary and server-streaming calls carry exactly one request: gRPC reads it before announcing the call. */
    m->handle = grpc_server_register_method(srv->server, m->path, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle) {
        free(m->path);
        free(m);
        return bt_fail(BT_ERR_INVALID, "gRPC refused method %s", path);
    }
    srv->methods[srv->n_methods++] = m;
    return BT_OK;
}

bt_status bt_rpc_server_create(const bt_rpc_server_config_t *cfg, bt_rpc_server_t **out)
{
    if (!cfg || !cfg->listen || !*cfg->listen) return bt_fail(BT_ERR_INVALID, "rpc server: no listen address");
    if (cfg->n_threads < 0 || cfg->n_threads > 256 || cfg->slots_per_method < 0)
        return bt_fail(BT_ERR_INVALID, "rpc server: bad thread or slot count");
    bt_status st;
    bt_rpc_server_t *srv = calloc(1, sizeof *srv);
    if (!srv) return bt_fail(BT_ERR_NOMEM, "out of memory");
    grpc_init();
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    srv->n_threads = cfg->n_threads ? cfg->n_threads : BT_RPC_DEFAULT_THREADS;
    srv->slots = cfg->slots_per_method ? cfg->slots_per_method : BT_RPC_DEFAULT_SLOTS;
    srv->max_queued = cfg->max_queued ? cfg->max_queued : BT_RPC_DEFAULT_MAX_QUEUED;
    srv->t_shutdown = (rpc_tag){TAG_SHUTDOWN, srv};
    size_t max_msg = cfg->max_message ? cfg->max_message : BT_RPC_DEFAULT_MAX_MESSAGE;
    if (max_msg > INT32_MAX) max_msg = INT32_MAX;

    grpc_arg args[3];
    memset(args, 0, sizeof args);
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)max_msg;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_ALLOW_REUSEPORT; /* an explicit port already taken must fail, not be shared */
    args[1].value.integer = 0;
    args[2].type = GRPC_ARG_INTEGER; /* accept our clients' keepalive pings (default: one per 5 min, else GOAWAY) */
    args[2].key = GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
    args[2].value.integer = BT_RPC_MIN_KEEPALIVE_MS / 2;
    grpc_channel_args chargs = {3, args};
    srv->server = grpc_server_create(&chargs, NULL);
    srv->cqs = calloc((size_t)srv->n_threads, sizeof *srv->cqs);
    srv->threads = calloc((size_t)srv->n_threads, sizeof *srv->threads);
    if (!srv->server || !srv->cqs || !srv->threads) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory creating the rpc server");
        goto fail;
    }
    for (int i = 0; i < srv->n_threads; i++) {
        srv->cqs[i] = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(srv->server, srv->cqs[i], NULL);
    }
    grpc_server_credentials *creds = server_creds(cfg, &st);
    if (!creds) goto fail;
    srv->port = grpc_server_add_http2_port(srv->server, cfg->listen, creds);
    grpc_server_credentials_release(creds);
    if (srv->port == 0) {
        st = bt_fail(BT_ERR_IO, "cannot listen on %s", cfg->listen);
        goto fail;
    }
    st = method_add(srv, "/grpc.health.v1.Health/Check", BT_RPC_UNARY,
                    &grpc__health__v1__health_check_request__descriptor, health_check, srv);
    if (st == BT_OK) st = bt_rpc_server_set_health(srv, "", 1);
    if (st != BT_OK) goto fail;
    *out = srv;
    return BT_OK;
fail:
    bt_rpc_server_destroy(srv);
    return st;
}

bt_status bt_rpc_server_add_method(bt_rpc_server_t *srv, const char *path, bt_rpc_method_kind kind,
                                   const ProtobufCMessageDescriptor *req_desc, bt_rpc_handler_fn fn, void *ud)
{
    if (srv->started) return bt_fail(BT_ERR_INVALID, "methods must be added before the server starts");
    return method_add(srv, path, kind, req_desc, fn, ud);
}

bt_status bt_rpc_server_start(bt_rpc_server_t *srv)
{
    if (srv->started) return bt_fail(BT_ERR_INVALID, "rpc server already started");
    bt_status st = BT_OK;
    pthread_mutex_lock(&srv->mu); /* held so each thread finds its own id in srv->threads */
    for (int i = srv->n_started; i < srv->n_threads; i++) {
        if (pthread_create(&srv->threads[i], NULL, cq_thread, srv) != 0) {
            st = bt_fail(BT_ERR_INTERNAL, "cannot start rpc thread %d", i);
            break;
        }
        srv->n_started++;
    }
    pthread_mutex_unlock(&srv->mu);
    if (st != BT_OK) return st; /* not started: destroy stops the threads that run */
    grpc_server_start(srv->server);
    srv->started = 1;
    pthread_mutex_lock(&srv->mu);
    for (int q = 0; q < srv->n_threads && st == BT_OK; q++) {
        for (size_t m = 0; m < srv->n_methods && st == BT_OK; m++)
            for (int k = 0; k < srv->slots && st == BT_OK; k++) st = slot_post_locked(srv, srv->methods[m], q);
        for (int k = 0; k < 2 && st == BT_OK; k++) st = slot_post_locked(srv, NULL, q);
    }
    pthread_mutex_unlock(&srv->mu);
    if (st == BT_OK) BT_DEBUG(RPC_LOG, "serving on port %d with %d threads", srv->port, srv->n_threads);
    return st; /* on failure the caller destroys the server, which shuts down what was posted */
}

int bt_rpc_server_port(const bt_rpc_server_t *srv)
{
    return srv->port;
}

static void drain_cq(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
    }
}

void bt_rpc_server_shutdown(bt_rpc_server_t *srv, int grace_ms)
{
    if (!srv->started || srv->stopped) return;
    pthread_mutex_lock(&srv->mu);
    for (size_t i = 0; i < srv->n_health; i++) srv->health[i].serving = 0;
    srv->shutting_down = 1;
    pthread_mutex_unlock(&srv->mu);
    grpc_server_shutdown_and_notify(srv->server, srv->cqs[0], &srv->t_shutdown);

    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    int64_t ns = until.tv_nsec + (int64_t)(grace_ms > 0 ? grace_ms : 0) * 1000000;
    until.tv_sec += ns / 1000000000;
    until.tv_nsec = ns % 1000000000;
    pthread_mutex_lock(&srv->mu);
    while (srv->n_calls > 0 && grace_ms > 0)
        if (pthread_cond_timedwait(&srv->cv, &srv->mu, &until) == ETIMEDOUT) break;
    pthread_mutex_unlock(&srv->mu);
    grpc_server_cancel_all_calls(srv->server);

    /* Every slot comes back with ok = 0 and every call ends once its handler finishes it. */
    pthread_mutex_lock(&srv->mu);
    while (!srv->shutdown_done || srv->n_objects > 0) {
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 5;
        if (pthread_cond_timedwait(&srv->cv, &srv->mu, &until) == ETIMEDOUT && srv->n_calls > 0)
            BT_WARN(RPC_LOG, "shutdown waits for %zu calls their handlers have not finished", srv->n_calls);
    }
    pthread_mutex_unlock(&srv->mu);
    for (int i = 0; i < srv->n_threads; i++) grpc_completion_queue_shutdown(srv->cqs[i]);
    for (int i = 0; i < srv->n_started; i++) pthread_join(srv->threads[i], NULL);
    srv->stopped = 1;
}

void bt_rpc_server_destroy(bt_rpc_server_t *srv)
{
    if (!srv) return;
    if (srv->started) {
        bt_rpc_server_shutdown(srv, 0); /* no-op when already stopped; leaves every queue drained */
    } else {
        if (srv->server && srv->cqs && srv->cqs[0]) {
            /* gRPC asserts that a server with listeners was shut down before it is destroyed, started or not. */
            grpc_server_shutdown_and_notify(srv->server, srv->cqs[0], &srv->t_shutdown);
            if (srv->n_started > 0) {
                pthread_mutex_lock(&srv->mu);
                while (!srv->shutdown_done) pthread_cond_wait(&srv->cv, &srv->mu);
                pthread_mutex_unlock(&srv->mu);
            } else {
                for (;;) {
                    grpc_event ev = grpc_completion_queue_next(srv->cqs[0], gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
                    if (ev.type == GRPC_OP_COMPLETE && ev.tag == &srv->t_shutdown) break;
                }
            }
        }
        if (srv->server) grpc_server_destroy(srv->server);
        srv->server = NULL;
        if (srv->cqs)
            for (int i = 0; i < srv->n_threads; i++) {
                if (!srv->cqs[i]) continue;
                if (i < srv->n_started)
                    grpc_completion_queue_shutdown(srv->cqs[i]); /* its thread drains it */
                else
                    drain_cq(srv->cqs[i]);
            }
        for (int i = 0; i < srv->n_started; i++) pthread_join(srv->threads[i], NULL);
    }
    if (srv->server) grpc_server_destroy(srv->server);
    if (srv->cqs)
        for (int i = 0; i < srv->n_threads; i++)
            if (srv->cqs[i]) grpc_completion_queue_destroy(srv->cqs[i]);
    for (size_t i = 0; i < srv->n_methods; i++) {
        free(srv->methods[i]->path);
        free(srv->methods[i]);
    }
    free(srv->methods);
    free(srv->cqs);
    free(srv->threads);
    pthread_mutex_destroy(&srv->mu);
    pthread_cond_destroy(&srv->cv);
    free(srv);
    grpc_shutdown();
}

/* ---- client ---- */

struct bt_rpc_channel {
    grpc_channel *ch;
};

bt_status bt_rpc_channel_create(const bt_rpc_channel_config_t *cfg, bt_rpc_channel_t **out)
{
    if (!cfg || !cfg->target || !*cfg->target) return bt_fail(BT_ERR_INVALID, "rpc channel: no target");
    int tls = cfg->tls_ca_file || cfg->tls_cert_file || cfg->tls_key_file;
    if ((cfg->tls_cert_file != NULL) != (cfg->tls_key_file != NULL))
        return bt_fail(BT_ERR_INVALID, "rpc channel: a client certificate needs both cert and key files");
    char *ca = NULL, *cert = NULL, *key = NULL;
    bt_status st = BT_OK;
    bt_rpc_channel_t *c = calloc(1, sizeof *c);
    if (!c) return bt_fail(BT_ERR_NOMEM, "out of memory");
    if (cfg->tls_ca_file && (st = read_pem(cfg->tls_ca_file, &ca)) != BT_OK) goto out;
    if (cfg->tls_cert_file && (st = read_pem(cfg->tls_cert_file, &cert)) != BT_OK) goto out;
    if (cfg->tls_key_file && (st = read_pem(cfg->tls_key_file, &key)) != BT_OK) goto out;
    grpc_init();
    grpc_channel_credentials *creds;
    if (tls) {
        grpc_ssl_pem_key_cert_pair pair = {key, cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    size_t max_msg = cfg->max_message ? cfg->max_message : BT_RPC_DEFAULT_MAX_MESSAGE;
    if (max_msg > INT32_MAX) max_msg = INT32_MAX;
    grpc_arg args[6];
    memset(args, 0, sizeof args);
    size_t n = 0;
    if (cfg->keepalive_ms > 0) {
        int ka = cfg->keepalive_ms < BT_RPC_MIN_KEEPALIVE_MS ? BT_RPC_MIN_KEEPALIVE_MS : cfg->keepalive_ms;
        args[n].type = GRPC_ARG_INTEGER;
        args[n].key = GRPC_ARG_KEEPALIVE_TIME_MS;
        args[n++].value.integer = ka;
        args[n].type = GRPC_ARG_INTEGER;
        args[n].key = GRPC_ARG_KEEPALIVE_TIMEOUT_MS;
        args[n++].value.integer = 5000;
        args[n].type = GRPC_ARG_INTEGER;
        args[n].key = GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA; /* default 2 would stop pinging a quiet stream */
        args[n++].value.integer = 0;
    }
    args[n].type = GRPC_ARG_INTEGER;
    args[n].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[n].value.integer = (int)max_msg;
    n++;
    if (tls && cfg->tls_server_name) {
        args[n].type = GRPC_ARG_STRING;
        args[n].key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
        args[n].value.string = (char *)cfg->tls_server_name;
        n++;
    }
    grpc_channel_args chargs = {n, args};
    c->ch = creds ? grpc_channel_create(cfg->target, creds, &chargs) : NULL;
    if (creds) grpc_channel_credentials_release(creds);
    if (!c->ch) {
        grpc_shutdown();
        st = bt_fail(BT_ERR_INVALID, "gRPC refused channel to %s", cfg->target);
        goto out;
    }
out:
    free(ca);
    free(cert);
    free(key);
    if (st != BT_OK) {
        free(c);
        return st;
    }
    *out = c;
    return BT_OK;
}

void bt_rpc_channel_destroy(bt_rpc_channel_t *c)
{
    if (!c) return;
    grpc_channel_destroy(c->ch);
    free(c);
    grpc_shutdown();
}

static void result_set(bt_rpc_result_t *r, grpc_status_code code, grpc_slice details)
{
    r->code = (bt_rpc_code)code;
    copy_slice(r->message, sizeof r->message, details);
}

static bt_status result_status(const bt_rpc_result_t *r, const char *method)
{
    if (r->code == BT_RPC_OK) return BT_OK;
    return bt_fail(bt_rpc_status_from_code(r->code), "%s: %s: %s", method, bt_rpc_code_str(r->code), r->message);
}

static grpc_call *call_create(bt_rpc_channel_t *ch, grpc_completion_queue *cq, const char *method, int timeout_ms)
{
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                               deadline_after_ms(timeout_ms), NULL);
    grpc_slice_unref(m);
    return call;
}

bt_status bt_rpc_unary(bt_rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *resp_desc, int timeout_ms, ProtobufCMessage **resp,
                       bt_rpc_result_t *result)
{
    bt_rpc_result_t local;
    if (!result) result = &local;
    result->code = BT_RPC_INTERNAL;
    snprintf(result->message, sizeof result->message, "call not started");
    bt_status st;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    grpc_call *call = call_create(ch, cq, method, timeout_ms);
    grpc_byte_buffer *send_bb = bb_from_msg(req), *recv_bb = NULL;
    grpc_metadata_array init_md, trailing;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trailing);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    const char *err_str = NULL;
    if (!call || !send_bb) {
        st = bt_fail(BT_ERR_NOMEM, "%s: cannot create the call", method);
        goto out;
    }
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    ops[5].data.recv_status_on_client.error_string = &err_str;
    static char tag;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) != GRPC_CALL_OK) {
        st = bt_fail(BT_ERR_INTERNAL, "%s: gRPC refused the batch", method);
        goto out;
    }
    grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    (void)ev; /* RECV_STATUS_ON_CLIENT always completes; the status says what happened */
    result_set(result, code, details);
    st = result_status(result, method);
    if (st == BT_OK) {
        if (!recv_bb) {
            result->code = BT_RPC_INTERNAL;
            snprintf(result->message, sizeof result->message, "OK status without a response message");
            st = bt_fail(BT_ERR_PEER, "%s: OK status without a response message", method);
        } else {
            ProtobufCMessage *m = NULL;
            st = bb_unpack(recv_bb, resp_desc, &m);
            if (st == BT_OK) *resp = m;
        }
    }
out:
    if (call) grpc_call_unref(call);
    drain_cq(cq);
    grpc_completion_queue_destroy(cq);
    if (send_bb) grpc_byte_buffer_destroy(send_bb);
    if (recv_bb) grpc_byte_buffer_destroy(recv_bb);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trailing);
    grpc_slice_unref(details);
    gpr_free((void *)err_str);
    return st;
}

/* ---- client streams ---- */

struct bt_rpc_stream {
    grpc_completion_queue *cq;
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    char *method;
    char t_start, t_status, t_recv; /* their addresses are the tags */
    int start_pending, status_pending, recv_pending;
    int ended;
    grpc_metadata *md;
    size_t n_md;
    grpc_metadata_array init_md, trailing;
    grpc_status_code code;
    grpc_slice details;
    const char *err_str;
    grpc_byte_buffer *send_bb, *recv_bb;
    bt_rpc_result_t result;
};

/* Waits until `until` for one event and records which batch completed. Returns 0 when the wait timed out. */
static int stream_wait_until(bt_rpc_stream_t *s, gpr_timespec until)
{
    grpc_event ev = grpc_completion_queue_next(s->cq, until, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) return 0;
    if (ev.type != GRPC_OP_COMPLETE) return 1;
    if (ev.tag == &s->t_start) s->start_pending = 0;
    else if (ev.tag == &s->t_status) s->status_pending = 0;
    else if (ev.tag == &s->t_recv) s->recv_pending = 0;
    return 1;
}

static void stream_wait_one(bt_rpc_stream_t *s)
{
    stream_wait_until(s, gpr_inf_future(GPR_CLOCK_REALTIME));
}

bt_status bt_rpc_stream_open(bt_rpc_channel_t *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int timeout_ms,
                             const char *const *metadata, bt_rpc_stream_t **out)
{
    bt_status st;
    bt_rpc_stream_t *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory");
    s->desc = resp_desc;
    s->details = grpc_empty_slice();
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trailing);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->method = strdup(method);
    s->send_bb = bb_from_msg(req);
    size_t n_md = 0;
    while (metadata && metadata[2 * n_md]) n_md++;
    if (n_md) s->md = calloc(n_md, sizeof *s->md);
    if (!s->method || !s->send_bb || (n_md && !s->md)) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (; s->n_md < n_md; s->n_md++) {
        s->md[s->n_md].key = grpc_slice_from_copied_string(metadata[2 * s->n_md]);
        s->md[s->n_md].value = grpc_slice_from_copied_string(metadata[2 * s->n_md + 1] ? metadata[2 * s->n_md + 1] : "");
    }
    s->call = call_create(ch, s->cq, method, timeout_ms);
    if (!s->call) {
        st = bt_fail(BT_ERR_INTERNAL, "%s: cannot create the call", method);
        goto fail;
    }
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = s->n_md;
    ops[0].data.send_initial_metadata.metadata = s->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = s->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    grpc_call_error err = grpc_call_start_batch(s->call, ops, 4, &s->t_start, NULL);
    if (err == GRPC_CALL_ERROR_INVALID_METADATA) {
        st = bt_fail(BT_ERR_INVALID, "%s: invalid metadata key or value", method);
        goto fail;
    }
    if (err != GRPC_CALL_OK) {
        st = bt_fail(BT_ERR_INTERNAL, "%s: gRPC refused the first batch: %d", method, (int)err);
        goto fail;
    }
    s->start_pending = 1;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    op.data.recv_status_on_client.trailing_metadata = &s->trailing;
    op.data.recv_status_on_client.status = &s->code;
    op.data.recv_status_on_client.status_details = &s->details;
    op.data.recv_status_on_client.error_string = &s->err_str;
    if (grpc_call_start_batch(s->call, &op, 1, &s->t_status, NULL) != GRPC_CALL_OK) {
        st = bt_fail(BT_ERR_INTERNAL, "%s: gRPC refused the status batch", method);
        goto fail;
    }
    s->status_pending = 1;
    *out = s;
    return BT_OK;
fail:
    bt_rpc_stream_close(s);
    return st;
}

bt_status bt_rpc_stream_next_wait(bt_rpc_stream_t *s, int wait_ms, ProtobufCMessage **msg, int *ready)
{
    *msg = NULL;
    *ready = 1;
    if (!s->ended) {
        if (!s->recv_pending) { /* else a RECV_MESSAGE from a call that timed out is still waiting */
            grpc_op op;
            memset(&op, 0, sizeof op);
            op.op = GRPC_OP_RECV_MESSAGE;
            op.data.recv_message.recv_message = &s->recv_bb;
            s->recv_bb = NULL;
            if (grpc_call_start_batch(s->call, &op, 1, &s->t_recv, NULL) != GRPC_CALL_OK)
                return bt_fail(BT_ERR_INTERNAL, "%s: gRPC refused RECV_MESSAGE", s->method);
            s->recv_pending = 1;
        }
        gpr_timespec until = wait_ms < 0 ? gpr_inf_future(GPR_CLOCK_REALTIME)
                                         : gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                        gpr_time_from_millis(wait_ms, GPR_TIMESPAN));
        while (s->recv_pending) {
            if (!stream_wait_until(s, until)) {
                *ready = 0;
                return BT_OK;
            }
        }
        if (s->recv_bb) {
            grpc_byte_buffer *bb = s->recv_bb;
            s->recv_bb = NULL;
            ProtobufCMessage *m = NULL;
            bt_status st = bb_unpack(bb, s->desc, &m);
            grpc_byte_buffer_destroy(bb);
            if (st != BT_OK) {
                grpc_call_cancel(s->call, NULL);
                return st;
            }
            *msg = m;
            return BT_OK;
        }
        /* No message: the stream ended (or failed); the status follows at once. */
        while (s->status_pending) stream_wait_one(s);
        result_set(&s->result, s->code, s->details);
        s->ended = 1;
    }
    return result_status(&s->result, s->method);
}

bt_status bt_rpc_stream_next(bt_rpc_stream_t *s, ProtobufCMessage **msg)
{
    int ready;
    return bt_rpc_stream_next_wait(s, -1, msg, &ready);
}

bt_status bt_rpc_stream_result(const bt_rpc_stream_t *s, bt_rpc_result_t *result)
{
    if (!s->ended) return bt_fail(BT_ERR_INVALID, "stream has not ended");
    *result = s->result;
    return BT_OK;
}

void bt_rpc_stream_cancel(bt_rpc_stream_t *s)
{
    grpc_call_cancel(s->call, NULL);
}

void bt_rpc_stream_close(bt_rpc_stream_t *s)
{
    if (!s) return;
    if (s->call) {
        if (s->status_pending) grpc_call_cancel(s->call, NULL);
        while (s->start_pending || s->status_pending || s->recv_pending) stream_wait_one(s);
        grpc_call_unref(s->call);
    }
    if (s->cq) {
        drain_cq(s->cq);
        grpc_completion_queue_destroy(s->cq);
    }
    if (s->send_bb) grpc_byte_buffer_destroy(s->send_bb);
    if (s->recv_bb) grpc_byte_buffer_destroy(s->recv_bb);
    for (size_t i = 0; i < s->n_md; i++) {
        grpc_slice_unref(s->md[i].key);
        grpc_slice_unref(s->md[i].value);
    }
    free(s->md);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trailing);
    grpc_slice_unref(s->details);
    gpr_free((void *)s->err_str);
    free(s->method);
    free(s);
}

/* ---- channel cache ---- */

typedef struct chc_entry {
    char target[256];
    char identity[128]; /* the name the server's certificate must carry; "" = the target's host */
    bt_rpc_channel_t *ch;
    int refs;           /* holders between get and release; only unheld entries are evicted */
    uint64_t last_used; /* the cache's clock at the last get */
} chc_entry;

struct bt_rpc_chcache {
    pthread_mutex_t mu;
    char ca[4096], cert[4096], key[4096];
    int keepalive_ms;
    size_t max_message;
    int cap, n;
    uint64_t clock;
    uint64_t evictions;
    chc_entry *e; /* [cap] */
};

bt_status bt_rpc_chcache_create(const bt_rpc_chcache_config_t *cfg, bt_rpc_chcache_t **out)
{
    int cap = cfg->capacity > 0 ? cfg->capacity : BT_RPC_CHCACHE_DEFAULT_CAP;
    bt_rpc_chcache_t *c = calloc(1, sizeof *c);
    if (!c || !(c->e = calloc((size_t)cap, sizeof *c->e))) {
        free(c);
        return bt_fail(BT_ERR_NOMEM, "out of memory creating the channel cache");
    }
    snprintf(c->ca, sizeof c->ca, "%s", cfg->tls_ca_file ? cfg->tls_ca_file : "");
    snprintf(c->cert, sizeof c->cert, "%s", cfg->tls_cert_file ? cfg->tls_cert_file : "");
    snprintf(c->key, sizeof c->key, "%s", cfg->tls_key_file ? cfg->tls_key_file : "");
    c->keepalive_ms = cfg->keepalive_ms;
    c->max_message = cfg->max_message;
    c->cap = cap;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return BT_OK;
}

/* The slot for a new channel: a free one, else the least recently used one nobody holds (its channel closed).
 * NULL when every slot is held. Under c->mu. */
static chc_entry *chc_slot(bt_rpc_chcache_t *c)
{
    if (c->n < c->cap) return &c->e[c->n++];
    chc_entry *lru = NULL;
    for (int i = 0; i < c->n; i++)
        if (c->e[i].refs == 0 && (!lru || c->e[i].last_used < lru->last_used)) lru = &c->e[i];
    if (lru) {
        if (lru->ch) c->evictions++; /* (an entry whose channel could not be made holds none) */
        bt_rpc_channel_destroy(lru->ch);
        memset(lru, 0, sizeof *lru);
    }
    return lru;
}

static bt_status chc_open(bt_rpc_chcache_t *c, chc_entry *e, const char *target, const char *identity)
{
    bt_rpc_channel_config_t cc = {
        .target = target,
        .tls_ca_file = c->ca[0] ? c->ca : NULL,
        .tls_cert_file = c->cert[0] ? c->cert : NULL,
        .tls_key_file = c->key[0] ? c->key : NULL,
        .tls_server_name = identity && *identity ? identity : NULL,
        .max_message = c->max_message,
        .keepalive_ms = c->keepalive_ms,
    };
    bt_status st = bt_rpc_channel_create(&cc, &e->ch);
    if (st) return st;
    snprintf(e->target, sizeof e->target, "%s", target);
    snprintf(e->identity, sizeof e->identity, "%s", identity ? identity : "");
    return BT_OK;
}

bt_status bt_rpc_chcache_get(bt_rpc_chcache_t *c, const char *target, const char *identity, bt_rpc_channel_t **out)
{
    bt_status st = bt_tls_check_member_addr(target);
    if (st) return st;
    if (identity && strlen(identity) >= sizeof c->e[0].identity)
        return bt_fail(BT_ERR_INVALID, "peer identity longer than %zu bytes", sizeof c->e[0].identity - 1);
    const char *id = identity ? identity : "";
    pthread_mutex_lock(&c->mu);
    chc_entry *e = NULL;
    for (int i = 0; i < c->n && !e; i++)
        if (c->e[i].ch && !strcmp(c->e[i].target, target) && !strcmp(c->e[i].identity, id)) e = &c->e[i];
    if (!e) {
        if (!(e = chc_slot(c))) {
            st = bt_fail(BT_ERR_EXHAUSTED, "all %d cached channels are in use", c->cap);
        } else if ((st = chc_open(c, e, target, id)) != BT_OK) {
            memset(e, 0, sizeof *e); /* stays free: found by chc_slot as an unheld, oldest entry */
        }
    }
    if (st == BT_OK) {
        e->refs++;
        e->last_used = ++c->clock;
        *out = e->ch;
    }
    pthread_mutex_unlock(&c->mu);
    return st;
}

void bt_rpc_chcache_release(bt_rpc_chcache_t *c, bt_rpc_channel_t *ch)
{
    if (!c || !ch) return;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n; i++)
        if (c->e[i].ch == ch && c->e[i].refs > 0) {
            c->e[i].refs--;
            break;
        }
    pthread_mutex_unlock(&c->mu);
}

void bt_rpc_chcache_stats(bt_rpc_chcache_t *c, int *open, uint64_t *evictions)
{
    pthread_mutex_lock(&c->mu);
    int k = 0;
    for (int i = 0; i < c->n; i++) k += c->e[i].ch != NULL;
    if (open) *open = k;
    if (evictions) *evictions = c->evictions;
    pthread_mutex_unlock(&c->mu);
}

void bt_rpc_chcache_destroy(bt_rpc_chcache_t *c)
{
    if (!c) return;
    for (int i = 0; i < c->n; i++) bt_rpc_channel_destroy(c->e[i].ch);
    pthread_mutex_destroy(&c->mu);
    free(c->e);
    free(c);
}
