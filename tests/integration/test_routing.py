"""The router's routing policy end to end (DESIGN 3 "Overload", 7): real etcd, one prefill node, two decode nodes and
two routers on the same cluster, one with a tiny TTFT SLO and one with a loose one.

Checks: with one decode node kept busy by long streams, the tiny-SLO router refuses at once (HTTP 429, gRPC
RESOURCE_EXHAUSTED) while the loose one answers 200; the power-of-two-choices pick sends new requests to the idle
decode node (measured over 50 requests); and the placement and planner metrics carry values under that load:
baton_router_predicted_ttft_seconds (one observation per placed request), baton_prefill_seconds (prefill node) and
baton_remote_prefill_seconds (decode node) (one per remote prefill), baton_planner_desired_replicas (the node counts
while no node has measured a rate, then a whole number >= 1)."""
import concurrent.futures as cf
import json
import time

import grpc
import openai
import pytest

from conftest import ROOT
from harness import pygen
from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from harness.router_procs import start_router

N_REQUESTS = 50
BUSY_STREAMS = 4


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.generate(ROOT / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))


def family_sum(proc, name):
    """Sum of every series of one metric family (all label values), 0 when absent."""
    total = 0.0
    for line in proc.metrics().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def load_report(etcd, node_id):
    raw = etcd.get(f"/baton/default/load/{node_id}")
    return json.loads(raw) if raw else None


def wait_for(cond, what, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id="rp-1") as p, \
            start_decode(etcd, default_model, threads=1, node_id="rd-busy") as busy, \
            start_decode(etcd, default_model, threads=1, node_id="rd-idle") as idle, \
            start_router(etcd, default_model, prefill_mode="remote", ttft_slo_ms=600000) as loose, \
            start_router(etcd, default_model, ttft_slo_ms=1) as tight:
        for r in (loose, tight):
            wait_for(lambda r=r: json.loads(r.http("/health")[1]).get("decode_nodes") == 2, "2 decode nodes")
        wait_for(lambda: all(load_report(etcd, i) for i in ("rp-1", "rd-busy", "rd-idle")), "load reports")
        yield {"etcd": etcd, "p": p, "busy": busy, "idle": idle, "loose": loose, "tight": tight}


def keep_busy(pb, node, n):
    """n long greedy streams run directly on node (its internal Decode/Run): it is busy, the routers did not
    place them. Returns (channel, calls): cancel the calls and close the channel to stop."""
    nm, g = pb["baton.v1.node_pb2"], pb["baton.v1.generate_pb2"]
    ch = grpc.insecure_channel(node.grpc_addr)
    stub = pb["baton.v1.node_pb2_grpc"].DecodeStub(ch)
    calls = []
    for i in range(n):
        req = nm.DecodeRunRequest(request_id=f"busy-{i}", prompt_token_ids=[1, 504, 3458 + i, 314, 260],
                                  max_tokens=4000, ignore_eos=True, sampling=g.SamplingParams(temperature=0.0))
        calls.append(stub.Run(req, timeout=600))
    for c in calls:
        next(c)  # running: its first token is out
    return ch, calls


def test_planner_answers_node_counts_without_rates(cluster):
    """Before any node has measured a rate the planner has nothing better than the node counts."""
    etcd, loose = cluster["etcd"], cluster["loose"]
    loads = [load_report(etcd, i) for i in ("rp-1", "rd-busy", "rd-idle")]
    if any(ld.get("prefill_tok_s", 0) > 0 or ld.get("decode_tok_s", 0) > 0 for ld in loads):
        pytest.fail(f"a node reports a measured rate before any request: {loads}")
    time.sleep(1.5)  # one planner tick (1 s) after the view is complete
    assert loose.metric("baton_planner_desired_replicas", 'role="prefill"') == 1
    assert loose.metric("baton_planner_desired_replicas", 'role="decode"') == 2


def test_busy_node_slo_admission_and_pick(pb, cluster):
    etcd, p, busy, idle, loose, tight = (cluster[k] for k in ("etcd", "p", "busy", "idle", "loose", "tight"))
    ch, calls = keep_busy(pb, busy, BUSY_STREAMS)
    try:
        # the routers see the busy node through its load report
        wait_for(lambda: (load_report(etcd, "rd-busy") or {}).get("running_seqs", 0) >= BUSY_STREAMS,
                 "the busy node's load report")

        # tiny SLO: refused at once, on both APIs, with the reason
        cl_tight = openai.OpenAI(base_url=tight.base_url, api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as e:
            cl_tight.completions.create(model="", prompt="Hello there", max_tokens=2)
        assert "exceeds the TTFT SLO" in str(e.value)
        g = pb["baton.v1.generate_pb2"]
        with grpc.insecure_channel(tight.grpc_addr) as tch:
            stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(tch)
            with pytest.raises(grpc.RpcError) as ge:
                list(stub.Generate(g.GenerateRequest(text="Hello there", max_tokens=2), timeout=30))
            assert ge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT SLO" in ge.value.details()
        assert family_sum(busy, "baton_requests_total") == family_sum(idle, "baton_requests_total") == 0

        # loose SLO: N requests answered 200, and the pick sends them to the idle node
        before = {k: family_sum(n, "baton_requests_total") for k, n in (("busy", busy), ("idle", idle))}
        ttft_count0 = loose.metric("baton_router_predicted_ttft_seconds_count") or 0
        cl = openai.OpenAI(base_url=loose.base_url, api_key="x", max_retries=0, timeout=120)

        def one(i):
            r = cl.completions.create(model="", prompt=f"Request {i}: the sky is", max_tokens=2, temperature=0)
            return r.choices[0].text

        with cf.ThreadPoolExecutor(max_workers=2) as ex:
            texts = list(ex.map(one, range(N_REQUESTS)))
        assert all(texts), texts
        wait_for(lambda: sum(family_sum(n, "baton_requests_total") for n in (busy, idle))
                 - sum(before.values()) >= N_REQUESTS, "the decode nodes' request counters")
        went = {k: family_sum(n, "baton_requests_total") - before[k] for k, n in (("busy", busy), ("idle", idle))}
        print(f"requests by decode node: {went}")
        assert went["busy"] + went["idle"] == N_REQUESTS, went
        assert went["idle"] >= 0.9 * N_REQUESTS, f"power of two choices sent {went} (busy node runs {BUSY_STREAMS})"

        # metrics under that load, each with a value
        ttft_count = loose.metric("baton_router_predicted_ttft_seconds_count")
        assert ttft_count - ttft_count0 == N_REQUESTS
        assert loose.metric("baton_router_predicted_ttft_seconds_sum") > 0
        assert loose.metric("baton_router_prefill_decisions_total", 'choice="remote"') == N_REQUESTS
        assert p.metric("baton_prefill_seconds_count") == N_REQUESTS and p.metric("baton_prefill_seconds_sum") > 0
        remote_counts = [d.metric("baton_remote_prefill_seconds_count") or 0 for d in (busy, idle)]
        assert sum(remote_counts) == N_REQUESTS, remote_counts
        assert idle.metric("baton_remote_prefill_seconds_sum") > 0
        for role in ("prefill", "decode"):
            v = loose.metric("baton_planner_desired_replicas", f'role="{role}"')
            assert v is not None and v >= 1 and v == int(v), (role, v)
    finally:
        for c in calls:
            c.cancel()
        ch.close()
    wait_for(lambda: busy.metric("baton_running_sequences") == 0, "the busy node to drain")
