/* libFuzzer target: the router's gRPC request validators. Byte 0 picks the method (mod 4: 0 Generate through
 * rtr_grpc_parse, 1 Tokenize, 2 Detokenize, 3 Embed through rtr_embed_from_grpc); the rest is the protobuf
 * request as it arrives on the wire.
 * For Generate, byte 0's bits 2-4 pick the served model's tool-call parser (mod 5: none, hermes, llama3, mistral,
 * mistral-args) and bit 5 whether its template renders tools and tool calls, so tools, tool_choice and messages
 * with calls reach every path of rtr_tools_from_request. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "fuzz_router_model.h"
#include "router/tool_calls.h"

static void generate(uint8_t how, const uint8_t *p, size_t n)
{
    Baton__V1__GenerateRequest *q = baton__v1__generate_request__unpack(NULL, n, p);
    if (!q) return;
    fuzz_model.tool_format = (how >> 2) % 5;
    fuzz_model.tmpl_renders_tools = fuzz_model.tmpl_renders_tool_calls = (how >> 5) & 1;
    rtr_gen_t g;
    if (rtr_grpc_parse(&fuzz_model, q, &g) == BT_OK) {
        if (g.tools) { /* tools were accepted only where they can work, and a forced call has its grammar */
            if (q->prompt_case != BATON__V1__GENERATE_REQUEST__PROMPT_CHAT) abort();
            if (g.tools->choice != RTR_TOOL_CHOICE_NONE && (!fuzz_model.tmpl_renders_tools || !fuzz_model.tool_format))
                abort();
            if ((g.tools->choice == RTR_TOOL_CHOICE_REQUIRED || g.tools->choice == RTR_TOOL_CHOICE_NAMED) && !g.grammar)
                abort();
        }
        if (!g.n_prompt || g.n < 1 || g.n > RTR_MAX_N || (int64_t)g.n_prompt + g.max_tokens > fuzz_model.n_ctx)
            abort();
        for (size_t i = 0; i < g.n_prompt; i++)
            if (g.prompt[i] < 0 || g.prompt[i] >= tok_n_vocab(fuzz_model.tok)) abort();
        for (const char *c = g.request_id; *c; c++)
            if (*c < 0x21 || *c > 0x7e || *c == '"' || *c == '\\') abort(); /* safe to log as it is */
        rtr_gen_free(&g);
    } else if (g.prompt || g.n_stop) {
        abort(); /* on failure g is freed and zeroed */
    }
    baton__v1__generate_request__free_unpacked(q, NULL);
}

static void tokenize(const uint8_t *p, size_t n)
{
    Baton__V1__TokenizeRequest *q = baton__v1__tokenize_request__unpack(NULL, n, p);
    if (!q) return;
    tok_ids ids = {0};
    if (rtr_grpc_tokenize(&fuzz_model, q, &ids) == BT_OK)
        for (size_t i = 0; i < ids.n; i++)
            if (ids.ids[i] < 0 || ids.ids[i] >= tok_n_vocab(fuzz_model.tok)) abort();
    tok_ids_free(&ids);
    baton__v1__tokenize_request__free_unpacked(q, NULL);
}

static void detokenize(const uint8_t *p, size_t n)
{
    Baton__V1__DetokenizeRequest *q = baton__v1__detokenize_request__unpack(NULL, n, p);
    if (!q) return;
    char *text = NULL;
    if (rtr_grpc_detokenize(&fuzz_model, q, &text) == BT_OK) {
        char *again = rtr_utf8_sanitize(text, strlen(text)); /* the answer is already valid UTF-8 */
        if (again && strcmp(again, text)) abort();
        free(again);
        free(text);
    }
    baton__v1__detokenize_request__free_unpacked(q, NULL);
}

static void embed(const uint8_t *p, size_t n)
{
    Baton__V1__EmbedRequest *q = baton__v1__embed_request__unpack(NULL, n, p);
    if (!q) return;
    rtr_embed_req_t e;
    if (rtr_embed_from_grpc(&fuzz_model, q, &e) == BT_OK) {
        fuzz_check_embed(&e);
    }
    rtr_embed_req_free(&e);
    baton__v1__embed_request__free_unpacked(q, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    switch (data[0] % 4) {
    case 0: generate(data[0], data + 1, size - 1); break;
    case 1: tokenize(data + 1, size - 1); break;
    case 2: detokenize(data + 1, size - 1); break;
    default: embed(data + 1, size - 1); break;
    }
    return 0;
}
