"""Dense causal forward of a Llama-family target, for training and for computing features.

The serving forward (``jaxspec.model.targets.llama``) writes K/V into a paged pool; training needs
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

from jaxspec.model.layers import attention_qkv, layer_tail, lm_head, rms_norm, rope_inv_freq
from jaxspec.model.targets import forward_fresh
from jaxspec.model.targets.llama_config import LlamaConfig

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

    Returns the final normed hidden state (feed it to ``jaxspec.model.layers.lm_head``) and
    the draft features: the pre-norm residual streams entering ``aux_layers`` (``L``: the final
    normed state, as HF's last ``hidden_states``), concatenated in that order (as ``llama_forward(..., aux_layers=...)``). ``remat``
    recomputes each layer in the backward pass (less memory, more compute).
    """
    B, T = tokens.shape
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = causal_mask(T)
    x = params["embed"][tokens]  # [B, T, H]

    def layer(x, lp):
        q, k, v = attention_qkv(lp, cfg, x, positions, inv_freq)
        o = dense_attention(q, k, v, mask)
        return layer_tail(lp, cfg, x, o), (x if aux_layers else None)  # the layer's input residual stream is its tap

    if remat:
        layer = jax.checkpoint(layer)
    x, inputs = jax.lax.scan(layer, x, params["layers"])  # inputs: [L, B, T, H]
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    aux = None
    if aux_layers:
        taps = [hidden if l == cfg.num_layers else inputs[l] for l in aux_layers]
        aux = jnp.concatenate(taps, axis=-1)  # [B, T, nA*H]
    return hidden, aux


def frozen_target_forward(params: dict, cfg, tokens: jax.Array, *, aux_layers: tuple[int, ...] = ()):
    """A frozen target's (hidden [B, T, H], aux) for draft training: ``dense_forward`` for the Llama
    family, the serving forward over a fresh pool for the others (no gradient flows into a target)."""
    if isinstance(cfg, LlamaConfig):
        return dense_forward(params, cfg, tokens, aux_layers=aux_layers)
    dtype = jax.tree.leaves(params)[0].dtype
    _, hidden, aux = forward_fresh(cfg, params, tokens, dtype=dtype, aux_layers=aux_layers)
    return hidden, aux


def frozen_block_inputs(target_params: dict, tcfg, tokens: jax.Array, target_layer_ids) -> tuple[jax.Array, jax.Array]:
    """What a block drafter (DFlash, DSpark) trains against, from the frozen target over windows
    ``tokens`` i32[B, T+1]: its logits f32[B, T+1, V] (the labels) and its features at positions
    0..T-1 f32[B, T, F] (the taps after ``target_layer_ids``), no gradient into either."""
    hidden, aux = frozen_target_forward(target_params, tcfg, tokens, aux_layers=tuple(l + 1 for l in target_layer_ids))
    t_logits = jax.lax.stop_gradient(lm_head(target_params, hidden))  # [B, T+1, V]
    features = jax.lax.stop_gradient(aux[:, :-1]).astype(jnp.float32)  # [B, T, F]
    return t_logits, features


def num_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
