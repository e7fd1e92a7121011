#!/usr/bin/env bash
# The cost of authentication on the request path: router CPU time per request, with the
# internal channels in mutual TLS (the default) against --insecure-internal, and with an API
# key on the public port against none, all in one run on the same binaries. Two simulated
# workers (tandem-mocker) behind the router; tandem-loadtest drives it closed-loop.
#
#   PROFILE   cargo profile of the binaries to use (default release; build them first:
#             cargo build --release -p tandem-router -p tandem-mocker -p tandem-loadtest)
#   REQUESTS  requests per case (default 2000), CONCURRENCY (default 32), ROUNDS (default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${PROFILE:-release}
bin=target/$profile
for b in tandem-router tandem-mocker tandem-loadtest tandem; do
    [ -x "$bin/$b" ] || { echo "missing $bin/$b (build it with --profile $profile)" >&2; exit 1; }
done
requests=${REQUESTS:-2000}
concurrency=${CONCURRENCY:-32}
rounds=${ROUNDS:-3}
work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
"$bin/tandem" certs --out "$work/pki" >/dev/null
ticks=$(getconf CLK_TCK)

# Prints the first line of FILE matching PREFIX once it appears (bounded).
wait_line() {
    local file=$1 prefix=$2 n=0
    until grep -m1 "^$prefix" "$file" 2>/dev/null; do
        n=$((n + 1)); [ "$n" -lt 600 ] || { echo "timed out waiting for $prefix in $file" >&2; exit 1; }
        sleep 0.1
    done
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# case NAME SECURITY-FLAGS... -- ROUTER-FLAGS... -- LOADTEST-FLAGS...
run_case() {
    local name=$1; shift
    local sec=() rflags=() lflags=()
    while [ "$1" != "--" ]; do sec+=("$1"); shift; done; shift
    while [ "$1" != "--" ]; do rflags+=("$1"); shift; done; shift
    lflags=("$@")
    local disc="$work/disc-$name-$RANDOM"
    mkdir -p "$disc"
    DYN_FILE_KV=$disc DYN_DISCOVERY_BACKEND=file "$bin/tandem-mocker" --num-workers 2 \
        --speedup-ratio 1000 --num-gpu-blocks-override 4096 --block-size 16 \
        --disaggregation-mode agg --publish-kv-events "${sec[@]}" >"$disc/mocker.log" 2>&1 &
    pids+=($!)
    local mocker=$!
    until [ "$(grep -c '^TANDEM_WORKER_READY' "$disc/mocker.log" 2>/dev/null)" -ge 2 ]; do sleep 0.1; done
    DYN_FILE_KV=$disc DYN_DISCOVERY_BACKEND=file "$bin/tandem-router" --http-host 127.0.0.1 \
        --http-port 0 --router-min-initial-workers 2 --router-mode kv "${sec[@]}" "${rflags[@]}" \
        >"$disc/router.log" 2>&1 &
    pids+=($!)
    local router=$!
    local http
    http=$(wait_line "$disc/router.log" TANDEM_ROUTER_READY | sed 's/.*http=\([^ ]*\).*/\1/')
    # Warm-up (connections, tokenizer, TLS sessions), then the measured run.
    "$bin/tandem-loadtest" --url "http://$http" --num-requests 200 --concurrency "$concurrency" \
        --isl 128 --osl 8 --seed 1 --out "$disc/warm" --quiet "${lflags[@]}" >/dev/null
    local before after
    before=$(cpu_ticks "$router")
    local start=$SECONDS
    "$bin/tandem-loadtest" --url "http://$http" --num-requests "$requests" \
        --concurrency "$concurrency" --isl 128 --osl 8 --seed 2 --out "$disc/run" --quiet \
        "${lflags[@]}" >"$disc/load.log"
    after=$(cpu_ticks "$router")
    local ok
    ok=$(grep -o '"succeeded": *[0-9]*' "$disc/run/report.json" 2>/dev/null | head -1 | grep -o '[0-9]*$' || echo 0)
    awk -v n="$name" -v t=$((after - before)) -v hz="$ticks" -v r="$requests" -v ok="$ok" \
        -v s=$((SECONDS - start)) \
        'BEGIN { printf "%-28s router CPU %7.1f µs/request  (%d/%d ok, %d s)\n", n, t / hz / r * 1e6, ok, r, s }'
    kill "$router" "$mocker" 2>/dev/null || true
    wait "$router" "$mocker" 2>/dev/null || true
}

for round in $(seq 1 "$rounds"); do
    echo "== round $round"
    run_case "insecure-internal, no key" --insecure-internal -- -- 
    run_case "mutual TLS, no key" --internal-tls-dir "$work/pki" -- -- 
    run_case "mutual TLS, API key" --internal-tls-dir "$work/pki" -- --api-key bench-key-0123456789 -- \
        --api-key bench-key-0123456789
done
