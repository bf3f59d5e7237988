/* Jinja interpreter (see jinja.h). Three parts: a lexer that applies Jinja2's whitespace rules while it cuts the
 * source into text and tag tokens, a recursive-descent parser to an AST, and a tree-walking evaluator.
 *
 * All memory of a parse or a render comes from one arena that is freed at once, so errors leave by longjmp from
 * wherever they are found (nothing to unwind) and a render's memory bound is the arena's cap. */
#include "engine/jinja.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/unicode.h"

/* ---- arena ---- */

typedef struct jchunk {
    struct jchunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char mem[];
} jchunk;

typedef struct jarena {
    jchunk *head;
    size_t total, cap; /* bytes taken from malloc; the most allowed */
} jarena;

static void arena_free(jarena *a)
{
    for (jchunk *c = a->head, *n; c; c = n) {
        n = c->next;
        free(c);
    }
    a->head = NULL;
    a->total = 0;
}

/* NULL when the cap is reached or malloc fails; the caller reports it. */
static void *arena_alloc(jarena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    jchunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->total + cap > a->cap) return NULL;
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->cap = cap;
        c->used = 0;
        c->next = a->head;
        a->head = c;
        a->total += cap;
    }
    void *p = c->mem + c->used;
    c->used += n;
    return p;
}

/* ---- values ---- */

typedef enum jv_type {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,
    JV_DICT,
    JV_NS,    /* namespace(): a dict whose attributes may be assigned */
    JV_LOOP,  /* the loop variable of a for */
    JV_FUNC,  /* a global function or a bound method */
    JV_MACRO,
} jv_type;

struct jlist;
struct jdict;
struct jfunc;
struct jloop;
struct jnode;

typedef struct jv {
    jv_type t;
    int safe; /* JV_STR: markupsafe.Markup (from |safe), whose + escapes a plain operand */
    union {
        int64_t i; /* JV_BOOL, JV_INT */
        double f;
        struct {
            const char *p;
            size_t n;
        } s; /* JV_STR; JV_UNDEF: the name that was undefined (may be NULL) */
        struct jlist *l;
        struct jdict *d;
        struct jfunc *fn;
        struct jloop *loop;
        const struct jnode *m;
    };
} jv;

typedef struct jlist {
    jv *v;
    size_t n, cap;
    int gen; /* the result of map/select/reject: a generator in Jinja2, so no len(), no index, no JSON, truthy */
} jlist;

typedef struct jdict {
    jv *k, *v;
    size_t n, cap;
} jdict;

typedef enum jfunc_id {
    F_RAISE,
    F_STRFTIME,
    F_NAMESPACE,
    F_RANGE,
    F_DICT,
    M_STRIP,
    M_LSTRIP,
    M_RSTRIP,
    M_SPLIT,
    M_RSPLIT,
    M_STARTSWITH,
    M_ENDSWITH,
    M_UPPER,
    M_LOWER,
    M_TITLE,
    M_CAPITALIZE,
    M_REPLACE,
    M_FIND,
    M_COUNT,
    M_JOIN,
    M_SPLITLINES,
    M_ISDIGIT,
    M_ISSPACE,
    M_FORMAT,
    M_ITEMS,
    M_KEYS,
    M_VALUES,
    M_GET,
} jfunc_id;

typedef struct jfunc {
    jfunc_id id;
    jv self;
} jfunc;

typedef struct jloop {
    jlist *items;
    size_t i;
} jloop;

static const jv UNDEF = {.t = JV_UNDEF};
static const jv NONE = {.t = JV_NONE};

/* ---- AST ---- */

typedef enum jn_kind {
    /* expressions */
    N_LIT,
    N_NAME,
    N_ATTR,   /* a.name */
    N_ITEM,   /* a[b] */
    N_SLICE,  /* a[b:c:d] */
    N_CALL,   /* a(args in b) */
    N_FILTER, /* a | name(args in b) */
    N_TEST,   /* a is [not] name(args in b); op = negated */
    N_NEG,
    N_POS,
    N_NOT,
    N_AND,
    N_OR,
    N_BIN,    /* op: one of the binary operators */
    N_COMPARE, /* a op1 b op2 c ...: a, then the operands in b (each N_BIN-less: op and operand in a) */
    N_COND,   /* a if b else c */
    N_LIST,   /* items in a */
    N_TUPLE,
    N_DICT,   /* pairs in a: N_PAIR(a = key, b = value) */
    N_PAIR,
    N_KWARG,  /* name = a */
    /* statements */
    N_TEXT,
    N_OUT,
    N_IF,     /* a cond, b body, c else */
    N_FOR,    /* a targets (N_NAME list), b iterable, c body, d else, e filter */
    N_SET,    /* a target (N_NAME, N_ATTR, or N_TUPLE of names), b value */
    N_SETBLOCK, /* a target, b body */
    N_MACRO,  /* name, a params (N_NAME, default in its a), b body */
    N_BREAK,
    N_CONTINUE,
    N_FILTERBLOCK, /* name, b args, c body */
    N_BODY,   /* a: statements (a transparent block such as {% generation %}) */
} jn_kind;

enum { OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT, OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT,
       OP_GE, OP_IN, OP_NOTIN };

typedef struct jnode {
    jn_kind k;
    int op;
    uint32_t line, col;
    const char *name;
    size_t name_n;
    jv lit;
    struct jnode *a, *b, *c, *d, *e;
    struct jnode *next; /* the next statement, argument, item or parameter */
} jnode;

struct jinja_tmpl {
    jarena arena;
    jnode *body;
};

/* ---- errors ---- */

typedef struct jerr {
    jmp_buf jmp;
    bt_status st;
    char msg[400];
} jerr;

static _Noreturn void fail_at(jerr *e, bt_status st, uint32_t line, uint32_t col, const char *fmt, va_list ap)
    __attribute__((format(printf, 5, 0)));
static _Noreturn void fail_at(jerr *e, bt_status st, uint32_t line, uint32_t col, const char *fmt, va_list ap)
{
    int k = snprintf(e->msg, sizeof e->msg, "line %u:%u: ", line, col);
    if (k < 0) k = 0;
    vsnprintf(e->msg + k, sizeof e->msg - (size_t)k, fmt, ap);
    e->st = st;
    longjmp(e->jmp, 1);
}

/* ---- lexer ---- */

typedef enum jt_kind { T_EOF, T_DATA, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END, T_NAME, T_STR, T_INT,
                       T_FLOAT, T_OP } jt_kind;

typedef struct jtok {
    jt_kind k;
    const char *p; /* T_STR: the decoded string; others: the source text */
    size_t n;
    int64_t i;
    double f;
    uint32_t line, col;
} jtok;

typedef struct jlex {
    jerr *err;
    jarena *arena;
    const char *src;
    size_t n, pos;
    jtok *toks;
    size_t nt, cap;
    uint32_t depth; /* parser recursion */
} jlex;

static _Noreturn void lex_fail(jlex *L, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void lex_fail(jlex *L, size_t at, const char *fmt, ...)
{
    uint32_t line = 1, col = 1;
    for (size_t i = 0; i < at && i < L->n; i++) {
        if (L->src[i] == '\n') {
            line++;
            col = 1;
        } else if (((unsigned char)L->src[i] & 0xC0) != 0x80) {
            col++;
        }
    }
    va_list ap;
    va_start(ap, fmt);
    fail_at(L->err, BT_ERR_FORMAT, line, col, fmt, ap);
}

static void *lalloc(jlex *L, size_t n)
{
    void *p = arena_alloc(L->arena, n);
    if (!p) {
        L->err->st = BT_ERR_NOMEM;
        snprintf(L->err->msg, sizeof L->err->msg, "out of memory parsing the template");
        longjmp(L->err->jmp, 1);
    }
    return p;
}

static jtok *emit(jlex *L, jt_kind k, size_t at, const char *p, size_t n)
{
    if (L->nt == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        jtok *t = lalloc(L, cap * sizeof *t);
        if (L->nt) memcpy(t, L->toks, L->nt * sizeof *t);
        L->toks = t;
        L->cap = cap;
    }
    jtok *t = &L->toks[L->nt++];
    memset(t, 0, sizeof *t);
    t->k = k;
    t->p = p;
    t->n = n;
    t->line = (uint32_t)at; /* the offset for now; turned into line:col after lexing */
    return t;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
static int is_name0(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }

static void put_utf8(char *d, size_t *o, uint32_t cp)
{
    if (cp < 0x80) {
        d[(*o)++] = (char)cp;
    } else if (cp < 0x800) {
        d[(*o)++] = (char)(0xC0 | (cp >> 6));
        d[(*o)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        d[(*o)++] = (char)(0xE0 | (cp >> 12));
        d[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        d[(*o)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        d[(*o)++] = (char)(0xF0 | (cp >> 18));
        d[(*o)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        d[(*o)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        d[(*o)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string literal at L->pos (a quote): Python's escapes; an unknown escape is kept as written. */
static void lex_string(jlex *L)
{
    size_t start = L->pos;
    char q = L->src[L->pos++];
    size_t e = L->pos;
    while (e < L->n && L->src[e] != q) e += L->src[e] == '\\' ? 2 : 1;
    if (e >= L->n) lex_fail(L, start, "unterminated string");
    char *d = lalloc(L, e - L->pos + 1);
    size_t o = 0;
    for (size_t i = L->pos; i < e; i++) {
        char c = L->src[i];
        if (c != '\\') {
            d[o++] = c;
            continue;
        }
        char x = L->src[++i];
        int nhex = x == 'x' ? 2 : x == 'u' ? 4 : x == 'U' ? 8 : 0;
        if (nhex) {
            uint32_t cp = 0;
            int k;
            for (k = 0; k < nhex && i + 1 + (size_t)k < e && hexval(L->src[i + 1 + k]) >= 0; k++)
                cp = cp * 16 + (uint32_t)hexval(L->src[i + 1 + k]);
            if (k < nhex || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) lex_fail(L, i - 1, "bad \\%c escape", x);
            i += (size_t)nhex;
            put_utf8(d, &o, cp);
            continue;
        }
        switch (x) {
        case 'n': d[o++] = '\n'; break;
        case 't': d[o++] = '\t'; break;
        case 'r': d[o++] = '\r'; break;
        case '0': d[o++] = '\0'; break;
        case 'a': d[o++] = '\a'; break;
        case 'b': d[o++] = '\b'; break;
        case 'f': d[o++] = '\f'; break;
        case 'v': d[o++] = '\v'; break;
        case '\\': d[o++] = '\\'; break;
        case '\'': d[o++] = '\''; break;
        case '"': d[o++] = '"'; break;
        case '\n': break;
        default:
            d[o++] = '\\';
            d[o++] = x;
        }
    }
    d[o] = 0;
    emit(L, T_STR, start, d, o);
    L->pos = e + 1;
}

static void lex_number(jlex *L)
{
    size_t s = L->pos, e = s;
    int is_float = 0;
    while (e < L->n && (is_digit(L->src[e]) || L->src[e] == '_')) e++;
    if (e + 1 < L->n && L->src[e] == '.' && is_digit(L->src[e + 1])) {
        is_float = 1;
        e++;
        while (e < L->n && (is_digit(L->src[e]) || L->src[e] == '_')) e++;
    }
    if (e < L->n && (L->src[e] == 'e' || L->src[e] == 'E')) {
        size_t k = e + 1;
        if (k < L->n && (L->src[k] == '+' || L->src[k] == '-')) k++;
        if (k < L->n && is_digit(L->src[k])) {
            is_float = 1;
            e = k;
            while (e < L->n && is_digit(L->src[e])) e++;
        }
    }
    char buf[64];
    size_t o = 0;
    for (size_t i = s; i < e && o < sizeof buf - 1; i++)
        if (L->src[i] != '_') buf[o++] = L->src[i];
    buf[o] = 0;
    jtok *t = emit(L, is_float ? T_FLOAT : T_INT, s, L->src + s, e - s);
    if (is_float) {
        t->f = strtod(buf, NULL);
    } else {
        char *end;
        unsigned long long v = strtoull(buf, &end, 10);
        if (v > INT64_MAX || o >= sizeof buf - 1) lex_fail(L, s, "integer literal too large");
        t->i = (int64_t)v;
    }
    L->pos = e;
}

/* Tokens of one tag, up to its closer ("}}" or "%}", with an optional '-' before it). Returns the closer's offset
 * and sets *strip when it has the '-'. */
static size_t lex_tag(jlex *L, int block, size_t open_at, int *strip)
{
    int depth = 0;
    char c1 = block ? '%' : '}';
    for (;;) {
        while (L->pos < L->n && is_ws(L->src[L->pos])) L->pos++;
        if (L->pos >= L->n) lex_fail(L, open_at, "unclosed %s", block ? "'{%'" : "'{{'");
        const char *s = L->src + L->pos;
        size_t left = L->n - L->pos;
        if (depth == 0) {
            if (left >= 3 && s[0] == '-' && s[1] == c1 && s[2] == '}') {
                *strip = 1;
                return L->pos;
            }
            if (left >= 2 && s[0] == c1 && s[1] == '}') {
                *strip = 0;
                return L->pos;
            }
            if (block && left >= 3 && s[0] == '+' && s[1] == '%' && s[2] == '}') {
                *strip = 2; /* "+%}": no trim_blocks */
                return L->pos;
            }
        }
        if (is_name0(*s)) {
            size_t e = L->pos;
            while (e < L->n && (is_name0(L->src[e]) || is_digit(L->src[e]))) e++;
            emit(L, T_NAME, L->pos, s, e - L->pos);
            L->pos = e;
        } else if (is_digit(*s)) {
            lex_number(L);
        } else if (*s == '\'' || *s == '"') {
            lex_string(L);
        } else {
            static const char *const two[] = {"**", "//", "==", "!=", "<=", ">="};
            size_t n = 0;
            for (size_t k = 0; k < sizeof two / sizeof *two; k++)
                if (left >= 2 && s[0] == two[k][0] && s[1] == two[k][1]) n = 2;
            if (!n && strchr("+-*/%~<>=()[]{},.:|", *s) && *s) n = 1;
            if (!n) lex_fail(L, L->pos, "unexpected character '%c'", *s);
            if (n == 1 && strchr("([{", *s)) depth++;
            if (n == 1 && strchr(")]}", *s)) {
                if (depth == 0) lex_fail(L, L->pos, "unbalanced '%c'", *s);
                depth--;
            }
            emit(L, T_OP, L->pos, s, n);
            L->pos += n;
        }
    }
}

/* Offset just past whitespace from at. */
static size_t skip_ws(const jlex *L, size_t at)
{
    while (at < L->n && is_ws(L->src[at])) at++;
    return at;
}

/* {% raw %}...{% endraw %}: returns 1 and emits the raw text when the block tag at open (after "{%") is "raw". */
static int lex_raw(jlex *L, size_t tag_at, size_t body_at, int *line_starting)
{
    size_t p = skip_ws(L, body_at);
    if (L->n - p < 3 || memcmp(L->src + p, "raw", 3)) return 0;
    size_t q = skip_ws(L, p + 3);
    int strip_after = 0;
    if (q < L->n && L->src[q] == '-') {
        strip_after = 1;
        q++;
    }
    if (L->n - q < 2 || memcmp(L->src + q, "%}", 2)) return 0;
    size_t text = q + 2;
    if (strip_after) text = skip_ws(L, text);
    else if (text < L->n && L->src[text] == '\n') text++;
    for (size_t i = text; i + 1 < L->n; i++) {
        if (L->src[i] != '{' || L->src[i + 1] != '%') continue;
        size_t k = i + 2, strip_before = 0;
        if (k < L->n && L->src[k] == '-') {
            strip_before = 1;
            k++;
        }
        k = skip_ws(L, k);
        if (L->n - k < 6 || memcmp(L->src + k, "endraw", 6)) continue;
        size_t c = skip_ws(L, k + 6);
        int strip = 0;
        if (c < L->n && L->src[c] == '-') {
            strip = 1;
            c++;
        }
        if (L->n - c < 2 || memcmp(L->src + c, "%}", 2)) continue;
        size_t end = i;
        if (strip_before)
            while (end > text && is_ws(L->src[end - 1])) end--;
        if (end > text) emit(L, T_DATA, text, L->src + text, end - text);
        size_t after = c + 2;
        if (strip) after = skip_ws(L, after);
        else if (after < L->n && L->src[after] == '\n') after++;
        L->pos = after;
        *line_starting = after > 0 && L->src[after - 1] == '\n';
        return 1;
    }
    lex_fail(L, tag_at, "{%% raw %%} without {%% endraw %%}");
}

static void lex_all(jlex *L)
{
    int line_starting = 1;
    while (L->pos < L->n) {
        size_t q = L->pos;
        while (q + 1 < L->n && !(L->src[q] == '{' && (L->src[q + 1] == '{' || L->src[q + 1] == '%' ||
                                                       L->src[q + 1] == '#')))
            q++;
        if (q + 1 >= L->n) {
            emit(L, T_DATA, L->pos, L->src + L->pos, L->n - L->pos);
            L->pos = L->n;
            break;
        }
        char kind = L->src[q + 1];
        char sign = q + 2 < L->n ? L->src[q + 2] : 0;
        size_t dend = q;
        if (sign == '-') {
            while (dend > L->pos && is_ws(L->src[dend - 1])) dend--;
        } else if (kind != '{' && sign != '+') {
            /* lstrip_blocks: spaces and tabs between the line's start and a block or comment tag go */
            size_t l = q;
            while (l > L->pos && L->src[l - 1] != '\n') l--;
            int only_ws = 1;
            for (size_t i = l; i < q; i++)
                if (!is_ws(L->src[i])) only_ws = 0;
            if (only_ws && (l > L->pos || line_starting)) dend = l;
        }
        if (dend > L->pos) emit(L, T_DATA, L->pos, L->src + L->pos, dend - L->pos);
        size_t body = q + 2 + (sign == '-' || sign == '+');
        size_t after;
        int strip;
        if (kind == '#') {
            size_t e = body;
            while (e + 1 < L->n && !(L->src[e] == '#' && L->src[e + 1] == '}')) e++;
            if (e + 1 >= L->n) lex_fail(L, q, "unclosed comment");
            strip = e > body && L->src[e - 1] == '-';
            after = e + 2;
        } else if (kind == '%' && lex_raw(L, q, body, &line_starting)) {
            continue;
        } else {
            emit(L, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, q, L->src + q, 2);
            L->pos = body;
            size_t c = lex_tag(L, kind == '%', q, &strip);
            emit(L, kind == '%' ? T_BLOCK_END : T_VAR_END, c, L->src + c, 2);
            after = c + 2 + (strip != 0);
        }
        if (strip == 1) {
            after = skip_ws(L, after);
        } else if (kind != '{' && strip == 0 && after < L->n && L->src[after] == '\n') {
            after++; /* trim_blocks */
        }
        L->pos = after;
        line_starting = after > 0 && L->src[after - 1] == '\n';
    }
    emit(L, T_EOF, L->n, L->src + L->n, 0);
    /* offsets to line:col in one pass */
    uint32_t line = 1, col = 1;
    size_t at = 0;
    for (size_t i = 0; i < L->nt; i++) {
        size_t off = L->toks[i].line;
        for (; at < off && at < L->n; at++) {
            if (L->src[at] == '\n') {
                line++;
                col = 1;
            } else if (((unsigned char)L->src[at] & 0xC0) != 0x80) {
                col++;
            }
        }
        L->toks[i].line = line;
        L->toks[i].col = col;
    }
}

/* ---- parser ---- */

typedef struct jparse {
    jlex *L;
    size_t at; /* the current token */
} jparse;

static const jtok *cur(jparse *P) { return &P->L->toks[P->at]; }

static _Noreturn void parse_fail(jparse *P, const jtok *t, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static _Noreturn void parse_fail(jparse *P, const jtok *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail_at(P->L->err, BT_ERR_FORMAT, t->line, t->col, fmt, ap);
}

static int tok_is(const jtok *t, jt_kind k, const char *s)
{
    return t->k == k && (!s || (strlen(s) == t->n && !memcmp(t->p, s, t->n)));
}

static int at_op(jparse *P, const char *op) { return tok_is(cur(P), T_OP, op); }
static int at_name(jparse *P, const char *nm) { return tok_is(cur(P), T_NAME, nm); }

static const jtok *next_tok(jparse *P)
{
    const jtok *t = cur(P);
    if (t->k != T_EOF) P->at++;
    return t;
}

static const char *tok_desc(const jtok *t)
{
    switch (t->k) {
    case T_EOF: return "the end of the template";
    case T_DATA: return "text";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "'}}'";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "'%}'";
    case T_NAME: return "a name";
    case T_STR: return "a string";
    case T_INT:
    case T_FLOAT: return "a number";
    default: return "an operator";
    }
}

static void expect_op(jparse *P, const char *op)
{
    if (!at_op(P, op)) parse_fail(P, cur(P), "expected '%s', found %s", op, tok_desc(cur(P)));
    P->at++;
}

static void expect_k(jparse *P, jt_kind k)
{
    if (cur(P)->k != k) {
        static const char *const names[] = {[T_BLOCK_END] = "'%}'", [T_VAR_END] = "'}}'"};
        parse_fail(P, cur(P), "expected %s, found %s", k < sizeof names / sizeof *names && names[k] ? names[k] : "?",
                   tok_desc(cur(P)));
    }
    P->at++;
}

static jnode *node(jparse *P, jn_kind k, const jtok *at)
{
    jnode *n = lalloc(P->L, sizeof *n);
    memset(n, 0, sizeof *n);
    n->k = k;
    n->line = at->line;
    n->col = at->col;
    return n;
}

static void enter(jparse *P)
{
    if (++P->L->depth > 100) parse_fail(P, cur(P), "nested too deeply");
}

static jnode *parse_expr(jparse *P);
static jnode *parse_or(jparse *P);
static jnode *parse_unary(jparse *P, int with_filter);

/* Arguments up to ')' (already past '('): positional, then name=value as N_KWARG. */
static jnode *parse_args(jparse *P)
{
    jnode *head = NULL, **tail = &head;
    while (!at_op(P, ")")) {
        jnode *a;
        const jtok *t = cur(P);
        if (t->k == T_NAME && tok_is(&P->L->toks[P->at + 1], T_OP, "=")) {
            a = node(P, N_KWARG, t);
            a->name = t->p;
            a->name_n = t->n;
            P->at += 2;
            a->a = parse_expr(P);
        } else {
            a = parse_expr(P);
        }
        *tail = a;
        tail = &a->next;
        if (!at_op(P, ",")) break;
        P->at++;
    }
    expect_op(P, ")");
    return head;
}

static jnode *parse_primary(jparse *P)
{
    const jtok *t = next_tok(P);
    jnode *n;
    switch (t->k) {
    case T_NAME:
        n = node(P, N_LIT, t);
        if (tok_is(t, T_NAME, "true") || tok_is(t, T_NAME, "True")) {
            n->lit = (jv){.t = JV_BOOL, .i = 1};
        } else if (tok_is(t, T_NAME, "false") || tok_is(t, T_NAME, "False")) {
            n->lit = (jv){.t = JV_BOOL, .i = 0};
        } else if (tok_is(t, T_NAME, "none") || tok_is(t, T_NAME, "None")) {
            n->lit = NONE;
        } else {
            n->k = N_NAME;
            n->name = t->p;
            n->name_n = t->n;
        }
        return n;
    case T_STR: {
        n = node(P, N_LIT, t);
        size_t len = t->n;
        const char *p = t->p;
        if (cur(P)->k == T_STR) { /* adjacent literals concatenate */
            size_t total = len;
            for (size_t k = P->at; P->L->toks[k].k == T_STR; k++) total += P->L->toks[k].n;
            char *d = lalloc(P->L, total + 1);
            memcpy(d, p, len);
            while (cur(P)->k == T_STR) {
                memcpy(d + len, cur(P)->p, cur(P)->n);
                len += cur(P)->n;
                P->at++;
            }
            d[len] = 0;
            p = d;
        }
        n->lit = (jv){.t = JV_STR, .s = {p, len}};
        return n;
    }
    case T_INT:
        n = node(P, N_LIT, t);
        n->lit = (jv){.t = JV_INT, .i = t->i};
        return n;
    case T_FLOAT:
        n = node(P, N_LIT, t);
        n->lit = (jv){.t = JV_FLOAT, .f = t->f};
        return n;
    case T_OP:
        if (tok_is(t, T_OP, "(")) {
            if (at_op(P, ")")) {
                P->at++;
                return node(P, N_TUPLE, t);
            }
            jnode *e = parse_expr(P);
            if (!at_op(P, ",")) {
                expect_op(P, ")");
                return e;
            }
            n = node(P, N_TUPLE, t);
            n->a = e;
            jnode **tail = &e->next;
            while (at_op(P, ",")) {
                P->at++;
                if (at_op(P, ")")) break;
                *tail = parse_expr(P);
                tail = &(*tail)->next;
            }
            expect_op(P, ")");
            return n;
        }
        if (tok_is(t, T_OP, "[")) {
            n = node(P, N_LIST, t);
            jnode **tail = &n->a;
            while (!at_op(P, "]")) {
                *tail = parse_expr(P);
                tail = &(*tail)->next;
                if (!at_op(P, ",")) break;
                P->at++;
            }
            expect_op(P, "]");
            return n;
        }
        if (tok_is(t, T_OP, "{")) {
            n = node(P, N_DICT, t);
            jnode **tail = &n->a;
            while (!at_op(P, "}")) {
                jnode *pr = node(P, N_PAIR, cur(P));
                pr->a = parse_expr(P);
                expect_op(P, ":");
                pr->b = parse_expr(P);
                *tail = pr;
                tail = &pr->next;
                if (!at_op(P, ",")) break;
                P->at++;
            }
            expect_op(P, "}");
            return n;
        }
        break;
    default:
        break;
    }
    parse_fail(P, t, "unexpected %s", tok_desc(t));
}

/* '[' already consumed: an index or a slice. */
static jnode *parse_subscript(jparse *P, jnode *obj, const jtok *at)
{
    jnode *start = NULL;
    if (!at_op(P, ":")) start = parse_expr(P);
    if (!at_op(P, ":")) {
        expect_op(P, "]");
        jnode *n = node(P, N_ITEM, at);
        n->a = obj;
        n->b = start;
        return n;
    }
    jnode *n = node(P, N_SLICE, at);
    n->a = obj;
    n->b = start;
    P->at++;
    if (!at_op(P, "]") && !at_op(P, ":")) n->c = parse_expr(P);
    if (at_op(P, ":")) {
        P->at++;
        if (!at_op(P, "]")) n->d = parse_expr(P);
    }
    expect_op(P, "]");
    return n;
}

static jnode *parse_postfix(jparse *P, jnode *n, int with_filter)
{
    for (;;) {
        const jtok *t = cur(P);
        if (tok_is(t, T_OP, ".")) {
            P->at++;
            const jtok *nm = next_tok(P);
            if (nm->k == T_INT) {
                jnode *it = node(P, N_ITEM, t);
                it->a = n;
                it->b = node(P, N_LIT, nm);
                it->b->lit = (jv){.t = JV_INT, .i = nm->i};
                n = it;
                continue;
            }
            if (nm->k != T_NAME) parse_fail(P, nm, "expected an attribute name after '.'");
            jnode *a = node(P, N_ATTR, t);
            a->a = n;
            a->name = nm->p;
            a->name_n = nm->n;
            n = a;
        } else if (tok_is(t, T_OP, "[")) {
            P->at++;
            n = parse_subscript(P, n, t);
        } else if (tok_is(t, T_OP, "(")) {
            P->at++;
            jnode *c = node(P, N_CALL, t);
            c->line = n->line; /* errors of a call point at what is called */
            c->col = n->col;
            c->a = n;
            c->b = parse_args(P);
            n = c;
        } else if (with_filter && tok_is(t, T_OP, "|")) {
            P->at++;
            const jtok *nm = next_tok(P);
            if (nm->k != T_NAME) parse_fail(P, nm, "expected a filter name after '|'");
            jnode *f = node(P, N_FILTER, nm);
            f->a = n;
            f->name = nm->p;
            f->name_n = nm->n;
            if (at_op(P, "(")) {
                P->at++;
                f->b = parse_args(P);
            }
            n = f;
        } else if (with_filter && tok_is(t, T_NAME, "is")) {
            P->at++;
            jnode *f = node(P, N_TEST, t);
            if (at_name(P, "not")) {
                P->at++;
                f->op = 1;
            }
            const jtok *nm = next_tok(P);
            if (nm->k != T_NAME) parse_fail(P, nm, "expected a test name after 'is'");
            f->a = n;
            f->name = nm->p;
            f->name_n = nm->n;
            const jtok *x = cur(P);
            if (tok_is(x, T_OP, "(")) {
                P->at++;
                f->b = parse_args(P);
            } else if ((x->k == T_NAME || x->k == T_STR || x->k == T_INT || x->k == T_FLOAT ||
                        tok_is(x, T_OP, "[") || tok_is(x, T_OP, "{")) &&
                       !tok_is(x, T_NAME, "else") && !tok_is(x, T_NAME, "or") && !tok_is(x, T_NAME, "and") &&
                       !tok_is(x, T_NAME, "if") && !tok_is(x, T_NAME, "is")) {
                f->b = parse_unary(P, 0); /* "x is divisibleby 3" */
            }
            n = f;
        } else {
            return n;
        }
    }
}

static jnode *parse_unary(jparse *P, int with_filter)
{
    enter(P);
    const jtok *t = cur(P);
    jnode *n;
    if (tok_is(t, T_OP, "-") || tok_is(t, T_OP, "+")) {
        P->at++;
        n = node(P, t->p[0] == '-' ? N_NEG : N_POS, t);
        n->a = parse_unary(P, 0);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n, with_filter);
    P->L->depth--;
    return n;
}

static jnode *binop(jparse *P, const jtok *t, int op, jnode *a, jnode *b)
{
    jnode *n = node(P, N_BIN, t);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(jparse *P)
{
    jnode *n = parse_unary(P, 1);
    while (at_op(P, "**")) {
        const jtok *t = next_tok(P);
        n = binop(P, t, OP_POW, n, parse_unary(P, 1));
    }
    return n;
}

static jnode *parse_math2(jparse *P)
{
    jnode *n = parse_pow(P);
    for (;;) {
        int op = at_op(P, "*") ? OP_MUL : at_op(P, "/") ? OP_DIV : at_op(P, "//") ? OP_FLOORDIV
               : at_op(P, "%") ? OP_MOD : 0;
        if (!op) return n;
        const jtok *t = next_tok(P);
        n = binop(P, t, op, n, parse_pow(P));
    }
}

static jnode *parse_concat(jparse *P)
{
    jnode *n = parse_math2(P);
    while (at_op(P, "~")) {
        const jtok *t = next_tok(P);
        n = binop(P, t, OP_CONCAT, n, parse_math2(P));
    }
    return n;
}

static jnode *parse_math1(jparse *P)
{
    jnode *n = parse_concat(P);
    for (;;) {
        int op = at_op(P, "+") ? OP_ADD : at_op(P, "-") ? OP_SUB : 0;
        if (!op) return n;
        const jtok *t = next_tok(P);
        n = binop(P, t, op, n, parse_concat(P));
    }
}

/* Comparisons chain as in Python: a < b == c is (a < b) and (b == c), with b evaluated once. */
static jnode *parse_compare(jparse *P)
{
    jnode *n = parse_math1(P), *chain = NULL, **tail = NULL;
    for (;;) {
        const jtok *t = cur(P);
        int op = at_op(P, "==") ? OP_EQ : at_op(P, "!=") ? OP_NE : at_op(P, "<") ? OP_LT : at_op(P, "<=") ? OP_LE
               : at_op(P, ">") ? OP_GT : at_op(P, ">=") ? OP_GE : at_name(P, "in") ? OP_IN : 0;
        if (!op && at_name(P, "not") && tok_is(&P->L->toks[P->at + 1], T_NAME, "in")) {
            op = OP_NOTIN;
            P->at++;
        }
        if (!op) return chain ? chain : n;
        P->at++;
        if (!chain) {
            chain = node(P, N_COMPARE, t);
            chain->a = n;
            tail = &chain->b;
        }
        jnode *o = node(P, N_PAIR, t);
        o->op = op;
        o->a = parse_math1(P);
        *tail = o;
        tail = &o->next;
    }
}

static jnode *parse_not(jparse *P)
{
    if (at_name(P, "not")) {
        const jtok *t = next_tok(P);
        enter(P);
        jnode *n = node(P, N_NOT, t);
        n->a = parse_not(P);
        P->L->depth--;
        return n;
    }
    return parse_compare(P);
}

static jnode *parse_and(jparse *P)
{
    jnode *n = parse_not(P);
    while (at_name(P, "and")) {
        const jtok *t = next_tok(P);
        jnode *a = node(P, N_AND, t);
        a->a = n;
        a->b = parse_not(P);
        n = a;
    }
    return n;
}

static jnode *parse_or(jparse *P)
{
    jnode *n = parse_and(P);
    while (at_name(P, "or")) {
        const jtok *t = next_tok(P);
        jnode *a = node(P, N_OR, t);
        a->a = n;
        a->b = parse_and(P);
        n = a;
    }
    return n;
}

static jnode *parse_expr(jparse *P)
{
    enter(P);
    jnode *n = parse_or(P);
    while (at_name(P, "if")) {
        const jtok *t = next_tok(P);
        jnode *c = node(P, N_COND, t);
        c->a = n;
        c->b = parse_or(P);
        if (at_name(P, "else")) {
            P->at++;
            c->c = parse_expr(P);
        }
        n = c;
    }
    P->L->depth--;
    return n;
}

/* An expression, or a bare tuple "a, b" (for set). */
static jnode *parse_tuple_expr(jparse *P)
{
    jnode *e = parse_expr(P);
    if (!at_op(P, ",")) return e;
    jnode *t = node(P, N_TUPLE, cur(P));
    t->a = e;
    jnode **tail = &e->next;
    while (at_op(P, ",")) {
        P->at++;
        *tail = parse_expr(P);
        tail = &(*tail)->next;
    }
    return t;
}

/* ---- statements ---- */

static jnode *parse_body(jparse *P, const char *const *ends, const jtok *opener);

static const jtok *block_name(jparse *P)
{
    const jtok *t = cur(P);
    if (t->k != T_NAME) parse_fail(P, t, "expected a tag name after '{%%'");
    return t;
}

/* Consumes "{% NAME %}" where NAME is one of the ends the caller expects (already checked by parse_body). */
static void end_tag(jparse *P)
{
    P->at++; /* the name */
    expect_k(P, T_BLOCK_END);
}

static jnode *parse_name_target(jparse *P)
{
    const jtok *t = next_tok(P);
    if (t->k != T_NAME) parse_fail(P, t, "expected a name");
    jnode *n = node(P, N_NAME, t);
    n->name = t->p;
    n->name_n = t->n;
    return n;
}

static jnode *parse_if(jparse *P, const jtok *t)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    jnode *n = node(P, N_IF, t);
    n->a = parse_tuple_expr(P);
    expect_k(P, T_BLOCK_END);
    n->b = parse_body(P, ends, t);
    const jtok *e = cur(P);
    if (tok_is(e, T_NAME, "elif")) {
        P->at++;
        n->c = parse_if(P, e);
        return n;
    }
    if (tok_is(e, T_NAME, "else")) {
        static const char *const end[] = {"endif", NULL};
        end_tag(P);
        n->c = parse_body(P, end, e);
    }
    end_tag(P);
    return n;
}

static jnode *parse_for(jparse *P, const jtok *t)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    jnode *n = node(P, N_FOR, t);
    int paren = at_op(P, "(");
    if (paren) P->at++;
    jnode **tail = &n->a;
    for (;;) {
        *tail = parse_name_target(P);
        tail = &(*tail)->next;
        if (!at_op(P, ",")) break;
        P->at++;
    }
    if (paren) expect_op(P, ")");
    if (!at_name(P, "in")) parse_fail(P, cur(P), "expected 'in' in for");
    P->at++;
    n->b = parse_or(P);
    if (at_name(P, "if")) {
        P->at++;
        n->e = parse_or(P);
    }
    if (at_name(P, "recursive")) parse_fail(P, cur(P), "recursive loops are not supported");
    expect_k(P, T_BLOCK_END);
    n->c = parse_body(P, ends, t);
    if (at_name(P, "else")) {
        static const char *const end[] = {"endfor", NULL};
        const jtok *e = cur(P);
        end_tag(P);
        n->d = parse_body(P, end, e);
    }
    end_tag(P);
    return n;
}

static jnode *parse_set(jparse *P, const jtok *t)
{
    jnode *target = parse_name_target(P);
    if (at_op(P, ".")) {
        P->at++;
        const jtok *nm = next_tok(P);
        if (nm->k != T_NAME) parse_fail(P, nm, "expected an attribute name");
        jnode *a = node(P, N_ATTR, nm);
        a->a = target;
        a->name = nm->p;
        a->name_n = nm->n;
        target = a;
    } else if (at_op(P, ",")) {
        jnode *tu = node(P, N_TUPLE, t);
        tu->a = target;
        jnode **tail = &target->next;
        while (at_op(P, ",")) {
            P->at++;
            *tail = parse_name_target(P);
            tail = &(*tail)->next;
        }
        target = tu;
    }
    if (at_op(P, "=")) {
        P->at++;
        jnode *n = node(P, N_SET, t);
        n->a = target;
        n->b = parse_tuple_expr(P);
        expect_k(P, T_BLOCK_END);
        return n;
    }
    if (target->k != N_NAME) parse_fail(P, cur(P), "expected '=' in set");
    static const char *const ends[] = {"endset", NULL};
    jnode *n = node(P, N_SETBLOCK, t);
    n->a = target;
    expect_k(P, T_BLOCK_END);
    n->b = parse_body(P, ends, t);
    end_tag(P);
    return n;
}

static jnode *parse_macro(jparse *P, const jtok *t)
{
    static const char *const ends[] = {"endmacro", NULL};
    jnode *n = node(P, N_MACRO, t);
    const jtok *nm = next_tok(P);
    if (nm->k != T_NAME) parse_fail(P, nm, "expected a macro name");
    n->name = nm->p;
    n->name_n = nm->n;
    expect_op(P, "(");
    jnode **tail = &n->a;
    while (!at_op(P, ")")) {
        jnode *p = parse_name_target(P);
        if (at_op(P, "=")) {
            P->at++;
            p->a = parse_expr(P);
        }
        *tail = p;
        tail = &p->next;
        if (!at_op(P, ",")) break;
        P->at++;
    }
    expect_op(P, ")");
    expect_k(P, T_BLOCK_END);
    n->b = parse_body(P, ends, t);
    end_tag(P);
    return n;
}

static jnode *parse_stmt(jparse *P)
{
    const jtok *t = block_name(P);
    P->at++;
    if (tok_is(t, T_NAME, "if")) return parse_if(P, t);
    if (tok_is(t, T_NAME, "for")) return parse_for(P, t);
    if (tok_is(t, T_NAME, "set")) return parse_set(P, t);
    if (tok_is(t, T_NAME, "macro")) return parse_macro(P, t);
    if (tok_is(t, T_NAME, "break") || tok_is(t, T_NAME, "continue")) {
        expect_k(P, T_BLOCK_END);
        return node(P, t->p[0] == 'b' ? N_BREAK : N_CONTINUE, t);
    }
    if (tok_is(t, T_NAME, "filter")) {
        static const char *const ends[] = {"endfilter", NULL};
        const jtok *nm = next_tok(P);
        if (nm->k != T_NAME) parse_fail(P, nm, "expected a filter name");
        jnode *n = node(P, N_FILTERBLOCK, t);
        n->name = nm->p;
        n->name_n = nm->n;
        if (at_op(P, "(")) {
            P->at++;
            n->b = parse_args(P);
        }
        expect_k(P, T_BLOCK_END);
        n->c = parse_body(P, ends, t);
        end_tag(P);
        return n;
    }
    if (tok_is(t, T_NAME, "generation")) {
        static const char *const ends[] = {"endgeneration", NULL};
        expect_k(P, T_BLOCK_END);
        jnode *n = node(P, N_BODY, t);
        n->a = parse_body(P, ends, t);
        end_tag(P);
        return n;
    }
    parse_fail(P, t, "unknown or unsupported tag '%.*s'", (int)(t->n > 40 ? 40 : t->n), t->p);
}

/* Statements until a block tag whose name is in ends (NULL-terminated; NULL for the top level). Leaves the
 * current token at that name. */
static jnode *parse_body(jparse *P, const char *const *ends, const jtok *opener)
{
    enter(P);
    jnode *head = NULL, **tail = &head;
    for (;;) {
        const jtok *t = cur(P);
        jnode *n;
        if (t->k == T_EOF) {
            if (ends) parse_fail(P, opener, "'%.*s' is never closed (expected '%s')", (int)(opener->n > 20 ? 20 :
                                 opener->n), opener->p, ends[0] && !ends[1] ? ends[0] : ends[1] && !ends[2] ? ends[1]
                                 : ends[2]);
            break;
        }
        if (t->k == T_DATA) {
            P->at++;
            n = node(P, N_TEXT, t);
            n->name = t->p;
            n->name_n = t->n;
        } else if (t->k == T_VAR_BEGIN) {
            P->at++;
            n = node(P, N_OUT, t);
            n->a = parse_tuple_expr(P);
            expect_k(P, T_VAR_END);
        } else if (t->k == T_BLOCK_BEGIN) {
            const jtok *nm = &P->L->toks[P->at + 1];
            int is_end = 0;
            for (int i = 0; ends && ends[i]; i++) is_end |= tok_is(nm, T_NAME, ends[i]);
            if (is_end) {
                P->at++;
                break;
            }
            if (nm->k == T_NAME && (nm->n >= 3 && (!memcmp(nm->p, "end", 3) || tok_is(nm, T_NAME, "elif") ||
                                                   tok_is(nm, T_NAME, "else"))))
                parse_fail(P, nm, "unexpected '%.*s'", (int)(nm->n > 20 ? 20 : nm->n), nm->p);
            P->at++;
            n = parse_stmt(P);
        } else {
            parse_fail(P, t, "unexpected %s", tok_desc(t));
        }
        *tail = n;
        tail = &n->next;
    }
    P->L->depth--;
    return head;
}

#define JINJA_MAX_SOURCE (4u << 20)

bt_status jinja_parse(const char *src, size_t len, jinja_tmpl **out)
{
    if (len > JINJA_MAX_SOURCE)
        return bt_fail(BT_ERR_FORMAT, "template is %zu bytes; at most %u", len, JINJA_MAX_SOURCE);
    jinja_tmpl *t = calloc(1, sizeof *t);
    if (!t) return bt_fail(BT_ERR_NOMEM, "out of memory");
    t->arena.cap = (size_t)64 << 20;
    jerr err = {0};
    jlex L = {.err = &err, .arena = &t->arena};
    if (setjmp(err.jmp)) {
        arena_free(&t->arena);
        free(t);
        return bt_fail(err.st, "%s", err.msg);
    }
    /* Jinja2's lexer first turns \r\n and \r into \n and drops one trailing newline (keep_trailing_newline off). */
    char *s = lalloc(&L, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;
    L.src = s;
    L.n = n;
    lex_all(&L);
    jparse P = {.L = &L};
    t->body = parse_body(&P, NULL, NULL);
    *out = t;
    return BT_OK;
}

void jinja_free(jinja_tmpl *t)
{
    if (!t) return;
    arena_free(&t->arena);
    free(t);
}

/* ---- evaluator ---- */

typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

typedef struct jframe {
    jdict vars;
    struct jframe *parent;
} jframe;

typedef struct jctx {
    jerr err;
    jarena arena;
    jinja_limits lim;
    uint64_t steps;
    uint32_t depth;
    struct timespec deadline;
    int64_t now;
    sbuf *out;
    jframe *root;
    jframe *frame; /* where names resolve and set assigns */
    const jnode *at; /* the node being evaluated, for errors */
    int brk;      /* 1 break, 2 continue: unwinding to the innermost loop */
} jctx;

static _Noreturn void fail(jctx *C, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static _Noreturn void fail(jctx *C, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail_at(&C->err, BT_ERR_INVALID, C->at ? C->at->line : 0, C->at ? C->at->col : 0, fmt, ap);
}

static void *alloc(jctx *C, size_t n)
{
    void *p = arena_alloc(&C->arena, n);
    if (!p) {
        if (C->arena.total + n + 65536 > C->arena.cap) fail(C, "the template used more than %zu bytes of memory",
                                                           C->lim.max_mem);
        C->err.st = BT_ERR_NOMEM;
        snprintf(C->err.msg, sizeof C->err.msg, "out of memory rendering the template");
        longjmp(C->err.jmp, 1);
    }
    return p;
}

static void sb_put(jctx *C, sbuf *b, const char *s, size_t n)
{
    if (!n && b->p) return;
    if (b->n + n > C->lim.max_out) fail(C, "the output is longer than %zu bytes", C->lim.max_out);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = alloc(C, cap);
        if (b->n) memcpy(q, b->p, b->n);
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(jctx *C, sbuf *b, const char *s) { sb_put(C, b, s, strlen(s)); }

static jv mkstr(const char *p, size_t n) { return (jv){.t = JV_STR, .s = {p, n}}; }
static jv mkint(int64_t i) { return (jv){.t = JV_INT, .i = i}; }
static jv mkbool(int b) { return (jv){.t = JV_BOOL, .i = !!b}; }
static jv mkfloat(double f) { return (jv){.t = JV_FLOAT, .f = f}; }
static jv sb_val(const sbuf *b) { return mkstr(b->p ? b->p : "", b->n); }

static jv strcopy(jctx *C, const char *p, size_t n)
{
    char *d = alloc(C, n + 1);
    if (n) memcpy(d, p, n);
    d[n] = 0;
    return mkstr(d, n);
}

static jlist *list_new(jctx *C, size_t cap)
{
    jlist *l = alloc(C, sizeof *l);
    l->n = 0;
    l->gen = 0;
    l->cap = cap ? cap : 4;
    l->v = alloc(C, l->cap * sizeof *l->v);
    return l;
}

static void list_push(jctx *C, jlist *l, jv v)
{
    if (l->n == l->cap) {
        jv *nv = alloc(C, l->cap * 2 * sizeof *nv);
        memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap *= 2;
    }
    l->v[l->n++] = v;
}

static jv mklist(jlist *l) { return (jv){.t = JV_LIST, .l = l}; }

static jdict *dict_new(jctx *C)
{
    jdict *d = alloc(C, sizeof *d);
    memset(d, 0, sizeof *d);
    return d;
}

static int str_eq(jv v, const char *s, size_t n) { return v.t == JV_STR && v.s.n == n && !memcmp(v.s.p, s, n); }

static int val_eq(jv a, jv b);

static jv *dict_find(const jdict *d, jv k)
{
    for (size_t i = 0; i < d->n; i++)
        if (val_eq(d->k[i], k)) return &d->v[i];
    return NULL;
}

static jv *dict_find_s(const jdict *d, const char *s, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (str_eq(d->k[i], s, n)) return &d->v[i];
    return NULL;
}

static void dict_append(jctx *C, jdict *d, jv k, jv v);

static void dict_set(jctx *C, jdict *d, jv k, jv v)
{
    jv *slot = dict_find(d, k);
    if (slot) {
        *slot = v;
        return;
    }
    dict_append(C, d, k, v);
}

/* Adds a key known to be new (JSON objects: the caller's parser refused duplicates, so no quadratic search). */
static void dict_append(jctx *C, jdict *d, jv k, jv v)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        jv *nk = alloc(C, cap * sizeof *nk), *nv = alloc(C, cap * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk;
        d->v = nv;
        d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

static int is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double num(jv v) { return v.t == JV_FLOAT ? v.f : (double)v.i; }

static int val_eq(jv a, jv b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) return a.i == b.i;
        return num(a) == num(b);
    }
    if (a.t != b.t) return 0;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE: return 1;
    case JV_STR: return a.s.n == b.s.n && !memcmp(a.s.p, b.s.p, a.s.n);
    case JV_LIST:
        if (a.l->n != b.l->n) return 0;
        for (size_t i = 0; i < a.l->n; i++)
            if (!val_eq(a.l->v[i], b.l->v[i])) return 0;
        return 1;
    case JV_DICT:
        if (a.d->n != b.d->n) return 0;
        for (size_t i = 0; i < a.d->n; i++) {
            jv *o = dict_find(b.d, a.d->k[i]);
            if (!o || !val_eq(a.d->v[i], *o)) return 0;
        }
        return 1;
    case JV_NS: return a.d == b.d;
    case JV_LOOP: return a.loop == b.loop;
    case JV_MACRO: return a.m == b.m;
    case JV_FUNC: return a.fn == b.fn;
    default: return 0;
    }
}

static int is_gen(jv v) { return v.t == JV_LIST && v.l->gen; }

static int truthy(jv v)
{
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE: return 0;
    case JV_BOOL:
    case JV_INT: return v.i != 0;
    case JV_FLOAT: return v.f != 0;
    case JV_STR: return v.s.n != 0;
    case JV_LIST: return v.l->gen || v.l->n != 0;
    case JV_DICT: return v.d->n != 0;
    default: return 1;
    }
}

static const char *type_name(jv v)
{
    static const char *const names[] = {"undefined", "none", "bool", "int", "float", "string", "list",
                                        "dict", "namespace", "loop", "function", "macro"};
    return names[v.t];
}

/* Python's repr of a float: the shortest digits that round-trip, positional for exponents -4..15. */
static void float_repr(double f, char *buf, size_t cap)
{
    if (isnan(f)) {
        snprintf(buf, cap, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, cap, f < 0 ? "-inf" : "inf");
        return;
    }
    char e[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, f);
        if (strtod(e, NULL) == f) break;
    }
    /* e = [-]d.ddde[+-]XX */
    const char *p = e;
    int neg = *p == '-';
    if (neg) p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    size_t o = 0;
    if (neg) buf[o++] = '-';
    if (exp >= -5 && exp < 16) { /* Python's repr uses positional when -4 <= exp < 16 */
        if (exp < -4) goto sci;
        if (exp < 0) {
            buf[o++] = '0';
            buf[o++] = '.';
            for (int i = -1; i > exp; i--) buf[o++] = '0';
            for (int i = 0; i < nd; i++) buf[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp; i++) buf[o++] = i < nd ? digits[i] : '0';
            buf[o++] = '.';
            if (nd > exp + 1)
                for (int i = exp + 1; i < nd; i++) buf[o++] = digits[i];
            else
                buf[o++] = '0';
        }
        buf[o] = 0;
        return;
    }
sci:
    buf[o++] = digits[0];
    if (nd > 1) {
        buf[o++] = '.';
        for (int i = 1; i < nd; i++) buf[o++] = digits[i];
    }
    snprintf(buf + o, cap - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
}

static void write_repr(jctx *C, sbuf *b, jv v);

static void write_str(jctx *C, sbuf *b, jv v)
{
    char tmp[48];
    switch (v.t) {
    case JV_UNDEF: return;
    case JV_NONE: sb_puts(C, b, "None"); return;
    case JV_BOOL: sb_puts(C, b, v.i ? "True" : "False"); return;
    case JV_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.i); sb_puts(C, b, tmp); return;
    case JV_FLOAT: float_repr(v.f, tmp, sizeof tmp); sb_puts(C, b, tmp); return;
    case JV_STR: sb_put(C, b, v.s.p, v.s.n); return;
    default:
        if (is_gen(v)) fail(C, "a generator (the result of map, select or reject) cannot be printed; apply |list");
        write_repr(C, b, v);
    }
}

/* Python's repr, as str() of a list or dict prints its items. */
static void write_repr(jctx *C, sbuf *b, jv v)
{
    switch (v.t) {
    case JV_STR: {
        int dq = memchr(v.s.p, '\'', v.s.n) && !memchr(v.s.p, '"', v.s.n);
        char q = dq ? '"' : '\'';
        sb_put(C, b, &q, 1);
        for (size_t i = 0; i < v.s.n; i++) {
            unsigned char c = (unsigned char)v.s.p[i];
            char esc[16];
            if (c == '\\' || c == (unsigned char)q) {
                esc[0] = '\\';
                esc[1] = (char)c;
                sb_put(C, b, esc, 2);
            } else if (c == '\n') {
                sb_puts(C, b, "\\n");
            } else if (c == '\r') {
                sb_puts(C, b, "\\r");
            } else if (c == '\t') {
                sb_puts(C, b, "\\t");
            } else if (c < 0x80) {
                if (c < 0x20 || c == 0x7F) {
                    snprintf(esc, sizeof esc, "\\x%02x", c);
                    sb_puts(C, b, esc);
                } else {
                    sb_put(C, b, (const char *)&v.s.p[i], 1);
                }
            } else {
                /* Python's repr escapes what str.isprintable() rejects: controls, format, separators, unassigned */
                uint32_t cp;
                int ok;
                size_t l = uni_utf8_decode((const uint8_t *)v.s.p + i, v.s.n - i, &cp, &ok);
                if (!l) l = 1;
                uni_cat cat = ok ? uni_category(cp) : UNI_CN;
                if (!ok || cat == UNI_CN || cat == UNI_CC || cat == UNI_CF || cat == UNI_CS || cat == UNI_CO ||
                    cat == UNI_ZS || cat == UNI_ZL || cat == UNI_ZP) {
                    if (!ok) cp = 0xDC00 + (uint8_t)v.s.p[i]; /* surrogateescape, as the bytes were decoded */
                    snprintf(esc, sizeof esc, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x",
                             (unsigned)cp);
                    if (!ok) l = 1;
                    sb_puts(C, b, esc);
                } else {
                    sb_put(C, b, v.s.p + i, l);
                }
                i += l - 1;
            }
        }
        sb_put(C, b, &q, 1);
        return;
    }
    case JV_LIST:
        sb_puts(C, b, "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) sb_puts(C, b, ", ");
            write_repr(C, b, v.l->v[i]);
        }
        sb_puts(C, b, "]");
        return;
    case JV_DICT:
        sb_puts(C, b, "{");
        for (size_t i = 0; i < v.d->n; i++) {
            if (i) sb_puts(C, b, ", ");
            write_repr(C, b, v.d->k[i]);
            sb_puts(C, b, ": ");
            write_repr(C, b, v.d->v[i]);
        }
        sb_puts(C, b, "}");
        return;
    case JV_NS: sb_puts(C, b, "<Namespace>"); return;
    case JV_LOOP: sb_puts(C, b, "<LoopContext>"); return;
    case JV_FUNC:
    case JV_MACRO: sb_puts(C, b, "<function>"); return;
    case JV_UNDEF: return;
    default: write_str(C, b, v);
    }
}

static jv to_str(jctx *C, jv v)
{
    if (v.t == JV_STR) return v;
    if (v.t == JV_UNDEF) return mkstr("", 0);
    sbuf b = {0};
    write_str(C, &b, v);
    return sb_val(&b);
}

/* json.dumps(v, ensure_ascii=False, indent=indent, separators=(item_sep, key_sep)); indent < 0: none. */
static void write_json(jctx *C, sbuf *b, jv v, int indent, int level, const char *item_sep, const char *key_sep,
                       int ascii)
{
    if (++C->depth > C->lim.max_depth) fail(C, "tojson: nested too deeply");
    char tmp[48];
    switch (v.t) {
    case JV_NONE: sb_puts(C, b, "null"); break;
    case JV_BOOL: sb_puts(C, b, v.i ? "true" : "false"); break;
    case JV_INT: write_str(C, b, v); break;
    case JV_FLOAT:
        if (isnan(v.f)) sb_puts(C, b, "NaN");
        else if (isinf(v.f)) sb_puts(C, b, v.f < 0 ? "-Infinity" : "Infinity");
        else {
            float_repr(v.f, tmp, sizeof tmp);
            sb_puts(C, b, tmp);
        }
        break;
    case JV_STR:
        sb_puts(C, b, "\"");
        for (size_t i = 0; i < v.s.n; i++) {
            unsigned char c = (unsigned char)v.s.p[i];
            const char *e = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                          : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
            if (e) {
                sb_puts(C, b, e);
            } else if (c < 0x20) {
                snprintf(tmp, sizeof tmp, "\\u%04x", c);
                sb_puts(C, b, tmp);
            } else if (ascii && c >= 0x80) { /* ensure_ascii: \uXXXX, with a surrogate pair above the BMP */
                uint32_t cp;
                int ok;
                size_t l = uni_utf8_decode((const uint8_t *)v.s.p + i, v.s.n - i, &cp, &ok);
                if (!ok || !l) cp = 0xDC00 + c, l = 1; /* a stray byte, as Python's surrogateescape */
                if (cp >= 0x10000)
                    snprintf(tmp, sizeof tmp, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                             0xDC00 + ((cp - 0x10000) & 0x3FF));
                else
                    snprintf(tmp, sizeof tmp, "\\u%04x", cp);
                sb_puts(C, b, tmp);
                i += l - 1;
            } else {
                sb_put(C, b, &v.s.p[i], 1);
            }
        }
        sb_puts(C, b, "\"");
        break;
    case JV_LIST:
    case JV_DICT: {
        int is_list = v.t == JV_LIST;
        if (is_gen(v)) fail(C, "tojson: object of type generator is not JSON serializable");
        size_t n = is_list ? v.l->n : v.d->n;
        sb_puts(C, b, is_list ? "[" : "{");
        if (!n) {
            sb_puts(C, b, is_list ? "]" : "}");
            break;
        }
        for (size_t i = 0; i < n; i++) {
            if (i) sb_puts(C, b, item_sep);
            if (indent >= 0) {
                sb_puts(C, b, "\n");
                for (int k = 0; k < indent * (level + 1); k++) sb_puts(C, b, " ");
            }
            if (is_list) {
                write_json(C, b, v.l->v[i], indent, level + 1, item_sep, key_sep, ascii);
                continue;
            }
            jv k = v.d->k[i];
            if (k.t == JV_STR) {
                write_json(C, b, k, indent, level + 1, item_sep, key_sep, ascii);
            } else if (k.t == JV_INT || k.t == JV_FLOAT || k.t == JV_BOOL || k.t == JV_NONE) {
                sbuf kb = {0};
                if (k.t == JV_NONE) sb_puts(C, &kb, "null");
                else if (k.t == JV_BOOL) sb_puts(C, &kb, k.i ? "true" : "false");
                else write_str(C, &kb, k);
                write_json(C, b, sb_val(&kb), indent, level + 1, item_sep, key_sep, ascii);
            } else {
                fail(C, "tojson: keys must be str, int, float, bool or None, not %s", type_name(k));
            }
            sb_puts(C, b, key_sep);
            write_json(C, b, v.d->v[i], indent, level + 1, item_sep, key_sep, ascii);
        }
        if (indent >= 0) {
            sb_puts(C, b, "\n");
            for (int k = 0; k < indent * level; k++) sb_puts(C, b, " ");
        }
        sb_puts(C, b, is_list ? "]" : "}");
        break;
    }
    default: fail(C, "tojson: object of type %s is not JSON serializable", type_name(v));
    }
    C->depth--;
}

/* ---- strings as Python sees them: code points ---- */

static int py_space(uint32_t cp) { return uni_is_space(cp) || (cp >= 0x1C && cp <= 0x1F); }

/* Decodes one character at s[i..n); an invalid byte counts as one character. */
static size_t cp_at(const char *s, size_t n, size_t i, uint32_t *cp)
{
    int ok;
    size_t l = uni_utf8_decode((const uint8_t *)s + i, n - i, cp, &ok);
    return l ? l : 1;
}

static size_t cp_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        uint32_t cp;
        i += cp_at(s, n, i, &cp);
    }
    return k;
}

/* Byte offsets of each character start, plus the end: [count + 1]. */
static size_t *cp_offsets(jctx *C, jv s, size_t *count)
{
    size_t k = cp_count(s.s.p, s.s.n);
    size_t *off = alloc(C, (k + 1) * sizeof *off);
    size_t i = 0, j = 0;
    for (; i < s.s.n; j++) {
        uint32_t cp;
        off[j] = i;
        i += cp_at(s.s.p, s.s.n, i, &cp);
    }
    off[j] = s.s.n;
    *count = k;
    return off;
}

static int in_chars(uint32_t cp, jv chars)
{
    if (chars.t != JV_STR) return py_space(cp);
    for (size_t i = 0; i < chars.s.n;) {
        uint32_t c;
        i += cp_at(chars.s.p, chars.s.n, i, &c);
        if (c == cp) return 1;
    }
    return 0;
}

/* str.strip/lstrip/rstrip(chars); chars not a string: whitespace. */
static jv str_strip(jv s, jv chars, int left, int right)
{
    size_t a = 0, e = s.s.n;
    while (left && a < e) {
        uint32_t cp;
        size_t l = cp_at(s.s.p, e, a, &cp);
        if (!in_chars(cp, chars)) break;
        a += l;
    }
    while (right && e > a) {
        size_t k = e - 1;
        while (k > a && ((uint8_t)s.s.p[k] & 0xC0) == 0x80 && e - k < 4) k--;
        uint32_t cp;
        size_t l = cp_at(s.s.p, e, k, &cp);
        if (k + l != e) k = e - 1, cp = (uint8_t)s.s.p[k] | 0x80000000u; /* a stray continuation byte */
        if (!in_chars(cp, chars)) break;
        e = k;
    }
    return mkstr(s.s.p + a, e - a);
}

static const char *memmem_(const char *h, size_t hn, const char *n, size_t nn)
{
    if (!nn) return h;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == n[0] && !memcmp(h + i, n, nn)) return h + i;
    return NULL;
}

static jv str_replace(jctx *C, jv s, jv old, jv new_, int64_t count)
{
    if (old.t != JV_STR || new_.t != JV_STR) fail(C, "replace() takes strings");
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    size_t i = 0;
    int64_t done = 0;
    if (!old.s.n) { /* Python inserts new before every character and at the end */
        for (; i < s.s.n && (count < 0 || done < count); done++) {
            uint32_t cp;
            size_t l = cp_at(s.s.p, s.s.n, i, &cp);
            sb_put(C, &b, new_.s.p, new_.s.n);
            sb_put(C, &b, s.s.p + i, l);
            i += l;
        }
        if (count < 0 || done < count) sb_put(C, &b, new_.s.p, new_.s.n);
        sb_put(C, &b, s.s.p + i, s.s.n - i);
        return sb_val(&b);
    }
    while (count < 0 || done < count) {
        const char *f = memmem_(s.s.p + i, s.s.n - i, old.s.p, old.s.n);
        if (!f) break;
        size_t at = (size_t)(f - s.s.p);
        sb_put(C, &b, s.s.p + i, at - i);
        sb_put(C, &b, new_.s.p, new_.s.n);
        i = at + old.s.n;
        done++;
    }
    sb_put(C, &b, s.s.p + i, s.s.n - i);
    return sb_val(&b);
}

static jv str_split(jctx *C, jv s, jv sep, int64_t maxsplit)
{
    jlist *l = list_new(C, 4);
    if (sep.t == JV_STR) {
        if (!sep.s.n) fail(C, "split(): empty separator");
        size_t i = 0;
        for (int64_t k = 0; maxsplit < 0 || k < maxsplit; k++) {
            const char *f = memmem_(s.s.p + i, s.s.n - i, sep.s.p, sep.s.n);
            if (!f) break;
            list_push(C, l, mkstr(s.s.p + i, (size_t)(f - s.s.p) - i));
            i = (size_t)(f - s.s.p) + sep.s.n;
        }
        list_push(C, l, mkstr(s.s.p + i, s.s.n - i));
        return mklist(l);
    }
    /* runs of whitespace; no empty strings */
    size_t i = 0;
    int64_t k = 0;
    for (;;) {
        while (i < s.s.n) {
            uint32_t cp;
            size_t n = cp_at(s.s.p, s.s.n, i, &cp);
            if (!py_space(cp)) break;
            i += n;
        }
        if (i >= s.s.n) break;
        if (maxsplit >= 0 && k == maxsplit) {
            jv rest = str_strip(mkstr(s.s.p + i, s.s.n - i), UNDEF, 0, 1);
            list_push(C, l, rest);
            break;
        }
        size_t st = i;
        while (i < s.s.n) {
            uint32_t cp;
            size_t n = cp_at(s.s.p, s.s.n, i, &cp);
            if (py_space(cp)) break;
            i += n;
        }
        list_push(C, l, mkstr(s.s.p + st, i - st));
        k++;
    }
    return mklist(l);
}

/* ASCII case mapping: mode 0 upper, 1 lower, 2 capitalize, 3 title. */
static jv str_case(jctx *C, jv s, int mode)
{
    jv r = strcopy(C, s.s.p, s.s.n);
    char *d = (char *)r.s.p;
    int prev_letter = 0;
    for (size_t i = 0; i < r.s.n; i++) {
        char c = d[i];
        int up = mode == 0 || (mode == 2 && i == 0) || (mode == 3 && !prev_letter);
        if (up && c >= 'a' && c <= 'z') d[i] = (char)(c - 32);
        else if (!up && c >= 'A' && c <= 'Z') d[i] = (char)(c + 32);
        prev_letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || ((unsigned char)c >= 0x80);
    }
    return r;
}

static int starts_with(jv s, jv p, int end)
{
    if (p.t != JV_STR || p.s.n > s.s.n) return 0;
    return !memcmp(s.s.p + (end ? s.s.n - p.s.n : 0), p.s.p, p.s.n);
}

/* ---- evaluation ---- */

static void step(jctx *C, const jnode *n)
{
    C->at = n;
    if (++C->steps > C->lim.max_steps) fail(C, "the template ran more than %llu steps",
                                           (unsigned long long)C->lim.max_steps);
    if ((C->steps & 1023) == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (ts.tv_sec > C->deadline.tv_sec || (ts.tv_sec == C->deadline.tv_sec && ts.tv_nsec > C->deadline.tv_nsec))
            fail(C, "the template ran longer than %u ms", C->lim.max_ms);
    }
}

static void deeper(jctx *C)
{
    if (++C->depth > C->lim.max_depth) fail(C, "nested deeper than %u", C->lim.max_depth);
}

static jv eval(jctx *C, const jnode *n);
static void exec_body(jctx *C, const jnode *s);

static jv lookup(jctx *C, const char *name, size_t n)
{
    for (jframe *f = C->frame; f; f = f->parent) {
        jv *v = dict_find_s(&f->vars, name, n);
        if (v) return *v;
    }
    static const struct {
        const char *name;
        jfunc_id id;
    } globals[] = {{"raise_exception", F_RAISE}, {"strftime_now", F_STRFTIME}, {"namespace", F_NAMESPACE},
                   {"range", F_RANGE},           {"dict", F_DICT}};
    for (size_t i = 0; i < sizeof globals / sizeof *globals; i++) {
        if (strlen(globals[i].name) == n && !memcmp(globals[i].name, name, n)) {
            jfunc *fn = alloc(C, sizeof *fn);
            fn->id = globals[i].id;
            fn->self = NONE;
            return (jv){.t = JV_FUNC, .fn = fn};
        }
    }
    return (jv){.t = JV_UNDEF, .s = {name, n}};
}

static jv method(jctx *C, jv self, jfunc_id id)
{
    jfunc *fn = alloc(C, sizeof *fn);
    fn->id = id;
    fn->self = self;
    return (jv){.t = JV_FUNC, .fn = fn};
}

static jv undefined_named(const char *name, size_t n) { return (jv){.t = JV_UNDEF, .s = {name, n}}; }

static _Noreturn void fail_undef(jctx *C, jv u, const char *what)
{
    if (u.s.p) fail(C, "'%.*s' is undefined (%s)", (int)(u.s.n > 60 ? 60 : u.s.n), u.s.p, what);
    fail(C, "a value is undefined (%s)", what);
}

static jv get_attr(jctx *C, jv obj, const char *name, size_t n)
{
#define IS(s) (n == sizeof(s) - 1 && !memcmp(name, s, n))
    switch (obj.t) {
    case JV_UNDEF: fail_undef(C, obj, "getting an attribute");
    case JV_DICT:
        if (IS("items")) return method(C, obj, M_ITEMS);
        if (IS("keys")) return method(C, obj, M_KEYS);
        if (IS("values")) return method(C, obj, M_VALUES);
        if (IS("get")) return method(C, obj, M_GET);
        /* fallthrough */
    case JV_NS: {
        jv *v = dict_find_s(obj.d, name, n);
        return v ? *v : undefined_named(name, n);
    }
    case JV_STR: {
        static const struct {
            const char *name;
            jfunc_id id;
        } m[] = {{"strip", M_STRIP},           {"lstrip", M_LSTRIP},     {"rstrip", M_RSTRIP},
                 {"split", M_SPLIT},           {"rsplit", M_RSPLIT},     {"startswith", M_STARTSWITH},
                 {"endswith", M_ENDSWITH},     {"upper", M_UPPER},       {"lower", M_LOWER},
                 {"title", M_TITLE},           {"capitalize", M_CAPITALIZE}, {"replace", M_REPLACE},
                 {"find", M_FIND},             {"count", M_COUNT},       {"join", M_JOIN},
                 {"splitlines", M_SPLITLINES}, {"isdigit", M_ISDIGIT},   {"isspace", M_ISSPACE},
                 {"format", M_FORMAT}};
        for (size_t i = 0; i < sizeof m / sizeof *m; i++)
            if (strlen(m[i].name) == n && !memcmp(m[i].name, name, n)) return method(C, obj, m[i].id);
        return undefined_named(name, n);
    }
    case JV_LOOP: {
        jloop *L = obj.loop;
        size_t len = L->items->n;
        if (IS("index")) return mkint((int64_t)L->i + 1);
        if (IS("index0")) return mkint((int64_t)L->i);
        if (IS("revindex")) return mkint((int64_t)(len - L->i));
        if (IS("revindex0")) return mkint((int64_t)(len - L->i - 1));
        if (IS("first")) return mkbool(L->i == 0);
        if (IS("last")) return mkbool(L->i + 1 == len);
        if (IS("length")) return mkint((int64_t)len);
        if (IS("depth")) return mkint(1);
        if (IS("depth0")) return mkint(0);
        if (IS("previtem")) return L->i ? L->items->v[L->i - 1] : undefined_named(name, n);
        if (IS("nextitem")) return L->i + 1 < len ? L->items->v[L->i + 1] : undefined_named(name, n);
        return undefined_named(name, n);
    }
    default: return undefined_named(name, n);
    }
#undef IS
}

static int64_t as_index(jctx *C, jv v, const char *what)
{
    if (v.t == JV_INT || v.t == JV_BOOL) return v.i;
    fail(C, "%s must be an integer, not %s", what, type_name(v));
}

static jv get_item(jctx *C, jv obj, jv key)
{
    switch (obj.t) {
    case JV_UNDEF: fail_undef(C, obj, "indexing it");
    case JV_DICT:
    case JV_NS: {
        jv *v = dict_find(obj.d, key);
        if (v) return *v;
        if (key.t == JV_STR && obj.t == JV_DICT) return get_attr(C, obj, key.s.p, key.s.n);
        return key.t == JV_STR ? undefined_named(key.s.p, key.s.n) : UNDEF;
    }
    case JV_LIST:
    case JV_STR: {
        if (key.t == JV_STR) return get_attr(C, obj, key.s.p, key.s.n);
        if (key.t != JV_INT && key.t != JV_BOOL) return UNDEF;
        int64_t i = key.i;
        if (is_gen(obj)) fail(C, "a generator (the result of map, select or reject) cannot be indexed");
        if (obj.t == JV_LIST) {
            if (i < 0) i += (int64_t)obj.l->n;
            return i >= 0 && (size_t)i < obj.l->n ? obj.l->v[i] : UNDEF;
        }
        size_t k;
        size_t *off = cp_offsets(C, obj, &k);
        if (i < 0) i += (int64_t)k;
        if (i < 0 || (size_t)i >= k) return UNDEF;
        return mkstr(obj.s.p + off[i], off[i + 1] - off[i]);
    }
    case JV_LOOP:
        if (key.t == JV_STR) return get_attr(C, obj, key.s.p, key.s.n);
        return UNDEF;
    default: return UNDEF;
    }
}

/* Python's slice.indices(len) and the selected positions. */
static jv do_slice(jctx *C, jv obj, jv start, jv stop, jv stepv)
{
    if (obj.t == JV_UNDEF) fail_undef(C, obj, "slicing it");
    if ((obj.t != JV_LIST && obj.t != JV_STR) || is_gen(obj)) fail(C, "cannot slice a %s", type_name(obj));
    size_t *off = NULL, len;
    if (obj.t == JV_STR) off = cp_offsets(C, obj, &len);
    else len = obj.l->n;
    int64_t n = (int64_t)len;
    int64_t st = stepv.t == JV_NONE || stepv.t == JV_UNDEF ? 1 : as_index(C, stepv, "a slice step");
    if (st == 0) fail(C, "slice step cannot be zero");
    int64_t lo, hi;
    if (start.t == JV_NONE || start.t == JV_UNDEF) {
        lo = st < 0 ? n - 1 : 0;
    } else {
        lo = as_index(C, start, "a slice index");
        if (lo < 0) lo += n;
        if (lo < 0) lo = st < 0 ? -1 : 0;
        if (lo >= n) lo = st < 0 ? n - 1 : n;
    }
    if (stop.t == JV_NONE || stop.t == JV_UNDEF) {
        hi = st < 0 ? -1 : n;
    } else {
        hi = as_index(C, stop, "a slice index");
        if (hi < 0) hi += n;
        if (hi < 0) hi = st < 0 ? -1 : 0;
        if (hi >= n) hi = st < 0 ? n - 1 : n;
    }
    if (obj.t == JV_LIST) {
        jlist *l = list_new(C, 4);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) list_push(C, l, obj.l->v[i]);
        return mklist(l);
    }
    if (st == 1) return lo < hi ? mkstr(obj.s.p + off[lo], off[hi] - off[lo]) : mkstr("", 0);
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) sb_put(C, &b, obj.s.p + off[i], off[i + 1] - off[i]);
    return sb_val(&b);
}

/* Items that a for loop or a filter walks: list items, dict keys, string characters. */
static jlist *iter_items(jctx *C, jv v)
{
    switch (v.t) {
    case JV_UNDEF: return list_new(C, 1);
    case JV_LIST: return v.l;
    case JV_DICT:
    case JV_NS: {
        jlist *l = list_new(C, v.d->n);
        for (size_t i = 0; i < v.d->n; i++) list_push(C, l, v.d->k[i]);
        return l;
    }
    case JV_STR: {
        jlist *l = list_new(C, v.s.n);
        for (size_t i = 0; i < v.s.n;) {
            uint32_t cp;
            size_t k = cp_at(v.s.p, v.s.n, i, &cp);
            list_push(C, l, mkstr(v.s.p + i, k));
            i += k;
        }
        return l;
    }
    default: fail(C, "a %s is not iterable", type_name(v));
    }
}

/* ---- calls: arguments ---- */

typedef struct jargs {
    jv pos[8];
    size_t npos;
    const char *kw[8];
    size_t kwn[8];
    jv kwv[8];
    size_t nkw;
} jargs;

static void eval_args(jctx *C, const jnode *a, jargs *out)
{
    out->npos = out->nkw = 0;
    for (; a; a = a->next) {
        if (a->k == N_KWARG) {
            if (out->nkw == 8) fail(C, "too many keyword arguments");
            out->kw[out->nkw] = a->name;
            out->kwn[out->nkw] = a->name_n;
            out->kwv[out->nkw++] = eval(C, a->a);
        } else {
            if (out->npos == 8) fail(C, "too many arguments");
            out->pos[out->npos++] = eval(C, a);
        }
    }
}

/* Argument i, or keyword name, or dflt. */
static jv arg(const jargs *a, size_t i, const char *name, jv dflt)
{
    if (i < a->npos) return a->pos[i];
    for (size_t k = 0; name && k < a->nkw; k++)
        if (strlen(name) == a->kwn[k] && !memcmp(name, a->kw[k], a->kwn[k])) return a->kwv[k];
    return dflt;
}

static jv need_str(jctx *C, jv v, const char *what)
{
    if (v.t != JV_STR) fail(C, "%s must be a string, not %s", what, type_name(v));
    return v;
}

static jv call_macro(jctx *C, const jnode *m, const jargs *a)
{
    jframe f = {.parent = C->root}, *saved_frame = C->frame;
    size_t i = 0;
    for (const jnode *p = m->a; p; p = p->next, i++) {
        jv v = i < a->npos ? a->pos[i] : UNDEF;
        for (size_t k = 0; k < a->nkw; k++)
            if (a->kwn[k] == p->name_n && !memcmp(a->kw[k], p->name, p->name_n)) v = a->kwv[k];
        if (v.t == JV_UNDEF && p->a) v = eval(C, p->a);
        dict_set(C, &f.vars, mkstr(p->name, p->name_n), v);
    }
    if (a->npos > i) fail(C, "macro '%.*s' takes %zu arguments, got %zu", (int)m->name_n, m->name, i, a->npos);
    sbuf b = {0}, *saved = C->out;
    sb_put(C, &b, "", 0);
    C->out = &b;
    deeper(C);
    C->frame = &f;
    exec_body(C, m->b);
    C->depth--;
    C->out = saved;
    C->frame = saved_frame;
    C->brk = 0;
    return sb_val(&b);
}

/* str.format with {}, {0} and {name} fields and {{ }} escapes; format specs and conversions are not supported. */
static jv str_format_braces(jctx *C, jv f, const jargs *a)
{
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    size_t auto_i = 0;
    int numbering = 0; /* 1 automatic ({}), 2 manual ({0}): Python refuses to mix them */
    for (size_t i = 0; i < f.s.n; i++) {
        char c = f.s.p[i];
        if ((c == '{' || c == '}') && i + 1 < f.s.n && f.s.p[i + 1] == c) {
            sb_put(C, &b, &c, 1);
            i++;
            continue;
        }
        if (c == '}') fail(C, "format: single '}' encountered");
        if (c != '{') {
            sb_put(C, &b, &c, 1);
            continue;
        }
        size_t e = i + 1;
        while (e < f.s.n && f.s.p[e] != '}') e++;
        if (e >= f.s.n) fail(C, "format: single '{' encountered");
        const char *name = f.s.p + i + 1;
        size_t n = e - i - 1;
        for (size_t k = 0; k < n; k++)
            if (name[k] == ':' || name[k] == '!' || name[k] == '.' || name[k] == '[')
                fail(C, "format: only {}, {N} and {name} fields are supported");
        jv v = UNDEF;
        if (n == 0 || is_digit(name[0])) {
            int mode = n == 0 ? 1 : 2;
            if (numbering && numbering != mode) fail(C, "format: cannot mix automatic and manual field numbering");
            numbering = mode;
            size_t idx = n == 0 ? auto_i++ : (size_t)atoll(name);
            if (idx >= a->npos) fail(C, "format: index %zu out of range", idx);
            v = a->pos[idx];
        } else {
            for (size_t k = 0; k < a->nkw; k++)
                if (a->kwn[k] == n && !memcmp(a->kw[k], name, n)) v = a->kwv[k];
            if (v.t == JV_UNDEF) fail(C, "format: no argument '%.*s'", (int)(n > 40 ? 40 : n), name);
        }
        write_str(C, &b, v);
        i = e;
    }
    return sb_val(&b);
}

static jv call_str_method(jctx *C, jv s, jfunc_id id, const jargs *a)
{
    switch (id) {
    case M_STRIP:
    case M_LSTRIP:
    case M_RSTRIP: {
        jv chars = arg(a, 0, "chars", NONE);
        return str_strip(s, chars, id != M_RSTRIP, id != M_LSTRIP);
    }
    case M_SPLIT:
    case M_RSPLIT: {
        jv sep = arg(a, 0, "sep", NONE);
        jv mx = arg(a, 1, "maxsplit", mkint(-1));
        if (id == M_RSPLIT && as_index(C, mx, "maxsplit") >= 0) fail(C, "rsplit() with maxsplit is not supported");
        return str_split(C, s, sep.t == JV_STR ? sep : NONE, as_index(C, mx, "maxsplit"));
    }
    case M_STARTSWITH:
    case M_ENDSWITH: {
        jv p = arg(a, 0, "prefix", UNDEF);
        if (p.t == JV_LIST) {
            for (size_t i = 0; i < p.l->n; i++)
                if (starts_with(s, need_str(C, p.l->v[i], "a prefix"), id == M_ENDSWITH)) return mkbool(1);
            return mkbool(0);
        }
        return mkbool(starts_with(s, need_str(C, p, "the prefix"), id == M_ENDSWITH));
    }
    case M_UPPER: return str_case(C, s, 0);
    case M_LOWER: return str_case(C, s, 1);
    case M_CAPITALIZE: return str_case(C, s, 2);
    case M_TITLE: return str_case(C, s, 3);
    case M_REPLACE: {
        jv cnt = arg(a, 2, "count", mkint(-1));
        return str_replace(C, s, arg(a, 0, "old", UNDEF), arg(a, 1, "new", UNDEF), as_index(C, cnt, "count"));
    }
    case M_FIND:
    case M_COUNT: {
        jv sub = need_str(C, arg(a, 0, "sub", UNDEF), "the substring");
        if (id == M_FIND) {
            const char *f = memmem_(s.s.p, s.s.n, sub.s.p, sub.s.n);
            return mkint(f ? (int64_t)cp_count(s.s.p, (size_t)(f - s.s.p)) : -1);
        }
        if (!sub.s.n) return mkint((int64_t)cp_count(s.s.p, s.s.n) + 1);
        int64_t k = 0;
        for (size_t i = 0; i < s.s.n;) {
            const char *f = memmem_(s.s.p + i, s.s.n - i, sub.s.p, sub.s.n);
            if (!f) break;
            k++;
            i = (size_t)(f - s.s.p) + sub.s.n;
        }
        return mkint(k);
    }
    case M_JOIN: {
        jlist *l = iter_items(C, arg(a, 0, "iterable", UNDEF));
        sbuf b = {0};
        sb_put(C, &b, "", 0);
        for (size_t i = 0; i < l->n; i++) {
            if (i) sb_put(C, &b, s.s.p, s.s.n);
            sb_put(C, &b, need_str(C, l->v[i], "a joined item").s.p, l->v[i].s.n);
        }
        return sb_val(&b);
    }
    case M_SPLITLINES: {
        jlist *l = list_new(C, 4);
        size_t st = 0, i = 0;
        while (i < s.s.n) {
            char c = s.s.p[i];
            if (c == '\n' || c == '\r') {
                list_push(C, l, mkstr(s.s.p + st, i - st));
                i += c == '\r' && i + 1 < s.s.n && s.s.p[i + 1] == '\n' ? 2 : 1;
                st = i;
            } else {
                i++;
            }
        }
        if (st < s.s.n) list_push(C, l, mkstr(s.s.p + st, s.s.n - st));
        return mklist(l);
    }
    case M_FORMAT: return str_format_braces(C, s, a);
    case M_ISDIGIT:
    case M_ISSPACE: {
        if (!s.s.n) return mkbool(0);
        for (size_t i = 0; i < s.s.n;) {
            uint32_t cp;
            i += cp_at(s.s.p, s.s.n, i, &cp);
            if (id == M_ISDIGIT ? !(cp >= '0' && cp <= '9') : !py_space(cp)) return mkbool(0);
        }
        return mkbool(1);
    }
    default: fail(C, "bad string method");
    }
}

static jv call_func(jctx *C, jfunc *fn, const jargs *a)
{
    switch (fn->id) {
    case F_RAISE: {
        jv m = to_str(C, arg(a, 0, "message", UNDEF));
        fail(C, "raise_exception: %.*s", (int)(m.s.n > 300 ? 300 : m.s.n), m.s.p);
    }
    case F_STRFTIME: {
        jv f = need_str(C, arg(a, 0, "format", UNDEF), "strftime_now's format");
        if (f.s.n > 200) fail(C, "strftime_now: format too long");
        char fmt[256], buf[512];
        memcpy(fmt, f.s.p, f.s.n);
        fmt[f.s.n] = 0;
        time_t t = (time_t)C->now;
        struct tm tm;
        localtime_r(&t, &tm);
        /* The format is the template's: strftime only copies unknown conversions and stops at the buffer's end. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        size_t n = strftime(buf, sizeof buf, fmt, &tm);
#pragma GCC diagnostic pop
        return strcopy(C, buf, n);
    }
    case F_NAMESPACE:
    case F_DICT: {
        jdict *d = dict_new(C);
        if (a->npos > 1) fail(C, "%s() takes at most one positional argument", fn->id == F_DICT ? "dict" : "namespace");
        if (a->npos == 1) {
            jv src = a->pos[0];
            if (src.t != JV_DICT) fail(C, "%s() takes a dict", fn->id == F_DICT ? "dict" : "namespace");
            for (size_t i = 0; i < src.d->n; i++) dict_set(C, d, src.d->k[i], src.d->v[i]);
        }
        for (size_t i = 0; i < a->nkw; i++) dict_set(C, d, mkstr(a->kw[i], a->kwn[i]), a->kwv[i]);
        return (jv){.t = fn->id == F_DICT ? JV_DICT : JV_NS, .d = d};
    }
    case F_RANGE: {
        int64_t lo = 0, hi, st = 1;
        if (a->npos == 1) {
            hi = as_index(C, a->pos[0], "range()'s argument");
        } else if (a->npos == 2 || a->npos == 3) {
            lo = as_index(C, a->pos[0], "range()'s argument");
            hi = as_index(C, a->pos[1], "range()'s argument");
            if (a->npos == 3) st = as_index(C, a->pos[2], "range()'s argument");
        } else {
            fail(C, "range() takes 1 to 3 arguments");
        }
        if (st == 0) fail(C, "range() step must not be zero");
        jlist *l = list_new(C, 4);
        for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
            if (l->n >= 100000) fail(C, "range() is limited to 100000 items");
            list_push(C, l, mkint(i));
        }
        return mklist(l);
    }
    case M_ITEMS:
    case M_KEYS:
    case M_VALUES: {
        jdict *d = fn->self.d;
        jlist *l = list_new(C, d->n);
        for (size_t i = 0; i < d->n; i++) {
            if (fn->id == M_ITEMS) {
                jlist *p = list_new(C, 2);
                list_push(C, p, d->k[i]);
                list_push(C, p, d->v[i]);
                list_push(C, l, mklist(p));
            } else {
                list_push(C, l, fn->id == M_KEYS ? d->k[i] : d->v[i]);
            }
        }
        return mklist(l);
    }
    case M_GET: {
        jv *v = dict_find(fn->self.d, arg(a, 0, "key", UNDEF));
        return v ? *v : arg(a, 1, "default", NONE);
    }
    default: return call_str_method(C, fn->self, fn->id, a);
    }
}

/* ---- tests and filters ---- */

static int run_test(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
#define IS(s) (n == sizeof(s) - 1 && !memcmp(name, s, n))
    if (IS("defined")) return v.t != JV_UNDEF;
    if (IS("undefined")) return v.t == JV_UNDEF;
    if (IS("none")) return v.t == JV_NONE;
    if (IS("string")) return v.t == JV_STR;
    if (IS("mapping")) return v.t == JV_DICT;
    if (IS("iterable")) return v.t == JV_UNDEF || v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_NS;
    if (IS("sequence")) return v.t == JV_UNDEF || v.t == JV_STR || (v.t == JV_LIST && !v.l->gen) || v.t == JV_DICT;
    if (IS("number")) return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
    if (IS("integer")) return v.t == JV_INT;
    if (IS("float")) return v.t == JV_FLOAT;
    if (IS("boolean")) return v.t == JV_BOOL;
    if (IS("true")) return v.t == JV_BOOL && v.i;
    if (IS("false")) return v.t == JV_BOOL && !v.i;
    if (IS("callable")) return v.t == JV_FUNC || v.t == JV_MACRO;
    if (IS("eq") || IS("equalto") || IS("==")) return val_eq(v, arg(a, 0, NULL, UNDEF));
    if (IS("ne") || IS("!=")) return !val_eq(v, arg(a, 0, NULL, UNDEF));
    if (IS("sameas")) {
        jv o = arg(a, 0, NULL, UNDEF);
        return v.t == o.t && val_eq(v, o);
    }
    if (IS("odd") || IS("even") || IS("divisibleby")) {
        int64_t x = as_index(C, v, "the tested value");
        int64_t d = IS("divisibleby") ? as_index(C, arg(a, 0, NULL, UNDEF), "divisibleby's argument") : 2;
        if (d == 0) fail(C, "divisibleby 0");
        int r = x % d == 0;
        return IS("odd") ? !r : r;
    }
    if (IS("lower") || IS("upper")) {
        if (v.t != JV_STR) return 0;
        for (size_t i = 0; i < v.s.n; i++)
            if (IS("lower") ? (v.s.p[i] >= 'A' && v.s.p[i] <= 'Z') : (v.s.p[i] >= 'a' && v.s.p[i] <= 'z')) return 0;
        return 1;
    }
    if (IS("in")) {
        jv c = arg(a, 0, NULL, UNDEF);
        if (c.t == JV_STR) return v.t == JV_STR && memmem_(c.s.p, c.s.n, v.s.p, v.s.n) != NULL;
        jlist *l = iter_items(C, c);
        for (size_t i = 0; i < l->n; i++)
            if (val_eq(l->v[i], v)) return 1;
        return 0;
    }
    fail(C, "unknown test '%.*s'", (int)(n > 40 ? 40 : n), name);
#undef IS
}

static int val_lt(jctx *C, jv a, jv b);

/* The value a filter or test sees for attribute "a.b.c" of item v (Jinja's attribute= arguments). */
static jv attr_path(jctx *C, jv v, jv path)
{
    if (path.t == JV_INT) return get_item(C, v, path);
    need_str(C, path, "the attribute");
    size_t st = 0;
    for (size_t i = 0; i <= path.s.n; i++) {
        if (i < path.s.n && path.s.p[i] != '.') continue;
        const char *p = path.s.p + st;
        size_t n = i - st;
        int digits = n > 0;
        for (size_t k = 0; k < n; k++) digits &= is_digit(p[k]);
        if (v.t == JV_UNDEF) return v;
        v = digits ? get_item(C, v, mkint(atoll(p))) : get_item(C, v, mkstr(p, n));
        st = i + 1;
    }
    return v;
}

static jv apply_filter(jctx *C, const char *name, size_t n, jv v, const jargs *a);

/* markupsafe.escape: & < > " ' as entities. */
static jv escape_html(jctx *C, jv s)
{
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    for (size_t i = 0; i < s.s.n; i++) {
        char c = s.s.p[i];
        const char *e = c == '&' ? "&amp;" : c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '"' ? "&#34;"
                      : c == '\'' ? "&#39;" : NULL;
        if (e) sb_puts(C, &b, e);
        else sb_put(C, &b, &c, 1);
    }
    return sb_val(&b);
}

/* select/reject/selectattr/rejectattr: keep items whose (attribute's) test result is want. */
static jv select_items(jctx *C, jv v, const jargs *a, int by_attr, int want)
{
    jlist *src = truthy(v) ? iter_items(C, v) : list_new(C, 1), *out = list_new(C, src->n); /* Jinja: "if seq:" */
    out->gen = 1;
    size_t first = by_attr ? 1 : 0;
    jv tname = arg(a, first, NULL, UNDEF);
    jargs ta = {0};
    for (size_t i = first + 1; i < a->npos && ta.npos < 8; i++) ta.pos[ta.npos++] = a->pos[i];
    for (size_t i = 0; i < src->n; i++) {
        jv x = by_attr ? attr_path(C, src->v[i], arg(a, 0, "attribute", UNDEF)) : src->v[i];
        int r = tname.t == JV_UNDEF ? truthy(x)
                                    : run_test(C, need_str(C, tname, "the test name").s.p, tname.s.n, x, &ta);
        if (r == want) list_push(C, out, src->v[i]);
    }
    return mklist(out);
}

/* Filters, one function each; a function that serves several names (length/count, min/max/sort, ...) gets the
 * name it was called by (name, n bytes). */
#define IS(s) (n == sizeof(s) - 1 && !memcmp(name, s, n))

static jv filter_safe(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    v = to_str(C, v);
    v.safe = 1;
    return v;
}

static jv filter_escape(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_STR && v.safe && !IS("forceescape")) return v;
    v = escape_html(C, to_str(C, v));
    v.safe = 1;
    return v;
}

static jv filter_trim(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return str_strip(to_str(C, v), arg(a, 0, "chars", NONE), 1, 1);
}

static jv filter_string(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return to_str(C, v);
}

static jv filter_upper(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return str_case(C, to_str(C, v), 0);
}

static jv filter_lower(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return str_case(C, to_str(C, v), 1);
}

static jv filter_capitalize(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return str_case(C, to_str(C, v), 2);
}

static jv filter_title(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return str_case(C, to_str(C, v), 3);
}

static jv filter_length(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    switch (v.t) {
    case JV_UNDEF: return mkint(0);
    case JV_STR: return mkint((int64_t)cp_count(v.s.p, v.s.n));
    case JV_LIST:
        if (v.l->gen) fail(C, "a generator (the result of map, select or reject) has no length; apply |list");
        return mkint((int64_t)v.l->n);
    case JV_DICT:
    case JV_NS: return mkint((int64_t)v.d->n);
    default: fail(C, "a %s has no length", type_name(v));
    }
}

static jv filter_tojson(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    /* HF's signature: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) */
    jv ind = arg(a, 1, "indent", NONE), seps = arg(a, 2, "separators", NONE);
    int ascii = truthy(arg(a, 0, "ensure_ascii", mkbool(0)));
    if (truthy(arg(a, 3, "sort_keys", NONE))) fail(C, "tojson(sort_keys=true) is not supported");
    int indent = -1;
    if (ind.t != JV_NONE) {
        int64_t k = as_index(C, ind, "tojson's indent");
        if (k < 0 || k > 64) fail(C, "tojson's indent must be 0..64");
        indent = (int)k;
    }
    const char *item_sep = indent >= 0 ? "," : ", ", *key_sep = ": ";
    char *is_buf = NULL, *ks_buf = NULL;
    if (seps.t == JV_LIST && seps.l->n == 2) {
        jv s0 = need_str(C, seps.l->v[0], "a separator"), s1 = need_str(C, seps.l->v[1], "a separator");
        is_buf = (char *)strcopy(C, s0.s.p, s0.s.n).s.p;
        ks_buf = (char *)strcopy(C, s1.s.p, s1.s.n).s.p;
        item_sep = is_buf;
        key_sep = ks_buf;
    } else if (seps.t != JV_NONE) {
        fail(C, "tojson's separators must be a pair of strings");
    }
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    uint32_t d = C->depth;
    write_json(C, &b, v, indent, 0, item_sep, key_sep, ascii);
    C->depth = d;
    return sb_val(&b);
}

static jv filter_replace(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    jv s = to_str(C, v);
    jv cnt = arg(a, 2, "count", NONE);
    return str_replace(C, s, arg(a, 0, "old", UNDEF), arg(a, 1, "new", UNDEF),
                       cnt.t == JV_NONE ? -1 : as_index(C, cnt, "count"));
}

static jv filter_default(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    int boolean = truthy(arg(a, 1, "boolean", mkbool(0)));
    if (v.t == JV_UNDEF || (boolean && !truthy(v))) return arg(a, 0, "default_value", mkstr("", 0));
    return v;
}

static jv filter_first_last(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_UNDEF) return v; /* Jinja2: an undefined iterates as empty */
    if (IS("last") && is_gen(v)) fail(C, "last: a generator cannot be reversed; apply |list");
    jlist *l = iter_items(C, v);
    if (!l->n) return UNDEF;
    return IS("first") ? l->v[0] : l->v[l->n - 1];
}

static jv filter_join(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    jv sep = arg(a, 0, "d", mkstr("", 0)), attr = arg(a, 1, "attribute", NONE);
    sep = to_str(C, sep);
    jlist *l = iter_items(C, v);
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_put(C, &b, sep.s.p, sep.s.n);
        write_str(C, &b, attr.t == JV_NONE ? l->v[i] : attr_path(C, l->v[i], attr));
    }
    return sb_val(&b);
}

static jv filter_items(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_UNDEF) return mklist(list_new(C, 1));
    if (v.t != JV_DICT && v.t != JV_NS) fail(C, "items: expected a dict, got %s", type_name(v));
    jfunc fn = {.id = M_ITEMS, .self = v};
    jargs none = {0};
    return call_func(C, &fn, &none);
}

static jv filter_list(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_LIST) {
        jlist *l = list_new(C, v.l->n);
        for (size_t i = 0; i < v.l->n; i++) list_push(C, l, v.l->v[i]);
        return mklist(l);
    }
    return mklist(iter_items(C, v));
}

static jv filter_reverse(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_STR) return do_slice(C, v, NONE, NONE, mkint(-1));
    jlist *src = iter_items(C, v), *l = list_new(C, src->n);
    for (size_t i = src->n; i > 0; i--) list_push(C, l, src->v[i - 1]);
    return mklist(l);
}

/* unique: strings compare case-insensitively, as Jinja2's default */
static jv filter_unique(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    jlist *src = iter_items(C, v), *l = list_new(C, src->n), *keys = list_new(C, src->n);
    for (size_t i = 0; i < src->n; i++) {
        jv x = src->v[i].t == JV_STR ? str_case(C, src->v[i], 1) : src->v[i];
        int seen = 0;
        for (size_t k = 0; k < keys->n && !seen; k++) {
            step(C, C->at);
            seen = val_eq(x, keys->v[k]);
        }
        if (!seen) {
            list_push(C, keys, x);
            list_push(C, l, src->v[i]);
        }
    }
    return mklist(l);
}

static jv filter_select(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return select_items(C, v, a, 0, 1);
}

static jv filter_reject(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return select_items(C, v, a, 0, 0);
}

static jv filter_selectattr(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return select_items(C, v, a, 1, 1);
}

static jv filter_rejectattr(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    return select_items(C, v, a, 1, 0);
}

static jv filter_map(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    jlist *src = truthy(v) ? iter_items(C, v) : list_new(C, 1), *l = list_new(C, src->n);
    l->gen = 1;
    jv attr = arg(a, 99, "attribute", UNDEF);
    jv dflt = arg(a, 99, "default", UNDEF);
    if (attr.t == JV_UNDEF) {
        jv f = need_str(C, arg(a, 0, NULL, UNDEF), "map's filter name");
        jargs fa = {0};
        for (size_t i = 1; i < a->npos; i++) fa.pos[fa.npos++] = a->pos[i];
        for (size_t i = 0; i < src->n; i++) list_push(C, l, apply_filter(C, f.s.p, f.s.n, src->v[i], &fa));
    } else {
        for (size_t i = 0; i < src->n; i++) {
            jv x = attr_path(C, src->v[i], attr);
            list_push(C, l, x.t == JV_UNDEF && dflt.t != JV_UNDEF ? dflt : x);
        }
    }
    return mklist(l);
}

static jv filter_int(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_UNDEF) fail_undef(C, v, "converted to a number");
    if (v.t == JV_INT) return v;
    if (v.t == JV_BOOL) return mkint(v.i);
    if (v.t == JV_FLOAT && isfinite(v.f) && fabs(v.f) < 9e18) return mkint((int64_t)v.f);
    if (v.t == JV_STR) {
        char buf[32];
        jv s = str_strip(v, NONE, 1, 1);
        if (s.s.n && s.s.n < sizeof buf) {
            memcpy(buf, s.s.p, s.s.n);
            buf[s.s.n] = 0;
            char *e;
            long long x = strtoll(buf, &e, 10);
            if (!*e) return mkint(x);
        }
    }
    return arg(a, 0, "default", mkint(0));
}

static jv filter_float(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_UNDEF) fail_undef(C, v, "converted to a number");
    if (is_num(v)) return mkfloat(num(v));
    return arg(a, 0, "default", mkfloat(0));
}

static jv filter_abs(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t == JV_BOOL) return mkint(v.i);
    if (v.t == JV_INT) return v.i == INT64_MIN ? mkfloat(9223372036854775808.0) : mkint(v.i < 0 ? -v.i : v.i);
    if (is_num(v)) return mkfloat(fabs(num(v)));
    fail(C, "abs: expected a number, got %s", type_name(v));
}

static jv filter_indent(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    jv s = to_str(C, v);
    jv w = arg(a, 0, "width", mkint(4));
    int64_t first = truthy(arg(a, 1, "first", mkbool(0))), blank = truthy(arg(a, 2, "blank", mkbool(0)));
    sbuf pad = {0};
    sb_put(C, &pad, "", 0);
    if (w.t == JV_STR) sb_put(C, &pad, w.s.p, w.s.n);
    else
        for (int64_t k = as_index(C, w, "indent's width"); k > 0; k--) sb_put(C, &pad, " ", 1);
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    size_t st = 0;
    for (size_t i = 0, line = 0; i <= s.s.n; i++) {
        if (i < s.s.n && s.s.p[i] != '\n') continue;
        size_t len = i - st;
        if ((line > 0 || first) && (blank || len > 0)) sb_put(C, &b, pad.p, pad.n);
        sb_put(C, &b, s.s.p + st, len);
        if (i < s.s.n) sb_put(C, &b, "\n", 1);
        st = i + 1;
        line++;
    }
    return sb_val(&b);
}

static jv filter_min_max_sort(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    int sort = IS("sort");
    jv rev = sort ? arg(a, 0, "reverse", mkbool(0)) : mkbool(0);
    jv cs = arg(a, sort ? 1 : 0, "case_sensitive", mkbool(0)), attr = arg(a, sort ? 2 : 1, "attribute", NONE);
    jlist *src = iter_items(C, v), *l = list_new(C, src->n), *keys = list_new(C, src->n);
    for (size_t i = 0; i < src->n; i++) {
        jv k = attr.t == JV_NONE ? src->v[i] : attr_path(C, src->v[i], attr);
        list_push(C, keys, k.t == JV_STR && !truthy(cs) ? str_case(C, k, 1) : k);
        list_push(C, l, src->v[i]);
    }
    if (!sort) {
        if (!l->n) return UNDEF;
        size_t best = 0;
        for (size_t i = 1; i < l->n; i++)
            if (IS("min") ? val_lt(C, keys->v[i], keys->v[best]) : val_lt(C, keys->v[best], keys->v[i])) best = i;
        return l->v[best];
    }
    int r = truthy(rev);
    for (size_t i = 1; i < l->n; i++) /* insertion sort: stable, as Python's sorted */
        for (size_t k = i; k > 0 && (r ? val_lt(C, keys->v[k - 1], keys->v[k])
                                       : val_lt(C, keys->v[k], keys->v[k - 1])); k--) {
            step(C, C->at); /* quadratic: every comparison counts against the limits */
            jv t = l->v[k], tk = keys->v[k];
            l->v[k] = l->v[k - 1];
            keys->v[k] = keys->v[k - 1];
            l->v[k - 1] = t;
            keys->v[k - 1] = tk;
        }
    return mklist(l);
}

static jv filter_dictsort(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    if (v.t != JV_DICT) fail(C, "dictsort: expected a dict, got %s", type_name(v));
    jfunc fn = {.id = M_ITEMS, .self = v};
    jargs none = {0};
    jv items = call_func(C, &fn, &none);
    jlist *l = items.l;
    for (size_t i = 1; i < l->n; i++) /* insertion sort by key: small dicts */
        for (size_t k = i; k > 0 && val_lt(C, l->v[k].l->v[0], l->v[k - 1].l->v[0]); k--) {
            step(C, C->at);
            jv t = l->v[k];
            l->v[k] = l->v[k - 1];
            l->v[k - 1] = t;
        }
    return items;
}
#undef IS

typedef jv (*filter_fn)(jctx *C, const char *name, size_t n, jv v, const jargs *a);

static const struct {
    const char *name;
    filter_fn fn;
} FILTERS[] = {
    {"safe", filter_safe},
    {"e", filter_escape},
    {"escape", filter_escape},
    {"forceescape", filter_escape},
    {"trim", filter_trim},
    {"string", filter_string},
    {"upper", filter_upper},
    {"lower", filter_lower},
    {"capitalize", filter_capitalize},
    {"title", filter_title},
    {"length", filter_length},
    {"count", filter_length},
    {"tojson", filter_tojson},
    {"replace", filter_replace},
    {"default", filter_default},
    {"d", filter_default},
    {"first", filter_first_last},
    {"last", filter_first_last},
    {"join", filter_join},
    {"items", filter_items},
    {"list", filter_list},
    {"reverse", filter_reverse},
    {"unique", filter_unique},
    {"select", filter_select},
    {"reject", filter_reject},
    {"selectattr", filter_selectattr},
    {"rejectattr", filter_rejectattr},
    {"map", filter_map},
    {"int", filter_int},
    {"float", filter_float},
    {"abs", filter_abs},
    {"indent", filter_indent},
    {"min", filter_min_max_sort},
    {"max", filter_min_max_sort},
    {"sort", filter_min_max_sort},
    {"dictsort", filter_dictsort},
};

static jv apply_filter(jctx *C, const char *name, size_t n, jv v, const jargs *a)
{
    for (size_t i = 0; i < sizeof FILTERS / sizeof *FILTERS; i++)
        if (strlen(FILTERS[i].name) == n && !memcmp(FILTERS[i].name, name, n))
            return FILTERS[i].fn(C, name, n, v, a);
    fail(C, "unknown filter '%.*s'", (int)(n > 40 ? 40 : n), name);
}

/* ---- operators ---- */

static int val_lt(jctx *C, jv a, jv b)
{
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) return a.i < b.i;
        return num(a) < num(b);
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t m = a.s.n < b.s.n ? a.s.n : b.s.n;
        int c = memcmp(a.s.p, b.s.p, m);
        return c < 0 || (c == 0 && a.s.n < b.s.n);
    }
    if (a.t == JV_LIST && b.t == JV_LIST) {
        for (size_t i = 0; i < a.l->n && i < b.l->n; i++) {
            if (val_eq(a.l->v[i], b.l->v[i])) continue;
            return val_lt(C, a.l->v[i], b.l->v[i]);
        }
        return a.l->n < b.l->n;
    }
    fail(C, "cannot compare %s with %s", type_name(a), type_name(b));
}

static int contains(jctx *C, jv hay, jv x)
{
    switch (hay.t) {
    case JV_STR:
        if (x.t != JV_STR) fail(C, "'in <string>' needs a string on the left, not %s", type_name(x));
        return memmem_(hay.s.p, hay.s.n, x.s.p, x.s.n) != NULL;
    case JV_LIST:
        for (size_t i = 0; i < hay.l->n; i++)
            if (val_eq(hay.l->v[i], x)) return 1;
        return 0;
    case JV_DICT:
    case JV_NS: return dict_find(hay.d, x) != NULL;
    case JV_UNDEF: return 0;
    default: fail(C, "'in' needs a string, list or dict on the right, not %s", type_name(hay));
    }
}

/* Python's printf-style str % args: %s %r %d %i %% and %(key)s; args a tuple (list), a dict or one value. */
static jv str_format(jctx *C, jv f, jv args)
{
    sbuf b = {0};
    sb_put(C, &b, "", 0);
    size_t next = 0;
    int used_mapping = 0;
    for (size_t i = 0; i < f.s.n; i++) {
        char c = f.s.p[i];
        if (c != '%') {
            sb_put(C, &b, &c, 1);
            continue;
        }
        if (++i >= f.s.n) fail(C, "incomplete format");
        jv v;
        if (f.s.p[i] == '%') {
            sb_put(C, &b, "%", 1);
            continue;
        }
        if (f.s.p[i] == '(') {
            size_t e = i + 1;
            while (e < f.s.n && f.s.p[e] != ')') e++;
            if (e >= f.s.n || args.t != JV_DICT) fail(C, "format requires a mapping");
            jv *p = dict_find_s(args.d, f.s.p + i + 1, e - i - 1);
            if (!p) fail(C, "format key '%.*s' is missing", (int)(e - i - 1 > 40 ? 40 : e - i - 1), f.s.p + i + 1);
            v = *p;
            used_mapping = 1;
            i = e + 1;
            if (i >= f.s.n) fail(C, "incomplete format");
        } else if (args.t == JV_LIST) {
            if (next >= args.l->n) fail(C, "not enough arguments for format string");
            v = args.l->v[next++];
        } else {
            if (next++ > 0 || args.t == JV_DICT) fail(C, "not enough arguments for format string");
            v = args;
        }
        char conv = f.s.p[i];
        if (conv == 's') write_str(C, &b, v);
        else if (conv == 'r') write_repr(C, &b, v);
        else if ((conv == 'd' || conv == 'i') && is_num(v))
            write_str(C, &b, mkint(v.t == JV_FLOAT ? (int64_t)v.f : v.i));
        else fail(C, "unsupported format '%%%c'", conv);
    }
    if (!used_mapping && args.t != JV_DICT && args.t != JV_UNDEF && next < (args.t == JV_LIST ? args.l->n : 1))
        fail(C, "not all arguments converted during string formatting");
    return sb_val(&b);
}

static jv arith(jctx *C, int op, jv a, jv b)
{
    if (op == OP_MOD && a.t == JV_STR && b.t == JV_UNDEF) return str_format(C, a, b); /* Python: a mapping */
    if (a.t == JV_UNDEF) fail_undef(C, a, "used in arithmetic");
    if (b.t == JV_UNDEF) fail_undef(C, b, "used in arithmetic");
    if (op == OP_ADD && a.t == JV_STR && b.t == JV_STR) {
        int safe = a.safe || b.safe;
        if (safe && !a.safe) a = escape_html(C, a); /* Markup + str escapes the str */
        if (safe && !b.safe) b = escape_html(C, b);
        sbuf s = {0};
        sb_put(C, &s, "", 0);
        sb_put(C, &s, a.s.p, a.s.n);
        sb_put(C, &s, b.s.p, b.s.n);
        jv r = sb_val(&s);
        r.safe = safe;
        return r;
    }
    if (op == OP_ADD && a.t == JV_LIST && b.t == JV_LIST) {
        jlist *l = list_new(C, a.l->n + b.l->n);
        for (size_t i = 0; i < a.l->n; i++) list_push(C, l, a.l->v[i]);
        for (size_t i = 0; i < b.l->n; i++) list_push(C, l, b.l->v[i]);
        return mklist(l);
    }
    if (op == OP_MUL && (b.t == JV_STR || b.t == JV_LIST) && (a.t == JV_INT || a.t == JV_BOOL)) {
        jv t = a; /* int * sequence repeats as sequence * int does */
        a = b;
        b = t;
    }
    if (op == OP_MUL && (a.t == JV_STR || (a.t == JV_LIST && !a.l->gen)) && (b.t == JV_INT || b.t == JV_BOOL)) {
        int64_t k = b.i;
        if (a.t == JV_STR) {
            sbuf s = {0};
            sb_put(C, &s, "", 0);
            for (int64_t i = 0; i < k; i++) sb_put(C, &s, a.s.p, a.s.n);
            return sb_val(&s);
        }
        jlist *l = list_new(C, 4);
        for (int64_t i = 0; i < k && a.l->n; i++) {
            if (l->n > 100000) fail(C, "list repetition is limited to 100000 items");
            for (size_t j = 0; j < a.l->n; j++) list_push(C, l, a.l->v[j]);
        }
        return mklist(l);
    }
    if (op == OP_MOD && a.t == JV_STR) return str_format(C, a, b);
    if (!is_num(a) || !is_num(b))
        fail(C, "unsupported operand types for arithmetic: %s and %s", type_name(a), type_name(b));
    if (a.t != JV_FLOAT && b.t != JV_FLOAT && op != OP_DIV) {
        int64_t x = a.i, y = b.i, r;
        switch (op) {
        case OP_ADD:
            if (__builtin_add_overflow(x, y, &r)) fail(C, "integer overflow");
            return mkint(r);
        case OP_SUB:
            if (__builtin_sub_overflow(x, y, &r)) fail(C, "integer overflow");
            return mkint(r);
        case OP_MUL:
            if (__builtin_mul_overflow(x, y, &r)) fail(C, "integer overflow");
            return mkint(r);
        case OP_FLOORDIV:
        case OP_MOD:
            if (y == 0) fail(C, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) fail(C, "integer overflow");
            r = x / y;
            if ((x % y != 0) && ((x < 0) != (y < 0))) r--;
            return op == OP_FLOORDIV ? mkint(r) : mkint(x - r * y);
        case OP_POW:
            if (y < 0) return mkfloat(pow((double)x, (double)y));
            r = 1;
            for (int64_t i = 0; i < y; i++) {
                if (__builtin_mul_overflow(r, x, &r)) fail(C, "integer overflow");
                if (r == 0 || r == 1) break;
            }
            return mkint(r);
        }
    }
    double x = num(a), y = num(b);
    switch (op) {
    case OP_ADD: return mkfloat(x + y);
    case OP_SUB: return mkfloat(x - y);
    case OP_MUL: return mkfloat(x * y);
    case OP_DIV:
        if (y == 0) fail(C, "division by zero");
        return mkfloat(x / y);
    case OP_FLOORDIV:
        if (y == 0) fail(C, "float floor division by zero");
        return mkfloat(floor(x / y));
    case OP_MOD: {
        if (y == 0) fail(C, "float modulo by zero");
        double m = fmod(x, y);
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return mkfloat(m);
    }
    default: return mkfloat(pow(x, y));
    }
}

static jv binary(jctx *C, int op, jv a, jv b)
{
    switch (op) {
    case OP_EQ: return mkbool(val_eq(a, b));
    case OP_NE: return mkbool(!val_eq(a, b));
    case OP_LT: return mkbool(val_lt(C, a, b));
    case OP_GT: return mkbool(val_lt(C, b, a));
    case OP_LE: return mkbool(!val_lt(C, b, a));
    case OP_GE: return mkbool(!val_lt(C, a, b));
    case OP_IN: return mkbool(contains(C, b, a));
    case OP_NOTIN: return mkbool(!contains(C, b, a));
    case OP_CONCAT: {
        sbuf s = {0};
        sb_put(C, &s, "", 0);
        write_str(C, &s, a);
        write_str(C, &s, b);
        return sb_val(&s);
    }
    default: return arith(C, op, a, b);
    }
}

/* ---- expressions and statements ---- */

static jv eval_call(jctx *C, const jnode *n)
{
    jv callee = eval(C, n->a);
    jargs a;
    eval_args(C, n->b, &a);
    C->at = n;
    if (callee.t == JV_FUNC) return call_func(C, callee.fn, &a);
    if (callee.t == JV_MACRO) return call_macro(C, callee.m, &a);
    if (callee.t == JV_UNDEF) fail_undef(C, callee, "called");
    fail(C, "a %s is not callable", type_name(callee));
}

static jv eval(jctx *C, const jnode *n)
{
    step(C, n);
    deeper(C);
    jv r;
    switch (n->k) {
    case N_LIT: r = n->lit; break;
    case N_NAME: r = lookup(C, n->name, n->name_n); break;
    case N_ATTR: {
        jv o = eval(C, n->a);
        C->at = n;
        r = get_attr(C, o, n->name, n->name_n);
        break;
    }
    case N_ITEM: {
        jv o = eval(C, n->a), k = eval(C, n->b);
        C->at = n;
        r = get_item(C, o, k);
        break;
    }
    case N_SLICE: {
        jv o = eval(C, n->a);
        jv lo = n->b ? eval(C, n->b) : NONE, hi = n->c ? eval(C, n->c) : NONE, st = n->d ? eval(C, n->d) : NONE;
        C->at = n;
        r = do_slice(C, o, lo, hi, st);
        break;
    }
    case N_CALL: r = eval_call(C, n); break;
    case N_FILTER: {
        jv v = eval(C, n->a);
        jargs a;
        eval_args(C, n->b, &a);
        C->at = n;
        r = apply_filter(C, n->name, n->name_n, v, &a);
        break;
    }
    case N_TEST: {
        jv v = eval(C, n->a);
        jargs a;
        eval_args(C, n->b, &a);
        C->at = n;
        r = mkbool(run_test(C, n->name, n->name_n, v, &a) != n->op);
        break;
    }
    case N_NEG:
    case N_POS: {
        jv v = eval(C, n->a);
        C->at = n;
        if (v.t == JV_UNDEF) fail_undef(C, v, "used in arithmetic");
        if (!is_num(v)) fail(C, "bad operand type for unary %c: %s", n->k == N_NEG ? '-' : '+', type_name(v));
        if (n->k == N_POS) r = v.t == JV_BOOL ? mkint(v.i) : v;
        else if (v.t == JV_FLOAT) r = mkfloat(-v.f);
        else if (v.i == INT64_MIN) fail(C, "integer overflow");
        else r = mkint(-v.i);
        break;
    }
    case N_NOT: r = mkbool(!truthy(eval(C, n->a))); break;
    case N_AND: {
        jv a = eval(C, n->a);
        r = truthy(a) ? eval(C, n->b) : a;
        break;
    }
    case N_OR: {
        jv a = eval(C, n->a);
        r = truthy(a) ? a : eval(C, n->b);
        break;
    }
    case N_BIN: {
        jv a = eval(C, n->a), b = eval(C, n->b);
        C->at = n;
        r = binary(C, n->op, a, b);
        break;
    }
    case N_COMPARE: {
        jv left = eval(C, n->a);
        for (const jnode *o = n->b; o; o = o->next) {
            jv right = eval(C, o->a);
            C->at = o;
            r = binary(C, o->op, left, right);
            if (!truthy(r)) break;
            left = right;
        }
        break;
    }
    case N_COND: r = truthy(eval(C, n->b)) ? eval(C, n->a) : n->c ? eval(C, n->c) : UNDEF; break;
    case N_LIST:
    case N_TUPLE: {
        jlist *l = list_new(C, 4);
        for (const jnode *i = n->a; i; i = i->next) list_push(C, l, eval(C, i));
        r = mklist(l);
        break;
    }
    case N_DICT: {
        jdict *d = dict_new(C);
        for (const jnode *p = n->a; p; p = p->next) {
            jv k = eval(C, p->a);
            dict_set(C, d, k, eval(C, p->b));
        }
        r = (jv){.t = JV_DICT, .d = d};
        break;
    }
    default: fail(C, "bad expression node %d", (int)n->k);
    }
    C->depth--;
    return r;
}

static void assign(jctx *C, const jnode *target, jv v)
{
    if (target->k == N_NAME) {
        dict_set(C, &C->frame->vars, mkstr(target->name, target->name_n), v);
    } else if (target->k == N_ATTR) {
        jv ns = eval(C, target->a);
        C->at = target;
        if (ns.t != JV_NS) fail(C, "can only assign attributes of a namespace(), not of a %s", type_name(ns));
        if (target->name_n && target->name[0] == '_') fail(C, "namespace attributes may not start with '_'");
        dict_set(C, ns.d, mkstr(target->name, target->name_n), v);
    } else { /* a tuple of names */
        if (v.t != JV_LIST) fail(C, "cannot unpack a %s", type_name(v));
        size_t k = 0;
        for (const jnode *t = target->a; t; t = t->next) k++;
        if (k != v.l->n) fail(C, "cannot unpack %zu values into %zu names", v.l->n, k);
        k = 0;
        for (const jnode *t = target->a; t; t = t->next) assign(C, t, v.l->v[k++]);
    }
}

/* Binds a loop item to the loop's names in frame f. */
static void bind_targets(jctx *C, const jnode *targets, jv item)
{
    if (!targets->next) {
        dict_set(C, &C->frame->vars, mkstr(targets->name, targets->name_n), item);
        return;
    }
    size_t k = 0;
    for (const jnode *t = targets; t; t = t->next) k++;
    if (item.t != JV_LIST || item.l->n != k)
        fail(C, "cannot unpack a %s into %zu loop variables", type_name(item), k);
    k = 0;
    for (const jnode *t = targets; t; t = t->next)
        dict_set(C, &C->frame->vars, mkstr(t->name, t->name_n), item.l->v[k++]);
}

static void exec_for(jctx *C, const jnode *n)
{
    jv it = eval(C, n->b);
    C->at = n;
    jlist *items = iter_items(C, it);
    jframe *outer = C->frame;
    jframe f = {.parent = outer};
    C->frame = &f;
    if (n->e) { /* "for x in xs if cond": loop over the items that pass */
        jlist *kept = list_new(C, items->n);
        for (size_t i = 0; i < items->n; i++) {
            f.vars.n = 0;
            bind_targets(C, n->a, items->v[i]);
            if (truthy(eval(C, n->e))) list_push(C, kept, items->v[i]);
        }
        items = kept;
    }
    jloop *loop = alloc(C, sizeof *loop); /* in the arena: a template may keep it past the loop */
    loop->items = items;
    for (size_t i = 0; i < items->n; i++) {
        f.vars.n = 0;
        loop->i = i;
        dict_set(C, &f.vars, mkstr("loop", 4), (jv){.t = JV_LOOP, .loop = loop});
        bind_targets(C, n->a, items->v[i]);
        exec_body(C, n->c);
        if (C->brk == 1) {
            C->brk = 0;
            break;
        }
        C->brk = 0;
    }
    C->frame = outer;
    if (!items->n && n->d) exec_body(C, n->d);
}

static void exec_stmt(jctx *C, const jnode *n)
{
    step(C, n);
    deeper(C);
    switch (n->k) {
    case N_TEXT: sb_put(C, C->out, n->name, n->name_n); break;
    case N_OUT: write_str(C, C->out, eval(C, n->a)); break;
    case N_IF:
        exec_body(C, truthy(eval(C, n->a)) ? n->b : n->c);
        break;
    case N_FOR: exec_for(C, n); break;
    case N_SET: {
        jv v = eval(C, n->b);
        C->at = n;
        assign(C, n->a, v);
        break;
    }
    case N_SETBLOCK:
    case N_FILTERBLOCK: {
        sbuf b = {0}, *saved = C->out;
        sb_put(C, &b, "", 0);
        C->out = &b;
        exec_body(C, n->k == N_SETBLOCK ? n->b : n->c);
        C->out = saved;
        if (n->k == N_SETBLOCK) {
            assign(C, n->a, sb_val(&b));
        } else {
            jargs a;
            eval_args(C, n->b, &a);
            C->at = n;
            write_str(C, C->out, apply_filter(C, n->name, n->name_n, sb_val(&b), &a));
        }
        break;
    }
    case N_MACRO: dict_set(C, &C->frame->vars, mkstr(n->name, n->name_n), (jv){.t = JV_MACRO, .m = n}); break;
    case N_BREAK: C->brk = 1; break;
    case N_CONTINUE: C->brk = 2; break;
    case N_BODY: exec_body(C, n->a); break;
    default: fail(C, "bad statement node %d", (int)n->k);
    }
    C->depth--;
}

static void exec_body(jctx *C, const jnode *s)
{
    for (; s && !C->brk; s = s->next) exec_stmt(C, s);
}

/* ---- rendering ---- */

jinja_limits jinja_default_limits(void)
{
    return (jinja_limits){.max_steps = 10000000, .max_ms = 2000, .max_mem = (size_t)128 << 20, .max_depth = 200,
                          .max_out = (size_t)32 << 20};
}

static jv from_json(jctx *C, const cJSON *j)
{
    step(C, NULL);
    deeper(C);
    jv r;
    if (cJSON_IsNull(j)) {
        r = NONE;
    } else if (cJSON_IsBool(j)) {
        r = mkbool(cJSON_IsTrue(j));
    } else if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        r = d == floor(d) && fabs(d) < 9007199254740992.0 ? mkint((int64_t)d) : mkfloat(d);
    } else if (cJSON_IsString(j)) {
        r = mkstr(j->valuestring, strlen(j->valuestring));
    } else if (cJSON_IsArray(j)) {
        jlist *l = list_new(C, 4);
        for (const cJSON *e = j->child; e; e = e->next) list_push(C, l, from_json(C, e));
        r = mklist(l);
    } else if (cJSON_IsObject(j)) {
        jdict *d = dict_new(C);
        for (const cJSON *e = j->child; e; e = e->next)
            dict_append(C, d, mkstr(e->string, strlen(e->string)), from_json(C, e));
        r = (jv){.t = JV_DICT, .d = d};
    } else {
        r = NONE;
    }
    C->depth--;
    return r;
}

bt_status jinja_render(const jinja_tmpl *t, const cJSON *vars, int64_t now, const jinja_limits *limits, char **out,
                       size_t *out_len)
{
    jctx *C = calloc(1, sizeof *C);
    if (!C) return bt_fail(BT_ERR_NOMEM, "out of memory");
    C->lim = limits ? *limits : jinja_default_limits();
    C->arena.cap = C->lim.max_mem;
    C->now = now;
    clock_gettime(CLOCK_MONOTONIC, &C->deadline);
    C->deadline.tv_sec += C->lim.max_ms / 1000;
    C->deadline.tv_nsec += (long)(C->lim.max_ms % 1000) * 1000000L;
    if (C->deadline.tv_nsec >= 1000000000L) {
        C->deadline.tv_sec++;
        C->deadline.tv_nsec -= 1000000000L;
    }
    jframe root = {0};
    sbuf b = {0};
    bt_status st = BT_OK;
    if (setjmp(C->err.jmp)) {
        st = bt_fail(C->err.st, "%s", C->err.msg);
        goto done;
    }
    C->root = C->frame = &root;
    C->out = &b;
    sb_put(C, &b, "", 0);
    if (cJSON_IsObject(vars))
        for (const cJSON *e = vars->child; e; e = e->next)
            dict_set(C, &root.vars, mkstr(e->string, strlen(e->string)), from_json(C, e));
    exec_body(C, t->body);
    char *s = malloc(b.n + 1);
    if (!s) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto done;
    }
    memcpy(s, b.p, b.n + 1);
    *out = s;
    *out_len = b.n;
done:
    arena_free(&C->arena);
    free(C);
    return st;
}
