"""Building blocks shared by targets, draft heads and training: RMSNorm, RoPE, SwiGLU, paged
attention, and the Llama layer body (q/k/v projection before attention, output projection and
MLP after it) that the Llama-family targets, the EAGLE heads, the frozen-KV assistant and the
dense training forwards all run.

Glossary: B rows, T positions per row, H model width, Hq / Hkv query / KV heads, D head width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.mesh import MODEL, per_model_shard
from jaxspec.model.config import RopeConfig
from jaxspec.pallas.paged_attention import paged_attention


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF-style RMSNorm: normalize in f32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:  # f32[dim // 2]
    """Inverse frequencies, including linear and llama3 scaling (computed once, host side)."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "linear":
        inv = inv / np.float32(rope.factor)
    elif rope.kind == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope.kind != "default":
        raise ValueError(f"unsupported rope kind {rope.kind!r}")
    return inv


def apply_rope(
    x: jax.Array,  # [B, T, H, D]
    positions: jax.Array,  # i32[B, T]
    inv_freq: np.ndarray,  # f32[D // 2]
    scale: float = 1.0,
) -> jax.Array:  # [B, T, H, D]
    """Rotate-half RoPE (HF Llama convention) at integer ``positions``."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos = (jnp.cos(emb) * scale).astype(x.dtype)
    sin = (jnp.sin(emb) * scale).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


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
) -> tuple[jax.Array, KVPool]:  # [B, T, Hq, D], new pool
    """Writes the new K/V into the pool first, then attends through the page table, so a
    token reads its own (pool-dtype) K/V exactly as later tokens will. With ``tensor_parallel``
    shards, heads and the pool's KV heads are split over the mesh's model axis and every shard
    attends over its own heads."""
    D = k.shape[-1]

    def local(q, k, v, pool, layer, attn):
        B, T, Hkv, _ = k.shape
        pool = pool.write(layer, attn.write_slots.reshape(B * T), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D))
        o = paged_attention(
            q, pool.k, pool.v, layer, attn.page_table, attn.prefix_lens, attn.block_mask,
            page_size=pool.page_size, sm_scale=sm_scale or 1.0 / math.sqrt(D), implementation=implementation,
        )
        return o, pool

    heads = P(None, None, MODEL, None)
    rep = jax.tree.map(lambda _: P(), attn)
    fn = per_model_shard(local, in_specs=(heads, heads, heads, jax.tree.map(lambda _: heads, pool), P(), rep),
                         out_specs=(heads, jax.tree.map(lambda _: heads, pool)), shards=tensor_parallel)
    return fn(q, k, v, pool, layer, attn)


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


# ------------------------------------------------------------------------------- Llama layer
#
# A Llama-family layer (and every head built from one) is
#     q, k, v = project(norm(x));  o = attention(q, k, v);  x' = layer_tail(x, o)
# ``cfg`` is any config with num_heads, num_kv_heads, head_dim, rms_norm_eps, attention_bias
# (Qwen2 q/k/v bias) and qk_norm (Qwen3 per-head RMSNorm before RoPE). Weights ``[in, out]``.


def project_q(
    lp: dict, cfg, a: jax.Array, positions: jax.Array, inv_freq  # a [B, T, A] attention input
) -> jax.Array:  # [B, T, Hq, D] with RoPE
    B, T, _ = a.shape
    q = a @ lp["wq"]
    if cfg.attention_bias:
        q = q + lp["bq"]
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq)


def project_kv(
    lp: dict, cfg, a: jax.Array, positions: jax.Array, inv_freq  # a [B, T, A]
) -> tuple[jax.Array, jax.Array]:  # k (RoPE applied), v: [B, T, Hkv, D]
    B, T, _ = a.shape
    k, v = a @ lp["wk"], a @ lp["wv"]
    if cfg.attention_bias:
        k, v = k + lp["bk"], v + lp["bv"]
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, positions, inv_freq), v


def attention_qkv(
    lp: dict, cfg, x: jax.Array, positions: jax.Array, inv_freq  # x [B, T, H] residual stream
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, Hq, D], k, v [B, T, Hkv, D]
    """Input norm, then q/k/v projections and RoPE: the part of a layer before attention."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    return (project_q(lp, cfg, h, positions, inv_freq), *project_kv(lp, cfg, h, positions, inv_freq))


def layer_tail(
    lp: dict, cfg, x: jax.Array, o: jax.Array  # x [B, T, H] residual; o [B, T, Hq, D] attention output
) -> jax.Array:  # [B, T, H] residual stream leaving the layer
    """Output projection and residual, then the SwiGLU MLP block: the part of a layer after attention."""
    B, T, _ = x.shape
    x = x + o.reshape(B, T, -1) @ lp["wo"]
    return x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])


def lm_head(params: dict, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """Output head in f32: ``params["lm_head"] [H, V]``, or tied to ``params["embed"] [V, H]``."""
    if "lm_head" in params:
        return jnp.einsum("...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
