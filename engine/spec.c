#include "engine/spec.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bt_spec_config bt_spec_config_default(void)
{
    bt_spec_config c;
    memset(&c, 0, sizeof c);
    c.kind = BT_SPEC_NONE;
    c.k_max = BT_SPEC_K_DEFAULT;
    c.ngram_min = 1;
    c.ngram_max = 4;
    return c;
}

const char *bt_spec_kind_name(bt_spec_kind k)
{
    switch (k) {
    case BT_SPEC_NGRAM: return "ngram";
    case BT_SPEC_DRAFT: return "draft";
    case BT_SPEC_SELF: return "self";
    default: return "none";
    }
}

bt_status bt_spec_parse(const char *text, bt_spec_config *c)
{
    static const char forms[] = "none, ngram, ngram:MIN-MAX (n-gram lengths, 1..8), draft:PATH (a GGUF sharing the "
                                "model's vocabulary) or self:L (the model's first L layers)";
    if (!text) return bt_fail(BT_ERR_INVALID, "--spec needs a value: %s", forms);
    if (!strcmp(text, "none")) {
        c->kind = BT_SPEC_NONE;
        return BT_OK;
    }
    if (!strcmp(text, "ngram")) {
        c->kind = BT_SPEC_NGRAM;
        return BT_OK;
    }
    if (!strncmp(text, "ngram:", 6)) {
        char *end = NULL, *end2 = NULL;
        long lo = strtol(text + 6, &end, 10), hi = *end == '-' ? strtol(end + 1, &end2, 10) : -1;
        if (end == text + 6 || *end != '-' || end2 == end + 1 || !end2 || *end2 || lo < 1 || hi < lo || hi > 8)
            return bt_fail(BT_ERR_INVALID, "--spec '%s': ngram:MIN-MAX wants 1 <= MIN <= MAX <= 8, e.g. ngram:2-4",
                           text);
        c->kind = BT_SPEC_NGRAM;
        c->ngram_min = (int32_t)lo;
        c->ngram_max = (int32_t)hi;
        return BT_OK;
    }
    if (!strncmp(text, "draft:", 6)) {
        size_t n = strlen(text + 6);
        if (n == 0 || n >= sizeof c->draft_path)
            return bt_fail(BT_ERR_INVALID, "--spec '%s': the draft model path is empty or too long", text);
        memcpy(c->draft_path, text + 6, n + 1);
        c->kind = BT_SPEC_DRAFT;
        return BT_OK;
    }
    if (!strncmp(text, "self:", 5)) {
        char *end = NULL;
        long l = strtol(text + 5, &end, 10);
        if (end == text + 5 || *end || l < 1 || l > 100000)
            return bt_fail(BT_ERR_INVALID, "--spec '%s': self needs a layer count L >= 1, e.g. self:8", text);
        c->self_layers = (int32_t)l;
        c->kind = BT_SPEC_SELF;
        return BT_OK;
    }
    return bt_fail(BT_ERR_INVALID, "--spec '%s' is not one of: %s", text, forms);
}

/* ---- n-gram prompt lookup ---- */

typedef struct ng_entry {
    uint64_t key;  /* 0 = empty slot */
    int32_t end;   /* index of the n-gram's last token, most recent occurrence */
} ng_entry;

typedef struct ng_seq {
    ng_entry *tab;     /* open addressing, cap a power of two, at most half full */
    uint32_t cap, used;
    int32_t n_indexed; /* every n-gram ending before this index is in tab */
} ng_seq;

typedef struct ng_ctx {
    int32_t nmin, nmax;
} ng_ctx;

static uint64_t ng_key(const int32_t *t, int32_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull * (uint64_t)(n + 1);
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint64_t)(uint32_t)t[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    return h ? h : 1;
}

static int ng_grow(ng_seq *s)
{
    uint32_t cap = s->cap ? s->cap * 2 : 256;
    ng_entry *tab = calloc(cap, sizeof *tab);
    if (!tab) return -1;
    for (uint32_t i = 0; i < s->cap; i++) {
        if (!s->tab[i].key) continue;
        uint32_t j = (uint32_t)s->tab[i].key & (cap - 1);
        while (tab[j].key) j = (j + 1) & (cap - 1);
        tab[j] = s->tab[i];
    }
    free(s->tab);
    s->tab = tab;
    s->cap = cap;
    return 0;
}

/* Records (or moves to the newer occurrence) the n-gram with this key ending at end. */
static int ng_put(ng_seq *s, uint64_t key, int32_t end)
{
    if ((s->used + 1) * 2 > s->cap && ng_grow(s)) return -1;
    uint32_t j = (uint32_t)key & (s->cap - 1);
    while (s->tab[j].key && s->tab[j].key != key) j = (j + 1) & (s->cap - 1);
    if (!s->tab[j].key) s->used++;
    s->tab[j].key = key;
    s->tab[j].end = end;
    return 0;
}

static int32_t ng_get(const ng_seq *s, uint64_t key)
{
    if (!s->cap) return -1;
    uint32_t j = (uint32_t)key & (s->cap - 1);
    while (s->tab[j].key) {
        if (s->tab[j].key == key) return s->tab[j].end;
        j = (j + 1) & (s->cap - 1);
    }
    return -1;
}

static bt_status ng_seq_open(bt_proposer *p, void **state)
{
    (void)p;
    ng_seq *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory for an n-gram index");
    *state = s;
    return BT_OK;
}

static void ng_seq_close(bt_proposer *p, void *state)
{
    (void)p;
    ng_seq *s = state;
    if (!s) return;
    free(s->tab);
    free(s);
}

/* Indexes the n-grams that end before the last token (only those have a continuation), then looks the sequence's
 * last n tokens up, longest n first. A match must be an earlier occurrence, not the suffix itself. */
static void ng_propose_one(const ng_ctx *c, ng_seq *s, bt_spec_item *it)
{
    const int32_t *t = it->tokens;
    int32_t n_tok = it->n_tokens;
    it->n_drafts = 0;
    it->cls = 0;
    if (s->n_indexed > n_tok) s->n_indexed = 0; /* a shorter sequence than indexed: cannot happen; start over */
    for (int32_t e = s->n_indexed; e < n_tok - 1; e++) {
        for (int32_t n = c->nmin; n <= c->nmax && n <= e + 1; n++)
            if (ng_put(s, ng_key(t + e - n + 1, n), e)) return; /* out of memory: no drafts, retried next step */
        s->n_indexed = e + 1;
    }
    for (int32_t n = c->nmax; n >= c->nmin; n--) {
        if (n > n_tok - 1) continue;
        const int32_t *suffix = t + n_tok - n;
        int32_t end = ng_get(s, ng_key(suffix, n));
        if (end < n - 1 || end >= n_tok - 1) continue;
        if (memcmp(t + end - n + 1, suffix, sizeof(int32_t) * (size_t)n) != 0) continue; /* hash collision */
        int32_t k = 0;
        while (k < it->k && end + 1 + k < n_tok) {
            it->drafts[k] = t[end + 1 + k];
            k++;
        }
        it->n_drafts = k;
        it->cls = n == 1;
        return;
    }
}

static void ng_propose(bt_proposer *p, bt_spec_item *items, int32_t n)
{
    const ng_ctx *c = p->ctx;
    for (int32_t i = 0; i < n; i++) {
        if (items[i].state) ng_propose_one(c, items[i].state, &items[i]);
        else items[i].n_drafts = items[i].cls = 0;
    }
}

static void ng_destroy(bt_proposer *p)
{
    free(p->ctx);
    free(p);
}

static const bt_proposer_ops ngram_ops = {
    .name = "ngram",
    .seq_open = ng_seq_open,
    .seq_close = ng_seq_close,
    .propose = ng_propose,
    .destroy = ng_destroy,
};

bt_status bt_spec_ngram_create(int32_t ngram_min, int32_t ngram_max, bt_proposer **out)
{
    if (ngram_min < 1 || ngram_max < ngram_min || ngram_max > 8)
        return bt_fail(BT_ERR_INVALID, "n-gram lengths %d..%d: need 1 <= min <= max <= 8", ngram_min, ngram_max);
    bt_proposer *p = calloc(1, sizeof *p);
    ng_ctx *c = calloc(1, sizeof *c);
    if (!p || !c) {
        free(p);
        free(c);
        return bt_fail(BT_ERR_NOMEM, "out of memory creating the n-gram proposer");
    }
    c->nmin = ngram_min;
    c->nmax = ngram_max;
    p->ops = &ngram_ops;
    p->ctx = c;
    *out = p;
    return BT_OK;
}

/* ---- adaptive k ---- */

#define SPEC_DECAY 0.8f        /* weight of the past per verification: about the last 5 steps count */
#define SPEC_PROBE_STEPS 16
#define SPEC_PROBE_MAX 512

#define SPEC_CHAIN_WEIGHT 0.25f /* how many tries the previous position's alpha is worth at a position */

void bt_spec_stats_init(bt_spec_stats *st)
{
    memset(st, 0, sizeof *st);
    st->hits[0] = 1; /* alpha 0.5 from one hit in two tries, forgotten as evidence comes */
    st->tries[0] = 2;
    st->probe_every = SPEC_PROBE_STEPS;
}

/* alpha of draft position i from the previous position's (0.5 before the first), in double: one step of the chain
 * that bt_spec_alpha_at walks in float, for the loops that also multiply the chance P_i along it */
static double chain_alpha(const bt_spec_stats *st, int32_t i, double prev)
{
    return (st->hits[i] + SPEC_CHAIN_WEIGHT * prev) / (st->tries[i] + SPEC_CHAIN_WEIGHT);
}

float bt_spec_alpha_at(const bt_spec_stats *st, int32_t i)
{
    float a = 0.5f;
    for (int32_t j = 0; j <= i && j < BT_SPEC_K_LIMIT; j++)
        a = (st->hits[j] + SPEC_CHAIN_WEIGHT * a) / (st->tries[j] + SPEC_CHAIN_WEIGHT);
    return a;
}

float bt_spec_alpha(const bt_spec_stats *st) { return bt_spec_alpha_at(st, 0); }

void bt_spec_stats_init_from(bt_spec_stats *st, const bt_spec_stats *global)
{
    bt_spec_stats_init(st);
    for (int32_t i = 0; i < BT_SPEC_K_LIMIT; i++) {
        float w = global->tries[i] < 2 ? global->tries[i] : 2;
        st->hits[i] = w * bt_spec_alpha_at(global, i);
        st->tries[i] = w;
    }
}

/* Decays every position's counts, then records a verification: drafts 1..n_accepted kept, draft n_accepted + 1
 * (when there was one) rejected. */
static void stats_record(bt_spec_stats *st, float decay, int32_t n_drafts, int32_t n_accepted)
{
    for (int32_t i = 0; i < BT_SPEC_K_LIMIT; i++) {
        st->hits[i] *= decay;
        st->tries[i] *= decay;
    }
    for (int32_t i = 0; i < n_accepted && i < BT_SPEC_K_LIMIT; i++) {
        st->hits[i] += 1;
        st->tries[i] += 1;
    }
    if (n_accepted < n_drafts && n_accepted < BT_SPEC_K_LIMIT) st->tries[n_accepted] += 1;
}

#define SPEC_GLOBAL_DECAY 0.95f /* proposer-wide: about the last 20 verifications of any sequence */

void bt_spec_global_init(bt_spec_stats *g)
{
    bt_spec_stats_init(g);
    g->hits[0] = 5; /* alpha 0.5 worth 10 tries: a few early misses do not condemn a proposer */
    g->tries[0] = 10;
}

void bt_spec_global_update(bt_spec_stats *g, int32_t n_drafts, int32_t n_accepted)
{
    if (n_drafts > 0) stats_record(g, SPEC_GLOBAL_DECAY, n_drafts, n_accepted);
}

void bt_spec_stats_update(bt_spec_stats *st, int32_t n_drafts, int32_t n_accepted)
{
    if (n_drafts <= 0) return;
    stats_record(st, SPEC_DECAY, n_drafts, n_accepted);
    if (n_accepted > 0) st->probe_every = SPEC_PROBE_STEPS;
    else if (st->probe_every < SPEC_PROBE_MAX) st->probe_every *= 2;
}

double bt_spec_threshold(double fixed, double per_row, double draft_row, double round, int32_t n_decode, int32_t rows)
{
    if (per_row < 0) per_row = 0;
    if (draft_row < 0) draft_row = 0;
    if (round < 0) round = 0;
    double t = fixed + per_row * rows;
    if (n_decode <= 0 || t <= 0) return 0;
    return (draft_row * n_decode + round) / t;
}

int32_t bt_spec_choose_k(bt_spec_stats *st, int32_t k_max, double threshold, int may_probe)
{
    /* probes only where the cost allows drafting at all: a compute-bound batch is not worth probing */
    may_probe = may_probe && threshold < 0.5;
    if (threshold < BT_SPEC_MIN_THRESHOLD) threshold = BT_SPEC_MIN_THRESHOLD;
    double p = 1, a = 0.5;
    int32_t k = 0;
    while (k < k_max) {
        p *= a = chain_alpha(st, k, a);
        if (p <= threshold) break;
        k++;
    }
    if (k == 0 && ++st->idle_steps >= st->probe_every && may_probe) k = 1;
    if (k > 0) st->idle_steps = 0;
    return k;
}

/* ---- the step-cost curve and the plan ---- */

#define CURVE_DOWN 0.3f  /* weight of a step faster than the estimate */
#define CURVE_UP 0.05f   /* and of a slower one (at most CURVE_CLIP times the estimate) */
#define CURVE_CLIP 2.0f
/* An unmeasured size past the last measured one is priced at the slope of the curve's two nearest measured sizes,
 * at least this fraction of the fitted row cost and at most all of it. The fitted model's row (fitted over every
 * step, prompt chunks included) cost ~1.2 ms where a decode step's extra row cost 0.2-1.0 ms, so sizes priced with
 * it were never chosen and so never measured. Offline replay of the input-grounded workload (the engine's plan and
 * curve, learnt from nothing, under a measured Zen 4 curve): 1.63x with the fitted row, 1.77-1.83x with the slope,
 * against 1.80-1.84x for the same plan knowing the whole curve; a floor of 1/4 or 1/2 made no difference. */
#define CURVE_MIN_SLOPE 0.25

void bt_spec_curve_init(bt_spec_curve *c) { memset(c, 0, sizeof *c); }

void bt_spec_curve_add(bt_spec_curve *c, int32_t n_seqs, int32_t n_extra, double t)
{
    if (n_seqs < 1 || n_seqs > BT_SPEC_CURVE_SEQS || n_extra < 0 || n_extra > BT_SPEC_CURVE_EXTRA || !(t > 0)) return;
    float *e = &c->t[n_seqs - 1][n_extra], x = (float)t;
    uint8_t *n = &c->n[n_seqs - 1][n_extra];
    if (*n < 2) {
        *e = *n == 0 || x < *e ? x : *e;
        (*n)++;
    } else if (x < *e) *e += CURVE_DOWN * (x - *e);
    else *e += CURVE_UP * (fminf(x, CURVE_CLIP * *e) - *e);
}

void bt_spec_curve_costs(const bt_spec_curve *c, int32_t n_seqs, int32_t max_extra, double fixed, double per_row,
                         double *cost)
{
    if (per_row < 0) per_row = 0;
    int in = n_seqs >= 1 && n_seqs <= BT_SPEC_CURVE_SEQS;
    const float *row = in ? c->t[n_seqs - 1] : NULL;
    const uint8_t *cnt = in ? c->n[n_seqs - 1] : NULL;
    double last = -1, prev = -1; /* the nearest measured smaller steps' seconds, at last_e and prev_e < last_e */
    int32_t last_e = 0, prev_e = 0;
    for (int32_t e = 0; e <= max_extra; e++) {
        if (row && e <= BT_SPEC_CURVE_EXTRA && cnt[e] >= 2) {
            cost[e] = row[e];
            prev = last, prev_e = last_e;
            last = row[e];
            last_e = e;
        } else if (last >= 0) { /* the measured slope of the curve, within [per_row / 4, per_row] */
            double slope = prev >= 0 ? (last - prev) / (double)(last_e - prev_e) : per_row;
            if (slope > per_row) slope = per_row;
            if (slope < CURVE_MIN_SLOPE * per_row) slope = CURVE_MIN_SLOPE * per_row;
            cost[e] = last + slope * (e - last_e);
        } else {
            cost[e] = fixed + per_row * (n_seqs + e);
        }
    }
}

typedef struct plan_draft {
    float p;          /* chance it yields a token */
    int32_t cand, i;  /* its sequence and position (0-based) */
} plan_draft;

static int plan_cmp(const void *a, const void *b)
{
    const plan_draft *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    if (x->i != y->i) return x->i < y->i ? -1 : 1; /* a sequence's equal P: earlier first (keeps a prefix) */
    return x->cand < y->cand ? -1 : x->cand > y->cand;
}

int32_t bt_spec_plan(bt_spec_cand *cand, int32_t n_cand, int32_t n_seqs, const double *cost, int32_t max_extra)
{
    plan_draft d[BT_SPEC_CURVE_SEQS * BT_SPEC_K_LIMIT];
    int32_t m = 0, best = 0;
    for (int32_t c = 0; c < n_cand; c++) cand[c].k = 0;
    if (n_cand > BT_SPEC_CURVE_SEQS) n_cand = BT_SPEC_CURVE_SEQS; /* the rest do not draft */
    for (int32_t c = 0; c < n_cand; c++) {
        double p = 1, a = 0.5;
        const bt_spec_stats *st = cand[c].st;
        for (int32_t i = 0; i < cand[c].avail && i < BT_SPEC_K_LIMIT; i++) {
            p *= a = chain_alpha(st, i, a);
            if (p < BT_SPEC_MIN_THRESHOLD) break; /* a row that looks free is often a noisy measurement */
            d[m++] = (plan_draft){(float)p, c, i};
        }
    }
    qsort(d, (size_t)m, sizeof *d, plan_cmp);
    if (m > max_extra) m = max_extra;
    double tokens = n_seqs, best_rate = cost[0] > 0 ? tokens / cost[0] : 0;
    for (int32_t j = 0; j < m; j++) {
        tokens += d[j].p;
        double rate = cost[j + 1] > 0 ? tokens / cost[j + 1] : 0;
        if (rate > best_rate) {
            best_rate = rate;
            best = j + 1;
        }
    }
    for (int32_t j = 0; j < best; j++) cand[d[j].cand].k++;
    /* probes: one draft for a sequence whose estimate has not been tried for a while, where a row is cheap */
    int32_t rows = best;
    for (int32_t c = 0; c < n_cand; c++) {
        bt_spec_stats *st = cand[c].st;
        if (cand[c].k > 0) {
            st->idle_steps = 0;
            continue;
        }
        if (cand[c].avail <= 0) continue;
        int cheap = rows < max_extra && (cost[rows + 1] - cost[rows]) * n_seqs < 0.5 * cost[rows];
        if (++st->idle_steps >= st->probe_every && cheap) {
            cand[c].k = 1;
            st->idle_steps = 0;
            rows++;
        }
    }
    return rows;
}

/* ---- the drafting check ---- */

static int check_size(int32_t n)
{
    if (n <= 16) return n < 1 ? 0 : n - 1;
    int b = 16;
    for (int32_t m = 32; n >= m && b < BT_SPEC_CHECK_SIZES - 1; m *= 2) b++;
    return b;
}

void bt_spec_check_init(bt_spec_check *c)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < BT_SPEC_CHECK_SIZES; i++) c->factor[i] = 1;
}

/* An average that a machine's noise (which only ever adds time) moves slowly: a sample is counted at most 1.5 times
 * the average. */
static double check_avg(double avg, double x, double w)
{
    if (avg <= 0) return x;
    if (x > 1.5 * avg) x = 1.5 * avg;
    return (1 - w) * avg + w * x;
}

void bt_spec_check_add(bt_spec_check *c, int32_t n_seqs, int32_t n_drafts, int64_t n_accepted, double t)
{
    if (n_seqs < 1 || !(t > 0)) return;
    int b = check_size(n_seqs), decides = n_seqs > BT_SPEC_CURVE_SEQS;
    if (n_drafts <= 0) {
        c->plain_spt[b] = check_avg(c->plain_spt[b], t / n_seqs, decides ? 0.2 : 0.1);
        if (!decides) c->factor[b] = 1 + (c->factor[b] - 1) * 0.995;
        return;
    }
    c->draft_spt[b] = check_avg(c->draft_spt[b], t / (double)(n_seqs + (n_accepted > 0 ? n_accepted : 0)), 0.2);
    if (c->plain_spt[b] <= 0 || decides) return; /* nothing to compare with yet; or the step is decided instead */
    if (c->draft_spt[b] > c->plain_spt[b]) c->factor[b] = fmin(c->factor[b] * 1.1, BT_SPEC_CHECK_MAX);
    else c->factor[b] = fmax(c->factor[b] / 1.05, 1.0);
}

double bt_spec_check_factor(const bt_spec_check *c, int32_t n_seqs)
{
    return c->factor[check_size(n_seqs)];
}

int bt_spec_check_may_draft(bt_spec_check *c, int32_t n_seqs)
{
    if (n_seqs <= BT_SPEC_CURVE_SEQS) return 1;
    int b = check_size(n_seqs), alternate = ++c->turn[b] >= BT_SPEC_CHECK_ALTERNATE;
    if (alternate) c->turn[b] = 0;
    if (c->plain_spt[b] <= 0) return 0;          /* plain steps first: they are the measure */
    if (c->draft_spt[b] <= 0) return alternate; /* drafting here has to show that it pays */
    int faster = c->draft_spt[b] <= c->plain_spt[b];
    return alternate ? !faster : faster;
}

int bt_spec_check_pays(const bt_spec_check *c, int32_t n_seqs)
{
    if (n_seqs <= BT_SPEC_CURVE_SEQS) return 1;
    int b = check_size(n_seqs);
    return c->plain_spt[b] > 0 && c->draft_spt[b] > 0 && c->draft_spt[b] <= c->plain_spt[b];
}
