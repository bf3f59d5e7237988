/* engine/chat_template: detection of each family from template text, rendering, overrides and errors.
 * Byte-for-byte agreement with Jinja (HF apply_chat_template) is tests/integration/test_chat_template_hf.py. */
#include <stdlib.h>
#include <string.h>

#include "engine/chat_template.h"
#include "engine/gguf.h"
#include "test_util.h"

static const char SMOLLM[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou "
    "are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";
static const char CHATML_PLAIN[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
static const char LLAMA3[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}";
static const char MISTRAL[] = "{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] + "
                              "' [/INST]' }}{% endfor %}";
static const char GEMMA[] = "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + "
                            "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}";
static const char ZEPHYR[] = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + "
                             "message['content'] + eos_token }}\n{% endif %}{{ '<|assistant|>' }}{% endfor %}";
static const char PHI3[] = "{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + "
                           "message['content'] + '<|end|>\\n' }}{% endfor %}<|user|><|assistant|>";
static const char LLAMA2[] = "{% if messages[0]['role'] == 'system' %}<<SYS>>\\n{% endif %}[INST] [/INST]";

static void test_detect(void)
{
    const struct {
        const char *text;
        chat_tmpl_kind kind;
    } cases[] = {{SMOLLM, CHAT_TMPL_CHATML}, {CHATML_PLAIN, CHAT_TMPL_CHATML}, {LLAMA3, CHAT_TMPL_LLAMA3},
                 {MISTRAL, CHAT_TMPL_MISTRAL}, {GEMMA, CHAT_TMPL_GEMMA},        {ZEPHYR, CHAT_TMPL_ZEPHYR}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        chat_tmpl_kind k = CHAT_TMPL_COUNT;
        CHECK_MSG(chat_tmpl_detect(cases[i].text, strlen(cases[i].text), &k) == BT_OK && k == cases[i].kind,
                  "case %zu: %s", i, chat_tmpl_name(k));
    }
    chat_tmpl_kind k;
    CHECK(chat_tmpl_detect(PHI3, strlen(PHI3), &k) == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "not recognised") && strstr(bt_last_error(), "{% for message"));
    CHECK(chat_tmpl_detect(LLAMA2, strlen(LLAMA2), &k) == BT_ERR_UNSUPPORTED);
    const char mistral_v3[] = "{{ '[INST] ' + message['content'] + '[/INST]' }}{{ ' ' + message['content'] }}";
    CHECK(chat_tmpl_detect(mistral_v3, strlen(mistral_v3), &k) == BT_ERR_UNSUPPORTED);
    CHECK(chat_tmpl_detect("", 0, &k) == BT_ERR_INVALID);
    const char odd[] = "line one\nline two";
    CHECK(chat_tmpl_detect(odd, strlen(odd), &k) == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "line one\\nline two") != NULL); /* one line, quoting the template */

    for (int i = 0; i < CHAT_TMPL_COUNT; i++) {
        CHECK(chat_tmpl_kind_from_name(chat_tmpl_name((chat_tmpl_kind)i), &k) == BT_OK && k == (chat_tmpl_kind)i);
    }
    CHECK(chat_tmpl_kind_from_name("vicuna", &k) == BT_ERR_NOT_FOUND && strstr(bt_last_error(), "vicuna"));
    CHECK(!strcmp(chat_tmpl_name(CHAT_TMPL_COUNT), "?"));
}

static char *render(const chat_tmpl *t, const chat_msg *m, size_t n, int gen)
{
    char *out = NULL;
    size_t len;
    if (chat_tmpl_render(t, m, n, gen, &out, &len) != BT_OK) return NULL;
    if (strlen(out) != len) {
        free(out);
        return NULL;
    }
    return out;
}

#define EXPECT_RENDER(t, msgs, n, gen, want)                                                  \
    do {                                                                                      \
        char *got_ = render(t, msgs, n, gen);                                                 \
        CHECK_MSG(got_ && !strcmp(got_, want), "got \"%s\"", got_ ? got_ : bt_last_error());  \
        free(got_);                                                                           \
    } while (0)

static const chat_msg CONV[] = {
    {"user", "Hi", 2, NULL},
    {"assistant", " Hello! ", 8, NULL},
    {"user", "\n2+2?\n", 6, NULL},
};
static const chat_msg CONV_SYS[] = {
    {"system", "Be brief.", 9, NULL},
    {"user", "Hi", 2, NULL},
};

/* The same template through the interpreter (the default) and through the built-in renderer (an override). */
static void test_chatml(void)
{
    static const char *const overrides[] = {NULL, "builtin:chatml"};
    for (int i = 0; i < 2; i++) {
        chat_tmpl t;
        REQUIRE(chat_tmpl_init(&t, SMOLLM, strlen(SMOLLM), overrides[i], "<|im_start|>", "<|im_end|>") == BT_OK);
        if (i == 0) {
            CHECK(t.kind == CHAT_TMPL_JINJA && t.jinja && strstr(t.why, "Jinja"));
        } else {
            CHECK(t.kind == CHAT_TMPL_CHATML && t.default_system &&
                  !strcmp(t.default_system, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"));
        }
        EXPECT_RENDER(&t, CONV, 1, 1,
                      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                      "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        EXPECT_RENDER(&t, CONV_SYS, 2, 0,
                      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
        chat_tmpl_free(&t);

        REQUIRE(chat_tmpl_init(&t, CHATML_PLAIN, strlen(CHATML_PLAIN), overrides[i], NULL, NULL) == BT_OK);
        CHECK(t.default_system == NULL);
        EXPECT_RENDER(&t, CONV, 2, 0,
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n Hello! <|im_end|>\n");
        EXPECT_RENDER(&t, CONV, 0, 1, "<|im_start|>assistant\n");
        chat_tmpl_free(&t);
    }
}

/* A template that does not parse falls back to the built-in family its markers name, saying why; one that neither
 * parses nor is recognised gives both reasons. Extra message fields and tools reach a Jinja template. */
static void test_jinja_fallback_and_data(void)
{
    chat_tmpl t;
    static const char broken[] = "{% for m in messages %}<|im_start|>{{ m.role }\n{% endfor %}";
    REQUIRE(chat_tmpl_init(&t, broken, strlen(broken), NULL, NULL, NULL) == BT_OK);
    CHECK(t.kind == CHAT_TMPL_CHATML && strstr(t.why, "does not parse (line 1:"));
    chat_tmpl_free(&t);
    static const char odd[] = "{% for m in messages %}### {{ m.role }\n{% endfor %}";
    CHECK(chat_tmpl_init(&t, odd, strlen(odd), NULL, NULL, NULL) == BT_ERR_UNSUPPORTED);
    CHECK(strstr(bt_last_error(), "does not parse") && strstr(bt_last_error(), "not recognised"));
    CHECK(chat_tmpl_init_jinja(&t, odd, strlen(odd), NULL, NULL) == BT_ERR_FORMAT);
    CHECK(strstr(bt_last_error(), "line 1:") != NULL);

    static const char calls[] = "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                                "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
                                "{% if m.content is none %}(none){% endif %}|{% endfor %}"
                                "{{ tools | map(attribute='name') | join(',') }}{{ strftime_now('%Y') }}";
    REQUIRE(chat_tmpl_init_jinja(&t, calls, strlen(calls), "<s>", "</s>") == BT_OK);
    chat_msg msgs[] = {{"user", "hi", 2, NULL},
                       {"assistant", NULL, 0, "{\"tool_calls\": [{\"name\": \"f\"}], \"role\": \"ignored\"}"},
                       {"tool", "ok", 2, "{\"tool_call_id\": \"1\"}"}};
    chat_render_opts o = {.add_generation_prompt = 1, .tools_json = "[{\"name\": \"f\"}, {\"name\": \"g\"}]",
                          .now = 1721995200};
    char *out = NULL;
    size_t len = 0;
    REQUIRE(chat_tmpl_render_opts(&t, msgs, 3, &o, &out, &len) == BT_OK);
    CHECK_MSG(!strcmp(out, "user:hi|assistant:None[{\"name\": \"f\"}](none)|tool:ok|f,g2024"), "got %s", out);
    free(out);
    chat_msg bad[] = {{"user", "hi", 2, "[1]"}};
    CHECK(chat_tmpl_render_opts(&t, bad, 1, &o, &out, &len) == BT_ERR_INVALID);
    chat_tmpl_free(&t);
}

static void test_other_families(void)
{
    chat_tmpl t;
    REQUIRE(chat_tmpl_init(&t, NULL, 0, "llama3", "<|begin_of_text|>", "<|eot_id|>") == BT_OK);
    EXPECT_RENDER(&t, CONV, 3, 1,
                  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
    chat_tmpl_free(&t);

    REQUIRE(chat_tmpl_init(&t, NULL, 0, "mistral", "<s>", "</s>") == BT_OK);
    EXPECT_RENDER(&t, CONV, 3, 1, "<s>[INST] Hi [/INST] Hello! </s>[INST] \n2+2?\n [/INST]");
    EXPECT_RENDER(&t, CONV_SYS, 2, 1, "<s>[INST] Be brief.\n\nHi [/INST]");
    chat_msg bad[] = {{"user", "a", 1, NULL}, {"user", "b", 1, NULL}};
    CHECK(chat_tmpl_render(&t, bad, 2, 1, &(char *){NULL}, &(size_t){0}) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "alternate") != NULL);
    chat_msg tool[] = {{"user", "a", 1, NULL}, {"tool", "b", 1, NULL}};
    CHECK(chat_tmpl_render(&t, tool, 2, 1, &(char *){NULL}, &(size_t){0}) == BT_ERR_INVALID);
    CHECK(strstr(bt_last_error(), "'tool'") != NULL);
    chat_tmpl_free(&t);

    REQUIRE(chat_tmpl_init(&t, NULL, 0, "gemma", "<bos>", "<eos>") == BT_OK);
    EXPECT_RENDER(&t, CONV, 3, 1,
                  "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                  "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n");
    EXPECT_RENDER(&t, CONV_SYS, 2, 0, "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n");
    chat_tmpl_free(&t);

    REQUIRE(chat_tmpl_init(&t, NULL, 0, "zephyr", "<s>", "</s>") == BT_OK);
    EXPECT_RENDER(&t, CONV_SYS, 2, 1, "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n");
    EXPECT_RENDER(&t, CONV, 0, 1, "");
    chat_tmpl_free(&t);

    /* |trim strips Unicode whitespace as Python does, including U+001C..U+001F, but not ZWSP */
    REQUIRE(chat_tmpl_init(&t, NULL, 0, "llama3", "", "") == BT_OK);
    chat_msg ws[] = {{"user", "\xE3\x80\x80\x1Cx\xC2\xA0\xE2\x80\x8B", 10, NULL}};
    EXPECT_RENDER(&t, ws, 1, 0, "<|start_header_id|>user<|end_header_id|>\n\nx\xC2\xA0\xE2\x80\x8B<|eot_id|>");
    chat_tmpl_free(&t);
}

static void test_on_default_model(void)
{
    const char *path = test_default_model();
    if (!path) {
        test_skip("test_on_default_model: default model not cached (run deploy/fetch-model.sh)");
        return;
    }
    gguf_file *f;
    REQUIRE(gguf_open(path, &f) == BT_OK);
    chat_tmpl t;
    CHECK(chat_tmpl_init_gguf(&t, f, NULL) == BT_OK);
    CHECK(t.kind == CHAT_TMPL_JINJA && !strcmp(t.bos, "<|im_start|>") && !strcmp(t.eos, "<|im_end|>"));
    chat_tmpl_free(&t);
    CHECK(chat_tmpl_init_gguf(&t, f, "builtin:chatml") == BT_OK);
    CHECK(t.kind == CHAT_TMPL_CHATML && t.default_system && !strcmp(t.bos, "<|im_start|>"));
    chat_tmpl_free(&t);
    CHECK(chat_tmpl_init_gguf(&t, f, "zephyr") == BT_OK && t.kind == CHAT_TMPL_ZEPHYR);
    chat_tmpl_free(&t);
    CHECK(chat_tmpl_init_gguf(&t, f, "nope") == BT_ERR_NOT_FOUND);
    gguf_close(f);
}

int main(void)
{
    RUN(test_detect);
    RUN(test_chatml);
    RUN(test_jinja_fallback_and_data);
    RUN(test_other_families);
    RUN(test_on_default_model);
    return test_summary();
}
