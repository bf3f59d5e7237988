/* Internal to engine/cpu: the per-ISA kernels the op tables point at. Each ISA file exports its kernels so that a
 * higher ISA's table can reuse a lower one's where it has nothing better. */
#ifndef BATON_ENGINE_CPU_IMPL_H
#define BATON_ENGINE_CPU_IMPL_H

#include "engine/cpu/cpu_kernels.h"

/* Attention kernels that set attn_prefetches request kv->pf_k / pf_v a few lines per loop iteration, into the
 * last-level cache (prefetcht2): requested in one burst, part of them were dropped (measured in the engine: stalls
 * on V). A bt_cpu_pf splits the bytes at p (NULL: none) into n_it parts; bt_cpu_pf_part requests part it. The split
 * is planned once per kernel call: two 64-bit divisions in every part were a tenth of the AVX-512 kernel's samples
 * (perf, 16 sequences). Always inlined: a copy left out of line is a function GCC finds free of side effects, and it
 * drops every call to it. */
typedef struct bt_cpu_pf {
    const char *p;
    uint32_t lines, per; /* per: lines per part in 16.16 fixed point, rounded up */
} bt_cpu_pf;

static inline __attribute__((always_inline)) bt_cpu_pf bt_cpu_pf_plan(const void *p, size_t bytes, int n_it)
{
    bt_cpu_pf pf = {p, (uint32_t)(bytes / 64), 0};
    if (p && n_it > 0) pf.per = (uint32_t)((((uint64_t)pf.lines << 16) + (uint64_t)n_it - 1) / (uint64_t)n_it);
    return pf;
}

static inline __attribute__((always_inline)) void bt_cpu_pf_part(const bt_cpu_pf *pf, int it)
{
    if (!pf->p) return;
    uint32_t lo = (uint32_t)(((uint64_t)(uint32_t)it * pf->per) >> 16);
    uint32_t hi = (uint32_t)(((uint64_t)(uint32_t)(it + 1) * pf->per) >> 16);
    if (hi > pf->lines) hi = pf->lines;
    for (uint32_t t = lo; t < hi; t++) __builtin_prefetch(pf->p + 64 * (size_t)t, 0, 1);
}

/* every line of the bytes at p (NULL: none) at once */
static inline __attribute__((always_inline)) void bt_cpu_pf_all(const void *p, size_t bytes)
{
    if (!p) return;
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 1);
}

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
                                   float *acc);                                                                \
    void bt_cpu_##isa##_attn_block(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv,     \
                                   int nk, float *m, float *l, float *acc);                                     \
    void bt_cpu_##isa##_swiglu(int64_t n, const float *g, const float *u, float *out);                          \
    void bt_cpu_##isa##_geglu(int64_t n, const float *g, const float *u, float *out);                           \
    void bt_cpu_##isa##_rmsnorm(int64_t n, const float *x, const float *w, float eps, float *out)

#define BT_CPU_GEMM_DECL(isa, ty)                                                                              \
    void bt_cpu_##isa##_gemm_##ty(int64_t n, const void *group, const void *act, size_t act_stride, int nr,     \
                                  float *out, size_t out_stride, int n_valid, const void *next)

BT_CPU_GEMM_DECL(avx512, q4_0); BT_CPU_GEMM_DECL(avx512, q4_1); BT_CPU_GEMM_DECL(avx512, q8_0);
BT_CPU_GEMM_DECL(avx512, q4_0_q16); BT_CPU_GEMM_DECL(avx512, q4_1_q16); BT_CPU_GEMM_DECL(avx512, q8_0_q16);
BT_CPU_GEMM_DECL(avx2, q4_0); BT_CPU_GEMM_DECL(avx2, q4_1); BT_CPU_GEMM_DECL(avx2, q8_0); BT_CPU_GEMM_DECL(avx2, q5_1);
BT_CPU_GEMM_DECL(avx2, q4_0_q16); BT_CPU_GEMM_DECL(avx2, q4_1_q16); BT_CPU_GEMM_DECL(avx2, q8_0_q16);
BT_CPU_GEMM_DECL(avx2, q4_k_q16); BT_CPU_GEMM_DECL(avx512, q4_k_q16);
BT_CPU_GEMM_DECL(avx512, q5_1); BT_CPU_GEMM_DECL(avx512, q5_1_q16); BT_CPU_GEMM_DECL(avx2, q5_1_q16);
BT_CPU_GEMM_DECL(avx512, q5_0_q16); BT_CPU_GEMM_DECL(avx2, q5_0_q16); BT_CPU_GEMM_DECL(neon, q5_0_q16);
BT_CPU_GEMM_DECL(neon_i8mm, q5_0_q16);

BT_CPU_GEMM_DECL(neon, q4_0); BT_CPU_GEMM_DECL(neon, q4_1); BT_CPU_GEMM_DECL(neon, q8_0); BT_CPU_GEMM_DECL(neon, q5_1);
BT_CPU_GEMM_DECL(neon, q4_0_q16); BT_CPU_GEMM_DECL(neon, q4_1_q16); BT_CPU_GEMM_DECL(neon, q8_0_q16);
BT_CPU_GEMM_DECL(neon, q5_1_q16); BT_CPU_GEMM_DECL(neon, q4_k_q16); BT_CPU_GEMM_DECL(neon, q6_k_q16);
BT_CPU_GEMM_DECL(avx2, q6_k_q16); BT_CPU_GEMM_DECL(avx512, q6_k_q16);
BT_CPU_GEMM_DECL(neon, q5_k_q16); BT_CPU_GEMM_DECL(avx2, q5_k_q16); BT_CPU_GEMM_DECL(avx512, q5_k_q16);
BT_CPU_GEMM_DECL(neon_i8mm, q4_0); BT_CPU_GEMM_DECL(neon_i8mm, q4_1); BT_CPU_GEMM_DECL(neon_i8mm, q8_0);
BT_CPU_GEMM_DECL(neon_i8mm, q5_1); BT_CPU_GEMM_DECL(neon_i8mm, q4_0_q16); BT_CPU_GEMM_DECL(neon_i8mm, q4_1_q16);
BT_CPU_GEMM_DECL(neon_i8mm, q8_0_q16); BT_CPU_GEMM_DECL(neon_i8mm, q5_1_q16); BT_CPU_GEMM_DECL(neon_i8mm, q4_k_q16);
BT_CPU_GEMM_DECL(neon_i8mm, q6_k_q16); BT_CPU_GEMM_DECL(neon_i8mm, q5_k_q16);
/* K-quants with 8-bit activations */
BT_CPU_GEMM_DECL(avx512, q4_k); BT_CPU_GEMM_DECL(avx512, q5_k); BT_CPU_GEMM_DECL(avx512, q6_k);
BT_CPU_GEMM_DECL(avx2, q4_k); BT_CPU_GEMM_DECL(avx2, q5_k); BT_CPU_GEMM_DECL(avx2, q6_k);
BT_CPU_GEMM_DECL(neon, q4_k); BT_CPU_GEMM_DECL(neon, q5_k); BT_CPU_GEMM_DECL(neon, q6_k);
BT_CPU_GEMM_DECL(neon_i8mm, q4_k); BT_CPU_GEMM_DECL(neon_i8mm, q5_k); BT_CPU_GEMM_DECL(neon_i8mm, q6_k);
/* AVX2 + AVX-VNNI: the AVX2 kernels with vpdpbusd / vpdpwssd chains (cpu_avx2_vnni_gemm.c) */
BT_CPU_GEMM_DECL(avx2_vnni, q4_0); BT_CPU_GEMM_DECL(avx2_vnni, q4_1); BT_CPU_GEMM_DECL(avx2_vnni, q8_0);
BT_CPU_GEMM_DECL(avx2_vnni, q5_1); BT_CPU_GEMM_DECL(avx2_vnni, q4_k); BT_CPU_GEMM_DECL(avx2_vnni, q5_k);
BT_CPU_GEMM_DECL(avx2_vnni, q6_k); BT_CPU_GEMM_DECL(avx2_vnni, q4_0_q16); BT_CPU_GEMM_DECL(avx2_vnni, q4_1_q16);
BT_CPU_GEMM_DECL(avx2_vnni, q8_0_q16); BT_CPU_GEMM_DECL(avx2_vnni, q4_k_q16); BT_CPU_GEMM_DECL(avx2_vnni, q5_1_q16);
BT_CPU_GEMM_DECL(avx2_vnni, q5_0_q16); BT_CPU_GEMM_DECL(avx2_vnni, q6_k_q16); BT_CPU_GEMM_DECL(avx2_vnni, q5_k_q16);

/* attn_block_rows on AVX2 and NEON (AVX-512 has its own, in cpu_avx512.c) */
void bt_cpu_avx2_attn_block_rows(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                 int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint);
void bt_cpu_neon_attn_block_rows(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                 int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint);

BT_CPU_DECLARE_ISA(scalar);
BT_CPU_DECLARE_ISA(avx2);
BT_CPU_DECLARE_ISA(avx512);
BT_CPU_DECLARE_ISA(neon);

extern const bt_cpu_ops bt_cpu_ops_scalar;
extern const bt_cpu_ops bt_cpu_ops_avx2;
extern const bt_cpu_ops bt_cpu_ops_avx2_vnni;
extern const bt_cpu_ops bt_cpu_ops_avx512;
extern const bt_cpu_ops bt_cpu_ops_neon;
extern const bt_cpu_ops bt_cpu_ops_neon_i8mm;

/* The slots other than the GEMM that an ISA's kernels fill under one naming scheme (bt_cpu_<isa>_<op>): the AVX2
 * and NEON sets, each shared by its two tables (AVX2 and AVX2 + AVX-VNNI; NEON and NEON + i8mm). */
#define BT_CPU_SHARED_SLOTS(isa)                                                                                      \
    .quantize_q8_32 = bt_cpu_##isa##_quantize_q8_32,                                                                  \
    .quantize_q8_256 = bt_cpu_##isa##_quantize_q8_256,                                                                \
    .quantize_q16_32 = bt_cpu_##isa##_quantize_q16_32,                                                                \
    .quantize_q16_256 = bt_cpu_##isa##_quantize_q16_256,                                                              \
    .fp16_to_f32 = bt_cpu_##isa##_fp16_to_f32,                                                                        \
    .f32_to_fp16 = bt_cpu_##isa##_f32_to_fp16,                                                                        \
    .bf16_to_f32 = bt_cpu_##isa##_bf16_to_f32,                                                                        \
    .f32_to_bf16 = bt_cpu_##isa##_f32_to_bf16,                                                                        \
    .attn_scores = bt_cpu_##isa##_attn_scores,                                                                        \
    .attn_accum = bt_cpu_##isa##_attn_accum,                                                                          \
    .attn_block = bt_cpu_##isa##_attn_block,                                                                          \
    .swiglu = bt_cpu_##isa##_swiglu,                                                                                  \
    .geglu = bt_cpu_##isa##_geglu,                                                                                    \
    .rmsnorm = bt_cpu_##isa##_rmsnorm,                                                                                \
    .dot_rows = {                                                                                                     \
        [BT_TYPE_F32] = bt_cpu_##isa##_dot_rows_f32,                                                                  \
        [BT_TYPE_F16] = bt_cpu_##isa##_dot_rows_f16,                                                                  \
        [BT_TYPE_BF16] = bt_cpu_##isa##_dot_rows_bf16,                                                                \
        [BT_TYPE_Q4_0] = bt_cpu_##isa##_dot_rows_q4_0,                                                                \
        [BT_TYPE_Q4_1] = bt_cpu_##isa##_dot_rows_q4_1,                                                                \
        [BT_TYPE_Q5_0] = bt_cpu_##isa##_dot_rows_q5_0,                                                                \
        [BT_TYPE_Q5_1] = bt_cpu_##isa##_dot_rows_q5_1,                                                                \
        [BT_TYPE_Q8_0] = bt_cpu_##isa##_dot_rows_q8_0,                                                                \
        [BT_TYPE_Q4_K] = bt_cpu_##isa##_dot_rows_q4_k,                                                                \
        [BT_TYPE_Q5_K] = bt_cpu_##isa##_dot_rows_q5_k,                                                                \
        [BT_TYPE_Q6_K] = bt_cpu_##isa##_dot_rows_q6_k,                                                                \
    },                                                                                                                \
    .dot_rows16 = {                                                                                                   \
        [BT_TYPE_Q4_0] = bt_cpu_##isa##_dot_rows_q4_0_q16,                                                            \
        [BT_TYPE_Q4_1] = bt_cpu_##isa##_dot_rows_q4_1_q16,                                                            \
        [BT_TYPE_Q5_0] = bt_cpu_##isa##_dot_rows_q5_0_q16,                                                            \
        [BT_TYPE_Q5_1] = bt_cpu_##isa##_dot_rows_q5_1_q16,                                                            \
        [BT_TYPE_Q8_0] = bt_cpu_##isa##_dot_rows_q8_0_q16,                                                            \
        [BT_TYPE_Q4_K] = bt_cpu_##isa##_dot_rows_q4_k_q16,                                                            \
        [BT_TYPE_Q5_K] = bt_cpu_##isa##_dot_rows_q5_k_q16,                                                            \
        [BT_TYPE_Q6_K] = bt_cpu_##isa##_dot_rows_q6_k_q16,                                                            \
    }

/* The AVX2 kernels spread attention's prefetch hints over their loops; the NEON ones leave them to the caller. */
#define BT_CPU_AVX2_SHARED_SLOTS                                                                               \
    BT_CPU_SHARED_SLOTS(avx2), .attn_prefetches = 1, .attn_block_rows = bt_cpu_avx2_attn_block_rows
#define BT_CPU_NEON_SHARED_SLOTS BT_CPU_SHARED_SLOTS(neon), .attn_block_rows = bt_cpu_neon_attn_block_rows

/* The GEMM slots of the AVX2 layouts: bt_cpu_avx2_gemm_* or bt_cpu_avx2_vnni_gemm_* (the same source, two builds) */
#define BT_CPU_AVX2_GEMM_SLOTS(isa)                                                                                   \
    .gemm8 = {                                                                                                        \
        [BT_TYPE_Q4_0] = bt_cpu_##isa##_gemm_q4_0,                                                                    \
        [BT_TYPE_Q4_1] = bt_cpu_##isa##_gemm_q4_1,                                                                    \
        [BT_TYPE_Q8_0] = bt_cpu_##isa##_gemm_q8_0,                                                                    \
        [BT_TYPE_Q5_1] = bt_cpu_##isa##_gemm_q5_1,                                                                    \
        [BT_TYPE_Q4_K] = bt_cpu_##isa##_gemm_q4_k,                                                                    \
        [BT_TYPE_Q5_K] = bt_cpu_##isa##_gemm_q5_k,                                                                    \
        [BT_TYPE_Q6_K] = bt_cpu_##isa##_gemm_q6_k,                                                                    \
    },                                                                                                                \
    .gemm16 = {                                                                                                       \
        [BT_TYPE_Q4_0] = bt_cpu_##isa##_gemm_q4_0_q16,                                                                \
        [BT_TYPE_Q4_1] = bt_cpu_##isa##_gemm_q4_1_q16,                                                                \
        [BT_TYPE_Q8_0] = bt_cpu_##isa##_gemm_q8_0_q16,                                                                \
        [BT_TYPE_Q4_K] = bt_cpu_##isa##_gemm_q4_k_q16,                                                                \
        [BT_TYPE_Q6_K] = bt_cpu_##isa##_gemm_q6_k_q16,                                                                \
        [BT_TYPE_Q5_K] = bt_cpu_##isa##_gemm_q5_k_q16,                                                                \
        [BT_TYPE_Q5_1] = bt_cpu_##isa##_gemm_q5_1_q16,                                                                \
        [BT_TYPE_Q5_0] = bt_cpu_##isa##_gemm_q5_0_q16,                                                                \
    },                                                                                                                \
    .gemm_nr = 16, /* every layout and width, in passes of 4; 16-bit Q5_0 / Q5_1 through a scratch (gemm16_many) */ \
    .plane_nibbles = 1 /* the Q5_0 / Q5_1 planes in nibble-vector order (cpu_gemm.c) */


/* The first of a block's 16 scores (in key order) that is zero, or z when none is: where an attention kernel's
 * vector max of the scores is zero, the reference's running max (s[j] > mn, in key order) kept the first zero, and +0
 * and -0 are the one pair of equal values with different bits. */
static inline float bt_cpu_first_zero16(const float *s, float z)
{
    for (int j = 0; j < 16; j++)
        if (s[j] == 0.0f) return s[j];
    return z;
}

/* Constants of bt_cpu_expf, shared by every ISA's version. */
#define BT_EXP_LO (-86.5f) /* below: 0 (keeps 2^n normal) */
#define BT_EXP_HI 88.0f    /* above: +inf */
#define BT_EXP_LOG2E 1.44269504088896341f
#define BT_EXP_MAGIC 0x1.8p23f /* adding and subtracting it rounds to an integer, ties to even */
#define BT_EXP_LN2_HI 0.693359375f
#define BT_EXP_LN2_LO (-2.12194440e-4f)
#define BT_EXP_P5 1.9875691500e-4f
#define BT_EXP_P4 1.3981999507e-3f
#define BT_EXP_P3 8.3334519073e-3f
#define BT_EXP_P2 4.1665795894e-2f
#define BT_EXP_P1 1.6666665459e-1f
#define BT_EXP_P0 5.0000001201e-1f

/* Constants of the tanh GELU: gelu(x) = 0.5 x (1 + tanh(y)) = x / (1 + exp(-2 y)), y = sqrt(2/pi) (x + A x^3). */
#define BT_GELU_A 0.044715f
#define BT_GELU_K (-1.59576912160573071f) /* -2 sqrt(2/pi) */

#endif
