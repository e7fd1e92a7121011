#!/usr/bin/env python3
"""GGUF dequantization goldens for shared/engine/tests/gguf_dequant.rs.

Writes shared/engine/tests/goldens/gguf/quants.gguf: one small tensor per GGML type the engine
reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) plus one it does not (Q5_0), and
quants_f32.bin / quants.json: each tensor's values as dequantized by the reference
`gguf.quants.dequantize` (little-endian f32, concatenated in the order of quants.json).

Random data (fixed seed) is quantized with `gguf.quants.quantize` where the package can
(F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0); Q4_K and Q6_K have no quantizer there, so their blocks are
random bytes with finite f16 scales (every bit of the packed scales and quants exercised).

    pip install gguf numpy      # pure Python, no torch
    python3 scripts/goldens/make_gguf_goldens.py
"""
import importlib.metadata
import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.quants import dequantize, quantize

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "engine", "tests", "goldens", "gguf")
ROWS, COLS = 3, 512  # Hugging Face order [rows, cols]; cols a multiple of 256 (k-quant blocks)

rng = np.random.default_rng(20261130)


def random_k_blocks(qtype, n_blocks, block_bytes, f16_offsets):
    b = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in f16_offsets:
        d = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        b[:, off:off + 2] = d
    return b


def main():
    os.makedirs(OUT, exist_ok=True)
    w = GGUFWriter(os.path.join(OUT, "quants.gguf"), "llama")
    w.add_string("test.string", "héllo")
    w.add_array("test.strings", ["a", "bc", ""])
    w.add_float32("test.f32", 0.5)
    w.add_uint64("test.u64", 1 << 40)
    w.add_bool("test.bool", True)
    index = []
    values = []
    data = (rng.standard_normal((ROWS, COLS)) * 0.5).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block
    for name, qtype in [("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q8_0", T.Q8_0),
                        ("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("q5_0", T.Q5_0)]:
        if qtype == T.F32:
            raw = data.copy()
            w.add_tensor(name, raw)
        else:
            raw = quantize(data, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
        deq = dequantize(raw, qtype).astype(np.float32)
        assert deq.shape == (ROWS, COLS), deq.shape
        if qtype != T.Q5_0:
            index.append({"name": name, "type": qtype.name, "shape": [ROWS, COLS]})
            values.append(deq.reshape(-1))
    # k-quants: 144-byte Q4_K blocks (d, dmin at 0, 2), 210-byte Q6_K blocks (d at 208).
    n_blocks = ROWS * COLS // 256
    for name, qtype, bb, offs in [("q4_k", T.Q4_K, 144, [0, 2]), ("q6_k", T.Q6_K, 210, [208])]:
        raw = random_k_blocks(qtype, n_blocks, bb, offs).reshape(ROWS, COLS // 256 * bb)
        w.add_tensor(name, raw, raw_dtype=qtype)
        deq = dequantize(raw, qtype).astype(np.float32)
        assert deq.shape == (ROWS, COLS), deq.shape
        assert np.isfinite(deq).all()
        index.append({"name": name, "type": qtype.name, "shape": [ROWS, COLS]})
        values.append(deq.reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    np.concatenate(values).astype("<f4").tofile(os.path.join(OUT, "quants_f32.bin"))
    with open(os.path.join(OUT, "quants.json"), "w") as f:
        json.dump({"generator": "scripts/goldens/make_gguf_goldens.py",
                   "gguf_version": importlib.metadata.version("gguf"), "tensors": index}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
