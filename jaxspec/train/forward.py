"""Dense causal forward of a Llama-family target, for training and for computing features.

The serving forward (``jaxspec.model.llama``) writes K/V into a paged pool; training needs
neither pages nor a pool, only the same math over whole sequences with a causal mask. This
module reuses the serving building blocks (``jaxspec.model.layers``) and the same param
layout, so a model trained here is served as is (tests check it equals ``forward_sequence``).

Glossary: B sequences, T positions, H hidden, Hq / Hkv query / KV heads, G = Hq / Hkv, D head
width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import LlamaConfig
from jaxspec.model.layers import apply_rope, rms_norm, rope_inv_freq, swiglu

_MASK_VALUE = -1e30


def dense_attention(
    q: jax.Array,  # [B, T, Hq, D] (RoPE applied)
    k: jax.Array,  # [B, S, Hkv, D] (RoPE applied)
    v: jax.Array,  # [B, S, Hkv, D]
    mask: jax.Array,  # bool[T, S] or bool[B, T, S]: query row t may see key s
) -> jax.Array:  # [B, T, Hq, D]
    """Grouped-query attention with an explicit visibility mask; softmax in f32."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(D)
    mask = mask if mask.ndim == 3 else mask[None]
    s = jnp.where(mask[:, None, None], s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bhgts,bshd->bthgd", p, v)
    return o.reshape(B, T, Hq, D)


def causal_mask(T: int) -> jax.Array:  # bool[T, T]
    return jnp.tril(jnp.ones((T, T), bool))


def dense_forward(
    params: dict,
    cfg: LlamaConfig,
    tokens: jax.Array,  # i32[B, T]
    *,
    aux_layers: tuple[int, ...] = (),
    remat: bool = False,
) -> tuple[jax.Array, jax.Array | None]:  # hidden [B, T, H] (final, normed), aux [B, T, nA*H] | None
    """Causal forward over whole sequences at positions 0..T-1.

    Returns the final normed hidden state (feed it to ``jaxspec.model.llama.lm_logits``) and
    the EAGLE-3 features: the pre-norm residual streams entering ``aux_layers``,
    concatenated low to high (as ``llama_forward(..., aux_layers=...)``). ``remat``
    recomputes each layer in the backward pass (less memory, more compute).
    """
    B, T = tokens.shape
    D, Hq, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv_freq = rope_inv_freq(cfg.rope, D)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = causal_mask(T)
    x = params["embed"][tokens]  # [B, T, H]

    def layer(x, lp):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if cfg.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = q.reshape(B, T, Hq, D)
        k = k.reshape(B, T, Hkv, D)
        v = v.reshape(B, T, Hkv, D)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        o = dense_attention(q, k, v, mask)
        x_in = x
        x = x + o.reshape(B, T, Hq * D) @ lp["wo"]
        x = x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])
        return x, (x_in if aux_layers else None)  # the layer's input residual stream is its tap

    if remat:
        layer = jax.checkpoint(layer)
    x, inputs = jax.lax.scan(layer, x, params["layers"])  # inputs: [L, B, T, H]
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    aux = None
    if aux_layers:
        aux = jnp.concatenate([inputs[l] for l in aux_layers], axis=-1)  # [B, T, nA*H]
    return hidden, aux


def num_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
