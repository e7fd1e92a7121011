#!/usr/bin/env bash
# Router CPU per request, per streamed token and at rest (issue 32's router targets).
# The router runs alone on core 0 (taskset), four simulated workers (tandem-mocker, fast) and
# the load generator on core 1, internal channels in mutual TLS (the default). Text prompts of
# about ISL words (the router tokenizes them with the model's tokenizer), streamed completions.
#
# For each case: a warm-up, then REQUESTS requests closed-loop at CONCURRENCY; the router's
# utime+stime from /proc/PID/stat over the measured run, divided by the requests. The per-token
# cost is the difference between OSL and OSL 1 spread over the extra tokens. At rest: the
# router's CPU over IDLE_SECS with nothing sent (4 workers registered, health probes on).
# Also the router's own scheduling time (dynamo_router_overhead_scheduling_ms, the part that
# takes the shared routing state) at CONCURRENCY, and at 128 in flight with the router on
# both cores (then its CPU per request includes the cores it shares with the load).
#
#   BIN (target/release), LOADTEST (BIN's tandem-loadtest), REQUESTS (1000),
#   CONCURRENCY (32), ISL (512), OSL (128), IDLE_SECS (20), ROUNDS (1)
# Usage: cargo build --release -p tandem-router -p tandem-mocker -p tandem-loadtest -p tandem
#        loadtest/bench/router_cpu.sh [OUT_DIR]
BIN="${BIN:-$(cd "$(dirname "$0")/../.." && pwd)/target/release}"
. "$(dirname "$0")/lib.sh"
OUT="${1:-$ROOT/loadtest-out/router_cpu}"
REQUESTS=${REQUESTS:-1000}
CONCURRENCY=${CONCURRENCY:-32}
ISL=${ISL:-512}
OSL=${OSL:-128}
IDLE_SECS=${IDLE_SECS:-20}
ROUNDS=${ROUNDS:-1}
LOADTEST=${LOADTEST:-$BIN/tandem-loadtest}
PIN_ROUTER="taskset -c 0"
PIN_LOAD="taskset -c 1"
TCK=$(getconf CLK_TCK)
mkdir -p "$OUT"
bench_pki

ticks() { awk '{print $14 + $15}' "/proc/$ROUTER_PID/stat"; }
sched_hist() { curl -s "$ROUTER_URL/metrics" | grep '^dynamo_router_overhead_scheduling_ms' || true; }

# load NAME OSL CONCURRENCY N: one measured closed-loop run; prints router µs/request.
load() {
  local name=$1 osl=$2 conc=$3 n=$4 before after
  sched_hist >"$OUT/$name.hist.before"
  before=$(ticks)
  $PIN_LOAD "$LOADTEST" --url "$ROUTER_URL" --prompt-mode text --isl "$ISL" \
    --osl "$osl" --concurrency "$conc" --num-requests "$n" --seed 2 --quiet \
    --out "$OUT/$name" >/dev/null
  after=$(ticks)
  sched_hist >"$OUT/$name.hist.after"
  echo "$((after - before))" >"$OUT/$name.ticks"
}

for round in $(seq 1 "$ROUNDS"); do
  start_mocker mocker 4 --speedup-ratio 1000 --num-gpu-blocks-override 8192 --block-size 16 "${SEC[@]}"
  start_router 4 --router-mode kv "${SEC[@]}"
  $PIN_LOAD "$LOADTEST" --url "$ROUTER_URL" --prompt-mode text --isl "$ISL" \
    --osl 8 --concurrency "$CONCURRENCY" --num-requests 200 --seed 1 --quiet \
    --out "$OUT/warm" >/dev/null
  before=$(ticks)
  sleep "$IDLE_SECS"
  echo "$(($(ticks) - before))" >"$OUT/r$round-idle.ticks"
  load "r$round-osl$OSL" "$OSL" "$CONCURRENCY" "$REQUESTS"
  load "r$round-osl1" 1 "$CONCURRENCY" "$REQUESTS"
  stop_all
  # Contention: the router on both cores (two runtime threads that can race for its state),
  # 128 requests in flight.
  PIN_ROUTER="" start_mocker mocker 4 --speedup-ratio 1000 --num-gpu-blocks-override 8192 \
    --block-size 16 "${SEC[@]}"
  PIN_ROUTER="" start_router 4 --router-mode kv "${SEC[@]}"
  load "r$round-c128" "$OSL" 128 "$REQUESTS"
  stop_all
done

python3 - "$OUT" "$TCK" "$ROUNDS" "$REQUESTS" "$OSL" "$IDLE_SECS" "$CONCURRENCY" <<'PY'
import json, re, sys
out, tck, rounds, n, osl, idle, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
def us(name):
    return int(open(f"{out}/{name}.ticks").read()) / tck * 1e6 / n
def hist(path):
    b = {}
    for line in open(path):
        m = re.match(r'\S+_bucket\{.*le="([^"]+)".*\} (\S+)', line)
        if m: b[float('inf') if m[1] == '+Inf' else float(m[1])] = float(m[2])
    return b
def quantile(name, q):
    a, b = hist(f"{out}/{name}.hist.before"), hist(f"{out}/{name}.hist.after")
    d = {le: b.get(le, 0) - a.get(le, 0) for le in b}
    les = sorted(d)
    if not les or d[les[-1]] <= 0: return float('nan')
    total, prev_le, prev_c = d[les[-1]], 0.0, 0.0
    for le in les:
        if d[le] >= q * total:
            if le == float('inf'): return prev_le
            return prev_le + (le - prev_le) * (q * total - prev_c) / max(d[le] - prev_c, 1e-9)
        prev_le, prev_c = le, d[le]
def ok(name):
    s = json.load(open(f"{out}/{name}/report.json"))["summary"]
    return f"{s['succeeded']}/{s['requests']}"
for r in range(1, rounds + 1):
    full, one = us(f"r{r}-osl{osl}"), us(f"r{r}-osl1")
    idle_pct = int(open(f"{out}/r{r}-idle.ticks").read()) / tck / idle * 100
    print(f"round {r}: router CPU {full:.0f} µs/request at OSL {osl} ({ok(f'r{r}-osl{osl}')} ok), "
          f"{one:.0f} at OSL 1, {(full - one) / (osl - 1):.2f} µs per extra streamed token; "
          f"at rest {idle_pct:.2f}% of a core")
    for name, c in ((f"r{r}-osl{osl}", conc), (f"r{r}-c128", "128")):
        print(f"  scheduling at {c} in flight: p50 {quantile(name, .5):.3f} ms, "
              f"p99 {quantile(name, .99):.3f} ms ({us(name):.0f} µs/request CPU, {ok(name)} ok)")
PY
