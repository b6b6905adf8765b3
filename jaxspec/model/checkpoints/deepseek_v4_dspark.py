"""Checkpoint names of DeepSeek's DSpark draft for DeepSeek-V4 (DeepSeek-V4-Flash-DSpark): S stages
``mtp.{0..S-1}.*`` in the target's own checkpoint, DeepSeek's published names
(``jaxspec.model.drafts.deepseek_v4_dspark``):

    mtp.0.main_proj.weight [H, n*H], mtp.0.main_norm.weight [H]                       (first stage)
    mtp.{s}.{attn_norm, ffn_norm, hc_attn_*, hc_ffn_*, attn.*, ffn.gate.{weight,bias}, ffn.experts.*,
             ffn.shared_experts.*}                        (every stage: a sliding-window V4 block)
    mtp.{S-1}.norm.weight, hc_head_{fn,base,scale}, markov_head.markov_w1.weight [V, r] (an embedding),
             markov_head.markov_w2.weight [V, r] (a linear r -> V), confidence_head.proj.weight [1, H + r]
                                                                                      (last stage)

Config (``config.json``, beside the target's fields): ``dspark_block_size``, ``dspark_noise_token_id``,
``dspark_target_layer_ids``, ``dspark_markov_rank``; optional ``n_mtp_layers`` (DeepSeek's inference
config; else the stages found), ``enable_confidence_head`` (default true, as vLLM) and
``compress_ratios`` (the stages' entries, after the target's layers, must be 0: sliding window).
The embedding and the output head are the target's.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import ConfigError
from jaxspec.model.drafts.deepseek_v4_dspark import V4DSparkConfig
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from jaxspec.model.checkpoints.deepseek_v4 import common_entries, layer_names, routing_entries
from jaxspec.model.checkpoints.name_tables import (LINEAR, Param, Table, init_params, load_params, shardings_for,
                                                   stacked, with_target_embedding)
from jaxspec.model.targets.deepseek_v4_config import TOPK, DeepseekV4Config

MAIN_PROJ = "mtp.0.main_proj.weight"
_STAGE = re.compile(r"^mtp\.(\d+)\.attn_norm\.weight$")


def is_v4_dspark(names) -> bool:
    """DeepSeek's DSpark stages: the first one's ``main_proj`` marks them."""
    return MAIN_PROJ in names


def find_stages(names) -> list[int]:
    return sorted(int(m.group(1)) for n in names if (m := _STAGE.match(n)))


def _field(raw: dict, key: str, where: str):
    if key not in raw:
        raise ConfigError(f"{where}: a DeepSeek-V4 DSpark checkpoint (mtp.0.main_proj) needs {key!r} in config.json")
    return raw[key]


def _int_field(raw: dict, key: str, where: str, minimum: int = 0) -> int:
    v = _field(raw, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{where}: DSpark {key} must be an integer >= {minimum}, got {v!r}")
    return v


def v4_dspark_config_from_hf(raw: dict, names, target: DeepseekV4Config, where: str) -> V4DSparkConfig:
    """The draft's config from the checkpoint's ``config.json`` and tensor names.

    Raises:
      ConfigError: a missing or bad ``dspark_*`` field, stages that are not contiguous from 0 or do not
        match ``n_mtp_layers``, or a stage with compressed attention (named)."""
    stages = find_stages(names)
    if stages != list(range(len(stages))) or not stages:
        raise ConfigError(f"{where}: DSpark stages must be mtp.0 .. mtp.S-1, found mtp.{stages}")
    S = len(stages)
    if raw.get("n_mtp_layers") is not None and raw["n_mtp_layers"] != S:
        raise ConfigError(f"{where}: n_mtp_layers {raw['n_mtp_layers']} but the checkpoint holds {S} DSpark stages")
    ratios = raw.get("compress_ratios")
    if isinstance(ratios, list) and len(ratios) > target.num_layers:
        staged = ratios[target.num_layers:target.num_layers + S]
        if any(r != 0 for r in staged):
            raise ConfigError(f"{where}: compress_ratios gives the DSpark stages {staged}: only sliding-window "
                              f"stages (0) are supported")
    layers = _field(raw, "dspark_target_layer_ids", where)
    if not isinstance(layers, list) or not layers or not all(isinstance(l, int) and not isinstance(l, bool)
                                                             for l in layers):
        raise ConfigError(f"{where}: dspark_target_layer_ids must be a non-empty list of layer indices, got {layers!r}")
    confidence = raw.get("enable_confidence_head", True)
    if not isinstance(confidence, bool):
        raise ConfigError(f"{where}: enable_confidence_head must be true or false, got {confidence!r}")
    try:
        return V4DSparkConfig(target=target, num_stages=S, block_size=_int_field(raw, "dspark_block_size", where, 1),
                              mask_token_id=_int_field(raw, "dspark_noise_token_id", where),
                              target_layer_ids=tuple(layers),
                              markov_rank=_int_field(raw, "dspark_markov_rank", where, 1),
                              confidence_head=confidence)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def v4_dspark_table(cfg: V4DSparkConfig) -> Table:
    t = cfg.target
    H, N, V, r, S, f32 = t.hidden_size, t.hc_mult, t.vocab_size, cfg.markov_rank, cfg.num_stages, "float32"
    last = f"mtp.{S - 1}."
    names = layer_names("published")
    table = [
        Param("main_proj", MAIN_PROJ, (len(cfg.target_layer_ids) * H, H), perm=LINEAR),
        Param("main_norm", "mtp.0.main_norm.weight", (H,), init="ones", dtype=f32),
        *stacked(common_entries(t, names), "stages/layers/", "mtp.{i}.", range(S)),
        *stacked(routing_entries(t, TOPK, names), "stages/topk/", "mtp.{i}.", range(S)),
        Param("norm", last + "norm.weight", (H,), init="ones", dtype=f32),
        Param("hc_head_fn", last + "hc_head_fn", (N * H, N), perm=LINEAR, dtype=f32),
        Param("hc_head_base", last + "hc_head_base", (N,), dtype=f32),
        Param("hc_head_scale", last + "hc_head_scale", (1,), init="ones", dtype=f32),
        Param("markov/w1", last + "markov_head.markov_w1.weight", (V, r)),
        Param("markov/w2", last + "markov_head.markov_w2.weight", (r, V), perm=LINEAR, dtype=f32),
    ]
    if cfg.confidence_head:
        table.append(Param("confidence/w", last + "confidence_head.proj.weight", (H + r, 1), perm=LINEAR, dtype=f32))
    return table


def _with_target(params: dict, cfg: V4DSparkConfig, target_params: dict) -> dict:
    with_target_embedding(params, target_params)
    if cfg.confidence_head:
        params["confidence"]["b"] = jnp.zeros((1,), jnp.float32)  # DeepSeek's proj has no bias
    return params


def load_v4_dspark_params(ckpt, raw: dict, target_cfg: DeepseekV4Config, target_params: dict, dtype, where: str, *,
                          mesh=None, fp8_block=None) -> tuple[dict, V4DSparkConfig]:
    """Reads the DSpark stages with the target's embedding and head.

    Raises:
      ConfigError / CheckpointError: a bad config field or a missing / misshaped tensor (named)."""
    cfg = v4_dspark_config_from_hf(raw, set(ckpt.keys()), target_cfg, where)
    if cfg.confidence_head and f"mtp.{cfg.num_stages - 1}.confidence_head.proj.weight" not in ckpt.keys():
        raise CheckpointError(f"{ckpt.path}: enable_confidence_head but no mtp.{cfg.num_stages - 1}.confidence_head."
                              f"proj.weight (set enable_confidence_head false for a draft without one)")
    table = v4_dspark_table(cfg)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=True), fp8_block=fp8_block)
    return _with_target(params, cfg, target_params), cfg


def init_v4_dspark_params(cfg: V4DSparkConfig, target_params: dict, seed=0, dtype=np.float32,
                          scale: float = 0.02) -> dict:
    """Random stages around the target's embedding and head (tests)."""
    return _with_target(init_params(v4_dspark_table(cfg), seed, scale=scale, dtype=dtype), cfg, target_params)
