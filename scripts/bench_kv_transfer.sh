#!/usr/bin/env bash
# KV transfer benchmark: tandem-kv-transfer between two processes over UCX host memory, with
# the block layout of a Qwen3-0.6B-shaped model (28 layers, 8 KV heads, head dim 128, block 32,
# bf16: 3,670,016 B per block, 131,072 B per layer of a block), then `ucx_perftest -t
# ucp_put_bw` (server + client on 127.0.0.1) at the same message sizes, one after the other on
# the same machine with the same UCX, and the ratios. See docs/benchmarks.md "## KV transfer".
#
# Needs: a built transfer_bench (built here unless BENCH is set) and UCX with ucx_perftest:
# Debian's libucx-dev + ucx-utils by default, or TANDEM_UCX_DIR=<dir with bin/ and lib/> (e.g. the
# unpacked PyPI wheel libucx-cu13: TANDEM_UCX_DIR=/tmp/ucx/libucx), which is then put first in
# LD_LIBRARY_PATH for both programs.
#
# Order per variant: ucx_perftest, tandem-kv-transfer (each lane count), ucx_perftest again;
# ratios use the higher of the two perftest figures.
# Env: BLOCKS (64), ITERS (5), LANES ("1 <default>": one run per lane count), BATCH (64,16),
# VARIANTS ("default"; add "memcpy" on UCX >= 1.16 to also run both programs with
# UCX_PROTOS=^put/offload/zcopy, i.e. shared-memory puts as a memcpy instead of cma),
# PERF_ITERS_LARGE (500), PERF_ITERS_SMALL (5000), PORT (13370), HEAP (1: also a run into a
# registered heap pool), TCP (1: also the TCP transport), BENCH (prebuilt binary),
# MEMORY (host; `cuda`: source blocks and pool in GPU memory of device 0, GPU to GPU through
# a CUDA-enabled UCX — transfer_bench built with `--features cuda-bench` — against
# `ucx_perftest -m cuda`; HEAP and TCP runs are then skipped), CUDA_PAIR (with MEMORY=cuda:
# "S,R", the sender's and the receiver's GPU of transfer_bench, e.g. "1,0" on a two-GPU
# machine, where ucx_perftest's client sends from GPU 1 to its server's GPU 0 — its rule,
# group index modulo the GPU count — so both measure the same pair over NVLink).
# Figures are in MiB/s (2^20 B/s), the unit ucx_perftest prints as "MB/s".
set -euo pipefail
cd "$(dirname "$0")/.."

BLOCKS=${BLOCKS:-64}
ITERS=${ITERS:-5}
BATCH=${BATCH:-64,16}
VARIANTS=${VARIANTS:-default}
PERF_ITERS_LARGE=${PERF_ITERS_LARGE:-500}
PERF_ITERS_SMALL=${PERF_ITERS_SMALL:-5000}
PORT=${PORT:-13370}
MEMORY=${MEMORY:-host}
case $MEMORY in
    host) POOL=alloc HEAP=${HEAP:-1} TCP=${TCP:-1} ;;
    cuda) POOL=cuda HEAP=0 TCP=0 ;;
    *) echo "MEMORY must be host or cuda, not '$MEMORY'" >&2; exit 2 ;;
esac
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

if [[ -n ${TANDEM_UCX_DIR:-} ]]; then
    export LD_LIBRARY_PATH="$TANDEM_UCX_DIR/lib:$TANDEM_UCX_DIR/../libucx_cu13.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export UCX_MODULE_DIR="$TANDEM_UCX_DIR/lib/ucx"
    PERFTEST="$TANDEM_UCX_DIR/bin/ucx_perftest"
    UCX_INFO="$TANDEM_UCX_DIR/bin/ucx_info"
else
    PERFTEST=ucx_perftest
    UCX_INFO=ucx_info
fi
if [[ -z ${BENCH:-} ]]; then
    cargo build --release -q -p tandem-kv-transfer --example transfer_bench
    BENCH=target/release/examples/transfer_bench
fi
NPROC=$(nproc)
DEFAULT_LANES=$((NPROC < 4 ? NPROC : 4))
LANES=${LANES:-"1 $DEFAULT_LANES"}
UCX_VERSION=$("$UCX_INFO" -v | sed -n 's/^# \(Library version:\|Version\) *//p' | head -1)

echo "== machine: $NPROC CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')), load $(cut -d' ' -f1-3 /proc/loadavg), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo); UCX $UCX_VERSION"

variant_args() { [[ $1 == memcpy ]] && echo "--ucx PROTOS=^put/offload/zcopy" || true; }
variant_env() { [[ $1 == memcpy ]] && echo "UCX_PROTOS=^put/offload/zcopy" || true; }

# Which transports/protocols UCX picks for puts (one short run with UCX's info log).
for v in $VARIANTS; do
    # shellcheck disable=SC2046
    env $(variant_env "$v") UCX_LOG_LEVEL=info UCX_PROTO_INFO=y UCX_LOG_FILE="$TMP/ucx.%p" \
        "$BENCH" --blocks 2 --iters 1 --batch 2 --lanes 1 --pool "$POOL" >/dev/null 2>&1 || true
    # UCX < 1.16: the ep_cfg info line; later: the protocol table of ucp_put* to host memory.
    chosen=$(cat "$TMP"/ucx.* 2>/dev/null | sed 's/^\[[^]]*\] *\[[^]]*\] *//' | awk -v mem="$MEMORY" '
        /ep_cfg/ { sub(/.*INFO */, ""); print; next }
        $0 ~ "remote memory write by ucp_put\\* from " mem " memory to " mem { put = 1; next }
        /ucp_context|by ucp_/ { put = 0 }
        put && /\| *[0-9][0-9.]*[KMG]?\.\.[0-9a-z]+ *\|/ { gsub(/ +/, " "); print }' \
        | sort -u | tr '\n' ';' || true)
    echo "== UCX protocols, tandem-kv-transfer, variant $v: ${chosen:-n/a}"
    rm -f "$TMP"/ucx.*
done

# transfer_bench's GPUs from CUDA_PAIR (none: device 0 for both).
PAIR_ARGS=()
if [[ -n ${CUDA_PAIR:-} ]]; then
    [[ $MEMORY == cuda ]] || { echo "CUDA_PAIR needs MEMORY=cuda" >&2; exit 2; }
    [[ $CUDA_PAIR =~ ^([0-9]+),([0-9]+)$ ]] || { echo "CUDA_PAIR must be S,R (GPU indexes), not '$CUDA_PAIR'" >&2; exit 2; }
    PAIR_ARGS=(--cuda-device "${BASH_REMATCH[1]}" --receiver-cuda-device "${BASH_REMATCH[2]}")
fi

run() {
    local tag=$1
    shift
    echo "== transfer_bench $* ${PAIR_ARGS[*]}"
    "$BENCH" --blocks "$BLOCKS" --iters "$ITERS" --batch "$BATCH" "$@" "${PAIR_ARGS[@]}" | tee "$TMP/out_$tag" ||
        echo "transfer_bench $* FAILED"
}

perftest() {
    local size=$1 iters=$2 port=$3 v=$4
    # shellcheck disable=SC2046
    env $(variant_env "$v") "$PERFTEST" -p "$port" -m "$MEMORY" >/dev/null 2>&1 &
    local srv=$!
    sleep 1
    # shellcheck disable=SC2046
    env $(variant_env "$v") "$PERFTEST" 127.0.0.1 -p "$port" -t ucp_put_bw -s "$size" \
        -m "$MEMORY" -n "$iters" -w $((iters / 10)) >"$TMP/perf_${v}_$size" 2>&1 || true
    wait "$srv" || true
    # "Final: iters p50 avg overall bw_avg bw_overall ..." -> overall bandwidth, MiB/s
    awk '/Final/ {print $7}' "$TMP/perf_${v}_$size"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }'; }
# "best X MiB/s, mean Y MiB/s" of the line starting with $2 in file $1; $3 = best|mean.
field() { grep "^$2" "$1" | head -1 | sed -E "s/.*$3 ([0-9.]+) MiB\/s.*/\1/"; }

max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a > b ? a : b) }'; }

# ucx_perftest at both sizes; prints "<3670016 figure> <131072 figure>".
perftests() {
    local v=$1
    echo "== ucx_perftest -t ucp_put_bw -m $MEMORY, variant $v (server + client on 127.0.0.1)" >&2
    local large small
    large=$(perftest 3670016 "$PERF_ITERS_LARGE" "$PORT" "$v")
    small=$(perftest 131072 "$PERF_ITERS_SMALL" $((PORT + 1)) "$v")
    PORT=$((PORT + 2))
    echo "ucx_perftest -s 3670016 -n $PERF_ITERS_LARGE: $large MiB/s" >&2
    echo "ucx_perftest -s 131072  -n $PERF_ITERS_SMALL: $small MiB/s" >&2
    echo "$large $small"
}

SUMMARY=$TMP/summary
for v in $VARIANTS; do
    # ucx_perftest, then ours, then ucx_perftest again: same machine, same UCX, one after the
    # other; ratios are taken against the higher of the two perftest figures.
    read -r P1_LARGE P1_SMALL < <(perftests "$v")
    for l in $LANES; do
        # shellcheck disable=SC2046
        run "${v}_$l" --backend UCX --pool "$POOL" --lanes "$l" $(variant_args "$v")
    done
    read -r P2_LARGE P2_SMALL < <(perftests "$v")
    P_LARGE=$(max "$P1_LARGE" "$P2_LARGE")
    P_SMALL=$(max "$P1_SMALL" "$P2_SMALL")
    echo "$v ucx_perftest 3670016 B: $P1_LARGE before, $P2_LARGE after; 131072 B: $P1_SMALL before, $P2_SMALL after" >>"$SUMMARY"
    for l in $LANES; do
        f=$TMP/out_${v}_$l
        for b in ${BATCH//,/ }; do
            best=$(field "$f" "serving $b " best)
            mean=$(field "$f" "serving $b " mean)
            echo "$v lanes=$l serving $b x 3670016 B: best $best ($(ratio "$best" "$P_LARGE")), mean $mean ($(ratio "$mean" "$P_LARGE")) vs perftest $P_LARGE" >>"$SUMMARY"
        done
        best=$(field "$f" "per-layer" best)
        mean=$(field "$f" "per-layer" mean)
        echo "$v lanes=$l per-layer 131072 B: best $best ($(ratio "$best" "$P_SMALL")), mean $mean ($(ratio "$mean" "$P_SMALL")) vs perftest $P_SMALL" >>"$SUMMARY"
        best=$(field "$f" "hot" best)
        echo "$v lanes=$l hot 3670016 B: best $best ($(ratio "$best" "$P_LARGE")) vs perftest $P_LARGE" >>"$SUMMARY"
        grep "^local copy" "$f" | sed "s/^/$v lanes=$l /" >>"$SUMMARY"
    done
done
if [[ $HEAP == 1 ]]; then
    run heap --backend UCX --pool heap --lanes "$DEFAULT_LANES"
fi
if [[ $TCP == 1 ]]; then
    run tcp --backend TCP --pool heap
fi
echo "== summary (MiB/s; ratio = tandem-kv-transfer / the higher ucx_perftest figure at the same message size)"
cat "$SUMMARY"
