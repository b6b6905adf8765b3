"""Joined projections: several weights that read the same input stored as one, so a layer runs
one product where it ran several (q/k/v as one ``wqkv``, gate/up as one ``w_gate_up``, a Qwen3.5
Gated DeltaNet layer's z/b/a as one ``in_zba``).

The parts sit side by side on the last axis, grouped per model shard: with n shards, shard k's
slice of every part comes together,

    [q_0 k_0 v_0 | q_1 k_1 v_1 | ... | q_{n-1} k_{n-1} v_{n-1}]

so splitting the last axis evenly over the mesh's model axis gives each shard its own slice of
each part, and the product's output is split back into its parts on every shard without moving
data between shards. One matmul with the joined weight computes each column exactly as the
separate product did (the same reduction over the input axis).

``n`` is the config's ``tensor_parallel``, on both sides: the name tables join with it, the layers
split with it. A joined weight kept whole on every shard (a replicated draft) has the same
order, which is then just a permutation of its columns. Parts whose widths do not all divide by
n are joined in the one-shard order (``column_shards``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shards_of(cfg) -> int:
    """The shard count a config's joined weights are ordered for: its ``tensor_parallel`` (1 for a
    config without one, e.g. a draft head kept whole on every shard)."""
    return getattr(cfg, "tensor_parallel", 1)


def column_shards(sizes: Sequence[int], shards: int) -> int:
    """The shard count of the column order of parts ``sizes`` wide: ``shards`` when every part
    divides by it, else 1."""
    return shards if shards > 1 and all(s % shards == 0 for s in sizes) else 1


def fuse_columns(parts: Sequence, shards: int = 1):
    """Parts ``[..., s_i]`` (numpy or jax arrays) -> ``[..., sum s_i]`` in the per-shard order."""
    xp = jnp if any(isinstance(p, jax.Array) for p in parts) else np
    n = column_shards([p.shape[-1] for p in parts], shards)
    lead = parts[0].shape[:-1]
    grouped = [xp.reshape(p, lead + (n, p.shape[-1] // n)) for p in parts]  # [..., n, s_i / n]
    return xp.reshape(xp.concatenate(grouped, axis=-1), lead + (-1,))


def split_columns(x, sizes: Sequence[int], shards: int = 1) -> tuple:
    """``[..., sum sizes]`` in the per-shard order -> the parts ``[..., s_i]`` (inverse of
    ``fuse_columns``). Slices of each shard's own columns: no data crosses shards."""
    n = column_shards(sizes, shards)
    lead = x.shape[:-1]
    if n == 1:
        bounds = np.cumsum((0,) + tuple(sizes))
        return tuple(x[..., a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    y = x.reshape(lead + (n, x.shape[-1] // n))  # [..., n, per shard]
    bounds = np.cumsum((0,) + tuple(s // n for s in sizes))
    return tuple(y[..., a:b].reshape(lead + (s,)) for a, b, s in zip(bounds[:-1], bounds[1:], sizes))
