/* common/etcd against a real etcd started by the harness, plus a fake HTTP server for malformed answers. */
#include "common/etcd.h"
#include "common/etcd_json.h"
#include "etcd_harness.h"
#include "fake_http.h"
#include "test_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static etcd_harness_t etcd;

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static etcd_client_t *connect_to(const char *endpoints, int timeout_ms)
{
    etcd_config_t cfg = {.endpoints = endpoints, .timeout_ms = timeout_ms};
    etcd_client_t *c = NULL;
    if (etcd_client_create(&cfg, &c)) fprintf(stderr, "create: %s\n", bt_last_error());
    return c;
}

static void test_put_get_range_delete(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    int64_t rev1 = 0, rev2 = 0;
    REQUIRE(etcd_put(c, "/t/kv/a", "alpha", 5, 0, &rev1) == BT_OK);
    CHECK(rev1 > 1);
    REQUIRE(etcd_put(c, "/t/kv/b", "\0bin\xff", 5, 0, &rev2) == BT_OK);
    CHECK(rev2 == rev1 + 1);
    REQUIRE(etcd_put(c, "/t/kv/empty", "", 0, 0, NULL) == BT_OK); /* empty value: the gateway omits it */
    REQUIRE(etcd_put(c, "/t/kw", "x", 1, 0, NULL) == BT_OK);      /* just past the prefix */

    char *v = NULL;
    size_t n = 0;
    int64_t mod = 0;
    REQUIRE(etcd_get(c, "/t/kv/a", &v, &n, &mod) == BT_OK);
    CHECK(n == 5 && strcmp(v, "alpha") == 0 && mod == rev1);
    free(v);
    REQUIRE(etcd_get(c, "/t/kv/b", &v, &n, NULL) == BT_OK);
    CHECK(n == 5 && memcmp(v, "\0bin\xff", 5) == 0);
    free(v);
    REQUIRE(etcd_get(c, "/t/kv/empty", &v, &n, NULL) == BT_OK);
    CHECK(n == 0 && v && v[0] == '\0');
    free(v);
    CHECK(etcd_get(c, "/t/kv/missing", &v, &n, NULL) == BT_ERR_NOT_FOUND);

    etcd_range_result_t r;
    REQUIRE(etcd_range(c, "/t/kv/missing", NULL, &r) == BT_OK); /* missing key: no kvs, count omitted */
    CHECK(r.n_kvs == 0 && r.count == 0 && r.more == 0 && r.revision >= rev2);
    etcd_range_result_free(&r);

    etcd_range_opts_t pre = {.prefix = 1};
    REQUIRE(etcd_range(c, "/t/kv/", &pre, &r) == BT_OK);
    CHECK(r.n_kvs == 3 && r.count == 3);
    if (r.n_kvs == 3) {
        CHECK(strcmp(r.kvs[0].key, "/t/kv/a") == 0 && r.kvs[0].version == 1 && r.kvs[0].lease == 0);
        CHECK(strcmp(r.kvs[2].key, "/t/kv/empty") == 0 && r.kvs[2].value_len == 0);
        CHECK(r.kvs[0].create_revision == rev1 && r.kvs[0].mod_revision == rev1);
    }
    etcd_range_result_free(&r);

    etcd_range_opts_t lim = {.prefix = 1, .limit = 1};
    REQUIRE(etcd_range(c, "/t/kv/", &lim, &r) == BT_OK);
    CHECK(r.n_kvs == 1 && r.count == 3 && r.more == 1);
    etcd_range_result_free(&r);

    etcd_range_opts_t cnt = {.prefix = 1, .count_only = 1};
    REQUIRE(etcd_range(c, "/t/kv/", &cnt, &r) == BT_OK);
    CHECK(r.n_kvs == 0 && r.count == 3);
    etcd_range_result_free(&r);

    etcd_range_opts_t old = {.revision = rev1};
    REQUIRE(etcd_range(c, "/t/kv/b", &old, &r) == BT_OK); /* before b existed */
    CHECK(r.n_kvs == 0);
    etcd_range_result_free(&r);

    REQUIRE(etcd_put(c, "/t/kv/a", "alpha2", 6, 0, NULL) == BT_OK);
    REQUIRE(etcd_range(c, "/t/kv/a", NULL, &r) == BT_OK);
    CHECK(r.n_kvs == 1 && r.kvs[0].version == 2);
    etcd_range_result_free(&r);

    int64_t deleted = -1;
    REQUIRE(etcd_delete(c, "/t/kv/nothing", 0, &deleted, NULL) == BT_OK);
    CHECK(deleted == 0); /* omitted zero */
    REQUIRE(etcd_delete(c, "/t/kv/", 1, &deleted, NULL) == BT_OK);
    CHECK(deleted == 3);
    REQUIRE(etcd_get(c, "/t/kw", &v, &n, NULL) == BT_OK); /* outside the prefix: kept */
    free(v);
    etcd_client_destroy(c);
}

static void test_txn(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    /* create-if-absent: compare create_revision == 0 (a zero value, sent explicitly) */
    etcd_cmp_t absent = {.target = ETCD_CMP_CREATE, .result = ETCD_CMP_EQUAL, .key = "/t/txn/x", .number = 0};
    etcd_op_t put = {.type = ETCD_OP_PUT, .key = "/t/txn/x", .value = "one", .value_len = 3};
    etcd_op_t put_other = {.type = ETCD_OP_PUT, .key = "/t/txn/lost", .value = "1", .value_len = 1};
    int ok = -1;
    int64_t rev = 0;
    REQUIRE(etcd_txn(c, &absent, 1, &put, 1, &put_other, 1, &ok, &rev) == BT_OK);
    CHECK(ok == 1 && rev > 0);
    REQUIRE(etcd_txn(c, &absent, 1, &put, 1, &put_other, 1, &ok, NULL) == BT_OK);
    CHECK(ok == 0); /* omitted "succeeded" reads as false */
    char *v;
    size_t n;
    REQUIRE(etcd_get(c, "/t/txn/lost", &v, &n, NULL) == BT_OK);
    free(v);
    etcd_cmp_t val = {.target = ETCD_CMP_VALUE, .result = ETCD_CMP_EQUAL, .key = "/t/txn/x", .value = "one",
                      .value_len = 3};
    etcd_op_t del = {.type = ETCD_OP_DELETE, .key = "/t/txn/", .prefix = 1};
    REQUIRE(etcd_txn(c, &val, 1, &del, 1, NULL, 0, &ok, NULL) == BT_OK);
    CHECK(ok == 1);
    CHECK(etcd_get(c, "/t/txn/x", &v, &n, NULL) == BT_ERR_NOT_FOUND);
    etcd_cmp_t bad = {.target = (etcd_cmp_target)9, .key = "k"};
    CHECK(etcd_txn(c, &bad, 1, NULL, 0, NULL, 0, &ok, NULL) == BT_ERR_INVALID);
    etcd_client_destroy(c);
}

static void test_leases(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    int64_t id = 0, ttl = 0, granted = 0;
    REQUIRE(etcd_lease_grant(c, 30, &id, &ttl) == BT_OK);
    CHECK(id != 0 && ttl == 30);
    CHECK(id > (int64_t)1 << 53 || id > 0); /* ids are large: parsed from strings, not doubles */
    REQUIRE(etcd_put(c, "/t/lease/k", "v", 1, id, NULL) == BT_OK);
    etcd_range_result_t r;
    REQUIRE(etcd_range(c, "/t/lease/k", NULL, &r) == BT_OK);
    CHECK(r.n_kvs == 1 && r.kvs[0].lease == id); /* exact int64 round trip */
    etcd_range_result_free(&r);
    REQUIRE(etcd_lease_keepalive(c, id, &ttl) == BT_OK);
    CHECK(ttl == 30);
    REQUIRE(etcd_lease_timetolive(c, id, &ttl, &granted) == BT_OK);
    CHECK(ttl > 25 && ttl <= 30 && granted == 30);
    REQUIRE(etcd_lease_revoke(c, id) == BT_OK);
    char *v;
    size_t n;
    CHECK(etcd_get(c, "/t/lease/k", &v, &n, NULL) == BT_ERR_NOT_FOUND); /* revoke deletes the keys */
    CHECK(etcd_lease_revoke(c, id) == BT_ERR_NOT_FOUND);
    CHECK(etcd_lease_timetolive(c, id, &ttl, NULL) == BT_ERR_NOT_FOUND);
    CHECK(etcd_lease_keepalive(c, id, &ttl) == BT_ERR_NOT_FOUND);
    CHECK(etcd_put(c, "/t/lease/k", "v", 1, id, NULL) == BT_ERR_NOT_FOUND);
    CHECK(etcd_lease_grant(c, 0, &id, NULL) == BT_ERR_INVALID);
    etcd_client_destroy(c);
}

/* A lease that expires (no keepalive for longer than its TTL): keepalive answers 200 without a TTL. */
static void test_keepalive_expired_lease(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    int64_t id = 0, ttl = 0;
    REQUIRE(etcd_lease_grant(c, 1, &id, &ttl) == BT_OK);
    CHECK(ttl >= 1); /* etcd may raise it to its minimum */
    REQUIRE(etcd_put(c, "/t/exp/k", "v", 1, id, NULL) == BT_OK);
    int64_t t0 = mono_ms();
    bt_status st = BT_OK;
    while (mono_ms() - t0 < (ttl + 3) * 1000) {
        usleep(200000);
        int64_t left;
        if ((st = etcd_lease_timetolive(c, id, &left, NULL)) == BT_ERR_NOT_FOUND) break;
    }
    CHECK(st == BT_ERR_NOT_FOUND);
    CHECK(etcd_lease_keepalive(c, id, &ttl) == BT_ERR_NOT_FOUND);
    CHECK(strstr(bt_last_error(), "expired") != NULL);
    char *v;
    size_t n;
    CHECK(etcd_get(c, "/t/exp/k", &v, &n, NULL) == BT_ERR_NOT_FOUND);
    etcd_client_destroy(c);
}

typedef struct watch_log {
    pthread_mutex_t mu;
    int puts, deletes, connects, disconnects;
    int64_t last_rev;
    char last_key[128];
    char last_value[64];
    int prev_seen;
    int resyncs;
} watch_log;

static void wl_events(void *arg, const etcd_event_t *ev, size_t n)
{
    watch_log *l = arg;
    pthread_mutex_lock(&l->mu);
    for (size_t i = 0; i < n; i++) {
        if (ev[i].type == ETCD_EVENT_PUT) l->puts++;
        else l->deletes++;
        if (ev[i].kv.mod_revision <= l->last_rev) fprintf(stderr, "watch: revision went backwards\n");
        l->last_rev = ev[i].kv.mod_revision;
        snprintf(l->last_key, sizeof l->last_key, "%s", ev[i].kv.key);
        snprintf(l->last_value, sizeof l->last_value, "%s", ev[i].kv.value);
        l->prev_seen += ev[i].has_prev_kv;
    }
    pthread_mutex_unlock(&l->mu);
}

static void wl_state(void *arg, int connected)
{
    watch_log *l = arg;
    pthread_mutex_lock(&l->mu);
    if (connected) l->connects++;
    else l->disconnects++;
    pthread_mutex_unlock(&l->mu);
}

static int wl_wait(watch_log *l, int *field, int want, int ms)
{
    int64_t end = mono_ms() + ms;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        int v = *field;
        pthread_mutex_unlock(&l->mu);
        if (v >= want) return 1;
        if (mono_ms() > end) return 0;
        usleep(10000);
    }
}

static void test_watch_and_resume(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    watch_log l = {.mu = PTHREAD_MUTEX_INITIALIZER};
    etcd_watch_ops_t ops = {.on_events = wl_events, .on_state = wl_state, .arg = &l};
    etcd_watch_t *w = NULL;
    REQUIRE(etcd_watch_start(c, "/t/w/", 1, 0, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l, &l.connects, 1, 5000));
    REQUIRE(etcd_put(c, "/t/w/a", "1", 1, 0, NULL) == BT_OK);
    REQUIRE(etcd_put(c, "/t/w/a", "2", 1, 0, NULL) == BT_OK);
    REQUIRE(etcd_put(c, "/t/other", "x", 1, 0, NULL) == BT_OK);
    REQUIRE(etcd_delete(c, "/t/w/a", 0, NULL, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.deletes, 1, 3000));
    CHECK(l.puts == 2 && l.prev_seen >= 2);

    /* etcd restarts on the same data: the watch reconnects and resumes without gaps or repeats */
    etcd_harness_stop(&etcd);
    CHECK(wl_wait(&l, &l.disconnects, 1, 3000));
    REQUIRE(etcd_harness_restart(&etcd) == BT_OK);
    REQUIRE(etcd_put(c, "/t/w/b", "after", 5, 0, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.puts, 3, 5000));
    CHECK(l.connects >= 2);
    pthread_mutex_lock(&l.mu);
    CHECK(strcmp(l.last_key, "/t/w/b") == 0 && strcmp(l.last_value, "after") == 0);
    pthread_mutex_unlock(&l.mu);

    int64_t t0 = mono_ms();
    etcd_watch_stop(w);
    /* milliseconds when it interrupts the stream; 2 s leaves room for a loaded machine under ASan and still
     * fails a stop that waits out the 2 s call timeout or a longer keepalive */
    CHECK_MSG(mono_ms() - t0 < 2000, "watch stop took %lld ms", (long long)(mono_ms() - t0));
    CHECK(l.puts == 3 && l.deletes == 1);

    /* a watch started at an old revision replays history */
    watch_log l2 = {.mu = PTHREAD_MUTEX_INITIALIZER};
    ops.arg = &l2;
    REQUIRE(etcd_watch_start(c, "/t/w/a", 0, 1, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l2, &l2.deletes, 1, 5000));
    CHECK(l2.puts == 2);
    etcd_watch_stop(w);
    etcd_client_destroy(c);
}

static bt_status count_resync(void *arg, int64_t *start)
{
    watch_log *l = arg;
    pthread_mutex_lock(&l->mu);
    l->resyncs++;
    pthread_mutex_unlock(&l->mu);
    *start = 0;
    return BT_OK;
}

/* A resume revision that was compacted away makes the watch call resync. */
static void test_watch_compacted(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    int64_t rev = 0;
    for (int i = 0; i < 5; i++) REQUIRE(etcd_put(c, "/t/cmp/k", "v", 1, 0, &rev) == BT_OK);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "ETCDCTL_API=3 etcdctl --endpoints=%s compaction %lld >/dev/null", etcd.endpoint,
             (long long)rev);
    REQUIRE(system(cmd) == 0);
    watch_log l = {.mu = PTHREAD_MUTEX_INITIALIZER};
    etcd_watch_ops_t ops = {.on_events = wl_events, .resync = count_resync, .on_state = wl_state, .arg = &l};
    etcd_watch_t *w = NULL;
    REQUIRE(etcd_watch_start(c, "/t/cmp/", 1, rev - 3, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l, &l.resyncs, 1, 5000));
    CHECK(wl_wait(&l, &l.connects, 1, 5000));
    REQUIRE(etcd_put(c, "/t/cmp/k", "new", 3, 0, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.puts, 1, 5000));
    etcd_watch_stop(w);
    etcd_client_destroy(c);
}

/* etcd comes back empty (wiped data dir): the watch notices the revision went backwards and resyncs. */
static void test_watch_store_reset(void)
{
    etcd_client_t *c = connect_to(etcd.endpoint, 0);
    REQUIRE(c);
    for (int i = 0; i < 3; i++) REQUIRE(etcd_put(c, "/t/reset/k", "v", 1, 0, NULL) == BT_OK);
    watch_log l = {.mu = PTHREAD_MUTEX_INITIALIZER};
    etcd_watch_ops_t ops = {.on_events = wl_events, .resync = count_resync, .on_state = wl_state, .arg = &l};
    etcd_watch_t *w = NULL;
    REQUIRE(etcd_watch_start(c, "/t/reset/", 1, 0, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l, &l.connects, 1, 5000));
    REQUIRE(etcd_put(c, "/t/reset/k", "v", 1, 0, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.puts, 1, 5000));
    etcd_harness_kill(&etcd);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s/data'", etcd.dir);
    REQUIRE(system(cmd) == 0);
    REQUIRE(etcd_harness_restart(&etcd) == BT_OK);
    CHECK(wl_wait(&l, &l.resyncs, 2, 8000));
    CHECK(wl_wait(&l, &l.connects, 2, 8000));
    REQUIRE(etcd_put(c, "/t/reset/k", "new", 3, 0, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.puts, 2, 5000));
    etcd_watch_stop(w);
    etcd_client_destroy(c);
}

/* A dead endpoint first in the list: calls fail over to the live one and stick to it. */
static void test_failover(void)
{
    char eps[256];
    snprintf(eps, sizeof eps, "http://127.0.0.1:%d, %s/", etcd_harness_free_port(), etcd.endpoint);
    etcd_client_t *c = connect_to(eps, 0);
    REQUIRE(c);
    REQUIRE(etcd_put(c, "/t/fo", "1", 1, 0, NULL) == BT_OK);
    CHECK(strcmp(etcd_client_endpoint(c), etcd.endpoint) == 0);
    etcd_client_destroy(c);
    c = connect_to("127.0.0.1:1", 0);
    REQUIRE(c);
    CHECK(etcd_put(c, "/t/fo", "1", 1, 0, NULL) == BT_ERR_UNAVAILABLE);
    etcd_client_destroy(c);
    etcd_config_t none = {.endpoints = " , "};
    CHECK(etcd_client_create(&none, &c) == BT_ERR_INVALID);
}

static void test_malformed_answers(void)
{
    fake_http_t f;
    REQUIRE(fake_http_start(&f) == 0);
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", f.port);
    etcd_config_t cfg = {.endpoints = ep, .timeout_ms = 500, .max_response = 1 << 20};
    etcd_client_t *c = NULL;
    REQUIRE(etcd_client_create(&cfg, &c) == BT_OK);
    etcd_range_result_t r;
    int64_t id, ttl;

    fake_http_set(&f, 500, "Internal Server Error");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_PEER);
    fake_http_set(&f, 500, "{\"error\":\"boom\",\"message\":\"boom\",\"code\":13}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_PEER);
    CHECK(strstr(bt_last_error(), "boom") != NULL);
    fake_http_set(&f, 400, "{\"error\":\"bad\",\"message\":\"bad\",\"code\":3}");
    CHECK(etcd_put(c, "k", "v", 1, 0, NULL) == BT_ERR_INVALID);
    fake_http_set(&f, 200, "{\"header\":{\"revision\":\"5\"},\"kvs\":[{\"key\":\"aw==\",\"val");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT); /* truncated */
    fake_http_set(&f, 200, "");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "[1,2]");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"header\":{\"revision\":5},\"kvs\":{\"key\":\"aw==\"}}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT); /* kvs not an array */
    fake_http_set(&f, 200, "{\"kvs\":[{\"key\":12}]}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"kvs\":[{\"key\":\"not base64!\"}]}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"header\":{\"revision\":\"12x\"}}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"header\":{\"revision\":\"99999999999999999999\"}}");
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"header\":{\"revision\":true}}");
    CHECK(etcd_put(c, "k", "v", 1, 0, NULL) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"ID\":{},\"TTL\":\"5\"}");
    CHECK(etcd_lease_grant(c, 5, &id, &ttl) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"ID\":\"7\"}");
    CHECK(etcd_lease_grant(c, 5, &id, &ttl) == BT_ERR_FORMAT); /* no TTL */
    fake_http_set(&f, 200, "{\"result\":[]}");
    CHECK(etcd_lease_keepalive(c, 7, &ttl) == BT_ERR_FORMAT);
    fake_http_set(&f, 200, "{\"result\":{\"ID\":\"7\"}}");
    CHECK(etcd_lease_keepalive(c, 7, &ttl) == BT_ERR_NOT_FOUND);
    fake_http_set(&f, 200, "{\"succeeded\":\"yes\"}");
    int ok;
    CHECK(etcd_txn(c, NULL, 0, NULL, 0, NULL, 0, &ok, NULL) == BT_ERR_FORMAT);
    /* ints as numbers are tolerated, as are unknown fields */
    fake_http_set(&f, 200, "{\"header\":{\"revision\":42},\"count\":1,\"extra\":[1],\"kvs\":[{\"key\":\"aw==\"}]}");
    REQUIRE(etcd_range(c, "k", NULL, &r) == BT_OK);
    CHECK(r.revision == 42 && r.n_kvs == 1 && strcmp(r.kvs[0].key, "k") == 0 && r.kvs[0].value_len == 0);
    etcd_range_result_free(&r);

    fake_http_set_huge(&f, 8u << 20);
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_EXHAUSTED);

    fake_http_set_hang(&f, 1);
    int64_t t0 = mono_ms();
    CHECK(etcd_range(c, "k", NULL, &r) == BT_ERR_TIMEOUT);
    int64_t took = mono_ms() - t0;
    /* the 500 ms timeout, not the 2 s default: 1.4 s of slack for a loaded machine */
    CHECK_MSG(took >= 450 && took < 1900, "took %lld ms", (long long)took);
    fake_http_set_hang(&f, 0);

    /* a 503 member fails over to the next endpoint */
    fake_http_set(&f, 503, "{\"error\":\"etcdserver: no leader\",\"message\":\"etcdserver: no leader\",\"code\":14}");
    etcd_client_destroy(c);
    char eps[160];
    snprintf(eps, sizeof eps, "%s,%s", ep, etcd.endpoint);
    cfg.endpoints = eps;
    REQUIRE(etcd_client_create(&cfg, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/503", "v", 1, 0, NULL) == BT_OK);
    CHECK(strcmp(etcd_client_endpoint(c), etcd.endpoint) == 0);
    etcd_client_destroy(c);
    fake_http_stop(&f);
}

static void test_watch_parser(void)
{
    etcd_watch_msg_t m;
    const char *ok = "{\"result\":{\"header\":{\"revision\":\"9\"},\"events\":[{\"kv\":{\"key\":\"YQ==\",\"mod_revision\":\"9\"}},"
                     "{\"type\":\"DELETE\",\"kv\":{\"key\":\"Yg==\",\"mod_revision\":\"9\"},\"prev_kv\":{\"key\":\"Yg==\",\"value\":\"eA==\"}}]}}";
    REQUIRE(etcd_json_parse_watch(ok, strlen(ok), &m) == BT_OK);
    CHECK(m.n_events == 2 && m.events[0].type == ETCD_EVENT_PUT && m.events[1].type == ETCD_EVENT_DELETE);
    CHECK(m.events[1].has_prev_kv && strcmp(m.events[1].prev_kv.value, "x") == 0 && m.revision == 9);
    etcd_watch_msg_free(&m);
    const char *bad[] = {"{\"result\":{\"events\":[{\"type\":\"NOPE\",\"kv\":{}}]}}",
                         "{\"result\":{\"events\":[{\"kv\":{\"key\":\"YQ==\"}},{}]}}",
                         "{\"result\":{\"events\":[{\"kv\":{\"key\":\"YQ==\"},\"prev_kv\":{\"value\":3}}]}}",
                         "{\"result\":5}", "{}", "{\"result\":{\"created\":\"true\"}}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(etcd_json_parse_watch(bad[i], strlen(bad[i]), &m) == BT_ERR_FORMAT, "%s", bad[i]);
    const char *err = "{\"error\":{\"grpc_code\":14,\"message\":\"unavailable\"}}";
    REQUIRE(etcd_json_parse_watch(err, strlen(err), &m) == BT_OK);
    CHECK(m.is_error && strcmp(m.reason, "unavailable") == 0);
    etcd_watch_msg_free(&m);
}

/* etcd with auth enabled and tokens that expire after 1 s (simple tokens): the client authenticates,
 * re-authenticates when its token expires, and a watch keeps working. */
static void test_auth(void)
{
    etcd_harness_t a;
    REQUIRE(etcd_harness_start(&a, "--auth-token-ttl=1") == BT_OK);
    if (etcd_harness_enable_auth(&a, "s3cret")) {
        CHECK(!"auth enable");
        etcd_harness_destroy(&a);
        return;
    }
    etcd_client_t *anon = connect_to(a.endpoint, 0);
    REQUIRE(anon);
    CHECK(etcd_put(anon, "/t/auth", "v", 1, 0, NULL) == BT_ERR_INVALID); /* "user name is empty" */
    etcd_client_destroy(anon);

    etcd_config_t bad = {.endpoints = a.endpoint, .user = "root", .password = "wrong"};
    etcd_client_t *c = NULL;
    REQUIRE(etcd_client_create(&bad, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/auth", "v", 1, 0, NULL) == BT_ERR_PEER);
    CHECK_MSG(strstr(bt_last_error(), "authentication failed") != NULL, "%s", bt_last_error());
    etcd_client_destroy(c);

    etcd_config_t good = {.endpoints = a.endpoint, .user = "root", .password = "s3cret"};
    REQUIRE(etcd_client_create(&good, &c) == BT_OK);
    REQUIRE(etcd_put(c, "/t/auth", "v1", 2, 0, NULL) == BT_OK);
    watch_log l = {.mu = PTHREAD_MUTEX_INITIALIZER};
    etcd_watch_ops_t ops = {.on_events = wl_events, .on_state = wl_state, .arg = &l};
    etcd_watch_t *w = NULL;
    REQUIRE(etcd_watch_start(c, "/t/auth", 0, 0, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l, &l.connects, 1, 5000));
    sleep(3); /* the token expires (TTL 1 s; etcd checks about every second) */
    REQUIRE(etcd_put(c, "/t/auth", "v2", 2, 0, NULL) == BT_OK);
    char *v;
    size_t n;
    REQUIRE(etcd_get(c, "/t/auth", &v, &n, NULL) == BT_OK);
    CHECK(strcmp(v, "v2") == 0);
    free(v);
    CHECK(wl_wait(&l, &l.puts, 1, 5000));
    int64_t id;
    REQUIRE(etcd_lease_grant(c, 10, &id, NULL) == BT_OK);
    sleep(2);
    CHECK(etcd_lease_keepalive(c, id, NULL) == BT_OK);
    CHECK(etcd_authenticate(c) == BT_OK);
    /* a restart forgets every simple token: the watch reconnects with a stale one, is refused, re-authenticates */
    etcd_harness_stop(&a);
    REQUIRE(etcd_harness_restart(&a) == BT_OK);
    int64_t t0 = mono_ms();
    while (etcd_put(c, "/t/auth", "v3", 2, 0, NULL) != BT_OK && mono_ms() - t0 < 5000) usleep(100000);
    CHECK_MSG(wl_wait(&l, &l.puts, 2, 8000), "puts seen %d", l.puts);
    CHECK(strcmp(l.last_value, "v3") == 0);
    etcd_watch_stop(w);
    etcd_client_destroy(c);
    etcd_harness_destroy(&a);
}

/* TLS with client certificates (mTLS): the options reach libcurl. Certificates come from the openssl CLI. */
static void test_tls(void)
{
    const char *dir = test_tmpdir();
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd '%s' && printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext && "
             "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=baton-test-ca && "
             "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1 && "
             "openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2 "
             "-extfile san.ext && "
             "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=root && "
             "openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out client.crt -days 2",
             dir);
    if (system(cmd) != 0) {
        test_skip("TLS test: openssl could not make certificates");
        return;
    }
    char args[1024], ca[300], cert[300], key[300];
    snprintf(ca, sizeof ca, "%s/ca.crt", dir);
    snprintf(cert, sizeof cert, "%s/client.crt", dir);
    snprintf(key, sizeof key, "%s/client.key", dir);
    snprintf(args, sizeof args,
             "--cert-file=%s/server.crt --key-file=%s/server.key --client-cert-auth --trusted-ca-file=%s", dir, dir, ca);
    etcd_harness_t t;
    REQUIRE(etcd_harness_start(&t, args) == BT_OK);
    CHECK(strncmp(t.endpoint, "https://", 8) == 0);
    etcd_config_t cfg = {.endpoints = t.endpoint, .ca_file = ca, .cert_file = cert, .key_file = key};
    etcd_client_t *c = NULL;
    REQUIRE(etcd_client_create(&cfg, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/tls", "secure", 6, 0, NULL) == BT_OK);
    char *v;
    size_t n;
    if (etcd_get(c, "/t/tls", &v, &n, NULL) == BT_OK) {
        CHECK(strcmp(v, "secure") == 0);
        free(v);
    } else {
        CHECK(!"get over TLS");
    }
    watch_log l = {.mu = PTHREAD_MUTEX_INITIALIZER};
    etcd_watch_ops_t ops = {.on_events = wl_events, .on_state = wl_state, .arg = &l};
    etcd_watch_t *w = NULL;
    REQUIRE(etcd_watch_start(c, "/t/tls", 0, 0, &ops, &w) == BT_OK);
    CHECK(wl_wait(&l, &l.connects, 1, 5000));
    CHECK(etcd_put(c, "/t/tls", "again", 5, 0, NULL) == BT_OK);
    CHECK(wl_wait(&l, &l.puts, 1, 5000));
    etcd_watch_stop(w);
    etcd_client_destroy(c);

    etcd_config_t no_cert = {.endpoints = t.endpoint, .ca_file = ca}; /* server demands a client certificate */
    REQUIRE(etcd_client_create(&no_cert, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/tls", "x", 1, 0, NULL) == BT_ERR_UNAVAILABLE);
    etcd_client_destroy(c);
    etcd_config_t no_ca = {.endpoints = t.endpoint, .cert_file = cert, .key_file = key}; /* unknown CA */
    REQUIRE(etcd_client_create(&no_ca, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/tls", "x", 1, 0, NULL) == BT_ERR_UNAVAILABLE);
    CHECK(strstr(bt_last_error(), "certificate") != NULL || strstr(bt_last_error(), "SSL") != NULL);
    etcd_client_destroy(c);
    no_ca.insecure_skip_verify = 1;
    REQUIRE(etcd_client_create(&no_ca, &c) == BT_OK);
    CHECK(etcd_put(c, "/t/tls", "x", 1, 0, NULL) == BT_OK);
    etcd_client_destroy(c);
    etcd_harness_destroy(&t);
}

int main(void)
{
    RUN(test_watch_parser);
    if (etcd_harness_start(&etcd, NULL) != BT_OK) {
        fprintf(stderr, "cannot start etcd: %s\n", bt_last_error());
        return 1;
    }
    RUN(test_put_get_range_delete);
    RUN(test_txn);
    RUN(test_leases);
    RUN(test_keepalive_expired_lease);
    RUN(test_failover);
    RUN(test_malformed_answers);
    RUN(test_watch_and_resume);
    RUN(test_watch_compacted);
    RUN(test_watch_store_reset);
    RUN(test_auth);
    RUN(test_tls);
    etcd_harness_destroy(&etcd);
    return test_summary();
}
