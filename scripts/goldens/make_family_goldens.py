#!/usr/bin/env python3
"""Golden outputs of transformers for the tiny model of each family (Qwen2, Llama 3, Mistral,
and a Llama with attention_bias;
see `tiny::FAMILY_MODELS`). The tiny Qwen3 has its own goldens (make_goldens.py).

    cargo run -p tandem-engine --example write_family_models -- MODELS_DIR   # build machine
    python3 scripts/goldens/make_family_goldens.py MODELS_DIR OUT_DIR        # where torch is

MODELS_DIR holds one folder per model (qwen2, llama3, mistral, llama-bias). Each is loaded with
AutoModelForCausalLM in f32 with eager attention on the CPU (plain IEEE f32 arithmetic, no TF32);
loading must find every tensor (no missing or unexpected keys, which transformers would
otherwise initialise at random). Prompts are fixed id lists (vocab 1,024). With such a vocab a
full logit row is 4 KB: rows are stored for every 3rd position and the last
(family_logits_rows.bin, f32 little endian, in order), the argmax for every position, and 16
free-running greedy tokens with their top-2 margins. Also stored: the model's RoPE inv_freq
(after rope_scaling) and the config transformers resolved (sliding window, rope parameters).
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

FAMILIES = ["qwen2", "llama3", "mistral", "llama-bias"]
GREEDY = 16


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v)


def main():
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    out = {
        "generator": "scripts/goldens/make_family_goldens.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "families": [],
    }
    rows = []
    failed = []
    for fam in FAMILIES:
        try:
            rows_before = len(rows)
            out["families"].append(golden(models_dir, fam, rows))
        except Exception:  # one model's failure must not lose the others' goldens
            import traceback
            traceback.print_exc()
            failed.append(fam)
            del rows[rows_before:]
    with open(os.path.join(out_dir, "family_logits_rows.bin"), "wb") as f:
        for r in rows:
            f.write(r.tobytes())
    with open(os.path.join(out_dir, "family_logits.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")
    if failed:
        sys.exit(f"failed: {failed}")


def golden(models_dir, fam, rows):
    """The goldens of one model; appends its logit rows to rows."""
    model_dir = os.path.join(models_dir, fam)
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True,
    )
    model.eval()
    bad = {k: v for k, v in info.items() if v}
    assert not bad, (fam, info)
    cfg = model.config
    vocab = cfg.vocab_size
    prompts = [
        ("ramp", [(i * 37 + 11) % vocab for i in range(23)]),
        ("long", [(i * i * 13 + 5 * i + 1) % vocab for i in range(75)]),
    ]
    try:
        inv_freq = model.model.rotary_emb.inv_freq.float().tolist()
    except AttributeError as e:
        print(fam, "no rotary_emb.inv_freq:", e, flush=True)
        inv_freq = None
    resolved = {k: jsonable(getattr(cfg, k, None)) for k in
                ["sliding_window", "use_sliding_window", "rope_scaling", "rope_parameters",
                 "rope_theta", "head_dim", "tie_word_embeddings", "layer_types"]}
    entry = {
        "family": fam,
        "class": type(model).__name__,
        "weights_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "vocab_size": vocab,
        "inv_freq": inv_freq,
        "resolved_config": resolved,
        "prompts": [],
    }
    for name, ids in prompts:
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        positions = [p for p in range(len(ids)) if p % 3 == 2 or p == len(ids) - 1]
        first_row = sum(len(r) for r in rows)
        rows.append(logits[positions].astype("<f4"))
        argmax = [int(a) for a in logits.argmax(axis=-1)]
        seq = list(ids)
        greedy, margins = [], []
        for _ in range(GREEDY):
            last = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            top2 = np.sort(last)[-2:]
            nxt = int(np.argmax(last))
            greedy.append(nxt)
            margins.append(float(top2[1] - top2[0]))
            seq.append(nxt)
        entry["prompts"].append({
            "name": name, "ids": ids, "first_row": first_row, "row_positions": positions,
            "argmax": argmax, "greedy": greedy, "greedy_top2_margins": margins,
            "row_std": [float(logits[p].std()) for p in positions],
        })
        print(fam, name, len(ids), "greedy", greedy, "min margin", min(margins), flush=True)
    print(fam, type(model).__name__, "resolved", resolved, flush=True)
    return entry


if __name__ == "__main__":
    main()
