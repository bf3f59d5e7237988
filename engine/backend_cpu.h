/* The CPU backend (engine/backend_cpu.c): a scalar reference for every op plus AVX2 and AVX-512 paths chosen at run
 * time, a thread pool suited to 2-core machines, and lanes for decode steps (engine/backend.h). */
#ifndef BATON_ENGINE_BACKEND_CPU_H
#define BATON_ENGINE_BACKEND_CPU_H

#include "engine/backend.h"

/* How the CPU backend runs. Zero in every field is the default. The environment switches (README) are read once at
 * the process's edge by bt_cpu_opts_from_env; the constructor reads nothing but this struct. */
typedef struct bt_cpu_opts {
    int n_threads; /* 0 = one per online CPU */
    int force_isa; /* 1: run the kernels of isa (BATON_CPU_ISA); 0: the best this CPU has */
    int isa;       /* a bt_cpu_isa (engine/cpu/cpu_kernels.h), read when force_isa is set */
    int act_bits;  /* activations of quantized matmuls: 16 (0 = 16) or 8 (BATON_ACT_BITS=8: faster; 8-bit
                    * activations flip near-tied greedy tokens on small models) */
    int no_repack; /* BATON_CPU_REPACK=0: every weight stays in its GGUF layout (no extra memory, slower batched
                    * matmuls) instead of being packed for the tiled GEMM on first use */
    int no_lanes;  /* BATON_CPU_LANES=0: decode steps never split over lanes (every op forks over the pool) */
} bt_cpu_opts;

/* The edge only: sets the switch fields of o (not n_threads) from BATON_CPU_ISA, BATON_ACT_BITS, BATON_CPU_REPACK
 * and BATON_CPU_LANES (unset or empty: the default). BT_ERR_INVALID for a value not listed, BT_ERR_UNSUPPORTED for
 * an ISA this CPU lacks, with one line naming the variable; o is then unchanged. Can't block. */
bt_status bt_cpu_opts_from_env(bt_cpu_opts *o);

/* Creates the CPU backend as o says (NULL = every default). Errors: BT_ERR_UNSUPPORTED (a forced ISA this CPU
 * lacks), BT_ERR_INVALID (act_bits not 8 or 16), BT_ERR_NOMEM. */
bt_status bt_backend_cpu_create(const bt_cpu_opts *o, bt_backend **out);

/* Name of the CPU kernel ISA in use ("avx512", "avx2", "scalar"). These four accessors also answer for another
 * backend (its name, 1 thread, 16-bit activations, "<name> kernels") so that reports need no branch. */
const char *bt_backend_cpu_isa(const bt_backend *be);
int bt_backend_cpu_threads(const bt_backend *be);
/* Activation precision of quantized matmuls: 16 (default) or 8 (BATON_ACT_BITS=8). */
int bt_backend_cpu_act_bits(const bt_backend *be);

/* Which kernels the model's matrices run on, per weight type, e.g. "q4_1 x210 packed, q8_0 x1 packed" or
 * "q6_k x1 row kernels (no packed layout)": a user sees at once when a type takes the slower unpacked path.
 * Writes at most cap bytes (always NUL-terminated). */
void bt_backend_cpu_describe(const bt_backend *be, const bt_model *m, char *buf, size_t cap);

#endif
