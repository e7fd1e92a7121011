#!/usr/bin/env bash
# The engine thread's own time per step (what it does while the GPU waits: scheduling,
# preparing the step, applying its tokens, emitting) under issue 32's load, on the mocker:
# one simulated worker behind the router, 256 clients, ISL 512 / OSL 512, from the worker's
# tandem_engine_* counters over the run. Alternates the tandem-mocker binaries of each
# folder given (A/B of an engine change), ROUNDS times.
# Usage: loadtest/bench/engine_own_time.sh MOCKER_DIR... (env: ROUNDS=2 N=512 SPEEDUP=1;
#        BIN: the folder of tandem-router, tandem and tandem-loadtest; release builds)
. "$(dirname "$0")/lib.sh"
[ $# -ge 1 ] || { echo "usage: $0 MOCKER_DIR..." >&2; exit 2; }
ROUNDS="${ROUNDS:-2}" N="${N:-512}" SPEEDUP="${SPEEDUP:-1}"
echo "== $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); 256 clients, $N requests, ISL/OSL 512"
bench_pki
for r in $(seq 1 "$ROUNDS"); do
  for dir in "$@"; do
    export DYN_FILE_KV="$WORK/disc-$r-$(basename "$dir")"
    MOCKER_BIN="$BIN"; BIN="$dir"
    start_mocker m 1 "${SEC[@]}" --speedup-ratio "$SPEEDUP" --block-size 16 \
      --num-gpu-blocks-override 40000 --max-num-seqs 256
    BIN="$MOCKER_BIN"
    start_router 1 "${SEC[@]}"
    host=$(grep -o 'http=[^ ]*' "$WORK/m.out" | head -1 | cut -d= -f2)
    snap() { curl -s "http://$host/metrics" | grep -E '^tandem_engine_(steps|step_microseconds|forward_microseconds|apply_microseconds|schedule_microseconds)_total' > "$1"; }
    snap "$WORK/before"
    "$BIN/tandem-loadtest" --url "$ROUTER_URL" --wait-for-model 60 --quiet --out "$WORK/lt" \
      --num-requests "$N" --concurrency 256 --isl 512 --osl 512 --seed 3 --vocab-hi 150000 >/dev/null
    snap "$WORK/after"
    python3 - "$WORK/before" "$WORK/after" "$WORK/lt/report.json" "$dir" <<'PY'
import json, sys
def read(path):
    return {l.split()[0].split("{")[0]: float(l.split()[1]) for l in open(path) if l.strip()}
b, a = read(sys.argv[1]), read(sys.argv[2])
d = {k: a[k] - b.get(k, 0.0) for k in a}
steps = d["tandem_engine_steps_total"]
ms = lambda k: d.get(f"tandem_engine_{k}_microseconds_total", 0.0) / steps / 1e3
r = json.load(open(sys.argv[3]))["summary"]
assert r["failed"] == 0, r["errors"]
print(f"{sys.argv[4]}: {steps:.0f} steps, {ms('step'):.3f} ms a step, forward {ms('forward'):.3f}, "
      f"the thread's own {ms('step') - ms('forward'):.3f} (apply {ms('apply'):.3f}, schedule {ms('schedule'):.3f}); "
      f"{r['output_token_throughput']:.0f} out tok/s, {r['succeeded']}/{r['requests']} ok")
PY
    stop_all
  done
done
