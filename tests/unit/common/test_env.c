/* common/env.c: the one strict reader of BATON_* switches: unset and empty give the default, listed values their
 * index, anything else an error naming the variable, the value and the choices (and the default stays in *out). */
#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "test_util.h"

static void test_env_choice(void)
{
    static const char *const paths[] = {"auto", "mapped", "put", "am"};
    int v = 99;
    unsetenv("BATON_TEST_ENV");
    CHECK(bt_env_choice("BATON_TEST_ENV", paths, 4, 0, &v) == BT_OK && v == 0);
    setenv("BATON_TEST_ENV", "", 1);
    CHECK(bt_env_choice("BATON_TEST_ENV", paths, 4, 2, &v) == BT_OK && v == 2);
    setenv("BATON_TEST_ENV", "put", 1);
    CHECK(bt_env_choice("BATON_TEST_ENV", paths, 4, 0, &v) == BT_OK && v == 2);
    setenv("BATON_TEST_ENV", "am", 1);
    CHECK(bt_env_choice("BATON_TEST_ENV", paths, 4, 0, &v) == BT_OK && v == 3);
    const char *bad[] = {"PUT", "puts", " put", "1", NULL};
    for (int i = 0; bad[i]; i++) {
        setenv("BATON_TEST_ENV", bad[i], 1);
        v = 99;
        CHECK_MSG(bt_env_choice("BATON_TEST_ENV", paths, 4, 1, &v) == BT_ERR_INVALID && v == 1, "'%s'", bad[i]);
        const char *e = bt_last_error();
        CHECK_MSG(strstr(e, "BATON_TEST_ENV") && strstr(e, bad[i]) && strstr(e, "auto, mapped, put or am"), "%s", e);
    }
    static const char *const two[] = {"0", "1"};
    setenv("BATON_TEST_ENV", "yes", 1);
    CHECK(bt_env_choice("BATON_TEST_ENV", two, 2, 0, &v) == BT_ERR_INVALID && strstr(bt_last_error(), "0 or 1"));
    unsetenv("BATON_TEST_ENV");
}

int main(void)
{
    RUN(test_env_choice);
    return test_summary();
}
