#include "router/json_schema.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "engine/grammar.h"

/* Room for element n of the array at *arrp (the address of a T *, *cap elements of elem bytes): when it is full,
 * realloc'd to twice its capacity (min when empty). -1 on overflow or out of memory, leaving the array and *cap
 * as they were. The pointer moves by memcpy so that any T * can be passed without breaking aliasing rules. */
static int grow(void *arrp, int n, int *cap, size_t elem, int min)
{
    if (n < *cap) return 0;
    if (*cap > INT_MAX / 2) return -1;
    int ncap = *cap ? *cap * 2 : min;
    if ((size_t)ncap > SIZE_MAX / elem) return -1;
    void *old, *arr;
    memcpy(&old, arrp, sizeof old);
    if (!(arr = realloc(old, elem * (size_t)ncap))) return -1;
    memcpy(arrp, &arr, sizeof arr);
    *cap = ncap;
    return 0;
}

__attribute__((format(printf, 2, 3))) static void sb_printf(bt_strbuf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        bt_strbuf_put(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1); /* a long property name: never cut mid-escape */
    if (!big) {
        b->oom = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    bt_strbuf_put(b, big, (size_t)n);
    free(big);
}

/* A GBNF literal for the bytes s[n]: quotes and backslashes escaped, control and non-ASCII bytes as \xHH (exact
 * bytes even when a client's JSON string holds invalid UTF-8). */
static void sb_literal(bt_strbuf *b, const char *s, size_t n)
{
    bt_strbuf_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            bt_strbuf_put(b, e, 2);
        } else if (c < 0x20 || c >= 0x7F) {
            sb_printf(b, "\\x%02X", c);
        } else {
            bt_strbuf_put(b, (const char *)&c, 1);
        }
    }
    bt_strbuf_puts(b, "\"");
}

/* Shared rules: bounded whitespace (a model must not loop on spaces), JSON strings without surrogate escapes (so
 * lengths count code points as validators do), numbers, and any JSON value. */
static const char *BASE_RULES =
    "ws ::= [ \\t\\n]{0,4}\n"
    "jchar ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" ( [0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | [dD] [0-7] "
    "[0-9a-fA-F]{2} ) )\n"
    "jstr ::= \"\\\"\" jchar* \"\\\"\"\n"
    "jint ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
    "jnum ::= jint ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?\n"
    "jval ::= jobj | jarr | jstr | jnum | \"true\" | \"false\" | \"null\"\n"
    "jobj ::= \"{\" ws ( jstr ws \":\" ws jval ws ( \",\" ws jstr ws \":\" ws jval ws )* )? \"}\"\n"
    "jarr ::= \"[\" ws ( jval ws ( \",\" ws jval ws )* )? \"]\"\n";

typedef struct memo {
    const cJSON *node;
    int id;
} memo;

typedef struct gen {
    const cJSON *root;
    bt_strbuf rules;
    int n_rules;
    memo *memo;
    int n_memo, cap_memo;
    int depth;
    bt_status err;
} gen;

#define MAX_SCHEMA_DEPTH 64
#define MAX_COUNT 1000 /* minItems/maxItems/minLength/maxLength the grammar spells out */

__attribute__((format(printf, 3, 4))) static bt_status fail(gen *g, bt_status st, const char *fmt, ...)
{
    if (g->err) return g->err;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    g->err = bt_fail(st, "%s", msg);
    return g->err;
}

static int schema_rule(gen *g, const cJSON *s);

static const char *const ANNOTATIONS[] = {"title", "description", "default", "examples", "$schema", "$id",
                                          "$comment", "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
                                          "strict", NULL};
static const char *const SUPPORTED[] = {"type", "properties", "required", "additionalProperties", "items",
                                        "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern",
                                        "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                        "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "uniqueItems",
                                        "multipleOf", NULL};

static int in_list(const char *const *list, const char *k)
{
    for (int i = 0; list[i]; i++)
        if (!strcmp(list[i], k)) return 1;
    return 0;
}

static bt_status check_keywords(gen *g, const cJSON *s)
{
    for (const cJSON *k = s->child; k; k = k->next)
        if (!in_list(ANNOTATIONS, k->string) && !in_list(SUPPORTED, k->string))
            return fail(g, BT_ERR_UNSUPPORTED, "JSON schema keyword '%.60s' is not supported", k->string);
    return BT_OK;
}

static const cJSON *kw(const cJSON *s, const char *name) { return cJSON_GetObjectItemCaseSensitive(s, name); }

/* Reads a non-negative count keyword (absent: *v = dflt). */
static bt_status get_count(gen *g, const cJSON *s, const char *name, long dflt, long *v)
{
    const cJSON *k = kw(s, name);
    *v = dflt;
    if (!k) return BT_OK;
    if (!cJSON_IsNumber(k) || k->valuedouble < 0 || k->valuedouble != floor(k->valuedouble))
        return fail(g, BT_ERR_INVALID, "JSON schema '%s' must be a non-negative integer", name);
    if (k->valuedouble > MAX_COUNT)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%s' above %d is not supported", name, MAX_COUNT);
    *v = (long)k->valuedouble;
    return BT_OK;
}

/* ---- integers as digit ranges ---- */

#define INF_U64 UINT64_MAX

static int ndigits(uint64_t x)
{
    int n = 1;
    while (x >= 10) {
        x /= 10;
        n++;
    }
    return n;
}

static uint64_t pow10u(int n)
{
    uint64_t p = 1;
    while (n-- > 0) p *= 10;
    return p;
}

/* Same-length digit strings x <= y: alternatives matching exactly the numbers between them. */
static void same_len(bt_strbuf *b, const char *x, const char *y, int n)
{
    if (n == 1) {
        sb_printf(b, "[%c-%c]", x[0], y[0]);
        return;
    }
    if (x[0] == y[0]) {
        sb_printf(b, "\"%c\" ", x[0]);
        same_len(b, x + 1, y + 1, n - 1);
        return;
    }
    int x_low = 1, y_high = 1;
    for (int i = 1; i < n; i++) {
        x_low &= x[i] == '0';
        y_high &= y[i] == '9';
    }
    if (x_low && y_high) {
        sb_printf(b, "[%c-%c] [0-9]{%d}", x[0], y[0], n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    sb_printf(b, "( \"%c\" ( ", x[0]);
    same_len(b, x + 1, nines, n - 1);
    bt_strbuf_puts(b, " )");
    if (x[0] + 1 <= y[0] - 1) sb_printf(b, " | [%c-%c] [0-9]{%d}", x[0] + 1, y[0] - 1, n - 1);
    sb_printf(b, " | \"%c\" ( ", y[0]);
    same_len(b, zeros, y + 1, n - 1);
    bt_strbuf_puts(b, " ) )");
}

/* Non-negative integers in [a, c] without leading zeros (c = INF_U64: no upper bound). */
static void nonneg_range(bt_strbuf *b, uint64_t a, uint64_t c)
{
    int la = ndigits(a), lc = c == INF_U64 ? la : ndigits(c);
    bt_strbuf_puts(b, "( ");
    for (int L = la; L <= lc; L++) {
        uint64_t lo = L == 1 ? 0 : pow10u(L - 1), hi = pow10u(L) - 1;
        if (lo < a) lo = a;
        if (c != INF_U64 && hi > c) hi = c;
        char xs[24], ys[24];
        snprintf(xs, sizeof xs, "%llu", (unsigned long long)lo);
        snprintf(ys, sizeof ys, "%llu", (unsigned long long)hi);
        if (L > la) bt_strbuf_puts(b, " | ");
        bt_strbuf_puts(b, "( ");
        same_len(b, xs, ys, L);
        bt_strbuf_puts(b, " )");
    }
    if (c == INF_U64) sb_printf(b, " | [1-9] [0-9]{%d,}", la);
    bt_strbuf_puts(b, " )");
}

/* Integers in [lo, hi]; has_* = 0 for an open end. */
static void int_range(bt_strbuf *b, int has_lo, int64_t lo, int has_hi, int64_t hi)
{
    int neg = !has_lo || lo <= -1, pos = !has_hi || hi >= 0;
    uint64_t nlo = has_hi && hi < 0 ? (uint64_t)(-hi) : 1, nhi = has_lo ? (uint64_t)(-lo) : INF_U64;
    if (neg && nhi != INF_U64 && nlo > nhi) neg = 0;
    uint64_t plo = has_lo && lo > 0 ? (uint64_t)lo : 0, phi = has_hi ? (uint64_t)hi : INF_U64;
    if (pos && phi != INF_U64 && plo > phi) pos = 0;
    bt_strbuf_puts(b, "( ");
    if (neg) {
        bt_strbuf_puts(b, "\"-\" ");
        nonneg_range(b, nlo, nhi);
    }
    if (neg && pos) bt_strbuf_puts(b, " | ");
    if (pos) nonneg_range(b, plo, phi);
    if (!neg && !pos) bt_strbuf_puts(b, "[^\\x00-\\U0010FFFF]"); /* empty: matches nothing */
    bt_strbuf_puts(b, " )");
}

/* Reads a numeric bound as an integer-valued double. */
static bt_status get_bound(gen *g, const cJSON *s, const char *name, int *has, double *v)
{
    const cJSON *k = kw(s, name);
    *has = 0;
    if (!k) return BT_OK;
    if (cJSON_IsBool(k))
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%s' as a boolean (draft 4) is not supported", name);
    if (!cJSON_IsNumber(k)) return fail(g, BT_ERR_INVALID, "JSON schema '%s' must be a number", name);
    if (fabs(k->valuedouble) > 1e15)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%s' beyond 1e15 is not supported", name);
    *has = 1;
    *v = k->valuedouble;
    return BT_OK;
}

/* The four numeric bounds of a schema; has* says which are given. */
typedef struct bounds {
    int hmin, hmax, hxmin, hxmax;
    double vmin, vmax, vxmin, vxmax;
} bounds;

static bt_status read_bounds(gen *g, const cJSON *s, bounds *o)
{
    memset(o, 0, sizeof *o);
    if (get_bound(g, s, "minimum", &o->hmin, &o->vmin) || get_bound(g, s, "maximum", &o->hmax, &o->vmax) ||
        get_bound(g, s, "exclusiveMinimum", &o->hxmin, &o->vxmin) ||
        get_bound(g, s, "exclusiveMaximum", &o->hxmax, &o->vxmax))
        return g->err;
    return BT_OK;
}

static bt_status gen_integer(gen *g, const cJSON *s, bt_strbuf *b)
{
    bounds bd;
    if (read_bounds(g, s, &bd)) return g->err;
    int hmin = bd.hmin, hmax = bd.hmax, hxmin = bd.hxmin, hxmax = bd.hxmax;
    double vmin = bd.vmin, vmax = bd.vmax, vxmin = bd.vxmin, vxmax = bd.vxmax;
    const cJSON *mo = kw(s, "multipleOf");
    if (mo && !(cJSON_IsNumber(mo) && mo->valuedouble == 1.0))
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema keyword 'multipleOf' is not supported");
    int has_lo = hmin || hxmin, has_hi = hmax || hxmax;
    int64_t lo = INT64_MIN, hi = INT64_MAX;
    if (hmin) lo = (int64_t)ceil(vmin);
    if (hxmin && (int64_t)floor(vxmin) + 1 > lo) lo = (int64_t)floor(vxmin) + 1;
    if (hmax) hi = (int64_t)floor(vmax);
    if (hxmax && (int64_t)ceil(vxmax) - 1 < hi) hi = (int64_t)ceil(vxmax) - 1;
    if (!has_lo && !has_hi) {
        bt_strbuf_puts(b, "jint");
        return BT_OK;
    }
    if (has_lo && has_hi && lo > hi)
        return fail(g, BT_ERR_INVALID, "JSON schema integer bounds leave no value (minimum %lld > maximum %lld)",
                    (long long)lo, (long long)hi);
    int_range(b, has_lo, lo, has_hi, hi);
    return BT_OK;
}

/* ---- numbers between decimal bounds ----
 * A bounded number is written without exponent, with at most 15 significant digits in all (integer digits plus
 * fraction digits), and each bound is the shortest decimal that reads back as the schema's double, which must have
 * at most 15 significant digits too. Decimals of at most 15 significant digits read back as distinct doubles in the
 * same order (DBL_DIG), so comparing the decimal strings, which the grammar does digit by digit, is comparing what
 * a validator compares: every number the grammar allows validates, and near a bound nothing valid of up to that
 * many digits is left out. */

#define NUM_SIG_DIGITS 15
#define NUM_MIN_FRACTION 6 /* fraction digits allowed where the bounds need fewer */

typedef struct dbound {
    int on, strict, neg;
    uint64_t iv;   /* integer part */
    char fp[24];   /* fraction digits, trailing zeros stripped ("" = none) */
} dbound;

/* One side of a fraction comparison still open: 0.phi against 0.d (d: the rest of a bound's fraction digits). */
typedef struct fside {
    int on, strict;
    const char *d;
} fside;

/* Alternatives for the non-empty digit strings phi of at most r digits with lo <= 0.phi <= hi (either side strict,
 * or off), written to b joined by " | "; returns whether there is one. *eps: whether the empty fraction qualifies. */
static int frac_alts(bt_strbuf *b, fside lo, fside hi, int r, int *eps)
{
    *eps = (!lo.on || (!*lo.d && !lo.strict)) && (!hi.on || !hi.strict || *hi.d);
    if (r <= 0) return 0;
    if (!lo.on && !hi.on) {
        sb_printf(b, "[0-9]{1,%d}", r);
        return 1;
    }
    int any = 0;
    char free_digits[11];
    int n_free = 0;
    for (int d = 0; d <= 9; d++) {
        fside nl = {0, 0, ""}, nh = {0, 0, ""};
        int ok = 1;
        if (lo.on) {
            int c = *lo.d ? lo.d[0] - '0' : 0;
            if (!*lo.d) nl = lo.strict && d == 0 ? lo : nl; /* 0.phi > 0: still waiting for a non-zero digit */
            else if (d == c) nl = (fside){1, lo.strict, lo.d + 1};
            else if (d < c) ok = 0;
        }
        if (hi.on) {
            int c = *hi.d ? hi.d[0] - '0' : 0;
            if (!*hi.d) { /* 0.phi <= 0: zeros only; < 0: nothing */
                if (hi.strict || d != 0) ok = 0;
                else nh = hi;
            } else if (d == c) {
                nh = (fside){1, hi.strict, hi.d + 1};
            } else if (d > c) {
                ok = 0;
            }
        }
        if (!ok) continue;
        if (!nl.on && !nh.on) {
            free_digits[n_free++] = (char)('0' + d);
            continue;
        }
        bt_strbuf sub = {0};
        int sub_eps;
        int sub_any = frac_alts(&sub, nl, nh, r - 1, &sub_eps);
        if (sub_any || sub_eps) {
            if (any++) bt_strbuf_puts(b, " | ");
            sb_printf(b, "\"%c\"", '0' + d);
            if (sub_any) {
                sb_printf(b, " ( %s )%s", sub.p ? sub.p : "", sub_eps ? "?" : "");
            }
        }
        if (sub.oom) b->oom = 1;
        free(sub.p);
    }
    if (n_free) {
        if (any++) bt_strbuf_puts(b, " | ");
        free_digits[n_free] = 0;
        sb_printf(b, "[%s] [0-9]{0,%d}", free_digits, r - 1);
    }
    return any > 0;
}

/* The fraction part ("." and digits, or nothing) of the alternatives above into b; 0 when there is no fraction at
 * all that qualifies (not even none). */
static int frac_part(bt_strbuf *b, fside lo, fside hi, int r)
{
    bt_strbuf alts = {0};
    int eps, any = frac_alts(&alts, lo, hi, r, &eps);
    if (alts.oom) b->oom = 1;
    if (any) sb_printf(b, " ( \".\" ( %s ) )%s", alts.p ? alts.p : "", eps ? "?" : "");
    free(alts.p);
    return any || eps;
}

/* Magnitudes m (digits, no sign) with A <= m <= B (A on; B off: integer part at most int_cap), fractions of at most
 * F digits, as alternatives into b; returns whether there is one. */
static int magnitude_alts(bt_strbuf *b, const dbound *A, const dbound *B, int F, uint64_t int_cap)
{
    uint64_t a = A->iv, hi_int = B->on ? B->iv : int_cap;
    fside flo = {1, A->strict, A->fp}, fhi = {B->on, B->strict, B->fp}, off = {0, 0, ""};
    int any = 0;
    bt_strbuf alt = {0};
    if (a > hi_int) return 0;
    if (a == hi_int && B->on) {
        sb_printf(&alt, "\"%llu\"", (unsigned long long)a);
        if (frac_part(&alt, flo, fhi, F) && alt.p) {
            bt_strbuf_puts(b, alt.p);
            any = 1;
        }
        if (alt.oom) b->oom = 1;
        free(alt.p);
        return any;
    }
    sb_printf(&alt, "\"%llu\"", (unsigned long long)a);
    if (frac_part(&alt, flo, off, F)) {
        bt_strbuf_puts(b, alt.p);
        any = 1;
    }
    free(alt.p);
    uint64_t mid_hi = B->on ? hi_int - 1 : hi_int;
    if (a + 1 <= mid_hi) {
        if (any++) bt_strbuf_puts(b, " | ");
        nonneg_range(b, a + 1, mid_hi);
        sb_printf(b, " ( \".\" [0-9]{1,%d} )?", F);
    }
    if (B->on) {
        alt = (bt_strbuf){0};
        sb_printf(&alt, "\"%llu\"", (unsigned long long)hi_int);
        if (frac_part(&alt, off, fhi, F)) {
            if (any++) bt_strbuf_puts(b, " | ");
            bt_strbuf_puts(b, alt.p);
        }
        free(alt.p);
    }
    return any;
}

/* A numeric bound as the shortest decimal that reads back as its double. BT_ERR_UNSUPPORTED past 15 significant
 * digits. */
static bt_status to_dbound(gen *g, const char *name, double v, int strict, dbound *o)
{
    char buf[48];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (p > NUM_SIG_DIGITS)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%s' %.17g: a number bound of more than %d significant "
                    "digits is not supported", name, v, NUM_SIG_DIGITS);
    char digits[24];
    int nd = 0, e;
    const char *q = buf;
    memset(o, 0, sizeof *o);
    o->on = 1;
    o->strict = strict;
    if (*q == '-') {
        o->neg = 1;
        q++;
    }
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') digits[nd++] = *q;
    e = *q == 'e' ? atoi(q + 1) : 0;
    digits[nd] = 0;
    int point = e + 1; /* digits before the decimal point */
    char ip[64] = "0";
    if (point > 24 || -point + nd >= (int)sizeof o->fp)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%s' %.17g: a number bound of more than %d significant "
                    "digits is not supported", name, v, NUM_SIG_DIGITS);
    if (point >= nd) { /* digits then zeros */
        memcpy(ip, digits, (size_t)nd);
        memset(ip + nd, '0', (size_t)(point - nd));
        ip[point] = 0;
    } else if (point > 0) {
        memcpy(ip, digits, (size_t)point);
        ip[point] = 0;
        memcpy(o->fp, digits + point, (size_t)(nd - point) + 1);
    } else { /* zeros then digits */
        memset(o->fp, '0', (size_t)-point);
        memcpy(o->fp - point, digits, (size_t)nd + 1);
    }
    size_t fl = strlen(o->fp);
    while (fl && o->fp[fl - 1] == '0') o->fp[--fl] = 0;
    o->iv = strtoull(ip, NULL, 10);
    if (o->iv == 0 && !fl) o->neg = 0; /* -0 is 0 */
    return BT_OK;
}

static bt_status gen_number(gen *g, const cJSON *s, bt_strbuf *b)
{
    bounds bd;
    if (read_bounds(g, s, &bd)) return g->err;
    const cJSON *mo = kw(s, "multipleOf");
    if (mo) {
        if (cJSON_IsNumber(mo) && mo->valuedouble == 1.0) return gen_integer(g, s, b);
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema keyword 'multipleOf' is not supported");
    }
    if (!bd.hmin && !bd.hmax && !bd.hxmin && !bd.hxmax) {
        bt_strbuf_puts(b, "jnum");
        return BT_OK;
    }
    /* the tighter bound of each side (an exclusive one wins a tie) */
    dbound L = {0}, U = {0};
    const char *lname = NULL, *uname = NULL;
    int lx = bd.hxmin && (!bd.hmin || bd.vxmin >= bd.vmin), ux = bd.hxmax && (!bd.hmax || bd.vxmax <= bd.vmax);
    if (bd.hmin || bd.hxmin) {
        lname = lx ? "exclusiveMinimum" : "minimum";
        if (to_dbound(g, lname, lx ? bd.vxmin : bd.vmin, lx, &L)) return g->err;
    }
    if (bd.hmax || bd.hxmax) {
        uname = ux ? "exclusiveMaximum" : "maximum";
        if (to_dbound(g, uname, ux ? bd.vxmax : bd.vmax, ux, &U)) return g->err;
    }
    double lv = lx ? bd.vxmin : bd.vmin, uv = ux ? bd.vxmax : bd.vmax;
    if (L.on && U.on && (lv > uv || (lv == uv && (L.strict || U.strict))))
        return fail(g, BT_ERR_INVALID, "JSON schema number bounds leave no value (%s %g, %s %g)", lname, lv, uname,
                    uv);
    /* fraction digits: what the bounds spell, at least NUM_MIN_FRACTION, within NUM_SIG_DIGITS with the integers */
    int f0 = (int)strlen(L.fp), ib = 1;
    if ((int)strlen(U.fp) > f0) f0 = (int)strlen(U.fp);
    if (L.on && ndigits(L.iv) > ib) ib = ndigits(L.iv);
    if (U.on && ndigits(U.iv) > ib) ib = ndigits(U.iv);
    int F = f0 > NUM_MIN_FRACTION ? f0 : NUM_MIN_FRACTION;
    if (ib + F > NUM_SIG_DIGITS) F = NUM_SIG_DIGITS - ib;
    if (F < f0 || F < 1)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema number bounds ('%s'%s%s%s) need more than %d significant "
                    "digits", lname ? lname : uname, lname && uname ? ", '" : "", lname && uname ? uname : "",
                    lname && uname ? "'" : "", NUM_SIG_DIGITS);
    uint64_t cap = pow10u(NUM_SIG_DIGITS - F) - 1; /* integer part on an open side */
    int lneg = L.on && L.neg, uneg = U.on && U.neg;
    int any = 0;
    bt_strbuf_puts(b, "( ");
    /* x >= 0: from max(L, 0) to U */
    if (!uneg) {
        dbound A = {1, 0, 0, 0, ""};
        if (L.on && !lneg) A = L;
        if (magnitude_alts(b, &A, &U, F, cap)) any = 1;
    }
    /* x < 0: "-" and a magnitude m > 0 from |U| (U < 0) to |L| (L < 0) */
    if (!L.on || lneg) {
        dbound A = {1, 1, 0, 0, ""}, B = {0};
        if (uneg) A = U;
        if (L.on) B = L;
        bt_strbuf neg = {0};
        if (magnitude_alts(&neg, &A, &B, F, cap) && neg.p) {
            if (any++) bt_strbuf_puts(b, " | ");
            sb_printf(b, "\"-\" ( %s )", neg.p);
        }
        if (neg.oom) b->oom = 1;
        free(neg.p);
    }
    if (!any) bt_strbuf_puts(b, "[^\\x00-\\U0010FFFF]"); /* empty: matches nothing */
    bt_strbuf_puts(b, " )");
    return BT_OK;
}

/* ---- regular expressions ---- */

typedef struct cpr {
    uint32_t lo, hi;
} cpr;

typedef struct rx {
    const char *p, *end, *start;
    int json;  /* inside a JSON string: characters are emitted JSON-escaped */
    int nest;
    bt_status err;
} rx;

__attribute__((format(printf, 2, 3))) static bt_status rx_fail(rx *r, const char *fmt, ...)
{
    if (r->err) return r->err;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->err = bt_fail(BT_ERR_INVALID, "regex at offset %d: %s", (int)(r->p - r->start), msg);
    return r->err;
}

static bt_status rx_unsupported(rx *r, const char *what)
{
    if (r->err) return r->err;
    r->err = bt_fail(BT_ERR_UNSUPPORTED, "regex feature %s (at offset %d) is not supported", what,
                     (int)(r->p - r->start));
    return r->err;
}

/* A counted repetition at r->p ('{'): {m}, {m,} or {m,n}, read past its '}' into *m, *n (n = -1: unbounded). On a
 * malformed one the error names the '{'. */
static bt_status rx_count(rx *r, long *m, long *n)
{
    const char *brace = r->p++;
    long x = 0, y;
    int digits = 0;
    while (r->p < r->end && *r->p >= '0' && *r->p <= '9' && x <= MAX_COUNT) {
        x = x * 10 + (*r->p++ - '0');
        digits++;
    }
    if (!digits) {
        r->p = brace;
        return rx_fail(r, "bad '{' quantifier");
    }
    y = x;
    if (r->p < r->end && *r->p == ',') {
        r->p++;
        y = -1;
        if (r->p < r->end && *r->p >= '0' && *r->p <= '9') {
            y = 0;
            while (r->p < r->end && *r->p >= '0' && *r->p <= '9' && y <= MAX_COUNT) y = y * 10 + (*r->p++ - '0');
        }
    }
    if (r->p >= r->end || *r->p != '}') return rx_fail(r, "bad '{' quantifier");
    r->p++;
    if (x > MAX_COUNT || y > MAX_COUNT) return rx_unsupported(r, "a repetition count above 1000");
    if (y >= 0 && y < x) return rx_fail(r, "{m,n} with n < m");
    *m = x;
    *n = y;
    return BT_OK;
}

/* One code point of the pattern (UTF-8), -1 at the end or on invalid UTF-8. */
static int32_t rx_cp(rx *r)
{
    if (r->p >= r->end) return -1;
    unsigned char c = (unsigned char)*r->p++;
    if (c < 0x80) return c;
    int n = c >= 0xF8 ? -1 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : -1;
    if (n < 0) return -1;
    uint32_t v = c & (0x3F >> n);
    for (int i = 0; i < n; i++) {
        if (r->p >= r->end || ((unsigned char)*r->p & 0xC0) != 0x80) return -1;
        v = (v << 6) | ((unsigned char)*r->p++ & 0x3F);
    }
    return v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF) ? -1 : (int32_t)v;
}

typedef struct cls {
    cpr *r;
    int n, cap;
    int oom;
} cls;

static void cls_add(cls *c, uint32_t lo, uint32_t hi)
{
    if (grow(&c->r, c->n, &c->cap, sizeof *c->r, 8)) {
        c->oom = 1;
        return;
    }
    c->r[c->n++] = (cpr){lo, hi};
}

static int cpr_cmp(const void *a, const void *b)
{
    const cpr *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sorted, merged, complemented when negate. */
static void cls_normalise(cls *c, int negate)
{
    qsort(c->r, (size_t)c->n, sizeof *c->r, cpr_cmp);
    int m = 0;
    for (int i = 0; i < c->n; i++) {
        if (m && c->r[i].lo <= c->r[m - 1].hi + 1) {
            if (c->r[i].hi > c->r[m - 1].hi) c->r[m - 1].hi = c->r[i].hi;
        } else {
            c->r[m++] = c->r[i];
        }
    }
    c->n = m;
    if (!negate) return;
    cls o = {0};
    uint32_t next = 0;
    for (int i = 0; i < c->n; i++) {
        if (c->r[i].lo > next) cls_add(&o, next, c->r[i].lo - 1);
        next = c->r[i].hi + 1;
    }
    if (next <= 0x10FFFF) cls_add(&o, next, 0x10FFFF);
    free(c->r);
    *c = o;
}

static void sb_cp_escaped(bt_strbuf *b, uint32_t cp)
{
    if (cp < 0x10000) sb_printf(b, "\\u%04X", cp);
    else sb_printf(b, "\\U%08X", cp);
}

/* A character as a GBNF literal, JSON-escaped when r->json. */
static void emit_char(rx *r, bt_strbuf *b, uint32_t cp)
{
    if (r->json && (cp == '"' || cp == '\\' || cp < 0x20)) {
        static const char *const named[] = {[8] = "b", [9] = "t", [10] = "n", [12] = "f", [13] = "r"};
        bt_strbuf_puts(b, "\"\\\\");
        if (cp == '"') bt_strbuf_puts(b, "\\\"");
        else if (cp == '\\') bt_strbuf_puts(b, "\\\\");
        else if (cp < sizeof named / sizeof *named && named[cp]) bt_strbuf_puts(b, named[cp]);
        else sb_printf(b, "u00%02X", cp);
        bt_strbuf_puts(b, "\"");
        return;
    }
    bt_strbuf_puts(b, "\"");
    sb_cp_escaped(b, cp);
    bt_strbuf_puts(b, "\"");
}

/* A class as GBNF: one [...] of the characters that need no escape, plus alternatives for the ones that do. */
static void emit_class(rx *r, bt_strbuf *b, cls *c)
{
    bt_strbuf_puts(b, "( [");
    for (int i = 0; i < c->n; i++) {
        uint32_t lo = c->r[i].lo, hi = c->r[i].hi;
        /* split around the characters JSON must escape */
        uint32_t cut[][2] = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
        uint32_t segs[8][2];
        int ns = 0;
        segs[ns][0] = lo;
        segs[ns][1] = hi;
        ns = 1;
        if (r->json) {
            for (int k = 0; k < 3; k++) {
                int m = 0;
                uint32_t out[8][2];
                for (int j = 0; j < ns; j++) {
                    uint32_t a = segs[j][0], z = segs[j][1];
                    if (z < cut[k][0] || a > cut[k][1]) {
                        out[m][0] = a;
                        out[m++][1] = z;
                        continue;
                    }
                    if (a < cut[k][0]) {
                        out[m][0] = a;
                        out[m++][1] = cut[k][0] - 1;
                    }
                    if (z > cut[k][1]) {
                        out[m][0] = cut[k][1] + 1;
                        out[m++][1] = z;
                    }
                }
                memcpy(segs, out, sizeof out[0] * (size_t)m);
                ns = m;
            }
        }
        for (int j = 0; j < ns; j++) {
            sb_cp_escaped(b, segs[j][0]);
            if (segs[j][1] != segs[j][0]) {
                bt_strbuf_puts(b, "-");
                sb_cp_escaped(b, segs[j][1]);
            }
        }
    }
    if (!c->n || (r->json && c->n == 1 && c->r[0].hi < 0x20)) bt_strbuf_puts(b, "^\\x00-\\U0010FFFF"); /* nothing */
    bt_strbuf_puts(b, "]");
    if (r->json) {
        static const uint32_t special[] = {'"', '\\', '\n', '\t', '\r'};
        for (size_t k = 0; k < sizeof special / sizeof *special; k++)
            for (int i = 0; i < c->n; i++)
                if (c->r[i].lo <= special[k] && special[k] <= c->r[i].hi) {
                    bt_strbuf_puts(b, " | ");
                    emit_char(r, b, special[k]);
                    break;
                }
    }
    bt_strbuf_puts(b, " )");
}

/* \d \w \s and their negations into c; 0 when e is not one of them. */
static int shorthand(cls *c, int32_t e, int *negate)
{
    *negate = e == 'D' || e == 'W' || e == 'S';
    switch (e) {
    case 'd': case 'D': cls_add(c, '0', '9'); return 1;
    case 'w': case 'W':
        cls_add(c, '0', '9');
        cls_add(c, 'A', 'Z');
        cls_add(c, 'a', 'z');
        cls_add(c, '_', '_');
        return 1;
    case 's': case 'S':
        cls_add(c, ' ', ' ');
        cls_add(c, '\t', '\r');
        return 1;
    default: return 0;
    }
}

/* An escaped literal after '\' (not a shorthand), -1 after an error. */
static int32_t rx_escape(rx *r, int32_t e)
{
    switch (e) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    case 'b': rx_unsupported(r, "\\b (word boundary)"); return -1;
    case 'B': rx_unsupported(r, "\\B"); return -1;
    case 'x': case 'u': {
        int nd = e == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int i = 0; i < nd; i++) {
            char h = r->p < r->end ? *r->p++ : 0;
            int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (d < 0) {
                rx_fail(r, "bad \\%c escape", (char)e);
                return -1;
            }
            v = v * 16 + (uint32_t)d;
        }
        if (v >= 0xD800 && v <= 0xDFFF) {
            rx_fail(r, "\\u%04X is a surrogate, not a character", v);
            return -1;
        }
        return (int32_t)v;
    }
    default:
        if (e >= '1' && e <= '9') {
            rx_unsupported(r, "back-references");
            return -1;
        }
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
            r->p--;
            rx_unsupported(r, "an unknown letter escape");
            return -1;
        }
        return e;
    }
}

/* The class after '[' into *out (normalised; caller frees out->r). */
static bt_status rx_class_parse(rx *r, cls *out)
{
    cls c = {0};
    int negate = 0;
    if (r->p < r->end && *r->p == '^') {
        negate = 1;
        r->p++;
    }
    int first = 1;
    while (1) {
        if (r->p >= r->end) {
            free(c.r);
            return rx_fail(r, "unterminated character class");
        }
        if (*r->p == ']' && !first) {
            r->p++;
            break;
        }
        first = 0;
        int32_t lo = rx_cp(r);
        if (lo == '\\') {
            int32_t e = rx_cp(r);
            int neg;
            cls sh = {0};
            if (shorthand(&sh, e, &neg)) {
                cls_normalise(&sh, neg);
                for (int i = 0; i < sh.n; i++) cls_add(&c, sh.r[i].lo, sh.r[i].hi);
                free(sh.r);
                continue;
            }
            free(sh.r);
            lo = rx_escape(r, e);
        } else if (lo == '[' && r->p < r->end && *r->p == ':') {
            free(c.r);
            return rx_unsupported(r, "POSIX classes [:name:]");
        }
        if (lo < 0) {
            free(c.r);
            return r->err ? r->err : rx_fail(r, "invalid UTF-8");
        }
        int32_t hi = lo;
        if (r->end - r->p >= 2 && r->p[0] == '-' && r->p[1] != ']') {
            r->p++;
            hi = rx_cp(r);
            if (hi == '\\') hi = rx_escape(r, rx_cp(r));
            if (hi < lo) {
                free(c.r);
                return r->err ? r->err : rx_fail(r, "reversed range in a class");
            }
        }
        cls_add(&c, (uint32_t)lo, (uint32_t)hi);
    }
    cls_normalise(&c, negate);
    if (c.oom) {
        free(c.r);
        return r->err = bt_fail(BT_ERR_NOMEM, "regex: out of memory");
    }
    *out = c;
    return BT_OK;
}

static bt_status rx_class(rx *r, bt_strbuf *b)
{
    cls c = {0};
    if (rx_class_parse(r, &c)) return r->err;
    emit_class(r, b, &c);
    free(c.r);
    return BT_OK;
}

static bt_status rx_alt(rx *r, bt_strbuf *b);

static bt_status rx_seq(rx *r, bt_strbuf *b)
{
    int empty = 1;
    bt_strbuf_puts(b, "( ");
    while (r->p < r->end && *r->p != '|' && *r->p != ')') {
        char c = *r->p;
        if (c == '^') {
            if (r->p != r->start) return rx_unsupported(r, "'^' other than at the start");
            r->p++;
            continue;
        }
        if (c == '$') {
            if (r->p + 1 != r->end) return rx_unsupported(r, "'$' other than at the end");
            r->p++;
            continue;
        }
        bt_strbuf atom = {0};
        if (c == '(') {
            r->p++;
            if (r->p < r->end && *r->p == '?') {
                if (r->end - r->p >= 2 && r->p[1] == ':') {
                    r->p += 2;
                } else {
                    free(atom.p);
                    return rx_unsupported(r, "lookaround and named groups '(?...)'");
                }
            }
            if (++r->nest > 64) {
                free(atom.p);
                return rx_fail(r, "groups nested too deep");
            }
            rx_alt(r, &atom);
            r->nest--;
            if (!r->err && (r->p >= r->end || *r->p != ')')) rx_fail(r, "missing ')'");
            r->p++;
        } else if (c == '[') {
            r->p++;
            rx_class(r, &atom);
        } else if (c == '.') {
            r->p++;
            cls d = {0};
            cls_add(&d, '\n', '\n');
            cls_normalise(&d, 1);
            emit_class(r, &atom, &d);
            free(d.r);
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            return rx_fail(r, "nothing to repeat");
        } else {
            int32_t cp = rx_cp(r);
            if (cp == '\\') {
                int32_t e = rx_cp(r);
                cls sh = {0};
                int neg;
                if (shorthand(&sh, e, &neg)) {
                    cls_normalise(&sh, neg);
                    emit_class(r, &atom, &sh);
                    free(sh.r);
                    cp = -2;
                } else {
                    free(sh.r);
                    cp = rx_escape(r, e);
                }
            }
            if (cp == -1 && !r->err) rx_fail(r, "invalid UTF-8 or a trailing '\\'");
            if (cp >= 0) emit_char(r, &atom, (uint32_t)cp);
        }
        if (r->err || atom.oom) {
            free(atom.p);
            return r->err ? r->err : (r->err = bt_fail(BT_ERR_NOMEM, "regex: out of memory"));
        }
        /* quantifier */
        bt_strbuf_puts(b, "( ");
        bt_strbuf_puts(b, atom.p ? atom.p : "\"\"");
        bt_strbuf_puts(b, " )");
        free(atom.p);
        if (r->p < r->end) {
            char q = *r->p;
            if (q == '*' || q == '+' || q == '?') {
                bt_strbuf_put(b, &q, 1);
                r->p++;
            } else if (q == '{') {
                long m, n;
                if (rx_count(r, &m, &n)) return r->err;
                if (n < 0) sb_printf(b, "{%ld,}", m);
                else sb_printf(b, "{%ld,%ld}", m, n);
            }
            if (r->p < r->end && *r->p == '?') r->p++; /* lazy: the same language */
            if (r->p < r->end && *r->p == '+') return rx_unsupported(r, "possessive quantifiers");
            if (r->p < r->end && (*r->p == '*' || *r->p == '{')) return rx_fail(r, "a quantifier after a quantifier");
        }
        bt_strbuf_puts(b, " ");
        empty = 0;
    }
    if (empty) bt_strbuf_puts(b, "\"\" ");
    bt_strbuf_puts(b, ")");
    return r->err;
}

static bt_status rx_alt(rx *r, bt_strbuf *b)
{
    bt_strbuf_puts(b, "( ");
    if (rx_seq(r, b)) return r->err;
    while (r->p < r->end && *r->p == '|') {
        r->p++;
        bt_strbuf_puts(b, " | ");
        if (rx_seq(r, b)) return r->err;
    }
    bt_strbuf_puts(b, " )");
    return r->err;
}

static bt_status regex_expr(const char *re, int json, bt_strbuf *b)
{
    rx r = {.p = re, .end = re + strlen(re), .start = re, .json = json};
    if (rx_alt(&r, b)) return r.err;
    if (r.p != r.end) {
        return rx_fail(&r, "unbalanced ')'");
    }
    if (b->oom) return bt_fail(BT_ERR_NOMEM, "regex: out of memory");
    return BT_OK;
}

/* ---- pattern with minLength/maxLength: the regex as an automaton crossed with a character counter ----
 * The pattern is parsed again into a Thompson NFA (a repetition {m,n} is that many copies of its atom, parsed
 * anew), and the grammar gets one rule per pair (automaton state, characters so far) that can be reached from the
 * start and can still reach an accepting pair: a right-linear grammar of exactly the pattern's strings whose length
 * (in code points, as JSON Schema counts) lies in [minLength, maxLength]. Without maxLength the counter stops at
 * minLength. Dead pairs are left out, so every prefix the grammar allows can be completed. Too many states or pairs
 * is BT_ERR_UNSUPPORTED (a 400), never a silent loosening. */

#define NFA_MAX_STATES 4096
#define LEN_MAX_PAIRS 20000

typedef struct nfa_edge {
    int to, cl; /* cl: index into nfa.cl, -1 for an empty move */
} nfa_edge;

typedef struct nfa_state {
    nfa_edge *e;
    int n, cap;
} nfa_state;

typedef struct nfa {
    nfa_state *s;
    int n, cap;
    cls *cl;
    int n_cl, cap_cl;
    int full, oom;
} nfa;

typedef struct frag {
    int in, out;
} frag;

static void nfa_free(nfa *a)
{
    for (int i = 0; i < a->n; i++) free(a->s[i].e);
    for (int i = 0; i < a->n_cl; i++) free(a->cl[i].r);
    free(a->s);
    free(a->cl);
}

static int nfa_new(nfa *a)
{
    if (a->n >= NFA_MAX_STATES) {
        a->full = 1;
        return 0;
    }
    if (grow(&a->s, a->n, &a->cap, sizeof *a->s, 64)) {
        a->oom = 1;
        return 0;
    }
    a->s[a->n] = (nfa_state){0};
    return a->n++;
}

static void nfa_edge_add(nfa *a, int from, int to, int cl)
{
    if (a->full || a->oom) return;
    nfa_state *st = &a->s[from];
    if (grow(&st->e, st->n, &st->cap, sizeof *st->e, 2)) {
        a->oom = 1;
        return;
    }
    st->e[st->n++] = (nfa_edge){to, cl};
}

/* A fragment of one labelled edge; takes c's ranges. */
static frag nfa_class_frag(nfa *a, cls *c)
{
    frag f = {nfa_new(a), nfa_new(a)};
    if (c->oom) a->oom = 1;
    if (!a->full && !a->oom && grow(&a->cl, a->n_cl, &a->cap_cl, sizeof *a->cl, 16)) a->oom = 1;
    if (a->full || a->oom) {
        free(c->r);
        *c = (cls){0};
        return f;
    }
    a->cl[a->n_cl] = *c;
    *c = (cls){0};
    nfa_edge_add(a, f.in, f.out, a->n_cl++);
    return f;
}

static bt_status nx_alt(rx *r, nfa *a, frag *f);

/* One atom at r->p: a group, a class, '.', or a character or escape. */
static bt_status nx_atom(rx *r, nfa *a, frag *f)
{
    char c = *r->p;
    cls k = {0};
    if (c == '(') {
        r->p++;
        if (r->p < r->end && *r->p == '?') {
            if (r->end - r->p >= 2 && r->p[1] == ':') r->p += 2;
            else return rx_unsupported(r, "lookaround and named groups '(?...)'");
        }
        if (++r->nest > 64) return rx_fail(r, "groups nested too deep");
        nx_alt(r, a, f);
        r->nest--;
        if (!r->err && (r->p >= r->end || *r->p != ')')) rx_fail(r, "missing ')'");
        r->p++;
        return r->err;
    }
    if (c == '[') {
        r->p++;
        if (rx_class_parse(r, &k)) return r->err;
    } else if (c == '.') {
        r->p++;
        cls_add(&k, '\n', '\n');
        cls_normalise(&k, 1);
    } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        return rx_fail(r, "nothing to repeat");
    } else {
        int32_t cp = rx_cp(r);
        if (cp == '\\') {
            int32_t e = rx_cp(r);
            int neg;
            if (shorthand(&k, e, &neg)) {
                cls_normalise(&k, neg);
                cp = -2;
            } else {
                free(k.r);
                k = (cls){0};
                cp = rx_escape(r, e);
            }
        }
        if (cp == -1 && !r->err) rx_fail(r, "invalid UTF-8 or a trailing '\\'");
        if (r->err) {
            free(k.r);
            return r->err;
        }
        if (cp >= 0) cls_add(&k, (uint32_t)cp, (uint32_t)cp);
    }
    *f = nfa_class_frag(a, &k);
    return r->err;
}

/* The quantifier after an atom: *m..*n (n = -1: unbounded); 1..1 when there is none. */
static bt_status nx_quantifier(rx *r, long *m, long *n)
{
    *m = *n = 1;
    if (r->p >= r->end) return BT_OK;
    char q = *r->p;
    if (q == '*' || q == '+' || q == '?') {
        *m = q == '+';
        *n = q == '?' ? 1 : -1;
        r->p++;
    } else if (q == '{') {
        if (rx_count(r, m, n)) return r->err;
    } else {
        return BT_OK;
    }
    if (r->p < r->end && *r->p == '?') r->p++; /* lazy: the same language */
    if (r->p < r->end && *r->p == '+') return rx_unsupported(r, "possessive quantifiers");
    if (r->p < r->end && (*r->p == '*' || *r->p == '{')) return rx_fail(r, "a quantifier after a quantifier");
    return BT_OK;
}

/* Another copy of the atom that starts at ap (fresh states). */
static bt_status nx_copy(rx *r, nfa *a, const char *ap, frag *f)
{
    const char *save = r->p;
    r->p = ap;
    nx_atom(r, a, f);
    r->p = save;
    return r->err;
}

static bt_status nx_seq(rx *r, nfa *a, frag *f)
{
    int cur = nfa_new(a);
    f->in = cur;
    while (r->p < r->end && *r->p != '|' && *r->p != ')' && !r->err && !a->full && !a->oom) {
        char c = *r->p;
        if (c == '^') {
            if (r->p != r->start) return rx_unsupported(r, "'^' other than at the start");
            r->p++;
            continue;
        }
        if (c == '$') {
            if (r->p + 1 != r->end) return rx_unsupported(r, "'$' other than at the end");
            r->p++;
            continue;
        }
        const char *ap = r->p;
        frag first, x;
        long m, n;
        if (nx_atom(r, a, &first) || nx_quantifier(r, &m, &n)) return r->err;
        int have_first = 1;
        for (long i = 0; i < m && !r->err && !a->full && !a->oom; i++) {
            if (have_first) x = first, have_first = 0;
            else if (nx_copy(r, a, ap, &x)) return r->err;
            nfa_edge_add(a, cur, x.in, -1);
            cur = x.out;
        }
        if (n < 0) { /* a loop: cur -> atom -> cur */
            if (have_first) x = first;
            else if (nx_copy(r, a, ap, &x)) return r->err;
            nfa_edge_add(a, cur, x.in, -1);
            nfa_edge_add(a, x.out, cur, -1);
        } else if (n > m) {
            int end = nfa_new(a);
            for (long i = m; i < n && !r->err && !a->full && !a->oom; i++) {
                if (have_first) x = first, have_first = 0;
                else if (nx_copy(r, a, ap, &x)) return r->err;
                nfa_edge_add(a, cur, end, -1);
                nfa_edge_add(a, cur, x.in, -1);
                cur = x.out;
            }
            nfa_edge_add(a, cur, end, -1);
            cur = end;
        }
    }
    f->out = cur;
    return r->err;
}

static bt_status nx_alt(rx *r, nfa *a, frag *f)
{
    f->in = nfa_new(a);
    f->out = nfa_new(a);
    for (;;) {
        frag s = {0, 0};
        if (nx_seq(r, a, &s)) return r->err;
        nfa_edge_add(a, f->in, s.in, -1);
        nfa_edge_add(a, s.out, f->out, -1);
        if (r->p >= r->end || *r->p != '|' || a->full || a->oom) return r->err;
        r->p++;
    }
}

/* What one automaton state leads to: the labelled edges of its empty-move closure, and whether that closure
 * holds the final state. */
typedef struct nfa_reach {
    nfa_edge *e;
    int n;
    int accept;
} nfa_reach;

static bt_status nfa_closures(const nfa *a, int final, const int *imp, int n_imp, nfa_reach *out)
{
    int *stack = malloc(sizeof *stack * (size_t)a->n), *seen = calloc((size_t)a->n, sizeof *seen);
    bt_status st = stack && seen ? BT_OK : bt_fail(BT_ERR_NOMEM, "JSON schema: out of memory");
    for (int i = 0; i < n_imp && !st; i++) {
        int sp = 0, n = 0, cap = 0;
        nfa_edge *e = NULL;
        stack[sp++] = imp[i];
        seen[imp[i]] = i + 1;
        while (sp && !st) {
            int q = stack[--sp];
            if (q == final) out[i].accept = 1;
            for (int k = 0; k < a->s[q].n; k++) {
                nfa_edge x = a->s[q].e[k];
                if (x.cl >= 0) {
                    if (grow(&e, n, &cap, sizeof *e, 4)) {
                        st = bt_fail(BT_ERR_NOMEM, "JSON schema: out of memory");
                        break;
                    }
                    e[n++] = x;
                } else if (seen[x.to] != i + 1) {
                    seen[x.to] = i + 1;
                    stack[sp++] = x.to;
                }
            }
        }
        out[i].e = e;
        out[i].n = n;
    }
    free(stack);
    free(seen);
    return st;
}

/* The string of a pattern with length bounds [mn, mx] (mx < 0: none) as rules into g->rules; b gets the
 * expression. */
static bt_status gen_pattern_len(gen *g, const char *pattern, long mn, long mx, bt_strbuf *b)
{
    nfa a = {0};
    rx r = {.p = pattern, .end = pattern + strlen(pattern), .start = pattern, .json = 1};
    frag top = {0, 0};
    nx_alt(&r, &a, &top);
    if (!r.err && !a.full && !a.oom && r.p != r.end) rx_fail(&r, "unbalanced ')'");
    if (r.err) {
        nfa_free(&a);
        return fail(g, r.err, "JSON schema 'pattern': %s", bt_last_error());
    }
    if (a.full || a.oom) {
        nfa_free(&a);
        return a.oom ? fail(g, BT_ERR_NOMEM, "JSON schema: out of memory")
                     : fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'pattern' with minLength/maxLength: the pattern needs "
                            "more than %d automaton states (long repetitions); not supported", NFA_MAX_STATES);
    }
    /* the states a pair can be in: the start and every labelled edge's target */
    int *idx = malloc(sizeof *idx * (size_t)a.n), *imp = malloc(sizeof *imp * (size_t)a.n), n_imp = 0;
    nfa_reach *reach = NULL;
    int K = mx >= 0 ? (int)mx : (int)mn, W = K + 1;
    unsigned char *live = NULL;
    int *ids = NULL, *queue = NULL;
    bt_status st = BT_OK;
    if (!idx || !imp) {
        st = fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
        goto out;
    }
    for (int q = 0; q < a.n; q++) idx[q] = -1;
    idx[top.in] = n_imp;
    imp[n_imp++] = top.in;
    for (int q = 0; q < a.n; q++)
        for (int k = 0; k < a.s[q].n; k++) {
            int t = a.s[q].e[k].to;
            if (a.s[q].e[k].cl >= 0 && idx[t] < 0) {
                idx[t] = n_imp;
                imp[n_imp++] = t;
            }
        }
    if ((long)n_imp * W > LEN_MAX_PAIRS) {
        st = fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'pattern' with minLength/maxLength: %d automaton states times "
                  "%d lengths is above %d rules; not supported", n_imp, W, LEN_MAX_PAIRS);
        goto out;
    }
    size_t np = (size_t)n_imp * (size_t)W;
    reach = calloc((size_t)n_imp, sizeof *reach);
    live = calloc(np, 1);
    ids = malloc(sizeof *ids * np);
    queue = malloc(sizeof *queue * np);
    if (!reach || !live || !ids || !queue) {
        st = fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
        goto out;
    }
    if ((st = nfa_closures(&a, top.out, imp, n_imp, reach))) {
        st = fail(g, st, "%s", bt_last_error());
        goto out;
    }
    /* pairs reachable from (start, 0): bit 1 of live; then those that reach acceptance: bit 2 */
    int head = 0, tail = 0;
    live[0] = 1;
    queue[tail++] = 0;
    while (head < tail) {
        int p = queue[head++], i = p / W, k = p % W;
        int nk = mx >= 0 ? k + 1 : (k + 1 < K ? k + 1 : K);
        if (nk > K) continue;
        for (int e = 0; e < reach[i].n; e++) {
            int t = idx[reach[i].e[e].to] * W + nk;
            if (!(live[t] & 1)) {
                live[t] |= 1;
                queue[tail++] = t;
            }
        }
    }
    /* liveness by fixed point over the reachable pairs, in reverse discovery order first (usually one pass) */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int qi = tail - 1; qi >= 0; qi--) {
            int p = queue[qi], i = p / W, k = p % W;
            if (live[p] & 2) continue;
            int ok = reach[i].accept && k >= mn;
            int nk = mx >= 0 ? k + 1 : (k + 1 < K ? k + 1 : K);
            for (int e = 0; !ok && nk <= K && e < reach[i].n; e++) ok = live[idx[reach[i].e[e].to] * W + nk] & 2;
            if (ok) {
                live[p] |= 2;
                changed = 1;
            }
        }
    }
    if (!(live[0] & 2)) {
        st = mx >= 0 ? fail(g, BT_ERR_INVALID, "JSON schema 'pattern' allows no string of length %ld to %ld", mn, mx)
                     : fail(g, BT_ERR_INVALID, "JSON schema 'pattern' allows no string of length %ld or more", mn);
        goto out;
    }
    for (size_t p = 0; p < np; p++) ids[p] = live[p] == 3 ? g->n_rules++ : -1;
    rx er = {.json = 1};
    for (int qi = 0; qi < tail; qi++) {
        int p = queue[qi], i = p / W, k = p % W;
        if (ids[p] < 0) continue;
        int nk = mx >= 0 ? k + 1 : (k + 1 < K ? k + 1 : K), any = 0;
        sb_printf(&g->rules, "s%d ::= ", ids[p]);
        for (int e = 0; nk <= K && e < reach[i].n; e++) {
            int t = idx[reach[i].e[e].to] * W + nk;
            if (ids[t] < 0) continue;
            if (any++) bt_strbuf_puts(&g->rules, " | ");
            emit_class(&er, &g->rules, &a.cl[reach[i].e[e].cl]);
            sb_printf(&g->rules, " s%d", ids[t]);
        }
        if (reach[i].accept && k >= mn) bt_strbuf_puts(&g->rules, any ? " | \"\"" : "\"\"");
        bt_strbuf_puts(&g->rules, "\n");
        if (g->rules.n > RTR_SCHEMA_MAX_GRAMMAR) {
            st = fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'pattern' with minLength/maxLength compiles to a grammar "
                      "above %u bytes", RTR_SCHEMA_MAX_GRAMMAR);
            goto out;
        }
    }
    sb_printf(b, "\"\\\"\" s%d \"\\\"\"", ids[0]);
out:
    for (int i = 0; reach && i < n_imp; i++) free(reach[i].e);
    free(reach);
    free(live);
    free(ids);
    free(queue);
    free(idx);
    free(imp);
    nfa_free(&a);
    return st;
}

/* ---- schemas ---- */

static bt_status gen_schema(gen *g, const cJSON *s, bt_strbuf *b);

static bt_status gen_string(gen *g, const cJSON *s, bt_strbuf *b)
{
    long mn, mx;
    if (get_count(g, s, "minLength", 0, &mn) || get_count(g, s, "maxLength", -1, &mx)) return g->err;
    if (mx >= 0 && mx < mn) return fail(g, BT_ERR_INVALID, "JSON schema maxLength is below minLength");
    const cJSON *pat = kw(s, "pattern"), *fmt = kw(s, "format");
    if (pat && fmt) return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'pattern' together with 'format' is not supported");
    if (fmt && (kw(s, "minLength") || kw(s, "maxLength")))
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'format' together with minLength/maxLength is not supported");
    if (pat && !cJSON_IsString(pat)) return fail(g, BT_ERR_INVALID, "JSON schema 'pattern' must be a string");
    if (pat && (kw(s, "minLength") || kw(s, "maxLength"))) return gen_pattern_len(g, pat->valuestring, mn, mx, b);
    if (pat) {
        bt_strbuf_puts(b, "\"\\\"\" ");
        bt_status st = regex_expr(pat->valuestring, 1, b);
        if (st) return fail(g, st, "JSON schema 'pattern': %s", bt_last_error());
        bt_strbuf_puts(b, " \"\\\"\"");
        return BT_OK;
    }
    if (fmt) {
        static const struct {
            const char *name, *body;
        } formats[] = {
            {"date", "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] )"},
            {"time", "( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? ( \"Z\" "
                     "| [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )"},
            {"date-time", "[0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | \"1\" [0-9] | \"2\" "
                          "[0-8] ) \"T\" ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" "
                          "[0-9]{1,6} )? ( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )"},
            {"uuid", "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{12}"},
            {"ipv4", "ipv4oct \".\" ipv4oct \".\" ipv4oct \".\" ipv4oct"},
            {"email", "[a-z0-9]{1,20} ( \".\" [a-z0-9]{1,20} ){0,2} \"@\" [a-z0-9]{1,20} ( \".\" [a-z0-9]{1,20} "
                      "){0,2} \".\" [a-z]{2,6}"},
        };
        if (!cJSON_IsString(fmt)) return fail(g, BT_ERR_INVALID, "JSON schema 'format' must be a string");
        for (size_t i = 0; i < sizeof formats / sizeof *formats; i++)
            if (!strcmp(fmt->valuestring, formats[i].name)) {
                sb_printf(b, "\"\\\"\" ( %s ) \"\\\"\"", formats[i].body);
                return BT_OK;
            }
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema format '%.40s' is not supported", fmt->valuestring);
    }
    if (mn == 0 && mx < 0) bt_strbuf_puts(b, "jstr");
    else if (mx < 0) sb_printf(b, "\"\\\"\" jchar{%ld,} \"\\\"\"", mn);
    else sb_printf(b, "\"\\\"\" jchar{%ld,%ld} \"\\\"\"", mn, mx);
    return BT_OK;
}

/* The GBNF literal of a JSON value's compact serialization. */
static bt_status gen_literal_value(gen *g, const cJSON *v, bt_strbuf *b)
{
    char *text = cJSON_PrintUnformatted(v);
    if (!text) return fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
    sb_literal(b, text, strlen(text));
    free(text);
    return BT_OK;
}

static bt_status gen_array(gen *g, const cJSON *s, bt_strbuf *b)
{
    long mn, mx;
    if (get_count(g, s, "minItems", 0, &mn) || get_count(g, s, "maxItems", -1, &mx)) return g->err;
    if (mx >= 0 && mx < mn) return fail(g, BT_ERR_INVALID, "JSON schema maxItems is below minItems");
    const cJSON *uq = kw(s, "uniqueItems");
    if (cJSON_IsTrue(uq) && !(mx >= 0 && mx <= 1))
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'uniqueItems' is not supported (except with maxItems <= 1)");
    const cJSON *items = kw(s, "items"), *prefix = kw(s, "prefixItems");
    if (items && cJSON_IsArray(items))
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'items' as an array (draft 4 tuples) is not supported; use "
                    "prefixItems");
    int n_prefix = prefix ? cJSON_GetArraySize(prefix) : 0;
    if (prefix && !cJSON_IsArray(prefix)) return fail(g, BT_ERR_INVALID, "JSON schema 'prefixItems' must be an array");
    if (mx >= 0 && n_prefix > mx)
        return fail(g, BT_ERR_UNSUPPORTED, "JSON schema prefixItems longer than maxItems is not supported");
    int no_more = cJSON_IsFalse(items);
    if (no_more && mn > n_prefix) return fail(g, BT_ERR_INVALID, "JSON schema minItems needs items beyond prefixItems");
    bt_strbuf_puts(b, "\"[\" ws ");
    int k = 0;
    for (const cJSON *p = prefix ? prefix->child : NULL; p; p = p->next, k++) {
        int id = schema_rule(g, p);
        if (id < 0) return g->err;
        sb_printf(b, "%ss%d ws ", k ? "\",\" ws " : "", id);
    }
    if (!no_more) {
        int id = items ? schema_rule(g, items) : -1;
        if (items && id < 0) return g->err;
        char item[32];
        snprintf(item, sizeof item, items ? "s%d" : "jval", id);
        long rmin = mn > n_prefix ? mn - n_prefix : 0, rmax = mx < 0 ? -1 : mx - n_prefix;
        if (rmax != 0) {
            if (n_prefix) { /* every further item follows a comma */
                if (rmax < 0) sb_printf(b, "( \",\" ws %s ws ){%ld,} ", item, rmin);
                else sb_printf(b, "( \",\" ws %s ws ){%ld,%ld} ", item, rmin, rmax);
            } else {
                bt_strbuf_puts(b, rmin == 0 ? "( " : "");
                sb_printf(b, "%s ws ", item);
                long tmin = rmin > 0 ? rmin - 1 : 0;
                if (rmax < 0) sb_printf(b, "( \",\" ws %s ws ){%ld,} ", item, tmin);
                else sb_printf(b, "( \",\" ws %s ws ){%ld,%ld} ", item, tmin, rmax - 1);
                bt_strbuf_puts(b, rmin == 0 ? ")? " : "");
            }
        }
    }
    bt_strbuf_puts(b, "\"]\"");
    return BT_OK;
}

typedef struct prop {
    const char *name;
    const cJSON *schema; /* NULL: any value */
    int required;
} prop;

static bt_status gen_object(gen *g, const cJSON *s, bt_strbuf *b)
{
    static const char *const unsupported[] = {"minProperties", "maxProperties", "patternProperties", "propertyNames",
                                              NULL};
    for (int i = 0; unsupported[i]; i++)
        if (kw(s, unsupported[i]))
            return fail(g, BT_ERR_UNSUPPORTED, "JSON schema keyword '%s' is not supported", unsupported[i]);
    const cJSON *props = kw(s, "properties"), *req = kw(s, "required"), *addl = kw(s, "additionalProperties");
    if (props && !cJSON_IsObject(props)) return fail(g, BT_ERR_INVALID, "JSON schema 'properties' must be an object");
    if (req && !cJSON_IsArray(req)) return fail(g, BT_ERR_INVALID, "JSON schema 'required' must be an array");
    int n = 0, cap = (props ? cJSON_GetArraySize(props) : 0) + (req ? cJSON_GetArraySize(req) : 0);
    prop *p = calloc((size_t)(cap ? cap : 1), sizeof *p);
    if (!p) return fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
    for (const cJSON *k = props ? props->child : NULL; k; k = k->next) p[n++] = (prop){k->string, k, 0};
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next) {
        if (!cJSON_IsString(r)) {
            free(p);
            return fail(g, BT_ERR_INVALID, "JSON schema 'required' must hold strings");
        }
        int found = 0;
        for (int i = 0; i < n; i++)
            if (!strcmp(p[i].name, r->valuestring)) found = p[i].required = 1;
        if (!found) {
            if (cJSON_IsFalse(addl)) {
                free(p);
                return fail(g, BT_ERR_INVALID, "JSON schema requires '%.60s', which additionalProperties false forbids",
                            r->valuestring);
            }
            p[n++] = (prop){r->valuestring, cJSON_IsObject(addl) ? addl : NULL, 1};
        }
    }
    if (n == 0) {
        free(p);
        if (cJSON_IsFalse(addl)) {
            bt_strbuf_puts(b, "\"{\" ws \"}\"");
        } else if (cJSON_IsObject(addl)) {
            int id = schema_rule(g, addl);
            if (id < 0) return g->err;
            sb_printf(b, "\"{\" ws ( jstr ws \":\" ws s%d ws ( \",\" ws jstr ws \":\" ws s%d ws )* )? \"}\"", id, id);
        } else {
            bt_strbuf_puts(b, "jobj");
        }
        return BT_OK;
    }
    /* first_i: nothing emitted yet, properties i.. to go; rest_i: something emitted, so each starts with a comma */
    int base = g->n_rules;
    g->n_rules += 2 * (n + 1);
    int *val = malloc(sizeof *val * (size_t)n);
    if (!val) {
        free(p);
        return fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
    }
    for (int i = 0; i < n && !g->err; i++) val[i] = p[i].schema ? schema_rule(g, p[i].schema) : -1;
    for (int i = 0; i < n && !g->err; i++) {
        bt_strbuf kv = {0};
        cJSON *tmp = cJSON_CreateString(p[i].name);
        char *kt = tmp ? cJSON_PrintUnformatted(tmp) : NULL;
        cJSON_Delete(tmp);
        if (!kt) {
            free(kv.p);
            break;
        }
        sb_literal(&kv, kt, strlen(kt));
        free(kt);
        if (val[i] >= 0) sb_printf(&kv, " ws \":\" ws s%d ws", val[i]);
        else bt_strbuf_puts(&kv, " ws \":\" ws jval ws");
        /* first_i = s(base + 2i), rest_i = s(base + 2i + 1) */
        if (p[i].required) {
            sb_printf(&g->rules, "s%d ::= %s s%d\n", base + 2 * i, kv.p, base + 2 * i + 3);
            sb_printf(&g->rules, "s%d ::= \",\" ws %s s%d\n", base + 2 * i + 1, kv.p, base + 2 * i + 3);
        } else {
            sb_printf(&g->rules, "s%d ::= %s s%d | s%d\n", base + 2 * i, kv.p, base + 2 * i + 3, base + 2 * i + 2);
            sb_printf(&g->rules, "s%d ::= ( \",\" ws %s )? s%d\n", base + 2 * i + 1, kv.p, base + 2 * i + 3);
        }
        if (kv.oom) g->rules.oom = 1;
        free(kv.p);
    }
    sb_printf(&g->rules, "s%d ::= \"\"\ns%d ::= \"\"\n", base + 2 * n, base + 2 * n + 1);
    free(val);
    free(p);
    if (g->err) return g->err;
    sb_printf(b, "\"{\" ws s%d \"}\"", base);
    return BT_OK;
}

static const cJSON *resolve_ref(gen *g, const char *ref)
{
    if (!strcmp(ref, "#")) return g->root;
    const char *name = NULL;
    const cJSON *defs = NULL;
    if (!strncmp(ref, "#/$defs/", 8)) {
        defs = kw(g->root, "$defs");
        name = ref + 8;
    } else if (!strncmp(ref, "#/definitions/", 14)) {
        defs = kw(g->root, "definitions");
        name = ref + 14;
    } else {
        fail(g, BT_ERR_UNSUPPORTED, "JSON schema $ref '%.80s' is not supported (only #, #/$defs/NAME and "
             "#/definitions/NAME)", ref);
        return NULL;
    }
    const cJSON *t = defs ? kw(defs, name) : NULL;
    if (!t) fail(g, BT_ERR_INVALID, "JSON schema $ref '%.80s' names no definition", ref);
    return t;
}

static bt_status gen_typed(gen *g, const cJSON *s, const char *type, bt_strbuf *b)
{
    if (!strcmp(type, "null")) bt_strbuf_puts(b, "\"null\"");
    else if (!strcmp(type, "boolean")) bt_strbuf_puts(b, "( \"true\" | \"false\" )");
    else if (!strcmp(type, "integer")) return gen_integer(g, s, b);
    else if (!strcmp(type, "number")) return gen_number(g, s, b);
    else if (!strcmp(type, "string")) return gen_string(g, s, b);
    else if (!strcmp(type, "array")) return gen_array(g, s, b);
    else if (!strcmp(type, "object")) return gen_object(g, s, b);
    else return fail(g, BT_ERR_INVALID, "JSON schema type '%.40s' is unknown", type);
    return BT_OK;
}

/* Whether s has validation keywords besides the ones listed. */
static const char *other_keyword(const cJSON *s, const char *const *allowed)
{
    for (const cJSON *k = s->child; k; k = k->next)
        if (!in_list(ANNOTATIONS, k->string) && !in_list(allowed, k->string)) return k->string;
    return NULL;
}

/* ---- oneOf: enforced where no value can match two branches ----
 * The grammar allows what any branch allows; that satisfies oneOf exactly when no value validates against two
 * branches, which is checked here for each pair on what the schemas say at their top level: different JSON types,
 * disjoint const/enum values, or (objects) a property required by both whose schemas are themselves exclusive, the
 * usual discriminator. Anything else is refused rather than loosened to anyOf. */

enum { JT_NULL = 1, JT_BOOL = 2, JT_INT = 4, JT_FRAC = 8, JT_STR = 16, JT_ARR = 32, JT_OBJ = 64, JT_ANY = 127 };

#define ONEOF_DEPTH 4 /* nesting of properties and combinations the check looks through */

/* s with its $ref chain followed (NULL when it names nothing: gen_schema reports that). */
static const cJSON *deref(gen *g, const cJSON *s)
{
    for (int i = 0; i < 16 && cJSON_IsObject(s); i++) {
        const cJSON *r = kw(s, "$ref");
        if (!cJSON_IsString(r)) return s;
        s = resolve_ref(g, r->valuestring);
    }
    return cJSON_IsObject(s) || cJSON_IsBool(s) ? s : NULL;
}

static int value_type(const cJSON *v)
{
    if (cJSON_IsNull(v)) return JT_NULL;
    if (cJSON_IsBool(v)) return JT_BOOL;
    if (cJSON_IsNumber(v)) return v->valuedouble == floor(v->valuedouble) ? JT_INT : JT_FRAC;
    if (cJSON_IsString(v)) return JT_STR;
    if (cJSON_IsArray(v)) return JT_ARR;
    return JT_OBJ;
}

static int type_name_bits(const char *t)
{
    static const char *const names[] = {"null", "boolean", "integer", "number", "string", "array", "object"};
    static const int bits[] = {JT_NULL, JT_BOOL, JT_INT, JT_INT | JT_FRAC, JT_STR, JT_ARR, JT_OBJ};
    for (int i = 0; i < 7; i++)
        if (!strcmp(t, names[i])) return bits[i];
    return JT_ANY;
}

/* The JSON types a value valid against s may have (a superset). */
static int schema_types(gen *g, const cJSON *s, int depth)
{
    s = deref(g, s);
    if (!s || cJSON_IsTrue(s) || depth > ONEOF_DEPTH) return JT_ANY;
    if (cJSON_IsFalse(s)) return 0;
    const cJSON *en = kw(s, "enum"), *cn = kw(s, "const");
    if (cn) return value_type(cn);
    if (cJSON_IsArray(en)) {
        int t = 0;
        for (const cJSON *x = en->child; x; x = x->next) t |= value_type(x);
        return t;
    }
    const char *combo = kw(s, "anyOf") ? "anyOf" : kw(s, "oneOf") ? "oneOf" : kw(s, "allOf") ? "allOf" : NULL;
    if (combo && cJSON_IsArray(kw(s, combo))) {
        int t = 0;
        for (const cJSON *x = kw(s, combo)->child; x; x = x->next) t |= schema_types(g, x, depth + 1);
        return t;
    }
    const cJSON *type = kw(s, "type");
    if (cJSON_IsString(type)) return type_name_bits(type->valuestring);
    if (cJSON_IsArray(type)) {
        int t = 0;
        for (const cJSON *x = type->child; x; x = x->next) t |= cJSON_IsString(x) ? type_name_bits(x->valuestring) : JT_ANY;
        return t;
    }
    if (kw(s, "properties") || kw(s, "required") || kw(s, "additionalProperties")) return JT_OBJ;
    if (kw(s, "items") || kw(s, "prefixItems") || kw(s, "minItems") || kw(s, "maxItems")) return JT_ARR;
    if (kw(s, "pattern") || kw(s, "format") || kw(s, "minLength") || kw(s, "maxLength")) return JT_STR;
    if (kw(s, "minimum") || kw(s, "maximum") || kw(s, "exclusiveMinimum") || kw(s, "exclusiveMaximum"))
        return JT_INT | JT_FRAC;
    return JT_ANY;
}

/* Whether value v is in s's const/enum list (*listed = 0 when s has none). */
static int in_values(const cJSON *s, const cJSON *v, int *listed)
{
    const cJSON *cn = kw(s, "const"), *en = kw(s, "enum");
    *listed = cn || cJSON_IsArray(en);
    if (cn) return cJSON_Compare(cn, v, 1);
    if (cJSON_IsArray(en))
        for (const cJSON *x = en->child; x; x = x->next)
            if (cJSON_Compare(x, v, 1)) return 1;
    return 0;
}

static int required_in(const cJSON *s, const char *name)
{
    const cJSON *r = kw(s, "required");
    if (!cJSON_IsArray(r)) return 0;
    for (const cJSON *x = r->child; x; x = x->next)
        if (cJSON_IsString(x) && !strcmp(x->valuestring, name)) return 1;
    return 0;
}

/* 1 when no value can be valid against both a and b (as far as the rules above see). */
static int exclusive(gen *g, const cJSON *a, const cJSON *b, int depth)
{
    a = deref(g, a);
    b = deref(g, b);
    if (!a || !b || depth > ONEOF_DEPTH) return 0;
    if (cJSON_IsFalse(a) || cJSON_IsFalse(b)) return 1;
    if (!cJSON_IsObject(a) || !cJSON_IsObject(b)) return 0;
    int common = schema_types(g, a, depth) & schema_types(g, b, depth);
    if (!common) return 1;
    int la, lb;
    in_values(a, NULL, &la);
    in_values(b, NULL, &lb);
    if (la && lb) { /* both list their values: exclusive when no value is in both lists */
        const cJSON *cn = kw(a, "const"), *en = kw(a, "enum");
        for (const cJSON *x = cn ? cn : en->child; x; x = cn ? NULL : x->next) {
            int listed;
            if (in_values(b, x, &listed)) return 0;
        }
        return 1;
    }
    if (common != JT_OBJ) return 0;
    const cJSON *pa = kw(a, "properties"), *pb = kw(b, "properties");
    if (!cJSON_IsObject(pa) || !cJSON_IsObject(pb)) return 0;
    for (const cJSON *p = pa->child; p; p = p->next) {
        const cJSON *q = kw(pb, p->string);
        if (q && required_in(a, p->string) && required_in(b, p->string) && exclusive(g, p, q, depth + 1)) return 1;
    }
    return 0;
}

/* BT_OK when oneOf's branches are pairwise exclusive; else BT_ERR_UNSUPPORTED naming the first overlapping pair. */
static bt_status check_one_of(gen *g, const cJSON *list)
{
    int i = 0;
    for (const cJSON *a = list->child; a; a = a->next, i++) {
        int j = i + 1;
        for (const cJSON *b = a->next; b; b = b->next, j++) {
            if (exclusive(g, a, b, 0)) continue;
            if (g->err) return g->err;
            return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'oneOf': branches %d and %d may both match one value, "
                        "which oneOf forbids and a grammar cannot rule out; supported are branches of different "
                        "JSON types, with disjoint const/enum values, or objects whose values of a property "
                        "required by both are exclusive (a discriminator); use anyOf when overlap is fine", i, j);
        }
    }
    return g->err;
}

static bt_status gen_schema(gen *g, const cJSON *s, bt_strbuf *b)
{
    if (cJSON_IsTrue(s)) {
        bt_strbuf_puts(b, "jval");
        return BT_OK;
    }
    if (cJSON_IsFalse(s)) return fail(g, BT_ERR_INVALID, "JSON schema 'false' allows no value");
    if (!cJSON_IsObject(s)) return fail(g, BT_ERR_INVALID, "a JSON schema must be an object or a boolean");
    if (check_keywords(g, s)) return g->err;
    const cJSON *ref = kw(s, "$ref");
    if (ref) {
        static const char *const only[] = {"$ref", NULL};
        const char *o = other_keyword(s, only);
        if (o) return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%.60s' beside $ref is not supported", o);
        if (!cJSON_IsString(ref)) return fail(g, BT_ERR_INVALID, "JSON schema $ref must be a string");
        const cJSON *t = resolve_ref(g, ref->valuestring);
        int id = t ? schema_rule(g, t) : -1;
        if (id < 0) return g->err;
        sb_printf(b, "s%d", id);
        return BT_OK;
    }
    const char *combo = kw(s, "anyOf") ? "anyOf" : kw(s, "oneOf") ? "oneOf" : kw(s, "allOf") ? "allOf" : NULL;
    if (combo) {
        static const char *const only[] = {"anyOf", "oneOf", "allOf", NULL};
        const char *o = other_keyword(s, only);
        if (o) return fail(g, BT_ERR_UNSUPPORTED, "JSON schema '%.60s' beside %s is not supported", o, combo);
        if ((kw(s, "anyOf") != NULL) + (kw(s, "oneOf") != NULL) + (kw(s, "allOf") != NULL) > 1)
            return fail(g, BT_ERR_UNSUPPORTED, "JSON schema with more than one of anyOf/oneOf/allOf is not supported");
        const cJSON *list = kw(s, combo);
        if (!cJSON_IsArray(list) || !cJSON_GetArraySize(list))
            return fail(g, BT_ERR_INVALID, "JSON schema '%s' must be a non-empty array", combo);
        if (!strcmp(combo, "allOf") && cJSON_GetArraySize(list) != 1)
            return fail(g, BT_ERR_UNSUPPORTED, "JSON schema 'allOf' with more than one schema is not supported");
        if (!strcmp(combo, "oneOf") && check_one_of(g, list)) return g->err;
        bt_strbuf_puts(b, "( ");
        int n_alts = 0;
        for (const cJSON *x = list->child; x; x = x->next) {
            if (cJSON_IsFalse(x)) continue; /* matches nothing: no alternative */
            int id = schema_rule(g, x);
            if (id < 0) return g->err;
            sb_printf(b, "%ss%d", n_alts++ ? " | " : "", id);
        }
        if (!n_alts) return fail(g, BT_ERR_INVALID, "JSON schema '%s' of only false schemas allows no value", combo);
        bt_strbuf_puts(b, " )");
        return BT_OK;
    }
    const cJSON *en = kw(s, "enum"), *cn = kw(s, "const");
    if (en || cn) {
        if (en && (!cJSON_IsArray(en) || !cJSON_GetArraySize(en)))
            return fail(g, BT_ERR_INVALID, "JSON schema 'enum' must be a non-empty array");
        bt_strbuf_puts(b, "( ");
        for (const cJSON *x = cn ? cn : en->child; x; x = cn ? NULL : x->next) {
            if (!cn && x != en->child) bt_strbuf_puts(b, " | ");
            if (gen_literal_value(g, x, b)) return g->err;
        }
        bt_strbuf_puts(b, " )");
        return BT_OK;
    }
    const cJSON *type = kw(s, "type");
    if (!type) {
        const char *t = kw(s, "properties") || kw(s, "required") || kw(s, "additionalProperties") ? "object"
                        : kw(s, "items") || kw(s, "prefixItems") || kw(s, "minItems") || kw(s, "maxItems") ? "array"
                        : kw(s, "pattern") || kw(s, "format") || kw(s, "minLength") || kw(s, "maxLength") ? "string"
                        : kw(s, "minimum") || kw(s, "maximum") || kw(s, "exclusiveMinimum") ||
                                  kw(s, "exclusiveMaximum") || kw(s, "multipleOf")
                            ? "number"
                            : NULL;
        if (!t) {
            bt_strbuf_puts(b, "jval");
            return BT_OK;
        }
        return gen_typed(g, s, t, b);
    }
    if (cJSON_IsString(type)) return gen_typed(g, s, type->valuestring, b);
    if (!cJSON_IsArray(type) || !cJSON_GetArraySize(type))
        return fail(g, BT_ERR_INVALID, "JSON schema 'type' must be a string or a non-empty array of strings");
    bt_strbuf_puts(b, "( ");
    for (const cJSON *t = type->child; t; t = t->next) {
        if (!cJSON_IsString(t)) return fail(g, BT_ERR_INVALID, "JSON schema 'type' must hold strings");
        if (t != type->child) bt_strbuf_puts(b, " | ");
        if (gen_typed(g, s, t->valuestring, b)) return g->err;
    }
    bt_strbuf_puts(b, " )");
    return BT_OK;
}

/* The rule id standing for schema s (defined once per schema node, so $ref cycles terminate). -1 after an error. */
static int schema_rule(gen *g, const cJSON *s)
{
    if (g->err) return -1;
    for (int i = 0; i < g->n_memo; i++)
        if (g->memo[i].node == s) return g->memo[i].id;
    if (grow(&g->memo, g->n_memo, &g->cap_memo, sizeof *g->memo, 32)) {
        fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
        return -1;
    }
    int id = g->n_rules++;
    g->memo[g->n_memo++] = (memo){s, id};
    if (++g->depth > MAX_SCHEMA_DEPTH) {
        fail(g, BT_ERR_UNSUPPORTED, "JSON schema nested deeper than %d", MAX_SCHEMA_DEPTH);
        return -1;
    }
    bt_strbuf body = {0};
    bt_status st = gen_schema(g, s, &body);
    g->depth--;
    if (!st && body.oom) st = fail(g, BT_ERR_NOMEM, "JSON schema: out of memory");
    if (!st) sb_printf(&g->rules, "s%d ::= ", id), bt_strbuf_puts(&g->rules, body.p), bt_strbuf_puts(&g->rules, "\n");
    free(body.p);
    if (!st && g->rules.n > RTR_SCHEMA_MAX_GRAMMAR)
        st = fail(g, BT_ERR_UNSUPPORTED, "JSON schema compiles to a grammar above %u bytes", RTR_SCHEMA_MAX_GRAMMAR);
    return st ? -1 : id;
}

bt_status rtr_json_schema_grammar(const cJSON *schema, char **out)
{
    gen g = {.root = schema};
    bt_strbuf_puts(&g.rules, "root ::= s0\n");
    bt_strbuf_puts(&g.rules, BASE_RULES);
    bt_strbuf_puts(&g.rules, "ipv4oct ::= \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9]\n");
    int id = schema_rule(&g, schema);
    free(g.memo);
    if (id < 0 || g.rules.oom) {
        free(g.rules.p);
        return g.err ? g.err : bt_fail(BT_ERR_NOMEM, "JSON schema: out of memory");
    }
    /* A $ref cycle that matches nothing before reaching itself ({"$ref": "#"}, or an anyOf that refers back to
     * its own schema first) compiles to a left-recursive grammar: refuse the schema rather than send the nodes a
     * grammar they cannot load (found by fuzz_json_schema). */
    bt_grammar *check = NULL;
    if (bt_grammar_parse(g.rules.p, g.rules.n, &check)) {
        bt_status st = bt_fail(BT_ERR_UNSUPPORTED, "JSON schema $ref cycle that matches nothing before it recurs is "
                                                   "not supported (%.160s)", bt_last_error());
        free(g.rules.p);
        return st;
    }
    bt_grammar_free(check);
    *out = g.rules.p;
    return BT_OK;
}

bt_status rtr_json_schema_rules(const cJSON *const *schemas, size_t n, const char *prefix, int compact, char **out)
{
    gen g = {0};
    /* BASE_RULES starts with the ws rule: a compact grammar replaces it */
    const char *base = BASE_RULES;
    if (compact) {
        bt_strbuf_puts(&g.rules, "ws ::= \" \"?\n");
        base = strchr(BASE_RULES, '\n') + 1;
    }
    bt_strbuf_puts(&g.rules, base);
    bt_strbuf_puts(&g.rules, "ipv4oct ::= \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9]\n");
    bt_strbuf names = {0};
    for (size_t i = 0; i < n; i++) {
        g.root = schemas[i]; /* each schema is the document its own $ref "#..." points into */
        int id = schema_rule(&g, schemas[i]);
        if (id < 0) break;
        sb_printf(&names, "%s%zu ::= s%d\n", prefix, i, id);
    }
    free(g.memo);
    if (g.err || g.rules.oom || names.oom) {
        free(g.rules.p);
        free(names.p);
        return g.err ? g.err : bt_fail(BT_ERR_NOMEM, "JSON schema: out of memory");
    }
    bt_strbuf_put(&g.rules, names.p ? names.p : "", names.n);
    free(names.p);
    if (g.rules.oom) {
        free(g.rules.p);
        return bt_fail(BT_ERR_NOMEM, "JSON schema: out of memory");
    }
    *out = g.rules.p;
    return BT_OK;
}

bt_status rtr_json_object_grammar(char **out)
{
    bt_strbuf b = {0};
    bt_strbuf_puts(&b, "root ::= jobj\n");
    bt_strbuf_puts(&b, BASE_RULES);
    if (b.oom) {
        free(b.p);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    *out = b.p;
    return BT_OK;
}

bt_status rtr_regex_grammar(const char *re, char **out)
{
    bt_strbuf b = {0};
    bt_strbuf_puts(&b, "root ::= ");
    bt_status st = regex_expr(re, 0, &b);
    bt_strbuf_puts(&b, "\n");
    if (!st && b.oom) st = bt_fail(BT_ERR_NOMEM, "regex: out of memory");
    /* A repetition of a part that can match the empty string (^()+x, (a?)*) compiles to a left-recursive rule the
     * nodes refuse: refuse the regex here, naming why (found by fuzz_json_schema). */
    bt_grammar *check = NULL;
    if (!st && bt_grammar_parse(b.p, b.n, &check))
        st = bt_fail(BT_ERR_UNSUPPORTED, "regex: a repetition of a part that can match the empty string is not "
                                         "supported (%.160s)", bt_last_error());
    bt_grammar_free(check);
    if (st) {
        free(b.p);
        return st;
    }
    *out = b.p;
    return BT_OK;
}
