"""``load_model``: HF checkpoint directory -> ``Model`` (config + param pytree + tokenizer).

The family is picked from ``config.json`` (``architectures`` first, ``model_type`` second);
its parameter-name table drives the read (``jaxspec.model.io.tables``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from jaxspec.model.config import ConfigError
from jaxspec.model.io.checkpoint import SafetensorsCheckpoint, read_config, read_eos_ids, resolve_dtype
from jaxspec.model.io.deepseek import deepseek_table, has_fused_experts
from jaxspec.model.io.gemma4 import gemma4_table
from jaxspec.model.io.llama import llama_table
from jaxspec.model.io.tables import load_params
from jaxspec.model.io.tokenizer import load_tokenizer
from jaxspec.model.targets import Model
from jaxspec.model.targets import deepseek_config as ds
from jaxspec.model.targets import gemma4_config as gemma4
from jaxspec.model.targets import llama_config as llama


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    name: str
    architectures: tuple[str, ...]  # HF `architectures` values
    model_types: tuple[str, ...]  # HF `model_type` values (used when `architectures` is absent)
    parse: Callable  # (raw config, where) -> config
    table: Callable  # (config, checkpoint) -> parameter table


TARGET_FAMILIES = (
    TargetFamily("llama", tuple(llama.LLAMA_FAMILY), tuple(llama.MODEL_TYPES),
                 lambda raw, where: llama.llama_config_from_hf(raw, where), lambda cfg, ckpt: llama_table(cfg)),
    TargetFamily("deepseek", tuple(ds.ARCHITECTURES), tuple(ds.MODEL_TYPES), ds.deepseek_config_from_hf,
                 lambda cfg, ckpt: deepseek_table(cfg, fused_experts=has_fused_experts(ckpt, cfg))),
    TargetFamily("gemma4", gemma4.ARCHITECTURES, gemma4.MODEL_TYPES, gemma4.gemma4_config_from_hf,
                 lambda cfg, ckpt: gemma4_table(cfg)),  # text weights only (CondGen towers ignored)
)


def target_family(raw: dict, where: str) -> TargetFamily:
    """The family of a target checkpoint, from ``architectures`` first, ``model_type`` second."""
    archs = raw.get("architectures") or []
    for fam in TARGET_FAMILIES:
        if set(archs) & set(fam.architectures):
            return fam
    if not archs:
        for fam in TARGET_FAMILIES:
            if raw.get("model_type") in fam.model_types:
                return fam
    supported = sorted(a for fam in TARGET_FAMILIES for a in fam.architectures)
    raise ConfigError(f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; supported: {supported}")


def load_model(path: str | os.PathLike, dtype="bfloat16", *, progress: bool = True) -> Model:
    """Loads an HF causal-LM checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``); ``tokenizer.json`` is attached when present.
      dtype: "bfloat16" | "float32" | "float16": params are cast to it.
      progress: show a progress bar over the tensors.

    Raises:
      FileNotFoundError: the directory or a required file is missing.
      ValueError (ConfigError / CheckpointError): unsupported architecture, a bad config
        field, a missing or misshaped tensor, an unknown dtype.
    """
    path = os.fspath(path)
    np_dtype = resolve_dtype(dtype)
    raw = read_config(path)
    where = os.path.join(path, "config.json")
    family = target_family(raw, where)
    cfg = family.parse(raw, where)
    ckpt = SafetensorsCheckpoint(path)
    try:
        params = load_params(family.table(cfg, ckpt), ckpt, np_dtype, progress=progress, desc="loading")
    finally:
        ckpt.close()
    tokenizer = load_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Model(config=cfg, params=params, dtype=np_dtype, tokenizer=tokenizer,
                 eos_token_ids=read_eos_ids(path, raw), path=path)
