/* Prometheus metrics: a registry of counters, gauges and histograms with label sets, and the text exposition
 * format 0.0.4 (what `promtool check metrics` and a Prometheus scrape read).
 *
 * There is no global registry: a process creates one metrics_registry_t and passes it to the modules that
 * record into it (and to http_server for its /metrics route). A metric *family* has a name, help text, a type
 * and a fixed list of label names; each distinct tuple of label values is a *series* (a counter, gauge or
 * histogram handle). Looking a series up takes the family's lock, so hot paths look it up once and keep the
 * handle: updates on a handle are lock-free atomics, safe from any thread. Handles stay valid until the
 * registry is destroyed.
 *
 * Errors: BT_ERR_INVALID (bad name, label or bucket list, or a name re-registered with a different shape),
 * BT_ERR_EXHAUSTED (a family reached METRICS_MAX_SERIES), BT_ERR_NOMEM. bt_last_error() says which. */
#ifndef BATON_COMMON_METRICS_H
#define BATON_COMMON_METRICS_H

#include "common/status.h"

#include <stddef.h>
#include <stdint.h>

#define METRICS_MAX_LABELS 8
#define METRICS_MAX_BUCKETS 64
#define METRICS_MAX_SERIES 10000 /* per family: guards against unbounded label cardinality */

typedef enum metrics_type {
    METRICS_COUNTER = 0,
    METRICS_GAUGE = 1,
    METRICS_HISTOGRAM = 2,
} metrics_type_t;

typedef struct metrics_registry metrics_registry_t;
typedef struct metrics_family metrics_family_t;
typedef struct metrics_counter metrics_counter_t;
typedef struct metrics_gauge metrics_gauge_t;
typedef struct metrics_histogram metrics_histogram_t;

typedef struct metrics_desc {
    const char *name;                /* [a-zA-Z_:][a-zA-Z0-9_:]*; counters must end in "_total" (promtool lint) */
    const char *help;                /* non-empty (promtool lint); any bytes, escaped on output */
    metrics_type_t type;
    const char *const *label_names;  /* n_labels names, [a-zA-Z_][a-zA-Z0-9_]*, no "__" prefix, no "le" */
    size_t n_labels;
    const double *buckets;           /* histograms: finite, strictly increasing upper bounds (+Inf is implied);
                                      * NULL: METRICS_DEFAULT_BUCKETS */
    size_t n_buckets;
} metrics_desc_t;

/* Creates an empty registry. Returns BT_ERR_NOMEM; *out set only on success. */
bt_status metrics_registry_create(metrics_registry_t **out);

/* Frees the registry and every family and handle in it. No thread may still use a handle. NULL is a no-op. */
void metrics_registry_destroy(metrics_registry_t *r);

/* Registers a family (strings and buckets are copied). Registering a name again with the same type, labels
 * and buckets returns the existing family, so two modules may both declare a metric; a different shape is
 * BT_ERR_INVALID. Thread-safe; takes the registry lock. */
bt_status metrics_family_register(metrics_registry_t *r, const metrics_desc_t *desc, metrics_family_t **out);

/* The series of a family for label_values (one per label name, in order; NULL when the family has no labels),
 * created at zero on first use. Values are copied; any UTF-8 is allowed (escaped on output).
 * BT_ERR_INVALID when the family is of another type. Thread-safe; takes the family lock: cache the handle. */
bt_status metrics_family_counter(metrics_family_t *f, const char *const *label_values, metrics_counter_t **out);
bt_status metrics_family_gauge(metrics_family_t *f, const char *const *label_values, metrics_gauge_t **out);
bt_status metrics_family_histogram(metrics_family_t *f, const char *const *label_values,
                                   metrics_histogram_t **out);

/* Shortcuts for a family without labels: register (or find) it and return its only series. */
bt_status metrics_counter_register(metrics_registry_t *r, const char *name, const char *help,
                                   metrics_counter_t **out);
bt_status metrics_gauge_register(metrics_registry_t *r, const char *name, const char *help, metrics_gauge_t **out);
bt_status metrics_histogram_register(metrics_registry_t *r, const char *name, const char *help,
                                     const double *buckets, size_t n_buckets, metrics_histogram_t **out);

/* Updates: lock-free, thread-safe, can't fail. A NULL handle is a no-op, so optional metrics need no checks.
 * Counters only go up: metrics_counter_addf ignores negative and NaN amounts. */
void metrics_counter_inc(metrics_counter_t *c);
void metrics_counter_add(metrics_counter_t *c, uint64_t n);
void metrics_counter_addf(metrics_counter_t *c, double v);
void metrics_gauge_set(metrics_gauge_t *g, double v);
void metrics_gauge_add(metrics_gauge_t *g, double v);
void metrics_gauge_inc(metrics_gauge_t *g);
void metrics_gauge_dec(metrics_gauge_t *g);
void metrics_histogram_observe(metrics_histogram_t *h, double v);

/* Current values (for tests and for processes that publish their own load, e.g. into etcd). NULL reads 0. */
double metrics_counter_value(const metrics_counter_t *c);
double metrics_gauge_value(const metrics_gauge_t *g);
/* Total observations and their sum. */
uint64_t metrics_histogram_count(const metrics_histogram_t *h);
double metrics_histogram_sum(const metrics_histogram_t *h);

/* Writes the whole registry in Prometheus text format 0.0.4 into a malloc'd, NUL-terminated buffer that the
 * caller frees; *len excludes the NUL. Families in registration order, series in creation order; histogram
 * buckets are cumulative and their +Inf bucket equals _count. Families with no series yet are written with
 * HELP and TYPE only. Returns BT_ERR_NOMEM. Takes the registry lock and each family lock briefly; concurrent
 * updates go on (each value is read atomically, the whole is not a snapshot). */
bt_status metrics_expose(metrics_registry_t *r, char **out, size_t *len);

/* The content type of metrics_expose's output, for an HTTP answer. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Latency buckets in seconds used when a histogram gives none (5 ms .. 60 s). */
extern const double METRICS_DEFAULT_BUCKETS[];
extern const size_t METRICS_DEFAULT_BUCKETS_N;

/* The metric names of DESIGN 10, shared by the router and the nodes so dashboards and the planner agree. */
#define BT_METRIC_TTFT "baton_time_to_first_token_seconds"
#define BT_METRIC_TPOT "baton_time_per_output_token_seconds"
#define BT_METRIC_E2E_LATENCY "baton_e2e_request_latency_seconds"
#define BT_METRIC_QUEUE_TIME "baton_queue_time_seconds"
#define BT_METRIC_REQUESTS "baton_requests_total"                 /* label: status */
#define BT_METRIC_PROMPT_TOKENS "baton_prompt_tokens_total"
#define BT_METRIC_GENERATION_TOKENS "baton_generation_tokens_total"
#define BT_METRIC_KV_BLOCKS_USED "baton_kv_blocks_used"
#define BT_METRIC_KV_BLOCKS_CAPACITY "baton_kv_blocks_capacity" /* DESIGN 10 says baton_kv_blocks_total, but
                                                                  * promtool rejects _total on a gauge */
#define BT_METRIC_PREFIX_CACHE_HITS "baton_prefix_cache_hits_total"
#define BT_METRIC_PREFIX_CACHE_QUERIES "baton_prefix_cache_queries_total"
#define BT_METRIC_KV_TRANSFER_BYTES "baton_kv_transfer_bytes_total"
#define BT_METRIC_KV_TRANSFER_SECONDS "baton_kv_transfer_seconds"
#define BT_METRIC_SPEC_ACCEPTED "baton_spec_accepted_tokens_total"
#define BT_METRIC_SPEC_PROPOSED "baton_spec_proposed_tokens_total"
#define BT_METRIC_SPEC_ACCEPTED_LENGTH "baton_spec_accepted_length"
#define BT_METRIC_RUNNING_SEQUENCES "baton_running_sequences"
#define BT_METRIC_WAITING_REQUESTS "baton_waiting_requests"
#define BT_METRIC_MIGRATIONS "baton_migrations_total"
#define BT_METRIC_PLANNER_DESIRED_REPLICAS "baton_planner_desired_replicas" /* label: role */

/* The standard families of DESIGN 10, with their help text, labels and buckets predefined. */
typedef enum metrics_std {
    METRICS_STD_TTFT,
    METRICS_STD_TPOT,
    METRICS_STD_E2E_LATENCY,
    METRICS_STD_QUEUE_TIME,
    METRICS_STD_REQUESTS,
    METRICS_STD_PROMPT_TOKENS,
    METRICS_STD_GENERATION_TOKENS,
    METRICS_STD_KV_BLOCKS_USED,
    METRICS_STD_KV_BLOCKS_CAPACITY,
    METRICS_STD_PREFIX_CACHE_HITS,
    METRICS_STD_PREFIX_CACHE_QUERIES,
    METRICS_STD_KV_TRANSFER_BYTES,
    METRICS_STD_KV_TRANSFER_SECONDS,
    METRICS_STD_SPEC_ACCEPTED,
    METRICS_STD_SPEC_PROPOSED,
    METRICS_STD_SPEC_ACCEPTED_LENGTH,
    METRICS_STD_RUNNING_SEQUENCES,
    METRICS_STD_WAITING_REQUESTS,
    METRICS_STD_MIGRATIONS,
    METRICS_STD_PLANNER_DESIRED_REPLICAS,
    METRICS_STD_COUNT
} metrics_std_t;

/* The descriptor of a standard family; NULL when id is out of range. Static storage, never freed. */
const metrics_desc_t *metrics_std_desc(metrics_std_t id);

/* Registers (or finds) a standard family. Same errors as metrics_family_register. */
bt_status metrics_std_register(metrics_registry_t *r, metrics_std_t id, metrics_family_t **out);

/* The unlabelled series of standard family id, registering the family first (or finding it): the one-line form
 * of metrics_std_register + metrics_family_counter/gauge/histogram. Errors as those two: BT_ERR_INVALID when the
 * family has labels or another type. */
bt_status metrics_std_counter(metrics_registry_t *r, metrics_std_t id, metrics_counter_t **out);
bt_status metrics_std_gauge(metrics_registry_t *r, metrics_std_t id, metrics_gauge_t **out);
bt_status metrics_std_histogram(metrics_registry_t *r, metrics_std_t id, metrics_histogram_t **out);

#endif
