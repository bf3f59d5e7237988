/* libFuzzer target for engine/tokenizer.
 * Input byte 0 picks a mode:
 *   0-3  encode the rest as text with a small built-in byte-level vocabulary (pre-tokenizer gpt2, llama3, qwen2,
 *        digits-gpt2) and check decode(encode(s)) == s and that streaming gives the same bytes (valid UTF-8 ones);
 *   4    the same with a SentencePiece vocabulary (round trip checked when the text neither starts with a space,
 *        which the decoder drops by design, nor holds a literal U+2581, which decodes as a space);
 *   5    the rest is a GGUF file: build a tokenizer from whatever metadata it holds, then encode and decode. */
#define _GNU_SOURCE /* memmem */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/gguf_writer.h"
#include "engine/tokenizer.h"
#include "engine/unicode.h"

#define N_TOK 5

static tok_tokenizer *toks[N_TOK];

static void byte_spelling(unsigned b, char out[5])
{
    unsigned k = 0, cp = b;
    int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (!printable) {
        for (unsigned x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE)) k++;
        cp = 0x100 + k;
    }
    out[uni_utf8_encode(cp, (uint8_t *)out)] = 0;
}

static tok_tokenizer *build(int spm, const char *pre)
{
    static const char *const merged[][3] = {{"t", "h", "th"}, {"th", "e", "the"}, {"Ġ", "t", "Ġt"},
                                            {"Ġt", "he", "Ġthe"}, {"h", "e", "he"}, {"e", "r", "er"},
                                            {"Ġ", "Ġ", "ĠĠ"},    {"ä", "¸", "ä¸"}};
    static const char *const spm_extra[] = {"\xE2\x96\x81", "t", "h", "e", "th", "the", "\xE2\x96\x81the", "er"};
    char *tok[400];
    int32_t type[400];
    float score[400];
    char *merges[16];
    int n = 0, nm = 0;
    tok[n] = strdup("<|end|>"), type[n] = 3, score[n++] = 0;
    tok[n] = strdup("<s>"), type[n] = 3, score[n++] = 0;
    tok[n] = strdup("<tool>"), type[n] = 4, score[n++] = 0;
    for (unsigned b = 0; b < 256; b++) {
        char s[8];
        if (spm) snprintf(s, sizeof s, "<0x%02X>", b);
        else byte_spelling(b, s);
        tok[n] = strdup(s), type[n] = spm ? 6 : 1, score[n++] = 0;
    }
    if (spm) {
        for (size_t i = 0; i < sizeof spm_extra / sizeof spm_extra[0]; i++)
            tok[n] = strdup(spm_extra[i]), type[n] = 1, score[n++] = -(float)i;
    } else {
        for (size_t i = 0; i < sizeof merged / sizeof merged[0]; i++) {
            int dup = 0;
            for (int k = 0; k < n; k++) dup |= !strcmp(tok[k], merged[i][2]);
            if (!dup) tok[n] = strdup(merged[i][2]), type[n] = 1, score[n++] = 0;
            char m[32];
            snprintf(m, sizeof m, "%s %s", merged[i][0], merged[i][1]);
            merges[nm++] = strdup(m);
        }
    }
    gguf_writer *w = gguf_writer_create();
    uint8_t *buf = NULL;
    size_t len = 0;
    gguf_file *f = NULL;
    tok_tokenizer *t = NULL;
    if (w && !gguf_writer_add_str(w, "tokenizer.ggml.model", spm ? "llama" : "gpt2") &&
        !gguf_writer_add_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tok, NULL, (uint64_t)n) &&
        !gguf_writer_add_arr_i32(w, "tokenizer.ggml.token_type", type, (uint64_t)n) &&
        !gguf_writer_add_arr_f32(w, "tokenizer.ggml.scores", score, (uint64_t)n) &&
        (spm ||
         !gguf_writer_add_arr_str(w, "tokenizer.ggml.merges", (const char *const *)merges, NULL, (uint64_t)nm)) &&
        !gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1) &&
        !gguf_writer_to_memory(w, &buf, &len) && !gguf_open_memory(buf, len, &f))
        tok_create_ex(f, spm ? NULL : pre, &t);
    gguf_close(f);
    free(buf);
    gguf_writer_free(w);
    for (int i = 0; i < n; i++) free(tok[i]);
    for (int i = 0; i < nm; i++) free(merges[i]);
    if (!t) {
        fprintf(stderr, "fuzz_tokenizer: cannot build the test vocabulary: %s\n", bt_last_error());
        abort();
    }
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    toks[0] = build(0, "gpt2");
    toks[1] = build(0, "llama3");
    toks[2] = build(0, "qwen2");
    toks[3] = build(0, "digits-gpt2");
    toks[4] = build(1, NULL);
    return 0;
}

static void check_text(const tok_tokenizer *t, const char *s, size_t n, int spm, unsigned flags)
{
    tok_ids ids = {0};
    if (tok_encode(t, s, n, flags, &ids)) abort();
    char *out = NULL;
    size_t ol = 0;
    /* with TOK_ADD_SPECIAL the BOS is left out of the comparison (the text has no control tokens then) */
    if (tok_decode(t, ids.ids, ids.n, (flags & TOK_ADD_SPECIAL) ? TOK_SKIP_SPECIAL : 0, &out, &ol)) abort();
    /* SentencePiece cannot round-trip a leading space or a literal U+2581 (both decode as plain spaces). */
    int exact = !spm || !(n > 0 && (s[0] == ' ' || memmem(s, n, "\xE2\x96\x81", 3)));
    if (exact && (ol != n || memcmp(out, s, n))) abort();
    /* streaming: the concatenation equals decode's bytes with invalid sequences replaced; always valid UTF-8 */
    tok_stream st;
    tok_stream_init(&st, t, 0);
    for (size_t i = 0; i < ids.n; i++) {
        const char *p;
        size_t pl;
        if (tok_stream_push(&st, ids.ids[i], &p, &pl)) abort();
        if (!uni_utf8_valid((const uint8_t *)p, pl)) abort();
    }
    const char *p;
    size_t pl;
    tok_stream_flush(&st, &p, &pl);
    if (!uni_utf8_valid((const uint8_t *)p, pl)) abort();
    tok_stream_free(&st);
    free(out);
    tok_ids_free(&ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    unsigned mode = data[0] % 6;
    size_t n = size - 1;
    char *copy = malloc(n ? n : 1); /* exact size so ASan sees overreads */
    if (!copy) return 0;
    if (n) memcpy(copy, data + 1, n);
    if (mode < N_TOK) {
        check_text(toks[mode], copy, n, mode == 4, TOK_PARSE_SPECIAL);
        check_text(toks[mode], copy, n, mode == 4, TOK_ADD_SPECIAL);
    } else {
        gguf_file *f = NULL;
        tok_tokenizer *t = NULL;
        if (gguf_open_memory(copy, n, &f) == BT_OK && tok_create(f, &t) == BT_OK) {
            static const char text[] = "Hello, world! 123 \xE4\xB8\xAD\xE6\x96\x87 <s> \xF0\x9F\x98\x80\xFF";
            tok_ids ids = {0};
            if (tok_encode(t, text, sizeof text - 1, TOK_PARSE_SPECIAL | TOK_ADD_SPECIAL, &ids) == BT_OK) {
                char *out = NULL;
                size_t ol;
                if (tok_decode(t, ids.ids, ids.n, 0, &out, &ol) != BT_OK) abort(); /* ids came from t */
                free(out);
            }
            tok_ids_free(&ids);
        }
        tok_free(t);
        gguf_close(f);
    }
    free(copy);
    return 0;
}
