"""Building blocks shared by targets, draft heads and training: RMSNorm, RoPE, SwiGLU, paged
attention, and the Llama layer body (q/k/v projection before attention, output projection and
MLP after it) that the Llama-family targets, the EAGLE heads, the frozen-KV assistant and the
dense training forwards all run.

Glossary: B rows, T positions per row, H model width, Hq / Hkv query / KV heads, D head width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jaxspec.kvcache.paging import AttentionInputs, WindowTable, scratch_end
from jaxspec.kvcache.pool import KVPool
from jaxspec.mesh import MODEL, per_model_shard
from jaxspec.model.config import RopeConfig
from jaxspec.model.fused import column_shards, fuse_columns, shards_of, split_columns
from jaxspec.pallas import dispatch
from jaxspec.pallas.block_sizes import grouped_blocks
from jaxspec.pallas.exact import exact_on, matmul, row_mean
from jaxspec.pallas.exact_attention import exact_attention
from jaxspec.pallas.grouped_matmul import gated_epilogue, group_tiles, grouped_matmul_tiled_pallas, grouped_unsupported
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.rms_norm import record_reference, rms_norm_pallas
from jaxspec.pallas.rope_write import rope_cos_sin, rope_write_pallas, rope_write_unsupported


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, *, gemma: bool = False) -> jax.Array:
    """HF-style RMSNorm: normalize in f32, cast back, then scale (Llama). ``gemma``: HF Gemma 4's
    arithmetic instead (``pow(ms + eps, -0.5)``, the weight applied in f32 before the cast back);
    ``weight=None`` is a norm without a scale (Gemma 4's v_norm)."""
    xf = x.astype(jnp.float32)
    ms = row_mean(xf * xf) + eps  # the fixed-order kernel's sum in the exact mode
    xf = xf * (jnp.power(ms, -0.5) if gemma else jax.lax.rsqrt(ms))
    if weight is None:
        return xf.astype(x.dtype)
    if gemma:
        return (xf * weight.astype(jnp.float32)).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def centred_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm, HF's Qwen3-Next / Qwen3.5 arithmetic: ``x_hat * (1 + w)`` in f32, then cast."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def stacked_rms_norm(
    x: jax.Array,  # [..., H]
    weights: jax.Array,  # [L, H] a norm's weights, stacked per layer
    layer: jax.Array,  # i32[]
    *,
    eps: float,
    implementation,
    tensor_parallel: int = 1,
    centred: bool = False,
    record: tuple[jax.Array, jax.Array] | None = None,  # (buffer [S, ..., H], slots i32[L])
):  # [..., H]; with ``record``: ([..., H], the buffer with x at its layer's slot)
    """``rms_norm(x, weights[layer], eps)`` (``centred``: ``centred_rms_norm``), one kernel on a GPU
    (``jaxspec.pallas.rms_norm``: it reads the stacked weights where they lie). The exact mode keeps
    its fixed-order mean (XLA path). With ``tensor_parallel`` shards every shard normalizes its whole
    copy of ``x``. ``record``: x is also written at ``buffer[slots[layer]]`` (an aux tap), by the same
    kernel on a GPU (a ``dynamic_update_slice`` on XLA)."""
    if exact_on() or dispatch.choose("rms_norm", implementation, shape_class="rms_norm") == "xla":
        out = centred_rms_norm(x, weights[layer], eps) if centred else rms_norm(x, weights[layer], eps)
        return out if record is None else (out, record_reference(record[0], record[1], layer, x))

    def local(x, weights, layer, *record):
        H = x.shape[-1]
        flat = None if not record else (record[0].reshape(record[0].shape[0], -1, H), record[1])
        out = rms_norm_pallas(x.reshape(-1, H), weights, layer, eps, interpret=dispatch.interpret_mode(),
                              centred=centred, record=flat)
        rows, buffer = out if record else (out, None)
        rows = rows.reshape(x.shape[:-1] + rows.shape[-1:])
        return rows if not record else (rows, buffer.reshape(record[0].shape))

    specs = (P(), P(), P()) + ((P(), P()) if record else ())
    return per_model_shard(local, in_specs=specs, out_specs=P() if record is None else (P(), P()),
                           shards=tensor_parallel)(x, weights, layer, *(record or ()))


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:  # f32[dim // 2]
    """Inverse frequencies of ``rope`` over ``dim`` dims (computed once, host side)."""
    return rope.inv_freq(dim)


def apply_rope(
    x: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # i32[B, T]
    inv_freq: np.ndarray,  # f32[D // 2]
    scale: float = 1.0,
) -> jax.Array:  # [B, T, H, D]
    """Rotate-half RoPE (HF Llama convention) at integer ``positions``."""
    cos, sin = rope_cos_sin(positions, inv_freq, scale, x.dtype)  # [B, T, D/2]
    cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    sin = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def gated_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, shards: int = 1,
              activation=jax.nn.silu) -> jax.Array:  # x [..., H] -> [..., H]
    """``down(act(gate(x)) * up(x))`` (SwiGLU with ``silu``, Gemma's GeGLU with ``gelu_tanh``), gate
    and up as one product: ``w_gate_up [H, 2I]`` joined in the column order of ``shards`` model
    shards (``jaxspec.model.fused``)."""
    half = w_gate_up.shape[-1] // 2
    gate, up = split_columns(matmul(x, w_gate_up), (half, half), shards)
    return matmul(activation(gate) * up, w_down)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (HF ``gelu_pytorch_tanh``)."""
    return jax.nn.gelu(x, approximate=True)


def write_and_attend(
    q: jax.Array,  # [B, T, Hq, D] (RoPE applied)
    k: jax.Array,  # [B, T, Hkv, D] (RoPE applied)
    v: jax.Array,  # [B, T, Hkv, D]
    pool: KVPool,
    layer: jax.Array,  # i32[]
    attn: AttentionInputs,
    *,
    implementation,
    sm_scale: float | None = None,
    tensor_parallel: int = 1,
    write: bool = True,
) -> tuple[jax.Array, KVPool]:  # [B, T, Hq, D], new pool
    """Writes the new K/V into the pool first, then attends through the page table, so a
    token reads its own (pool-dtype) K/V exactly as later tokens will. With ``tensor_parallel``
    shards, heads and the pool's KV heads are split over the mesh's model axis and every shard
    attends over its own heads. ``write=False``: a layer reading K/V that an earlier layer of
    this forward wrote there (Gemma 4's K/V sharing) attends without writing."""
    D = k.shape[-1]

    def local(q, k, v, pool, layer, attn):
        B, T, Hkv, _ = k.shape
        if write:
            pool = pool.write(layer, attn.write_slots.reshape(B * T), k.reshape(B * T, Hkv, D),
                              v.reshape(B * T, Hkv, D))
        return _attend(q, pool, layer, attn, implementation, sm_scale), pool

    return _per_head_shard(local, tensor_parallel)(q, k, v, pool, layer, attn)


def rope_write_and_attend(
    qkv: jax.Array,  # [B, T, Hq + 2 Hkv, D] joined heads, unrotated (``joined_qkv``)
    pool: KVPool,
    layer: jax.Array,  # i32[]
    attn: AttentionInputs,
    rope: "Rope",
    *,
    q_heads: int,  # Hq (all shards)
    implementation,
    sm_scale: float | None = None,
    tensor_parallel: int = 1,
) -> tuple[jax.Array, KVPool]:  # [B, T, Hq, D], new pool
    """``write_and_attend`` for q/k/v as the joined product leaves them: RoPE on q and k and the K/V
    write in one step (``rotate_and_write``: one kernel on a GPU), then attention.

    ``qkv`` may hold padding rows after a request's real ones (``padded_tokens``), with
    ``attn.write_slots`` and ``rope.positions`` padded alike (scratch slot 0, position 0) or shorter
    (padded here): those rows write nothing and see the prefix alone (``pad_attention_rows``); their
    output rows are finite and meaningless, and nothing may read them."""
    def local(qkv, pool, layer, attn, positions):
        B, Tp = qkv.shape[:2]
        # (A forward pads its attention inputs and positions once, outside the layer loop: no-ops then.)
        attn = pad_attention_rows(attn, Tp)
        q, pool = rotate_and_write(qkv, pool, layer, attn.write_slots.reshape(B * Tp),
                                   rope._replace(positions=pad_tokens(positions, Tp)),
                                   q_heads=q_heads // tensor_parallel, implementation=implementation)
        # The padding rows are attended too (cheap: rows are few where there is padding), so no
        # slice of q and pad of the output sit around the kernel: two small kernels a layer on a GPU.
        return _attend(q, pool, layer, attn, implementation, sm_scale), pool

    if qkv.shape[2] != q_heads + 2 * pool.k.shape[2]:  # (global shapes: every shard's heads)
        raise ValueError(f"joined heads {qkv.shape} do not hold {q_heads} query heads and the pool's "
                         f"{pool.k.shape[2]} KV heads")
    return _per_head_shard(local, tensor_parallel, head_args=1)(qkv, pool, layer, attn, rope.positions)


def padded_tokens(B: int, T: int) -> int:
    """Tokens per request a forward of B x T new tokens runs over: T rounded up until B * T rows are
    a multiple of ``dispatch.product_rows()`` (8 on a GPU). XLA:GPU pads each bf16 product's rows to
    a multiple of 8 and slices the result back, nine small kernels a Llama layer at B * T = 6 (an
    EAGLE chain of 5 verified at batch 1) and seven at a decode of batch 2 or 4 (the 8B plain step:
    595 kernels against 370 at batch 8); rows padded once per forward leave none. A decode at batch 1
    is a vector product and stays as it is (inside ``dispatch.one_row_padded_to``, it runs over that
    many rows)."""
    if B * T == 1:
        return dispatch.one_row_rows()
    multiple = dispatch.product_rows()
    Tp = T
    while (B * Tp) % multiple:
        Tp += 1
    return Tp


def pad_tokens(x: jax.Array, Tp: int) -> jax.Array:  # [B, T, ...] -> [B, Tp, ...] zeros after T
    if x.shape[1] == Tp:
        return x
    return jnp.pad(x, ((0, 0), (0, Tp - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def pad_attention_rows(attn: AttentionInputs, Tp: int) -> AttentionInputs:
    """``attn`` for Tp >= T rows a request: each padding row writes to scratch slot 0 and sees the
    prefix alone, none of the block (its ``block_mask`` row False; a causal block has no mask, and a
    padding row's extra block positions were never written, so it reads finite values it may not
    need). No real row's output changes: every row's softmax is its own."""
    mask = attn.block_mask
    if mask is not None and mask.shape[1] != Tp:
        mask = jnp.pad(mask, ((0, 0), (0, Tp - mask.shape[1]), (0, 0)))
    return dataclasses.replace(attn, write_slots=pad_tokens(attn.write_slots, Tp), block_mask=mask)


def _attend(q, pool: KVPool, layer, attn: AttentionInputs, implementation, sm_scale) -> jax.Array:  # [B, T, Hq, D]
    attend = exact_attention if exact_on() else functools.partial(paged_attention, implementation=implementation)
    return attend(q, pool.k, pool.v, layer, attn.page_table, attn.prefix_lens, attn.block_mask,
                  page_size=pool.page_size, sm_scale=sm_scale or 1.0 / math.sqrt(q.shape[-1]))


class Rope(NamedTuple):
    """RoPE still to apply to a layer's q and k (``rope_write_and_attend``)."""

    positions: jax.Array  # i32[B, T]
    inv_freq: np.ndarray  # f32[D // 2]
    scale: float = 1.0  # YaRN's attention factor on cos / sin


def rotate_and_write(
    qkv: jax.Array,  # [B, T, Hq + 2 Hkv, D] joined heads, unrotated
    pool: KVPool,
    layer: jax.Array,  # i32[]
    slots: jax.Array,  # i32[B * T] pool slots (scratch: not written)
    rope: Rope,
    *,
    q_heads: int,  # Hq
    implementation,
) -> tuple[jax.Array, KVPool]:  # rotated q [B, T, Hq, D], new pool
    """RoPE on q and k, then k and v written at ``slots``: ``apply_rope`` and ``KVPool.write`` on
    XLA, one launch on a GPU (``jaxspec.pallas.rope_write``)."""
    B, T, Hw, D = qkv.shape
    Hkv = (Hw - q_heads) // 2
    unsupported = rope_write_unsupported(pool.k.shape)
    if dispatch.choose("rope_write", implementation, shape_class="rope_write", unsupported=unsupported) == "xla":
        q = apply_rope(qkv[:, :, :q_heads], rope.positions, rope.inv_freq, rope.scale)
        k = apply_rope(qkv[:, :, q_heads:q_heads + Hkv], rope.positions, rope.inv_freq, rope.scale)
        v = qkv[:, :, q_heads + Hkv:]
        return q, pool.write(layer, slots, k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D))
    q, k_pool, v_pool = rope_write_pallas(
        qkv.reshape(B * T, Hw, D), pool.k, pool.v, layer, slots, rope.positions.reshape(B * T), rope.inv_freq,
        q_heads=q_heads, scale=rope.scale, scratch_slots=scratch_end(pool.page_size), interpret=dispatch.interpret_mode())
    return q.reshape(B, T, q_heads, D), pool.with_buffers((k_pool, v_pool))


def _per_head_shard(local, tensor_parallel: int, head_args: int = 3):
    """``local(*heads, pool, layer, attn, *whole) -> (o, pool)`` run on each model shard's heads:
    the first ``head_args`` arguments (q, k, v, or joined q/k/v), o and the pool's KV heads split
    over the model axis; layer, attn and the rest whole."""
    heads = P(None, None, MODEL, None)

    def fn(*args):
        pool, layer, attn, *whole = args[head_args:]
        pool_heads = jax.tree.map(lambda _: heads, pool)
        in_specs = (heads,) * head_args + (pool_heads, P(), jax.tree.map(lambda _: P(), attn)) + (P(),) * len(whole)
        return per_model_shard(local, in_specs=in_specs, out_specs=(heads, pool_heads),
                               shards=tensor_parallel)(*args)

    return fn


def embed_lookup(table: jax.Array, tokens: jax.Array, tensor_parallel: int = 1) -> jax.Array:
    """``table[tokens]`` ([V, H] -> [..., H]); with ``tensor_parallel`` shards the table is split
    by vocabulary rows over the model axis: each shard looks up the tokens in its range and one
    all-reduce sums them (the table is never gathered)."""
    if tensor_parallel == 1:
        return table[tokens]

    def local(tab, tok):
        rows = tab.shape[0]
        rel = tok - jax.lax.axis_index(MODEL) * rows
        ok = (rel >= 0) & (rel < rows)
        x = jnp.where(ok[..., None], tab[jnp.clip(rel, 0, rows - 1)], jnp.zeros((), tab.dtype))
        return jax.lax.psum(x, MODEL)

    return per_model_shard(local, in_specs=(P(MODEL, None), P()), out_specs=P(), shards=tensor_parallel)(table, tokens)

# --------------------------------------------------------------------- sliding-window attention
#
# The XLA path for sliding-window layers, whatever ``implementation`` says: the Pallas kernels
# see a prefix [0, prefix_len) and a block, and cannot yet skip the positions that fell out of
# the window nor address the ring table of the window pool. A kernel would need (a) a per-row
# lower bound ``q_pos - W`` on prefix positions (skipping whole tiles below it, so a decode step
# reads W positions instead of the whole prefix) and (b) the ring slot map of
# ``paging.WindowTable`` (column ``page % R`` plus a residency test) in place of the page-table
# lookup; the block part is unchanged.


def attention_over(
    q: jax.Array,  # [B, T, Hq, D]
    k: jax.Array,  # [B, K, Hkv, D] keys each row may consider
    v: jax.Array,  # [B, K, Hkv, D]
    visible: jax.Array,  # bool[B, T, K]
    sm_scale: float,
) -> jax.Array:  # [B, T, Hq, D], q.dtype
    """Grouped-query attention of each row over its own gathered keys (the sliding-window layers'
    path), as lean as ``paged_attention_xla``: K/V stay in their dtype, both products accumulate in
    f32 at the default precision (float32 K/V keep HIGHEST, so float32 runs stay exact), the softmax
    runs in f32 and its weights enter P @ V in the K/V dtype. (In f32 at HIGHEST throughout, a GPU ran
    these products without tensor cores plus a transpose: 55 of a 152 ms 1k-token prefill on an H200.)"""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    dt = k.dtype
    precision = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    qg = q.astype(dt).reshape(B, T, Hkv, Hq // Hkv, D)
    scores = jnp.einsum("bthgd,bkhd->bhgtk", qg, k, precision=precision, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(jnp.where(visible[:, None, None], scores * sm_scale, -1e30), axis=-1)  # f32
    # [B, Hkv, G, T, D] (the canonical dot layout), transposed after (see paged_attention_xla)
    out = jnp.einsum("bhgtk,bkhd->bhgtd", weights.astype(dt), v.astype(dt), precision=precision,
                     preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D).astype(q.dtype)


def gather_window(
    pool: KVPool,
    layer: jax.Array,  # i32[]
    ring: WindowTable,
    start: jax.Array,  # i32[B] first position gathered
    count: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # k, v [B, count, Hkv, D]; positions i32[B, count]
    """K/V at positions ``start + [0, count)`` of each request (scratch where not resident)."""
    positions = start[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :]
    slots = ring.slots(positions, pool.page_size)
    return pool.k[layer, slots], pool.v[layer, slots], positions


def window_write_and_attend(
    q: jax.Array,  # [B, T, Hq, D] (RoPE applied)
    k: jax.Array,  # [B, T, Hkv, D] (RoPE applied)
    v: jax.Array,  # [B, T, Hkv, D]
    pool: KVPool,  # the window pool, addressed by attn.window
    layer: jax.Array,  # i32[]
    attn: AttentionInputs,
    query_positions: jax.Array,  # i32[B, T] each row's position (its RoPE position)
    *,
    window: int,
    sm_scale: float,
    tensor_parallel: int = 1,
    write: bool = True,
) -> tuple[jax.Array, KVPool]:  # [B, T, Hq, D], new pool
    """A sliding-window layer: writes the new K/V through the ring table, then each row at
    position p attends to the keys at positions (p - window, p] that ``attn`` lets it see.
    With ``tensor_parallel`` shards, heads and the window pool's KV heads are split over the
    mesh's model axis (the ring table is the same on every shard). ``write=False``: k and v are
    what an earlier layer of this forward wrote at ``layer`` (Gemma 4's K/V sharing); nothing is
    written.

    Keys come in two parts. The prefix part: the ``window - 1`` positions before
    ``prefix_lens`` (read from the pool). The block part: for a causal block, this forward's
    own K/V (cast to the pool dtype, i.e. what the pool holds; a prompt longer than the window
    keeps only its tail in the pool); for a masked block (tree verify, draft scratch), the
    block positions read back from the pool after the write. Inside a masked block no window
    test is made: its rows sit at most ``num_steps`` < ``window`` positions from their
    ancestors (``generate`` checks that)."""
    local = functools.partial(_window_write_and_attend, window=window, sm_scale=sm_scale, write=write)
    return _per_head_shard(local, tensor_parallel)(q, k, v, pool, layer, attn, query_positions)


def _window_write_and_attend(q, k, v, pool: KVPool, layer, attn: AttentionInputs, query_positions, *,
                             window: int, sm_scale: float, write: bool = True) -> tuple[jax.Array, KVPool]:
    """``window_write_and_attend`` on one shard's heads."""
    B, T, Hkv, D = k.shape
    ring = attn.window
    if write:
        slots = ring.slots(attn.write_positions, pool.page_size)  # [B, T]
        pool = pool.write(layer, slots.reshape(B * T), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D))
    if write and attn.window_keep is not None:  # a prefill's checkpoint pages for the prefix cache (scratch elsewhere)
        keep = attn.window_keep.slots(attn.write_positions, pool.page_size)
        pool = pool.write(layer, keep.reshape(B * T), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D))
    read = ring if attn.window_read is None else attn.window_read  # a prefill after a cached prefix: its pages
    kp, vp, ppos = gather_window(pool, layer, read, attn.prefix_lens - (window - 1), window - 1)
    prefix_ok = (ppos >= 0)[:, None, :] & (ppos[:, None, :] > query_positions[:, :, None] - window)  # [B, T, W-1]
    if attn.block_mask is None:
        kb, vb = k.astype(pool.k.dtype), v.astype(pool.v.dtype)
        rows = jnp.arange(T, dtype=jnp.int32)
        dist = rows[:, None] - rows[None, :]  # row - block entry
        block_ok = jnp.broadcast_to((dist >= 0) & (dist < window), (B, T, T))
    else:
        kb, vb, _ = gather_window(pool, layer, ring, attn.prefix_lens, attn.block_mask.shape[-1])
        block_ok = attn.block_mask
    o = attention_over(q, jnp.concatenate([kp, kb], axis=1), jnp.concatenate([vp, vb], axis=1),
                       jnp.concatenate([prefix_ok, block_ok], axis=-1), sm_scale)
    return o, pool


# ------------------------------------------------------------------------------- Llama layer
#
# A Llama-family layer (and every head built from one) is
#     q, k, v = project(norm(x));  o = attention(q, k, v);  x' = layer_tail(x, o)
# ``cfg`` is any config with num_heads, num_kv_heads, head_dim, rms_norm_eps, attention_bias
# (Qwen2 q/k/v bias) and qk_norm (Qwen3 per-head RMSNorm before RoPE), and optionally
# tensor_parallel (the column order of the joined weights). Weights ``[in, out]``; q/k/v joined
# as ``wqkv`` (biases ``bqkv``), or q apart from a joined ``wkv`` (a layer that also projects
# k/v alone: a DFlash draft's context), or ``wq`` alone (a query-only layer); gate/up joined as
# ``w_gate_up`` (``jaxspec.model.fused``).


def _query(q: jax.Array, lp: dict, cfg, positions: jax.Array, inv_freq) -> jax.Array:  # [B, T, Hq*D] -> [B, T, Hq, D]
    q = q.reshape(q.shape[:2] + (cfg.num_heads, cfg.head_dim))
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq, cfg.rope.cos_sin_scale)  # scale: YaRN's attention factor


def _key_value(k: jax.Array, v: jax.Array, lp: dict, cfg, positions: jax.Array, inv_freq):  # [B, T, Hkv*D] each
    shape = k.shape[:2] + (cfg.num_kv_heads, cfg.head_dim)
    k, v = k.reshape(shape), v.reshape(shape)
    if cfg.qk_norm:
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, positions, inv_freq, cfg.rope.cos_sin_scale), v


def layer_rope(cfg, positions: jax.Array, inv_freq) -> Rope:
    """The RoPE a layer of ``cfg`` applies at ``positions``, for ``rope_write_and_attend``."""
    return Rope(positions, inv_freq, cfg.rope.cos_sin_scale)


def joins_heads(lp: dict, cfg) -> bool:
    """Whether a layer's q/k/v can stay joined into attention (``joined_qkv``): one ``wqkv`` whose
    columns are grouped per model shard the way the heads are split."""
    parts = (cfg.num_heads * cfg.head_dim,) + (cfg.num_kv_heads * cfg.head_dim,) * 2
    return "wqkv" in lp and column_shards(parts, shards_of(cfg)) == shards_of(cfg)


def joined_qkv(
    lp: dict, cfg, a: jax.Array  # a [B, T, A] attention input
) -> jax.Array:  # [B, T, Hq + 2 Hkv, D] heads in the per-shard column order, unrotated
    """q, k and v of one input as one array of heads (the ``wqkv`` product as it lies; Qwen3's
    q/k norms applied to their parts). RoPE is left to ``rope_write_and_attend``."""
    y = matmul(a, lp["wqkv"])
    if cfg.attention_bias:
        y = y + lp["bqkv"]
    if cfg.qk_norm:
        kv = cfg.num_kv_heads * cfg.head_dim
        q, k, v = split_columns(y, (cfg.num_heads * cfg.head_dim, kv, kv), shards_of(cfg))
        q, k, v = (x.reshape(x.shape[:2] + (-1, cfg.head_dim)) for x in (q, k, v))
        q, k = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        y = fuse_columns([x.reshape(x.shape[:2] + (-1,)) for x in (q, k, v)], shards_of(cfg))
    return y.reshape(y.shape[:2] + (-1, cfg.head_dim))


def _joined(lp: dict, name: str, cfg, a: jax.Array, sizes) -> tuple:
    """``a @ w{name}`` (+ ``b{name}``), split into its parts of ``sizes`` columns."""
    y = matmul(a, lp["w" + name])
    if cfg.attention_bias:
        y = y + lp["b" + name]
    return split_columns(y, sizes, shards_of(cfg))


def project_q(
    lp: dict, cfg, a: jax.Array, positions: jax.Array, inv_freq  # a [B, T, A] attention input
) -> jax.Array:  # [B, T, Hq, D] with RoPE
    """The query alone (a layer with ``wq``: a query-only layer, or a DFlash layer's)."""
    q = matmul(a, lp["wq"])
    if cfg.attention_bias:
        q = q + lp["bq"]
    return _query(q, lp, cfg, positions, inv_freq)


def project_kv(
    lp: dict, cfg, a: jax.Array, positions: jax.Array, inv_freq  # a [B, T, A]
) -> tuple[jax.Array, jax.Array]:  # k (RoPE applied), v: [B, T, Hkv, D]
    """Keys and values alone, one product with the joined ``wkv`` (a DFlash layer's context)."""
    kv = cfg.num_kv_heads * cfg.head_dim
    return _key_value(*_joined(lp, "kv", cfg, a, (kv, kv)), lp, cfg, positions, inv_freq)


def project_qkv(
    lp: dict, cfg, a: jax.Array, positions: jax.Array, inv_freq  # a [B, T, A] attention input
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, Hq, D], k, v [B, T, Hkv, D] (q, k with RoPE)
    """q, k and v of one input: one product with the joined ``wqkv`` (two with ``wq`` and ``wkv``)."""
    if "wqkv" not in lp:
        return (project_q(lp, cfg, a, positions, inv_freq), *project_kv(lp, cfg, a, positions, inv_freq))
    kv = cfg.num_kv_heads * cfg.head_dim
    q, k, v = _joined(lp, "qkv", cfg, a, (cfg.num_heads * cfg.head_dim, kv, kv))
    return (_query(q, lp, cfg, positions, inv_freq), *_key_value(k, v, lp, cfg, positions, inv_freq))


def attention_qkv(
    lp: dict, cfg, x: jax.Array, positions: jax.Array, inv_freq  # x [B, T, H] residual stream
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, Hq, D], k, v [B, T, Hkv, D]
    """Input norm, then q/k/v projections and RoPE: the part of a layer before attention."""
    return project_qkv(lp, cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions, inv_freq)


def project_and_attend(
    lp: dict, cfg, a: jax.Array, pool: KVPool, layer: jax.Array, attn: AttentionInputs,
    positions: jax.Array, inv_freq, *, implementation,  # a [B, T, A] attention input
    tokens: int | None = None,  # the real tokens a request when ``a`` holds padding rows after them
) -> tuple[jax.Array, KVPool]:  # o [B, T, Hq, D], new pool
    """q/k/v of ``a``, RoPE, the K/V write and attention over the pool: the joined heads through
    ``rope_write_and_attend`` where the layer's weights allow it (``joins_heads``), else
    ``project_qkv`` and ``write_and_attend`` (no padding rows)."""
    tp = shards_of(cfg)
    if joins_heads(lp, cfg):
        return rope_write_and_attend(joined_qkv(lp, cfg, a), pool, layer, attn, layer_rope(cfg, positions, inv_freq),
                                     q_heads=cfg.num_heads, implementation=implementation, tensor_parallel=tp)
    if tokens is not None and tokens != a.shape[1]:
        raise ValueError("padding rows need the joined q/k/v path (joins_heads)")
    q, k, v = project_qkv(lp, cfg, a, positions, inv_freq)
    return write_and_attend(q, k, v, pool, layer, attn, implementation=implementation, tensor_parallel=tp)


def layer_tail(
    lp: dict, cfg, x: jax.Array, o: jax.Array,  # x [B, T, H] residual; o [B, T, Hq, D] attention output
    mlp_norm=None,
) -> jax.Array:  # [B, T, H] residual stream leaving the layer
    """Output projection and residual, then the SwiGLU MLP block: the part of a layer after attention.
    ``mlp_norm``: the MLP's input norm as a function of the residual (default: ``lp["mlp_norm"]``'s)."""
    B, T, _ = x.shape
    x = x + matmul(o.reshape(B, T, -1), lp["wo"])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps) if mlp_norm is None else mlp_norm(x)
    return x + gated_mlp(h, lp["w_gate_up"], lp["w_down"], shards_of(cfg))


ROUTED_EXPERTS = ("experts_gate", "experts_up", "experts_down")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer ``layer`` of the stacked weights ``stack [L, ...]``, left unsliced: a layer loop hands
    the routed experts' weights to ``routed_experts`` this way, so the grouped-matmul kernel reads
    them where they lie (a slice handed to a custom call is copied first: every expert's weights,
    every layer), while XLA's paths slice them inside their own fusions."""

    stack: jax.Array  # [L, ...]
    layer: jax.Array  # i32[]


def without_routed_experts(stacked: dict) -> dict:
    """A layer stack's weights but the routed experts': what a layer loop slices per layer."""
    return {k: v for k, v in stacked.items() if k not in ROUTED_EXPERTS}


def with_routed_experts(lp: dict, stacked: dict, layer) -> dict:
    """One layer's weights ``lp`` (sliced by the loop) plus its routed experts' weights as
    ``StackedLayer`` rows of ``stacked`` (unsliced): the loop's counterpart of
    ``without_routed_experts``."""
    layer = jnp.asarray(layer, jnp.int32)
    return {**lp, **{k: StackedLayer(stacked[k], layer) for k in ROUTED_EXPERTS if k in stacked}}


def routed_experts(
    xf: jax.Array,  # [N, H] tokens
    experts: jax.Array,  # i32[N, K] the experts each token is routed to
    weights: jax.Array,  # f32[N, K] their weights
    w_gate: jax.Array | StackedLayer,  # [E, H, I], or a layer of a stack [L, E, H, I]
    w_up: jax.Array | StackedLayer,  # [E, H, I]
    w_down: jax.Array | StackedLayer,  # [E, I, H]
    tensor_parallel: int = 1,
    limit: float | None = None,
    activation=jax.nn.silu,
    implementation=None,
) -> jax.Array:  # [N, H]
    """The routed gated experts of an MoE block (``down(activation(gate) * up)``, SwiGLU by
    default; Gemma 4's GELU-tanh): the N*K (token, expert) assignments sorted by expert and run as
    grouped matmuls, weighted and summed per token. With ``tensor_parallel`` shards the experts are
    split over the model axis: every shard runs the assignments to its own experts and one
    all-reduce sums the shards. ``limit``: clamp the gate from above and the up projection to
    [-limit, limit] before the product (DeepSeek-V4's ``swiglu_limit``).

    Three paths compute the same function (``implementation``'s ``grouped_matmul`` entry picks):
    the grouped-matmul kernel (``jaxspec.pallas.grouped_matmul``: each row tile reads its expert's
    weights once; a GPU's choice), and on XLA either the assigned experts' weights gathered by
    index (fewer assignments than experts: decode) or ``ragged_dot``, which XLA lowers densely
    (each row masked into an [E*H] row, one product with every expert's weights)."""
    stacks = tuple(w.stack if isinstance(w, StackedLayer) else w[None] for w in (w_gate, w_up, w_down))  # [L, E, ..]
    layer = w_gate.layer if isinstance(w_gate, StackedLayer) else jnp.zeros((), jnp.int32)
    N, K = experts.shape
    H, I = xf.shape[-1], stacks[0].shape[-1]
    El = stacks[0].shape[1] // tensor_parallel
    if dispatch.implementation_for("grouped_matmul", implementation) is None and N * K < El:
        path = "gathered"  # decode on any backend: the gather reads the assigned experts, as the kernel would
    else:
        why = grouped_unsupported(H, I) or grouped_unsupported(I, H)
        chosen = dispatch.choose("grouped_matmul", implementation, shape_class="grouped_matmul", unsupported=why)
        path = "pallas" if chosen == "pallas" else "gathered" if N * K < El else "ragged"

    def routed(xf, experts, weights, layer, w_gate, w_up, w_down):  # w_*: this shard's experts [L, El, ...]
        # Assignments to other shards' experts sort last, past every group.
        first = jax.lax.axis_index(MODEL) * El if tensor_parallel > 1 else 0
        local = experts.reshape(N * K) - first
        flat = jnp.where((local >= 0) & (local < El), local, El)
        order = jnp.argsort(flat, stable=True)
        token = (jnp.arange(N * K, dtype=jnp.int32) // K)[order]  # [N*K]
        weight = weights.reshape(N * K)[order]  # [N*K]
        if path == "pallas":
            sizes = jnp.bincount(flat, length=El + 1)[:El].astype(jnp.int32)  # [El]
            bm = grouped_blocks(rows=N * K, groups=El, k=H, n=I).block_m
            tiles = group_tiles(sizes, N * K, bm)
            # Tiled rows: a padding row reads a zero row (token N) and carries weight 0.
            token = jnp.concatenate([token, jnp.full((1,), N, jnp.int32)])[tiles.source]  # [T*bm]
            weight = jnp.concatenate([weight, jnp.zeros((1,), weight.dtype)])[tiles.source]
            xt = jnp.concatenate([xf, jnp.zeros((1, H), xf.dtype)])[token]  # [T*bm, H]
            interpret = dispatch.interpret_mode()
            h = grouped_matmul_tiled_pallas(xt, tiles.tile_group, w_gate, w_up=w_up, layer=layer,
                                            activation=activation, limit=limit, interpret=interpret)  # [T*bm, I]
            y = grouped_matmul_tiled_pallas(h, tiles.tile_group, w_down, layer=layer, interpret=interpret)  # [T*bm, H]
        else:
            xs = xf[token]  # [N*K, H]
            if path == "gathered":
                # XLA reads the gathered experts' rows in place inside its reductions (no copy).
                mine = flat[order] < El
                e = jnp.where(mine, flat[order], 0)
                g = jnp.einsum("ah,ahi->ai", xs, w_gate[layer, e])
                u = jnp.einsum("ah,ahi->ai", xs, w_up[layer, e])
                y = jnp.einsum("ai,aih->ah", gated_epilogue(g, u, activation, limit), w_down[layer, e])
                y = jnp.where(mine[:, None], y, jnp.zeros_like(y))  # another shard's expert: zeros, as ragged_dot
            else:
                sizes = jnp.bincount(flat, length=El + 1)[:El].astype(jnp.int32)  # [El]
                w_gate, w_up, w_down = (jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
                                        for w in (w_gate, w_up, w_down))
                g = jax.lax.ragged_dot(xs, w_gate, sizes)
                u = jax.lax.ragged_dot(xs, w_up, sizes)
                y = jax.lax.ragged_dot(gated_epilogue(g, u, activation, limit), w_down, sizes)  # [N*K, H]
        y = (y.astype(jnp.float32) * weight[:, None]).astype(xf.dtype)
        out = jnp.zeros((N + 1, H), xf.dtype).at[token].add(y)[:N]  # row N: the tiled layout's padding
        return out if tensor_parallel == 1 else jax.lax.psum(out, MODEL)

    split = P(None, MODEL, None, None)
    return per_model_shard(routed, in_specs=(P(), P(), P(), P(), split, split, split), out_specs=P(),
                           shards=tensor_parallel)(xf, experts, weights, layer, *stacks)


def mask_padded_vocab(logits: jax.Array, vocab_size: int, width: int | None = None) -> jax.Array:  # f32[..., W]
    """Logits over a vocabulary of ``vocab_size`` tokens, ``width`` columns wide (default: as
    given; narrower logits are widened), -inf at every column ``>= vocab_size``: the padding of a
    vocab-parallel head (``jaxspec.model.config.pad_vocab``) never wins an argmax, a sample, a
    top-k or a log-probability. Elementwise, so a head split over the model axis stays split."""
    width = logits.shape[-1] if width is None else width
    if logits.shape[-1] < width:
        pad = jnp.full(logits.shape[:-1] + (width - logits.shape[-1],), -jnp.inf, logits.dtype)
        logits = jnp.concatenate([logits, pad], axis=-1)
    if width <= vocab_size:
        return logits
    return jnp.where(jnp.arange(width) < vocab_size, logits, jnp.asarray(-jnp.inf, logits.dtype))


def head_logits(hidden: jax.Array, w: jax.Array, *, rows_of_w: bool = False) -> jax.Array:
    """``hidden [..., H] @ w`` accumulated and returned in f32: a head's logits (``w [H, V]``, or
    ``[V, H]`` with ``rows_of_w``, an embedding table used as the head).

    A single row of a low-precision head (a batch-1 decode step, a draft step) is computed as two
    (a zero row added, then dropped): XLA:GPU lowers a one-row bf16 x bf16 -> f32 product to a
    convert of the whole weight to f32 and an f32 GEMV. Measured on an H200 at Llama-3-8B's head
    (128256 x 4096, jaxlib 0.11.2, ``benchmarks/gpu_check.py --items profile``): 0.75 ms of convert
    + 0.50 ms of GEMV a step, where a cuBLAS product of 16 rows took 0.26 ms. The extra row only
    changes which kernel runs; each row's result is its own dot product.
    """
    spec = "...h,vh->...v" if rows_of_w else "...h,hv->...v"
    if math.prod(hidden.shape[:-1]) != 1 or w.dtype == jnp.float32:
        return jnp.einsum(spec, hidden, w, preferred_element_type=jnp.float32)
    two = jnp.concatenate([hidden.reshape(1, -1), jnp.zeros((1, hidden.shape[-1]), hidden.dtype)])  # [2, H]
    out = jnp.einsum(spec, two, w, preferred_element_type=jnp.float32)[:1]  # f32[1, V]
    return out.reshape(hidden.shape[:-1] + out.shape[-1:])


def lm_head(params: dict, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """Output head in f32: ``params["lm_head"] [H, V]``, or tied to ``params["embed"] [V, H]``."""
    if exact_on():  # the fixed-tile product, the f32 accumulator unrounded
        return matmul(hidden, params["lm_head"] if "lm_head" in params else params["embed"].T, out_dtype=jnp.float32)
    if "lm_head" in params:
        return head_logits(hidden, params["lm_head"])
    return head_logits(hidden, params["embed"], rows_of_w=True)
