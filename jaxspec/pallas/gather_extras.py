"""Fused gather of the speculative "extras" by one index vector (seed 002).

After draft-extend, each request's next draft seed lives in row ``accept_len - 1`` of its
block: ``topk_p``, ``topk_index``, the next token and (for feature-level drafts) the hidden
state. One op gathers all four with a single index vector instead of four gathers.

Pallas kernel (Triton): one ``pallas_call`` (one launch) with grid
``(row blocks, hidden column blocks)``. Every program gathers its rows' hidden columns; the
programs of the first column block also gather ``topk_p``, ``topk_index`` and the token.
Row indices are clamped to ``[0, N)`` (the rows the engine asks for are always in range);
column indices are never clamped (see ``triton_common``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.triton_common import columns, tile_mask, whole
from jaxspec.pallas.block_sizes import GatherBlocks, gather_blocks, next_pow2


def gather_spec_extras_reference(
    index: jax.Array,  # i32[R] rows to take
    topk_p: jax.Array,  # f32[N, K]
    topk_index: jax.Array,  # i32[N, K]
    tokens: jax.Array,  # i32[N]
    hidden: jax.Array | None,  # [N, Hd] | None
):  # -> (f32[R, K], i32[R, K], i32[R], [R, Hd] | None)
    take = lambda x: None if x is None else x[index]  # noqa: E731
    return take(topk_p), take(topk_index), take(tokens), take(hidden)


def _gather_kernel(
    index_ref,  # i32[R]
    topk_p_ref,  # f32[N, K]
    topk_index_ref,  # i32[N, K]
    tokens_ref,  # i32[N]
    *refs,  # [hidden_ref [N, Hd]], then outputs: p [R, K], idx [R, K], tok [R], [hid [R, Hd]]
    block_rows: int,
    block_hidden: int,
    has_hidden: bool,
):
    if has_hidden:
        hidden_ref, p_out, i_out, t_out, h_out = refs
    else:
        hidden_ref = h_out = None
        p_out, i_out, t_out = refs
    R = index_ref.shape[0]
    N, K = topk_p_ref.shape
    r = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [br]
    row_ok = r < R
    src = plgpu.load(index_ref.at[jnp.where(row_ok, r, 0)], mask=row_ok, other=0)  # [br]
    src = jnp.clip(src, 0, N - 1)
    r_store = jnp.where(row_ok, r, R)  # masked rows: out of range, never written

    @pl.when(pl.program_id(1) == 0)
    def _():
        k, k_ok = columns(K, next_pow2(K))  # [Kp]
        m2 = tile_mask(row_ok, k, k_ok)  # [br, Kp]
        p = plgpu.load(topk_p_ref.at[src[:, None], k[None, :]], mask=m2, other=0)  # [br, Kp]
        plgpu.store(p_out.at[r_store[:, None], k[None, :]], p, mask=m2)
        ix = plgpu.load(topk_index_ref.at[src[:, None], k[None, :]], mask=m2, other=0)  # [br, Kp]
        plgpu.store(i_out.at[r_store[:, None], k[None, :]], ix, mask=m2)
        tok = plgpu.load(tokens_ref.at[src], mask=row_ok, other=0)  # [br]
        plgpu.store(t_out.at[r_store], tok, mask=row_ok)

    if has_hidden:
        Hd = hidden_ref.shape[1]
        # Unclamped columns (vector loads and stores); masked only when a block overhangs the row.
        c = pl.program_id(1) * block_hidden + jnp.arange(block_hidden, dtype=jnp.int32)  # [bh]
        m2 = tile_mask(row_ok, c, None if Hd % block_hidden == 0 else c < Hd)  # [br, bh]
        h = plgpu.load(hidden_ref.at[src[:, None], c[None, :]], mask=m2, other=0)  # [br, bh]
        plgpu.store(h_out.at[r_store[:, None], c[None, :]], h, mask=m2)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def _gather_call(index, topk_p, topk_index, tokens, hidden, *, blocks: GatherBlocks, interpret: bool):
    R = index.shape[0]
    has_hidden = hidden is not None
    col_blocks = pl.cdiv(hidden.shape[1], blocks.block_hidden) if has_hidden else 1
    ins = (index, topk_p, topk_index, tokens) + ((hidden,) if has_hidden else ())
    out_shape = (
        jax.ShapeDtypeStruct((R, topk_p.shape[1]), topk_p.dtype),
        jax.ShapeDtypeStruct((R, topk_index.shape[1]), topk_index.dtype),
        jax.ShapeDtypeStruct((R,), tokens.dtype),
    ) + ((jax.ShapeDtypeStruct((R, hidden.shape[1]), hidden.dtype),) if has_hidden else ())
    out = pl.pallas_call(
        functools.partial(_gather_kernel, block_rows=blocks.block_rows, block_hidden=blocks.block_hidden,
                          has_hidden=has_hidden),
        grid=(pl.cdiv(R, blocks.block_rows), col_blocks),
        in_specs=[whole(x) for x in ins],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name="gather_spec_extras",
    )(*ins)
    return tuple(out) if has_hidden else (*out, None)


def gather_spec_extras_pallas(
    index: jax.Array,  # i32[R]
    topk_p: jax.Array,  # f32[N, K]
    topk_index: jax.Array,  # i32[N, K]
    tokens: jax.Array,  # i32[N]
    hidden: jax.Array | None,  # [N, Hd] | None
    *,
    interpret: bool,
    blocks: GatherBlocks | None = None,
):  # -> (f32[R, K], i32[R, K], i32[R], [R, Hd] | None)
    """Pallas path of :func:`gather_spec_extras`: one launch for all four arrays."""
    R = index.shape[0]
    if R == 0:
        return gather_spec_extras_reference(index, topk_p, topk_index, tokens, hidden)
    if blocks is None:
        blocks = gather_blocks(num_rows=R, hidden_width=0 if hidden is None else hidden.shape[1],
                               **block_table.copy_overrides("gather_spec_extras", gpu=dispatch.gpu_kind(),
                                                            interpret=interpret))
    return _gather_call(index.astype(jnp.int32), topk_p, topk_index, tokens, hidden,
                        blocks=blocks, interpret=interpret)


def gather_spec_extras(index, topk_p, topk_index, tokens, hidden=None, *, implementation=None):
    """Rows ``index`` of (topk_p, topk_index, tokens, hidden); ``hidden`` may be None."""
    if dispatch.choose("gather_spec_extras", implementation, shape_class="gather_spec_extras") == "pallas":
        return gather_spec_extras_pallas(index, topk_p, topk_index, tokens, hidden, interpret=dispatch.interpret_mode())
    return gather_spec_extras_reference(index, topk_p, topk_index, tokens, hidden)
