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

/* Each case's schema compiles to a grammar that accepts its good documents and rejects its bad ones. */
static void check_kases(const kase *cases, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        bt_grammar *g = compile_schema(cases[i].schema);
        if (!g) continue;
        for (int k = 0; k < 6 && cases[i].good[k]; k++)
            CHECK_MSG(grammar_accepts(g, cases[i].good[k]), "schema %s should accept %s", cases[i].schema,
                      cases[i].good[k]);
        for (int k = 0; k < 6 && cases[i].bad[k]; k++)
            CHECK_MSG(!grammar_accepts(g, cases[i].bad[k]), "schema %s should reject %s", cases[i].schema,
                      cases[i].bad[k]);
        bt_grammar_free(g);
    }
}

static void test_cases(void)
{
    check_kases(CASES, sizeof CASES / sizeof *CASES);
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
    expect_error("{\"type\":\"number\",\"minimum\":0.1234567890123456}", BT_ERR_UNSUPPORTED, "'minimum'");
    expect_error("{\"type\":\"number\",\"maximum\":1e-20}", BT_ERR_UNSUPPORTED, "'maximum'");
    expect_error("{\"type\":\"number\",\"minimum\":123456789.125,\"maximum\":987654321.0000001}", BT_ERR_UNSUPPORTED,
                 "'maximum'");
    expect_error("{\"type\":\"number\",\"minimum\":1.5,\"exclusiveMaximum\":1.5}", BT_ERR_INVALID, "no value");
    expect_error("{\"type\":\"string\",\"format\":\"hostname\"}", BT_ERR_UNSUPPORTED, "format 'hostname'");
    expect_error("{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", BT_ERR_UNSUPPORTED, "back-references");
    expect_error("{\"type\":\"string\",\"pattern\":\"(?=a)\"}", BT_ERR_UNSUPPORTED, "lookaround");
    expect_error("{\"$ref\":\"http://x/y\"}", BT_ERR_UNSUPPORTED, "$ref");
    expect_error("{\"$ref\":\"#/$defs/missing\"}", BT_ERR_INVALID, "names no definition");
    expect_error("{\"type\":\"array\",\"uniqueItems\":true}", BT_ERR_UNSUPPORTED, "'uniqueItems'");
    expect_error("{\"type\":\"strong\"}", BT_ERR_INVALID, "'strong'");
    expect_error("{\"allOf\":[{},{}]}", BT_ERR_UNSUPPORTED, "'allOf'");
    /* oneOf whose branches may overlap: refused (it used to be taken as anyOf, which may produce a value that
     * matches two branches) */
    expect_error("{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"string\",\"maxLength\":3}]}", BT_ERR_UNSUPPORTED,
                 "'oneOf': branches 0 and 1");
    expect_error("{\"oneOf\":[{\"type\":\"null\"},{\"type\":\"number\"},{\"type\":\"integer\"}]}",
                 BT_ERR_UNSUPPORTED, "'oneOf': branches 1 and 2");
    expect_error("{\"oneOf\":[{\"enum\":[1,2]},{\"enum\":[3,2.0]}]}", BT_ERR_UNSUPPORTED, "'oneOf'");
    expect_error("{\"oneOf\":[{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"a\"}}},"
                 "{\"type\":\"object\",\"properties\":{\"k\":{\"const\":\"b\"}},\"required\":[\"k\"]}]}",
                 BT_ERR_UNSUPPORTED, "'oneOf'"); /* k not required in the first: {} matches both */
    expect_error("{\"oneOf\":[{},{\"type\":\"null\"}]}", BT_ERR_UNSUPPORTED, "'oneOf'");
    expect_error("{\"type\":\"string\",\"pattern\":\"[a\"}", BT_ERR_INVALID, "unterminated");
    /* $ref cycles that match nothing before they recur (left recursion; found by fuzz_json_schema) */
    expect_error("{\"$ref\":\"#\"}", BT_ERR_UNSUPPORTED, "$ref cycle");
    expect_error("{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"string\"}]}", BT_ERR_UNSUPPORTED, "$ref cycle");
    expect_error("{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},"
                 "\"$ref\":\"#/$defs/a\"}", BT_ERR_UNSUPPORTED, "$ref cycle");
}

/* Numbers between non-integer and negative bounds (issue 23: exact, not a 400): every decimal of up to three
 * fraction digits in [-12, 12] (and a few spellings: "-0", "1.0", "007") is accepted exactly when it is a JSON
 * number that compares right against the bounds as doubles, which is what a validator does. */
static void test_number_bounds(void)
{
    static const struct {
        const char *schema;
        int hl, hu, xl, xu;
        double lo, hi;
    } B[] = {
        {"{\"type\":\"number\",\"minimum\":-2.5}", 1, 0, 0, 0, -2.5, 0},
        {"{\"type\":\"number\",\"exclusiveMaximum\":0.1}", 0, 1, 0, 1, 0, 0.1},
        {"{\"type\":\"number\",\"minimum\":-2.5,\"exclusiveMaximum\":0.1}", 1, 1, 0, 1, -2.5, 0.1},
        {"{\"type\":\"number\",\"exclusiveMinimum\":-0.125,\"maximum\":-0.05}", 1, 1, 1, 0, -0.125, -0.05},
        {"{\"type\":\"number\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":1}", 1, 1, 1, 1, 0, 1},
        {"{\"type\":\"number\",\"minimum\":3.25,\"maximum\":3.5}", 1, 1, 0, 0, 3.25, 3.5},
        {"{\"type\":\"number\",\"minimum\":-7,\"maximum\":-7}", 1, 1, 0, 0, -7, -7},
        {"{\"type\":\"number\",\"maximum\":-0.001}", 0, 1, 0, 0, 0, -0.001},
        {"{\"type\":\"number\",\"exclusiveMinimum\":9.99}", 1, 0, 1, 0, 9.99, 0},
        {"{\"type\":\"number\",\"minimum\":0,\"maximum\":1,\"exclusiveMinimum\":0.5}", 1, 1, 1, 0, 0.5, 1},
        {"{\"type\":\"number\",\"minimum\":-1e-3,\"maximum\":2e1}", 1, 1, 0, 0, -0.001, 20},
    };
    for (size_t c = 0; c < sizeof B / sizeof *B; c++) {
        bt_grammar *g = compile_schema(B[c].schema);
        if (!g) continue;
        int bad = 0, accepted = 0;
        for (int v = -12000; v <= 12000 && bad < 5; v++) {
            for (int f = 0; f <= 3; f++) { /* v / 1000 written with f fraction digits, when it has no more */
                int scale = f == 0 ? 1000 : f == 1 ? 100 : f == 2 ? 10 : 1;
                if (v % scale) continue;
                char doc[32];
                int a = abs(v) / 1000, frac = (abs(v) % 1000) / scale;
                if (f == 0) snprintf(doc, sizeof doc, "%s%d", v < 0 ? "-" : "", a);
                else snprintf(doc, sizeof doc, "%s%d.%0*d", v < 0 ? "-" : "", a, f, frac);
                double x = strtod(doc, NULL);
                int want = (!B[c].hl || (B[c].xl ? x > B[c].lo : x >= B[c].lo)) &&
                           (!B[c].hu || (B[c].xu ? x < B[c].hi : x <= B[c].hi));
                int got = grammar_accepts(g, doc);
                accepted += got;
                if (got != want && bad++ < 5)
                    CHECK_MSG(0, "schema %s: %s %s (want %s)", B[c].schema, doc, got ? "accepted" : "rejected",
                              want ? "accepted" : "rejected");
            }
        }
        CHECK_MSG(accepted > 0 || (B[c].hl && B[c].hu && B[c].lo == B[c].hi && (B[c].xl || B[c].xu)), "%s",
                  B[c].schema);
        CHECK(!grammar_accepts(g, "-0") || (!B[c].hl || (B[c].xl ? 0 > B[c].lo : 0 >= B[c].lo)));
        CHECK(!grammar_accepts(g, "007") && !grammar_accepts(g, "1e0") && !grammar_accepts(g, "."));
        bt_grammar_free(g);
    }
}

/* oneOf that holds exactly: branches of different types, disjoint const/enum values, a discriminator property
 * (through $ref too), a false branch. */
static void test_one_of(void)
{
    static const char *const ok[] = {
        "{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"},{\"type\":[\"null\",\"boolean\"]}]}",
        "{\"oneOf\":[{\"enum\":[\"a\",\"b\"]},{\"const\":\"c\"},{\"type\":\"number\"}]}",
        "{\"oneOf\":[{\"type\":\"integer\",\"maximum\":0},{\"enum\":[1.5,2.5]}]}",
        "{\"$defs\":{\"c\":{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"circle\"},\"r\":{\"type\":\"number\"}},"
        "\"required\":[\"kind\",\"r\"]},\"s\":{\"properties\":{\"kind\":{\"enum\":[\"square\",\"box\"]}},"
        "\"required\":[\"kind\"]}},\"oneOf\":[{\"$ref\":\"#/$defs/c\"},{\"$ref\":\"#/$defs/s\"},{\"type\":\"array\"}]}",
        "{\"oneOf\":[false,{\"type\":\"string\"},{\"type\":\"boolean\"}]}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        bt_grammar *g = compile_schema(ok[i]);
        bt_grammar_free(g);
    }
    bt_grammar *g = compile_schema(ok[3]);
    if (g) {
        CHECK(grammar_accepts(g, "{\"kind\": \"circle\", \"r\": 2}"));
        CHECK(grammar_accepts(g, "{\"kind\": \"box\"}"));
        CHECK(grammar_accepts(g, "[1, \"x\"]"));
        CHECK(!grammar_accepts(g, "{\"kind\": \"triangle\"}"));
        bt_grammar_free(g);
    }
}

/* pattern together with minLength/maxLength (an automaton crossed with a counter): exactly the pattern's strings of
 * those lengths, counted in characters (an escape or a multi-byte character is one); refused when too large. */
static void test_pattern_length(void)
{
    static const kase P[] = {
        {"{\"type\":\"string\",\"pattern\":\"^[a-z]+[0-9]*$\",\"minLength\":3,\"maxLength\":5}",
         {"\"abc\"", "\"ab1\"", "\"a1234\"", "\"abcde\"", "\"zz99\""},
         {"\"ab\"", "\"abcdef\"", "\"a12345\"", "\"1ab\"", "\"\""}},
        {"{\"type\":\"string\",\"pattern\":\"^(ab|c)*$\",\"maxLength\":3}",
         {"\"\"", "\"ab\"", "\"abc\"", "\"cab\"", "\"ccc\""},
         {"\"abab\"", "\"cccc\"", "\"a\"", "\"ba\""}},
        {"{\"type\":\"string\",\"pattern\":\"^x(é|\\\\\\\")+$\",\"minLength\":3}",
         {"\"xéé\"", "\"x\\\"\\\"\"", "\"xé\\\"é\""},
         {"\"xé\"", "\"x\\\"\"", "\"x\""}},
        {"{\"type\":\"string\",\"pattern\":\"[0-9]{2,4}-?[A-F]{0,3}\",\"minLength\":4,\"maxLength\":4}",
         {"\"1234\"", "\"12-A\"", "\"12AB\"", "\"123A\"", "\"12-F\""},
         {"\"123\"", "\"12345\"", "\"12-AB\"", "\"1-AB\""}},
    };
    check_kases(P, sizeof P / sizeof *P);
    expect_error("{\"type\":\"string\",\"pattern\":\"^[a-z]{3}$\",\"minLength\":5}", BT_ERR_INVALID, "no string");
    expect_error("{\"type\":\"string\",\"pattern\":\"^(a{1000}){1000}$\",\"maxLength\":10}", BT_ERR_UNSUPPORTED,
                 "automaton states");
    expect_error("{\"type\":\"string\",\"pattern\":\"^[a-z]{1,200}(x|y){0,90}$\",\"maxLength\":1000}",
                 BT_ERR_UNSUPPORTED, "minLength/maxLength");
    expect_error("{\"type\":\"string\",\"pattern\":\"(?=a)\",\"maxLength\":3}", BT_ERR_UNSUPPORTED, "lookaround");
    expect_error("{\"type\":\"string\",\"format\":\"date\",\"maxLength\":3}", BT_ERR_UNSUPPORTED, "'format' together");
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
    /* counted repetitions, read by one parser for the grammar path and the pattern-with-length automaton */
    static const char *bad_counts[] = {"a{", "a{,3}", "a{3,2}", "a{2", "a{x}"};
    for (size_t i = 0; i < sizeof bad_counts / sizeof *bad_counts; i++) {
        char schema[160];
        snprintf(schema, sizeof schema, "{\"type\":\"string\",\"pattern\":\"%s\",\"maxLength\":8}", bad_counts[i]);
        CHECK_MSG(rtr_regex_grammar(bad_counts[i], &text) == BT_ERR_INVALID, "%s", bad_counts[i]);
        expect_error(schema, BT_ERR_INVALID, "regex at offset");
    }
    CHECK(rtr_regex_grammar("a{3,2}", &text) == BT_ERR_INVALID && strstr(bt_last_error(), "n < m") != NULL);
    CHECK(rtr_regex_grammar("a{1001}", &text) == BT_ERR_UNSUPPORTED);
    expect_error("{\"type\":\"string\",\"pattern\":\"a{1001}\",\"maxLength\":8}", BT_ERR_UNSUPPORTED, "above 1000");
    REQUIRE(rtr_regex_grammar("^a{2,}b{1,2}$", &text) == BT_OK);
    free(text);
    text = NULL;
}

/* Arrays well past their first doublings (json_schema.c's grow): a class of 20 ranges on both paths, an automaton
 * with 20 branches out of one state (edges, states, classes, closures) and an object of 40 properties (rule memo). */
static void test_growth(void)
{
    char *text = NULL;
    bt_grammar *g = NULL;
    REQUIRE(rtr_regex_grammar("^[acegikmoqsuwyACEGIK]+$", &text) == BT_OK);
    REQUIRE(bt_grammar_parse(text, strlen(text), &g) == BT_OK);
    free(text);
    CHECK(grammar_accepts(g, "aK") && grammar_accepts(g, "yIAc"));
    CHECK(!grammar_accepts(g, "ab") && !grammar_accepts(g, "B"));
    bt_grammar_free(g);

    static const kase P[] = {
        {"{\"type\":\"string\",\"pattern\":\"^[acegikmoqsuwyACEGIK]{2}$\",\"maxLength\":2}",
         {"\"aK\"", "\"yI\""},
         {"\"a\"", "\"ab\"", "\"aKa\""}},
        {"{\"type\":\"string\",\"pattern\":\"^(a|c|e|g|i|k|m|o|q|s|u|w|y|A|C|E|G|I|K|M)+$\",\"maxLength\":3}",
         {"\"aM\"", "\"M\"", "\"yyy\""},
         {"\"\"", "\"b\"", "\"aaaa\""}},
    };
    check_kases(P, sizeof P / sizeof *P);

    char schema[2048] = "{\"type\":\"object\",\"required\":[\"p39\"],\"properties\":{";
    for (int i = 0; i < 40; i++) {
        size_t len = strlen(schema);
        snprintf(schema + len, sizeof schema - len, "%s\"p%d\":{\"type\":\"integer\"}", i ? "," : "", i);
    }
    strcat(schema, "}}");
    g = compile_schema(schema);
    REQUIRE(g != NULL);
    CHECK(grammar_accepts(g, "{\"p0\": 1, \"p20\": 2, \"p39\": 3}"));
    CHECK(!grammar_accepts(g, "{\"p0\": 1}") && !grammar_accepts(g, "{\"p39\": \"x\"}"));
    bt_grammar_free(g);
}

int main(void)
{
    RUN(test_cases);
    RUN(test_errors);
    RUN(test_number_bounds);
    RUN(test_one_of);
    RUN(test_pattern_length);
    RUN(test_json_object_and_regex);
    RUN(test_growth);
    return test_summary();
}
