/* libFuzzer target: chat templates. Byte 0 even: chat_tmpl_detect over the rest (any text as a GGUF's
 * tokenizer.chat_template). Byte 0 odd: the rest is messages "role\0content\0role\0content..." rendered with the
 * served model's template through rtr_chat_encode (issue 16.7): content must never add a special marker, so the
 * prompt holds exactly as many CONTROL tokens as the same conversation with empty contents. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "fuzz_router_model.h"

static size_t n_control(const tok_ids *v)
{
    size_t k = 0;
    for (size_t i = 0; i < v->n; i++) k += tok_token_type(fuzz_model.tok, v->ids[i]) == TOK_TYPE_CONTROL;
    return k;
}

static void render(const char *s, size_t n)
{
    chat_msg msgs[8], empty[8];
    size_t k = 0, at = 0;
    while (at < n && k < 8) {
        const char *role = s + at;
        size_t rl = strnlen(role, n - at);
        at += rl + 1;
        if (at > n) break;
        const char *content = s + at;
        size_t cl = strnlen(content, n - at);
        at += cl + 1;
        if (!rtr_chat_role_ok(role)) continue;
        msgs[k] = (chat_msg){role, content, cl, NULL};
        empty[k] = (chat_msg){role, "", 0, NULL};
        k++;
    }
    if (!k) return;
    tok_ids got = {0}, bare = {0};
    if (rtr_chat_encode(&fuzz_model, msgs, k, &got) == BT_OK && rtr_chat_encode(&fuzz_model, empty, k, &bare) == BT_OK &&
        n_control(&got) != n_control(&bare))
        abort();
    tok_ids_free(&got);
    tok_ids_free(&bare);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    size_t n = size - 1;
    char *s = malloc(n + 1);
    if (!s) return 0;
    memcpy(s, data + 1, n);
    s[n] = 0; /* roles are C strings: the buffer ends with a NUL */
    if (data[0] & 1) {
        render(s, n);
    } else {
        chat_tmpl_kind k;
        chat_tmpl_detect(s, n, &k);
    }
    free(s);
    return 0;
}
