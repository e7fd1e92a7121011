#!/usr/bin/env python3
"""The chaos matrix: faults injected into a running deployment under a steady load.

Each run starts a fresh deployment on this machine (mutual TLS on every channel, from
`tandem certs`): etcd, NATS, two routers sharing their load (`--router-replica-sync`), and two
prefill + two decode workers (`pd`, KV over TCP; disaggregated topology) or two aggregated
workers (agg topology), discovery in etcd and KV events on NATS. A tandem-loadtest runs against each router (Poisson arrivals, per-request
timeout 60 s: a request still open by then counts as hung). A few seconds in, one fault hits;
when the load ends the run waits (bounded) for every surviving worker to go back to its
baseline: nothing running or waiting, no KV held by sequences, no lease live or quarantined.

Faults: kill -9 and SIGTERM of a decode (or aggregated) worker and of a prefill worker, a
decode worker frozen for 8 s (SIGSTOP, then SIGCONT: a host that stops answering, as a network
partition looks to its peers; the kernel keeps its sockets open), a silent prefill worker for
10 s (it accepts leases, then neither writes nor answers FenceLease: the failpoint
TANDEM_FAILPOINT_PREFILL_SILENT_FILE; decode workers run with a 5 s lease TTL and a 2 s
reclaim margin), decode worker 0 cut off by the network for 15 s (it runs in a network
namespace of its own, joined to the others by a veth pair whose link goes down, then up: its
peers see silence, then its connections and its etcd lease lapse; root is needed), etcd and
NATS restarted, decode worker 0 behind a fault proxy (tandem-faultproxy: every connection to
it, gRPC and KV transfer) that adds 50 ms each way and holds 5% of the chunks another 200 ms
(TCP loss as the application sees it) for 10 s, and
(killed, down 3 s, started again on the same data), and kill -9 and SIGTERM of router 2 (its
own clients fail; router 1's must not).

The load is greedy (temperature 0) and records every output with its top-2 logprob margins;
the first run of each topology has no fault ("none") and is the reference the others'
outputs are compared with: a request's tokens must equal the reference's up to its first
position whose top-2 margin is below 1e-3 (migration replays through other batches).

Per run: requests completed / failed (with the loadtest's error classes) / hung, per router;
streams migrated (both routers' dynamo_frontend_model_migration_total); time to recover
(from the fault to the first request started after it that succeeded);
whether the workers went back to baseline; and whether every surviving decode worker serves
requests again afterwards (a partitioned or frozen one must come back).

Usage: scripts/chaos.py [--bin target/debug] [--subset ci|full] [--out chaos-out]
       [--write-doc docs/reliability.md]
`ci`: disaggregated, migration on, kill -9 decode and decode partition (about 2 minutes;
CI's time is short, the other faults run in `full` and the doc's table). `full`: every fault x {agg, disagg} x migration
{on, off}. Binaries: tandem, tandem-router, tandem-decode, tandem-prefill, tandem-loadtest,
tandem-faultproxy
(cargo build --workspace --bins, the prefill worker with its `failpoints` feature). Needs etcd
and nats-server.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

RATE = 3.0  # requests per second, per router
DURATION = 24  # seconds of load
FAULT_AT = 6  # seconds into the load
FREEZE_SECS = 8
SILENT_SECS = 10
PARTITION_SECS = 15  # past the router's keep-alive (10 s) and etcd's lease TTL (10 s)
SLOW_NET = "latency_ms=50 loss=0.05 rto_ms=200"  # decode-slow-net, for FAULT_SECS
FAULT_SECS = 10
PROXIED_IP = "127.0.0.3"  # decode-0's advertised address in the decode-slow-net runs
NETNS = "tandem-chaos"
HOST_IP, NS_IP = "10.78.0.1", "10.78.0.2"  # the veth's two ends
LEASE_TTL = 5  # decode workers' --kv-lease-ttl-secs
RECLAIM_MARGIN = 2  # decode workers' --kv-lease-reclaim-margin-secs
DOWN_SECS = 3  # etcd / NATS outage
TIMEOUT = 60  # per request: past it, a request is hung
BASELINE_WAIT = 40  # seconds for the workers to settle after the load

FAULTS = ["none", "decode-kill9", "decode-sigterm", "prefill-kill9", "prefill-sigterm",
          "decode-freeze", "prefill-silent", "decode-partition", "decode-slow-net", "etcd-restart",
          "nats-restart", "router-kill9", "router-sigterm"]
CI = [("disagg", True, f) for f in ["decode-kill9", "decode-partition"]]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def field(line, key):
    m = re.search(rf"{key}(\S+)", line or "")
    if not m:
        raise RuntimeError(f"no {key} in {line!r}")
    return m.group(1)


def http_ok(url, timeout=2):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for(what, check, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


class Proc:
    """A process of the deployment: how to start it, its log, its ready line."""

    def __init__(self, dep, name, args, ready=None, env=None):
        self.dep, self.name, self.args, self.ready = dep, name, args, ready
        self.env = dict(dep.env, **(env or {}))
        self.p = None
        self.line = None

    def start(self):
        log = open(self.dep.dir / f"{self.name}.log", "a")
        self.p = subprocess.Popen(self.args, env=self.env, stdout=subprocess.PIPE,
                                  stderr=log, text=True)
        if self.ready:
            deadline = time.time() + 120
            for line in self.p.stdout:
                if line.startswith(self.ready):
                    self.line = line
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"{self.name}: no {self.ready} line")
            else:
                raise RuntimeError(f"{self.name} exited before {self.ready}: see {log.name}")
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()

    def signal(self, sig):
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)

    def stop(self, timeout=40):
        if not self.p or self.p.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


class Deployment:
    """etcd, NATS, two routers and the workers of one topology, under mutual TLS."""

    def __init__(self, bins, workdir, topology, migration, netns=False, proxy=False):
        self.bins = bins
        # With `netns`, decode-0 runs in a namespace of its own and everything else listens on
        # the host end of its veth.
        self.netns = netns
        host = HOST_IP if netns else "127.0.0.1"
        if netns:
            make_netns()
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-chaos-", dir=workdir))
        self.env = dict(os.environ, RUST_LOG="warn")
        # Only prefill-0 goes silent, while this file exists (failpoints build).
        self.silent = self.dir / "silent-prefill-0"
        # With `proxy`, decode-0 is reached through tandem-faultproxy, whose fault is this file.
        self.fault_file = self.dir / "proxy-fault"
        self.procs = {}
        pki = self.dir / "pki"
        subprocess.run([str(bins / "tandem"), "certs", "--out", str(pki), "--host", "127.0.0.1",
                        "--host", HOST_IP, "--host", NS_IP, "--host", PROXIED_IP],
                       check=True,
                       stdout=subprocess.DEVNULL)
        model = self.dir / "model"
        subprocess.run([str(bins / "tandem"), "model", "tiny", str(model)], check=True,
                       stdout=subprocess.DEVNULL)
        etcd_port, etcd_peer, etcd_metrics = free_port(), free_port(), free_port()
        self.etcd_health = f"http://127.0.0.1:{etcd_metrics}/health"
        self.add("etcd", [
            "etcd", "--name", "chaos", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", f"https://{host}:{etcd_port}",
            "--advertise-client-urls", f"https://{host}:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"chaos=http://127.0.0.1:{etcd_peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{etcd_metrics}",
            "--cert-file", str(pki / "node.crt"), "--key-file", str(pki / "node.key"),
            "--trusted-ca-file", str(pki / "ca.crt"), "--client-cert-auth",
            "--log-level", "warn"])
        nats_port = free_port()
        self.nats_port, self.nats_host = nats_port, host
        self.add("nats", [
            "nats-server", "-a", host, "-p", str(nats_port), "--tlsverify",
            "--tlscert", str(pki / "node.crt"), "--tlskey", str(pki / "node.key"),
            "--tlscacert", str(pki / "ca.crt")])
        common = ["--internal-tls-dir", str(pki), "--discovery-backend", "etcd",
                  "--etcd-endpoints", f"https://{host}:{etcd_port}",
                  "--event-plane", "nats", "--nats-server", f"tls://{host}:{nats_port}"]
        worker = common + ["--model-path", str(model), "--publish-kv-events",
                           "--kv-transport", "tcp"]

        def at(ip):
            return ["--rpc-advertise-host", ip, "--system-host", ip]
        decode_mode = "pd" if topology == "disagg" else "agg"
        workers = []
        if topology == "disagg":
            for i in range(2):
                env = {"TANDEM_FAILPOINT_PREFILL_SILENT_FILE": str(self.silent)} if i == 0 else {}
                workers.append(self.add(f"prefill-{i}", [
                    str(bins / "tandem-prefill"), "--disaggregation-mode", "prefill"] + worker
                    + at(host), "TANDEM_WORKER_READY", env))
        leases = ["--kv-lease-ttl-secs", str(LEASE_TTL),
                  "--kv-lease-reclaim-margin-secs", str(RECLAIM_MARGIN)]
        if proxy:
            # gRPC, KV transfer and the status server (its advertised address too).
            rpc, kv, status = free_port(), free_port(), free_port()
            self.add("faultproxy", [
                str(bins / "tandem-faultproxy"), "--fault-file", str(self.fault_file)] + [
                a for port in (rpc, kv, status)
                for a in ("--forward", f"{PROXIED_IP}:{port}=127.0.0.1:{port}")],
                "TANDEM_FAULTPROXY_READY")
            proxied = ["--rpc-host", "127.0.0.1", "--rpc-port", str(rpc),
                       "--kv-transfer-port", str(kv), "--rpc-advertise-host", PROXIED_IP,
                       "--system-host", "127.0.0.1", "--system-port", str(status)]
        for i in range(2):
            inside = netns and i == 0
            prefix = ["ip", "netns", "exec", NETNS] if inside else []
            where = proxied if proxy and i == 0 else at(NS_IP if inside else host)
            workers.append(self.add(f"decode-{i}", prefix + [
                str(bins / "tandem-decode"), "--disaggregation-mode", decode_mode] + worker
                + leases + where, "TANDEM_WORKER_READY"))
        self.workers = workers
        router = common + ["--http-host", "127.0.0.1", "--http-port", "0",
                           "--router-min-initial-workers", "2", "--router-replica-sync",
                           "--expose-worker-id",
                           "--migration-limit", "3" if migration else "0"]
        if topology == "disagg":
            router.append("--enforce-disagg")
        for i in range(2):
            self.add(f"router-{i}", [str(bins / "tandem-router")] + router, "TANDEM_ROUTER_READY")

    def add(self, name, args, ready=None, env=None):
        proc = Proc(self, name, args, ready, env)
        self.procs[name] = proc
        return proc

    def start(self):
        self.procs["etcd"].start()
        wait_for("etcd", lambda: http_ok(self.etcd_health))
        self.start_nats()
        for name, proc in self.procs.items():
            if name not in ("etcd", "nats"):
                proc.start()
        for i in range(2):
            wait_for(f"router {i} healthy", lambda: http_ok(self.router_url(i) + "/health"))

    def start_nats(self):
        self.procs["nats"].start()

        def greets():
            try:
                with socket.create_connection((self.nats_host, self.nats_port), timeout=1) as s:
                    return s.recv(5) == b"INFO "
            except OSError:
                return False
        wait_for("nats", greets)

    def router_url(self, i):
        return "http://" + field(self.procs[f"router-{i}"].line, "http=")

    def worker_metrics(self, proc):
        return "http://" + field(proc.line, "http=") + "/metrics"

    def stop(self, logs):
        """Stops everything; the logs are kept in `logs`."""
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        logs.mkdir(parents=True, exist_ok=True)
        for log in self.dir.glob("*.log"):
            shutil.copy(log, logs / log.name)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.netns:
            subprocess.run(["ip", "netns", "del", NETNS], check=False)


def ip(*args):
    subprocess.run(["ip", *args], check=True)


def make_netns():
    """A namespace for decode-0, joined to this one by a veth pair (HOST_IP here, NS_IP there)."""
    subprocess.run(["ip", "netns", "del", NETNS], check=False, stderr=subprocess.DEVNULL)
    ip("netns", "add", NETNS)
    ip("link", "add", "tchaos-h", "type", "veth", "peer", "name", "tchaos-n")
    ip("link", "set", "tchaos-n", "netns", NETNS)
    ip("addr", "add", f"{HOST_IP}/24", "dev", "tchaos-h")
    ip("-n", NETNS, "addr", "add", f"{NS_IP}/24", "dev", "tchaos-n")
    ip("-n", NETNS, "link", "set", "lo", "up")
    ip("-n", NETNS, "link", "set", "tchaos-n", "up")
    ip("link", "set", "tchaos-h", "up")


def gauge_sum(url, names):
    """The sum of the named gauges on a /metrics page; None when unreadable."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            total += float(line.rsplit(" ", 1)[1])
    return total


def busy_lines(url):
    """The non-zero BUSY gauges of a /metrics page (what kept a worker from its baseline)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except OSError as e:
        return [f"unreadable: {e}"]
    return [line for line in text.splitlines()
            if line.split("{")[0].split(" ")[0] in BUSY and float(line.rsplit(" ", 1)[1]) != 0]


BUSY = {"dynamo_component_running_requests", "dynamo_component_waiting_requests",
        "dynamo_component_scheduled_kv_tokens", "dynamo_component_queued_kv_tokens",
        "tandem_kv_leases"}


def inject(dep, fault):
    """Applies `fault` (and undoes what a fault of a while undoes: a freeze, a partition)."""
    p = dep.procs
    if fault == "none":
        pass
    elif fault == "decode-kill9":
        p["decode-0"].signal(signal.SIGKILL)
    elif fault == "decode-sigterm":
        p["decode-0"].signal(signal.SIGTERM)
    elif fault == "prefill-kill9":
        p["prefill-0"].signal(signal.SIGKILL)
    elif fault == "prefill-sigterm":
        p["prefill-0"].signal(signal.SIGTERM)
    elif fault == "decode-freeze":
        p["decode-0"].signal(signal.SIGSTOP)
        time.sleep(FREEZE_SECS)
        p["decode-0"].signal(signal.SIGCONT)
    elif fault == "prefill-silent":
        dep.silent.write_text("")
        time.sleep(SILENT_SECS)
        dep.silent.unlink()
    elif fault == "decode-partition":
        ip("link", "set", "tchaos-h", "down")
        time.sleep(PARTITION_SECS)
        ip("link", "set", "tchaos-h", "up")
    elif fault == "decode-slow-net":
        dep.fault_file.write_text(SLOW_NET)
        time.sleep(FAULT_SECS)
        dep.fault_file.unlink()
    elif fault == "etcd-restart":
        p["etcd"].p.kill()
        p["etcd"].p.wait()
        time.sleep(DOWN_SECS)
        p["etcd"].start()
    elif fault == "nats-restart":
        p["nats"].p.kill()
        p["nats"].p.wait()
        time.sleep(DOWN_SECS)
        dep.start_nats()
    elif fault == "router-kill9":
        p["router-1"].signal(signal.SIGKILL)
    elif fault == "router-sigterm":
        p["router-1"].signal(signal.SIGTERM)
    else:
        raise ValueError(fault)


def serving_workers(dep, timeout=30):
    """Whether every surviving decode (or aggregated) worker serves requests through router 1
    again within `timeout` (a partitioned worker must come back); sends small requests."""
    want = {field(w.line, "instance_id=") for w in dep.workers
            if w.p.poll() is None and w.name.startswith("decode")}
    base = dep.router_url(0)
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        model = json.loads(r.read())["data"][0]["id"]
    seen = set()
    deadline = time.time() + timeout
    n = 0
    while time.time() < deadline and not want <= seen:
        n += 1
        body = json.dumps({"model": model, "prompt": f"probe {n} " * (8 + n % 7),
                           "max_tokens": 2}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                seen.add(r.headers.get("x-tandem-worker-id", ""))
        except OSError:
            time.sleep(0.2)
    return want <= seen


def applies(topology, fault):
    return topology == "disagg" or not fault.startswith("prefill")


def one_run(bins, workdir, out, topology, migration, fault):
    dep = Deployment(bins, workdir, topology, migration, netns=fault == "decode-partition",
                     proxy=fault == "decode-slow-net")
    try:
        dep.start()
        loads = []
        t0 = time.time()
        for i in range(2):
            d = out / f"router-{i}"
            loads.append((d, subprocess.Popen(
                [str(bins / "tandem-loadtest"), "--url", dep.router_url(i),
                 "--rate", str(RATE), "--duration", str(DURATION),
                 "--num-requests", str(int(RATE * DURATION * 3)), "--isl", "256", "--osl", "48",
                 "--timeout", str(TIMEOUT), "--seed", str(i + 1), "--temperature", "0",
                 "--save-outputs", "--quiet", "--out", str(d)],
                stdout=subprocess.DEVNULL)))
        time.sleep(FAULT_AT)
        fault_at = time.time() - t0
        inject(dep, fault)
        for _, lt in loads:
            lt.wait(timeout=DURATION + TIMEOUT + 60)
        survivors = [w for w in dep.workers if w.p.poll() is None]
        settled = None
        deadline = time.time() + BASELINE_WAIT
        while time.time() < deadline:
            busy = [gauge_sum(dep.worker_metrics(w), BUSY) for w in survivors]
            if all(b == 0.0 for b in busy):
                settled = round(time.time() - t0 - DURATION, 1)
                break
            time.sleep(0.5)
        result = summarize(loads, fault_at, settled)
        if settled is None:
            result["unsettled"] = {w.name: busy_lines(dep.worker_metrics(w)) for w in survivors}
        result["migrated"] = int(sum(
            gauge_sum(dep.router_url(i) + "/metrics", {"dynamo_frontend_model_migration_total"})
            or 0 for i in range(2) if dep.procs[f"router-{i}"].p.poll() is None))
        result["rejoined"] = serving_workers(dep)
        return result, outputs(loads)
    finally:
        dep.stop(out / "logs")


def outputs(loads):
    """Every successful request's greedy output: {seed: (tokens, top-2 margins)}."""
    got = {}
    for d, _ in loads:
        path = d / "outputs.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                o = json.loads(line)
                got[o["seed"]] = (o["tokens"], o["margins"])
    return got


def compare(reference, got):
    """The issue's rule per request: tokens equal to the fault-free run's up to its first
    position whose top-2 margin is below 1e-3. Returns (requests compared, equal, tokens)."""
    compared = equal = tokens = 0
    for seed, (toks, _) in got.items():
        if seed not in reference:
            continue
        ref, margins = reference[seed]
        n = next((i for i, m in enumerate(margins) if m < 1e-3), len(ref))
        compared += 1
        tokens += n
        equal += toks[:n] == ref[:n] and len(toks) == len(ref)
    return {"compared": compared, "equal": equal, "tokens": tokens}


def summarize(loads, fault_at, settled):
    per_router = []
    recover = None
    for d, _ in loads:
        report = json.loads((d / "report.json").read_text())["summary"]
        errors = report.get("errors", {})
        hung = errors.get("timeout", 0)
        per_router.append({"ok": report["succeeded"], "failed": report["failed"] - hung,
                           "hung": hung, "errors": errors})
        rows = (d / "requests.csv").read_text().splitlines()[1:]
        for row in rows:
            cols = row.split(",")
            start, error = float(cols[0]), cols[-1]
            if start >= fault_at and not error:
                recover = start - fault_at if recover is None else min(recover,
                                                                       start - fault_at)
    return {"routers": per_router, "recover_s": None if recover is None else round(recover, 2),
            "settled_s": settled}


def verdict(fault, migration, r):
    """Whether the run meets the issue's rule for its fault and migration setting."""
    hung = sum(x["hung"] for x in r["routers"])
    if hung or r["settled_s"] is None or not r["rejoined"]:
        return False
    if "outputs" in r and r["outputs"]["equal"] != r["outputs"]["compared"]:
        return False
    if fault.startswith("router-"):
        return r["routers"][0]["failed"] == 0
    return not migration or all(x["failed"] == 0 for x in r["routers"])


def table(results):
    lines = ["| topology | migration | fault | router 1: ok / failed / hung | "
             "router 2: ok / failed / hung | migrated | recovered after | back to baseline | "
             "all serve again | outputs = fault-free run | rule met |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (topology, migration, fault), r in results:
        cells = [f"{x['ok']} / {x['failed']} / {x['hung']}" for x in r["routers"]]
        rec = "—" if r["recover_s"] is None else f"{r['recover_s']} s"
        base = "no" if r["settled_s"] is None else f"yes ({max(r['settled_s'], 0.0) + 0.0} s)"
        ok = "yes" if verdict(fault, migration, r) else "**no**"
        back = "yes" if r["rejoined"] else "**no**"
        o = r.get("outputs")
        same = "(reference)" if o is None else (
            f"{o['equal']} / {o['compared']} ({o['tokens']} tokens)")
        lines.append(f"| {topology} | {'on' if migration else 'off'} | {fault} | {cells[0]} | "
                     f"{cells[1]} | {r['migrated']} | {rec} | {base} | {back} | {same} | {ok} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug")
    ap.add_argument("--subset", choices=["ci", "full"], default="ci")
    ap.add_argument("--out", default="chaos-out")
    ap.add_argument("--write-doc")
    ap.add_argument("--only", help="comma-separated faults to run (of the subset)")
    a = ap.parse_args()
    bins = Path(a.bin).resolve()
    for b in ["tandem", "tandem-router", "tandem-decode", "tandem-prefill", "tandem-loadtest",
              "tandem-faultproxy"]:
        if not (bins / b).is_file():
            sys.exit(f"missing {bins / b}: cargo build --workspace --bins")
    for b in ["etcd", "nats-server"]:
        if not shutil.which(b):
            sys.exit(f"needs {b} on PATH (Debian etcd-server, nats-server)")
    runs = CI if a.subset == "ci" else [
        (t, m, f) for t in ["disagg", "agg"] for m in [True, False] for f in FAULTS
        if applies(t, f)]
    if a.only:
        runs = [r for r in runs if r[2] in a.only.split(",")]
    if os.geteuid() != 0:
        print("SKIPPED: decode-partition needs root (ip netns)")
        runs = [r for r in runs if r[2] != "decode-partition"]
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    results = []
    failed = []
    reference = {}  # topology -> the fault-free run's outputs
    for topology, migration, fault in runs:
        key = (topology, migration, fault)
        name = f"{topology}-{'mig' if migration else 'nomig'}-{fault}"
        print(f"== {name}", flush=True)
        r, got = one_run(bins, workdir, out / name, topology, migration, fault)
        if fault == "none" and topology not in reference:
            reference[topology] = got
        elif topology in reference:
            r["outputs"] = compare(reference[topology], got)
        print(f"   {json.dumps(r)}", flush=True)
        results.append((key, r))
        if not verdict(fault, migration, r):
            failed.append(name)
    shutil.rmtree(workdir, ignore_errors=True)
    md = table(results)
    (out / "table.md").write_text(md + "\n")
    print(md)
    if a.write_doc:
        doc = Path(a.write_doc)
        text = doc.read_text()
        begin, end = "<!-- chaos table -->", "<!-- end chaos table -->"
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        doc.write_text(f"{head}{begin}\n{md}\n{end}{tail}")
    if failed:
        sys.exit(f"chaos: the rule is not met in {failed}")


if __name__ == "__main__":
    main()
