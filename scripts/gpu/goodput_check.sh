#!/usr/bin/env bash
# The two-GPU goodput stage of scripts/gpu-check: disaggregated (1 prefill + 1 decode worker,
# one GPU each, KV GPU to GPU over UCX cuda_ipc) against aggregated (2 workers, one GPU each)
# serving, under a fixed SLA, on the given model (issue 36: a Llama-3-8B-shaped one, bf16).
# Per load mix (name:ISL:OSL, TANDEM_GOODPUT_MIXES, default a prefill-heavy and a decode-heavy
# one):
#   1. aggregated: the unloaded TTFT p90 and ITL p90 (one request at a time): the SLA is
#      TTFT p90 <= 2x and ITL p90 <= 1.25x those; then the saturation throughput (a closed
#      loop of TANDEM_GOODPUT_CONCURRENCY clients), which sets the request rates: each of
#      TANDEM_GOODPUT_FRACTIONS times it;
#   2. each topology at each rate, open loop (Poisson, TANDEM_GOODPUT_REQUESTS requests):
#      agg (2 workers), disagg (--enforce-disagg: every prompt on the prefill worker) and
#      cond (conditional disaggregation: prompts with fewer than TANDEM_GOODPUT_COND_TOKENS
#      uncached tokens prefill on the decode worker).
# Writes OUT/goodput_summary.txt (one line per run and a table per mix) and each loadtest
# report; every request of every run must succeed.
# Usage: goodput_check.sh BIN_DIR MODEL_DIR OUT_DIR. TANDEM_GOODPUT_DEVICES (cuda:0,cuda:1)
# names the workers' devices in start order (prefill, then decode; `cpu,cpu` rehearses the
# script without GPUs). Exit status non-zero when a run fails.
set -uo pipefail
BIN=$1
MODEL=$2
OUT=$3
. "$(dirname "$0")/serve_lib.sh"
DEVICES=${TANDEM_GOODPUT_DEVICES:-cuda:0,cuda:1}
MIXES=${TANDEM_GOODPUT_MIXES:-prefill:3072:128 decode:512:768}
FRACTIONS=${TANDEM_GOODPUT_FRACTIONS:-0.25 0.5 0.75 1.0 1.25 1.5}
REQUESTS=${TANDEM_GOODPUT_REQUESTS:-96}
BASE_REQUESTS=${TANDEM_GOODPUT_BASE_REQUESTS:-8}
CONCURRENCY=${TANDEM_GOODPUT_CONCURRENCY:-64}
COND_TOKENS=${TANDEM_GOODPUT_COND_TOKENS:-1024}
TOPOLOGIES=${TANDEM_GOODPUT_TOPOLOGIES:-agg disagg cond}
SUMMARY=$OUT/goodput_summary.txt
mkdir -p "$OUT"

# `tandem up` of a topology, its workers on $DEVICES (serve_lib's `up` puts them on cuda).
up_on() { # name, tandem up args...
    local name=$1; shift
    "$BIN/tandem" up --model-path "$MODEL" --http-port "$PORT" --insecure-internal \
        --devices "$DEVICES" "$@" > "$OUT/serve_$name.log" 2>&1 &
    pid=$!
}

start_topology() { # topology mix
    case $1 in
        agg) up_on "$1_$2" --topology agg --workers 2 ;;
        disagg) up_on "$1_$2" --router-arg=--enforce-disagg ;;
        cond) up_on "$1_$2" "--router-arg=--disagg-prefill-threshold-tokens=$COND_TOKENS" ;;
        *) echo "unknown topology $1" >&2; return 1 ;;
    esac
}

# One loadtest run; prints its report's summary as one JSON line.
load() { # name isl osl loadtest args...
    local name=$1 isl=$2 osl=$3; shift 3
    "$BIN/tandem-loadtest" --url "$URL" --wait-for-model 600 --quiet --out "$OUT/load_$name" \
        --isl "$isl" --osl "$osl" --vocab-hi 120000 "$@" > "$OUT/load_$name.txt" 2>&1
    python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["summary"]))' \
        "$OUT/load_$name/report.json"
}

field() { # json python-expression-of-s
    python3 -c "import json,sys; s=json.loads(sys.argv[1]); print($2)" "$1"
}

run_mix() { # name isl osl
    local mix=$1 isl=$2 osl=$3 s sla_ttft sla_itl rps rates=() topo f rate rc=0
    start_topology agg "$mix" || return 1
    s=$(load "${mix}_base" "$isl" "$osl" --num-requests "$BASE_REQUESTS" --concurrency 1 --seed 7) || { stop; return 1; }
    sla_ttft=$(field "$s" '2 * s["ttft_ms"]["p90"]')
    sla_itl=$(field "$s" '1.25 * s["itl_ms"]["p90"]')
    s=$(load "${mix}_saturate" "$isl" "$osl" --num-requests $((CONCURRENCY * 3)) \
        --concurrency "$CONCURRENCY" --seed 8) || { stop; return 1; }
    rps=$(field "$s" 's["request_throughput"]')
    for f in $FRACTIONS; do rates+=("$(python3 -c "print(f'{$f * $rps:.3f}')")"); done
    echo "mix $mix (ISL $isl, OSL $osl): unloaded agg SLA TTFT p90 <= $sla_ttft ms, ITL p90 <= $sla_itl ms; agg saturates at $rps req/s; rates ${rates[*]}" | tee -a "$SUMMARY"
    for topo in $TOPOLOGIES; do
        if [ "$topo" != agg ]; then stop; start_topology "$topo" "$mix" || return 1; fi
        for rate in "${rates[@]}"; do
            s=$(load "${mix}_${topo}_$rate" "$isl" "$osl" --num-requests "$REQUESTS" \
                --rate "$rate" --seed 9 --sla-ttft-ms "$sla_ttft" --sla-itl-ms "$sla_itl") || rc=1
            python3 - "$mix" "$topo" "$rate" "$s" "$sla_ttft" "$sla_itl" <<'PY' | tee -a "$SUMMARY"
import json, sys
mix, topo, rate, s = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
t, i = s["ttft_ms"], s["itl_ms"]
p90_ok = t["p90"] <= float(sys.argv[5]) and i["p90"] <= float(sys.argv[6])
print(f"run {mix} {topo} {rate} req/s: goodput {s['goodput']:.3f} req/s, {s['sla_met']}/{s['requests']} met, "
      f"p90s {'within' if p90_ok else 'outside'} the SLA, "
      f"TTFT p90 {t['p90']:.1f} ms, ITL p90 {i['p90']:.2f} ms, {s['output_token_throughput']:.0f} out tok/s, "
      f"{s['succeeded']}/{s['requests']} ok")
sys.exit(0 if s["failed"] == 0 else 1)
PY
            case_result "${mix}_${topo}_$rate" "${PIPESTATUS[0]}"
        done
    done
    stop
    return $rc
}

: > "$SUMMARY"
rc=0
for m in $MIXES; do
    IFS=: read -r name isl osl <<< "$m"
    run_mix "$name" "$isl" "$osl" || rc=1
done
# Per mix: goodput by rate and topology (requests meeting the SLA per second; * where the
# run's TTFT p90 and ITL p90 are within the SLA), each topology's best against agg's best, and
# the highest rate each serves with its p90s within the SLA.
python3 - "$SUMMARY" <<'PY' | tee -a "$SUMMARY"
import re, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"run (\S+) (\S+) (\S+) req/s: goodput (\S+) req/s, .* p90s (\S+) the SLA", line)
    if m:
        runs.setdefault(m[1], {}).setdefault(m[2], {})[float(m[3])] = (float(m[4]), m[5] == "within")
for mix, topos in runs.items():
    rates = sorted({r for t in topos.values() for r in t})
    print(f"\n{mix}: goodput (req/s meeting the SLA)\n| req/s | " + " | ".join(topos) + " |")
    print("|---|" + "---|" * len(topos))
    for r in rates:
        cell = lambda t: (lambda g: f"{g[0]:.3f}{'*' if g[1] else ''}")(topos[t].get(r, (float("nan"), False)))
        print(f"| {r:.2f} | " + " | ".join(cell(t) for t in topos) + " |")
    best = {t: max(g for g, _ in v.values()) for t, v in topos.items()}
    agg = best.get("agg", 0)
    print("best: " + ", ".join(f"{t} {b:.3f}" + (f" ({b / agg:.2f}x agg)" if agg and t != "agg" else "")
                               for t, b in best.items()))
    top = {t: max([r for r, (_, ok) in v.items() if ok], default=0.0) for t, v in topos.items()}
    print("highest rate with p90s within the SLA: " + ", ".join(f"{t} {r:.2f} req/s" for t, r in top.items()))
PY
echo "goodput_check: $fails run(s) failed"
[ "$fails" -eq 0 ] && [ "$rc" -eq 0 ]
