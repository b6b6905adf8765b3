"""Parameter-name tables: one per model family, driving checkpoint load, export and random init.

A table is a list of entries built from a config. Each entry names one array of our param
pytree (a ``/``-separated path such as ``layers/wq``), the checkpoint tensor(s) that hold it,
its shape in our layout and how to initialize it. Three generic functions walk a table:

    load_params(table, ckpt, dtype)     checkpoint -> our pytree (checked shapes, named errors)
    export_params(table, params, dtype) our pytree -> {checkpoint name: array}
    init_params(table, seed, scale)     random pytree (one host RNG, in table order)

so a family's names are written once. Stacked entries fill a leading ``[L]`` axis from the
checkpoint's per-layer tensors (``{i}`` in the name), and optionally an expert axis (``{e}``).
Linear weights are stored ``[in, out]`` here and ``[out, in]`` (nn.Linear) in checkpoints.
An entry is one checkpoint tensor as one array (``Param``), one tensor holding several of ours
(``SplitParam``), or several tensors joined into one of ours (``FusedParam``: projections of
one input run as one product, ``jaxspec.model.fused``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxspec.mesh import MODEL
from jaxspec.model.config import padded_vocab_size
from jaxspec.model.fused import column_shards, fuse_columns, split_columns
from jaxspec.model.checkpoints.checkpoint import SAFETENSORS_DTYPES, CheckpointError, ShardView

LINEAR = (1, 0)  # nn.Linear [out, in] -> ours [in, out]


@dataclasses.dataclass(frozen=True)
class Param:
    """One array of our pytree and the checkpoint tensor(s) behind it.

    Attributes:
      path: where it lives in our pytree, ``/``-separated.
      hf: checkpoint tensor name; ``{i}`` is replaced by each layer of ``layers``, ``{e}`` by
        each expert.
      shape: our shape of one entry (without the stacked layer / expert axes).
      init: "normal" (scaled N(0, 1)), "ones" or "zeros".
      perm: axis permutation taking the checkpoint tensor to ours (``LINEAR`` for linear
        weights); None keeps the checkpoint's layout.
      layers: checkpoint layer indices stacked on our leading axis (None: not stacked).
      experts: experts stacked on the next axis (None: no expert axis).
      dtype: a fixed dtype (e.g. "float32" for a router bias) instead of the model's.
      tp: how tensor parallelism splits it over the mesh's ``model`` axis: the axis of ``shape``
        that is split (column-parallel weights: the output axis, row-parallel: the input axis,
        the vocabulary axis of the embedding and head), "experts" for the expert axis, None to
        replicate.
      repeat: each checkpoint head (``unit`` rows of its first axis) appears ``repeat`` times in
        ours: KV heads replicated when the model axis has more shards than KV heads.
      pad: ours has ``pad`` more entries than the checkpoint along the checkpoint's first axis,
        left zero (a vocabulary padded to split evenly over the model axis).
      first_expert: the checkpoint expert of our first (a shard of the experts).
    """

    path: str
    hf: str
    shape: tuple[int, ...]
    init: str = "normal"
    perm: tuple[int, ...] | None = None
    layers: tuple[int, ...] | None = None
    experts: int | None = None
    dtype: str | None = None
    tp: int | str | None = None
    repeat: int = 1
    unit: int = 0
    pad: int = 0
    first_expert: int = 0

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        lead = () if self.layers is None else (len(self.layers),)
        lead += () if self.experts is None else (self.experts,)
        return lead + tuple(self.shape)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        out = list(self.shape)
        if self.perm is not None:
            for ours, theirs in enumerate(self.perm):
                out[theirs] = self.shape[ours]
        out[0] = out[0] // self.repeat - self.pad
        return tuple(out)

    def from_hf(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.repeat > 1:  # [heads * unit, ...] -> [heads * repeat * unit, ...]
            heads = x.reshape((-1, self.unit) + x.shape[1:])
            x = np.repeat(heads, self.repeat, axis=0).reshape((-1,) + x.shape[1:])
        return (x if self.perm is None else np.transpose(x, self.perm),)

    def to_hf(self, *ours: np.ndarray) -> np.ndarray:
        (x,) = ours
        x = x if self.perm is None else np.transpose(x, np.argsort(self.perm))
        if self.repeat > 1:  # keep one copy of each repeated head
            x = x.reshape((-1, self.repeat, self.unit) + x.shape[1:])[:, 0].reshape((-1,) + x.shape[1:])
        return x[: x.shape[0] - self.pad]


@dataclasses.dataclass(frozen=True)
class SplitParam:
    """One checkpoint tensor that holds several of our arrays (e.g. DeepSeek's ``kv_b_proj``
    is our ``w_uk`` and ``w_uv``). ``split`` maps it to ours, ``join`` back."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (path, our shape of one entry)
    hf: str
    hf_shape: tuple[int, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    join: Callable[..., np.ndarray]
    init: str = "normal"
    layers: tuple[int, ...] | None = None
    experts: int | None = None
    dtype: str | None = None
    tp: int | str | None = None  # as ``Param.tp``, for every part
    # (k, n) -> the checkpoint rows ([start, stop) ranges of its first axis) that model shard k of
    # n holds, which ``split`` turns into that shard's parts; None: a shard needs the whole tensor.
    shard_rows: Callable[[int, int], list[tuple[int, int]]] | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.parts)

    def part_stacked_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        lead = () if self.layers is None else (len(self.layers),)
        lead += () if self.experts is None else (self.experts,)
        return lead + tuple(shape)

    def from_hf(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(self.split(x))

    def to_hf(self, *ours: np.ndarray) -> np.ndarray:
        return self.join(*ours)


@dataclasses.dataclass(frozen=True)
class FusedParam:
    """Several checkpoint tensors read into one array of ours, joined on its last axis in the
    per-shard column order of ``jaxspec.model.fused`` (q/k/v projections as one ``wqkv``,
    gate/up as one ``w_gate_up``: one product where a layer ran several). Each part is a
    ``Param`` of its own (checkpoint name, shape, repeated KV heads) whose last axis is where
    its checkpoint tensor's first axis lands (a linear weight's output axis, a bias's axis);
    the parts differ only in that axis. Export writes the parts back as separate tensors.

    Attributes:
      path: where the joined array lives in our pytree.
      parts: the joined entries in column order (their ``path`` names the part).
      shards: the shard count of the column order (``column_shards``; 1: parts one after another).
      tp: the split axis (the last), None to replicate.
      layers, dtype: as ``Param``'s, for every part.
    """

    path: str
    parts: tuple[Param, ...]
    shards: int = 1
    tp: int | None = None
    layers: tuple[int, ...] | None = None
    dtype: str | None = None
    experts = None  # no expert axis: routed experts run as grouped products of their own

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(p.shape[-1] for p in self.parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.parts[0].shape[:-1]) + (sum(self.widths),)

    @property
    def stacked_shape(self) -> tuple[int, ...]:
        return (() if self.layers is None else (len(self.layers),)) + self.shape

    def members(self) -> list[Param]:
        """The parts as entries of their own (stacked like this one)."""
        return [dataclasses.replace(p, layers=self.layers, dtype=self.dtype, tp=self.tp) for p in self.parts]


Entry = Param | SplitParam | FusedParam
Table = list[Entry]


def fused(path: str, parts: Sequence[Param], shards: int = 1) -> FusedParam:
    """``parts`` (entries that read one input, split alike over the model axis) as one array
    ``path``, joined in the column order of ``shards`` model shards (the config's
    ``tensor_parallel``: the layers split the product with the same count)."""
    parts = tuple(parts)
    for p in parts:
        lands = 0 if p.perm is None else p.perm.index(0)
        if lands != len(p.shape) - 1 or p.tp not in (None, len(p.shape) - 1) or p.tp != parts[0].tp \
                or p.shape[:-1] != parts[0].shape[:-1] or p.layers is not None or p.experts is not None:
            raise ValueError(f"{path}: {p.path} cannot be joined with {[q.path for q in parts]}")
    return FusedParam(path, parts, column_shards([p.shape[-1] for p in parts], shards), tp=parts[0].tp,
                      dtype=parts[0].dtype)


def packed_experts(prefix: str, E: int, H: int, I: int) -> list:
    """Routed SwiGLU-style experts stored as transformers 5 packs them: ``{prefix}gate_up_proj``
    [E, 2I, H] (gate rows first) and ``{prefix}down_proj`` [E, H, I]; ours ``experts_gate``,
    ``experts_up`` [E, H, I] and ``experts_down`` [E, I, H], split over the model axis by expert."""

    def split(x):  # [E, 2I, H] -> gate, up [E, H, I]
        return np.transpose(x[:, :I], (0, 2, 1)), np.transpose(x[:, I:], (0, 2, 1))

    def join(gate, up):
        return np.concatenate([np.transpose(gate, (0, 2, 1)), np.transpose(up, (0, 2, 1))], axis=1)

    return [SplitParam(parts=(("experts_gate", (E, H, I)), ("experts_up", (E, H, I))),
                       hf=prefix + "gate_up_proj", hf_shape=(E, 2 * I, H), split=split, join=join, tp="experts",
                       shard_rows=row_blocks(E)),
            Param("experts_down", prefix + "down_proj", (E, I, H), perm=(0, 2, 1), tp="experts")]


def row_blocks(*segments: int) -> Callable[[int, int], list[tuple[int, int]]]:
    """``SplitParam.shard_rows`` of a tensor whose first axis is ``segments`` one after another,
    each split evenly over the shards: shard k of n takes the k-th n-th of each."""
    def rows(k: int, n: int) -> list[tuple[int, int]]:
        out, at = [], 0
        for size in segments:
            out.append((at + k * size // n, at + (k + 1) * size // n))
            at += size
        return out

    return rows


def embedding(path: str, hf: str, cfg) -> Param:
    """A target's token embedding ``[V', H]``, split by vocabulary rows over the model axis;
    ``V'`` is the vocabulary padded to split evenly (``padded_vocab_size``; zero rows)."""
    V, Vp = cfg.vocab_size, padded_vocab_size(cfg)
    return Param(path, hf, (Vp, cfg.hidden_size), tp=0, pad=Vp - V)


def output_head(path: str, hf: str, cfg) -> Param:
    """A target's output head ``[H, V']`` (``nn.Linear [V, H]`` in checkpoints), split by
    vocabulary over the model axis, padded as ``embedding``."""
    V, Vp = cfg.vocab_size, padded_vocab_size(cfg)
    return Param(path, hf, (cfg.hidden_size, Vp), perm=LINEAR, tp=1, pad=Vp - V)


def gate_up(path: str, hf_prefix: str, hidden: int, intermediate: int, shards: int = 1) -> FusedParam:
    """A gated MLP's ``gate_proj`` and ``up_proj`` (``{hf_prefix}gate_proj.weight``, ...) read
    into one joined ``[H, 2I]`` array (column-parallel, in the column order of ``shards``)."""
    return fused(path, [Param("w_gate", hf_prefix + "gate_proj.weight", (hidden, intermediate), perm=LINEAR, tp=1),
                        Param("w_up", hf_prefix + "up_proj.weight", (hidden, intermediate), perm=LINEAR, tp=1)], shards)


def stacked(entries: Sequence[Entry], path_prefix: str, hf_prefix: str, layers: Sequence[int]) -> list[Entry]:
    """One layer's entries (checkpoint names relative to the layer) stacked over ``layers``:
    paths under ``path_prefix``, names under ``hf_prefix`` (which holds the ``{i}``)."""
    return [dataclasses.replace(e, layers=tuple(layers), **_prefixed(e, path_prefix, hf_prefix)) for e in entries]


def under(entries: Sequence[Entry], path_prefix: str, hf_prefix: str) -> list[Entry]:
    """Entries placed under ``path_prefix`` in our pytree and ``hf_prefix`` in the checkpoint."""
    return [dataclasses.replace(e, **_prefixed(e, path_prefix, hf_prefix)) for e in entries]


def _prefixed(e: Entry, path_prefix: str, hf_prefix: str) -> dict:
    if isinstance(e, FusedParam):
        return {"path": path_prefix + e.path, "parts": tuple(dataclasses.replace(p, hf=hf_prefix + p.hf) for p in e.parts)}
    if isinstance(e, SplitParam):
        return {"parts": tuple((path_prefix + p, s) for p, s in e.parts), "hf": hf_prefix + e.hf}
    return {"path": path_prefix + e.path, "hf": hf_prefix + e.hf}


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _get(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def _names(e: Entry) -> Iterator[tuple[tuple[int, ...], str]]:
    """(index into the stacked axes, checkpoint name) of every tensor behind an entry."""
    if isinstance(e, FusedParam):
        for m in e.members():
            yield from _names(m)
        return
    layers = [None] if e.layers is None else list(enumerate(e.layers))
    experts = [None] if e.experts is None else list(range(e.experts))
    for li in layers:
        for ex in experts:
            idx = () if li is None else (li[0],)
            idx += () if ex is None else (ex,)
            name = e.hf
            if li is not None:
                name = name.replace("{i}", str(li[1]))
            if ex is not None:
                name = name.replace("{e}", str(ex + getattr(e, "first_expert", 0)))
            yield idx, name


def scale_names(name: str) -> tuple[str, ...]:
    """Where a quantized weight's block scales may be stored: ``<name>_scale_inv`` (HF, DeepSeek-V3),
    or ``<module>.scale`` beside ``<module>.weight`` (DeepSeek-V4's release)."""
    out = (name + "_scale_inv",)
    return out + ((name.removesuffix("weight") + "scale",) if name.endswith(".weight") else ())


def unread_tensors(table: Table, names) -> list[str]:
    """The checkpoint tensor ``names`` no entry of ``table`` reads (a quantized weight's scales
    count as read with it), sorted."""
    read = {name for e in table for _, name in _names(e)}
    scales = {s for n in read for s in scale_names(n)}
    return sorted(n for n in names if n not in read and n not in scales)


def _shapes(e: Entry) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(e, SplitParam):
        return [(p, e.part_stacked_shape(s)) for p, s in e.parts]
    return [(e.path, e.stacked_shape)]


def _hf_shape(e: Entry) -> tuple[int, ...]:
    return tuple(e.hf_shape)


def param_shapes(table: Table, dtype) -> dict:
    """Our pytree as ``jax.ShapeDtypeStruct`` leaves (no arrays allocated)."""
    out: dict = {}
    for e in table:
        dt = jnp.dtype(e.dtype) if e.dtype else jnp.dtype(dtype)
        for path, shape in _shapes(e):
            _set(out, path, jax.ShapeDtypeStruct(shape, dt))
    return out


CHUNK_BYTES = 16 << 20  # largest piece of a checkpoint tensor in flight on the host
LOAD_THREADS = 2  # entries loaded at once on one device (each with at most two pieces in flight)


def load_params(table: Table, ckpt, dtype, *, sharding_of=None, fp8_block: tuple[int, int] | None = None,
                progress: bool = False, desc: str = "loading") -> dict:
    """Reads every entry of ``table`` from ``ckpt`` (a ``CheckpointTensors``) into our layout.

    Streaming: each checkpoint tensor goes from a memory map of its bytes to the device in
    pieces of at most ``CHUNK_BYTES`` (rows of its first axis); the cast to ``dtype`` and any
    transpose run on the device, and every array is filled in place (donated), so the host holds
    a few pieces at a time besides what is already placed. ``sharding_of(path)`` gives each
    array's sharding (None: the default device, where ``LOAD_THREADS`` entries load at once); on
    a mesh this process reads only the bytes of the shards its own devices hold
    (``_load_shards``), so a host of a job spanning several reads its part of the checkpoint. A
    float8 tensor with a ``<name>_scale_inv`` block scale (``fp8_block`` rows x cols per scale)
    is dequantized on the device into ``dtype``. Raises ``CheckpointError`` naming a missing or
    misshaped tensor."""
    def load(e: Entry) -> list:
        dt = jnp.dtype(e.dtype) if e.dtype else jnp.dtype(dtype)
        if sharding_of is None:
            return _load_entry(e, ckpt, dt, [None] * len(_shapes(e)), fp8_block)
        return _load_shards(e, ckpt, dt, [sharding_of(path) for path, _ in _shapes(e)], fp8_block)

    out: dict = {}
    bar = tqdm(total=len(table), desc=desc, disable=not progress, leave=False)
    # On a mesh one thread: every process must issue the same programs in the same order (an
    # entry no shard can be read of alone runs one program over the whole mesh: ``_write``).
    with concurrent.futures.ThreadPoolExecutor(1 if sharding_of is not None else LOAD_THREADS) as pool:
        futures = [pool.submit(load, e) for e in table]
        for f in futures:
            f.add_done_callback(lambda _: bar.update())
        try:
            for e, f in zip(table, futures):
                for (path, _), buf in zip(_shapes(e), f.result()):
                    _set(out, path, buf)
        except BaseException:  # the first failing entry in table order; the rest are not started
            for f in futures:
                f.cancel()
            raise
        finally:
            bar.close()
    return out


def _load_entry(e: Entry, ckpt, dt, shards, fp8_block) -> list:
    """The arrays of one table entry (``_shapes(e)`` order), filled piece by piece. ``ckpt``: the
    checkpoint, or for a ``FusedParam`` one source per part (a model shard's views)."""
    bufs = [_zeros(shape, dt, sh) for (_, shape), sh in zip(_shapes(e), shards)]
    if isinstance(e, FusedParam):
        return [_fill_fused(bufs[0], e, ckpt, dt, fp8_block)]
    return _fill(bufs, e, ckpt, fp8_block)


def _fill(bufs: list, e: Param | SplitParam, ckpt, fp8_block, at: int = 0) -> list:
    """Writes every checkpoint tensor behind ``e`` into ``bufs`` (its arrays), piece by piece; a
    ``Param``'s at offset ``at`` of the axis its checkpoint tensor's first axis lands on."""
    in_flight: collections.deque = collections.deque()
    for idx, name in _names(e):
        heads = e.unit if isinstance(e, Param) and e.repeat > 1 else 1  # pieces hold whole repeated heads
        for rows, x, scale in _pieces(ckpt, name, _hf_shape(e), fp8_block, whole=isinstance(e, SplitParam),
                                      align=heads):
            if isinstance(e, SplitParam):
                x = np.asarray(x) if scale is None else _dequantize_host(x, scale, fp8_block)
                pieces = [(part, None, _Layout(), 0) for part in e.from_hf(x)]
            else:
                how = _Layout(e.perm, e.repeat, e.unit, None if scale is None else fp8_block)
                pieces = [(x, scale, how, at + rows[0] * e.repeat)]
            for k, (part, sc, how, offset) in enumerate(pieces):
                # The checkpoint's first axis lands on our axis perm.index(0).
                axis = 0 if how.perm is None else how.perm.index(0)
                start = np.concatenate([np.asarray(idx, np.int32), np.zeros(bufs[k].ndim - len(idx), np.int32)])
                start[len(idx) + axis] = offset
                bufs[k], done = _write(bufs[k], part, sc, start, how)
                if done is not None:
                    in_flight.append(done)
            # At most two pieces in flight: the host reads and sends the next piece while the
            # device converts this one, and asynchronous dispatch cannot queue more (nor the
            # host memory behind them).
            while len(in_flight) > 2:
                jax.block_until_ready(in_flight.popleft())
            del x, pieces
    return jax.block_until_ready(bufs)


def _fill_fused(buf, e: FusedParam, src, dt, fp8_block):
    """A ``FusedParam``'s array: each part read (and dequantized) as a ``Param`` of its own. In
    the one-shard order every piece is written straight to its columns; in an n-shard order a
    part is read whole, then its n column blocks are placed (one part at a time in memory)."""
    at, stride = 0, sum(e.widths) // e.shards
    for i, m in enumerate(e.members()):
        part_src = src[i] if isinstance(src, tuple) else src
        if e.shards == 1:
            (buf,) = _fill([buf], m, part_src, fp8_block, at=at)
        else:
            (part,) = _fill([_zeros(m.stacked_shape, dt, buf.sharding)], m, part_src, fp8_block)
            buf = jax.block_until_ready(_place_columns(buf, part, at=at // e.shards, stride=stride, shards=e.shards))
        at += m.shape[-1]
    return buf


@functools.partial(jax.jit, static_argnames=("at", "stride", "shards"), donate_argnums=0)
def _place_columns(buf, part, *, at: int, stride: int, shards: int):
    """``part [..., s]``'s k-th of ``shards`` column blocks written at column ``k * stride + at`` of ``buf``."""
    w = part.shape[-1] // shards
    for k in range(shards):
        block = jax.lax.slice_in_dim(part, k * w, (k + 1) * w, axis=-1)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, block.astype(buf.dtype), k * stride + at, axis=buf.ndim - 1)
    return buf


def _scale_of(ckpt, name: str) -> str | None:
    return next((s for s in scale_names(name) if s in ckpt), None)


def _is_fp4(ckpt, name: str, e, hf_shape) -> bool:
    """``name`` holds e2m1 values packed two per byte (int8 / uint8, half the expected columns)
    with block scales: DeepSeek-V4's FP4 experts."""
    return (e.dtype in ("I8", "U8") and len(e.shape) == len(hf_shape) >= 2 and tuple(e.shape[:-1]) == tuple(
        hf_shape[:-1]) and 2 * e.shape[-1] == hf_shape[-1] and _scale_of(ckpt, name) is not None)


FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:  # [..., r, c/2] bytes -> f32[..., r, c]
    """e2m1 pairs (low nibble first, as HF's loader reads them) times their block scales; the block
    is the weight shape over the scale shape."""
    u8 = np.asarray(packed).view(np.uint8)
    x = np.stack([FP4_E2M1[u8 & 0xF], FP4_E2M1[u8 >> 4]], axis=-1).reshape(u8.shape[:-1] + (2 * u8.shape[-1],))
    s = np.asarray(scale, np.float32)
    r, c = x.shape[-2:]
    if r % s.shape[-2] or c % s.shape[-1]:
        raise CheckpointError(f"fp4 weight of shape {x.shape} does not split into scale blocks {s.shape}")
    return x * _expand_blocks(s, x.shape, (r // s.shape[-2], c // s.shape[-1]), np)


def _load_shards(e: Entry, ckpt, dt, shardings, fp8_block) -> list:
    """The arrays of one table entry on a mesh (``shardings``, one per array), built from this
    process's devices' shards: model shard k of n of a split entry is read alone (exactly its
    checkpoint bytes, ``_shard_of``) onto one device holding it and copied to the others (its
    replicas over data); a replicated entry is read once per process. An entry whose shards
    cannot be read alone (a ``SplitParam`` without ``shard_rows``, FP8 scale blocks straddling a
    shard bound: decided alike on every process) is read whole, in one program over the mesh. A
    ``FusedParam``'s shard k is the shard's slice of each part, read alone and written side by side."""
    sharding = shardings[0]
    mesh = sharding.mesh
    n = mesh.shape[MODEL]
    split = n > 1 and any(MODEL in (ax if isinstance(ax, tuple) else (ax,)) for ax in sharding.spec)
    model_axis = mesh.axis_names.index(MODEL)
    coord = {d: idx[model_axis] for idx, d in np.ndenumerate(mesh.devices)}
    groups: dict = {}  # model shard (None: the whole entry) -> this process's devices holding it
    for d in sharding.addressable_devices:
        groups.setdefault(coord[d] if split else None, []).append(d)
    local = {k: _shard_of(e, k, n, ckpt, fp8_block) for k in range(n)} if split else {None: (e, ckpt)}
    if any(v is None for v in local.values()):  # every shard, not only this process's: all take one path
        return _load_entry(e, ckpt, dt, shardings, fp8_block)
    reads: dict = {}  # what is read (model shards holding copies of one KV head read it once) -> devices
    for k, devices in groups.items():
        entry, view = local[k]
        key = (entry, _view_key(view, ckpt))
        reads.setdefault(key, (entry, view, []))[2].extend(devices)
    arrays: dict = {}  # device -> its shard of each array
    parts_read: dict = {}  # a fused entry's part, read once for the shards sharing it (repeated KV heads)
    for entry, view, devices in reads.values():
        first = jax.sharding.SingleDeviceSharding(devices[0])
        if isinstance(view, tuple):  # a split FusedParam: one view per part
            bufs = [_join_parts(entry, view, ckpt, dt, first, fp8_block, parts_read)]
        else:
            bufs = _load_entry(entry, view, dt, [first] * len(shardings), fp8_block)
        for d in devices:
            arrays[d] = bufs if d == devices[0] else jax.device_put(bufs, d)
    return [jax.make_array_from_single_device_arrays(shape, sh, [arrays[d][i] for d in sh.addressable_devices])
            for i, ((_, shape), sh) in enumerate(zip(_shapes(e), shardings))]


def _join_parts(entry: FusedParam, views: tuple, ckpt, dt, device, fp8_block, parts_read: dict):
    """One model shard's joined array (``entry`` cut to the shard, in the one-shard order): each
    part read alone, or taken from ``parts_read`` when another shard of this process read the
    same bytes (the copies of one KV head), then set side by side on ``device``."""
    parts = []
    for m, view in zip(entry.members(), views):
        key = (m, _view_key(view, ckpt))
        if key not in parts_read:
            (parts_read[key],) = _load_entry(m, view, dt, [device], fp8_block)
        parts.append(jax.device_put(parts_read[key], device))
    return jax.block_until_ready(jnp.concatenate(parts, axis=-1))


def _view_key(view, ckpt):
    """What a shard's view reads (equal for model shards holding copies of the same bytes)."""
    if isinstance(view, tuple):  # a FusedParam's: one view per part
        return tuple(_view_key(v, ckpt) for v in view)
    return None if view is ckpt else (view.axis, tuple(view.ranges))


def _shard_of(e: Entry, k: int, n: int, ckpt, fp8_block):
    """(the entry cut to model shard k of n, a view of ``ckpt`` holding just that shard's
    checkpoint bytes: for a ``FusedParam`` one view per part), or None when the shard cannot be
    read alone."""
    if isinstance(e, FusedParam):  # shard k's columns are its slice of each part, one after another
        cuts = [_shard_of(m, k, n, ckpt, fp8_block) for m in e.members()]
        if e.shards != n or any(c is None for c in cuts):
            return None
        return dataclasses.replace(e, parts=tuple(c[0] for c in cuts), shards=1), tuple(c[1] for c in cuts)
    if e.tp == "experts" and e.experts is not None:  # per-expert tensors: shard k holds experts [k*E/n, ...)
        per = e.experts // n
        return dataclasses.replace(e, experts=per, first_expert=e.first_expert + k * per), ckpt
    axis = 0 if e.tp == "experts" else e.tp  # the split axis of one entry's shape(s)
    if isinstance(e, SplitParam):
        if e.shard_rows is None or e.experts is not None:
            return None
        ranges = e.shard_rows(k, n)
        parts = tuple((p, tuple(d // n if i == axis else d for i, d in enumerate(shape))) for p, shape in e.parts)
        local = dataclasses.replace(e, parts=parts, hf_shape=(sum(b - a for a, b in ranges),) + tuple(e.hf_shape[1:]))
        return _aligned(local, ckpt, 0, ranges, fp8_block)
    size = e.shape[axis]
    s, t = k * size // n, (k + 1) * size // n  # ours [s, t) along the split axis
    hf_axis = axis if e.perm is None else e.perm[axis]
    shape = tuple(t - s if i == axis else d for i, d in enumerate(e.shape))
    if hf_axis != 0:
        return _aligned(dataclasses.replace(e, shape=shape), ckpt, hf_axis, [(s, t)], fp8_block)
    if e.repeat > 1:  # KV heads repeated over the shards: whole repeat groups, or copies of one head
        u, r = e.unit, e.repeat
        heads = (t - s) // u
        if (t - s) % u or (heads % r and r % heads):
            return None
        if heads % r == 0:
            return _aligned(dataclasses.replace(e, shape=shape), ckpt, 0, [(s // r, t // r)], fp8_block)
        head = s // u // r
        return _aligned(dataclasses.replace(e, shape=shape, repeat=heads), ckpt, 0, [(head * u, (head + 1) * u)],
                        fp8_block)
    real = size - e.pad  # checkpoint rows; ours beyond them are padding
    stop = max(s, min(t, real))
    return _aligned(dataclasses.replace(e, shape=shape, pad=(t - s) - (stop - s)), ckpt, 0, [(s, stop)], fp8_block)


def _aligned(local: Entry, ckpt, axis: int, ranges, fp8_block):
    """``(local, its shard view)``, or None when an FP8 tensor's shard does not start and end on
    its scale blocks."""
    names = [name for _, name in _names(local)]
    if fp8_block and any(_is_fp8(ckpt.entry(name)) for name in names):
        nd = len(ckpt.entry(names[0]).shape)
        f = fp8_block[0] if axis == nd - 2 else fp8_block[1] if axis == nd - 1 else 1
        full = ckpt.entry(names[0]).shape[axis]
        if any(a % f or (b % f and b != full) for a, b in ranges):
            return None
    return local, ShardView(ckpt, axis, ranges, fp8_block)


def _pieces(ckpt, name: str, hf_shape: tuple[int, ...], fp8_block, whole: bool, align: int = 1):
    """(rows, tensor piece, its fp8 block scale or None) over the first axis of ``name``, each at
    most ``CHUNK_BYTES`` (whole heads / scale blocks per piece; ``whole``: one piece). FP4 tensors
    come dequantized (one piece, float32, no scale)."""
    e = ckpt.entry(name)
    if _is_fp4(ckpt, name, e, hf_shape):
        scale = ckpt.read(_scale_of(ckpt, name))
        yield (0, e.shape[0]), dequantize_fp4(ckpt.read(name), scale), None
        return
    if tuple(e.shape) != tuple(hf_shape):
        raise CheckpointError(f"{ckpt.path}: tensor {name!r} has shape {tuple(e.shape)}, expected {tuple(hf_shape)}")
    n = e.shape[0] if e.shape else 1
    if n == 0:  # a shard of padding only: nothing to read
        return
    fp8 = _is_fp8(e)
    step = n
    if not whole and e.shape and e.nbytes > CHUNK_BYTES:
        if fp8 and fp8_block:
            align = math.lcm(align, fp8_block[0])
        step = max(align, (CHUNK_BYTES * n // e.nbytes) // align * align)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        x = ckpt.read(name, rows=(r0, r1)) if e.shape else ckpt.read(name)
        scale = None
        if fp8:
            scale_name = _scale_of(ckpt, name)
            if fp8_block is None or scale_name is None:
                raise CheckpointError(
                    f"{ckpt.path}: tensor {name!r} is {x.dtype} but the checkpoint has no "
                    f"{'quantization_config weight_block_size' if fp8_block is None else repr(scale_names(name)[0])} "
                    f"to dequantize it"
                )
            want = tuple(e.shape[:-2]) + (-(-e.shape[-2] // fp8_block[0]), -(-e.shape[-1] // fp8_block[1]))
            if tuple(ckpt.entry(scale_name).shape) != want:
                raise CheckpointError(f"{ckpt.path}: tensor {scale_name!r} has shape "
                                      f"{tuple(ckpt.entry(scale_name).shape)}, expected {want}")
            scale = np.asarray(ckpt.read(scale_name, rows=(r0 // fp8_block[0], -(-r1 // fp8_block[0]))), np.float32)
        yield (r0, r1), x, scale


def _zeros(shape, dtype, sharding):
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _zeros_fn(shape, dtype, sharding):  # one compiled program per (shape, dtype, sharding)
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


@functools.cache
def _default_device():  # where jit puts host arrays
    return jax.local_devices()[0]


def _is_fp8(e) -> bool:  # e: a TensorEntry
    return np.dtype(SAFETENSORS_DTYPES.get(e.dtype, np.uint8)) in FP8_DTYPES


def _expand_blocks(scale, shape, block, xp):
    """A [..., ceil(r/br), ceil(c/bc)] block scale repeated to [..., r, c]."""
    full = xp.repeat(xp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def _dequantize_host(x, scale, block) -> np.ndarray:
    xf = np.asarray(x).astype(np.float32)
    return xf * _expand_blocks(np.asarray(scale, np.float32), xf.shape, block, np)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a checkpoint tensor becomes ours on the device: block-scaled FP8 dequantized
    (``fp8_block``), heads repeated (``Param.repeat / unit``), axes permuted (``Param.perm``)."""

    perm: tuple[int, ...] | None = None
    repeat: int = 1
    unit: int = 0
    fp8_block: tuple[int, int] | None = None

    def __call__(self, x, scale):
        if self.fp8_block is not None:
            x = x.astype(jnp.float32) * _expand_blocks(scale.astype(jnp.float32), x.shape, self.fp8_block, jnp)
        if self.repeat > 1:
            heads = x.reshape((-1, self.unit) + x.shape[1:])
            x = jnp.repeat(heads, self.repeat, axis=0).reshape((-1,) + x.shape[1:])
        if self.perm is None:
            return x
        # XLA:CPU transposes 32-bit elements about twice as fast as 16-bit ones.
        return jnp.transpose(x.astype(jnp.promote_types(x.dtype, jnp.float32)), self.perm)


def _write(buf, x, scale, start, how: _Layout):  # buf [*lead, *shape]; x a piece of one checkpoint tensor
    """Writes ``how(x)`` into ``buf`` at ``start`` (i32[buf.ndim]: stacked indices, then offsets).
    Returns the new buffer and an array to wait on before the host piece may be dropped (None:
    already done)."""
    if len(buf.sharding.device_set) > 1:
        # On a mesh the host array goes into one program (every process passes the same tensor
        # and keeps its own shards of the result).
        # (its output is donated to the next piece's update, so it is waited for here).
        return jax.block_until_ready(_convert_update(buf, x, scale, start, how)), None
    # Two programs on purpose: XLA:CPU runs a transpose fused into the in-place update several
    # times slower than the transpose alone followed by the update.
    device = next(iter(buf.sharding.device_set))
    if device != _default_device():  # a mesh's device: jit would put host pieces on the default one (and the
        # explicit transfer costs the default path about 10% of its load time, so it is left to jit there)
        x, scale = jax.device_put((x, scale), device)
    piece = _convert(x, scale, how, buf.dtype)
    return _update(buf, piece, start), piece


@functools.partial(jax.jit, static_argnames=("how", "dtype"))
def _convert(x, scale, how: _Layout, dtype):
    return how(x, scale).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _update(buf, x, start):
    lead = buf.ndim - x.ndim
    x = x.reshape((1,) * lead + x.shape).astype(buf.dtype)
    return jax.lax.dynamic_update_slice(buf, x, tuple(start[i] for i in range(buf.ndim)))


@functools.partial(jax.jit, static_argnames=("how",), donate_argnums=0)
def _convert_update(buf, x, scale, start, how: _Layout):
    return _update(buf, how(x, scale), start)


def export_params(table: Table, params: dict, dtype) -> dict[str, np.ndarray]:
    """Our pytree -> ``{checkpoint name: array}`` in ``dtype`` (contiguous, ready for
    ``safetensors.numpy.save_file``)."""
    out = {}
    for e in table:
        arrays = [np.asarray(_get(params, p), np.float32) for p in e.paths]
        if isinstance(e, FusedParam):  # the parts back as separate tensors
            for m, part in zip(e.members(), split_columns(arrays[0], e.widths, e.shards)):
                one: dict = {}
                _set(one, m.path, part)
                out.update(export_params([m], one, dtype))
            continue
        dt = np.dtype(e.dtype) if e.dtype else np.dtype(dtype)
        for idx, name in _names(e):
            out[name] = np.ascontiguousarray(e.to_hf(*(a[idx] for a in arrays)).astype(dt))
    return out


def host_rng(seed) -> np.random.Generator:
    """The one RNG of random init: numpy's, seeded from an int or a JAX key (no XLA compile
    per weight shape)."""
    if isinstance(seed, (int, np.integer)):
        return np.random.default_rng(int(seed))
    data = jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed
    return np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())


def init_params(table: Table, seed, *, scale: float = 0.02, dtype=np.float32, on_device: bool = False) -> dict:
    """Random params in table order: "normal" entries N(0, scale^2), norms 1, biases 0.

    Drawn on the host by one numpy RNG (``host_rng``: no XLA compile per weight shape), or with
    ``on_device`` by ``jax.random`` directly on the default device, for models too large for
    host memory (benchmarks at 8B shapes); the two give different values."""
    rng = None if on_device else host_rng(seed)
    key = None
    if on_device:
        key = jax.random.PRNGKey(seed) if isinstance(seed, (int, np.integer)) else seed
    out: dict = {}
    count = 0

    def draw(e, shape, dt):
        nonlocal count
        count += 1
        if e.init in ("ones", "zeros"):
            return (jnp.ones if e.init == "ones" else jnp.zeros)(shape, dt)
        if on_device:
            return _device_normal(jax.random.fold_in(key, count - 1), shape, dt, scale)
        return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dt)

    for e in table:
        dt = jnp.dtype(e.dtype) if e.dtype else jnp.dtype(dtype)
        if isinstance(e, FusedParam):  # each part drawn as its own entry would be, then joined
            _set(out, e.path, fuse_columns([draw(m, m.stacked_shape, dt) for m in e.members()], e.shards))
            continue
        for path, shape in _shapes(e):
            _set(out, path, draw(e, shape, dt))
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_normal(key, shape, dtype, scale):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def partition_specs(table: Table, model_axis: str | None) -> dict[str, tuple]:
    """{path: partition spec (a tuple of axis names) of the stacked array} for tensor parallelism
    over ``model_axis`` (None: everything replicated)."""
    out = {}
    for e in table:
        for path, shape in _shapes(e):
            lead = (0 if e.layers is None else 1) + (0 if e.experts is None else 1)
            spec = [None] * len(shape)
            if model_axis is not None and e.tp is not None:
                if e.tp == "experts":
                    spec[lead - 1 if e.experts is not None else lead] = model_axis
                else:
                    spec[lead + e.tp] = model_axis
            out[path] = tuple(spec)
    return out


def check_divisible(table: Table, shards: int, where: str) -> None:
    """Every split axis divides evenly over ``shards`` (else a ValueError naming the tensor)."""
    for e in table:
        for path, shape in _shapes(e):
            spec = partition_specs([e], "model")[path]
            for axis, name in enumerate(spec):
                if name is not None and shape[axis] % shards:
                    raise ValueError(
                        f"{where}: {path} of shape {shape} cannot be split over a model axis of {shards}: "
                        f"axis {axis} ({shape[axis]}) is not a multiple of {shards}"
                    )


def replicated(entries: Sequence[Entry]) -> list[Entry]:
    """The same entries, never split (small heads kept whole on every shard)."""
    return [dataclasses.replace(e, tp=None) for e in entries]


def whole_on(x: np.ndarray, mesh) -> jax.Array:
    """A small host array whole on every device of ``mesh`` (every process passes the same
    value), or on the default device without one."""
    return jnp.asarray(x) if mesh is None else jax.device_put(x, NamedSharding(mesh, PartitionSpec()))


def shardings_for(table, mesh, split: bool):
    """``sharding_of(path)`` for ``load_params``: the table's tensor-parallel layout over the
    mesh's model axis (``split``), or every array replicated on the mesh; None without a mesh."""
    if mesh is None:
        return None
    specs = partition_specs(table, MODEL if split else None)
    return lambda path: NamedSharding(mesh, PartitionSpec(*specs[path]))


def with_target_embedding(params: dict, target_params: dict) -> dict:
    """A draft's ``params`` with the target's input embedding (``embed``) and output head (``head``:
    the target's ``lm_head``, or its tied embedding transposed), as MTP layers share them."""
    params["embed"] = target_params["embed"]
    params["head"] = target_params["lm_head"] if "lm_head" in target_params else jnp.asarray(target_params["embed"]).T
    return params
