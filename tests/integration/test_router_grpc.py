"""baton-router's public gRPC API (baton.v1.Generation) with real grpcio stubs generated from proto/ at test time:
Generate (server-streaming, equal to the HTTP answer and to `baton generate`), Tokenize, Detokenize, ListModels,
grpc.health.v1 Check, INVALID_ARGUMENT / NOT_FOUND / UNAUTHENTICATED / UNAVAILABLE."""
from __future__ import annotations

import pathlib
import subprocess
import time

import grpc
import pytest

from harness import pygen
from harness.baton_procs import start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router
from test_router_openai import PROMPT, baton_generate, wait_nodes

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.api_stubs(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd:
        with start_decode(etcd, default_model, threads=1, node_id="dec-g") as dec:
            with start_router(etcd, default_model) as rtr:
                wait_nodes(rtr, 1)
                yield etcd, dec, rtr


@pytest.fixture(scope="module")
def stub(cluster, pb):
    _, _, rtr = cluster
    ch = grpc.insecure_channel(rtr.grpc_addr)
    yield pb[1].GenerationStub(ch)
    ch.close()


def health(addr):
    with grpc.insecure_channel(addr) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        return check(b"", timeout=5)


def test_health_serving(cluster):
    assert health(cluster[2].grpc_addr) == b"\x08\x01"  # HealthCheckResponse{status: SERVING}


def test_generate_text_equals_baton_generate(stub, pb, baton_bin, default_model):
    pb2 = pb[0]
    req = pb2.GenerateRequest(text=PROMPT, max_tokens=20, sampling=pb2.SamplingParams(temperature=0))
    msgs = list(stub.Generate(req, timeout=120))
    text = "".join(m.text for m in msgs)
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) == 20
    assert msgs[-1].finish_reason == pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 20 and msgs[-1].usage.prompt_tokens > 0
    assert all(m.request_id == msgs[0].request_id for m in msgs)
    assert text == baton_generate(baton_bin, default_model, "--prompt", PROMPT, "--max-tokens", "20")


def test_generate_chat_logprobs_n_and_stop(stub, pb):
    pb2 = pb[0]
    chat = pb2.ChatMessages(messages=[pb2.ChatMessage(role="user", content="Name a colour.")])
    msgs = list(stub.Generate(pb2.GenerateRequest(chat=chat, max_tokens=8, n=2, logprobs=True, top_logprobs=2,
                                                  sampling=pb2.SamplingParams(temperature=0)), timeout=120))
    by = {}
    for m in msgs:
        by.setdefault(m.index, []).append(m)
        assert len(m.logprobs) == len(m.token_ids)
        for lp in m.logprobs:
            assert len(lp.top) == 2 and lp.logprob <= 0
    assert sorted(by) == [0, 1]
    assert "".join(m.text for m in by[0]) == "".join(m.text for m in by[1])
    full = "".join(m.text for m in stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=24), timeout=120))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    msgs = list(stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=24, stop=[stop]), timeout=120))
    assert "".join(m.text for m in msgs) == full[:full.index(stop)]
    assert msgs[-1].finish_reason == pb2.FINISH_REASON_STOP and msgs[-1].stop == stop


def test_tokenize_detokenize_list_models(stub, pb):
    pb2 = pb[0]
    t = stub.Tokenize(pb2.TokenizeRequest(text="Hello world"), timeout=10)
    assert len(t.token_ids) >= 2 and t.max_context > 0
    d = stub.Detokenize(pb2.DetokenizeRequest(token_ids=t.token_ids), timeout=10)
    assert d.text == "Hello world"
    chat = stub.Tokenize(pb2.TokenizeRequest(chat=pb2.ChatMessages(messages=[pb2.ChatMessage(role="user",
                                                                                             content="hi")])))
    assert len(chat.token_ids) > len(t.token_ids)
    models = stub.ListModels(pb2.ListModelsRequest(), timeout=10).models
    assert len(models) == 1 and models[0].id and models[0].context_length == t.max_context


@pytest.mark.parametrize("kw,code", [
    (dict(text=PROMPT, max_tokens=10 ** 6), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, n=1000), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, top_logprobs=50), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, stop=["a", "b", "c", "d", "e"]), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, model="nope"), grpc.StatusCode.NOT_FOUND),
    (dict(token_ids={"ids": [-5]}), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"temperature": 9}), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"top_p": 0}), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"logit_bias": [{"token_id": 10 ** 6, "bias": 1}]}), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"logit_bias": [{"token_id": 5, "bias": 101}]}), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"logit_bias": [{"token_id": 5, "bias": 1}, {"token_id": 5, "bias": 2}]}),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text=PROMPT, sampling={"logit_bias": [{"token_id": i, "bias": 1} for i in range(301)]}),
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_generate_errors(stub, pb, kw, code):
    pb2 = pb[0]
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb2.GenerateRequest(**kw), timeout=30))
    assert e.value.code() == code


def test_generate_logit_bias(stub, pb):
    pb2 = pb[0]
    greedy = [t for m in stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=3,
                                                          sampling=pb2.SamplingParams(temperature=0)), timeout=60)
              for t in m.token_ids]
    (paris,) = stub.Tokenize(pb2.TokenizeRequest(text=" Paris"), timeout=10).token_ids
    forced = paris if greedy[0] != paris else greedy[0] + 1

    def first(bias):
        sp = pb2.SamplingParams(temperature=0, logit_bias=[pb2.LogitBias(token_id=t, bias=b) for t, b in bias])
        msgs = list(stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=3, sampling=sp), timeout=60))
        return [t for m in msgs for t in m.token_ids][0]

    assert first([(forced, 100)]) == forced
    assert first([(greedy[0], -100)]) != greedy[0]
    assert first([(greedy[0], 0)]) == greedy[0]


def test_bad_protobuf_and_keeps_serving(cluster, stub, pb):
    _, _, rtr = cluster
    with grpc.insecure_channel(rtr.grpc_addr) as ch:
        raw = ch.unary_stream("/baton.v1.Generation/Generate", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\xff\xff\xff\xff\x0f", timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    pb2 = pb[0]
    assert len(list(stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=2), timeout=60))) >= 1


def test_cancel_frees_kv_blocks(cluster, stub, pb):
    _, dec, rtr = cluster
    pb2 = pb[0]
    time.sleep(0.3)
    base = dec.metric("baton_kv_blocks_used")
    call = stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=2000, ignore_eos=True), timeout=120)
    for i, _ in enumerate(call):
        if i == 5:
            break
    call.cancel()
    used = dec.wait_metric("baton_kv_blocks_used", lambda v: v <= base, timeout=10)
    # a failure says what the node still holds (a running or waiting request, or blocks held by none) and why
    state = {k: dec.metric(f"baton_{k}") for k in ("running_sequences", "waiting_requests")}
    assert used <= base, (used, base, state, dec.log()[-3000:], rtr.log()[-2000:])


def test_api_key_and_unavailable(default_model, pb):
    pb2, pb2_grpc = pb
    with EtcdServer() as etcd, start_router(etcd, default_model, api_key="k1") as rtr:
        with grpc.insecure_channel(rtr.grpc_addr) as ch:
            s = pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                s.ListModels(pb2.ListModelsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            md = [("authorization", "Bearer k1")]
            assert len(s.ListModels(pb2.ListModelsRequest(), metadata=md, timeout=10).models) == 1
            with pytest.raises(grpc.RpcError) as e:
                list(s.Generate(pb2.GenerateRequest(text="hi", max_tokens=2), metadata=md, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_tls(default_model, pb, tmp_path):
    pb2, pb2_grpc = pb
    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(crt)],
                   check=True, capture_output=True)
    with EtcdServer() as etcd, start_router(etcd, default_model, grpc_tls_cert=crt, grpc_tls_key=key) as rtr:
        creds = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
        with grpc.secure_channel(rtr.grpc_addr, creds) as ch:
            models = pb2_grpc.GenerationStub(ch).ListModels(pb2.ListModelsRequest(), timeout=10).models
            assert len(models) == 1
        with grpc.insecure_channel(rtr.grpc_addr) as ch:
            with pytest.raises(grpc.RpcError):
                pb2_grpc.GenerationStub(ch).ListModels(pb2.ListModelsRequest(), timeout=3)


def test_deadlines_end_the_work(cluster, stub, pb, default_model):
    """A gRPC client's own deadline reaches the decode node (its Decode/Run carries what is left of it), and the
    router's --request-timeout-s bounds an HTTP request: both end a 2,000-token generation early with
    DEADLINE_EXCEEDED / HTTP 504, and every KV block comes back."""
    import requests

    etcd, dec, _ = cluster
    pb2 = pb[0]
    time.sleep(0.3)
    base = dec.metric("baton_kv_blocks_used")

    def blocks_back():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and dec.metric("baton_kv_blocks_used") > base:
            time.sleep(0.1)
        return dec.metric("baton_kv_blocks_used") <= base

    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb2.GenerateRequest(text=PROMPT, max_tokens=2000, ignore_eos=True), timeout=1.5))
    took = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert took < 5, took
    assert blocks_back()

    with start_router(etcd, default_model, request_timeout_s=1) as rtr:
        wait_nodes(rtr, 1)
        t0 = time.monotonic()
        r = requests.post(rtr.base_url + "/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert "deadline" in r.json()["error"]["message"].lower()
        assert took < 5, took
    assert blocks_back()


def test_http_tokenize_detokenize_equal_grpc(cluster, stub, pb):
    """POST /tokenize and /detokenize (vLLM's shapes) give the gRPC API's ids and text, for text and for a chat;
    bad bodies are a 400 naming the field, an unknown model a 404."""
    import json

    from test_router_openai import raw_post

    _, _, rtr = cluster
    pb2 = pb[0]

    def post(path, body):
        status, data = raw_post(rtr, path, json.dumps(body).encode())
        return status, json.loads(data)

    text = "Hello world <|im_start|> and 東京"
    g = stub.Tokenize(pb2.TokenizeRequest(text=text, add_special_tokens=True), timeout=10)
    status, t = post("/tokenize", {"prompt": text})
    assert status == 200 and t["tokens"] == list(g.token_ids) and t["count"] == len(g.token_ids)
    assert t["max_model_len"] == g.max_context
    status, t2 = post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and t2["tokens"] == list(stub.Tokenize(pb2.TokenizeRequest(text=text), timeout=10).token_ids)
    msgs = [{"role": "user", "content": "hi <|im_end|>"}]
    gc = stub.Tokenize(pb2.TokenizeRequest(chat=pb2.ChatMessages(messages=[pb2.ChatMessage(**m) for m in msgs])))
    status, tc = post("/tokenize", {"messages": msgs})
    assert status == 200 and tc["tokens"] == list(gc.token_ids)
    status, d = post("/detokenize", {"tokens": t2["tokens"]})
    assert status == 200 and d["prompt"] == stub.Detokenize(pb2.DetokenizeRequest(token_ids=t2["tokens"])).text == text
    for path, body, field in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                              ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [1.5]}, "tokens")]:
        status, e = post(path, body)
        assert status == 400 and field in e["error"]["message"], (path, body, e)
    assert post("/tokenize", {"prompt": "x", "model": "nope"})[0] == 404
