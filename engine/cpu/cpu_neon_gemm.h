/* Internal to engine/cpu: what the NEON tiled GEMM kernels (cpu_neon_gemm.c: dot product and smlal;
 * cpu_neon_i8mm.c: smmla) share once a block's integer dots are known: reading the 16 rows' scales and adding
 * isum * d * d_a (then m * ds_a) to each output in bt_cpu_gemm_packed_ref's order. Included after <arm_neon.h>. */
#ifndef BATON_ENGINE_CPU_NEON_GEMM_H
#define BATON_ENGINE_CPU_NEON_GEMM_H

#include <string.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_gemm_layout.h"

#define AI static inline __attribute__((always_inline))

/* the 16 fp16 values at p as 4 float32x4 */
AI void load_h16(const uint16_t *p, float32x4_t v[4])
{
    for (int i = 0; i < 4; i++) v[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
}

/* The 16 integer scales at p as floats: signed bytes (Q6_K) or unsigned */
AI void kq_scales_f32(const uint8_t *p, const int type, float32x4_t v[4])
{
    const uint8x16_t u = vld1q_u8(p);
    int16x8_t h[2];
    if (type == BT_TYPE_Q6_K) {
        const int8x16_t sv = vreinterpretq_s8_u8(u);
        h[0] = vmovl_s8(vget_low_s8(sv)), h[1] = vmovl_s8(vget_high_s8(sv));
    } else {
        h[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(u)));
        h[1] = vreinterpretq_s16_u16(vmovl_u8(vget_high_u8(u)));
    }
    for (int i = 0; i < 2; i++) {
        v[2 * i] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h[i])));
        v[2 * i + 1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(h[i])));
    }
}

/* Block b's 16 weight scales d (and mins m) as floats. */
AI void block_scales(const uint8_t *group, int64_t b, const int type, const size_t cb, float32x4_t d[4],
                     float32x4_t m[4])
{
    if (bt_gl_kquant(type)) { /* Q4_K, Q5_K: d = A * s0, m = -(B * s1); Q6_K: the halves' d, A * s0 and A * s1 */
        const float *sup = bt_gl_kq_super(group, b, cb);
        const uint8_t *s = bt_gl_kq_bytes(group, b, cb);
        float32x4_t s0[4], s1[4];
        kq_scales_f32(s, type, s0);
        kq_scales_f32(s + 16, type, s1);
        for (int i = 0; i < 4; i++) {
            const float32x4_t a = vld1q_f32(sup + 4 * i);
            d[i] = vmulq_f32(a, s0[i]);
            m[i] = type == BT_TYPE_Q6_K ? vmulq_f32(a, s1[i]) : vnegq_f32(vmulq_f32(vld1q_f32(sup + 16 + 4 * i), s1[i]));
        }
        return;
    }
    const uint16_t *sc = bt_gl_scales(group, b, type, cb);
    load_h16(sc, d);
    if (bt_gl_fp16_min(type)) load_h16(sc + 16, m);
}

/* acc[i] (rows 4i .. 4i + 3) = fma(isum, d * ad, acc) then, with a min, fma(m, ads, acc) */
AI void block_accumulate(float32x4_t acc[4], const int32x4_t isum[4], const float32x4_t d[4], const float32x4_t m[4],
                         float ad, float ads, const int mins)
{
    for (int i = 0; i < 4; i++) {
        acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum[i]), vmulq_f32(d[i], vdupq_n_f32(ad)));
        if (mins) acc[i] = vfmaq_f32(acc[i], m[i], vdupq_n_f32(ads));
    }
}

/* Q6_K: acc[i] = fma(isum0, d0 * ad, acc) over elements 0..15, then fma(isum1, d1 * ad, acc) (d1 in m) */
AI void block_accumulate_q6k(float32x4_t acc[4], const int32x4_t isum0[4], const int32x4_t isum1[4],
                             const float32x4_t d[4], const float32x4_t m[4], float ad)
{
    for (int i = 0; i < 4; i++) {
        acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum0[i]), vmulq_f32(d[i], vdupq_n_f32(ad)));
        acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(isum1[i]), vmulq_f32(m[i], vdupq_n_f32(ad)));
    }
}

/* acc[r][0..3] = 0 for the nr activation rows */
AI void acc_zero(float32x4_t acc[][4], int nr)
{
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = vdupq_n_f32(0.0f);
}

AI void store_rows(float *out, const float32x4_t acc[4], int n_valid)
{
    if (n_valid == BT_CPU_PACK_ROWS) {
        for (int i = 0; i < 4; i++) vst1q_f32(out + 4 * i, acc[i]);
        return;
    }
    float tmp[BT_CPU_PACK_ROWS];
    for (int i = 0; i < 4; i++) vst1q_f32(tmp + 4 * i, acc[i]);
    memcpy(out, tmp, (size_t)n_valid * sizeof(float));
}

/* Every activation row's n_valid outputs: row r at out + r * out_stride */
AI void store_all(float *out, size_t out_stride, float32x4_t acc[][4], int nr, int n_valid)
{
    for (int r = 0; r < nr; r++) store_rows(out + (size_t)r * out_stride, acc[r], n_valid);
}

#endif
