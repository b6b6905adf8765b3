"""Block drafts in the ``speculators`` layout (vLLM's training library): DFlash and DSpark.

The config is the library's own (``speculators_model_type``: "dflash" or "dspark"), with the
draft layers' Qwen3 config nested in ``transformer_layer_config`` and:

    block_size, mask_token_id, draft_vocab_size, aux_hidden_state_layer_ids,
    sample_from_anchor (DSpark's default true, DFlash's false), sliding_window_non_causal,
    speculators_config.proposal_methods[0].speculative_tokens (the chain it drafts),
    DSpark: markov_rank (0: none), markov_head_type (vanilla / gated / rnn),
    enable_confidence_head, confidence_head_with_markov

``aux_hidden_state_layer_ids`` index HF's ``hidden_states`` (0: the embeddings), one more than
z-lab's ``target_layer_ids``: they are jaxspec's taps as they are. Tensors: DFlash's ``fc``,
``hidden_norm``, ``layers.*`` (Qwen3 names), ``norm``; DSpark's ``markov_head.markov_w1``
(``[V, r]``, an embedding over the target vocabulary), ``markov_head.markov_w2``,
``markov_head.gate_proj`` (gated) or ``markov_head.joint_proj`` (rnn), ``confidence_head.proj``;
and, only for a reduced draft vocabulary, ``lm_head`` with ``d2t`` (draft id -> target id offset)
and ``t2d``. The embedding, and the head of a full-vocabulary draft, are the target's.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from safetensors.numpy import save_file

from jaxspec.model.config import ConfigError, get_field, parse_rope
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.drafts.dflash import DFlashConfig, dflash_draft
from jaxspec.model.drafts.dspark import MARKOV_HEADS, DSparkConfig, dspark_draft
from jaxspec.model.checkpoints.checkpoint import decoder_fields, resolve_dtype, write_json
from jaxspec.model.checkpoints.dflash import dflash_table, layer_kinds, shared_target_params
from jaxspec.model.checkpoints.speculators_fields import (QWEN3_DEFAULTS, flag, hot_ids, integer, mask_token, speculative_tokens,
                                                 taps, vocab_sizes)
from jaxspec.model.checkpoints.name_tables import LINEAR, Param, Table, export_params, init_params, load_params, shardings_for, whole_on

MODEL_TYPES = ("dflash", "dspark")
ARCHITECTURES = ("DFlashDraftModel", "DFlashSpeculator", "DSparkDraftModel", "DSparkSpeculator")


def is_speculators(raw: dict) -> bool:
    """A config written by the ``speculators`` library (any of its draft kinds)."""
    return "speculators_model_type" in raw


def model_type(raw: dict, where: str) -> str:
    kind = raw.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise ConfigError(f"{where}: speculators_model_type {kind!r} is not a draft jaxspec loads from this "
                          f"layout; supported: {[*MODEL_TYPES, 'peagle', 'eagle3']}")
    return kind


def speculators_config_from_hf(raw: dict, target_cfg, where: str) -> DFlashConfig:
    """Parses a ``speculators`` DFlash / DSpark config for ``target_cfg``: a ``DFlashConfig`` for a
    DFlash that z-lab's drafting covers (the target's vocabulary, the anchor drafting nothing),
    else a ``DSparkConfig``. Raises ``ConfigError`` naming a missing, bad or unsupported field."""
    kind = model_type(raw, where)
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: missing the nested 'transformer_layer_config' (the draft layers' Qwen3 config)")
    lwhere = f"{where} (transformer_layer_config)"
    layer = {**QWEN3_DEFAULTS, **{k: v for k, v in layer.items() if v is not None}}
    if layer.get("model_type", "qwen3") not in ("qwen3", "llama"):
        raise ConfigError(f"{lwhere}: draft layers of model_type {layer.get('model_type')!r} are not supported "
                          f"(Qwen3-style layers)")
    if layer.get("attention_bias"):
        raise ConfigError(f"{lwhere}: draft layers with attention_bias are not supported")
    H = get_field(layer, "hidden_size", int, where=lwhere)
    heads = get_field(layer, "num_attention_heads", int, where=lwhere)
    L = get_field(layer, "num_hidden_layers", int, where=lwhere)
    if H != target_cfg.hidden_size or raw.get("target_hidden_size") not in (None, H):
        raise ConfigError(f"{where}: draft hidden_size {H} (target_hidden_size {raw.get('target_hidden_size')}) must "
                          f"equal the target's hidden size {target_cfg.hidden_size}")
    vocab, draft_vocab = vocab_sizes(raw, layer, target_cfg, where, lwhere, prefix="")
    aux = taps(raw, "aux_hidden_state_layer_ids", target_cfg.num_layers, where, prefix="")
    block = integer(raw, "block_size", where, default=8, minimum=2)
    mask = mask_token(raw, vocab, where, prefix="")
    anchor = flag(raw, "sample_from_anchor", kind == "dspark", where)
    if isinstance(layer.get("layer_types"), list) and len(layer["layer_types"]) > L:
        # the library copies the verifier's config and sets num_hidden_layers; its layers read
        # layer_types[i] for their own i only
        layer = dict(layer, layer_types=layer["layer_types"][:L])
    windows, _ = layer_kinds(layer, L, lwhere)
    non_causal = flag(raw, "sliding_window_non_causal", False, where)
    base = dict(
        hidden_size=H,
        intermediate_size=get_field(layer, "intermediate_size", int, where=lwhere),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=get_field(layer, "num_key_value_heads", int, where=lwhere),
        head_dim=get_field(layer, "head_dim", int, where=lwhere),
        rms_norm_eps=float(get_field(layer, "rms_norm_eps", float, where=lwhere)),
        rope=parse_rope(layer, lwhere),
        vocab_size=vocab,
        target_layer_ids=tuple(a - 1 for a in aux),  # z-lab's numbering: the tap is l + 1
        num_target_layers=target_cfg.num_layers,
        block_size=block,
        mask_token_id=mask,
        layer_windows=windows,
        # full-attention layers see the whole block; sliding ones causally unless non-causal
        layer_causal=tuple(w is not None and not non_causal for w in windows),
    )
    tokens = speculative_tokens(raw, where)
    if kind == "dflash" and not anchor and draft_vocab == vocab:
        return DFlashConfig(version=1, **base)
    markov = 0
    head_type, confidence, with_markov = "vanilla", False, False
    if kind == "dspark":
        markov = integer(raw, "markov_rank", where, default=256, minimum=0)
        head_type = raw.get("markov_head_type") or "vanilla"
        if head_type not in MARKOV_HEADS:
            raise ConfigError(f"{where}: markov_head_type {head_type!r} is not supported; supported: "
                              f"{list(MARKOV_HEADS)}")
        confidence = flag(raw, "enable_confidence_head", True, where)
        with_markov = confidence and flag(raw, "confidence_head_with_markov", True, where)
        if with_markov and not markov:
            raise ConfigError(f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    cfg = DSparkConfig(**base, sample_from_anchor=anchor, markov_rank=markov, markov_head_type=head_type,
                       confidence_head=confidence, confidence_with_markov=with_markov, draft_vocab_size=draft_vocab)
    if tokens is not None:
        if tokens > cfg.max_proposals:
            raise ConfigError(f"{where}: speculative_tokens {tokens} exceeds what a block of {block} holds "
                              f"({cfg.max_proposals} with sample_from_anchor {str(anchor).lower()})")
        cfg = dataclasses.replace(cfg, num_speculative_tokens=tokens)
    return cfg


def dspark_table(cfg: DFlashConfig) -> Table:
    """The draft's own tensors: DFlash's, then DSpark's heads and a reduced vocabulary's head."""
    table = dflash_table(cfg)
    if not isinstance(cfg, DSparkConfig):
        return table
    H, r, V, Vd = cfg.hidden_size, cfg.markov_rank, cfg.vocab_size, cfg.draft_vocab_size
    if r:
        table += [Param("markov/w1", "markov_head.markov_w1.weight", (V, r)),
                  Param("markov/w2", "markov_head.markov_w2.weight", (r, Vd), perm=LINEAR)]
        if cfg.markov_head_type == "gated":
            table += [Param("markov/gate_w", "markov_head.gate_proj.weight", (H + r, r), perm=LINEAR),
                      Param("markov/gate_b", "markov_head.gate_proj.bias", (r,), init="zeros")]
        elif cfg.markov_head_type == "rnn":
            table += [Param("markov/joint_w", "markov_head.joint_proj.weight", (2 * r + H, 3 * r), perm=LINEAR),
                      Param("markov/joint_b", "markov_head.joint_proj.bias", (3 * r,), init="zeros")]
    if cfg.confidence_head:
        width = H + (r if cfg.confidence_with_markov else 0)
        table += [Param("confidence/w", "confidence_head.proj.weight", (width, 1), perm=LINEAR),
                  Param("confidence/b", "confidence_head.proj.bias", (1,), init="zeros")]
    if cfg.own_vocab:
        table.append(Param("own_head", "lm_head.weight", (H, Vd), perm=LINEAR))
    return table


def _draft_of(cfg: DFlashConfig, params: dict, path: str | None) -> DraftModel:
    return dspark_draft(cfg, params, path) if isinstance(cfg, DSparkConfig) else dflash_draft(cfg, params, path)


def load_speculators(ckpt, raw: dict, target, dtype, where: str) -> DraftModel:
    """Reads a ``speculators`` DFlash / DSpark checkpoint for ``target`` (a ``Model``)."""
    cfg = speculators_config_from_hf(raw, target.config, where)
    table = dspark_table(cfg)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, target.mesh, split=False))
    if isinstance(cfg, DSparkConfig) and cfg.own_vocab:
        params["hot_ids"] = whole_on(hot_ids(ckpt, cfg.draft_vocab_size, cfg.vocab_size, prefix=""), target.mesh)
    return _draft_of(cfg, shared_target_params(params, target.params), ckpt.path)


def init_dspark_params(cfg: DFlashConfig, seed, target_params: dict, dtype=np.float32, scale: float = 0.02,
                       hot_ids: np.ndarray | None = None) -> dict:
    """Random draft params (tests, training init), sharing the target's embedding and head; a
    reduced vocabulary needs its ``hot_ids`` (sorted target ids)."""
    params = init_params(dspark_table(cfg), seed, scale=scale, dtype=dtype)
    if isinstance(cfg, DSparkConfig) and cfg.own_vocab:
        if hot_ids is None or len(hot_ids) != cfg.draft_vocab_size:
            raise ValueError(f"a reduced draft vocabulary needs hot_ids of {cfg.draft_vocab_size} target ids")
        params["hot_ids"] = np.asarray(hot_ids, np.int32)
    return shared_target_params(params, target_params)


def speculators_hf_config(cfg: DFlashConfig, *, dtype: str, verifier: str | None = None) -> dict:
    """The ``speculators`` config of a DFlash / DSpark draft (``DSparkConfig``: "dspark")."""
    dspark = isinstance(cfg, DSparkConfig)
    windows = {w for w in cfg.layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError("the speculators config has one sliding_window for all sliding layers")
    if cfg.rope.kind != "default":
        raise ValueError("export writes default RoPE only")
    if any(c != (w is not None) for c, w in zip(cfg.layer_causal, cfg.layer_windows)):
        raise ValueError("the speculators layout has full layers bidirectional and sliding layers causal")
    layer = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **decoder_fields(cfg, cfg.num_layers),
        "vocab_size": cfg.vocab_size, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in cfg.layer_windows],
        "use_sliding_window": bool(windows), "sliding_window": windows.pop() if windows else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope.theta}, "dtype": dtype,
    }
    anchor = cfg.sample_from_anchor if dspark else False
    tokens = cfg.num_speculative_tokens if dspark else cfg.block_size - 1
    out = {
        "architectures": ["DSparkDraftModel" if dspark else "DFlashDraftModel"],
        "speculators_model_type": "dspark" if dspark else "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size if dspark else cfg.vocab_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": [l + 1 for l in cfg.target_layer_ids],
        "sample_from_anchor": anchor,
        "sliding_window_non_causal": False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "dspark" if dspark else "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"architectures": [], "name_or_path": verifier},
        },
        "dtype": dtype,
    }
    if dspark:
        out.update(markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
                   enable_confidence_head=cfg.confidence_head,
                   confidence_head_with_markov=cfg.confidence_with_markov)
    return out


def export_speculators(path: str, params: dict, cfg: DFlashConfig, *, dtype: str = "float32",
                       verifier: str | None = None) -> None:
    """Writes the draft to ``path`` in the ``speculators`` layout (``config.json`` +
    ``model.safetensors``; the target's embedding and head are not written, a reduced
    vocabulary's ``lm_head``, ``d2t`` and ``t2d`` are)."""
    os.makedirs(path, exist_ok=True)
    tensors = export_params(dspark_table(cfg), params, resolve_dtype(dtype))
    if isinstance(cfg, DSparkConfig) and cfg.own_vocab:
        hot = np.asarray(params["hot_ids"], np.int64)
        tensors["d2t"] = hot - np.arange(cfg.draft_vocab_size, dtype=np.int64)
        t2d = np.zeros((cfg.vocab_size,), bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), speculators_hf_config(cfg, dtype=dtype, verifier=verifier))
