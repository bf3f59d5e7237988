#!/usr/bin/env bash
# Disaggregated against colocated serving on one host (issue 8's report), at the same offered loads:
#   colocated:     one baton-decode on CPUs $COLO_CPUS (both cores), prefilling locally
#   disaggregated: baton-prefill pinned to $PREFILL_CPUS, baton-decode to $DECODE_CPUS, every prefill remote
# Each set-up gets the same `baton bench-serve` run (same seed: same arrivals and lengths); results go to $OUT.
# Usage: tools/bench-disagg.sh   (env: RATES REQUESTS PROMPT_TOKENS OUTPUT_TOKENS SLO_TTFT_MS SLO_TPOT_MS OUT
#                                 COLO_CPUS PREFILL_CPUS DECODE_CPUS BATON_BUILD_DIR; the cluster's BATON_RUN_DIR,
#                                 BATON_ETCD_LISTEN, BATON_HTTP_LISTEN, BATON_GRPC_LISTEN)
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin="${BATON_BUILD_DIR:-$top/build}/bin"
rates=${RATES:-0.1,0.25}
requests=${REQUESTS:-10}
prompt=${PROMPT_TOKENS:-512:128}
output=${OUTPUT_TOKENS:-128:32}
slo_ttft=${SLO_TTFT_MS:-5000}
slo_tpot=${SLO_TPOT_MS:-100}
out=${OUT:-/tmp/baton-bench-disagg}
mkdir -p "$out"
cluster="$top/deploy/local/cluster"

run_one() {
  local name=$1; shift
  echo "== $name: $*" >&2
  "$cluster" down >/dev/null 2>&1 || true
  "$cluster" up --detach "$@" >"$out/$name.up.log"
  "$bin/baton" bench-serve --url "http://${BATON_HTTP_LISTEN:-127.0.0.1:8000}" --rate "$rates" --requests "$requests" \
    --prompt-tokens "$prompt" --output-tokens "$output" --slo-ttft-ms "$slo_ttft" --slo-tpot-ms "$slo_tpot" --seed 1 --quiet \
    --json "$out/$name.json" | tee "$out/$name.txt"
  local run_dir="${BATON_RUN_DIR:-${XDG_RUNTIME_DIR:-/tmp}/baton-local}" f addr
  for f in "$run_dir"/prefill-*.log "$run_dir"/decode-*.log; do
    [ -e "$f" ] || continue
    addr=$(sed -n 's/.*listening grpc=[^ ]* http=\([^ ]*\).*/\1/p' "$f" | head -1)
    [ -n "$addr" ] && curl -fsS "http://$addr/metrics" >"$out/$name.$(basename "$f" .log).metrics" || true
  done
  if [ -e "$out/$name.prefill-1.metrics" ]; then
    # KV handoff (exposed tail after the last layer) beside the prefill time, per request, from the prefill node
    awk '/^baton_kv_transfer_seconds_(sum|count)/ { v[$1] = $2 } /^baton_prefill_seconds_(sum|count)/ { v[$1] = $2 }
         END { if (v["baton_kv_transfer_seconds_count"] > 0)
                 printf "prefill node: %d requests, mean prefill %.3f s, mean KV handoff after the last layer %.4f s\n",
                   v["baton_prefill_seconds_count"], v["baton_prefill_seconds_sum"] / v["baton_prefill_seconds_count"],
                   v["baton_kv_transfer_seconds_sum"] / v["baton_kv_transfer_seconds_count"] }' \
      "$out/$name.prefill-1.metrics" | tee -a "$out/$name.txt"
  fi
  "$cluster" down >/dev/null
}

trap '"$cluster" down >/dev/null 2>&1 || true' EXIT
run_one colocated --prefill 0 --decode 1 --decode-cpus "${COLO_CPUS:-0,1}"
run_one disaggregated --prefill 1 --decode 1 --prefill-cpus "${PREFILL_CPUS:-0}" --decode-cpus "${DECODE_CPUS:-1}" \
  --router-args "--prefill-mode remote"
echo "results: $out/{colocated,disaggregated}.{txt,json}" >&2
