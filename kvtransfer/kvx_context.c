/* kvx_context: UCX context + worker, and the progress thread that drives them (worker event fd +
 * ucp_worker_arm), the deadline sweep and the user-callback queue. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/env.h"
#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

uint64_t kvx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kvx_now_ms(void)
{
    return kvx_now_ns() / 1000000ull;
}

void kvx_kick(kvx_context_t *ctx)
{
    if (!ctx->sleeping) return;
    ctx->sleeping = 0;
    uint64_t one = 1;
    ssize_t n = write(ctx->wake_fd, &one, sizeof one);
    (void)n; /* EAGAIN means a wake-up is already pending */
}

void kvx_notify_push(kvx_context_t *ctx, kvx_notify_t *n)
{
    n->next = NULL;
    n->pending = 1;
    if (ctx->notify_tail)
        ctx->notify_tail->next = n;
    else
        ctx->notify_head = n;
    ctx->notify_tail = n;
    kvx_kick(ctx);
}

uint64_t kvx_random_u64(void)
{
    uint64_t v = 0;
    for (int tries = 0; tries < 4; tries++) {
        ssize_t n = getrandom(&v, sizeof v, 0);
        if (n == (ssize_t)sizeof v && v) return v;
        if (n < 0 && errno != EINTR) break;
    }
    /* no kernel randomness (pre-3.17 kernel or seccomp): unique but guessable; say so once */
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
        BT_WARN("kvx", "getrandom() failed (%s): epochs are unique but predictable", strerror(errno));
    static uint64_t counter;
    uint64_t c = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    return (kvx_now_ns() ^ ((uint64_t)getpid() << 32) ^ (c * 0x9e3779b97f4a7c15ull)) | 1;
}

/* Runs queued user callbacks with mu released; returns with mu held. */
static void run_callbacks(kvx_context_t *ctx)
{
    while (ctx->notify_head) {
        kvx_notify_t *n = ctx->notify_head;
        ctx->notify_head = n->next;
        if (!ctx->notify_head) ctx->notify_tail = NULL;
        if (n->kind == KVX_OBJ_PUSH) {
            kvx_push_t *p = (kvx_push_t *)((char *)n - offsetof(kvx_push_t, notify));
            kvx_push_cb cb = p->user_gone ? NULL : p->cb;
            if (cb) {
                ctx->cb_running = p;
                pthread_mutex_unlock(&ctx->mu);
                cb(p, p->status, p->cb_arg);
                pthread_mutex_lock(&ctx->mu);
                ctx->cb_running = NULL;
            }
            n->pending = 0;
            pthread_cond_broadcast(&ctx->cv);
            kvx_push_unref(p);
        } else {
            kvx_expect_t *e = (kvx_expect_t *)((char *)n - offsetof(kvx_expect_t, notify));
            kvx_expect_cb cb = e->cb;
            if (cb) {
                ctx->cb_running = e;
                pthread_mutex_unlock(&ctx->mu);
                cb(e, e->status, e->cb_arg);
                pthread_mutex_lock(&ctx->mu);
                ctx->cb_running = NULL;
            }
            n->pending = 0;
            pthread_cond_broadcast(&ctx->cv);
            kvx_expect_unref(e);
        }
    }
}

static void *progress_main(void *arg)
{
    kvx_context_t *ctx = arg;
    pthread_mutex_lock(&ctx->mu);
    while (!ctx->stopping) {
        while (ucp_worker_progress(ctx->worker)) {
        }
        uint64_t wait_ms = kvx_deadlines(ctx, kvx_now_ms());
        kvx_peers_reap(ctx);
        if (ctx->notify_head) {
            run_callbacks(ctx);
            continue;
        }
        ucs_status_t us = ucp_worker_arm(ctx->worker);
        if (us == UCS_ERR_BUSY) continue;
        /* UCX's keepalive and endpoint closes advance only inside progress: tick while anything is live. */
        int busy = !bt_list_empty(&ctx->pushes) || !bt_list_empty(&ctx->expects) || ctx->closing || ctx->dead;
        uint64_t tick = busy ? 50 : (ctx->peers ? ctx->keepalive_ms : 1000);
        if (wait_ms > tick) wait_ms = tick;
        ctx->sleeping = 1;
        pthread_mutex_unlock(&ctx->mu);
        struct pollfd fds[2] = {{.fd = ctx->wake_fd, .events = POLLIN}, {.fd = ctx->efd, .events = POLLIN}};
        int nfds = us == UCS_OK ? 2 : 1; /* arm failed otherwise: just wait on the wake fd and the tick */
        if (poll(fds, (nfds_t)nfds, (int)wait_ms) > 0 && (fds[0].revents & POLLIN)) {
            uint64_t v;
            ssize_t n = read(ctx->wake_fd, &v, sizeof v);
            (void)n;
        }
        pthread_mutex_lock(&ctx->mu);
        ctx->sleeping = 0;
    }
    pthread_mutex_unlock(&ctx->mu);
    return NULL;
}

/* Sets a UCX option unless its UCX_* variable is set: UCX reads its own variables (ucp_config_read), and a user's
 * choice wins over our default. These are UCX's settings, not baton's switches (those are read at the edge). */
static void config_default(ucp_config_t *cfg, const char *name, const char *value)
{
    char env[96];
    snprintf(env, sizeof env, "UCX_%s", name);
    if (getenv(env)) return;
    ucs_status_t us = ucp_config_modify(cfg, name, value);
    if (us != UCS_OK) BT_DEBUG("kvx", "ucp_config_modify(%s=%s): %s", name, value, ucs_status_string(us));
}

/* Whether UCX_TLS allows shared-memory transports (else setting their options draws a UCX warning). */
static int tls_may_use_shm(void)
{
    const char *tls = getenv("UCX_TLS");
    if (!tls || !*tls || tls[0] == '^') return 1;
    static const char *const names[] = {"all", "sm", "shm", "posix", "sysv", "mm"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        size_t n = strlen(names[i]);
        for (const char *p = tls; (p = strstr(p, names[i])) != NULL; p += n)
            if ((p == tls || p[-1] == ',') && (p[n] == '\0' || p[n] == ',')) return 1;
    }
    return 0;
}

const char *kvx_data_path_name(kvx_data_path_t path)
{
    switch (path) {
    case KVX_PATH_AUTO: return "auto";
    case KVX_PATH_MAPPED: return "mapped";
    case KVX_PATH_PUT: return "put";
    case KVX_PATH_AM: return "am";
    }
    return "?";
}

bt_status kvx_context_opts_from_env(kvx_context_opts_t *o)
{
    static const char *const paths[] = {"auto", "mapped", "put", "am"}; /* kvx_data_path_t order */
    int dp = KVX_PATH_AUTO;
    bt_status st = bt_env_choice("BATON_KVX_DATA_PATH", paths, 4, KVX_PATH_AUTO, &dp);
    if (st == BT_OK && o->data_path == KVX_PATH_AUTO) o->data_path = (kvx_data_path_t)dp;
    return st;
}

bt_status kvx_context_create(const kvx_context_opts_t *opts, kvx_context_t **out)
{
    bt_status st;
    ucs_status_t us;
    ucp_config_t *cfg = NULL;
    kvx_context_t *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    snprintf(ctx->name, sizeof ctx->name, "%s", opts && opts->name ? opts->name : "kvx");
    ctx->keepalive_ms = opts && opts->keepalive_ms ? opts->keepalive_ms : 200;
    ctx->data_path = opts ? opts->data_path : KVX_PATH_AUTO;
    ctx->max_peers = opts && opts->max_peers ? opts->max_peers : KVX_DEFAULT_MAX_PEERS;
    ctx->instance = kvx_random_u64();
    /* Epochs from a random high start so a restarted receiver does not reuse its predecessor's. */
    ctx->next_push_id = 1;
    ctx->wake_fd = -1;
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);

    us = ucp_config_read(NULL, NULL, &cfg);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_config_read: %s", ucs_status_string(us));
        goto fail;
    }
    /* Shared memory in PEER error mode needs these (POSIX_ and SYSV_ inherit MM_); the environment wins. */
    if (!getenv("UCX_POSIX_ERROR_HANDLING") && !getenv("UCX_SYSV_ERROR_HANDLING") && tls_may_use_shm())
        config_default(cfg, "MM_ERROR_HANDLING", "y");
    char ka[32];
    snprintf(ka, sizeof ka, "%ums", ctx->keepalive_ms);
    config_default(cfg, "KEEPALIVE_INTERVAL", ka);

    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = ctx->name,
    };
    us = ucp_init(&params, cfg, &ctx->ucp);
    ucp_config_release(cfg);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_init: %s (check UCX_TLS)", ucs_status_string(us));
        goto fail;
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_NAME,
        .thread_mode = UCS_THREAD_MODE_SERIALIZED, /* every call is serialized by ctx->mu */
        .name = ctx->name,
    };
    us = ucp_worker_create(ctx->ucp, &wp, &ctx->worker);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_worker_create: %s", ucs_status_string(us));
        goto fail_ucp;
    }
    us = ucp_worker_get_address(ctx->worker, &ctx->worker_addr, &ctx->worker_addr_len);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_worker_get_address: %s", ucs_status_string(us));
        goto fail_worker;
    }
    us = ucp_worker_get_efd(ctx->worker, &ctx->efd);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_worker_get_efd: %s", ucs_status_string(us));
        goto fail_addr;
    }
    ucp_am_handler_param_t am = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = KVX_AM_DONE,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = kvx_am_done_cb,
        .arg = ctx,
    };
    if ((us = ucp_worker_set_am_recv_handler(ctx->worker, &am)) == UCS_OK) {
        am.id = KVX_AM_ACK;
        am.cb = kvx_am_ack_cb;
        us = ucp_worker_set_am_recv_handler(ctx->worker, &am);
    }
    if (us == UCS_OK) {
        am.id = KVX_AM_DATA;
        am.cb = kvx_am_data_cb;
        us = ucp_worker_set_am_recv_handler(ctx->worker, &am);
    }
    if (us == UCS_OK) {
        am.id = KVX_AM_CLAIM;
        am.cb = kvx_am_claim_cb;
        us = ucp_worker_set_am_recv_handler(ctx->worker, &am);
    }
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: ucp_worker_set_am_recv_handler: %s", ucs_status_string(us));
        goto fail_addr;
    }
    ctx->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ctx->wake_fd < 0) {
        st = bt_fail(BT_ERR_IO, "kvx: eventfd: %s", strerror(errno));
        goto fail_addr;
    }
    if (pthread_create(&ctx->thread, NULL, progress_main, ctx) != 0) {
        st = bt_fail(BT_ERR_UNAVAILABLE, "kvx: cannot start the progress thread");
        goto fail_fd;
    }
    ctx->thread_started = 1;
    BT_DEBUG("kvx", "%s: context up, worker address %zu bytes", ctx->name, ctx->worker_addr_len);
    *out = ctx;
    return BT_OK;

fail_fd:
    close(ctx->wake_fd);
fail_addr:
    ucp_worker_release_address(ctx->worker, ctx->worker_addr);
fail_worker:
    ucp_worker_destroy(ctx->worker);
fail_ucp:
    ucp_cleanup(ctx->ucp);
fail:
    pthread_cond_destroy(&ctx->cv);
    pthread_mutex_destroy(&ctx->mu);
    free(ctx);
    return st;
}

void kvx_context_destroy(kvx_context_t *ctx)
{
    if (!ctx) return;
    pthread_mutex_lock(&ctx->mu);
    ctx->stopping = 1;
    ctx->sleeping = 1;
    kvx_kick(ctx);
    pthread_mutex_unlock(&ctx->mu);
    if (ctx->thread_started) pthread_join(ctx->thread, NULL);

    /* Now single-threaded: end everything without callbacks, then close endpoints. */
    pthread_mutex_lock(&ctx->mu);
    BT_LIST_FOR(p, &ctx->pushes, kvx_push_t, link) {
        p->user_gone = 1;
        kvx_push_finish(p, BT_ERR_CANCELLED, "kvx: context destroyed");
    }
    BT_LIST_FOR(e, &ctx->expects, kvx_expect_t, link) {
        e->cb = NULL;
        kvx_expect_finish(e, BT_ERR_CANCELLED, "kvx: context destroyed");
    }
    while (ctx->notify_head) {
        kvx_notify_t *n = ctx->notify_head;
        ctx->notify_head = n->next;
        n->pending = 0;
        if (n->kind == KVX_OBJ_PUSH)
            kvx_push_unref((kvx_push_t *)((char *)n - offsetof(kvx_push_t, notify)));
        else
            kvx_expect_unref((kvx_expect_t *)((char *)n - offsetof(kvx_expect_t, notify)));
    }
    ctx->notify_tail = NULL;
    while (ctx->peers) kvx_peer_fail(ctx->peers, BT_ERR_CANCELLED, "context destroyed");
    uint64_t until = kvx_now_ms() + 3000;
    do {
        while (ucp_worker_progress(ctx->worker)) {
        }
        kvx_peers_reap(ctx);
        if (!ctx->closing && !ctx->dead) break;
        pthread_mutex_unlock(&ctx->mu);
        usleep(1000);
        pthread_mutex_lock(&ctx->mu);
    } while (kvx_now_ms() < until);
    if (ctx->closing || ctx->dead) BT_WARN("kvx", "%s: endpoints still closing at shutdown", ctx->name);
    /* Let UCX send what its internal endpoints still hold (wireup replies): UCX 1.13 asserts when
     * ucp_worker_destroy purges a pending wireup reply. Bounded: a dead remote must not hold us. */
    ucp_request_param_t fp = {0};
    void *freq = ucp_worker_flush_nbx(ctx->worker, &fp);
    if (freq && !UCS_PTR_IS_ERR(freq)) {
        until = kvx_now_ms() + 500;
        while (ucp_request_check_status(freq) == UCS_INPROGRESS && kvx_now_ms() < until) {
            if (!ucp_worker_progress(ctx->worker)) {
                pthread_mutex_unlock(&ctx->mu);
                usleep(500);
                pthread_mutex_lock(&ctx->mu);
            }
        }
        if (ucp_request_check_status(freq) == UCS_INPROGRESS) ucp_request_cancel(ctx->worker, freq);
        while (ucp_request_check_status(freq) == UCS_INPROGRESS && kvx_now_ms() < until + 500)
            ucp_worker_progress(ctx->worker);
        ucp_request_free(freq);
    }
    /* Objects the user never released: free them so the UCX resources go. */
    while (!bt_list_empty(&ctx->pushes)) {
        kvx_push_t *p = bt_list_entry(ctx->pushes.head, kvx_push_t, link);
        p->refs = 1;
        kvx_push_unref(p);
    }
    while (!bt_list_empty(&ctx->expects)) {
        kvx_expect_t *e = bt_list_entry(ctx->expects.head, kvx_expect_t, link);
        e->refs = 1;
        kvx_expect_unref(e);
    }
    while (ctx->pools) {
        kvx_pool_t *pool = ctx->pools;
        ctx->pools = pool->next;
        ucp_mem_unmap(ctx->ucp, pool->memh); /* before the worker goes (rcache) */
        free(pool->desc);
        free(pool);
    }
    pthread_mutex_unlock(&ctx->mu);
    ucp_worker_release_address(ctx->worker, ctx->worker_addr);
    ucp_worker_destroy(ctx->worker);
    ucp_cleanup(ctx->ucp);
    close(ctx->wake_fd);
    pthread_cond_destroy(&ctx->cv);
    pthread_mutex_destroy(&ctx->mu);
    free(ctx);
}

void kvx_context_stats(kvx_context_t *ctx, kvx_stats_t *out)
{
    pthread_mutex_lock(&ctx->mu);
    *out = ctx->stats;
    pthread_mutex_unlock(&ctx->mu);
}
