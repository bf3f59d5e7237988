#include "common/base64.h"

#include <stdlib.h>

static const char b64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t base64_encoded_len(size_t n)
{
    return (n + 2) / 3 * 4;
}

void base64_encode_to(const void *src, size_t n, char *dst)
{
    const uint8_t *s = src;
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        *dst++ = b64_alphabet[v >> 18 & 63];
        *dst++ = b64_alphabet[v >> 12 & 63];
        *dst++ = b64_alphabet[v >> 6 & 63];
        *dst++ = b64_alphabet[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        *dst++ = b64_alphabet[v >> 18 & 63];
        *dst++ = b64_alphabet[v >> 12 & 63];
        *dst++ = '=';
        *dst++ = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        *dst++ = b64_alphabet[v >> 18 & 63];
        *dst++ = b64_alphabet[v >> 12 & 63];
        *dst++ = b64_alphabet[v >> 6 & 63];
        *dst++ = '=';
    }
    *dst = '\0';
}

bt_status base64_encode(const void *src, size_t n, char **out)
{
    if (n > (SIZE_MAX - 1) / 4 * 3 - 3) return bt_fail(BT_ERR_NOMEM, "base64: input of %zu bytes too large", n);
    char *dst = malloc(base64_encoded_len(n) + 1);
    if (!dst) return bt_fail(BT_ERR_NOMEM, "base64: out of memory");
    base64_encode_to(src, n, dst);
    *out = dst;
    return BT_OK;
}

static int b64_value(unsigned char c)
{
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

bt_status base64_decode(const char *src, size_t len, uint8_t **out, size_t *out_len)
{
    if (len % 4 != 0) return bt_fail(BT_ERR_FORMAT, "base64: length %zu is not a multiple of 4", len);
    size_t pad = 0;
    if (len >= 4 && src[len - 1] == '=') pad = src[len - 2] == '=' ? 2 : 1;
    size_t n = len / 4 * 3 - pad;
    uint8_t *dst = malloc(n + 1);
    if (!dst) return bt_fail(BT_ERR_NOMEM, "base64: out of memory");
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        int last = i + 4 == len;
        int v[4];
        for (int k = 0; k < 4; k++) {
            unsigned char c = (unsigned char)src[i + k];
            if (c == '=' && last && k >= 4 - (int)pad) {
                v[k] = 0;
                continue;
            }
            v[k] = b64_value(c);
            if (v[k] < 0) {
                free(dst);
                return bt_fail(BT_ERR_FORMAT, "base64: bad character at offset %zu", i + (size_t)k);
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        dst[o++] = (uint8_t)(w >> 16);
        if (!last || pad < 2) dst[o++] = (uint8_t)(w >> 8);
        if (!last || pad < 1) dst[o++] = (uint8_t)w;
    }
    dst[n] = '\0';
    *out = dst;
    *out_len = n;
    return BT_OK;
}
