# Shared by the serving stages of scripts/gpu-check (serve_check.sh, burst_check.sh): the
# caller sets BIN, MODEL and OUT, then starts topologies with `up` and stops them with `stop`.
PORT=${TANDEM_SERVE_PORT:-18080}
URL=http://127.0.0.1:$PORT
fails=0
pid=

stop() {
    if [ -n "$pid" ]; then
        kill -INT "$pid" 2>/dev/null
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null
        pid=
    fi
}
trap stop EXIT

up() { # name, extra args for tandem up...
    local name=$1; shift
    "$BIN/tandem" up --model-path "$MODEL" --http-port "$PORT" --worker-arg=--device --worker-arg=cuda \
        "$@" > "$OUT/serve_$name.log" 2>&1 &
    pid=$!
}

case_result() { if [ "$2" -eq 0 ]; then echo "case $1: PASS"; else echo "case $1: FAIL"; fails=$((fails + 1)); fi; }

