"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as pure functions.

Params are a dict pytree with the per-layer weights stacked on a leading ``[L]`` axis, so
the layers run under one ``lax.scan`` (one compiled layer body, whatever the depth). Linear
weights are stored ``[in, out]``; ``jaxspec.model.io.llama`` holds the checkpoint names.

    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    layers/attn_norm [L, H]; wq [L, H, Hq*D]; wk, wv [L, H, Hkv*D]; wo [L, Hq*D, H]
    layers/bq [L, Hq*D], bk, bv [L, Hkv*D]      (Qwen2)
    layers/q_norm, k_norm [L, D]                (Qwen3)
    layers/mlp_norm [L, H]; w_gate, w_up [L, H, I]; w_down [L, I, H]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.layers import attention_qkv, embed_lookup, layer_tail, rms_norm, rope_inv_freq, write_and_attend
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.llama_config import LlamaConfig


def create_llama_pool(cfg: LlamaConfig, *, num_pages: int, page_size: int, dtype) -> KVPool:
    return KVPool.create(
        num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
    )


def llama_forward(
    params: dict,
    cfg: LlamaConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T] RoPE positions
    pool: KVPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation=None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per request, writing their K/V into ``pool``."""
    x = embed_lookup(params["embed"], tokens, cfg.tensor_parallel)  # [B, T, H]
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    taps = AuxTaps(cfg.num_layers, aux_layers)

    def layer(carry, lp):
        x, pool, aux, l = carry
        aux = taps.record(aux, l, x)
        q, k, v = attention_qkv(lp, cfg, x, positions, inv_freq)
        o, pool = write_and_attend(q, k, v, pool, l, attn, implementation=implementation,
                                   tensor_parallel=cfg.tensor_parallel)
        return (layer_tail(lp, cfg, x, o), pool, aux, l + 1), None

    (x, pool, aux, _), _ = jax.lax.scan(layer, (x, pool, taps.empty(x), jnp.int32(0)), params["layers"])
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, hidden), pool=pool)
