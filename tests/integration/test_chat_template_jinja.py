"""baton's Jinja interpreter against Jinja2 as Hugging Face apply_chat_template runs it, on real model templates.

The templates come from PyPI (chat_templates_fetch.py; the test fails when they cannot be fetched). Each is
rendered by `baton chat-template --template-file` and by transformers' render_jinja_template (the function behind
apply_chat_template: ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, its tojson, raise_exception
and strftime_now) over the same conversations, with and without the generation prompt, and compared byte for
byte. A conversation the template rejects (raise_exception or another template error) must fail in baton too.
"""
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import chat_templates_fetch  # noqa: E402
import hf_tokenizer_oracle as oracle  # noqa: E402
from conftest import build_dir, default_model_path  # noqa: E402

BATON = build_dir() / "bin" / "baton"
MODEL = default_model_path()
NOW = 1721995200  # 2024-07-26 12:00 UTC: strftime_now's time on both sides

# The target families (issue 23): each must render byte-identically to Jinja2 (or be rejected by both) for every
# conversation, and render at least 10 of them. Gemma 3, Phi-4 and Mistral v0.3 templates are not in the package.
TARGETS = [
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "Qwen-QwQ-32B.jinja",
    "Qwen3-Coder.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
    "google-gemma-2-2b-it.jinja",
    "google-gemma-4-31B-it.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
    "HuggingFaceTB-SmolLM3-3B.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "deepseek-ai-DeepSeek-V3.1.jinja",
    "deepseek-ai-DeepSeek-V3.2.jinja",
    "llama-cpp-deepseek-r1.jinja",
]

U, A, S, T = "user", "assistant", "system", "tool"


def m(role, content, **extra):
    return {"role": role, "content": content, **extra}


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers: «a + b».",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


def call(name, args, cid="call_1"):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


PLAIN = [
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
    [m(U, "  leading and trailing spaces  "), m(A, "\n\nnewlines around\n\n"), m(U, "\ttab\t")],
    [m(U, "Line 1\nLine 2\n\nLine 4")],
    [m(U, "He said \"hi\" and 'bye' {{ not jinja }} {% raw %} \\n")],
    [m(U, "a"), m(A, "b"), m(U, "c"), m(A, "d"), m(U, "e")],
    [m(S, "Multi\nline\nsystem"), m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")],
    [m(U, "Ends with assistant"), m(A, "Final answer.")],
    [m(U, "Think first."), m(A, "<think>\nIt is 4.\n</think>\n\nThe answer is 4."), m(U, "Sure?")],
    [m(U, "q"), m(A, "<think>reasoning</think>answer")],
    [m(U, "\u00a0nbsp\u3000ideographic space\u2003")],
    [m(U, "u1"), m(U, "u2")],
    [m(A, "assistant first"), m(U, "then user")],
    [m(S, "sys only")],
    [],
]
WITH_TOOLS = [
    [m(U, "Weather in Paris?")],
    [m(S, "You call tools."), m(U, "Weather in Paris?")],
    [m(U, "Weather in Paris?"),
     m(A, "", tool_calls=[call("get_weather", {"city": "Paris", "unit": "celsius"})]),
     m(T, "{\"temperature\": 21}", tool_call_id="call_1", name="get_weather"),
     m(U, "And in Rome?")],
    [m(S, "Be precise."), m(U, "Add 2 and 3.5"),
     m(A, "", tool_calls=[call("add", {"a": 3.5, "b": 2})]),
     m(T, "5.5", tool_call_id="call_1", name="add")],
    [m(U, "Both?"),
     m(A, "Calling both.", tool_calls=[call("get_weather", {"city": "Oslo"}, "c1"), call("add", {"a": 1, "b": 2}, "c2")]),
     m(T, "cold", tool_call_id="c1", name="get_weather"), m(T, "3", tool_call_id="c2", name="add")],
]
NO_TOOL_CALLS = [
    [m(U, "Weather?"), m(A, "", tool_calls=[call("get_weather", {"city": "Paris"})]),
     m(T, "sunny", tool_call_id="call_1", name="get_weather")],
]
CASES = ([(c, None) for c in PLAIN] + [(c, TOOLS) for c in WITH_TOOLS] + [(c, None) for c in NO_TOOL_CALLS])


@pytest.fixture(scope="module")
def templates():
    try:
        return chat_templates_fetch.fetch()
    except Exception as e:  # a failure, never a skip: CI has PyPI
        pytest.fail(f"cannot fetch the chat templates: {e}")


@pytest.fixture(scope="module")
def special():
    tok, _ = oracle.build(str(MODEL))
    return {"bos_token": tok.bos_token, "eos_token": tok.eos_token}


def hf_render(text, conv, tools, gen, special, monkeypatch):
    from transformers.utils import chat_template_utils as ctu

    class Fixed(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime.fromtimestamp(NOW, tz)

    monkeypatch.setattr(ctu, "datetime", Fixed)
    try:
        out, _ = ctu.render_jinja_template(conversations=[conv], tools=tools, chat_template=text,
                                           add_generation_prompt=gen, **special)
        return out[0]
    except Exception as e:  # noqa: BLE001 -- the template rejected the conversation
        return e


def baton_render(path, cases, gen):
    lines = "".join(json.dumps({"messages": c, "tools": t}) + "\n" for c, t in cases)
    r = subprocess.run([str(BATON), "chat-template", "--model", str(MODEL), "--template-file", str(path), "--jsonl",
                        "--now", str(NOW), *([] if gen else ["--no-generation-prompt"])],
                       input=lines, capture_output=True, text=True, encoding="utf-8", timeout=120)
    out = r.stdout.split("\n")[:-1]
    assert len(out) == len(cases), r.stderr
    return [json.loads(line) for line in out]


def compare(path, special, monkeypatch):
    text = path.read_text(encoding="utf-8")
    mismatches, rendered, rejected = [], 0, 0
    for gen in (True, False):
        got = baton_render(path, CASES, gen)
        for (conv, tools), g in zip(CASES, got):
            want = hf_render(text, conv, tools, gen, special, monkeypatch)
            if isinstance(want, Exception):
                rejected += 1
                if not isinstance(g, dict):
                    mismatches.append(f"gen={gen} {conv!r}: Jinja2 raised {want!r}, baton rendered {g!r}")
            else:
                rendered += 1
                if g != want:
                    mismatches.append(f"gen={gen} tools={tools is not None} {conv!r}:\n want {want!r}\n got  {g!r}")
    return mismatches, rendered, rejected


@pytest.mark.parametrize("name", TARGETS)
def test_target_template_matches_jinja2(templates, special, monkeypatch, name):
    path = templates / name
    assert path.exists(), f"{name} is not in {templates}"
    mismatches, rendered, rejected = compare(path, special, monkeypatch)
    assert rendered >= 10, f"only {rendered} conversations rendered ({rejected} rejected)"
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:5])


def test_every_other_template_matches_jinja2(templates, special, monkeypatch):
    """The package's other templates (some reject every conversation here in Jinja2 too, e.g. Command R wants
    Cohere's tool format, firefunction a "functions" variable: baton must fail on each of them as well)."""
    others = sorted(p for p in templates.glob("*.jinja") if p.name not in TARGETS)
    assert len(others) >= 40, f"only {len(others)} templates in {templates}"
    failed = {}
    for path in others:
        mismatches, _, _ = compare(path, special, monkeypatch)
        if mismatches:
            failed[path.name] = mismatches[0]
    assert not failed, f"{len(failed)} templates differ: " + "\n".join(f"{k}: {v}" for k, v in failed.items())


def test_bos_and_eos_are_the_models(special, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}|{{ eos_token }}", encoding="utf-8")
    assert baton_render(path, [([], None)], True) == [f"{special['bos_token']}|{special['eos_token']}"]


def test_router_template_file_sees_message_fields(tmp_path, default_model):
    """baton-router --chat-template FILE: /tokenize renders the file with the messages' name and tool_call_id."""
    import http.client

    from harness.etcd import EtcdServer
    from harness.router_procs import start_router

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|{{ m.other }}]"
                    "{{ m.content }}{% endfor %}", encoding="utf-8")
    body = {"messages": [m(U, "hi", name="bob", other="dropped"), m(T, "42", tool_call_id="c1")]}
    want = "[user|bob||]hi[tool||c1|]42"
    ids = subprocess.run([str(BATON), "tokenize", "--model", str(default_model), want], capture_output=True,
                         text=True, check=True).stdout.split()
    with EtcdServer() as etcd, start_router(etcd, default_model, extra_args=["--chat-template", str(path)]) as rtr:
        host, port = rtr.http_addr.rsplit(":", 1)
        c = http.client.HTTPConnection(host, int(port), timeout=60)
        c.request("POST", "/tokenize", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = json.loads(r.read())
        c.close()
    assert r.status == 200, data
    assert data["tokens"] == [int(i) for i in ids]
