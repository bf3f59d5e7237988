"""`baton bench --concurrency` as a user runs it: the table, its JSON twin, and rooflines that bound what was
achieved. The multiply-accumulates per token are checked against the GGUF file's own tensor shapes (gguf-py)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gguf import GGUFReader

ROOT = Path(__file__).resolve().parents[2]
MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def matmul_macs(path):
    r = GGUFReader(str(path))
    names = {t.name: t for t in r.tensors}
    total = 0
    for name, t in names.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in MATMULS and parts[3] == "weight":
            total += int(t.shape[0]) * int(t.shape[1])
    out = names.get("output.weight", names["token_embd.weight"])  # tied embeddings: the output is token_embd
    return total + int(out.shape[0]) * int(out.shape[1])


def test_concurrency_table_json_and_rooflines(baton_bin, default_model, tmp_path):
    js = tmp_path / "bench.json"
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "1,4,16", "--reps", "1", "--decode-tokens", "16",
                          "--json", str(js)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    head = re.search(r"(\d+)-bit activations; memory ([\d.]+) GB/s; matmul dot rate ([\d.]+) GMAC/s on (\d+) "
                     r"threads at once \(([\d.]+) on one; ([\d.]+) MMAC per token: compute roofline (\d+) tok/s\)",
                     res.stdout)
    assert head, res.stdout
    macs = matmul_macs(default_model)
    assert abs(float(head.group(6)) * 1e6 - macs) < 0.06e6
    rows = [l.split() for l in res.stdout.splitlines() if re.match(r"^(1|4|16)\s", l)]
    assert [r[0] for r in rows] == ["1", "4", "16"], res.stdout
    doc = json.loads(js.read_text())
    assert doc["act_bits"] == int(head.group(1)) and doc["compute_roofline_tok_s"] > 0
    # the compute roofline is the rate measured on every thread at once (not n times one thread's: threads that share
    # a core share its vector units), over the matmuls' multiply-adds per token
    assert int(head.group(4)) == doc["threads"] and doc["dot_gmac_s_one_thread"] > 0, doc
    assert doc["dot_rate_measured"] is True, doc
    roof = doc["compute_roofline_tok_s"]
    assert abs(roof - doc["dot_gmac_s"] * 1e9 / macs) < 0.01 * roof, doc
    lanes = re.search(r"(\d+) threads \(decode lanes: (\d+)\)", res.stdout)
    assert lanes and doc["decode_lanes"] == int(lanes.group(2)), res.stdout
    # a lane per thread when there are threads to run them on
    assert doc["decode_lanes"] == (doc["threads"] if doc["threads"] > 1 else 0), doc
    runs = {r["concurrency"]: r for r in doc["runs"]}
    for n in (1, 4):
        r = runs[n]
        # what was achieved stays under its roofline (with room for a bandwidth measured while something else ran:
        # the machine is shared); 4 sequences share one pass over the weights
        assert 0 < r["decode_tok_s"] <= 1.5 * r["roofline_tok_s"], r
    # decode counts the steps in which every sequence decodes and no prompt runs: 1 and 4 prompts of 128 tokens
    # fit one 512-token step, so every output token after the first; 16 prompts take several steps, during which
    # the first requests decode beside them (not counted), and those finish first (the drain, not counted)
    assert runs[1]["decode_steps"] == 15 and runs[4]["decode_steps"] == 15, doc
    assert 0 < runs[16]["decode_steps"] < 15, doc
    assert runs[4]["roofline_tok_s"] > 2 * runs[1]["roofline_tok_s"]
    assert runs[4]["roofline_tok_s"] <= doc["compute_roofline_tok_s"] + 0.01


def test_lanes_switch_is_reported(baton_bin, default_model):
    env = dict(os.environ, BATON_CPU_LANES="0")
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "1", "--reps", "1", "--decode-tokens", "4"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    assert re.search(r"threads \(decode lanes: 0\)", res.stdout), res.stdout
    env["BATON_CPU_LANES"] = "yes"
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "1", "--reps", "1"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode != 0 and "BATON_CPU_LANES='yes': expected 0 or 1" in res.stderr, res.stderr


def test_step_trace(baton_bin, default_model, tmp_path):
    """BATON_STEP_TRACE=DIR: one file per concurrency with every rep's steps, in the nodes' format, which
    tools/step_trace.py summarizes; the decode-only step count agrees with the JSON's decode_steps. A directory that
    cannot take the file is an error that names it."""
    js = tmp_path / "bench.json"
    env = dict(os.environ, BATON_STEP_TRACE=str(tmp_path))
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "2,3", "--reps", "2", "--decode-tokens", "6",
                          "--json", str(js)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr
    doc = json.loads(js.read_text())
    for run in doc["runs"]:
        n = run["concurrency"]
        (path,) = tmp_path.glob(f"bench-c{n}-*.steps")
        assert f"step trace of concurrency {n}: {path}" in res.stderr, res.stderr
        lines = path.read_text().splitlines()
        assert lines[0] == "# t_s step_ms forward_ms gap_ms tokens seqs decode_only drafts context", lines[0]
        steps = [[float(x) for x in l.split()] for l in lines[1:]]
        assert all(len(s) == 9 and s[1] >= s[2] > 0 for s in steps), steps
        # per rep: one step for the n prompts (n x 128 tokens), then 5 in which all n decode one token each
        full = [s for s in steps if s[6] == 1 and s[5] == n and s[4] == n]
        assert len(full) == 2 * run["decode_steps"] == 2 * 5, (n, steps)
        assert sum(1 for s in steps if s[6] == 0 and s[4] == n * 128) == 2, (n, steps)
    summary = subprocess.run([sys.executable, str(ROOT / "tools" / "step_trace.py"), str(tmp_path), "--json"],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)[next(tmp_path.glob("bench-c3-*.steps")).name]["decode"]["3"]["steps"] == 10
    env["BATON_STEP_TRACE"] = str(tmp_path / "missing")
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "2", "--reps", "1", "--decode-tokens", "2"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 1 and f"BATON_STEP_TRACE: cannot create {tmp_path / 'missing'}/bench-c2-" in res.stderr, \
        res.stderr


def test_prompt_tokens_sets_the_context(baton_bin, default_model, tmp_path):
    """--prompt-tokens: the header and JSON say what ran; a longer context gives a lower memory roofline (more KV per
    sequence); out-of-range values are refused."""
    roofs = {}
    for plen in (128, 600):
        js = tmp_path / f"bench{plen}.json"
        res = subprocess.run([str(baton_bin), "bench", "--concurrency", "2", "--prompt-tokens", str(plen), "--reps", "1",
                              "--decode-tokens", "4", "--json", str(js)], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        assert f"{plen} prompt + 4 output tokens per request" in res.stdout, res.stdout
        doc = json.loads(js.read_text())
        assert doc["prompt_tokens"] == plen and doc["decode_tokens"] == 4, doc
        run = doc["runs"][0]
        assert run["concurrency"] == 2 and run["prefill_tok_s"] > 0 and run["decode_tok_s"] > 0, run
        roofs[plen] = run["roofline_tok_s"] / doc["bandwidth_gb_s"]
    # memory-bound at 2 sequences: the roofline is 2 x bandwidth / (weights + 2 x KV), and KV grows with the context
    # (per GB/s, as each run measures the shared machine's bandwidth anew)
    assert roofs[600] < 0.95 * roofs[128], roofs
    for bad in ("0", "8193", "x", "12x"):
        res = subprocess.run([str(baton_bin), "bench", "--concurrency", "1", "--prompt-tokens", bad],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "--prompt-tokens" in res.stderr, (bad, res.stderr)


def test_kv_dtype_is_used_and_reported(baton_bin, default_model, tmp_path):
    """--kv-dtype int8: the header and JSON say it, and the memory roofline counts int8's smaller KV (53% of f16's
    bytes per token: per GB/s of bandwidth, more tokens at the same context); unknown names are refused."""
    per_gbs = {}
    for dt in ("f16", "int8"):
        js = tmp_path / f"bench-{dt}.json"
        res = subprocess.run([str(baton_bin), "bench", "--concurrency", "2", "--prompt-tokens", "600", "--reps", "1",
                              "--decode-tokens", "4", "--kv-dtype", dt, "--json", str(js)], capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        assert f"tokens per request, {dt} KV" in res.stdout, res.stdout
        doc = json.loads(js.read_text())
        assert doc["kv_dtype"] == dt and doc["runs"][0]["decode_tok_s"] > 0, doc
        per_gbs[dt] = doc["runs"][0]["roofline_tok_s"] / doc["bandwidth_gb_s"]
    assert per_gbs["int8"] > 1.05 * per_gbs["f16"], per_gbs
    res = subprocess.run([str(baton_bin), "bench", "--concurrency", "1", "--kv-dtype", "q4"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "--kv-dtype must be f16, f32 or int8" in res.stderr, res.stderr


def test_step_rows_curve(baton_bin, default_model, tmp_path):
    """--step-rows: one sequence's step of 1..N rows after the prompt, as a table, a curve for tools/spec_replay.py
    --curve and JSON that agree. The prompt nearly fills the context (640 of 656 positions): each step's rows must be
    dropped again for the 8 steps of each size to fit. Bad values are refused."""
    js = tmp_path / "rows.json"
    res = subprocess.run([str(baton_bin), "bench", "--step-rows", "8", "--reps", "1", "--prompt-tokens", "640",
                          "--json", str(js)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    table = [l.split() for l in res.stdout.splitlines() if re.match(r"^\d+\s+[\d.]+\s+[\d.]+x$", l)]
    assert [int(r[0]) for r in table] == list(range(1, 9)), res.stdout
    curve = re.search(r"^curve \(tools/spec_replay.py --curve\): ([\d.,]+)$", res.stdout, re.M)
    assert curve, res.stdout
    doc = json.loads(js.read_text())
    assert doc["prompt_tokens"] == 640 and doc["act_bits"] in (8, 16) and len(doc["step_ms"]) == 8, doc
    assert all(ms > 0 for ms in doc["step_ms"]), doc
    # the same times at each print's precision (JSON has 4 decimals, so a rounding tie may go either way)
    assert all(abs(float(x) - ms) <= 0.0051 for x, ms in zip(curve.group(1).split(","), doc["step_ms"])), (curve, doc)
    assert all(abs(float(r[1]) - ms) <= 0.00051 for r, ms in zip(table, doc["step_ms"])), (table, doc)
    assert len(curve.group(1).split(",")) == 8
    for args, msg in ((["--step-rows", "0"], "--step-rows"), (["--step-rows", "65"], "--step-rows"),
                      (["--step-rows", "2", "--concurrency", "1"], "--step-rows runs alone")):
        res = subprocess.run([str(baton_bin), "bench", *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
