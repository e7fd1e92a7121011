#!/usr/bin/env bash
# Measurement 2: router capacity with 16 simulated workers. The router is pinned to core 0,
# the mocker and the load generator to core 1, so their CPU does not count as router cost.
# For each Poisson rate: the router's own p99 overhead (dynamo_router_overhead_total_ms from
# its /metrics, this step's bucket deltas) and its CPU time per request (utime+stime from
# /proc/<pid>/stat). Workers are fast (--speedup-ratio 100) so they are not the bottleneck.
# Usage: BIN=target/release loadtest/bench/router_capacity.sh [OUT_DIR]  (RATES, SECS override)
. "$(dirname "$0")/lib.sh"
OUT="${1:-$ROOT/loadtest-out/router_capacity}"
RATES="${RATES:-50 100 200 400 800}"
SECS="${SECS:-5}"
PIN_ROUTER="taskset -c 0"
PIN_LOAD="taskset -c 1"
start_mocker mocker 16 --speedup-ratio 100 --block-size 32
start_router 16 --router-mode kv
mkdir -p "$OUT"
snap() { # snap NAME: router CPU ticks and overhead histogram
  awk '{print $14+$15}' "/proc/$ROUTER_PID/stat" >"$OUT/$1.ticks"
  curl -s "$ROUTER_URL/metrics" | grep '^dynamo_router_overhead_total_ms' >"$OUT/$1.hist" || true
}
for rate in $RATES; do
  snap "before-$rate"
  $PIN_LOAD "$BIN/tandem-loadtest" --url "$ROUTER_URL" --workload synthetic --isl 256 --osl 4 \
    --rate "$rate" --num-requests $((rate * SECS)) --seed 1 --quiet --out "$OUT/r$rate" >/dev/null
  snap "after-$rate"
done
python3 - "$OUT" "$(getconf CLK_TCK)" $RATES <<'PY'
import json, re, sys
out, tck, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def hist(path):
    b = {}
    for line in open(path):
        m = re.match(r'dynamo_router_overhead_total_ms_bucket\{.*le="([^"]+)".*\} (\S+)', line)
        if m: b[float('inf') if m[1] == '+Inf' else float(m[1])] = float(m[2])
    return b
def quantile(d, q):
    les = sorted(d); total = d[les[-1]]
    if total <= 0: return 0.0
    prev_le, prev_c = 0.0, 0.0
    for le in les:
        if d[le] >= q * total:
            if le == float('inf'): return prev_le
            return prev_le + (le - prev_le) * (q * total - prev_c) / max(d[le] - prev_c, 1e-9)
        prev_le, prev_c = le, d[le]
print(f"{'rate':>6} {'achieved':>9} {'ok':>6} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/req':>10} {'TTFT p50':>9}")
for r in rates:
    a, b = hist(f"{out}/before-{r}.hist"), hist(f"{out}/after-{r}.hist")
    d = {le: b.get(le, 0) - a.get(le, 0) for le in b}
    s = json.load(open(f"{out}/r{r}/report.json"))["summary"]
    ticks = int(open(f"{out}/after-{r}.ticks").read()) - int(open(f"{out}/before-{r}.ticks").read())
    cpu_us = ticks / tck * 1e6 / max(s["requests"], 1)
    print(f"{r:>6} {s['request_throughput']:9.1f} {s['succeeded']:6d} {quantile(d, .5):7.3f} {quantile(d, .99):7.3f} {cpu_us:10.0f} {s['ttft_ms']['p50']:9.2f}")
PY
