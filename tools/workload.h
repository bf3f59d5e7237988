/* Workload files (the JSON-lines files in tools/workloads) read by `baton bench --spec` and `baton bench-serve
 * --workload`: one JSON object per line with a string "chat" (a user message) or "prompt" (raw text) and an optional
 * "name"; blank lines are skipped. */
#ifndef BATON_TOOLS_WORKLOAD_H
#define BATON_TOOLS_WORKLOAD_H

#include <stdint.h>

typedef struct workload_item {
    char name[64];
    char *text; /* owned */
    int chat;   /* 1: "chat" (render it with a chat template), 0: "prompt" */
} workload_item;

/* Reads path into *out (n items, at most max). On error prints one line "<prog>: <path>[:<line>]: <why>" to stderr
 * and returns -1 with nothing allocated; an empty file is an error. */
int workload_load(const char *prog, const char *path, int max, workload_item **out, int *n);

/* NULL allowed. */
void workload_free(workload_item *w, int n);

/* Seeded arrivals and lengths, drawn the same way by `baton bench-serve` and `baton simulate` so that both run the
 * same requests: splitmix64, Poisson gaps, lengths normal(mean, sd) rounded and at least 1. */
typedef struct wl_draw {
    uint64_t s;
    double rate;          /* req/s; INFINITY = all at time 0 */
    double prompt_mean, prompt_sd, output_mean, output_sd;
    double t;             /* the last arrival, s */
} wl_draw_t;

uint64_t wl_rng_next(uint64_t *s);
double wl_rng_unit(uint64_t *s); /* [0, 1) */
/* The generator of run rate_index (bench-serve's --rate list position) for seed. */
void wl_draw_init(wl_draw_t *d, unsigned long long seed, int rate_index, double rate, double prompt_mean,
                  double prompt_sd, double output_mean, double output_sd);
/* The next request: arrival time, prompt and output tokens, and the seed of its prompt's words. */
void wl_draw_next(wl_draw_t *d, double *t, int *prompt_len, int *output_len, uint64_t *prompt_seed);

#endif
