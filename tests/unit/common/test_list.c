#include "common/list.h"
#include "test_util.h"

struct item {
    int v;
    bt_list_node link;
};

/* Writes the values front to back into out; returns how many. */
static int collect(const bt_list *l, int *out, int max)
{
    int n = 0;
    BT_LIST_FOR(it, l, struct item, link) {
        if (n < max) out[n] = it->v;
        n++;
    }
    return n;
}

static void test_push_walk_remove(void)
{
    struct item a = {.v = 1}, b = {.v = 2}, c = {.v = 3};
    bt_list l = {0};
    CHECK(bt_list_empty(&l));
    bt_list_push_front(&l, &a.link);
    bt_list_push_front(&l, &b.link);
    bt_list_push_front(&l, &c.link);
    int got[4];
    REQUIRE(collect(&l, got, 4) == 3);
    CHECK(got[0] == 3 && got[1] == 2 && got[2] == 1);

    CHECK(bt_list_remove(&l, &b.link) == 1); /* middle */
    REQUIRE(collect(&l, got, 4) == 2);
    CHECK(got[0] == 3 && got[1] == 1);
    CHECK(bt_list_remove(&l, &c.link) == 1); /* head */
    REQUIRE(collect(&l, got, 4) == 1);
    CHECK(got[0] == 1);
    CHECK(bt_list_remove(&l, &a.link) == 1); /* last one */
    CHECK(bt_list_empty(&l));
}

static void test_remove_unlisted_is_a_no_op(void)
{
    struct item a = {.v = 1}, b = {.v = 2}, never = {.v = 9};
    bt_list l = {0};
    bt_list_push_front(&l, &a.link);
    bt_list_push_front(&l, &b.link);
    CHECK(bt_list_remove(&l, &never.link) == 0);
    CHECK(bt_list_remove(&l, &a.link) == 1);
    CHECK(bt_list_remove(&l, &a.link) == 0); /* twice */
    int got[2];
    REQUIRE(collect(&l, got, 2) == 1);
    CHECK(got[0] == 2);
    bt_list other = {0}; /* a node listed elsewhere is not in this list */
    CHECK(bt_list_remove(&other, &b.link) == 0);
    CHECK(!bt_list_empty(&l) && bt_list_empty(&other));
    bt_list_push_front(&l, &a.link); /* a removed node can be listed again */
    REQUIRE(collect(&l, got, 2) == 2);
    CHECK(got[0] == 1 && got[1] == 2);
}

int main(void)
{
    RUN(test_push_walk_remove);
    RUN(test_remove_unlisted_is_a_no_op);
    return test_summary();
}
