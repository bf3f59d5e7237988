/* node/calls.c: admission bound, reference counts, the list of calls in flight with Abort by request id, deadline
 * conversion. Included whole to reach the list's static helpers; submission and finishing need a scheduler and a
 * gRPC call and are covered by tests/integration/test_decode_node.py and test_disagg.py. */
#include "node/calls.c"
#include "test_util.h"

#include <limits.h>
#include <stdlib.h>

typedef struct counted_call {
    bt_call_t base;
    int *frees;
} counted_call;

static void counted_free(bt_call_t *base)
{
    counted_call *c = (counted_call *)base;
    (*c->frees)++;
    free(c);
}

static counted_call *counted_new(bt_calls_t *l, const char *rid, int *frees)
{
    counted_call *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    bt_call_init(&c->base, l, NULL, rid, counted_free);
    c->frees = frees;
    return c;
}

static void test_deadline_timeout(void)
{
    CHECK(bt_deadline_timeout_ms(0, 100.0, 30000) == 30000);
    CHECK(bt_deadline_timeout_ms(-1, 100.0, 7) == 7);
    CHECK(bt_deadline_timeout_ms(99.0, 100.0, 30000) == 1);      /* already past: one try */
    CHECK(bt_deadline_timeout_ms(100.0005, 100.0, 30000) == 1);  /* under a millisecond */
    CHECK(bt_deadline_timeout_ms(102.5, 100.0, 30000) == 2500);
    CHECK(bt_deadline_timeout_ms(100.0 + 40.0, 100.0, 30000) == 40000); /* a deadline is not capped by none_ms */
    CHECK(bt_deadline_timeout_ms(1e12, 0.0, 1) == INT32_MAX);
}

static void test_admission_bound(void)
{
    bt_calls_t l;
    bt_calls_init(&l, 2, "test");
    CHECK(bt_calls_admit(&l) == 1);
    CHECK(bt_calls_admit(&l) == 1);
    CHECK(bt_calls_admit(&l) == 0);
    CHECK(bt_calls_inflight(&l) == 2); /* a refusal counts nothing */
    bt_calls_leave(&l);
    CHECK(bt_calls_inflight(&l) == 1);
    CHECK(bt_calls_admit(&l) == 1);
    CHECK(bt_calls_admit(&l) == 0);
    bt_calls_destroy(&l);
}

static void test_queued_tokens_never_negative(void)
{
    bt_calls_t l;
    bt_calls_init(&l, 4, "test");
    atomic_fetch_add(&l.queued_prefill_tokens, 10);
    bt_calls_prefilled(&l, 4);
    CHECK(bt_calls_queued_prefill_tokens(&l) == 6);
    bt_calls_prefilled(&l, 9);
    CHECK(bt_calls_queued_prefill_tokens(&l) == 0);
    bt_calls_destroy(&l);
}

static void test_references(void)
{
    bt_calls_t l;
    bt_calls_init(&l, 4, "test");
    int frees = 0;
    counted_call *c = counted_new(&l, "r1", &frees);
    REQUIRE(c);
    CHECK(atomic_load(&c->base.refs) == 2); /* the handler's and the engine side's */
    bt_call_unref(&c->base);
    CHECK(frees == 0);
    bt_call_ref(&c->base); /* a helper thread's */
    bt_call_unref(&c->base);
    CHECK(frees == 0);
    bt_call_unref(&c->base);
    CHECK(frees == 1);
    bt_calls_destroy(&l);
}

static void test_request_id_truncated(void)
{
    bt_calls_t l;
    bt_calls_init(&l, 4, "test");
    char rid[300];
    memset(rid, 'x', sizeof rid - 1);
    rid[sizeof rid - 1] = 0;
    int frees = 0;
    counted_call *c = counted_new(&l, rid, &frees);
    REQUIRE(c);
    CHECK(strlen(c->base.request_id) == BT_CALL_ID_MAX - 1);
    atomic_store(&c->base.refs, 1);
    bt_call_unref(&c->base);
    CHECK(frees == 1);
    bt_calls_destroy(&l);
}

static void test_abort_by_request_id(void)
{
    bt_calls_t l;
    bt_calls_init(&l, 8, "test");
    int frees = 0;
    counted_call *a1 = counted_new(&l, "a", &frees), *b = counted_new(&l, "b", &frees);
    counted_call *a2 = counted_new(&l, "a", &frees);
    REQUIRE(a1 && b && a2);
    list_insert(&l, &a1->base);
    list_insert(&l, &b->base);
    list_insert(&l, &a2->base);
    /* not yet submitted (no scheduler id): marked, so the submitter aborts once the id is known */
    CHECK(bt_calls_abort(&l, "a") == 2);
    CHECK(atomic_load(&a1->base.abort_pending) && atomic_load(&a2->base.abort_pending));
    CHECK(!atomic_load(&b->base.abort_pending));
    CHECK(bt_calls_abort(&l, "zzz") == 0);
    CHECK(bt_calls_abort(&l, "") == 0);

    list_remove(&l, &b->base); /* the middle one */
    CHECK(bt_calls_abort(&l, "b") == 0);
    CHECK(l.list.head == &a2->base.link && a2->base.link.next == &a1->base.link &&
          a1->base.link.prev == &a2->base.link && !a1->base.link.next);
    list_remove(&l, &a2->base); /* the head */
    CHECK(l.list.head == &a1->base.link && !a1->base.link.prev);
    list_remove(&l, &a1->base);
    CHECK(l.list.head == NULL);
    list_remove(&l, &a1->base); /* removing twice is harmless */
    CHECK(l.list.head == NULL);
    CHECK(bt_calls_abort(&l, "a") == 0);
    counted_call *all[3] = {a1, b, a2};
    for (int i = 0; i < 3; i++) {
        atomic_store(&all[i]->base.refs, 1);
        bt_call_unref(&all[i]->base);
    }
    CHECK(frees == 3);
    bt_calls_destroy(&l);
}

int main(void)
{
    RUN(test_deadline_timeout);
    RUN(test_admission_bound);
    RUN(test_queued_tokens_never_negative);
    RUN(test_references);
    RUN(test_request_id_truncated);
    RUN(test_abort_by_request_id);
    return test_summary();
}
