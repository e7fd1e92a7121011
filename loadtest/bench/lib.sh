# Helpers for the benchmark scripts: start a mocker fleet and a router on loopback with
# file discovery in a private folder, wait for their READY lines, stop them by pid.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${BIN:-$ROOT/target/debug}"
ROUTER_BIN="${ROUTER_BIN:-$BIN/tandem-router}"
WORK="$(mktemp -d /tmp/tandem-bench.XXXXXX)"
export DYN_FILE_KV="$WORK/disc" DYN_DISCOVERY_BACKEND=file
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# wait_lines FILE MARKER COUNT: block until FILE has COUNT lines starting with MARKER.
wait_lines() {
  local deadline=$((SECONDS + 120))
  local n
  while :; do
    n=$(grep -c "^$2" "$1" 2>/dev/null) || n=0
    [ "$n" -lt "$3" ] || break
    [ $SECONDS -lt $deadline ] || { echo "timeout waiting for $2 in $1" >&2; exit 1; }
    sleep 0.1
  done
}

# start_mocker PREFIX N ARGS...: N simulated workers in one process.
start_mocker() {
  local pfx="$1" n="$2"; shift 2
  ${PIN_LOAD:-} "$BIN/tandem-mocker" --num-workers "$n" --disaggregation-mode agg \
    --publish-kv-events --rpc-host 127.0.0.1 --system-host 127.0.0.1 "$@" \
    >"$WORK/$pfx.out" 2>"$WORK/$pfx.err" &
  PIDS+=($!)
  wait_lines "$WORK/$pfx.out" TANDEM_WORKER_READY "$n"
}

# start_router N ARGS...: sets ROUTER_URL and ROUTER_PID.
start_router() {
  local n="$1"; shift
  ${PIN_ROUTER:-} "$ROUTER_BIN" --http-host 127.0.0.1 --http-port 0 \
    --router-min-initial-workers "$n" "$@" >"$WORK/router.out" 2>"$WORK/router.err" &
  ROUTER_PID=$!
  PIDS+=($ROUTER_PID)
  wait_lines "$WORK/router.out" TANDEM_ROUTER_READY 1
  ROUTER_URL="http://$(grep -o 'http=[^ ]*' "$WORK/router.out" | head -1 | cut -d= -f2)"
}

stop_all() { cleanup; PIDS=(); }

# bench_pki: a deployment PKI for this run (internal channels are mutual TLS by default);
# sets SEC, the flags the mocker and the router take.
bench_pki() {
  "$BIN/tandem" certs --out "$WORK/pki" >/dev/null
  SEC=(--internal-tls-dir "$WORK/pki")
}
