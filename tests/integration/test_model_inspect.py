"""`baton model inspect` against gguf-py's independent reader, and clear errors on bad files."""
import re
import subprocess

import gguf


def run(baton_bin, *args):
    return subprocess.run([str(baton_bin), *args], capture_output=True, text=True, timeout=60)


def test_inspect_matches_gguf_py(baton_bin, default_model):
    out = run(baton_bin, "model", "inspect", str(default_model))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"architecture\s+llama", text)
    assert re.search(r"blocks\s+30\n", text)
    assert re.search(r"embedding\s+576\n", text)
    assert re.search(r"heads\s+9\n", text)
    assert re.search(r"kv heads\s+3\n", text)
    assert re.search(r"vocab\s+49152\n", text)
    assert "Q4_1 x210" in text and "Q8_0 x1" in text

    reader = gguf.GGUFReader(str(default_model))
    rows = {}
    for line in text.split("\ntensors:\n", 1)[1].splitlines()[1:]:
        parts = line.split()
        # "#  name  type  d0 x d1 ...  bytes  offset"
        idx, name, typ = parts[0], parts[1], parts[2]
        dims = [int(p) for p in parts[3:-2] if p != "x"]
        rows[name] = (typ, dims, int(parts[-2]), int(parts[-1]))
    assert len(rows) == len(reader.tensors) == 272
    for t in reader.tensors:
        typ, dims, nbytes, offset = rows[t.name]
        assert typ == t.tensor_type.name, t.name
        assert dims == [int(d) for d in t.shape], t.name
        assert nbytes == int(t.n_bytes), t.name
        assert offset == int(t.data_offset) - int(reader.data_offset), t.name


def test_inspect_bad_files(baton_bin, tmp_path, default_model):
    missing = run(baton_bin, "model", "inspect", str(tmp_path / "nope.gguf"))
    assert missing.returncode != 0
    assert "nope.gguf" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

    head = default_model.read_bytes()[:5_000_000]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    res = run(baton_bin, "model", "inspect", str(cut))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "extends past the end" in lines[0], res.stderr

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    res = run(baton_bin, "model", "inspect", str(junk))
    assert res.returncode == 1 and "version" in res.stderr


def test_cli_usage_errors(baton_bin):
    assert run(baton_bin).returncode == 2
    assert run(baton_bin, "no-such-command").returncode == 2
    helped = run(baton_bin, "--help")
    assert helped.returncode == 0 and "model" in helped.stdout
    assert run(baton_bin, "model", "inspect", "--bogus").returncode == 2
