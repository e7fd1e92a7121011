#!/usr/bin/env python3
"""A llava-1.5-7b-shaped vision tower with random weights, its reference outputs from
transformers, and transformers' own throughput on the same GPU: the real-size half of
`cuda_vision_check` (the tiny LLaVA's goldens are the other).

    python3 scripts/goldens/clip_tower.py OUT_DIR        # on the GPU machine (torch, CUDA)
    cuda_vision_check OUT_DIR OUT_DIR/model --bench

OUT_DIR/model is a `LlavaForConditionalGeneration` folder (safetensors, f32): the vision tower
of llava-1.5-7b-hf (CLIP ViT-L/14 at 336 px: hidden 1024, 24 layers, 16 heads, 576 patches),
its projector into a 4096-wide text model, and a one-layer Llama of vocab 1024 behind it
(nothing here reads the language model; it only has to load). Weights: transformers' own
initialisation (seed 0), then every bias and LayerNorm parameter moved by N(0, 0.1^2) so that
a dropped or misplaced bias or norm shows.

Reference (`manifest.json`, cases like scripts/goldens/llava.py's): two images of N(0, 1)
pixels (seed 1) through the tower in float64 with eager attention, on the GPU:
`{case}.vision_hidden.bin` [2, 576, 1024] (hidden_states[-2] without the class token) and
`{case}.image_features.bin` [2, 576, 4096] (the projector's output), f32 little endian.

`pytorch_bench` in the manifest: images/s of transformers' tower + projector (every layer
computed, as LLaVA's get_image_features does) at 32 images, median of 5 runs after a warm-up,
in f32 (TF32 off), TF32 and bf16, with SDPA attention.
"""
import json
import os
import sys
import time

import torch
import transformers
from transformers import LlavaConfig, LlavaForConditionalGeneration

IMAGES = 2
BENCH_IMAGES = 32
RUNS = 5


def config():
    vision = dict(
        model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
        num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14,
        projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    )
    text = dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=1024,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=1000,
        projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=576,
    )


def part(model, name):
    """A submodule under either layout (transformers >= 4.52 keeps them in `model.model`)."""
    found = getattr(model, name, None)
    return found if found is not None else getattr(model.model, name)


def tower_and_projector(model, pixels, select_layer=-2):
    out = part(model, "vision_tower")(pixels, output_hidden_states=True)
    hidden = out.hidden_states[select_layer][:, 1:]
    return hidden, part(model, "multi_modal_projector")(hidden)


def write_f32(path, t):
    t.detach().to("cpu", torch.float32).contiguous().numpy().tofile(path)


def bench(folder, dtype, tf32):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    model = LlavaForConditionalGeneration.from_pretrained(
        folder, torch_dtype=dtype, attn_implementation="sdpa").to("cuda").eval()
    pixels = torch.randn(BENCH_IMAGES, 3, 336, 336, device="cuda", dtype=dtype)
    times = []
    with torch.no_grad():
        tower_and_projector(model, pixels)
        for _ in range(RUNS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            tower_and_projector(model, pixels)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    median = sorted(times)[RUNS // 2]
    return {"images": BENCH_IMAGES, "median_ms": median * 1e3,
            "images_per_s": BENCH_IMAGES / median}


def main():
    out = sys.argv[1]
    folder = os.path.join(out, "model")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration._from_config(
        config(), attn_implementation="eager", torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name or "lm_head" in name:
                continue
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="50GB")

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = model.to("cuda", torch.float64).eval()
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(IMAGES, 3, 336, 336, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        hidden, features = tower_and_projector(model, pixels.to("cuda"))
    case = "two_random_images"
    write_f32(os.path.join(out, f"{case}.pixel_values.bin"), pixels)
    write_f32(os.path.join(out, f"{case}.vision_hidden.bin"), hidden)
    write_f32(os.path.join(out, f"{case}.image_features.bin"), features)
    del model
    torch.cuda.empty_cache()

    manifest = {
        "generator": "scripts/goldens/clip_tower.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0),
        "reference_dtype": "float64",
        "cases": [{
            "case": case,
            "pixel_values": {"file": f"{case}.pixel_values.bin", "shape": list(pixels.shape)},
            "vision_hidden": {"file": f"{case}.vision_hidden.bin", "shape": list(hidden.shape)},
            "image_features": {"file": f"{case}.image_features.bin",
                               "shape": list(features.shape)},
        }],
        "pytorch_bench": {
            "f32": bench(folder, torch.float32, False),
            "tf32": bench(folder, torch.float32, True),
            "bf16": bench(folder, torch.bfloat16, False),
        },
    }
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps(manifest["pytorch_bench"]))


if __name__ == "__main__":
    main()
