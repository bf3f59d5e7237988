"""Embeddings that nobody waits for any more stop at once (issue 23 item 4 mends): an HTTP client that leaves in the
middle of a long /v1/embeddings request makes the router cancel its Decode/Embed call, and the decode node aborts
the inputs (its baton_requests_total{status="cancelled"} counts it, its log says so, no sequence keeps running);
Decode/Abort by request id finds an Embed call in flight, as it finds Run calls. Real etcd, router and decode
processes; a raw socket for the client that leaves, grpcio for the node's own API."""
import json
import re
import socket
import threading
import time
import urllib.parse

import grpc
import openai
import pytest

from harness import pygen
from harness.baton_procs import start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router
from test_disagg_router import wait_nodes


def cancelled_count(node):
    for line in node.metrics().splitlines():
        if line.startswith("baton_requests_total{") and 'status="cancelled"' in line:
            return float(line.split()[-1])
    return 0.0


def status_count(node, status):
    for line in node.metrics().splitlines():
        if line.startswith("baton_requests_total{") and f'status="{status}"' in line:
            return float(line.split()[-1])
    return 0.0


def wait_for(pred, timeout, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return False


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd, start_decode(etcd, default_model, threads=1, node_id="dec-cancel") as d, \
            start_router(etcd, default_model) as rtr:
        wait_nodes(etcd, ["dec-cancel"])
        time.sleep(0.5)  # the router's watch sees the node
        yield etcd, d, rtr


def test_http_client_leaving_cancels_the_embed_call(cluster):
    _, d, rtr = cluster
    big = [f"Embeddings of long texts, part {i}. " * 120 for i in range(48)]  # tens of seconds on one thread
    body = json.dumps({"model": "", "input": big}).encode()
    u = urllib.parse.urlsplit(rtr.base_url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    before, ok_before = cancelled_count(d), status_count(d, "ok")
    assert wait_for(lambda: (d.metric("baton_running_sequences") or 0) > 0, 30), "the node never ran the inputs"
    t0 = time.monotonic()
    s.close()
    # the router notices within its 100 ms polls (plus the socket check); the node aborts after its current step,
    # which a sanitizer build makes seconds long, so that bound is looser
    assert wait_for(lambda: "the client went away; cancelled on decode node dec-cancel" in rtr.log(), 3), rtr.log()
    router_s = time.monotonic() - t0
    assert wait_for(lambda: cancelled_count(d) > before, 60), d.log()[-2000:]
    took = time.monotonic() - t0
    assert wait_for(lambda: (d.metric("baton_running_sequences") or 0) == 0, 5)
    print(f"client left -> router cancelled the call in {router_s:.2f} s, the decode node aborted in {took:.2f} s")
    assert status_count(d, "ok") == ok_before, "the node computed the whole request"
    assert re.search(r"embeddings emb-\d+: cancelled", d.log())
    # the router and the node go on serving
    cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=120)
    r = cl.embeddings.create(model="", input=["still here"], encoding_format="float")
    assert len(r.data) == 1 and len(r.data[0].embedding) == 576


def test_decode_abort_finds_embed_calls(cluster, tmp_path_factory):
    _, d, _ = cluster
    mods = pygen.generate(pygen_root(), tmp_path_factory.mktemp("np"), tmp_path_factory.mktemp("npo"))
    n = mods["baton.v1.node_pb2"]
    with grpc.insecure_channel(d.grpc_addr) as ch:
        stub = mods["baton.v1.node_pb2_grpc"].DecodeStub(ch)
        inputs = [mods["baton.v1.generate_pb2"].TokenIds(ids=[100 + (k * 7 + i) % 20000 for k in range(1500)]) for i in range(32)]
        fut = stub.Embed.future(n.DecodeEmbedRequest(request_id="emb-abort-me", inputs=inputs), timeout=300)
        assert wait_for(lambda: (d.metric("baton_running_sequences") or 0) > 0, 30)
        before = cancelled_count(d)
        assert stub.Abort(n.AbortRequest(request_id="emb-abort-me"), timeout=5).found
        with pytest.raises(grpc.RpcError) as e:
            fut.result(timeout=60)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert wait_for(lambda: cancelled_count(d) > before, 10)
        assert "embeddings emb-abort-me: cancelled" in d.log()
        assert not stub.Abort(n.AbortRequest(request_id="emb-abort-me"), timeout=5).found


def pygen_root():
    import pathlib
    return pathlib.Path(__file__).resolve().parents[2] / "proto"
