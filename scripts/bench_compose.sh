#!/usr/bin/env bash
# The tiny model's TTFT and ITL through compose/disagg.yml against `tandem up` (disaggregated)
# on the same machine and the same binaries, one tandem-loadtest run each; also the time from
# `up` to healthy. Needs the images (scripts/images --bin-dir target/$PROFILE) and docker
# compose v2.
#
#   PROFILE      cargo profile of the binaries (default debug, what the tests build)
#   REQUESTS     requests per run (default 64), CONCURRENCY (default 4), ISL (default 256),
#                OSL (default 32)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${PROFILE:-debug}
bin=target/$profile
for b in tandem tandem-router tandem-prefill tandem-decode tandem-loadtest; do
    [ -x "$bin/$b" ] || { echo "missing $bin/$b (cargo build --bins --profile $profile)" >&2; exit 1; }
done
requests=${REQUESTS:-64} concurrency=${CONCURRENCY:-4} isl=${ISL:-256} osl=${OSL:-32}
work=$(mktemp -d)
port=18431
project=tandem-bench
up_pid=""
cleanup() {
    if [ -n "$up_pid" ]; then kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null || true; fi
    TANDEM_PORT=$port docker compose -p "$project" -f compose/disagg.yml down -v >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

wait_healthy() { # wait_healthy URL: seconds until /health answers 200 (bounded)
    local start=$SECONDS
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ]; do
        [ $((SECONDS - start)) -lt 300 ] || { echo "not healthy within 300 s: $1" >&2; exit 1; }
        sleep 0.2
    done
}

load() { # load NAME URL
    "$bin/tandem-loadtest" --url "$2" --num-requests "$requests" --concurrency "$concurrency" \
        --isl "$isl" --osl "$osl" --quiet --out "$work/$1" >/dev/null
    python3 - "$1" "$work/$1/report.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
s = json.load(open(path))["summary"]
t, i = s["ttft_ms"], s["itl_ms"]
print(f"   {name:10s} TTFT p50 {t['p50']:8.1f} ms  p99 {t['p99']:8.1f} ms   "
      f"ITL p50 {i['p50']:6.2f} ms  p99 {i['p99']:6.2f} ms   {s['succeeded']}/{s['requests']} ok")
PY
}

echo "== tandem up --topology disagg ($profile binaries)"
t0=$SECONDS
"$bin/tandem" up --topology disagg --kv-transport tcp --http-port "$port" --insecure-internal > "$work/up.log" 2>&1 &
up_pid=$!
wait_healthy "http://127.0.0.1:$port"
echo "   healthy after $((SECONDS - t0)) s"
load tandem-up "http://127.0.0.1:$port"
kill "$up_pid"; wait "$up_pid" 2>/dev/null || true; up_pid=""

echo "== docker compose -f compose/disagg.yml"
t0=$SECONDS
TANDEM_PORT=$port docker compose --progress quiet -p "$project" -f compose/disagg.yml up -d --wait
echo "   healthy after $((SECONDS - t0)) s"
load compose "http://127.0.0.1:$port"
