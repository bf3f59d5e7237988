"""Real chat templates for the interpreter's tests, fetched from PyPI and cached (not committed: third-party files).

The llama-cpp-python sdist vendors llama.cpp's models/templates/*.jinja, the templates of many model families as
their tokenizer_config.json ship them. The sdist is pinned by version and sha256; its templates are unpacked once
into ${XDG_CACHE_HOME:-~/.cache}/baton/chat-templates/<version>/. Run as a script to fetch and print the folder.
"""
import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBER_DIR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/templates/"


def cache_dir() -> pathlib.Path:
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return cache / "baton" / "chat-templates" / f"{PACKAGE}-{VERSION}"


def fetch() -> pathlib.Path:
    """The folder of *.jinja files; downloads and unpacks them on first use. Raises RuntimeError when it cannot."""
    dest = cache_dir()
    stamp = dest / ".complete"
    if stamp.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        sdists = list(pathlib.Path(tmp).glob("*.tar.gz"))
        if r.returncode != 0 or len(sdists) != 1:
            raise RuntimeError(f"cannot download {PACKAGE}=={VERSION} from PyPI: {r.stderr.strip()[-500:]}")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{sdists[0].name} has sha256 {digest}, expected {SHA256}")
        out = pathlib.Path(tmp) / "templates"
        out.mkdir()
        with tarfile.open(sdists[0]) as tar:
            for m in tar.getmembers():
                name = m.name[len(MEMBER_DIR):]
                if m.isfile() and m.name.startswith(MEMBER_DIR) and name.endswith(".jinja") and "/" not in name:
                    (out / name).write_bytes(tar.extractfile(m).read())
        if not any(out.iterdir()):
            raise RuntimeError(f"{sdists[0].name} has no {MEMBER_DIR}*.jinja")
        (out / ".complete").write_text(f"{PACKAGE}=={VERSION} sha256:{SHA256}\n")
        if dest.exists():
            for f in dest.iterdir():
                f.unlink()
            dest.rmdir()
        out.rename(dest)
    return dest


if __name__ == "__main__":
    print(fetch())
