#include "engine/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/unicode.h"

/* A compiled element: kind in the top two bits, payload below. Each alternative is a run of elements ended by
 * E_END; a frame of a parse stack is the index of the next element its alternative must match. */
#define E_END 0u
#define E_BYTES 1u /* payload: byte set index */
#define E_REF 2u   /* payload: rule index */
#define E_KIND(e) ((e) >> 30)
#define E_ARG(e) ((e) & 0x3FFFFFFFu)
#define E_MAKE(k, a) (((uint32_t)(k) << 30) | (uint32_t)(a))

typedef struct byteset {
    uint64_t b[4];
} byteset;

struct bt_grammar {
    uint32_t *elems; /* [n_elems] all alternatives, each ended by E_END */
    uint32_t n_elems;
    byteset *sets;   /* [n_sets] */
    uint32_t n_sets;
    uint32_t *rule_alt; /* [n_rules + 1] rule r's alternatives are alt_start[rule_alt[r] .. rule_alt[r + 1]) */
    uint32_t *alt_start; /* element index of each alternative's first element */
    int32_t n_rules;
    int32_t root;
};

/* ---- parsing ---- */

typedef struct vec32 {
    uint32_t *v;
    uint32_t n, cap;
} vec32;

typedef struct prule {
    char *name;     /* NULL for anonymous rules */
    int defined;
    size_t first_use; /* text offset of the first reference, for "undefined rule" errors */
    vec32 *alts;
    uint32_t n_alts, cap_alts;
} prule;

typedef struct parser {
    const char *s, *p, *end;
    prule *rules;
    uint32_t n_rules, cap_rules;
    byteset *sets;
    uint32_t n_sets, cap_sets;
    uint64_t n_elems; /* elements so far, for the limit */
    int nest;
    bt_status err;
} parser;

static void where(const parser *ps, size_t off, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < off && ps->s + i < ps->end; i++) {
        if (ps->s[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

__attribute__((format(printf, 3, 4))) static bt_status perr_at(parser *ps, size_t off, const char *fmt, ...)
{
    if (ps->err) return ps->err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    where(ps, off, &line, &col);
    ps->err = bt_fail(BT_ERR_INVALID, "grammar: line %d col %d: %s", line, col, msg);
    return ps->err;
}

#define PERR(ps, ...) perr_at((ps), (size_t)((ps)->p - (ps)->s), __VA_ARGS__)

static bt_status nomem(parser *ps)
{
    if (!ps->err) ps->err = bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    return ps->err;
}

static bt_status vec_push(parser *ps, vec32 *v, uint32_t x)
{
    if (v->n == v->cap) {
        uint32_t cap = v->cap ? v->cap * 2 : 8;
        uint32_t *nv = realloc(v->v, sizeof *nv * cap);
        if (!nv) return nomem(ps);
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    if (++ps->n_elems > BT_GRAMMAR_MAX_ELEMS)
        return PERR(ps, "the grammar compiles to more than %u elements", BT_GRAMMAR_MAX_ELEMS);
    return BT_OK;
}

static bt_status vec_append(parser *ps, vec32 *v, const vec32 *src)
{
    for (uint32_t i = 0; i < src->n; i++)
        if (vec_push(ps, v, src->v[i])) return ps->err;
    return BT_OK;
}

static int32_t rule_new(parser *ps, const char *name, size_t len)
{
    if (ps->n_rules >= BT_GRAMMAR_MAX_RULES) {
        PERR(ps, "more than %d rules", BT_GRAMMAR_MAX_RULES);
        return -1;
    }
    if (ps->n_rules == ps->cap_rules) {
        uint32_t cap = ps->cap_rules ? ps->cap_rules * 2 : 16;
        prule *nr = realloc(ps->rules, sizeof *nr * cap);
        if (!nr) {
            nomem(ps);
            return -1;
        }
        ps->rules = nr;
        ps->cap_rules = cap;
    }
    prule *r = &ps->rules[ps->n_rules];
    memset(r, 0, sizeof *r);
    if (name) {
        r->name = malloc(len + 1);
        if (!r->name) {
            nomem(ps);
            return -1;
        }
        memcpy(r->name, name, len);
        r->name[len] = 0;
    }
    r->first_use = (size_t)(ps->p - ps->s);
    return (int32_t)ps->n_rules++;
}

static int32_t rule_find(parser *ps, const char *name, size_t len)
{
    for (uint32_t i = 0; i < ps->n_rules; i++)
        if (ps->rules[i].name && strlen(ps->rules[i].name) == len && !memcmp(ps->rules[i].name, name, len))
            return (int32_t)i;
    return rule_new(ps, name, len);
}

static vec32 *rule_add_alt(parser *ps, int32_t rid)
{
    prule *r = &ps->rules[rid];
    if (r->n_alts == r->cap_alts) {
        uint32_t cap = r->cap_alts ? r->cap_alts * 2 : 4;
        vec32 *na = realloc(r->alts, sizeof *na * cap);
        if (!na) {
            nomem(ps);
            return NULL;
        }
        r->alts = na;
        r->cap_alts = cap;
    }
    vec32 *a = &r->alts[r->n_alts++];
    memset(a, 0, sizeof *a);
    return a;
}

static int32_t set_add(parser *ps, const byteset *bs)
{
    for (uint32_t i = 0; i < ps->n_sets; i++) /* classes repeat a lot in generated grammars */
        if (!memcmp(&ps->sets[i], bs, sizeof *bs)) return (int32_t)i;
    if (ps->n_sets == ps->cap_sets) {
        uint32_t cap = ps->cap_sets ? ps->cap_sets * 2 : 32;
        byteset *ns = realloc(ps->sets, sizeof *ns * cap);
        if (!ns) {
            nomem(ps);
            return -1;
        }
        ps->sets = ns;
        ps->cap_sets = cap;
    }
    ps->sets[ps->n_sets] = *bs;
    return (int32_t)ps->n_sets++;
}

static bt_status push_byte_range(parser *ps, vec32 *v, uint8_t lo, uint8_t hi)
{
    byteset bs = {{0, 0, 0, 0}};
    for (unsigned c = lo; c <= hi; c++) bs.b[c >> 6] |= 1ull << (c & 63);
    int32_t id = set_add(ps, &bs);
    if (id < 0) return ps->err;
    return vec_push(ps, v, E_MAKE(E_BYTES, id));
}

static void skip_space(parser *ps)
{
    while (ps->p < ps->end) {
        char c = *ps->p;
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            ps->p++;
        } else if (c == '#') {
            while (ps->p < ps->end && *ps->p != '\n') ps->p++;
        } else {
            break;
        }
    }
}

static int is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

static size_t name_len(const parser *ps, const char *p)
{
    size_t n = 0;
    while (p + n < ps->end && is_name_char(p[n])) n++;
    return n;
}

/* Whether p starts `name ::=`, the beginning of the next rule. */
static int at_rule_def(const parser *ps, const char *p)
{
    size_t n = name_len(ps, p);
    if (!n) return 0;
    p += n;
    while (p < ps->end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return ps->end - p >= 3 && !memcmp(p, "::=", 3);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class, escapes decoded, as a code point (or a raw byte >= 0x80 for \xHH, which
 * literals emit as that byte). Multi-byte UTF-8 in the text is decoded. Returns -1 after an error. */
static int32_t parse_char(parser *ps, int *raw_byte)
{
    *raw_byte = 0;
    if (ps->p >= ps->end) {
        PERR(ps, "unexpected end of grammar");
        return -1;
    }
    unsigned char c = (unsigned char)*ps->p++;
    if (c == '\\') {
        if (ps->p >= ps->end) {
            PERR(ps, "unexpected end of grammar after '\\'");
            return -1;
        }
        char e = *ps->p++;
        int nd = 0;
        switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '0': return 0;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '\'': case '/': case '.': return e;
        case 'x': nd = 2; break;
        case 'u': nd = 4; break;
        case 'U': nd = 8; break;
        default:
            ps->p -= 2;
            PERR(ps, "unknown escape '\\%c'", e);
            return -1;
        }
        uint32_t v = 0;
        for (int i = 0; i < nd; i++) {
            int h = ps->p < ps->end ? hexval(*ps->p) : -1;
            if (h < 0) {
                PERR(ps, "escape needs %d hex digits", nd);
                return -1;
            }
            v = v * 16 + (uint32_t)h;
            ps->p++;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
            PERR(ps, "escape U+%X is not a Unicode scalar value", v);
            return -1;
        }
        if (nd == 2 && v >= 0x80) *raw_byte = 1;
        return (int32_t)v;
    }
    if (c < 0x80) return c;
    int n = c >= 0xF8 ? -1 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : -1;
    if (n < 0) {
        ps->p--;
        PERR(ps, "invalid UTF-8 in the grammar text");
        return -1;
    }
    uint32_t v = c & (0x3F >> n);
    for (int i = 0; i < n; i++) {
        if (ps->p >= ps->end || ((unsigned char)*ps->p & 0xC0) != 0x80) n = -1;
        else v = (v << 6) | ((unsigned char)*ps->p++ & 0x3F);
    }
    if (n < 0 || v > 0x10FFFF) {
        PERR(ps, "invalid UTF-8 in the grammar text");
        return -1;
    }
    return (int32_t)v;
}


typedef struct cprange {
    uint32_t lo, hi;
} cprange;

static int cprange_cmp(const void *a, const void *b)
{
    const cprange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Appends to rule rid one alternative per UTF-8 byte-range sequence of the code points [lo, hi] (no surrogates):
 * the range is split until every byte position spans a contiguous range of the same length encoding. */
static bt_status utf8_ranges(parser *ps, int32_t rid, byteset *ascii, uint32_t lo, uint32_t hi)
{
    static const uint32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i]) {
            if (utf8_ranges(ps, rid, ascii, lo, bounds[i])) return ps->err;
            return utf8_ranges(ps, rid, ascii, bounds[i] + 1, hi);
        }
    if (hi < 0x80) {
        for (uint32_t c = lo; c <= hi; c++) ascii->b[c >> 6] |= 1ull << (c & 63);
        return BT_OK;
    }
    int n = hi < 0x800 ? 2 : hi < 0x10000 ? 3 : 4;
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                if (utf8_ranges(ps, rid, ascii, lo, lo | m)) return ps->err;
                return utf8_ranges(ps, rid, ascii, (lo | m) + 1, hi);
            }
            if ((hi & m) != m) {
                if (utf8_ranges(ps, rid, ascii, lo, (hi & ~m) - 1)) return ps->err;
                return utf8_ranges(ps, rid, ascii, hi & ~m, hi);
            }
        }
    }
    uint8_t a[4], b[4];
    uni_utf8_encode(lo, a);
    uni_utf8_encode(hi, b);
    vec32 *alt = rule_add_alt(ps, rid);
    if (!alt) return ps->err;
    for (int i = 0; i < n; i++)
        if (push_byte_range(ps, alt, a[i], b[i])) return ps->err;
    return BT_OK;
}

/* A class of code point ranges (sorted, merged, complemented when negated) as elements appended to out: one byte
 * set when it is all ASCII, else a reference to an anonymous rule with one alternative per UTF-8 shape. */
static bt_status emit_class(parser *ps, cprange *r, uint32_t n, int negate, vec32 *out)
{
    if (n) qsort(r, n, sizeof *r, cprange_cmp); /* "." passes no ranges */
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (m && r[i].lo <= r[m - 1].hi + 1) {
            if (r[i].hi > r[m - 1].hi) r[m - 1].hi = r[i].hi;
        } else {
            r[m++] = r[i];
        }
    }
    cprange *c = malloc(sizeof *c * (m + 3));
    if (!c) return nomem(ps);
    uint32_t k = 0;
    if (negate) {
        uint32_t next = 0;
        for (uint32_t i = 0; i < m; i++) {
            if (r[i].lo > next) c[k++] = (cprange){next, r[i].lo - 1};
            next = r[i].hi + 1;
        }
        if (next <= 0x10FFFF) c[k++] = (cprange){next, 0x10FFFF};
    } else {
        if (m) memcpy(c, r, sizeof *c * m);
        k = m;
    }
    /* surrogates are not characters */
    cprange *d = malloc(sizeof *d * (2 * k + 1));
    if (!d) {
        free(c);
        return nomem(ps);
    }
    uint32_t nd = 0;
    int all_ascii = 1;
    for (uint32_t i = 0; i < k; i++) {
        if (c[i].lo < 0xD800 && c[i].hi > 0xDFFF) {
            d[nd++] = (cprange){c[i].lo, 0xD7FF};
            d[nd++] = (cprange){0xE000, c[i].hi};
        } else if (c[i].lo >= 0xD800 && c[i].hi <= 0xDFFF) {
            continue;
        } else if (c[i].lo >= 0xD800 && c[i].lo <= 0xDFFF) {
            d[nd++] = (cprange){0xE000, c[i].hi};
        } else if (c[i].hi >= 0xD800 && c[i].hi <= 0xDFFF) {
            d[nd++] = (cprange){c[i].lo, 0xD7FF};
        } else {
            d[nd++] = c[i];
        }
    }
    free(c);
    for (uint32_t i = 0; i < nd; i++)
        if (d[i].hi >= 0x80) all_ascii = 0;
    byteset ascii = {{0, 0, 0, 0}};
    bt_status st = BT_OK;
    if (all_ascii) {
        for (uint32_t i = 0; i < nd; i++) utf8_ranges(ps, -1, &ascii, d[i].lo, d[i].hi);
        int32_t id = set_add(ps, &ascii);
        st = id < 0 ? ps->err : vec_push(ps, out, E_MAKE(E_BYTES, id));
        free(d);
        return st;
    }
    int32_t rid = rule_new(ps, NULL, 0);
    if (rid < 0) {
        free(d);
        return ps->err;
    }
    ps->rules[rid].defined = 1;
    for (uint32_t i = 0; i < nd && !ps->err; i++) utf8_ranges(ps, rid, &ascii, d[i].lo, d[i].hi);
    free(d);
    if (ps->err) return ps->err;
    if (ascii.b[0] | ascii.b[1]) {
        vec32 *alt = rule_add_alt(ps, rid);
        if (!alt) return ps->err;
        int32_t id = set_add(ps, &ascii);
        if (id < 0 || vec_push(ps, alt, E_MAKE(E_BYTES, id))) return ps->err;
    }
    return vec_push(ps, out, E_MAKE(E_REF, rid));
}

static bt_status parse_class(parser *ps, vec32 *out)
{
    ps->p++; /* [ */
    int negate = 0;
    if (ps->p < ps->end && *ps->p == '^') {
        negate = 1;
        ps->p++;
    }
    cprange *r = NULL;
    uint32_t n = 0, cap = 0;
    while (1) {
        if (ps->p >= ps->end) {
            free(r);
            return PERR(ps, "unterminated character class");
        }
        if (*ps->p == ']') {
            ps->p++;
            break;
        }
        int raw;
        int32_t lo = parse_char(ps, &raw), hi = lo;
        if (lo >= 0 && ps->end - ps->p >= 2 && ps->p[0] == '-' && ps->p[1] != ']') {
            ps->p++;
            hi = parse_char(ps, &raw);
            if (hi >= 0 && hi < lo) {
                free(r);
                return PERR(ps, "character range is reversed");
            }
        }
        if (lo < 0 || hi < 0) {
            free(r);
            return ps->err;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            cprange *nr = realloc(r, sizeof *nr * cap);
            if (!nr) {
                free(r);
                return nomem(ps);
            }
            r = nr;
        }
        r[n++] = (cprange){(uint32_t)lo, (uint32_t)hi};
    }
    bt_status st = emit_class(ps, r, n, negate, out);
    free(r);
    return st;
}

static bt_status parse_literal(parser *ps, vec32 *out)
{
    ps->p++; /* " */
    while (1) {
        if (ps->p >= ps->end) return PERR(ps, "unterminated string literal");
        if (*ps->p == '"') {
            ps->p++;
            return BT_OK;
        }
        int raw;
        int32_t cp = parse_char(ps, &raw);
        if (cp < 0) return ps->err;
        uint8_t b[4];
        int nb = raw ? (b[0] = (uint8_t)cp, 1) : (int)uni_utf8_encode((uint32_t)cp, b);
        for (int i = 0; i < nb; i++)
            if (push_byte_range(ps, out, b[i], b[i])) return ps->err;
    }
}

static bt_status parse_alternatives(parser *ps, int32_t rid);

/* A new anonymous rule with alternatives a and (when b is not NULL) b. */
static int32_t anon_rule2(parser *ps, const vec32 *a, const vec32 *b)
{
    int32_t rid = rule_new(ps, NULL, 0);
    if (rid < 0) return -1;
    ps->rules[rid].defined = 1;
    vec32 *alt = rule_add_alt(ps, rid);
    if (!alt || vec_append(ps, alt, a)) return -1;
    if (b) {
        alt = rule_add_alt(ps, rid);
        if (!alt || vec_append(ps, alt, b)) return -1;
    }
    return rid;
}

/* x* as R ::= x R | "" (right recursion: the tail frame is dropped before the call, so the stack stays flat). */
static bt_status emit_star(parser *ps, const vec32 *x, vec32 *out)
{
    int32_t rid = anon_rule2(ps, x, &(vec32){0});
    if (rid < 0) return ps->err;
    if (vec_push(ps, &ps->rules[rid].alts[0], E_MAKE(E_REF, rid))) return ps->err;
    return vec_push(ps, out, E_MAKE(E_REF, rid));
}

static bt_status parse_uint(parser *ps, uint32_t *v)
{
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') return PERR(ps, "expected a number in {m,n}");
    uint64_t x = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        x = x * 10 + (uint64_t)(*ps->p++ - '0');
        if (x > BT_GRAMMAR_MAX_REPEAT) return PERR(ps, "repetition count above %d", BT_GRAMMAR_MAX_REPEAT);
    }
    *v = (uint32_t)x;
    return BT_OK;
}

/* Applies the postfix operator at ps->p (if any) to the atom x, appending the result to out. */
static bt_status parse_postfix(parser *ps, vec32 *x, vec32 *out)
{
    char c = ps->p < ps->end ? *ps->p : 0;
    if (c == '*') {
        ps->p++;
        return emit_star(ps, x, out);
    }
    if (c == '+') {
        ps->p++;
        if (vec_append(ps, out, x)) return ps->err;
        return emit_star(ps, x, out);
    }
    if (c == '?') {
        ps->p++;
        int32_t rid = anon_rule2(ps, x, &(vec32){0});
        return rid < 0 ? ps->err : vec_push(ps, out, E_MAKE(E_REF, rid));
    }
    if (c != '{') return vec_append(ps, out, x);
    ps->p++;
    uint32_t m, n;
    int unbounded = 0;
    skip_space(ps);
    if (parse_uint(ps, &m)) return ps->err;
    skip_space(ps);
    n = m;
    if (ps->p < ps->end && *ps->p == ',') {
        ps->p++;
        skip_space(ps);
        if (ps->p < ps->end && *ps->p == '}') unbounded = 1;
        else if (parse_uint(ps, &n)) return ps->err;
        skip_space(ps);
    }
    if (ps->p >= ps->end || *ps->p != '}') return PERR(ps, "expected '}' closing {m,n}");
    ps->p++;
    if (!unbounded && n < m) return PERR(ps, "{m,n} with n < m");
    for (uint32_t i = 0; i < m; i++)
        if (vec_append(ps, out, x)) return ps->err;
    if (unbounded) return emit_star(ps, x, out);
    /* up to n - m more: R_1 ::= x | "", R_k ::= x R_{k-1} | "" */
    int32_t prev = -1;
    for (uint32_t k = 0; k < n - m; k++) {
        vec32 body = {0};
        if (vec_append(ps, &body, x) || (prev >= 0 && vec_push(ps, &body, E_MAKE(E_REF, prev)))) {
            free(body.v);
            return ps->err;
        }
        prev = anon_rule2(ps, &body, &(vec32){0});
        free(body.v);
        if (prev < 0) return ps->err;
    }
    return prev >= 0 ? vec_push(ps, out, E_MAKE(E_REF, prev)) : BT_OK;
}

/* Parses a sequence into alt, up to '|', ')', the end or the next rule. */
static bt_status parse_sequence(parser *ps, vec32 *alt_out, int32_t rid)
{
    uint32_t alt_index = ps->rules[rid].n_alts - 1; /* alt_out may move when the rule grows: index it */
    (void)alt_out;
    while (1) {
        skip_space(ps);
        if (ps->p >= ps->end) return BT_OK;
        char c = *ps->p;
        if (c == '|' || c == ')') return BT_OK;
        if (at_rule_def(ps, ps->p)) return BT_OK;
        vec32 x = {0};
        bt_status st = BT_OK;
        if (c == '"') {
            st = parse_literal(ps, &x);
        } else if (c == '[') {
            st = parse_class(ps, &x);
        } else if (c == '.') {
            ps->p++;
            st = emit_class(ps, NULL, 0, 1, &x);
        } else if (c == '(') {
            if (++ps->nest > BT_GRAMMAR_MAX_NEST) {
                st = PERR(ps, "parentheses nested deeper than %d", BT_GRAMMAR_MAX_NEST);
            } else {
                ps->p++;
                int32_t sub = rule_new(ps, NULL, 0);
                if (sub < 0) {
                    st = ps->err;
                } else {
                    ps->rules[sub].defined = 1;
                    st = parse_alternatives(ps, sub);
                    skip_space(ps);
                    if (!st && (ps->p >= ps->end || *ps->p != ')')) st = PERR(ps, "expected ')'");
                    if (!st) {
                        ps->p++;
                        st = vec_push(ps, &x, E_MAKE(E_REF, sub));
                    }
                }
                ps->nest--;
            }
        } else if (is_name_char(c)) {
            size_t n = name_len(ps, ps->p);
            int32_t ref = rule_find(ps, ps->p, n);
            ps->p += n;
            st = ref < 0 ? ps->err : vec_push(ps, &x, E_MAKE(E_REF, ref));
        } else {
            st = PERR(ps, "unexpected character '%c'", c);
        }
        if (!st) st = parse_postfix(ps, &x, &ps->rules[rid].alts[alt_index]);
        free(x.v);
        if (st) return st;
    }
}

static bt_status parse_alternatives(parser *ps, int32_t rid)
{
    while (1) {
        vec32 *alt = rule_add_alt(ps, rid);
        if (!alt) return ps->err;
        if (parse_sequence(ps, alt, rid)) return ps->err;
        skip_space(ps);
        if (ps->p < ps->end && *ps->p == '|') {
            ps->p++;
            continue;
        }
        return BT_OK;
    }
}

static bt_status parse_rules(parser *ps)
{
    skip_space(ps);
    if (ps->p >= ps->end) return PERR(ps, "empty grammar");
    while (ps->p < ps->end) {
        size_t n = name_len(ps, ps->p);
        if (!n) return PERR(ps, "expected a rule name");
        if (!at_rule_def(ps, ps->p)) return PERR(ps, "expected '::=' after the rule name");
        int32_t rid = rule_find(ps, ps->p, n);
        if (rid < 0) return ps->err;
        if (ps->rules[rid].defined) return PERR(ps, "rule '%s' is defined twice", ps->rules[rid].name);
        ps->rules[rid].defined = 1;
        ps->p += n;
        skip_space(ps);
        ps->p += 3;
        if (parse_alternatives(ps, rid)) return ps->err;
        skip_space(ps);
        if (ps->p < ps->end && *ps->p == ')') return PERR(ps, "unbalanced ')'");
    }
    return BT_OK;
}

/* Rejects left recursion: a rule reachable from itself through the leading, possibly nullable, references of its
 * alternatives would make the recognizer expand forever. */
static bt_status check_left_recursion(parser *ps)
{
    uint32_t n = ps->n_rules;
    uint8_t *nullable = calloc(n, 1), *color = calloc(n, 1);
    uint32_t *stack = malloc(sizeof *stack * (n + 1) * 2);
    bt_status st = BT_OK;
    if (!nullable || !color || !stack) {
        st = nomem(ps);
        goto out;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (uint32_t r = 0; r < n; r++) {
            if (nullable[r]) continue;
            for (uint32_t a = 0; a < ps->rules[r].n_alts && !nullable[r]; a++) {
                const vec32 *alt = &ps->rules[r].alts[a];
                uint32_t i = 0;
                while (i < alt->n && E_KIND(alt->v[i]) == E_REF && nullable[E_ARG(alt->v[i])]) i++;
                if (i == alt->n) nullable[r] = changed = 1;
            }
        }
    }
    /* iterative DFS over "r may start with s" edges; color 1 = on the path, 2 = done */
    for (uint32_t root = 0; root < n && !st; root++) {
        if (color[root]) continue;
        uint32_t sp = 0;
        stack[sp++] = root;
        stack[sp++] = 0; /* position: alternative * 2^16 + element, flattened below as an edge index */
        color[root] = 1;
        while (sp && !st) {
            uint32_t r = stack[sp - 2], e = stack[sp - 1];
            /* enumerate leading refs of r as a flat edge index */
            uint32_t idx = 0, next = UINT32_MAX;
            for (uint32_t a = 0; a < ps->rules[r].n_alts && next == UINT32_MAX; a++) {
                const vec32 *alt = &ps->rules[r].alts[a];
                for (uint32_t i = 0; i < alt->n && E_KIND(alt->v[i]) == E_REF; i++) {
                    if (idx++ == e) {
                        next = E_ARG(alt->v[i]);
                        break;
                    }
                    if (!nullable[E_ARG(alt->v[i])]) break;
                }
            }
            if (next == UINT32_MAX) {
                color[r] = 2;
                sp -= 2;
                continue;
            }
            stack[sp - 1] = e + 1;
            if (color[next] == 1) {
                uint32_t named = next;
                for (uint32_t k = 0; k < sp && !ps->rules[named].name; k += 2)
                    if (ps->rules[stack[k]].name) named = stack[k];
                st = perr_at(ps, ps->rules[next].first_use, "rule '%s' is left-recursive (it can reach itself "
                             "before consuming a byte); rewrite it with repetition",
                             ps->rules[named].name ? ps->rules[named].name : "(anonymous)");
            } else if (!color[next]) {
                color[next] = 1;
                stack[sp++] = next;
                stack[sp++] = 0;
            }
        }
    }
out:
    free(nullable);
    free(color);
    free(stack);
    return st;
}

static void parser_free(parser *ps)
{
    for (uint32_t i = 0; i < ps->n_rules; i++) {
        for (uint32_t a = 0; a < ps->rules[i].n_alts; a++) free(ps->rules[i].alts[a].v);
        free(ps->rules[i].alts);
        free(ps->rules[i].name);
    }
    free(ps->rules);
    free(ps->sets);
}

static bt_status compile(parser *ps, bt_grammar *g)
{
    uint64_t n_alts = 0, n_elems = 0;
    for (uint32_t r = 0; r < ps->n_rules; r++) {
        n_alts += ps->rules[r].n_alts;
        for (uint32_t a = 0; a < ps->rules[r].n_alts; a++) n_elems += ps->rules[r].alts[a].n + 1;
    }
    g->elems = malloc(sizeof *g->elems * (n_elems + 1));
    g->alt_start = malloc(sizeof *g->alt_start * (n_alts + 1));
    g->rule_alt = malloc(sizeof *g->rule_alt * (ps->n_rules + 1));
    g->sets = malloc(sizeof *g->sets * (ps->n_sets + 1));
    if (!g->elems || !g->alt_start || !g->rule_alt || !g->sets) return nomem(ps);
    uint32_t ne = 0, na = 0;
    for (uint32_t r = 0; r < ps->n_rules; r++) {
        g->rule_alt[r] = na;
        for (uint32_t a = 0; a < ps->rules[r].n_alts; a++) {
            const vec32 *alt = &ps->rules[r].alts[a];
            g->alt_start[na++] = ne;
            if (alt->n) memcpy(g->elems + ne, alt->v, sizeof *alt->v * alt->n);
            ne += alt->n;
            g->elems[ne++] = E_MAKE(E_END, 0);
        }
    }
    g->rule_alt[ps->n_rules] = na;
    g->n_elems = ne;
    if (ps->n_sets) memcpy(g->sets, ps->sets, sizeof *g->sets * ps->n_sets);
    g->n_sets = ps->n_sets;
    g->n_rules = (int32_t)ps->n_rules;
    return BT_OK;
}

bt_status bt_grammar_parse(const char *text, size_t len, bt_grammar **out)
{
    if (len > BT_GRAMMAR_MAX_TEXT)
        return bt_fail(BT_ERR_INVALID, "grammar: text of %zu bytes exceeds the limit of %u", len,
                       BT_GRAMMAR_MAX_TEXT);
    parser ps = {.s = text, .p = text, .end = text + len};
    bt_grammar *g = calloc(1, sizeof *g);
    if (!g) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    bt_status st = parse_rules(&ps);
    for (uint32_t r = 0; !st && r < ps.n_rules; r++)
        if (!ps.rules[r].defined)
            st = perr_at(&ps, ps.rules[r].first_use, "rule '%s' is used but never defined", ps.rules[r].name);
    g->root = -1;
    for (uint32_t r = 0; !st && r < ps.n_rules; r++)
        if (ps.rules[r].name && !strcmp(ps.rules[r].name, "root")) g->root = (int32_t)r;
    if (!st && g->root < 0) st = bt_fail(BT_ERR_INVALID, "grammar: no 'root' rule");
    if (!st) st = check_left_recursion(&ps);
    if (!st) st = compile(&ps, g);
    parser_free(&ps);
    if (st) {
        bt_grammar_free(g);
        return st;
    }
    *out = g;
    return BT_OK;
}

void bt_grammar_free(bt_grammar *g)
{
    if (!g) return;
    free(g->elems);
    free(g->sets);
    free(g->rule_alt);
    free(g->alt_start);
    free(g);
}

int32_t bt_grammar_n_rules(const bt_grammar *g) { return g->n_rules; }

/* ---- matching ---- */

static int grow(uint32_t **v, uint32_t *cap, uint32_t need)
{
    if (need <= *cap) return 0;
    uint32_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    uint32_t *nv = realloc(*v, sizeof *nv * c);
    if (!nv) return -1;
    *v = nv;
    *cap = c;
    return 0;
}

static void state_clear(bt_gstate *st)
{
    st->cost = 0;
    st->n = 0;
    st->n_stacks = 0;
    st->accepting = 0;
    st->overflow = 0;
    st->next[0] = st->next[1] = st->next[2] = st->next[3] = 0;
}

/* Adds frames[d] to st unless the same stack is there. Its top is E_BYTES, or d == 0 (accepting). */
static int state_add(const bt_grammar *g, bt_gstate *st, const uint32_t *frames, uint32_t d)
{
    for (uint32_t off = 0; off < st->n; off += 1 + st->w[off]) {
        st->cost++;
        if (st->w[off] == d && !memcmp(st->w + off + 1, frames, sizeof *frames * d)) return 0;
    }
    if (st->n_stacks >= BT_GRAMMAR_MAX_STACKS) {
        st->overflow = 1;
        return 0;
    }
    if (grow(&st->w, &st->cap, st->n + 1 + d)) return -1;
    st->w[st->n] = d;
    memcpy(st->w + st->n + 1, frames, sizeof *frames * d);
    st->n += 1 + d;
    st->n_stacks++;
    if (d == 0) {
        st->accepting = 1;
    } else {
        const byteset *bs = &g->sets[E_ARG(g->elems[frames[d - 1]])];
        for (int i = 0; i < 4; i++) st->next[i] |= bs->b[i];
    }
    return 0;
}

/* Expands every stack queued in st->work (entries: frames bottom to top, then the frame count) until its top is a
 * byte set or it is empty, adding the results to st. The stack being expanded lives in st->cur. */
static int expand_work(const bt_grammar *g, bt_gstate *st)
{
    uint32_t budget = BT_GRAMMAR_MAX_EXPAND;
    while (st->n_work) {
        uint32_t d = st->work[st->n_work - 1];
        uint32_t base = st->n_work - 1 - d;
        if (grow(&st->cur, &st->cap_cur, d + 1)) return -1;
        memcpy(st->cur, st->work + base, sizeof *st->cur * d);
        st->n_work = base;
        while (1) {
            uint32_t *f = st->cur;
            if (d == 0) {
                if (state_add(g, st, f, 0)) return -1;
                break;
            }
            uint32_t e = g->elems[f[d - 1]];
            if (E_KIND(e) == E_END) {
                d--;
                continue;
            }
            if (E_KIND(e) == E_BYTES) {
                if (state_add(g, st, f, d)) return -1;
                break;
            }
            if (!budget--) {
                st->overflow = 1;
                break;
            }
            st->cost++;
            uint32_t rule = E_ARG(e), next = f[d - 1] + 1;
            if (E_KIND(g->elems[next]) == E_END) d--; /* tail call: this frame has nothing left */
            else f[d - 1] = next;
            uint32_t a0 = g->rule_alt[rule], a1 = g->rule_alt[rule + 1];
            if (a0 == a1) break; /* a rule without alternatives matches nothing */
            if (d + 1 > BT_GRAMMAR_MAX_DEPTH) {
                st->overflow = 1;
                break;
            }
            for (uint32_t a = a0 + 1; a < a1; a++) {
                uint32_t at = st->n_work;
                if (grow(&st->work, &st->cap_work, at + d + 2)) return -1;
                memcpy(st->work + at, f, sizeof *f * d);
                st->work[at + d] = g->alt_start[a];
                st->work[at + d + 1] = d + 1;
                st->n_work = at + d + 2;
            }
            if (grow(&st->cur, &st->cap_cur, d + 1)) return -1;
            st->cur[d++] = g->alt_start[a0];
        }
    }
    return 0;
}

static int queue_stack(bt_gstate *st, const uint32_t *frames, uint32_t d)
{
    if (grow(&st->work, &st->cap_work, st->n_work + d + 1)) return -1;
    memcpy(st->work + st->n_work, frames, sizeof *frames * d);
    st->work[st->n_work + d] = d;
    st->n_work += d + 1;
    return 0;
}

bt_status bt_grammar_start(const bt_grammar *g, bt_gstate *dst)
{
    state_clear(dst);
    dst->n_work = 0;
    for (uint32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1]; a++) {
        uint32_t f = g->alt_start[a];
        if (queue_stack(dst, &f, 1)) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    }
    if (expand_work(g, dst)) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    return BT_OK;
}

int bt_grammar_step(const bt_grammar *g, const bt_gstate *src, uint8_t byte, bt_gstate *dst)
{
    state_clear(dst);
    dst->overflow = src->overflow;
    dst->n_work = 0;
    if (!bt_gstate_can(src, byte)) return 0;
    for (uint32_t off = 0; off < src->n; off += 1 + src->w[off]) {
        uint32_t d = src->w[off];
        if (!d) continue;
        const uint32_t *f = src->w + off + 1;
        const byteset *bs = &g->sets[E_ARG(g->elems[f[d - 1]])];
        if (!((bs->b[byte >> 6] >> (byte & 63)) & 1)) continue;
        if (queue_stack(dst, f, d)) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
        dst->work[dst->n_work - 2]++; /* the top frame moves past the byte */
    }
    if (expand_work(g, dst)) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    return dst->n_stacks > 0;
}

static void state_swap(bt_gstate *a, bt_gstate *b)
{
    bt_gstate t = *a;
    *a = *b;
    *b = t;
}

int bt_grammar_advance(const bt_grammar *g, bt_gstate *st, const uint8_t *bytes, size_t n, bt_gstate *tmp)
{
    if (n == 0) return 1;
    bt_gstate cur = {0};
    int r = bt_grammar_step(g, st, bytes[0], tmp);
    if (r <= 0) return r;
    for (size_t i = 1; i < n; i++) {
        r = bt_grammar_step(g, tmp, bytes[i], &cur);
        if (r <= 0) {
            bt_gstate_free(&cur);
            return r;
        }
        state_swap(tmp, &cur);
    }
    bt_gstate_free(&cur);
    state_swap(st, tmp);
    return 1;
}

typedef struct stack_ref {
    const uint32_t *p; /* frame count then frames */
} stack_ref;

static int stack_cmp(const void *a, const void *b)
{
    const uint32_t *x = ((const stack_ref *)a)->p, *y = ((const stack_ref *)b)->p;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    for (uint32_t i = 1; i <= x[0]; i++)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}

bt_status bt_gstate_canon(bt_gstate *st)
{
    if (st->n_stacks < 2) return BT_OK;
    stack_ref *r = malloc(sizeof *r * st->n_stacks);
    uint32_t *w = malloc(sizeof *w * (st->n ? st->n : 1));
    if (!r || !w) {
        free(r);
        free(w);
        return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    }
    uint32_t k = 0;
    for (uint32_t off = 0; off < st->n; off += 1 + st->w[off]) r[k++].p = st->w + off;
    qsort(r, k, sizeof *r, stack_cmp);
    uint32_t n = 0;
    for (uint32_t i = 0; i < k; i++) {
        memcpy(w + n, r[i].p, sizeof *w * (1 + r[i].p[0]));
        n += 1 + r[i].p[0];
    }
    memcpy(st->w, w, sizeof *w * n);
    free(r);
    free(w);
    return BT_OK;
}

bt_status bt_gstate_copy(bt_gstate *dst, const bt_gstate *src)
{
    if (grow(&dst->w, &dst->cap, src->n)) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    if (src->n) memcpy(dst->w, src->w, sizeof *dst->w * src->n);
    dst->n = src->n;
    dst->n_stacks = src->n_stacks;
    dst->accepting = src->accepting;
    dst->overflow = src->overflow;
    memcpy(dst->next, src->next, sizeof dst->next);
    return BT_OK;
}

bt_status bt_gstate_load(const bt_grammar *g, bt_gstate *dst, const uint32_t *w, uint32_t n)
{
    state_clear(dst);
    for (uint32_t off = 0; off < n; off += 1 + w[off])
        if (state_add(g, dst, w + off + 1, w[off])) return bt_fail(BT_ERR_NOMEM, "grammar: out of memory");
    return BT_OK;
}

void bt_gstate_free(bt_gstate *st)
{
    free(st->w);
    free(st->work);
    free(st->cur);
    memset(st, 0, sizeof *st);
}
