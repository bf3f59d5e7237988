/* router/tool_calls.c on arbitrary model output (issue 23 item 4): model output is untrusted. The first byte picks
 * the format and the streaming split; the parser never crashes, and streaming the output in pieces gives exactly
 * the whole-text result: the same calls, and content that adds up to the same text (a difference is a bug: abort).
 * The bytes that parse as a JSON object also go through the request checks (tools, tool_choice, a message's
 * tool_calls), and strict tools under auto: what their grammar accepts never parses to a call that breaks the
 * schema. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "router/tool_calls.h"

static char *names[] = {"get_weather", "f", "a-b_c"};

static void die(const char *what, const char *text, size_t n)
{
    fprintf(stderr, "%s on %.*s\n", what, (int)n, text);
    abort();
}

/* The same bytes as a request body: tools are accepted or refused with a status, and a forcing grammar always
 * parses (it is checked again by the router; a failure here is a bug). */
static void request(const rtr_tools_t *t, const char *text, size_t n, uint8_t flags)
{
    cJSON *body = cJSON_ParseWithLength(text, n);
    if (!cJSON_IsObject(body)) {
        cJSON_Delete(body);
        return;
    }
    rtr_tool_env_t env = {.format = t->format, .tmpl_renders_tools = 1, .has_response_format = (flags >> 7) & 1,
                          .chat = 1};
    rtr_tools_t *tools = NULL;
    char *grammar = NULL;
    if (rtr_tools_from_request(body, &env, &tools, &grammar) == BT_OK && grammar) {
        bt_grammar *g = NULL;
        if (bt_grammar_parse(grammar, strlen(grammar), &g)) die("a forcing grammar does not parse", grammar, strlen(grammar));
        bt_grammar_free(g);
    }
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "tool_calls");
    cJSON *out = NULL;
    if (msgs && rtr_tools_message_calls(msgs, 0, &out) == BT_OK && !cJSON_IsArray(out))
        die("message tool_calls did not stay an array", text, n);
    cJSON_Delete(out);
    free(grammar);
    rtr_tools_free(tools);
    cJSON_Delete(body);
}

/* Strict tools under auto: when the grammar of text-or-calls accepts the output, every call the parser finds of the
 * strict tool has the only arguments its schema allows (f, not strict, takes any object). */
static void strict_auto(const rtr_tools_t *t, const char *text, size_t n)
{
    static bt_grammar *gs[5];
    rtr_tool_format f = t->format;
    if (!gs[f]) {
        cJSON *p = cJSON_Parse("{\"type\": \"object\", \"properties\": {\"city\": {\"const\": \"Paris\"}}, "
                               "\"required\": [\"city\"], \"additionalProperties\": false}");
        const cJSON *params[] = {p, NULL, NULL};
        char *g = NULL;
        if (rtr_tools_grammar(f, (const char *const *)names, params, 3, -1, 1, 1, &g) ||
            bt_grammar_parse(g, strlen(g), &gs[f]))
            die("the strict grammar does not build", g ? g : "", g ? strlen(g) : 0);
        free(g);
        cJSON_Delete(p);
    }
    bt_gstate a = {0}, tmp = {0};
    int ok = !bt_grammar_start(gs[f], &a) &&
             bt_grammar_advance(gs[f], &a, (const uint8_t *)text, n, &tmp) == 1 && a.accepting && !a.overflow;
    bt_gstate_free(&a);
    bt_gstate_free(&tmp);
    if (!ok) return;
    rtr_tool_result_t r;
    if (rtr_tool_parse(t, text, n, &r) == 1)
        for (size_t i = 0; i < r.n_calls; i++)
            if (!strcmp(r.calls[i].name, "get_weather") && strcmp(r.calls[i].arguments, "{\"city\":\"Paris\"}"))
                die("a strict call the grammar allowed does not match its schema", text, n);
    rtr_tool_result_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    static const rtr_tool_format fmts[] = {RTR_TOOL_FMT_HERMES, RTR_TOOL_FMT_LLAMA3, RTR_TOOL_FMT_MISTRAL,
                                           RTR_TOOL_FMT_MISTRAL_ARGS};
    rtr_tools_t t = {.format = fmts[data[0] & 3], .choice = RTR_TOOL_CHOICE_AUTO, .parallel = (data[0] >> 2) & 1,
                     .names = names, .n_names = 3, .named = -1};
    size_t step = (size_t)(data[0] >> 3) + 1;
    const char *text = (const char *)data + 1;
    size_t n = size - 1;

    rtr_tool_result_t whole;
    int rc = rtr_tool_parse(&t, text, n, &whole);

    char *content = malloc(n + 1);
    if (!content) return 0;
    size_t k = 0;
    rtr_tool_stream_t s;
    rtr_tool_stream_init(&s, &t);
    for (size_t i = 0; i < n; i += step) {
        const char *out;
        size_t n_out, len = n - i < step ? n - i : step;
        rtr_tool_stream_push(&s, text + i, len, &out, &n_out);
        if (k + n_out > n) die("stream released more than it was given", text, n);
        memcpy(content + k, out, n_out);
        k += n_out;
    }
    rtr_tool_result_t streamed;
    const char *out;
    size_t n_out;
    int rs = rtr_tool_stream_finish(&s, &streamed, &out, &n_out);
    if (rs == 1 && streamed.content) {
        out = streamed.content;
        n_out = streamed.content_len;
    }
    if (k + n_out > n) die("stream released more than it was given", text, n);
    memcpy(content + k, out, n_out);
    k += n_out;
    if (rs != rc) die("stream and whole disagree on calls", text, n);
    if (rc == 1) {
        const char *want = whole.content ? whole.content : "";
        if (k != whole.content_len || memcmp(content, want, k)) die("content before the calls differs", text, n);
        if (whole.n_calls != streamed.n_calls) die("call counts differ", text, n);
        for (size_t i = 0; i < whole.n_calls; i++)
            if (strcmp(whole.calls[i].name, streamed.calls[i].name) ||
                strcmp(whole.calls[i].arguments, streamed.calls[i].arguments))
                die("calls differ", text, n);
        if (!t.parallel && whole.n_calls > 1) die("more than one call without parallel_tool_calls", text, n);
    } else if (k != n || memcmp(content, text, n)) {
        die("plain content did not come out whole", text, n);
    }
    rtr_tool_result_free(&whole);
    rtr_tool_result_free(&streamed);
    rtr_tool_stream_free(&s);
    free(content);
    request(&t, text, n, data[0]);
    strict_auto(&t, text, n);
    return 0;
}
