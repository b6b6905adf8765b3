"""Grouped matrix products for an MoE block's routed experts: rows sorted by expert, each group of
rows multiplied by its own expert's weight, every expert's weight tile read once per row tile.

Glossary: M rows (the (token, expert) assignments, sorted by expert), E groups (experts), K the
reduction width, N the output width, bm rows per tile, T tiles.

Why. ``jax.lax.ragged_dot`` is what the XLA path runs, and XLA lowers it densely: each row is
spread over all E experts' blocks and one product reads every expert's weight, doing E times the
FLOPs the rows need. At a verify of a DeepSeek-V4-Flash-like target (16 requests x 8 rows x 6
experts = 768 assignments over 256 experts) that is the whole expert bank read and multiplied by
every row, in every MoE layer.

Layout (``group_tiles``). Each group's rows are padded to a multiple of ``bm``, so every tile of
``bm`` rows belongs to one group: ``tile_group[t]`` is tile t's expert (E past the used tiles).
``T = cdiv(M + min(E, M) * (bm - 1), bm)`` tiles hold any split of M rows into E groups (each
non-empty group pads at most ``bm - 1`` rows). Rows past the groups' total (an assignment to
another shard's expert) are in no tile, as ``ragged_dot`` leaves them zero. The rows are gathered
into the tiled layout once per MoE block: the gated product writes its result in that layout, the
down product reads it as it lies, and the tiled rows are scattered back to their tokens once.

Kernels (Triton), one body for both products: grid ``(T, N / bn)``; the program of tile t and
column block j reads ``e = tile_group[t]`` and walks K in ``bk`` steps, multiplying the tile's
``[bm, bk]`` rows by ``w[layer, e, k : k + bk, j * bn : (j + 1) * bn]``. The weights are the
model's stacked ``[L, E, K, N]`` array, indexed inside the kernel by the layer and the expert's
first row: a layer's slice handed to a custom call would first be copied into a buffer of its own
(every expert's weights, every layer: 1.6 GB a layer at the GPU check's DeepSeek-V4 shape), where a
product XLA runs reads its slice in place. An unused tile writes zeros and reads nothing.
The gated product keeps two accumulators (gate and up), rounds them to the rows' dtype and writes
``activation(gate) * up`` (``gated_epilogue``; the activation in float32, rounded once). K and N
must have power-of-two divisors of at least 16 (``tl.dot``); the weights are never padded, since a
padded copy of the expert bank would cost more than the product.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import GroupedBlocks, grouped_blocks
from jaxspec.pallas.triton_common import whole


class GroupTiles(NamedTuple):
    """Where the rows of a grouped product sit when every tile holds one group (module docstring).

    ``T * bm`` tiled rows; ``bm`` is ``source.shape[0] // tile_group.shape[0]``."""

    source: jax.Array  # i32[T * bm] the row each tiled row holds; M for a padding row
    dest: jax.Array  # i32[M] the tiled row each row sits at; T * bm for a row in no group
    tile_group: jax.Array  # i32[T] each tile's group; E for an unused tile


def tiles_needed(rows: int, groups: int, block_m: int) -> int:
    """Tiles of ``block_m`` rows that hold any split of ``rows`` rows into ``groups`` groups, each
    padded to whole tiles."""
    return max(1, -(-(rows + min(groups, rows) * (block_m - 1)) // block_m))


def group_tiles(group_sizes: jax.Array, rows: int, block_m: int) -> GroupTiles:  # group_sizes i32[E]
    """The tiled layout of ``rows`` rows sorted by group, ``group_sizes[g]`` rows in group g (their
    sum at most ``rows``; the rows past it belong to no group)."""
    E = group_sizes.shape[0]
    T = tiles_needed(rows, E, block_m)
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + block_m - 1) // block_m * block_m
    end = jnp.cumsum(sizes)
    start = end - sizes
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    q = jnp.arange(T * block_m, dtype=jnp.int32)
    # compare_all: one fusion (the default method is a loop of small kernels on a GPU)
    g = jnp.searchsorted(padded_end, q, side="right", method="compare_all").astype(jnp.int32)  # [T*bm]; E: unused
    gc = jnp.minimum(g, E - 1)
    j = q - padded_start[gc]  # the row's index within its group
    held = (g < E) & (j < sizes[gc])
    source = jnp.where(held, start[gc] + j, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    rg = jnp.searchsorted(end, r, side="right", method="compare_all").astype(jnp.int32)  # [M], E past the total
    rgc = jnp.minimum(rg, E - 1)
    dest = jnp.where(rg < E, padded_start[rgc] + r - start[rgc], T * block_m)
    return GroupTiles(source=source, dest=dest, tile_group=g[::block_m])


def grouped_unsupported(k: int, n: int) -> str | None:
    """Why the kernel cannot take a ``[K, N]`` weight per group, or None."""
    if grouped_blocks(rows=1, groups=1, k=k, n=n) is None:
        return f"a [{k}, {n}] expert weight needs power-of-two divisors >= 16 of both widths"
    return None


# ------------------------------------------------------------------------------------ references


def _row_groups(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:  # i32[M], bool[M]
    g = jnp.searchsorted(jnp.cumsum(group_sizes.astype(jnp.int32)), jnp.arange(rows), side="right")
    return jnp.minimum(g, group_sizes.shape[0] - 1), g < group_sizes.shape[0]


def grouped_matmul_reference(
    x: jax.Array,  # [M, K] rows sorted by group
    w: jax.Array,  # [E, K, N]
    group_sizes: jax.Array,  # i32[E]
) -> jax.Array:  # [M, N] x's dtype
    """Pure-jnp oracle (``ragged_dot``'s function): row r times its group's weight, accumulated in
    float32; rows past the groups' total are zeros."""
    g, held = _row_groups(group_sizes, x.shape[0])
    out = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), w[g].astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return jnp.where(held[:, None], out, 0.0).astype(x.dtype)


def gated_epilogue(g: jax.Array, u: jax.Array, activation: Callable, limit: float | None,
                   upcast: bool = False) -> jax.Array:
    """``activation(g) * u`` from the two products' results, in their dtype; ``limit`` clamps g from
    above and u to [-limit, limit] first (DeepSeek-V4's ``swiglu_limit``). ``upcast``: the
    activation evaluated in float32 and rounded once (the kernel's way: Triton has no bf16
    division), where XLA rounds after each of its elementwise ops."""
    if limit is not None:
        g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    a = activation(g.astype(jnp.float32)).astype(g.dtype) if upcast else activation(g)
    return a * u


def grouped_gated_reference(x, w_gate, w_up, group_sizes, *, activation: Callable = jax.nn.silu,
                            limit: float | None = None) -> jax.Array:  # [M, K] -> [M, N]
    """Pure-jnp oracle of the gated product: ``activation(x @ w_gate[g]) * (x @ w_up[g])`` per row,
    rounded as the kernel rounds."""
    return gated_epilogue(grouped_matmul_reference(x, w_gate, group_sizes),
                          grouped_matmul_reference(x, w_up, group_sizes), activation, limit, upcast=True)


# ------------------------------------------------------------------------------------ kernel


def _grouped_kernel(layer_ref, tile_group_ref, x_ref, *refs, groups: int, k: int, bk: int, gated: bool,
                    activation: Callable | None, limit: float | None):
    # layer_ref i32[1]; tile_group_ref i32[T]; x_ref [bm, K] (this tile's rows); w refs [L * E * K, N]
    # whole; o_ref [bm, bn]
    *w_refs, o_ref = refs
    bm, bn = o_ref.shape
    t, j = pl.program_id(0), pl.program_id(1)
    e = tile_group_ref[t]

    @pl.when(e < groups)
    def _():
        first = (layer_ref[0] * groups + e) * k  # the expert's first row of the flattened stacked weights
        cols = pl.ds(j * bn, bn)

        def step(i, accs):
            xs = x_ref[:, pl.ds(i * bk, bk)]  # [bm, bk]
            return tuple(acc + jnp.dot(xs, w_ref[pl.ds(first + i * bk, bk), cols],
                                       preferred_element_type=jnp.float32,
                                       precision=jax.lax.Precision.HIGHEST)
                         for acc, w_ref in zip(accs, w_refs))

        accs = jax.lax.fori_loop(0, k // bk, step, tuple(jnp.zeros((bm, bn), jnp.float32) for _ in w_refs))
        if gated:
            g, u = (acc.astype(o_ref.dtype) for acc in accs)
            o_ref[...] = gated_epilogue(g, u, activation, limit, upcast=True)
        else:
            o_ref[...] = accs[0].astype(o_ref.dtype)

    @pl.when(e >= groups)
    def _():
        o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "activation", "limit", "interpret"))
def _grouped_call(xt, tile_group, weights, layer, *, blocks: GroupedBlocks, activation, limit, interpret: bool):
    TM, K = xt.shape
    L, E, _, N = weights[0].shape
    bm, bn = blocks.block_m, blocks.block_n
    flat = tuple(w.astype(xt.dtype).reshape(L * E * K, N) for w in weights)  # a bitcast: read where they lie
    return pl.pallas_call(
        functools.partial(_grouped_kernel, groups=E, k=K, bk=blocks.block_k, gated=len(weights) == 2,
                          activation=activation, limit=limit),
        grid=(TM // bm, N // bn),
        in_specs=[whole(layer), whole(tile_group), pl.BlockSpec((bm, K), lambda t, j: (t, 0))]
        + [whole(w) for w in flat],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((TM, N), xt.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="grouped_gated_matmul" if len(weights) == 2 else "grouped_matmul",
    )(layer, tile_group, xt, *flat)


def grouped_matmul_tiled_pallas(
    xt: jax.Array,  # [T * bm, K] rows in the tiled layout (padding rows zeros)
    tile_group: jax.Array,  # i32[T] (GroupTiles.tile_group)
    w: jax.Array,  # [E, K, N], or [L, E, K, N] with ``layer``
    *,
    interpret: bool,
    w_up: jax.Array | None = None,  # w's shape: the gated product
    layer: jax.Array | None = None,  # i32[]: w and w_up are stacked per layer, this one's are used
    activation: Callable = jax.nn.silu,
    limit: float | None = None,
    blocks: GroupedBlocks | None = None,
) -> jax.Array:  # [T * bm, N] in the tiled layout
    """Pallas path, in the tiled layout: ``xt @ w[tile_group]`` tile by tile, or with ``w_up``
    ``activation(xt @ w) * (xt @ w_up)`` (``gated_epilogue``); with ``layer``, ``w[layer]`` read in
    place. ``blocks``: their ``block_m`` must be the layout's; default: the heuristic's tiles for
    that ``block_m``."""
    if layer is None:
        w, w_up = w[None], None if w_up is None else w_up[None]
        layer = jnp.zeros((), jnp.int32)
    TM, K = xt.shape
    _, E, Kw, N = w.shape
    bm = TM // tile_group.shape[0]
    if Kw != K or (w_up is not None and w_up.shape != w.shape):
        raise ValueError(f"rows [.., {K}] and weights {w.shape}" + ("" if w_up is None else f", {w_up.shape}")
                         + " do not match")
    if blocks is None:
        blocks = grouped_blocks(rows=TM, groups=E, k=K, n=N, block_m=bm)
        if blocks is None:
            raise NotImplementedError(f"grouped_matmul: {grouped_unsupported(K, N)}")
    if blocks.block_m != bm or K % blocks.block_k or N % blocks.block_n:
        raise ValueError(f"{blocks} do not tile rows of {bm}-row tiles, K={K}, N={N}")
    weights = (w,) if w_up is None else (w, w_up)
    return _grouped_call(xt, tile_group.astype(jnp.int32), weights, jnp.asarray(layer, jnp.int32).reshape(1),
                         blocks=blocks, activation=activation if w_up is not None else None, limit=limit,
                         interpret=interpret)


def grouped_matmul(
    x: jax.Array,  # [M, K] rows sorted by group
    w: jax.Array,  # [E, K, N]
    group_sizes: jax.Array,  # i32[E]
    *,
    implementation=None,
) -> jax.Array:  # [M, N]
    """``jax.lax.ragged_dot(x, w, group_sizes)``: the kernel on a GPU (through the tiled layout,
    there and back), ``ragged_dot`` on XLA (``jaxspec.pallas.dispatch``)."""
    M, K = x.shape
    E, _, N = w.shape
    choice = dispatch.choose("grouped_matmul", implementation, shape_class="grouped_matmul",
                             unsupported=grouped_unsupported(K, N))
    if choice == "xla":
        return jax.lax.ragged_dot(x, w, group_sizes)
    bm = grouped_blocks(rows=M, groups=E, k=K, n=N).block_m
    tiles = group_tiles(group_sizes, M, bm)
    xt = jnp.concatenate([x, jnp.zeros((1, K), x.dtype)])[tiles.source]  # [T * bm, K]
    yt = grouped_matmul_tiled_pallas(xt, tiles.tile_group, w, interpret=dispatch.interpret_mode())
    return jnp.concatenate([yt, jnp.zeros((1, N), yt.dtype)])[tiles.dest]
