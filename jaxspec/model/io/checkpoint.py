"""Reading HF checkpoint directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

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
    elif rope.kind == "yarn":
        out["rope_scaling"] = {
            "rope_type": "yarn", "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "truncate": rope.truncate,
            **({"mscale": rope.mscale} if rope.mscale else {}),
            **({"mscale_all_dim": rope.mscale_all_dim} if rope.mscale_all_dim else {}),
            **({"attention_factor": rope.attention_factor} if rope.attention_factor is not None else {}),
        }
    elif rope.kind != "default":
        raise ValueError(f"cannot write {rope.kind!r} RoPE as HF Llama-style config fields")
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


def fp8_block_size(raw: dict, where: str) -> tuple[int, int] | None:
    """The ``[rows, cols]`` block of a block-scaled FP8 checkpoint's weight scales
    (DeepSeek-V3 / V4's ``quantization_config``: ``quant_method`` "fp8", ``fmt`` "e4m3",
    ``weight_block_size``, ``scale_fmt`` float or ue8m0; V4's routed experts may instead be FP4,
    ``expert_dtype`` "fp4", e2m1 values two per byte with their own scales), None when the
    checkpoint is not quantized; any other quantization is refused by name."""
    q = raw.get("quantization_config")
    expert_dtype = (q or {}).get("expert_dtype", raw.get("expert_dtype"))
    if expert_dtype not in (None, "fp8", "fp4", "bf16"):
        raise CheckpointError(f"{where}: expert_dtype {expert_dtype!r} is not supported; supported: fp8, fp4 "
                              f"(e2m1, two per byte, with block scales), dequantized while loading")
    if not q:
        return None
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method != "fp8" or q.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(
            f"{where}: quantization {method!r} (fmt {q.get('fmt')!r}, weight_block_size {block!r}) is not supported; "
            f"supported: block-scaled fp8 e4m3 (DeepSeek-V3 / V4), dequantized while loading"
        )
    if q.get("scale_fmt") not in (None, "float", "ue8m0"):
        raise CheckpointError(f"{where}: fp8 scale_fmt {q.get('scale_fmt')!r} is not supported; supported: float, "
                              f"ue8m0")
    return int(block[0]), int(block[1])


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


# safetensors dtype names -> numpy dtypes (float8 through ml_dtypes: numpy has none).
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and byte offset of its data."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int


def read_header(file: str) -> dict[str, TensorEntry]:
    """The tensor table of one ``.safetensors`` file (8-byte little-endian header length, a JSON
    header of ``{name: {dtype, shape, data_offsets}}``, then the data)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not a safetensors file ({e})") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = TensorEntry(file, info["dtype"], tuple(info["shape"]), 8 + n + begin, end - begin)
    return out


class SafetensorsCheckpoint:
    """Tensors of a checkpoint directory: ``model.safetensors``, or shards listed by
    ``model.safetensors.index.json``, or (fallback) every ``*.safetensors`` file.

    Tensors are read one at a time through a memory map of just their bytes, which is closed as
    soon as the caller is done with the array: the process never holds more than the tensor it is
    placing (plus what was already placed), however large the files. (``safetensors.safe_open``
    keeps a whole file mapped while it is open, and its numpy path refuses float8.)"""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} has no 'weight_map' object")
            files = sorted(set(weight_map.values()))
            for file in files:
                if not os.path.exists(os.path.join(path, file)):
                    name = next(k for k, v in weight_map.items() if v == file)
                    raise FileNotFoundError(f"missing shard {file} (listed in {index_path} for {name})")
            files = [os.path.join(path, f) for f in files]
        else:
            files = [single] if os.path.exists(single) else sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")
            )
            if not files:
                raise FileNotFoundError(
                    f"no safetensors weights in {path} (expected model.safetensors or "
                    f"model.safetensors.index.json with shards)"
                )
        self._entries: dict[str, TensorEntry] = {}
        for file in files:
            self._entries.update(read_header(file))

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        return self._entries[name]

    def read(self, name: str, shape: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor ``name`` (or its rows ``[start, stop)`` along the first axis) in its stored
        dtype, as a read-only memory map of just those bytes (nothing is read until used),
        checked against ``shape``."""
        e = self.entry(name)
        if shape is not None and tuple(e.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(e.shape)}, expected {tuple(shape)}")
        if e.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {e.dtype}")
        dt = np.dtype(SAFETENSORS_DTYPES[e.dtype])
        start, stop = (0, e.shape[0] if e.shape else 1) if rows is None else rows
        out_shape = (stop - start,) + tuple(e.shape[1:]) if e.shape else ()
        if e.nbytes == 0 or (e.shape and stop == start):
            return np.zeros(out_shape, dt)
        row_bytes = e.nbytes // e.shape[0] if e.shape else e.nbytes
        return np.memmap(e.file, dtype=dt, mode="r", offset=e.offset + start * row_bytes, shape=out_shape)

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype=None) -> np.ndarray:
        """The tensor ``name`` as an in-memory array (cast to ``dtype``), checked against ``shape``."""
        x = self.read(name, shape)
        return np.array(x, dtype=dtype if dtype is not None else x.dtype)

    def close(self):
        """Nothing stays open between reads (kept for callers that close checkpoints)."""


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
