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


def attention_qkv(
    lp: dict,  # one layer's params
    cfg: LlamaConfig,
    x: jax.Array,  # [B, T, H] residual stream entering the layer
    positions: jax.Array,  # i32[B, T]
    inv_freq,  # f32[D // 2]
) -> tuple[jax.Array, jax.Array, jax.Array]:  # q [B, T, Hq, D], k, v [B, T, Hkv, D]
    """Input norm, q/k/v projections (+ Qwen2 bias, + Qwen3 per-head norm) and RoPE: the part
    of a layer before attention, shared by the paged serving forward and the dense training one."""
    B, T, _ = x.shape
    D = cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.attention_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(B, T, cfg.num_heads, D)
    k = k.reshape(B, T, cfg.num_kv_heads, D)
    v = v.reshape(B, T, cfg.num_kv_heads, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def layer_tail(
    lp: dict, cfg: LlamaConfig, x: jax.Array, o: jax.Array  # x [B, T, H]; o [B, T, Hq, D] attention output
) -> jax.Array:  # [B, T, H] residual stream leaving the layer
    """Output projection and residual, then the SwiGLU MLP block: the part of a layer after attention."""
    B, T, H = x.shape
    x = x + o.reshape(B, T, -1) @ lp["wo"]
    return x + swiglu(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp["w_gate"], lp["w_up"], lp["w_down"])


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
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
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
        q, k, v = attention_qkv(lp, cfg, x, positions, inv_freq)
        o, pool = write_and_attend(q, k, v, pool, l, attn, implementation=implementation)
        return (layer_tail(lp, cfg, x, o), pool, aux, l + 1), None

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


def llama_param_shapes(cfg: LlamaConfig) -> dict:
    """The param pytree as ``(shape, init)`` leaves, init ``"normal"`` (linear weights and
    biases) or ``"ones"`` (norms); every initializer fills this one table, in its order."""
    L, H, I, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    normal = lambda *shape: (shape, "normal")  # noqa: E731
    ones = lambda *shape: (shape, "ones")  # noqa: E731
    layers = {
        "attn_norm": ones(L, H), "wq": normal(L, H, cfg.q_size), "wk": normal(L, H, cfg.kv_size),
        "wv": normal(L, H, cfg.kv_size), "wo": normal(L, cfg.q_size, H), "mlp_norm": ones(L, H),
        "w_gate": normal(L, H, I), "w_up": normal(L, H, I), "w_down": normal(L, I, H),
    }
    if cfg.attention_bias:
        layers |= {"bq": normal(L, cfg.q_size), "bk": normal(L, cfg.kv_size), "bv": normal(L, cfg.kv_size)}
    if cfg.qk_norm:
        layers |= {"q_norm": ones(L, cfg.head_dim), "k_norm": ones(L, cfg.head_dim)}
    shapes = {"embed": normal(V, H), "layers": layers, "norm": ones(H)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = normal(H, V)
    return shapes


def fill_param_shapes(shapes: dict, normal, ones) -> dict:
    """Maps the ``(shape, init)`` leaves of a shape table to arrays in the table's insertion
    order (not ``jax.tree`` order, which sorts keys), so seeded draws stay put."""
    return {
        name: fill_param_shapes(leaf, normal, ones) if isinstance(leaf, dict)
        else (normal(leaf[0]) if leaf[1] == "normal" else ones(leaf[0]))
        for name, leaf in shapes.items()
    }


def init_llama_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params (tests, benchmarks). ``scale`` is the std of every linear weight."""
    keys = iter(jax.random.split(key, 16))
    return fill_param_shapes(
        llama_param_shapes(cfg),
        lambda shape: (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype),
        lambda shape: jnp.ones(shape, dtype),
    )
