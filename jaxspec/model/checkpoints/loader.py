"""``load_model``: HF checkpoint directory -> ``Model`` (config + param pytree + tokenizer).

The family is picked from ``config.json`` (``architectures`` first, ``model_type`` second);
its parameter-name table drives the read (``jaxspec.model.checkpoints.name_tables``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

from jaxspec.mesh import MODEL, axis_size
from jaxspec.model.config import ConfigError
from jaxspec.model.checkpoints.checkpoint import (CheckpointTensors, check_same_checkpoint, fp8_block_size, read_config,
                                         read_eos_ids, resolve_dtype)
from jaxspec.model.checkpoints.deepseek import deepseek_table, has_fused_experts
from jaxspec.model.checkpoints import deepseek_v4 as v4_io
from jaxspec.model.checkpoints.gemma4 import gemma4_table, leaves_unread as gemma4_leaves_unread
from jaxspec.model.checkpoints.llama import llama_table
from jaxspec.model.checkpoints.hybrid import has_fused_experts as hybrid_fused_experts
from jaxspec.model.checkpoints.hybrid import hybrid_table
from jaxspec.model.checkpoints.name_tables import load_params, shardings_for, unread_tensors
from jaxspec.model.checkpoints.tokenizer import load_tokenizer
from jaxspec.model.targets import Model
from jaxspec.model.targets import deepseek_config as ds
from jaxspec.model.targets import deepseek_v4_config as v4
from jaxspec.model.targets import gemma4_config as gemma4
from jaxspec.model.targets import llama_config as llama
from jaxspec.model.targets import hybrid_config as hybrid


@dataclasses.dataclass(frozen=True)
class TargetFamily:
    name: str
    architectures: tuple[str, ...]  # HF `architectures` values
    model_types: tuple[str, ...]  # HF `model_type` values (used when `architectures` is absent)
    parse: Callable  # (raw config, where) -> config
    table: Callable  # (config, checkpoint) -> parameter table
    for_mesh: Callable  # (config, model-axis shards, where) -> the config split over them (or an error)
    # (checkpoint tensor name, config) -> True for what the family leaves unread on purpose
    leaves_unread: Callable = lambda name, cfg: False


def _mtp_layer(name: str, cfg) -> bool:
    """DeepSeek's MTP (NextN) layers, stored after the main layers; ``load_draft`` reads them."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= cfg.num_layers


TARGET_FAMILIES = (
    TargetFamily("llama", tuple(llama.LLAMA_FAMILY), tuple(llama.MODEL_TYPES),
                 lambda raw, where: llama.llama_config_from_hf(raw, where),
                 lambda cfg, ckpt: llama_table(cfg, kv_repeat=cfg.kv_repeat), llama.llama_for_tensor_parallel),
    TargetFamily("deepseek", tuple(ds.ARCHITECTURES), tuple(ds.MODEL_TYPES), ds.deepseek_config_from_hf,
                 lambda cfg, ckpt: deepseek_table(cfg, fused_experts=has_fused_experts(ckpt, cfg)),
                 ds.deepseek_for_tensor_parallel, leaves_unread=_mtp_layer),
    TargetFamily("deepseek_v4", v4.ARCHITECTURES, v4.MODEL_TYPES, v4.deepseek_v4_config_from_hf,
                 v4_io.checkpoint_table, v4.deepseek_v4_for_tensor_parallel, leaves_unread=v4_io.leaves_unread),
    TargetFamily("gemma4", gemma4.ARCHITECTURES, gemma4.MODEL_TYPES, gemma4.gemma4_config_from_hf,
                 lambda cfg, ckpt: gemma4_table(cfg),  # text weights only (CondGen towers ignored)
                 gemma4.gemma4_for_tensor_parallel, leaves_unread=gemma4_leaves_unread),
    TargetFamily("qwen3_next", tuple(hybrid.ARCHITECTURES), hybrid.MODEL_TYPES, hybrid.hybrid_config_from_hf,
                 lambda cfg, ckpt: hybrid_table(cfg, fused_experts=hybrid_fused_experts(ckpt, cfg)),
                 hybrid.hybrid_for_tensor_parallel,
                 # the MTP layers (read by load_draft) and a ConditionalGeneration's vision tower
                 leaves_unread=lambda name, cfg: name.startswith("mtp.") or not name.startswith((cfg.prefix, "lm_head"))),
)


def warn_unread(model: str, table, ckpt, path: str, leaves_unread=lambda name: False) -> None:
    """Warns about checkpoint tensors that nothing reads: weights the model (named ``model`` in the
    warning) would run without (a bias or a norm of a variant jaxspec does not know), so its output
    would differ from the checkpoint's own model. ``leaves_unread(name)``: a tensor known to be unneeded."""
    unread = [n for n in unread_tensors(table, ckpt.keys())
              if not n.endswith("rotary_emb.inv_freq") and not leaves_unread(n)]
    if unread:
        shown = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        warnings.warn(f"{path}: {len(unread)} checkpoint tensor(s) are not read by jaxspec's {model} "
                      f"model, which runs without them, so its output may differ from the checkpoint's: {shown}",
                      stacklevel=3)


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


def load_model(path: str | os.PathLike, dtype="bfloat16", *, mesh=None, progress: bool = True) -> Model:
    """Loads an HF causal-LM checkpoint directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``), or PyTorch's ``pytorch_model.bin`` (or its shards with
        ``pytorch_model.bin.index.json``; read without torch, running nothing from the pickle);
        ``tokenizer.json`` is attached when present.
      dtype: "bfloat16" | "float32" | "float16": params are cast to it (on the device).
      mesh: a ``jaxspec.make_mesh`` mesh: the weights are streamed straight into their shards
        (tensor parallel over its ``model`` axis, replicated over ``data``; the vocabulary padded
        to split evenly), each process reading only the bytes of its own devices' shards. None:
        one device.
      progress: show a progress bar over the tensors.

    Raises:
      FileNotFoundError: the directory or a required file is missing.
      ValueError (ConfigError / CheckpointError): unsupported architecture, a bad config
        field, a missing or misshaped tensor, an unknown dtype, an unsupported quantization
        (block-scaled FP8 weights, as DeepSeek-V3 ships them, are dequantized while loading), a
        mesh the model cannot be split over (heads or experts not divisible; any vocabulary is
        padded), processes of a ``jax.distributed`` job loading different checkpoints.
    """
    path = os.fspath(path)
    np_dtype = resolve_dtype(dtype)
    raw = read_config(path)
    where = os.path.join(path, "config.json")
    family = target_family(raw, where)
    fp8_block = fp8_block_size(raw, where)
    cfg = family.for_mesh(family.parse(raw, where), axis_size(mesh, MODEL), where)
    ckpt = CheckpointTensors(path)
    check_same_checkpoint(path, raw, ckpt, np_dtype, mesh)
    table = family.table(cfg, ckpt)
    warn_unread(family.name, table, ckpt, path, lambda name: family.leaves_unread(name, cfg))
    params = load_params(table, ckpt, np_dtype, sharding_of=shardings_for(table, mesh, split=True),
                         fp8_block=fp8_block, progress=progress, desc="loading")
    tokenizer = load_tokenizer(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Model(config=cfg, params=params, dtype=np_dtype, tokenizer=tokenizer,
                 eos_token_ids=read_eos_ids(path, raw), path=path, mesh=mesh)
