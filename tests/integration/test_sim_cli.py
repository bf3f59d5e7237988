"""`baton profile` and `baton simulate` as a user runs them (issue 22): help texts, one clear error line and exit
code 2 for a missing or garbled profile or workload, a short simulation with --json whose requests all end
somewhere, the same report twice from the same seed, and bench-serve's generator reproduced from a workload line.
A short `baton profile` run on the default model writes a profile the simulator accepts."""
import json
import subprocess
import sys

from conftest import ROOT

H100 = ROOT / "deploy/profiles/h100-llama3-8b.json"


def baton(baton_bin, *args, timeout=300):
    return subprocess.run([str(baton_bin), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_help(baton_bin):
    for cmd in ("profile", "simulate"):
        r = baton(baton_bin, cmd, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: baton {cmd}"), r
    r = baton(baton_bin, "--help")
    assert "profile" in r.stdout and "simulate" in r.stdout


def test_bad_inputs_exit_2_with_one_line(baton_bin, tmp_path):
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text('{"prefill": {"fixed_s": 0.01}, "decode": {"fixed_s": 0.01, "seq_s": 0}}')
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 1, "prompt_tokens": 10, "output_tokens": 5}\n{"t": 0.5, "prompt_tokens": 10, "output_tokens": 5}\n')
    cases = [
        (["--profile", tmp_path / "missing.json", "--decode", 1, "--rate", 1, "--requests", 1], "cannot open the profile"),
        (["--profile", garbled, "--decode", 1, "--rate", 1, "--requests", 1], "not valid JSON"),
        (["--profile", partial, "--decode", 1, "--rate", 1, "--requests", 1], "token_s"),
        (["--profile", H100, "--decode", 1, "--workload", tmp_path / "none.jsonl"], "cannot open the workload"),
        (["--profile", H100, "--decode", 1, "--workload", garbled], "not a JSON object"),
        (["--profile", H100, "--decode", 1, "--workload", trace], "trace.jsonl:2"),
        (["--profile", H100, "--decode", 1, "--workload", ROOT / "tools/workloads/chat.jsonl"], "prompt texts"),
        (["--profile", H100, "--decode", 0, "--rate", 1, "--requests", 1], "--decode"),
        (["--profile", H100, "--decode", 1, "--rate", 1, "--requests", 1, "--fail", "x"], "--fail"),
    ]
    for args, words in cases:
        r = baton(baton_bin, "simulate", *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, r.stderr)
    r = baton(baton_bin, "profile", "--model", tmp_path / "missing.gguf")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_simulate_json_conserves_and_repeats(baton_bin, tmp_path):
    args = ["simulate", "--profile", H100, "--prefill", 2, "--decode", 3, "--rate", 40, "--duration", 30,
            "--prompt-tokens", "1500:400", "--output-tokens", "150:50", "--seed", 4, "--slo-ttft-ms", 500,
            "--slo-tpot-ms", 30, "--fail", "10:decode:1:5", "--json", "-"]
    a = baton(baton_bin, *args)
    assert a.returncode == 0, a.stderr
    doc = json.loads(a.stdout)
    assert doc["arrived"] > 1000 and doc["arrived"] == doc["finished"] + doc["rejected"] + doc["failed"]
    assert doc["migrations"] > 0 and len(doc["nodes"]) == 5 and sum(n["failures"] for n in doc["nodes"]) == 1
    assert 0 < doc["ttft"]["p50_s"] <= doc["ttft"]["p90_s"] and doc["planner"], doc["ttft"]
    b = json.loads(baton(baton_bin, *args).stdout)
    doc.pop("wall_s"), b.pop("wall_s")
    assert doc == b
    # a workload line draws what the flags draw
    wl = tmp_path / "w.json"
    wl.write_text(json.dumps({"rate": 40, "duration_s": 30, "prompt_tokens": 1500, "prompt_sd": 400,
                              "output_tokens": 150, "output_sd": 50, "seed": 4}) + "\n")
    c = baton(baton_bin, *(args[:7] + ["--workload", wl] + args[17:]))
    assert c.returncode == 0, c.stderr
    c = json.loads(c.stdout)
    c.pop("wall_s")
    assert c == doc


def test_profile_short_run_feeds_the_simulator(baton_bin, default_model, tmp_path):
    out = tmp_path / "p.json"
    r = baton(baton_bin, "profile", "--model", default_model, "--max-batch", 2, "--max-context", 64, "--idle-reps", 2,
              "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "profile: prefill" in r.stderr and "the first logits row" in r.stderr
    assert "steps scatter by" in r.stderr and "after 2.0 s idle" in r.stderr, r.stderr
    p = json.loads(out.read_text())
    # what idleness costs a 128-token prompt step (4 gaps), and the steps' scatter the simulator draws from
    idle = p["idle"]
    assert idle["gap_s"] == [0.1, 0.3, 1.0, 2.0] and len(idle["extra_s"]) == 4 and idle["step_s"] > 0
    assert all(0 <= e < 10 * idle["step_s"] for e in idle["extra_s"])
    assert 0 < p["decode"]["spread"] < 2 and 0 <= p["prefill"].get("spread", 0) < 2
    assert p["prefill"]["token_s"] > 0 and p["decode"]["fixed_s"] > 0 and p["transfer"]["shm"]["bytes_s"] > 0
    # a prompt ending's logits row and sampling are timed apart: never 0 as the sweep's fit made them, and a small
    # fraction of a prompt token's cost times the vocabulary's share of the weights
    assert 0 < p["prefill"]["seq_s"] < 0.5 * p["decode"]["fixed_s"]
    assert "CPUs online" in p["host"] and p["kv_bytes_per_token"] == 23040
    # the decode step at each batch measured (1 and 2), less its context term: near the samples' own medians
    pts = p["decode"]["batch_s"]
    assert [b for b, _ in pts] == [1, 2] and all(t > 0 for _, t in pts), pts
    for b, t in pts:
        ys = sorted(y - c * p["decode"]["ctx_token_s"] for bb, c, y in p["samples"]["decode_batch_ctx_s"] if bb == b)
        assert ys[0] <= t <= ys[-1], (b, t, ys)
    r = baton(baton_bin, "simulate", "--profile", out, "--decode", 1, "--rate", 0.2, "--requests", 5, "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["finished"] == 5, r.stderr


def test_sim_validate_smoke(baton_bin, default_model, tmp_path):
    """tools/sim_validate.py end to end on a tiny workload (its figures need a quiet machine; here only that it
    runs both sides and prints the table): a given profile, one repetition, no quiet file nor idle wait, targets
    not enforced."""
    from harness.etcd import free_port_run

    wl = tmp_path / "validate-tiny.json"
    wl.write_text('{"rate": 4, "requests": 6, "prompt_tokens": 16, "prompt_sd": 4, "output_tokens": 4, "seed": 3}\n')
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools/sim_validate.py"), "--repeats", "1", "--profile",
                        ROOT / "deploy/profiles/cpu-smollm2-135m.json", "--quiet-file", "", "--lock", "", "--max-others", "1", "--no-targets",
                        "--port-base", str(free_port_run(4)), "--build", str(baton_bin.parent.parent), "--model",
                        str(default_model), "--json", str(out), str(wl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ttft_p90_ms" in r.stdout and "cells within target" in r.stdout, r.stdout
    j = json.loads(out.read_text())
    assert len(j["table"]) == 5 and j["rows"][0]["requests"] == 6
    assert all(x >= 0 for x in j["rows"][0]["real"].values()) and j["rows"][0]["sim"]["ttft_p50_ms"] > 0
    row = j["rows"][0]
    # where the load's CPU went, per process; the step and row parts of the path from the two stream probes
    # (per process in clock ticks: the router's share of six 4-token requests can round to 0)
    cpu = row["load_cpu_s"]
    assert {"router", "client", "decode-1", "etcd"} <= set(cpu) and min(cpu.values()) >= 0, cpu
    assert cpu["decode-1"] > 0, cpu
    assert row["probes"]["path_wall_batch_s"] >= 0 and row["profile"]["path_step_ms"] >= 0
    # where a TTFT went: the router's and the decode node's histograms over the load alone (6 requests, not the
    # probes'), beside the client's mean and the simulated one
    parts = row["ttft_parts_ms"]
    assert parts["router baton_time_to_first_token_seconds"][1] == 6, parts
    assert parts["decode-1 baton_time_to_first_token_seconds"][1] == 6, parts
    assert 0 < parts["decode-1 baton_time_to_first_token_seconds"][0] <= parts["client ttft"][0], parts
    assert row["sim"]["ttft_mean_ms"] > 0 and "TTFT means, ms: measured" in r.stdout, r.stdout
    # the engine's speed just before and just after the load, and their ratio
    sp = row["speed_probes"]
    assert len(sp) == 2 and all(x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0 for x in sp), sp
    assert abs(row["speed_drift"] - sp[1]["prefill_tok_s"] / sp[0]["prefill_tok_s"]) < 0.001, row["speed_drift"]
    # colocated: the decode node's one-prompt steps in the load (6 requests: the ratio when 5 or more ran alone)
    pre = [v.get("prefill", {}) for k, v in row["steps"].items() if k.startswith("decode-")]
    assert row["load_speed_ratio"] == (round(pre[0]["vs_profile"], 3) if "vs_profile" in pre[0] else 1.0), row
    assert row["mean_prompt_tokens"] > 0
    # no SLO given: the run's is --slo-scale (2) times the first window's unloaded cost of a mean request
    b = j["slo_basis"]
    assert b["scale"] == 2 and b["ttft_ms"] > 0 and b["tpot_ms"] > 0, b
    assert j["slo_ms"] == [round(2 * b["ttft_ms"]), round(2 * b["tpot_ms"], 1)], j["slo_ms"]
    assert f"SLO TTFT {j['slo_ms'][0]:g} ms" in r.stdout and row["speed_ratio"] == 1, r.stdout
    # the decode node's step trace over the load: its decode-only steps by batch size against the profile
    steps = [v for k, v in row["steps"].items() if k.startswith("decode-")]
    assert len(steps) == 1 and steps[0]["steps"] > 0 and steps[0]["decode"], row["steps"]
    cells = steps[0]["decode"].values()
    assert sum(c["steps"] for c in cells) > 0 and all(c["vs_profile"] > 0 for c in cells), steps
    assert "decode-only steps by batch size" in r.stdout, r.stdout
    # the decode node's lone steps against the profile's prices: the in-window speed check (1p1d's) reads it
    assert steps[0]["lone_vs_profile"] > 0 and row["decode_speed_ratio"] == round(steps[0]["lone_vs_profile"], 3)
    # --resimulate runs the recorded windows again through the simulator alone: same profile, same seed, same answer
    r2 = subprocess.run([sys.executable, str(ROOT / "tools/sim_validate.py"), "--resimulate", str(out), "--no-targets",
                         "--build", str(baton_bin.parent.parent)], capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stderr
    assert "cells within target" in r2.stdout, r2.stdout
    assert [ln for ln in r2.stdout.splitlines() if "ttft_p50_ms" in ln] == \
        [ln for ln in r.stdout.splitlines() if "ttft_p50_ms" in ln]


def test_sim_validate_speed_reference_is_the_clean_windows():
    """A window's speed is judged against the median of the clean windows so far (and itself): a slow window that
    was marked disturbed does not drag the reference toward its speed."""
    sys.path.insert(0, str(ROOT / "tools"))
    import sim_validate

    def row(ms, disturbed=False):
        return {"profile": {"prefill_token_ms": ms}, "disturbed": disturbed}

    clean = [row(1.0), row(1.0)]
    assert sim_validate.speed_ratio(clean, row(1.0)) == 1
    # two slow retries (disturbed) would make 1.5 the median of all five; of the clean ones and this, it stays 1
    slow = clean + [row(1.5, True), row(1.5, True)]
    assert sim_validate.speed_ratio(slow, row(1.5)) == 1.5
    assert abs(sim_validate.speed_ratio(slow, row(1.1)) - 1.1) < 1e-9


def test_sim_validate_load_speed_ratio():
    """A 1P+1D window's prefill speed during the load: the prefill node's CPU per prompt token over the profile's
    prefill time per token; nothing to say without a prefill node."""
    sys.path.insert(0, str(ROOT / "tools"))
    import sim_validate

    row = {"load_cpu_s": {"prefill-1": 26.4, "decode-1": 44.8}, "requests": 100, "mean_prompt_tokens": 120,
           "profile": {"prefill_token_ms": 1.8}}
    assert abs(sim_validate.load_speed_ratio(row) - 2.2 / 1.8) < 1e-9
    assert sim_validate.load_speed_ratio(dict(row, load_cpu_s={"decode-1": 44.8})) is None
    assert sim_validate.load_speed_ratio(dict(row, requests=0)) is None
    # colocated: the decode node's one-prompt steps in its step trace against the profile's prices
    coloc = {"load_cpu_s": {"decode-1": 44.8, "router": 3.0}, "requests": 100, "mean_prompt_tokens": 120,
             "steps": {"decode-7.steps": {"prefill": {"steps": 9, "vs_profile": 0.83}}}}
    assert sim_validate.load_speed_ratio(coloc) == 0.83
    assert sim_validate.load_speed_ratio(dict(coloc, steps={"decode-7.steps": {"prefill": {"steps": 3}}})) is None


def test_step_trace_summary(tmp_path):
    """tools/step_trace.py on two hand-written traces: buckets by batch size, the profile's ratio, and which decode
    steps another node's steps overlapped (nested intervals included); the window [from, to] keeps what started in
    it; a line cut short is skipped."""
    sys.path.insert(0, str(ROOT / "tools"))
    import step_trace

    hdr = "# t_s step_ms forward_ms gap_ms tokens seqs decode_only drafts context\n"
    (tmp_path / "decode-1.steps").write_text(hdr + "".join([
        "10.000 4.0 3.5 -1 1 1 1 0 100\n",      # alone
        "10.010 6.0 5.0 6.0 1 1 1 0 101\n",     # overlaps the prefill step 10.012-10.030
        "10.050 8.0 7.0 34.0 2 2 1 0 300\n",    # inside the long prefill step 10.040-10.200 (a short one nests in it)
        "10.300 5.0 4.0 242.0 60 2 0 0 300\n",  # not decode-only
        "10.400 4.0\n",                          # cut short
        "20.000 4.0 3.5 1.0 1 1 1 0 100\n"]))   # outside the window
    (tmp_path / "prefill-1.steps").write_text(hdr + "10.012 18.0 17.0 -1 128 1 0 0 128\n"
                                              "10.040 160.0 150.0 10.0 512 1 0 0 512\n"
                                              "10.045 1.0 1.0 0 16 1 0 0 16\n")
    prof = {"decode": {"fixed_s": 0.002, "seq_s": 0.001, "ctx_token_s": 1e-5}}
    s = step_trace.summarize(tmp_path, 9.0, 11.0, prof)
    d = s["decode-1.steps"]
    assert d["steps"] == 4, d
    assert d["decode"]["1"]["steps"] == 2 and d["decode"]["2"]["steps"] == 1
    assert d["decode"]["1 alone"]["steps"] == 1 and d["decode"]["1 overlapped"]["steps"] == 1
    assert d["decode"]["2 overlapped"]["steps"] == 1 and "2 alone" not in d["decode"]
    # step 1: 4 ms against 2 + 1 + 1.00 = 4 ms; step 2: 6 ms against 4.01 ms; the median of the two
    assert abs(d["decode"]["1"]["vs_profile"] - (4.0 / 4.0 + 6.0 / 4.01) / 2) < 1e-9, d["decode"]["1"]
    assert abs(d["decode"]["2"]["vs_profile"] - 8.0 / 7.0) < 1e-9
    assert d["decode"]["1"]["gap_p50_ms"] == 6.0  # the first step has no gap (-1)
    assert s["prefill-1.steps"]["decode"] == {}
    # with measured batch points the prediction follows them (as plan_decode_step_s: test_router_planner)
    d = {"fixed_s": 0.002, "seq_s": 0.001, "ctx_token_s": 1e-5, "batch_s": [[1, 0.004], [2, 0.0045], [8, 0.0125]]}
    assert abs(step_trace.decode_step_s(d, 5, 100) - (0.0085 + 0.001)) < 1e-12
    assert abs(step_trace.decode_step_s(d, 10, 0) - 0.0145) < 1e-12
    assert abs(step_trace.decode_step_s(d, 1, 0) - 0.004) < 1e-12
    # one-prompt steps (one sequence, not decoding): counted on any node, priced by the profile's prefill from 5 up
    assert s["prefill-1.steps"]["prefill"] == {"steps": 3, "tokens_p50": 128, "step_p50_ms": 18.0}
    assert "prefill" not in s["decode-1.steps"]  # its prompt step carried two sequences: not one prompt alone
    (tmp_path / "coloc").mkdir()
    (tmp_path / "coloc" / "decode-2.steps").write_text(hdr + "".join(
        f"{t:.3f} {ms} {ms} 0 {n} 1 0 0 {n}\n" for t, ms, n in
        [(1.0, 51.0, 100), (2.0, 45.0, 100), (3.0, 90.0, 200), (4.0, 99.0, 200), (5.0, 200.0, 200),
         (6.0, 9.0, 10)]) + "7.000 4.0 3.9 0.1 1 1 1 0 101\n")
    pre = {"prefill": {"fixed_s": 0.002, "token_s": 0.0005, "seq_s": 0.001}}  # 100 tokens: 53 ms, 200: 103, 10: 8
    c = step_trace.summarize(tmp_path / "coloc", None, None, pre)["decode-2.steps"]
    assert c["prefill"]["steps"] == 6 and c["prefill"]["tokens_p50"] == 200, c
    ratios = sorted([51 / 53, 45 / 53, 90 / 103, 99 / 103, 200 / 103, 9 / 8])
    assert abs(c["prefill"]["vs_profile"] - (ratios[2] + ratios[3]) / 2) < 1e-9, c
