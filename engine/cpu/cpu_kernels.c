/* ISA selection, the scalar op table, and the matmul driver. */
#include "engine/cpu/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define BT_CPU_X86 1
#elif defined(__aarch64__)
#include <sys/auxv.h>
#define BT_CPU_ARM64 1
#endif
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_impl.h"

#define SCALAR_DOT_ROWS(ty, TYPE, BITS)                                                                        \
    BT_CPU_DOT_ROWS_DECL(scalar, ty)                                                                           \
    {                                                                                                          \
        for (int r = 0; r < nr; r++)                                                                           \
            out[(size_t)r * out_stride] =                                                                      \
                bt_cpu_vec_dot_ref(TYPE, BITS, n, w_row, (const char *)act + (size_t)r * act_stride);          \
    }

SCALAR_DOT_ROWS(f32, BT_TYPE_F32, 8)
SCALAR_DOT_ROWS(f16, BT_TYPE_F16, 8)
SCALAR_DOT_ROWS(bf16, BT_TYPE_BF16, 8)
SCALAR_DOT_ROWS(q4_0, BT_TYPE_Q4_0, 8)
SCALAR_DOT_ROWS(q4_1, BT_TYPE_Q4_1, 8)
SCALAR_DOT_ROWS(q5_0, BT_TYPE_Q5_0, 8)
SCALAR_DOT_ROWS(q5_1, BT_TYPE_Q5_1, 8)
SCALAR_DOT_ROWS(q8_0, BT_TYPE_Q8_0, 8)
SCALAR_DOT_ROWS(q4_k, BT_TYPE_Q4_K, 8)
SCALAR_DOT_ROWS(q5_k, BT_TYPE_Q5_K, 8)
SCALAR_DOT_ROWS(q6_k, BT_TYPE_Q6_K, 8)
SCALAR_DOT_ROWS(q4_0_q16, BT_TYPE_Q4_0, 16)
SCALAR_DOT_ROWS(q4_1_q16, BT_TYPE_Q4_1, 16)
SCALAR_DOT_ROWS(q5_0_q16, BT_TYPE_Q5_0, 16)
SCALAR_DOT_ROWS(q5_1_q16, BT_TYPE_Q5_1, 16)
SCALAR_DOT_ROWS(q8_0_q16, BT_TYPE_Q8_0, 16)
SCALAR_DOT_ROWS(q4_k_q16, BT_TYPE_Q4_K, 16)
SCALAR_DOT_ROWS(q5_k_q16, BT_TYPE_Q5_K, 16)
SCALAR_DOT_ROWS(q6_k_q16, BT_TYPE_Q6_K, 16)

void bt_cpu_scalar_quantize_q8_32(int64_t n, const float *x, bt_block_q8_32 *y)
{
    bt_cpu_quantize_q8_32_ref(n, x, y);
}

void bt_cpu_scalar_quantize_q8_256(int64_t n, const float *x, bt_block_q8_256 *y)
{
    bt_cpu_quantize_q8_256_ref(n, x, y);
}

void bt_cpu_scalar_quantize_q16_32(int64_t n, const float *x, bt_block_q16_32 *y)
{
    bt_cpu_quantize_q16_32_ref(n, x, y);
}

void bt_cpu_scalar_quantize_q16_256(int64_t n, const float *x, bt_block_q16_256 *y)
{
    bt_cpu_quantize_q16_256_ref(n, x, y);
}

void bt_cpu_scalar_fp16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = bt_fp16_to_f32(x[i]);
}

void bt_cpu_scalar_f32_to_fp16(int64_t n, const float *x, uint16_t *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = bt_f32_to_fp16(x[i]);
}

void bt_cpu_scalar_bf16_to_f32(int64_t n, const uint16_t *x, float *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = bt_bf16_to_f32(x[i]);
}

void bt_cpu_scalar_f32_to_bf16(int64_t n, const float *x, uint16_t *y)
{
    for (int64_t i = 0; i < n; i++) y[i] = bt_f32_to_bf16(x[i]);
}

void bt_cpu_scalar_attn_scores(int64_t n, const float *q, const float *k, size_t k_stride, int64_t nk, float scale,
                               float *out)
{
    for (int64_t j = 0; j < nk; j++) {
        const float *kr = k + (size_t)j * k_stride;
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < n; i += 8)
            for (int t = 0; t < 8; t++) l[t] += q[i + t] * kr[i + t];
        out[j] = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
    }
}

void bt_cpu_scalar_attn_accum(int64_t n, const float *w, const float *v, size_t v_stride, int64_t nv, float *acc)
{
    for (int64_t j = 0; j < nv; j++) {
        const float *vr = v + (size_t)j * v_stride;
        for (int64_t i = 0; i < n; i++) acc[i] += w[j] * vr[i];
    }
}

float bt_cpu_expf(float x)
{
    if (x != x) return x;
    if (x < BT_EXP_LO) return 0.0f;
    if (x > BT_EXP_HI) return INFINITY;
    float t = x * BT_EXP_LOG2E;
    float nf = (t + BT_EXP_MAGIC) - BT_EXP_MAGIC; /* in -125..127: 2^nf times p (0.7..1.42) stays normal */
    float r = fmaf(nf, -BT_EXP_LN2_HI, x);
    r = fmaf(nf, -BT_EXP_LN2_LO, r);
    float p = fmaf(BT_EXP_P5, r, BT_EXP_P4);
    p = fmaf(p, r, BT_EXP_P3);
    p = fmaf(p, r, BT_EXP_P2);
    p = fmaf(p, r, BT_EXP_P1);
    p = fmaf(p, r, BT_EXP_P0);
    p = fmaf(p, r * r, r);
    p = p + 1.0f;
    return bt_f32_from_bits(bt_f32_bits(p) + ((uint32_t)(int32_t)nf << 23));
}

static float tree16(const float *x)
{
    float b[8], c[4];
    for (int t = 0; t < 8; t++) b[t] = x[t] + x[t + 8];
    for (int t = 0; t < 4; t++) c[t] = b[t] + b[t + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* Element i of row j of a KV block (which = 0: K, 1: V), dequantized. */
static inline float kv_elem(const bt_cpu_kv_rows *kv, int which, int64_t n, int j, int64_t i)
{
    const void *base = which ? kv->v : kv->k;
    size_t e = (size_t)j * (size_t)n + (size_t)i;
    switch (kv->type) {
    case BT_CPU_KV_F16: return bt_fp16_to_f32(((const uint16_t *)base)[e]);
    case BT_CPU_KV_U8: {
        const uint16_t *sm = (which ? kv->v_sm : kv->k_sm) + 2 * j;
        return fmaf(bt_fp16_to_f32(sm[0]), (float)((const uint8_t *)base)[e], bt_fp16_to_f32(sm[1]));
    }
    default: return ((const float *)base)[e];
    }
}

void bt_cpu_scalar_attn_block(int64_t n, int nq, const float *q, float scale, const bt_cpu_kv_rows *kv, int nk,
                              float *m, float *l, float *acc)
{
    for (int h = 0; h < nq; h++) {
        const float *qh = q + (size_t)h * (size_t)n;
        float *ah = acc + (size_t)h * (size_t)n;
        float s[BT_CPU_ATTN_BLOCK], w[BT_CPU_ATTN_BLOCK];
        for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) {
            if (j >= nk) {
                s[j] = -INFINITY;
                continue;
            }
            float x[16] = {0};
            for (int64_t i = 0; i < n && i < 16; i++) x[i] = qh[i] * kv_elem(kv, 0, n, j, i);
            for (int64_t i = 16; i < n; i++) x[i % 16] = fmaf(qh[i], kv_elem(kv, 0, n, j, i), x[i % 16]);
            s[j] = tree16(x) * scale;
        }
        float mn = m[h];
        for (int j = 0; j < nk; j++) mn = s[j] > mn ? s[j] : mn;
        float c = bt_cpu_expf(m[h] - mn);
        for (int j = 0; j < BT_CPU_ATTN_BLOCK; j++) w[j] = bt_cpu_expf(s[j] - mn);
        l[h] = fmaf(l[h], c, tree16(w));
        for (int64_t i = 0; i < n; i++) {
            float a = ah[i] * c;
            for (int j = 0; j < nk; j++) a = fmaf(w[j], kv_elem(kv, 1, n, j, i), a);
            ah[i] = a;
        }
        m[h] = mn;
    }
}

void bt_cpu_attn_block_rows_ref(int64_t n, int nr, const float *qt, float scale, const float *k, const float *v,
                                int nk, float *m, float *l, float *acc, const bt_cpu_kv_rows *hint)
{
    (void)hint;
    if (n > 256 || nk < 1 || nk > BT_CPU_ATTN_BLOCK || nr < 1 || nr > BT_CPU_ATTN_ROWS) return;
    const bt_cpu_kv_rows rows = {.type = BT_CPU_KV_F32, .k = k, .v = v};
    float q[256];
    for (int r = 0; r < nr; r++) {
        for (int64_t i = 0; i < n; i++) q[i] = qt[BT_CPU_ATTN_ROWS * (size_t)i + (size_t)r];
        bt_cpu_scalar_attn_block(n, 1, q, scale, &rows, nk, m + r, l + r, acc + (size_t)r * (size_t)n);
    }
}

void bt_cpu_attn_rows_put(int64_t n, int r, const float *row, float *qt)
{
    for (int64_t i = 0; i < n; i++) qt[BT_CPU_ATTN_ROWS * (size_t)i + (size_t)r] = row[i];
}

void bt_cpu_scalar_swiglu(int64_t n, const float *g, const float *u, float *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + bt_cpu_expf(-g[i])) * u[i];
}

void bt_cpu_scalar_geglu(int64_t n, const float *g, const float *u, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        float x = g[i];
        float z = fmaf((x * x) * BT_GELU_A, x, x) * BT_GELU_K;
        out[i] = x / (1.0f + bt_cpu_expf(z)) * u[i];
    }
}

void bt_cpu_scalar_rmsnorm(int64_t n, const float *x, const float *w, float eps, float *out)
{
    double l[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[4];
    for (int64_t i = 0; i < n; i++) l[i % 8] += (double)x[i] * x[i];
    for (int t = 0; t < 4; t++) b[t] = l[t] + l[t + 4];
    double ss = (b[0] + b[2]) + (b[1] + b[3]);
    float scale = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

const bt_cpu_ops bt_cpu_ops_scalar = {
    .isa = BT_CPU_ISA_SCALAR,
    .name = "scalar",
    .quantize_q8_32 = bt_cpu_scalar_quantize_q8_32,
    .quantize_q8_256 = bt_cpu_scalar_quantize_q8_256,
    .quantize_q16_32 = bt_cpu_scalar_quantize_q16_32,
    .quantize_q16_256 = bt_cpu_scalar_quantize_q16_256,
    .fp16_to_f32 = bt_cpu_scalar_fp16_to_f32,
    .f32_to_fp16 = bt_cpu_scalar_f32_to_fp16,
    .bf16_to_f32 = bt_cpu_scalar_bf16_to_f32,
    .f32_to_bf16 = bt_cpu_scalar_f32_to_bf16,
    .attn_scores = bt_cpu_scalar_attn_scores,
    .attn_accum = bt_cpu_scalar_attn_accum,
    .attn_block = bt_cpu_scalar_attn_block,
    .swiglu = bt_cpu_scalar_swiglu,
    .geglu = bt_cpu_scalar_geglu,
    .rmsnorm = bt_cpu_scalar_rmsnorm,
    .dot_rows = {
        [BT_TYPE_F32] = bt_cpu_scalar_dot_rows_f32,
        [BT_TYPE_F16] = bt_cpu_scalar_dot_rows_f16,
        [BT_TYPE_BF16] = bt_cpu_scalar_dot_rows_bf16,
        [BT_TYPE_Q4_0] = bt_cpu_scalar_dot_rows_q4_0,
        [BT_TYPE_Q4_1] = bt_cpu_scalar_dot_rows_q4_1,
        [BT_TYPE_Q5_0] = bt_cpu_scalar_dot_rows_q5_0,
        [BT_TYPE_Q5_1] = bt_cpu_scalar_dot_rows_q5_1,
        [BT_TYPE_Q8_0] = bt_cpu_scalar_dot_rows_q8_0,
        [BT_TYPE_Q4_K] = bt_cpu_scalar_dot_rows_q4_k,
        [BT_TYPE_Q5_K] = bt_cpu_scalar_dot_rows_q5_k,
        [BT_TYPE_Q6_K] = bt_cpu_scalar_dot_rows_q6_k,
    },
    .dot_rows16 = {
        [BT_TYPE_Q4_0] = bt_cpu_scalar_dot_rows_q4_0_q16,
        [BT_TYPE_Q4_1] = bt_cpu_scalar_dot_rows_q4_1_q16,
        [BT_TYPE_Q5_0] = bt_cpu_scalar_dot_rows_q5_0_q16,
        [BT_TYPE_Q5_1] = bt_cpu_scalar_dot_rows_q5_1_q16,
        [BT_TYPE_Q8_0] = bt_cpu_scalar_dot_rows_q8_0_q16,
        [BT_TYPE_Q4_K] = bt_cpu_scalar_dot_rows_q4_k_q16,
        [BT_TYPE_Q5_K] = bt_cpu_scalar_dot_rows_q5_k_q16,
        [BT_TYPE_Q6_K] = bt_cpu_scalar_dot_rows_q6_k_q16,
    },
};

const char *bt_cpu_isa_name(bt_cpu_isa isa)
{
    switch (isa) {
    case BT_CPU_ISA_SCALAR: return "scalar";
    case BT_CPU_ISA_AVX2: return "avx2";
    case BT_CPU_ISA_AVX2_VNNI: return "avx2-vnni";
    case BT_CPU_ISA_AVX512: return "avx512";
    case BT_CPU_ISA_NEON: return "neon";
    case BT_CPU_ISA_NEON_I8MM: return "neon-i8mm";
    default: return "unknown";
    }
}

int bt_cpu_isa_built(bt_cpu_isa isa)
{
    switch (isa) {
    case BT_CPU_ISA_SCALAR: return 1;
#ifdef BT_CPU_X86
    case BT_CPU_ISA_AVX2:
    case BT_CPU_ISA_AVX2_VNNI:
    case BT_CPU_ISA_AVX512: return 1;
#endif
#ifdef BT_CPU_ARM64
    case BT_CPU_ISA_NEON:
    case BT_CPU_ISA_NEON_I8MM: return 1;
#endif
    default: return 0;
    }
}

#ifdef BT_CPU_X86
/* F16C from CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c"); the OS side of the
 * YMM state is covered by the avx2 check. */
static int has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29) & 1;
}

/* AVX-VNNI (the VEX vpdpbusd / vpdpwssd) from CPUID leaf 7 sub-leaf 1, EAX bit 4 (clang 14's
 * __builtin_cpu_supports does not know "avxvnni" either). */
static int has_avx_vnni(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4) & 1;
}
#endif

int bt_cpu_isa_supported(bt_cpu_isa isa)
{
    if (isa == BT_CPU_ISA_SCALAR) return 1;
#ifdef BT_CPU_X86
    __builtin_cpu_init();
    switch (isa) {
    case BT_CPU_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case BT_CPU_ISA_AVX2_VNNI:
        return bt_cpu_isa_supported(BT_CPU_ISA_AVX2) && has_avx_vnni();
    case BT_CPU_ISA_AVX512:
        return bt_cpu_isa_supported(BT_CPU_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
#elif defined(BT_CPU_ARM64)
    /* HWCAP_ASIMD (bit 1) and HWCAP_ASIMDDP (bit 20), and HWCAP2_I8MM (bit 13), of the aarch64 Linux ABI */
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    int neon = (hw >> 1 & 1) && (hw >> 20 & 1);
    if (isa == BT_CPU_ISA_NEON) return neon;
    return isa == BT_CPU_ISA_NEON_I8MM && neon && (hw2 >> 13 & 1);
#else
    return 0;
#endif
}

int bt_cpu_vendor_amd(void)
{
    static _Atomic int cached = -1; /* the matmul asks per task: CPUID is a VM exit under a hypervisor */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v >= 0) return v;
    v = 0;
#ifdef BT_CPU_X86
    unsigned a, b, c, d;
    /* the vendor string is EBX, EDX, ECX of leaf 0: "Auth" "enti" "cAMD" */
    if (__get_cpuid(0, &a, &b, &c, &d)) v = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
#endif
    atomic_store_explicit(&cached, v, memory_order_relaxed);
    return v;
}

bt_status bt_cpu_isa_env(int *want)
{
    const char *names[BT_CPU_ISA_COUNT];
    for (int i = 0; i < BT_CPU_ISA_COUNT; i++) names[i] = bt_cpu_isa_name((bt_cpu_isa)i);
    bt_status st = bt_env_choice("BATON_CPU_ISA", names, BT_CPU_ISA_COUNT, -1, want);
    if (st) return st;
    if (*want >= 0 && !bt_cpu_isa_supported((bt_cpu_isa)*want)) {
        st = bt_fail(BT_ERR_UNSUPPORTED, "BATON_CPU_ISA=%s: this CPU lacks the instructions", names[*want]);
        *want = -1;
    }
    return st;
}

bt_status bt_cpu_isa_select(int want, bt_cpu_isa *out)
{
    if (want >= 0) {
        if (want >= BT_CPU_ISA_COUNT || !bt_cpu_isa_supported((bt_cpu_isa)want))
            return bt_fail(BT_ERR_UNSUPPORTED, "the %s kernels cannot run on this CPU",
                           want < BT_CPU_ISA_COUNT ? bt_cpu_isa_name((bt_cpu_isa)want) : "requested");
        *out = (bt_cpu_isa)want;
        return BT_OK;
    }
    for (int i = BT_CPU_ISA_COUNT - 1; i > 0; i--) {
        if (bt_cpu_isa_supported((bt_cpu_isa)i)) {
            *out = (bt_cpu_isa)i;
            return BT_OK;
        }
    }
    *out = BT_CPU_ISA_SCALAR;
    return BT_OK;
}

const bt_cpu_ops *bt_cpu_ops_get(bt_cpu_isa isa)
{
    switch (isa) {
    case BT_CPU_ISA_SCALAR: return &bt_cpu_ops_scalar;
#ifdef BT_CPU_X86
    case BT_CPU_ISA_AVX2: return &bt_cpu_ops_avx2;
    case BT_CPU_ISA_AVX2_VNNI: return &bt_cpu_ops_avx2_vnni;
    case BT_CPU_ISA_AVX512: return &bt_cpu_ops_avx512;
#endif
#ifdef BT_CPU_ARM64
    case BT_CPU_ISA_NEON: return &bt_cpu_ops_neon;
    case BT_CPU_ISA_NEON_I8MM: return &bt_cpu_ops_neon_i8mm;
#endif
    default: return NULL;
    }
}

bt_cpu_dot_rows_fn bt_cpu_dot_rows_get(const bt_cpu_ops *ops, uint32_t t, int act_bits)
{
    switch (bt_cpu_act_format(t, act_bits)) {
    case BT_ACT_F32:
    case BT_ACT_Q8_32:
    case BT_ACT_Q8_256: return ops->dot_rows[t];
    case BT_ACT_Q16_32:
    case BT_ACT_Q16_256: return ops->dot_rows16[t];
    default: return NULL;
    }
}

float bt_cpu_vec_dot(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const void *w_row,
                     const void *act_row)
{
    bt_cpu_dot_rows_fn dot = bt_cpu_dot_rows_get(ops, t, act_bits);
    if (!dot) return 0.0f;
    float r;
    dot(n, w_row, act_row, 0, 1, &r, 0);
    return r;
}

void bt_cpu_prepare_act_row(const bt_cpu_ops *ops, uint32_t t, int act_bits, int64_t n, const float *x, void *dst)
{
    switch (bt_cpu_act_format(t, act_bits)) {
    case BT_ACT_F32: memcpy(dst, x, (size_t)n * sizeof(float)); break;
    case BT_ACT_Q8_32: ops->quantize_q8_32(n, x, dst); break;
    case BT_ACT_Q8_256: ops->quantize_q8_256(n, x, dst); break;
    case BT_ACT_Q16_32: ops->quantize_q16_32(n, x, dst); break;
    case BT_ACT_Q16_256: ops->quantize_q16_256(n, x, dst); break;
    default: break;
    }
}

bt_status bt_cpu_matmul_check(const bt_cpu_matmul *mm)
{
    if (!mm || !mm->ops) return bt_fail(BT_ERR_INVALID, "matmul: no op table");
    if (mm->act_bits != 0 && mm->act_bits != 8 && mm->act_bits != 16)
        return bt_fail(BT_ERR_INVALID, "matmul: act_bits %d (expected 0, 8 or 16)", mm->act_bits);
    bt_cpu_act_fmt fmt = bt_cpu_act_format(mm->wtype, mm->act_bits);
    if (fmt == BT_ACT_NONE || mm->wtype >= BT_TYPE_COUNT || !bt_cpu_dot_rows_get(mm->ops, mm->wtype, mm->act_bits))
        return bt_fail(BT_ERR_UNSUPPORTED, "matmul: weight type %s has no CPU kernel", bt_ggml_type_name(mm->wtype));
    int be = bt_cpu_block_elems(mm->wtype);
    if (mm->n_in <= 0 || mm->n_in % be || mm->n_out < 0 || mm->n_rows < 0)
        return bt_fail(BT_ERR_INVALID, "matmul: bad shape n_in=%lld n_out=%lld n_rows=%lld for %s (block %d)",
                       (long long)mm->n_in, (long long)mm->n_out, (long long)mm->n_rows,
                       bt_ggml_type_name(mm->wtype), be);
    if (mm->out_stride != 0 && mm->out_stride < mm->n_out)
        return bt_fail(BT_ERR_INVALID, "matmul: out_stride %lld < n_out %lld", (long long)mm->out_stride,
                       (long long)mm->n_out);
    if ((mm->n_out && !mm->w && !mm->wp) || (mm->n_rows && (!mm->x || !mm->out)) ||
        (fmt != BT_ACT_F32 && mm->n_rows && !mm->xq))
        return bt_fail(BT_ERR_INVALID, "matmul: missing buffer");
    if (mm->wp) {
        const bt_cpu_packed *p = mm->wp;
        int bits = mm->act_bits == 8 ? 8 : 16;
        int planes = bits == 16 && p->wtype < 32 && (mm->ops->gemm16_planes >> p->wtype & 1u);
        if (p->wtype != bt_cpu_pack_layout(mm->wtype, bits) || p->act_bits != bits || p->n_in != mm->n_in || p->n_out != mm->n_out ||
            !p->data || !bt_cpu_pack_supported(mm->ops, mm->wtype, bits) || p->planes != planes ||
            p->plane_nib != bt_cpu_pack_plane_nibbles(mm->ops, mm->wtype, bits))
            return bt_fail(BT_ERR_INVALID, "matmul: packed weights do not match the matmul or the ISA");
    }
    return BT_OK;
}

void bt_cpu_matmul_quantize(const bt_cpu_matmul *mm, int ith, int nth)
{
    if (bt_cpu_act_format(mm->wtype, mm->act_bits) == BT_ACT_F32) return;
    size_t ab = bt_cpu_act_row_bytes(mm->wtype, mm->act_bits, mm->n_in);
    for (int64_t r = ith; r < mm->n_rows; r += nth)
        bt_cpu_prepare_act_row(mm->ops, mm->wtype, mm->act_bits, mm->n_in, mm->x + r * mm->n_in,
                               (char *)mm->xq + (size_t)r * ab);
}

/* Activation rows per cache block: their quantized copies stay in L1/L2 while a thread's weight rows stream. */
#define ROW_CHUNK 32

/* Activation rows per pass over a thread's packed groups: a group's codes (<= 16 KB for n_in <= 1536) stay in L1
 * while up to 64 rows of activations (<= 216 KB at 16 bits) stream from L2, so a matrix larger than the caches
 * (the 28 MB output matrix) is read from memory once for up to 64 rows. */
#define PACKED_ROW_CHUNK 64

/* The first row tile of a group prefetches the next group (the kernels' `next`), at any row count. With many rows
 * the kernel is compute-bound and the hardware prefetcher alone left it waiting on memory a fifth of the time. At
 * batch 1 an earlier Zen 4 host measured the prefetches ~5% slower, but on an Intel Xeon with AVX-512 (2026-12) the
 * weights stream ~1.8x faster with them: baton bench decode batch 1, alternated runs, 197-215 -> 381-393 tok/s
 * (avx512) and 152-165 -> 281-309 (BATON_CPU_ISA=avx2). So they stay on everywhere. Those figures were for L1
 * prefetches; since 2026-12-04 they go to L2 (bt_gl_prefetch_block), measured on Zen 4 only. */

/* Below this many rows a matmul streams the weights: one contiguous slice per thread (see slices()). Up to 9 rows
 * (a batch-1 step verifying 8 drafts) the step is still close to the weight read once the prefetches go to L2
 * (bt_gl_prefetch_block); 4 tasks per thread, each starting cold, measured 10-28% slower at 4-9 rows on Zen 4 (two
 * threads, 4 rows 5.34 against 4.50 ms for the decode step's matmuls), and 10-12 rows were mixed. */
#define PACKED_STREAM_ROWS 10

/* Phase 2 on packed weights: groups [lo, hi) of 16 output rows. */
static void matmul_compute_packed(const bt_cpu_matmul *mm, int ith, int nth)
{
    const bt_cpu_packed *p = mm->wp;
    int64_t ng = (mm->n_out + BT_CPU_PACK_ROWS - 1) / BT_CPU_PACK_ROWS;
    int64_t lo = ng * ith / nth, hi = ng * (ith + 1) / nth;
    if (lo >= hi || mm->n_rows == 0) return;
    bt_cpu_gemm_fn gemm = p->act_bits == 8 ? mm->ops->gemm8[p->wtype] : mm->ops->gemm16[p->wtype];
    const int64_t nr_max = bt_cpu_gemm_tile(mm->ops);
    size_t os = (size_t)(mm->out_stride ? mm->out_stride : mm->n_out);
    size_t ab = bt_cpu_act_row_bytes(mm->wtype, mm->act_bits, mm->n_in);
    /* what the slice's last group prefetches: the same slice of the next run's weights, when streaming */
    const char *after = NULL;
    if (mm->then.data && mm->n_rows < PACKED_STREAM_ROWS)
        after = (const char *)mm->then.data + (size_t)(mm->then.n_groups * ith / nth) * mm->then.group_bytes;
    for (int64_t r0 = 0; r0 < mm->n_rows; r0 += PACKED_ROW_CHUNK) {
        int64_t r1 = r0 + PACKED_ROW_CHUNK < mm->n_rows ? r0 + PACKED_ROW_CHUNK : mm->n_rows;
        for (int64_t g = lo; g < hi; g++) {
            const char *grp = (const char *)p->data + (size_t)g * p->group_bytes;
            const char *nx = g + 1 < hi ? grp + p->group_bytes : r1 == mm->n_rows ? after : NULL;
            int64_t o = g * BT_CPU_PACK_ROWS;
            int nv = (int)(mm->n_out - o < BT_CPU_PACK_ROWS ? mm->n_out - o : BT_CPU_PACK_ROWS);
            /* tiles of near-equal size (9 rows: 5 + 4, not 8 + 1): a short tile decodes the codes for few rows */
            int64_t nt = (r1 - r0 + nr_max - 1) / nr_max;
            for (int64_t t = 0; t < nt; t++) {
                int64_t r = r0 + (r1 - r0) * t / nt;
                int nr = (int)(r0 + (r1 - r0) * (t + 1) / nt - r);
                gemm(mm->n_in, grp, (const char *)mm->xq + (size_t)r * ab, ab, nr, mm->out + (size_t)r * os + o, os,
                     nv, t == 0 ? nx : NULL);
            }
        }
    }
}

void bt_cpu_matmul_compute(const bt_cpu_matmul *mm, int ith, int nth)
{
    if (mm->wp) {
        matmul_compute_packed(mm, ith, nth);
        return;
    }
    int64_t lo = mm->n_out * ith / nth, hi = mm->n_out * (ith + 1) / nth;
    if (lo >= hi || mm->n_rows == 0) return;
    bt_cpu_dot_rows_fn dot = bt_cpu_dot_rows_get(mm->ops, mm->wtype, mm->act_bits);
    size_t wb = bt_cpu_row_bytes(mm->wtype, mm->n_in);
    size_t os = (size_t)(mm->out_stride ? mm->out_stride : mm->n_out);
    const char *act = bt_cpu_act_format(mm->wtype, mm->act_bits) == BT_ACT_F32 ? (const char *)mm->x
                                                                               : (const char *)mm->xq;
    size_t ab = bt_cpu_act_row_bytes(mm->wtype, mm->act_bits, mm->n_in);
    for (int64_t r0 = 0; r0 < mm->n_rows; r0 += ROW_CHUNK) {
        int64_t r1 = r0 + ROW_CHUNK < mm->n_rows ? r0 + ROW_CHUNK : mm->n_rows;
        for (int64_t o = lo; o < hi; o++) {
            const char *w = (const char *)mm->w + (size_t)o * wb;
            for (int64_t r = r0; r < r1; r += BT_CPU_MAX_NR) {
                int nr = (int)(r1 - r < BT_CPU_MAX_NR ? r1 - r : BT_CPU_MAX_NR);
                dot(mm->n_in, w, act + (size_t)r * ab, ab, nr, mm->out + (size_t)r * os + o, os);
            }
        }
    }
}

static void matmul_quantize_task(void *ctx, int ith, int nth)
{
    bt_cpu_matmul_quantize(ctx, ith, nth);
}

static void matmul_compute_task(void *ctx, int ith, int nth)
{
    bt_cpu_matmul_compute(ctx, ith, nth);
}

/* Below this many activation elements the caller quantizes them alone: a decode step's 16 rows of 1,536 take ~8 us on
 * one thread, and a pool run for them cost more than it saved (16 sequences: ~6% off the decode step, median of 4
 * interleaved runs against the previous 8,192). The bytes are the same either way. */
#define QUANTIZE_POOL_MIN 32768

static void quantize_acts(bt_pool *pool, int nth, const bt_cpu_matmul *mm)
{
    if (nth == 1 || mm->n_rows * mm->n_in < QUANTIZE_POOL_MIN)
        bt_cpu_matmul_quantize(mm, 0, 1);
    else
        bt_pool_run_tasks(pool, matmul_quantize_task, (void *)mm, (int)(mm->n_rows < 4 * nth ? mm->n_rows : 4 * nth));
}

/* Tasks of a matmul over nth > 1 threads, at least 16 output rows each. Batched (compute-bound): 4 per thread, so a
 * descheduled thread's share is picked up by the others. Fewer rows than PACKED_STREAM_ROWS stream the weights at
 * memory speed: one contiguous slice per thread, read start to end by the hardware prefetcher, instead of four
 * that each start with a wait on memory (batch-1 decode: +12%, 5 alternated runs of baton bench --concurrency 1,
 * median 276 -> 309 tok/s). The split never changes how an output element is computed. */
static int slices(const bt_cpu_matmul *mm, int nth)
{
    int64_t per = mm->n_rows < PACKED_STREAM_ROWS ? 1 : 4;
    int64_t k = mm->n_out / 16 < per * nth ? mm->n_out / 16 : per * nth;
    return k < 1 ? 1 : (int)k;
}

bt_status bt_cpu_matmul_run(bt_pool *pool, const bt_cpu_matmul *mm)
{
    bt_status st = bt_cpu_matmul_check(mm);
    if (st != BT_OK) return st;
    int nth = pool ? bt_pool_size(pool) : 1;
    quantize_acts(pool, nth, mm);
    if (nth == 1) {
        bt_cpu_matmul_compute(mm, 0, 1);
    } else {
        bt_pool_run_tasks(pool, matmul_compute_task, (void *)mm, slices(mm, nth));
    }
    return BT_OK;
}

#define MAX_MULTI 16

typedef struct multi_ctx {
    const bt_cpu_matmul *mms;
    int n_mm;
    int slices[MAX_MULTI]; /* tasks given to each matmul */
} multi_ctx;

static void multi_compute_task(void *arg, int ith, int nth)
{
    (void)nth; /* the task count is the sum of slices, fixed per matmul */
    const multi_ctx *c = arg;
    for (int m = 0; m < c->n_mm; m++) {
        if (ith < c->slices[m]) {
            bt_cpu_matmul_compute(&c->mms[m], ith, c->slices[m]);
            return;
        }
        ith -= c->slices[m];
    }
}

bt_status bt_cpu_matmul_run_multi(bt_pool *pool, const bt_cpu_matmul *mms, int n_mm)
{
    if (n_mm < 1 || n_mm > MAX_MULTI) return bt_fail(BT_ERR_INVALID, "matmul: %d matmuls in one run (1..16)", n_mm);
    for (int m = 0; m < n_mm; m++) {
        bt_status st = bt_cpu_matmul_check(&mms[m]);
        if (st != BT_OK) return st;
        if (mms[m].ops != mms[0].ops || mms[m].wtype != mms[0].wtype || mms[m].n_in != mms[0].n_in ||
            (mms[m].act_bits ? mms[m].act_bits : 16) != (mms[0].act_bits ? mms[0].act_bits : 16) ||
            mms[m].n_rows != mms[0].n_rows || mms[m].x != mms[0].x || mms[m].xq != mms[0].xq)
            return bt_fail(BT_ERR_INVALID, "matmul: matmul %d of a multi run does not share the activations", m);
    }
    const bt_cpu_matmul *mm = &mms[0];
    int nth = pool ? bt_pool_size(pool) : 1;
    quantize_acts(pool, nth, mm);
    multi_ctx c = {.mms = mms, .n_mm = n_mm};
    int total = 0;
    for (int m = 0; m < n_mm; m++) {
        c.slices[m] = nth == 1 ? 1 : slices(&mms[m], nth);
        total += c.slices[m];
    }
    if (nth == 1)
        for (int t = 0; t < total; t++) multi_compute_task(&c, t, total);
    else
        bt_pool_run_tasks(pool, multi_compute_task, &c, total);
    return BT_OK;
}
