#!/usr/bin/env python3
"""Every skipped test of a `make test` run, and why; with --allow, a failure for any skip not on the allow-list.

Reads the JUnit XML that ctest (--output-junit) and pytest (--junitxml) write. A ctest entry skips by exiting 77
(tests/unit/test_util.h) and says why on "SKIP: " lines; a pytest test says why in its skip message.

usage: tests/skip_report.py [--allow FILE] SUITE=JUNIT.xml...
  SUITE names the run in test ids ("unit", "asan", "fuzz", "integration"): unit:test_cpu_gemm.avx512.
  Exit status: 0; with --allow, 1 when a skip matches no entry, 2 on a missing or unreadable report.

Allow-list lines (# starts a comment): TEST-ID GLOB | REASON GLOB | why this skip is acceptable
A skip is allowed when an entry's globs (fnmatch) match its test id and every reason it gave.
"""
import fnmatch
import sys
import xml.etree.ElementTree as ET


def read_skips(suite, path):
    """[(test id, [reasons])] of the skipped test cases in one JUnit file."""
    skips = []
    for case in ET.parse(path).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        classname, name = case.get("classname", ""), case.get("name", "")
        out = case.findtext("system-out") or ""
        reasons = [line[len("SKIP: "):].strip() for line in out.splitlines() if line.startswith("SKIP: ")]
        if not reasons:  # pytest: the skip message; ctest: exit 77 without a SKIP line
            msg = skipped.get("message", "")
            reasons = [msg if msg and msg != "SKIP_RETURN_CODE=77" else "(no reason given)"]
        test = name if classname in ("", name) else f"{classname.replace('.', '/')}.py::{name}"
        skips.append((f"{suite}:{test}", list(dict.fromkeys(reasons))))
    return skips


def read_allow(path):
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = [p.strip() for p in line.split("|")]
            if len(parts) != 3 or not all(parts):
                sys.exit(f"{path}:{n}: expected 'TEST-ID GLOB | REASON GLOB | why it may skip'")
            entries.append(tuple(parts))
    return entries


def allowed_by(entries, test, reasons):
    for pattern, reason, why in entries:
        if fnmatch.fnmatchcase(test, pattern) and all(fnmatch.fnmatchcase(r, reason) for r in reasons):
            return why
    return None


def main(argv):
    allow = None
    if len(argv) >= 2 and argv[0] == "--allow":
        allow, argv = argv[1], argv[2:]
    if not argv or any("=" not in a for a in argv):
        sys.exit(__doc__.split("\n\n")[2])
    skips = []
    for arg in argv:
        suite, path = arg.split("=", 1)
        try:
            skips += read_skips(suite, path)
        except (OSError, ET.ParseError) as e:
            print(f"skip report: cannot read the {suite} results {path}: {e}", file=sys.stderr)
            return 2
    entries = read_allow(allow) if allow else []
    print(f"Skipped tests: {len(skips) or 'none'}")
    refused = 0
    for test, reasons in skips:
        why = allowed_by(entries, test, reasons) if allow else None
        verdict = "" if not allow else f"   [allowed: {why}]" if why else "   [NOT ON THE ALLOW-LIST]"
        refused += allow is not None and why is None
        print(f"  {test}: {'; '.join(reasons)}{verdict}")
    if refused:
        print(f"skip report: {refused} skip(s) not on {allow}: run them or add an entry that says why", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
