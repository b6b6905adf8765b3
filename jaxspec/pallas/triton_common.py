"""Helpers shared by the Pallas (Triton backend) kernels.

All kernels here see their operands whole (one block = the full array) and index them with
explicit integer tensors: paged KV is a gather by construction, masked rows and columns are
common, and Triton lowers an integer-tensor index to the same pointer arithmetic it would
use for a block. Conventions:

* the contiguous (last) index of a tile is a plain ``arange``, never clamped: a clamp such as
  ``jnp.where(ok, d, 0)`` hides the contiguity Triton needs for 16-byte vector loads and
  ``cp.async`` (every element becomes a scalar load and ``num_stages`` does nothing). When a
  tile spans the row exactly it has no column mask at all; otherwise masked columns past the
  row are never touched on the GPU, and in interpret mode they fall outside the 2-D ref
  (loads clamp and then mask; stores drop them);
* gathered row indices are clamped in range for loads; stores send masked rows to an
  out-of-range row as well as masking them, so interpret mode (which scatters, dropping
  out-of-range indices) never writes them either;
* every tile edge is a power of two (Triton); block sizes come from ``block_sizes``.

The second half is the body both attention kernels share (paged MHA and MLA): rows of the
folded (query row, head) axis per program, page-table lookups, the prefix and block loops
with split-KV, the online softmax and the output store.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# JAX imports its Pallas interpreters lazily, on the first interpret-mode lowering, and that
# import registers a config option (through ``pallas.fuser``). The changed tracing context
# makes the first program traced before it miss the jit cache and compile a second time.
# Importing it up front keeps the context stable.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401


def whole(x: jax.ShapeDtypeStruct | jax.Array) -> pl.BlockSpec:
    """A BlockSpec giving every program the whole array (any grid rank)."""
    ndim = len(x.shape)
    return pl.BlockSpec(x.shape, lambda *_: (0,) * ndim)


def split_out_shapes(num_splits: int, rows: int, width: int, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Outputs of an attention kernel over ``rows`` query rows of ``width``: the result itself,
    or, with the KV split over ``num_splits`` programs, each split's unnormalized output, its
    running max and its softmax denominator (f32), merged by :func:`merge_splits`."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct((rows, width), dtype),)
    return (
        jax.ShapeDtypeStruct((num_splits * rows, width), jnp.float32),  # unnormalized partial outputs
        jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),  # running max
        jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),  # softmax denominator
    )


def merge_splits(out: tuple[jax.Array, ...], shape: tuple[int, ...], dtype) -> jax.Array:
    """Flash-decoding merge: rescales each split to the common max and normalizes.
    ``shape`` is the output shape [..., width]; ``out`` comes from ``split_out_shapes``.

    The splits are combined one by one (a left-to-right chain of elementwise ops over S, a small
    static count) rather than with reductions over the split axis: XLA fuses the whole merge into
    one loop kernel that way, where the max and the sums as reductions cost two launches a layer
    on a GPU."""
    if len(out) == 1:
        return out[0].reshape(shape)
    rows = shape[:-1]
    o_part = out[0].reshape((-1,) + tuple(shape))  # [S, ..., width]
    m_part, l_part = (x.reshape((-1,) + tuple(rows)) for x in out[1:])
    S = o_part.shape[0]
    m_all = functools.reduce(jnp.maximum, [m_part[s] for s in range(S)])
    scale = [jnp.exp(m_part[s] - m_all) for s in range(S)]
    l_all = functools.reduce(jnp.add, [scale[s] * l_part[s] for s in range(S)])
    o = functools.reduce(jnp.add, [scale[s][..., None] * o_part[s] for s in range(S)])
    return (o / jnp.where(l_all > 0, l_all, 1.0)[..., None]).astype(dtype)


def columns(width: int, pad: int) -> tuple[jax.Array, jax.Array | None]:
    """Column indices ``i32[pad]`` of a tile over a row of ``width`` elements and their mask
    (``None`` when the tile spans the row exactly: no mask, full contiguity)."""
    cols = jnp.arange(pad, dtype=jnp.int32)
    return cols, (None if pad == width else cols < width)


def tile_mask(rows_ok: jax.Array, cols: jax.Array, cols_ok: jax.Array | None) -> jax.Array:
    """bool[r, c] from a row mask ``bool[r]`` and an optional column mask ``bool[c]``."""
    if cols_ok is None:
        return jnp.broadcast_to(rows_ok[:, None], (rows_ok.shape[0], cols.shape[0]))
    return rows_ok[:, None] & cols_ok[None, :]


# --------------------------------------------------------------------------- attention body

MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """Static shape of one paged-attention launch (MHA, or MLA as MQA with ``group = Hq``).

    Programs own ``block_m`` rows of the folded (T, group) axis of one request and one KV
    head: row m is query row ``m // group`` of q head ``kv_head * group + m % group``.
    """

    batch: int  # B
    rows: int  # T
    q_heads: int  # Hq
    group: int  # q heads per KV head (Hq for MLA)
    page_size: int  # P
    table_width: int  # W
    num_slots: int  # N
    block_width: int  # Wb: positions of the block after the prefix
    causal: bool  # block visibility w <= t (no block mask)
    block_m: int
    block_k: int
    block_w: int
    kv_splits: int

    @property
    def out_rows(self) -> int:  # B * T * Hq
        return self.batch * self.rows * self.q_heads


@dataclasses.dataclass(frozen=True)
class ProgramRows:
    """The query rows of one program (all ``i32[bm]`` / ``bool[bm]``)."""

    t: jax.Array  # query row (may be >= T on the last row block)
    t_in: jax.Array  # t clamped in range (for loads)
    ok: jax.Array  # t < T
    q_row: jax.Array  # row of the flat [B * T * Hq, width] q / o arrays


def program_rows(g: AttentionGeometry, b, kv_head, row_block) -> ProgramRows:
    m = row_block * g.block_m + jnp.arange(g.block_m, dtype=jnp.int32)  # folded rows
    t = jax.lax.div(m, g.group)
    head = kv_head * g.group + jax.lax.rem(m, g.group)
    ok = t < g.rows
    t_in = jnp.where(ok, t, 0)
    return ProgramRows(t=t, t_in=t_in, ok=ok, q_row=(b * g.rows + t_in) * g.q_heads + head)


def kv_slots(g: AttentionGeometry, table_ref, b, pos: jax.Array) -> jax.Array:  # i32[bk] -> i32[bk]
    """Pool slots of request ``b``'s positions through its page table (clamped in range)."""
    P, W = g.page_size, g.table_width
    page = table_ref[b * W + jnp.minimum(jax.lax.div(pos, P), W - 1)]  # [bk]
    return jnp.clip(page * P + jax.lax.rem(pos, P), 0, g.num_slots - 1)


# carry = (acc f32[bm, Dv], running max f32[bm], softmax denominator f32[bm])
Carry = tuple[jax.Array, jax.Array, jax.Array]


def init_carry(block_m: int, width: int) -> Carry:
    return (jnp.zeros((block_m, width), jnp.float32), jnp.full((block_m,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))


def online_softmax_step(
    carry: Carry,
    s: jax.Array,  # f32[bm, bk] scaled scores
    allowed: jax.Array,  # bool[bm, bk]
    weighted_values: Callable[[jax.Array], jax.Array],  # p f32[bm, bk] -> f32[bm, Dv] (p @ V)
) -> Carry:
    """One KV tile of the online softmax (f32): rescale what was accumulated to the new row
    max, add this tile's weights. Positions a row may not see weigh exactly 0."""
    acc, m_i, l_i = carry
    s = jnp.where(allowed, s, MASK_VALUE)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))  # [bm]
    alpha = jnp.exp(m_i - m_new)  # [bm]
    p = jnp.where(allowed, jnp.exp(s - m_new[:, None]), 0.0)  # [bm, bk]
    l_new = alpha * l_i + jnp.sum(p, axis=1)
    return acc * alpha[:, None] + weighted_values(p), m_new, l_new


# attend(carry, pos i32[bk], load_ok bool[bk], allowed bool[bm, bk]) -> carry: loads the K/V
# of the positions some row sees (load_ok) and runs one online-softmax step.
Attend = Callable[[Carry, jax.Array, jax.Array, jax.Array], Carry]


def stream_kv(
    g: AttentionGeometry,
    attend: Attend,
    carry: Carry,
    rows: ProgramRows,
    *,
    mask_ref,  # i8[B * T * Wb] block mask, or None (causal)
    b,
    row_block,
    split,
    prefix_ref,  # i32[B] committed prefix lengths
) -> Carry:
    """Streams the prefix [0, prefix) in block_k tiles (visible to every row; dealt out among
    the kv_splits programs), then the block [prefix, prefix + Wb) in block_w tiles, masked
    per row (handled by the last split), skipping tiles no row of the program sees."""
    bm, bk, bw, S = g.block_m, g.block_k, g.block_w, g.kv_splits
    max_len = g.table_width * g.page_size  # positions the page table can address
    prefix = jnp.minimum(prefix_ref[b], max_len)

    def prefix_step(j, carry):
        pos = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        ok = pos < prefix  # only the last tile is partial
        return attend(carry, pos, ok, jnp.broadcast_to(ok[None, :], (bm, bk)))

    n_prefix = pl.cdiv(prefix, bk)
    if S == 1:
        lo, hi = 0, n_prefix
    else:
        per_split = pl.cdiv(n_prefix, S)
        lo = split * per_split
        hi = jnp.minimum(lo + per_split, n_prefix)
    carry = jax.lax.fori_loop(lo, hi, prefix_step, carry)

    def block_step(j, carry):
        w = j * bw + jnp.arange(bw, dtype=jnp.int32)  # [bw] block offsets
        pos = prefix + w
        w_ok = (w < g.block_width) & (pos < max_len)
        if g.causal:
            vis = w[None, :] <= rows.t[:, None]  # [bm, bw]
        else:  # w unclamped: contiguous mask bytes (masked ones are not read)
            mask_idx = (b * g.rows + rows.t_in[:, None]) * g.block_width + w[None, :]
            vis = plgpu.load(mask_ref.at[mask_idx], mask=rows.ok[:, None] & w_ok[None, :], other=0) != 0
        allowed = vis & w_ok[None, :]  # [bm, bw]
        seen = jnp.max(allowed.astype(jnp.int32), axis=0) > 0  # [bw] some row sees it
        return attend(carry, pos, seen, allowed)

    if g.causal:  # rows of this program see block offsets <= their largest t
        t_hi = jnp.minimum(g.rows - 1, jax.lax.div(row_block * bm + bm - 1, g.group))
        n_block = pl.cdiv(t_hi + 1, bw)
    else:
        n_block = pl.cdiv(g.block_width, bw)
    if S > 1:
        # Both branches explicitly int32: with two weak-typed Python ints, the Triton lowering
        # of select_n types its constants like the predicate (i1), and the loop bound becomes
        # i1 ('scf.for' op failed to verify: a GPU crash that interpret mode never sees).
        n_block = jnp.where(split == S - 1, jnp.asarray(n_block, jnp.int32), jnp.int32(0))
    return jax.lax.fori_loop(0, n_block, block_step, carry)


def store_attention(
    g: AttentionGeometry,
    out_refs,  # (o [B*T*Hq, Dv],) or (o f32[S*B*T*Hq, Dv], m f32[S*B*T*Hq], l f32[S*B*T*Hq])
    carry: Carry,
    rows: ProgramRows,
    cols: jax.Array,  # i32[Dvp]
    cols_ok: jax.Array | None,
    split,
) -> None:
    """Normalized output (one split), or the split's partial output, max and denominator."""
    acc, m_i, l_i = carry
    mask = tile_mask(rows.ok, cols, cols_ok)
    if g.kv_splits == 1:
        (o_ref,) = out_refs
        row = jnp.where(rows.ok, rows.q_row, g.out_rows)  # masked rows: out of range, never written
        o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]  # rows that see nothing: 0
        plgpu.store(o_ref.at[row[:, None], cols[None, :]], o.astype(o_ref.dtype), mask=mask)
    else:
        o_ref, m_ref, l_ref = out_refs
        row = jnp.where(rows.ok, split * g.out_rows + rows.q_row, g.kv_splits * g.out_rows)
        plgpu.store(o_ref.at[row[:, None], cols[None, :]], acc, mask=mask)
        plgpu.store(m_ref.at[row], m_i, mask=rows.ok)
        plgpu.store(l_ref.at[row], l_i, mask=rows.ok)
