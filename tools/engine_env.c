#include "tools/engine_env.h"

#include "engine/forward.h"

#include <stdio.h>
#include <string.h>

int cli_engine_env_read(const char *cmd, int n_threads, cli_engine_env *e)
{
    memset(e, 0, sizeof *e);
    if (bt_cpu_opts_from_env(&e->cpu) != BT_OK || bt_forward_profile_from_env(&e->profile) != BT_OK) {
        fprintf(stderr, "baton %s: %s\n", cmd, bt_last_error());
        return 1;
    }
    e->cpu.n_threads = n_threads;
    return 0;
}
