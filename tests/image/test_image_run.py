"""The CPU image deploy/Dockerfile builds (issue 21.1), run here: `make test-image` builds it with podman
(deploy/image/build-local.sh) and this file runs its programs from the image's own root file system.

podman builds images on this machine but cannot start containers: crun fails with "setrlimit RLIMIT_NPROC:
Operation not permitted" (the session lacks CAP_SYS_RESOURCE) and, without rlimits, "cgroups in hybrid mode not
supported". So each program runs the way the container would run it, minus the runtime: in a private mount
namespace, chrooted into the mounted image (`podman image mount`), as uid:gid 10001:10001, with /proc, /dev and a
tmpfs /tmp mounted and the model bind-mounted at /mnt (the image has no /models: Kubernetes creates mount points itself); the network is the host's (etcd from the test harness).

BATON_IMAGE names another image (default localhost/baton:0.1.0)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
import urllib.request

import pytest

from harness.baton_procs import start_proc
from harness.etcd import EtcdServer

IMAGE = os.environ.get("BATON_IMAGE", "localhost/baton:0.1.0")
PROGRAMS = ["baton", "baton-router", "baton-prefill", "baton-decode"]
JAIL = ('mount -t proc proc "$R/proc" && mount --rbind /dev "$R/dev" && mount -t tmpfs tmpfs "$R/tmp" && '
        'mount --bind "$M" "$R/mnt" && exec chroot --userspec=10001:10001 "$R" "$@"')


@pytest.fixture(scope="module")
def image_root():
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode:
        pytest.fail(f"{IMAGE} is not built: run deploy/image/build-local.sh (make test-image does)")
    root = subprocess.run(["podman", "image", "mount", IMAGE], capture_output=True, text=True, check=True).stdout.strip()
    yield pathlib.Path(root)
    subprocess.run(["podman", "image", "unmount", IMAGE], capture_output=True)


def jailed(root, model_dir, *argv):
    """argv for running argv[0] inside the image (see the module docstring)."""
    return ["unshare", "-m", "--", "sh", "-c", JAIL, "jail", *argv], {"R": str(root), "M": str(model_dir)}


def run_in(root, model_dir, *argv, timeout=30):
    cmd, env = jailed(root, model_dir, *argv)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


def test_image_layout(image_root):
    info = json.loads(subprocess.run(["podman", "image", "inspect", IMAGE], capture_output=True, text=True,
                                     check=True).stdout)[0]
    assert info["Config"]["User"] == "10001:10001"
    print(f"\n{IMAGE}: {info['Size'] / 1e6:.0f} MB, user {info['Config']['User']}")
    for p in PROGRAMS:
        assert (image_root / "usr/local/bin" / p).is_file(), p
    assert "VERSION_ID=\"12\"" in (image_root / "etc/os-release").read_text()
    for tool in ("cc", "gcc", "c++", "clang", "cmake", "make", "ld", "as", "nvcc"):
        for d in ("usr/bin", "usr/local/bin", "bin"):
            assert not (image_root / d / tool).exists(), f"/{d}/{tool} is in the runtime image"
    models = [str(p) for p in image_root.rglob("*.gguf")]
    assert not models, models


@pytest.mark.parametrize("prog", PROGRAMS)
def test_programs_start_inside_the_image(image_root, tmp_path, prog):
    r = run_in(image_root, tmp_path, prog, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "usage" in (r.stdout + r.stderr).lower()


def test_image_serves_a_completion_and_drains(image_root, default_model):
    model_dir = pathlib.Path(default_model).parent
    model = "/mnt/" + pathlib.Path(default_model).name
    with EtcdServer() as etcd:
        common = ["--model", model, "--etcd", etcd.endpoint]
        dcmd, denv = jailed(image_root, model_dir, "baton-decode", *common, "--node-id", "img-dec", "--threads", "1",
                            "--grpc-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0")
        with start_proc("/usr/bin/unshare", dcmd[1:], name="image-decode", env=denv) as dec:
            rcmd, renv = jailed(image_root, model_dir, "baton-router", *common, "--grpc-listen", "127.0.0.1:0",
                                "--http-listen", "127.0.0.1:0")
            with start_proc("/usr/bin/unshare", rcmd[1:], name="image-router", env=renv) as rtr:
                deadline = time.monotonic() + 20
                while rtr.http("/ready")[0] != 200:
                    assert time.monotonic() < deadline, rtr.http("/ready")
                    time.sleep(0.1)
                body = json.dumps({"model": "", "prompt": "The capital of France is", "max_tokens": 8,
                                   "temperature": 0}).encode()
                req = urllib.request.Request(f"http://{rtr.http_addr}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    out = json.loads(r.read())
                assert out["usage"]["completion_tokens"] == 8, out
                print(f"\nserved from the image: {out['choices'][0]['text']!r}")
                assert dec.stop() == 0, dec.log()[-2000:]
                deadline = time.monotonic() + 10
                while rtr.http("/ready")[0] != 503:
                    assert time.monotonic() < deadline, "router still ready after its only decode node left"
                    time.sleep(0.1)
                assert rtr.stop() == 0, rtr.log()[-2000:]
