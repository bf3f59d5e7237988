#!/usr/bin/env python3
"""What the engines' steps did: reads the step traces nodes write with BATON_STEP_TRACE=DIR (one DIR/NAME-PID.steps
per node, columns BT_SCHED_TRACE_FIELDS of engine/scheduler.h) and summarizes each decode node's decode-only steps by
batch size: how many, the median and p90 wall time of a step, of its forward pass and of the wait before it, and,
with a profile (`baton profile`'s JSON), the median ratio of each step's wall time to the profile's prediction
(what the simulator prices: decode.batch_s at the batch, or decode.fixed_s + batch x decode.seq_s, plus context x
decode.ctx_token_s). Where other nodes on the host traced their
steps too, each decode step counts as overlapped when another node computed during it, and the overlapped and the
lone steps get their own medians: what sharing the host's memory and caches costs a decode step.

usage: tools/step_trace.py DIR [--profile P.json] [--from T0 --to T1] [--json]
T0 and T1 are CLOCK_MONOTONIC seconds (Python's time.monotonic() on Linux), the trace's own clock."""
import argparse
import bisect
import json
import statistics
import sys
from pathlib import Path

FIELDS = ["t_s", "step_ms", "forward_ms", "gap_ms", "tokens", "seqs", "decode_only", "drafts", "context"]
BUCKETS = ["1", "2", "3", "4", "5-8", "9+"]
PREFILL_MIN_STEPS = 5


def read_trace(path, t0=None, t1=None):
    """The steps of one trace file that started within [t0, t1], as dicts of FIELDS."""
    steps = []
    for line in Path(path).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        v = line.split()
        if len(v) != len(FIELDS):
            continue  # a line cut short by the process's end
        s = dict(zip(FIELDS, (float(x) for x in v)))
        if (t0 is None or s["t_s"] >= t0) and (t1 is None or s["t_s"] <= t1):
            steps.append(s)
    return steps


def bucket(n):
    n = int(n)
    return str(n) if n <= 4 else "5-8" if n <= 8 else "9+"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


class Busy:
    """Other nodes' step intervals: whether one overlaps [a, b]."""

    def __init__(self, steps):
        iv = sorted((s["t_s"], s["t_s"] + s["step_ms"] / 1e3) for s in steps)
        self.starts = [a for a, _ in iv]
        self.ends = [b for _, b in iv]
        # the latest end among intervals starting at or before each one (intervals may nest)
        run, self.max_end = float("-inf"), []
        for b in self.ends:
            run = max(run, b)
            self.max_end.append(run)

    def overlaps(self, a, b):
        i = bisect.bisect_right(self.starts, b) - 1
        return i >= 0 and self.max_end[i] > a


def decode_step_s(decode, batch, context):
    """A decode step by a profile's "decode" object, as the simulator prices it (plan_decode_step_s): its measured
    batch points (batch_s) interpolated in the batch where it has them, else the line; then the context term."""
    pts, ctx = decode.get("batch_s") or [], context * decode.get("ctx_token_s", 0)
    if not pts:
        return decode["fixed_s"] + batch * decode["seq_s"] + ctx
    if batch <= pts[0][0]:
        return pts[0][1] + ctx
    if batch >= pts[-1][0]:
        return pts[-1][1] + (batch - pts[-1][0]) * decode["seq_s"] + ctx
    i = next(i for i, (b, _) in enumerate(pts) if b >= batch)
    (b0, s0), (b1, s1) = pts[i - 1], pts[i]
    return s0 + (s1 - s0) * (batch - b0) / (b1 - b0) + ctx


def predicted_s(step, decode):
    return decode_step_s(decode, step["seqs"], step["context"])


def prefill_step_s(prefill, tokens, prompts):
    """A prompt-only step by a profile's "prefill" object (plan_prefill_step_s)."""
    return prefill.get("fixed_s", 0) + tokens * prefill["token_s"] + prompts * prefill.get("seq_s", 0)


def cell(steps, decode):
    c = {"steps": len(steps),
         "step_p50_ms": pct([s["step_ms"] for s in steps], 0.5), "step_p90_ms": pct([s["step_ms"] for s in steps], 0.9),
         "forward_p50_ms": pct([s["forward_ms"] for s in steps], 0.5),
         "gap_p50_ms": pct([s["gap_ms"] for s in steps if s["gap_ms"] >= 0], 0.5),
         "gap_p90_ms": pct([s["gap_ms"] for s in steps if s["gap_ms"] >= 0], 0.9)}
    if decode:
        c["vs_profile"] = statistics.median(s["step_ms"] / 1e3 / predicted_s(s, decode) for s in steps)
    return c


def summarize(trace_dir, t0=None, t1=None, profile=None):
    """{node file: {"steps": all steps, "decode": {bucket: cell, also "<bucket> overlapped" / "<bucket> alone"},
    "lone_vs_profile": the median ratio over every decode-only step no other node's step overlapped (with a
    profile), "prefill": {"steps", "tokens_p50", "step_p50_ms", "vs_profile"}}}. The prefill cell counts the steps
    that computed one prompt's tokens and nothing else (one sequence, not decoding): on a prefill node and on a
    colocated decode node alike they are priced without ambiguity, and their median ratio to the profile's
    prefill price (with at least PREFILL_MIN_STEPS of them) says how fast the node prefilled during the trace
    against what the profile measured."""
    decode = profile.get("decode") if profile else None
    prefill = profile.get("prefill") if profile else None
    files = sorted(Path(trace_dir).glob("*.steps"))
    traces = {f.name: read_trace(f, t0, t1) for f in files}
    out = {}
    for name, steps in traces.items():
        others = Busy([s for n, st in traces.items() if n != name for s in st])
        by, lone = {}, []
        for s in steps:
            if not s["decode_only"]:
                continue
            b = bucket(s["seqs"])
            by.setdefault(b, []).append(s)
            busy = bool(others.starts) and others.overlaps(s["t_s"], s["t_s"] + s["step_ms"] / 1e3)
            if others.starts:
                by.setdefault(f"{b} {'overlapped' if busy else 'alone'}", []).append(s)
            if not busy:
                lone.append(s)
        out[name] = {"steps": len(steps), "decode": {k: cell(v, decode) for k, v in by.items()}}
        alone = [s for s in steps if not s["decode_only"] and s["seqs"] == 1 and s["tokens"] > 1]
        if alone:
            pc = {"steps": len(alone), "tokens_p50": pct([s["tokens"] for s in alone], 0.5),
                  "step_p50_ms": pct([s["step_ms"] for s in alone], 0.5)}
            if prefill and len(alone) >= PREFILL_MIN_STEPS:
                pc["vs_profile"] = statistics.median(s["step_ms"] / 1e3 / prefill_step_s(prefill, s["tokens"], 1)
                                                     for s in alone)
            out[name]["prefill"] = pc
        if decode and lone:  # the node's own speed against the profile's, where nothing else computed
            out[name]["lone_vs_profile"] = statistics.median(s["step_ms"] / 1e3 / predicted_s(s, decode) for s in lone)
    return out


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def print_summary(summary, file=sys.stdout, indent=""):
    for name, node in summary.items():
        pc = node.get("prefill")
        pline = (f"; {pc['steps']} one-prompt steps (median {pc['tokens_p50']:.0f} tokens, {pc['step_p50_ms']:.1f} ms"
                 + (f", x{pc['vs_profile']:.3f} the profile's" if "vs_profile" in pc else "") + ")") if pc else ""
        if not node["decode"]:
            print(f"{indent}{name}: {node['steps']} steps, none decode-only{pline}", file=file)
            continue
        lone = node.get("lone_vs_profile")
        print(f"{indent}{name}: {node['steps']} steps"
              + (f", lone decode steps x{lone:.3f} the profile's" if lone else "") + pline
              + "; decode-only steps by batch size (ms):", file=file)
        print(f"{indent}  {'batch':<16} {'steps':>6} {'p50':>7} {'p90':>7} {'fwd p50':>8} {'gap p50':>8} "
              f"{'gap p90':>8} {'x profile':>9}", file=file)
        keys = [k for b in BUCKETS for k in (b, f"{b} alone", f"{b} overlapped") if k in node["decode"]]
        for k in keys:
            c = node["decode"][k]
            print(f"{indent}  {k:<16} {c['steps']:>6} {fmt(c['step_p50_ms']):>7} {fmt(c['step_p90_ms']):>7} "
                  f"{fmt(c['forward_p50_ms']):>8} {fmt(c['gap_p50_ms']):>8} {fmt(c['gap_p90_ms']):>8} "
                  f"{fmt(c.get('vs_profile'), '.3f'):>9}", file=file)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--profile", help="baton profile's JSON: compare each step with its prediction")
    ap.add_argument("--from", dest="t0", type=float)
    ap.add_argument("--to", dest="t1", type=float)
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = ap.parse_args()
    if not sorted(Path(a.dir).glob("*.steps")):
        print(f"step_trace: no *.steps files in {a.dir}", file=sys.stderr)
        return 2
    profile = json.loads(Path(a.profile).read_text()) if a.profile else None
    s = summarize(a.dir, a.t0, a.t1, profile)
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print_summary(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
