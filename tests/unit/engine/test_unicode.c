/* engine/unicode: UTF-8 decoding and encoding, the streaming "complete prefix" rule, and category lookups. */
#include <string.h>

#include "engine/unicode.h"
#include "test_util.h"

static void test_decode_valid(void)
{
    const struct {
        const char *s;
        uint32_t cp;
        size_t len;
    } cases[] = {
        {"A", 'A', 1}, {"\xC3\xA9", 0xE9, 2}, {"\xE2\x82\xAC", 0x20AC, 3}, {"\xF0\x9F\x98\x80", 0x1F600, 4},
        {"\xF4\x8F\xBF\xBF", 0x10FFFF, 4}, {"\xEF\xBB\xBF", 0xFEFF, 3}, {"\x7F", 0x7F, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint32_t cp;
        int ok;
        size_t n = uni_utf8_decode((const uint8_t *)cases[i].s, strlen(cases[i].s), &cp, &ok);
        CHECK_MSG(ok && cp == cases[i].cp && n == cases[i].len, "case %zu: cp %X n %zu", i, cp, n);
        uint8_t out[4];
        CHECK(uni_utf8_encode(cases[i].cp, out) == cases[i].len && !memcmp(out, cases[i].s, cases[i].len));
    }
    uint32_t cp;
    CHECK(uni_utf8_decode((const uint8_t *)"", 1, &cp, NULL) == 1 && cp == 0); /* NUL is a character */
}

static void test_decode_invalid(void)
{
    const char *bad[] = {
        "\x80", "\xBF", "\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xED\xA0\x80", /* surrogate */
        "\xF4\x90\x80\x80",                                                     /* > U+10FFFF */
        "\xF5\x80\x80\x80", "\xFF", "\xC3", "\xE2\x82", "\xF0\x9F\x98", "\xC3\x41",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint32_t cp;
        int ok = 1;
        size_t n = uni_utf8_decode((const uint8_t *)bad[i], strlen(bad[i]), &cp, &ok);
        CHECK_MSG(!ok && n == 1 && cp == UNI_REPLACEMENT, "case %zu", i);
        CHECK(!uni_utf8_valid((const uint8_t *)bad[i], strlen(bad[i])));
    }
    uint8_t out[4];
    CHECK(uni_utf8_encode(0xD800, out) == 3 && !memcmp(out, "\xEF\xBF\xBD", 3));
    CHECK(uni_utf8_encode(0x110000, out) == 3);
    CHECK(uni_utf8_valid((const uint8_t *)"h\xC3\xA9llo \xF0\x9F\x98\x80", 11));
}

static void test_complete_prefix(void)
{
    const uint8_t *s = (const uint8_t *)"ab\xF0\x9F\x98\x80";
    CHECK(uni_utf8_complete_prefix(s, 6) == 6);
    CHECK(uni_utf8_complete_prefix(s, 5) == 2);
    CHECK(uni_utf8_complete_prefix(s, 4) == 2);
    CHECK(uni_utf8_complete_prefix(s, 3) == 2);
    CHECK(uni_utf8_complete_prefix(s, 2) == 2);
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"\xC3", 1) == 0);
    /* Bytes that can never complete are not held back. */
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"a\x80", 2) == 2);
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"a\xFF", 2) == 2);
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"a\xE0\x80", 3) == 3); /* overlong start */
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"a\xE2\x41", 3) == 3);
    CHECK(uni_utf8_complete_prefix((const uint8_t *)"", 0) == 0);
}

static void test_categories(void)
{
    CHECK(uni_category('A') == UNI_LU && uni_category('z') == UNI_LL);
    CHECK(uni_category('5') == UNI_ND && uni_category(0xBD) == UNI_NO && uni_category(0x216B) == UNI_NL);
    CHECK(uni_category(0x4E2D) == UNI_LO);  /* 中 */
    CHECK(uni_category(0xAC00) == UNI_LO);  /* 가 */
    CHECK(uni_category(0x301) == UNI_MN);   /* combining acute */
    CHECK(uni_category(0x1F600) == UNI_SO); /* emoji */
    CHECK(uni_category(0x200D) == UNI_CF);  /* ZWJ */
    CHECK(uni_category(0xE000) == UNI_CO);
    CHECK(uni_category(0xD800) == UNI_CS);
    CHECK(uni_category(0x10FFFF) == UNI_CN && uni_category(0x110000) == UNI_CN);
    CHECK(uni_category(0x1C89) == UNI_LU); /* assigned in Unicode 16: the tables follow the oracle's version */
    CHECK(uni_is_letter(0x3042) && !uni_is_letter('1') && uni_is_number(0x0663) && uni_is_mark(0x0E31));
    CHECK(!strcmp(uni_cat_name(UNI_LU), "Lu") && !strcmp(uni_cat_name(UNI_CO), "Co"));
    const uint32_t spaces[] = {9, 10, 11, 12, 13, 32, 0x85, 0xA0, 0x1680, 0x2000, 0x200A, 0x2028, 0x2029, 0x202F,
                               0x205F, 0x3000};
    for (size_t i = 0; i < sizeof spaces / sizeof spaces[0]; i++) CHECK_MSG(uni_is_space(spaces[i]), "%X", spaces[i]);
    const uint32_t not_spaces[] = {0, 8, 0x1C, 0x1F, 'a', 0x200B, 0x180E, 0xFEFF, 0x2060};
    for (size_t i = 0; i < sizeof not_spaces / sizeof not_spaces[0]; i++)
        CHECK_MSG(!uni_is_space(not_spaces[i]), "%X", not_spaces[i]);
}

/* Every code point's category is in range, and UTF-8 round-trips for every scalar value. */
static void test_exhaustive(void)
{
    int bad = 0;
    for (uint32_t cp = 0; cp < 0x110000; cp++) {
        if (uni_category(cp) >= UNI_CAT_COUNT) bad++;
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        uint8_t buf[4];
        size_t n = uni_utf8_encode(cp, buf);
        uint32_t back;
        int ok;
        if (uni_utf8_decode(buf, n, &back, &ok) != n || !ok || back != cp) bad++;
    }
    CHECK(bad == 0);
}

int main(void)
{
    RUN(test_decode_valid);
    RUN(test_decode_invalid);
    RUN(test_complete_prefix);
    RUN(test_categories);
    RUN(test_exhaustive);
    return test_summary();
}
