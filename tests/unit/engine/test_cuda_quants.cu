/* engine/cuda/cuda_quants.cuh compiled for the host: every weight type's 32-element chunk dequantization, as the
 * cuda kernels run it, against the CPU scalar reference (engine/cpu/cpu_quants.c), bit for bit, on random blocks.
 * Runs everywhere the plugin builds, GPU or not: the one part of engine/cuda that CI here executes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_quants.cuh"

extern "C" {
#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_quants.h"
#include "engine/ggml_type.h"
#include "test_util.h"
}

static uint64_t rng = 42;

static void check_type(uint32_t t)
{
    const int64_t n = 1024;
    int be, bb;
    type_geom(t, &be, &bb);
    size_t bytes = row_bytes(t, n);
    CHECK_MSG(bytes == bt_cpu_row_bytes(t, n), "%s: row bytes %zu vs %zu", bt_ggml_type_name(t), bytes,
              bt_cpu_row_bytes(t, n));
    uint8_t *row = (uint8_t *)malloc(bytes);
    float ref[1024], got[1024];
    for (int rep = 0; rep < 50; rep++) {
        for (size_t i = 0; i < bytes; i++) row[i] = (uint8_t)test_rand_next(&rng);
        if (t == BT_TYPE_F32 || t == BT_TYPE_F16 || t == BT_TYPE_BF16) { /* no NaN or infinity patterns */
            for (int64_t i = 0; i < n; i++) {
                float v = (float)((int64_t)(test_rand_next(&rng) % 20001) - 10000) / 1000.0f;
                if (t == BT_TYPE_F32) memcpy(row + 4 * i, &v, 4);
                else {
                    uint16_t h = t == BT_TYPE_F16 ? bt_f32_to_fp16(v) : bt_f32_to_bf16(v);
                    memcpy(row + 2 * i, &h, 2);
                }
            }
        } else { /* finite f16 scales: clear the top exponent bit of every 2-byte scale field */
            size_t nb = bytes / (size_t)bb;
            for (size_t b = 0; b < nb; b++) {
                uint8_t *p = row + b * (size_t)bb;
                if (t == BT_TYPE_Q6_K) p[209] &= 0xbf;
                else {
                    p[1] &= 0xbf;
                    if (t == BT_TYPE_Q4_1 || t == BT_TYPE_Q5_1 || t == BT_TYPE_Q4_K) p[3] &= 0xbf;
                }
            }
        }
        REQUIRE(bt_cpu_dequantize_row_ref(t, n, row, ref) == 0);
        switch (t) {
        case BT_TYPE_F32: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_F32>(row, c, got + 32 * c); break;
        case BT_TYPE_F16: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_F16>(row, c, got + 32 * c); break;
        case BT_TYPE_BF16: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_BF16>(row, c, got + 32 * c); break;
        case BT_TYPE_Q4_0: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q4_0>(row, c, got + 32 * c); break;
        case BT_TYPE_Q4_1: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q4_1>(row, c, got + 32 * c); break;
        case BT_TYPE_Q5_0: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q5_0>(row, c, got + 32 * c); break;
        case BT_TYPE_Q5_1: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q5_1>(row, c, got + 32 * c); break;
        case BT_TYPE_Q8_0: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q8_0>(row, c, got + 32 * c); break;
        case BT_TYPE_Q4_K: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q4_K>(row, c, got + 32 * c); break;
        case BT_TYPE_Q6_K: for (int64_t c = 0; c < n / 32; c++) deq_chunk<T_Q6_K>(row, c, got + 32 * c); break;
        default: REQUIRE(0);
        }
        int bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
            if (memcmp(&ref[i], &got[i], 4) && !(isnan(ref[i]) && isnan(got[i]))) bad = (int)i;
        CHECK_MSG(bad < 0, "%s: element %d: %g vs reference %g", bt_ggml_type_name(t), bad, bad < 0 ? 0.0 : got[bad],
                  bad < 0 ? 0.0 : ref[bad]);
        if (bad >= 0) break;
    }
    free(row);
}

/* tile_span: the staged bytes of every K tile dequantize as the row itself does, for a tile-aligned K, a K that ends
 * inside a tile, and the split-K slice ends (ke) the matmul uses */
template <int T>
static void check_span(uint32_t t)
{
    static const int64_t ks[] = {256, 512, 1024, 2048 + 256, 96, 64};
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
        int64_t K = ks[ki];
        if (K % blk_elems<T>()) continue;
        size_t bytes = row_bytes(t, K);
        uint8_t *row = (uint8_t *)malloc(bytes), staged[TILE_SPAN_MAX];
        for (size_t i = 0; i < bytes; i++) row[i] = (uint8_t)test_rand_next(&rng);
        for (size_t b = 0; b < bytes / (size_t)blk_bytes<T>(); b++) { /* finite scales, as in check_type */
            uint8_t *p = row + b * (size_t)blk_bytes<T>();
            if (T == T_Q6_K) p[209] &= 0xbf;
            else p[1] &= 0xbf, p[3] &= 0xbf;
        }
        for (int64_t kb = 0; kb < K; kb += 1024) {
            int64_t ke = kb + 1024 < K ? kb + 1024 : K;
            for (int64_t k0 = kb; k0 < ke; k0 += 128) {
                size_t off;
                int len;
                int64_t c0;
                tile_span<T>(k0, ke, &off, &len, &c0);
                CHECK_MSG(len > 0 && len <= TILE_SPAN_MAX && off + (size_t)len <= bytes && len % 2 == 0 &&
                              off % 2 == 0 && (T == T_Q6_K || k0 + 128 > ke || (len % 4 == 0 && off % 4 == 0)),
                          "%s K %lld k0 %lld: span %zu+%d", bt_ggml_type_name(t), (long long)K, (long long)k0, off,
                          len);
                if (off + (size_t)len > bytes || len > TILE_SPAN_MAX) continue;
                memcpy(staged, row + off, (size_t)len);
                for (int64_t c = k0 / 32; c < (k0 + 128 < ke ? k0 + 128 : ke) / 32; c++) {
                    float a[32], b[32];
                    deq_chunk<T>(row, c, a);
                    deq_chunk<T>(staged, c - c0, b);
                    CHECK_MSG(!memcmp(a, b, sizeof a), "%s K %lld chunk %lld: staged copy differs",
                              bt_ggml_type_name(t), (long long)K, (long long)c);
                }
            }
        }
        free(row);
    }
}

/* stage_tile run by all 128 threads of a block (one after another) copies exactly each row's tile span to its
 * place in the staging buffer and writes nothing else: whole tiles of 64 rows (the constant-count paths), a
 * matrix's last rows, a last partial K step, and rows whose bytes are only 2-byte aligned. */
template <int T>
static void check_stage(uint32_t t)
{
    static const int64_t Ks[] = {1024, 1024 + 96, 32 * 37, 256 * 5};
    static const int row_counts[] = {64, 37};
    for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
        int64_t K = Ks[ki];
        size_t rb = row_bytes(t, K);
        if (!rb) continue;
        for (size_t ri = 0; ri < 2; ri++) {
            int rows = row_counts[ri];
            const int64_t n0 = 3; /* a few rows in: the block's first row is not the matrix's */
            size_t bytes = (size_t)(n0 + rows) * rb;
            uint8_t *w = (uint8_t *)malloc(bytes + 4);
            for (size_t i = 0; i < bytes + 4; i++) w[i] = (uint8_t)test_rand_next(&rng);
            static unsigned char raw[64 * TILE_SPAN_MAX] __attribute__((aligned(16)));
            for (int64_t k0 = 0; k0 < K; k0 += 128) {
                size_t off;
                int len;
                int64_t c0;
                tile_span<T>(k0, K, &off, &len, &c0);
                memset(raw, 0xA5, sizeof raw);
                for (int tid = 0; tid < 128; tid++) stage_tile<T, 64, 128>(raw, w, rb, n0, rows, off, len, tid);
                int bad = 0;
                for (int r = 0; r < 64 && !bad; r++)
                    for (int b = 0; b < TILE_SPAN_MAX && !bad; b++) {
                        unsigned char want = r < rows && b < len ? w[(size_t)(n0 + r) * rb + off + (size_t)b] : 0xA5;
                        bad = raw[r * TILE_SPAN_MAX + b] != want;
                        CHECK_MSG(!bad, "%s K %lld rows %d k0 %lld: staged byte %d of row %d wrong",
                                  bt_ggml_type_name(t), (long long)K, rows, (long long)k0, b, r);
                    }
            }
            free(w);
        }
    }
}

static void test_stage_tile(void)
{
    check_stage<T_Q4_0>(BT_TYPE_Q4_0);
    check_stage<T_Q4_1>(BT_TYPE_Q4_1);
    check_stage<T_Q5_0>(BT_TYPE_Q5_0);
    check_stage<T_Q5_1>(BT_TYPE_Q5_1);
    check_stage<T_Q8_0>(BT_TYPE_Q8_0);
    check_stage<T_Q4_K>(BT_TYPE_Q4_K);
    check_stage<T_Q6_K>(BT_TYPE_Q6_K);
}

static void test_tile_spans(void)
{
    check_span<T_Q4_0>(BT_TYPE_Q4_0);
    check_span<T_Q4_1>(BT_TYPE_Q4_1);
    check_span<T_Q5_0>(BT_TYPE_Q5_0);
    check_span<T_Q5_1>(BT_TYPE_Q5_1);
    check_span<T_Q8_0>(BT_TYPE_Q8_0);
    check_span<T_Q4_K>(BT_TYPE_Q4_K);
    check_span<T_Q6_K>(BT_TYPE_Q6_K);
}

static void test_every_type(void)
{
    static const uint32_t types[] = {BT_TYPE_F32, BT_TYPE_F16, BT_TYPE_BF16, BT_TYPE_Q4_0, BT_TYPE_Q4_1,
                                     BT_TYPE_Q5_0, BT_TYPE_Q5_1, BT_TYPE_Q8_0, BT_TYPE_Q4_K, BT_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) check_type(types[i]);
}

int main(void)
{
    RUN(test_every_type);
    RUN(test_tile_spans);
    RUN(test_stage_tile);
    return test_summary();
}
