/* engine/tokenizer on tiny vocabularies written with the GGUF writer, and on the default model when cached.
 * Agreement with the Hugging Face tokenizer over a large corpus is tests/integration/test_tokenizer_hf.py. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/gguf.h"
#include "engine/gguf_writer.h"
#include "engine/tokenizer.h"
#include "engine/unicode.h"
#include "test_util.h"

/* ---- building tiny tokenizers ---- */

typedef struct vocab_builder {
    char *tok[600];
    int32_t type[600];
    float score[600];
    int n;
    char *merges[64];
    int n_merges;
    int no_space_prefix; /* writes tokenizer.ggml.add_space_prefix = false (Gemma) */
} vocab_builder;

static int vb_add(vocab_builder *v, const char *s, int32_t type, float score)
{
    v->tok[v->n] = strdup(s);
    v->type[v->n] = type;
    v->score[v->n] = score;
    return v->n++;
}

static void vb_free(vocab_builder *v)
{
    for (int i = 0; i < v->n; i++) free(v->tok[i]);
    for (int i = 0; i < v->n_merges; i++) free(v->merges[i]);
}

/* The GPT-2 byte alphabet spelling of byte b, as UTF-8. */
static void byte_spelling(unsigned b, char out[4])
{
    unsigned k = 0, cp = b;
    int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    if (!printable) {
        for (unsigned x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE))) k++;
        cp = 0x100 + k;
    }
    size_t n = uni_utf8_encode(cp, (uint8_t *)out);
    out[n] = 0;
}

/* Writes the vocabulary as GGUF metadata and builds a tokenizer from it; NULL on failure (message printed). */
static tok_tokenizer *vb_build(vocab_builder *v, const char *model, const char *pre, int add_bos, int with_merges,
                               bt_status *st_out)
{
    gguf_writer *w = gguf_writer_create();
    uint8_t *buf = NULL;
    size_t len = 0;
    gguf_file *f = NULL;
    tok_tokenizer *t = NULL;
    bt_status st = BT_ERR_NOMEM;
    if (!w) goto out;
    if ((st = gguf_writer_add_str(w, "general.architecture", "llama"))) goto out;
    if ((st = gguf_writer_add_str(w, "tokenizer.ggml.model", model))) goto out;
    if (pre && (st = gguf_writer_add_str(w, "tokenizer.ggml.pre", pre))) goto out;
    if ((st = gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->tok, NULL, (uint64_t)v->n)))
        goto out;
    if ((st = gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", v->type, (uint64_t)v->n))) goto out;
    if ((st = gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", v->score, (uint64_t)v->n))) goto out;
    if (with_merges && (st = gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", (const char *const *)v->merges,
                                                     NULL, (uint64_t)v->n_merges)))
        goto out;
    if ((st = gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1))) goto out;
    if ((st = gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 2))) goto out;
    if ((st = gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", add_bos))) goto out;
    if (v->no_space_prefix && (st = gguf_writer_add_bool(w, "tokenizer.ggml.add_space_prefix", 0))) goto out;
    if ((st = gguf_writer_to_memory(w, &buf, &len))) goto out;
    if ((st = gguf_open_memory(buf, len, &f))) goto out;
    st = tok_create(f, &t);
out:
    if (st && !st_out) fprintf(stderr, "vb_build: %s\n", bt_last_error());
    if (st_out) *st_out = st;
    gguf_close(f);
    free(buf);
    gguf_writer_free(w);
    return t;
}

enum { B_HE = 259, B_LL, B_HELL, B_HELLO, B_GW, B_OR, B_GWOR, B_LD, B_GWORLD, B_APOS_S, B_GG, B_TOOL };

/* Byte-level vocabulary: 0-2 control, 3..258 the 256 bytes, then merged tokens and one user-defined token. */
static void bpe_vocab(vocab_builder *v)
{
    memset(v, 0, sizeof *v);
    vb_add(v, "<|endoftext|>", TOK_TYPE_CONTROL, 0);
    vb_add(v, "<|im_start|>", TOK_TYPE_CONTROL, 0);
    vb_add(v, "<|im_end|>", TOK_TYPE_CONTROL, 0);
    for (unsigned b = 0; b < 256; b++) {
        char s[5];
        byte_spelling(b, s);
        vb_add(v, s, TOK_TYPE_NORMAL, 0);
    }
    static const char *const merged[][3] = {
        {"he", "h", "e"},       {"ll", "l", "l"},      {"hell", "he", "ll"},   {"hello", "hell", "o"},
        {"Ġw", "Ġ", "w"},       {"or", "o", "r"},      {"Ġwor", "Ġw", "or"},   {"ld", "l", "d"},
        {"Ġworld", "Ġwor", "ld"}, {"'s", "'", "s"},    {"ĠĠ", "Ġ", "Ġ"},
    };
    for (size_t i = 0; i < sizeof merged / sizeof merged[0]; i++) {
        vb_add(v, merged[i][0], TOK_TYPE_NORMAL, 0);
        char m[32];
        snprintf(m, sizeof m, "%s %s", merged[i][1], merged[i][2]);
        v->merges[v->n_merges++] = strdup(m);
    }
    vb_add(v, "<tool>", TOK_TYPE_USER_DEFINED, 0);
}

static int ids_eq(const tok_ids *v, const int32_t *want, size_t n)
{
    if (v->n != n) return 0;
    for (size_t i = 0; i < n; i++)
        if (v->ids[i] != want[i]) return 0;
    return 1;
}

static void print_ids(const char *what, const tok_ids *v)
{
    fprintf(stderr, "  %s:", what);
    for (size_t i = 0; i < v->n; i++) fprintf(stderr, " %d", v->ids[i]);
    fputc('\n', stderr);
}

#define EXPECT_IDS(t, text, flags, ...)                                                                 \
    do {                                                                                                \
        static const int32_t want_[] = {__VA_ARGS__};                                                   \
        tok_ids got_ = {0};                                                                             \
        CHECK(tok_encode(t, text, strlen(text), flags, &got_) == BT_OK);                                \
        int ok_ = ids_eq(&got_, want_, sizeof want_ / sizeof want_[0]);                                 \
        CHECK_MSG(ok_, "encode(\"%s\")", text);                                                         \
        if (!ok_) print_ids("got", &got_);                                                              \
        tok_ids_free(&got_);                                                                            \
    } while (0)

static int roundtrip(const tok_tokenizer *t, const char *s, size_t len, unsigned flags)
{
    tok_ids v = {0};
    char *out = NULL;
    size_t ol = 0;
    int ok = tok_encode(t, s, len, flags, &v) == BT_OK && tok_decode(t, v.ids, v.n, 0, &out, &ol) == BT_OK &&
             ol == len && !memcmp(out, s, len);
    free(out);
    tok_ids_free(&v);
    return ok;
}

#define BYTE(b) (3 + (b))

static void test_bpe_basic(void)
{
    vocab_builder v;
    bpe_vocab(&v);
    tok_tokenizer *t = vb_build(&v, "gpt2", "gpt2", 0, 1, NULL);
    REQUIRE(t);
    CHECK(tok_get_model(t) == TOK_MODEL_BPE && tok_get_pre(t) == TOK_PRE_GPT2);
    CHECK(tok_n_vocab(t) == v.n && tok_bos(t) == 1 && tok_eos(t) == 2 && tok_unk(t) == -1);
    EXPECT_IDS(t, "hello world", TOK_PARSE_SPECIAL, B_HELLO, B_GWORLD);
    EXPECT_IDS(t, "hello's", TOK_PARSE_SPECIAL, B_HELLO, B_APOS_S);
    EXPECT_IDS(t, "   world", TOK_PARSE_SPECIAL, B_GG, B_GWORLD);
    EXPECT_IDS(t, "hello\n", TOK_PARSE_SPECIAL, B_HELLO, BYTE('\n'));
    EXPECT_IDS(t, "\xC3\xA9", TOK_PARSE_SPECIAL, BYTE(0xC3), BYTE(0xA9));
    EXPECT_IDS(t, "<|im_start|>hello<|im_end|>", TOK_PARSE_SPECIAL, 1, B_HELLO, 2);
    EXPECT_IDS(t, "hello<tool>", 0, B_HELLO, B_TOOL); /* user-defined tokens always match */
    EXPECT_IDS(t, "<|im_start|", TOK_PARSE_SPECIAL, BYTE('<'), BYTE('|'), BYTE('i'), BYTE('m'), BYTE('_'),
               BYTE('s'), BYTE('t'), BYTE('a'), BYTE('r'), BYTE('t'), BYTE('|'));
    tok_ids e = {0};
    CHECK(tok_encode(t, "", 0, TOK_PARSE_SPECIAL, &e) == BT_OK && e.n == 0);
    tok_ids_free(&e);

    /* Without TOK_PARSE_SPECIAL control strings are text. */
    tok_ids ids = {0};
    CHECK(tok_encode(t, "<|im_start|>", 12, 0, &ids) == BT_OK);
    for (size_t i = 0; i < ids.n; i++) CHECK(ids.ids[i] != 1);
    tok_ids_free(&ids);

    const char *texts[] = {"hello world", "  \t\n x", "caf\xC3\xA9 \xF0\x9F\x98\x80", "<|im_end|><|im_end|>",
                           "a\xFF\xFE b", "\xE4\xBD\xA0\xE5\xA5\xBD", "hello  world  "};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        CHECK_MSG(roundtrip(t, texts[i], strlen(texts[i]), TOK_PARSE_SPECIAL), "roundtrip %zu", i);
    CHECK(roundtrip(t, "a\0b", 3, 0));

    size_t l;
    CHECK(tok_token_piece(t, B_GWORLD, &l) && l == 6 && !memcmp(tok_token_piece(t, B_GWORLD, &l), " world", 6));
    CHECK(tok_token_text(t, B_GWORLD, &l) && l == 7);
    CHECK(tok_find(t, "Ġworld", strlen("Ġworld")) == B_GWORLD && tok_find(t, "nope", 4) == -1);
    CHECK(tok_token_type(t, 1) == TOK_TYPE_CONTROL && tok_token_type(t, -1) == TOK_TYPE_UNDEFINED);
    CHECK(tok_is_eog(t, 2) && !tok_is_eog(t, 1));

    /* decode flags and errors */
    const int32_t seq[] = {1, B_HELLO, 2};
    char *out;
    size_t ol;
    CHECK(tok_decode(t, seq, 3, TOK_SKIP_SPECIAL, &out, &ol) == BT_OK && !strcmp(out, "hello"));
    free(out);
    const int32_t badseq[] = {B_HELLO, 99999};
    CHECK(tok_decode(t, badseq, 2, 0, &out, &ol) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "99999") != NULL);
    tok_free(t);

    /* add_bos from metadata */
    t = vb_build(&v, "gpt2", NULL, 1, 1, NULL);
    REQUIRE(t);
    CHECK(tok_add_bos(t) == 1 && tok_get_pre(t) == TOK_PRE_GPT2);
    EXPECT_IDS(t, "hello", TOK_ADD_SPECIAL, 1, B_HELLO);
    EXPECT_IDS(t, "hello", 0, B_HELLO);
    tok_free(t);
    vb_free(&v);
}

static void test_pre_tokenizers(void)
{
    vocab_builder v;
    bpe_vocab(&v);
    /* llama3 splits digits in threes and lets a non-letter lead a word; gpt2 keeps digit runs whole. */
    tok_tokenizer *g = vb_build(&v, "gpt2", "gpt2", 0, 1, NULL);
    tok_tokenizer *l3 = vb_build(&v, "gpt2", "llama-bpe", 0, 1, NULL);
    tok_tokenizer *q = vb_build(&v, "gpt2", "qwen2", 0, 1, NULL);
    tok_tokenizer *s = vb_build(&v, "gpt2", "smollm", 0, 1, NULL);
    REQUIRE(g && l3 && q && s);
    CHECK(tok_get_pre(l3) == TOK_PRE_LLAMA3 && tok_get_pre(q) == TOK_PRE_QWEN2 && tok_get_pre(s) == TOK_PRE_GPT2);
    /* Pieces are visible through merges: "Ġw" only forms when the space and the w share a piece. */
    EXPECT_IDS(g, "\tworld", 0, BYTE('\t'), BYTE('w'), B_OR, B_LD);
    EXPECT_IDS(l3, "HELLO's", 0, BYTE('H'), BYTE('E'), BYTE('L'), BYTE('L'), BYTE('O'), B_APOS_S);
    EXPECT_IDS(l3, "x'S", 0, BYTE('x'), BYTE('\''), BYTE('S'));
    EXPECT_IDS(g, "x'S", 0, BYTE('x'), BYTE('\''), BYTE('S'));
    EXPECT_IDS(l3, "a\n\n b", 0, BYTE('a'), BYTE('\n'), BYTE('\n'), BYTE(' '), BYTE('b'));
    const char *texts[] = {"12345 6789", "don't STOP'LL", "a\r\n\r\n  b\n", "  \xE4\xB8\xAD\xE6\x96\x87!!\n\n",
                           "x  \t y", "\xC2\xBD\xC2\xB2 1\xD9\xA3"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        CHECK(roundtrip(g, texts[i], strlen(texts[i]), 0));
        CHECK(roundtrip(l3, texts[i], strlen(texts[i]), 0));
        CHECK(roundtrip(q, texts[i], strlen(texts[i]), 0));
    }
    tok_tokenizer *o = vb_build(&v, "gpt2", "llama4", 0, 1, NULL), *k = vb_build(&v, "gpt2", "tekken", 0, 1, NULL);
    REQUIRE(o && k);
    CHECK(tok_get_pre(o) == TOK_PRE_GPT4O && tok_get_pre(k) == TOK_PRE_TEKKEN);
    CHECK(!strcmp(tok_pre_name(TOK_PRE_GPT4O), "gpt-4o"));
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        CHECK(roundtrip(o, texts[i], strlen(texts[i]), 0));
        CHECK(roundtrip(k, texts[i], strlen(texts[i]), 0));
    }
    /* HTTPServer: the upper-then-lower rule splits before the last capital */
    EXPECT_IDS(o, "HTTPServer", 0, BYTE('H'), BYTE('T'), BYTE('T'), BYTE('P'), BYTE('S'), BYTE('e'), BYTE('r'),
               BYTE('v'), BYTE('e'), BYTE('r'));
    tok_free(o);
    tok_free(k);
    tok_free(g);
    tok_free(l3);
    tok_free(q);
    tok_free(s);

    bt_status st;
    CHECK(vb_build(&v, "gpt2", "no-such-pre", 0, 1, &st) == NULL && st == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "no-such-pre") != NULL);
    CHECK(vb_build(&v, "bert", NULL, 0, 1, &st) == NULL && st == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "bert") != NULL);
    CHECK(vb_build(&v, "gpt2", NULL, 0, 0, &st) == NULL && st == BT_ERR_NOT_FOUND); /* no merges */
    v.merges[v.n_merges++] = strdup("q zz");
    CHECK(vb_build(&v, "gpt2", NULL, 0, 1, &st) == NULL && st == BT_ERR_FORMAT);
    CHECK(strstr(bt_last_error(), "q zz") != NULL);
    vb_free(&v);
}

static void test_stream(void)
{
    vocab_builder v;
    bpe_vocab(&v);
    tok_tokenizer *t = vb_build(&v, "gpt2", "gpt2", 0, 1, NULL);
    REQUIRE(t);
    tok_stream s;
    tok_stream_init(&s, t, 0);
    const char *out;
    size_t n;
    CHECK(tok_stream_push(&s, B_HELLO, &out, &n) == BT_OK && n == 5 && !memcmp(out, "hello", 5));
    /* 😀 = F0 9F 98 80, fed one byte token at a time: nothing until the last byte */
    CHECK(tok_stream_push(&s, BYTE(0xF0), &out, &n) == BT_OK && n == 0);
    CHECK(tok_stream_push(&s, BYTE(0x9F), &out, &n) == BT_OK && n == 0);
    CHECK(tok_stream_push(&s, BYTE(0x98), &out, &n) == BT_OK && n == 0);
    CHECK(tok_stream_push(&s, BYTE(0x80), &out, &n) == BT_OK && n == 4 && !memcmp(out, "\xF0\x9F\x98\x80", 4));
    /* an invalid byte comes out as U+FFFD at once; an interrupted sequence too */
    CHECK(tok_stream_push(&s, BYTE(0xFF), &out, &n) == BT_OK && n == 3 && !memcmp(out, "\xEF\xBF\xBD", 3));
    CHECK(tok_stream_push(&s, BYTE(0xC3), &out, &n) == BT_OK && n == 0);
    CHECK(tok_stream_push(&s, BYTE('a'), &out, &n) == BT_OK && n == 4 && !memcmp(out, "\xEF\xBF\xBD" "a", 4));
    CHECK(tok_stream_push(&s, 99999, &out, &n) == BT_ERR_INVALID);
    CHECK(tok_stream_push(&s, BYTE(0xE4), &out, &n) == BT_OK && n == 0);
    tok_stream_flush(&s, &out, &n);
    CHECK(n == 3 && !memcmp(out, "\xEF\xBF\xBD", 3));
    tok_stream_flush(&s, &out, &n);
    CHECK(n == 0);
    tok_stream_free(&s);

    tok_stream_init(&s, t, TOK_SKIP_SPECIAL);
    CHECK(tok_stream_push(&s, 1, &out, &n) == BT_OK && n == 0);
    tok_stream_free(&s);
    tok_free(t);
    vb_free(&v);
}

/* SentencePiece-style: merges come from scores; spaces are U+2581; bytes fall back to <0xXX>. */
static void test_spm(void)
{
    vocab_builder v;
    memset(&v, 0, sizeof v);
    vb_add(&v, "<unk>", TOK_TYPE_UNKNOWN, 0);
    vb_add(&v, "<s>", TOK_TYPE_CONTROL, 0);
    vb_add(&v, "</s>", TOK_TYPE_CONTROL, 0);
    for (unsigned b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        vb_add(&v, s, TOK_TYPE_BYTE, 0);
    }
    int meta = vb_add(&v, "\xE2\x96\x81", TOK_TYPE_NORMAL, -10);
    int h = vb_add(&v, "h", TOK_TYPE_NORMAL, -20), e = vb_add(&v, "e", TOK_TYPE_NORMAL, -20);
    int l = vb_add(&v, "l", TOK_TYPE_NORMAL, -20), o = vb_add(&v, "o", TOK_TYPE_NORMAL, -20);
    vb_add(&v, "he", TOK_TYPE_NORMAL, -1);
    vb_add(&v, "ll", TOK_TYPE_NORMAL, -2);
    vb_add(&v, "hell", TOK_TYPE_NORMAL, -3);
    int hello = vb_add(&v, "hello", TOK_TYPE_NORMAL, -4);
    int mh = vb_add(&v, "\xE2\x96\x81h", TOK_TYPE_NORMAL, -5);
    int mhello = vb_add(&v, "\xE2\x96\x81hello", TOK_TYPE_NORMAL, -6);
    tok_tokenizer *t = vb_build(&v, "llama", NULL, 1, 0, NULL);
    REQUIRE(t);
    CHECK(tok_get_model(t) == TOK_MODEL_SPM && tok_add_bos(t) == 1);
    tok_ids ids = {0};
    CHECK(tok_encode(t, "hello", 5, 0, &ids) == BT_OK && ids.n == 1 && ids.ids[0] == mhello);
    ids.n = 0;
    CHECK(tok_encode(t, " hello hello", 12, TOK_ADD_SPECIAL, &ids) == BT_OK && ids.n == 3 && ids.ids[0] == 1 &&
          ids.ids[1] == mhello && ids.ids[2] == mhello);
    ids.n = 0;
    /* after a special token no U+2581 is prepended */
    CHECK(tok_encode(t, "<s>hello", 8, TOK_PARSE_SPECIAL, &ids) == BT_OK && ids.n == 2 && ids.ids[0] == 1 &&
          ids.ids[1] == hello);
    ids.n = 0;
    CHECK(tok_encode(t, "\xC3\xA9h", 3, 0, &ids) == BT_OK && ids.n == 4 && ids.ids[0] == meta &&
          ids.ids[1] == 3 + 0xC3 && ids.ids[2] == 3 + 0xA9 && ids.ids[3] == h);
    char *out;
    size_t ol;
    CHECK(tok_decode(t, ids.ids, ids.n, 0, &out, &ol) == BT_OK && !strcmp(out, "\xC3\xA9h"));
    free(out);
    ids.n = 0;
    CHECK(tok_encode(t, "oleh", 4, 0, &ids) == BT_OK && ids.n == 5 && ids.ids[1] == o && ids.ids[2] == l &&
          ids.ids[3] == e && ids.ids[4] == h);
    (void)mh;
    const char *texts[] = {"hello", "hello  hello ", "\xE4\xBD\xA0 hello\n", "ol\xC3\xA9"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        CHECK_MSG(roundtrip(t, texts[i], strlen(texts[i]), 0), "spm roundtrip %zu", i);
    /* streaming drops the same leading space as decode */
    tok_stream s;
    tok_stream_init(&s, t, 0);
    const char *so;
    size_t sn;
    CHECK(tok_stream_push(&s, mhello, &so, &sn) == BT_OK && sn == 5 && !memcmp(so, "hello", 5));
    CHECK(tok_stream_push(&s, mhello, &so, &sn) == BT_OK && sn == 6 && !memcmp(so, " hello", 6));
    tok_stream_free(&s);
    tok_ids_free(&ids);
    tok_free(t);
    vb_free(&v);
}

/* Gemma's SentencePiece settings: add_space_prefix = false (no U+2581 before the text, none dropped when decoding
 * or streaming), and <end_of_turn>, a control token no key names, ends generation (tok_is_eog). */
static void test_spm_no_space_prefix(void)
{
    vocab_builder v;
    memset(&v, 0, sizeof v);
    vb_add(&v, "<unk>", TOK_TYPE_UNKNOWN, 0);
    vb_add(&v, "<s>", TOK_TYPE_CONTROL, 0);
    vb_add(&v, "</s>", TOK_TYPE_CONTROL, 0);
    for (unsigned b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        vb_add(&v, s, TOK_TYPE_BYTE, 0);
    }
    vb_add(&v, "\xE2\x96\x81", TOK_TYPE_NORMAL, -10);
    vb_add(&v, "h", TOK_TYPE_NORMAL, -20), vb_add(&v, "e", TOK_TYPE_NORMAL, -20);
    vb_add(&v, "l", TOK_TYPE_NORMAL, -20), vb_add(&v, "o", TOK_TYPE_NORMAL, -20);
    vb_add(&v, "he", TOK_TYPE_NORMAL, -1);
    vb_add(&v, "ll", TOK_TYPE_NORMAL, -2);
    vb_add(&v, "hell", TOK_TYPE_NORMAL, -3);
    int hello = vb_add(&v, "hello", TOK_TYPE_NORMAL, -4);
    int mhello = vb_add(&v, "\xE2\x96\x81hello", TOK_TYPE_NORMAL, -6);
    int eot = vb_add(&v, "<end_of_turn>", TOK_TYPE_CONTROL, 0);
    v.no_space_prefix = 1;
    tok_tokenizer *t = vb_build(&v, "llama", NULL, 1, 0, NULL);
    REQUIRE(t);
    tok_ids ids = {0};
    CHECK(tok_encode(t, "hello hello", 11, 0, &ids) == BT_OK && ids.n == 2 && ids.ids[0] == hello &&
          ids.ids[1] == mhello);
    ids.n = 0;
    CHECK(tok_encode(t, " hello", 6, 0, &ids) == BT_OK && ids.n == 1 && ids.ids[0] == mhello);
    char *out;
    size_t ol;
    CHECK(tok_decode(t, ids.ids, ids.n, 0, &out, &ol) == BT_OK && !strcmp(out, " hello")); /* the space stays */
    free(out);
    const char *texts[] = {"hello", " hello  hello ", "\xE4\xBD\xA0 hello\n"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        CHECK_MSG(roundtrip(t, texts[i], strlen(texts[i]), 0), "spm (no prefix) roundtrip %zu", i);
    tok_stream s;
    tok_stream_init(&s, t, 0);
    const char *so;
    size_t sn;
    CHECK(tok_stream_push(&s, mhello, &so, &sn) == BT_OK && sn == 6 && !memcmp(so, " hello", 6));
    tok_stream_free(&s);
    CHECK(tok_eot(t) == eot && tok_is_eog(t, eot) && tok_is_eog(t, 2) && !tok_is_eog(t, hello));
    tok_ids_free(&ids);
    tok_free(t);
    vb_free(&v);
}

/* ---- the default model, when cached ---- */

static double cpu_s(void) /* CPU time of this process */
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_on_default_model(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("test_on_default_model: default model not cached (run deploy/fetch-model.sh)");
        return;
    }
    tok_tokenizer *t;
    REQUIRE(tok_load(path, &t) == BT_OK);
    CHECK(tok_n_vocab(t) == 49152 && tok_bos(t) == 1 && tok_eos(t) == 2 && tok_add_bos(t) == 0);
    EXPECT_IDS(t, "Hello world", TOK_PARSE_SPECIAL, 19556, 905);
    /* as the HF tokenizer gives */
    EXPECT_IDS(t, "<|im_start|>user\nHi<|im_end|>", TOK_PARSE_SPECIAL, 1, 4093, 198, 26843, 2);

    /* streaming reproduces the text exactly, in valid UTF-8 chunks */
    const char *text = "Tokyo 東京 😀👨‍👩‍👧 café e\xCC\x81 done";
    tok_ids ids = {0};
    REQUIRE(tok_encode(t, text, strlen(text), 0, &ids) == BT_OK);
    tok_stream s;
    tok_stream_init(&s, t, 0);
    char joined[256] = "";
    size_t jl = 0;
    for (size_t i = 0; i < ids.n; i++) {
        const char *o;
        size_t n;
        CHECK(tok_stream_push(&s, ids.ids[i], &o, &n) == BT_OK);
        CHECK(uni_utf8_valid((const uint8_t *)o, n));
        if (jl + n < sizeof joined) {
            memcpy(joined + jl, o, n);
            jl += n;
        }
    }
    CHECK(jl == strlen(text) && !memcmp(joined, text, jl));
    tok_stream_free(&s);

    /* 100 KB in well under a second, and a 100 KB single piece: CPU time of this (single-threaded) process, so a
     * loaded machine does not count; 0.5 s is ~15x the release build's time and ~4x ASan's, and far below the
     * seconds a quadratic merge would take */
    size_t big = 100000;
    char *buf = malloc(big + 1);
    REQUIRE(buf);
    const char *unit = "The quick brown fox jumps over 13 lazy dogs; 東京 😀 \n\tdef f(x): return x*x  ";
    size_t ul = strlen(unit);
    for (size_t i = 0; i < big; i++) buf[i] = unit[i % ul];
    ids.n = 0;
    double t0 = cpu_s();
    CHECK(tok_encode(t, buf, big, 0, &ids) == BT_OK);
    double dt = cpu_s() - t0;
    fprintf(stderr, "  100 KB mixed text: %zu tokens in %.1f ms of CPU\n", ids.n, dt * 1e3);
    CHECK(dt < 0.5);
    memset(buf, 'a', big);
    ids.n = 0;
    t0 = cpu_s();
    CHECK(tok_encode(t, buf, big, 0, &ids) == BT_OK);
    dt = cpu_s() - t0;
    fprintf(stderr, "  100 KB single word: %zu tokens in %.1f ms of CPU\n", ids.n, dt * 1e3);
    CHECK(dt < 0.5);
    CHECK(roundtrip(t, buf, big, 0));

    /* Runs of one letter leave many stale pairs in the merge heap: "|" + 126 'p's + "itant" overflowed a heap sized
     * to the symbol count (found by fuzz_chat_template; the ASan build of this test catches it). Every letter and
     * digit, runs of 2 to 300 and a few longer, alone and with that word's tail. */
    const char *alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    int runs_ok = 1;
    for (const char *c = alnum; *c; c++) {
        for (size_t len = 2; len <= 1024; len = len < 300 ? len + 1 : len * 2) {
            for (int tail = 0; tail < 2; tail++) {
                buf[0] = '|';
                memset(buf + 1, *c, len);
                size_t n = len + 1;
                if (tail) {
                    memcpy(buf + n, "itant", 5);
                    n += 5;
                }
                runs_ok &= roundtrip(t, buf, n, 0);
            }
        }
    }
    CHECK(runs_ok);
    free(buf);
    tok_ids_free(&ids);
    tok_free(t);
}

int main(void)
{
    RUN(test_bpe_basic);
    RUN(test_pre_tokenizers);
    RUN(test_stream);
    RUN(test_spm);
    RUN(test_spm_no_space_prefix);
    RUN(test_on_default_model);
    return test_summary();
}
