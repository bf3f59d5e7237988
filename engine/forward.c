#include "engine/forward.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/env.h"
#include "common/log.h"

/* BATON_PROFILE=1: wall time per op kind, summed separately over decode-only steps (one new token per sequence)
 * and steps that carry prompt chunks, logged when the forward pass is destroyed. */
enum { P_EMBED, P_NORM, P_QKV, P_ROPE, P_KV_WRITE, P_ATTN, P_WO, P_GATE_UP, P_SWIGLU, P_DOWN, P_ADD, P_HEAD, P_N };
static const char *const prof_names[P_N] = {"embed", "rmsnorm", "qkv", "rope", "kv_write", "attention", "wo",
                                            "gate_up", "swiglu", "down", "add", "output"};

typedef struct prof_acc {
    double sec[P_N];
    double wall; /* the whole bt_forward_run, every lane and the wait for the last one included */
    long steps, tokens, lane_steps;
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
    int32_t *lslots; /* [T] slots in the sliding-window layers' block space (= slots without local tables) */
    const int32_t **ltables; /* [T] */
    bt_forward_layer_fn layer_fn; /* optional: after each layer's K/V are in the pool */
    void *layer_user;
    int64_t lane_steps; /* steps run on lanes */
    int profile;      /* BATON_PROFILE set */
    prof_acc prof[2]; /* [0] decode-only steps, [1] steps with prompt chunks */
    prof_acc *cur;    /* the accumulator of the running step, NULL when not profiling */
};

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The tokens [t0, t0 + n) of a step, run on one backend (the backend itself, or one of its lanes). */
typedef struct span {
    bt_backend *be;
    int32_t t0, n;
    prof_acc *cur; /* where op times go (NULL: not profiled) */
    double t_mark;
} span;

/* charges the time since the previous mark to op kind k */
static void mark(span *sp, int k)
{
    if (!sp->cur) return;
    double t = mono_s();
    sp->cur->sec[k] += t - sp->t_mark;
    sp->t_mark = t;
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
        char lanes[64] = "";
        if (a->lane_steps) snprintf(lanes, sizeof lanes, ", %ld on lanes: lane 0's times", a->lane_steps);
        BT_INFO("forward", "profile of %ld %s steps (%.1f tokens/step%s), %.3f ms/step (wall %.3f):%s", a->steps,
                c == 0 ? "decode" : "prefill", (double)a->tokens / (double)a->steps, lanes,
                total * 1e3 / (double)a->steps, a->wall * 1e3 / (double)a->steps, line);
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

void bt_forward_profile_reset(bt_forward *fw)
{
    memset(fw->prof, 0, sizeof fw->prof);
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
    free(fw->lslots);
    free(fw->ltables);
    free(fw);
}

bt_status bt_forward_profile_from_env(int *profile)
{
    static const char *const off_on[] = {"0", "1"};
    return bt_env_choice("BATON_PROFILE", off_on, 2, 0, profile);
}

bt_status bt_forward_create(const bt_model *m, bt_backend *be, int32_t max_tokens, int profile, bt_forward **out)
{
    if (max_tokens < 1) return bt_fail(BT_ERR_INVALID, "forward: max_tokens must be >= 1");
    if (m->hp.gemma && (!be->ops->geglu || !be->ops->scale))
        return bt_fail(BT_ERR_UNSUPPORTED, "the %s backend has no geglu or scale op, which %s models need",
                       be->ops->name, m->hp.arch);
    bt_forward *fw = calloc(1, sizeof *fw);
    if (!fw) return bt_fail(BT_ERR_NOMEM, "out of memory for forward scratch");
    fw->m = m;
    fw->be = be;
    fw->max_tokens = max_tokens;
    fw->profile = profile != 0;
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
    fw->lslots = malloc(T * sizeof *fw->lslots);
    fw->ltables = malloc(T * sizeof *fw->ltables);
    if (!fw->x || !fw->h || !fw->q || !fw->k || !fw->v || !fw->att || !fw->g || !fw->u || !fw->tmp || !fw->slots ||
        !fw->tables || !fw->lslots || !fw->ltables) {
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

int64_t bt_forward_lane_steps(const bt_forward *fw)
{
    return fw->lane_steps;
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
        if (!s->local_table) continue;
        /* the local layers read keys from p - window + 1 on: earlier entries may have been released */
        if (hp->swa_window <= 0 || p / BT_KV_BLOCK >= s->n_local_blocks)
            return bt_fail(BT_ERR_INVALID, "position %d: local block table of %d blocks (window %d)", p,
                           s->n_local_blocks, hp->swa_window);
        int32_t j0 = p > hp->swa_window ? (p - hp->swa_window) / BT_KV_BLOCK : 0;
        for (int32_t j = j0; j <= p / BT_KV_BLOCK; j++)
            if (s->local_table[j] < 0 || s->local_table[j] >= kv->n_blocks)
                return bt_fail(BT_ERR_INVALID, "local KV block id %d (entry %d, position %d) outside the pool (%d "
                               "blocks)", s->local_table[j], j, p, kv->n_blocks);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens)
            return bt_fail(BT_ERR_INVALID, "logit row %d outside the batch", b->logit_rows[i]);
    if (b->n_hidden < 0 || b->n_hidden > b->n_tokens || (b->n_hidden && (!b->hidden_rows || !b->hidden)))
        return bt_fail(BT_ERR_INVALID, "%d hidden rows for a batch of %d tokens", b->n_hidden, b->n_tokens);
    for (int32_t i = 0; i < b->n_hidden; i++)
        if (b->hidden_rows[i] < 0 || b->hidden_rows[i] >= b->n_tokens)
            return bt_fail(BT_ERR_INVALID, "hidden row %d outside the batch", b->hidden_rows[i]);
    return BT_OK;
}

/* Several projections of the same input: fused when the backend offers it (one quantization, one pool run). */
static bt_status matmuls(bt_backend *be, const bt_weight *const *ws, const float *const *bs, int n, const float *x,
                         int32_t n_rows, float *const *outs)
{
    if (be->ops->matmul_multi) return be->ops->matmul_multi(be, ws, bs, n, x, n_rows, outs);
    for (int i = 0; i < n; i++) {
        bt_status st = be->ops->matmul(be, ws[i], bs[i], x, n_rows, outs[i]);
        if (st) return st;
    }
    return BT_OK;
}

static bt_status run_head(bt_forward *fw, const bt_batch *b, float *logits, span *sp, int32_t i0, int32_t i1);

/* Every layer, then the logits of rows [i0, i1) of the batch's logit rows, for the tokens of sp. Lanes (sp not the
 * whole batch) run only where each lane's logit rows are its own tokens (i0 = t0), so no lane writes scratch rows
 * of another. */
static bt_status run_span(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits, span *sp, int32_t i0,
                          int32_t i1)
{
    const bt_model *m = fw->m;
    const bt_hparams *hp = &m->hp;
    bt_backend *be = sp->be;
    const bt_backend_ops *op = be->ops;
    bt_status st;
    int32_t T = sp->n, E = hp->n_embd;
    size_t t0 = (size_t)sp->t0, Q = (size_t)hp->n_head * (size_t)hp->head_dim;
    size_t KV = (size_t)hp->n_head_kv * (size_t)hp->head_dim, F = (size_t)hp->n_ff;
    float *x = fw->x + t0 * (size_t)E, *h = fw->h + t0 * (size_t)E, *tmp = fw->tmp + t0 * (size_t)E;
    float *q = fw->q + t0 * Q, *k = fw->k + t0 * KV, *v = fw->v + t0 * KV, *att = fw->att + t0 * Q;
    float *g = fw->g + t0 * F, *u = fw->u + t0 * F;
    const int32_t *pos = b->pos + t0;

    op->embed(be, &m->tok_embd, b->tokens + t0, T, x);
    if (hp->embd_scale > 0 && hp->embd_scale != 1.0f) op->scale(be, x, hp->embd_scale, (int64_t)T * E);
    mark(sp, P_EMBED);
    bt_attn_args aa = {
        .kv = kv, .n_tokens = T, .n_head = hp->n_head, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
        .scale = hp->attn_scale > 0 ? hp->attn_scale : 1.0f / sqrtf((float)hp->head_dim), .q = q, .pos = pos, .tables = fw->tables + t0, .out = att,
    };
    for (int32_t l = 0; l < hp->n_layer; l++) {
        const bt_layer *L = &m->layers[l];
        op->rmsnorm(be, x, L->attn_norm.data, T, E, hp->rms_eps, h);
        mark(sp, P_NORM);
        {
            const bt_weight *ws[3] = {&L->wq, &L->wk, &L->wv};
            const float *bs[3] = {L->bq.data, L->bk.data, L->bv.data};
            float *outs[3] = {q, k, v};
            if ((st = matmuls(be, ws, bs, 3, h, T, outs))) return st;
        }
        mark(sp, P_QKV);
        if (hp->gemma) { /* every head normed on its own before RoPE */
            op->rmsnorm(be, q, L->q_norm.data, T * hp->n_head, hp->head_dim, hp->rms_eps, q);
            op->rmsnorm(be, k, L->k_norm.data, T * hp->n_head_kv, hp->head_dim, hp->rms_eps, k);
            mark(sp, P_NORM);
        }
        float base = L->rope_base > 0 ? L->rope_base : hp->rope_base; /* 0 in a bt_layer not made by the loader */
        op->rope(be, q, pos, T, hp->n_head, hp->head_dim, hp->n_rot, base, hp->rope_freq_scale, hp->rope_neox);
        op->rope(be, k, pos, T, hp->n_head_kv, hp->head_dim, hp->n_rot, base, hp->rope_freq_scale, hp->rope_neox);
        mark(sp, P_ROPE);
        int local = L->window > 0; /* a sliding-window layer: its own block space when the batch brings one */
        op->kv_write(be, kv, l, k, v, T, (local ? fw->lslots : fw->slots) + t0);
        mark(sp, P_KV_WRITE);
        /* this layer's KV of the whole batch is final now: a prefill node starts moving it while the rest of the
         * layer (and the later layers) compute (never with lanes: see lanes_for) */
        if (fw->layer_fn) fw->layer_fn(fw->layer_user, l);
        aa.layer = l;
        aa.window = L->window;
        aa.tables = (local ? fw->ltables : fw->tables) + t0;
        if ((st = op->attention(be, &aa))) return st;
        mark(sp, P_ATTN);
        if ((st = op->matmul(be, &L->wo, NULL, att, T, tmp))) return st;
        mark(sp, P_WO);
        if (hp->gemma) {
            op->rmsnorm(be, tmp, L->post_attn_norm.data, T, E, hp->rms_eps, tmp);
            mark(sp, P_NORM);
        }
        op->add(be, x, tmp, (int64_t)T * E);
        mark(sp, P_ADD);

        op->rmsnorm(be, x, L->ffn_norm.data, T, E, hp->rms_eps, h);
        mark(sp, P_NORM);
        {
            const bt_weight *ws[2] = {&L->w_gate, &L->w_up};
            const float *bs[2] = {NULL, NULL};
            float *outs[2] = {g, u};
            if ((st = matmuls(be, ws, bs, 2, h, T, outs))) return st;
        }
        mark(sp, P_GATE_UP);
        if (hp->gemma)
            op->geglu(be, g, u, (int64_t)T * hp->n_ff, g);
        else
            op->swiglu(be, g, u, (int64_t)T * hp->n_ff, g);
        mark(sp, P_SWIGLU);
        if ((st = op->matmul(be, &L->w_down, NULL, g, T, tmp))) return st;
        mark(sp, P_DOWN);
        if (hp->gemma) {
            op->rmsnorm(be, tmp, L->post_ffn_norm.data, T, E, hp->rms_eps, tmp);
            mark(sp, P_NORM);
        }
        op->add(be, x, tmp, (int64_t)T * E);
        mark(sp, P_ADD);
    }
    return run_head(fw, b, logits, sp, i0, i1);
}

/* The logits of rows [i0, i1) of the batch's logit rows from the final residual stream in fw->x: only the rows that
 * need logits go through the final norm and the (large) output matrix. */
static bt_status run_head(bt_forward *fw, const bt_batch *b, float *logits, span *sp, int32_t i0, int32_t i1)
{
    const bt_model *m = fw->m;
    const bt_hparams *hp = &m->hp;
    bt_backend *be = sp->be;
    const bt_backend_ops *op = be->ops;
    int32_t E = hp->n_embd;
    if (i1 <= i0) return BT_OK;
    for (int32_t i = i0; i < i1; i++)
        bt_backend_copy(be, fw->tmp + (size_t)i * (size_t)E, fw->x + (size_t)b->logit_rows[i] * (size_t)E,
                        (size_t)E * 4);
    op->rmsnorm(be, fw->tmp + (size_t)i0 * (size_t)E, m->output_norm.data, i1 - i0, E, hp->rms_eps,
                fw->h + (size_t)i0 * (size_t)E);
    bt_status st = op->matmul(be, &m->output, NULL, fw->h + (size_t)i0 * (size_t)E, i1 - i0,
                              logits + (size_t)i0 * (size_t)hp->n_vocab);
    mark(sp, P_HEAD);
    return st;
}

/* Lanes: a decode step of at least this many sequences per lane splits its sequences over the backend's lanes.
 * Each lane then runs every op of its sequences on its own thread, with no fork and join per op (a step of 16
 * sequences had 150+ of them, each with a serial activation quantization and the tail of its last task). One
 * thread with 8 sequences takes the step time of 2 lanes with 16: lanes lose nothing to each other. With fewer
 * sequences per lane, each lane's matmuls have too few rows to reuse a weight from cache, and the pool's split of
 * each op wins. Measured on 2 threads (baton bench --concurrency, alternated runs): 8 sequences as 2 lanes of 4
 * ~10% faster than whole, 4 as 2 lanes of 2 ~15% slower; 16: ~25% faster. */
#define LANE_MIN_SEQS 4

typedef struct lanes_ctx {
    bt_forward *fw;
    bt_kv_pool *kv;
    const bt_batch *b;
    float *logits;
    int n_lanes;
} lanes_ctx;

/* Where lane i's tokens start: the first sequence boundary at or after an even share of the tokens (a sequence's
 * tokens stay on one lane: a draft row attends to the KV its sequence's earlier rows write in the same layer). */
static int32_t lane_start(const bt_batch *b, int i, int n_lanes)
{
    int32_t t = (int32_t)((int64_t)b->n_tokens * i / n_lanes);
    while (t > 0 && t < b->n_tokens && b->seq[t] == b->seq[t - 1]) t++;
    return t;
}

static bt_status lane_body(bt_backend *lane, int i, void *user)
{
    lanes_ctx *lc = user;
    int32_t t0 = lane_start(lc->b, i, lc->n_lanes), t1 = lane_start(lc->b, i + 1, lc->n_lanes);
    if (t1 <= t0) return BT_OK;
    span sp = {.be = lane, .t0 = t0, .n = t1 - t0};
    if (i == 0 && lc->fw->cur) { /* lane 0's op times stand for the step's */
        sp.cur = lc->fw->cur;
        sp.t_mark = mono_s();
    }
    return run_span(lc->fw, lc->kv, lc->b, lc->logits, &sp, t0, t0); /* the logits after the lanes join */
}

/* Lanes for this batch (0: run it whole): decode steps only (every token wants its logits, in order; a sequence's
 * tokens are its last token and its speculative drafts, contiguous, sequences in order), no layer hook (it reports
 * each layer once for the whole batch). Sequences never write KV blocks another reads (shared blocks are copied
 * before a write), so lanes need no order between them. */
static int lanes_for(const bt_forward *fw, const bt_batch *b)
{
    bt_backend *be = fw->be;
    if (!be->ops->run_lanes || !be->ops->max_lanes || fw->layer_fn || b->n_logits != b->n_tokens || b->n_hidden)
        return 0;
    int n = be->ops->max_lanes(be);
    if (n > b->n_seqs / LANE_MIN_SEQS) n = b->n_seqs / LANE_MIN_SEQS;
    if (n < 2) return 0;
    for (int32_t i = 0; i < b->n_tokens; i++) {
        int32_t prev = i ? b->seq[i - 1] : -1;
        if (b->logit_rows[i] != i || (b->seq[i] != prev && b->seq[i] != prev + 1)) return 0;
    }
    return n;
}

static bt_status forward_run(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits);

bt_status bt_forward_run(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits)
{
    if (!fw->profile) return forward_run(fw, kv, b, logits);
    double t0 = mono_s();
    bt_status st = forward_run(fw, kv, b, logits);
    if (fw->cur) fw->cur->wall += mono_s() - t0;
    return st;
}

static bt_status forward_run(bt_forward *fw, bt_kv_pool *kv, const bt_batch *b, float *logits)
{
    bt_status st = check_batch(fw, kv, b);
    if (st) return st;
    int32_t T = b->n_tokens;

    for (int32_t i = 0; i < T; i++) {
        const bt_seq_view *s = &b->seqs[b->seq[i]];
        fw->slots[i] = s->block_table[b->pos[i] / BT_KV_BLOCK] * BT_KV_BLOCK + b->pos[i] % BT_KV_BLOCK;
        fw->tables[i] = s->block_table;
        const int32_t *lt = s->local_table ? s->local_table : s->block_table;
        fw->lslots[i] = lt[b->pos[i] / BT_KV_BLOCK] * BT_KV_BLOCK + b->pos[i] % BT_KV_BLOCK;
        fw->ltables[i] = lt;
    }
    fw->cur = NULL;
    if (fw->profile) {
        fw->cur = &fw->prof[T == b->n_seqs ? 0 : 1];
        fw->cur->steps++;
        fw->cur->tokens += T;
    }
    int n_lanes = lanes_for(fw, b);
    if (n_lanes) {
        lanes_ctx lc = {fw, kv, b, logits, n_lanes};
        fw->lane_steps++;
        if (fw->cur) fw->cur->lane_steps++;
        if ((st = fw->be->ops->run_lanes(fw->be, n_lanes, lane_body, &lc))) return st;
        /* The logits of every row in one matmul on the whole backend: the output matrix is read once a step instead
         * of once per lane, which matters where it does not stay in cache (Gemma 3's 178 MB) */
        span hs = {.be = fw->be, .t0 = 0, .n = T, .cur = fw->cur, .t_mark = fw->cur ? mono_s() : 0};
        return run_head(fw, b, logits, &hs, 0, b->n_logits);
    }
    span sp = {.be = fw->be, .t0 = 0, .n = T, .cur = fw->cur, .t_mark = fw->cur ? mono_s() : 0};
    st = run_span(fw, kv, b, logits, &sp, 0, b->n_logits);
    if (st || !b->n_hidden) return st;
    /* the final residual stream of every token is still in x: the output norm of the rows asked for */
    const bt_hparams *hp = &fw->m->hp;
    size_t E = (size_t)hp->n_embd;
    for (int32_t i = 0; i < b->n_hidden; i++)
        bt_backend_copy(fw->be, fw->tmp + (size_t)i * E, fw->x + (size_t)b->hidden_rows[i] * E, E * 4);
    fw->be->ops->rmsnorm(fw->be, fw->tmp, fw->m->output_norm.data, b->n_hidden, (int32_t)E, hp->rms_eps, fw->h);
    fw->be->ops->buf_get(fw->be, b->hidden, fw->h, (size_t)b->n_hidden * E * 4);
    return BT_OK;
}
