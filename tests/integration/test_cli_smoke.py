"""Smoke tests of the commands README lists that no other test runs: `baton kvx-bench`, plain `baton bench`,
`baton tokenize --pieces`. Each run is short; the checks are on the output's shape and sanity (JSON keys present,
figures positive and consistent with each other), not on speed."""
import json
import os
import re
import subprocess

# a 1,000-token SmolLM2 prompt: 63 blocks x 30 layers x 12,288 bytes (f16 KV), what kvx-bench's hand-off moves
HANDOFF_BYTES = 63 * 30 * 12288


def run(cmd, env=None, timeout=300):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}: {r.stderr[-3000:]}"
    return r


def check_transport(t, path):
    assert t["ok"] is True and t["data_path"] == path, t
    for s in t["sizes"]:
        assert s["size"] == 12288
        assert s["bw_hot_mib_s"] > 0 and s["bw_stream_mib_s"] > 0, s
        assert 0 < s["lat_p50_us"] <= s["lat_p99_us"], s
        assert s["puts_per_stream_push"] > 0, s
        # --no-perftest: the reference columns say "not measured", never a made-up figure
        assert s["perftest_put_bw_mib_s"] == s["perftest_am_bw_mib_s"] == s["perftest_put_lat_us"] == -1, s
    h = t["handoff"]
    assert h["bytes"] == HANDOFF_BYTES and h["contiguous_ms"] > 0 and h["fragmented_ms"] > 0 and h["crc32c_ms"] > 0, h
    soak = t["soak"]
    assert soak["transfers"] == 10 and soak["seconds"] > 0, soak
    assert soak["live_requests"] == soak["live_pushes"] == soak["receiver_live_expects"] == 0, soak


def test_kvx_bench(baton_bin, tmp_path):
    js = tmp_path / "kvx.json"
    r = run([baton_bin, "kvx-bench", "--transport", "both", "--sizes", "12K", "--seconds", "0.1", "--no-perftest",
             "--soak", "10", "--json", js])
    doc = json.loads(js.read_text())
    assert doc["depth"] == 1 and doc["seconds"] == 0.1
    by = {t["name"]: t for t in doc["transports"]}
    assert sorted(by) == ["shm", "tcp"], by.keys()
    check_transport(by["tcp"], "am")
    check_transport(by["shm"], "mapped")
    assert "tcp (UCX_TLS=tcp, kvx data path: am" in r.stdout and "kvx data path: mapped" in r.stdout, r.stdout
    assert "hand-off of a 1,000-token SmolLM2 prompt" in r.stdout


def test_kvx_bench_put_path(baton_bin, tmp_path):
    """BATON_KVX_DATA_PATH=put is honoured and reported: the bench measures ucp_put_nbx over shared memory."""
    js = tmp_path / "kvx.json"
    env = dict(os.environ, BATON_KVX_DATA_PATH="put")
    run([baton_bin, "kvx-bench", "--transport", "shm", "--sizes", "12K", "--seconds", "0.1", "--no-perftest",
         "--soak", "10", "--json", js], env=env)
    (t,) = json.loads(js.read_text())["transports"]
    check_transport(t, "put")


def test_plain_bench(baton_bin, default_model, tmp_path):
    js = tmp_path / "bench.json"
    r = run([baton_bin, "bench", "--model", default_model, "--reps", "1", "--decode-tokens", "8", "--threads", "1",
             "--json", js])
    doc = json.loads(js.read_text())
    for k in ("prefill128_tok_s", "prefill512_tok_s", "decode_tok_s", "bandwidth_1t_gb_s", "bandwidth_gb_s",
              "weight_bytes_per_token", "decode_roofline_tok_s", "decode_roofline_fraction", "warmup_ms"):
        assert doc[k] > 0, (k, doc)
    # the weights are packed by a warm-up token before rep 1 (not inside it), and the user is told
    assert "warm-up:" in r.stderr and r.stderr.index("warm-up:") < r.stderr.index("rep 1:"), r.stderr
    assert doc["threads"] == 1 and doc["reps"] == 1 and doc["isa"] in ("scalar", "avx2", "avx512")
    # the roofline is bandwidth / bytes per token, and the fraction is decode over it
    assert abs(doc["decode_roofline_tok_s"] - doc["bandwidth_gb_s"] * 1e9 / doc["weight_bytes_per_token"]) \
        < 0.01 * doc["decode_roofline_tok_s"], doc
    assert abs(doc["decode_roofline_fraction"] - doc["decode_tok_s"] / doc["decode_roofline_tok_s"]) < 0.01, doc
    # Q4_1 weights of a 135M-parameter model: between 50 and 200 MB read per token
    assert 50e6 < doc["weight_bytes_per_token"] < 200e6, doc
    for line in ("prefill 128 tokens", "prefill 512 tokens", "decode batch 1", "memory bandwidth", "decode roofline"):
        assert line in r.stdout, r.stdout


def test_bench_prefix(baton_bin, default_model):
    """`baton bench --prefix N`: the second prompt finds the first's N shared tokens in the prefix cache (the warm-up
    token before the cold prompt is never cached, so the cold prompt finds none)."""
    r = run([baton_bin, "bench", "--model", default_model, "--prefix", "256", "--reps", "1", "--threads", "1"])
    m = re.search(r"prefix cache: 256 shared \+ 32 new tokens: TTFT cold ([\d.]+) ms, warm ([\d.]+) ms "
                  r"\((\d+) tokens cached\)", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0 and int(m.group(3)) == 256, r.stdout


def test_tokenize_pieces(baton_bin, default_model):
    text = "Hello, world! The pieces add up."
    ids = [int(t) for t in run([baton_bin, "tokenize", "--model", default_model, text]).stdout.split()]
    lines = run([baton_bin, "tokenize", "--model", default_model, "--pieces", text]).stdout.splitlines()
    assert len(lines) == len(ids) > 3
    got_ids, pieces = [], []
    for line in lines:
        i, piece = line.split("\t")
        got_ids.append(int(i))
        pieces.append(json.loads(piece))
    assert got_ids == ids
    assert "".join(pieces) == text
    # a multi-byte character split over tokens shows as U+FFFD pieces, never as broken bytes
    lines = run([baton_bin, "tokenize", "--model", default_model, "--pieces", "東京"]).stdout.splitlines()
    assert all(isinstance(json.loads(line.split("\t")[1]), str) for line in lines) and len(lines) >= 2
