/* Engine tests build the CPU backend as a process's edge does: the BATON_* switches (ctest's per-ISA entries set
 * BATON_CPU_ISA; a test may set others) are read from the environment into bt_cpu_opts, then the constructor,
 * which reads nothing itself, takes them. */
#ifndef BATON_TEST_ENGINE_ENV_H
#define BATON_TEST_ENGINE_ENV_H

#include "engine/backend_cpu.h"

/* The backend with n_threads threads (0 = all CPUs) and the environment's switches; their reader's error when one
 * holds a bad value (*out untouched). */
static inline bt_status test_backend_cpu(int n_threads, bt_backend **out)
{
    bt_cpu_opts o = {0};
    bt_status st = bt_cpu_opts_from_env(&o);
    if (st) return st;
    o.n_threads = n_threads;
    return bt_backend_cpu_create(&o, out);
}

#endif
