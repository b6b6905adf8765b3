"""Reading HF checkpoint directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

DTYPES = {
    "float32": np.float32,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


def rope_fields(rope) -> dict:
    """``RopeConfig`` -> the classic HF config fields (``rope_theta`` + ``rope_scaling``)."""
    out: dict = {"rope_theta": rope.theta}
    if rope.kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
    elif rope.kind == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return out


def decoder_fields(cfg, num_layers: int) -> dict:
    """The decoder-shape fields of an HF ``config.json`` (SwiGLU MLP, RMSNorm) for any config
    with hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim and rms_norm_eps."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
    }


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing or malformed."""


def resolve_dtype(dtype) -> np.dtype:
    """Accepts "float32" | "bfloat16" | "float16" or the numpy / jnp dtype objects."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return np.dtype(DTYPES[dtype])
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}") from None
    if dt not in {np.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"unsupported dtype {dt}; expected one of {sorted(DTYPES)}")
    return dt


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"missing file: {path}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    return read_json(os.path.join(path, "config.json"))


class SafetensorsCheckpoint:
    """Tensors of a checkpoint directory: ``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``, or (fallback) every ``*.safetensors`` file."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self._file_of: dict[str, str] = {}
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} has no 'weight_map' object")
            for name, file in weight_map.items():
                full = os.path.join(path, file)
                if not os.path.exists(full):
                    raise FileNotFoundError(f"missing shard {file} (listed in {index_path} for {name})")
                self._file_of[name] = full
        else:
            files = [single] if os.path.exists(single) else sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
            )
            if not files:
                raise FileNotFoundError(
                    f"no safetensors weights in {path} (expected model.safetensors or "
                    f"model.safetensors.index.json with shards)"
                )
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    for name in f.keys():
                        self._file_of[name] = file
        self._handles: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def keys(self) -> list[str]:
        return list(self._file_of)

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype=None) -> np.ndarray:
        """The tensor ``name`` (cast to ``dtype``), checked against ``shape``."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="numpy")
        x = self._handles[file].get_tensor(name)
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}"
            )
        return x.astype(dtype) if dtype is not None else x

    def close(self):
        self._handles.clear()


def read_eos_ids(path: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """eos ids from config.json and generation_config.json (int or list in either)."""
    ids: list[int] = []
    sources = [cfg]
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        sources.append(read_json(gen))
    for src in sources:
        eos = src.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)
