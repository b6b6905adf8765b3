"""Move KV rows between slots, for every layer and every buffer of a pool (compaction).

After tree verify, accepted node ``a_j`` moves from position ``seq_len + a_j`` to
``seq_len + j``. Because ``a_j >= j``, a target slot can only coincide with the source of an
*earlier* move, so reading every source before writing any target (gather, then scatter) is
exact. Entries with ``src < 0`` or ``dst < 0`` are padding and ignored.

Buffers are any arrays shaped ``[L, N, ...]`` (MHA k/v, MLA latent, indexer keys): they all
move by the same slot lists. A pool with ``L == 0`` is returned unchanged.

The slot lists are flat ``[M]`` with ``M = B * S``, request-major (entry ``b * S + j - 1``
moves request ``b``'s node ``j``; see ``jaxspec.spec.compact``). Moves of different requests
touch disjoint pages, so any set of whole requests is closed under overlap.

Pallas kernel (Triton). Every buffer is viewed as ``[L, N, C]``. The grid is
``(groups, L, column blocks)``; a program owns a group of whole requests (all moves when the
request structure is unknown), one layer and one column block of every buffer. It loads all
of its group's source rows, waits at a CTA barrier, then stores them to the targets, so a
target that is also an earlier move's source is read before it is overwritten, whatever order
the programs run in (programs never share a (layer, column, request) element). The pool is
updated in place through ``input_output_aliases``. Out-of-range slots never touch memory
(they are dropped like padding); ``check_bounds=True`` reports them with a clear error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.config import normalize_implementation
from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.triton_common import tile_mask, whole
from jaxspec.pallas.block_sizes import MoveBlocks, move_blocks


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


# --------------------------------------------------------------------------- validation


def validate_moves(
    src_slots: jax.Array,  # i32[M]
    dst_slots: jax.Array,  # i32[M]
    num_slots: int,  # N
) -> None:
    """Opt-in bounds check (``jax.experimental.checkify``): every slot must be -1 (padding)
    or in ``[0, num_slots)``. Eager calls raise at once; under ``jax.jit`` wrap the caller in
    ``checkify.checkify`` and ``err.throw()`` (or use :func:`kv_move_checked`)."""
    src = jnp.asarray(src_slots, jnp.int32)
    dst = jnp.asarray(dst_slots, jnp.int32)
    bad = (src < -1) | (src >= num_slots) | (dst < -1) | (dst >= num_slots)  # [M]
    first = jnp.argmax(bad)
    checkify.check(
        ~jnp.any(bad),
        f"kv_move: slot out of bounds in move {{i}}: src={{s}}, dst={{d}} (the pool has {num_slots} "
        "slots; use -1 for padding)",
        i=first, s=src[first], d=dst[first],
    )


# --------------------------------------------------------------------------- kernel


def _kv_move_kernel(
    src_ref,  # i32[R] source slots of this program's group (-1 = padding)
    dst_ref,  # i32[R] target slots
    *refs,  # inputs (aliased, unused) then outputs: each [L * N, C_i] (flat over layers)
    num_slots: int,  # N
    block_cols: tuple[int, ...],  # Cb_i per buffer
    interpret: bool,
):
    nbuf = len(block_cols)
    out_refs = refs[nbuf:]
    layer = pl.program_id(1)
    col_block = pl.program_id(2)
    src = src_ref[...]  # [R]
    dst = dst_ref[...]  # [R]
    move = (src >= 0) & (dst >= 0) & (src < num_slots) & (dst < num_slots)  # [R]
    base = layer * num_slots
    src_row = base + jnp.where(move, src, 0)  # loads: always in bounds
    dst_row = jnp.where(move, base + dst, out_refs[0].shape[0])  # stores: masked (interpret mode drops)

    @pl.when(jnp.max(move.astype(jnp.int32)) > 0)
    def _():
        for ref, cb in zip(out_refs, block_cols):
            width = ref.shape[1]
            nblocks = pl.cdiv(width, cb)

            @pl.when(col_block < nblocks)
            def _():
                # Unclamped columns (16-byte vector loads and stores); a mask only when the
                # last column block overhangs the row.
                cols = col_block * cb + jnp.arange(cb, dtype=jnp.int32)  # [Cb]
                mask = tile_mask(move, cols, None if width % cb == 0 else cols < width)  # [R, Cb]
                # Read from the aliased output: on the GPU it is the same memory as the input,
                # and in interpret mode it holds every earlier program's writes.
                rows = plgpu.load(ref.at[src_row[:, None], cols[None, :]], mask=mask, other=0)  # [R, Cb]
                if not interpret:
                    # Every thread of the CTA has its sources in registers before any target is
                    # written (a target may be another thread's source).
                    plgpu.debug_barrier()
                plgpu.store(ref.at[dst_row[:, None], cols[None, :]], rows, mask=mask)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _kv_move_call(
    buffers: tuple[jax.Array, ...],  # each [L, N, C_i]
    src: jax.Array,  # i32[G, R]
    dst: jax.Array,  # i32[G, R]
    *,
    blocks: MoveBlocks,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # each [L, N, C_i], updated in place
    G, R = src.shape
    L, N = buffers[0].shape[:2]
    flat = tuple(b.reshape(L * N, b.shape[2]) for b in buffers)  # [L * N, C_i]: free reshapes
    col_blocks = max(pl.cdiv(b.shape[1], cb) for b, cb in zip(flat, blocks.block_cols))
    group = pl.BlockSpec((None, R), lambda g, l, c: (g, 0))
    nbuf = len(flat)
    out = pl.pallas_call(
        functools.partial(_kv_move_kernel, num_slots=N, block_cols=blocks.block_cols, interpret=interpret),
        grid=(G, L, col_blocks),
        in_specs=[group, group] + [whole(b) for b in flat],
        out_specs=tuple(whole(b) for b in flat),
        out_shape=tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in flat),
        input_output_aliases={2 + i: i for i in range(nbuf)},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="kv_move",
    )(src, dst, *flat)
    return tuple(o.reshape(b.shape) for o, b in zip(out, buffers))


def _group_moves(
    slots: jax.Array,  # i32[M]
    blocks: MoveBlocks,
    moves_per_request: int | None,
) -> jax.Array:  # i32[G, R], -1 padded
    M = slots.shape[0]
    R = blocks.group_rows
    if blocks.requests_per_group is None:
        return jnp.pad(slots, (0, R - M), constant_values=-1)[None, :]
    S, k = moves_per_request, blocks.requests_per_group
    B = M // S
    G = -(-B // k)
    per_req = jnp.pad(slots.reshape(B, S), ((0, G * k - B), (0, 0)), constant_values=-1)  # [G*k, S]
    return jnp.pad(per_req.reshape(G, k * S), ((0, 0), (0, R - k * S)), constant_values=-1)


def kv_move_pallas(
    buffers: tuple[jax.Array, ...],  # each [L, N, ...]
    src_slots: jax.Array,  # i32[M] (-1 = skip)
    dst_slots: jax.Array,  # i32[M] (-1 = skip)
    *,
    interpret: bool,
    moves_per_request: int | None = None,  # S: lets whole requests form separate programs
    blocks: MoveBlocks | None = None,
) -> tuple[jax.Array, ...]:
    """Pallas path of :func:`kv_move` (one launch for every buffer of the pool)."""
    buffers = tuple(buffers)
    M = src_slots.shape[0]
    if not buffers or buffers[0].shape[0] == 0 or M == 0:
        return buffers  # zero-layer pool or no moves: nothing to do
    if not isinstance(src_slots, jax.core.Tracer) and not isinstance(dst_slots, jax.core.Tracer):
        if not bool(jnp.any((src_slots >= 0) & (dst_slots >= 0))):
            return buffers  # all padding (known on the host)
    L, N = buffers[0].shape[:2]
    for b in buffers:
        if b.shape[:2] != (L, N):
            raise ValueError(f"every buffer must share [L, N] = {(L, N)}, got {b.shape}")
    flat = tuple(b.reshape(L, N, -1) for b in buffers)  # [L, N, C_i]
    if blocks is None:
        blocks = move_blocks(num_moves=M, moves_per_request=moves_per_request,
                             row_widths=tuple(f.shape[2] for f in flat),
                             **block_table.copy_overrides("kv_move", gpu=dispatch.gpu_kind(), interpret=interpret))
    src = _group_moves(src_slots.astype(jnp.int32), blocks, moves_per_request)
    dst = _group_moves(dst_slots.astype(jnp.int32), blocks, moves_per_request)
    out = _kv_move_call(flat, src, dst, blocks=blocks, interpret=interpret)
    return tuple(o.reshape(b.shape) for o, b in zip(out, buffers))


def kv_move(
    buffers: tuple[jax.Array, ...],
    src_slots: jax.Array,
    dst_slots: jax.Array,
    *,
    implementation: str | None = None,
    check_bounds: bool = False,
    moves_per_request: int | None = None,
) -> tuple[jax.Array, ...]:
    """Copies rows ``src_slots -> dst_slots`` in every buffer, all layers (see module doc).

    ``check_bounds=True`` adds :func:`validate_moves` (checkify) before the move.
    ``moves_per_request`` (S, optional) lets the kernel give each group of whole requests
    its own programs; without it all moves share one program per (layer, column block).
    """
    buffers = tuple(buffers)
    if check_bounds and buffers and buffers[0].shape[0] > 0:
        validate_moves(src_slots, dst_slots, buffers[0].shape[1])
    if dispatch.choose("kv_move", implementation, shape_class="kv_move") == "pallas":
        return kv_move_pallas(buffers, src_slots, dst_slots, interpret=dispatch.interpret_mode(),
                              moves_per_request=moves_per_request)
    return kv_move_reference(buffers, src_slots, dst_slots)


def kv_move_checked(
    buffers: tuple[jax.Array, ...],
    src_slots: jax.Array,
    dst_slots: jax.Array,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, ...]:
    """:func:`kv_move` under ``jax.jit`` with the bounds check functionalized by checkify:
    raises ``JaxRuntimeError`` naming the first bad move instead of corrupting the pool."""
    err, out = _checked_kv_move(normalize_implementation(implementation))(tuple(buffers), src_slots, dst_slots)
    err.throw()
    return out


@functools.cache
def _checked_kv_move(implementation: str | None):
    return checkify.checkify(jax.jit(functools.partial(kv_move, implementation=implementation, check_bounds=True)))
