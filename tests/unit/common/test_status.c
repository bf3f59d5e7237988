#include "common/status.h"
#include "test_util.h"

#include <string.h>

static void test_fail_sets_message(void)
{
    bt_clear_error();
    CHECK(strcmp(bt_last_error(), "") == 0);
    bt_status st = bt_fail(BT_ERR_FORMAT, "bad %s at %d", "magic", 4);
    CHECK(st == BT_ERR_FORMAT);
    CHECK(strcmp(bt_last_error(), "bad magic at 4") == 0);
    CHECK(strcmp(bt_status_str(BT_ERR_TIMEOUT), "timed out") == 0);
    CHECK(strcmp(bt_status_str((bt_status)-999), "unknown status") == 0);
}

static void test_long_message_truncated(void)
{
    char big[2000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    bt_fail(BT_ERR_INVALID, "%s", big);
    CHECK(strlen(bt_last_error()) < sizeof big);
    CHECK(strlen(bt_last_error()) > 100);
}

static void test_message_can_wrap_itself(void)
{
    bt_fail(BT_ERR_IO, "disk full");
    bt_fail(BT_ERR_IO, "%s: %s", "model.gguf", bt_last_error());
    CHECK(strcmp(bt_last_error(), "model.gguf: disk full") == 0);
}

int main(void)
{
    RUN(test_message_can_wrap_itself);
    RUN(test_fail_sets_message);
    RUN(test_long_message_truncated);
    return test_summary();
}
