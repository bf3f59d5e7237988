#!/bin/sh
# The one GPU check of the CUDA backend (README "CUDA backend"), run on a lent GPU machine from the folder that
# tools/gpu-check-prepare.sh fills (or from a build tree: it finds bin/ and lib/ too). Within about 8 minutes:
#   1. every op of engine/cuda against the CPU scalar references, the forward pass against the CPU backend on tiny
#      models of 7 weight types and on the default model's first 4 layers (top-1 the same but for near ties), batch
#      invariance on the GPU                                                      -> $OUT/ops.txt
#   2. decode bandwidth at batch 1 over 1 GiB of weights per type, as a fraction of the measured device-to-device
#      copy bandwidth, the prefill rate at 512 rows, and the forward pass's speed on the sliced model (prefill 512,
#      decode of 1 and of 16 sequences) on the GPU and on the machine's CPU cores  -> $OUT/bench.txt
#   3. the machine (nvidia-smi), the commit tested and a one-screen verdict       -> $OUT/gpu.txt, $OUT/summary.txt
# Exit status 0 only when step 1 passed. $OUT defaults to ./gpu-check-out.
set -u
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
if [ -x "$here/test_backend_cuda" ]; then
    bin=$here/test_backend_cuda lib=$here/libbaton_cuda.so
else
    bin=$here/../build/bin/test_backend_cuda lib=$here/../build/lib/libbaton_cuda.so
fi
export BATON_CUDA_LIB="$lib"
export TMPDIR="${TMPDIR:-/tmp}"
[ -f "$here/model.gguf" ] && export BATON_TEST_MODEL="$here/model.gguf"
{
    date -u
    cat "$here/commit.txt" 2>/dev/null
    nvidia-smi 2>&1 | head -20
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
} >"$OUT/gpu.txt"

# each group in its own process with its own limit (380 s in all): a crash or a hung kernel in one leaves the rest
t0=$(date +%s)
ops_rc=0
: >"$OUT/ops.txt"
for g in embed:20 elementwise:20 matmul:80 attention:40 forward:80 invariance:20 model:60 scheduler:60; do
    name=${g%%:*} limit=${g##*:}
    echo "== $name (limit ${limit} s)" >>"$OUT/ops.txt"
    timeout "$limit" "$bin" "$name" >>"$OUT/ops.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc" >>"$OUT/ops.txt"
    if [ $rc = 77 ]; then ops_rc=77; break; fi
    if [ $rc != 0 ]; then ops_rc=1; fi
done
t1=$(date +%s)
timeout 90 "$bin" --bench >"$OUT/bench.txt" 2>&1
bench_rc=$?
# the forward pass end to end (the sliced model; GPU and this machine's CPU cores): prefill, decode of 1 and 16
timeout 120 "$bin" speed >>"$OUT/bench.txt" 2>&1 || bench_rc=$?
t2=$(date +%s)

{
    echo "gpu-check: $(head -1 "$OUT/gpu.txt")  commit $(cat "$here/commit.txt" 2>/dev/null || echo unknown)"
    grep -m1 "NVIDIA" "$OUT/gpu.txt"
    case $ops_rc in
    0) echo "ops, forward, invariance: PASS ($((t1 - t0)) s)" ;;
    77) echo "ops, forward, invariance: NOT RUN (no CUDA device): $(grep -m1 SKIP "$OUT/ops.txt")" ;;
    *) echo "ops, forward, invariance: FAIL" ;;
    esac
    grep -E "^== [a-z]+: exit|^(FAIL|ok  )|CHECK failed|REQUIRE failed" "$OUT/ops.txt" | head -60
    grep -E "^op " "$OUT/ops.txt"
    grep -E "^forward|^batch invariance|^scheduler" "$OUT/ops.txt"
    echo "bench (exit $bench_rc, $((t2 - t1)) s):"
    grep -E "^(bench|speed)" "$OUT/bench.txt"
} >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
exit $ops_rc
