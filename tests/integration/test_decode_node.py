"""baton-decode as a user of it sees it: a real process on loopback registered in a real etcd, called with the real
grpcio client (stubs generated from proto/ at test time), scraped over HTTP.

Checks: the etcd record and load report; greedy Decode/Run output equal to `baton generate`; 8 concurrent streams equal
to their solo runs; logprobs; client cancel, deadline and Decode/Abort each return every KV block (/metrics);
bad requests get INVALID_ARGUMENT (or FAILED_PRECONDITION) with a clear message while the node keeps serving;
/metrics passes `promtool check metrics`; SIGTERM drains, deregisters and exits 0; bad flags exit non-zero."""
import json
import subprocess
import threading
import time

import grpc
import pytest

from harness import pygen
from conftest import ROOT, build_dir
from harness.baton_procs import start_decode, wait_registered
from harness.etcd import EtcdServer

PROTO = ROOT / "proto"
QUESTION = "What is the capital of France?"
QUESTIONS = [QUESTION, "Name three primary colors.", "Why is the sky blue?", "Write a haiku about rain.",
             "What is 12 times 7?", "Who wrote Hamlet?", "Give me a synonym for happy.", "How do bees make honey?"]


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.generate(PROTO, tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def node(etcd, default_model):
    with start_decode(etcd, default_model, node_id="decode-t1", threads=2, kv_mem="64M") as d:
        yield d
        rc = d.stop()
        assert rc == 0, d.log()[-3000:]


@pytest.fixture(scope="module")
def stub(pb, node):
    with grpc.insecure_channel(node.grpc_addr) as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield pb["baton.v1.node_pb2_grpc"].DecodeStub(ch)


@pytest.fixture(scope="module")
def chat_ids(baton_bin, default_model):
    """Prompt ids of each question rendered with the model's chat template."""
    out = {}
    for q in QUESTIONS:
        conv = json.dumps([{"role": "user", "content": q}])
        r = subprocess.run([str(baton_bin), "chat-template", "--model", str(default_model), "--tokenize", conv],
                           capture_output=True, text=True, timeout=60, check=True)
        out[q] = [int(t) for t in r.stdout.split()]
    return out


def run(pb, stub, ids, max_tokens=24, timeout=60, **kw):
    """One Decode/Run call: (messages, token ids)."""
    n = pb["baton.v1.node_pb2"]
    msgs = list(stub.Run(n.DecodeRunRequest(prompt_token_ids=ids, max_tokens=max_tokens, **kw), timeout=timeout))
    return msgs, [t for m in msgs for t in m.token_ids]


def wait_metric(node, name, want, timeout=10.0, labels=""):
    return node.wait_metric(name, lambda v: v == want, labels=labels, timeout=timeout)


def test_registers_in_etcd(etcd, node):
    end = time.monotonic() + 10
    rec = load = None
    while time.monotonic() < end and not (rec and load):
        rec = etcd.get("/baton/default/nodes/decode-t1")
        load = etcd.get("/baton/default/load/decode-t1")
        time.sleep(0.05)
    assert rec, f"no NodeInfo in etcd:\n{node.log()}"
    info = json.loads(rec)
    assert info["role"] == "decode" and info["node_id"] == "decode-t1"
    assert info["grpc_addr"] == node.grpc_addr and info["http_addr"] == node.http_addr
    assert len(info["model"]) == 16 and int(info["model"], 16) >= 0
    assert info["capacity"]["kv_blocks"] > 0 and info["capacity"]["kv_block_tokens"] == 16
    assert 0 < info["capacity"]["max_context"] <= info["capacity"]["kv_blocks"] * 16
    assert load and json.loads(load)["kv_blocks_total"] == info["capacity"]["kv_blocks"]
    assert etcd.range("/baton/default/nodes/decode-t1")[0]["lease"] != 0
    assert node.metric("baton_kv_blocks_capacity") == info["capacity"]["kv_blocks"]
    assert "listening grpc=" in node.log() and "KV" in node.log()


def test_health(pb, node):
    h = pb["baton_health.health_pb2"]
    with grpc.insecure_channel(node.grpc_addr) as ch:
        r = pb["baton_health.health_pb2_grpc"].HealthStub(ch).Check(h.HealthCheckRequest(), timeout=5)
    assert r.status == h.HealthCheckResponse.SERVING
    status, body = node.http("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_greedy_equals_generate(pb, stub, node, chat_ids, baton_bin, default_model):
    ids = chat_ids[QUESTION]
    msgs, toks = run(pb, stub, ids, max_tokens=32, request_id="greedy-1",
                     sampling=pb["baton.v1.generate_pb2"].SamplingParams(temperature=0.0))
    r = subprocess.run([str(baton_bin), "generate", "--model", str(default_model), "--chat", QUESTION, "--ids",
                        "--max-tokens", "32", "--threads", "1", "--quiet"],
                       capture_output=True, text=True, timeout=60, check=True)
    want = [int(t) for t in r.stdout.split()]
    assert toks == want
    g = pb["baton.v1.generate_pb2"]
    assert msgs[0].node_id == "decode-t1"
    assert [m.offset for m in msgs] == list(range(len(msgs)))
    assert all(m.finish_reason == g.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert msgs[-1].finish_reason in (g.FINISH_REASON_STOP, g.FINISH_REASON_LENGTH)
    u = msgs[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(ids), len(toks), len(ids) + len(toks))


def test_logprobs_and_migration(pb, stub, chat_ids):
    ids = chat_ids[QUESTION]
    msgs, toks = run(pb, stub, ids, max_tokens=12, logprobs=True, top_logprobs=3, ignore_eos=True)
    assert len(toks) == 12
    for m in msgs:
        (lp,) = m.logprobs
        assert lp.token_id == m.token_ids[0] and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy picks the most likely
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
    # a migrated stream (tokens already delivered) continues exactly where the uninterrupted one went
    msgs2, rest = run(pb, stub, ids, max_tokens=12, generated_token_ids=toks[:5], ignore_eos=True)
    assert rest == toks[5:] and msgs2[0].offset == 5
    assert msgs2[-1].usage.completion_tokens == 12 and msgs2[-1].usage.prompt_tokens == len(ids)


def test_logit_bias(pb, stub, chat_ids):
    g = pb["baton.v1.generate_pb2"]
    ids = chat_ids[QUESTION]
    greedy = g.SamplingParams(temperature=0.0)
    _, base = run(pb, stub, ids, max_tokens=4, sampling=greedy)
    forced = 7042 if base[0] != 7042 else 198
    _, toks = run(pb, stub, ids, max_tokens=4, sampling=g.SamplingParams(
        temperature=0.0, logit_bias=[g.LogitBias(token_id=forced, bias=100)]))
    assert toks[0] == forced
    _, toks = run(pb, stub, ids, max_tokens=4, sampling=g.SamplingParams(
        temperature=0.0, logit_bias=[g.LogitBias(token_id=base[0], bias=-100)]))
    assert toks[0] != base[0]
    # a bias of 0 changes nothing
    _, toks = run(pb, stub, ids, max_tokens=4, sampling=g.SamplingParams(
        temperature=0.0, logit_bias=[g.LogitBias(token_id=base[0], bias=0)]))
    assert toks == base


def test_eight_concurrent_streams(pb, stub, node, chat_ids):
    solo = {q: run(pb, stub, chat_ids[q], max_tokens=24, ignore_eos=True)[1] for q in QUESTIONS}
    results, ttft = {}, {}
    n = pb["baton.v1.node_pb2"]

    def worker(q):
        t0 = time.monotonic()
        toks = []
        for i, m in enumerate(stub.Run(n.DecodeRunRequest(prompt_token_ids=chat_ids[q], max_tokens=24,
                                                          ignore_eos=True), timeout=60)):
            if i == 0:
                ttft[q] = time.monotonic() - t0
            toks.extend(m.token_ids)
        results[q] = toks

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    dt = time.monotonic() - t0
    assert results == solo
    tt = sorted(ttft.values())
    print(f"\n8 concurrent streams x 24 tokens: {dt:.2f} s, {8 / dt:.2f} req/s, {8 * 24 / dt:.0f} tok/s; "
          f"TTFT p50 {tt[3] * 1000:.0f} ms, max {tt[-1] * 1000:.0f} ms")
    assert wait_metric(node, "baton_kv_blocks_used", 0.0) == 0.0


def test_cancel_deadline_abort_free_blocks(pb, stub, node, chat_ids):
    n = pb["baton.v1.node_pb2"]
    g = pb["baton.v1.generate_pb2"]
    assert wait_metric(node, "baton_kv_blocks_used", 0.0) == 0.0
    cancelled0 = node.metric("baton_requests_total", 'status="cancelled"') or 0

    # client cancel mid-stream (max_tokens 0: up to the context, which the node clamps to its KV pool)
    it = stub.Run(n.DecodeRunRequest(prompt_token_ids=chat_ids[QUESTION], max_tokens=0, ignore_eos=True),
                  timeout=60)
    for _, _m in zip(range(5), it):
        pass
    it.cancel()
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert wait_metric(node, "baton_kv_blocks_used", 0.0) == 0.0, node.metrics()
    assert wait_metric(node, "baton_requests_total", cancelled0 + 1, labels='status="cancelled"') == cancelled0 + 1

    # deadline
    with pytest.raises(grpc.RpcError) as e:
        run(pb, stub, chat_ids[QUESTION], max_tokens=2000, ignore_eos=True, timeout=0.7)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_metric(node, "baton_kv_blocks_used", 0.0) == 0.0

    # Decode/Abort by request id: the stream ends with finish_reason ABORT
    it = stub.Run(n.DecodeRunRequest(request_id="abort-me", prompt_token_ids=chat_ids[QUESTION], max_tokens=2000,
                                     ignore_eos=True), timeout=60)
    first = next(it)
    assert first.token_ids
    assert stub.Abort(n.AbortRequest(request_id="abort-me"), timeout=5).found
    rest = list(it)
    assert rest and rest[-1].finish_reason == g.FINISH_REASON_ABORT
    assert not stub.Abort(n.AbortRequest(request_id="abort-me"), timeout=5).found
    assert not stub.Abort(n.AbortRequest(request_id="never-seen"), timeout=5).found
    assert wait_metric(node, "baton_kv_blocks_used", 0.0) == 0.0


def test_bad_requests(pb, stub, node, chat_ids, etcd):
    n = pb["baton.v1.node_pb2"]
    g = pb["baton.v1.generate_pb2"]
    ids = chat_ids[QUESTION]
    bad = [
        (dict(prompt_token_ids=[]), "prompt_token_ids is empty"),
        (dict(prompt_token_ids=ids + [49152]), "outside the vocabulary"),
        (dict(prompt_token_ids=[-1]), "outside the vocabulary"),
        (dict(prompt_token_ids=ids, generated_token_ids=[10 ** 6]), "generated_token_ids"),
        (dict(prompt_token_ids=ids, max_tokens=9000), "exceeds the context"),
        # found by fuzz_node_request: max_tokens past 2^31 wrapped to a negative limit (refused later as "must be >= 0")
        (dict(prompt_token_ids=ids, max_tokens=2 ** 32 - 1), "exceeds the context"),
        (dict(prompt_token_ids=ids, max_tokens=2 ** 31 + 5), "exceeds the context"),
        (dict(prompt_token_ids=[1] * 8192), "exceeds the context"),
        (dict(prompt_token_ids=ids, logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(prompt_token_ids=ids, top_logprobs=3), "logprobs"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(temperature=-1)), "temperature"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(top_p=1.5)), "top_p"),
        (dict(prompt_token_ids=ids, stop_token_ids=list(range(33))), "stop_token_ids"),
        (dict(prompt_token_ids=ids, stop_token_ids=[49152]), "stop"),
        (dict(prompt_token_ids=ids, max_tokens=3, generated_token_ids=[5, 6, 7]), "max_tokens"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(logit_bias=[g.LogitBias(token_id=49152, bias=1)])),
         "sampling.logit_bias[0].token_id"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(logit_bias=[g.LogitBias(token_id=-3, bias=1)])),
         "sampling.logit_bias[0].token_id"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(
            logit_bias=[g.LogitBias(token_id=i, bias=1) for i in range(301)])), "sampling.logit_bias"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(logit_bias=[g.LogitBias(token_id=5, bias=500)])),
         "logit_bias"),
        (dict(prompt_token_ids=ids, sampling=g.SamplingParams(
            logit_bias=[g.LogitBias(token_id=5, bias=1), g.LogitBias(token_id=5, bias=2)])), "logit_bias"),
    ]
    for req, words in bad:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Run(n.DecodeRunRequest(**req), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.value.details())
        assert words in e.value.details(), (req, e.value.details())

    with pytest.raises(grpc.RpcError) as e:
        list(stub.Run(n.DecodeRunRequest(prompt_token_ids=ids, model_fingerprint="0123456789abcdef"), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fingerprint" in e.value.details()

    with grpc.insecure_channel(node.grpc_addr) as ch:
        raw = ch.unary_stream("/baton.v1.Decode/Run")
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\x0a\xff\xff", timeout=10))  # truncated length-delimited field
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # the node keeps serving, and the fingerprint it publishes is accepted
    fp = json.loads(etcd.get("/baton/default/nodes/decode-t1"))["model"]
    _, toks = run(pb, stub, ids, max_tokens=4, model_fingerprint=fp.upper())
    assert len(toks) == 4
    assert (node.metric("baton_requests_total", 'status="invalid"') or 0) >= len(bad) + 1  # + the fingerprint mismatch


def test_metrics_promtool(node):
    text = node.metrics()
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("baton_time_to_first_token_seconds_count", "baton_time_per_output_token_seconds_count",
                 "baton_e2e_request_latency_seconds_count", "baton_generation_tokens_total",
                 "baton_prompt_tokens_total"):
        assert node.metric(name) > 0, name
    for name in ("baton_running_sequences", "baton_waiting_requests", "baton_kv_blocks_used",
                 "baton_kv_blocks_capacity", "baton_queue_time_seconds_count"):
        assert node.metric(name) is not None, name


def test_sigterm_deregisters(etcd, default_model, pb):
    # flags may come from BATON_* variables
    d = start_decode(etcd, default_model, env={"BATON_NODE_ID": "decode-term", "BATON_KV_MEM": "32M"}, threads=1)
    try:
        assert wait_registered(etcd, "decode-term")["grpc_addr"] == d.grpc_addr
        # a stream in flight at SIGTERM is drained (it finishes within the grace period)
        n = pb["baton.v1.node_pb2"]
        got = []
        with grpc.insecure_channel(d.grpc_addr) as ch:
            it = pb["baton.v1.node_pb2_grpc"].DecodeStub(ch).Run(
                n.DecodeRunRequest(prompt_token_ids=[1, 2, 3, 4], max_tokens=40, ignore_eos=True), timeout=30)
            got.append(next(it))
            t0 = time.monotonic()
            rc = d.stop()
            got.extend(it)
        assert rc == 0, d.log()[-3000:]
        assert sum(len(m.token_ids) for m in got) == 40
        assert time.monotonic() - t0 < 10
        assert etcd.get("/baton/default/nodes/decode-term") is None
        assert etcd.get("/baton/default/load/decode-term") is None
        assert "stopped cleanly" in d.log() and "node decode-term" in d.log()
    finally:
        d.close()


def test_serves_while_etcd_is_down(pb, default_model, chat_ids):
    with start_decode("http://127.0.0.1:1", default_model, threads=1, kv_mem="32M") as d:
        with grpc.insecure_channel(d.grpc_addr) as ch:
            _, toks = run(pb, pb["baton.v1.node_pb2_grpc"].DecodeStub(ch), chat_ids[QUESTION], max_tokens=4)
        assert len(toks) == 4
        end = time.monotonic() + 8
        while "not registered in etcd" not in d.log() and time.monotonic() < end:
            time.sleep(0.1)
        t0 = time.monotonic()
        assert d.stop() == 0, d.log()[-3000:]
        assert time.monotonic() - t0 < 8
        assert "not registered in etcd" in d.log()


def test_bad_flags_exit_nonzero(tmp_path):
    exe = str(build_dir() / "bin" / "baton-decode")
    r = subprocess.run([exe, "--no-such-flag"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown option '--no-such-flag'" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([exe, "--model", str(tmp_path / "missing.gguf"), "--etcd", "none"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 1 and "missing.gguf" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([exe, "--kv-mem", "lots"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--kv-mem" in r.stderr
