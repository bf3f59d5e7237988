/* router/dispatch.c: the set of decode nodes a request must not go back to. Before it was a fixed array of eight,
 * and a request that migrated more often could be sent back to a node that had already failed it. */
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

int main(void)
{
    RUN(test_exclude_grows_past_eight);
    RUN(test_exclude_once_per_node);
    RUN(test_exclude_keeps_whole_ids);
    return test_summary();
}
