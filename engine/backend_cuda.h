/* The cuda backend, loaded at run time (engine/cuda/): this module holds no CUDA symbol. bt_backend_cuda_create
 * dlopens libbaton_cuda.so (built by CMake where nvcc exists; it links cudart statically), so every binary runs
 * unchanged on a machine without a GPU or driver and only a run that asks for `--device cuda:N` needs one. */
#ifndef BATON_ENGINE_BACKEND_CUDA_H
#define BATON_ENGINE_BACKEND_CUDA_H

#include "engine/backend.h"

/* Parses a device flag: "cpu" -> *cuda_device = -1; "cuda" or "cuda:N" -> N (0 when absent). BT_ERR_INVALID with a
 * one-line message otherwise. Can't block. */
bt_status bt_device_parse(const char *s, int *cuda_device);

/* Creates the cuda backend on GPU `device`. The plugin is looked up in $BATON_CUDA_LIB, then next to the executable
 * (../lib/ and ./), then on the loader's path. Errors, each one line: BT_ERR_UNAVAILABLE (plugin not built or not
 * found, no GPU or driver, no such device), BT_ERR_INVALID (plugin from another build), BT_ERR_NOMEM. */
bt_status bt_backend_cuda_create(int device, bt_backend **out);

/* The tensor-core rate (TFLOP/s) of be's GPU for the matmul's instruction (WMMA f16, f32 accumulation), measured
 * now (a few milliseconds, blocking): the reference for prefill rates. be must be a cuda backend. */
bt_status bt_backend_cuda_mma_tflops(bt_backend *be, double *tflops);

/* 1 when this build compiled the cuda plugin (BATON_HAVE_CUDA); says nothing about a GPU being present. */
int bt_backend_cuda_built(void);

#endif
