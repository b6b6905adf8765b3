#!/usr/bin/env python
"""Quantizes a DeepSeek-V3-style checkpoint the way DeepSeek ships V3 / V3.2: every linear
``*_proj.weight`` of the decoder layers (experts included; not the MTP layer's ``eh_proj``, the
router, norms, embedding or head) stored as float8 e4m3 with one float32 ``weight_scale_inv`` per
128 x 128 block (dequantized weight = fp8 value x scale), and ``quantization_config`` in
``config.json``. Used to test jaxspec's FP8 loading against the unquantized source.

    PYTHONPATH=. python scripts/make_fp8_checkpoint.py SRC_DIR OUT_DIR [--block 128]
"""

from __future__ import annotations

import argparse
import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.checkpoints.checkpoint import CheckpointTensors

E4M3_MAX = 448.0
QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """w [rows, cols] -> (e4m3 [rows, cols], f32 scale [ceil(rows/b), ceil(cols/b)]): each block
    scaled so its largest magnitude maps to the e4m3 maximum."""
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = np.zeros((br * block, bc * block), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(br, block, bc, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(br * block, bc * block)[:rows, :cols]
    return np.clip(q, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn), scale


def quantize_checkpoint(src: str, out: str, block: int = 128) -> list[str]:
    """Writes the quantized copy of ``src`` to ``out``; returns the names of the quantized tensors."""
    os.makedirs(out, exist_ok=True)
    ckpt = CheckpointTensors(src)
    tensors, done = {}, []
    for name in ckpt.keys():
        x = ckpt.get(name)
        if QUANTIZED.match(name) and ".eh_proj." not in name and x.ndim == 2:
            tensors[name], tensors[name + "_scale_inv"] = quantize(x.astype(np.float32), block)
            done.append(name)
        else:
            tensors[name] = x
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [block, block]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for extra in ("generation_config.json", "tokenizer.json"):
        if os.path.exists(os.path.join(src, extra)):
            with open(os.path.join(src, extra)) as a, open(os.path.join(out, extra), "w") as b:
                b.write(a.read())
    return done


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    done = quantize_checkpoint(args.src, args.out, args.block)
    print(f"quantized {len(done)} tensors to float8 e4m3 with {args.block}x{args.block} block scales -> {args.out}")


if __name__ == "__main__":
    main()
