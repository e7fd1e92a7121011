#!/usr/bin/env python3
"""Writes a deterministic Mooncake-format trace: Poisson arrivals, prompts of whole 512-token
blocks where the first blocks come from a few shared system prompts.
Usage: gen_trace.py N RATE_PER_S OUT [SEED]"""
import json, random, sys

n, rate, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
r = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
t = 0.0
with open(out, "w") as f:
    for i in range(n):
        t += r.expovariate(rate) * 1000.0
        shared = r.randint(0, 7)
        blocks = r.randint(3, 8)
        ids = [shared * 1000 + k for k in range(2)] + [100000 + i * 16 + k for k in range(blocks - 2)]
        f.write(json.dumps({"timestamp": round(t, 3), "input_length": blocks * 512 - r.randint(0, 300),
                            "output_length": r.randint(100, 300), "hash_ids": ids}) + "\n")
