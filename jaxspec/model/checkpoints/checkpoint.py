"""Reading HF checkpoint directories: config.json and (sharded) safetensors, or PyTorch's
``pytorch_model.bin`` files (``torch_archive``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import threading
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec.mesh import same_on_every_process, spans_processes
from jaxspec.model.checkpoints.torch_archive import TorchArchiveError, read_torch_archive, strided_span

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
    """Where one tensor lives: its file, dtype (a safetensors name), shape and byte offset of its
    first element; ``strides`` (in elements) only for a tensor of a ``torch.save`` file that is not
    row-major (a saved view, such as a transpose)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int
    strides: tuple[int, ...] | None = None


def read_header(file: str) -> tuple[dict[str, TensorEntry], int]:
    """The tensor table of one ``.safetensors`` file (8-byte little-endian header length, a JSON
    header of ``{name: {dtype, shape, data_offsets}}``, then the data) and the header's bytes."""
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
    return out, 8 + n


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fills ``buf`` from byte ``offset`` of ``fd`` (one read may return less than asked)."""
    while len(buf):
        got = os.preadv(fd, [buf], offset)
        if got <= 0:
            raise CheckpointError(f"unexpected end of file at byte {offset}")
        buf, offset = buf[got:], offset + got


def tensor_files(path: str) -> list[str]:
    """The files holding a checkpoint directory's tensors, in the order HF's loaders prefer them:
    ``model.safetensors.index.json``'s shards, ``model.safetensors``, every ``*.safetensors``;
    else PyTorch's ``pytorch_model.bin.index.json``'s shards or ``pytorch_model.bin``."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index_path = os.path.join(path, index)
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path} has no 'weight_map' object")
            files = sorted(set(weight_map.values()))
            for file in files:
                if not os.path.exists(os.path.join(path, file)):
                    name = next(k for k, v in weight_map.items() if v == file)
                    raise FileNotFoundError(f"missing shard {file} (listed in {index_path} for {name})")
            return [os.path.join(path, f) for f in files]
        if os.path.exists(os.path.join(path, single)):
            return [os.path.join(path, single)]
        if single.endswith(".safetensors"):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if files:
                return files
    pickles = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
    hint = (f"; it holds {', '.join(pickles)}, and of PyTorch files only pytorch_model.bin (or the shards "
            "pytorch_model.bin.index.json lists) is read") if pickles else ""
    raise FileNotFoundError(
        f"no weights in {path} (expected model.safetensors, model.safetensors.index.json with shards, "
        f"or pytorch_model.bin){hint}"
    )


class CheckpointTensors:
    """Tensors of a checkpoint directory (``tensor_files``): safetensors files, or PyTorch's
    ``torch.save`` zip archives, whose tensors are read in place too (``torch_archive``: no torch,
    and no code from the pickle is run).

    Tensors are read piece by piece with plain reads of exactly the bytes asked for (rows of the
    first axis, optionally a band of another axis: a tensor-parallel shard), so the process
    holds no more than the pieces in flight and reads nothing a caller did not ask for;
    ``bytes_read`` counts what was read (headers included). (``safetensors.safe_open`` keeps a
    whole file mapped while it is open, and its numpy path refuses float8.)"""

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[str, TensorEntry] = {}
        self._lock = threading.Lock()  # bytes_read is counted from the loader's threads
        self.bytes_read = 0
        for file in tensor_files(path):
            if file.endswith(".safetensors"):
                entries, header_bytes = read_header(file)
            else:
                try:
                    entries, header_bytes = read_torch_archive(file, TensorEntry)
                except TorchArchiveError as e:
                    raise CheckpointError(str(e)) from None
            self._entries.update(entries)
            self.bytes_read += header_bytes

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        if name not in self._entries:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}")
        return self._entries[name]

    def index_digest(self) -> str:
        """A checksum of the tensor index (every tensor's name, dtype, shape and size; not where
        the files are), equal for equal checkpoints wherever they are stored."""
        h = hashlib.sha256()
        for name in sorted(self._entries):
            e = self._entries[name]
            h.update(json.dumps([name, e.dtype, list(e.shape), e.nbytes]).encode())
        return h.hexdigest()

    def read(self, name: str, shape: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None,
             band: tuple[int, int, int] | None = None) -> np.ndarray:
        """The tensor ``name`` in its stored dtype, checked against ``shape``: its rows
        ``[start, stop)`` along the first axis (``rows``; default all), and of those only
        ``[start, stop)`` along axis ``band[0] >= 1`` (``band = (axis, start, stop)``). Exactly
        those bytes are read."""
        e = self.entry(name)
        if shape is not None and tuple(e.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(e.shape)}, expected {tuple(shape)}")
        if e.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {e.dtype}")
        dt = np.dtype(SAFETENSORS_DTYPES[e.dtype])
        dims = list(e.shape) or [1]
        start, stop = (0, dims[0]) if rows is None else rows
        dims[0] = stop - start
        axis, b0, b1 = (len(dims), 0, 0) if band is None else band
        if band is not None:
            if not 1 <= axis < len(dims):
                raise ValueError(f"band axis {axis} of a {len(dims)}-axis tensor")
            dims[axis] = b1 - b0
        if e.strides is not None:
            return self._read_strided(e, dt, dims, start, band)
        out = np.empty(dims, dt)
        if out.size == 0:
            return out.reshape(tuple(e.shape) and dims)
        # Runs of contiguous bytes: everything from the band's axis on, for each index before it.
        inner = int(np.prod(e.shape[axis + 1:], dtype=np.int64)) * dt.itemsize if band is not None else 0
        strides = [int(np.prod(e.shape[i + 1:], dtype=np.int64)) * dt.itemsize for i in range(len(dims))]
        run = dims[axis] * inner if band is not None else out.nbytes
        flat = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(e.file, os.O_RDONLY)
        try:
            lead = np.ndindex(*dims[:axis]) if band is not None else [()]
            for i, idx in enumerate(lead):
                offset = e.offset + start * strides[0] + sum(j * s for j, s in zip(idx, strides)) + b0 * inner
                _pread_into(fd, flat[i * run:(i + 1) * run], offset)
        finally:
            os.close(fd)
        with self._lock:
            self.bytes_read += out.nbytes
        return out.reshape(tuple(e.shape) and dims)

    def _read_strided(self, e: TensorEntry, dt: np.dtype, dims: list[int], start: int, band) -> np.ndarray:
        """A tensor that is not row-major (a saved view): the span of its storage it covers, read
        whole, then the asked-for rows / band of it copied out."""
        raw = np.empty(strided_span(e.shape, e.strides), dt)
        fd = os.open(e.file, os.O_RDONLY)
        try:
            _pread_into(fd, memoryview(raw.view(np.uint8)), e.offset)
        finally:
            os.close(fd)
        with self._lock:
            self.bytes_read += raw.nbytes
        full = np.lib.stride_tricks.as_strided(raw, e.shape, [s * dt.itemsize for s in e.strides], writeable=False)
        index = [slice(None)] * len(e.shape)
        if e.shape:
            index[0] = slice(start, start + dims[0])
        if band is not None:
            index[band[0]] = slice(band[1], band[2])
        return np.ascontiguousarray(full[tuple(index)])

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype=None) -> np.ndarray:
        """The tensor ``name`` as an in-memory array (cast to ``dtype``), checked against ``shape``."""
        x = self.read(name, shape)
        return x if dtype is None else x.astype(dtype, copy=False)

    def close(self):
        """Nothing stays open between reads (kept for callers that close checkpoints)."""


def check_same_checkpoint(path: str, raw: dict, ckpt: CheckpointTensors, dtype, mesh) -> None:
    """On a mesh spanning several processes: every process must be loading the same checkpoint
    (a checksum of its config.json, its tensor index and the dtype asked for; not its path,
    which may differ between hosts), else a ValueError on every process before anything is read."""
    if not spans_processes(mesh):
        return
    h = hashlib.sha256(json.dumps(raw, sort_keys=True).encode())
    h.update(ckpt.index_digest().encode())
    h.update(np.dtype(dtype).name.encode())
    same_on_every_process(f"the checkpoint {path} (its config.json, tensor index or dtype)", h.hexdigest())


def read_eos_ids(path: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """eos ids from config.json (its ``text_config`` too: a multimodal wrapper's) and
    generation_config.json (int or list in any)."""
    ids: list[int] = []
    sources = [cfg, cfg.get("text_config") or {}]
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        sources.append(read_json(gen))
    for src in sources:
        eos = src.get("eos_token_id")
        for t in eos if isinstance(eos, list) else [eos]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


class ShardView:
    """One tensor-parallel shard of a checkpoint's tensors: each tensor read through it is cut
    to ``ranges`` (``[start, stop)`` pairs, concatenated) along its axis ``axis`` (several ranges
    only on axis 0); a block-scaled FP8 weight's ``<name>_scale_inv`` is cut to the scale blocks
    of those ranges (``fp8_block`` rows x cols per scale; the ranges start on block bounds).
    Reads go to ``ckpt`` for exactly the shard's bytes."""

    def __init__(self, ckpt, axis: int, ranges: list[tuple[int, int]], fp8_block: tuple[int, int] | None = None):
        if axis and len(ranges) != 1:
            raise ValueError("a shard view cuts several ranges on the first axis only")
        self.ckpt, self.path, self.axis, self.ranges, self.fp8_block = ckpt, ckpt.path, axis, ranges, fp8_block

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt

    def _ranges(self, name: str) -> list[tuple[int, int]]:
        e = self.ckpt.entry(name)
        if not name.endswith("_scale_inv") or self.fp8_block is None:
            return self.ranges
        nd = len(e.shape)
        f = self.fp8_block[0] if self.axis == nd - 2 else self.fp8_block[1] if self.axis == nd - 1 else 1
        return [(a // f, -(-b // f)) for a, b in self.ranges]

    def entry(self, name: str) -> TensorEntry:
        e = self.ckpt.entry(name)
        shape = list(e.shape)
        shape[self.axis] = sum(b - a for a, b in self._ranges(name))
        full = int(np.prod(e.shape, dtype=np.int64))
        nbytes = e.nbytes * int(np.prod(shape, dtype=np.int64)) // full if full else 0
        return dataclasses.replace(e, shape=tuple(shape), nbytes=nbytes)

    def read(self, name: str, shape=None, rows: tuple[int, int] | None = None) -> np.ndarray:
        local = self.entry(name)
        if shape is not None and tuple(local.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} shard has shape {local.shape}, expected {tuple(shape)}")
        ranges = self._ranges(name)
        if self.axis:
            (a, b), = ranges
            return self.ckpt.read(name, rows=rows, band=(self.axis, a, b))
        lo, hi = (0, local.shape[0]) if rows is None else rows
        pieces, at = [], 0
        for a, b in ranges:  # local rows [at, at + b - a) are the checkpoint's rows [a, b)
            s, t = max(lo, at), min(hi, at + b - a)
            if s < t:
                pieces.append(self.ckpt.read(name, rows=(a + s - at, a + t - at)))
            at += b - a
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else self.ckpt.read(name, rows=(0, 0))
