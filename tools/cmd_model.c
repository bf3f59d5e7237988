/* `baton model fetch|inspect|path`: fetch the default model, print a GGUF file's metadata and tensor table. */
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/paths.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/ggml_type.h"
#include "engine/gguf.h"
#include "engine/gguf_slice.h"
#include "tools/commands.h"

static void model_usage(FILE *out)
{
    fprintf(out,
            "usage: baton model fetch [--force] [NAME]\n"
            "                                          fetch the default model (%s) into the cache, or\n"
            "                                          the one deploy/models/NAME.env names (gemma3-270m)\n"
            "       baton model inspect [PATH] [--all]  print metadata and the tensor table (default model if no PATH)\n"
            "       baton model slice [PATH] --layers 0-N --out FILE\n"
            "                                          write the model's layers 0..N (inclusive) as a model of their\n"
            "                                          own: a draft for speculative decoding (--spec draft:FILE;\n"
            "                                          --spec self:N+1 does the same without a file)\n"
            "       baton model quantize [PATH] --type q4_k|q5_k|q5_0|q5_1|q6_k --out FILE\n"
            "                                          write the model with every matrix requantized to Q4_K (rows\n"
            "                                          a multiple of 256), Q5_0 or Q5_1 (a multiple of 32): files of\n"
            "                                          those types to test and measure with\n"
            "       baton model path                print the default model's path\n"
            "\n--all prints every array element instead of the first few.\n",
            BT_DEFAULT_MODEL_FILE);
}

/* Prints s quoted, escaping control bytes, at most max bytes. */
static void print_quoted(gguf_str s, uint64_t max)
{
    putchar('"');
    uint64_t n = s.len < max ? s.len : max;
    for (uint64_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s.ptr[i];
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch == '\n') fputs("\\n", stdout);
        else if (ch == '\t') fputs("\\t", stdout);
        else if (ch < 0x20 || ch == 0x7f) printf("\\x%02x", ch);
        else putchar(ch);
    }
    putchar('"');
    if (n < s.len) printf("... (%" PRIu64 " bytes)", s.len);
}

static void print_scalar(const gguf_kv *kv)
{
    switch (kv->type) {
    case GGUF_VT_BOOL: fputs(kv->num.u64 ? "true" : "false", stdout); break;
    case GGUF_VT_INT8: case GGUF_VT_INT16: case GGUF_VT_INT32: case GGUF_VT_INT64:
        printf("%" PRId64, kv->num.i64);
        break;
    case GGUF_VT_FLOAT32: case GGUF_VT_FLOAT64: printf("%.9g", kv->num.f64); break;
    case GGUF_VT_STRING: print_quoted(kv->str, 160); break;
    default: printf("%" PRIu64, kv->num.u64); break;
    }
}

static void print_kv(const gguf_kv *kv, int all)
{
    char key[256];
    printf("  %-44s %-8s ", gguf_str_copy(kv->key, key, sizeof key), gguf_vtype_name(kv->type));
    if (kv->type != GGUF_VT_ARRAY) {
        print_scalar(kv);
        putchar('\n');
        return;
    }
    printf("[%s x %" PRIu64 "] ", gguf_vtype_name(kv->arr_type), kv->arr_len);
    uint64_t show = all ? kv->arr_len : (kv->arr_len < 8 ? kv->arr_len : 8);
    putchar('[');
    for (uint64_t i = 0; i < show; i++) {
        if (i) fputs(", ", stdout);
        if (kv->arr_type == GGUF_VT_STRING) print_quoted(gguf_arr_str(kv, i), 80);
        else if (kv->arr_type == GGUF_VT_FLOAT32 || kv->arr_type == GGUF_VT_FLOAT64) printf("%g", gguf_arr_float(kv, i));
        else printf("%" PRId64, gguf_arr_int(kv, i));
    }
    if (show < kv->arr_len) fputs(", ...", stdout);
    puts("]");
}

static int model_inspect(const char *path, int all)
{
    gguf_file *f;
    bt_status st = gguf_open(path, &f);
    if (st) {
        fprintf(stderr, "baton model inspect: %s\n", bt_last_error());
        return 1;
    }
    printf("file: %s\n", path);
    printf("GGUF version %u, %" PRIu64 " bytes, %" PRIu64 " metadata entries, %" PRIu64
           " tensors, alignment %u, data at offset %" PRIu64 "\n",
           gguf_version(f), gguf_file_size(f), gguf_n_kv(f), gguf_n_tensors(f), gguf_alignment(f), gguf_data_offset(f));

    gguf_str arch = {"", 0};
    char a[64] = "";
    if (gguf_get_str(f, "general.architecture", &arch) == BT_OK) gguf_str_copy(arch, a, sizeof a);
    printf("\nmodel:\n");
    gguf_str name;
    if (gguf_get_str(f, "general.name", &name) == BT_OK) {
        printf("  %-22s ", "name");
        print_quoted(name, 120);
        putchar('\n');
    }
    printf("  %-22s %s\n", "architecture", *a ? a : "(missing)");
    static const struct { const char *label, *suffix; } hp[] = {
        {"blocks", "block_count"},
        {"embedding", "embedding_length"},
        {"feed forward", "feed_forward_length"},
        {"heads", "attention.head_count"},
        {"kv heads", "attention.head_count_kv"},
        {"context", "context_length"},
        {"rope dims", "rope.dimension_count"},
    };
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) {
        char key[128];
        uint64_t v;
        snprintf(key, sizeof key, "%s.%s", a, hp[i].suffix);
        if (gguf_get_u64(f, key, &v) == BT_OK) printf("  %-22s %" PRIu64 "\n", hp[i].label, v);
    }
    char key[128];
    float fv;
    snprintf(key, sizeof key, "%s.rope.freq_base", a);
    if (gguf_get_f32(f, key, &fv) == BT_OK) printf("  %-22s %g\n", "rope freq base", fv);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", a);
    if (gguf_get_f32(f, key, &fv) == BT_OK) printf("  %-22s %g\n", "rms norm eps", fv);
    const gguf_kv *toks;
    if (gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &toks) == BT_OK)
        printf("  %-22s %" PRIu64 "\n", "vocab", toks->arr_len);
    gguf_str tm;
    if (gguf_get_str(f, "tokenizer.ggml.model", &tm) == BT_OK) {
        char t[64];
        printf("  %-22s %s\n", "tokenizer", gguf_str_copy(tm, t, sizeof t));
    }

    uint64_t count[BT_TYPE_COUNT] = {0}, bytes[BT_TYPE_COUNT] = {0}, params = 0;
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        count[t->type]++;
        bytes[t->type] += t->n_bytes;
        params += t->n_elems;
    }
    printf("  %-22s %.1f M\n", "parameters", params / 1e6);
    printf("  %-22s", "tensor types");
    for (int t = 0; t < BT_TYPE_COUNT; t++)
        if (count[t]) printf(" %s x%" PRIu64 " (%.1f MiB)", bt_ggml_type_name((uint32_t)t), count[t], bytes[t] / 1048576.0);
    putchar('\n');

    printf("\nmetadata:\n");
    for (uint64_t i = 0; i < gguf_n_kv(f); i++) print_kv(gguf_kv_at(f, i), all);

    printf("\ntensors:\n  %-5s %-36s %-6s %-24s %12s %12s\n", "#", "name", "type", "shape", "bytes", "offset");
    for (uint64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        char nm[256], shape[96];
        int n = 0;
        for (uint32_t d = 0; d < t->n_dims; d++)
            n += snprintf(shape + n, sizeof shape - (size_t)n, "%s%" PRIu64, d ? " x " : "", t->ne[d]);
        printf("  %-5" PRIu64 " %-36s %-6s %-24s %12" PRIu64 " %12" PRIu64 "\n", i, gguf_str_copy(t->name, nm, sizeof nm),
               bt_ggml_type_name(t->type), shape, t->n_bytes, t->offset);
    }
    gguf_close(f);
    return 0;
}

/* Finds deploy/fetch-model.sh: $BATON_HOME, then relative to this executable (build/bin/../../), then the
 * source tree this binary was built from. */
static int find_fetch_script(char *out, size_t cap)
{
    const char *home = getenv("BATON_HOME");
    if (home && *home) {
        snprintf(out, cap, "%s/deploy/fetch-model.sh", home);
        if (access(out, X_OK) == 0) return 0;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = '\0';
            snprintf(out, cap, "%s/../../deploy/fetch-model.sh", exe);
            if (access(out, X_OK) == 0) return 0;
        }
    }
    snprintf(out, cap, "%s/deploy/fetch-model.sh", BATON_SOURCE_DIR);
    return access(out, X_OK) == 0 ? 0 : -1;
}

static int model_fetch(int force, const char *name)
{
    char script[PATH_MAX + 64];
    if (find_fetch_script(script, sizeof script) != 0) {
        fprintf(stderr, "baton model fetch: cannot find deploy/fetch-model.sh (set BATON_HOME to the baton checkout)\n");
        return 1;
    }
    char *args[5] = {script};
    int n = 1;
    if (name) args[n++] = "--model", args[n++] = (char *)name;
    if (force) args[n++] = "--force";
    args[n] = NULL;
    execv(script, args);
    perror("baton model fetch: exec");
    return 1;
}

/* `model slice PATH --layers 0-N --out FILE`. */
static int model_slice(const char *path, const char *layers, const char *out)
{
    if (!layers || !out) {
        fprintf(stderr, "baton model slice: give --layers 0-N and --out FILE\n");
        return 2;
    }
    char *end = NULL;
    long last = -1;
    if (!strncmp(layers, "0-", 2)) last = strtol(layers + 2, &end, 10);
    if (last < 0 || !end || end == layers + 2 || *end) {
        fprintf(stderr, "baton model slice: --layers wants 0-N (the first N+1 layers), not '%s'\n", layers);
        return 2;
    }
    if (gguf_slice_layers(path, out, (int32_t)last + 1)) {
        fprintf(stderr, "baton model slice: %s\n", bt_last_error());
        return 1;
    }
    printf("wrote %s: layers 0-%ld of %s\n", out, last, path);
    return 0;
}

/* `model quantize`: each matrix (2-D ".weight" tensor with rows a multiple of the type's block) rewritten as Q4_K
 * or Q5_0. */
typedef struct quant_job {
    uint32_t type; /* BT_TYPE_Q4_K, BT_TYPE_Q5_K, BT_TYPE_Q5_0, BT_TYPE_Q5_1 or BT_TYPE_Q6_K */
    uint64_t done, total;
    void *buf;   /* the current tensor's new bytes */
    float *row;  /* one dequantized row */
    size_t row_cap;
} quant_job;

static int quantizable(const gguf_tensor *t, uint32_t type)
{
    char name[256];
    gguf_str_copy(t->name, name, sizeof name);
    size_t n = strlen(name);
    return t->n_dims == 2 && n > 7 && !strcmp(name + n - 7, ".weight") &&
           t->ne[0] % (uint64_t)bt_cpu_block_elems(type) == 0 && t->type != type;
}

static bt_status quantize_tensor(void *ud, const gguf_tensor *t, gguf_tensor_out *out)
{
    quant_job *q = ud;
    q->done++;
    if (!quantizable(t, q->type)) return BT_OK;
    int64_t n_in = (int64_t)t->ne[0], n_out = (int64_t)t->ne[1];
    size_t src_row = bt_cpu_row_bytes(t->type, n_in), dst_row = bt_cpu_row_bytes(q->type, n_in);
    if (!src_row) return bt_fail(BT_ERR_UNSUPPORTED, "cannot read tensor type %s", bt_ggml_type_name(t->type));
    free(q->buf);
    q->buf = malloc(dst_row * (size_t)n_out);
    if ((size_t)n_in > q->row_cap) {
        free(q->row);
        q->row = malloc(sizeof(float) * (size_t)n_in);
        q->row_cap = q->row ? (size_t)n_in : 0;
    }
    if (!q->buf || !q->row) return bt_fail(BT_ERR_NOMEM, "out of memory quantizing a %lld x %lld tensor",
                                           (long long)n_out, (long long)n_in);
    for (int64_t o = 0; o < n_out; o++) {
        if (bt_cpu_dequantize_row_ref(t->type, n_in, (const uint8_t *)t->data + (size_t)o * src_row, q->row))
            return bt_fail(BT_ERR_UNSUPPORTED, "cannot dequantize %s rows", bt_ggml_type_name(t->type));
        void *dst = (uint8_t *)q->buf + (size_t)o * dst_row;
        if (q->type == BT_TYPE_Q4_K) bt_cpu_quantize_row_q4_k(n_in, q->row, dst);
        else if (q->type == BT_TYPE_Q5_K) bt_cpu_quantize_row_q5_k(n_in, q->row, dst);
        else if (q->type == BT_TYPE_Q5_0) bt_cpu_quantize_row_q5_0(n_in, q->row, dst);
        else if (q->type == BT_TYPE_Q6_K) bt_cpu_quantize_row_q6_k(n_in, q->row, dst);
        else bt_cpu_quantize_row_q5_1(n_in, q->row, dst);
    }
    out->type = q->type, out->data = q->buf, out->n_bytes = dst_row * (size_t)n_out;
    fprintf(stderr, "\r  quantized %llu of %llu tensors", (unsigned long long)q->done, (unsigned long long)q->total);
    return BT_OK;
}

/* What `model quantize --type` writes: the name, the tensor type, the file's name suffix and llama.cpp file type. */
static const struct {
    const char *name;
    uint32_t type;
    const char *suffix;
    int file_type;
} quant_types[] = {{"q4_k", BT_TYPE_Q4_K, " (Q4_K)", 14 /* MOSTLY_Q4_K_S */},
                   {"q5_k", BT_TYPE_Q5_K, " (Q5_K)", 16 /* MOSTLY_Q5_K_S */},
                   {"q5_0", BT_TYPE_Q5_0, " (Q5_0)", 8 /* MOSTLY_Q5_0 */},
                   {"q5_1", BT_TYPE_Q5_1, " (Q5_1)", 9 /* MOSTLY_Q5_1 */},
                   {"q6_k", BT_TYPE_Q6_K, " (Q6_K)", 18 /* MOSTLY_Q6_K */}};

/* `model quantize PATH --type q4_k|q5_k|q5_0|q5_1|q6_k --out FILE`. */
static int model_quantize(const char *path, const char *type, const char *out)
{
    int k = -1;
    for (int i = 0; type && i < (int)(sizeof quant_types / sizeof *quant_types); i++)
        if (!strcmp(type, quant_types[i].name)) k = i;
    if (!out || k < 0) {
        fprintf(stderr, "baton model quantize: give --type q4_k|q5_k|q5_0|q5_1|q6_k and --out FILE%s%s%s\n",
                type ? " (not '" : "", type ? type : "", type ? "')" : "");
        return 2;
    }
    gguf_file *f = NULL;
    if (gguf_open(path, &f)) {
        fprintf(stderr, "baton model quantize: %s\n", bt_last_error());
        return 1;
    }
    quant_job q = {.type = quant_types[k].type, .total = gguf_n_tensors(f)};
    gguf_close(f);
    gguf_rewrite_opts o = {.name_suffix = quant_types[k].suffix, .file_type = quant_types[k].file_type,
                           .tensor = quantize_tensor, .ud = &q};
    bt_status st = gguf_rewrite(path, out, &o);
    fprintf(stderr, "\n");
    free(q.buf);
    free(q.row);
    if (st) {
        fprintf(stderr, "baton model quantize: %s\n", bt_last_error());
        return 1;
    }
    printf("wrote %s: the matrices of %s as %s\n", out, path, bt_ggml_type_name(quant_types[k].type));
    return 0;
}

int cmd_model(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        model_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *sub = argv[1];
    int all = 0, force = 0;
    const char *path = NULL, *layers = NULL, *out = NULL, *type = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--all")) all = 1;
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) layers = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else if (!strcmp(argv[i], "--type") && i + 1 < argc) type = argv[++i];
        else if (!strcmp(argv[i], "--force")) force = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            model_usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "baton model %s: unknown option '%s'\n", sub, argv[i]);
            return 2;
        } else if (!path) path = argv[i];
        else {
            fprintf(stderr, "baton model %s: unexpected argument '%s'\n", sub, argv[i]);
            return 2;
        }
    }
    char def[4096];
    if (!strcmp(sub, "fetch")) return model_fetch(force, path);
    if (!path) {
        if (bt_default_model_path(def, sizeof def)) {
            fprintf(stderr, "baton model: %s\n", bt_last_error());
            return 1;
        }
        path = def;
    }
    if (!strcmp(sub, "path")) {
        puts(path);
        return access(path, R_OK) == 0 ? 0 : 1;
    }
    if (!strcmp(sub, "slice")) return model_slice(path, layers, out);
    if (!strcmp(sub, "quantize")) return model_quantize(path, type, out);
    if (!strcmp(sub, "inspect")) {
        if (path == def && access(path, R_OK) != 0) {
            fprintf(stderr, "baton model inspect: the default model is not cached at %s; run `baton model fetch`\n", path);
            return 1;
        }
        return model_inspect(path, all);
    }
    fprintf(stderr, "baton model: unknown subcommand '%s'\n", sub);
    model_usage(stderr);
    return 2;
}
