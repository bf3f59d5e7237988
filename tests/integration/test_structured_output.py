"""Structured output through a real local cluster (issue 23 item 3): response_format json_schema over the schema
corpus (tests/data/json_schema_corpus.json) with the default model, every output that finished validated with
Python's jsonschema; json_object, regex and grammar extensions; the same tokens with and without speculative
decoding and with n > 1 and logprobs; a prefill node sampling the first token under the grammar."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import re

import jsonschema
import openai
import pytest

from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from harness.router_procs import start_router
from test_router_openai import wait_nodes

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "json_schema_corpus.json"


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd:
        with start_decode(etcd, default_model, threads=1, node_id="dec-s", spec="ngram") as dec:
            with start_router(etcd, default_model) as rtr:
                wait_nodes(rtr, 1)
                yield etcd, dec, rtr


@pytest.fixture(scope="module")
def client(cluster):
    _, _, rtr = cluster
    return openai.OpenAI(base_url=rtr.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(client, schema, name, **kw):
    return client.chat.completions.create(
        model="", messages=[{"role": "user", "content": f"Reply with a JSON value for '{name}'."}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        max_tokens=kw.pop("max_tokens", 160), temperature=kw.pop("temperature", 0.7), seed=kw.pop("seed", 1), **kw)


def test_schema_corpus_validates(client):
    corpus = json.loads(CORPUS.read_text())
    assert len(corpus) >= 50
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda e: ask(client, e["schema"], e["name"]), corpus))
    valid, truncated, failures = 0, 0, []
    for entry, r in zip(corpus, answers):
        ch = r.choices[0]
        if ch.finish_reason != "stop":
            truncated += 1
            continue
        try:
            jsonschema.Draft202012Validator(entry["schema"], format_checker=jsonschema.FormatChecker()).validate(
                json.loads(ch.message.content))
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{entry['name']}: {ch.message.content!r}: {str(e).splitlines()[0]}")
    print(f"schema corpus: {valid} of {len(corpus)} valid, {truncated} cut by max_tokens, {len(failures)} invalid")
    assert not failures, "\n".join(failures)
    assert valid >= len(corpus) * 3 // 4


def test_json_object_regex_grammar(client):
    msgs = [{"role": "user", "content": "Describe a cat."}]
    r = client.chat.completions.create(model="", messages=msgs, response_format={"type": "json_object"},
                                       max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=40, temperature=0.8, seed=3,
                                       response_format={"type": "regex", "regex": "(yes|no), [a-z]{2,8}\\."})
    assert re.fullmatch(r"(yes|no), [a-z]{2,8}\.", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"  # nothing may follow the final '.'
    r = client.chat.completions.create(model="", messages=msgs, max_tokens=10, temperature=0,
                                       response_format={"type": "grammar", "grammar": 'root ::= "meow" | "purr"'})
    assert r.choices[0].message.content in ("meow", "purr") and r.choices[0].finish_reason == "stop"


def test_speculation_n_logprobs_compose(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                        "maxItems": 3}}, "required": ["name", "tags"]}
    a = ask(client, schema, "thing", temperature=0, max_tokens=80, logprobs=True, top_logprobs=3)
    b = ask(client, schema, "thing", temperature=0, max_tokens=80, logprobs=True, top_logprobs=3,
            extra_body={"speculative": False})
    assert a.choices[0].message.content == b.choices[0].message.content
    la = [t.logprob for t in a.choices[0].logprobs.content]
    lb = [t.logprob for t in b.choices[0].logprobs.content]
    assert la == lb
    for t in a.choices[0].logprobs.content:  # the masked distribution: every alternative is allowed, so <= 0
        assert t.logprob <= 0 and all(x.logprob <= 0 for x in t.top_logprobs)
    r = ask(client, schema, "thing", temperature=1.0, max_tokens=80, n=3, seed=5)
    for ch in r.choices:
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), schema)


def test_stop_string_cuts_constrained_output(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    r = ask(client, schema, "pair", temperature=0, stop=[","])
    assert "," not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


def test_prefill_node_first_token_obeys(default_model):
    with EtcdServer() as etcd:
        with start_prefill(etcd, default_model, threads=1, node_id="pre-s"), \
             start_decode(etcd, default_model, threads=1, node_id="dec-p") as dec, \
             start_router(etcd, default_model, extra_args=["--prefill-mode", "remote"]) as rtr:
            wait_nodes(rtr, 1)
            c = openai.OpenAI(base_url=rtr.base_url, api_key="unused", max_retries=0, timeout=300)
            r = c.chat.completions.create(
                model="", messages=[{"role": "user", "content": "Pick one. " * 40}], max_tokens=10, temperature=1.0,
                seed=9, response_format={"type": "grammar", "grammar": 'root ::= "alpha" | "beta" | "gamma"'})
            assert r.choices[0].message.content in ("alpha", "beta", "gamma")
            assert (dec.metric("baton_remote_prefills_total", 'result="ok"') or 0) >= 1, dec.log()[-3000:]


def test_grpc_response_format(cluster, tmp_path_factory):
    import grpc
    from harness import pygen
    pb2, pb2_grpc = pygen.api_stubs(tmp_path_factory)
    _, _, rtr = cluster
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                              "maximum": 9}}, "required": ["ok", "n"]}
    with grpc.insecure_channel(rtr.grpc_addr) as ch:
        stub = pb2_grpc.GenerationStub(ch)
        chat = pb2.ChatMessages(messages=[pb2.ChatMessage(role="user", content="Answer in JSON.")])
        req = pb2.GenerateRequest(chat=chat, max_tokens=60, sampling=pb2.SamplingParams(temperature=0),
                                  response_format=pb2.ResponseFormat(json_schema=json.dumps(schema)))
        msgs = list(stub.Generate(req, timeout=120))
        assert msgs[-1].finish_reason == pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads("".join(m.text for m in msgs)), schema)
        bad = pb2.GenerateRequest(chat=chat, max_tokens=4, response_format=pb2.ResponseFormat(
            json_schema=json.dumps({"type": "object", "patternProperties": {"a": {}}})))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "patternProperties" in e.value.details()
