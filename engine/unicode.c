#include "engine/unicode.h"

const char *uni_cat_name(uni_cat c)
{
    static const char names[UNI_CAT_COUNT][3] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                                 "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                                 "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
    return (unsigned)c < UNI_CAT_COUNT ? names[c] : "??";
}

/* Expected total length of a sequence from its lead byte; 0 for a byte that cannot start one. */
static size_t lead_len(uint8_t b)
{
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* Valid range of the second byte given the lead byte (excludes overlongs, surrogates, > U+10FFFF). */
static int second_ok(uint8_t lead, uint8_t b)
{
    switch (lead) {
    case 0xE0: return b >= 0xA0 && b <= 0xBF;
    case 0xED: return b >= 0x80 && b <= 0x9F;
    case 0xF0: return b >= 0x90 && b <= 0xBF;
    case 0xF4: return b >= 0x80 && b <= 0x8F;
    default: return b >= 0x80 && b <= 0xBF;
    }
}

size_t uni_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp, int *valid)
{
    uint8_t b = s[0];
    size_t n = lead_len(b);
    if (n == 1) {
        *cp = b;
        if (valid) *valid = 1;
        return 1;
    }
    if (n == 0 || len < n || !second_ok(b, s[1])) goto bad;
    for (size_t i = 2; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) goto bad;
    uint32_t c = b & (0x7F >> n);
    for (size_t i = 1; i < n; i++) c = (c << 6) | (s[i] & 0x3F);
    *cp = c;
    if (valid) *valid = 1;
    return n;
bad:
    *cp = UNI_REPLACEMENT;
    if (valid) *valid = 0;
    return 1;
}

size_t uni_utf8_encode(uint32_t cp, uint8_t out[4])
{
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = UNI_REPLACEMENT;
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

int uni_utf8_valid(const uint8_t *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int ok;
        uint32_t cp;
        i += uni_utf8_decode(s + i, len - i, &cp, &ok);
        if (!ok) return 0;
    }
    return 1;
}

size_t uni_utf8_complete_prefix(const uint8_t *s, size_t len)
{
    /* Only the last (up to 3) bytes can be an incomplete sequence: find the last lead byte. */
    size_t back = len < 4 ? len : 4;
    for (size_t k = 1; k <= back; k++) {
        size_t at = len - k;
        uint8_t b = s[at];
        if ((b & 0xC0) == 0x80) continue; /* continuation byte: keep looking for its lead */
        size_t n = lead_len(b);
        if (n <= k) return len; /* ASCII, invalid lead, or a sequence that is already complete */
        /* The tail s[at..len) is shorter than the lead announces: hold it back only if it can still be valid. */
        if (k >= 2 && !second_ok(b, s[at + 1])) return len;
        for (size_t i = at + 2; i < len; i++)
            if ((s[i] & 0xC0) != 0x80) return len;
        return at;
    }
    return len;
}
