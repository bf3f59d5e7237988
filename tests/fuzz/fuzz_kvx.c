/* libFuzzer target: what a kvtransfer node parses from the network. The first byte picks the input:
 *   0: a pool descriptor (kvx_desc_parse) and, when it parses, a transfer plan into it from block lists taken
 *      from the rest of the input (kvx_plan_build); see fuzz_descriptor for the framing;
 *   1-4: one active message (CLAIM, DONE, DATA, ACK) delivered to a live receiver context that holds a pool with
 *      two pending expectations (epochs 1 and 2), as the UCX progress thread would deliver it (context lock held).
 * A DATA message's header length is the second byte (bit 7 set: the header's base field is replaced by the live
 * pool's base, so that mutations reach the write path). The kvtransfer sources are compiled in so that they are
 * instrumented. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/crc32c.h"
#include "common/log.h"
#include "kvtransfer/kvx.h"
#include "kvtransfer/kvx_internal.h"

/* UCX keeps a few global allocations (configuration parsing) for the process's life; they are not ours. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void)
{
    return "leak:libucs.so\nleak:libucp.so\nleak:libuct.so\n";
}

static kvx_context_t *g_ctx;
static kvx_pool_t *g_pool;
static const kvx_layout_t g_layout = {.n_layers = 2, .n_blocks = 8, .block_stride = 64, .fingerprint = 0x5eed};

static void setup(void)
{
    if (g_ctx) return;
    bt_log_set_level(BT_LOG_ERROR); /* the handlers warn about every malformed message */
    kvx_context_opts_t o = {.name = "fuzz", .data_path = KVX_PATH_AM};
    if (kvx_context_create(&o, &g_ctx) != BT_OK || kvx_pool_create(g_ctx, &g_layout, &g_pool) != BT_OK) abort();
}

/* d: u8 flags (bit 0: recompute the trailing crc32c so that mutations get past it), u16 descriptor length, the
 * descriptor, then (u32 src, u32 dst) block pairs for a plan. */
static void fuzz_descriptor(const uint8_t *d, size_t n)
{
    if (n < 3) return;
    uint8_t flags = d[0];
    size_t dlen = (size_t)d[1] | (size_t)d[2] << 8;
    d += 3, n -= 3;
    if (dlen > n) dlen = n;
    uint8_t *desc = malloc(dlen ? dlen : 1);
    if (!desc) return;
    memcpy(desc, d, dlen);
    if ((flags & 1) && dlen >= 4) {
        uint32_t crc = bt_crc32c(0, desc, dlen - 4);
        memcpy(desc + dlen - 4, &crc, 4);
    }
    kvx_desc_t out;
    if (kvx_desc_parse(desc, dlen, &out) == BT_OK) {
        size_t rest = n - dlen, k = rest / 8;
        uint32_t *src = malloc((k ? k : 1) * 4), *dst = malloc((k ? k : 1) * 4);
        if (src && dst) {
            for (size_t i = 0; i < k; i++) {
                memcpy(&src[i], d + dlen + 8 * i, 4);
                memcpy(&dst[i], d + dlen + 8 * i + 4, 4);
            }
            kvx_layout_t local = out.layout;
            local.n_blocks = 16;
            kvx_plan_t plan;
            if (kvx_plan_build(&local, &out.layout, src, dst, k, &plan) == BT_OK) {
                for (uint32_t l = 0; l < local.n_layers && l < 4; l++)
                    for (size_t r = 0; r < plan.n_runs; r++) (void)kvx_plan_range(&plan, l, r);
                kvx_plan_free(&plan);
            }
        }
        free(src);
        free(dst);
    }
    free(desc);
}

static void fuzz_message(uint8_t which, const uint8_t *d, size_t n)
{
    uint32_t b1[3] = {1, 2, 3}, b2[1] = {5};
    kvx_expect_args_t a1 = {.blocks = b1, .n_blocks = 3, .epoch = 1, .flags = KVX_F_CRC, .timeout_ms = 60000};
    kvx_expect_args_t a2 = {.blocks = b2, .n_blocks = 1, .epoch = 2, .timeout_ms = 60000};
    kvx_expect_t *e1 = NULL, *e2 = NULL;
    if (kvx_expect_create(g_pool, &a1, &e1) != BT_OK || kvx_expect_create(g_pool, &a2, &e2) != BT_OK) abort();
    size_t hlen = 0;
    int real_base = 0;
    if (which == 3 && n >= 1) { /* DATA: u8 header length (bit 7: write our pool's base into the header) */
        hlen = (size_t)(d[0] & 0x7f) <= n - 1 ? (size_t)(d[0] & 0x7f) : n - 1;
        real_base = (d[0] & 0x80) != 0;
        d++, n--;
    }
    /* exact-size copies so that reads past either end are caught */
    uint8_t *hdr = malloc(hlen ? hlen : 1), *body = malloc(n - hlen ? n - hlen : 1);
    if (hdr && body) {
        memcpy(hdr, d, hlen);
        memcpy(body, d + hlen, n - hlen);
        if (real_base && hlen >= 24) {
            uint64_t base = (uint64_t)(uintptr_t)kvx_pool_base(g_pool);
            memcpy(hdr + 16, &base, 8); /* little-endian host, as the wire format */
        }
        ucp_am_recv_param_t p = {.recv_attr = 0, .reply_ep = NULL};
        pthread_mutex_lock(&g_ctx->mu);
        switch (which) {
        case 1: kvx_am_claim_cb(g_ctx, NULL, 0, body, n, &p); break;
        case 2: kvx_am_done_cb(g_ctx, NULL, 0, body, n, &p); break;
        case 3: kvx_am_data_cb(g_ctx, hdr, hlen, body, n - hlen, &p); break;
        default: kvx_am_ack_cb(g_ctx, NULL, 0, body, n, &p); break;
        }
        pthread_mutex_unlock(&g_ctx->mu);
    }
    free(hdr);
    free(body);
    kvx_expect_destroy(e1);
    kvx_expect_destroy(e2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    setup();
    uint8_t which = data[0] % 5;
    if (which == 0)
        fuzz_descriptor(data + 1, size - 1);
    else
        fuzz_message(which, data + 1, size - 1);
    return 0;
}
