"""deploy/local/cluster, the launcher behind `make run`, as a user runs it: `up --detach` starts etcd, a prefill node,
a decode node and the router; the first request after it returns is answered (the nodes are registered by then);
`status` lists the processes; `down` stops them all. Also: `--prefill-cpus/--decode-cpus` pin the nodes and a
request goes through the prefill node (KV moved, counted on both nodes); `--prefill 0` serves colocated; and
tools/bench-disagg.sh runs both set-ups end to end. Ports and the run directory are moved out of the way of a
cluster the developer may be running."""
import contextlib
import json
import os
import re
import subprocess
import urllib.request

import openai

from conftest import ROOT, build_dir
from harness.etcd import free_port, free_port_run


def test_cluster_up_serves_then_down(default_model, tmp_path):
    script = ROOT / "deploy" / "local" / "cluster"
    http = free_port()
    env = dict(os.environ, BATON_BUILD_DIR=str(build_dir()), BATON_RUN_DIR=str(tmp_path / "run"),
               BATON_ETCD_LISTEN=f"127.0.0.1:{free_port_run(2)}", BATON_HTTP_LISTEN=f"127.0.0.1:{http}",
               BATON_GRPC_LISTEN=f"127.0.0.1:{free_port()}", BATON_THREADS="1")
    up = subprocess.run([str(script), "up", "--detach", "--model", str(default_model)], env=env,
                        capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "baton is up" in up.stdout and f"http://127.0.0.1:{http}" in up.stdout
        st = subprocess.run([str(script), "status"], env=env, capture_output=True, text=True, timeout=30)
        for name in ("etcd", "prefill-1", "decode-1", "router"):
            assert f"{name}: running" in st.stdout, st.stdout
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0, timeout=60)
        r = cl.chat.completions.create(model="", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
    finally:
        down = subprocess.run([str(script), "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0 and "stopped" in down.stdout
    st = subprocess.run([str(script), "status"], env=env, capture_output=True, text=True, timeout=30)
    assert "running" not in st.stdout, st.stdout


@contextlib.contextmanager
def local_cluster(default_model, tmp_path, *args):
    """`cluster up --detach ARGS` on free ports; yields (env, http address); `cluster down` on the way out."""
    script = ROOT / "deploy" / "local" / "cluster"
    http = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, BATON_BUILD_DIR=str(build_dir()), BATON_RUN_DIR=str(tmp_path / "run"),
               BATON_ETCD_LISTEN=f"127.0.0.1:{free_port_run(2)}", BATON_HTTP_LISTEN=http,
               BATON_GRPC_LISTEN=f"127.0.0.1:{free_port()}", BATON_THREADS="1")
    up = subprocess.run([str(script), "up", "--detach", "--model", str(default_model), *args], env=env,
                        capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield env, http
    finally:
        down = subprocess.run([str(script), "down"], env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr


def node_metric(run_dir, node, name, labels=""):
    """A sample of one node's /metrics; the node's HTTP address is in its log's ready line."""
    log = (run_dir / f"{node}.log").read_text()
    addr = re.search(r"listening grpc=\S+ http=(\S+)", log).group(1)
    body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    key = f"{name}{{{labels}}}" if labels else name
    for line in body.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    return None


def chat(http, q="What is the capital of France?"):
    cl = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0, timeout=60)
    r = cl.chat.completions.create(model="", max_tokens=16, temperature=0, messages=[{"role": "user", "content": q}])
    return r.choices[0].message.content


def cpus_allowed(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":")[1].strip()
    return None


def test_cluster_pinned_with_remote_prefill(default_model, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    pc, dc = str(cpus[0]), str(cpus[-1])
    with local_cluster(default_model, tmp_path, "--prefill-cpus", pc, "--decode-cpus", dc,
                       "--router-args", "--prefill-mode remote") as (env, http):
        run_dir = tmp_path / "run"
        assert cpus_allowed((run_dir / "prefill-1.pid").read_text().strip()) == pc
        assert cpus_allowed((run_dir / "decode-1.pid").read_text().strip()) == dc
        assert "Paris" in chat(http)
        # the request was prefilled by the prefill node: KV moved, and the decode node counts a remote prefill
        assert node_metric(run_dir, "prefill-1", "baton_kv_transfer_bytes_total") > 0
        assert node_metric(run_dir, "decode-1", "baton_remote_prefills_total", 'result="ok"') >= 1
        assert node_metric(run_dir, "decode-1", "baton_remote_prefills_total", 'result="fallback"') == 0


def test_cluster_prefill_0_is_colocated(default_model, tmp_path):
    script = ROOT / "deploy" / "local" / "cluster"
    with local_cluster(default_model, tmp_path, "--prefill", "0") as (env, http):
        st = subprocess.run([str(script), "status"], env=env, capture_output=True, text=True, timeout=30).stdout
        assert "decode-1: running" in st and "router: running" in st and "prefill" not in st, st
        assert "Paris" in chat(http)
        run_dir = tmp_path / "run"
        assert not list(run_dir.glob("prefill-*"))
        assert (node_metric(run_dir, "decode-1", "baton_remote_prefills_total", 'result="ok"') or 0) == 0


def test_bench_disagg_script(default_model, tmp_path):
    """tools/bench-disagg.sh at a tiny load: both set-ups come up, serve every request, write their JSON, and the
    disaggregated one reports its prefill node's KV hand-off."""
    out = tmp_path / "out"
    env = dict(os.environ, BATON_BUILD_DIR=str(build_dir()), BATON_RUN_DIR=str(tmp_path / "run"),
               BATON_ETCD_LISTEN=f"127.0.0.1:{free_port_run(2)}", BATON_HTTP_LISTEN=f"127.0.0.1:{free_port()}",
               BATON_GRPC_LISTEN=f"127.0.0.1:{free_port()}", BATON_MODEL=str(default_model), RATES="2",
               REQUESTS="3", PROMPT_TOKENS="64:0", OUTPUT_TOKENS="8:0", OUT=str(out))
    r = subprocess.run([str(ROOT / "tools" / "bench-disagg.sh")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for name in ("colocated", "disaggregated"):
        doc = json.loads((out / f"{name}.json").read_text())
        assert doc["url"] == f"http://{env['BATON_HTTP_LISTEN']}", doc["url"]  # this cluster, not one on :8000
        (run,) = doc["runs"]
        assert (run["rate"], run["requests"], run["completed"], run["errors"]) == (2, 3, 3, 0), run
        assert (run["mean_prompt_tokens"], run["mean_output_tokens"]) == (64, 8), run
        assert 0 < run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["throughput_output_tok_s"] > 0, run
        assert "3/3" in (out / f"{name}.txt").read_text()
    assert "prefill node: 3 requests" in (out / "disaggregated.txt").read_text()
    assert "prefill node" not in (out / "colocated.txt").read_text()
