/* Tool calling (issue 23 item 4): the request's tools and tool_choice, the grammar that forces a call, and the
 * parser that finds calls in a model's output, for the call syntaxes of real chat templates:
 *
 *   hermes   <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>, possibly several (Hermes 2/3, Qwen 2.5,
 *            Qwen 3; any template that spells <tool_call>)
 *   llama3   {"name": N, "parameters": {...}} as the whole answer, or after <|python_tag|>; several separated by ';'
 *            (Llama 3.1/3.2/3.3 JSON tool calling)
 *   mistral  [TOOL_CALLS][{"name": N, "arguments": {...}}, ...] (Mistral 7B v0.3, Nemo), or
 *            [TOOL_CALLS]N[ARGS]{...} repeated (Mistral Small 3.2, Ministral 3, Devstral: "mistral-args"); the
 *            parser reads both forms, the grammar writes the template's.
 *
 * Model output is untrusted: every scan is linear, JSON nesting is bounded (RTR_TOOL_MAX_DEPTH) before cJSON sees
 * it, and at most RTR_TOOL_MAX_CALLS calls are taken. A call counts only when it is complete, names a tool of the
 * request and has an object for arguments; anything else leaves the output plain content. Pure functions and
 * per-choice state: no globals, thread-safe. */
#ifndef BATON_ROUTER_TOOL_CALLS_H
#define BATON_ROUTER_TOOL_CALLS_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "common/status.h"

#define RTR_TOOL_MAX_TOOLS 128  /* tools per request (OpenAI's limit) */
#define RTR_TOOL_MAX_CALLS 64   /* calls taken from one output */
#define RTR_TOOL_MAX_DEPTH 64   /* JSON nesting in a call */
#define RTR_TOOL_MAX_NAME 64    /* bytes of a function name: [A-Za-z0-9_-] (OpenAI's rule) */

typedef enum rtr_tool_format {
    RTR_TOOL_FMT_NONE = 0,
    RTR_TOOL_FMT_HERMES,
    RTR_TOOL_FMT_LLAMA3,
    RTR_TOOL_FMT_MISTRAL,      /* [TOOL_CALLS][{...}, ...] */
    RTR_TOOL_FMT_MISTRAL_ARGS, /* [TOOL_CALLS]name[ARGS]{...} */
} rtr_tool_format;

typedef enum rtr_tool_choice {
    RTR_TOOL_CHOICE_NONE = 0, /* no tools, or tool_choice "none": no parsing */
    RTR_TOOL_CHOICE_AUTO,     /* free generation, then parsing */
    RTR_TOOL_CHOICE_REQUIRED, /* a grammar forces one call or more */
    RTR_TOOL_CHOICE_NAMED,    /* a grammar forces a call of one function */
} rtr_tool_choice;

/* "hermes", "llama3", "mistral", "mistral-args", "none". */
const char *rtr_tool_format_name(rtr_tool_format f);

/* The format of a chat template from the call syntax its text spells ("<tool_call>", "<|python_tag|>" or the
 * llama3 "parameters" instruction, "[TOOL_CALLS]" with or without "[ARGS]"); RTR_TOOL_FMT_NONE when none. Pure. */
rtr_tool_format rtr_tool_format_detect(const char *tmpl, size_t len);

/* The --tool-call-parser flag: "auto" (detect from tmpl, which may be NULL), or a format name ("mistral" becomes
 * mistral-args when tmpl spells [ARGS]). BT_ERR_INVALID naming the accepted values. */
bt_status rtr_tool_format_choose(const char *flag, const char *tmpl, size_t len, rtr_tool_format *out);

/* A request's tools as the router keeps them (owned by rtr_gen_t; free with rtr_tools_free). */
typedef struct rtr_tools {
    rtr_tool_format format;
    rtr_tool_choice choice;
    int parallel;     /* parallel_tool_calls (default 1): 0 keeps at most one call */
    char **names;     /* [n_names] function names, distinct */
    size_t n_names;
    int named;        /* RTR_TOOL_CHOICE_NAMED: index into names */
    char *tools_json; /* the tools as the chat template sees them (JSON array), NULL when the template sees none */
} rtr_tools_t;

void rtr_tools_free(rtr_tools_t *t);

/* What the template and the parser can do, from the served model (rtr_model_t). */
typedef struct rtr_tool_env {
    rtr_tool_format format;   /* the parser in use (--tool-call-parser, or detected) */
    int tmpl_renders_tools;   /* the template's text refers to tools */
    int has_response_format;  /* the request constrains its output otherwise (response_format other than text) */
    int chat;                 /* /v1/chat/completions (tools are refused elsewhere) */
} rtr_tool_env_t;

/* Reads tools, tool_choice and parallel_tool_calls from an OpenAI request body. *out is NULL when the request asks
 * for no tool calling (no tools, or tools: []), else the tools (choice NONE for tool_choice "none": the template
 * still sees them). For REQUIRED and NAMED *grammar receives the grammar that forces the call (caller frees), else
 * NULL (a named function: exactly one call of it; required: one or more unless parallel_tool_calls is false). With
 * auto a tool with strict: true also gets a grammar: text or calls whose arguments match the strict tools' schemas.
 * Client errors are BT_ERR_INVALID or BT_ERR_UNSUPPORTED naming the field (the caller answers 400): a malformed
 * tool, a duplicate name, a named tool_choice naming no tool, tool_choice without tools, tools on completions, a
 * template that does not render tools or no call format, a parameters schema that json_schema.c does not support
 * (when a grammar is made), response_format together with tool calling. BT_ERR_NOMEM.
 * Outputs set only on success. */
bt_status rtr_tools_from_request(const cJSON *body, const rtr_tool_env_t *env, rtr_tools_t **out, char **grammar);

/* The grammar that makes an output one call (or, when parallel, one or more) of tools[i] in fmt, with
 * params[i] as the schema of the arguments (NULL: any object); named >= 0 allows only that tool. with_text also
 * allows text in which rtr_tool_parse finds no call (strict tools under tool_choice auto), before the calls for
 * hermes and mistral. BT_ERR_UNSUPPORTED naming the tool for a schema json_schema.c does not support (or a $ref
 * cycle that matches nothing before it recurs), BT_ERR_INVALID for a malformed one, BT_ERR_NOMEM. */
bt_status rtr_tools_grammar(rtr_tool_format fmt, const char *const *names, const cJSON *const *params, size_t n,
                            int named, int parallel, int with_text, char **out);

/* A message's tool_calls (assistant, OpenAI shape) checked and turned into what templates read: each call's
 * function.arguments (a JSON string) becomes the object it encodes, as Hugging Face templates expect (Qwen 2.5
 * applies tojson to it). *out is a new array (caller deletes). BT_ERR_INVALID naming messages[idx]..., BT_ERR_NOMEM. */
bt_status rtr_tools_message_calls(const cJSON *calls, int idx, cJSON **out);

/* One parsed call. */
typedef struct rtr_tool_call {
    char *name;
    char *arguments; /* JSON text of an object */
} rtr_tool_call_t;

typedef struct rtr_tool_result {
    char *content;          /* text before the first call; NULL when it is empty or only whitespace */
    size_t content_len;     /* its bytes (model text may hold a NUL) */
    rtr_tool_call_t *calls; /* [n_calls] */
    size_t n_calls;
} rtr_tool_result_t;

void rtr_tool_result_free(rtr_tool_result_t *r);

/* Parses a whole output. Returns 1 with *r filled when it holds well-formed calls (at most one when !t->parallel:
 * the first), 0 when it does not (plain content; *r zeroed), BT_ERR_NOMEM. */
int rtr_tool_parse(const rtr_tools_t *t, const char *text, size_t len, rtr_tool_result_t *r);

/* A call id: "call_" and 24 random alphanumerics, or 9 for the Mistral formats (their templates demand exactly 9).
 * cap >= 32. Can't fail. */
void rtr_tool_call_id(rtr_tool_format f, char *out, size_t cap);

/* Streaming: text is released as content until a call may start; from there everything is held until the end,
 * when it is parsed (calls) or released (content). Trailing whitespace and what could be the start of a call
 * marker are held back, so content never ends in the marker's first bytes. */
typedef struct rtr_tool_stream {
    const rtr_tools_t *t; /* borrowed */
    char *held;           /* text not released yet */
    size_t n_held, cap_held;
    char *rel;            /* what the last push released */
    size_t cap_rel;
    int in_call;          /* a call started: held from its marker to the end */
    int released_any;     /* non-whitespace content was released (a llama3 call must open the answer) */
    int oom;
} rtr_tool_stream_t;

void rtr_tool_stream_init(rtr_tool_stream_t *s, const rtr_tools_t *t);
void rtr_tool_stream_free(rtr_tool_stream_t *s);
/* Feeds text; *out and *out_len: content to release now (points into s, valid until the next call). */
void rtr_tool_stream_push(rtr_tool_stream_t *s, const char *text, size_t len, const char **out, size_t *out_len);
/* The end: returns 1 with *r filled (r->content: held text before the calls, usually NULL: a llama3 answer that
 * opens with '{' and holds <|python_tag|> later), 0 with *out and *out_len the held text to release as content,
 * BT_ERR_NOMEM. What was released plus r->content equals rtr_tool_parse's content of the whole text. */
int rtr_tool_stream_finish(rtr_tool_stream_t *s, rtr_tool_result_t *r, const char **out, size_t *out_len);

#endif
