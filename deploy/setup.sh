#!/usr/bin/env bash
# One set-up for `make run` and `make test` (DESIGN 11): installs missing Debian packages, creates the Python
# venv for test clients and oracles, fetches the default model (and Gemma 3 270M for the gemma3 tests). Idempotent; a few seconds when all is present.
# Usage: deploy/setup.sh [--no-model]
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$top"
fetch_model=1
for a in "$@"; do
  case "$a" in
    --no-model) fetch_model=0 ;;
    -h|--help) echo "usage: deploy/setup.sh [--no-model]"; exit 0 ;;
    *) echo "setup: unknown option $a" >&2; exit 2 ;;
  esac
done
t0=$(date +%s)
step() { echo "setup: $*" >&2; }

# Debian packages: compilers and build tools, the chosen libraries, the real peers the tests run against.
pkgs=(build-essential cmake pkg-config clang libclang-rt-14-dev
      libgrpc-dev protobuf-c-compiler libprotobuf-c-dev protobuf-compiler
      libucx-dev ucx-utils libcurl4-openssl-dev libcjson-dev libmicrohttpd-dev
      etcd-server etcd-client prometheus python3 python3-venv python3-pip curl openssl valgrind procps iproute2
      gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then missing+=("$p"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
  step "installing Debian packages: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo=sudo
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  # Debian's prometheus package would start a server on :9090; only promtool is wanted.
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The etcd and prometheus packages enable system services; tests start their own throwaway instances.
  for svc in etcd prometheus; do $sudo systemctl disable --now "$svc" >/dev/null 2>&1 || true; done
else
  step "Debian packages present"
fi

# Python venv with the pinned test clients and oracles; a stamp of the requirements' hash makes re-runs instant.
venv="$top/.venv"
req="$top/tests/requirements.txt"
stamp="$venv/.baton-requirements.sha256"
want=$(sha256sum "$req" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  step "creating Python venv at .venv (pinned in tests/requirements.txt)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  echo "$want" > "$stamp"
else
  step "Python venv up to date"
fi

if [ "$fetch_model" = 1 ]; then
  model=$(BATON_PYTHON="$venv/bin/python" "$top/deploy/fetch-model.sh")
  step "default model: $model"
  # the second model family's tests (gemma3) need their file too; a CI machine starts with an empty cache
  model=$(BATON_PYTHON="$venv/bin/python" "$top/deploy/fetch-model.sh" --model gemma3-270m)
  step "gemma3 test model: $model"
fi
step "done in $(( $(date +%s) - t0 )) s"
