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

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import AttentionBlocks, attention_blocks, next_pow2
from jaxspec.pallas.paged_attention import visible_mask
from jaxspec.pallas.triton_common import merge_splits, split_out_shapes, whole

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


# --------------------------------------------------------------------------- Pallas kernel
#
# MLA is MQA over one shared KV row per token: the anatomy of the paged-attention kernel
# with Hkv = 1 and G = Hq. Grid (B, row blocks[, kv_splits]). A program owns one request b
# and block_m rows of the folded (T, Hq) axis (row m is query row m // Hq of head m % Hq), so
# every head reads each latent tile once. Per tile it loads the latent c [bk, C] and the rope
# key [bk, R] of each position once; c serves as key AND value:
#     s = sm_scale * (q_latent @ c^T + q_rope @ k_rope^T),  acc += softmax-weights @ c.
# It streams the prefix [0, prefix_lens[b]) in block_k tiles (dynamic trip count; dealt out
# among kv_splits programs when splitting), then the block after the prefix in block_w tiles,
# masked per row by block_mask (or w <= t), skipping tiles no row sees; online softmax in
# f32. Positions become slots through the page table inside the kernel (any page size), and
# positions no row can see are never loaded.


def _mla_kernel(
    layer_ref,  # i32[1]
    prefix_ref,  # i32[B]
    table_ref,  # i32[B * W] page table, flat
    *refs,  # [mask_ref i8[B * T * Wb]], ql_ref [B*T*Hq, C], qr_ref [B*T*Hq, R], kv_ref [L*N, C+R], outputs
    shape: tuple[int, int, int, int, int, int, int],  # (B, T, Hq, C, R, N, W)
    causal: bool,
    page_size: int,
    sm_scale: float,
    block_m: int,
    block_k: int,
    block_w: int,
    kv_splits: int,
    block_width: int,  # Wb
    c_pad: int,
    r_pad: int,
):
    if causal:
        mask_ref = None
        ql_ref, qr_ref, kv_ref, *out_refs = refs
    else:
        mask_ref, ql_ref, qr_ref, kv_ref, *out_refs = refs
    B, T, Hq, C, R, N, W = shape
    P = page_size
    max_len = W * P
    b, i = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if kv_splits > 1 else 0

    m = i * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [bm] folded rows
    t = jax.lax.div(m, Hq)  # [bm] query row
    head = jax.lax.rem(m, Hq)
    row_ok = t < T
    t_in = jnp.where(row_ok, t, 0)
    q_row = (b * T + t_in) * Hq + head  # [bm] row of q / o
    c = jnp.arange(c_pad, dtype=jnp.int32)
    c_ok = c < C
    c_in = jnp.where(c_ok, c, 0)[None, :]  # [1, Cp]
    r = jnp.arange(r_pad, dtype=jnp.int32)
    r_ok = r < R
    r_in = (C + jnp.where(r_ok, r, 0))[None, :]  # [1, Rp] columns of the rope key
    qo_mask = row_ok[:, None] & c_ok[None, :]  # [bm, Cp]
    ql = plgpu.load(ql_ref.at[q_row[:, None], c_in], mask=qo_mask, other=0)  # [bm, Cp]
    qr = plgpu.load(qr_ref.at[q_row[:, None], r_in - C], mask=row_ok[:, None] & r_ok[None, :], other=0)
    precision = jax.lax.Precision.HIGHEST if ql.dtype == jnp.float32 else None
    kv_base = layer_ref[0] * N  # first pool row of this layer
    prefix = jnp.minimum(prefix_ref[b], max_len)

    def attend(carry, pos, load_ok, allowed):
        # pos: i32[bk] positions; load_ok: bool[bk] positions some row sees (only those are
        # read); allowed: bool[bm, bk] per-row visibility.
        acc, m_i, l_i = carry  # f32[bm, Cp], f32[bm], f32[bm]
        page = table_ref[b * W + jnp.minimum(jax.lax.div(pos, P), W - 1)]  # [bk]
        slot = jnp.clip(page * P + jax.lax.rem(pos, P), 0, N - 1)
        row = (kv_base + slot)[:, None]  # [bk, 1]
        lat = plgpu.load(kv_ref.at[row, c_in], mask=load_ok[:, None] & c_ok[None, :], other=0)  # [bk, Cp]
        kr = plgpu.load(kv_ref.at[row, r_in], mask=load_ok[:, None] & r_ok[None, :], other=0)  # [bk, Rp]
        s = plgpu.dot(ql, lat, trans_b=True, precision=precision)
        s = (s + plgpu.dot(qr, kr, trans_b=True, precision=precision)) * sm_scale  # f32[bm, bk]
        s = jnp.where(allowed, s, _MASK_VALUE)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp(m_i - m_new)
        p = jnp.where(allowed, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l_i + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(lat.dtype), lat, precision=precision)
        return acc, m_new, l_new

    carry = (
        jnp.zeros((block_m, c_pad), jnp.float32),
        jnp.full((block_m,), _MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )

    def prefix_step(j, carry):  # visible to every row; only the last tile is partial
        pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        ok = pos < prefix
        return attend(carry, pos, ok, jnp.broadcast_to(ok[None, :], (block_m, block_k)))

    n_prefix = pl.cdiv(prefix, block_k)
    if kv_splits == 1:
        lo, hi = 0, n_prefix
    else:
        per_split = pl.cdiv(n_prefix, kv_splits)
        lo = split * per_split
        hi = jnp.minimum(lo + per_split, n_prefix)
    carry = jax.lax.fori_loop(lo, hi, prefix_step, carry)

    def block_step(j, carry):  # the block after the prefix (handled by the last split)
        w = j * block_w + jnp.arange(block_w, dtype=jnp.int32)
        pos = prefix + w
        w_ok = (w < block_width) & (pos < max_len)
        if causal:
            vis = w[None, :] <= t[:, None]
        else:
            mask_idx = (b * T + t_in[:, None]) * block_width + jnp.where(w_ok, w, 0)[None, :]
            vis = plgpu.load(mask_ref.at[mask_idx], mask=row_ok[:, None] & w_ok[None, :], other=0) != 0
        allowed = vis & w_ok[None, :]
        seen = jnp.max(allowed.astype(jnp.int32), axis=0) > 0
        return attend(carry, pos, seen, allowed)

    if causal:
        t_hi = jnp.minimum(T - 1, jax.lax.div(i * block_m + block_m - 1, Hq))
        n_block = pl.cdiv(t_hi + 1, block_w)
    else:
        n_block = pl.cdiv(block_width, block_w)
    if kv_splits > 1:
        n_block = jnp.where(split == kv_splits - 1, n_block, 0)
    acc, m_i, l_i = jax.lax.fori_loop(0, n_block, block_step, carry)

    row_st = jnp.where(row_ok, q_row, B * T * Hq)  # masked rows / columns: out of range, never written
    c_st = jnp.where(c_ok, c, C)[None, :]
    if kv_splits == 1:
        (o_ref,) = out_refs  # [B * T * Hq, C]
        o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]  # rows that see nothing: 0
        plgpu.store(o_ref.at[row_st[:, None], c_st], o.astype(o_ref.dtype), mask=qo_mask)
    else:
        o_ref, m_ref, l_ref = out_refs  # f32[S * B*T*Hq, C], f32[S * B*T*Hq] x2
        row_st = jnp.where(row_ok, split * (B * T * Hq) + q_row, kv_splits * B * T * Hq)
        plgpu.store(o_ref.at[row_st[:, None], c_st], acc, mask=qo_mask)
        plgpu.store(m_ref.at[row_st], m_i, mask=row_ok)
        plgpu.store(l_ref.at[row_st], l_i, mask=row_ok)


def _check_inputs(q_latent, q_rope, kv_pool, page_table, prefix_lens, block_mask):
    B, T, Hq, C = q_latent.shape
    if q_rope.ndim != 4 or q_rope.shape[:3] != (B, T, Hq):
        raise ValueError(f"q_rope must be [B, T, Hq, R] with [B, T, Hq] = {(B, T, Hq)}, got {q_rope.shape}")
    if kv_pool.ndim != 3 or kv_pool.shape[2] != C + q_rope.shape[3]:
        raise ValueError(f"kv_pool must be [L, N, C + R] = [L, N, {C + q_rope.shape[3]}], got {kv_pool.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != B or prefix_lens.shape != (B,):
        raise ValueError(f"page_table {page_table.shape} / prefix_lens {prefix_lens.shape} do not match B={B}")
    if block_mask is not None and (block_mask.ndim != 3 or block_mask.shape[:2] != (B, T)):
        raise ValueError(f"block_mask must be [B, T, Wb] = [{B}, {T}, Wb], got {block_mask.shape}")


@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "blocks", "interpret"))
def _mla_call(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[1]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # i8[B, T, Wb] | None
    *,
    page_size: int,
    sm_scale: float,
    blocks: AttentionBlocks,
    interpret: bool,
) -> jax.Array:  # [B, T, Hq, C]
    B, T, Hq, C = q_latent.shape
    R = q_rope.shape[3]
    L, N, _ = kv_pool.shape
    W = page_table.shape[1]
    causal = block_mask is None
    S = blocks.kv_splits
    grid = (B, pl.cdiv(T * Hq, blocks.block_m)) + ((S,) if S > 1 else ())
    kernel = functools.partial(
        _mla_kernel, shape=(B, T, Hq, C, R, N, W), causal=causal, page_size=page_size, sm_scale=sm_scale,
        block_m=blocks.block_m, block_k=blocks.block_k, block_w=blocks.block_w, kv_splits=S,
        block_width=T if causal else block_mask.shape[2], c_pad=max(16, next_pow2(C)), r_pad=max(16, next_pow2(R)),
    )
    ins = (layer, prefix_lens, page_table.reshape(B * W))
    ins += () if causal else (block_mask.reshape(-1),)
    ins += (q_latent.reshape(B * T * Hq, C), q_rope.reshape(B * T * Hq, R), kv_pool.reshape(L * N, C + R))
    out_shape = split_out_shapes(S, B * T * Hq, C, q_latent.dtype)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x) for x in ins],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="mla_attention",
    )(*ins)
    return merge_splits(out, (B, T, Hq, C), q_latent.dtype)


def mla_blocks(*, batch: int, rows: int, block_width: int, latent_dim: int, max_kv_len: int,
               interpret: bool) -> AttentionBlocks:
    """Heuristic tiles: those of the paged-attention kernel for one KV head of width C."""
    return attention_blocks(batch=batch, kv_heads=1, rows=rows, block_width=block_width, head_dim=latent_dim,
                            max_kv_len=max_kv_len, interpret=interpret)


def mla_attention_pallas(
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
    interpret: bool,
    blocks: AttentionBlocks | None = None,
) -> jax.Array:  # [B, T, Hq, C], q_latent.dtype
    """Pallas path of :func:`mla_attention` (see the kernel notes above)."""
    _check_inputs(q_latent, q_rope, kv_pool, page_table, prefix_lens, block_mask)
    B, T, Hq, C = q_latent.shape
    L, N, _ = kv_pool.shape
    if L * N >= 2**31:
        raise NotImplementedError(f"pool rows L*N = {L * N} overflow the kernel's int32 row index")
    if blocks is None:
        blocks = mla_blocks(
            batch=B, rows=T * Hq, block_width=T if block_mask is None else block_mask.shape[2],
            latent_dim=C, max_kv_len=page_table.shape[1] * page_size, interpret=interpret,
        )
    dt = kv_pool.dtype  # queries take the pool's dtype (the pool is never copied)
    o = _mla_call(
        q_latent.astype(dt), q_rope.astype(dt), kv_pool,
        jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32), prefix_lens.astype(jnp.int32),
        None if block_mask is None else block_mask.astype(jnp.int8),
        page_size=page_size, sm_scale=float(sm_scale), blocks=blocks, interpret=interpret,
    )
    return o.astype(q_latent.dtype)


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
