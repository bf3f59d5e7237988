/* The attention inner loops of the op tables (attn_scores, attn_accum): every ISA bit-identical to the scalar
 * reference, so attention results do not depend on the ISA or on how queries are grouped into work items. */
#include <stdlib.h>

#include "engine/cpu/cpu_kernels.h"
#include "test_cpu_util.h"

static void test_attn_ops_match_scalar(void)
{
    uint64_t s = 61;
    const bt_cpu_ops *ref = bt_cpu_ops_get(BT_CPU_ISA_SCALAR);
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        for (int rep = 0; rep < 40; rep++) {
            int64_t n = 8 * (1 + (int64_t)(test_rand_next(&s) % 32)), nk = 1 + (int64_t)(test_rand_next(&s) % 20);
            size_t stride = (size_t)n + 8 * (test_rand_next(&s) % 3);
            float *q = malloc(sizeof(float) * (size_t)n), *k = malloc(sizeof(float) * stride * (size_t)nk);
            float *a = malloc(sizeof(float) * (size_t)nk), *b = malloc(sizeof(float) * (size_t)nk);
            float *acc_a = malloc(sizeof(float) * (size_t)n), *acc_b = malloc(sizeof(float) * (size_t)n);
            REQUIRE(q && k && a && b && acc_a && acc_b);
            test_fill_act(n, q, &s);
            test_fill_act((int64_t)stride * nk, k, &s);
            test_fill_act(n, acc_a, &s);
            memcpy(acc_b, acc_a, sizeof(float) * (size_t)n);
            ref->attn_scores(n, q, k, stride, nk, 0.125f, a);
            ops->attn_scores(n, q, k, stride, nk, 0.125f, b);
            int bad = 0;
            for (int64_t j = 0; j < nk; j++) bad += bt_f32_bits(a[j]) != bt_f32_bits(b[j]);
            ref->attn_accum(n, a, k, stride, nk, acc_a);
            ops->attn_accum(n, a, k, stride, nk, acc_b);
            for (int64_t i = 0; i < n; i++) bad += bt_f32_bits(acc_a[i]) != bt_f32_bits(acc_b[i]);
            CHECK_MSG(bad == 0, "%s n=%lld nk=%lld: %d values differ from scalar", ops->name, (long long)n,
                      (long long)nk, bad);
            free(q), free(k), free(a), free(b), free(acc_a), free(acc_b);
        }
    }
}

int main(void)
{
    RUN(test_attn_ops_match_scalar);
    return test_summary();
}
