#!/usr/bin/env python3
"""Golden outputs of transformers for the shape-check model (Qwen3-0.6B layer shapes, one
layer, untied lm_head, bf16 weights, vocab 4,096; see `tiny::SHAPE_CHECK`).

    cargo run -p tandem-engine --example write_shape_check -- MODEL_DIR   # on the build machine
    python3 scripts/goldens/make_shape_goldens.py MODEL_DIR OUT_DIR       # where torch is

The bf16 weights are loaded as f32 (exact) and run with eager attention on the CPU, so the
reference is plain f32 arithmetic. Prompts are fixed id lists (the model has no tokenizer of its
own). With a 4,096 vocab, full logit rows are small (16 KB): they are stored for every 4th
position and the last (shape_logits_rows.bin, f32 little endian, in order), plus 16 greedy
tokens; the teacher-forced argmax is stored for every position.
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

GREEDY = 16


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = model.config.vocab_size
    prompts = [
        ("ramp", [(i * 37 + 11) % vocab for i in range(23)]),
        ("long", [(i * i * 13 + 5 * i + 1) % vocab for i in range(75)]),
    ]
    out = {
        "generator": "scripts/goldens/make_shape_goldens.py",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "weights_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "vocab_size": vocab,
        "prompts": [],
    }
    rows = []
    for name, ids in prompts:
        logits = model(torch.tensor([ids])).logits[0].float().numpy()
        positions = [p for p in range(len(ids)) if p % 4 == 3 or p == len(ids) - 1]
        first_row = sum(len(p["row_positions"]) for p in out["prompts"])
        rows.append(logits[positions].astype("<f4"))
        argmax = [int(a) for a in logits.argmax(axis=-1)]
        seq = list(ids)
        greedy = []
        for _ in range(GREEDY):
            nxt = int(np.argmax(model(torch.tensor([seq])).logits[0, -1].float().numpy()))
            greedy.append(nxt)
            seq.append(nxt)
        out["prompts"].append({"name": name, "ids": ids, "first_row": first_row,
                               "row_positions": positions, "argmax": argmax,
                               "greedy": greedy})
        print(name, len(ids), "greedy", greedy)
    with open(os.path.join(out_dir, "shape_logits_rows.bin"), "wb") as f:
        for r in rows:
            f.write(r.tobytes())
    with open(os.path.join(out_dir, "shape_logits.json"), "w") as f:
        json.dump(out, f)
        f.write("\n")


if __name__ == "__main__":
    main()
