/* OpenAI-compatible HTTP API (DESIGN 9): /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models,
 * /tokenize, /detokenize, /health.
 * Validation happens here, before anything reaches a node: wrong types are refused naming the field, unknown
 * fields are ignored, and the prompt plus max_tokens must fit the context. */
#include "router/router.h"

#include "common/log.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A client error: 400 with a message that names the field. */
#include "engine/grammar.h"
#include "router/json_schema.h"
#include "router/tool_calls.h"

#define bad(http_status, ...) (*(http_status) = 400, bt_fail(BT_ERR_INVALID, __VA_ARGS__))

/* A JSON field that is absent or null counts as not given. */
static const cJSON *field(const cJSON *body, const char *name)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(body, name);
    return f && !cJSON_IsNull(f) ? f : NULL;
}

static bt_status get_num(const cJSON *body, const char *name, double lo, double hi, float *out, int *has,
                         int *http_status)
{
    const cJSON *f = field(body, name);
    if (!f) return BT_OK;
    if (!cJSON_IsNumber(f)) return bad(http_status, "'%s' must be a number", name);
    double v = f->valuedouble;
    if (!(v >= lo && v <= hi)) {
        *http_status = 400;
        return bt_fail(BT_ERR_INVALID, "'%s' must be in [%g, %g]", name, lo, hi);
    }
    *out = (float)v;
    if (has) *has = 1;
    return BT_OK;
}

static bt_status get_int(const cJSON *body, const char *name, double lo, double hi, int64_t *out, int *has,
                         int *http_status)
{
    const cJSON *f = field(body, name);
    if (!f) return BT_OK;
    if (!cJSON_IsNumber(f) || f->valuedouble != floor(f->valuedouble) || !isfinite(f->valuedouble))
        return bad(http_status, "'%s' must be an integer", name);
    double v = f->valuedouble;
    if (v < lo || v > hi) {
        *http_status = 400;
        return bt_fail(BT_ERR_INVALID, "'%s' must be in [%.0f, %.0f]", name, lo, hi);
    }
    *out = (int64_t)v;
    if (has) *has = 1;
    return BT_OK;
}

static bt_status get_bool(const cJSON *body, const char *name, int *out, int *http_status)
{
    const cJSON *f = field(body, name);
    if (!f) return BT_OK;
    if (!cJSON_IsBool(f)) return bad(http_status, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(f);
    return BT_OK;
}

static int valid_utf8(const char *s)
{
    char *t = rtr_utf8_sanitize(s, strlen(s));
    int ok = t && !strcmp(t, s);
    free(t);
    return ok;
}

static bt_status parse_stop(const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const cJSON *f = field(body, "stop");
    if (!f) return BT_OK;
    const cJSON *items[RTR_MAX_STOP];
    int n = 0;
    if (cJSON_IsString(f)) {
        items[n++] = f;
    } else if (cJSON_IsArray(f)) {
        int k = cJSON_GetArraySize(f);
        if (k > RTR_MAX_STOP) {
            *http_status = 400;
            return bt_fail(BT_ERR_INVALID, "'stop' may hold at most %d strings", RTR_MAX_STOP);
        }
        const cJSON *e;
        cJSON_ArrayForEach(e, f) {
            if (!cJSON_IsString(e)) return bad(http_status, "'%s' must be a string or an array of strings", "stop");
            items[n++] = e;
        }
    } else {
        return bad(http_status, "'%s' must be a string or an array of strings", "stop");
    }
    for (int i = 0; i < n; i++) {
        const char *s = items[i]->valuestring;
        size_t len = strlen(s);
        if (!len) continue;
        if (len > RTR_MAX_STOP_LEN) {
            *http_status = 400;
            return bt_fail(BT_ERR_INVALID, "'stop' strings may be at most %d bytes", RTR_MAX_STOP_LEN);
        }
        if (!valid_utf8(s)) return bad(http_status, "'%s' strings must be valid UTF-8", "stop");
        g->stops[g->n_stop] = strdup(s);
        if (!g->stops[g->n_stop]) return bt_fail(BT_ERR_NOMEM, "out of memory");
        g->n_stop++;
    }
    return BT_OK;
}

static bt_status parse_logit_bias(const rtr_model_t *m, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const cJSON *f = field(body, "logit_bias");
    if (!f) return BT_OK;
    if (!cJSON_IsObject(f)) return bad(http_status, "'%s' must be an object of token id -> bias", "logit_bias");
    const cJSON *e;
    cJSON_ArrayForEach(e, f) {
        if (g->n_logit_bias >= RTR_MAX_LOGIT_BIAS) {
            *http_status = 400;
            return bt_fail(BT_ERR_INVALID, "'logit_bias' may hold at most %d entries", RTR_MAX_LOGIT_BIAS);
        }
        char *end;
        long id = strtol(e->string, &end, 10);
        if (!*e->string || *end || id < 0 || id >= tok_n_vocab(m->tok)) {
            *http_status = 400;
            return bt_fail(BT_ERR_INVALID, "'logit_bias' key '%.32s' is not a token id of this model", e->string);
        }
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= -100 && e->valuedouble <= 100))
            return bad(http_status, "'%s' values must be numbers in [-100, 100]", "logit_bias");
        /* "7" and "07" name one token: the sampler wants distinct ids */
        for (int i = 0; i < g->n_logit_bias; i++)
            if (g->logit_bias_ids[i] == id) {
                *http_status = 400;
                return bt_fail(BT_ERR_INVALID, "'logit_bias' names token %ld twice", id);
            }
        g->logit_bias_ids[g->n_logit_bias] = (int32_t)id;
        g->logit_bias[g->n_logit_bias] = (float)e->valuedouble;
        g->n_logit_bias++;
    }
    return BT_OK;
}

/* Content of a chat message: a string, or an array of {type: "text", text} parts (concatenated) into *out. */
static bt_status message_content(const cJSON *c, char **out, int idx, int *http_status)
{
    if (!c || cJSON_IsNull(c)) {
        *out = strdup("");
        return *out ? BT_OK : BT_ERR_NOMEM;
    }
    if (cJSON_IsString(c)) {
        *out = strdup(c->valuestring);
        return *out ? BT_OK : BT_ERR_NOMEM;
    }
    if (!cJSON_IsArray(c)) {
        *http_status = 400;
        return bt_fail(BT_ERR_INVALID, "'messages[%d].content' must be a string or an array of text parts", idx);
    }
    size_t n = 0;
    char *s = calloc(1, 1);
    const cJSON *p;
    cJSON_ArrayForEach(p, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(p, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(p, "text");
        if (!cJSON_IsObject(p) || !cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            free(s);
            *http_status = 400;
            return bt_fail(BT_ERR_INVALID, "'messages[%d].content' parts must be {\"type\": \"text\", \"text\": ...}",
                           idx);
        }
        size_t l = strlen(text->valuestring);
        char *q = realloc(s, n + l + 1);
        if (!q) {
            free(s);
            return bt_fail(BT_ERR_NOMEM, "out of memory");
        }
        s = q;
        memcpy(s + n, text->valuestring, l + 1);
        n += l;
    }
    *out = s;
    return BT_OK;
}

static bt_status encode(const rtr_model_t *m, const char *text, size_t len, unsigned flags, rtr_gen_t *g)
{
    tok_ids ids = {0};
    bt_status st = tok_encode(m->tok, text, len, flags, &ids);
    if (st) {
        tok_ids_free(&ids);
        return st;
    }
    g->prompt = ids.ids;
    g->n_prompt = ids.n;
    return BT_OK;
}

int rtr_chat_role_ok(const char *role)
{
    static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
    for (size_t i = 0; i < sizeof roles / sizeof *roles; i++)
        if (!strcmp(role, roles[i])) return 1;
    return 0;
}

/* CONTROL tokens (chat markers, BOS/EOS) among ids: what message content must never produce. */
static size_t n_control(const tok_tokenizer *t, const int32_t *ids, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += tok_token_type(t, ids[i]) == TOK_TYPE_CONTROL;
    return k;
}

/* Placeholder content "<U+E000><index><U+E000>": a private-use character, which no template emits and which is not
 * whitespace, so |trim and strip() keep it (an ASCII control such as \x1f is whitespace to Python and was trimmed). */
#define PH_MARK "\xEE\x80\x80"
#define PH_MARK_LEN 3

/* Parses a placeholder at s[0..end): its message index and length, or 0 when s does not start one. */
static size_t placeholder_at(const char *s, const char *end, size_t n_msgs, size_t *idx)
{
    if (end - s < PH_MARK_LEN || memcmp(s, PH_MARK, PH_MARK_LEN)) return 0;
    size_t v = 0, i = PH_MARK_LEN;
    while (s + i < end && s[i] >= '0' && s[i] <= '9' && i < PH_MARK_LEN + 11) v = v * 10 + (size_t)(s[i++] - '0');
    if (i == PH_MARK_LEN || end - (s + i) < PH_MARK_LEN || memcmp(s + i, PH_MARK, PH_MARK_LEN) || v >= n_msgs)
        return 0;
    *idx = v;
    return i + PH_MARK_LEN;
}

static int ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* Content as the template places it: llama3 and gemma trim it (Jinja's |trim). A Jinja template may trim it or
 * not, so its placeholder carries the content's outer whitespace (placeholder_text) and the span is the rest. */
static void content_span(const rtr_model_t *m, const chat_msg *c, const char **p, size_t *len)
{
    const char *s = c->content ? c->content : "", *e = s + (c->content ? c->content_len : 0);
    if (m->tmpl.kind == CHAT_TMPL_LLAMA3 || m->tmpl.kind == CHAT_TMPL_GEMMA || m->tmpl.kind == CHAT_TMPL_JINJA) {
        while (s < e && ascii_space(*s)) s++;
        while (e > s && ascii_space(e[-1])) e--;
    }
    *p = s;
    *len = (size_t)(e - s);
}

/* The placeholder of message i; for a Jinja template between the content's leading and trailing whitespace (see
 * content_span). */
static bt_status placeholder_text(const rtr_model_t *m, const chat_msg *c, size_t i, char **out)
{
    const char *s = c->content ? c->content : "", *e = s + (c->content ? c->content_len : 0), *a = s, *b = e;
    if (m->tmpl.kind == CHAT_TMPL_JINJA) {
        while (a < e && ascii_space(*a)) a++;
        while (b > a && ascii_space(b[-1])) b--;
    } else {
        a = s; /* the built-in renderers place the placeholder as given */
        b = e;
    }
    size_t lead = (size_t)(a - s), trail = (size_t)(e - b);
    char *t = malloc(lead + trail + 32);
    if (!t) return bt_fail(BT_ERR_NOMEM, "out of memory");
    memcpy(t, s, lead);
    int k = snprintf(t + lead, 32, "%s%zu%s", PH_MARK, i, PH_MARK);
    memcpy(t + lead + (size_t)k, b, trail);
    t[lead + (size_t)k + trail] = 0;
    *out = t;
    return BT_OK;
}

/* Renders msgs with placeholder contents, then encodes the template's text with its special markers and each
 * message's content as plain text in their places. */
static bt_status encode_segments(const rtr_model_t *m, const chat_msg *msgs, size_t n, const char *tools_json,
                                 tok_ids *out)
{
    chat_msg *ph = calloc(n, sizeof *ph);
    char **txt = calloc(n, sizeof *txt);
    char *skel = NULL;
    size_t len = 0;
    bt_status st = BT_OK;
    if (!ph || !txt) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        if ((st = placeholder_text(m, &msgs[i], i, &txt[i]))) goto out;
        ph[i] = (chat_msg){msgs[i].role, txt[i], strlen(txt[i]), msgs[i].extra_json};
    }
    const chat_render_opts o = {.add_generation_prompt = 1, .tools_json = tools_json};
    if ((st = chat_tmpl_render_opts(&m->tmpl, ph, n, &o, &skel, &len))) goto out;
    const char *s = skel, *end = skel + len, *run = skel;
    while (s < end && !st) {
        size_t idx, k = placeholder_at(s, end, n, &idx);
        if (!k) {
            s++;
            continue;
        }
        const char *c;
        size_t clen;
        content_span(m, &msgs[idx], &c, &clen);
        if ((s > run && (st = tok_encode(m->tok, run, (size_t)(s - run), TOK_PARSE_SPECIAL, out))) ||
            (clen && (st = tok_encode(m->tok, c, clen, 0, out))))
            break;
        s += k;
        run = s;
    }
    if (!st && end > run) st = tok_encode(m->tok, run, (size_t)(end - run), TOK_PARSE_SPECIAL, out);
out:
    free(skel);
    for (size_t i = 0; txt && i < n; i++) free(txt[i]);
    free(txt);
    free(ph);
    return st;
}

bt_status rtr_chat_encode(const rtr_model_t *m, const chat_msg *msgs, size_t n, tok_ids *out)
{
    return rtr_chat_encode_tools(m, msgs, n, NULL, out);
}

bt_status rtr_chat_encode_tools(const rtr_model_t *m, const chat_msg *msgs, size_t n, const char *tools_json,
                                tok_ids *out)
{
    char *text = NULL, *skel = NULL;
    size_t len = 0, slen = 0;
    tok_ids full = {0}, bare = {0};
    const chat_render_opts o = {.add_generation_prompt = 1, .tools_json = tools_json};
    bt_status st = chat_tmpl_render_opts(&m->tmpl, msgs, n, &o, &text, &len);
    if (st || (st = tok_encode(m->tok, text, len, TOK_PARSE_SPECIAL, &full))) goto out;
    /* the same template with empty contents: how many markers the template itself produces */
    chat_msg *empty = calloc(n, sizeof *empty);
    if (!empty) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) empty[i] = (chat_msg){msgs[i].role, "", 0, msgs[i].extra_json};
    st = chat_tmpl_render_opts(&m->tmpl, empty, n, &o, &skel, &slen);
    free(empty);
    if (st == BT_ERR_INVALID) {
        /* a Jinja template may refuse empty contents (raise_exception): place the contents by placeholders */
        st = BT_OK;
    } else if (st || (st = tok_encode(m->tok, skel, slen, TOK_PARSE_SPECIAL, &bare))) {
        goto out;
    } else if (n_control(m->tok, full.ids, full.n) == n_control(m->tok, bare.ids, bare.n)) {
        *out = full; /* no content produced a marker: the usual tokens, byte for byte */
        full = (tok_ids){0};
        goto out;
    }
    tok_ids seg = {0};
    if ((st = encode_segments(m, msgs, n, tools_json, &seg))) {
        tok_ids_free(&seg);
        goto out;
    }
    *out = seg;
out:
    tok_ids_free(&full);
    tok_ids_free(&bare);
    free(text);
    free(skel);
    return st;
}

size_t rtr_prompt_max_bytes(const rtr_model_t *m)
{
    size_t b = (size_t)m->n_ctx * RTR_PROMPT_BYTES_PER_TOKEN;
    return b < RTR_PROMPT_MIN_BYTES ? RTR_PROMPT_MIN_BYTES : b;
}

/* Bytes of text in a message's content (string or text parts), without copying it. */
static size_t content_bytes(const cJSON *c)
{
    if (cJSON_IsString(c)) return strlen(c->valuestring);
    size_t n = 0;
    const cJSON *p;
    if (cJSON_IsArray(c))
        cJSON_ArrayForEach(p, c) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "text");
            if (cJSON_IsString(t)) n += strlen(t->valuestring);
        }
    return n;
}

/* Issue 16.5: text that cannot fit the context is refused before it is copied, rendered or tokenized. */
static bt_status check_prompt_bytes(const rtr_model_t *m, size_t bytes, int *http_status)
{
    size_t max = rtr_prompt_max_bytes(m);
    if (bytes <= max) return BT_OK;
    *http_status = 400;
    return bt_fail(BT_ERR_INVALID, "the prompt has %zu bytes of text; at most %zu fit this model's context of %d tokens",
                   bytes, max, m->n_ctx);
}

/* A tool message answers a call: it must name it. Calls in assistant messages reach the template only when it
 * renders them (else they would vanish from the prompt unseen). */
static bt_status check_tool_fields(const rtr_model_t *m, const cJSON *msg, const char *role, int idx,
                                   int *http_status)
{
    const cJSON *id = field(msg, "tool_call_id");
    if (!strcmp(role, "tool") && !(cJSON_IsString(id) && id->valuestring[0]))
        return bad(http_status, "'messages[%d].tool_call_id' is required for role 'tool'", idx);
    if (id && !cJSON_IsString(id)) return bad(http_status, "'messages[%d].tool_call_id' must be a string", idx);
    const cJSON *calls = field(msg, "tool_calls");
    if (calls && strcmp(role, "assistant") && !(cJSON_IsArray(calls) && cJSON_GetArraySize(calls) == 0))
        return bad(http_status, "'messages[%d].tool_calls' is only allowed in assistant messages", idx);
    if (calls && cJSON_IsArray(calls) && cJSON_GetArraySize(calls) > 0 && !m->tmpl_renders_tool_calls)
        return bad(http_status, "'messages[%d].tool_calls': the chat template does not render tool calls; start the "
                   "router with --chat-template FILE whose template does", idx);
    if (field(msg, "function_call"))
        return bad(http_status, "'messages[%d].function_call' (the deprecated functions API) is not supported: use "
                   "tool_calls", idx);
    return BT_OK;
}

/* A message's fields that the chat template sees besides role and content; other fields are ignored (README). */
static const char *const extra_fields[] = {"name", "tool_call_id", "tool_calls", "reasoning_content"};

/* The message's extra_fields as JSON text for the chat template, which sees them as plain data; *out stays NULL
 * when there are none. */
static bt_status message_extra(const cJSON *msg, int idx, char **out, int *http_status)
{
    *out = NULL;
    cJSON *copy = NULL;
    for (size_t i = 0; i < sizeof extra_fields / sizeof *extra_fields; i++) {
        const cJSON *f = field(msg, extra_fields[i]);
        if (!f) continue;
        if (!copy && !(copy = cJSON_CreateObject())) return bt_fail(BT_ERR_NOMEM, "out of memory");
        cJSON *d = NULL;
        if (!strcmp(extra_fields[i], "tool_calls")) {
            bt_status st = rtr_tools_message_calls(f, idx, &d); /* arguments as objects, as templates read them */
            if (st) {
                cJSON_Delete(copy);
                if (st == BT_ERR_INVALID) *http_status = 400;
                return st;
            }
        } else {
            d = cJSON_Duplicate(f, 1);
        }
        if (!d || !cJSON_AddItemToObject(copy, extra_fields[i], d)) {
            cJSON_Delete(d);
            cJSON_Delete(copy);
            return bt_fail(BT_ERR_NOMEM, "out of memory");
        }
    }
    if (!copy) return BT_OK;
    *out = cJSON_PrintUnformatted(copy);
    cJSON_Delete(copy);
    return *out ? BT_OK : bt_fail(BT_ERR_NOMEM, "out of memory");
}

bt_status rtr_chat_message_extra(const rtr_model_t *m, const cJSON *msg, const char *role, int idx, char **extra)
{
    int http_status = 400;
    *extra = NULL;
    bt_status st = check_tool_fields(m, msg, role, idx, &http_status);
    return st ? st : message_extra(msg, idx, extra, &http_status);
}

static bt_status chat_prompt(const rtr_model_t *m, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const cJSON *msgs = field(body, "messages");
    if (!msgs) return bad(http_status, "'%s' is required", "messages");
    if (!cJSON_IsArray(msgs)) return bad(http_status, "'%s' must be an array", "messages");
    int n = cJSON_GetArraySize(msgs);
    if (n == 0) return bad(http_status, "'%s' must not be empty", "messages");
    if (!m->has_tmpl) {
        *http_status = 400;
        return bt_fail(BT_ERR_INVALID, "this model has no chat template: use /v1/completions");
    }
    size_t total = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, msgs) total += content_bytes(cJSON_GetObjectItemCaseSensitive(e, "content"));
    if (g->tools && g->tools->tools_json) total += strlen(g->tools->tools_json); /* the template renders them too */
    bt_status st = check_prompt_bytes(m, total, http_status);
    if (st) return st;
    chat_msg *cm = calloc((size_t)n, sizeof *cm);
    char **contents = calloc((size_t)n, sizeof *contents), **extras = calloc((size_t)n, sizeof *extras);
    if (!cm || !contents || !extras) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    int i = 0;
    cJSON_ArrayForEach(e, msgs) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(e, "role");
        if (!cJSON_IsObject(e)) {
            *http_status = 400;
            st = bt_fail(BT_ERR_INVALID, "'messages[%d]' must be an object", i);
            goto out;
        }
        if (!cJSON_IsString(role)) {
            *http_status = 400;
            st = bt_fail(BT_ERR_INVALID, "'messages[%d].role' must be a string", i);
            goto out;
        }
        const char *r = role->valuestring;
        if (!rtr_chat_role_ok(r)) {
            *http_status = 400;
            st = bt_fail(BT_ERR_INVALID, "'messages[%d].role' must be system, developer, user, assistant or tool", i);
            goto out;
        }
        if ((st = check_tool_fields(m, e, r, i, http_status))) goto out;
        if ((st = message_content(cJSON_GetObjectItemCaseSensitive(e, "content"), &contents[i], i, http_status)))
            goto out;
        if (!valid_utf8(contents[i])) {
            *http_status = 400;
            st = bt_fail(BT_ERR_INVALID, "'messages[%d].content' is not valid UTF-8", i);
            goto out;
        }
        if ((st = message_extra(e, i, &extras[i], http_status))) goto out;
        cm[i] = (chat_msg){!strcmp(r, "developer") ? "system" : r, contents[i], strlen(contents[i]), extras[i]};
        i++;
    }
    tok_ids ids = {0};
    if ((st = rtr_chat_encode_tools(m, cm, (size_t)n, g->tools ? g->tools->tools_json : NULL, &ids))) {
        tok_ids_free(&ids);
        if (st == BT_ERR_INVALID) *http_status = 400;
        goto out;
    }
    g->prompt = ids.ids;
    g->n_prompt = ids.n;
out:
    for (int k = 0; contents && k < n; k++) free(contents[k]);
    for (int k = 0; extras && k < n; k++) free(extras[k]);
    free(contents);
    free(extras);
    free(cm);
    return st;
}

static bt_status completion_prompt(const rtr_model_t *m, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const cJSON *p = field(body, "prompt");
    if (!p) return bad(http_status, "'%s' is required", "prompt");
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1 && cJSON_IsString(cJSON_GetArrayItem(p, 0)))
        p = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsString(p)) {
        bt_status st = check_prompt_bytes(m, strlen(p->valuestring), http_status);
        if (st) return st;
        if (!valid_utf8(p->valuestring)) return bad(http_status, "'%s' is not valid UTF-8", "prompt");
        if (!*p->valuestring) return bad(http_status, "'%s' must not be empty", "prompt");
        return encode(m, p->valuestring, strlen(p->valuestring), TOK_PARSE_SPECIAL | TOK_ADD_SPECIAL, g);
    }
    if (!cJSON_IsArray(p))
        return bad(http_status, "'%s' must be a string or an array of token ids", "prompt");
    int n = cJSON_GetArraySize(p);
    g->prompt = calloc(n ? (size_t)n : 1, sizeof *g->prompt);
    if (!g->prompt) return bt_fail(BT_ERR_NOMEM, "out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, p) {
        if (cJSON_IsString(e))
            return bad(http_status, "'%s': only one prompt per request is supported", "prompt");
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble >= tok_n_vocab(m->tok))
            return bad(http_status, "'%s' token ids must be integers in the vocabulary", "prompt");
        g->prompt[g->n_prompt++] = (int32_t)e->valuedouble;
    }
    return BT_OK;
}

bt_status rtr_gen_check_context(const rtr_model_t *m, rtr_gen_t *g, int max_tokens_given)
{
    if (g->n_prompt == 0) return bt_fail(BT_ERR_INVALID, "the prompt is empty");
    if ((int64_t)g->n_prompt >= m->n_ctx)
        return bt_fail(BT_ERR_INVALID, "the prompt has %zu tokens; this model's context is %d tokens", g->n_prompt,
                       m->n_ctx);
    if (!max_tokens_given) g->max_tokens = (uint32_t)(m->n_ctx - (int32_t)g->n_prompt);
    if ((int64_t)g->n_prompt + g->max_tokens > m->n_ctx)
        return bt_fail(BT_ERR_INVALID,
                       "'max_tokens': the prompt (%zu tokens) plus max_tokens (%u) exceeds the context of %d tokens",
                       g->n_prompt, g->max_tokens, m->n_ctx);
    return BT_OK;
}

bt_status rtr_gen_take_grammar(bt_status st, char *grammar, const char *where, rtr_gen_t *g)
{
    bt_grammar *gr = NULL;
    if (!st) st = bt_grammar_parse(grammar, strlen(grammar), &gr);
    bt_grammar_free(gr);
    if (st) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        free(grammar);
        return bt_fail(st, "'%s': %s", where, msg);
    }
    g->grammar = grammar;
    return BT_OK;
}

/* 'model', when given, names the served model: else 404. */
static bt_status check_model(const rtr_model_t *m, const cJSON *body, int *http_status)
{
    const cJSON *model = field(body, "model");
    if (model && !cJSON_IsString(model)) return bad(http_status, "'%s' must be a string", "model");
    if (model && !rtr_model_matches(m, model->valuestring)) {
        *http_status = 404;
        return bt_fail(BT_ERR_NOT_FOUND, "The model '%.100s' does not exist (this server serves '%s')",
                       model->valuestring, m->name);
    }
    return BT_OK;
}

/* OpenAI fields baton does not honour yet are refused with 400 naming them, never ignored (a client would believe
 * its tools were applied). Values that ask for nothing are accepted: tools: [], tool_choice: "none",
 * modalities ["text"], store: false, suffix "", service_tier "auto"/"default". */
static bt_status check_unsupported(rtr_api api, const cJSON *body, int *http_status)
{
    static const char *const never[] = {"prediction", "audio", "reasoning_effort", "web_search_options"};
    for (size_t i = 0; i < sizeof never / sizeof *never; i++)
        if (field(body, never[i])) return bad(http_status, "'%s' is not supported", never[i]);
    static const char *const deprecated[] = {"functions", "function_call"};
    for (size_t i = 0; i < sizeof deprecated / sizeof *deprecated; i++)
        if (field(body, deprecated[i]))
            return bad(http_status, "'%s' (OpenAI's deprecated functions API) is not supported: use 'tools' and "
                       "'tool_choice'", deprecated[i]);
    const cJSON *f = field(body, "modalities");
    if (f && !(cJSON_IsArray(f) && cJSON_GetArraySize(f) == 1 && cJSON_IsString(f->child) &&
               !strcmp(f->child->valuestring, "text")))
        return bad(http_status, "'%s' other than [\"text\"] is not supported", "modalities");
    f = field(body, "store");
    if (f && !cJSON_IsFalse(f)) return bad(http_status, "'%s': true is not supported (baton stores nothing)", "store");
    f = field(body, "service_tier");
    if (f && !(cJSON_IsString(f) && (!strcmp(f->valuestring, "auto") || !strcmp(f->valuestring, "default"))))
        return bad(http_status, "'%s' must be \"auto\" or \"default\"", "service_tier");
    f = field(body, "suffix");
    if (api == RTR_API_COMPLETION && f && !(cJSON_IsString(f) && !f->valuestring[0]))
        return bad(http_status, "'%s' is not supported", "suffix");
    return BT_OK;
}

/* Grammar text, checked (rtr_gen_take_grammar): an error is the client's 400, 500 when out of memory. */
static bt_status take_grammar(bt_status st, char *grammar, const char *where, rtr_gen_t *g, int *http_status)
{
    if ((st = rtr_gen_take_grammar(st, grammar, where, g)) != BT_OK) *http_status = st == BT_ERR_NOMEM ? 500 : 400;
    return st;
}

/* response_format (issue 23): text; json_object; json_schema {name, schema, strict}; and baton's extensions
 * {"type": "regex", "regex": RE} and {"type": "grammar", "grammar": GBNF}. All become grammar text for the nodes
 * (router/json_schema.h); an unsupported schema keyword or a bad grammar is a 400 naming it. */
static bt_status parse_response_format(const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const cJSON *f = field(body, "response_format");
    if (!f) return BT_OK;
    const cJSON *type = cJSON_IsObject(f) ? cJSON_GetObjectItemCaseSensitive(f, "type") : NULL;
    if (!cJSON_IsString(type)) return bad(http_status, "'%s' must be an object with a string 'type'", "response_format");
    const char *t = type->valuestring;
    char *grammar = NULL;
    bt_status st;
    if (!strcmp(t, "text")) return BT_OK;
    if (!strcmp(t, "json_object")) {
        st = rtr_json_object_grammar(&grammar);
    } else if (!strcmp(t, "json_schema")) {
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(f, "json_schema");
        if (!cJSON_IsObject(js)) return bad(http_status, "'%s' must be an object", "response_format.json_schema");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(js, "name");
        if (name && !cJSON_IsString(name)) return bad(http_status, "'%s' must be a string", "response_format.json_schema.name");
        const cJSON *strict = cJSON_GetObjectItemCaseSensitive(js, "strict");
        if (strict && !cJSON_IsBool(strict) && !cJSON_IsNull(strict))
            return bad(http_status, "'%s' must be a boolean", "response_format.json_schema.strict");
        const cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema");
        if (!schema) return bad(http_status, "'%s' is required", "response_format.json_schema.schema");
        st = rtr_json_schema_grammar(schema, &grammar);
    } else if (!strcmp(t, "regex") || !strcmp(t, "grammar")) {
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(f, t);
        if (!cJSON_IsString(x)) return bad(http_status, "'response_format.%s' must be a string", t);
        if (!strcmp(t, "regex")) {
            st = rtr_regex_grammar(x->valuestring, &grammar);
        } else {
            grammar = strdup(x->valuestring);
            st = grammar ? BT_OK : bt_fail(BT_ERR_NOMEM, "out of memory");
        }
    } else {
        return bad(http_status, "'%s' type '%.40s' is not supported (text, json_object, json_schema, and the "
                   "extensions regex and grammar are)", "response_format", t);
    }
    return take_grammar(st, grammar, "response_format", g, http_status);
}

/* tools, tool_choice, parallel_tool_calls (router/tool_calls.h): the template sees the tools; a forced call
 * becomes the request's grammar. Every refusal is a 400 naming the field. */
static bt_status parse_tools(const rtr_model_t *m, rtr_api api, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    const rtr_tool_env_t env = {.format = (rtr_tool_format)m->tool_format,
                                .tmpl_renders_tools = m->has_tmpl && m->tmpl_renders_tools,
                                .has_response_format = g->grammar != NULL, .chat = api == RTR_API_CHAT};
    char *grammar = NULL;
    bt_status st = rtr_tools_from_request(body, &env, &g->tools, &grammar);
    if (st == BT_ERR_NOMEM) *http_status = 500;
    if (st == BT_ERR_NOMEM) return st;
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        *http_status = 400;
        return bt_fail(BT_ERR_INVALID, "%s", msg);
    }
    return grammar ? take_grammar(BT_OK, grammar, "tools", g, http_status) : BT_OK;
}

bt_status rtr_openai_parse(const rtr_model_t *m, rtr_api api, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    memset(g, 0, sizeof *g);
    g->api = api;
    g->n = 1;
    *http_status = 400;
    bt_status st;
    if ((st = check_model(m, body, http_status))) return st;
    if ((st = check_unsupported(api, body, http_status))) return st;
    if ((st = get_bool(body, "stream", &g->stream, http_status))) return st;
    const cJSON *so = field(body, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so)) return bad(http_status, "'%s' must be an object", "stream_options");
        if ((st = get_bool(so, "include_usage", &g->include_usage, http_status))) return st;
        if (!g->stream) g->include_usage = 0;
    }
    int64_t v = 0;
    int has_max = 0;
    const char *max_name = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if ((st = get_int(body, max_name, 1, 1 << 30, &v, &has_max, http_status))) return st;
    if (has_max) g->max_tokens = (uint32_t)v;
    if (!has_max && api == RTR_API_COMPLETION) { /* OpenAI's default for completions */
        g->max_tokens = 16;
        has_max = 1;
    }
    int has = 0;
    if ((st = get_int(body, "n", 1, RTR_MAX_N, &v, &has, http_status))) return st;
    if (has) g->n = (int)v;
    if ((st = get_num(body, "temperature", 0, 2, &g->temperature, &g->has_temperature, http_status))) return st;
    if ((st = get_num(body, "top_p", 0, 1, &g->top_p, &g->has_top_p, http_status))) return st;
    if (g->has_top_p && g->top_p <= 0) return bad(http_status, "'%s' must be in (0, 1]", "top_p");
    if ((st = get_num(body, "min_p", 0, 1, &g->min_p, &g->has_min_p, http_status))) return st;
    if ((st = get_num(body, "repetition_penalty", 0, 10, &g->repetition_penalty, &g->has_repetition_penalty,
                      http_status)))
        return st;
    if (g->has_repetition_penalty && g->repetition_penalty <= 0)
        return bad(http_status, "'%s' must be in (0, 10]", "repetition_penalty");
    if ((st = get_num(body, "presence_penalty", -2, 2, &g->presence_penalty, &g->has_presence, http_status))) return st;
    if ((st = get_num(body, "frequency_penalty", -2, 2, &g->frequency_penalty, &g->has_frequency, http_status)))
        return st;
    has = 0;
    if ((st = get_int(body, "top_k", -1, 1 << 30, &v, &has, http_status))) return st;
    if (has && v > 0) {
        g->top_k = (int32_t)v;
        g->has_top_k = 1;
    }
    const cJSON *seed = field(body, "seed");
    if (seed) {
        /* a double converts to int64 only inside [-2^63, 2^63): 1e400 (inf) or 1e30 would be undefined */
        if (!cJSON_IsNumber(seed) || !isfinite(seed->valuedouble) || seed->valuedouble != floor(seed->valuedouble) ||
            seed->valuedouble < -9223372036854775808.0 || seed->valuedouble >= 9223372036854775808.0)
            return bad(http_status, "'%s' must be an integer in [-2^63, 2^63)", "seed");
        g->seed = (uint64_t)(int64_t)seed->valuedouble;
        g->has_seed = 1;
    }
    if ((st = get_bool(body, "ignore_eos", &g->ignore_eos, http_status))) return st;
    /* extra field "speculative" (default true): false opts this request out of speculative decoding */
    int speculative = 1;
    if ((st = get_bool(body, "speculative", &speculative, http_status))) return st;
    g->no_spec = !speculative;
    if (api == RTR_API_CHAT) {
        if ((st = get_bool(body, "logprobs", &g->logprobs, http_status))) return st;
        has = 0;
        if ((st = get_int(body, "top_logprobs", 0, RTR_MAX_TOP_LOGPROBS, &v, &has, http_status))) return st;
        if (has) {
            if (!g->logprobs && v > 0) return bad(http_status, "'%s' needs logprobs: true", "top_logprobs");
            g->top_logprobs = (int)v;
        }
    } else {
        has = 0;
        if ((st = get_int(body, "logprobs", 0, RTR_MAX_TOP_LOGPROBS, &v, &has, http_status))) return st;
        if (has) {
            g->logprobs = 1;
            g->top_logprobs = (int)v;
        }
        const cJSON *echo = field(body, "echo");
        if (echo && !cJSON_IsBool(echo)) return bad(http_status, "'%s' must be a boolean", "echo");
        if (echo && cJSON_IsTrue(echo)) return bad(http_status, "'%s' is not supported", "echo");
        const cJSON *best_of = field(body, "best_of");
        if (best_of && (!cJSON_IsNumber(best_of) || best_of->valuedouble != g->n))
            return bad(http_status, "'%s' other than n is not supported", "best_of");
    }
    if ((st = parse_stop(body, g, http_status))) return st;
    if ((st = parse_logit_bias(m, body, g, http_status))) return st;
    if ((st = parse_response_format(body, g, http_status))) return st;
    if ((st = parse_tools(m, api, body, g, http_status))) return st;
    const cJSON *user = field(body, "user");
    if (user && !cJSON_IsString(user)) return bad(http_status, "'%s' must be a string", "user");
    st = api == RTR_API_CHAT ? chat_prompt(m, body, g, http_status) : completion_prompt(m, body, g, http_status);
    if (st) return st;
    if ((st = rtr_gen_check_context(m, g, has_max))) {
        *http_status = 400;
        return st;
    }
    /* a non-streaming answer is held whole until the end: bound what it may hold (issue 16.5) */
    double units = (double)g->n * g->max_tokens * (1.0 + (g->logprobs ? g->top_logprobs : 0));
    if (!g->stream && units > RTR_MAX_NONSTREAM_UNITS)
        return bad(http_status,
                   "'n' x 'max_tokens' x (1 + top_logprobs) = %.0f exceeds %d for a non-streaming answer: lower them or "
                   "set 'stream': true",
                   units, RTR_MAX_NONSTREAM_UNITS);
    *http_status = 200;
    return BT_OK;
}

static void refuse_429(rtr_t *r, http_request_t *req, const char *msg, int retry_after_s)
{
    char ra[16];
    snprintf(ra, sizeof ra, "%d", retry_after_s);
    rtr_count_request(r, "overloaded");
    http_response_header(req, "Retry-After", ra);
    http_respond_error(req, 429, msg, NULL, NULL);
}

/* Answers a request whose parsing failed with its status: 404 for an unknown model, 500 when out of memory. */
static void respond_parse_error(rtr_t *r, http_request_t *req, bt_status st, int status)
{
    rtr_count_request(r, st == BT_ERR_NOMEM ? "server_error" : "client_error");
    if (st == BT_ERR_NOMEM) http_respond_error(req, 500, bt_last_error(), NULL, NULL);
    else if (status == 404) http_respond_error(req, 404, bt_last_error(), "invalid_request_error", "model_not_found");
    else http_respond_error(req, status, bt_last_error(), NULL, NULL);
}

static void handle_generate(rtr_t *r, http_request_t *req, rtr_api api)
{
    char msg[200];
    int retry = 1;
    /* admission first: a refused request costs no parsing, templating or tokenizing */
    if (!rtr_admit_quick(r, msg, sizeof msg, &retry)) {
        refuse_429(r, req, msg, retry);
        return;
    }
    if (!rtr_ready(r)) {
        rtr_count_request(r, "unavailable");
        http_response_header(req, "Retry-After", "1");
        http_respond_error(req, 503, rtr_not_ready_reason(r), NULL, NULL);
        return;
    }
    cJSON *body = NULL;
    if (http_request_json(req, &body)) {
        rtr_count_request(r, "client_error");
        http_respond_error(req, 400, bt_last_error(), NULL, NULL);
        return;
    }
    rtr_gen_t g;
    int status = 400;
    bt_status st = rtr_openai_parse(&r->model, api, body, &g, &status);
    cJSON_Delete(body);
    if (st) {
        rtr_gen_free(&g);
        respond_parse_error(r, req, st, status);
        return;
    }
    char slo_msg[160];
    if (!rtr_slo_admit(r, &g, slo_msg, sizeof slo_msg)) {
        rtr_gen_free(&g);
        refuse_429(r, req, slo_msg, 1);
        return;
    }
    if (!rtr_admit_gen(r, &g, &g.adm, msg, sizeof msg, &retry)) {
        rtr_gen_free(&g);
        refuse_429(r, req, msg, retry);
        return;
    }
    if ((st = rtr_job_start_http(r, &g, req))) {
        rtr_count_request(r, "server_error");
        http_respond_error(req, st == BT_ERR_UNAVAILABLE ? 503 : 500, bt_last_error(), NULL, NULL);
    }
}

static void h_chat(http_request_t *req, void *arg) { handle_generate(arg, req, RTR_API_CHAT); }
static void h_completions(http_request_t *req, void *arg) { handle_generate(arg, req, RTR_API_COMPLETION); }

static cJSON *model_json(const rtr_t *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", r->model.name);
    cJSON_AddStringToObject(o, "object", "model");
    cJSON_AddNumberToObject(o, "created", (double)r->model.created);
    cJSON_AddStringToObject(o, "owned_by", "baton");
    cJSON_AddNumberToObject(o, "max_model_len", r->model.n_ctx);
    return o;
}

/* The JSON body of a tokenizer call, admitted like Tokenize on gRPC; NULL when the request was answered. */
static cJSON *tokenizer_body(rtr_t *r, http_request_t *req)
{
    char msg[200];
    int retry = 1;
    if (!rtr_admit_quick(r, msg, sizeof msg, &retry)) {
        refuse_429(r, req, msg, retry);
        return NULL;
    }
    cJSON *body = NULL;
    int status = 400;
    bt_status st = http_request_json(req, &body);
    if (!st) st = check_model(&r->model, body, &status);
    if (st) {
        cJSON_Delete(body);
        respond_parse_error(r, req, st, status);
        return NULL;
    }
    return body;
}

/* The ids of a /tokenize body: a chat ("messages", rendered with the template as a chat request would be) or a
 * "prompt" string (special-token text parsed, BOS added unless "add_special_tokens": false). */
static bt_status tokenize_body(const rtr_model_t *m, const cJSON *body, rtr_gen_t *g, int *http_status)
{
    memset(g, 0, sizeof *g);
    if (field(body, "messages")) { /* tools are rendered as a chat request would render them */
        bt_status st = parse_tools(m, RTR_API_CHAT, body, g, http_status);
        return st ? st : chat_prompt(m, body, g, http_status);
    }
    const cJSON *p = field(body, "prompt");
    if (!cJSON_IsString(p)) return bad(http_status, "'%s' (a string) or 'messages' is required", "prompt");
    int add_special = 1;
    bt_status st = get_bool(body, "add_special_tokens", &add_special, http_status);
    if (!st) st = check_prompt_bytes(m, strlen(p->valuestring), http_status);
    if (st) return st;
    if (!valid_utf8(p->valuestring)) return bad(http_status, "'%s' is not valid UTF-8", "prompt");
    return encode(m, p->valuestring, strlen(p->valuestring), TOK_PARSE_SPECIAL | (add_special ? TOK_ADD_SPECIAL : 0),
                  g);
}

/* POST /tokenize (as vLLM): {"count", "max_model_len", "tokens"}. */
static void h_tokenize(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    cJSON *body = tokenizer_body(r, req);
    if (!body) return;
    rtr_gen_t g;
    int status = 400;
    bt_status st = tokenize_body(&r->model, body, &g, &status);
    cJSON_Delete(body);
    if (st) {
        rtr_gen_free(&g);
        respond_parse_error(r, req, st, status);
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON *ids = o ? cJSON_AddArrayToObject(o, "tokens") : NULL;
    for (size_t i = 0; ids && i < g.n_prompt; i++) {
        cJSON *v = cJSON_CreateNumber(g.prompt[i]);
        if (!v || !cJSON_AddItemToArray(ids, v)) ids = NULL;
    }
    if (!ids || !cJSON_AddNumberToObject(o, "count", (double)g.n_prompt) ||
        !cJSON_AddNumberToObject(o, "max_model_len", r->model.n_ctx)) {
        http_respond_error(req, 500, "out of memory", NULL, NULL);
    } else {
        http_respond_json(req, 200, o);
    }
    cJSON_Delete(o);
    rtr_gen_free(&g);
}

/* The text of a /detokenize body's "tokens" (ids in the vocabulary, at most about a prompt's worth) into *text. */
static bt_status detokenize_body(const rtr_model_t *m, const cJSON *body, char **text, int *http_status)
{
    const cJSON *t = field(body, "tokens");
    if (!cJSON_IsArray(t)) return bad(http_status, "'%s' (an array of token ids) is required", "tokens");
    size_t n = (size_t)cJSON_GetArraySize(t), max_ids = rtr_prompt_max_bytes(m) / 4;
    if (n > max_ids) return bad(http_status, "'%s' holds %zu ids; at most %zu per call", "tokens", n, max_ids);
    int32_t *ids = calloc(n ? n : 1, sizeof *ids);
    if (!ids) return bt_fail(BT_ERR_NOMEM, "out of memory");
    size_t k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, t) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble >= tok_n_vocab(m->tok)) {
            free(ids);
            return bad(http_status, "'%s' must be integers in the vocabulary", "tokens");
        }
        ids[k++] = (int32_t)e->valuedouble;
    }
    char *s = NULL;
    size_t len = 0;
    bt_status st = tok_decode(m->tok, ids, k, 0, &s, &len);
    free(ids);
    if (st) return st;
    *text = rtr_utf8_sanitize(s, len);
    free(s);
    return *text ? BT_OK : bt_fail(BT_ERR_NOMEM, "out of memory");
}

/* POST /detokenize (as vLLM): {"prompt": text}. */
static void h_detokenize(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    cJSON *body = tokenizer_body(r, req);
    if (!body) return;
    char *text = NULL;
    int status = 400;
    bt_status st = detokenize_body(&r->model, body, &text, &status);
    cJSON_Delete(body);
    if (st) {
        respond_parse_error(r, req, st, status);
        return;
    }
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "prompt", text)) http_respond_error(req, 500, "out of memory", NULL, NULL);
    else http_respond_json(req, 200, o);
    cJSON_Delete(o);
    free(text);
}

/* POST /v1/embeddings: parsed here, computed on a decode node (router/embeddings.c). */
static void h_embeddings(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    if (!rtr_ready(r)) {
        rtr_count_request(r, "unavailable");
        http_response_header(req, "Retry-After", "1");
        http_respond_error(req, 503, rtr_not_ready_reason(r), NULL, NULL);
        return;
    }
    cJSON *body = tokenizer_body(r, req);
    if (!body) return;
    rtr_embed_req_t e;
    int status = 400;
    bt_status st = rtr_embed_parse(&r->model, body, &e, &status);
    cJSON_Delete(body);
    if (st) {
        rtr_embed_req_free(&e);
        respond_parse_error(r, req, st, status);
        return;
    }
    rtr_embed_start_http(r, &e, req);
}

static void h_models(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    cJSON_AddItemToArray(data, model_json(r));
    http_respond_json(req, 200, o);
    cJSON_Delete(o);
}

static void h_model_one(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    const char *name = http_request_path(req) + strlen("/v1/models/");
    if (!rtr_model_matches(&r->model, name) || !*name) {
        http_respond_error(req, 404, "model not found", "invalid_request_error", "model_not_found");
        return;
    }
    cJSON *o = model_json(r);
    http_respond_json(req, 200, o);
    cJSON_Delete(o);
}

static void h_health(http_request_t *req, void *arg)
{
    rtr_t *r = arg;
    int n = rtr_dispatch_n_healthy(r->dispatch);
    char buf[128];
    int len = snprintf(buf, sizeof buf, "{\"status\":\"ok\",\"decode_nodes\":%d}", n);
    http_respond(req, 200, "application/json", buf, (size_t)len);
}

bt_status rtr_openai_register(rtr_t *r, http_server_t *s)
{
    bt_status st;
    if ((st = http_server_route(s, "POST", "/v1/chat/completions", HTTP_ROUTE_AUTH, h_chat, r))) return st;
    if ((st = http_server_route(s, "POST", "/v1/completions", HTTP_ROUTE_AUTH, h_completions, r))) return st;
    if ((st = http_server_route(s, "GET", "/v1/models", HTTP_ROUTE_AUTH, h_models, r))) return st;
    if ((st = http_server_route(s, "POST", "/tokenize", HTTP_ROUTE_AUTH, h_tokenize, r))) return st;
    if ((st = http_server_route(s, "POST", "/detokenize", HTTP_ROUTE_AUTH, h_detokenize, r))) return st;
    if ((st = http_server_route(s, "POST", "/v1/embeddings", HTTP_ROUTE_AUTH, h_embeddings, r))) return st;
    if ((st = http_server_route(s, "GET", "/v1/models/", HTTP_ROUTE_AUTH | HTTP_ROUTE_PREFIX, h_model_one, r)))
        return st;
    return http_server_route(s, "GET", "/health", 0, h_health, r);
}
