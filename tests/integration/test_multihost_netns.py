"""Issue 16 item 3: a cluster spread over "hosts", each a network namespace made by this test (veth pairs on one
bridge, 10.216.N.0/24), with no loopback shortcut between them: etcd (HTTPS, client certificates, auth on: only
baton's role writes /baton/), the router, a prefill node and a decode node each in their own namespace, listening on
their own addresses with mutual TLS, KV moving over UCX tcp between namespaces (UCX_TLS=tcp: no shared memory).
A real openai client in the root namespace gets an answer over HTTPS, prefilled on the prefill node (counted on both
nodes). A node asked to listen on a non-loopback address without mTLS refuses to start unless --insecure.

Needs root and `ip netns` (iproute2); without them it is skipped with the reason (never silently)."""
import os
import re
import shutil
import ssl
import subprocess
import time
import urllib.request

import httpx2
import openai
import pytest

from conftest import ROOT, build_dir

PKI = ROOT / "deploy" / "local" / "pki"
HOSTS = ["etcd", "router", "prefill", "decode"]


def netns_unavailable():
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root)"
    if not shutil.which("ip"):
        return "needs the ip command (iproute2)"
    probe = f"bt16p{os.getpid() % 100000}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*args):
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, f"{' '.join(args)}: {p.stderr}"
    return p.stdout


class Net:
    """A bridge in the root namespace and one namespace per host, each with eth0 = 10.216.S.(i+1)."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.subnet = 10 + os.getpid() % 200
        self.bridge = f"bt16b{tag}"
        self.ns = {h: f"bt16-{tag}-{h}" for h in HOSTS}
        self.ip = {h: f"10.216.{self.subnet}.{i + 1}" for i, h in enumerate(HOSTS)}
        self.gw = f"10.216.{self.subnet}.254"
        self.veths = []

    def up(self):
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        sh("ip", "addr", "add", f"{self.gw}/24", "dev", self.bridge)
        for i, h in enumerate(HOSTS):
            ns, veth = self.ns[h], f"{self.bridge}v{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.veths.append(veth)
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[h]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self):
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Procs:
    def __init__(self, logdir):
        self.logdir, self.procs = logdir, []

    def start(self, net, host, name, cmd, env=None):
        log = open(self.logdir / f"{name}.log", "w")
        p = subprocess.Popen(["ip", "netns", "exec", net.ns[host], *cmd], stdout=log, stderr=subprocess.STDOUT,
                             env=dict(os.environ, **(env or {})))
        self.procs.append((name, p))
        return p

    def log(self, name):
        return (self.logdir / f"{name}.log").read_text()

    def wait_log(self, name, pattern, timeout=180):
        end = time.time() + timeout
        while time.time() < end:
            m = re.search(pattern, self.log(name))
            if m:
                return m
            for n, p in self.procs:
                if n == name and p.poll() is not None:
                    raise AssertionError(f"{name} exited {p.returncode}:\n{self.log(name)[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{name}: no '{pattern}' after {timeout} s:\n{self.log(name)[-3000:]}")

    def stop(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def etcd_setup(net, tls, procs):
    """etcd over HTTPS with client certificates in its namespace, then users, role and auth (as deploy/local/cluster
    up --tls does)."""
    ip = net.ip["etcd"]
    procs.start(net, "etcd", "etcd", [
        "etcd", "--name", "e", "--data-dir", str(procs.logdir / "etcd-data"),
        "--listen-client-urls", f"https://{ip}:2379", "--advertise-client-urls", f"https://{ip}:2379",
        "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
        "--initial-cluster", "e=http://127.0.0.1:2380",
        "--cert-file", f"{tls}/etcd-server.pem", "--key-file", f"{tls}/etcd-server-key.pem",
        "--client-cert-auth", "--trusted-ca-file", f"{tls}/ca.pem"])
    procs.wait_log("etcd", "ready to serve client requests", timeout=60)
    ctl = ["etcdctl", "--endpoints", f"https://{ip}:2379", "--cacert", f"{tls}/ca.pem", "--cert", f"{tls}/root.pem",
           "--key", f"{tls}/root-key.pem"]
    for args in (["user", "add", "root", "--new-user-password", "root-pw-not-used"], ["role", "add", "baton"],
                 ["role", "grant-permission", "baton", "--prefix=true", "readwrite", "/baton/"],
                 ["user", "add", "baton", "--new-user-password", (tls / "etcd-baton.password").read_text().strip()],
                 ["user", "grant-role", "baton", "baton"], ["auth", "enable"]):
        sh(*ctl, *args)
    return f"https://{ip}:2379"


@pytest.fixture(scope="module")
def cluster(default_model, tmp_path_factory):
    why = netns_unavailable()
    if why:
        pytest.skip(f"multi-host test in network namespaces: {why}")
    base = tmp_path_factory.mktemp("netns")
    net = Net()
    tls = base / "tls"
    subprocess.run([str(PKI), str(tls), "root", "baton,no-cn", f"etcd-server,IP:{net.ip['etcd']}",
                    f"router,IP:{net.ip['router']}", "decode-1", "prefill-1"], check=True, timeout=120)
    (tls / "etcd-baton.password").write_text("pw-" + os.urandom(12).hex() + "\n")
    procs = Procs(base)
    try:
        net.up()
        etcd = etcd_setup(net, tls, procs)
        bindir = build_dir() / "bin"
        etcd_flags = ["--etcd", etcd, "--etcd-ca", f"{tls}/ca.pem", "--etcd-cert", f"{tls}/baton.pem",
                      "--etcd-key", f"{tls}/baton-key.pem", "--etcd-user", "baton",
                      "--etcd-password-file", f"{tls}/etcd-baton.password"]
        ucx = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "BATON_THREADS": "1"}
        for role, node in (("decode", "decode-1"), ("prefill", "prefill-1")):
            ip = net.ip[role]
            procs.start(net, role, node, [
                str(bindir / f"baton-{role}"), "--model", str(default_model), "--node-id", node,
                "--grpc-listen", f"{ip}:7000", "--http-listen", f"{ip}:7001", "--kv-mem", "64M",
                "--tls-cert", f"{tls}/{node}.pem", "--tls-key", f"{tls}/{node}-key.pem", "--tls-ca", f"{tls}/ca.pem",
                *etcd_flags], env=ucx)
        rip = net.ip["router"]
        procs.start(net, "router", "router", [
            str(bindir / "baton-router"), "--model", str(default_model), "--http-listen", f"{rip}:8000",
            "--grpc-listen", f"{rip}:50051", "--prefill-mode", "remote", "--tls-cert", f"{tls}/router.pem",
            "--tls-key", f"{tls}/router-key.pem", "--tls-ca", f"{tls}/ca.pem", *etcd_flags])
        for node in ("decode-1", "prefill-1"):
            procs.wait_log(node, "registered in etcd as")
        procs.wait_log("router", r"node decode-1 \(decode\) joined", timeout=60)
        procs.wait_log("router", r"node prefill-1 \(prefill\) joined", timeout=60)
        yield net, tls, procs
    finally:
        procs.stop()
        net.down()


def metric(url, name):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_request_across_namespaces_with_mtls(cluster):
    net, tls, procs = cluster
    for name, host in (("decode-1", "decode"), ("prefill-1", "prefill")):  # each on its own host's address
        assert f"listening grpc={net.ip[host]}:7000" in procs.log(name)
    ctx = ssl.create_default_context(cafile=f"{tls}/ca.pem")
    client = openai.OpenAI(base_url=f"https://{net.ip['router']}:8000/v1", api_key="none", max_retries=0,
                           timeout=120, http_client=httpx2.Client(verify=ctx, timeout=120))
    r = client.chat.completions.create(model="", max_tokens=16, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    dec = f"http://{net.ip['decode']}:7001/metrics"
    pre = f"http://{net.ip['prefill']}:7001/metrics"
    assert metric(dec, 'baton_remote_prefills_total{result="ok"}') == 1, procs.log("decode-1")[-3000:]
    assert metric(pre, "baton_kv_transfer_bytes_total") > 0
    # the KV moved over tcp between namespaces, not through shared memory
    assert metric(pre, 'baton_kv_transfer_descriptors_total{path="am"}') + \
        metric(pre, 'baton_kv_transfer_descriptors_total{path="put"}') > 0
    assert metric(pre, 'baton_kv_transfer_descriptors_total{path="mapped"}') == 0


def test_insecure_internal_listener_refused(cluster):
    net, tls, procs = cluster
    ip = net.ip["decode"]
    cmd = ["ip", "netns", "exec", net.ns["decode"], str(build_dir() / "bin" / "baton-decode"), "--etcd", "none",
           "--grpc-listen", f"{ip}:7100"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "needs mutual TLS" in p.stderr and "--insecure" in p.stderr, p.stderr
