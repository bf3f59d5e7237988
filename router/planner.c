/* The SLA planner's arithmetic (formulas in planner.h). Pure: no clock, no I/O, no globals. */
#include "router/planner.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int plan_profile_usable(const plan_profile_t *p)
{
    return p && p->prefill_token_s > 0 && p->decode_fixed_s > 0;
}

double plan_prefill_step_s(const plan_profile_t *p, int64_t n_tokens, int64_t n_prompts)
{
    return p->prefill_fixed_s + (double)n_tokens * p->prefill_token_s + (double)n_prompts * p->prefill_seq_s;
}

double plan_decode_step_s(const plan_profile_t *p, int64_t batch, double ctx_tokens)
{
    const double ctx = ctx_tokens * p->decode_ctx_s;
    const int n = p->n_batch;
    if (n < 1) return p->decode_fixed_s + (double)batch * p->decode_seq_s + ctx;
    if (batch <= p->batch_b[0]) return p->batch_s[0] + ctx;
    if (batch >= p->batch_b[n - 1]) return p->batch_s[n - 1] + (double)(batch - p->batch_b[n - 1]) * p->decode_seq_s + ctx;
    int i = 1;
    while (p->batch_b[i] < batch) i++;
    const double b0 = p->batch_b[i - 1], b1 = p->batch_b[i];
    return p->batch_s[i - 1] + (p->batch_s[i] - p->batch_s[i - 1]) * ((double)batch - b0) / (b1 - b0) + ctx;
}

double plan_idle_extra_s(const plan_profile_t *p, double gap_s, double step_s)
{
    if (p->n_idle < 1 || !(gap_s > 0) || !(step_s > 0) || !(p->idle_step_s > 0)) return 0;
    double e;
    if (gap_s <= p->idle_gap_s[0]) {
        e = p->idle_extra_s[0] * gap_s / p->idle_gap_s[0];
    } else {
        int i = 1;
        while (i < p->n_idle && p->idle_gap_s[i] < gap_s) i++;
        if (i == p->n_idle) {
            e = p->idle_extra_s[p->n_idle - 1];
        } else {
            double g0 = p->idle_gap_s[i - 1], g1 = p->idle_gap_s[i];
            e = p->idle_extra_s[i - 1] + (p->idle_extra_s[i] - p->idle_extra_s[i - 1]) * (gap_s - g0) / (g1 - g0);
        }
    }
    return e * (step_s < p->idle_step_s ? step_s / p->idle_step_s : 1.0);
}

const plan_transport_t *plan_profile_transport(const plan_profile_t *p, const char *name)
{
    for (int i = 0; i < p->n_xfer; i++)
        if (!name || !*name || !strcmp(p->xfer[i].name, name)) return &p->xfer[i];
    return NULL;
}

/* ---- profile JSON ---- */

static bt_status get_num(const cJSON *o, const char *name, int required, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!v) return required ? bt_fail(BT_ERR_FORMAT, "profile: \"%s\" is missing", name) : BT_OK;
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || !isfinite(v->valuedouble))
        return bt_fail(BT_ERR_FORMAT, "profile: \"%s\" must be a number >= 0", name);
    *out = v->valuedouble;
    return BT_OK;
}

/* "idle": {"step_s": S, "gap_s": [...], "extra_s": [...]}: optional; gaps > 0 and increasing, extras >= 0. */
static bt_status parse_idle(const cJSON *root, plan_profile_t *p)
{
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "idle");
    if (!o) return BT_OK;
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(o, "gap_s"), *e = cJSON_GetObjectItemCaseSensitive(o, "extra_s");
    if (!cJSON_IsObject(o) || !cJSON_IsArray(g) || !cJSON_IsArray(e) ||
        cJSON_GetArraySize(g) != cJSON_GetArraySize(e) || cJSON_GetArraySize(g) > PLAN_MAX_IDLE)
        return bt_fail(BT_ERR_FORMAT, "profile: \"idle\" must be an object with arrays \"gap_s\" and \"extra_s\" "
                       "of the same length (at most %d)", PLAN_MAX_IDLE);
    bt_status st = get_num(o, "step_s", 1, &p->idle_step_s);
    if (st) return st;
    int n = cJSON_GetArraySize(g);
    for (int i = 0; i < n; i++) {
        const cJSON *gi = cJSON_GetArrayItem(g, i), *ei = cJSON_GetArrayItem(e, i);
        if (!cJSON_IsNumber(gi) || !cJSON_IsNumber(ei) || !(gi->valuedouble > 0) || !isfinite(gi->valuedouble) ||
            !(ei->valuedouble >= 0) || !isfinite(ei->valuedouble) || (i && !(gi->valuedouble > p->idle_gap_s[i - 1])))
            return bt_fail(BT_ERR_FORMAT, "profile: idle point %d: gaps must be increasing numbers > 0 and extras "
                           "numbers >= 0", i);
        p->idle_gap_s[i] = gi->valuedouble;
        p->idle_extra_s[i] = ei->valuedouble;
    }
    p->n_idle = n;
    return BT_OK;
}

/* decode.batch_s: [[B, s], ...], B whole and increasing, s > 0; absent = none. */
static bt_status parse_batch_points(const cJSON *dec, plan_profile_t *p)
{
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(dec, "batch_s"), *e;
    if (!a) return BT_OK;
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) > PLAN_MAX_BATCH_POINTS)
        return bt_fail(BT_ERR_FORMAT, "profile: \"decode.batch_s\" must be an array of at most %d [batch, seconds] "
                       "pairs", PLAN_MAX_BATCH_POINTS);
    int n = 0;
    cJSON_ArrayForEach(e, a)
    {
        const cJSON *b = cJSON_GetArrayItem(e, 0), *t = cJSON_GetArrayItem(e, 1);
        if (!cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2 || !cJSON_IsNumber(b) || !cJSON_IsNumber(t) ||
            b->valuedouble < 1 || b->valuedouble > 1e6 || b->valuedouble != floor(b->valuedouble) ||
            !(t->valuedouble > 0) || (n > 0 && b->valuedouble <= p->batch_b[n - 1]))
            return bt_fail(BT_ERR_FORMAT, "profile: decode.batch_s point %d: batches must be increasing whole numbers "
                           ">= 1 and times numbers > 0", n);
        p->batch_b[n] = (int32_t)b->valuedouble;
        p->batch_s[n] = t->valuedouble;
        n++;
    }
    p->n_batch = n;
    return BT_OK;
}

static bt_status parse_profile(const cJSON *root, plan_profile_t *p)
{
    if (!cJSON_IsObject(root)) return bt_fail(BT_ERR_FORMAT, "profile: not a JSON object");
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(root, "prefill");
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "decode");
    if (!cJSON_IsObject(pre)) return bt_fail(BT_ERR_FORMAT, "profile: \"prefill\" object is missing");
    if (!cJSON_IsObject(dec)) return bt_fail(BT_ERR_FORMAT, "profile: \"decode\" object is missing");
    double chunk = PLAN_DEFAULT_CHUNK, running = PLAN_DEFAULT_MAX_RUNNING, kv = 0;
    bt_status st;
    if ((st = get_num(pre, "fixed_s", 1, &p->prefill_fixed_s)) || (st = get_num(pre, "token_s", 1, &p->prefill_token_s)) ||
        (st = get_num(pre, "seq_s", 0, &p->prefill_seq_s)) || (st = get_num(pre, "chunk_tokens", 0, &chunk)) || (st = get_num(dec, "fixed_s", 1, &p->decode_fixed_s)) ||
        (st = get_num(dec, "seq_s", 1, &p->decode_seq_s)) || (st = get_num(dec, "ctx_token_s", 0, &p->decode_ctx_s)) ||
        (st = get_num(dec, "max_running", 0, &running)) || (st = get_num(dec, "kv_tokens", 0, &kv)) ||
        (st = get_num(root, "kv_bytes_per_token", 0, &p->kv_bytes_per_token)))
        return st;
    const cJSON *rt = cJSON_GetObjectItemCaseSensitive(root, "router");
    if (rt && !cJSON_IsObject(rt)) return bt_fail(BT_ERR_FORMAT, "profile: \"router\" must be an object");
    if (rt && ((st = get_num(rt, "request_s", 0, &p->request_s)) || (st = get_num(rt, "token_s", 0, &p->path_token_s)) ||
               (st = get_num(rt, "step_s", 0, &p->path_step_s)) ||
               (st = get_num(rt, "prefill_token_s", 0, &p->path_prefill_token_s))))
        return st;
    if (!(p->prefill_token_s > 0)) return bt_fail(BT_ERR_FORMAT, "profile: \"prefill.token_s\" must be > 0");
    if (!(p->decode_fixed_s > 0)) return bt_fail(BT_ERR_FORMAT, "profile: \"decode.fixed_s\" must be > 0");
    if (chunk < 1 || running < 1) return bt_fail(BT_ERR_FORMAT, "profile: chunk_tokens and max_running must be >= 1");
    p->chunk_tokens = (int64_t)chunk;
    p->max_running = (int64_t)running;
    p->kv_tokens = (int64_t)kv;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(root, "transfer"), *e;
    if (x && !cJSON_IsObject(x)) return bt_fail(BT_ERR_FORMAT, "profile: \"transfer\" must be an object");
    cJSON_ArrayForEach(e, x)
    {
        if (p->n_xfer == PLAN_MAX_TRANSPORTS) break;
        plan_transport_t *t = &p->xfer[p->n_xfer];
        if (!cJSON_IsObject(e)) return bt_fail(BT_ERR_FORMAT, "profile: transfer \"%s\" must be an object", e->string);
        if ((st = get_num(e, "latency_s", 0, &t->latency_s)) || (st = get_num(e, "bytes_s", 1, &t->bytes_s))) return st;
        if (!(t->bytes_s > 0)) return bt_fail(BT_ERR_FORMAT, "profile: transfer \"%s\" bytes_s must be > 0", e->string);
        snprintf(t->name, sizeof t->name, "%s", e->string);
        p->n_xfer++;
    }
    if ((st = get_num(pre, "spread", 0, &p->prefill_spread)) || (st = get_num(dec, "spread", 0, &p->decode_spread)) ||
        (st = parse_idle(root, p)) || (st = parse_batch_points(dec, p)))
        return st;
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(root, "host"), *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (cJSON_IsString(h)) snprintf(p->host, sizeof p->host, "%s", h->valuestring);
    if (cJSON_IsString(m)) snprintf(p->model, sizeof p->model, "%s", m->valuestring);
    return BT_OK;
}

bt_status plan_profile_from_json(const char *text, plan_profile_t *out)
{
    cJSON *root = cJSON_Parse(text);
    if (!root) return bt_fail(BT_ERR_FORMAT, "profile: not valid JSON");
    plan_profile_t p;
    memset(&p, 0, sizeof p);
    bt_status st = parse_profile(root, &p);
    cJSON_Delete(root);
    if (st == BT_OK) *out = p;
    return st;
}

char *plan_profile_to_json(const plan_profile_t *p, const char *samples_json)
{
    cJSON *o = cJSON_CreateObject(), *pre = cJSON_AddObjectToObject(o, "prefill"), *dec = cJSON_AddObjectToObject(o, "decode");
    cJSON *x = cJSON_AddObjectToObject(o, "transfer");
    if (!o || !pre || !dec || !x) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddStringToObject(o, "host", p->host);
    cJSON_AddStringToObject(o, "model", p->model);
    cJSON_AddNumberToObject(o, "kv_bytes_per_token", p->kv_bytes_per_token);
    cJSON_AddNumberToObject(pre, "fixed_s", p->prefill_fixed_s);
    cJSON_AddNumberToObject(pre, "token_s", p->prefill_token_s);
    cJSON_AddNumberToObject(pre, "seq_s", p->prefill_seq_s);
    cJSON_AddNumberToObject(pre, "chunk_tokens", (double)p->chunk_tokens);
    cJSON_AddNumberToObject(dec, "fixed_s", p->decode_fixed_s);
    cJSON_AddNumberToObject(dec, "seq_s", p->decode_seq_s);
    cJSON_AddNumberToObject(dec, "ctx_token_s", p->decode_ctx_s);
    cJSON_AddNumberToObject(dec, "max_running", (double)p->max_running);
    cJSON_AddNumberToObject(dec, "kv_tokens", (double)p->kv_tokens);
    if (p->prefill_spread > 0) cJSON_AddNumberToObject(pre, "spread", p->prefill_spread);
    if (p->decode_spread > 0) cJSON_AddNumberToObject(dec, "spread", p->decode_spread);
    cJSON *bs = p->n_batch > 0 ? cJSON_AddArrayToObject(dec, "batch_s") : NULL;
    for (int i = 0; bs && i < p->n_batch; i++) {
        double v[2] = {p->batch_b[i], p->batch_s[i]};
        cJSON_AddItemToArray(bs, cJSON_CreateDoubleArray(v, 2));
    }
    if (p->n_idle > 0) {
        cJSON *idle = cJSON_AddObjectToObject(o, "idle");
        cJSON *g = idle ? cJSON_AddArrayToObject(idle, "gap_s") : NULL;
        cJSON *e = idle ? cJSON_AddArrayToObject(idle, "extra_s") : NULL;
        if (idle) cJSON_AddNumberToObject(idle, "step_s", p->idle_step_s);
        for (int i = 0; g && e && i < p->n_idle; i++) {
            cJSON_AddItemToArray(g, cJSON_CreateNumber(p->idle_gap_s[i]));
            cJSON_AddItemToArray(e, cJSON_CreateNumber(p->idle_extra_s[i]));
        }
    }
    if (p->request_s > 0 || p->path_token_s > 0 || p->path_step_s > 0 || p->path_prefill_token_s > 0) {
        cJSON *rt = cJSON_AddObjectToObject(o, "router");
        if (rt) cJSON_AddNumberToObject(rt, "request_s", p->request_s);
        if (rt) cJSON_AddNumberToObject(rt, "token_s", p->path_token_s);
        if (rt && p->path_step_s > 0) cJSON_AddNumberToObject(rt, "step_s", p->path_step_s);
        if (rt && p->path_prefill_token_s > 0) cJSON_AddNumberToObject(rt, "prefill_token_s", p->path_prefill_token_s);
    }
    for (int i = 0; i < p->n_xfer; i++) {
        cJSON *t = cJSON_AddObjectToObject(x, p->xfer[i].name);
        if (!t) continue;
        cJSON_AddNumberToObject(t, "latency_s", p->xfer[i].latency_s);
        cJSON_AddNumberToObject(t, "bytes_s", p->xfer[i].bytes_s);
    }
    cJSON *s = samples_json ? cJSON_Parse(samples_json) : NULL;
    if (s) cJSON_AddItemToObject(o, "samples", s);
    char *txt = cJSON_Print(o);
    cJSON_Delete(o);
    return txt;
}

/* ---- fitting ---- */

/* Solves the (k+1)x(k+1) normal equations for the regressors flagged in use[]; unused coefficients are 0. */
static int solve_ls(const double *x, int k_dim, const double *y, const double *w, int n, const int *use, double *c)
{
    int idx[3], m = 0;
    for (int j = 0; j <= k_dim; j++)
        if (j == 0 || use[j - 1]) idx[m++] = j;
    double a[3][4] = {{0}};
    for (int i = 0; i < n; i++) {
        double row[3];
        for (int r = 0; r < m; r++) row[r] = idx[r] == 0 ? 1.0 : x[i * k_dim + idx[r] - 1];
        double wi = w ? w[i] : 1.0;
        for (int r = 0; r < m; r++) {
            for (int q = 0; q < m; q++) a[r][q] += wi * row[r] * row[q];
            a[r][m] += wi * row[r] * y[i];
        }
    }
    for (int col = 0; col < m; col++) { /* Gauss-Jordan with partial pivoting */
        int piv = col;
        for (int r = col + 1; r < m; r++)
            if (fabs(a[r][col]) > fabs(a[piv][col])) piv = r;
        if (fabs(a[piv][col]) < 1e-300) return -1;
        for (int q = 0; q <= m; q++) {
            double tmp = a[col][q];
            a[col][q] = a[piv][q];
            a[piv][q] = tmp;
        }
        for (int r = 0; r < m; r++) {
            if (r == col) continue;
            double f = a[r][col] / a[col][col];
            for (int q = col; q <= m; q++) a[r][q] -= f * a[col][q];
        }
    }
    for (int j = 0; j <= k_dim; j++) c[j] = 0;
    for (int r = 0; r < m; r++) c[idx[r]] = a[r][m] / a[r][r];
    return 0;
}

int plan_fit_linear(const double *x, int k_dim, const double *y, const double *w, int n, double *c)
{
    if (k_dim < 1 || k_dim > 2 || n < k_dim + 1) return -1;
    int use[2] = {1, 1};
    for (int pass = 0; pass < 3; pass++) {
        if (solve_ls(x, k_dim, y, w, n, use, c)) return -1;
        int again = 0;
        for (int j = 0; j < k_dim; j++)
            if (use[j] && c[j + 1] < 0) {
                use[j] = 0;
                again = 1;
            }
        if (!again) break;
    }
    if (c[0] < 0) c[0] = 0;
    return 0;
}

/* ---- observations ---- */

void plan_obs_merge(plan_obs_t *a, const plan_obs_t *b)
{
    a->req_s += b->req_s;
    a->prompt_tok_s += b->prompt_tok_s;
    a->gen_tok_s += b->gen_tok_s;
    a->queued += b->queued;
    a->routers += b->routers > 0 ? b->routers : 1;
}

/* ---- queueing ---- */

static double headroom(const plan_targets_t *t) { return t->headroom > 0 && t->headroom <= 1 ? t->headroom : PLAN_DEFAULT_HEADROOM; }
static double ttft_target(const plan_targets_t *t) { return t->ttft_s > 0 ? t->ttft_s : PLAN_DEFAULT_TTFT_S; }
static double tpot_target(const plan_targets_t *t) { return t->tpot_s > 0 ? t->tpot_s : PLAN_DEFAULT_TPOT_S; }

/* One request's prefill compute: a step per chunk, each paying the fixed cost. */
static double prefill_service_s(const plan_profile_t *p, double isl)
{
    double chunk = p->chunk_tokens > 0 ? (double)p->chunk_tokens : PLAN_DEFAULT_CHUNK;
    return ceil(isl / chunk) * p->prefill_fixed_s + isl * p->prefill_token_s + p->prefill_seq_s;
}

/* p90 of an M/M/1 wait at utilisation rho with mean service s. */
static double wait90(double rho, double s)
{
    if (rho >= 1) return INFINITY;
    if (rho <= 0.1) return 0;
    return s * log(10.0 * rho) / (1.0 - rho);
}

/* p90 of an M/M/c wait: c servers of mean service s, arrivals lambda. Erlang C by the Erlang B recurrence;
 * P(W > t) = C exp(-(c / s - lambda) t). */
static double wait90_c(double lambda, double s, int c)
{
    double a = lambda * s, rho = a / c;
    if (rho >= 1) return INFINITY;
    double b = 1;
    for (int k = 1; k <= c; k++) b = a * b / (k + a * b);
    double erlang_c = b / (1 - rho * (1 - b));
    if (erlang_c <= 0.1) return 0;
    return log(erlang_c / 0.1) / ((double)c / s - lambda);
}

static double transfer_s(const plan_profile_t *p, const plan_targets_t *t, double isl)
{
    const plan_transport_t *x = plan_profile_transport(p, t->transport);
    if (!x || p->kv_bytes_per_token <= 0) return 0;
    return x->latency_s + isl * p->kv_bytes_per_token / x->bytes_s;
}

/* Decode on nd nodes: p90 step time (INFINITY when saturated or out of batch/KV room) and the busy share. */
static double decode_tpot90(const plan_profile_t *p, double lambda, double isl, double osl, int nd)
{
    double per_node = lambda / nd, ctx = isl + osl / 2.0;
    double marginal = p->decode_seq_s + ctx * p->decode_ctx_s;
    double denom = 1.0 - per_node * osl * marginal;
    if (denom <= 0) return INFINITY;
    double step = p->decode_fixed_s / denom;
    double b = per_node * osl * step, b90 = b + PLAN_P90_Z * sqrt(b);
    int64_t max_run = p->max_running > 0 ? p->max_running : PLAN_DEFAULT_MAX_RUNNING;
    if (b90 > (double)max_run) return INFINITY;
    if (p->kv_tokens > 0 && b90 * (isl + osl) > (double)p->kv_tokens) return INFINITY;
    return p->decode_fixed_s + b90 * marginal;
}

void plan_predict(const plan_profile_t *p, const plan_targets_t *t, double lambda, double isl, double osl, int np,
                  int nd, double *ttft_s, double *tpot_s)
{
    if (nd < 1) nd = 1;
    double s = prefill_service_s(p, isl);
    double tpot = decode_tpot90(p, lambda, isl, osl, nd);
    if (np > 0) {
        *ttft_s = wait90_c(lambda, s, np) + s + transfer_s(p, t, isl) + p->request_s;
        *tpot_s = tpot;
        return;
    }
    /* colocated: each node's time is shared between prefill (rho_p) and decode steps; a prompt waits behind the
     * prompts before it and rides one decode step */
    double rho_p = lambda * s / nd;
    *tpot_s = rho_p < 1 && isfinite(tpot) ? tpot / (1.0 - rho_p) : INFINITY;
    *ttft_s = wait90(rho_p, s) + s + (isfinite(tpot) ? tpot : 0) + p->request_s;
}

/* What one search asks of a count n: which role n sizes, with the other role's count fixed. */
typedef struct plan_query {
    const plan_profile_t *p;
    const plan_targets_t *t;
    double lambda, isl, osl;
    int role;        /* 0: n prefill nodes, decode fixed (TTFT); 1: n decode nodes, prefill fixed (TPOT);
                      * 2: n colocated nodes (both targets) */
    int other;       /* the fixed count */
} plan_query_t;

static int query_ok(const plan_query_t *q, int n)
{
    double ttft, tpot, h = headroom(q->t);
    int np = q->role == 0 ? n : q->role == 1 ? q->other : 0, nd = q->role == 0 ? q->other : n;
    plan_predict(q->p, q->t, q->lambda, q->isl, q->osl, np, nd, &ttft, &tpot);
    int ttft_ok = ttft <= h * ttft_target(q->t), tpot_ok = tpot <= h * tpot_target(q->t);
    return q->role == 0 ? ttft_ok : q->role == 1 ? tpot_ok : ttft_ok && tpot_ok;
}

/* The least n in [1, PLAN_MAX_REPLICAS] with query_ok (monotone in n), by doubling then bisection; 0 if none. */
static int least_n(const plan_query_t *q)
{
    int lo = 1, hi = 1;
    while (!query_ok(q, hi)) {
        if (hi >= PLAN_MAX_REPLICAS) return 0;
        lo = hi + 1;
        hi = hi * 2 > PLAN_MAX_REPLICAS ? PLAN_MAX_REPLICAS : hi * 2;
    }
    while (lo < hi) {
        int m = lo + (hi - lo) / 2;
        if (query_ok(q, m)) hi = m;
        else lo = m + 1;
    }
    return hi;
}

static int clamp_count(double n)
{
    return !(n >= 1) ? 1 : n > PLAN_MAX_REPLICAS ? PLAN_MAX_REPLICAS : (int)ceil(n);
}

/* Count at PLAN_FALLBACK_UTIL of the given work (node-seconds per second). */
static int fallback_count(double work) { return clamp_count(work / PLAN_FALLBACK_UTIL); }

/* Nodes that hold the p99.9 of a Poisson(l) concurrency: beyond it nobody waits for a node (prefill: the router
 * weighs every candidate's queue). */
static int concurrency_cap(double l) { return clamp_count(l + 3.0 * sqrt(l > 0 ? l : 0) + 1.0); }

/* The same for nodes chosen by two random picks (decode nodes, rtr_decode_score): a request shares a busy node
 * when both picks are busy, (l / N)^2, at most 1% from N = 10 l. */
static int concurrency_cap_2choice(double l)
{
    int a = concurrency_cap(l), b = clamp_count(10.0 * l);
    return a > b ? a : b;
}

/* Node-seconds per second of the per-sequence decode work (the fixed step cost is shared by the batch). */
static double decode_work(const plan_profile_t *p, double lambda, double isl, double osl)
{
    return lambda * osl * (p->decode_seq_s + (isl + osl / 2.0) * p->decode_ctx_s);
}

/* The throughput count of decode: its per-sequence work at PLAN_FALLBACK_UTIL, and room for the sequences in
 * flight (ld) within max_running and the KV capacity. */
static int decode_fallback(const plan_profile_t *p, double wd, double ld, double isl, double osl)
{
    int n = fallback_count(wd);
    int64_t max_run = p->max_running > 0 ? p->max_running : PLAN_DEFAULT_MAX_RUNNING;
    int room = clamp_count(ld / (double)max_run);
    if (p->kv_tokens > 0 && clamp_count(ld * (isl + osl) / (double)p->kv_tokens) > room)
        room = clamp_count(ld * (isl + osl) / (double)p->kv_tokens);
    return n > room ? n : room;
}

/* Sequences decoding at once when each runs alone: lambda OSL t1. */
static double decode_concurrency(const plan_profile_t *p, double lambda, double isl, double osl)
{
    return lambda * osl * plan_decode_step_s(p, 1, isl + osl / 2.0);
}

void plan_compute(const plan_profile_t *p, const plan_targets_t *t, const plan_obs_t *obs, plan_answer_t *out)
{
    memset(out, 0, sizeof *out);
    out->slo_reachable = 1;
    double seen = obs->req_s > 0 ? obs->req_s : 0;
    double isl = seen > 0 ? obs->prompt_tok_s / seen : 0, osl = seen > 0 ? obs->gen_tok_s / seen : 0;
    if (isl < 1) isl = 1;
    if (osl < 1) osl = 1;
    double excess = (obs->queued > 0 ? obs->queued : 0) - seen * ttft_target(t);
    out->drain_req_s = excess > 0 ? excess / PLAN_DRAIN_S : 0;
    double lambda = seen + out->drain_req_s;
    out->lambda = lambda;
    out->isl = isl;
    out->osl = osl;
    int np = t->colocated ? 0 : 1, nd = 1;
    if (lambda > 0) {
        double s = prefill_service_s(p, isl);
        double wp = lambda * s, wd = decode_work(p, lambda, isl, osl); /* work; wp is also prefill's concurrency */
        double ld = decode_concurrency(p, lambda, isl, osl);
        plan_query_t q = {.p = p, .t = t, .lambda = lambda, .isl = isl, .osl = osl};
        if (!t->colocated) {
            q.role = 0, q.other = 1;
            if (!(np = least_n(&q))) {
                np = fallback_count(wp);
                out->slo_reachable = 0;
            }
            if (np > concurrency_cap(wp)) np = concurrency_cap(wp);
            q.role = 1, q.other = np;
            if (!(nd = least_n(&q))) {
                nd = decode_fallback(p, wd, ld, isl, osl);
                out->slo_reachable = 0;
            }
            if (nd > concurrency_cap_2choice(ld)) nd = concurrency_cap_2choice(ld);
        } else {
            q.role = 2;
            if (!(nd = least_n(&q))) {
                int room = decode_fallback(p, 0, ld, isl, osl), busy = fallback_count(wp + wd);
                nd = busy > room ? busy : room;
                out->slo_reachable = 0;
            }
            if (nd > concurrency_cap_2choice(wp + ld)) nd = concurrency_cap_2choice(wp + ld);
        }
    }
    out->prefill = np;
    out->decode = nd;
    plan_predict(p, t, lambda, isl, osl, np, nd, &out->ttft_s, &out->tpot_s);
}

/* ---- smoothing ---- */

void plan_smooth_init(plan_smooth_t *s, int window)
{
    memset(s, 0, sizeof *s);
    s->window = window < 1 ? 1 : window > PLAN_MAX_WINDOW ? PLAN_MAX_WINDOW : window;
}

int plan_smooth_tick(plan_smooth_t *s, int raw)
{
    s->ring[s->next] = raw;
    s->next = (s->next + 1) % s->window;
    if (s->n < s->window) s->n++;
    /* up at once, past a dead band of PLAN_UP_TOLERANCE of the current count (none below 20 replicas): Poisson
     * noise in the window's rate moves a large answer by one now and then, and that is no reason to scale */
    int band = (int)(s->current * PLAN_UP_TOLERANCE);
    if (s->current == 0 || raw > s->current + band) {
        s->current = raw;
        return s->current;
    }
    if (raw >= s->current) return s->current;
    if (s->n < s->window) return s->current; /* not a whole window of evidence yet */
    int hi = 0;
    for (int i = 0; i < s->n; i++)
        if (s->ring[i] > hi) hi = s->ring[i];
    if (hi < s->current) s->current = hi;
    return s->current;
}
