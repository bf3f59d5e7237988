/* CPU kernel layer: run-time ISA selection, per-ISA op tables, and the quantized matmul the forward pass calls.
 *
 * Quantized weight types take activations quantized per block to 16 bits (default: integer dots within ~2e-5 of
 * sum |w * x| of the float result) or to 8 bits (faster, up to ~3e-3), chosen per matmul by act_bits.
 * Every op has a scalar reference (cpu_quants.h); the AVX2 (+FMA, F16C) and AVX-512 (F, BW, VL, VNNI) tables
 * fill the same slots with SIMD kernels. Integer parts of quantized dot products are exact in every path; only the
 * float accumulation order differs between ISAs (tests bound the difference by 1e-5 of sum |w * x|; measured
 * <= 2e-7; K-quants with 16-bit activations sum exactly in int64 and agree bit for bit). Within one ISA, an
 * output element is always computed by the same code with the same reduction order, whatever the batch size, its
 * position in the batch or the thread count (batch invariance, DESIGN 4.3); results of different ISAs differ, so
 * one process (and every node that must agree with it) uses one ISA. */
#ifndef BATON_ENGINE_CPU_KERNELS_H
#define BATON_ENGINE_CPU_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/cpu/cpu_pool.h"
#include "engine/cpu/cpu_quants.h"

typedef enum bt_cpu_isa {
    BT_CPU_ISA_SCALAR = 0,
    BT_CPU_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
    BT_CPU_ISA_AVX512 = 2, /* AVX2 set + AVX-512 F/BW/VL/VNNI */
    BT_CPU_ISA_COUNT = 3,
} bt_cpu_isa;

/* Most activation rows one dot_rows call handles (the weight block is decoded once for all of them). */
#define BT_CPU_MAX_NR 4

/* Dot products of one weight row (n elements of the table's type) with nr (1..BT_CPU_MAX_NR) activation rows
 * in the type's activation format: out[r * out_stride] = dot(w_row, act + r * act_stride bytes).
 * For each r the arithmetic is identical to nr == 1. Can't fail. */
typedef void (*bt_cpu_dot_rows_fn)(int64_t n, const void *w_row, const void *act, size_t act_stride, int nr,
                                   float *out, size_t out_stride);

typedef struct bt_cpu_ops {
    bt_cpu_isa isa;
    const char *name; /* "scalar", "avx2", "avx512" */
    /* activation quantizers: y[n / 32] and y[n / 256]; output bytes equal the scalar reference's */
    void (*quantize_q8_32)(int64_t n, const float *x, bt_block_q8_32 *y);
    void (*quantize_q8_256)(int64_t n, const float *x, bt_block_q8_256 *y);
    void (*quantize_q16_32)(int64_t n, const float *x, bt_block_q16_32 *y);
    void (*quantize_q16_256)(int64_t n, const float *x, bt_block_q16_256 *y);
    /* row conversions (bit-identical to the inline scalar functions of cpu_fp16.h) */
    void (*fp16_to_f32)(int64_t n, const uint16_t *x, float *y);
    void (*f32_to_fp16)(int64_t n, const float *x, uint16_t *y);
    void (*bf16_to_f32)(int64_t n, const uint16_t *x, float *y);
    void (*f32_to_bf16)(int64_t n, const float *x, uint16_t *y);
    /* per weight type; NULL for types without kernels. dot_rows: float types and 8-bit activations (Q8_32,
     * Q8_256); dot_rows16: quantized types with 16-bit activations (Q16_32, Q16_256). */
    bt_cpu_dot_rows_fn dot_rows[BT_TYPE_COUNT];
    bt_cpu_dot_rows_fn dot_rows16[BT_TYPE_COUNT];
} bt_cpu_ops;

/* Name of isa ("scalar", "avx2", "avx512"). */
const char *bt_cpu_isa_name(bt_cpu_isa isa);

/* True when this CPU (and OS) can run isa: __builtin_cpu_supports plus CPUID for F16C. */
int bt_cpu_isa_supported(bt_cpu_isa isa);

/* The ISA to use: BATON_CPU_ISA=scalar|avx2|avx512 when set, else the best this CPU supports. Meant to be called
 * once at start-up (it reads the environment and CPUID); keep the result in the engine struct.
 * Returns BT_ERR_INVALID for an unknown name and BT_ERR_UNSUPPORTED when the forced ISA cannot run here. */
bt_status bt_cpu_isa_select(bt_cpu_isa *out);

/* The op table of isa (static, never freed), or NULL when isa is out of range. Slots of an ISA without a special
 * kernel for a type hold the next lower ISA's kernel. */
const bt_cpu_ops *bt_cpu_ops_get(bt_cpu_isa isa);

/* The dot_rows kernel of ops for weight type t with act_bits-bit activations (0 means 16), NULL if none. */
bt_cpu_dot_rows_fn bt_cpu_dot_rows_get(const bt_cpu_ops *ops, uint32_t t, int act_bits);

/* Dot of one weight row with one activation row in the format bt_cpu_act_format(t, act_bits), through ops (see
 * bt_cpu_dot_rows_fn). Returns 0 for types without kernels. */
float bt_cpu_vec_dot(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const void *w_row,
                     const void *act_row);

/* Quantizes (or, for float weight types, copies) one activation row x[n] into the format weight type t needs at
 * precision act_bits (0 means 16); dst holds bt_cpu_act_row_bytes(t, act_bits, n) bytes. Can't fail for
 * supported t and act_bits and n a multiple of the block. */
void bt_cpu_prepare_act_row(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const float *x, void *dst);

/* out[n_rows][n_out] = x[n_rows][n_in] * W^T, W = w[n_out][n_in] in GGUF type wtype (rows contiguous). */
typedef struct bt_cpu_matmul {
    const bt_cpu_ops *ops;
    uint32_t wtype;
    int64_t n_in, n_out, n_rows;
    const void *w;      /* [n_out][bt_cpu_row_bytes(wtype, n_in)] */
    const float *x;     /* [n_rows][n_in] */
    void *xq;           /* scratch [n_rows][bt_cpu_act_row_bytes(wtype, act_bits, n_in)]; unused (may be NULL) for
                         * F32/F16/BF16 */
    float *out;         /* [n_rows][out_stride] */
    int64_t out_stride; /* floats between output rows; 0 means n_out */
    int act_bits;       /* activation precision for quantized weights: 16, 8, or 0 meaning 16 */
} bt_cpu_matmul;

/* Validates mm (type supported, n_in a multiple of the block, pointers present, act_bits 0, 8 or 16).
 * BT_ERR_UNSUPPORTED for a weight type without kernels, BT_ERR_INVALID for bad shapes or act_bits. */
bt_status bt_cpu_matmul_check(const bt_cpu_matmul *mm);

/* Phase 1: quantizes activation rows ith, ith + nth, ... into mm->xq. No-op for float weight types. */
void bt_cpu_matmul_quantize(const bt_cpu_matmul *mm, int ith, int nth);

/* Phase 2 (after phase 1 finished on every thread): computes output columns [n_out*ith/nth, n_out*(ith+1)/nth)
 * for every activation row. */
void bt_cpu_matmul_compute(const bt_cpu_matmul *mm, int ith, int nth);

/* Several matmuls reading the same activations (q/k/v or gate/up projections): mms[0..n_mm) must share ops,
 * wtype, act_bits (0 and 16 count as equal), n_in, n_rows, x and xq. Quantizes x once and computes every output in
 * a single pool run; each output is bit-identical to what bt_cpu_matmul_run gives for that matmul alone.
 * BT_ERR_INVALID if they differ. Blocks. */
bt_status bt_cpu_matmul_run_multi(bt_pool *pool, const bt_cpu_matmul *mms, int n_mm);

/* Checks mm, then runs both phases on pool (or on the calling thread when pool is NULL), each split into a few
 * tasks per thread. Blocks until done. */
bt_status bt_cpu_matmul_run(bt_pool *pool, const bt_cpu_matmul *mm);

#endif
