#!/usr/bin/env python3
"""Golden outputs of Hugging Face transformers for the built-in tiny model.

Run where torch + transformers are installed (the GPU machine; it runs on CPU there, in f32
with eager attention, so the reference is plain IEEE f32 arithmetic, no TF32):

    python3 scripts/goldens/make_goldens.py MODEL_DIR OUT_DIR

MODEL_DIR is what `tandem model tiny MODEL_DIR` writes. Writes into OUT_DIR:

- tiny_logits.json: the sha256 of model.safetensors, and per prompt its text, its token ids
  (from the real tokenizer), per position the argmax, std, max|logit| and the top-20 ids and
  values of the logits, 32 free-running greedy tokens, and where full logit rows lie in the .bin.
- tiny_logits_rows.bin: full logit rows (151,936 f32 little endian each) for a few positions.

Full rows for every position would be ~600 KB each (hundreds of MB in all), so only a few are
stored in full; the per-position summaries carry the rest of the check (see the engine test).
"""
import hashlib
import json
import os
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOPK = 20
GREEDY = 32

PROMPTS = [
    ("short", "The quick brown fox jumps over the lazy dog."),
    ("mixed", "Tandem 服务 LLMs 🚀 — naïve café, x² + y² = z²; `fn main() { println!(\"hi\"); }`"),
]
LONG_USER = (
    "Please summarise the following notes in three bullet points. The cluster has two "
    "prefill workers and four decode workers; the router picks a worker by the overlap of "
    "cached prefix blocks and by the load it sees. KV blocks move from prefill to decode "
    "over the transfer layer, and every block stored or removed is reported as an event."
)


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
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = [(name, text, tok.encode(text, add_special_tokens=False)) for name, text in PROMPTS]
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": LONG_USER}],
        tokenize=False, add_generation_prompt=True, enable_thinking=False,
    )
    prompts.append(("chat_long", chat, tok.encode(chat, add_special_tokens=False)))
    assert len(prompts[-1][2]) > 64, len(prompts[-1][2])

    rows = []
    out = {
        "generator": "scripts/goldens/make_goldens.py",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "weights_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "vocab_size": model.config.vocab_size,
        "std": "population std (ddof=0) of each full logit row",
        "topk": TOPK,
        "prompts": [],
    }
    for name, text, ids in prompts:
        x = torch.tensor([ids])
        logits = model(x).logits[0].float().numpy()  # [T, V]
        per_pos = []
        for row in logits:
            top = np.argsort(-row, kind="stable")[:TOPK]
            per_pos.append({
                "argmax": int(np.argmax(row)),
                "std": float(row.std()),
                "max_abs": float(np.abs(row).max()),
                "top_ids": [int(i) for i in top],
                "top_values": [float(row[i]) for i in top],
            })
        full_positions = [len(ids) - 1]
        full = []
        for p in full_positions:
            full.append({"position": p, "row_index": len(rows)})
            rows.append(logits[p].astype("<f4"))
        # Free-running greedy: full recompute each step (unambiguous; the model is tiny).
        seq = list(ids)
        greedy, margins = [], []
        for _ in range(GREEDY):
            last = model(torch.tensor([seq])).logits[0, -1].float().numpy()
            top2 = np.sort(last)[-2:]
            nxt = int(np.argmax(last))
            greedy.append(nxt)
            margins.append(float(top2[1] - top2[0]))
            seq.append(nxt)
        out["prompts"].append({
            "name": name, "text": text, "ids": ids, "positions": per_pos,
            "full_rows": full, "greedy": greedy, "greedy_top2_margins": margins,
        })
        print(name, len(ids), "tokens; greedy", greedy[:8], "min margin", min(margins))
    with open(os.path.join(out_dir, "tiny_logits_rows.bin"), "wb") as f:
        for r in rows:
            f.write(r.tobytes())
    with open(os.path.join(out_dir, "tiny_logits.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
