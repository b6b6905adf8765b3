"""Fused gather of the speculative "extras" by one index vector
(docs/architecture.md#one-gather-for-the-next-seed).

After draft extend, each request's next draft seed lives in row ``accept_len - 1`` of its
block: the next root token and the draft's hidden state (and whatever else a draft carries).
One op gathers the rows of all of them with a single index vector instead of one gather each.

Pallas kernel (Triton): one ``pallas_call`` (one launch) with grid ``(row blocks, column
blocks)``. Every array is seen as ``[N, C_i]`` (a 1-D array as one column); the program of
column block ``c`` gathers columns ``[c * Cb_i, (c + 1) * Cb_i)`` of its rows of every array
that has them. Row indices are clamped to ``[0, N)`` (the rows the engine asks for are in
range); column indices are never clamped (see ``triton_common``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.block_sizes import GatherBlocks, gather_blocks
from jaxspec.pallas.triton_common import tile_mask, whole


def gather_spec_extras_reference(
    index: jax.Array,  # i32[R] rows to take
    *arrays: jax.Array | None,  # each [N, ...] or None
) -> tuple[jax.Array | None, ...]:  # each [R, ...] or None
    return tuple(None if x is None else x[index] for x in arrays)


def _gather_kernel(
    index_ref,  # i32[R]
    *refs,  # inputs [N, C_i] then outputs [R, C_i]
    block_rows: int,
    block_cols: tuple[int, ...],  # Cb_i per array
):
    n = len(block_cols)
    in_refs, out_refs = refs[:n], refs[n:]
    R = index_ref.shape[0]
    r = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [br]
    row_ok = r < R
    src = plgpu.load(index_ref.at[jnp.where(row_ok, r, 0)], mask=row_ok, other=0)  # [br]
    src = jnp.clip(src, 0, in_refs[0].shape[0] - 1)
    r_store = jnp.where(row_ok, r, R)  # masked rows: out of range, never written
    col_block = pl.program_id(1)
    for x_ref, o_ref, cb in zip(in_refs, out_refs, block_cols):
        width = x_ref.shape[1]

        @pl.when(col_block < pl.cdiv(width, cb))
        def _():
            # Unclamped columns (vector loads and stores); masked only when a block overhangs the row.
            c = col_block * cb + jnp.arange(cb, dtype=jnp.int32)  # [Cb]
            m2 = tile_mask(row_ok, c, None if width % cb == 0 else c < width)  # [br, Cb]
            x = plgpu.load(x_ref.at[src[:, None], c[None, :]], mask=m2, other=0)  # [br, Cb]
            plgpu.store(o_ref.at[r_store[:, None], c[None, :]], x, mask=m2)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _gather_call(index, arrays, *, blocks: GatherBlocks, interpret: bool):
    R = index.shape[0]
    flat = tuple(x.reshape(x.shape[0], -1) for x in arrays)  # [N, C_i]
    col_blocks = max(pl.cdiv(f.shape[1], cb) for f, cb in zip(flat, blocks.block_cols))
    out_shape = tuple(jax.ShapeDtypeStruct((R, f.shape[1]), f.dtype) for f in flat)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, block_rows=blocks.block_rows, block_cols=blocks.block_cols),
        grid=(pl.cdiv(R, blocks.block_rows), col_blocks),
        in_specs=[whole(index)] + [whole(f) for f in flat],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="gather_spec_extras",
    )(index, *flat)
    return tuple(o.reshape((R,) + x.shape[1:]) for o, x in zip(out, arrays))


def gather_spec_extras_pallas(
    index: jax.Array,  # i32[R]
    *arrays: jax.Array | None,  # each [N, ...] or None
    interpret: bool,
    blocks: GatherBlocks | None = None,
) -> tuple[jax.Array | None, ...]:  # each [R, ...] or None
    """Pallas path of :func:`gather_spec_extras`: one launch for every array."""
    present = [x for x in arrays if x is not None]
    R = index.shape[0]
    if R == 0 or not present:
        return gather_spec_extras_reference(index, *arrays)
    if blocks is None:
        blocks = gather_blocks(num_rows=R, widths=tuple(int(x.size // x.shape[0]) for x in present),
                               **block_table.copy_overrides("gather_spec_extras", gpu=dispatch.gpu_kind(),
                                                            interpret=interpret))
    got = iter(_gather_call(index.astype(jnp.int32), tuple(present), blocks=blocks, interpret=interpret))
    return tuple(None if x is None else next(got) for x in arrays)


def gather_spec_extras(index: jax.Array, *arrays: jax.Array | None, implementation=None):
    """Rows ``index`` of every array (each ``[N, ...]``; None stays None), in one launch."""
    if dispatch.choose("gather_spec_extras", implementation, shape_class="gather_spec_extras") == "pallas":
        return gather_spec_extras_pallas(index, *arrays, interpret=dispatch.interpret_mode())
    return gather_spec_extras_reference(index, *arrays)
