"""Start and stop baton server processes (baton-decode, later baton-prefill and baton-router) for integration tests.

Each process listens on loopback with port 0 (it picks free ports itself and logs them), writes its log to a file in
a temporary directory, and is considered started once its log names its addresses and its HTTP /health answers 200.

    from harness.baton_procs import start_decode
    with start_decode(etcd_server, default_model, threads=1) as d:
        grpc.insecure_channel(d.grpc_addr) ...
        d.metrics()            # /metrics text
        rc = d.stop()          # SIGTERM, waits, returns the exit code

Flags given as keyword arguments become command-line flags: threads=1 -> `--threads 1`, kv_mem="64M" ->
`--kv-mem 64M`; a value of True gives the bare flag, None leaves it out. `etcd` may be an EtcdServer, an endpoint
string, or None (the node then runs without etcd: `--etcd none`). Only the standard library is used.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Optional, Sequence

__all__ = ["Proc", "ProcError", "start_proc", "start_decode", "bin_path", "flag_args", "wait_registered"]

# The line every baton server logs once it serves: "... listening grpc=HOST:PORT http=HOST:PORT ...".
LISTEN_RE = re.compile(r"listening grpc=(\S+) http=(\S+)")


class ProcError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, so a crashed run leaves nothing behind."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def bin_path(name: str) -> str:
    """build/bin/<name> under $BATON_BUILD_DIR (default <repo>/build)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    build = os.environ.get("BATON_BUILD_DIR", os.path.join(root, "build"))
    return os.path.join(build, "bin", name)


def flag_args(flags: dict) -> list:
    out = []
    for k, v in flags.items():
        if v is None or v is False:
            continue
        out.append("--" + k.replace("_", "-"))
        if v is not True:
            out.append(str(v))
    return out


class Proc:
    """One running baton process. Use as a context manager (stop on exit) or call stop()/kill()."""

    def __init__(self, name: str, argv: Sequence[str], env: Optional[dict] = None):
        self.name = name
        self.argv = list(argv)
        self.dir = tempfile.mkdtemp(prefix=f"baton-{name}-")
        self.log_path = os.path.join(self.dir, f"{name}.log")
        self.grpc_addr: Optional[str] = None
        self.http_addr: Optional[str] = None
        self.returncode: Optional[int] = None
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env=env, start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> "Proc":
        """Waits for the listening line and a 200 from /health; raises ProcError with the log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcError(f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.log()}")
            if self.grpc_addr is None:
                m = LISTEN_RE.search(self.log())
                if m:
                    self.grpc_addr, self.http_addr = m.group(1), m.group(2)
            if self.http_addr is not None and self.health() == 200:
                return self
            time.sleep(0.05)
        self.kill()
        raise ProcError(f"{self.name} not ready after {timeout} s:\n{self.log()}")

    def http(self, path: str, timeout: float = 5.0):
        """GET http://<http_addr><path>: (status, body bytes)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_addr}{path}", timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def health(self) -> int:
        try:
            return self.http("/health", timeout=1.0)[0]
        except (OSError, urllib.error.URLError):
            return 0

    def metrics(self) -> str:
        status, body = self.http("/metrics")
        if status != 200:
            raise ProcError(f"{self.name} /metrics answered {status}")
        return body.decode()

    def metric(self, name: str, labels: str = "") -> Optional[float]:
        """The value of one sample (`name` or `name{labels}` exactly as exposed), or None."""
        key = f"{name}{{{labels}}}" if labels else name
        for line in self.metrics().splitlines():
            if line.startswith(key + " "):
                return float(line.split()[1])
        return None

    def wait_metric(self, name: str, ok: Callable[[Optional[float]], bool], labels: str = "",
                    timeout: float = 10.0) -> Optional[float]:
        """Polls one sample until ok(value) or timeout; returns the last value read. Nodes sample their engine's
        counters and gauges on the load thread (every BT_NODE_LOAD_PERIOD_MS), so a metric lags what a reply saw."""
        end = time.monotonic() + timeout
        while True:
            v = self.metric(name, labels)
            if ok(v) or time.monotonic() >= end:
                return v
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait up to timeout (then SIGKILL); returns the exit code."""
        return self._signal(signal.SIGTERM, timeout)

    def kill(self) -> int:
        """SIGKILL: a crash."""
        return self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: int, timeout: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_proc(binary: str, args: Sequence[str], name: Optional[str] = None, env: Optional[dict] = None,
               timeout: float = 60.0, wait: bool = True) -> Proc:
    """Starts build/bin/<binary> (or a path) with args; waits until ready unless wait=False."""
    path = binary if os.sep in binary else bin_path(binary)
    if not os.path.exists(path):
        raise ProcError(f"{path} is not built (build it or set BATON_BUILD_DIR)")
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    p = Proc(name or os.path.basename(path), [path, *args], env=full_env)
    if wait:
        try:
            p.wait_ready(timeout)
        except ProcError:
            shutil.rmtree(p.dir, ignore_errors=True)
            raise
    return p


def _etcd_endpoint(etcd) -> str:
    if etcd is None:
        return "none"
    return etcd if isinstance(etcd, str) else etcd.endpoint


def start_decode(etcd, model, *, extra_args: Sequence[str] = (), env: Optional[dict] = None,
                 timeout: float = 60.0, wait: bool = True, **flags) -> Proc:
    """baton-decode on 127.0.0.1 free ports, registered in `etcd`. Flags: node_id, cluster, threads, kv_mem,
    max_batch_tokens, log_level, ... (see `baton-decode --help`)."""
    flags = dict(flags)
    flags.setdefault("grpc_listen", "127.0.0.1:0")
    flags.setdefault("http_listen", "127.0.0.1:0")
    args = ["--model", str(model), "--etcd", _etcd_endpoint(etcd), *flag_args(flags), *extra_args]
    proc = start_proc("baton-decode", args, name=f"decode-{flags.get('node_id', 'node')}", env=env,
                      timeout=timeout, wait=wait)
    proc.node_id = flags.get("node_id")  # None: the node picked its own (<role>-<host>-<pid>)
    return proc


def start_prefill(etcd, model, *, extra_args: Sequence[str] = (), env: Optional[dict] = None,
                  timeout: float = 60.0, wait: bool = True, **flags) -> Proc:
    """baton-prefill on 127.0.0.1 free ports, registered in `etcd`; flags as for start_decode."""
    flags = dict(flags)
    flags.setdefault("grpc_listen", "127.0.0.1:0")
    flags.setdefault("http_listen", "127.0.0.1:0")
    args = ["--model", str(model), "--etcd", _etcd_endpoint(etcd), *flag_args(flags), *extra_args]
    proc = start_proc("baton-prefill", args, name=f"prefill-{flags.get('node_id', 'node')}", env=env,
                      timeout=timeout, wait=wait)
    proc.node_id = flags.get("node_id")  # None: the node picked its own (<role>-<host>-<pid>)
    return proc


def wait_registered(etcd, node_id: str, cluster: str = "default", timeout: float = 10.0) -> dict:
    """Waits until /baton/<cluster>/nodes/<node_id> exists in `etcd` (an EtcdServer) and returns its NodeInfo as a
    dict (node_id, role, model, grpc_addr, http_addr, capacity{kv_blocks, kv_block_tokens, max_running,
    max_context}, version, started_ms). Raises ProcError on timeout."""
    key = f"/baton/{cluster}/nodes/{node_id}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = etcd.get(key)
        if v:
            return json.loads(v)
        time.sleep(0.05)
    raise ProcError(f"{key} did not appear in etcd within {timeout} s")
