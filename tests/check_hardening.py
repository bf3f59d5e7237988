#!/usr/bin/env python3
"""Checks release binaries with readelf (issue 16.9): each must be a PIE, have full RELRO (GNU_RELRO and BIND_NOW),
a non-executable stack, and call fortified libc functions (__*_chk symbols: _FORTIFY_SOURCE took effect).
Usage: check_hardening.py BINARY... ; exit 0 when all pass, 1 naming each failure, 77 when readelf is missing."""
import re
import shutil
import subprocess
import sys


def readelf(*args):
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


def problems(path):
    out = []
    if "DYN (Position-Independent Executable" not in readelf("-h", path):
        out.append("not a PIE")
    segs = readelf("-l", path)
    if "GNU_RELRO" not in segs:
        out.append("no GNU_RELRO segment")
    stack = re.search(r"GNU_STACK(?:\s+\S+){5}\s+(\w+)", segs)
    if not stack:
        out.append("no GNU_STACK segment (the stack defaults to executable)")
    elif "E" in stack.group(1):
        out.append(f"executable stack ({stack.group(1)})")
    dyn = readelf("-d", path)
    if not re.search(r"\(BIND_NOW\)|\(FLAGS\).*BIND_NOW|\(FLAGS_1\).*\bNOW\b", dyn):
        out.append("no BIND_NOW (partial RELRO)")
    chk = sorted(set(re.findall(r"\b(__\w+_chk)\b", readelf("--dyn-syms", path))))
    if not chk:
        out.append("no fortified __*_chk calls (_FORTIFY_SOURCE not in effect)")
    return out, chk


def main(paths):
    if not shutil.which("readelf"):
        print("SKIP: readelf (binutils) is not installed")
        return 77
    failed = False
    for p in paths:
        bad, chk = problems(p)
        if bad:
            failed = True
            print(f"FAIL {p}: " + "; ".join(bad))
        else:
            print(f"ok   {p}: PIE, RELRO + BIND_NOW, NX stack, {len(chk)} fortified calls ({', '.join(chk[:4])}...)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
