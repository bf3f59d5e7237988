"""What the container images promise (deploy/Dockerfile, deploy/Dockerfile.cuda; issue 21.1), checked without a
container runtime, so it runs in `make test` everywhere:

- the runtime stage installs a Debian package for every shared library the four programs need (readelf NEEDED of
  the binaries built here, resolved with ldconfig and dpkg), so the slim image cannot miss one;
- the runtime stage has no compiler or -dev package and copies no model; it runs as a non-root user;
- the programs the chart's containers run as their command exist and answer --help.

The image itself is built and its files are run (as uid 10001, in a chroot of the image's root file system: this
machine's OCI runtime cannot start containers) by `make test-image` (tests/image/)."""
from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

from harness.baton_procs import bin_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAMS = ["baton", "baton-router", "baton-prefill", "baton-decode"]
BASE_PACKAGES = {"libc6", "libgcc-s1"}  # in every Debian image (Essential / libc's own dependencies)


def stages(dockerfile: pathlib.Path) -> list:
    """The Dockerfile's stages as lists of logical lines (continuations joined)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def apt_packages(stage: list) -> set:
    pkgs = set()
    for line in stage:
        for m in re.finditer(r"apt-get install ((?:-[-\w]+ )*)([^&]+)", line):
            pkgs |= {p for p in m.group(2).split() if not p.startswith("-")}
    return pkgs


def needed_packages() -> dict:
    """Debian package -> libraries of it that the programs need directly."""
    ldconfig = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    where = {}
    for line in ldconfig.splitlines():
        m = re.match(r"\s*(\S+) \((libc6,x86-64[^)]*)\) => (\S+)", line)
        if m:
            where.setdefault(m.group(1), m.group(3))
    out = {}
    for prog in PROGRAMS:
        dyn = subprocess.run(["readelf", "-d", bin_path(prog)], capture_output=True, text=True, check=True).stdout
        for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn):
            path = where.get(lib)
            assert path, f"{prog} needs {lib}, which ldconfig does not know"
            res = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
            if res.returncode:
                res = subprocess.run(["dpkg", "-S", "/usr" + path], capture_output=True, text=True)
            assert res.returncode == 0, f"no Debian package owns {path} ({lib})"
            pkg = res.stdout.split(":")[0]
            out.setdefault(pkg, set()).add(lib)
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_runtime_stage_has_every_library_and_nothing_to_build_with(name):
    st = stages(ROOT / "deploy" / name)
    assert len(st) == 2, "a build stage and a runtime stage"
    build, runtime = st
    runtime_pkgs = apt_packages(runtime)
    need = needed_packages()
    missing = {p: sorted(libs) for p, libs in need.items() if p not in runtime_pkgs | BASE_PACKAGES}
    assert not missing, f"{name}: the runtime stage lacks packages for {missing}"
    assert not {p for p in runtime_pkgs if p.endswith("-dev") or p in (
        "build-essential", "gcc", "clang", "cmake", "nvidia-cuda-toolkit")}, runtime_pkgs
    assert apt_packages(build) >= {"build-essential", "cmake", "libgrpc-dev", "libucx-dev"}
    body = "\n".join(runtime)
    assert re.search(r"^USER 10001:10001$", body, re.M), "the runtime stage must run as a non-root user"
    assert "gguf" not in body.lower() and "fetch-model" not in body, "no model inside the image"
    copies = [line for line in runtime if line.startswith("COPY")]
    assert copies == ["COPY --from=build /out/ /"], copies
    build_body = "\n".join(build)
    assert f"-DBATON_CUDA={'ON' if name.endswith('cuda') else 'OFF'}" in build_body
    assert all(p in build_body for p in PROGRAMS)
    print(f"\n{name}: runtime packages {sorted(runtime_pkgs)} cover {sum(map(len, need.values()))} libraries")


def test_dockerignore_keeps_builds_and_models_out_of_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pat in (".git", ".venv", "build", "build-*", "*.gguf"):
        assert pat in ignored, pat


@pytest.mark.parametrize("prog", PROGRAMS)
def test_programs_the_chart_runs_answer_help(prog):
    r = subprocess.run([bin_path(prog), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "usage" in (r.stdout + r.stderr).lower()
