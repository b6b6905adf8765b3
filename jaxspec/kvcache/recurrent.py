"""State that is not paged KV: the recurrent state of linear-attention layers (Gated DeltaNet),
one per request, in the request's batch row.

* ``RecurrentPool``: ``ssm [L, B, Hv, Dk, Dv]`` (float32) and ``conv [L, B, C, K-1]`` (the last K-1
  conv inputs), for the model's L linear-attention layers and B batch rows.
* ``HybridPool``: a model mixing full-attention layers (``kv``, a paged ``KVPool`` of those layers)
  and linear-attention layers (``state``); with the prefix cache, ``snapshots``, a ``RecurrentPool``
  whose rows are the snapshot slots (``jaxspec.engine.snapshots``), which a prefill reads and
  writes through its ``SnapshotTable``.

The state follows the rules of KV: a prefill writes it; a verify step writes nothing and returns each
node's pending quantities (``jaxspec.model.gated_delta``), and only the accepted path's end state is
committed, for active rows; nothing is kept per draft node between steps. Compaction moves the KV
part alone (the state is already the accepted path's). A new request's prefill starts from a zero
state, so a row needs no clearing when its request ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.kvcache.pool import KVPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentPool:
    """ssm: f32[L, B, Hv, Dk, Dv]; conv: [L, B, C, K-1] (C conv channels, grouped per key head)."""

    ssm: jax.Array
    conv: jax.Array

    @classmethod
    def create(cls, *, num_layers, rows, num_v_heads, head_k_dim, head_v_dim, conv_channels, conv_kernel,
               dtype) -> "RecurrentPool":
        return cls(ssm=jnp.zeros((num_layers, rows, num_v_heads, head_k_dim, head_v_dim), jnp.float32),
                   conv=jnp.zeros((num_layers, rows, conv_channels, conv_kernel - 1), dtype))

    @property
    def num_layers(self) -> int:
        return self.ssm.shape[0]

    def specs(self, data_axis: str | None, model_axis: str | None):
        """Rows split over ``data_axis`` (with the pages of the same rows), heads and conv channels over
        ``model_axis``."""
        if self.num_layers == 0:
            return dataclasses.replace(self, ssm=PartitionSpec(), conv=PartitionSpec())
        return dataclasses.replace(self, ssm=PartitionSpec(None, data_axis, model_axis, None, None),
                                   conv=PartitionSpec(None, data_axis, model_axis, None))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SnapshotTable:
    """A prefill's use of the snapshot slots (``jaxspec.engine.snapshots``), per request:
    restore i32[B] the slot whose state a request with a cached prefix starts from (it has
    ``prefix_lens > 0``; slot 0, scratch, otherwise); at i32[B, M] positions after which the state
    is saved (a mark at or before ``prefix_lens`` saves nothing); slots i32[B, M] the slots they go to."""

    restore: jax.Array
    at: jax.Array
    slots: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftScratch:
    """While a hybrid model drafts a tree (a standalone draft): per linear layer, what each scratch
    node left (``jaxspec.model.gated_delta``), in the draft-scratch layout (``jaxspec.kvcache.layout``:
    column ``j * S + i`` for branch j, step i; W = K * S columns): k f32[L, B, W, Hk, Dk], u f32[L, B, W, Hv, Dv],
    G f32[L, B, W, Hv], conv_in [L, B, W, C]. It exists only inside one propose."""

    k: jax.Array
    u: jax.Array
    G: jax.Array
    conv_in: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridPool:
    """The pools of a hybrid model: ``kv`` for its full-attention layers, ``state`` for its
    linear-attention layers; ``scratch`` only while it drafts (``DraftScratch``); ``snapshots`` the
    states the prefix cache keeps (rows: slots; None without the cache)."""

    kv: KVPool
    state: RecurrentPool
    scratch: DraftScratch | None = None
    snapshots: RecurrentPool | None = None

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def num_layers(self) -> int:
        return self.kv.num_layers + self.state.num_layers

    def specs(self, data_axis: str | None, model_axis: str | None = None):
        snapshots = None if self.snapshots is None else self.snapshots.specs(data_axis, model_axis)
        return dataclasses.replace(self, kv=self.kv.specs(data_axis, model_axis),
                                   state=self.state.specs(data_axis, model_axis), scratch=None, snapshots=snapshots)

    def with_scratch(self, width: int, num_k_heads: int, conv_channels: int) -> "HybridPool":
        """Zeroed ``DraftScratch`` of ``width`` columns for one propose."""
        L, B, Hv, Dk, Dv = self.state.ssm.shape
        z = lambda *shape, dtype=jnp.float32: jnp.zeros((L, B, width) + shape, dtype)  # noqa: E731
        return dataclasses.replace(self, scratch=DraftScratch(
            k=z(num_k_heads, Dk), u=z(Hv, Dv), G=z(Hv), conv_in=z(conv_channels, dtype=self.state.conv.dtype)))

    def map_parts(self, tables, fn: Callable) -> "HybridPool":
        """``fn`` on the KV part only: position-addressed ops (compaction) never touch the state."""
        return dataclasses.replace(self, kv=self.kv.map_parts(tables, fn))

    def part(self, name: str) -> KVPool:
        if name != "full":
            raise ValueError(f"a hybrid pool has no {name!r} part")
        return self.kv
