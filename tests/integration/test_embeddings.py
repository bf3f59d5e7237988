"""/v1/embeddings end to end (issue 23.5): real etcd, baton-router and baton-decode processes, the real openai client.

Checks: the openai client's embeddings call (which asks for base64) and encoding_format "float" give exactly the
vectors `baton embed` prints (same engine, batch-invariant, so bit for bit; `baton embed` itself is checked against
the float64 oracle in test_logits_oracle.py); token-id inputs equal their text; a vector does not depend on what is
batched with it, generation requests included; bad bodies are 400 naming the field and the server goes on; with a
prefill node in the cluster the embeddings are computed on a decode node; when the decode node computing a request
is killed, the request is answered by the other one."""
import base64
import json
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from harness import pygen
from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from harness.router_procs import start_router
from test_disagg_router import wait_nodes

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
         "Embeddings map text to vectors.", "a"]
DIM = 576


def cli_embed(baton_bin, model, texts):
    r = subprocess.run([str(baton_bin), "embed", "--model", str(model), *texts], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    # the CLI prints %.9g: parsed back to float32 it is the engine's value exactly
    return [[struct.unpack("<f", struct.pack("<f", v))[0] for v in row] for row in rows]


def post(base_url, path, body, timeout=120):
    req = urllib.request.Request(base_url.rsplit("/v1", 1)[0] + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def as_f32(vec):
    return [struct.unpack("<f", struct.pack("<f", v))[0] for v in vec]


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.api_stubs(tmp_path_factory)


@pytest.fixture(scope="module")
def cli_vectors(baton_bin, default_model):
    return cli_embed(baton_bin, default_model, TEXTS)


def test_embeddings_api(default_model, cli_vectors, pb):
    with EtcdServer() as etcd, start_decode(etcd, default_model, threads=1, node_id="dec-1") as d, \
            start_router(etcd, default_model) as rtr:
        wait_nodes(etcd, ["dec-1"])
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=120)

        # the openai client (base64 on the wire, decoded by the client)
        r = cl.embeddings.create(model="smollm2-135m-instruct", input=TEXTS)
        assert [e.index for e in r.data] == list(range(len(TEXTS)))
        got = [as_f32(e.embedding) for e in r.data]
        assert got == cli_vectors
        assert r.model == "smollm2-135m-instruct"
        tok = [post(rtr.base_url, "/tokenize", {"prompt": t})[1]["tokens"] for t in TEXTS]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in tok)
        for v in got:
            assert len(v) == DIM and abs(sum(x * x for x in v) - 1.0) < 1e-5

        # encoding_format float, one string; explicit base64 decoded here
        st, body = post(rtr.base_url, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"})
        assert st == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding", body
        assert as_f32(body["data"][0]["embedding"]) == cli_vectors[0]
        st, body = post(rtr.base_url, "/v1/embeddings", {"input": TEXTS[1:3], "encoding_format": "base64"})
        assert st == 200, body
        for i, e in enumerate(body["data"]):
            raw = base64.b64decode(e["embedding"])
            assert list(struct.unpack(f"<{DIM}f", raw)) == cli_vectors[1 + i]

        # token ids (one list, a list of lists) equal their text
        st, body = post(rtr.base_url, "/v1/embeddings", {"input": tok[0], "encoding_format": "float"})
        assert st == 200 and as_f32(body["data"][0]["embedding"]) == cli_vectors[0]
        st, body = post(rtr.base_url, "/v1/embeddings", {"input": tok, "encoding_format": "float"})
        assert st == 200 and [as_f32(e["embedding"]) for e in body["data"]] == cli_vectors
        assert body["usage"]["prompt_tokens"] == sum(len(t) for t in tok)

        # batch invariance: alone, in a crowd of 32 inputs, and beside generation requests
        crowd = [f"filler text number {i} " * (1 + i % 7) for i in range(32)]
        crowd[17] = TEXTS[2]
        gen_errors = []

        def generate():
            try:
                cl.completions.create(model="", prompt="Once upon a time", max_tokens=48,
                                      extra_body={"ignore_eos": True})
            except Exception as e:  # reported below
                gen_errors.append(e)

        gens = [threading.Thread(target=generate) for _ in range(3)]
        for t in gens:
            t.start()
        r2 = cl.embeddings.create(model="", input=crowd)
        for t in gens:
            t.join(120)
        assert not gen_errors, gen_errors
        assert as_f32(r2.data[17].embedding) == cli_vectors[2]
        assert len(r2.data) == 32

        # concurrent requests are batched together by the node and still exact
        outs = [None] * 6
        def one(i):
            outs[i] = cl.embeddings.create(model="", input=TEXTS[i % len(TEXTS)]).data[0].embedding
        ts = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert [as_f32(o) for o in outs] == [cli_vectors[i % len(TEXTS)] for i in range(6)]

        # bad bodies: 400 naming the field (404 for the model), nothing else disturbed
        bad = [({}, "'input' is required"), ({"input": ""}, "empty string"), ({"input": []}, "empty array"),
               ({"input": ["a", 1]}, "'input' must be"), ({"input": [49152]}, "vocabulary"),
               ({"input": "a", "dimensions": 8}, "'dimensions' 8"), ({"input": "a", "encoding_format": "hex"},
                                                                       "'encoding_format'"),
               ({"input": ["a"] * 2049}, "at most 2048"), ({"input": "x" * 40, "user": 3}, "'user'")]
        for b, words in bad:
            st, body = post(rtr.base_url, "/v1/embeddings", b)
            assert st == 400 and words in body["error"]["message"], (b if len(str(b)) < 200 else words, st, body)
        st, body = post(rtr.base_url, "/v1/embeddings", {"input": "a", "model": "gpt-4"})
        assert st == 404, body
        with pytest.raises(openai.BadRequestError):
            cl.embeddings.create(model="", input="a", dimensions=64)
        r3 = cl.embeddings.create(model="", input=TEXTS[3])
        assert as_f32(r3.data[0].embedding) == cli_vectors[3]

        # gRPC Generation/Embed: texts or token ids, the same vectors; bad input is INVALID_ARGUMENT naming it
        pb2, pb2_grpc = pb
        with grpc.insecure_channel(rtr.grpc_addr) as ch:
            stub = pb2_grpc.GenerationStub(ch)
            g = stub.Embed(pb2.EmbedRequest(texts=TEXTS), timeout=60)
            assert [as_f32(e.values) for e in g.data] == cli_vectors
            assert g.prompt_tokens == sum(len(t) for t in tok)
            g = stub.Embed(pb2.EmbedRequest(token_ids=[pb2.TokenIds(ids=t) for t in tok[:2]]), timeout=60)
            assert [as_f32(e.values) for e in g.data] == cli_vectors[:2]
            for req, words in [(pb2.EmbedRequest(), "exactly one of"),
                               (pb2.EmbedRequest(texts=["a"], token_ids=[pb2.TokenIds(ids=[1])]), "exactly one of"),
                               (pb2.EmbedRequest(token_ids=[pb2.TokenIds(ids=[])]), "no tokens"),
                               (pb2.EmbedRequest(token_ids=[pb2.TokenIds(ids=[-5])]), "vocabulary"),
                               (pb2.EmbedRequest(texts=[""]), "empty string")]:
                with pytest.raises(grpc.RpcError) as ei:
                    stub.Embed(req, timeout=30)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in ei.value.details(), \
                    (words, ei.value.details())
            with pytest.raises(grpc.RpcError) as ei:
                stub.Embed(pb2.EmbedRequest(model="nope", texts=["a"]), timeout=30)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND

        # the node counted the calls; nothing is left running or admitted
        assert d.metric("baton_requests_total", 'status="ok"') >= 8
        time.sleep(1.2)
        assert d.metric("baton_running_sequences") == 0
        assert rtr.health() == 200


def test_embeddings_disaggregated_and_failover(default_model, cli_vectors):
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id="pre-1") as p, \
            start_decode(etcd, default_model, threads=1, node_id="dec-1") as d1, \
            start_decode(etcd, default_model, threads=1, node_id="dec-2") as d2, \
            start_router(etcd, default_model, prefill_mode="remote") as rtr:
        wait_nodes(etcd, ["pre-1", "dec-1", "dec-2"])
        time.sleep(0.5)  # the router's watch sees all three
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=120)
        r = cl.embeddings.create(model="", input=TEXTS)
        assert [as_f32(e.embedding) for e in r.data] == cli_vectors
        assert not p.metric("baton_kv_transfer_bytes_total"), "embeddings went through the prefill node"

        # a request long enough to be running when its node dies: the router answers it from the other node
        big = [f"{TEXTS[0]} {i} " * 40 for i in range(48)]
        big[5] = TEXTS[1]
        result, errors = [], []

        def run():
            try:
                result.append(cl.embeddings.create(model="", input=big))
            except Exception as e:  # reported below
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        victim = None
        end = time.monotonic() + 30
        while victim is None and time.monotonic() < end:
            for d in (d1, d2):
                if (d.metric("baton_running_sequences") or 0) > 0:
                    victim = d
                    break
            time.sleep(0.02)
        assert victim is not None, "no decode node ever ran the request"
        victim.kill()
        t.join(180)
        assert not errors, errors
        assert as_f32(result[0].data[5].embedding) == cli_vectors[1]
        assert len(result[0].data) == 48
        assert f"decode node {victim.node_id} failed" in rtr.log(), "the request was not retried"
