"""Accepted-path compaction for tree drafting (seed 001), for any page size.

Verify writes node ``i``'s target KV at position ``seq_len + i``. The accepted nodes
``a_0 = 0 < a_1 < ... < a_k`` then move to ``seq_len + j`` (all layers, every pool buffer),
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


def compaction_moves(
    page_table: jax.Array,  # i32[B, W]
    seq_lens: jax.Array,  # i32[B]
    accept_index: jax.Array,  # i32[B, S+1]
    accept_lens: jax.Array,  # i32[B]
    active: jax.Array,  # bool[B]
    page_size: int,
) -> tuple[jax.Array, jax.Array]:  # src, dst slots i32[B * S] (-1 = no move)
    """Slot pairs moving accepted node ``a_j`` (position ``seq_len + a_j``) to ``seq_len + j``."""
    B, A = accept_index.shape
    j = jnp.arange(1, A, dtype=jnp.int32)[None, :]  # [1, S]
    a = accept_index[:, 1:]  # [B, S]
    move = active[:, None] & (j < accept_lens[:, None]) & (a != j)
    src = positions_to_slots(page_table, seq_lens[:, None] + jnp.maximum(a, 0), page_size)
    dst = positions_to_slots(page_table, seq_lens[:, None] + j, page_size)
    src = jnp.where(move, src, -1)
    dst = jnp.where(move, dst, -1)
    return src.reshape(-1), dst.reshape(-1)


def compact_pool(pool, page_table, seq_lens, accept_index, accept_lens, active, *, implementation=None,
                 tensor_parallel: int = 1):
    """Moves every buffer of ``pool`` (MHA k/v, MLA latent, indexer keys) along the accepted path.
    With ``tensor_parallel`` shards every model shard moves its own part of the pool (its KV
    heads, or its copy of an MLA latent)."""
    if pool.num_layers == 0:
        return pool
    src, dst = compaction_moves(page_table, seq_lens, accept_index, accept_lens, active, pool.page_size)

    def move(buffers, src, dst):
        # Moves are request-major (S per request), so requests can be spread over programs.
        return kv_move(buffers, src, dst, implementation=implementation, moves_per_request=accept_index.shape[1] - 1)

    specs = pool.specs(None, MODEL).buffers
    moved = per_model_shard(move, in_specs=(specs, P(), P()), out_specs=specs, shards=tensor_parallel)(
        pool.buffers, src, dst)
    return pool.with_buffers(moved)


def gather_to_front(
    x: jax.Array,  # [B, n, ...]
    accept_index: jax.Array,  # i32[B, S+1]
) -> jax.Array:  # [B, S+1, ...]: row j = x[a_j] (rows past accept_len: node 0, never read)
    idx = jnp.maximum(accept_index, 0)
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)
