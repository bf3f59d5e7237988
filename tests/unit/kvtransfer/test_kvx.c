/* tests kvtransfer end to end with two processes on loopback: this binary re-executes itself as an "agent"
 * (the other node) driven over a socketpair. ctest runs it over tcp (active messages), over shared memory (the
 * mapped pool) and over shared memory with BATON_KVX_DATA_PATH=put (ucp_put_nbx, the RDMA path); each entry names
 * the data path it must get in BATON_TEST_KVX_PATH, and the tests check that it did.
 * BATON_KVX_SOAK=N sets the soak test's transfer count (default 300). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/crc32c.h"
#include "kvtransfer/kvx.h"
#include "kvtransfer/kvx_internal.h" /* test hook: kvx_push.test_flip_layer */
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif

/* ---- framing over the socketpair: u32 type, u32 length, payload ---------------------------------------- */

enum {
    OP_INIT = 1, /* layout + seed -> descriptor */
    OP_EXPECT,   /* epoch, flags, timeout, n, blocks, sender desc len, desc -> status, epoch */
    OP_EXPECT_DROP,
    OP_EXPECT_WAIT, /* -> status, pending blocks */
    OP_DUMP,        /* -> pool bytes */
    OP_STATS,       /* -> kvx_stats_t */
    OP_CONNECT,     /* node id, desc -> status */
    OP_PUSH_START,  /* epoch, flags, timeout, n, src, dst -> status */
    OP_PUSH_LAYERS, /* from, to -> status */
    OP_PUSH_WAIT,   /* -> status */
    OP_EXPECT_SETTLE, /* epoch, timeout ms -> settle's status, pending blocks (the expectation is kept) */
    OP_EXIT,
};

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n) {
        ssize_t r = read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static int msg_send(int fd, uint32_t type, const void *p, size_t n)
{
    uint32_t h[2] = {type, (uint32_t)n};
    if (write_all(fd, h, sizeof h)) return -1;
    return n ? write_all(fd, p, n) : 0;
}

/* Returns a malloc'd payload (NUL-terminated for convenience) or NULL on a closed socket. */
static void *msg_recv(int fd, uint32_t *type, size_t *n)
{
    uint32_t h[2];
    if (read_all(fd, h, sizeof h)) return NULL;
    char *p = malloc((size_t)h[1] + 1);
    if (!p) return NULL;
    if (h[1] && read_all(fd, p, h[1])) {
        free(p);
        return NULL;
    }
    p[h[1]] = 0;
    *type = h[0];
    *n = h[1];
    return p;
}

/* A byte buffer for building payloads. */
typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf_t;

static void buf_add(buf_t *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}
#define BUF_VAL(b, v)                                                                                    \
    do {                                                                                                 \
        __typeof__(v) v_ = (v);                                                                          \
        buf_add((b), &v_, sizeof v_);                                                                    \
    } while (0)

/* ---- pool contents ------------------------------------------------------------------------------------- */

static void fill_pattern(uint8_t *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = test_rand_next(&seed);
        memcpy(p + i, &v, 8);
    }
}

/* ---- the agent (child process) ------------------------------------------------------------------------- */

#define MAX_EXPECTS 64

static int agent_main(int fd)
{
    kvx_context_t *ctx = NULL;
    kvx_pool_t *pool = NULL;
    kvx_peer_t *peer = NULL;
    kvx_push_t *push = NULL;
    kvx_expect_t *exp[MAX_EXPECTS] = {0};
    for (;;) {
        uint32_t type;
        size_t n;
        uint8_t *m = msg_recv(fd, &type, &n);
        if (!m) break;
        int32_t st = 0;
        buf_t out = {0};
        switch (type) {
        case OP_INIT: {
            kvx_layout_t l;
            uint64_t seed;
            memcpy(&l, m, sizeof l);
            memcpy(&seed, m + sizeof l, 8);
            kvx_context_opts_t o = {.name = "agent"};
            st = kvx_context_opts_from_env(&o); /* BATON_KVX_DATA_PATH, as a process's edge reads it */
            if (!st) st = kvx_context_create(&o, &ctx);
            if (!st) st = kvx_pool_create(ctx, &l, &pool);
            if (st) {
                fprintf(stderr, "agent: init: %s\n", bt_last_error());
                return 3;
            }
            uint64_t bytes;
            kvx_layout_check(&l, &bytes);
            fill_pattern(kvx_pool_base(pool), bytes, seed);
            size_t dl;
            const void *d = kvx_pool_descriptor(pool, &dl);
            buf_add(&out, d, dl);
            break;
        }
        case OP_EXPECT: {
            kvx_expect_args_t a = {0};
            uint32_t n_blocks, dl;
            size_t off = 0;
            memcpy(&a.epoch, m + off, 8), off += 8;
            memcpy(&a.flags, m + off, 4), off += 4;
            memcpy(&a.timeout_ms, m + off, 4), off += 4;
            memcpy(&n_blocks, m + off, 4), off += 4;
            a.blocks = (const uint32_t *)(m + off), off += 4 * (size_t)n_blocks;
            a.n_blocks = n_blocks;
            memcpy(&dl, m + off, 4), off += 4;
            kvx_peer_t *sender = NULL;
            if (dl) {
                st = kvx_peer_get(ctx, 99, m + off, dl, &sender);
                if (st) fprintf(stderr, "agent: sender peer: %s\n", bt_last_error());
            }
            a.sender = sender;
            off += dl;
            uint32_t nl = 0;
            if (off + 4 <= n) memcpy(&nl, m + off, 4), off += 4;
            if (nl) { /* a second list and the layer map (pool's layer count) */
                a.local_blocks = (const uint32_t *)(m + off), off += 4 * (size_t)nl;
                a.n_local_blocks = nl;
                a.layer_group = m + off;
            }
            int slot = 0;
            while (slot < MAX_EXPECTS && exp[slot]) slot++;
            kvx_expect_t *e = NULL;
            if (!st && slot < MAX_EXPECTS) st = kvx_expect_create(pool, &a, &e);
            kvx_peer_release(sender);
            uint64_t epoch = 0;
            if (!st && e) {
                exp[slot] = e;
                epoch = kvx_expect_epoch(e);
            }
            BUF_VAL(&out, st);
            BUF_VAL(&out, epoch);
            break;
        }
        case OP_EXPECT_DROP:
        case OP_EXPECT_WAIT: {
            uint64_t epoch;
            memcpy(&epoch, m, 8);
            int slot = 0;
            while (slot < MAX_EXPECTS && !(exp[slot] && kvx_expect_epoch(exp[slot]) == epoch)) slot++;
            uint64_t pending = 0;
            if (slot == MAX_EXPECTS) {
                st = BT_ERR_NOT_FOUND;
            } else {
                if (type == OP_EXPECT_WAIT) st = kvx_expect_wait(exp[slot]);
                kvx_expect_destroy(exp[slot]);
                exp[slot] = NULL;
                pending = kvx_pool_blocks_pending(pool);
            }
            BUF_VAL(&out, st);
            BUF_VAL(&out, pending);
            break;
        }
        case OP_EXPECT_SETTLE: {
            uint64_t epoch, pending = 0;
            uint32_t ms;
            memcpy(&epoch, m, 8);
            memcpy(&ms, m + 8, 4);
            int slot = 0;
            while (slot < MAX_EXPECTS && !(exp[slot] && kvx_expect_epoch(exp[slot]) == epoch)) slot++;
            st = slot == MAX_EXPECTS ? BT_ERR_NOT_FOUND : kvx_expect_settle(exp[slot], ms);
            pending = kvx_pool_blocks_pending(pool);
            BUF_VAL(&out, st);
            BUF_VAL(&out, pending);
            break;
        }
        case OP_DUMP: {
            uint64_t bytes;
            kvx_layout_check(kvx_pool_layout(pool), &bytes);
            buf_add(&out, kvx_pool_base(pool), bytes);
            break;
        }
        case OP_STATS: {
            kvx_stats_t s;
            kvx_context_stats(ctx, &s);
            buf_add(&out, &s, sizeof s);
            break;
        }
        case OP_CONNECT: {
            uint64_t node;
            memcpy(&node, m, 8);
            kvx_peer_release(peer);
            peer = NULL;
            st = kvx_peer_get(ctx, node, m + 8, n - 8, &peer);
            BUF_VAL(&out, st);
            break;
        }
        case OP_PUSH_START: {
            kvx_push_args_t a = {0};
            uint32_t nb;
            size_t off = 0;
            memcpy(&a.epoch, m + off, 8), off += 8;
            memcpy(&a.flags, m + off, 4), off += 4;
            memcpy(&a.timeout_ms, m + off, 4), off += 4;
            memcpy(&nb, m + off, 4), off += 4;
            a.n_blocks = nb;
            a.src_blocks = (const uint32_t *)(m + off), off += 4 * (size_t)nb;
            a.dst_blocks = (const uint32_t *)(m + off);
            kvx_push_destroy(push);
            push = NULL;
            st = kvx_push_create(pool, peer, &a, &push);
            BUF_VAL(&out, st);
            break;
        }
        case OP_PUSH_LAYERS: {
            uint32_t from, to;
            memcpy(&from, m, 4);
            memcpy(&to, m + 4, 4);
            for (uint32_t l = from; l < to && !st; l++) st = kvx_push_layer(push, l);
            BUF_VAL(&out, st);
            break;
        }
        case OP_PUSH_WAIT:
            st = kvx_push_wait(push);
            BUF_VAL(&out, st);
            break;
        case OP_EXIT:
            free(m);
            kvx_push_destroy(push);
            for (int i = 0; i < MAX_EXPECTS; i++) kvx_expect_destroy(exp[i]);
            kvx_peer_release(peer);
            kvx_pool_destroy(pool);
            kvx_context_destroy(ctx);
            msg_send(fd, 0, NULL, 0);
            return 0;
        }
        free(m);
        if (msg_send(fd, 0, out.p, out.n)) return 2;
        free(out.p);
    }
    return 1;
}

/* ---- parent-side helpers ------------------------------------------------------------------------------- */

typedef struct agent {
    pid_t pid;
    int fd;
    uint8_t *desc;
    size_t desc_len;
    kvx_layout_t layout;
    uint64_t seed;
} agent_t;

static const char *self_exe;

static int agent_spawn(agent_t *a)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        int fd = dup(sv[1]); /* without CLOEXEC */
        char arg[16];
        snprintf(arg, sizeof arg, "%d", fd);
        execl(self_exe, self_exe, "--kvx-agent", arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    memset(a, 0, sizeof *a);
    a->pid = pid;
    a->fd = sv[0];
    return 0;
}

/* Sends a request and returns the reply payload (malloc'd) or NULL when the agent is gone. */
static uint8_t *agent_call(agent_t *a, uint32_t op, const void *p, size_t n, size_t *reply_len)
{
    size_t dummy;
    uint32_t type;
    if (msg_send(a->fd, op, p, n)) return NULL;
    return msg_recv(a->fd, &type, reply_len ? reply_len : &dummy);
}

static int32_t agent_status(agent_t *a, uint32_t op, const void *p, size_t n)
{
    size_t len;
    uint8_t *r = agent_call(a, op, p, n, &len);
    int32_t st = BT_ERR_PEER;
    if (r && len >= 4) memcpy(&st, r, 4);
    free(r);
    return st;
}

static int agent_init(agent_t *a, const kvx_layout_t *l, uint64_t seed)
{
    if (agent_spawn(a)) return -1;
    a->layout = *l;
    a->seed = seed;
    uint8_t req[sizeof *l + 8];
    memcpy(req, l, sizeof *l);
    memcpy(req + sizeof *l, &seed, 8);
    a->desc = agent_call(a, OP_INIT, req, sizeof req, &a->desc_len);
    return a->desc ? 0 : -1;
}

static void agent_close(agent_t *a)
{
    if (a->pid > 0) {
        uint8_t *r = agent_call(a, OP_EXIT, NULL, 0, NULL);
        free(r);
        int status;
        waitpid(a->pid, &status, 0);
        CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "agent exit status %d", status);
    }
    close(a->fd);
    free(a->desc);
    a->pid = 0;
}

static void agent_kill(agent_t *a)
{
    kill(a->pid, SIGKILL);
    waitpid(a->pid, NULL, 0);
    a->pid = 0;
}

/* Registers an expectation in the agent, with a second list for the layers of map (nl 0: none); returns its epoch
 * (0 on failure, status in *st). */
static uint64_t agent_expect2(agent_t *a, const uint32_t *blocks, size_t n, const uint32_t *lblocks, size_t nl,
                              const uint8_t *map, uint64_t epoch, uint32_t flags, uint32_t timeout_ms,
                              const void *sender_desc, size_t sender_len, int32_t *st_out)
{
    buf_t b = {0};
    BUF_VAL(&b, epoch);
    BUF_VAL(&b, flags);
    BUF_VAL(&b, timeout_ms);
    BUF_VAL(&b, (uint32_t)n);
    buf_add(&b, blocks, 4 * n);
    BUF_VAL(&b, (uint32_t)sender_len);
    if (sender_len) buf_add(&b, sender_desc, sender_len);
    BUF_VAL(&b, (uint32_t)nl);
    if (nl) {
        buf_add(&b, lblocks, 4 * nl);
        buf_add(&b, map, a->layout.n_layers);
    }
    size_t len;
    uint8_t *r = agent_call(a, OP_EXPECT, b.p, b.n, &len);
    free(b.p);
    int32_t st = BT_ERR_PEER;
    uint64_t e = 0;
    if (r && len == 12) {
        memcpy(&st, r, 4);
        memcpy(&e, r + 4, 8);
    }
    free(r);
    if (st_out) *st_out = st;
    return st ? 0 : e;
}

static uint64_t agent_expect(agent_t *a, const uint32_t *blocks, size_t n, uint64_t epoch, uint32_t flags,
                             uint32_t timeout_ms, const void *sender_desc, size_t sender_len, int32_t *st_out)
{
    return agent_expect2(a, blocks, n, NULL, 0, NULL, epoch, flags, timeout_ms, sender_desc, sender_len, st_out);
}

/* An agent call answered by (status, pending blocks); BT_ERR_PEER when the answer is missing. */
static int32_t agent_status_call(agent_t *a, uint32_t op, const void *req, size_t n, uint64_t *pending)
{
    size_t len;
    uint8_t *r = agent_call(a, op, req, n, &len);
    int32_t st = BT_ERR_PEER;
    if (r && len == 12) {
        memcpy(&st, r, 4);
        if (pending) memcpy(pending, r + 4, 8);
    }
    free(r);
    return st;
}

static int32_t agent_expect_wait(agent_t *a, uint64_t epoch, uint64_t *pending)
{
    return agent_status_call(a, OP_EXPECT_WAIT, &epoch, 8, pending);
}

/* kvx_expect_settle in the agent; *pending: blocks its pool still holds for expectations afterwards. */
static int32_t agent_expect_settle(agent_t *a, uint64_t epoch, uint32_t ms, uint64_t *pending)
{
    uint8_t req[12];
    memcpy(req, &epoch, 8);
    memcpy(req + 8, &ms, 4);
    return agent_status_call(a, OP_EXPECT_SETTLE, req, sizeof req, pending);
}

static kvx_stats_t agent_stats(agent_t *a)
{
    kvx_stats_t s = {0};
    size_t len;
    uint8_t *r = agent_call(a, OP_STATS, NULL, 0, &len);
    if (r && len == sizeof s) memcpy(&s, r, sizeof s);
    free(r);
    return s;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static size_t count_runs(const uint32_t *s, const uint32_t *d, size_t n)
{
    size_t runs = 1;
    for (size_t i = 1; i < n; i++)
        if (s[i] != s[i - 1] + 1 || d[i] != d[i - 1] + 1) runs++;
    return runs;
}

/* Picks n distinct blocks below limit: one contiguous run when contiguous, else scattered. */
static void pick_blocks(uint64_t *seed, uint32_t *out, size_t n, uint32_t limit, int contiguous)
{
    if (contiguous) {
        uint32_t start = (uint32_t)(test_rand_next(seed) % (limit - n + 1));
        for (size_t i = 0; i < n; i++) out[i] = start + (uint32_t)i;
        return;
    }
    uint8_t *used = calloc(limit, 1);
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        do b = (uint32_t)(test_rand_next(seed) % limit);
        while (used[b]);
        used[b] = 1;
        out[i] = b;
        /* Sometimes extend into a short run so fragmented sets mix run lengths. */
        while (i + 1 < n && b + 1 < limit && !used[b + 1] && test_rand_next(seed) % 2) {
            used[++b] = 1;
            out[++i] = b;
        }
    }
    free(used);
}

/* Checks the agent's pool: blocks dst[i] hold src[i] of ours in every layer, every other block still holds
 * the agent's initial pattern. Returns the number of mismatching blocks. */
static size_t verify_agent_pool(agent_t *a, const kvx_pool_t *src_pool, const uint32_t *src, const uint32_t *dst,
                                size_t n)
{
    const kvx_layout_t *rl = &a->layout, *ll = kvx_pool_layout(src_pool);
    uint64_t bytes;
    kvx_layout_check(rl, &bytes);
    size_t len;
    uint8_t *dump = agent_call(a, OP_DUMP, NULL, 0, &len);
    if (!dump || len != bytes) {
        free(dump);
        return (size_t)-1;
    }
    uint8_t *expect = malloc(bytes);
    fill_pattern(expect, bytes, a->seed);
    const uint8_t *sb = kvx_pool_base(src_pool);
    for (size_t i = 0; i < n; i++)
        for (uint32_t l = 0; l < rl->n_layers; l++)
            memcpy(expect + kvx_layout_offset(rl, l, dst[i]), sb + kvx_layout_offset(ll, l, src[i]),
                   rl->block_stride);
    size_t bad = 0;
    for (uint32_t l = 0; l < rl->n_layers; l++)
        for (uint32_t b = 0; b < rl->n_blocks; b++) {
            uint64_t off = kvx_layout_offset(rl, l, b);
            if (memcmp(expect + off, dump + off, rl->block_stride)) bad++;
        }
    free(expect);
    free(dump);
    return bad;
}

/* ---- the tests ----------------------------------------------------------------------------------------- */

static const kvx_layout_t SRC_L = {.n_layers = 4, .n_blocks = 64, .block_stride = 3072, .fingerprint = 0x5eed};
static const kvx_layout_t DST_L = {.n_layers = 4, .n_blocks = 96, .block_stride = 3072, .fingerprint = 0x5eed};

typedef struct sender {
    kvx_context_t *ctx;
    kvx_pool_t *pool;
    uint64_t seed;
} sender_t;

static int sender_init(sender_t *s, const kvx_layout_t *l, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->seed = seed;
    kvx_context_opts_t o = {.name = "test"};
    if (kvx_context_opts_from_env(&o) != BT_OK || kvx_context_create(&o, &s->ctx) != BT_OK) return -1;
    if (kvx_pool_create(s->ctx, l, &s->pool) != BT_OK) return -1;
    uint64_t bytes;
    kvx_layout_check(l, &bytes);
    fill_pattern(kvx_pool_base(s->pool), bytes, seed);
    return 0;
}

static void sender_free(sender_t *s)
{
    CHECK(kvx_pool_destroy(s->pool) == BT_OK);
    kvx_context_destroy(s->ctx);
}

typedef struct cb_rec {
    int calls;
    bt_status st;
} cb_rec_t;

/* The data path a peer must use in this run (BATON_TEST_KVX_PATH, set by every ctest entry), else -1. */
static int wanted_path(void)
{
    const char *w = getenv("BATON_TEST_KVX_PATH");
    for (int k = KVX_PATH_MAPPED; w && k <= KVX_PATH_AM; k++)
        if (!strcmp(w, kvx_data_path_name((kvx_data_path_t)k))) return k;
    return -1;
}

static void check_path(const kvx_peer_t *peer)
{
    const char *w = getenv("BATON_TEST_KVX_PATH");
    CHECK_MSG(w && wanted_path() >= 0, "BATON_TEST_KVX_PATH=%s: expected mapped, put or am", w ? w : "(unset)");
    CHECK_MSG((int)kvx_peer_data_path(peer) == wanted_path(), "data path %s, this run wants %s",
              kvx_data_path_name(kvx_peer_data_path(peer)), w ? w : "(unset)");
}

static void push_cb(kvx_push_t *push, bt_status st, void *arg)
{
    cb_rec_t *r = arg;
    r->calls++;
    r->st = st;
}

/* Issue 16 item 8: peers are cached by node ids that arrive in requests; the cache stays within max_peers by
 * closing the least recently used idle peer, refuses when every peer is in use, and keeps a busy peer usable. */
/* One push of block blk through peer p into the agent, checked end to end. */
static void push_one(kvx_pool_t *pool, kvx_peer_t *p, agent_t *a, uint32_t blk)
{
    uint64_t e = agent_expect(a, &blk, 1, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    kvx_push_args_t args = {.src_blocks = &blk, .dst_blocks = &blk, .n_blocks = 1, .epoch = e, .timeout_ms = 10000};
    kvx_push_t *push = NULL;
    REQUIRE(kvx_push_create(pool, p, &args, &push) == BT_OK);
    REQUIRE(kvx_push_all(push) == BT_OK);
    CHECK(kvx_push_wait(push) == BT_OK);
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(a, e, NULL) == BT_OK);
}

/* kvx_pool_register: existing host memory keeps its contents and address; CUDA memory on this UCX (Debian's 1.13 has
 * no CUDA transports; here the memory is not even on a GPU) is refused with an error, not a crash */
static void test_pool_register(void)
{
    kvx_context_opts_t o = {.name = "reg"};
    kvx_context_t *ctx = NULL;
    kvx_pool_t *pool = NULL;
    REQUIRE(kvx_context_opts_from_env(&o) == BT_OK);
    REQUIRE(kvx_context_create(&o, &ctx) == BT_OK);
    uint64_t bytes;
    REQUIRE(kvx_layout_check(&SRC_L, &bytes) == BT_OK);
    uint8_t *mem = malloc(bytes);
    REQUIRE(mem);
    for (uint64_t i = 0; i < bytes; i++) mem[i] = (uint8_t)(i * 7);
    CHECK(kvx_pool_register(ctx, &SRC_L, NULL, KVX_MEM_HOST, &pool) == BT_ERR_INVALID);
    REQUIRE(kvx_pool_register(ctx, &SRC_L, mem, KVX_MEM_HOST, &pool) == BT_OK);
    CHECK(kvx_pool_base(pool) == mem && mem[1] == 7 && mem[bytes - 1] == (uint8_t)((bytes - 1) * 7));
    CHECK(kvx_pool_destroy(pool) == BT_OK);
    pool = NULL;
    bt_status st = kvx_pool_register(ctx, &SRC_L, mem, KVX_MEM_CUDA, &pool);
    CHECK_MSG(st != BT_OK && !pool, "host memory registered as CUDA memory");
    if (st) fprintf(stderr, "kvx_pool_register(KVX_MEM_CUDA) here: %s\n", bt_last_error());
    if (pool) kvx_pool_destroy(pool);
    kvx_context_destroy(ctx);
    free(mem);
}

static void test_peer_cache_cap(void)
{
    agent_t a;
    REQUIRE(agent_init(&a, &DST_L, 7) == 0);
    kvx_context_opts_t o = {.name = "cap", .max_peers = 2};
    kvx_context_t *ctx = NULL;
    kvx_pool_t *pool = NULL;
    REQUIRE(kvx_context_opts_from_env(&o) == BT_OK);
    REQUIRE(kvx_context_create(&o, &ctx) == BT_OK);
    REQUIRE(kvx_pool_create(ctx, &SRC_L, &pool) == BT_OK);
    for (uint64_t id = 1; id <= 10; id++) { /* ten made-up node ids for the same pool, each used for a push */
        kvx_peer_t *p = NULL;
        REQUIRE(kvx_peer_get(ctx, id, a.desc, a.desc_len, &p) == BT_OK);
        push_one(pool, p, &a, (uint32_t)id);
        kvx_peer_release(p);
    }
    kvx_stats_t st;
    kvx_context_stats(ctx, &st);
    CHECK_MSG(st.peers_built == 10 && st.peers_evicted == 8, "built %llu evicted %llu",
              (unsigned long long)st.peers_built, (unsigned long long)st.peers_evicted);
    kvx_peer_t *h1 = NULL, *h2 = NULL, *h3 = NULL, *again = NULL;
    REQUIRE(kvx_peer_get(ctx, 100, a.desc, a.desc_len, &h1) == BT_OK);
    REQUIRE(kvx_peer_get(ctx, 101, a.desc, a.desc_len, &h2) == BT_OK);
    CHECK(kvx_peer_get(ctx, 102, a.desc, a.desc_len, &h3) == BT_ERR_EXHAUSTED); /* both held: nothing to close */
    CHECK(kvx_peer_status(h1) == BT_OK && kvx_peer_status(h2) == BT_OK);
    CHECK(kvx_peer_get(ctx, 100, a.desc, a.desc_len, &again) == BT_OK && again == h1); /* a hit needs no room */
    kvx_peer_release(again);
    /* UCX 1.13 over tcp: closing an endpoint whose wire-up is still in flight can trip an assertion in the receiver
     * ("got REP message"); real peers always carry a push first, so these do too before the context closes them */
    push_one(pool, h1, &a, 11);
    push_one(pool, h2, &a, 12);
    kvx_peer_release(h1);
    kvx_peer_release(h2);
    for (int i = 0; i < 100; i++) { /* closed endpoints are reaped by the progress thread */
        kvx_context_stats(ctx, &st);
        if (st.live_peers <= 2) break;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    CHECK_MSG(st.live_peers <= 2, "%u peers alive", st.live_peers);
    CHECK(kvx_pool_destroy(pool) == BT_OK);
    kvx_context_destroy(ctx);
    agent_close(&a);
}

static void test_bitexact(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 11) == 0);
    REQUIRE(agent_init(&a, &DST_L, 22) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 1, a.desc, a.desc_len, &peer) == BT_OK);
    check_path(peer);
    fprintf(stderr, "  data path: %s\n", kvx_data_path_name(kvx_peer_data_path(peer)));
    kvx_peer_t *again = NULL;
    CHECK(kvx_peer_get(s.ctx, 1, a.desc, a.desc_len, &again) == BT_OK && again == peer); /* cached */
    kvx_peer_release(again);

    uint64_t seed = 1234, ranges = 0;
    uint32_t src[40], dst[40];
    size_t total_src_blocks = 0, all_src[96 * 8], all_dst[96 * 8];
    uint8_t dst_used[96] = {0};
    (void)all_src;
    (void)all_dst;
    for (int round = 0; round < 8; round++) {
        int contiguous = round % 2 == 0;
        size_t n = 1 + test_rand_next(&seed) % 40;
        /* Destination blocks are fresh each round so earlier rounds stay checkable. */
        pick_blocks(&seed, src, n, SRC_L.n_blocks, contiguous);
        size_t tries = 0;
        do {
            pick_blocks(&seed, dst, n, DST_L.n_blocks, contiguous);
            int clash = 0;
            for (size_t i = 0; i < n; i++) clash |= dst_used[dst[i]];
            if (!clash) break;
        } while (++tries < 1000);
        if (tries == 1000) {
            n = 1;
            for (uint32_t b = 0; b < DST_L.n_blocks; b++)
                if (!dst_used[b]) dst[0] = b;
        }
        for (size_t i = 0; i < n; i++) dst_used[dst[i]] = 1;
        uint32_t flags = round % 3 == 0 ? KVX_F_CRC : 0;
        int32_t est;
        uint64_t epoch = agent_expect(&a, dst, n, 0, flags, 10000, NULL, 0, &est);
        REQUIRE(est == BT_OK && epoch != 0);

        cb_rec_t rec = {0};
        kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = n, .epoch = epoch,
                                .flags = flags, .timeout_ms = 10000, .cb = push_cb, .cb_arg = &rec};
        kvx_push_t *push = NULL;
        REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
        size_t runs = count_runs(src, dst, n);
        ranges += runs * SRC_L.n_layers;
        CHECK(kvx_push_plan(push)->n_runs == runs);
        if (contiguous) CHECK(runs == 1);
        /* Layers in a shuffled order, as a pipelined prefill might finish them. */
        uint32_t order[4] = {2, 0, 3, 1};
        for (uint32_t k = 0; k < SRC_L.n_layers; k++) {
            CHECK(kvx_push_layer(push, order[k]) == BT_OK);
            CHECK_MSG(kvx_push_puts(push) == runs * (k + 1), "puts %zu, runs %zu, layers %u", kvx_push_puts(push),
                      runs, k + 1);
        }
        CHECK(kvx_push_layer(push, 1) == BT_ERR_INVALID); /* twice */
        bt_status st = kvx_push_wait(push);
        CHECK_MSG(st == BT_OK, "round %d: %s", round, kvx_push_error(push));
        CHECK(kvx_push_elapsed_ns(push) > 0 && kvx_push_elapsed_ns(push) == kvx_push_elapsed_ns(push));
        uint64_t pending = 99;
        CHECK(agent_expect_wait(&a, epoch, &pending) == BT_OK);
        CHECK(pending == 0);
        kvx_push_destroy(push);
        CHECK(rec.calls == 1 && rec.st == BT_OK);
        for (size_t i = 0; i < n; i++) {
            all_src[total_src_blocks] = src[i];
            all_dst[total_src_blocks++] = dst[i];
        }
    }
    uint32_t s32[96 * 8], d32[96 * 8];
    for (size_t i = 0; i < total_src_blocks; i++) {
        s32[i] = (uint32_t)all_src[i];
        d32[i] = (uint32_t)all_dst[i];
    }
    CHECK(verify_agent_pool(&a, s.pool, s32, d32, total_src_blocks) == 0);
    kvx_stats_t st = agent_stats(&a);
    CHECK(st.expects_ok == 8 && st.expects_failed == 0 && st.crc_mismatches == 0);
    /* the receiver's side of the path: data messages only on the AM path, one per range */
    uint64_t want_am = kvx_peer_data_path(peer) == KVX_PATH_AM ? ranges : 0;
    CHECK_MSG(st.am_data_received == want_am, "%s path: receiver got %llu data messages, want %llu",
              kvx_data_path_name(kvx_peer_data_path(peer)), (unsigned long long)st.am_data_received,
              (unsigned long long)want_am);
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

/* A model whose sliding-window layers have their own block space: layers 1 and 3 move a second, shorter list whose
 * destination ids repeat the first list's (other layers' bytes), with and without checksums; every other byte of the
 * receiver's pool is untouched. A receiver expecting one list refuses a two-list push before anything lands. */
static void test_two_lists(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 31) == 0);
    REQUIRE(agent_init(&a, &DST_L, 32) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 1, a.desc, a.desc_len, &peer) == BT_OK);
    check_path(peer);
    const uint8_t map[4] = {0, 1, 0, 1};
    uint32_t src[10], dst[10], lsrc[3] = {20, 21, 40}, ldst[3] = {10, 11, 12};
    for (uint32_t i = 0; i < 10; i++) src[i] = i, dst[i] = 10 + i;
    for (int round = 0; round < 2; round++) {
        uint32_t flags = round ? KVX_F_CRC : 0;
        int32_t est;
        uint64_t epoch = agent_expect2(&a, dst, 10, ldst, 3, map, 0, flags, 10000, NULL, 0, &est);
        REQUIRE(est == BT_OK && epoch != 0);
        kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = 10, .epoch = epoch,
                                .flags = flags, .timeout_ms = 10000, .layer_group = map,
                                .local_src_blocks = lsrc, .local_dst_blocks = ldst, .n_local_blocks = 3};
        kvx_push_t *push = NULL;
        REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
        CHECK(kvx_push_all(push) == BT_OK);
        CHECK_MSG(kvx_push_wait(push) == BT_OK, "round %d: %s", round, kvx_push_error(push));
        /* 2 layers x 1 run + 2 layers x 2 runs (20-21, 40) */
        CHECK_MSG(kvx_push_puts(push) == 6, "%zu puts", kvx_push_puts(push));
        kvx_push_destroy(push);
        CHECK(agent_expect_wait(&a, epoch, NULL) == BT_OK);
    }
    /* the receiver's pool: its pattern, with layers 0 and 2 of blocks 10..19 and layers 1 and 3 of 10..12 replaced */
    uint64_t bytes;
    kvx_layout_check(&DST_L, &bytes);
    size_t len;
    uint8_t *dump = agent_call(&a, OP_DUMP, NULL, 0, &len), *want = malloc(bytes);
    REQUIRE(dump && want && len == bytes);
    fill_pattern(want, bytes, a.seed);
    const uint8_t *sb = kvx_pool_base(s.pool);
    for (uint32_t l = 0; l < 4; l++) {
        const uint32_t *ss = map[l] ? lsrc : src, *dd = map[l] ? ldst : dst;
        for (uint32_t i = 0; i < (map[l] ? 3u : 10u); i++)
            memcpy(want + kvx_layout_offset(&DST_L, l, dd[i]), sb + kvx_layout_offset(&SRC_L, l, ss[i]),
                   DST_L.block_stride);
    }
    CHECK(memcmp(want, dump, bytes) == 0);
    free(want);
    free(dump);
    /* one list expected, two pushed: refused (on the claim, or at DONE on the AM path) */
    int32_t est;
    uint64_t epoch = agent_expect(&a, dst, 10, 0, 0, 10000, NULL, 0, &est);
    REQUIRE(est == BT_OK && epoch != 0);
    kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = 10, .epoch = epoch, .timeout_ms = 10000,
                            .layer_group = map, .local_src_blocks = lsrc, .local_dst_blocks = ldst,
                            .n_local_blocks = 3};
    kvx_push_t *push = NULL;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    kvx_push_all(push);
    CHECK(kvx_push_wait(push) == BT_ERR_FORMAT);
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(&a, epoch, NULL) == BT_ERR_FORMAT);
    /* a bit flipped after its checksum was taken, in a layer of the second list and in one of the first: each list's
     * checksums are folded over its own layers and caught */
    for (int k = 0; k < 2; k++) {
        uint64_t mismatches = agent_stats(&a).crc_mismatches;
        epoch = agent_expect2(&a, dst, 10, ldst, 3, map, 0, KVX_F_CRC, 10000, NULL, 0, &est);
        REQUIRE(est == BT_OK && epoch != 0);
        args.epoch = epoch;
        args.flags = KVX_F_CRC;
        REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
        push->test_flip_layer = k ? 2 : 1;
        CHECK(kvx_push_all(push) == BT_OK);
        CHECK_MSG(kvx_push_wait(push) == BT_ERR_FORMAT, "layer %d: %s", k ? 2 : 1, kvx_push_error(push));
        kvx_push_destroy(push);
        CHECK(agent_expect_wait(&a, epoch, NULL) == BT_ERR_FORMAT);
        CHECK(agent_stats(&a).crc_mismatches == mismatches + 1);
    }
    args.flags = 0;
    /* a second list without any block is refused before anything is planned */
    args.n_local_blocks = 0;
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID);
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

static void test_refusals(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 33) == 0);
    kvx_layout_t other = DST_L;
    other.fingerprint = 0xbad;
    REQUIRE(agent_init(&a, &other, 44) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 7, a.desc, a.desc_len, &peer) == BT_OK);
    uint32_t blocks[3] = {1, 2, 3};
    kvx_push_args_t args = {.src_blocks = blocks, .dst_blocks = blocks, .n_blocks = 3, .epoch = 1};
    kvx_push_t *push = NULL;
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID && push == NULL);
    CHECK(strstr(bt_last_error(), "layout mismatch") != NULL);
    kvx_peer_release(peer);
    agent_close(&a);

    REQUIRE(agent_init(&a, &DST_L, 55) == 0);
    REQUIRE(kvx_peer_get(s.ctx, 7, a.desc, a.desc_len, &peer) == BT_OK); /* descriptor changed: rebuilt */
    kvx_stats_t before;
    kvx_context_stats(s.ctx, &before);
    CHECK(before.peers_built == 2);
    uint32_t oob_src[2] = {1, SRC_L.n_blocks};
    uint32_t oob_dst[2] = {5, DST_L.n_blocks};
    uint32_t dup_dst[2] = {5, 5};
    uint32_t ok2[2] = {5, 6};
    args = (kvx_push_args_t){.src_blocks = oob_src, .dst_blocks = ok2, .n_blocks = 2, .epoch = 1};
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID);
    args.src_blocks = ok2;
    args.dst_blocks = oob_dst;
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "out of range") != NULL);
    args.dst_blocks = dup_dst;
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID);
    args.dst_blocks = ok2;
    args.n_blocks = 0;
    CHECK(kvx_push_create(s.pool, peer, &args, &push) == BT_ERR_INVALID);
    kvx_stats_t after;
    kvx_context_stats(s.ctx, &after);
    CHECK(after.puts == before.puts && after.live_pushes == 0);
    /* The receiver refuses bad expectations too. */
    int32_t est;
    CHECK(agent_expect(&a, oob_dst, 2, 0, 0, 1000, NULL, 0, &est) == 0 && est == BT_ERR_INVALID);
    CHECK(verify_agent_pool(&a, s.pool, NULL, NULL, 0) == 0); /* no byte moved */
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

/* A descriptor that declares a bigger pool than the receiver registered (a forged one, re-checksummed): on shared
 * memory the peer is refused before any copy could run past the segment; over tcp the receiver drops every data
 * message outside its own pool. Fresh epochs are random, not a counter a third party could guess. */
static void test_forged_descriptor(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 91) == 0);
    REQUIRE(agent_init(&a, &DST_L, 92) == 0);
    uint8_t *forged = malloc(a.desc_len);
    REQUIRE(forged != NULL);
    memcpy(forged, a.desc, a.desc_len);
    uint32_t big = DST_L.n_blocks * 64;
    memcpy(forged + 16, &big, 4); /* n_blocks (little-endian host) */
    uint32_t crc = bt_crc32c(0, forged, a.desc_len - 4);
    memcpy(forged + a.desc_len - 4, &crc, 4);
    kvx_desc_t d;
    REQUIRE(kvx_desc_parse(forged, a.desc_len, &d) == BT_OK && d.layout.n_blocks == big);
    kvx_peer_t *peer = NULL;
    bt_status st = kvx_peer_get(s.ctx, 9, forged, a.desc_len, &peer);
    const char *want = getenv("BATON_TEST_KVX_PATH");
    if (want && strcmp(want, "am") != 0) {
        CHECK_MSG(st == BT_ERR_FORMAT && peer == NULL, "status %d", st);
        CHECK(strstr(bt_last_error(), "declares a pool") != NULL);
    } else if (st == BT_OK) {
        uint32_t src[2] = {1, 2}, dst[2] = {big - 2, big - 1};
        kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = 2, .epoch = 5, .timeout_ms = 5000};
        kvx_push_t *push = NULL;
        REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
        kvx_push_all(push);
        CHECK(kvx_push_wait(push) != BT_OK);
        kvx_push_destroy(push);
        CHECK(agent_stats(&a).dropped_writes > 0);
        kvx_peer_release(peer);
    }
    CHECK(verify_agent_pool(&a, s.pool, NULL, NULL, 0) == 0);
    uint32_t b1[1] = {3}, b2[1] = {4};
    uint64_t e1 = agent_expect(&a, b1, 1, 0, 0, 10000, NULL, 0, NULL);
    uint64_t e2 = agent_expect(&a, b2, 1, 0, 0, 10000, NULL, 0, NULL);
    uint64_t gap = e1 > e2 ? e1 - e2 : e2 - e1;
    CHECK_MSG(e1 && e2 && gap > (1ull << 32), "epochs %llu and %llu look sequential", (unsigned long long)e1,
              (unsigned long long)e2);
    free(forged);
    agent_close(&a);
    sender_free(&s);
}

static void test_stale_epoch(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 66) == 0);
    REQUIRE(agent_init(&a, &DST_L, 77) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 3, a.desc, a.desc_len, &peer) == BT_OK);
    uint32_t src[4] = {10, 11, 12, 13}, dst[4] = {40, 41, 42, 43};
    uint64_t e1 = agent_expect(&a, dst, 4, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e1 != 0);
    /* The receiver gives up on e1 (say its prefill node looked dead) and re-issues the blocks as e2. */
    uint64_t dropped = 0;
    int32_t dst_st = 0;
    {
        size_t len;
        uint8_t *r = agent_call(&a, OP_EXPECT_DROP, &e1, 8, &len);
        if (r && len == 12) memcpy(&dst_st, r, 4), memcpy(&dropped, r + 4, 8);
        free(r);
    }
    CHECK(dst_st == 0 && dropped == 0);
    uint64_t e2 = agent_expect(&a, dst, 4, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e2 != 0 && e2 != e1);
    kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = 4, .epoch = e1, .timeout_ms = 10000};
    kvx_push_t *push = NULL;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    /* one-sided paths fail at the claim, before writing; the AM path posts and the receiver drops the data */
    int one_sided = kvx_peer_data_path(peer) != KVX_PATH_AM;
    CHECK(kvx_push_all(push) == (one_sided ? BT_ERR_STALE : BT_OK));
    CHECK_MSG(kvx_push_wait(push) == BT_ERR_STALE, "%s", kvx_push_error(push));
    kvx_push_destroy(push);
    kvx_stats_t as = agent_stats(&a);
    CHECK(as.stale_completions == 1 && as.expects_ok == 0);
    CHECK(verify_agent_pool(&a, s.pool, NULL, NULL, 0) == 0); /* no byte of the stale push landed, on any path */
    /* e2 is untouched by the stale completion and completes with its own push. */
    args.epoch = e2;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_all(push) == BT_OK);
    CHECK(kvx_push_wait(push) == BT_OK);
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(&a, e2, NULL) == BT_OK);
    CHECK(kvx_peer_status(peer) == BT_OK);
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

/* A sender that writes other blocks than the receiver handed out: the expectation fails, and on the AM data path
 * the foreign blocks are never written. */
static void test_wrong_blocks(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 17) == 0);
    REQUIRE(agent_init(&a, &DST_L, 18) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 3, a.desc, a.desc_len, &peer) == BT_OK);
    uint32_t src[3] = {1, 2, 3}, mine[3] = {20, 21, 22}, other[3] = {60, 61, 62};
    uint64_t e = agent_expect(&a, mine, 3, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    kvx_push_args_t args = {.src_blocks = src, .dst_blocks = other, .n_blocks = 3, .epoch = e, .timeout_ms = 10000};
    kvx_push_t *push = NULL;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    int one_sided = kvx_peer_data_path(peer) != KVX_PATH_AM;
    CHECK(kvx_push_all(push) == (one_sided ? BT_ERR_FORMAT : BT_OK));
    CHECK_MSG(kvx_push_wait(push) == BT_ERR_FORMAT, "%s", kvx_push_error(push));
    kvx_push_destroy(push);
    uint64_t pending = 1;
    CHECK(agent_expect_wait(&a, e, &pending) == BT_ERR_FORMAT && pending == 0);
    CHECK(verify_agent_pool(&a, s.pool, NULL, NULL, 0) == 0); /* nothing landed, on any path */
    if (!one_sided) CHECK(agent_stats(&a).dropped_writes == 4); /* one run per layer */
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

/* A push whose caller stalls misses its deadline: BT_ERR_TIMEOUT, the endpoint closes, the peer is rebuilt on
 * the next get. A push destroyed mid-way drops its callback and leaves nothing behind. */
static void test_deadline_and_cancel(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 19) == 0);
    REQUIRE(agent_init(&a, &DST_L, 20) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 8, a.desc, a.desc_len, &peer) == BT_OK);
    check_path(peer);
    uint32_t blocks[6] = {1, 2, 3, 4, 5, 6};
    uint64_t e = agent_expect(&a, blocks, 6, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    cb_rec_t rec = {0};
    kvx_push_args_t args = {.src_blocks = blocks, .dst_blocks = blocks, .n_blocks = 6, .epoch = e,
                            .timeout_ms = 300, .cb = push_cb, .cb_arg = &rec};
    kvx_push_t *push = NULL;
    double t0 = now_s();
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_layer(push, 0) == BT_OK); /* then the "prefill" stalls */
    CHECK(kvx_push_wait(push) == BT_ERR_TIMEOUT);
    double dt = now_s() - t0;
    CHECK_MSG(dt >= 0.29 && dt < 2.0, "deadline fired after %.3f s", dt);
    CHECK(rec.calls == 1 && rec.st == BT_ERR_TIMEOUT);
    CHECK(kvx_push_layer(push, 1) == BT_ERR_TIMEOUT); /* the caller learns to stop */
    kvx_push_destroy(push);
    CHECK(kvx_peer_status(peer) == BT_ERR_PEER);
    kvx_peer_release(peer);
    free(agent_call(&a, OP_EXPECT_DROP, &e, 8, NULL)); /* the receiver gives up on it too */

    REQUIRE(kvx_peer_get(s.ctx, 8, a.desc, a.desc_len, &peer) == BT_OK); /* rebuilt */
    CHECK(kvx_peer_status(peer) == BT_OK);
    e = agent_expect(&a, blocks, 6, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    rec = (cb_rec_t){0};
    args.epoch = e;
    args.timeout_ms = 10000;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_layer(push, 0) == BT_OK);
    CHECK(kvx_push_layer(push, 1) == BT_OK);
    kvx_push_destroy(push); /* cancelled: no callback, no completion message */
    usleep(100000);
    CHECK(rec.calls == 0);
    kvx_stats_t st;
    kvx_context_stats(s.ctx, &st);
    CHECK(st.live_pushes == 0 || st.live_requests > 0);
    /* The receiver's expectation for the cancelled push stays pending until it gives up on it. */
    {
        size_t len;
        uint64_t pending = 1;
        int32_t dst = -1;
        uint8_t *r = agent_call(&a, OP_EXPECT_DROP, &e, 8, &len);
        if (r && len == 12) memcpy(&dst, r, 4), memcpy(&pending, r + 4, 8);
        free(r);
        CHECK(dst == 0 && pending == 0);
    }
    CHECK(kvx_peer_status(peer) == BT_OK);
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s); /* the pool goes only once nothing references it */
}

/* A receiver that cancelled the call asking for its blocks settles the expectation (decode-node's cancelled remote
 * prefill): unclaimed, it ends at once and nothing lands afterwards; claimed by a one-sided sender that stalls, it
 * stays pending and settle gives up at its bound; once the sender completed, settle returns at once. */
static void test_settle(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 23) == 0);
    REQUIRE(agent_init(&a, &DST_L, 24) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 9, a.desc, a.desc_len, &peer) == BT_OK);
    int one_sided = kvx_peer_data_path(peer) != KVX_PATH_AM;
    uint32_t src[3] = {5, 6, 7}, dst[3] = {30, 31, 32};
    kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = 3, .timeout_ms = 10000};
    kvx_push_t *push = NULL;

    /* unclaimed: settled at once; the sender's push then writes nothing (claim refused, or its data dropped) */
    uint64_t e = agent_expect(&a, dst, 3, 0, 0, 10000, NULL, 0, NULL), pending = 1;
    REQUIRE(e != 0);
    double t0 = now_s();
    CHECK(agent_expect_settle(&a, e, 5000, &pending) == BT_OK && pending == 0);
    CHECK_MSG(now_s() - t0 < 1.0, "settle took %.3f s", now_s() - t0);
    args.epoch = e;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    kvx_push_all(push);
    CHECK_MSG(kvx_push_wait(push) == BT_ERR_STALE, "%s", kvx_push_error(push));
    kvx_push_destroy(push);
    CHECK(verify_agent_pool(&a, s.pool, NULL, NULL, 0) == 0);
    free(agent_call(&a, OP_EXPECT_DROP, &e, 8, NULL));

    /* claimed (one-sided paths) and stalled after its first layer: still pending at the bound */
    e = agent_expect(&a, dst, 3, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    args.epoch = e;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_layer(push, 0) == BT_OK);
    t0 = now_s();
    int32_t st = agent_expect_settle(&a, e, 300, &pending);
    double dt = now_s() - t0;
    if (one_sided) {
        CHECK_MSG(st == BT_ERR_TIMEOUT && pending == 3, "status %d, %llu blocks pending", st,
                  (unsigned long long)pending);
        CHECK_MSG(dt >= 0.29 && dt < 2.0, "bound hit after %.3f s", dt);
    } else {
        CHECK(st == BT_OK && pending == 0); /* AM data is checked on arrival: no claim to wait for */
    }
    /* the sender completes: settle sees the end at once */
    kvx_push_all(push);
    CHECK(kvx_push_wait(push) == (one_sided ? BT_OK : BT_ERR_STALE));
    kvx_push_destroy(push);
    t0 = now_s();
    CHECK(agent_expect_settle(&a, e, 5000, &pending) == BT_OK && pending == 0);
    CHECK_MSG(now_s() - t0 < 1.0, "settle took %.3f s", now_s() - t0);
    free(agent_call(&a, OP_EXPECT_DROP, &e, 8, NULL));
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

static void test_crc_corruption(void)
{
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 88) == 0);
    REQUIRE(agent_init(&a, &DST_L, 99) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 3, a.desc, a.desc_len, &peer) == BT_OK);
    uint32_t src[5] = {1, 2, 3, 30, 31}, dst[5] = {50, 51, 52, 7, 9};
    uint64_t e = agent_expect(&a, dst, 5, 0, KVX_F_CRC, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    kvx_push_args_t args = {
        .src_blocks = src, .dst_blocks = dst, .n_blocks = 5, .epoch = e, .flags = KVX_F_CRC, .timeout_ms = 10000};
    kvx_push_t *push = NULL;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    push->test_flip_layer = 2;
    CHECK(kvx_push_all(push) == BT_OK);
    CHECK_MSG(kvx_push_wait(push) == BT_ERR_FORMAT, "%s", kvx_push_error(push));
    kvx_push_destroy(push);
    uint64_t pending = 1;
    CHECK(agent_expect_wait(&a, e, &pending) == BT_ERR_FORMAT);
    CHECK(pending == 0);
    CHECK(agent_stats(&a).crc_mismatches == 1);

    /* A receiver that requires checksums refuses a push without them. */
    e = agent_expect(&a, dst, 5, 0, KVX_F_CRC, 10000, NULL, 0, NULL);
    args.epoch = e;
    args.flags = 0;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_all(push) == BT_OK);
    CHECK(kvx_push_wait(push) == BT_ERR_FORMAT);
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(&a, e, NULL) == BT_ERR_FORMAT);

    /* And a clean push with checksums passes. */
    e = agent_expect(&a, dst, 5, 0, KVX_F_CRC, 10000, NULL, 0, NULL);
    args.epoch = e;
    args.flags = KVX_F_CRC;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_all(push) == BT_OK);
    CHECK(kvx_push_wait(push) == BT_OK);
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(&a, e, NULL) == BT_OK);
    CHECK(verify_agent_pool(&a, s.pool, src, dst, 5) == 0);
    kvx_peer_release(peer);
    agent_close(&a);
    sender_free(&s);
}

static void test_receiver_killed(void)
{
    const kvx_layout_t big = {.n_layers = 16, .n_blocks = 64, .block_stride = 12288, .fingerprint = 9};
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &big, 5) == 0);
    REQUIRE(agent_init(&a, &big, 6) == 0);
    kvx_peer_t *peer = NULL;
    REQUIRE(kvx_peer_get(s.ctx, 42, a.desc, a.desc_len, &peer) == BT_OK);
    check_path(peer);
    uint32_t blocks[48];
    for (uint32_t i = 0; i < 48; i++) blocks[i] = i;
    uint64_t e = agent_expect(&a, blocks, 48, 0, 0, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    cb_rec_t rec = {0};
    kvx_push_args_t args = {.src_blocks = blocks, .dst_blocks = blocks, .n_blocks = 48, .epoch = e,
                            .timeout_ms = 2000, .cb = push_cb, .cb_arg = &rec};
    kvx_push_t *push = NULL;
    double t0 = now_s();
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    for (uint32_t l = 0; l < 8; l++) CHECK(kvx_push_layer(push, l) == BT_OK);
    agent_kill(&a);
    double t_kill = now_s();
    for (uint32_t l = 8; l < 16; l++)
        if (kvx_push_layer(push, l) != BT_OK) break; /* may already report the failure */
    bt_status st = kvx_push_wait(push);
    double t_end = now_s();
    CHECK_MSG(st == BT_ERR_PEER || st == BT_ERR_TIMEOUT, "status %s", bt_status_str(st));
    /* Within the 2 s deadline; 1 s of slack for a loaded 2-core machine. */
    CHECK_MSG(t_end - t0 < 3.0, "push ended %.3f s after start", t_end - t0);
    fprintf(stderr, "  receiver killed: push ended with '%s' %.0f ms after the kill (%s)\n", bt_status_str(st),
            (t_end - t_kill) * 1e3, kvx_push_error(push));
    kvx_push_destroy(push);
    CHECK(rec.calls == 1 && rec.st == st);
    CHECK(kvx_peer_status(peer) == BT_ERR_PEER);
    kvx_peer_release(peer);
    close(a.fd);
    free(a.desc);

    /* The sender carries on with a new receiver under the same node id (the peer is rebuilt). */
    REQUIRE(agent_init(&a, &big, 7) == 0);
    REQUIRE(kvx_peer_get(s.ctx, 42, a.desc, a.desc_len, &peer) == BT_OK);
    CHECK(kvx_peer_status(peer) == BT_OK);
    e = agent_expect(&a, blocks, 48, 0, KVX_F_CRC, 10000, NULL, 0, NULL);
    REQUIRE(e != 0);
    args.epoch = e;
    args.flags = KVX_F_CRC;
    args.timeout_ms = 10000;
    REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
    CHECK(kvx_push_all(push) == BT_OK);
    CHECK_MSG(kvx_push_wait(push) == BT_OK, "%s", kvx_push_error(push));
    kvx_push_destroy(push);
    CHECK(agent_expect_wait(&a, e, NULL) == BT_OK);
    CHECK(verify_agent_pool(&a, s.pool, blocks, blocks, 48) == 0);
    kvx_peer_release(peer);
    agent_close(&a);
    kvx_stats_t ss;
    kvx_context_stats(s.ctx, &ss);
    CHECK(ss.pushes_failed == 1 && ss.pushes_ok == 1);
    sender_free(&s);
}

static void test_sender_killed(void)
{
    const kvx_layout_t big = {.n_layers = 16, .n_blocks = 64, .block_stride = 12288, .fingerprint = 9};
    sender_t r; /* this process receives */
    agent_t a;  /* the agent sends and dies */
    REQUIRE(sender_init(&r, &big, 1) == 0);
    REQUIRE(agent_init(&a, &big, 2) == 0);
    size_t my_len;
    const void *my_desc = kvx_pool_descriptor(r.pool, &my_len);
    buf_t b = {0};
    BUF_VAL(&b, (uint64_t)1);
    buf_add(&b, my_desc, my_len);
    CHECK(agent_status(&a, OP_CONNECT, b.p, b.n) == BT_OK);
    free(b.p);
    kvx_peer_t *sender = NULL;
    REQUIRE(kvx_peer_get(r.ctx, 2, a.desc, a.desc_len, &sender) == BT_OK);

    uint32_t blocks[32];
    for (uint32_t i = 0; i < 32; i++) blocks[i] = 2 * i;
    for (int bound = 1; bound >= 0; bound--) {
        /* bound: the expectation watches the sender's peer; unbound: only the deadline saves it. */
        kvx_expect_args_t ea = {.blocks = blocks, .n_blocks = 32, .timeout_ms = 2000,
                                .sender = bound ? sender : NULL};
        kvx_expect_t *e = NULL;
        REQUIRE(kvx_expect_create(r.pool, &ea, &e) == BT_OK);
        CHECK(kvx_pool_blocks_pending(r.pool) == 32);
        if (bound) {
            buf_t pb = {0};
            BUF_VAL(&pb, kvx_expect_epoch(e));
            BUF_VAL(&pb, (uint32_t)0);
            BUF_VAL(&pb, (uint32_t)10000);
            BUF_VAL(&pb, (uint32_t)32);
            buf_add(&pb, blocks, sizeof blocks);
            buf_add(&pb, blocks, sizeof blocks);
            CHECK(agent_status(&a, OP_PUSH_START, pb.p, pb.n) == BT_OK);
            free(pb.p);
            uint32_t range[2] = {0, 6};
            CHECK(agent_status(&a, OP_PUSH_LAYERS, range, sizeof range) == BT_OK);
        }
        double t_kill = now_s();
        if (bound) agent_kill(&a);
        bt_status st = kvx_expect_wait(e);
        double dt = now_s() - t_kill;
        CHECK_MSG(st == BT_ERR_PEER || st == BT_ERR_TIMEOUT, "status %s", bt_status_str(st));
        CHECK_MSG(dt < 3.0, "expectation ended after %.3f s", dt);
        CHECK(kvx_pool_blocks_pending(r.pool) == 0);
        fprintf(stderr, "  sender %s: expectation ended with '%s' after %.0f ms (%s)\n",
                bound ? "killed, expectation bound to it" : "gone, unbound expectation", bt_status_str(st), dt * 1e3,
                kvx_expect_error(e));
        kvx_expect_destroy(e);
    }
    kvx_peer_release(sender);
    close(a.fd);
    free(a.desc);
    sender_free(&r);
}

static long rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1) break;
    fclose(f);
    return kib;
}

static void test_soak(void)
{
    const char *env = getenv("BATON_KVX_SOAK");
    int count = env && atoi(env) > 0 ? atoi(env) : 300;
    sender_t s;
    agent_t a;
    REQUIRE(sender_init(&s, &SRC_L, 123) == 0);
    REQUIRE(agent_init(&a, &DST_L, 456) == 0);
    uint64_t seed = 99;
    long rss_warm = 0;
    kvx_stats_t warm = {0};
    double t0 = now_s();
    for (int i = 0; i < count; i++) {
        kvx_peer_t *peer = NULL;
        REQUIRE(kvx_peer_get(s.ctx, 5, a.desc, a.desc_len, &peer) == BT_OK);
        check_path(peer);
        uint32_t src[16], dst[16];
        size_t n = 1 + test_rand_next(&seed) % 16;
        pick_blocks(&seed, src, n, SRC_L.n_blocks, i % 2);
        pick_blocks(&seed, dst, n, DST_L.n_blocks, i % 2);
        uint32_t flags = i % 4 == 0 ? KVX_F_CRC : 0;
        uint64_t e = agent_expect(&a, dst, n, 0, flags, 10000, NULL, 0, NULL);
        REQUIRE(e != 0);
        kvx_push_args_t args = {.src_blocks = src, .dst_blocks = dst, .n_blocks = n, .epoch = e, .flags = flags,
                                .timeout_ms = 10000};
        kvx_push_t *push = NULL;
        REQUIRE(kvx_push_create(s.pool, peer, &args, &push) == BT_OK);
        REQUIRE(kvx_push_all(push) == BT_OK);
        bt_status st = kvx_push_wait(push);
        CHECK_MSG(st == BT_OK, "transfer %d: %s", i, kvx_push_error(push));
        kvx_push_destroy(push);
        kvx_peer_release(peer);
        CHECK(agent_expect_wait(&a, e, NULL) == BT_OK);
        if (st != BT_OK) break;
        if (i == count / 10) {
            rss_warm = rss_kib();
            kvx_context_stats(s.ctx, &warm);
        }
    }
    double dt = now_s() - t0;
    long rss_end = rss_kib();
    kvx_stats_t end, as = agent_stats(&a);
    kvx_context_stats(s.ctx, &end);
    fprintf(stderr, "  soak: %d transfers in %.2f s (%.0f us each); sender RSS %ld -> %ld KiB; live peers %u eps %u "
            "rkeys %u pushes %u requests %u; receiver live expects %u requests %u\n",
            count, dt, dt * 1e6 / count, rss_warm, rss_end, end.live_peers, end.live_eps, end.live_rkeys,
            end.live_pushes, end.live_requests, as.live_expects, as.live_requests);
    CHECK(end.pushes_ok == (uint64_t)count && as.expects_ok == (uint64_t)count);
    CHECK(end.peers_built == 1);
    CHECK(end.live_pushes == 0 && end.live_requests == 0 && end.live_peers == 1 && end.live_eps == 1);
    CHECK(end.live_rkeys == warm.live_rkeys && end.live_eps == warm.live_eps);
    /* Forgetting the node closes everything it held. */
    CHECK(kvx_peer_forget(s.ctx, 5) == BT_OK);
    CHECK(kvx_peer_forget(s.ctx, 5) == BT_ERR_NOT_FOUND);
    for (int i = 0; i < 200; i++) {
        kvx_context_stats(s.ctx, &end);
        if (end.live_eps == 0) break;
        usleep(10000);
    }
    CHECK(end.live_peers == 0 && end.live_eps == 0 && end.live_rkeys == 0);
    CHECK(as.live_expects == 0 && as.live_requests == 0);
    if (!UNDER_ASAN && rss_warm > 0) CHECK_MSG(rss_end - rss_warm < 4096, "RSS grew %ld KiB", rss_end - rss_warm);
    agent_close(&a);
    sender_free(&s);
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--kvx-agent")) return agent_main(atoi(argv[2]));
    signal(SIGPIPE, SIG_IGN);
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return 2;
    exe[n] = 0;
    self_exe = exe;
    const char *tls = getenv("UCX_TLS");
    fprintf(stderr, "UCX_TLS=%s\n", tls ? tls : "(unset)");
    RUN(test_bitexact);
    RUN(test_two_lists);
    RUN(test_peer_cache_cap);
    RUN(test_pool_register);
    RUN(test_refusals);
    RUN(test_forged_descriptor);
    RUN(test_stale_epoch);
    RUN(test_wrong_blocks);
    RUN(test_deadline_and_cancel);
    RUN(test_settle);
    RUN(test_crc_corruption);
    RUN(test_receiver_killed);
    RUN(test_sender_killed);
    RUN(test_soak);
    return test_summary();
}
