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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.kvcache.paging import positions_to_slots
from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.block_sizes import AttentionBlocks, next_pow2
from jaxspec.pallas.triton_common import (
    AttentionGeometry, MASK_VALUE, columns, init_carry, kv_slots, merge_splits, online_softmax_step, program_rows,
    split_out_shapes, stream_kv, store_attention, tile_mask, whole,
)


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


def table_slots(page_table: jax.Array, page_size: int) -> jax.Array:  # i32[B, W] -> i32[B, W * P]
    """Pool slot of every position the page table covers, per request (the XLA paths' gather)."""
    B, W = page_table.shape
    pos = jnp.broadcast_to(jnp.arange(W * page_size, dtype=jnp.int32), (B, W * page_size))
    return positions_to_slots(page_table, pos, page_size)


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
    slots = table_slots(page_table, page_size)  # [B, K]
    k = k_pool[layer, slots].astype(jnp.float32)  # [B, K, Hkv, D]
    v = v_pool[layer, slots].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bkhd->bhgtk", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgtk,bkhd->bthgd", p, v, precision=jax.lax.Precision.HIGHEST)
    return o.reshape(B, T, Hq, D).astype(q.dtype)


def paged_attention_xla(
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
    """The XLA path users run (the CPU default and the GPU fallback); the reference is the exact one.

    It reads the ``W * P`` positions the page table covers (the engine passes a table sliced
    to a power-of-two bucket of the live context), in the pool's dtype: the gathered K/V are
    never copied to f32, and both matmuls accumulate in f32 (``preferred_element_type``) at
    the default precision. The softmax runs in f32; its weights enter P @ V in the pool dtype
    (as in the kernel). Float32 pools keep HIGHEST precision, so float32 runs stay exact.
    """
    B, T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    G = Hq // Hkv
    kv_len = page_table.shape[1] * page_size
    dt = k_pool.dtype
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    slots = table_slots(page_table, page_size)  # [B, K]
    k = k_pool[layer, slots]  # [B, K, Hkv, D], pool dtype
    v = v_pool[layer, slots]
    qg = q.astype(dt).reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bkhd->bhgtk", qg, k, precision=precision, preferred_element_type=jnp.float32)
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None, None], s * sm_scale, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)  # f32[B, Hkv, G, T, K]
    # Output [B, Hkv, G, T, D] (batch, rows, columns: the canonical dot layout), transposed
    # after: XLA:CPU runs a bf16 x bf16 -> f32 dot only in that layout (asked for [B, T, ...]
    # directly, it swaps the operands and fails with "Unsupported element type for DotThunk").
    o = jnp.einsum("bhgtk,bkhd->bhgtd", p.astype(dt), v, precision=precision, preferred_element_type=jnp.float32)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


# --------------------------------------------------------------------------- Pallas kernel
#
# Grid (row blocks, Hkv, B[, kv_splits]); the row-block axis varies fastest, so the programs
# that read the same request and KV head run side by side and share its K/V through L2. A
# program owns one request b, one KV head h and block_m rows of the folded (T, G) axis: row m
# is query row t = m // G of q head h*G + m % G, so every q head sharing the KV head reads
# each K/V tile once. It streams
#   1. the prefix [0, prefix_lens[b]) in block_k tiles (a dynamic trip count: only the pages
#      this request uses; with kv_splits > 1 the tiles are dealt out among the splits), then
#   2. the block [prefix, prefix + Wb) in block_w tiles, masked per row by block_mask (or
#      w <= t), skipping tiles no row of the program can see (causal),
# with an online softmax in f32 (``triton_common.stream_kv``). Each tile's positions become
# slots through the page table inside the kernel, so any page size works. Positions no row
# can see are never loaded. A K/V tile row is one contiguous [D] run of the pool, read with
# an unclamped column index (16-byte vector loads, cp.async when pipelined).


def _attention_kernel(
    layer_ref,  # i32[1]
    prefix_ref,  # i32[B]
    table_ref,  # i32[B * W] page table, flat
    *refs,  # [mask_ref i8[B * T * Wb]], q_ref [B * T * Hq, D], k_ref [L * N * Hkv, D], v_ref, outputs
    geometry: AttentionGeometry,
    kv_heads: int,  # Hkv
    head_dim: int,  # D
    d_pad: int,
    sm_scale: float,
    reload_q: bool,
):
    # Every array is flat in its leading axes (row-major, free to reshape outside): one row
    # index per element keeps the pointer math explicit and the interpreted program small.
    g = geometry
    if g.causal:
        mask_ref = None
        q_ref, k_ref, v_ref, *out_refs = refs
    else:
        mask_ref, q_ref, k_ref, v_ref, *out_refs = refs
    i, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split = pl.program_id(3) if g.kv_splits > 1 else 0
    rows = program_rows(g, b, h, i)
    d, d_ok = columns(head_dim, d_pad)  # [Dp]
    q_mask = tile_mask(rows.ok, d, d_ok)

    def load_q():  # [bm, Dp]
        return plgpu.load(q_ref.at[rows.q_row[:, None], d[None, :]], mask=q_mask, other=0)

    q_held = None if reload_q else load_q()
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    kv_base = layer_ref[0] * g.num_slots  # first pool row of this layer

    def attend(carry, pos, load_ok, allowed):
        kv_row = (kv_base + kv_slots(g, table_ref, b, pos)) * kv_heads + h  # [bk]
        kv_mask = tile_mask(load_ok, d, d_ok)  # [bk, Dp]
        k = plgpu.load(k_ref.at[kv_row[:, None], d[None, :]], mask=kv_mask, other=0)  # [bk, Dp]
        v = plgpu.load(v_ref.at[kv_row[:, None], d[None, :]], mask=kv_mask, other=0)  # [bk, Dp]
        q = load_q() if reload_q else q_held  # see AttentionBlocks.reload_q
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # f32[bm, bk]
        return online_softmax_step(carry, s, allowed,
                                   lambda p: plgpu.dot(p.astype(v.dtype), v, precision=precision))

    carry = stream_kv(g, attend, init_carry(g.block_m, d_pad), rows, mask_ref=mask_ref, b=b, row_block=i,
                      split=split, prefix_ref=prefix_ref)
    store_attention(g, out_refs, carry, rows, d, d_ok, split)


def _check_inputs(q, k_pool, v_pool, page_table, prefix_lens, block_mask):
    B, T, Hq, D = q.shape
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool and v_pool must be [L, N, Hkv, D] and equal, got {k_pool.shape}, {v_pool.shape}")
    Hkv = k_pool.shape[2]
    if Hq % Hkv or k_pool.shape[3] != D:
        raise ValueError(f"q {q.shape} does not fit a pool of {Hkv} KV heads of width {k_pool.shape[3]}")
    if page_table.ndim != 2 or page_table.shape[0] != B or prefix_lens.shape != (B,):
        raise ValueError(f"page_table {page_table.shape} / prefix_lens {prefix_lens.shape} do not match B={B}")
    if block_mask is not None and (block_mask.ndim != 3 or block_mask.shape[:2] != (B, T)):
        raise ValueError(f"block_mask must be [B, T, Wb] = [{B}, {T}, Wb], got {block_mask.shape}")


@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "blocks", "interpret"))
def _attention_call(
    q: jax.Array,  # [B, T, Hq, D]
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[1]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # i8[B, T, Wb] | None
    *,
    page_size: int,
    sm_scale: float,
    blocks: AttentionBlocks,
    interpret: bool,
) -> jax.Array:  # [B, T, Hq, D]
    B, T, Hq, D = q.shape
    L, N, Hkv, _ = k_pool.shape
    W = page_table.shape[1]
    G = Hq // Hkv
    causal = block_mask is None
    S = blocks.kv_splits
    geometry = AttentionGeometry(
        batch=B, rows=T, q_heads=Hq, group=G, page_size=page_size, table_width=W, num_slots=N,
        block_width=T if causal else block_mask.shape[2], causal=causal, block_m=blocks.block_m,
        block_k=blocks.block_k, block_w=blocks.block_w, kv_splits=S,
    )
    grid = (pl.cdiv(T * G, blocks.block_m), Hkv, B) + ((S,) if S > 1 else ())
    kernel = functools.partial(_attention_kernel, geometry=geometry, kv_heads=Hkv, head_dim=D,
                               d_pad=max(16, next_pow2(D)), sm_scale=sm_scale, reload_q=blocks.reload_q)
    # Flat views (free reshapes of contiguous arrays).
    ins = (layer, prefix_lens, page_table.reshape(B * W))
    ins += () if causal else (block_mask.reshape(-1),)
    ins += (q.reshape(B * T * Hq, D), k_pool.reshape(L * N * Hkv, D), v_pool.reshape(L * N * Hkv, D))
    out_shape = split_out_shapes(S, B * T * Hq, D, q.dtype)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x) for x in ins],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="paged_attention",
    )(*ins)
    return merge_splits(out, (B, T, Hq, D), q.dtype)


def paged_attention_pallas(
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
    interpret: bool,
    blocks: AttentionBlocks | None = None,
) -> jax.Array:  # [B, T, Hq, D], q.dtype
    """Pallas path of :func:`paged_attention` (see the kernel notes above). ``blocks=None``:
    the block table's entry for this GPU kind and shape class, else the heuristics."""
    _check_inputs(q, k_pool, v_pool, page_table, prefix_lens, block_mask)
    if reason := _unsupported(k_pool):
        raise NotImplementedError(f"paged_attention: {reason}")
    B, T, Hq, D = q.shape
    Hkv = k_pool.shape[2]
    if blocks is None:
        blocks = block_table.attention_blocks_for(
            _shape_class(q, block_mask, page_size), gpu=dispatch.gpu_kind(), batch=B, kv_heads=Hkv,
            rows=T * (Hq // Hkv), block_width=T if block_mask is None else block_mask.shape[2], head_dim=D,
            max_kv_len=page_table.shape[1] * page_size, interpret=interpret,
        )
    return _attention_call(
        q, k_pool, v_pool, jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32),
        prefix_lens.astype(jnp.int32), None if block_mask is None else block_mask.astype(jnp.int8),
        page_size=page_size, sm_scale=float(sm_scale), blocks=blocks, interpret=interpret,
    )


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
    """Attention of T query rows per request over its paged KV (see the module docstring).

    ``implementation``: "pallas", "xla" (the lean :func:`paged_attention_xla`), None (Pallas
    on a GPU where the kernel takes the shape, else XLA) or a mapping op name -> those
    (``jaxspec.pallas.dispatch``).
    """
    _check_inputs(q, k_pool, v_pool, page_table, prefix_lens, block_mask)
    impl = dispatch.choose("paged_attention", implementation, shape_class=_shape_class(q, block_mask, page_size),
                           unsupported=_unsupported(k_pool))
    fn = paged_attention_xla
    if impl == "pallas":
        fn = functools.partial(paged_attention_pallas, interpret=dispatch.interpret_mode())
    return fn(q, k_pool, v_pool, layer, page_table, prefix_lens, block_mask, page_size=page_size, sm_scale=sm_scale)


def _shape_class(q, block_mask, page_size: int) -> str:
    return block_table.attention_class_of("paged_attention", rows=q.shape[1], block_mask=block_mask,
                                          head_dim=q.shape[3], page_size=page_size)


def _unsupported(k_pool) -> str | None:
    """Why the kernel cannot take this pool, or None."""
    L, N, Hkv, _ = k_pool.shape
    if L * N * Hkv >= 2**31:
        return f"pool rows L*N*Hkv = {L * N * Hkv} overflow the kernel's int32 row index"
    return None
