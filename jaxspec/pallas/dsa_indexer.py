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

import jax
import jax.numpy as jnp

from jaxspec.pallas.paged_attention import table_slots, visible_mask

_HIGHEST = jax.lax.Precision.HIGHEST


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
) -> jax.Array:  # i32[B, T, topk] pool slots, -1 = no pick
    """Scores every position the page table covers and keeps each row's ``topk`` best
    visible ones (module docstring)."""
    _check_inputs(index_q, weights, index_k_pool, page_table, prefix_lens, block_mask, page_size, topk)
    scores = index_scores_xla(index_q, weights, index_k_pool, layer, page_table, prefix_lens, block_mask,
                              page_size=page_size)
    return select_top_k(scores, page_table, page_size=page_size, topk=topk)
