#!/usr/bin/env python3
"""Golden outputs of transformers for the tiny LLaVA (`tandem model tiny-vl`).

    cargo run -p tandem -- model tiny-vl .carry/tiny-vl                  # build machine
    python3 scripts/goldens/llava.py .carry/tiny-vl IMAGES_DIR OUT_DIR  # where torch is

MODEL_DIR is the folder `tandem model tiny-vl` writes (llava-hf/llava-1.5-7b-hf layout);
IMAGES_DIR holds PNG/JPEG files, of which the first three by name are used (at least two).

The model is loaded with `LlavaForConditionalGeneration.from_pretrained(..., torch_dtype=f32)`
on the CPU with eager attention (plain IEEE f32), and the processor with
`AutoProcessor.from_pretrained(..., use_fast=False)` (the slow `CLIPImageProcessor`: PIL
bicubic resize, centre crop, rescale, normalise). Loading must find every tensor (no missing
or unexpected keys, which transformers would otherwise initialise at random).

Cases (prompts rendered with the folder's chat template, `add_generation_prompt=True`):
- `one_image`: image 0 and a question;
- `two_images`: images 0 and 1 and a question;
- `one_image_b`: image 2 (when there is one) and the first question.

With `--lm-bf16`, only the CPU f32 set, the language model's matrices first rounded to bf16
(what Tandem's bf16 CUDA precisions compute with; norms, tower and projector stay f32): the
baseline of `cuda_llava_check OUT_DIR bf16x2`.

For each case, into OUT_DIR (CPU, f32) and OUT_DIR/cuda (CUDA, bfloat16, outputs cast to f32),
all `.bin` files f32 little endian, row-major:
- `{case}.pixel_values.bin`   [n_images, 3, 56, 56], what the processor made;
- `{case}.vision_hidden.bin`  [n_images, 16, 32], the vision tower's hidden_states[-2]
  without the class token (the projector's input; for debugging);
- `{case}.image_features.bin` [n_images, 16, text_hidden], `model.get_image_features`;
- `{case}.logits_last.bin`    [4, vocab], the full prompt's logits at its last 4 positions;
- `{case}.input_ids.json`, the prompt's ids after the processor expanded `<image>`;
and in the manifest: input_ids, the argmax and top-2 margin (top1 - top2) of every prompt
position, 8 greedy tokens from `generate(do_sample=False, max_new_tokens=8)`, and 8 greedy
tokens from a plain no-cache argmax loop with each step's top-2 margin (the two agree unless
generate stopped at an EOS). `manifest.json` also holds the shapes, the transformers and torch
versions, the sha256 of model.safetensors and of each image.
"""
import glob
import hashlib
import json
import os
import sys

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

GREEDY = 8
LAST_ROWS = 4
QUESTIONS = [
    "What is in this picture?",
    "What differs between these two pictures?",
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def f32(t):
    """A tensor (or array) as a contiguous f32 numpy array."""
    if isinstance(t, torch.Tensor):
        t = t.detach().to(device="cpu", dtype=torch.float32).numpy()
    return np.ascontiguousarray(t, dtype="<f4")


def write_bin(out_dir, name, t):
    a = f32(t)
    with open(os.path.join(out_dir, name), "wb") as f:
        f.write(a.tobytes())
    return {"file": name, "dtype": "f32", "shape": list(a.shape)}


def as_feature_tensor(x):
    """`get_image_features` returns a tensor, a list/tuple of per-image tensors, or (newer
    transformers) a ModelOutput; make it one [n_images, tokens, hidden] tensor."""
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "pooler_output") and getattr(x, "pooler_output", None) is not None:
        return as_feature_tensor(x.pooler_output)
    if isinstance(x, (list, tuple)):
        return torch.stack([as_feature_tensor(t) for t in x])
    if hasattr(x, "to_tuple"):
        return as_feature_tensor(x.to_tuple()[0])
    raise TypeError(f"get_image_features returned {type(x)}")


def image_token_id(cfg):
    v = getattr(cfg, "image_token_index", None)
    return v if v is not None else cfg.image_token_id


def vision_tower(model):
    vt = getattr(model, "vision_tower", None)
    if vt is None:
        vt = model.model.vision_tower
    return vt


def top2_margin(logits):
    """Per row of [rows, vocab]: argmax and top1 - top2."""
    top = torch.topk(logits.float(), 2, dim=-1)
    return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


def load_model(model_dir, device, dtype, attn):
    model, info = LlavaForConditionalGeneration.from_pretrained(
        model_dir,
        torch_dtype=dtype,
        attn_implementation=attn,
        output_loading_info=True,
    )
    bad = {k: list(v) for k, v in info.items() if v}
    if bad:
        sys.exit(f"loading {model_dir} on {device} was not exact: {bad}")
    return model.to(device).eval()


def build_cases(processor, images):
    """(name, prompt text, list of PIL images) per case."""

    def prompt(n_images, question):
        content = [{"type": "image"} for _ in range(n_images)]
        content.append({"type": "text", "text": question})
        messages = [{"role": "user", "content": content}]
        return processor.apply_chat_template(messages, add_generation_prompt=True)

    cases = [
        ("one_image", prompt(1, QUESTIONS[0]), [images[0]]),
        ("two_images", prompt(2, QUESTIONS[1]), [images[0], images[1]]),
    ]
    if len(images) > 2:
        cases.append(("one_image_b", prompt(1, QUESTIONS[0]), [images[2]]))
    return cases


def run_case(model, processor, name, text, images, device, dtype, out_dir):
    inputs = processor(images=images, text=text, return_tensors="pt")
    input_ids = inputs["input_ids"].to(device)
    attention_mask = inputs["attention_mask"].to(device)
    pixel_values = inputs["pixel_values"]
    entry = {
        "case": name,
        "prompt": text,
        "n_images": len(images),
        "input_ids": input_ids[0].tolist(),
        "n_image_tokens": int((input_ids[0] == image_token_id(model.config)).sum()),
        "pixel_values": write_bin(out_dir, f"{name}.pixel_values.bin", pixel_values),
    }
    pv = pixel_values.to(device=device, dtype=dtype)
    cfg = model.config

    hs = vision_tower(model)(pv, output_hidden_states=True).hidden_states
    vision_hidden = hs[cfg.vision_feature_layer][:, 1:]
    entry["vision_hidden"] = write_bin(out_dir, f"{name}.vision_hidden.bin", vision_hidden)

    feats = as_feature_tensor(
        model.get_image_features(
            pixel_values=pv,
            vision_feature_layer=cfg.vision_feature_layer,
            vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        )
    )
    want = (len(images), cfg.image_seq_length, cfg.text_config.hidden_size)
    if tuple(feats.shape) != want:
        sys.exit(f"{name}: image features of shape {tuple(feats.shape)}, expected {want}")
    entry["image_features"] = write_bin(out_dir, f"{name}.image_features.bin", feats)

    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, pixel_values=pv
    ).logits[0]
    entry["seq_len"] = int(logits.shape[0])
    entry["vocab"] = int(logits.shape[1])
    entry["logits_last"] = write_bin(out_dir, f"{name}.logits_last.bin", logits[-LAST_ROWS:])
    entry["logits_last_positions"] = list(
        range(logits.shape[0] - LAST_ROWS, logits.shape[0])
    )
    argmax, margin = top2_margin(logits)
    entry["argmax"] = argmax
    entry["top2_margin"] = margin

    gen = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        pixel_values=pv,
        do_sample=False,
        max_new_tokens=GREEDY,
    )
    entry["generate_tokens"] = gen[0, input_ids.shape[1]:].tolist()

    # A plain greedy loop (full forward each step, no cache): 8 tokens whatever they are,
    # with each step's margin.
    ids = input_ids
    tokens, margins = [], []
    for _ in range(GREEDY):
        step = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pv
        ).logits[0, -1:]
        a, m = top2_margin(step)
        tokens.append(a[0])
        margins.append(m[0])
        ids = torch.cat([ids, torch.tensor([[a[0]]], device=device, dtype=ids.dtype)], dim=1)
    entry["greedy_tokens"] = tokens
    entry["greedy_margins"] = margins
    entry["greedy_text"] = processor.tokenizer.decode(tokens)
    with open(os.path.join(out_dir, f"{name}.input_ids.json"), "w") as f:
        json.dump(entry["input_ids"], f)
        f.write("\n")
    return entry


def run_all(model_dir, processor, cases, device, dtype, attn, out_dir, common, prepare=None):
    os.makedirs(out_dir, exist_ok=True)
    model = load_model(model_dir, device, dtype, attn)
    if prepare is not None:
        prepare(model)
    manifest = dict(common)
    manifest.update(
        {
            "device": device,
            "dtype": str(dtype).replace("torch.", ""),
            "attn_implementation": attn,
            "cases": [],
        }
    )
    with torch.no_grad():
        for name, text, images in cases:
            manifest["cases"].append(
                run_case(model, processor, name, text, images, device, dtype, out_dir)
            )
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    for c in manifest["cases"]:
        print(
            f"{device} {c['case']}: seq {c['seq_len']}, greedy {c['greedy_tokens']} "
            f"(generate {c['generate_tokens']}), min margin {min(c['top2_margin']):.4g}"
        )


def round_language_model_to_bf16(model):
    """Rounds the language model's matrices (embeddings, projections, lm_head) to bf16 and
    back: the weights Tandem's bf16 CUDA precisions compute with. Norms, the vision tower and
    the projector keep f32 (Tandem keeps them in f32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "vision_tower" not in name and "multi_modal_projector" not in name:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def main():
    args = [a for a in sys.argv[1:] if a != "--lm-bf16"]
    lm_bf16 = "--lm-bf16" in sys.argv[1:]
    if len(args) != 3:
        sys.exit("usage: llava.py MODEL_DIR IMAGES_DIR OUT_DIR [--lm-bf16]")
    model_dir, images_dir, out_dir = args
    torch.manual_seed(0)
    paths = sorted(
        p
        for ext in ("png", "jpg", "jpeg", "PNG", "JPG", "JPEG")
        for p in glob.glob(os.path.join(images_dir, f"*.{ext}"))
    )[:3]
    if len(paths) < 2:
        sys.exit(f"need at least two PNG/JPEG images in {images_dir}")
    images = [Image.open(p).convert("RGB") for p in paths]

    processor = AutoProcessor.from_pretrained(model_dir, use_fast=False)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    common = {
        "generator": "scripts/goldens/llava.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights_sha256": sha256_file(os.path.join(model_dir, "model.safetensors")),
        "image_token_index": cfg["image_token_index"],
        "image_seq_length": cfg["image_seq_length"],
        "text_hidden": cfg["text_config"]["hidden_size"],
        "vocab_size": cfg["text_config"]["vocab_size"],
        "image_processor": type(processor.image_processor).__name__,
        "tokenizer": type(processor.tokenizer).__name__,
        "images": [
            {"file": os.path.basename(p), "sha256": sha256_file(p), "size": list(im.size)}
            for p, im in zip(paths, images)
        ],
    }
    cases = build_cases(processor, images)

    if lm_bf16:
        # The baseline of Tandem's default CUDA precision: f32 arithmetic on the weights it
        # computes with (as the text models' CUDA check); no CUDA set.
        common["language_model_weights"] = "rounded to bf16"
        run_all(model_dir, processor, cases, "cpu", torch.float32, "eager", out_dir, common,
                round_language_model_to_bf16)
        return
    run_all(model_dir, processor, cases, "cpu", torch.float32, "eager", out_dir, common)
    if torch.cuda.is_available():
        run_all(
            model_dir,
            processor,
            cases,
            "cuda",
            torch.bfloat16,
            "sdpa",
            os.path.join(out_dir, "cuda"),
            common,
        )
    else:
        print("no CUDA device: skipped OUT_DIR/cuda", file=sys.stderr)


if __name__ == "__main__":
    main()
