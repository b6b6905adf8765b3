"""The one owner of the draft-scratch KV layout (SGLang's ``per_step_draft_out_cache_loc``).

A speculative step drafts ``topk`` branches for ``S`` steps. Branch ``j``'s step ``i`` writes
its draft KV at position ``base + j * S + i`` (``base`` = the first position after the
committed prefix, per request). The flat buffer is laid out ``[B, topk, S]``; step ``i``
needs row ``i`` of the ``[S, B * topk]`` view. Every path that writes or reads draft scratch
(EAGLE heads, standalone drafts, the MLA/MTP path, the attention masks) goes through these
functions, so the jitted and the eager (``jax.disable_jit()``) runs cannot disagree, as two
copies of this reshape once did (docs/architecture.md#jitted-and-eager-runs-agree).

The layout itself (branch j, step i -> scratch offset ``j * S + i``) is defined once, in
``_scratch_offsets``: the write side (``draft_scratch_positions``) maps (j, i) through it, and the
read side (``draft_scratch_cells``: which branch and step a scratch column holds, hence which
ancestor it is and its logical position ``base + i``; ``draft_scratch_steps`` its steps) inverts it,
so writes and reads cannot drift apart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _scratch_offsets(topk: int, num_steps: int) -> np.ndarray:  # i32[topk, S]
    """THE draft-scratch layout: entry [j, i] is the scratch offset (position - base) of branch j,
    step i, i.e. ``j * S + i``. Static (topk and S are), so jitted and eager runs share one constant."""
    return np.arange(topk * num_steps, dtype=np.int32).reshape(topk, num_steps)


def draft_scratch_positions(
    base: jax.Array,  # i32[B]: first scratch position of each request
    topk: int,
    num_steps: int,
) -> jax.Array:  # i32[B * topk * S], laid out [B, topk, S]
    """Flat scratch positions ``base + j * S + i`` for every (request, branch j, step i)."""
    offsets = jnp.asarray(_scratch_offsets(topk, num_steps).reshape(-1))  # j * S + i, row-major over (j, i)
    return (base[:, None].astype(jnp.int32) + offsets[None, :]).reshape(-1)


def per_step_draft_locs(
    flat: jax.Array,  # [B * topk * S] laid out [B, topk, S]
    batch_size: int,
    topk: int,
    num_steps: int,
) -> jax.Array:  # [S, B * topk]
    """Views the flat ``[B, topk, S]`` buffer as ``[S, B * topk]``: row ``i`` is step ``i``."""
    expected = batch_size * topk * num_steps
    if flat.shape[0] != expected:
        raise ValueError(
            f"draft scratch buffer has {flat.shape[0]} entries, expected "
            f"batch_size * topk * num_steps = {batch_size}*{topk}*{num_steps} = {expected}"
        )
    return jnp.transpose(flat.reshape(batch_size, topk, num_steps), (2, 0, 1)).reshape(num_steps, -1)


def draft_scratch_cells(topk: int, num_steps: int) -> tuple[np.ndarray, np.ndarray]:  # (i32[topk * S], i32[topk * S])
    """The read side of the layout: (branch, step) of every scratch column. Entry ``c`` says which
    branch ``j`` and step ``i`` wrote the column at offset ``c`` (position ``base + c``): the inverse of
    ``_scratch_offsets`` (``c // S``, ``c % S`` for the layout ``j * S + i``), so it moves with it. Static
    numpy (topk and S are): masks over the scratch columns (which ancestor each column is) and logical
    positions (``base + i``) are built from it, never from the arithmetic of one layout."""
    offsets = _scratch_offsets(topk, num_steps)
    n = topk * num_steps
    if offsets.shape != (topk, num_steps) or not np.array_equal(np.sort(offsets.reshape(-1)), np.arange(n)):
        raise ValueError(f"draft-scratch offsets of {topk} branches x {num_steps} steps are not a "
                         f"permutation of 0..{n - 1}")
    branch, step = np.empty(n, np.int32), np.empty(n, np.int32)
    branch[offsets.reshape(-1)] = np.repeat(np.arange(topk, dtype=np.int32), num_steps)
    step[offsets.reshape(-1)] = np.tile(np.arange(num_steps, dtype=np.int32), topk)
    return branch, step


def draft_scratch_steps(topk: int, num_steps: int) -> jax.Array:  # i32[topk * S]
    """Entry ``c`` is the step ``i`` of the scratch column at offset ``c`` (position ``base + c``), so
    the token there sits at logical (RoPE) position ``base + i`` (``draft_scratch_cells``' steps)."""
    return jnp.asarray(draft_scratch_cells(topk, num_steps)[1])
