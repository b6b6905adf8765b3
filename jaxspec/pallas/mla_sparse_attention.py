"""Sparse MLA attention (absorbed form): every query row attends over its own list of pool slots.

DeepSeek-V3.2's sparse attention (DSA): the lightning indexer picks, for each query row, the
``index_topk`` positions it attends to (``jaxspec.pallas.dsa_indexer``); this op is MLA over
exactly those positions, given as pool slots (the page-table lookup is done by the indexer).

Glossary: B requests, T query rows per request, Hq query heads, C latent width
(``kv_lora_rank``), R decoupled RoPE width, L layers, N pool slots, Ks selected slots per row.

    score(t, j) = sm_scale * (q_latent[t] . c[slots[t, j]] + q_rope[t] . k_rope[slots[t, j]])
    o_latent[t] = sum_j softmax_j(score)[t, j] * c[slots[t, j]]                 # [Hq, C]

over the entries with ``slots[t, j] >= 0`` (-1: nothing selected there; the indexer returns
fewer real picks than Ks when a row sees fewer positions). A row with no slot at all gets 0.
All heads of a row share its slots (MLA is MQA over the latent row).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import block_table, dispatch
from jaxspec.pallas.block_sizes import AttentionBlocks, next_pow2, split_kv
from jaxspec.pallas.triton_common import (
    MASK_VALUE, ProgramRows, columns, init_carry, merge_splits, online_softmax_step, split_out_shapes,
    store_attention, tile_mask, whole,
)

_HIGHEST = jax.lax.Precision.HIGHEST
OP = "mla_sparse_attention"


def mla_sparse_attention_reference(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[B, T, Ks], -1 = none
    *,
    sm_scale: float,
) -> jax.Array:  # [B, T, Hq, C], q_latent.dtype
    """Pure-jnp sparse MLA in f32 (HIGHEST): gathers each row's slots, masks, softmax."""
    C = q_latent.shape[3]
    kv = kv_pool[layer, jnp.maximum(slots, 0)].astype(jnp.float32)  # [B, T, Ks, C + R]
    c, k_rope = kv[..., :C], kv[..., C:]
    s = jnp.einsum("bthc,btkc->bthk", q_latent.astype(jnp.float32), c, precision=_HIGHEST)
    s = s + jnp.einsum("bthr,btkr->bthk", q_rope.astype(jnp.float32), k_rope, precision=_HIGHEST)
    valid = (slots >= 0)[:, :, None, :]  # [B, T, 1, Ks]
    s = jnp.where(valid, s * sm_scale, MASK_VALUE)
    p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0)  # a row without slots weighs nothing
    o = jnp.einsum("bthk,btkc->bthc", p, c, precision=_HIGHEST)
    return o.astype(q_latent.dtype)


def mla_sparse_attention_xla(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[B, T, Ks], -1 = none
    *,
    sm_scale: float,
) -> jax.Array:  # [B, T, Hq, C], q_latent.dtype
    """The XLA path users run (the CPU default, the GPU fallback); the reference is the exact one.

    Like ``mla_attention_xla``: the gathered rows stay in the pool dtype, the scores are one
    matmul of ``[q_latent | q_rope]`` against whole ``[c | k_rope]`` rows, both matmuls
    accumulate in f32, and float32 pools keep HIGHEST precision. It gathers ``Ks`` rows per
    query row (``B * T * Ks * (C + R)`` elements): fine for decode and verify, heavy for a long
    prefill, where the kernel streams them instead.
    """
    C = q_latent.shape[3]
    dt = kv_pool.dtype
    precision = _HIGHEST if dt == jnp.float32 else None
    kv = kv_pool[layer, jnp.maximum(slots, 0)]  # [B, T, Ks, C + R], pool dtype
    q = jnp.concatenate([q_latent.astype(dt), q_rope.astype(dt)], axis=-1)  # [B, T, Hq, C + R]
    s = jnp.einsum("bthc,btkc->bthk", q, kv, precision=precision, preferred_element_type=jnp.float32)
    valid = (slots >= 0)[:, :, None, :]  # [B, T, 1, Ks]
    s = jnp.where(valid, s * sm_scale, MASK_VALUE)
    p = jnp.where(valid, jax.nn.softmax(s, axis=-1), 0.0)  # f32[B, T, Hq, Ks]
    o = jnp.einsum("bthk,btkc->bthc", p.astype(dt), kv, precision=precision, preferred_element_type=jnp.float32)
    return o[..., :C].astype(q_latent.dtype)


# --------------------------------------------------------------------------- Pallas kernel
#
# Grid (head blocks, B * T[, kv_splits]), head blocks fastest: the programs of one query row
# read the same selected latent rows side by side (L2 hits). A program owns block_m heads of
# one query row and streams that row's slot list in block_k tiles: it loads the tile's slots,
# then the latent c [bk, C] and rope key [bk, R] of each selected pool row (one contiguous
# run per row: 16-byte vector loads; unselected entries are never loaded), and runs the same
# online softmax as the dense kernels (``triton_common``). The register budget is the dense
# MLA kernel's (block_m x C f32 accumulator, queries re-read per tile at C = 512), so the
# same tiles apply. With kv_splits > 1 the tiles of the list are dealt out among programs
# (flash-decoding) and merged outside.


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """What ``triton_common.store_attention`` needs to know about the launch."""

    out_rows: int  # B * T * Hq
    kv_splits: int


def _sparse_kernel(
    layer_ref,  # i32[1]
    slots_ref,  # i32[B * T * Ks]
    ql_ref,  # [B * T * Hq, C]
    qr_ref,  # [B * T * Hq, R]
    kv_ref,  # [L * N, C + R]
    *out_refs,
    heads: int,  # Hq
    num_selected: int,  # Ks
    num_slots: int,  # N
    latent: int,  # C
    rope: int,  # R
    c_pad: int,
    r_pad: int,
    block_m: int,
    block_k: int,
    kv_splits: int,
    out_rows: int,
    sm_scale: float,
    reload_q: bool,
):
    C = latent
    i, row = pl.program_id(0), pl.program_id(1)  # head block, query row b * T + t
    split = pl.program_id(2) if kv_splits > 1 else 0
    head = i * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [bm]
    ok = head < heads
    q_row = row * heads + jnp.where(ok, head, 0)
    rows = ProgramRows(t=head, t_in=head, ok=ok, q_row=q_row)
    c, c_ok = columns(C, c_pad)
    r, r_ok = columns(rope, r_pad)
    ql_mask, qr_mask = tile_mask(ok, c, c_ok), tile_mask(ok, r, r_ok)

    def load_q():  # [bm, Cp], [bm, Rp]
        return (plgpu.load(ql_ref.at[q_row[:, None], c[None, :]], mask=ql_mask, other=0),
                plgpu.load(qr_ref.at[q_row[:, None], r[None, :]], mask=qr_mask, other=0))

    q_held = None if reload_q else load_q()
    precision = jax.lax.Precision.HIGHEST if ql_ref.dtype == jnp.float32 else None
    kv_base = layer_ref[0] * num_slots
    slot_base = row * num_selected

    def step(j, carry):
        idx = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [bk] entries of the list
        slot = plgpu.load(slots_ref.at[slot_base + idx], mask=idx < num_selected, other=-1)
        valid = slot >= 0  # [bk]
        kv_row = (kv_base + jnp.clip(slot, 0, num_slots - 1))[:, None]  # [bk, 1]
        lat = plgpu.load(kv_ref.at[kv_row, c[None, :]], mask=tile_mask(valid, c, c_ok), other=0)  # [bk, Cp]
        kr = plgpu.load(kv_ref.at[kv_row, C + r[None, :]], mask=tile_mask(valid, r, r_ok), other=0)  # [bk, Rp]
        ql, qr = load_q() if reload_q else q_held
        s = plgpu.dot(ql, lat, trans_b=True, precision=precision)
        s = (s + plgpu.dot(qr, kr, trans_b=True, precision=precision)) * sm_scale  # f32[bm, bk]
        allowed = jnp.broadcast_to(valid[None, :], (block_m, block_k))
        return online_softmax_step(carry, s, allowed,
                                   lambda p: plgpu.dot(p.astype(lat.dtype), lat, precision=precision))

    n_tiles = pl.cdiv(num_selected, block_k)
    if kv_splits == 1:
        lo, hi = 0, n_tiles
    else:
        per_split = pl.cdiv(n_tiles, kv_splits)
        lo = split * per_split
        hi = jnp.minimum(lo + per_split, n_tiles)
    carry = jax.lax.fori_loop(lo, hi, step, init_carry(block_m, c_pad))
    store_attention(_Outputs(out_rows, kv_splits), out_refs, carry, rows, c, c_ok, split)


def _check_inputs(q_latent, q_rope, kv_pool, slots):
    B, T, Hq, C = q_latent.shape
    if q_rope.ndim != 4 or q_rope.shape[:3] != (B, T, Hq):
        raise ValueError(f"q_rope must be [B, T, Hq, R] with [B, T, Hq] = {(B, T, Hq)}, got {q_rope.shape}")
    if kv_pool.ndim != 3 or kv_pool.shape[2] != C + q_rope.shape[3]:
        raise ValueError(f"kv_pool must be [L, N, C + R] = [L, N, {C + q_rope.shape[3]}], got {kv_pool.shape}")
    if slots.ndim != 3 or slots.shape[:2] != (B, T):
        raise ValueError(f"slots must be [B, T, Ks] = [{B}, {T}, Ks], got {slots.shape}")


def sparse_blocks(*, rows: int, heads: int, latent: int, num_selected: int, interpret: bool) -> AttentionBlocks:
    """Heuristic tiles: the dense MLA kernel's rows x latent budget (block_m heads of one row,
    queries re-read per tile at C = 512), split-KV when too few programs fill the GPU."""
    d_pad = next_pow2(latent)
    if d_pad <= 128:
        block_m, block_k, reload_q = min(max(16, next_pow2(heads)), 128), 64, False
    else:
        block_m, block_k, reload_q = min(max(16, next_pow2(heads)), 32), (32 if d_pad <= 256 else 16), True
    programs = rows * -(-heads // block_m)
    splits = split_kv(programs=programs, max_kv_len=num_selected, block_k=block_k, interpret=interpret)
    return AttentionBlocks(block_m=block_m, block_k=block_k, block_w=16, kv_splits=splits,
                           num_warps=8 if block_m * d_pad >= 4096 else 4, num_stages=2, reload_q=reload_q)


@functools.partial(jax.jit, static_argnames=("sm_scale", "blocks", "interpret"))
def _sparse_call(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[1]
    slots: jax.Array,  # i32[B, T, Ks]
    *,
    sm_scale: float,
    blocks: AttentionBlocks,
    interpret: bool,
) -> jax.Array:  # [B, T, Hq, C]
    B, T, Hq, C = q_latent.shape
    R = q_rope.shape[3]
    L, N, _ = kv_pool.shape
    Ks = slots.shape[2]
    S = blocks.kv_splits
    grid = (pl.cdiv(Hq, blocks.block_m), B * T) + ((S,) if S > 1 else ())
    kernel = functools.partial(
        _sparse_kernel, heads=Hq, num_selected=Ks, num_slots=N, latent=C, rope=R, c_pad=max(16, next_pow2(C)),
        r_pad=max(16, next_pow2(R)), block_m=blocks.block_m, block_k=blocks.block_k, kv_splits=S,
        out_rows=B * T * Hq, sm_scale=sm_scale, reload_q=blocks.reload_q,
    )
    ins = (layer, slots.reshape(B * T * Ks), q_latent.reshape(B * T * Hq, C), q_rope.reshape(B * T * Hq, R),
           kv_pool.reshape(L * N, C + R))
    out_shape = split_out_shapes(S, B * T * Hq, C, q_latent.dtype)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x) for x in ins],
        out_specs=tuple(whole(s) for s in out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=OP,
    )(*ins)
    return merge_splits(out, (B, T, Hq, C), q_latent.dtype)


def mla_sparse_attention_pallas(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[B, T, Ks]
    *,
    sm_scale: float,
    interpret: bool,
    blocks: AttentionBlocks | None = None,
) -> jax.Array:  # [B, T, Hq, C], q_latent.dtype
    """Pallas path of :func:`mla_sparse_attention` (kernel notes above). ``blocks=None``: the
    block table's entry for this GPU kind and shape class over the heuristics."""
    _check_inputs(q_latent, q_rope, kv_pool, slots)
    if reason := _unsupported(kv_pool):
        raise NotImplementedError(f"{OP}: {reason}")
    B, T, Hq, C = q_latent.shape
    if blocks is None:
        blocks = sparse_blocks(rows=B * T, heads=Hq, latent=C, num_selected=slots.shape[2], interpret=interpret)
        entry = None if interpret else block_table.lookup(dispatch.gpu_kind(), "blocks", _shape_class(q_latent))
        if entry:
            blocks = dataclasses.replace(
                blocks, **{k: v for k, v in entry.items() if k in block_table.ATTENTION_FIELDS})
    dt = kv_pool.dtype  # queries take the pool's dtype (the pool is never copied)
    o = _sparse_call(q_latent.astype(dt), q_rope.astype(dt), kv_pool, jnp.asarray(layer, jnp.int32).reshape(1),
                     slots.astype(jnp.int32), sm_scale=float(sm_scale), blocks=blocks, interpret=interpret)
    return o.astype(q_latent.dtype)


def mla_sparse_attention(
    q_latent: jax.Array,  # [B, T, Hq, C]
    q_rope: jax.Array,  # [B, T, Hq, R]
    kv_pool: jax.Array,  # [L, N, C + R]
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[B, T, Ks], -1 = none
    *,
    sm_scale: float,
    implementation: str | None = None,
) -> jax.Array:  # [B, T, Hq, C]
    """Absorbed MLA of every query row over its own selected pool slots (module docstring).

    ``implementation``: "pallas", "xla" (the lean :func:`mla_sparse_attention_xla`), None
    (Pallas on a GPU, XLA elsewhere) or a mapping op name -> those.
    """
    _check_inputs(q_latent, q_rope, kv_pool, slots)
    impl = dispatch.choose(OP, implementation, shape_class=_shape_class(q_latent), unsupported=_unsupported(kv_pool))
    fn = mla_sparse_attention_xla
    if impl == "pallas":
        fn = functools.partial(mla_sparse_attention_pallas, interpret=dispatch.interpret_mode())
    return fn(q_latent, q_rope, kv_pool, layer, slots, sm_scale=sm_scale)


def _shape_class(q_latent) -> str:
    """``mla_sparse_attention/<decode|rows>/d<C>``: one query row per request, or several (the
    kernel's tiling does not depend on which; the page size plays no part: slots are given)."""
    phase = "decode" if q_latent.shape[1] == 1 else "rows"
    return f"{OP}/{phase}/d{q_latent.shape[3]}"


def _unsupported(kv_pool) -> str | None:
    L, N, _ = kv_pool.shape
    if L * N >= 2**31:
        return f"pool rows L*N = {L * N} overflow the kernel's int32 row index"
    return None
