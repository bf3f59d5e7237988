#!/usr/bin/env python3
"""Where baton's and llama.cpp's greedy outputs part on a gemma3 file, which one the float64 oracle sides with.

    tools/llamacpp_divergence.py [--model PATH] [--prompts FILE] [--max-tokens N] [--threads N] [--llama-dir DIR]

For each prompt (JSON lines with "chat", used as a plain completion prompt, as chat-vs-llamacpp.py --raw does):
baton's greedy ids (`baton generate --prompt --ids`) and llama-completion's greedy text, re-tokenized by baton. At
the first token where the two differ, the float64 numpy oracle of tests/integration/gemma3_oracle.py (gguf-py
dequantization, teacher-forced on the prompt and the common prefix) gives both tokens' logits: the report says which
is the oracle's higher and by how much, and whether baton's ids up to there are the oracle's argmax. Needs the
.venv's numpy and gguf (make setup)."""
import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from gemma3_oracle import Gemma3Oracle  # noqa: E402


def run(argv, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"llamacpp_divergence: {argv[0]} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/baton/models/gemma-3-270m-q4_k_m.gguf"))
    ap.add_argument("--prompts", action="append")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                        "baton", "llama.cpp"))
    a = ap.parse_args()
    baton = os.path.join(os.environ.get("BATON_BUILD_DIR", str(ROOT / "build")), "bin", "baton")
    lc = os.path.join(a.llama_dir, "build", "bin", "llama-completion")
    if not os.access(lc, os.X_OK):
        run([str(ROOT / "tools" / "bench-vs-llamacpp.sh"), "--build-only", "--llama-dir", a.llama_dir])
    files = a.prompts or [str(ROOT / "tools" / "workloads" / f) for f in ("chat.jsonl", "input-grounded.jsonl")]
    prompts = [json.loads(line) for f in files for line in open(f) if line.strip()]
    oracle = Gemma3Oracle(a.model)
    tok = lambda text, special: [int(x) for x in run([baton, "tokenize", "--model", a.model, "--no-parse-special"] +
                                                      (["--add-special"] if special else []) + [text]).split()]
    n_same = n_div = n_baton = 0
    for p in prompts:
        text = p["chat"]
        ours = [int(x) for x in run([baton, "generate", "--model", a.model, "--prompt", text, "--max-tokens",
                                     str(a.max_tokens), "--threads", str(a.threads), "--ids", "--quiet"]).split()]
        theirs_text = run([lc, "-m", a.model, "-p", text, "-n", str(a.max_tokens), "--temp", "0", "-no-cnv",
                           "--no-display-prompt", "--simple-io", "-t", str(a.threads), "--no-warmup"],
                          stdin=subprocess.DEVNULL, timeout=600).replace(" [end of text]", "").rstrip("\n")
        prompt_ids = tok(text, True)
        full = tok(text + theirs_text, True)
        theirs = full[len(prompt_ids):] if full[:len(prompt_ids)] == prompt_ids else None
        name = p.get("name", "?")
        if theirs is None:
            print(f"{name:24s} llama.cpp's text does not re-tokenize after the prompt: skipped")
            continue
        j = 0
        while j < min(len(ours), len(theirs)) and ours[j] == theirs[j]:
            j += 1
        if j >= min(len(ours), len(theirs)):
            n_same += 1
            print(f"{name:24s} same tokens ({j})")
            continue
        n_div += 1
        lg = oracle.logits(prompt_ids + ours[:j + 1])
        pos = len(prompt_ids) - 1  # row i predicts token i + 1
        follows = all(int(np.argmax(lg[pos + i])) == ours[i] for i in range(j + 1))
        lo, lt = lg[pos + j][ours[j]], lg[pos + j][theirs[j]]
        n_baton += lo > lt
        print(f"{name:24s} part at token {j}: oracle logit baton {lo:.4f} vs llama.cpp {lt:.4f} "
              f"({'baton' if lo > lt else 'llama.cpp'} higher by {abs(lo - lt):.4f}); baton's ids up to there "
              f"{'are' if follows else 'are NOT'} the oracle's argmax")
    print(f"{n_same} same, {n_div} part; at {n_baton} of {n_div} partings the oracle ranks baton's token higher")


if __name__ == "__main__":
    main()
