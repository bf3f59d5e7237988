"""Issue 16 items 3 and 4 attacked from outside, on `deploy/local/cluster up --tls` (a throwaway CA; etcd over HTTPS
with client certificates and auth; mutual TLS between router, decode and prefill nodes; HTTPS on the OpenAI API):

- a real openai client gets an answer over HTTPS, with the prefill on the prefill node (decode -> prefill is mTLS
  and checks the prefill node's identity); plain HTTP to the same port gets nothing;
- hostile gRPC clients without a certificate from the cluster CA (plain, TLS without a certificate, a certificate
  from another CA) cannot call Decode/Run, Decode/Abort, Prefill/Run or Prefill/Abort; a client with a cluster
  certificate reaches the handlers (the control);
- etcd refuses to write a member for anyone but baton's role: a client certificate of the CA without the password,
  the right user with a wrong password, the JSON gateway without a token;
- a forged member record that got into etcd anyway (written by the admin here) whose certificate identity does not
  match (a host holding the CA's "intruder" certificate claims to be decode-9), or whose address is not host:port,
  is never called, and requests keep being served by the real decode node.
All of this fails on code without the TLS flags (the cluster does not start)."""
import base64
import contextlib
import json
import os
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import httpx2
import openai
import pytest

from conftest import ROOT, build_dir
from harness.etcd import free_port, free_port_run

CLUSTER = ROOT / "deploy" / "local" / "cluster"
PKI = ROOT / "deploy" / "local" / "pki"
NODE_METHODS = {"decode-1": ["/baton.v1.Decode/Run", "/baton.v1.Decode/Abort"],
                "prefill-1": ["/baton.v1.Prefill/Run", "/baton.v1.Prefill/Abort"]}


class Cluster:
    def __init__(self, run, env, http, etcd):
        self.run, self.env, self.http, self.etcd = run, env, http, etcd
        self.tls = run / "tls"

    def path(self, name):
        return str(self.tls / name)

    def grpc_addr(self, node):
        m = re.search(r"listening grpc=(\S+)", (self.run / f"{node}.log").read_text())
        assert m, f"{node} did not log its gRPC address"
        return m.group(1)

    def http_addr(self, node):
        return re.search(r"listening grpc=\S+ http=(\S+)", (self.run / f"{node}.log").read_text()).group(1)

    def etcdctl(self, cert, *args, check=True):
        """etcdctl over the cluster's TLS as the user named by cert's CN (root administers)."""
        cmd = ["etcdctl", "--endpoints", f"https://{self.etcd}", "--cacert", self.path("ca.pem"),
               "--cert", self.path(f"{cert}.pem"), "--key", self.path(f"{cert}-key.pem"), *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check:
            assert p.returncode == 0, p.stderr
        return p

    def gateway(self, path, body, token=None, cert="baton"):
        """POST to etcd's JSON gateway with a client certificate of the CA; returns (status, json)."""
        ctx = ssl.create_default_context(cafile=self.path("ca.pem"))
        ctx.load_cert_chain(self.path(f"{cert}.pem"), self.path(f"{cert}-key.pem"))
        req = urllib.request.Request(f"https://{self.etcd}{path}", data=json.dumps(body).encode(), method="POST")
        if token:
            req.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def token(self, password):
        st, body = self.gateway("/v3/auth/authenticate", {"name": "baton", "password": password})
        return body.get("token") if st == 200 else None

    def openai(self):
        return openai.OpenAI(base_url=f"https://{self.http}/v1", api_key="none", max_retries=0, timeout=120,
                             http_client=httpx2.Client(verify=ssl.create_default_context(cafile=self.path("ca.pem")), timeout=120))


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    run = tmp_path_factory.mktemp("tls") / "run"
    http, etcd = free_port(), f"127.0.0.1:{free_port_run(2)}"
    env = dict(os.environ, BATON_BUILD_DIR=str(build_dir()), BATON_RUN_DIR=str(run), BATON_ETCD_LISTEN=etcd,
               BATON_HTTP_LISTEN=f"127.0.0.1:{http}", BATON_GRPC_LISTEN=f"127.0.0.1:{free_port()}", BATON_THREADS="1")
    up = subprocess.run([str(CLUSTER), "up", "--tls", "--detach", "--model", str(default_model),
                         "--router-args", "--prefill-mode remote"], env=env, capture_output=True, text=True,
                        timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"https://127.0.0.1:{http}" in up.stdout, up.stdout
        yield Cluster(run, env, f"127.0.0.1:{http}", etcd)
    finally:
        subprocess.run([str(CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=60)


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def node_metrics(c, node):
    with urllib.request.urlopen(f"http://{c.http_addr(node)}/metrics", timeout=10) as r:
        return r.read().decode()


def ask(c, content="What is the capital of France?"):
    r = c.openai().chat.completions.create(model="", max_tokens=16, temperature=0,
                                           messages=[{"role": "user", "content": content}])
    return r.choices[0].message.content


def test_https_openai_with_remote_prefill_over_mtls(cluster):
    before = metric(node_metrics(cluster, "decode-1"), 'baton_remote_prefills_total{result="ok"}')
    assert "Paris" in ask(cluster)
    after = metric(node_metrics(cluster, "decode-1"), 'baton_remote_prefills_total{result="ok"}')
    assert after == before + 1, "the prefill did not run on the prefill node over mTLS"
    # the same port does not speak plain HTTP, and a client that does not trust the CA is refused
    with pytest.raises(Exception):
        urllib.request.urlopen(f"http://{cluster.http}/health", timeout=5).read()
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"https://{cluster.http}/health", context=ssl.create_default_context(), timeout=5)
    # the router's public gRPC API is TLS
    with open(cluster.path("ca.pem"), "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    ch = grpc.secure_channel(cluster.env["BATON_GRPC_LISTEN"], creds)
    health = ch.unary_unary("/grpc.health.v1.Health/Check")
    assert health(b"", timeout=10) is not None
    ch.close()


def rogue_ca_cert(tmp_path):
    """A client certificate from a CA the cluster does not trust."""
    subprocess.run([str(PKI), str(tmp_path / "rogue"), "decode-1"], check=True, timeout=60)
    return (tmp_path / "rogue" / "decode-1.pem").read_bytes(), (tmp_path / "rogue" / "decode-1-key.pem").read_bytes()


def call_code(channel, method):
    """Calls method with an empty request; returns the gRPC status code it ends with."""
    try:
        if method.endswith("/Run") and "Decode" in method:
            for _ in channel.unary_stream(method)(b"", timeout=10):
                pass
        else:
            channel.unary_unary(method)(b"", timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_hostile_clients_cannot_call_nodes(cluster, tmp_path):
    ca = open(cluster.path("ca.pem"), "rb").read()
    rogue_cert, rogue_key = rogue_ca_cert(tmp_path)
    good = (open(cluster.path("router.pem"), "rb").read(), open(cluster.path("router-key.pem"), "rb").read())
    for node, methods in NODE_METHODS.items():
        addr = cluster.grpc_addr(node)
        opts = [("grpc.ssl_target_name_override", node)]
        hostile = {
            "plain": grpc.insecure_channel(addr),
            "tls without a certificate": grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca), opts),
            "certificate of another CA": grpc.secure_channel(
                addr, grpc.ssl_channel_credentials(ca, rogue_key, rogue_cert), opts),
        }
        for who, ch in hostile.items():
            for m in methods:
                code = call_code(ch, m)
                assert code == grpc.StatusCode.UNAVAILABLE, f"{who} client reached {m} on {node}: {code}"
            ch.close()
        # control: a certificate of the cluster's CA reaches the handlers (they refuse the empty request)
        ch = grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca, good[1], good[0]), opts)
        for m in methods:
            assert call_code(ch, m) != grpc.StatusCode.UNAVAILABLE, f"a cluster client could not reach {m}"
        ch.close()


def member_key(name):
    return f"/baton/default/nodes/{name}"


def test_only_baton_role_writes_members(cluster):
    key = member_key("decode-9")
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    put = {"key": b64(key), "value": b64('{"node_id":"decode-9"}')}
    # a certificate of the CA (CN "intruder" is no etcd user) without a password
    subprocess.run([str(PKI), str(cluster.tls), "intruder,IP:127.0.0.1"], check=True, timeout=60)
    p = cluster.etcdctl("intruder", "put", key, "x", check=False)
    err = p.stderr.lower()
    assert p.returncode != 0 and ("user name not found" in err or "permission denied" in err), p.stderr
    # baton's user with a wrong password
    assert cluster.token("wrong-password") is None
    # the JSON gateway without a token
    st, body = cluster.gateway("/v3/kv/put", put)
    assert st != 200, body
    # nothing was written
    assert cluster.etcdctl("root", "get", key).stdout == ""
    # control: baton's user with its password writes members, and only under /baton/
    token = cluster.token((cluster.tls / "etcd-baton.password").read_text().strip())
    assert token
    st, body = cluster.gateway("/v3/kv/put", {"key": b64("/other/x"), "value": b64("x")}, token=token)
    assert st != 200 and "permission denied" in json.dumps(body), body
    st, body = cluster.gateway("/v3/kv/put", {"key": b64(member_key("probe")), "value": b64("{}")}, token=token)
    assert st == 200, body
    cluster.etcdctl("root", "del", member_key("probe"))


class Hostile(grpc.GenericRpcHandler):
    """A gRPC server holding a certificate of the CA for another name ("intruder", valid for its address 127.0.0.1, so
    only the identity check refuses it): counts every call that reaches it."""

    def __init__(self):
        self.calls = 0
        self.lock = threading.Lock()

    def service(self, details):
        with self.lock:
            self.calls += 1
        return None  # UNIMPLEMENTED


@contextlib.contextmanager
def hostile_server(cluster):
    h = Hostile()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[h])
    creds = grpc.ssl_server_credentials([(open(cluster.path("intruder-key.pem"), "rb").read(),
                                          open(cluster.path("intruder.pem"), "rb").read())])
    port = srv.add_secure_port("127.0.0.1:0", creds)
    srv.start()
    try:
        yield h, f"127.0.0.1:{port}"
    finally:
        srv.stop(0)


def forge(cluster, name, grpc_addr):
    """Copies decode-1's record under another node id and address (as the admin: what a breach would write)."""
    rec = json.loads(cluster.etcdctl("root", "get", member_key("decode-1"), "--print-value-only").stdout)
    rec["node_id"], rec["grpc_addr"] = name, grpc_addr
    rec["started_ms"] = int(time.time() * 1000)
    cluster.etcdctl("root", "put", member_key(name), json.dumps(rec))


def test_forged_member_is_not_used(cluster):
    if not (cluster.tls / "intruder.pem").exists():
        subprocess.run([str(PKI), str(cluster.tls), "intruder,IP:127.0.0.1"], check=True, timeout=60)
    with hostile_server(cluster) as (hostile, addr):
        forge(cluster, "decode-9", addr)           # a host with the CA's "intruder" certificate
        forge(cluster, "decode-8", "unix:/tmp/x")  # not host:port
        try:
            deadline = time.time() + 30  # the router's watch sees them (etcd's put can take a second)
            while time.time() < deadline:
                log = (cluster.run / "router.log").read_text()
                if "node decode-9 (decode) joined" in log and "node decode-8 (decode) joined" in log:
                    break
                time.sleep(0.1)
            # power of two choices among three "decode nodes": the forged ones get picked, though not on every ask
            # (a run once went 6 asks without trying decode-9), so ask until it was tried, at most 40 times
            for i in range(40):
                assert "Paris" in ask(cluster)
                log = (cluster.run / "router.log").read_text()
                if i >= 5 and "Peer name decode-9 is not in peer cert" in log:
                    break
            assert hostile.calls == 0, f"the forged member received {hostile.calls} calls"
            assert "Peer name decode-9 is not in peer cert" in log, f"the forged member was never tried in {i + 1} asks"
        finally:
            cluster.etcdctl("root", "del", member_key("decode-9"))
            cluster.etcdctl("root", "del", member_key("decode-8"))


def prefill_runs(c):
    return metric(urllib.request.urlopen(f"http://{c.http_addr('prefill-1')}/metrics", timeout=10).read().decode(),
                  "baton_prefill_seconds_count")


def test_prefill_hint_with_another_identity_is_refused(cluster, tmp_path_factory):
    """A caller with a cluster certificate hints the real prefill node's address under another node id: the decode
    node dials it expecting that id, the handshake fails, and it prefills locally; the same hint with the right id
    is served remotely (the control)."""
    from harness import pygen
    pb = pygen.generate(ROOT / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))
    n = pb["baton.v1.node_pb2"]
    ca = open(cluster.path("ca.pem"), "rb").read()
    creds = grpc.ssl_channel_credentials(ca, open(cluster.path("router-key.pem"), "rb").read(),
                                         open(cluster.path("router.pem"), "rb").read())
    ch = grpc.secure_channel(cluster.grpc_addr("decode-1"), creds, [("grpc.ssl_target_name_override", "decode-1")])
    run = pb["baton.v1.node_pb2_grpc"].DecodeStub(ch).Run
    paddr = cluster.grpc_addr("prefill-1")
    dmet = f'baton_remote_prefills_total{{result="%s"}}'
    for node_id, remote in (("prefill-9", False), ("prefill-1", True)):
        before = (metric(node_metrics(cluster, "decode-1"), dmet % "ok"),
                  metric(node_metrics(cluster, "decode-1"), dmet % "fallback"), prefill_runs(cluster))
        ids = [1000 + 7 * i + (0 if remote else 3) for i in range(64)]  # no prefix shared between the two runs
        msgs = list(run(n.DecodeRunRequest(prompt_token_ids=ids, max_tokens=2, ignore_eos=True,
                                           prefill=n.PrefillHint(node_id=node_id, grpc_address=paddr)), timeout=60))
        assert sum(len(m.token_ids) for m in msgs) == 2
        after = (metric(node_metrics(cluster, "decode-1"), dmet % "ok"),
                 metric(node_metrics(cluster, "decode-1"), dmet % "fallback"), prefill_runs(cluster))
        if remote:
            assert after[0] == before[0] + 1 and after[2] == before[2] + 1, (before, after)
        else:
            assert after[0] == before[0] and after[2] == before[2], f"the prefill node served a hint for {node_id}"
    ch.close()


def test_bench_serve_over_https(cluster, tmp_path):
    out = tmp_path / "bs.json"
    args = [str(build_dir() / "bin" / "baton"), "bench-serve", "--url", f"https://{cluster.http}", "--rate", "inf",
            "--requests", "3", "--prompt-tokens", "16", "--output-tokens", "4", "--quiet", "--json", str(out)]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120)  # the system CAs do not know ours
    assert refused.returncode == 1, refused.stderr
    r = subprocess.run([*args, "--tls-ca", cluster.path("ca.pem")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 3 and run["errors"] == 0, run


def test_prefill_run_only_from_its_destination(cluster, tmp_path_factory):
    """Under mTLS a Prefill/Run must come from the decode node it names: a caller with another cluster certificate
    (the router's) that names decode-1 and carries decode-1's real pool descriptor (read from etcd) is refused with
    PERMISSION_DENIED before any compute; decode-1's own certificate passes that check (and then meets the claim:
    the made-up epoch is not one decode-1 handed out, so nothing is written)."""
    from harness import pygen
    pb = pygen.generate(ROOT / "proto", tmp_path_factory.mktemp("protos"), tmp_path_factory.mktemp("pygen"))
    n = pb["baton.v1.node_pb2"]
    rec = json.loads(cluster.etcdctl("root", "get", member_key("decode-1"), "--print-value-only").stdout)
    desc = base64.b64decode(rec["ucx"])
    fingerprint = int.from_bytes(desc[32:40], "little")
    ca = open(cluster.path("ca.pem"), "rb").read()
    ids = [1000 + 11 * i for i in range(40)]
    dst = n.KvDestination(decode_node_id="decode-1", epoch=0x5eed5eed, block_ids=[0, 1, 2], layout_fingerprint=fingerprint,
                          checksums=True, pool_descriptor=desc)
    req = n.PrefillRunRequest(request_id="x", prompt_token_ids=ids, destination=dst)
    codes = {}
    for who in ("router", "decode-1"):
        creds = grpc.ssl_channel_credentials(ca, open(cluster.path(f"{who}-key.pem"), "rb").read(),
                                             open(cluster.path(f"{who}.pem"), "rb").read())
        with grpc.secure_channel(cluster.grpc_addr("prefill-1"), creds,
                                 [("grpc.ssl_target_name_override", "prefill-1")]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb["baton.v1.node_pb2_grpc"].PrefillStub(ch).Run(req, timeout=60)
            codes[who] = (e.value.code(), e.value.details())
    assert codes["router"][0] == grpc.StatusCode.PERMISSION_DENIED, codes
    assert "names 'router', not decode node 'decode-1'" in codes["router"][1], codes
    assert codes["decode-1"][0] != grpc.StatusCode.PERMISSION_DENIED and "claim" in codes["decode-1"][1], codes
