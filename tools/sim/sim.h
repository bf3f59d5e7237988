/* A discrete-event simulation of a baton cluster (issue 22): one logical router that runs the router's own policy
 * code (router/placement.c: rtr_decode_score, rtr_place_decide, rtr_admit_queue_s, rtr_admit_rates;
 * router/prefix_index.c when prompts share prefixes; router/planner.c every simulated second), prefill nodes with
 * chunked prefill, decode nodes with continuous batching, KV transfers over each prefill node's link, node
 * failures with migration of their requests.
 *
 * Time advances by events on one binary heap (O(log n) per event; ties broken by insertion order, so a run is a
 * pure function of its inputs and seed). There is no per-token event: a node's engine step is one event, and a
 * decode node finds the sequences that end at a step from a heap keyed by the step index they end at, and keeps its
 * batch's total context as a closed form of the step index. Cost per request: O(log n) heap work plus the
 * placement's candidates (at most RTR_SIM_MAX_PREFILL prefill nodes, as the router).
 *
 * Model (what it leaves out is in the opening comment of sim.c). All times in seconds. */
#ifndef BATON_TOOLS_SIM_SIM_H
#define BATON_TOOLS_SIM_SIM_H

#include "router/planner.h"

#include <stdint.h>
#include <stdio.h>

#define SIM_MAX_FAILS 16

/* One request as the workload gives it. */
typedef struct sim_arrival {
    double t;
    int32_t prompt_tokens, output_tokens;
    uint32_t prefix_group;   /* requests of the same group share their first prefix_tokens tokens (0 = none) */
    int32_t prefix_tokens;
} sim_arrival_t;

/* The workload: a callback that yields arrivals in time order (0 = one more in *a, 1 = no more). */
typedef int (*sim_next_fn)(void *ud, sim_arrival_t *a);

typedef struct sim_fail {
    double t;          /* when */
    int decode;        /* 1: decode nodes, 0: prefill nodes */
    int count;         /* how many (chosen by the seed) */
    double repair_s;   /* down this long (<= 0: for good) */
} sim_fail_t;

typedef struct sim_config {
    plan_profile_t profile;
    int n_prefill, n_decode;           /* n_prefill 0 = colocated */
    const char *transport;             /* the profile's transport for KV pushes (NULL = its first) */
    double link_bytes_s, link_latency_s; /* > 0: override the transport's figures */
    int prefill_mode;                  /* rtr_prefill_mode */
    double overhead_s;                 /* remote prefill overhead (the router's default: 5 ms) */
    double max_queue_s;                /* admission bound (0 = the router's default 30 s, < 0 = off) */
    double admit_ttft_slo_s;           /* > 0: refuse what the placement predicts over it (--ttft-slo-ms) */
    double slo_ttft_s, slo_tpot_s;     /* goodput and the planner's targets */
    double duration_s;                 /* stop arrivals after this (0 = when the workload ends) */
    double planner_interval_s;         /* planner tick (default 1 s) */
    int planner_window;                /* ticks (default PLAN_DEFAULT_DOWN_WINDOW) */
    sim_fail_t fails[SIM_MAX_FAILS];
    int n_fails;
    int max_migrations;                /* per request (default 3) */
    uint64_t seed;
    int use_prefix_index;              /* run prefix_index.c (prompts carry block hashes) */
} sim_config_t;

/* Latency histogram: log-spaced bins, 1% wide, from 10 us to 10^5 s. */
#define SIM_HIST_BINS 2400
typedef struct sim_hist {
    uint64_t bins[SIM_HIST_BINS];
    uint64_t n;
    double sum;
} sim_hist_t;

double sim_hist_quantile(const sim_hist_t *h, double q);

typedef struct sim_node_stats {
    double busy_s;      /* engine time spent in steps */
    uint64_t steps;
    uint64_t tokens;    /* prompt tokens computed + tokens generated */
    int failures;
} sim_node_stats_t;

typedef struct sim_plan_point {
    double t;
    int prefill, decode;
    double rate, ttft_s, tpot_s;
} sim_plan_point_t;

typedef struct sim_result {
    uint64_t arrived, finished, rejected, failed, migrations, remote_prefills, local_prefills;
    uint64_t good;                   /* finished within both SLOs */
    double sim_end_s;                /* simulated time of the last event */
    double arrivals_end_s;           /* the last arrival */
    sim_hist_t ttft, tpot, e2e;
    /* a remote prefill's parts (first attempts and migrations alike): queued on its prefill node until its prompt
     * is computed (what the prefill node's baton_prefill_seconds times), and from there until the decode node
     * emits the first token (KV transfer and the wait for the decode step in flight) */
    sim_hist_t prefill_node, after_prefill;
    sim_node_stats_t *nodes;         /* [n_prefill + n_decode]: prefill nodes first */
    int n_nodes;
    sim_plan_point_t *plan;          /* the planner's smoothed answer, one point per tick */
    int n_plan;
    uint64_t events;
    double wall_s;                   /* real time the run took */
} sim_result_t;

/* Runs the whole simulation. BT_ERR_INVALID (bad config), BT_ERR_NOMEM. *res is owned by the caller
 * (sim_result_free) and set only on success. Deterministic: same inputs and seed, same result (wall_s aside). */
bt_status sim_run(const sim_config_t *cfg, sim_next_fn next, void *ud, sim_result_t *res);
void sim_result_free(sim_result_t *res);

/* Prints the report (text) or one JSON object. */
void sim_report_text(FILE *f, const sim_config_t *cfg, const sim_result_t *r);
bt_status sim_report_json(FILE *f, const sim_config_t *cfg, const sim_result_t *r);

#endif
