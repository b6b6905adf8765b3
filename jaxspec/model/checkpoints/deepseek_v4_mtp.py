"""Checkpoint names of DeepSeek-V4's MTP layer: ``mtp.{k}.*`` in DeepSeek's published names, whichever
layout the trunk is in (``jaxspec.model.drafts.deepseek_v4_mtp``). Its embedding and output head are
the target's."""

from __future__ import annotations

import re

import numpy as np

from jaxspec.model.drafts.deepseek_v4_mtp import V4MtpConfig
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from jaxspec.model.checkpoints.deepseek_v4 import common_entries, layer_names, routing_entries
from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, init_params, load_params, shardings_for,
                                                   stacked, with_target_embedding)
from jaxspec.model.targets.deepseek_v4_config import TOPK, DeepseekV4Config

_E_PROJ = re.compile(r"^mtp\.(\d+)\.e_proj\.weight$")


def find_v4_mtp_layers(names) -> list[int]:
    """Indices ``k`` with an ``mtp.{k}.e_proj.weight`` tensor, ascending."""
    return sorted(int(m.group(1)) for n in names if (m := _E_PROJ.match(n)))


def v4_mtp_table(cfg: V4MtpConfig) -> Table:
    t = cfg.target
    H, N, f32 = t.hidden_size, t.hc_mult, "float32"
    p = f"mtp.{cfg.layer}."
    names = layer_names("published")
    return [
        Param("enorm", p + "enorm.weight", (H,), init="ones", dtype=f32),
        Param("hnorm", p + "hnorm.weight", (H,), init="ones", dtype=f32),
        Param("e_proj", p + "e_proj.weight", (H, H), perm=LINEAR),
        Param("h_proj", p + "h_proj.weight", (H, H), perm=LINEAR),
        Param("norm", p + "norm.weight", (H,), init="ones", dtype=f32),
        Param("hc_head_fn", p + "hc_head_fn", (N * H, N), perm=LINEAR, dtype=f32),
        Param("hc_head_base", p + "hc_head_base", (N,), dtype=f32),
        Param("hc_head_scale", p + "hc_head_scale", (1,), init="ones", dtype=f32),
        *stacked(common_entries(t, names), "block/layers/", "mtp.{i}.", [cfg.layer]),
        *stacked(routing_entries(t, TOPK, names), "block/topk/", "mtp.{i}.", [cfg.layer]),
    ]


def load_v4_mtp_params(ckpt, target_cfg: DeepseekV4Config, target_params: dict, dtype, *, mesh=None,
                       fp8_block=None) -> tuple[dict, V4MtpConfig]:
    """Reads ``mtp.0.*`` (the first MTP layer) with the target's embedding and head.

    Raises:
      CheckpointError: no MTP layer, or a missing / misshaped tensor (named)."""
    found = find_v4_mtp_layers(ckpt.keys())
    if not found:
        raise CheckpointError(f"{ckpt.path}: no DeepSeek-V4 MTP layer (no mtp.{{k}}.e_proj.weight tensor)")
    cfg = V4MtpConfig(target=target_cfg, layer=found[0])
    table = v4_mtp_table(cfg)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=True), fp8_block=fp8_block)
    with_target_embedding(params, target_params)
    return params, cfg


def init_v4_mtp_params(cfg: V4MtpConfig, target_params: dict, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random MTP params around the target's embedding and head (tests)."""
    params = init_params(v4_mtp_table(cfg), seed, scale=scale, dtype=dtype)
    return with_target_embedding(params, target_params)
