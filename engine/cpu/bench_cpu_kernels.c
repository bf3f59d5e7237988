/* bench_cpu_kernels: matmul speed per weight type, ISA, batch and thread count on SmolLM2-sized matrices, and a
 * plain memory read loop on 1 and 2 threads. Weights rotate through copies totalling >= 128 MB (beyond L3), as in
 * decode where every token streams all the weights; --hot reuses one copy.
 * usage: bench_cpu_kernels [--types q4_1,q8_0] [--isa scalar|avx2|avx512|all] [--threads 1,2] [--batch 1,16]
 *                          [--bits 8,16] [--hot] [--ms MILLISECONDS_PER_CASE] [--memory-only] [--decode-only] [--gemm]
 * --bits: activation precisions of quantized types (both by default; float types run once).
 * Also times the matmuls of one SmolLM2-135M decode step (batch 1) and prefill chunk (batch 16).
 * --gemm: only the packed kernels of --isa (default: the best here) against its measured dot rate
 *         (bench_gemm_kernels).
 * --attn: attn_block (one 16-key cache block, the decode attention kernel) per ISA and KV dtype, on SmolLM2's and
 *         Gemma 3's head shapes: hot (one block) and cold (blocks in random order over 256 MB, each call hinting
 *         the block two ahead as the engine does) (bench_attn); then a prompt chunk's rows through attn_block per
 *         query against attn_block_rows (bench_attn_rows). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <immintrin.h>

#include "engine/cpu/cpu_fp16.h"
#include "engine/cpu/cpu_hostmem.h"
#include "engine/cpu/cpu_kernels.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* random bytes, with every fp16 field that is a scale set to a small finite value */
static void fill_weights(uint32_t t, int64_t n_in, int64_t n_out, uint8_t *w, uint64_t *s)
{
    size_t bytes = bt_cpu_row_bytes(t, n_in) * (size_t)n_out;
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v = rng_next(s);
        memcpy(w + i, &v, 8);
    }
    const bt_ggml_type_info *ti = bt_ggml_type_get(t);
    size_t nb = bytes / ti->block_bytes;
    uint16_t sc = bt_f32_to_fp16(0.01f);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * ti->block_bytes;
        switch (t) {
        case BT_TYPE_F32: {
            float f = (float)(rng_next(s) % 1000) * 1e-3f;
            memcpy(blk, &f, 4);
            break;
        }
        case BT_TYPE_F16: sc = bt_f32_to_fp16((float)(rng_next(s) % 1000) * 1e-3f); memcpy(blk, &sc, 2); break;
        case BT_TYPE_BF16: sc = bt_f32_to_bf16((float)(rng_next(s) % 1000) * 1e-3f); memcpy(blk, &sc, 2); break;
        case BT_TYPE_Q6_K: memcpy(blk + 208, &sc, 2); break;
        case BT_TYPE_Q4_1:
        case BT_TYPE_Q5_1:
        case BT_TYPE_Q4_K:
        case BT_TYPE_Q5_K: memcpy(blk + 2, &sc, 2); /* fall through */
        default: memcpy(blk, &sc, 2); break;
        }
    }
}

typedef struct read_ctx {
    const uint64_t *buf;
    size_t n;
    uint64_t sink[64];
} read_ctx;

static void read_task(void *arg, int ith, int nth)
{
    read_ctx *c = arg;
    size_t lo = c->n * (size_t)ith / (size_t)nth, hi = c->n * (size_t)(ith + 1) / (size_t)nth;
    uint64_t a = 0, b = 0, d = 0, e = 0;
    for (size_t i = lo; i + 4 <= hi; i += 4) {
        a += c->buf[i], b += c->buf[i + 1], d += c->buf[i + 2], e += c->buf[i + 3];
    }
    c->sink[ith * 8] = a + b + d + e;
}

/* Read bandwidth over 1 GiB on 4 KiB pages and on huge pages (where the kernel backs the hint), 1 and 2 threads. */
static void bench_memory(void)
{
    size_t bytes = (size_t)1 << 30;
    for (int huge = 0; huge < 2; huge++) {
        uint64_t *buf = huge ? bt_hostmem_huge_alloc(bytes) : malloc(bytes);
        if (!buf) {
            printf("memory read: cannot allocate 1 GiB\n");
            return;
        }
        memset(buf, 1, bytes);
        for (int nth = 1; nth <= 2; nth++) {
            bt_pool *pool = NULL;
            if (bt_pool_create(nth, &pool) != BT_OK) break;
            read_ctx c = {.buf = buf, .n = bytes / 8};
            double best = 1e9;
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now_s();
                bt_pool_run(pool, read_task, &c);
                double dt = now_s() - t0;
                best = dt < best ? dt : best;
            }
            printf("memory read 1 GiB (%s pages), %d thread%s: %.1f GB/s (best of 5)\n", huge ? "huge" : "4 KiB", nth,
                   nth > 1 ? "s" : "", bytes / best * 1e-9);
            bt_pool_destroy(pool);
        }
        free(buf);
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The matmuls of one SmolLM2-135M token: 30 layers of q, k, v, o, gate, up, down in Q4_1 and the tied 49152-row
 * output matrix in Q8_0, as laid out in the default model (about 100 MB of weights, beyond L3). */
static void bench_decode_sweep(int max_threads, int n_batches, const int *batches, int n_bits, const int *bits)
{
    static const int64_t layer_shapes[7][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576},
                                               {576, 1536}, {576, 1536}, {1536, 576}};
    enum { N_LAYERS = 30 };
    size_t total = 0, off[N_LAYERS * 7 + 1];
    for (int l = 0; l < N_LAYERS; l++)
        for (int k = 0; k < 7; k++) {
            off[l * 7 + k] = total;
            total += bt_cpu_row_bytes(BT_TYPE_Q4_1, layer_shapes[k][0]) * (size_t)layer_shapes[k][1];
        }
    off[N_LAYERS * 7] = total;
    size_t out_bytes = bt_cpu_row_bytes(BT_TYPE_Q8_0, 576) * 49152;
    /* buffers for the largest batch: y holds the output matrix's rows, or a layer's 7 outputs apart (up to 1536 of
     * them per row each: 7 x 1536 <= 49152), so the matmuls run together in one pool run write apart */
    size_t rows = 16;
    for (int bi = 0; bi < n_batches; bi++)
        if ((size_t)batches[bi] > rows) rows = (size_t)batches[bi];
    uint8_t *w = malloc(total), *wout = malloc(out_bytes);
    float *x = malloc(sizeof(float) * 1536 * rows), *y = malloc(sizeof(float) * 49152 * rows);
    void *xq = malloc(bt_cpu_act_row_bytes(BT_TYPE_Q4_1, 16, 1536) * rows);
    if (!w || !wout || !x || !y || !xq) {
        fprintf(stderr, "bench_cpu_kernels: out of memory for the decode sweep\n");
        free(w), free(wout), free(x), free(y), free(xq);
        return;
    }
    uint64_t seed = 99;
    for (int l = 0; l < N_LAYERS; l++)
        for (int k = 0; k < 7; k++)
            fill_weights(BT_TYPE_Q4_1, layer_shapes[k][0], layer_shapes[k][1], w + off[l * 7 + k], &seed);
    fill_weights(BT_TYPE_Q8_0, 576, 49152, wout, &seed);
    for (size_t i = 0; i < 1536 * rows; i++) x[i] = (float)((int)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
    printf("\nSmolLM2-135M token matmuls (30 layers Q4_1 + Q8_0 output, %.1f MB of weights), median of 15:\n",
           (double)(total + out_bytes) * 1e-6);
    printf("%-7s %4s %3s %5s %6s %12s %14s\n", "isa", "bits", "thr", "batch", "fused", "ms/step", "weight GB/s");
    for (int isa = 1; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) continue;
        for (int bi2 = 0; bi2 < n_bits; bi2++)
        for (int nth = 1; nth <= max_threads; nth++)
        /* 2: fused, on weights packed for the tiled GEMM, each matrix on its own 4 KiB pages; 3: the same packed
         * weights laid end to end on huge pages, as the cpu backend holds them, each matmul told where the next one's
         * weights start (bt_cpu_next_hint), as the backend learns it */
        for (int fused = 0; fused < 4; fused++) {
            const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
            if (fused >= 2 && (!bt_cpu_pack_supported(ops, BT_TYPE_Q4_1, bits[bi2]) ||
                               !bt_cpu_pack_supported(ops, BT_TYPE_Q8_0, bits[bi2])))
                continue;
            bt_pool *pool = NULL;
            if (bt_pool_create(nth, &pool) != BT_OK) return;
            static bt_cpu_packed packs[N_LAYERS * 7 + 1];
            bt_hostmem_arena *arena = NULL;
            if (fused == 3 && bt_hostmem_arena_create((size_t)32 << 20, &arena) != BT_OK) return;
            for (int k = 0; fused >= 2 && k <= N_LAYERS * 7; k++) {
                int last = k == N_LAYERS * 7;
                uint32_t t = last ? BT_TYPE_Q8_0 : BT_TYPE_Q4_1;
                int64_t n_in = last ? 576 : layer_shapes[k % 7][0], n_out = last ? 49152 : layer_shapes[k % 7][1];
                const void *src = last ? wout : w + off[k];
                bt_status st = fused == 2 ? bt_cpu_pack(ops, pool, t, bits[bi2], n_in, n_out, src, &packs[k])
                                          : bt_cpu_pack_into(ops, pool, t, bits[bi2], n_in, n_out, src,
                                                             bt_hostmem_arena_alloc(arena, bt_cpu_pack_bytes(
                                                                                               ops, t, bits[bi2], n_in, n_out)),
                                                             &packs[k]);
                if (st != BT_OK) return;
            }
            for (int bi = 0; bi < n_batches; bi++) {
                double samples[15];
                for (int rep = 0; rep < 15; rep++) {
                    double t0 = now_s();
                    for (int l = 0; l < N_LAYERS; l++) {
                        bt_cpu_matmul mm[7];
                        for (int k = 0; k < 7; k++) {
                            mm[k] = (bt_cpu_matmul){.ops = bt_cpu_ops_get((bt_cpu_isa)isa), .wtype = BT_TYPE_Q4_1,
                                                    .n_in = layer_shapes[k][0], .n_out = layer_shapes[k][1],
                                                    .n_rows = batches[bi], .w = w + off[l * 7 + k], .x = x,
                                                    .xq = xq, .out = y + (size_t)k * 1536 * rows, .act_bits = bits[bi2],
                                                    .wp = fused >= 2 ? &packs[l * 7 + k] : NULL};
                            if (fused == 3) /* where the next matmul's weights start (the output's after the last) */
                                mm[k].then = (bt_cpu_next_hint){.data = packs[l * 7 + k + 1].data,
                                                                .n_groups = (packs[l * 7 + k + 1].n_out + 15) / 16,
                                                                .group_bytes = packs[l * 7 + k + 1].group_bytes};
                        }
                        if (fused) { /* q, k, v in one run; gate, up in one run */
                            bt_cpu_matmul_run_multi(pool, mm, 3);
                            bt_cpu_matmul_run(pool, &mm[3]);
                            bt_cpu_matmul_run_multi(pool, mm + 4, 2);
                            bt_cpu_matmul_run(pool, &mm[6]);
                        } else {
                            for (int k = 0; k < 7; k++) bt_cpu_matmul_run(pool, &mm[k]);
                        }
                    }
                    bt_cpu_matmul mo = {.ops = bt_cpu_ops_get((bt_cpu_isa)isa), .wtype = BT_TYPE_Q8_0, .n_in = 576,
                                        .n_out = 49152, .n_rows = batches[bi], .w = wout, .x = x, .xq = xq, .out = y,
                                        .act_bits = bits[bi2], .wp = fused >= 2 ? &packs[N_LAYERS * 7] : NULL};
                    bt_cpu_matmul_run(pool, &mo);
                    samples[rep] = now_s() - t0;
                }
                qsort(samples, 15, sizeof samples[0], cmp_double);
                printf("%-7s %4d %3d %5d %6s %12.3f %14.1f\n", bt_cpu_isa_name((bt_cpu_isa)isa), bits[bi2], nth,
                       batches[bi],
                       fused == 3 ? "huge" : fused == 2 ? "packed" : fused ? "yes" : "no", samples[7] * 1e3,
                       (double)(total + out_bytes) / samples[7] * 1e-9);
                fflush(stdout);
            }
            for (int k = 0; fused >= 2 && k <= N_LAYERS * 7; k++) bt_cpu_packed_free(&packs[k]);
            bt_hostmem_arena_destroy(arena);
            bt_pool_destroy(pool);
        }
    }
    free(w), free(wout), free(x), free(y), free(xq);
}

/* True when the comma-separated list of type names holds t's name (any case). */
static int type_listed(const char *list, uint32_t t)
{
    const char *name = bt_ggml_type_name(t);
    size_t n = strlen(name);
    for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (!strncasecmp(p, name, n) && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

typedef struct gemm_variant {
    const char *name;
    bt_cpu_gemm_fn fn;
    int nr, ahead;
} gemm_variant;

/* --gemm: the packed kernels of one ISA alone on one thread: all groups of a matrix times its activation rows (16,
 * or the --batch counts) in tiles of nr, variants alternated, median of 25; "cold" rotates through copies of the
 * packed matrix totalling >= 128 MB, as decode streams the weights. Efficiency: multiply-adds over the ISA's
 * measured dot-instruction rate for those activation bits (bt_cpu_dot_macs_rate: vpdpwssd / vpdpbusd on AVX-512,
 * vpmaddwd or vpmaddubsw on AVX2). types: NULL, or a comma-separated list of the weight types to run (--types). n_rows > 0: each
 * shape (once per type, shape and cold) runs with each of the activation row counts in rows instead of its own
 * (--batch: a verification step's 2-9 rows, or a prefill chunk's 512, say; as the engine, rows go in chunks of 64,
 * each over all groups). */
static void bench_gemm_kernels(bt_cpu_isa isa, const char *types, int n_rows, const int *rows_list)
{
    const bt_cpu_ops *ops = bt_cpu_isa_supported(isa) ? bt_cpu_ops_get(isa) : NULL;
    if (!ops || (!ops->gemm16[BT_TYPE_Q4_1] && !ops->gemm8[BT_TYPE_Q4_1])) {
        printf("--gemm: no packed kernels for %s here\n", bt_cpu_isa_name(isa));
        return;
    }
    double peak[2] = {bt_cpu_dot_macs_rate(isa, 8), bt_cpu_dot_macs_rate(isa, 16)};
    printf("%s dot rate on one thread: %.1f G MAC/s with 16-bit activations, %.1f with 8-bit; the engine's tiles: up "
           "to %d rows (the kernels take %d); nr: the most rows of a tile, the rows cut into near-equal tiles\n",
           bt_cpu_isa_name(isa), peak[1] * 1e-9, peak[0] * 1e-9, bt_cpu_gemm_tile(ops), bt_cpu_gemm_nr(ops));
    static const struct { uint32_t t; int64_t n_in, n_out; int cold, rows; } cases[] = {
        {BT_TYPE_Q4_1, 576, 1536, 0, 16}, {BT_TYPE_Q4_1, 576, 1536, 1, 16}, {BT_TYPE_Q4_1, 1536, 576, 1, 16},
        {BT_TYPE_Q8_0, 576, 49152, 0, 16}, {BT_TYPE_Q8_0, 576, 1536, 0, 16}, {BT_TYPE_Q4_0, 576, 1536, 0, 16}, {BT_TYPE_Q4_1, 576, 1536, 1, 1},
        {BT_TYPE_Q8_0, 576, 49152, 0, 1}, {BT_TYPE_Q4_K, 1536, 576, 1, 1}, {BT_TYPE_Q4_K, 1536, 576, 1, 16},
        {BT_TYPE_Q6_K, 1536, 576, 1, 1}, {BT_TYPE_Q5_0, 640, 2048, 1, 1}, {BT_TYPE_Q5_0, 640, 2048, 1, 16},
        {BT_TYPE_Q5_1, 576, 1536, 1, 1}, {BT_TYPE_Q5_1, 576, 1536, 1, 16}, {BT_TYPE_Q5_0, 576, 1536, 1, 16},
        {BT_TYPE_Q4_0, 640, 2048, 1, 16}, {BT_TYPE_Q4_1, 576, 576, 1, 16}, {BT_TYPE_Q4_1, 576, 192, 1, 16},
        {BT_TYPE_Q5_K, 1536, 576, 1, 1}, {BT_TYPE_Q5_K, 1536, 576, 1, 16}, {BT_TYPE_Q8_0, 640, 262144, 0, 16}};
    uint64_t seed = 7;
    printf("%-5s %-10s %4s %4s %4s %-6s %3s %10s %8s\n", "type", "shape", "rows", "cold", "bits", "kernel", "nr", "us median",
           "% peak");
    enum { N_CASES = sizeof cases / sizeof cases[0] };
    for (size_t ci = 0; ci < N_CASES * (size_t)(n_rows > 0 ? n_rows : 1); ci++)
        for (int bits = 16; bits >= 8; bits -= 8) {
            const size_t k0 = n_rows > 0 ? ci / (size_t)n_rows : ci;
            uint32_t t = cases[k0].t;
            if (types && !type_listed(types, t)) continue;
            int seen = 0; /* with a rows list, one run per type, shape and cold */
            for (size_t j = 0; n_rows > 0 && j < k0; j++)
                seen |= cases[j].t == t && cases[j].n_in == cases[k0].n_in && cases[j].n_out == cases[k0].n_out &&
                        cases[j].cold == cases[k0].cold;
            if (seen) continue;
            const int64_t rows = n_rows > 0 ? rows_list[ci % (size_t)n_rows] : cases[k0].rows;
            if (!bt_cpu_pack_supported(ops, t, bits)) continue; /* no packed kernel for this type and width */
            int64_t n_in = cases[k0].n_in, n_out = cases[k0].n_out;
            size_t wb = bt_cpu_row_bytes(t, n_in) * (size_t)n_out, ab = bt_cpu_act_row_bytes(t, bits, n_in);
            uint8_t *w = malloc(wb), *xq = malloc(ab * rows);
            float *x = malloc(sizeof(float) * (size_t)(n_in * rows)), *out = malloc(sizeof(float) * (size_t)(n_out * rows));
            if (!w || !xq || !x || !out) return;
            fill_weights(t, n_in, n_out, w, &seed);
            for (int64_t i = 0; i < n_in * rows; i++) x[i] = (float)((int64_t)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
            for (int64_t r = 0; r < rows; r++)
                bt_cpu_prepare_act_row(ops, t, bits, n_in, x + r * n_in, xq + (size_t)r * ab);
            int copies = cases[k0].cold ? (int)(((size_t)128 << 20) / wb + 1) : 1;
            bt_cpu_packed *p = calloc((size_t)copies, sizeof *p);
            for (int c = 0; c < copies; c++)
                if (!p || bt_cpu_pack(ops, NULL, t, bits, n_in, n_out, w, &p[c]) != BT_OK) return;
            bt_cpu_gemm_fn fn = bits == 16 ? ops->gemm16[p[0].wtype] : ops->gemm8[p[0].wtype]; /* the layout's */
            /* the first tile of a group prefetches the next one, or two ahead (pf2), or nothing (nopf) */
            /* tiles of at most the engine's tile rows on this CPU (bt_cpu_gemm_tile), and of the most the kernel
             * takes where that is more, else of 8 (or 4 where that is 8) */
            const int nrt = bt_cpu_gemm_tile(ops), nrm = bt_cpu_gemm_nr(ops);
            const int alt = nrt < nrm ? nrm : nrm > BT_CPU_GEMM_NR ? BT_CPU_GEMM_NR : 4;
            gemm_variant vs[] = {{"pf", fn, nrt, 1}, {"pf", fn, alt, 1}, {"nopf", fn, nrt, 0}, {"pf2", fn, nrt, 2}};
            enum { NV = sizeof vs / sizeof vs[0], REPS = 25 };
            double samples[NV][REPS];
            int c = 0;
            for (int rep = 0; rep < REPS; rep++)
                for (int v = 0; v < NV; v++) {
                    const bt_cpu_packed *pc = &p[c++ % copies];
                    double t0 = now_s();
                    for (int64_t r0 = 0; r0 < rows; r0 += 64) { /* as the engine: 64-row chunks, each over all groups */
                        const int64_t len = rows - r0 < 64 ? rows - r0 : 64, nt = (len + vs[v].nr - 1) / vs[v].nr;
                        for (int64_t g = 0; g < n_out / 16; g++)
                            for (int64_t ti = 0; ti < nt; ti++) { /* near-equal tiles, as the engine cuts them */
                                const int64_t r = r0 + len * ti / nt;
                                const int nr = (int)(r0 + len * (ti + 1) / nt - r);
                                vs[v].fn(n_in, (const char *)pc->data + (size_t)g * pc->group_bytes,
                                         xq + (size_t)r * ab, ab, nr, out + r * n_out + g * 16, (size_t)n_out, 16,
                                         ti == 0 && vs[v].ahead && g + vs[v].ahead < n_out / 16
                                             ? (const char *)pc->data + (size_t)(g + vs[v].ahead) * pc->group_bytes
                                             : NULL);
                            }
                    }
                    samples[v][rep] = now_s() - t0;
                }
            double macs = (double)n_in * (double)n_out * (double)rows;
            char shape[32];
            snprintf(shape, sizeof shape, "%lldx%lld", (long long)n_in, (long long)n_out);
            for (int v = 0; v < NV; v++) {
                qsort(samples[v], REPS, sizeof(double), cmp_double);
                double med = samples[v][REPS / 2];
                printf("%-5s %-10s %4d %4d %4d %-6s %3d %10.1f %7.1f%%\n", bt_ggml_type_name(t), shape, (int)rows, cases[k0].cold,
                       bits, vs[v].name, vs[v].nr, med * 1e6, 100.0 * macs / med / peak[bits == 16]);
            }
            fflush(stdout);
            for (int k = 0; k < copies; k++) bt_cpu_packed_free(&p[k]);
            free(p), free(w), free(xq), free(x), free(out);
        }
}

/* ns per attn_block call; KV bytes per call = K and V rows of one block */
static void bench_attn(const char *isa_arg)
{
    static const struct { const char *model; int hd, group; } shapes[] = {{"SmolLM2", 64, 3}, {"Gemma3", 256, 4}};
    static const struct { bt_cpu_kv_type t; const char *name; size_t esz; } kts[] = {
        {BT_CPU_KV_F16, "f16", 2}, {BT_CPU_KV_U8, "int8", 1}, {BT_CPU_KV_F32, "f32", 4}};
    const size_t region = (size_t)256 << 20;
    uint8_t *mem = aligned_alloc(64, region); /* blocks on cache lines, as the KV pool keeps them */
    if (!mem) return;
    uint64_t seed = 11;
    /* every byte a small fp16 / u8 / f32 value: fp16 0x3c00-range codes, f32 from the same bits are tiny normals */
    for (size_t i = 0; i < region; i += 2) {
        uint16_t h = (uint16_t)(0x3000 + rng_next(&seed) % 0x0c00);
        memcpy(mem + i, &h, 2);
    }
    printf("%-7s %-8s %-5s %4s %5s %10s %10s %9s %9s\n", "model", "isa", "kv", "hd", "group", "hot ns", "cold ns",
           "hot GB/s", "cold GB/s");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ki = 0; ki < sizeof kts / sizeof kts[0]; ki++) {
            const int hd = shapes[si].hd, nq = shapes[si].group, nk = BT_CPU_ATTN_BLOCK;
            const size_t rows = (size_t)nk * (size_t)hd * kts[ki].esz, sm = kts[ki].t == BT_CPU_KV_U8 ? 4 * (size_t)nk : 0;
            const size_t blk = 2 * rows + 2 * sm + 64;
            const size_t n_blk = region / blk;
            size_t *order = malloc(n_blk * sizeof *order);
            float *q = malloc(sizeof(float) * (size_t)(nq * hd)), *acc = malloc(sizeof(float) * (size_t)(nq * hd));
            if (!order || !q || !acc) return;
            for (size_t i = 0; i < n_blk; i++) order[i] = i;
            for (size_t i = n_blk - 1; i > 0; i--) {
                size_t j = rng_next(&seed) % (i + 1), t = order[i];
                order[i] = order[j], order[j] = t;
            }
            for (int i = 0; i < nq * hd; i++) q[i] = (float)((int64_t)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
            if (kts[ki].t == BT_CPU_KV_U8) /* sane (scale, min) pairs */
                for (size_t b = 0; b < n_blk; b++)
                    for (size_t i = 0; i < 2 * sm; i += 2) { /* k_sm, then v_sm */
                        uint16_t h = (uint16_t)(i % 4 == 0 ? 0x2000 : 0xb000);
                        memcpy(mem + b * blk + 2 * rows + i, &h, 2);
                    }
            for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
                if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) continue;
                if (strcmp(isa_arg, "all") && strcmp(isa_arg, bt_cpu_isa_name((bt_cpu_isa)isa))) continue;
                const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
                double med[2];
                for (int cold = 0; cold < 2; cold++) {
                    enum { REPS = 9 };
                    double samples[REPS];
                    size_t calls = 64; /* then as many as take ~20 ms a rep (the scalar kernels are ~100x slower) */
                    for (int rep = -1; rep < REPS; rep++) {
                        float m[8], l[8];
                        for (int h = 0; h < nq; h++) m[h] = -INFINITY, l[h] = 0;
                        memset(acc, 0, sizeof(float) * (size_t)(nq * hd));
                        double t0 = now_s();
                        for (size_t c = 0; c < calls; c++) {
                            const uint8_t *b = mem + (cold ? order[c] : 0) * blk;
                            const uint8_t *pf = cold && c + 2 < calls ? mem + order[c + 2] * blk : NULL;
                            bt_cpu_kv_rows kv = {.type = kts[ki].t, .k = b, .v = b + rows,
                                                 .k_sm = (const uint16_t *)(b + 2 * rows),
                                                 .v_sm = (const uint16_t *)(b + 2 * rows + sm), .pf_k = pf,
                                                 .pf_v = pf ? pf + rows : NULL, .pf_bytes = rows};
                            if (!ops->attn_prefetches && pf) { /* as the engine: K before, V after */
                                for (size_t o = 0; o < rows; o += 64) __builtin_prefetch(pf + o, 0, 1);
                            }
                            ops->attn_block(hd, nq, q, 0.125f, &kv, nk, m, l, acc);
                            if (!ops->attn_prefetches && pf)
                                for (size_t o = 0; o < rows; o += 64) __builtin_prefetch(pf + rows + o, 0, 1);
                        }
                        double per = (now_s() - t0) / (double)calls;
                        if (rep < 0) {
                            double want = 20e-3 / per;
                            calls = want < 64 ? 64 : want > (double)(cold ? n_blk : 20000) ? (cold ? n_blk : 20000) : (size_t)want;
                        } else {
                            samples[rep] = per;
                        }
                    }
                    qsort(samples, REPS, sizeof(double), cmp_double);
                    med[cold] = samples[REPS / 2];
                }
                printf("%-7s %-8s %-5s %4d %5d %10.1f %10.1f %9.1f %9.1f\n", shapes[si].model,
                       bt_cpu_isa_name((bt_cpu_isa)isa), kts[ki].name, hd, nq, med[0] * 1e9, med[1] * 1e9,
                       (double)(2 * rows) / med[0] * 1e-9, (double)(2 * rows) / med[1] * 1e-9);
                fflush(stdout);
            }
            free(order), free(q), free(acc);
        }
    free(mem);
}

/* --attn, second table: a prompt chunk's query rows against one f32 block (as the engine widens f16 ones), ns per
 * query row: attn_block called once per query (its GQA group of heads) against attn_block_rows (16 rows a call,
 * from rows transposed once), alternated, median of 31 rounds; the results compared to the bit. */
static void bench_attn_rows(const char *isa_arg)
{
    static const struct { const char *model; int hd, group; } shapes[] = {
        {"SmolLM2", 64, 3}, {"hd128", 128, 4}, {"Gemma3", 256, 4}};
    enum { ROWS = 48, REPS = 31 }; /* 16 queries of 3 heads, 12 of 4 */
    printf("\n%-7s %-8s %4s %5s %14s %14s %7s\n", "model", "isa", "hd", "group", "per query ns", "rows ns", "ratio");
    for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
        if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) continue;
        if (strcmp(isa_arg, "all") && strcmp(isa_arg, bt_cpu_isa_name((bt_cpu_isa)isa))) continue;
        const bt_cpu_ops *ops = bt_cpu_ops_get((bt_cpu_isa)isa);
        if (!ops->attn_block_rows) continue;
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int hd = shapes[si].hd, group = shapes[si].group;
            const size_t kvn = (size_t)BT_CPU_ATTN_BLOCK * (size_t)hd, qn = (size_t)ROWS * (size_t)hd;
            float *k = malloc(4 * kvn), *v = malloc(4 * kvn), *q = malloc(4 * qn), *qt = malloc(4 * qn);
            float *acc[2] = {malloc(4 * qn), malloc(4 * qn)}, m[2][ROWS], l[2][ROWS];
            if (!k || !v || !q || !qt || !acc[0] || !acc[1]) {
                free(k), free(v), free(q), free(qt), free(acc[0]), free(acc[1]);
                return;
            }
            uint64_t seed = 3;
            for (size_t i = 0; i < kvn; i++)
                k[i] = (float)((int)(rng_next(&seed) % 2001) - 1000) * 1e-3f, v[i] = (float)((int)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
            for (size_t i = 0; i < qn; i++) q[i] = (float)((int)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
            for (int r = 0; r < ROWS; r++) /* 16-row chunks, each element i of its rows side by side */
                bt_cpu_attn_rows_put(hd, r % BT_CPU_ATTN_ROWS, q + (size_t)r * (size_t)hd,
                                     qt + (size_t)(r / BT_CPU_ATTN_ROWS) * BT_CPU_ATTN_ROWS * (size_t)hd);
            const bt_cpu_kv_rows rows = {.type = BT_CPU_KV_F32, .k = k, .v = v};
            double samples[2][REPS];
            for (int rep = 0; rep < REPS; rep++)
                for (int w = 0; w < 2; w++) {
                    for (int r = 0; r < ROWS; r++) m[w][r] = -INFINITY, l[w][r] = 0;
                    memset(acc[w], 0, 4 * qn);
                    const int calls = 64;
                    double t0 = now_s();
                    for (int c = 0; c < calls; c++)
                        for (int r = 0; r < ROWS; r += w ? BT_CPU_ATTN_ROWS : group) {
                            if (w)
                                ops->attn_block_rows(hd, BT_CPU_ATTN_ROWS, qt + (size_t)r * (size_t)hd, 0.125f, k, v,
                                                     BT_CPU_ATTN_BLOCK, m[1] + r, l[1] + r, acc[1] + (size_t)r * (size_t)hd,
                                                     NULL);
                            else
                                ops->attn_block(hd, group, q + (size_t)r * (size_t)hd, 0.125f, &rows, BT_CPU_ATTN_BLOCK,
                                                m[0] + r, l[0] + r, acc[0] + (size_t)r * (size_t)hd);
                        }
                    samples[w][rep] = (now_s() - t0) / calls / ROWS;
                }
            const int same = !memcmp(acc[0], acc[1], 4 * qn) && !memcmp(m[0], m[1], sizeof m[0]) &&
                             !memcmp(l[0], l[1], sizeof l[0]);
            qsort(samples[0], REPS, sizeof(double), cmp_double);
            qsort(samples[1], REPS, sizeof(double), cmp_double);
            printf("%-7s %-8s %4d %5d %14.1f %14.1f %6.2fx%s\n", shapes[si].model, bt_cpu_isa_name((bt_cpu_isa)isa), hd,
                   group, samples[0][REPS / 2] * 1e9, samples[1][REPS / 2] * 1e9,
                   samples[1][REPS / 2] / samples[0][REPS / 2], same ? "" : "  RESULTS DIFFER");
            fflush(stdout);
            free(k), free(v), free(q), free(qt), free(acc[0]), free(acc[1]);
        }
    }
}

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        s = strchr(s, ',');
        if (!s) break;
        s++;
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *types_arg = "f32,f16,bf16,q8_0,q4_0,q4_1,q5_0,q5_1,q4_k,q5_k,q6_k", *isa_arg = "all";
    int threads[4] = {1, 2}, n_threads = 2, batches[8] = {1, 16}, n_batches = 2, batch_given = 0, hot = 0;
    int case_ms = 150, only = 0;
    int bits[2] = {8, 16}, n_bits = 2, types_given = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--types") && i + 1 < argc) types_arg = argv[++i], types_given = 1;
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa_arg = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) n_threads = parse_list(argv[++i], threads, 4);
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc) n_batches = parse_list(argv[++i], batches, 8), batch_given = 1;
        else if (!strcmp(argv[i], "--bits") && i + 1 < argc) n_bits = parse_list(argv[++i], bits, 2);
        else if (!strcmp(argv[i], "--hot")) hot = 1;
        else if (!strcmp(argv[i], "--ms") && i + 1 < argc) case_ms = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--memory-only")) only = 1;
        else if (!strcmp(argv[i], "--decode-only")) only = 2;
        else if (!strcmp(argv[i], "--gemm")) only = 3;
        else if (!strcmp(argv[i], "--attn")) only = 4;
        else {
            fprintf(stderr, "usage: %s [--types LIST] [--isa NAME|all] [--threads LIST] [--batch LIST] [--bits LIST] "
                            "[--hot] [--ms N] [--memory-only] [--decode-only] [--gemm] [--attn]\n", argv[0]);
            return 2;
        }
    }
    if (only == 4) {
        bench_attn(isa_arg), bench_attn_rows(isa_arg);
        return 0;
    }
    for (int b = 0; b < n_batches; b++)
        if (batches[b] < 1 || batches[b] > 512) return fprintf(stderr, "--batch: row counts from 1 to 512\n"), 2;
    if (only == 3) { /* --isa names the kernels (default: the best this CPU has) */
        bt_cpu_isa gi = BT_CPU_ISA_SCALAR;
        for (int i = 0; i < BT_CPU_ISA_COUNT; i++)
            if (bt_cpu_isa_supported((bt_cpu_isa)i) &&
                (!strcmp(isa_arg, "all") || !strcmp(isa_arg, bt_cpu_isa_name((bt_cpu_isa)i))))
                gi = (bt_cpu_isa)i;
        bench_gemm_kernels(gi, types_given ? types_arg : NULL, batch_given ? n_batches : 0, batches);
        return 0;
    }
    if (only != 2) bench_memory();
    for (int b = 0; b < n_bits; b++)
        if (bits[b] != 8 && bits[b] != 16) return fprintf(stderr, "--bits: 8 or 16\n"), 2;
    if (only != 1) bench_decode_sweep(2, n_batches, batches, n_bits, bits);
    if (only) return 0;
    static const int64_t shapes[][2] = {{576, 576}, {576, 1536}, {1536, 576}, {576, 49152}}; /* n_in, n_out */
    printf("\nmedian and best time per matmul call (activation quantization included); GB/s = weight bytes / median\n");
    printf("%-5s %-12s %-7s %4s %3s %5s %10s %10s %8s %9s\n", "type", "n_in x n_out", "isa", "bits", "thr", "batch",
           "us median", "us best", "GB/s", "GFLOP/s");
    char types[256];
    snprintf(types, sizeof types, "%s", types_arg);
    uint64_t seed = 1;
    for (char *save = NULL, *tn = strtok_r(types, ",", &save); tn; tn = strtok_r(NULL, ",", &save)) {
        int t = bt_ggml_type_from_name(tn);
        if (t < 0 || bt_cpu_act_format((uint32_t)t, 8) == BT_ACT_NONE) {
            fprintf(stderr, "unsupported type %s\n", tn);
            return 2;
        }
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            int64_t n_in = shapes[si][0], n_out = shapes[si][1];
            size_t wbytes = bt_cpu_row_bytes((uint32_t)t, n_in) * (size_t)n_out;
            if (wbytes == 0) continue; /* n_in not a multiple of the block (K-quants need 256) */
            size_t copies = hot ? 1 : ((size_t)128 << 20) / wbytes + 1;
            uint8_t *w = malloc(wbytes * copies);
            int max_batch = 1;
            for (int b = 0; b < n_batches; b++) max_batch = batches[b] > max_batch ? batches[b] : max_batch;
            float *x = malloc(sizeof(float) * (size_t)(n_in * max_batch));
            float *out = malloc(sizeof(float) * (size_t)(n_out * max_batch));
            void *xq = malloc(bt_cpu_act_row_bytes((uint32_t)t, 16, n_in) * (size_t)max_batch); /* >= 8-bit size */
            if (!w || !x || !out || !xq) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            fill_weights((uint32_t)t, n_in, n_out, w, &seed);
            for (size_t c = 1; c < copies; c++) memcpy(w + c * wbytes, w, wbytes);
            for (int64_t i = 0; i < n_in * max_batch; i++)
                x[i] = (float)((int64_t)(rng_next(&seed) % 2001) - 1000) * 1e-3f;
            for (int isa = 0; isa < BT_CPU_ISA_COUNT; isa++) {
                if (!bt_cpu_isa_supported((bt_cpu_isa)isa)) continue;
                if (strcmp(isa_arg, "all") && strcmp(isa_arg, bt_cpu_isa_name((bt_cpu_isa)isa))) continue;
                for (int ti = 0; ti < n_threads; ti++) {
                    bt_pool *pool = NULL;
                    if (bt_pool_create(threads[ti], &pool) != BT_OK) return 1;
                    int nb_bits = bt_cpu_act_format((uint32_t)t, 8) == BT_ACT_F32 ? 1 : n_bits;
                    for (int bk = 0; bk < nb_bits; bk++)
                    for (int bi = 0; bi < n_batches; bi++) {
                        bt_cpu_matmul mm = {.ops = bt_cpu_ops_get((bt_cpu_isa)isa), .wtype = (uint32_t)t,
                                            .n_in = n_in, .n_out = n_out, .n_rows = batches[bi], .x = x, .xq = xq,
                                            .out = out, .act_bits = bits[bk]};
                        double samples[4096];
                        int ns = 0;
                        double start = now_s();
                        size_t c = 0;
                        while (ns < 4096 && (ns < 3 || now_s() - start < case_ms * 1e-3)) {
                            mm.w = w + (c++ % copies) * wbytes;
                            double t0 = now_s();
                            if (bt_cpu_matmul_run(pool, &mm) != BT_OK) return 1;
                            samples[ns++] = now_s() - t0;
                        }
                        qsort(samples, (size_t)ns, sizeof samples[0], cmp_double);
                        double med = samples[ns / 2];
                        char shape[32];
                        snprintf(shape, sizeof shape, "%lldx%lld", (long long)n_in, (long long)n_out);
                        printf("%-5s %-12s %-7s %4d %3d %5d %10.1f %10.1f %8.1f %9.1f\n",
                               bt_ggml_type_name((uint32_t)t), shape, bt_cpu_isa_name((bt_cpu_isa)isa),
                               nb_bits == 1 ? 32 : bits[bk], threads[ti], batches[bi], med * 1e6,
                               samples[0] * 1e6,
                               (double)wbytes / med * 1e-9, 2.0 * (double)(n_in * n_out * batches[bi]) / med * 1e-9);
                        fflush(stdout);
                    }
                    bt_pool_destroy(pool);
                }
            }
            free(w), free(x), free(out), free(xq);
        }
    }
    return 0;
}
