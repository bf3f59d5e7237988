"""The SLA planner on a real local cluster (issue 22): etcd, one decode node with one engine thread, two routers.

Load from `baton bench-serve` goes to router A only. The routers plan with a fixed profile file. Checks: before
any load both routers ask for 1; under load the desired decode replicas rise to 2 or more on router B too, which
served nothing, because every router plans on the sum of all routers' window rates (one answer per cluster:
`max(baton_planner_desired_replicas)` over routers is that answer); B's inputs show the load (observed rate, mean
prompt and output tokens near what bench-serve sent, two routers merged, a predicted TPOT); and the node publishes
its fitted step model in its load reports (while it steps: the fit covers recent steps only). Figures print with
pytest -s."""
import json
import subprocess
import time

from harness.baton_procs import bin_path, start_decode
from harness.etcd import EtcdServer
from harness.router_procs import start_router

PROMPT, OUTPUT, RATE, SECONDS = 64, 48, 6, 25



def test_desired_replicas_rise_under_load_on_every_router(default_model, tmp_path):
    # A fixed profile, so that the answer depends on the load only and not on how fast this shared machine is at
    # the moment (the nodes' own fits follow it). With it, 6 req/s of 64 + 48 tokens needs 4 decode nodes for a
    # p90 TPOT of 40 ms (planner.h's arithmetic); an idle cluster 1. Window 1 s: both routers follow the raw
    # answer, so their answers are comparable tick by tick (smoothing is unit-tested).
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"prefill": {"fixed_s": 0.005, "token_s": 0.001},
                                "decode": {"fixed_s": 0.02, "seq_s": 0.002, "ctx_token_s": 0}}))
    flags = dict(tpot_slo_ms=40, planner_profile=prof, planner_window_s=1)
    with EtcdServer() as etcd, \
            start_decode(etcd, default_model, threads=1, node_id="plan-d") as dec, \
            start_router(etcd, default_model, **flags) as ra, \
            start_router(etcd, default_model, **flags) as rb:
        time.sleep(2)  # a planner tick after the view is complete
        idle = [r.metric("baton_planner_desired_replicas", 'role="decode"') for r in (ra, rb)]
        assert idle == [1, 1], idle  # no load yet
        load = subprocess.Popen([bin_path("baton"), "bench-serve", "--url", ra.base_url, "--quiet",
                                 "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT), "--seed", "3",
                                 "--rate", str(RATE), "--duration", str(SECONDS), "--json", str(tmp_path / "b.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen, fitted = [], None
        try:
            end = time.monotonic() + SECONDS + 5
            while time.monotonic() < end:
                a = ra.metric("baton_planner_desired_replicas", 'role="decode"')
                b = rb.metric("baton_planner_desired_replicas", 'role="decode"')
                seen.append((a, b, rb.metric("baton_planner_routers"), rb.metric("baton_planner_observed_request_rate"),
                             rb.metric("baton_planner_input_tokens_mean"), rb.metric("baton_planner_output_tokens_mean"),
                             rb.metric("baton_planner_predicted_tpot_seconds")))
                ld = json.loads(etcd.get("/baton/default/load/plan-d") or b"{}")
                if ld.get("step_token_s", 0) > 0:
                    fitted = ld  # the scheduler's fit comes and goes with its recent steps: any report will do
                    # (decode_fixed_s / decode_row_s need decode-only steps: an overloaded node may have none)
                time.sleep(1)
        finally:
            out, err = load.communicate(timeout=600)
        assert load.returncode == 0, err
    print("\n(A desired, B desired, routers merged, B's observed req/s, ISL, OSL, predicted TPOT p90):")
    for s in seen:
        print("  ", s)
    assert fitted, "no load report carried the node's step-time fit"
    print("node's load report:", {k: fitted.get(k) for k in ("step_fixed_s", "step_token_s", "decode_fixed_s",
                                                            "decode_row_s")})
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
