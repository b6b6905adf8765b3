"""Checkpoint names of Qwen3-Next and Qwen3.5 (dense and MoE, ``ForCausalLM`` and the text weights of
``ForConditionalGeneration``): one table for load, export and random init. Layout of our params:
``jaxspec.model.targets.hybrid``.

Our Gated DeltaNet projections are grouped per key head, ``[q (Dk) | k (Dk) | v (r * Dv)]`` for each
of the Hk key heads (r value heads per key head), so that splitting the channel axis over the
mesh's model shards keeps every key head with its value heads (the conv channels and conv state
too). Qwen3-Next checkpoints already group ``in_proj_qkvz`` / ``in_proj_ba`` that way (with z and b/a
inside each group); Qwen3.5 checkpoints and both families' ``conv1d`` are flat ``[q all | k all |
v all]``: both are reordered here, once, while loading.
"""

from __future__ import annotations

import numpy as np

from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, SplitParam, Table, embedding, fused, gate_up, init_params,
                                                 output_head, packed_experts, row_blocks, stacked)
from jaxspec.model.targets.hybrid_config import FULL, HybridConfig


def _grouped_from_flat(cfg: HybridConfig, x: np.ndarray) -> np.ndarray:
    """[q all | k all | v all] on axis 0 -> per key head [q | k | v] (axis 0), for all key heads
    or a shard's (``_flat_rows``)."""
    g = cfg.gdn
    Dk, r, Dv = g.head_k_dim, g.group, g.head_v_dim
    Hk = x.shape[0] // (2 * Dk + r * Dv)
    rest = x.shape[1:]
    q = x[: Hk * Dk].reshape((Hk, Dk) + rest)
    k = x[Hk * Dk: 2 * Hk * Dk].reshape((Hk, Dk) + rest)
    v = x[2 * Hk * Dk:].reshape((Hk, r * Dv) + rest)
    return np.concatenate([q, k, v], axis=1).reshape((-1,) + rest)


def _flat_rows(cfg: HybridConfig):
    """``SplitParam.shard_rows`` of a flat ``[q all | k all | v all]`` tensor: shard k of n takes its
    key heads' rows of each of the three."""
    g = cfg.gdn
    return row_blocks(g.num_k_heads * g.head_k_dim, g.num_k_heads * g.head_k_dim, g.num_v_heads * g.head_v_dim)


def _flat_from_grouped(cfg: HybridConfig, x: np.ndarray) -> np.ndarray:
    g = cfg.gdn
    Hk, Dk = g.num_k_heads, g.head_k_dim
    rest = x.shape[1:]
    x = x.reshape((Hk, -1) + rest)
    return np.concatenate([x[:, :Dk].reshape((-1,) + rest), x[:, Dk:2 * Dk].reshape((-1,) + rest),
                           x[:, 2 * Dk:].reshape((-1,) + rest)], axis=0)


def linear_attention_entries(cfg: HybridConfig) -> list:
    """One Gated DeltaNet block (names relative to the layer), our layout; tensor parallel splits
    key heads (with their value heads) over the model axis, ``out_proj`` row-parallel."""
    g, H = cfg.gdn, cfg.hidden_size
    C, Hv, K = g.conv_dim, g.num_v_heads, g.conv_kernel
    a = "linear_attn."
    out: list = []
    if cfg.layout == "qwen3_next":
        Hk, Dk, r, Dv = g.num_k_heads, g.head_k_dim, g.group, g.head_v_dim
        width = 2 * Dk + 2 * r * Dv

        def split_qkvz(x):  # [Hk * width, H] -> in_qkv [H, C] (grouped), in_z [H, Hv * Dv]
            x = x.reshape(-1, width, H)  # (all key heads, or a shard's)
            return (np.transpose(x[:, : 2 * Dk + r * Dv].reshape(-1, H)),
                    np.transpose(x[:, 2 * Dk + r * Dv:].reshape(-1, H)))

        def join_qkvz(qkv, z):
            return np.concatenate([qkv.T.reshape(Hk, -1, H), z.T.reshape(Hk, -1, H)], axis=1).reshape(-1, H)

        def split_ba(x):  # [Hk * 2r, H] -> b, a [H, Hv]
            x = x.reshape(-1, 2 * r, H)
            return np.transpose(x[:, :r].reshape(-1, H)), np.transpose(x[:, r:].reshape(-1, H))

        def join_ba(b, a_):
            return np.concatenate([b.T.reshape(Hk, r, H), a_.T.reshape(Hk, r, H)], axis=1).reshape(-1, H)

        out += [SplitParam(parts=(("in_qkv", (H, C)), ("in_z", (H, Hv * Dv))), hf=a + "in_proj_qkvz.weight",
                           hf_shape=(Hk * width, H), split=split_qkvz, join=join_qkvz, tp=1,
                           shard_rows=row_blocks(Hk * width)),
                SplitParam(parts=(("in_b", (H, Hv)), ("in_a", (H, Hv))), hf=a + "in_proj_ba.weight",
                           hf_shape=(Hk * 2 * r, H), split=split_ba, join=join_ba, tp=1,
                           shard_rows=row_blocks(Hk * 2 * r))]
    else:
        out += [SplitParam(parts=(("in_qkv", (H, C)),), hf=a + "in_proj_qkv.weight", hf_shape=(C, H),
                           split=lambda x: (np.transpose(_grouped_from_flat(cfg, x)),),
                           join=lambda w: _flat_from_grouped(cfg, w.T), tp=1, shard_rows=_flat_rows(cfg)),
                # z, b and a read the same input: one joined product (b and a alone, [H, Hv], were
                # three small kernels a layer on a GPU; joined with z they ride its cuBLAS call).
                fused("in_zba", [Param("in_z", a + "in_proj_z.weight", (H, g.value_dim), perm=LINEAR, tp=1),
                                 Param("in_b", a + "in_proj_b.weight", (H, Hv), perm=LINEAR, tp=1),
                                 Param("in_a", a + "in_proj_a.weight", (H, Hv), perm=LINEAR, tp=1)],
                      cfg.tensor_parallel)]
    out += [
        SplitParam(parts=(("conv_w", (C, K)),), hf=a + "conv1d.weight", hf_shape=(C, 1, K),
                   split=lambda x: (_grouped_from_flat(cfg, x[:, 0]),),
                   join=lambda w: _flat_from_grouped(cfg, w)[:, None], tp=0, shard_rows=_flat_rows(cfg)),
        Param("dt_bias", a + "dt_bias", (Hv,), tp=0, dtype="float32"),
        Param("A_log", a + "A_log", (Hv,), tp=0, dtype="float32"),
        Param("gdn_norm", a + "norm.weight", (g.head_v_dim,), init="ones"),
        Param("wo", a + "out_proj.weight", (g.value_dim, H), perm=LINEAR, tp=0),
    ]
    return out


def full_attention_entries(cfg: HybridConfig) -> list:
    """Gated attention: ``q_proj`` holds [query | gate] per head, read with ``k_proj`` and
    ``v_proj`` into one joined ``wqkv``; zero-centred q/k norms."""
    H, D = cfg.hidden_size, cfg.head_dim
    a = "self_attn."
    return [fused("wqkv", [Param("wq", a + "q_proj.weight", (H, cfg.num_heads * 2 * D), perm=LINEAR, tp=1),
                           Param("wk", a + "k_proj.weight", (H, cfg.num_kv_heads * D), perm=LINEAR, tp=1),
                           Param("wv", a + "v_proj.weight", (H, cfg.num_kv_heads * D), perm=LINEAR, tp=1)],
                  cfg.tensor_parallel),
            Param("wo", a + "o_proj.weight", (cfg.num_heads * D, H), perm=LINEAR, tp=0),
            Param("q_norm", a + "q_norm.weight", (D,), init="zeros"),
            Param("k_norm", a + "k_norm.weight", (D,), init="zeros")]


def _experts(cfg: HybridConfig, fused: bool) -> list:
    H, m = cfg.hidden_size, cfg.moe
    E, Im = m.num_experts, m.moe_intermediate_size
    if not fused:
        e = "mlp.experts.{e}."
        return [Param("experts_gate", e + "gate_proj.weight", (H, Im), perm=LINEAR, experts=E, tp="experts"),
                Param("experts_up", e + "up_proj.weight", (H, Im), perm=LINEAR, experts=E, tp="experts"),
                Param("experts_down", e + "down_proj.weight", (Im, H), perm=LINEAR, experts=E, tp="experts")]

    return packed_experts("mlp.experts.", E, H, Im)


def mlp_entries(cfg: HybridConfig, kind: str, fused_experts: bool) -> list:
    H = cfg.hidden_size
    out: list = [Param("mlp_norm", "post_attention_layernorm.weight", (H,), init="zeros")]
    if kind == "dense":
        I = cfg.intermediate_size
        return out + [gate_up("w_gate_up", "mlp.", H, I, cfg.tensor_parallel),
                      Param("w_down", "mlp.down_proj.weight", (I, H), perm=LINEAR, tp=0)]
    m = cfg.moe
    Is = m.shared_intermediate_size
    s = "mlp.shared_expert."
    return out + [Param("router", "mlp.gate.weight", (H, m.num_experts), perm=LINEAR),
                  *_experts(cfg, fused_experts),
                  gate_up("shared_gate_up", s, H, Is, cfg.tensor_parallel),
                  Param("shared_down", s + "down_proj.weight", (Is, H), perm=LINEAR, tp=0),
                  Param("shared_expert_gate", "mlp.shared_expert_gate.weight", (H, 1), perm=LINEAR)]


def layer_entries(cfg: HybridConfig, layer: int, fused_experts: bool = False) -> list:
    """Layer ``layer`` of the decoder (its mixer and MLP kinds), names relative to the layer."""
    mixer, mlp = cfg.kinds[layer]
    attn = full_attention_entries(cfg) if mixer == FULL else linear_attention_entries(cfg)
    return [Param("attn_norm", "input_layernorm.weight", (cfg.hidden_size,), init="zeros"), *attn,
            *mlp_entries(cfg, mlp, fused_experts)]


def hybrid_table(cfg: HybridConfig, fused_experts: bool = False) -> Table:
    """Every tensor of the text model. Layers stack per position of the layer pattern's period:
    ``p{j}/...`` holds layers j, j + p, j + 2p, ... (``HybridConfig.period``)."""
    H, p = cfg.hidden_size, cfg.period
    prefix = cfg.prefix
    table: Table = [embedding("embed", prefix + "embed_tokens.weight", cfg)]
    for j in range(p):
        table += stacked(layer_entries(cfg, j, fused_experts), f"p{j}/", prefix + "layers.{i}.",
                         range(j, cfg.num_layers, p))
    table.append(Param("norm", prefix + "norm.weight", (H,), init="zeros"))
    if not cfg.tie_word_embeddings:
        table.append(output_head("lm_head", "lm_head.weight", cfg))
    return table


def has_fused_experts(ckpt, cfg: HybridConfig) -> bool:
    if cfg.moe is None:
        return False
    first = cfg.mlp_types.index("moe")
    return f"{cfg.prefix}layers.{first}.mlp.experts.gate_up_proj" in ckpt


def init_hybrid_params(cfg: HybridConfig, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random params (tests, benchmarks): zero-centred norms 0 (a scale of 1), the gated norm 1,
    the rest N(0, scale^2)."""
    return init_params(hybrid_table(cfg), seed, scale=scale, dtype=dtype)
