/* The boundary between baton and libbaton_cuda.so (engine/backend_cuda.c loads it with dlopen): the only symbol the
 * shared object exports, and the services of the host program it may call. Nothing else crosses: the .so links
 * cudart statically and no baton library, so a binary that never asks for a GPU needs no CUDA symbol at all. */
#ifndef BATON_ENGINE_CUDA_PLUGIN_H
#define BATON_ENGINE_CUDA_PLUGIN_H

#include "engine/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BT_CUDA_PLUGIN_ABI 3 /* bumped whenever backend.h's table or this struct changes */

/* What the host program lends the plugin: bt_fail, so errors decided in the .so reach bt_last_error. */
typedef struct bt_cuda_host {
    int abi;
    size_t backend_ops_size; /* sizeof(bt_backend_ops) as the host was compiled */
    bt_status (*fail)(bt_status st, const char *fmt, ...);
} bt_cuda_host;

/* Creates the CUDA backend on device `device`. Errors (through host->fail): BT_ERR_UNAVAILABLE (no driver, no such
 * device), BT_ERR_INVALID (ABI mismatch), BT_ERR_NOMEM. */
typedef bt_status (*bt_cuda_plugin_create_fn)(const bt_cuda_host *host, int device, bt_backend **out);
#define BT_CUDA_PLUGIN_SYMBOL "bt_cuda_plugin_create"

/* The rate in TFLOP/s that back-to-back WMMA f16 multiply-accumulates (the matmul's instruction) reach on be's GPU:
 * the prefill figure's reference. Errors through host->fail. */
typedef bt_status (*bt_cuda_plugin_mma_fn)(bt_backend *be, double *tflops);
#define BT_CUDA_PLUGIN_MMA_SYMBOL "bt_cuda_plugin_mma_tflops"

#ifdef __cplusplus
}
#endif

#endif
