/* router/dispatch.c: the set of decode nodes a request must not go back to (before it was a fixed array of eight,
 * and a request that migrated more often could be sent back to a node that had already failed it), and the
 * liveness rules that pick and move streams (issue 17). */
#include "router/router.h"
#include "test_util.h"

#include <stdio.h>
#include <string.h>

static void test_exclude_grows_past_eight(void)
{
    rtr_exclude_t e = {0};
    char id[MBR_NODE_ID_MAX];
    for (int i = 0; i < 40; i++) {
        snprintf(id, sizeof id, "decode-%d", i);
        CHECK(!rtr_exclude_has(&e, id));
        REQUIRE(rtr_exclude_add(&e, id) == BT_OK);
    }
    CHECK(e.n == 40);
    for (int i = 0; i < 40; i++) {
        snprintf(id, sizeof id, "decode-%d", i);
        CHECK_MSG(rtr_exclude_has(&e, id), "%s was forgotten", id);
    }
    CHECK(!rtr_exclude_has(&e, "decode-40"));
    CHECK(!rtr_exclude_has(&e, "decode-"));
    rtr_exclude_free(&e);
    CHECK(e.n == 0 && e.ids == NULL);
    CHECK(!rtr_exclude_has(&e, "decode-0"));
}

static void test_exclude_once_per_node(void)
{
    rtr_exclude_t e = {0};
    CHECK(rtr_exclude_add(&e, "a") == BT_OK);
    CHECK(rtr_exclude_add(&e, "b") == BT_OK);
    CHECK(rtr_exclude_add(&e, "a") == BT_OK);
    CHECK(e.n == 2);
    CHECK(rtr_exclude_has(&e, "a") && rtr_exclude_has(&e, "b") && !rtr_exclude_has(&e, "c"));
    rtr_exclude_free(&e);
}

static void test_exclude_keeps_whole_ids(void)
{
    rtr_exclude_t e = {0};
    char longest[MBR_NODE_ID_MAX];
    memset(longest, 'n', sizeof longest - 1);
    longest[sizeof longest - 1] = 0;
    REQUIRE(rtr_exclude_add(&e, longest) == BT_OK);
    CHECK(rtr_exclude_has(&e, longest));
    longest[sizeof longest - 2] = 'm'; /* differs only in the last character */
    CHECK(!rtr_exclude_has(&e, longest));
    rtr_exclude_free(&e);
}

/* Liveness (issue 17): which decode nodes get new work and when a waiting stream moves. */
static void test_liveness_fit_node(void)
{
    rtr_liveness_t l = {.report_age_ms = 900, .confirmed_ms = 60000, .decoding = 4, .silent_ms = 100, .step_s = 0.05};
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
    CHECK(rtr_liveness_unfit(&l, 3000, 0) == NULL);
}

static void test_liveness_gone_and_suspect(void)
{
    rtr_liveness_t l = {.gone = 1, .confirmed_ms = 60000};
    CHECK(rtr_liveness_unfit(&l, 3000, 0) != NULL);
    l.gone = 0;
    l.suspect = 1;
    CHECK(rtr_liveness_unfit(&l, 3000, 0) != NULL);
}

/* A report ages only while etcd answers: during an outage (or shortly after) every report is old, and no node is
 * refused for it. */
static void test_liveness_stale_report(void)
{
    rtr_liveness_t l = {.report_age_ms = 3500, .confirmed_ms = 60000};
    CHECK(rtr_liveness_unfit(&l, 3000, 0) != NULL);
    CHECK(rtr_liveness_unfit(&l, 0, 0) == NULL);  /* off */
    l.confirmed_ms = 0;                             /* etcd does not answer now */
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
    l.confirmed_ms = 2000;                          /* answered again 2 s ago: reports are being renewed */
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
    l.report_age_ms = 2500;
    l.confirmed_ms = 60000;
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
}

/* Silence counts in the node's own steps, at least RTR_SILENT_MIN_MS, only with streams decoding there, and only
 * to steer new work (strict). */
static void test_liveness_silent_streams(void)
{
    rtr_liveness_t l = {.confirmed_ms = 60000, .decoding = 2, .silent_ms = RTR_SILENT_MIN_MS + 1, .step_s = 0.01};
    CHECK(rtr_liveness_unfit(&l, 3000, 1) != NULL);
    CHECK(rtr_liveness_unfit(&l, 3000, 0) == NULL);
    l.step_s = 0.2; /* 5 steps of 200 ms = 1 s */
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
    l.silent_ms = 1001;
    CHECK(rtr_liveness_unfit(&l, 3000, 1) != NULL);
    l.decoding = 0; /* nothing decodes there: silence says nothing */
    CHECK(rtr_liveness_unfit(&l, 3000, 1) == NULL);
}

static void test_stall_bound(void)
{
    CHECK(rtr_stall_bound_ms(3000, 0) == 3000);
    CHECK(rtr_stall_bound_ms(3000, 0.02) == 3000);     /* 50 steps = 1 s < 3 s */
    CHECK(rtr_stall_bound_ms(3000, 0.1) == 5000);      /* 50 steps of a slow node */
    CHECK(rtr_stall_bound_ms(RTR_DEFAULT_STALL_MS, 0) == RTR_DEFAULT_STALL_MS);
}

int main(void)
{
    RUN(test_liveness_fit_node);
    RUN(test_liveness_gone_and_suspect);
    RUN(test_liveness_stale_report);
    RUN(test_liveness_silent_streams);
    RUN(test_stall_bound);
    RUN(test_exclude_grows_past_eight);
    RUN(test_exclude_once_per_node);
    RUN(test_exclude_keeps_whole_ids);
    return test_summary();
}
