"""Tool calling through a real local cluster with the openai client (issue 23 item 4).

The default model (SmolLM2-135M-Instruct) ships a ChatML template that never renders tools, so the router under test
runs with `--chat-template` Qwen 2.5's own template (fetched by chat_templates_fetch.py; same ChatML markers), whose
call syntax is detected as hermes. A 135M model seldom calls a tool on its own, so tool_choice "required" and a named
function are tested end to end (the grammar forces the call: every call's arguments must validate against its
tool's schema with jsonschema), and the parser's formats are covered by tests/unit/router/test_tool_calls.c. A second
router with the model's own template shows the refusal a user of the default model gets."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import pathlib

import jsonschema
import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import chat_templates_fetch  # noqa: E402
from harness.baton_procs import bin_path, start_decode  # noqa: E402
from harness.etcd import EtcdServer  # noqa: E402
from harness.router_procs import start_router  # noqa: E402
from test_router_openai import wait_nodes  # noqa: E402

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}/[A-Z][a-z]{2,10}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def qwen_template():
    try:
        path = chat_templates_fetch.fetch() / "Qwen-Qwen2.5-7B-Instruct.jinja"
    except Exception as e:  # a failure, never a skip: CI has PyPI
        pytest.fail(f"cannot fetch the chat templates: {e}")
    assert path.exists()
    return path


@pytest.fixture(scope="module")
def cluster(default_model, qwen_template):
    with EtcdServer() as etcd:
        with start_decode(etcd, default_model, threads=1, node_id="dec-tools") as dec:
            with start_router(etcd, default_model, extra_args=["--chat-template", str(qwen_template)]) as rtr, \
                    start_router(etcd, default_model) as plain:
                wait_nodes(rtr, 1)
                wait_nodes(plain, 1)
                yield rtr, plain, etcd


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[0].base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def plain_client(cluster):
    return openai.OpenAI(base_url=cluster[1].base_url, api_key="unused", max_retries=0, timeout=300)


def check_calls(calls, names=None, mistral=False):
    """Every call is a known tool whose arguments parse and validate against its schema."""
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function"
        assert (len(c.id) == 9 and c.id.isalnum()) if mistral else (c.id.startswith("call_") and len(c.id) == 29)
        assert c.function.name in (names or SCHEMAS)
        jsonschema.Draft202012Validator(SCHEMAS[c.function.name]).validate(json.loads(c.function.arguments))


def test_required_then_tool_result(client, cluster):
    """The openai client's tool-calling example, unchanged: a forced call, then the tool's result sent back."""
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                       temperature=0.7, seed=5)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    check_calls(ch.message.tool_calls)
    assert ch.message.content is None
    call = ch.message.tool_calls[0]
    messages = ASK + [ch.message,
                      {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    r2 = client.chat.completions.create(model="", messages=messages, tools=TOOLS, max_tokens=30, temperature=0)
    ch2 = r2.choices[0]
    assert ch2.finish_reason in ("stop", "length", "tool_calls")
    if ch2.message.tool_calls:  # auto: a call is allowed, but then it must be well formed
        check_calls(ch2.message.tool_calls)
    else:
        assert ch2.message.content
    # the history reaches the template: the call's arguments as an object (not a JSON string encoded again), the
    # result as a tool response
    ids = post(cluster[0], "/tokenize", {"messages": [m if isinstance(m, dict) else m.model_dump() for m in messages]})
    text = post(cluster[0], "/detokenize", {"tokens": ids["tokens"]})["prompt"]
    args = json.loads(call.function.arguments)
    assert f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {json.dumps(args)}}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in text


def post(rtr, path, body):
    req = urllib.request.Request(rtr.base_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_named_function_single_call(client):
    """A named function is called exactly once (parallel_tool_calls left at its default, true)."""
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=200, temperature=0.7, seed=11, n=3)
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls, names=["get_time"])


def test_required_many_seeds_validate(client):
    """Forced calls over several seeds and temperatures. One call (parallel_tool_calls false): the grammar ends after
    it, so every answer is a call that validates. Parallel calls: this 135M model often repeats calls until
    max_tokens (a cut call is content, finish "length"); those that end are calls that validate."""
    for seed in range(4):
        r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200,
                                           temperature=0.3 + 0.3 * seed, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (seed, ch.message.content)
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls)
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160,
                                       temperature=0.8, seed=3, n=6)
    ended = [ch for ch in r.choices if ch.finish_reason == "tool_calls"]
    assert ended, [ch.message.content for ch in r.choices]
    for ch in r.choices:
        if ch.finish_reason == "tool_calls":
            check_calls(ch.message.tool_calls)
        else:
            assert ch.finish_reason == "length" and ch.message.content.startswith("<tool_call>\n{\"name\": \"")


def test_streaming_deltas_accumulate(client):
    """stream=True: delta.tool_calls chunks (index, id, type, name, then arguments) that the openai client's own
    stream helper accumulates into the same calls as the non-streaming answer for the same seed."""
    kw = dict(model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.8, seed=21)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    firsts = [tc for d in deltas for tc in (d.tool_calls or []) if tc.id]
    assert all(tc.type == "function" and tc.function.name for tc in firsts)
    assert not any(d.content for d in deltas)
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    check_calls(final.message.tool_calls)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == want


def test_auto_and_none(client):
    """auto: free text, parsed afterwards (a plain answer stays content); none: tools rendered, never parsed."""
    msgs = [{"role": "user", "content": "Say hello to me in one short sentence."}]
    for choice in ("auto", "none"):
        for stream in (False, True):
            kw = dict(model="", messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=24, temperature=0, seed=1)
            if stream:
                with client.chat.completions.stream(**kw) as s:
                    ch = s.get_final_completion().choices[0]
            else:
                ch = client.chat.completions.create(**kw).choices[0]
            if ch.message.tool_calls:
                assert choice == "auto" and ch.finish_reason == "tool_calls"
                check_calls(ch.message.tool_calls)
            else:
                assert ch.finish_reason in ("stop", "length") and ch.message.content


def test_auto_strict_is_honoured(client):
    """strict: true under auto: a grammar allows text or calls, so any call the answer holds validates (OpenAI's
    promise), streamed or not."""
    strict_tools = [{"type": "function", "function": dict(t["function"], strict=True)} for t in TOOLS]
    msgs = [{"role": "user", "content": "What is the weather in Paris? Call a tool."}]
    calls = 0
    for seed in range(4):
        kw = dict(model="", messages=msgs, tools=strict_tools, max_tokens=120, temperature=0.9, seed=seed)
        for stream in (False, True):
            if stream:
                try:
                    with client.chat.completions.stream(**kw) as s:
                        ch = s.get_final_completion().choices[0]
                except openai.LengthFinishReasonError:  # the helper refuses to parse strict output cut by length
                    continue
            else:
                ch = client.chat.completions.create(**kw).choices[0]
            if ch.message.tool_calls:
                calls += 1
                assert ch.finish_reason in ("tool_calls", "length")
                check_calls(ch.message.tool_calls)
            else:
                assert ch.finish_reason in ("stop", "length")
                assert "<tool_call>" not in (ch.message.content or "")
    print(f"auto + strict: {calls} of 8 answers called a tool")


@pytest.mark.parametrize("extra,needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": TOOLS + [TOOLS[0]]}, "repeats"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "minProperties": 1}}}]}, "minProperties"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
])
def test_unsupported_combinations_are_400(client, extra, needle):
    kw = dict(model="", messages=ASK, tools=TOOLS, max_tokens=8)
    kw.update(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert needle in str(e.value)


def test_tools_on_completions_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="", prompt="hi", max_tokens=4, extra_body={"tools": TOOLS})
    assert "/v1/chat/completions" in str(e.value)


def test_default_template_refuses_tools(plain_client):
    """SmolLM2's own template never renders tools: a 400 that says what to do, never a silent plain answer."""
    with pytest.raises(openai.BadRequestError) as e:
        plain_client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=8)
    assert "--chat-template" in str(e.value) and "does not render tools" in str(e.value)
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as e:
        plain_client.chat.completions.create(model="", messages=history, max_tokens=8)
    assert "tool_calls" in str(e.value)
    r = plain_client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("template,fmt", [
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral-args"),
])
def test_other_formats_end_to_end(cluster, default_model, template, fmt):
    """The llama3 and Mistral formats through their models' own templates (rendered for this model's tokenizer: the
    markers are plain text to it): the detected format's grammar forces a named call that parses back, streamed
    too, and the call sent back in the history renders (Mistral's templates demand 9-character ids)."""
    path = chat_templates_fetch.fetch() / template
    with start_router(cluster[2], default_model, extra_args=["--chat-template", str(path)]) as rtr:
        wait_nodes(rtr, 1)
        assert f"tool calling: parser {fmt} (detected)" in rtr.log()
        c = openai.OpenAI(base_url=rtr.base_url, api_key="unused", max_retries=0, timeout=300)
        kw = dict(model="", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.5, seed=2,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls", ch.message.content
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls, names=["get_weather"], mistral=fmt.startswith("mistral"))
        with c.chat.completions.stream(**kw) as s:
            final = s.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert [json.loads(t.function.arguments) for t in final.message.tool_calls] == \
            [json.loads(t.function.arguments) for t in ch.message.tool_calls]
        call = ch.message.tool_calls[0]
        history = ASK + [ch.message, {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        r = c.chat.completions.create(model="", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_parser_flag(cluster, default_model, qwen_template):
    """--tool-call-parser: a bad value stops the start naming the choices; none turns tool calling off (a 400 that
    names the flag) while tool_choice "none" still works."""
    p = subprocess.run([bin_path("baton-router"), "--model", str(default_model), "--etcd", cluster[2].endpoint,
                        "--tool-call-parser", "pythonic"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "hermes, llama3, mistral" in p.stderr
    with start_router(cluster[2], default_model,
                      extra_args=["--chat-template", str(qwen_template), "--tool-call-parser", "none"]) as rtr:
        wait_nodes(rtr, 1)
        assert "tool calling: parser none (--tool-call-parser)" in rtr.log()
        c = openai.OpenAI(base_url=rtr.base_url, api_key="unused", max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
        assert "--tool-call-parser" in str(e.value)
        r = c.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert r.choices[0].message.tool_calls is None


def test_tokenize_renders_tools(cluster):
    """POST /tokenize with messages and tools renders the tools as a chat request does (never ignores them)."""
    ids = post(cluster[0], "/tokenize", {"messages": ASK, "tools": TOOLS})["tokens"]
    text = post(cluster[0], "/detokenize", {"tokens": ids})["prompt"]
    assert "# Tools" in text and json.dumps(TOOLS[0]) in text
    req = urllib.request.Request(cluster[1].base_url.removesuffix("/v1") + "/tokenize",
                                 data=json.dumps({"messages": ASK, "tools": TOOLS}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400 and b"does not render tools" in e.value.read()


# ---- the same through gRPC baton.v1.Generation/Generate (tools, tool_choice, ToolCall) ----

@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    from harness import pygen
    return pygen.api_stubs(tmp_path_factory)


@pytest.fixture(scope="module")
def stubs(cluster, pb):
    import grpc
    chans = [grpc.insecure_channel(cluster[i].grpc_addr) for i in (0, 1)]
    yield [pb[1].GenerationStub(ch) for ch in chans]
    for ch in chans:
        ch.close()


def grpc_tools(pb2, tools=TOOLS):
    return [pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                     parameters=json.dumps(t["function"]["parameters"]) if "parameters" in t["function"] else "",
                     strict=bool(t["function"].get("strict"))) for t in tools]


def grpc_chat(pb2, messages):
    out = []
    for m in messages:
        calls = [pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.get("tool_calls") or []]
        out.append(pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                   tool_call_id=m.get("tool_call_id", ""), tool_calls=calls))
    return pb2.ChatMessages(messages=out)


def grpc_generate(stub, pb2, messages, choice, seed, temperature, max_tokens=200, parallel=None, tools=TOOLS):
    """Generate's messages, and per choice (text, token ids, tool calls, finish reason); usage from the last."""
    kw = dict(chat=grpc_chat(pb2, messages), tools=grpc_tools(pb2, tools), max_tokens=max_tokens,
              sampling=pb2.SamplingParams(temperature=temperature, seed=seed))
    if choice is not None:
        kw["tool_choice"] = choice
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    msgs = list(stub.Generate(pb2.GenerateRequest(**kw), timeout=300))
    ids = [i for m in msgs for i in m.token_ids]
    text = "".join(m.text for m in msgs)
    calls = [c for m in msgs for c in m.tool_calls]
    return msgs, text, ids, calls, msgs[-1].finish_reason


def http_answer(client, messages, tool_choice, seed, temperature, max_tokens=200, **extra):
    kw = dict(model="", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=temperature, seed=seed)
    if tool_choice is not None:
        kw["tool_choice"] = tool_choice
    kw.update(extra)
    return client.chat.completions.create(**kw)


def call_pairs(calls):
    return [(c.name if hasattr(c, "name") else c.function.name,
             json.loads(c.arguments if hasattr(c, "arguments") else c.function.arguments)) for c in calls]


@pytest.mark.parametrize("grpc_choice,http_choice,seed", [
    ("required", "required", 5),
    ({"function": "get_time"}, {"type": "function", "function": {"name": "get_time"}}, 11),
])
def test_grpc_forced_call_equals_http(client, stubs, pb, grpc_choice, http_choice, seed):
    """A required or named call over gRPC: the last message carries ToolCall entries (finish_reason TOOL_CALLS,
    no text held back as content), the arguments validate, and the calls, tokens and usage equal the HTTP answer
    for the same request and seed."""
    pb2 = pb[0]
    choice = pb2.ToolChoice(mode=pb2.TOOL_CHOICE_REQUIRED) if grpc_choice == "required" else \
        pb2.ToolChoice(function=grpc_choice["function"])
    msgs, text, ids, calls, finish = grpc_generate(stubs[0], pb2, ASK, choice, seed, 0.7)
    assert finish == pb2.FINISH_REASON_TOOL_CALLS, text
    assert text == "" and ids and calls
    assert all(not m.tool_calls for m in msgs[:-1])  # the calls come with the choice's end
    for c in calls:
        assert c.id.startswith("call_") and len(c.id) == 29
        jsonschema.Draft202012Validator(SCHEMAS[c.name]).validate(json.loads(c.arguments))
    if grpc_choice != "required":
        assert [c.name for c in calls] == [grpc_choice["function"]]
    h = http_answer(client, ASK, http_choice, seed, 0.7)
    ch = h.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert call_pairs(calls) == call_pairs(ch.message.tool_calls)
    assert msgs[-1].usage.prompt_tokens == h.usage.prompt_tokens
    assert msgs[-1].usage.completion_tokens == h.usage.completion_tokens == len(ids)


def test_grpc_history_and_auto_equal_http(client, stubs, pb):
    """A conversation with an assistant call and the tool's result, tool_choice auto (unset) and greedy: the gRPC
    prompt renders as HTTP's (same prompt tokens) and the answer (text or calls) is the same."""
    pb2 = pb[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature_c\": 21}"}]
    msgs, text, ids, calls, finish = grpc_generate(stubs[0], pb2, history, None, 1, 0.0, max_tokens=40)
    h = http_answer(client, history, None, 1, 0.0, max_tokens=40)
    ch = h.choices[0]
    assert msgs[-1].usage.prompt_tokens == h.usage.prompt_tokens
    assert text == (ch.message.content or "")
    assert call_pairs(calls) == call_pairs(ch.message.tool_calls or [])
    want = {"stop": pb2.FINISH_REASON_STOP, "length": pb2.FINISH_REASON_LENGTH,
            "tool_calls": pb2.FINISH_REASON_TOOL_CALLS}[ch.finish_reason]
    assert finish == want


def test_grpc_parallel_false_one_call(stubs, pb):
    pb2 = pb[0]
    for seed in range(2):
        _, _, _, calls, finish = grpc_generate(stubs[0], pb2, ASK, pb2.ToolChoice(mode=pb2.TOOL_CHOICE_REQUIRED),
                                               seed, 0.6, parallel=False)
        assert finish == pb2.FINISH_REASON_TOOL_CALLS and len(calls) == 1


@pytest.mark.parametrize("change,needle", [
    (dict(tool_choice="named:nope"), "'tool_choice' names the function 'nope'"),
    (dict(tools="dup"), "'tools[2].name' 'get_weather' repeats"),
    (dict(tools="badparams"), "'tools[0].parameters' must be a JSON schema object"),
    (dict(tools="minprops"), "minProperties"),
    (dict(response_format=True), "'response_format' together with tool_choice"),
    (dict(text=True), "'tools' needs a 'chat' prompt"),
    (dict(tool_message_without_id=True), "'chat.messages[1].tool_call_id' is required"),
])
def test_grpc_tool_errors_name_the_field(stubs, pb, change, needle):
    import grpc
    pb2 = pb[0]
    tools = grpc_tools(pb2)
    if change.get("tools") == "dup":
        tools = tools + tools[:1]
    elif change.get("tools") == "badparams":
        tools[0].parameters = "{\"type\": "
    elif change.get("tools") == "minprops":
        tools = [pb2.Tool(name="f", parameters='{"type": "object", "minProperties": 1}')]
    kw = dict(tools=tools, max_tokens=8, tool_choice=pb2.ToolChoice(mode=pb2.TOOL_CHOICE_REQUIRED))
    if "tool_choice" in change:
        kw["tool_choice"] = pb2.ToolChoice(function=change["tool_choice"].split(":")[1])
    if change.get("response_format"):
        kw["response_format"] = pb2.ResponseFormat(json_object=True)
    if change.get("text"):
        kw["text"] = "hello"
    elif change.get("tool_message_without_id"):
        kw["chat"] = pb2.ChatMessages(messages=[pb2.ChatMessage(role="user", content="hi"),
                                                pb2.ChatMessage(role="tool", content="21")])
    else:
        kw["chat"] = grpc_chat(pb2, ASK)
    with pytest.raises(grpc.RpcError) as e:
        list(stubs[0].Generate(pb2.GenerateRequest(**kw), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details(), e.value.details()


def test_grpc_default_template_refuses_tools(stubs, pb):
    """The router whose template renders no tools answers INVALID_ARGUMENT, never a plain answer."""
    import grpc
    pb2 = pb[0]
    with pytest.raises(grpc.RpcError) as e:
        list(stubs[1].Generate(pb2.GenerateRequest(chat=grpc_chat(pb2, ASK), tools=grpc_tools(pb2), max_tokens=8),
                               timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not render tools" in e.value.details()
    msgs = list(stubs[1].Generate(pb2.GenerateRequest(chat=grpc_chat(pb2, ASK), tools=grpc_tools(pb2), max_tokens=4,
                                                      tool_choice=pb2.ToolChoice(mode=pb2.TOOL_CHOICE_NONE)),
                                  timeout=60))
    assert msgs[-1].finish_reason in (pb2.FINISH_REASON_STOP, pb2.FINISH_REASON_LENGTH)
    assert not any(m.tool_calls for m in msgs)
