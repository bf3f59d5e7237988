/* `baton tokenize` (text <-> ids) and `baton chat-template` (render a conversation), with JSON-lines batch modes
 * that the integration tests use to compare baton with the Hugging Face tokenizer. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/paths.h"
#include "engine/chat_template.h"
#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "engine/unicode.h"
#include "tools/commands.h"

/* ---- a small JSON reader for the inputs these commands take (strings, id arrays, message arrays) ---- */

typedef struct jbuf {
    char *p;
    size_t n, cap;
} jbuf;

static int jb_put(jbuf *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < b->n + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        if (!q) return -1;
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static const char *ws(const char *p)
{
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
    return p;
}

static int hex4(const char *p, uint32_t *v)
{
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* Parses a JSON string at p into out (cleared first); returns the position after it or NULL. */
static const char *parse_string(const char *p, jbuf *out)
{
    out->n = 0;
    if (jb_put(out, "", 0)) return NULL;
    p = ws(p);
    if (*p != '"') return NULL;
    p++;
    for (;;) {
        unsigned char c = (unsigned char)*p;
        if (c == 0) return NULL;
        if (c == '"') return p + 1;
        if (c != '\\') {
            if (jb_put(out, p, 1)) return NULL;
            p++;
            continue;
        }
        p++;
        char e = *p++;
        char ch;
        switch (e) {
        case '"': ch = '"'; break;
        case '\\': ch = '\\'; break;
        case '/': ch = '/'; break;
        case 'b': ch = '\b'; break;
        case 'f': ch = '\f'; break;
        case 'n': ch = '\n'; break;
        case 'r': ch = '\r'; break;
        case 't': ch = '\t'; break;
        case 'u': {
            uint32_t cp, lo;
            if (hex4(p, &cp)) return NULL;
            p += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF && p[0] == '\\' && p[1] == 'u' && !hex4(p + 2, &lo) && lo >= 0xDC00 &&
                lo <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                p += 6;
            }
            uint8_t u[4];
            size_t l = uni_utf8_encode(cp, u); /* a lone surrogate becomes U+FFFD */
            if (jb_put(out, u, l)) return NULL;
            continue;
        }
        default: return NULL;
        }
        if (jb_put(out, &ch, 1)) return NULL;
    }
}

/* Skips any JSON value; returns the position after it or NULL. */
static const char *skip_value(const char *p, int depth)
{
    p = ws(p);
    if (depth > 64) return NULL;
    if (*p == '"') {
        for (p++; *p && *p != '"'; p++)
            if (*p == '\\' && !*++p) return NULL;
        return *p ? p + 1 : NULL;
    }
    if (*p == '[' || *p == '{') {
        char close = *p == '[' ? ']' : '}';
        p = ws(p + 1);
        if (*p == close) return p + 1;
        for (;;) {
            if (close == '}') {
                if (!(p = skip_value(p, depth + 1))) return NULL;
                p = ws(p);
                if (*p++ != ':') return NULL;
            }
            if (!(p = skip_value(p, depth + 1))) return NULL;
            p = ws(p);
            if (*p == ',') {
                p++;
                continue;
            }
            return *p == close ? p + 1 : NULL;
        }
    }
    const char *s = p;
    while (*p && strchr("-+.eE0123456789truefalsn", *p)) p++;
    return p > s ? p : NULL;
}

/* Parses a JSON array of integer ids. */
static const char *parse_ids(const char *p, tok_ids *out)
{
    out->n = 0;
    p = ws(p);
    if (*p++ != '[') return NULL;
    p = ws(p);
    if (*p == ']') return p + 1;
    for (;;) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < INT32_MIN || v > INT32_MAX) return NULL;
        if (out->n == out->cap) {
            size_t c = out->cap ? out->cap * 2 : 64;
            int32_t *q = realloc(out->ids, c * sizeof *q);
            if (!q) return NULL;
            out->ids = q;
            out->cap = c;
        }
        out->ids[out->n++] = (int32_t)v;
        p = ws(end);
        if (*p == ',') {
            p = ws(p + 1);
            continue;
        }
        return *p == ']' ? p + 1 : NULL;
    }
}

typedef struct conv {
    chat_msg *msgs;
    char **owned; /* role, content and extra_json of each message */
    size_t n, cap;
    char *tools;  /* the JSON text of "tools", or NULL */
} conv;

static void conv_clear(conv *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free(c->owned[3 * i]);
        free(c->owned[3 * i + 1]);
        free(c->owned[3 * i + 2]);
    }
    c->n = 0;
    free(c->tools);
    c->tools = NULL;
}

static void conv_free(conv *c)
{
    conv_clear(c);
    free(c->msgs);
    free(c->owned);
}

/* A copy of p[0..n) as a NUL-terminated string; NULL on allocation failure. */
static char *dup_n(const char *p, size_t n)
{
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, p, n);
        s[n] = 0;
    }
    return s;
}

static char *take(jbuf *b, size_t *len)
{
    char *s = malloc(b->n + 1);
    if (s) {
        memcpy(s, b->p ? b->p : "", b->n);
        s[b->n] = 0;
        *len = b->n;
    }
    return s;
}

static const char *parse_msgs(const char *p, conv *c, const char **why);

/* Parses a conversation: [{"role": "...", "content": "..."}, ...], or {"messages": [...], "tools": [...]}. Other
 * keys of a message (tool_calls, tool_call_id, name, ...) go to the template as they are; content null is none. */
static const char *parse_conv(const char *p, conv *c, const char **why)
{
    conv_clear(c);
    p = ws(p);
    if (*p != '{') return parse_msgs(p, c, why);
    int have_msgs = 0;
    *why = "expected {\"messages\": [...], \"tools\": [...]}";
    p = ws(p + 1);
    while (*p != '}') {
        jbuf key = {0};
        p = parse_string(p, &key);
        int is_msgs = p && !strcmp(key.p, "messages"), is_tools = p && !strcmp(key.p, "tools");
        free(key.p);
        if (!p) return NULL;
        p = ws(p);
        if (*p++ != ':') return NULL;
        p = ws(p);
        const char *v = p;
        if (is_msgs) {
            if (!(p = parse_msgs(p, c, why))) return NULL;
            have_msgs = 1;
        } else {
            if (!(p = skip_value(p, 0))) return NULL;
            if (is_tools && strncmp(v, "null", 4)) {
                free(c->tools);
                if (!(c->tools = dup_n(v, (size_t)(p - v)))) return NULL;
            }
        }
        p = ws(p);
        if (*p == ',') p = ws(p + 1);
        else if (*p != '}') return NULL;
    }
    return have_msgs ? p + 1 : NULL;
}

static const char *parse_msgs(const char *p, conv *c, const char **why)
{
    jbuf tmp = {0}, extra = {0};
    *why = "expected a JSON array of {\"role\": ..., \"content\": ...} objects";
    p = ws(p);
    if (*p++ != '[') goto bad;
    p = ws(p);
    if (*p == ']') {
        free(tmp.p);
        return p + 1;
    }
    for (;;) {
        if (c->n == c->cap) {
            size_t cap = c->cap ? c->cap * 2 : 8;
            chat_msg *m = realloc(c->msgs, cap * sizeof *m);
            if (!m) goto bad;
            c->msgs = m;
            char **o = realloc(c->owned, 3 * cap * sizeof *o);
            if (!o) goto bad;
            c->owned = o;
            c->cap = cap;
        }
        char *role = NULL, *content = NULL, *extra_json = NULL;
        size_t rl = 0, cl = 0;
        int null_content = 0;
        extra.n = 0;
        p = ws(p);
        if (*p++ != '{') goto bad;
        p = ws(p);
        while (*p != '}') {
            jbuf key = {0};
            const char *key_at = p;
            p = parse_string(p, &key);
            int is_role = p && !strcmp(key.p, "role"), is_content = p && !strcmp(key.p, "content");
            free(key.p);
            if (!p) goto bad_msg;
            p = ws(p);
            if (*p++ != ':') goto bad_msg;
            p = ws(p);
            if ((is_role || is_content) && *p == '"') {
                if (!(p = parse_string(p, &tmp))) goto bad_msg;
                char **dst = is_role ? &role : &content;
                free(*dst);
                if (!(*dst = take(&tmp, is_role ? &rl : &cl))) goto bad_msg;
            } else {
                if (is_role || (is_content && strncmp(p, "null", 4))) {
                    *why = "\"role\" and \"content\" must be strings";
                    goto bad_msg;
                }
                const char *v = p;
                if (!(p = skip_value(p, 0))) goto bad_msg;
                if (is_content) {
                    null_content = 1;
                } else if (jb_put(&extra, extra.n ? "," : "{", 1) || jb_put(&extra, key_at, (size_t)(v - key_at)) ||
                           jb_put(&extra, v, (size_t)(p - v))) {
                    goto bad_msg;
                }
            }
            p = ws(p);
            if (*p == ',') p = ws(p + 1);
            else if (*p != '}') goto bad_msg;
        }
        p++;
        if (!role) {
            *why = "a message has no \"role\"";
            goto bad_msg;
        }
        if (!content && !null_content && !(content = calloc(1, 1))) goto bad_msg;
        if (null_content) {
            free(content);
            content = NULL;
            cl = 0;
        }
        if (extra.n && (jb_put(&extra, "}", 1) || !(extra_json = dup_n(extra.p, extra.n)))) goto bad_msg;
        c->owned[3 * c->n] = role;
        c->owned[3 * c->n + 1] = content;
        c->owned[3 * c->n + 2] = extra_json;
        c->msgs[c->n++] = (chat_msg){role, content, cl, extra_json};
        p = ws(p);
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p != ']') goto bad;
        free(tmp.p);
        free(extra.p);
        return p + 1;
    bad_msg:
        free(role);
        free(content);
        free(extra_json);
        goto bad;
    }
bad:
    free(tmp.p);
    free(extra.p);
    return NULL;
}

/* ---- output ---- */

/* Writes s as a JSON string: control characters (C0, C1) and U+2028/U+2029 escaped, so that no line splitter
 * breaks an output line; invalid UTF-8 bytes as \ufffd. */
static void print_json_string(FILE *out, const char *s, size_t n)
{
    fputc('"', out);
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            fputc('\\', out);
            fputc(c, out);
            i++;
        } else if (c == '\n') {
            fputs("\\n", out);
            i++;
        } else if (c < 0x20 || c == 0x7F) {
            fprintf(out, "\\u%04x", c);
            i++;
        } else if (c < 0x80) {
            fputc(c, out);
            i++;
        } else {
            uint32_t cp;
            int ok;
            size_t l = uni_utf8_decode((const uint8_t *)s + i, n - i, &cp, &ok);
            if (!ok) fputs("\\ufffd", out);
            else if ((cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029) fprintf(out, "\\u%04x", cp);
            else fwrite(s + i, 1, l, out);
            i += l;
        }
    }
    fputc('"', out);
}

static void print_ids_json(FILE *out, const tok_ids *v)
{
    fputc('[', out);
    for (size_t i = 0; i < v->n; i++) fprintf(out, i ? ",%d" : "%d", v->ids[i]);
    fputs("]\n", out);
}

/* Reads all of f into a malloc'd NUL-terminated buffer. */
static char *read_all(FILE *f, size_t *len)
{
    jbuf b = {0};
    char chunk[65536];
    size_t n;
    if (jb_put(&b, "", 0)) return NULL;
    while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
        if (jb_put(&b, chunk, n)) {
            free(b.p);
            return NULL;
        }
    *len = b.n;
    return b.p;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *s = read_all(f, len);
    fclose(f);
    return s;
}

/* Reads one line (without its newline) from f; returns -1 at EOF. */
static long read_line(FILE *f, char **line, size_t *cap)
{
    ssize_t n = getline(line, cap, f);
    if (n < 0) return -1;
    while (n > 0 && ((*line)[n - 1] == '\n' || (*line)[n - 1] == '\r')) (*line)[--n] = 0;
    return (long)n;
}

static const char *model_path(const char *given, char *buf, size_t cap)
{
    if (given) return given;
    if (bt_default_model_path(buf, cap)) return NULL;
    return buf;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- baton tokenize ---- */

static void tokenize_usage(FILE *out)
{
    fprintf(out,
            "usage: baton tokenize [--model PATH] [options] [TEXT]\n"
            "\n"
            "Encodes TEXT (or all of stdin, or --file) with the model's tokenizer and prints the ids.\n"
            "\n"
            "  --model PATH          GGUF file (default: $BATON_MODEL or the cached default model)\n"
            "  --file PATH           read the text from PATH\n"
            "  --pre NAME            pre-tokenizer instead of the file's: gpt2, digits-gpt2, llama3, qwen2 or a\n"
            "                        tokenizer.ggml.pre name\n"
            "  --add-special         add BOS/EOS as the model's metadata says (default: off)\n"
            "  --no-parse-special    treat control-token strings in the text as plain text\n"
            "  --pieces              print one \"id<TAB>piece\" line per token (piece as a JSON string)\n"
            "  --decode              the input is ids (separated by spaces or commas); print the text\n"
            "  --skip-special        with --decode: leave control tokens out\n"
            "  --jsonl               batch mode: each stdin line is a JSON string (with --decode: a JSON array\n"
            "                        of ids); each output line is a JSON array of ids (with --decode: a JSON\n"
            "                        string, invalid UTF-8 as U+FFFD)\n"
            "  --time                print load and encode times to stderr\n"
            "  -h, --help            this help\n"
            "\n"
            "Exit status: 0 on success, 1 on a model or input error (one line on stderr), 2 on bad usage.\n");
}

static int decode_print(const tok_tokenizer *t, const tok_ids *ids, unsigned flags, int json)
{
    char *s;
    size_t n;
    if (tok_decode(t, ids->ids, ids->n, flags, &s, &n)) {
        fprintf(stderr, "baton tokenize: %s\n", bt_last_error());
        return 1;
    }
    if (json) {
        print_json_string(stdout, s, n);
        fputc('\n', stdout);
    } else {
        fwrite(s, 1, n, stdout);
        fputc('\n', stdout);
    }
    free(s);
    return 0;
}

/* Parses "1 2 3" or "1,2,3" or "[1, 2, 3]". */
static int parse_id_list(const char *s, tok_ids *out)
{
    out->n = 0;
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '[' || *p == ']') p++;
        if (!*p) return 0;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < INT32_MIN || v > INT32_MAX) return -1;
        if (out->n == out->cap) {
            size_t c = out->cap ? out->cap * 2 : 64;
            int32_t *q = realloc(out->ids, c * sizeof *q);
            if (!q) return -1;
            out->ids = q;
            out->cap = c;
        }
        out->ids[out->n++] = (int32_t)v;
        p = end;
    }
}

int cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *file = NULL, *text = NULL, *pre = NULL;
    int decode = 0, jsonl = 0, pieces = 0, timing = 0;
    unsigned eflags = TOK_PARSE_SPECIAL, dflags = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            tokenize_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--model") || !strcmp(a, "--file") || !strcmp(a, "--pre")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "baton tokenize: %s needs a value\n", a);
                return 2;
            }
            *(!strcmp(a, "--model") ? &model : !strcmp(a, "--file") ? &file : &pre) = argv[++i];
        } else if (!strcmp(a, "--add-special")) {
            eflags |= TOK_ADD_SPECIAL;
        } else if (!strcmp(a, "--no-parse-special")) {
            eflags &= ~TOK_PARSE_SPECIAL;
        } else if (!strcmp(a, "--skip-special")) {
            dflags |= TOK_SKIP_SPECIAL;
        } else if (!strcmp(a, "--decode")) {
            decode = 1;
        } else if (!strcmp(a, "--jsonl")) {
            jsonl = 1;
        } else if (!strcmp(a, "--pieces")) {
            pieces = 1;
        } else if (!strcmp(a, "--time")) {
            timing = 1;
        } else if (!strcmp(a, "--")) {
            if (i + 1 < argc) text = argv[++i];
            if (i + 1 < argc) {
                fprintf(stderr, "baton tokenize: give the text as one argument (quote it)\n");
                return 2;
            }
        } else if (a[0] == '-' && a[1] == '-') {
            fprintf(stderr, "baton tokenize: unknown option '%s' (see --help)\n", a);
            return 2;
        } else if (text) {
            fprintf(stderr, "baton tokenize: give the text as one argument (quote it)\n");
            return 2;
        } else {
            text = a;
        }
    }
    if (!text && !file && isatty(STDIN_FILENO)) {
        fprintf(stderr, "baton tokenize: give TEXT, --file PATH or text on stdin (see --help)\n");
        return 2;
    }
    if ((text && file) || (jsonl && (text || file))) {
        fprintf(stderr, "baton tokenize: give one input: TEXT, --file, or stdin (--jsonl reads stdin)\n");
        return 2;
    }
    char pathbuf[4096];
    const char *path = model_path(model, pathbuf, sizeof pathbuf);
    if (!path) {
        fprintf(stderr, "baton tokenize: %s\n", bt_last_error());
        return 1;
    }
    double t0 = now_s();
    tok_tokenizer *t;
    gguf_file *f;
    if (gguf_open(path, &f)) {
        fprintf(stderr, "baton tokenize: %s: %s\n", path, bt_last_error());
        return 1;
    }
    bt_status st = tok_create_ex(f, pre, &t);
    gguf_close(f);
    if (st) {
        fprintf(stderr, "baton tokenize: %s: %s\n", path, bt_last_error());
        return 1;
    }
    double t_load = now_s() - t0, t_enc = 0;
    size_t enc_bytes = 0, enc_tokens = 0;
    int rc = 0;
    tok_ids ids = {0};
    char *owned = NULL;
    if (jsonl) {
        char *line = NULL;
        size_t cap = 0;
        jbuf s = {0};
        long lineno = 0;
        while (read_line(stdin, &line, &cap) >= 0) {
            lineno++;
            if (decode) {
                const char *e = parse_ids(line, &ids);
                if (!e || *ws(e)) {
                    fprintf(stderr, "baton tokenize: stdin line %ld: expected a JSON array of ids\n", lineno);
                    rc = 1;
                    break;
                }
                if ((rc = decode_print(t, &ids, dflags, 1))) break;
            } else {
                const char *e = parse_string(line, &s);
                if (!e || *ws(e)) {
                    fprintf(stderr, "baton tokenize: stdin line %ld: expected a JSON string\n", lineno);
                    rc = 1;
                    break;
                }
                ids.n = 0;
                double a = now_s();
                if (tok_encode(t, s.p, s.n, eflags, &ids)) {
                    fprintf(stderr, "baton tokenize: %s\n", bt_last_error());
                    rc = 1;
                    break;
                }
                t_enc += now_s() - a;
                enc_bytes += s.n;
                enc_tokens += ids.n;
                print_ids_json(stdout, &ids);
            }
        }
        free(line);
        free(s.p);
    } else {
        size_t len = 0;
        if (file) {
            if (!(owned = read_file(file, &len))) {
                fprintf(stderr, "baton tokenize: cannot read %s: %s\n", file, strerror(errno));
                rc = 1;
                goto out;
            }
            text = owned;
        } else if (!text) {
            if (!(owned = read_all(stdin, &len))) {
                fprintf(stderr, "baton tokenize: cannot read stdin\n");
                rc = 1;
                goto out;
            }
            text = owned;
        } else {
            len = strlen(text);
        }
        if (decode) {
            if (parse_id_list(text, &ids)) {
                fprintf(stderr, "baton tokenize: --decode expects integer ids separated by spaces or commas\n");
                rc = 1;
                goto out;
            }
            rc = decode_print(t, &ids, dflags, 0);
        } else {
            double a = now_s();
            if (tok_encode(t, text, len, eflags, &ids)) {
                fprintf(stderr, "baton tokenize: %s\n", bt_last_error());
                rc = 1;
                goto out;
            }
            t_enc = now_s() - a;
            enc_bytes = len;
            enc_tokens = ids.n;
            if (pieces) {
                for (size_t i = 0; i < ids.n; i++) {
                    size_t pl;
                    const char *pc = tok_token_piece(t, ids.ids[i], &pl);
                    printf("%d\t", ids.ids[i]);
                    print_json_string(stdout, pc, pl);
                    putchar('\n');
                }
            } else {
                for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
                putchar('\n');
            }
        }
    }
    if (timing)
        fprintf(stderr, "load %.3f s; encode %zu bytes -> %zu tokens in %.4f s (%.1f MB/s)\n", t_load, enc_bytes,
                enc_tokens, t_enc, t_enc > 0 ? (double)enc_bytes / t_enc / 1e6 : 0.0);
out:
    free(owned);
    tok_ids_free(&ids);
    tok_free(t);
    if (fflush(stdout)) rc = 1;
    return rc;
}

/* ---- baton chat-template ---- */

static void chat_usage(FILE *out)
{
    fprintf(out,
            "usage: baton chat-template [--model PATH] [options] [CONVERSATION]\n"
            "\n"
            "Renders a conversation with the model's chat template (its Jinja text, by baton's interpreter; a\n"
            "built-in renderer when it does not parse). CONVERSATION (or stdin) is a JSON array of\n"
            "{\"role\": ..., \"content\": ...} objects (other fields such as tool_calls reach the template as they\n"
            "are), or {\"messages\": [...], \"tools\": [...]}; the rendered prompt is printed as is.\n"
            "\n"
            "  --model PATH             GGUF file (default: $BATON_MODEL or the cached default model)\n"
            "  --chat-template builtin:NAME|FILE\n"
            "                           a built-in renderer (chatml, llama3, mistral, gemma, zephyr; a bare NAME\n"
            "                           works too), or a Jinja template FILE rendered by the interpreter\n"
            "  --template-file PATH     this template text instead of the model's (interpreted, with the fallback)\n"
            "  --now SECONDS            the Unix time that strftime_now formats (default: now)\n"
            "  --no-generation-prompt   do not append the assistant header\n"
            "  --tokenize               print the rendered prompt's ids instead of its text\n"
            "  --detect                 print the chosen renderer (jinja or a built-in name) and exit\n"
            "  --jsonl                  batch mode: each stdin line is a conversation; each output line is the\n"
            "                           rendered prompt as a JSON string (with --tokenize: a JSON array of ids),\n"
            "                           or {\"error\": ...} when it cannot be rendered (the exit status is then 1)\n"
            "  -h, --help               this help\n"
            "\n"
            "Exit status: 0 on success, 1 on a model, template or input error (one line on stderr), 2 on bad usage.\n");
}

static int render_one(const chat_tmpl *ct, const tok_tokenizer *t, const conv *c, int gen, int64_t now, int json)
{
    char *s;
    size_t n;
    chat_render_opts o = {.add_generation_prompt = gen, .tools_json = c->tools, .now = now};
    if (chat_tmpl_render_opts(ct, c->msgs, c->n, &o, &s, &n)) {
        fprintf(stderr, "baton chat-template: %s\n", bt_last_error());
        if (json) { /* the batch goes on: this conversation's line says why it failed */
            const char *e = bt_last_error();
            fputs("{\"error\": ", stdout);
            print_json_string(stdout, e, strlen(e));
            fputs("}\n", stdout);
        }
        return 1;
    }
    if (t) {
        tok_ids ids = {0};
        /* the template writes BOS itself where the model wants one (as the router and `generate --chat` encode it,
         * and HF's apply_chat_template(tokenize=True)): adding it again gave Gemma two */
        if (tok_encode(t, s, n, TOK_PARSE_SPECIAL, &ids)) {
            fprintf(stderr, "baton chat-template: %s\n", bt_last_error());
            free(s);
            return 1;
        }
        if (json) {
            print_ids_json(stdout, &ids);
        } else {
            for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
            putchar('\n');
        }
        tok_ids_free(&ids);
    } else if (json) {
        print_json_string(stdout, s, n);
        fputc('\n', stdout);
    } else {
        fwrite(s, 1, n, stdout);
    }
    free(s);
    return 0;
}

int cmd_chat_template(int argc, char **argv)
{
    const char *model = NULL, *name = NULL, *tfile = NULL, *arg = NULL;
    int gen = 1, tokenize = 0, jsonl = 0, detect = 0;
    int64_t now = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            chat_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--model") || !strcmp(a, "--chat-template") || !strcmp(a, "--template-file")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "baton chat-template: %s needs a value\n", a);
                return 2;
            }
            *(!strcmp(a, "--model") ? &model : !strcmp(a, "--chat-template") ? &name : &tfile) = argv[++i];
        } else if (!strcmp(a, "--now")) {
            char *end = NULL;
            if (i + 1 < argc) now = strtoll(argv[++i], &end, 10);
            if (!end || *end || now <= 0) {
                fprintf(stderr, "baton chat-template: --now needs a positive number of seconds\n");
                return 2;
            }
        } else if (!strcmp(a, "--no-generation-prompt")) {
            gen = 0;
        } else if (!strcmp(a, "--tokenize")) {
            tokenize = 1;
        } else if (!strcmp(a, "--jsonl")) {
            jsonl = 1;
        } else if (!strcmp(a, "--detect")) {
            detect = 1;
        } else if (a[0] == '-' && a[1] == '-') {
            fprintf(stderr, "baton chat-template: unknown option '%s' (see --help)\n", a);
            return 2;
        } else if (arg) {
            fprintf(stderr, "baton chat-template: give the conversation as one argument (quote it)\n");
            return 2;
        } else {
            arg = a;
        }
    }
    if (!arg && !detect && isatty(STDIN_FILENO)) {
        fprintf(stderr, "baton chat-template: give the conversation as an argument or on stdin (see --help)\n");
        return 2;
    }
    if (jsonl && arg) {
        fprintf(stderr, "baton chat-template: --jsonl reads stdin; give no CONVERSATION argument\n");
        return 2;
    }
    char pathbuf[4096];
    const char *path = model_path(model, pathbuf, sizeof pathbuf);
    if (!path) {
        fprintf(stderr, "baton chat-template: %s\n", bt_last_error());
        return 1;
    }
    int rc = 1;
    gguf_file *f = NULL;
    tok_tokenizer *t = NULL;
    chat_tmpl ct = {0};
    char *ttext = NULL, *input = NULL, *line = NULL;
    conv c = {0};
    if (gguf_open(path, &f)) {
        fprintf(stderr, "baton chat-template: %s: %s\n", path, bt_last_error());
        return 1;
    }
    bt_status st;
    if (tfile) {
        size_t tl;
        if (!(ttext = read_file(tfile, &tl))) {
            fprintf(stderr, "baton chat-template: cannot read %s: %s\n", tfile, strerror(errno));
            goto out;
        }
        chat_tmpl bos_eos = {0};
        /* bos/eos still come from the model */
        st = chat_tmpl_init_gguf(&bos_eos, f, "chatml");
        if (!st) st = chat_tmpl_init(&ct, ttext, tl, name, bos_eos.bos, bos_eos.eos);
        chat_tmpl_free(&bos_eos);
    } else {
        st = chat_tmpl_init_gguf(&ct, f, name);
    }
    if (st) {
        fprintf(stderr, "baton chat-template: %s\n", bt_last_error());
        goto out;
    }
    if (detect) {
        printf("%s\n", chat_tmpl_name(ct.kind));
        rc = 0;
        goto out;
    }
    if (tokenize && tok_create(f, &t)) {
        fprintf(stderr, "baton chat-template: %s: %s\n", path, bt_last_error());
        goto out;
    }
    const char *why;
    if (jsonl) {
        size_t cap = 0;
        long lineno = 0;
        int failed = 0;
        while (read_line(stdin, &line, &cap) >= 0) {
            lineno++;
            const char *e = parse_conv(line, &c, &why);
            if (!e || *ws(e)) {
                fprintf(stderr, "baton chat-template: stdin line %ld: %s\n", lineno, why);
                goto out;
            }
            failed |= render_one(&ct, t, &c, gen, now, 1);
        }
        if (failed) goto out;
    } else {
        size_t len;
        if (!arg) {
            if (!(input = read_all(stdin, &len))) {
                fprintf(stderr, "baton chat-template: cannot read stdin\n");
                goto out;
            }
            arg = input;
        }
        const char *e = parse_conv(arg, &c, &why);
        if (!e || *ws(e)) {
            fprintf(stderr, "baton chat-template: %s\n", why);
            goto out;
        }
        if (render_one(&ct, t, &c, gen, now, 0)) goto out;
    }
    rc = fflush(stdout) ? 1 : 0;
out:
    conv_free(&c);
    free(line);
    free(input);
    free(ttext);
    chat_tmpl_free(&ct);
    tok_free(t);
    gguf_close(f);
    return rc;
}
