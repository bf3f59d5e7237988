/* The CPU backend (engine/backend_cpu.c): a scalar reference for every op plus AVX2 and AVX-512 paths chosen at run
 * time, a thread pool suited to 2-core machines, and lanes for decode steps (engine/backend.h). */
#ifndef BATON_ENGINE_BACKEND_CPU_H
#define BATON_ENGINE_BACKEND_CPU_H

#include "engine/backend.h"

/* Creates the CPU backend with n_threads threads (0 = one per online CPU). The ISA comes from BATON_CPU_ISA or the
 * best this CPU has; activations of quantized matmuls are 16-bit unless BATON_ACT_BITS=8.
 * Errors: BT_ERR_INVALID / BT_ERR_UNSUPPORTED (bad BATON_CPU_ISA or BATON_ACT_BITS), BT_ERR_NOMEM. */
bt_status bt_backend_cpu_create(int n_threads, bt_backend **out);

/* Name of the CPU kernel ISA in use ("avx512", "avx2", "scalar"); be must be a cpu backend. */
const char *bt_backend_cpu_isa(const bt_backend *be);
int bt_backend_cpu_threads(const bt_backend *be);
/* Activation precision of quantized matmuls: 16 (default) or 8 (BATON_ACT_BITS=8). */
int bt_backend_cpu_act_bits(const bt_backend *be);

/* Which kernels the model's matrices run on, per weight type, e.g. "q4_1 x210 packed, q8_0 x1 packed" or
 * "q6_k x1 row kernels (no packed layout)": a user sees at once when a type takes the slower unpacked path.
 * Writes at most cap bytes (always NUL-terminated). */
void bt_backend_cpu_describe(const bt_backend *be, const bt_model *m, char *buf, size_t cap);

#endif
