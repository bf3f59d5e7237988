/* Prometheus registry and text exposition; see metrics.h. */
#include "common/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One label set of a family. The public handle types all point at this struct. */
typedef struct series {
    struct series *next;
    struct metrics_family *fam;
    char **values;            /* [fam->n_labels] */
    atomic_uint_fast64_t n;   /* counter: integer part (exact under concurrent inc) */
    atomic_uint_fast64_t f;   /* counter: fractional adds; gauge: value; histogram: sum (all as double bits) */
    atomic_uint_fast64_t *bk; /* histogram: [fam->n_buckets + 1] non-cumulative counts, last = +Inf */
} series_t;

struct metrics_family {
    struct metrics_family *next;
    char *name;
    char *help;
    metrics_type_t type;
    char *label_names[METRICS_MAX_LABELS];
    size_t n_labels;
    double *buckets; /* [n_buckets] upper bounds */
    size_t n_buckets;
    pthread_mutex_t mu; /* guards the series list (not the values) */
    series_t *head, *tail;
    size_t n_series;
};

struct metrics_registry {
    pthread_mutex_t mu; /* guards the family list */
    struct metrics_family *head, *tail;
};

const double METRICS_DEFAULT_BUCKETS[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
const size_t METRICS_DEFAULT_BUCKETS_N = sizeof METRICS_DEFAULT_BUCKETS / sizeof METRICS_DEFAULT_BUCKETS[0];

static uint64_t dbl_bits(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static double bits_dbl(uint64_t u)
{
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static void atomic_add_double(atomic_uint_fast64_t *a, double v)
{
    uint_fast64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, dbl_bits(bits_dbl(old) + v), memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

static double atomic_read_double(const atomic_uint_fast64_t *a)
{
    return bits_dbl(atomic_load_explicit((atomic_uint_fast64_t *)a, memory_order_relaxed));
}

static int valid_metric_name(const char *s)
{
    if (!s || !*s) return 0;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                 (i > 0 && c >= '0' && c <= '9');
        if (!ok) return 0;
    }
    return 1;
}

static int valid_label_name(const char *s)
{
    if (!s || !*s || strncmp(s, "__", 2) == 0) return 0;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (i > 0 && c >= '0' && c <= '9');
        if (!ok) return 0;
    }
    return 1;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

bt_status metrics_registry_create(metrics_registry_t **out)
{
    metrics_registry_t *r = calloc(1, sizeof *r);
    if (!r) return bt_fail(BT_ERR_NOMEM, "metrics: out of memory");
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return BT_OK;
}

static void series_free(series_t *s, size_t n_labels)
{
    if (!s) return;
    if (s->values)
        for (size_t i = 0; i < n_labels; i++) free(s->values[i]);
    free(s->values);
    free(s->bk);
    free(s);
}

static void family_free(struct metrics_family *f)
{
    if (!f) return;
    series_t *s = f->head;
    while (s) {
        series_t *next = s->next;
        series_free(s, f->n_labels);
        s = next;
    }
    for (size_t i = 0; i < f->n_labels; i++) free(f->label_names[i]);
    free(f->name);
    free(f->help);
    free(f->buckets);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void metrics_registry_destroy(metrics_registry_t *r)
{
    if (!r) return;
    struct metrics_family *f = r->head;
    while (f) {
        struct metrics_family *next = f->next;
        family_free(f);
        f = next;
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static bt_status check_desc(const metrics_desc_t *d, const double **buckets, size_t *n_buckets)
{
    if (!d || !valid_metric_name(d->name)) return bt_fail(BT_ERR_INVALID, "metrics: invalid metric name");
    if (!d->help || !*d->help) return bt_fail(BT_ERR_INVALID, "metrics: %s: help text is required", d->name);
    if (d->type != METRICS_COUNTER && d->type != METRICS_GAUGE && d->type != METRICS_HISTOGRAM)
        return bt_fail(BT_ERR_INVALID, "metrics: %s: unknown type %d", d->name, (int)d->type);
    if (d->type == METRICS_COUNTER && !ends_with(d->name, "_total"))
        return bt_fail(BT_ERR_INVALID, "metrics: counter %s must end in _total", d->name);
    if (d->type != METRICS_COUNTER && ends_with(d->name, "_total"))
        return bt_fail(BT_ERR_INVALID, "metrics: %s: only counters end in _total", d->name);
    if (d->type == METRICS_HISTOGRAM &&
        (ends_with(d->name, "_bucket") || ends_with(d->name, "_count") || ends_with(d->name, "_sum")))
        return bt_fail(BT_ERR_INVALID, "metrics: histogram %s must not end in _bucket, _count or _sum", d->name);
    if (d->n_labels > METRICS_MAX_LABELS || (d->n_labels && !d->label_names))
        return bt_fail(BT_ERR_INVALID, "metrics: %s: bad label list", d->name);
    for (size_t i = 0; i < d->n_labels; i++) {
        if (!valid_label_name(d->label_names[i]))
            return bt_fail(BT_ERR_INVALID, "metrics: %s: invalid label name", d->name);
        if (d->type == METRICS_HISTOGRAM && strcmp(d->label_names[i], "le") == 0)
            return bt_fail(BT_ERR_INVALID, "metrics: %s: label \"le\" is reserved for histograms", d->name);
        for (size_t j = 0; j < i; j++)
            if (strcmp(d->label_names[i], d->label_names[j]) == 0)
                return bt_fail(BT_ERR_INVALID, "metrics: %s: duplicate label %s", d->name, d->label_names[i]);
    }
    *buckets = NULL;
    *n_buckets = 0;
    if (d->type != METRICS_HISTOGRAM) return BT_OK;
    const double *b = d->buckets ? d->buckets : METRICS_DEFAULT_BUCKETS;
    size_t n = d->buckets ? d->n_buckets : METRICS_DEFAULT_BUCKETS_N;
    if (n == 0 || n > METRICS_MAX_BUCKETS)
        return bt_fail(BT_ERR_INVALID, "metrics: %s: need 1..%d buckets", d->name, METRICS_MAX_BUCKETS);
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(b[i]) || (i > 0 && !(b[i] > b[i - 1])))
            return bt_fail(BT_ERR_INVALID, "metrics: %s: buckets must be finite and strictly increasing", d->name);
    }
    *buckets = b;
    *n_buckets = n;
    return BT_OK;
}

static int same_shape(const struct metrics_family *f, const metrics_desc_t *d, const double *b, size_t nb)
{
    if (f->type != d->type || f->n_labels != d->n_labels || f->n_buckets != nb) return 0;
    for (size_t i = 0; i < f->n_labels; i++)
        if (strcmp(f->label_names[i], d->label_names[i]) != 0) return 0;
    for (size_t i = 0; i < nb; i++)
        if (f->buckets[i] != b[i]) return 0;
    return 1;
}

bt_status metrics_family_register(metrics_registry_t *r, const metrics_desc_t *desc, metrics_family_t **out)
{
    const double *b;
    size_t nb;
    if (!r) return bt_fail(BT_ERR_INVALID, "metrics: no registry");
    bt_status st = check_desc(desc, &b, &nb);
    if (st != BT_OK) return st;

    pthread_mutex_lock(&r->mu);
    for (struct metrics_family *f = r->head; f; f = f->next) {
        if (strcmp(f->name, desc->name) != 0) continue;
        if (!same_shape(f, desc, b, nb)) {
            pthread_mutex_unlock(&r->mu);
            return bt_fail(BT_ERR_INVALID, "metrics: %s registered again with a different type, labels or buckets",
                           desc->name);
        }
        pthread_mutex_unlock(&r->mu);
        *out = f;
        return BT_OK;
    }

    struct metrics_family *f = calloc(1, sizeof *f);
    if (!f) goto oom;
    pthread_mutex_init(&f->mu, NULL);
    f->type = desc->type;
    f->name = strdup(desc->name);
    f->help = strdup(desc->help);
    if (!f->name || !f->help) goto oom;
    for (size_t i = 0; i < desc->n_labels; i++) {
        f->label_names[i] = strdup(desc->label_names[i]);
        if (!f->label_names[i]) goto oom;
        f->n_labels = i + 1;
    }
    if (nb) {
        f->buckets = malloc(nb * sizeof *f->buckets);
        if (!f->buckets) goto oom;
        memcpy(f->buckets, b, nb * sizeof *b);
        f->n_buckets = nb;
    }
    if (r->tail)
        r->tail->next = f;
    else
        r->head = f;
    r->tail = f;
    pthread_mutex_unlock(&r->mu);
    *out = f;
    return BT_OK;

oom:
    pthread_mutex_unlock(&r->mu);
    family_free(f);
    return bt_fail(BT_ERR_NOMEM, "metrics: out of memory");
}

static bt_status family_series(metrics_family_t *f, metrics_type_t type, const char *const *values, series_t **out)
{
    if (!f) return bt_fail(BT_ERR_INVALID, "metrics: no family");
    if (f->type != type) return bt_fail(BT_ERR_INVALID, "metrics: %s is of another type", f->name);
    if (f->n_labels && !values) return bt_fail(BT_ERR_INVALID, "metrics: %s needs label values", f->name);
    for (size_t i = 0; i < f->n_labels; i++)
        if (!values[i]) return bt_fail(BT_ERR_INVALID, "metrics: %s: NULL label value", f->name);

    pthread_mutex_lock(&f->mu);
    for (series_t *s = f->head; s; s = s->next) {
        size_t i = 0;
        while (i < f->n_labels && strcmp(s->values[i], values[i]) == 0) i++;
        if (i == f->n_labels) {
            pthread_mutex_unlock(&f->mu);
            *out = s;
            return BT_OK;
        }
    }
    if (f->n_series >= METRICS_MAX_SERIES) {
        pthread_mutex_unlock(&f->mu);
        return bt_fail(BT_ERR_EXHAUSTED, "metrics: %s has %d series already", f->name, METRICS_MAX_SERIES);
    }
    series_t *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->fam = f;
    if (f->n_labels) {
        s->values = calloc(f->n_labels, sizeof *s->values);
        if (!s->values) goto oom;
        for (size_t i = 0; i < f->n_labels; i++)
            if (!(s->values[i] = strdup(values[i]))) goto oom;
    }
    atomic_init(&s->n, 0);
    atomic_init(&s->f, dbl_bits(0.0));
    if (type == METRICS_HISTOGRAM) {
        s->bk = calloc(f->n_buckets + 1, sizeof *s->bk);
        if (!s->bk) goto oom;
        for (size_t i = 0; i <= f->n_buckets; i++) atomic_init(&s->bk[i], 0);
    }
    if (f->tail)
        f->tail->next = s;
    else
        f->head = s;
    f->tail = s;
    f->n_series++;
    pthread_mutex_unlock(&f->mu);
    *out = s;
    return BT_OK;

oom:
    pthread_mutex_unlock(&f->mu);
    series_free(s, f->n_labels);
    return bt_fail(BT_ERR_NOMEM, "metrics: out of memory");
}

bt_status metrics_family_counter(metrics_family_t *f, const char *const *label_values, metrics_counter_t **out)
{
    series_t *s;
    bt_status st = family_series(f, METRICS_COUNTER, label_values, &s);
    if (st == BT_OK) *out = (metrics_counter_t *)s;
    return st;
}

bt_status metrics_family_gauge(metrics_family_t *f, const char *const *label_values, metrics_gauge_t **out)
{
    series_t *s;
    bt_status st = family_series(f, METRICS_GAUGE, label_values, &s);
    if (st == BT_OK) *out = (metrics_gauge_t *)s;
    return st;
}

bt_status metrics_family_histogram(metrics_family_t *f, const char *const *label_values, metrics_histogram_t **out)
{
    series_t *s;
    bt_status st = family_series(f, METRICS_HISTOGRAM, label_values, &s);
    if (st == BT_OK) *out = (metrics_histogram_t *)s;
    return st;
}

static bt_status register_plain(metrics_registry_t *r, const char *name, const char *help, metrics_type_t type,
                                const double *buckets, size_t n_buckets, series_t **out)
{
    metrics_desc_t d = {.name = name, .help = help, .type = type, .buckets = buckets, .n_buckets = n_buckets};
    metrics_family_t *f;
    bt_status st = metrics_family_register(r, &d, &f);
    if (st != BT_OK) return st;
    return family_series(f, type, NULL, out);
}

bt_status metrics_counter_register(metrics_registry_t *r, const char *name, const char *help, metrics_counter_t **out)
{
    series_t *s;
    bt_status st = register_plain(r, name, help, METRICS_COUNTER, NULL, 0, &s);
    if (st == BT_OK) *out = (metrics_counter_t *)s;
    return st;
}

bt_status metrics_gauge_register(metrics_registry_t *r, const char *name, const char *help, metrics_gauge_t **out)
{
    series_t *s;
    bt_status st = register_plain(r, name, help, METRICS_GAUGE, NULL, 0, &s);
    if (st == BT_OK) *out = (metrics_gauge_t *)s;
    return st;
}

bt_status metrics_histogram_register(metrics_registry_t *r, const char *name, const char *help,
                                     const double *buckets, size_t n_buckets, metrics_histogram_t **out)
{
    series_t *s;
    bt_status st = register_plain(r, name, help, METRICS_HISTOGRAM, buckets, n_buckets, &s);
    if (st == BT_OK) *out = (metrics_histogram_t *)s;
    return st;
}

void metrics_counter_inc(metrics_counter_t *c)
{
    if (c) atomic_fetch_add_explicit(&((series_t *)c)->n, 1, memory_order_relaxed);
}

void metrics_counter_add(metrics_counter_t *c, uint64_t n)
{
    if (c) atomic_fetch_add_explicit(&((series_t *)c)->n, n, memory_order_relaxed);
}

void metrics_counter_addf(metrics_counter_t *c, double v)
{
    if (c && v > 0) atomic_add_double(&((series_t *)c)->f, v);
}

void metrics_gauge_set(metrics_gauge_t *g, double v)
{
    if (g) atomic_store_explicit(&((series_t *)g)->f, dbl_bits(v), memory_order_relaxed);
}

void metrics_gauge_add(metrics_gauge_t *g, double v)
{
    if (g) atomic_add_double(&((series_t *)g)->f, v);
}

void metrics_gauge_inc(metrics_gauge_t *g)
{
    metrics_gauge_add(g, 1.0);
}

void metrics_gauge_dec(metrics_gauge_t *g)
{
    metrics_gauge_add(g, -1.0);
}

void metrics_histogram_observe(metrics_histogram_t *h, double v)
{
    if (!h || isnan(v)) return;
    series_t *s = (series_t *)h;
    const double *b = s->fam->buckets;
    size_t lo = 0, hi = s->fam->n_buckets; /* first bucket with v <= bound; n_buckets = +Inf */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v <= b[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&s->bk[lo], 1, memory_order_relaxed);
    atomic_add_double(&s->f, v);
}

double metrics_counter_value(const metrics_counter_t *c)
{
    if (!c) return 0;
    const series_t *s = (const series_t *)c;
    return (double)atomic_load_explicit((atomic_uint_fast64_t *)&s->n, memory_order_relaxed) +
           atomic_read_double(&s->f);
}

double metrics_gauge_value(const metrics_gauge_t *g)
{
    return g ? atomic_read_double(&((const series_t *)g)->f) : 0;
}

uint64_t metrics_histogram_count(const metrics_histogram_t *h)
{
    if (!h) return 0;
    const series_t *s = (const series_t *)h;
    uint64_t n = 0;
    for (size_t i = 0; i <= s->fam->n_buckets; i++)
        n += atomic_load_explicit((atomic_uint_fast64_t *)&s->bk[i], memory_order_relaxed);
    return n;
}

double metrics_histogram_sum(const metrics_histogram_t *h)
{
    return h ? atomic_read_double(&((const series_t *)h)->f) : 0;
}

/* A growing output buffer; after an allocation failure every append is a no-op and oom stays set. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf_t;

static void sb_reserve(sbuf_t *b, size_t extra)
{
    if (b->oom || b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static void sb_put(sbuf_t *b, const char *s, size_t n)
{
    sb_reserve(b, n);
    if (b->oom) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_str(sbuf_t *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

/* Escapes \ and newline (HELP text), plus " when quote is set (label values). */
static void sb_escaped(sbuf_t *b, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            sb_put(b, "\\\\", 2);
        else if (*s == '\n')
            sb_put(b, "\\n", 2);
        else if (quote && *s == '"')
            sb_put(b, "\\\"", 2);
        else
            sb_put(b, s, 1);
    }
}

/* Shortest text that reads back as the same double; Prometheus spellings for the special values. */
static void fmt_double(char out[40], double v)
{
    if (isnan(v)) {
        strcpy(out, "NaN");
        return;
    }
    if (isinf(v)) {
        strcpy(out, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(out, 40, "%.0f", v);
        return;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(out, 40, "%.*g", prec, v);
        if (strtod(out, NULL) == v) return;
    }
}

static void sb_double(sbuf_t *b, double v)
{
    char tmp[40];
    fmt_double(tmp, v);
    sb_str(b, tmp);
}

/* name{l1="v1",...[,le="x"]} */
static void sb_series_name(sbuf_t *b, const struct metrics_family *f, const series_t *s, const char *suffix,
                           const char *le)
{
    sb_str(b, f->name);
    sb_str(b, suffix);
    if (f->n_labels == 0 && !le) return;
    sb_put(b, "{", 1);
    for (size_t i = 0; i < f->n_labels; i++) {
        if (i) sb_put(b, ",", 1);
        sb_str(b, f->label_names[i]);
        sb_put(b, "=\"", 2);
        sb_escaped(b, s->values[i], 1);
        sb_put(b, "\"", 1);
    }
    if (le) {
        if (f->n_labels) sb_put(b, ",", 1);
        sb_str(b, "le=\"");
        sb_str(b, le);
        sb_put(b, "\"", 1);
    }
    sb_put(b, "}", 1);
}

static void expose_series(sbuf_t *b, const struct metrics_family *f, const series_t *s)
{
    char num[40];
    if (f->type == METRICS_COUNTER || f->type == METRICS_GAUGE) {
        sb_series_name(b, f, s, "", NULL);
        sb_put(b, " ", 1);
        sb_double(b, f->type == METRICS_COUNTER ? metrics_counter_value((const metrics_counter_t *)s)
                                                : metrics_gauge_value((const metrics_gauge_t *)s));
        sb_put(b, "\n", 1);
        return;
    }
    uint64_t cum = 0;
    for (size_t i = 0; i <= f->n_buckets; i++) {
        cum += atomic_load_explicit((atomic_uint_fast64_t *)&s->bk[i], memory_order_relaxed);
        if (i < f->n_buckets)
            fmt_double(num, f->buckets[i]);
        else
            strcpy(num, "+Inf");
        sb_series_name(b, f, s, "_bucket", num);
        snprintf(num, sizeof num, " %llu\n", (unsigned long long)cum);
        sb_str(b, num);
    }
    sb_series_name(b, f, s, "_sum", NULL);
    sb_put(b, " ", 1);
    sb_double(b, atomic_read_double(&s->f));
    sb_put(b, "\n", 1);
    sb_series_name(b, f, s, "_count", NULL);
    snprintf(num, sizeof num, " %llu\n", (unsigned long long)cum);
    sb_str(b, num);
}

bt_status metrics_expose(metrics_registry_t *r, char **out, size_t *len)
{
    static const char *const type_names[] = {"counter", "gauge", "histogram"};
    sbuf_t b = {0};
    if (!r) return bt_fail(BT_ERR_INVALID, "metrics: no registry");
    sb_reserve(&b, 0);
    pthread_mutex_lock(&r->mu);
    for (struct metrics_family *f = r->head; f; f = f->next) {
        sb_str(&b, "# HELP ");
        sb_str(&b, f->name);
        sb_put(&b, " ", 1);
        sb_escaped(&b, f->help, 0);
        sb_str(&b, "\n# TYPE ");
        sb_str(&b, f->name);
        sb_put(&b, " ", 1);
        sb_str(&b, type_names[f->type]);
        sb_put(&b, "\n", 1);
        pthread_mutex_lock(&f->mu);
        for (const series_t *s = f->head; s; s = s->next) expose_series(&b, f, s);
        pthread_mutex_unlock(&f->mu);
    }
    pthread_mutex_unlock(&r->mu);
    if (b.oom) {
        free(b.p);
        return bt_fail(BT_ERR_NOMEM, "metrics: out of memory");
    }
    *out = b.p;
    *len = b.len;
    return BT_OK;
}

static const char *const LABEL_STATUS[] = {"status"};
static const char *const LABEL_ROLE[] = {"role"};
static const char *const LABEL_PROPOSER[] = {"proposer"};
static const double SPEC_LEN_BUCKETS[] = {0, 1, 2, 3, 4, 6, 8, 12, 16};
static const double TTFT_BUCKETS[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                                      0.75,  1,    2.5,   5,    7.5,   10,  20,   40,  80};
static const double TPOT_BUCKETS[] = {0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                      0.1,   0.15, 0.2,   0.3,  0.4,   0.5,  0.75, 1,    2.5};
static const double E2E_BUCKETS[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 300, 600};
static const double XFER_BUCKETS[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                      0.1,    0.25,  0.5,    1,     2.5,  5,     10, 30};
#define NB(a) (sizeof(a) / sizeof((a)[0]))

static const metrics_desc_t STD_DESCS[METRICS_STD_COUNT] = {
    [METRICS_STD_TTFT] = {BT_METRIC_TTFT, "Time from request arrival to the first output token, in seconds.",
                          METRICS_HISTOGRAM, NULL, 0, TTFT_BUCKETS, NB(TTFT_BUCKETS)},
    [METRICS_STD_TPOT] = {BT_METRIC_TPOT, "Time between consecutive output tokens of a request, in seconds.",
                          METRICS_HISTOGRAM, NULL, 0, TPOT_BUCKETS, NB(TPOT_BUCKETS)},
    [METRICS_STD_E2E_LATENCY] = {BT_METRIC_E2E_LATENCY, "Time from request arrival to its last token, in seconds.",
                                 METRICS_HISTOGRAM, NULL, 0, E2E_BUCKETS, NB(E2E_BUCKETS)},
    [METRICS_STD_QUEUE_TIME] = {BT_METRIC_QUEUE_TIME, "Time a request waited before it was scheduled, in seconds.",
                                METRICS_HISTOGRAM, NULL, 0, TTFT_BUCKETS, NB(TTFT_BUCKETS)},
    [METRICS_STD_REQUESTS] = {BT_METRIC_REQUESTS, "Finished requests by final status.", METRICS_COUNTER,
                              LABEL_STATUS, 1, NULL, 0},
    [METRICS_STD_PROMPT_TOKENS] = {BT_METRIC_PROMPT_TOKENS, "Prompt tokens processed.", METRICS_COUNTER, NULL, 0,
                                   NULL, 0},
    [METRICS_STD_GENERATION_TOKENS] = {BT_METRIC_GENERATION_TOKENS, "Output tokens generated.", METRICS_COUNTER,
                                       NULL, 0, NULL, 0},
    [METRICS_STD_KV_BLOCKS_USED] = {BT_METRIC_KV_BLOCKS_USED, "KV cache blocks in use.", METRICS_GAUGE, NULL, 0,
                                    NULL, 0},
    [METRICS_STD_KV_BLOCKS_CAPACITY] = {BT_METRIC_KV_BLOCKS_CAPACITY, "KV cache blocks in the pool.", METRICS_GAUGE,
                                        NULL, 0, NULL, 0},
    [METRICS_STD_PREFIX_CACHE_HITS] = {BT_METRIC_PREFIX_CACHE_HITS, "Prompt blocks found in the prefix cache.",
                                       METRICS_COUNTER, NULL, 0, NULL, 0},
    [METRICS_STD_PREFIX_CACHE_QUERIES] = {BT_METRIC_PREFIX_CACHE_QUERIES,
                                          "Prompt blocks looked up in the prefix cache.", METRICS_COUNTER, NULL, 0,
                                          NULL, 0},
    [METRICS_STD_KV_TRANSFER_BYTES] = {BT_METRIC_KV_TRANSFER_BYTES, "KV cache bytes moved between nodes.",
                                       METRICS_COUNTER, NULL, 0, NULL, 0},
    [METRICS_STD_KV_TRANSFER_SECONDS] = {BT_METRIC_KV_TRANSFER_SECONDS,
                                         "Duration of one request's KV cache transfer, in seconds.", METRICS_HISTOGRAM,
                                         NULL, 0, XFER_BUCKETS, NB(XFER_BUCKETS)},
    [METRICS_STD_SPEC_ACCEPTED] = {BT_METRIC_SPEC_ACCEPTED, "Speculative draft tokens accepted.", METRICS_COUNTER,
                                   LABEL_PROPOSER, 1, NULL, 0},
    [METRICS_STD_SPEC_PROPOSED] = {BT_METRIC_SPEC_PROPOSED, "Speculative draft tokens proposed.", METRICS_COUNTER,
                                   LABEL_PROPOSER, 1, NULL, 0},
    [METRICS_STD_SPEC_ACCEPTED_LENGTH] = {BT_METRIC_SPEC_ACCEPTED_LENGTH,
                                          "Draft tokens accepted per verification (one sequence's step with drafts).",
                                          METRICS_HISTOGRAM, LABEL_PROPOSER, 1, SPEC_LEN_BUCKETS,
                                          NB(SPEC_LEN_BUCKETS)},
    [METRICS_STD_RUNNING_SEQUENCES] = {BT_METRIC_RUNNING_SEQUENCES, "Sequences in the running batch.", METRICS_GAUGE,
                                       NULL, 0, NULL, 0},
    [METRICS_STD_WAITING_REQUESTS] = {BT_METRIC_WAITING_REQUESTS, "Requests waiting to be scheduled.", METRICS_GAUGE,
                                      NULL, 0, NULL, 0},
    [METRICS_STD_MIGRATIONS] = {BT_METRIC_MIGRATIONS, "Streams moved to another decode node after a failure.",
                                METRICS_COUNTER, NULL, 0, NULL, 0},
    [METRICS_STD_PLANNER_DESIRED_REPLICAS] = {BT_METRIC_PLANNER_DESIRED_REPLICAS,
                                              "Replicas per role the planner asks for.", METRICS_GAUGE, LABEL_ROLE, 1,
                                              NULL, 0},
};

const metrics_desc_t *metrics_std_desc(metrics_std_t id)
{
    if ((int)id < 0 || id >= METRICS_STD_COUNT) return NULL;
    return &STD_DESCS[id];
}

bt_status metrics_std_register(metrics_registry_t *r, metrics_std_t id, metrics_family_t **out)
{
    const metrics_desc_t *d = metrics_std_desc(id);
    if (!d) return bt_fail(BT_ERR_INVALID, "metrics: unknown standard metric %d", (int)id);
    return metrics_family_register(r, d, out);
}

bt_status metrics_std_counter(metrics_registry_t *r, metrics_std_t id, metrics_counter_t **out)
{
    metrics_family_t *f;
    bt_status st = metrics_std_register(r, id, &f);
    return st ? st : metrics_family_counter(f, NULL, out);
}

bt_status metrics_std_gauge(metrics_registry_t *r, metrics_std_t id, metrics_gauge_t **out)
{
    metrics_family_t *f;
    bt_status st = metrics_std_register(r, id, &f);
    return st ? st : metrics_family_gauge(f, NULL, out);
}

bt_status metrics_std_histogram(metrics_registry_t *r, metrics_std_t id, metrics_histogram_t **out)
{
    metrics_family_t *f;
    bt_status st = metrics_std_register(r, id, &f);
    return st ? st : metrics_family_histogram(f, NULL, out);
}
