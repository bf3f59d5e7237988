#include "engine/scheduler.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "engine/block_manager.h"
#include "engine/kv_groups.h"
#include "engine/forward.h"

#define SAMPLE_PARTS_MAX 8     /* parts a step's sampling is split into at most (sample_plain_rows) */
#define SAMPLE_PARALLEL_MIN 4  /* plain rows below which one thread samples them (a fork costs more than it saves) */

typedef struct sreq {
    uint64_t id;
    uint64_t order;          /* arrival order (tie-break after priority) */
    bt_req_params p;
    bt_sched_emit_fn emit;
    void *user;
    bt_sampler_seq *sampler; /* penalties' history, stop and length rules, RNG stream */
    int32_t *tokens;         /* [cap] prompt then generated tokens */
    int32_t n_tokens, cap;
    int32_t n_prompt;
    int32_t n_generated;
    int32_t n_cached;        /* prompt tokens from the prefix cache at the last admission */
    int32_t seq;             /* block manager sequence, -1 while waiting */
    int aborted;
    int remote;              /* REMOTE_* */
    int export_begun;        /* kv_export.begin was called */
    double t_submit, t_admit; /* bt_sched_now() at submit and at the first admission (0 = not yet) */
    /* this step */
    int32_t feed_from, feed_n;
    int32_t logit_row;       /* row in the step's logits, -1 when none (the first of n_draft + 1 rows) */
    int32_t n_draft;         /* drafts fed after the last token in this step, at tokens[n_tokens...] */
    int32_t draft[BT_SPEC_K_LIMIT];
    int32_t draft_cls;       /* the acceptance estimate (spec[]) the drafts count in */
    int32_t hidden_row;      /* embedding requests: this step's first row in b_hidden */
    double *emb_sum;         /* embedding requests: [n_embd] sum of the computed tokens' final hidden states */
    /* speculative decoding */
    void *spec_state;        /* the proposer's, opened at the first draft */
    int spec_open;           /* 0 not yet, 1 open, -1 could not open (no speculation) */
    int spec_seeded;         /* spec[] started from the scheduler's proposer-wide estimates */
    bt_spec_stats spec[BT_SPEC_CLASSES];
    struct sreq *next;       /* inbox link */
} sreq;

enum { REMOTE_NONE = 0, REMOTE_PENDING = 1, REMOTE_ENDED = 2 };

/* Requests from other threads, applied by the engine thread in arrival order. */
typedef enum ctl_kind { CTL_ABORT, CTL_REMOTE_DONE, CTL_RELEASE } ctl_kind;

typedef struct ctl_item {
    ctl_kind kind;
    uint64_t id;
    bt_status st;      /* CTL_REMOTE_DONE */
    int32_t token;
    int has_so;
    bt_sample_out so;
    struct ctl_item *next;
} ctl_item;

/* Blocks kept after a request's last event: a hold_kv request's (its transfer may still read them) or a request's
 * that ended while a remote prefill could still write into them. */
typedef struct parked {
    uint64_t id;
    int32_t seq;
} parked;

/* Weighted sums over steps of 1, n, T, n^2, n*T for a least-squares fit T = fixed + n * per_token. */
typedef struct step_fit {
    double w, n, t, nn, nt;
} step_fit;

struct bt_sched {
    const bt_model *m;
    bt_backend *be;
    bt_sched_config cfg;
    int32_t *eog;
    bt_kv_pool *kv;
    bt_kvg *kvg;             /* block tables: the global space, and the local layers' when their window releases */
    int32_t n_local_layers;  /* layers with a window (their bytes are the local space's when it exists) */
    bt_forward *fw;

    /* engine-thread state */
    sreq **waiting;          /* sorted by (priority, order) */
    int32_t n_waiting, cap_waiting;
    sreq **running;          /* admission order */
    int32_t n_running, cap_running;
    float *logits;           /* [max_batch_tokens][n_vocab] */
    float *scratch;          /* [sample_parts][2 * n_vocab] sampler scratch, one per part of a step's sampling */
    int sample_parts;        /* parts a step's plain rows are sampled in (the backend's host threads, at most 8) */
    int32_t *b_toks;         /* [max_running] the tokens sampled for a step's plain rows */
    bt_sample_out *b_so;     /* [max_running] and their details */
    sreq **b_plain;          /* [max_running] those rows' requests */
    int32_t *b_tokens, *b_pos, *b_seq, *b_rows; /* [max_batch_tokens] */
    int32_t *b_hidden_rows;  /* [max_batch_tokens] rows of embedding requests */
    float *b_hidden;         /* [max_batch_tokens][n_embd] their final hidden states */
    bt_seq_view *b_views;    /* [max_running] */
    sreq **b_reqs;           /* [max_running] */
    bt_sched_stats st;       /* engine-thread counters */
    parked *parked;
    int32_t n_parked, cap_parked;
    int32_t n_remote_pending; /* running requests waiting for bt_sched_remote_done */
    bt_spec_stats spec_global[BT_SPEC_CLASSES]; /* every verification's outcome: where new sequences' estimates start */
    int32_t spec_idle_steps;   /* steps with sequences to draft for and no drafts (the proposer-wide probe) */
    int32_t spec_n_open;       /* running requests with an open proposer state */
    double t_step_end;       /* bt_sched_now() when the last traced step ended (cfg.step_trace), 0 before one */
    step_fit fit;            /* every step */
    step_fit fit_decode;     /* steps of decode rows only (drafts included): what one more row costs there */
    bt_spec_check spec_check; /* drafting steps against plain ones, by step size (steps priced by the fit) */
    bt_spec_curve spec_curve; /* decode-only steps' measured seconds by sequences and draft rows */
    bt_spec_cand *b_cands;   /* [max_running] the plan of a decode-only step */
    double *b_costs;         /* [BT_SPEC_CURVE_EXTRA + 1] its estimated seconds by draft rows */
    sreq **b_export;         /* [max_running] requests exporting their KV in this step */
    int32_t n_export;
    bt_spec_item *b_items;   /* [max_running] draft requests of this step */
    sreq **b_item_reqs;      /* [max_running] */

    /* shared with other threads */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    sreq *inbox, *inbox_tail;
    ctl_item *ctl, *ctl_tail; /* control messages: aborts, remote prefill ends, KV releases */
    uint64_t next_id;
    bt_sched_stats snap;
    int thread_running, stop;
    pthread_t thread;
};

double bt_sched_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

bt_req_params bt_req_params_default(void)
{
    bt_req_params p;
    memset(&p, 0, sizeof p);
    p.sampling = bt_sampling_default();
    p.sampling.max_tokens = 16;
    return p;
}

/* Closes r's proposer state (a draft model's KV goes back to its pool); r may open a new one later. */
static void spec_close(bt_sched *s, sreq *r)
{
    if (r->spec_open != 1) return;
    s->cfg.proposer->ops->seq_close(s->cfg.proposer, r->spec_state);
    r->spec_state = NULL;
    r->spec_open = 0;
    s->spec_n_open--;
}

static void req_free(bt_sched *s, sreq *r)
{
    if (!r) return;
    spec_close(s, r);
    bt_sampler_seq_free(r->sampler);
    free(r->emb_sum);
    free(r->tokens);
    free(r);
}

static int grow(void **arr, int32_t *cap, int32_t need, size_t elem)
{
    if (need <= *cap) return 0;
    int32_t nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    void *p = realloc(*arr, (size_t)nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

bt_status bt_sched_create(const bt_model *m, bt_backend *be, const bt_sched_config *cfg_in, bt_sched **out)
{
    bt_sched_config cfg = *cfg_in;
    if (!cfg.kv_mem) cfg.kv_mem = BT_SCHED_DEFAULT_KV_MEM;
    if (!cfg.max_batch_tokens) cfg.max_batch_tokens = BT_SCHED_DEFAULT_BATCH_TOKENS;
    if (!cfg.max_running) cfg.max_running = BT_SCHED_DEFAULT_MAX_RUNNING;
    if (!cfg.max_context) cfg.max_context = bt_sched_default_context(m);
    if (!cfg.spec_k_max) cfg.spec_k_max = BT_SPEC_K_DEFAULT;
    if (cfg.spec_k_max < 1 || cfg.spec_k_max > BT_SPEC_K_LIMIT)
        return bt_fail(BT_ERR_INVALID, "speculative k_max %d outside 1..%d", cfg.spec_k_max, BT_SPEC_K_LIMIT);
    if (cfg.max_batch_tokens < 1 || cfg.max_running < 1 || cfg.max_context < 1 || cfg.n_eog < 0)
        return bt_fail(BT_ERR_INVALID, "scheduler: bad configuration");
    bt_sched *s = calloc(1, sizeof *s);
    if (!s) return bt_fail(BT_ERR_NOMEM, "out of memory creating the scheduler");
    s->m = m;
    s->be = be;
    s->cfg = cfg;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->next_id = 1;
    for (int c = 0; c < BT_SPEC_CLASSES; c++) bt_spec_global_init(&s->spec_global[c]);
    bt_spec_check_init(&s->spec_check);
    bt_spec_curve_init(&s->spec_curve);
    bt_status st;
    int32_t V = m->hp.n_vocab, B = cfg.max_batch_tokens;
    s->eog = malloc(sizeof(int32_t) * (size_t)(cfg.n_eog + 1));
    if (!s->eog) goto nomem;
    if (cfg.n_eog) memcpy(s->eog, cfg.eog_ids, sizeof(int32_t) * (size_t)cfg.n_eog);
    s->cfg.eog_ids = s->eog;
    if (cfg.kv_memory)
        st = bt_kv_pool_create(&m->hp, cfg.kv_dtype, cfg.kv_mem, cfg.kv_memory, &s->kv);
    else /* on the GPU for a device backend */
        st = bt_backend_kv_pool_create(be, &m->hp, cfg.kv_dtype, cfg.kv_mem, &s->kv);
    if (st) goto fail;
    for (int32_t l = 0; l < m->hp.n_layer; l++) s->n_local_layers += m->layers[l].window > 0;
    bt_kvg_config gc = {.n_blocks = s->kv->n_blocks, .fingerprint = m->fingerprint,
                        .disable_prefix_cache = cfg.disable_prefix_cache,
                        .window = s->n_local_layers && !cfg.kv_full_local ? m->hp.swa_window : 0};
    if ((st = bt_kvg_create(&gc, &s->kvg))) goto fail;
    if ((st = bt_forward_create(m, be, B, cfg.profile, &s->fw))) goto fail;
    s->logits = malloc(sizeof(float) * (size_t)B * (size_t)V);
    s->sample_parts = be->ops->host_tasks && be->ops->host_threads ? be->ops->host_threads(be) : 1;
    if (s->sample_parts > SAMPLE_PARTS_MAX) s->sample_parts = SAMPLE_PARTS_MAX;
    if (s->sample_parts < 1) s->sample_parts = 1;
    s->scratch = malloc(sizeof(float) * 2 * (size_t)V * (size_t)s->sample_parts);
    s->b_toks = malloc(sizeof(int32_t) * (size_t)cfg.max_running);
    s->b_so = malloc(sizeof(bt_sample_out) * (size_t)cfg.max_running);
    s->b_plain = malloc(sizeof(sreq *) * (size_t)cfg.max_running);
    s->b_tokens = malloc(sizeof(int32_t) * (size_t)B);
    s->b_pos = malloc(sizeof(int32_t) * (size_t)B);
    s->b_seq = malloc(sizeof(int32_t) * (size_t)B);
    s->b_rows = malloc(sizeof(int32_t) * (size_t)B);
    s->b_views = malloc(sizeof(bt_seq_view) * (size_t)cfg.max_running);
    s->b_reqs = malloc(sizeof(sreq *) * (size_t)cfg.max_running);
    s->b_export = malloc(sizeof(sreq *) * (size_t)cfg.max_running);
    s->b_items = malloc(sizeof(bt_spec_item) * (size_t)cfg.max_running);
    s->b_item_reqs = malloc(sizeof(sreq *) * (size_t)cfg.max_running);
    s->b_cands = malloc(sizeof(bt_spec_cand) * (size_t)cfg.max_running);
    s->b_costs = malloc(sizeof(double) * (BT_SPEC_CURVE_EXTRA + 1));
    s->b_hidden_rows = malloc(sizeof(int32_t) * (size_t)B);
    s->b_hidden = malloc(sizeof(float) * (size_t)B * (size_t)m->hp.n_embd);
    if (!s->b_hidden_rows || !s->b_hidden || !s->b_items || !s->b_item_reqs || !s->b_cands || !s->b_costs || !s->logits || !s->scratch || !s->b_toks || !s->b_so || !s->b_plain || !s->b_tokens || !s->b_pos || !s->b_seq || !s->b_rows || !s->b_views ||
        !s->b_reqs || !s->b_export)
        goto nomem;
    s->st.kv_blocks_total = s->snap.kv_blocks_total = s->kv->n_blocks;
    *out = s;
    return BT_OK;
nomem:
    st = bt_fail(BT_ERR_NOMEM, "out of memory creating the scheduler");
fail:
    bt_sched_destroy(s);
    return st;
}

static void emit_end(sreq *r, bt_end_reason f, bt_status err)
{
    bt_sched_event ev = {.req_id = r->id, .token = -1, .logprob = 0, .index = r->n_generated, .finish = f,
                         .n_prompt = r->n_prompt, .n_cached = r->n_cached, .error = err,
                         .queue_s = r->t_admit > 0 ? r->t_admit - r->t_submit : 0};
    r->emit(r->user, &ev);
}

/* Keeps seq's blocks out of use until bt_sched_release_kv / bt_sched_remote_done names id. If the list cannot grow
 * the blocks are released at once (the lesser harm than leaking them). */
static void park(bt_sched *s, uint64_t id, int32_t seq)
{
    if (grow((void **)&s->parked, &s->cap_parked, s->n_parked + 1, sizeof(parked))) {
        BT_WARN("sched", "request %llu: out of memory parking its KV blocks; released now", (unsigned long long)id);
        bt_kvg_seq_free(s->kvg, seq);
        return;
    }
    s->parked[s->n_parked++] = (parked){id, seq};
}

static void unpark(bt_sched *s, uint64_t id)
{
    for (int32_t i = 0; i < s->n_parked; i++)
        if (s->parked[i].id == id) {
            bt_kvg_seq_free(s->kvg, s->parked[i].seq);
            s->parked[i] = s->parked[--s->n_parked];
            return;
        }
}

/* Removes r from whichever list holds it, releases (or parks) its blocks and frees it. */
static void finish_and_free(bt_sched *s, sreq *r)
{
    int remote_pending = r->remote == REMOTE_PENDING;
    if (remote_pending) s->n_remote_pending--;
    if (r->seq >= 0) {
        if (remote_pending || r->p.hold_kv) park(s, r->id, r->seq);
        else bt_kvg_seq_free(s->kvg, r->seq);
    }
    r->seq = -1;
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == r) {
            memmove(&s->running[i], &s->running[i + 1], sizeof(sreq *) * (size_t)(s->n_running - i - 1));
            s->n_running--;
            break;
        }
    for (int32_t i = 0; i < s->n_waiting; i++)
        if (s->waiting[i] == r) {
            memmove(&s->waiting[i], &s->waiting[i + 1], sizeof(sreq *) * (size_t)(s->n_waiting - i - 1));
            s->n_waiting--;
            break;
        }
    req_free(s, r);
}

static int before(const sreq *a, const sreq *b)
{
    if (a->p.priority != b->p.priority) return a->p.priority < b->p.priority;
    return a->order < b->order;
}

static int waiting_insert(bt_sched *s, sreq *r)
{
    if (grow((void **)&s->waiting, &s->cap_waiting, s->n_waiting + 1, sizeof(sreq *))) return -1;
    int32_t i = s->n_waiting;
    while (i > 0 && before(r, s->waiting[i - 1])) i--;
    memmove(&s->waiting[i + 1], &s->waiting[i], sizeof(sreq *) * (size_t)(s->n_waiting - i));
    s->waiting[i] = r;
    s->n_waiting++;
    return 0;
}

/* Sends a running request back to the waiting list to be recomputed later: releases its blocks (hashed ones stay
 * in the prefix cache) and takes it out of the running list. If the waiting list cannot grow, the request ends with
 * an error event instead of being lost. */
static void requeue(bt_sched *s, sreq *r)
{
    bt_kvg_seq_free(s->kvg, r->seq);
    r->seq = -1;
    spec_close(s, r); /* a draft model's KV too: a waiting request holds no memory a running one could use */
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == r) {
            memmove(&s->running[i], &s->running[i + 1], sizeof(sreq *) * (size_t)(s->n_running - i - 1));
            s->n_running--;
            break;
        }
    if (waiting_insert(s, r)) {
        emit_end(r, BT_END_ERROR, BT_ERR_NOMEM);
        req_free(s, r);
    }
}

void bt_sched_destroy(bt_sched *s)
{
    if (!s) return;
    bt_sched_stop(s);
    while (s->n_running) {
        sreq *r = s->running[0];
        emit_end(r, BT_END_ABORT, BT_OK);
        finish_and_free(s, r);
    }
    while (s->n_waiting) {
        sreq *r = s->waiting[0];
        emit_end(r, BT_END_ABORT, BT_OK);
        finish_and_free(s, r);
    }
    for (sreq *r = s->inbox, *n; r; r = n) {
        n = r->next;
        emit_end(r, BT_END_ABORT, BT_OK);
        req_free(s, r);
    }
    for (ctl_item *a = s->ctl, *n; a; a = n) {
        n = a->next;
        free(a);
    }
    free(s->parked); /* their blocks go with the block manager */
    free(s->b_export);
    free(s->b_items);
    free(s->b_item_reqs);
    free(s->b_cands);
    free(s->b_costs);
    free(s->b_hidden_rows);
    free(s->b_hidden);
    bt_forward_destroy(s->fw);
    bt_kvg_destroy(s->kvg);
    bt_backend_kv_pool_destroy(s->be, s->kv);
    free(s->eog);
    free(s->waiting);
    free(s->running);
    free(s->logits);
    free(s->scratch);
    free(s->b_toks);
    free(s->b_so);
    free(s->b_plain);
    free(s->b_tokens);
    free(s->b_pos);
    free(s->b_seq);
    free(s->b_rows);
    free(s->b_views);
    free(s->b_reqs);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

bt_status bt_sched_submit(bt_sched *s, const int32_t *prompt, int32_t n_prompt, const bt_req_params *p,
                          bt_sched_emit_fn emit, void *user, uint64_t *req_id)
{
    if (n_prompt < 1) return bt_fail(BT_ERR_INVALID, "the prompt is empty");
    bt_status st = bt_sampling_check_vocab(&p->sampling, s->m->hp.n_vocab);
    if (st) return st;
    if (p->sample_index < 0 || p->sample_index >= p->sampling.n)
        return bt_fail(BT_ERR_INVALID, "sample_index %d outside 0..n-1 (n = %d): submit one request per sample",
                       p->sample_index, p->sampling.n);
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= s->m->hp.n_vocab)
            return bt_fail(BT_ERR_INVALID, "prompt token %d at position %d is outside the vocabulary (%d)", prompt[i],
                           i, s->m->hp.n_vocab);
    if (p->embedding && (p->remote || p->kv_export || p->hold_kv))
        return bt_fail(BT_ERR_INVALID, "an embedding request takes no remote prefill, KV export or hold_kv");
    int32_t max_tokens = p->embedding ? 0
                         : p->sampling.max_tokens > 0 ? p->sampling.max_tokens
                                                      : s->cfg.max_context - n_prompt;
    int64_t total = (int64_t)n_prompt + max_tokens;
    if ((max_tokens < 1 && !p->embedding) || total > s->cfg.max_context)
        return bt_fail(BT_ERR_EXHAUSTED, "prompt (%d tokens) + max_tokens (%d) exceeds the context limit of %d",
                       n_prompt, max_tokens, s->cfg.max_context);
    if ((total + BT_KV_BLOCK - 1) / BT_KV_BLOCK > s->kv->n_blocks)
        return bt_fail(BT_ERR_EXHAUSTED, "prompt + max_tokens (%lld tokens) can never fit in the KV pool (%d tokens)",
                       (long long)total, s->kv->n_blocks * BT_KV_BLOCK);
    sreq *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "out of memory queueing a request");
    r->cap = (int32_t)total;
    r->tokens = malloc(sizeof(int32_t) * (size_t)r->cap);
    if (!r->tokens) {
        free(r);
        return bt_fail(BT_ERR_NOMEM, "out of memory queueing a request");
    }
    memcpy(r->tokens, prompt, sizeof(int32_t) * (size_t)n_prompt);
    if (p->embedding && !(r->emb_sum = calloc((size_t)s->m->hp.n_embd, sizeof(double)))) {
        free(r->tokens);
        free(r);
        return bt_fail(BT_ERR_NOMEM, "out of memory queueing a request");
    }
    st = bt_sampler_seq_create(&p->sampling, s->m->hp.n_vocab, prompt, n_prompt, s->eog, s->cfg.n_eog,
                               p->sample_index, &r->sampler);
    if (!st && p->constraint) {
        int32_t k = p->constraint_prefix;
        if (k < 0 || k > n_prompt) st = bt_fail(BT_ERR_INVALID, "constraint_prefix %d outside the prompt", k);
        if (!st) st = bt_sampler_seq_set_constraint(r->sampler, p->constraint);
        if (!st && k) st = bt_sampler_seq_constraint_feed(r->sampler, prompt + n_prompt - k, k);
        if (st) bt_sampler_seq_free(r->sampler);
    }
    if (st) {
        free(r->emb_sum);
        free(r->tokens);
        free(r);
        return st;
    }
    r->n_tokens = r->n_prompt = n_prompt;
    r->p = *p;
    r->p.constraint = NULL; /* the sampler holds the reference */
    r->emit = emit;
    r->user = user;
    r->seq = -1;
    for (int c = 0; c < BT_SPEC_CLASSES; c++) bt_spec_stats_init(&r->spec[c]);
    r->t_submit = bt_sched_now();
    pthread_mutex_lock(&s->mu);
    r->id = r->order = s->next_id++;
    if (s->inbox_tail) s->inbox_tail->next = r;
    else s->inbox = r;
    s->inbox_tail = r;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (req_id) *req_id = r->id;
    return BT_OK;
}

static void ctl_post(bt_sched *s, ctl_item *a)
{
    a->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->ctl_tail) s->ctl_tail->next = a;
    else s->ctl = a;
    s->ctl_tail = a;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void bt_sched_abort(bt_sched *s, uint64_t req_id)
{
    ctl_item *a = calloc(1, sizeof *a);
    if (!a) return; /* the request then simply runs to completion */
    a->kind = CTL_ABORT;
    a->id = req_id;
    ctl_post(s, a);
}

void bt_sched_remote_done(bt_sched *s, uint64_t req_id, bt_status st, int32_t token, const bt_sample_out *so)
{
    ctl_item *a = calloc(1, sizeof *a);
    if (!a) {
        /* cannot happen in practice; without the item the request would wait for its deadline */
        BT_ERROR("sched", "out of memory ending the remote prefill of request %llu", (unsigned long long)req_id);
        return;
    }
    a->kind = CTL_REMOTE_DONE;
    a->id = req_id;
    a->st = st;
    a->token = token;
    if (so) {
        a->so = *so;
        a->has_so = 1;
    }
    ctl_post(s, a);
}

void bt_sched_release_kv(bt_sched *s, uint64_t req_id)
{
    ctl_item *a = calloc(1, sizeof *a);
    if (!a) {
        BT_ERROR("sched", "out of memory releasing the KV blocks of request %llu", (unsigned long long)req_id);
        return;
    }
    a->kind = CTL_RELEASE;
    a->id = req_id;
    ctl_post(s, a);
}

static sreq *find_req(bt_sched *s, uint64_t id)
{
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id) return s->running[i];
    for (int32_t i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->id == id) return s->waiting[i];
    return NULL;
}

/* Appends a sampled token to r and emits it; finishes r when it ended. Returns 1 when r was finished (and freed). */
static int accept_token(bt_sched *s, sreq *r, int32_t tok, const bt_sample_out *so)
{
    bt_finish sf = BT_FINISH_NONE;
    bt_status st = bt_sampler_seq_accept(r->sampler, tok, &sf);
    if (st) {
        /* a token the request's grammar forbids (from a remote prefill that did not apply it) or out of memory:
         * ending with an error beats emitting output that does not parse */
        BT_ERROR("sched", "request %llu: token %d not accepted: %s", (unsigned long long)r->id, tok, bt_last_error());
        emit_end(r, BT_END_ERROR, st);
        s->st.finished++;
        finish_and_free(s, r);
        return 1;
    }
    r->tokens[r->n_tokens++] = tok;
    r->n_generated++;
    s->st.generated_tokens++;
    bt_end_reason f = BT_END_NONE;
    if (sf == BT_FINISH_STOP) f = BT_END_STOP;
    else if (sf == BT_FINISH_LENGTH || r->n_tokens >= r->cap || r->n_tokens >= s->cfg.max_context)
        f = BT_END_LENGTH;
    bt_sched_event ev = {.req_id = r->id, .token = tok, .logprob = so ? so->logprob : 0, .index = r->n_generated - 1,
                         .finish = f, .n_prompt = r->n_prompt, .n_cached = r->n_cached, .error = BT_OK,
                         .detail = so, .queue_s = r->t_admit - r->t_submit};
    r->emit(r->user, &ev);
    if (f == BT_END_NONE) return 0;
    s->st.finished++;
    s->st.prompt_tokens += (uint64_t)r->n_prompt;
    finish_and_free(s, r);
    return 1;
}

/* A remote prefill ended: on success the prompt's KV is in r's blocks and a->token is its first token; otherwise r
 * computes its prompt here, from the end of its prefix-cache hit (the blocks a failed transfer may have touched
 * are simply overwritten). */
static void remote_end(bt_sched *s, sreq *r, const ctl_item *a)
{
    r->remote = REMOTE_ENDED;
    s->n_remote_pending--;
    /* local blocks before the window were never written: released before the others are published */
    if (a->st == BT_OK && a->token >= 0 && a->token < s->m->hp.n_vocab &&
        bt_kvg_seq_release_window(s->kvg, r->seq, r->n_tokens) >= 0 &&
        bt_kvg_seq_set_computed(s->kvg, r->seq, r->n_tokens) == BT_OK) {
        accept_token(s, r, a->token, a->has_so ? &a->so : NULL);
        return;
    }
    s->st.remote_fallbacks++;
    BT_DEBUG("sched", "request %llu: remote prefill failed (%s); prefilling locally", (unsigned long long)r->id,
             bt_status_str(a->st));
}

/* Moves the inbox into the waiting list and applies the control messages (aborts, remote prefill ends, KV
 * releases) in arrival order. */
static void drain_inbox(bt_sched *s)
{
    pthread_mutex_lock(&s->mu);
    sreq *in = s->inbox;
    ctl_item *ab = s->ctl;
    s->inbox = s->inbox_tail = NULL;
    s->ctl = s->ctl_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    for (sreq *r = in, *n; r; r = n) {
        n = r->next;
        r->next = NULL;
        if (waiting_insert(s, r)) {
            emit_end(r, BT_END_ERROR, BT_ERR_NOMEM);
            req_free(s, r);
        }
    }
    for (ctl_item *a = ab, *n; a; a = n) {
        n = a->next;
        sreq *r = find_req(s, a->id);
        switch (a->kind) {
        case CTL_ABORT:
            if (r) {
                emit_end(r, BT_END_ABORT, BT_OK);
                finish_and_free(s, r);
                s->st.aborted++;
            }
            break;
        case CTL_REMOTE_DONE:
            if (r && r->remote == REMOTE_PENDING) remote_end(s, r, a);
            else if (!r) unpark(s, a->id); /* ended while waiting: its blocks can be reused now */
            break;
        case CTL_RELEASE:
            unpark(s, a->id);
            break;
        }
        free(a);
    }
}

static void expire_deadlines(bt_sched *s)
{
    double now = bt_sched_now();
    for (int pass = 0; pass < 2; pass++) {
        sreq **list = pass ? s->running : s->waiting;
        int32_t *n = pass ? &s->n_running : &s->n_waiting;
        for (int32_t i = 0; i < *n;) {
            sreq *r = list[i];
            if (r->p.deadline > 0 && now >= r->p.deadline) {
                emit_end(r, BT_END_TIMEOUT, BT_OK);
                finish_and_free(s, r);
                s->st.timed_out++;
            } else {
                i++;
            }
        }
    }
}

/* Preempts the running request that is served last (lowest priority, latest arrival), other than keep:
 * releases its blocks and puts it back in the waiting list to be recomputed. Returns 0 when there was none. */
static int preempt_one(bt_sched *s, const sreq *keep)
{
    sreq *victim = NULL;
    for (int32_t i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        /* never one already placed in this step's batch, nor one whose blocks a remote prefill is writing */
        if (r == keep || r->feed_n > 0 || r->remote == REMOTE_PENDING) continue;
        if (!victim || before(victim, r)) victim = r;
    }
    if (!victim) return 0;
    BT_DEBUG("sched", "preempting request %llu (%d tokens) for recompute", (unsigned long long)victim->id,
             victim->n_tokens);
    requeue(s, victim);
    s->st.preemptions++;
    return 1;
}

/* Copies blocks for copy-on-write (K and V): c in the layers of the global space (every layer when there is no
 * local space), lc (may be NULL) in the sliding-window layers. */
static void copy_block(bt_sched *s, const bt_bm_copy *c, const bt_bm_copy *lc)
{
    int split = bt_kvg_windowed(s->kvg);
    for (int32_t l = 0; l < s->kv->n_layer; l++) {
        const bt_bm_copy *x = split && s->m->layers[l].window > 0 ? lc : c;
        if (!x || x->src < 0) continue;
        bt_backend_copy(s->be, bt_kv_block_ptr(s->kv, l, x->dst), bt_kv_block_ptr(s->kv, l, x->src),
                        s->kv->block_stride);
    }
}

/* Reserves KV slots for r's positions up to len (a no-op when already reserved, as after a failed remote
 * prefill), preempting others when the pool is full. Returns 0 on success. */
static int reserve_to(bt_sched *s, sreq *r, int32_t len)
{
    for (;;) {
        int32_t have = bt_kvg_seq_len(s->kvg, r->seq);
        if (have >= len) return 0;
        bt_bm_copy cow = {-1, -1}, lcow = {-1, -1};
        bt_status st = bt_kvg_seq_append(s->kvg, r->seq, len - have, r->tokens + have, &cow, &lcow);
        copy_block(s, &cow, &lcow); /* a global copy may be reported even when the local space failed */
        if (st == BT_OK) return 0;
        if (st != BT_ERR_EXHAUSTED || !preempt_one(s, r)) return -1;
    }
}

/* Admits waiting requests in order while blocks, budget and the running limit allow. */
static void admit(bt_sched *s, int32_t *budget)
{
    while (s->n_waiting > 0 && *budget > 0 && s->n_running < s->cfg.max_running) {
        sreq *r = s->waiting[0];
        int32_t evictable = 0, evictable_local = 0;
        /* an embedding needs every token's hidden state: it reuses no cached prefix */
        int32_t hits = r->p.embedding ? 0
                                      : bt_kvg_prefix_probe(s->kvg, r->tokens, r->n_tokens, &evictable, &evictable_local);
        int32_t blocks = (r->n_tokens + BT_KV_BLOCK - 1) / BT_KV_BLOCK - hits;
        /* all of the prompt's blocks must fit now, so an admission never forces a preemption by itself */
        if (!bt_kvg_can_allocate(s->kvg, blocks + evictable, blocks + evictable_local)) break;
        int32_t seq, cached = 0;
        if (bt_kvg_seq_create(s->kvg, &seq)) break;
        if (!r->p.embedding && bt_kvg_seq_match_prefix(s->kvg, seq, r->tokens, r->n_tokens, &cached)) {
            bt_kvg_seq_free(s->kvg, seq);
            break;
        }
        r->seq = seq;
        if (r->t_admit == 0) r->t_admit = bt_sched_now();
        if (r->n_generated == 0) r->n_cached = cached;
        int32_t n = r->n_tokens - cached;
        if (n > *budget) n = *budget;
        if (grow((void **)&s->running, &s->cap_running, s->n_running + 1, sizeof(sreq *))) {
            bt_kvg_seq_free(s->kvg, seq);
            r->seq = -1;
            break;
        }
        memmove(&s->waiting[0], &s->waiting[1], sizeof(sreq *) * (size_t)(s->n_waiting - 1));
        s->n_waiting--;
        s->running[s->n_running++] = r;
        if (r->p.remote && r->remote == REMOTE_NONE && r->n_generated == 0) {
            /* remote prefill: the whole prompt's blocks now, then nothing to compute here until it ends */
            if (reserve_to(s, r, r->n_tokens)) {
                requeue(s, r);
                break;
            }
            int32_t nb, nlb, lfirst = 0;
            const int32_t *table = bt_kvg_seq_table(s->kvg, r->seq, &nb);
            const int32_t *ltable = bt_kvg_seq_local_table(s->kvg, r->seq, &nlb);
            if (ltable) { /* the window before the first generated position, less the prefix-cache hit */
                lfirst = bt_kvg_window_first_block(s->m->hp.swa_window, r->n_tokens);
                if (lfirst < cached / BT_KV_BLOCK) lfirst = cached / BT_KV_BLOCK;
            }
            r->remote = REMOTE_ENDED; /* whatever happens next, at most one attempt */
            if (r->p.remote->start(r->user, r->id, table, (r->n_tokens + BT_KV_BLOCK - 1) / BT_KV_BLOCK, cached,
                                   ltable, lfirst) == 0) {
                r->remote = REMOTE_PENDING;
                s->n_remote_pending++;
                s->st.remote_prefills++;
                r->feed_n = 0;
                continue;
            }
        }
        if (reserve_to(s, r, cached + n)) {
            requeue(s, r); /* cannot happen after the can_allocate check; be safe: back to waiting */
            break;
        }
        r->feed_from = cached;
        r->feed_n = n;
        *budget -= n;
        s->st.computed_prompt_tokens += (uint64_t)n;
    }
}

/* Adds one step of n tokens that took t seconds to a step-time fit (recent steps weigh more) and returns the fitted
 * fixed and per-token seconds. */
static void fit_add(step_fit *f, double n, double t, double *fixed, double *per_token)
{
    const double decay = 0.98;
    f->w = f->w * decay + 1;
    f->n = f->n * decay + n;
    f->t = f->t * decay + t;
    f->nn = f->nn * decay + n * n;
    f->nt = f->nt * decay + n * t;
    double mn = f->n / f->w, mt = f->t / f->w;
    double var = f->nn / f->w - mn * mn, cov = f->nt / f->w - mn * mt;
    double c = var > 1.0 ? cov / var : 0, t0 = mt - c * mn;
    if (c <= 0 || t0 < 0) {
        /* steps of (nearly) one size, or noise: big steps are mostly per-token cost, small ones mostly fixed cost;
         * the per-token cost of small steps stays unknown (0) rather than wildly overstated */
        c = mn >= 64 ? mt / mn : 0;
        t0 = mn >= 64 ? 0 : mt;
    }
    *per_token = c;
    *fixed = t0;
}

static void snapshot(bt_sched *s)
{
    bt_bm_stats bs, ls = {0};
    bt_bm_get_stats(bt_kvg_global(s->kvg), &bs);
    if (bt_kvg_windowed(s->kvg)) bt_bm_get_stats(bt_kvg_local(s->kvg), &ls);
    s->st.waiting = s->n_waiting;
    s->st.running = s->n_running;
    s->st.kv_blocks_used = bs.blocks_used;
    s->st.kv_blocks_cached = bs.blocks_cached;
    s->st.kv_local_blocks_used = ls.blocks_used;
    s->st.kv_local_blocks_cached = ls.blocks_cached;
    {
        int64_t stride = (int64_t)s->kv->block_stride, n_local = bt_kvg_windowed(s->kvg) ? s->n_local_layers : 0;
        s->st.kv_bytes_used = (int64_t)bs.blocks_used * (s->kv->n_layer - n_local) * stride +
                              (int64_t)ls.blocks_used * n_local * stride;
        if (s->st.kv_bytes_used > s->st.kv_bytes_peak) s->st.kv_bytes_peak = s->st.kv_bytes_used;
    }
    s->st.kv_tokens_used = 0;
    for (int32_t i = 0; i < s->n_running; i++) s->st.kv_tokens_used += bt_kvg_seq_len(s->kvg, s->running[i]->seq);
    s->st.prefix_query_tokens = bs.prefix_query_tokens;
    s->st.prefix_hit_tokens = bs.prefix_hit_tokens;
    s->st.kv_blocks_parked = 0;
    for (int32_t i = 0; i < s->n_parked; i++) {
        int32_t nb = 0;
        bt_kvg_seq_table(s->kvg, s->parked[i].seq, &nb);
        s->st.kv_blocks_parked += nb;
    }
    pthread_mutex_lock(&s->mu);
    s->snap = s->st;
    pthread_mutex_unlock(&s->mu);
}

/* Forward-pass layer hook: this step's exporting requests move layer `layer`. */
static void export_layer(void *user, int32_t layer)
{
    bt_sched *s = user;
    for (int32_t i = 0; i < s->n_export; i++) s->b_export[i]->p.kv_export->layer(s->b_export[i]->user, layer);
}

/* A running request whose only token this step is its last sampled one: it may carry drafts. */
static int is_plain_decode(const sreq *r)
{
    return r->feed_n == 1 && r->feed_from == r->n_tokens - 1 && r->n_generated > 0 && !r->p.kv_export &&
           r->remote != REMOTE_PENDING;
}

/* The running requests that are plain decodes this step. */
static int32_t count_plain_decode(const bt_sched *s)
{
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_running; i++) n += is_plain_decode(s->running[i]);
    return n;
}

/* Tokens r may still generate after its next one (drafts beyond that could never be kept). */
static int32_t draft_room(const bt_sched *s, const sreq *r)
{
    int32_t room = bt_sampler_seq_remaining(r->sampler);
    if (r->cap - r->n_tokens < room) room = r->cap - r->n_tokens;
    if (s->cfg.max_context - r->n_tokens < room) room = s->cfg.max_context - r->n_tokens;
    return room - 1;
}

#define SPEC_GLOBAL_PROBE 256 /* steps without any draft before one sequence probes for all (~0.4% of steps) */
#define SPEC_EXPLORE 8        /* verifications before more than one sequence at a time tries a draft model */

/* The cost threshold of drafting in this step (bt_spec_threshold) from the decode-step fit, the decoding sequences
 * and the proposer's cost of a drafting round. A kept draft saves its sequence a decode row of a later step, so a
 * draft row is priced against what a decode-only step of these sequences costs, also when prompt chunks share the
 * step: against the whole step (prompt rows included) every draft looked nearly free, and at concurrency 16 with
 * requests arriving, drafting on that price cost up to 16% of the throughput (alternated runs). */
static double draft_threshold(const bt_sched *s, bt_proposer *pr)
{
    int32_t n_decode = count_plain_decode(s);
    double round = pr->ops->round_cost ? pr->ops->round_cost(pr) : 0;
    const bt_sched_stats *st = &s->st;
    double thr = bt_spec_threshold(st->decode_fixed_s, st->decode_row_s, st->decode_row_s, round, n_decode, n_decode);
    /* where drafting steps of this size were measured slower per token than plain ones, the model is wrong there */
    return (thr < BT_SPEC_MIN_THRESHOLD ? BT_SPEC_MIN_THRESHOLD : thr) * bt_spec_check_factor(&s->spec_check, n_decode);
}

/* The most drafts r may carry this step, or -1 when it cannot draft at all now (not a plain decode, opted out, no
 * room before its limit). */
static int32_t draft_k_max(const bt_sched *s, const sreq *r)
{
    if (!is_plain_decode(r) || r->p.no_spec || r->spec_open < 0) return -1;
    int32_t k_max = draft_room(s, r);
    if (k_max > s->cfg.spec_k_max) k_max = s->cfg.spec_k_max;
    return k_max > 0 ? k_max : -1;
}

/* A new sequence's estimates start from what the earlier ones learnt of the proposer. */
static void spec_seed(bt_sched *s, sreq *r)
{
    if (r->spec_seeded) return;
    for (int c = 0; c < BT_SPEC_CLASSES; c++) bt_spec_stats_init_from(&r->spec[c], &s->spec_global[c]);
    r->spec_seeded = 1;
}

/* Opens r's proposer state if it has none; -1 when it cannot (r then never drafts). */
static int spec_ensure_open(bt_sched *s, bt_proposer *pr, sreq *r)
{
    if (r->spec_open == 0) {
        r->spec_open = pr->ops->seq_open(pr, &r->spec_state) == BT_OK ? 1 : -1;
        if (r->spec_open > 0) s->spec_n_open++;
    }
    return r->spec_open > 0 ? 0 : -1;
}

/* How many drafts r asks for this step, or -1 when r cannot draft at all now (draft_k_max). *global_probe: the
 * proposer-wide probe is due; cleared when r takes it. */
static int32_t draft_k(bt_sched *s, sreq *r, double thr, int *global_probe)
{
    int32_t k_max = draft_k_max(s, r);
    if (k_max <= 0) return -1;
    if (s->cfg.spec_fixed_k) return k_max;
    spec_seed(s, r);
    /* A draft model first catches up on a sequence it has not seen (its whole prompt): until the proposer has shown
     * what it is worth (SPEC_EXPLORE verifications), one sequence at a time explores it; and a probe is one row
     * with a free proposer but a catch-up with a draft model, which then probes only proposer-wide, one sequence
     * after SPEC_GLOBAL_PROBE idle steps. */
    int costly = s->cfg.proposer->ops->round_cost != NULL;
    if (costly && r->spec_open == 0 && s->st.spec_verifications < SPEC_EXPLORE && s->spec_n_open > 0) return 0;
    int32_t k = bt_spec_choose_k(&r->spec[0], k_max, thr, !costly || r->spec_open == 1);
    if (k == 0 && *global_probe) {
        k = 1;
        *global_probe = 0;
    }
    return k;
}

/* Fills s->b_items with the requests that draft this step; returns their number. Records the step's threshold and
 * the mean acceptance estimate and k of the sequences that could draft (bench output explains k with them). */
static int32_t pick_drafters(bt_sched *s, bt_proposer *pr)
{
    double thr = draft_threshold(s, pr);
    int global_probe = s->spec_idle_steps >= SPEC_GLOBAL_PROBE && thr < 0.5;
    int32_t ni = 0, n_considered = 0;
    double alpha_sum = 0, k_sum = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        int32_t k = draft_k(s, r, thr, &global_probe);
        if (k < 0) continue;
        n_considered++;
        alpha_sum += bt_spec_alpha(&r->spec[0]);
        k_sum += k;
        if (k == 0 || spec_ensure_open(s, pr, r)) continue;
        s->b_items[ni] = (bt_spec_item){.state = r->spec_state, .tokens = r->tokens, .n_tokens = r->n_tokens,
                                        .sampler = r->sampler, .k = k};
        s->b_item_reqs[ni++] = r;
    }
    s->spec_idle_steps = ni > 0 ? 0 : s->spec_idle_steps + (n_considered > 0);
    if (n_considered) {
        s->st.spec_threshold = thr;
        s->st.spec_alpha = alpha_sum / n_considered;
        s->st.spec_k = k_sum / n_considered;
        s->st.spec_threshold_sum += thr < BT_SPEC_MIN_THRESHOLD ? BT_SPEC_MIN_THRESHOLD : thr;
        s->st.spec_alpha_sum += s->st.spec_alpha;
        s->st.spec_k_sum += s->st.spec_k;
        s->st.spec_considered_steps++;
    }
    return ni;
}

/* The sequences of this step when every one of them decodes one token (the step may be priced by the curve), else
 * -1. */
static int32_t decode_only_seqs(const bt_sched *s)
{
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        const sreq *r = s->running[i];
        if (r->feed_n <= 0) continue;
        if (r->feed_n != 1 || r->feed_from + 1 != r->n_tokens || r->p.embedding) return -1;
        n++;
    }
    return n;
}

/* A decode-only step of n_seqs sequences with a proposer that costs nothing to ask (n-gram): every sequence that may
 * draft proposes up to its k_max, then bt_spec_plan keeps the drafts that make the step's expected tokens per second
 * highest under the measured step-cost curve. Fills s->b_items with the drafting requests (k = drafts kept) and
 * returns their number. */
static int32_t plan_drafters(bt_sched *s, bt_proposer *pr, int32_t n_seqs, int32_t budget)
{
    int32_t ni = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        int32_t k_max = draft_k_max(s, r);
        if (k_max <= 0 || spec_ensure_open(s, pr, r)) continue;
        spec_seed(s, r);
        s->b_items[ni] = (bt_spec_item){.state = r->spec_state, .tokens = r->tokens, .n_tokens = r->n_tokens,
                                        .sampler = r->sampler, .k = k_max};
        s->b_item_reqs[ni++] = r;
    }
    if (ni == 0) return 0;
    pr->ops->propose(pr, s->b_items, ni);
    int32_t avail = 0;
    double alpha_sum = 0;
    for (int32_t j = 0; j < ni; j++) {
        bt_spec_item *it = &s->b_items[j];
        sreq *r = s->b_item_reqs[j];
        int32_t nd = it->n_drafts < it->k ? it->n_drafts : it->k;
        r->draft_cls = it->cls >= 0 && it->cls < BT_SPEC_CLASSES ? it->cls : 0;
        s->b_cands[j] = (bt_spec_cand){.st = &r->spec[r->draft_cls], .avail = nd > 0 ? nd : 0};
        avail += s->b_cands[j].avail;
        alpha_sum += bt_spec_alpha(&r->spec[0]);
    }
    int32_t max_extra = avail < budget ? avail : budget;
    if (max_extra > BT_SPEC_CURVE_EXTRA) max_extra = BT_SPEC_CURVE_EXTRA;
    bt_spec_curve_costs(&s->spec_curve, n_seqs, max_extra, s->st.decode_fixed_s, s->st.decode_row_s, s->b_costs);
    bt_spec_plan(s->b_cands, ni, n_seqs, s->b_costs, max_extra);
    int32_t n = 0;
    double k_sum = 0;
    for (int32_t j = 0; j < ni; j++) {
        k_sum += s->b_cands[j].k;
        if (s->b_cands[j].k <= 0) continue;
        s->b_items[n] = s->b_items[j];
        s->b_items[n].k = s->b_cands[j].k;
        s->b_item_reqs[n++] = s->b_item_reqs[j];
    }
    s->st.spec_threshold = 0; /* no threshold: the curve decided */
    s->st.spec_alpha = alpha_sum / ni;
    s->st.spec_k = k_sum / ni;
    s->st.spec_alpha_sum += s->st.spec_alpha;
    s->st.spec_k_sum += s->st.spec_k;
    s->st.spec_considered_steps++;
    s->st.spec_planned_steps++;
    return n;
}

/* Lays the proposed drafts of items[n] after their requests' last tokens and reserves their KV slots without
 * preempting anyone (no slots: no drafts), within the budget. */
static void place_drafts(bt_sched *s, int32_t n, int32_t *budget)
{
    for (int32_t j = 0; j < n && *budget > 0; j++) {
        sreq *r = s->b_item_reqs[j];
        bt_spec_item *it = &s->b_items[j];
        int32_t nd = it->n_drafts < it->k ? it->n_drafts : it->k;
        if (nd > *budget) nd = *budget;
        for (int32_t d = 0; d < nd; d++) {
            if (it->drafts[d] < 0 || it->drafts[d] >= s->m->hp.n_vocab) { /* a proposer bug must not reach the model */
                nd = d;
                break;
            }
            r->draft[d] = r->tokens[r->n_tokens + d] = it->drafts[d];
        }
        bt_bm_copy cow = {-1, -1}, lcow = {-1, -1};
        if (nd <= 0) continue;
        r->draft_cls = it->cls >= 0 && it->cls < BT_SPEC_CLASSES ? it->cls : 0;
        bt_status ast = bt_kvg_seq_append(s->kvg, r->seq, nd, r->tokens + r->n_tokens, &cow, &lcow);
        copy_block(s, &cow, &lcow);
        if (ast != BT_OK) continue;
        r->n_draft = nd;
        r->feed_n += nd;
        *budget -= nd;
    }
}

/* Whether this step may carry drafts at all, from the drafting check: a decode-only step of n_seqs sequences (-1:
 * prompt chunks in the step) of more than BT_SPEC_CURVE_SEQS is decided by it; a step with prompt chunks and that
 * many decoding sequences drafts only where the check measured drafting faster. */
static int step_may_draft(bt_sched *s, int32_t n_seqs)
{
    if (n_seqs > BT_SPEC_CURVE_SEQS) {
        s->st.spec_checked_steps++;
        int may = bt_spec_check_may_draft(&s->spec_check, n_seqs);
        s->st.spec_checked_plain_steps += !may;
        return may;
    }
    if (n_seqs >= 0) return 1;
    return bt_spec_check_pays(&s->spec_check, count_plain_decode(s));
}

/* Drafts for the decoding requests that get them this step (adaptive k), with what budget the running requests and
 * admissions left. */
static void add_drafts(bt_sched *s, int32_t *budget)
{
    bt_proposer *pr = s->cfg.proposer;
    if (!pr || *budget <= 0) return;
    /* decode-only steps with a free proposer are priced by the measured curve once a plain step of their size (or
     * the fit) says what a step costs; the rest by the fitted threshold */
    int32_t n_seqs = decode_only_seqs(s);
    if (!s->cfg.spec_fixed_k && !step_may_draft(s, n_seqs)) return;
    if (n_seqs >= 1 && n_seqs <= BT_SPEC_CURVE_SEQS && !pr->ops->round_cost && !s->cfg.spec_fixed_k &&
        (s->spec_curve.n[n_seqs - 1][0] >= 2 || s->st.decode_fixed_s > 0)) {
        int32_t n = plan_drafters(s, pr, n_seqs, *budget);
        if (n > 0) place_drafts(s, n, budget);
        return;
    }
    int32_t n = pick_drafters(s, pr);
    if (n == 0) return;
    pr->ops->propose(pr, s->b_items, n);
    place_drafts(s, n, budget);
}

/* A step's plain rows (one logit row: no drafts, no embedding, no grammar) are sampled before any of them is
 * accepted, in sample_parts parts on the backend's host threads (host_tasks), which otherwise wait for the next step:
 * Gemma 3's greedy argmax over 262,144 logits is ~0.09 ms a row, 5.8 ms of a 64-sequence step on one thread. Such a
 * row's token is a function of its own logits and sampler state alone (the RNG is counter-based), so the parts change
 * no token; accepting stays in step order on this thread. Rows under a grammar are sampled in the step loop, in step
 * order, as before: a grammar shared by several sequences caches transitions, and whether one mask stays within
 * BT_CONSTRAINT_MASK_WORK depends on what that cache already holds, which threads would make a matter of timing. */
typedef struct sample_job {
    bt_sched *s;
    int32_t n;
} sample_job;

static void sample_part(void *user, int i, int n)
{
    sample_job *j = user;
    bt_sched *s = j->s;
    int32_t V = s->m->hp.n_vocab;
    float *scratch = s->scratch + (size_t)i * 2 * (size_t)V;
    for (int32_t k = (int32_t)((int64_t)j->n * i / n); k < (int32_t)((int64_t)j->n * (i + 1) / n); k++) {
        sreq *r = s->b_plain[k];
        s->b_toks[k] = bt_sampler_sample(r->sampler, s->logits + (size_t)r->logit_row * (size_t)V, r->n_tokens,
                                         scratch, &s->b_so[k]);
    }
}

/* Samples the plain rows among the step's ns sequences into b_toks / b_so, b_plain naming their requests in step
 * order; returns how many. */
static int32_t sample_plain_rows(bt_sched *s, int32_t ns)
{
    int32_t n = 0;
    for (int32_t j = 0; j < ns; j++) {
        sreq *r = s->b_reqs[j];
        if (r->n_draft > 0 || r->p.embedding || r->logit_row < 0) continue;
        if (r->p.constraint) continue; /* the step loop samples it (see above) */
        s->b_plain[n++] = r;
    }
    sample_job job = {s, n};
    int parts = n < SAMPLE_PARALLEL_MIN ? 1 : s->sample_parts < n ? s->sample_parts : (int)n;
    if (parts > 1)
        s->be->ops->host_tasks(s->be, sample_part, &job, parts);
    else if (n)
        sample_part(&job, 0, 1);
    return n;
}

/* Samples r's rows of a step that carried drafts, exactly as plain decoding would sample each position: row i holds
 * the logits for position n0 + i, sampled with the history of the tokens before it. Drafts are kept while they equal
 * those draws; the first draw that differs (or the draw after the last draft) is kept too. Then the KV of rejected
 * drafts is dropped, the kept positions are published, and the tokens are emitted one by one (the request may finish
 * on any of them). */
static void verify_drafts(bt_sched *s, sreq *r)
{
    int32_t V = s->m->hp.n_vocab, n0 = r->n_tokens, nd = r->n_draft;
    int32_t toks[BT_SPEC_K_LIMIT + 1];
    bt_sample_out so[BT_SPEC_K_LIMIT + 1];
    int32_t m = 0, ended = 0;
    for (int32_t i = 0; i <= nd; i++) {
        toks[i] = bt_sampler_sample(r->sampler, s->logits + (size_t)(r->logit_row + i) * (size_t)V, n0 + i,
                                    s->scratch, &so[i]);
        m = i + 1;
        bt_finish f = BT_FINISH_NONE;
        if (bt_sampler_seq_accept(r->sampler, toks[i], &f) != BT_OK) f = BT_FINISH_LENGTH;
        if (f != BT_FINISH_NONE || n0 + m >= r->cap || n0 + m >= s->cfg.max_context) {
            ended = 1;
            break;
        }
        if (i < nd && toks[i] != r->draft[i]) break;
    }
    bt_sampler_seq_rollback(r->sampler, m); /* accept_token below records them for good */
    int32_t acc = 0;
    while (acc < m && acc < nd && toks[acc] == r->draft[acc]) acc++;
    r->n_draft = 0;
    /* positions before n0 + m - 1 hold the last token and the kept drafts: their KV is valid */
    bt_kvg_seq_truncate(s->kvg, r->seq, n0 + m - 1);
    bt_kvg_seq_set_computed(s->kvg, r->seq, n0 + m - 1);
    s->st.spec_verifications++;
    s->st.decode_seq_steps++;
    s->st.decode_tokens += (uint64_t)m;
    s->st.spec_proposed += (uint64_t)nd;
    s->st.spec_accepted += (uint64_t)acc;
    s->st.spec_accepted_hist[acc]++;
    if (!ended) {
        bt_spec_stats_update(&r->spec[r->draft_cls], nd, acc);
        bt_spec_global_update(&s->spec_global[r->draft_cls], nd, acc);
    }
    for (int32_t i = 0; i < m; i++)
        if (accept_token(s, r, toks[i], &so[i])) break;
}

/* An embedding request's rows of this step: added to its sum in token order (a restart after preemption computes
 * from position 0 and starts the sum again); after its last prompt token, the normalized mean and the end. */
static void embed_step(bt_sched *s, sreq *r)
{
    const int32_t E = s->m->hp.n_embd;
    if (r->feed_from == 0) memset(r->emb_sum, 0, sizeof(double) * (size_t)E);
    for (int32_t k = 0; k < r->feed_n; k++) {
        const float *h = s->b_hidden + (size_t)(r->hidden_row + k) * (size_t)E;
        for (int32_t i = 0; i < E; i++) r->emb_sum[i] += h[i];
    }
    if (r->feed_from + r->feed_n < r->n_prompt) return;
    double ss = 0;
    for (int32_t i = 0; i < E; i++) ss += r->emb_sum[i] * r->emb_sum[i];
    const double inv = ss > 0 ? 1.0 / sqrt(ss) : 0; /* the mean's 1 / n cancels in the normalization */
    for (int32_t i = 0; i < E; i++) r->p.embedding[i] = (float)(r->emb_sum[i] * inv);
    s->st.finished++;
    s->st.prompt_tokens += (uint64_t)r->n_prompt;
    emit_end(r, BT_END_STOP, BT_OK);
    finish_and_free(s, r);
}

/* One line of the step trace (BT_SCHED_TRACE_FIELDS). */
static void trace_step(bt_sched *s, double t0, double dt, int32_t nt, int32_t ns, int decode_only, int32_t n_drafts,
                       int64_t context)
{
    double t1 = bt_sched_now();
    fprintf(s->cfg.step_trace, "%.6f %.3f %.3f %.3f %d %d %d %d %lld\n", t0, (t1 - t0) * 1e3, dt * 1e3,
            s->t_step_end > 0 ? (t0 - s->t_step_end) * 1e3 : -1.0, nt, ns, decode_only, n_drafts,
            (long long)context);
    s->t_step_end = t1;
}

int bt_sched_step(bt_sched *s)
{
    double t_step = bt_sched_now();
    drain_inbox(s);
    expire_deadlines(s);
    int32_t budget = s->cfg.max_batch_tokens;
    for (int32_t i = 0; i < s->n_running; i++) {
        s->running[i]->feed_n = 0;
        s->running[i]->n_draft = 0;
    }

    /* 1. running requests continue (decodes need 1 token, unfinished prefills a chunk), in serving order */
    for (int32_t i = 0; i < s->n_running && budget > 0;) {
        sreq *r = s->running[i];
        int32_t done = bt_kvg_seq_computed(s->kvg, r->seq);
        int32_t n = r->n_tokens - done;
        if (n > budget) n = budget;
        if (n <= 0 || r->remote == REMOTE_PENDING) {
            i++;
            continue;
        }
        if (reserve_to(s, r, done + n)) {
            requeue(s, r); /* nobody left to preempt: r itself waits for blocks */
            s->st.preemptions++;
            continue;
        }
        if (done < r->n_prompt) s->st.computed_prompt_tokens += (uint64_t)n;
        r->feed_from = done;
        r->feed_n = n;
        budget -= n;
        /* preemption may have removed entries before i: find r again */
        for (i = 0; i < s->n_running && s->running[i] != r; i++) {}
        i++;
    }
    /* 2. admissions, then drafts with what budget is left */
    admit(s, &budget);
    double t_drafts = bt_sched_now(); /* the drafting check times the step from here: proposing is its cost too */
    add_drafts(s, &budget);

    /* 3. build the batch */
    int32_t nt = 0, ns = 0, nl = 0, nh = 0, n_drafts = 0;
    int64_t context = 0; /* positions attended (the step trace) */
    int decode_only = 1;
    s->n_export = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        if (r->feed_n <= 0) continue;
        int32_t nb;
        const int32_t *table = bt_kvg_seq_table(s->kvg, r->seq, &nb);
        int32_t nlb = 0;
        const int32_t *ltable = bt_kvg_seq_local_table(s->kvg, r->seq, &nlb);
        s->b_views[ns] = (bt_seq_view){table, nb, ltable, nlb};
        s->b_reqs[ns] = r;
        r->logit_row = -1;
        if (r->feed_n - r->n_draft != 1 || r->feed_from + 1 != r->n_tokens) decode_only = 0;
        n_drafts += r->n_draft;
        context += r->feed_from + r->feed_n;
        for (int32_t k = 0; k < r->feed_n; k++) {
            s->b_tokens[nt] = r->tokens[r->feed_from + k];
            s->b_pos[nt] = r->feed_from + k;
            s->b_seq[nt] = ns;
            nt++;
        }
        if (r->p.embedding) { /* every computed token's final hidden state, no logits */
            r->hidden_row = nh;
            for (int32_t k = 0; k < r->feed_n; k++) s->b_hidden_rows[nh++] = nt - r->feed_n + k;
        } else if (r->n_draft > 0) {
            r->logit_row = nl; /* the last token and every draft: one row each */
            for (int32_t k = r->n_draft; k >= 0; k--) s->b_rows[nl++] = nt - 1 - k;
        } else if (r->feed_from + r->feed_n == r->n_tokens) {
            r->logit_row = nl;
            s->b_rows[nl++] = nt - 1;
            if (r->p.kv_export && !r->export_begun && r->n_generated == 0) {
                r->export_begun = 1;
                if (r->p.kv_export->begin(r->user, table, (r->n_tokens + BT_KV_BLOCK - 1) / BT_KV_BLOCK, ltable) == 0)
                    s->b_export[s->n_export++] = r;
            }
        }
        ns++;
    }
    if (nt == 0) {
        snapshot(s);
        return 0;
    }
    bt_batch b = {nt, s->b_tokens, s->b_pos, s->b_seq, s->b_views, ns, s->b_rows, nl, s->b_hidden_rows, nh,
                  s->b_hidden};
    bt_forward_set_layer_hook(s->fw, s->n_export ? export_layer : NULL, s);
    double t_run = bt_sched_now(), dt = 0;
    bt_status st = bt_forward_run(s->fw, s->kv, &b, s->logits);
    if (!st) {
        dt = bt_sched_now() - t_run;
        fit_add(&s->fit, nt, dt, &s->st.step_fixed_s, &s->st.step_token_s);
        if (decode_only) {
            fit_add(&s->fit_decode, nt, dt, &s->st.decode_fixed_s, &s->st.decode_row_s);
        }
    }
    bt_forward_set_layer_hook(s->fw, NULL, NULL);
    s->st.steps++;
    if (st) {
        BT_ERROR("sched", "forward pass failed: %s", bt_last_error());
        for (int32_t j = 0; j < ns; j++) {
            emit_end(s->b_reqs[j], BT_END_ERROR, st);
            finish_and_free(s, s->b_reqs[j]);
        }
        snapshot(s);
        return st;
    }
    /* 4. publish computed KV, sample, emit, finish */
    double t_sample = bt_sched_now();
    int32_t V = s->m->hp.n_vocab;
    uint64_t accepted0 = s->st.spec_accepted;
    int32_t np = sample_plain_rows(s, ns), ip = 0;
    for (int32_t j = 0; j < ns; j++) {
        sreq *r = s->b_reqs[j];
        if (r->n_draft > 0) {
            verify_drafts(s, r);
            continue;
        }
        bt_kvg_seq_set_computed(s->kvg, r->seq, r->feed_from + r->feed_n);
        if (r->p.embedding) {
            embed_step(s, r);
            continue;
        }
        if (r->logit_row < 0) continue;
        if (r->feed_n == 1 && r->n_generated > 0) {
            s->st.decode_seq_steps++;
            s->st.decode_tokens++;
        }
        if (ip < np && s->b_plain[ip] == r) { /* sampled above */
            accept_token(s, r, s->b_toks[ip], &s->b_so[ip]);
            ip++;
            continue;
        }
        bt_sample_out so;
        int32_t tok = bt_sampler_sample(r->sampler, s->logits + (size_t)r->logit_row * (size_t)V, r->n_tokens,
                                        s->scratch, &so);
        accept_token(s, r, tok, &so);
    }
    if (decode_only && s->cfg.proposer) {
        bt_spec_check_add(&s->spec_check, ns, n_drafts, (int64_t)(s->st.spec_accepted - accepted0),
                          bt_sched_now() - t_drafts);
        bt_spec_curve_add(&s->spec_curve, ns, n_drafts, dt + (bt_sched_now() - t_sample)); /* forward and sampling */
    }
    snapshot(s);
    if (s->cfg.step_trace) trace_step(s, t_step, dt, nt, ns, decode_only, n_drafts, context);
    return nt;
}

int bt_sched_idle(bt_sched *s)
{
    pthread_mutex_lock(&s->mu);
    int empty = !s->inbox && !s->ctl;
    pthread_mutex_unlock(&s->mu);
    return empty && s->n_waiting == 0 && s->n_running == 0;
}

/* Something a step could compute: waiting requests, or running ones not waiting for a remote prefill. */
static int has_work(const bt_sched *s)
{
    return s->n_waiting > 0 || s->n_running > s->n_remote_pending;
}

static void *engine_main(void *arg)
{
    bt_sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !s->inbox && !s->ctl && !has_work(s)) pthread_cond_wait(&s->cv, &s->mu);
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        int n = bt_sched_step(s);
        if (n == 0 && s->n_waiting > 0 && s->n_running == s->n_remote_pending) {
            /* waiting requests that cannot be admitted with nothing running: only deadlines can change that */
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

bt_status bt_sched_warmup(bt_sched *s)
{
    if (s->thread_running) return bt_fail(BT_ERR_INVALID, "the engine thread runs: warm up before bt_sched_start");
    int32_t seq;
    bt_status st = bt_kvg_seq_create(s->kvg, &seq);
    if (st) return st;
    int32_t tok = 0, pos = 0, seq_idx = 0, row = 0;
    bt_bm_copy cow = {-1, -1}, lcow = {-1, -1};
    if ((st = bt_kvg_seq_append(s->kvg, seq, 1, &tok, &cow, &lcow)) == BT_OK) {
        int32_t nb = 0, nlb = 0;
        const int32_t *table = bt_kvg_seq_table(s->kvg, seq, &nb);
        const int32_t *ltable = bt_kvg_seq_local_table(s->kvg, seq, &nlb);
        bt_seq_view view = {table, nb, ltable, nlb};
        bt_batch b = {1, &tok, &pos, &seq_idx, &view, 1, &row, 1, NULL, 0, NULL};
        st = bt_forward_run(s->fw, s->kv, &b, s->logits);
    }
    /* never computed, so never cached: the block goes back free */
    bt_kvg_seq_free(s->kvg, seq);
    bt_forward_profile_reset(s->fw);
    return st;
}

bt_status bt_sched_start(bt_sched *s)
{
    if (s->thread_running) return BT_OK;
    s->stop = 0;
    if (pthread_create(&s->thread, NULL, engine_main, s) != 0)
        return bt_fail(BT_ERR_INTERNAL, "cannot start the engine thread");
    s->thread_running = 1;
    return BT_OK;
}

void bt_sched_stop(bt_sched *s)
{
    if (!s->thread_running) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->thread_running = 0;
}

const bt_kv_pool *bt_sched_kv_pool(const bt_sched *s) { return s->kv; }

int32_t bt_sched_kv_window(const bt_sched *s)
{
    return bt_kvg_windowed(s->kvg) ? s->m->hp.swa_window : 0;
}

bt_status bt_sched_check(bt_sched *s)
{
    bt_status st = bt_kvg_check(s->kvg);
    if (st) return st;
    int32_t window = s->m->hp.swa_window;
    for (int32_t i = 0; i < s->n_running; i++) {
        const sreq *r = s->running[i];
        int32_t len = bt_kvg_seq_len(s->kvg, r->seq), done = bt_kvg_seq_computed(s->kvg, r->seq);
        if (r->n_draft || len < done || len > r->n_tokens)
            return bt_fail(BT_ERR_INTERNAL, "request %llu: %d drafts left, KV length %d, computed %d, tokens %d",
                           (unsigned long long)r->id, r->n_draft, len, done, r->n_tokens);
        if (!bt_kvg_windowed(s->kvg)) continue;
        /* between steps a running sequence holds exactly the local blocks its next query can see */
        int32_t nl, released = 0, first = bt_kvg_window_first_block(window, done);
        const int32_t *lt = bt_kvg_seq_local_table(s->kvg, r->seq, &nl);
        while (released < nl && lt[released] == BT_BM_NO_BLOCK) released++;
        if (first > nl) first = nl;
        if (released != first)
            return bt_fail(BT_ERR_INTERNAL, "request %llu: %d local blocks released at computed %d, window wants %d",
                           (unsigned long long)r->id, released, done, first);
    }
    return BT_OK;
}

void bt_sched_spec_costs(const bt_sched *s, int32_t n_seqs, int32_t max_extra, double *cost)
{
    bt_spec_curve_costs(&s->spec_curve, n_seqs, max_extra, s->st.decode_fixed_s, s->st.decode_row_s, cost);
}

void bt_sched_get_stats(bt_sched *s, bt_sched_stats *st)
{
    pthread_mutex_lock(&s->mu);
    *st = s->snap;
    pthread_mutex_unlock(&s->mu);
}
