#!/usr/bin/env python3
"""Function lengths in C sources, for the issue reports: the longest function per top-level folder (and, with -n N,
the N longest). A function is a top-level brace block whose opening line ends a declarator (`name(...)` before `{`);
length counts its lines from the signature's first line to the closing brace. Comments and strings are blanked
before braces are counted, so braces inside them do not confuse it; preprocessor lines are blanked too.

usage: tools/fn_lengths.py [-n N] [--folders a,b,...] [ROOT]   (ROOT defaults to the repository's top)"""
import argparse
import os
import re
import sys

SKIP = {"build", "build-asan", "build-fuzz", ".git", ".venv"}


def blank(text):
    """text with comments, strings and character literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "#" and text[text.rfind("\n", 0, i) + 1:i].strip() == "":
            j = i
            while True:  # a directive, with its continuation lines
                j = text.find("\n", j)
                if j < 0 or text[j - 1] != "\\":
                    break
                j += 1
            j = n if j < 0 else j
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


DECL = re.compile(r"([A-Za-z_]\w*)\s*\([^;{}]*\)\s*(?:__attribute__\s*\(\(.*?\)\)\s*)?$", re.S)


def functions(path):
    """(name, first line, line count) of each function defined in path."""
    with open(path, encoding="utf-8", errors="replace") as f:
        src = blank(f.read())
    res, depth, start, cur = [], 0, 0, None
    for i, c in enumerate(src):
        if c == "{":
            if depth == 0:
                head = src[start:i]
                m = DECL.search(head.rstrip())
                cur = None
                if m and m.group(1) not in ("if", "for", "while", "switch", "return", "sizeof"):
                    sig = start + len(head) - len(head.lstrip())
                    cur = (m.group(1), src.count("\n", 0, sig) + 1)
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                if cur:
                    res.append((cur[0], cur[1], src.count("\n", 0, i) + 1 - cur[1] + 1))
                cur = None
                start = i + 1
        elif c == ";" and depth == 0:
            start = i + 1
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("-n", type=int, default=1, help="longest functions per folder (default 1)")
    ap.add_argument("--folders", help="comma-separated top-level folders (default: every one with C files)")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    folders = a.folders.split(",") if a.folders else sorted(
        d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and d not in SKIP)
    for d in folders:
        found = []
        for dirpath, dirnames, files in os.walk(os.path.join(root, d)):
            dirnames[:] = [x for x in dirnames if x not in SKIP]
            for fn in files:
                if fn.endswith((".c", ".h")):
                    p = os.path.join(dirpath, fn)
                    found += [(n, os.path.relpath(p, root), line, length) for n, line, length in functions(p)]
        if not found:
            continue
        found.sort(key=lambda x: -x[3])
        for name, path, line, length in found[: a.n]:
            print(f"{d:14s} {length:5d}  {name}  ({path}:{line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
