"""The Helm chart's mTLS layout (issue 21) on real processes: every node shares one certificate whose DNS names are
wildcards (`*.decode.<release>`, `*.prefill.<release>`) and takes the node id `<pod>.<role>.<release>`, so one
cert-manager Certificate serves pods whose names are not known in advance. The router and the decode node check
at the handshake that a member holds a certificate for the node id its etcd record claims; this shows the wildcard
satisfies that check in both directions (requests are served over HTTPS, prefilled on the prefill node, which
accepts the decode node's call only from a certificate naming the destination node: the wildcard counts now) and
that it stays a check: a node presenting the same certificate under an id outside the wildcard never gets a call.
A shared certificate proves the role, not the pod: per-pod certificates keep per-node identity (README)."""
from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
import urllib.request

from harness.baton_procs import start_decode, start_prefill
from harness.etcd import EtcdServer
from harness.router_procs import start_router

from conftest import ROOT

PKI = ROOT / "deploy" / "local" / "pki"
RELEASE = "baton"


def tls_flags(d, name):
    return {"tls_cert": str(d / f"{name}.pem"), "tls_key": str(d / f"{name}-key.pem"), "tls_ca": str(d / "ca.pem")}


def https_json(ctx, url, body=None, timeout=60):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_wildcard_node_certificate_passes_the_identity_check(default_model, tmp_path):
    pki = tmp_path / "pki"
    subprocess.run([str(PKI), str(pki), f"nodes,DNS:*.decode.{RELEASE},DNS:*.prefill.{RELEASE}",
                    "router,IP:127.0.0.1"], check=True)
    nodes, router = tls_flags(pki, "nodes"), tls_flags(pki, "router")
    good, bad = f"pod-a.decode.{RELEASE}", f"pod-z.decode.{RELEASE}.evil"
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id=f"pod-p.prefill.{RELEASE}", **nodes) as pre, \
            start_decode(etcd, default_model, threads=1, node_id=good, **nodes) as dec, \
            start_decode(etcd, default_model, threads=1, node_id=bad, **nodes) as evil, \
            start_router(etcd, default_model, wait=False, prefill_mode="remote", **router) as rtr:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        deadline = time.monotonic() + 60
        while True:  # the harness probes plain HTTP: poll HTTPS here
            m = re.search(r"listening grpc=\S+ http=(\S+)", rtr.log())
            if m:
                try:
                    code, body = https_json(ctx, f"https://{m.group(1)}/ready")
                    if code == 200 and body.get("decode_nodes") == 2:
                        break
                except OSError:
                    pass
            assert rtr.alive() and time.monotonic() < deadline, rtr.log()[-3000:]
            time.sleep(0.1)
        base = f"https://{m.group(1)}/v1"
        texts = []
        for i in range(6):
            code, out = https_json(ctx, base + "/completions", {"model": "", "prompt": f"Count to {i + 3}:",
                                                                "max_tokens": 6, "temperature": 0})
            assert code == 200, out
            texts.append(out["choices"][0]["text"])
        served = {n: (p.metric("baton_requests_total", 'status="ok"') or 0) for n, p in (("good", dec), ("evil", evil))}
        remote = pre.metric("baton_prefill_seconds_count") or 0
        fallback = dec.metric("baton_remote_prefills_total", 'result="fallback"')
        print(f"\nwildcard mTLS: 6 requests over HTTPS -> {served}, prefills on the prefill node {remote:.0f}; "
              f"router log names the refused id: {bad in rtr.log()}")
        assert served["good"] == 6 and served["evil"] == 0, served
        # the prefill node checks that its caller is the decode node named as the KV destination (before the
        # wildcard was accepted there: PERMISSION_DENIED "the caller's certificate names 'nodes'", local fallback)
        assert remote == 6 and not fallback, (remote, fallback)
