#include "common/metrics.h"
#include "test_util.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Value of the exposition line that starts with `series ` exactly (name plus labels), or NAN if absent. */
static double line_value(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ') {
            const char *v = p + n + 1;
            if (strncmp(v, "+Inf", 4) == 0) return INFINITY;
            return strtod(v, NULL);
        }
        p = strchr(p, '\n');
        if (p) p++;
    }
    return NAN;
}

static int has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = text; p && *p;) {
        if (strncmp(p, line, n) == 0 && (p[n] == '\n' || p[n] == 0)) return 1;
        p = strchr(p, '\n');
        if (p) p++;
    }
    return 0;
}

/* Runs `promtool check metrics` on text; returns its exit status, or -1 (a recorded skip) when promtool is not
 * installed. */
static int promtool_check(const char *text)
{
    if (system("command -v promtool >/dev/null 2>&1") != 0) {
        test_skip("promtool check metrics: promtool not installed");
        return -1;
    }
    const char *dir = test_tmpdir();
    char path[512], cmd[1200];
    snprintf(path, sizeof path, "%s/metrics.txt", dir);
    if (test_write_file(path, text, strlen(text)) != 0) return -2;
    snprintf(cmd, sizeof cmd, "promtool check metrics < '%s'", path);
    int rc = system(cmd);
    return rc == -1 ? -2 : WEXITSTATUS(rc);
}

static void test_counter_gauge_histogram(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    metrics_counter_t *c;
    metrics_gauge_t *g;
    metrics_histogram_t *h;
    REQUIRE(metrics_counter_register(r, "test_events_total", "Events seen.", &c) == BT_OK);
    REQUIRE(metrics_gauge_register(r, "test_queue_depth", "Items queued.", &g) == BT_OK);
    static const double b[] = {0.1, 0.5, 1};
    REQUIRE(metrics_histogram_register(r, "test_latency_seconds", "Latency.", b, 3, &h) == BT_OK);

    metrics_counter_inc(c);
    metrics_counter_add(c, 41);
    metrics_counter_addf(c, 0.5);
    metrics_counter_addf(c, -3); /* ignored: counters only go up */
    metrics_gauge_set(g, 10);
    metrics_gauge_dec(g);
    metrics_gauge_add(g, -2.25);
    const double obs[] = {0.05, 0.1, 0.2, 0.7, 3, NAN};
    for (size_t i = 0; i < 6; i++) metrics_histogram_observe(h, obs[i]);
    metrics_counter_inc(NULL); /* NULL handles are no-ops */
    metrics_histogram_observe(NULL, 1);

    CHECK(metrics_counter_value(c) == 42.5);
    CHECK(metrics_gauge_value(g) == 6.75);
    CHECK(metrics_histogram_count(h) == 5);
    CHECK(fabs(metrics_histogram_sum(h) - 4.05) < 1e-12);

    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(strlen(text) == len);
    CHECK(has_line(text, "# HELP test_events_total Events seen."));
    CHECK(has_line(text, "# TYPE test_events_total counter"));
    CHECK(has_line(text, "# TYPE test_queue_depth gauge"));
    CHECK(has_line(text, "# TYPE test_latency_seconds histogram"));
    CHECK(line_value(text, "test_events_total") == 42.5);
    CHECK(line_value(text, "test_queue_depth") == 6.75);
    CHECK(has_line(text, "test_latency_seconds_bucket{le=\"0.1\"} 2"));
    CHECK(has_line(text, "test_latency_seconds_bucket{le=\"0.5\"} 3"));
    CHECK(has_line(text, "test_latency_seconds_bucket{le=\"1\"} 4"));
    CHECK(has_line(text, "test_latency_seconds_bucket{le=\"+Inf\"} 5"));
    CHECK(has_line(text, "test_latency_seconds_count 5"));
    CHECK(fabs(line_value(text, "test_latency_seconds_sum") - 4.05) < 1e-12);
    /* order: HELP then TYPE then samples, families in registration order */
    const char *help = strstr(text, "# HELP test_latency_seconds");
    const char *type = strstr(text, "# TYPE test_latency_seconds");
    const char *first = strstr(text, "test_latency_seconds_bucket");
    CHECK(help && type && first && help < type && type < first);
    CHECK(strstr(text, "test_events_total") < strstr(text, "test_queue_depth"));
    int rc = promtool_check(text);
    CHECK_MSG(rc == 0 || rc == -1, "promtool exit %d on:\n%s", rc, text);
    free(text);
    metrics_registry_destroy(r);
}

static void test_labels_and_escaping(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    static const char *const names[] = {"status", "route"};
    metrics_desc_t d = {.name = "test_requests_total", .help = "Requests with \\ and\nnewline.",
                        .type = METRICS_COUNTER, .label_names = names, .n_labels = 2};
    metrics_family_t *f, *f2;
    REQUIRE(metrics_family_register(r, &d, &f) == BT_OK);
    REQUIRE(metrics_family_register(r, &d, &f2) == BT_OK); /* same shape: same family */
    CHECK(f == f2);
    metrics_counter_t *ok, *ok2, *weird;
    REQUIRE(metrics_family_counter(f, (const char *const[]){"ok", "/v1/chat"}, &ok) == BT_OK);
    REQUIRE(metrics_family_counter(f, (const char *const[]){"ok", "/v1/chat"}, &ok2) == BT_OK);
    CHECK(ok == ok2);
    REQUIRE(metrics_family_counter(f, (const char *const[]){"a\"b\\c\nd", "é"}, &weird) == BT_OK);
    CHECK(ok != weird);
    metrics_counter_add(ok, 3);
    metrics_counter_inc(weird);
    metrics_gauge_t *wrong;
    CHECK(metrics_family_gauge(f, (const char *const[]){"x", "y"}, &wrong) == BT_ERR_INVALID);
    CHECK(metrics_family_counter(f, NULL, &ok2) == BT_ERR_INVALID);

    metrics_family_t *hf;
    static const char *const role[] = {"role"};
    metrics_desc_t hd = {.name = "test_wait_seconds", .help = "Wait.", .type = METRICS_HISTOGRAM,
                         .label_names = role, .n_labels = 1};
    REQUIRE(metrics_family_register(r, &hd, &hf) == BT_OK);
    metrics_histogram_t *hp;
    REQUIRE(metrics_family_histogram(hf, (const char *const[]){"prefill"}, &hp) == BT_OK);
    metrics_histogram_observe(hp, 0.02);
    /* an unused family is exposed with HELP/TYPE only */
    metrics_family_t *empty;
    static const char *const role2[] = {"role"};
    metrics_desc_t ed = {.name = "test_replicas", .help = "Replicas.", .type = METRICS_GAUGE, .label_names = role2,
                         .n_labels = 1};
    REQUIRE(metrics_family_register(r, &ed, &empty) == BT_OK);

    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(has_line(text, "# HELP test_requests_total Requests with \\\\ and\\nnewline."));
    CHECK(has_line(text, "test_requests_total{status=\"ok\",route=\"/v1/chat\"} 3"));
    CHECK(has_line(text, "test_requests_total{status=\"a\\\"b\\\\c\\nd\",route=\"é\"} 1"));
    CHECK(has_line(text, "test_wait_seconds_bucket{role=\"prefill\",le=\"0.01\"} 0"));
    CHECK(has_line(text, "test_wait_seconds_bucket{role=\"prefill\",le=\"0.025\"} 1"));
    CHECK(has_line(text, "test_wait_seconds_bucket{role=\"prefill\",le=\"+Inf\"} 1"));
    CHECK(has_line(text, "test_wait_seconds_count{role=\"prefill\"} 1"));
    CHECK(has_line(text, "# TYPE test_replicas gauge"));
    int rc = promtool_check(text);
    CHECK_MSG(rc == 0 || rc == -1, "promtool exit %d on:\n%s", rc, text);
    free(text);
    metrics_registry_destroy(r);
}

static void test_rejects_bad_definitions(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    metrics_counter_t *c;
    metrics_gauge_t *g;
    metrics_histogram_t *h;
    CHECK(metrics_counter_register(r, "no_suffix", "x", &c) == BT_ERR_INVALID);
    CHECK(metrics_counter_register(r, "9starts_with_digit_total", "x", &c) == BT_ERR_INVALID);
    CHECK(metrics_counter_register(r, "has-dash_total", "x", &c) == BT_ERR_INVALID);
    CHECK(metrics_counter_register(r, "fine_total", "", &c) == BT_ERR_INVALID);
    CHECK(metrics_gauge_register(r, "gauge_total", "x", &g) == BT_ERR_INVALID);
    static const double unsorted[] = {1, 0.5};
    static const double inf[] = {1, INFINITY};
    CHECK(metrics_histogram_register(r, "h_seconds", "x", unsorted, 2, &h) == BT_ERR_INVALID);
    CHECK(metrics_histogram_register(r, "h_seconds", "x", inf, 2, &h) == BT_ERR_INVALID);
    CHECK(metrics_histogram_register(r, "h_count", "x", NULL, 0, &h) == BT_ERR_INVALID);
    static const char *const le[] = {"le"};
    static const char *const dunder[] = {"__x"};
    static const char *const dup[] = {"a", "a"};
    metrics_desc_t d = {.name = "h2_seconds", .help = "x", .type = METRICS_HISTOGRAM, .label_names = le,
                        .n_labels = 1};
    metrics_family_t *f;
    CHECK(metrics_family_register(r, &d, &f) == BT_ERR_INVALID);
    d.type = METRICS_GAUGE;
    d.label_names = dunder;
    CHECK(metrics_family_register(r, &d, &f) == BT_ERR_INVALID);
    d.label_names = dup;
    d.n_labels = 2;
    CHECK(metrics_family_register(r, &d, &f) == BT_ERR_INVALID);
    /* same name, other shape */
    REQUIRE(metrics_gauge_register(r, "shape", "x", &g) == BT_OK);
    CHECK(metrics_histogram_register(r, "shape", "x", NULL, 0, &h) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "shape") != NULL);
    metrics_registry_destroy(r);
}

static void test_std_metrics(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    for (int i = 0; i < METRICS_STD_COUNT; i++) {
        metrics_family_t *f;
        CHECK_MSG(metrics_std_register(r, (metrics_std_t)i, &f) == BT_OK, "%d: %s", i, bt_last_error());
    }
    CHECK(metrics_std_desc(METRICS_STD_COUNT) == NULL);
    metrics_family_t *req, *ttft, *roles;
    REQUIRE(metrics_std_register(r, METRICS_STD_REQUESTS, &req) == BT_OK);
    REQUIRE(metrics_std_register(r, METRICS_STD_TTFT, &ttft) == BT_OK);
    REQUIRE(metrics_std_register(r, METRICS_STD_PLANNER_DESIRED_REPLICAS, &roles) == BT_OK);
    metrics_counter_t *ok;
    metrics_histogram_t *h;
    metrics_gauge_t *g;
    REQUIRE(metrics_family_counter(req, (const char *const[]){"ok"}, &ok) == BT_OK);
    REQUIRE(metrics_family_histogram(ttft, NULL, &h) == BT_OK);
    REQUIRE(metrics_family_gauge(roles, (const char *const[]){"decode"}, &g) == BT_OK);
    metrics_counter_inc(ok);
    metrics_histogram_observe(h, 0.123);
    metrics_gauge_set(g, 3);
    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(has_line(text, BT_METRIC_REQUESTS "{status=\"ok\"} 1"));
    CHECK(has_line(text, BT_METRIC_TTFT "_bucket{le=\"0.15\"} 1"));
    CHECK(has_line(text, BT_METRIC_PLANNER_DESIRED_REPLICAS "{role=\"decode\"} 3"));
    CHECK(strstr(text, "# TYPE " BT_METRIC_KV_BLOCKS_USED " gauge") != NULL);
    int rc = promtool_check(text);
    CHECK_MSG(rc == 0 || rc == -1, "promtool exit %d on:\n%s", rc, text);
    free(text);
    metrics_registry_destroy(r);
}

/* The one-line forms give the same series as register + family_*, and refuse a family with labels or of another
 * type. */
static void test_std_series_shortcuts(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    metrics_histogram_t *h1, *h2;
    metrics_counter_t *c;
    metrics_gauge_t *g;
    REQUIRE(metrics_std_histogram(r, METRICS_STD_TTFT, &h1) == BT_OK);
    metrics_family_t *f;
    REQUIRE(metrics_std_register(r, METRICS_STD_TTFT, &f) == BT_OK);
    REQUIRE(metrics_family_histogram(f, NULL, &h2) == BT_OK);
    CHECK(h1 == h2);
    REQUIRE(metrics_std_counter(r, METRICS_STD_PROMPT_TOKENS, &c) == BT_OK);
    REQUIRE(metrics_std_gauge(r, METRICS_STD_KV_BLOCKS_USED, &g) == BT_OK);
    metrics_counter_add(c, 5);
    metrics_gauge_set(g, 7);
    metrics_histogram_observe(h1, 0.123);
    CHECK(metrics_std_counter(r, METRICS_STD_TTFT, &c) != BT_OK);         /* a histogram family */
    CHECK(metrics_std_gauge(r, METRICS_STD_PROMPT_TOKENS, &g) != BT_OK);  /* a counter family */
    CHECK(metrics_std_counter(r, METRICS_STD_REQUESTS, &c) != BT_OK);     /* labelled by status */
    CHECK(metrics_std_histogram(r, METRICS_STD_COUNT, &h2) == BT_ERR_INVALID);
    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(has_line(text, BT_METRIC_PROMPT_TOKENS " 5"));
    CHECK(has_line(text, BT_METRIC_KV_BLOCKS_USED " 7"));
    CHECK(has_line(text, BT_METRIC_TTFT "_count 1"));
    free(text);
    metrics_registry_destroy(r);
}

typedef struct hammer {
    metrics_registry_t *r;
    metrics_counter_t *c;
    metrics_gauge_t *g;
    metrics_histogram_t *h;
    metrics_family_t *f;
    int id;
} hammer_t;

#define HAMMER_THREADS 8
#define HAMMER_ITERS 50000

static void *hammer_main(void *arg)
{
    hammer_t *hm = arg;
    metrics_counter_t *mine;
    char label[16];
    snprintf(label, sizeof label, "t%d", hm->id % 2); /* threads race to create the same series */
    if (metrics_family_counter(hm->f, (const char *const[]){label}, &mine) != BT_OK) return NULL;
    for (int i = 0; i < HAMMER_ITERS; i++) {
        metrics_counter_inc(hm->c);
        metrics_counter_addf(hm->c, 0.5);
        metrics_gauge_inc(hm->g);
        metrics_histogram_observe(hm->h, (i % 4) * 0.25);
        metrics_counter_inc(mine);
        if (i % 5000 == 0) { /* exposition concurrent with updates must be safe */
            char *text;
            size_t len;
            if (metrics_expose(hm->r, &text, &len) == BT_OK) free(text);
        }
    }
    return NULL;
}

static void test_concurrent_updates(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    hammer_t base = {.r = r};
    static const double b[] = {0.25, 0.5};
    REQUIRE(metrics_counter_register(r, "hammer_total", "x", &base.c) == BT_OK);
    REQUIRE(metrics_gauge_register(r, "hammer_gauge", "x", &base.g) == BT_OK);
    REQUIRE(metrics_histogram_register(r, "hammer_seconds", "x", b, 2, &base.h) == BT_OK);
    static const char *const lbl[] = {"thread"};
    metrics_desc_t d = {.name = "hammer_by_thread_total", .help = "x", .type = METRICS_COUNTER,
                        .label_names = lbl, .n_labels = 1};
    REQUIRE(metrics_family_register(r, &d, &base.f) == BT_OK);
    pthread_t th[HAMMER_THREADS];
    hammer_t args[HAMMER_THREADS];
    for (int i = 0; i < HAMMER_THREADS; i++) {
        args[i] = base;
        args[i].id = i;
        REQUIRE(pthread_create(&th[i], NULL, hammer_main, &args[i]) == 0);
    }
    for (int i = 0; i < HAMMER_THREADS; i++) pthread_join(th[i], NULL);
    const double n = (double)HAMMER_THREADS * HAMMER_ITERS;
    CHECK(metrics_counter_value(base.c) == n * 1.5);
    CHECK(metrics_gauge_value(base.g) == n);
    CHECK(metrics_histogram_count(base.h) == (uint64_t)n);
    CHECK(metrics_histogram_sum(base.h) == n / 4 * (0 + 0.25 + 0.5 + 0.75));
    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(line_value(text, "hammer_by_thread_total{thread=\"t0\"}") == n / 2);
    CHECK(line_value(text, "hammer_by_thread_total{thread=\"t1\"}") == n / 2);
    CHECK(line_value(text, "hammer_seconds_bucket{le=\"0.25\"}") == n / 2);
    CHECK(line_value(text, "hammer_seconds_bucket{le=\"0.5\"}") == n * 3 / 4);
    CHECK(line_value(text, "hammer_seconds_bucket{le=\"+Inf\"}") == n);
    free(text);
    metrics_registry_destroy(r);
}

static void test_number_format(void)
{
    metrics_registry_t *r;
    REQUIRE(metrics_registry_create(&r) == BT_OK);
    metrics_gauge_t *a, *b, *c, *d;
    REQUIRE(metrics_gauge_register(r, "fmt_alpha", "x", &a) == BT_OK);
    REQUIRE(metrics_gauge_register(r, "fmt_beta", "x", &b) == BT_OK);
    REQUIRE(metrics_gauge_register(r, "fmt_gamma", "x", &c) == BT_OK);
    REQUIRE(metrics_gauge_register(r, "fmt_delta", "x", &d) == BT_OK);
    metrics_gauge_set(a, 0.1);
    metrics_gauge_set(b, -INFINITY);
    metrics_gauge_set(c, 1e20);
    metrics_gauge_set(d, 123456789012.0);
    char *text;
    size_t len;
    REQUIRE(metrics_expose(r, &text, &len) == BT_OK);
    CHECK(has_line(text, "fmt_alpha 0.1"));
    CHECK(has_line(text, "fmt_beta -Inf"));
    CHECK(line_value(text, "fmt_gamma") == 1e20);
    CHECK(has_line(text, "fmt_delta 123456789012"));
    int rc = promtool_check(text);
    CHECK_MSG(rc == 0 || rc == -1, "promtool exit %d on:\n%s", rc, text);
    free(text);
    metrics_registry_destroy(r);
}

int main(void)
{
    RUN(test_counter_gauge_histogram);
    RUN(test_labels_and_escaping);
    RUN(test_rejects_bad_definitions);
    RUN(test_std_metrics);
    RUN(test_std_series_shortcuts);
    RUN(test_concurrent_updates);
    RUN(test_number_format);
    test_tmpdir_cleanup();
    return test_summary();
}
