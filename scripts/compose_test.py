#!/usr/bin/env python3
"""compose/disagg.yml for real: up (health checks), requests through the official `openai`
client, `--scale decode=2` with both replicas used, `docker kill` of one decode replica under
load (requests started once the router noticed succeed), the planner (profile `planner`,
docker actuator) scaling prefill and decode up to its minimum of 2 (replicas it creates
serve) and, once its minimum is lowered to 1, back down under load (the stopped replicas
drained: exit code 0, no request failed), `down -v` leaving nothing behind.

With `--topology epd`, compose/epd.yml: up, image requests through the `openai` client (the
image tokens counted, the same image twice an embedding-cache hit on the encode worker, the
embedding bytes written by the encode workers equal to those the prefill and decode workers
received), `--scale encode=2` with both replicas encoding, `down -v` leaving nothing behind.

With `--topology sim`, compose/sim.yml (simulated workers): up, the requests of disagg.yml,
`down -v` leaving nothing behind.

Needs the images (scripts/images) and `docker compose` v2. Prints `== step` lines, timings,
and PASS; exits non-zero naming the failed check.
    python3 scripts/compose_test.py [--topology disagg|epd|sim] [--keep]
"""

import base64
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = sys.argv[sys.argv.index("--topology") + 1] if "--topology" in sys.argv else "disagg"
if TOPOLOGY not in ("disagg", "epd", "sim"):
    sys.exit(f"--topology {TOPOLOGY}: expected disagg, epd or sim")
FILE = os.path.join(ROOT, "compose", f"{TOPOLOGY}.yml")
PROJECT = "tandem-ci-" + secrets.token_hex(3)
KEY = "sk-compose-" + secrets.token_hex(12)
MODEL = "tandem-tiny-vl" if TOPOLOGY == "epd" else "tandem-tiny"
IMAGES = os.path.join(ROOT, "scripts", "goldens", "llava_images")
# The tiny LLaVA: 16 image tokens of 64 f32 values.
IMAGE_TOKENS = 16
IMAGE_BYTES = IMAGE_TOKENS * 64 * 4
# Requests routed to a killed replica fail until the router notices it; after this long,
# every request must succeed.
NOTICE_WITHIN_S = 15.0


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT = free_port()
ENV = dict(
    os.environ,
    TANDEM_PORT=str(PORT),
    TANDEM_API_KEYS=KEY,
    DYN_EXPOSE_WORKER_ID="true",
)


def compose(*args, check=True, capture=False, timeout=300):
    cmd = ["docker", "compose", "--progress", "quiet", "-p", PROJECT, "-f", FILE, *args]
    r = subprocess.run(cmd, env=ENV, text=True, timeout=timeout,
                       stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.STDOUT if capture else None)
    if check and r.returncode != 0:
        if capture:
            print(r.stdout)
        subprocess.run(["docker", "compose", "-p", PROJECT, "-f", FILE, "logs", "--tail", "40"],
                       env=ENV)
        fail(f"docker compose {' '.join(args)} exited {r.returncode}")
    return r.stdout if capture else ""


def docker_lines(*args):
    r = subprocess.run(["docker", *args], text=True, stdout=subprocess.PIPE, check=True)
    return [l for l in r.stdout.splitlines() if l.strip()]


def client():
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key=KEY,
                         timeout=30, max_retries=0)


def chat(c, text, max_tokens=8):
    """One chat completion; returns (content, decode worker id, prefill worker id)."""
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens, temperature=0)
    body = raw.parse()
    return (body.choices[0].message.content, raw.headers.get("x-tandem-worker-id"),
            raw.headers.get("x-tandem-prefill-worker-id"))


def step_up():
    print(f"== up: {FILE} as project {PROJECT}, API on 127.0.0.1:{PORT}", flush=True)
    t = time.monotonic()
    compose("up", "-d", "--wait", "--wait-timeout", "180")
    took = time.monotonic() - t
    print(f"   healthy after {took:.1f} s", flush=True)
    return took


def step_requests(c):
    print("== requests through the openai client", flush=True)
    models = [m.id for m in c.models.list().data]
    if MODEL not in models:
        fail(f"/v1/models lists {models}, not {MODEL}")
    try:
        openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="wrong",
                      max_retries=0).models.list()
        fail("a wrong API key was accepted")
    except openai.AuthenticationError:
        pass
    text, decode, _ = chat(c, "Hello there, how are you today?")
    if not text:
        fail("empty completion")
    # A long prompt is prefilled by the prefill worker and its KV pushed to the decode worker.
    long_prompt = " ".join(f"word{i}" for i in range(400))
    text, decode, prefill = chat(c, long_prompt)
    if not text or not prefill:
        fail(f"the long prompt was not served disaggregated (prefill worker: {prefill})")
    stream = c.chat.completions.create(model=MODEL, stream=True, max_tokens=6,
                                       messages=[{"role": "user", "content": "Count to five"}])
    pieces = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    if not "".join(pieces):
        fail("the stream carried no text")
    print(f"   ok (decode worker {decode}, prefill worker {prefill}, {len(pieces)} stream chunks)",
          flush=True)


def step_scale(c):
    print("== scale decode to 2: both replicas serve", flush=True)
    compose("up", "-d", "--wait", "--wait-timeout", "180", "--scale", "decode=2")
    both_decode_replicas_serve(c, "Request")


def both_decode_replicas_serve(c, tag):
    """Concurrent requests until two decode workers answered: while one replica is busy, the
    router sends the next to the other (ties go to the emptier cache: the new one)."""
    seen = set()
    deadline = time.monotonic() + 60
    i = 0
    while len(seen) < 2:
        if time.monotonic() > deadline:
            fail(f"after {i} requests only decode workers {seen} served")
        batch = []
        threads = [threading.Thread(
            target=lambda n=n: batch.append(chat(c, f"{tag} {i + n}: say something.", 24)[1]))
            for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        seen.update(batch)
        i += len(threads)
    print(f"   decode workers {sorted(seen)} served ({i} requests)", flush=True)


def step_kill(c):
    print("== docker kill one decode replica under load", flush=True)
    ids = docker_lines("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                       "--filter", "label=com.docker.compose.service=decode")
    if len(ids) != 2:
        fail(f"expected 2 decode containers, found {len(ids)}")
    results = []  # (start time, ok)
    stop = threading.Event()

    def load(n):
        j = 0
        while not stop.is_set():
            start = time.monotonic()
            try:
                chat(c, f"Load {n}-{j}: go on.", max_tokens=4)
                ok = True
            except Exception:  # noqa: BLE001 - any failure counts as one
                ok = False
            results.append((start, ok))
            j += 1

    threads = [threading.Thread(target=load, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    time.sleep(2)
    killed_at = time.monotonic()
    subprocess.run(["docker", "kill", ids[0]], check=True, stdout=subprocess.DEVNULL)
    time.sleep(NOTICE_WITHIN_S + 10)
    stop.set()
    for t in threads:
        t.join(60)
    after = [(s - killed_at, ok) for s, ok in results if s >= killed_at]
    failed = [round(s, 1) for s, ok in after if not ok]
    late = [s for s in failed if s > NOTICE_WITHIN_S]
    print(f"   {len(after)} requests after the kill, {len(failed)} failed"
          f"{' (started at +' + ', '.join(map(str, failed[:8])) + ' s)' if failed else ''}",
          flush=True)
    if len(after) < 10:
        fail(f"only {len(after)} requests ran after the kill")
    if late:
        fail(f"requests started {late} s after the kill still failed (> {NOTICE_WITHIN_S} s)")
    return failed


def running(service):
    return docker_lines("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                        "--filter", f"label=com.docker.compose.service={service}")


def wait_for(what, pred, timeout):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.5)


def planner(min_endpoint, *args):
    ENV.update(PLANNER_MIN_ENDPOINT=str(min_endpoint), PLANNER_INTERVAL="2",
               PLANNER_SCALE_DOWN_INTERVALS="2",
               DOCKER_GID=str(os.stat("/var/run/docker.sock").st_gid))
    compose("--profile", "planner", *args)


def step_planner(c):
    print("== planner (docker actuator): minimum 2 scales prefill and decode up", flush=True)
    compose("up", "-d", "--wait", "--wait-timeout", "180", "--scale", "decode=1")
    t = time.monotonic()
    # --wait: the planner is healthy once every role has its minimum registered.
    planner(2, "up", "-d", "--wait", "--wait-timeout", "180")
    for service in ("prefill", "decode"):
        if len(running(service)) != 2:
            fail(f"{service}: {len(running(service))} replicas running, expected 2")
    print(f"   2 prefill + 2 decode replicas registered after {time.monotonic() - t:.1f} s",
          flush=True)
    both_decode_replicas_serve(c, "Planner")

    print("== planner minimum 1: idle replicas drained away under load", flush=True)
    before = {s: set(running(s)) for s in ("prefill", "decode")}
    results = []
    stop = threading.Event()

    def load():
        j = 0
        while not stop.is_set():
            try:
                chat(c, f"Steady {j}: go on.", max_tokens=4)
                results.append(True)
            except Exception as e:  # noqa: BLE001 - any failure counts
                results.append(False)
                print(f"   request failed: {e}", flush=True)
            j += 1

    th = threading.Thread(target=load)
    th.start()
    t = time.monotonic()
    planner(1, "up", "-d", "--no-deps", "--wait", "--wait-timeout", "120", "planner")
    wait_for("the planner to drain prefill and decode to 1 replica each",
             lambda: all(len(running(s)) == 1 for s in ("prefill", "decode")), 120)
    took = time.monotonic() - t
    stop.set()
    th.join(60)
    for s in ("prefill", "decode"):
        for cid in before[s] - set(running(s)):
            code = docker_lines("inspect", "-f", "{{.State.ExitCode}}", cid)[0]
            if code != "0":
                fail(f"{s} replica {cid[:12]} exited {code}: not drained (SIGKILL is 137)")
    if not results or not all(results):
        fail(f"{results.count(False)} of {len(results)} requests failed during the scale-down")
    print(f"   down to 1 + 1 after {took:.1f} s; {len(results)} requests meanwhile, none failed;"
          " the stopped replicas exited 0 (drained)", flush=True)


def service_metrics(service):
    """Each replica of `service`: its /metrics as {"name{labels}": value}."""
    ids = docker_lines("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                       "--filter", f"label=com.docker.compose.service={service}")
    out = []
    for cid in ids:
        r = subprocess.run(["docker", "exec", cid, "sh", "-c",
                            "curl -fsS http://$(hostname -i | cut -d' ' -f1):9090/metrics"],
                           text=True, stdout=subprocess.PIPE, check=True)
        values = {}
        for line in r.stdout.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        out.append(values)
    return out


def total(replicas, prefix):
    return sum(v for m in replicas for k, v in m.items() if k.startswith(prefix))


def image_chat(c, name):
    """A chat completion of one image and a question; returns (content, prompt tokens)."""
    with open(os.path.join(IMAGES, name), "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    body = c.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[{
        "role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this picture? " * 20}]}])
    return body.choices[0].message.content, body.usage.prompt_tokens


def step_images(c):
    print("== image requests: encode workers write the embeddings", flush=True)
    first, tokens = image_chat(c, "a_gradient.png")
    again, tokens_again = image_chat(c, "a_gradient.png")
    _, text_tokens = chat_tokens(c)
    if not first or first != again:
        fail(f"the same image prompt gave {first!r} then {again!r}")
    if tokens != tokens_again or tokens < IMAGE_TOKENS:
        fail(f"prompt tokens {tokens} / {tokens_again} do not count the {IMAGE_TOKENS} image tokens")
    enc = service_metrics("encode")
    hits = total(enc, 'tandem_encode_images_total{cache="hit"}')
    misses = total(enc, 'tandem_encode_images_total{cache="miss"}')
    if (hits, misses) != (1, 1):
        fail(f"encode cache hits/misses {hits}/{misses}, want 1/1")
    written = total(enc, "tandem_encode_bytes_written_total")
    received = total(service_metrics("prefill") + service_metrics("decode"),
                     "tandem_worker_embedding_bytes_received_total")
    if written != 2 * IMAGE_BYTES or received != written:
        fail(f"embedding bytes written {written}, received {received}, want {2 * IMAGE_BYTES}")
    print(f"   ok ({tokens} prompt tokens, cache 1 hit / 1 miss, {int(written)} bytes moved; "
          f"text prompt {text_tokens} tokens)", flush=True)


def chat_tokens(c):
    body = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": "Hello there"}])
    return body.choices[0].message.content, body.usage.prompt_tokens


def step_scale_encode(c):
    print("== scale encode to 2: both replicas encode", flush=True)
    compose("up", "-d", "--wait", "--wait-timeout", "180", "--scale", "encode=2")
    names = ["b_stripes.png", "a_gradient.png"]
    deadline = time.monotonic() + 60
    i = 0
    while True:
        per = [m.get('tandem_encode_images_total{cache="miss"}', 0)
               + m.get('tandem_encode_images_total{cache="hit"}', 0)
               for m in service_metrics("encode")]
        if len(per) == 2 and all(per):
            break
        if time.monotonic() > deadline:
            fail(f"after {i} image requests the encode replicas served {per}")
        image_chat(c, names[i % 2])
        i += 1
    print(f"   encode replicas served {per} images", flush=True)


def step_down():
    print("== down -v leaves nothing", flush=True)
    compose("--profile", "planner", "down", "-v", "--timeout", "60")
    label = f"label=com.docker.compose.project={PROJECT}"
    left = (docker_lines("ps", "-aq", "--filter", label)
            + docker_lines("network", "ls", "-q", "--filter", label)
            + docker_lines("volume", "ls", "-q", "--filter", label))
    if left:
        fail(f"left behind: {left}")


def main():
    keep = "--keep" in sys.argv
    up = step_up()
    ok = False
    failed = []
    try:
        c = client()
        if TOPOLOGY == "epd":
            step_images(c)
            step_scale_encode(c)
        elif TOPOLOGY == "sim":
            step_requests(c)
        else:
            step_requests(c)
            step_scale(c)
            failed = step_kill(c)
            step_planner(c)
        ok = True
    finally:
        if not ok and not keep:
            compose("logs", "--tail", "30", check=False)
        if not keep:
            step_down()
    print(json.dumps({"up_to_healthy_s": round(up, 1), "failed_after_kill": len(failed)}))
    print(f"PASS compose/{TOPOLOGY}.yml", flush=True)


if __name__ == "__main__":
    main()
