/* router/json_schema.c on arbitrary JSON (issue 23): a schema compiles or fails with a status, never crashes, and
 * every grammar it produces parses (a failure there is a bug: abort). The same for regexes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "router/json_schema.h"

static void must_parse(char *text)
{
    bt_grammar *g = NULL;
    if (bt_grammar_parse(text, strlen(text), &g)) {
        fprintf(stderr, "grammar does not parse: %s\n%s\n", bt_last_error(), text);
        abort();
    }
    bt_grammar_free(g);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = 0;
    char *text = NULL;
    if (!rtr_regex_grammar(s, &text)) must_parse(text);
    cJSON *schema = cJSON_ParseWithLength(s, size);
    if (schema && !rtr_json_schema_grammar(schema, &text)) must_parse(text);
    cJSON_Delete(schema);
    free(s);
    return 0;
}
