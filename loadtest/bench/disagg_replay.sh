#!/usr/bin/env bash
# Measurement 3 (offline, virtual clock): aggregated vs disaggregated goodput at equal worker
# count (4), on a generated Mooncake-format trace, with the simulated KV transfer.
# Usage: loadtest/bench/disagg_replay.sh [RATES...]   (defaults 10 20 30)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
M="${BIN:-$ROOT/target/debug}/tandem-mocker"
TMP="$(mktemp -d)"
SLA=(--sla-ttft-ms "${SLA_TTFT:-500}" --sla-itl-ms "${SLA_ITL:-30}")
printf "%5s %-8s %9s %9s %8s %8s %9s %7s\n" rate fleet ttft_p50 ttft_p99 itl_p50 itl_p99 goodput met
[ $# -gt 0 ] || set -- 10 20 30
for rate in "$@"; do
  python3 "$ROOT/loadtest/bench/gen_trace.py" 300 "$rate" "$TMP/t.jsonl" 1
  for fleet in "agg4:--num-workers 4" "1p3d:--num-prefill-workers 1 --num-workers 3" \
               "2p2d:--num-prefill-workers 2 --num-workers 2"; do
    name="${fleet%%:*}"; flags="${fleet#*:}"
    # shellcheck disable=SC2086
    "$M" --replay "$TMP/t.jsonl" $flags "${SLA[@]}" --kv-transfer-bandwidth "${BW:-64}" 2>/dev/null |
      python3 -c "import json,sys; d=json.load(sys.stdin); t,i=d['ttft_ms'],d['itl_ms']; print('%5s %-8s %9.1f %9.1f %8.2f %8.2f %9.2f %4d/%d' % ('$rate','$name',t['p50'],t['p99'],i['p50'],i['p99'],d['goodput_rps'],d['sla_met'],d['requests']))"
  done
done
rm -rf "$TMP"
