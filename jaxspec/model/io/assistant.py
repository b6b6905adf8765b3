"""The frozen-KV assistant's checkpoint layout (``architectures: ["JaxspecFrozenKVAssistant"]``):
config parsing, the name table (load, save, random init)."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import ConfigError
from jaxspec.model.drafts.assistant import AssistantConfig, check_assistant_fits
from jaxspec.model.io.checkpoint import CheckpointError, write_json
from jaxspec.model.io.llama import attention_entries, mlp_entries
from jaxspec.model.io.tables import LINEAR, Param, Table, export_params, init_params, load_params, shardings_for, stacked
from jaxspec.model.targets.llama_config import LlamaConfig

ARCHITECTURE = "JaxspecFrozenKVAssistant"


def assistant_config_from_hf(raw: dict, target: LlamaConfig, where: str) -> AssistantConfig:
    try:
        cfg = AssistantConfig(
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=int(raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or target.head_dim),
            num_kv_heads=int(raw.get("num_key_value_heads") or target.num_kv_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            backbone_hidden_size=int(raw["backbone_hidden_size"]),
            vocab_size=int(raw["vocab_size"]),
            kv_layers=tuple(int(i) for i in raw["kv_layer_map"]),
            rope=target.rope,
            embed_scale=float(raw.get("embed_scale", 1.0)),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing required field {e.args[0]!r}") from None
    check_assistant_fits(cfg, target, where)
    return cfg


def assistant_table(cfg: AssistantConfig, *, lm_head: bool = True) -> Table:
    """The assistant's own tensors (its embedding is the target's)."""
    H, Hb = cfg.hidden_size, cfg.backbone_hidden_size
    layer = [Param("attn_norm", "input_layernorm.weight", (H,), init="ones"), *attention_entries(cfg, H, kv=False),
             *mlp_entries(cfg)]
    table: Table = [
        Param("pre_proj", "pre_projection.weight", (2 * Hb, H), perm=LINEAR),
        Param("post_proj", "post_projection.weight", (H, Hb), perm=LINEAR),
        *stacked(layer, "layers/", "model.layers.{i}.", range(cfg.num_layers)),
        Param("norm", "model.norm.weight", (H,), init="ones"),
    ]
    if lm_head:
        table.append(Param("lm_head", "lm_head.weight", (H, cfg.vocab_size), perm=LINEAR))
    return table


def load_assistant_params(ckpt, cfg: AssistantConfig, target_params: dict, dtype, mesh=None) -> dict:
    tied = "lm_head.weight" not in ckpt
    if tied and cfg.hidden_size != cfg.backbone_hidden_size:
        raise CheckpointError(f"{ckpt.path}: no lm_head.weight and hidden_size != backbone_hidden_size")
    table = assistant_table(cfg, lm_head=not tied)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=False))
    params["embed"] = target_params["embed"]
    return params


def init_assistant_params(cfg: AssistantConfig, seed, target_params: dict, dtype=np.float32, scale: float = 0.02,
                          tied: bool = False) -> dict:
    """Random assistant params (tests); ``tied`` shares the target embedding as its head."""
    if tied and cfg.hidden_size != cfg.backbone_hidden_size:
        raise ValueError("a tied lm_head needs hidden_size == backbone_hidden_size")
    params = init_params(assistant_table(cfg, lm_head=not tied), seed, scale=scale, dtype=dtype)
    params["embed"] = target_params["embed"]
    return params


def save_assistant(path: str, cfg: AssistantConfig, params: dict) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the layout above."""
    os.makedirs(path, exist_ok=True)
    tensors = export_params(assistant_table(cfg, lm_head="lm_head" in params), params, np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    write_json(os.path.join(path, "config.json"), {
        "architectures": [ARCHITECTURE],
        "model_type": "jaxspec_frozen_kv_assistant",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "backbone_hidden_size": cfg.backbone_hidden_size,
        "vocab_size": cfg.vocab_size,
        "kv_layer_map": list(cfg.kv_layers),
        "embed_scale": cfg.embed_scale,
        "tie_word_embeddings": "lm_head" not in params,
    })
