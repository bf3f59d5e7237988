/* Fork-join pool with task claiming. `next` packs run id (bits 32..63), the run's task count (16..31) and the next
 * task index (0..15); any thread claims a task with one fetch_add, and the ticket itself says whether the index is
 * a task of that run. A valid claim holds the run open (the caller waits for it), so fn/ctx stay put meanwhile.
 * Each thread over-claims at most once per run, so the index field cannot overflow into the count. `gen` is the
 * futex word idle workers sleep on; sleeper counts let the hot path skip the wake syscalls. */
#include "engine/cpu/cpu_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A waiter spins SPIN_NS, then yields the CPU between checks until YIELD_NS, then sleeps. The yielding phase keeps
 * the CPU awake through a step's short waits (a serial stretch, an unbalanced op) without holding it from another
 * runnable thread. Why not sleep sooner: on a virtual machine a CPU that sleeps halts, and waking a halted virtual
 * CPU is cheap only while the hypervisor still polls for it, which it stops doing after a long idle. On a KVM guest
 * with 2 vCPUs and a 50 us spin, a 128-token prompt step after the node sat idle 0.3-2 s took 15-21 ms more than
 * back to back (63-67 ms); with the yielding phase, 0-6 ms more (`baton profile`'s idle points, two runs each). */
#define SPIN_NS 50000
#define YIELD_NS 2000000

typedef struct worker {
    bt_pool *pool;
    pthread_t thread;
} worker;

struct bt_pool {
    int n;
    worker *workers; /* [n - 1] */
    bt_pool_fn fn;
    void *ctx;
    _Atomic uint64_t next;     /* run id << 32 | n_tasks << 16 | next unclaimed task */
    _Atomic uint32_t gen;      /* bumped for every run (and for shutdown) */
    _Atomic uint32_t done;     /* tasks finished by workers in the current run */
    _Atomic int sleepers;      /* workers asleep (or about to be) on gen */
    _Atomic int caller_asleep; /* caller asleep (or about to be) on done */
    _Atomic int stop;
};

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr, int n)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins until *addr != val, yielding between checks after SPIN_NS, for at most YIELD_NS; returns 1 if the value
 * changed. */
static int spin_while_equal(_Atomic uint32_t *addr, uint32_t val)
{
    uint64_t start = 0;
    int yielding = 0;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(addr, memory_order_acquire) != val) return 1;
        if (yielding)
            sched_yield();
        else
            cpu_relax();
        if (yielding || (i & 63) == 0) {
            uint64_t t = now_ns();
            if (!start)
                start = t;
            else if (t - start > YIELD_NS)
                return 0;
            else if (t - start > SPIN_NS)
                yielding = 1;
        }
    }
}

static void *worker_main(void *arg)
{
    bt_pool *p = ((worker *)arg)->pool;
    uint32_t seen = 0; /* gen at creation: a run may start before this thread does */
    for (;;) {
        while (!spin_while_equal(&p->gen, seen)) {
            atomic_fetch_add(&p->sleepers, 1);
            futex_wait(&p->gen, seen); /* returns at once if gen already moved */
            atomic_fetch_sub(&p->sleepers, 1);
        }
        seen = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) return NULL;
        for (;;) {
            uint64_t t = atomic_fetch_add(&p->next, 1);
            int ith = (int)(t & 0xffff), n_tasks = (int)((t >> 16) & 0xffff);
            if (ith >= n_tasks) break;
            p->fn(p->ctx, ith, n_tasks); /* published before `next` was reset for this run */
            atomic_fetch_add(&p->done, 1);
            if (atomic_load(&p->caller_asleep)) futex_wake(&p->done, 1);
        }
    }
}

bt_status bt_pool_create(int n_threads, bt_pool **out)
{
    if (n_threads < 1 || n_threads > 256) return bt_fail(BT_ERR_INVALID, "thread pool: %d threads", n_threads);
    bt_pool *p = calloc(1, sizeof *p);
    if (!p) return bt_fail(BT_ERR_NOMEM, "thread pool: out of memory");
    p->n = n_threads;
    atomic_store(&p->next, 0); /* run 0 has no tasks */
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            free(p);
            return bt_fail(BT_ERR_NOMEM, "thread pool: out of memory");
        }
    }
    for (int i = 0; i < n_threads - 1; i++) {
        p->workers[i].pool = p;
        if (pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]) != 0) {
            p->n = i + 1; /* destroy joins the i workers started */
            bt_pool_destroy(p);
            return bt_fail(BT_ERR_INTERNAL, "thread pool: cannot start thread %d", i + 1);
        }
    }
    *out = p;
    return BT_OK;
}

#define MAX_ROUND_TASKS 32768 /* fits the 16-bit index field with room for over-claims */

typedef struct round_ctx {
    bt_pool_fn fn;
    void *ctx;
    int base, total;
} round_ctx;

static void round_task(void *arg, int ith, int nth)
{
    round_ctx *r = arg;
    r->fn(r->ctx, r->base + ith, r->total);
}

static void run_round(bt_pool *p, bt_pool_fn fn, void *ctx, int n_tasks);

void bt_pool_run_tasks(bt_pool *p, bt_pool_fn fn, void *ctx, int n_tasks)
{
    if (n_tasks <= MAX_ROUND_TASKS) {
        run_round(p, fn, ctx, n_tasks);
        return;
    }
    for (int base = 0; base < n_tasks; base += MAX_ROUND_TASKS) {
        round_ctx r = {fn, ctx, base, n_tasks};
        run_round(p, round_task, &r, n_tasks - base < MAX_ROUND_TASKS ? n_tasks - base : MAX_ROUND_TASKS);
    }
}

static void run_round(bt_pool *p, bt_pool_fn fn, void *ctx, int n_tasks)
{
    if (n_tasks <= 0) return;
    if (p->n == 1 || n_tasks == 1) {
        for (int i = 0; i < n_tasks; i++) fn(ctx, i, n_tasks);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint64_t run = (atomic_load_explicit(&p->next, memory_order_relaxed) >> 32) + 1;
    atomic_store(&p->next, run << 32 | (uint64_t)n_tasks << 16); /* seq_cst: publishes fn, ctx, done */
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers)) futex_wake(&p->gen, p->n - 1);
    int mine = 0;
    for (;;) {
        int ith = (int)(atomic_fetch_add(&p->next, 1) & 0xffff);
        if (ith >= n_tasks) break;
        fn(ctx, ith, n_tasks);
        mine++;
    }
    /* every task is claimed now; wait for the ones workers took */
    uint32_t target = (uint32_t)(n_tasks - mine);
    for (;;) {
        uint32_t d = atomic_load_explicit(&p->done, memory_order_acquire);
        if (d == target) break;
        if (spin_while_equal(&p->done, d)) continue;
        atomic_store(&p->caller_asleep, 1);
        d = atomic_load(&p->done);
        if (d != target) futex_wait(&p->done, d);
        atomic_store(&p->caller_asleep, 0);
    }
}

void bt_pool_run(bt_pool *p, bt_pool_fn fn, void *ctx)
{
    bt_pool_run_tasks(p, fn, ctx, p->n);
}

int bt_pool_size(const bt_pool *p)
{
    return p->n;
}

void bt_pool_destroy(bt_pool *p)
{
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    futex_wake(&p->gen, p->n);
    for (int i = 0; i < p->n - 1; i++) pthread_join(p->workers[i].thread, NULL);
    free(p->workers);
    free(p);
}
