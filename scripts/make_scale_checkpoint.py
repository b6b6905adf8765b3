#!/usr/bin/env python
"""Writes a random HF Llama checkpoint of a real model's shape, for measuring load time and memory.

    PYTHONPATH=. python scripts/make_scale_checkpoint.py OUT_DIR              # Llama-3.2-1B shape, float16, 3 shards
    PYTHONPATH=. python scripts/make_scale_checkpoint.py OUT_DIR --shape medium --shards 2

Shapes: "1b" = Llama-3.2-1B (vocab 128256, hidden 2048, 16 layers, 32 / 8 heads of 64, MLP 8192,
tied embeddings; about 2.5 GB in float16); "medium" = a 375 MB model for the memory test. The values are
random (N(0, 0.02)); the files, names and index are those of an HF ``LlamaForCausalLM`` export.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file

SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False),
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    H, I, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    out = {"model.embed_tokens.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H), p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q), p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)}
    out["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, H)
    return out


def write_checkpoint(out: str, shape: str = "1b", shards: int = 3, dtype: str = "float16", seed: int = 0) -> int:
    """Writes the checkpoint; returns its parameter bytes."""
    cfg = SHAPES[shape]
    os.makedirs(out, exist_ok=True)
    np_dtype = np.dtype(dtype)
    shapes = tensor_shapes(cfg)
    names = list(shapes)
    total = sum(int(np.prod(s)) for s in shapes.values()) * np_dtype.itemsize
    rng = np.random.default_rng(seed)
    per_shard, weight_map, shard, size = total / shards, {}, [], 0.0
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    k = 0
    for name in names:
        shard.append(name)
        size += int(np.prod(shapes[name])) * np_dtype.itemsize
        last = name == names[-1]
        if size >= per_shard * (k + 1) or last:
            tensors = {}
            for n in shard:
                fill = np.ones if n.endswith("norm.weight") else None
                tensors[n] = (fill(shapes[n], np_dtype) if fill else
                              (0.02 * rng.standard_normal(shapes[n], dtype=np.float32)).astype(np_dtype))
                weight_map[n] = files[k]
            save_file(tensors, os.path.join(out, files[k]), metadata={"format": "pt"})
            del tensors
            shard, k = [], min(k + 1, shards - 1)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
              "torch_dtype": dtype, **cfg}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    if args.dtype == "bfloat16":
        import ml_dtypes  # noqa: F401  (registers the dtype name with numpy)

        args.dtype = ml_dtypes.bfloat16
    total = write_checkpoint(args.out, args.shape, args.shards, args.dtype)
    print(f"wrote {total / 1e9:.2f} GB of parameters to {args.out}")


if __name__ == "__main__":
    main()
