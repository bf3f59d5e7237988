/* kvx_push (sender) and kvx_expect (receiver), and the two active messages between them.
 *
 * Sender: [CLAIM -> waits for the receiver's claim ACK] -> puts per layer -> ucp_ep_flush_nbx -> DONE message ->
 * waits for the receiver's ACK. The claim is made on the MAPPED and PUT paths, where bytes land one-sidedly: no
 * byte is written until the receiver has confirmed that a pending expectation holds the epoch for exactly this
 * block list. Epochs are random 64-bit values (kvx_random_u64), so only the sender the receiver handed an epoch
 * to can claim it, and an expectation accepts one claim.
 * Receiver: DONE for a pending epoch -> checks the block list digest and checksums -> ends the expectation
 * -> ACK with the verdict. A DONE for an epoch no expectation holds is counted stale and answered
 * BT_ERR_STALE, so late completions never touch blocks that were re-assigned.
 *
 * DONE, little-endian: u32 magic "KXDN", u16 version 1, u16 flags, u64 push id, u64 epoch, u64 fingerprint,
 *   u32 n_blocks (both lists), u32 digest of the destination ids (kvx_lists_digest: with a second list for the
 *   layers of a layer map, its ids and the map too), u32 n_layers, u32 reserved, then u32 crc[n_blocks] when
 *   flags has KVX_F_CRC. A block's crc is the crc32c of its per-layer crc32c values in layer order.
 * ACK: u32 magic "KXAK" (answer to DONE) or "KXCA" (answer to CLAIM), i32 status, u64 push id, u64 epoch.
 * CLAIM: u32 magic "KXCL", u16 version 1, u16 reserved, u64 push id, u64 epoch, u32 n_blocks, u32 digest of the
 *   destination ids.
 * DATA (AM path only; the payload is the range's bytes): header u32 magic "KXDT", u32 layer, u64 epoch,
 *   u64 receiver pool base, u32 first destination block, u32 block count. The receiver writes it only when a
 *   pending expectation holds the epoch and every named block, so late or stray data never lands. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

#define DONE_MAGIC 0x4e44584bu /* "KXDN" */
#define ACK_MAGIC 0x4b41584bu  /* "KXAK" */
#define DONE_HDR 48u
#define ACK_LEN 24u
#define DATA_MAGIC 0x5444584bu /* "KXDT" */
#define DATA_HDR 32u
#define CLAIM_MAGIC 0x4c43584bu     /* "KXCL" */
#define CLAIM_ACK_MAGIC 0x4143584bu /* "KXCA" */
#define CLAIM_LEN 32u

uint32_t kvx_blocks_digest(const uint32_t *blocks, size_t n)
{
    uint32_t crc = 0;
    uint8_t buf[256];
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        kvx_put32(buf + k, blocks[i]);
        k += 4;
        if (k == sizeof buf) {
            crc = bt_crc32c(crc, buf, k);
            k = 0;
        }
    }
    return bt_crc32c(crc, buf, k);
}

uint32_t kvx_lists_digest(const uint32_t *blocks, size_t n, const uint32_t *lblocks, size_t nl,
                          const uint8_t *layer_group, uint32_t n_layers)
{
    uint32_t crc = kvx_blocks_digest(blocks, n);
    if (!layer_group) return crc;
    uint8_t b[4];
    kvx_put32(b, crc);
    crc = bt_crc32c(0, b, 4);
    kvx_put32(b, kvx_blocks_digest(lblocks, nl));
    crc = bt_crc32c(crc, b, 4);
    for (uint32_t l = 0; l < n_layers; l++) {
        uint8_t g = layer_group[l] != 0;
        crc = bt_crc32c(crc, &g, 1);
    }
    return crc;
}

/* 1 when layer moves the second list (layer_group may be NULL). */
static inline int in_group(const uint8_t *layer_group, uint32_t layer)
{
    return layer_group && layer_group[layer];
}

/* Block checksum from its per-layer checksums over the layers of group g: crcs is [n_layers][n_blocks]. */
static uint32_t fold_block_crc(const uint32_t *crcs, uint32_t n_layers, size_t n_blocks, size_t i,
                               const uint8_t *layer_group, int g)
{
    uint32_t crc = 0;
    for (uint32_t l = 0; l < n_layers; l++) {
        if (in_group(layer_group, l) != g) continue;
        uint8_t b[4];
        kvx_put32(b, crcs[(size_t)l * n_blocks + i]);
        crc = bt_crc32c(crc, b, 4);
    }
    return crc;
}

/* ---- push ---------------------------------------------------------------------------------------------- */

/* Copies dst[plan.n_blocks] into l (its plan built) and makes room for its checksums when crc. BT_ERR_NOMEM
 * (what was allocated stays in l for push_list_free). */
static bt_status push_list_alloc(kvx_push_list_t *l, const uint32_t *dst, uint32_t n_layers, int crc)
{
    size_t n = l->plan.n_blocks;
    l->dst_blocks = malloc(n * sizeof *l->dst_blocks);
    if (crc) l->crcs = calloc((size_t)n_layers * n, sizeof *l->crcs);
    if (!l->dst_blocks || (crc && !l->crcs)) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    memcpy(l->dst_blocks, dst, n * sizeof *l->dst_blocks);
    return BT_OK;
}

static void push_list_free(kvx_push_list_t *l)
{
    kvx_plan_free(&l->plan);
    free(l->dst_blocks);
    free(l->crcs);
}

static uint32_t push_n_layers(const kvx_push_t *p)
{
    return p->lists[0].plan.local.n_layers;
}

/* Blocks in both lists, as CLAIM and DONE count them. */
static size_t push_n_blocks(const kvx_push_t *p)
{
    return p->lists[0].plan.n_blocks + p->lists[1].plan.n_blocks;
}

/* The AM path's data headers hold this many runs per layer. */
static size_t push_max_runs(const kvx_push_t *p)
{
    return p->lists[0].plan.n_runs > p->lists[1].plan.n_runs ? p->lists[0].plan.n_runs : p->lists[1].plan.n_runs;
}

/* Frees what a push owns besides its references (also a push that was never registered). */
static void push_discard(kvx_push_t *p)
{
    push_list_free(&p->lists[0]);
    push_list_free(&p->lists[1]);
    free(p->layer_group);
    free(p->layer_done);
    free(p->am_hdrs);
    free(p->msg);
    free(p);
}

static void push_free(kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    bt_list_remove(&ctx->pushes, &p->link);
    ctx->stats.live_pushes--;
    p->pool->users--;
    kvx_peer_unref(p->peer);
    push_discard(p);
    pthread_cond_broadcast(&ctx->cv);
}

void kvx_push_unref(kvx_push_t *p)
{
    if (--p->refs == 0) push_free(p);
}

void kvx_push_finish(kvx_push_t *p, bt_status st, const char *fmt, ...)
{
    kvx_context_t *ctx = p->ctx;
    if (p->state == KVX_PUSH_DONE) return;
    p->state = KVX_PUSH_DONE;
    p->status = st;
    p->end_ns = kvx_now_ns();
    if (st != BT_OK && fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err, sizeof p->err, fmt, ap);
        va_end(ap);
        BT_DEBUG("kvx", "%s: push %llu: %s", ctx->name, (unsigned long long)p->id, p->err);
    }
    if (st == BT_OK) {
        ctx->stats.pushes_ok++;
    } else {
        ctx->stats.pushes_failed++;
    }
    if (p->cb && !p->user_gone) {
        p->refs++;
        kvx_notify_push(ctx, &p->notify);
    }
    pthread_cond_broadcast(&ctx->cv);
    /* Past its deadline the endpoint closes, so no byte of this push can land after the caller gave up. */
    if (st == BT_ERR_TIMEOUT) kvx_peer_fail(p->peer, BT_ERR_PEER, "a push to it missed its deadline");
}

static void push_am_cb(void *req, ucs_status_t status, void *user_data)
{
    kvx_push_t *p = user_data;
    ucp_request_free(req);
    p->ctx->stats.live_requests--;
    if (status != UCS_OK)
        kvx_push_finish(p, BT_ERR_PEER, "kvx: completion message failed: %s", ucs_status_string(status));
    kvx_push_unref(p);
}

/* A put or data message completed: it no longer reads the pool or its header. */
static void push_data_cb(void *req, ucs_status_t status, void *user_data)
{
    kvx_push_t *p = user_data;
    ucp_request_free(req);
    p->ctx->stats.live_requests--;
    if (status != UCS_OK)
        kvx_push_finish(p, BT_ERR_PEER, "kvx: data transfer failed: %s", ucs_status_string(status));
    kvx_push_unref(p);
}

/* Sends DONE after the flush (mu held). */
static void push_send_done(kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    if (p->state != KVX_PUSH_FLUSHING) return;
    if (p->peer->failed || !p->peer->ep) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: %s", p->peer->err);
        return;
    }
    size_t n = push_n_blocks(p);
    uint32_t n_layers = push_n_layers(p);
    int crc = (p->flags & KVX_F_CRC) != 0;
    p->msg_len = DONE_HDR + (crc ? 4 * n : 0);
    p->msg = malloc(p->msg_len);
    if (!p->msg) {
        kvx_push_finish(p, BT_ERR_NOMEM, "kvx: out of memory");
        return;
    }
    uint8_t *m = p->msg;
    kvx_put32(m, DONE_MAGIC);
    kvx_put16(m + 4, 1);
    kvx_put16(m + 6, (uint16_t)((crc ? KVX_F_CRC : 0) | (p->peer->path == KVX_PATH_AM ? KVX_DONE_AM : 0)));
    kvx_put64(m + 8, p->id);
    kvx_put64(m + 16, p->epoch);
    kvx_put64(m + 24, p->lists[0].plan.local.fingerprint);
    kvx_put32(m + 32, (uint32_t)n);
    kvx_put32(m + 36, p->digest);
    kvx_put32(m + 40, n_layers);
    kvx_put32(m + 44, 0);
    size_t i = 0; /* the first list's blocks, then the second's */
    for (int g = 0; crc && g < 2; g++) {
        const kvx_push_list_t *l = &p->lists[g];
        for (size_t k = 0; k < l->plan.n_blocks; k++, i++)
            kvx_put32(m + DONE_HDR + 4 * i, fold_block_crc(l->crcs, n_layers, l->plan.n_blocks, k, p->layer_group, g));
    }
    p->state = KVX_PUSH_ACKING;
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
        .cb.send = push_am_cb,
        .user_data = p,
    };
    void *req = ucp_am_send_nbx(p->peer->ep, KVX_AM_DONE, NULL, 0, p->msg, p->msg_len, &rp);
    if (UCS_PTR_IS_ERR(req)) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: completion message: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    } else if (req) {
        p->refs++;
        ctx->stats.live_requests++;
    }
}

static void push_flush_cb(void *req, ucs_status_t status, void *user_data)
{
    kvx_push_t *p = user_data;
    ucp_request_free(req);
    p->ctx->stats.live_requests--;
    if (status != UCS_OK)
        kvx_push_finish(p, BT_ERR_PEER, "kvx: flush failed: %s", ucs_status_string(status));
    else
        push_send_done(p);
    kvx_push_unref(p);
}

/* After the last layer (mu held). */
static void push_flush(kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    p->state = KVX_PUSH_FLUSHING;
    if (p->peer->path == KVX_PATH_MAPPED) {
        /* Our own stores into the mapping: order them before the completion message. */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        push_send_done(p);
        return;
    }
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = push_flush_cb,
        .user_data = p,
    };
    void *req = ucp_ep_flush_nbx(p->peer->ep, &rp);
    if (UCS_PTR_IS_ERR(req)) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: flush: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    } else if (req) {
        p->refs++;
        ctx->stats.live_requests++;
    } else {
        push_send_done(p);
    }
}

/* Asks the receiver to confirm the epoch and block list before the first byte moves (mu held). */
static void push_send_claim(kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    if (p->peer->failed || !p->peer->ep) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: %s", p->peer->err);
        return;
    }
    uint8_t *m = p->claim;
    kvx_put32(m, CLAIM_MAGIC);
    kvx_put16(m + 4, 1);
    kvx_put16(m + 6, 0);
    kvx_put64(m + 8, p->id);
    kvx_put64(m + 16, p->epoch);
    kvx_put32(m + 24, (uint32_t)push_n_blocks(p));
    kvx_put32(m + 28, p->digest);
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
        .cb.send = push_am_cb,
        .user_data = p,
    };
    void *req = ucp_am_send_nbx(p->peer->ep, KVX_AM_CLAIM, NULL, 0, m, CLAIM_LEN, &rp);
    if (UCS_PTR_IS_ERR(req)) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: claim message: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    } else if (req) {
        p->refs++;
        ctx->stats.live_requests++;
    }
}

bt_status kvx_push_create(kvx_pool_t *pool, kvx_peer_t *peer, const kvx_push_args_t *a, kvx_push_t **out)
{
    bt_status st;
    kvx_context_t *ctx = pool->ctx;
    if (!a || peer->ctx != ctx) return bt_fail(BT_ERR_INVALID, "kvx: push: pool and peer from different contexts");
    /* a pool in GPU memory is read by the transport alone: RMA puts (cuda_ipc, or rc with GPUDirect RDMA), and no
     * checksums (they are computed on the host) */
    if (pool->mem_type == KVX_MEM_CUDA && peer->path != KVX_PATH_PUT)
        return bt_fail(BT_ERR_UNSUPPORTED, "kvx: a KV pool in GPU memory moves by RMA put only "
                                           "(BATON_KVX_DATA_PATH=put), not by shared-memory copies or messages");
    uint32_t flags = pool->mem_type == KVX_MEM_CUDA ? a->flags & ~(uint32_t)KVX_F_CRC : a->flags;
    kvx_push_t *p = calloc(1, sizeof *p);
    if (!p) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    /* Layout and block checks happen here, before anything is posted: every list's plan, then the buffers. */
    size_t nl = a->layer_group ? a->n_local_blocks : 0;
    uint32_t n_layers = pool->layout.n_layers;
    const uint32_t *src[2] = {a->src_blocks, a->local_src_blocks}, *dst[2] = {a->dst_blocks, a->local_dst_blocks};
    size_t n[2] = {a->n_blocks, nl};
    int n_lists = a->layer_group ? 2 : 1;
    for (int g = 0; g < n_lists; g++)
        if ((st = kvx_plan_build(&pool->layout, &peer->d.layout, src[g], dst[g], n[g], &p->lists[g].plan)) != BT_OK)
            goto fail;
    for (int g = 0; g < n_lists; g++)
        if ((st = push_list_alloc(&p->lists[g], dst[g], n_layers, (flags & KVX_F_CRC) != 0)) != BT_OK) goto fail;
    p->layer_done = calloc(n_layers, 1);
    if (nl) p->layer_group = malloc(n_layers);
    if (peer->path == KVX_PATH_AM) p->am_hdrs = malloc((size_t)n_layers * push_max_runs(p) * DATA_HDR);
    if (!p->layer_done || (nl && !p->layer_group) || (peer->path == KVX_PATH_AM && !p->am_hdrs)) {
        st = bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
        goto fail;
    }
    for (uint32_t l = 0; nl && l < n_layers; l++) p->layer_group[l] = a->layer_group[l] != 0;
    p->digest = kvx_lists_digest(p->lists[0].dst_blocks, n[0], p->lists[1].dst_blocks, nl, p->layer_group, n_layers);
    p->ctx = ctx;
    p->pool = pool;
    p->peer = peer;
    p->epoch = a->epoch;
    p->flags = flags;
    p->cb = a->cb;
    p->cb_arg = a->cb_arg;
    p->notify.kind = KVX_OBJ_PUSH;
    p->refs = 1;
    p->test_flip_layer = -1;
    p->start_ns = kvx_now_ns();
    p->deadline_ms = p->start_ns / 1000000 + (a->timeout_ms ? a->timeout_ms : KVX_DEFAULT_TIMEOUT_MS);

    pthread_mutex_lock(&ctx->mu);
    if (peer->failed) {
        st = bt_fail(BT_ERR_PEER, "kvx: %s", peer->err);
        pthread_mutex_unlock(&ctx->mu);
        goto fail;
    }
    p->id = ctx->next_push_id++;
    peer->refs++;
    pool->users++;
    bt_list_push_front(&ctx->pushes, &p->link);
    ctx->stats.live_pushes++;
    p->state = peer->path == KVX_PATH_AM ? KVX_PUSH_POSTING : KVX_PUSH_CLAIMING;
    if (p->state == KVX_PUSH_CLAIMING) push_send_claim(p);
    kvx_kick(ctx); /* the deadline sweep must see it */
    pthread_mutex_unlock(&ctx->mu);
    *out = p;
    return BT_OK;

fail:
    push_discard(p);
    return st;
}

bt_status kvx_push_layer(kvx_push_t *p, uint32_t layer)
{
    kvx_context_t *ctx = p->ctx;
    if (layer >= push_n_layers(p))
        return bt_fail(BT_ERR_INVALID, "kvx: layer %u out of range (%u layers)", layer, push_n_layers(p));
    if (p->layer_done[layer]) return bt_fail(BT_ERR_INVALID, "kvx: layer %u posted twice", layer);
    kvx_push_list_t *list = &p->lists[in_group(p->layer_group, layer)];
    const kvx_plan_t *plan = &list->plan;
    uint32_t *crcs = list->crcs;
    if (crcs) {
        /* The caller owns this layer's bytes now; checksum them outside the lock. */
        const uint8_t *base = p->pool->base;
        uint64_t stride = plan->local.block_stride;
        size_t i = 0;
        for (size_t r = 0; r < plan->n_runs; r++)
            for (uint32_t b = 0; b < plan->runs[r].n_blocks; b++, i++)
                crcs[(size_t)layer * plan->n_blocks + i] =
                    bt_crc32c(0, base + kvx_layout_offset(&plan->local, layer, plan->runs[r].src_block + b), stride);
        if (p->test_flip_layer == (int64_t)layer)
            ((uint8_t *)p->pool->base)[kvx_layout_offset(&plan->local, layer, plan->runs[0].src_block)] ^= 1;
    }

    pthread_mutex_lock(&ctx->mu);
    /* one-sided paths: nothing is written before the receiver confirmed the claim (or the push failed) */
    while (p->state == KVX_PUSH_CLAIMING) pthread_cond_wait(&ctx->cv, &ctx->mu);
    if (p->state == KVX_PUSH_DONE) {
        bt_status st = bt_fail(p->status, "%s", p->err);
        pthread_mutex_unlock(&ctx->mu);
        return st;
    }
    p->layer_done[layer] = 1;
    p->layers_posted++;
    kvx_peer_t *peer = p->peer;
    const uint8_t *base = p->pool->base;
    if (peer->failed) {
        kvx_push_finish(p, BT_ERR_PEER, "kvx: %s", peer->err);
    } else if (peer->path == KVX_PATH_MAPPED) {
        /* One-sided copies into the mapped remote pool, without holding mu (the mapping stays while copying). */
        peer->copying++;
        pthread_mutex_unlock(&ctx->mu);
        uint64_t bytes = 0;
        for (size_t r = 0; r < plan->n_runs; r++) {
            kvx_range_t rg = kvx_plan_range(plan, layer, r);
            memcpy(peer->mapped + rg.remote_off, base + rg.local_off, rg.len);
            bytes += rg.len;
        }
        pthread_mutex_lock(&ctx->mu);
        peer->copying--;
        p->puts += plan->n_runs;
        ctx->stats.puts += plan->n_runs;
        ctx->stats.bytes_pushed += bytes;
    } else {
        /* Each in-flight request holds a reference, so the push (its headers) and the pool outlive it. */
        ucp_request_param_t rp = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .memh = p->pool->memh,
            .cb.send = push_data_cb,
            .user_data = p,
        };
        if (peer->path == KVX_PATH_AM) {
            rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            rp.flags = UCP_AM_SEND_FLAG_EAGER; /* the receiver never answers data: safe if we die */
        }
        for (size_t r = 0; r < plan->n_runs; r++) {
            kvx_range_t rg = kvx_plan_range(plan, layer, r);
            void *req;
            if (peer->path == KVX_PATH_AM) {
                uint8_t *h = p->am_hdrs + ((size_t)layer * push_max_runs(p) + r) * DATA_HDR;
                kvx_put32(h, DATA_MAGIC);
                kvx_put32(h + 4, layer);
                kvx_put64(h + 8, p->epoch);
                kvx_put64(h + 16, peer->d.base);
                kvx_put32(h + 24, plan->runs[r].dst_block);
                kvx_put32(h + 28, plan->runs[r].n_blocks);
                req = ucp_am_send_nbx(peer->ep, KVX_AM_DATA, h, DATA_HDR, base + rg.local_off, rg.len, &rp);
            } else {
                req = ucp_put_nbx(peer->ep, base + rg.local_off, rg.len, peer->d.base + rg.remote_off, peer->rkey,
                                  &rp);
            }
            p->puts++;
            ctx->stats.puts++;
            if (UCS_PTR_IS_ERR(req)) {
                kvx_push_finish(p, BT_ERR_PEER, "kvx: put: %s", ucs_status_string(UCS_PTR_STATUS(req)));
                break;
            }
            if (req) {
                p->refs++;
                ctx->stats.live_requests++;
            }
            ctx->stats.bytes_pushed += rg.len;
        }
    }
    if (p->state == KVX_PUSH_POSTING && p->layers_posted == push_n_layers(p)) push_flush(p);
    bt_status st = BT_OK;
    if (p->state == KVX_PUSH_DONE && p->status != BT_OK) st = bt_fail(p->status, "%s", p->err);
    kvx_kick(ctx);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

bt_status kvx_push_all(kvx_push_t *p)
{
    for (uint32_t l = 0; l < push_n_layers(p); l++) {
        if (p->layer_done[l]) continue;
        bt_status st = kvx_push_layer(p, l);
        if (st != BT_OK) return st;
    }
    return BT_OK;
}

bt_status kvx_push_wait(kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    pthread_mutex_lock(&ctx->mu);
    while (p->state != KVX_PUSH_DONE || p->notify.pending) pthread_cond_wait(&ctx->cv, &ctx->mu);
    bt_status st = p->status;
    if (st != BT_OK) bt_fail(st, "%s", p->err);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

uint64_t kvx_push_elapsed_ns(const kvx_push_t *p)
{
    kvx_context_t *ctx = p->ctx;
    pthread_mutex_lock(&ctx->mu);
    uint64_t end = p->state == KVX_PUSH_DONE ? p->end_ns : kvx_now_ns();
    pthread_mutex_unlock(&ctx->mu);
    return end - p->start_ns;
}

uint64_t kvx_push_bytes(const kvx_push_t *p)
{
    uint64_t sum = 0;
    for (uint32_t l = 0; l < push_n_layers(p); l++)
        sum += (uint64_t)p->lists[in_group(p->layer_group, l)].plan.n_blocks * p->lists[0].plan.local.block_stride;
    return sum;
}

size_t kvx_push_puts(const kvx_push_t *p)
{
    return p->puts;
}

const kvx_plan_t *kvx_push_plan(const kvx_push_t *p)
{
    return &p->lists[0].plan;
}

const char *kvx_push_error(const kvx_push_t *p)
{
    return p->err;
}

void kvx_push_destroy(kvx_push_t *p)
{
    if (!p) return;
    kvx_context_t *ctx = p->ctx;
    pthread_mutex_lock(&ctx->mu);
    if (!pthread_equal(pthread_self(), ctx->thread))
        while (ctx->cb_running == p) pthread_cond_wait(&ctx->cv, &ctx->mu);
    p->user_gone = 1;
    if (p->state != KVX_PUSH_DONE) kvx_push_finish(p, BT_ERR_CANCELLED, "kvx: push destroyed while running");
    kvx_push_unref(p);
    pthread_mutex_unlock(&ctx->mu);
}

/* ---- expectation ---------------------------------------------------------------------------------------- */

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* 1 when blocks first..first+count-1 all belong to e's list for layer (sorted and distinct, so they sit side by
 * side). */
static int expect_owns(const kvx_expect_t *e, uint32_t layer, uint32_t first, uint32_t count)
{
    const kvx_expect_list_t *list = &e->lists[in_group(e->layer_group, layer)];
    const uint32_t *sorted = list->sorted;
    size_t n = list->n;
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < first)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo + count > n) return 0;
    for (uint32_t k = 0; k < count; k++)
        if (sorted[lo + k] != first + k) return 0;
    return 1;
}

/* Copies blocks[n] into l, in the sender's order and ascending. BT_ERR_NOMEM (what was allocated stays in l for
 * expect_list_free). */
static bt_status expect_list_init(kvx_expect_list_t *l, const uint32_t *blocks, size_t n)
{
    l->blocks = malloc(n * sizeof *l->blocks);
    l->sorted = malloc(n * sizeof *l->sorted);
    if (!l->blocks || !l->sorted) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    memcpy(l->blocks, blocks, n * sizeof *l->blocks);
    memcpy(l->sorted, blocks, n * sizeof *l->sorted);
    qsort(l->sorted, n, sizeof *l->sorted, cmp_u32);
    l->n = n;
    return BT_OK;
}

static void expect_list_free(kvx_expect_list_t *l)
{
    free(l->blocks);
    free(l->sorted);
}

/* Blocks in both lists, as CLAIM and DONE count them. */
static size_t expect_n_blocks(const kvx_expect_t *e)
{
    return e->lists[0].n + e->lists[1].n;
}

/* Frees what an expectation owns besides its references (also one that was never registered). */
static void expect_discard(kvx_expect_t *e)
{
    expect_list_free(&e->lists[0]);
    expect_list_free(&e->lists[1]);
    free(e->layer_group);
    free(e);
}

static void expect_free(kvx_expect_t *e)
{
    kvx_context_t *ctx = e->ctx;
    bt_list_remove(&ctx->expects, &e->link);
    ctx->stats.live_expects--;
    e->pool->users--;
    if (e->sender) kvx_peer_unref(e->sender);
    expect_discard(e);
    pthread_cond_broadcast(&ctx->cv);
}

void kvx_expect_unref(kvx_expect_t *e)
{
    if (--e->refs == 0) expect_free(e);
}

void kvx_expect_finish(kvx_expect_t *e, bt_status st, const char *fmt, ...)
{
    kvx_context_t *ctx = e->ctx;
    if (e->done) return;
    e->done = 1;
    e->status = st;
    e->pool->pending_blocks -= expect_n_blocks(e); /* the caller may reuse them (after bumping the epoch) */
    if (st != BT_OK && fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->err, sizeof e->err, fmt, ap);
        va_end(ap);
        BT_DEBUG("kvx", "%s: expectation %llu: %s", ctx->name, (unsigned long long)e->epoch, e->err);
    }
    if (st == BT_OK)
        ctx->stats.expects_ok++;
    else
        ctx->stats.expects_failed++;
    if (e->cb) {
        e->refs++;
        kvx_notify_push(ctx, &e->notify);
    }
    pthread_cond_broadcast(&ctx->cv);
}

/* The pending expectation that holds epoch, or NULL (mu held). */
static kvx_expect_t *expect_pending(kvx_context_t *ctx, uint64_t epoch)
{
    BT_LIST_FOR(o, &ctx->expects, kvx_expect_t, link)
        if (!o->done && o->epoch == epoch) return o;
    return NULL;
}

bt_status kvx_expect_create(kvx_pool_t *pool, const kvx_expect_args_t *a, kvx_expect_t **out)
{
    bt_status st;
    kvx_context_t *ctx = pool->ctx;
    if (!a || !a->blocks || a->n_blocks == 0 || a->n_blocks > KVX_MAX_BLOCKS)
        return bt_fail(BT_ERR_INVALID, "kvx: expectation needs 1..%u blocks", KVX_MAX_BLOCKS);
    if (a->sender && a->sender->ctx != ctx) return bt_fail(BT_ERR_INVALID, "kvx: sender peer from another context");
    size_t nl = a->layer_group ? a->n_local_blocks : 0;
    if (a->layer_group && (!a->local_blocks || nl == 0 || nl > KVX_MAX_BLOCKS))
        return bt_fail(BT_ERR_INVALID, "kvx: expectation's second list needs 1..%u blocks", KVX_MAX_BLOCKS);
    /* Same checks as a plan into this pool, per list. */
    const uint32_t *ids[2] = {a->blocks, a->local_blocks};
    size_t n[2] = {a->n_blocks, nl};
    int n_lists = nl ? 2 : 1;
    for (int g = 0; g < n_lists; g++) {
        kvx_plan_t plan = {0};
        if ((st = kvx_plan_build(&pool->layout, &pool->layout, ids[g], ids[g], n[g], &plan)) != BT_OK) return st;
        kvx_plan_free(&plan);
    }
    uint32_t n_layers = pool->layout.n_layers;
    kvx_expect_t *e = calloc(1, sizeof *e);
    if (!e) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    for (int g = 0; g < n_lists; g++) {
        if ((st = expect_list_init(&e->lists[g], ids[g], n[g])) != BT_OK) {
            expect_discard(e);
            return st;
        }
    }
    if (nl && !(e->layer_group = malloc(n_layers))) {
        expect_discard(e);
        return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    }
    for (uint32_t l = 0; nl && l < n_layers; l++) e->layer_group[l] = a->layer_group[l] != 0;
    e->ctx = ctx;
    e->pool = pool;
    e->blocks_crc = kvx_lists_digest(e->lists[0].blocks, n[0], e->lists[1].blocks, nl, e->layer_group, n_layers);
    e->flags = a->flags;
    e->cb = a->cb;
    e->cb_arg = a->cb_arg;
    e->notify.kind = KVX_OBJ_EXPECT;
    e->refs = 1;
    e->deadline_ms = kvx_now_ms() + (a->timeout_ms ? a->timeout_ms : KVX_DEFAULT_TIMEOUT_MS);

    pthread_mutex_lock(&ctx->mu);
    e->epoch = a->epoch;
    while (!e->epoch || expect_pending(ctx, e->epoch)) {
        if (a->epoch) {
            pthread_mutex_unlock(&ctx->mu);
            expect_discard(e);
            return bt_fail(BT_ERR_INVALID, "kvx: epoch %llu already pending", (unsigned long long)a->epoch);
        }
        e->epoch = kvx_random_u64(); /* fresh, unguessable; drawn again on the 2^-64 chance that it is taken */
    }
    if (a->sender) {
        if (a->sender->failed) {
            st = bt_fail(BT_ERR_PEER, "kvx: sender %s", a->sender->err);
            pthread_mutex_unlock(&ctx->mu);
            expect_discard(e);
            return st;
        }
        e->sender = a->sender;
        e->sender->refs++;
    }
    pool->users++;
    pool->pending_blocks += expect_n_blocks(e);
    bt_list_push_front(&ctx->expects, &e->link);
    ctx->stats.live_expects++;
    kvx_kick(ctx);
    pthread_mutex_unlock(&ctx->mu);
    *out = e;
    return BT_OK;
}

uint64_t kvx_expect_epoch(const kvx_expect_t *e)
{
    return e->epoch;
}

bt_status kvx_expect_wait(kvx_expect_t *e)
{
    kvx_context_t *ctx = e->ctx;
    pthread_mutex_lock(&ctx->mu);
    while (!e->done || e->notify.pending) pthread_cond_wait(&ctx->cv, &ctx->mu);
    bt_status st = e->status;
    if (st != BT_OK) bt_fail(st, "%s", e->err);
    pthread_mutex_unlock(&ctx->mu);
    return st;
}

bt_status kvx_expect_settle(kvx_expect_t *e, uint32_t timeout_ms)
{
    kvx_context_t *ctx = e->ctx;
    pthread_mutex_lock(&ctx->mu);
    if (!e->done && !e->claimed) {
        /* no claim yet: ending it now refuses any later claim and drops late AM data, so nothing more lands */
        e->cb = NULL;
        kvx_expect_finish(e, BT_ERR_CANCELLED, "kvx: expectation settled before any claim");
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until); /* ctx->cv runs on the default (realtime) clock */
    uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)timeout_ms * 1000000u;
    until.tv_sec += (time_t)(ns / 1000000000u);
    until.tv_nsec = (long)(ns % 1000000000u);
    int rc = 0;
    while ((!e->done || e->notify.pending) && rc == 0) rc = pthread_cond_timedwait(&ctx->cv, &ctx->mu, &until);
    bt_status st = e->done && !e->notify.pending ? BT_OK : BT_ERR_TIMEOUT;
    pthread_mutex_unlock(&ctx->mu);
    if (st != BT_OK)
        return bt_fail(st, "kvx: epoch %llu: the sender claimed it and did not finish within %u ms",
                       (unsigned long long)e->epoch, timeout_ms);
    return BT_OK;
}

const char *kvx_expect_error(const kvx_expect_t *e)
{
    return e->err;
}

void kvx_expect_destroy(kvx_expect_t *e)
{
    if (!e) return;
    kvx_context_t *ctx = e->ctx;
    pthread_mutex_lock(&ctx->mu);
    if (!pthread_equal(pthread_self(), ctx->thread))
        while (ctx->cb_running == e) pthread_cond_wait(&ctx->cv, &ctx->mu);
    e->cb = NULL;
    if (!e->done) kvx_expect_finish(e, BT_ERR_CANCELLED, "kvx: expectation destroyed");
    kvx_expect_unref(e);
    pthread_mutex_unlock(&ctx->mu);
}

/* ---- deadlines ----------------------------------------------------------------------------------------- */

uint64_t kvx_deadlines(kvx_context_t *ctx, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    BT_LIST_FOR(p, &ctx->pushes, kvx_push_t, link) {
        if (p->state == KVX_PUSH_DONE) continue;
        if (now >= p->deadline_ms) {
            kvx_push_finish(p, BT_ERR_TIMEOUT, "kvx: push %llu to node %llu missed its %llu ms deadline",
                            (unsigned long long)p->id, (unsigned long long)p->peer->node_id,
                            (unsigned long long)(p->deadline_ms - p->start_ns / 1000000));
        } else if (p->deadline_ms - now < next) {
            next = p->deadline_ms - now;
        }
    }
    BT_LIST_FOR(e, &ctx->expects, kvx_expect_t, link) {
        if (e->done) continue;
        if (now >= e->deadline_ms)
            kvx_expect_finish(e, BT_ERR_TIMEOUT, "kvx: expectation for epoch %llu timed out",
                              (unsigned long long)e->epoch);
        else if (e->deadline_ms - now < next)
            next = e->deadline_ms - now;
    }
    return next;
}

/* ---- active messages ------------------------------------------------------------------------------------ */

static void ack_sent_cb(void *req, ucs_status_t status, void *user_data)
{
    kvx_context_t *ctx = *(kvx_context_t **)user_data;
    ucp_request_free(req);
    ctx->stats.live_requests--;
    free(user_data);
}

static void send_ack(kvx_context_t *ctx, ucp_ep_h ep, uint32_t magic, bt_status st, uint64_t push_id, uint64_t epoch)
{
    if (!ep) {
        BT_WARN("kvx", "%s: cannot acknowledge push %llu: no reply endpoint", ctx->name,
                (unsigned long long)push_id);
        return;
    }
    /* [context pointer][ack bytes]: the pointer lets the completion callback find the counters. */
    uint8_t *buf = malloc(sizeof(kvx_context_t *) + ACK_LEN);
    if (!buf) return;
    memcpy(buf, &ctx, sizeof ctx);
    uint8_t *m = buf + sizeof(kvx_context_t *);
    kvx_put32(m, magic);
    kvx_put32(m + 4, (uint32_t)(int32_t)st);
    kvx_put64(m + 8, push_id);
    kvx_put64(m + 16, epoch);
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .flags = UCP_AM_SEND_FLAG_EAGER,
        .cb.send = ack_sent_cb,
        .user_data = buf,
    };
    void *req = ucp_am_send_nbx(ep, KVX_AM_ACK, NULL, 0, m, ACK_LEN, &rp);
    if (UCS_PTR_IS_ERR(req)) {
        BT_WARN("kvx", "%s: acknowledgement failed: %s", ctx->name, ucs_status_string(UCS_PTR_STATUS(req)));
        free(buf);
    } else if (req) {
        ctx->stats.live_requests++;
    } else {
        free(buf);
    }
}

/* Verifies the checksums of e's blocks (the first list's, then the second's, each over its layers) against the
 * sender's: 0 when all match, else -1 with *bad the first failing block in that order. */
static int verify_crcs(const kvx_expect_t *e, const uint8_t *crcs, uint32_t *bad)
{
    const kvx_layout_t *l = &e->pool->layout;
    const uint8_t *base = e->pool->base;
    size_t i = 0;
    for (int g = 0; g < 2; g++) {
        for (size_t k = 0; k < e->lists[g].n; k++, i++) {
            uint32_t block = e->lists[g].blocks[k], crc = 0;
            for (uint32_t layer = 0; layer < l->n_layers; layer++) {
                if (in_group(e->layer_group, layer) != g) continue;
                uint8_t b[4];
                kvx_put32(b, bt_crc32c(0, base + kvx_layout_offset(l, layer, block), l->block_stride));
                crc = bt_crc32c(crc, b, 4);
            }
            if (crc != kvx_get32(crcs + 4 * i)) {
                *bad = block;
                return -1;
            }
        }
    }
    return 0;
}

/* Bytes the AM data path must have delivered for e: each list's blocks in each of its layers. */
static uint64_t expect_bytes(const kvx_expect_t *e)
{
    const kvx_layout_t *l = &e->pool->layout;
    uint64_t sum = 0;
    for (uint32_t layer = 0; layer < l->n_layers; layer++)
        sum += (uint64_t)e->lists[in_group(e->layer_group, layer)].n * l->block_stride;
    return sum;
}

/* CLAIM: the sender asks before writing one-sidedly. Accepted once per expectation, for its exact block list; a
 * claim naming other blocks ends the expectation (the sender is confused or hostile). */
ucs_status_t kvx_am_claim_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param)
{
    kvx_context_t *ctx = arg;
    const uint8_t *m = data;
    ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != CLAIM_LEN || kvx_get32(m) != CLAIM_MAGIC ||
        kvx_get16(m + 4) != 1) {
        BT_WARN("kvx", "%s: malformed claim message (%zu bytes) dropped", ctx->name, length);
        return UCS_OK;
    }
    uint64_t push_id = kvx_get64(m + 8), epoch = kvx_get64(m + 16);
    uint32_t n = kvx_get32(m + 24), digest = kvx_get32(m + 28);
    kvx_expect_t *e = expect_pending(ctx, epoch);
    bt_status st = BT_OK;
    if (!e) {
        ctx->stats.stale_completions++;
        BT_DEBUG("kvx", "%s: claim for stale epoch %llu refused", ctx->name, (unsigned long long)epoch);
        st = BT_ERR_STALE;
    } else if (e->claimed) {
        st = BT_ERR_STALE; /* one sender per epoch; the first claim stands */
        BT_WARN("kvx", "%s: second claim for epoch %llu refused", ctx->name, (unsigned long long)epoch);
    } else if (n != expect_n_blocks(e) || digest != e->blocks_crc) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: sender claimed a different block list", (unsigned long long)epoch);
    } else {
        e->claimed = 1;
    }
    send_ack(ctx, reply, CLAIM_ACK_MAGIC, st, push_id, epoch);
    return UCS_OK;
}

ucs_status_t kvx_am_done_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    kvx_context_t *ctx = arg;
    const uint8_t *m = data;
    ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length < DONE_HDR || kvx_get32(m) != DONE_MAGIC ||
        kvx_get16(m + 4) != 1) {
        BT_WARN("kvx", "%s: malformed completion message (%zu bytes) dropped", ctx->name, length);
        return UCS_OK;
    }
    uint16_t flags = kvx_get16(m + 6);
    uint64_t push_id = kvx_get64(m + 8), epoch = kvx_get64(m + 16), fp = kvx_get64(m + 24);
    uint32_t n = kvx_get32(m + 32), digest = kvx_get32(m + 36), n_layers = kvx_get32(m + 40);
    int has_crc = (flags & KVX_F_CRC) != 0;

    kvx_expect_t *e = expect_pending(ctx, epoch);
    if (!e) {
        ctx->stats.stale_completions++;
        BT_DEBUG("kvx", "%s: completion for stale epoch %llu ignored", ctx->name, (unsigned long long)epoch);
        send_ack(ctx, reply, ACK_MAGIC, BT_ERR_STALE, push_id, epoch);
        return UCS_OK;
    }
    bt_status st = BT_OK;
    if (fp != e->pool->layout.fingerprint || n_layers != e->pool->layout.n_layers) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: sender layout differs", (unsigned long long)epoch);
    } else if (n != expect_n_blocks(e) || digest != e->blocks_crc) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: sender wrote a different block list", (unsigned long long)epoch);
    } else if (!(flags & KVX_DONE_AM) && !e->claimed) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: one-sided completion without a claim", (unsigned long long)epoch);
    } else if (length != DONE_HDR + (has_crc ? 4ull * n : 0)) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: completion message has %zu bytes", (unsigned long long)epoch,
                          length);
    } else if ((flags & KVX_DONE_AM) && e->bytes_received != expect_bytes(e)) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: %llu of %llu bytes arrived", (unsigned long long)epoch,
                          (unsigned long long)e->bytes_received, (unsigned long long)expect_bytes(e));
    } else if ((e->flags & KVX_F_CRC) && !has_crc && e->pool->mem_type != KVX_MEM_CUDA) {
        st = BT_ERR_FORMAT;
        kvx_expect_finish(e, st, "kvx: epoch %llu: checksums required but not sent", (unsigned long long)epoch);
    } else if (has_crc && e->pool->mem_type != KVX_MEM_CUDA) { /* GPU memory: not read on the host, not verified */
        uint32_t bad;
        if (verify_crcs(e, m + DONE_HDR, &bad)) {
            ctx->stats.crc_mismatches++;
            st = BT_ERR_FORMAT;
            kvx_expect_finish(e, st, "kvx: epoch %llu: block %u failed its crc32c check", (unsigned long long)epoch,
                              bad);
        }
    }
    if (st == BT_OK) kvx_expect_finish(e, BT_OK, NULL);
    send_ack(ctx, reply, ACK_MAGIC, st, push_id, epoch);
    return UCS_OK;
}

ucs_status_t kvx_am_data_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    kvx_context_t *ctx = arg;
    const uint8_t *h = header;
    ctx->stats.am_data_received++;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || header_length != DATA_HDR || kvx_get32(h) != DATA_MAGIC) {
        ctx->stats.dropped_writes++;
        BT_WARN("kvx", "%s: malformed data message dropped", ctx->name);
        return UCS_OK;
    }
    uint32_t layer = kvx_get32(h + 4), first = kvx_get32(h + 24), count = kvx_get32(h + 28);
    uint64_t epoch = kvx_get64(h + 8), base = kvx_get64(h + 16);
    kvx_expect_t *e = expect_pending(ctx, epoch);
    const kvx_layout_t *l = e ? &e->pool->layout : NULL;
    int ok = e && (uint64_t)(uintptr_t)e->pool->base == base && layer < l->n_layers && count > 0 &&
             first < l->n_blocks && count <= l->n_blocks - first && length == (uint64_t)count * l->block_stride;
    ok = ok && expect_owns(e, layer, first, count) && e->pool->mem_type != KVX_MEM_CUDA; /* no host copy into a GPU */
    if (!ok) {
        ctx->stats.dropped_writes++;
        BT_DEBUG("kvx", "%s: data for epoch %llu dropped (stale or outside its blocks)", ctx->name,
                 (unsigned long long)epoch);
        return UCS_OK;
    }
    memcpy((uint8_t *)e->pool->base + kvx_layout_offset(l, layer, first), data, length);
    e->bytes_received += length;
    return UCS_OK;
}

/* The receiver's answer to a CLAIM: the push may write (POSTING) or has failed. */
static void claim_answered(kvx_push_t *p, bt_status st, uint64_t epoch)
{
    switch (st) {
    case BT_OK: p->state = KVX_PUSH_POSTING; break;
    case BT_ERR_STALE:
        kvx_push_finish(p, st, "kvx: receiver holds no claimable epoch %llu; nothing was written",
                        (unsigned long long)epoch);
        break;
    case BT_ERR_FORMAT:
        kvx_push_finish(p, st, "kvx: receiver refused the claim (block list mismatch); nothing was written");
        break;
    default: kvx_push_finish(p, st, "kvx: receiver answered the claim: %s", bt_status_str(st)); break;
    }
    pthread_cond_broadcast(&p->ctx->cv);
}

/* The receiver's verdict on DONE. */
static void done_answered(kvx_push_t *p, bt_status st, uint64_t epoch)
{
    switch (st) {
    case BT_OK: kvx_push_finish(p, BT_OK, NULL); break;
    case BT_ERR_STALE:
        kvx_push_finish(p, st, "kvx: receiver no longer holds epoch %llu", (unsigned long long)epoch);
        break;
    case BT_ERR_FORMAT:
        kvx_push_finish(p, st, "kvx: receiver rejected the transfer (checksum or block list mismatch)");
        break;
    default: kvx_push_finish(p, st, "kvx: receiver answered: %s", bt_status_str(st)); break;
    }
}

ucs_status_t kvx_am_ack_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                           const ucp_am_recv_param_t *param)
{
    kvx_context_t *ctx = arg;
    const uint8_t *m = data;
    uint32_t magic = length == ACK_LEN ? kvx_get32(m) : 0;
    if (magic != ACK_MAGIC && magic != CLAIM_ACK_MAGIC) {
        BT_WARN("kvx", "%s: malformed acknowledgement dropped", ctx->name);
        return UCS_OK;
    }
    int32_t raw = (int32_t)kvx_get32(m + 4);
    bt_status st = raw <= 0 && raw >= BT_ERR_INTERNAL ? (bt_status)raw : BT_ERR_PEER;
    uint64_t push_id = kvx_get64(m + 8), epoch = kvx_get64(m + 16);
    BT_LIST_FOR(p, &ctx->pushes, kvx_push_t, link) {
        if (p->id != push_id || p->epoch != epoch) continue;
        if (magic == CLAIM_ACK_MAGIC && p->state == KVX_PUSH_CLAIMING) claim_answered(p, st, epoch);
        if (magic == ACK_MAGIC && p->state == KVX_PUSH_ACKING) done_answered(p, st, epoch);
        break;
    }
    return UCS_OK;
}
