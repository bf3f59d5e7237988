#include "engine/backend_cuda.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/cuda/cuda_plugin.h"

#define PLUGIN_NAME "libbaton_cuda.so"

bt_status bt_device_parse(const char *s, int *cuda_device)
{
    if (!strcmp(s, "cpu")) {
        *cuda_device = -1;
        return BT_OK;
    }
    if (!strcmp(s, "cuda")) {
        *cuda_device = 0;
        return BT_OK;
    }
    if (!strncmp(s, "cuda:", 5) && s[5]) {
        char *end;
        long n = strtol(s + 5, &end, 10);
        if (!*end && n >= 0 && n < 1024) {
            *cuda_device = (int)n;
            return BT_OK;
        }
    }
    return bt_fail(BT_ERR_INVALID, "--device: expected cpu, cuda or cuda:N, got '%s'", s);
}

int bt_backend_cuda_built(void)
{
#ifdef BATON_HAVE_CUDA
    return 1;
#else
    return 0;
#endif
}

/* dlopen of dir/rel, where dir is the executable's directory */
static void *open_near_exe(const char *rel)
{
    char exe[PATH_MAX], path[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return NULL;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash) return NULL;
    *slash = 0;
    snprintf(path, sizeof path, "%s/%s", exe, rel);
    return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

/* The plugin's handle (a second open returns the same one), or BT_ERR_UNAVAILABLE. */
static bt_status plugin_open(void **out)
{
    const char *env = getenv("BATON_CUDA_LIB");
    void *h = NULL;
    if (env && *env) {
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (!h) return bt_fail(BT_ERR_UNAVAILABLE, "cuda: cannot load BATON_CUDA_LIB=%s: %s", env, dlerror());
    }
    if (!h) h = open_near_exe("../lib/" PLUGIN_NAME);
    if (!h) h = open_near_exe(PLUGIN_NAME);
    if (!h) h = dlopen(PLUGIN_NAME, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return bt_fail(BT_ERR_UNAVAILABLE, "cuda: %s not found (%s)", PLUGIN_NAME,
                       bt_backend_cuda_built() ? "set BATON_CUDA_LIB" : "this build has no CUDA backend: no nvcc");
    *out = h;
    return BT_OK;
}

bt_status bt_backend_cuda_mma_tflops(bt_backend *be, double *tflops)
{
    void *h;
    bt_status st = plugin_open(&h);
    if (st) return st;
    bt_cuda_plugin_mma_fn fn;
    *(void **)&fn = dlsym(h, BT_CUDA_PLUGIN_MMA_SYMBOL);
    dlclose(h); /* the backend's own reference keeps it loaded */
    if (!fn || strcmp(be->ops->name, "cuda"))
        return bt_fail(BT_ERR_INVALID, "cuda: no mma rate for a %s backend", be->ops->name);
    return fn(be, tflops);
}

bt_status bt_backend_cuda_create(int device, bt_backend **out)
{
    void *h;
    bt_status st = plugin_open(&h);
    if (st) return st;
    bt_cuda_plugin_create_fn create;
    *(void **)&create = dlsym(h, BT_CUDA_PLUGIN_SYMBOL);
    if (!create) {
        dlclose(h);
        return bt_fail(BT_ERR_INVALID, "cuda: %s lacks %s", PLUGIN_NAME, BT_CUDA_PLUGIN_SYMBOL);
    }
    /* the plugin stays loaded for the life of the process: backends it made may outlive any one caller */
    bt_cuda_host host = {.abi = BT_CUDA_PLUGIN_ABI, .backend_ops_size = sizeof(bt_backend_ops), .fail = bt_fail};
    return create(&host, device, out); /* on failure the plugin stays mapped: cudart may have hooks registered */
}
