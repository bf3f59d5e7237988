#!/usr/bin/env python3
"""The runs behind deploy/PLANNING.md (issue 22, item 5): for each profile, workload shape and SLO, the fewest
nodes that meet the SLO at p90 (TTFT and TPOT), colocated and disaggregated (the best P:D split at that count),
and the planner's own answer for the same load.

usage: tools/sim_planning.py [--build DIR] [--quick] > tables.md
Every figure is one `baton simulate` run (seeded: rerunning gives the same tables)."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, prompt mean, sd, output mean, sd)
GPU_SHAPES = [("chat", 1000, 300, 250, 80), ("RAG", 6000, 1500, 200, 60), ("code completion", 2000, 500, 40, 15)]
CPU_SHAPES = [("chat", 200, 60, 64, 20), ("RAG", 1200, 300, 48, 16), ("code completion", 400, 100, 16, 6)]
PROFILES = [
    # label, file, rate (req/s), duration (s), shapes, SLOs [(ttft_ms, tpot_ms)], transport
    ("H100 (Llama-3-8B, published figures)", "deploy/profiles/h100-llama3-8b.json", 100, 120, GPU_SHAPES,
     [(300, 25), (1000, 60)], "rdma"),
    ("H200 (Llama-3-8B, published figures)", "deploy/profiles/h200-llama3-8b.json", 100, 120, GPU_SHAPES,
     [(300, 25), (1000, 60)], "rdma"),
    ("this CPU host (SmolLM2-135M, measured)", "deploy/profiles/cpu-smollm2-135m.json", 5, 300, CPU_SHAPES,
     [(2000, 100), (5000, 250)], "shm"),
]


class Sim:
    def __init__(self, baton):
        self.baton = baton
        self.cache = {}

    def run(self, profile, p, d, rate, dur, shape, slo, transport):
        key = (profile, p, d, rate, dur, shape, slo, transport)
        if key in self.cache:
            return self.cache[key]
        _, pm, ps, om, osd = shape
        cmd = [self.baton, "simulate", "--profile", str(ROOT / profile), "--prefill", str(p), "--decode", str(d),
               "--rate", str(rate), "--duration", str(dur), "--prompt-tokens", f"{pm}:{ps}",
               "--output-tokens", f"{om}:{osd}", "--seed", "5", "--slo-ttft-ms", str(slo[0]),
               "--slo-tpot-ms", str(slo[1]), "--transport", transport, "--max-queue-s", "-1", "--json", "-"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{' '.join(cmd)}: {r.stderr}")
        self.cache[key] = json.loads(r.stdout)
        return self.cache[key]

    def meets(self, res, slo):
        return (res["finished"] == res["arrived"] and res["ttft"]["p90_s"] * 1e3 <= slo[0] and
                res["tpot"]["p90_s"] * 1e3 <= slo[1])


def least(ok, cap):
    """Least n in 1..cap with ok(n) (ok monotone in n), or None."""
    lo, hi = 1, 1
    while not ok(hi):
        if hi >= cap:
            return None
        lo, hi = hi + 1, min(cap, hi * 2)
    while lo < hi:
        m = (lo + hi) // 2
        if ok(m):
            hi = m
        else:
            lo = m + 1
    return hi


def least_colocated(sim, pf, rate, dur, shape, slo, tr, cap=512):
    return least(lambda n: sim.meets(sim.run(pf, 0, n, rate, dur, shape, slo, tr), slo), cap)


def least_disagg(sim, pf, rate, dur, shape, slo, tr, cap=512):
    """The roles are nearly independent when disaggregated: the least P meeting the TTFT target with decode to
    spare, the least D meeting the TPOT target with prefill to spare; then, together (the router's cost model
    still prefills some prompts on decode nodes), the side that misses grows by an eighth until both hold, and
    each side is trimmed back while they still hold. (N, P, D) or None."""
    spare = cap

    def ttft_ok(p):
        r = sim.run(pf, p, spare, rate, dur, shape, slo, tr)
        return r["finished"] == r["arrived"] and r["ttft"]["p90_s"] * 1e3 <= slo[0]

    def tpot_ok(d):
        r = sim.run(pf, spare, d, rate, dur, shape, slo, tr)
        return r["finished"] == r["arrived"] and r["tpot"]["p90_s"] * 1e3 <= slo[1]

    p, d = least(ttft_ok, cap), least(tpot_ok, cap)
    if p is None or d is None:
        return None
    for _ in range(64):
        r = sim.run(pf, p, d, rate, dur, shape, slo, tr)
        if sim.meets(r, slo):
            break
        if r["ttft"]["p90_s"] * 1e3 > slo[0]:
            p += max(1, p // 8)
        if r["tpot"]["p90_s"] * 1e3 > slo[1]:
            d += max(1, d // 8)
    else:
        return None
    # steps of an eighth may overshoot: trim each side while the SLO still holds
    for _ in range(2):
        while p > 1 and sim.meets(sim.run(pf, p - 1, d, rate, dur, shape, slo, tr), slo):
            p -= 1
        while d > 1 and sim.meets(sim.run(pf, p, d - 1, rate, dur, shape, slo, tr), slo):
            d -= 1
    return p + d, p, d


def planner_answer(res):
    last = res["planner"][-1] if res["planner"] else {}
    steady = [x for x in res["planner"] if x["t"] > 60] or res["planner"]
    return max(x["prefill"] for x in steady), max(x["decode"] for x in steady)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=str(ROOT / "build"))
    a = ap.parse_args()
    sim = Sim(str(Path(a.build) / "bin" / "baton"))
    for label, pf, rate, dur, shapes, slos, tr in PROFILES:
        if not (ROOT / pf).exists():
            print(f"\n(skipped {label}: {pf} missing)\n")
            continue
        print(f"\n### {label}: {rate} req/s\n")
        print("| workload (ISL/OSL) | SLO p90 TTFT / TPOT | colocated nodes | disaggregated nodes (P:D) | "
              "planner P/D (disagg.) | planner D (coloc.) |")
        print("|---|---|---|---|---|---|")
        for shape in shapes:
            for slo in slos:
                nc = least_colocated(sim, pf, rate, dur, shape, slo, tr)
                nd = least_disagg(sim, pf, rate, dur, shape, slo, tr)
                plan_d = planner_answer(sim.run(pf, nd[1], nd[2], rate, dur, shape, slo, tr)) if nd else None
                plan_c = planner_answer(sim.run(pf, 0, nc, rate, dur, shape, slo, tr)) if nc else None
                print(f"| {shape[0]} ({shape[1]}/{shape[3]}) | {slo[0]} ms / {slo[1]} ms | {nc if nc else '> 512'} | "
                      f"{f'{nd[0]} ({nd[1]}:{nd[2]})' if nd else 'none (> 512 per role)'} | "
                      f"{f'{plan_d[0]}/{plan_d[1]}' if plan_d else '-'} | {plan_c[1] if plan_c else '-'} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
