/* POST /v1/embeddings (issue 23.5): the router tokenizes the inputs and one decode node computes them together
 * (Decode/Embed: each input is a sequence of the node's continuous batch), answering the mean of each input's final
 * hidden states, L2-normalized. The HTTP thread only parses and defers; the call to the node runs on a thread of
 * its own, so a long request never holds an HTTP thread. */
#include "router/router.h"

#include "common/log.h"
#include "common/strbuf.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "base64 embeddings are written as the host's float32 bytes: little-endian hosts only"
#endif

#define bad(http_status, ...) (*(http_status) = 400, bt_fail(BT_ERR_INVALID, __VA_ARGS__))

void rtr_embed_req_free(rtr_embed_req_t *e)
{
    for (size_t i = 0; e->inputs && i < e->n; i++) tok_ids_free(&e->inputs[i]);
    free(e->inputs);
    memset(e, 0, sizeof *e);
}

/* A JSON field that is absent or null counts as not given. */
static const cJSON *field(const cJSON *body, const char *name)
{
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(body, name);
    return f && !cJSON_IsNull(f) ? f : NULL;
}

/* Checks one input's token ids (already in out) against the vocabulary and the context. */
static bt_status check_ids(const rtr_model_t *m, const tok_ids *t, size_t idx, int *http_status)
{
    if (t->n == 0) return bad(http_status, "'input'[%zu] has no tokens", idx);
    if (t->n > (size_t)m->n_ctx)
        return bad(http_status, "'input'[%zu] has %zu tokens; the context is %d", idx, t->n, m->n_ctx);
    int32_t nv = tok_n_vocab(m->tok);
    for (size_t k = 0; k < t->n; k++)
        if (t->ids[k] < 0 || t->ids[k] >= nv)
            return bad(http_status, "'input'[%zu] holds %d, outside the vocabulary [0, %d)", idx, t->ids[k], nv);
    return BT_OK;
}

/* One input's token ids from a JSON array of integers. */
static bt_status ids_input(const rtr_model_t *m, const cJSON *a, size_t idx, tok_ids *out, int *http_status)
{
    size_t n = (size_t)cJSON_GetArraySize(a);
    if (n == 0) return bad(http_status, "'input'[%zu] is an empty list of token ids", idx);
    if (n > (size_t)m->n_ctx)
        return bad(http_status, "'input'[%zu] has %zu tokens; the context is %d", idx, n, m->n_ctx);
    out->ids = malloc(n * sizeof *out->ids);
    if (!out->ids) return bt_fail(BT_ERR_NOMEM, "out of memory");
    const cJSON *e;
    cJSON_ArrayForEach(e, a) {
        /* the range check keeps the conversion defined; check_ids names a value outside the vocabulary */
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || fabs(e->valuedouble) > 2e9)
            return bad(http_status, "'input'[%zu] holds %s; token ids are integers", idx,
                       cJSON_IsNumber(e) ? "a number that is not a token id" : "a non-number");
        out->ids[out->n++] = (int32_t)e->valuedouble;
    }
    return check_ids(m, out, idx, http_status);
}

/* One input's token ids from text. */
static bt_status text_input(const rtr_model_t *m, const char *text, size_t idx, tok_ids *out, int *http_status)
{
    size_t len = strlen(text);
    if (len == 0) return bad(http_status, "'input'[%zu] is an empty string", idx);
    if (len > (size_t)m->n_ctx * RTR_PROMPT_BYTES_PER_TOKEN && len > RTR_PROMPT_MIN_BYTES)
        return bad(http_status, "'input'[%zu] is %zu bytes: too long for a context of %d tokens", idx, len, m->n_ctx);
    bt_status st = tok_encode(m->tok, text, len, TOK_ADD_SPECIAL, out);
    if (st == BT_ERR_NOMEM) return st;
    if (st) return bad(http_status, "'input'[%zu]: %s", idx, bt_last_error());
    return check_ids(m, out, idx, http_status);
}

/* The request's token total, bounded. */
static bt_status sum_tokens(rtr_embed_req_t *e, int *http_status)
{
    uint64_t total = 0;
    for (size_t i = 0; i < e->n; i++) total += e->inputs[i].n;
    if (total > (1u << 20))
        return bad(http_status, "'input' holds %llu tokens; at most %u per request", (unsigned long long)total, 1u << 20);
    e->tokens = (uint32_t)total;
    return BT_OK;
}

/* Room for n inputs. */
static bt_status alloc_inputs(rtr_embed_req_t *e, size_t n, int *http_status)
{
    if (n > RTR_EMBED_MAX_INPUTS)
        return bad(http_status, "'input' holds %zu inputs; at most %d per request", n, RTR_EMBED_MAX_INPUTS);
    e->inputs = calloc(n, sizeof *e->inputs);
    if (!e->inputs) return bt_fail(BT_ERR_NOMEM, "out of memory");
    e->n = n;
    return BT_OK;
}

/* The kind of every element of "input" as an array: 's' strings, 'i' numbers, 'a' arrays; 0 for a mix or anything
 * else. */
static char array_kind(const cJSON *in)
{
    char kind = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, in) {
        char k = cJSON_IsString(e) ? 's' : cJSON_IsNumber(e) ? 'i' : cJSON_IsArray(e) ? 'a' : 'x';
        if (k == 'x' || (kind && k != kind)) return 0;
        kind = k;
    }
    return kind;
}

static bt_status parse_inputs(const rtr_model_t *m, const cJSON *in, rtr_embed_req_t *out, int *http_status)
{
    if (!in) return bad(http_status, "'%s' is required", "input");
    if (cJSON_IsArray(in) && cJSON_GetArraySize(in) == 0) return bad(http_status, "'input' is an empty array");
    char kind = cJSON_IsString(in) ? 'S' : cJSON_IsArray(in) ? array_kind(in) : 'x';
    if (kind == 'x' || kind == 0)
        return bad(http_status, "'input' must be a string, an array of strings, an array of token ids or an array of "
                                "arrays of token ids");
    size_t n = kind == 'S' || kind == 'i' ? 1 : (size_t)cJSON_GetArraySize(in);
    bt_status st = alloc_inputs(out, n, http_status);
    if (st) return st;
    if (kind == 'S') st = text_input(m, in->valuestring, 0, &out->inputs[0], http_status);
    else if (kind == 'i') st = ids_input(m, in, 0, &out->inputs[0], http_status);
    else {
        size_t i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, in) {
            st = kind == 's' ? text_input(m, e->valuestring, i, &out->inputs[i], http_status)
                             : ids_input(m, e, i, &out->inputs[i], http_status);
            if (st) break;
            i++;
        }
    }
    return st ? st : sum_tokens(out, http_status);
}

bt_status rtr_embed_from_grpc(const rtr_model_t *m, const Baton__V1__EmbedRequest *q, rtr_embed_req_t *out)
{
    memset(out, 0, sizeof *out);
    int http_status = 400;
    if ((q->n_texts > 0) == (q->n_token_ids > 0))
        return bt_fail(BT_ERR_INVALID, "exactly one of 'texts' and 'token_ids' must hold the inputs");
    bt_status st = alloc_inputs(out, q->n_texts + q->n_token_ids, &http_status);
    for (size_t i = 0; !st && i < q->n_texts; i++) st = text_input(m, q->texts[i], i, &out->inputs[i], &http_status);
    for (size_t i = 0; !st && i < q->n_token_ids; i++) {
        const Baton__V1__TokenIds *t = q->token_ids[i];
        size_t n = t ? t->n_ids : 0;
        if (n > (size_t)m->n_ctx) {
            st = bad(&http_status, "'input'[%zu] has %zu tokens; the context is %d", i, n, m->n_ctx);
            break;
        }
        if (n && !(out->inputs[i].ids = malloc(n * sizeof(int32_t)))) {
            st = bt_fail(BT_ERR_NOMEM, "out of memory");
            break;
        }
        if (n) memcpy(out->inputs[i].ids, t->ids, n * sizeof(int32_t));
        out->inputs[i].n = n;
        st = check_ids(m, &out->inputs[i], i, &http_status);
    }
    return st ? st : sum_tokens(out, &http_status);
}

bt_status rtr_embed_parse(const rtr_model_t *m, const cJSON *body, rtr_embed_req_t *out, int *http_status)
{
    memset(out, 0, sizeof *out);
    *http_status = 400;
    if (!cJSON_IsObject(body)) return bad(http_status, "the body must be a JSON object");
    const cJSON *f = field(body, "encoding_format");
    if (f && !(cJSON_IsString(f) && (!strcmp(f->valuestring, "float") || !strcmp(f->valuestring, "base64"))))
        return bad(http_status, "'%s' must be \"float\" or \"base64\"", "encoding_format");
    out->base64 = f && !strcmp(f->valuestring, "base64");
    if ((f = field(body, "dimensions"))) {
        if (!cJSON_IsNumber(f) || f->valuedouble != floor(f->valuedouble))
            return bad(http_status, "'%s' must be an integer", "dimensions");
        if (m->n_embd <= 0 || f->valuedouble != m->n_embd)
            return bad(http_status, "'dimensions' %.0f is not supported: this model's embeddings have %d dimensions "
                                    "and cannot be shortened", f->valuedouble, m->n_embd);
    }
    if ((f = field(body, "user")) && !cJSON_IsString(f)) return bad(http_status, "'%s' must be a string", "user");
    return parse_inputs(m, field(body, "input"), out, http_status);
}

/* ---- the answer ---- */

static void put_base64(bt_strbuf *b, const uint8_t *p, size_t n)
{
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char q[4];
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16;
        if (i + 1 < n) v |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n) v |= p[i + 2];
        q[0] = A[v >> 18 & 63];
        q[1] = A[v >> 12 & 63];
        q[2] = i + 1 < n ? A[v >> 6 & 63] : '=';
        q[3] = i + 2 < n ? A[v & 63] : '=';
        bt_strbuf_put(b, q, 4);
    }
}

static void put_json_string(bt_strbuf *b, const char *s)
{
    bt_strbuf_puts(b, "\"");
    for (; *s; s++) {
        char e[8];
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            e[0] = '\\', e[1] = (char)c;
            bt_strbuf_put(b, e, 2);
        } else if (c < 0x20) {
            snprintf(e, sizeof e, "\\u%04x", c);
            bt_strbuf_puts(b, e);
        } else {
            bt_strbuf_put(b, (const char *)&c, 1);
        }
    }
    bt_strbuf_puts(b, "\"");
}

char *rtr_embed_answer_json(const char *model, const Baton__V1__DecodeEmbedResponse *resp, int base64, size_t *len)
{
    bt_strbuf b = {0};
    char num[96];
    bt_strbuf_puts(&b, "{\"object\":\"list\",\"data\":[");
    for (size_t i = 0; i < resp->n_data; i++) {
        const Baton__V1__Embedding *e = resp->data[i];
        snprintf(num, sizeof num, "%s{\"object\":\"embedding\",\"index\":%zu,\"embedding\":", i ? "," : "", i);
        bt_strbuf_puts(&b, num);
        if (base64) {
            bt_strbuf_puts(&b, "\"");
            put_base64(&b, (const uint8_t *)e->values, e->n_values * sizeof(float));
            bt_strbuf_puts(&b, "\"}");
            continue;
        }
        bt_strbuf_puts(&b, "[");
        for (size_t k = 0; k < e->n_values; k++) {
            float v = e->values[k];
            int w = isfinite(v) ? snprintf(num, sizeof num, "%s%.9g", k ? "," : "", (double)v)
                                : snprintf(num, sizeof num, "%snull", k ? "," : ""); /* never: JSON has no NaN */
            bt_strbuf_put(&b, num, (size_t)w);
        }
        bt_strbuf_puts(&b, "]}");
    }
    bt_strbuf_puts(&b, "],\"model\":");
    put_json_string(&b, model);
    snprintf(num, sizeof num, ",\"usage\":{\"prompt_tokens\":%u,\"total_tokens\":%u}}", resp->prompt_tokens,
             resp->prompt_tokens);
    bt_strbuf_puts(&b, num);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.n;
    return b.p;
}

/* ---- the request's life ---- */

typedef struct embed_job {
    rtr_t *r;
    http_request_t *req;  /* the HTTP request, or NULL */
    bt_rpc_call_t *call;  /* else the gRPC call */
    rtr_embed_req_t e;
    rtr_adm_t *adm;
    char request_id[64];
} embed_job;

/* The HTTP status for what the node (or the router's dispatch) answered. */
static int http_status_of(bt_rpc_code c)
{
    switch (c) {
    case BT_RPC_INVALID_ARGUMENT: return 400;
    case BT_RPC_RESOURCE_EXHAUSTED: return 429;
    case BT_RPC_UNAVAILABLE: return 503;
    case BT_RPC_DEADLINE_EXCEEDED: return 504;
    default: return 502;
    }
}

static const char *status_label(bt_rpc_code c)
{
    switch (c) {
    case BT_RPC_INVALID_ARGUMENT: return "client_error";
    case BT_RPC_RESOURCE_EXHAUSTED: return "overloaded";
    case BT_RPC_UNAVAILABLE: return "unavailable";
    case BT_RPC_CANCELLED: return "cancelled";
    default: return "server_error";
    }
}

/* Answers the client: resp on success, else code and msg. */
static void answer(embed_job *j, const Baton__V1__DecodeEmbedResponse *resp, bt_rpc_code code, const char *msg)
{
    rtr_t *r = j->r;
    if (code == BT_RPC_OK && j->req) {
        size_t len = 0;
        char *body = rtr_embed_answer_json(r->model.name, resp, j->e.base64, &len);
        if (!body) {
            answer(j, NULL, BT_RPC_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        http_respond(j->req, 200, "application/json", body, len);
        free(body);
    } else if (code == BT_RPC_OK) {
        Baton__V1__EmbedResponse out = BATON__V1__EMBED_RESPONSE__INIT;
        out.n_data = resp->n_data;
        out.data = resp->data;
        out.prompt_tokens = resp->prompt_tokens;
        bt_status st = bt_rpc_call_send(j->call, &out.base);
        bt_rpc_call_finish_status(j->call, st);
    } else if (j->req) {
        int status = msg && !strcmp(msg, "out of memory") ? 500 : http_status_of(code);
        if (status == 429 || status == 503) http_response_header(j->req, "Retry-After", "1");
        http_respond_error(j->req, status, msg, NULL, NULL);
    } else {
        bt_rpc_call_finish(j->call, code, msg);
    }
    if (code == BT_RPC_OK) metrics_counter_add(r->prompt_tokens, j->e.tokens);
    rtr_count_request(r, code == BT_RPC_OK ? "ok" : status_label(code));
}

static void job_free(embed_job *j)
{
    rtr_t *r = j->r;
    rtr_admit_release(r, j->adm);
    rtr_embed_req_free(&j->e);
    free(j);
    atomic_fetch_sub(&r->active_jobs, 1);
}

/* The client of a job in flight left (HTTP: its socket closed; gRPC: cancelled or past its deadline), or the router
 * is stopping. */
static int client_left(void *ud)
{
    embed_job *j = ud;
    if (atomic_load(&j->r->stopping)) return 1;
    return j->req ? http_request_client_gone(j->req) : bt_rpc_call_cancelled(j->call);
}

static void *embed_main(void *arg)
{
    embed_job *j = arg;
    Baton__V1__TokenIds *ti = calloc(j->e.n, sizeof *ti);
    Baton__V1__TokenIds **tp = calloc(j->e.n, sizeof *tp);
    Baton__V1__DecodeEmbedResponse *resp = NULL;
    bt_rpc_result_t res = {0};
    bt_status st = BT_ERR_NOMEM;
    if (ti && tp) {
        for (size_t i = 0; i < j->e.n; i++) {
            baton__v1__token_ids__init(&ti[i]);
            ti[i].n_ids = j->e.inputs[i].n;
            ti[i].ids = j->e.inputs[i].ids;
            tp[i] = &ti[i];
        }
        Baton__V1__DecodeEmbedRequest q = BATON__V1__DECODE_EMBED_REQUEST__INIT;
        q.request_id = j->request_id;
        q.n_inputs = j->e.n;
        q.inputs = tp;
        int64_t dl = j->call ? bt_rpc_call_deadline_ms(j->call) : INT64_MAX;
        int timeout_ms = 0;
        if (dl != INT64_MAX) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            int64_t left = dl - ((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
            timeout_ms = left < 1 ? 1 : left > INT32_MAX ? INT32_MAX : (int)left;
        }
        st = rtr_dispatch_embed(j->r->dispatch, &q, timeout_ms, client_left, j, &resp, &res);
    }
    char msg[400];
    if (st == BT_OK && resp->n_data != j->e.n) {
        snprintf(msg, sizeof msg, "embeddings failed: the decode node answered %zu embeddings for %zu inputs",
                 resp->n_data, j->e.n);
        answer(j, NULL, BT_RPC_INTERNAL, msg);
    } else if (st == BT_OK) {
        answer(j, resp, BT_RPC_OK, NULL);
    } else if (st == BT_ERR_NOMEM && res.code == BT_RPC_OK) {
        answer(j, NULL, BT_RPC_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        snprintf(msg, sizeof msg, "embeddings failed: %s", res.message[0] ? res.message : bt_status_str(st));
        answer(j, NULL, res.code == BT_RPC_OK ? BT_RPC_INTERNAL : res.code, msg);
    }
    if (resp) protobuf_c_message_free_unpacked(&resp->base, NULL);
    free(ti);
    free(tp);
    job_free(j);
    return NULL;
}

/* Admits e (moved into a job), then runs the job on a thread of its own. The client is answered here when that
 * fails. */
static void start(rtr_t *r, rtr_embed_req_t *e, http_request_t *req, bt_rpc_call_t *call)
{
    /* admitted as one choice of one token after a prompt of every input's tokens: prefill work, no decoding */
    rtr_gen_t g = {.n = 1, .n_prompt = e->tokens, .max_tokens = 1, .ignore_eos = 1};
    char msg[200];
    int retry = 1;
    embed_job *j = calloc(1, sizeof *j);
    if (!j) {
        rtr_embed_req_free(e);
        embed_job tmp = {.r = r, .req = req, .call = call};
        answer(&tmp, NULL, BT_RPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    *j = (embed_job){.r = r, .req = req, .call = call, .e = *e};
    memset(e, 0, sizeof *e);
    snprintf(j->request_id, sizeof j->request_id, "emb-%llu", (unsigned long long)atomic_fetch_add(&r->next_id, 1));
    atomic_fetch_add(&r->active_jobs, 1);
    if (!rtr_admit_gen(r, &g, &j->adm, msg, sizeof msg, &retry)) {
        if (req) {
            char ra[16];
            snprintf(ra, sizeof ra, "%d", retry);
            http_response_header(req, "Retry-After", ra);
        }
        answer(j, NULL, BT_RPC_RESOURCE_EXHAUSTED, msg);
        job_free(j);
        return;
    }
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = !req || http_request_defer(req) == BT_OK ? pthread_create(&th, &at, embed_main, j) : -1;
    pthread_attr_destroy(&at);
    if (rc != 0) {
        BT_WARN("router", "embeddings: cannot start the request's thread");
        answer(j, NULL, BT_RPC_INTERNAL, "cannot start the request");
        job_free(j);
    }
}

void rtr_embed_start_http(rtr_t *r, rtr_embed_req_t *e, http_request_t *req)
{
    start(r, e, req, NULL);
}

void rtr_embed_start_grpc(rtr_t *r, rtr_embed_req_t *e, bt_rpc_call_t *call)
{
    start(r, e, NULL, call);
}
