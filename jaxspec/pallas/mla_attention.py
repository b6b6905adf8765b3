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

from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.block_sizes import AttentionBlocks, next_pow2
from jaxspec.pallas.paged_attention import table_slots, visible_mask
from jaxspec.pallas.triton_common import (
    AttentionGeometry, MASK_VALUE, columns, init_carry, kv_slots, merge_splits, online_softmax_step, program_rows,
    split_out_shapes, stream_kv, store_attention, tile_mask, whole,
)

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
    slots = table_slots(page_table, page_size)  # [B, K]
    kv = kv_pool[layer, slots].astype(jnp.float32)  # [B, K, C + R]
    c, k_rope = kv[..., :C], kv[..., C:]
    s = jnp.einsum("bthc,bkc->bhtk", q_latent.astype(jnp.float32), c, precision=_HIGHEST)
    s = s + jnp.einsum("bthr,bkr->bhtk", q_rope.astype(jnp.float32), k_rope, precision=_HIGHEST)
    s = s * sm_scale
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhtk,bkc->bthc", p, c, precision=_HIGHEST)
    return o.astype(q_latent.dtype)


def mla_attention_xla(
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
    """The XLA path users run (the CPU default and the GPU fallback); the reference is the exact one.

    It reads the ``W * P`` positions the page table covers (the engine passes a table sliced
    to the live context's bucket) in the pool's dtype, never copied to f32 nor split: the
    scores are one matmul of ``[q_latent | q_rope]`` against the whole ``[c | k_rope]`` row,
    and the weighted sum runs over the whole row too, its rope columns dropped from the
    (small) output instead of slicing the (large) gathered latent. Both matmuls accumulate in
    f32; float32 pools keep HIGHEST precision, so float32 runs stay exact.
    """
    B, T, Hq, C = q_latent.shape
    kv_len = page_table.shape[1] * page_size
    dt = kv_pool.dtype
    precision = _HIGHEST if dt == jnp.float32 else None
    slots = table_slots(page_table, page_size)  # [B, K]
    kv = kv_pool[layer, slots]  # [B, K, C + R], pool dtype
    q = jnp.concatenate([q_latent.astype(dt), q_rope.astype(dt)], axis=-1)  # [B, T, Hq, C + R]
    s = jnp.einsum("bthc,bkc->bhtk", q, kv, precision=precision, preferred_element_type=jnp.float32)
    mask = visible_mask(prefix_lens, block_mask, T, kv_len)  # [B, T, K]
    s = jnp.where(mask[:, None], s * sm_scale, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)  # f32[B, Hq, T, K]
    # [B, Hq, T, C + R] (canonical dot layout; see paged_attention_xla), transposed after.
    o = jnp.einsum("bhtk,bkc->bhtc", p.astype(dt), kv, precision=precision, preferred_element_type=jnp.float32)
    return o[..., :C].transpose(0, 2, 1, 3).astype(q_latent.dtype)


# --------------------------------------------------------------------------- Pallas kernel
#
# MLA is MQA over one shared KV row per token: the anatomy of the paged-attention kernel
# with Hkv = 1 and G = Hq, on the same body (``triton_common.stream_kv``). Grid (row blocks,
# B[, kv_splits]), row blocks fastest. A program owns one request b and block_m rows of the
# folded (T, Hq) axis (row m is query row m // Hq of head m % Hq). Per tile it loads the
# latent c [bk, C] and the rope key [bk, R] of each position once; c serves as key AND value:
#     s = sm_scale * (q_latent @ c^T + q_rope @ k_rope^T),  acc += softmax-weights @ c.
# The prefix is streamed in block_k tiles (dealt out among kv_splits programs when
# splitting), then the block after the prefix in block_w tiles, masked per row; positions no
# row can see are never loaded.
#
# Registers, and why each request's latent is read by several programs. The f32 accumulator
# alone is block_m x C (512): 64 x 512 over 256 threads is 128 registers per thread, and an
# mma.sync operand holds 16 rows x the whole contraction per warp, so the [bm, 512] query
# kept across the loop costs another 128. At DeepSeek-V3 shapes (128 heads) that spilled
# ~1 KB per thread (block_m = 64, compiled for sm_90a by Triton 3.6). What compiles without
# spills here: block_m = 32 rows (8 warps), block_k = 16, and the queries re-read from
# global memory (L2) per KV tile instead of held in registers across the loop (``reload_q``):
# their live range ends at the score matmul, before the value matmul needs its registers
# (block_k = 32 also compiles without spills, at 253-255 registers: no margin). The cost is
# that a request's latent KV is streamed by T * Hq / 32 programs (4 for decode at 128
# heads) instead of one. That is inherent in this design: one program owning all 128 heads
# would need a 128 x 512 f32 accumulator (256 KB), more than a CTA's registers or shared
# memory. The grid runs the programs of one request side by side so the repeated reads
# hit L2, not HBM. (FlashMLA's answer, 64 heads per CTA with the query and KV tiles in
# shared memory split over two warp groups, is not expressible in Pallas-Triton.)


def _mla_kernel(
    layer_ref,  # i32[1]
    prefix_ref,  # i32[B]
    table_ref,  # i32[B * W] page table, flat
    *refs,  # [mask_ref i8[B * T * Wb]], ql_ref [B*T*Hq, C], qr_ref [B*T*Hq, R], kv_ref [L*N, C+R], outputs
    geometry: AttentionGeometry,
    latent: int,  # C
    rope: int,  # R
    c_pad: int,
    r_pad: int,
    sm_scale: float,
    reload_q: bool,
):
    g = geometry
    if g.causal:
        mask_ref = None
        ql_ref, qr_ref, kv_ref, *out_refs = refs
    else:
        mask_ref, ql_ref, qr_ref, kv_ref, *out_refs = refs
    C = latent
    i, b = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if g.kv_splits > 1 else 0
    rows = program_rows(g, b, 0, i)
    c, c_ok = columns(C, c_pad)  # [Cp] latent columns
    r, r_ok = columns(rope, r_pad)  # [Rp] rope columns (at C + r in the pool row)
    ql_mask, qr_mask = tile_mask(rows.ok, c, c_ok), tile_mask(rows.ok, r, r_ok)

    def load_q():  # [bm, Cp], [bm, Rp]
        return (plgpu.load(ql_ref.at[rows.q_row[:, None], c[None, :]], mask=ql_mask, other=0),
                plgpu.load(qr_ref.at[rows.q_row[:, None], r[None, :]], mask=qr_mask, other=0))

    q_held = None if reload_q else load_q()
    precision = jax.lax.Precision.HIGHEST if ql_ref.dtype == jnp.float32 else None
    kv_base = layer_ref[0] * g.num_slots  # first pool row of this layer

    def attend(carry, pos, load_ok, allowed):
        row = (kv_base + kv_slots(g, table_ref, b, pos))[:, None]  # [bk, 1]
        lat = plgpu.load(kv_ref.at[row, c[None, :]], mask=tile_mask(load_ok, c, c_ok), other=0)  # [bk, Cp]
        kr = plgpu.load(kv_ref.at[row, C + r[None, :]], mask=tile_mask(load_ok, r, r_ok), other=0)  # [bk, Rp]
        ql, qr = load_q() if reload_q else q_held
        s = plgpu.dot(ql, lat, trans_b=True, precision=precision)
        s = (s + plgpu.dot(qr, kr, trans_b=True, precision=precision)) * sm_scale  # f32[bm, bk]
        return online_softmax_step(carry, s, allowed,
                                   lambda p: plgpu.dot(p.astype(lat.dtype), lat, precision=precision))

    carry = stream_kv(g, attend, init_carry(g.block_m, c_pad), rows, mask_ref=mask_ref, b=b, row_block=i,
                      split=split, prefix_ref=prefix_ref)
    store_attention(g, out_refs, carry, rows, c, c_ok, split)


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
    geometry = AttentionGeometry(
        batch=B, rows=T, q_heads=Hq, group=Hq, page_size=page_size, table_width=W, num_slots=N,
        block_width=T if causal else block_mask.shape[2], causal=causal, block_m=blocks.block_m,
        block_k=blocks.block_k, block_w=blocks.block_w, kv_splits=S,
    )
    grid = (pl.cdiv(T * Hq, blocks.block_m), B) + ((S,) if S > 1 else ())
    kernel = functools.partial(
        _mla_kernel, geometry=geometry, latent=C, rope=R, c_pad=max(16, next_pow2(C)),
        r_pad=max(16, next_pow2(R)), sm_scale=sm_scale, reload_q=blocks.reload_q,
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
    """Pallas path of :func:`mla_attention` (see the kernel notes above). ``blocks=None``:
    the block table's entry for this GPU kind and shape class, else the heuristics."""
    _check_inputs(q_latent, q_rope, kv_pool, page_table, prefix_lens, block_mask)
    if reason := _unsupported(kv_pool):
        raise NotImplementedError(f"mla_attention: {reason}")
    B, T, Hq, C = q_latent.shape
    if blocks is None:
        blocks = block_table.attention_blocks_for(
            _shape_class(q_latent, block_mask, page_size), gpu=dispatch.gpu_kind(), batch=B, kv_heads=1,
            rows=T * Hq, block_width=T if block_mask is None else block_mask.shape[2], head_dim=C,
            max_kv_len=page_table.shape[1] * page_size, interpret=interpret,
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
    """Absorbed MLA of T query rows per request over its paged latent KV (module docstring).

    ``implementation``: "pallas", "xla" (the lean :func:`mla_attention_xla`), None (Pallas on
    a GPU where the kernel takes the shape, else XLA) or a mapping op name -> those.
    """
    _check_inputs(q_latent, q_rope, kv_pool, page_table, prefix_lens, block_mask)
    impl = dispatch.choose("mla_attention", implementation,
                           shape_class=_shape_class(q_latent, block_mask, page_size), unsupported=_unsupported(kv_pool))
    fn = mla_attention_xla
    if impl == "pallas":
        fn = functools.partial(mla_attention_pallas, interpret=dispatch.interpret_mode())
    return fn(q_latent, q_rope, kv_pool, layer, page_table, prefix_lens, block_mask, page_size=page_size,
              sm_scale=sm_scale)


def _shape_class(q_latent, block_mask, page_size: int) -> str:
    return block_table.attention_class_of("mla_attention", rows=q_latent.shape[1], block_mask=block_mask,
                                          head_dim=q_latent.shape[3], page_size=page_size)


def _unsupported(kv_pool) -> str | None:
    """Why the kernel cannot take this pool, or None."""
    L, N, _ = kv_pool.shape
    if L * N >= 2**31:
        return f"pool rows L*N = {L * N} overflow the kernel's int32 row index"
    return None
