/* libFuzzer target: the Jinja interpreter over any template and any messages. The input is a template, a NUL, then
 * "role\0content\0..." pairs; the template is parsed and, when it parses, rendered with those messages, tools, a
 * bos/eos and add_generation_prompt both ways, under small limits so that a slow input ends as an error quickly.
 * Any outcome is fine except a crash, a sanitizer report, a leak, or output past the limit. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine/jinja.h"

static cJSON *vars_for(const char *s, size_t n, int gen)
{
    cJSON *v = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(v, "messages");
    size_t at = 0;
    for (int k = 0; at < n && k < 8; k++) {
        const char *role = s + at;
        at += strnlen(role, n - at) + 1;
        if (at > n) break;
        const char *content = s + at;
        at += strnlen(content, n - at) + 1;
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", role);
        cJSON_AddStringToObject(m, "content", content);
        if (k == 1) {
            cJSON *calls = cJSON_AddArrayToObject(m, "tool_calls"), *c = cJSON_CreateObject();
            cJSON *f = cJSON_AddObjectToObject(c, "function");
            cJSON_AddStringToObject(f, "name", role);
            cJSON_AddItemToObject(f, "arguments", cJSON_Parse("{\"a\": 1, \"b\": [true, null, 2.5, \"x\"]}"));
            cJSON_AddItemToArray(calls, c);
        }
        cJSON_AddItemToArray(msgs, m);
    }
    cJSON_AddItemToObject(v, "tools", cJSON_Parse("[{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                                                  "\"parameters\": {\"type\": \"object\"}}}]"));
    cJSON_AddBoolToObject(v, "add_generation_prompt", gen);
    cJSON_AddStringToObject(v, "bos_token", "<s>");
    cJSON_AddStringToObject(v, "eos_token", "</s>");
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *s = (const char *)data;
    size_t tl = strnlen(s, size);
    jinja_tmpl *t;
    if (jinja_parse(s, tl, &t) != BT_OK) return 0;
    jinja_limits lim = {.max_steps = 200000, .max_ms = 1000, .max_mem = (size_t)64 << 20, .max_depth = 100,
                        .max_out = (size_t)1 << 20};
    size_t rest = tl < size ? size - tl - 1 : 0;
    char *msgs = malloc(rest + 1); /* NUL-terminated, so that the last content is a C string */
    if (!msgs) abort();
    memcpy(msgs, s + size - rest, rest);
    msgs[rest] = 0;
    for (int gen = 0; gen < 2; gen++) {
        cJSON *v = vars_for(msgs, rest, gen);
        char *out = NULL;
        size_t len = 0;
        if (jinja_render(t, v, 1721995200, &lim, &out, &len) == BT_OK) {
            if (len > lim.max_out || strlen(out) > len) abort();
            free(out);
        }
        cJSON_Delete(v);
    }
    free(msgs);
    jinja_free(t);
    return 0;
}
