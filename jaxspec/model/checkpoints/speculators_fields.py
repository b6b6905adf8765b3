"""What every draft in the ``speculators`` layout (DFlash, DSpark, P-EAGLE) reads alike: typed
config fields that raise ``ConfigError`` naming the field, the nested layers' Qwen3 defaults, the
chain in ``speculators_config``, the fields that tie a draft to its verifier (vocabularies, taps,
mask token) and the ``d2t`` draft vocabulary.

``prefix`` goes before a field's name in the messages ("P-EAGLE " or "").
"""

from __future__ import annotations

import numpy as np

from jaxspec.model.config import ConfigError, get_field
from jaxspec.model.checkpoints.checkpoint import CheckpointError

# The library stores the nested config as a diff against transformers' Qwen3Config: absent fields
# hold these defaults.
QWEN3_DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6}


def flag(raw: dict, name: str, default: bool, where: str) -> bool:
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {name!r} must be true or false, got {value!r}")
    return value


def integer(raw: dict, name: str, where: str, default=None, minimum: int = 1) -> int:
    value = raw.get(name, default)
    if value is None:
        raise ConfigError(f"{where}: missing required field {name!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{where}: {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def speculative_tokens(raw: dict, where: str) -> int | None:
    """``speculators_config.proposal_methods[0].speculative_tokens`` (None when absent)."""
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    if not methods:
        return None
    value = methods[0].get("speculative_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens must be a positive "
                          f"int, got {value!r}")
    return value


def vocab_sizes(raw: dict, layer: dict, target_cfg, where: str, lwhere: str, prefix: str) -> tuple[int, int]:
    """(vocab_size, draft_vocab_size): the nested layers' vocabulary, which must be the target's,
    and the draft's own (default: the same), no larger."""
    vocab = get_field(layer, "vocab_size", int, where=lwhere)
    if vocab != target_cfg.vocab_size:
        raise ConfigError(f"{lwhere}: {prefix}vocab_size {vocab} (the verifier's) does not match the target's "
                          f"{target_cfg.vocab_size}")
    draft_vocab = integer(raw, "draft_vocab_size", where, default=vocab)
    if draft_vocab > vocab:
        raise ConfigError(f"{where}: {prefix}draft_vocab_size {draft_vocab} exceeds the target vocabulary {vocab}")
    return vocab, draft_vocab


def taps(raw: dict, name: str, num_layers: int, where: str, prefix: str) -> list[int]:
    """The HF ``hidden_states`` indices in field ``name`` (default: the library's [2, L // 2, L - 3])."""
    aux = raw.get(name)
    if aux is None:  # the library's default taps
        aux = [2, num_layers // 2, num_layers - 3]
    if (not isinstance(aux, list) or not aux or any(not isinstance(a, int) or isinstance(a, bool) for a in aux)
            or len(set(aux)) != len(aux) or not all(1 <= a <= num_layers for a in aux)):
        raise ConfigError(f"{where}: {prefix}{name} {aux!r} must be distinct HF hidden_states indices in "
                          f"[1, {num_layers}] (the target's layer outputs)")
    return aux


def mask_token(raw: dict, vocab: int, where: str, prefix: str) -> int:
    value = integer(raw, "mask_token_id", where, minimum=0)
    if value >= vocab:
        raise ConfigError(f"{where}: {prefix}mask_token_id {value} is outside the vocabulary of {vocab}")
    return value


def hot_ids(ckpt, draft_vocab: int, vocab: int, prefix: str) -> np.ndarray:
    """The target ids of a reduced draft vocabulary, i32[draft_vocab], from the checkpoint's ``d2t``
    (target id = draft id + d2t[draft id])."""
    if "d2t" not in ckpt:
        raise CheckpointError(f"{ckpt.path}: {prefix}draft_vocab_size {draft_vocab} < the target's {vocab} but the "
                              f"checkpoint has no d2t map")
    hot = np.arange(draft_vocab, dtype=np.int64) + ckpt.get("d2t", (draft_vocab,)).astype(np.int64)
    if hot.min() < 0 or hot.max() >= vocab or len(set(hot.tolist())) != len(hot):
        raise CheckpointError(f"{ckpt.path}: d2t maps draft ids outside the target vocabulary or onto one id twice")
    return hot.astype(np.int32)
