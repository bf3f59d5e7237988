/* Tool calling: request tools, the forcing grammar, and the call parser (router/tool_calls.h). */
#include "router/tool_calls.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/strbuf.h"
#include "engine/grammar.h"
#include "router/json_schema.h"

static const char HERMES_OPEN[] = "<tool_call>", HERMES_CLOSE[] = "</tool_call>";
static const char PYTHON_TAG[] = "<|python_tag|>";
static const char MISTRAL_TAG[] = "[TOOL_CALLS]", MISTRAL_ARGS_TAG[] = "[ARGS]", MISTRAL_ID_TAG[] = "[CALL_ID]";

#define LIT(s) (s), (sizeof(s) - 1)

const char *rtr_tool_format_name(rtr_tool_format f)
{
    switch (f) {
    case RTR_TOOL_FMT_HERMES: return "hermes";
    case RTR_TOOL_FMT_LLAMA3: return "llama3";
    case RTR_TOOL_FMT_MISTRAL: return "mistral";
    case RTR_TOOL_FMT_MISTRAL_ARGS: return "mistral-args";
    default: return "none";
    }
}

/* memmem over a bounded text. */
static const char *find(const char *s, size_t n, const char *pat, size_t m)
{
    if (m == 0 || n < m) return NULL;
    for (size_t i = 0; i + m <= n; i++)
        if (s[i] == pat[0] && !memcmp(s + i, pat, m)) return s + i;
    return NULL;
}

static int has(const char *s, size_t n, const char *pat) { return find(s, n, pat, strlen(pat)) != NULL; }

rtr_tool_format rtr_tool_format_detect(const char *t, size_t n)
{
    if (!t) return RTR_TOOL_FMT_NONE;
    /* XML-argument forms (Qwen3-Coder's <function=...>, GLM's <arg_key>) also spell <tool_call>: not JSON calls */
    int xml = has(t, n, "<function=") || has(t, n, "<arg_key>");
    int json_name = has(t, n, "\"name\"") || has(t, n, "\\\"name\\\""); /* "name" or \"name\" (in a string) */
    if (has(t, n, HERMES_OPEN) && json_name && !xml) return RTR_TOOL_FMT_HERMES;
    if (has(t, n, MISTRAL_TAG)) return has(t, n, MISTRAL_ARGS_TAG) ? RTR_TOOL_FMT_MISTRAL_ARGS : RTR_TOOL_FMT_MISTRAL;
    if (!xml && (has(t, n, PYTHON_TAG) || has(t, n, "\"parameters\": dictionary"))) return RTR_TOOL_FMT_LLAMA3;
    return RTR_TOOL_FMT_NONE;
}

bt_status rtr_tool_format_choose(const char *flag, const char *tmpl, size_t len, rtr_tool_format *out)
{
    if (!flag || !strcmp(flag, "auto")) {
        *out = rtr_tool_format_detect(tmpl, len);
        return BT_OK;
    }
    static const rtr_tool_format all[] = {RTR_TOOL_FMT_NONE, RTR_TOOL_FMT_HERMES, RTR_TOOL_FMT_LLAMA3,
                                          RTR_TOOL_FMT_MISTRAL, RTR_TOOL_FMT_MISTRAL_ARGS};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (!strcmp(flag, rtr_tool_format_name(all[i]))) {
            *out = all[i];
            if (all[i] == RTR_TOOL_FMT_MISTRAL && tmpl && has(tmpl, len, MISTRAL_ARGS_TAG))
                *out = RTR_TOOL_FMT_MISTRAL_ARGS;
            return BT_OK;
        }
    return bt_fail(BT_ERR_INVALID, "--tool-call-parser '%.40s' is not one of auto, hermes, llama3, mistral, "
                   "mistral-args, none", flag);
}

void rtr_tools_free(rtr_tools_t *t)
{
    if (!t) return;
    for (size_t i = 0; i < t->n_names; i++) free(t->names[i]);
    free(t->names);
    free(t->tools_json);
    free(t);
}

void rtr_tool_result_free(rtr_tool_result_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++) {
        free(r->calls[i].name);
        free(r->calls[i].arguments);
    }
    free(r->calls);
    free(r->content);
    memset(r, 0, sizeof *r);
}

/* ---- parsing model output ---- */

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static const char *skip_ws(const char *p, const char *e)
{
    while (p < e && is_ws(*p)) p++;
    return p;
}

static int starts(const char *p, const char *e, const char *lit, size_t n)
{
    return (size_t)(e - p) >= n && !memcmp(p, lit, n);
}

/* Length of the JSON object or array that opens at p (balanced brackets outside strings, at most
 * RTR_TOOL_MAX_DEPTH deep), or 0 when it is not complete before e or too deep. Linear; cJSON checks the rest. */
static size_t json_span(const char *p, const char *e)
{
    if (p >= e || (*p != '{' && *p != '[')) return 0;
    int depth = 0, in_str = 0;
    for (const char *q = p; q < e; q++) {
        char c = *q;
        if (in_str) {
            if (c == '\\' && ++q == e) return 0; /* an escape cut by the end */
            if (c == '"') in_str = 0;
            continue;
        }
        if (c == '"') in_str = 1;
        else if (c == '{' || c == '[') {
            if (++depth > RTR_TOOL_MAX_DEPTH) return 0;
        } else if (c == '}' || c == ']') {
            if (--depth == 0) return (size_t)(q - p) + 1;
        }
    }
    return 0;
}

/* The JSON value at *pp (object or array) parsed, *pp moved past it; NULL when there is none. */
static cJSON *json_at(const char **pp, const char *e)
{
    size_t n = json_span(*pp, e);
    if (!n) return NULL;
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(*pp, n, &end, 0);
    if (v && end != *pp + n) {
        cJSON_Delete(v);
        return NULL;
    }
    if (v) *pp += n;
    return v;
}

static int known_name(const rtr_tools_t *t, const char *name)
{
    for (size_t i = 0; i < t->n_names; i++)
        if (!strcmp(t->names[i], name)) return 1;
    return 0;
}

/* Appends a call named name with arguments args (an object; NULL = {}). 0, -1 for a call that does not count,
 * BT_ERR_NOMEM. */
static int add_call(rtr_tool_result_t *r, const rtr_tools_t *t, const char *name, const cJSON *args)
{
    if (!name || !known_name(t, name) || (args && !cJSON_IsObject(args))) return -1;
    if (r->n_calls >= RTR_TOOL_MAX_CALLS) return -1;
    rtr_tool_call_t *c = realloc(r->calls, (r->n_calls + 1) * sizeof *c);
    if (!c) return BT_ERR_NOMEM;
    r->calls = c;
    char *a = args ? cJSON_PrintUnformatted(args) : strdup("{}");
    char *nm = strdup(name);
    if (!a || !nm) {
        free(a);
        free(nm);
        return BT_ERR_NOMEM;
    }
    r->calls[r->n_calls++] = (rtr_tool_call_t){nm, a};
    return 0;
}

/* A call object {"name": N, key: {...}} (key "arguments", or "parameters" for llama3) added to r. */
static int add_call_object(rtr_tool_result_t *r, const rtr_tools_t *t, const cJSON *o, int llama3)
{
    if (!cJSON_IsObject(o)) return -1;
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, llama3 ? "parameters" : "arguments");
    if (!args) args = cJSON_GetObjectItemCaseSensitive(o, llama3 ? "arguments" : "parameters");
    if (!cJSON_IsString(name)) return -1;
    if (args && !cJSON_IsObject(args)) return -1;
    return add_call(r, t, name->valuestring, args);
}

/* Calls in hermes syntax from p (at "<tool_call>") to e: 1 when they are all well formed up to e. */
static int parse_hermes(const rtr_tools_t *t, const char *p, const char *e, rtr_tool_result_t *r)
{
    while (p < e) {
        if (!starts(p, e, LIT(HERMES_OPEN))) return 0;
        p = skip_ws(p + sizeof HERMES_OPEN - 1, e);
        cJSON *o = json_at(&p, e);
        int rc = o ? add_call_object(r, t, o, 0) : -1;
        cJSON_Delete(o);
        if (rc) return rc == BT_ERR_NOMEM ? rc : 0;
        p = skip_ws(p, e);
        if (starts(p, e, LIT(HERMES_CLOSE))) p = skip_ws(p + sizeof HERMES_CLOSE - 1, e);
        else if (p != e) return 0; /* only the last call may stop before its closing tag */
    }
    return 1;
}

/* llama3: one JSON call object or several separated by ';'. */
static int parse_llama3(const rtr_tools_t *t, const char *p, const char *e, rtr_tool_result_t *r)
{
    p = skip_ws(p, e);
    while (p < e) {
        cJSON *o = json_at(&p, e);
        int rc = o ? add_call_object(r, t, o, 1) : -1;
        cJSON_Delete(o);
        if (rc) return rc == BT_ERR_NOMEM ? rc : 0;
        p = skip_ws(p, e);
        if (p < e && *p == ';') p = skip_ws(p + 1, e);
        else if (p != e) return 0;
    }
    return r->n_calls > 0;
}

static int name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           c == '.';
}

/* mistral, both forms, from p (at "[TOOL_CALLS]", or at "[" when the marker was a control token the detokenizer
 * dropped). */
static int parse_mistral(const rtr_tools_t *t, const char *p, const char *e, rtr_tool_result_t *r)
{
    while (p < e) {
        if (starts(p, e, LIT(MISTRAL_TAG))) p += sizeof MISTRAL_TAG - 1;
        else if (r->n_calls || *p != '[') return 0;
        const char *q = skip_ws(p, e);
        if (q < e && *q == '[') { /* [{"name": ..., "arguments": ...}, ...] */
            p = q;
            cJSON *a = json_at(&p, e);
            int rc = cJSON_IsArray(a) && cJSON_GetArraySize(a) > 0 ? 0 : -1;
            const cJSON *o;
            if (!rc) cJSON_ArrayForEach(o, a) if (!rc) rc = add_call_object(r, t, o, 0);
            cJSON_Delete(a);
            if (rc) return rc == BT_ERR_NOMEM ? rc : 0;
        } else { /* name[CALL_ID]id[ARGS]{...} */
            p = q;
            char name[RTR_TOOL_MAX_NAME + 1];
            size_t k = 0;
            while (p < e && name_char(*p) && k < RTR_TOOL_MAX_NAME) name[k++] = *p++;
            name[k] = 0;
            if (starts(p, e, LIT(MISTRAL_ID_TAG))) {
                p += sizeof MISTRAL_ID_TAG - 1;
                for (int i = 0; p < e && name_char(*p) && i < 64; i++) p++;
            }
            if (!k || !starts(p, e, LIT(MISTRAL_ARGS_TAG))) return 0;
            p = skip_ws(p + sizeof MISTRAL_ARGS_TAG - 1, e);
            cJSON *o = json_at(&p, e);
            int rc = o ? add_call(r, t, name, o) : -1;
            cJSON_Delete(o);
            if (rc) return rc == BT_ERR_NOMEM ? rc : 0;
        }
        p = skip_ws(p, e);
    }
    return r->n_calls > 0;
}

/* Where the calls of text start (their marker), or NULL. */
static const char *call_start(rtr_tool_format f, const char *s, const char *e)
{
    const char *lead = skip_ws(s, e);
    switch (f) {
    case RTR_TOOL_FMT_HERMES: return find(s, (size_t)(e - s), LIT(HERMES_OPEN));
    case RTR_TOOL_FMT_LLAMA3: {
        const char *p = find(s, (size_t)(e - s), LIT(PYTHON_TAG));
        if (p) return p;
        return lead < e && *lead == '{' ? lead : NULL;
    }
    case RTR_TOOL_FMT_MISTRAL:
    case RTR_TOOL_FMT_MISTRAL_ARGS: {
        const char *p = find(s, (size_t)(e - s), LIT(MISTRAL_TAG));
        if (p) return p;
        return lead < e && *lead == '[' ? lead : NULL;
    }
    default: return NULL;
    }
}

int rtr_tool_parse(const rtr_tools_t *t, const char *text, size_t len, rtr_tool_result_t *r)
{
    memset(r, 0, sizeof *r);
    if (!t || t->choice == RTR_TOOL_CHOICE_NONE) return 0;
    const char *e = text + len, *start = call_start(t->format, text, e);
    if (!start) return 0;
    int ok;
    const char *p = start;
    switch (t->format) {
    case RTR_TOOL_FMT_HERMES: ok = parse_hermes(t, p, e, r); break;
    case RTR_TOOL_FMT_LLAMA3:
        if (starts(p, e, LIT(PYTHON_TAG))) p += sizeof PYTHON_TAG - 1;
        ok = parse_llama3(t, p, e, r);
        break;
    default: ok = parse_mistral(t, p, e, r); break;
    }
    if (ok == 1 && r->n_calls) {
        if (!t->parallel)
            while (r->n_calls > 1) {
                r->n_calls--;
                free(r->calls[r->n_calls].name);
                free(r->calls[r->n_calls].arguments);
            }
        const char *c = text, *ce = start;
        while (ce > c && is_ws(ce[-1])) ce--;
        if (ce > skip_ws(c, ce)) {
            if (!(r->content = malloc((size_t)(ce - c) + 1))) ok = BT_ERR_NOMEM;
            else {
                memcpy(r->content, c, (size_t)(ce - c));
                r->content[ce - c] = 0;
                r->content_len = (size_t)(ce - c);
            }
        }
        if (ok == 1) return 1;
    }
    rtr_tool_result_free(r);
    return ok == BT_ERR_NOMEM ? BT_ERR_NOMEM : 0;
}

/* ---- streaming ---- */

void rtr_tool_stream_init(rtr_tool_stream_t *s, const rtr_tools_t *t)
{
    memset(s, 0, sizeof *s);
    s->t = t;
}

void rtr_tool_stream_free(rtr_tool_stream_t *s)
{
    free(s->held);
    free(s->rel);
    memset(s, 0, sizeof *s);
}

/* Marker that may appear anywhere in the answer. */
static const char *anywhere_marker(rtr_tool_format f, size_t *n)
{
    switch (f) {
    case RTR_TOOL_FMT_HERMES: *n = sizeof HERMES_OPEN - 1; return HERMES_OPEN;
    case RTR_TOOL_FMT_LLAMA3: *n = sizeof PYTHON_TAG - 1; return PYTHON_TAG;
    case RTR_TOOL_FMT_MISTRAL:
    case RTR_TOOL_FMT_MISTRAL_ARGS: *n = sizeof MISTRAL_TAG - 1; return MISTRAL_TAG;
    default: *n = 0; return NULL;
    }
}

/* The character that starts a call when it opens the answer ('{' for llama3, '[' for mistral), or 0. */
static char opening_char(rtr_tool_format f)
{
    return f == RTR_TOOL_FMT_LLAMA3 ? '{' : f == RTR_TOOL_FMT_MISTRAL || f == RTR_TOOL_FMT_MISTRAL_ARGS ? '[' : 0;
}

void rtr_tool_stream_push(rtr_tool_stream_t *s, const char *text, size_t len, const char **out, size_t *out_len)
{
    *out = "";
    *out_len = 0;
    if (s->oom) { /* past an allocation failure text goes out as content: nothing is lost, calls are not parsed */
        *out = text;
        *out_len = len;
        return;
    }
    if (s->n_held + len + 1 > s->cap_held) {
        size_t cap = s->cap_held ? s->cap_held : 256;
        while (cap < s->n_held + len + 1) cap *= 2;
        char *p = realloc(s->held, cap);
        if (!p) {
            s->oom = 1;
            *out = text;
            *out_len = len;
            return;
        }
        s->held = p;
        s->cap_held = cap;
    }
    memcpy(s->held + s->n_held, text, len);
    s->n_held += len;
    if (s->in_call) return;
    const char *h = s->held, *e = h + s->n_held;
    size_t mlen;
    const char *mark = anywhere_marker(s->t->format, &mlen);
    const char *at = mark ? find(h, s->n_held, mark, mlen) : NULL;
    char open = opening_char(s->t->format);
    if (!s->released_any && open) {
        const char *lead = skip_ws(h, e);
        if (lead == e) return; /* only whitespace so far: the answer may still open with a call */
        if (*lead == open && (!at || lead < at)) at = lead;
    }
    size_t keep; /* bytes held back from the end */
    if (at) {
        s->in_call = 1;
        keep = (size_t)(e - at);
    } else {
        keep = 0;
        /* the longest tail that is a proper prefix of the marker */
        for (size_t k = mlen > 1 ? mlen - 1 : 0; k > 0; k--)
            if (k <= s->n_held && !memcmp(e - k, mark, k)) {
                keep = k;
                break;
            }
    }
    while (keep < s->n_held && is_ws(e[-(ptrdiff_t)keep - 1])) keep++; /* whitespace before a possible call */
    size_t rel = s->n_held - keep;
    if (!rel) return;
    for (size_t i = 0; i < rel && !s->released_any; i++) s->released_any = !is_ws(h[i]);
    if (rel + 1 > s->cap_rel) {
        char *p = realloc(s->rel, rel + 1);
        if (!p) {
            s->oom = 1;
            *out = h;
            *out_len = s->n_held;
            s->n_held = 0;
            return;
        }
        s->rel = p;
        s->cap_rel = rel + 1;
    }
    memcpy(s->rel, h, rel);
    memmove(s->held, h + rel, keep);
    s->n_held = keep;
    *out = s->rel;
    *out_len = rel;
}

int rtr_tool_stream_finish(rtr_tool_stream_t *s, rtr_tool_result_t *r, const char **out, size_t *out_len)
{
    memset(r, 0, sizeof *r);
    *out = s->held ? s->held : "";
    *out_len = s->n_held;
    if (s->oom || !s->in_call) return 0;
    int rc = rtr_tool_parse(s->t, s->held, s->n_held, r);
    if (rc == 1) {
        *out = "";
        *out_len = 0;
    }
    return rc;
}

/* ---- call ids ---- */

void rtr_tool_call_id(rtr_tool_format f, char *out, size_t cap)
{
    static const char an[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    int mistral = f == RTR_TOOL_FMT_MISTRAL || f == RTR_TOOL_FMT_MISTRAL_ARGS;
    size_t n = mistral ? 9 : 24, k = 0;
    unsigned char rnd[24];
    if (getrandom(rnd, n, GRND_NONBLOCK) != (ssize_t)n) {
        uint64_t x = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)out ^ (uint64_t)clock();
        for (size_t i = 0; i < n; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            rnd[i] = (unsigned char)(x >> 56);
        }
    }
    if (!mistral) k = (size_t)snprintf(out, cap, "call_");
    for (size_t i = 0; i < n && k + 1 < cap; i++) out[k++] = an[rnd[i] % (sizeof an - 1)];
    out[k] = 0;
}

/* ---- the request ---- */

#define bad(...) bt_fail(BT_ERR_INVALID, __VA_ARGS__)

static const cJSON *field(const cJSON *o, const char *name)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    return f && !cJSON_IsNull(f) ? f : NULL;
}

static int valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > RTR_TOOL_MAX_NAME) return 0;
    for (size_t i = 0; i < n; i++)
        if (!name_char(s[i]) || s[i] == '.') return 0;
    return 1;
}

/* A GBNF literal of a JSON string for name (names are [A-Za-z0-9_-]: no escaping needed). */
static void put_name_literal(bt_strbuf *b, const char *name)
{
    bt_strbuf_puts(b, "\"\\\"");
    bt_strbuf_puts(b, name);
    bt_strbuf_puts(b, "\\\"\"");
}

/* The rules of the allowed tools' parameters (rule tool<k> for the k-th allowed tool; NULL = any object). When they
 * do not compile, each is compiled alone to name the tool at fault. */
static bt_status params_rules(const char *const *names, const cJSON *const *params, const size_t *idx, size_t k,
                              char **out)
{
    cJSON *any = cJSON_CreateObject();
    const cJSON **schemas = calloc(k, sizeof *schemas);
    bt_status st = BT_OK;
    if (!any || !schemas || !cJSON_AddStringToObject(any, "type", "object")) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < k; i++) schemas[i] = params[idx[i]] ? params[idx[i]] : any;
    if (!(st = rtr_json_schema_rules(schemas, k, "tool", 1, out)) || st == BT_ERR_NOMEM) goto out;
    for (size_t i = 0; i < k; i++) {
        char *one = NULL, msg[300];
        bt_status e = rtr_json_schema_rules(&schemas[i], 1, "tool", 1, &one);
        free(one);
        if (!e) continue;
        snprintf(msg, sizeof msg, "%s", bt_last_error());
        st = bt_fail(e, "'tools[%zu].function.parameters' (%s): %s", idx[i], names[idx[i]], msg);
        break;
    }
out:
    free(schemas);
    cJSON_Delete(any);
    return st;
}

/* tcbody ::= one of the allowed tools' call: {"name": N, "arguments"|"parameters": ARGS}, or N[ARGS]ARGS. */
static void body_rule(bt_strbuf *b, rtr_tool_format fmt, const char *const *names, const size_t *idx, size_t k)
{
    const char *key = fmt == RTR_TOOL_FMT_LLAMA3 ? "parameters" : "arguments";
    bt_strbuf_puts(b, "tcbody ::= ");
    for (size_t i = 0; i < k; i++) {
        char num[24];
        snprintf(num, sizeof num, "%zu", i);
        if (i) bt_strbuf_puts(b, " | ");
        if (fmt == RTR_TOOL_FMT_MISTRAL_ARGS) {
            bt_strbuf_puts(b, "\"");
            bt_strbuf_puts(b, names[idx[i]]);
            bt_strbuf_puts(b, "[ARGS]\" tool");
            bt_strbuf_puts(b, num);
            continue;
        }
        bt_strbuf_puts(b, "\"{\" ws \"\\\"name\\\"\" ws \":\" ws ");
        put_name_literal(b, names[idx[i]]);
        bt_strbuf_puts(b, " ws \",\" ws \"\\\"");
        bt_strbuf_puts(b, key);
        bt_strbuf_puts(b, "\\\"\" ws \":\" ws tool");
        bt_strbuf_puts(b, num);
        bt_strbuf_puts(b, " ws \"}\"");
    }
    bt_strbuf_puts(b, "\n");
}

/* c as a GBNF character-class member. */
static void put_class_char(bt_strbuf *b, char c)
{
    if (c == '[' || c == ']' || c == '\\' || c == '^' || c == '-') bt_strbuf_put(b, "\\", 1);
    bt_strbuf_put(b, &c, 1);
}

/* tctext ::= text in which the parser finds no call: it never holds the format's marker M (whose first character
 * m0 occurs in M only there, so M can only start where m0 does: the text is runs without m0, each after an m0 that
 * does not go on to spell M), and for llama3 and mistral its first non-blank character does not open a call. */
static void text_rule(bt_strbuf *b, rtr_tool_format fmt)
{
    size_t k;
    const char *m = anywhere_marker(fmt, &k);
    char open = opening_char(fmt), m0 = m[0];
    for (size_t i = 1; i < k; i++) { /* tx<i>: m0 and m[1..i) seen; what may follow up to the next m0 */
        bt_strbuf_puts(b, "tx");
        char num[48];
        snprintf(num, sizeof num, "%zu ::= ( ", i);
        bt_strbuf_puts(b, num);
        if (i + 1 < k) {
            bt_strbuf_puts(b, "\"");
            bt_strbuf_put(b, &m[i], 1);
            snprintf(num, sizeof num, "\" tx%zu | ", i + 1);
            bt_strbuf_puts(b, num);
        }
        bt_strbuf_puts(b, "[^");
        put_class_char(b, m[i]);
        put_class_char(b, m0);
        bt_strbuf_puts(b, "] [^");
        put_class_char(b, m0);
        bt_strbuf_puts(b, "]* )?\n");
    }
    bt_strbuf_puts(b, "txseg ::= \"");
    bt_strbuf_put(b, &m0, 1);
    bt_strbuf_puts(b, "\" tx1\n");
    if (!open) {
        bt_strbuf_puts(b, "tctext ::= [^");
        put_class_char(b, m0);
        bt_strbuf_puts(b, "]* txseg*\n");
        return;
    }
    /* \r too: the parser skips it before looking for the opening character */
    bt_strbuf_puts(b, "tctext ::= [ \\t\\n\\r]* ( [^ \\t\\n\\r");
    put_class_char(b, open);
    put_class_char(b, m0);
    bt_strbuf_puts(b, "] [^");
    put_class_char(b, m0);
    bt_strbuf_puts(b, open == m0 ? "]* txseg* )?\n" : "]* txseg* | txseg+ )?\n");
}

/* tccalls ::= the calls in the format's syntax, one or (parallel) more; root ::= them, or (with_text) text without
 * a call, or for hermes and mistral text then calls (the parser takes that text as content). */
static void root_rule(bt_strbuf *b, rtr_tool_format fmt, int parallel, int with_text)
{
    switch (fmt) {
    case RTR_TOOL_FMT_HERMES: /* Qwen 2.5 / Hermes spell one call per tag, tags on their own lines */
        bt_strbuf_puts(b, "tccall ::= \"<tool_call>\\n\" tcbody \"\\n</tool_call>\"\n");
        bt_strbuf_puts(b, parallel ? "tccalls ::= tccall ( \"\\n\" tccall )*\n" : "tccalls ::= tccall\n");
        break;
    case RTR_TOOL_FMT_LLAMA3: /* the JSON form of Llama 3.1; several calls separated by "; " as vLLM reads them */
        bt_strbuf_puts(b, parallel ? "tccalls ::= tcbody ( \"; \" tcbody )*\n" : "tccalls ::= tcbody\n");
        break;
    case RTR_TOOL_FMT_MISTRAL:
        bt_strbuf_puts(b, parallel ? "tccalls ::= \"[TOOL_CALLS][\" tcbody ( \", \" tcbody )* \"]\"\n"
                                   : "tccalls ::= \"[TOOL_CALLS][\" tcbody \"]\"\n");
        break;
    default:
        bt_strbuf_puts(b, parallel ? "tccalls ::= ( \"[TOOL_CALLS]\" tcbody )+\n"
                                   : "tccalls ::= \"[TOOL_CALLS]\" tcbody\n");
        break;
    }
    if (!with_text) {
        bt_strbuf_puts(b, "root ::= tccalls\n");
        return;
    }
    text_rule(b, fmt);
    bt_strbuf_puts(b, fmt == RTR_TOOL_FMT_LLAMA3 ? "root ::= tccalls | tctext\n" : "root ::= tctext tccalls?\n");
}

bt_status rtr_tools_grammar(rtr_tool_format fmt, const char *const *names, const cJSON *const *params, size_t n,
                            int named, int parallel, int with_text, char **out)
{
    if (fmt == RTR_TOOL_FMT_NONE || n == 0 || (named >= 0 && (size_t)named >= n))
        return bt_fail(BT_ERR_INVALID, "tool grammar: no format, no tools or a named tool out of range");
    size_t *idx = calloc(n, sizeof *idx), k = 0; /* the tools a call may name */
    if (!idx) return bt_fail(BT_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        if (named < 0 || (size_t)named == i) idx[k++] = i;
    char *rules = NULL;
    bt_status st = params_rules(names, params, idx, k, &rules);
    if (!st) {
        bt_strbuf b = {0};
        root_rule(&b, fmt, parallel, with_text);
        body_rule(&b, fmt, names, idx, k);
        bt_strbuf_puts(&b, rules);
        bt_grammar *check = NULL;
        if (b.oom) {
            st = bt_fail(BT_ERR_NOMEM, "out of memory");
        } else if ((st = bt_grammar_parse(b.p, b.n, &check))) {
            /* as in rtr_json_schema_grammar: a $ref cycle that matches nothing before it recurs is left-recursive */
            char msg[200];
            snprintf(msg, sizeof msg, "%s", bt_last_error());
            st = st == BT_ERR_NOMEM ? st : bt_fail(BT_ERR_UNSUPPORTED, "'tools': a parameters schema whose $ref cycle "
                                                   "matches nothing before it recurs is not supported (%.160s)", msg);
        }
        bt_grammar_free(check);
        if (st) free(b.p);
        else *out = b.p;
    }
    free(rules);
    free(idx);
    return st;
}

/* One entry of 'tools': {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}. */
static bt_status check_tool(const cJSON *tool, size_t i, const char **name, const cJSON **params, int *strict)
{
    if (!cJSON_IsObject(tool)) return bad("'tools[%zu]' must be an object", i);
    const cJSON *type = field(tool, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "function"))
        return bad("'tools[%zu].type' must be \"function\" (the only tool type supported)", i);
    const cJSON *fn = field(tool, "function");
    if (!cJSON_IsObject(fn)) return bad("'tools[%zu].function' must be an object", i);
    const cJSON *n = field(fn, "name");
    if (!cJSON_IsString(n) || !valid_name(n->valuestring))
        return bad("'tools[%zu].function.name' must be 1 to %d characters of a-z, A-Z, 0-9, _ and -", i,
                   RTR_TOOL_MAX_NAME);
    const cJSON *d = field(fn, "description");
    if (d && !cJSON_IsString(d)) return bad("'tools[%zu].function.description' must be a string", i);
    const cJSON *p = field(fn, "parameters");
    if (p && !cJSON_IsObject(p)) return bad("'tools[%zu].function.parameters' must be a JSON schema object", i);
    const cJSON *s = field(fn, "strict");
    if (s && !cJSON_IsBool(s)) return bad("'tools[%zu].function.strict' must be a boolean", i);
    *name = n->valuestring;
    *params = p;
    *strict = s && cJSON_IsTrue(s);
    return BT_OK;
}

/* tool_choice into *choice and, for a named one, *named_name. */
static bt_status parse_choice(const cJSON *f, rtr_tool_choice *choice, const char **named_name)
{
    *named_name = NULL;
    if (cJSON_IsString(f)) {
        const char *v = f->valuestring;
        if (!strcmp(v, "none")) *choice = RTR_TOOL_CHOICE_NONE;
        else if (!strcmp(v, "auto")) *choice = RTR_TOOL_CHOICE_AUTO;
        else if (!strcmp(v, "required")) *choice = RTR_TOOL_CHOICE_REQUIRED;
        else return bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}");
        return BT_OK;
    }
    const cJSON *type = cJSON_IsObject(f) ? field(f, "type") : NULL;
    const cJSON *fn = cJSON_IsObject(f) ? field(f, "function") : NULL;
    const cJSON *name = cJSON_IsObject(fn) ? field(fn, "name") : NULL;
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "function") || !cJSON_IsString(name))
        return bad("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}");
    *choice = RTR_TOOL_CHOICE_NAMED;
    *named_name = name->valuestring;
    return BT_OK;
}

/* The checks that need the whole request; the tools themselves are valid. */
static bt_status check_combination(const rtr_tool_env_t *env, const rtr_tools_t *t)
{
    if (t->choice == RTR_TOOL_CHOICE_NONE) return BT_OK;
    if (!env->tmpl_renders_tools)
        return bt_fail(BT_ERR_UNSUPPORTED, "'tools': the chat template does not render tools, so the model would "
                       "never see them; start the router with --chat-template FILE whose template does (a Hermes or "
                       "Qwen 2.5 style template for ChatML models), or send tool_choice \"none\"");
    if (env->format == RTR_TOOL_FMT_NONE)
        return bt_fail(BT_ERR_UNSUPPORTED, "'tools': no tool-call format is known for this chat template; start the "
                       "router with --tool-call-parser hermes|llama3|mistral|mistral-args, or send tool_choice "
                       "\"none\"");
    int forced = t->choice == RTR_TOOL_CHOICE_REQUIRED || t->choice == RTR_TOOL_CHOICE_NAMED;
    if (forced && env->has_response_format)
        return bt_fail(BT_ERR_UNSUPPORTED, "'response_format' together with tool_choice \"required\" or a named "
                       "function is not supported (both would constrain the same output)");
    if (!forced && env->has_response_format)
        return bt_fail(BT_ERR_UNSUPPORTED, "'response_format' together with 'tools' and tool_choice \"auto\" is not "
                       "supported (a constrained output could never hold a call): send tool_choice \"none\"");
    return BT_OK;
}

bt_status rtr_tools_from_request(const cJSON *body, const rtr_tool_env_t *env, rtr_tools_t **out, char **grammar)
{
    *out = NULL;
    *grammar = NULL;
    const cJSON *tools = field(body, "tools"), *choice_f = field(body, "tool_choice"),
                *par = field(body, "parallel_tool_calls");
    if (par && !cJSON_IsBool(par)) return bad("'%s' must be a boolean", "parallel_tool_calls");
    if (tools && !cJSON_IsArray(tools)) return bad("'%s' must be an array", "tools");
    size_t n = tools ? (size_t)cJSON_GetArraySize(tools) : 0;
    if (n > RTR_TOOL_MAX_TOOLS) return bad("'tools' may hold at most %d tools", RTR_TOOL_MAX_TOOLS);
    rtr_tool_choice choice = n ? RTR_TOOL_CHOICE_AUTO : RTR_TOOL_CHOICE_NONE;
    const char *named_name = NULL;
    bt_status st;
    if (choice_f && (st = parse_choice(choice_f, &choice, &named_name))) return st;
    if (!env->chat && (n || choice != RTR_TOOL_CHOICE_NONE))
        return bad("'%s' is only supported on /v1/chat/completions", n ? "tools" : "tool_choice");
    if (!n) {
        if (choice != RTR_TOOL_CHOICE_NONE) return bad("'tool_choice' other than \"none\" needs a non-empty 'tools'");
        return BT_OK;
    }
    rtr_tools_t *t = calloc(1, sizeof *t);
    const cJSON **params = calloc(n, sizeof *params);
    char *strict_of = calloc(n, 1);
    if (!t || !params || !strict_of || !(t->names = calloc(n, sizeof *t->names))) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto fail;
    }
    t->format = env->format;
    t->choice = choice;
    t->parallel = !par || cJSON_IsTrue(par);
    t->named = -1;
    int any_strict = 0;
    const cJSON *tool;
    cJSON_ArrayForEach(tool, tools) {
        size_t i = t->n_names;
        const char *name = NULL;
        int strict = 0;
        if ((st = check_tool(tool, i, &name, &params[i], &strict))) goto fail;
        any_strict |= strict;
        strict_of[i] = (char)strict;
        for (size_t k = 0; k < i; k++)
            if (!strcmp(t->names[k], name)) {
                st = bad("'tools[%zu].function.name' '%s' repeats tools[%zu]'s", i, name, k);
                goto fail;
            }
        if (!(t->names[i] = strdup(name))) {
            st = bt_fail(BT_ERR_NOMEM, "out of memory");
            goto fail;
        }
        t->n_names++;
        if (named_name && !strcmp(named_name, name)) t->named = (int)i;
    }
    if (named_name && t->named < 0) {
        st = bad("'tool_choice' names the function '%.64s', which is not in 'tools'", named_name);
        goto fail;
    }
    if ((st = check_combination(env, t))) goto fail;
    if (!(t->tools_json = cJSON_PrintUnformatted(tools))) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (choice == RTR_TOOL_CHOICE_REQUIRED || choice == RTR_TOOL_CHOICE_NAMED) {
        /* a named function is one call of it (as OpenAI's "forces the model to call that function") */
        int many = t->parallel && choice == RTR_TOOL_CHOICE_REQUIRED;
        if ((st = rtr_tools_grammar(t->format, (const char *const *)t->names, params, n, t->named, many, 0, grammar)))
            goto fail;
    } else if (choice == RTR_TOOL_CHOICE_AUTO && any_strict) {
        /* strict under auto (OpenAI's promise: a call's arguments match its schema): text or calls, the strict
         * tools' arguments under their schemas, the others' any object */
        for (size_t i = 0; i < n; i++)
            if (!strict_of[i]) params[i] = NULL;
        if ((st = rtr_tools_grammar(t->format, (const char *const *)t->names, params, n, -1, t->parallel, 1,
                                    grammar)))
            goto fail;
    }
    free(params);
    free(strict_of);
    *out = t;
    return BT_OK;
fail:
    free(params);
    free(strict_of);
    rtr_tools_free(t);
    return st;
}

bt_status rtr_tools_message_calls(const cJSON *calls, int idx, cJSON **out)
{
    *out = NULL;
    if (!cJSON_IsArray(calls)) return bad("'messages[%d].tool_calls' must be an array", idx);
    if (cJSON_GetArraySize(calls) > RTR_TOOL_MAX_CALLS)
        return bad("'messages[%d].tool_calls' may hold at most %d calls", idx, RTR_TOOL_MAX_CALLS);
    cJSON *a = cJSON_Duplicate(calls, 1);
    if (!a) return bt_fail(BT_ERR_NOMEM, "out of memory");
    int k = 0;
    cJSON *c;
    cJSON_ArrayForEach(c, a) {
        const cJSON *type = field(c, "type"), *id = field(c, "id");
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *name = cJSON_IsObject(fn) ? field(fn, "name") : NULL;
        cJSON *args = cJSON_IsObject(fn) ? cJSON_GetObjectItemCaseSensitive(fn, "arguments") : NULL;
        bt_status st = BT_OK;
        if (!cJSON_IsObject(c) || (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "function"))))
            st = bad("'messages[%d].tool_calls[%d]' must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                     "\"arguments\"}}", idx, k);
        else if (id && !cJSON_IsString(id))
            st = bad("'messages[%d].tool_calls[%d].id' must be a string", idx, k);
        else if (!cJSON_IsString(name))
            st = bad("'messages[%d].tool_calls[%d].function.name' must be a string", idx, k);
        else if (!cJSON_IsString(args))
            st = bad("'messages[%d].tool_calls[%d].function.arguments' must be a string of JSON", idx, k);
        if (!st) {
            const char *p = args->valuestring, *e = p + strlen(p);
            p = skip_ws(p, e);
            cJSON *v = json_at(&p, e);
            if (!cJSON_IsObject(v) || skip_ws(p, e) != e) {
                cJSON_Delete(v);
                st = bad("'messages[%d].tool_calls[%d].function.arguments' must be a JSON object (as text), nested "
                         "at most %d deep", idx, k, RTR_TOOL_MAX_DEPTH);
            } else if (!cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", v)) {
                cJSON_Delete(v);
                st = bt_fail(BT_ERR_NOMEM, "out of memory");
            }
        }
        if (st) {
            cJSON_Delete(a);
            return st;
        }
        k++;
    }
    *out = a;
    return BT_OK;
}
