#include "tools/engine_env.h"

#include "engine/backend_cuda.h"
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
    e->device = -1;
    return 0;
}

int cli_device_parse(const char *cmd, const char *v, int *device)
{
    if (bt_device_parse(v, device) == BT_OK) return 0;
    fprintf(stderr, "baton %s: %s\n", cmd, bt_last_error());
    return 1;
}

bt_status cli_backend_create(const cli_engine_env *e, bt_backend **out)
{
    if (e->device >= 0) return bt_backend_cuda_create(e->device, out);
    return bt_backend_cpu_create(&e->cpu, out);
}
