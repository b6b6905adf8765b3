"""Position-to-slot math: the one place that turns (request, position) into a pool slot.

A pool holds ``num_slots = num_pages * page_size`` slots. Request ``b``'s token at position
``pos`` lives in slot ``page_table[b, pos // P] * P + pos % P``. Page 0 is reserved scratch:
padded rows and unused page-table entries point there and nothing reads it.
"""

from __future__ import annotations

import dataclasses

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


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages covering positions [0, num_tokens)."""
    return -(-num_tokens // page_size)


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
    """

    page_table: jax.Array
    prefix_lens: jax.Array
    write_slots: jax.Array
    block_mask: jax.Array | None = None

    @classmethod
    def build(cls, page_table, prefix_lens, write_positions, page_size, block_mask=None) -> "AttentionInputs":
        """``write_positions: i32[B, T]`` (negative = padded row, written to scratch)."""
        return cls(
            page_table=page_table,
            prefix_lens=prefix_lens.astype(jnp.int32),
            write_slots=positions_to_slots(page_table, write_positions, page_size),
            block_mask=block_mask,
        )
