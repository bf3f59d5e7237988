"""`baton generate` as a user runs it: the default model answers, seeded sampling repeats, bad input fails cleanly."""
import subprocess


def run(baton_bin, *args, timeout=120):
    return subprocess.run([str(baton_bin), *args], capture_output=True, text=True, timeout=timeout)


def test_capital_of_france(baton_bin, default_model):
    res = run(baton_bin, "generate", "--chat", "What is the capital of France?", "--max-tokens", "32")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "tok/s" in res.stderr


def test_seeded_sampling_is_reproducible(baton_bin, default_model):
    args = ("generate", "--prompt", "Once upon a time", "--max-tokens", "24", "--temperature", "0.9",
            "--top-p", "0.95", "--seed", "7", "--ids", "--quiet")
    a, b = run(baton_bin, *args), run(baton_bin, *args)
    assert a.returncode == 0 and a.stdout == b.stdout and len(a.stdout.split()) == 24
    c = run(baton_bin, *args[:-4], "--seed", "8", "--ids", "--quiet")
    assert c.returncode == 0 and c.stdout != a.stdout


def test_threads_do_not_change_greedy_output(baton_bin, default_model):
    base = ("generate", "--prompt", "The three primary colors are", "--max-tokens", "20", "--ids", "--quiet")
    one, two = run(baton_bin, *base, "--threads", "1"), run(baton_bin, *base, "--threads", "2")
    assert one.returncode == 0 and one.stdout == two.stdout


def one_error_line(res):
    lines = [l for l in res.stderr.strip().splitlines() if l]
    return res.returncode != 0 and len(lines) >= 1 and lines[0].startswith("baton generate:")


def test_bad_input(baton_bin, default_model, tmp_path):
    missing = run(baton_bin, "generate", "--model", str(tmp_path / "none.gguf"), "--prompt", "hi")
    assert one_error_line(missing) and "none.gguf" in missing.stderr

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(default_model.read_bytes()[:3_000_000])
    cut = run(baton_bin, "generate", "--model", str(bad), "--prompt", "hi")
    assert one_error_line(cut) and "extends past the end" in cut.stderr

    long_prompt = "word " * 9000
    over = run(baton_bin, "generate", "--prompt", long_prompt, "--max-tokens", "10")
    assert one_error_line(over) and "exceeds the context" in over.stderr

    assert run(baton_bin, "generate").returncode == 2
    assert run(baton_bin, "generate", "--prompt", "x", "--temperature", "-1").returncode == 2
    assert run(baton_bin, "generate", "--prompt", "x", "--bogus", "1").returncode == 2


def test_unsupported_architecture(baton_bin, tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = run(baton_bin, "generate", "--model", str(path), "--prompt", "hi")
    assert one_error_line(res) and "falcon" in res.stderr and "not supported" in res.stderr


def test_profile_logs_op_times_without_changing_output(baton_bin, default_model):
    """BATON_PROFILE=1 logs ms per step per op kind, for prompt steps and decode steps, and changes no token."""
    import os
    import re
    args = ("generate", "--prompt", "The three primary colors are", "--max-tokens", "12", "--ids")
    plain = run(baton_bin, *args)
    env = dict(os.environ, BATON_PROFILE="1")
    prof = subprocess.run([str(baton_bin), *args], capture_output=True, text=True, timeout=120, env=env)
    assert plain.returncode == 0 and prof.returncode == 0, prof.stderr
    assert prof.stdout == plain.stdout
    lines = {m.group(1): m.group(0) for m in re.finditer(r"profile of \d+ (decode|prefill) steps.*", prof.stderr)}
    assert set(lines) == {"decode", "prefill"}, prof.stderr
    decode = lines["decode"]
    assert re.search(r"profile of 11 decode steps \(1\.0 tokens/step\)", decode), decode
    total, wall = map(float, re.search(r"(\d+\.\d+) ms/step \(wall (\d+\.\d+)\)", decode).groups())
    assert wall >= total > 0, decode  # the whole forward pass holds every op's time
    times = dict(re.findall(r" (\w+) (\d+\.\d+)", decode.split(":", 1)[1]))
    for op in ("embed", "rmsnorm", "qkv", "rope", "kv_write", "attention", "wo", "gate_up", "swiglu", "down", "add",
               "output"):
        assert op in times, decode
    assert float(times["gate_up"]) > 0 and "profile" not in plain.stderr
