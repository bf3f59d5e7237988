#include "engine/forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

/* BATON_PROFILE=1: wall time per op kind, summed separately over decode-only steps (one new token per sequence)
 * and steps that carry prompt chunks, logged when the forward pass is destroyed. */
enum { P_EMBED, P_NORM, P_QKV, P_ROPE, P_KV_WRITE, P_ATTN, P_WO, P_GATE_UP, P_SWIGLU, P_DOWN, P_ADD, P_HEAD, P_N };
static const char *const prof_names[P_N] = {"embed", "rmsnorm", "qkv", "rope", "kv_write", "attention", "wo",
                                            "gate_up", "swiglu", "down", "add", "output"};

typedef struct prof_acc {
    double sec[P_N];
    long steps, tokens;
} prof_acc;

struct bt_forward {
    const bt_model *m;
    bt_backend *be;
    int32_t max_tokens;
    float *x;       /* [T][n_embd] residual stream */
    float *h;       /* [T][n_embd] normed input of a sub-layer */
    float *q;       /* [T][n_head][head_dim] */
    float *k, *v;   /* [T][n_head_kv][head_dim] */
    float *att;     /* [T][n_head][head_dim] */
    float *g, *u;   /* [T][n_ff] */
    float *tmp;     /* [T][n_embd] sub-layer output */
    int32_t *slots; /* [T] */
    const int32_t **tables; /* [T] */
    bt_forward_layer_fn layer_fn; /* optional: after each layer's K/V are in the pool */
    void *layer_user;
    int profile;      /* BATON_PROFILE set */
    prof_acc prof[2]; /* [0] decode-only steps, [1] steps with prompt chunks */
    prof_acc *cur;    /* the accumulator of the running step, NULL when not profiling */
    double t_mark;
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* charges the time since the previous mark to op kind k */
static void mark(bt_forward *fw, int k)
{
    if (!fw->cur) return;
    double t = mono_s();
    fw->cur->sec[k] += t - fw->t_mark;
    fw->t_mark = t;
}

static void prof_log(const bt_forward *fw)
{
    for (int c = 0; c < 2; c++) {
        const prof_acc *a = &fw->prof[c];
        if (!a->steps) continue;
        char line[512];
        int n = 0;
        double total = 0;
        for (int k = 0; k < P_N; k++) total += a->sec[k];
        for (int k = 0; k < P_N && n < (int)sizeof line; k++)
            n += snprintf(line + n, sizeof line - (size_t)n, " %s %.3f", prof_names[k], a->sec[k] * 1e3 / (double)a->steps);
        BT_INFO("forward", "profile of %ld %s steps (%.1f tokens/step), %.3f ms/step:%s", a->steps,
                c == 0 ? "decode" : "prefill", (double)a->tokens / (double)a->steps, total * 1e3 / (double)a->steps,
                line);
    }
}

void bt_forward_set_layer_hook(bt_forward *fw, bt_forward_layer_fn fn, void *user)
{
    fw->layer_fn = fn;
    fw->layer_user = user;
}

static void *balloc(bt_forward *fw, size_t n)
{
    return fw->be->ops->buf_alloc(fw->be, n);
}

void bt_forward_destroy(bt_forward *fw)
{
    if (!fw) return;
    if (fw->profile) prof_log(fw);
    float *bufs[] = {fw->x, fw->h, fw->q, fw->k, fw->v, fw->att, fw->g, fw->u, fw->tmp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) fw->be->ops->buf_free(fw->be, bufs[i]);
    free(fw->slots);
    free(fw->tables);
    free(fw);
}

bt_status bt_forward_create(const bt_model *m, bt_backend *be, int32_t max_tokens, bt_forward **out)
{
    if (max_tokens < 1) return bt_fail(BT_ERR_INVALID, "forward: max_tokens must be >= 1");
    bt_forward *fw = calloc(1, sizeof *fw);
    if (!fw) return bt_fail(BT_ERR_NOMEM, "out of memory for forward scratch");
    fw->m = m;
    fw->be = be;
    fw->max_tokens = max_tokens;
    const char *pe = getenv("BATON_PROFILE");
    fw->profile = pe && *pe && strcmp(pe, "0") != 0;
    const bt_hparams *hp = &m->hp;
    size_t T = (size_t)max_tokens, E = (size_t)hp->n_embd;
    size_t Q = (size_t)hp->n_head * (size_t)hp->head_dim, KV = (size_t)hp->n_head_kv * (size_t)hp->head_dim;
    size_t F = (size_t)hp->n_ff;
    fw->x = balloc(fw, T * E * 4);
    fw->h = balloc(fw, T * (E > Q ? E : Q) * 4);
    fw->q = balloc(fw, T * Q * 4);
    fw->k = balloc(fw, T * KV * 4);
    fw->v = balloc(fw, T * KV * 4);
    fw->att = balloc(fw, T * Q * 4);
    fw->g = balloc(fw, T * F * 4);
    fw->u = balloc(fw, T * F * 4);
    fw->tmp = balloc(fw, T * E * 4);
    fw->slots = malloc(T * sizeof *fw->slots);
    fw->tables = malloc(T * sizeof *fw->tables);
    if (!fw->x || !fw->h || !fw->q || !fw->k || !fw->v || !fw->att || !fw->g || !fw->u || !fw->tmp || !fw->slots ||
        !fw->tables) {
        bt_forward_destroy(fw);
        return bt_fail(BT_ERR_NOMEM, "out of memory for forward scratch of %d tokens", max_tokens);
    }
    *out = fw;
    return BT_OK;
}

int32_t bt_forward_max_tokens(const bt_forward *fw)
{
    return fw->max_tokens;
}

static bt_status check_batch(const bt_forward *fw, const bt_kv_pool *kv, const bt_batch *b)
{
    const bt_hparams *hp = &fw->m->hp;
    if (b->n_tokens < 1 || b->n_tokens > fw->max_tokens)
        return bt_fail(BT_ERR_INVALID, "batch of %d tokens (1..%d allowed)", b->n_tokens, fw->max_tokens);
    if (kv->n_layer != hp->n_layer || kv->n_head_kv != hp->n_head_kv || kv->head_dim != hp->head_dim)
        return bt_fail(BT_ERR_INVALID, "KV pool layout does not match the model");
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab)
            return bt_fail(BT_ERR_INVALID, "token id %d out of range (vocabulary %d)", b->tokens[i], hp->n_vocab);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            return bt_fail(BT_ERR_INVALID, "token %d names sequence %d of %d", i, b->seq[i], b->n_seqs);
        const bt_seq_view *s = &b->seqs[b->seq[i]];
        int32_t p = b->pos[i];
        if (p < 0 || p / BT_KV_BLOCK >= s->n_blocks)
            return bt_fail(BT_ERR_INVALID, "position %d is outside its sequence's %d KV blocks", p, s->n_blocks);
        for (int32_t j = 0; j <= p / BT_KV_BLOCK; j++)
            if (s->block_table[j] < 0 || s->block_table[j] >= kv->n_blocks)
                return bt_fail(BT_ERR_INVALID, "KV block id %d outside the pool (%d blocks)", s->block_table[j],
                               kv->n_blocks);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens)
            return bt_fail(BT_ERR_INVALID, "logit row %d outside the batch", b->logit_rows[i]);
    return BT_OK;
}

/* Several projections of the same input: fused when the backend offers it (one quantization, one pool run). */
static bt_status matmuls(bt_forward *fw, const bt_weight *const *ws, const float *const *bs, int n, const float *x,
                         int32_t n_rows, float *const *outs)
{
    bt_backend *be = fw->be;
    if (be->ops->matmul_multi) return be->ops->matmul_multi(be, ws, bs, n, x, n_rows, outs);
    for (int i = 0; i < n; i++) {
        bt_status st = be->ops->matmul(be, ws[i], bs[i], x, n_rows, outs[i]);
        if (st) return st;
    }
    return BT_OK;
}

bt_status bt_forward_run(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits)
{
    bt_status st = check_batch(fw, kv, b);
    if (st) return st;
    const bt_model *m = fw->m;
    const bt_hparams *hp = &m->hp;
    const bt_backend_ops *op = fw->be->ops;
    bt_backend *be = fw->be;
    int32_t T = b->n_tokens, E = hp->n_embd;

    for (int32_t i = 0; i < T; i++) {
        const bt_seq_view *s = &b->seqs[b->seq[i]];
        fw->slots[i] = s->block_table[b->pos[i] / BT_KV_BLOCK] * BT_KV_BLOCK + b->pos[i] % BT_KV_BLOCK;
        fw->tables[i] = s->block_table;
    }
    fw->cur = NULL;
    if (fw->profile) {
        fw->cur = &fw->prof[T == b->n_seqs ? 0 : 1];
        fw->cur->steps++;
        fw->cur->tokens += T;
        fw->t_mark = mono_s();
    }
    op->embed(be, &m->tok_embd, b->tokens, T, fw->x);
    mark(fw, P_EMBED);
    bt_attn_args aa = {
        .kv = kv, .n_tokens = T, .n_head = hp->n_head, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
        .scale = 1.0f / sqrtf((float)hp->head_dim), .q = fw->q, .pos = b->pos, .tables = fw->tables, .out = fw->att,
    };
    for (int32_t l = 0; l < hp->n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        op->rmsnorm(be, fw->x, L->attn_norm.data, T, E, hp->rms_eps, fw->h);
        mark(fw, P_NORM);
        {
            const bt_weight *ws[3] = {&L->wq, &L->wk, &L->wv};
            const float *bs[3] = {L->bq.data, L->bk.data, L->bv.data};
            float *outs[3] = {fw->q, fw->k, fw->v};
            if ((st = matmuls(fw, ws, bs, 3, fw->h, T, outs))) return st;
        }
        mark(fw, P_QKV);
        op->rope(be, fw->q, b->pos, T, hp->n_head, hp->head_dim, hp->n_rot, hp->rope_base, hp->rope_freq_scale,
                 hp->rope_neox);
        op->rope(be, fw->k, b->pos, T, hp->n_head_kv, hp->head_dim, hp->n_rot, hp->rope_base, hp->rope_freq_scale,
                 hp->rope_neox);
        mark(fw, P_ROPE);
        op->kv_write(be, kv, l, fw->k, fw->v, T, fw->slots);
        mark(fw, P_KV_WRITE);
        /* this layer's KV of the whole batch is final now: a prefill node starts moving it while the rest of the
         * layer (and the later layers) compute */
        if (fw->layer_fn) fw->layer_fn(fw->layer_user, l);
        aa.layer = l;
        if ((st = op->attention(be, &aa))) return st;
        mark(fw, P_ATTN);
        if ((st = op->matmul(be, &L->wo, NULL, fw->att, T, fw->tmp))) return st;
        mark(fw, P_WO);
        op->add(be, fw->x, fw->tmp, (int64_t)T * E);
        mark(fw, P_ADD);

        op->rmsnorm(be, fw->x, L->ffn_norm.data, T, E, hp->rms_eps, fw->h);
        mark(fw, P_NORM);
        {
            const bt_weight *ws[2] = {&L->w_gate, &L->w_up};
            const float *bs[2] = {NULL, NULL};
            float *outs[2] = {fw->g, fw->u};
            if ((st = matmuls(fw, ws, bs, 2, fw->h, T, outs))) return st;
        }
        mark(fw, P_GATE_UP);
        op->swiglu(be, fw->g, fw->u, (int64_t)T * hp->n_ff, fw->g);
        mark(fw, P_SWIGLU);
        if ((st = op->matmul(be, &L->w_down, NULL, fw->g, T, fw->tmp))) return st;
        mark(fw, P_DOWN);
        op->add(be, fw->x, fw->tmp, (int64_t)T * E);
        mark(fw, P_ADD);
    }
    if (b->n_logits == 0) return BT_OK;
    /* Only the rows that need logits go through the final norm and the (large) output matrix. */
    for (int32_t i = 0; i < b->n_logits; i++)
        memcpy(fw->tmp + (size_t)i * (size_t)E, fw->x + (size_t)b->logit_rows[i] * (size_t)E, (size_t)E * 4);
    op->rmsnorm(be, fw->tmp, m->output_norm.data, b->n_logits, E, hp->rms_eps, fw->h);
    st = op->matmul(be, &m->output, NULL, fw->h, b->n_logits, logits);
    mark(fw, P_HEAD);
    return st;
}
