#!/bin/sh
# Prepares the folder that tools/gpu-check.sh runs from on a bare GPU machine (no toolkit, no registry): the CUDA
# test binary (op tests, forward-pass and invariance checks, --bench; it writes its tiny models itself with baton's
# GGUF writer), libbaton_cuda.so (cudart linked statically: the machine needs only the NVIDIA driver, R580+ for the
# CUDA 13 runtime), the default model's first 4 layers and the check script. About 50 MiB, inside the device
# tool's 64 MiB carry limit.
#   tools/gpu-check-prepare.sh [BUILD_DIR (build)] [CARRY_DIR (build-cuda)]
set -eu
build=${1:-build}
carry=${2:-build-cuda}
for f in "$build/bin/test_backend_cuda" "$build/lib/libbaton_cuda.so"; do
    if [ ! -f "$f" ]; then
        echo "gpu-check-prepare: $f missing: build with nvcc present (make build; CMake option BATON_CUDA=AUTO/ON)" >&2
        exit 1
    fi
done
rm -rf "$carry"
mkdir -p "$carry"
cp "$build/bin/test_backend_cuda" "$build/lib/libbaton_cuda.so" tools/gpu-check.sh "$carry/"
# the default model's first 4 layers (about 40 MB): the forward-pass check on real weights and text
if model=$("$build/bin/baton" model path 2>/dev/null) && [ -f "$model" ]; then
    "$build/bin/baton" model slice "$model" --layers 0-3 --out "$carry/model.gguf" >/dev/null
else
    echo "gpu-check-prepare: no default model here (make setup fetches it): the real-model check will not run" >&2
fi
git rev-parse HEAD >"$carry/commit.txt" 2>/dev/null || echo unknown >"$carry/commit.txt"
du -sh "$carry"
echo "gpu-check-prepare: run there: $carry/gpu-check.sh   (results under \$OUT, default ./gpu-check-out)"
