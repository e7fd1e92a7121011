# Shared body of slurm/agg.sbatch, slurm/disagg.sbatch and slurm/epd.sbatch: sourced by them
# after they set MODE (agg | disagg | epd). Runs in the batch step, on the job's first node. See
# slurm/README.md.
set -euo pipefail

fail() { echo "tandem-slurm: error: $*" >&2; exit 1; }
log() { echo "tandem-slurm: $(date -u +%H:%M:%S) $*"; }

[ -n "${SLURM_JOB_ID:-}" ] || fail "SLURM_JOB_ID is not set: submit this script with sbatch"
[ -n "${TANDEM_BIN_DIR:-}" ] || fail "TANDEM_BIN_DIR is not set (the folder holding tandem, tandem-router, tandem-prefill and tandem-decode on every node)"
[ -d "$TANDEM_BIN_DIR" ] || fail "TANDEM_BIN_DIR=$TANDEM_BIN_DIR is not a folder on $(hostname)"
case "$MODE" in agg | disagg | epd) ;; *) fail "MODE=$MODE is not agg, disagg or epd" ;; esac
bins=(tandem tandem-router tandem-decode)
[ "$MODE" = agg ] || bins+=(tandem-prefill)
[ "$MODE" = epd ] && bins+=(tandem-encode)
PLANNER=${PLANNER:-0}
case "$PLANNER" in 0 | 1) ;; *) fail "PLANNER=$PLANNER is not 0 or 1" ;; esac
[ "$PLANNER" = 0 ] || [ "$MODE" != epd ] || fail "PLANNER=1 scales agg and disagg jobs; epd is not supported yet"
[ "$PLANNER" = 0 ] || bins+=(tandem-planner)
for b in "${bins[@]}"; do
    [ -x "$TANDEM_BIN_DIR/$b" ] || fail "TANDEM_BIN_DIR=$TANDEM_BIN_DIR has no executable $b"
done

ROUTER_PORT=${ROUTER_PORT:-8000}
ETCD_PORT=${ETCD_PORT:-2379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-2380}
NATS_PORT=${NATS_PORT:-4222}
NATS_HTTP_PORT=${NATS_HTTP_PORT:-8222}
GPUS_PER_WORKER=${GPUS_PER_WORKER:-0}
CPUS_PER_WORKER=${CPUS_PER_WORKER:-4}
KV_TRANSPORT=${KV_TRANSPORT:-tcp}
ETCD_BIN=${ETCD_BIN:-etcd}
NATS_SERVER_BIN=${NATS_SERVER_BIN:-nats-server}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
JOB_DIR=${JOB_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/tandem-$SLURM_JOB_ID}
if [ "$MODE" = agg ]; then
    PREFILL_WORKERS=0
    DECODE_WORKERS=${DECODE_WORKERS:-${WORKERS:-1}}
else
    PREFILL_WORKERS=${PREFILL_WORKERS:-1}
    DECODE_WORKERS=${DECODE_WORKERS:-1}
fi
if [ "$MODE" = epd ]; then
    ENCODE_WORKERS=${ENCODE_WORKERS:-1}
    EMBEDDING_CACHE_GB=${EMBEDDING_CACHE_GB:-1}
    [[ $EMBEDDING_CACHE_GB =~ ^[0-9]+(\.[0-9]+)?$ ]] \
        || fail "EMBEDDING_CACHE_GB=$EMBEDDING_CACHE_GB is not a non-negative number"
else
    ENCODE_WORKERS=0
fi
PLANNER_MIN_ENDPOINT=${PLANNER_MIN_ENDPOINT:-1}
PLANNER_MAX_ENDPOINT=${PLANNER_MAX_ENDPOINT:-$((${SLURM_JOB_NUM_NODES:-1} * 2))}
PLANNER_INTERVAL=${PLANNER_INTERVAL:-10}
for v in ROUTER_PORT ETCD_PORT ETCD_PEER_PORT NATS_PORT NATS_HTTP_PORT GPUS_PER_WORKER \
    CPUS_PER_WORKER ENCODE_WORKERS PREFILL_WORKERS DECODE_WORKERS STARTUP_TIMEOUT \
    PLANNER_MIN_ENDPOINT PLANNER_MAX_ENDPOINT PLANNER_INTERVAL; do
    [[ ${!v} =~ ^[0-9]+$ ]] || fail "$v=${!v} is not a non-negative integer"
done
[ "$DECODE_WORKERS" -ge 1 ] || fail "DECODE_WORKERS must be at least 1"
[ "$MODE" = agg ] || [ "$PREFILL_WORKERS" -ge 1 ] || fail "PREFILL_WORKERS must be at least 1"
[ "$MODE" != epd ] || [ "$ENCODE_WORKERS" -ge 1 ] || fail "ENCODE_WORKERS must be at least 1"
case "$KV_TRANSPORT" in tcp | ucx) ;; *) fail "KV_TRANSPORT=$KV_TRANSPORT is not tcp or ucx" ;; esac
command -v "$ETCD_BIN" >/dev/null || fail "ETCD_BIN=$ETCD_BIN: no etcd on $(hostname)"
command -v "$NATS_SERVER_BIN" >/dev/null || fail "NATS_SERVER_BIN=$NATS_SERVER_BIN: no nats-server on $(hostname)"
command -v curl >/dev/null || fail "curl is needed on $(hostname)"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ "${#NODES[@]}" -ge 1 ] || fail "empty SLURM_JOB_NODELIST"
FIRST=${NODES[0]}

# This node's address as the other nodes reach it: the first non-loopback IPv4 address its name
# resolves to, else the first of `hostname -I`. The same logic runs in every worker step.
node_addr() {
    local a
    a=$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}')
    [ -n "$a" ] || a=$(hostname -I 2>/dev/null | awk '{print $1}')
    echo "${a:-$(hostname)}"
}
FIRST_ADDR=$(node_addr)

mkdir -p "$JOB_DIR/logs"
rm -f "$JOB_DIR/router.url" "$JOB_DIR"/logs/*.log
PKI=$JOB_DIR/pki
log "job $SLURM_JOB_ID ($MODE) on ${NODES[*]}; first node $FIRST ($FIRST_ADDR); job folder $JOB_DIR"

# The deployment's mutual-TLS folder: etcd and NATS serve node.crt, so it names the first node.
"$TANDEM_BIN_DIR/tandem" certs --out "$PKI" --host "$FIRST" --host "$FIRST_ADDR" >/dev/null
if [ -z "${MODEL_PATH:-}" ]; then
    MODEL_PATH=$JOB_DIR/model
    # The built-in tiny model; E/P/D needs a multimodal one: the tiny random LLaVA.
    tiny=tiny
    [ "$MODE" = epd ] && tiny=tiny-vl
    [ -e "$MODEL_PATH/config.json" ] || "$TANDEM_BIN_DIR/tandem" model "$tiny" "$MODEL_PATH" >/dev/null
fi
[ -e "$MODEL_PATH" ] || fail "MODEL_PATH=$MODEL_PATH does not exist"
# The router's API key: TANDEM_API_KEYS (comma-separated) when set, else a random one.
( umask 077
  if [ -n "${TANDEM_API_KEYS:-}" ]; then tr ',' '\n' <<<"$TANDEM_API_KEYS" >"$JOB_DIR/api-key"
  else head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$JOB_DIR/api-key"; echo >>"$JOB_DIR/api-key"; fi )
unset TANDEM_API_KEYS

cat >"$JOB_DIR/nats.conf" <<EOF
port: $NATS_PORT
http: "127.0.0.1:$NATS_HTTP_PORT"
tls {
  cert_file: "$PKI/node.crt"
  key_file: "$PKI/node.key"
  ca_file: "$PKI/ca.crt"
  verify: true
}
EOF

# Step launcher on the shared folder: runs the command with this node's address appended as
# --rpc-advertise-host (workers bind their gRPC and KV listeners there).
cat >"$JOB_DIR/worker.sh" <<'EOF'
#!/bin/bash
a=$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}')
[ -n "$a" ] || a=$(hostname -I 2>/dev/null | awk '{print $1}')
echo "step $SLURM_STEP_ID on $(hostname) ($a): $*" >&2
exec "$@" --rpc-advertise-host "${a:-$(hostname)}"
EOF
chmod 755 "$JOB_DIR/worker.sh"

steps=() # "pid name"
# Infrastructure steps (etcd, NATS, router) share the first node's CPUs with everything else
# (--overlap) and take no GPU.
infra_opts=(--overlap --nodes=1 --ntasks=1 --nodelist="$FIRST")
[ "$GPUS_PER_WORKER" -gt 0 ] && infra_opts+=(--gres=none)
start_step() { # name srun-options... -- command...
    local name=$1; shift
    local opts=()
    while [ "$1" != -- ]; do opts+=("$1"); shift; done
    shift
    srun "${opts[@]}" --job-name="$name" --kill-on-bad-exit=1 \
        --output="$JOB_DIR/logs/$name.log" "$@" &
    steps+=("$! $name")
}
stop_all() {
    local s
    for s in "${steps[@]}"; do kill -TERM "${s%% *}" 2>/dev/null || true; done
    wait || true
    rm -rf "${ETCD_DATA:-/nonexistent}"
}
on_term() { log "SIGTERM: stopping every step"; stop_all; exit 143; }
trap on_term TERM INT
trap 'rm -rf "${ETCD_DATA:-/nonexistent}"' EXIT

# Waits (bounded by STARTUP_TIMEOUT) until "$@" succeeds.
wait_for() {
    local what=$1 t=0; shift
    until "$@" >/dev/null 2>&1; do
        t=$((t + 1))
        [ "$t" -le $((STARTUP_TIMEOUT * 2)) ] || { log "timed out waiting for $what"; stop_all; exit 1; }
        for s in "${steps[@]}"; do
            kill -0 "${s%% *}" 2>/dev/null || { log "step ${s#* } exited while waiting for $what (see $JOB_DIR/logs/${s#* }.log)"; stop_all; exit 1; }
        done
        sleep 0.5
    done
}

ETCD_DATA=${TMPDIR:-/tmp}/tandem-etcd-$SLURM_JOB_ID
start_step etcd "${infra_opts[@]}" -- "$ETCD_BIN" --name tandem --data-dir "$ETCD_DATA" \
    --listen-client-urls "https://0.0.0.0:$ETCD_PORT" \
    --advertise-client-urls "https://$FIRST_ADDR:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "tandem=http://127.0.0.1:$ETCD_PEER_PORT" \
    --cert-file "$PKI/node.crt" --key-file "$PKI/node.key" --trusted-ca-file "$PKI/ca.crt" \
    --client-cert-auth --log-level warn
start_step nats "${infra_opts[@]}" -- "$NATS_SERVER_BIN" -c "$JOB_DIR/nats.conf"
wait_for etcd curl -sf --cacert "$PKI/ca.crt" --cert "$PKI/node.crt" --key "$PKI/node.key" \
    "https://$FIRST_ADDR:$ETCD_PORT/health"
wait_for nats curl -sf "http://127.0.0.1:$NATS_HTTP_PORT/healthz"
log "etcd https://$FIRST_ADDR:$ETCD_PORT and NATS tls://$FIRST_ADDR:$NATS_PORT are up"

# What every step inherits (srun exports the environment; set
# after etcd started, which reads ETCD_* variables as its own flags): the internal planes, all with TLS.
export TANDEM_INTERNAL_TLS_DIR=$PKI
export DYN_DISCOVERY_BACKEND=etcd
export ETCD_ENDPOINTS=https://$FIRST_ADDR:$ETCD_PORT
export DYN_EVENT_PLANE=nats
export NATS_SERVER=tls://$FIRST_ADDR:$NATS_PORT


# Workers: encode ones first, then prefill, then decode ones; worker i runs on node i mod N.
worker_opts=(--nodes=1 --ntasks=1)
if [ "$GPUS_PER_WORKER" -gt 0 ]; then
    worker_opts+=(--exact --gpus-per-task="$GPUS_PER_WORKER" --cpus-per-task="$CPUS_PER_WORKER")
else
    worker_opts+=(--overlap)
fi
common=(--model-path "$MODEL_PATH" --publish-kv-events)

# PLANNER=1: the planner, in the batch step, starts and drains the workers as job steps
# (--actuator slurm) from a spec of each role's command; each step logs to logs/<step>.log.
json_list() { # values... -> ["v1", "v2"]
    local out="" v
    for v in "$@"; do v=${v//\\/\\\\}; out+="${out:+, }\"${v//\"/\\\"}\""; done
    echo "[$out]"
}
role_spec() { # program args...
    printf '{"program": "%s", "args": %s, "srun_args": %s}' "$JOB_DIR/worker.sh" "$(json_list "$@")" \
        "$(json_list "${worker_opts[@]}" "--output=$JOB_DIR/logs/{step}.log")"
}
start_planner() {
    local spec=$JOB_DIR/planner-workers.json mode=$MODE gpus=$(( GPUS_PER_WORKER > 0 ? GPUS_PER_WORKER : 1 ))
    if [ "$MODE" = agg ]; then
        printf '{"agg": %s}\n' "$(role_spec "$TANDEM_BIN_DIR/tandem-decode" "${common[@]}" \
            --disaggregation-mode agg)" >"$spec"
    else
        printf '{"prefill": %s,\n "decode": %s}\n' \
            "$(role_spec "$TANDEM_BIN_DIR/tandem-prefill" "${common[@]}" --kv-transport "$KV_TRANSPORT")" \
            "$(role_spec "$TANDEM_BIN_DIR/tandem-decode" "${common[@]}" --disaggregation-mode pd \
                --kv-transport "$KV_TRANSPORT")" >"$spec"
    fi
    "$TANDEM_BIN_DIR/tandem-planner" --planner-mode "$mode" --actuator slurm \
        --local-workers-spec "$spec" --min-endpoint "$PLANNER_MIN_ENDPOINT" \
        --max-endpoint "$PLANNER_MAX_ENDPOINT" --max-gpu-budget "$((PLANNER_MAX_ENDPOINT * 2 * gpus))" \
        --prefill-engine-num-gpu "$gpus" --decode-engine-num-gpu "$gpus" \
        --load-adjustment-interval "$PLANNER_INTERVAL" --decisions-out "$JOB_DIR/planner-decisions.jsonl" \
        ${PLANNER_ARGS:-} >"$JOB_DIR/logs/planner.log" 2>&1 &
    steps+=("$! planner")
    log "planner: $PLANNER_MIN_ENDPOINT..$PLANNER_MAX_ENDPOINT workers per role (spec $spec)"
}
if [ "$PLANNER" = 1 ]; then
    start_planner
else
    i=0
    for ((e = 0; e < ENCODE_WORKERS; e++, i++)); do
        node=${NODES[i % ${#NODES[@]}]}
        start_step "encode-$e" "${worker_opts[@]}" --nodelist="$node" -- "$JOB_DIR/worker.sh" \
            "$TANDEM_BIN_DIR/tandem-encode" "${common[@]}" --kv-transport "$KV_TRANSPORT" \
            --multimodal-embedding-cache-capacity-gb "$EMBEDDING_CACHE_GB"
        log "encode-$e on $node"
    done
    # In E/P/D every other worker takes images and has the encode workers encode them.
    [ "$MODE" = epd ] && common+=(--enable-multimodal --encode-endpoint "dyn://${DYN_NAMESPACE:-dynamo}.encode.generate")
    for ((p = 0; p < PREFILL_WORKERS; p++, i++)); do
        node=${NODES[i % ${#NODES[@]}]}
        start_step "prefill-$p" "${worker_opts[@]}" --nodelist="$node" -- "$JOB_DIR/worker.sh" \
            "$TANDEM_BIN_DIR/tandem-prefill" "${common[@]}" --kv-transport "$KV_TRANSPORT"
        log "prefill-$p on $node"
    done
    for ((d = 0; d < DECODE_WORKERS; d++, i++)); do
        node=${NODES[i % ${#NODES[@]}]}
        if [ "$MODE" != agg ]; then
            extra=(--disaggregation-mode pd --kv-transport "$KV_TRANSPORT")
        else
            extra=(--disaggregation-mode agg)
        fi
        start_step "decode-$d" "${worker_opts[@]}" --nodelist="$node" -- "$JOB_DIR/worker.sh" \
            "$TANDEM_BIN_DIR/tandem-decode" "${common[@]}" "${extra[@]}"
        log "decode-$d on $node"
    done
fi

# The router starts once every worker has registered (its TANDEM_WORKER_READY line).
worker_ready() {
    local k
    for ((k = 0; k < ENCODE_WORKERS; k++)); do
        grep -q '^TANDEM_WORKER_READY' "$JOB_DIR/logs/encode-$k.log" 2>/dev/null || return 1
    done
    for ((k = 0; k < PREFILL_WORKERS; k++)); do
        grep -q '^TANDEM_WORKER_READY' "$JOB_DIR/logs/prefill-$k.log" 2>/dev/null || return 1
    done
    for ((k = 0; k < DECODE_WORKERS; k++)); do
        grep -q '^TANDEM_WORKER_READY' "$JOB_DIR/logs/decode-$k.log" 2>/dev/null || return 1
    done
}
if [ "$PLANNER" = 1 ]; then
    # Ready once every role has its minimum of workers registered.
    wait_for planner grep -q '^TANDEM_PLANNER_READY' "$JOB_DIR/logs/planner.log"
    log "planner ready: $PLANNER_MIN_ENDPOINT worker(s) per role registered"
    initial_workers=$PLANNER_MIN_ENDPOINT
else
    wait_for workers worker_ready
    log "all $((ENCODE_WORKERS + PREFILL_WORKERS + DECODE_WORKERS)) workers ready"
    initial_workers=$DECODE_WORKERS
fi

router_args=(--http-host 0.0.0.0 --http-port "$ROUTER_PORT" --api-key-file "$JOB_DIR/api-key"
    --router-min-initial-workers "$initial_workers")
start_step router "${infra_opts[@]}" -- "$TANDEM_BIN_DIR/tandem-router" "${router_args[@]}" \
    ${ROUTER_EXTRA_ARGS:-}
wait_for router curl -sf "http://127.0.0.1:$ROUTER_PORT/health"
echo "http://$FIRST_ADDR:$ROUTER_PORT" >"$JOB_DIR/router.url"
log "router ready: http://$FIRST_ADDR:$ROUTER_PORT (API key in $JOB_DIR/api-key)"

# Serve until scancel (Slurm sends SIGTERM to every step: workers drain) or a step ends.
set +e
wait -n
log "a step ended; stopping the others"
for s in "${steps[@]}"; do
    kill -0 "${s%% *}" 2>/dev/null || log "ended: ${s#* } (see $JOB_DIR/logs/${s#* }.log)"
done
stop_all
exit 1
