"""Gemma 4 text decoder (dense, with MoE blocks, or the E2B / E4B kind) as pure functions (checkpoint names in ``jaxspec.model.checkpoints.gemma4``).

Sliding-window and full-attention layers interleave (``Gemma4Config.layer_types``); each type
has its own head width, KV heads and RoPE, so each keeps its K/V in its own part of a
``SplitPool``: full layers in ``pool.full`` (every position, the shared page table), sliding
layers in ``pool.window`` (only the last positions, the ring table; see
``jaxspec.kvcache.paging``). One layer, HF ``Gemma4TextDecoderLayer`` semantics:

    h = norm_in(x)
    q = RoPE(q_norm(h @ wq));  k = RoPE(k_norm(h @ wk));  v = v_norm(h @ wv)   (v_norm: no weight)
        full layers with attention_k_eq_v have no wv: v = v_norm(h @ wk) (the raw K projection)
        (wq, wk, wv: one product with the joined wqkv, split after it: ``jaxspec.model.fused``)
    o = attention(q, k, v) with scale 1.0 (sliding layers: keys in (p - W, p])
    x = x + post_attn_norm(o @ wo)
    m = post_mlp_norm_1(down(gelu_tanh(gate(pre_mlp_norm(x))) * up(pre_mlp_norm(x))))  (dense: no _1 norm)
    MoE blocks (26B-A4B), from the same residual x:
        r = rms(x) * router_scale / sqrt(H);  p = softmax(r @ router) in f32
        top_k of p renormalized to sum 1, each times per_expert_scale[e]
        m = m + post_moe_norm(sum_k w_k * down_e(gelu_tanh(gate_e(h)) * up_e(h))),  h = pre_moe_norm(x)
    x = x + post_mlp_norm(m)
    E2B / E4B, with the layer's per-layer input e_l [P] (``per_layer_inputs``):
        x = x + post_ple_norm(ple_proj(gelu_tanh(ple_gate(x)) * e_l))
    x = x * layer_scalar

E2B / E4B share K/V across layers: the last ``num_kv_shared_layers`` layers (``*_shared``
params) have no k/v projections and attend over the K/V that the last earlier layer of their
type keeps (``Gemma4Config.kv_source``); only the layers before them hold pool layers.

The input is ``embed[tokens] * sqrt(H)`` (the scale rounded to the weight dtype); the output
``norm(x)``; logits ``c * tanh(norm(x) . embed / c)`` with ``c = final_logit_softcapping``.
RMSNorms scale by ``w`` (not ``1 + w``), in f32 before casting back.

The layers run as a ``lax.scan`` over groups of a period of layers (the repeating pattern of
layer types, unrolled inside the group): one compiled group whatever the depth; with K/V
sharing, one scan for the layers keeping K/V and one for the sharing ones (``segments``).

Params (linear weights ``[in, out]``; ``[Lt]`` = stacked over the layers of one type):
    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    sliding/, full/ (each present when it has layers):
      attn_norm, post_attn_norm, pre_mlp_norm, post_mlp_norm [Lt, H]; layer_scalar [Lt, 1]
      wqkv [Lt, H, (Hq + 2 Hkv) * D] (k_eq_v: [Lt, H, (Hq + Hkv) * D]); q_norm, k_norm [Lt, D]
      wo [Lt, Hq*D, H]; w_gate_up [Lt, H, 2I] (joined); w_down [Lt, I, H]
      with MoE blocks also: post_mlp_norm_1, pre_moe_norm, post_moe_norm, router_scale [Lt, H];
      router [Lt, H, E]; per_expert_scale [Lt, E]; experts_gate, experts_up [Lt, E, H, Im];
      experts_down [Lt, E, Im, H]
      with per-layer inputs also: ple_gate [Lt, H, P]; ple_proj [Lt, P, H]; post_ple_norm [Lt, H]
    sliding_shared/, full_shared/ (the K/V-sharing layers): as above with wq [Lt, H, Hq * D] and
      q_norm in place of wqkv, q_norm, k_norm, and w_gate_up / w_down of the shared width
    ple_embed [Vp, L * P]; ple_projection [H, L * P]; ple_norm [P] (with per-layer inputs)

Glossary: B rows, T positions per row, H width, Hq query heads, Hkv KV heads, D head width,
L layers, P per-layer input width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import SplitPool
from jaxspec.model.fused import split_columns
from jaxspec.model.layers import (apply_rope, embed_lookup, gated_mlp, gelu_tanh, lm_head, rms_norm,
                                  rope_inv_freq, routed_experts, window_write_and_attend, with_routed_experts,
                                  without_routed_experts, write_and_attend)
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.gemma4_config import FULL, SLIDING, AttentionShape, Gemma4Config, Gemma4Moe

GROUPS = {SLIDING: "sliding", FULL: "full"}  # params group of each layer type (layers keeping K/V)
SHARED_GROUPS = {SLIDING: "sliding_shared", FULL: "full_shared"}  # the K/V-sharing layers (E2B / E4B)


def create_gemma4_pool(cfg: Gemma4Config, *, num_pages: int, page_size: int, dtype, window_pages=None) -> SplitPool:
    """Full layers in ``full`` (``num_pages``), sliding layers in ``window`` (``window_pages``);
    only the layers that keep K/V (not the K/V-sharing ones)."""
    return SplitPool.create(
        full_layers=cfg.num_full_layers, window_layers=cfg.num_sliding_layers,
        num_pages=num_pages, window_pages=window_pages or num_pages, page_size=page_size,
        full_heads=cfg.full.num_kv_heads, full_dim=cfg.full.head_dim,
        window_heads=cfg.sliding.num_kv_heads, window_dim=cfg.sliding.head_dim, dtype=dtype,
    )


def embed_scale(hidden_size: int, dtype) -> jax.Array:
    """sqrt(H), rounded to the weight dtype as HF does (bf16: 73.5 for H = 5376)."""
    return jnp.asarray(math.sqrt(hidden_size), dtype)


def norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
    return rms_norm(x, w, eps, gemma=True)


def gemma_query(
    lp: dict, shape: AttentionShape, num_heads: int, eps: float, x: jax.Array, positions: jax.Array, inv_freq
) -> jax.Array:  # x [B, T, H] residual -> q [B, T, Hq, D] (q_norm, RoPE)
    """The input norm and the query of a query-only layer (``wq``: a frozen-KV assistant layer)."""
    B, T, _ = x.shape
    q = (norm(x, lp["attn_norm"], eps) @ lp["wq"]).reshape(B, T, num_heads, shape.head_dim)
    return apply_rope(norm(q, lp["q_norm"], eps), positions, inv_freq)


def gemma_qkv(
    lp: dict, shape: AttentionShape, num_heads: int, eps: float, x: jax.Array, positions: jax.Array, inv_freq,
    shards: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # x [B, T, H] -> q [B, T, Hq, D]; k (k_norm, RoPE), v (v_norm) [B, T, Hkv, D]
    """The input norm, then q, k and v as one product with the joined ``wqkv`` (in the column
    order of ``shards`` model shards; ``k_eq_v``: [q | k], v is the raw k)."""
    B, T, _ = x.shape
    D, kvs = shape.head_dim, shape.num_kv_heads * shape.head_dim
    sizes = (num_heads * D, kvs) if shape.k_eq_v else (num_heads * D, kvs, kvs)
    q, k_raw, *v_raw = split_columns(norm(x, lp["attn_norm"], eps) @ lp["wqkv"], sizes, shards)
    q = apply_rope(norm(q.reshape(B, T, num_heads, D), lp["q_norm"], eps), positions, inv_freq)
    k_raw = k_raw.reshape(B, T, shape.num_kv_heads, D)
    v_raw = k_raw if shape.k_eq_v else v_raw[0].reshape(B, T, shape.num_kv_heads, D)
    return q, apply_rope(norm(k_raw, lp["k_norm"], eps), positions, inv_freq), norm(v_raw, None, eps)


def gemma_moe_block(lp: dict, moe: Gemma4Moe, eps: float, x: jax.Array, shards: int = 1,
                    implementation=None) -> jax.Array:
    """x [B, T, H] residual -> [B, T, H] the MoE block's output, after its post norm: the router
    and the experts both read the residual (the experts through their own input norm)."""
    B, T, H = x.shape
    xf = x.reshape(B * T, H)
    # HF's order: the weightless norm, times the scale, times H^-0.5, in the model's dtype.
    r = norm(xf, None, eps) * lp["router_scale"] * jnp.asarray(H ** -0.5, x.dtype)
    probs = jax.nn.softmax((r @ lp["router"]).astype(jnp.float32), axis=-1)  # f32[N, E]
    weights, experts = jax.lax.top_k(probs, moe.top_k)  # [N, K]
    weights = weights / weights.sum(-1, keepdims=True) * lp["per_expert_scale"].astype(jnp.float32)[experts]
    y = routed_experts(norm(xf, lp["pre_moe_norm"], eps), experts, weights, lp["experts_gate"], lp["experts_up"],
                       lp["experts_down"], shards, activation=gelu_tanh, implementation=implementation)
    return norm(y.reshape(B, T, H), lp["post_moe_norm"], eps)


def gemma_layer_tail(lp: dict, eps: float, x: jax.Array, o: jax.Array, shards: int = 1,
                     moe: Gemma4Moe | None = None, implementation=None,
                     ple_input: jax.Array | None = None) -> jax.Array:
    """x [B, T, H] residual, o [B, T, Hq, D] attention output -> the residual leaving the layer
    (gate/up joined in the column order of ``shards`` model shards; ``moe``: with its MoE block;
    ``ple_input`` [B, T, P]: the layer's per-layer input, gated in after the MLP)."""
    B, T, _ = x.shape
    x = x + norm(o.reshape(B, T, -1) @ lp["wo"], lp["post_attn_norm"], eps)
    m = gated_mlp(norm(x, lp["pre_mlp_norm"], eps), lp["w_gate_up"], lp["w_down"], shards, gelu_tanh)
    if moe is not None:
        m = norm(m, lp["post_mlp_norm_1"], eps) + gemma_moe_block(lp, moe, eps, x, shards, implementation)
    x = x + norm(m, lp["post_mlp_norm"], eps)
    if ple_input is not None:
        g = gelu_tanh(x @ lp["ple_gate"]) * ple_input  # [B, T, P]
        x = x + norm(g @ lp["ple_proj"], lp["post_ple_norm"], eps)
    return x * lp["layer_scalar"].astype(x.dtype)


def per_layer_inputs(params: dict, cfg: Gemma4Config, tokens: jax.Array, x: jax.Array) -> jax.Array | None:
    """Each token's input to every layer (E2B / E4B; None without): its row of the per-layer
    table (times sqrt(P), rounded to the weight dtype), plus the normed projection of its
    embedding x (times H^-0.5), the sum times 2^-0.5. tokens i32[B, T], x [B, T, H] -> [B, T, L, P]."""
    ple = cfg.per_layer_inputs
    if ple is None:
        return None
    B, T, _ = x.shape
    L, P = cfg.num_layers, ple.width
    own = embed_lookup(params["ple_embed"], tokens, cfg.tensor_parallel) * embed_scale(P, params["ple_embed"].dtype)
    mixed = (x @ params["ple_projection"]) * jnp.asarray(cfg.hidden_size ** -0.5, x.dtype)  # [B, T, L * P]
    mixed = norm(mixed.reshape(B, T, L, P), params["ple_norm"], cfg.rms_norm_eps)
    return (mixed + own.reshape(B, T, L, P).astype(x.dtype)) * jnp.asarray(2 ** -0.5, x.dtype)


def gemma4_forward(
    params: dict,
    cfg: Gemma4Config,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T] RoPE positions
    pool: SplitPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation=None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per request, writing their K/V into both pool parts."""
    x = embed_lookup(params["embed"], tokens, cfg.tensor_parallel) * embed_scale(cfg.hidden_size, params["embed"].dtype)
    ple = per_layer_inputs(params, cfg, tokens, x)  # [B, T, L, P] or None
    taps = AuxTaps(cfg.num_layers, aux_layers)
    # The K/V of the new tokens at the last K/V-keeping layer of each type the shared layers read.
    read_by_shared = sorted(set(cfg.layer_types[cfg.first_shared_layer:]))
    kv = {t: (jnp.zeros(x.shape[:2] + (cfg.shape_of(t).num_kv_heads, cfg.shape_of(t).head_dim), x.dtype),) * 2
          for t in read_by_shared}
    carry = (x, pool.full, pool.window, taps.empty(x), kv)
    for segment in cfg.segments():
        carry = _scan_segment(params, cfg, segment, carry, ple, positions, attn, taps, implementation)
    x, full, window, aux, _ = carry
    hidden = norm(x, params["norm"], cfg.rms_norm_eps)
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, hidden), pool=SplitPool(full=full, window=window))


def _scan_segment(params: dict, cfg: Gemma4Config, segment: tuple[int, int, int], carry, ple, positions, attn,
                  taps: AuxTaps, implementation):
    """Layers [start, end) of the decoder as a ``lax.scan`` over groups of ``period`` layers;
    carry (x, full pool, window pool, taps, kv) -> the same after the segment."""
    start, end, p = segment
    tp, shared = cfg.tensor_parallel, start >= cfg.first_shared_layer
    names = SHARED_GROUPS if shared else GROUPS
    pattern = cfg.layer_types[start:start + p]
    counts = {t: pattern.count(t) for t in (SLIDING, FULL)}
    groups = (end - start) // p
    # [Lt, ...] -> [G, n_t, ...]: group g holds layers g*n_t .. of each type.
    xs = {names[t]: jax.tree.map(lambda a, n=n: a.reshape((groups, n) + a.shape[1:]),
                                 without_routed_experts(params[names[t]]))
          for t, n in counts.items() if n}
    if ple is not None:  # [B, T, L, P] -> [G, p, B, T, P]: this segment's layers, by group
        B, T, _, P = ple.shape
        xs["ple"] = ple[:, :, start:end].reshape(B, T, groups, p, P).transpose(2, 3, 0, 1, 4)
    inv_freq = {t: rope_inv_freq(cfg.shape_of(t).rope, cfg.shape_of(t).head_dim) for t in (SLIDING, FULL)}

    def group(carry, gp):
        x, full, window, aux, kv, g = carry
        seen = {SLIDING: 0, FULL: 0}
        for k, t in enumerate(pattern):
            aux = taps.record(aux, start + g * p + k, x)
            i = seen[t]
            seen[t] += 1
            shape, index = cfg.shape_of(t), g * counts[t] + i  # index in this segment's stack of type t
            lp = with_routed_experts(jax.tree.map(lambda a, i=i: a[i], gp[names[t]]), params[names[t]], index)
            if shared:
                # No K/V of its own: the query attends over what its source layer wrote in this forward
                # (the pool; a sliding layer's causal block also reads the new K/V as they are).
                q = gemma_query(lp, shape, cfg.num_heads, cfg.rms_norm_eps, x, positions, inv_freq[t])
                kk, v = kv[t]
                layer = jnp.int32(cfg.kv_source(start + k)[1])
            else:
                q, kk, v = gemma_qkv(lp, shape, cfg.num_heads, cfg.rms_norm_eps, x, positions, inv_freq[t], tp)
                layer = index
                if t in kv:
                    kv = {**kv, t: (kk, v)}
            if t == SLIDING:
                o, window = window_write_and_attend(q, kk, v, window, layer, attn, positions, window=cfg.sliding_window,
                                                    sm_scale=1.0, tensor_parallel=tp, write=not shared)
            else:
                o, full = write_and_attend(q, kk, v, full, layer, attn, implementation=implementation, sm_scale=1.0,
                                           tensor_parallel=tp, write=not shared)
            x = gemma_layer_tail(lp, cfg.rms_norm_eps, x, o, tp, cfg.moe, implementation,
                                 ple_input=None if ple is None else gp["ple"][k])
        return (x, full, window, aux, kv, g + 1), None

    (x, full, window, aux, kv, _), _ = jax.lax.scan(group, carry + (jnp.int32(0),), xs)
    return x, full, window, aux, kv


def gemma4_logits(cfg: Gemma4Config, params: dict, hidden: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    logits = lm_head(params, hidden)
    cap = cfg.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)
