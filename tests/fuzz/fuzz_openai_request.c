/* libFuzzer target: an OpenAI request body as the router takes it, http_json_parse (what http_request_json does)
 * then rtr_openai_parse, or rtr_embed_parse for /v1/embeddings. Byte 0 picks the API (mod 3: chat, completions,
 * embeddings); the rest is the body. Accepted requests must satisfy what the router relies on afterwards. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/http.h"
#include "common/log.h"
#include "fuzz_router_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int which = data[0] % 3;
    rtr_api api = which == 1 ? RTR_API_COMPLETION : RTR_API_CHAT;
    size_t len = size - 1;
    char *body = malloc(len ? len : 1); /* exact size, not NUL-terminated: overreads are caught */
    if (!body) return 0;
    if (len) memcpy(body, data + 1, len);
    cJSON *j = NULL;
    if (which == 2 && http_json_parse(body, len, &j) == BT_OK) {
        rtr_embed_req_t e;
        int status = 0;
        bt_status st = rtr_embed_parse(&fuzz_model, j, &e, &status);
        if (st == BT_OK) {
            fuzz_check_embed(&e);
        } else if (st != BT_ERR_NOMEM && ((status != 400 && status != 404) || !bt_last_error()[0])) {
            abort();
        }
        rtr_embed_req_free(&e);
        cJSON_Delete(j);
    } else if (which != 2 && http_json_parse(body, len, &j) == BT_OK) {
        rtr_gen_t g;
        int status = 0;
        bt_status st = rtr_openai_parse(&fuzz_model, api, j, &g, &status);
        if (st == BT_OK) {
            if (status != 200 || !g.n_prompt || g.n < 1 || g.n > RTR_MAX_N || !g.max_tokens ||
                (int64_t)g.n_prompt + g.max_tokens > fuzz_model.n_ctx || g.n_stop > RTR_MAX_STOP ||
                g.top_logprobs > RTR_MAX_TOP_LOGPROBS)
                abort();
            for (size_t i = 0; i < g.n_prompt; i++)
                if (g.prompt[i] < 0 || g.prompt[i] >= tok_n_vocab(fuzz_model.tok)) abort();
        } else if (st != BT_ERR_NOMEM && ((status != 400 && status != 404) || !bt_last_error()[0])) {
            abort(); /* a refused request is a 400 or 404 with a message */
        }
        rtr_gen_free(&g);
        cJSON_Delete(j);
    }
    free(body);
    return 0;
}
