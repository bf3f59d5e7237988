/* `baton bench --spec ...` (tools/cmd_bench_spec.c): speculative decoding on and off over a workload of prompts. */
#ifndef BATON_TOOLS_BENCH_SPEC_H
#define BATON_TOOLS_BENCH_SPEC_H

/* argv as `baton bench` got it. Returns the exit code: 0, 1 (failure, incl. outputs that differ), 2 (usage). */
int bench_spec_main(int argc, char **argv);

#endif
