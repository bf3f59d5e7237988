"""Attacks on the KV path (issue 16 items 1 and 2), run against real nodes in a real etcd with the real grpcio client:

- a forged prefill hint (Decode/Run naming a "prefill node" at an address the caller controls, or a registered prefill
  node's id with another address) is never dialled: the decode node prefills locally, answers exactly what it answers
  without a hint, and counts the refusal;
- a forged Prefill/Run (a caller that names a registered decode node and even carries its real pool descriptor, read
  from etcd, with block ids covering the whole pool under an epoch it made up) writes nothing: the decode node's
  prefix-cached KV gives the same output afterwards as before;
- a destination that is not a registered decode node, or a descriptor that is not the one it registered, is refused
  before any compute.

Shared memory is the transport where these attacks bite hardest: kvtransfer's MAPPED path copies one-sidedly into
the decode node's pool, so before the fix the forged push's bytes landed before any epoch check."""
import base64
import concurrent.futures as cf
import random
import struct

import grpc
import pytest

from conftest import ROOT
from harness import pygen
from harness.baton_procs import start_decode, start_prefill, wait_registered
from harness.etcd import EtcdServer

SHM = {"UCX_TLS": "sm", "UCX_POSIX_ERROR_HANDLING": "y", "UCX_SYSV_ERROR_HANDLING": "y"}
BLOCK = 16  # tokens per KV block


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.generate(ROOT / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))


@pytest.fixture(scope="module")
def cluster(default_model):
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, node_id="p-atk", threads=1, kv_mem="64M", env=SHM) as p, \
            start_decode(etcd, default_model, node_id="d-atk", threads=1, kv_mem="32M", env=SHM) as d:
        wait_registered(etcd, "p-atk")
        rec = wait_registered(etcd, "d-atk")
        yield {"etcd": etcd, "p": p, "d": d, "d_rec": rec}
        for proc in (d, p):
            assert proc.stop() == 0, proc.log()[-3000:]


def generate(pb, stub, ids, hint=None, max_tokens=12):
    n, g = pb["baton.v1.node_pb2"], pb["baton.v1.generate_pb2"]
    req = n.DecodeRunRequest(prompt_token_ids=ids, max_tokens=max_tokens, sampling=g.SamplingParams(temperature=0.0),
                             ignore_eos=True, logprobs=True, prefill=hint)
    msgs = list(stub.Run(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], [round(lp.logprob, 6) for m in msgs for lp in m.logprobs]


class FakePrefill(grpc.GenericRpcHandler):
    """A hostile "prefill node": records every call it receives (it would get the decode node's pool descriptor and
    epoch, and could then complete the expectation with KV of its choosing)."""

    def __init__(self):
        self.calls = []

    def service(self, details):
        self.calls.append(details.method)

        def answer(request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake prefill node")
        return grpc.unary_unary_rpc_method_handler(answer)


@pytest.fixture
def fake_prefill():
    fake = FakePrefill()
    server = grpc.server(cf.ThreadPoolExecutor(max_workers=2), handlers=(fake,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def test_forged_prefill_hint_is_not_followed(pb, cluster, fake_prefill):
    n = pb["baton.v1.node_pb2"]
    fake, fake_addr = fake_prefill
    p, d = cluster["p"], cluster["d"]
    rng = random.Random(11)
    ids = [rng.randrange(200, 40000) for _ in range(70)]
    with grpc.insecure_channel(d.grpc_addr) as ch:
        stub = pb["baton.v1.node_pb2_grpc"].DecodeStub(ch)
        want = generate(pb, stub, ids)  # colocated: no hint
        refused0 = d.metric("baton_remote_prefills_total", 'result="refused"') or 0
        forged = [n.PrefillHint(node_id="evil", grpc_address=fake_addr),          # not a member at all
                  n.PrefillHint(node_id=p.node_id, grpc_address=fake_addr),       # a member's id, another address
                  n.PrefillHint(node_id=d.node_id, grpc_address=d.grpc_addr)]     # a member, but not a prefill node
        for hint in forged:
            assert generate(pb, stub, ids, hint=hint) == want
        assert fake.calls == [], f"the decode node dialled the forged prefill node: {fake.calls}"
        assert d.metric("baton_remote_prefills_total", 'result="refused"') == refused0 + len(forged)
        # the real prefill node, named as registered, is still used
        ok0 = d.metric("baton_remote_prefills_total", 'result="ok"') or 0
        assert generate(pb, stub, ids, hint=n.PrefillHint(node_id=p.node_id, grpc_address=p.grpc_addr)) == want
        assert d.metric("baton_remote_prefills_total", 'result="ok"') == ok0 + 1
    assert "prefill hint refused" in d.log()


def descriptor_fields(desc):
    """n_blocks and the layout fingerprint from a kvx descriptor (see kvtransfer/kvx_pool.c for the format)."""
    n_blocks, = struct.unpack_from("<I", desc, 16)
    fingerprint, = struct.unpack_from("<Q", desc, 32)
    return n_blocks, fingerprint


def forged_prefill(pb, stub, dest_id, desc, block_ids, fingerprint, rng):
    n = pb["baton.v1.node_pb2"]
    ids = [rng.randrange(200, 40000) for _ in range(len(block_ids) * BLOCK)]
    dst = n.KvDestination(decode_node_id=dest_id, epoch=rng.getrandbits(64), block_ids=block_ids,
                          layout_fingerprint=fingerprint, checksums=True, pool_descriptor=desc)
    with pytest.raises(grpc.RpcError) as e:
        stub.Run(n.PrefillRunRequest(request_id="forged", prompt_token_ids=ids, destination=dst), timeout=120)
    return e.value


def test_forged_prefill_run_writes_nothing(pb, cluster):
    """Poisoning attempt: warm the decode node's prefix cache with prompt A (prefilled remotely, so its blocks came
    over kvtransfer), then make the prefill node push KV of other prompts into every block of the decode node's
    pool with the real descriptor from etcd and made-up epochs. A again must give the same tokens and logprobs."""
    n = pb["baton.v1.node_pb2"]
    p, d = cluster["p"], cluster["d"]
    desc = base64.b64decode(cluster["d_rec"]["ucx"])
    n_blocks, fingerprint = descriptor_fields(desc)
    assert 16 <= n_blocks <= 512, n_blocks
    rng = random.Random(12)
    prompt_a = [rng.randrange(200, 40000) for _ in range(8 * BLOCK + 5)]
    with grpc.insecure_channel(d.grpc_addr) as dch, grpc.insecure_channel(p.grpc_addr) as pch:
        dstub = pb["baton.v1.node_pb2_grpc"].DecodeStub(dch)
        pstub = pb["baton.v1.node_pb2_grpc"].PrefillStub(pch)
        hint = n.PrefillHint(node_id=p.node_id, grpc_address=p.grpc_addr)
        before = generate(pb, dstub, prompt_a, hint=hint)
        assert d.metric("baton_remote_prefills_total", 'result="ok"') >= 1
        hits0 = d.metric("baton_prefix_cache_hits_total") or 0
        # cover every block of the pool, a few dozen blocks per forged call
        step = 40
        errors = []
        for first in range(0, n_blocks, step):
            blocks = list(range(first, min(n_blocks, first + step)))
            errors.append(forged_prefill(pb, pstub, d.node_id, desc, blocks, fingerprint, rng))
        assert all(e.code() != grpc.StatusCode.OK for e in errors)
        after = generate(pb, dstub, prompt_a)  # no hint: the decode node's own prefix cache serves A's blocks
        hits = d.wait_metric("baton_prefix_cache_hits_total", lambda v: (v or 0) > hits0)
        assert (hits or 0) > hits0, "prompt A did not hit the prefix cache"
        assert after == before, "forged Prefill/Run calls changed the decode node's cached KV"
    # nothing of the forged calls was accepted on the decode side
    assert all("claim" in e.details() for e in errors), [e.details() for e in errors]


def test_destination_must_be_the_registered_pool(pb, cluster):
    """Destinations that are not a registered decode node, or a descriptor other than the one it registered, are
    refused with PERMISSION_DENIED before any compute (the prefill node's prompt-token counter does not move)."""
    n = pb["baton.v1.node_pb2"]
    p, d = cluster["p"], cluster["d"]
    desc = base64.b64decode(cluster["d_rec"]["ucx"])
    _, fingerprint = descriptor_fields(desc)
    rng = random.Random(13)
    forged_desc = bytearray(desc)
    forged_desc[48] ^= 0x40  # another base address (the checksum no longer matters: it must not even be parsed)
    tokens0 = p.metric("baton_prompt_tokens_total") or 0
    with grpc.insecure_channel(p.grpc_addr) as pch:
        pstub = pb["baton.v1.node_pb2_grpc"].PrefillStub(pch)
        cases = [("nobody", desc, "not registered"),
                 (p.node_id, desc, "not a decode node"),
                 (d.node_id, bytes(forged_desc), "is not the KV pool")]
        for dest, dsc, why in cases:
            e = forged_prefill(pb, pstub, dest, dsc, [0, 1], fingerprint, rng)
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (dest, e.code(), e.details())
            assert why in e.details(), e.details()
    assert (p.metric("baton_prompt_tokens_total") or 0) == tokens0
