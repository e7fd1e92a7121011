#!/usr/bin/env python3
"""transformers reference outputs for the CUDA backend's correctness check.

    python3 scripts/gpu/hf_reference.py --model DIR --out-dir OUT [--prompts 64]
        [--prompt-len 32] [--steps 64] [--seed 1] [--device cuda|cpu] [--batch 16]

The model is loaded in bfloat16 and cast to float32 (f32 compute from the same bf16 weights,
no TF32), SDPA attention (eager when SDPA is not supported).

With --compute-dtype bfloat16 --cases REF/cases.json the model stays in bfloat16 (what
transformers serves by default) and runs the reference's prompts, teacher-forced over the
reference's continuations: OUT/hf_logits.f32 and OUT/greedy.json ({"greedy": [[ids]...]}, its
own free-running greedy tokens) are then what compare_logits.py takes as --tandem-logits and
--tandem-greedy, which measures transformers' own bf16 error against its f32 reference; the
given cases.json is copied to OUT, so OUT also serves as a --ref-dir (Tandem against
transformers in bf16, row by row). The prompts are `prompts`
sequences of `prompt-len` token ids drawn by numpy's default_rng(seed) from
[10, min(vocab, 150000)).

For each prompt:
- free-running greedy decoding of `steps` tokens (a manual loop with the KV cache, no EOS
  stop): the continuation;
- one teacher-forced forward over prompt + continuation[:steps-1] (the last continuation
  token changes no earlier row, the attention being causal); logits row j (0 <= j < steps) is
  the row at position prompt_len-1+j, the one that predicts continuation[j].

Writes:
- OUT/cases.json: {"prompts": [[ids]...], "continuations": [[ids]...], "steps": S,
  "vocab": V, "prompt_len": L, ...metadata}
- OUT/hf_logits.f32: raw little-endian float32, C order, shape [prompts, steps, vocab].
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM


def log(msg):
    print(f"[hf_reference] {msg}", file=sys.stderr, flush=True)


def load_model(path, device, dtype):
    last = None
    for attn in ("sdpa", "eager"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, attn_implementation=attn
            )
        except (ValueError, ImportError, NotImplementedError) as e:
            log(f"attn_implementation={attn} not usable ({e}); trying the next")
            last = e
            continue
        if dtype == "float32":
            model = model.float()
        return model.to(device).eval(), attn
    raise last


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=16, help="prompts per forward")
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--cases", help="another run's cases.json: its prompts, teacher-forced "
                    "over its continuations (writes greedy.json instead of cases.json)")
    args = ap.parse_args()
    if args.steps < 1 or args.prompt_len < 1 or args.prompts < 1:
        sys.exit("--prompts, --prompt-len and --steps must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no CUDA device")

    torch.set_grad_enabled(False)
    # Plain IEEE f32 matmuls (no TF32): the reference must not be the noisier side.
    torch.set_float32_matmul_precision("highest")
    device = torch.device(args.device)

    t0 = time.time()
    model, attn = load_model(args.model, device, args.compute_dtype)
    vocab = int(model.config.vocab_size)
    log(f"loaded {args.model} (bf16 -> {args.compute_dtype}, attn {attn}, device {device}) "
        f"in {time.time() - t0:.1f} s; vocab {vocab}")

    forced = None
    if args.cases:
        try:
            with open(args.cases) as f:
                given = json.load(f)
            prompts = np.asarray(given["prompts"], dtype=np.int64)
            forced = np.asarray(given["continuations"], dtype=np.int64)
            given_vocab = given["vocab"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"--cases {args.cases}: not a cases.json of hf_reference.py "
                     f"({type(e).__name__}: {e})")
        if prompts.ndim != 2 or forced.ndim != 2:
            sys.exit(f"--cases {args.cases}: prompts and continuations must be lists of equal-length id lists")
        if given_vocab != vocab or forced.shape[0] != prompts.shape[0]:
            sys.exit(f"--cases {args.cases}: vocab {given_vocab} (model {vocab}), "
                     f"{prompts.shape[0]} prompts, {forced.shape[0]} continuations")
        args.prompts, args.prompt_len = prompts.shape
        args.steps = forced.shape[1]
    else:
        rng = np.random.default_rng(args.seed)
        hi = min(vocab, 150000)
        if hi <= 10:
            sys.exit(f"vocab {vocab} is too small for ids drawn from [10, {hi})")
        prompts = rng.integers(10, hi, size=(args.prompts, args.prompt_len), dtype=np.int64)

    os.makedirs(args.out_dir, exist_ok=True)
    logits_path = os.path.join(args.out_dir, "hf_logits.f32")
    L, S = args.prompt_len, args.steps
    continuations = []
    argmax_mismatch = []  # (prompt, step) where argmax(teacher-forced row) != greedy token
    t0 = time.time()
    with open(logits_path, "wb") as out:
        for start in range(0, args.prompts, args.batch):
            ids = torch.from_numpy(prompts[start:start + args.batch]).to(device)
            b = ids.shape[0]
            # Free-running greedy with the KV cache.
            res = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = res.past_key_values
            nxt = res.logits[:, -1, :].argmax(dim=-1)
            gen = [nxt]
            for _ in range(S - 1):
                res = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True,
                            logits_to_keep=1)
                cache = res.past_key_values
                nxt = res.logits[:, -1, :].argmax(dim=-1)
                gen.append(nxt)
            cont = torch.stack(gen, dim=1)  # [b, S]
            del cache, res

            # Teacher-forced rows: positions L-1 .. L+S-2 of prompt + cont[:S-1] (with
            # --cases, the given continuations).
            if forced is not None:
                teach = torch.from_numpy(forced[start:start + b]).to(device)
            else:
                teach = cont
            full = torch.cat([ids, teach[:, : S - 1]], dim=1)
            logits = model(input_ids=full, use_cache=False, logits_to_keep=S).logits
            assert logits.shape == (b, S, vocab), logits.shape
            tf_argmax = logits.argmax(dim=-1)
            for i, j in (tf_argmax != teach).nonzero().tolist():
                argmax_mismatch.append([start + i, j])
            rows = logits.float().cpu().numpy()
            del logits
            for i in range(b):
                np.ascontiguousarray(rows[i], dtype="<f4").tofile(out)
            continuations.extend(cont.cpu().tolist())
            log(f"prompts {start}..{start + b - 1} done ({time.time() - t0:.1f} s)")

    expect = args.prompts * S * vocab * 4
    assert os.path.getsize(logits_path) == expect, (os.path.getsize(logits_path), expect)
    if forced is not None:
        # The given cases beside these logits: OUT can also be the --ref-dir of a comparison
        # (Tandem against transformers in bf16, on the same rows).
        with open(os.path.join(args.out_dir, "cases.json"), "w") as f:
            json.dump(dict(given, reference=dict(given.get("reference", {}),
                                                 compute_dtype=args.compute_dtype)), f)
        with open(os.path.join(args.out_dir, "greedy.json"), "w") as f:
            json.dump({"greedy": continuations, "compute_dtype": args.compute_dtype,
                       "torch": torch.__version__, "transformers": transformers.__version__}, f)
        log(f"wrote {logits_path} and greedy.json ({args.compute_dtype}, teacher-forced over "
            f"{args.cases})")
        return
    cases = {
        "prompts": prompts.tolist(),
        "continuations": continuations,
        "steps": S,
        "vocab": vocab,
        "prompt_len": L,
        "seed": args.seed,
        "logits_file": "hf_logits.f32",
        "logits_layout": "little-endian float32, C order, [prompts, steps, vocab]; row j is "
                         "the logits at position prompt_len-1+j of the forward over "
                         "prompt + continuation (it predicts continuation[j])",
        "reference": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": args.device,
            "compute_dtype": "float32 (weights loaded as bfloat16, then .float())",
            "attn_implementation": attn,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "model": os.path.abspath(args.model),
        },
        # Where the teacher-forced forward's argmax differs from the incremental greedy
        # token (near-ties between the two computations; expected to be empty or tiny).
        "teacher_forced_argmax_mismatch": argmax_mismatch,
    }
    with open(os.path.join(args.out_dir, "cases.json"), "w") as f:
        json.dump(cases, f)
    log(f"wrote {logits_path} ({expect / 2**20:.1f} MiB) and cases.json: "
        f"{args.prompts} prompts x {S} steps, vocab {vocab}; "
        f"{len(argmax_mismatch)} teacher-forced/greedy argmax mismatches")


if __name__ == "__main__":
    main()
