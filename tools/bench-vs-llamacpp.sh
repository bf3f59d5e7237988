#!/usr/bin/env bash
# baton against llama.cpp on the same GGUF, the same threads, alternated runs, medians (issue 19's targets).
#
#   tools/bench-vs-llamacpp.sh [--model PATH] [--threads N] [--reps N] [--llama-dir DIR] [--concurrency 16,64]
#                              [--isa native|avx2|avx2-vnni]
#   tools/bench-vs-llamacpp.sh --build-only [--llama-dir DIR] [--isa native|avx2|avx2-vnni]   (chat-vs-llamacpp.py)
#
# llama.cpp's tools come from DIR (default $XDG_CACHE_HOME/baton/llama.cpp): DIR/build/bin/llama-bench,
# llama-batched-bench and llama-completion (for tools/chat-vs-llamacpp.py). When one is missing the script builds
# them from the llama-cpp-python sdist on PyPI (its vendor/llama.cpp; GGML_NATIVE, Release): minutes on 2 cores, once.
# --isa avx2 compares the two AVX2 paths on a host that has more: baton with BATON_CPU_ISA=avx2 against a llama.cpp
# built for AVX2, FMA and F16C only (GGML_NATIVE off, in DIR-avx2 unless --llama-dir is given). --isa avx2-vnni does
# the same with AVX-VNNI on both sides (BATON_CPU_ISA=avx2-vnni, GGML_AVX_VNNI; DIR-avx2-vnni): an AVX2 + AVX-VNNI
# CPU without AVX-512 (Intel Xeon 6 E-cores), rehearsed on a host that has more.
#
# Each repetition runs, in this order: baton bench (prefill 512, decode batch 1), llama-bench (-p 512 -n 64), baton
# bench --concurrency LIST, llama-batched-bench (-npp 128 -ntg 32 -npl LIST). Prints the medians and the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."

model="" threads=2 reps=3 conc="16,64" build_only=0 isa=native src_from=""
dir="${XDG_CACHE_HOME:-$HOME/.cache}/baton/llama.cpp" dir_given=0
while [ $# -gt 0 ]; do
    case "$1" in
    --model) model="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --reps) reps="$2"; shift 2 ;;
    --llama-dir) dir="$2"; dir_given=1; shift 2 ;;
    --concurrency) conc="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --isa) isa="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-vs-llamacpp: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$isa" in
native) isa_flags=(-DGGML_NATIVE=ON) ;;
avx2)
    grep -qw avx2 /proc/cpuinfo || { echo "bench-vs-llamacpp: this CPU has no AVX2" >&2; exit 1; }
    [ "$dir_given" = 1 ] || { src_from="$dir/src"; dir="$dir-avx2"; }
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF)
    export BATON_CPU_ISA=avx2 ;;
avx2-vnni)
    grep -qw avx_vnni /proc/cpuinfo || { echo "bench-vs-llamacpp: this CPU has no AVX-VNNI" >&2; exit 1; }
    [ "$dir_given" = 1 ] || { src_from="$dir/src"; dir="$dir-avx2-vnni"; }
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DGGML_AVX512=OFF)
    export BATON_CPU_ISA=avx2-vnni ;;
*) echo "bench-vs-llamacpp: --isa takes native, avx2 or avx2-vnni, not '$isa'" >&2; exit 2 ;;
esac
baton="${BATON_BUILD_DIR:-build}/bin/baton"

build_llama() {
    mkdir -p "$dir"
    # the AVX2 build shares the native build's sources when those were fetched already
    if [ ! -d "$dir/src" ] && [ -n "$src_from" ] && [ -d "$src_from" ]; then
        ln -s "$(cd "$src_from" && pwd -P)" "$dir/src"
    fi
    if [ ! -d "$dir/src" ]; then
        echo "fetching the llama-cpp-python sdist from PyPI ..." >&2
        python3 - "$dir" <<'EOF'
import json, sys, tarfile, urllib.parse, urllib.request, io, os
d = sys.argv[1]
meta_url = "https://pypi.org/pypi/llama-cpp-python/json"
meta = json.load(urllib.request.urlopen(meta_url, timeout=60))
sd = [u for u in meta["urls"] if u["packagetype"] == "sdist"][0]
url = urllib.parse.urljoin(meta_url, sd["url"])
data = urllib.request.urlopen(url, timeout=600).read()
with tarfile.open(fileobj=io.BytesIO(data)) as t:
    root = t.getnames()[0].split("/")[0]
    t.extractall(d, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(d)
os.symlink(os.path.join(root, "vendor", "llama.cpp"), os.path.join(d, "src"))
print(f"llama-cpp-python {meta['info']['version']}", file=sys.stderr)
EOF
    fi
    echo "building llama-bench and llama-batched-bench in $dir/build ..." >&2
    # AMX off: baton has no AMX path (so both sides use the same dot instructions), and ggml's AMX matmul crashes on
    # VMs whose kernel does not grant the AMX tile state
    local noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    grep -q ' amx' /proc/cpuinfo 2>/dev/null || noamx=""
    cmake -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
        "-DCMAKE_C_FLAGS=$noamx" "-DCMAKE_CXX_FLAGS=$noamx" >/dev/null
    # the compilers' output (thousands of warning lines from ggml's intrinsics) goes to a log, shown on failure
    if ! cmake --build "$dir/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-completion \
        >"$dir/build.log" 2>&1; then
        tail -n 40 "$dir/build.log" >&2
        echo "bench-vs-llamacpp: building llama.cpp failed (whole log: $dir/build.log)" >&2
        return 1
    fi
    echo "built llama.cpp's tools (compiler output: $dir/build.log)" >&2
}
lb="$dir/build/bin/llama-bench" lbb="$dir/build/bin/llama-batched-bench" lc="$dir/build/bin/llama-completion"
[ -x "$lb" ] && [ -x "$lbb" ] && [ -x "$lc" ] || build_llama
[ "$build_only" = 1 ] && { echo "$dir/build/bin"; exit 0; }
[ -x "$baton" ] || { echo "bench-vs-llamacpp: $baton not built (make build)" >&2; exit 1; }
[ -n "$model" ] || model="$("$baton" model path)"
[ -r "$model" ] || { echo "bench-vs-llamacpp: model $model not readable (baton model fetch)" >&2; exit 1; }

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$reps"); do
    echo "repetition $r of $reps" >&2
    "$baton" bench --model "$model" --threads "$threads" --reps 1 --decode-tokens 64 >"$out/baton.$r" 2>/dev/null
    "$lb" -m "$model" -t "$threads" -p 512 -n 64 -r 1 -o json >"$out/llama.$r" 2>/dev/null
    "$baton" bench --model "$model" --threads "$threads" --reps 1 --decode-tokens 32 --concurrency "$conc" \
        >"$out/batonc.$r" 2>/dev/null
    "$lbb" -m "$model" -t "$threads" -c 16384 -b 2048 -ub 512 -npp 128 -ntg 32 -npl "$conc" \
        >"$out/llamac.$r" 2>/dev/null
done

python3 - "$out" "$reps" "$conc" "$model" "$threads" "$isa" <<'EOF'
import json, re, statistics, sys
out, reps, conc, model, threads, isa = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], sys.argv[4], sys.argv[5], sys.argv[6]
def read(name, r):
    return open(f"{out}/{name}.{r}").read()
b_pre, b_dec, l_pre, l_dec = [], [], [], []
b_agg = {n: [] for n in conc}
l_agg = {n: [] for n in conc}
# fractions of the roofline each run printed, then their median: a run's bandwidth and its decode speed were
# measured together (taking the last run's roofline for every run's speed mixed two moments of a noisy host)
frac_b1, frac = [], {n: [] for n in conc}
for r in range(1, reps + 1):
    t = read("baton", r)
    b_pre.append(float(re.search(r"prefill 512 tokens\s+([\d.]+)", t).group(1)))
    b_dec.append(float(re.search(r"decode batch 1\s+([\d.]+)", t).group(1)))
    frac_b1.append(b_dec[-1] / float(re.search(r"decode roofline\s+([\d.]+)", t).group(1)))
    for row in json.loads(read("llama", r)):
        (l_pre if row["n_prompt"] > 0 else l_dec).append(row["avg_ts"])
    for line in read("batonc", r).splitlines():
        m = re.match(r"\s*(\d+)\s+[\d.]+\s+([\d.]+)\s+\S+\s+\S+\s+([\d.]+)", line)
        if m and int(m.group(1)) in b_agg:
            b_agg[int(m.group(1))].append(float(m.group(2)))
            frac[int(m.group(1))].append(float(m.group(2)) / float(m.group(3)))
    for line in read("llamac", r).splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) >= 10 and cols[2].isdigit() and int(cols[2]) in l_agg:
            l_agg[int(cols[2])].append(float(cols[7]))  # S_TG t/s: aggregate generation tokens per second
med = statistics.median
kernels = re.search(r"^kernels\s+(\S+)", read("baton", 1), re.M)
print(f"model {model}, {threads} threads, medians of {reps} alternated runs; baton's kernels: "
      f"{kernels.group(1).rstrip(',') if kernels else '?'}; llama.cpp built for: {isa}")
print(f"{'figure':34s} {'baton':>10s} {'llama.cpp':>10s} {'ratio':>7s}")
def row(name, b, l):
    print(f"{name:34s} {med(b):10.1f} {med(l):10.1f} {med(b) / med(l):6.2f}x")
row("prefill 512 (tok/s)", b_pre, l_pre)
row("decode batch 1 (tok/s)", b_dec, l_dec)
print(f"{'decode batch 1, % of memory roofline':34s} {100 * med(frac_b1):9.0f}%")
for n in conc:
    if b_agg[n] and l_agg[n]:
        row(f"aggregate decode at {n} seqs (tok/s)", b_agg[n], l_agg[n])
        print(f"{f'  baton vs its roofline at {n}':34s} {100 * med(frac[n]):9.0f}%")
EOF
