"""DeepSeek-V3.2 lightning indexer: scores of every visible position, top-k per query row.

Glossary: B requests, T query rows per request, Hi indexer heads, Di indexer head width,
L layers, N pool slots, W page-table width, P page size, K = W * P positions the page table
covers, k = ``topk``.

Per query row t and position j (HF ``DeepseekV32Indexer``, without the Hadamard rotation
and FP8 rounding of DeepSeek's kernel, which leave exact scores unchanged):

    score[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])                     # f32

with ``weights`` carrying both of HF's scales (``weights_proj(x) * Hi^-0.5 * Di^-0.5``; a
positive scale moves through the ReLU) and ``k`` the indexer keys in the pool
(``MLAPool.index_k``). Positions a row may not see score -inf, by the rule every attention
path uses (``paged_attention.visible_mask``: the committed prefix, then the block after it
under ``block_mask`` or causally). Each row keeps its ``topk`` best positions, returned as
pool slots; picks with score -inf (a row that sees fewer than ``topk`` positions) become
-1, so such a row keeps every position it sees: dense attention.

Ties: ``lax.top_k`` keeps the lower position first. Exact ties are common only at a score of
exactly 0 (every head's ReLU zero), which plain decoding and speculative verify round
identically; relative position order survives tree compaction, so both keep the same set.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import next_pow2
from jaxspec.pallas.paged_attention import table_slots, visible_mask
from jaxspec.pallas.triton_common import columns, tile_mask, whole

_HIGHEST = jax.lax.Precision.HIGHEST
OP = "dsa_indexer"


def _check_inputs(index_q, weights, index_k_pool, page_table, prefix_lens, block_mask, page_size, topk):
    B, T, Hi, Di = index_q.shape
    if weights.shape != (B, T, Hi):
        raise ValueError(f"weights must be [B, T, Hi] = {(B, T, Hi)}, got {weights.shape}")
    if index_k_pool.ndim != 3 or index_k_pool.shape[2] != Di:
        raise ValueError(f"index_k_pool must be [L, N, Di] = [L, N, {Di}], got {index_k_pool.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != B or prefix_lens.shape != (B,):
        raise ValueError(f"page_table {page_table.shape} / prefix_lens {prefix_lens.shape} do not match B={B}")
    if block_mask is not None and (block_mask.ndim != 3 or block_mask.shape[:2] != (B, T)):
        raise ValueError(f"block_mask must be [B, T, Wb] = [{B}, {T}, Wb], got {block_mask.shape}")
    if not 1 <= topk <= page_table.shape[1] * page_size:
        raise ValueError(f"topk={topk} must be in [1, {page_table.shape[1] * page_size}] (positions covered)")


def index_scores_reference(
    index_q: jax.Array,  # [B, T, Hi, Di]
    weights: jax.Array,  # f32[B, T, Hi]
    index_k_pool: jax.Array,  # [L, N, Di]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
) -> jax.Array:  # f32[B, T, K], -inf where a row may not look
    """Index scores in f32 at HIGHEST precision (the tests' oracle)."""
    T = index_q.shape[1]
    K = page_table.shape[1] * page_size
    k = index_k_pool[layer, table_slots(page_table, page_size)].astype(jnp.float32)  # [B, K, Di]
    s = jnp.einsum("bthd,bkd->bthk", index_q.astype(jnp.float32), k, precision=_HIGHEST)
    score = jnp.einsum("bthk,bth->btk", jax.nn.relu(s), weights.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(visible_mask(prefix_lens, block_mask, T, K), score, -jnp.inf)


def index_scores_xla(
    index_q: jax.Array,  # [B, T, Hi, Di]
    weights: jax.Array,  # f32[B, T, Hi]
    index_k_pool: jax.Array,  # [L, N, Di]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
) -> jax.Array:  # f32[B, T, K], -inf where a row may not look
    """The XLA path: keys gathered in the pool dtype, q.k accumulated in f32 (HIGHEST for f32
    pools), ReLU and the head-weighted sum in f32, as HF scores. It materializes the per-head
    scores ``f32[B, T, Hi, K]``."""
    T = index_q.shape[1]
    K = page_table.shape[1] * page_size
    dt = index_k_pool.dtype
    precision = _HIGHEST if dt == jnp.float32 else None
    k = index_k_pool[layer, table_slots(page_table, page_size)]  # [B, K, Di], pool dtype
    s = jnp.einsum("bthd,bkd->bthk", index_q.astype(dt), k, precision=precision, preferred_element_type=jnp.float32)
    score = jnp.einsum("bthk,bth->btk", jax.nn.relu(s), weights.astype(jnp.float32), precision=_HIGHEST)
    return jnp.where(visible_mask(prefix_lens, block_mask, T, K), score, -jnp.inf)


# --------------------------------------------------------------------------- Pallas kernel
#
# Grid (B * T query rows, K / block_k position tiles). A program scores one query row against
# one tile of positions: it loads the row's Hi x Di query heads and Hi weights, then the tile's
# indexer keys [bk, Di] through the page table (one contiguous Di run per position: 16-byte
# vector loads; positions the row may not see are never loaded), computes q k^T [Hi, bk] in
# f32, ReLU, and the weighted sum over heads, and stores f32[bk] scores (-inf where the row
# may not look). Nothing of size Hi x K is ever written: the XLA path materializes the
# per-head scores f32[B, T, Hi, K] (134 MB for one 8-row verify at 64k context), which is
# what the kernel saves. Top-k stays in XLA (``select_top_k``).


@dataclasses.dataclass(frozen=True)
class IndexerBlocks:
    block_k: int = 64  # positions per program
    num_warps: int = 4
    num_stages: int = 2


def _scores_kernel(
    layer_ref,  # i32[1]
    table_ref,  # i32[B * W]
    prefix_ref,  # i32[B]
    mask_ref,  # i8[B * T * Wb] block mask, or None (causal)
    q_ref,  # [B * T * Hi, Di]
    w_ref,  # f32[B * T * Hi]
    k_ref,  # [L * N, Di]
    out_ref,  # f32[B * T * K]
    *,
    rows: int,  # T
    heads: int,  # Hi
    width: int,  # Di
    page_size: int,
    table_width: int,
    num_slots: int,
    block_width: int,  # Wb (0: causal)
    h_pad: int,
    d_pad: int,
    block_k: int,
):
    row, tile = pl.program_id(0), pl.program_id(1)  # query row b * T + t, position tile
    b, t = jax.lax.div(row, rows), jax.lax.rem(row, rows)
    P, W = page_size, table_width
    K = W * P
    pos = tile * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk]
    prefix = jnp.minimum(prefix_ref[b], K)
    rel = pos - prefix  # offset in the block after the prefix
    if mask_ref is None:
        in_block = (rel >= 0) & (rel <= t)
    else:
        in_block_range = (rel >= 0) & (rel < block_width)
        m = plgpu.load(mask_ref.at[row * block_width + jnp.clip(rel, 0, block_width - 1)], mask=in_block_range,
                       other=0)
        in_block = in_block_range & (m != 0)
    visible = ((pos < prefix) | in_block) & (pos < K)  # [bk]
    page = table_ref[b * W + jnp.minimum(jax.lax.div(pos, P), W - 1)]
    slot = jnp.clip(page * P + jax.lax.rem(pos, P), 0, num_slots - 1)
    d, d_ok = columns(width, d_pad)
    k = plgpu.load(k_ref.at[(layer_ref[0] * num_slots + slot)[:, None], d[None, :]],
                   mask=tile_mask(visible, d, d_ok), other=0)  # [bk, Dp]
    h = jnp.arange(h_pad, dtype=jnp.int32)
    h_ok = h < heads
    q_row = row * heads + jnp.where(h_ok, h, 0)
    q = plgpu.load(q_ref.at[q_row[:, None], d[None, :]], mask=tile_mask(h_ok, d, d_ok), other=0)  # [Hp, Dp]
    w = plgpu.load(w_ref.at[q_row], mask=h_ok, other=0.0)  # f32[Hp] (padded heads weigh 0)
    precision = _HIGHEST if k_ref.dtype == jnp.float32 else None
    s = jnp.maximum(plgpu.dot(q, k, trans_b=True, precision=precision), 0.0)  # f32[Hp, bk]
    score = jnp.sum(s * w[:, None], axis=0)  # f32[bk]
    out = jnp.where(pos < K, row * K + pos, out_ref.shape[0])  # lanes past K: out of range, never written
    plgpu.store(out_ref.at[out], jnp.where(visible, score, -jnp.inf), mask=pos < K)


def _causal_scores_kernel(layer_ref, table_ref, prefix_ref, *refs, **kw):
    """The kernel without a block-mask input (causal rows)."""
    return _scores_kernel(layer_ref, table_ref, prefix_ref, None, *refs, **kw)


def indexer_blocks(*, heads: int, width: int) -> IndexerBlocks:
    """Tiles: the Hi x block_k f32 score tile and the block_k x Di keys in registers."""
    block_k = 64 if next_pow2(heads) * next_pow2(width) <= 64 * 128 else 32
    return IndexerBlocks(block_k=block_k, num_warps=4 if next_pow2(heads) <= 64 else 8)


@functools.partial(jax.jit, static_argnames=("page_size", "blocks", "interpret"))
def _scores_call(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask, *, page_size: int,
                 blocks: IndexerBlocks, interpret: bool):
    B, T, Hi, Di = index_q.shape
    L, N, _ = index_k_pool.shape
    W = page_table.shape[1]
    K = W * page_size
    Wb = 0 if block_mask is None else block_mask.shape[2]
    kernel = functools.partial(
        _scores_kernel if block_mask is not None else _causal_scores_kernel,
        rows=T, heads=Hi, width=Di, page_size=page_size, table_width=W, num_slots=N, block_width=Wb,
        h_pad=max(16, next_pow2(Hi)), d_pad=max(16, next_pow2(Di)), block_k=blocks.block_k)
    ins = [layer, page_table.reshape(B * W), prefix_lens]
    if block_mask is not None:
        ins.append(block_mask.astype(jnp.int8).reshape(B * T * Wb))
    ins += [index_q.reshape(B * T * Hi, Di), weights.astype(jnp.float32).reshape(B * T * Hi),
            index_k_pool.reshape(L * N, Di)]
    out_shape = jax.ShapeDtypeStruct((B * T * K,), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(B * T, pl.cdiv(K, blocks.block_k)),
        in_specs=[whole(x) for x in ins],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=OP,
    )(*ins)
    return out.reshape(B, T, K)


def index_scores_pallas(
    index_q: jax.Array,  # [B, T, Hi, Di]
    weights: jax.Array,  # f32[B, T, Hi]
    index_k_pool: jax.Array,  # [L, N, Di]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
    interpret: bool,
    blocks: IndexerBlocks | None = None,
) -> jax.Array:  # f32[B, T, K], -inf where a row may not look
    """Pallas path of the index scores (kernel notes above); queries take the pool's dtype."""
    if reason := _unsupported(index_k_pool, page_table, page_size, index_q):
        raise NotImplementedError(f"{OP}: {reason}")
    if blocks is None:
        blocks = indexer_blocks(heads=index_q.shape[2], width=index_q.shape[3])
    return _scores_call(index_q.astype(index_k_pool.dtype), weights, index_k_pool,
                        jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32),
                        prefix_lens.astype(jnp.int32), block_mask, page_size=page_size, blocks=blocks,
                        interpret=interpret)


def _unsupported(index_k_pool, page_table, page_size: int, index_q) -> str | None:
    L, N, _ = index_k_pool.shape
    B, T = index_q.shape[:2]
    if L * N >= 2**31:
        return f"pool rows L*N = {L * N} overflow the kernel's int32 row index"
    if B * T * page_table.shape[1] * page_size >= 2**31:
        return "B * T * K scores overflow the kernel's int32 output index"
    return None


def _shape_class(index_q) -> str:
    """``dsa_indexer/<decode|rows>/h<Hi>d<Di>``."""
    phase = "decode" if index_q.shape[1] == 1 else "rows"
    return f"{OP}/{phase}/h{index_q.shape[2]}d{index_q.shape[3]}"


def index_scores(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask, *, page_size: int,
                 implementation=None) -> jax.Array:  # f32[B, T, K]
    """Index scores of every position the page table covers (module docstring), by
    ``implementation``: "pallas", "xla" (:func:`index_scores_xla`), None (Pallas on a GPU, XLA
    elsewhere) or a mapping op name -> those."""
    impl = dispatch.choose(OP, implementation, shape_class=_shape_class(index_q),
                           unsupported=_unsupported(index_k_pool, page_table, page_size, index_q))
    if impl == "pallas":
        return index_scores_pallas(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask,
                                   page_size=page_size, interpret=dispatch.interpret_mode())
    return index_scores_xla(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask,
                            page_size=page_size)


def select_top_k(
    scores: jax.Array,  # f32[B, T, K], -inf where invisible
    page_table: jax.Array,  # i32[B, W]
    *,
    page_size: int,
    topk: int,
) -> jax.Array:  # i32[B, T, topk] pool slots, -1 = no pick
    """The ``topk`` best positions of each row as pool slots (-1 for picks scoring -inf)."""
    value, pos = jax.lax.top_k(scores, topk)  # [B, T, topk], best first; ties: lower position first
    slots = jnp.take_along_axis(table_slots(page_table, page_size)[:, None, :], pos, axis=2)
    return jnp.where(value > -jnp.inf, slots, -1)


def indexer_top_k(
    index_q: jax.Array,  # [B, T, Hi, Di]
    weights: jax.Array,  # f32[B, T, Hi]
    index_k_pool: jax.Array,  # [L, N, Di]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
    topk: int,
    implementation=None,
) -> jax.Array:  # i32[B, T, topk] pool slots, -1 = no pick
    """Scores every position the page table covers and keeps each row's ``topk`` best
    visible ones (module docstring). ``implementation`` picks the scoring path
    (:func:`index_scores`); the top-k is XLA's."""
    _check_inputs(index_q, weights, index_k_pool, page_table, prefix_lens, block_mask, page_size, topk)
    scores = index_scores(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask,
                          page_size=page_size, implementation=implementation)
    return select_top_k(scores, page_table, page_size=page_size, topk=topk)
