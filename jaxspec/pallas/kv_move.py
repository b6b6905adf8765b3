"""Move KV rows between slots, for every layer and every buffer of a pool (compaction).

After tree verify, accepted node ``a_j`` moves from position ``seq_len + a_j`` to
``seq_len + j``. Because ``a_j >= j``, a target slot can only coincide with the source of an
*earlier* move, so reading every source before writing any target (gather, then scatter) is
exact. Entries with ``src < 0`` or ``dst < 0`` are padding and ignored.

Buffers are any arrays shaped ``[L, N, ...]`` (MHA k/v, MLA latent, indexer keys): they all
move by the same slot lists. A pool with ``L == 0`` is returned unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.pallas import dispatch


def kv_move_reference(
    buffers: tuple[jax.Array, ...],  # each [L, N, ...]
    src_slots: jax.Array,  # i32[M] (-1 = skip)
    dst_slots: jax.Array,  # i32[M] (-1 = skip)
) -> tuple[jax.Array, ...]:
    """Gather every source row, then scatter to the targets (XLA path)."""
    valid = (src_slots >= 0) & (dst_slots >= 0)
    out = []
    for buf in buffers:
        if buf.shape[0] == 0:
            out.append(buf)
            continue
        N = buf.shape[1]
        rows = buf[:, jnp.where(valid, src_slots, 0)]  # [L, M, ...]
        dst = jnp.where(valid, dst_slots, N)  # out of range -> dropped
        out.append(buf.at[:, dst].set(rows, mode="drop"))
    return tuple(out)


def kv_move_pallas(buffers, src_slots, dst_slots, *, interpret):
    # TODO(kernels issue): Pallas Triton kernel.
    raise NotImplementedError("the Pallas KV-move kernel is not written yet")


def kv_move(
    buffers: tuple[jax.Array, ...],
    src_slots: jax.Array,
    dst_slots: jax.Array,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """Copies rows ``src_slots -> dst_slots`` in every buffer, all layers (see module doc)."""
    if dispatch.resolve(implementation) == "pallas":
        return kv_move_pallas(buffers, src_slots, dst_slots, interpret=dispatch.interpret_mode())
    return kv_move_reference(buffers, src_slots, dst_slots)
