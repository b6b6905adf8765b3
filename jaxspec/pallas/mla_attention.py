"""Paged multi-head latent attention (MLA, absorbed form) with per-row visibility.

Glossary: B requests, T query rows per request, Hq query heads, C latent width
(``kv_lora_rank``), R decoupled RoPE width (``qk_rope_head_dim``), L layers, N pool slots,
W page-table width, P page size, Wb block width.

The pool stores one row per token and layer: ``[c | k_rope]`` (``C + R`` wide), the
normalized KV latent and the RoPE'd key part shared by every head. With the key half of
``kv_b_proj`` absorbed into the query (``q_latent = W_uk^T q_nope``), every head attends
over that single row:

    score(t, k) = sm_scale * (q_latent[t] . c[k] + q_rope[t] . k_rope[k])
    o_latent[t] = sum_k softmax(score)[t, k] * c[k]                   # [Hq, C]

and the caller maps ``o_latent`` through the value half of ``kv_b_proj``. This equals HF's
non-absorbed math (``k_nope = W_uk c``, ``v = W_uv c``) up to float rounding.

Visibility is the rule of ``jaxspec.pallas.paged_attention`` (``visible_mask``): the
committed prefix of each request is visible to all its rows; the block right after it
follows ``block_mask`` (or is causal over the T rows when ``block_mask`` is None).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.pallas import dispatch
from jaxspec.pallas.paged_attention import visible_mask

_MASK_VALUE = -1e30
_HIGHEST = jax.lax.Precision.HIGHEST


def mla_attention_reference(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
    sm_scale: float,
) -> jax.Array:  # [B, T, Hq, C], q_latent.dtype
    """Pure-jnp MLA: gathers every position the page table covers, masks, softmax in f32."""
    B, T, Hq, C = q_latent.shape
    kv_len = page_table.shape[1] * page_size
    pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (B, kv_len))
    slots = positions_to_slots(page_table, pos, page_size)  # [B, K]
    kv = kv_pool[layer, slots].astype(jnp.float32)  # [B, K, C + R]
    c, k_rope = kv[..., :C], kv[..., C:]
    s = jnp.einsum("bthc,bkc->bhtk", q_latent.astype(jnp.float32), c, precision=_HIGHEST)
    s = s + jnp.einsum("bthr,bkr->bhtk", q_rope.astype(jnp.float32), k_rope, precision=_HIGHEST)
    s = s * sm_scale
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhtk,bkc->bthc", p, c, precision=_HIGHEST)
    return o.astype(q_latent.dtype)


def mla_attention_pallas(q_latent, q_rope, kv_pool, layer, page_table, prefix_lens, block_mask, *,
                         page_size, sm_scale, interpret):
    # TODO(kernels issue): Pallas Triton kernel (one program per (request, head group),
    # online softmax over pages; the latent row serves as both key and value).
    raise NotImplementedError("the Pallas MLA attention kernel is not written yet")


def mla_attention(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None
    *,
    page_size: int,
    sm_scale: float,
    implementation: str | None = None,
) -> jax.Array:  # [B, T, Hq, C]
    """Absorbed MLA of T query rows per request over its paged latent KV (module docstring)."""
    if dispatch.resolve(implementation) == "pallas":
        return mla_attention_pallas(
            q_latent, q_rope, kv_pool, layer, page_table, prefix_lens, block_mask,
            page_size=page_size, sm_scale=sm_scale, interpret=dispatch.interpret_mode(),
        )
    return mla_attention_reference(
        q_latent, q_rope, kv_pool, layer, page_table, prefix_lens, block_mask,
        page_size=page_size, sm_scale=sm_scale,
    )
