/* kvx_pool: the registered KV pool and its exported descriptor.
 *
 * Descriptor wire format, version 1, little-endian:
 *   0  u32 magic "KVXD"     4  u16 version (1)      6  u16 header length (64)
 *   8  u32 total length     12 u32 n_layers         16 u32 n_blocks        20 u32 worker address length
 *   24 u64 block_stride     32 u64 fingerprint      40 u64 instance        48 u64 base address
 *   56 u32 rkey length      60 u32 reserved (0)
 *   64 worker address, then packed rkey, then u32 crc32c of every preceding byte. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "kvtransfer/kvx_internal.h"

#define DESC_MAGIC 0x4458564bu /* "KVXD" */
#define DESC_VERSION 1
#define DESC_HDR 64u
#define DESC_MAX_BLOB (1u << 20) /* a worker address or rkey larger than this is garbage */

bt_status kvx_desc_parse(const void *bytes, size_t len, kvx_desc_t *out)
{
    const uint8_t *p = bytes;
    if (!p || len < DESC_HDR + 4) return bt_fail(BT_ERR_FORMAT, "kvx descriptor: truncated (%zu bytes)", len);
    if (kvx_get32(p) != DESC_MAGIC) return bt_fail(BT_ERR_FORMAT, "kvx descriptor: bad magic");
    if (kvx_get16(p + 4) != DESC_VERSION)
        return bt_fail(BT_ERR_FORMAT, "kvx descriptor: version %u not supported", kvx_get16(p + 4));
    if (kvx_get16(p + 6) != DESC_HDR) return bt_fail(BT_ERR_FORMAT, "kvx descriptor: bad header length");
    if (kvx_get32(p + 8) != len)
        return bt_fail(BT_ERR_FORMAT, "kvx descriptor: length %zu, header says %u", len, kvx_get32(p + 8));
    uint32_t wal = kvx_get32(p + 20), rkl = kvx_get32(p + 56);
    if (wal == 0 || rkl == 0 || wal > DESC_MAX_BLOB || rkl > DESC_MAX_BLOB ||
        (uint64_t)DESC_HDR + wal + rkl + 4 != len)
        return bt_fail(BT_ERR_FORMAT, "kvx descriptor: inconsistent lengths");
    uint32_t crc = bt_crc32c(0, p, len - 4);
    if (crc != kvx_get32(p + len - 4)) return bt_fail(BT_ERR_FORMAT, "kvx descriptor: checksum mismatch");
    kvx_desc_t d = {
        .layout = {.n_layers = kvx_get32(p + 12),
                   .n_blocks = kvx_get32(p + 16),
                   .block_stride = kvx_get64(p + 24),
                   .fingerprint = kvx_get64(p + 32)},
        .instance = kvx_get64(p + 40),
        .base = kvx_get64(p + 48),
        .worker_addr = p + DESC_HDR,
        .worker_addr_len = wal,
        .rkey = p + DESC_HDR + wal,
        .rkey_len = rkl,
    };
    if (kvx_layout_check(&d.layout, &d.len) != BT_OK)
        return bt_fail(BT_ERR_FORMAT, "kvx descriptor: bad layout: %s", bt_last_error());
    if (d.base == 0 || d.base + d.len < d.base) return bt_fail(BT_ERR_FORMAT, "kvx descriptor: bad base address");
    *out = d;
    return BT_OK;
}

/* kvx_pool_create (mem NULL: UCX allocates host memory, zero-filled) and kvx_pool_register (mem of type mt) */
static bt_status pool_map(kvx_context_t *ctx, const kvx_layout_t *layout, void *mem, kvx_mem_type_t mt,
                          kvx_pool_t **out)
{
    bt_status st;
    ucs_status_t us;
    uint64_t bytes;
    void *rkey_buf = NULL;
    size_t rkey_len = 0;

    if ((st = kvx_layout_check(layout, &bytes)) != BT_OK) return st;
    kvx_pool_t *pool = calloc(1, sizeof *pool);
    if (!pool) return bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
    pool->ctx = ctx;
    pool->layout = *layout;
    pool->bytes = bytes;

    pthread_mutex_lock(&ctx->mu);
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .length = bytes,
        .flags = UCP_MEM_MAP_ALLOCATE, /* shared-memory transports can then put one-sidedly */
    };
    if (mem) {
        mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                        UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.address = mem;
        mp.flags = 0;
        mp.memory_type = mt == KVX_MEM_CUDA ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    }
    us = ucp_mem_map(ctx->ucp, &mp, &pool->memh);
    if (us != UCS_OK) {
        st = bt_fail(us == UCS_ERR_NO_MEMORY            ? BT_ERR_NOMEM
                     : us == UCS_ERR_UNSUPPORTED || mt ? BT_ERR_UNSUPPORTED
                                                       : BT_ERR_IO,
                     "kvx: ucp_mem_map(%llu bytes of %s memory): %s%s", (unsigned long long)bytes,
                     mt == KVX_MEM_CUDA ? "cuda" : "host", ucs_status_string(us),
                     mt == KVX_MEM_CUDA ? " (this UCX may lack CUDA support: see `ucx_info -d`)" : "");
        goto fail;
    }
    ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    us = ucp_mem_query(pool->memh, &attr);
    if (us != UCS_OK || !attr.address || attr.length < bytes) {
        st = bt_fail(BT_ERR_IO, "kvx: ucp_mem_query: %s", ucs_status_string(us));
        goto fail_unmap;
    }
    pool->base = attr.address;
    pool->mem_type = mem ? mt : KVX_MEM_HOST;
    us = ucp_rkey_pack(ctx->ucp, pool->memh, &rkey_buf, &rkey_len);
    if (us != UCS_OK) {
        st = bt_fail(BT_ERR_IO, "kvx: ucp_rkey_pack: %s", ucs_status_string(us));
        goto fail_unmap;
    }
    if (rkey_len == 0 || rkey_len > DESC_MAX_BLOB || ctx->worker_addr_len > DESC_MAX_BLOB) {
        st = bt_fail(BT_ERR_INTERNAL, "kvx: unexpected rkey/address size");
        goto fail_rkey;
    }
    pool->desc_len = DESC_HDR + ctx->worker_addr_len + rkey_len + 4;
    pool->desc = calloc(1, pool->desc_len);
    if (!pool->desc) {
        st = bt_fail(BT_ERR_NOMEM, "kvx: out of memory");
        goto fail_rkey;
    }
    uint8_t *d = pool->desc;
    kvx_put32(d, DESC_MAGIC);
    kvx_put16(d + 4, DESC_VERSION);
    kvx_put16(d + 6, DESC_HDR);
    kvx_put32(d + 8, (uint32_t)pool->desc_len);
    kvx_put32(d + 12, layout->n_layers);
    kvx_put32(d + 16, layout->n_blocks);
    kvx_put32(d + 20, (uint32_t)ctx->worker_addr_len);
    kvx_put64(d + 24, layout->block_stride);
    kvx_put64(d + 32, layout->fingerprint);
    kvx_put64(d + 40, ctx->instance);
    kvx_put64(d + 48, (uint64_t)(uintptr_t)pool->base);
    kvx_put32(d + 56, (uint32_t)rkey_len);
    memcpy(d + DESC_HDR, ctx->worker_addr, ctx->worker_addr_len);
    memcpy(d + DESC_HDR + ctx->worker_addr_len, rkey_buf, rkey_len);
    kvx_put32(d + pool->desc_len - 4, bt_crc32c(0, d, pool->desc_len - 4));
    ucp_rkey_buffer_release(rkey_buf);
    pool->next = ctx->pools;
    ctx->pools = pool;
    pthread_mutex_unlock(&ctx->mu);
    if (!mem) memset(pool->base, 0, bytes);
    *out = pool;
    return BT_OK;

fail_rkey:
    ucp_rkey_buffer_release(rkey_buf);
fail_unmap:
    ucp_mem_unmap(ctx->ucp, pool->memh);
fail:
    pthread_mutex_unlock(&ctx->mu);
    free(pool);
    return st;
}

bt_status kvx_pool_create(kvx_context_t *ctx, const kvx_layout_t *layout, kvx_pool_t **out)
{
    return pool_map(ctx, layout, NULL, KVX_MEM_HOST, out);
}

bt_status kvx_pool_register(kvx_context_t *ctx, const kvx_layout_t *layout, void *mem, kvx_mem_type_t mt,
                            kvx_pool_t **out)
{
    if (!mem) return bt_fail(BT_ERR_INVALID, "kvx: no memory to register");
    if (mt == KVX_MEM_CUDA) {
        /* ucp_mem_map does not check the type against the transports (Debian's UCX 1.13 maps "CUDA" memory with its
         * host transports, which would then read device addresses on the host): ask the context what it moves */
        ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
        if (ucp_context_query(ctx->ucp, &ca) != UCS_OK || !(ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)))
            return bt_fail(BT_ERR_UNSUPPORTED, "kvx: this UCX cannot move CUDA memory (built without CUDA support: "
                                               "`ucx_info -d` lists no cuda_copy, cuda_ipc or gdr_copy transport)");
    }
    return pool_map(ctx, layout, mem, mt, out);
}

bt_status kvx_pool_destroy(kvx_pool_t *pool)
{
    if (!pool) return BT_OK;
    kvx_context_t *ctx = pool->ctx;
    pthread_mutex_lock(&ctx->mu);
    /* Pushes released by their owner may still have UCX requests in flight: give them a moment. */
    uint64_t until = kvx_now_ms() + 5000;
    while (pool->users > 0 && kvx_now_ms() < until) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        kvx_kick(ctx);
        pthread_cond_timedwait(&ctx->cv, &ctx->mu, &ts);
    }
    if (pool->users > 0) {
        int users = pool->users;
        pthread_mutex_unlock(&ctx->mu);
        return bt_fail(BT_ERR_INVALID, "kvx: pool still has %d transfers", users);
    }
    for (kvx_pool_t **pp = &ctx->pools; *pp; pp = &(*pp)->next) {
        if (*pp == pool) {
            *pp = pool->next;
            break;
        }
    }
    ucp_mem_unmap(ctx->ucp, pool->memh);
    pthread_mutex_unlock(&ctx->mu);
    free(pool->desc);
    free(pool);
    return BT_OK;
}

void *kvx_pool_base(const kvx_pool_t *pool)
{
    return pool->base;
}

const kvx_layout_t *kvx_pool_layout(const kvx_pool_t *pool)
{
    return &pool->layout;
}

const void *kvx_pool_descriptor(const kvx_pool_t *pool, size_t *len)
{
    *len = pool->desc_len;
    return pool->desc;
}

size_t kvx_pool_blocks_pending(const kvx_pool_t *pool)
{
    kvx_context_t *ctx = pool->ctx;
    pthread_mutex_lock(&ctx->mu);
    size_t n = pool->pending_blocks;
    pthread_mutex_unlock(&ctx->mu);
    return n;
}
