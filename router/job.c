/* One client request from validation to its last byte: n choices, each on its own thread running
 * rtr_dispatch_run, whose tokens pass through a textgen and go to the client as SSE chunks, gRPC messages or
 * one JSON answer at the end. The job's lock orders what the choices write; the last choice to end answers or
 * closes the stream, records the metrics and frees the job. */
#include "router/router.h"

#include "common/log.h"
#include "router/tool_calls.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

typedef struct choice {
    rtr_job_t *job;
    int index;
    rtr_textgen_t tg;
    char *text;          /* whole text, for a non-streaming answer */
    size_t n_text, cap_text;
    cJSON *lp;           /* non-streaming logprobs: chat "content" array, or completions' object */
    uint32_t n_tokens;
    size_t text_offset;  /* completions text_offset */
    double t_first, t_last;
    const char *finish;
    int stop_index;      /* -1: none */
    int overrun;         /* the node sent more than max_tokens: cut there, finish "length" */
    int sent_role;
    int tools_on;        /* chat with tools and tool_choice other than none: the output is parsed for calls */
    rtr_tool_stream_t ts; /* streaming with tools_on: content held from where a call may start */
} choice_t;

struct rtr_job {
    rtr_t *r;
    rtr_gen_t g;
    pthread_mutex_t mu;
    int remaining;
    atomic_int gone;
    atomic_llong next_probe_ms; /* non-streaming HTTP: when to look at the client's socket next */
    http_request_t *hreq;
    http_stream_t *hst;
    bt_rpc_call_t *call;
    char id[80];
    int64_t created;
    double t0, t_first;
    uint32_t completion_tokens, cached;
    int failed;          /* some choice failed */
    bt_status fail_st;
    bt_rpc_code fail_code;
    char fail_msg[256];
    choice_t *ch;
    char **seq_ids;      /* per choice request id */
    Baton__V1__SamplingParams *sp;  /* per choice (seed differs for n > 1) */
    Baton__V1__LogitBias *lb;       /* [g.n_logit_bias], shared by every choice's sp */
    Baton__V1__LogitBias **lb_ptrs; /* [g.n_logit_bias] -> lb */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void rtr_gen_free(rtr_gen_t *g)
{
    free(g->prompt);
    free(g->grammar);
    g->grammar = NULL;
    rtr_tools_free(g->tools);
    g->tools = NULL;
    for (int i = 0; i < g->n_stop; i++) free(g->stops[i]);
    free(g->stop_ids);
    memset(g, 0, sizeof *g);
}

static void job_free(rtr_job_t *j)
{
    rtr_admit_release(j->r, j->g.adm);
    j->g.adm = NULL;
    for (int i = 0; i < j->g.n; i++) {
        rtr_textgen_free(&j->ch[i].tg);
        rtr_tool_stream_free(&j->ch[i].ts);
        free(j->ch[i].text);
        cJSON_Delete(j->ch[i].lp);
        if (j->seq_ids) free(j->seq_ids[i]);
    }
    free(j->ch);
    free(j->seq_ids);
    free(j->sp);
    free(j->lb);
    free(j->lb_ptrs);
    rtr_gen_free(&j->g);
    pthread_mutex_destroy(&j->mu);
    atomic_fetch_sub(&j->r->active_jobs, 1);
    free(j);
}

static int append(char **buf, size_t *n, size_t *cap, const char *s, size_t len)
{
    if (*n + len + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *n + len + 1) c *= 2;
        char *p = realloc(*buf, c);
        if (!p) return -1;
        *buf = p;
        *cap = c;
    }
    memcpy(*buf + *n, s, len);
    *n += len;
    (*buf)[*n] = '\0';
    return 0;
}

/* The decoded text of one token by itself, valid UTF-8 (for logprob entries). */
static char *token_text(const tok_tokenizer *tok, int32_t id)
{
    size_t len = 0;
    const char *p = tok_token_piece(tok, id, &len);
    return rtr_utf8_sanitize(p ? p : "", p ? len : 0);
}

static cJSON *bytes_array(const char *s)
{
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *u = (const unsigned char *)s; *u; u++) cJSON_AddItemToArray(a, cJSON_CreateNumber(*u));
    return a;
}

/* Chat logprob entry {token, logprob, bytes, top_logprobs}. */
static cJSON *chat_lp_entry(const tok_tokenizer *tok, const Baton__V1__TokenLogprob *lp, int32_t id, int n_top)
{
    cJSON *e = cJSON_CreateObject();
    char *t = token_text(tok, id);
    cJSON_AddStringToObject(e, "token", t ? t : "");
    cJSON_AddNumberToObject(e, "logprob", lp ? lp->logprob : 0.0);
    cJSON_AddItemToObject(e, "bytes", bytes_array(t ? t : ""));
    free(t);
    cJSON *tops = cJSON_AddArrayToObject(e, "top_logprobs");
    for (size_t k = 0; lp && k < lp->n_top && (int)k < n_top; k++) {
        cJSON *o = cJSON_CreateObject();
        char *tt = token_text(tok, lp->top[k]->token_id);
        cJSON_AddStringToObject(o, "token", tt ? tt : "");
        cJSON_AddNumberToObject(o, "logprob", lp->top[k]->logprob);
        cJSON_AddItemToObject(o, "bytes", bytes_array(tt ? tt : ""));
        free(tt);
        cJSON_AddItemToArray(tops, o);
    }
    return e;
}

/* Completions logprobs object {tokens, token_logprobs, top_logprobs, text_offset}, or adds to it. */
static void cmpl_lp_add(cJSON *obj, const tok_tokenizer *tok, const Baton__V1__TokenLogprob *lp, int32_t id,
                        int n_top, size_t offset)
{
    char *t = token_text(tok, id);
    cJSON_AddItemToArray(cJSON_GetObjectItem(obj, "tokens"), cJSON_CreateString(t ? t : ""));
    free(t);
    cJSON_AddItemToArray(cJSON_GetObjectItem(obj, "token_logprobs"), cJSON_CreateNumber(lp ? lp->logprob : 0.0));
    cJSON *tops = cJSON_CreateObject();
    for (size_t k = 0; lp && k < lp->n_top && (int)k < n_top; k++) {
        char *tt = token_text(tok, lp->top[k]->token_id);
        if (!cJSON_GetObjectItem(tops, tt ? tt : "")) cJSON_AddNumberToObject(tops, tt ? tt : "", lp->top[k]->logprob);
        free(tt);
    }
    cJSON_AddItemToArray(cJSON_GetObjectItem(obj, "top_logprobs"), tops);
    cJSON_AddItemToArray(cJSON_GetObjectItem(obj, "text_offset"), cJSON_CreateNumber((double)offset));
}

static cJSON *cmpl_lp_new(void)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddArrayToObject(o, "tokens");
    cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON_AddArrayToObject(o, "top_logprobs");
    cJSON_AddArrayToObject(o, "text_offset");
    return o;
}

static cJSON *usage_json(const rtr_job_t *j)
{
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", (double)j->g.n_prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", j->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)j->g.n_prompt + j->completion_tokens);
    if (j->cached) {
        cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
        cJSON_AddNumberToObject(d, "cached_tokens", j->cached);
    }
    return u;
}

static cJSON *chunk_base(const rtr_job_t *j)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", j->id);
    cJSON_AddStringToObject(o, "object", j->g.api == RTR_API_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)j->created);
    cJSON_AddStringToObject(o, "model", j->r->model.name);
    cJSON_AddStringToObject(o, "system_fingerprint", "baton");
    return o;
}

static void sse_send_json(rtr_job_t *j, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    if (s) {
        if (http_stream_send(j->hst, s, strlen(s)) != BT_OK) atomic_store(&j->gone, 1);
        free(s);
    }
}

/* Sends one SSE chunk for choice c (under j->mu): text, logprobs (a chat array or completions object, taken),
 * finish reason (NULL: still going). */
static void sse_chunk(rtr_job_t *j, choice_t *c, const char *text, size_t len, cJSON *lp, const char *finish)
{
    cJSON *o = chunk_base(j);
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    cJSON *ch = cJSON_CreateObject();
    cJSON_AddNumberToObject(ch, "index", c->index);
    char *t = rtr_utf8_sanitize(text, len);
    if (j->g.api == RTR_API_CHAT) {
        cJSON *delta = cJSON_AddObjectToObject(ch, "delta");
        if (!c->sent_role) {
            cJSON_AddStringToObject(delta, "role", "assistant");
            c->sent_role = 1;
        }
        if (len || !finish) cJSON_AddStringToObject(delta, "content", t ? t : "");
        if (lp) {
            cJSON *l = cJSON_AddObjectToObject(ch, "logprobs");
            cJSON_AddItemToObject(l, "content", lp);
        } else {
            cJSON_AddNullToObject(ch, "logprobs");
        }
    } else {
        cJSON_AddStringToObject(ch, "text", t ? t : "");
        if (lp) cJSON_AddItemToObject(ch, "logprobs", lp);
        else cJSON_AddNullToObject(ch, "logprobs");
    }
    free(t);
    if (finish) cJSON_AddStringToObject(ch, "finish_reason", finish);
    else cJSON_AddNullToObject(ch, "finish_reason");
    cJSON_AddItemToArray(choices, ch);
    if (j->g.include_usage) cJSON_AddNullToObject(o, "usage");
    sse_send_json(j, o);
    cJSON_Delete(o);
}

/* message.tool_calls / the calls of a parsed output, each with a fresh id. */
static cJSON *tool_calls_json(const rtr_job_t *j, const rtr_tool_result_t *r)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < r->n_calls; i++) {
        char id[40];
        rtr_tool_call_id(j->g.tools->format, id, sizeof id);
        cJSON *o = cJSON_CreateObject(), *fn = cJSON_AddObjectToObject(o, "function");
        char *args = rtr_utf8_sanitize(r->calls[i].arguments, strlen(r->calls[i].arguments));
        cJSON_AddStringToObject(o, "id", id);
        cJSON_AddStringToObject(o, "type", "function");
        cJSON_AddStringToObject(fn, "name", r->calls[i].name);
        cJSON_AddStringToObject(fn, "arguments", args ? args : "{}");
        free(args);
        cJSON_AddItemToArray(a, o);
    }
    return a;
}

/* Streams the calls as OpenAI does: per call, a chunk with index, id, type, name and empty arguments, then one
 * with the arguments (under j->mu). */
static void sse_tool_calls(rtr_job_t *j, choice_t *c, const rtr_tool_result_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++) {
        char id[40];
        rtr_tool_call_id(j->g.tools->format, id, sizeof id);
        char *args = rtr_utf8_sanitize(r->calls[i].arguments, strlen(r->calls[i].arguments));
        for (int part = 0; part < 2; part++) {
            cJSON *o = chunk_base(j);
            cJSON *ch = cJSON_CreateObject();
            if (!cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "choices"), ch)) {
                cJSON_Delete(ch); /* out of memory: the cJSON_Add* below then do nothing */
                ch = NULL;
            }
            cJSON_AddNumberToObject(ch, "index", c->index);
            cJSON *delta = cJSON_AddObjectToObject(ch, "delta");
            if (!c->sent_role) {
                cJSON_AddStringToObject(delta, "role", "assistant");
                cJSON_AddNullToObject(delta, "content");
                c->sent_role = 1;
            }
            cJSON *tc = cJSON_CreateObject();
            if (!cJSON_AddItemToArray(cJSON_AddArrayToObject(delta, "tool_calls"), tc)) {
                cJSON_Delete(tc);
                tc = NULL;
            }
            cJSON_AddNumberToObject(tc, "index", (double)i);
            if (part == 0) {
                cJSON_AddStringToObject(tc, "id", id);
                cJSON_AddStringToObject(tc, "type", "function");
            }
            cJSON *f = cJSON_AddObjectToObject(tc, "function");
            if (part == 0) cJSON_AddStringToObject(f, "name", r->calls[i].name);
            cJSON_AddStringToObject(f, "arguments", part == 0 ? "" : args ? args : "{}");
            cJSON_AddNullToObject(ch, "logprobs");
            cJSON_AddNullToObject(ch, "finish_reason");
            if (j->g.include_usage) cJSON_AddNullToObject(o, "usage");
            sse_send_json(j, o);
            cJSON_Delete(o);
        }
        free(args);
    }
}

/* The end of a streamed choice with tools: the held text becomes calls or content, then the finish chunk. */
static void sse_finish_tools(rtr_job_t *j, choice_t *c, const char *tail, size_t n_tail)
{
    const char *out;
    size_t n_out;
    rtr_tool_stream_push(&c->ts, tail, n_tail, &out, &n_out);
    if (n_out) sse_chunk(j, c, out, n_out, NULL, NULL);
    rtr_tool_result_t r;
    int rc = rtr_tool_stream_finish(&c->ts, &r, &out, &n_out);
    if (rc == 1) {
        if (r.content) sse_chunk(j, c, r.content, r.content_len, NULL, NULL);
        sse_tool_calls(j, c, &r);
        rtr_tool_result_free(&r);
        sse_chunk(j, c, "", 0, NULL, !strcmp(c->finish, "length") ? "length" : "tool_calls");
        return;
    }
    sse_chunk(j, c, out, n_out, NULL, c->finish);
}

/* One GenerateResponse of choice c (under j->mu); calls (may be NULL) are the parsed tool calls of its end. */
static void grpc_send(rtr_job_t *j, choice_t *c, const int32_t *ids, size_t n, Baton__V1__TokenLogprob *const *lps,
                      size_t n_lps, const char *text, size_t len, Baton__V1__FinishReason finish, int with_usage,
                      const rtr_tool_result_t *calls)
{
    Baton__V1__GenerateResponse m = BATON__V1__GENERATE_RESPONSE__INIT;
    m.request_id = j->id;
    m.model = j->r->model.name;
    m.index = (uint32_t)c->index;
    m.token_ids = (int32_t *)ids;
    m.n_token_ids = n;
    char *t = rtr_utf8_sanitize(text, len);
    m.text = t ? t : "";
    Baton__V1__TokenLogprob **out = NULL;
    Baton__V1__TokenLogprob *items = NULL;
    char **names = NULL;
    size_t n_out = j->g.logprobs ? (n_lps < n ? n_lps : n) : 0;
    if (n_out) {
        out = calloc(n_out, sizeof *out);
        items = calloc(n_out, sizeof *items);
        names = calloc(n_out, sizeof *names);
        if (!out || !items || !names) n_out = 0;
        for (size_t i = 0; i < n_out; i++) {
            items[i] = *lps[i];
            names[i] = token_text(j->r->model.tok, ids[i]);
            items[i].token = names[i] ? names[i] : "";
            items[i].token_id = ids[i];
            out[i] = &items[i];
        }
        m.logprobs = out;
        m.n_logprobs = n_out;
    }
    m.finish_reason = finish;
    if (finish != BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED && c->stop_index >= 0)
        m.stop = j->g.stops[c->stop_index];
    size_t n_calls = calls ? calls->n_calls : 0;
    Baton__V1__ToolCall *tc = n_calls ? calloc(n_calls, sizeof *tc) : NULL;
    Baton__V1__ToolCall **tcp = n_calls ? calloc(n_calls, sizeof *tcp) : NULL;
    char (*ids_tc)[40] = n_calls ? calloc(n_calls, sizeof *ids_tc) : NULL;
    char **args = n_calls ? calloc(n_calls, sizeof *args) : NULL;
    if (!tc || !tcp || !ids_tc || !args) n_calls = 0;
    for (size_t i = 0; i < n_calls; i++) {
        baton__v1__tool_call__init(&tc[i]);
        rtr_tool_call_id(j->g.tools->format, ids_tc[i], sizeof ids_tc[i]);
        args[i] = rtr_utf8_sanitize(calls->calls[i].arguments, strlen(calls->calls[i].arguments));
        tc[i].id = ids_tc[i];
        tc[i].name = calls->calls[i].name;
        tc[i].arguments = args[i] ? args[i] : "{}";
        tcp[i] = &tc[i];
    }
    m.tool_calls = tcp;
    m.n_tool_calls = n_calls;
    Baton__V1__Usage u = BATON__V1__USAGE__INIT;
    if (with_usage) {
        u.prompt_tokens = (uint32_t)j->g.n_prompt;
        u.completion_tokens = j->completion_tokens;
        u.total_tokens = u.prompt_tokens + u.completion_tokens;
        u.cached_prompt_tokens = j->cached;
        m.usage = &u;
    }
    if (bt_rpc_call_send(j->call, &m.base) != BT_OK) atomic_store(&j->gone, 1);
    for (size_t i = 0; i < n_calls; i++) free(args[i]);
    free(args);
    free(ids_tc);
    free(tcp);
    free(tc);
    for (size_t i = 0; i < n_out; i++) free(names[i]);
    free(names);
    free(items);
    free(out);
    free(t);
}

/* The end of a gRPC choice with tools (as sse_finish_tools): the held text becomes calls, sent in the last message
 * with finish_reason TOOL_CALLS (LENGTH stays), or is released as its text. */
static void grpc_finish_tools(rtr_job_t *j, choice_t *c, const char *tail, size_t n_tail, Baton__V1__FinishReason fr,
                              int with_usage)
{
    const char *out;
    size_t n_out;
    char *text = NULL;
    size_t n_text = 0, cap_text = 0;
    rtr_tool_stream_push(&c->ts, tail, n_tail, &out, &n_out);
    append(&text, &n_text, &cap_text, out, n_out);
    rtr_tool_result_t r;
    int rc = rtr_tool_stream_finish(&c->ts, &r, &out, &n_out);
    if (rc == 1) {
        if (r.content) append(&text, &n_text, &cap_text, r.content, r.content_len);
        if (fr != BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH)
            fr = BATON__V1__FINISH_REASON__FINISH_REASON_TOOL_CALLS;
        grpc_send(j, c, NULL, 0, NULL, 0, text ? text : "", n_text, fr, with_usage, &r);
        rtr_tool_result_free(&r);
    } else {
        if (rc == 0) append(&text, &n_text, &cap_text, out, n_out);
        grpc_send(j, c, NULL, 0, NULL, 0, text ? text : "", n_text, fr, with_usage, NULL);
    }
    free(text);
}

static int on_tokens(void *ud, const int32_t *ids, size_t n, Baton__V1__TokenLogprob *const *lps, size_t n_lps)
{
    choice_t *c = ud;
    rtr_job_t *j = c->job;
    const tok_tokenizer *tok = j->r->model.tok;
    char *delta = NULL;
    size_t n_delta = 0, cap_delta = 0;
    int stop = 0;
    size_t used = 0;
    cJSON *lp = NULL;
    pthread_mutex_lock(&j->mu);
    double t = now_s();
    if (!c->n_tokens) c->t_first = t;
    if (j->t_first == 0) {
        j->t_first = t;
        metrics_histogram_observe(j->r->ttft, t - j->t0);
    }
    c->t_last = t;
    if (j->g.logprobs && j->g.stream && j->g.api != RTR_API_GRPC)
        lp = j->g.api == RTR_API_CHAT ? cJSON_CreateArray() : cmpl_lp_new();
    /* a node never gets to stream past max_tokens (issue 16.8): the rest is dropped and the choice ends */
    size_t room = c->n_tokens < j->g.max_tokens ? j->g.max_tokens - c->n_tokens : 0;
    if (n > room) {
        c->overrun = 1;
        n = room;
    }
    for (size_t i = 0; i < n && !stop; i++) {
        const char *txt;
        size_t len;
        int rc = rtr_textgen_push(&c->tg, ids[i], &txt, &len);
        if (rc < 0) { txt = ""; len = 0; }
        if (rc == 1) {
            stop = 1;
            c->stop_index = c->tg.stop_index;
        }
        used = i + 1;
        const Baton__V1__TokenLogprob *l = i < n_lps ? lps[i] : NULL;
        if (j->g.logprobs && j->g.api != RTR_API_GRPC) {
            cJSON *dst = lp ? lp : c->lp;
            if (j->g.api == RTR_API_CHAT) cJSON_AddItemToArray(dst, chat_lp_entry(tok, l, ids[i], j->g.top_logprobs));
            else cmpl_lp_add(dst, tok, l, ids[i], j->g.top_logprobs, c->text_offset);
        }
        c->text_offset += len;
        append(&delta, &n_delta, &cap_delta, len ? txt : "", len);
    }
    c->n_tokens += (uint32_t)used;
    j->completion_tokens += (uint32_t)used;
    atomic_fetch_add(&j->r->tokens_seen, (long long)used);
    if (j->g.adm) {
        atomic_store(&j->g.adm->c[c->index].started, 1);
        atomic_store(&j->g.adm->c[c->index].got, (long long)c->n_tokens);
    }
    if (j->g.api == RTR_API_GRPC) {
        const char *out = delta ? delta : "";
        size_t n_out = n_delta;
        if (c->tools_on) rtr_tool_stream_push(&c->ts, out, n_out, &out, &n_out);
        if (used) grpc_send(j, c, ids, used, lps, n_lps < used ? n_lps : used, out, n_out,
                            BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED, 0, NULL);
    } else if (j->g.stream) {
        const char *out = delta ? delta : "";
        size_t n_out = n_delta;
        if (c->tools_on) rtr_tool_stream_push(&c->ts, out, n_out, &out, &n_out);
        if (n_out || lp) sse_chunk(j, c, out, n_out, lp, NULL);
        else cJSON_Delete(lp);
    } else if (n_delta) {
        append(&c->text, &c->n_text, &c->cap_text, delta, n_delta);
    }
    pthread_mutex_unlock(&j->mu);
    free(delta);
    return stop || c->overrun;
}

#define CLIENT_PROBE_MS 200 /* how often a non-streaming job looks at its client's socket (issue 16.6) */

/* A deferred (non-streaming) answer has no write that would fail when the client leaves: look at the socket,
 * at most every CLIENT_PROBE_MS per job whichever choice asks. */
static void probe_client(rtr_job_t *j)
{
    if (!j->hreq || j->g.stream) return;
    long long now = (long long)(now_s() * 1000.0), next = atomic_load(&j->next_probe_ms);
    if (now < next || !atomic_compare_exchange_strong(&j->next_probe_ms, &next, now + CLIENT_PROBE_MS)) return;
    if (http_request_client_gone(j->hreq)) atomic_store(&j->gone, 1);
}

static int is_cancelled(void *ud)
{
    choice_t *c = ud;
    probe_client(c->job);
    return atomic_load(&c->job->gone) || atomic_load(&c->job->r->stopping);
}

static void http_error_for(rtr_job_t *j, int *status, const char **type, const char **code)
{
    *type = NULL;
    *code = NULL;
    switch (j->fail_code) {
    case BT_RPC_INVALID_ARGUMENT: case BT_RPC_OUT_OF_RANGE: *status = 400; break;
    case BT_RPC_RESOURCE_EXHAUSTED: *status = 429; break;
    case BT_RPC_UNAVAILABLE: *status = 503; break;
    case BT_RPC_DEADLINE_EXCEEDED: *status = 504; break;
    default: *status = 500; break;
    }
}

/* The final answer, by the last choice to end (j->mu not held: nothing else touches the job now). */
static void job_complete(rtr_job_t *j)
{
    rtr_t *r = j->r;
    double t = now_s();
    const char *label = "ok";
    if (atomic_load(&j->gone)) label = "cancelled";
    else if (j->failed) label = "error";
    if (j->g.api == RTR_API_GRPC) {
        if (j->failed && !atomic_load(&j->gone)) bt_rpc_call_finish(j->call, j->fail_code, j->fail_msg);
        else bt_rpc_call_finish(j->call, BT_RPC_OK, NULL);
    } else if (j->g.stream) {
        if (!atomic_load(&j->gone)) {
            if (j->failed) {
                int status;
                const char *type, *code;
                http_error_for(j, &status, &type, &code);
                cJSON *o = cJSON_CreateObject();
                cJSON *e = cJSON_AddObjectToObject(o, "error");
                cJSON_AddStringToObject(e, "message", j->fail_msg);
                cJSON_AddStringToObject(e, "type", status < 500 ? "invalid_request_error" : "server_error");
                cJSON_AddNullToObject(e, "param");
                cJSON_AddNumberToObject(e, "code", status);
                sse_send_json(j, o);
                cJSON_Delete(o);
            }
            if (j->g.include_usage) {
                cJSON *o = chunk_base(j);
                cJSON_AddArrayToObject(o, "choices");
                cJSON_AddItemToObject(o, "usage", usage_json(j));
                sse_send_json(j, o);
                cJSON_Delete(o);
            }
            static const char done[] = "[DONE]";
            http_stream_send(j->hst, done, sizeof done - 1);
        }
        http_stream_end(j->hst);
    } else if (j->failed) {
        int status;
        const char *type, *code;
        http_error_for(j, &status, &type, &code);
        http_respond_error(j->hreq, status, j->fail_msg, type, code);
    } else {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", j->id);
        cJSON_AddStringToObject(o, "object", j->g.api == RTR_API_CHAT ? "chat.completion" : "text_completion");
        cJSON_AddNumberToObject(o, "created", (double)j->created);
        cJSON_AddStringToObject(o, "model", r->model.name);
        cJSON_AddStringToObject(o, "system_fingerprint", "baton");
        cJSON *choices = cJSON_AddArrayToObject(o, "choices");
        for (int i = 0; i < j->g.n; i++) {
            choice_t *c = &j->ch[i];
            cJSON *ch = cJSON_CreateObject();
            cJSON_AddNumberToObject(ch, "index", i);
            char *txt = rtr_utf8_sanitize(c->text ? c->text : "", c->n_text);
            rtr_tool_result_t tr = {0};
            int calls = c->tools_on && rtr_tool_parse(j->g.tools, c->text ? c->text : "", c->n_text, &tr) == 1;
            if (calls) {
                free(txt);
                txt = tr.content ? rtr_utf8_sanitize(tr.content, tr.content_len) : NULL;
                if (strcmp(c->finish ? c->finish : "stop", "length")) c->finish = "tool_calls";
            }
            if (j->g.api == RTR_API_CHAT) {
                cJSON *msg = cJSON_AddObjectToObject(ch, "message");
                cJSON_AddStringToObject(msg, "role", "assistant");
                if (calls && !txt) cJSON_AddNullToObject(msg, "content");
                else cJSON_AddStringToObject(msg, "content", txt ? txt : "");
                if (calls) cJSON_AddItemToObject(msg, "tool_calls", tool_calls_json(j, &tr));
                rtr_tool_result_free(&tr);
                if (c->lp) {
                    cJSON *l = cJSON_AddObjectToObject(ch, "logprobs");
                    cJSON_AddItemToObject(l, "content", c->lp);
                    c->lp = NULL;
                } else {
                    cJSON_AddNullToObject(ch, "logprobs");
                }
            } else {
                cJSON_AddStringToObject(ch, "text", txt ? txt : "");
                if (c->lp) {
                    cJSON_AddItemToObject(ch, "logprobs", c->lp);
                    c->lp = NULL;
                } else {
                    cJSON_AddNullToObject(ch, "logprobs");
                }
            }
            free(txt);
            cJSON_AddStringToObject(ch, "finish_reason", c->finish ? c->finish : "stop");
            if (c->stop_index >= 0) cJSON_AddStringToObject(ch, "stop_reason", j->g.stops[c->stop_index]);
            cJSON_AddItemToArray(choices, ch);
        }
        cJSON_AddItemToObject(o, "usage", usage_json(j));
        http_respond_json(j->hreq, 200, o);
        cJSON_Delete(o);
    }
    metrics_histogram_observe(r->e2e, t - j->t0);
    metrics_counter_add(r->prompt_tokens, j->g.n_prompt);
    metrics_counter_add(r->generation_tokens, j->completion_tokens);
    rtr_count_request(r, label);
    job_free(j);
}

/* DecodeRunRequest's sample index field (n > 1: each choice its own RNG stream), when node.proto has one; looked
 * up by name so the router works with node.proto before and after the field is added. */
static const ProtobufCFieldDescriptor *sample_index_field(void)
{
    const ProtobufCFieldDescriptor *fd =
        protobuf_c_message_descriptor_get_field_by_name(&baton__v1__decode_run_request__descriptor, "sample_index");
    if (!fd || fd->label == PROTOBUF_C_LABEL_REPEATED ||
        (fd->type != PROTOBUF_C_TYPE_UINT32 && fd->type != PROTOBUF_C_TYPE_INT32))
        return NULL;
    return fd;
}

static void set_sample_index(Baton__V1__DecodeRunRequest *req, int index)
{
    const ProtobufCFieldDescriptor *fd = sample_index_field();
    if (!fd) return;
    uint32_t v = (uint32_t)index;
    memcpy((char *)req + fd->offset, &v, sizeof v);
    if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
        uint32_t id = fd->id;
        memcpy((char *)req + fd->quantifier_offset, &id, sizeof id);
    } else if (fd->label == PROTOBUF_C_LABEL_OPTIONAL && fd->quantifier_offset) {
        protobuf_c_boolean has = 1;
        memcpy((char *)req + fd->quantifier_offset, &has, sizeof has);
    }
}

/* What is left of a gRPC client's deadline, in ms (at least 1 once it passed), or 0 when it set none. */
static int client_timeout_ms(const rtr_job_t *j)
{
    if (!j->call) return 0;
    int64_t deadline = bt_rpc_call_deadline_ms(j->call);
    if (deadline == INT64_MAX) return 0;
    double left = (double)deadline - now_s() * 1000.0;
    return left < 1 ? 1 : left > INT32_MAX ? INT32_MAX : (int)left;
}

static void *choice_main(void *arg)
{
    choice_t *c = arg;
    rtr_job_t *j = c->job;
    rtr_gen_t *g = &j->g;
    Baton__V1__DecodeRunRequest req = BATON__V1__DECODE_RUN_REQUEST__INIT;
    req.request_id = j->seq_ids[c->index];
    req.model_fingerprint = "";
    req.prompt_token_ids = g->prompt;
    req.n_prompt_token_ids = g->n_prompt;
    req.sampling = &j->sp[c->index];
    req.max_tokens = g->max_tokens;
    req.stop_token_ids = g->stop_ids;
    req.n_stop_token_ids = g->n_stop_ids;
    req.ignore_eos = g->ignore_eos;
    req.disable_speculation = g->no_spec;
    req.logprobs = g->logprobs;
    req.top_logprobs = (uint32_t)g->top_logprobs;
    req.grammar = g->grammar ? g->grammar : "";
    set_sample_index(&req, c->index);
    rtr_run_ops_t ops = {.on_tokens = on_tokens, .cancelled = is_cancelled, .ud = c,
                         .timeout_ms = client_timeout_ms(j)};
    rtr_run_result_t res;
    bt_status st = rtr_dispatch_run(j->r->dispatch, &req, &ops, &res);

    pthread_mutex_lock(&j->mu);
    const char *tail;
    size_t n_tail;
    rtr_textgen_finish(&c->tg, &tail, &n_tail);
    if (c->stop_index < 0) c->stop_index = c->tg.stop_index; /* the flushed tail may complete a stop string */
    Baton__V1__FinishReason fr = res.finish;
    if (st == BT_OK) {
        if (fr == BATON__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED || c->stop_index >= 0)
            fr = BATON__V1__FINISH_REASON__FINISH_REASON_STOP;
        if (c->overrun && c->stop_index < 0) fr = BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        c->finish = fr == BATON__V1__FINISH_REASON__FINISH_REASON_LENGTH ? "length"
                  : fr == BATON__V1__FINISH_REASON__FINISH_REASON_ABORT ? "abort" : "stop";
        if (res.cached_prompt_tokens > j->cached) j->cached = res.cached_prompt_tokens;
    } else {
        c->finish = "abort";
        fr = BATON__V1__FINISH_REASON__FINISH_REASON_ABORT;
        if (!j->failed && st != BT_ERR_CANCELLED) {
            j->failed = 1;
            j->fail_st = st;
            j->fail_code = res.code != BT_RPC_OK ? res.code : bt_rpc_code_from_status(st);
            snprintf(j->fail_msg, sizeof j->fail_msg, "%s", res.message[0] ? res.message : bt_last_error());
        }
    }
    if (c->n_tokens > 1) metrics_histogram_observe(j->r->tpot, (c->t_last - c->t_first) / (c->n_tokens - 1));
    rtr_admit_choice_end(j->r, j->g.adm, c->index, c->n_tokens,
                         st == BT_OK && fr != BATON__V1__FINISH_REASON__FINISH_REASON_ABORT && !c->overrun);
    int last = --j->remaining == 0;
    if (!atomic_load(&j->gone) && !(st != BT_OK && j->g.api != RTR_API_GRPC && !j->g.stream)) {
        if (j->g.api == RTR_API_GRPC) {
            if (st == BT_OK && c->tools_on) grpc_finish_tools(j, c, tail, n_tail, fr, last);
            else if (st == BT_OK) grpc_send(j, c, NULL, 0, NULL, 0, tail, n_tail, fr, last, NULL);
        } else if (j->g.stream) {
            if (st == BT_OK && c->tools_on) sse_finish_tools(j, c, tail, n_tail);
            else if (st == BT_OK) sse_chunk(j, c, tail, n_tail, NULL, c->finish);
        } else if (n_tail) {
            append(&c->text, &c->n_text, &c->cap_text, tail, n_tail);
        }
    }
    pthread_mutex_unlock(&j->mu);
    if (last) job_complete(j);
    return NULL;
}

static uint64_t mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static bt_status job_create(rtr_t *r, rtr_gen_t *g, rtr_job_t **out)
{
    rtr_job_t *j = calloc(1, sizeof *j);
    if (!j) {
        rtr_admit_release(r, g->adm);
        rtr_gen_free(g);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    j->r = r;
    j->g = *g;
    memset(g, 0, sizeof *g);
    if (j->g.n < 1) j->g.n = 1;
    pthread_mutex_init(&j->mu, NULL);
    atomic_fetch_add(&r->active_jobs, 1);
    j->t0 = now_s();
    j->created = (int64_t)time(NULL);
    unsigned long long seq = atomic_fetch_add(&r->next_id, 1);
    const char *prefix = j->g.api == RTR_API_CHAT ? "chatcmpl-" : j->g.api == RTR_API_COMPLETION ? "cmpl-" : "gen-";
    /* nodes only ever see the router's own unguessable id (issue 16.8): a client-chosen id is echoed back to its
     * client, never used to name a sequence, so it cannot collide with or abort another client's stream */
    uint64_t rnd;
    if (getrandom(&rnd, sizeof rnd, GRND_NONBLOCK) != (ssize_t)sizeof rnd) rnd = mix64((uint64_t)(now_s() * 1e9) ^ seq);
    char own[80];
    snprintf(own, sizeof own, "%s%016llx%llx", prefix, (unsigned long long)rnd, seq);
    snprintf(j->id, sizeof j->id, "%s", j->g.request_id[0] ? j->g.request_id : own);
    j->ch = calloc((size_t)j->g.n, sizeof *j->ch);
    j->seq_ids = calloc((size_t)j->g.n, sizeof *j->seq_ids);
    j->sp = calloc((size_t)j->g.n, sizeof *j->sp);
    if (!j->ch || !j->seq_ids || !j->sp) {
        job_free(j);
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    }
    size_t n_lb = (size_t)j->g.n_logit_bias;
    if (n_lb) {
        j->lb = calloc(n_lb, sizeof *j->lb);
        j->lb_ptrs = calloc(n_lb, sizeof *j->lb_ptrs);
        if (!j->lb || !j->lb_ptrs) {
            job_free(j);
            return bt_fail(BT_ERR_NOMEM, "out of memory");
        }
        for (size_t k = 0; k < n_lb; k++) {
            baton__v1__logit_bias__init(&j->lb[k]);
            j->lb[k].token_id = j->g.logit_bias_ids[k];
            j->lb[k].bias = j->g.logit_bias[k];
            j->lb_ptrs[k] = &j->lb[k];
        }
    }
    /* Without a client seed the router picks one, so a migrated stream samples the same tokens. */
    uint64_t seed = j->g.has_seed ? j->g.seed : mix64((uint64_t)(now_s() * 1e9) ^ seq);
    const char *stops[RTR_MAX_STOP];
    for (int i = 0; i < j->g.n_stop; i++) stops[i] = j->g.stops[i];
    for (int i = 0; i < j->g.n; i++) {
        choice_t *c = &j->ch[i];
        c->job = j;
        c->index = i;
        c->stop_index = -1;
        rtr_textgen_init(&c->tg, r->model.tok, stops, j->g.n_stop);
        c->tools_on = (j->g.api == RTR_API_CHAT || j->g.api == RTR_API_GRPC) && j->g.tools &&
                      j->g.tools->choice != RTR_TOOL_CHOICE_NONE;
        rtr_tool_stream_init(&c->ts, j->g.tools);
        if (j->g.logprobs && !j->g.stream && j->g.api != RTR_API_GRPC)
            c->lp = j->g.api == RTR_API_CHAT ? cJSON_CreateArray() : cmpl_lp_new();
        char buf[120];
        snprintf(buf, sizeof buf, "%s-%d", own, i);
        j->seq_ids[i] = strdup(buf);
        Baton__V1__SamplingParams *sp = &j->sp[i];
        baton__v1__sampling_params__init(sp);
        const rtr_gen_t *q = &j->g;
        if (q->has_temperature) {
            sp->temperature_opt_case = BATON__V1__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE;
            sp->temperature = q->temperature;
        }
        if (q->has_top_p) {
            sp->top_p_opt_case = BATON__V1__SAMPLING_PARAMS__TOP_P_OPT_TOP_P;
            sp->top_p = q->top_p;
        }
        if (q->has_top_k) {
            sp->top_k_opt_case = BATON__V1__SAMPLING_PARAMS__TOP_K_OPT_TOP_K;
            sp->top_k = q->top_k;
        }
        if (q->has_min_p) {
            sp->min_p_opt_case = BATON__V1__SAMPLING_PARAMS__MIN_P_OPT_MIN_P;
            sp->min_p = q->min_p;
        }
        if (q->has_repetition_penalty) {
            sp->repetition_penalty_opt_case = BATON__V1__SAMPLING_PARAMS__REPETITION_PENALTY_OPT_REPETITION_PENALTY;
            sp->repetition_penalty = q->repetition_penalty;
        }
        if (q->has_presence) {
            sp->presence_penalty_opt_case = BATON__V1__SAMPLING_PARAMS__PRESENCE_PENALTY_OPT_PRESENCE_PENALTY;
            sp->presence_penalty = q->presence_penalty;
        }
        if (q->has_frequency) {
            sp->frequency_penalty_opt_case = BATON__V1__SAMPLING_PARAMS__FREQUENCY_PENALTY_OPT_FREQUENCY_PENALTY;
            sp->frequency_penalty = q->frequency_penalty;
        }
        sp->n_logit_bias = n_lb;
        sp->logit_bias = j->lb_ptrs;
        sp->seed_opt_case = BATON__V1__SAMPLING_PARAMS__SEED_OPT_SEED;
        /* without a sample index in node.proto, choice i > 0 gets a seed of its own instead */
        sp->seed = i == 0 || sample_index_field() ? seed : mix64(seed + (uint64_t)i);
    }
    j->remaining = j->g.n;
    *out = j;
    return BT_OK;
}

static void stream_gone(http_stream_t *st, void *arg)
{
    (void)st;
    rtr_job_t *j = arg;
    atomic_store(&j->gone, 1);
}

static void call_cancelled(void *ud, bt_rpc_call_t *call)
{
    (void)call;
    rtr_job_t *j = ud;
    atomic_store(&j->gone, 1);
}

/* Starts one detached thread per choice; a choice whose thread cannot start ends at once as failed. */
static void job_launch(rtr_job_t *j)
{
    int n = j->g.n;
    for (int i = 0; i < n; i++) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&at, 256 * 1024);
        int rc = pthread_create(&th, &at, choice_main, &j->ch[i]);
        pthread_attr_destroy(&at);
        if (rc) {
            pthread_mutex_lock(&j->mu);
            j->failed = 1;
            j->fail_code = BT_RPC_RESOURCE_EXHAUSTED;
            snprintf(j->fail_msg, sizeof j->fail_msg, "cannot start a worker thread");
            j->ch[i].finish = "abort";
            int last = --j->remaining == 0;
            pthread_mutex_unlock(&j->mu);
            if (last) job_complete(j);
        }
    }
}

bt_status rtr_job_start_http(rtr_t *r, rtr_gen_t *g, http_request_t *req)
{
    rtr_job_t *j;
    bt_status st = job_create(r, g, &j);
    if (st) return st;
    if (j->g.stream) {
        st = http_stream_start(req, stream_gone, j, &j->hst);
    } else {
        j->hreq = req;
        st = http_request_defer(req);
    }
    if (st) {
        job_free(j);
        return st;
    }
    job_launch(j);
    return BT_OK;
}

bt_status rtr_job_start_grpc(rtr_t *r, rtr_gen_t *g, bt_rpc_call_t *call)
{
    rtr_job_t *j;
    g->api = RTR_API_GRPC;
    g->stream = 1;
    bt_status st = job_create(r, g, &j);
    if (st) return st;
    j->call = call;
    bt_rpc_call_on_cancel(call, call_cancelled, j);
    job_launch(j);
    return BT_OK;
}
