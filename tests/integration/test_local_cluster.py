"""deploy/local/cluster, the launcher behind `make run`, as a user runs it: `up --detach` starts etcd, a prefill node,
a decode node and the router; the first request after it returns is answered (the nodes are registered by then);
`status` lists the processes; `down` stops them all. Ports and the run directory are moved out of the way of a
cluster the developer may be running."""
import os
import socket
import subprocess

import openai

from conftest import ROOT, build_dir


def free_port(pair=False):
    """A free TCP port on 127.0.0.1 (with pair, one whose successor is free too: etcd's peer port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


def test_cluster_up_serves_then_down(default_model, tmp_path):
    script = ROOT / "deploy" / "local" / "cluster"
    http = free_port()
    env = dict(os.environ, BATON_BUILD_DIR=str(build_dir()), BATON_RUN_DIR=str(tmp_path / "run"),
               BATON_ETCD_LISTEN=f"127.0.0.1:{free_port(pair=True)}", BATON_HTTP_LISTEN=f"127.0.0.1:{http}",
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
