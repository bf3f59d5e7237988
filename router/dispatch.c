/* Decode-node choice, prefill placement, Decode/Run and migration (DESIGN 3, 7).
 *
 * Choice: among decode nodes in the etcd view not already failed for this request, two picked at random (power of
 * two choices, so that many routers reading the same stale load do not herd onto one node); the one with more KV
 * headroom and fewer running sequences wins. Running counts add this router's own in-flight calls, which are more
 * recent than the node's last load report. Placement: for that node D, the cost model of placement.c decides local or
 * remote prefill and on which prefill node P, from the nodes' load reports, this router's own not-yet-answered
 * prefills, and the approximate prefix index (what this router already sent where). Migration: when a stream fails
 * before its end, the choice and the placement are made again without that node and the new call carries the prompt
 * plus every token already delivered, so the node continues exactly after them; responses are placed by their
 * offset, so nothing is delivered twice or skipped.
 *
 * Failure detection (DESIGN 3, issue 17): a stream moves to another node at once when its node leaves the
 * membership; when neither it nor any other stream of ours on that node got a token for the stall bound
 * (max(--stall-timeout-ms, RTR_STALL_STEPS of the node's step time): one preempted stream on a busy node stays);
 * and, before its first token, when it waited that long on a node that is stale (no load report for
 * --load-stale-ms while etcd answers: nodes rewrite theirs every second) or suspect (another stream of ours stalled
 * there, and no record of the node arrived since). New work avoids such nodes, and nodes whose streams went silent
 * for longer than their own step time allows, as long as another node is fit; with none fit, the last view stands.
 * Every Decode/Run carries the request's deadline (the front end's, else --request-timeout-s). */
#include "router/router.h"

#include "common/log.h"
#include "common/prefix_hash.h"
#include "common/tls.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define MAX_TRACKED 256
#define MAX_PREFILL RTR_MAX_PREFILL_CANDIDATES /* prefill candidates one decision weighs (prefill_nodes) */
#define POLL_MS 50

typedef struct node_slot {
    char node_id[MBR_NODE_ID_MAX];
    char grpc_addr[128];
    int64_t started_ms;
    bt_rpc_channel_t *ch;      /* decode nodes only; opened on first use */
    int inflight;
    int64_t pending_prefill;   /* prompt tokens this router sent here to prefill whose first token has not come */
    int gone;                  /* left the membership: its streams move at once */
    int decoding;              /* streams of ours on it past their first token */
    int64_t last_token_ms;     /* monotonic ms of the last token any stream of ours got from it */
    int64_t suspect_ms;        /* when a stream of ours stalled here (0 = none); a later token or record clears it */
} node_slot_t;

struct rtr_dispatch {
    mbr_watcher_t *watcher;
    char fingerprint[32];    /* the router's model; "" = accept any */
    uint64_t fingerprint_u64;
    int max_migrations;
    metrics_counter_t *migrations, *decisions_local, *decisions_remote;
    metrics_histogram_t *predicted_ttft;
    rtr_prefill_mode mode;
    double overhead_s, kv_bytes_per_token;
    rtr_pindex_t *pindex;
    int log_fd;              /* decision log, -1 = off */
    int load_stale_ms, stall_ms, request_timeout_ms; /* <= 0: off */
    int64_t last_unfit_log_ms; /* under mu */
    pthread_mutex_t mu;
    bt_tls_files_t tls;      /* calls to nodes: mTLS when set, each node verified as its node id */
    node_slot_t slots[MAX_TRACKED]; /* channels and in-flight counts by node (a restarted node gets a new slot) */
    int n_slots;
    uint64_t rng;
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Marks this incarnation's slots gone (or back); under no lock. */
static void mark_gone(rtr_dispatch_t *d, const mbr_node_info_t *info, int gone)
{
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < d->n_slots; i++)
        if (!strcmp(d->slots[i].node_id, info->node_id) && d->slots[i].started_ms == info->started_ms)
            d->slots[i].gone = gone;
    pthread_mutex_unlock(&d->mu);
}

/* A node that left the view takes its cache with it (or will come back empty), and its streams move now. */
static void on_leave(void *arg, const mbr_node_t *n)
{
    rtr_dispatch_t *d = arg;
    mark_gone(d, &n->info, 1);
    rtr_pindex_forget(d->pindex, n->info.node_id);
}

static void on_join(void *arg, const mbr_node_t *n)
{
    mark_gone(arg, &n->info, 0);
}

bt_status rtr_dispatch_create(const rtr_dispatch_config_t *cfg, rtr_dispatch_t **out)
{
    rtr_dispatch_t *d = calloc(1, sizeof *d);
    if (!d) return bt_fail(BT_ERR_NOMEM, "out of memory");
    d->max_migrations = cfg->max_migrations > 0 ? cfg->max_migrations : RTR_DEFAULT_MIGRATIONS;
    snprintf(d->fingerprint, sizeof d->fingerprint, "%s", cfg->fingerprint ? cfg->fingerprint : "");
    d->fingerprint_u64 = cfg->fingerprint_u64;
    d->migrations = cfg->migrations;
    d->decisions_local = cfg->decisions_local;
    d->decisions_remote = cfg->decisions_remote;
    d->predicted_ttft = cfg->predicted_ttft;
    d->mode = cfg->prefill_mode;
    d->overhead_s = cfg->remote_overhead_s > 0 ? cfg->remote_overhead_s : 0;
    d->kv_bytes_per_token = cfg->kv_bytes_per_token;
    d->log_fd = -1;
    d->load_stale_ms = cfg->load_stale_ms ? cfg->load_stale_ms : RTR_DEFAULT_LOAD_STALE_MS;
    d->stall_ms = cfg->stall_ms ? cfg->stall_ms : RTR_DEFAULT_STALL_MS;
    d->request_timeout_ms = cfg->request_timeout_ms ? cfg->request_timeout_ms : RTR_DEFAULT_REQUEST_TIMEOUT_MS;
    int grace = cfg->rejoin_grace_ms ? cfg->rejoin_grace_ms : RTR_DEFAULT_REJOIN_GRACE_MS;
    if (cfg->tls) d->tls = *cfg->tls;
    pthread_mutex_init(&d->mu, NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    d->rng = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec;
    bt_status st = rtr_pindex_create(&d->pindex);
    if (st) goto fail;
    if (cfg->decision_log && *cfg->decision_log) {
        d->log_fd = open(cfg->decision_log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (d->log_fd < 0) {
            st = bt_fail(BT_ERR_IO, "cannot open decision log %s: %s", cfg->decision_log, strerror(errno));
            goto fail;
        }
    }
    mbr_watch_ops_t ops = {.on_join = on_join, .on_leave = on_leave, .arg = d};
    if ((st = mbr_watcher_create(cfg->etcd, cfg->cluster, &ops, &d->watcher))) goto fail;
    if (grace > 0 && (st = mbr_watcher_set_rejoin_grace(d->watcher, grace))) {
        mbr_watcher_destroy(d->watcher);
        goto fail;
    }
    *out = d;
    return BT_OK;
fail:
    if (d->log_fd >= 0) close(d->log_fd);
    rtr_pindex_destroy(d->pindex);
    pthread_mutex_destroy(&d->mu);
    free(d);
    return st;
}

void rtr_dispatch_destroy(rtr_dispatch_t *d)
{
    if (!d) return;
    mbr_watcher_destroy(d->watcher);
    for (int i = 0; i < d->n_slots; i++) bt_rpc_channel_destroy(d->slots[i].ch);
    rtr_pindex_destroy(d->pindex);
    if (d->log_fd >= 0) close(d->log_fd);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

bt_status rtr_dispatch_wait_synced(rtr_dispatch_t *d, int timeout_ms)
{
    return mbr_watcher_wait_synced(d->watcher, timeout_ms);
}

/* A node of this role with an address, serving the router's model (a node of another model is never used). */
static int usable_role(const rtr_dispatch_t *d, const mbr_node_t *n, mbr_role role)
{
    /* an address that is not host:port (a "unix:" or other gRPC target URI from a forged record) is never dialled */
    return n->info.role == role && n->info.grpc_addr[0] &&
           (!d->fingerprint[0] || !strcasecmp(n->info.model, d->fingerprint)) &&
           bt_tls_check_member_addr(n->info.grpc_addr) == BT_OK;
}

static int usable(const rtr_dispatch_t *d, const mbr_node_t *n)
{
    return usable_role(d, n, MBR_ROLE_DECODE);
}

int rtr_dispatch_n_healthy(rtr_dispatch_t *d)
{
    mbr_node_t *nodes;
    size_t n;
    if (mbr_watcher_snapshot(d->watcher, &nodes, &n)) return 0;
    int k = 0;
    for (size_t i = 0; i < n; i++) k += usable(d, &nodes[i]);
    mbr_nodes_free(nodes, n);
    return k;
}

/* The slot of this incarnation of a node, or NULL; under d->mu. */
static node_slot_t *slot_find(rtr_dispatch_t *d, const mbr_node_info_t *info)
{
    for (int i = 0; i < d->n_slots; i++)
        if (!strcmp(d->slots[i].node_id, info->node_id) && d->slots[i].started_ms == info->started_ms)
            return &d->slots[i];
    return NULL;
}

/* Slot of a node, created on first use, with a channel when with_channel; under d->mu. NULL when the table is full
 * of busy slots or the channel cannot be made. */
static node_slot_t *slot_get(rtr_dispatch_t *d, const mbr_node_info_t *info, int with_channel)
{
    node_slot_t *s = NULL;
    for (int i = 0; i < d->n_slots && !s; i++)
        if (!strcmp(d->slots[i].node_id, info->node_id) && !strcmp(d->slots[i].grpc_addr, info->grpc_addr) &&
            d->slots[i].started_ms == info->started_ms)
            s = &d->slots[i];
    if (!s) {
        if (d->n_slots < MAX_TRACKED) {
            s = &d->slots[d->n_slots++];
        } else {
            for (int i = 0; i < d->n_slots && !s; i++)
                if (!d->slots[i].inflight && !d->slots[i].pending_prefill) s = &d->slots[i];
            if (!s) return NULL;
            bt_rpc_channel_destroy(s->ch);
        }
        memset(s, 0, sizeof *s);
        snprintf(s->node_id, sizeof s->node_id, "%s", info->node_id);
        snprintf(s->grpc_addr, sizeof s->grpc_addr, "%s", info->grpc_addr);
        s->started_ms = info->started_ms;
    }
    if (with_channel && !s->ch) {
        /* the record is etcd's word: its address must be host:port, and with TLS the node's certificate must
         * name its node id (a record pointing elsewhere fails the handshake) */
        bt_rpc_channel_config_t cc = {.target = info->grpc_addr, .keepalive_ms = 10000,
                                      .tls_ca_file = d->tls.ca[0] ? d->tls.ca : NULL,
                                      .tls_cert_file = d->tls.cert[0] ? d->tls.cert : NULL,
                                      .tls_key_file = d->tls.key[0] ? d->tls.key : NULL,
                                      .tls_server_name = d->tls.ca[0] ? info->node_id : NULL};
        if (bt_tls_check_member_addr(info->grpc_addr) != BT_OK) {
            BT_WARN("router", "node %s: %s; not used", info->node_id, bt_last_error());
            return NULL;
        }
        if (bt_rpc_channel_create(&cc, &s->ch)) {
            s->ch = NULL;
            return NULL; /* the slot stays, empty: reused or retried later */
        }
    }
    return s;
}

static int inflight_of(rtr_dispatch_t *d, const mbr_node_info_t *info)
{
    node_slot_t *s = slot_find(d, info);
    return s ? s->inflight : 0;
}

/* Higher is better: free fraction of the KV pool minus the busy fraction of the batch. */
static double score(rtr_dispatch_t *d, const mbr_node_t *n)
{
    double total = (double)(n->has_load && n->load.kv_blocks_total ? n->load.kv_blocks_total : n->info.kv_blocks_total);
    double free_blocks = n->has_load ? (double)n->load.kv_blocks_free : total;
    int64_t running = n->has_load ? n->load.running_seqs + n->load.queued_requests : 0;
    int local = inflight_of(d, &n->info);
    if (local > running) running = local;
    return rtr_decode_score(total, free_blocks, running, (double)n->info.max_running);
}

int64_t rtr_stall_bound_ms(int stall_ms, double step_s)
{
    double steps = step_s > 0 ? RTR_STALL_STEPS * step_s * 1000.0 : 0;
    return steps > stall_ms ? (int64_t)steps : stall_ms;
}

const char *rtr_liveness_unfit(const rtr_liveness_t *l, int load_stale_ms, int strict)
{
    if (l->gone) return "left the cluster";
    if (load_stale_ms > 0 && l->confirmed_ms > load_stale_ms && l->report_age_ms > load_stale_ms)
        return "sends no load report";
    if (l->suspect) return "stalled another stream";
    int64_t silent = (int64_t)(RTR_SILENT_STEPS * (l->step_s > 0 ? l->step_s : 0) * 1000.0);
    if (silent < RTR_SILENT_MIN_MS) silent = RTR_SILENT_MIN_MS;
    if (strict && l->decoding > 0 && l->silent_ms > silent) return "went silent";
    return NULL;
}

/* rtr_liveness_unfit for node n as of now; under d->mu. */
static const char *node_unfit(rtr_dispatch_t *d, const mbr_node_t *n, int64_t now, int64_t confirmed, int strict)
{
    node_slot_t *s = slot_find(d, &n->info);
    rtr_liveness_t l = {.report_age_ms = now - n->seen_ms, .confirmed_ms = confirmed,
                        .step_s = n->has_load ? n->load.step_s : 0};
    if (s) {
        l.gone = s->gone;
        l.suspect = s->suspect_ms && n->seen_ms <= s->suspect_ms;
        l.decoding = s->decoding;
        l.silent_ms = now - s->last_token_ms;
    }
    return rtr_liveness_unfit(&l, d->load_stale_ms, strict);
}

static uint64_t next_rand(rtr_dispatch_t *d)
{
    d->rng ^= d->rng << 13;
    d->rng ^= d->rng >> 7;
    d->rng ^= d->rng << 17;
    return d->rng;
}

/* What one placement decision is about. */
typedef struct plan_req {
    const char *request_id;
    int64_t n_tokens;        /* prompt + tokens already delivered (a migrated request prefills both) */
    const uint64_t *hashes;  /* [n_hashes] the prompt's block hashes */
    size_t n_hashes;
} plan_req_t;

typedef struct picked {
    node_slot_t *slot;          /* D, with its call counted in flight */
    double step_s;              /* D's step time in its last load report (0 = unknown) */
    node_slot_t *pending_slot;  /* the node that prefills, holding `pending` tokens of ours */
    int64_t pending;
    char fingerprint[128];
    int remote;
    char prefill_id[MBR_NODE_ID_MAX];
    char prefill_addr[128];
} picked_t;

bt_status rtr_exclude_add(rtr_exclude_t *e, const char *node_id)
{
    if (rtr_exclude_has(e, node_id)) return BT_OK;
    if (e->n == e->cap) {
        size_t cap = e->cap ? e->cap * 2 : 4;
        char(*ids)[MBR_NODE_ID_MAX] = realloc(e->ids, cap * sizeof *ids);
        if (!ids) return bt_fail(BT_ERR_NOMEM, "out of memory");
        e->ids = ids;
        e->cap = cap;
    }
    snprintf(e->ids[e->n++], MBR_NODE_ID_MAX, "%s", node_id);
    return BT_OK;
}

int rtr_exclude_has(const rtr_exclude_t *e, const char *node_id)
{
    for (size_t i = 0; i < e->n; i++)
        if (!strcmp(e->ids[i], node_id)) return 1;
    return 0;
}

void rtr_exclude_free(rtr_exclude_t *e)
{
    free(e->ids);
    memset(e, 0, sizeof *e);
}

/* The cost model's view of a node: its load report, raised by this router's fresher counts, and the leading prompt
 * tokens the prefix index says it holds. cached_blocks comes from rtr_pindex_match (taken before d->mu). */
static rtr_place_node_t place_node(rtr_dispatch_t *d, const mbr_node_t *n, size_t cached_blocks, int64_t n_tokens)
{
    rtr_place_node_t p = {.node_id = n->info.node_id};
    if (n->has_load) {
        p.queued_prefill_tokens = n->load.queued_prefill_tokens;
        p.running_seqs = n->load.running_seqs;
        p.prefill_tok_s = n->load.prefill_tok_s;
        p.step_s = n->load.step_s;
        p.tokens_per_step = n->load.tokens_per_step;
        p.kv_transfer_bytes_s = n->load.kv_transfer_bytes_s;
    }
    node_slot_t *s = slot_find(d, &n->info);
    if (s) { /* the report may be up to a second old: our own recent sends are a floor */
        if (s->pending_prefill > p.queued_prefill_tokens) p.queued_prefill_tokens = s->pending_prefill;
        if (n->info.role == MBR_ROLE_DECODE && s->inflight > p.running_seqs) p.running_seqs = s->inflight;
    }
    int64_t cached = (int64_t)cached_blocks * BT_PREFIX_HASH_BLOCK;
    p.cached_tokens = cached < n_tokens ? cached : n_tokens;
    return p;
}

static size_t match_of(rtr_dispatch_t *d, const mbr_node_t *n, const plan_req_t *rq)
{
    return rtr_pindex_match(d->pindex, n->info.node_id, n->info.started_ms, rq->hashes, rq->n_hashes);
}

/* The prefill candidates one decision weighs (rtr_prefill_candidates): indices of healthy prefill nodes in nodes[n],
 * at most MAX_PREFILL, prefix holders first. Out of memory: the first MAX_PREFILL healthy ones. */
static size_t prefill_nodes(rtr_dispatch_t *d, const mbr_node_t *nodes, size_t n, const plan_req_t *rq, size_t *idx)
{
    size_t healthy = 0, k = 0;
    size_t *h = malloc((2 * n + 1) * sizeof *h); /* [n] healthy indices, then rtr_prefill_candidates' scratch */
    unsigned char *holds = calloc(n + 1, 1);
    if (!h || !holds) {
        free(h);
        free(holds);
        for (size_t i = 0; i < n && k < MAX_PREFILL; i++)
            if (usable_role(d, &nodes[i], MBR_ROLE_PREFILL)) idx[k++] = i;
        return k;
    }
    for (size_t i = 0; i < n; i++) /* one usable_role per node (it parses the address) */
        if (usable_role(d, &nodes[i], MBR_ROLE_PREFILL)) h[healthy++] = i;
    uint32_t hid[RTR_PINDEX_HOLDERS];
    int64_t hst[RTR_PINDEX_HOLDERS];
    size_t nh = healthy > MAX_PREFILL && rq->n_hashes ? rtr_pindex_holders(d->pindex, rq->hashes[0], hid, hst) : 0;
    for (size_t j = 0; j < healthy && nh; j++) {
        const mbr_node_t *x = &nodes[h[j]];
        uint32_t idh = rtr_pindex_id_hash(x->info.node_id);
        for (size_t t = 0; t < nh; t++) holds[j] |= hid[t] == idh && hst[t] == x->info.started_ms;
    }
    size_t pick[MAX_PREFILL];
    pthread_mutex_lock(&d->mu);
    k = rtr_prefill_candidates(healthy, holds, MAX_PREFILL, &d->rng, h + healthy, pick);
    pthread_mutex_unlock(&d->mu);
    for (size_t i = 0; i < k; i++) idx[i] = h[pick[i]];
    free(h);
    free(holds);
    return k;
}

/* One decision with every input kept, for the decision log. */
typedef struct plan {
    size_t di;                          /* D in the snapshot */
    size_t pidx[MAX_PREFILL], np;       /* the prefill candidates in the snapshot */
    rtr_place_node_t dn;                /* D's inputs */
    rtr_place_node_t pn[MAX_PREFILL];   /* each candidate's inputs */
    rtr_place_cand_t cands[MAX_PREFILL];
    rtr_place_decision_t dec;
} plan_t;

/* Runs the cost model for decode node nodes[pl->di] against the candidates pl->pidx (set by the caller). */
static void place(rtr_dispatch_t *d, const mbr_node_t *nodes, const plan_req_t *rq, plan_t *pl)
{
    size_t dm = match_of(d, &nodes[pl->di], rq);
    size_t pm[MAX_PREFILL];
    for (size_t i = 0; i < pl->np; i++) pm[i] = match_of(d, &nodes[pl->pidx[i]], rq);
    pthread_mutex_lock(&d->mu);
    pl->dn = place_node(d, &nodes[pl->di], dm, rq->n_tokens);
    for (size_t i = 0; i < pl->np; i++) pl->pn[i] = place_node(d, &nodes[pl->pidx[i]], pm[i], rq->n_tokens);
    pthread_mutex_unlock(&d->mu);
    rtr_place_input_t in = {.prompt_tokens = rq->n_tokens, .decode = pl->dn, .prefill = pl->pn, .n_prefill = pl->np,
                            .mode = d->mode, .overhead_s = d->overhead_s, .kv_bytes_per_token = d->kv_bytes_per_token};
    rtr_place_decide(&in, pl->cands, &pl->dec);
}

static void log_debug(const plan_req_t *rq, const plan_t *pl)
{
    if (!bt_log_enabled(BT_LOG_DEBUG)) return;
    char cands[2048];
    size_t off = 0;
    cands[0] = '\0';
    for (size_t i = 0; i < pl->np && off < sizeof cands; i++) {
        const rtr_place_cand_t *c = &pl->cands[i];
        int w = snprintf(cands + off, sizeof cands - off,
                         " [%s cost %.4f s: step %.4f queued %lld tok (%.4f s) uncached %lld tok (%.4f s) at %.0f tok/s, "
                         "transfer %.4f s at %.3g B/s]",
                         pl->pn[i].node_id, c->cost_s, c->step_s, (long long)pl->pn[i].queued_prefill_tokens,
                         c->queue_s, (long long)c->uncached_tokens, c->compute_s, c->rate, c->transfer_s, c->bps);
        if (w < 0) break;
        off += (size_t)w;
    }
    const rtr_place_decision_t *dc = &pl->dec;
    BT_DEBUG("router",
             "request %s: prefill %s%s (%s) | prompt %lld tok | decode %s: running %lld, queued %lld tok, "
             "uncached %lld tok, %.0f tok/s, step %.4f s | local %.4f s = own %.4f + interference %.4f | "
             "predicted ttft %.4f s | %zu prefill node(s):%s",
             rq->request_id, dc->remote ? "remote on " : "local", dc->remote ? pl->pn[dc->best].node_id : "",
             dc->reason, (long long)rq->n_tokens, pl->dn.node_id, (long long)pl->dn.running_seqs,
             (long long)pl->dn.queued_prefill_tokens, (long long)dc->uncached_local, dc->d_rate, dc->d_step_s,
             dc->cost_local_s, dc->local_own_s, dc->interference_s, dc->ttft_s, pl->np, cands);
}

/* Appends the decision as one JSON line with a single write(): O_APPEND keeps concurrent lines whole. */
static void log_json(rtr_dispatch_t *d, const plan_req_t *rq, const plan_t *pl)
{
    if (d->log_fd < 0) return;
    const rtr_place_decision_t *dc = &pl->dec;
    cJSON *o = cJSON_CreateObject();
    if (!o) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    cJSON_AddNumberToObject(o, "ts", (double)ts.tv_sec + ts.tv_nsec / 1e9);
    cJSON_AddStringToObject(o, "request_id", rq->request_id ? rq->request_id : "");
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)rq->n_tokens);
    cJSON_AddStringToObject(o, "mode", rtr_prefill_mode_name(d->mode));
    cJSON_AddStringToObject(o, "decode_node", pl->dn.node_id);
    cJSON_AddStringToObject(o, "choice", dc->remote ? "remote" : "local");
    if (dc->remote) cJSON_AddStringToObject(o, "prefill_node", pl->pn[dc->best].node_id);
    else cJSON_AddNullToObject(o, "prefill_node");
    cJSON_AddNumberToObject(o, "cost_local_s", dc->cost_local_s);
    cJSON_AddNumberToObject(o, "local_own_s", dc->local_own_s);
    cJSON_AddNumberToObject(o, "interference_s", dc->interference_s);
    cJSON_AddNumberToObject(o, "predicted_ttft_s", dc->ttft_s);
    cJSON_AddNumberToObject(o, "d_running_seqs", (double)pl->dn.running_seqs);
    cJSON_AddNumberToObject(o, "d_queued_prefill_tokens", (double)pl->dn.queued_prefill_tokens);
    cJSON_AddNumberToObject(o, "d_prefill_tok_s", dc->d_rate);
    cJSON_AddNumberToObject(o, "d_step_s", dc->d_step_s);
    cJSON_AddNumberToObject(o, "d_uncached_tokens", (double)dc->uncached_local);
    cJSON *arr = cJSON_AddArrayToObject(o, "candidates");
    for (size_t i = 0; arr && i < pl->np; i++) {
        const rtr_place_cand_t *c = &pl->cands[i];
        cJSON *e = cJSON_CreateObject();
        if (!e) break;
        cJSON_AddStringToObject(e, "node", pl->pn[i].node_id);
        cJSON_AddNumberToObject(e, "cost_s", c->cost_s);
        cJSON_AddNumberToObject(e, "queued_prefill_tokens", (double)pl->pn[i].queued_prefill_tokens);
        cJSON_AddNumberToObject(e, "prefill_tok_s", c->rate);
        cJSON_AddNumberToObject(e, "step_s", c->step_s);
        cJSON_AddNumberToObject(e, "uncached_tokens", (double)c->uncached_tokens);
        cJSON_AddNumberToObject(e, "transfer_s", c->transfer_s);
        cJSON_AddItemToArray(arr, e);
    }
    cJSON_AddStringToObject(o, "reason", dc->reason);
    char *txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!txt) return;
    size_t len = strlen(txt);
    char *line = malloc(len + 2);
    if (line) {
        memcpy(line, txt, len);
        line[len] = '\n';
        /* a failed or short write only loses a log line: never worth failing a request for */
        if (write(d->log_fd, line, len + 1) < 0) BT_DEBUG("router", "decision log write: %s", strerror(errno));
        free(line);
    }
    cJSON_free(txt);
}

/* Keeps the candidates idx[k] that are fit (node_unfit, strict), in order, unless none is: then all stay (the last
 * view is the best there is). Returns the new count; under d->mu. */
static size_t keep_fit(rtr_dispatch_t *d, const mbr_node_t *nodes, size_t *idx, size_t k, int64_t confirmed)
{
    int64_t now = mono_ms();
    size_t fit = 0;
    char why[256];
    size_t off = 0;
    why[0] = '\0';
    for (size_t i = 0; i < k; i++) {
        const char *u = node_unfit(d, &nodes[idx[i]], now, confirmed, 1);
        if (!u) idx[fit++] = idx[i];
        else if (off < sizeof why) {
            int w = snprintf(why + off, sizeof why - off, "%s%s: %s", off ? "; " : "", nodes[idx[i]].info.node_id, u);
            if (w > 0) off += (size_t)w;
        }
    }
    if (!fit && now - d->last_unfit_log_ms >= 1000) { /* at most once a second */
        d->last_unfit_log_ms = now;
        BT_WARN("router", "no decode node looks fit (%s); using the last view", why);
    }
    return fit ? fit : k; /* with none fit nothing was overwritten */
}

/* The power of two choices among the usable decode nodes nodes[idx[0..k-1]] (k > 0), fit ones first: an index into
 * nodes. */
static size_t choose_decode(rtr_dispatch_t *d, const mbr_node_t *nodes, size_t *idx, size_t k)
{
    int64_t confirmed = mbr_watcher_confirmed_ms(d->watcher);
    pthread_mutex_lock(&d->mu);
    k = keep_fit(d, nodes, idx, k, confirmed);
    size_t a = idx[next_rand(d) % k], b = a;
    if (k > 1) {
        size_t j = next_rand(d) % (k - 1);
        b = idx[j];
        if (b == a) b = idx[k - 1];
        if (score(d, &nodes[b]) > score(d, &nodes[a])) a = b;
    }
    pthread_mutex_unlock(&d->mu);
    return a;
}

/* A snapshot of the view (*nodes[*n], the caller frees it with mbr_nodes_free) and the decode node chosen in it
 * (*a), never one in ex. BT_ERR_UNAVAILABLE (nothing to free) when no usable decode node is left. */
static bt_status snapshot_choose(rtr_dispatch_t *d, const rtr_exclude_t *ex, mbr_node_t **nodes, size_t *n, size_t *a)
{
    bt_status st = mbr_watcher_snapshot(d->watcher, nodes, n);
    if (st) return st;
    size_t idx[MAX_TRACKED];
    size_t k = 0;
    for (size_t i = 0; i < *n && k < MAX_TRACKED; i++)
        if (usable(d, &(*nodes)[i]) && !rtr_exclude_has(ex, (*nodes)[i].info.node_id)) idx[k++] = i;
    if (!k) {
        mbr_nodes_free(*nodes, *n);
        return bt_fail(BT_ERR_UNAVAILABLE, ex->n ? "no healthy decode node left" : "no healthy decode node");
    }
    *a = choose_decode(d, *nodes, idx, k);
    return BT_OK;
}

/* Picks a decode node, places the prefill, counts the call in flight and the prefill as pending, and remembers the
 * prompt's blocks on the nodes that will hold them. BT_ERR_UNAVAILABLE when no decode node is left. */
static bt_status pick(rtr_dispatch_t *d, const rtr_exclude_t *ex, const plan_req_t *rq, picked_t *out)
{
    mbr_node_t *nodes;
    size_t n, a;
    bt_status st = snapshot_choose(d, ex, &nodes, &n, &a);
    if (st) return st;

    plan_t *pl = malloc(sizeof *pl); /* ~10 KiB: kept off the choice thread's small stack */
    if (!pl) {
        mbr_nodes_free(nodes, n);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    pl->di = a;
    pl->np = prefill_nodes(d, nodes, n, rq, pl->pidx);
    place(d, nodes, rq, pl);
    const mbr_node_t *dn = &nodes[a];
    const mbr_node_t *pn = pl->dec.remote ? &nodes[pl->pidx[pl->dec.best]] : NULL;

    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&d->mu);
    node_slot_t *s = slot_get(d, &dn->info, 1);
    node_slot_t *ps = s && pn ? slot_get(d, &pn->info, 0) : NULL;
    if (s) {
        s->inflight++;
        out->slot = s;
        out->step_s = dn->has_load ? dn->load.step_s : 0;
        out->remote = ps != NULL; /* no slot for P (table full): local is always safe */
        out->pending_slot = out->remote ? ps : s;
        out->pending = out->remote ? pl->cands[pl->dec.best].uncached_tokens : pl->dec.uncached_local;
        out->pending_slot->pending_prefill += out->pending;
    }
    pthread_mutex_unlock(&d->mu);
    if (s) {
        snprintf(out->fingerprint, sizeof out->fingerprint, "%s", dn->info.model);
        if (out->remote) {
            snprintf(out->prefill_id, sizeof out->prefill_id, "%s", pn->info.node_id);
            snprintf(out->prefill_addr, sizeof out->prefill_addr, "%s", pn->info.grpc_addr);
            rtr_pindex_insert(d->pindex, pn->info.node_id, pn->info.started_ms, pn->info.kv_blocks_total, rq->hashes,
                              rq->n_hashes);
        }
        /* D holds the blocks either way: it computed them, or P pushed them into its pool */
        rtr_pindex_insert(d->pindex, dn->info.node_id, dn->info.started_ms, dn->info.kv_blocks_total, rq->hashes,
                          rq->n_hashes);
        if (pl->dec.remote && !out->remote) {
            pl->dec.remote = 0;
            pl->dec.reason = "prefill node table full: local";
        }
        metrics_counter_inc(out->remote ? d->decisions_remote : d->decisions_local);
        metrics_histogram_observe(d->predicted_ttft, out->remote ? pl->dec.ttft_s : pl->dec.local_own_s);
        log_debug(rq, pl);
        log_json(d, rq, pl);
    }
    free(pl);
    mbr_nodes_free(nodes, n);
    return s ? BT_OK : bt_fail(BT_ERR_NOMEM, "cannot open a channel to a decode node");
}

/* The prefilling node answered (first token) or the attempt ended: our tokens are no longer queued there. */
static void settle(rtr_dispatch_t *d, picked_t *p)
{
    if (!p->pending) return;
    pthread_mutex_lock(&d->mu);
    p->pending_slot->pending_prefill -= p->pending;
    pthread_mutex_unlock(&d->mu);
    p->pending = 0;
}

static void unpick(rtr_dispatch_t *d, picked_t *p)
{
    settle(d, p);
    pthread_mutex_lock(&d->mu);
    p->slot->inflight--;
    pthread_mutex_unlock(&d->mu);
}

/* The prompt's block hashes as the wire carries them (low 64 bits of each bt_prefix_hash). *out is malloc'd; NULL
 * with *n = 0 for a prompt shorter than one block. BT_ERR_NOMEM. */
static bt_status hash_prompt(const rtr_dispatch_t *d, const int32_t *prompt, size_t n_prompt, uint64_t **out,
                             size_t *n)
{
    *out = NULL;
    *n = 0;
    size_t nb = n_prompt / BT_PREFIX_HASH_BLOCK;
    if (!nb || n_prompt > INT32_MAX) return BT_OK;
    bt_prefix_hash *h = malloc(nb * sizeof *h);
    uint64_t *lo = malloc(nb * sizeof *lo);
    if (!h || !lo) {
        free(h);
        free(lo);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    bt_prefix_hash_blocks(BT_PREFIX_HASH_ROOT, prompt, (int32_t)n_prompt, d->fingerprint_u64, h);
    for (size_t i = 0; i < nb; i++) lo[i] = h[i].lo;
    free(h);
    *out = lo;
    *n = nb;
    return BT_OK;
}

bt_status rtr_dispatch_predict_ttft(rtr_dispatch_t *d, const int32_t *prompt, size_t n_prompt, double *ttft_s)
{
    uint64_t *h;
    size_t nh;
    bt_status st = hash_prompt(d, prompt, n_prompt, &h, &nh);
    if (st) return st;
    mbr_node_t *nodes;
    size_t n;
    if ((st = mbr_watcher_snapshot(d->watcher, &nodes, &n))) {
        free(h);
        return st;
    }
    plan_t *pl = malloc(sizeof *pl);
    if (!pl) {
        free(h);
        mbr_nodes_free(nodes, n);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    plan_req_t rq = {.request_id = "", .n_tokens = (int64_t)n_prompt, .hashes = h, .n_hashes = nh};
    pl->np = prefill_nodes(d, nodes, n, &rq, pl->pidx);
    double best = INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (!usable(d, &nodes[i])) continue;
        pl->di = i;
        place(d, nodes, &rq, pl);
        if (pl->dec.best_ttft_s < best) best = pl->dec.best_ttft_s;
    }
    free(pl);
    free(h);
    mbr_nodes_free(nodes, n);
    if (best == INFINITY) return bt_fail(BT_ERR_UNAVAILABLE, "no healthy decode node");
    *ttft_s = best;
    return BT_OK;
}

void rtr_dispatch_rates(rtr_dispatch_t *d, rtr_cluster_rates_t *out)
{
    memset(out, 0, sizeof *out);
    mbr_node_t *nodes;
    size_t n;
    if (mbr_watcher_snapshot(d->watcher, &nodes, &n)) return;
    double p_sum = 0, dp_sum = 0, dd_sum = 0;
    int p_n = 0, dp_n = 0, dd_n = 0;
    double pf[2][2] = {{0}}, df[2] = {0}; /* [prefill nodes, decode nodes][fixed, token] sums; decode fit sums */
    int pf_n[2] = {0}, df_n = 0;
    for (size_t i = 0; i < n; i++) {
        const mbr_node_t *x = &nodes[i];
        int role = usable_role(d, x, MBR_ROLE_PREFILL) ? 0 : usable(d, x) ? 1 : -1;
        if (role < 0) continue;
        if (x->has_load && x->load.step_token_s > 0) {
            pf[role][0] += x->load.step_fixed_s;
            pf[role][1] += x->load.step_token_s;
            pf_n[role]++;
        }
        if (role == 0) {
            out->n_prefill++;
            if (x->has_load && x->load.prefill_tok_s > 0) p_sum += x->load.prefill_tok_s, p_n++;
        } else {
            out->n_decode++;
            if (x->has_load && x->load.prefill_tok_s > 0) dp_sum += x->load.prefill_tok_s, dp_n++;
            if (x->has_load && x->load.decode_tok_s > 0) dd_sum += x->load.decode_tok_s, dd_n++;
            if (x->has_load && x->load.decode_fixed_s > 0) {
                df[0] += x->load.decode_fixed_s;
                df[1] += x->load.decode_row_s;
                df_n++;
            }
        }
    }
    int pr = out->n_prefill ? 0 : 1;
    if (pf_n[pr]) {
        out->prefill_fixed_s = pf[pr][0] / pf_n[pr];
        out->prefill_token_s = pf[pr][1] / pf_n[pr];
    }
    if (df_n) {
        out->decode_fixed_s = df[0] / df_n;
        out->decode_row_s = df[1] / df_n;
    }
    /* without prefill nodes the decode nodes prefill: theirs is the rate that serves the prompts */
    out->prefill_tok_s = out->n_prefill ? (p_n ? p_sum / p_n : 0) : (dp_n ? dp_sum / dp_n : 0);
    out->decode_tok_s = dd_n ? dd_sum / dd_n : 0;
    mbr_nodes_free(nodes, n);
}

/* Codes after which another node may do better: the node died, restarted, shed the request or serves another
 * model (FAILED_PRECONDITION: fingerprint mismatch). */
static int retryable(bt_rpc_code c)
{
    return c == BT_RPC_UNAVAILABLE || c == BT_RPC_FAILED_PRECONDITION || c == BT_RPC_INTERNAL ||
           c == BT_RPC_UNKNOWN || c == BT_RPC_ABORTED || c == BT_RPC_CANCELLED || c == BT_RPC_RESOURCE_EXHAUSTED ||
           c == BT_RPC_DATA_LOSS;
}

/* One request's way through its attempts: what was delivered so far and which nodes failed it. */
typedef struct run_state {
    rtr_dispatch_t *d;
    const Baton__V1__DecodeRunRequest *tmpl;
    const rtr_run_ops_t *ops;
    rtr_run_result_t *res;
    rtr_exclude_t ex;
    int32_t *done; /* tokens delivered so far */
    size_t n_done, cap_done;
    uint64_t *hashes; /* computed here when the caller sent none */
    const uint64_t *hv;
    size_t n_hashes;
    int64_t deadline_ms; /* monotonic; 0 = none */
} run_state_t;

/* How one attempt on one decode node ended. */
typedef struct attempt {
    int finished, stopped, cancelled;
    int moved;          /* abandoned by this router: the node left or stalled (rr says why) */
    int got_token;      /* counted in the slot's decoding streams */
    int64_t last_ms;    /* monotonic: the last token, or the open */
    bt_status st;       /* the stream's: BT_OK while it delivers, BT_ERR_PEER when the node skipped tokens */
    bt_status err;      /* this router's own failure (out of memory) */
    bt_rpc_result_t rr; /* the node's result when the stream failed */
} attempt_t;

/* Opens Decode/Run on the picked node with the prompt, the tokens already delivered and the prefill hint. */
static bt_status attempt_open(run_state_t *r, const picked_t *p, bt_rpc_stream_t **s)
{
    Baton__V1__DecodeRunRequest req = *r->tmpl;
    req.model_fingerprint = (char *)p->fingerprint;
    req.generated_token_ids = r->done;
    req.n_generated_token_ids = r->n_done;
    req.block_hashes = (uint64_t *)r->hv;
    req.n_block_hashes = r->n_hashes;
    Baton__V1__PrefillHint hint = BATON__V1__PREFILL_HINT__INIT;
    req.prefill = NULL;
    if (p->remote) {
        hint.node_id = (char *)p->prefill_id;
        hint.grpc_address = (char *)p->prefill_addr;
        req.prefill = &hint;
    }
    int timeout_ms = 0;
    if (r->deadline_ms) {
        int64_t left = r->deadline_ms - mono_ms();
        timeout_ms = left < 1 ? 1 : left > INT32_MAX ? INT32_MAX : (int)left;
    }
    return bt_rpc_stream_open(p->slot->ch, "/baton.v1.Decode/Run", &req.base,
                              &baton__v1__decode_run_response__descriptor, timeout_ms, NULL, s);
}

/* Appends n delivered tokens. BT_ERR_NOMEM. */
static bt_status keep_tokens(run_state_t *r, const int32_t *ids, size_t n)
{
    if (r->n_done + n > r->cap_done) {
        size_t c = r->cap_done ? r->cap_done * 2 : 256;
        while (c < r->n_done + n) c *= 2;
        int32_t *q = realloc(r->done, c * sizeof *q);
        if (!q) return bt_fail(BT_ERR_NOMEM, "out of memory");
        r->done = q;
        r->cap_done = c;
    }
    memcpy(r->done + r->n_done, ids, n * sizeof *ids);
    r->n_done += n;
    return BT_OK;
}

/* Tokens came from the picked node: it lives, and this stream decodes there. */
static void note_token(rtr_dispatch_t *d, picked_t *p, attempt_t *a)
{
    a->last_ms = mono_ms();
    pthread_mutex_lock(&d->mu);
    if (!a->got_token) p->slot->decoding++;
    a->got_token = 1;
    p->slot->last_token_ms = a->last_ms;
    p->slot->suspect_ms = 0;
    pthread_mutex_unlock(&d->mu);
}

/* Why the picked node is unfit for a stream still waiting for its first token (node_unfit, not strict), or NULL.
 * Waiting is normal on a busy node: only an unfit one makes it move. */
static const char *waiting_unfit(rtr_dispatch_t *d, const picked_t *p, int64_t now)
{
    mbr_node_t n;
    if (mbr_watcher_get(d->watcher, p->slot->node_id, &n) != BT_OK) return "left the cluster";
    int64_t confirmed = mbr_watcher_confirmed_ms(d->watcher);
    pthread_mutex_lock(&d->mu);
    const char *u = n.info.started_ms == p->slot->started_ms ? node_unfit(d, &n, now, confirmed, 0) : "restarted";
    pthread_mutex_unlock(&d->mu);
    mbr_node_info_free(&n.info);
    return u;
}

/* 1 when a stream that has waited on the picked node since a->last_ms should move, with why[cap] saying why (see
 * the opening comment). A stall of the whole node also makes it suspect. */
static int should_move(rtr_dispatch_t *d, picked_t *p, const attempt_t *a, char *why, size_t cap)
{
    int64_t now = mono_ms(), quiet = now - a->last_ms, bound = rtr_stall_bound_ms(d->stall_ms, p->step_s);
    pthread_mutex_lock(&d->mu);
    int gone = p->slot->gone;
    pthread_mutex_unlock(&d->mu);
    if (gone) {
        snprintf(why, cap, "the node left the cluster");
        return 1;
    }
    if (d->stall_ms <= 0 || quiet <= bound) return 0;
    if (!a->got_token) {
        const char *u = waiting_unfit(d, p, now);
        if (u) snprintf(why, cap, "no first token after %.1f s from a node that %s", quiet / 1000.0, u);
        return u != NULL;
    }
    /* only when the whole node went quiet: a stream preempted on a busy node waits while its neighbours decode */
    pthread_mutex_lock(&d->mu);
    int64_t node_quiet = now - p->slot->last_token_ms;
    if (node_quiet > bound) p->slot->suspect_ms = now;
    pthread_mutex_unlock(&d->mu);
    if (node_quiet <= bound) return 0;
    snprintf(why, cap, "no token from the node for %.1f s (stall bound %.1f s)", node_quiet / 1000.0, bound / 1000.0);
    return 1;
}

/* Abandons the attempt when should_move says so: 1 when it did. */
static int attempt_check(run_state_t *r, picked_t *p, attempt_t *a)
{
    char why[160];
    if (!should_move(r->d, p, a, why, sizeof why)) return 0;
    a->moved = 1;
    a->st = BT_ERR_UNAVAILABLE;
    a->rr.code = BT_RPC_UNAVAILABLE;
    snprintf(a->rr.message, sizeof a->rr.message, "%s", why);
    return 1;
}

/* Takes one response: tokens past what was delivered go to the client (placed by offset, so a migrated stream
 * neither repeats nor skips), a finish reason ends the attempt. Returns 1 when the attempt is over. */
static int take_response(run_state_t *r, picked_t *p, const Baton__V1__DecodeRunResponse *m, attempt_t *a)
{
    size_t off = m->offset;
    if (off > r->n_done) { /* a gap cannot be filled: a failure of this node */
        a->rr.code = BT_RPC_DATA_LOSS;
        snprintf(a->rr.message, sizeof a->rr.message, "node skipped tokens %zu..%zu", r->n_done, off);
        a->st = BT_ERR_PEER;
        return 1;
    }
    if (m->n_token_ids) {
        settle(r->d, p); /* the first token means the prefill is done */
        note_token(r->d, p, a);
    }
    size_t skip = r->n_done - off;
    if (skip < m->n_token_ids) {
        size_t nn = m->n_token_ids - skip;
        if ((a->err = keep_tokens(r, m->token_ids + skip, nn)) != BT_OK) {
            a->cancelled = 1;
            return 1;
        }
        Baton__V1__TokenLogprob *const *lps = m->n_logprobs > skip ? m->logprobs + skip : NULL;
        size_t n_lps = m->n_logprobs > skip ? m->n_logprobs - skip : 0;
        if (r->ops->on_tokens(r->ops->ud, m->token_ids + skip, nn, lps, n_lps)) a->stopped = 1;
    }
    if (m->finish_reason != BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) {
        r->res->finish = m->finish_reason;
        if (m->usage) r->res->cached_prompt_tokens = m->usage->cached_prompt_tokens;
        a->finished = 1;
    }
    return a->stopped || a->finished;
}

/* Reads the stream until it ends, fails, the client goes away or on_tokens says stop. */
static void attempt_read(run_state_t *r, picked_t *p, bt_rpc_stream_t *s, attempt_t *a)
{
    for (;;) {
        if (r->ops->cancelled && r->ops->cancelled(r->ops->ud)) {
            a->cancelled = 1;
            return;
        }
        ProtobufCMessage *m = NULL;
        int ready = 0;
        a->st = bt_rpc_stream_next_wait(s, POLL_MS, &m, &ready);
        if (a->st == BT_OK && !ready) {
            if (attempt_check(r, p, a)) return;
            continue;
        }
        if (a->st != BT_OK || !m) {
            bt_rpc_stream_result(s, &a->rr);
            if (a->st == BT_OK && !a->finished) { /* ended OK without a finish reason: treat as a stop */
                r->res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_STOP;
                a->finished = 1;
            }
            if (a->st != BT_OK && a->rr.code == BT_RPC_OK) a->rr.code = bt_rpc_code_from_status(a->st);
            return;
        }
        int over = take_response(r, p, (const Baton__V1__DecodeRunResponse *)m, a);
        protobuf_c_message_free_unpacked(m, NULL);
        if (over || attempt_check(r, p, a)) return;
    }
}

/* Runs one attempt on the picked node, from opening the stream to closing it. BT_OK, or the open's error. */
static bt_status attempt_run(run_state_t *r, picked_t *p, attempt_t *a)
{
    memset(a, 0, sizeof *a);
    a->last_ms = mono_ms();
    bt_rpc_stream_t *s = NULL;
    bt_status st = attempt_open(r, p, &s);
    if (st) {
        unpick(r->d, p);
        r->res->code = BT_RPC_INTERNAL;
        snprintf(r->res->message, sizeof r->res->message, "%s", bt_last_error());
        return st;
    }
    attempt_read(r, p, s, a);
    if (a->stopped || a->cancelled || a->moved || (!a->finished && a->st == BT_OK)) bt_rpc_stream_cancel(s);
    bt_rpc_stream_close(s);
    if (a->got_token) {
        pthread_mutex_lock(&r->d->mu);
        p->slot->decoding--;
        pthread_mutex_unlock(&r->d->mu);
    }
    unpick(r->d, p);
    return BT_OK;
}

/* After an attempt: 1 when the request is over (*ret says how), 0 to migrate to another node. */
static int attempt_settle(run_state_t *r, const picked_t *p, const attempt_t *a, int attempt, bt_status *ret)
{
    rtr_run_result_t *res = r->res;
    *ret = a->err;
    if (a->stopped) {
        res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
        return 1;
    }
    if (a->cancelled) {
        if (*ret == BT_OK) *ret = bt_fail(BT_ERR_CANCELLED, "client went away");
        res->code = BT_RPC_CANCELLED;
        return 1;
    }
    if (a->finished) return 1;
    if (r->tmpl->max_tokens && r->n_done >= r->tmpl->max_tokens) { /* it died after the last token: nothing left */
        res->finish = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        return 1;
    }
    BT_WARN("router", "request %s: decode node %s failed after %zu tokens: %s %s", r->tmpl->request_id,
            p->slot->node_id, r->n_done, bt_rpc_code_str(a->rr.code), a->rr.message);
    res->code = a->rr.code;
    snprintf(res->message, sizeof res->message, "decode node %.60s: %.180s", p->slot->node_id, a->rr.message);
    if (!retryable(a->rr.code) || attempt >= r->d->max_migrations ||
        rtr_exclude_add(&r->ex, p->slot->node_id) != BT_OK) {
        *ret = bt_rpc_status_from_code(a->rr.code);
        if (*ret == BT_OK) *ret = BT_ERR_PEER;
        return 1;
    }
    return 0;
}

/* Picks the node of this attempt, never one that failed the request before. BT_ERR_UNAVAILABLE when none is left. */
static bt_status attempt_pick(run_state_t *r, int attempt, picked_t *p)
{
    plan_req_t rq = {.request_id = r->tmpl->request_id,
                     .n_tokens = (int64_t)(r->tmpl->n_prompt_token_ids + r->n_done), .hashes = r->hv,
                     .n_hashes = r->n_hashes};
    if (pick(r->d, &r->ex, &rq, p)) {
        r->res->code = BT_RPC_UNAVAILABLE;
        snprintf(r->res->message, sizeof r->res->message, "%s",
                 r->ex.n ? "no healthy decode node left" : bt_last_error());
        return BT_ERR_UNAVAILABLE;
    }
    if (attempt > 0) {
        r->res->migrations++;
        metrics_counter_inc(r->d->migrations);
        BT_INFO("router", "request %s: continuing on node %s after %zu tokens (attempt %d)", r->tmpl->request_id,
                p->slot->node_id, r->n_done, attempt + 1);
    }
    return BT_OK;
}

bt_status rtr_dispatch_run(rtr_dispatch_t *d, const Baton__V1__DecodeRunRequest *tmpl, const rtr_run_ops_t *ops,
                           rtr_run_result_t *res)
{
    memset(res, 0, sizeof *res);
    run_state_t r = {.d = d, .tmpl = tmpl, .ops = ops, .res = res, .n_hashes = tmpl->n_block_hashes};
    bt_status ret = BT_OK;
    if (!r.n_hashes &&
        (ret = hash_prompt(d, tmpl->prompt_token_ids, tmpl->n_prompt_token_ids, &r.hashes, &r.n_hashes))) {
        res->code = BT_RPC_RESOURCE_EXHAUSTED;
        snprintf(res->message, sizeof res->message, "%s", bt_last_error());
        return ret;
    }
    r.hv = r.hashes ? r.hashes : tmpl->block_hashes;
    /* the shorter of the client's own deadline (gRPC) and the router's --request-timeout-s */
    int timeout_ms = d->request_timeout_ms;
    if (ops->timeout_ms > 0 && (timeout_ms <= 0 || ops->timeout_ms < timeout_ms)) timeout_ms = ops->timeout_ms;
    if (timeout_ms > 0) r.deadline_ms = mono_ms() + timeout_ms;
    for (int attempt = 0;; attempt++) {
        picked_t p;
        attempt_t a;
        if (r.deadline_ms && mono_ms() >= r.deadline_ms) {
            res->code = BT_RPC_DEADLINE_EXCEEDED;
            snprintf(res->message, sizeof res->message, "request deadline (%d ms) passed", timeout_ms);
            ret = bt_fail(BT_ERR_TIMEOUT, "%s", res->message);
            break;
        }
        if ((ret = attempt_pick(&r, attempt, &p)) != BT_OK) break;
        if ((ret = attempt_run(&r, &p, &a)) != BT_OK) break;
        if (attempt_settle(&r, &p, &a, attempt, &ret)) break;
    }
    if (ret == BT_OK) {
        res->code = BT_RPC_OK;
        res->message[0] = '\0';
    }
    rtr_exclude_free(&r.ex);
    free(r.done);
    free(r.hashes);
    return ret;
}

/* ---- embeddings ---- */

/* A decode node for one Embed attempt, never one in ex: its slot (call counted in flight; undo with unpick) and its
 * model fingerprint. BT_ERR_UNAVAILABLE when none is left. */
static bt_status pick_embed(rtr_dispatch_t *d, const rtr_exclude_t *ex, picked_t *out)
{
    mbr_node_t *nodes;
    size_t n, a;
    bt_status st = snapshot_choose(d, ex, &nodes, &n, &a);
    if (st) return st;
    const mbr_node_t *dn = &nodes[a];
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&d->mu);
    node_slot_t *s = slot_get(d, &dn->info, 1);
    if (s) s->inflight++;
    pthread_mutex_unlock(&d->mu);
    if (s) {
        out->slot = s;
        snprintf(out->fingerprint, sizeof out->fingerprint, "%s", dn->info.model);
    }
    mbr_nodes_free(nodes, n);
    return s ? BT_OK : bt_fail(BT_ERR_NOMEM, "cannot open a channel to a decode node");
}

#define EMBED_POLL_MS 100 /* how often an Embed call in flight asks whether its client is still there */

/* Decode/Embed as a cancellable call (the wire format of a unary call, as decode's call_prefill): when cancelled()
 * says the client left, the call is cancelled, so the node aborts the inputs at once. Returns as bt_rpc_unary does;
 * BT_ERR_CANCELLED with res->code CANCELLED when the client left. */
static bt_status embed_call(bt_rpc_channel_t *ch, const Baton__V1__DecodeEmbedRequest *req, int timeout_ms,
                            int (*cancelled)(void *), void *ud, ProtobufCMessage **out, bt_rpc_result_t *res)
{
    bt_rpc_stream_t *rs = NULL;
    bt_status st = bt_rpc_stream_open(ch, "/baton.v1.Decode/Embed", &req->base,
                                      &baton__v1__decode_embed_response__descriptor, timeout_ms, NULL, &rs);
    if (st != BT_OK) {
        res->code = BT_RPC_INTERNAL;
        snprintf(res->message, sizeof res->message, "%s", bt_last_error());
        return st;
    }
    ProtobufCMessage *m = NULL, *first = NULL;
    int left = 0;
    for (;;) {
        int ready = 0;
        st = bt_rpc_stream_next_wait(rs, EMBED_POLL_MS, &m, &ready);
        if (st != BT_OK) break;
        if (!ready) {
            if (!left && cancelled && cancelled(ud)) {
                left = 1;
                bt_rpc_stream_cancel(rs);
            }
            continue;
        }
        if (!m) break;
        if (first) protobuf_c_message_free_unpacked(m, NULL);
        else first = m;
    }
    if (bt_rpc_stream_result(rs, res) != BT_OK) {
        res->code = BT_RPC_INTERNAL;
        snprintf(res->message, sizeof res->message, "no result");
    }
    bt_rpc_stream_close(rs);
    if (left) {
        res->code = BT_RPC_CANCELLED;
        snprintf(res->message, sizeof res->message, "the client went away");
        st = bt_fail(BT_ERR_CANCELLED, "%s", res->message);
    } else if (st == BT_OK && !first) {
        res->code = BT_RPC_INTERNAL;
        snprintf(res->message, sizeof res->message, "the decode node answered nothing");
        st = bt_fail(BT_ERR_FORMAT, "%s", res->message);
    } else if (st != BT_OK) {
        bt_fail(st, "%s: %s", bt_rpc_code_str(res->code), res->message);
    }
    if (st != BT_OK) {
        if (first) protobuf_c_message_free_unpacked(first, NULL);
        return st;
    }
    *out = first;
    return BT_OK;
}

bt_status rtr_dispatch_embed(rtr_dispatch_t *d, const Baton__V1__DecodeEmbedRequest *tmpl, int timeout_ms,
                             int (*cancelled)(void *), void *ud, Baton__V1__DecodeEmbedResponse **out,
                             bt_rpc_result_t *res)
{
    memset(res, 0, sizeof *res);
    rtr_exclude_t ex = {0};
    if (d->request_timeout_ms > 0 && (timeout_ms <= 0 || d->request_timeout_ms < timeout_ms))
        timeout_ms = d->request_timeout_ms;
    int64_t deadline = timeout_ms > 0 ? mono_ms() + timeout_ms : 0;
    bt_status st = BT_OK;
    for (int attempt = 0;; attempt++) {
        int left = 0;
        if (deadline) {
            int64_t l = deadline - mono_ms();
            if (l <= 0) {
                res->code = BT_RPC_DEADLINE_EXCEEDED;
                snprintf(res->message, sizeof res->message, "request deadline (%d ms) passed", timeout_ms);
                st = bt_fail(BT_ERR_TIMEOUT, "%s", res->message);
                break;
            }
            left = l > INT32_MAX ? INT32_MAX : (int)l;
        }
        picked_t p;
        if ((st = pick_embed(d, &ex, &p)) != BT_OK) {
            res->code = BT_RPC_UNAVAILABLE;
            snprintf(res->message, sizeof res->message, "%s", bt_last_error());
            st = BT_ERR_UNAVAILABLE;
            break;
        }
        Baton__V1__DecodeEmbedRequest req = *tmpl;
        req.model_fingerprint = p.fingerprint;
        ProtobufCMessage *resp = NULL;
        st = embed_call(p.slot->ch, &req, left, cancelled, ud, &resp, res);
        unpick(d, &p);
        if (st == BT_OK) {
            *out = (Baton__V1__DecodeEmbedResponse *)resp;
            break;
        }
        if (st == BT_ERR_CANCELLED && res->code == BT_RPC_CANCELLED) {
            BT_INFO("router", "embeddings %s: the client went away; cancelled on decode node %s", tmpl->request_id,
                    p.slot->node_id);
            break;
        }
        BT_WARN("router", "embeddings %s: decode node %s failed: %s %s", tmpl->request_id, p.slot->node_id,
                bt_rpc_code_str(res->code), res->message);
        if (!retryable(res->code) || res->code == BT_RPC_CANCELLED || attempt >= d->max_migrations ||
            rtr_exclude_add(&ex, p.slot->node_id) != BT_OK)
            break;
    }
    rtr_exclude_free(&ex);
    return st;
}
