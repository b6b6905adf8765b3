"""Position-to-slot math: the one place that turns (request, position) into a pool slot.

A pool holds ``num_slots = num_pages * page_size`` slots. Request ``b``'s token at position
``pos`` lives in slot ``page_table[b, pos // P] * P + pos % P``. Page 0 is reserved scratch:
padded rows and unused page-table entries point there and nothing reads it.

Sliding-window layers live in a pool of their own, addressed by a ring page table
(``WindowTable``) instead: a request keeps only the pages that cover its last positions, so
its table holds R columns, and logical page ``j`` (positions ``[j*P, (j+1)*P)``) sits in
column ``j % R`` while it is resident, i.e. while ``first[b] <= j < first[b] + R``. The host
(``jaxspec.engine.window``) moves ``first`` forward as the request advances, returning the
pages that fell behind to the allocator and granting new ones in the freed columns; no
device array is shifted. A position that is not resident maps to scratch slot 0: a write
there is dropped (a prompt longer than the window writes only its tail), and attention never
reads one unmasked (every position a sliding-window query can see is resident). Both pools of
a model and any draft pool share these tables (``PageTables``), so slots agree across them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

SCRATCH_PAGE = 0


def positions_to_slots(
    page_table: jax.Array,  # i32[B, W]
    positions: jax.Array,  # i32[B, ...]; < 0 means "no slot" (padding)
    page_size: int,
) -> jax.Array:  # i32[B, ...]
    """Slots of ``positions`` for each request; negative positions map to scratch slot 0."""
    B, W = page_table.shape
    flat = positions.reshape(B, -1)
    valid = (flat >= 0) & (flat < W * page_size)
    safe = jnp.where(valid, flat, 0)
    pages = jnp.take_along_axis(page_table, safe // page_size, axis=1)
    slots = pages * page_size + safe % page_size
    slots = jnp.where(valid, slots, SCRATCH_PAGE * page_size)
    return slots.reshape(positions.shape).astype(jnp.int32)


def scratch_dropped(slots: jax.Array, page_size: int, num_slots: int) -> jax.Array:  # i32[...] -> i32[...]
    """Write indices for a scatter with ``mode="drop"``: slots of the scratch page move past the
    buffer, so those writes are skipped. Padding rows, positions a ring does not hold and a
    checkpoint table's unused columns all map to scratch; as many writes to one slot serialize on a
    GPU (a 1k-token prompt's head written to a window pool's scratch slot took 43 ms a layer on an
    H200), and nothing reads scratch."""
    return jnp.where(slots >= scratch_end(page_size), slots, num_slots)


def scratch_end(page_size: int) -> int:
    """The first slot past the scratch page."""
    return (SCRATCH_PAGE + 1) * page_size


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages covering positions [0, num_tokens)."""
    return -(-num_tokens // page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowTable:
    """Ring page table of a sliding-window pool (module docstring).

    pages: i32[B, R] physical page of each resident logical page, at column ``j % R``.
    first: i32[B] first resident logical page of each request.
    """

    pages: jax.Array
    first: jax.Array

    def slots(self, positions: jax.Array, page_size: int) -> jax.Array:  # i32[B, ...] -> i32[B, ...]
        """Slots of ``positions`` (scratch slot 0 for negative or non-resident positions)."""
        B, R = self.pages.shape
        flat = positions.reshape(B, -1)
        page = jnp.maximum(flat, 0) // page_size
        first = self.first[:, None]
        resident = (flat >= 0) & (page >= first) & (page < first + R)
        phys = jnp.take_along_axis(self.pages, page % R, axis=1)
        slots = jnp.where(resident, phys * page_size + flat % page_size, SCRATCH_PAGE * page_size)
        return slots.reshape(positions.shape).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTables:
    """The page tables of one decode: ``full`` (i32[B, W], every position) and, for models with
    sliding-window layers, the ring table of the window pool (``None`` otherwise); for models
    with compressed KV (DeepSeek-V4), one page table per compression rate (``compressed``,
    i32[B, We] each, addressed by entry index: entry ``e`` of rate ``m`` covers positions
    ``[e*m, (e+1)*m)``, so these tables advance at ``1/m`` of the token rate). Passed wherever a
    page table goes; a bare ``[B, W]`` array means ``PageTables(full=array)``.

    A prefill with the prefix cache on a model with a window pool also gets two tables of the
    window pool beside the ring (``jaxspec.engine.window``): ``window_read``, the cached pages
    before a request's cached prefix ends, which its sliding-window layers read (the ring holds
    the prompt's tail, possibly far past them), and ``window_keep``, the pages where its prefill
    also writes the window before the point another prompt's match ended (a checkpoint the
    prefix cache keeps). A prefill with the prefix cache on a model with recurrent state gets its
    ``snapshots`` table (``jaxspec.kvcache.recurrent.SnapshotTable``: the slot each request's state
    starts from, the slots its states at page points go to); on a model with compressed KV, its
    ``entry_copy`` (per rate i32[B, 2]: a partial entry page to copy, source and destination page,
    before anything reads it; ``jaxspec.engine.entries``). Decode calls pass none of these."""

    full: jax.Array
    window: WindowTable | None = None
    compressed: tuple[jax.Array, ...] = ()
    window_read: WindowTable | None = None
    window_keep: WindowTable | None = None
    snapshots: Any = None
    entry_copy: tuple[jax.Array, ...] = ()


def full_table(tables) -> jax.Array:  # PageTables | i32[B, W] -> i32[B, W]
    return tables.full if isinstance(tables, PageTables) else tables


def window_table(tables) -> WindowTable | None:
    return tables.window if isinstance(tables, PageTables) else None


def compressed_tables(tables) -> tuple[jax.Array, ...]:
    return tables.compressed if isinstance(tables, PageTables) else ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Where one forward writes its K/V and what each query row may see.

    Attributes:
      page_table: i32[B, W] pages of each request (unused entries point at scratch page 0).
      prefix_lens: i32[B] committed positions visible to every row of the request.
      write_slots: i32[B, T] slot receiving each row's K/V (scratch slot 0 for padding).
      block_mask: bool[B, T, Wb] visibility of the block right after the prefix, or None
        for a causal block over the T rows.
      write_positions: i32[B, T] the positions behind ``write_slots`` (negative = padding).
      window: the ring table of the sliding-window pool, for models that have one.
      state_rows: i32[B] the row of the recurrent-state pool of each request (linear-attention
        layers; None: row b is request b). Rows past the pool's are padding (never written).
      pending: static. True for a verify forward: its tokens are candidates, so recurrent state is
        not written but returned per token (``ForwardOutput.pending``), for the accepted path to be
        committed; False (a prefill) writes the state after each row's last token.
      compressed: the page tables of the compressed-KV pools, one per compression rate
        (``PageTables.compressed``).
      window_read, window_keep: a prefill's extra tables of the window pool (``PageTables``):
        where its sliding-window layers read the positions before ``prefix_lens`` (None: the ring),
        and where they also write their K/V (None: nowhere else).
      snapshots: a prefill's ``SnapshotTable`` (``PageTables.snapshots``), or None.
      entry_copy: a prefill's partial entry pages to copy, per compression rate (``PageTables.entry_copy``).
    """

    page_table: jax.Array
    prefix_lens: jax.Array
    write_slots: jax.Array
    block_mask: jax.Array | None = None
    write_positions: jax.Array | None = None
    window: WindowTable | None = None
    state_rows: jax.Array | None = None
    pending: bool = dataclasses.field(default=False, metadata=dict(static=True))
    compressed: tuple[jax.Array, ...] = ()
    window_read: WindowTable | None = None
    window_keep: WindowTable | None = None
    snapshots: Any = None
    entry_copy: tuple[jax.Array, ...] = ()

    @classmethod
    def build(cls, page_table, prefix_lens, write_positions, page_size, block_mask=None, *, state_rows=None,
              pending: bool = False) -> "AttentionInputs":
        """``page_table``: ``PageTables`` or a bare i32[B, W]; ``write_positions: i32[B, T]``
        (negative = padded row, written to scratch)."""
        full = full_table(page_table)
        return cls(
            page_table=full,
            prefix_lens=prefix_lens.astype(jnp.int32),
            write_slots=positions_to_slots(full, write_positions, page_size),
            block_mask=block_mask,
            write_positions=write_positions.astype(jnp.int32),
            window=window_table(page_table),
            state_rows=state_rows,
            pending=pending,
            compressed=compressed_tables(page_table),
            window_read=page_table.window_read if isinstance(page_table, PageTables) else None,
            window_keep=page_table.window_keep if isinstance(page_table, PageTables) else None,
            snapshots=page_table.snapshots if isinstance(page_table, PageTables) else None,
            entry_copy=page_table.entry_copy if isinstance(page_table, PageTables) else (),
        )
