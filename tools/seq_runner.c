#include "tools/seq_runner.h"

#include "engine/backend_cpu.h"

#include <stdlib.h>
#include <string.h>

bt_status seq_runner_init(seq_runner *r, const bt_model *m, const cli_engine_env *env, int32_t n_ctx, int32_t chunk,
                          bt_kv_dtype dtype)
{
    memset(r, 0, sizeof *r);
    r->model = m;
    r->n_ctx = n_ctx;
    r->chunk = chunk;
    r->n_blocks = (n_ctx + BT_KV_BLOCK - 1) / BT_KV_BLOCK;
    bt_status st = cli_backend_create(env, &r->be);
    if (st) return st;
    if ((st = bt_forward_create(m, r->be, chunk, env->profile, &r->fw))) goto fail;
    size_t mem = bt_kv_block_stride(&m->hp, dtype) * (size_t)m->hp.n_layer * (size_t)r->n_blocks;
    if ((st = bt_backend_kv_pool_create(r->be, &m->hp, dtype, mem, &r->kv))) goto fail;
    r->table = malloc((size_t)r->n_blocks * sizeof *r->table);
    r->logits = malloc((size_t)chunk * (size_t)m->hp.n_vocab * sizeof *r->logits);
    if (!r->table || !r->logits) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory for a sequence of %d tokens", n_ctx);
        goto fail;
    }
    if ((st = bt_kv_pool_alloc(r->kv, r->n_blocks, r->table))) goto fail;
    return BT_OK;
fail:
    seq_runner_free(r);
    return st;
}

void seq_runner_free(seq_runner *r)
{
    bt_forward_destroy(r->fw);
    if (r->be) bt_backend_kv_pool_destroy(r->be, r->kv);
    bt_backend_destroy(r->be);
    free(r->table);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

void seq_runner_reset(seq_runner *r)
{
    r->n_past = 0;
}

bt_status seq_runner_feed(seq_runner *r, const int32_t *tokens, int32_t n, int all_logits)
{
    if (n < 1) return bt_fail(BT_ERR_INVALID, "nothing to feed");
    if (r->n_past + n > r->n_ctx)
        return bt_fail(BT_ERR_INVALID, "sequence of %d tokens exceeds the context of %d", r->n_past + n, r->n_ctx);
    if (all_logits && n > r->chunk) return bt_fail(BT_ERR_INVALID, "all_logits needs n <= chunk (%d)", r->chunk);
    int32_t pos[r->chunk], seq[r->chunk], rows[r->chunk];
    bt_seq_view sv = {.block_table = r->table, .n_blocks = r->n_blocks};
    for (int32_t done = 0; done < n;) {
        int32_t m = n - done < r->chunk ? n - done : r->chunk;
        for (int32_t i = 0; i < m; i++) {
            pos[i] = r->n_past + i;
            seq[i] = 0;
            rows[i] = i;
        }
        int last_chunk = done + m == n;
        bt_batch b = {
            .n_tokens = m, .tokens = tokens + done, .pos = pos, .seq = seq, .seqs = &sv, .n_seqs = 1,
            .logit_rows = all_logits ? rows : &rows[m - 1], .n_logits = last_chunk ? (all_logits ? m : 1) : 0,
        };
        bt_status st = bt_forward_run(r->fw, r->kv, &b, r->logits);
        if (st) return st;
        r->n_past += m;
        done += m;
    }
    return BT_OK;
}

void seq_runner_rewind(seq_runner *r, int32_t n)
{
    if (n < 0) n = 0;
    if (n < r->n_past) r->n_past = n;
}
