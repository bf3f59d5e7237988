/* Tokenizer built from GGUF metadata (tokenizer.ggml.*).
 *
 * Two models:
 *  - "gpt2": byte-level BPE. Text is split on added tokens, then by the pre-tokenizer regex that
 *    tokenizer.ggml.pre names, then each piece's bytes are spelled in the GPT-2 byte alphabet and merged by the
 *    ranks in tokenizer.ggml.merges.
 *  - "llama": SentencePiece-style BPE. Spaces become U+2581, one U+2581 is prepended to the text's first
 *    segment, characters missing from the vocabulary fall back to <0xXX> byte tokens, and merges come from
 *    tokenizer.ggml.merges or, when absent, from the token scores (highest score first).
 * Both follow the tokenizer that Hugging Face transformers builds from the same GGUF file (the test oracle):
 * CONTROL tokens are special added tokens and USER_DEFINED tokens plain added tokens, matched whole in the text
 * (leftmost, then longest) before anything else; so are the BOS/EOS/UNK/PAD tokens the file names. Also as the
 * oracle does: a character the vocabulary cannot spell (a byte-level vocabulary missing a byte token, a
 * SentencePiece one missing a <0xXX> token) is dropped, since neither model has an unknown token;
 * tokenizer.ggml.add_space_prefix is ignored: byte-level text gets no prefix space and SentencePiece text always
 * gets the U+2581 prefix; the SentencePiece decoder drops one leading space, so text starting with a space or
 * holding a literal U+2581 does not round-trip there. Every other text does: decode(encode(s)) == s, byte for
 * byte, for any bytes (invalid UTF-8 included).
 *
 * A tok_tokenizer is immutable after creation: every function taking a const pointer is thread-safe.
 * Creation copies what it needs, so the gguf_file may be closed afterwards. */
#ifndef BATON_ENGINE_TOKENIZER_H
#define BATON_ENGINE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/gguf.h"

typedef struct tok_tokenizer tok_tokenizer;

typedef enum tok_model {
    TOK_MODEL_BPE = 0, /* "gpt2": byte-level BPE */
    TOK_MODEL_SPM = 1, /* "llama": SentencePiece-style BPE with byte fallback */
} tok_model;

/* Pre-tokenizers (the split regex of a byte-level BPE vocabulary), by tokenizer.ggml.pre name:
 *  gpt2      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *            for "default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion", a missing key, and also for
 *            "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva": the oracle
 *            (transformers' GGUF conversion) uses the plain gpt2 regex for these, although the models' own
 *            tokenizer.json (and llama.cpp) first isolate every \p{N}. The two agree on ASCII digits, which no
 *            merge of these vocabularies joins, and differ on e.g. " ½"; pass "digits-gpt2" as the override of
 *            tok_create_ex to get the models' own behaviour.
 *  digits    every \p{N} isolated, then the gpt2 regex (name "digits-gpt2"; only by override)
 *  llama3    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+
 *            |\s+(?!\S)|\s+  for "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx",
 *            "smaug-bpe", "midm-2.0", "lfm2", "jina-v5-nano"
 *  qwen2     as llama3 with \p{N} single: "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"
 *  gpt-4o    [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|...)?|(the same
 *            with + and * swapped)|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *            for "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"
 *  tekken    as gpt-4o without the contractions and with \p{N} single: "tekken"
 * Any other name is refused with BT_ERR_UNSUPPORTED naming it (guessing would give silently wrong ids); an
 * override names the pre-tokenizer to use instead. */
typedef enum tok_pre {
    TOK_PRE_NONE = 0, /* SentencePiece models */
    TOK_PRE_GPT2,
    TOK_PRE_DIGITS,
    TOK_PRE_LLAMA3,
    TOK_PRE_QWEN2,
    TOK_PRE_GPT4O,
    TOK_PRE_TEKKEN,
} tok_pre;

/* tokenizer.ggml.token_type values. */
typedef enum tok_type {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
} tok_type;

/* tok_encode flags. */
#define TOK_ADD_SPECIAL 1u   /* add BOS/EOS as tokenizer.ggml.add_bos_token / add_eos_token say */
#define TOK_PARSE_SPECIAL 2u /* match CONTROL token strings in the text (USER_DEFINED ones always match) */

/* tok_decode / tok_stream flags. */
#define TOK_SKIP_SPECIAL 1u /* leave CONTROL tokens and the BOS/EOS/UNK/PAD tokens out of the text */

/* Builds a tokenizer from f's tokenizer.ggml.* keys. Errors: BT_ERR_NOT_FOUND (no tokenizer.ggml.model or
 * tokens), BT_ERR_UNSUPPORTED (unknown model or pre-tokenizer name), BT_ERR_FORMAT (inconsistent metadata: array
 * lengths differ, ids out of range, a merge naming a missing token), BT_ERR_NOMEM. *out is set only on success. */
bt_status tok_create(const gguf_file *f, tok_tokenizer **out);

/* Same, with the pre-tokenizer named by pre_override (a tokenizer.ggml.pre name or one of "gpt2", "digits-gpt2",
 * "llama3", "qwen2", "gpt-4o", "tekken") instead of the file's; NULL means the file's.
 * BT_ERR_UNSUPPORTED for an unknown name. */
bt_status tok_create_ex(const gguf_file *f, const char *pre_override, tok_tokenizer **out);

/* Opens the GGUF file at path, builds its tokenizer and closes the file. Errors as gguf_open and tok_create. */
bt_status tok_load(const char *path, tok_tokenizer **out);

/* NULL is allowed. */
void tok_free(tok_tokenizer *t);

tok_model tok_get_model(const tok_tokenizer *t);
tok_pre tok_get_pre(const tok_tokenizer *t);
const char *tok_pre_name(tok_pre p);
int32_t tok_n_vocab(const tok_tokenizer *t);

/* Special ids; -1 when the file names none. */
int32_t tok_bos(const tok_tokenizer *t);
int32_t tok_eos(const tok_tokenizer *t);
int32_t tok_eot(const tok_tokenizer *t);
int32_t tok_unk(const tok_tokenizer *t);
int32_t tok_pad(const tok_tokenizer *t);
int tok_add_bos(const tok_tokenizer *t); /* what TOK_ADD_SPECIAL does */
int tok_add_eos(const tok_tokenizer *t);

/* 1 when id ends generation: EOS, EOT, EOM (the ids the file names). */
int tok_is_eog(const tok_tokenizer *t, int32_t id);

/* Token type of id (TOK_TYPE_UNDEFINED when id is out of range). */
tok_type tok_token_type(const tok_tokenizer *t, int32_t id);

/* The token's text as the file spells it (e.g. "Ġworld"); NULL when id is out of range. Not NUL-terminated. */
const char *tok_token_text(const tok_tokenizer *t, int32_t id, size_t *len);

/* The bytes the token stands for when decoded (e.g. " world"); NULL when id is out of range. */
const char *tok_token_piece(const tok_tokenizer *t, int32_t id, size_t *len);

/* Id of the token spelled exactly text[0..len) (file spelling), or -1. */
int32_t tok_find(const tok_tokenizer *t, const char *text, size_t len);

/* A growable id array; zero-initialise, free with tok_ids_free. */
typedef struct tok_ids {
    int32_t *ids;
    size_t n;
    size_t cap;
} tok_ids;

void tok_ids_free(tok_ids *v);

/* Appends the ids of text[0..len) to out (text need not be valid UTF-8: each invalid byte is one character
 * that is neither letter, number nor space, and still round-trips). Linear in len apart from BPE merging,
 * which is O(n log n) per piece. Errors: BT_ERR_NOMEM (out keeps what it had). */
bt_status tok_encode(const tok_tokenizer *t, const char *text, size_t len, unsigned flags, tok_ids *out);

/* Decodes ids into a malloc'd NUL-terminated byte string (*out, length *out_len; caller frees). The bytes are
 * exactly those the tokens stand for, so decode(encode(s)) == s; they may be invalid UTF-8 when the ids cut a
 * character. SentencePiece models drop one leading space, as the Hugging Face decoder does.
 * Errors: BT_ERR_INVALID (an id out of range), BT_ERR_NOMEM. */
bt_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, unsigned flags, char **out,
                     size_t *out_len);

/* Streaming detokenizer: feed ids one at a time; it returns only complete UTF-8 characters and holds back the
 * bytes of a character that the next token may complete. Invalid bytes come out as U+FFFD, so everything it
 * emits is valid UTF-8. Not thread-safe per stream; many streams may share one tokenizer. */
typedef struct tok_stream {
    const tok_tokenizer *tok;
    unsigned flags;
    int started;        /* some text was produced (SentencePiece leading-space rule) */
    uint8_t held[4];    /* bytes of an incomplete character */
    size_t n_held;
    char *buf;          /* output returned by push/flush; valid until the next call */
    size_t cap;
} tok_stream;

void tok_stream_init(tok_stream *s, const tok_tokenizer *t, unsigned flags);

/* Feeds id; text and len receive the bytes that are now complete (possibly none). Valid until the next call.
 * Errors: BT_ERR_INVALID (id out of range; the stream is unchanged), BT_ERR_NOMEM. */
bt_status tok_stream_push(tok_stream *s, int32_t id, const char **text, size_t *len);

/* End of stream: returns held bytes as U+FFFD (nothing when none), and resets the stream. Can't fail. */
void tok_stream_flush(tok_stream *s, const char **text, size_t *len);

/* Frees the stream's buffer; the stream can be re-initialised. */
void tok_stream_free(tok_stream *s);

#endif
