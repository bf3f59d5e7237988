/* kvx_peer: one endpoint (PEER error mode) and one unpacked rkey per remote pool, cached by node id and
 * rebuilt after a failure or when the remote's descriptor changes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

static void peer_free(kvx_peer_t *peer)
{
    kvx_context_t *ctx = peer->ctx;
    ctx->stats.live_peers--;
    free(peer->desc);
    free(peer);
}

void kvx_peer_unref(kvx_peer_t *peer)
{
    if (--peer->refs == 0) peer_free(peer);
}

/* Bytes from addr to the end of the mapping that holds it, following directly adjacent mappings of the same
 * object (/proc/self/maps); 0 when addr is not mapped or the table cannot be read. */
static uint64_t mapping_extent(const void *addr)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return 0;
    uint64_t a = (uint64_t)(uintptr_t)addr, end = 0, dev_ino = 0;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, off, ino;
        unsigned maj, mnr;
        char perms[8];
        if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &off, &maj, &mnr, &ino) != 7) continue;
        uint64_t id = ((uint64_t)maj << 48) ^ ((uint64_t)mnr << 32) ^ ino;
        if (!end) {
            if (a >= lo && a < hi) end = hi, dev_ino = id;
        } else if (lo == end && id == dev_ino && ino) {
            end = hi;
        } else {
            break;
        }
    }
    fclose(f);
    return end ? end - a : 0;
}

/* Runs inside ucp_worker_progress (mu held). */
static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kvx_peer_t *peer = arg;
    char why[96];
    snprintf(why, sizeof why, "UCX endpoint error: %s", ucs_status_string(status));
    kvx_peer_fail(peer, BT_ERR_PEER, why);
}

void kvx_peer_fail(kvx_peer_t *peer, bt_status st, const char *why)
{
    kvx_context_t *ctx = peer->ctx;
    if (peer->failed) return;
    peer->failed = 1;
    snprintf(peer->err, sizeof peer->err, "peer %llu: %s", (unsigned long long)peer->node_id, why);
    if (st == BT_ERR_CANCELLED)
        BT_DEBUG("kvx", "%s: %s", ctx->name, peer->err);
    else
        BT_WARN("kvx", "%s: %s", ctx->name, peer->err);
    if (peer->cached) {
        for (kvx_peer_t **pp = &ctx->peers; *pp; pp = &(*pp)->next) {
            if (*pp == peer) {
                *pp = peer->next;
                break;
            }
        }
        ctx->n_peers--;
        peer->cached = 0; /* the cache's reference now belongs to the dead list */
    } else {
        peer->refs++;
    }
    peer->next = ctx->dead;
    ctx->dead = peer;
    BT_LIST_FOR(p, &ctx->pushes, kvx_push_t, link)
        if (p->peer == peer && p->state != KVX_PUSH_DONE) kvx_push_finish(p, st, "kvx: %s", peer->err);
    BT_LIST_FOR(e, &ctx->expects, kvx_expect_t, link)
        if (e->sender == peer && !e->done) kvx_expect_finish(e, st, "kvx: sender %s", peer->err);
    kvx_kick(ctx);
}

void kvx_peers_reap(kvx_context_t *ctx)
{
    kvx_peer_t *busy = NULL; /* a memcpy into their mapping is still running: next round */
    while (ctx->dead) {
        kvx_peer_t *peer = ctx->dead;
        ctx->dead = peer->next;
        if (peer->copying) {
            peer->next = busy;
            busy = peer;
            continue;
        }
        peer->next = NULL;
        peer->mapped = NULL;
        if (peer->rkey) {
            ucp_rkey_destroy(peer->rkey); /* before the endpoint closes */
            peer->rkey = NULL;
            ctx->stats.live_rkeys--;
        }
        if (!peer->ep) {
            kvx_peer_unref(peer);
            continue;
        }
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
        void *req = ucp_ep_close_nbx(peer->ep, &rp);
        peer->ep = NULL;
        if (req && !UCS_PTR_IS_ERR(req)) {
            kvx_closing_t *c = malloc(sizeof *c);
            if (c) {
                *c = (kvx_closing_t){.next = ctx->closing, .req = req, .peer = peer};
                ctx->closing = c;
                continue;
            }
            /* No memory to track it: let UCX finish on its own. */
            ucp_request_free(req);
        }
        ctx->stats.live_eps--;
        kvx_peer_unref(peer);
    }
    ctx->dead = busy;
    for (kvx_closing_t **cp = &ctx->closing; *cp;) {
        kvx_closing_t *c = *cp;
        if (ucp_request_check_status(c->req) == UCS_INPROGRESS) {
            cp = &c->next;
            continue;
        }
        ucp_request_free(c->req);
        *cp = c->next;
        ctx->stats.live_eps--;
        kvx_peer_unref(c->peer);
        free(c);
    }
}

/* Keeps the cache under max_peers before one more peer joins it: closes the least recently used peer that only the
 * cache holds. BT_ERR_EXHAUSTED when every cached peer is in use. mu held. */
static bt_status make_room(kvx_context_t *ctx)
{
    if (ctx->n_peers < ctx->max_peers) return BT_OK;
    kvx_peer_t *victim = NULL;
    for (kvx_peer_t *p = ctx->peers; p; p = p->next)
        if (p->refs == 1 && !p->copying) victim = p; /* the last idle one in LRU order */
    if (!victim)
        return bt_fail(BT_ERR_EXHAUSTED, "kvx: all %u cached peers are in use", (unsigned)ctx->max_peers);
    kvx_peer_fail(victim, BT_ERR_CANCELLED, "closed to make room in the peer cache");
    ctx->stats.peers_evicted++;
    return BT_OK;
}

bt_status kvx_peer_get(kvx_context_t *ctx, uint64_t node_id, const void *desc, size_t desc_len, kvx_peer_t **out)
{
    bt_status st;
    ucs_status_t us;
    kvx_desc_t d;
    if ((st = kvx_desc_parse(desc, desc_len, &d)) != BT_OK) return st;

    pthread_mutex_lock(&ctx->mu);
    for (kvx_peer_t **pp = &ctx->peers; *pp; pp = &(*pp)->next) {
        kvx_peer_t *peer = *pp;
        if (peer->node_id != node_id) continue;
        if (peer->desc_len == desc_len && !memcmp(peer->desc, desc, desc_len)) {
            *pp = peer->next; /* to the front: the list is in LRU order */
            peer->next = ctx->peers;
            ctx->peers = peer;
            peer->refs++;
            pthread_mutex_unlock(&ctx->mu);
            *out = peer;
            return BT_OK;
        }
        kvx_peer_fail(peer, BT_ERR_PEER, "descriptor changed (node restarted)");
        break;
    }
    if ((st = make_room(ctx)) != BT_OK) goto fail;

    kvx_peer_t *peer = calloc(1, sizeof *peer);
    if (!peer) {
        st = bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
        goto fail;
    }
    peer->ctx = ctx;
    peer->node_id = node_id;
    peer->desc_len = desc_len;
    peer->desc = malloc(desc_len);
    if (!peer->desc) {
        st = bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
        goto fail_peer;
    }
    memcpy(peer->desc, desc, desc_len);
    kvx_desc_parse(peer->desc, desc_len, &peer->d); /* re-point into our copy; validated above */

    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)peer->d.worker_addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = peer_err_cb, .arg = peer},
    };
    us = ucp_ep_create(ctx->worker, &ep, &peer->ep);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_PEER, "kvx: ucp_ep_create to node %llu: %s", (unsigned long long)node_id,
                     ucs_status_string(us));
        goto fail_desc;
    }
    us = ucp_ep_rkey_unpack(peer->ep, peer->d.rkey, &peer->rkey);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_PEER, "kvx: ucp_ep_rkey_unpack for node %llu: %s", (unsigned long long)node_id,
                     ucs_status_string(us));
        goto fail_ep;
    }
    peer->path = ctx->data_path;
    void *mapped = NULL;
    if (peer->path == KVX_PATH_AUTO || peer->path == KVX_PATH_MAPPED) {
        if (ucp_rkey_ptr(peer->rkey, peer->d.base, &mapped) == UCS_OK && mapped) {
            peer->path = KVX_PATH_MAPPED;
            peer->mapped = mapped;
        } else {
            peer->path = KVX_PATH_AM;
        }
    } else if (ucp_rkey_ptr(peer->rkey, peer->d.base, &mapped) != UCS_OK) {
        mapped = NULL; /* PUT over a fabric: the NIC checks the key's bounds */
    }
    /* Shared memory: the transport copies into the mapped segment without a bounds check, so a descriptor that
     * declares a larger pool than the segment it names must not be used (it would write past the segment). */
    uint64_t extent = mapped ? mapping_extent(mapped) : UINT64_MAX;
    if (extent < peer->d.len) {
        st = bt_fail(BT_ERR_FORMAT,
                     "kvx: node %llu's descriptor declares a pool of %llu bytes but its shared segment maps %llu",
                     (unsigned long long)node_id, (unsigned long long)peer->d.len, (unsigned long long)extent);
        goto fail_rkey;
    }
    BT_DEBUG("kvx", "%s: peer %llu connected, data path %s", ctx->name, (unsigned long long)node_id,
             kvx_data_path_name(peer->path));
    peer->refs = 2; /* cache + caller */
    peer->cached = 1;
    peer->next = ctx->peers;
    ctx->peers = peer;
    ctx->n_peers++;
    ctx->stats.live_peers++;
    ctx->stats.live_eps++;
    ctx->stats.live_rkeys++;
    ctx->stats.peers_built++;
    kvx_kick(ctx);
    pthread_mutex_unlock(&ctx->mu);
    *out = peer;
    return BT_OK;

fail_rkey:
    ucp_rkey_destroy(peer->rkey);
fail_ep: {
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(peer->ep, &rp);
    if (req && !UCS_PTR_IS_ERR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(ctx->worker);
        ucp_request_free(req);
    }
}
fail_desc:
    free(peer->desc);
fail_peer:
    free(peer);
fail:
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

void kvx_peer_release(kvx_peer_t *peer)
{
    if (!peer) return;
    kvx_context_t *ctx = peer->ctx;
    pthread_mutex_lock(&ctx->mu);
    kvx_peer_unref(peer);
    pthread_mutex_unlock(&ctx->mu);
}

bt_status kvx_peer_status(const kvx_peer_t *peer)
{
    kvx_context_t *ctx = peer->ctx;
    pthread_mutex_lock(&ctx->mu);
    int failed = peer->failed;
    pthread_mutex_unlock(&ctx->mu);
    return failed ? BT_ERR_PEER : BT_OK;
}

const kvx_layout_t *kvx_peer_layout(const kvx_peer_t *peer)
{
    return &peer->d.layout;
}

kvx_data_path_t kvx_peer_data_path(const kvx_peer_t *peer)
{
    return peer->path;
}

bt_status kvx_peer_forget(kvx_context_t *ctx, uint64_t node_id)
{
    bt_status st = bt_fail(BT_ERR_NOT_FOUND, "kvx: no cached peer for node %llu", (unsigned long long)node_id);
    pthread_mutex_lock(&ctx->mu);
    for (kvx_peer_t *peer = ctx->peers; peer; peer = peer->next) {
        if (peer->node_id == node_id) {
            kvx_peer_fail(peer, BT_ERR_CANCELLED, "forgotten (node left)");
            st = BT_OK;
            break;
        }
    }
    pthread_mutex_unlock(&ctx->mu);
    return st;
}
