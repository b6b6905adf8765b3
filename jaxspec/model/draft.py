"""Draft models behind one interface: ``load_draft`` picks the kind from the checkpoint, and
``draft_forward`` / ``draft_topk`` run any kind inside the speculative step.

Kinds:
  eagle1      EAGLE-1/2 feature head (target final hidden state in).
  eagle3      EAGLE-3 head (target aux residual streams in).
  standalone  any supported LM (Llama family or DeepSeek MLA) with the target's vocabulary
              (tokens in; its own KV pool of its own kind).
  frozen_kv   frozen-KV MTP assistant: reads the target's KV, has none of its own
              (jaxspec.model.assistant); its seed step is iteration 0 of the draft loop.
  mtp         DeepSeek-V3 NextN/MTP layer (target final hidden in; one MLA block with its
              own MLA KV pool; jaxspec.model.mtp).

Position convention: a feature-level head's row ``p`` consumes the token at ``p + 1`` and
writes KV at ``p``; a standalone LM's row consumes the token at ``p`` and writes KV at ``p``.
``pos_offset`` (0 or 1) is the difference, so both share one draft loop.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.assistant import (
    ARCHITECTURE as ASSISTANT_ARCHITECTURE,
    AssistantConfig,
    assistant_config_from_hf,
    assistant_logits,
    load_assistant_params,
)
from jaxspec.model.checkpoint import CheckpointError, SafetensorsCheckpoint, read_config, resolve_dtype
from jaxspec.model.config import ConfigError, LlamaConfig, llama_config_from_hf
from jaxspec.model.eagle import (
    EagleConfig,
    detect_eagle_version,
    eagle_config_from_hf,
    eagle_forward,
    eagle_logits,
    load_eagle_params,
)
from jaxspec.model.llama import lm_logits
from jaxspec.model.loader import Model, load_llama_params
from jaxspec.model.target import create_target_pool, target_forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Static description of a draft, enough to shape every compiled program.

    kind: "eagle1" | "eagle3" | "standalone" | "frozen_kv" | "mtp".
    model: the head's or LM's own config.
    feature: target feature consumed at draft-extend: "final" (normed final hidden),
      "aux" (EAGLE-3 taps) or None.
    aux_layers: target layers tapped for "aux".
    pos_offset: 0 for feature heads, 1 for token-level LMs (see module docstring).
    hidden_size: width of the recurrent hidden carried between draft steps (1 if unused).
    """

    kind: str
    model: Any
    feature: str | None
    aux_layers: tuple[int, ...] = ()
    pos_offset: int = 0
    hidden_size: int = 1

    @property
    def frozen_kv(self) -> bool:
        return self.kind == "frozen_kv"

    @property
    def num_layers(self) -> int:
        """Layers of the draft's own KV pool (0 for a frozen-KV assistant)."""
        return 0 if self.frozen_kv else self.model.num_layers



@dataclasses.dataclass(eq=False)
class DraftModel:
    """A loaded draft: static ``config`` plus ``params`` (which may share target arrays)."""

    config: DraftConfig
    params: dict
    path: str | None = None

    @property
    def kind(self) -> str:
        return self.config.kind

    def __repr__(self) -> str:
        return f"DraftModel(kind={self.kind!r}, path={self.path!r})"


def draft_forward(
    dcfg: DraftConfig,
    params: dict,
    tokens: jax.Array,  # i32[B, T]
    feature: jax.Array | None,  # [B, T, F] target features (extend) or [B, T, Hd] own hidden
    positions: jax.Array,  # i32[B, T]
    pool: KVPool,
    attn: AttentionInputs,
    *,
    from_target: bool,
    implementation: str | None = None,
) -> tuple[jax.Array, KVPool]:  # hidden [B, T, Hd], new pool
    if dcfg.kind in ("eagle1", "eagle3"):
        return eagle_forward(
            params, dcfg.model, tokens, feature, positions, pool, attn,
            from_target=from_target, implementation=implementation,
        )
    if dcfg.kind == "standalone":
        out = target_forward(dcfg.model, params, tokens, positions, pool, attn, implementation=implementation)
        return out.hidden, out.pool
    if dcfg.kind == "mtp":
        from jaxspec.model.mtp import mtp_forward

        return mtp_forward(params, dcfg.model, tokens, feature, positions, pool, attn,
                           from_target=from_target, implementation=implementation)
    raise ValueError(f"unknown draft kind {dcfg.kind!r}")


def draft_logits(dcfg: DraftConfig, params: dict, hidden: jax.Array) -> jax.Array:  # f32[..., Vd]
    if dcfg.kind in ("eagle1", "eagle3"):
        return eagle_logits(params, dcfg.model, hidden)
    if dcfg.kind == "frozen_kv":
        return assistant_logits(params, hidden)
    if dcfg.kind == "mtp":
        from jaxspec.model.mtp import mtp_logits

        return mtp_logits(params, dcfg.model, hidden)
    return lm_logits(params, hidden)


def create_draft_pool(dcfg: DraftConfig | None, *, num_pages: int, page_size: int, dtype):
    """The draft's own KV pool: MHA for EAGLE heads and standalone LMs, a one-layer MLA pool
    for MTP, and a zero-layer pool (every op a no-op) for frozen-KV assistants or no draft."""
    if dcfg is not None and dcfg.kind == "mtp":
        from jaxspec.model.mtp import create_mtp_pool

        return create_mtp_pool(dcfg.model, num_pages=num_pages, page_size=page_size, dtype=dtype)
    if dcfg is None or dcfg.num_layers == 0:
        return KVPool.create(num_layers=0, num_pages=1, page_size=page_size, num_kv_heads=1, head_dim=1, dtype=dtype)
    if dcfg.kind == "standalone":
        return create_target_pool(dcfg.model, num_pages=num_pages, page_size=page_size, dtype=dtype)
    return KVPool.create(num_layers=dcfg.num_layers, num_pages=num_pages, page_size=page_size,
                         num_kv_heads=dcfg.model.num_kv_heads, head_dim=dcfg.model.head_dim, dtype=dtype)


def draft_ids(params: dict, index: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target ids (EAGLE-3 d2t); identity otherwise."""
    return params["hot_ids"][index] if "hot_ids" in params else index.astype(jnp.int32)


def draft_topk(
    dcfg: DraftConfig, params: dict, hidden: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:  # f32[..., k], i32[..., k] (target ids)
    """Top-k of the draft's softmax. k = 1 uses max/argmax (no top_k primitive)."""
    probs = jax.nn.softmax(draft_logits(dcfg, params, hidden), axis=-1)
    if k == 1:
        index = jnp.argmax(probs, axis=-1)[..., None]
        p = jnp.max(probs, axis=-1, keepdims=True)
    else:
        p, index = jax.lax.top_k(probs, k)
    return p, draft_ids(params, index)


# ---------------------------------------------------------------------------------- loading


def load_draft(path: str | os.PathLike, target: Model, dtype=None) -> DraftModel:
    """Loads a draft for ``target``; the kind is detected from the checkpoint.

    EAGLE-1/2 (SafeAILab layout), EAGLE-3 (SafeAILab ``midlayer.*`` or SpecForge / vLLM
    ``layers.0.*`` names, optional ``embed_tokens`` / ``d2t``), a standalone Llama-family
    LM sharing the target's vocabulary, a frozen-KV assistant, or -- for a DeepSeek-V3
    target -- the NextN/MTP layer stored in its checkpoint (pass the target's directory).

    Raises:
      ValueError: the draft does not fit the target (vocabulary, hidden size, layers) or is
        of an unknown kind; FileNotFoundError: missing files.
    """
    path = os.fspath(path)
    np_dtype = resolve_dtype(dtype) if dtype is not None else target.dtype
    raw = read_config(path)
    where = os.path.join(path, "config.json")
    ckpt = SafetensorsCheckpoint(path)
    try:
        if not isinstance(target.config, LlamaConfig):
            return _load_mtp(ckpt, target, np_dtype, path, where)
        if ASSISTANT_ARCHITECTURE in (raw.get("architectures") or []):
            acfg = assistant_config_from_hf(raw, target.config, where)
            return assistant_draft(acfg, load_assistant_params(ckpt, acfg, target.params, np_dtype), path)
        version = detect_eagle_version(ckpt)
        if version is not None:
            ecfg: EagleConfig = eagle_config_from_hf(raw, version, target.config, where)
            params, ecfg = load_eagle_params(ckpt, ecfg, target.params, np_dtype)
            return eagle_draft(ecfg, params, path)
        if any(k.startswith("model.layers.") for k in ckpt.keys()):
            lcfg = llama_config_from_hf(raw, where)
            if lcfg.vocab_size != target.config.vocab_size:
                raise ConfigError(
                    f"{where}: standalone draft vocab_size {lcfg.vocab_size} does not match the "
                    f"target's {target.config.vocab_size}"
                )
            params = load_llama_params(ckpt, lcfg, np_dtype, progress=False)
            return DraftModel(config=standalone_config(lcfg), params=params, path=path)
        raise CheckpointError(f"{path}: not an EAGLE, EAGLE-3 or Llama-family checkpoint")
    finally:
        ckpt.close()


def eagle_draft(cfg: EagleConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps EAGLE head params (e.g. from ``init_eagle_params`` or training) as a draft."""
    config = DraftConfig(
        kind=f"eagle{cfg.version}", model=cfg, feature="aux" if cfg.version == 3 else "final",
        aux_layers=cfg.aux_layers, pos_offset=0, hidden_size=cfg.hidden_size,
    )
    return DraftModel(config=config, params=params, path=path)


def _load_mtp(ckpt: SafetensorsCheckpoint, target: Model, dtype, path: str, where: str) -> DraftModel:
    from jaxspec.model.deepseek import DeepseekConfig
    from jaxspec.model.mtp import find_mtp_layers, load_mtp_params

    if not isinstance(target.config, DeepseekConfig):
        raise ConfigError(f"{where}: no draft kind supports a {type(target.config).__name__} target")
    if find_mtp_layers(ckpt):
        params, mcfg = load_mtp_params(ckpt, target.config, dtype, target_params=target.params,
                                       share_target_weights=True)
        return mtp_draft(mcfg, params, path)
    raise CheckpointError(
        f"{path}: a DeepSeek target takes an MTP (NextN) draft, but this checkpoint has no "
        f"model.layers.N.eh_proj.weight (pass the target's own directory if it ships the MTP layer, "
        f"or load a smaller DeepSeek-family model with load_model and wrap it with standalone_draft)"
    )


def mtp_draft(cfg, params: dict, path: str | None = None) -> DraftModel:
    """Wraps MTP head params (``jaxspec.model.mtp``) as a draft."""
    config = DraftConfig(kind="mtp", model=cfg, feature="final", pos_offset=0, hidden_size=cfg.hidden_size)
    return DraftModel(config=config, params=params, path=path)


def assistant_draft(cfg: AssistantConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps frozen-KV assistant params as a draft."""
    config = DraftConfig(kind="frozen_kv", model=cfg, feature="final", pos_offset=0,
                         hidden_size=cfg.backbone_hidden_size)
    return DraftModel(config=config, params=params, path=path)


def standalone_config(cfg) -> DraftConfig:
    return DraftConfig(kind="standalone", model=cfg, feature=None, pos_offset=1, hidden_size=1)


def standalone_draft(model: Model) -> DraftModel:
    """Uses an already-loaded LM (e.g. a smaller model of the same family, or the target
    itself in tests) as a standalone draft."""
    return DraftModel(config=standalone_config(model.config), params=model.params, path=model.path)


def check_draft_fits(target: Model, draft: DraftModel) -> None:
    """Raises a clear ValueError when a draft cannot serve ``target``."""
    cfg = draft.config
    tcfg = target.config
    if cfg.model.vocab_size != tcfg.vocab_size:
        raise ValueError(
            f"draft vocabulary ({cfg.model.vocab_size}) does not match the target's ({tcfg.vocab_size})"
        )
    if cfg.kind in ("eagle1", "eagle3", "mtp") and cfg.model.target_hidden_size != tcfg.hidden_size:
        raise ValueError(
            f"draft was built for target hidden size {cfg.model.target_hidden_size}, "
            f"the target has {tcfg.hidden_size}"
        )
    if cfg.frozen_kv:
        from jaxspec.model.assistant import check_assistant_fits

        check_assistant_fits(cfg.model, tcfg)
    if cfg.aux_layers and max(cfg.aux_layers) >= tcfg.num_layers:
        raise ValueError(f"draft taps target layers {cfg.aux_layers}; the target has {tcfg.num_layers}")
