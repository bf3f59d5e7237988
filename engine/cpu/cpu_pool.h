/* A fork-join thread pool for compute kernels, suited to machines with 2 vCPUs.
 * A run is a set of tasks 0 .. n_tasks - 1; every thread, the caller included, claims tasks from a shared counter
 * until none are left, so a worker the OS has descheduled never holds the caller up: the caller runs the task
 * itself. Idle workers spin briefly with a pause instruction (about 50 us, so back-to-back kernels pay no wake-up)
 * and then sleep on a futex (pure spinning collapses when anything else runs on 2 cores).
 * One run at a time: bt_pool_run* must not be called concurrently on the same pool, nor from inside fn. */
#ifndef BATON_ENGINE_CPU_POOL_H
#define BATON_ENGINE_CPU_POOL_H

#include "common/status.h"

typedef struct bt_pool bt_pool;

/* fn(ctx, ith, nth): task ith of nth. Tasks may run on any pool thread, in any order, concurrently. */
typedef void (*bt_pool_fn)(void *ctx, int ith, int nth);

/* Creates a pool of n_threads (1..256) threads including the caller. BT_ERR_INVALID for a bad count,
 * BT_ERR_NOMEM / BT_ERR_INTERNAL when memory or a thread cannot be had. *out is set only on success. */
bt_status bt_pool_create(int n_threads, bt_pool **out);

/* Runs fn(ctx, ith, nth) for ith = 0 .. nth - 1 with nth = bt_pool_size(pool), each exactly once, and returns
 * when all have finished (blocks). Can't fail. */
void bt_pool_run(bt_pool *pool, bt_pool_fn fn, void *ctx);

/* Same with n_tasks tasks (none when n_tasks <= 0): more tasks than threads balance the load when a thread is
 * slowed down. */
void bt_pool_run_tasks(bt_pool *pool, bt_pool_fn fn, void *ctx, int n_tasks);

/* Number of threads, the caller included. */
int bt_pool_size(const bt_pool *pool);

/* Stops and joins the workers and frees the pool; NULL is a no-op. Must not race with bt_pool_run. */
void bt_pool_destroy(bt_pool *pool);

#endif
