#!/usr/bin/env python3
"""Offline replay of n-gram speculation on a workload's greedy outputs: what any n-gram drafting policy could reach.

Greedy output does not depend on speculation, so the outputs of a plain run fix which drafts would be kept. For each
prompt of the workload this renders the chat, generates greedily with `baton generate --ids`, then replays decoding
step by step with the n-gram proposer's rule (the sequence's last n tokens, longest n first, most recent earlier
occurrence) under a step-cost model: a step costs STEP_MS plus ROW_MS per draft row, or, with --curve, the measured
milliseconds of a step of 1, 2, 3, ... rows (rows past the list add the last difference). It prints the speed-up of
  - fixed k: draft every available continuation token up to --k-max (what k = k_max costs);
  - oracle k: draft exactly the tokens that will be kept (no policy can do better with this proposer).
The two costs come from `baton bench --spec ngram` ("a decode row cost X ms against a step's fixed Y ms"), and so does
the curve (its step times "by draft rows 0..N" are the steps of 1..N+1 rows).

usage: tools/spec_replay.py [--workload tools/workloads/input-grounded.jsonl] [--baton build/bin/baton]
                            [--step-ms 4.8] [--row-ms 0.61 | --curve MS,MS,...] [--k-max 8] [--ngram 2-4]
                            [--max-tokens 128]
"""
import argparse
import json
import subprocess
import sys


def run(cmd, stdin=None):
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"spec_replay: {' '.join(cmd[:2])} failed: {r.stderr.strip()}")
    return r.stdout


def ids(text):
    return [int(x) for x in text.split() if x.lstrip("-").isdigit()]


def propose(t, nmin, nmax, k):
    """The n-gram proposer: the continuation after the most recent earlier occurrence of the longest suffix."""
    n_tok = len(t)
    for n in range(nmax, nmin - 1, -1):
        if n > n_tok - 1:
            continue
        suffix = t[n_tok - n:]
        for end in range(n_tok - 2, n - 2, -1):
            if t[end - n + 1:end + 1] == suffix:
                return t[end + 1:end + 1 + k]
    return []


def step_cost(rows, step, row, curve):
    """Milliseconds of a step of `rows` rows: the measured curve, extended by its last difference, or the line."""
    if not curve:
        return step + row * rows
    if rows <= len(curve):
        return curve[rows - 1]
    last = max(curve[-1] - curve[-2], 0.0)
    return curve[-1] + last * (rows - len(curve))


def replay(prompt, out, nmin, nmax, k_max, cost, oracle):
    """Milliseconds to decode out after prompt with drafting; every step emits the kept drafts plus one token."""
    ms, i = 0.0, 0
    while i < len(out):
        drafts = propose(prompt + out[:i + 1], nmin, nmax, k_max) if i + 1 < len(out) else []
        kept = 0
        while kept < len(drafts) and i + 1 + kept < len(out) and drafts[kept] == out[i + 1 + kept]:
            kept += 1
        ms += cost(1 + (kept if oracle else len(drafts)))
        i += 1 + kept
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="tools/workloads/input-grounded.jsonl")
    ap.add_argument("--baton", default="build/bin/baton")
    ap.add_argument("--step-ms", type=float, default=4.8, help="a step's fixed cost (default 4.8)")
    ap.add_argument("--row-ms", type=float, default=0.61, help="what one row adds (default 0.61)")
    ap.add_argument("--curve", default="", help="measured ms of a step of 1, 2, 3, ... rows, comma-separated "
                    "(instead of --step-ms and --row-ms)")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--ngram", default="2-4", help="n-gram lengths MIN-MAX (default 2-4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    nmin, nmax = (int(x) for x in a.ngram.split("-"))
    try:
        curve = [float(x) for x in a.curve.split(",")] if a.curve else []
    except ValueError:
        sys.exit(f"spec_replay: --curve wants milliseconds separated by commas, got '{a.curve}'")
    if curve and (len(curve) < 2 or min(curve) <= 0):
        sys.exit("spec_replay: --curve wants at least 2 positive milliseconds (steps of 1 and 2 rows, ...)")

    def cost(rows):
        return step_cost(rows, a.step_ms, a.row_ms, curve)
    base = fixed = oracle = 0.0
    print(f"{'prompt':<24} {'tokens':>6} {'fixed k':>8} {'oracle k':>9}")
    with open(a.workload) as f:
        items = [json.loads(line) for line in f if line.strip()]
    for it in items:
        if "chat" in it:
            conv = json.dumps([{"role": "user", "content": it["chat"]}])
            text = run([a.baton, "chat-template", conv])
            gen_args = ["--chat", it["chat"]]
        else:
            text = it["prompt"]
            gen_args = ["--prompt", it["prompt"]]
        prompt = ids(run([a.baton, "tokenize"], stdin=text))
        out = ids(run([a.baton, "generate", *gen_args, "--ids", "--quiet", "--max-tokens", str(a.max_tokens)]))
        plain = len(out) * cost(1)
        f_ms = replay(prompt, out, nmin, nmax, a.k_max, cost, False)
        o_ms = replay(prompt, out, nmin, nmax, a.k_max, cost, True)
        base, fixed, oracle = base + plain, fixed + f_ms, oracle + o_ms
        print(f"{it.get('name', '?'):<24} {len(out):>6} {plain / f_ms:>7.2f}x {plain / o_ms:>8.2f}x")
    print(f"{'all':<24} {'':>6} {base / fixed:>7.2f}x {base / oracle:>8.2f}x")


if __name__ == "__main__":
    main()
