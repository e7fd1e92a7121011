#!/usr/bin/env python3
"""transformers' speed on a model: the baseline row of the CUDA benchmark table.

    python3 scripts/gpu/hf_bench.py --model DIR --out FILE.json [--batches 1,8,64,256]
        [--context 1024] [--decode-steps 16] [--prefill 512,2048,8192] [--device cuda]
        [--no-static] [--compiled-batches 1]

bfloat16 weights and compute, SDPA attention.
- decode: for each batch b, random prompts [b, context] are prefilled (not timed; in chunks of
  at most --prefill-chunk-tokens tokens), two warm-up steps run, then `decode-steps`
  single-token steps are timed with the DynamicCache ("eager-dynamic"), and again with a
  StaticCache ("eager-static", no torch.compile; skipped with the reason recorded when it
  errors), and for the batches of --compiled-batches with the StaticCache and the decode
  forward under torch.compile(mode="reduce-overhead") ("compiled-static": what
  generate(cache_implementation="static") compiles; four warm-up steps, the first compiles and
  the next record CUDA graphs; the compile time is reported, the error when it fails).
  tok/s = b * steps / time. A batch that runs out of memory records the error.
- prefill: one forward (with a fresh KV cache, logits of the last position only) over [1, n]
  random ids for each n, after one warm-up of the same size; the median of --prefill-repeats
  timed runs is reported in ms.
Progress goes to stderr; the JSON goes to --out.
"""
import argparse
import json
import platform
import statistics
import sys
import time
import traceback

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache


def log(msg):
    print(f"[hf_bench] {msg}", file=sys.stderr, flush=True)


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.model, self.attn = self.load()
        self.vocab = int(self.model.config.vocab_size)
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed)
        self.compiled_forward = None

    def compiled(self):
        if self.compiled_forward is None:
            self.compiled_forward = torch.compile(self.model.forward, mode="reduce-overhead", fullgraph=True)
        return self.compiled_forward

    def load(self):
        last = None
        for attn in ("sdpa", "eager"):
            try:
                m = AutoModelForCausalLM.from_pretrained(
                    self.args.model, dtype=torch.bfloat16, attn_implementation=attn
                )
            except (ValueError, ImportError, NotImplementedError) as e:
                log(f"attn_implementation={attn} not usable ({e})")
                last = e
                continue
            return m.to(self.device).eval(), attn
        raise last

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def free(self):
        if self.cuda:
            torch.cuda.empty_cache()

    def ids(self, b, n):
        hi = min(self.vocab, 150000)
        return torch.randint(10, hi, (b, n), generator=self.gen).to(self.device)

    def prefill(self, ids, cache, static=False):
        """Fills `cache` with `ids` in chunks; returns the next tokens [b]."""
        b, n = ids.shape
        chunk = max(1, self.args.prefill_chunk_tokens // b)
        logits = None
        for s in range(0, n, chunk):
            part = ids[:, s:s + chunk]
            kw = {}
            if static:
                kw["cache_position"] = torch.arange(s, s + part.shape[1], device=self.device)
            logits = self.model(input_ids=part, past_key_values=cache, use_cache=True,
                                logits_to_keep=1, **kw).logits
        return logits[:, -1, :].argmax(dim=-1)

    def steps(self, cache, nxt, pos, count, static=False, forward=None):
        forward = forward or self.model
        for i in range(count):
            kw = {}
            if static:
                kw["cache_position"] = torch.tensor([pos + i], device=self.device)
            logits = forward(input_ids=nxt[:, None], past_key_values=cache, use_cache=True,
                             **kw).logits
            nxt = logits[:, -1, :].argmax(dim=-1)
        return nxt

    def decode(self, b, mode):
        a = self.args
        compiled = mode == "compiled-static"
        warm = 4 if compiled else 2
        forward = self.compiled() if compiled else None
        ids = self.ids(b, a.context)
        if mode == "eager-dynamic":
            cache = make_dynamic_cache(self.model)
            static = False
        else:
            cache = make_static_cache(self.model, b, a.context + warm + a.decode_steps,
                                      self.device)
            static = True
        nxt = self.prefill(ids, cache, static)
        self.sync()
        t_warm = time.perf_counter()
        nxt = self.steps(cache, nxt, a.context, warm, static, forward)
        self.sync()
        warm_s = time.perf_counter() - t_warm
        t0 = time.perf_counter()
        self.steps(cache, nxt, a.context + warm, a.decode_steps, static, forward)
        self.sync()
        dt = time.perf_counter() - t0
        del cache, ids, nxt
        row = {"batch": b, "context": a.context, "mode": mode,
               "tok_s": b * a.decode_steps / dt, "step_ms": dt * 1e3 / a.decode_steps}
        if forward is not None:
            row["warmup_s"] = warm_s
        return row

    def prefill_one(self, n):
        ids = self.ids(1, n)

        def once():
            cache = make_dynamic_cache(self.model)
            self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

        once()
        self.sync()
        runs = []
        for _ in range(self.args.prefill_repeats):
            t0 = time.perf_counter()
            once()
            self.sync()
            runs.append((time.perf_counter() - t0) * 1e3)
        return {"tokens": n, "ms": statistics.median(runs), "runs_ms": runs}


def make_dynamic_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def make_static_cache(model, batch, max_len, device):
    from transformers import StaticCache

    try:  # transformers 5: sized lazily on the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len,
                           device=device, dtype=model.dtype)


def err_text(e):
    s = f"{type(e).__name__}: {e}".strip()
    return s.splitlines()[0][:500] if s else type(e).__name__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=ints, default=ints("1,8,64,256"))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prefill", type=ints, default=ints("512,2048,8192"))
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--prefill-chunk-tokens", type=int, default=65536,
                    help="decode setup prefills at most this many tokens (batch x len) a forward")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-static", action="store_true", help="skip the StaticCache variants")
    ap.add_argument("--compiled-batches", type=ints, default=ints("1"),
                    help="batches also run with the decode forward under torch.compile (empty: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no CUDA device")

    torch.set_grad_enabled(False)
    bench = Bench(args)
    cuda = bench.cuda
    result = {
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "dtype": "bfloat16",
        "attn_implementation": bench.attn,
        "torch_compile": "decode rows of mode compiled-static (reduce-overhead)",
        "decode": [],
        "prefill": [],
    }
    log(f"{result['device']}: torch {result['torch']}, transformers {result['transformers']}, "
        f"attn {bench.attn}")

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")

    modes = ["eager-dynamic"] + ([] if args.no_static else ["eager-static", "compiled-static"])
    static_broken = None
    for b in args.batches:
        for mode in modes:
            if mode == "compiled-static" and b not in args.compiled_batches:
                continue
            if mode != "eager-dynamic" and static_broken:
                result["decode"].append({"batch": b, "context": args.context, "mode": mode,
                                         "skipped": static_broken})
                continue
            try:
                row = bench.decode(b, mode)
                log(f"decode {mode} batch {b} context {args.context}: "
                    f"{row['tok_s']:.1f} tok/s, {row['step_ms']:.2f} ms/step")
            except torch.cuda.OutOfMemoryError as e:
                row = {"batch": b, "context": args.context, "mode": mode, "error": err_text(e)}
                log(f"decode {mode} batch {b}: out of memory")
            except Exception as e:  # noqa: BLE001
                row = {"batch": b, "context": args.context, "mode": mode, "error": err_text(e)}
                log(f"decode {mode} batch {b}: {row['error']}")
                if mode == "eager-static":
                    static_broken = f"StaticCache failed earlier: {row['error']}"
                    traceback.print_exc()
            result["decode"].append(row)
            bench.free()
            save()

    for n in args.prefill:
        try:
            row = bench.prefill_one(n)
            log(f"prefill {n} tokens: {row['ms']:.2f} ms")
        except torch.cuda.OutOfMemoryError as e:
            row = {"tokens": n, "error": err_text(e)}
            log(f"prefill {n}: out of memory")
        except Exception as e:  # noqa: BLE001
            row = {"tokens": n, "error": err_text(e)}
            log(f"prefill {n}: {row['error']}")
        result["prefill"].append(row)
        bench.free()
        save()
    save()
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
