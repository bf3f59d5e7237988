/* engine/jinja: rendering against outputs that Jinja2 3.1.6 produced in Hugging Face's environment (the table was
 * generated with transformers' chat-template environment), errors with line:col, the sandbox and the limits.
 * Real model templates against Jinja2: tests/integration/test_chat_template_jinja.py. */
#include <stdlib.h>
#include <string.h>

#include "engine/jinja.h"
#include "test_util.h"

/* Renders text with vars (JSON); NULL on any error (bt_last_error() says which). */
static char *render_with(const char *text, const char *vars_json, const jinja_limits *lim)
{
    jinja_tmpl *t;
    if (jinja_parse(text, strlen(text), &t) != BT_OK) return NULL;
    cJSON *vars = cJSON_Parse(vars_json);
    char *out = NULL;
    size_t len = 0;
    bt_status st = jinja_render(t, vars, 1721995200, lim, &out, &len);
    cJSON_Delete(vars);
    jinja_free(t);
    if (st) return NULL;
    if (strlen(out) != len) {
        free(out);
        return NULL;
    }
    return out;
}

static const struct {
    const char *text, *vars, *want;
} CASES[] = {
    {"  {% if true %}\n    a\n  {%- endif %}\n{# c #}\n  {%+ if 1 %}b{% endif +%}\nc\n",
     "{}",
     "    a  b\nc"},
    {"{{- ' x ' -}}\n\n{{ 'y' }}  {{ 'z' }}\n",
     "{}",
     " x y  z"},
    {"{% for i in [1, 2] %}\n  {{ i }}\n{% endfor %}\n",
     "{}",
     "  1\n  2\n"},
    {"a {% raw %}{{ x }} {% y %}{% endraw %} b",
     "{}",
     "a {{ x }} {% y %} b"},
    {"{% for x in xs if x > 1 %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% else %}none{% endfor %}",
     "{\"xs\": [1, 2, 3]}",
     "102TrueFalse2;211FalseTrue2;"},
    {"{% for x in [] %}x{% else %}empty{% endfor %}",
     "{}",
     "empty"},
    {"{% for x in [1,2,3,4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
     "{}",
     "13"},
    {"{% set y = 1 %}{% for x in [1] %}{% set y = 5 %}{% endfor %}{{ y }}{% if true %}{% set y = 7 %}{% endif %}{{ y }}",
     "{}",
     "17"},
    {"{% set ns = namespace(n=0) %}{% for x in [1,2,3] %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}",
     "{}",
     "6"},
    {"{% for k, v in d | items %}{{ k }}={{ v }},{% endfor %}{% for k, v in d.items() %}{{ k }}{% endfor %}",
     "{\"d\": {\"b\": 1, \"a\": [1, \"x\"]}}",
     "b=1,a=[1, 'x'],ba"},
    {"{{ none }}|{{ true }}|{{ 1.0 }}|{{ 0.1 + 0.2 }}|{{ 1e20 }}|{{ [1, 'a', none, {'k': \"it's\"}] }}|{{ undefined_thing }}|{{ 10 / 4 }}|{{ -7 // 2 }}|{{ -7 % 3 }}",
     "{}",
     "None|True|1.0|0.30000000000000004|1e+20|[1, 'a', None, {'k': \"it's\"}]||2.5|-4|2"},
    {"{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.split() }}|{{ s.split('b') }}|{{ s | trim | lower }}|{{ s[1:3] }}|{{ s[::-1] }}|{{ s | length }}|{{ s.replace('b', 'X') }}",
     "{\"s\": \" ab\\u00e9b\\u3000\"}",
     "ab\xC3""\xA9""b|ab\xC3""\xA9""b\xE3""\x80""\x80""| ab\xC3""\xA9""b|['ab\xC3""\xA9""b']|[' a', '\xC3""\xA9""', '\\u3000']|ab\xC3""\xA9""b|ab|\xE3""\x80""\x80""b\xC3""\xA9""ba |6| aX\xC3""\xA9""X\xE3""\x80""\x80"""},
    {"{{ 'a<b' ~ 1 ~ none }}|{{ 'x' + 'y' }}|{{ 'ab' * 3 }}|{{ 'Hello World'.lower().title() }}|{{ 'hi' | capitalize }}|{{ 'x' in 'axb' }}|{{ 'a,b'.split(',') | join('+') }}|{{ 'abc'.startswith(('x', 'a')) }}|{{ 'abc'.endswith('bc') }}",
     "{}",
     "a<b1None|xy|ababab|Hello World|Hi|True|a+b|True|True"},
    {"{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ [] | tojson(indent=4) }}|{{ '\xC3""\xA9""\"\\n\\t\x01""' | tojson }}",
     "{\"d\": {\"a\": [1, 2.5, true, null], \"b\": {}, \"c\": \"\\u00fc\"}}",
     "{\"a\": [1, 2.5, true, null], \"b\": {}, \"c\": \"\xC3""\xBC""\"}|{\n  \"a\": [\n    1,\n    2.5,\n    true,\n    null\n  ],\n  \"b\": {},\n  \"c\": \"\xC3""\xBC""\"\n}|[]|\"\xC3""\xA9""\\\"\\n\\t\\u0001\""},
    {"{{ x is defined }}{{ y is defined }}{{ x is none }}{{ x is string }}{{ x is number }}{{ x is mapping }}{{ x is iterable }}{{ x is sequence }}{{ 3 is odd }}{{ 'a' is lower }}{{ x is not none }}",
     "{\"x\": [1]}",
     "TrueFalseFalseFalseFalseFalseTrueTrueTrueTrueTrue"},
    {"{{ xs | map(attribute='n') | join(',') }}|{{ xs | selectattr('n', 'equalto', 2) | list | length }}|{{ xs | rejectattr('n') | list }}|{{ xs | first }}|{{ xs | last }}|{{ none | default('d') }}|{{ z | default('d') }}|{{ '' | default('e', true) }}|{{ ['b', 'A', 'a'] | unique | list }}|{{ 'a\\nb' | indent(2) }}|{{ xs | map(attribute='n') | map('string') | list }}",
     "{\"xs\": [{\"n\": 1}, {\"n\": 2}, {\"n\": 0}]}",
     "1,2,0|1|[{'n': 0}]|{'n': 1}|{'n': 0}|None|d|e|['b', 'A']|a\n  b|['1', '2', '0']"},
    {"{% macro f(a, b='B') %}[{{ a }}{{ b }}]{% endmacro %}{{ f(1) }}{{ f(1, b=2) }}{% set s %}x{{ 1 }}{% endset %}{{ s }}{% filter upper %}abc{% endfilter %}{% generation %}gen{% endgeneration %}",
     "{}",
     "[1B][12]x1ABCgen"},
    {"{{ '<{}|{}|{name}>{{x}}'.format('a', 'b', name='n') }}{{ '{1}{0}'.format('x', 'y') }}|{{ '%s=%d%%' % ('k', 3) }}|{{ [3, 1, 2] | min }}{{ ['b', 'A'] | max }}|{{ xs | sort(attribute='n') | map(attribute='n') | list }}|{{ ['b', 'C', 'a'] | sort(reverse=true) }}|{{ '\xC3""\xA9""\xF0""\x9F""\x98""\x80""' | tojson(ensure_ascii=True) }}|{{ 1 < 2 < 3 }}{{ 3 > 2 == 1 }}",
     "{\"xs\": [{\"n\": 2}, {\"n\": 1}]}",
     "<a|b|n>{x}yx|k=3%|1b|[1, 2]|['C', 'b', 'a']|\"\\u00e9\\ud83d\\ude00\"|TrueFalse"},
    {"{{ '<a>'|safe + '<b>' }}|{{ '<a>' ~ '<b>'|safe }}",
     "{}",
     "<a>&lt;b&gt;|<a><b>"},
    {"{{ 'y' if x else 'n' }}{{ 'y' if not x }}|{{ x or 'dflt' }}|{{ x and 'both' }}|{{ 1 < 2 }}{{ [1, 2] == [1, 2] }}{{ 1 == 1.0 }}{{ 'a' != 'b' }}",
     "{\"x\": 0}",
     "ny|dflt|0|TrueTrueTrueTrue"},
};

static void test_matches_jinja2(void)
{
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        char *got = render_with(CASES[i].text, CASES[i].vars, NULL);
        CHECK_MSG(got && !strcmp(got, CASES[i].want), "case %zu: got \"%s\"", i, got ? got : bt_last_error());
        free(got);
    }
}

/* The error message of rendering text (parse or render), or "" when it renders. */
static const char *error_of(const char *text, const char *vars, const jinja_limits *lim, bt_status *st)
{
    jinja_tmpl *t;
    *st = jinja_parse(text, strlen(text), &t);
    if (*st) return bt_last_error();
    cJSON *v = cJSON_Parse(vars);
    char *out = NULL;
    size_t len;
    *st = jinja_render(t, v, 0, lim, &out, &len);
    cJSON_Delete(v);
    jinja_free(t);
    free(out);
    return *st ? bt_last_error() : "";
}

static void test_errors_have_line_and_column(void)
{
    static const struct {
        const char *text;
        bt_status st;
        const char *msg;
    } cases[] = {
        {"ab\n  {% if x %}", BT_ERR_FORMAT, "line 2:6: 'if' is never closed (expected 'endif')"},
        {"{{ 1 + }}", BT_ERR_FORMAT, "line 1:8: unexpected '}}'"},
        {"{% for x in %}", BT_ERR_FORMAT, "line 1:13: unexpected '%}'"},
        {"x\n{% endfor %}", BT_ERR_FORMAT, "line 2:4: unexpected 'endfor'"},
        {"{% include 'a' %}", BT_ERR_FORMAT, "line 1:4: unknown or unsupported tag 'include'"},
        {"{{ 'abc }}", BT_ERR_FORMAT, "line 1:4: unterminated string"},
        {"{{ x", BT_ERR_FORMAT, "line 1:1: unclosed '{{'"},
        {"\n\n   {{ raise_exception('bad ' ~ 1) }}", BT_ERR_INVALID, "line 3:7: raise_exception: bad 1"},
        {"{{ messages[0].role.x.y }}", BT_ERR_INVALID, "line 1:22: 'x' is undefined (getting an attribute)"},
        {"{{ 1 + 'a' }}", BT_ERR_INVALID, "line 1:6: unsupported operand types for arithmetic: int and string"},
        {"{{ none | tojson }}{{ x | tojson }}", BT_ERR_INVALID, "line 1:27: tojson: object of type undefined"},
        {"{{ [1] | map('nope') | list }}", BT_ERR_INVALID, "unknown filter 'nope'"},
        {"{{ 1 is frob }}", BT_ERR_INVALID, "line 1:6: unknown test 'frob'"},
        {"{% set x = 1 %}{% set x.y = 2 %}", BT_ERR_INVALID, "can only assign attributes of a namespace()"},
        {"{{ 1 // 0 }}", BT_ERR_INVALID, "integer division or modulo by zero"},
        {"{{ messages | map(attribute='role') | length }}", BT_ERR_INVALID, "a generator"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        bt_status st;
        const char *e = error_of(cases[i].text, "{\"messages\": [{\"role\": \"user\"}]}", NULL, &st);
        CHECK_MSG(st == cases[i].st && strstr(e, cases[i].msg), "case %zu: %d \"%s\"", i, (int)st, e);
    }
}

/* Only plain data is reachable: no Python attribute, no method that mutates, no way out of the sandbox. */
static void test_sandbox(void)
{
    static const char *const cases[] = {
        "{{ ''.__class__ }}{{ messages.__len__ }}{{ messages.append }}{{ loop }}{{ self }}{{ cycler }}",
        "{{ messages[0].__dict__ }}{{ namespace.__init__ }}{{ range.__globals__ }}{{ dict.fromkeys }}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *got = render_with(cases[i], "{\"messages\": [{\"role\": \"user\"}]}", NULL);
        CHECK_MSG(got && !strcmp(got, ""), "case %zu: \"%s\"", i, got ? got : bt_last_error());
        free(got);
    }
    bt_status st;
    error_of("{{ messages.pop() }}", "{\"messages\": []}", NULL, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "'pop' is undefined (called)"));
    error_of("{% set ns = namespace() %}{% set ns._x = 1 %}", "{}", NULL, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "'_'"));
    /* a loop variable kept past its loop stays valid memory */
    char *got = render_with("{% set ns = namespace() %}{% for x in [1, 2] %}{% set ns.l = loop %}{% endfor %}"
                            "{{ ns.l.index }}", "{}", NULL);
    CHECK(got && !strcmp(got, "2"));
    free(got);
}

static void test_limits(void)
{
    jinja_limits lim = jinja_default_limits();
    bt_status st;
    lim.max_steps = 1000;
    error_of("{% for i in range(100000) %}{{ i }}{% endfor %}", "{}", &lim, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "more than 1000 steps"));
    lim = jinja_default_limits();
    lim.max_out = 100;
    error_of("{% for i in range(1000) %}{{ i }}{% endfor %}", "{}", &lim, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "output is longer than 100 bytes"));
    lim = jinja_default_limits();
    lim.max_mem = (size_t)1 << 20;
    error_of("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "{}",
             &lim, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "memory"));
    lim = jinja_default_limits();
    lim.max_depth = 30;
    error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "{}", &lim, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "nested deeper than 30"));
    lim = jinja_default_limits();
    lim.max_ms = 50;
    lim.max_steps = UINT64_MAX;
    error_of("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "{}", &lim, &st);
    CHECK(st == BT_ERR_INVALID && strstr(bt_last_error(), "longer than 50 ms"));
    /* parser depth: deeply nested parentheses are an error, not a stack overflow */
    char deep[4000] = "{{ ";
    memset(deep + 3, '(', 1500);
    deep[1503] = '1';
    memset(deep + 1504, ')', 1500);
    strcpy(deep + 3004, " }}");
    jinja_tmpl *t;
    CHECK(jinja_parse(deep, strlen(deep), &t) == BT_ERR_FORMAT && strstr(bt_last_error(), "nested too deeply"));
}

static void test_strftime_now(void)
{
    char *got = render_with("{{ strftime_now('%Y-%m') }}|{{ strftime_now('') }}", "{}", NULL);
    CHECK(got && !strcmp(got, "2024-07|"));
    free(got);
}

int main(void)
{
    RUN(test_matches_jinja2);
    RUN(test_errors_have_line_and_column);
    RUN(test_sandbox);
    RUN(test_limits);
    RUN(test_strftime_now);
    return test_summary();
}
