/* The cluster simulation (sim.h). What the model keeps and what it leaves out:
 *  - The router sees the nodes' state as it is now, not as their last load report (up to 1 s old) said; its own
 *    in-flight counts are therefore exact. One logical router: every request passes the same admission.
 *  - Decode choice: two alive decode nodes drawn at random, rtr_decode_score picks (dispatch.c's rule). Prefill
 *    candidates: rtr_prefill_candidates over the alive prefill nodes (the router's choice: prefix holders first, a
 *    random sample of the rest, at most its MAX_PREFILL). rtr_place_decide decides local or remote and where, with the router's default overhead.
 *  - Admission: rtr_admit_queue_s against --max-queue-s with rtr_admit_rates (measured generated tokens over the
 *    last 5 s, the nodes' marginal prefill rate 1 / prefill.token_s, the floors); the competing tokens are every
 *    admitted request's remaining tokens (the router takes min(remaining, o) of each: the simulation's bound is the
 *    upper one). No --max-inflight bound (one logical router stands for many).
 *  - Nodes: a step of n prompt tokens (k prompts ending in it) and B decoding sequences of total context C takes
 *    (B ? decode.fixed_s + B decode.seq_s + C decode.ctx_token_s : prefill.fixed_s) + n prefill.token_s
 *    + k prefill.seq_s.
 *    Prompts are chunked to prefill.chunk_tokens per step (decode rows count against that budget on decode nodes).
 *    A decode node admits sequences FCFS while they fit max_running and the KV capacity, reserving prompt + output
 *    (no preemption). Prefix caches hold what the router's prefix index says they hold.
 *  - Steps scatter as measured: each step's time is its model's times exp(spread z), z a standard normal drawn from
 *    the seed (clamped to +-3; prefill.spread for a step with prompt tokens, decode.spread otherwise), so the
 *    model's value stays the median. A step that starts on a node idle for g seconds first pays the profile's idle
 *    cost for g (plan_idle_extra_s: a CPU that has been idle runs its next tens of milliseconds slower).
 *  - The serving path outside the engines (HTTP, tokenization, the RPCs, the first token's way back) is one
 *    constant per request, the profile's request_s: a request reaches placement that long after it was sent.
 *    Where that path shares the decode node's cores (a one-host cluster), its CPU per streamed token
 *    (path_token_s) lengthens each step by that much per row; a serving node's decode step also costs path_step_s
 *    more than the profile's loop timed it, once per step. Where it shares the prefill nodes' cores instead
 *    (one host, decode nodes pinned elsewhere), a prefill step is stretched by the share of a core it takes then
 *    (path_prefill_token_s times the decode nodes' current streaming rate, over the alive prefill nodes).
 *  - KV transfer: each prefill node pushes one request at a time over its link (latency + bytes / bandwidth, the
 *    blocks the decode node lacks). The first token reaches the client when the decode node has seen the KV
 *    arrive (TTFT): at once when it is idle, else when its step in flight ends (its engine looks between steps).
 *  - Failures: a failed node's requests (queued, transferring to it, running) move to other nodes with their
 *    delivered tokens, re-prefilled there (the router's migration), up to max_migrations, then count as failed.
 * Every request ends finished, rejected at admission, or failed: sim_run checks that count. */
#include "tools/sim/sim.h"

#include "router/router.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RTR_SIM_MAX_PREFILL RTR_MAX_PREFILL_CANDIDATES /* dispatch.c's MAX_PREFILL */
#define SIM_MAX_HASHES 1024    /* block hashes per request the prefix index sees (16 K tokens) */

enum { EV_ARRIVAL, EV_PSTEP, EV_DSTEP, EV_KV_DONE, EV_PLAN, EV_FAIL, EV_REPAIR };

typedef struct ev {
    double t;
    uint64_t seq;
    int32_t type, a;
    uint32_t b;
    void *p;
} ev_t;

typedef struct req {
    double t_arrive, t_first;
    double t_pq, t_pdone;           /* a remote prefill: queued on its prefill node, computed there */
    int32_t isl, osl, gen;          /* prompt, output and delivered tokens */
    int32_t prefill_left;           /* tokens the current prefill still computes */
    int32_t prefill_total;          /* tokens the current prefill computes in all */
    int32_t xfer_tokens;            /* tokens whose KV travels to D */
    int32_t p, d;                   /* nodes of the current attempt (p = -1: local) */
    uint32_t d_epoch;
    int migrations;
    int kv_held;                    /* KV reserved on d */
    uint32_t group;
    int32_t prefix_tokens;
    uint64_t id;
    int64_t finish_step, ctx_base;
    int heap_i;
    struct req *next;
} req_t;

typedef struct node {
    int decode, alive;
    uint32_t epoch;
    int busy;
    char id[24];
    uint32_t id_hash;               /* rtr_pindex_id_hash(id) */
    req_t *q_head, *q_tail;         /* prefill queue (a decode node's local prefills) */
    int64_t q_tokens;
    int q_len;
    req_t *w_head, *w_tail;         /* decode: KV arrived, waiting for a batch slot */
    req_t *a_head, *a_tail;         /* decode: KV arrived during the step in flight, seen when it ends */
    int w_len;
    req_t **run;                    /* decode: heap of running sequences by finish_step */
    int n_run, cap_run;
    int64_t step_idx, kv_used;
    double ctx_base_sum;
    int step_b;                     /* decode rows of the step in flight */
    double step_rate;               /* decode: rows per second of the step in flight (0 when none) */
    req_t **done;                   /* prefills that complete with the step in flight */
    int n_done, cap_done;
    double link_free;
    double last_end;                /* when its last step ended (idle since, when it has none in flight) */
    int alive_i;                    /* index in its role's alive list */
} node_t;

typedef struct sim {
    const sim_config_t *cfg;
    const plan_profile_t *pf;
    sim_result_t *res;
    node_t *nodes;                  /* prefill nodes first */
    int np, nd;
    int *alive_p, n_alive_p, *alive_d, n_alive_d;
    unsigned char *cand_holds;      /* [np] rtr_prefill_candidates' inputs */
    size_t *cand_scratch;
    uint64_t cand_rng;
    ev_t *heap;
    size_t n_ev, cap_ev;
    uint64_t seq, rng, next_id;
    uint64_t step_rng;              /* the steps' scatter: its own stream, so the other draws stay as they were */
    double now;
    double xfer_bps, xfer_lat;
    int64_t chunk, max_running, kv_tokens;
    /* admission's view */
    double pending_prompt, compete;
    double pending_req;             /* admitted, first token not yet delivered: the planner's backlog */
    uint64_t gen_total, prompt_total, admitted;
    double gen_ring[6][2];
    int gen_n;
    double gen_rate;
    /* planner */
    double plan_ring[32][4];
    int plan_n;
    plan_smooth_t sp, sd;
    int plan_cap;
    rtr_pindex_t *pindex;
    uint64_t hashes[SIM_MAX_HASHES];
    req_t *free_reqs;
    uint64_t inflight;
    int arrivals_done;
    sim_next_fn next;
    void *ud;
    bt_status err;
} sim_t;

/* ---- event heap ---- */

static int ev_before(const ev_t *a, const ev_t *b) { return a->t < b->t || (a->t == b->t && a->seq < b->seq); }

static void ev_push(sim_t *s, double t, int type, int a, uint32_t b, void *p)
{
    if (s->n_ev == s->cap_ev) {
        size_t c = s->cap_ev ? s->cap_ev * 2 : 1024;
        ev_t *h = realloc(s->heap, c * sizeof *h);
        if (!h) {
            s->err = BT_ERR_NOMEM;
            return;
        }
        s->heap = h;
        s->cap_ev = c;
    }
    ev_t e = {.t = t, .seq = s->seq++, .type = type, .a = a, .b = b, .p = p};
    size_t i = s->n_ev++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!ev_before(&e, &s->heap[up])) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = e;
}

static ev_t ev_pop(sim_t *s)
{
    ev_t top = s->heap[0], last = s->heap[--s->n_ev];
    size_t i = 0, n = s->n_ev;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && ev_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!ev_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

/* ---- running-sequence heap of a decode node (by finish_step) ---- */

static void run_swap(node_t *n, int i, int j)
{
    req_t *t = n->run[i];
    n->run[i] = n->run[j];
    n->run[j] = t;
    n->run[i]->heap_i = i;
    n->run[j]->heap_i = j;
}

static int run_push(sim_t *s, node_t *n, req_t *r)
{
    if (n->n_run == n->cap_run) {
        int c = n->cap_run ? n->cap_run * 2 : 64;
        req_t **q = realloc(n->run, (size_t)c * sizeof *q);
        if (!q) return s->err = BT_ERR_NOMEM;
        n->run = q;
        n->cap_run = c;
    }
    int i = n->n_run++;
    n->run[i] = r;
    r->heap_i = i;
    while (i > 0 && n->run[(i - 1) / 2]->finish_step > n->run[i]->finish_step) {
        run_swap(n, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    return 0;
}

static req_t *run_pop(node_t *n)
{
    req_t *top = n->run[0];
    n->run[0] = n->run[--n->n_run];
    if (n->n_run) n->run[0]->heap_i = 0;
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= n->n_run) break;
        if (c + 1 < n->n_run && n->run[c + 1]->finish_step < n->run[c]->finish_step) c++;
        if (n->run[c]->finish_step >= n->run[i]->finish_step) break;
        run_swap(n, i, c);
        i = c;
    }
    return top;
}

/* ---- small helpers ---- */

/* A standard normal draw from the steps' stream (Box-Muller), clamped to +-3. */
static double step_gauss(sim_t *s)
{
    uint64_t v[2];
    for (int k = 0; k < 2; k++) {
        s->step_rng ^= s->step_rng << 13;
        s->step_rng ^= s->step_rng >> 7;
        s->step_rng ^= s->step_rng << 17;
        v[k] = s->step_rng;
    }
    double u1 = ((double)(v[0] >> 11) + 0.5) / 9007199254740992.0, u2 = (double)(v[1] >> 11) / 9007199254740992.0;
    double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    return z > 3 ? 3 : z < -3 ? -3 : z;
}

static uint64_t rnd(sim_t *s)
{
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    return s->rng;
}

static void q_append(req_t **head, req_t **tail, req_t *r)
{
    r->next = NULL;
    if (*tail) (*tail)->next = r;
    else *head = r;
    *tail = r;
}

static req_t *q_pop(req_t **head, req_t **tail)
{
    req_t *r = *head;
    if (r) {
        *head = r->next;
        if (!*head) *tail = NULL;
        r->next = NULL;
    }
    return r;
}

static int done_add(sim_t *s, node_t *n, req_t *r)
{
    if (n->n_done == n->cap_done) {
        int c = n->cap_done ? n->cap_done * 2 : 16;
        req_t **q = realloc(n->done, (size_t)c * sizeof *q);
        if (!q) return s->err = BT_ERR_NOMEM;
        n->done = q;
        n->cap_done = c;
    }
    n->done[n->n_done++] = r;
    return 0;
}

static void hist_add(sim_hist_t *h, double x)
{
    int b = x <= 1e-5 ? 0 : (int)(log(x / 1e-5) / log(1.01));
    if (b >= SIM_HIST_BINS) b = SIM_HIST_BINS - 1;
    h->bins[b]++;
    h->n++;
    h->sum += x;
}

double sim_hist_quantile(const sim_hist_t *h, double q)
{
    if (!h->n) return 0;
    uint64_t want = (uint64_t)ceil(q * (double)h->n), seen = 0;
    if (want < 1) want = 1;
    for (int b = 0; b < SIM_HIST_BINS; b++) {
        seen += h->bins[b];
        if (seen >= want) return 1e-5 * pow(1.01, b + 0.5);
    }
    return 1e-5 * pow(1.01, SIM_HIST_BINS);
}

static req_t *req_new(sim_t *s)
{
    req_t *r = s->free_reqs;
    if (r) s->free_reqs = r->next;
    else r = malloc(sizeof *r);
    if (!r) {
        s->err = BT_ERR_NOMEM;
        return NULL;
    }
    memset(r, 0, sizeof *r);
    s->inflight++;
    return r;
}

static void req_free(sim_t *s, req_t *r)
{
    r->next = s->free_reqs;
    s->free_reqs = r;
    s->inflight--;
}

static double node_prefill_rate(const sim_t *s) { return 1.0 / s->pf->prefill_token_s; }

/* ---- request ends ---- */

static void req_finish(sim_t *s, req_t *r)
{
    double e2e = s->now - r->t_arrive, ttft = r->t_first - r->t_arrive;
    hist_add(&s->res->e2e, e2e);
    double tpot = r->osl > 1 ? (s->now - r->t_first) / (r->osl - 1) : 0;
    if (r->osl > 1) hist_add(&s->res->tpot, tpot);
    s->res->finished++;
    if ((s->cfg->slo_ttft_s <= 0 || ttft <= s->cfg->slo_ttft_s) && (s->cfg->slo_tpot_s <= 0 || tpot <= s->cfg->slo_tpot_s))
        s->res->good++;
    s->compete -= r->osl - r->gen;
    req_free(s, r);
}

static void req_fail(sim_t *s, req_t *r)
{
    s->res->failed++;
    if (r->gen == 0) {
        s->pending_prompt -= r->isl;
        s->pending_req -= 1;
    }
    s->compete -= r->osl - r->gen;
    req_free(s, r);
}

/* The first token reached the client. */
static void first_token(sim_t *s, req_t *r)
{
    r->t_first = s->now;
    r->gen = 1;
    s->gen_total++;
    s->compete -= 1;
    s->pending_prompt -= r->isl;
    s->pending_req -= 1;
    hist_add(&s->res->ttft, s->now - r->t_arrive);
    if (r->p >= 0) hist_add(&s->res->after_prefill, s->now - r->t_pdone);
}

/* ---- nodes ---- */

/* Puts r into decode node d's batch (its KV is there and reserved). */
static void join_batch(sim_t *s, node_t *n, req_t *r)
{
    r->ctx_base = (int64_t)(r->isl + r->gen) - n->step_idx;
    r->finish_step = n->step_idx + (r->osl - r->gen);
    n->ctx_base_sum += (double)r->ctx_base;
    run_push(s, n, r);
}

static int kv_fits(const sim_t *s, const node_t *n, const req_t *r)
{
    return s->kv_tokens <= 0 || n->kv_used + r->isl + r->osl <= s->kv_tokens || n->kv_used == 0;
}

/* Takes up to budget prompt tokens from n's queue (FCFS, chunked); decode nodes reserve KV as a prefill starts. */
static int64_t take_prefill(sim_t *s, node_t *n, int64_t budget)
{
    int64_t took = 0;
    while (budget > 0 && n->q_head) {
        req_t *r = n->q_head;
        if (n->decode && !r->kv_held) {
            if (!kv_fits(s, n, r) || n->n_run + n->n_done >= s->max_running) break;
            r->kv_held = 1;
            n->kv_used += r->isl + r->osl;
        }
        int64_t t = r->prefill_left < budget ? r->prefill_left : budget;
        r->prefill_left -= (int32_t)t;
        budget -= t;
        took += t;
        n->q_tokens -= t;
        if (r->prefill_left == 0) {
            q_pop(&n->q_head, &n->q_tail);
            n->q_len--;
            done_add(s, n, r);
        }
    }
    return took;
}

/* The share of a prefill node's core that a one-host cluster's router and clients take (profile
 * path_prefill_token_s): the decode nodes' streaming rate now times its CPU per token, spread over the alive
 * prefill nodes, at most 0.9. Scans the nodes: only such small clusters set it. */
static double path_share(const sim_t *s)
{
    double rate = 0;
    for (int i = 0; i < s->np + s->nd; i++)
        if (s->nodes[i].busy) rate += s->nodes[i].step_rate;
    double u = rate * s->pf->path_prefill_token_s / (s->n_alive_p > 0 ? s->n_alive_p : 1);
    return u < 0.9 ? u : 0.9;
}

static void node_start(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    if (n->busy || !n->alive) return;
    const plan_profile_t *pf = s->pf;
    int64_t ptoks;
    double dt;
    n->n_done = 0;
    if (!n->decode) {
        ptoks = take_prefill(s, n, s->chunk);
        if (!ptoks) return;
        dt = plan_prefill_step_s(pf, ptoks, n->n_done);
        if (pf->path_prefill_token_s > 0) dt /= 1.0 - path_share(s);
        n->step_b = 0;
    } else {
        while (n->w_head && n->n_run < s->max_running && kv_fits(s, n, n->w_head)) {
            req_t *r = q_pop(&n->w_head, &n->w_tail);
            n->w_len--;
            r->kv_held = 1;
            n->kv_used += r->isl + r->osl;
            join_batch(s, n, r);
        }
        int b = n->n_run;
        ptoks = take_prefill(s, n, s->chunk - b > 0 ? s->chunk - b : 0);
        if (!b && !ptoks) return;
        double ctx = n->ctx_base_sum + (double)b * (double)n->step_idx;
        /* every row streams one token, and on a one-host cluster the serving path's CPU for it (path_token_s)
         * comes out of the step */
        dt = (b ? plan_decode_step_s(pf, b, ctx) : pf->prefill_fixed_s) + (double)ptoks * pf->prefill_token_s +
             (double)n->n_done * pf->prefill_seq_s + (double)(b + n->n_done) * pf->path_token_s +
             (b ? pf->path_step_s : 0);
        n->step_b = b;
    }
    /* what idleness before it costs, then the profile's scatter around its shape's median */
    dt += plan_idle_extra_s(pf, s->now - n->last_end, dt);
    double spread = ptoks > 0 ? pf->prefill_spread : pf->decode_spread;
    if (spread > 0) dt *= exp(spread * step_gauss(s));
    n->step_rate = n->decode && n->step_b ? n->step_b / dt : 0;
    n->busy = 1;
    sim_node_stats_t *st = &s->res->nodes[i];
    st->busy_s += dt;
    st->steps++;
    st->tokens += (uint64_t)(ptoks + n->step_b);
    ev_push(s, s->now + dt, n->decode ? EV_DSTEP : EV_PSTEP, i, n->epoch, NULL);
}

static void place_and_send(sim_t *s, req_t *r);

/* A request lost its node: place it again with what it has delivered, or fail it. */
static void migrate(sim_t *s, req_t *r)
{
    s->res->migrations++;
    if (++r->migrations > (s->cfg->max_migrations > 0 ? s->cfg->max_migrations : RTR_DEFAULT_MIGRATIONS)) {
        req_fail(s, r);
        return;
    }
    r->kv_held = 0;
    place_and_send(s, r);
}

static void prefill_step_done(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    n->busy = 0;
    n->last_end = s->now;
    for (int k = 0; k < n->n_done; k++) {
        req_t *r = n->done[k];
        r->t_pdone = s->now;
        hist_add(&s->res->prefill_node, s->now - r->t_pq);
        double bytes = (double)r->xfer_tokens * s->pf->kv_bytes_per_token;
        double start = n->link_free > s->now ? n->link_free : s->now;
        n->link_free = start + bytes / s->xfer_bps;
        ev_push(s, n->link_free + s->xfer_lat, EV_KV_DONE, r->d, r->d_epoch, r);
    }
    n->n_done = 0;
    node_start(s, i);
}

static void kv_arrived(sim_t *s, node_t *n, req_t *r);

static void decode_step_done(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    n->busy = 0;
    n->step_rate = 0;
    n->last_end = s->now;
    n->step_idx++;
    s->gen_total += (uint64_t)n->step_b;
    s->compete -= n->step_b;
    while (n->n_run && n->run[0]->finish_step <= n->step_idx) {
        req_t *r = run_pop(n);
        r->gen = r->osl;
        n->ctx_base_sum -= (double)r->ctx_base;
        n->kv_used -= r->isl + r->osl;
        req_finish(s, r);
    }
    /* per-sequence delivered counts are implicit in the heap; prefills that completed now emit their token */
    for (int k = 0; k < n->n_done; k++) {
        req_t *r = n->done[k];
        if (r->gen == 0) first_token(s, r);
        else {
            r->gen++;
            s->gen_total++;
            s->compete -= 1;
        }
        if (r->gen >= r->osl) {
            n->kv_used -= r->isl + r->osl;
            req_finish(s, r);
        } else {
            join_batch(s, n, r);
        }
    }
    n->n_done = 0;
    for (req_t *r; (r = q_pop(&n->a_head, &n->a_tail));) kv_arrived(s, n, r);
    node_start(s, i);
}

/* r's KV is on decode node n: its first token goes out (the prefill node's) and it waits for a batch slot. */
static void kv_arrived(sim_t *s, node_t *n, req_t *r)
{
    if (r->gen == 0) first_token(s, r);
    else {
        r->gen++;
        s->gen_total++;
        s->compete -= 1;
    }
    if (r->gen >= r->osl) {
        req_finish(s, r);
        return;
    }
    q_append(&n->w_head, &n->w_tail, r);
    n->w_len++;
}

/* A decode node's engine sees a finished remote prefill between steps (the scheduler drains its control messages
 * before it plans the next one): an arrival during a step waits for that step's end, first token included. */
static void kv_done(sim_t *s, req_t *r, int d, uint32_t epoch)
{
    node_t *n = &s->nodes[d];
    if (!n->alive || n->epoch != epoch) {
        migrate(s, r);
        return;
    }
    if (n->busy) {
        q_append(&n->a_head, &n->a_tail, r);
        return;
    }
    kv_arrived(s, n, r);
    node_start(s, d);
}

/* ---- the router: admission, decode choice, placement ---- */

static void fill_place_node(const sim_t *s, int i, rtr_place_node_t *p)
{
    const node_t *n = &s->nodes[i];
    memset(p, 0, sizeof *p);
    p->node_id = n->id;
    p->queued_prefill_tokens = n->q_tokens;
    p->running_seqs = n->decode ? n->n_run + n->w_len : 0;
    p->prefill_tok_s = node_prefill_rate(s);
    p->step_s = (n->decode ? s->pf->decode_fixed_s : s->pf->prefill_fixed_s) + s->pf->prefill_token_s;
    p->tokens_per_step = 1;
    p->kv_transfer_bytes_s = s->xfer_bps;
}

static size_t req_hashes(sim_t *s, const req_t *r, int32_t tokens)
{
    size_t n = (size_t)(tokens / 16);
    if (n > SIM_MAX_HASHES) n = SIM_MAX_HASHES;
    size_t shared = r->group ? (size_t)(r->prefix_tokens / 16) : 0;
    for (size_t k = 0; k < n; k++) {
        uint64_t key = k < shared ? ((uint64_t)r->group << 32) ^ 0x5bd1e995u : r->id * 0x9E3779B97F4A7C15ull;
        uint64_t h = (key + k) * 0xBF58476D1CE4E5B9ull;
        s->hashes[k] = h ^ (h >> 31);
    }
    return n;
}

static size_t pmatch(sim_t *s, int i, size_t nh)
{
    if (!s->pindex || !nh) return 0;
    return rtr_pindex_match(s->pindex, s->nodes[i].id, (int64_t)s->nodes[i].epoch, s->hashes, nh);
}

static void pinsert(sim_t *s, int i, size_t nh)
{
    if (!s->pindex || !nh) return;
    rtr_pindex_insert(s->pindex, s->nodes[i].id, (int64_t)s->nodes[i].epoch, s->kv_tokens / 16, s->hashes, nh);
}

static int pick_decode(sim_t *s)
{
    int k = s->n_alive_d;
    int a = s->alive_d[rnd(s) % (uint64_t)k];
    if (k > 1) {
        int b = s->alive_d[rnd(s) % (uint64_t)(k - 1)];
        if (b == a) b = s->alive_d[k - 1];
        const node_t *na = &s->nodes[a], *nb = &s->nodes[b];
        double tot = (double)s->kv_tokens;
        double sa = rtr_decode_score(tot, tot - (double)na->kv_used, na->n_run + na->w_len + na->q_len, (double)s->max_running);
        double sb = rtr_decode_score(tot, tot - (double)nb->kv_used, nb->n_run + nb->w_len + nb->q_len, (double)s->max_running);
        if (sb > sa) a = b;
    }
    return a;
}

/* Places r (a new request or a migration) and queues it on its nodes. */
static void place_and_send(sim_t *s, req_t *r)
{
    if (!s->n_alive_d) {
        req_fail(s, r);
        return;
    }
    int32_t tokens = r->isl + r->gen; /* a migrated request prefills what it delivered too */
    int d = pick_decode(s);
    size_t nh = s->pindex ? req_hashes(s, r, tokens) : 0;
    rtr_place_node_t pn[RTR_SIM_MAX_PREFILL];
    rtr_place_cand_t cands[RTR_SIM_MAX_PREFILL];
    int pidx[RTR_SIM_MAX_PREFILL];
    size_t np = 0;
    if (s->n_alive_p) { /* the router's choice of candidates (rtr_prefill_candidates) */
        size_t na = (size_t)s->n_alive_p, pick[RTR_SIM_MAX_PREFILL];
        uint32_t hid[RTR_PINDEX_HOLDERS];
        int64_t hst[RTR_PINDEX_HOLDERS];
        size_t nhold = na > RTR_SIM_MAX_PREFILL && s->pindex && nh ? rtr_pindex_holders(s->pindex, s->hashes[0], hid, hst)
                                                                   : 0;
        for (size_t j = 0; nhold && j < na; j++) {
            const node_t *pnode = &s->nodes[s->alive_p[j]];
            uint32_t idh = pnode->id_hash;
            s->cand_holds[j] = 0;
            for (size_t t = 0; t < nhold; t++) s->cand_holds[j] |= hid[t] == idh && hst[t] == (int64_t)pnode->epoch;
        }
        size_t k = rtr_prefill_candidates(na, nhold ? s->cand_holds : NULL, RTR_SIM_MAX_PREFILL,
                                          &s->cand_rng, s->cand_scratch, pick);
        for (size_t j = 0; j < k; j++) {
            pidx[np] = s->alive_p[pick[j]];
            fill_place_node(s, pidx[np], &pn[np]);
            pn[np].cached_tokens = (int64_t)pmatch(s, pidx[np], nh) * 16;
            np++;
        }
    }
    rtr_place_input_t in = {.prompt_tokens = tokens, .prefill = pn, .n_prefill = np,
                            .mode = (rtr_prefill_mode)s->cfg->prefill_mode, .overhead_s = s->cfg->overhead_s,
                            .kv_bytes_per_token = s->pf->kv_bytes_per_token};
    fill_place_node(s, d, &in.decode);
    in.decode.cached_tokens = (int64_t)pmatch(s, d, nh) * 16;
    rtr_place_decision_t dec;
    rtr_place_decide(&in, cands, &dec);
    if (r->gen == 0 && r->migrations == 0 && s->cfg->admit_ttft_slo_s > 0 &&
        !rtr_place_within_slo(dec.best_ttft_s, s->cfg->admit_ttft_slo_s)) {
        s->res->rejected++;
        s->pending_prompt -= r->isl;
        s->pending_req -= 1;
        s->compete -= r->osl;
        req_free(s, r);
        return;
    }
    node_t *dn = &s->nodes[d];
    r->d = d;
    r->d_epoch = dn->epoch;
    if (dec.remote && dec.best >= 0) {
        int p = pidx[dec.best];
        node_t *pnode = &s->nodes[p];
        r->p = p;
        r->prefill_total = r->prefill_left = (int32_t)cands[dec.best].uncached_tokens;
        r->xfer_tokens = (int32_t)dec.uncached_local;
        r->t_pq = s->now;
        q_append(&pnode->q_head, &pnode->q_tail, r);
        pnode->q_len++;
        pnode->q_tokens += r->prefill_left;
        s->res->remote_prefills++;
        pinsert(s, p, nh);
        pinsert(s, d, nh);
        node_start(s, p);
    } else {
        r->p = -1;
        r->prefill_total = r->prefill_left = (int32_t)dec.uncached_local;
        r->xfer_tokens = 0;
        q_append(&dn->q_head, &dn->q_tail, r);
        dn->q_len++;
        dn->q_tokens += r->prefill_left;
        s->res->local_prefills++;
        pinsert(s, d, nh);
        node_start(s, d);
    }
}

static void admit(sim_t *s, const sim_arrival_t *a)
{
    req_t *r = req_new(s);
    if (!r) return;
    s->res->arrived++;
    r->t_arrive = s->now - s->pf->request_s; /* when the client sent it: TTFT and E2E count the path too */
    r->isl = a->prompt_tokens > 0 ? a->prompt_tokens : 1;
    r->osl = a->output_tokens > 0 ? a->output_tokens : 1;
    r->group = a->prefix_group;
    r->prefix_tokens = a->prefix_tokens;
    r->id = ++s->next_id;
    double bound = s->cfg->max_queue_s == 0 ? RTR_DEFAULT_MAX_QUEUE_S : s->cfg->max_queue_s;
    if (bound >= 0) {
        double dr, pr;
        rtr_admit_rates(s->gen_rate, 0, s->n_alive_p || s->n_alive_d ? node_prefill_rate(s) : 0, s->n_alive_d,
                        s->n_alive_p, &dr, &pr);
        if (rtr_admit_queue_s(s->pending_prompt, s->compete, 1, r->isl, r->osl, dr, pr) > bound) {
            s->res->rejected++;
            req_free(s, r);
            return;
        }
    }
    s->admitted++;
    s->prompt_total += (uint64_t)r->isl;
    s->pending_prompt += r->isl;
    s->pending_req += 1;
    s->compete += r->osl;
    place_and_send(s, r);
}

/* ---- failures ---- */

static void alive_remove(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    int *list = n->decode ? s->alive_d : s->alive_p, *cnt = n->decode ? &s->n_alive_d : &s->n_alive_p;
    int last = list[--*cnt];
    list[n->alive_i] = last;
    s->nodes[last].alive_i = n->alive_i;
}

static void alive_add(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    int *list = n->decode ? s->alive_d : s->alive_p, *cnt = n->decode ? &s->n_alive_d : &s->n_alive_p;
    n->alive_i = *cnt;
    list[(*cnt)++] = i;
}

static void node_fail(sim_t *s, int i, double repair_s)
{
    node_t *n = &s->nodes[i];
    n->alive = 0;
    n->epoch++;
    n->busy = 0;
    n->step_rate = 0;
    alive_remove(s, i);
    s->res->nodes[i].failures++;
    if (s->pindex) rtr_pindex_forget(s->pindex, n->id);
    /* collect everything it held, then move it */
    req_t *lost = NULL, *r;
    for (int k = 0; k < n->n_done; k++) n->done[k]->next = lost, lost = n->done[k];
    n->n_done = 0;
    while ((r = q_pop(&n->q_head, &n->q_tail))) r->next = lost, lost = r;
    while ((r = q_pop(&n->w_head, &n->w_tail))) r->next = lost, lost = r;
    while ((r = q_pop(&n->a_head, &n->a_tail))) r->next = lost, lost = r;
    for (int k = 0; k < n->n_run; k++) {
        r = n->run[k];
        r->gen = r->osl - (int32_t)(r->finish_step - n->step_idx); /* tokens delivered until now */
        r->next = lost;
        lost = r;
    }
    n->n_run = 0;
    n->q_len = n->w_len = 0;
    n->q_tokens = n->kv_used = 0;
    n->ctx_base_sum = 0;
    if (repair_s > 0) ev_push(s, s->now + repair_s, EV_REPAIR, i, 0, NULL);
    while (lost) {
        r = lost;
        lost = r->next;
        migrate(s, r);
    }
}

static void fail_event(sim_t *s, int fi)
{
    const sim_fail_t *f = &s->cfg->fails[fi];
    for (int k = 0; k < f->count; k++) {
        int cnt = f->decode ? s->n_alive_d : s->n_alive_p;
        if (cnt <= (f->decode ? 1 : 0)) break; /* keep one decode node: the cluster is otherwise down */
        int *list = f->decode ? s->alive_d : s->alive_p;
        node_fail(s, list[rnd(s) % (uint64_t)cnt], f->repair_s);
    }
}

static void repair_event(sim_t *s, int i)
{
    node_t *n = &s->nodes[i];
    n->alive = 1;
    n->epoch++;
    n->link_free = s->now;
    n->last_end = s->now; /* a repaired node starts idle */
    alive_add(s, i);
}

/* ---- planner ---- */

static void plan_tick(sim_t *s)
{
    double *smp = s->plan_ring[s->plan_n % 32];
    smp[0] = s->now;
    smp[1] = (double)s->admitted;
    smp[2] = (double)s->prompt_total;
    smp[3] = (double)s->gen_total;
    int back = s->plan_n < RTR_PLANNER_WINDOW_S ? s->plan_n : RTR_PLANNER_WINDOW_S;
    const double *o = s->plan_ring[(s->plan_n - back) % 32];
    s->plan_n++;
    double dt = smp[0] - o[0];
    plan_obs_t obs = {.routers = 1, .queued = s->pending_req};
    if (dt > 0) {
        obs.req_s = (smp[1] - o[1]) / dt;
        obs.prompt_tok_s = (smp[2] - o[2]) / dt;
        obs.gen_tok_s = (smp[3] - o[3]) / dt;
    }
    /* admission's measured rate: generated tokens over the last 5 ticks */
    double *g = s->gen_ring[s->gen_n % 6], *b = s->gen_ring[(s->gen_n + 1) % 6];
    g[0] = s->now;
    g[1] = (double)s->gen_total;
    if (++s->gen_n >= 6 && g[0] > b[0]) s->gen_rate = (g[1] - b[1]) / (g[0] - b[0]);
    plan_targets_t t = {.ttft_s = s->cfg->slo_ttft_s, .tpot_s = s->cfg->slo_tpot_s, .colocated = s->np == 0,
                        .transport = s->cfg->transport};
    plan_answer_t a;
    plan_compute(s->pf, &t, &obs, &a);
    int np = plan_smooth_tick(&s->sp, a.prefill), nd = plan_smooth_tick(&s->sd, a.decode);
    if (s->res->n_plan == s->plan_cap) {
        int c = s->plan_cap ? s->plan_cap * 2 : 256;
        sim_plan_point_t *q = realloc(s->res->plan, (size_t)c * sizeof *q);
        if (!q) {
            s->err = BT_ERR_NOMEM;
            return;
        }
        s->res->plan = q;
        s->plan_cap = c;
    }
    sim_plan_point_t *pt = &s->res->plan[s->res->n_plan++];
    pt->t = s->now;
    pt->prefill = np;
    pt->decode = nd;
    pt->rate = obs.req_s;
    plan_predict(s->pf, &t, a.lambda, a.isl, a.osl, np, nd, &pt->ttft_s, &pt->tpot_s);
    double iv = s->cfg->planner_interval_s > 0 ? s->cfg->planner_interval_s : 1.0;
    if (!s->arrivals_done || s->inflight) ev_push(s, s->now + iv, EV_PLAN, 0, 0, NULL);
}

/* ---- the run ---- */

static void next_arrival(sim_t *s)
{
    sim_arrival_t a;
    if (s->arrivals_done) return;
    if (s->next(s->ud, &a) || (s->cfg->duration_s > 0 && a.t > s->cfg->duration_s)) {
        s->arrivals_done = 1;
        return;
    }
    sim_arrival_t *keep = malloc(sizeof *keep);
    if (!keep) {
        s->err = BT_ERR_NOMEM;
        return;
    }
    *keep = a;
    /* the request reaches the router's placement after the serving path's own time (profile request_s) */
    ev_push(s, (a.t > s->now ? a.t : s->now) + s->pf->request_s, EV_ARRIVAL, 0, 0, keep);
}

static bt_status sim_setup(sim_t *s, const sim_config_t *cfg, sim_result_t *res)
{
    const plan_profile_t *pf = &cfg->profile;
    if (!plan_profile_usable(pf)) return bt_fail(BT_ERR_INVALID, "the profile lacks prefill.token_s or decode.fixed_s");
    if (cfg->n_decode < 1 || cfg->n_prefill < 0 || cfg->n_decode + cfg->n_prefill > 1000000)
        return bt_fail(BT_ERR_INVALID, "want at least one decode node and at most a million nodes");
    s->cfg = cfg;
    s->pf = pf;
    s->res = res;
    s->np = cfg->n_prefill;
    s->nd = cfg->n_decode;
    s->rng = cfg->seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    if (!s->rng) s->rng = 1;
    s->chunk = pf->chunk_tokens > 0 ? pf->chunk_tokens : PLAN_DEFAULT_CHUNK;
    s->max_running = pf->max_running > 0 ? pf->max_running : PLAN_DEFAULT_MAX_RUNNING;
    s->kv_tokens = pf->kv_tokens;
    const plan_transport_t *x = plan_profile_transport(pf, cfg->transport);
    if (cfg->transport && *cfg->transport && !x && !(cfg->link_bytes_s > 0))
        return bt_fail(BT_ERR_INVALID, "the profile has no transport '%s'", cfg->transport);
    s->xfer_bps = cfg->link_bytes_s > 0 ? cfg->link_bytes_s : x ? x->bytes_s : RTR_PLACE_DEFAULT_XFER_BPS;
    s->xfer_lat = cfg->link_latency_s > 0 ? cfg->link_latency_s : x ? x->latency_s : 0;
    int n = s->np + s->nd;
    s->nodes = calloc((size_t)n, sizeof *s->nodes);
    s->alive_p = calloc((size_t)(s->np + 1), sizeof(int));
    s->alive_d = calloc((size_t)s->nd, sizeof(int));
    s->cand_holds = calloc((size_t)(s->np + 1), 1);
    s->cand_scratch = calloc((size_t)(s->np + 1), sizeof(size_t));
    s->cand_rng = s->rng ^ 0x5bd1e995ull;
    s->step_rng = s->rng ^ 0x9b05688c2b3e6c1full;
    res->nodes = calloc((size_t)n, sizeof *res->nodes);
    if (!s->nodes || !s->alive_p || !s->alive_d || !s->cand_holds || !s->cand_scratch || !res->nodes)
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    res->n_nodes = n;
    for (int i = 0; i < n; i++) {
        node_t *nd = &s->nodes[i];
        nd->decode = i >= s->np;
        nd->alive = 1;
        snprintf(nd->id, sizeof nd->id, "%s%d", nd->decode ? "d" : "p", nd->decode ? i - s->np : i);
        nd->id_hash = rtr_pindex_id_hash(nd->id);
        alive_add(s, i);
    }
    if (cfg->use_prefix_index && rtr_pindex_create(&s->pindex)) return bt_fail(BT_ERR_NOMEM, "out of memory");
    int w = cfg->planner_window > 0 ? cfg->planner_window : PLAN_DEFAULT_DOWN_WINDOW;
    plan_smooth_init(&s->sp, w);
    plan_smooth_init(&s->sd, w);
    return BT_OK;
}

static void sim_teardown(sim_t *s)
{
    for (int i = 0; s->nodes && i < s->np + s->nd; i++) {
        free(s->nodes[i].run);
        free(s->nodes[i].done);
    }
    free(s->nodes);
    free(s->alive_p);
    free(s->alive_d);
    free(s->cand_holds);
    free(s->cand_scratch);
    for (size_t i = 0; i < s->n_ev; i++)
        if (s->heap[i].type == EV_ARRIVAL) free(s->heap[i].p);
    free(s->heap);
    while (s->free_reqs) {
        req_t *r = s->free_reqs;
        s->free_reqs = r->next;
        free(r);
    }
    rtr_pindex_destroy(s->pindex);
}

bt_status sim_run(const sim_config_t *cfg, sim_next_fn next, void *ud, sim_result_t *out)
{
    struct timespec w0, w1;
    clock_gettime(CLOCK_MONOTONIC, &w0);
    sim_t s;
    memset(&s, 0, sizeof s);
    sim_result_t res;
    memset(&res, 0, sizeof res);
    s.next = next;
    s.ud = ud;
    bt_status st = sim_setup(&s, cfg, &res);
    if (st) {
        sim_teardown(&s);
        sim_result_free(&res);
        return st;
    }
    for (int f = 0; f < cfg->n_fails; f++) ev_push(&s, cfg->fails[f].t, EV_FAIL, f, 0, NULL);
    ev_push(&s, 0, EV_PLAN, 0, 0, NULL);
    next_arrival(&s);
    while (s.n_ev && !s.err) {
        ev_t e = ev_pop(&s);
        s.now = e.t;
        res.events++;
        switch (e.type) {
        case EV_ARRIVAL: {
            sim_arrival_t a = *(sim_arrival_t *)e.p;
            free(e.p);
            res.arrivals_end_s = s.now;
            admit(&s, &a);
            next_arrival(&s);
            break;
        }
        case EV_PSTEP:
            if (s.nodes[e.a].epoch == e.b && s.nodes[e.a].alive) prefill_step_done(&s, e.a);
            break;
        case EV_DSTEP:
            if (s.nodes[e.a].epoch == e.b && s.nodes[e.a].alive) decode_step_done(&s, e.a);
            break;
        case EV_KV_DONE: kv_done(&s, e.p, e.a, e.b); break;
        case EV_PLAN: plan_tick(&s); break;
        case EV_FAIL: fail_event(&s, e.a); break;
        case EV_REPAIR: repair_event(&s, e.a); break;
        }
        if (e.type != EV_PLAN) res.sim_end_s = s.now;
    }
    uint64_t left = s.inflight;
    st = s.err ? bt_fail(s.err, "out of memory") : BT_OK;
    sim_teardown(&s);
    if (!st && (left || res.arrived != res.finished + res.rejected + res.failed))
        st = bt_fail(BT_ERR_INTERNAL, "simulation lost requests: %llu arrived, %llu finished, %llu rejected, %llu "
                     "failed, %llu still held", (unsigned long long)res.arrived, (unsigned long long)res.finished,
                     (unsigned long long)res.rejected, (unsigned long long)res.failed, (unsigned long long)left);
    if (st) {
        sim_result_free(&res);
        return st;
    }
    clock_gettime(CLOCK_MONOTONIC, &w1);
    res.wall_s = (double)(w1.tv_sec - w0.tv_sec) + (w1.tv_nsec - w0.tv_nsec) / 1e9;
    *out = res;
    return BT_OK;
}

void sim_result_free(sim_result_t *res)
{
    free(res->nodes);
    free(res->plan);
    memset(res, 0, sizeof *res);
}
