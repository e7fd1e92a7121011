#!/usr/bin/env bash
# Measurement 1: KV-aware vs round-robin routing, 8 simulated workers, shared-prefix load.
# Each worker's pool (512 blocks x 32 tokens) holds about 4 of the 16 prefixes: round-robin
# spreads every group over every worker and thrashes; KV routing keeps groups sticky.
# The prompt cache hit rate is the workers' cached_tokens over prompt tokens (usage); the
# prefix share (PREFIX_RATIO, default 0.8) bounds it.
# Usage: loadtest/bench/kv_vs_rr.sh [OUT_DIR]
. "$(dirname "$0")/lib.sh"
OUT="${1:-$ROOT/loadtest-out/kv_vs_rr}"
LOAD=(--workload shared-prefix --groups 16 --prefix-len 2048 --prefix-ratio "${PREFIX_RATIO:-0.8}" --osl 32
      --rate "${RATE:-40}" --num-requests "${N:-400}" --seed 7 --quiet)
bench_pki
for mode in round-robin kv; do
  start_mocker mocker 8 --num-gpu-blocks-override 512 --block-size 32 --speedup-ratio "${SPEEDUP:-1}" "${SEC[@]}"
  start_router 8 --router-mode "$mode" "${SEC[@]}"
  "$BIN/tandem-loadtest" --url "$ROUTER_URL" "${LOAD[@]}" --out "$OUT/$mode"
  stop_all
done
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
r = {m: json.load(open(f"{o}/{m}/report.json"))["summary"] for m in ("round-robin", "kv")}
for m, s in r.items():
    hit = s.get("prompt_cache_hit_rate")
    hit = "n/a" if hit is None else f"{hit * 100:5.1f}%"
    print(f"{m:12s} TTFT p50 {s['ttft_ms']['p50']:8.1f} ms  p99 {s['ttft_ms']['p99']:8.1f} ms  ok {s['succeeded']}/{s['requests']}  prompt cache hit {hit}")
print(f"round-robin / kv: p50 {r['round-robin']['ttft_ms']['p50']/r['kv']['ttft_ms']['p50']:.2f}x  "
      f"p99 {r['round-robin']['ttft_ms']['p99']/r['kv']['ttft_ms']['p99']:.2f}x")
PY
