"""EAGLE-1/2 and EAGLE-3 draft heads: configs and forward (checkpoint names: ``jaxspec.model.checkpoints.eagle``).

Both heads run one decoder layer at the feature level. Draft position ``p`` consumes the
pair (feature at ``p``, token at ``p + 1``) and predicts the token at ``p + 2``; its KV sits
at position ``p`` of the draft pool.

* EAGLE-1/2: ``x = fc([embed(token), feature])``; one Llama layer without its input norm;
  the output is the next feature and ``logits = target lm_head(output)``.
* EAGLE-3: the target feature is the concatenation of the residual streams entering
  layers (2, L//2, L-3); ``fc`` maps it to H (only for target features: the head's own
  H-wide output is fed back as is); the layer attends over
  ``[input_layernorm(embed(token)), hidden_norm(h)]`` (2H wide); ``logits = lm_head(norm(h'))``
  over ``draft_vocab_size`` tokens, mapped back to target ids by ``d2t``.

Params (linear weights ``[in, out]``):
    embed [V, H]; fc [F, H] (+ fc_bias [H]); layer/{input_norm, hidden_norm (EAGLE-3),
    wqkv [A, (Hq + 2 Hkv) * D] (q/k/v joined: ``jaxspec.model.fused``), wo [Hq*D, H], mlp_norm,
    w_gate_up [H, 2I] (joined), w_down};
    norm [H] + lm_head [H, Vd] + hot_ids i32[Vd] (EAGLE-3); lm_head [H, V] (EAGLE-1, the target's)
with A = H (EAGLE-1) or 2H (EAGLE-3), F = 2H (EAGLE-1) or num_aux * H_target (EAGLE-3).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import RopeConfig
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel
from jaxspec.model.layers import (embed_lookup, head_logits, joins_heads, layer_tail, mask_padded_vocab,
                                  pad_attention_rows, pad_tokens, padded_tokens, project_and_attend, rms_norm,
                                  rope_inv_freq)
from jaxspec.model.targets.llama_config import LlamaConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """Static shape of an EAGLE head.

    version: 1 (EAGLE-1/2) or 3.
    target_hidden_size: width of one target feature (H_target).
    aux_layers: target layers whose input residual streams EAGLE-3 taps (empty for EAGLE-1).
    draft_vocab_size: Vd (== vocab_size when there is no d2t map).
    """

    version: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...] = ()
    fc_bias: bool = False
    attention_bias: bool = False  # (the shared Llama layer body reads these two)
    qk_norm: bool = False
    vocab_parallel: int = 1  # shards the (target's) embedding table is split over by vocabulary

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def attn_in(self) -> int:
        return 2 * self.hidden_size if self.version == 3 else self.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes at draft-extend."""
        if self.version == 3:
            return len(self.aux_layers) * self.target_hidden_size
        return self.target_hidden_size


def eagle_attention_input(
    params: dict,
    cfg: EagleConfig,
    tokens: jax.Array,  # i32[B, T] the token after each position
    feature: jax.Array,  # [B, T, F] target features, or [B, T, H] the head's own outputs
    *,
    from_target: bool,
) -> tuple[jax.Array, jax.Array]:  # attention input [B, T, A], residual [B, T, H]
    """What enters the head's Llama layer (shared by serving and TTT training)."""
    lp = params["layer"]
    emb = embed_lookup(params["embed"], tokens, cfg.vocab_parallel).astype(feature.dtype)
    if cfg.version == 3:
        h = feature @ params["fc"] if from_target else feature
        a = jnp.concatenate(
            [rms_norm(emb, lp["input_norm"], cfg.rms_norm_eps), rms_norm(h, lp["hidden_norm"], cfg.rms_norm_eps)],
            axis=-1,
        )
        return a, h
    h = jnp.concatenate([emb, feature], axis=-1) @ params["fc"]
    if cfg.fc_bias:
        h = h + params["fc_bias"]
    return h, h


def eagle_forward(
    params: dict,
    cfg: EagleConfig,
    tokens: jax.Array,  # i32[B, T]
    feature: jax.Array,  # [B, T, F] or [B, T, H]
    positions: jax.Array,  # i32[B, T]
    pool: KVPool,
    attn: AttentionInputs,
    *,
    from_target: bool,
    implementation=None,
) -> tuple[jax.Array, KVPool]:  # hidden [B, T, H] (pre-norm), new pool
    """One head step over T rows per request (extend: ``from_target``; drafting: not)."""
    lp = params["layer"]
    # As the target's forward: Tp >= T rows a request (padding after T: writes no K/V, sees the
    # prefix alone, dropped at the end) so that no product's rows need padding on a GPU
    # (``padded_tokens``; Tp = T on a CPU).
    B, T = tokens.shape
    Tp = padded_tokens(B, T) if joins_heads(lp, cfg) else T
    if Tp != T:
        tokens, feature, positions = (pad_tokens(x, Tp) for x in (tokens, feature, positions))
        attn = pad_attention_rows(attn, Tp)
    a, residual = eagle_attention_input(params, cfg, tokens, feature, from_target=from_target)
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    o, pool = project_and_attend(lp, cfg, a, pool, jnp.int32(0), attn, positions, inv_freq,
                                 implementation=implementation, tokens=T)
    return layer_tail(lp, cfg, residual, o)[:, :T], pool


def eagle_logits(params: dict, cfg: EagleConfig, hidden: jax.Array) -> jax.Array:  # f32[..., Vd]
    """Draft-vocabulary logits (EAGLE-3: ``lm_head(norm(h))``; EAGLE-1: the target's head)."""
    if cfg.version == 3:
        hidden = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    logits = head_logits(hidden, params["lm_head"])
    return mask_padded_vocab(logits, cfg.vocab_size)  # EAGLE-1: the target's head, padded on a mesh


@dataclasses.dataclass(frozen=True)
class EagleDraft(Draft):
    """EAGLE-1/2 head: ``fc([embed(token), target final hidden])`` then one Llama layer;
    logits through the target's head."""

    model: EagleConfig
    kind: ClassVar[str] = "eagle1"

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, pool = eagle_forward(params, self.model, tokens, hidden, positions, pool, attn,
                                from_target=from_target, implementation=implementation)
        return h, h, pool

    def logits(self, params, logit_in):
        return eagle_logits(params, self.model, logit_in)

    @property
    def target_hidden_size(self) -> int:
        return self.model.target_hidden_size


@dataclasses.dataclass(frozen=True)
class Eagle3Draft(EagleDraft):
    """EAGLE-3 head: the target's aux residual streams through ``fc``, one Llama layer over
    ``[norm(embed), norm(h)]``, its own ``lm_head`` over a draft vocabulary mapped to target
    ids by ``d2t`` (``params["hot_ids"]``)."""

    kind: ClassVar[str] = "eagle3"

    @property
    def feature(self) -> str:
        return "aux"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.model.aux_layers

    def to_target_ids(self, params, index):
        return params["hot_ids"][index] if "hot_ids" in params else index.astype(jnp.int32)

    def target_vocab_logits(self, params, logits):
        if "hot_ids" not in params:
            return logits
        full = jnp.full(logits.shape[:-1] + (self.vocab_size,), -jnp.inf, logits.dtype)
        return full.at[..., params["hot_ids"]].set(logits)


def eagle_draft_for(cfg: EagleConfig) -> EagleDraft:
    """The draft kind of an EAGLE head config."""
    return Eagle3Draft(model=cfg) if cfg.version == 3 else EagleDraft(model=cfg)


def eagle3_config_for(target: LlamaConfig, *, draft_vocab_size: int | None = None, intermediate_size=None,
                      num_heads=None, num_kv_heads=None) -> EagleConfig:
    """An EAGLE-3 head shaped for ``target`` (same width and head layout by default)."""
    return EagleConfig(
        version=3,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=num_heads or target.num_heads,
        num_kv_heads=num_kv_heads or target.num_kv_heads,
        head_dim=target.hidden_size // (num_heads or target.num_heads),
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size or target.vocab_size,
        target_hidden_size=target.hidden_size,
        aux_layers=target.eagle3_aux_layers(),
    )


def eagle_draft(cfg: EagleConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps EAGLE head params (from ``init_eagle_params``, a checkpoint or training) as a draft."""
    return DraftModel(config=eagle_draft_for(cfg), params=params, path=path)
