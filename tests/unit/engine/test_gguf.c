/* engine/gguf.c and engine/gguf_writer.c: round trips, the real model, and handcrafted malformed files.
 * Malformed inputs are parsed from exact-size heap buffers so ASan flags any read past the end. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/ggml_type.h"
#include "engine/gguf.h"
#include "engine/gguf_writer.h"
#include "test_util.h"

/* ---- a tiny byte builder for handcrafted files ---- */

typedef struct bb {
    uint8_t *p;
    size_t len, cap;
} bb;

static void bb_put(bb *b, const void *d, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->len, d, n);
    b->len += n;
}
static void bb_u8(bb *b, uint8_t v) { bb_put(b, &v, 1); }
static void bb_u32(bb *b, uint32_t v) { bb_put(b, &v, 4); }
static void bb_u64(bb *b, uint64_t v) { bb_put(b, &v, 8); }
static void bb_str(bb *b, const char *s) { bb_u64(b, strlen(s)); bb_put(b, s, strlen(s)); }
static void bb_pad(bb *b, size_t a) { while (b->len % a) bb_u8(b, 0); }

static void bb_header(bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    bb_put(b, "GGUF", 4);
    bb_u32(b, version);
    bb_u64(b, n_tensors);
    bb_u64(b, n_kv);
}

static void bb_kv_u32(bb *b, const char *key, uint32_t v) { bb_str(b, key); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, v); }
static void bb_kv_str(bb *b, const char *key, const char *v) { bb_str(b, key); bb_u32(b, GGUF_VT_STRING); bb_str(b, v); }

/* tensor info with n_dims dims */
static void bb_tinfo(bb *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t off)
{
    bb_str(b, name);
    bb_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) bb_u64(b, ne[d]);
    bb_u32(b, type);
    bb_u64(b, off);
}

/* A valid file: 3 kvs (string, u32, string array) and 2 F32 tensors of 8 and 4x2 elements. */
static bb valid_file(void)
{
    bb b = {0};
    bb_header(&b, 3, 2, 3);
    bb_kv_str(&b, "general.architecture", "llama");
    bb_kv_u32(&b, "llama.block_count", 2);
    bb_str(&b, "tokenizer.ggml.tokens");
    bb_u32(&b, GGUF_VT_ARRAY);
    bb_u32(&b, GGUF_VT_STRING);
    bb_u64(&b, 3);
    bb_str(&b, "a");
    bb_str(&b, "bc");
    bb_str(&b, "");
    uint64_t ne1[1] = {8}, ne2[2] = {4, 2};
    bb_tinfo(&b, "t0", 1, ne1, BT_TYPE_F32, 0);
    bb_tinfo(&b, "t1", 2, ne2, BT_TYPE_F32, 32);
    bb_pad(&b, 32);
    for (int i = 0; i < 16; i++) {
        float v = (float)i;
        bb_put(&b, &v, 4);
    }
    return b;
}

/* Parses an exact-size copy; returns the status and closes any handle. */
static bt_status parse_exact(const uint8_t *p, size_t n)
{
    uint8_t *copy = malloc(n ? n : 1);
    if (n) memcpy(copy, p, n);
    gguf_file *f = NULL;
    bt_clear_error();
    bt_status st = gguf_open_memory(copy, n, &f);
    gguf_close(f);
    free(copy);
    return st;
}

static void test_valid_handcrafted(void)
{
    bb b = valid_file();
    gguf_file *f = NULL;
    REQUIRE(gguf_open_memory(b.p, b.len, &f) == BT_OK);
    CHECK(gguf_version(f) == 3);
    CHECK(gguf_n_kv(f) == 3);
    CHECK(gguf_n_tensors(f) == 2);
    gguf_str s;
    CHECK(gguf_get_str(f, "general.architecture", &s) == BT_OK && gguf_str_eq(s, "llama"));
    uint32_t u;
    CHECK(gguf_get_u32(f, "llama.block_count", &u) == BT_OK && u == 2);
    const gguf_kv *arr;
    REQUIRE(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &arr) == BT_OK);
    CHECK(arr->arr_len == 3);
    CHECK(gguf_str_eq(gguf_arr_str(arr, 0), "a"));
    CHECK(gguf_str_eq(gguf_arr_str(arr, 1), "bc"));
    CHECK(gguf_str_eq(gguf_arr_str(arr, 2), ""));
    CHECK(gguf_arr_str(arr, 3).len == 0);
    const gguf_tensor *t1 = gguf_find_tensor(f, "t1");
    REQUIRE(t1 != NULL);
    CHECK(t1->n_dims == 2 && t1->ne[0] == 4 && t1->ne[1] == 2 && t1->ne[2] == 1 && t1->n_bytes == 32);
    float v;
    memcpy(&v, t1->data, 4);
    CHECK(v == 8.0f);
    CHECK(gguf_find_tensor(f, "t2") == NULL);
    /* getters with the wrong type or a missing key */
    CHECK(gguf_get_u32(f, "general.architecture", &u) == BT_ERR_FORMAT);
    CHECK(strstr(bt_last_error(), "general.architecture") != NULL);
    CHECK(gguf_get_u32(f, "nope", &u) == BT_ERR_NOT_FOUND);
    CHECK(gguf_get_str(f, "llama.block_count", &s) == BT_ERR_FORMAT);
    CHECK(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_INT32, &arr) == BT_ERR_FORMAT);
    float fl;
    CHECK(gguf_get_f32(f, "llama.block_count", &fl) == BT_ERR_FORMAT);
    gguf_close(f);
    free(b.p);
}

/* Every proper prefix of a valid file is refused with BT_ERR_FORMAT and a message; nothing reads past the end. */
static void test_truncated_everywhere(void)
{
    bb b = valid_file();
    int bad = 0;
    for (size_t n = 0; n < b.len; n++) {
        bt_status st = parse_exact(b.p, n);
        if (st != BT_ERR_FORMAT || bt_last_error()[0] == '\0') {
            bad++;
            fprintf(stderr, "prefix of %zu bytes: status %d '%s'\n", n, st, bt_last_error());
        }
    }
    CHECK_MSG(bad == 0, "%d of %zu truncations were not refused", bad, b.len);
    CHECK(parse_exact(b.p, b.len) == BT_OK);
    free(b.p);
}

typedef struct bad_case {
    const char *name;
    bb b;
    bt_status want;
    const char *msg; /* a substring the error must contain */
} bad_case;

#define MAX_CASES 96
static bad_case cases[MAX_CASES];
static int n_cases;

static bb *add_case(const char *name, bt_status want, const char *msg)
{
    bad_case *c = &cases[n_cases++];
    c->name = name;
    c->want = want;
    c->msg = msg;
    memset(&c->b, 0, sizeof c->b);
    return &c->b;
}

/* File with header and one kv whose body the caller writes after this returns. */
static bb *kv_case(const char *name, const char *msg)
{
    bb *b = add_case(name, BT_ERR_FORMAT, msg);
    bb_header(b, 3, 0, 1);
    return b;
}

/* File with no kvs and one tensor info written by the caller, then data. */
static bb *tensor_case(const char *name, const char *msg)
{
    bb *b = add_case(name, BT_ERR_FORMAT, msg);
    bb_header(b, 3, 1, 0);
    return b;
}

static void tensor_data(bb *b, size_t n)
{
    bb_pad(b, 32);
    for (size_t i = 0; i < n; i++) bb_u8(b, 0);
}

static void build_cases(void)
{
    bb *b;
    uint64_t ne8[1] = {8};

    b = add_case("empty buffer", BT_ERR_FORMAT, "magic"); (void)b;
    b = add_case("bad magic", BT_ERR_FORMAT, "magic"); bb_put(b, "GGML", 4); bb_u32(b, 3); bb_u64(b, 0); bb_u64(b, 0);
    b = add_case("lowercase magic", BT_ERR_FORMAT, "magic"); bb_put(b, "gguf", 4); bb_u32(b, 3); bb_u64(b, 0); bb_u64(b, 0);
    b = add_case("version 0", BT_ERR_UNSUPPORTED, "version"); bb_header(b, 0, 0, 0);
    b = add_case("version 1", BT_ERR_UNSUPPORTED, "version 1"); bb_header(b, 1, 0, 0);
    b = add_case("version 4", BT_ERR_UNSUPPORTED, "version 4"); bb_header(b, 4, 0, 0);
    b = add_case("big-endian v3", BT_ERR_UNSUPPORTED, "big-endian"); bb_header(b, 0x03000000u, 0, 0);
    b = add_case("huge kv count", BT_ERR_FORMAT, "metadata entries"); bb_header(b, 3, 0, UINT64_MAX);
    b = add_case("kv count 2^40", BT_ERR_FORMAT, "metadata entries"); bb_header(b, 3, 0, 1ull << 40);
    b = add_case("huge tensor count", BT_ERR_FORMAT, "tensors"); bb_header(b, 3, UINT64_MAX, 0);
    b = add_case("tensor count 2^33", BT_ERR_FORMAT, "tensors"); bb_header(b, 3, 1ull << 33, 0); bb_u64(b, 0);
    b = add_case("kv count larger than entries", BT_ERR_FORMAT, "truncated"); bb_header(b, 3, 0, 3);
    bb_kv_u32(b, "a.b", 1); bb_str(b, "c.d"); bb_u32(b, GGUF_VT_STRING); bb_u64(b, 0); bb_u8(b, 0);

    b = kv_case("key length huge", "claims"); bb_u64(b, UINT64_MAX); bb_u32(b, 4); bb_u32(b, 0);
    b = kv_case("key length past end", "claims"); bb_u64(b, 1000); bb_put(b, "abc", 3);
    b = kv_case("key empty", "empty"); bb_u64(b, 0); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key with NUL", "UTF-8"); bb_u64(b, 3); bb_put(b, "a\0b", 3); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key invalid UTF-8 byte", "UTF-8"); bb_u64(b, 3); bb_put(b, "a\xffz", 3); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key overlong UTF-8", "UTF-8"); bb_u64(b, 3); bb_put(b, "a\xc0\xaf", 3); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key truncated UTF-8", "UTF-8"); bb_u64(b, 2); bb_put(b, "a\xe2", 2); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key UTF-16 surrogate", "UTF-8"); bb_u64(b, 3); bb_put(b, "\xed\xa0\x80", 3); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("key too long", "long"); bb_u64(b, 70000); for (int i = 0; i < 70000; i++) bb_u8(b, 'k'); bb_u32(b, GGUF_VT_UINT32); bb_u32(b, 1);
    b = kv_case("unknown value type 13", "unknown value type"); bb_str(b, "k"); bb_u32(b, 13); bb_u32(b, 1);
    b = kv_case("unknown value type huge", "unknown value type"); bb_str(b, "k"); bb_u32(b, 0xffffffffu); bb_u32(b, 1);
    b = kv_case("bool value 2", "bool"); bb_str(b, "k"); bb_u32(b, GGUF_VT_BOOL); bb_u8(b, 2);
    b = kv_case("u64 value truncated", "truncated"); bb_str(b, "k"); bb_u32(b, GGUF_VT_UINT64); bb_u32(b, 1);
    b = kv_case("string value length huge", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_STRING); bb_u64(b, UINT64_MAX - 3);
    b = kv_case("string value past end", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_STRING); bb_u64(b, 50); bb_put(b, "xyz", 3);
    b = kv_case("nested array", "nests"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_ARRAY); bb_u64(b, 1);
    b = kv_case("array unknown element type", "unknown element type"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, 77); bb_u64(b, 1);
    b = kv_case("int32 array count huge", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_INT32); bb_u64(b, UINT64_MAX / 2);
    b = kv_case("int32 array count overflowing size", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_INT32); bb_u64(b, (1ull << 62) + 1); bb_u32(b, 0);
    b = kv_case("f64 array short", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_FLOAT64); bb_u64(b, 3); bb_u64(b, 0);
    b = kv_case("string array count huge", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_STRING); bb_u64(b, 1ull << 60);
    b = kv_case("string array element past end", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_STRING); bb_u64(b, 2); bb_str(b, "ok"); bb_u64(b, 1ull << 50);
    b = kv_case("string array missing elements", "claims"); bb_str(b, "k"); bb_u32(b, GGUF_VT_ARRAY); bb_u32(b, GGUF_VT_STRING); bb_u64(b, 3); bb_str(b, "a"); bb_str(b, "b");
    b = add_case("duplicate key", BT_ERR_FORMAT, "twice"); bb_header(b, 3, 0, 2); bb_kv_u32(b, "x.y", 1); bb_kv_u32(b, "x.y", 2);
    b = add_case("alignment zero", BT_ERR_FORMAT, "alignment"); bb_header(b, 3, 0, 1); bb_kv_u32(b, "general.alignment", 0);
    b = add_case("alignment not power of two", BT_ERR_FORMAT, "alignment"); bb_header(b, 3, 0, 1); bb_kv_u32(b, "general.alignment", 48);
    b = add_case("alignment huge", BT_ERR_FORMAT, "alignment"); bb_header(b, 3, 0, 1); bb_kv_u32(b, "general.alignment", 1u << 31);
    b = add_case("alignment wrong type", BT_ERR_FORMAT, "alignment"); bb_header(b, 3, 0, 1); bb_kv_str(b, "general.alignment", "32");

    b = tensor_case("tensor name empty", "empty"); bb_tinfo(b, "", 1, ne8, BT_TYPE_F32, 0); tensor_data(b, 32);
    b = tensor_case("tensor name invalid UTF-8", "UTF-8"); bb_tinfo(b, "w\xfe", 1, ne8, BT_TYPE_F32, 0); tensor_data(b, 32);
    b = tensor_case("tensor name length huge", "claims"); bb_u64(b, 1ull << 62); bb_u32(b, 1);
    b = tensor_case("tensor 0 dims", "dimensions"); bb_tinfo(b, "w", 0, ne8, BT_TYPE_F32, 0); tensor_data(b, 32);
    b = tensor_case("tensor 5 dims", "dimensions"); { uint64_t ne[5] = {1, 1, 1, 1, 1}; bb_tinfo(b, "w", 5, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor 2^32 dims", "dimensions"); bb_str(b, "w"); bb_u32(b, 0xffffffffu); bb_u64(b, 8); tensor_data(b, 64);
    b = tensor_case("tensor dim zero", "invalid dimension"); { uint64_t ne[2] = {8, 0}; bb_tinfo(b, "w", 2, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor dim negative", "invalid dimension"); { uint64_t ne[1] = {(uint64_t)-8}; bb_tinfo(b, "w", 1, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor dims product overflows", "overflows"); { uint64_t ne[4] = {1ull << 32, 1ull << 32, 4, 1}; bb_tinfo(b, "w", 4, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor dims product just over int64", "overflows"); { uint64_t ne[2] = {1ull << 32, 1ull << 31}; bb_tinfo(b, "w", 2, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor byte size overflows", "overflows"); { uint64_t ne[2] = {1ull << 31, 1ull << 31}; bb_tinfo(b, "w", 2, ne, BT_TYPE_F64, 0); } tensor_data(b, 32);
    b = tensor_case("tensor too big for file", "extends past"); { uint64_t ne[2] = {1ull << 20, 1ull << 20}; bb_tinfo(b, "w", 2, ne, BT_TYPE_F32, 0); } tensor_data(b, 32);
    b = tensor_case("tensor unknown type 99", "unknown type"); bb_tinfo(b, "w", 1, ne8, 99, 0); tensor_data(b, 32);
    b = tensor_case("tensor removed type 4 (Q4_2)", "unknown type"); bb_tinfo(b, "w", 1, ne8, 4, 0); tensor_data(b, 32);
    b = tensor_case("tensor type huge", "unknown type"); bb_tinfo(b, "w", 1, ne8, 0x80000000u, 0); tensor_data(b, 32);
    b = tensor_case("Q4_0 row not a block multiple", "multiple"); { uint64_t ne[1] = {48}; bb_tinfo(b, "w", 1, ne, BT_TYPE_Q4_0, 0); } tensor_data(b, 64);
    b = tensor_case("Q4_K row not a super-block multiple", "multiple"); { uint64_t ne[1] = {32}; bb_tinfo(b, "w", 1, ne, BT_TYPE_Q4_K, 0); } tensor_data(b, 200);
    b = tensor_case("tensor offset misaligned", "alignment"); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 4); tensor_data(b, 64);
    b = tensor_case("tensor offset past end", "extends past"); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 1ull << 40); tensor_data(b, 32);
    b = tensor_case("tensor offset near 2^64", "extends past"); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, UINT64_MAX - 31); tensor_data(b, 32);
    b = tensor_case("tensor data truncated", "extends past"); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 0); tensor_data(b, 31);
    b = tensor_case("data section missing", "beyond the end"); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 0);
    b = tensor_case("tensor info truncated after dims", "truncated"); bb_str(b, "w"); bb_u32(b, 2); bb_u64(b, 8); bb_u64(b, 8); bb_u32(b, 0); bb_u32(b, 0);
    b = add_case("duplicate tensor", BT_ERR_FORMAT, "twice"); bb_header(b, 3, 2, 0);
    bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 0); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 32); tensor_data(b, 64);
    b = add_case("second tensor past end", BT_ERR_FORMAT, "extends past"); bb_header(b, 3, 2, 0);
    bb_tinfo(b, "a", 1, ne8, BT_TYPE_F32, 0); bb_tinfo(b, "b", 1, ne8, BT_TYPE_F32, 32); tensor_data(b, 40);
    b = add_case("custom alignment misaligned offset", BT_ERR_FORMAT, "alignment"); bb_header(b, 3, 1, 1);
    bb_kv_u32(b, "general.alignment", 64); bb_tinfo(b, "w", 1, ne8, BT_TYPE_F32, 32); bb_pad(b, 64); for (int i = 0; i < 128; i++) bb_u8(b, 0);
}

static void test_malformed_cases(void)
{
    build_cases();
    CHECK_MSG(n_cases >= 50, "only %d handcrafted cases", n_cases);
    for (int i = 0; i < n_cases; i++) {
        bad_case *c = &cases[i];
        bt_status st = parse_exact(c->b.p, c->b.len);
        const char *msg = bt_last_error();
        int ok = st == c->want && msg[0] && strstr(msg, c->msg) && !strchr(msg, '\n');
        CHECK_MSG(ok, "case '%s': status %d (want %d), message '%s' (want '%s')", c->name, st, c->want, msg, c->msg);
        free(c->b.p);
    }
}

static void test_open_errors(void)
{
    gguf_file *f = NULL;
    CHECK(gguf_open("/nonexistent/model.gguf", &f) == BT_ERR_IO);
    CHECK(strstr(bt_last_error(), "/nonexistent/model.gguf") != NULL);
    CHECK(gguf_open(test_tmpdir(), &f) == BT_ERR_IO);
    char path[512];
    snprintf(path, sizeof path, "%s/empty.gguf", test_tmpdir());
    REQUIRE(test_write_file(path, "", 0) == 0);
    CHECK(gguf_open(path, &f) == BT_ERR_FORMAT);
    CHECK(strstr(bt_last_error(), "empty") != NULL);
    snprintf(path, sizeof path, "%s/text.gguf", test_tmpdir());
    REQUIRE(test_write_file(path, "hello world, not a model\n", 25) == 0);
    CHECK(gguf_open(path, &f) == BT_ERR_FORMAT);
    CHECK(strstr(bt_last_error(), "text.gguf") != NULL && strstr(bt_last_error(), "magic") != NULL);
    CHECK(f == NULL);
}

static void test_writer_round_trip(void)
{
    gguf_writer *w = gguf_writer_create();
    REQUIRE(w != NULL);
    CHECK(gguf_writer_set_alignment(w, 64) == BT_OK);
    CHECK(gguf_writer_add_str(w, "general.architecture", "llama") == BT_OK);
    CHECK(gguf_writer_add_u32(w, "llama.block_count", 3) == BT_OK);
    CHECK(gguf_writer_add_i32(w, "x.neg", -5) == BT_OK);
    CHECK(gguf_writer_add_u64(w, "x.big", 1ull << 40) == BT_OK);
    CHECK(gguf_writer_add_f32(w, "x.f", 0.5f) == BT_OK);
    CHECK(gguf_writer_add_bool(w, "x.b", 1) == BT_OK);
    const char *toks[] = {"<s>", "h\xc3\xa9llo", ""};
    CHECK(gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", toks, NULL, 3) == BT_OK);
    int32_t types[] = {3, 1, -1};
    CHECK(gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", types, 3) == BT_OK);
    float scores[] = {0.f, -1.5f, 2.f};
    CHECK(gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", scores, 3) == BT_OK);
    CHECK(gguf_writer_add_u32(w, "llama.block_count", 4) == BT_ERR_INVALID); /* duplicate */

    uint64_t ne_a[2] = {32, 3};
    uint8_t qa[3 * 20];
    for (size_t i = 0; i < sizeof qa; i++) qa[i] = (uint8_t)(i * 7);
    CHECK(gguf_writer_add_tensor(w, "blk.0.w", BT_TYPE_Q4_1, 2, ne_a, qa, sizeof qa) == BT_OK);
    float fb[5] = {1, 2, 3, 4, 5};
    uint64_t ne_b[1] = {5};
    CHECK(gguf_writer_add_tensor(w, "norm", BT_TYPE_F32, 1, ne_b, fb, sizeof fb) == BT_OK);
    CHECK(gguf_writer_add_tensor(w, "bad", BT_TYPE_Q4_0, 1, ne_b, fb, sizeof fb) == BT_ERR_INVALID);
    CHECK(gguf_writer_add_tensor(w, "norm", BT_TYPE_F32, 1, ne_b, fb, sizeof fb) == BT_ERR_INVALID);
    CHECK(gguf_writer_add_tensor(w, "short", BT_TYPE_F32, 1, ne_b, fb, 8) == BT_ERR_INVALID);

    char path[512];
    snprintf(path, sizeof path, "%s/rt.gguf", test_tmpdir());
    REQUIRE(gguf_writer_write_file(w, path) == BT_OK);
    gguf_writer_free(w);

    gguf_file *f = NULL;
    REQUIRE(gguf_open(path, &f) == BT_OK);
    CHECK(gguf_alignment(f) == 64);
    uint32_t u;
    int64_t i64;
    uint64_t u64;
    float fl;
    int bl;
    gguf_str s;
    CHECK(gguf_get_u32(f, "llama.block_count", &u) == BT_OK && u == 3);
    CHECK(gguf_get_i64(f, "x.neg", &i64) == BT_OK && i64 == -5);
    CHECK(gguf_get_u64(f, "x.neg", &u64) == BT_ERR_FORMAT);
    CHECK(gguf_get_u64(f, "x.big", &u64) == BT_OK && u64 == (1ull << 40));
    CHECK(gguf_get_u32(f, "x.big", &u) == BT_ERR_FORMAT);
    CHECK(gguf_get_f32(f, "x.f", &fl) == BT_OK && fl == 0.5f);
    CHECK(gguf_get_bool(f, "x.b", &bl) == BT_OK && bl == 1);
    CHECK(gguf_get_str(f, "general.architecture", &s) == BT_OK && gguf_str_eq(s, "llama"));
    const gguf_kv *kv;
    REQUIRE(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &kv) == BT_OK);
    CHECK(kv->arr_len == 3 && gguf_str_eq(gguf_arr_str(kv, 1), "h\xc3\xa9llo") && gguf_arr_str(kv, 2).len == 0);
    REQUIRE(gguf_get_arr(f, "tokenizer.ggml.token_type", GGUF_VT_INT32, &kv) == BT_OK);
    CHECK(gguf_arr_int(kv, 0) == 3 && gguf_arr_int(kv, 2) == -1 && gguf_arr_int(kv, 3) == 0);
    REQUIRE(gguf_get_arr(f, "tokenizer.ggml.scores", GGUF_VT_FLOAT32, &kv) == BT_OK);
    CHECK(gguf_arr_float(kv, 1) == -1.5);
    const gguf_tensor *t = gguf_find_tensor(f, "blk.0.w");
    REQUIRE(t != NULL);
    CHECK(t->type == BT_TYPE_Q4_1 && t->ne[0] == 32 && t->ne[1] == 3 && t->n_bytes == sizeof qa);
    CHECK(memcmp(t->data, qa, sizeof qa) == 0);
    CHECK(((uintptr_t)t->data - (uintptr_t)gguf_tensor_at(f, 0)->data) % 64 == 0);
    t = gguf_find_tensor(f, "norm");
    REQUIRE(t != NULL);
    CHECK(t->offset % 64 == 0 && memcmp(t->data, fb, sizeof fb) == 0);
    /* the fingerprint is a pure function of the bytes: a second open agrees, a changed weight does not */
    uint64_t fp = gguf_fingerprint(f);
    gguf_close(f);
    REQUIRE(gguf_open(path, &f) == BT_OK);
    CHECK(gguf_fingerprint(f) == fp);
    gguf_close(f);
    FILE *fp_file = fopen(path, "r+b");
    REQUIRE(fp_file != NULL);
    fseek(fp_file, -1, SEEK_END);
    fputc(0x7f, fp_file);
    fclose(fp_file);
    REQUIRE(gguf_open(path, &f) == BT_OK);
    CHECK(gguf_fingerprint(f) != fp);
    gguf_close(f);
}

static void test_default_model_file(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("test_default_model_file: default model not cached (run deploy/fetch-model.sh)");
        return;
    }
    gguf_file *f = NULL;
    REQUIRE(gguf_open(path, &f) == BT_OK);
    uint32_t v;
    gguf_str s;
    CHECK(gguf_get_str(f, "general.architecture", &s) == BT_OK && gguf_str_eq(s, "llama"));
    CHECK(gguf_get_u32(f, "llama.block_count", &v) == BT_OK && v == 30);
    CHECK(gguf_get_u32(f, "llama.embedding_length", &v) == BT_OK && v == 576);
    CHECK(gguf_get_u32(f, "llama.attention.head_count", &v) == BT_OK && v == 9);
    CHECK(gguf_get_u32(f, "llama.attention.head_count_kv", &v) == BT_OK && v == 3);
    const gguf_kv *toks;
    CHECK(gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &toks) == BT_OK && toks->arr_len == 49152);
    CHECK(gguf_n_tensors(f) == 272);
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    REQUIRE(emb != NULL);
    CHECK(emb->type == BT_TYPE_Q8_0 && emb->ne[0] == 576 && emb->ne[1] == 49152);
    const gguf_tensor *q = gguf_find_tensor(f, "blk.29.attn_q.weight");
    REQUIRE(q != NULL);
    CHECK(q->type == BT_TYPE_Q4_1 && q->ne[0] == 576 && q->ne[1] == 576);
    gguf_close(f);

    /* The real file cut short at section boundaries and mid-tensor: refused, never crashes. */
    FILE *fp = fopen(path, "rb");
    REQUIRE(fp != NULL);
    size_t head = 2 * 1024 * 1024;
    uint8_t *buf = malloc(head);
    size_t got = fread(buf, 1, head, fp);
    fclose(fp);
    CHECK(got == head);
    size_t cuts[] = {3, 4, 8, 24, 100, 1000, 50000, 1785000, 1785664, 1785665, 2000000};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++)
        CHECK_MSG(parse_exact(buf, cuts[i]) == BT_ERR_FORMAT, "cut at %zu", cuts[i]);
    free(buf);
}

static void test_type_table(void)
{
    CHECK(bt_ggml_type_get(BT_TYPE_Q4_1)->block_bytes == 20);
    CHECK(bt_ggml_type_get(BT_TYPE_Q6_K)->block_elems == 256);
    CHECK(bt_ggml_type_get(4) == NULL);
    CHECK(bt_ggml_type_get(1000) == NULL);
    CHECK(bt_ggml_type_from_name("q8_0") == BT_TYPE_Q8_0);
    CHECK(bt_ggml_type_from_name("nope") == -1);
    CHECK(strcmp(bt_ggml_type_name(99), "unknown") == 0);
}

int main(void)
{
    RUN(test_valid_handcrafted);
    RUN(test_truncated_everywhere);
    RUN(test_malformed_cases);
    RUN(test_open_errors);
    RUN(test_writer_round_trip);
    RUN(test_default_model_file);
    RUN(test_type_table);
    return test_summary();
}
