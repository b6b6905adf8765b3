"""DFlash / DFlash 2 drafts in their published layout (z-lab ``dflash``): config parsing, the
name table (load, export, random init).

The config is a Qwen3 config with ``architectures`` ``DFlashDraftModel`` or
``DFlash2DraftModel`` and ``num_target_layers``. The DFlash fields are read from
``dflash_config`` first and from the top level second: ``target_layer_ids`` (default: spread
over the target's layers), ``block_size`` (16), ``mask_token_id`` (required),
``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``, and for DFlash 2
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``. Per draft layer,
``layer_types`` / ``sliding_window`` (Qwen3 rules: no window unless ``use_sliding_window``) and
causality (sliding layers are causal unless a global ``is_causal`` says otherwise).

The draft has no embedding or head of its own: it shares the target's. DFlash 2's selector
codebooks are stored without a ``.weight`` suffix in published files; both spellings load, and
export writes the published one.
"""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import ConfigError, get_field, parse_rope
from jaxspec.model.drafts.dflash import DFlashConfig, default_target_layer_ids, dflash_draft
from jaxspec.model.checkpoints.checkpoint import decoder_fields, resolve_dtype, write_json
from jaxspec.model.checkpoints.llama import llama_layer_entries
from jaxspec.model.checkpoints.name_tables import LINEAR, Param, Table, export_params, init_params, load_params, shardings_for, stacked

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
CODEBOOKS = ("predecessor", "successor")


def is_dflash(names) -> bool:
    """DFlash tensors: ``fc`` + a top-level ``hidden_norm`` + Qwen3 layers (EAGLE heads keep their
    hidden norm inside their one layer)."""
    names = set(names)
    return {"fc.weight", "hidden_norm.weight", "layers.0.self_attn.q_proj.weight"} <= names


def is_dflash2(names) -> bool:
    names = set(names)
    return is_dflash(names) and "layers.0.attention_conv.base_kernel" in names


def _value(raw: dict, name: str, default=None):
    """``dflash_config[name]``, else the top-level ``name``, else ``default``."""
    sub = raw.get("dflash_config") or {}
    if name in sub and sub[name] is not None:
        return sub[name]
    return raw.get(name, default) if raw.get(name) is not None else default


def _int(raw: dict, name: str, where: str, default=None, minimum: int = 1) -> int:
    value = _value(raw, name, default)
    if value is None:
        raise ConfigError(f"{where}: missing required DFlash field {name!r} (in dflash_config or at the top level)")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: DFlash field {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _float(raw: dict, name: str, where: str, default=None):
    value = _value(raw, name, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{where}: DFlash field {name!r} must be a number, got {value!r}")
    return float(value)


def layer_kinds(raw: dict, num_layers: int, where: str) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """(sliding window or None, causal) of every draft layer, by the Qwen3 config rules."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ConfigError(f"{where}: layer_types must list 'full_attention' / 'sliding_attention' for each of "
                          f"the {num_layers} layers, got {types!r}")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and (not isinstance(window, int) or window < 1):
        raise ConfigError(f"{where}: sliding_attention layers need use_sliding_window: true and a positive "
                          f"sliding_window, got use_sliding_window={raw.get('use_sliding_window')!r}, "
                          f"sliding_window={raw.get('sliding_window')!r}")
    is_causal = raw.get("is_causal")
    causal = tuple(bool(is_causal) if is_causal is not None else s for s in sliding)
    return tuple(window if s else None for s in sliding), causal


def dflash_config_from_hf(raw: dict, target_cfg, where: str, version: int | None = None) -> DFlashConfig:
    """Parses a DFlash / DFlash 2 ``config.json`` for ``target_cfg`` (``version``: as the
    checkpoint's format was detected; None: ``architectures`` picks it). Raises ``ConfigError``
    naming a missing or bad field, a tap outside the target or a hidden size that does not match."""
    if version is None:
        version = 2 if "DFlash2DraftModel" in (raw.get("architectures") or []) else 1
    H = get_field(raw, "hidden_size", int, where=where)
    heads = get_field(raw, "num_attention_heads", int, where=where)
    L = get_field(raw, "num_hidden_layers", int, where=where)
    if raw.get("attention_bias"):
        raise ConfigError(f"{where}: DFlash drafts with attention_bias are not supported")
    if H != target_cfg.hidden_size:
        raise ConfigError(f"{where}: DFlash draft hidden_size {H} must equal the target's hidden size "
                          f"{target_cfg.hidden_size} (the context is n_sel target features of that width)")
    vocab = get_field(raw, "vocab_size", int, default=target_cfg.vocab_size, where=where)
    if vocab != target_cfg.vocab_size:
        raise ConfigError(f"{where}: DFlash vocab_size {vocab} does not match the target's {target_cfg.vocab_size}")
    num_target_layers = get_field(raw, "num_target_layers", int, where=where)
    ids = _value(raw, "target_layer_ids")
    if ids is None:
        if num_target_layers != target_cfg.num_layers:
            raise ConfigError(f"{where}: this DFlash draft was built for a {num_target_layers}-layer target "
                              f"(num_target_layers, no target_layer_ids); the target has {target_cfg.num_layers}")
        ids = default_target_layer_ids(num_target_layers, L)
    if not isinstance(ids, (list, tuple)) or not ids or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ConfigError(f"{where}: target_layer_ids must be a non-empty list of ints, got {ids!r}")
    if any(not 0 <= i < target_cfg.num_layers for i in ids):
        raise ConfigError(f"{where}: target_layer_ids {list(ids)} are outside the target's "
                          f"{target_cfg.num_layers} layers (0-based)")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: target_layer_ids {list(ids)} repeat a layer")
    mask_token_id = _int(raw, "mask_token_id", where, minimum=0)
    if mask_token_id >= vocab:
        raise ConfigError(f"{where}: mask_token_id {mask_token_id} is outside the vocabulary of {vocab}")
    windows, causal = layer_kinds(raw, L, where)
    extra = {}
    if version == 2:
        extra = {k: _int(raw, k, where) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                  "selector_top_k")}
        if H % extra["conv_group_size"]:
            raise ConfigError(f"{where}: hidden_size {H} is not a multiple of conv_group_size {extra['conv_group_size']}")
        if extra["selector_top_k"] > vocab:
            raise ConfigError(f"{where}: selector_top_k {extra['selector_top_k']} exceeds the vocabulary")
    softcap = _float(raw, "final_logit_softcapping", where)
    return DFlashConfig(
        version=version,
        hidden_size=H,
        intermediate_size=get_field(raw, "intermediate_size", int, where=where),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=get_field(raw, "num_key_value_heads", int, default=heads, where=where),
        head_dim=get_field(raw, "head_dim", int, default=128, where=where),  # Qwen3Config's default
        rms_norm_eps=float(get_field(raw, "rms_norm_eps", float, default=1e-6, where=where)),
        rope=parse_rope(raw, where),
        vocab_size=vocab,
        target_layer_ids=tuple(ids),
        num_target_layers=num_target_layers,
        block_size=_int(raw, "block_size", where, default=16, minimum=2),
        mask_token_id=mask_token_id,
        input_embedding_scale=_float(raw, "input_embedding_scale", where, 1.0),
        output_multiplier=_float(raw, "output_multiplier", where, 1.0),
        final_logit_softcapping=softcap if softcap and softcap > 0 else None,
        layer_windows=windows,
        layer_causal=causal,
        **extra,
    )


def dflash_table(cfg: DFlashConfig, *, codebook_suffix: str = "") -> Table:
    """The draft's own tensors (not the target's embedding or head). ``codebook_suffix``:
    "" (published files) or ".weight" (``save_pretrained``) for DFlash 2's codebooks."""
    H = cfg.hidden_size
    layer = llama_layer_entries(cfg, join_q=False)  # q apart: the context projects k/v alone
    if cfg.version == 2:
        K, dyn = cfg.conv_kernel_size, 2 * cfg.conv_kernel_size * cfg.conv_groups
        for ours, theirs in (("attn_conv", "attention_conv"), ("mlp_conv", "mlp_conv")):
            layer += [Param(ours + "_base", theirs + ".base_kernel", (2, K, H)),
                      Param(ours + "_proj", theirs + ".kernel_projection.weight", (H, dyn), perm=LINEAR)]
    table: Table = [Param("fc", "fc.weight", (cfg.feature_size, H), perm=LINEAR),
                    Param("hidden_norm", "hidden_norm.weight", (H,), init="ones")]
    table += stacked(layer, "layers/", "layers.{i}.", range(cfg.num_layers))
    table.append(Param("norm", "norm.weight", (H,), init="ones"))
    if cfg.version == 2:
        R, V = cfg.selector_rank, cfg.vocab_size
        sel = "candidate_selector."
        table += [Param("selector/hidden_proj", sel + "hidden_projection.weight", (H, R), perm=LINEAR),
                  Param("selector/predecessor", sel + "predecessor_codebook" + codebook_suffix, (V, R)),
                  Param("selector/successor", sel + "successor_codebook" + codebook_suffix, (V, R))]
    return table


def shared_target_params(params: dict, target_params: dict) -> dict:
    """Adds the target's embedding (and untied head) the draft embeds and projects with."""
    out = dict(params, embed=target_params["embed"])
    if "lm_head" in target_params:
        out["lm_head"] = target_params["lm_head"]
    return out


def load_dflash(ckpt, raw: dict, target, dtype, where: str):
    """Reads a DFlash / DFlash 2 checkpoint for ``target`` (a ``Model``) -> ``DraftModel``."""
    # the version as detected (architectures first, tensors when a config names none)
    cfg = dflash_config_from_hf(raw, target.config, where, version=2 if is_dflash2(ckpt.keys()) else 1)
    suffix = ""
    if cfg.version == 2 and "candidate_selector.predecessor_codebook" not in ckpt:
        suffix = ".weight"
    table = dflash_table(cfg, codebook_suffix=suffix)
    # a small draft: replicated on every shard of the target's mesh (None: one device)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, target.mesh, split=False))
    return dflash_draft(cfg, shared_target_params(params, target.params), ckpt.path)


def init_dflash_params(cfg: DFlashConfig, seed, target_params: dict, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random draft params (tests, training init), sharing the target's embedding and head."""
    return shared_target_params(init_params(dflash_table(cfg), seed, scale=scale, dtype=dtype), target_params)


def dflash_hf_config(cfg: DFlashConfig, *, dtype: str) -> dict:
    """The published config (a Qwen3 config with the DFlash fields in ``dflash_config``)."""
    sliding = [w is not None for w in cfg.layer_windows]
    windows = {w for w in cfg.layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError("the published config has one sliding_window for all sliding layers")
    dflash = {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
              "target_layer_ids": list(cfg.target_layer_ids)}
    if cfg.input_embedding_scale != 1.0:
        dflash["input_embedding_scale"] = cfg.input_embedding_scale
    if cfg.output_multiplier != 1.0:
        dflash["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.version == 2:
        dflash.update(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                      selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)
    out = {
        "architectures": ["DFlash2DraftModel" if cfg.version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        **decoder_fields(cfg, cfg.num_layers),
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_target_layers": cfg.num_target_layers,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "use_sliding_window": bool(windows),
        "sliding_window": windows.pop() if windows else None,
        "dflash_config": dflash,
        "torch_dtype": dtype,
    }
    if cfg.rope.kind != "default":
        raise ValueError("export_dflash writes default RoPE only")
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope.theta}
    if tuple(cfg.layer_causal) != tuple(sliding):
        if len(set(cfg.layer_causal)) != 1:
            raise ValueError("the published config has one is_causal for all layers")
        out["is_causal"] = bool(cfg.layer_causal[0])
    return out


def export_dflash(path: str, params: dict, cfg: DFlashConfig, *, dtype: str = "float32") -> None:
    """Writes the draft to ``path`` in the published layout (``config.json`` +
    ``model.safetensors``; the target's embedding and head are not written)."""
    os.makedirs(path, exist_ok=True)
    tensors = export_params(dflash_table(cfg), params, resolve_dtype(dtype))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), dflash_hf_config(cfg, dtype=dtype))


def describe(cfg: DFlashConfig) -> str:
    """One line for logs."""
    kinds = ",".join("full" if w is None else f"sliding{w}" for w in cfg.layer_windows)
    return (f"DFlash{'' if cfg.version == 1 else ' 2'}: {cfg.num_layers} layers ({kinds}), block {cfg.block_size}, "
            f"taps {list(cfg.target_layer_ids)}, mask token {cfg.mask_token_id}")

