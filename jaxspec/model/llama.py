"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as pure functions.

Params are a dict pytree with the per-layer weights stacked on a leading ``[L]`` axis, so
the layers run under one ``lax.scan`` (one compiled layer body, whatever the depth). Linear
weights are stored ``[in, out]``.

    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    layers/attn_norm [L, H]; wq [L, H, Hq*D]; wk, wv [L, H, Hkv*D]; wo [L, Hq*D, H]
    layers/bq [L, Hq*D], bk, bv [L, Hkv*D]      (Qwen2)
    layers/q_norm, k_norm [L, D]                (Qwen3)
    layers/mlp_norm [L, H]; w_gate, w_up [L, H, I]; w_down [L, I, H]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import LlamaConfig
from jaxspec.model.layers import apply_rope, rms_norm, rope_inv_freq, swiglu, write_and_attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """hidden: [B, T, H] final normed state; aux: [B, T, len(aux_layers) * H] or None
    (pre-norm residual streams entering the tapped layers, concatenated low to high)."""

    hidden: jax.Array
    aux: jax.Array | None
    pool: KVPool


def llama_forward(
    params: dict,
    cfg: LlamaConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T] RoPE positions
    pool: KVPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation: str | None = None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per request, writing their K/V into ``pool``."""
    x = params["embed"][tokens]  # [B, T, H]
    return llama_forward_embeds(
        params, cfg, x, positions, pool, attn, aux_layers=aux_layers, implementation=implementation
    )


def llama_forward_embeds(
    params: dict,
    cfg: LlamaConfig,
    x: jax.Array,  # [B, T, H] input embeddings
    positions: jax.Array,  # i32[B, T]
    pool: KVPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation: str | None = None,
) -> ForwardOutput:
    B, T, H = x.shape
    D, Hq, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv_freq = rope_inv_freq(cfg.rope, D)
    num_aux = len(aux_layers)
    # Layer l writes its input into aux slot tap[l]; untapped layers write the dummy slot.
    tap = np.full((cfg.num_layers,), num_aux, np.int32)
    for i, l in enumerate(aux_layers):
        tap[l] = i
    aux = jnp.zeros((num_aux + 1, B, T, H), x.dtype) if num_aux else None

    def layer(carry, lp):
        x, pool, aux, l = carry
        if aux is not None:
            aux = jax.lax.dynamic_update_index_in_dim(aux, x, jnp.asarray(tap)[l], axis=0)
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
        o, pool = write_and_attend(q, k, v, pool, l, attn, implementation=implementation)
        x = x + o.reshape(B, T, Hq * D) @ lp["wo"]
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"])
        return (x, pool, aux, l + 1), None

    (x, pool, aux, _), _ = jax.lax.scan(layer, (x, pool, aux, jnp.int32(0)), params["layers"])
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if aux is not None:
        aux = jnp.concatenate([aux[i] for i in range(num_aux)], axis=-1)  # [B, T, nA*H]
    return ForwardOutput(hidden=hidden, aux=aux, pool=pool)


def lm_logits(params: dict, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """Output head (tied to the embedding when ``lm_head`` is absent), in f32."""
    if "lm_head" in params:
        return jnp.einsum("...h,hv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("...h,vh->...v", hidden, params["embed"], preferred_element_type=jnp.float32)


def init_llama_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params (tests, benchmarks). ``scale`` is the std of every linear weight."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    keys = iter(jax.random.split(key, 16))

    def normal(shape, std=scale):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    layers = {
        "attn_norm": jnp.ones((L, H), dtype),
        "wq": normal((L, H, cfg.q_size)),
        "wk": normal((L, H, cfg.kv_size)),
        "wv": normal((L, H, cfg.kv_size)),
        "wo": normal((L, cfg.q_size, H)),
        "mlp_norm": jnp.ones((L, H), dtype),
        "w_gate": normal((L, H, I)),
        "w_up": normal((L, H, I)),
        "w_down": normal((L, I, H)),
    }
    if cfg.attention_bias:
        layers |= {"bq": normal((L, cfg.q_size)), "bk": normal((L, cfg.kv_size)), "bv": normal((L, cfg.kv_size))}
    if cfg.qk_norm:
        layers |= {"q_norm": jnp.ones((L, cfg.head_dim), dtype), "k_norm": jnp.ones((L, cfg.head_dim), dtype)}
    params = {"embed": normal((V, H)), "layers": layers, "norm": jnp.ones((H,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((H, V))
    return params
