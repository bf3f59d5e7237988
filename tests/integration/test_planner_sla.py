"""The SLA planner on a real local cluster (issue 22): etcd, one decode node with one engine thread, two routers.

Load from `baton bench-serve` goes to router A only. Checks: before any load both routers ask for the node count
(no step-time fit published yet); under load the desired decode replicas rise to 2 or more on router B too, which
served nothing, because every router plans on the sum of all routers' window rates (one answer per cluster:
`max(baton_planner_desired_replicas)` over routers is that answer); B's inputs show the load (observed rate, mean
prompt and output tokens near what bench-serve sent, two routers merged, a predicted TPOT); and the node publishes
its fitted step model in its load report. Figures print with pytest -s."""
import json
import subprocess
import time

from harness.baton_procs import bin_path, start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router

PROMPT, OUTPUT, RATE, SECONDS = 64, 48, 6, 25



def test_desired_replicas_rise_under_load_on_every_router(default_model, tmp_path):
    with EtcdServer() as etcd, \
            start_decode(etcd, default_model, threads=1, node_id="plan-d") as dec, \
            start_router(etcd, default_model, tpot_slo_ms=40) as ra, \
            start_router(etcd, default_model, tpot_slo_ms=40) as rb:
        time.sleep(2)  # a planner tick after the view is complete
        idle = [r.metric("baton_planner_desired_replicas", 'role="decode"') for r in (ra, rb)]
        assert idle == [1, 1], idle
        load = subprocess.Popen([bin_path("baton"), "bench-serve", "--url", ra.base_url, "--quiet",
                                 "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT), "--seed", "3",
                                 "--rate", str(RATE), "--duration", str(SECONDS), "--json", str(tmp_path / "b.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        try:
            end = time.monotonic() + SECONDS + 5
            while time.monotonic() < end:
                a = ra.metric("baton_planner_desired_replicas", 'role="decode"')
                b = rb.metric("baton_planner_desired_replicas", 'role="decode"')
                seen.append((a, b, rb.metric("baton_planner_routers"), rb.metric("baton_planner_observed_request_rate"),
                             rb.metric("baton_planner_input_tokens_mean"), rb.metric("baton_planner_output_tokens_mean"),
                             rb.metric("baton_planner_predicted_tpot_seconds")))
                time.sleep(1)
        finally:
            out, err = load.communicate(timeout=600)
        assert load.returncode == 0, err
        report = json.loads(etcd.get("/baton/default/load/plan-d") or b"{}")
    print("\n(A desired, B desired, routers merged, B's observed req/s, ISL, OSL, predicted TPOT p90):")
    for s in seen:
        print("  ", s)
    print("node's load report:", {k: report.get(k) for k in ("step_fixed_s", "step_token_s", "decode_fixed_s",
                                                            "decode_row_s")})
    assert report.get("decode_fixed_s", 0) > 0 and report.get("step_token_s", 0) > 0, report
    peak_b = max(s[1] for s in seen if s[1] is not None)
    assert peak_b >= 2, seen
    # router B (no traffic of its own) plans on both routers' records and agrees with A at some tick under load
    assert any(s[2] == 2 for s in seen), seen
    assert any(s[0] == s[1] and s[1] >= 2 for s in seen), seen
    busy = [s for s in seen if s[3] and s[3] > RATE / 3]
    assert busy, seen
    isl, osl = busy[-1][4], busy[-1][5]
    # ISL counts the prompt as tokenized (a few tokens more than the words); OSL tokens streamed per request admitted
    assert PROMPT * 0.8 <= isl <= PROMPT * 1.5, isl
    assert OSL_LOW * OUTPUT <= osl <= OUTPUT * 1.3, osl
    assert busy[-1][6] is not None and busy[-1][6] > 0


OSL_LOW = 0.5  # the window holds requests admitted but not yet done: generated tokens per admitted request lag
