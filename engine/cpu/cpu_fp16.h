/* IEEE half (fp16) and bfloat16 <-> f32 conversion.
 * The inline scalar functions are exact and deterministic: f32 -> fp16/bf16 rounds to nearest, ties to even,
 * keeps subnormals, overflows to infinity, and turns NaNs into quiet NaNs. Row versions with SIMD paths live in
 * the op table (cpu_kernels.h); they produce the same bits as these. Can't fail. */
#ifndef BATON_ENGINE_CPU_FP16_H
#define BATON_ENGINE_CPU_FP16_H

#include <stdint.h>
#include <string.h>

static inline uint32_t bt_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bt_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bt_fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 is exact in f32 */
        float v = (float)man * 0x1p-24f;
        return bt_f32_from_bits(sign | bt_f32_bits(v));
    }
    if (exp == 31) /* infinity, or NaN made quiet as the F16C instructions do */
        return bt_f32_from_bits(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
    return bt_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t bt_f32_to_fp16(float f)
{
    uint32_t x = bt_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* quiet NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to infinity */
    if (ax < 0x38800000u) {
        /* below the smallest normal: the result is round(|f| * 2^24) units of 2^-24; adding 2^23 makes the
         * FPU round to an integer, ties to even (|f| * 2^24 < 2^10 here). 1024 is the smallest normal. */
        float v = bt_f32_from_bits(ax) * 0x1p24f;
        uint32_t m = bt_f32_bits(v + 0x1p23f) - 0x4b000000u;
        return (uint16_t)(sign | m);
    }
    /* rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even */
    uint32_t r = ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

static inline float bt_bf16_to_f32(uint16_t b)
{
    return bt_f32_from_bits((uint32_t)b << 16);
}

static inline uint16_t bt_f32_to_bf16(float f)
{
    uint32_t x = bt_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif
