"""KV pools: immutable arrays indexed [layer, slot, ...], passed in and returned new.

* ``KVPool`` (MHA/GQA): ``k, v: [L, num_slots, Hkv, D]``.
* ``MLAPool``: ``kv: [L, num_slots, kv_lora_rank + rope_dim]``, optionally with a DSA-style
  indexer key buffer ``index_k: [L, num_slots, index_dim]`` that moves with the KV.
* A pool with ``L == 0`` is valid; every op on it is a no-op.

Every buffer shares the leading ``[L, num_slots]`` axes, so moving KV between positions is
the same gather/scatter for every pool kind (see ``jaxspec.pallas.kv_move``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


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
        """Writes ``k, v: [R, Hkv, D]`` at ``slots: i32[R]`` of ``layer``."""
        return dataclasses.replace(
            self,
            k=self.k.at[layer, slots].set(k.astype(self.k.dtype)),
            v=self.v.at[layer, slots].set(v.astype(self.v.dtype)),
        )


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

    def specs(self, data_axis: str | None, model_axis: str | None = None):
        """Partition specs of the buffers on a mesh: slots split over ``data_axis``; the latent
        (and indexer keys) are whole on every model shard (every head reads all of it)."""
        spec = PartitionSpec() if self.num_layers == 0 else PartitionSpec(None, data_axis, None)
        return dataclasses.replace(self, kv=spec, index_k=None if self.index_k is None else spec)

    def write(self, layer, slots, kv, index_k=None) -> "MLAPool":
        """Writes ``kv: [R, C]`` (and ``index_k: [R, Di]``) at ``slots: i32[R]`` of ``layer``."""
        new = dataclasses.replace(self, kv=self.kv.at[layer, slots].set(kv.astype(self.kv.dtype)))
        if self.index_k is not None and index_k is not None:
            new = dataclasses.replace(
                new, index_k=self.index_k.at[layer, slots].set(index_k.astype(self.index_k.dtype))
            )
        return new
