#!/usr/bin/env python3
"""Registers and spills of the CUDA kernels, held to budgets (CI, no GPU needed).

ptxas (from the PyPI wheel nvidia-cuda-nvcc, no GPU needed) assembles the PTX that
cuda_ptx_check wrote for sm_90a and reports each entry point's registers and spills. The hot
decode and prefill kernels' occupancy rests on their register counts (the decode attention's
5 blocks per SM at 96 registers, docs/benchmarks.md), so each budgeted kernel must stay at or
under its budget and must not spill (beyond the bytes the budget file's `spill_bytes` grants
a kernel whose measured speed came with them); a change that needs more says so by raising
the budget in the budget file. Prints a JSON report; exit status 1 when a budget is broken.

usage: kernel_registers.py --ptxas PTXAS --ptx FILE --budgets JSON
"""
import argparse
import json
import re
import subprocess
import sys


def parse(log):
    """{kernel: {registers, spill_stores, spill_loads, stack}} from ptxas -v output."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
            out[name] = {"registers": None, "spill_stores": 0, "spill_loads": 0, "stack": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["registers"] = int(m.group(1))
    return out


def check(found, budgets, spill_allowed=None):
    """Messages for every budgeted kernel missing, over its budget, or spilling more than the
    bytes (stored + loaded) its entry in `spill_allowed` grants (none by default)."""
    spill_allowed = spill_allowed or {}
    problems = []
    for kernel, budget in sorted(budgets.items()):
        k = found.get(kernel)
        if k is None or k["registers"] is None:
            problems.append(f"{kernel}: not in the ptxas report (renamed or removed? update the budget file)")
            continue
        if k["registers"] > budget:
            problems.append(f"{kernel}: {k['registers']} registers, budget {budget}")
        if k["spill_stores"] + k["spill_loads"] > spill_allowed.get(kernel, 0):
            problems.append(f"{kernel}: spills ({k['spill_stores']} bytes stored, {k['spill_loads']} loaded)")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ptxas", required=True)
    ap.add_argument("--ptx", required=True)
    ap.add_argument("--budgets", required=True)
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    try:
        with open(a.budgets) as f:
            doc = json.load(f)
        budgets = doc["registers"]
        spill_allowed = doc.get("spill_bytes", {})
    except (OSError, ValueError, KeyError) as e:
        print(f"kernel registers: cannot read the budgets {a.budgets}: {e!r}", file=sys.stderr)
        return 1
    try:
        run = subprocess.run([a.ptxas, f"-arch={a.arch}", "-v", a.ptx, "-o", "/dev/null"],
                             capture_output=True, text=True)
    except OSError as e:
        print(f"kernel registers: cannot run ptxas {a.ptxas}: {e}", file=sys.stderr)
        return 1
    if run.returncode != 0:
        print(f"ptxas failed ({run.returncode}):\n{run.stderr[-4000:]}", file=sys.stderr)
        return 1
    found = parse(run.stdout + run.stderr)
    problems = check(found, budgets, spill_allowed)
    report = {"arch": a.arch, "kernels": len(found),
              "budgeted": {k: found.get(k) for k in sorted(budgets)}, "problems": problems}
    print(json.dumps(report, indent=1))
    for p in problems:
        print(f"kernel registers: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
