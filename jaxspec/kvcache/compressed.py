"""The pools of a model with compressed KV (DeepSeek-V4): a window part addressed by the ring
table, and one entry part per compressed layer kind addressed by its compressed page table.

* ``RingPart`` (the sliding-window pool, ``paging.WindowTable``): per position, every layer's K = V
  row ``kv [L, Nw, D]`` and, for compressed layers, the compressor's inputs of that token
  (``csa_in [Lc, Nw, 4D + 4Di]``: kv and gate projections of the main and the indexer compressor;
  ``hca_in [Lh, Nw, 2D]``). These inputs are the running compressor state: a window not yet closed
  is the inputs of its tokens so far, read by position. A request keeps resident the positions its
  windows still read (``DeepseekV4Config.window_span`` behind its length), like the sliding window.
* ``EntryPart`` (one per compression rate): one slot per compressed entry, ``kv [Lk, Ne, D]`` (+ the
  indexer's compressed keys ``index_k [Lc, Ne, Di]`` for CSA), addressed by entry index through the
  rate's page table (``PageTables.compressed``).

How the engine's moves apply: a forward writes the inputs of its tokens at their positions (tree
nodes and draft scratch included); compaction moves the ring part by position like KV; entries
are written only for committed tokens (a prefill or draft extend writes the entries its tokens
close; a verify returns the entry each node would close, and the commit writes those of the
accepted path), so a rejected token leaves no trace in an entry, and its inputs sit past the
committed length where nothing reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.kvcache.paging import WindowTable, window_table


def _spec(buffer: jax.Array, data_axis):
    return PartitionSpec() if buffer.shape[0] == 0 else PartitionSpec(None, data_axis, None)


def entry_pages_for(num_pages: int, rows: int, rate: int) -> int:
    """Pages of an entry pool that let every row reach whatever the full pool's ``num_pages`` allow:
    a row holding positions [0, n) keeps entries [0, n / rate] (one page more at most), so
    ``num_pages / rate`` pages for all rows together, two per row for rounding, and the scratch page."""
    return -(-num_pages // rate) + 2 * rows + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingPart:
    """kv: [L, Nw, D] K = V rows of every layer; csa_in [Lc, Nw, Pc] / hca_in [Lh, Nw, Ph]: the
    compressor inputs of each token, per compressed layer. Whole on every model shard (one head)."""

    kv: jax.Array
    csa_in: jax.Array
    hca_in: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (self.kv, self.csa_in, self.hca_in)

    def with_buffers(self, buffers) -> "RingPart":
        kv, csa_in, hca_in = buffers
        return dataclasses.replace(self, kv=kv, csa_in=csa_in, hca_in=hca_in)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_slots(self) -> int:
        return self.kv.shape[1]

    def specs(self, data_axis, model_axis=None):
        return dataclasses.replace(self, kv=_spec(self.kv, data_axis), csa_in=_spec(self.csa_in, data_axis),
                                   hca_in=_spec(self.hca_in, data_axis))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingBuffer:
    """One buffer of the ring part as a part of its own (``map_parts``: compaction moves it)."""

    buffer: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (self.buffer,)

    def with_buffers(self, buffers) -> "RingBuffer":
        return dataclasses.replace(self, buffer=buffers[0])

    @property
    def num_layers(self) -> int:
        return self.buffer.shape[0]

    def specs(self, data_axis, model_axis=None):
        return dataclasses.replace(self, buffer=_spec(self.buffer, data_axis))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EntryPart:
    """kv: [Lk, Ne, D] compressed entries; index_k: [Lk, Ne, Di] the indexer's compressed keys
    (CSA), or None."""

    kv: jax.Array
    index_k: jax.Array | None = None
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)

    @property
    def buffers(self) -> tuple[jax.Array, ...]:
        return (self.kv,) if self.index_k is None else (self.kv, self.index_k)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    def specs(self, data_axis, model_axis=None):
        return dataclasses.replace(self, kv=_spec(self.kv, data_axis),
                                   index_k=None if self.index_k is None else _spec(self.index_k, data_axis))

    def write(self, layer, slots, kv, index_k=None) -> "EntryPart":
        """Writes ``kv [R, D]`` (and ``index_k [R, Di]``) at ``slots: i32[R]`` (< 0: dropped)."""
        where = jnp.where(slots >= 0, slots, self.kv.shape[1])
        new = dataclasses.replace(self, kv=self.kv.at[layer, where].set(kv.astype(self.kv.dtype), mode="drop"))
        if self.index_k is not None and index_k is not None:
            new = dataclasses.replace(new, index_k=self.index_k.at[layer, where].set(
                index_k.astype(self.index_k.dtype), mode="drop"))
        return new


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedPool:
    """The pools of a DeepSeek-V4 model (module docstring): ``window`` (ring), ``entries`` (one
    ``EntryPart`` per compression rate, in the order of ``PageTables.compressed``)."""

    window: RingPart
    entries: tuple[EntryPart, ...] = ()

    @classmethod
    def create(cls, *, num_layers, window_pages, page_size, head_dim, csa_layers, csa_width, hca_layers, hca_width,
               entry_specs, dtype) -> "CompressedPool":
        """``entry_specs``: per compression rate, (layers, pages, index_dim) of its entry part."""
        n = window_pages * page_size
        window = RingPart(kv=jnp.zeros((num_layers, n, head_dim), dtype),
                          csa_in=jnp.zeros((csa_layers, n, csa_width), dtype),
                          hca_in=jnp.zeros((hca_layers, n, hca_width), dtype), page_size=page_size)
        entries = tuple(
            EntryPart(kv=jnp.zeros((layers, pages * page_size, head_dim), dtype),
                      index_k=jnp.zeros((layers, pages * page_size, index_dim), dtype) if index_dim else None,
                      page_size=page_size)
            for layers, pages, index_dim in entry_specs)
        return cls(window=window, entries=entries)

    @property
    def page_size(self) -> int:
        return self.window.page_size

    @property
    def num_layers(self) -> int:
        return self.window.num_layers

    def specs(self, data_axis, model_axis=None):
        """Slots split over ``data_axis``; nothing over the model axis (V4 has one K = V head)."""
        return dataclasses.replace(self, window=self.window.specs(data_axis),
                                   entries=tuple(e.specs(data_axis) for e in self.entries))

    def map_parts(self, tables, fn: Callable) -> "CompressedPool":
        """``fn`` on each buffer of the ring part (position-addressed: compaction moves them like KV;
        one at a time, their layer counts differ); entries are committed, never moved by position."""
        ring = window_table(tables)
        if ring is None:
            raise ValueError("a compressed-KV pool needs PageTables with a window table")
        page = self.window.page_size
        slots_of = lambda positions: ring.slots(positions, page)  # noqa: E731
        moved = tuple(fn(RingBuffer(b, page), slots_of).buffer for b in self.window.buffers)
        return dataclasses.replace(self, window=self.window.with_buffers(moved))

    def copy_entry_pages(self, copies: tuple[jax.Array, ...]) -> "CompressedPool":
        """Copies, per rate, page ``copies[r][b, 0]`` of its entry part onto page ``copies[r][b, 1]``
        (every layer, indexer keys included; destination 0: nothing), a prefix-cache hit's partial
        entry page (``jaxspec.engine.entries``)."""
        if not copies:
            return self
        entries = []
        for part, copy in zip(self.entries, copies):
            P = part.page_size
            within = jnp.arange(P, dtype=jnp.int32)[None, :]
            src = (copy[:, :1] * P + within).reshape(-1)
            dst = jnp.where(copy[:, 1:] > 0, copy[:, 1:] * P + within, part.kv.shape[1]).reshape(-1)
            move = lambda buf: buf.at[:, dst].set(buf[:, src], mode="drop")  # noqa: E731
            entries.append(dataclasses.replace(part, kv=move(part.kv),
                                               index_k=None if part.index_k is None else move(part.index_k)))
        return dataclasses.replace(self, entries=tuple(entries))

    def part(self, name: str):
        if name != "window":
            raise ValueError(f"a compressed-KV pool has no {name!r} part")
        return self.window


def compressed_write_targets(
    ring: WindowTable,
    write_positions: jax.Array,  # i32[B, T] where each row's token is written (< 0: padding)
    positions: jax.Array,  # i32[B, T] each row's logical position
    rates: tuple[int, ...],
    page_size: int,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Where a forward's compressed-KV writes go: the ring slots of its rows' compressor inputs
    (i32[B, T]: beside their K = V rows), and per compression rate the entry each row closes (i32[B, T],
    -1 when it closes none: entry ``w`` closes at position ``(w + 1) * rate - 1``). A draft step's rows
    come from the one draft-scratch layout (``jaxspec.kvcache.layout.per_step_draft_locs``), so its
    compressed write targets are that step's row of the layout and nothing else (so jitted and eager
    runs write the same entries: docs/architecture.md#jitted-and-eager-runs-agree)."""
    slots = ring.slots(write_positions, page_size)
    real = write_positions >= 0
    closes = tuple(jnp.where(real & ((positions + 1) % m == 0), (positions + 1) // m - 1, -1) for m in rates)
    return slots, closes
