#include "etcd_harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int etcd_harness_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = 0;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) && errno == EINTR) {}
}

/* GET /health over a raw socket (keeps the harness free of libcurl): 1 when etcd says healthy. */
static int health_ok(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    struct timeval tv = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        const char req[] = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        if (write(fd, req, sizeof req - 1) == (ssize_t)(sizeof req - 1)) {
            char buf[2048];
            size_t n = 0;
            ssize_t r;
            while (n < sizeof buf - 1 && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += (size_t)r;
            buf[n] = '\0';
            ok = strstr(buf, " 200 ") && strstr(buf, "\"health\":\"true\"");
        }
    }
    close(fd);
    return ok;
}

static void print_log(const etcd_harness_t *h)
{
    char path[320];
    snprintf(path, sizeof path, "%s/etcd.log", h->dir);
    FILE *f = fopen(path, "r");
    if (!f) return;
    fprintf(stderr, "---- %s (tail) ----\n", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, size > 4000 ? size - 4000 : 0, SEEK_SET);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fputs(buf, stderr);
    fclose(f);
}

static bt_status spawn(etcd_harness_t *h)
{
    const char *bin = getenv("BATON_ETCD_BIN");
    if (!bin || !*bin) bin = "etcd";
    char data[320], log[320], client[64], peer[64], cluster[96], metrics[64];
    int tls = strstr(h->extra_args, "--cert-file") != NULL;
    snprintf(data, sizeof data, "%s/data", h->dir);
    snprintf(log, sizeof log, "%s/etcd.log", h->dir);
    snprintf(client, sizeof client, "%s://127.0.0.1:%d", tls ? "https" : "http", h->client_port);
    snprintf(metrics, sizeof metrics, "http://127.0.0.1:%d", h->metrics_port);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", h->peer_port);
    snprintf(cluster, sizeof cluster, "baton-test=%s", peer);
    snprintf(h->endpoint, sizeof h->endpoint, "%s", client);
    char extra[sizeof h->extra_args];
    snprintf(extra, sizeof extra, "%s", h->extra_args);
    char *argv[64];
    int argc = 0;
    argv[argc++] = (char *)bin;
    argv[argc++] = "--name=baton-test";
    char a_data[340], a_lc[96], a_ac[96], a_lp[96], a_ap[96], a_ic[128], a_m[96];
    snprintf(a_m, sizeof a_m, "--listen-metrics-urls=%s", metrics);
    argv[argc++] = a_m;
    snprintf(a_data, sizeof a_data, "--data-dir=%s", data);
    snprintf(a_lc, sizeof a_lc, "--listen-client-urls=%s", client);
    snprintf(a_ac, sizeof a_ac, "--advertise-client-urls=%s", client);
    snprintf(a_lp, sizeof a_lp, "--listen-peer-urls=%s", peer);
    snprintf(a_ap, sizeof a_ap, "--initial-advertise-peer-urls=%s", peer);
    snprintf(a_ic, sizeof a_ic, "--initial-cluster=%s", cluster);
    argv[argc++] = a_data;
    argv[argc++] = a_lc;
    argv[argc++] = a_ac;
    argv[argc++] = a_lp;
    argv[argc++] = a_ap;
    argv[argc++] = a_ic;
    argv[argc++] = "--initial-cluster-state=new";
    argv[argc++] = "--log-level=warn";
    char *save = NULL;
    for (char *t = strtok_r(extra, " ", &save); t && argc < 62; t = strtok_r(NULL, " ", &save)) argv[argc++] = t;
    argv[argc] = NULL;

    pid_t pid = fork();
    if (pid < 0) return bt_fail(BT_ERR_UNAVAILABLE, "etcd harness: fork: %s", strerror(errno));
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        int null = open("/dev/null", O_RDONLY);
        if (null >= 0) dup2(null, 0);
        setpgid(0, 0); /* a Ctrl-C of the test does not reach etcd twice; we stop it ourselves */
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a crashed test leaves no etcd behind */
        execvp(bin, argv);
        fprintf(stderr, "exec %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    h->pid = pid;
    for (int i = 0; i < 200; i++) { /* 20 s: a cold start on a busy 2-core machine takes ~1 s */
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            h->pid = 0;
            return bt_fail(BT_ERR_UNAVAILABLE, "etcd harness: etcd exited during start-up (status %d)", status);
        }
        if (health_ok(h->metrics_port)) return BT_OK;
        sleep_ms(100);
    }
    etcd_harness_kill(h);
    return bt_fail(BT_ERR_UNAVAILABLE, "etcd harness: etcd not healthy after 20 s");
}

bt_status etcd_harness_start(etcd_harness_t *h, const char *extra_args)
{
    memset(h, 0, sizeof *h);
    if (extra_args) snprintf(h->extra_args, sizeof h->extra_args, "%s", extra_args);
    const char *base = getenv("TMPDIR");
    snprintf(h->dir, sizeof h->dir, "%s/baton-etcd-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(h->dir)) return bt_fail(BT_ERR_IO, "etcd harness: mkdtemp: %s", strerror(errno));
    bt_status st = BT_ERR_UNAVAILABLE;
    for (int attempt = 0; attempt < 3; attempt++) {
        h->client_port = etcd_harness_free_port();
        h->peer_port = etcd_harness_free_port();
        h->metrics_port = etcd_harness_free_port();
        if (!h->client_port || !h->peer_port || !h->metrics_port || h->client_port == h->peer_port ||
            h->metrics_port == h->client_port || h->metrics_port == h->peer_port)
            continue;
        if (!(st = spawn(h))) return BT_OK;
        print_log(h);
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s/data'", h->dir);
        if (system(cmd) != 0) break;
    }
    return st;
}

bt_status etcd_harness_restart(etcd_harness_t *h)
{
    if (h->pid) return BT_OK;
    bt_status st = spawn(h);
    if (st) print_log(h);
    return st;
}

static void stop_with(etcd_harness_t *h, int sig)
{
    if (!h->pid) return;
    kill(h->pid, sig);
    for (int i = 0; i < 100; i++) {
        if (waitpid(h->pid, NULL, WNOHANG) == h->pid) {
            h->pid = 0;
            return;
        }
        sleep_ms(50);
    }
    kill(h->pid, SIGKILL);
    waitpid(h->pid, NULL, 0);
    h->pid = 0;
}

void etcd_harness_stop(etcd_harness_t *h)
{
    stop_with(h, SIGTERM);
}

void etcd_harness_kill(etcd_harness_t *h)
{
    stop_with(h, SIGKILL);
}

void etcd_harness_destroy(etcd_harness_t *h)
{
    etcd_harness_stop(h);
    if (h->dir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", h->dir);
        if (system(cmd) != 0) fprintf(stderr, "etcd harness: could not remove %s\n", h->dir);
        h->dir[0] = '\0';
    }
}

static int run_etcdctl(const etcd_harness_t *h, const char *args)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "ETCDCTL_API=3 etcdctl --endpoints=%s %s >>'%s/etcd.log' 2>&1", h->endpoint, args,
             h->dir);
    return system(cmd);
}

bt_status etcd_harness_enable_auth(etcd_harness_t *h, const char *root_password)
{
    char args[256];
    snprintf(args, sizeof args, "user add root:%s", root_password);
    if (run_etcdctl(h, args) || run_etcdctl(h, "user grant-role root root") || run_etcdctl(h, "auth enable")) {
        print_log(h);
        return bt_fail(BT_ERR_UNAVAILABLE, "etcd harness: enabling auth with etcdctl failed");
    }
    return BT_OK;
}
