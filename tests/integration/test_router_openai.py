"""baton-router's OpenAI-compatible HTTP API with the real `openai` client, a real etcd and real decode nodes.

Checks what a user sees: response shapes, usage, stop strings, n, seed, logprobs, greedy output equal to
`baton generate`, logit_bias, validation errors naming the field, 413, API keys, 503 without decode nodes, KV blocks
returned after client disconnects (one, and 100 at random moments), and a stream that survives kill -9 of its decode
node (no gap, no duplicate)."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import time

import openai
import pytest

from harness.baton_procs import start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router

CHAT_Q = "What is the capital of France? Answer in one sentence."
PROMPT = "The three largest cities in Germany are"


def wait_nodes(router, n, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = router.http("/health")
        if status == 200 and json.loads(body).get("decode_nodes") == n:
            return
        time.sleep(0.1)
    raise AssertionError(f"router did not see {n} decode node(s): {router.http('/health')}")


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd:
        with start_decode(etcd, default_model, threads=1, node_id="dec-a") as dec:
            with start_router(etcd, default_model) as rtr:
                wait_nodes(rtr, 1)
                yield etcd, dec, rtr


@pytest.fixture(scope="module")
def client(cluster):
    _, _, rtr = cluster
    return openai.OpenAI(base_url=rtr.base_url, api_key="unused", max_retries=0, timeout=120)


def baton_generate(baton_bin, model, *args):
    out = subprocess.run([str(baton_bin), "generate", "--model", str(model), "--quiet", "--threads", "1", *args],
                         check=True, capture_output=True, timeout=300)
    text = out.stdout.decode()
    return text[:-1] if text.endswith("\n") else text


def token_ids(baton_bin, model, text):
    out = subprocess.run([str(baton_bin), "tokenize", "--model", str(model), "--no-parse-special", text],
                         check=True, capture_output=True, text=True, timeout=60)
    return [int(t) for t in out.stdout.split()]


def raw_post(rtr, path, body: bytes, headers=None):
    host, port = rtr.http_addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def test_models(client, cluster):
    _, _, rtr = cluster
    models = client.models.list()
    assert len(models.data) == 1
    name = models.data[0].id
    assert name and models.data[0].object == "model"
    assert client.models.retrieve(name).id == name
    base = os.path.basename(str(default_model_path())).removesuffix(".gguf")
    assert client.models.retrieve(base).id == name
    # a short id from the file name; the GGUF's general.name stays an alias
    assert name == "smollm2-135m-instruct"
    assert client.models.retrieve("Smollm2 135M 8k Lc100K Mix1 Ep2").id == name
    r = client.chat.completions.create(model="Smollm2 135M 8k Lc100K Mix1 Ep2", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.model == name


def default_model_path():
    from conftest import default_model_path as p
    return p()


def test_chat_greedy_equals_baton_generate(client, baton_bin, default_model):
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": CHAT_Q}], max_tokens=24,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    want = baton_generate(baton_bin, default_model, "--chat", CHAT_Q, "--max-tokens", "24")
    assert c.message.content == want


def test_completion_greedy_equals_baton_generate(client, baton_bin, default_model):
    r = client.completions.create(model="", prompt=PROMPT, max_tokens=20, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    want = baton_generate(baton_bin, default_model, "--prompt", PROMPT, "--max-tokens", "20")
    assert r.choices[0].text == want


def test_chat_stream_matches_non_stream_and_usage(client):
    msgs = [{"role": "user", "content": CHAT_Q}]
    full = client.chat.completions.create(model="", messages=msgs, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model="", messages=msgs, max_tokens=30, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_stream(client):
    full = client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0)
    text = "".join(ch.choices[0].text for ch in
                   client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert text == full.choices[0].text


def test_stop_strings(client):
    full = client.completions.create(model="", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    # a stop string that spans token boundaries: the middle of the text
    cut = len(full) // 2
    stop = full[cut:cut + 4]
    assert len(stop) == 4 and stop.strip()
    want = full[:full.index(stop)]
    r = client.completions.create(model="", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 30
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == want


def test_max_tokens_and_length(client):
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Tell me a long story."}],
                                       max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_n_choices(client):
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Say a random word."}],
                                       n=3, max_tokens=8, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.message.content is not None for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1, "3 sampled choices came out identical"
    assert r.usage.completion_tokens >= 3
    chunks = list(client.completions.create(model="", prompt=PROMPT, n=2, max_tokens=6, temperature=0, stream=True))
    by = {}
    for ch in chunks:
        for c in ch.choices:
            by.setdefault(c.index, []).append(c.text)
    assert sorted(by) == [0, 1]
    assert "".join(by[0]) == "".join(by[1])  # greedy: every sample is the same


def test_seed_reproducible(client):
    kw = dict(model="", prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    assert client.completions.create(seed=4321, **kw).choices[0].text != a


def test_no_temperature_is_greedy(client):
    """README: a request without temperature decodes greedily (OpenAI's default is 1): it equals temperature 0,
    whatever the seed."""
    msgs = [{"role": "user", "content": "Name three colors."}]
    greedy = client.chat.completions.create(model="", messages=msgs, max_tokens=16, temperature=0)
    for seed in (1, 2):
        r = client.chat.completions.create(model="", messages=msgs, max_tokens=16, seed=seed)
        assert r.choices[0].message.content == greedy.choices[0].message.content, seed


def test_logprobs(client):
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": CHAT_Q}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4  # greedy picks the most likely token
    c = client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text


def test_logit_bias(client, baton_bin, default_model):
    first = client.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0).choices[0].text
    word = " Paris" if first != " Paris" else " Rome"
    (forced,) = token_ids(baton_bin, default_model, word)
    kw = dict(model="", max_tokens=3, temperature=0)
    r = client.completions.create(prompt=PROMPT, logit_bias={str(forced): 100}, **kw)
    assert r.choices[0].text.startswith(word), r.choices[0].text
    msgs = [{"role": "user", "content": CHAT_Q}]
    r = client.chat.completions.create(messages=msgs, logit_bias={str(forced): 100}, **kw)
    assert r.choices[0].message.content.startswith(word), r.choices[0].message.content
    # -100 on the token greedy picks: another first token, streamed or not
    (greedy,) = token_ids(baton_bin, default_model, first)
    r = client.completions.create(prompt=PROMPT, logit_bias={str(greedy): -100}, **kw)
    assert not r.choices[0].text.startswith(first), r.choices[0].text
    chunks = list(client.completions.create(prompt=PROMPT, logit_bias={str(greedy): -100}, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    # n > 1: every choice is biased
    r = client.completions.create(prompt=PROMPT, logit_bias={str(forced): 100}, n=2, **kw)
    assert all(c.text.startswith(word) for c in r.choices)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=PROMPT, logit_bias={"1000000": 5}, **kw)
    assert "logit_bias" in str(e.value)


BAD = [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": 1, "content": "x"}]}, "role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 10_000_000}, "max_tokens"),
    ({"max_completion_tokens": "x"}, "max_completion_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"n": "2"}, "n"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": "x" * 300}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": 3, "stream": True}, "stream_options"),
    ({"seed": "abc"}, "seed"),
    ({"speculative": "no"}, "speculative"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"),
    ({"logit_bias": []}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"1000000": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"7": "x"}}, "logit_bias"),
    ({"model": 3}, "model"),
    ({"user": 3}, "user"),
    # OpenAI fields baton does not honour are refused, never ignored (issue 23.5)
    ({"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    # structured output (issue 23.3): what it cannot honour is named
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                        "minProperties": 1}}}},
     "minProperties"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"store": True}, "store"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]}, "tool_call_id"),
    ({"seed": 2e19}, "seed"),
    ({"messages": [{"role": "user", "content": "hello world " * 5000}]}, "context"),
]


@pytest.mark.parametrize("patch,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_chat_requests_name_the_field(cluster, patch, field):
    _, _, rtr = cluster
    body = {"model": "", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(patch)
    for k in [k for k, v in patch.items() if v is None]:
        del body[k]
    if not patch:
        del body["messages"]
    status, data = raw_post(rtr, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, data
    err = json.loads(data)["error"]
    assert field in err["message"], err
    assert err["type"] == "invalid_request_error"


BAD_CMPL = [
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 30}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"suffix": "return x"}, "suffix"),
]


@pytest.mark.parametrize("patch,field", BAD_CMPL, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_CMPL)])
def test_bad_completion_requests(cluster, patch, field):
    _, _, rtr = cluster
    body = {"model": "", "prompt": "hi", "max_tokens": 4}
    body.update(patch)
    status, data = raw_post(rtr, "/v1/completions", json.dumps(body).encode())
    assert status == 400, data
    assert field in json.loads(data)["error"]["message"]


def test_malformed_json_unknown_model_and_unknown_fields(cluster):
    _, _, rtr = cluster
    assert raw_post(rtr, "/v1/chat/completions", b"{not json")[0] == 400
    assert raw_post(rtr, "/v1/chat/completions", b"[1,2]")[0] == 400
    status, data = raw_post(rtr, "/v1/chat/completions", json.dumps(
        {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    status, data = raw_post(rtr, "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frobnicate": {"x": 1}}).encode())
    assert status == 200, data
    # invalid UTF-8 inside a JSON string is refused
    status, _ = raw_post(rtr, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}')
    assert status == 400
    # a NUL escape cut the content short, and a repeated key took the first value: both refused now
    status, data = raw_post(rtr, "/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "hi\\u0000 there"}], "max_tokens": 2}')
    assert status == 400 and "u0000" in json.loads(data)["error"]["message"], data
    status, data = raw_post(rtr, "/v1/chat/completions",
                            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_tokens": 9}')
    assert status == 400 and "'max_tokens' twice" in json.loads(data)["error"]["message"], data


def test_unsupported_fields_with_the_openai_client(client):
    """The openai client's tool-calling calls and schemas with unsupported keywords get a 400 naming the field or
    keyword, never a 200 that ignored it; the neutral values a client may send by default are accepted."""
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=msgs, tools=tools, max_tokens=4)
    assert "tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}, max_tokens=4)
    assert "'not'" in str(e.value)
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=4, tools=[], tool_choice="none",
                                       response_format={"type": "text"}, store=False, temperature=0)
    assert r.choices[0].message.content


def test_body_too_large_413(cluster):
    _, _, rtr = cluster
    # the router answers from Content-Length before the body is read, so send only the headers
    host, port = rtr.http_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (5 << 20))
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 413"), data
    # and a chunked body that grows past the limit
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * (1 << 20)
        try:
            for _ in range(6):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        data = s.recv(65536)
    assert data.startswith(b"HTTP/1.1 413"), data


def test_metrics_populated(cluster, client):
    _, _, rtr = cluster
    client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0)
    m = rtr.metrics()
    assert rtr.metric("baton_time_to_first_token_seconds_count") >= 1
    assert rtr.metric("baton_time_per_output_token_seconds_count") >= 1
    assert rtr.metric("baton_e2e_request_latency_seconds_count") >= 1
    assert rtr.metric("baton_requests_total", 'status="ok"') >= 1
    assert rtr.metric("baton_generation_tokens_total") >= 4
    assert "baton_migrations_total" in m
    promtool = shutil.which("promtool")
    if promtool:
        p = subprocess.run([promtool, "check", "metrics"], input=m.encode(), capture_output=True)
        assert p.returncode == 0, p.stdout + p.stderr


def test_client_disconnect_frees_kv_blocks(cluster):
    _, dec, rtr = cluster
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (dec.metric("baton_running_sequences") or 0) > 0:
        time.sleep(0.1)
    time.sleep(0.3)  # one more gauge sample after the last request of the previous test
    base = dec.metric("baton_kv_blocks_used")
    host, port = rtr.http_addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True, "temperature": 0}),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    got = b""
    while got.count(b"data: ") < 5:
        got += r.read1(4096)
    deadline = time.monotonic() + 5  # the node samples its gauges every 100 ms
    while time.monotonic() < deadline and dec.metric("baton_kv_blocks_used") <= base:
        got += r.read1(4096)
    assert dec.metric("baton_kv_blocks_used") > base
    c.sock.close()
    c.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and dec.metric("baton_kv_blocks_used") > base:
        time.sleep(0.1)
    assert dec.metric("baton_kv_blocks_used") <= base
    assert rtr.metric("baton_requests_total", 'status="cancelled"') >= 1


def test_api_key(default_model):
    with EtcdServer() as etcd, start_router(etcd, default_model, api_key="s3cret") as rtr:
        bad = openai.OpenAI(base_url=rtr.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        status, _ = raw_post(rtr, "/v1/completions", b'{"prompt": "hi"}')
        assert status == 401
        good = openai.OpenAI(base_url=rtr.base_url, api_key="s3cret", max_retries=0)
        assert len(good.models.list().data) == 1
        assert rtr.http("/health")[0] == 200 and rtr.http("/metrics")[0] == 200


def test_served_model_name(default_model, baton_bin):
    """--served-model-name sets the id clients see and send; general.name stays an alias; a bad name stops start-up
    with one line naming the flag."""
    with EtcdServer() as etcd, start_router(etcd, default_model, served_model_name="team/smol-chat") as rtr:
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0)
        assert [m.id for m in cl.models.list().data] == ["team/smol-chat"]
        assert cl.models.retrieve("Smollm2 135M 8k Lc100K Mix1 Ep2").id == "team/smol-chat"
        status, data = raw_post(rtr, "/tokenize", b'{"model": "smollm2-135m-instruct", "prompt": "hi"}')
        assert status == 404 and b"team/smol-chat" in data, data
        assert raw_post(rtr, "/tokenize", b'{"model": "team/smol-chat", "prompt": "hi"}')[0] == 200
    router = baton_bin.parent / "baton-router"
    r = subprocess.run([str(router), "--model", str(default_model), "--etcd", "http://127.0.0.1:1",
                        "--served-model-name", "two words"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--served-model-name" in r.stderr, r.stderr


def test_no_decode_node_503(default_model):
    with EtcdServer() as etcd, start_router(etcd, default_model) as rtr:
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            cl.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            list(cl.completions.create(model="", prompt="hi", max_tokens=2, stream=True))
        assert e.value.status_code == 503


def test_kill9_mid_stream_migrates_without_gap_or_duplicate(default_model):
    """Two greedy and three seeded sampled streams; the decode node running most of them dies: every stream
    continues on the other node with exactly the tokens an uninterrupted run gives (seeded sampling is keyed by
    position, so it survives migration). Sampling is real: other seeds, and the n choices of one request, differ."""
    import threading
    cook = "The best way to learn to cook is"
    cases = [(PROMPT, None), ("Once upon a time", None), (cook, 11), (cook, 12), ("def fibonacci(n):", 13)]
    with EtcdServer() as etcd, \
            start_decode(etcd, default_model, threads=1, node_id="dec-1") as d1, \
            start_decode(etcd, default_model, threads=1, node_id="dec-2") as d2, \
            start_router(etcd, default_model) as rtr:
        wait_nodes(rtr, 2)
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=120)

        def kw(p, seed):
            # long enough that the streams are still running when the node dies (60 tokens can finish in under a
            # second, before the kill)
            sampling = dict(temperature=0) if seed is None else dict(temperature=0.9, top_p=0.95, seed=seed)
            return dict(model="", prompt=p, max_tokens=240, extra_body={"ignore_eos": True}, **sampling)

        want = [cl.completions.create(**kw(*c)).choices[0].text for c in cases]
        assert want[2] != want[3], "seeds 11 and 12 sampled the same 240 tokens"
        two = cl.completions.create(model="", prompt=cook, max_tokens=40, temperature=0.9, seed=5, n=2)
        assert len(two.choices) == 2 and two.choices[0].text != two.choices[1].text, two
        got = [[] for _ in cases]
        started = threading.Barrier(len(cases) + 1)
        errors = []

        def consume(i):
            try:
                it = iter(cl.completions.create(stream=True, **kw(*cases[i])))
                first = next(it)
                got[i].append(first.choices[0].text)
                started.wait(60)
                for ch in it:
                    if ch.choices:
                        got[i].append(ch.choices[0].text)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        started.wait(60)
        time.sleep(0.3)
        run = {d: d.metric("baton_running_sequences") or 0 for d in (d1, d2)}
        victim = max(run, key=run.get)
        # 5 streams on 2 nodes: the victim runs at least 3, so at least one of them is a sampled stream
        assert sum(run.values()) == len(cases) and run[victim] >= 3, run
        victim.kill()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for c, g, w in zip(cases, got, want):
            assert "".join(g) == w, c
        assert rtr.metric("baton_migrations_total") >= 3


def test_64_concurrent_streams(client):
    from concurrent.futures import ThreadPoolExecutor
    prompts = [f"Count from {i} to {i + 5}:" for i in range(8)]
    want = {p: client.completions.create(model="", prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts}

    def one(i):
        p = prompts[i % len(prompts)]
        chunks = list(client.completions.create(model="", prompt=p, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return p, text, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(64) as ex:
        results = list(ex.map(one, range(64)))
    for p, text, n in results:
        assert text == want[p] and n == 8


def test_100_random_disconnects_return_kv_blocks(cluster, client):
    """100 streaming clients hang up at random moments: before the answer's headers, before the first token,
    mid-stream, or not at all; every KV block comes back and the router serves the next request."""
    import random
    import threading
    _, dec, rtr = cluster
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (dec.metric("baton_running_sequences") or 0) > 0:
        time.sleep(0.1)
    time.sleep(0.3)
    base = dec.metric("baton_kv_blocks_used")
    cancelled0 = dec.metric("baton_requests_total", 'status="cancelled"')
    host, port = rtr.http_addr.rsplit(":", 1)
    rng = random.Random(5)
    seen = {"headers": 0, "early": 0, "mid": 0, "done": 0}
    errors = []
    lock = threading.Lock()

    def one(seed):
        r = random.Random(seed)
        mode = r.choices(["headers", "early", "mid", "done"], weights=[15, 20, 55, 10])[0]
        chat = r.random() < 0.5
        body = {"max_tokens": 24, "stream": True, "ignore_eos": True, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me a story number {seed}."}]
        else:
            body["prompt"] = f"Story number {seed}: once upon a time"
        c = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            c.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            if mode == "headers":
                time.sleep(r.random() * 0.05)
            else:
                resp = c.getresponse()
                if resp.status != 200:
                    raise AssertionError(f"status {resp.status}: {resp.read()[:200]!r}")
                # chat streams open with a role-only chunk: the first token is in data event 2 (1 for completions)
                first = 2 if chat else 1
                want = {"early": first - 1, "mid": first + r.randint(0, 16), "done": 10 ** 9}[mode]
                got = b""
                while got.count(b"data: ") < want:
                    chunk = resp.read1(4096)
                    if not chunk:
                        break
                    got += chunk
                if mode == "done" and b"data: [DONE]" not in got:
                    raise AssertionError(f"stream ended without [DONE]: {got[-200:]!r}")
                if mode == "mid":
                    time.sleep(r.random() * 0.05)
            with lock:
                seen[mode] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"{mode}: {e!r}")
        finally:
            if c.sock:
                c.sock.close()
            c.close()

    threads = [threading.Thread(target=one, args=(rng.randint(0, 10 ** 6),)) for _ in range(100)]
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.01)
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert all(seen[k] > 0 for k in seen), seen
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and dec.metric("baton_kv_blocks_used") > base:
        time.sleep(0.1)
    assert dec.metric("baton_kv_blocks_used") <= base, (base, dec.metric("baton_kv_blocks_used"))
    # the node saw the hang-ups as cancels (a stream the node finished before the router noticed counts as ok)
    assert dec.metric("baton_requests_total", 'status="cancelled"') > cancelled0
    assert rtr.health() == 200
    r = client.completions.create(model="", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4


def test_overload_429(default_model):
    with EtcdServer() as etcd, start_decode(etcd, default_model, threads=1, node_id="dec-o") as dec, \
            start_router(etcd, default_model, max_inflight=1) as rtr:
        wait_nodes(rtr, 1)
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=60)
        long = cl.completions.create(model="", prompt=PROMPT, max_tokens=200, stream=True,
                                     extra_body={"ignore_eos": True})
        next(iter(long))
        with pytest.raises(openai.RateLimitError):
            cl.completions.create(model="", prompt=PROMPT, max_tokens=2)
        long.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                assert cl.completions.create(model="", prompt=PROMPT, max_tokens=2).choices[0].text
                break
            except openai.RateLimitError:
                time.sleep(0.1)
        else:
            raise AssertionError("still 429 after the stream ended")
