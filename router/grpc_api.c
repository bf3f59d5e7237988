/* baton.v1.Generation over gRPC (DESIGN 9): Generate (server-streaming), Tokenize, Detokenize, ListModels.
 * Limits as over HTTP; errors map to INVALID_ARGUMENT, NOT_FOUND, UNAUTHENTICATED, UNAVAILABLE. */
#include "router/router.h"

#include "common/http.h"
#include "common/log.h"
#include "router/json_schema.h"
#include "router/tool_calls.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 1 when given equals key, in time that depends on the key's length only (issue 16.8: strcmp leaks how long a
 * guessed prefix is). */
int rtr_key_equal(const char *given, const char *key)
{
    size_t glen = strlen(given), klen = strlen(key);
    unsigned char diff = (unsigned char)(glen != klen);
    for (size_t i = 0; i < klen; i++) diff |= (unsigned char)(key[i] ^ (i < glen ? given[i] : 0));
    return diff == 0;
}

/* 1 when the call may proceed: no keys configured, or `authorization: Bearer <key>` names one. Every key is
 * compared, so the time does not tell which matched. */
static int authorized(rtr_t *r, bt_rpc_call_t *call)
{
    if (!r->cfg.n_api_keys) return 1;
    char buf[512];
    if (bt_rpc_call_metadata(call, "authorization", buf, sizeof buf) != BT_OK) return 0;
    const char *k = buf;
    if (!strncmp(k, "Bearer ", 7) || !strncmp(k, "bearer ", 7)) k += 7;
    int ok = 0;
    for (size_t i = 0; i < r->cfg.n_api_keys; i++) ok |= rtr_key_equal(k, r->cfg.api_keys[i]);
    return ok;
}

static int check_auth(rtr_t *r, bt_rpc_call_t *call)
{
    if (authorized(r, call)) return 1;
    bt_rpc_call_finish(call, BT_RPC_UNAUTHENTICATED, "missing or invalid API key");
    return 0;
}

static int check_model(rtr_t *r, bt_rpc_call_t *call, const char *model)
{
    if (rtr_model_matches(&r->model, model)) return 1;
    char msg[512];
    snprintf(msg, sizeof msg, "model '%.100s' is not served here (this server serves '%s')", model, r->model.name);
    bt_rpc_call_finish(call, BT_RPC_NOT_FOUND, msg);
    return 0;
}

static int valid_utf8(const char *s)
{
    char *t = rtr_utf8_sanitize(s, strlen(s));
    int ok = t && !strcmp(t, s);
    free(t);
    return ok;
}

/* The shared checks (router/openai_api.c, router/tool_calls.c) name OpenAI's fields; the same error re-recorded with
 * this API's names: messages[i] is chat.messages[i], tools[i].function.name is tools[i].name, a tool call's
 * function.arguments is its arguments. */
static bt_status grpc_names(bt_status st)
{
    char in[512], out[640];
    snprintf(in, sizeof in, "%s", bt_last_error());
    size_t o = 0;
    for (const char *p = in; *p && o + 16 < sizeof out;) {
        if (!strncmp(p, "'messages[", 10)) {
            memcpy(out + o, "'chat.messages[", 15);
            o += 15;
            p += 10;
        } else if (!strncmp(p, "].function.", 11)) {
            memcpy(out + o, "].", 2);
            o += 2;
            p += 11;
        } else {
            out[o++] = *p++;
        }
    }
    out[o] = '\0';
    return bt_fail(st, "%s", out);
}

/* A gRPC chat message as the OpenAI message object the shared checks read; NULL when out of memory. */
static cJSON *message_json(const Baton__V1__ChatMessage *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "role", m->role)) goto fail;
    if (*m->name && !cJSON_AddStringToObject(o, "name", m->name)) goto fail;
    if (*m->tool_call_id && !cJSON_AddStringToObject(o, "tool_call_id", m->tool_call_id)) goto fail;
    if (m->n_tool_calls) {
        cJSON *a = cJSON_AddArrayToObject(o, "tool_calls");
        for (size_t i = 0; a && i < m->n_tool_calls; i++) {
            const Baton__V1__ToolCall *c = m->tool_calls[i];
            cJSON *tc = cJSON_CreateObject(), *fn = NULL;
            if (!tc || !cJSON_AddItemToArray(a, tc)) {
                cJSON_Delete(tc);
                goto fail;
            }
            if ((*c->id && !cJSON_AddStringToObject(tc, "id", c->id)) ||
                !cJSON_AddStringToObject(tc, "type", "function") || !(fn = cJSON_AddObjectToObject(tc, "function")) || !cJSON_AddStringToObject(fn, "name", c->name) ||
                !cJSON_AddStringToObject(fn, "arguments", c->arguments))
                goto fail;
        }
        if (!a) goto fail;
    }
    return o;
fail:
    cJSON_Delete(o);
    return NULL;
}

/* The chat messages checked and rendered with the model's template (and the request's tools, NULL: none). */
static bt_status chat_to_ids(const rtr_model_t *model, const Baton__V1__ChatMessages *chat, const char *tools_json,
                             tok_ids *ids)
{
    if (!chat->n_messages) return bt_fail(BT_ERR_INVALID, "'chat.messages' must not be empty");
    if (!model->has_tmpl) return bt_fail(BT_ERR_INVALID, "this model has no chat template");
    size_t total = tools_json ? strlen(tools_json) : 0; /* the template renders the tools too */
    for (size_t i = 0; i < chat->n_messages; i++) total += strlen(chat->messages[i]->content);
    if (total > rtr_prompt_max_bytes(model))
        return bt_fail(BT_ERR_INVALID,
                       "'chat' has %zu bytes of text; at most %zu fit this model's context of %d tokens", total, rtr_prompt_max_bytes(model), model->n_ctx);
    chat_msg *cm = calloc(chat->n_messages, sizeof *cm);
    char **extras = calloc(chat->n_messages, sizeof *extras);
    bt_status st = BT_OK;
    if (!cm || !extras) {
        st = bt_fail(BT_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < chat->n_messages; i++) {
        const Baton__V1__ChatMessage *m = chat->messages[i];
        if (!rtr_chat_role_ok(m->role)) {
            st = bt_fail(BT_ERR_INVALID, "'chat.messages[%zu].role' must be system, developer, user, assistant or tool",
                         i);
            goto out;
        }
        int utf8 = valid_utf8(m->content) && valid_utf8(m->name) && valid_utf8(m->tool_call_id);
        for (size_t k = 0; utf8 && k < m->n_tool_calls; k++)
            utf8 = valid_utf8(m->tool_calls[k]->id) && valid_utf8(m->tool_calls[k]->name) &&
                   valid_utf8(m->tool_calls[k]->arguments);
        if (!utf8) {
            st = bt_fail(BT_ERR_INVALID, "'chat.messages[%zu]' is not valid UTF-8", i);
            goto out;
        }
        cJSON *o = message_json(m);
        if (!o) {
            st = bt_fail(BT_ERR_NOMEM, "out of memory");
            goto out;
        }
        st = rtr_chat_message_extra(model, o, m->role, (int)i, &extras[i]);
        cJSON_Delete(o);
        if (st) {
            st = grpc_names(st);
            goto out;
        }
        cm[i] = (chat_msg){!strcmp(m->role, "developer") ? "system" : m->role, m->content, strlen(m->content),
                           extras[i]};
    }
    st = rtr_chat_encode_tools(model, cm, chat->n_messages, tools_json, ids);
out:
    for (size_t i = 0; extras && i < chat->n_messages; i++) free(extras[i]);
    free(extras);
    free(cm);
    return st;
}

/* Renders a chat (or takes text) and tokenizes it into ids. BT_ERR_INVALID with a message for the client. */
static bt_status to_ids(const rtr_model_t *model, const char *text, const Baton__V1__ChatMessages *chat,
                        const char *tools_json, unsigned flags, tok_ids *ids)
{
    if (chat) return chat_to_ids(model, chat, tools_json, ids);
    if (strlen(text) > rtr_prompt_max_bytes(model))
        return bt_fail(BT_ERR_INVALID, "'text' has %zu bytes; at most %zu fit this model's context of %d tokens",
                       strlen(text), rtr_prompt_max_bytes(model), model->n_ctx);
    if (!valid_utf8(text)) return bt_fail(BT_ERR_INVALID, "'text' is not valid UTF-8");
    return tok_encode(model->tok, text, strlen(text), TOK_PARSE_SPECIAL | flags, ids);
}

/* Copies sampling.logit_bias into g after the checks the HTTP API makes; BT_ERR_INVALID naming the entry. */
static bt_status copy_logit_bias(const rtr_model_t *m, const Baton__V1__SamplingParams *sp, rtr_gen_t *g)
{
    if (sp->n_logit_bias > RTR_MAX_LOGIT_BIAS)
        return bt_fail(BT_ERR_INVALID, "'sampling.logit_bias' may hold at most %d entries", RTR_MAX_LOGIT_BIAS);
    for (size_t i = 0; i < sp->n_logit_bias; i++) {
        const Baton__V1__LogitBias *e = sp->logit_bias[i];
        if (e->token_id < 0 || e->token_id >= tok_n_vocab(m->tok))
            return bt_fail(BT_ERR_INVALID, "'sampling.logit_bias' [%zu] token_id %d is not in the vocabulary", i,
                           e->token_id);
        if (!(e->bias >= -100 && e->bias <= 100))
            return bt_fail(BT_ERR_INVALID, "'sampling.logit_bias' [%zu] bias must be in [-100, 100]", i);
        for (size_t k = 0; k < i; k++)
            if (sp->logit_bias[k]->token_id == e->token_id)
                return bt_fail(BT_ERR_INVALID, "'sampling.logit_bias' names token %d twice", e->token_id);
        g->logit_bias_ids[i] = e->token_id;
        g->logit_bias[i] = e->bias;
    }
    g->n_logit_bias = (int)sp->n_logit_bias;
    return BT_OK;
}

/* The prompt as token ids: text (tokenized with BOS), chat (rendered by the model's template) or ids (checked
 * against the vocabulary). */
static bt_status parse_prompt(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g)
{
    tok_ids ids = {0};
    bt_status st;
    switch (q->prompt_case) {
    case BATON__V1__GENERATE_REQUEST__PROMPT_TEXT: st = to_ids(m, q->text, NULL, NULL, TOK_ADD_SPECIAL, &ids); break;
    case BATON__V1__GENERATE_REQUEST__PROMPT_CHAT:
        st = to_ids(m, NULL, q->chat, g->tools ? g->tools->tools_json : NULL, 0, &ids);
        break;
    case BATON__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS:
        for (size_t i = 0; i < q->token_ids->n_ids; i++)
            if (q->token_ids->ids[i] < 0 || q->token_ids->ids[i] >= tok_n_vocab(m->tok))
                return bt_fail(BT_ERR_INVALID, "'token_ids' [%zu] = %d is not in the vocabulary", i,
                               q->token_ids->ids[i]);
        if (!q->token_ids->n_ids) return BT_OK; /* rtr_gen_check_context names the empty prompt */
        if (!(g->prompt = malloc(q->token_ids->n_ids * sizeof *g->prompt)))
            return bt_fail(BT_ERR_NOMEM, "out of memory");
        memcpy(g->prompt, q->token_ids->ids, q->token_ids->n_ids * sizeof *g->prompt);
        g->n_prompt = q->token_ids->n_ids;
        return BT_OK;
    default: return bt_fail(BT_ERR_INVALID, "'prompt' is required (text, token_ids or chat)");
    }
    if (st) tok_ids_free(&ids);
    g->prompt = ids.ids; /* NULL after a failure */
    g->n_prompt = ids.n;
    return st;
}

/* max_tokens (at least 1 when given) and the context bound of prompt + max_tokens. */
static bt_status parse_length(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g)
{
    int given = q->max_tokens_opt_case == BATON__V1__GENERATE_REQUEST__MAX_TOKENS_OPT_MAX_TOKENS;
    if (given) {
        if (q->max_tokens == 0) return bt_fail(BT_ERR_INVALID, "'max_tokens' must be at least 1");
        g->max_tokens = q->max_tokens;
    }
    return rtr_gen_check_context(m, g, given);
}

/* Stop strings (empty ones ignored) and stop token ids. */
static bt_status parse_stops(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g)
{
    if (q->n_stop > RTR_MAX_STOP) return bt_fail(BT_ERR_INVALID, "'stop' may hold at most %d strings", RTR_MAX_STOP);
    for (size_t i = 0; i < q->n_stop; i++) {
        if (strlen(q->stop[i]) > RTR_MAX_STOP_LEN)
            return bt_fail(BT_ERR_INVALID, "'stop' strings may be at most %d bytes", RTR_MAX_STOP_LEN);
        if (!*q->stop[i]) continue;
        if (!valid_utf8(q->stop[i])) return bt_fail(BT_ERR_INVALID, "'stop' strings must be valid UTF-8");
        if (!(g->stops[g->n_stop] = strdup(q->stop[i]))) return bt_fail(BT_ERR_NOMEM, "out of memory");
        g->n_stop++;
    }
    if (q->n_stop_token_ids > 32) return bt_fail(BT_ERR_INVALID, "'stop_token_ids' may hold at most 32 ids");
    if (!q->n_stop_token_ids) return BT_OK;
    if (!(g->stop_ids = malloc(q->n_stop_token_ids * sizeof *g->stop_ids)))
        return bt_fail(BT_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < q->n_stop_token_ids; i++) {
        if (q->stop_token_ids[i] < 0 || q->stop_token_ids[i] >= tok_n_vocab(m->tok))
            return bt_fail(BT_ERR_INVALID, "'stop_token_ids' [%zu] is not in the vocabulary", i);
        g->stop_ids[i] = q->stop_token_ids[i];
    }
    g->n_stop_ids = q->n_stop_token_ids;
    return BT_OK;
}

/* BT_OK when the optional field is absent or lies in [lo, hi]; else BT_ERR_INVALID naming it. */
static bt_status check_range(int has, double v, double lo, double hi, const char *name)
{
    if (!has || (v >= lo && v <= hi)) return BT_OK;
    return bt_fail(BT_ERR_INVALID, "'sampling.%s' must be in [%g, %g]", name, lo, hi);
}

/* SamplingParams: each optional field range-checked, then copied with its presence; logit bias last. */
static bt_status parse_sampling(const rtr_model_t *m, const Baton__V1__SamplingParams *sp, rtr_gen_t *g)
{
    bt_status st;
    if ((st = check_range(sp->temperature_opt_case, sp->temperature, 0, 2, "temperature")) ||
        (st = check_range(sp->top_p_opt_case, sp->top_p, 1e-9, 1, "top_p")) ||
        (st = check_range(sp->top_k_opt_case, sp->top_k, 0, 1 << 30, "top_k")) ||
        (st = check_range(sp->min_p_opt_case, sp->min_p, 0, 1, "min_p")) ||
        (st = check_range(sp->repetition_penalty_opt_case, sp->repetition_penalty, 1e-9, 10, "repetition_penalty")) ||
        (st = check_range(sp->presence_penalty_opt_case, sp->presence_penalty, -2, 2, "presence_penalty")) ||
        (st = check_range(sp->frequency_penalty_opt_case, sp->frequency_penalty, -2, 2, "frequency_penalty")))
        return st;
    g->has_temperature = sp->temperature_opt_case != 0;
    g->temperature = sp->temperature;
    g->has_top_p = sp->top_p_opt_case != 0;
    g->top_p = sp->top_p;
    g->has_top_k = sp->top_k_opt_case != 0;
    g->top_k = sp->top_k;
    g->has_min_p = sp->min_p_opt_case != 0;
    g->min_p = sp->min_p;
    g->has_repetition_penalty = sp->repetition_penalty_opt_case != 0;
    g->repetition_penalty = sp->repetition_penalty;
    g->has_presence = sp->presence_penalty_opt_case != 0;
    g->presence_penalty = sp->presence_penalty;
    g->has_frequency = sp->frequency_penalty_opt_case != 0;
    g->frequency_penalty = sp->frequency_penalty;
    g->has_seed = sp->seed_opt_case != 0;
    g->seed = sp->seed;
    return copy_logit_bias(m, sp, g);
}

/* The client's request id is only echoed back (the router names the sequences it sends to nodes itself, so an id
 * cannot reach, or abort, another client's stream); it must be printable ASCII without quotes or backslashes,
 * so it is safe in logs. */
static bt_status copy_request_id(const char *id, rtr_gen_t *g)
{
    size_t n = strlen(id);
    if (n >= sizeof g->request_id)
        return bt_fail(BT_ERR_INVALID, "'request_id' may be at most %zu bytes", sizeof g->request_id - 1);
    for (size_t i = 0; i < n; i++)
        if (id[i] < 0x21 || id[i] > 0x7e || id[i] == '"' || id[i] == '\\')
            return bt_fail(BT_ERR_INVALID, "'request_id' byte %zu is not printable ASCII (or is a quote or backslash)", i);
    memcpy(g->request_id, id, n + 1);
    return BT_OK;
}

/* Grammar text, checked (rtr_gen_take_grammar): every error but out of memory is INVALID_ARGUMENT. */
static bt_status take_grammar(bt_status st, char *grammar, const char *where, rtr_gen_t *g)
{
    st = rtr_gen_take_grammar(st, grammar, where, g);
    return st && st != BT_ERR_NOMEM ? bt_fail(BT_ERR_INVALID, "%s", bt_last_error()) : st;
}

/* ResponseFormat (issue 23) as grammar text (router/json_schema.h), checked; every client error is
 * INVALID_ARGUMENT naming what is wrong. */
static bt_status parse_response_format(const Baton__V1__ResponseFormat *f, rtr_gen_t *g)
{
    char *grammar = NULL;
    bt_status st = BT_OK;
    switch (f->format_case) {
    case BATON__V1__RESPONSE_FORMAT__FORMAT_JSON_SCHEMA: {
        cJSON *schema = cJSON_Parse(f->json_schema);
        if (!schema) return bt_fail(BT_ERR_INVALID, "'response_format.json_schema' is not valid JSON");
        st = rtr_json_schema_grammar(schema, &grammar);
        cJSON_Delete(schema);
        break;
    }
    case BATON__V1__RESPONSE_FORMAT__FORMAT_JSON_OBJECT:
        if (!f->json_object) return BT_OK;
        st = rtr_json_object_grammar(&grammar);
        break;
    case BATON__V1__RESPONSE_FORMAT__FORMAT_REGEX: st = rtr_regex_grammar(f->regex, &grammar); break;
    case BATON__V1__RESPONSE_FORMAT__FORMAT_GRAMMAR:
        grammar = strdup(f->grammar);
        if (!grammar) st = bt_fail(BT_ERR_NOMEM, "out of memory");
        break;
    default: return BT_OK;
    }
    return take_grammar(st, grammar, "response_format", g);
}

/* The request's tools as the OpenAI body fields rtr_tools_from_request reads (tools, tool_choice,
 * parallel_tool_calls), so both APIs run one set of checks. BT_ERR_INVALID naming the field, BT_ERR_NOMEM. */
static bt_status tools_body(const Baton__V1__GenerateRequest *q, cJSON **out)
{
    *out = NULL;
    cJSON *b = cJSON_CreateObject(), *a = b && q->n_tools ? cJSON_AddArrayToObject(b, "tools") : NULL;
    bt_status st = BT_OK;
    if (!b || (q->n_tools && !a)) goto nomem;
    for (size_t i = 0; i < q->n_tools && i <= RTR_TOOL_MAX_TOOLS; i++) {
        const Baton__V1__Tool *t = q->tools[i];
        cJSON *o = cJSON_CreateObject(), *fn = NULL;
        if (!o || !cJSON_AddItemToArray(a, o)) {
            cJSON_Delete(o);
            goto nomem;
        }
        if (!valid_utf8(t->name) || !valid_utf8(t->description)) {
            st = bt_fail(BT_ERR_INVALID, "'tools[%zu]' is not valid UTF-8", i);
            goto fail;
        }
        if (!cJSON_AddStringToObject(o, "type", "function") || !(fn = cJSON_AddObjectToObject(o, "function")) ||
            !cJSON_AddStringToObject(fn, "name", t->name) ||
            (*t->description && !cJSON_AddStringToObject(fn, "description", t->description)) ||
            (t->strict && !cJSON_AddTrueToObject(fn, "strict")))
            goto nomem;
        if (*t->parameters) {
            cJSON *p = NULL;
            if (http_json_parse(t->parameters, strlen(t->parameters), &p)) {
                char msg[300];
                snprintf(msg, sizeof msg, "%s", bt_last_error());
                st = bt_fail(BT_ERR_INVALID, "'tools[%zu].parameters' must be a JSON schema object as JSON text: %s", i,
                             msg);
                goto fail;
            }
            if (!cJSON_AddItemToObject(fn, "parameters", p)) {
                cJSON_Delete(p);
                goto nomem;
            }
        }
    }
    const Baton__V1__ToolChoice *c = q->tool_choice;
    if (c && c->choice_case == BATON__V1__TOOL_CHOICE__CHOICE_MODE) {
        static const char *const modes[] = {NULL, "none", "auto", "required"};
        if ((unsigned)c->mode >= sizeof modes / sizeof *modes) {
            st = bt_fail(BT_ERR_INVALID, "'tool_choice.mode' %d is not a ToolChoiceMode", (int)c->mode);
            goto fail;
        }
        if (modes[c->mode] && !cJSON_AddStringToObject(b, "tool_choice", modes[c->mode])) goto nomem;
    } else if (c && c->choice_case == BATON__V1__TOOL_CHOICE__CHOICE_FUNCTION) {
        cJSON *o = cJSON_AddObjectToObject(b, "tool_choice"), *fn = o ? cJSON_AddObjectToObject(o, "function") : NULL;
        if (!fn || !cJSON_AddStringToObject(o, "type", "function") ||
            !cJSON_AddStringToObject(fn, "name", c->function))
            goto nomem;
    }
    if (q->parallel_tool_calls_opt_case &&
        !cJSON_AddBoolToObject(b, "parallel_tool_calls", q->parallel_tool_calls))
        goto nomem;
    *out = b;
    return BT_OK;
nomem:
    st = bt_fail(BT_ERR_NOMEM, "out of memory");
fail:
    cJSON_Delete(b);
    return st;
}

/* tools, tool_choice, parallel_tool_calls through rtr_tools_from_request, as /v1/chat/completions reads them: the
 * template sees the tools, a forced call becomes the request's grammar. After parse_response_format. */
static bt_status parse_tools(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g)
{
    const Baton__V1__ToolChoice *c = q->tool_choice;
    /* what asks for nothing (no tools; tool_choice unset, unspecified or none; parallel_tool_calls alone) is
     * accepted with any prompt, as over HTTP */
    int asks = q->n_tools ||
               (c && (c->choice_case == BATON__V1__TOOL_CHOICE__CHOICE_FUNCTION ||
                      (c->choice_case == BATON__V1__TOOL_CHOICE__CHOICE_MODE &&
                       c->mode != BATON__V1__TOOL_CHOICE_MODE__TOOL_CHOICE_NONE &&
                       c->mode != BATON__V1__TOOL_CHOICE_MODE__TOOL_CHOICE_UNSPECIFIED)));
    if (!asks) return BT_OK;
    if (q->prompt_case != BATON__V1__GENERATE_REQUEST__PROMPT_CHAT)
        return bt_fail(BT_ERR_INVALID, "'%s' needs a 'chat' prompt", q->n_tools ? "tools" : "tool_choice");
    cJSON *body = NULL;
    bt_status st = tools_body(q, &body);
    if (st) return st;
    const rtr_tool_env_t env = {.format = (rtr_tool_format)m->tool_format,
                                .tmpl_renders_tools = m->has_tmpl && m->tmpl_renders_tools,
                                .has_response_format = g->grammar != NULL, .chat = 1};
    char *grammar = NULL;
    st = rtr_tools_from_request(body, &env, &g->tools, &grammar);
    cJSON_Delete(body);
    if (st) return st == BT_ERR_NOMEM ? st : grpc_names(BT_ERR_INVALID);
    return grammar ? take_grammar(BT_OK, grammar, "tools", g) : BT_OK;
}

bt_status rtr_grpc_parse(const rtr_model_t *m, const Baton__V1__GenerateRequest *q, rtr_gen_t *g)
{
    memset(g, 0, sizeof *g);
    g->api = RTR_API_GRPC;
    g->n = q->n ? (int)q->n : 1;
    bt_status st;
    if (q->n > RTR_MAX_N) {
        st = bt_fail(BT_ERR_INVALID, "'n' must be at most %d", RTR_MAX_N);
        goto fail;
    }
    if (q->response_format && (st = parse_response_format(q->response_format, g))) goto fail;
    if ((st = parse_tools(m, q, g))) goto fail;
    if ((st = parse_prompt(m, q, g)) || (st = parse_length(m, q, g)) || (st = parse_stops(m, q, g))) goto fail;
    if (q->top_logprobs > RTR_MAX_TOP_LOGPROBS) {
        st = bt_fail(BT_ERR_INVALID, "'top_logprobs' must be at most %d", RTR_MAX_TOP_LOGPROBS);
        goto fail;
    }
    g->logprobs = q->logprobs || q->top_logprobs;
    g->top_logprobs = (int)q->top_logprobs;
    g->ignore_eos = q->ignore_eos;
    g->no_spec = q->disable_speculation;
    if ((st = copy_request_id(q->request_id, g))) goto fail;
    if (q->sampling && (st = parse_sampling(m, q->sampling, g))) goto fail;
    return BT_OK;
fail:
    rtr_gen_free(g);
    return st;
}

/* Refuses a parsed request that may not start now: frees it, counts it under status and answers the call. */
static void refuse(rtr_t *r, rtr_gen_t *g, bt_rpc_call_t *call, const char *status, bt_rpc_code code, const char *msg)
{
    rtr_gen_free(g);
    rtr_count_request(r, status);
    bt_rpc_call_finish(call, code, msg);
}

/* Admission for a parsed request: the in-flight bound, a healthy decode node, the TTFT SLO. 1 to go on; else the
 * call is answered and counted. */
static int admit(rtr_t *r, rtr_gen_t *g, bt_rpc_call_t *call)
{
    char msg[200];
    int retry;
    if (!rtr_ready(r)) {
        refuse(r, g, call, "unavailable", BT_RPC_UNAVAILABLE, rtr_not_ready_reason(r));
        return 0;
    }
    if (!rtr_slo_admit(r, g, msg, sizeof msg)) {
        refuse(r, g, call, "overloaded", BT_RPC_RESOURCE_EXHAUSTED, msg);
        return 0;
    }
    if (!rtr_admit_gen(r, g, &g->adm, msg, sizeof msg, &retry)) {
        refuse(r, g, call, "overloaded", BT_RPC_RESOURCE_EXHAUSTED, msg);
        return 0;
    }
    return 1;
}

/* Before any parsing: the in-flight and predicted-time bounds for one small request. 1 to go on. */
static int admit_quick(rtr_t *r, bt_rpc_call_t *call)
{
    char msg[200];
    int retry;
    if (rtr_admit_quick(r, msg, sizeof msg, &retry)) return 1;
    rtr_count_request(r, "overloaded");
    bt_rpc_call_finish(call, BT_RPC_RESOURCE_EXHAUSTED, msg);
    return 0;
}

/* Generation/Generate: authorise, parse, admit, start the job (which answers the call). */
static void generate(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    rtr_t *r = ud;
    const Baton__V1__GenerateRequest *q = (const Baton__V1__GenerateRequest *)msg;
    if (!check_auth(r, call) || !check_model(r, call, q->model)) {
        rtr_count_request(r, "client_error");
        return;
    }
    if (!admit_quick(r, call)) return;
    rtr_gen_t g;
    bt_status st = rtr_grpc_parse(&r->model, q, &g);
    if (st) {
        rtr_count_request(r, st == BT_ERR_NOMEM ? "server_error" : "client_error");
        bt_rpc_call_finish(call, st == BT_ERR_NOMEM ? BT_RPC_RESOURCE_EXHAUSTED : BT_RPC_INVALID_ARGUMENT,
                           bt_last_error());
        return;
    }
    if (!admit(r, &g, call)) return;
    if ((st = rtr_job_start_grpc(r, &g, call))) {
        rtr_count_request(r, "server_error");
        bt_rpc_call_finish_status(call, st);
    }
}

bt_status rtr_grpc_tokenize(const rtr_model_t *m, const Baton__V1__TokenizeRequest *q, tok_ids *ids)
{
    if (q->input_case == BATON__V1__TOKENIZE_REQUEST__INPUT_CHAT) return to_ids(m, NULL, q->chat, NULL, 0, ids);
    return to_ids(m, q->input_case == BATON__V1__TOKENIZE_REQUEST__INPUT_TEXT ? q->text : "", NULL, NULL,
                  q->add_special_tokens ? TOK_ADD_SPECIAL : 0, ids);
}

bt_status rtr_grpc_detokenize(const rtr_model_t *m, const Baton__V1__DetokenizeRequest *q, char **text)
{
    size_t max_ids = rtr_prompt_max_bytes(m) / 4; /* decoded text up to about the prompt bound */
    if (q->n_token_ids > max_ids)
        return bt_fail(BT_ERR_INVALID, "'token_ids' holds %zu ids; at most %zu per call", q->n_token_ids, max_ids);
    char *s = NULL;
    size_t len = 0;
    bt_status st = tok_decode(m->tok, q->token_ids, q->n_token_ids, q->skip_special_tokens ? TOK_SKIP_SPECIAL : 0,
                              &s, &len);
    if (st) return st;
    *text = rtr_utf8_sanitize(s, len);
    free(s);
    return *text ? BT_OK : bt_fail(BT_ERR_NOMEM, "out of memory");
}

static void tokenize(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    rtr_t *r = ud;
    const Baton__V1__TokenizeRequest *q = (const Baton__V1__TokenizeRequest *)msg;
    if (!check_auth(r, call) || !check_model(r, call, q->model) || !admit_quick(r, call)) return;
    tok_ids ids = {0};
    bt_status st = rtr_grpc_tokenize(&r->model, q, &ids);
    if (st) {
        tok_ids_free(&ids);
        bt_rpc_call_finish(call, st == BT_ERR_NOMEM ? BT_RPC_RESOURCE_EXHAUSTED : BT_RPC_INVALID_ARGUMENT,
                           bt_last_error());
        return;
    }
    Baton__V1__TokenizeResponse resp = BATON__V1__TOKENIZE_RESPONSE__INIT;
    resp.token_ids = ids.ids;
    resp.n_token_ids = ids.n;
    resp.max_context = (uint32_t)r->model.n_ctx;
    st = bt_rpc_call_send(call, &resp.base);
    tok_ids_free(&ids);
    bt_rpc_call_finish_status(call, st);
}

static void detokenize(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    rtr_t *r = ud;
    const Baton__V1__DetokenizeRequest *q = (const Baton__V1__DetokenizeRequest *)msg;
    if (!check_auth(r, call) || !check_model(r, call, q->model) || !admit_quick(r, call)) return;
    char *clean = NULL;
    bt_status st = rtr_grpc_detokenize(&r->model, q, &clean);
    if (st) {
        bt_rpc_call_finish(call, st == BT_ERR_NOMEM ? BT_RPC_RESOURCE_EXHAUSTED : BT_RPC_INVALID_ARGUMENT,
                           bt_last_error());
        return;
    }
    Baton__V1__DetokenizeResponse resp = BATON__V1__DETOKENIZE_RESPONSE__INIT;
    resp.text = clean ? clean : "";
    st = bt_rpc_call_send(call, &resp.base);
    free(clean);
    bt_rpc_call_finish_status(call, st);
}

/* Generation/Embed: authorise, parse, then the embeddings job (router/embeddings.c) answers the call. */
static void embed(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    rtr_t *r = ud;
    const Baton__V1__EmbedRequest *q = (const Baton__V1__EmbedRequest *)msg;
    if (!check_auth(r, call) || !check_model(r, call, q->model)) {
        rtr_count_request(r, "client_error");
        return;
    }
    if (!admit_quick(r, call)) return;
    if (!rtr_ready(r)) {
        rtr_count_request(r, "unavailable");
        bt_rpc_call_finish(call, BT_RPC_UNAVAILABLE, rtr_not_ready_reason(r));
        return;
    }
    rtr_embed_req_t e;
    bt_status st = rtr_embed_from_grpc(&r->model, q, &e);
    if (st) {
        rtr_embed_req_free(&e);
        rtr_count_request(r, st == BT_ERR_NOMEM ? "server_error" : "client_error");
        bt_rpc_call_finish(call, st == BT_ERR_NOMEM ? BT_RPC_RESOURCE_EXHAUSTED : BT_RPC_INVALID_ARGUMENT,
                           bt_last_error());
        return;
    }
    rtr_embed_start_grpc(r, &e, call);
}

static void list_models(void *ud, bt_rpc_call_t *call, const ProtobufCMessage *msg)
{
    (void)msg;
    rtr_t *r = ud;
    if (!check_auth(r, call)) return;
    Baton__V1__ModelInfo mi = BATON__V1__MODEL_INFO__INIT;
    mi.id = r->model.name;
    mi.fingerprint = r->model.fingerprint;
    mi.context_length = (uint32_t)r->model.n_ctx;
    mi.created = r->model.created;
    mi.owned_by = "baton";
    Baton__V1__ModelInfo *list[1] = {&mi};
    Baton__V1__ListModelsResponse resp = BATON__V1__LIST_MODELS_RESPONSE__INIT;
    resp.models = list;
    resp.n_models = 1;
    bt_status st = bt_rpc_call_send(call, &resp.base);
    bt_rpc_call_finish_status(call, st);
}

bt_status rtr_grpc_register(rtr_t *r, bt_rpc_server_t *s)
{
    bt_status st;
    if ((st = bt_rpc_server_add_method(s, "/baton.v1.Generation/Generate", BT_RPC_SERVER_STREAMING,
                                       &baton__v1__generate_request__descriptor, generate, r)))
        return st;
    if ((st = bt_rpc_server_add_method(s, "/baton.v1.Generation/Tokenize", BT_RPC_UNARY,
                                       &baton__v1__tokenize_request__descriptor, tokenize, r)))
        return st;
    if ((st = bt_rpc_server_add_method(s, "/baton.v1.Generation/Detokenize", BT_RPC_UNARY,
                                       &baton__v1__detokenize_request__descriptor, detokenize, r)))
        return st;
    if ((st = bt_rpc_server_add_method(s, "/baton.v1.Generation/Embed", BT_RPC_UNARY,
                                       &baton__v1__embed_request__descriptor, embed, r)))
        return st;
    return bt_rpc_server_add_method(s, "/baton.v1.Generation/ListModels", BT_RPC_UNARY,
                                    &baton__v1__list_models_request__descriptor, list_models, r);
}
