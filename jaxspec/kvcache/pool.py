"""KV pools: immutable arrays indexed [layer, slot, ...], passed in and returned new.

* ``KVPool`` (MHA/GQA): ``k, v: [L, num_slots, Hkv, D]``.
* ``MLAPool``: ``kv: [L, num_slots, kv_lora_rank + rope_dim]``, optionally with a DSA-style
  indexer key buffer ``index_k: [L, num_slots, index_dim]`` that moves with the KV.
* ``SplitPool``: the pair of a model with sliding-window layers (Gemma 4, Mistral with a
  window): ``full`` (its full-attention layers) and ``window`` (its sliding-window layers, in a
  pool of its own with fewer pages, addressed by the ring table of ``paging.WindowTable``).
* A pool with ``L == 0`` is valid; every op on it is a no-op.

Every buffer shares the leading ``[L, num_slots]`` axes, so moving KV between positions is
the same gather/scatter for every pool kind (see ``jaxspec.pallas.kv_move``). Ops that address
KV by position go through ``map_parts``: a pool applies ``fn(part, slots_of)`` to each of its
parts with the position-to-slot map of the table that addresses it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.kvcache.paging import full_table, positions_to_slots, scratch_dropped, window_table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """MHA/GQA pool. ``k, v: [L, num_slots, Hkv, D]``."""

    k: jax.Array
    v: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

    @classmethod
    def create(cls, *, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype) -> "KVPool":
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), page_size=page_size)

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (self.k, self.v)

    def with_buffers(self, buffers) -> "KVPool":
        k, v = buffers
        return dataclasses.replace(self, k=k, v=v)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def specs(self, data_axis: str | None, model_axis: str | None):
        """Partition specs of the buffers on a mesh: slots split over ``data_axis`` (each data
        shard owns its pages), KV heads over ``model_axis`` (None: not split). A zero-layer
        pool holds nothing and is never split."""
        spec = PartitionSpec() if self.num_layers == 0 else PartitionSpec(None, data_axis, model_axis, None)
        return dataclasses.replace(self, k=spec, v=spec)

    def write(self, layer, slots, k, v) -> "KVPool":
        """Writes ``k, v: [R, Hkv, D]`` at ``slots: i32[R]`` of ``layer`` (scratch slots: skipped)."""
        where = scratch_dropped(slots, self.page_size, self.num_slots)
        return dataclasses.replace(
            self,
            k=self.k.at[layer, where].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, where].set(v.astype(self.v.dtype), mode="drop"),
        )

    def map_parts(self, tables, fn: Callable):
        """``fn(self, slots_of)``: one part, addressed by the shared page table."""
        return _whole(self, tables, fn)

    def part(self, name: str) -> "KVPool":
        """A plain pool is its own "full" part."""
        if name != "full":
            raise ValueError(f"a pool without sliding-window layers has no {name!r} part")
        return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAPool:
    """Multi-head latent attention pool: ``kv: [L, num_slots, kv_lora_rank + rope_dim]``,
    plus an optional indexer key buffer ``index_k: [L, num_slots, index_dim]``."""

    kv: jax.Array
    index_k: jax.Array | None = None
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

    @classmethod
    def create(cls, *, num_layers, num_pages, page_size, kv_dim, index_dim=0, dtype) -> "MLAPool":
        n = num_pages * page_size
        index_k = jnp.zeros((num_layers, n, index_dim), dtype) if index_dim else None
        return cls(kv=jnp.zeros((num_layers, n, kv_dim), dtype), index_k=index_k, page_size=page_size)

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (self.kv,) if self.index_k is None else (self.kv, self.index_k)

    def with_buffers(self, buffers) -> "MLAPool":
        if self.index_k is None:
            (kv,) = buffers
            return dataclasses.replace(self, kv=kv)
        kv, index_k = buffers
        return dataclasses.replace(self, kv=kv, index_k=index_k)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_slots(self) -> int:
        return self.kv.shape[1]

    def map_parts(self, tables, fn: Callable):
        """``fn(self, slots_of)``: one part, addressed by the shared page table."""
        return _whole(self, tables, fn)

    def specs(self, data_axis: str | None, model_axis: str | None = None):
        """Partition specs of the buffers on a mesh: slots split over ``data_axis``; the latent
        (and indexer keys) are whole on every model shard (every head reads all of it)."""
        spec = PartitionSpec() if self.num_layers == 0 else PartitionSpec(None, data_axis, None)
        return dataclasses.replace(self, kv=spec, index_k=None if self.index_k is None else spec)

    def write(self, layer, slots, kv, index_k=None) -> "MLAPool":
        """Writes ``kv: [R, C]`` (and ``index_k: [R, Di]``) at ``slots: i32[R]`` of ``layer`` (scratch
        slots: skipped)."""
        where = scratch_dropped(slots, self.page_size, self.kv.shape[1])
        new = dataclasses.replace(self, kv=self.kv.at[layer, where].set(kv.astype(self.kv.dtype), mode="drop"))
        if self.index_k is not None and index_k is not None:
            new = dataclasses.replace(
                new, index_k=self.index_k.at[layer, where].set(index_k.astype(self.index_k.dtype), mode="drop")
            )
        return new


def _whole(pool, tables, fn):
    return fn(pool, functools.partial(_full_slots, full_table(tables), page_size=pool.page_size))


def _full_slots(table, positions, *, page_size):
    return positions_to_slots(table, positions, page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitPool:
    """The two pools of a model with sliding-window layers.

    full: ``KVPool`` of the full-attention layers ``[Lf, N, Hf, Df]``, addressed by the shared
      page table (every position of a request).
    window: ``KVPool`` of the sliding-window layers ``[Lw, Nw, Hw, Dw]`` (its own head count and
      width), addressed by the ring table: only each request's last positions are held.
    Either part may have zero layers (Mistral's full part, a Gemma model without sliding
    layers); every op on that part is then a no-op.
    """

    full: KVPool
    window: KVPool

    @classmethod
    def create(cls, *, full_layers, window_layers, num_pages, window_pages, page_size, full_heads, full_dim,
               window_heads, window_dim, dtype) -> "SplitPool":
        return cls(
            full=KVPool.create(num_layers=full_layers, num_pages=num_pages, page_size=page_size,
                               num_kv_heads=full_heads, head_dim=full_dim, dtype=dtype),
            window=KVPool.create(num_layers=window_layers, num_pages=window_pages, page_size=page_size,
                                 num_kv_heads=window_heads, head_dim=window_dim, dtype=dtype),
        )

    @property
    def page_size(self) -> int:
        return self.full.page_size

    @property
    def num_layers(self) -> int:
        return self.full.num_layers + self.window.num_layers

    def specs(self, data_axis: str | None, model_axis: str | None = None):
        """Partition specs of both parts (``KVPool.specs``)."""
        return dataclasses.replace(self, full=self.full.specs(data_axis, model_axis),
                                   window=self.window.specs(data_axis, model_axis))

    def part(self, name: str) -> KVPool:
        """``"full"`` or ``"window"``."""
        return {"full": self.full, "window": self.window}[name]

    def map_parts(self, tables, fn: Callable) -> "SplitPool":
        """``fn`` on the full part (shared page table) and on the window part (ring table)."""
        ring = window_table(tables)
        if ring is None and self.window.num_layers:
            raise ValueError("a pool with sliding-window layers needs PageTables with a window table")
        page = self.window.page_size
        window = self.window if ring is None else fn(self.window, lambda positions: ring.slots(positions, page))
        return dataclasses.replace(self, full=self.full.map_parts(tables, fn), window=window)
