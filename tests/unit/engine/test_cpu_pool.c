/* engine/cpu/cpu_pool.c: every thread runs once per run, runs are back to back and after sleeps, and pools are
 * created and destroyed repeatedly (leaks show under ASan). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/cpu/cpu_pool.h"
#include "test_util.h"

typedef struct count_ctx {
    int nth_expected;
    _Atomic int calls;
    _Atomic int bad;
    int hits[16];  /* each thread writes only its own slot */
    long work[16];
} count_ctx;

static void count_fn(void *arg, int ith, int nth)
{
    count_ctx *c = arg;
    atomic_fetch_add(&c->calls, 1);
    if (nth != c->nth_expected || ith < 0 || ith >= nth) atomic_fetch_add(&c->bad, 1);
    else c->hits[ith]++;
    long s = 0;
    for (int i = ith; i < 1000; i += nth) s += i;
    c->work[ith] += s;
}

static void test_each_thread_once(void)
{
    for (int n = 1; n <= 4; n++) {
        bt_pool *p = NULL;
        REQUIRE(bt_pool_create(n, &p) == BT_OK);
        CHECK(bt_pool_size(p) == n);
        count_ctx c = {.nth_expected = n};
        const int runs = n <= 2 ? 20000 : 2000; /* more threads than cores here: keep it short */
        for (int r = 0; r < runs; r++) bt_pool_run(p, count_fn, &c);
        CHECK(atomic_load(&c.calls) == runs * n);
        CHECK(atomic_load(&c.bad) == 0);
        long total = 0;
        for (int i = 0; i < n; i++) {
            CHECK(c.hits[i] == runs);
            total += c.work[i];
        }
        CHECK(total == 499500L * runs);
        bt_pool_destroy(p);
    }
}

/* Results written by workers are visible to the caller when bt_pool_run returns. */
typedef struct fill_ctx {
    int *buf;
    int len, gen;
} fill_ctx;

static void fill_fn(void *arg, int ith, int nth)
{
    fill_ctx *f = arg;
    for (int i = f->len * ith / nth; i < f->len * (ith + 1) / nth; i++) f->buf[i] = f->gen + i;
}

static void test_visibility_and_sleep(void)
{
    bt_pool *p = NULL;
    REQUIRE(bt_pool_create(2, &p) == BT_OK);
    int buf[1024];
    fill_ctx f = {.buf = buf, .len = 1024};
    int bad = 0;
    for (int r = 0; r < 200; r++) {
        f.gen = r * 7;
        if (r % 20 == 0) {
            struct timespec ts = {0, 2000000}; /* 2 ms: workers have gone to sleep */
            nanosleep(&ts, NULL);
        }
        bt_pool_run(p, fill_fn, &f);
        for (int i = 0; i < 1024; i++)
            if (buf[i] != f.gen + i) bad++;
    }
    CHECK(bad == 0);
    bt_pool_destroy(p);
}

static void test_create_destroy(void)
{
    for (int i = 0; i < 300; i++) {
        bt_pool *p = NULL;
        REQUIRE(bt_pool_create(1 + i % 4, &p) == BT_OK);
        if (i % 2) {
            count_ctx c = {.nth_expected = 1 + i % 4};
            bt_pool_run(p, count_fn, &c);
            CHECK(atomic_load(&c.calls) == 1 + i % 4);
        }
        bt_pool_destroy(p);
    }
    bt_pool *p = NULL;
    CHECK(bt_pool_create(0, &p) == BT_ERR_INVALID && p == NULL);
    CHECK(bt_pool_create(100000, &p) == BT_ERR_INVALID && p == NULL);
    bt_pool_destroy(NULL);
}

typedef struct task_ctx {
    _Atomic int seen[70000];
    _Atomic int bad;
    int n_tasks;
} task_ctx;

static void task_fn(void *arg, int ith, int nth)
{
    task_ctx *c = arg;
    if (nth != c->n_tasks || ith < 0 || ith >= nth) atomic_fetch_add(&c->bad, 1);
    else atomic_fetch_add(&c->seen[ith], 1);
}

/* More (or fewer) tasks than threads: every task exactly once per run. */
static void test_run_tasks(void)
{
    static const int counts[] = {0, 1, 2, 3, 7, 64, 1000, 70000};
    for (int n = 1; n <= 3; n++) {
        bt_pool *p = NULL;
        REQUIRE(bt_pool_create(n, &p) == BT_OK);
        for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
            static task_ctx c;
            memset(&c, 0, sizeof c);
            c.n_tasks = counts[k];
            const int runs = counts[k] > 1000 ? 3 : 300;
            for (int r = 0; r < runs; r++) bt_pool_run_tasks(p, task_fn, &c, counts[k]);
            int bad = atomic_load(&c.bad);
            for (int i = 0; i < counts[k]; i++)
                if (atomic_load(&c.seen[i]) != runs) bad++;
            CHECK_MSG(bad == 0, "%d threads, %d tasks: %d tasks not run exactly once per run", n, counts[k], bad);
        }
        bt_pool_destroy(p);
    }
}

typedef struct who_ctx {
    pthread_t caller;
    _Atomic int on_worker;
} who_ctx;

static void who_fn(void *arg, int ith, int nth)
{
    who_ctx *c = arg;
    struct timespec ts = {0, 200000}; /* 200 us of "work" gives the workers time to claim tasks */
    nanosleep(&ts, NULL);
    if (!pthread_equal(pthread_self(), c->caller)) atomic_fetch_add(&c->on_worker, 1);
}

/* The workers do take tasks (the caller is not doing everything alone). */
static void test_workers_participate(void)
{
    bt_pool *p = NULL;
    REQUIRE(bt_pool_create(2, &p) == BT_OK);
    who_ctx c = {.caller = pthread_self()};
    for (int r = 0; r < 50 && atomic_load(&c.on_worker) == 0; r++) bt_pool_run_tasks(p, who_fn, &c, 8);
    CHECK(atomic_load(&c.on_worker) > 0);
    bt_pool_destroy(p);
}

int main(void)
{
    RUN(test_each_thread_once);
    RUN(test_visibility_and_sleep);
    RUN(test_run_tasks);
    RUN(test_workers_participate);
    RUN(test_create_destroy);
    return test_summary();
}
