/* The engine's environment switches for a CLI command (README: environment variables): read once, where the
 * command parses its options, and handed to the engine's constructors, which read nothing themselves. */
#ifndef BATON_TOOLS_ENGINE_ENV_H
#define BATON_TOOLS_ENGINE_ENV_H

#include "engine/backend_cpu.h"

typedef struct cli_engine_env {
    bt_cpu_opts cpu; /* BATON_CPU_ISA, BATON_ACT_BITS, BATON_CPU_REPACK, BATON_CPU_LANES; n_threads from --threads */
    int profile;     /* BATON_PROFILE: forward passes log time per op kind */
    int device;      /* --device: -1 the CPU (default), else the CUDA device number */
} cli_engine_env;

/* Fills *e from the environment, with n_threads. A bad value prints "baton CMD: <the reason, naming the variable>"
 * and returns 1 (the command's exit code); 0 otherwise. */
int cli_engine_env_read(const char *cmd, int n_threads, cli_engine_env *e);

/* Parses --device's value (cpu, cuda, cuda:N) into *device (-1: cpu). A bad value prints "baton CMD: <why>" and
 * returns 1; 0 otherwise. */
int cli_device_parse(const char *cmd, const char *v, int *device);

/* The backend e names: the CPU backend (e->device < 0) or the CUDA backend on GPU e->device (engine/backend_cuda.h:
 * a one-line error when no GPU, driver or plugin is there). */
bt_status cli_backend_create(const cli_engine_env *e, bt_backend **out);

#endif
