"""Frozen-KV MTP assistant (seed 003): a draft with no KV of its own.

Modeled on the Gemma-4 assistant that SGLang serves as FROZEN_KV_MTP, for Llama-family
targets. Each assistant layer cross-attends to the *target's* K/V of one mapped target
layer (``kv_layers``), reading only the committed prefix and writing nothing. Every draft
step uses the same RoPE position, ``seq_len - 1`` (the last committed target position).

One step over T rows per request:
    x = pre_projection([embed(token) * embed_scale, h])          h: backbone hidden [Hb]
    for each layer l: x += o(attn(q(norm(x)), target K/V of layer kv_layers[l])); x += mlp(norm(x))
    y = norm(x);  logits = lm_head(y);  next h = post_projection(y)

The seed step (bonus token + the target's last hidden state) is iteration 0 of the draft
loop (see ``jaxspec.draft.step.draft_propose``), so a speculative step stays one executable.

Checkpoint layout (``jaxspec.model.io.assistant``; config ``architectures: ["JaxspecFrozenKVAssistant"]``):
    pre_projection.weight [H, 2*Hb]; post_projection.weight [Hb, H];
    model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight [H];
    model.layers.{i}.self_attn.q_proj.weight [Hq*D, H], o_proj.weight [H, Hq*D];
    model.layers.{i}.mlp.{gate,up,down}_proj.weight; model.norm.weight [H];
    lm_head.weight [V, H] (absent: tied to the target embedding, needs H == Hb).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.pool import KVPool
from jaxspec.model.config import ConfigError, RopeConfig
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel, DraftSeed, zero_pool
from jaxspec.model.layers import layer_tail, lm_head, project_q, rms_norm, rope_inv_freq
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.pallas.paged_attention import paged_attention


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantConfig:
    """kv_layers: target layer whose K/V assistant layer i reads. head_dim, num_kv_heads
    and rope are the target's (the assistant's queries meet the target's keys)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    rms_norm_eps: float
    backbone_hidden_size: int
    vocab_size: int
    kv_layers: tuple[int, ...]
    rope: RopeConfig
    embed_scale: float = 1.0
    attention_bias: bool = False  # (the shared Llama layer body reads these two)
    qk_norm: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.kv_layers)


def assistant_forward(
    params: dict,
    cfg: AssistantConfig,
    tokens: jax.Array,  # i32[B, T]
    hidden: jax.Array,  # [B, T, Hb] backbone hidden (target's at the seed step, own after)
    seq_lens: jax.Array,  # i32[B] committed target positions (all readable)
    target_pool: KVPool,
    page_table: jax.Array,  # i32[B, W]
    *,
    implementation=None,
) -> tuple[jax.Array, jax.Array]:  # next hidden [B, T, Hb], normed output [B, T, H]
    B, T = tokens.shape
    emb = params["embed"][tokens].astype(hidden.dtype) * cfg.embed_scale
    x = jnp.concatenate([emb, hidden], axis=-1) @ params["pre_proj"]  # [B, T, H]
    positions = jnp.broadcast_to(jnp.maximum(seq_lens - 1, 0)[:, None], (B, T))
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    nothing = jnp.zeros((B, T, 1), bool)  # no block: only the committed prefix is visible
    kv_layers = jnp.asarray(cfg.kv_layers, jnp.int32)

    def layer(x, lp_and_layer):
        lp, target_layer = lp_and_layer
        q = project_q(lp, cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), positions, inv_freq)
        o = paged_attention(
            q, target_pool.k, target_pool.v, target_layer, page_table, seq_lens, nothing,
            page_size=target_pool.page_size, sm_scale=1.0 / math.sqrt(cfg.head_dim), implementation=implementation,
        )
        return layer_tail(lp, cfg, x, o), None

    x, _ = jax.lax.scan(layer, x, (params["layers"], kv_layers))
    y = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    return y @ params["post_proj"], y


@dataclasses.dataclass(frozen=True)
class FrozenKVAssistant(Draft):
    """Frozen-KV MTP assistant (seed 003) as a draft: no pool of its own; its extend keeps the
    target's hidden at the last accepted row, and its root runs the seed step (iteration 0 of
    the draft loop) at RoPE position ``seq_len - 1``."""

    model: AssistantConfig
    kind: ClassVar[str] = "frozen_kv"

    @property
    def hidden_size(self) -> int:
        return self.model.backbone_hidden_size

    @property
    def num_layers(self) -> int:
        return 0

    def create_pool(self, *, num_pages, page_size, dtype):
        return zero_pool(page_size, dtype)

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, y = assistant_forward(params, self.model, tokens, hidden, ctx.seq_lens, ctx.target_pool,
                                 ctx.page_table, implementation=implementation)
        return h, y, pool

    def extend(self, params, tokens, features, positions, pool, attn, ctx, *, implementation=None):
        return features, pool  # nothing to extend: the root step reads the target's hidden

    def root(self, params, bonus, seed: DraftSeed, ctx: DraftContext, *, implementation=None):
        h, y, _ = self.forward(params, bonus[:, None], seed.hidden[:, None], None, None, None, ctx,
                               from_target=True, implementation=implementation)
        return h[:, 0], y[:, 0]

    def logits(self, params, logit_in):
        return lm_head(params, logit_in)

    def check_fits(self, target_cfg) -> None:
        check_assistant_fits(self.model, target_cfg)


def assistant_draft(cfg: AssistantConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps frozen-KV assistant params as a draft."""
    return DraftModel(config=FrozenKVAssistant(model=cfg), params=params, path=path)


def assistant_config_for(target: LlamaConfig, *, hidden_size=None, intermediate_size=None, num_heads=None,
                         kv_layers=None) -> AssistantConfig:
    """An assistant shaped for ``target`` (by default: reads the last target layer)."""
    H = hidden_size or target.hidden_size
    return AssistantConfig(
        hidden_size=H,
        intermediate_size=intermediate_size or 2 * H,
        num_heads=num_heads or target.num_heads,
        head_dim=target.head_dim,
        num_kv_heads=target.num_kv_heads,
        rms_norm_eps=target.rms_norm_eps,
        backbone_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        kv_layers=tuple(kv_layers) if kv_layers is not None else (target.num_layers - 1,),
        rope=target.rope,
    )


def check_assistant_fits(cfg: AssistantConfig, target: LlamaConfig, where: str = "assistant") -> None:
    problems = []
    if cfg.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} != target hidden {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
    if cfg.head_dim != target.head_dim or cfg.num_kv_heads != target.num_kv_heads:
        problems.append(
            f"attention reads the target KV ({target.num_kv_heads} heads x {target.head_dim}), "
            f"assistant has {cfg.num_kv_heads} x {cfg.head_dim}"
        )
    if cfg.num_heads % target.num_kv_heads:
        problems.append(f"num_attention_heads {cfg.num_heads} is not a multiple of the target's KV heads")
    if any(not 0 <= layer < target.num_layers for layer in cfg.kv_layers):
        problems.append(f"kv_layer_map {list(cfg.kv_layers)} is outside the target's {target.num_layers} layers")
    if problems:
        raise ConfigError(f"{where}: does not fit the target: " + "; ".join(problems))
