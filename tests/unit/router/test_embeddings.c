/* router/embeddings.c: the OpenAI embeddings body (every input form, every error naming its field) and the answer's
 * two encodings (the floats round-trip exactly; base64 is the little-endian float32 bytes). */
#include "router/router.h"
#include "test_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static rtr_model_t model;

static bt_status parse(const char *json, rtr_embed_req_t *e, int *status)
{
    cJSON *body = cJSON_Parse(json);
    if (!body) return BT_ERR_FORMAT;
    bt_status st = rtr_embed_parse(&model, body, e, status);
    cJSON_Delete(body);
    return st;
}

static void expect_error(const char *json, const char *words)
{
    rtr_embed_req_t e;
    int status = 0;
    bt_status st = parse(json, &e, &status);
    CHECK_MSG(st != BT_OK && status == 400 && strstr(bt_last_error(), words), "%.120s -> st %d status %d '%s' (want %s)",
              json, st, status, bt_last_error(), words);
    rtr_embed_req_free(&e);
}

static void test_input_forms(void)
{
    rtr_embed_req_t e;
    int status;
    REQUIRE(parse("{\"input\":\"Hello world\",\"model\":\"smollm2-135m-instruct\",\"user\":\"u\"}", &e, &status) ==
            BT_OK);
    REQUIRE(e.n == 1 && e.inputs[0].n >= 2 && !e.base64);
    tok_ids hello = {0};
    REQUIRE(tok_encode(model.tok, "Hello world", 11, TOK_ADD_SPECIAL, &hello) == BT_OK);
    CHECK(hello.n == e.inputs[0].n && !memcmp(hello.ids, e.inputs[0].ids, hello.n * sizeof *hello.ids));
    CHECK(e.tokens == hello.n);
    rtr_embed_req_free(&e);

    REQUIRE(parse("{\"input\":[\"Hello world\",\"a b c\"],\"encoding_format\":\"base64\"}", &e, &status) == BT_OK);
    CHECK(e.n == 2 && e.base64 && e.inputs[0].n == hello.n && e.tokens == e.inputs[0].n + e.inputs[1].n);
    rtr_embed_req_free(&e);

    /* token ids: one list, or a list of lists; special-token text is not parsed in strings */
    REQUIRE(parse("{\"input\":[19556, 905, 1]}", &e, &status) == BT_OK);
    CHECK(e.n == 1 && e.inputs[0].n == 3 && e.inputs[0].ids[2] == 1);
    rtr_embed_req_free(&e);
    REQUIRE(parse("{\"input\":[[19556],[905, 2, 3]],\"dimensions\":576,\"encoding_format\":\"float\"}", &e, &status) ==
            BT_OK);
    CHECK(e.n == 2 && e.inputs[1].n == 3 && e.tokens == 4);
    rtr_embed_req_free(&e);
    REQUIRE(parse("{\"input\":\"<|im_start|>\"}", &e, &status) == BT_OK);
    CHECK(e.inputs[0].n > 1); /* the marker's text, not the control token */
    rtr_embed_req_free(&e);
    tok_ids_free(&hello);
}

static void test_errors(void)
{
    expect_error("{}", "'input' is required");
    expect_error("{\"input\":null}", "'input' is required");
    expect_error("{\"input\":\"\"}", "'input'[0] is an empty string");
    expect_error("{\"input\":[]}", "'input' is an empty array");
    expect_error("{\"input\":[[]]}", "'input'[0] is an empty list");
    expect_error("{\"input\":[\"a\", 5]}", "'input' must be");
    expect_error("{\"input\":[[1], \"a\"]}", "'input' must be");
    expect_error("{\"input\":{\"a\":1}}", "'input' must be");
    expect_error("{\"input\":[1.5]}", "token ids are integers");
    expect_error("{\"input\":[[3],[-1]]}", "'input'[1]");
    expect_error("{\"input\":[99999999]}", "outside the vocabulary");
    expect_error("{\"input\":[\"a\", \"\"]}", "'input'[1] is an empty string");
    expect_error("{\"input\":\"a\",\"encoding_format\":\"int8\"}", "'encoding_format'");
    expect_error("{\"input\":\"a\",\"dimensions\":64}", "'dimensions' 64 is not supported");
    expect_error("{\"input\":\"a\",\"dimensions\":\"576\"}", "'dimensions' must be an integer");
    expect_error("{\"input\":\"a\",\"user\":7}", "'user' must be a string");
    /* more inputs than a request may hold */
    size_t n = RTR_EMBED_MAX_INPUTS + 1;
    char *big = malloc(n * 4 + 32);
    REQUIRE(big);
    char *p = big + sprintf(big, "{\"input\":[");
    for (size_t i = 0; i < n; i++) p += sprintf(p, "%s\"a\"", i ? "," : "");
    strcpy(p, "]}");
    expect_error(big, "at most 2048");
    free(big);
    /* an input longer than the context */
    size_t len = (size_t)model.n_ctx + 8;
    char *longids = malloc(len * 3 + 32);
    REQUIRE(longids);
    p = longids + sprintf(longids, "{\"input\":[");
    for (size_t i = 0; i < len; i++) p += sprintf(p, "%s7", i ? "," : "");
    strcpy(p, "]}");
    expect_error(longids, "the context is");
    free(longids);
}

/* base64 back to bytes (the test's own decoder). */
static size_t unbase64(const char *s, size_t n, uint8_t *out)
{
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t k = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n && s[i] != '='; i++) {
        const char *c = strchr(A, s[i]);
        if (!c) return 0;
        acc = acc << 6 | (uint32_t)(c - A);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[k++] = (uint8_t)(acc >> bits);
        }
    }
    return k;
}

static void test_answer(void)
{
    float v0[5] = {0.1f, -1e-30f, 3.4028235e38f, 0.0f, -0.33333334f};
    float v1[1] = {1.0f};
    Baton__V1__Embedding e0 = BATON__V1__EMBEDDING__INIT, e1 = BATON__V1__EMBEDDING__INIT;
    e0.n_values = 5, e0.values = v0;
    e1.n_values = 1, e1.values = v1;
    Baton__V1__Embedding *ep[2] = {&e0, &e1};
    Baton__V1__DecodeEmbedResponse r = BATON__V1__DECODE_EMBED_RESPONSE__INIT;
    r.n_data = 2, r.data = ep, r.prompt_tokens = 9;
    for (int b64 = 0; b64 < 2; b64++) {
        size_t len = 0;
        char *s = rtr_embed_answer_json("m\"x", &r, b64, &len);
        REQUIRE(s && len == strlen(s));
        cJSON *j = cJSON_Parse(s);
        CHECK_MSG(j != NULL, "%s", s);
        REQUIRE(j);
        CHECK(!strcmp(cJSON_GetObjectItem(j, "model")->valuestring, "m\"x"));
        CHECK(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens")->valueint == 9);
        cJSON *data = cJSON_GetObjectItem(j, "data");
        REQUIRE(cJSON_GetArraySize(data) == 2);
        for (int i = 0; i < 2; i++) {
            cJSON *d = cJSON_GetArrayItem(data, i);
            CHECK(cJSON_GetObjectItem(d, "index")->valueint == i);
            CHECK(!strcmp(cJSON_GetObjectItem(d, "object")->valuestring, "embedding"));
            cJSON *emb = cJSON_GetObjectItem(d, "embedding");
            const Baton__V1__Embedding *want = ep[i];
            if (b64) {
                REQUIRE(cJSON_IsString(emb));
                uint8_t bytes[64];
                size_t nb = unbase64(emb->valuestring, strlen(emb->valuestring), bytes);
                CHECK(nb == want->n_values * 4 && !memcmp(bytes, want->values, nb));
            } else {
                REQUIRE(cJSON_GetArraySize(emb) == (int)want->n_values);
                for (size_t k = 0; k < want->n_values; k++) /* %.9g round-trips a float exactly */
                    CHECK_MSG((float)cJSON_GetArrayItem(emb, (int)k)->valuedouble == want->values[k], "%d %zu", i, k);
            }
        }
        cJSON_Delete(j);
        free(s);
    }
}

int main(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("embeddings parse tests: default model not cached (run deploy/fetch-model.sh)");
        return test_summary();
    }
    if (rtr_model_load(path, 0, &model) != BT_OK) {
        fprintf(stderr, "cannot load %s: %s\n", path, bt_last_error());
        return 1;
    }
    CHECK(model.n_embd == 576);
    RUN(test_input_forms);
    RUN(test_errors);
    RUN(test_answer);
    rtr_model_free(&model);
    return test_summary();
}
