"""The CUDA backend stays out of every binary (engine/backend_cuda.c, engine/cuda; issue 24): no program links a CUDA
library, the plugin links cudart statically and needs nothing but libc, and asking for a GPU where none is gives one
line and a non-zero exit, not a crash. Runs on machines without a GPU; the GPU itself is tools/gpu-check.sh's."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from harness.baton_procs import bin_path

PROGRAMS = ["baton", "baton-router", "baton-prefill", "baton-decode"]
CUDA_LIBS = re.compile(r"libcuda|libcudart|libnccl|libcublas|libnvrtc")


def needed(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


@pytest.mark.parametrize("prog", PROGRAMS)
def test_programs_link_no_cuda_library(prog):
    libs = needed(bin_path(prog))
    assert not [lib for lib in libs if CUDA_LIBS.search(lib)], libs


def plugin_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(bin_path("baton"))), "lib", "libbaton_cuda.so")


def test_plugin_needs_only_libc():
    path = plugin_path()
    if not os.path.exists(path):
        pytest.skip("no CUDA plugin in this build (no nvcc)")
    libs = needed(path)
    assert set(libs) <= {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                         "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}, libs
    syms = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in syms.splitlines() if " T " in line)
    assert exported == ["bt_cuda_plugin_create", "bt_cuda_plugin_mma_tflops"], exported


def gpu_present() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.startswith("GPU ")
    except FileNotFoundError:
        return False


def test_generate_on_cuda_without_gpu_says_why(baton_bin):
    if gpu_present():
        pytest.skip("a GPU is here: tools/gpu-check.sh covers it")
    res = subprocess.run([str(baton_bin), "generate", "--device", "cuda:0", "--prompt", "hi", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("baton generate: cuda: "), res.stderr
