"""Accepted-path compaction for tree drafting, for any page size
(docs/architecture.md#accepted-path-compaction).

Verify writes node ``i``'s target KV at position ``seq_len + i``. The accepted nodes
``a_0 = 0 < a_1 < ... < a_k`` then move to ``seq_len + j`` (all layers, every pool buffer,
both parts of a split pool, each through its own page table),
and the per-node outputs (predicted token, target features) are gathered to the front of
each request's block. Chains (topk = 1) accept a prefix, so this is statically skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.mesh import MODEL, per_model_shard
from jaxspec.pallas.kv_move import kv_move


def compaction_positions(
    seq_lens: jax.Array,  # i32[B]
    accept_index: jax.Array,  # i32[B, S+1]
    accept_lens: jax.Array,  # i32[B]
    active: jax.Array,  # bool[B]
) -> tuple[jax.Array, jax.Array]:  # src, dst positions i32[B, S] (-1 = no move)
    """Position pairs moving accepted node ``a_j`` (position ``seq_len + a_j``) to ``seq_len + j``."""
    B, A = accept_index.shape
    j = jnp.arange(1, A, dtype=jnp.int32)[None, :]  # [1, S]
    a = accept_index[:, 1:]  # [B, S]
    move = active[:, None] & (j < accept_lens[:, None]) & (a != j)
    src = jnp.where(move, seq_lens[:, None] + jnp.maximum(a, 0), -1)
    dst = jnp.where(move, seq_lens[:, None] + j, -1)
    return src, dst


def _to_slots(positions: jax.Array, slots_of) -> jax.Array:  # i32[B, S] -> i32[B * S] (-1 kept)
    return jnp.where(positions >= 0, slots_of(positions), -1).reshape(-1)


def compaction_moves(
    page_table: jax.Array,  # i32[B, W]
    seq_lens: jax.Array,  # i32[B]
    accept_index: jax.Array,  # i32[B, S+1]
    accept_lens: jax.Array,  # i32[B]
    active: jax.Array,  # bool[B]
    page_size: int,
) -> tuple[jax.Array, jax.Array]:  # src, dst slots i32[B * S] (-1 = no move)
    """Slot pairs of ``compaction_positions`` through a (full) page table."""
    src, dst = compaction_positions(seq_lens, accept_index, accept_lens, active)

    def slots_of(positions):
        return positions_to_slots(page_table, positions, page_size)

    return _to_slots(src, slots_of), _to_slots(dst, slots_of)


def compact_pool(pool, page_table, seq_lens, accept_index, accept_lens, active, *, implementation=None,
                 tensor_parallel: int = 1):
    """Moves every buffer of every part of ``pool`` (MHA k/v, MLA latent, indexer keys, the
    full and sliding-window parts of a ``SplitPool``) along the accepted path; ``page_table``
    is a bare i32[B, W] or ``PageTables``. With ``tensor_parallel`` shards every model shard
    moves its own part of the pool (its KV heads, or its copy of an MLA latent)."""
    src, dst = compaction_positions(seq_lens, accept_index, accept_lens, active)

    def move_buffers(buffers, src, dst):
        # Moves are request-major (S per request), so requests can be spread over programs.
        return kv_move(buffers, src, dst, implementation=implementation, moves_per_request=accept_index.shape[1] - 1)

    def move(part, slots_of):
        if part.num_layers == 0:
            return part
        specs = part.specs(None, MODEL).buffers
        moved = per_model_shard(move_buffers, in_specs=(specs, P(), P()), out_specs=specs, shards=tensor_parallel)(
            part.buffers, _to_slots(src, slots_of), _to_slots(dst, slots_of))
        return part.with_buffers(moved)

    return pool.map_parts(page_table, move)


def gather_to_front(
    x: jax.Array,  # [B, n, ...]
    accept_index: jax.Array,  # i32[B, S+1]
) -> jax.Array:  # [B, S+1, ...]: row j = x[a_j] (rows past accept_len: node 0, never read)
    idx = jnp.maximum(accept_index, 0)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)
