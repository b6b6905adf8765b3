"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) as pure functions.

Params are a dict pytree with the per-layer weights stacked on a leading ``[L]`` axis, so
the layers run under one ``lax.scan`` (one compiled layer body, whatever the depth). Linear
weights are stored ``[in, out]``; ``jaxspec.model.checkpoints.llama`` holds the checkpoint names.

    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    layers/attn_norm [L, H]; wqkv [L, H, (Hq + 2 Hkv) * D]; wo [L, Hq*D, H]
    layers/bqkv [L, (Hq + 2 Hkv) * D]             (Qwen2)
    layers/q_norm, k_norm [L, D]                (Qwen3: applied after the split)
    layers/mlp_norm [L, H]; w_gate_up [L, H, 2I]; w_down [L, I, H]

q/k/v (and their biases) are one joined weight and gate/up another, each run as one product and
split after it (``jaxspec.model.fused``: the columns are grouped per tensor-parallel shard).

With a ``sliding_window`` (Mistral) every layer is a sliding-window layer: the pool is a
``SplitPool`` whose full part has no layers and whose window part holds every layer (only the
last positions of each request; see ``jaxspec.kvcache.paging``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool, SplitPool
from jaxspec.model.layers import (embed_lookup, joins_heads, layer_tail, pad_attention_rows, pad_tokens, padded_tokens,
                                  project_and_attend, project_qkv, rms_norm, rope_inv_freq, stacked_rms_norm,
                                  window_write_and_attend)
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.llama_config import LlamaConfig


def create_llama_pool(cfg: LlamaConfig, *, num_pages: int, page_size: int, dtype,
                      window_pages=None) -> KVPool | SplitPool:
    """MHA pool; with a sliding window, a ``SplitPool`` of ``window_pages`` window pages."""
    if cfg.sliding_window is None:
        return KVPool.create(
            num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
        )
    return SplitPool.create(
        full_layers=0, window_layers=cfg.num_layers, num_pages=num_pages, window_pages=window_pages or num_pages,
        page_size=page_size, full_heads=cfg.num_kv_heads, full_dim=cfg.head_dim, window_heads=cfg.num_kv_heads,
        window_dim=cfg.head_dim, dtype=dtype,
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
    window = cfg.sliding_window
    layers_pool = pool if window is None else pool.window
    B, T = tokens.shape
    # The layers run over Tp >= T tokens a request, the extra rows padding that writes no K/V and
    # sees the prefix alone (nothing reads what they compute), so that no product's rows need
    # padding (``padded_tokens``); the joined q/k/v path carries them (``rope_write_and_attend``).
    Tp = padded_tokens(B, T) if window is None and joins_heads(params["layers"], cfg) else T
    x = pad_tokens(x, Tp)  # [B, Tp, H]
    aux0 = taps.empty(x)  # [nA + 1, B, Tp, H] (the padding rows dropped by ``taps.features``)
    layer_positions = pad_tokens(positions, Tp)  # padding rows: position 0, scratch slot 0 (not written)
    layer_attn = pad_attention_rows(attn, Tp)

    # The norms' stacked weights are read whole, indexed by the layer inside the norm (one kernel a
    # norm on a GPU, no copy of a layer's slice).
    attn_norms, mlp_norms = params["layers"]["attn_norm"], params["layers"]["mlp_norm"]  # [L, H] each
    norm = functools.partial(stacked_rms_norm, eps=cfg.rms_norm_eps, implementation=implementation,
                             tensor_parallel=cfg.tensor_parallel)

    def layer(carry, lp):
        x, part, aux, l = carry
        if aux is None:
            a = norm(x, attn_norms, l)
        else:  # the layer's input recorded by its first norm (the same kernel on a GPU)
            a, aux = norm(x, attn_norms, l, record=(aux, taps.tap))
        if window is None:
            o, part = project_and_attend(lp, cfg, a, part, l, layer_attn, layer_positions, inv_freq,
                                         implementation=implementation, tokens=T)
        else:
            q, k, v = project_qkv(lp, cfg, a, positions, inv_freq)
            o, part = window_write_and_attend(q, k, v, part, l, attn, positions, window=window,
                                              sm_scale=1.0 / math.sqrt(cfg.head_dim),
                                              tensor_parallel=cfg.tensor_parallel)
        x = layer_tail(lp, cfg, x, o, mlp_norm=lambda y: norm(y, mlp_norms, l))
        return (x, part, aux, l + 1), None

    (x, part, aux, _), _ = jax.lax.scan(layer, (x, layers_pool, aux0, jnp.int32(0)), params["layers"])
    hidden = rms_norm(x[:, :T], params["norm"], cfg.rms_norm_eps)
    pool = part if window is None else SplitPool(full=pool.full, window=part)
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, hidden), pool=pool)
