#!/usr/bin/env python3
"""Greedy chat output of baton against llama.cpp's llama-completion on the same GGUF (issue 23's agreement check).

    tools/chat-vs-llamacpp.py [--model PATH] [--prompts FILE] [--max-tokens N] [--threads N] [--llama-dir DIR] [--raw]

Each prompt (a JSON line with "chat": user text, as tools/workloads/chat.jsonl; default: that file and
tools/workloads/input-grounded.jsonl) is rendered once with baton's chat template (`baton chat-template`), then
generated greedily by `baton generate --chat` and by llama-completion on exactly that rendered text (its special
tokens parsed; a BOS the template wrote is left to llama.cpp, which adds the model's own). Prints, per prompt, whether the two texts are identical and, if not, after how many
characters they part; then how many agree. --raw sends each text as a plain completion prompt instead (for base
models without a chat format: `baton generate --prompt`, llama-completion -p). llama.cpp comes from DIR (default $XDG_CACHE_HOME/baton/llama.cpp),
built by tools/bench-vs-llamacpp.sh --build-only when missing. Exit status 0 (the figure is the report, not a
verdict); 1 when a tool fails.

Both sides are correct implementations whose arithmetic differs (activation quantization, summation order), so
near-ties between two tokens can go either way and the texts then part; agreement is a figure to report.
BATON_ACT_BITS=8 in the environment runs baton with 8-bit activations, as llama.cpp's CPU matmuls quantize them.
(On SmolLM2 Q4_1, "good habits for studying" parts at the first token at 16-bit activations, "To" against "When",
and agrees at 8-bit: a near tie.)"""
import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BOS_TEXTS = ("<bos>", "<|begin_of_text|>", "<s>", "<|startoftext|>")


def run(argv, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"chat-vs-llamacpp: {argv[0]} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--prompts", action="append")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--raw", action="store_true", help="plain completion prompts, no chat template")
    ap.add_argument("--llama-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                        "baton", "llama.cpp"))
    a = ap.parse_args()
    baton = os.path.join(os.environ.get("BATON_BUILD_DIR", str(ROOT / "build")), "bin", "baton")
    if not os.access(baton, os.X_OK):
        sys.exit(f"chat-vs-llamacpp: {baton} is not built (make build)")
    model = a.model or run([baton, "model", "path"]).strip()
    lc = os.path.join(a.llama_dir, "build", "bin", "llama-completion")
    if not os.access(lc, os.X_OK):
        run([str(ROOT / "tools" / "bench-vs-llamacpp.sh"), "--build-only", "--llama-dir", a.llama_dir])
    files = a.prompts or [str(ROOT / "tools" / "workloads" / f) for f in ("chat.jsonl", "input-grounded.jsonl")]
    prompts = []
    for f in files:
        with open(f) as fh:
            prompts += [json.loads(line) for line in fh if line.strip()]
    agree = 0
    for i, p in enumerate(prompts):
        user = p["chat"]
        if a.raw:
            rendered = user
        else:
            conv = json.dumps([{"role": "user", "content": user}])
            rendered = run([baton, "chat-template", "--model", model, conv])
            for bos in BOS_TEXTS:  # llama-completion adds the model's BOS itself: a second one would change the text
                if rendered.startswith(bos):
                    rendered = rendered[len(bos):]
                    break
        ours = run([baton, "generate", "--model", model, "--prompt" if a.raw else "--chat", user, "--max-tokens",
                    str(a.max_tokens), "--threads", str(a.threads), "--quiet"])
        theirs = run([lc, "-m", model, "-p", rendered, "-n", str(a.max_tokens), "--temp", "0", "-no-cnv",
                      "--no-display-prompt", "--simple-io", "-t", str(a.threads), "--no-warmup"],
                     stdin=subprocess.DEVNULL, timeout=600)
        theirs = theirs.replace(" [end of text]", "").rstrip("\n")
        ours = ours.rstrip("\n")
        n = 0
        while n < min(len(ours), len(theirs)) and ours[n] == theirs[n]:
            n += 1
        same = ours == theirs
        agree += same
        name = p.get("name", str(i))
        print(f"{name:28s} {'identical' if same else f'part after {n} of {max(len(ours), len(theirs))} chars'}")
        if not same:
            print(f"    baton:     {ours[max(0, n - 20):n + 40]!r}")
            print(f"    llama.cpp: {theirs[max(0, n - 20):n + 40]!r}")
    print(f"{agree} of {len(prompts)} prompts identical ({a.max_tokens} greedy tokens, {'raw' if a.raw else 'chat'}; "
          f"model {model})")


if __name__ == "__main__":
    main()
