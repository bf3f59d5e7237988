/* Timing helpers the CLI's benchmarks share. */
#ifndef BATON_TOOLS_BENCH_UTIL_H
#define BATON_TOOLS_BENCH_UTIL_H

/* Seconds on the monotonic clock. */
double bench_now_s(void);

/* The median of v[n] (n >= 1); sorts v in place. */
double bench_median(double *v, int n);

#endif
