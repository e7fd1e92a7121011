#!/usr/bin/env bash
# Image requests on the tiny LLaVA: TTFT through `tandem up --topology epd` (E/P/D: encode workers
# write the embeddings into the prefill and decode workers) against `--topology agg` (each worker
# encodes its own images) and `--topology disagg` (EP/D: the prefill worker encodes), the last two
# with every prompt prefilled remotely (--enforce-disagg); same binaries and workload, one
# tandem-loadtest run each; then the
# encode worker's throughput under a saturating run (images/s of its tower, from its metrics).
# Every request carries a different image (generated here), so neither the embedding cache nor
# the prefix cache hides the encoding.
#
#   PROFILE      cargo profile of the binaries (default release)
#   REQUESTS     requests per run (default 64), CONCURRENCY (default 1), ISL (default 128),
#                OSL (default 8), IMAGES distinct images (default = REQUESTS)
#   UP_ARGS      more flags for every `tandem up` (e.g. "--worker-arg=--device --worker-arg=cuda")
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${PROFILE:-release}
bin=target/$profile
for b in tandem tandem-router tandem-prefill tandem-decode tandem-encode tandem-loadtest; do
    [ -x "$bin/$b" ] || { echo "missing $bin/$b (cargo build --profile $profile -p $b)" >&2; exit 1; }
done
requests=${REQUESTS:-64} concurrency=${CONCURRENCY:-1} isl=${ISL:-128} osl=${OSL:-8}
images=${IMAGES:-$requests}
work=$(mktemp -d)
port=18433
up_pid=""
cleanup() {
    if [ -n "$up_pid" ]; then kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# Distinct 224x224 RGB PNGs (random noise, a seed per image): written with zlib, no imaging
# library needed.
python3 - "$work/images" "$images" <<'PY'
import os, random, struct, sys, zlib
out, n = sys.argv[1], int(sys.argv[2])
os.makedirs(out)
def chunk(kind, data):
    c = kind + data
    return struct.pack(">I", len(data)) + c + struct.pack(">I", zlib.crc32(c) & 0xFFFFFFFF)
for i in range(n):
    rng = random.Random(i)
    w = h = 224
    rows = b"".join(b"\x00" + bytes(rng.getrandbits(8) for _ in range(w * 3)) for _ in range(h))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))
    with open(os.path.join(out, f"img{i:04d}.png"), "wb") as f:
        f.write(png)
PY

wait_healthy() { # wait_healthy URL (bounded)
    local start=$SECONDS
    until [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ]; do
        [ $((SECONDS - start)) -lt 300 ] || { echo "not healthy within 300 s: $1" >&2; exit 1; }
        sleep 0.2
    done
}

load() { # load NAME CONCURRENCY REQUESTS
    "$bin/tandem-loadtest" --url "http://127.0.0.1:$port" --num-requests "$3" \
        --concurrency "$2" --isl "$isl" --osl "$osl" --prompt-mode text \
        --images "$work/images" --quiet --out "$work/$1" >/dev/null
    python3 - "$1" "$work/$1/report.json" <<'PY'
import json, sys
name, path = sys.argv[1], sys.argv[2]
s = json.load(open(path))["summary"]
t, e = s["ttft_ms"], s["e2e_ms"]
print(f"   {name:14s} TTFT p50 {t['p50']:8.1f} ms  p90 {t['p90']:8.1f} ms   "
      f"E2E p50 {e['p50']:8.1f} ms   {s['succeeded']}/{s['requests']} ok")
PY
}

up() { # up TOPOLOGY (disagg and epd prefill every prompt on the prefill worker)
    local extra=()
    [ "$1" = agg ] || extra=(--router-arg=--enforce-disagg)
    # shellcheck disable=SC2206 # UP_ARGS is a list of flags, split on purpose
    extra+=(${UP_ARGS:-})
    "$bin/tandem" up --topology "$1" --builtin-model tiny-vl --kv-transport tcp \
        --http-port "$port" --insecure-internal "${extra[@]}" > "$work/up-$1.log" 2>&1 &
    up_pid=$!
    wait_healthy "http://127.0.0.1:$port"
}

down() {
    kill "$up_pid"; wait "$up_pid" 2>/dev/null || true; up_pid=""
}

echo "== $requests image requests (ISL $isl text tokens + 16 image tokens, OSL $osl), concurrency $concurrency ($profile binaries)"
for topo in agg disagg epd; do
    up "$topo"
    load "$topo" "$concurrency" "$requests"
    down
done

echo "== encode worker throughput: $images distinct images, concurrency 16"
up epd
metrics=$(sed -n 's|^tandem: encode worker 0 ready at .*metrics: \(http://[^)]*\)).*|\1|p' "$work/up-epd.log")
[ -n "$metrics" ] || { echo "no encode worker address in $work/up-epd.log" >&2; exit 1; }
load saturate 16 "$images"
curl -s "$metrics/metrics" > "$work/encode.metrics"
down
python3 - "$work/encode.metrics" <<'PY'
import sys
m = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    key, _, value = line.rpartition(" ")
    m[key] = float(value)
runs = m.get("tandem_encode_run_seconds_count", 0)
secs = m.get("tandem_encode_run_seconds_sum", 0)
imgs = m.get("tandem_encode_batch_images_sum", 0)
misses = m.get('tandem_encode_images_total{cache="miss"}', 0)
print(f"   tower: {imgs:.0f} images in {runs:.0f} runs ({imgs / max(runs, 1):.1f} per run), "
      f"{secs:.3f} s of tower time: {imgs / max(secs, 1e-9):.0f} images/s; {misses:.0f} cache misses")
PY
