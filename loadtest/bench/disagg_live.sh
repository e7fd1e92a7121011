#!/usr/bin/env bash
# Live disaggregation with simulated workers: TTFT of aggregated vs disaggregated serving behind
# the real router, at two simulated KV transfer bandwidths. Three topologies one after the
# other, each with 2 simulated workers: 2 agg workers; 1 prefill + 1 pd worker with
# --enforce-disagg at BW_HI and at BW_LO GB/s. The mocker's transfer is simulated (no bytes
# move; a batch of blocks takes bytes / bandwidth on the prefill worker's link) with KV sized as
# Qwen3-0.6B in bf16 (--kv-bytes-per-token 114688), so a 2,048-token prompt is 235 MB.
# Closed loop at concurrency 1: the TTFT difference is the handoff plus the transfer.
# Then goodput at equal worker count (4: agg x4 vs 2 prefill + 2 pd at BW_HI), open loop
# (Poisson) at each of RATES req/s, GN requests of ISL / GOSL tokens, SLA TTFT <= SLA_TTFT ms
# and ITL <= SLA_ITL ms (RATES="" skips it).
# Usage: loadtest/bench/disagg_live.sh [OUT_DIR]
#   env: N=40 ISL=2048 OSL=16 BW_HI=64 BW_LO=4 SPEEDUP=1
#        RATES="20 40" GN=240 GOSL=128 SLA_TTFT=300 SLA_ITL=20
#        BIN=target/debug (mocker) ROUTER_BIN / LOADTEST (default: release if built)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BIN="${BIN:-$ROOT/target/debug}"
pick() { if [ -x "$ROOT/target/release/$1" ]; then echo "$ROOT/target/release/$1"; else echo "$BIN/$1"; fi; }
ROUTER_BIN="${ROUTER_BIN:-$(pick tandem-router)}"
LOADTEST="${LOADTEST:-$(pick tandem-loadtest)}"
OUT="${1:-$ROOT/loadtest-out/disagg_live}"
N="${N:-40}" ISL="${ISL:-2048}" OSL="${OSL:-16}" BW_HI="${BW_HI:-64}" BW_LO="${BW_LO:-4}"
SPEEDUP="${SPEEDUP:-1}"
KVB=114688
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/tandem-disagg-live.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

wait_lines() {  # FILE MARKER COUNT
  local deadline=$((SECONDS + 120)) n
  while :; do
    n=$(grep -c "^$2" "$1" 2>/dev/null) || n=0
    [ "$n" -lt "$3" ] || break
    [ $SECONDS -lt $deadline ] || { echo "timeout waiting for $2 in $1" >&2; exit 1; }
    sleep 0.1
  done
}

mocker() {  # NAME MODE COUNT ARGS...
  local name="$1" mode="$2" n="$3"; shift 3
  "$BIN/tandem-mocker" --disaggregation-mode "$mode" --num-workers "$n" --publish-kv-events \
    --rpc-host 127.0.0.1 --system-host 127.0.0.1 --speedup-ratio "$SPEEDUP" \
    --kv-bytes-per-token "$KVB" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  wait_lines "$WORK/$name.out" TANDEM_WORKER_READY "$n"
}

LT=(--num-requests "$N" --concurrency 1 --osl "$OSL")  # the measured run's load
run() {  # NAME ROUTER_ARGS...
  local name="$1"; shift
  "$ROUTER_BIN" --http-host 127.0.0.1 --http-port 0 "$@" >"$WORK/router-$name.out" 2>"$WORK/router-$name.err" &
  PIDS+=($!)
  wait_lines "$WORK/router-$name.out" TANDEM_ROUTER_READY 1
  local url="http://$(grep -o 'http=[^ ]*' "$WORK/router-$name.out" | head -1 | cut -d= -f2)"
  "$LOADTEST" --url "$url" --num-requests 4 --concurrency 1 --isl "$ISL" --osl "$OSL" \
    --seed 99 --quiet --wait-for-model 60 --out "$WORK/warm-$name" >/dev/null
  "$LOADTEST" --url "$url" --isl "$ISL" --seed 1 --quiet --out "$OUT/$name" \
    "${LT[@]}" >/dev/null
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=()
}

topology() {  # NAME: fresh discovery folder
  export DYN_FILE_KV="$WORK/disc-$1" DYN_DISCOVERY_BACKEND=file
}

echo "== machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); N=$N ISL=$ISL OSL=$OSL speedup=$SPEEDUP"
topology agg;  mocker agg agg 2;                                  run agg --router-min-initial-workers 2
for bw in "$BW_HI" "$BW_LO"; do
  topology "bw$bw"
  mocker "p$bw" prefill 1 --kv-transfer-bandwidth "$bw"
  mocker "d$bw" pd 1
  run "disagg-${bw}GBps" --router-min-initial-workers 1 --enforce-disagg
done

python3 - "$OUT" "$ISL" "$KVB" "$BW_HI" "$BW_LO" "$SPEEDUP" <<'PY'
import json, sys
out, isl, kvb, hi, lo, sp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6])
def row(name):
    s = json.load(open(f"{out}/{name}/report.json"))["summary"]
    return s["ttft_ms"], s["itl_ms"], s
agg = row("agg")[0]
print(f"{'topology':18s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} {'ITL p50':>8s}  transfer alone")
for name, bw in (("agg", None), (f"disagg-{hi}GBps", hi), (f"disagg-{lo}GBps", lo)):
    t, i, _ = row(name)
    x = "" if bw is None else f"{isl * kvb / (float(bw) * 1e9 * sp) * 1e3:8.1f} ms"
    print(f"{name:18s} {t['p50']:9.1f} {t['p90']:8.1f} {t['p99']:8.1f} {i['p50']:8.2f}  {x}")
PY

RATES="${RATES-20 40}" GN="${GN:-240}" GOSL="${GOSL:-128}" SLA_TTFT="${SLA_TTFT:-300}" SLA_ITL="${SLA_ITL:-20}"
[ -n "$RATES" ] || exit 0
echo "== goodput, 4 workers: ISL=$ISL OSL=$GOSL N=$GN SLA TTFT<=$SLA_TTFT ms ITL<=$SLA_ITL ms, transfer $BW_HI GB/s"
for rate in $RATES; do
  LT=(--num-requests "$GN" --rate "$rate" --osl "$GOSL" --sla-ttft-ms "$SLA_TTFT" --sla-itl-ms "$SLA_ITL")
  topology "g-agg-$rate"; mocker "ga$rate" agg 4; run "goodput-agg4-$rate" --router-min-initial-workers 4
  topology "g-dis-$rate"
  mocker "gp$rate" prefill 2 --kv-transfer-bandwidth "$BW_HI"
  mocker "gd$rate" pd 2
  run "goodput-2p2d-$rate" --router-min-initial-workers 2 --enforce-disagg
done
python3 - "$OUT" $RATES <<'PY'
import json, sys
out, rates = sys.argv[1], sys.argv[2:]
print(f"{'req/s':>5s} {'fleet':6s} {'TTFT p50':>9s} {'p99':>8s} {'ITL p50':>8s} {'p99':>7s} {'goodput':>8s} {'met':>8s} {'ok':>8s}")
for r in rates:
    for f in ("agg4", "2p2d"):
        s = json.load(open(f"{out}/goodput-{f}-{r}/report.json"))["summary"]
        t, i = s["ttft_ms"], s["itl_ms"]
        print(f"{r:>5s} {f:6s} {t['p50']:9.1f} {t['p99']:8.1f} {i['p50']:8.2f} {i['p99']:7.2f} "
              f"{s['goodput']:8.2f} {s['sla_met']:>4d}/{s['requests']:<3d} {s['succeeded']:>4d}/{s['requests']}")
PY
