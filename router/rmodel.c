/* The served model as the router sees it: tokenizer, chat template, names and context; no weights. */
#include "router/router.h"

#include "common/log.h"
#include "engine/gguf.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

bt_status rtr_model_load(const char *path, int32_t max_ctx, rtr_model_t *out)
{
    rtr_model_t m;
    memset(&m, 0, sizeof m);
    gguf_file *f = NULL;
    bt_status st = gguf_open(path, &f);
    if (st) return st;
    if ((st = tok_create(f, &m.tok))) goto fail;
    if (chat_tmpl_init_gguf(&m.tmpl, f, NULL) == BT_OK) {
        m.has_tmpl = 1;
    } else {
        BT_WARN("router", "no usable chat template in %s (%s): chat requests will be refused", path, bt_last_error());
    }
    const char *slash = strrchr(path, '/');
    snprintf(m.base, sizeof m.base, "%s", slash ? slash + 1 : path);
    char *dot = strstr(m.base, ".gguf");
    if (dot && dot[5] == '\0') *dot = '\0';
    gguf_str s;
    if (gguf_get_str(f, "general.name", &s) == BT_OK && s.len)
        gguf_str_copy(s, m.name, sizeof m.name);
    else
        snprintf(m.name, sizeof m.name, "%s", m.base);
    int64_t ctx = 2048;
    if (gguf_get_str(f, "general.architecture", &s) == BT_OK && s.len) {
        char arch[64], key[128];
        gguf_str_copy(s, arch, sizeof arch);
        snprintf(key, sizeof key, "%s.context_length", arch);
        uint64_t v;
        if (gguf_get_u64(f, key, &v) == BT_OK && v > 0 && v < (1u << 30)) ctx = (int64_t)v;
    }
    if (max_ctx <= 0) max_ctx = RTR_DEFAULT_MAX_CONTEXT;
    m.n_ctx = (int32_t)(ctx < max_ctx ? ctx : max_ctx);
    struct stat sb;
    m.created = stat(path, &sb) == 0 ? (int64_t)sb.st_mtime : 0;
    snprintf(m.fingerprint, sizeof m.fingerprint, "%016llx", (unsigned long long)gguf_fingerprint(f));
    gguf_close(f);
    *out = m;
    return BT_OK;
fail:
    tok_free(m.tok);
    gguf_close(f);
    return st;
}

void rtr_model_free(rtr_model_t *m)
{
    tok_free(m->tok);
    if (m->has_tmpl) chat_tmpl_free(&m->tmpl);
    memset(m, 0, sizeof *m);
}

int rtr_model_matches(const rtr_model_t *m, const char *name)
{
    if (!name || !*name) return 1;
    if (!strcmp(name, m->name) || !strcmp(name, m->base)) return 1;
    size_t lb = strlen(m->base), ln = strlen(name);
    return ln == lb + 5 && !strncmp(name, m->base, lb) && !strcmp(name + lb, ".gguf");
}
