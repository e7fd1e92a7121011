"""Validates rendered Kubernetes manifests (scripts/k8s-check runs it, once per overlay).

Usage: k8s_check.py OVERLAY RENDERED.yaml K8S_VERSION DOCS_CONFIG_MD

Each document is checked against the OpenAPI schema of K8S_VERSION in strict mode
(kubernetes-validate: unknown fields are errors), then against Tandem's own invariants.
Every failure names the overlay and the object; the exit status is 1 if there is any.
"""

import re
import sys

import kubernetes_validate
import yaml

WORKER_COMMANDS = {"tandem-prefill", "tandem-decode", "tandem-encode"}
TLS_SECRET = "tandem-internal-tls"
TLS_DIR = "/etc/tandem/pki"
# Variables that are not Tandem flags: XDG_CACHE_HOME moves Tandem's cache folder
# (shared/config/src/paths.rs) onto the writable emptyDir.
EXTRA_ENV = {"XDG_CACHE_HOME"}


def known_env(config_md):
    """The env var names of the flag table in docs/config.md (its second column)."""
    names = set(EXTRA_ENV)
    with open(config_md, encoding="utf-8") as f:
        for line in f:
            cells = line.split("|")
            if len(cells) > 3 and "`" in cells[2]:
                names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[2]))
    return names


def pod_spec(obj):
    if obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def invariants(obj, env_names):
    """Yields one message per broken invariant of one object."""
    kind = obj.get("kind")
    spec = pod_spec(obj)
    if spec is None:
        return
    containers = spec.get("containers", [])
    all_containers = spec.get("initContainers", []) + containers
    pod_sc = spec.get("securityContext", {})

    # Every pod mounts the internal mutual-TLS secret.
    tls_volumes = {
        v["name"]
        for v in spec.get("volumes", [])
        if v.get("secret", {}).get("secretName") == TLS_SECRET
    }
    if not tls_volumes:
        yield f"no volume of Secret {TLS_SECRET}"
    for c in containers:
        mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
        if not any(n in mounts and mounts[n].get("mountPath") == TLS_DIR for n in tls_volumes):
            yield f"container {c['name']} does not mount Secret {TLS_SECRET} at {TLS_DIR}"

    for c in all_containers:
        csc = c.get("securityContext", {})
        if not (csc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
            yield f"container {c['name']}: runAsNonRoot is not true"
        if csc.get("allowPrivilegeEscalation") is not False:
            yield f"container {c['name']}: allowPrivilegeEscalation is not false"
        if "ALL" not in csc.get("capabilities", {}).get("drop", []):
            yield f"container {c['name']}: capabilities do not drop ALL"
        if c.get("imagePullPolicy") != "IfNotPresent":
            yield f"container {c['name']}: imagePullPolicy is not IfNotPresent"
        image = c.get("image", "")
        if image.split("/")[-1].startswith("tandem:"):
            for e in c.get("env", []):
                if e["name"] not in env_names:
                    yield (f"container {c['name']}: env {e['name']} is not in docs/config.md"
                           " (a variable Tandem does not read)")

    if kind != "Deployment":
        return
    if not spec.get("terminationGracePeriodSeconds", 30) > 30:
        yield "terminationGracePeriodSeconds is not above the drain timeout (30 s)"
    for c in containers:
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in c:
                yield f"container {c['name']} has no {probe}"
        env = {e["name"]: e for e in c.get("env", [])}
        if env.get("TANDEM_INTERNAL_TLS_DIR", {}).get("value") != TLS_DIR:
            yield f"container {c['name']}: TANDEM_INTERNAL_TLS_DIR is not {TLS_DIR}"
        command = (c.get("command") or [""])[0]
        if command in WORKER_COMMANDS:
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            # The encode worker runs its vision tower on the CPU (no CUDA tower yet).
            if command != "tandem-encode" and (not gpus or int(gpus) < 1):
                yield f"worker container {c['name']} does not request nvidia.com/gpu"
            if env.get("DYN_TCP_RPC_ADVERTISE_HOST", {}).get("valueFrom", {}).get(
                    "fieldRef", {}).get("fieldPath") != "status.podIP":
                yield f"worker container {c['name']}: DYN_TCP_RPC_ADVERTISE_HOST is not the pod IP"


def main():
    overlay, rendered, version, config_md = sys.argv[1:5]
    env_names = known_env(config_md)
    with open(rendered, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors = []
    kinds = {}
    deployments, pdbs = set(), set()
    for obj in docs:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{overlay}: {name}: schema {version}: {path}: {e.message}")
        except Exception as e:  # unknown kind or version: an error too, never a skip
            errors.append(f"{overlay}: {name}: cannot validate: {e}")
        for msg in invariants(obj, env_names):
            errors.append(f"{overlay}: {name}: {msg}")
        kinds[obj.get("kind")] = kinds.get(obj.get("kind"), 0) + 1
        if obj.get("kind") == "Deployment":
            deployments.add(obj["metadata"]["name"])
        if obj.get("kind") == "PodDisruptionBudget":
            pdbs.add(obj["metadata"]["name"])
    for d in sorted(deployments - pdbs):
        errors.append(f"{overlay}: Deployment/{d}: no PodDisruptionBudget of the same name")
    if not deployments:
        errors.append(f"{overlay}: renders no Deployment")
    if errors:
        for e in errors:
            print(f"FAIL {e}", file=sys.stderr)
        sys.exit(1)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    print(f"ok {overlay}: {len(docs)} objects valid against Kubernetes {version} (strict),"
          f" invariants hold ({summary})")


if __name__ == "__main__":
    main()
