#!/usr/bin/env bash
# Measurement 1: KV-aware vs round-robin routing, 8 simulated workers, shared-prefix load.
# Each worker's pool (512 blocks x 32 tokens) holds about 4 of the 16 prefixes: round-robin
# spreads every group over every worker and thrashes; KV routing keeps groups sticky.
# The prompt cache hit rate is the workers' cached_tokens over prompt tokens (usage); the
# prefix share (PREFIX_RATIO, default 0.8) bounds it. WEIGHTS (default "1.0", the router's
# default) runs kv mode once per --router-kv-overlap-score-weight given.
# Usage: loadtest/bench/kv_vs_rr.sh [OUT_DIR]
. "$(dirname "$0")/lib.sh"
OUT="${1:-$ROOT/loadtest-out/kv_vs_rr}"
LOAD=(--workload shared-prefix --groups 16 --prefix-len 2048 --prefix-ratio "${PREFIX_RATIO:-0.8}" --osl 32
      --rate "${RATE:-40}" --num-requests "${N:-400}" --seed 7 --quiet)
bench_pki
WEIGHTS=(${WEIGHTS:-1.0})
run() { # NAME ROUTER_ARGS...
  local name="$1"; shift
  start_mocker mocker 8 --num-gpu-blocks-override 512 --block-size 32 --speedup-ratio "${SPEEDUP:-1}" "${SEC[@]}"
  start_router 8 "$@" "${SEC[@]}"
  "$BIN/tandem-loadtest" --url "$ROUTER_URL" "${LOAD[@]}" --out "$OUT/$name"
  stop_all
}
run round-robin --router-mode round-robin
for w in "${WEIGHTS[@]}"; do
  run "kv-w$w" --router-mode kv --router-kv-overlap-score-weight "$w"
done
python3 - "$OUT" "${WEIGHTS[@]}" <<'PY'
import json, sys
o, weights = sys.argv[1], sys.argv[2:]
names = ["round-robin"] + [f"kv-w{w}" for w in weights]
r = {m: json.load(open(f"{o}/{m}/report.json"))["summary"] for m in names}
for m, s in r.items():
    hit = s.get("prompt_cache_hit_rate")
    hit = "n/a" if hit is None else f"{hit * 100:5.1f}%"
    print(f"{m:12s} TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  p99 {s['ttft_ms']['p99']:8.1f} ms  "
          f"ITL p50 {s['itl_ms']['p50']:6.1f} ms  p99 {s['itl_ms']['p99']:6.1f} ms  "
          f"ok {s['succeeded']}/{s['requests']}  prompt cache hit {hit}")
rr = r["round-robin"]["ttft_ms"]
for m in names[1:]:
    kv = r[m]["ttft_ms"]
    print(f"round-robin / {m}: TTFT p50 {rr['p50'] / kv['p50']:.2f}x  p99 {rr['p99'] / kv['p99']:.2f}x")
PY
