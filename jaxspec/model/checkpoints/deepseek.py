"""Checkpoint names of DeepSeek-V3 / V3.2 (HF ``DeepseekV3ForCausalLM`` and
``DeepseekV32ForCausalLM``): one table per layer kind, used by the target, the MTP head, load,
export and random init. Layout of our params: ``jaxspec.model.targets.deepseek``."""

from __future__ import annotations

import numpy as np

from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, SplitParam, Table, embedding, gate_up, init_params,
                                                 output_head, row_blocks, stacked)
from jaxspec.model.targets.deepseek_config import DeepseekConfig


def _kv_b(cfg: DeepseekConfig) -> SplitParam:
    """``kv_b_proj [Hq*(Dn+Dv), C]`` is our absorbed ``w_uk [Hq, Dn, C]`` and ``w_uv [Hq, C, Dv]``."""
    Hq, Dn, Dv, C = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def split(x):
        x = x.reshape(-1, Dn + Dv, C)  # (all heads, or a shard's)
        return x[:, :Dn, :], np.transpose(x[:, Dn:, :], (0, 2, 1))

    def join(w_uk, w_uv):
        return np.concatenate([w_uk, np.transpose(w_uv, (0, 2, 1))], axis=1).reshape(Hq * (Dn + Dv), C)

    return SplitParam(parts=(("w_uk", (Hq, Dn, C)), ("w_uv", (Hq, C, Dv))), hf="self_attn.kv_b_proj.weight",
                      hf_shape=(Hq * (Dn + Dv), C), split=split, join=join, tp=0,
                      shard_rows=row_blocks(Hq * (Dn + Dv)))


def _experts(cfg: DeepseekConfig, fused: bool) -> list:
    """Routed experts: per expert (``mlp.experts.{e}.*_proj.weight``, the hub layout) or fused
    (transformers 5: ``mlp.experts.gate_up_proj [E, 2*Im, H]`` + ``mlp.experts.down_proj [E, H, Im]``)."""
    H, E, Im = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.moe_intermediate_size
    if not fused:
        e = "mlp.experts.{e}."
        return [
            Param("experts_gate", e + "gate_proj.weight", (H, Im), perm=LINEAR, experts=E, tp="experts"),
            Param("experts_up", e + "up_proj.weight", (H, Im), perm=LINEAR, experts=E, tp="experts"),
            Param("experts_down", e + "down_proj.weight", (Im, H), perm=LINEAR, experts=E, tp="experts"),
        ]

    def split(x):  # [E, 2*Im, H] -> gate, up [E, H, Im]
        return np.transpose(x[:, :Im], (0, 2, 1)), np.transpose(x[:, Im:], (0, 2, 1))

    def join(gate, up):
        return np.concatenate([np.transpose(gate, (0, 2, 1)), np.transpose(up, (0, 2, 1))], axis=1)

    return [
        SplitParam(parts=(("experts_gate", (E, H, Im)), ("experts_up", (E, H, Im))), hf="mlp.experts.gate_up_proj",
                   hf_shape=(E, 2 * Im, H), split=split, join=join, tp="experts", shard_rows=row_blocks(E)),
        Param("experts_down", "mlp.experts.down_proj", (E, Im, H), perm=(0, 2, 1), tp="experts"),
    ]


def layer_entries(cfg: DeepseekConfig, *, moe: bool, indexer: bool | None = None, fused_experts: bool = False) -> list:
    """One decoder layer (names relative to ``model.layers.{i}.``), our layout."""
    H, Hq, Dqk, R, C, Dv = (cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim, cfg.qk_rope_head_dim,
                            cfg.kv_lora_rank, cfg.v_head_dim)
    a = "self_attn."
    out: list = [Param("attn_norm", "input_layernorm.weight", (H,), init="ones")]
    if cfg.q_lora_rank is None:
        out.append(Param("wq", a + "q_proj.weight", (H, Hq * Dqk), perm=LINEAR, tp=1))
    else:
        Rq = cfg.q_lora_rank
        out += [Param("wq_a", a + "q_a_proj.weight", (H, Rq), perm=LINEAR),
                Param("q_a_norm", a + "q_a_layernorm.weight", (Rq,), init="ones"),
                Param("wq_b", a + "q_b_proj.weight", (Rq, Hq * Dqk), perm=LINEAR, tp=1)]
    out += [Param("wkv_a", a + "kv_a_proj_with_mqa.weight", (H, C + R), perm=LINEAR),
            Param("kv_a_norm", a + "kv_a_layernorm.weight", (C,), init="ones"),
            _kv_b(cfg),
            Param("wo", a + "o_proj.weight", (Hq * Dv, H), perm=LINEAR, tp=0)]
    if cfg.has_indexer if indexer is None else indexer:
        Di, Hi = cfg.index_head_dim, cfg.index_n_heads
        # Replicated under tensor parallelism: every model shard selects the same positions.
        out += [Param("idx_wq_b", a + "indexer.wq_b.weight", (cfg.q_lora_rank, Hi * Di), perm=LINEAR),
                Param("idx_wk", a + "indexer.wk.weight", (H, Di), perm=LINEAR),
                Param("idx_norm_w", a + "indexer.k_norm.weight", (Di,), init="ones"),
                Param("idx_norm_b", a + "indexer.k_norm.bias", (Di,), init="zeros"),
                # HF keeps weights_proj in float32 (_keep_in_fp32_modules).
                Param("idx_w_proj", a + "indexer.weights_proj.weight", (H, Hi), perm=LINEAR, dtype="float32")]
    out.append(Param("mlp_norm", "post_attention_layernorm.weight", (H,), init="ones"))
    if not moe:
        I = cfg.intermediate_size
        return out + [gate_up("w_gate_up", "mlp.", H, I, cfg.tensor_parallel),
                      Param("w_down", "mlp.down_proj.weight", (I, H), perm=LINEAR, tp=0)]
    m = cfg.moe
    E = m.num_experts
    out += [Param("router", "mlp.gate.weight", (H, E), perm=LINEAR),
            Param("router_bias", "mlp.gate.e_score_correction_bias", (E,), dtype="float32"),
            *_experts(cfg, fused_experts)]
    if m.n_shared_experts:
        Is = m.shared_intermediate_size
        s = "mlp.shared_experts."
        out += [gate_up("shared_gate_up", s, H, Is, cfg.tensor_parallel),
                Param("shared_down", s + "down_proj.weight", (Is, H), perm=LINEAR, tp=0)]
    return out


def deepseek_table(cfg: DeepseekConfig, prefix: str = "model.", fused_experts: bool = False) -> Table:
    """Every tensor of the main model (MTP layers at index >= num_hidden_layers are read by
    ``jaxspec.model.checkpoints.mtp``): the dense prefix and the MoE layers stack separately."""
    H = cfg.hidden_size
    layer = prefix + "layers.{i}."
    table: Table = [embedding("embed", prefix + "embed_tokens.weight", cfg)]
    if cfg.num_dense_layers:
        table += stacked(layer_entries(cfg, moe=False), "dense/", layer, range(cfg.num_dense_layers))
    if cfg.num_moe_layers:
        table += stacked(layer_entries(cfg, moe=True, fused_experts=fused_experts), "moe/", layer,
                         range(cfg.num_dense_layers, cfg.num_layers))
    table.append(Param("norm", prefix + "norm.weight", (H,), init="ones"))
    if not cfg.tie_word_embeddings:
        table.append(output_head("lm_head", "lm_head.weight", cfg))
    return table


def has_fused_experts(ckpt, cfg: DeepseekConfig, prefix: str = "model.") -> bool:
    return cfg.num_moe_layers > 0 and f"{prefix}layers.{cfg.num_dense_layers}.mlp.experts.gate_up_proj" in ckpt


def init_deepseek_params(cfg: DeepseekConfig, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random DeepSeek params (tests, benchmarks): norms 1, LayerNorm bias 0, the rest N(0, scale^2)."""
    return init_params(deepseek_table(cfg), seed, scale=scale, dtype=dtype)
