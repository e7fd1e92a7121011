#!/usr/bin/env bash
# The serving stage of scripts/gpu-check: the real worker binaries on --device cuda, started
# by `tandem up` on the given model, driven by tandem-loadtest. Cases:
#   agg        aggregated worker, 32 concurrent requests (continuous batching), in the default
#              precision (bf16x2 with an f16 KV cache: the start-up line must say so)
#   pressure   a small KV pool (kv_cache_config.max_tokens 12288), max_num_tokens 512 and the
#              MAX_UTILIZATION policy: chunked prefill and preemption (counted by the worker's
#              metrics, must be > 0) under 32 concurrent requests of up to 1k tokens
#              (the router's busy thresholds lifted and its queue off, so that the engine,
#              not the router, meets the pressure)
#   cancel     streams cut by the client mid-generation, then the worker still serves a
#              normal load, and once idle no KV block stays referenced (worker metrics)
#   disagg     a CUDA prefill worker pushing KV GPU to GPU over UCX into a CUDA decode worker
#              (TANDEM_GPU_KV_TRANSPORT, default ucx: the CUDA-enabled UCX must be in
#              LD_LIBRARY_PATH, as gpu-check sets it), with the router enforcing disaggregation;
#              then the same over TCP (host staging) as the comparison
#   f16        the agg and disagg topologies again with --cuda-precision f16 (f16 weights,
#              GEMM inputs and KV cache: the f16 blocks cross the transport too)
#   bf16       disagg with --cuda-precision bf16 (the fastest precision: bf16 GEMM inputs and
#              KV cache)
# Usage: serve_check.sh BIN_DIR MODEL_DIR OUT_DIR. Exit status non-zero when a case fails.
set -uo pipefail
BIN=$1
MODEL=$2
OUT=$3
. "$(dirname "$0")/serve_lib.sh"

load() { # name, loadtest args...
    local name=$1; shift
    "$BIN/tandem-loadtest" --url "$URL" --wait-for-model 300 --quiet --out "$OUT/load_$name" "$@" \
        > "$OUT/load_$name.txt" 2>&1
    python3 - "$OUT/load_$name/report.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["summary"]
ok = r["failed"] == 0 and r["succeeded"] == r["requests"] > 0
print(f"{sys.argv[2]}: {r['succeeded']}/{r['requests']} ok, {r['output_token_throughput']:.0f} out tok/s, "
      f"TTFT p50 {r['ttft_ms']['p50']:.1f} ms, ITL p50 {r['itl_ms']['p50']:.2f} ms, errors {r['errors']}")
sys.exit(0 if ok else 1)
PY
}

# agg: continuous batching on one CUDA worker, in the default precision.
kv_f16_mode() { sed 's/\x1b\[[0-9;]*m//g' "$OUT/serve_$1.log" | grep -c 'CUDA backend ready.*mode=Bf16Split.*kv_dtype=f16' > /dev/null; }
up agg --topology agg
load agg --num-requests 256 --concurrency 32 --isl uniform:64:1024 --osl 64 --vocab-hi 150000
rc=$?
stop
kv_f16_mode agg || { echo "agg: no worker reported mode=Bf16Split with kv_dtype=f16 (the default)"; rc=1; }
case_result agg $rc

# pressure: chunked prefill + preemption.
METRICS=http://127.0.0.1:18091/metrics
up pressure --topology agg --worker-arg=--system-port --worker-arg=18091 \
    --worker-arg=--max-num-tokens --worker-arg=512 \
    --worker-arg=--override-engine-args \
    --worker-arg='{"kv_cache_config":{"max_tokens":12288},"scheduler_config":{"capacity_scheduler_policy":"MAX_UTILIZATION"}}' \
    --router-arg=--active-decode-blocks-threshold --router-arg=1000 \
    --router-arg=--active-prefill-tokens-threshold-frac --router-arg=1000 \
    --router-arg=--router-queue-threshold --router-arg=none
load pressure --num-requests 128 --concurrency 32 --isl uniform:256:1024 --osl 128 --vocab-hi 150000
rc=$?
curl -s "$METRICS" | grep -E '^dynamo_component_(preemptions_total|kv_cache_active_blocks)' \
    | tee "$OUT/pressure_metrics.txt"
# MAX_UTILIZATION admits more than the pool holds to completion: it must have preempted.
preempted=$(awk '/^dynamo_component_preemptions_total/ {s += $2} END {print s + 0}' "$OUT/pressure_metrics.txt")
echo "pressure: preemptions $preempted"
[ "${preempted%.*}" -gt 0 ] || rc=1
case_result pressure $rc

# cancel (same topology): cut streams, then a normal request must still complete.
rc=0
name=$(curl -s "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
for i in $(seq 1 8); do
    curl -sN --max-time 0.5 "$URL/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$name\",\"prompt\":[$(seq -s, 100 900)],\"max_tokens\":4000,\"stream\":true,\"ignore_eos\":true}" \
        > /dev/null 2>&1
done
load cancel_after --num-requests 32 --concurrency 8 --isl 512 --osl 32 --vocab-hi 150000 || rc=1
# Idle again: no KV block may stay referenced (cut streams release theirs).
active=-1
for _ in $(seq 1 50); do
    active=$(curl -s "$METRICS" | awk '/^dynamo_component_kv_cache_active_blocks/ {s += $2} END {print s + 0}')
    [ "$active" = 0 ] && break
    sleep 0.2
done
echo "cancel: referenced KV blocks when idle: $active"
[ "$active" = 0 ] || rc=1
case_result cancel $rc
stop

# disagg: CUDA prefill → CUDA decode, GPU to GPU over UCX, router enforcing disaggregation;
# then over TCP (host staging), the comparison.
KV=${TANDEM_GPU_KV_TRANSPORT:-ucx}
up disagg --topology disagg --kv-transport "$KV" --router-arg=--enforce-disagg
load disagg --num-requests 128 --concurrency 16 --isl uniform:256:1024 --osl 64 --vocab-hi 150000
case_result disagg $?
stop
up disagg_tcp --topology disagg --kv-transport tcp --router-arg=--enforce-disagg
load disagg_tcp --num-requests 128 --concurrency 16 --isl uniform:256:1024 --osl 64 --vocab-hi 150000
case_result disagg_tcp $?
stop

# f16: the f16 precision through the same worker paths, aggregated then disaggregated; the
# workers' start-up line must name it (a flag that went unheard would pass the loads).
# (grep reads the whole stream: with -q it would stop at the first match and, under pipefail,
# sed's SIGPIPE would fail the check.)
f16_mode() { sed 's/\x1b\[[0-9;]*m//g' "$OUT/serve_$1.log" | grep -c 'CUDA backend ready.*mode=F16' > /dev/null; }
up agg_f16 --topology agg --worker-arg=--cuda-precision --worker-arg=f16
load agg_f16 --num-requests 128 --concurrency 32 --isl uniform:64:1024 --osl 64 --vocab-hi 150000
rc=$?
stop
f16_mode agg_f16 || { echo "agg_f16: no worker reported mode=F16"; rc=1; }
up disagg_f16 --topology disagg --kv-transport "$KV" --router-arg=--enforce-disagg \
    --worker-arg=--cuda-precision --worker-arg=f16
load disagg_f16 --num-requests 64 --concurrency 16 --isl uniform:256:1024 --osl 64 --vocab-hi 150000 || rc=1
stop
f16_mode disagg_f16 || { echo "disagg_f16: no worker reported mode=F16"; rc=1; }
case_result f16 $rc

# bf16: bf16 GEMM inputs and a bf16 KV cache, disaggregated: its bf16 blocks cross the
# transport between two such workers.
bf16_mode() { sed 's/\x1b\[[0-9;]*m//g' "$OUT/serve_$1.log" | grep -c 'CUDA backend ready.*mode=Bf16 .*kv_dtype=bf16' > /dev/null; }
up disagg_bf16 --topology disagg --kv-transport "$KV" --router-arg=--enforce-disagg \
    --worker-arg=--cuda-precision --worker-arg=bf16
load disagg_bf16 --num-requests 32 --concurrency 8 --isl uniform:256:1024 --osl 32 --vocab-hi 150000
rc=$?
stop
bf16_mode disagg_bf16 || { echo "disagg_bf16: no worker reported mode=Bf16 with kv_dtype=bf16"; rc=1; }
case_result bf16 $rc

echo "serve_check: $fails case(s) failed"
[ "$fails" -eq 0 ]
