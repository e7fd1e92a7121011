#!/usr/bin/env python3
"""Goldens for tandem-media's CLIP preprocessing, from transformers' PIL-backend CLIP processor.

Run from the repository root (deterministic; needs `pip install transformers pillow numpy`, no torch):

    python3 shared/media/tests/goldens/make_goldens.py

It (a) writes small test images (seeded, smooth structure plus edges and a little noise) into
this folder, (b) preprocesses each with llava-1.5's parameters at a small size (shortest edge 56,
crop 56x56; one run at 336), (c) writes the expected pixel values as little-endian f32 CHW
`.bin` files and `manifest.json`. The 336 run is stored as the uint8 values before rescale and
normalisation (`encoding: "u8_chw"`), to keep the goldens small; the script checks that
normalising them reproduces transformers' output. For JPEGs it also stores Pillow's decoded RGB
(`pil_rgb`), since JPEG decoders legitimately differ by a few uint8 steps.
"""
import json
import os

import numpy as np
import PIL
from PIL import Image
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def processor(n):
    kwargs = dict(
        do_resize=True,
        size={"shortest_edge": n},
        resample=3,
        do_center_crop=True,
        crop_size={"height": n, "width": n},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=MEAN,
        image_std=STD,
        do_convert_rgb=True,
    )
    try:  # transformers >= 5: the PIL backend is its own class
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil(**kwargs)
    except ImportError:  # transformers 4: the slow processor
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor(**kwargs)


def smooth_rgb(rng, w, h):
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    chans = []
    for _ in range(3):
        fx, fy = rng.uniform(0.5, 3.0, 2) * 2 * np.pi / max(w, h)
        phase = rng.uniform(0, 2 * np.pi)
        base = 128 + 90 * np.sin(fx * x + phase) * np.cos(fy * y) + rng.uniform(-30, 30) * (x / w - y / h)
        chans.append(base)
    img = np.stack(chans, axis=-1)
    # A few sharp-edged rectangles (ringing and clipping in the bicubic filter).
    for _ in range(3):
        x0, y0 = rng.integers(0, w), rng.integers(0, h)
        x1, y1 = x0 + rng.integers(1, max(2, w // 3)), y0 + rng.integers(1, max(2, h // 3))
        img[y0:y1, x0:x1] = rng.integers(0, 256, 3)
    img += rng.normal(0, 4, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_images():
    rng = np.random.default_rng(20261203)
    specs = []

    def save(name, arr, mode, fmt, **kw):
        Image.fromarray(arr, mode).save(os.path.join(HERE, name), fmt, **kw)
        specs.append(name)

    save("rgb_64x48.png", smooth_rgb(rng, 64, 48), "RGB", "PNG")
    save("rgb_37x91.png", smooth_rgb(rng, 37, 91), "RGB", "PNG")
    save("rgb_300x200_q90.jpg", smooth_rgb(rng, 300, 200), "RGB", "JPEG", quality=90)
    save("rgb_91x37_q90.jpg", smooth_rgb(rng, 91, 37), "RGB", "JPEG", quality=90)
    save("rgb_120x80_lossless.webp", smooth_rgb(rng, 120, 80), "RGB", "WEBP", lossless=True)
    save("rgb_80x120_lossy.webp", smooth_rgb(rng, 80, 120), "RGB", "WEBP", quality=80)
    save("rgb_20x20.png", smooth_rgb(rng, 20, 20), "RGB", "PNG")
    rgba = np.concatenate([smooth_rgb(rng, 50, 40), smooth_rgb(rng, 50, 40)[..., :1]], axis=-1)
    rgba[:5, :, 3] = 0
    rgba[5:10, :, 3] = 255
    save("rgba_50x40.png", rgba, "RGBA", "PNG")
    save("gray_45x60.png", smooth_rgb(rng, 45, 60)[..., 1], "L", "PNG")
    return specs


def main():
    names = make_images()
    entries = []
    p56 = processor(56)
    for name in names:
        with Image.open(os.path.join(HERE, name)) as im:
            out = p56(images=[im], return_tensors="np")["pixel_values"][0]
        assert out.dtype == np.float32 and out.shape == (3, 56, 56), (out.dtype, out.shape)
        bin_name = name.rsplit(".", 1)[0] + f".{name.rsplit('.', 1)[1]}.s56.f32.bin"
        out.astype("<f4").tofile(os.path.join(HERE, bin_name))
        entry = {"image": name, "size": 56, "shape": list(out.shape), "encoding": "f32le_chw", "expected": bin_name}
        if name.endswith(".jpg"):
            # JPEG decoders differ by a few uint8 steps (libjpeg-turbo vs zune-jpeg): keep
            # Pillow's decoded pixels too, so the preprocessing itself is checked exactly.
            with Image.open(os.path.join(HERE, name)) as im:
                rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
            entry["pil_rgb"] = name + ".pil_rgb.u8.bin"
            rgb.tofile(os.path.join(HERE, entry["pil_rgb"]))
        entries.append(entry)

    # One run at llava-1.5's real size, stored as uint8 before rescale/normalise.
    name = "rgb_300x200_q90.jpg"
    with Image.open(os.path.join(HERE, name)) as im:
        out = processor(336)(images=[im], return_tensors="np")["pixel_values"][0]
    assert out.shape == (3, 336, 336)
    mean = np.array(MEAN, dtype=np.float32)[:, None, None]
    std = np.array(STD, dtype=np.float32)[:, None, None]
    u8 = np.rint((out * std + mean) * 255).astype(np.uint8)
    again = ((u8.astype(np.float64) * (1 / 255)).astype(np.float32) - mean) / std
    assert np.array_equal(again, out), float(np.abs(again - out).max())
    bin_name = "rgb_300x200_q90.jpg.s336.u8.bin"
    u8.tofile(os.path.join(HERE, bin_name))
    entries.append({"image": name, "size": 336, "shape": list(out.shape), "encoding": "u8_chw", "expected": bin_name, "pil_rgb": name + ".pil_rgb.u8.bin"})

    manifest = {
        "transformers": transformers.__version__,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "processor": type(p56).__name__,
        "image_mean": MEAN,
        "image_std": STD,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "goldens": entries,
    }
    with open(os.path.join(HERE, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
