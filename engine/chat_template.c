#include "engine/chat_template.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/strbuf.h"
#include "engine/unicode.h"

static const char *const kind_names[CHAT_TMPL_COUNT] = {"chatml", "llama3", "mistral", "gemma", "zephyr"};

const char *chat_tmpl_name(chat_tmpl_kind k)
{
    if (k == CHAT_TMPL_JINJA) return "jinja";
    return (unsigned)k < CHAT_TMPL_COUNT ? kind_names[k] : "?";
}

bt_status chat_tmpl_kind_from_name(const char *name, chat_tmpl_kind *out)
{
    if (!strncmp(name, "builtin:", 8)) name += 8;
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
    char parse_err[240] = "";
    bt_status st;
    if (override_name) {
        if ((st = chat_tmpl_kind_from_name(override_name, &r.kind))) return st;
        snprintf(r.why, sizeof r.why, "the built-in %s renderer, chosen by --chat-template", chat_tmpl_name(r.kind));
    } else {
        if (!text || !len) return bt_fail(BT_ERR_INVALID, "chat template is empty");
        st = jinja_parse(text, len, &r.jinja);
        if (st == BT_ERR_NOMEM) return st;
        if (st == BT_OK) {
            r.kind = CHAT_TMPL_JINJA;
            snprintf(r.why, sizeof r.why, "the model's own template, rendered by the Jinja interpreter");
        } else {
            snprintf(parse_err, sizeof parse_err, "%s", bt_last_error());
            if ((st = chat_tmpl_detect(text, len, &r.kind)))
                return bt_fail(st, "chat template does not parse (%s), and %s", parse_err, bt_last_error());
            snprintf(r.why, sizeof r.why, "the built-in %s renderer: the template does not parse (%s)",
                     chat_tmpl_name(r.kind), parse_err);
        }
    }
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

bt_status chat_tmpl_init_jinja(chat_tmpl *t, const char *text, size_t len, const char *bos, const char *eos)
{
    chat_tmpl r = {.kind = CHAT_TMPL_JINJA};
    bt_status st = jinja_parse(text ? text : "", text ? len : 0, &r.jinja);
    if (st) return bt_fail(st, "chat template %s", bt_last_error());
    snprintf(r.why, sizeof r.why, "a template file, rendered by the Jinja interpreter");
    r.bos = dup_or_empty(bos);
    r.eos = dup_or_empty(eos);
    if (!r.bos || !r.eos) {
        chat_tmpl_free(&r);
        return bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
    }
    *t = r;
    return BT_OK;
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

/* A whole file into a malloc'd NUL-terminated buffer; NULL with errno set on failure. */
static char *read_text_file(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (cap - n < 4096) {
            if (cap > ((size_t)8 << 20)) { /* larger than any template: not one */
                errno = EFBIG;
                goto fail;
            }
            char *q = realloc(buf, cap ? cap * 2 : 8192);
            if (!q) goto fail;
            buf = q;
            cap = cap ? cap * 2 : 8192;
        }
        size_t k = fread(buf + n, 1, cap - n - 1, fp);
        n += k;
        if (k == 0) break;
    }
    if (ferror(fp)) goto fail;
    fclose(fp);
    buf[n] = 0;
    *len = n;
    return buf;
fail:;
    int e = errno;
    free(buf);
    fclose(fp);
    errno = e;
    return NULL;
}

static int is_builtin_name(const char *name)
{
    chat_tmpl_kind k;
    if (!strncmp(name, "builtin:", 8)) return 1;
    bt_status st = chat_tmpl_kind_from_name(name, &k);
    bt_clear_error();
    return st == BT_OK;
}

bt_status chat_tmpl_init_gguf(chat_tmpl *t, const gguf_file *f, const char *override)
{
    gguf_str text = {NULL, 0};
    bt_status st;
    gguf_str arch = {NULL, 0};
    if (gguf_find_kv(f, "tokenizer.chat_template")) {
        if ((st = gguf_get_str(f, "tokenizer.chat_template", &text))) return st;
    } else if (!override && gguf_get_str(f, "general.architecture", &arch) == BT_OK && arch.len >= 5 &&
               !memcmp(arch.ptr, "gemma", 5)) {
        /* Gemma files without a template (the base checkpoints, e.g. gemma-3-270m): the family's turn markers are
         * in every Gemma vocabulary, and the instruction-tuned siblings use exactly this built-in format */
        override = "gemma";
    } else if (!override) {
        return bt_fail(BT_ERR_NOT_FOUND,
                       "the model has no tokenizer.chat_template; choose one with --chat-template builtin:NAME|FILE");
    }
    char *bos = NULL, *eos = NULL, *file = NULL;
    if ((st = token_text(f, "tokenizer.ggml.bos_token_id", &bos))) goto out;
    if ((st = token_text(f, "tokenizer.ggml.eos_token_id", &eos))) goto out;
    if (override && !is_builtin_name(override)) {
        size_t len;
        if (!(file = read_text_file(override, &len))) {
            st = bt_fail(errno == ENOENT ? BT_ERR_NOT_FOUND : BT_ERR_IO,
                         "--chat-template '%s' is neither a built-in template (chatml, llama3, mistral, gemma, zephyr; "
                         "or builtin:NAME) nor a readable file: %s", override, strerror(errno));
            goto out;
        }
        st = chat_tmpl_init_jinja(t, file, len, bos, eos);
        if (st) st = bt_fail(st, "--chat-template %s: %s", override, bt_last_error());
        goto out;
    }
    st = chat_tmpl_init(t, text.ptr, (size_t)text.len, override, bos, eos);
out:
    free(file);
    free(bos);
    free(eos);
    return st;
}

void chat_tmpl_free(chat_tmpl *t)
{
    free(t->bos);
    free(t->eos);
    free(t->default_system);
    jinja_free(t->jinja);
    t->bos = t->eos = t->default_system = NULL;
    t->jinja = NULL;
}

/* ---- rendering ---- */


/* Python's str.isspace: White_Space plus the information separators U+001C..U+001F. */
static int py_space(uint32_t cp) { return uni_is_space(cp) || (cp >= 0x1C && cp <= 0x1F); }

/* Jinja's |trim (Python str.strip()). */
static void put_trimmed(bt_strbuf *b, const char *s, size_t n)
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
    bt_strbuf_put(b, s + a, e - a);
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

/* The template's variables as HF apply_chat_template passes them: messages (role, content, then the extra fields),
 * tools (none when absent), documents (none), add_generation_prompt, bos_token, eos_token. NULL with the error set. */
static bt_status jinja_vars(const chat_tmpl *t, const chat_msg *msgs, size_t n, const chat_render_opts *o,
                            cJSON **out)
{
    cJSON *vars = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(vars, "messages"), *tools = NULL;
    if (!vars || !list) goto nomem;
    for (size_t i = 0; i < n; i++) {
        cJSON *m = cJSON_CreateObject(), *extra = NULL;
        if (!m) goto nomem;
        cJSON_AddItemToArray(list, m);
        if (!cJSON_AddStringToObject(m, "role", msgs[i].role ? msgs[i].role : "")) goto nomem;
        if (msgs[i].content) {
            char *c = malloc(msgs[i].content_len + 1);
            if (!c) goto nomem;
            memcpy(c, msgs[i].content, msgs[i].content_len);
            c[msgs[i].content_len] = 0; /* a NUL inside content ends it here, as JSON text cannot carry it raw */
            cJSON *s = cJSON_AddStringToObject(m, "content", c);
            free(c);
            if (!s) goto nomem;
        } else if (!cJSON_AddNullToObject(m, "content")) {
            goto nomem;
        }
        if (!msgs[i].extra_json) continue;
        if (!(extra = cJSON_Parse(msgs[i].extra_json)) || !cJSON_IsObject(extra)) {
            cJSON_Delete(extra);
            cJSON_Delete(vars);
            return bt_fail(BT_ERR_INVALID, "chat template: message %zu's extra fields are not a JSON object", i);
        }
        for (cJSON *e = extra->child, *next; e; e = next) {
            next = e->next;
            if (!strcmp(e->string, "role") || !strcmp(e->string, "content")) continue;
            cJSON_AddItemToObject(m, e->string, cJSON_DetachItemViaPointer(extra, e));
        }
        cJSON_Delete(extra);
    }
    if (o->tools_json) {
        if (!(tools = cJSON_Parse(o->tools_json))) {
            cJSON_Delete(vars);
            return bt_fail(BT_ERR_INVALID, "chat template: tools are not valid JSON");
        }
        cJSON_AddItemToObject(vars, "tools", tools);
    } else if (!cJSON_AddNullToObject(vars, "tools")) {
        goto nomem;
    }
    if (!cJSON_AddNullToObject(vars, "documents") ||
        !cJSON_AddBoolToObject(vars, "add_generation_prompt", o->add_generation_prompt) ||
        !cJSON_AddStringToObject(vars, "bos_token", t->bos ? t->bos : "") ||
        !cJSON_AddStringToObject(vars, "eos_token", t->eos ? t->eos : ""))
        goto nomem;
    *out = vars;
    return BT_OK;
nomem:
    cJSON_Delete(vars);
    return bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
}

static bt_status render_builtin(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                                char **out, size_t *out_len);

static bt_status render_jinja(const chat_tmpl *t, const chat_msg *msgs, size_t n, const chat_render_opts *o,
                              char **out, size_t *out_len)
{
    cJSON *vars = NULL;
    bt_status st = jinja_vars(t, msgs, n, o, &vars);
    if (st) return st;
    st = jinja_render(t->jinja, vars, o->now ? o->now : (int64_t)time(NULL), NULL, out, out_len);
    cJSON_Delete(vars);
    if (st) return bt_fail(st, "chat template %s", bt_last_error());
    return BT_OK;
}

bt_status chat_tmpl_render(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                           char **out, size_t *out_len)
{
    chat_render_opts o = {.add_generation_prompt = add_generation_prompt};
    return chat_tmpl_render_opts(t, msgs, n, &o, out, out_len);
}

bt_status chat_tmpl_render_opts(const chat_tmpl *t, const chat_msg *msgs, size_t n, const chat_render_opts *o,
                                char **out, size_t *out_len)
{
    if (t->kind == CHAT_TMPL_JINJA) return render_jinja(t, msgs, n, o, out, out_len);
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].content) continue;
        /* the built-in renderers read content as text: a message without content renders as empty */
        chat_msg *copy = malloc((n ? n : 1) * sizeof *copy);
        if (!copy) return bt_fail(BT_ERR_NOMEM, "chat template: out of memory");
        for (size_t k = 0; k < n; k++) {
            copy[k] = msgs[k];
            if (!copy[k].content) copy[k].content = "", copy[k].content_len = 0;
        }
        bt_status st = render_builtin(t, copy, n, o->add_generation_prompt, out, out_len);
        free(copy);
        return st;
    }
    return render_builtin(t, msgs, n, o->add_generation_prompt, out, out_len);
}

static bt_status render_builtin(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                                char **out, size_t *out_len)
{
    bt_strbuf b = {0};
    bt_status st = BT_OK;
    bt_strbuf_put(&b, "", 0);
    switch (t->kind) {
    case CHAT_TMPL_CHATML:
        for (size_t i = 0; i < n; i++) {
            if (i == 0 && t->default_system && !role_is(&msgs[0], "system")) {
                bt_strbuf_puts(&b, "<|im_start|>system\n");
                bt_strbuf_puts(&b, t->default_system);
                bt_strbuf_puts(&b, "<|im_end|>\n");
            }
            bt_strbuf_puts(&b, "<|im_start|>");
            bt_strbuf_puts(&b, msgs[i].role ? msgs[i].role : "");
            bt_strbuf_puts(&b, "\n");
            bt_strbuf_put(&b, msgs[i].content, msgs[i].content_len);
            bt_strbuf_puts(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt) bt_strbuf_puts(&b, "<|im_start|>assistant\n");
        break;
    case CHAT_TMPL_LLAMA3:
        for (size_t i = 0; i < n; i++) {
            if (i == 0) bt_strbuf_puts(&b, t->bos);
            bt_strbuf_puts(&b, "<|start_header_id|>");
            bt_strbuf_puts(&b, msgs[i].role ? msgs[i].role : "");
            bt_strbuf_puts(&b, "<|end_header_id|>\n\n");
            put_trimmed(&b, msgs[i].content, msgs[i].content_len);
            bt_strbuf_puts(&b, "<|eot_id|>");
        }
        if (add_generation_prompt) bt_strbuf_puts(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_TMPL_MISTRAL: {
        size_t first = n > 0 && role_is(&msgs[0], "system") ? 1 : 0;
        if ((st = check_alternation(msgs, n, first, "mistral"))) goto fail;
        bt_strbuf_puts(&b, t->bos);
        for (size_t i = first; i < n; i++) {
            if (role_is(&msgs[i], "user")) {
                bt_strbuf_puts(&b, "[INST] ");
                if (first && i == 1) {
                    bt_strbuf_put(&b, msgs[0].content, msgs[0].content_len);
                    bt_strbuf_puts(&b, "\n\n");
                }
                bt_strbuf_put(&b, msgs[i].content, msgs[i].content_len);
                bt_strbuf_puts(&b, " [/INST]");
            } else {
                bt_strbuf_put(&b, msgs[i].content, msgs[i].content_len);
                bt_strbuf_puts(&b, t->eos);
            }
        }
        break;
    }
    case CHAT_TMPL_GEMMA: {
        size_t first = n > 0 && role_is(&msgs[0], "system") ? 1 : 0;
        if ((st = check_alternation(msgs, n, first, "gemma"))) goto fail;
        bt_strbuf_puts(&b, t->bos);
        for (size_t i = first; i < n; i++) {
            bt_strbuf_puts(&b, "<start_of_turn>");
            bt_strbuf_puts(&b, role_is(&msgs[i], "assistant") ? "model" : msgs[i].role);
            bt_strbuf_puts(&b, "\n");
            if (first && i == 1) {
                bt_strbuf_put(&b, msgs[0].content, msgs[0].content_len);
                bt_strbuf_puts(&b, "\n\n");
            }
            put_trimmed(&b, msgs[i].content, msgs[i].content_len);
            bt_strbuf_puts(&b, "<end_of_turn>\n");
        }
        if (add_generation_prompt) bt_strbuf_puts(&b, "<start_of_turn>model\n");
        break;
    }
    case CHAT_TMPL_ZEPHYR:
        for (size_t i = 0; i < n; i++) {
            if (role_is(&msgs[i], "user") || role_is(&msgs[i], "system") || role_is(&msgs[i], "assistant")) {
                bt_strbuf_puts(&b, "<|");
                bt_strbuf_puts(&b, msgs[i].role ? msgs[i].role : "");
                bt_strbuf_puts(&b, "|>\n");
                bt_strbuf_put(&b, msgs[i].content, msgs[i].content_len);
                bt_strbuf_puts(&b, t->eos);
                bt_strbuf_puts(&b, "\n");
            }
            if (i + 1 == n && add_generation_prompt) bt_strbuf_puts(&b, "<|assistant|>\n");
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
