#!/usr/bin/env bash
# Inter-token latency under 256 concurrent clients (issue 32's load: ISL 512, closed loop)
# against the step's token budget (`--max-num-batched-tokens`): how much a decode step that
# carries prefill chunks stalls the streams. One simulated worker (tandem-mocker, its default
# cost model) behind the router, once per budget in BUDGETS; per run the throughput, TTFT, the
# per-request ITL (aiperf's definition: a request's mean) and the chunk gaps (every interval
# between two output chunks of a stream: what a reader sees stall), with each p99 / p50.
# Usage: loadtest/bench/itl_mixing.sh [OUT_DIR]
#   env: BUDGETS="8192 2048 1024" CONC=256 N=512 OSL=128 SPEEDUP=0.25 (simulated time slowed
#        4x, so that a debug router and load generator keep up on 2 cores)
. "$(dirname "$0")/lib.sh"
OUT="${1:-$ROOT/loadtest-out/itl_mixing}"
BUDGETS="${BUDGETS:-8192 2048 1024}" CONC="${CONC:-256}" N="${N:-512}" OSL="${OSL:-128}"
SPEEDUP="${SPEEDUP:-0.25}"
mkdir -p "$OUT"
bench_pki
echo "== $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $CONC clients, $N requests, ISL 512, OSL $OSL, speedup $SPEEDUP"
for b in $BUDGETS; do
  export DYN_FILE_KV="$WORK/disc-$b"
  start_mocker "m$b" 1 "${SEC[@]}" --speedup-ratio "$SPEEDUP" --block-size 16 \
    --num-gpu-blocks-override 20000 --max-num-seqs "$CONC" --max-num-batched-tokens "$b"
  start_router 1 "${SEC[@]}"
  "$BIN/tandem-loadtest" --url "$ROUTER_URL" --wait-for-model 60 --quiet --out "$OUT/budget-$b" \
    --num-requests "$N" --concurrency "$CONC" --isl 512 --osl "$OSL" --seed 3 >/dev/null
  stop_all
done
python3 - "$OUT" $BUDGETS <<'PY'
import json, sys
out, budgets = sys.argv[1], sys.argv[2:]
print("| budget | out tok/s | TTFT p50 / p90 | ITL p50 / p99 (ratio) | chunk gap p50 / p99 (ratio) | max gap |")
print("|---|---|---|---|---|---|")
for b in budgets:
    s = json.load(open(f"{out}/budget-{b}/report.json"))["summary"]
    t, i, g = s["ttft_ms"], s["itl_ms"], s["gap_ms"]
    assert s["failed"] == 0, s["errors"]
    print(f"| {b} | {s['output_token_throughput']:.0f} | {t['p50']:.0f} / {t['p90']:.0f} ms | "
          f"{i['p50']:.1f} / {i['p99']:.1f} ms ({i['p99'] / i['p50']:.2f}) | "
          f"{g['p50']:.1f} / {g['p99']:.1f} ms ({g['p99'] / g['p50']:.2f}) | {g['max']:.0f} ms |")
PY
