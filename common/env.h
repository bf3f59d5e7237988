/* Environment switches (BATON_*), read with one strict rule: unset or empty means the default, a listed value is
 * taken, anything else is an error that names the variable and the values it takes. Settings that have a flag are
 * read by the flag parsers (node/node.c, router/main.c); the others by a *_from_env reader next to the options they
 * fill (bt_cpu_opts_from_env, bt_forward_profile_from_env, kvx_context_opts_from_env), called only at a process's
 * edge (bt_node_main, a CLI command): constructors never read the environment. README lists every variable. */
#ifndef BATON_COMMON_ENV_H
#define BATON_COMMON_ENV_H

#include "common/status.h"

/* *out = the index in choices[n] of the variable's value, or dflt when it is unset or empty. BT_ERR_INVALID
 * ("NAME='v': expected a, b or c") for any other value; *out is then dflt. Can't block. */
bt_status bt_env_choice(const char *name, const char *const *choices, int n, int dflt, int *out);

#endif
