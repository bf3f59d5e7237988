"""The router with prefill nodes in the loop (DESIGN 2, 3, 7): real etcd, baton-router, baton-prefill and
baton-decode processes, the real openai client.

Checks: kill -9 of the decode node serving a stream while every prefill goes through the prefill node, both decode
nodes speculating by n-gram lookup: the stream continues on the other decode node with no gap and no duplicate; the cost model keeps a 1-token prompt local and sends
a 1,000-token prompt to the idle prefill node while the decode node runs decodes, and its decision log shows the
inputs it used."""
import json
import threading
import time

import openai
import pytest

from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from harness.router_procs import start_router

PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn to cook is", "def fibonacci(n):"]


def wait_nodes(etcd, ids, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(etcd.get(f"/baton/default/load/{i}") for i in ids):
            return
        time.sleep(0.05)
    raise AssertionError(f"nodes {ids} did not all report load")


def test_kill9_decode_mid_stream_with_prefill_node(default_model, tmp_path):
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id="pre-1") as p, \
            start_decode(etcd, default_model, threads=1, node_id="dec-1", spec="ngram") as d1, \
            start_decode(etcd, default_model, threads=1, node_id="dec-2", spec="ngram") as d2, \
            start_router(etcd, default_model, prefill_mode="remote") as rtr:
        wait_nodes(etcd, ["pre-1", "dec-1", "dec-2"])
        time.sleep(0.5)  # the router's watch sees all three
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=120)

        def kw(prompt):
            # long enough that the streams are still running when the node dies (60 tokens took under a second
            # once batched decode got faster, and the kill could come after the last token)
            return dict(model="", prompt=prompt, max_tokens=240, temperature=0, extra_body={"ignore_eos": True})

        want = {q: cl.completions.create(**kw(q)).choices[0].text for q in PROMPTS}
        assert p.metric("baton_kv_transfer_bytes_total") > 0, "the prefill node was not used"
        got = {q: [] for q in PROMPTS}
        started = threading.Barrier(len(PROMPTS) + 1)
        errors = []

        def consume(q):
            try:
                it = iter(cl.completions.create(stream=True, **kw(q)))
                got[q].append(next(it).choices[0].text)
                started.wait(60)
                for ch in it:
                    if ch.choices:
                        got[q].append(ch.choices[0].text)
            except Exception as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=consume, args=(q,)) for q in PROMPTS]
        for t in threads:
            t.start()
        started.wait(60)
        time.sleep(0.3)
        run = {d: d.metric("baton_running_sequences") or 0 for d in (d1, d2)}
        victim = max(run, key=run.get)
        assert run[victim] > 0, run
        xfer_before = p.metric("baton_kv_transfer_bytes_total")
        victim.kill()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for q in PROMPTS:
            assert "".join(got[q]) == want[q], q
        assert rtr.metric("baton_migrations_total") >= 1
        # the migrated requests were prefilled (prompt + delivered tokens) by the prefill node again
        assert p.metric("baton_kv_transfer_bytes_total") > xfer_before
        survivor = d2 if victim is d1 else d1
        end = time.monotonic() + 10
        while time.monotonic() < end and survivor.metric("baton_kv_blocks_used") != 0:
            time.sleep(0.05)
        assert survivor.metric("baton_kv_blocks_used") == 0


def test_cost_model_short_local_long_remote(default_model, tmp_path):
    log = tmp_path / "decisions.jsonl"
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id="pre-c") as p, \
            start_decode(etcd, default_model, threads=1, node_id="dec-c") as d, \
            start_router(etcd, default_model, decision_log=str(log)) as rtr:
        wait_nodes(etcd, ["pre-c", "dec-c"])
        cl = openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=180)
        # keep the decode node busy with two long decodes
        stop = threading.Event()

        def busy(i):
            stream = cl.completions.create(model="", prompt=f"Story {i}:", max_tokens=3000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                if stop.is_set():
                    break
            stream.close()

        bg = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(2)]
        for t in bg:
            t.start()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            load = json.loads(etcd.get("/baton/default/load/dec-c") or "{}")
            if load.get("running_seqs", 0) >= 2:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # the router's watch catches up with the report
        short = cl.completions.create(model="", prompt="Hi", max_tokens=2, temperature=0)
        long_prompt = " ".join(f"word{i}" for i in range(400))  # ~1,000 tokens
        long = cl.completions.create(model="", prompt=long_prompt, max_tokens=2, temperature=0)
        stop.set()
        for t in bg:
            t.join(30)
        assert short.usage.prompt_tokens <= 2 and long.usage.prompt_tokens > 800
        decisions = [json.loads(line) for line in log.read_text().splitlines()]
        by_len = {e["prompt_tokens"]: e for e in decisions}
        s, lg = by_len[short.usage.prompt_tokens], by_len[long.usage.prompt_tokens]
        assert s["choice"] == "local", s
        assert lg["choice"] == "remote" and lg["prefill_node"] == "pre-c", lg
        # the inputs are in the log: costs, the decode node's load, the candidate's queue, rate and transfer time
        assert lg["d_running_seqs"] >= 2 and lg["d_prefill_tok_s"] > 0 and lg["d_step_s"] > 0
        assert lg["cost_local_s"] > lg["candidates"][0]["cost_s"] > 0
        assert lg["interference_s"] > 0 and "transfer_s" in lg["candidates"][0]
        assert p.metric("baton_kv_transfer_bytes_total") > 0
        assert rtr.metric("baton_router_prefill_decisions_total", 'choice="remote"') >= 1
        assert rtr.metric("baton_router_prefill_decisions_total", 'choice="local"') >= 1
