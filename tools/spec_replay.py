#!/usr/bin/env python3
"""Offline replay of n-gram speculation on a workload's greedy outputs: what any n-gram drafting policy could reach.

Greedy output does not depend on speculation, so the outputs of a plain run fix which drafts would be kept. For each
prompt of the workload this renders the chat, generates greedily with `baton generate --ids`, then replays decoding
step by step with the n-gram proposer's rule (the sequence's last n tokens, longest n first, most recent earlier
occurrence) under a step-cost model: a step costs STEP_MS plus ROW_MS per draft row, or, with --curve, the measured
milliseconds of a step of 1, 2, 3, ... rows (rows past the list add the last difference). It prints the speed-up of
  - fixed k: draft every available continuation token up to --k-max (what k = k_max costs);
  - plan: the engine's own rule (engine/spec.c), replayed: per-position acceptance estimates per draft class, the plan
    that maximizes expected tokens per second under a step-cost curve it learns as it goes (a size counts once it has
    been chosen twice; unmeasured sizes are priced from the measured slope, within [ROW_MS / 4, ROW_MS], and before
    any measurement at STEP_MS + ROW_MS per row, as the scheduler's fitted model), and the probes. Noise-free: where
    `baton bench` falls short of this column, the step times it met were worse than the curve;
  - oracle k: draft exactly the tokens that will be kept (no policy can do better with this proposer).
The two costs come from `baton bench --spec ngram` ("a decode row cost X ms against a step's fixed Y ms"), and so does
the curve (its step times "by draft rows 0..N" are the steps of 1..N+1 rows).

usage: tools/spec_replay.py [--workload tools/workloads/input-grounded.jsonl] [--baton build/bin/baton]
                            [--step-ms 4.8] [--row-ms 0.61] [--curve MS,MS,...] [--k-max 8] [--ngram 2-4]
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


def propose_n(t, nmin, nmax, k):
    """The n-gram proposer: the continuation after the most recent earlier occurrence of the longest suffix, and the
    suffix's length (0: no match)."""
    n_tok = len(t)
    for n in range(nmax, nmin - 1, -1):
        if n > n_tok - 1:
            continue
        suffix = t[n_tok - n:]
        for end in range(n_tok - 2, n - 2, -1):
            if t[end - n + 1:end + 1] == suffix:
                return t[end + 1:end + 1 + k], n
    return [], 0


def propose(t, nmin, nmax, k):
    return propose_n(t, nmin, nmax, k)[0]


def step_cost(rows, step, row, curve):
    """Milliseconds of a step of `rows` rows: the measured curve, extended by its last difference, or the line."""
    if not curve:
        return step + row * rows
    if rows <= len(curve):
        return curve[rows - 1]
    last = max(curve[-1] - curve[-2], 0.0)
    return curve[-1] + last * (rows - len(curve))


def kept_count(drafts, out, i):
    """How many of the drafts proposed after out[i] greedy decoding would keep (they match out[i + 1], ...)."""
    kept = 0
    while kept < len(drafts) and i + 1 + kept < len(out) and drafts[kept] == out[i + 1 + kept]:
        kept += 1
    return kept


def replay(prompt, out, nmin, nmax, k_max, cost, oracle):
    """Milliseconds to decode out after prompt with drafting; every step emits the kept drafts plus one token."""
    ms, i = 0.0, 0
    while i < len(out):
        drafts = propose(prompt + out[:i + 1], nmin, nmax, k_max) if i + 1 < len(out) else []
        kept = kept_count(drafts, out, i)
        ms += cost(1 + (kept if oracle else len(drafts)))
        i += 1 + kept
    return ms


K_LIMIT = 16          # BT_SPEC_K_LIMIT
SEQ_DECAY = 0.8       # SPEC_DECAY
GLOBAL_DECAY = 0.95   # SPEC_GLOBAL_DECAY
CHAIN_WEIGHT = 0.25   # SPEC_CHAIN_WEIGHT
MIN_P = 0.1           # BT_SPEC_MIN_THRESHOLD
MIN_SLOPE = 0.25      # CURVE_MIN_SLOPE


class Stats:
    """bt_spec_stats: decayed hits and tries per draft position."""

    def __init__(self, hits0=1.0, tries0=2.0):
        self.hits, self.tries = [0.0] * K_LIMIT, [0.0] * K_LIMIT
        self.hits[0], self.tries[0] = hits0, tries0
        self.idle, self.probe_every = 0, 16

    def alphas(self, n):
        a, out = 0.5, []
        for i in range(min(n, K_LIMIT)):
            a = (self.hits[i] + CHAIN_WEIGHT * a) / (self.tries[i] + CHAIN_WEIGHT)
            out.append(a)
        return out

    def record(self, decay, n_drafts, n_kept):
        self.hits = [h * decay for h in self.hits]
        self.tries = [t * decay for t in self.tries]
        for i in range(min(n_kept, K_LIMIT)):
            self.hits[i] += 1
            self.tries[i] += 1
        if n_kept < n_drafts and n_kept < K_LIMIT:
            self.tries[n_kept] += 1

    def seeded(self):
        """bt_spec_stats_init_from: a new sequence's estimate from this proposer-wide one."""
        st, al = Stats(), self.alphas(K_LIMIT)
        for i in range(K_LIMIT):
            w = min(self.tries[i], 2)
            st.hits[i], st.tries[i] = w * al[i], w
        return st


def replay_plan(items, nmin, nmax, k_max, true_cost, fixed, per_row):
    """Milliseconds of each request's decoding under the engine's plan, the workload in order (the proposer-wide
    estimates and the learnt curve carry over from one request to the next, as in one scheduler)."""
    known = {}  # rows -> [samples (up to 2), seconds]
    glob = {}

    def est(rows):
        if rows in known and known[rows][0] >= 2:
            return known[rows][1]
        m = sorted(r for r in known if known[r][0] >= 2 and r < rows)
        if not m:
            return fixed + per_row * rows
        slope = (known[m[-1]][1] - known[m[-2]][1]) / (m[-1] - m[-2]) if len(m) >= 2 else per_row
        slope = min(max(slope, MIN_SLOPE * per_row), per_row)
        return known[m[-1]][1] + slope * (rows - m[-1])

    times = []
    for prompt, out in items:
        seq = {}
        total = 0.0
        i = 0
        while i < len(out):
            drafts, n = propose_n(prompt + out[:i + 1], nmin, nmax, k_max) if i + 1 < len(out) else ([], 0)
            kept = kept_count(drafts, out, i)
            k = 0
            if drafts:
                cls = 1 if n == 1 else 0  # the n-gram proposer's draft classes
                if cls not in glob:
                    glob[cls] = Stats(5.0, 10.0)
                if cls not in seq:
                    seq[cls] = glob[cls].seeded()
                st = seq[cls]
                p, tokens, best_rate = 1.0, 1.0, 1.0 / est(1)
                for j, a in enumerate(st.alphas(len(drafts))):
                    p *= a
                    if p < MIN_P:
                        break
                    tokens += p
                    if tokens / est(j + 2) > best_rate:
                        best_rate, k = tokens / est(j + 2), j + 1
                if k:
                    st.idle = 0
                else:
                    st.idle += 1
                    if st.idle >= st.probe_every and (est(2) - est(1)) < 0.5 * est(1):
                        k, st.idle = 1, 0
                if k:
                    n_kept = min(kept, k)
                    st.record(SEQ_DECAY, k, n_kept)
                    glob[cls].record(GLOBAL_DECAY, k, n_kept)
                    st.probe_every = 16 if n_kept else min(st.probe_every * 2, 512)
            rows, n_kept = 1 + k, min(kept, k)
            t = true_cost(rows)
            if rows not in known:
                known[rows] = [1, t]
            elif known[rows][0] < 2:
                known[rows] = [2, min(known[rows][1], t)]
            total += t
            i += 1 + n_kept
        times.append(total)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="tools/workloads/input-grounded.jsonl")
    ap.add_argument("--baton", default="build/bin/baton")
    ap.add_argument("--step-ms", type=float, default=4.8, help="a step's fixed cost (default 4.8); with --curve, the "
                    "plan's fitted model for sizes it has not measured")
    ap.add_argument("--row-ms", type=float, default=0.61, help="what one row adds (default 0.61); with --curve, as "
                    "--step-ms")
    ap.add_argument("--curve", default="", help="measured ms of a step of 1, 2, 3, ... rows, comma-separated "
                    "(the steps' true cost instead of --step-ms and --row-ms, which then only price the plan's "
                    "unmeasured sizes)")
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
    with open(a.workload) as f:
        items = [json.loads(line) for line in f if line.strip()]
    runs = []
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
        runs.append((prompt, out))
    plan_ms = replay_plan(runs, nmin, nmax, a.k_max, cost, a.step_ms, a.row_ms)
    base = fixed = planned = oracle = 0.0
    print(f"{'prompt':<24} {'tokens':>6} {'fixed k':>8} {'plan':>7} {'oracle k':>9}")
    for it, (prompt, out), p_ms in zip(items, runs, plan_ms):
        plain = len(out) * cost(1)
        f_ms = replay(prompt, out, nmin, nmax, a.k_max, cost, False)
        o_ms = replay(prompt, out, nmin, nmax, a.k_max, cost, True)
        base, fixed, planned, oracle = base + plain, fixed + f_ms, planned + p_ms, oracle + o_ms
        print(f"{it.get('name', '?'):<24} {len(out):>6} {plain / f_ms:>7.2f}x {plain / p_ms:>6.2f}x {plain / o_ms:>8.2f}x")
    print(f"{'all':<24} {'':>6} {base / fixed:>7.2f}x {base / planned:>6.2f}x {base / oracle:>8.2f}x")


if __name__ == "__main__":
    main()
