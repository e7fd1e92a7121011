#!/usr/bin/env python3
"""Beam-search goldens of Hugging Face transformers for the built-in tiny model.

Run where torch + transformers are installed (the GPU machine; it runs on CPU there, f32,
eager attention):

    python3 scripts/goldens/make_beam_goldens.py MODEL_DIR OUT_DIR

Writes OUT_DIR/beam_search.json: per case the prompt ids, the beam width, num_return_sequences,
length_penalty, max_new_tokens, the EOS ids, and the returned hypotheses best first: generated
token ids (cut after the first EOS, which is kept) and `sequences_scores` (the
length-normalised score). Cases with a custom EOS id (a token the search actually meets, taken
from the EOS-free run of the same prompt) exercise finished hypotheses and the
`early_stopping=False` heuristic. Checked by `shared/engine/tests/beam_goldens.rs`.
"""
import hashlib
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    ("short", "The quick brown fox jumps over the lazy dog."),
    ("mixed", "Tandem 服务 LLMs 🚀 — naïve café, x² + y² = z²; `fn main() { println!(\"hi\"); }`"),
    ("code", "def fibonacci(n):\n    "),
]
MAX_NEW = 10


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run(model, ids, width, nret, lp, eos, max_new=MAX_NEW):
    x = torch.tensor([ids])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), num_beams=width, num_return_sequences=nret,
        do_sample=False, temperature=None, top_k=None, top_p=None, length_penalty=lp,
        early_stopping=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
        return_dict_in_generate=True, output_scores=True,
    )
    hyps = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = seq[len(ids):]
        cut = next((i for i, t in enumerate(gen) if t in eos), None)
        if cut is not None:
            gen = gen[: cut + 1]
        hyps.append({"tokens": gen, "score": score})
    return {"prompt_ids": ids, "width": width, "num_return_sequences": nret,
            "length_penalty": lp, "max_new_tokens": max_new, "eos_token_ids": eos,
            "hypotheses": hyps}


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_grad_enabled(False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    default_eos = [151645, 151643]
    cases = []
    for name, text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False)
        for width, lp in [(2, 1.0), (4, 1.0), (4, 2.0), (2, 0.5)]:
            c = run(model, ids, width, width, lp, default_eos)
            c["name"] = f"{name}/w{width}/lp{lp}"
            cases.append(c)
            print(c["name"], [(h["tokens"], round(h["score"], 5)) for h in c["hypotheses"]])
        # A custom EOS that the search meets: the best hypothesis' third token.
        base = next(c for c in cases if c["name"] == f"{name}/w4/lp1.0")
        for k, (width, nret, lp) in enumerate([(4, 4, 1.0), (2, 1, 1.0), (4, 2, 0.5), (4, 3, 2.0)]):
            hyp = base["hypotheses"][k % len(base["hypotheses"])]["tokens"]
            eos = [hyp[1 + k % 3]]
            c = run(model, ids, width, nret, lp, eos, max_new=14)
            c["name"] = f"{name}/eos{eos[0]}/w{width}/n{nret}/lp{lp}"
            cases.append(c)
            print(c["name"], [(h["tokens"], round(h["score"], 5)) for h in c["hypotheses"]])
    out = {
        "generator": "scripts/goldens/make_beam_goldens.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights_sha256": sha256(os.path.join(model_dir, "model.safetensors")),
        "cases": cases,
    }
    with open(os.path.join(out_dir, "beam_search.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
