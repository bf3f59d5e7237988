/* Shared node plumbing: flags, listeners, etcd registration, load reports, signals (see node.h). */
#include "node/node.h"

#include "common/etcd.h"
#include "common/http.h"
#include "common/log.h"
#include "common/paths.h"
#include "engine/backend_cuda.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef BATON_VERSION
#define BATON_VERSION "0.0.0"
#endif

#define NODE_LOG "node"

struct bt_node {
    bt_node_flags_t flags;
    mbr_role role;
    metrics_registry_t *metrics;
    bt_rpc_server_t *rpc;
    http_server_t *http;
    etcd_client_t *etcd;
    mbr_registration_t *reg;
    mbr_watcher_t *members; /* the cluster as etcd shows it: which peers requests may name (peer_check.h) */
    char grpc_addr[128]; /* published: fits mbr_node_info_t */
    char http_addr[128];
    atomic_int draining;
    atomic_int registered; /* the last registration state was MBR_REG_REGISTERED (on_reg_state) */
    atomic_int stop_requested;
    int stopped;

    /* load thread */
    pthread_t load_thread;
    int load_running;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int load_quit;
    bt_node_load_fn load_fn;
    void *load_ud;
};

/* ---- flags ---- */

static bt_status parse_int(const char *what, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return bt_fail(BT_ERR_INVALID, "%s expects an integer in [%ld, %ld], got '%s'", what, lo, hi, s);
    *out = v;
    return BT_OK;
}

/* "256M", "1G", "1048576", "512K" (binary units). */
static bt_status parse_size(const char *what, const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || s[0] == '-') goto bad;
    unsigned long long mul = 1;
    if (*end) {
        switch (toupper((unsigned char)*end)) {
        case 'K': mul = 1ull << 10; break;
        case 'M': mul = 1ull << 20; break;
        case 'G': mul = 1ull << 30; break;
        case 'T': mul = 1ull << 40; break;
        default: goto bad;
        }
        end++;
        if ((*end == 'i' || *end == 'I') && (end[1] == 'B' || end[1] == 'b')) end += 2;
        else if (*end == 'B' || *end == 'b') end++;
        if (*end) goto bad;
    }
    if (v > SIZE_MAX / mul) goto bad;
    *out = (size_t)(v * mul);
    return BT_OK;
bad:
    return bt_fail(BT_ERR_INVALID, "%s expects a size in bytes with an optional K/M/G suffix (e.g. 256M), got '%s'",
                   what, s);
}

bt_status bt_node_split_addr(const char *addr, char *host, size_t host_cap, int *port)
{
    const char *colon;
    size_t hl;
    const char *h = addr;
    if (!addr || !*addr) return bt_fail(BT_ERR_INVALID, "empty address (expected host:port)");
    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');
        if (!rb || rb[1] != ':') return bt_fail(BT_ERR_INVALID, "bad address '%s' (expected [v6addr]:port)", addr);
        h = addr + 1;
        hl = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (!colon) return bt_fail(BT_ERR_INVALID, "bad address '%s' (expected host:port)", addr);
        hl = (size_t)(colon - addr);
    }
    if (hl == 0 || hl >= host_cap) return bt_fail(BT_ERR_INVALID, "bad host in address '%s'", addr);
    long p;
    if (parse_int("port", colon + 1, 0, 65535, &p)) return bt_fail(BT_ERR_INVALID, "bad port in address '%s'", addr);
    memcpy(host, h, hl);
    host[hl] = 0;
    *port = (int)p;
    return BT_OK;
}

static bt_status copy_str(char *dst, size_t cap, const char *what, const char *v)
{
    size_t n = strlen(v);
    if (n >= cap) return bt_fail(BT_ERR_INVALID, "%s is too long (%zu bytes, at most %zu)", what, n, cap - 1);
    memcpy(dst, v, n + 1);
    return BT_OK;
}

static int parse_level(const char *s)
{
    if (!strcmp(s, "debug")) return BT_LOG_DEBUG;
    if (!strcmp(s, "info")) return BT_LOG_INFO;
    if (!strcmp(s, "warn") || !strcmp(s, "warning")) return BT_LOG_WARN;
    if (!strcmp(s, "error")) return BT_LOG_ERROR;
    return -1;
}

/* One flag's value: from argv, else the environment, else NULL. */
typedef struct flag_def {
    const char *flag, *env;
} flag_def;

enum {
    F_MODEL, F_ETCD, F_CLUSTER, F_NODE_ID, F_GRPC, F_HTTP, F_THREADS, F_KV_MEM, F_MBT, F_LOG, F_GRACE, F_SPEC,
    F_SPEC_K, F_TLS_CERT, F_TLS_KEY, F_TLS_CA, F_INSECURE, F_ETCD_USER, F_ETCD_PW, F_ETCD_CA, F_ETCD_CERT,
    F_ETCD_KEY, F_DEVICE, F_N
};

static const flag_def FLAGS[F_N] = {
    [F_MODEL] = {"--model", "BATON_MODEL"},
    [F_ETCD] = {"--etcd", "BATON_ETCD"},
    [F_CLUSTER] = {"--cluster", "BATON_CLUSTER"},
    [F_NODE_ID] = {"--node-id", "BATON_NODE_ID"},
    [F_GRPC] = {"--grpc-listen", "BATON_GRPC_LISTEN"},
    [F_HTTP] = {"--http-listen", "BATON_HTTP_LISTEN"},
    [F_THREADS] = {"--threads", "BATON_THREADS"},
    [F_KV_MEM] = {"--kv-mem", "BATON_KV_MEM"},
    [F_MBT] = {"--max-batch-tokens", "BATON_MAX_BATCH_TOKENS"},
    [F_LOG] = {"--log-level", "BATON_LOG"},
    [F_GRACE] = {"--grace-ms", "BATON_GRACE_MS"},
    [F_SPEC] = {"--spec", "BATON_SPEC"},
    [F_SPEC_K] = {"--spec-k-max", "BATON_SPEC_K_MAX"},
    [F_TLS_CERT] = {"--tls-cert", "BATON_TLS_CERT"},
    [F_TLS_KEY] = {"--tls-key", "BATON_TLS_KEY"},
    [F_TLS_CA] = {"--tls-ca", "BATON_TLS_CA"},
    [F_INSECURE] = {"--insecure", "BATON_INSECURE"}, /* a switch: takes no value on the command line */
    [F_ETCD_USER] = {"--etcd-user", "BATON_ETCD_USER"},
    [F_ETCD_PW] = {"--etcd-password-file", "BATON_ETCD_PASSWORD_FILE"},
    [F_ETCD_CA] = {"--etcd-ca", "BATON_ETCD_CA"},
    [F_ETCD_CERT] = {"--etcd-cert", "BATON_ETCD_CERT"},
    [F_ETCD_KEY] = {"--etcd-key", "BATON_ETCD_KEY"},
    [F_DEVICE] = {"--device", "BATON_DEVICE"},
};

void bt_node_usage(FILE *out, const char *prog)
{
    fprintf(out,
            "usage: %s [options]   (every option also reads the BATON_* variable named)\n"
            "  --model PATH             GGUF model (BATON_MODEL; default: the cached default model)\n"
            "  --etcd URLS              etcd endpoints, comma-separated, or 'none' (BATON_ETCD; default %s)\n"
            "  --cluster NAME           cluster name in etcd keys (BATON_CLUSTER; default %s)\n"
            "  --node-id ID             unique node id (BATON_NODE_ID; default <role>-<host>-<pid>)\n"
            "  --grpc-listen HOST:PORT  gRPC listener; port 0 = a free port (BATON_GRPC_LISTEN; default %s)\n"
            "  --http-listen HOST:PORT  /health and /metrics (BATON_HTTP_LISTEN; default %s)\n"
            "  --threads N              compute threads, 0 = all CPUs (BATON_THREADS; default 0)\n"
            "  --device cpu|cuda:N      compute backend; cuda needs a GPU, its driver and libbaton_cuda.so, and a\n"
            "                           UCX with CUDA support for KV transfer (BATON_DEVICE; default cpu)\n"
            "  --kv-mem SIZE            KV pool size, e.g. 256M, 2G (BATON_KV_MEM; default 256M)\n"
            "  --max-batch-tokens N     token budget of one engine step (BATON_MAX_BATCH_TOKENS; default 512)\n"
            "  --log-level LEVEL        debug|info|warn|error (BATON_LOG; default info)\n"
            "  --grace-ms MS            drain time for calls in flight at shutdown (BATON_GRACE_MS; default %d)\n"
            "  --spec none|ngram[:MIN-MAX]|draft:PATH|self:L\n"
            "                           decode nodes: speculative decoding by n-gram prompt lookup (n-grams of\n"
            "                           MIN..MAX tokens, default 2-4), a draft model\n"
            "                           sharing the vocabulary, or the model's own first L layers; output is\n"
            "                           bit-identical either way (BATON_SPEC; default none)\n"
            "  --spec-k-max N           most draft tokens per sequence per step, 1..16; k adapts below it to the\n"
            "                           acceptance rate and the batch's cost (BATON_SPEC_K_MAX; default 8)\n"
            "  --tls-cert PEM           this node's certificate chain; its DNS SAN must be the node id\n"
            "  --tls-key PEM            its private key (BATON_TLS_KEY)\n"
            "  --tls-ca PEM             CA of the cluster: with cert and key, mutual TLS on the gRPC listener and on\n"
            "                           calls to other nodes (BATON_TLS_CERT, BATON_TLS_CA)\n"
            "  --insecure               allow a non-loopback --grpc-listen without mutual TLS (BATON_INSECURE=1)\n"
            "  --etcd-user NAME         authenticate to etcd as NAME (BATON_ETCD_USER)\n"
            "  --etcd-password-file F   its password, first line of F (BATON_ETCD_PASSWORD_FILE)\n"
            "  --etcd-ca PEM, --etcd-cert PEM, --etcd-key PEM\n"
            "                           TLS to https:// etcd endpoints: CA, client certificate and key\n"
            "                           (BATON_ETCD_CA, BATON_ETCD_CERT, BATON_ETCD_KEY)\n",
            prog, BT_NODE_DEFAULT_ETCD, MBR_DEFAULT_CLUSTER, BT_NODE_DEFAULT_LISTEN, BT_NODE_DEFAULT_LISTEN,
            BT_NODE_DEFAULT_GRACE_MS);
}

static void default_node_id(char *buf, size_t cap, mbr_role role)
{
    char host[64] = "host";
    if (gethostname(host, sizeof host - 1) != 0) strcpy(host, "host");
    host[sizeof host - 1] = 0;
    for (char *p = host; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '-' && *p != '_') *p = '-';
    host[32] = 0; /* keep the id within MBR_NODE_ID_MAX */
    snprintf(buf, cap, "%s-%s-%ld", mbr_role_name(role), host, (long)getpid());
}

/* Each flag's value and where it came from (the flag or the variable, named in errors); NULL when not given. */
typedef struct flag_values {
    const char *val[F_N];
    const char *src[F_N];
} flag_values;

/* argv first, then the BATON_* variable of each flag not given. *help set on --help / -h, which ends the scan. */
static bt_status collect_values(int argc, char **argv, flag_values *fv, int *help)
{
    const char **val = fv->val, **src = fv->src;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = 1;
            return BT_OK;
        }
        const char *eq = strchr(a, '=');
        size_t alen = eq ? (size_t)(eq - a) : strlen(a);
        int k = -1;
        for (int j = 0; j < F_N; j++)
            if (strlen(FLAGS[j].flag) == alen && !strncmp(a, FLAGS[j].flag, alen)) k = j;
        if (k < 0) return bt_fail(BT_ERR_INVALID, "unknown option '%s'", a);
        if (k == F_INSECURE && !eq) {
            val[k] = "1";
        } else if (eq) {
            val[k] = eq + 1;
        } else {
            if (i + 1 >= argc) return bt_fail(BT_ERR_INVALID, "%s needs a value", a);
            val[k] = argv[++i];
        }
        src[k] = FLAGS[k].flag;
    }
    for (int j = 0; j < F_N; j++) {
        if (val[j]) continue;
        const char *e = getenv(FLAGS[j].env);
        if (e && *e) {
            val[j] = e;
            src[j] = FLAGS[j].env;
        }
    }
    return BT_OK;
}

/* The model, the etcd endpoints ("none": no registration), the cluster and the node id. */
static bt_status take_identity(bt_node_flags_t *o, const flag_values *fv, mbr_role role)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    if (val[F_MODEL]) {
        if ((st = copy_str(o->model, sizeof o->model, src[F_MODEL], val[F_MODEL]))) return st;
    } else if ((st = bt_default_model_path(o->model, sizeof o->model))) {
        return st;
    }
    const char *etcd = val[F_ETCD] ? val[F_ETCD] : BT_NODE_DEFAULT_ETCD;
    if (strcmp(etcd, "none") && (st = copy_str(o->etcd, sizeof o->etcd, "--etcd", etcd))) return st;
    const char *cluster = val[F_CLUSTER] ? val[F_CLUSTER] : MBR_DEFAULT_CLUSTER;
    if ((st = copy_str(o->cluster, sizeof o->cluster, "--cluster", cluster))) return st;
    for (const char *p = o->cluster; *p; p++)
        if (*p == '/') return bt_fail(BT_ERR_INVALID, "%s must not contain '/'", src[F_CLUSTER]);
    if (val[F_NODE_ID]) {
        if ((st = copy_str(o->node_id, sizeof o->node_id, src[F_NODE_ID], val[F_NODE_ID]))) return st;
        if (!o->node_id[0]) return bt_fail(BT_ERR_INVALID, "%s is empty", src[F_NODE_ID]);
        for (const char *p = o->node_id; *p; p++)
            if (!isalnum((unsigned char)*p) && *p != '.' && *p != '_' && *p != '-')
                return bt_fail(BT_ERR_INVALID, "%s '%s': only letters, digits, '.', '_' and '-' are allowed",
                               src[F_NODE_ID], o->node_id);
    } else {
        default_node_id(o->node_id, sizeof o->node_id, role);
    }
    return BT_OK;
}

/* The gRPC and HTTP listen addresses, each checked as host:port. */
static bt_status take_listeners(bt_node_flags_t *o, const flag_values *fv)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    const char *addr[2] = {val[F_GRPC] ? val[F_GRPC] : BT_NODE_DEFAULT_LISTEN,
                           val[F_HTTP] ? val[F_HTTP] : BT_NODE_DEFAULT_LISTEN};
    const char *aname[2] = {val[F_GRPC] ? src[F_GRPC] : "--grpc-listen", val[F_HTTP] ? src[F_HTTP] : "--http-listen"};
    char *adst[2] = {o->grpc_listen, o->http_listen};
    for (int j = 0; j < 2; j++) {
        char host[BT_NODE_ADDR_MAX];
        int port;
        if (bt_node_split_addr(addr[j], host, sizeof host, &port))
            return bt_fail(BT_ERR_INVALID, "%s: %s", aname[j], bt_last_error());
        if ((st = copy_str(adst[j], BT_NODE_ADDR_MAX, aname[j], addr[j]))) return st;
    }
    return BT_OK;
}

/* Threads, KV memory, batch tokens, log level and drain time. */
static bt_status take_tuning(bt_node_flags_t *o, const flag_values *fv)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    long v;
    if (val[F_THREADS]) {
        if ((st = parse_int(src[F_THREADS], val[F_THREADS], 0, 1024, &v))) return st;
        o->threads = (int)v;
    }
    if (val[F_DEVICE] && bt_device_parse(val[F_DEVICE], &o->device))
        return bt_fail(BT_ERR_INVALID, "%s: %s", src[F_DEVICE], bt_last_error());
    if (val[F_KV_MEM] && (st = parse_size(src[F_KV_MEM], val[F_KV_MEM], &o->kv_mem))) return st;
    if (val[F_MBT]) {
        if ((st = parse_int(src[F_MBT], val[F_MBT], 16, 1 << 20, &v))) return st;
        o->max_batch_tokens = (int32_t)v;
    }
    if (val[F_LOG]) {
        o->log_level = parse_level(val[F_LOG]);
        if (o->log_level < 0)
            return bt_fail(BT_ERR_INVALID, "%s expects debug, info, warn or error, got '%s'", src[F_LOG], val[F_LOG]);
    }
    if (val[F_GRACE]) {
        if ((st = parse_int(src[F_GRACE], val[F_GRACE], 0, 3600 * 1000, &v))) return st;
        o->grace_ms = (int)v;
    }
    return BT_OK;
}

/* Speculative decoding, a decode-node setting. */
static bt_status take_spec(bt_node_flags_t *o, const flag_values *fv, mbr_role role)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    long v;
    /* speculation is a decode-node setting: a prefill node refuses the flag but ignores a cluster-wide variable */
    if (val[F_SPEC] && role == MBR_ROLE_PREFILL && src[F_SPEC] == FLAGS[F_SPEC].flag && strcmp(val[F_SPEC], "none"))
        return bt_fail(BT_ERR_INVALID, "--spec applies to decode nodes; prefill nodes generate one token per request");
    /* the value itself is checked where the engine starts (bt_spec_parse) */
    if (val[F_SPEC] && role != MBR_ROLE_PREFILL && (st = copy_str(o->spec, sizeof o->spec, src[F_SPEC], val[F_SPEC])))
        return st;
    if (val[F_SPEC_K]) {
        if ((st = parse_int(src[F_SPEC_K], val[F_SPEC_K], 1, 16, &v))) return st; /* BT_SPEC_K_LIMIT */
        o->spec_k_max = (int32_t)v;
    }
    return BT_OK;
}

static bt_status take_tls_files(bt_tls_files_t *t, const flag_values *fv, int fc, int fk, int fa, const char *what)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    if (val[fc] && (st = copy_str(t->cert, sizeof t->cert, src[fc], val[fc]))) return st;
    if (val[fk] && (st = copy_str(t->key, sizeof t->key, src[fk], val[fk]))) return st;
    if (val[fa] && (st = copy_str(t->ca, sizeof t->ca, src[fa], val[fa]))) return st;
    return bt_tls_files_check(t, what, 1);
}

/* TLS files, --insecure, etcd credentials (the password read from its file here: secrets never come from argv),
 * and the rule that a non-loopback gRPC listener needs mutual TLS. */
static bt_status take_security(bt_node_flags_t *o, const flag_values *fv)
{
    const char *const *val = fv->val, *const *src = fv->src;
    bt_status st;
    if ((st = take_tls_files(&o->tls, fv, F_TLS_CERT, F_TLS_KEY, F_TLS_CA, "--tls"))) return st;
    if (o->tls.cert[0] && !o->tls.ca[0])
        return bt_fail(BT_ERR_INVALID, "--tls-cert needs --tls-ca: nodes verify the certificates of their peers");
    if (val[F_INSECURE]) {
        if (strcmp(val[F_INSECURE], "1") && strcmp(val[F_INSECURE], "0"))
            return bt_fail(BT_ERR_INVALID, "%s expects 1 or 0, got '%s'", src[F_INSECURE], val[F_INSECURE]);
        o->insecure = !strcmp(val[F_INSECURE], "1");
    }
    if ((st = bt_tls_check_listen(src[F_GRPC] ? src[F_GRPC] : "--grpc-listen", o->grpc_listen, &o->tls,
                                  o->insecure)))
        return st;
    if ((st = take_tls_files(&o->etcd_tls, fv, F_ETCD_CERT, F_ETCD_KEY, F_ETCD_CA, "--etcd"))) return st;
    if (val[F_ETCD_USER] && (st = copy_str(o->etcd_user, sizeof o->etcd_user, src[F_ETCD_USER], val[F_ETCD_USER])))
        return st;
    if (!val[F_ETCD_USER] != !val[F_ETCD_PW])
        return bt_fail(BT_ERR_INVALID, "%s needs %s as well", val[F_ETCD_USER] ? "--etcd-user" : "--etcd-password-file",
                       val[F_ETCD_USER] ? "--etcd-password-file" : "--etcd-user");
    if (val[F_ETCD_PW])
        return bt_tls_read_secret(src[F_ETCD_PW], val[F_ETCD_PW], o->etcd_password, sizeof o->etcd_password);
    return BT_OK;
}

bt_status bt_node_flags_parse(bt_node_flags_t *f, mbr_role role, int argc, char **argv, int *help)
{
    flag_values fv = {{0}, {0}};
    *help = 0;
    bt_status st = collect_values(argc, argv, &fv, help);
    if (st || *help) return st;
    bt_node_flags_t o;
    memset(&o, 0, sizeof o);
    o.log_level = -1;
    o.device = -1;
    o.grace_ms = BT_NODE_DEFAULT_GRACE_MS;
    if ((st = take_identity(&o, &fv, role)) || (st = take_listeners(&o, &fv)) || (st = take_tuning(&o, &fv)) ||
        (st = take_spec(&o, &fv, role)) || (st = take_security(&o, &fv)))
        return st;
    *f = o;
    return BT_OK;
}

/* ---- node ---- */

mbr_watcher_t *bt_node_members(bt_node_t *n)
{
    return n->members;
}

metrics_registry_t *bt_node_metrics(bt_node_t *n) { return n->metrics; }
bt_rpc_server_t *bt_node_rpc(bt_node_t *n) { return n->rpc; }
const bt_node_flags_t *bt_node_flags(const bt_node_t *n) { return &n->flags; }
const char *bt_node_grpc_addr(const bt_node_t *n) { return n->grpc_addr; }
const char *bt_node_http_addr(const bt_node_t *n) { return n->http_addr; }

/* The address others should dial: a wildcard bind publishes the host name instead. */
static void publish_addr(char *out, size_t cap, const char *host, int port)
{
    char name[128];
    if (!strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "")) {
        if (gethostname(name, sizeof name - 1) != 0) strcpy(name, "localhost");
        name[sizeof name - 1] = 0;
        host = name;
    }
    if (strchr(host, ':')) snprintf(out, cap, "[%s]:%d", host, port);
    else snprintf(out, cap, "%s:%d", host, port);
}

bt_status bt_node_create(const bt_node_flags_t *f, mbr_role role, bt_node_t **out)
{
    /* Every thread created from here on inherits the mask; bt_node_wait takes the signals synchronously. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    bt_node_t *n = calloc(1, sizeof *n);
    if (!n) return bt_fail(BT_ERR_NOMEM, "out of memory creating the node");
    n->flags = *f;
    n->role = role;
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    if (f->log_level >= 0) bt_log_set_level((bt_log_level)f->log_level);
    bt_status st = metrics_registry_create(&n->metrics);
    if (st) goto fail;
    if (f->etcd[0]) {
        etcd_config_t ec = {.endpoints = f->etcd, .user = f->etcd_user, .password = f->etcd_password};
        bt_tls_etcd_paths(&f->etcd_tls, &ec.ca_file, &ec.cert_file, &ec.key_file);
        if ((st = etcd_client_create(&ec, &n->etcd))) goto fail;
        if ((st = mbr_watcher_create(n->etcd, f->cluster, NULL, &n->members))) goto fail;
    }
    char host[BT_NODE_ADDR_MAX];
    int port;
    if ((st = bt_node_split_addr(f->grpc_listen, host, sizeof host, &port))) goto fail;
    /* with the node's certificate: TLS; with the CA too: clients must present a certificate from it (mTLS) */
    bt_rpc_server_config_t rc = {.listen = f->grpc_listen,
                                 .tls_cert_file = f->tls.cert[0] ? f->tls.cert : NULL,
                                 .tls_key_file = f->tls.key[0] ? f->tls.key : NULL,
                                 .tls_client_ca_file = f->tls.cert[0] && f->tls.ca[0] ? f->tls.ca : NULL};
    if ((st = bt_rpc_server_create(&rc, &n->rpc))) {
        bt_fail(st, "gRPC listener %s: %s", f->grpc_listen, bt_last_error());
        goto fail;
    }
    publish_addr(n->grpc_addr, sizeof n->grpc_addr, host, bt_rpc_server_port(n->rpc));
    *out = n;
    return BT_OK;
fail:
    bt_node_destroy(n);
    return st;
}

static int64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void health_handler(http_request_t *req, void *arg)
{
    bt_node_t *n = arg;
    char body[256];
    int draining = atomic_load(&n->draining);
    int len = snprintf(body, sizeof body, "{\"status\":\"%s\",\"role\":\"%s\",\"node_id\":\"%s\"}",
                       draining ? "draining" : "ok", mbr_role_name(n->role), n->flags.node_id);
    http_respond(req, draining ? 503 : 200, "application/json", body, (size_t)len);
}

/* Liveness: the process answers. Kubernetes restarts a pod whose liveness fails, so a draining node stays live. */
static void live_handler(http_request_t *req, void *arg)
{
    (void)arg;
    static const char body[] = "{\"status\":\"alive\"}";
    http_respond(req, 200, "application/json", body, sizeof body - 1);
}

/* Readiness: serving and, with etcd, registered (routers find the node only through its record). */
static void ready_handler(http_request_t *req, void *arg)
{
    bt_node_t *n = arg;
    const char *why = NULL;
    if (atomic_load(&n->draining)) why = "draining";
    else if (n->etcd && !atomic_load(&n->registered)) why = "not registered in etcd";
    char body[256];
    int len = snprintf(body, sizeof body, "{\"status\":\"%s\",\"role\":\"%s\",\"node_id\":\"%s\"}",
                       why ? why : "ready", mbr_role_name(n->role), n->flags.node_id);
    http_respond(req, why ? 503 : 200, "application/json", body, (size_t)len);
}

#define NODE_ETCD_WARN_MS 3000 /* not registered this long: say so (membership retries on its own) */

static void *load_main(void *arg)
{
    bt_node_t *n = arg;
    int64_t pending_since = 0;
    int warned = 0;
    pthread_mutex_lock(&n->mu);
    while (!n->load_quit) {
        pthread_mutex_unlock(&n->mu);
        if (n->load_fn) {
            mbr_load_report_t lr;
            memset(&lr, 0, sizeof lr);
            n->load_fn(n->load_ud, &lr);
            if (n->reg) mbr_registration_publish_load(n->reg, &lr);
        }
        if (n->reg) {
            int64_t now = wall_ms();
            if (mbr_registration_state(n->reg, NULL) == MBR_REG_REGISTERED) {
                pending_since = 0;
                warned = 0;
            } else if (!pending_since) {
                pending_since = now;
            } else if (!warned && now - pending_since > NODE_ETCD_WARN_MS) {
                BT_WARN(NODE_LOG, "not registered in etcd %s after %d s (etcd does not answer?); serving on and "
                        "retrying with backoff", n->flags.etcd, NODE_ETCD_WARN_MS / 1000);
                warned = 1;
            }
        }
        pthread_mutex_lock(&n->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += BT_NODE_LOAD_PERIOD_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        if (!n->load_quit) pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

static void on_reg_state(void *arg, mbr_reg_state state, int64_t lease)
{
    bt_node_t *n = arg;
    atomic_store(&n->registered, state == MBR_REG_REGISTERED);
    if (state == MBR_REG_REGISTERED)
        BT_INFO(NODE_LOG, "registered in etcd as /baton/%s/nodes/%s (lease %lld)", n->flags.cluster,
                n->flags.node_id, (long long)lease);
    else if (state == MBR_REG_ETCD_DOWN)
        BT_WARN(NODE_LOG, "etcd %s does not answer; serving on and retrying", n->flags.etcd);
    else
        BT_INFO(NODE_LOG, "etcd registration pending (lease lost or not yet granted)");
}

bt_status bt_node_start(bt_node_t *n, const mbr_node_info_t *info, bt_node_load_fn load, void *load_ud,
                        const char *summary)
{
    char host[BT_NODE_ADDR_MAX];
    int port;
    bt_status st = bt_node_split_addr(n->flags.http_listen, host, sizeof host, &port);
    if (st) return st;
    http_config_t hc = {.address = host, .port = port, .threads = 2, .metrics = n->metrics};
    if ((st = http_server_create(&hc, &n->http))) return st;
    if ((st = http_server_route(n->http, "GET", "/health", 0, health_handler, n))) return st;
    if ((st = http_server_route(n->http, "GET", "/live", 0, live_handler, n))) return st;
    if ((st = http_server_route(n->http, "GET", "/ready", 0, ready_handler, n))) return st;
    if ((st = http_server_start(n->http))) return bt_fail(st, "HTTP listener %s: %s", n->flags.http_listen,
                                                          bt_last_error());
    publish_addr(n->http_addr, sizeof n->http_addr, host, http_server_port(n->http));
    if ((st = bt_rpc_server_start(n->rpc))) return st;

    if (load) {
        n->load_fn = load;
        n->load_ud = load_ud;
    }
    if (n->etcd) {
        mbr_node_info_t ni;
        if ((st = mbr_node_info_copy(info, &ni))) return st;
        snprintf(ni.node_id, sizeof ni.node_id, "%s", n->flags.node_id);
        ni.role = n->role;
        snprintf(ni.grpc_addr, sizeof ni.grpc_addr, "%s", n->grpc_addr);
        snprintf(ni.http_addr, sizeof ni.http_addr, "%s", n->http_addr);
        snprintf(ni.version, sizeof ni.version, "%s", BATON_VERSION);
        ni.started_ms = wall_ms();
        mbr_config_t mc = {.cluster = n->flags.cluster, .on_state = on_reg_state, .arg = n};
        st = mbr_registration_create(n->etcd, &mc, &ni, &n->reg);
        mbr_node_info_free(&ni);
        if (st) return st;
    }
    if (n->load_fn || n->reg) {
        if (pthread_create(&n->load_thread, NULL, load_main, n) != 0)
            return bt_fail(BT_ERR_INTERNAL, "cannot start the load thread");
        n->load_running = 1;
    }
    BT_INFO(NODE_LOG, "baton-%s %s ready: %s | node %s cluster %s etcd %s | listening grpc=%s http=%s | grpc %s",
            mbr_role_name(n->role), BATON_VERSION, summary ? summary : "", n->flags.node_id, n->flags.cluster,
            n->flags.etcd[0] ? n->flags.etcd : "none", n->grpc_addr, n->http_addr,
            bt_tls_mutual(&n->flags.tls) ? "mTLS" : n->flags.tls.cert[0] ? "TLS" : "insecure");
    return BT_OK;
}

int bt_node_wait(bt_node_t *n)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    while (!atomic_load(&n->stop_requested)) {
        struct timespec ts = {0, 200 * 1000000L};
        int sig = sigtimedwait(&set, NULL, &ts);
        if (sig > 0) return sig;
    }
    return 0;
}

void bt_node_request_stop(bt_node_t *n) { atomic_store(&n->stop_requested, 1); }

void bt_node_stop(bt_node_t *n, int grace_ms)
{
    if (!n || n->stopped) return;
    n->stopped = 1;
    atomic_store(&n->draining, 1);
    if (n->rpc) bt_rpc_server_set_health(n->rpc, "", 0);
    if (n->load_running) {
        pthread_mutex_lock(&n->mu);
        n->load_quit = 1;
        pthread_cond_broadcast(&n->cv);
        pthread_mutex_unlock(&n->mu);
        pthread_join(n->load_thread, NULL);
        n->load_running = 0;
    }
    /* Leave the cluster first so the router stops sending new work while the calls in flight drain. */
    if (n->reg) {
        int registered = mbr_registration_state(n->reg, NULL) != MBR_REG_PENDING;
        mbr_registration_destroy(n->reg, 1);
        n->reg = NULL;
        BT_INFO(NODE_LOG, "%s", registered ? "deregistered from etcd" : "left etcd (was not registered)");
    }
    if (n->rpc) bt_rpc_server_shutdown(n->rpc, grace_ms);
    if (n->http) http_server_stop(n->http);
}

void bt_node_destroy(bt_node_t *n)
{
    if (!n) return;
    bt_node_stop(n, 0);
    bt_rpc_server_destroy(n->rpc);
    http_server_destroy(n->http);
    mbr_watcher_destroy(n->members);
    etcd_client_destroy(n->etcd);
    metrics_registry_destroy(n->metrics);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    free(n);
}
