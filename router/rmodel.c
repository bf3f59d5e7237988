/* The served model as the router sees it: tokenizer, chat template, names and context; no weights. */
#include "router/router.h"

#include "common/log.h"
#include "engine/gguf.h"
#include "router/tool_calls.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* A positive arch-prefixed integer key, or 0 when absent or out of range (the router only estimates with it). */
static int32_t arch_i32(const gguf_file *f, const char *arch, const char *name)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, name);
    uint64_t v;
    return gguf_get_u64(f, key, &v) == BT_OK && v > 0 && v < (1u << 20) ? (int32_t)v : 0;
}

/* Attention shape and the KV bytes per token it implies (for the transfer-time estimate of remote prefill).
 * Missing keys follow the engine's defaults: head_count_kv = head_count, key_length = embedding / head_count. */
static void load_attention_shape(const gguf_file *f, const char *arch, rtr_model_t *m)
{
    int32_t n_embd = arch_i32(f, arch, "embedding_length");
    m->n_embd = n_embd;
    int32_t n_head = arch_i32(f, arch, "attention.head_count");
    m->n_layer = arch_i32(f, arch, "block_count");
    m->n_head_kv = arch_i32(f, arch, "attention.head_count_kv");
    if (!m->n_head_kv) m->n_head_kv = n_head;
    m->head_dim = arch_i32(f, arch, "attention.key_length");
    if (!m->head_dim && n_head) m->head_dim = n_embd / n_head;
    m->kv_bytes_per_token = (double)m->n_layer * 2.0 * m->n_head_kv * m->head_dim * 2.0;
}

bt_status rtr_model_load(const char *path, int32_t max_ctx, rtr_model_t *out)
{
    return rtr_model_load_tmpl(path, max_ctx, NULL, out);
}

bt_status rtr_model_load_tmpl(const char *path, int32_t max_ctx, const char *chat_template, rtr_model_t *out)
{
    rtr_model_t m;
    memset(&m, 0, sizeof m);
    gguf_file *f = NULL;
    bt_status st = gguf_open(path, &f);
    if (st) return st;
    if ((st = tok_create(f, &m.tok))) goto fail;
    if ((st = chat_tmpl_init_gguf(&m.tmpl, f, chat_template)) == BT_OK) {
        m.has_tmpl = 1;
        BT_INFO("router", "chat template of %s: %s", path, m.tmpl.why);
    } else if (chat_template) {
        goto fail; /* a template asked for that cannot be used stops the start */
    } else {
        BT_WARN("router", "no usable chat template in %s (%s): chat requests will be refused", path, bt_last_error());
    }
    const char *slash = strrchr(path, '/');
    snprintf(m.base, sizeof m.base, "%s", slash ? slash + 1 : path);
    char *dot = strstr(m.base, ".gguf");
    if (dot && dot[5] == '\0') *dot = '\0';
    gguf_str s;
    if (gguf_get_str(f, "general.name", &s) == BT_OK && s.len)
        gguf_str_copy(s, m.long_name, sizeof m.long_name);
    else
        snprintf(m.long_name, sizeof m.long_name, "%s", m.base);
    rtr_model_short_id(m.base, m.name, sizeof m.name);
    int64_t ctx = 2048;
    if (gguf_get_str(f, "general.architecture", &s) == BT_OK && s.len) {
        char arch[64], key[128];
        gguf_str_copy(s, arch, sizeof arch);
        snprintf(key, sizeof key, "%s.context_length", arch);
        uint64_t v;
        if (gguf_get_u64(f, key, &v) == BT_OK && v > 0 && v < (1u << 30)) ctx = (int64_t)v;
        load_attention_shape(f, arch, &m);
    }
    if (max_ctx <= 0) max_ctx = RTR_DEFAULT_MAX_CONTEXT;
    m.n_ctx = (int32_t)(ctx < max_ctx ? ctx : max_ctx);
    struct stat sb;
    m.created = stat(path, &sb) == 0 ? (int64_t)sb.st_mtime : 0;
    m.fingerprint_u64 = gguf_fingerprint(f);
    snprintf(m.fingerprint, sizeof m.fingerprint, "%016llx", (unsigned long long)m.fingerprint_u64);
    gguf_close(f);
    *out = m;
    return BT_OK;
fail:
    tok_free(m.tok);
    gguf_close(f);
    return st;
}

/* A --chat-template FILE's text (at most 8 MiB, as the loader reads it) into *out (caller frees). */
static bt_status read_small_file(const char *path, char **out, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return bt_fail(errno == ENOENT ? BT_ERR_NOT_FOUND : BT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    size_t cap = (size_t)8 << 20;
    char *buf = malloc(cap + 1);
    size_t n = buf ? fread(buf, 1, cap, fp) : 0;
    int err = !buf || ferror(fp);
    fclose(fp);
    if (err) {
        bt_status st = buf ? bt_fail(BT_ERR_IO, "cannot read %s", path) : bt_fail(BT_ERR_NOMEM, "out of memory");
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return BT_OK;
}

bt_status rtr_model_tools_init(rtr_model_t *m, const char *path, const char *chat_template, const char *parser)
{
    char *text = NULL;
    size_t len = 0;
    gguf_file *f = NULL;
    bt_status st = BT_OK;
    if (m->has_tmpl && m->tmpl.kind == CHAT_TMPL_JINJA) { /* built-in renderers never render tools */
        if (chat_template) {
            if ((st = read_small_file(chat_template, &text, &len))) return st;
        } else {
            gguf_str s;
            if ((st = gguf_open(path, &f))) return st;
            if (gguf_get_str(f, "tokenizer.chat_template", &s) == BT_OK && s.len) {
                if (!(text = malloc((size_t)s.len + 1))) st = bt_fail(BT_ERR_NOMEM, "out of memory");
                else {
                    memcpy(text, s.ptr, (size_t)s.len);
                    text[s.len] = 0;
                    len = (size_t)s.len;
                }
            }
            gguf_close(f);
            if (st) return st;
        }
    }
    rtr_tool_format fmt;
    if ((st = rtr_tool_format_choose(parser, text, len, &fmt))) {
        free(text);
        return st;
    }
    m->tool_format = (int)fmt;
    m->tmpl_renders_tools = text && strstr(text, "tools") != NULL;
    m->tmpl_renders_tool_calls = text && strstr(text, "tool_calls") != NULL;
    free(text);
    BT_INFO("router", "tool calling: parser %s%s; the chat template %s tools", rtr_tool_format_name(fmt),
            parser && strcmp(parser, "auto") ? " (--tool-call-parser)" : " (detected)",
            m->tmpl_renders_tools ? "renders" : "does not render");
    return BT_OK;
}

void rtr_model_free(rtr_model_t *m)
{
    tok_free(m->tok);
    if (m->has_tmpl) chat_tmpl_free(&m->tmpl);
    memset(m, 0, sizeof *m);
}

/* 1 when a file name's last tag is a GGUF quantization or float type: Q4_1, q4_k_m, IQ2_XS, F16, BF16, ... */
static int quant_tag(const char *t)
{
    if (!strcasecmp(t, "f16") || !strcasecmp(t, "f32") || !strcasecmp(t, "bf16")) return 1;
    if (tolower((unsigned char)t[0]) == 'i') t++;
    return tolower((unsigned char)t[0]) == 'q' && isdigit((unsigned char)t[1]);
}

void rtr_model_short_id(const char *base, char *out, size_t cap)
{
    snprintf(out, cap, "%s", base);
    for (char *p = out; *p; p++) *p = (char)tolower((unsigned char)*p);
    char *dot = strrchr(out, '.'), *dash = strrchr(out, '-');
    char *cut = dot > dash ? dot : dash;
    if (cut && cut != out && quant_tag(cut + 1)) *cut = '\0';
}

int rtr_model_matches(const rtr_model_t *m, const char *name)
{
    if (!name || !*name) return 1;
    if (!strcmp(name, m->name) || !strcmp(name, m->long_name) || !strcmp(name, m->base)) return 1;
    size_t lb = strlen(m->base), ln = strlen(name);
    return ln == lb + 5 && !strncmp(name, m->base, lb) && !strcmp(name + lb, ".gguf");
}
