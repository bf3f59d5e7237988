/* kvx layout arithmetic and transfer plans: pure functions, no UCX. */
#include <stdlib.h>
#include <string.h>

#include "kvtransfer/kvx.h"

bt_status kvx_layout_check(const kvx_layout_t *l, uint64_t *bytes)
{
    if (!l) return bt_fail(BT_ERR_INVALID, "kvx: no layout");
    if (l->n_layers == 0 || l->n_blocks == 0 || l->block_stride == 0)
        return bt_fail(BT_ERR_INVALID, "kvx: empty layout (%u layers, %u blocks, stride %llu)", l->n_layers,
                       l->n_blocks, (unsigned long long)l->block_stride);
    uint64_t per_layer, total;
    if (__builtin_mul_overflow((uint64_t)l->n_blocks, l->block_stride, &per_layer) ||
        __builtin_mul_overflow(per_layer, (uint64_t)l->n_layers, &total) || total > (uint64_t)SIZE_MAX / 2)
        return bt_fail(BT_ERR_INVALID, "kvx: layout size overflows");
    if (bytes) *bytes = total;
    return BT_OK;
}

bt_status kvx_layout_compatible(const kvx_layout_t *a, const kvx_layout_t *b)
{
    if (a->fingerprint != b->fingerprint)
        return bt_fail(BT_ERR_INVALID, "kvx: layout mismatch: fingerprint %016llx vs remote %016llx",
                       (unsigned long long)a->fingerprint, (unsigned long long)b->fingerprint);
    if (a->n_layers != b->n_layers)
        return bt_fail(BT_ERR_INVALID, "kvx: layout mismatch: %u layers vs remote %u", a->n_layers, b->n_layers);
    if (a->block_stride != b->block_stride)
        return bt_fail(BT_ERR_INVALID, "kvx: layout mismatch: block stride %llu vs remote %llu",
                       (unsigned long long)a->block_stride, (unsigned long long)b->block_stride);
    return BT_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

bt_status kvx_plan_build(const kvx_layout_t *local, const kvx_layout_t *remote, const uint32_t *src,
                         const uint32_t *dst, size_t n, kvx_plan_t *out)
{
    bt_status st;
    uint32_t *sorted = NULL;
    kvx_run_t *runs = NULL;

    if ((st = kvx_layout_check(local, NULL)) != BT_OK) return st;
    if ((st = kvx_layout_check(remote, NULL)) != BT_OK) return st;
    if ((st = kvx_layout_compatible(local, remote)) != BT_OK) return st;
    if (n == 0 || n > KVX_MAX_BLOCKS || !src || !dst)
        return bt_fail(BT_ERR_INVALID, "kvx: %zu blocks (must be 1..%u)", n, KVX_MAX_BLOCKS);
    for (size_t i = 0; i < n; i++) {
        if (src[i] >= local->n_blocks)
            return bt_fail(BT_ERR_INVALID, "kvx: source block %u out of range (pool has %u)", src[i],
                           local->n_blocks);
        if (dst[i] >= remote->n_blocks)
            return bt_fail(BT_ERR_INVALID, "kvx: destination block %u out of range (remote pool has %u)", dst[i],
                           remote->n_blocks);
    }
    sorted = malloc(n * sizeof *sorted);
    if (!sorted) return bt_fail(BT_ERR_NOMEM, "kvx: plan: out of memory");
    memcpy(sorted, dst, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_u32);
    for (size_t i = 1; i < n; i++) {
        if (sorted[i] == sorted[i - 1]) {
            st = bt_fail(BT_ERR_INVALID, "kvx: destination block %u named twice", sorted[i]);
            goto fail;
        }
    }

    size_t n_runs = 1;
    for (size_t i = 1; i < n; i++)
        if (src[i] != src[i - 1] + 1 || dst[i] != dst[i - 1] + 1) n_runs++;
    runs = malloc(n_runs * sizeof *runs);
    if (!runs) {
        st = bt_fail(BT_ERR_NOMEM, "kvx: plan: out of memory");
        goto fail;
    }
    size_t r = 0;
    runs[0] = (kvx_run_t){src[0], dst[0], 1};
    for (size_t i = 1; i < n; i++) {
        if (src[i] == src[i - 1] + 1 && dst[i] == dst[i - 1] + 1) {
            runs[r].n_blocks++;
        } else {
            runs[++r] = (kvx_run_t){src[i], dst[i], 1};
        }
    }
    free(sorted);
    out->local = *local;
    out->remote = *remote;
    out->n_blocks = n;
    out->n_runs = n_runs;
    out->runs = runs;
    return BT_OK;

fail:
    free(runs);
    free(sorted);
    return st;
}

kvx_range_t kvx_plan_range(const kvx_plan_t *plan, uint32_t layer, size_t run)
{
    const kvx_run_t *r = &plan->runs[run];
    kvx_range_t out = {
        .local_off = kvx_layout_offset(&plan->local, layer, r->src_block),
        .remote_off = kvx_layout_offset(&plan->remote, layer, r->dst_block),
        .len = (uint64_t)r->n_blocks * plan->local.block_stride,
    };
    return out;
}

void kvx_plan_free(kvx_plan_t *plan)
{
    if (!plan) return;
    free(plan->runs);
    plan->runs = NULL;
    plan->n_runs = 0;
    plan->n_blocks = 0;
}
