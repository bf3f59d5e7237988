/* Shared helpers for the engine/cpu tests: random weight rows with sane scales, random activations. */
#ifndef BATON_TEST_CPU_UTIL_H
#define BATON_TEST_CPU_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_quants.h"
#include "engine/ggml_type.h"
#include "test_util.h"

static const uint32_t cpu_test_types[] = {BT_TYPE_F32,  BT_TYPE_F16,  BT_TYPE_BF16, BT_TYPE_Q8_0,
                                          BT_TYPE_Q4_0, BT_TYPE_Q4_1, BT_TYPE_Q5_0, BT_TYPE_Q5_1,
                                          BT_TYPE_Q4_K, BT_TYPE_Q5_K, BT_TYPE_Q6_K};
#define N_CPU_TEST_TYPES (sizeof cpu_test_types / sizeof cpu_test_types[0])

static inline float test_randf(uint64_t *s) /* uniform in [-1, 1) */
{
    return (float)((double)(test_rand_next(s) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* a finite fp16 of magnitude in [lo, hi), random sign when sign != 0 */
static inline uint16_t test_rand_scale(uint64_t *s, float lo, float hi, int sign)
{
    float u = (test_randf(s) + 1.0f) * 0.5f;
    float v = lo + (hi - lo) * u;
    if (sign && (test_rand_next(s) & 1)) v = -v;
    return bt_f32_to_fp16(v);
}

static inline void put16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

/* Fills a row of n elements of type t with random bytes, then gives every fp16 scale a sane finite value
 * (float elements: finite values of moderate size). */
static inline void test_fill_row(uint32_t t, int64_t n, void *row, uint64_t *s)
{
    size_t bytes = bt_cpu_row_bytes(t, n);
    uint8_t *p = row;
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)test_rand_next(s);
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    int64_t nb = (int64_t)(bytes / ti->block_bytes);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = p + b * ti->block_bytes;
        switch (t) {
        case BT_TYPE_F32: {
            float v = test_randf(s);
            memcpy(blk, &v, 4);
            break;
        }
        case BT_TYPE_F16: put16(blk, bt_f32_to_fp16(test_randf(s))); break;
        case BT_TYPE_BF16: put16(blk, bt_f32_to_bf16(test_randf(s))); break;
        case BT_TYPE_Q4_1:
        case BT_TYPE_Q5_1:
            put16(blk, test_rand_scale(s, 1e-3f, 2e-2f, 0));
            put16(blk + 2, test_rand_scale(s, 1e-3f, 2e-1f, 1));
            break;
        case BT_TYPE_Q4_K:
        case BT_TYPE_Q5_K:
            put16(blk, test_rand_scale(s, 1e-4f, 2e-3f, 0));
            put16(blk + 2, test_rand_scale(s, 1e-4f, 2e-3f, 0));
            break;
        case BT_TYPE_Q6_K: put16(blk + 208, test_rand_scale(s, 1e-5f, 2e-4f, 1)); break;
        default: put16(blk, test_rand_scale(s, 1e-3f, 2e-2f, 1)); break; /* Q4_0, Q5_0, Q8_0: d first */
        }
    }
}

static inline void test_fill_act(int64_t n, float *x, uint64_t *s)
{
    for (int64_t i = 0; i < n; i++) x[i] = test_randf(s) * (1.0f + (float)(i % 7)); /* uneven magnitudes */
}

#endif
