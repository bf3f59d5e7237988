#include "engine/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/unicode.h"

/* Open-addressing hash of token spelling -> id. */
typedef struct vocab_map {
    int32_t *slots; /* id + 1; 0 = empty */
    size_t mask;
} vocab_map;

/* Open-addressing hash of (left id, right id) -> merge rank and merged id. */
typedef struct merge_slot {
    uint64_t key; /* (left << 32 | right) + 1; 0 = empty */
    int32_t rank;
    int32_t result;
} merge_slot;

typedef struct merge_map {
    merge_slot *slots;
    size_t mask;
    size_t n;
} merge_map;

/* An added token matched whole in the text before pre-tokenization. */
typedef struct special_tok {
    int32_t id;
    uint32_t len;
    const char *text; /* spelling, into text_arena */
    int control;      /* 1: matched only with TOK_PARSE_SPECIAL */
} special_tok;

struct tok_tokenizer {
    tok_model model;
    tok_pre pre;
    int32_t n_vocab;
    char *text_arena;      /* spellings, back to back */
    uint32_t *text_off;    /* [n_vocab + 1] */
    char *piece_arena;     /* decoded bytes, back to back */
    uint32_t *piece_off;   /* [n_vocab + 1] */
    uint8_t *type;         /* [n_vocab] tok_type */
    vocab_map vocab;
    merge_map merges;
    int32_t byte_id[256];  /* BPE: id of the token spelling byte b; SPM: id of <0xXX>; -1 when missing */
    special_tok *specials; /* sorted by first byte, then longest first */
    size_t n_specials;
    uint32_t special_first[257]; /* specials starting with byte b: [special_first[b], special_first[b+1]) */
    int32_t bos, eos, eot, eom, unk, pad;
    int add_bos, add_eos;
    int space_prefix;      /* SPM: U+2581 before the text (tokenizer.ggml.add_space_prefix, default 1; Gemma: 0) */
};

/* ---- the GPT-2 byte alphabet: printable bytes stand for themselves, the others for U+0100 + k ---- */

static int byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static void byte_alphabet(uint32_t cp_of_byte[256])
{
    uint32_t next = 0x100;
    for (unsigned b = 0; b < 256; b++) cp_of_byte[b] = byte_is_printable(b) ? b : next++;
}

/* Byte that code point cp spells in the alphabet, or -1. */
static int alphabet_byte(uint32_t cp)
{
    if (cp < 0x100) return byte_is_printable(cp) ? (int)cp : -1;
    /* The 68 other bytes in order: 0x00-0x20, 0x7F-0xA0, 0xAD. */
    if (cp >= 0x100 && cp < 0x100 + 33) return (int)(cp - 0x100);
    if (cp >= 0x100 + 33 && cp < 0x100 + 67) return (int)(0x7F + cp - 0x100 - 33);
    if (cp == 0x100 + 67) return 0xAD;
    return -1;
}

/* ---- hashing ---- */

static uint64_t hash_bytes(const void *p, size_t n)
{
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static const char *tok_text(const tok_tokenizer *t, int32_t id, size_t *len)
{
    *len = t->text_off[id + 1] - t->text_off[id];
    return t->text_arena + t->text_off[id];
}

static int32_t vocab_get(const tok_tokenizer *t, const char *s, size_t len)
{
    size_t i = hash_bytes(s, len) & t->vocab.mask;
    for (;;) {
        int32_t v = t->vocab.slots[i];
        if (!v) return -1;
        size_t l;
        const char *x = tok_text(t, v - 1, &l);
        if (l == len && !memcmp(x, s, len)) return v - 1;
        i = (i + 1) & t->vocab.mask;
    }
}

/* Later duplicates replace earlier ones, as a Python dict built from the token list would. */
static void vocab_put(tok_tokenizer *t, int32_t id)
{
    size_t len;
    const char *s = tok_text(t, id, &len);
    size_t i = hash_bytes(s, len) & t->vocab.mask;
    for (;;) {
        int32_t v = t->vocab.slots[i];
        if (!v) break;
        size_t l;
        const char *x = tok_text(t, v - 1, &l);
        if (l == len && !memcmp(x, s, len)) break;
        i = (i + 1) & t->vocab.mask;
    }
    t->vocab.slots[i] = id + 1;
}

static const merge_slot *merge_get(const merge_map *m, int32_t a, int32_t b)
{
    if (!m->slots) return NULL;
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t i = hash_u64(key) & m->mask;
    for (;;) {
        const merge_slot *s = &m->slots[i];
        if (s->key == key) return s;
        if (!s->key) return NULL;
        i = (i + 1) & m->mask;
    }
}

static void merge_put(merge_map *m, int32_t a, int32_t b, int32_t rank, int32_t result)
{
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t i = hash_u64(key) & m->mask;
    while (m->slots[i].key && m->slots[i].key != key) i = (i + 1) & m->mask;
    if (!m->slots[i].key) m->n++;
    m->slots[i].key = key;
    m->slots[i].rank = rank;
    m->slots[i].result = result;
}

/* ---- construction ---- */

static const struct {
    const char *name;
    tok_pre pre;
} pre_names[] = {
    {"default", TOK_PRE_GPT2}, {"gpt2", TOK_PRE_GPT2}, {"gpt-2", TOK_PRE_GPT2}, {"mpt", TOK_PRE_GPT2},
    {"olmo", TOK_PRE_GPT2}, {"jais", TOK_PRE_GPT2}, {"trillion", TOK_PRE_GPT2}, {"smollm", TOK_PRE_GPT2},
    {"starcoder", TOK_PRE_GPT2}, {"refact", TOK_PRE_GPT2}, {"command-r", TOK_PRE_GPT2},
    {"codeshell", TOK_PRE_GPT2}, {"exaone", TOK_PRE_GPT2}, {"minerva", TOK_PRE_GPT2},
    {"digits-gpt2", TOK_PRE_DIGITS}, {"llama3", TOK_PRE_LLAMA3}, {"llama-v3", TOK_PRE_LLAMA3},
    {"llama-bpe", TOK_PRE_LLAMA3}, {"falcon3", TOK_PRE_LLAMA3}, {"falcon-h1", TOK_PRE_LLAMA3},
    {"pixtral", TOK_PRE_LLAMA3}, {"dbrx", TOK_PRE_LLAMA3}, {"smaug-bpe", TOK_PRE_LLAMA3},
    {"midm-2.0", TOK_PRE_LLAMA3}, {"lfm2", TOK_PRE_LLAMA3}, {"jina-v5-nano", TOK_PRE_LLAMA3},
    {"qwen2", TOK_PRE_QWEN2}, {"deepseek-r1-qwen", TOK_PRE_QWEN2}, {"kormo", TOK_PRE_QWEN2},
    {"f2llmv2", TOK_PRE_QWEN2}, {"megrez", TOK_PRE_QWEN2}, {"gpt-4o", TOK_PRE_GPT4O},
    {"llama4", TOK_PRE_GPT4O}, {"kanana2", TOK_PRE_GPT4O}, {"talkie", TOK_PRE_GPT4O},
    {"minimax-m2", TOK_PRE_GPT4O}, {"tekken", TOK_PRE_TEKKEN},
};

const char *tok_pre_name(tok_pre p)
{
    switch (p) {
    case TOK_PRE_NONE: return "none";
    case TOK_PRE_GPT2: return "gpt2";
    case TOK_PRE_DIGITS: return "digits-gpt2";
    case TOK_PRE_LLAMA3: return "llama3";
    case TOK_PRE_QWEN2: return "qwen2";
    case TOK_PRE_GPT4O: return "gpt-4o";
    case TOK_PRE_TEKKEN: return "tekken";
    }
    return "?";
}

/* Optional id key: -1 when absent; out-of-range ids are ignored with a warning (some converters write junk). */
static bt_status get_opt_id(const gguf_file *f, const char *key, int32_t n_vocab, int32_t *out)
{
    *out = -1;
    if (!gguf_find_kv(f, key)) return BT_OK;
    uint32_t v;
    bt_status st = gguf_get_u32(f, key, &v);
    if (st) return st;
    if (v >= (uint32_t)n_vocab) {
        BT_WARN("tokenizer", "%s = %u is outside the vocabulary (%d tokens); ignored", key, v, n_vocab);
        return BT_OK;
    }
    *out = (int32_t)v;
    return BT_OK;
}

static bt_status get_opt_bool(const gguf_file *f, const char *key, int dflt, int *out)
{
    *out = dflt;
    if (!gguf_find_kv(f, key)) return BT_OK;
    return gguf_get_bool(f, key, out);
}

/* The bytes a token stands for, appended at t->piece_arena + *pos (capacity checked by the caller). */
static size_t make_piece(const tok_tokenizer *t, const char *s, size_t len, tok_type type, char *dst)
{
    if (type == TOK_TYPE_CONTROL) {
        memcpy(dst, s, len);
        return len;
    }
    if (t->model == TOK_MODEL_SPM) {
        /* <0xXX> stands for one byte; U+2581 for a space. */
        if (len == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>') {
            char hex[3] = {s[3], s[4], 0};
            char *end;
            long v = strtol(hex, &end, 16);
            if (*end == 0 && end == hex + 2) {
                dst[0] = (char)v;
                return 1;
            }
        }
        size_t o = 0;
        for (size_t i = 0; i < len;) {
            if (i + 3 <= len && (uint8_t)s[i] == 0xE2 && (uint8_t)s[i + 1] == 0x96 && (uint8_t)s[i + 2] == 0x81) {
                dst[o++] = ' ';
                i += 3;
            } else {
                dst[o++] = s[i++];
            }
        }
        return o;
    }
    /* Byte-level: each alphabet character is one byte; anything else (an added token's literal text) stays. */
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t n = uni_utf8_decode((const uint8_t *)s + i, len - i, &cp, NULL);
        int b = alphabet_byte(cp);
        if (b >= 0) {
            dst[o++] = (char)b;
        } else {
            memcpy(dst + o, s + i, n);
            o += n;
        }
        i += n;
    }
    return o;
}

static int is_alphabet_spelled(const char *s, size_t len)
{
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int ok;
        i += uni_utf8_decode((const uint8_t *)s + i, len - i, &cp, &ok);
        if (!ok || alphabet_byte(cp) < 0) return 0;
    }
    return 1;
}

static int special_cmp(const void *a, const void *b)
{
    const special_tok *x = a, *y = b;
    uint8_t fx = (uint8_t)x->text[0], fy = (uint8_t)y->text[0];
    if (fx != fy) return fx < fy ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

static bt_status build_specials(tok_tokenizer *t)
{
    t->specials = calloc((size_t)t->n_vocab, sizeof *t->specials);
    if (!t->specials) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    size_t n = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t len;
        const char *s = tok_text(t, id, &len);
        if (!len) continue;
        int named = id == t->bos || id == t->eos || id == t->unk || id == t->pad;
        int control = t->type[id] == TOK_TYPE_CONTROL;
        /* A byte-level control token spelled outside the alphabet is a converter mislabel; the oracle skips it. */
        if (control && t->model == TOK_MODEL_BPE && !is_alphabet_spelled(s, len)) control = 0;
        if (control || named) {
            t->specials[n++] = (special_tok){.id = id, .len = (uint32_t)len, .text = s, .control = 1};
        } else if (t->type[id] == TOK_TYPE_USER_DEFINED) {
            t->specials[n++] = (special_tok){.id = id, .len = (uint32_t)len, .text = s, .control = 0};
        }
    }
    t->n_specials = n;
    qsort(t->specials, n, sizeof *t->specials, special_cmp);
    /* Duplicate spellings: keep the first (lowest id) of each; the sort put equal texts next to each other
     * only when they share first byte and length, so compare within that run. */
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        int dup = 0;
        for (size_t j = w; j-- > 0;) {
            if (t->specials[j].len != t->specials[i].len || t->specials[j].text[0] != t->specials[i].text[0]) break;
            if (!memcmp(t->specials[j].text, t->specials[i].text, t->specials[i].len)) {
                dup = 1;
                break;
            }
        }
        if (!dup) t->specials[w++] = t->specials[i];
    }
    t->n_specials = w;
    size_t k = 0;
    for (unsigned b = 0; b <= 256; b++) {
        while (k < w && (uint8_t)t->specials[k].text[0] < b) k++;
        t->special_first[b] = (uint32_t)k;
    }
    return BT_OK;
}

/* Merges from tokenizer.ggml.merges: "left right", rank = position (a later duplicate wins). */
static bt_status build_merges_from_file(tok_tokenizer *t, const gguf_kv *kv)
{
    t->merges.mask = pow2_at_least((size_t)kv->arr_len * 2) - 1;
    t->merges.slots = calloc(t->merges.mask + 1, sizeof *t->merges.slots);
    if (!t->merges.slots) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory for %llu merges",
                                         (unsigned long long)kv->arr_len);
    char *buf = NULL;
    size_t cap = 0;
    bt_status st = BT_OK;
    for (uint64_t r = 0; r < kv->arr_len; r++) {
        gguf_str m = gguf_arr_str(kv, r);
        const char *sp = memchr(m.ptr, ' ', m.len);
        if (!sp || sp == m.ptr || sp == m.ptr + m.len - 1) {
            st = bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu ('%.*s') is not 'left right'", (unsigned long long)r,
                         (int)(m.len > 60 ? 60 : m.len), m.ptr);
            goto out;
        }
        size_t ll = (size_t)(sp - m.ptr), rl = m.len - ll - 1;
        int32_t a = vocab_get(t, m.ptr, ll), b = vocab_get(t, sp + 1, rl);
        if (ll + rl > cap) {
            cap = (ll + rl) * 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                st = bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
                goto out;
            }
            buf = nb;
        }
        memcpy(buf, m.ptr, ll);
        memcpy(buf + ll, sp + 1, rl);
        int32_t c = vocab_get(t, buf, ll + rl);
        if (a < 0 || b < 0 || c < 0) {
            st = bt_fail(BT_ERR_FORMAT, "tokenizer: merge %llu ('%.*s') names a token missing from the vocabulary",
                         (unsigned long long)r, (int)(m.len > 60 ? 60 : m.len), m.ptr);
            goto out;
        }
        merge_put(&t->merges, a, b, (int32_t)r, c);
    }
out:
    free(buf);
    return st;
}

typedef struct spm_merge {
    float score;
    uint32_t len_l, len_r; /* in code points */
    int32_t tok;           /* merged token (insertion order) */
    int32_t l, r;
} spm_merge;

static int spm_merge_cmp(const void *a, const void *b)
{
    const spm_merge *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->len_l != y->len_l) return x->len_l > y->len_l ? -1 : 1;
    if (x->len_r != y->len_r) return x->len_r > y->len_r ? -1 : 1;
    if (x->tok != y->tok) return x->tok < y->tok ? -1 : 1;
    if (x->l != y->l) return x->l < y->l ? -1 : 1;
    return x->r < y->r ? -1 : (x->r > y->r);
}

/* No merges in the file: every split of a token into two tokens is a merge, ordered by the merged token's
 * score (highest first), then longer left part, then longer right part, then token order — the order the
 * oracle's generate_merges produces. */
static bt_status build_merges_from_scores(tok_tokenizer *t, const float *scores)
{
    size_t cap = 1024, n = 0;
    spm_merge *ms = malloc(cap * sizeof *ms);
    if (!ms) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    for (int32_t id = 0; id < t->n_vocab; id++) {
        if (vocab_get(t, t->text_arena + t->text_off[id], t->text_off[id + 1] - t->text_off[id]) != id)
            continue; /* a duplicate spelling: the dict keeps the last */
        size_t len;
        const char *s = tok_text(t, id, &len);
        uint32_t total = 0;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            i += uni_utf8_decode((const uint8_t *)s + i, len - i, &cp, NULL);
            total++;
        }
        uint32_t nl = 0;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            i += uni_utf8_decode((const uint8_t *)s + i, len - i, &cp, NULL);
            nl++;
            if (i >= len) break;
            int32_t l = vocab_get(t, s, i), r = vocab_get(t, s + i, len - i);
            if (l < 0 || r < 0) continue;
            if (n == cap) {
                cap *= 2;
                spm_merge *nm = realloc(ms, cap * sizeof *ms);
                if (!nm) {
                    free(ms);
                    return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
                }
                ms = nm;
            }
            ms[n++] = (spm_merge){scores ? scores[id] : 0.0f, nl, total - nl, id, l, r};
        }
    }
    qsort(ms, n, sizeof *ms, spm_merge_cmp);
    t->merges.mask = pow2_at_least(n * 2) - 1;
    t->merges.slots = calloc(t->merges.mask + 1, sizeof *t->merges.slots);
    if (!t->merges.slots) {
        free(ms);
        return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    }
    for (size_t i = 0; i < n; i++)
        if (!merge_get(&t->merges, ms[i].l, ms[i].r)) merge_put(&t->merges, ms[i].l, ms[i].r, (int32_t)i, ms[i].tok);
    free(ms);
    return BT_OK;
}

bt_status tok_create(const gguf_file *f, tok_tokenizer **out) { return tok_create_ex(f, NULL, out); }

bt_status tok_create_ex(const gguf_file *f, const char *pre_override, tok_tokenizer **out)
{
    bt_status st;
    gguf_str model;
    const gguf_kv *tokens, *types = NULL, *scores_kv = NULL, *merges = NULL;
    float *scores = NULL;
    tok_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");

    if ((st = gguf_get_str(f, "tokenizer.ggml.model", &model))) goto fail;
    if (gguf_str_eq(model, "gpt2")) {
        t->model = TOK_MODEL_BPE;
    } else if (gguf_str_eq(model, "llama")) {
        t->model = TOK_MODEL_SPM;
    } else {
        st = bt_fail(BT_ERR_UNSUPPORTED, "tokenizer: tokenizer.ggml.model '%.*s' is not supported (gpt2, llama)",
                     (int)(model.len > 40 ? 40 : model.len), model.ptr);
        goto fail;
    }
    if (t->model == TOK_MODEL_BPE) {
        t->pre = TOK_PRE_GPT2;
        gguf_str pre = {pre_override, pre_override ? strlen(pre_override) : 0};
        if (!pre_override && gguf_find_kv(f, "tokenizer.ggml.pre") &&
            (st = gguf_get_str(f, "tokenizer.ggml.pre", &pre)))
            goto fail;
        if (pre.ptr) {
            size_t i;
            for (i = 0; i < sizeof pre_names / sizeof pre_names[0]; i++)
                if (gguf_str_eq(pre, pre_names[i].name)) break;
            if (i == sizeof pre_names / sizeof pre_names[0]) {
                st = bt_fail(BT_ERR_UNSUPPORTED,
                             "tokenizer: pre-tokenizer '%.*s'%s is not supported; supported: gpt2/default, "
                             "smollm, llama3/llama-bpe, qwen2, gpt-4o/llama4, tekken, digits-gpt2 and their aliases",
                             (int)(pre.len > 40 ? 40 : pre.len), pre.ptr,
                             pre_override ? "" : " (tokenizer.ggml.pre)");
                goto fail;
            }
            t->pre = pre_names[i].pre;
        }
    }

    if ((st = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &tokens))) goto fail;
    if (tokens->arr_len == 0 || tokens->arr_len > (1u << 24)) {
        st = bt_fail(BT_ERR_FORMAT, "tokenizer: tokenizer.ggml.tokens has %llu entries",
                     (unsigned long long)tokens->arr_len);
        goto fail;
    }
    t->n_vocab = (int32_t)tokens->arr_len;
    if (gguf_find_kv(f, "tokenizer.ggml.token_type")) {
        if ((st = gguf_get_arr(f, "tokenizer.ggml.token_type", GGUF_VT_COUNT, &types))) goto fail;
        if (types->arr_len != tokens->arr_len) {
            st = bt_fail(BT_ERR_FORMAT, "tokenizer: %llu token types for %d tokens",
                         (unsigned long long)types->arr_len, t->n_vocab);
            goto fail;
        }
    }
    if (gguf_find_kv(f, "tokenizer.ggml.scores")) {
        if ((st = gguf_get_arr(f, "tokenizer.ggml.scores", GGUF_VT_COUNT, &scores_kv))) goto fail;
        if (scores_kv->arr_len != tokens->arr_len) {
            st = bt_fail(BT_ERR_FORMAT, "tokenizer: %llu scores for %d tokens",
                         (unsigned long long)scores_kv->arr_len, t->n_vocab);
            goto fail;
        }
    }
    if (gguf_find_kv(f, "tokenizer.ggml.merges")) {
        if ((st = gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_VT_STRING, &merges))) goto fail;
    } else if (t->model == TOK_MODEL_BPE) {
        st = bt_fail(BT_ERR_NOT_FOUND, "tokenizer: a gpt2 tokenizer needs tokenizer.ggml.merges");
        goto fail;
    }

    size_t n = (size_t)t->n_vocab, total = 0;
    for (size_t i = 0; i < n; i++) {
        total += gguf_arr_str(tokens, i).len;
        if (total > UINT32_MAX / 2) {
            st = bt_fail(BT_ERR_FORMAT, "tokenizer: token strings too long");
            goto fail;
        }
    }
    t->text_arena = malloc(total + 1);
    t->piece_arena = malloc(total + 1);
    t->text_off = malloc((n + 1) * sizeof *t->text_off);
    t->piece_off = malloc((n + 1) * sizeof *t->piece_off);
    t->type = malloc(n);
    t->vocab.mask = pow2_at_least(n * 2) - 1;
    t->vocab.slots = calloc(t->vocab.mask + 1, sizeof *t->vocab.slots);
    if (!t->text_arena || !t->piece_arena || !t->text_off || !t->piece_off || !t->type || !t->vocab.slots) {
        st = bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory for %d tokens", t->n_vocab);
        goto fail;
    }
    uint32_t off = 0, poff = 0;
    for (size_t i = 0; i < n; i++) {
        gguf_str s = gguf_arr_str(tokens, i);
        memcpy(t->text_arena + off, s.ptr, s.len);
        t->text_off[i] = off;
        off += (uint32_t)s.len;
        int64_t ty = types ? gguf_arr_int(types, i) : TOK_TYPE_NORMAL;
        t->type[i] = (uint8_t)(ty >= 0 && ty <= TOK_TYPE_BYTE ? ty : TOK_TYPE_UNDEFINED);
    }
    t->text_off[n] = off;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *s = tok_text(t, (int32_t)i, &len);
        t->piece_off[i] = poff;
        poff += (uint32_t)make_piece(t, s, len, (tok_type)t->type[i], t->piece_arena + poff);
        vocab_put(t, (int32_t)i);
    }
    t->piece_off[n] = poff;

    for (unsigned b = 0; b < 256; b++) {
        if (t->model == TOK_MODEL_BPE) {
            uint32_t cps[256];
            byte_alphabet(cps);
            uint8_t u[4];
            size_t ul = uni_utf8_encode(cps[b], u);
            t->byte_id[b] = vocab_get(t, (const char *)u, ul);
        } else {
            char hex[8];
            snprintf(hex, sizeof hex, "<0x%02X>", b);
            t->byte_id[b] = vocab_get(t, hex, 6);
        }
    }

    if ((st = get_opt_id(f, "tokenizer.ggml.bos_token_id", t->n_vocab, &t->bos))) goto fail;
    if ((st = get_opt_id(f, "tokenizer.ggml.eos_token_id", t->n_vocab, &t->eos))) goto fail;
    if ((st = get_opt_id(f, "tokenizer.ggml.eot_token_id", t->n_vocab, &t->eot))) goto fail;
    if ((st = get_opt_id(f, "tokenizer.ggml.eom_token_id", t->n_vocab, &t->eom))) goto fail;
    if ((st = get_opt_id(f, "tokenizer.ggml.unknown_token_id", t->n_vocab, &t->unk))) goto fail;
    if ((st = get_opt_id(f, "tokenizer.ggml.padding_token_id", t->n_vocab, &t->pad))) goto fail;
    if ((st = get_opt_bool(f, "tokenizer.ggml.add_bos_token", t->model == TOK_MODEL_SPM, &t->add_bos))) goto fail;
    if ((st = get_opt_bool(f, "tokenizer.ggml.add_eos_token", 0, &t->add_eos))) goto fail;
    if ((st = get_opt_bool(f, "tokenizer.ggml.add_space_prefix", 1, &t->space_prefix))) goto fail;
    if (t->add_bos && t->bos < 0) t->add_bos = 0;
    if (t->add_eos && t->eos < 0) t->add_eos = 0;

    if (merges) {
        if ((st = build_merges_from_file(t, merges))) goto fail;
    } else {
        if (scores_kv) {
            scores = malloc(n * sizeof *scores);
            if (!scores) {
                st = bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
                goto fail;
            }
            for (size_t i = 0; i < n; i++) scores[i] = (float)gguf_arr_float(scores_kv, i);
        }
        if ((st = build_merges_from_scores(t, scores))) goto fail;
    }
    if ((st = build_specials(t))) goto fail;
    if (t->eot < 0) { /* Gemma's files name no eot token: its turns end with the control token <end_of_turn> */
        int32_t id = vocab_get(t, "<end_of_turn>", 13);
        if (id >= 0 && t->type[id] == TOK_TYPE_CONTROL) t->eot = id;
    }
    free(scores);
    *out = t;
    return BT_OK;
fail:
    free(scores);
    tok_free(t);
    return st;
}

bt_status tok_load(const char *path, tok_tokenizer **out)
{
    gguf_file *f;
    bt_status st = gguf_open(path, &f);
    if (st) return st;
    st = tok_create(f, out);
    gguf_close(f);
    return st;
}

void tok_free(tok_tokenizer *t)
{
    if (!t) return;
    free(t->text_arena);
    free(t->piece_arena);
    free(t->text_off);
    free(t->piece_off);
    free(t->type);
    free(t->vocab.slots);
    free(t->merges.slots);
    free(t->specials);
    free(t);
}

tok_model tok_get_model(const tok_tokenizer *t) { return t->model; }
tok_pre tok_get_pre(const tok_tokenizer *t) { return t->pre; }
int32_t tok_n_vocab(const tok_tokenizer *t) { return t->n_vocab; }
int32_t tok_bos(const tok_tokenizer *t) { return t->bos; }
int32_t tok_eos(const tok_tokenizer *t) { return t->eos; }
int32_t tok_eot(const tok_tokenizer *t) { return t->eot; }
int32_t tok_unk(const tok_tokenizer *t) { return t->unk; }
int32_t tok_pad(const tok_tokenizer *t) { return t->pad; }
int tok_add_bos(const tok_tokenizer *t) { return t->add_bos; }
int tok_add_eos(const tok_tokenizer *t) { return t->add_eos; }

int tok_is_eog(const tok_tokenizer *t, int32_t id)
{
    return id >= 0 && (id == t->eos || id == t->eot || id == t->eom);
}

tok_type tok_token_type(const tok_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? (tok_type)t->type[id] : TOK_TYPE_UNDEFINED;
}

const char *tok_token_text(const tok_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab) return NULL;
    return tok_text(t, id, len);
}

const char *tok_token_piece(const tok_tokenizer *t, int32_t id, size_t *len)
{
    if (id < 0 || id >= t->n_vocab) return NULL;
    *len = t->piece_off[id + 1] - t->piece_off[id];
    return t->piece_arena + t->piece_off[id];
}

int32_t tok_find(const tok_tokenizer *t, const char *text, size_t len) { return vocab_get(t, text, len); }

void tok_ids_free(tok_ids *v)
{
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

static bt_status ids_push(tok_ids *v, int32_t id)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->ids, cap * sizeof *p);
        if (!p) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
        v->ids = p;
        v->cap = cap;
    }
    v->ids[v->n++] = id;
    return BT_OK;
}

/* ---- encoding ---- */

/* Character classes: letter, number, White_Space, \r or \n, [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] ("upper" side of the
 * gpt-4o/tekken word rule), [\p{Ll}\p{Lm}\p{Lo}\p{M}] ("lower" side), '/'. */
enum { CL_L = 1, CL_N = 2, CL_S = 4, CL_NL = 8, CL_U = 16, CL_W = 32, CL_SLASH = 64 };

typedef struct sym {
    int32_t id;
    int32_t prev, next;
    uint32_t len; /* bytes; 0 once merged into its left neighbour */
} sym;

typedef struct heap_ent {
    int32_t rank;
    int32_t pos;
} heap_ent;

/* Per-call scratch space, grown as needed (the tokenizer itself stays read-only). */
typedef struct work {
    uint32_t *cps;  /* [n_chars] code points of the segment (U+FFFD for invalid bytes) */
    uint32_t *offs; /* [n_chars + 1] byte offsets */
    uint8_t *cls;   /* [n_chars] CL_* bits */
    size_t cap_chars;
    sym *syms;
    heap_ent *heap;
    size_t cap_syms, cap_heap, heap_n;
    char *buf; /* SentencePiece: the segment with spaces replaced */
    size_t cap_buf;
} work;

static void work_free(work *w)
{
    free(w->cps);
    free(w->offs);
    free(w->cls);
    free(w->syms);
    free(w->heap);
    free(w->buf);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int work_chars(work *w, size_t n)
{
    if (n + 1 <= w->cap_chars) return 0;
    size_t c = w->cap_chars ? w->cap_chars : 64;
    while (c < n + 1) c *= 2;
    uint32_t *a = realloc(w->cps, c * sizeof *a);
    if (!a) return -1;
    w->cps = a;
    uint32_t *b = realloc(w->offs, c * sizeof *b);
    if (!b) return -1;
    w->offs = b;
    uint8_t *d = realloc(w->cls, c);
    if (!d) return -1;
    w->cls = d;
    w->cap_chars = c;
    return 0;
}

static int work_syms(work *w, size_t n)
{
    if (grow((void **)&w->syms, &w->cap_syms, n, sizeof *w->syms)) return -1;
    /* The merge heap keeps stale entries: it starts with n - 1 pairs, and each merge pops one entry and pushes at
     * most two, so it never holds more than 2n. (Sizing it n overflowed on long runs of one letter: fuzz_chat_template.) */
    return grow((void **)&w->heap, &w->cap_heap, 2 * n, sizeof *w->heap);
}

static int heap_less(heap_ent a, heap_ent b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static void heap_push(work *w, heap_ent e)
{
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(e, w->heap[p])) break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = e;
}

static heap_ent heap_pop(work *w)
{
    heap_ent top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(w->heap[c + 1], w->heap[c])) c++;
        if (!heap_less(w->heap[c], last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

static void try_pair(const tok_tokenizer *t, work *w, int32_t pos)
{
    int32_t nx = w->syms[pos].next;
    if (nx < 0) return;
    const merge_slot *m = merge_get(&t->merges, w->syms[pos].id, w->syms[nx].id);
    if (m) heap_push(w, (heap_ent){m->rank, pos});
}

/* Merges w->syms[0..n) (linked in order) by rank, lowest rank and then leftmost first; appends the ids. */
static bt_status bpe_merge(const tok_tokenizer *t, work *w, size_t n, tok_ids *out)
{
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) try_pair(t, w, (int32_t)i);
    while (w->heap_n) {
        heap_ent e = heap_pop(w);
        sym *s = &w->syms[e.pos];
        if (!s->len || s->next < 0) continue;
        sym *r = &w->syms[s->next];
        const merge_slot *m = merge_get(&t->merges, s->id, r->id);
        if (!m || m->rank != e.rank) continue; /* stale entry */
        s->id = m->result;
        s->len += r->len;
        r->len = 0;
        s->next = r->next;
        if (s->next >= 0) w->syms[s->next].prev = e.pos;
        if (s->prev >= 0) try_pair(t, w, s->prev);
        try_pair(t, w, e.pos);
    }
    for (int32_t i = n ? 0 : -1; i >= 0; i = w->syms[i].next) {
        if (w->syms[i].id < 0) continue;
        if (ids_push(out, w->syms[i].id)) return BT_ERR_NOMEM;
    }
    return BT_OK;
}

static void link_syms(work *w, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        w->syms[i].prev = (int32_t)i - 1;
        w->syms[i].next = i + 1 < n ? (int32_t)i + 1 : -1;
    }
}

/* One byte-level pre-token: bytes -> alphabet ids -> merges. */
static bt_status bpe_bytes(const tok_tokenizer *t, work *w, const uint8_t *s, size_t n, tok_ids *out)
{
    if (n == 1) {
        int32_t id = t->byte_id[s[0]];
        return id >= 0 && ids_push(out, id) ? BT_ERR_NOMEM : BT_OK;
    }
    if (work_syms(w, n)) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    /* A byte the vocabulary cannot spell is dropped (the oracle's BPE has no unknown token), so its neighbours
     * become adjacent and may merge. */
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[s[i]];
        if (id < 0) continue;
        w->syms[k].id = id;
        w->syms[k].len = 1;
        k++;
    }
    link_syms(w, k);
    return bpe_merge(t, w, k, out);
}

/* Decodes seg into w->cps/offs/cls; returns the number of characters or (size_t)-1 when out of memory. */
static size_t classify(work *w, const uint8_t *seg, size_t len)
{
    if (work_chars(w, len)) return (size_t)-1;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int ok;
        size_t l = uni_utf8_decode(seg + i, len - i, &cp, &ok);
        uint8_t c = 0;
        if (ok) {
            uint8_t p = uni_props(cp);
            uni_cat cat = (uni_cat)(p & 0x1F);
            if (cat >= UNI_LU && cat <= UNI_LO) c |= CL_L;
            if (cat >= UNI_ND && cat <= UNI_NO) c |= CL_N;
            if (p & 0x80) c |= CL_S;
            if (cp == '\r' || cp == '\n') c |= CL_NL;
            if (cp == '/') c |= CL_SLASH;
            if ((cat >= UNI_LU && cat <= UNI_ME && cat != UNI_LL)) c |= CL_U;
            if (cat >= UNI_LL && cat <= UNI_ME && cat != UNI_LT) c |= CL_W;
        } else {
            cp = 0xFFFFFFFFu; /* an invalid byte: "other" */
        }
        w->cps[n] = cp;
        w->offs[n] = (uint32_t)i;
        w->cls[n] = c;
        n++;
        i += l;
    }
    w->offs[n] = (uint32_t)len;
    return n;
}

#define IS_O(c) (((c) & (CL_L | CL_N | CL_S)) == 0)

static size_t run_of(const uint8_t *cls, size_t i, size_t end, uint8_t bit)
{
    while (i < end && (cls[i] & bit)) i++;
    return i;
}

static size_t run_of_other(const uint8_t *cls, size_t i, size_t end)
{
    while (i < end && IS_O(cls[i])) i++;
    return i;
}

static uint32_t lower_ascii(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 's 't 're 've 'm 'll 'd at i; case-insensitive (U+017F folds to s) when ci. Returns the end or 0. */
static size_t contraction(const uint32_t *cp, size_t i, size_t end, int ci)
{
    if (cp[i] != '\'' || i + 1 >= end) return 0;
    uint32_t a = cp[i + 1], b = i + 2 < end ? cp[i + 2] : 0;
    if (ci) {
        a = a == 0x17F ? 's' : lower_ascii(a);
        b = lower_ascii(b);
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return 0;
}

/* \s+(?!\S)|\s+ at a whitespace character i. */
static size_t match_spaces(const uint8_t *cls, size_t i, size_t end)
{
    size_t j = run_of(cls, i, end, CL_S);
    if (j == end || j - i < 2) return j;
    return j - 1;
}

/* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t match_gpt2(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end)
{
    size_t j = contraction(cp, i, end, 0);
    if (j) return j;
    uint8_t c = cls[i];
    int sp = cp[i] == ' ' && i + 1 < end;
    if (c & CL_L) return run_of(cls, i, end, CL_L);
    if (sp && (cls[i + 1] & CL_L)) return run_of(cls, i + 1, end, CL_L);
    if (c & CL_N) return run_of(cls, i, end, CL_N);
    if (sp && (cls[i + 1] & CL_N)) return run_of(cls, i + 1, end, CL_N);
    if (IS_O(c)) return run_of_other(cls, i, end);
    if (sp && IS_O(cls[i + 1])) return run_of_other(cls, i + 1, end);
    return match_spaces(cls, i, end);
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*
 * |\s*[\r\n]+|\s+(?!\S)|\s+   (llama3: max_digits 3; qwen2: 1) */
static size_t match_llama3(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end, size_t max_digits)
{
    size_t j = contraction(cp, i, end, 1);
    if (j) return j;
    uint8_t c = cls[i];
    if (c & CL_L) return run_of(cls, i, end, CL_L);
    if (!(c & (CL_NL | CL_L | CL_N)) && i + 1 < end && (cls[i + 1] & CL_L)) return run_of(cls, i + 1, end, CL_L);
    if (c & CL_N) {
        j = i;
        while (j < end && j - i < max_digits && (cls[j] & CL_N)) j++;
        return j;
    }
    int sp = cp[i] == ' ' && i + 1 < end;
    if (IS_O(c) || (sp && IS_O(cls[i + 1]))) {
        j = run_of_other(cls, IS_O(c) ? i : i + 1, end);
        return run_of(cls, j, end, CL_NL);
    }
    /* Whitespace: \s*[\r\n]+ ends after the last \r or \n of the run, if there is one. */
    j = run_of(cls, i, end, CL_S);
    for (size_t k = j; k > i; k--)
        if (cls[k - 1] & CL_NL) return k;
    return match_spaces(cls, i, end);
}

/* [U]*[W]+ (upper_first 0) or [U]+[W]* (upper_first 1) from j, with regex backtracking: U* gives characters
 * back until a W can follow. Returns the end, or 0 when there is no match. */
static size_t case_word(const uint8_t *cls, size_t j, size_t end, int upper_first)
{
    size_t u = run_of(cls, j, end, CL_U);
    if (upper_first) return u == j ? 0 : run_of(cls, u, end, CL_W);
    for (size_t k = u;; k--) {
        if (k < end && (cls[k] & CL_W)) return run_of(cls, k, end, CL_W);
        if (k == j) return 0;
    }
}

/* [^\r\n\p{L}\p{N}]?<case_word>(?i:'s|'t|'re|'ve|'m|'ll|'d)?  (the contraction only with contractions set) */
static size_t case_word_alt(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end, int upper_first,
                            int contractions)
{
    size_t e = 0;
    if (!(cls[i] & (CL_NL | CL_L | CL_N)) && i + 1 < end) e = case_word(cls, i + 1, end, upper_first);
    if (!e) e = case_word(cls, i, end, upper_first);
    if (e && contractions && e < end) {
        size_t c = contraction(cp, e, end, 1);
        if (c) e = c;
    }
    return e;
}

/* gpt-4o (tekken: no contractions, \p{N} single):
 * [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 * |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 * |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t match_gpt4o(const uint32_t *cp, const uint8_t *cls, size_t i, size_t end, int tekken)
{
    size_t j = case_word_alt(cp, cls, i, end, 0, !tekken);
    if (j) return j;
    if ((j = case_word_alt(cp, cls, i, end, 1, !tekken))) return j;
    uint8_t c = cls[i];
    if (c & CL_N) {
        size_t max_digits = tekken ? 1 : 3;
        for (j = i; j < end && j - i < max_digits && (cls[j] & CL_N); j++) {}
        return j;
    }
    int sp = cp[i] == ' ' && i + 1 < end;
    if (IS_O(c) || (sp && IS_O(cls[i + 1]))) {
        j = run_of_other(cls, IS_O(c) ? i : i + 1, end);
        return run_of(cls, j, end, CL_NL | CL_SLASH);
    }
    j = run_of(cls, i, end, CL_S);
    for (size_t k = j; k > i; k--)
        if (cls[k - 1] & CL_NL) return k;
    return match_spaces(cls, i, end);
}

static bt_status encode_bpe_segment(const tok_tokenizer *t, work *w, const uint8_t *seg, size_t len, tok_ids *out)
{
    size_t n = classify(w, seg, len);
    if (n == (size_t)-1) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    /* classify's arrays are reused by bpe_bytes only through syms/heap, so they stay valid here. */
    const uint32_t *cp = w->cps;
    const uint8_t *cls = w->cls;
    const uint32_t *offs = w->offs;
    size_t i = 0;
    while (i < n) {
        size_t end = n;
        if (t->pre == TOK_PRE_DIGITS) {
            if (cls[i] & CL_N) { /* every number character is its own piece */
                bt_status st = bpe_bytes(t, w, seg + offs[i], offs[i + 1] - offs[i], out);
                if (st) return st;
                i++;
                continue;
            }
            end = i;
            while (end < n && !(cls[end] & CL_N)) end++;
        }
        while (i < end) {
            size_t j;
            switch (t->pre) {
            case TOK_PRE_LLAMA3: j = match_llama3(cp, cls, i, end, 3); break;
            case TOK_PRE_QWEN2: j = match_llama3(cp, cls, i, end, 1); break;
            case TOK_PRE_GPT4O: j = match_gpt4o(cp, cls, i, end, 0); break;
            case TOK_PRE_TEKKEN: j = match_gpt4o(cp, cls, i, end, 1); break;
            default: j = match_gpt2(cp, cls, i, end); break;
            }
            bt_status st = bpe_bytes(t, w, seg + offs[i], offs[j] - offs[i], out);
            if (st) return st;
            i = j;
        }
    }
    return BT_OK;
}

/* SentencePiece: spaces -> U+2581, U+2581 prepended to the text's first segment unless it starts with one (or the
 * file says add_space_prefix = false),
 * then BPE over characters with <0xXX> fallback, the whole segment as one word (the oracle's Metaspace does
 * not split). */
static bt_status encode_spm_segment(const tok_tokenizer *t, work *w, const uint8_t *seg, size_t len, int first,
                                    tok_ids *out)
{
    static const uint8_t meta[3] = {0xE2, 0x96, 0x81};
    if (grow((void **)&w->buf, &w->cap_buf, len * 3 + 3, 1)) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    size_t bl = 0;
    int starts_meta = len > 0 && (seg[0] == ' ' || (len >= 3 && !memcmp(seg, meta, 3)));
    if (first && !starts_meta && t->space_prefix) {
        memcpy(w->buf, meta, 3);
        bl = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (seg[i] == ' ') {
            memcpy(w->buf + bl, meta, 3);
            bl += 3;
        } else {
            w->buf[bl++] = (char)seg[i];
        }
    }
    const uint8_t *s = (const uint8_t *)w->buf;
    if (work_syms(w, bl)) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    size_t n = 0;
    for (size_t i = 0; i < bl;) {
        uint32_t cp;
        int ok;
        size_t l = uni_utf8_decode(s + i, bl - i, &cp, &ok);
        int32_t id = ok ? vocab_get(t, (const char *)s + i, l) : -1;
        if (id >= 0) {
            w->syms[n++] = (sym){.id = id, .len = (uint32_t)l};
        } else {
            int all = 1;
            for (size_t k = 0; k < l; k++) all &= t->byte_id[s[i + k]] >= 0;
            if (all) {
                for (size_t k = 0; k < l; k++) w->syms[n++] = (sym){.id = t->byte_id[s[i + k]], .len = 1};
            }
            /* else dropped, as the oracle's BPE (no unknown token) does */
        }
        i += l;
    }
    link_syms(w, n);
    return bpe_merge(t, w, n, out);
}

/* Next added token at or after pos: leftmost start, longest text. Returns its index or -1. */
static long find_special(const tok_tokenizer *t, const uint8_t *s, size_t len, size_t pos, unsigned flags,
                         size_t *at)
{
    if (!t->n_specials) return -1;
    for (size_t p = pos; p < len; p++) {
        uint8_t b = s[p];
        for (uint32_t k = t->special_first[b]; k < t->special_first[b + 1]; k++) {
            const special_tok *sp = &t->specials[k];
            if (sp->control && !(flags & TOK_PARSE_SPECIAL)) continue;
            if (sp->len <= len - p && !memcmp(s + p, sp->text, sp->len)) {
                *at = p;
                return (long)k;
            }
        }
    }
    return -1;
}

bt_status tok_encode(const tok_tokenizer *t, const char *text, size_t len, unsigned flags, tok_ids *out)
{
    const uint8_t *s = (const uint8_t *)text;
    size_t n0 = out->n;
    work w = {0};
    bt_status st = BT_OK;
    if ((flags & TOK_ADD_SPECIAL) && t->add_bos && (st = ids_push(out, t->bos))) goto done;
    size_t pos = 0;
    while (pos < len) {
        size_t at = len;
        long k = find_special(t, s, len, pos, flags, &at);
        if (at > pos) {
            st = t->model == TOK_MODEL_SPM ? encode_spm_segment(t, &w, s + pos, at - pos, pos == 0, out)
                                           : encode_bpe_segment(t, &w, s + pos, at - pos, out);
            if (st) goto done;
        }
        if (k < 0) break;
        if ((st = ids_push(out, t->specials[k].id))) goto done;
        pos = at + t->specials[k].len;
    }
    if ((flags & TOK_ADD_SPECIAL) && t->add_eos) st = ids_push(out, t->eos);
done:
    work_free(&w);
    if (st) out->n = n0;
    return st;
}

/* ---- decoding ---- */

/* What TOK_SKIP_SPECIAL leaves out: CONTROL tokens and the named BOS/EOS/UNK/PAD (the oracle's special tokens). */
static int skip_special(const tok_tokenizer *t, int32_t id)
{
    return t->type[id] == TOK_TYPE_CONTROL || id == t->bos || id == t->eos || id == t->unk || id == t->pad;
}

bt_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, unsigned flags, char **out,
                     size_t *out_len)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return bt_fail(BT_ERR_INVALID, "tokenizer: token id %d is outside the vocabulary (%d tokens)", ids[i],
                           t->n_vocab);
        total += t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
    }
    char *buf = malloc(total + 1);
    if (!buf) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory decoding %zu tokens", n);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if ((flags & TOK_SKIP_SPECIAL) && skip_special(t, ids[i])) continue;
        size_t l;
        const char *p = tok_token_piece(t, ids[i], &l);
        memcpy(buf + o, p, l);
        o += l;
    }
    if (t->model == TOK_MODEL_SPM && t->space_prefix && o > 0 && buf[0] == ' ') {
        memmove(buf, buf + 1, o - 1);
        o--;
    }
    buf[o] = 0;
    *out = buf;
    *out_len = o;
    return BT_OK;
}

void tok_stream_init(tok_stream *s, const tok_tokenizer *t, unsigned flags)
{
    memset(s, 0, sizeof *s);
    s->tok = t;
    s->flags = flags;
}

void tok_stream_free(tok_stream *s)
{
    free(s->buf);
    s->buf = NULL;
    s->cap = 0;
}

/* Appends src to s->buf at *o, replacing each invalid byte with U+FFFD. Capacity: 3 bytes per input byte. */
static void append_valid(char *dst, size_t *o, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int ok;
        size_t l = uni_utf8_decode(src + i, n - i, &cp, &ok);
        if (ok) {
            memcpy(dst + *o, src + i, l);
            *o += l;
        } else {
            memcpy(dst + *o, "\xEF\xBF\xBD", 3);
            *o += 3;
        }
        i += l;
    }
}

bt_status tok_stream_push(tok_stream *s, int32_t id, const char **text, size_t *len)
{
    const tok_tokenizer *t = s->tok;
    if (id < 0 || id >= t->n_vocab)
        return bt_fail(BT_ERR_INVALID, "tokenizer: token id %d is outside the vocabulary (%d tokens)", id,
                       t->n_vocab);
    size_t pl = 0;
    const char *piece = "";
    if (!((s->flags & TOK_SKIP_SPECIAL) && skip_special(t, id))) piece = tok_token_piece(t, id, &pl);
    size_t need = (s->n_held + pl) * 3 + 1;
    if (grow((void **)&s->buf, &s->cap, need, 1)) return bt_fail(BT_ERR_NOMEM, "tokenizer: out of memory");
    /* Join held bytes and the piece (N bytes) in the last N bytes of a 3N+1 buffer, then emit what is complete
     * from the start: output grows at most 3 bytes per input byte, so it never overtakes the unread input. */
    uint8_t *tmp = (uint8_t *)s->buf + (need - 1 - (s->n_held + pl));
    memmove(tmp + s->n_held, piece, pl);
    memcpy(tmp, s->held, s->n_held);
    size_t n = s->n_held + pl, start = 0;
    if (t->model == TOK_MODEL_SPM && t->space_prefix && !s->started && n > 0) {
        s->started = 1;
        if (tmp[0] == ' ') start = 1;
    }
    size_t done = start + uni_utf8_complete_prefix(tmp + start, n - start);
    size_t o = 0;
    append_valid(s->buf, &o, tmp + start, done - start);
    s->n_held = n - done;
    memcpy(s->held, tmp + done, s->n_held);
    s->buf[o] = 0;
    *text = s->buf;
    *len = o;
    return BT_OK;
}

void tok_stream_flush(tok_stream *s, const char **text, size_t *len)
{
    static const char repl[] = "\xEF\xBF\xBD";
    *text = s->n_held ? repl : "";
    *len = s->n_held ? 3 : 0;
    s->n_held = 0;
    s->started = 0;
}
