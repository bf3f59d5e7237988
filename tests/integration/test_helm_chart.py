"""The Helm chart deploy/helm/baton (issue 21), tested without a Kubernetes cluster:

- it renders with Helm's own template engine (Helm SDK v4.2.3 through the `helm-python-sdk` wheel, which bundles it
  as a shared library: PyPI has no helm binary) with the default values and with GPU, TLS, KEDA, HPA, external-etcd
  and colocated values; values that cannot work fail the render with a message;
- every rendered object of a built-in kind validates, strictly (no unknown field), against the Kubernetes JSON
  schemas of two Kubernetes versions (`kubernetes-validate`); custom resources (ServiceMonitor, PrometheusRule,
  ScaledObject, Certificate) are checked for the fields their operators require;
- `helm lint` (the same SDK) reports no warning or error;
- the PrometheusRule passes `promtool check rules` and the alert unit tests of deploy/helm/baton/tests/;
- probes, drain grace, GPU and TLS settings land where they should;
- the dashboard file is what deploy/grafana/dashboard.py writes, and every metric name the dashboard, the rules and
  the ScaledObjects use is exported by a live local cluster (etcd, router, prefill and decode node: scraped here).
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.request

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (tests/requirements.txt) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (tests/requirements.txt)")

from harness.baton_procs import start_decode, start_prefill  # noqa: E402
from harness.etcd import EtcdServer  # noqa: E402
from harness.router_procs import start_router  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "baton"
NAMESPACE = "baton"
K8S_VERSIONS = ["1.29.0", "1.35.0"]  # the oldest and a recent minor the chart is validated against
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "Certificate"}

VALUE_SETS = {
    "default": {},
    "gpu": {"image": {"flavor": "cuda"},
            "prefill": {"gpus": 1, "rdma": {"resource": "rdma/rdma_shared_device_a", "count": 1}},
            "decode": {"gpus": 1, "rdma": {"resource": "rdma/rdma_shared_device_a", "count": 1}, "spec": "ngram"},
            "ucx": {"tls": "rc,cuda_copy,cuda_ipc,gdr_copy", "dataPath": "put", "netDevices": "mlx5_0:1"}},
    "tls": {"tls": {"enabled": True, "certManager": {"enabled": True}},
            "metrics": {"serviceMonitor": {"enabled": True}}},
    "keda": {"autoscaling": {"mode": "keda"},
             "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                         "prometheusRule": {"enabled": True}}},
    "hpa": {"autoscaling": {"mode": "hpa"}},
    "external-etcd": {"etcd": {"enabled": False, "external": {
        "endpoints": "https://etcd-0:2379,https://etcd-1:2379", "user": "baton", "passwordSecret": "etcd-baton",
        "tlsSecret": "etcd-client"}},
        "model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "smollm2"}},
        "router": {"apiKeySecret": "baton-api-key", "replicas": 2, "extraArgs": ["--ttft-slo-ms", "2000"]}},
    "colocated-hostpath": {"prefill": {"replicas": 0}, "model": {"source": "hostPath", "hostPath": {"path": "/srv/m"}},
                           "etcd": {"replicas": 1, "persistence": {"enabled": False}},
                           "podDisruptionBudget": {"enabled": False}, "grafana": {"dashboard": {"enabled": False}}},
}


def render(values: dict) -> list:
    """Every object the chart renders with these values (release "baton" in namespace NAMESPACE)."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="baton", namespace=NAMESPACE)
    objs = []
    for name, text in sorted(out.items()):
        if not name.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template"] = name
                objs.append(doc)
    return objs


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def one(objs, kind, name):
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.fixture(scope="module")
def rendered():
    return {k: render(v) for k, v in VALUE_SETS.items()}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_objects_validate_against_kubernetes_schemas(rendered, values, version):
    objs = rendered[values]
    checked = 0
    for o in objs:
        body = {k: v for k, v in o.items() if k != "__template"}
        if o["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(body, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['__template']}: {o['kind']}/{o['metadata']['name']} is invalid for Kubernetes "
                        f"{version}: {e.message} at {'/'.join(map(str, e.path))}")
        checked += 1
    assert checked >= 5, [o["kind"] for o in objs]


def test_helm_lint_finds_no_error():
    res = helm.lint(str(CHART))
    assert res["total_charts_linted"] == 1 and not res["errors"], res
    # severity 1 is INFO (e.g. "icon is recommended"); anything above is a warning or an error
    assert all(m["severity"] <= 1 for m in res["messages"]), res["messages"]


def test_custom_resources_have_what_their_operators_require(rendered):
    objs = [o for objs in rendered.values() for o in objs if o["kind"] in CUSTOM_KINDS]
    assert {o["kind"] for o in objs} == CUSTOM_KINDS
    want_api = {"ServiceMonitor": "monitoring.coreos.com/v1", "PrometheusRule": "monitoring.coreos.com/v1",
                "ScaledObject": "keda.sh/v1alpha1", "Certificate": "cert-manager.io/v1"}
    for o in objs:
        assert o["apiVersion"] == want_api[o["kind"]], o["kind"]
        spec = o["spec"]
        if o["kind"] == "ServiceMonitor":
            assert spec["selector"]["matchLabels"] and spec["endpoints"][0]["port"] == "http"
        elif o["kind"] == "PrometheusRule":
            assert all(r["expr"] and (r.get("alert") or r.get("record")) for g in spec["groups"] for r in g["rules"])
        elif o["kind"] == "ScaledObject":
            trig = spec["triggers"][0]
            assert trig["type"] == "prometheus" and trig["metadata"]["threshold"] == "1"
            assert spec["scaleTargetRef"]["name"].startswith("baton-")
        else:
            assert spec["secretName"] and spec["dnsNames"] and spec["issuerRef"]["name"]


def test_default_values_give_a_whole_cpu_cluster(rendered):
    objs = rendered["default"]
    etcd = one(objs, "StatefulSet", "baton-etcd")
    assert etcd["spec"]["replicas"] == 3
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(a.startswith("--initial-cluster=baton-etcd-0=") and a.count("=http://") == 3 for a in args), args
    for name in ("baton-router", "baton-prefill", "baton-decode"):
        dep = one(objs, "Deployment", name)
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["image"] == "baton:0.1.0" and c["command"] == [name.replace("baton-", "baton-")]
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod["initContainers"][0]["name"] == "fetch-model"
        e = env_of(c)
        assert e["BATON_MODEL"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
        assert e["BATON_ETCD"].count("http://baton-etcd-") == 3
        grace_ms = int(e["BATON_GRACE_MS"])
        # the kubelet's SIGKILL comes after the process's own drain grace
        assert pod["terminationGracePeriodSeconds"] * 1000 > grace_ms
        if name != "baton-router":
            assert e["BATON_INSECURE"] == "1" and e["BATON_GRPC_LISTEN"].startswith("$(POD_IP):")
            assert e["BATON_NODE_ID"] == f"$(POD_NAME).{name[6:]}.baton"
    # the init container pins the model's sha256 from deploy/default-model.env
    pinned = dict(line.split("=", 1) for line in (ROOT / "deploy/default-model.env").read_text().splitlines()
                  if "=" in line and not line.startswith("#"))
    script = one(objs, "Deployment", "baton-decode")["spec"]["template"]["spec"]["initContainers"][0]["command"][2]
    assert pinned["BATON_MODEL_SHA256"] in script and pinned["BATON_MODEL_MEMBER"] in script
    assert {p["metadata"]["name"] for p in by_kind(objs, "PodDisruptionBudget")} == {
        "baton-router", "baton-prefill", "baton-decode", "baton-etcd"}
    assert by_kind(objs, "ConfigMap")[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert not [o for o in objs if o["kind"] in CUSTOM_KINDS | {"HorizontalPodAutoscaler"}]


def test_gpu_values(rendered):
    objs = rendered["gpu"]
    for role in ("prefill", "decode"):
        c = one(objs, "Deployment", f"baton-{role}")["spec"]["template"]["spec"]["containers"][0]
        assert c["image"] == "baton:0.1.0-cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        e = env_of(c)
        assert e["UCX_TLS"] == "rc,cuda_copy,cuda_ipc,gdr_copy" and e["BATON_KVX_DATA_PATH"] == "put"
        assert e["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env_of(one(objs, "Deployment", "baton-decode")["spec"]["template"]["spec"]["containers"][0])[
        "BATON_SPEC"] == "ngram"


def test_tls_values(rendered):
    objs = rendered["tls"]
    certs = {c["metadata"]["name"]: c["spec"] for c in by_kind(objs, "Certificate")}
    assert set(certs["baton-nodes"]["dnsNames"]) == {"*.prefill.baton", "*.decode.baton"}
    assert "baton-router.baton.svc" in certs["baton-router"]["dnsNames"]
    for name, secret in (("baton-router", "baton-router-tls"), ("baton-decode", "baton-nodes-tls")):
        pod = one(objs, "Deployment", name)["spec"]["template"]["spec"]
        e = env_of(pod["containers"][0])
        assert e["BATON_TLS_CERT"] == "/etc/baton/tls/tls.crt" and e["BATON_TLS_CA"] == "/etc/baton/tls/ca.crt"
        assert "BATON_INSECURE" not in e
        assert {v["name"]: v for v in pod["volumes"]}["tls"]["secret"]["secretName"] == secret
    router = one(objs, "Deployment", "baton-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    sm = one(objs, "ServiceMonitor", "baton-router")
    assert sm["spec"]["endpoints"][0]["scheme"] == "https"


def test_autoscaling_values(rendered):
    keda = {o["metadata"]["name"]: o for o in by_kind(rendered["keda"], "ScaledObject")}
    assert set(keda) == {"baton-prefill", "baton-decode"}
    q = keda["baton-decode"]["spec"]["triggers"][0]["metadata"]["query"]
    assert q == 'max(baton_planner_desired_replicas{role="decode",component="router",namespace="baton"})'
    assert keda["baton-prefill"]["spec"]["minReplicaCount"] == 0
    # the autoscaler owns the replica count: the Deployments do not set one (a helm upgrade would reset it)
    for role in ("prefill", "decode"):
        assert "replicas" not in one(rendered["keda"], "Deployment", f"baton-{role}")["spec"]
    hpa = {o["metadata"]["name"]: o for o in by_kind(rendered["hpa"], "HorizontalPodAutoscaler")}
    assert hpa["baton-prefill"]["spec"]["minReplicas"] == 1  # an HPA cannot go to zero
    m = hpa["baton-decode"]["spec"]["metrics"][0]["external"]
    assert m["metric"]["name"] == "baton_planner_desired_replicas" and m["metric"]["selector"]["matchLabels"] == {
        "role": "decode"}


def test_external_etcd_and_colocated_values(rendered):
    objs = rendered["external-etcd"]
    assert not by_kind(objs, "StatefulSet")
    c = one(objs, "Deployment", "baton-router")["spec"]["template"]["spec"]["containers"][0]
    e = env_of(c)
    assert e["BATON_ETCD"] == "https://etcd-0:2379,https://etcd-1:2379"
    assert e["BATON_ETCD_PASSWORD_FILE"] == "/etc/baton/etcd-auth/password" and e["BATON_ETCD_USER"] == "baton"
    assert e["BATON_ETCD_CA"] == "/etc/baton/etcd-tls/ca.crt"
    assert c["args"] == ["--ttft-slo-ms", "2000"]
    assert {m["name"]: m for m in c["volumeMounts"]}["model"]["subPath"] == "smollm2"
    assert "initContainers" not in one(objs, "Deployment", "baton-router")["spec"]["template"]["spec"]
    col = rendered["colocated-hostpath"]
    assert [o["metadata"]["name"] for o in by_kind(col, "Deployment")] == ["baton-decode", "baton-router"]
    assert one(col, "StatefulSet", "baton-etcd")["spec"]["replicas"] == 1


@pytest.mark.parametrize("values,message", [
    ({"model": {"source": "s3"}}, "model.source must be download, pvc or hostPath"),
    ({"etcd": {"enabled": False}}, "etcd.external.endpoints is required"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
    ({"autoscaling": {"mode": "vpa"}}, "autoscaling.mode must be none, keda or hpa"),
    ({"decode": {"podAntiAffinity": "maybe"}}, "podAntiAffinity must be soft, hard or none"),
])
def test_bad_values_fail_with_a_message(values, message):
    with pytest.raises(Exception) as e:
        render(values)
    assert message in str(e.value)


def rules_file(tmp_path) -> pathlib.Path:
    rule = one(render(VALUE_SETS["keda"]), "PrometheusRule", "baton")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_rules_pass_promtool_check_and_alert_unit_tests(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: deploy/setup.sh installs Debian's prometheus package"
    rules = rules_file(tmp_path)
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout, r.stdout
    shutil.copy(CHART / "tests" / "alerts.test.yaml", tmp_path / "alerts.test.yaml")
    r = subprocess.run([promtool, "test", "rules", "alerts.test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    # and a broken expectation does fail (the unit tests are not vacuous)
    broken = (tmp_path / "alerts.test.yaml").read_text().replace("4.75s", "4.70s")
    (tmp_path / "broken.test.yaml").write_text(broken)
    r = subprocess.run([promtool, "test", "rules", "broken.test.yaml"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0


def test_dashboard_file_is_generated():
    r = subprocess.run([sys.executable, str(ROOT / "deploy/grafana/dashboard.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads((CHART / "files/baton-dashboard.json").read_text())
    titles = {p["title"] for p in d["panels"]}
    for want in ("Time to first token", "Time per output token", "End-to-end request latency", "Tokens per second",
                 "Queue", "KV blocks used", "Prefix cache hit rate", "Remote prefill share", "KV transfer bandwidth",
                 "Draft acceptance rate", "Desired vs actual replicas", "Running sequences per node"):
        assert want in titles, want


METRIC_RE = re.compile(r"\b(baton_[a-z0-9_]+)")
HISTO_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def used_metric_names() -> dict:
    """Every baton metric family named by the dashboard, the rules and the ScaledObjects, with where."""
    used = {}
    dash = json.loads((CHART / "files/baton-dashboard.json").read_text())
    exprs = [("dashboard", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    exprs.append(("dashboard", dash["templating"]["list"][1]["query"]["query"]))
    objs = render(VALUE_SETS["keda"])
    exprs += [("rules", r["expr"]) for g in one(objs, "PrometheusRule", "baton")["spec"]["groups"] for r in g["rules"]]
    exprs += [("ScaledObject", s["spec"]["triggers"][0]["metadata"]["query"]) for s in by_kind(objs, "ScaledObject")]
    for where, e in exprs:
        for name in METRIC_RE.findall(e):
            used.setdefault(name, set()).add(where)
    return used


def exported_families(text: str) -> set:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_every_metric_used_is_exported_by_a_live_cluster(default_model):
    with EtcdServer() as etcd, \
            start_prefill(etcd, default_model, threads=1, node_id="pre-a") as pre, \
            start_decode(etcd, default_model, threads=1, node_id="dec-a", spec="ngram") as dec, \
            start_router(etcd, default_model, prefill_mode="remote") as rtr:
        deadline = __import__("time").monotonic() + 20
        while json.loads(rtr.http("/ready")[1]).get("decode_nodes") != 1:
            assert __import__("time").monotonic() < deadline, "router never saw the decode node"
            __import__("time").sleep(0.1)
        body = json.dumps({"model": "", "prompt": "The capital of France is " * 4, "max_tokens": 8,
                           "temperature": 0}).encode()
        req = urllib.request.Request(rtr.base_url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        exported = {}
        for name, proc in (("router", rtr), ("prefill", pre), ("decode", dec)):
            for fam in exported_families(proc.metrics()):
                exported.setdefault(fam, set()).add(name)
    used = used_metric_names()
    missing = {}
    for name, where in sorted(used.items()):
        family = name if name in exported else HISTO_SUFFIX.sub("", name)
        if family not in exported:
            missing[name] = sorted(where)
    print(f"\n{len(used)} metric names used, all among the {len(exported)} families a live cluster exports"
          if not missing else f"\nmissing: {missing}")
    assert not missing, f"metric names no baton process exports: {missing}"
    assert len(used) >= 20, sorted(used)
