#!/usr/bin/env python3
"""Compares Tandem's logits and greedy tokens with the transformers reference.

    python3 scripts/gpu/compare_logits.py --ref-dir OUT --tandem-logits FILE \
        --tandem-greedy FILE.json --report REPORT.json

--ref-dir holds cases.json and hf_logits.f32 (from hf_reference.py). --tandem-logits is raw
little-endian float32 [prompts, steps, vocab]: Tandem's teacher-forced rows, Tandem having been
fed exactly prompt + transformers' continuation (row j predicts continuation[j]).
--tandem-greedy is JSON {"greedy": [[ids]...]}: Tandem's own free-running greedy tokens,
`steps` per prompt.

Checks (each a pass flag in the report; the exit code is 0 only when all pass):
- logits: per position, the cosine similarity of the two rows and max|delta| / std(ref row)
  (population std); pass when every position has cosine >= 0.999 and ratio <= 2e-2;
- teacher-forced argmax agreement: the fraction of positions whose argmax agree, >= 0.99;
- free-running greedy: per prompt, k = the first step where transformers' own top-2 margin
  (top1 - top2 of the ref row) is below 1% of the ref row's std (steps if none); the prompt
  passes when Tandem's greedy equals transformers' continuation on steps [0, k) (at step k the
  tokens may legitimately differ, and everything after follows from that).
The report is always written.
"""
import argparse
import json
import math
import os
import sys

import numpy as np


def clean(x):
    """JSON-safe: NaN/inf become None, numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def row_stats(ref, tan):
    """ref, tan: [steps, vocab] float64. Per-row cosine, max|delta|/std, argmaxes, margins."""
    dot = np.einsum("ij,ij->i", ref, tan)
    nr = np.sqrt(np.einsum("ij,ij->i", ref, ref))
    nt = np.sqrt(np.einsum("ij,ij->i", tan, tan))
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = dot / (nr * nt)
        std = ref.std(axis=1)
        ratio = np.abs(tan - ref).max(axis=1) / std
    top2 = np.partition(ref, -2, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    return cos, ratio, ref.argmax(axis=1), tan.argmax(axis=1), margin, std


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref-dir", required=True)
    ap.add_argument("--tandem-logits", required=True)
    ap.add_argument("--tandem-greedy", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--cos-min", type=float, default=0.999)
    ap.add_argument("--ratio-max", type=float, default=2e-2)
    ap.add_argument("--argmax-min", type=float, default=0.99)
    ap.add_argument("--low-margin", type=float, default=0.01,
                    help="a ref top-2 margin below this fraction of the row's std is low")
    args = ap.parse_args()

    report = {
        "thresholds": {"cos_min": args.cos_min, "ratio_max": args.ratio_max,
                       "argmax_agreement_min": args.argmax_min,
                       "low_margin_fraction_of_std": args.low_margin},
        "inputs": {"ref_dir": os.path.abspath(args.ref_dir),
                   "tandem_logits": os.path.abspath(args.tandem_logits),
                   "tandem_greedy": os.path.abspath(args.tandem_greedy)},
        "errors": [],
    }
    try:
        ok = run(args, report)
    except Exception as e:  # noqa: BLE001 - always write the report
        report["errors"].append(f"{type(e).__name__}: {e}")
        ok = False
    report["pass"] = bool(ok) and not report["errors"]
    os.makedirs(os.path.dirname(os.path.abspath(args.report)), exist_ok=True)
    with open(args.report, "w") as f:
        json.dump(clean(report), f, indent=1)
        f.write("\n")
    print_summary(report)
    sys.exit(0 if report["pass"] else 1)


def run(args, report):
    with open(os.path.join(args.ref_dir, "cases.json")) as f:
        cases = json.load(f)
    P = len(cases["prompts"])
    S = int(cases["steps"])
    V = int(cases["vocab"])
    conts = cases["continuations"]
    report["shape"] = {"prompts": P, "steps": S, "vocab": V}
    expect = P * S * V * 4
    ref_path = os.path.join(args.ref_dir, cases.get("logits_file", "hf_logits.f32"))
    for name, path in (("reference", ref_path), ("tandem", args.tandem_logits)):
        size = os.path.getsize(path)
        if size != expect:
            raise ValueError(f"{name} logits {path} has {size} bytes; expected {expect} "
                             f"({P} prompts x {S} steps x {V} vocab x 4)")
    ref_all = np.memmap(ref_path, dtype="<f4", mode="r", shape=(P, S, V))
    tan_all = np.memmap(args.tandem_logits, dtype="<f4", mode="r", shape=(P, S, V))
    with open(args.tandem_greedy) as f:
        greedy = json.load(f)["greedy"]
    if len(greedy) != P:
        raise ValueError(f"tandem greedy has {len(greedy)} prompts; expected {P}")

    cos_all = np.empty((P, S))
    ratio_all = np.empty((P, S))
    agree_all = np.empty((P, S), dtype=bool)
    prompts_report = []
    low_margin_positions = []
    for p in range(P):
        ref = np.asarray(ref_all[p], dtype=np.float64)
        tan = np.asarray(tan_all[p], dtype=np.float64)
        cos, ratio, am_ref, am_tan, margin, std = row_stats(ref, tan)
        cos_all[p], ratio_all[p] = cos, ratio
        agree_all[p] = am_ref == am_tan
        low = margin < args.low_margin * std
        for j in np.nonzero(low)[0]:
            low_margin_positions.append({"prompt": p, "step": int(j),
                                         "margin": margin[j], "margin_over_std": margin[j] / std[j]})

        want = [int(t) for t in conts[p]]
        got = [int(t) for t in greedy[p]]
        n = min(len(want), len(got))
        div = next((j for j in range(n) if want[j] != got[j]), None)
        if div is None and len(got) != len(want):
            div = n  # a short (or long) sequence diverges where it ends
        k = int(np.argmax(low)) if low.any() else S
        passed = div is None or div >= k
        entry = {"prompt": p, "identical": div is None, "pass": passed,
                 "first_low_margin_step": k if k < S else None,
                 "first_divergence": div, "tandem_len": len(got)}
        if div is not None and div < S:
            entry["ref_margin_at_divergence"] = margin[div]
            entry["ref_margin_over_std_at_divergence"] = margin[div] / std[div]
            entry["ref_token"] = want[div] if div < len(want) else None
            entry["tandem_token"] = got[div] if div < len(got) else None
        worst = int(np.nanargmin(cos)) if np.isfinite(cos).any() else 0
        entry["min_cos"] = cos.min()
        entry["max_ratio"] = ratio.max()
        entry["argmax_agreement"] = agree_all[p].mean()
        entry["worst_cos_step"] = worst
        prompts_report.append(entry)

    cos_f, ratio_f = cos_all.ravel(), ratio_all.ravel()
    finite = np.isfinite(cos_f) & np.isfinite(ratio_f)
    bad_cos = ~(cos_f >= args.cos_min)  # NaN counts as bad
    bad_ratio = ~(ratio_f <= args.ratio_max)
    bad = bad_cos | bad_ratio
    worst = []
    for idx in np.argsort(np.where(np.isfinite(cos_f), cos_f, -np.inf))[:10]:
        p, j = divmod(int(idx), S)
        worst.append({"prompt": p, "step": j, "cos": cos_f[idx], "ratio": ratio_f[idx]})
    logits = {
        "positions": int(cos_f.size),
        "non_finite_positions": int((~finite).sum()),
        "cos_min": np.nanmin(cos_f) if finite.any() else None,
        "cos_mean": np.nanmean(cos_f) if finite.any() else None,
        "cos_p1": np.nanpercentile(cos_f, 1) if finite.any() else None,
        "ratio_max": np.nanmax(ratio_f) if finite.any() else None,
        "ratio_mean": np.nanmean(ratio_f) if finite.any() else None,
        "ratio_p99": np.nanpercentile(ratio_f, 99) if finite.any() else None,
        "positions_cos_below_min": int(bad_cos.sum()),
        "positions_ratio_above_max": int(bad_ratio.sum()),
        "positions_failing": int(bad.sum()),
        "pass_cos": bool(not bad_cos.any()),
        "pass_ratio": bool(not bad_ratio.any()),
        "worst_positions_by_cos": worst,
    }
    logits["pass"] = logits["pass_cos"] and logits["pass_ratio"]
    report["logits"] = logits

    agreement = float(agree_all.mean())
    disagree = [{"prompt": int(p), "step": int(j)} for p, j in zip(*np.nonzero(~agree_all))]
    report["argmax"] = {"agreement": agreement, "disagreeing_positions": disagree[:200],
                        "disagreeing_count": len(disagree),
                        "pass": agreement >= args.argmax_min}

    n_ident = sum(e["identical"] for e in prompts_report)
    n_pass = sum(e["pass"] for e in prompts_report)
    report["greedy"] = {
        "prompts": P,
        "prompts_identical": n_ident,
        "prompts_passing": n_pass,
        "failing_prompts": [e["prompt"] for e in prompts_report if not e["pass"]],
        "low_margin_positions": low_margin_positions,
        "pass": n_pass == P,
    }
    report["per_prompt"] = prompts_report
    return logits["pass"] and report["argmax"]["pass"] and report["greedy"]["pass"]


def fmt(x, spec):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_summary(r):
    out = []
    if "logits" in r:
        lg = r["logits"]
        out.append(f"logits: {lg['positions']} positions; cos min {fmt(lg['cos_min'], '.6f')} "
                   f"mean {fmt(lg['cos_mean'], '.6f')} p1 {fmt(lg['cos_p1'], '.6f')}; "
                   f"max|d|/std max {fmt(lg['ratio_max'], '.3e')} mean {fmt(lg['ratio_mean'], '.3e')} "
                   f"p99 {fmt(lg['ratio_p99'], '.3e')}; non-finite {lg['non_finite_positions']}; "
                   f"failing {lg['positions_failing']} "
                   f"-> {'PASS' if lg['pass'] else 'FAIL'}")
    if "argmax" in r:
        am = r["argmax"]
        out.append(f"teacher-forced argmax agreement {am['agreement']:.4f} "
                   f"({am['disagreeing_count']} disagree) -> {'PASS' if am['pass'] else 'FAIL'}")
    if "greedy" in r:
        g = r["greedy"]
        out.append(f"free-running greedy: {g['prompts_identical']}/{g['prompts']} identical, "
                   f"{g['prompts_passing']}/{g['prompts']} passing "
                   f"({len(g['low_margin_positions'])} low-margin ref positions) "
                   f"-> {'PASS' if g['pass'] else 'FAIL'}")
    for e in r["errors"]:
        out.append(f"error: {e}")
    out.append(f"overall: {'PASS' if r['pass'] else 'FAIL'}")
    print("\n".join(out), flush=True)


if __name__ == "__main__":
    main()
