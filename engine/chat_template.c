#include "engine/chat_template.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/unicode.h"

static const char *const kind_names[CHAT_TMPL_COUNT] = {"chatml", "llama3", "mistral", "gemma", "zephyr"};

const char *chat_tmpl_name(chat_tmpl_kind k) { return (unsigned)k < CHAT_TMPL_COUNT ? kind_names[k] : "?"; }

bt_status chat_tmpl_kind_from_name(const char *name, chat_tmpl_kind *out)
{
    for (int k = 0; k < CHAT_TMPL_COUNT; k++) {
        if (!strcmp(name, kind_names[k])) {
            *out = (chat_tmpl_kind)k;
            return BT_OK;
        }
    }
    return bt_fail(BT_ERR_NOT_FOUND, "chat template '%s' is unknown; known: chatml, llama3, mistral, gemma, zephyr",
                   name);
}

static int has(const char *text, size_t len, const char *needle)
{
    size_t nl = strlen(needle);
    if (nl > len) return 0;
    for (const char *p = text; (p = memchr(p, needle[0], len - (size_t)(p - text) - nl + 1)); p++)
        if (!memcmp(p, needle, nl)) return 1;
    return 0;
}

bt_status chat_tmpl_detect(const char *text, size_t len, chat_tmpl_kind *out)
{
    if (!text || !len) return bt_fail(BT_ERR_INVALID, "chat template is empty");
    chat_tmpl_kind k;
    if (has(text, len, "<|start_header_id|>") && has(text, len, "<|eot_id|>")) {
        if (has(text, len, "Cutting Knowledge Date") || has(text, len, "<|python_tag|>")) goto unknown;
        k = CHAT_TMPL_LLAMA3;
    } else if (has(text, len, "<|im_start|>")) {
        k = CHAT_TMPL_CHATML;
    } else if (has(text, len, "<start_of_turn>")) {
        k = CHAT_TMPL_GEMMA;
    } else if (has(text, len, "[INST]") && has(text, len, "[/INST]")) {
        if (has(text, len, "<<SYS>>")) goto unknown; /* Llama 2 chat: a different format */
        /* Only the v1 layout ("[INST] " content " [/INST]"); v3/tekken/v7 templates drop those spaces and place the
         * system prompt elsewhere, so rendering them as v1 would be silently wrong. */
        if (!has(text, len, "' [/INST]") && !has(text, len, "\" [/INST]")) goto unknown;
        k = CHAT_TMPL_MISTRAL;
    } else if (has(text, len, "<|user|>") && has(text, len, "<|assistant|>") && !has(text, len, "<|end|>")) {
        k = CHAT_TMPL_ZEPHYR;
    } else {
        goto unknown;
    }
    *out = k;
    return BT_OK;
unknown:;
    /* Quote the start on one line: newlines as \n, at most 80 bytes, cut at a character boundary. */
    char q[100];
    size_t o = 0;
    for (size_t i = 0; i < len && o < 80;) {
        if (text[i] == '\n') {
            q[o++] = '\\';
            q[o++] = 'n';
            i++;
            continue;
        }
        uint32_t cp;
        size_t l = uni_utf8_decode((const uint8_t *)text + i, len - i, &cp, NULL);
        if (o + l > 80) break;
        memcpy(q + o, text + i, l);
        o += l;
        i += l;
    }
    q[o] = 0;
    return bt_fail(BT_ERR_UNSUPPORTED,
                   "chat template not recognised (%zu bytes, starting \"%s%s\"); known: chatml, llama3, mistral, "
                   "gemma, zephyr; choose one with --chat-template NAME",
                   len, q, o < len ? "..." : "");
}

static char *dup_or_empty(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    char *d = malloc(n + 1);
    if (d) {
        if (n) memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

/* A chatml default system prompt: the literal <|im_start|>system\n...<|im_end|> in a template string, with the
 * template's \n escapes undone. NULL when absent (or on allocation failure, with *nomem set). */
static char *chatml_default_system(const char *text, size_t len, int *nomem)
{
    static const char *const heads[2] = {"<|im_start|>system\\n", "<|im_start|>system\n"};
    *nomem = 0;
    for (int h = 0; h < 2; h++) {
        size_t hl = strlen(heads[h]);
        for (size_t i = 0; i + hl <= len; i++) {
            if (memcmp(text + i, heads[h], hl)) continue;
            size_t s = i + hl, e = s;
            /* The prompt is literal text: stop at a quote or an expression, which means it is not. */
            while (e < len && text[e] != '\'' && text[e] != '"' && text[e] != '{' && text[e] != '<') e++;
            if (e == s || e + 10 > len || memcmp(text + e, "<|im_end|>", 10)) continue;
            char *d = malloc(e - s + 1);
            if (!d) {
                *nomem = 1;
                return NULL;
            }
            size_t o = 0;
            for (size_t k = s; k < e; k++) {
                if (text[k] == '\\' && k + 1 < e) {
                    char c = text[++k];
                    d[o++] = c == 'n' ? '\n' : c == 't' ? '\t' : c;
                } else {
                    d[o++] = text[k];
                }
            }
            d[o] = 0;
            return d;
        }
    }
    return NULL;
}

bt_status chat_tmpl_init(chat_tmpl *t, const char *text, size_t len, const char *override_name, const char *bos,
                         const char *eos)
{
    chat_tmpl r = {0};
    bt_status st = override_name ? chat_tmpl_kind_from_name(override_name, &r.kind)
                                 : chat_tmpl_detect(text, len, &r.kind);
    if (st) return st;
    r.bos = dup_or_empty(bos);
    r.eos = dup_or_empty(eos);
    if (!r.bos || !r.eos) goto nomem;
    if (r.kind == CHAT_TMPL_CHATML && text) {
        int nomem;
        r.default_system = chatml_default_system(text, len, &nomem);
        if (nomem) goto nomem;
    }
    *t = r;
    return BT_OK;
nomem:
    chat_tmpl_free(&r);
    return bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
}

/* Text of token id named by key, NUL-terminated into a malloc'd string; NULL (not an error) when absent. */
static bt_status token_text(const gguf_file *f, const char *key, char **out)
{
    *out = NULL;
    uint32_t id;
    if (!gguf_find_kv(f, key)) return BT_OK;
    bt_status st = gguf_get_u32(f, key, &id);
    if (st) return st;
    const gguf_kv *toks;
    if ((st = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_VT_STRING, &toks))) return st;
    if (id >= toks->arr_len) return BT_OK;
    gguf_str s = gguf_arr_str(toks, id);
    char *d = malloc(s.len + 1);
    if (!d) return bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
    memcpy(d, s.ptr, s.len);
    d[s.len] = 0;
    *out = d;
    return BT_OK;
}

bt_status chat_tmpl_init_gguf(chat_tmpl *t, const gguf_file *f, const char *override_name)
{
    gguf_str text = {NULL, 0};
    bt_status st;
    if (gguf_find_kv(f, "tokenizer.chat_template")) {
        if ((st = gguf_get_str(f, "tokenizer.chat_template", &text))) return st;
    } else if (!override_name) {
        return bt_fail(BT_ERR_NOT_FOUND,
                       "the model has no tokenizer.chat_template; choose one with --chat-template NAME");
    }
    char *bos = NULL, *eos = NULL;
    if ((st = token_text(f, "tokenizer.ggml.bos_token_id", &bos))) goto out;
    if ((st = token_text(f, "tokenizer.ggml.eos_token_id", &eos))) goto out;
    st = chat_tmpl_init(t, text.ptr, (size_t)text.len, override_name, bos, eos);
out:
    free(bos);
    free(eos);
    return st;
}

void chat_tmpl_free(chat_tmpl *t)
{
    free(t->bos);
    free(t->eos);
    free(t->default_system);
    t->bos = t->eos = t->default_system = NULL;
}

/* ---- rendering ---- */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void put(sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void puts_(sbuf *b, const char *s) { put(b, s, strlen(s)); }

/* Python's str.isspace: White_Space plus the information separators U+001C..U+001F. */
static int py_space(uint32_t cp) { return uni_is_space(cp) || (cp >= 0x1C && cp <= 0x1F); }

/* Jinja's |trim (Python str.strip()). */
static void put_trimmed(sbuf *b, const char *s, size_t n)
{
    size_t a = 0, e = n;
    while (a < e) {
        uint32_t cp;
        int ok;
        size_t l = uni_utf8_decode((const uint8_t *)s + a, e - a, &cp, &ok);
        if (!ok || !py_space(cp)) break;
        a += l;
    }
    while (e > a) {
        size_t k = e - 1;
        while (k > a && ((uint8_t)s[k] & 0xC0) == 0x80 && e - k < 4) k--;
        uint32_t cp;
        int ok;
        size_t l = uni_utf8_decode((const uint8_t *)s + k, e - k, &cp, &ok);
        if (!ok || k + l != e || !py_space(cp)) break;
        e = k;
    }
    put(b, s + a, e - a);
}

static int role_is(const chat_msg *m, const char *r) { return m->role && !strcmp(m->role, r); }

/* user/assistant alternation (user first) after an optional leading system message that was folded in. */
static bt_status check_alternation(const chat_msg *msgs, size_t n, size_t first, const char *family)
{
    for (size_t i = first; i < n; i++) {
        int want_user = (i - first) % 2 == 0;
        if (role_is(&msgs[i], want_user ? "user" : "assistant")) continue;
        if (!role_is(&msgs[i], "user") && !role_is(&msgs[i], "assistant"))
            return bt_fail(BT_ERR_INVALID, "%s chat template: message %zu has role '%s'; only user and assistant "
                                           "(and a leading system message) are supported",
                           family, i, msgs[i].role ? msgs[i].role : "");
        return bt_fail(BT_ERR_INVALID, "%s chat template: roles must alternate user/assistant/user/... (message %zu "
                                       "is '%s')",
                       family, i, msgs[i].role);
    }
    return BT_OK;
}

bt_status chat_tmpl_render(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                           char **out, size_t *out_len)
{
    sbuf b = {0};
    bt_status st = BT_OK;
    put(&b, "", 0);
    switch (t->kind) {
    case CHAT_TMPL_CHATML:
        for (size_t i = 0; i < n; i++) {
            if (i == 0 && t->default_system && !role_is(&msgs[0], "system")) {
                puts_(&b, "<|im_start|>system\n");
                puts_(&b, t->default_system);
                puts_(&b, "<|im_end|>\n");
            }
            puts_(&b, "<|im_start|>");
            puts_(&b, msgs[i].role ? msgs[i].role : "");
            puts_(&b, "\n");
            put(&b, msgs[i].content, msgs[i].content_len);
            puts_(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt) puts_(&b, "<|im_start|>assistant\n");
        break;
    case CHAT_TMPL_LLAMA3:
        for (size_t i = 0; i < n; i++) {
            if (i == 0) puts_(&b, t->bos);
            puts_(&b, "<|start_header_id|>");
            puts_(&b, msgs[i].role ? msgs[i].role : "");
            puts_(&b, "<|end_header_id|>\n\n");
            put_trimmed(&b, msgs[i].content, msgs[i].content_len);
            puts_(&b, "<|eot_id|>");
        }
        if (add_generation_prompt) puts_(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_TMPL_MISTRAL: {
        size_t first = n > 0 && role_is(&msgs[0], "system") ? 1 : 0;
        if ((st = check_alternation(msgs, n, first, "mistral"))) goto fail;
        puts_(&b, t->bos);
        for (size_t i = first; i < n; i++) {
            if (role_is(&msgs[i], "user")) {
                puts_(&b, "[INST] ");
                if (first && i == 1) {
                    put(&b, msgs[0].content, msgs[0].content_len);
                    puts_(&b, "\n\n");
                }
                put(&b, msgs[i].content, msgs[i].content_len);
                puts_(&b, " [/INST]");
            } else {
                put(&b, msgs[i].content, msgs[i].content_len);
                puts_(&b, t->eos);
            }
        }
        break;
    }
    case CHAT_TMPL_GEMMA: {
        size_t first = n > 0 && role_is(&msgs[0], "system") ? 1 : 0;
        if ((st = check_alternation(msgs, n, first, "gemma"))) goto fail;
        puts_(&b, t->bos);
        for (size_t i = first; i < n; i++) {
            puts_(&b, "<start_of_turn>");
            puts_(&b, role_is(&msgs[i], "assistant") ? "model" : msgs[i].role);
            puts_(&b, "\n");
            if (first && i == 1) {
                put(&b, msgs[0].content, msgs[0].content_len);
                puts_(&b, "\n\n");
            }
            put_trimmed(&b, msgs[i].content, msgs[i].content_len);
            puts_(&b, "<end_of_turn>\n");
        }
        if (add_generation_prompt) puts_(&b, "<start_of_turn>model\n");
        break;
    }
    case CHAT_TMPL_ZEPHYR:
        for (size_t i = 0; i < n; i++) {
            if (role_is(&msgs[i], "user") || role_is(&msgs[i], "system") || role_is(&msgs[i], "assistant")) {
                puts_(&b, "<|");
                puts_(&b, msgs[i].role ? msgs[i].role : "");
                puts_(&b, "|>\n");
                put(&b, msgs[i].content, msgs[i].content_len);
                puts_(&b, t->eos);
                puts_(&b, "\n");
            }
            if (i + 1 == n && add_generation_prompt) puts_(&b, "<|assistant|>\n");
        }
        break;
    default:
        st = bt_fail(BT_ERR_INTERNAL, "chat template: bad kind %d", (int)t->kind);
        goto fail;
    }
    if (b.oom) {
        st = bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
        goto fail;
    }
    *out = b.p;
    *out_len = b.n;
    return BT_OK;
fail:
    free(b.p);
    return st;
}
