"""Checkpoint names of the DeepSeek-V3 NextN / MTP layer (``model.layers.{L}.*`` of the
target's own checkpoint, or ``model.layers.0.*`` of a separate NextN export)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from jaxspec.model.drafts.mtp import MtpConfig
from jaxspec.model.checkpoints.checkpoint import CheckpointError
from jaxspec.model.checkpoints.deepseek import layer_entries
from jaxspec.model.checkpoints.name_tables import LINEAR, Param, Table, embedding, output_head, init_params, load_params, shardings_for, under
from jaxspec.model.targets.deepseek_config import DeepseekConfig

_EH_PROJ = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")


def find_mtp_layers(names) -> list[int]:
    """Indices ``i`` with a ``model.layers.{i}.eh_proj.weight`` tensor, ascending."""
    return sorted(int(m.group(1)) for k in names if (m := _EH_PROJ.match(k)))


def mtp_table(cfg: MtpConfig, *, embed: bool = True, head: bool = True) -> Table:
    """The MTP layer's tensors: enorm / hnorm / eh_proj, one DeepSeek block, the shared head
    (``embed`` / ``head``: include the layer's own embedding and output head copies)."""
    H = cfg.hidden_size
    p = f"model.layers.{cfg.layer_index}."
    table: Table = [
        Param("enorm", p + "enorm.weight", (H,), init="ones"),
        Param("hnorm", p + "hnorm.weight", (H,), init="ones"),
        Param("eh_proj", p + "eh_proj.weight", (2 * H, H), perm=LINEAR),
        *under(layer_entries(cfg.target, moe=cfg.moe, indexer=cfg.indexer), "block/", p),
        Param("head_norm", p + "shared_head.norm.weight", (H,), init="ones"),
    ]
    if embed:
        table.insert(0, embedding("embed", p + "embed_tokens.weight", cfg.target))
    if head:
        table.append(output_head("head", p + "shared_head.head.weight", cfg.target))
    return table


def _target_head(target_params: dict):  # [H, V]
    return target_params["lm_head"] if "lm_head" in target_params else target_params["embed"].T


def load_mtp_params(
    ckpt,
    target_cfg: DeepseekConfig,
    dtype,
    *,
    target_params: dict | None = None,
    layer_index: int | None = None,
    share_target_weights: bool = False,
    mesh=None,
    fp8_block: tuple[int, int] | None = None,
) -> tuple[dict, MtpConfig]:
    """Reads the NextN/MTP layer of a DeepSeek-V3 checkpoint.

    Args:
      ckpt: the checkpoint holding ``model.layers.{layer_index}.eh_proj.weight`` (the target's
        own checkpoint, or a separate NextN export whose layer is ``model.layers.0``).
      target_cfg: the target's config (shapes of the block).
      target_params: the target's params; needed when the layer has no ``embed_tokens`` /
        ``shared_head.head`` copy of its own.
      layer_index: which layer; default ``target_cfg.num_layers`` if present, else the only
        MTP layer found.
      share_target_weights: use the target's embedding and ``lm_head`` even when the layer
        ships copies (as SGLang does; saves a vocab-sized matrix each).

    Raises:
      CheckpointError: no MTP layer, or a missing / misshaped tensor (named).
    """
    found = find_mtp_layers(ckpt.keys())
    if layer_index is None:
        if target_cfg.num_layers in found:
            layer_index = target_cfg.num_layers
        elif len(found) == 1:
            layer_index = found[0]
        else:
            raise CheckpointError(
                f"{ckpt.path}: no single MTP layer (model.layers.{{i}}.eh_proj.weight found for i in {found})"
            )
    elif layer_index not in found:
        raise CheckpointError(f"{ckpt.path}: missing tensor 'model.layers.{layer_index}.eh_proj.weight'")
    p = f"model.layers.{layer_index}."
    moe = f"{p}mlp.gate.weight" in ckpt
    if moe and target_cfg.moe is None:
        raise CheckpointError(f"{ckpt.path}: the MTP layer is MoE ({p}mlp.gate.weight) but the config has no MoE fields")
    indexer = f"{p}self_attn.indexer.wk.weight" in ckpt and target_cfg.has_indexer
    cfg = MtpConfig(target=target_cfg, moe=moe, indexer=indexer, layer_index=layer_index)
    use_target = share_target_weights and target_params is not None
    own = {name: key in ckpt and not use_target for name, key in (
        ("embed", p + "embed_tokens.weight"), ("head", p + "shared_head.head.weight"))}
    table = mtp_table(cfg, **own)
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, mesh, split=True), fp8_block=fp8_block)
    for name, fallback in (("embed", lambda t: t["embed"]), ("head", _target_head)):
        if name in params:
            continue
        if target_params is None:
            key = p + ("embed_tokens.weight" if name == "embed" else "shared_head.head.weight")
            raise CheckpointError(f"{ckpt.path}: missing tensor {key!r} (and no target params to share)")
        params[name] = jnp.asarray(fallback(target_params), dtype)
    return params, cfg


def init_mtp_params(cfg: MtpConfig, seed=0, dtype=np.float32, scale: float = 0.02) -> dict:
    """Random MTP params with their own embedding and head (tests, benchmarks)."""
    return init_params(mtp_table(cfg), seed, scale=scale, dtype=dtype)
