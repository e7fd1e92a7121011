#!/usr/bin/env bash
# Disaggregated serving across two "hosts" with every internal channel authenticated: two
# network namespaces joined by a veth pair, each with its own address. Host A (10.77.0.1) runs
# etcd (TLS, client certificates required) and a prefill worker; host B (10.77.0.2) runs a decode
# worker (`pd`, KV over TCP) and the router. All of them share one deployment TLS folder from
# `tandem certs`. Requests go through B's router with --enforce-disagg, so every prompt is
# prefilled on A and its KV pushed across the veth into B's pool. Then checks from B that the
# prefill worker's gRPC port refuses a client without a certificate.
#
# Needs root (ip netns), etcd, curl; binaries from target/$PROFILE (default debug):
#   cargo build -p tandem -p tandem-router -p tandem-decode -p tandem-prefill
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/${PROFILE:-debug}
for b in tandem tandem-router tandem-decode tandem-prefill; do
    [ -x "$bin/$b" ] || { echo "missing $bin/$b" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "needs root for ip netns" >&2; exit 1; }
command -v etcd >/dev/null || { echo "needs etcd (Debian etcd-server)" >&2; exit 1; }

A=tandem-a B=tandem-b IPA=10.77.0.1 IPB=10.77.0.2
work=$(mktemp -d)
pids=()
cleanup() {
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    ip netns del "$A" 2>/dev/null || true
    ip netns del "$B" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT
ip netns del "$A" 2>/dev/null || true
ip netns del "$B" 2>/dev/null || true
ip netns add "$A"
ip netns add "$B"
ip link add tandem-va type veth peer name tandem-vb
ip link set tandem-va netns "$A"
ip link set tandem-vb netns "$B"
ip -n "$A" addr add "$IPA/24" dev tandem-va
ip -n "$B" addr add "$IPB/24" dev tandem-vb
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set tandem-va up
ip -n "$B" link set tandem-vb up

# The deployment's folder; etcd's certificate must also name A's address.
"$bin/tandem" certs --out "$work/pki" --host "$IPA"
"$bin/tandem" model tiny "$work/model" >/dev/null
pki=$work/pki

# Waits (bounded) for a line starting with $2 in file $1 and prints it.
wait_line() {
    local n=0
    until grep -m1 "^$2" "$1" 2>/dev/null; do
        n=$((n + 1))
        [ "$n" -lt 900 ] || { echo "timed out waiting for $2; log:" >&2; tail -20 "$1" >&2; exit 1; }
        sleep 0.1
    done
}

ip netns exec "$A" etcd --name a --data-dir "$work/etcd" \
    --listen-client-urls "https://$IPA:2379" --advertise-client-urls "https://$IPA:2379" \
    --listen-peer-urls "http://127.0.0.1:2380" --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster a=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381 \
    --cert-file "$pki/node.crt" --key-file "$pki/node.key" --trusted-ca-file "$pki/ca.crt" \
    --client-cert-auth --log-level warn >"$work/etcd.log" 2>&1 &
pids+=($!)
n=0
until ip netns exec "$A" curl -sf http://127.0.0.1:2381/health >/dev/null; do
    n=$((n + 1)); [ "$n" -lt 300 ] || { echo "etcd did not start" >&2; exit 1; }; sleep 0.1
done

common=(--internal-tls-dir "$pki" --discovery-backend etcd --etcd-endpoints "https://$IPA:2379")
ip netns exec "$A" "$bin/tandem-prefill" "${common[@]}" --rpc-advertise-host "$IPA" \
    --model-path "$work/model" --kv-transport tcp --publish-kv-events >"$work/prefill.log" 2>&1 &
pids+=($!)
prefill=$(wait_line "$work/prefill.log" TANDEM_WORKER_READY)
echo "host A: $prefill"
ip netns exec "$B" "$bin/tandem-decode" "${common[@]}" --rpc-advertise-host "$IPB" \
    --model-path "$work/model" --disaggregation-mode pd --kv-transport tcp --publish-kv-events \
    >"$work/decode.log" 2>&1 &
pids+=($!)
echo "host B: $(wait_line "$work/decode.log" TANDEM_WORKER_READY)"
ip netns exec "$B" "$bin/tandem-router" "${common[@]}" --http-host "$IPB" \
    --http-port 8000 --router-min-initial-workers 1 --enforce-disagg --expose-worker-id \
    --api-key two-host-key >"$work/router.log" 2>&1 &
pids+=($!)
echo "host B: $(wait_line "$work/router.log" TANDEM_ROUTER_READY)"
n=0
until ip netns exec "$B" curl -sf "http://$IPB:8000/health" >/dev/null; do
    n=$((n + 1)); [ "$n" -lt 600 ] || { echo "router never healthy" >&2; tail "$work/router.log" >&2; exit 1; }
    sleep 0.1
done

model=$(ip netns exec "$B" curl -s "http://$IPB:8000/v1/models" \
    -H 'Authorization: Bearer two-host-key' | sed 's/.*"id":"\([^"]*\)".*/\1/')
ok=0
for i in $(seq 1 8); do
    prompt=$(seq -s ' ' $((i * 1000)) $((i * 1000 + 299)))   # ~300 tokens: over the threshold
    code=$(ip netns exec "$B" curl -s -o "$work/resp-$i.json" -D "$work/head-$i" -w '%{http_code}' \
        "http://$IPB:8000/v1/completions" -H 'Authorization: Bearer two-host-key' \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$model\", \"prompt\": \"$prompt\", \"max_tokens\": 8}")
    if [ "$code" = 200 ] && grep -qi '^x-tandem-prefill-worker-id' "$work/head-$i"; then
        ok=$((ok + 1))
    else
        echo "request $i: HTTP $code $(head -c 300 "$work/resp-$i.json")" >&2
    fi
done
echo "disaggregated across hosts: $ok/8 requests served with a prefill worker on host A"

# KV bytes the prefill worker on A pushed to B, from its /metrics.
http_a=$(sed 's/.*http=\([^ ]*\).*/\1/' <<<"$prefill")
ip netns exec "$A" curl -s "http://$http_a/metrics" | grep -E '^trtllm_kv_transfer_(bytes|success)' || true

# A's gRPC port from B: with the deployment's certificate the TLS handshake succeeds (curl gets
# an HTTP/2 answer); without one it is refused.
grpc_a=$(sed 's/.*grpc=\([^ ]*\).*/\1/' <<<"$prefill")
probe() {
    ip netns exec "$B" curl -s --max-time 5 --cacert "$pki/ca.crt" --http2 \
        --resolve "tandem.internal:${grpc_a##*:}:${grpc_a%:*}" \
        "https://tandem.internal:${grpc_a##*:}/" -o /dev/null "$@"
}
probe --cert "$pki/node.crt" --key "$pki/node.key" \
    || { echo "FAIL: the deployment's own certificate was refused" >&2; exit 1; }
echo "host A's gRPC port accepted the deployment's certificate"
if probe; then
    echo "FAIL: host A's gRPC port served a client without a certificate" >&2
    exit 1
fi
echo "host A's gRPC port refused a client without a certificate"
[ "$ok" = 8 ] || exit 1
