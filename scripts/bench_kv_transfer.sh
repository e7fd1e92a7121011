#!/usr/bin/env bash
# KV transfer benchmark: tandem-kv-transfer between two processes over UCX host memory, with
# the block layout of a Qwen3-0.6B-shaped model (28 layers, 8 KV heads, head dim 128, block 32,
# bf16: 131,072 B per layer of a block, 3,670,016 B per block), then `ucx_perftest -t
# ucp_put_bw` on loopback at the same two message sizes, and the ratios.
#
# Needs: libucx-dev + ucx-utils (ucx_perftest). Env: BLOCKS (64), ITERS (5),
# PERF_ITERS_SMALL (2000), PERF_ITERS_LARGE (300), PORT (13370).
# Figures are in MiB/s (2^20 B/s), the unit ucx_perftest prints as "MB/s".
set -euo pipefail
cd "$(dirname "$0")/.."

BLOCKS=${BLOCKS:-64}
ITERS=${ITERS:-5}
PERF_ITERS_SMALL=${PERF_ITERS_SMALL:-2000}
PERF_ITERS_LARGE=${PERF_ITERS_LARGE:-300}
PORT=${PORT:-13370}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

cargo build --release -q -p tandem-kv-transfer --example transfer_bench
BENCH=target/release/examples/transfer_bench

echo "== machine: $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg); $(ucx_info -v | head -1)"

# Which transports UCX picks (one short run with UCX's info log).
UCX_LOG_LEVEL=info UCX_LOG_FILE="$TMP/ucx.%p" "$BENCH" --blocks 2 --iters 1 >/dev/null
echo "== UCX lanes chosen by tandem-kv-transfer: $(grep -h 'ep_cfg' "$TMP"/ucx.* | sed 's/.*INFO *//' | sort -u | tr '\n' ' ')"

run() { echo "== transfer_bench $*"; "$BENCH" --blocks "$BLOCKS" --iters "$ITERS" "$@" | tee "$TMP/out"; }
run --backend UCX --pool alloc
cp "$TMP/out" "$TMP/ucx_alloc"
run --backend UCX --pool heap
cp "$TMP/out" "$TMP/ucx_heap"
run --backend TCP --pool heap

perftest() {
    local size=$1 iters=$2 port=$3
    ucx_perftest -p "$port" >/dev/null 2>&1 &
    local srv=$!
    sleep 1
    UCX_LOG_LEVEL=info UCX_LOG_FILE="$TMP/perf.%p" \
        ucx_perftest 127.0.0.1 -p "$port" -t ucp_put_bw -s "$size" -n "$iters" -w $((iters / 10)) >"$TMP/perf_$size"
    wait "$srv" || true
    # "Final: iters p50 avg overall bw_avg bw_overall ..." -> overall bandwidth, MiB/s
    awk '/Final/ {print $7}' "$TMP/perf_$size"
}
echo "== ucx_perftest -t ucp_put_bw (server + client on 127.0.0.1)"
P_SMALL=$(perftest 131072 "$PERF_ITERS_SMALL" "$PORT")
P_LARGE=$(perftest 3670016 "$PERF_ITERS_LARGE" $((PORT + 1)))
echo "ucx_perftest -s 131072  -n $PERF_ITERS_SMALL: $P_SMALL MiB/s"
echo "ucx_perftest -s 3670016 -n $PERF_ITERS_LARGE: $P_LARGE MiB/s"
echo "== UCX lanes chosen by ucx_perftest: $(grep -h 'ep_cfg' "$TMP"/perf.* | sed 's/.*INFO *//' | sort -u | tr '\n' ' ')"

# Pull "best X MiB/s" / "mean X MiB/s" out of a transfer_bench report line.
field() { grep "^$2" "$1" | sed -E "s/.*$3 ([0-9.]+) MiB\/s.*/\1/"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f%%", 100 * a / b }'; }
echo "== ratios, tandem-kv-transfer (UCX, pool=alloc) / ucx_perftest"
for pat in "per-layer:$P_SMALL" "whole-block:$P_LARGE"; do
    name=${pat%%:*} ref=${pat#*:}
    hot=$(field "$TMP/ucx_alloc" "hot $name" best)
    best=$(field "$TMP/ucx_alloc" "$name " best)
    mean=$(field "$TMP/ucx_alloc" "$name " mean)
    echo "$name: same access pattern as perftest (hot) $hot MiB/s = $(ratio "$hot" "$ref");" \
         "real layout (distinct blocks) best $best = $(ratio "$best" "$ref"), mean $mean = $(ratio "$mean" "$ref")"
done
