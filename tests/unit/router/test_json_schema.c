/* router/json_schema.c: schemas, json_object and regexes compile to grammars that accept valid documents and
 * reject invalid ones (checked with the engine's recognizer), and unsupported keywords are errors naming them. */
#include "router/json_schema.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/grammar.h"
#include "grammar_accepts.h"
#include "test_util.h"

static bt_grammar *compile_schema(const char *schema_text)
{
    cJSON *s = cJSON_Parse(schema_text);
    if (!s) return NULL;
    char *text = NULL;
    bt_status st = rtr_json_schema_grammar(s, &text);
    cJSON_Delete(s);
    CHECK_MSG(st == BT_OK, "schema %s: %s", schema_text, bt_last_error());
    if (st) return NULL;
    bt_grammar *g = NULL;
    st = bt_grammar_parse(text, strlen(text), &g);
    CHECK_MSG(st == BT_OK, "grammar of %s does not parse: %s\n%s", schema_text, bt_last_error(), text);
    free(text);
    return g;
}

typedef struct kase {
    const char *schema;
    const char *good[6];
    const char *bad[6];
} kase;

static const kase CASES[] = {
    {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"}},"
     "\"required\":[\"b\"]}",
     {"{\"a\": 1, \"b\": \"x\"}", "{\"b\":\"\"}", "{ \"a\" : -12 , \"b\" : \"q\\n\" }"},
     {"{}", "{\"a\": 1}", "{\"b\": \"x\", \"a\": 1}", "{\"a\": 1.5, \"b\": \"x\"}", "{\"b\": 1}"}},
    {"{\"type\":\"integer\",\"minimum\":-15,\"maximum\":123}",
     {"-15", "-9", "0", "7", "99", "123"},
     {"-16", "124", "200", "-0", "007", "1000"}},
    {"{\"type\":\"integer\",\"exclusiveMinimum\":99}", {"100", "1000", "123456"}, {"99", "0", "-5", "0100"}},
    {"{\"type\":\"integer\",\"maximum\":-3}", {"-3", "-10", "-99999"}, {"-2", "0", "5"}},
    {"{\"type\":\"number\",\"minimum\":0,\"maximum\":1}", {"0", "0.5", "1", "1.0", "0.999"}, {"1.5", "-0.1", "2", "1.01"}},
    {"{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}", {"\"ab\"", "\"abc\"", "\"\\n\\t\"", "\"é€\""},
     {"\"a\"", "\"abcd\"", "\"\\ud800x\""}},
    {"{\"type\":\"string\",\"pattern\":\"^[a-z]+-\\\\d{2,3}$\"}", {"\"ab-12\"", "\"x-123\""},
     {"\"ab-1\"", "\"AB-12\"", "\"ab-1234\""}},
    {"{\"type\":\"string\",\"pattern\":\"^(\\\"|\\\\\\\\|[^a])$\"}", {"\"\\\"\"", "\"\\\\\"", "\"b\"", "\"\\n\""},
     {"\"a\"", "\"\"\"", "\"bb\""}},
    {"{\"enum\":[\"red\",1,null,{\"k\":[true]}]}", {"\"red\"", "1", "null", "{\"k\":[true]}"}, {"\"blue\"", "2"}},
    {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":1,\"maxItems\":3}",
     {"[true]", "[true, false]", "[ false , true , true ]"}, {"[]", "[true,true,true,true]", "[1]"}},
    {"{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\"},{\"type\":\"integer\"}],\"items\":false}",
     {"[\"a\", 1]"}, {"[\"a\"]", "[\"a\", 1, 2]"}},
    {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}", {"\"x\"", "null"}, {"1", "true"}},
    {"{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
     "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},"
     "\"$ref\":\"#/$defs/node\"}",
     {"{\"v\": 1, \"next\": null}", "{\"v\": 1, \"next\": {\"v\": 2, \"next\": null}}"},
     {"{\"v\": 1}", "{\"v\": 1, \"next\": {}}"}},
    {"{\"type\":\"string\",\"format\":\"date\"}", {"\"2024-01-28\"", "\"1999-12-01\""}, {"\"2024-13-01\"", "\"24-1-1\""}},
    {"{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}", {"{}", "{\"x\": 1, \"y\": 2}"},
     {"{\"x\": \"s\"}"}},
    {"{\"type\":[\"integer\",\"null\"]}", {"5", "null"}, {"\"5\"", "1.5"}},
    {"{}", {"{\"any\": [1, \"x\", null]}", "3", "\"s\""}, {"{", "nul"}},
};

static void test_cases(void)
{
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        bt_grammar *g = compile_schema(CASES[i].schema);
        if (!g) continue;
        for (int k = 0; k < 6 && CASES[i].good[k]; k++)
            CHECK_MSG(grammar_accepts(g, CASES[i].good[k]), "schema %s should accept %s", CASES[i].schema,
                      CASES[i].good[k]);
        for (int k = 0; k < 6 && CASES[i].bad[k]; k++)
            CHECK_MSG(!grammar_accepts(g, CASES[i].bad[k]), "schema %s should reject %s", CASES[i].schema,
                      CASES[i].bad[k]);
        bt_grammar_free(g);
    }
}

static void expect_error(const char *schema_text, bt_status want, const char *needle)
{
    cJSON *s = cJSON_Parse(schema_text);
    REQUIRE(s != NULL);
    char *text = NULL;
    bt_status st = rtr_json_schema_grammar(s, &text);
    cJSON_Delete(s);
    free(text);
    CHECK_MSG(st == want, "schema %s: status %d, want %d", schema_text, st, want);
    CHECK_MSG(strstr(bt_last_error(), needle) != NULL, "schema %s: error '%s' lacks '%s'", schema_text,
              bt_last_error(), needle);
}

static void test_errors(void)
{
    expect_error("{\"type\":\"object\",\"minProperties\":1}", BT_ERR_UNSUPPORTED, "'minProperties'");
    expect_error("{\"not\":{\"type\":\"string\"}}", BT_ERR_UNSUPPORTED, "'not'");
    expect_error("{\"if\":{},\"then\":{}}", BT_ERR_UNSUPPORTED, "'if'");
    expect_error("{\"type\":\"number\",\"multipleOf\":0.5}", BT_ERR_UNSUPPORTED, "'multipleOf'");
    expect_error("{\"type\":\"number\",\"minimum\":0.5}", BT_ERR_UNSUPPORTED, "minimum");
    expect_error("{\"type\":\"string\",\"format\":\"hostname\"}", BT_ERR_UNSUPPORTED, "format 'hostname'");
    expect_error("{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", BT_ERR_UNSUPPORTED, "back-references");
    expect_error("{\"type\":\"string\",\"pattern\":\"(?=a)\"}", BT_ERR_UNSUPPORTED, "lookaround");
    expect_error("{\"$ref\":\"http://x/y\"}", BT_ERR_UNSUPPORTED, "$ref");
    expect_error("{\"$ref\":\"#/$defs/missing\"}", BT_ERR_INVALID, "names no definition");
    expect_error("{\"type\":\"array\",\"uniqueItems\":true}", BT_ERR_UNSUPPORTED, "'uniqueItems'");
    expect_error("{\"type\":\"strong\"}", BT_ERR_INVALID, "'strong'");
    expect_error("{\"allOf\":[{},{}]}", BT_ERR_UNSUPPORTED, "'allOf'");
    expect_error("{\"type\":\"string\",\"pattern\":\"[a\"}", BT_ERR_INVALID, "unterminated");
    /* $ref cycles that match nothing before they recur (left recursion; found by fuzz_json_schema) */
    expect_error("{\"$ref\":\"#\"}", BT_ERR_UNSUPPORTED, "$ref cycle");
    expect_error("{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"string\"}]}", BT_ERR_UNSUPPORTED, "$ref cycle");
    expect_error("{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},"
                 "\"$ref\":\"#/$defs/a\"}", BT_ERR_UNSUPPORTED, "$ref cycle");
}

static void test_json_object_and_regex(void)
{
    char *text = NULL;
    REQUIRE(rtr_json_object_grammar(&text) == BT_OK);
    bt_grammar *g = NULL;
    REQUIRE(bt_grammar_parse(text, strlen(text), &g) == BT_OK);
    free(text);
    CHECK(grammar_accepts(g, "{\"a\": [1, {\"b\": null}]}"));
    CHECK(!grammar_accepts(g, "[1]"));
    bt_grammar_free(g);

    REQUIRE(rtr_regex_grammar("^(\\d{3})-[A-Z]{2}(x|yz)?$", &text) == BT_OK);
    REQUIRE(bt_grammar_parse(text, strlen(text), &g) == BT_OK);
    free(text);
    CHECK(grammar_accepts(g, "123-AB"));
    CHECK(grammar_accepts(g, "123-ABx"));
    CHECK(grammar_accepts(g, "123-AByz"));
    CHECK(!grammar_accepts(g, "123-AByx"));
    CHECK(!grammar_accepts(g, "12-AB"));
    bt_grammar_free(g);
    CHECK(rtr_regex_grammar("a\\bb", &text) == BT_ERR_UNSUPPORTED);
    CHECK(rtr_regex_grammar("a)", &text) == BT_ERR_INVALID);
    CHECK(rtr_regex_grammar("*a", &text) == BT_ERR_INVALID);
    /* a repetition of a part that can match nothing (fuzz_json_schema's find): refused, never a grammar that the
     * nodes cannot load */
    CHECK(rtr_regex_grammar("^()+[A-]}", &text) == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "can match the empty string") != NULL);
    CHECK(rtr_regex_grammar("(a?)*b", &text) == BT_ERR_UNSUPPORTED);
}

int main(void)
{
    RUN(test_cases);
    RUN(test_errors);
    RUN(test_json_object_and_regex);
    return test_summary();
}
