"""Paged attention with per-row visibility: prefill, decode, tree verify and tree drafting.

Glossary: B requests, T query rows per request, Hq query heads, Hkv KV heads, G = Hq / Hkv,
D head width, L layers, N pool slots, W page-table width, P page size, Wb block width.

Visibility rule (the same for every use). Request ``b`` has a committed prefix of
``prefix_lens[b]`` positions, visible to all its rows. Right after the prefix sits a block of
``Wb`` positions written by this forward (the new tokens, the verify tree or the draft
scratch); row ``t`` sees block position ``w`` iff ``block_mask[b, t, w]``. With
``block_mask=None`` the block is causal over the T rows (``w <= t``).

* prefill: prefix 0 (or a cached prefix), causal block.
* decode: T = 1, causal block (the token sees itself).
* tree verify: T = n, block mask = tree mask (root, ancestors, self).
* tree draft step: T = topk, block = the topk * S scratch region, mask = ancestors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.pallas import dispatch

_MASK_VALUE = -1e30


def visible_mask(
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    num_rows: int,  # T
    kv_len: int,  # number of KV positions considered, static
) -> jax.Array:  # bool[B, T, kv_len]
    """Which KV positions each query row may attend to."""
    pos = jnp.arange(kv_len, dtype=jnp.int32)[None, None, :]  # [1, 1, K]
    prefix = prefix_lens[:, None, None]  # [B, 1, 1]
    rel = pos - prefix  # block offset of each position
    if block_mask is None:
        rows = jnp.arange(num_rows, dtype=jnp.int32)[None, :, None]
        in_block = (rel >= 0) & (rel <= rows)
    else:
        wb = block_mask.shape[-1]
        idx = jnp.clip(rel, 0, wb - 1)
        idx = jnp.broadcast_to(idx, (block_mask.shape[0], num_rows, kv_len))
        in_block = (rel >= 0) & (rel < wb) & jnp.take_along_axis(block_mask, idx, axis=2)
    return (pos < prefix) | in_block


def paged_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None
    *,
    page_size: int,
    sm_scale: float,
) -> jax.Array:  # [B, T, Hq, D], q.dtype
    """Pure-jnp attention: gathers every position the page table covers, masks, softmax in f32."""
    B, T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    kv_len = page_table.shape[1] * page_size
    pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (B, kv_len))
    slots = positions_to_slots(page_table, pos, page_size)  # [B, K]
    k = k_pool[layer, slots].astype(jnp.float32)  # [B, K, Hkv, D]
    v = v_pool[layer, slots].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bkhd->bhgtk", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgtk,bkhd->bthgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, Hq, D).astype(q.dtype)


def paged_attention_pallas(q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask, *,
                           page_size, sm_scale, interpret):
    # TODO(kernels issue): Pallas Triton kernel.
    raise NotImplementedError("the Pallas paged-attention kernel is not written yet")


def paged_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None
    *,
    page_size: int,
    sm_scale: float,
    implementation: str | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Attention of T query rows per request over its paged KV (see the module docstring)."""
    if dispatch.resolve(implementation) == "pallas":
        return paged_attention_pallas(
            q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask,
            page_size=page_size, sm_scale=sm_scale, interpret=dispatch.interpret_mode(),
        )
    return paged_attention_reference(
        q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask,
        page_size=page_size, sm_scale=sm_scale,
    )
