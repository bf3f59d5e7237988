/* Test helper (not a test) for tests/integration/test_dequant_oracle.py.
 *   bt_cpu_dequant_tool dequant TYPE N_ELEMS IN OUT
 *       dequantizes N_ELEMS elements of raw GGUF blocks with the scalar reference; OUT gets f32.
 *   bt_cpu_dequant_tool matmul TYPE N_IN N_OUT N_ROWS W X OUT [ACT_BITS]
 *       OUT[N_ROWS][N_OUT] = X[N_ROWS][N_IN] (f32) * W^T (raw blocks) with bt_cpu_matmul_run on 2 threads, on the
 *       ISA that bt_cpu_isa_select picks (BATON_CPU_ISA forces one), activations at ACT_BITS (8 or 16, default 8).
 *   bt_cpu_dequant_tool quantize N IN OUT [BITS]
 *       activation quantizer (reference) of N floats: BITS 8 (default) writes the raw bt_block_q8_32 array, 16 the
 *       bt_block_q16_32 array.
 * TYPE by name (q4_k, f16, ...). Exit status 0 on success, 1 on I/O errors, 2 on bad arguments. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"
#include "engine/ggml_type.h"

static void *read_all(const char *path, size_t bytes)
{
    void *buf = malloc(bytes ? bytes : 1);
    FILE *f = fopen(path, "rb");
    if (!buf || !f || fread(buf, 1, bytes, f) != bytes) {
        fprintf(stderr, "cannot read %zu bytes from %s: %s\n", bytes, path, strerror(errno));
        exit(1);
    }
    fclose(f);
    return buf;
}

static void write_all(const char *path, const void *buf, size_t bytes)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, bytes, f) != bytes || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
}

static int parse_type(const char *name)
{
    int t = bt_ggml_type_from_name(name);
    if (t < 0 || bt_cpu_act_format((uint32_t)t, 8) == BT_ACT_NONE) {
        fprintf(stderr, "unsupported type %s\n", name);
        exit(2);
    }
    return t;
}

int main(int argc, char **argv)
{
    if (argc == 6 && !strcmp(argv[1], "dequant")) {
        int t = parse_type(argv[2]);
        long long n = strtoll(argv[3], NULL, 10);
        size_t bytes = bt_cpu_row_bytes((uint32_t)t, n);
        if (n <= 0 || bytes == 0) return fprintf(stderr, "bad element count %s\n", argv[3]), 2;
        void *in = read_all(argv[4], bytes);
        float *out = malloc((size_t)n * sizeof *out);
        if (!out || bt_cpu_dequantize_row_ref((uint32_t)t, n, in, out) != 0) return 1;
        write_all(argv[5], out, (size_t)n * sizeof *out);
        free(in), free(out);
        return 0;
    }
    if ((argc == 9 || argc == 10) && !strcmp(argv[1], "matmul")) {
        int t = parse_type(argv[2]);
        int bits = argc == 10 ? atoi(argv[9]) : 8;
        if (bits != 8 && bits != 16) return fprintf(stderr, "bad activation bits %s\n", argv[9]), 2;
        long long n_in = strtoll(argv[3], NULL, 10), n_out = strtoll(argv[4], NULL, 10),
                  n_rows = strtoll(argv[5], NULL, 10);
        size_t wb = bt_cpu_row_bytes((uint32_t)t, n_in);
        if (n_in <= 0 || n_out <= 0 || n_rows <= 0 || wb == 0) return fprintf(stderr, "bad shape\n"), 2;
        bt_cpu_isa isa;
        int want = -1; /* this tool's edge: BATON_CPU_ISA forces an ISA */
        if (bt_cpu_isa_env(&want) != BT_OK || bt_cpu_isa_select(want, &isa) != BT_OK)
            return fprintf(stderr, "%s\n", bt_last_error()), 2;
        void *w = read_all(argv[6], wb * (size_t)n_out);
        float *x = read_all(argv[7], sizeof(float) * (size_t)(n_in * n_rows));
        float *out = malloc(sizeof(float) * (size_t)(n_out * n_rows));
        void *xq = malloc(bt_cpu_act_row_bytes((uint32_t)t, bits, n_in) * (size_t)n_rows);
        bt_pool *pool = NULL;
        if (!out || !xq || bt_pool_create(2, &pool) != BT_OK) return 1;
        bt_cpu_matmul mm = {.ops = bt_cpu_ops_get(isa), .wtype = (uint32_t)t, .n_in = n_in, .n_out = n_out,
                            .n_rows = n_rows, .w = w, .x = x, .xq = xq, .out = out, .act_bits = bits};
        if (bt_cpu_matmul_run(pool, &mm) != BT_OK) return fprintf(stderr, "%s\n", bt_last_error()), 1;
        write_all(argv[8], out, sizeof(float) * (size_t)(n_out * n_rows));
        fprintf(stderr, "isa %s\n", bt_cpu_isa_name(isa));
        bt_pool_destroy(pool);
        free(w), free(x), free(out), free(xq);
        return 0;
    }
    if ((argc == 5 || argc == 6) && !strcmp(argv[1], "quantize")) {
        long long n = strtoll(argv[2], NULL, 10);
        int bits = argc == 6 ? atoi(argv[5]) : 8;
        if (n <= 0 || n % BT_QK) return fprintf(stderr, "bad element count %s\n", argv[2]), 2;
        if (bits != 8 && bits != 16) return fprintf(stderr, "bad activation bits %s\n", argv[5]), 2;
        float *x = read_all(argv[3], sizeof(float) * (size_t)n);
        size_t ob = (size_t)(n / BT_QK) * (bits == 8 ? sizeof(bt_block_q8_32) : sizeof(bt_block_q16_32));
        void *y = malloc(ob);
        if (!y) return 1;
        if (bits == 8)
            bt_cpu_quantize_q8_32_ref(n, x, y);
        else
            bt_cpu_quantize_q16_32_ref(n, x, y);
        write_all(argv[4], y, ob);
        free(x), free(y);
        return 0;
    }
    fprintf(stderr, "usage: %s dequant TYPE N_ELEMS IN OUT\n"
                    "       %s matmul TYPE N_IN N_OUT N_ROWS W X OUT [ACT_BITS]\n"
                    "       %s quantize N IN OUT [BITS]\n", argv[0], argv[0], argv[0]);
    return 2;
}
