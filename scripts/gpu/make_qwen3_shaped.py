#!/usr/bin/env python3
"""Builds a Qwen3-0.6B-shaped model with random weights and saves it as a Tandem / HF folder.

    python3 scripts/gpu/make_qwen3_shaped.py --out DIR --tokenizer-from TINY_DIR [--seed 0]
        [--layers 28] [--small]

The weights come from transformers' own initialisation (`Qwen3ForCausalLM(config)` after
`torch.manual_seed(seed)`), cast to bfloat16 and saved with `save_pretrained` as one
`model.safetensors` (the tied lm_head is not stored). `tokenizer.json` and, if present,
`tokenizer_config.json` are copied from --tokenizer-from (the folder of Tandem's built-in tiny
model, which has the real Qwen3 tokenizer). --small makes a tiny variant for CPU testing
(hidden 64, 2 layers, 4/2 heads, head_dim 16, intermediate 128, vocab 1000). --shape
llama3-8b makes an 8B model for the two-GPU goodput run: Llama-3-8B's layer shapes (hidden
4096, 32 layers, 32/8 heads of 128, intermediate 14336, rope theta 500000, untied lm_head)
in the Qwen3 architecture (its q/k norms add 0.01% of the weights) with Qwen3's vocabulary of
151,936, so that the copied tokenizer's every id has an embedding.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

REAL = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

LLAMA3_8B = dict(
    REAL,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000,
    tie_word_embeddings=False,
)

SMALL = dict(
    REAL,
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)


def log(msg):
    print(f"[make_qwen3_shaped] {msg}", flush=True)


def rope_theta_of(config):
    """rope_theta wherever this transformers version keeps it (v5: rope_parameters)."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        return rp["rope_theta"]
    return getattr(config, "rope_theta", None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output model folder")
    ap.add_argument("--tokenizer-from", required=True,
                    help="folder with tokenizer.json (and tokenizer_config.json) to copy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None,
                    help="number of decoder layers (default: 28, or 2 with --small)")
    ap.add_argument("--small", action="store_true", help="tiny variant for CPU testing")
    ap.add_argument("--shape", choices=["qwen3-0.6b", "llama3-8b"], default="qwen3-0.6b",
                    help="layer shapes (default Qwen3-0.6B's)")
    args = ap.parse_args()

    tok_src = os.path.join(args.tokenizer_from, "tokenizer.json")
    if not os.path.isfile(tok_src):
        sys.exit(f"{tok_src} does not exist")

    shapes = {"qwen3-0.6b": REAL, "llama3-8b": LLAMA3_8B}
    fields = dict(SMALL if args.small else shapes[args.shape])
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    config = Qwen3Config(**fields)
    # transformers 5 moves rope_theta into rope_parameters; make sure the value landed.
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") != fields["rope_theta"]:
        rp["rope_theta"] = fields["rope_theta"]
        rp.setdefault("rope_type", "default")
    assert float(rope_theta_of(config)) == float(fields["rope_theta"]), rope_theta_of(config)
    config.architectures = ["Qwen3ForCausalLM"]

    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    log(f"config: {'small' if args.small else args.shape} shape, "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"heads {config.num_attention_heads}/{config.num_key_value_heads}x{config.head_dim}, "
        f"intermediate {config.intermediate_size}, vocab {config.vocab_size}, seed {args.seed}")

    t0 = time.time()
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"built and cast to bfloat16: {n_params / 1e6:.1f} M parameters ({time.time() - t0:.1f} s)")

    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    model.save_pretrained(args.out, safe_serialization=True, max_shard_size="1000GB")
    log(f"saved to {args.out} ({time.time() - t0:.1f} s)")

    # config.json: make sure the fields Tandem (and older transformers) read are there.
    cfg_path = os.path.join(args.out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["model_type"] = "qwen3"
    if cfg.get("torch_dtype") != "bfloat16" and cfg.get("dtype") != "bfloat16":
        cfg["dtype"] = "bfloat16"
        cfg["torch_dtype"] = "bfloat16"
    if "rope_theta" not in cfg and not (
        isinstance(cfg.get("rope_parameters"), dict) and "rope_theta" in cfg["rope_parameters"]
    ):
        cfg["rope_theta"] = fields["rope_theta"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    # One safetensors file (a tied lm_head not stored).
    st = os.path.join(args.out, "model.safetensors")
    if not os.path.isfile(st):
        sys.exit(f"expected a single {st}; found {sorted(os.listdir(args.out))}")
    from safetensors import safe_open

    with safe_open(st, framework="pt") as f:
        keys = list(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    if ("lm_head.weight" in keys) == bool(fields["tie_word_embeddings"]):
        log(f"warning: lm_head.weight {'is' if 'lm_head.weight' in keys else 'is not'} stored "
            f"with tie_word_embeddings={fields['tie_word_embeddings']}")
    log(f"model.safetensors: {len(keys)} tensors, dtypes {sorted(dtypes)}, "
        f"{os.path.getsize(st) / 2**20:.1f} MiB")

    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(args.tokenizer_from, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(args.out, name))
            log(f"copied {name} from {args.tokenizer_from}")
    log(f"done: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
