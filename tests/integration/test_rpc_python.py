"""common/rpc against the real Python grpcio client: stubs generated from proto/ at test time, the C test server
(tests/unit/common/rpc_test_server.c) on a random loopback port. Checks health, unary calls, streaming, cancel seen
by the server, deadlines, unknown methods, bad protobuf, concurrency, TLS, and a clean SIGTERM shutdown."""
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest

from harness import pygen
from conftest import ROOT, build_dir

PROTO = ROOT / "proto"


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    return pygen.generate(PROTO, tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))


class Server:
    def __init__(self, *args):
        exe = build_dir() / "bin" / "rpc_test_server"
        if not exe.exists():
            pytest.fail(f"{exe} is not built (build target rpc_test_server or set BATON_BUILD_DIR)")
        self.proc = subprocess.Popen([str(exe), "--listen", "127.0.0.1:0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            pytest.fail(f"rpc_test_server did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.split()[1])
        self.stopped = False

    def stop(self, timeout=30):
        """SIGTERM; returns (exit code, stdout rest, stderr)."""
        self.stopped = True
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


@pytest.fixture
def server():
    s = Server()
    yield s
    if not s.stopped:
        rc, out, err = s.stop()
        assert rc == 0, f"server exit {rc}: {out} {err}"
        assert "AddressSanitizer" not in err and "runtime error" not in err, err


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch


def stats(pb, ch):
    g = pb["baton.v1.generate_pb2"]
    text = pb["baton.v1.generate_pb2_grpc"].GenerationStub(ch).Detokenize(g.DetokenizeRequest(), timeout=5).text
    return dict(kv.split("=") for kv in text.split())


def wait_stat(pb, ch, key, want, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if int(stats(pb, ch)[key]) >= want:
            return True
        time.sleep(0.02)
    return False


def test_health(pb, channel):
    h = pb["baton_health.health_pb2"]
    stub = pb["baton_health.health_pb2_grpc"].HealthStub(channel)
    serving = h.HealthCheckResponse.SERVING
    assert stub.Check(h.HealthCheckRequest(), timeout=5).status == serving
    assert stub.Check(h.HealthCheckRequest(service="baton.v1.Generation"), timeout=5).status == serving
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(h.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stub.Watch(h.HealthCheckRequest(), timeout=5)))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_unary_and_errors(pb, channel):
    g = pb["baton.v1.generate_pb2"]
    stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(channel)
    r = stub.Tokenize(g.TokenizeRequest(text="héllo"), timeout=5)
    assert list(r.token_ids) == list("héllo".encode()) and r.max_context == 4096
    models = stub.ListModels(g.ListModelsRequest(), timeout=5).models
    assert [m.id for m in models] == ["test"] and 1000 < models[0].created <= 5100  # remaining deadline, ms

    unknown = channel.unary_unary("/baton.v1.Generation/Nope")
    with pytest.raises(grpc.RpcError) as e:
        unknown(b"", timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED

    raw = channel.unary_unary("/baton.v1.Generation/Tokenize")
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\x08\x01", timeout=5)  # field 1 as a varint: TokenizeRequest.model is a string
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(g.TokenizeRequest(text="hang"), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_stat(pb, channel, "cancelled", 1)


def test_generate_stream(pb, channel):
    g = pb["baton.v1.generate_pb2"]
    stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(channel)
    n = 2000
    t0 = time.monotonic()
    msgs = list(stub.Generate(g.GenerateRequest(text="", max_tokens=n), timeout=30))
    dt = time.monotonic() - t0
    assert [m.token_ids[0] for m in msgs] == list(range(n))
    assert all(m.finish_reason == g.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    assert msgs[-1].finish_reason == g.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == n and msgs[-1].usage.total_tokens == n + 1
    print(f"python client: {n} streamed messages in {dt:.3f} s ({n / dt:.0f}/s)")

    md = list(stub.Generate(g.GenerateRequest(text="meta:authorization", max_tokens=1),
                            metadata=[("authorization", "Bearer k")], timeout=5))
    assert md[0].text == "Bearer k"

    it = stub.Generate(g.GenerateRequest(text="fail", max_tokens=10), timeout=5)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for m in it:
            got.append(m)
    assert len(got) == 3 and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "fail mode" in e.value.details()


def test_cancel_mid_stream(pb, channel):
    g = pb["baton.v1.generate_pb2"]
    stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(channel)
    before = int(stats(pb, channel)["cancelled"])
    for text in ("hang", "slow"):
        it = stub.Generate(g.GenerateRequest(text=text, max_tokens=100000), timeout=30)
        first = next(it)
        assert first.token_ids[0] == 0
        it.cancel()
        with pytest.raises(grpc.RpcError) as e:
            for _ in it:
                pass
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert wait_stat(pb, channel, "cancelled", before + 2)  # the server saw both cancels
    end = time.monotonic() + 10
    while stats(pb, channel)["active"] != "0" and time.monotonic() < end:
        time.sleep(0.02)
    assert stats(pb, channel)["active"] == "0"  # every producer finished its call


def test_concurrent_streams(pb, channel):
    g = pb["baton.v1.generate_pb2"]
    stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(channel)
    results = [None] * 32

    def worker(i):
        msgs = list(stub.Generate(g.GenerateRequest(max_tokens=100), timeout=30))
        results[i] = [m.token_ids[0] for m in msgs] == list(range(100))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results)


def test_sigterm_with_streams_in_flight(pb):
    s = Server()
    g = pb["baton.v1.generate_pb2"]
    with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
        stub = pb["baton.v1.generate_pb2_grpc"].GenerationStub(ch)
        its = [stub.Generate(g.GenerateRequest(text="hang", max_tokens=10), timeout=30) for _ in range(4)]
        for it in its:
            next(it)
        t0 = time.monotonic()
        rc, out, err = s.stop()
        assert rc == 0, err
        assert time.monotonic() - t0 < 15
        assert "AddressSanitizer" not in err and "runtime error" not in err, err
        assert "idle=1" in out
        for it in its:
            with pytest.raises(grpc.RpcError) as e:
                for _ in it:
                    pass
            assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI")
def test_tls(pb, tmp_path):
    def sh(*cmd):
        subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True)

    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=baton-test-ca",
       "-keyout", "ca.key", "-out", "ca.pem")
    sh("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
       "-out", "server.csr")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    sh("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
       "-days", "2", "-extfile", "san.ext", "-out", "server.pem")
    s = Server("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"))
    h = pb["baton_health.health_pb2"]
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "ca.pem").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{s.port}", creds) as ch:
            stub = pb["baton_health.health_pb2_grpc"].HealthStub(ch)
            assert stub.Check(h.HealthCheckRequest(), timeout=10).status == h.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{s.port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb["baton_health.health_pb2_grpc"].HealthStub(ch).Check(h.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        rc, out, err = s.stop()
    assert rc == 0, err
