#!/usr/bin/env python3
"""The planner's ramp benchmark: one load that ramps and then shifts, served by simulated
disaggregated workers (tandem-mocker prefill and pd workers behind tandem-router
--enforce-disagg), once with tandem-planner's local actuator scaling both roles and once per
static split. Per run: SLA attainment, GPU-seconds (replicas integrated over the load) and
goodput per GPU-second; for the planner run, replicas over time against the offered rate,
drawn as an SVG.

The load (tandem-loadtest, Poisson arrivals, no shared prefixes):
  phase A, prefill-heavy: ISL 1024, OSL 16, the rate ramping from R to 4R over 60 s, then 30 s
  at 4R; phase B, decode-heavy: ISL 128, OSL 256 at 4R for 60 s.

With --sla-profile FILE the planner scales on estimated TTFT and ITL against the SLA
(--load-signal sla) from that profile, which `tandem-planner profile` first measures on one
simulated worker (the same mocker settings) when FILE does not exist.

With --actuator docker the same load runs against compose/sim.yml (the workers simulated in
containers, the planner as its `planner` service with the docker actuator, static splits with
`--scale`), on the images of scripts/images; replicas are the running worker containers.

Usage: scripts/bench_planner.py [--bin target/debug] [--out bench-planner] [--rate 1.5]
       [--splits 1x1,2x1,1x2,2x2] [--skip-planner] [--sla-profile FILE]
       [--actuator local|docker]
Binaries: tandem-router, tandem-mocker, tandem-planner, tandem-loadtest (cargo build
--workspace --bins). Writes OUT/results.json, OUT/replicas.svg and each run's loadtest output.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# The simulated engine: 10x slower than Dynamo's mocker fit, so a few req/s load it on 2 cores;
# a 64k-token KV pool per worker and a 4k context, so the load thresholds bite.
MOCKER = [
    "--speedup-ratio", "0.1", "--block-size", "16", "--num-gpu-blocks-override", "4096",
    "--max-num-batched-tokens", "4096", "--max-model-len", "4096", "--publish-kv-events",
    "--rpc-host", "127.0.0.1", "--system-host", "127.0.0.1", "--insecure-internal",
]
SLA_TTFT_MS = 3000.0
SLA_ITL_MS = 300.0
PLANNER = [
    "--planner-mode", "disagg", "--actuator", "local", "--optimization-target", "latency",
    "--load-adjustment-interval", "3", "--min-endpoint", "1", "--max-endpoint", "3",
    "--max-gpu-budget", "6", "--insecure-internal",
]


def phases(rate):
    """(name, loadtest flags, seconds) of the two phases."""
    top = 4 * rate
    return [
        ("A", ["--rate", str(rate), "--rate-to", str(top), "--ramp-secs", "60",
               "--duration", "90", "--isl", "1024", "--osl", "16"], 90),
        ("B", ["--rate", str(top), "--duration", "60", "--isl", "128", "--osl", "256"], 60),
    ]


class Topology:
    """A router and the workers (or the planner that starts them), on a private discovery
    folder; everything is stopped with SIGTERM and reaped."""

    def __init__(self, bins, workdir):
        self.bins = bins
        self.dir = Path(tempfile.mkdtemp(prefix="tandem-bench-planner-", dir=workdir))
        self.env = dict(os.environ, DYN_FILE_KV=str(self.dir / "disc"),
                        DYN_DISCOVERY_BACKEND="file", RUST_LOG="warn")
        self.procs = []

    def spawn(self, args, ready=None):
        log = open(self.dir / f"{Path(args[0]).name}-{len(self.procs)}.log", "w")
        p = subprocess.Popen(args, env=self.env, stdout=subprocess.PIPE, stderr=log, text=True)
        self.procs.append(p)
        line = None
        if ready:
            deadline = time.time() + 180
            for line in p.stdout:
                if line.startswith(ready):
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"{args[0]}: no {ready} line")
            else:
                raise RuntimeError(f"{args[0]} exited before {ready}: see {log.name}")
        threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
        return line

    def mocker(self, mode):
        return [str(self.bins / "tandem-mocker"), "--disaggregation-mode", mode] + MOCKER

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def field(line, key):
    m = re.search(rf"{key}(\S+)", line or "")
    if not m:
        raise RuntimeError(f"no {key} in {line!r}")
    return m.group(1)


def wait_health(url, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("router not healthy")


def replicas_by_role(disc):
    """Registered prefill and decode instances in the file discovery folder."""
    counts = {"prefill": 0, "decode": 0}
    for f in Path(disc).rglob("*"):
        if f.is_file() and "instances" in f.parts:
            try:
                role = json.loads(f.read_text()).get("role")
            except (OSError, ValueError):
                continue
            if role == "prefill":
                counts["prefill"] += 1
            elif role in ("pd", "decode"):
                counts["decode"] += 1
    return counts


def run_load(bins, base, out, rate):
    """Both phases back to back; the loadtest reports of each."""
    reports = []
    for name, flags, _ in phases(rate):
        d = out / f"phase-{name}"
        subprocess.run(
            [str(bins / "tandem-loadtest"), "--url", base, "--num-requests", "1000000",
             "--prefix-ratio", "0", "--sla-ttft-ms", str(SLA_TTFT_MS),
             "--sla-itl-ms", str(SLA_ITL_MS), "--quiet", "--out", str(d)] + flags,
            check=True, stdout=subprocess.DEVNULL)
        reports.append(json.loads((d / "report.json").read_text())["summary"])
    return reports


def profile_mocker(bins, workdir, path):
    """`tandem-planner profile` of one simulated aggregated worker, written to `path`."""
    topo = Topology(bins, workdir)
    try:
        worker = topo.spawn(topo.mocker("agg"), "TANDEM_WORKER_READY")
        line = topo.spawn([str(bins / "tandem-router"), "--http-host", "127.0.0.1",
                           "--http-port", "0", "--insecure-internal",
                           "--router-min-initial-workers", "1"], "TANDEM_ROUTER_READY")
        base = "http://" + field(line, "http=")
        wait_health(base)
        subprocess.run(
            [str(bins / "tandem-planner"), "profile", "--url", base,
             "--worker-metrics-url", f"http://{field(worker, 'http=')}/metrics",
             "--out", str(path), "--isl", "128,512,1024,2048,3072",
             "--contexts", "256,1024,1792", "--batches", "1,4,16,32",
             "--decode-tokens", "32", "--repeats", "1"],
            check=True)
    finally:
        topo.stop()


def load_while_sampling(bins, base, out, rate, samples, count):
    """Both phases of the load; meanwhile `count()` (replicas by role) every second into
    `samples` as (seconds, counts)."""
    stop = threading.Event()
    t0 = time.time()

    def sample():
        while not stop.is_set():
            samples.append((time.time() - t0, count()))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return run_load(bins, base, out, rate)
    finally:
        stop.set()
        sampler.join()


def one_run(bins, workdir, out, rate, split=None, planner_args=()):
    """A static split `(p, d)` or, with None, the planner. Returns the run's figures."""
    topo = Topology(bins, workdir)
    out.mkdir(parents=True, exist_ok=True)
    samples = []
    try:
        if split:
            for _ in range(split[0]):
                topo.spawn(topo.mocker("prefill"), "TANDEM_WORKER_READY")
            for _ in range(split[1]):
                topo.spawn(topo.mocker("pd"), "TANDEM_WORKER_READY")
        else:
            spec = {
                "prefill": {"program": str(bins / "tandem-mocker"),
                            "args": ["--disaggregation-mode", "prefill"] + MOCKER},
                "decode": {"program": str(bins / "tandem-mocker"),
                           "args": ["--disaggregation-mode", "pd"] + MOCKER},
            }
            (topo.dir / "spec.json").write_text(json.dumps(spec))
        # Throughput scaling reads the router's counters from its start: the router first.
        line = topo.spawn([str(bins / "tandem-router"), "--http-host", "127.0.0.1",
                           "--http-port", "0", "--enforce-disagg", "--insecure-internal",
                           "--router-min-initial-workers", "0"], "TANDEM_ROUTER_READY")
        base = "http://" + field(line, "http=")
        if not split:
            topo.spawn([str(bins / "tandem-planner"), *PLANNER, *planner_args,
                        "--local-workers-spec", str(topo.dir / "spec.json"),
                        "--router-metrics-url", base + "/metrics",
                        "--decisions-out", str(out / "decisions.jsonl")],
                       "TANDEM_PLANNER_READY")
        wait_health(base)
        reports = load_while_sampling(bins, base, out, rate, samples,
                                      lambda: replicas_by_role(topo.dir / "disc"))
    finally:
        topo.stop()
    return figures(reports, samples, split)


ROOT = Path(__file__).resolve().parent.parent


def one_run_docker(bins, out, rate, split=None):
    """compose/sim.yml: a static split `(p, d)` with --scale, or the planner's service."""
    out.mkdir(parents=True, exist_ok=True)
    project = f"tandem-bench-{os.getpid()}"
    port = free_port()
    flags = dict(zip(PLANNER[::2], PLANNER[1::2]))
    env = dict(
        os.environ, TANDEM_PORT=str(port), ENFORCE_DISAGG="true", RUST_LOG="warn",
        MOCKER_ARGS=" ".join(a for a in MOCKER if a not in (
            "--rpc-host", "--system-host", "127.0.0.1", "--insecure-internal")),
        DOCKER_GID=str(os.stat("/var/run/docker.sock").st_gid),
        PLANNER_MIN_ENDPOINT=flags["--min-endpoint"], PLANNER_MAX_ENDPOINT=flags["--max-endpoint"],
        PLANNER_MAX_GPU_BUDGET=flags["--max-gpu-budget"],
        PLANNER_INTERVAL=flags["--load-adjustment-interval"],
        PLANNER_OPTIMIZATION_TARGET=flags["--optimization-target"])

    def compose(*args):
        subprocess.run(["docker", "compose", "--progress", "quiet", "-p", project, "-f",
                        str(ROOT / "compose" / "sim.yml"), *args], env=env, check=True,
                       stdout=subprocess.DEVNULL)

    def running(service):
        r = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}",
             "--filter", f"label=com.docker.compose.service={service}"],
            text=True, stdout=subprocess.PIPE, check=True)
        return len(r.stdout.split())

    samples = []
    try:
        if split:
            compose("up", "-d", "--wait", "--scale", f"prefill={split[0]}",
                    "--scale", f"decode={split[1]}")
        else:
            compose("--profile", "planner", "up", "-d", "--wait")
        base = f"http://127.0.0.1:{port}"
        wait_health(base)
        reports = load_while_sampling(
            bins, base, out, rate, samples,
            lambda: {"prefill": running("prefill"), "decode": running("decode")})
        if not split:
            r = subprocess.run(["docker", "compose", "-p", project, "-f",
                                str(ROOT / "compose" / "sim.yml"), "logs", "planner"],
                               env=env, text=True, stdout=subprocess.PIPE)
            (out / "planner.log").write_text(r.stdout)
    finally:
        compose("--profile", "planner", "down", "-v", "--timeout", "60")
    return figures(reports, samples, split)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def figures(reports, samples, split):
    requests = sum(r["requests"] for r in reports)
    met = sum(r["sla_met"] for r in reports)
    failed = sum(r["failed"] for r in reports)
    gpu_s = 0.0
    for (t0, c), (t1, _) in zip(samples, samples[1:]):
        gpu_s += (c["prefill"] + c["decode"]) * (t1 - t0)
    return {
        "config": f"static {split[0]}p+{split[1]}d" if split else "planner",
        "requests": requests, "failed": failed, "sla_met": met,
        "attainment": met / requests if requests else 0.0,
        "gpu_seconds": gpu_s,
        "goodput_per_gpu_s": met / gpu_s if gpu_s else 0.0,
        "replicas": [(round(t, 1), c["prefill"], c["decode"]) for t, c in samples],
    }


def svg(run, rate, path):
    """Replicas of each role over time, with the offered rate (right axis)."""
    pts = run["replicas"]
    if not pts:
        return
    w, h, pad = 720, 300, 45
    t_end = max(p[0] for p in pts) or 1.0
    top = 4.0
    x = lambda t: pad + (w - 2 * pad) * t / t_end
    y = lambda n: h - pad - (h - 2 * pad) * n / top

    def offered(t):
        if t < 60:
            return rate + 3 * rate * t / 60
        return 4 * rate

    def steps(i):
        out, last = [], None
        for p in pts:
            if last is not None:
                out.append(f"{x(p[0]):.1f},{y(last):.1f}")
            out.append(f"{x(p[0]):.1f},{y(p[i]):.1f}")
            last = p[i]
        return " ".join(out)

    rate_line = " ".join(f"{x(t):.1f},{y(offered(t) * top / (4 * rate) * 0.999):.1f}"
                         for t in range(0, int(t_end) + 1, 2))
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
    ]
    for n in range(0, int(top) + 1):
        lines.append(f'<text x="{pad - 15}" y="{y(n) + 4:.1f}">{n}</text>')
    for t in range(0, int(t_end) + 1, 30):
        lines.append(f'<text x="{x(t) - 8:.1f}" y="{h - pad + 16}">{t}s</text>')
    b = x(90)
    lines += [
        f'<line x1="{b:.1f}" y1="{pad}" x2="{b:.1f}" y2="{h - pad}" stroke="#999" stroke-dasharray="4"/>',
        f'<text x="{x(20):.1f}" y="{pad - 10}">A: ISL 1024 / OSL 16, rate ramps</text>',
        f'<text x="{b + 8:.1f}" y="{pad - 10}">B: ISL 128 / OSL 256</text>',
        f'<polyline fill="none" stroke="#bbb" stroke-width="2" points="{rate_line}"/>',
        f'<polyline fill="none" stroke="#d62728" stroke-width="2" points="{steps(1)}"/>',
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{steps(2)}"/>',
        f'<text x="{w - 200}" y="{pad + 10}" fill="#d62728">prefill replicas</text>',
        f'<text x="{w - 200}" y="{pad + 26}" fill="#1f77b4">decode replicas</text>',
        f'<text x="{w - 200}" y="{pad + 42}" fill="#888">offered rate (4 = {4 * rate:g} req/s)</text>',
        "</svg>",
    ]
    Path(path).write_text("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/debug")
    ap.add_argument("--out", default="bench-planner")
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--splits", default="1x1,2x1,1x2,2x2")
    ap.add_argument("--skip-planner", action="store_true")
    ap.add_argument("--planner-arg", action="append", default=[],
                    help="extra tandem-planner flag (repeat), e.g. --planner-arg=--scale-down-intervals=1")
    ap.add_argument("--actuator", choices=["local", "docker"], default="local")
    ap.add_argument("--sla-profile", help="scale on estimated TTFT/ITL from this profile "
                    "(measured first when missing)")
    a = ap.parse_args()
    bins, out = Path(a.bin).resolve(), Path(a.out).resolve()
    for b in ["tandem-router", "tandem-mocker", "tandem-planner", "tandem-loadtest"]:
        if not (bins / b).is_file():
            sys.exit(f"{bins / b} missing: cargo build --workspace --bins")
    out.mkdir(parents=True, exist_ok=True)
    if a.sla_profile:
        profile = Path(a.sla_profile).resolve()
        if not profile.is_file():
            print(f"== profile of one simulated worker -> {profile}", flush=True)
            profile_mocker(bins, out, profile)
        a.planner_arg += ["--load-signal", "sla", "--planner-profile-data", str(profile),
                          "--ttft", str(SLA_TTFT_MS), "--itl", str(SLA_ITL_MS)]
    configs = [] if a.skip_planner else [None]
    configs += [tuple(int(n) for n in s.split("x")) for s in a.splits.split(",") if s]
    results = []
    for split in configs:
        name = f"static-{split[0]}p{split[1]}d" if split else "planner"
        print(f"== {name}", flush=True)
        if a.actuator == "docker":
            if a.planner_arg:
                sys.exit("--planner-arg and --sla-profile apply to the local actuator only")
            r = one_run_docker(bins, out / name, a.rate, split)
        else:
            r = one_run(bins, out, out / name, a.rate, split, a.planner_arg)
        print(f"   {r['requests']} requests, {r['failed']} failed, attainment "
              f"{r['attainment']:.3f}, {r['gpu_seconds']:.0f} GPU-s, goodput/GPU-s "
              f"{r['goodput_per_gpu_s']:.4f}", flush=True)
        results.append(r)
        if split is None:
            svg(r, a.rate, out / "replicas.svg")
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
