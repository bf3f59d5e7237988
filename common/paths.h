/* Where baton finds things on disk: the model cache and the default model. */
#ifndef BATON_COMMON_PATHS_H
#define BATON_COMMON_PATHS_H

#include <stddef.h>

#include "common/status.h"

#define BT_DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

/* ${XDG_CACHE_HOME:-$HOME/.cache}/baton/models into buf. BT_ERR_INVALID when it does not fit or HOME is unset. */
bt_status bt_model_cache_dir(char *buf, size_t cap);

/* The model used when --model is absent: $BATON_MODEL if set, else the cached default model's path.
 * Only computes the path; does not check that the file exists. */
bt_status bt_default_model_path(char *buf, size_t cap);

#endif
