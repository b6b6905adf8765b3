"""Checkpoint names of Gemma 4 text decoders (HF ``Gemma4ForCausalLM``: ``model.*``; the text part of
``Gemma4ForConditionalGeneration``: ``model.language_model.*``, its vision / audio towers ignored),
and of the Gemma 4 layer that assistants are built from: one table for load, export and random init
(``jaxspec.model.checkpoints.name_tables``; our layout in ``jaxspec.model.targets.gemma4``)."""

from __future__ import annotations

import re

import numpy as np

from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, embedding, fused, gate_up, init_params,
                                                 output_head, packed_experts, stacked)
from jaxspec.model.targets.gemma4 import GROUPS, SHARED_GROUPS
from jaxspec.model.targets.gemma4_config import FULL, SLIDING, AttentionShape, Gemma4Config, Gemma4Moe


def gemma4_moe_entries(moe: Gemma4Moe, hidden: int) -> list:
    """A layer's MoE block (26B-A4B): its three extra norms, the router (``router.proj``, its input
    scale ``router.scale`` and ``router.per_expert_scale``) and the packed experts, split over
    the model axis by expert (the router replicated)."""
    H, E = hidden, moe.num_experts
    return [
        Param("post_mlp_norm_1", "post_feedforward_layernorm_1.weight", (H,), init="ones"),
        Param("pre_moe_norm", "pre_feedforward_layernorm_2.weight", (H,), init="ones"),
        Param("post_moe_norm", "post_feedforward_layernorm_2.weight", (H,), init="ones"),
        Param("router_scale", "router.scale", (H,), init="ones"),
        Param("router", "router.proj.weight", (H, E), perm=LINEAR),
        Param("per_expert_scale", "router.per_expert_scale", (E,), init="ones"),
        *packed_experts("experts.", E, H, moe.intermediate_size),
    ]


def gemma4_layer_entries(shape: AttentionShape, *, hidden: int, intermediate: int, num_heads: int,
                         kv: bool = True, shards: int = 1, moe: Gemma4Moe | None = None,
                         per_layer_input: int = 0) -> list:
    """One Gemma 4 layer of an attention shape (names relative to the layer); ``kv=False``: a
    query-only layer (a frozen-KV assistant's, or a target layer that reads another layer's K/V);
    ``moe``: with its MoE block; ``per_layer_input``: the width of its per-layer input (E2B / E4B:
    the gate, the projection back and its norm; replicated over the model axis). q/k/v (q/k with
    ``k_eq_v``) read into one joined ``wqkv`` and gate/up into ``w_gate_up``, in the column order
    of ``shards`` model shards (``jaxspec.model.fused``). Tensor parallel: q/k/v/gate/up
    column-parallel, o/down row-parallel; each checkpoint KV head repeated ``shape.kv_repeat``
    times."""
    H, D = hidden, shape.head_dim
    q, kvs = num_heads * D, shape.num_kv_heads * D
    a = "self_attn."
    rep = dict(repeat=shape.kv_repeat, unit=D)
    wq = Param("wq", a + "q_proj.weight", (H, q), perm=LINEAR, tp=1)
    out: list = [Param("attn_norm", "input_layernorm.weight", (H,), init="ones")]
    if kv:
        parts = [wq, Param("wk", a + "k_proj.weight", (H, kvs), perm=LINEAR, tp=1, **rep)]
        if not shape.k_eq_v:
            parts.append(Param("wv", a + "v_proj.weight", (H, kvs), perm=LINEAR, tp=1, **rep))
        out += [fused("wqkv", parts, shards), Param("q_norm", a + "q_norm.weight", (D,), init="ones"),
                Param("k_norm", a + "k_norm.weight", (D,), init="ones")]
    else:
        out += [wq, Param("q_norm", a + "q_norm.weight", (D,), init="ones")]
    return out + [
        Param("wo", a + "o_proj.weight", (q, H), perm=LINEAR, tp=0),
        Param("post_attn_norm", "post_attention_layernorm.weight", (H,), init="ones"),
        Param("pre_mlp_norm", "pre_feedforward_layernorm.weight", (H,), init="ones"),
        Param("post_mlp_norm", "post_feedforward_layernorm.weight", (H,), init="ones"),
        gate_up("w_gate_up", "mlp.", H, intermediate, shards),
        Param("w_down", "mlp.down_proj.weight", (intermediate, H), perm=LINEAR, tp=0),
        Param("layer_scalar", "layer_scalar", (1,), init="ones"),
    ] + ([] if moe is None else gemma4_moe_entries(moe, H)) + ([] if not per_layer_input else [
        Param("ple_gate", "per_layer_input_gate.weight", (H, per_layer_input), perm=LINEAR),
        Param("ple_proj", "per_layer_projection.weight", (per_layer_input, H), perm=LINEAR),
        Param("post_ple_norm", "post_per_layer_input_norm.weight", (H,), init="ones"),
    ])


def typed_layers(layer_types, shape_of, prefix: str, *, first: int = 0, groups=GROUPS, **dims) -> Table:
    """Every layer of a stack of Gemma 4 layers, stacked per layer type under ``groups[t]``
    (``sliding/`` and ``full/``; checkpoint names ``{prefix}layers.{i}.*``, ``i`` counted from
    ``first``)."""
    table: Table = []
    for t in (SLIDING, FULL):
        idx = [first + i for i, lt in enumerate(layer_types) if lt == t]
        if idx:
            table += stacked(gemma4_layer_entries(shape_of(t), **dims), groups[t] + "/", prefix + "layers.{i}.", idx)
    return table


def per_layer_input_entries(cfg: Gemma4Config) -> list:
    """The per-layer inputs' model-level tensors (E2B / E4B): the table (split by vocabulary rows
    over the model axis, padded to split evenly), the projection of the embedding (replicated)
    and its norm."""
    ple, pre, L = cfg.per_layer_inputs, cfg.prefix, cfg.num_layers
    rows = -(-ple.vocab_size // cfg.tensor_parallel) * cfg.tensor_parallel
    return [
        Param("ple_embed", pre + "embed_tokens_per_layer.weight", (rows, L * ple.width), tp=0,
              pad=rows - ple.vocab_size),
        Param("ple_projection", pre + "per_layer_model_projection.weight", (cfg.hidden_size, L * ple.width),
              perm=LINEAR),
        Param("ple_norm", pre + "per_layer_projection_norm.weight", (ple.width,), init="ones"),
    ]


def gemma4_table(cfg: Gemma4Config) -> Table:
    """Every tensor of a Gemma 4 text checkpoint that the decoder uses, in our layout (embedding
    and head vocab-parallel). Layers that keep K/V stack under ``sliding/`` and ``full/``; the
    K/V-sharing ones, which have no k/v projections (HF ignores them where a checkpoint has
    them) and may have wider MLPs, under ``sliding_shared/`` and ``full_shared/``."""
    H, pre, first = cfg.hidden_size, cfg.prefix, cfg.first_shared_layer
    table: Table = [embedding("embed", pre + "embed_tokens.weight", cfg)]
    dims = dict(hidden=H, num_heads=cfg.num_heads, shards=cfg.tensor_parallel, moe=cfg.moe,
                per_layer_input=cfg.per_layer_inputs.width if cfg.per_layer_inputs else 0)
    table += typed_layers(cfg.layer_types[:first], cfg.shape_of, pre, intermediate=cfg.intermediate_size, **dims)
    table += typed_layers(cfg.layer_types[first:], cfg.shape_of, pre, first=first, groups=SHARED_GROUPS, kv=False,
                          intermediate=cfg.shared_intermediate_size, **dims)
    if cfg.per_layer_inputs:
        table += per_layer_input_entries(cfg)
    table.append(Param("norm", pre + "norm.weight", (H,), init="ones"))
    if not cfg.tie_word_embeddings:
        table.append(output_head("lm_head", "lm_head.weight", cfg))
    return table


def leaves_unread(name: str, cfg: Gemma4Config) -> bool:
    """Checkpoint tensors the decoder leaves unread on purpose: a conditional-generation
    checkpoint's vision / audio towers, and the k/v projections and norms a K/V-sharing layer
    may still carry (HF ignores them too)."""
    if not name.startswith(cfg.prefix):
        return True
    m = re.fullmatch(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight", name[len(cfg.prefix):])
    return m is not None and int(m.group(1)) >= cfg.first_shared_layer


def init_gemma4_params(cfg: Gemma4Config, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random Gemma 4 params (tests, benchmarks): linear weights N(0, scale^2), norms and layer
    scalars 1 (perturb them to tell ``w`` from ``1 + w``)."""
    return init_params(gemma4_table(cfg), seed, scale=scale, dtype=dtype)
