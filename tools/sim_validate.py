#!/usr/bin/env python3
"""Simulator against reality (issue 22, item 4): the same seeded workload through `baton bench-serve` against a
local cluster and through `baton simulate` with this machine's profile, side by side.

For each workload file (tools/workloads/validate-*.json: one generator line, the fields bench-serve's flags take),
bench-serve draws its arrivals and lengths from the seed exactly as the simulator does (tools/workload.c wl_draw),
so both run the same requests. Prints TTFT/TPOT p50/p90 and goodput (requests within both SLOs) of each, and the
relative differences; --json writes them all. Measurements on a shared 2-core machine are noisy: run it more than
once and compare medians.

usage: tools/sim_validate.py [--profile P.json] [--shape colocated|1p1d] [--build DIR] [--json OUT] WORKLOAD...
Without --profile it runs `baton profile` first (a minute or two). The cluster runs on its own ports and run
directory (deploy/local/cluster up --detach) and is stopped at the end."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, env=None, check=True, capture=True):
    r = subprocess.run(cmd, env=env, text=True, capture_output=capture)
    if check and r.returncode != 0:
        sys.exit(f"sim_validate: {' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


def wait_ready(url, seconds=120):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"sim_validate: the router at {url} never became ready")


def rel(sim, real):
    return (sim - real) / real if real else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--profile")
    ap.add_argument("--shape", choices=["colocated", "1p1d"], default="colocated")
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    baton = Path(a.build) / "bin" / "baton"
    tmp = Path(tempfile.mkdtemp(prefix="sim-validate-"))
    pin = ["taskset", "-c", "1"] if a.shape == "1p1d" else []
    profile = a.profile
    if not profile:
        profile = str(tmp / "profile.json")
        print(f"profiling this machine into {profile} ...", file=sys.stderr)
        run(pin + [str(baton), "profile", "--out", profile] + (["--threads", "1"] if pin else []), capture=False)
    env = dict(os.environ, BATON_BUILD_DIR=a.build, BATON_RUN_DIR=str(tmp / "run"),
               BATON_ETCD_LISTEN="127.0.0.1:23779", BATON_HTTP_LISTEN="127.0.0.1:18700",
               BATON_GRPC_LISTEN="127.0.0.1:18701")
    up = [str(ROOT / "deploy/local/cluster"), "up", "--detach"]
    up += ["--prefill", "1", "--decode", "1", "--prefill-cpus", "0", "--decode-cpus", "1",
           "--router-args", "--prefill-mode remote"] if a.shape == "1p1d" else ["--prefill", "0", "--decode", "1"]
    run(up, env=env)
    url = "http://127.0.0.1:18700"
    rows = []
    try:
        wait_ready(url)
        # one short warm-up so that first-request costs (page faults, caches) stay out of the measured runs
        run([str(baton), "bench-serve", "--url", url, "--quiet", "--rate", "inf", "--requests", "4",
             "--prompt-tokens", "64", "--output-tokens", "16"])
        for wpath in a.workloads:
            w = json.loads(Path(wpath).read_text().strip().splitlines()[0])
            out = tmp / (Path(wpath).stem + ".bench.json")
            flags = ["--rate", str(w["rate"]), "--prompt-tokens", f"{w['prompt_tokens']}:{w.get('prompt_sd', 0)}",
                     "--output-tokens", f"{w['output_tokens']}:{w.get('output_sd', 0)}", "--seed", str(w.get("seed", 0)),
                     "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]
            flags += ["--requests", str(w["requests"])] if "requests" in w else ["--duration", str(w["duration_s"])]
            print(f"bench-serve {wpath} ...", file=sys.stderr)
            run([str(baton), "bench-serve", "--url", url, "--quiet", "--json", str(out)] + flags)
            real = json.loads(out.read_text())["runs"][0]
            shape = ["--prefill", "1", "--decode", "1", "--prefill-mode", "remote"] if a.shape == "1p1d" else \
                ["--decode", "1"]
            sim = json.loads(run([str(baton), "simulate", "--profile", profile, "--workload", wpath, "--json", "-",
                                  "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]
                                 + shape).stdout)
            row = {"workload": wpath, "rate": w["rate"], "requests": real["requests"],
                   "real": {"ttft_p50_ms": real["ttft_ms"]["p50"], "ttft_p90_ms": real["ttft_ms"]["p90"],
                            "tpot_p50_ms": real["tpot_ms"]["p50"], "tpot_p90_ms": real["tpot_ms"]["p90"],
                            "good_fraction": real["good_requests"] / max(1, real["requests"])},
                   "sim": {"ttft_p50_ms": sim["ttft"]["p50_s"] * 1e3, "ttft_p90_ms": sim["ttft"]["p90_s"] * 1e3,
                           "tpot_p50_ms": sim["tpot"]["p50_s"] * 1e3, "tpot_p90_ms": sim["tpot"]["p90_s"] * 1e3,
                           "good_fraction": sim["good"] / max(1, sim["arrived"])}}
            row["diff"] = {k: rel(row["sim"][k], row["real"][k]) for k in row["real"]}
            rows.append(row)
    finally:
        run([str(ROOT / "deploy/local/cluster"), "down"], env=env, check=False)
    keys = ["ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "good_fraction"]
    print(f"shape {a.shape}, profile {profile}, SLO TTFT {a.slo_ttft_ms:g} ms, TPOT {a.slo_tpot_ms:g} ms")
    print(f"{'rate':>6} " + " ".join(f"{k:>26}" for k in keys))
    for r in rows:
        cells = [f"{r['real'][k]:8.3g} {r['sim'][k]:8.3g} {100 * r['diff'][k]:+7.1f}%" for k in keys]
        print(f"{r['rate']:>6g} " + " ".join(f"{c:>26}" for c in cells))
    print("(each cell: measured, simulated, difference)")
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": a.shape, "profile": profile, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
