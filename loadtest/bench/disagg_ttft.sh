#!/usr/bin/env bash
# The TTFT disaggregation adds over aggregation, tiny model, real CPU engine, from the router's
# TTFT histogram (dynamo_frontend_time_to_first_token_seconds) and from tandem-loadtest.
# Three topologies one after the other: aggregated (1 worker), and 1 prefill + 1 decode worker
# with --enforce-disagg over UCX and over TCP. Closed loop at concurrency 1, so the difference is
# the handoff itself (reserve, remote prefill + KV write, first token relayed, activation).
# Usage: loadtest/bench/disagg_ttft.sh [OUT_DIR]   (env: N=60 ISL=256 OSL=8 BIN=target/release)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BIN="${BIN:-$ROOT/target/release}"
OUT="${1:-$ROOT/loadtest-out/disagg_ttft}"
N="${N:-60}" ISL="${ISL:-256}" OSL="${OSL:-8}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/tandem-ttft.XXXXXX)"
UP_PID=
cleanup() { [ -z "$UP_PID" ] || kill "$UP_PID" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

run() {
  local name="$1"; shift
  "$BIN/tandem" up --http-port 0 "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
  UP_PID=$!
  local deadline=$((SECONDS + 180))
  until grep -q "Press Ctrl-C" "$WORK/$name.out"; do
    [ $SECONDS -lt $deadline ] || { echo "tandem up ($name) did not start; see $WORK/$name.*" >&2; exit 1; }
    kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/$name.err" >&2; exit 1; }
    sleep 0.2
  done
  local url; url=$(grep -o 'http://[0-9.]*:[0-9]*' "$WORK/$name.out" | tail -1)
  # Warm-up (first-touch of the KV pool, connections), then reset nothing: the warm-up's
  # request is subtracted below by reading the histogram before and after.
  "$BIN/tandem-loadtest" --url "$url" --num-requests 4 --concurrency 1 --isl "$ISL" --osl "$OSL" \
    --seed 99 --quiet --out "$WORK/warm-$name" >/dev/null
  curl -s "$url/metrics" >"$WORK/$name.before"
  "$BIN/tandem-loadtest" --url "$url" --num-requests "$N" --concurrency 1 --isl "$ISL" --osl "$OSL" \
    --seed 1 --quiet --out "$OUT/$name" >/dev/null
  curl -s "$url/metrics" >"$WORK/$name.after"
  kill "$UP_PID"; wait "$UP_PID" 2>/dev/null || true; UP_PID=
}

echo "== machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); N=$N ISL=$ISL OSL=$OSL"
run agg --topology agg --workers 1
run disagg-ucx --topology disagg --workers 1 --prefill-workers 1 --kv-transport ucx --router-arg=--enforce-disagg
run disagg-tcp --topology disagg --workers 1 --prefill-workers 1 --kv-transport tcp --router-arg=--enforce-disagg

python3 - "$OUT" "$WORK" <<'PY'
import json, re, sys
out, work = sys.argv[1], sys.argv[2]
name = "dynamo_frontend_time_to_first_token_seconds"
def hist(path):
    s, c, b = 0.0, 0.0, {}
    for line in open(path):
        if line.startswith(name + "_sum"): s = float(line.split()[-1])
        elif line.startswith(name + "_count"): c = float(line.split()[-1])
        elif line.startswith(name + "_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            b[le] = b.get(le, 0.0) + float(line.split()[-1])
    return s, c, b
def window(n):
    s0, c0, b0 = hist(f"{work}/{n}.before"); s1, c1, b1 = hist(f"{work}/{n}.after")
    c = c1 - c0
    mean = (s1 - s0) / c if c else float("nan")
    # p50 from the cumulative buckets (upper bound of the bucket holding the median).
    p50 = next((float(le) for le in sorted((k for k in b1 if k != "+Inf"), key=float)
                if b1[le] - b0.get(le, 0) >= c / 2), float("inf"))
    return mean * 1e3, p50 * 1e3, int(c)
rows = {}
for n in ("agg", "disagg-ucx", "disagg-tcp"):
    mean, p50b, c = window(n)
    lt = json.load(open(f"{out}/{n}/report.json"))["summary"]["ttft_ms"]
    rows[n] = (mean, p50b, c, lt["p50"], lt["p99"])
    print(f"{n:11s} router histogram: {c} requests, mean {mean:7.2f} ms, p50 <= {p50b:6.1f} ms | "
          f"loadtest TTFT p50 {lt['p50']:7.2f} ms p99 {lt['p99']:7.2f} ms")
a = rows["agg"]
for n in ("disagg-ucx", "disagg-tcp"):
    r = rows[n]
    print(f"{n} adds: mean {r[0]-a[0]:+.2f} ms ({r[0]/a[0]:.2f}x), loadtest p50 {r[3]-a[3]:+.2f} ms ({r[3]/a[3]:.2f}x)")
PY
