#include "common/paths.h"

#include <stdio.h>
#include <stdlib.h>

bt_status bt_model_cache_dir(char *buf, size_t cap)
{
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    int n;
    if (xdg && *xdg)
        n = snprintf(buf, cap, "%s/baton/models", xdg);
    else if (home && *home)
        n = snprintf(buf, cap, "%s/.cache/baton/models", home);
    else
        return bt_fail(BT_ERR_INVALID, "neither XDG_CACHE_HOME nor HOME is set: cannot locate the model cache");
    if (n < 0 || (size_t)n >= cap) return bt_fail(BT_ERR_INVALID, "model cache path is too long");
    return BT_OK;
}

bt_status bt_default_model_path(char *buf, size_t cap)
{
    const char *env = getenv("BATON_MODEL");
    if (env && *env) {
        int n = snprintf(buf, cap, "%s", env);
        return (n < 0 || (size_t)n >= cap) ? bt_fail(BT_ERR_INVALID, "BATON_MODEL is too long") : BT_OK;
    }
    char dir[3072];
    bt_status st = bt_model_cache_dir(dir, sizeof dir);
    if (st) return st;
    int n = snprintf(buf, cap, "%s/%s", dir, BT_DEFAULT_MODEL_FILE);
    return (n < 0 || (size_t)n >= cap) ? bt_fail(BT_ERR_INVALID, "model path is too long") : BT_OK;
}
