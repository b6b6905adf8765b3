"""DeepSeek-V3 / V3.2 target: multi-head latent attention (MLA) + DeepSeekMoE, as pure functions.

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

DeepSeek-V3.2 (DSA) adds a lightning indexer per layer. Its per-token key
``k_idx = RoPE_half(LayerNorm(h @ wk))`` (rotate-half RoPE on the first R dims) is written to
``MLAPool.index_k`` with the latent. Attention stays dense: sparse top-k selection only changes
anything for queries that see more than ``index_topk`` positions (see ``DeepseekConfig``).

Params (linear weights ``[in, out]``; ``[Ls]`` = stacked over the layers of a scan):
    embed [V, H]; norm [H]; lm_head [H, V] (absent when tied)
    dense/, moe/ (each present when it has layers):
      attn_norm [Ls, H]; wq [Ls, H, Hq*Dqk]  or  wq_a [Ls, H, Rq], q_a_norm [Ls, Rq], wq_b [Ls, Rq, Hq*Dqk]
      wkv_a [Ls, H, C+R]; kv_a_norm [Ls, C]; w_uk [Ls, Hq, Dn, C]; w_uv [Ls, Hq, C, Dv]; wo [Ls, Hq*Dv, H]
      idx_wk [Ls, H, Di], idx_norm_w, idx_norm_b [Ls, Di]              (V3.2 indexer)
      mlp_norm [Ls, H]
      dense: w_gate, w_up [Ls, H, I]; w_down [Ls, I, H]
      moe:   router [Ls, H, E]; router_bias f32[Ls, E]; experts_gate, experts_up [Ls, E, H, Im];
             experts_down [Ls, E, Im, H]; shared_gate, shared_up [Ls, H, Is]; shared_down [Ls, Is, H]
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import MLAPool
from jaxspec.model.checkpoint import CheckpointError, SafetensorsCheckpoint
from jaxspec.model.deepseek_config import (  # noqa: F401  (re-exported: the config lives there)
    ARCHITECTURES,
    MODEL_TYPES,
    DeepseekConfig,
    MLARope,
    MoEConfig,
    deepseek_config_from_hf,
    parse_mla_rope,
    yarn_mscale,
)
from jaxspec.model.layers import apply_rope, rms_norm, swiglu
from jaxspec.model.llama import ForwardOutput
from jaxspec.pallas.mla_attention import mla_attention

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
    Hq, Dn, R, C = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    inv_freq = cfg.rope.inv_freq(R)
    if cfg.q_lora_rank is None:
        q = h @ lp["wq"]
    else:
        q = rms_norm(h @ lp["wq_a"], lp["q_a_norm"], cfg.rms_norm_eps) @ lp["wq_b"]
    q = q.reshape(B, T, Hq, Dn + R)
    q_nope, q_rope = q[..., :Dn], q[..., Dn:]
    q_rope = _rope(q_rope, positions, cfg.rope, inv_freq, cfg.rope.interleave)  # [B, T, Hq, R]
    kv = h @ lp["wkv_a"]  # [B, T, C + R]
    latent = rms_norm(kv[..., :C], lp["kv_a_norm"], cfg.rms_norm_eps)  # [B, T, C]
    k_rope = _rope(kv[:, :, None, C:], positions, cfg.rope, inv_freq, cfg.rope.interleave)[:, :, 0]  # [B, T, R]
    row = jnp.concatenate([latent, k_rope], axis=-1)  # [B, T, C + R]
    index_k = indexer_key(lp, cfg, h, positions, inv_freq) if "idx_wk" in lp else None
    slots = attn.write_slots.reshape(B * T)
    pool = pool.write(layer, slots, row.reshape(B * T, -1), None if index_k is None else index_k.reshape(B * T, -1))
    q_latent = jnp.einsum("bthd,hdc->bthc", q_nope, lp["w_uk"])  # [B, T, Hq, C]
    o = mla_attention(
        q_latent, q_rope, pool.kv, layer, attn.page_table, attn.prefix_lens, attn.block_mask,
        page_size=pool.page_size, sm_scale=cfg.sm_scale, implementation=implementation,
    )  # [B, T, Hq, C]
    o = jnp.einsum("bthc,hcv->bthv", o, lp["w_uv"]).reshape(B, T, Hq * cfg.v_head_dim)
    return o @ lp["wo"], pool


def moe_mlp(lp: dict, moe: MoEConfig, x: jax.Array) -> jax.Array:  # [B, T, H] -> [B, T, H]
    """DeepSeekMoE: group-limited sigmoid routing (bias for selection only), routed experts
    as grouped matmuls over tokens sorted by expert, plus the shared experts."""
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
    # Sort the N*K (token, expert) assignments by expert and run one grouped matmul.
    flat = experts.reshape(N * K)
    order = jnp.argsort(flat, stable=True)
    token = (jnp.arange(N * K, dtype=jnp.int32) // K)[order]  # [N*K]
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
    xs = xf[token]  # [N*K, H]
    g = jax.lax.ragged_dot(xs, lp["experts_gate"], sizes)
    u = jax.lax.ragged_dot(xs, lp["experts_up"], sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, lp["experts_down"], sizes)  # [N*K, H]
    y = (y.astype(jnp.float32) * weights.reshape(N * K)[order][:, None]).astype(x.dtype)
    out = jnp.zeros((N, H), x.dtype).at[token].add(y)
    if moe.n_shared_experts:
        out = out + swiglu(xf, lp["shared_gate"], lp["shared_up"], lp["shared_down"])
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
    x = x + (moe_mlp(lp, cfg.moe, h) if moe else swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"]))
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
    x = params["embed"][tokens]  # [B, T, H]
    B, T, H = x.shape
    num_aux = len(aux_layers)
    tap = np.full((cfg.num_layers,), num_aux, np.int32)  # layer -> aux slot (num_aux = dummy)
    for i, l in enumerate(aux_layers):
        tap[l] = i
    aux = jnp.zeros((num_aux + 1, B, T, H), x.dtype) if num_aux else None
    layer0 = jnp.int32(0)
    for group, is_moe in (("dense", False), ("moe", True)):
        if group not in params:
            continue

        def body(carry, lp, is_moe=is_moe):
            x, pool, aux, l = carry
            if aux is not None:
                aux = jax.lax.dynamic_update_index_in_dim(aux, x, jnp.asarray(tap)[l], axis=0)
            x, pool = decoder_block(lp, cfg, x, positions, pool, l, attn, moe=is_moe, implementation=implementation)
            return (x, pool, aux, l + 1), None

        (x, pool, aux, layer0), _ = jax.lax.scan(body, (x, pool, aux, layer0), params[group])
    hidden = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if aux is not None:
        aux = jnp.concatenate([aux[i] for i in range(num_aux)], axis=-1)  # [B, T, nA*H]
    return ForwardOutput(hidden=hidden, aux=aux, pool=pool)


# ------------------------------------------------------------------------------------ params


def layer_param_shapes(cfg: DeepseekConfig, *, moe: bool, indexer: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's params (unstacked) in our layout."""
    H, Hq, Dn, R, C, Dv = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.kv_lora_rank, cfg.v_head_dim)
    s: dict[str, tuple[int, ...]] = {"attn_norm": (H,)}
    if cfg.q_lora_rank is None:
        s["wq"] = (H, Hq * (Dn + R))
    else:
        s |= {"wq_a": (H, cfg.q_lora_rank), "q_a_norm": (cfg.q_lora_rank,), "wq_b": (cfg.q_lora_rank, Hq * (Dn + R))}
    s |= {"wkv_a": (H, C + R), "kv_a_norm": (C,), "w_uk": (Hq, Dn, C), "w_uv": (Hq, C, Dv), "wo": (Hq * Dv, H)}
    if cfg.has_indexer if indexer is None else indexer:
        Di = cfg.index_head_dim
        s |= {"idx_wk": (H, Di), "idx_norm_w": (Di,), "idx_norm_b": (Di,)}
    s["mlp_norm"] = (H,)
    if not moe:
        I = cfg.intermediate_size
        return s | {"w_gate": (H, I), "w_up": (H, I), "w_down": (I, H)}
    m = cfg.moe
    E, Im = m.num_experts, m.moe_intermediate_size
    s |= {"router": (H, E), "router_bias": (E,), "experts_gate": (E, H, Im), "experts_up": (E, H, Im),
          "experts_down": (E, Im, H)}
    if m.n_shared_experts:
        Is = m.shared_intermediate_size
        s |= {"shared_gate": (H, Is), "shared_up": (H, Is), "shared_down": (Is, H)}
    return s


_ONES = ("attn_norm", "q_a_norm", "kv_a_norm", "mlp_norm", "idx_norm_w")


def host_rng(key: jax.Array) -> np.random.Generator:
    """Host RNG seeded from a JAX key (random init without compiling a program per shape)."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())


def init_layer_params(cfg: DeepseekConfig, key: jax.Array, *, moe: bool, num: int | None = None,
                      dtype=jnp.float32, scale: float = 0.02, indexer: bool | None = None) -> dict:
    """Random params of one layer (``num=None``) or ``num`` stacked layers (tests, benchmarks):
    norm weights 1, LayerNorm bias 0, everything else N(0, scale^2) (``router_bias`` in f32)."""
    rng = host_rng(key)
    lead = () if num is None else (num,)
    out = {}
    for name, shape in layer_param_shapes(cfg, moe=moe, indexer=indexer).items():
        full = lead + shape
        if name in _ONES:
            x = np.ones(full, np.float32)
        elif name == "idx_norm_b":
            x = np.zeros(full, np.float32)
        else:
            x = scale * rng.standard_normal(full, dtype=np.float32)
        out[name] = jnp.asarray(x, jnp.float32 if name == "router_bias" else dtype)
    return out


def init_deepseek_params(cfg: DeepseekConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params in the layout of ``load_deepseek_params`` (tests, benchmarks)."""
    k_embed, k_dense, k_moe = jax.random.split(key, 3)
    rng = host_rng(k_embed)
    H, V = cfg.hidden_size, cfg.vocab_size
    params = {
        "embed": jnp.asarray(scale * rng.standard_normal((V, H), dtype=np.float32), dtype),
        "norm": jnp.ones((H,), dtype),
    }
    if cfg.num_dense_layers:
        params["dense"] = init_layer_params(cfg, k_dense, moe=False, num=cfg.num_dense_layers, dtype=dtype, scale=scale)
    if cfg.num_moe_layers:
        params["moe"] = init_layer_params(cfg, k_moe, moe=True, num=cfg.num_moe_layers, dtype=dtype, scale=scale)
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(scale * rng.standard_normal((H, V), dtype=np.float32), dtype)
    return params


# ------------------------------------------------------------------------------------ loading


def _linear(ckpt: SafetensorsCheckpoint, name: str, out_dim: int, in_dim: int, dtype) -> np.ndarray:
    """HF nn.Linear weight [out, in] -> our [in, out]."""
    return np.ascontiguousarray(ckpt.get(name, (out_dim, in_dim), dtype).T)


def _load_experts(ckpt: SafetensorsCheckpoint, p: str, cfg: DeepseekConfig, dtype) -> dict[str, np.ndarray]:
    """Routed experts, per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the HF hub
    layout) or fused (transformers-5 ``mlp.experts.gate_up_proj`` [E, 2*Im, H] +
    ``mlp.experts.down_proj`` [E, H, Im])."""
    H, E, Im = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    if f"{p}mlp.experts.gate_up_proj" in ckpt:
        gate_up = ckpt.get(f"{p}mlp.experts.gate_up_proj", (E, 2 * Im, H), dtype)
        down = ckpt.get(f"{p}mlp.experts.down_proj", (E, H, Im), dtype)
        return {
            "experts_gate": np.ascontiguousarray(gate_up[:, :Im].transpose(0, 2, 1)),
            "experts_up": np.ascontiguousarray(gate_up[:, Im:].transpose(0, 2, 1)),
            "experts_down": np.ascontiguousarray(down.transpose(0, 2, 1)),
        }
    e = f"{p}mlp.experts."
    return {
        "experts_gate": np.stack([_linear(ckpt, f"{e}{i}.gate_proj.weight", Im, H, dtype) for i in range(E)]),
        "experts_up": np.stack([_linear(ckpt, f"{e}{i}.up_proj.weight", Im, H, dtype) for i in range(E)]),
        "experts_down": np.stack([_linear(ckpt, f"{e}{i}.down_proj.weight", H, Im, dtype) for i in range(E)]),
    }


def load_layer_params(
    ckpt: SafetensorsCheckpoint, cfg: DeepseekConfig, p: str, dtype, *, moe: bool, indexer: bool | None = None
) -> dict[str, np.ndarray]:
    """One decoder layer stored under prefix ``p`` (e.g. ``"model.layers.3."``), our layout."""
    H, Hq, Dn, R, C, Dv = (cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                           cfg.kv_lora_rank, cfg.v_head_dim)
    Dqk = Dn + R
    a = f"{p}self_attn."
    out = {"attn_norm": ckpt.get(f"{p}input_layernorm.weight", (H,), dtype)}
    if cfg.q_lora_rank is None:
        out["wq"] = _linear(ckpt, a + "q_proj.weight", Hq * Dqk, H, dtype)
    else:
        Rq = cfg.q_lora_rank
        out["wq_a"] = _linear(ckpt, a + "q_a_proj.weight", Rq, H, dtype)
        out["q_a_norm"] = ckpt.get(a + "q_a_layernorm.weight", (Rq,), dtype)
        out["wq_b"] = _linear(ckpt, a + "q_b_proj.weight", Hq * Dqk, Rq, dtype)
    out["wkv_a"] = _linear(ckpt, a + "kv_a_proj_with_mqa.weight", C + R, H, dtype)
    out["kv_a_norm"] = ckpt.get(a + "kv_a_layernorm.weight", (C,), dtype)
    kv_b = ckpt.get(a + "kv_b_proj.weight", (Hq * (Dn + Dv), C), dtype).reshape(Hq, Dn + Dv, C)
    out["w_uk"] = np.ascontiguousarray(kv_b[:, :Dn, :])  # [Hq, Dn, C]
    out["w_uv"] = np.ascontiguousarray(kv_b[:, Dn:, :].transpose(0, 2, 1))  # [Hq, C, Dv]
    out["wo"] = _linear(ckpt, a + "o_proj.weight", H, Hq * Dv, dtype)
    if cfg.has_indexer if indexer is None else indexer:
        Di = cfg.index_head_dim
        out["idx_wk"] = _linear(ckpt, a + "indexer.wk.weight", Di, H, dtype)
        out["idx_norm_w"] = ckpt.get(a + "indexer.k_norm.weight", (Di,), dtype)
        out["idx_norm_b"] = ckpt.get(a + "indexer.k_norm.bias", (Di,), dtype)
    out["mlp_norm"] = ckpt.get(f"{p}post_attention_layernorm.weight", (H,), dtype)
    if not moe:
        I = cfg.intermediate_size
        out["w_gate"] = _linear(ckpt, f"{p}mlp.gate_proj.weight", I, H, dtype)
        out["w_up"] = _linear(ckpt, f"{p}mlp.up_proj.weight", I, H, dtype)
        out["w_down"] = _linear(ckpt, f"{p}mlp.down_proj.weight", H, I, dtype)
        return out
    m = cfg.moe
    E = m.num_experts
    out["router"] = _linear(ckpt, f"{p}mlp.gate.weight", E, H, dtype)
    out["router_bias"] = ckpt.get(f"{p}mlp.gate.e_score_correction_bias", (E,), np.float32)
    out |= _load_experts(ckpt, p, cfg, dtype)
    if m.n_shared_experts:
        Is = m.shared_intermediate_size
        s = f"{p}mlp.shared_experts."
        out["shared_gate"] = _linear(ckpt, s + "gate_proj.weight", Is, H, dtype)
        out["shared_up"] = _linear(ckpt, s + "up_proj.weight", Is, H, dtype)
        out["shared_down"] = _linear(ckpt, s + "down_proj.weight", H, Is, dtype)
    return out


def load_deepseek_params(
    ckpt: SafetensorsCheckpoint, cfg: DeepseekConfig, dtype, progress: bool = True, prefix: str = "model."
) -> dict:
    """Reads a DeepSeek-V3 / V3.2 checkpoint into the layout of this module (MTP layers at
    index >= num_hidden_layers are not read; see ``jaxspec.model.mtp``).

    Raises:
      CheckpointError: a missing or misshaped tensor (named).
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    groups: dict[str, dict[str, list[np.ndarray]]] = {"dense": {}, "moe": {}}
    for i in tqdm(range(cfg.num_layers), desc="loading layers", disable=not progress, leave=False):
        is_moe = i >= cfg.num_dense_layers
        lp = load_layer_params(ckpt, cfg, f"{prefix}layers.{i}.", dtype, moe=is_moe)
        for k, v in lp.items():
            groups["moe" if is_moe else "dense"].setdefault(k, []).append(v)
    params: dict = {
        "embed": jnp.asarray(ckpt.get(f"{prefix}embed_tokens.weight", (V, H), dtype)),
        "norm": jnp.asarray(ckpt.get(f"{prefix}norm.weight", (H,), dtype)),
    }
    for name, layers in groups.items():
        if layers:
            params[name] = {k: jnp.asarray(np.stack(v)) for k, v in layers.items()}
    if not cfg.tie_word_embeddings:
        if "lm_head.weight" not in ckpt:
            raise CheckpointError(
                f"{ckpt.path}: missing tensor 'lm_head.weight' (config says tie_word_embeddings=false)"
            )
        params["lm_head"] = jnp.asarray(_linear(ckpt, "lm_head.weight", V, H, dtype))
    return params
