#include "common/env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bt_status bt_env_choice(const char *name, const char *const *choices, int n, int dflt, int *out)
{
    *out = dflt;
    const char *v = getenv(name);
    if (!v || !*v) return BT_OK;
    for (int i = 0; i < n; i++)
        if (!strcmp(v, choices[i])) {
            *out = i;
            return BT_OK;
        }
    char list[256] = "";
    size_t len = 0;
    for (int i = 0; i < n && len < sizeof list; i++)
        len += (size_t)snprintf(list + len, sizeof list - len, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ",
                                choices[i]);
    return bt_fail(BT_ERR_INVALID, "%s='%s': expected %s", name, v, list);
}
