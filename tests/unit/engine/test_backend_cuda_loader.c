/* engine/backend_cuda.c on any machine: --device parsing, the one-line errors when the plugin or a GPU is missing,
 * and that this binary (which links the whole engine) maps no CUDA library until the plugin is asked for. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend_cuda.h"
#include "test_util.h"

/* 1 when a mapping of this process's names `lib` */
static int mapped(const char *lib)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[1024];
    int hit = 0;
    while (f && fgets(line, sizeof line, f))
        if (strstr(line, lib)) hit = 1;
    if (f) fclose(f);
    return hit;
}

static void test_device_parse(void)
{
    int d = 7;
    CHECK(bt_device_parse("cpu", &d) == BT_OK && d == -1);
    CHECK(bt_device_parse("cuda", &d) == BT_OK && d == 0);
    CHECK(bt_device_parse("cuda:3", &d) == BT_OK && d == 3);
    static const char *const bad[] = {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "CUDA", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_MSG(bt_device_parse(bad[i], &d) == BT_ERR_INVALID, "'%s' accepted", bad[i]);
        CHECK(strstr(bt_last_error(), "--device") != NULL);
    }
}

static void test_missing_plugin(void)
{
    CHECK(!mapped("libcudart") && !mapped("libcuda.so") && !mapped("libbaton_cuda"));
    setenv("BATON_CUDA_LIB", "/nonexistent/libbaton_cuda.so", 1);
    bt_backend *be = NULL;
    CHECK(bt_backend_cuda_create(0, &be) == BT_ERR_UNAVAILABLE && !be);
    CHECK(strstr(bt_last_error(), "BATON_CUDA_LIB") != NULL && !strchr(bt_last_error(), '\n'));
    unsetenv("BATON_CUDA_LIB");
}

/* the real plugin (built next to this binary when nvcc exists): on a machine without a GPU, one line saying so */
static void test_no_gpu(void)
{
    if (!bt_backend_cuda_built()) return;
    bt_backend *be = NULL;
    bt_status st = bt_backend_cuda_create(0, &be);
    if (st == BT_OK) { /* a GPU is here: the backend came up */
        CHECK(!strcmp(be->ops->name, "cuda") && be->ops->device_memory == 1);
        bt_backend_destroy(be);
        return;
    }
    CHECK_MSG(st == BT_ERR_UNAVAILABLE, "status %d: %s", st, bt_last_error());
    CHECK(!strncmp(bt_last_error(), "cuda: ", 6) && !strchr(bt_last_error(), '\n'));
    CHECK(bt_backend_cuda_create(99999, &be) == BT_ERR_UNAVAILABLE);
}

int main(void)
{
    RUN(test_device_parse);
    RUN(test_missing_plugin);
    RUN(test_no_gpu);
    return test_summary();
}
