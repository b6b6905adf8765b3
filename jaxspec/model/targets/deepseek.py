"""DeepSeek-V3 / V3.2 target: multi-head latent attention (MLA) + DeepSeekMoE, as pure functions
(checkpoint names in ``jaxspec.model.checkpoints.deepseek``).

Attention (per layer, HF ``DeepseekV3Attention`` semantics, absorbed form):

    q      = q_proj(h)  or  q_b_proj(q_a_layernorm(q_a_proj(h)))      # [B, T, Hq, Dn + R]
    c, kr  = split(kv_a_proj_with_mqa(h), [C, R]);  c = kv_a_layernorm(c)
    q_rope, kr = RoPE(q_rope), RoPE(kr)       (interleaved pairs on the R rope dims)
    pool[layer, slot] = [c | kr]                                       # [C + R] per token
    q_latent = W_uk^T q_nope                  (k half of kv_b_proj absorbed into the query)
    o = W_uv (sum_k softmax(sm_scale * (q_latent.c_k + q_rope.kr_k)) c_k);  out = o_proj(o)

MLP: SwiGLU for the first ``first_k_dense_replace`` layers, DeepSeekMoE after (sigmoid router
with ``e_score_correction_bias`` for selection only, group-limited top-k, routed scaling,
shared experts). The dense prefix and the MoE layers run as two ``lax.scan`` s (two compiled
layer bodies, whatever the depth).

DeepSeek-V3.2 (DSA) adds a lightning indexer per layer (HF ``DeepseekV32Indexer``):

    k_idx  = RoPE_half(LayerNorm(h @ wk))                 # [B, T, Di], written to MLAPool.index_k
    q_idx  = RoPE_half((q_a_layernorm(q_a_proj(h))) @ wq_b)   # [B, T, Hi, Di]
    w      = (h @ weights_proj) * Hi^-0.5 * Di^-0.5        # f32[B, T, Hi]
    score[t, j] = sum_h w[t, h] relu(q_idx[t, h] . k_idx[j]) over the positions t may see

(rotate-half RoPE on the FIRST R dims, unlike MLA's interleaved RoPE on its last R). Each row
attends to its ``index_topk`` best positions only (``jaxspec.pallas.dsa_indexer``,
``jaxspec.pallas.mla_sparse_attention``). A forward whose page table covers at most
``index_topk`` positions attends densely: every visible position would be selected anyway.

Params (linear weights ``[in, out]``; ``[Ls]`` = stacked over the layers of a scan):
    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    dense/, moe/ (each present when it has layers):
      attn_norm [Ls, H]; wq [Ls, H, Hq*Dqk]  or  wq_a [Ls, H, Rq], q_a_norm [Ls, Rq], wq_b [Ls, Rq, Hq*Dqk]
      wkv_a [Ls, H, C+R]; kv_a_norm [Ls, C]; w_uk [Ls, Hq, Dn, C]; w_uv [Ls, Hq, C, Dv]; wo [Ls, Hq*Dv, H]
      idx_wq_b [Ls, Rq, Hi*Di], idx_wk [Ls, H, Di], idx_norm_w, idx_norm_b [Ls, Di],
      idx_w_proj f32[Ls, H, Hi]                                         (V3.2 indexer)
      mlp_norm [Ls, H]
      dense: w_gate_up [Ls, H, 2I] (gate and up joined: ``jaxspec.model.fused``); w_down [Ls, I, H]
      moe:   router [Ls, H, E]; router_bias f32[Ls, E]; experts_gate, experts_up [Ls, E, H, Im];
             experts_down [Ls, E, Im, H]; shared_gate_up [Ls, H, 2Is]; shared_down [Ls, Is, H]
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import MLAPool
from jax.sharding import PartitionSpec as P

from jaxspec.mesh import MODEL, per_model_shard
from jaxspec.model.layers import (apply_rope, embed_lookup, gated_mlp, rms_norm, routed_experts, with_routed_experts,
                                  without_routed_experts)
from jaxspec.model.targets.base import AuxTaps, ForwardOutput
from jaxspec.model.targets.deepseek_config import DeepseekConfig, MLARope, MoEConfig
from jaxspec.pallas.dsa_indexer import indexer_top_k
from jaxspec.pallas.mla_attention import mla_attention
from jaxspec.pallas.mla_sparse_attention import mla_sparse_attention

# ------------------------------------------------------------------------------------ pool


def create_mla_pool(cfg: DeepseekConfig, *, num_pages: int, page_size: int, dtype, num_layers: int | None = None) -> MLAPool:
    """MLA pool ``kv: [L, num_slots, C + R]`` (+ ``index_k: [L, num_slots, Di]`` with an indexer)."""
    return MLAPool.create(
        num_layers=cfg.num_layers if num_layers is None else num_layers,
        num_pages=num_pages, page_size=page_size, kv_dim=cfg.kv_dim,
        index_dim=cfg.index_head_dim if cfg.has_indexer else 0, dtype=dtype,
    )


# ------------------------------------------------------------------------------------ forward


def _rope(x: jax.Array, positions: jax.Array, rope: MLARope, inv_freq: np.ndarray, interleave: bool) -> jax.Array:
    """RoPE on ``x: [B, T, H, R]``. Interleaved pairs are de-interleaved first (evens, then
    odds), as HF writes them; q and k get the same layout, so q.k is unchanged."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, inv_freq, scale=rope.cos_sin_scale)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm in f32 (the V3.2 indexer's ``k_norm``), cast back to ``x.dtype``."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def indexer_key(
    lp: dict, cfg: DeepseekConfig, h: jax.Array, positions: jax.Array, inv_freq: np.ndarray
) -> jax.Array:  # [B, T, Di]
    """V3.2 lightning-indexer key of each token: ``LayerNorm(h @ wk)`` with rotate-half
    (non-interleaved) RoPE on its first R dims. ``h`` is the attention input (after
    ``input_layernorm``). The Hadamard rotation of DeepSeek's reference is omitted: it is
    orthogonal and applied to queries and keys alike, so index scores are unchanged."""
    R = cfg.qk_rope_head_dim
    k = layer_norm(h @ lp["idx_wk"], lp["idx_norm_w"], lp["idx_norm_b"])  # [B, T, Di]
    k_rope = _rope(k[:, :, None, :R], positions, cfg.rope, inv_freq, interleave=False)[:, :, 0]
    return jnp.concatenate([k_rope, k[..., R:]], axis=-1)


def indexer_query(
    lp: dict, cfg: DeepseekConfig, h: jax.Array, q_resid: jax.Array, positions: jax.Array, inv_freq: np.ndarray
) -> tuple[jax.Array, jax.Array]:  # [B, T, Hi, Di], f32[B, T, Hi]
    """V3.2 indexer queries (from the q-LoRA residual ``q_resid``, rotate-half RoPE on the
    first R dims of each head) and head weights carrying both of HF's scales
    (``weights_proj(h) * Hi^-0.5 * Di^-0.5``; the second moves through the score's ReLU)."""
    B, T, _ = h.shape
    Hi, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = (q_resid @ lp["idx_wq_b"]).reshape(B, T, Hi, Di)
    q = jnp.concatenate([_rope(q[..., :R], positions, cfg.rope, inv_freq, interleave=False), q[..., R:]], axis=-1)
    w = jnp.dot(h.astype(jnp.float32), lp["idx_w_proj"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return q, w * (Hi ** -0.5 * Di ** -0.5)


def uses_sparse_attention(cfg: DeepseekConfig, lp: dict, attn: AttentionInputs, page_size: int) -> bool:
    """Static: this forward selects positions with the indexer. It does when the layer has
    one and its page table covers more than ``index_topk`` positions; otherwise every row
    sees at most ``index_topk`` positions, all of which the indexer would select (dense)."""
    return "idx_wq_b" in lp and attn.page_table.shape[1] * page_size > cfg.index_topk


def mla_projections(
    lp: dict, cfg: DeepseekConfig, h: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Absorbed-MLA projections of ``h: [B, T, H]`` (after ``input_layernorm``): the queries in
    latent space ``q_latent [B, T, Hq, C]`` (``q_nope @ w_uk``) and ``q_rope [B, T, Hq, R]``, the
    pool's row for each token ``[B, T, C + R]`` (normed latent, roped shared key), and the q-LoRA
    residual ``[B, T, Rq]`` the indexer reads (None without q LoRA). A query at t scores key s as
    ``(q_latent[t] . row[s, :C] + q_rope[t] . row[s, C:]) * sm_scale``."""
    B, T, _ = h.shape
    Hq, Dn, R, C = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    inv_freq = cfg.rope.inv_freq(R)
    q_resid = None
    if cfg.q_lora_rank is None:
        q = h @ lp["wq"]
    else:
        q_resid = rms_norm(h @ lp["wq_a"], lp["q_a_norm"], cfg.rms_norm_eps)  # [B, T, Rq]
        q = q_resid @ lp["wq_b"]
    q = q.reshape(B, T, Hq, Dn + R)
    q_nope, q_rope = q[..., :Dn], q[..., Dn:]
    q_rope = _rope(q_rope, positions, cfg.rope, inv_freq, cfg.rope.interleave)  # [B, T, Hq, R]
    kv = h @ lp["wkv_a"]  # [B, T, C + R]
    latent = rms_norm(kv[..., :C], lp["kv_a_norm"], cfg.rms_norm_eps)  # [B, T, C]
    k_rope = _rope(kv[:, :, None, C:], positions, cfg.rope, inv_freq, cfg.rope.interleave)[:, :, 0]  # [B, T, R]
    row = jnp.concatenate([latent, k_rope], axis=-1)  # [B, T, C + R]
    q_latent = jnp.einsum("bthd,hdc->bthc", q_nope, lp["w_uk"])  # [B, T, Hq, C]
    return q_latent, q_rope, row, q_resid


def mla_attention_block(
    lp: dict,
    cfg: DeepseekConfig,
    h: jax.Array,  # [B, T, H] (after input_layernorm)
    positions: jax.Array,  # i32[B, T]
    pool: MLAPool,
    layer: jax.Array,  # i32[] pool layer
    attn: AttentionInputs,
    *,
    implementation: str | None,
) -> tuple[jax.Array, MLAPool]:  # [B, T, H], new pool
    """Writes this forward's latent (and indexer key) into ``pool`` first, then attends
    through the page table (absorbed MLA)."""
    B, T, _ = h.shape
    inv_freq = cfg.rope.inv_freq(cfg.qk_rope_head_dim)
    q_latent, q_rope, row, q_resid = mla_projections(lp, cfg, h, positions)
    index_k = indexer_key(lp, cfg, h, positions, inv_freq) if "idx_wk" in lp else None
    slots = attn.write_slots.reshape(B * T)
    pool = pool.write(layer, slots, row.reshape(B * T, -1), None if index_k is None else index_k.reshape(B * T, -1))
    heads = P(None, None, MODEL, None)

    if uses_sparse_attention(cfg, lp, attn, pool.page_size):
        # Every model shard selects the same positions (replicated indexer), then attends
        # with its own heads over them.
        index_q, index_w = indexer_query(lp, cfg, h, q_resid, positions, inv_freq)
        def select(index_q, index_w, index_k, layer, page_table, prefix_lens, block_mask):
            return indexer_top_k(index_q, index_w, index_k, layer, page_table, prefix_lens, block_mask,
                                 page_size=pool.page_size, topk=cfg.index_topk, implementation=implementation)

        # Replicated: every model shard runs the whole indexer (a kernel call inside one shard).
        slots = per_model_shard(select, in_specs=(P(),) * 7, out_specs=P(), shards=cfg.tensor_parallel)(
            index_q, index_w, pool.index_k, layer, attn.page_table, attn.prefix_lens, attn.block_mask)  # i32[B, T, topk]

        def attend_selected(q_latent, q_rope, kv, layer, slots):
            return mla_sparse_attention(q_latent, q_rope, kv, layer, slots, sm_scale=cfg.sm_scale,
                                        implementation=implementation)

        o = per_model_shard(attend_selected, in_specs=(heads, heads, P(), P(), P()), out_specs=heads,
                            shards=cfg.tensor_parallel)(q_latent, q_rope, pool.kv, layer, slots)  # [B, T, Hq, C]
    else:
        def attend(q_latent, q_rope, kv, layer, attn):  # per model shard: its heads, the whole latent
            return mla_attention(
                q_latent, q_rope, kv, layer, attn.page_table, attn.prefix_lens, attn.block_mask,
                page_size=pool.page_size, sm_scale=cfg.sm_scale, implementation=implementation,
            )

        o = per_model_shard(attend, in_specs=(heads, heads, P(), P(), jax.tree.map(lambda _: P(), attn)),
                            out_specs=heads, shards=cfg.tensor_parallel)(q_latent, q_rope, pool.kv, layer, attn)
    o = jnp.einsum("bthc,hcv->bthv", o, lp["w_uv"]).reshape(B, T, cfg.num_heads * cfg.v_head_dim)
    return o @ lp["wo"], pool


def moe_mlp(lp: dict, moe: MoEConfig, x: jax.Array, tensor_parallel: int = 1,
            implementation=None) -> jax.Array:  # [B, T, H] -> [B, T, H]
    """DeepSeekMoE: group-limited sigmoid routing (bias for selection only), the routed experts
    (``routed_experts``), plus the shared experts."""
    B, T, H = x.shape
    N, E, K, G = B * T, moe.num_experts, moe.num_experts_per_tok, moe.n_group
    xf = x.reshape(N, H)
    logits = jnp.dot(xf.astype(jnp.float32), lp["router"].astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)  # f32[N, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + lp["router_bias"].astype(jnp.float32)
    if moe.topk_group < G:
        grouped = choice.reshape(N, G, E // G)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, moe.topk_group)  # [N, topk_group]
        group_mask = jnp.any(jax.nn.one_hot(keep, G, dtype=jnp.bool_), axis=1)  # [N, G]
        choice = jnp.where(jnp.repeat(group_mask, E // G, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, K)  # i32[N, K]
    weights = jnp.take_along_axis(scores, experts, axis=1)  # f32[N, K]
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor

    out = routed_experts(xf, experts, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"],
                         tensor_parallel, implementation=implementation)
    if moe.n_shared_experts:
        out = out + gated_mlp(xf, lp["shared_gate_up"], lp["shared_down"], tensor_parallel)
    return out.reshape(B, T, H)


def decoder_block(
    lp: dict,
    cfg: DeepseekConfig,
    x: jax.Array,  # [B, T, H] residual stream
    positions: jax.Array,  # i32[B, T]
    pool: MLAPool,
    layer: jax.Array,  # i32[]
    attn: AttentionInputs,
    *,
    moe: bool,
    implementation: str | None,
) -> tuple[jax.Array, MLAPool]:
    """One DeepSeek decoder layer (pre-norm MLA, then dense or MoE MLP)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    o, pool = mla_attention_block(lp, cfg, h, positions, pool, layer, attn, implementation=implementation)
    x = x + o
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    x = x + (moe_mlp(lp, cfg.moe, h, cfg.tensor_parallel, implementation) if moe
             else gated_mlp(h, lp["w_gate_up"], lp["w_down"], cfg.tensor_parallel))
    return x, pool


def deepseek_forward(
    params: dict,
    cfg: DeepseekConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T] RoPE positions
    pool: MLAPool,
    attn: AttentionInputs,
    *,
    aux_layers: tuple[int, ...] = (),
    implementation: str | None = None,
) -> ForwardOutput:
    """Runs the decoder over T new tokens per request, writing their latent KV (and indexer
    keys) into ``pool``; same contract as ``llama_forward``."""
    x = embed_lookup(params["embed"], tokens, cfg.tensor_parallel)  # [B, T, H]
    taps = AuxTaps(cfg.num_layers, aux_layers)
    aux = taps.empty(x)
    layer0, first = jnp.int32(0), 0  # the group's first layer, traced and static
    for group, is_moe in (("dense", False), ("moe", True)):
        if group not in params:
            continue
        stacked = params[group]

        def body(carry, lp, is_moe=is_moe, stacked=stacked, first=first):
            x, pool, aux, l = carry
            aux = taps.record(aux, l, x)
            lp = with_routed_experts(lp, stacked, l - first)  # the experts read where they lie
            x, pool = decoder_block(lp, cfg, x, positions, pool, l, attn, moe=is_moe, implementation=implementation)
            return (x, pool, aux, l + 1), None

        (x, pool, aux, layer0), _ = jax.lax.scan(body, (x, pool, aux, layer0), without_routed_experts(stacked))
        first += jax.tree.leaves(stacked)[0].shape[0]
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return ForwardOutput(hidden=hidden, aux=taps.features(aux, hidden), pool=pool)
