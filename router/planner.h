/* The SLA planner (DESIGN 15; issue 22): pure arithmetic from an observed load, a machine profile and TTFT/TPOT
 * targets to prefill and decode replica counts, plus the smoothing that keeps the answer from flapping. No threads,
 * no I/O, no clock: every input and every piece of state is passed explicitly, so the router's planner thread and
 * the simulator (tools/sim) run exactly this code.
 *
 * Profile (what `baton profile` fits, and nodes publish the step part of it):
 *   prefill step of n prompt tokens of k prompts
 *                                        t = prefill_fixed_s + n * prefill_token_s + k * prefill_seq_s
 *                                        (k: each prompt's last row makes logits over the vocabulary and samples)
 *   decode step of B sequences, context C (the sum of their contexts)
 *                                        t = decode_fixed_s + B * decode_seq_s + C * decode_ctx_s
 *   a mixed step (colocated)             decode step + n * prefill_token_s
 *   KV transfer of b bytes               t = xfer_latency_s + b / xfer_bytes_s
 *   the request path outside the engines (router, RPCs) adds request_s to every TTFT
 *
 * Queueing approximation (per role, the load split evenly over N nodes, arrivals Poisson at rate lambda):
 *   prefill: service S = ceil(ISL / chunk) * prefill_fixed_s + ISL * prefill_token_s + prefill_seq_s, utilisation rho = lambda S / N.
 *            The router sends each prompt to the prefill node that finishes it first, so the N nodes act as one
 *            M/M/c queue: P(W > t) = ErlangC(N, lambda S) exp(-(N / S - lambda) t), W90 where that is 0.1 (0 when
 *            ErlangC <= 0.1). Exponential service is pessimistic for near-constant prompt lengths: part of the
 *            headroom. TTFT90 = W90 + S + transfer(ISL * kv_bytes_per_token).
 *   decode:  by Little's law a node holds B = (lambda / N) * OSL * t sequences, with t its own step time, so
 *            t = decode_fixed_s / (1 - (lambda / N) * OSL * (decode_seq_s + ctx * decode_ctx_s)),  ctx = ISL + OSL/2.
 *            The batch's p90 is B + 1.28 sqrt(B) (Poisson occupancy); TPOT90 = the step time at that batch.
 *            B90 must also fit max_running and the KV capacity (B90 * (ISL + OSL) <= kv_tokens).
 *   colocated (no prefill nodes): the decode nodes also prefill; the prefill share of their time rho_p = lambda S / N
 *            stretches every decode step: TPOT90 = decode TPOT90 / (1 - rho_p); a prompt queues on the decode node
 *            it was sent to (chosen for KV room, not queue), so its wait is M/M/1's at rho_p: W90 = S ln(10 rho_p) /
 *            (1 - rho_p); TTFT90 = W90 + S + one decode step.
 * Each count is the least N (1 .. PLAN_MAX_REPLICAS) whose predictions are within headroom * target.
 *
 * Saturation and backlog. The load planned for is the observed rate plus the drain of the excess backlog:
 *   lambda = req_s + max(0, queued - req_s * TTFT target) / PLAN_DRAIN_S
 * (queued: choices admitted and still waiting for their first token; what a cluster that meets the TTFT target
 * holds anyway is not excess), so a saturated cluster, whose observed rate is what it manages to serve, is sized to
 * serve the demand and work off its queue within PLAN_DRAIN_S. A target no count meets (the service time alone,
 * or a step's fixed cost, exceeds it: more nodes cannot help) gives the throughput count instead, with
 * slo_reachable = 0: the least N that keeps each node's work at PLAN_FALLBACK_UTIL, where work is node-seconds per
 * second: lambda S for prefill, lambda OSL (decode_seq_s + ctx decode_ctx_s) for decode (a step's fixed cost is
 * shared by the whole batch and is not charged per token), and at least the decode nodes whose max_running and KV
 * capacity hold the sequences in flight. Every count is then capped by the concurrency bound:
 * with N at least the p99.9 of the requests a role holds at once when nobody queues (Poisson of mean L = lambda S
 * for prefill, lambda OSL t1 for decode with t1 the step time of a lone sequence, their sum when colocated:
 * L + 3 sqrt(L) + 1), no prompt waits for a prefill node, so a larger N cannot lower a prediction; decode and
 * colocated nodes are chosen by two random picks, which both find a busy node (L / N)^2 of the time, so their cap
 * is at least 10 L (1%). The answer is therefore finite at and past
 * saturation and proportional to the load (a saturated profile whose decode fit degenerates to a large fixed step
 * asked for 95 decode nodes on a two-node test cluster before).
 *
 * Smoothing (plan_smooth_t): the observed rates are already means over the router's window (30 s). An answer above
 * the current one is taken at once (under-provisioning breaks the SLO now) when it passes a dead band of 5% of the
 * current count (0 below 20 replicas: the headroom covers that much); a lower one only when every raw answer
 * over the last down_window ticks was at most that low, and then to the highest of them (Kubernetes HPA's
 * scale-down stabilisation). Inputs that wobble around a boundary therefore hold the higher count: no flapping.
 *
 * One answer per cluster: every router publishes its own window rates (plan_obs_t, additive) to etcd and plans on
 * the sum of all routers' fresh records (plan_obs_merge), so every router computes the same answer from the same
 * inputs and `max(baton_planner_desired_replicas{role=...})` over routers is the cluster's answer (the Helm chart's
 * query). */
#ifndef BATON_ROUTER_PLANNER_H
#define BATON_ROUTER_PLANNER_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define PLAN_MAX_REPLICAS 100000
#define PLAN_DEFAULT_HEADROOM 0.8      /* aim predictions at 80% of each target */
#define PLAN_DEFAULT_TTFT_S 2.0        /* targets when the operator gives none */
#define PLAN_DEFAULT_TPOT_S 0.2
#define PLAN_DEFAULT_DOWN_WINDOW 60    /* ticks (seconds in the router) before a lower answer is taken */
#define PLAN_MAX_WINDOW 600
#define PLAN_DEFAULT_CHUNK 512         /* prefill tokens per step (the scheduler's default batch budget) */
#define PLAN_DEFAULT_MAX_RUNNING 256
#define PLAN_P90_Z 1.2816
#define PLAN_UP_TOLERANCE 0.05         /* a raw answer must pass current * (1 + this) (integer part) to raise it */
#define PLAN_DRAIN_S 30.0              /* an excess backlog is planned to be worked off within this (the window) */
#define PLAN_FALLBACK_UTIL 0.5         /* node utilisation planned for when no count meets a target */

typedef struct plan_transport {
    char name[16];          /* "shm", "tcp", "rdma", ... */
    double latency_s;
    double bytes_s;
} plan_transport_t;

#define PLAN_MAX_TRANSPORTS 4
#define PLAN_MAX_IDLE 8 /* idle points in a profile */
#define PLAN_MAX_BATCH_POINTS 64 /* decode batch sizes in a profile's decode.batch_s */

/* A machine profile: the fitted step model of one node (see the opening comment). Zero = unknown. */
typedef struct plan_profile {
    double prefill_fixed_s, prefill_token_s, prefill_seq_s;
    double decode_fixed_s, decode_seq_s, decode_ctx_s;
    double kv_bytes_per_token;
    double request_s;         /* the serving path outside the engines, per request: HTTP, tokenization, placement,
                               * the RPCs and the first token's way back (0 = not measured); adds to TTFT */
    double path_token_s;      /* CPU the serving path (router, client) spends per streamed token where it shares
                               * the nodes' cores, as on a one-host cluster: each decode row's step is that much
                               * longer (0 = the router runs elsewhere); the simulator's only */
    double path_step_s;       /* what a decode step with rows costs more on a serving node than in the profile's
                               * loop, once per step whatever its rows (the engine's wake-up and hand-off per step);
                               * the simulator's only */
    double path_prefill_token_s; /* CPU the serving path spends per token streamed anywhere in the cluster that the
                               * prefill nodes' cores pay: a one-host cluster whose decode nodes are pinned to other
                               * cores runs its router and clients beside the prefill nodes, whose steps stretch by
                               * that share (0 = they do not); the simulator's only */
    int64_t chunk_tokens;     /* prefill tokens per step */
    int64_t max_running;      /* sequences per decode batch */
    int64_t kv_tokens;        /* KV capacity of one node in tokens (0 = unbounded) */
    plan_transport_t xfer[PLAN_MAX_TRANSPORTS];
    int n_xfer;
    char host[256];           /* free text: CPU model, cores, memory; or the source of a published profile */
    char model[128];
    /* How steps scatter and what idleness costs, measured by `baton profile`; the simulator's only (0 = none). */
    double prefill_spread, decode_spread; /* standard deviation of ln(step time / its shape's median) */
    double idle_step_s;       /* the step the idle points were measured on (its time back to back) */
    double idle_gap_s[PLAN_MAX_IDLE], idle_extra_s[PLAN_MAX_IDLE]; /* after gap_s idle, that step took extra_s more */
    int n_idle;
    /* The decode step less its context term (C * decode_ctx_s) as measured at each batch size, batch_b increasing
     * (decode.batch_s: [[B, s], ...]; 0 points = the line fixed_s + B * seq_s alone). A CPU's step is not linear in
     * B at small batches (a lone row costs its own kernel path; rows fill vector tiles in steps), so where the
     * profile measured the batch sizes the simulator prices steps on them (plan_decode_step_s, which the planner's
     * lone-sequence decode time uses too); the planner's queueing formulas keep the line. */
    int32_t batch_b[PLAN_MAX_BATCH_POINTS];
    double batch_s[PLAN_MAX_BATCH_POINTS];
    int n_batch;
} plan_profile_t;

/* 1 when the profile has the step model the planner needs (prefill_token_s and decode_fixed_s > 0). */
int plan_profile_usable(const plan_profile_t *p);
/* What a step of step_s seconds (back to back) costs more when its node sat idle for gap_s before it: the profile's
 * idle points interpolated linearly in the gap (0 before the first point's share of it, the last point's beyond it),
 * scaled by step_s / idle_step_s up to 1 (a shorter step pays its share, a longer one no more than the measured
 * step did). 0 when the profile has no idle points. */
double plan_idle_extra_s(const plan_profile_t *p, double gap_s, double step_s);
/* Step times of the profile's model (seconds). A decode step with batch points: the points interpolated linearly
 * in the batch, the first point's below it and the last point's plus seq_s per further row beyond it, then the
 * context term; without points, the line. */
double plan_prefill_step_s(const plan_profile_t *p, int64_t n_tokens, int64_t n_prompts);
double plan_decode_step_s(const plan_profile_t *p, int64_t batch, double ctx_tokens);
/* The transport named name (NULL or "" = the first one), or NULL when the profile has none. */
const plan_transport_t *plan_profile_transport(const plan_profile_t *p, const char *name);

/* Parses a profile's JSON text (the format `baton profile` writes; plan_profile_to_json). BT_ERR_FORMAT naming the
 * field when a required field is missing or not a positive number; *out is set only on success. */
bt_status plan_profile_from_json(const char *text, plan_profile_t *out);
/* A malloc'd JSON text of p (NULL on no memory). extra (may be NULL) is a cJSON object's JSON text merged in as
 * "samples" (the measurements behind the fit). */
char *plan_profile_to_json(const plan_profile_t *p, const char *samples_json);

/* Least-squares fit of y = c[0] + sum_k c[k+1] * x[i][k] over n points with k_dim (1 or 2) regressors, each point
 * weighted by w[i] (w NULL: all 1; 1 / y^2 minimises relative error). Returns 0, or -1 when the system is singular
 * (too few distinct points). Coefficients that come out negative are clamped to 0 and the rest refitted, since a
 * negative cost per token means noise, not a real speed-up. */
int plan_fit_linear(const double *x, int k_dim, const double *y, const double *w, int n, double *c);

/* What the routers observed over their window, additive across routers. */
typedef struct plan_obs {
    double req_s;          /* requests admitted per second */
    double prompt_tok_s;   /* prompt tokens per second (of those requests) */
    double gen_tok_s;      /* tokens generated per second */
    double queued;         /* choices admitted and waiting for their first token, now (the backlog) */
    int routers;           /* records merged into this one */
} plan_obs_t;

/* a += b. */
void plan_obs_merge(plan_obs_t *a, const plan_obs_t *b);

typedef struct plan_targets {
    double ttft_s, tpot_s;   /* p90 targets; <= 0 = PLAN_DEFAULT_* */
    double headroom;         /* (0, 1]; <= 0 = PLAN_DEFAULT_HEADROOM */
    int colocated;           /* plan decode nodes that also prefill (no prefill role) */
    const char *transport;   /* the profile's transport for KV pushes (NULL = its first, none = free) */
} plan_targets_t;

typedef struct plan_answer {
    int prefill, decode;              /* raw counts (prefill 0 when colocated) */
    double lambda, isl, osl;          /* the load planned for: req/s (observed plus the backlog's drain), mean
                                       * prompt and output tokens */
    double drain_req_s;               /* the backlog's share of lambda */
    double ttft_s, tpot_s;            /* predicted p90 at the chosen counts */
    int slo_reachable;                /* 0 when no count meets a target */
} plan_answer_t;

/* Predicted p90 TTFT and TPOT for lambda req/s of mean isl/osl tokens on np prefill and nd decode nodes (np = 0:
 * colocated). INFINITY where a role is saturated. Can't fail. */
void plan_predict(const plan_profile_t *p, const plan_targets_t *t, double lambda, double isl, double osl, int np,
                  int nd, double *ttft_s, double *tpot_s);

/* The least counts that meet the targets for the observed load and backlog (see the opening comment), each
 * within the concurrency cap. No load and no backlog gives 1 of each role planned. Can't fail. */
void plan_compute(const plan_profile_t *p, const plan_targets_t *t, const plan_obs_t *obs, plan_answer_t *out);

/* Smoothing state, one per role. Zero-initialise, then plan_smooth_init. */
typedef struct plan_smooth {
    int window;                 /* ticks a lower answer must hold */
    int ring[PLAN_MAX_WINDOW];  /* the last raw answers */
    int n, next;
    int current;                /* the smoothed answer (0 before the first tick) */
} plan_smooth_t;

void plan_smooth_init(plan_smooth_t *s, int window);
/* Feeds one raw answer; returns the smoothed one. Can't fail. */
int plan_smooth_tick(plan_smooth_t *s, int raw);

#endif
