"""Gemma 3 270M served disaggregated and colocated (the second model family, issue 23):

- node level (real baton-prefill and baton-decode in a real etcd, KV over UCX shared memory, the grpcio client):
  prompts of 10 to 1,500 tokens, greedy and seeded sampling, give bit-identical tokens and logprobs whether the
  decode node prefills locally or the prefill node pushes the KV; prompts past the 512-token sliding window
  included (up to 2,500 tokens, nearly 5 windows). The sliding-window layers have their own block space on both
  nodes, so the transfer carries every prompt block of the 3 global layers but only the window before the first
  generated position of the 15 local ones (1 KV head x 256 dims, f16: 16,384 bytes per block and layer), asserted to
  the byte from baton_kv_transfer_bytes_total; later prompts that share a transferred prefix give the same output
  as a colocated node (the decode node reuses a transferred prefix only where it holds the local window before the
  split, so it never serves KV it was not sent); a chat prompt through the prefill node gives exactly what
  `baton generate` prints;
- the local cluster (deploy/local/cluster, the `make run` launcher) with --model: the same greedy completion through
  the router's OpenAI API with the request prefilled on the prefill node and with --prefill 0 (colocated)."""
import concurrent.futures as cf
import json
import random
import subprocess

import grpc
import openai
import pytest

from conftest import ROOT
from harness import pygen
from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from test_local_cluster import local_cluster, node_metric

SHM = {"UCX_TLS": "sm", "UCX_POSIX_ERROR_HANDLING": "y", "UCX_SYSV_ERROR_HANDLING": "y"}
LAYERS, BLOCK_BYTES = 18, 2 * 1 * 16 * 256 * 2
GLOBAL_LAYERS, WINDOW = 3, 512  # layers 5, 11, 17 are global; the other 15 slide over 512 positions


def transfer_bytes(n_prompt):
    """What the prefill node sends for a prompt the decode node has no prefix of: the global layers' blocks, and the
    local layers' blocks from the one holding position n_prompt - window on."""
    blocks = (n_prompt + 15) // 16
    first = (n_prompt - WINDOW) // 16 if n_prompt > WINDOW else 0
    return (blocks * GLOBAL_LAYERS + (blocks - first) * (LAYERS - GLOBAL_LAYERS)) * BLOCK_BYTES


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.generate(ROOT / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))


@pytest.fixture(scope="module")
def cluster(gemma3_model):
    with EtcdServer() as etcd, \
            start_prefill(etcd, gemma3_model, node_id="p-g3", threads=1, kv_mem="256M", env=SHM) as p, \
            start_decode(etcd, gemma3_model, node_id="dr-g3", threads=1, kv_mem="256M", env=SHM) as dr, \
            start_decode(etcd, gemma3_model, node_id="dl-g3", threads=1, kv_mem="256M", env=SHM) as dl:
        yield {"p": p, "dr": dr, "dl": dl}
        for proc in (dr, dl, p):
            assert proc.stop() == 0, proc.log()[-3000:]


def run(pb, stub, ids, sampled, seed, hint=None, max_tokens=4):
    n, g = pb["baton.v1.node_pb2"], pb["baton.v1.generate_pb2"]
    sp = g.SamplingParams(temperature=0.9, top_p=0.95, seed=seed) if sampled else g.SamplingParams(temperature=0.0)
    req = n.DecodeRunRequest(prompt_token_ids=ids, max_tokens=max_tokens, sampling=sp, ignore_eos=True,
                             logprobs=True, top_logprobs=2, prefill=hint)
    msgs = list(stub.Run(req, timeout=300))
    toks = [t for m in msgs for t in m.token_ids]
    lps = [(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for m in msgs for lp in m.logprobs]
    return toks, lps


def test_gemma3_remote_equals_colocated(pb, cluster):
    p, dr, dl = cluster["p"], cluster["dr"], cluster["dl"]
    rng = random.Random(3)
    lengths = [10, 100, 511, 513, 700, 1500, 2500]
    cases = [([2] + [rng.randrange(300, 200000) for _ in range(n - 1)], i % 2 == 1, 500 + i)
             for i, n in enumerate(lengths)]
    hint = pb["baton.v1.node_pb2"].PrefillHint(node_id=p.node_id, grpc_address=p.grpc_addr)
    mk = pb["baton.v1.node_pb2_grpc"].DecodeStub
    with grpc.insecure_channel(dr.grpc_addr) as cr, grpc.insecure_channel(dl.grpc_addr) as cl, \
            cf.ThreadPoolExecutor(max_workers=2) as ex:
        s_remote, s_local = mk(cr), mk(cl)
        remote = ex.map(lambda c: run(pb, s_remote, *c, hint=hint), cases)
        local = ex.map(lambda c: run(pb, s_local, *c), cases)
        remote, local = list(remote), list(local)
    bad = [(len(c[0]), r, l) for c, r, l in zip(cases, remote, local) if r != l]
    assert not bad, f"{len(bad)} of {len(cases)} differ, first: {bad[0]}"
    assert all(len(r[0]) == 4 for r in remote)
    assert dr.metric("baton_remote_prefills_total", 'result="ok"') == len(cases), dr.log()[-3000:]
    assert dr.metric("baton_remote_prefills_total", 'result="fallback"') == 0
    blocks = sum((len(c[0]) + 15) // 16 for c in cases)
    sent, full = p.metric("baton_kv_transfer_bytes_total"), blocks * LAYERS * BLOCK_BYTES
    assert sent == sum(transfer_bytes(len(c[0])) for c in cases), (sent, full)
    print(f"KV transferred for {len(cases)} prompts: {sent} bytes ({full} with every layer's every block, "
          f"{sent / full:.1%}); 2,500-token prompt: {transfer_bytes(2500)} vs {((2500 + 15) // 16) * LAYERS * BLOCK_BYTES}")
    assert sent < full * 0.6  # short prompts (all within one window) send all 18 layers' blocks
    assert transfer_bytes(2500) < 0.35 * ((2500 + 15) // 16) * LAYERS * BLOCK_BYTES

    # Prompts sharing the transferred prompts' prefixes, prefilled locally on both decode nodes: dr holds the global
    # layers' blocks of every transferred prompt but the local layers' only for their last window, so it may reuse a
    # prefix only where that window is there (the whole 2,500-token prompt) and must recompute the rest (its first
    # 2,000 tokens); dl computed everything itself. Any KV served that was never sent would part the outputs.
    long_ids = cases[-1][0]
    follow = [(long_ids + [rng.randrange(300, 200000) for _ in range(20)], False, 900),
              (long_ids[:2000] + [rng.randrange(300, 200000) for _ in range(30)], True, 901),
              (cases[-2][0][:1200] + [rng.randrange(300, 200000) for _ in range(5)], False, 902)]
    with grpc.insecure_channel(dr.grpc_addr) as cr, grpc.insecure_channel(dl.grpc_addr) as cl:
        s_remote, s_local = mk(cr), mk(cl)
        for ids, sampled, seed in follow:
            assert run(pb, s_remote, ids, sampled, seed) == run(pb, s_local, ids, sampled, seed), len(ids)
    assert dr.metric("baton_remote_prefills_total", 'result="ok"') == len(cases)


def test_gemma3_remote_equals_baton_generate(pb, cluster, baton_bin, gemma3_model):
    p, dr = cluster["p"], cluster["dr"]
    hint = pb["baton.v1.node_pb2"].PrefillHint(node_id=p.node_id, grpc_address=p.grpc_addr)
    n, g = pb["baton.v1.node_pb2"], pb["baton.v1.generate_pb2"]
    with grpc.insecure_channel(dr.grpc_addr) as ch:
        stub = pb["baton.v1.node_pb2_grpc"].DecodeStub(ch)
        for q in ["What is the capital of France?", "Write a haiku about rain."]:
            conv = json.dumps([{"role": "user", "content": q}])
            r = subprocess.run([str(baton_bin), "chat-template", "--model", str(gemma3_model), "--tokenize", conv],
                               capture_output=True, text=True, timeout=60, check=True)
            ids = [int(t) for t in r.stdout.split()]
            r = subprocess.run([str(baton_bin), "generate", "--model", str(gemma3_model), "--chat", q, "--ids",
                                "--max-tokens", "16", "--threads", "1", "--quiet"],
                               capture_output=True, text=True, timeout=300, check=True)
            want = [int(t) for t in r.stdout.split()]
            msgs = list(stub.Run(n.DecodeRunRequest(prompt_token_ids=ids, max_tokens=16, prefill=hint,
                                                    sampling=g.SamplingParams(temperature=0.0)), timeout=300))
            got = [t for m in msgs for t in m.token_ids]
            assert got == want and len(got) == 16, (q, got, want)


def completion(http, prompt):
    cl = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=120)
    r = cl.completions.create(model="", prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text


PROMPT = "The three largest cities in Germany are"


def test_gemma3_local_cluster_disaggregated_equals_colocated(gemma3_model, tmp_path):
    """Gemma 3 270M is a base (pretrained) checkpoint: a completion, not a chat, is what it answers sensibly."""
    with local_cluster(gemma3_model, tmp_path / "remote", "--router-args", "--prefill-mode remote") as (env, http):
        remote = completion(http, PROMPT)
        run_dir = tmp_path / "remote" / "run"
        assert node_metric(run_dir, "prefill-1", "baton_kv_transfer_bytes_total") > 0
        assert node_metric(run_dir, "decode-1", "baton_remote_prefills_total", 'result="ok"') >= 1
    with local_cluster(gemma3_model, tmp_path / "colocated", "--prefill", "0") as (env, http):
        local = completion(http, PROMPT)
    print(f"{PROMPT!r} -> {remote!r}")
    assert remote == local
    assert "Berlin" in remote, remote
