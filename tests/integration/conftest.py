"""Shared pytest fixtures: where the built binaries and the default model are."""
import os
import pathlib
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

from harness.etcd import etcd_server  # noqa: E402,F401  (fixture: a throwaway etcd per test)
