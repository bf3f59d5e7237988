"""`baton bench-serve` against real processes (etcd, one decode node, the router): the JSON a user gets is well
formed and consistent (every request succeeded, ordered percentiles, positive throughput, goodput <= achieved
rate), the table names the SLO, and an unreachable URL or an API key mismatch fails with one line."""
from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from harness.baton_procs import start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router


def wait_nodes(router, n, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = router.http("/health")
        if status == 200 and json.loads(body).get("decode_nodes") == n:
            return
        time.sleep(0.1)
    raise AssertionError(f"router did not see {n} decode node(s): {router.http('/health')}")


@pytest.fixture(scope="module")
def router(default_model):
    with EtcdServer() as etcd:
        with start_decode(etcd, default_model, threads=1, node_id="dec-bs"):
            with start_router(etcd, default_model, api_key="bench-key") as rtr:
                wait_nodes(rtr, 1)
                yield rtr


def bench(baton_bin, *args, timeout=120):
    return subprocess.run([str(baton_bin), "bench-serve", *args], capture_output=True, text=True, timeout=timeout)


def test_two_rates_json(baton_bin, router, tmp_path):
    out = tmp_path / "bs.json"
    r = bench(baton_bin, "--url", f"http://{router.http_addr}", "--api-key", "bench-key", "--rate", "2,4",
              "--requests", "6", "--prompt-tokens", "24:4", "--output-tokens", "8", "--seed", "7", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "TTFT <= 2000 ms and TPOT <= 200 ms (the defaults" in r.stdout
    assert "bench-serve: rate 2 req/s" in r.stderr  # progress on stderr
    j = json.loads(out.read_text())
    assert j["slo"] == {"ttft_ms": 2000, "tpot_ms": 200, "defaults": True}
    assert j["endpoint"] == "/v1/completions" and j["model"]
    assert [run["rate"] for run in j["runs"]] == [2, 4]
    for run in j["runs"]:
        assert run["requests"] == 6 and run["completed"] == 6 and run["errors"] == 0, run
        assert run["errors_by_status"] == {}
        assert run["mean_output_tokens"] == 8  # ignore_eos + max_tokens: lengths as drawn
        assert 15 <= run["mean_prompt_tokens"] <= 35
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            s = run[key]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert run["ttft_ms"]["p50"] > 0 and run["e2e_ms"]["p50"] > 0
        assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert run["throughput_output_tok_s"] > 0 and run["throughput_req_s"] > 0
        assert run["achieved_rate"] > 0 and run["duration_s"] > 0
        assert 0 <= run["goodput_req_s"] <= run["achieved_rate"]
        assert run["good_requests"] <= run["completed"]
    # the table: one row per rate
    rows = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in ("2", "4")]
    assert len(rows) == 2 and all(" 6/6 " in ln for ln in rows), r.stdout


def test_chat_duration_and_concurrency_limit(baton_bin, router, tmp_path):
    out = tmp_path / "bs.json"
    r = bench(baton_bin, "--url", f"http://{router.http_addr}/v1/", "--api-key", "bench-key", "--api", "chat",
              "--rate", "4", "--duration", "1", "--prompt-tokens", "16", "--output-tokens", "4:1",
              "--concurrency-limit", "2", "--slo-ttft-ms", "0.001", "--quiet", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    run = json.loads(out.read_text())["runs"][0]
    assert run["requests"] >= 1 and run["completed"] == run["requests"]
    assert run["good_requests"] == 0 and run["goodput_req_s"] == 0  # nobody meets a 1 us TTFT


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url(baton_bin):
    r = bench(baton_bin, "--url", f"http://127.0.0.1:{free_port()}", "--requests", "2", timeout=30)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("baton bench-serve: cannot reach"), r.stderr


def test_wrong_api_key_one_line(baton_bin, router):
    r = bench(baton_bin, "--url", f"http://{router.http_addr}", "--api-key", "nope", "--requests", "2", timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "401" in lines[0] and "--api-key" in lines[0], r.stderr


def test_every_request_failed(baton_bin, default_model, tmp_path):
    out = tmp_path / "bs.json"
    with EtcdServer() as etcd:
        with start_router(etcd, default_model) as rtr:  # no decode node: every request gets 503
            r = bench(baton_bin, "--url", f"http://{rtr.http_addr}", "--rate", "20,40", "--requests", "3",
                      "--output-tokens", "4", "--quiet", "--json", str(out), timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("baton bench-serve: every request failed at rate 20"), r.stderr
    assert "503" in lines[0]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1  # later rates are not tried
    assert runs[0]["completed"] == 0 and runs[0]["errors_by_status"] == {"503": 3}
    assert "errors at rate 20: 503 x3" in r.stdout


@pytest.mark.parametrize("args", [["--rate", "0"], ["--rate", "1,x"], ["--requests", "0"],
                                  ["--requests", "2", "--duration", "1"], ["--prompt-tokens", "0"],
                                  ["--output-tokens", "8:-1"], ["--concurrency-limit", "0"], ["--url", "ftp://x"],
                                  ["--api", "embeddings"], ["--slo-tpot-ms", "-5"], ["--bogus", "1"], ["--rate"]])
def test_bad_flags(baton_bin, args):
    r = bench(baton_bin, *args, timeout=10)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("baton bench-serve: ")


def test_help(baton_bin):
    r = bench(baton_bin, "--help", timeout=10)
    assert r.returncode == 0 and "--slo-ttft-ms" in r.stdout and "Poisson" in r.stdout
