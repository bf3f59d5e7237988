/* Grammar tests (engine/grammar.c): parse errors with positions, left recursion, limits, and matching of
 * sentences and non-sentences (literals, classes with ranges, negation and UTF-8, repetitions, grouping, nesting)
 * byte by byte, including prefixes that are alive but not accepting. */
#include "engine/grammar.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_util.h"

static bt_grammar *gparse(const char *text)
{
    bt_grammar *g = NULL;
    bt_status st = bt_grammar_parse(text, strlen(text), &g);
    CHECK_MSG(st == BT_OK, "parse failed: %s", bt_last_error());
    return g;
}

/* 2 = accepted, 1 = a live prefix, 0 = rejected */
static int gmatch(const bt_grammar *g, const char *s, size_t n)
{
    bt_gstate a = {0}, b = {0};
    if (bt_grammar_start(g, &a) != BT_OK) return -1;
    int alive = 1;
    for (size_t i = 0; i < n && alive; i++) {
        alive = bt_grammar_step(g, &a, (uint8_t)s[i], &b) == 1;
        bt_gstate t = a;
        a = b;
        b = t;
    }
    int r = alive ? (a.accepting ? 2 : 1) : 0;
    bt_gstate_free(&a);
    bt_gstate_free(&b);
    return r;
}

#define ACC(g, s) CHECK_MSG(gmatch(g, s, strlen(s)) == 2, "expected '%s' accepted", s)
#define PRE(g, s) CHECK_MSG(gmatch(g, s, strlen(s)) == 1, "expected '%s' a live prefix", s)
#define REJ(g, s) CHECK_MSG(gmatch(g, s, strlen(s)) == 0, "expected '%s' rejected", s)

static void expect_error(const char *text, const char *needle)
{
    bt_grammar *g = NULL;
    bt_status st = bt_grammar_parse(text, strlen(text), &g);
    CHECK(st == BT_ERR_INVALID);
    CHECK_MSG(strstr(bt_last_error(), needle) != NULL, "error '%s' lacks '%s'", bt_last_error(), needle);
    bt_grammar_free(g);
}

static void test_errors(void)
{
    expect_error("", "empty grammar");
    expect_error("root ::= foo", "rule 'foo' is used but never defined");
    expect_error("start ::= \"a\"", "no 'root' rule");
    expect_error("root ::= \"a", "line 1 col 12: unterminated string literal");
    expect_error("root ::= \"a\"\n  | [a-", "line 2 col 8: unterminated character class");
    expect_error("root ::= [z-a]", "reversed");
    expect_error("root ::= (\"a\"", "expected ')'");
    expect_error("root ::= \"a\" )", "unbalanced ')'");
    expect_error("root ::= \"\\q\"", "unknown escape");
    expect_error("root ::= \"a\"\nroot ::= \"b\"", "defined twice");
    expect_error("root ::= root \"a\" | \"a\"", "left-recursive");
    expect_error("root ::= a\na ::= b? a \"x\" | \"y\"\nb ::= \"z\"", "left-recursive");
    expect_error("root ::= a\na ::= (\"\" | \"q\") root", "left-recursive");
    expect_error("root ::= \"a\"{3,2}", "n < m");
    expect_error("root ::= \"a\"{20000}", "repetition count");
    expect_error("root ::= \"\\uD800\"", "not a Unicode scalar value");
    expect_error("root :: \"a\"", "expected '::='");
}

static void test_basic(void)
{
    bt_grammar *g = gparse("root ::= \"ab\" | \"ac\" d\nd ::= [0-9]+ # digits\n");
    ACC(g, "ab");
    ACC(g, "ac1");
    ACC(g, "ac123");
    PRE(g, "a");
    PRE(g, "ac");
    REJ(g, "ad");
    REJ(g, "ab1");
    REJ(g, "ac1x");
    bt_grammar_free(g);

    g = gparse("root ::= (\"x\" | \"y\")* \"z\"? [^a-c\\n]{2,3}");
    ACC(g, "xyxzqq");
    ACC(g, "qqq");
    ACC(g, "dd");
    ACC(g, "xyz"); /* x y z all fit the class too */
    PRE(g, "x");
    REJ(g, "qqqq");
    REJ(g, "za");
    REJ(g, "z\n");
    bt_grammar_free(g);

    g = gparse("root ::= \"\" | \"(\" root \")\"");
    ACC(g, "");
    ACC(g, "((()))");
    PRE(g, "((");
    REJ(g, "())");
    bt_grammar_free(g);

    g = gparse("root ::= [a]{3} [b]{0,2} [c]{2,}");
    ACC(g, "aaacc");
    ACC(g, "aaabbccc");
    REJ(g, "aacc");
    REJ(g, "aaabbbcc");
    PRE(g, "aaac");
    bt_grammar_free(g);
}

static void test_utf8(void)
{
    bt_grammar *g = gparse("root ::= [α-ω]+ \"→\" [^\"\\\\]* \"\\\"\"");
    ACC(g, "αβγ→x€😀\"");
    REJ(g, "a→\"");
    REJ(g, "α→\\\"");
    PRE(g, "α\xe2");  /* a partial character is alive */
    REJ(g, "α\xe2\x86\x91"); /* ↑ is not → */
    bt_grammar_free(g);

    g = gparse("root ::= .");
    ACC(g, "a");
    ACC(g, "\xf4\x8f\xbf\xbf"); /* U+10FFFF */
    REJ(g, "\xed\xa0\x80");     /* a surrogate */
    REJ(g, "\xc0\xaf");         /* overlong */
    REJ(g, "\xf4\x90\x80\x80"); /* above U+10FFFF */
    REJ(g, "\x80");
    bt_grammar_free(g);

    g = gparse("root ::= \"\\x41\\u00e9\\U0001F600\"");
    ACC(g, "A\xc3\xa9\xf0\x9f\x98\x80");
    bt_grammar_free(g);
}

static void test_json(void)
{
    const char *text =
        "root   ::= object\n"
        "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
        "object ::= \"{\" ws ( string \":\" ws value (\",\" ws string \":\" ws value)* )? \"}\" ws\n"
        "array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\" ws\n"
        "string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4}) )* \"\\\"\" ws\n"
        "number ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [-+]? [0-9]+)? ws\n"
        "ws     ::= [ \\t\\n]{0,20}\n";
    bt_grammar *g = gparse(text);
    ACC(g, "{}");
    ACC(g, "{\"a\": [1, 2.5e-3, {\"b\": null}], \"c\": \"x\\u00e9\\n\"}");
    ACC(g, "{ \"k\" : true }");
    PRE(g, "{\"a\": [1");
    REJ(g, "{\"a\": 01}");
    REJ(g, "{\"a\": [1,]}");
    REJ(g, "{\"a\" 1}");
    REJ(g, "[]");
    /* deep nesting grows the stack and stays within the limit */
    char deep[2000];
    size_t n = 0;
    n += (size_t)snprintf(deep + n, sizeof deep - n, "{\"a\":");
    for (int i = 0; i < 100; i++) deep[n++] = '[';
    deep[n++] = '1';
    for (int i = 0; i < 100; i++) deep[n++] = ']';
    deep[n++] = '}';
    CHECK(gmatch(g, deep, n) == 2);
    bt_grammar_free(g);
}

static void test_depth_limit(void)
{
    bt_grammar *g = gparse("root ::= \"(\" root \")\" | \"x\"");
    char s[4096];
    int k = 1000; /* 1000 open frames exceed BT_GRAMMAR_MAX_DEPTH: those paths die, never accepting more */
    for (int i = 0; i < k; i++) s[i] = '(';
    s[k] = 'x';
    for (int i = 0; i < k; i++) s[k + 1 + i] = ')';
    CHECK(gmatch(g, s, (size_t)(2 * k + 1)) != 2);
    bt_gstate a = {0}, b = {0};
    REQUIRE(bt_grammar_start(g, &a) == BT_OK);
    for (int i = 0; i < k && bt_grammar_step(g, &a, '(', &b) == 1; i++) {
        bt_gstate t = a;
        a = b;
        b = t;
    }
    CHECK(b.overflow || a.overflow);
    bt_gstate_free(&a);
    bt_gstate_free(&b);
    bt_grammar_free(g);
}

static void test_canon_load(void)
{
    bt_grammar *g = gparse("root ::= \"a\" x | \"a\" y\nx ::= \"b\" | \"c\"\ny ::= \"c\" | \"b\" \"d\"");
    bt_gstate a = {0}, b = {0}, c = {0};
    REQUIRE(bt_grammar_start(g, &a) == BT_OK);
    REQUIRE(bt_grammar_step(g, &a, 'a', &b) == 1);
    CHECK(b.n_stacks == 4);
    REQUIRE(bt_gstate_canon(&b) == BT_OK);
    REQUIRE(bt_gstate_load(g, &c, b.w, b.n) == BT_OK);
    CHECK(c.n == b.n && !memcmp(c.w, b.w, sizeof *b.w * b.n));
    CHECK(!memcmp(c.next, b.next, sizeof b.next));
    CHECK(bt_gstate_can(&c, 'b') && bt_gstate_can(&c, 'c') && !bt_gstate_can(&c, 'd'));
    bt_gstate tmp = {0};
    CHECK(bt_grammar_advance(g, &c, (const uint8_t *)"bd", 2, &tmp) == 1);
    CHECK(c.accepting && !bt_gstate_has_next(&c));
    CHECK(bt_grammar_advance(g, &b, (const uint8_t *)"bx", 2, &tmp) == 0);
    CHECK(b.n_stacks == 4); /* unchanged */
    bt_gstate_free(&a);
    bt_gstate_free(&b);
    bt_gstate_free(&c);
    bt_gstate_free(&tmp);
    bt_grammar_free(g);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    RUN(test_errors);
    RUN(test_basic);
    RUN(test_utf8);
    RUN(test_json);
    RUN(test_depth_limit);
    RUN(test_canon_load);
    return test_summary();
}
