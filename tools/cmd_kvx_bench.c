/* `baton kvx-bench`: KV transfer bandwidth and latency between two processes on this host, per message size
 * and transport, beside `ucx_perftest` for the same transport and size; the hand-off time of a 1,000-token
 * SmolLM2 prompt's KV; optionally a soak run with RSS figures. The tool forks and re-executes itself as the
 * receiving process (`kvx-bench --serve-fd N`, internal). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvtransfer/kvx.h"
#include "tools/commands.h"

enum { B_INIT = 1, B_EXPECT, B_WAIT, B_STATS, B_EXIT };

typedef struct bench_opts {
    int tcp, shm;
    size_t sizes[16];
    int n_sizes;
    double seconds; /* per measurement */
    int depth;      /* bandwidth pushes in flight */
    int perftest;
    int handoff;
    long soak;
    const char *json;
    kvx_data_path_t data_path; /* BATON_KVX_DATA_PATH, read once in cmd_kvx_bench */
} bench_opts_t;

typedef struct size_row {
    size_t size;
    double bw_hot;    /* MiB/s, one source block re-sent into <= 4 MiB of destination: perftest's working set */
    double bw_stream; /* MiB/s, distinct blocks, 32-64 MiB per push: a cold KV hand-off */
    double lat_p50, lat_p99;      /* us */
    double pt_bw, pt_am_bw, pt_lat; /* ucx_perftest ucp_put_bw, ucp_am_bw (MiB/s), ucp_put_lat (us); < 0: n/a */
    size_t puts_per_push;
} size_row_t;

typedef struct tr_result {
    const char *name;
    const char *path;
    size_row_t rows[16];
    double handoff_ms[3]; /* contiguous, fragmented, contiguous + crc32c */
    size_t handoff_bytes;
    long soak_n;
    double soak_s;
    long rss_send[2], rss_recv[2]; /* KiB after 10% and at the end */
    kvx_stats_t soak_send, soak_recv;
    int ok;
} tr_result_t;

/* ---- small helpers ------------------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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

static int io_all(int fd, void *p, size_t n, int wr)
{
    char *c = p;
    while (n) {
        ssize_t k = wr ? write(fd, c, n) : read(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static int ctl_send(int fd, uint32_t type, const void *p, uint32_t n)
{
    uint32_t h[2] = {type, n};
    if (io_all(fd, h, sizeof h, 1)) return -1;
    return n ? io_all(fd, (void *)p, n, 1) : 0;
}

static uint8_t *ctl_recv(int fd, uint32_t *type, uint32_t *n)
{
    uint32_t h[2];
    if (io_all(fd, h, sizeof h, 0)) return NULL;
    uint8_t *p = malloc((size_t)h[1] + 1);
    if (!p) return NULL;
    if (h[1] && io_all(fd, p, h[1], 0)) {
        free(p);
        return NULL;
    }
    *type = h[0];
    *n = h[1];
    return p;
}

static uint8_t *ctl_call(int fd, uint32_t op, const void *p, uint32_t n, uint32_t *rn)
{
    uint32_t type, dummy;
    if (ctl_send(fd, op, p, n)) return NULL;
    return ctl_recv(fd, &type, rn ? rn : &dummy);
}

/* ---- the receiving process ----------------------------------------------------------------------------- */

static int serve(int fd, kvx_data_path_t data_path)
{
    kvx_context_t *ctx = NULL;
    kvx_pool_t *pool = NULL;
    kvx_expect_t *exp[8] = {0};
    kvx_context_opts_t o = {.name = "kvx-bench-recv", .data_path = data_path};
    if (kvx_context_create(&o, &ctx) != BT_OK) {
        fprintf(stderr, "kvx-bench receiver: %s\n", bt_last_error());
        return 1;
    }
    for (;;) {
        uint32_t type, n;
        uint8_t *m = ctl_recv(fd, &type, &n);
        if (!m) break;
        uint8_t out[sizeof(kvx_stats_t) + 16];
        uint32_t out_n = 0;
        const void *reply = out;
        if (type == B_INIT) {
            for (int i = 0; i < 8; i++) kvx_expect_destroy(exp[i]), exp[i] = NULL;
            if (pool) kvx_pool_destroy(pool);
            pool = NULL;
            kvx_layout_t l;
            memcpy(&l, m, sizeof l);
            size_t dl = 0;
            if (kvx_pool_create(ctx, &l, &pool) == BT_OK) {
                reply = kvx_pool_descriptor(pool, &dl);
            } else {
                fprintf(stderr, "kvx-bench receiver: %s\n", bt_last_error());
            }
            out_n = (uint32_t)dl;
        } else if (type == B_EXPECT) {
            uint32_t flags, nb;
            memcpy(&flags, m, 4);
            memcpy(&nb, m + 4, 4);
            int slot = 0;
            while (slot < 8 && exp[slot]) slot++;
            kvx_expect_args_t a = {.blocks = (const uint32_t *)(m + 8), .n_blocks = nb, .flags = flags,
                                   .timeout_ms = 30000};
            uint64_t epoch = 0;
            if (slot < 8 && kvx_expect_create(pool, &a, &exp[slot]) == BT_OK) epoch = kvx_expect_epoch(exp[slot]);
            memcpy(out, &epoch, 8);
            out_n = 8;
        } else if (type == B_WAIT) {
            uint64_t epoch;
            memcpy(&epoch, m, 8);
            int32_t st = BT_ERR_NOT_FOUND;
            for (int i = 0; i < 8; i++) {
                if (exp[i] && kvx_expect_epoch(exp[i]) == epoch) {
                    st = kvx_expect_wait(exp[i]);
                    kvx_expect_destroy(exp[i]);
                    exp[i] = NULL;
                }
            }
            memcpy(out, &st, 4);
            out_n = 4;
        } else if (type == B_STATS) {
            kvx_stats_t s;
            kvx_context_stats(ctx, &s);
            long rss = rss_kib();
            memcpy(out, &s, sizeof s);
            memcpy(out + sizeof s, &rss, sizeof rss);
            out_n = (uint32_t)(sizeof s + sizeof rss);
        } else {
            free(m);
            break;
        }
        free(m);
        if (ctl_send(fd, 0, reply, out_n)) break;
    }
    for (int i = 0; i < 8; i++) kvx_expect_destroy(exp[i]);
    kvx_pool_destroy(pool);
    kvx_context_destroy(ctx);
    ctl_send(fd, 0, NULL, 0);
    return 0;
}

/* ---- the sending side ---------------------------------------------------------------------------------- */

typedef struct bench {
    int fd;
    pid_t pid;
    kvx_context_t *ctx;
    kvx_pool_t *pool;
    kvx_peer_t *peer;
    uint64_t node;
    int pipelined_pushes;
} bench_t;

static int bench_spawn(bench_t *b)
{
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return -1;
    exe[n] = 0;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        char arg[16];
        snprintf(arg, sizeof arg, "%d", dup(sv[1]));
        execl(exe, "baton", "kvx-bench", "--serve-fd", arg, (char *)NULL);
        _exit(127);
    }
    close(sv[1]);
    b->fd = sv[0];
    b->pid = pid;
    return 0;
}

/* (Re)creates both pools with this layout and connects to the receiver's. */
static int bench_layout(bench_t *b, const kvx_layout_t *l)
{
    kvx_peer_release(b->peer);
    b->peer = NULL;
    if (b->node) kvx_peer_forget(b->ctx, b->node); /* unmaps the receiver's previous pool */
    if (b->pool && kvx_pool_destroy(b->pool) != BT_OK) return -1;
    b->pool = NULL;
    if (kvx_pool_create(b->ctx, l, &b->pool) != BT_OK) return -1;
    uint64_t bytes;
    kvx_layout_check(l, &bytes);
    uint8_t *p = kvx_pool_base(b->pool);
    for (uint64_t i = 0; i < bytes; i += 4096) p[i] = (uint8_t)(i >> 12); /* touch every page */
    uint32_t n;
    uint8_t *desc = ctl_call(b->fd, B_INIT, l, sizeof *l, &n);
    if (!desc || n == 0) {
        free(desc);
        return -1;
    }
    bt_status st = kvx_peer_get(b->ctx, ++b->node, desc, n, &b->peer);
    free(desc);
    return st == BT_OK ? 0 : -1;
}

static uint64_t bench_expect(bench_t *b, const uint32_t *blocks, uint32_t n, uint32_t flags)
{
    uint8_t *req = malloc(8 + 4 * (size_t)n);
    memcpy(req, &flags, 4);
    memcpy(req + 4, &n, 4);
    memcpy(req + 8, blocks, 4 * (size_t)n);
    uint32_t rn;
    uint8_t *r = ctl_call(b->fd, B_EXPECT, req, 8 + 4 * n, &rn);
    free(req);
    uint64_t epoch = 0;
    if (r && rn == 8) memcpy(&epoch, r, 8);
    free(r);
    return epoch;
}

static int32_t bench_wait(bench_t *b, uint64_t epoch)
{
    uint32_t rn;
    uint8_t *r = ctl_call(b->fd, B_WAIT, &epoch, 8, &rn);
    int32_t st = BT_ERR_PEER;
    if (r && rn == 4) memcpy(&st, r, 4);
    free(r);
    return st;
}

/* One timed push of src->dst (all layers); returns seconds or < 0 on failure. */
static double bench_push(bench_t *b, const uint32_t *src, const uint32_t *dst, uint32_t n, uint32_t flags,
                         size_t *puts)
{
    uint64_t epoch = bench_expect(b, dst, n, flags);
    if (!epoch) return -1;
    kvx_push_args_t a = {.src_blocks = src, .dst_blocks = dst, .n_blocks = n, .epoch = epoch, .flags = flags,
                         .timeout_ms = 30000};
    kvx_push_t *push = NULL;
    double t0 = now_s();
    if (kvx_push_create(b->pool, b->peer, &a, &push) != BT_OK) return -1;
    bt_status st = kvx_push_all(push);
    if (st == BT_OK) st = kvx_push_wait(push);
    double dt = now_s() - t0;
    if (puts) *puts = kvx_push_puts(push);
    if (st != BT_OK) fprintf(stderr, "kvx-bench: push failed: %s\n", kvx_push_error(push));
    kvx_push_destroy(push);
    if (bench_wait(b, epoch) != BT_OK || st != BT_OK) return -1;
    return dt;
}

/* Keeps `depth` pushes in flight (each with its own expectation, made while the others run) for `seconds`;
 * returns the wall time and sets b->pipelined_pushes, or returns < 0 on failure. Only setup-free time counts:
 * the expectation round trips overlap the transfers, as they do when a decode node admits many requests. */
static double bench_pipelined(bench_t *b, const uint32_t *src, const uint32_t *dst, uint32_t n, int depth,
                              double seconds, size_t *puts)
{
    kvx_push_t *fly[8];
    uint64_t epochs[8];
    int head = 0, count = 0, started = 0, done = 0;
    double t0 = now_s();
    for (;;) {
        while (count < depth && (now_s() - t0 < seconds || started < 3)) {
            int slot = (head + count) % depth;
            epochs[slot] = bench_expect(b, dst, n, 0);
            kvx_push_args_t a = {.src_blocks = src, .dst_blocks = dst, .n_blocks = n, .epoch = epochs[slot],
                                 .timeout_ms = 30000};
            if (!epochs[slot] || kvx_push_create(b->pool, b->peer, &a, &fly[slot]) != BT_OK) return -1;
            if (kvx_push_all(fly[slot]) != BT_OK) return -1;
            count++;
            started++;
        }
        if (count == 0) break;
        bt_status st = kvx_push_wait(fly[head]);
        if (puts) *puts = kvx_push_puts(fly[head]);
        if (st != BT_OK) fprintf(stderr, "kvx-bench: push failed: %s\n", kvx_push_error(fly[head]));
        kvx_push_destroy(fly[head]);
        if (bench_wait(b, epochs[head]) != BT_OK || st != BT_OK) return -1;
        head = (head + 1) % depth;
        count--;
        done++;
    }
    b->pipelined_pushes = done;
    return now_s() - t0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Runs `ucx_perftest` server + client for one test and size; returns the CSV field (MiB/s or us) or -1. */
static double perftest(const char *test, size_t size, long iters, int field)
{
    static int port_seq;
    int port = 20000 + (int)(getpid() % 20000) + port_seq++;
    char ps[16], ss[32], ns[32], ws[32];
    snprintf(ps, sizeof ps, "%d", port);
    snprintf(ss, sizeof ss, "%zu", size);
    snprintf(ns, sizeof ns, "%ld", iters);
    snprintf(ws, sizeof ws, "%ld", iters / 10 + 1);
    pid_t srv = fork();
    if (srv < 0) return -1;
    if (srv == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execlp("ucx_perftest", "ucx_perftest", "-p", ps, (char *)NULL);
        _exit(127);
    }
    double result = -1;
    for (int attempt = 0; attempt < 5 && result < 0; attempt++) {
        usleep(200000);
        int pfd[2];
        if (pipe(pfd)) break;
        pid_t cli = fork();
        if (cli == 0) {
            dup2(pfd[1], 1);
            int devnull = open("/dev/null", O_WRONLY);
            dup2(devnull, 2);
            close(pfd[0]);
            execlp("ucx_perftest", "ucx_perftest", "127.0.0.1", "-p", ps, "-t", test, "-s", ss, "-n", ns, "-w", ws,
                   "-f", "-v", (char *)NULL);
            _exit(127);
        }
        close(pfd[1]);
        char buf[4096];
        size_t len = 0;
        ssize_t k;
        while (len < sizeof buf - 1 && (k = read(pfd[0], buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)k;
        buf[len] = 0;
        close(pfd[0]);
        int status;
        waitpid(cli, &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) continue;
        /* Last line: iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr */
        char *line = NULL;
        for (char *s = strtok(buf, "\n"); s; s = strtok(NULL, "\n"))
            if (s[0] == ' ' || (s[0] >= '0' && s[0] <= '9')) line = s;
        if (!line) continue;
        double v[8];
        if (sscanf(line, "%lf,%lf,%lf,%lf,%lf,%lf,%lf,%lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]) == 8)
            result = v[field];
    }
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    return result;
}

static int run_transport(const bench_opts_t *o, int shm, tr_result_t *res)
{
    memset(res, 0, sizeof *res);
    res->name = shm ? "shm" : "tcp";
    if (shm) {
        setenv("UCX_TLS", "sm", 1);
        setenv("UCX_POSIX_ERROR_HANDLING", "y", 1);
        setenv("UCX_SYSV_ERROR_HANDLING", "y", 1);
    } else {
        setenv("UCX_TLS", "tcp", 1);
        unsetenv("UCX_POSIX_ERROR_HANDLING");
        unsetenv("UCX_SYSV_ERROR_HANDLING");
    }
    bench_t b = {0};
    kvx_context_opts_t co = {.name = "kvx-bench", .data_path = o->data_path};
    if (kvx_context_create(&co, &b.ctx) != BT_OK) {
        fprintf(stderr, "kvx-bench: %s: %s\n", res->name, bt_last_error());
        return -1;
    }
    if (bench_spawn(&b)) {
        kvx_context_destroy(b.ctx);
        return -1;
    }
    int rc = -1;
    /* Bytes moved per bandwidth push: large enough to hide the ack round trip, small enough for 2 pools. */
    const uint64_t push_bytes = shm ? (64ull << 20) : (32ull << 20);
    for (int si = 0; si < o->n_sizes; si++) {
        size_t size = o->sizes[si];
        size_row_t *row = &res->rows[si];
        row->size = size;
        row->pt_bw = row->pt_am_bw = row->pt_lat = -1;
        uint32_t nb = (uint32_t)(push_bytes / size);
        if (nb < 4) nb = 4;
        kvx_layout_t l = {.n_layers = 1, .n_blocks = nb, .block_stride = size, .fingerprint = 0xbe4c};
        if (bench_layout(&b, &l)) {
            fprintf(stderr, "kvx-bench: %s: cannot set up %zu-byte pools: %s\n", res->name, size, bt_last_error());
            goto out;
        }
        res->path = kvx_data_path_name(kvx_peer_data_path(b.peer));
        /* Reversed destination order: no two blocks coalesce, so every put is exactly `size` bytes. */
        uint32_t *src = malloc(nb * sizeof *src), *dst = malloc(nb * sizeof *dst), *src0 = calloc(nb, sizeof *src0);
        for (uint32_t i = 0; i < nb; i++) src[i] = i, dst[i] = nb - 1 - i;
        uint32_t nb_hot = (uint32_t)((4u << 20) / size);
        if (nb_hot < 1) nb_hot = 1;
        if (nb_hot > nb) nb_hot = nb;
        bench_push(&b, src, dst, nb, 0, NULL); /* warm-up: connection, page faults */
        for (int mode = 0; mode < 2; mode++) {
            uint32_t k = mode == 0 ? nb_hot : nb;
            const uint32_t *s_blocks = mode == 0 ? src0 : src;
            double total = 0, bytes = 0;
            if (o->depth <= 1) {
                int pushes = 0;
                while (total < o->seconds || pushes < 3) {
                    double dt = bench_push(&b, s_blocks, dst, k, 0, &row->puts_per_push);
                    if (dt < 0) break;
                    total += dt;
                    bytes += (double)k * size;
                    pushes++;
                }
            } else {
                total = bench_pipelined(&b, s_blocks, dst, k, o->depth, o->seconds, &row->puts_per_push);
                bytes = total > 0 ? (double)k * size * b.pipelined_pushes : 0;
            }
            double bw = total > 0 ? bytes / total / (1 << 20) : 0;
            if (mode == 0)
                row->bw_hot = bw;
            else
                row->bw_stream = bw;
        }
        free(src0);
        /* Latency: one block, push to acknowledged completion (a full round trip). */
        double lat[201];
        int nl = 0;
        double t_end = now_s() + o->seconds;
        while (nl < 201 && (now_s() < t_end || nl < 11)) {
            double dt = bench_push(&b, &src[0], &dst[0], 1, 0, NULL);
            if (dt < 0) break;
            lat[nl++] = dt * 1e6;
        }
        qsort(lat, (size_t)nl, sizeof lat[0], cmp_double);
        row->lat_p50 = nl ? lat[nl / 2] : 0;
        row->lat_p99 = nl ? lat[(nl * 99) / 100] : 0;
        free(src);
        free(dst);
        if (o->perftest) {
            long iters = (long)((shm ? (512ull << 20) : (64ull << 20)) / size);
            if (iters < 50) iters = 50;
            if (iters > 50000) iters = 50000;
            row->pt_bw = perftest("ucp_put_bw", size, iters, 5);
            row->pt_am_bw = perftest("ucp_am_bw", size, iters, 5);
            row->pt_lat = perftest("ucp_put_lat", size, iters / 4 + 20, 1);
        }
        fprintf(stderr, "  %s %8zu B: hot %9.1f stream %9.1f MiB/s, p50 %8.1f us; perftest put %9.1f am %9.1f MiB/s\n",
                res->name, size, row->bw_hot, row->bw_stream, row->lat_p50, row->pt_bw, row->pt_am_bw);
    }

    if (o->handoff) {
        /* SmolLM2-135M f16 KV: 30 layers, block stride 12,288 B; 1,000 tokens = 63 blocks of 16. */
        kvx_layout_t l = {.n_layers = 30, .n_blocks = 256, .block_stride = 12288, .fingerprint = 0x5e012};
        if (bench_layout(&b, &l)) goto out;
        uint32_t src[63], dst[63], frag[63];
        for (uint32_t i = 0; i < 63; i++) src[i] = i, dst[i] = 100 + i, frag[i] = 2 * i + 1;
        res->handoff_bytes = 63ull * 12288 * 30;
        for (int k = 0; k < 3; k++) {
            double best = 1e9;
            for (int rep = 0; rep < 5; rep++) {
                double dt = bench_push(&b, src, k == 1 ? frag : dst, 63, k == 2 ? KVX_F_CRC : 0, NULL);
                if (dt >= 0 && dt < best) best = dt;
            }
            res->handoff_ms[k] = best * 1e3;
        }
    }

    if (o->soak > 0) {
        kvx_layout_t l = {.n_layers = 4, .n_blocks = 256, .block_stride = 3072, .fingerprint = 0x50a4};
        if (bench_layout(&b, &l)) goto out;
        uint64_t seed = 12345;
        double t0 = now_s();
        for (long i = 0; i < o->soak; i++) {
            uint32_t src[16], dst[16];
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            uint32_t n = 1 + (uint32_t)(seed >> 60);
            uint32_t start = (uint32_t)((seed >> 20) % (256 - 32));
            for (uint32_t k = 0; k < n; k++) src[k] = start + k, dst[k] = (i & 1) ? start + k : start + 2 * k;
            if (bench_push(&b, src, dst, n, i % 4 == 0 ? KVX_F_CRC : 0, NULL) < 0) {
                fprintf(stderr, "kvx-bench: soak transfer %ld failed\n", i);
                goto out;
            }
            if (i == o->soak / 10 || i == o->soak - 1) {
                int at = i == o->soak - 1;
                res->rss_send[at] = rss_kib();
                uint32_t rn;
                uint8_t *r = ctl_call(b.fd, B_STATS, NULL, 0, &rn);
                if (r && rn == sizeof(kvx_stats_t) + sizeof(long)) {
                    memcpy(&res->soak_recv, r, sizeof(kvx_stats_t));
                    memcpy(&res->rss_recv[at], r + sizeof(kvx_stats_t), sizeof(long));
                }
                free(r);
            }
        }
        res->soak_s = now_s() - t0;
        res->soak_n = o->soak;
        kvx_context_stats(b.ctx, &res->soak_send);
    }
    rc = 0;
    res->ok = 1;
out:
    kvx_peer_release(b.peer);
    kvx_pool_destroy(b.pool);
    kvx_context_destroy(b.ctx); /* before the receiver exits: no peer-death warnings */
    free(ctl_call(b.fd, B_EXIT, NULL, 0, NULL));
    waitpid(b.pid, NULL, 0);
    close(b.fd);
    return rc;
}

static void print_table(const bench_opts_t *o, const tr_result_t *r)
{
    printf("\n%s (UCX_TLS=%s, kvx data path: %s, %d bandwidth pushes in flight)\n", r->name,
           r->name[0] == 's' ? "sm" : "tcp", r->path ? r->path : "?", o->depth);
    printf("%9s %10s %10s %9s %9s %11s %11s %9s %8s %8s\n", "size", "hot MiB/s", "strm MiB/s", "p50 us", "p99 us",
           "pt put MB/s", "pt am MB/s", "pt lat us", "hot/put", "hot/am");
    for (int i = 0; i < o->n_sizes; i++) {
        const size_row_t *w = &r->rows[i];
        char r1[16] = "-", r2[16] = "-";
        if (w->pt_bw > 0) snprintf(r1, sizeof r1, "%.0f%%", 100 * w->bw_hot / w->pt_bw);
        if (w->pt_am_bw > 0) snprintf(r2, sizeof r2, "%.0f%%", 100 * w->bw_hot / w->pt_am_bw);
        printf("%9zu %10.1f %10.1f %9.1f %9.1f %11.1f %11.1f %9.1f %8s %8s\n", w->size, w->bw_hot, w->bw_stream,
               w->lat_p50, w->lat_p99, w->pt_bw, w->pt_am_bw, w->pt_lat, r1, r2);
    }
    if (o->handoff)
        printf("hand-off of a 1,000-token SmolLM2 prompt (%.1f MiB, 30 layers x 63 blocks): %.2f ms contiguous, "
               "%.2f ms fragmented (63 puts/layer), %.2f ms with crc32c\n",
               r->handoff_bytes / 1048576.0, r->handoff_ms[0], r->handoff_ms[1], r->handoff_ms[2]);
    if (r->soak_n)
        printf("soak: %ld transfers in %.1f s; RSS KiB sender %ld -> %ld, receiver %ld -> %ld; live after: "
               "sender peers %u eps %u rkeys %u pushes %u requests %u, receiver expects %u requests %u\n",
               r->soak_n, r->soak_s, r->rss_send[0], r->rss_send[1], r->rss_recv[0], r->rss_recv[1],
               r->soak_send.live_peers, r->soak_send.live_eps, r->soak_send.live_rkeys, r->soak_send.live_pushes,
               r->soak_send.live_requests, r->soak_recv.live_expects, r->soak_recv.live_requests);
    printf("(hot: one source block re-sent into <= 4 MiB of destination blocks, the working set ucx_perftest uses;\n"
           " strm: distinct blocks, 32-64 MiB per push, beyond the caches; each push ends with the receiver's\n"
           " acknowledgement; depth > 1 counts wall time, expectation set-up included; latency: one-block push until the receiver's\n"
           " acknowledgement, a round trip; pt = ucx_perftest ucp_put_bw / ucp_am_bw / ucp_put_lat (one way), MiB/s)\n");
}

static void write_json(FILE *f, const bench_opts_t *o, const tr_result_t *res, int n)
{
    fprintf(f, "{\"depth\":%d,\"seconds\":%.3f,\"transports\":[", o->depth, o->seconds);
    for (int t = 0; t < n; t++) {
        const tr_result_t *r = &res[t];
        fprintf(f, "%s{\"name\":\"%s\",\"data_path\":\"%s\",\"ok\":%s,\"sizes\":[", t ? "," : "", r->name,
                r->path ? r->path : "", r->ok ? "true" : "false");
        for (int i = 0; i < o->n_sizes; i++) {
            const size_row_t *w = &r->rows[i];
            fprintf(f,
                    "%s{\"size\":%zu,\"bw_hot_mib_s\":%.2f,\"bw_stream_mib_s\":%.2f,\"lat_p50_us\":%.2f,"
                    "\"lat_p99_us\":%.2f,\"perftest_put_bw_mib_s\":%.2f,\"perftest_am_bw_mib_s\":%.2f,"
                    "\"perftest_put_lat_us\":%.2f,\"puts_per_stream_push\":%zu}",
                    i ? "," : "", w->size, w->bw_hot, w->bw_stream, w->lat_p50, w->lat_p99, w->pt_bw, w->pt_am_bw,
                    w->pt_lat, w->puts_per_push);
        }
        fprintf(f, "]");
        if (o->handoff)
            fprintf(f,
                    ",\"handoff\":{\"bytes\":%zu,\"contiguous_ms\":%.3f,\"fragmented_ms\":%.3f,\"crc32c_ms\":%.3f}",
                    r->handoff_bytes, r->handoff_ms[0], r->handoff_ms[1], r->handoff_ms[2]);
        if (r->soak_n)
            fprintf(f,
                    ",\"soak\":{\"transfers\":%ld,\"seconds\":%.3f,\"rss_kib_sender\":[%ld,%ld],"
                    "\"rss_kib_receiver\":[%ld,%ld],\"live_eps\":%u,\"live_rkeys\":%u,\"live_requests\":%u,"
                    "\"live_pushes\":%u,\"receiver_live_expects\":%u}",
                    r->soak_n, r->soak_s, r->rss_send[0], r->rss_send[1], r->rss_recv[0], r->rss_recv[1],
                    r->soak_send.live_eps, r->soak_send.live_rkeys, r->soak_send.live_requests,
                    r->soak_send.live_pushes, r->soak_recv.live_expects);
        fprintf(f, "}");
    }
    fprintf(f, "]}\n");
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: baton kvx-bench [--transport tcp|shm|both] [--sizes 12K,64K,...] [--seconds S] [--depth N]\n"
            "                       [--no-perftest] [--no-handoff] [--soak N] [--json FILE]\n"
            "Pushes KV blocks into a second process it starts itself and prints bandwidth and latency per message\n"
            "size, next to ucx_perftest (ucp_put_bw, ucp_am_bw, ucp_put_lat) for the same transport and size.\n"
            "  --sizes      message sizes (default 12K,64K,256K,1M,4M)\n"
            "  --seconds    time per measurement (default 0.5)\n"
            "  --depth N    bandwidth pushes in flight, 1..4 (default 1: only the push is timed; more: wall time with\n"
            "               expectation set-up overlapped)\n"
            "  --soak N     also run N consecutive small transfers and report RSS and live UCX objects\n");
}

static size_t parse_size(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (*end == 'K' || *end == 'k') v *= 1024;
    else if (*end == 'M' || *end == 'm') v *= 1048576;
    return v > 0 ? (size_t)v : 0;
}

int cmd_kvx_bench(int argc, char **argv)
{
    kvx_context_opts_t env = {.data_path = KVX_PATH_AUTO};
    if (kvx_context_opts_from_env(&env) != BT_OK) {
        fprintf(stderr, "baton kvx-bench: %s\n", bt_last_error());
        return 1;
    }
    if (argc == 3 && !strcmp(argv[1], "--serve-fd")) return serve(atoi(argv[2]), env.data_path);
    bench_opts_t o = {.tcp = 1, .shm = 1, .seconds = 0.5, .depth = 1, .perftest = 1, .handoff = 1,
                      .data_path = env.data_path};
    const char *sizes = "12K,64K,256K,1M,4M";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--transport") && v) {
            o.tcp = !strcmp(v, "tcp") || !strcmp(v, "both");
            o.shm = !strcmp(v, "shm") || !strcmp(v, "sm") || !strcmp(v, "both");
            i++;
        } else if (!strcmp(a, "--sizes") && v) {
            sizes = v;
            i++;
        } else if (!strcmp(a, "--seconds") && v) {
            o.seconds = atof(v);
            i++;
        } else if (!strcmp(a, "--depth") && v) {
            o.depth = atoi(v);
            if (o.depth < 1 || o.depth > 4) {
                fprintf(stderr, "baton kvx-bench: --depth must be 1..4\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--soak") && v) {
            o.soak = atol(v);
            i++;
        } else if (!strcmp(a, "--json") && v) {
            o.json = v;
            i++;
        } else if (!strcmp(a, "--no-perftest")) {
            o.perftest = 0;
        } else if (!strcmp(a, "--no-handoff")) {
            o.handoff = 0;
        } else {
            fprintf(stderr, "baton kvx-bench: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    char list[256];
    snprintf(list, sizeof list, "%s", sizes);
    for (char *tok = strtok(list, ","); tok && o.n_sizes < 16; tok = strtok(NULL, ",")) {
        size_t s = parse_size(tok);
        if (s < 64 || s > (256u << 20)) {
            fprintf(stderr, "baton kvx-bench: bad size '%s'\n", tok);
            return 2;
        }
        o.sizes[o.n_sizes++] = s;
    }
    if (!o.n_sizes || (!o.tcp && !o.shm)) {
        usage(stderr);
        return 2;
    }
    if (o.perftest && system("command -v ucx_perftest >/dev/null 2>&1") != 0) {
        fprintf(stderr, "kvx-bench: ucx_perftest not found (install ucx-utils); reference column left empty\n");
        o.perftest = 0;
    }
    signal(SIGPIPE, SIG_IGN);
    tr_result_t res[2];
    int n = 0, failed = 0;
    if (o.tcp) failed |= run_transport(&o, 0, &res[n++]) != 0;
    if (o.shm) failed |= run_transport(&o, 1, &res[n++]) != 0;
    for (int t = 0; t < n; t++) print_table(&o, &res[t]);
    if (o.json) {
        FILE *f = fopen(o.json, "w");
        if (!f) {
            fprintf(stderr, "baton kvx-bench: cannot write %s\n", o.json);
            return 1;
        }
        write_json(f, &o, res, n);
        fclose(f);
    }
    return failed ? 1 : 0;
}
