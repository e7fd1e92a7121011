#!/usr/bin/env bash
# The disaggregation stage of scripts/gpu-check: CUDA prefill and decode workers on the same
# GPU, KV blocks GPU to GPU over UCX (cuda_ipc; the CUDA-enabled UCX of PyPI libucx-cu13
# must come first in LD_LIBRARY_PATH, with UCX_MODULE_DIR set), against aggregated serving
# and against disaggregation over TCP (host staging), on the given model:
#   same      fixed prompts (100 to 3,000 tokens, so partial and many blocks), greedy and
#             seeded sampling, one at a time: disaggregated output over UCX must equal the
#             aggregated output token for token (and TCP's too)
#   ttft      TTFT at 512 / 2k / 8k-token prompts, one request at a time (tandem-loadtest),
#             for agg, disagg over UCX (the default layer groups, then each of
#             TANDEM_GPU_LAYER_GROUPS_COMPARE, default "1 4") and disagg over TCP, in one run:
#             what disaggregation adds to the first token; with the prefill worker's time in
#             KV writes per request and the part of it after the last layer was computed, and
#             the means of the disaggregation phases (reserve, prefill call, compute) and of
#             the UCX lanes' batch phases (queue, issue, complete)
#   cancel    streams cut mid-prefill and mid-decode on the UCX path, then a normal load must
#             still complete with every request served (pins and leases released)
#   kill      kill -9 of the prefill worker, then of the decode worker, each under load on the
#             UCX path: the load must end (failed requests allowed, none hung), and once the
#             launcher has restarted the worker a normal load must be served in full
#   ttl       one-second leases under a burst of 8k-token prompts on the UCX path: the burst
#             ends, a normal load is then served in full, and the decode worker holds no lease
#             and no KV block afterwards
# TANDEM_GPU_DISAGG_CASES=ttft runs only same + ttft for agg and UCX.
# Usage: disagg_check.sh BIN_DIR MODEL_DIR OUT_DIR. Exit status non-zero when a case fails.
set -uo pipefail
BIN=$1
MODEL=$2
OUT=$3
. "$(dirname "$0")/serve_lib.sh"
ISLS=${TANDEM_GPU_TTFT_ISLS:-512 2048 8192}
TTFT_N=${TANDEM_GPU_TTFT_REQUESTS:-24}
# TANDEM_GPU_DISAGG_CASES=ttft: only the outputs and TTFT of aggregated and UCX serving (no
# fault cases, layer groups or TCP).
CASES=${TANDEM_GPU_DISAGG_CASES:-all}

# Fixed completions, one at a time; writes "<name>.json" (texts per prompt and mode).
outputs() { # name
    python3 - "$URL" "$OUT/outputs_$1.json" <<'PY'
import json, sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
res = {}
for n in (100, 257, 700, 1500, 3000):
    prompt = [(i * 7919 + n) % 150000 + 10 for i in range(n)]
    for mode, extra in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 1.0, "seed": 1234})):
        body = {"model": model, "prompt": prompt, "max_tokens": 32, "ignore_eos": True, **extra}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        r = json.load(urllib.request.urlopen(req, timeout=120))
        res[f"{n}/{mode}"] = r["choices"][0]["text"]
json.dump(res, open(out, "w"), indent=1)
print(f"{len(res)} outputs")
PY
}

same() { # a b
    python3 - "$OUT/outputs_$1.json" "$OUT/outputs_$2.json" "$1" "$2" <<'PY'
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
diff = [k for k in a if a[k] != b.get(k)]
print(f"{sys.argv[4]} vs {sys.argv[3]}: {len(a) - len(diff)}/{len(a)} outputs equal" + (f"; differ: {diff}" if diff else ""))
sys.exit(1 if diff or len(a) != len(b) else 0)
PY
}

# A worker's /metrics address in a topology's log (`tandem up` prints "<role> worker <i>
# ready at ... /metrics: http://..."); empty when there is none.
worker_metrics() { # name role
    grep -o "$2 worker [0-9]* ready at .*/metrics: http://[^)]*" "$OUT/serve_$1.log" | tail -1 | sed 's/.*metrics: //'
}

# Sums and counts of the workers' timing histograms (`_sum`/`_count` of the write times, the
# disaggregation phases and the UCX lanes' batch phases), one JSON object per scrape.
scrape_timings() { # metrics address...
    python3 - "$@" <<'PY'
import json, re, sys, urllib.request
want = ("tandem_kv_transfer_write_seconds", "tandem_kv_transfer_exposed_seconds",
        "tandem_disagg_phase_seconds", "tandem_kv_transfer_ucx_phase_seconds")
out = {}
for addr in sys.argv[1:]:
    if not addr:
        continue
    try:
        text = urllib.request.urlopen(addr + "/metrics", timeout=10).read().decode()
    except OSError:
        continue
    for line in text.splitlines():
        m = re.match(r"^(\w+?)_(sum|count)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in want:
            key = m.group(1) + (m.group(3) or "")
            out.setdefault(key, [0.0, 0.0])["sum count".split().index(m.group(2))] += float(m.group(4))
print(json.dumps(out))
PY
}

# Per request (or per batch, for UCX phases): the mean of every timing histogram between two
# scrapes.
print_timings() { # name isl before after
    python3 - "$@" <<'PY'
import json, sys
name, isl, b, a = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
for key in sorted(a):
    s = a[key][0] - b.get(key, [0, 0])[0]
    n = a[key][1] - b.get(key, [0, 0])[1]
    if n > 0:
        print(f"timing {name} isl {isl}: {key} mean {s / n * 1e3:.3f} ms over {n:.0f}")
w, e = (a.get(k, [0, 0]) for k in ("tandem_kv_transfer_write_seconds", "tandem_kv_transfer_exposed_seconds"))
bw, be = (b.get(k, [0, 0]) for k in ("tandem_kv_transfer_write_seconds", "tandem_kv_transfer_exposed_seconds"))
wn, en = w[1] - bw[1], e[1] - be[1]
if wn > 0:
    wm = (w[0] - bw[0]) / wn * 1e3
    em = (e[0] - be[0]) / en * 1e3 if en > 0 else float("nan")
    print(f"transfer {name} isl {isl}: writes {wm:.3f} ms per request, {em:.3f} ms of them after the "
          f"last layer was computed ({100 * (1 - em / wm) if wm > 0 else 0:.0f}% hidden)")
PY
}

ttft() { # name
    local isl rc=0 pm dm before after
    pm=$(worker_metrics "$1" prefill)
    dm=$(worker_metrics "$1" decode)
    for isl in $ISLS; do
        before=$(scrape_timings "$pm" "$dm")
        "$BIN/tandem-loadtest" --url "$URL" --wait-for-model 300 --quiet --out "$OUT/ttft_$1_$isl" \
            --num-requests "$TTFT_N" --concurrency 1 --isl "$isl" --osl 2 --vocab-hi 150000 \
            > "$OUT/ttft_$1_$isl.txt" 2>&1 || rc=1
        python3 - "$OUT/ttft_$1_$isl/report.json" "$1" "$isl" <<'PY' | tee -a "$OUT/ttft_summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))["summary"]
t = r["ttft_ms"]
i = r["itl_ms"]
print(f"ttft {sys.argv[2]} isl {sys.argv[3]}: p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f} ms "
      f"(second token after {i['p50']:.2f} ms p50), {r['succeeded']}/{r['requests']} ok")
sys.exit(0 if r["failed"] == 0 else 1)
PY
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        after=$(scrape_timings "$pm" "$dm")
        # Where the time went: writes (and the part after the last computed layer), the
        # disaggregation phases, the UCX lanes' batch phases.
        print_timings "$1" "$isl" "$before" "$after" | tee -a "$OUT/ttft_summary.txt"
    done
    return $rc
}

wait_model() {
    "$BIN/tandem-loadtest" --url "$URL" --wait-for-model 300 --quiet --num-requests 2 --concurrency 1 \
        --isl 64 --osl 2 --vocab-hi 150000 --out "$OUT/warm_$1" > /dev/null 2>&1
}

: > "$OUT/ttft_summary.txt"
up agg --topology agg
wait_model agg && outputs agg && ttft agg
case_result agg_reference $?
stop

up disagg_ucx --topology disagg --kv-transport ucx --router-arg=--enforce-disagg
wait_model disagg_ucx
rc=0
grep -q "GPU KV pool registered with UCX" "$OUT/serve_disagg_ucx.log" \
    || { echo "disagg_ucx: the decode worker did not register its GPU pool with UCX"; rc=1; }
outputs disagg_ucx && same agg disagg_ucx || rc=1
case_result same_ucx $rc
ttft disagg_ucx
case_result ttft_ucx $?
stop
# The same with the first token held until every KV write is done (TTFT includes the
# transfer), for comparison.
DYN_FIRST_TOKEN_BEFORE_KV_WRITES=false up disagg_ucx_late --topology disagg --kv-transport ucx \
    --router-arg=--enforce-disagg
wait_model disagg_ucx_late
ttft disagg_ucx_late
case_result ttft_ucx_late $?
if [ "$CASES" = ttft ]; then
    stop
    echo "disagg_check: $fails case(s) failed (TTFT cases only)"
    cat "$OUT/ttft_summary.txt"
    [ "$fails" -eq 0 ]
    exit
fi
stop
up disagg_ucx --topology disagg --kv-transport ucx --router-arg=--enforce-disagg
wait_model disagg_ucx
# cancel: streams cut mid-prefill (8k prompts) and mid-decode, then a normal load.
name=$(curl -s "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
for i in $(seq 1 6); do
    curl -sN --max-time 0.05 "$URL/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$name\",\"prompt\":[$(seq -s, 1000 9000)],\"max_tokens\":64,\"stream\":true}" \
        > /dev/null 2>&1
    curl -sN --max-time 0.4 "$URL/v1/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$name\",\"prompt\":[$(seq -s, 100 900)],\"max_tokens\":4000,\"stream\":true,\"ignore_eos\":true}" \
        > /dev/null 2>&1
done
"$BIN/tandem-loadtest" --url "$URL" --quiet --out "$OUT/load_cancel_ucx" --num-requests 64 --concurrency 16 \
    --isl uniform:256:4096 --osl 32 --vocab-hi 150000 > "$OUT/load_cancel_ucx.txt" 2>&1
python3 - "$OUT/load_cancel_ucx/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["summary"]
print(f"cancel_ucx: after cut streams {r['succeeded']}/{r['requests']} ok, "
      f"{r['output_token_throughput']:.0f} out tok/s, TTFT p50 {r['ttft_ms']['p50']:.1f} ms")
sys.exit(0 if r["failed"] == 0 and r["succeeded"] == r["requests"] else 1)
PY
case_result cancel_ucx $?
# kill: each worker role killed under load, then restarted by the launcher.
served() { # name: a load of 32 served in full
    "$BIN/tandem-loadtest" --url "$URL" --quiet --out "$OUT/load_$1" --num-requests 32 --concurrency 8 \
        --isl uniform:256:4096 --osl 16 --vocab-hi 150000 > "$OUT/load_$1.txt" 2>&1
    python3 - "$OUT/load_$1/report.json" "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["summary"]
print(f"{sys.argv[2]}: {r['succeeded']}/{r['requests']} ok, errors {r['errors']}")
sys.exit(0 if r["failed"] == 0 and r["succeeded"] == r["requests"] else 1)
PY
}
for role in prefill decode; do
    rc=0
    timeout 180 "$BIN/tandem-loadtest" --url "$URL" --quiet --out "$OUT/load_kill_$role" --num-requests 48 \
        --concurrency 8 --isl 4096 --osl 32 --vocab-hi 150000 > "$OUT/load_kill_$role.txt" 2>&1 &
    lt=$!
    sleep 3
    victim=$(pgrep -f "tandem-$role .*--disaggregation-mode" | head -1)
    [ -n "$victim" ] && kill -9 "$victim" || { echo "kill_$role: no $role worker found"; rc=1; }
    wait "$lt"; [ $? -eq 124 ] && { echo "kill_$role: the load hung"; rc=1; }
    # Back once a request goes through again (the launcher restarts the worker).
    for _ in $(seq 1 90); do
        curl -sf --max-time 20 "$URL/v1/completions" -H 'content-type: application/json' \
            -d "{\"model\":\"$name\",\"prompt\":[1,2,3,4,5,6,7,8],\"max_tokens\":2}" > /dev/null && break
        sleep 2
    done
    served "after_kill_$role" || rc=1
    case_result "kill_$role" $rc
done
stop
grep -E "ERROR|panicked" "$OUT/serve_disagg_ucx.log" | head -20

# ttl: leases of one second, under a burst of 8k-token prompts that queues prefills past
# it: the burst must end (failures allowed), a normal load must then be served in full, and
# the decode worker must end with no lease and no KV block held.
gauge() { # metrics address, name
    curl -sf "$1/metrics" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $2} END {print s + 0}'
}
up disagg_ucx_ttl --topology disagg --kv-transport ucx --router-arg=--enforce-disagg \
    --worker-arg=--kv-lease-ttl-secs --worker-arg=1
wait_model disagg_ucx_ttl
rc=0
timeout 180 "$BIN/tandem-loadtest" --url "$URL" --quiet --out "$OUT/load_ttl_burst" --num-requests 48 \
    --concurrency 48 --isl 8192 --osl 4 --vocab-hi 150000 > "$OUT/load_ttl_burst.txt" 2>&1
[ $? -eq 124 ] && { echo "ttl: the burst hung"; rc=1; }
python3 - "$OUT/load_ttl_burst/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["summary"]
print(f"ttl burst: {r['succeeded']}/{r['requests']} ok, errors {r['errors']}")
PY
served after_ttl || rc=1
dm=$(worker_metrics disagg_ucx_ttl decode)
for _ in $(seq 1 60); do
    [ "$(gauge "$dm" tandem_kv_leases)" = 0 ] && [ "$(gauge "$dm" dynamo_component_kv_cache_active_blocks)" = 0 ] && break
    sleep 1
done
leases=$(gauge "$dm" tandem_kv_leases); active=$(gauge "$dm" dynamo_component_kv_cache_active_blocks)
echo "ttl: decode worker after the loads: $leases leases, $active KV blocks in use"
[ "$leases" = 0 ] && [ "$active" = 0 ] || rc=1
case_result ttl_ucx $rc
stop

# The same over UCX with layer groups (N groups of layers put while the step computes), TTFT and
# write times side by side with the default's.
for g in ${TANDEM_GPU_LAYER_GROUPS_COMPARE:-1 4}; do
    DYN_KV_TRANSFER_LAYER_GROUPS=$g up "disagg_ucx_g$g" --topology disagg --kv-transport ucx \
        --router-arg=--enforce-disagg
    wait_model "disagg_ucx_g$g"
    outputs "disagg_ucx_g$g" && same agg "disagg_ucx_g$g"
    case_result "same_ucx_g$g" $?
    ttft "disagg_ucx_g$g"
    case_result "ttft_ucx_g$g" $?
    stop
done

up disagg_tcp --topology disagg --kv-transport tcp --router-arg=--enforce-disagg
wait_model disagg_tcp
outputs disagg_tcp && same agg disagg_tcp
case_result same_tcp $?
ttft disagg_tcp
case_result ttft_tcp $?
stop

echo "disagg_check: $fails case(s) failed"
cat "$OUT/ttft_summary.txt"
[ "$fails" -eq 0 ]
