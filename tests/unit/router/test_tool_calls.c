/* router/tool_calls.c: calls parsed from real outputs of each format (whole and streamed in every split), the
 * forcing grammar accepts exactly call syntax the parser reads back, request checks name the field, and format
 * detection from template markers. */
#include "router/tool_calls.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "grammar_accepts.h"
#include "test_util.h"

static char *names_weather[] = {"get_current_temperature", "get_temperature_date", "get_weather"};

static rtr_tools_t tools_of(rtr_tool_format f, int parallel)
{
    rtr_tools_t t = {.format = f, .choice = RTR_TOOL_CHOICE_AUTO, .parallel = parallel, .names = names_weather,
                     .n_names = 3, .named = -1};
    return t;
}

typedef struct expect {
    rtr_tool_format fmt;
    const char *text;
    int calls;              /* expected number of calls; 0 = plain content */
    const char *content;    /* expected content when calls > 0 (NULL = none) */
    const char *name0, *args0;
} expect;

/* Real outputs: Qwen 2.5's function-calling guide, Hermes 2 Pro, Llama 3.1's model card, Mistral 7B v0.3 and
 * Mistral Small 3.2 (vLLM's and the models' own examples). */
static const expect cases[] = {
    {RTR_TOOL_FMT_HERMES,
     "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n"
     "</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, "
     "CA, USA\", \"date\": \"2024-10-01\"}}\n</tool_call>",
     2, NULL, "get_current_temperature", "{\"location\":\"San Francisco, CA, USA\"}"},
    {RTR_TOOL_FMT_HERMES,
     "Let me check the weather.\n\n<tool_call>\n{\"arguments\": {\"city\": \"Paris\"}, \"name\": \"get_weather\"}\n"
     "</tool_call>",
     1, "Let me check the weather.", "get_weather", "{\"city\":\"Paris\"}"},
    /* the last call may end without its closing tag */
    {RTR_TOOL_FMT_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}", 1, NULL, "get_weather", "{}"},
    /* malformed or unknown: plain content */
    {RTR_TOOL_FMT_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par", 0, 0, 0, 0},
    {RTR_TOOL_FMT_HERMES, "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>", 0, 0, 0, 0},
    {RTR_TOOL_FMT_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"x\"}\n</tool_call>", 0, 0, 0, 0},
    {RTR_TOOL_FMT_HERMES, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call> and more", 0, 0, 0,
     0},
    {RTR_TOOL_FMT_HERMES, "The weather is sunny. No <tool_ here.", 0, 0, 0, 0},
    {RTR_TOOL_FMT_LLAMA3,
     "{\"name\": \"get_current_temperature\", \"parameters\": {\"location\": \"San Francisco, CA\", \"unit\": "
     "\"Fahrenheit\"}}",
     1, NULL, "get_current_temperature", "{\"location\":\"San Francisco, CA\",\"unit\":\"Fahrenheit\"}"},
    {RTR_TOOL_FMT_LLAMA3, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", 1, NULL,
     "get_weather", "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_LLAMA3,
     "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"get_weather\", \"parameters\": "
     "{\"city\": \"Rome\"}}",
     2, NULL, "get_weather", "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_LLAMA3, "The answer is {\"name\": \"get_weather\"}", 0, 0, 0, 0},
    {RTR_TOOL_FMT_LLAMA3, "{x} <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {}}", 1, "{x}",
     "get_weather", "{}"},
    {RTR_TOOL_FMT_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}} trailing", 0, 0, 0, 0},
    {RTR_TOOL_FMT_MISTRAL,
     "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris, France\", \"format\": "
     "\"celsius\"}}]",
     1, NULL, "get_weather", "{\"location\":\"Paris, France\",\"format\":\"celsius\"}"},
    /* [TOOL_CALLS] is a control token the detokenizer drops: the bare array opens the answer */
    {RTR_TOOL_FMT_MISTRAL,
     "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_temperature_date\", "
     "\"arguments\": {\"date\": \"2024-10-01\"}}]",
     2, NULL, "get_weather", "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", 1, NULL, "get_weather",
     "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_MISTRAL_ARGS,
     "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{\"city\": "
     "\"Rome\"}",
     2, "Sure.", "get_weather", "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_MISTRAL_ARGS, "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}", 0, 0, 0, 0},
    {RTR_TOOL_FMT_MISTRAL_ARGS, "[TOOL_CALLS] get_weather[ARGS] {\"city\": \"Paris\"}", 1, NULL, "get_weather",
     "{\"city\":\"Paris\"}"},
    {RTR_TOOL_FMT_MISTRAL, "[1, 2, 3] are numbers", 0, 0, 0, 0},
};

static void check_result(const expect *c, int rc, const rtr_tool_result_t *r, const char *how)
{
    CHECK_MSG(rc == (c->calls > 0), "%s: %s: rc %d", how, c->text, rc);
    if (rc != 1 || c->calls == 0) return;
    CHECK_MSG((int)r->n_calls == c->calls, "%s: %s: %zu calls", how, c->text, r->n_calls);
    CHECK_MSG(c->content ? r->content && !strcmp(r->content, c->content) : !r->content, "%s: %s: content '%s'", how,
              c->text, r->content ? r->content : "(null)");
    CHECK(!strcmp(r->calls[0].name, c->name0));
    CHECK_MSG(!strcmp(r->calls[0].arguments, c->args0), "%s: args %s", how, r->calls[0].arguments);
}

static void test_parse_real_outputs(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const expect *c = &cases[i];
        rtr_tools_t t = tools_of(c->fmt, 1);
        rtr_tool_result_t r;
        int rc = rtr_tool_parse(&t, c->text, strlen(c->text), &r);
        check_result(c, rc, &r, rtr_tool_format_name(c->fmt));
        rtr_tool_result_free(&r);
    }
    /* parallel_tool_calls false keeps the first call */
    rtr_tools_t t = tools_of(RTR_TOOL_FMT_HERMES, 0);
    rtr_tool_result_t r;
    CHECK(rtr_tool_parse(&t, cases[0].text, strlen(cases[0].text), &r) == 1 && r.n_calls == 1 &&
          !strcmp(r.calls[0].name, "get_current_temperature"));
    rtr_tool_result_free(&r);
    /* tool_choice none never parses */
    t.choice = RTR_TOOL_CHOICE_NONE;
    CHECK(rtr_tool_parse(&t, cases[0].text, strlen(cases[0].text), &r) == 0);
    /* nesting beyond the bound is content, not a crash */
    char deep[400];
    int k = snprintf(deep, sizeof deep, "<tool_call>{\"name\": \"get_weather\", \"arguments\": ");
    for (int i = 0; i < 100; i++) deep[k++] = '[';
    deep[k] = 0;
    t.choice = RTR_TOOL_CHOICE_AUTO;
    CHECK(rtr_tool_parse(&t, deep, strlen(deep), &r) == 0);
}

/* Streams text in pieces of `step` bytes; returns the content released and the final result. */
static int stream_in_steps(const rtr_tools_t *t, const char *text, size_t step, char *content, size_t cap,
                           rtr_tool_result_t *r)
{
    rtr_tool_stream_t s;
    rtr_tool_stream_init(&s, t);
    size_t n = strlen(text), k = 0;
    content[0] = 0;
    for (size_t i = 0; i < n; i += step) {
        size_t len = n - i < step ? n - i : step;
        const char *out;
        size_t n_out;
        rtr_tool_stream_push(&s, text + i, len, &out, &n_out);
        if (k + n_out < cap) {
            memcpy(content + k, out, n_out);
            k += n_out;
        }
    }
    const char *out;
    size_t n_out;
    int rc = rtr_tool_stream_finish(&s, r, &out, &n_out);
    if (rc == 1 && r->content) {
        out = r->content;
        n_out = r->content_len;
    }
    if (k + n_out < cap) {
        memcpy(content + k, out, n_out);
        k += n_out;
    }
    content[k] = 0;
    rtr_tool_stream_free(&s);
    return rc;
}

static void test_stream_matches_whole(void)
{
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const expect *c = &cases[i];
        rtr_tools_t t = tools_of(c->fmt, 1);
        for (size_t step = 1; step <= 7; step += 3) {
            char content[2048];
            rtr_tool_result_t r;
            int rc = stream_in_steps(&t, c->text, step, content, sizeof content, &r);
            char how[64];
            snprintf(how, sizeof how, "stream %s step %zu", rtr_tool_format_name(c->fmt), step);
            free(r.content); /* counted in content above */
            r.content = NULL;
            check_result(&(expect){c->fmt, c->text, c->calls, NULL, c->name0, c->args0}, rc, &r, how);
            if (c->calls) /* content released before the call, trailing whitespace held back */
                CHECK_MSG(!strcmp(content, c->content ? c->content : ""), "%s: content '%s'", how, content);
            else /* plain content comes out whole, byte for byte */
                CHECK_MSG(!strcmp(content, c->text), "%s: content '%s' for '%s'", how, content, c->text);
            rtr_tool_result_free(&r);
        }
    }
    /* plain text streams without waiting for the end, except a possible marker start */
    rtr_tools_t t = tools_of(RTR_TOOL_FMT_HERMES, 1);
    rtr_tool_stream_t s;
    rtr_tool_stream_init(&s, &t);
    const char *out;
    size_t n_out;
    rtr_tool_stream_push(&s, "Hello world <tool", 17, &out, &n_out);
    CHECK(n_out == 11 && !memcmp(out, "Hello world", 11));
    rtr_tool_stream_push(&s, "box> ok", 7, &out, &n_out);
    CHECK(n_out == 13 && !memcmp(out, " <toolbox> ok", 13));
    rtr_tool_stream_free(&s);
}

static bt_grammar *grammar_of(rtr_tool_format f, const char *params_json, int named, int parallel)
{
    cJSON *p1 = cJSON_Parse(params_json);
    cJSON *p2 = cJSON_Parse("{\"type\": \"object\", \"properties\": {\"date\": {\"type\": \"string\", \"format\": "
                            "\"date\"}}, \"required\": [\"date\"]}");
    const char *names[] = {"get_weather", "get_temperature_date"};
    const cJSON *params[] = {p1, p2};
    char *text = NULL;
    bt_status st = rtr_tools_grammar(f, names, params, 2, named, parallel, 0, &text);
    cJSON_Delete(p1);
    cJSON_Delete(p2);
    CHECK_MSG(st == BT_OK, "grammar: %s", bt_last_error());
    if (st) return NULL;
    bt_grammar *g = NULL;
    st = bt_grammar_parse(text, strlen(text), &g);
    CHECK_MSG(st == BT_OK, "grammar does not parse: %s\n%s", bt_last_error(), text);
    free(text);
    return g;
}

/* What the grammar accepts, the parser reads back as calls. */
static void accepts_and_parses(const bt_grammar *g, rtr_tool_format f, const char *doc, int n_calls)
{
    CHECK_MSG(grammar_accepts(g, doc), "%s grammar rejects %s", rtr_tool_format_name(f), doc);
    const char *names[] = {"get_weather", "get_temperature_date"};
    rtr_tools_t t = {.format = f, .choice = RTR_TOOL_CHOICE_REQUIRED, .parallel = 1, .names = (char **)names,
                     .n_names = 2, .named = -1};
    rtr_tool_result_t r;
    CHECK_MSG(rtr_tool_parse(&t, doc, strlen(doc), &r) == 1 && (int)r.n_calls == n_calls, "parse %s", doc);
    rtr_tool_result_free(&r);
}

static void test_grammar(void)
{
    const char *city = "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"enum\": [\"Paris\", "
                       "\"Rome\"]}, \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 7}}, \"required\": "
                       "[\"city\"], \"additionalProperties\": false}";
    bt_grammar *g = grammar_of(RTR_TOOL_FMT_HERMES, city, -1, 1);
    REQUIRE(g);
    accepts_and_parses(g, RTR_TOOL_FMT_HERMES,
                       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n"
                       "</tool_call>",
                       1);
    accepts_and_parses(g, RTR_TOOL_FMT_HERMES,
                       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>\n"
                       "<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"date\": \"2024-10-01\"}}\n"
                       "</tool_call>",
                       2);
    CHECK(!grammar_accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"));
    CHECK(!grammar_accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}}\n</tool_call>"));
    CHECK(!grammar_accepts(g, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
    CHECK(!grammar_accepts(g, "Sure! <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"));
    bt_grammar_free(g);

    g = grammar_of(RTR_TOOL_FMT_HERMES, city, 1, 0); /* named get_temperature_date, one call */
    REQUIRE(g);
    CHECK(!grammar_accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"));
    accepts_and_parses(g, RTR_TOOL_FMT_HERMES,
                       "<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"date\": \"2024-10-01\"}}\n"
                       "</tool_call>",
                       1);
    CHECK(!grammar_accepts(g, "<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"date\": \"2024-10-01\"}}\n"
                      "</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"date\": "
                      "\"2024-10-02\"}}\n</tool_call>"));
    bt_grammar_free(g);

    g = grammar_of(RTR_TOOL_FMT_LLAMA3, city, -1, 0);
    REQUIRE(g);
    accepts_and_parses(g, RTR_TOOL_FMT_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", 1);
    CHECK(!grammar_accepts(g, "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"));
    bt_grammar_free(g);

    g = grammar_of(RTR_TOOL_FMT_MISTRAL, city, -1, 1);
    REQUIRE(g);
    accepts_and_parses(g, RTR_TOOL_FMT_MISTRAL,
                       "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": "
                       "\"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
                       2);
    bt_grammar_free(g);

    g = grammar_of(RTR_TOOL_FMT_MISTRAL_ARGS, city, -1, 1);
    REQUIRE(g);
    accepts_and_parses(g, RTR_TOOL_FMT_MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", 1);
    bt_grammar_free(g);

    /* a $ref inside one tool's parameters resolves inside that tool's schema */
    g = grammar_of(RTR_TOOL_FMT_HERMES,
                   "{\"$defs\": {\"c\": {\"type\": \"string\", \"enum\": [\"Oslo\"]}}, \"type\": \"object\", "
                   "\"properties\": {\"city\": {\"$ref\": \"#/$defs/c\"}}, \"required\": [\"city\"]}",
                   -1, 0);
    REQUIRE(g);
    accepts_and_parses(g, RTR_TOOL_FMT_HERMES,
                       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>", 1);
    bt_grammar_free(g);

    /* an unsupported keyword is named with its tool */
    cJSON *bad = cJSON_Parse("{\"type\": \"object\", \"patternProperties\": {}}");
    const char *names[] = {"f"};
    const cJSON *params[] = {bad};
    char *text = NULL;
    CHECK(rtr_tools_grammar(RTR_TOOL_FMT_HERMES, names, params, 1, -1, 1, 0, &text) == BT_ERR_UNSUPPORTED &&
          strstr(bt_last_error(), "patternProperties") && strstr(bt_last_error(), "tools[0]"));
    /* ... and only the tools a call may name are compiled: a named choice ignores the others' schemas */
    const char *two[] = {"ok", "f"};
    const cJSON *two_params[] = {NULL, bad};
    CHECK(rtr_tools_grammar(RTR_TOOL_FMT_HERMES, two, two_params, 2, -1, 1, 0, &text) == BT_ERR_UNSUPPORTED &&
          strstr(bt_last_error(), "tools[1]"));
    REQUIRE(rtr_tools_grammar(RTR_TOOL_FMT_HERMES, two, two_params, 2, 0, 1, 0, &text) == BT_OK);
    bt_grammar *gr = NULL;
    CHECK(bt_grammar_parse(text, strlen(text), &gr) == BT_OK);
    CHECK(grammar_accepts(gr, "<tool_call>\n{\"name\": \"ok\", \"arguments\": {\"x\": [1]}}\n</tool_call>"));
    bt_grammar_free(gr);
    free(text);
    cJSON_Delete(bad);
}

/* The grammar of strict tools under auto: get_weather strict (city Paris or Rome), get_temperature_date any. */
static bt_status text_grammar(rtr_tool_format f, bt_grammar **out)
{
    cJSON *p1 = cJSON_Parse("{\"type\": \"object\", \"properties\": {\"city\": {\"enum\": [\"Paris\", \"Rome\"]}}, "
                            "\"required\": [\"city\"], \"additionalProperties\": false}");
    const char *names[] = {"get_weather", "get_temperature_date"};
    const cJSON *params[] = {p1, NULL};
    char *text = NULL;
    bt_status st = rtr_tools_grammar(f, names, params, 2, -1, 1, 1, &text);
    cJSON_Delete(p1);
    if (!st) st = bt_grammar_parse(text, strlen(text), out);
    CHECK_MSG(st == BT_OK, "%s text grammar: %s\n%s", rtr_tool_format_name(f), bt_last_error(), text ? text : "");
    free(text);
    return st;
}

/* Accepted documents parse to what they are: plain text (no call), or calls whose strict arguments validate. */
static void text_case(const bt_grammar *g, rtr_tool_format f, const char *doc, int accepted, int n_calls)
{
    CHECK_MSG(grammar_accepts(g, doc) == accepted, "%s: '%s' should be %s", rtr_tool_format_name(f), doc,
              accepted ? "accepted" : "rejected");
    if (!accepted) return;
    const char *names[] = {"get_weather", "get_temperature_date"};
    rtr_tools_t t = {.format = f, .choice = RTR_TOOL_CHOICE_AUTO, .parallel = 1, .names = (char **)names,
                     .n_names = 2, .named = -1};
    rtr_tool_result_t r;
    int rc = rtr_tool_parse(&t, doc, strlen(doc), &r);
    CHECK_MSG(rc == (n_calls > 0) && (int)r.n_calls == n_calls, "%s: '%s' parses to %d calls", rtr_tool_format_name(f),
              doc, (int)r.n_calls);
    rtr_tool_result_free(&r);
}

static void test_grammar_with_text(void)
{
    bt_grammar *g = NULL;
    REQUIRE(text_grammar(RTR_TOOL_FMT_HERMES, &g) == BT_OK);
    text_case(g, RTR_TOOL_FMT_HERMES, "Hello! It is sunny.", 1, 0);
    text_case(g, RTR_TOOL_FMT_HERMES, "", 1, 0);
    text_case(g, RTR_TOOL_FMT_HERMES, "a <b> <t <tool_c <<tool_cal x", 1, 0);
    text_case(g, RTR_TOOL_FMT_HERMES,
              "Let me check.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
              1, 1);
    text_case(g, RTR_TOOL_FMT_HERMES,
              "<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"anything\": [1]}}\n</tool_call>",
              1, 1);
    text_case(g, RTR_TOOL_FMT_HERMES,
              "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>", 0, 0);
    text_case(g, RTR_TOOL_FMT_HERMES, "text <tool_call> more text", 0, 0);
    bt_grammar_free(g);

    REQUIRE(text_grammar(RTR_TOOL_FMT_LLAMA3, &g) == BT_OK);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "Sure, it is {sunny}.", 1, 0);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "x <|python_ta y <| <<|p", 1, 0);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "<b>bold</b>", 1, 0);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", 1, 1);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", 0, 0);
    text_case(g, RTR_TOOL_FMT_LLAMA3, " \r\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", 0, 0);
    text_case(g, RTR_TOOL_FMT_LLAMA3, "x <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {}}", 0, 0);
    bt_grammar_free(g);

    REQUIRE(text_grammar(RTR_TOOL_FMT_MISTRAL, &g) == BT_OK);
    text_case(g, RTR_TOOL_FMT_MISTRAL, "ok [1] [TOOL_CALL [x", 1, 0);
    text_case(g, RTR_TOOL_FMT_MISTRAL,
              "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", 1, 1);
    text_case(g, RTR_TOOL_FMT_MISTRAL, " [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]", 0, 0);
    bt_grammar_free(g);

    REQUIRE(text_grammar(RTR_TOOL_FMT_MISTRAL_ARGS, &g) == BT_OK);
    text_case(g, RTR_TOOL_FMT_MISTRAL_ARGS, "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}", 1, 1);
    text_case(g, RTR_TOOL_FMT_MISTRAL_ARGS, "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}", 0, 0);
    text_case(g, RTR_TOOL_FMT_MISTRAL_ARGS, "a plain answer", 1, 0);
    bt_grammar_free(g);
}

static bt_status from_request(const char *body_json, int renders, rtr_tool_format f, int has_rf, rtr_tools_t **t,
                              char **grammar)
{
    cJSON *body = cJSON_Parse(body_json);
    rtr_tool_env_t env = {.format = f, .tmpl_renders_tools = renders, .has_response_format = has_rf, .chat = 1};
    bt_status st = rtr_tools_from_request(body, &env, t, grammar);
    cJSON_Delete(body);
    return st;
}

#define WEATHER "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": " \
                "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}"

static void expect_refused(const char *body, int renders, rtr_tool_format f, int has_rf, const char *needle)
{
    rtr_tools_t *t = NULL;
    char *g = NULL;
    bt_status st = from_request(body, renders, f, has_rf, &t, &g);
    CHECK_MSG(st < 0 && strstr(bt_last_error(), needle), "%s: %d '%s' (wanted '%s')", body, st,
              st ? bt_last_error() : "", needle);
    rtr_tools_free(t);
    free(g);
}

static void test_request(void)
{
    rtr_tools_t *t = NULL;
    char *g = NULL;
    CHECK(from_request("{\"tools\": [" WEATHER "]}", 1, RTR_TOOL_FMT_HERMES, 0, &t, &g) == BT_OK);
    REQUIRE(t);
    CHECK(t->choice == RTR_TOOL_CHOICE_AUTO && t->parallel && !g && t->n_names == 1 && t->tools_json);
    rtr_tools_free(t);
    CHECK(from_request("{\"tools\": [" WEATHER "], \"tool_choice\": \"required\", \"parallel_tool_calls\": false}", 1,
                       RTR_TOOL_FMT_HERMES, 0, &t, &g) == BT_OK);
    CHECK(t && t->choice == RTR_TOOL_CHOICE_REQUIRED && !t->parallel && g && strstr(g, "tccalls ::= tccall\n") &&
          strstr(g, "root ::= tccalls\n"));
    rtr_tools_free(t);
    free(g);
    CHECK(from_request("{\"tools\": [" WEATHER "], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
                       "\"get_weather\"}}}",
                       1, RTR_TOOL_FMT_LLAMA3, 0, &t, &g) == BT_OK);
    CHECK(t && t->choice == RTR_TOOL_CHOICE_NAMED && t->named == 0 && g && strstr(g, "tccalls ::= tcbody\n"));
    rtr_tools_free(t);
    free(g);
    /* tool_choice none: the template still sees the tools, nothing is parsed or forced, any template will do */
    CHECK(from_request("{\"tools\": [" WEATHER "], \"tool_choice\": \"none\"}", 0, RTR_TOOL_FMT_NONE, 1, &t, &g) ==
          BT_OK);
    CHECK(t && t->choice == RTR_TOOL_CHOICE_NONE && !g);
    rtr_tools_free(t);
    CHECK(from_request("{\"tools\": []}", 0, RTR_TOOL_FMT_NONE, 0, &t, &g) == BT_OK && !t && !g);

    expect_refused("{\"tools\": {}}", 1, RTR_TOOL_FMT_HERMES, 0, "'tools' must be an array");
    expect_refused("{\"tools\": [{\"type\": \"retrieval\"}]}", 1, RTR_TOOL_FMT_HERMES, 0, "'tools[0].type'");
    expect_refused("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a b\"}}]}", 1, RTR_TOOL_FMT_HERMES,
                   0, "'tools[0].function.name'");
    expect_refused("{\"tools\": [" WEATHER ", " WEATHER "]}", 1, RTR_TOOL_FMT_HERMES, 0, "repeats");
    expect_refused("{\"tools\": [" WEATHER "], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
                   "\"nope\"}}}",
                   1, RTR_TOOL_FMT_HERMES, 0, "not in 'tools'");
    expect_refused("{\"tools\": [" WEATHER "], \"tool_choice\": \"sometimes\"}", 1, RTR_TOOL_FMT_HERMES, 0,
                   "'tool_choice' must be");
    expect_refused("{\"tool_choice\": \"required\"}", 1, RTR_TOOL_FMT_HERMES, 0, "needs a non-empty 'tools'");
    expect_refused("{\"tools\": [" WEATHER "]}", 0, RTR_TOOL_FMT_HERMES, 0, "does not render tools");
    expect_refused("{\"tools\": [" WEATHER "]}", 1, RTR_TOOL_FMT_NONE, 0, "--tool-call-parser");
    expect_refused("{\"tools\": [" WEATHER "], \"tool_choice\": \"required\"}", 1, RTR_TOOL_FMT_HERMES, 1,
                   "'response_format'");
    /* strict under auto: a grammar of text or calls; a strict tool's schema must compile, another's need not */
    CHECK(from_request("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"strict\": true}}]}", 1,
                       RTR_TOOL_FMT_HERMES, 0, &t, &g) == BT_OK);
    CHECK(t && t->choice == RTR_TOOL_CHOICE_AUTO && g && strstr(g, "root ::= tctext tccalls?"));
    rtr_tools_free(t);
    free(g);
    expect_refused("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"strict\": true, "
                   "\"parameters\": {\"type\": \"object\", \"minProperties\": 1}}}]}",
                   1, RTR_TOOL_FMT_HERMES, 0, "minProperties");
    CHECK(from_request("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"strict\": true}}, "
                       "{\"type\": \"function\", \"function\": {\"name\": \"g\", \"parameters\": {\"type\": "
                       "\"object\", \"minProperties\": 1}}}]}",
                       1, RTR_TOOL_FMT_HERMES, 0, &t, &g) == BT_OK && g);
    rtr_tools_free(t);
    free(g);
    expect_refused("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"strict\": true}}]}", 1,
                   RTR_TOOL_FMT_HERMES, 1, "response_format");
    expect_refused("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": "
                   "\"object\", \"minProperties\": 1}}}], \"tool_choice\": \"required\"}",
                   1, RTR_TOOL_FMT_HERMES, 0, "minProperties");
    expect_refused("{\"tools\": [" WEATHER "], \"parallel_tool_calls\": 1}", 1, RTR_TOOL_FMT_HERMES, 0,
                   "parallel_tool_calls");
    /* strict is honoured under a grammar */
    CHECK(from_request("{\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"strict\": true}}], "
                       "\"tool_choice\": \"required\"}",
                       1, RTR_TOOL_FMT_HERMES, 0, &t, &g) == BT_OK);
    rtr_tools_free(t);
    free(g);
    /* completions take no tools */
    cJSON *body = cJSON_Parse("{\"tools\": [" WEATHER "]}");
    rtr_tool_env_t env = {.format = RTR_TOOL_FMT_HERMES, .tmpl_renders_tools = 1, .chat = 0};
    CHECK(rtr_tools_from_request(body, &env, &t, &g) < 0 && strstr(bt_last_error(), "/v1/chat/completions"));
    cJSON_Delete(body);
}

static void test_message_calls(void)
{
    cJSON *calls = cJSON_Parse("[{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": "
                               "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]");
    cJSON *out = NULL;
    REQUIRE(rtr_tools_message_calls(calls, 2, &out) == BT_OK);
    const cJSON *args = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(out, 0), "function"), "arguments");
    CHECK(cJSON_IsObject(args) && !strcmp(cJSON_GetObjectItem(args, "city")->valuestring, "Paris"));
    cJSON_Delete(out);
    cJSON_Delete(calls);
    calls = cJSON_Parse("[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": \"not json\"}}]");
    CHECK(rtr_tools_message_calls(calls, 3, &out) == BT_ERR_INVALID &&
          strstr(bt_last_error(), "'messages[3].tool_calls[0].function.arguments'"));
    cJSON_Delete(calls);
    calls = cJSON_Parse("[{\"type\": \"function\", \"function\": {\"arguments\": \"{}\"}}]");
    CHECK(rtr_tools_message_calls(calls, 0, &out) == BT_ERR_INVALID && strstr(bt_last_error(), "name"));
    cJSON_Delete(calls);
}

static void test_detect_and_ids(void)
{
    static const struct {
        const char *text;
        rtr_tool_format f;
    } t[] = {
        {"{{- \"<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call>\" }}",
         RTR_TOOL_FMT_HERMES},
        {"{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{\"name\"", RTR_TOOL_FMT_NONE}, /* Qwen3-Coder XML */
        {"{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
         "value}.' }}",
         RTR_TOOL_FMT_LLAMA3},
        {"{{- \"<|python_tag|>\" + tool_call.name + \".call(\" }}", RTR_TOOL_FMT_LLAMA3},
        {"{{- \"[TOOL_CALLS][\" }}", RTR_TOOL_FMT_MISTRAL},
        {"{{- '[TOOL_CALLS]' + tool_call.function.name }}{{- '[ARGS]' + args }}", RTR_TOOL_FMT_MISTRAL_ARGS},
        {"{% for message in messages %}<|im_start|>{{ message.role }}{% endfor %}", RTR_TOOL_FMT_NONE},
    };
    for (size_t i = 0; i < sizeof t / sizeof *t; i++)
        CHECK_MSG(rtr_tool_format_detect(t[i].text, strlen(t[i].text)) == t[i].f, "detect %s", t[i].text);
    rtr_tool_format f;
    CHECK(rtr_tool_format_choose("hermes", NULL, 0, &f) == BT_OK && f == RTR_TOOL_FMT_HERMES);
    CHECK(rtr_tool_format_choose("mistral", "x[ARGS]", 7, &f) == BT_OK && f == RTR_TOOL_FMT_MISTRAL_ARGS);
    CHECK(rtr_tool_format_choose("auto", t[3].text, strlen(t[3].text), &f) == BT_OK && f == RTR_TOOL_FMT_LLAMA3);
    CHECK(rtr_tool_format_choose("pythonic", NULL, 0, &f) == BT_ERR_INVALID && strstr(bt_last_error(), "hermes"));
    char id[40];
    rtr_tool_call_id(RTR_TOOL_FMT_HERMES, id, sizeof id);
    CHECK(strlen(id) == 29 && !strncmp(id, "call_", 5));
    rtr_tool_call_id(RTR_TOOL_FMT_MISTRAL, id, sizeof id);
    CHECK(strlen(id) == 9);
}

int main(void)
{
    RUN(test_parse_real_outputs);
    RUN(test_stream_matches_whole);
    RUN(test_grammar);
    RUN(test_grammar_with_text);
    RUN(test_request);
    RUN(test_message_calls);
    RUN(test_detect_and_ids);
    return test_summary();
}
