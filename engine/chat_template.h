/* Chat templates rendered natively (no Jinja): a GGUF's tokenizer.chat_template is recognised as one of the
 * common families by its distinctive markers and rendered by C code that reproduces the reference template's
 * output byte for byte (checked against Hugging Face apply_chat_template in tests/integration).
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
 * An unrecognised template is an error that quotes its beginning; a name (the CLI's --chat-template) overrides
 * detection. Rendering allocates; everything else is pure. No globals; thread-safe. */
#ifndef BATON_ENGINE_CHAT_TEMPLATE_H
#define BATON_ENGINE_CHAT_TEMPLATE_H

#include <stddef.h>

#include "common/status.h"
#include "engine/gguf.h"

typedef enum chat_tmpl_kind {
    CHAT_TMPL_CHATML = 0,
    CHAT_TMPL_LLAMA3,
    CHAT_TMPL_MISTRAL,
    CHAT_TMPL_GEMMA,
    CHAT_TMPL_ZEPHYR,
    CHAT_TMPL_COUNT
} chat_tmpl_kind;

/* One message. role is NUL-terminated ("system", "user", "assistant", ...); content is content_len bytes. */
typedef struct chat_msg {
    const char *role;
    const char *content;
    size_t content_len;
} chat_msg;

/* A template ready to render. Fields are owned (malloc'd); free with chat_tmpl_free. */
typedef struct chat_tmpl {
    chat_tmpl_kind kind;
    char *bos;            /* bos_token text ("" when the model has none) */
    char *eos;            /* eos_token text */
    char *default_system; /* chatml only: inserted when messages[0] is not a system message; NULL when none */
} chat_tmpl;

/* "chatml", "llama3", ...; "?" for an out-of-range kind. */
const char *chat_tmpl_name(chat_tmpl_kind k);

/* Kind named name. BT_ERR_NOT_FOUND (message lists the names) when unknown. */
bt_status chat_tmpl_kind_from_name(const char *name, chat_tmpl_kind *out);

/* Recognises a template's family from its text. BT_ERR_UNSUPPORTED, quoting the template's start, when none
 * matches; BT_ERR_INVALID for an empty text. */
bt_status chat_tmpl_detect(const char *text, size_t len, chat_tmpl_kind *out);

/* Prepares a template. When override_name is non-NULL it selects the family (text may then be NULL; a chatml
 * default system prompt is still taken from text when present); otherwise the family is detected from text.
 * bos/eos may be NULL (empty). Errors as chat_tmpl_detect / chat_tmpl_kind_from_name, BT_ERR_NOMEM.
 * *t is set only on success. */
bt_status chat_tmpl_init(chat_tmpl *t, const char *text, size_t len, const char *override_name, const char *bos,
                         const char *eos);

/* Same, with text, bos and eos from the GGUF's tokenizer.chat_template and tokenizer.ggml.* keys.
 * BT_ERR_NOT_FOUND when the file has no chat template and no override is given. */
bt_status chat_tmpl_init_gguf(chat_tmpl *t, const gguf_file *f, const char *override_name);

void chat_tmpl_free(chat_tmpl *t);

/* Renders msgs[0..n) into a malloc'd NUL-terminated string (*out, length *out_len; caller frees).
 * add_generation_prompt appends the assistant header where the family has one.
 * Errors: BT_ERR_INVALID (roles that the family's template rejects, e.g. not alternating, with the reason),
 * BT_ERR_NOMEM. */
bt_status chat_tmpl_render(const chat_tmpl *t, const chat_msg *msgs, size_t n, int add_generation_prompt,
                           char **out, size_t *out_len);

#endif
