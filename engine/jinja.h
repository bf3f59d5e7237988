/* A sandboxed interpreter for the Jinja subset that chat templates use, with the semantics of Hugging Face's
 * apply_chat_template (Jinja2 ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks on, loopcontrols, the
 * {% generation %} tag, tojson as json.dumps(ensure_ascii=False), raise_exception, strftime_now, namespace).
 *
 * Model files are untrusted, so a template sees plain data only (none, booleans, numbers, strings, lists, dicts)
 * and the few methods of str and dict that templates call; no Python object is reachable. Rendering is bounded in
 * steps, wall time, memory, nesting depth and output size (jinja_limits); every failure is one message that starts
 * with the template's line:col. Not supported (an error at parse time): extends/include/import/block, call blocks,
 * recursive loops, {% raw %} is supported. Case mapping (upper/lower/title/capitalize) is ASCII only.
 *
 * A parsed template is immutable: several threads may render it at once. No globals. */
#ifndef BATON_ENGINE_JINJA_H
#define BATON_ENGINE_JINJA_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/status.h"

typedef struct jinja_tmpl jinja_tmpl;

typedef struct jinja_limits {
    uint64_t max_steps;   /* expression and statement evaluations */
    uint32_t max_ms;      /* wall time of one render */
    size_t max_mem;       /* bytes of values allocated by one render */
    uint32_t max_depth;   /* nesting of expressions, statements and macro calls */
    size_t max_out;       /* bytes of output (and of any captured block) */
} jinja_limits;

/* Defaults sized for chat prompts: 10M steps, 2 s, 128 MiB, depth 200, 32 MiB of output. */
jinja_limits jinja_default_limits(void);

/* Parses src[0..len). Errors: BT_ERR_FORMAT with "line L:C: why" (a syntax error or an unsupported tag),
 * BT_ERR_NOMEM. *out is set only on success; free with jinja_free. */
bt_status jinja_parse(const char *src, size_t len, jinja_tmpl **out);

void jinja_free(jinja_tmpl *t);

/* Renders t with the members of the JSON object vars as its variables (messages, tools, bos_token, ...), into a
 * malloc'd NUL-terminated string (*out, *out_len; caller frees). now is the Unix time that strftime_now formats
 * (local time); limits may be NULL for the defaults. Errors: BT_ERR_INVALID with "line L:C: why" (a type error, an
 * undefined value used, raise_exception's message, a limit reached), BT_ERR_NOMEM. Outputs are set only on success. */
bt_status jinja_render(const jinja_tmpl *t, const cJSON *vars, int64_t now, const jinja_limits *limits, char **out,
                       size_t *out_len);

#endif
