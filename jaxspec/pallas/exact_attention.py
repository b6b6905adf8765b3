"""Paged attention whose result for a query row does not depend on what else is computed beside it
(the exact mode's attention, docs/architecture.md#the-exact-mode).

Glossary: B requests, T query rows per request, Hq query heads, Hkv KV heads, G = Hq / Hkv,
Gp = G padded to the tensor cores' 16 rows, D head width, L layers, N pool slots, W page-table
width, P page size, Wb block width, bk the KV tile.

A row at logical position ``pos`` (its prefix plus its depth in the block) attends to logical
positions ``0 .. pos``: the committed prefix, then its own ancestors in the block in depth order (a
causal block: the rows before it; a verify tree: its path from the root). The kernel walks these
logical positions in tiles of ``bk`` from position 0, in order, one online-softmax step per tile,
with no KV split, so a decode row, the same token as a node of a verify (chain or tree) and the same
token inside a prefill read the same keys in the same tiles and combine them in the same order:
bit-identical outputs. A tree node's ancestors sit at block offsets other than their depths; the
row's remap (``ancestors``: block offset of its ancestor at each depth) finds them.

Each program owns one (request, query row, KV head): the G query heads of that KV head, padded to
Gp rows, so every program has the same shapes whatever T and B are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import next_pow2
from jaxspec.pallas.paged_attention import paged_attention_reference
from jaxspec.pallas.triton_common import init_carry, online_softmax_step, whole

EXACT_KV_TILE = 64  # bk, pinned: the tile sequence must not change with the shapes of a call


def row_ancestors(block_mask: jax.Array | None, batch: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """(depth i32[B, T], ancestors i32[B, T, Wb]): each row's depth in the block and the block offset
    of its ancestor at every depth (valid up to its depth; the row itself last). A causal block
    (``block_mask=None``) is its own remap."""
    if block_mask is None:
        depth = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[None, :], (batch, rows))
        ancestors = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[None, None, :], (batch, rows, rows))
        return depth, ancestors
    depth = jnp.sum(block_mask.astype(jnp.int32), axis=-1) - 1
    # Tree nodes are numbered parents first, so the visible offsets in ascending order are the path
    # from the root: a stable sort puts them first, in that order.
    ancestors = jnp.argsort(~block_mask, axis=-1, stable=True).astype(jnp.int32)
    return depth, ancestors


# The reference is ``paged_attention``'s: the same visibility rule computed the plain way (a mask
# over every position the page table covers, one softmax), independent of the kernel's walk over
# logical tiles and its ancestor remap; the kernel equals it up to summation order.
exact_attention_reference = paged_attention_reference


def _exact_attention_kernel(layer_ref, q_ref, k_ref, v_ref, table_ref, prefix_ref, depth_ref, anc_ref, o_ref, *,
                            rows: int, group: int, group_pad: int, kv_heads: int, head_dim: int, page_size: int,
                            table_width: int, num_slots: int, block_width: int, bk: int, sm_scale: float):
    # q_ref/o_ref [B*T*Hq, D]; k_ref/v_ref [L*N*Hkv, D]; table_ref i32[B*W]; prefix_ref i32[B];
    # depth_ref i32[B*T]; anc_ref i32[B*T*Wb]
    b, t, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bt = b * rows + t
    Hq = kv_heads * group
    g = jnp.arange(group_pad, dtype=jnp.int32)
    g_ok = g < group
    q_row = bt * Hq + h * group + jnp.where(g_ok, g, 0)  # [Gp]
    d = jnp.arange(head_dim, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[q_row[:, None], d[None, :]], mask=g_ok[:, None], other=0)  # [Gp, D]
    prefix = prefix_ref[b]
    pos = prefix + depth_ref[bt]  # the row's logical position
    layer = layer_ref[0]

    def tile(j, carry):
        p = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk] logical positions
        ok = p <= pos
        rel = jnp.clip(p - prefix, 0, block_width - 1)
        offset = plgpu.load(anc_ref.at[bt * block_width + rel])  # [bk] block offset of that depth
        phys = jnp.where(p < prefix, p, prefix + offset)
        page = plgpu.load(table_ref.at[b * table_width + jnp.clip(jax.lax.div(phys, page_size), 0, table_width - 1)])
        slot = jnp.clip(page * page_size + jax.lax.rem(phys, page_size), 0, num_slots - 1)
        kv_row = (layer * num_slots + slot) * kv_heads + h  # [bk]
        k = plgpu.load(k_ref.at[kv_row[:, None], d[None, :]], mask=ok[:, None], other=0)  # [bk, D]
        v = plgpu.load(v_ref.at[kv_row[:, None], d[None, :]], mask=ok[:, None], other=0)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * sm_scale  # [Gp, bk]
        allowed = jnp.broadcast_to(ok[None, :], (group_pad, bk))
        return online_softmax_step(carry, s, allowed,
                                   lambda w: jnp.dot(w.astype(v.dtype), v, preferred_element_type=jnp.float32))

    acc, _, l_i = jax.lax.fori_loop(0, pl.cdiv(pos + 1, bk), tile, init_carry(group_pad, head_dim))
    o = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
    out_row = jnp.where(g_ok, q_row, o_ref.shape[0])  # padded heads: out of range, never written
    plgpu.store(o_ref.at[out_row[:, None], d[None, :]], o.astype(o_ref.dtype), mask=g_ok[:, None])


@functools.partial(jax.jit, static_argnames=("page_size", "sm_scale", "interpret", "block_width"))
def _exact_attention_call(q, k_pool, v_pool, layer, page_table, prefix_lens, depth, ancestors, *, page_size: int,
                          sm_scale: float, interpret: bool, block_width: int):
    B, T, Hq, D = q.shape
    L, N, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    W = page_table.shape[1]
    args = (
        jnp.reshape(layer, (1,)).astype(jnp.int32), q.reshape(B * T * Hq, D), k_pool.reshape(L * N * Hkv, D),
        v_pool.reshape(L * N * Hkv, D), page_table.reshape(-1).astype(jnp.int32), prefix_lens.astype(jnp.int32),
        depth.reshape(-1).astype(jnp.int32), ancestors.reshape(-1).astype(jnp.int32),
    )
    out_shape = jax.ShapeDtypeStruct((B * T * Hq, D), q.dtype)
    kernel = functools.partial(
        _exact_attention_kernel, rows=T, group=G, group_pad=max(16, next_pow2(G)), kv_heads=Hkv, head_dim=D,
        page_size=page_size, table_width=W, num_slots=N, block_width=block_width, bk=EXACT_KV_TILE,
        sm_scale=sm_scale)
    out = pl.pallas_call(
        kernel, grid=(B, T, Hkv), in_specs=[whole(a) for a in args], out_specs=whole(out_shape), out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret, name="exact_attention",
    )(*args)
    return out.reshape(B, T, Hq, D)


def exact_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_pool: jax.Array,  # [L, N, Hkv, D]
    v_pool: jax.Array,  # [L, N, Hkv, D]
    layer: jax.Array,  # i32[]
    page_table: jax.Array,  # i32[B, W]
    prefix_lens: jax.Array,  # i32[B]
    block_mask: jax.Array | None,  # bool[B, T, Wb] | None (causal)
    *,
    page_size: int,
    sm_scale: float,
    interpret: bool | None = None,
) -> jax.Array:  # [B, T, Hq, D]
    """The attention of ``paged_attention`` (same visibility rule) computed row by row over logical
    KV tiles from position 0: natively on a GPU, in interpret mode elsewhere."""
    B, T = q.shape[:2]
    depth, ancestors = row_ancestors(block_mask, B, T)
    return _exact_attention_call(q, k_pool, v_pool, layer, page_table, prefix_lens, depth, ancestors,
                                 page_size=page_size, sm_scale=float(sm_scale), block_width=ancestors.shape[-1],
                                 interpret=dispatch.interpret_mode() if interpret is None else interpret)
