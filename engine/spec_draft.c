/* Draft-model proposers (DESIGN 5.5): a small model with the target's vocabulary, or the target's own first L
 * layers (self-drafting by early exit), run on the engine thread with their own KV pool, block manager and forward
 * scratch, over the target's backend. Each sequence's draft KV follows the sequence: at every proposal the draft
 * first catches up on the tokens it has not seen (the whole prompt the first time, prefilled here on the decode node
 * whoever prefilled the target; afterwards the last accepted token or two) and drops the KV of its rejected drafts,
 * then runs k one-token steps batched over every drafting sequence. Draft tokens are drawn with the sequence's own
 * sampler at the same (seed, position) as the target will draw, so a draft close to the target is accepted often;
 * drafts after the first are drawn with a scratch copy of that sampler which has accepted the drafts before them
 * (grammar state, penalties), as the target's will have when it verifies them, and a draft that would end the
 * sequence (end of sequence, a stop id, a grammar with nothing left to allow) is the last. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/block_manager.h"
#include "engine/forward.h"
#include "engine/kv_pool.h"
#include "engine/scheduler.h"
#include "engine/spec.h"

#define DRAFT_MAX_TOKENS 256 /* rows of one draft forward pass: a long prompt is caught up over several steps */

typedef struct dm_seq {
    int32_t seq;       /* block-manager sequence, -1 when it holds no KV */
    int32_t *fed;      /* [cap] tokens whose KV is in the draft pool, positions 0..n_fed-1 */
    int32_t n_fed, cap;
    int disabled;      /* the draft pool could not hold it: no more drafts for this sequence */
} dm_seq;

typedef struct dm_ctx {
    const bt_model *m;      /* the draft: owned (loaded) or &view (self) */
    bt_model *owned;
    bt_model view;          /* self: the target with n_layer = L */
    bt_backend *be;         /* the target's; not owned */
    bt_kv_pool *kv;
    bt_bm *bm;
    bt_forward *fw;
    float *logits;          /* [DRAFT_MAX_TOKENS][n_vocab] */
    float *scratch;         /* [2 * n_vocab] */
    int32_t b_tokens[DRAFT_MAX_TOKENS], b_pos[DRAFT_MAX_TOKENS], b_seq[DRAFT_MAX_TOKENS], b_rows[DRAFT_MAX_TOKENS];
    bt_seq_view *views;     /* [max_items] */
    int32_t *row_of;        /* [max_items] logits row of each item in a pass, -1 when it has none */
    bt_sampler_seq **scr;   /* [max_items] during a proposal: the item's sampler after its drafts so far, or NULL */
    int32_t max_items;
    double round_s;         /* recent seconds per drafting round (one-token pass), exponentially weighted */
} dm_ctx;

/* FNV-1a over the tokenizer's token strings (and their count): equal vocabularies have equal fingerprints. Models
 * without tokenizer metadata (test models) hash their vocabulary size alone. */
static uint64_t vocab_fingerprint(const bt_model *m)
{
    uint64_t h = 0xcbf29ce484222325ull;
    const gguf_kv *kv = NULL;
    uint64_t n = (uint64_t)m->hp.n_vocab;
    if (m->file && gguf_get_arr(m->file, "tokenizer.ggml.tokens", GGUF_VT_STRING, &kv) == BT_OK) {
        for (uint64_t i = 0; i < kv->arr_len; i++) {
            gguf_str s = gguf_arr_str(kv, i);
            for (uint64_t j = 0; j < s.len; j++) h = (h ^ (uint8_t)s.ptr[j]) * 0x100000001b3ull;
            h = (h ^ 0xff) * 0x100000001b3ull; /* separator */
        }
    }
    for (int b = 0; b < 8; b++) h = (h ^ ((n >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    return h;
}

static void dm_seq_release(dm_ctx *c, dm_seq *d)
{
    if (d->seq >= 0) bt_bm_seq_free(c->bm, d->seq);
    d->seq = -1;
    d->n_fed = 0;
}

static bt_status dm_seq_open(bt_proposer *p, void **state)
{
    (void)p;
    dm_seq *d = calloc(1, sizeof *d);
    if (!d) return bt_fail(BT_ERR_NOMEM, "out of memory for a draft sequence");
    d->seq = -1;
    *state = d;
    return BT_OK;
}

static void dm_seq_close(bt_proposer *p, void *state)
{
    dm_seq *d = state;
    if (!d) return;
    dm_seq_release(p->ctx, d);
    free(d->fed);
    free(d);
}

/* Gives up drafting for d: its KV goes back to the pool (the lesser harm: the request runs on without drafts). */
static void dm_disable(dm_ctx *c, dm_seq *d, const char *why)
{
    BT_DEBUG("spec", "draft model: a sequence stops drafting: %s", why);
    dm_seq_release(c, d);
    d->disabled = 1;
}

/* Reserves the draft KV slots for tokens[n] at positions n_fed.. and records them as fed. 0 on success. */
static int dm_reserve(dm_ctx *c, dm_seq *d, const int32_t *tokens, int32_t n)
{
    if (d->seq < 0 && bt_bm_seq_create(c->bm, &d->seq) != BT_OK) {
        d->seq = -1;
        return -1;
    }
    if (d->n_fed + n > d->cap) {
        int32_t nc = d->cap ? d->cap : 256;
        while (nc < d->n_fed + n) nc *= 2;
        int32_t *f = realloc(d->fed, sizeof(int32_t) * (size_t)nc);
        if (!f) return -1;
        d->fed = f;
        d->cap = nc;
    }
    bt_bm_copy cow = {-1, -1}; /* no sharing in the draft pool: never a copy */
    if (bt_bm_seq_append(c->bm, d->seq, n, tokens, &cow) != BT_OK) return -1;
    memcpy(d->fed + d->n_fed, tokens, sizeof(int32_t) * (size_t)n);
    d->n_fed += n;
    return 0;
}

/* Runs the batch laid out in c->b_* (nt tokens, ns sequences whose views are set) and returns its status. */
static bt_status dm_run(dm_ctx *c, int32_t nt, int32_t ns, int32_t nl)
{
    bt_batch b = {nt, c->b_tokens, c->b_pos, c->b_seq, c->views, ns, c->b_rows, nl, NULL, 0, NULL};
    return bt_forward_run(c->fw, c->kv, &b, c->logits);
}

/* First pass: each item's unseen tokens (at most what fits in one pass; an item whose catch-up does not fit in
 * this pass gets no drafts this step and continues the next). Sets row_of[i] for items ready to draft. */
static int32_t dm_catch_up(dm_ctx *c, bt_spec_item *items, int32_t n, int32_t *n_seqs)
{
    int32_t nt = 0, ns = 0, nl = 0;
    for (int32_t i = 0; i < n; i++) {
        bt_spec_item *it = &items[i];
        dm_seq *d = it->state;
        c->row_of[i] = -1;
        it->n_drafts = 0;
        if (!d || d->disabled || nt >= DRAFT_MAX_TOKENS) continue;
        /* keep the fed prefix that matches the sequence, at least one token short of its end (logits needed) */
        int32_t keep = 0;
        while (keep < d->n_fed && keep < it->n_tokens - 1 && d->fed[keep] == it->tokens[keep]) keep++;
        if (keep < d->n_fed) {
            if (bt_bm_seq_truncate(c->bm, d->seq, keep) != BT_OK) {
                dm_disable(c, d, "truncate failed");
                continue;
            }
            d->n_fed = keep;
        }
        int32_t todo = it->n_tokens - keep, room = DRAFT_MAX_TOKENS - nt;
        int32_t take = todo < room ? todo : room;
        if (dm_reserve(c, d, it->tokens + keep, take)) {
            dm_disable(c, d, "draft KV pool full");
            continue;
        }
        int32_t nb;
        const int32_t *table = bt_bm_seq_table(c->bm, d->seq, &nb);
        c->views[ns] = (bt_seq_view){.block_table = table, .n_blocks = nb};
        for (int32_t k = 0; k < take; k++) {
            c->b_tokens[nt] = it->tokens[keep + k];
            c->b_pos[nt] = keep + k;
            c->b_seq[nt] = ns;
            nt++;
        }
        if (take == todo) {
            c->row_of[i] = nl;
            c->b_rows[nl++] = nt - 1;
        }
        ns++;
    }
    *n_seqs = ns;
    return nt;
}

/* The drafting passes of dm_propose over items[n] (n <= max_items), with c->scr set up. */
static void dm_draft(dm_ctx *c, bt_spec_item *items, int32_t n)
{
    int32_t V = c->m->hp.n_vocab;
    int32_t ns = 0, nl = 0;
    int32_t nt = dm_catch_up(c, items, n, &ns);
    if (nt == 0) return;
    for (int32_t i = 0; i < n; i++) nl += c->row_of[i] >= 0;
    for (int32_t j = 0;; j++) {
        double t0 = bt_sched_now();
        bt_status st = dm_run(c, nt, ns, nl);
        if (j > 0 && st == BT_OK) /* one-token passes only: catching up on a prompt is not a drafting round */
            c->round_s = c->round_s > 0 ? 0.9 * c->round_s + 0.1 * (bt_sched_now() - t0) : bt_sched_now() - t0;
        if (st != BT_OK) {
            BT_WARN("spec", "draft forward pass failed: %s; no drafts this step", bt_last_error());
            for (int32_t i = 0; i < n; i++) {
                items[i].n_drafts = 0;
                if (items[i].state) dm_seq_release(c, items[i].state); /* its KV may be half written */
            }
            return;
        }
        for (int32_t i = 0; i < n; i++) {
            dm_seq *d = items[i].state;
            if (d && d->seq >= 0) bt_bm_seq_set_computed(c->bm, d->seq, d->n_fed);
        }
        /* draw draft j + 1 of every item still drafting, then lay out the next one-token pass */
        nt = ns = nl = 0;
        for (int32_t i = 0; i < n; i++) {
            bt_spec_item *it = &items[i];
            if (c->row_of[i] < 0) continue;
            const bt_sampler_seq *smp = c->scr[i] ? c->scr[i] : it->sampler;
            int32_t tok = bt_sampler_sample(smp, c->logits + (size_t)c->row_of[i] * (size_t)V, it->n_tokens + j,
                                            c->scratch, NULL);
            it->drafts[it->n_drafts++] = tok;
            c->row_of[i] = -1;
            dm_seq *d = it->state;
            if (it->n_drafts >= it->k) continue;
            bt_finish f = BT_FINISH_NONE;
            if (c->scr[i] && (bt_sampler_seq_accept(c->scr[i], tok, &f) != BT_OK || f != BT_FINISH_NONE))
                continue; /* the target would end here (or the copy failed): nothing after it can be kept */
            if (dm_reserve(c, d, &tok, 1)) continue; /* pool full: these drafts are all it gets this step */
            int32_t nb;
            const int32_t *table = bt_bm_seq_table(c->bm, d->seq, &nb);
            c->views[ns] = (bt_seq_view){.block_table = table, .n_blocks = nb};
            c->b_tokens[nt] = tok;
            c->b_pos[nt] = d->n_fed - 1;
            c->b_seq[nt] = ns;
            c->row_of[i] = nl;
            c->b_rows[nl++] = nt;
            nt++;
            ns++;
        }
        if (nt == 0) return;
    }
}

static void dm_propose(bt_proposer *p, bt_spec_item *items, int32_t n)
{
    dm_ctx *c = p->ctx;
    if (n > c->max_items) n = c->max_items;
    for (int32_t i = 0; i < n; i++) { /* out of memory: drafts after the first use the state before the first */
        c->scr[i] = NULL;
        if (items[i].k > 1 && bt_sampler_seq_fork(items[i].sampler, bt_sampler_seq_index(items[i].sampler),
                                                   &c->scr[i]) != BT_OK)
            c->scr[i] = NULL;
    }
    dm_draft(c, items, n);
    for (int32_t i = 0; i < n; i++) {
        bt_sampler_seq_free(c->scr[i]);
        c->scr[i] = NULL;
    }
}

static double dm_round_cost(bt_proposer *p) { return ((const dm_ctx *)p->ctx)->round_s; }

static void dm_destroy(bt_proposer *p)
{
    dm_ctx *c = p->ctx;
    if (c) {
        bt_forward_destroy(c->fw);
        bt_bm_destroy(c->bm);
        bt_backend_kv_pool_destroy(c->be, c->kv);
        bt_model_free(c->owned);
        free(c->logits);
        free(c->scratch);
        free(c->views);
        free(c->row_of);
        free(c->scr);
        free(c);
    }
    free(p);
}

static const bt_proposer_ops draft_ops = {
    .name = "draft",
    .seq_open = dm_seq_open,
    .seq_close = dm_seq_close,
    .propose = dm_propose,
    .destroy = dm_destroy,
    .round_cost = dm_round_cost,
};

static const bt_proposer_ops self_ops = {
    .name = "self",
    .seq_open = dm_seq_open,
    .seq_close = dm_seq_close,
    .propose = dm_propose,
    .destroy = dm_destroy,
    .round_cost = dm_round_cost,
};

/* Creates the proposer around c->m (set by the caller): pool for kv_tokens positions, scratch for max_items. */
static bt_status dm_create(dm_ctx *c, const bt_proposer_ops *ops, bt_backend *be, int32_t kv_tokens,
                           int32_t max_items, int profile, bt_proposer **out)
{
    bt_status st;
    bt_proposer *p = calloc(1, sizeof *p);
    if (!p) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory creating the draft proposer");
        goto fail;
    }
    p->ops = ops;
    p->ctx = c;
    c->be = be;
    c->max_items = max_items;
    size_t stride = bt_kv_block_stride(&c->m->hp, BT_KV_F16) * (size_t)c->m->hp.n_layer;
    size_t blocks = ((size_t)kv_tokens + BT_KV_BLOCK - 1) / BT_KV_BLOCK + 1;
    if ((st = bt_backend_kv_pool_create(be, &c->m->hp, BT_KV_F16, blocks * stride, &c->kv))) goto fail;
    bt_bm_config bc = {.n_blocks = c->kv->n_blocks, .fingerprint = c->m->fingerprint, .disable_prefix_cache = 1};
    if ((st = bt_bm_create(&bc, &c->bm))) goto fail;
    if ((st = bt_forward_create(c->m, be, DRAFT_MAX_TOKENS, profile, &c->fw))) goto fail;
    c->logits = malloc(sizeof(float) * DRAFT_MAX_TOKENS * (size_t)c->m->hp.n_vocab);
    c->scratch = malloc(sizeof(float) * (size_t)bt_sampler_scratch_floats(c->m->hp.n_vocab));
    c->views = malloc(sizeof(bt_seq_view) * (size_t)max_items);
    c->row_of = malloc(sizeof(int32_t) * (size_t)max_items);
    c->scr = calloc((size_t)max_items, sizeof *c->scr);
    if (!c->logits || !c->scratch || !c->views || !c->row_of || !c->scr) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory creating the draft proposer");
        goto fail;
    }
    *out = p;
    return BT_OK;
fail:
    if (p) {
        dm_destroy(p);
    } else {
        bt_model_free(c->owned);
        free(c);
    }
    return st;
}

bt_status bt_spec_create(const bt_spec_config *cfg, const bt_model *target, bt_backend *be, int32_t kv_tokens,
                         int32_t max_seqs, bt_proposer **out)
{
    *out = NULL;
    switch (cfg->kind) {
    case BT_SPEC_NONE: return BT_OK;
    case BT_SPEC_NGRAM: return bt_spec_ngram_create(cfg->ngram_min, cfg->ngram_max, out);
    case BT_SPEC_SELF:
    case BT_SPEC_DRAFT: break;
    default: return bt_fail(BT_ERR_INVALID, "unknown speculative decoding kind %d", (int)cfg->kind);
    }
    if (kv_tokens < 1 || max_seqs < 1) return bt_fail(BT_ERR_INVALID, "draft proposer: bad pool or batch size");
    dm_ctx *c = calloc(1, sizeof *c);
    if (!c) return bt_fail(BT_ERR_NOMEM, "out of memory creating the draft proposer");
    if (cfg->kind == BT_SPEC_SELF) {
        if (cfg->self_layers >= target->hp.n_layer) {
            free(c);
            return bt_fail(BT_ERR_INVALID, "--spec self:%d: the model %s has %d layers; self-drafting needs fewer",
                           cfg->self_layers, target->name, target->hp.n_layer);
        }
        c->view = *target;
        c->view.hp.n_layer = cfg->self_layers;
        c->m = &c->view;
        return dm_create(c, &self_ops, be, kv_tokens, max_seqs, cfg->profile, out);
    }
    bt_status st = bt_model_load(cfg->draft_path, &c->owned);
    if (st) {
        free(c);
        return bt_fail(st, "cannot load the draft model %s: %s", cfg->draft_path, bt_last_error());
    }
    uint64_t fd = vocab_fingerprint(c->owned), ft = vocab_fingerprint(target);
    if (c->owned->hp.n_vocab != target->hp.n_vocab || fd != ft) {
        st = bt_fail(BT_ERR_INVALID,
                     "the draft model %s (%s, vocabulary of %d tokens, fingerprint %016" PRIx64
                     ") does not share the vocabulary of the model %s (vocabulary of %d tokens, fingerprint %016" PRIx64
                     ")",
                     cfg->draft_path, c->owned->name, c->owned->hp.n_vocab, fd, target->name, target->hp.n_vocab, ft);
        bt_model_free(c->owned);
        free(c);
        return st;
    }
    c->m = c->owned;
    BT_INFO("spec", "draft model %s: %d layers, d_model %d (target %s: %d layers)", c->owned->name,
            c->owned->hp.n_layer, c->owned->hp.n_embd, target->name, target->hp.n_layer);
    return dm_create(c, &draft_ops, be, kv_tokens, max_seqs, cfg->profile, out);
}
