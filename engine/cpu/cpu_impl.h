/* Internal to engine/cpu: the per-ISA kernels the op tables point at. Each ISA file exports its kernels so that a
 * higher ISA's table can reuse a lower one's where it has nothing better. */
#ifndef BATON_ENGINE_CPU_IMPL_H
#define BATON_ENGINE_CPU_IMPL_H

#include "engine/cpu/cpu_kernels.h"

#define BT_CPU_DOT_ROWS_DECL(isa, ty)                                                                          \
    void bt_cpu_##isa##_dot_rows_##ty(int64_t n, const void *w_row, const void *act, size_t act_stride, int nr, \
                                      float *out, size_t out_stride)

#define BT_CPU_DECLARE_ISA(isa)                                                                                \
    BT_CPU_DOT_ROWS_DECL(isa, f32); BT_CPU_DOT_ROWS_DECL(isa, f16); BT_CPU_DOT_ROWS_DECL(isa, bf16);             \
    BT_CPU_DOT_ROWS_DECL(isa, q4_0); BT_CPU_DOT_ROWS_DECL(isa, q4_1); BT_CPU_DOT_ROWS_DECL(isa, q5_0);           \
    BT_CPU_DOT_ROWS_DECL(isa, q5_1); BT_CPU_DOT_ROWS_DECL(isa, q8_0); BT_CPU_DOT_ROWS_DECL(isa, q4_k);           \
    BT_CPU_DOT_ROWS_DECL(isa, q5_k); BT_CPU_DOT_ROWS_DECL(isa, q6_k);                                          \
    BT_CPU_DOT_ROWS_DECL(isa, q4_0_q16); BT_CPU_DOT_ROWS_DECL(isa, q4_1_q16);                                  \
    BT_CPU_DOT_ROWS_DECL(isa, q5_0_q16); BT_CPU_DOT_ROWS_DECL(isa, q5_1_q16);                                  \
    BT_CPU_DOT_ROWS_DECL(isa, q8_0_q16); BT_CPU_DOT_ROWS_DECL(isa, q4_k_q16);                                  \
    BT_CPU_DOT_ROWS_DECL(isa, q5_k_q16); BT_CPU_DOT_ROWS_DECL(isa, q6_k_q16);                                  \
    void bt_cpu_##isa##_quantize_q8_32(int64_t n, const float *x, bt_block_q8_32 *y);                          \
    void bt_cpu_##isa##_quantize_q8_256(int64_t n, const float *x, bt_block_q8_256 *y);                        \
    void bt_cpu_##isa##_quantize_q16_32(int64_t n, const float *x, bt_block_q16_32 *y);                        \
    void bt_cpu_##isa##_quantize_q16_256(int64_t n, const float *x, bt_block_q16_256 *y);                      \
    void bt_cpu_##isa##_fp16_to_f32(int64_t n, const uint16_t *x, float *y);                                   \
    void bt_cpu_##isa##_f32_to_fp16(int64_t n, const float *x, uint16_t *y);                                   \
    void bt_cpu_##isa##_bf16_to_f32(int64_t n, const uint16_t *x, float *y);                                   \
    void bt_cpu_##isa##_f32_to_bf16(int64_t n, const float *x, uint16_t *y);                                   \
    void bt_cpu_##isa##_attn_scores(int64_t n, const float *q, const float *k, size_t k_stride, int64_t nk,     \
                                    float scale, float *out);                                                  \
    void bt_cpu_##isa##_attn_accum(int64_t n, const float *w, const float *v, size_t v_stride, int64_t nv,      \
                                   float *acc)

#define BT_CPU_GEMM_DECL(isa, ty)                                                                              \
    void bt_cpu_##isa##_gemm_##ty(int64_t n, const void *group, const void *act, size_t act_stride, int nr,     \
                                  float *out, size_t out_stride, int n_valid)

BT_CPU_GEMM_DECL(avx512, q4_0); BT_CPU_GEMM_DECL(avx512, q4_1); BT_CPU_GEMM_DECL(avx512, q8_0);
BT_CPU_GEMM_DECL(avx512, q4_0_q16); BT_CPU_GEMM_DECL(avx512, q4_1_q16); BT_CPU_GEMM_DECL(avx512, q8_0_q16);

BT_CPU_DECLARE_ISA(scalar);
BT_CPU_DECLARE_ISA(avx2);
BT_CPU_DECLARE_ISA(avx512);

extern const bt_cpu_ops bt_cpu_ops_scalar;
extern const bt_cpu_ops bt_cpu_ops_avx2;
extern const bt_cpu_ops bt_cpu_ops_avx512;

#endif
