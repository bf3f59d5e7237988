"""Throwaway etcd servers for integration tests.

Starts Debian's `etcd` (etcd-server 3.4) on random free loopback ports with a temporary data directory, waits
until /health answers, and stops it by pid. Also kills and restarts it on the same data directory, so tests can
check what happens to a cluster while etcd is away.

Use as a context manager::

    from harness.etcd import EtcdServer
    with EtcdServer() as etcd:
        start_node("--etcd", etcd.endpoint)
        assert etcd.get_prefix("/baton/default/nodes/")

With --cert-file among extra_args the client URL is https; health is always checked on a plain-HTTP
metrics port. Or as a pytest fixture: `from harness.etcd import etcd_server  # noqa: F401` in a conftest.py or test module,
then take `etcd_server` as an argument. Only the standard library is used. The etcd binary is $BATON_ETCD_BIN
or `etcd` on PATH; its log is <tmpdir>/etcd.log and is printed when start-up fails.
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, Iterator, Optional, Sequence

__all__ = ["EtcdServer", "EtcdError", "free_port", "etcd_server"]


class EtcdError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (someone else may take it meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive TCP ports that were all free on 127.0.0.1 a moment ago, drawn below the kernel's
    ephemeral range (ports above free_port()'s answer are where outgoing connections take theirs)."""
    lo, _ = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, lo - n))
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {lo}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, so a crashed run leaves no etcd behind."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EtcdServer:
    """One single-member etcd. start() is called by __enter__; close() stops it and removes its directory."""

    def __init__(self, extra_args: Sequence[str] = (), binary: Optional[str] = None,
                 tmp_parent: Optional[str] = None, start_timeout: float = 20.0):
        self.binary = binary or os.environ.get("BATON_ETCD_BIN") or "etcd"
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.dir = tempfile.mkdtemp(prefix="baton-etcd-", dir=tmp_parent)
        self.data_dir = os.path.join(self.dir, "data")
        self.log_path = os.path.join(self.dir, "etcd.log")
        self.client_port = 0
        self.peer_port = 0
        self.metrics_port = 0  # plain-HTTP /health and /metrics, also when the client port speaks TLS
        self.tls = any(a.startswith("--cert-file") for a in self.extra_args)
        self.proc: Optional[subprocess.Popen] = None
        self.token: Optional[str] = None  # set by authenticate(); sent by the helper calls

    # ---- life cycle ----

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def start(self) -> "EtcdServer":
        """Starts on fresh random ports (retrying when a port was taken) and waits until healthy."""
        if shutil.which(self.binary) is None and not os.path.exists(self.binary):
            raise EtcdError(f"etcd binary {self.binary!r} not found (apt-get install etcd-server)")
        last = None
        for _ in range(3):
            self.client_port, self.peer_port, self.metrics_port = free_port(), free_port(), free_port()
            if len({self.client_port, self.peer_port, self.metrics_port}) != 3:
                continue
            try:
                self._spawn()
                return self
            except EtcdError as e:
                last = e
                shutil.rmtree(self.data_dir, ignore_errors=True)
        raise last or EtcdError("could not pick ports for etcd")

    def restart(self) -> "EtcdServer":
        """Starts again on the same ports and data directory after stop() or kill()."""
        if self.pid is None:
            self._spawn()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after timeout seconds."""
        self._signal(signal.SIGTERM, timeout)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        self._signal(signal.SIGKILL, 5.0)

    def pause(self) -> None:
        """SIGSTOP: etcd hangs (connections stay open, nothing answers)."""
        if self.pid:
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.resume()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as r:
                return r.status == 200 and json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _spawn(self) -> None:
        client, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        args = [self.binary, "--name=baton-test", f"--data-dir={self.data_dir}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=baton-test={peer}", "--initial-cluster-state=new", "--log-level=warn",
                f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}",
                *self.extra_args]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.1)
        self.kill()
        raise EtcdError(f"etcd not healthy after {self.start_timeout} s:\n{self.log_tail()}")

    def _signal(self, sig: int, timeout: float) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    # ---- small client over the JSON gateway, for checks in tests ----

    def call(self, path: str, body: dict, timeout: float = 2.0) -> dict:
        """POST /v3/<path>; returns the decoded answer, raises EtcdError with etcd's message on an error.
        Plain HTTP only (a TLS server needs a client with its certificates)."""
        req = urllib.request.Request(self.endpoint + "/v3/" + path.lstrip("/"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        if self.token:
            req.add_header("Authorization", self.token)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise EtcdError(f"{path}: HTTP {e.code}: {e.read().decode('utf-8', 'replace')}") from None

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        value = value.encode() if isinstance(value, str) else value
        body = {"key": _b64(key.encode()), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("kv/put", body).get("header", {}).get("revision", "0"))

    def get(self, key: str) -> Optional[bytes]:
        kvs = self.call("kv/range", {"key": _b64(key.encode())}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def range(self, prefix: str) -> list:
        """Every kv under the prefix, decoded: dicts with key (str), value (bytes) and int revisions and lease."""
        p = prefix.encode()
        out = []
        for kv in self.call("kv/range", {"key": _b64(p), "range_end": _b64(_prefix_end(p))}).get("kvs", []):
            out.append({"key": base64.b64decode(kv["key"]).decode("utf-8", "replace"),
                        "value": base64.b64decode(kv.get("value", "")),
                        **{f: int(kv.get(f, "0")) for f in ("create_revision", "mod_revision", "version", "lease")}})
        return out

    def get_prefix(self, prefix: str) -> Dict[str, bytes]:
        return {kv["key"]: kv["value"] for kv in self.range(prefix)}

    def delete_prefix(self, prefix: str) -> int:
        p = prefix.encode()
        return int(self.call("kv/deleterange", {"key": _b64(p), "range_end": _b64(_prefix_end(p))}).get("deleted", "0"))

    def revision(self) -> int:
        return int(self.call("kv/range", {"key": _b64(b"\0"), "count_only": True})["header"]["revision"])

    def enable_auth(self, root_password: str) -> None:
        """Creates user root, grants it the root role, and enables authentication (runs etcdctl)."""
        env = dict(os.environ, ETCDCTL_API="3")
        for args in (["user", "add", f"root:{root_password}"], ["user", "grant-role", "root", "root"],
                     ["auth", "enable"]):
            r = subprocess.run(["etcdctl", f"--endpoints={self.endpoint}", *args], env=env, capture_output=True,
                               text=True, timeout=30)
            if r.returncode:
                raise EtcdError(f"etcdctl {' '.join(args)}: {r.stderr.strip()}")

    def authenticate(self, user: str, password: str) -> str:
        """Gets a token for the helper calls above."""
        self.token = None
        self.token = self.call("auth/authenticate", {"name": user, "password": password})["token"]
        return self.token


try:
    import pytest

    @pytest.fixture
    def etcd_server() -> Iterator[EtcdServer]:
        """A fresh etcd for one test."""
        with EtcdServer() as server:
            yield server
except ImportError:  # the harness also works without pytest
    pass


def _self_test() -> None:
    with EtcdServer() as etcd:
        rev = etcd.put("/t/a", "1")
        assert etcd.get("/t/a") == b"1" and rev > 1
        assert etcd.get("/t/missing") is None
        etcd.put("/t/b", b"\x00\xff")
        assert etcd.get_prefix("/t/") == {"/t/a": b"1", "/t/b": b"\x00\xff"}
        port, pid = etcd.client_port, etcd.pid
        etcd.kill()
        assert not etcd.healthy()
        etcd.restart()
        assert etcd.client_port == port and etcd.pid != pid
        assert etcd.get("/t/b") == b"\x00\xff", "data survives a restart"
        assert etcd.delete_prefix("/t/") == 2
        directory = etcd.dir
    assert not os.path.exists(directory)
    with EtcdServer(extra_args=["--auth-token-ttl=5"]) as etcd:
        etcd.enable_auth("pw")
        try:
            etcd.put("/x", "1")
            raise AssertionError("auth not enforced")
        except EtcdError:
            pass
        etcd.authenticate("root", "pw")
        etcd.put("/x", "1")
        assert etcd.get("/x") == b"1"
    print("etcd harness self-test: ok")


if __name__ == "__main__":
    _self_test()
