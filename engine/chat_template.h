/* Chat templates. By default a GGUF's tokenizer.chat_template is rendered by the Jinja interpreter (engine/jinja.h)
 * exactly as Hugging Face apply_chat_template renders it. A template that does not parse falls back to one of five
 * built-in renderers, recognised by the template's distinctive markers; they reproduce their reference templates
 * byte for byte (both are checked against HF in tests/integration/test_chat_template_hf.py):
 *
 *   chatml   <|im_start|>role\ncontent<|im_end|>\n ... ; generation prompt <|im_start|>assistant\n.
 *            A default system prompt written as a literal in the template (SmolLM2, Qwen2.5) is inserted when
 *            the first message is not a system message.
 *   llama3   bos <|start_header_id|>role<|end_header_id|>\n\n content|trim <|eot_id|> ... (Llama 3.0 form;
 *            templates with 3.1 tool/date preambles are not recognised).
 *   mistral  bos [INST] user [/INST]assistant eos ... (the v1 form of Mistral-7B-Instruct v0.1/v0.2; templates of
 *            the later v3/tekken/v7 forms, without the spaces around the content, are not recognised); roles must
 *            alternate user/assistant; a leading system message is prepended to the first user message followed
 *            by a blank line.
 *   gemma    bos <start_of_turn>user|model\n content|trim <end_of_turn>\n ...; generation prompt
 *            <start_of_turn>model\n; roles alternate; a leading system message prefixes the first user turn.
 *   zephyr   <|role|>\n content eos \n ...; generation prompt <|assistant|>\n.
 *
 * An override (the CLI's --chat-template) is "builtin:NAME" or a bare NAME for a built-in renderer, or a FILE whose
 * Jinja text is rendered by the interpreter (no fallback). Messages may carry further fields (tool_calls,
 * tool_call_id, name, ...) and a request may carry tools: the interpreter passes them to the template as plain data;
 * the built-in renderers ignore them. Rendering allocates; everything else is pure. No globals; thread-safe. */
#ifndef BATON_ENGINE_CHAT_TEMPLATE_H
#define BATON_ENGINE_CHAT_TEMPLATE_H

#include <stddef.h>

#include "common/status.h"
#include "engine/gguf.h"
#include "engine/jinja.h"

typedef enum chat_tmpl_kind {
    CHAT_TMPL_CHATML = 0,
    CHAT_TMPL_LLAMA3,
    CHAT_TMPL_MISTRAL,
    CHAT_TMPL_GEMMA,
    CHAT_TMPL_ZEPHYR,
    CHAT_TMPL_COUNT, /* the number of built-in renderers */
    CHAT_TMPL_JINJA = 100, /* the template's own text, by the interpreter */
} chat_tmpl_kind;

/* One message. role is NUL-terminated ("system", "user", "assistant", ...); content is content_len bytes (NULL:
 * the message has no content, which a Jinja template sees as none). extra_json, when not NULL, is a JSON object of
 * further fields (tool_calls, tool_call_id, name, ...) that a Jinja template sees in the message beside role and
 * content; the built-in renderers ignore it. */
typedef struct chat_msg {
    const char *role;
    const char *content;
    size_t content_len;
    const char *extra_json;
} chat_msg;

/* A template ready to render. Fields are owned (malloc'd); free with chat_tmpl_free. */
typedef struct chat_tmpl {
    chat_tmpl_kind kind;
    char *bos;            /* bos_token text ("" when the model has none) */
    char *eos;            /* eos_token text */
    char *default_system; /* chatml only: inserted when messages[0] is not a system message; NULL when none */
    jinja_tmpl *jinja;    /* CHAT_TMPL_JINJA only */
    char why[320];        /* which renderer was chosen and why: one line for the log */
} chat_tmpl;

/* What a render takes besides the messages. */
typedef struct chat_render_opts {
    int add_generation_prompt;
    const char *tools_json; /* a JSON array of tool definitions (Jinja only), or NULL: the template sees none */
    int64_t now;            /* the Unix time strftime_now formats; 0: now */
} chat_render_opts;

/* "chatml", "llama3", ..., "jinja"; "?" for an out-of-range kind. */
const char *chat_tmpl_name(chat_tmpl_kind k);

/* Kind named name. BT_ERR_NOT_FOUND (message lists the names) when unknown. */
bt_status chat_tmpl_kind_from_name(const char *name, chat_tmpl_kind *out);

/* Recognises a template's family from its text. BT_ERR_UNSUPPORTED, quoting the template's start, when none
 * matches; BT_ERR_INVALID for an empty text. */
bt_status chat_tmpl_detect(const char *text, size_t len, chat_tmpl_kind *out);

/* Prepares a template. When override_name is non-NULL ("builtin:NAME" or NAME) it selects a built-in renderer (text
 * may then be NULL; a chatml default system prompt is still taken from text when present); otherwise text is parsed
 * by the Jinja interpreter and, when it does not parse, its family is detected for a built-in renderer (t->why says
 * which and why). bos/eos may be NULL (empty). Errors: BT_ERR_UNSUPPORTED when text neither parses nor is
 * recognised (both reasons in the message), as chat_tmpl_kind_from_name, BT_ERR_NOMEM. *t is set only on success. */
bt_status chat_tmpl_init(chat_tmpl *t, const char *text, size_t len, const char *override_name, const char *bos,
                         const char *eos);

/* Prepares text for the Jinja interpreter only (a --chat-template FILE): no fallback. Errors: BT_ERR_FORMAT with the
 * line:col of the syntax error, BT_ERR_NOMEM. *t is set only on success. */
bt_status chat_tmpl_init_jinja(chat_tmpl *t, const char *text, size_t len, const char *bos, const char *eos);

/* Same as chat_tmpl_init, with text, bos and eos from the GGUF's tokenizer.chat_template and tokenizer.ggml.* keys.
 * override may also name a FILE of Jinja text (chat_tmpl_init_jinja; BT_ERR_NOT_FOUND or BT_ERR_IO when it cannot
 * be read).
 * A Gemma-family file (general.architecture gemma*) without a template gets the built-in gemma renderer.
 * BT_ERR_NOT_FOUND when any other file has no chat template and no override is given. */
bt_status chat_tmpl_init_gguf(chat_tmpl *t, const gguf_file *f, const char *override);

void chat_tmpl_free(chat_tmpl *t);

/* Renders msgs[0..n) into a malloc'd NUL-terminated string (*out, length *out_len; caller frees).
 * add_generation_prompt appends the assistant header where the family has one.
 * Errors: BT_ERR_INVALID (roles that the family's template rejects, e.g. not alternating, with the reason),
 * BT_ERR_NOMEM. */
bt_status chat_tmpl_render(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                           char **out, size_t *out_len);

/* Same, with tools and the time for strftime_now. A Jinja template's errors (raise_exception, a type error, a
 * limit) are BT_ERR_INVALID with the template's line:col; a malformed extra_json or tools_json is BT_ERR_INVALID. */
bt_status chat_tmpl_render_opts(const chat_tmpl *t, const chat_msg *msgs, size_t n, const chat_render_opts *o,
                                char **out, size_t *out_len);

#endif
