#!/usr/bin/env bash
# The burst stage of scripts/gpu-check: one aggregated CUDA worker behind the router, default
# settings (the router's queue on, threshold 4.0), driven by tandem-loadtest at 256 and then
# 512 concurrent clients (ISL 512, OSL 512, 1,024 requests each, each run its own prompts). Every request must succeed:
# bursts wait in the router's queue rather than getting 503. Records the loadtest reports and
# the router's queue metrics, the worker's KV pool (blocks, GiB) and the engine thread's time
# per step outside the forward pass (the worker's tandem_engine_* counters over each run).
# Usage: burst_check.sh BIN_DIR MODEL_DIR OUT_DIR. Exit status non-zero when a case fails.
# TANDEM_BURST_WORKER_ARGS: extra worker arguments (space-separated; e.g.
# "--trtllm.kv_cache_config.dtype=fp8"); TANDEM_BURST_NAME names the run in the reports;
# TANDEM_BURST_CONCURRENCY: the client counts (default "256 512").
set -uo pipefail
BIN=$1
MODEL=$2
OUT=$3
. "$(dirname "$0")/serve_lib.sh"

run=burst${TANDEM_BURST_NAME:+_$TANDEM_BURST_NAME}
extra=()
for a in ${TANDEM_BURST_WORKER_ARGS:-}; do extra+=("--worker-arg=$a"); done
up "$run" --topology agg "${extra[@]}"
# The worker's status address, from `tandem up`'s line once it is ready (bounded wait).
wurl=
for _ in $(seq 1 600); do
    wurl=$(grep -v planner "$OUT/serve_$run.log" 2>/dev/null | grep -o '/metrics: http://[^)]*' | head -1 | sed 's|/metrics: ||')
    [ -n "$wurl" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
done
engine_counters() { # file: the worker's tandem_engine_* counters, once they stop moving
    local prev= cur=
    for _ in $(seq 1 20); do
        cur=$(curl -s "$wurl/metrics" | grep -E '^tandem_engine_(steps|step_microseconds|forward_microseconds|apply_microseconds|schedule_microseconds|between_steps_microseconds)_total')
        [ -n "$cur" ] && [ "$cur" = "$prev" ] && break
        prev=$cur
        sleep 0.6
    done
    echo "$cur" > "$1"
}
for c in ${TANDEM_BURST_CONCURRENCY:-256 512}; do
    name=${run}_c$c
    [ -n "$wurl" ] && engine_counters "$OUT/${name}_engine_before.txt"
    "$BIN/tandem-loadtest" --url "$URL" --wait-for-model 300 --quiet --out "$OUT/load_$name" \
        --num-requests 1024 --concurrency "$c" --isl 512 --osl 512 --vocab-hi 150000 --seed "$c" \
        > "$OUT/load_$name.txt" 2>&1
    curl -s "$URL/metrics" | grep -E '^(tandem_router_queue_wait_seconds_(sum|count)|dynamo_frontend_model_rejection_total)' \
        > "$OUT/${name}_router_metrics.txt"
    [ -n "$wurl" ] && engine_counters "$OUT/${name}_engine_after.txt"
    python3 - "$OUT/load_$name/report.json" "$name" "$OUT/${name}_router_metrics.txt" \
        "$OUT/${name}_engine_before.txt" "$OUT/${name}_engine_after.txt" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))["summary"]
def counters(path):
    m = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip():
                k, v = line.rsplit(" ", 1)
                m[k.split("{")[0]] = float(v)
    return m
m = counters(sys.argv[3])
b, a = counters(sys.argv[4]), counters(sys.argv[5])
d = {k: a[k] - b.get(k, 0.0) for k in a}
steps = d.get("tandem_engine_steps_total", 0)
if steps > 0:
    step, fwd = d["tandem_engine_step_microseconds_total"], d["tandem_engine_forward_microseconds_total"]
    print(f"{sys.argv[2]}: engine {steps:.0f} steps, {step / steps / 1e3:.2f} ms per step, of which "
          f"forward {fwd / steps / 1e3:.2f} ms and the engine thread's own {(step - fwd) / steps / 1e3:.3f} ms "
          f"({(step - fwd) / step:.1%}): apply {d.get('tandem_engine_apply_microseconds_total', 0) / steps / 1e3:.3f} ms, "
          f"schedule {d.get('tandem_engine_schedule_microseconds_total', 0) / steps / 1e3:.3f} ms, "
          f"other (inputs, plans) {(step - fwd - d.get('tandem_engine_apply_microseconds_total', 0) - d.get('tandem_engine_schedule_microseconds_total', 0)) / steps / 1e3:.3f} ms; "
          f"between steps {d.get('tandem_engine_between_steps_microseconds_total', 0) / steps / 1e3:.3f} ms")
s, n = m.get("tandem_router_queue_wait_seconds_sum", 0), m.get("tandem_router_queue_wait_seconds_count", 0)
ok = r["failed"] == 0 and r["succeeded"] == r["requests"] > 0
print(f"{sys.argv[2]}: {r['succeeded']}/{r['requests']} ok, {r['failed']} failed, "
      f"{r['output_token_throughput']:.0f} out tok/s, TTFT p50 {r['ttft_ms']['p50']:.0f} ms "
      f"p90 {r['ttft_ms'].get('p90', float('nan')):.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, "
      f"ITL p50 {r['itl_ms']['p50']:.2f} ms p99 {r['itl_ms'].get('p99', float('nan')):.2f} ms, "
      f"chunk gaps p50 {r.get('gap_ms', {}).get('p50', float('nan')):.2f} ms p99 {r.get('gap_ms', {}).get('p99', float('nan')):.2f} ms; queued (cumulative) {n:.0f}, mean wait {s / n if n else 0:.2f} s; "
      f"errors {r['errors']}")
sys.exit(0 if ok else 1)
PY
    case_result "$name" $?
done
stop
grep -h "CUDA backend ready" "$OUT/serve_$run.log" | sed 's/\x1b\[[0-9;]*m//g' > "$OUT/${run}_pool.txt"
echo "burst_check: $fails case(s) failed"
[ "$fails" -eq 0 ]
