"""``load_draft``: a draft checkpoint directory -> ``DraftModel``, its kind detected from the files.

Detection reads ``config.json``'s ``architectures`` first and the tensor names second. A
draft-specific architecture (``LlamaForCausalLMEagle3``, ``JaxspecFrozenKVAssistant``, ...)
names its format, and the tensors must agree; a generic LM architecture (``LlamaForCausalLM``,
which SafeAILab's EAGLE checkpoints also carry) is told apart by its tensors (``fc.weight``
marks an EAGLE head). Two kinds are told apart by their config instead: a ``speculators`` block
draft (``speculators_model_type``) and a PARD draft (an LM whose config carries its mask token
``pard_token``; an LM without it is a standalone draft). Anything else is refused with an error
naming what was found and what is supported, so no checkpoint is loaded as a kind it is not.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from jaxspec.mesh import MODEL, axis_size
from jaxspec.model.config import ConfigError, padded_vocab_size
from jaxspec.model.drafts.assistant import assistant_draft
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.drafts.deepseek_v4_dspark import v4_dspark_draft
from jaxspec.model.drafts.deepseek_v4_mtp import v4_mtp_draft
from jaxspec.model.drafts.eagle import eagle_draft
from jaxspec.model.drafts.mtp import mtp_draft
from jaxspec.model.drafts.pard import PardDraft
from jaxspec.model.drafts.qwen_mtp import qwen_mtp_draft
from jaxspec.model.drafts.standalone import StandaloneDraft
from jaxspec.model.checkpoints import assistant as assistant_io
from jaxspec.model.checkpoints import dflash as dflash_io
from jaxspec.model.checkpoints import peagle as peagle_io
from jaxspec.model.checkpoints import speculators as speculators_io
from jaxspec.model.checkpoints.checkpoint import (CheckpointError, CheckpointTensors, check_same_checkpoint, fp8_block_size,
                                         read_config, resolve_dtype)
from jaxspec.model.checkpoints.eagle import ARCHITECTURES as EAGLE_ARCHITECTURES
from jaxspec.model.checkpoints.eagle import detect_eagle_version, load_eagle
from jaxspec.model.checkpoints.loader import TARGET_FAMILIES, target_family, warn_unread
from jaxspec.model.checkpoints.deepseek_v4_dspark import is_v4_dspark, load_v4_dspark_params
from jaxspec.model.checkpoints.deepseek_v4_mtp import find_v4_mtp_layers, load_v4_mtp_params
from jaxspec.model.checkpoints.mtp import find_mtp_layers, load_mtp_params
from jaxspec.model.checkpoints.qwen_mtp import load_qwen_mtp_params
from jaxspec.model.checkpoints.name_tables import load_params, shardings_for
from jaxspec.model.targets import Model
from jaxspec.model.targets.deepseek_config import DeepseekConfig
from jaxspec.model.targets.deepseek_v4_config import ARCHITECTURES as V4_ARCHITECTURES
from jaxspec.model.targets.deepseek_v4_config import DeepseekV4Config
from jaxspec.model.targets.gemma4_config import Gemma4Config
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.model.targets.hybrid_config import ARCHITECTURES as HYBRID_ARCHITECTURES
from jaxspec.model.targets.hybrid_config import HybridConfig

LM_ARCHITECTURES = tuple(a for fam in TARGET_FAMILIES for a in fam.architectures)


@dataclasses.dataclass(frozen=True)
class DraftFormat:
    """One checkpoint format a draft can come in.

    name: for messages. architectures: ``config.json`` values that may name it.
    matches: (tensor names) -> whether the tensors are of this format.
    targets: target config types it can serve.
    load: (ckpt, raw config, target, dtype, where, path) -> DraftModel, placed on the target's mesh.
    """

    name: str
    architectures: tuple[str, ...]
    matches: Callable[[set[str]], bool]
    targets: tuple[type, ...]
    load: Callable


def _load_eagle(version: int):
    def load(ckpt, raw, target: Model, dtype, where, path):
        # A small head: replicated on every shard (its embedding and EAGLE-1 head are the target's).
        cfg, params = load_eagle(ckpt, raw, version, target.config, target.params, dtype, where, mesh=target.mesh)
        return dataclasses.replace(eagle_draft(cfg, params, path), mesh=target.mesh)
    return load


def _load_assistant(ckpt, raw, target: Model, dtype, where, path):
    cfg = assistant_io.assistant_config_from_hf(raw, target.config, where)
    params = assistant_io.load_assistant_params(ckpt, cfg, target.params, dtype, mesh=target.mesh)
    return dataclasses.replace(assistant_draft(cfg, params, path), mesh=target.mesh)


def _load_gemma4_assistant(ckpt, raw, target: Model, dtype, where, path):
    cfg = assistant_io.gemma4_assistant_config_from_hf(raw, target.config, where)
    params = assistant_io.load_gemma4_assistant_params(ckpt, raw, cfg, target.params, dtype, mesh=target.mesh)
    return dataclasses.replace(assistant_draft(cfg, params, path), mesh=target.mesh)


def _is_gemma4_assistant(names: set[str]) -> bool:
    """pre/post projections around query-only Gemma 4 layers (``layer_scalar``, no k/v projections)."""
    return "pre_projection.weight" in names and any(n.endswith(".layer_scalar") for n in names) and not any(
        n.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")) for n in names)


def _load_mtp(ckpt, raw, target: Model, dtype, where, path):
    params, cfg = load_mtp_params(ckpt, target.config, dtype, target_params=target.params, share_target_weights=True,
                                  mesh=target.mesh, fp8_block=fp8_block_size(raw, where))
    return dataclasses.replace(mtp_draft(cfg, params, path), mesh=target.mesh)


def _load_v4_mtp(ckpt, raw, target: Model, dtype, where, path):
    params, cfg = load_v4_mtp_params(ckpt, target.config, target.params, dtype, mesh=target.mesh,
                                     fp8_block=fp8_block_size(raw, where))
    return dataclasses.replace(v4_mtp_draft(cfg, params, path), mesh=target.mesh)


def _load_v4_dspark(ckpt, raw, target: Model, dtype, where, path):
    params, cfg = load_v4_dspark_params(ckpt, raw, target.config, target.params, dtype, where, mesh=target.mesh,
                                        fp8_block=fp8_block_size(raw, where))
    return dataclasses.replace(v4_dspark_draft(cfg, params, path), mesh=target.mesh)


def _load_qwen_mtp(ckpt, raw, target: Model, dtype, where, path):
    params, cfg = load_qwen_mtp_params(ckpt, target.config, target.params, dtype, mesh=target.mesh)
    return dataclasses.replace(qwen_mtp_draft(cfg, params, path), mesh=target.mesh)


def _same_checkpoint(path: str, target: Model) -> bool:
    return target.path is not None and os.path.exists(target.path) and os.path.samefile(path, target.path)


def _load_lm(ckpt, raw, target: Model, dtype, where, path, kind: str = "standalone", check=None):
    """A supported LM's config and params, split over the target's mesh like the target when its
    heads divide (replicated otherwise); ``check(config)`` runs before any weight is read."""
    if _same_checkpoint(path, target):
        # A model drafting for itself costs a full target forward per draft token; what the user
        # meant is the MTP layer that DeepSeek checkpoints store after the main layers.
        hint = (f" It holds no MTP (NextN) layer: no model.layers.{target.config.num_layers}.* tensors "
                f"(HF save_pretrained drops them; the released DeepSeek checkpoints keep them)."
                if isinstance(target.config, DeepseekConfig) else "")
        raise ConfigError(f"{path} is the target's own checkpoint, and a model cannot be its own draft.{hint}")
    family = target_family(raw, where)
    cfg = family.parse(raw, where)
    if cfg.vocab_size != target.config.vocab_size:
        raise ConfigError(
            f"{where}: {kind} draft vocab_size {cfg.vocab_size} does not match the target's "
            f"{target.config.vocab_size}"
        )
    if check is not None:
        check(cfg)
    split = True
    try:  # split like the target when its heads divide; a draft that does not divide is replicated
        cfg = family.for_mesh(cfg, axis_size(target.mesh, MODEL), where)
    except ConfigError:
        split = False
    table = family.table(cfg, ckpt)
    warn_unread(family.name, table, ckpt, path, lambda name: family.leaves_unread(name, cfg))
    params = load_params(table, ckpt, dtype, sharding_of=shardings_for(table, target.mesh, split=split),
                         fp8_block=fp8_block_size(raw, where))
    return cfg, params


def _load_standalone(ckpt, raw, target: Model, dtype, where, path):
    cfg, params = _load_lm(ckpt, raw, target, dtype, where, path)
    return DraftModel(config=StandaloneDraft(model=cfg), params=params, path=path, mesh=target.mesh)


def is_pard(raw: dict) -> bool:
    """A PARD checkpoint: an LM whose config carries the mask token ``pard_token`` (what vLLM and
    TensorRT-LLM read), or at least PARD's ``spd_type: "pard"`` (its training script writes both)."""
    return "pard_token" in raw or raw.get("spd_type") == "pard"


def pard_mask_token(raw: dict, target: Model, where: str) -> int:
    """The checkpoint's ``pard_token``: an integer id inside the target's vocabulary."""
    if "pard_token" not in raw:
        raise ConfigError(f"{where}: spd_type 'pard' but no pard_token: a PARD draft needs the id of its mask token "
                          f"(the token filling the block after the bonus)")
    token = raw["pard_token"]
    if isinstance(token, bool) or not isinstance(token, int):
        raise ConfigError(f"{where}: PARD pard_token must be an integer token id, got {token!r}")
    if not 0 <= token < target.config.vocab_size:
        raise ConfigError(f"{where}: PARD pard_token {token} is outside the target's vocabulary of "
                          f"{target.config.vocab_size} tokens")
    return token


def _load_pard(ckpt, raw, target: Model, dtype, where, path):
    mask = pard_mask_token(raw, target, where)

    def draft_config(cfg):
        try:
            return PardDraft(model=cfg, mask_token_id=mask, logits_width=padded_vocab_size(target.config))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None

    cfg, params = _load_lm(ckpt, raw, target, dtype, where, path, kind="PARD", check=draft_config)
    return DraftModel(config=draft_config(cfg), params=params, path=path, mesh=target.mesh)


def _load_dflash(ckpt, raw, target: Model, dtype, where, path):
    return dataclasses.replace(dflash_io.load_dflash(ckpt, raw, target, dtype, where), mesh=target.mesh)


def _load_speculators(ckpt, raw, target: Model, dtype, where, path):
    return dataclasses.replace(speculators_io.load_speculators(ckpt, raw, target, dtype, where), mesh=target.mesh)


def _load_peagle(ckpt, raw, target: Model, dtype, where, path):
    return dataclasses.replace(peagle_io.load_peagle(ckpt, raw, target, dtype, where), mesh=target.mesh)


def _is_lm(names: set[str]) -> bool:
    return (any(n.startswith(("model.layers.", "layers.")) for n in names) and "fc.weight" not in names
            and not find_mtp_layers(names) and not find_v4_mtp_layers(names) and not is_v4_dspark(names))


DRAFT_FORMATS = (
    DraftFormat("EAGLE-3 head", EAGLE_ARCHITECTURES[:2] + ("LlamaForCausalLM",),
                lambda names: detect_eagle_version(names) == 3, (LlamaConfig, HybridConfig), _load_eagle(3)),
    DraftFormat("EAGLE-1/2 head", EAGLE_ARCHITECTURES[2:] + ("LlamaForCausalLM",),
                lambda names: detect_eagle_version(names) == 1, (LlamaConfig,), _load_eagle(1)),
    DraftFormat("Gemma 4 assistant (frozen-KV MTP)", (assistant_io.GEMMA4_ARCHITECTURE,), _is_gemma4_assistant,
                (Gemma4Config,), _load_gemma4_assistant),
    DraftFormat("frozen-KV assistant", (assistant_io.ARCHITECTURE,),
                lambda names: "pre_projection.weight" in names, (LlamaConfig,), _load_assistant),
    DraftFormat("DeepSeek MTP (NextN) layer", ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV3ForCausalLMNextN"),
                lambda names: bool(find_mtp_layers(names)), (DeepseekConfig,), _load_mtp),
    DraftFormat("DeepSeek-V4 DSpark draft (mtp.* stages)", V4_ARCHITECTURES, is_v4_dspark, (DeepseekV4Config,),
                _load_v4_dspark),
    DraftFormat("DeepSeek-V4 MTP layer", V4_ARCHITECTURES, lambda names: bool(find_v4_mtp_layers(names)),
                (DeepseekV4Config,), _load_v4_mtp),
    DraftFormat("Qwen3-Next / Qwen3.5 MTP layer", tuple(HYBRID_ARCHITECTURES),
                lambda names: "mtp.fc.weight" in names, (HybridConfig,), _load_qwen_mtp),
    DraftFormat("DFlash 2 block draft", ("DFlash2DraftModel",), dflash_io.is_dflash2,
                (LlamaConfig, DeepseekConfig, Gemma4Config, HybridConfig), _load_dflash),
    DraftFormat("DFlash block draft", ("DFlashDraftModel",),
                lambda names: dflash_io.is_dflash(names) and not dflash_io.is_dflash2(names),
                (LlamaConfig, DeepseekConfig, Gemma4Config, HybridConfig), _load_dflash),
    DraftFormat("standalone LM", LM_ARCHITECTURES, lambda names: _is_lm(names) and "mtp.fc.weight" not in names,
                (LlamaConfig, DeepseekConfig, Gemma4Config, HybridConfig, DeepseekV4Config), _load_standalone),
)


# Told apart by its config (``pard_token``): a PARD draft is an LM of a supported family.
PARD_FORMAT = DraftFormat("PARD parallel draft LM", LM_ARCHITECTURES, lambda names: _is_lm(names),
                          (LlamaConfig, DeepseekConfig, Gemma4Config, HybridConfig), _load_pard)

# Told apart by its config (``speculators_model_type``), not by architectures: its DFlash shares
# z-lab's architecture name and tensor names but nests the layers' config.
SPECULATORS_FORMAT = DraftFormat("speculators block draft (DFlash / DSpark)", speculators_io.ARCHITECTURES,
                                 dflash_io.is_dflash, (LlamaConfig, DeepseekConfig, Gemma4Config, HybridConfig),
                                 _load_speculators)


# A P-EAGLE head: the speculators EAGLE-3 layout plus mask_hidden, told apart by its config; the
# plain EAGLE-3 head in that layout is read by the same code (a token-by-token "eagle3" draft).
PEAGLE_FORMAT = DraftFormat("speculators P-EAGLE head", peagle_io.ARCHITECTURES, peagle_io.matches,
                            (LlamaConfig, HybridConfig), _load_peagle)
SPECULATORS_EAGLE3_FORMAT = DraftFormat("speculators EAGLE-3 head", peagle_io.EAGLE3_ARCHITECTURES,
                                        peagle_io.matches_eagle3, (LlamaConfig, HybridConfig), _load_peagle)


def detect_draft_format(raw: dict, names: set[str], where: str) -> DraftFormat:
    """The format of a draft checkpoint (``architectures`` first, tensor names second; a
    ``speculators`` block draft, P-EAGLE or EAGLE-3 head by its config)."""
    if peagle_io.is_peagle(raw):
        if not PEAGLE_FORMAT.matches(names):
            raise CheckpointError(f"{where}: a speculators peagle config, but the tensors are not a P-EAGLE head's "
                                  f"(mask_hidden, fc, layers.0.hidden_norm)")
        return PEAGLE_FORMAT
    if peagle_io.is_eagle3(raw):
        if not SPECULATORS_EAGLE3_FORMAT.matches(names):
            raise CheckpointError(f"{where}: a speculators eagle3 config, but the tensors are not an EAGLE-3 head's "
                                  f"(fc, layers.0.hidden_norm)")
        return SPECULATORS_EAGLE3_FORMAT
    if speculators_io.is_speculators(raw) and raw.get("speculators_model_type") in speculators_io.MODEL_TYPES:
        if not SPECULATORS_FORMAT.matches(names):
            raise CheckpointError(f"{where}: a speculators {raw['speculators_model_type']} config, but the tensors "
                                  f"are not a DFlash backbone's (fc, hidden_norm, layers.*)")
        return SPECULATORS_FORMAT
    archs = list(raw.get("architectures") or [])
    if is_pard(raw):
        if archs and not set(archs) & set(PARD_FORMAT.architectures):
            raise ConfigError(f"{where}: a PARD config (pard_token / spd_type), but architectures {archs} is not an "
                              f"LM jaxspec runs; supported: {sorted(PARD_FORMAT.architectures)}")
        if not PARD_FORMAT.matches(names):
            raise CheckpointError(f"{where}: a PARD config (pard_token / spd_type), but the tensors are not an LM's "
                                  f"(model.layers.*)")
        return PARD_FORMAT
    claimed = [f for f in DRAFT_FORMATS if not archs or set(archs) & set(f.architectures)]
    if not claimed and speculators_io.is_speculators(raw):
        speculators_io.model_type(raw, where)  # names the library's kind jaxspec does not load
    if not claimed:
        supported = sorted({a for f in DRAFT_FORMATS for a in f.architectures})
        raise ConfigError(f"{where}: unsupported draft architecture {archs}; supported: {supported}")
    for fmt in claimed:
        if fmt.matches(names):
            return fmt
    kinds = " or ".join(f.name for f in claimed)
    found = [f.name for f in DRAFT_FORMATS if f.matches(names)]
    raise CheckpointError(
        f"{where}: architectures {archs or '(none)'} claim: {kinds}; but the tensors are not of that format"
        + (f" (they are those of: {found[0]})" if found else "")
    )


def load_draft(path: str | os.PathLike, target: Model, dtype=None) -> DraftModel:
    """Loads a draft for ``target``; the kind is detected from the checkpoint.

    EAGLE-1/2 (SafeAILab layout), EAGLE-3 (SafeAILab ``midlayer.*`` or SpecForge / vLLM
    ``layers.0.*`` names, optional ``embed_tokens`` / ``d2t``), DFlash and DFlash 2 block drafts
    (z-lab layout; ``block_size`` on the result), DFlash, DSpark, P-EAGLE and EAGLE-3 drafts in the
    ``speculators`` layout (``speculators_model_type``), a PARD parallel draft (a Llama-family LM
    whose config carries its mask token ``pard_token``), a standalone LM of a supported family
    sharing the target's vocabulary, a frozen-KV assistant (the project's format for
    Llama-family targets, HF ``Gemma4AssistantForCausalLM`` for Gemma 4 targets), or -- for a DeepSeek-V3,
    DeepSeek-V4, Qwen3-Next or Qwen3.5 target -- the MTP layer(s) stored in its checkpoint, or the DSpark
    stages DeepSeek ships in DeepSeek-V4-Flash-DSpark (pass the target's directory).

    Raises:
      ValueError: an unknown or mismatched kind, or a draft that does not fit the target
        (vocabulary, hidden size, layers), named; processes of a ``jax.distributed`` job loading
        different drafts; FileNotFoundError: missing files.
    """
    path = os.fspath(path)
    np_dtype = resolve_dtype(dtype) if dtype is not None else target.dtype
    raw = read_config(path)
    where = os.path.join(path, "config.json")
    ckpt = CheckpointTensors(path)
    check_same_checkpoint(path, raw, ckpt, np_dtype, target.mesh)
    try:
        fmt = detect_draft_format(raw, set(ckpt.keys()), where)
        if not isinstance(target.config, fmt.targets):
            raise ConfigError(
                f"{where}: a {fmt.name} cannot serve a {type(target.config).__name__} target "
                f"(it serves {', '.join(t.__name__ for t in fmt.targets)})"
            )
        draft = fmt.load(ckpt, raw, target, np_dtype, where, path)
    finally:
        ckpt.close()
    draft.config.check_fits(target.config)
    return draft
