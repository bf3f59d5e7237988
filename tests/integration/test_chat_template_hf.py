"""baton's chat-template rendering against Hugging Face apply_chat_template (Jinja).

The default model's own template is rendered for every conversation, with and without the generation prompt, by
the Jinja interpreter (the default) and by the built-in chatml renderer (--chat-template builtin:chatml). The
other built-in families are checked with reference templates of those model families, passed to baton with
--chat-template builtin:NAME and to HF as chat_template=. Real model templates through the interpreter:
test_chat_template_jinja.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import hf_tokenizer_oracle as oracle  # noqa: E402

from conftest import build_dir, default_model_path  # noqa: E402

BATON = build_dir() / "bin" / "baton"
MODEL = default_model_path()

U, A, S = "user", "assistant", "system"


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [m(U, "Hi")],
    [m(S, "You are terse."), m(U, "Hello!")],
    [m(U, "What is 2+2?"), m(A, "4"), m(U, "And 3+3?")],
    [m(S, "Be kind."), m(U, "Hi"), m(A, "Hello, how can I help?"), m(U, "Tell me a joke.")],
    [m(U, "")],
    [m(S, ""), m(U, "")],
    [m(U, "x"), m(A, ""), m(U, "y")],
    [m(U, "你好，世界！请介绍一下你自己。")],
    [m(S, "日本語で答えてください。"), m(U, "東京の天気は？")],
    [m(U, "안녕하세요 👋"), m(A, "안녕하세요! 😀")],
    [m(U, "Emoji: 👨‍👩‍👧‍👦 🇫🇷 ❤️"), m(A, "Nice 👍🏽")],
    [m(U, "Combining: e\u0301 n\u0303 Z\u0351\u0352")],
    [m(U, "  leading and trailing spaces  "), m(A, "\n\nnewlines around\n\n"), m(U, "\ttab\t")],
    [m(U, "Line 1\nLine 2\n\nLine 4")],
    [m(U, "def f(x):\n    return x ** 2\n")],
    [m(U, "He said \"hi\" and 'bye' {{ not jinja }} {% raw %}")],
    [m(U, "Special strings: <|im_start|> <|im_end|> <s> [INST]")],
    [m(U, "a"), m(A, "b"), m(U, "c"), m(A, "d"), m(U, "e"), m(A, "f"), m(U, "g")],
    [m(S, "Multi\nline\nsystem"), m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")],
    [m(U, "Ends with assistant"), m(A, "Final answer.")],
    [m(U, "x" * 2000)],
    [m(U, "Backslashes \\n \\t \\\\ and unicode escapes \\u00e9")],
    [m(U, "Arabic: مرحبا — Hebrew: שלום — Hindi: नमस्ते")],
    [m(U, "\u00a0nbsp\u3000ideographic space\u2003")],
    [m(S, "sys"), m(U, "u1"), m(A, "a1"), m(U, "u2"), m(A, "a2"), m(U, "u3")],
]

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
          "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
          "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
CHATML_QWEN = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
               "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
               "{%- endif %}{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- else %}"
               "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
               "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_PLAIN = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")

FAMILIES = {"llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA, "zephyr": ZEPHYR, "chatml-qwen": CHATML_QWEN,
            "chatml-plain": CHATML_PLAIN}


def alternating(conv):
    return all(msg["role"] == (U if i % 2 == 0 else A) for i, msg in enumerate(conv))


def baton_render(convs, *args):
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--jsonl", *map(str, args)],
                       input="".join(json.dumps(c) + "\n" for c in convs), capture_output=True, text=True,
                       encoding="utf-8", timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")[:-1]
    assert len(lines) == len(convs)
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def hf():
    tok, _ = oracle.build(str(MODEL))
    return tok


@pytest.mark.parametrize("renderer", ["jinja", "builtin:chatml"])
@pytest.mark.parametrize("gen", [True, False])
def test_default_template_matches_hf(hf, gen, renderer):
    assert len(CONVERSATIONS) >= 20
    override = [] if renderer == "jinja" else ["--chat-template", renderer]
    got = baton_render(CONVERSATIONS, *override, *([] if gen else ["--no-generation-prompt"]))
    for conv, g in zip(CONVERSATIONS, got):
        want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        assert g == want, f"conversation {conv!r}"


def test_default_template_is_interpreted():
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--detect"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.strip() == "jinja"
    for override in ("builtin:chatml", "chatml"):
        r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", override,
                            "--detect"], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == "chatml"


def test_unparsable_template_falls_back_to_builtin(tmp_path):
    # {% call %} blocks are not supported: the chatml markers still select the built-in renderer
    text = CHATML_PLAIN + "{% call foo() %}{% endcall %}"
    path = tmp_path / "t.jinja"
    path.write_text(text, encoding="utf-8")
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--template-file", str(path), "--detect"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "chatml", r.stderr


def test_rendered_prompt_tokenizes_like_hf(hf):
    got = baton_render(CONVERSATIONS, "--tokenize")
    for conv, g in zip(CONVERSATIONS, got):
        assert g == hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("gen", [True, False])
def test_other_families_match_jinja(hf, tmp_path, family, gen):
    text = FAMILIES[family]
    path = tmp_path / "template.jinja"
    path.write_text(text, encoding="utf-8")
    convs = [c for c in CONVERSATIONS if family not in ("mistral", "gemma") or alternating(c)]
    assert len(convs) >= 10
    name = "chatml" if family.startswith("chatml") else family
    got = baton_render(convs, "--template-file", path, "--chat-template", f"builtin:{name}",
                       *([] if gen else ["--no-generation-prompt"]))
    assert got == baton_render(convs, "--template-file", path, *([] if gen else ["--no-generation-prompt"]))
    for conv, g in zip(convs, got):
        want = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, chat_template=text)
        assert g == want, f"{family}: conversation {conv!r}"


def test_override_by_name():
    conv = [m(U, "Hi")]
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", "gemma",
                        json.dumps(conv)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "<|im_start|><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_template_file_override(tmp_path):
    path = tmp_path / "odd.jinja"
    path.write_text("{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}", encoding="utf-8")
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", str(path),
                        json.dumps([m(U, "a"), m(A, "b")])], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "### user: a\n### assistant: b\n", r.stderr


def test_errors_are_one_clear_line(tmp_path):
    path = tmp_path / "odd.jinja"
    path.write_text("{% for m in messages %}### {{ m.role }}: {{ m.content }\n{% endfor %}", encoding="utf-8")
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--template-file", str(path), "[]"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "not recognised" in r.stderr and "### " in r.stderr
    assert "does not parse (line 1:" in r.stderr
    # a FILE override is interpreted without a fallback: its syntax error, with line:col, at load
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", str(path), "[]"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "line 1:" in r.stderr, r.stderr
    path.write_text("{{ raise_exception('no ' ~ messages[0].role) }}", encoding="utf-8")
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", str(path),
                        json.dumps([m(U, "a")])], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == ("baton chat-template: chat template line 1:4: "
                                                      "raise_exception: no user")
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", "nope", "[]"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "nope" in r.stderr
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--chat-template", "mistral",
                        json.dumps([m(U, "a"), m(U, "b")])], capture_output=True, text=True)
    assert r.returncode == 1 and "alternate" in r.stderr
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "[{\"content\": \"x\"}]"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
