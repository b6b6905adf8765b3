"""The one owner of the draft-scratch KV layout (SGLang's ``per_step_draft_out_cache_loc``).

A speculative step drafts ``topk`` branches for ``S`` steps. Branch ``j``'s step ``i`` writes
its draft KV at position ``base + j * S + i`` (``base`` = the first position after the
committed prefix, per request). The flat buffer is laid out ``[B, topk, S]``; step ``i``
needs row ``i`` of the ``[S, B * topk]`` view. Every path that writes or reads draft scratch
(EAGLE heads, standalone drafts, the MLA/MTP path, the attention masks) goes through these
functions, so the jitted and the eager (``jax.disable_jit()``) runs cannot disagree (seed 004
is a bug where two copies of this reshape did).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def draft_scratch_positions(
    base: jax.Array,  # i32[B]: first scratch position of each request
    topk: int,
    num_steps: int,
) -> jax.Array:  # i32[B * topk * S], laid out [B, topk, S]
    """Flat scratch positions ``base + j * S + i`` for every (request, branch j, step i)."""
    offsets = jnp.arange(topk * num_steps, dtype=jnp.int32)  # j * S + i, row-major over (j, i)
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
