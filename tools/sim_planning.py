#!/usr/bin/env python3
"""The runs behind deploy/PLANNING.md (issue 22, item 5): for each profile, workload shape and SLO, the fewest
nodes that meet the SLO at p90 (TTFT and TPOT), colocated and disaggregated (the best P:D split at that count),
the planner's own answer for the same load, and the most load each node count sustains both ways.

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
    ("this CPU host (SmolLM2-135M, measured)", "deploy/profiles/cpu-smollm2-135m.json", 2, 300, CPU_SHAPES,
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


def least_colocated(sim, pf, rate, dur, shape, slo, tr, cap=4096):
    lo, hi = 1, 1
    while not sim.meets(sim.run(pf, 0, hi, rate, dur, shape, slo, tr), slo):
        if hi >= cap:
            return None
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        m = (lo + hi) // 2
        if sim.meets(sim.run(pf, 0, m, rate, dur, shape, slo, tr), slo):
            hi = m
        else:
            lo = m + 1
    return hi


def least_disagg(sim, pf, rate, dur, shape, slo, tr, upto):
    """Fewest total nodes N (2..upto) with some split P + D = N meeting the SLO; (N, P, D) or None."""
    for n in range(2, upto + 1):
        best = None
        for p in range(1, n):
            res = sim.run(pf, p, n - p, rate, dur, shape, slo, tr)
            if sim.meets(res, slo):
                score = max(res["ttft"]["p90_s"] / (slo[0] / 1e3), res["tpot"]["p90_s"] / (slo[1] / 1e3))
                if best is None or score < best[0]:
                    best = (score, p, n - p)
        if best:
            return n, best[1], best[2]
    return None


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
                nd = least_disagg(sim, pf, rate, dur, shape, slo, tr, (nc or 64) + 2)
                plan_d = planner_answer(sim.run(pf, nd[1], nd[2], rate, dur, shape, slo, tr)) if nd else None
                plan_c = planner_answer(sim.run(pf, 0, nc, rate, dur, shape, slo, tr)) if nc else None
                print(f"| {shape[0]} ({shape[1]}/{shape[3]}) | {slo[0]} ms / {slo[1]} ms | {nc if nc else '> 4096'} | "
                      f"{f'{nd[0]} ({nd[1]}:{nd[2]})' if nd else 'none up to colocated + 2'} | "
                      f"{f'{plan_d[0]}/{plan_d[1]}' if plan_d else '-'} | {plan_c[1] if plan_c else '-'} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
