"""Probes and drain (issue 21, DESIGN 14) against real processes: etcd, decode nodes, the router, the real `openai`
client.

- Scale-down of a decode node under load: SIGTERM to one of two decode nodes while 16 greedy streams run; every
  stream completes with exactly the tokens of an undisturbed run (nothing lost, nothing repeated), and the node
  leaves etcd and exits 0 within its grace period.
- Readiness: the router's /ready (and gRPC health) is 503 / NOT_SERVING while it sees no decode node and 200 /
  SERVING once one registers; /live stays 200 throughout. Each node has /live and /ready too.
- Router drain: SIGTERM to the router with streams in flight: /ready turns 503 at once, new requests get 503, the
  streams in flight finish whole, and the router exits 0.

Figures print with pytest -s."""
from __future__ import annotations

import json
import threading
import time

import grpc
import openai

from harness.baton_procs import start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router

PROMPTS = ["The three largest cities in Germany are", "Once upon a time", "The best way to learn to cook is",
           "def fibonacci(n):", "A short history of the bicycle:", "Ten tips for a good night's sleep:",
           "The recipe for bread needs", "In the year 2050, cities will", "The moon is", "My favourite animal is",
           "Water boils at", "The capital of France", "import numpy as np\n", "Dear Sir or Madam,",
           "Photosynthesis is the process", "The first rule of programming:"]


def wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def status(proc, path):
    try:
        return proc.http(path, timeout=2.0)[0]
    except OSError:
        return 0


def decode_nodes(rtr):
    code, body = rtr.http("/ready", timeout=2.0)
    return json.loads(body).get("decode_nodes", 0)


def grpc_health(addr):
    """The router's overall gRPC health: 1 SERVING, 2 NOT_SERVING (HealthCheckResponse.status, field 1)."""
    with grpc.insecure_channel(addr) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
        resp = check(b"", timeout=5)
    return resp[1] if len(resp) == 2 and resp[0] == 0x08 else 0


def running(node):
    try:
        return node.metric("baton_running_sequences") or 0
    except Exception:
        return 0


def client(rtr):
    return openai.OpenAI(base_url=rtr.base_url, api_key="x", max_retries=0, timeout=180)


def kw(prompt, max_tokens):
    return dict(model="", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True})


def run_streams(cl, kws, started=None):
    """Streams every request on its own thread; returns (texts, completion token counts, errors). `started` (an
    Event) is set once every stream has received its first chunk."""
    texts, counts, errors = [""] * len(kws), [0] * len(kws), []
    first = threading.Barrier(len(kws) + 1) if started is not None else None

    def one(i):
        got = False
        try:
            for ch in cl.completions.create(stream=True, **kws[i]):
                if ch.choices and ch.choices[0].text:
                    texts[i] += ch.choices[0].text
                    if first is not None and not got:
                        got = True
                        first.wait(120)
                if ch.usage:
                    counts[i] = ch.usage.completion_tokens
        except Exception as e:  # reported by the test
            errors.append(f"stream {i}: {e!r}")
            if first is not None and not got:
                first.abort()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(kws))]
    for t in threads:
        t.start()
    if first is not None:
        first.wait(120)
        started.set()
    return threads, texts, counts, errors


def test_sigterm_decode_node_under_16_streams_loses_no_token(default_model):
    max_tokens = 192
    with EtcdServer() as etcd, \
            start_decode(etcd, default_model, threads=1, node_id="dec-a", grace_ms=5000) as da, \
            start_decode(etcd, default_model, threads=1, node_id="dec-b", grace_ms=5000) as db, \
            start_router(etcd, default_model) as rtr:
        wait_for(lambda: decode_nodes(rtr) == 2, 20, "two decode nodes")
        for node in (da, db):
            assert status(node, "/live") == 200 and status(node, "/ready") == 200
        cl = client(rtr)
        kws = [kw(p, max_tokens) for p in PROMPTS]
        # the reference: the same greedy requests, undisturbed (greedy output does not depend on batching)
        threads, want, want_n, errors = run_streams(cl, kws)
        for t in threads:
            t.join(180)
        assert not errors, errors
        assert want_n == [max_tokens] * len(kws)
        migrations0 = rtr.metric("baton_migrations_total") or 0

        started = threading.Event()
        threads, got, got_n, errors = run_streams(cl, kws, started)
        run = wait_for(lambda: (lambda r: r if max(r.values()) >= 2 else None)({d: running(d) for d in (da, db)}),
                       5, "streams running on the decode nodes")
        victim = max(run, key=run.get)
        victim_id = "dec-a" if victim is da else "dec-b"
        assert run[victim] >= 2, run
        t_term = time.monotonic()
        victim.proc.send_signal(15)
        # the node turns unready at once and leaves etcd
        left = wait_for(lambda: etcd.get(f"/baton/default/nodes/{victim_id}") is None and time.monotonic(), 5,
                        "the node's etcd record to go")
        rc = victim.proc.wait(30)
        t_exit = time.monotonic()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads), "a stream never ended"
        migrations = (rtr.metric("baton_migrations_total") or 0) - migrations0
        print(f"\nSIGTERM drain: {run[victim]:.0f} of 16 streams on {victim_id}; record gone after "
              f"{left - t_term:.2f} s, exit {rc} after {t_exit - t_term:.2f} s; migrations {migrations:.0f}; "
              f"streams identical to the undisturbed run: {sum(g == w for g, w in zip(got, want))}/16")
        assert rc == 0, victim.log()[-3000:]
        assert "stopped cleanly" in victim.log()
        assert not errors, errors
        assert got_n == [max_tokens] * len(kws), got_n
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"stream {i} differs from the undisturbed run:\n{g!r}\n{w!r}"
        assert t_exit - t_term < 5.0 + 3.0


def test_router_readiness_follows_decode_nodes(default_model):
    with EtcdServer() as etcd, start_router(etcd, default_model) as rtr:
        # no decode node: alive but not ready, on HTTP and gRPC, and generation is refused with 503
        assert status(rtr, "/live") == 200 and status(rtr, "/health") == 200
        wait_for(lambda: status(rtr, "/ready") == 503, 5, "/ready 503 without a decode node")
        wait_for(lambda: grpc_health(rtr.grpc_addr) == 2, 5, "gRPC NOT_SERVING without a decode node")
        with start_decode(etcd, default_model, threads=1, node_id="dec-a") as da:
            t0 = time.monotonic()
            wait_for(lambda: status(rtr, "/ready") == 200, 15, "/ready 200 once a decode node registered")
            t_http = time.monotonic() - t0
            wait_for(lambda: grpc_health(rtr.grpc_addr) == 1, 5, "gRPC SERVING once a decode node registered")
            assert client(rtr).completions.create(**kw(PROMPTS[0], 4)).usage.completion_tokens == 4
            t0 = time.monotonic()
            rc = da.stop()
            wait_for(lambda: status(rtr, "/ready") == 503, 5, "/ready 503 after the last decode node left")
            t_gone = time.monotonic() - t0
            wait_for(lambda: grpc_health(rtr.grpc_addr) == 2, 5, "gRPC NOT_SERVING after the last node left")
            assert rc == 0
        with start_decode(etcd, default_model, threads=1, node_id="dec-b"):
            wait_for(lambda: status(rtr, "/ready") == 200, 15, "/ready 200 when a decode node joins again")
        assert status(rtr, "/live") == 200
        print(f"\nreadiness: 200 {t_http:.2f} s after the node answered /health; 503 {t_gone:.2f} s after SIGTERM "
              f"to the last decode node (incl. its exit)")


def test_router_sigterm_drains_streams_in_flight(default_model):
    max_tokens = 64
    with EtcdServer() as etcd, \
            start_decode(etcd, default_model, threads=1, node_id="dec-a") as da, \
            start_router(etcd, default_model, grace_ms=60000) as rtr:
        wait_for(lambda: decode_nodes(rtr) == 1, 20, "a decode node")
        assert status(da, "/ready") == 200
        cl = client(rtr)
        kws = [kw(p, max_tokens) for p in PROMPTS[:6]]
        started = threading.Event()
        threads, got, got_n, errors = run_streams(cl, kws, started)
        t_term = time.monotonic()
        rtr.proc.send_signal(15)
        wait_for(lambda: status(rtr, "/ready") == 503, 2, "/ready 503 while draining")
        assert status(rtr, "/live") == 200
        try:
            cl.completions.create(**kw(PROMPTS[0], 4))
            refused = None
        except openai.APIStatusError as e:
            refused = e.status_code
        except openai.APIConnectionError:
            refused = "connection"  # the router finished draining first
        rc = rtr.proc.wait(60)
        t_exit = time.monotonic() - t_term
        for t in threads:
            t.join(60)
        print(f"\nrouter SIGTERM: {len(kws)} streams in flight finished whole, new request -> {refused}, "
              f"exit {rc} after {t_exit:.2f} s")
        assert not errors, errors
        assert got_n == [max_tokens] * len(kws), got_n
        assert refused in (503, "connection")
        assert rc == 0
        assert "drained" in rtr.log()


def test_router_grace_flag_is_checked(default_model):
    import subprocess
    from harness.baton_procs import bin_path
    for argv, env in ((["--grace-ms", "-5"], {}), (["--grace-ms", "5s"], {}), ([], {"BATON_GRACE_MS": "soon"})):
        r = subprocess.run([bin_path("baton-router"), "--model", str(default_model), "--etcd", "http://127.0.0.1:9",
                            *argv], capture_output=True, text=True, timeout=30, env={**__import__("os").environ, **env})
        assert r.returncode == 2 and "--grace-ms / BATON_GRACE_MS" in r.stderr, (argv, env, r.stderr)
