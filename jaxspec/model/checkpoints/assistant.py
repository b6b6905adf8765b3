"""Checkpoint layouts of frozen-KV assistants (``jaxspec.model.drafts.assistant``): config parsing
and the name tables (load, save, random init) of

* the project's own format (``architectures: ["JaxspecFrozenKVAssistant"]``, Llama-family
  targets, "llama" layers), and
* HF ``Gemma4AssistantForCausalLM`` (``model_type: gemma4_assistant``, Gemma 4 targets,
  "gemma4" layers): ``pre_projection.weight [H, 2*Hb]``, ``post_projection.weight [Hb, H]``,
  query-only Gemma 4 layers ``model.layers.{i}.*`` (no k/v projections), ``model.norm.weight``,
  ``model.embed_tokens.weight [V, H]`` (the tied head), and with ordered embeddings
  ``masked_embedding.centroids.weight [C, H]`` + ``masked_embedding.token_ordering [V]``.
"""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import ConfigError, get_field
from jaxspec.model.drafts.assistant import (AssistantConfig, assistant_config_for, check_assistant_fits,
                                            gemma4_assistant_config)
from jaxspec.model.checkpoints.checkpoint import CheckpointError, write_json
from jaxspec.model.checkpoints.gemma4 import typed_layers
from jaxspec.model.checkpoints.llama import attention_entries, mlp_entries
from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, export_params, host_rng, init_params, load_params,
                                    shardings_for, stacked, whole_on)
from jaxspec.model.fused import shards_of
from jaxspec.model.targets.gemma4_config import SLIDING, Gemma4Config, attention_shapes, layer_types_of
from jaxspec.model.targets.llama_config import LlamaConfig

ARCHITECTURE = "JaxspecFrozenKVAssistant"
GEMMA4_ARCHITECTURE = "Gemma4AssistantForCausalLM"

# ------------------------------------------------------------------------------ project format


def assistant_config_from_hf(raw: dict, target: LlamaConfig, where: str) -> AssistantConfig:
    try:
        base = assistant_config_for(target, kv_layers=tuple(int(i) for i in raw["kv_layer_map"]))
        cfg = AssistantConfig(**{
            **{f: getattr(base, f) for f in ("kv_layers", "kv_sources", "window", "rope", "tensor_parallel")},
            "hidden_size": int(raw["hidden_size"]),
            "intermediate_size": int(raw["intermediate_size"]),
            "num_heads": int(raw["num_attention_heads"]),
            "head_dim": int(raw.get("head_dim") or target.head_dim),
            "num_kv_heads": int(raw.get("num_key_value_heads") or base.num_kv_heads),
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
            "backbone_hidden_size": int(raw["backbone_hidden_size"]),
            "vocab_size": int(raw["vocab_size"]),
            "embed_scale": float(raw.get("embed_scale", 1.0)),
        })
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
        *_projections(H, Hb),
        *stacked(layer, "layers/", "model.layers.{i}.", range(cfg.num_layers)),
        Param("norm", "model.norm.weight", (H,), init="ones"),
    ]
    if lm_head:
        table.append(Param("lm_head", "lm_head.weight", (H, cfg.vocab_size), perm=LINEAR))
    return table


def _projections(H: int, Hb: int) -> list[Param]:
    return [Param("pre_proj", "pre_projection.weight", (2 * Hb, H), perm=LINEAR),
            Param("post_proj", "post_projection.weight", (H, Hb), perm=LINEAR)]


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
    """Writes ``config.json`` + ``model.safetensors`` in the project layout."""
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


# ------------------------------------------------------------------------------ Gemma 4 format


def gemma4_assistant_config_from_hf(raw: dict, target: Gemma4Config, where: str) -> AssistantConfig:
    """An HF ``Gemma4AssistantForCausalLM`` config (its decoder in ``text_config``) for ``target``."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: a Gemma 4 assistant config needs a text_config object")
    for field in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if text.get(field):
            raise ConfigError(f"{where}: text_config.{field}={text[field]!r} is not supported in an assistant")
    num_layers = get_field(text, "num_hidden_layers", int, where=where)
    heads = get_field(text, "num_attention_heads", int, where=where)
    types = layer_types_of(text, num_layers, where)
    sliding, full = attention_shapes(text, types, heads, where)
    ordered = bool(raw.get("use_ordered_embeddings", False))
    cfg = gemma4_assistant_config(
        target,
        hidden_size=get_field(text, "hidden_size", int, where=where),
        intermediate_size=get_field(text, "intermediate_size", int, where=where),
        num_heads=heads, layer_types=types, sliding=sliding, full=full,
        window=get_field(text, "sliding_window", int, default=512, where=where),
        rms_norm_eps=float(get_field(text, "rms_norm_eps", float, default=1e-6, where=where)),
        num_centroids=get_field(raw, "num_centroids", int, default=2048, where=where) if ordered else 0,
        centroid_top_k=get_field(raw, "centroid_intermediate_top_k", int, default=32, where=where) if ordered else 0,
    )
    vocab = get_field(text, "vocab_size", int, where=where)
    backbone = get_field(raw, "backbone_hidden_size", int, default=1536, where=where)
    if vocab != cfg.vocab_size or backbone != cfg.backbone_hidden_size:
        raise ConfigError(f"{where}: does not fit the target: vocab_size {vocab} / backbone_hidden_size {backbone}, "
                          f"the target has {target.vocab_size} / {target.hidden_size}")
    if ordered and vocab % cfg.num_centroids:
        raise ConfigError(f"{where}: vocab_size {vocab} is not a multiple of num_centroids {cfg.num_centroids}")
    if ordered and not 0 < cfg.centroid_top_k <= cfg.num_centroids:
        raise ConfigError(f"{where}: centroid_intermediate_top_k {cfg.centroid_top_k} is not in [1, num_centroids]")
    check_assistant_fits(cfg, target, where)
    return cfg


def gemma4_assistant_table(cfg: AssistantConfig, *, tied: bool = True) -> Table:
    """The assistant's own tensors (its input embedding is the target's)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    table: Table = [
        *_projections(H, cfg.backbone_hidden_size),
        *typed_layers(cfg.layer_types, lambda t: cfg.sliding if t == SLIDING else cfg.full, "model.", hidden=H,
                      intermediate=cfg.intermediate_size, num_heads=cfg.num_heads, kv=False,
                      shards=shards_of(cfg)),
        Param("norm", "model.norm.weight", (H,), init="ones"),
        Param("head", "model.embed_tokens.weight" if tied else "lm_head.weight", (V, H)),
    ]
    if cfg.num_centroids:
        table += [Param("centroids", "masked_embedding.centroids.weight", (H, cfg.num_centroids), perm=LINEAR),
                  Param("token_ordering", "masked_embedding.token_ordering", (V,), init="zeros", dtype="int32")]
    return table


def token_clusters(ordering: np.ndarray, num_centroids: int, where: str) -> np.ndarray:  # i32[V]
    """Cluster of each token: ``token_ordering`` viewed [C, V / C] lists each cluster's tokens."""
    ordering = np.asarray(ordering, np.int64)
    V = ordering.shape[0]
    if not np.array_equal(np.sort(ordering), np.arange(V)):
        raise CheckpointError(f"{where}: masked_embedding.token_ordering is not a permutation of the vocabulary")
    cluster = np.empty(V, np.int32)
    cluster[ordering] = np.arange(V) // (V // num_centroids)
    return cluster


def _finish_gemma4(params: dict, cfg: AssistantConfig, target_params: dict, where: str, mesh=None) -> dict:
    params["embed"] = target_params["embed"]
    if cfg.num_centroids:
        cluster = token_clusters(params["token_ordering"], cfg.num_centroids, where)
        params["token_cluster"] = whole_on(cluster, mesh)
    return params


def load_gemma4_assistant_params(ckpt, raw: dict, cfg: AssistantConfig, target_params: dict, dtype,
                                 mesh=None) -> dict:
    """The assistant's tensors (whole on every device of ``mesh``: it is small) and the target's
    embedding."""
    tied = raw.get("tie_word_embeddings", True) or "lm_head.weight" not in ckpt
    table = gemma4_assistant_table(cfg, tied=tied)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=False))
    return _finish_gemma4(params, cfg, target_params, ckpt.path, mesh)


def init_gemma4_assistant_params(cfg: AssistantConfig, seed, target_params: dict, dtype=np.float32,
                                 scale: float = 0.02) -> dict:
    """Random Gemma 4 assistant params (tests), with a random token ordering."""
    params = init_params(gemma4_assistant_table(cfg), seed, scale=scale, dtype=dtype)
    if cfg.num_centroids:
        params["token_ordering"] = host_rng(seed).permutation(cfg.vocab_size).astype(np.int32)
    return _finish_gemma4(params, cfg, target_params, "random init")
