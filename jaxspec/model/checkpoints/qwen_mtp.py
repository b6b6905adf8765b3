"""Checkpoint names of the Qwen3-Next / Qwen3.5 MTP layers (``mtp.*`` in the target's own checkpoint:
``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.{i}.*``, ``norm``). Layout of our
params: ``jaxspec.model.drafts.qwen_mtp``."""

from __future__ import annotations

import re

import numpy as np

from jaxspec.model.drafts.qwen_mtp import QwenMtpConfig
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from jaxspec.model.checkpoints.hybrid import full_attention_entries, mlp_entries
from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, init_params, load_params, shardings_for,
                                                   stacked, with_target_embedding)
from jaxspec.model.targets.hybrid_config import HybridConfig

_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layer_count(names) -> int:
    """MTP decoder layers present (``mtp.layers.{i}.*``)."""
    found = {int(m.group(1)) for k in names if (m := _LAYER.match(k))}
    return max(found) + 1 if found else 0


def qwen_mtp_table(cfg: QwenMtpConfig, fused_experts: bool = False) -> Table:
    t, H = cfg.target, cfg.target.hidden_size
    layer = [Param("attn_norm", "input_layernorm.weight", (H,), init="zeros"), *full_attention_entries(t),
             *mlp_entries(t, "moe" if cfg.moe else "dense", fused_experts)]
    return [Param("fc", "mtp.fc.weight", (2 * H, H), perm=LINEAR),
            Param("pre_fc_norm_embedding", "mtp.pre_fc_norm_embedding.weight", (H,), init="zeros"),
            Param("pre_fc_norm_hidden", "mtp.pre_fc_norm_hidden.weight", (H,), init="zeros"),
            *stacked(layer, "layers/", "mtp.layers.{i}.", range(cfg.num_mtp_layers)),
            Param("norm", "mtp.norm.weight", (H,), init="zeros")]


def load_qwen_mtp_params(ckpt, target_cfg: HybridConfig, target_params: dict, dtype, *, mesh=None
                         ) -> tuple[dict, QwenMtpConfig]:
    """The MTP layers of a Qwen3-Next / Qwen3.5 checkpoint, with the target's embedding and head.

    Raises:
      CheckpointError: no MTP layer, or a missing / misshaped tensor (named).
    """
    names = set(ckpt.keys())
    n = mtp_layer_count(names)
    if "mtp.fc.weight" not in names or n == 0:
        raise CheckpointError(f"{ckpt.path}: no MTP layer (mtp.fc.weight and mtp.layers.0.* not found)")
    moe = "mtp.layers.0.mlp.gate.weight" in names
    if moe and target_cfg.moe is None:
        raise CheckpointError(f"{ckpt.path}: the MTP layer is MoE (mtp.layers.0.mlp.gate.weight) but the config has "
                              f"no MoE fields")
    cfg = QwenMtpConfig(target=target_cfg, num_mtp_layers=n, moe=moe)
    table = qwen_mtp_table(cfg, fused_experts="mtp.layers.0.mlp.experts.gate_up_proj" in names)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=True))
    with_target_embedding(params, target_params)
    return params, cfg


def init_qwen_mtp_params(cfg: QwenMtpConfig, target_params: dict, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random MTP params sharing ``target_params``' embedding and head (tests, benchmarks)."""
    params = init_params(qwen_mtp_table(cfg), seed, scale=scale, dtype=dtype)
    return with_target_embedding(params, target_params)
