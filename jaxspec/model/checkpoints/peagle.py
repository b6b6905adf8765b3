"""P-EAGLE and EAGLE-3 heads in the ``speculators`` layout (vLLM's training library): config
parsing, the name table (load, random init) and the ``d2t`` draft vocabulary.

The config is the library's EAGLE-3 config: ``speculators_model_type`` "eagle3" (architectures
["Eagle3Speculator"]: an EAGLE-3 head, drafted token by token) or "peagle" with ``mask_token_id``
and the ``mask_hidden`` tensor (a P-EAGLE head, drafted in parallel); the head's layers' Llama or Qwen3 config is nested in
``transformer_layer_config`` (stored as a diff against transformers' defaults: absent fields hold
them), and:

    eagle_aux_hidden_state_layer_ids (HF ``hidden_states`` indices: jaxspec's taps as they are;
    default [2, L // 2, L - 3]), draft_vocab_size, target_hidden_size, norm_before_residual,
    norm_before_fc, fc_norm, norm_output (read by the library's EAGLE-3 test-time training only),
    speculators_config.proposal_methods[0].speculative_tokens (the parallel depths it drafts)

Tensors: ``embed_tokens`` (its own, trained; the target's when absent), ``mask_hidden``
``[1, 1, F]`` (P-EAGLE only), ``fc``, ``input_norm`` (norm_before_fc) or ``fc_norm.{j}`` (fc_norm),
``layers.0.*`` (EAGLE-3's first layer: ``hidden_norm``, 2H-wide q/k/v), ``layers.{i}.*`` (plain
layers), ``norm``, ``lm_head`` and, for a reduced vocabulary, ``d2t`` (target id = draft id +
d2t[draft id]) with ``t2d``.
"""

from __future__ import annotations

import numpy as np

from jaxspec.model.config import ConfigError, get_field, pad_vocab, parse_rope
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.drafts.peagle import PEagleConfig, peagle_draft
from jaxspec.model.checkpoints.llama import attention_entries, llama_layer_entries, mlp_entries
from jaxspec.model.checkpoints.speculators_fields import (QWEN3_DEFAULTS, flag, hot_ids, mask_token, speculative_tokens, taps,
                                                 vocab_sizes)
from jaxspec.model.checkpoints.name_tables import LINEAR, Param, Table, host_rng, init_params, load_params, replicated, shardings_for, under, whole_on

MODEL_TYPE = "peagle"
ARCHITECTURES = ("PEagleDraftModel", "PEagleSpeculator")
EAGLE3_MODEL_TYPE = "eagle3"
EAGLE3_ARCHITECTURES = ("Eagle3Speculator",)
# transformers' LlamaConfig defaults, for the fields a diff leaves out (None: from other fields)
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6}
LIBRARY_DEPTHS = 8  # the library's default num_depths


def is_peagle(raw: dict) -> bool:
    return raw.get("speculators_model_type") == MODEL_TYPE


def is_eagle3(raw: dict) -> bool:
    return raw.get("speculators_model_type") == EAGLE3_MODEL_TYPE


def matches(names: set[str]) -> bool:
    """The tensors of a P-EAGLE head: ``mask_hidden``, ``fc`` and EAGLE-3's first layer."""
    return "mask_hidden" in names and matches_eagle3(names)


def matches_eagle3(names: set[str]) -> bool:
    """The tensors of a ``speculators`` EAGLE-3 head: ``fc`` and EAGLE-3's first layer."""
    return {"fc.weight", "layers.0.hidden_norm.weight"} <= set(names)


def peagle_config_from_hf(raw: dict, target_cfg, where: str) -> PEagleConfig:
    """Parses a ``speculators`` P-EAGLE or EAGLE-3 config (``speculators_model_type``; an EAGLE-3
    head's has no mask token) for ``target_cfg``; raises ``ConfigError`` naming a missing, bad or
    unsupported field, or one that does not fit the target."""
    parallel = not is_eagle3(raw)
    name = "P-EAGLE" if parallel else "EAGLE-3"
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: missing the nested 'transformer_layer_config' (the head layers' config)")
    lwhere = f"{where} (transformer_layer_config)"
    kind = layer.get("model_type", "llama")
    if kind not in ("llama", "qwen3"):
        raise ConfigError(f"{lwhere}: {name} layers of model_type {kind!r} are not supported (llama, qwen3)")
    layer = {**(QWEN3_DEFAULTS if kind == "qwen3" else LLAMA_DEFAULTS), **{k: v for k, v in layer.items() if v is not None}}
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        raise ConfigError(f"{lwhere}: {name} layers with attention_bias / mlp_bias are not supported")
    L = get_field(layer, "num_hidden_layers", int, where=lwhere)
    types = (layer.get("layer_types") or [])[:L]
    if any(t != "full_attention" for t in types) or (kind == "qwen3" and layer.get("use_sliding_window")):
        raise ConfigError(f"{lwhere}: {name} layers with sliding-window attention ({types}) are not supported")
    H = get_field(layer, "hidden_size", int, where=lwhere)
    heads = get_field(layer, "num_attention_heads", int, where=lwhere)
    target_hidden = raw.get("target_hidden_size") or H
    if H != target_cfg.hidden_size or target_hidden != target_cfg.hidden_size:
        raise ConfigError(f"{where}: {name} hidden_size {H} (target_hidden_size {raw.get('target_hidden_size')}) "
                          f"must equal the target's hidden size {target_cfg.hidden_size}")
    vocab, draft_vocab = vocab_sizes(raw, layer, target_cfg, where, lwhere, prefix=f"{name} ")
    aux = taps(raw, "eagle_aux_hidden_state_layer_ids", target_cfg.num_layers, where, prefix=f"{name} ")
    mask = mask_token(raw, vocab, where, prefix=f"{name} ") if parallel else None
    norm_before_fc, fc_norm = flag(raw, "norm_before_fc", False, where), flag(raw, "fc_norm", False, where)
    if norm_before_fc and fc_norm:
        raise ConfigError(f"{where}: norm_before_fc and fc_norm are mutually exclusive")
    kv_heads = layer.get("num_key_value_heads") or heads
    return PEagleConfig(
        hidden_size=H,
        intermediate_size=get_field(layer, "intermediate_size", int, where=lwhere),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(layer.get("head_dim") or H // heads),
        rms_norm_eps=float(get_field(layer, "rms_norm_eps", float, where=lwhere)),
        rope=parse_rope(layer, lwhere),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_cfg.hidden_size,
        aux_layers=tuple(aux),
        mask_token_id=mask,
        num_speculative_tokens=speculative_tokens(raw, where) or LIBRARY_DEPTHS,
        qk_norm=kind == "qwen3",
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        norm_before_residual=flag(raw, "norm_before_residual", False, where),
        vocab_parallel=getattr(target_cfg, "tensor_parallel", 1),
    )


def peagle_table(cfg: PEagleConfig, *, embed: bool = True) -> Table:
    """The head's tensors (its own embedding unless ``embed`` is False), replicated on a mesh."""
    H, F = cfg.hidden_size, cfg.feature_size
    table: Table = []
    if embed:  # looked up vocab-parallel, so padded as the target's
        Vp = pad_vocab(cfg.vocab_size, cfg.vocab_parallel)
        table.append(Param("embed", "embed_tokens.weight", (Vp, H), pad=Vp - cfg.vocab_size))
    if cfg.mask_token_id is not None:  # P-EAGLE's mask rows
        table.append(Param("mask_hidden", "mask_hidden", (1, 1, F)))
    table.append(Param("fc", "fc.weight", (F, H), perm=LINEAR))
    if cfg.norm_before_fc:
        table.append(Param("fc_in_norm", "input_norm.weight", (F,), init="ones"))
    if cfg.fc_norm:
        table += [Param(f"fc_norm/{j}", f"fc_norm.{j}.weight", (H,), init="ones") for j in range(len(cfg.aux_layers))]
    first = [Param("input_norm", "input_layernorm.weight", (H,), init="ones"),
             Param("hidden_norm", "hidden_norm.weight", (H,), init="ones"),
             *attention_entries(cfg, 2 * H), *mlp_entries(cfg)]
    table += under(replicated(first), "layer0/", "layers.0.")
    for i in range(1, cfg.num_layers):
        table += under(replicated(llama_layer_entries(cfg)), f"layer{i}/", f"layers.{i}.")
    return table + [Param("norm", "norm.weight", (H,), init="ones"),
                    Param("lm_head", "lm_head.weight", (H, cfg.draft_vocab_size), perm=LINEAR)]


def load_peagle(ckpt, raw: dict, target, dtype, where: str) -> DraftModel:
    """Reads a ``speculators`` P-EAGLE or EAGLE-3 checkpoint for ``target`` (a ``Model``): a
    P-EAGLE draft, or an EAGLE-3 one (``SpeculatorsEagle3Draft``); a head without its own
    embedding shares the target's."""
    cfg = peagle_config_from_hf(raw, target.config, where)
    table = peagle_table(cfg, embed="embed_tokens.weight" in ckpt)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, target.mesh, split=False))
    if "embed" not in params:
        params["embed"] = target.params["embed"]
    if cfg.own_vocab:
        params["hot_ids"] = whole_on(hot_ids(ckpt, cfg.draft_vocab_size, cfg.vocab_size,
                                             prefix="P-EAGLE " if cfg.mask_token_id is not None else "EAGLE-3 "),
                                     target.mesh)
    return peagle_draft(cfg, params, ckpt.path)


def init_peagle_params(cfg: PEagleConfig, seed, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random head params (tests), its own embedding included; a reduced vocabulary gets a random
    sorted ``hot_ids`` subset."""
    params = init_params(peagle_table(cfg), seed, scale=scale, dtype=dtype)
    if cfg.own_vocab:
        rng = host_rng(seed).spawn(1)[0]
        params["hot_ids"] = np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False)).astype(np.int32)
    return params
