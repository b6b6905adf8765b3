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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

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
    """

    path: str
    hf: str
    shape: tuple[int, ...]
    init: str = "normal"
    perm: tuple[int, ...] | None = None
    layers: tuple[int, ...] | None = None
    experts: int | None = None
    dtype: str | None = None

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
        if self.perm is None:
            return tuple(self.shape)
        out = [0] * len(self.shape)
        for ours, theirs in enumerate(self.perm):
            out[theirs] = self.shape[ours]
        return tuple(out)

    def from_hf(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        return (x if self.perm is None else np.transpose(x, self.perm),)

    def to_hf(self, *ours: np.ndarray) -> np.ndarray:
        (x,) = ours
        return x if self.perm is None else np.transpose(x, np.argsort(self.perm))


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


Entry = Param | SplitParam
Table = list[Entry]


def stacked(entries: Sequence[Entry], path_prefix: str, hf_prefix: str, layers: Sequence[int]) -> list[Entry]:
    """One layer's entries (checkpoint names relative to the layer) stacked over ``layers``:
    paths under ``path_prefix``, names under ``hf_prefix`` (which holds the ``{i}``)."""
    return [dataclasses.replace(e, layers=tuple(layers), **_prefixed(e, path_prefix, hf_prefix)) for e in entries]


def under(entries: Sequence[Entry], path_prefix: str, hf_prefix: str) -> list[Entry]:
    """Entries placed under ``path_prefix`` in our pytree and ``hf_prefix`` in the checkpoint."""
    return [dataclasses.replace(e, **_prefixed(e, path_prefix, hf_prefix)) for e in entries]


def _prefixed(e: Entry, path_prefix: str, hf_prefix: str) -> dict:
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
                name = name.replace("{e}", str(ex))
            yield idx, name


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


def load_params(table: Table, ckpt, dtype, *, progress: bool = False, desc: str = "loading") -> dict:
    """Reads every entry of ``table`` from ``ckpt`` (a ``SafetensorsCheckpoint``) into our
    layout, cast to ``dtype``. Each stacked array is filled in place, one checkpoint tensor at a
    time. Raises ``CheckpointError`` naming a missing or misshaped tensor."""
    out: dict = {}
    for e in tqdm(table, desc=desc, disable=not progress, leave=False):
        dt = np.dtype(e.dtype) if e.dtype else np.dtype(dtype)
        bufs = [np.empty(shape, dt) for _, shape in _shapes(e)]
        for idx, name in _names(e):
            for buf, part in zip(bufs, e.from_hf(ckpt.get(name, _hf_shape(e), dt))):
                buf[idx] = part
        for (path, _), buf in zip(_shapes(e), bufs):
            _set(out, path, jnp.asarray(buf))
    return out


def export_params(table: Table, params: dict, dtype) -> dict[str, np.ndarray]:
    """Our pytree -> ``{checkpoint name: array}`` in ``dtype`` (contiguous, ready for
    ``safetensors.numpy.save_file``)."""
    out = {}
    for e in table:
        arrays = [np.asarray(_get(params, p), np.float32) for p in e.paths]
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
    for e in table:
        dt = jnp.dtype(e.dtype) if e.dtype else jnp.dtype(dtype)
        for path, shape in _shapes(e):
            if e.init in ("ones", "zeros"):
                x = (jnp.ones if e.init == "ones" else jnp.zeros)(shape, dt)
            elif on_device:
                x = _device_normal(jax.random.fold_in(key, count), shape, dt, scale)
            else:
                x = jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32), dt)
            count += 1
            _set(out, path, x)
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _device_normal(key, shape, dtype, scale):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
