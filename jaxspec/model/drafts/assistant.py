"""Frozen-KV MTP assistant: a draft with no KV of its own (docs/architecture.md#frozen-kv-assistants).

SGLang serves Google's Gemma 4 ``-assistant`` checkpoints this way (FROZEN_KV_MTP). Each
assistant layer is query-only: it attends to the *target's* K/V of one target layer, reading
the committed prefix and writing nothing. Every draft step uses the same RoPE position,
``seq_len - 1`` (the last committed target position), and the seed step (bonus token + the
target's last hidden state) is iteration 0 of the draft loop (``Draft.root``), so a
speculative step stays one executable. One step over T rows per request:

    x = pre_projection([embed(token) * embed_scale, h])      embed: the target's; h: [Hb] backbone
    for each layer l: q = query(x); o = attention(q, target K/V it reads); x = tail(x, o)
    y = norm(x);  logits = head(y);  next h = post_projection(y)

Two layer bodies share this path (``AssistantConfig.style`` picks the body, nothing else):

* "llama" (``JaxspecFrozenKVAssistant`` checkpoints, Llama-family targets): pre-norm SwiGLU
  layers, one attention shape, each layer reads the target layer in ``kv_layers``; the head is
  ``lm_head`` or the target's embedding.
* "gemma4" (HF ``Gemma4AssistantForCausalLM``, Gemma 4 targets): Gemma 4 layers (sandwich
  norms, q_norm, GELU-tanh MLP, layer_scalar, scale 1.0) typed sliding / full; a layer of type
  t reads the target's last layer of type t; the head is the assistant's own embedding table
  (tied ``lm_head``), optionally the ordered-embeddings head (below). ``embed_scale`` is the
  target's sqrt(H_t) and there is no logit softcap.

What a layer sees: a target layer in the full pool gives every committed position
``[0, seq_len)``; one in the window pool (sliding layers) the last ``window + 1`` committed
positions ``[seq_len - window - 1, seq_len)`` (what HF's assistant sees: its sliding mask keeps
the last W + 1 entries it is given), with no causal mask (all rows see the same keys).

Ordered-embeddings head (``num_centroids`` C > 0, HF ``use_ordered_embeddings``): the top
``centroid_top_k`` clusters of ``y @ centroids`` select the tokens of those clusters
(``token_ordering`` viewed ``[C, V / C]``); a selected token's logit is ``y . head[token]``
(as HF computes it); every other token gets -inf (HF writes ``min(selected) - 1`` over the whole
batch, which depends on the batch). The draft's sampling distribution q is the softmax of these
logits, so it is zero outside the selected clusters, and the same q is used to sample a draft
token and in its acceptance test (lossless either way).

Checkpoint layouts and parsing: ``jaxspec.model.checkpoints.assistant``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxspec.kvcache.paging import full_table, window_table
from jaxspec.mesh import MODEL, per_model_shard
from jaxspec.model.config import ConfigError, RopeConfig
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel, DraftSeed, zero_pool
from jaxspec.model.layers import (attention_over, embed_lookup, gather_window, head_logits, layer_tail, lm_head,
                                  mask_padded_vocab, project_q, rms_norm, rope_inv_freq)
from jaxspec.model.targets.gemma4 import GROUPS, gemma_layer_tail, gemma_query, norm
from jaxspec.model.targets.gemma4_config import SLIDING, AttentionShape, Gemma4Config
from jaxspec.model.targets.llama_config import LlamaConfig
from jaxspec.pallas.paged_attention import paged_attention


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantConfig:
    """A frozen-KV assistant (static).

    Attributes:
      style: the layer body, "llama" or "gemma4" (module docstring).
      kv_layers: the target layer whose K/V assistant layer i reads.
      kv_sources: for each assistant layer, where that target layer keeps its K/V: ("full" |
        "window", layer index in that pool part) (from the target config).
      window: the sliding window of window-pool reads (the last ``window + 1`` committed positions).
      head_dim, num_kv_heads, rope: the attention shape ("llama" style; the target's).
      layer_types, sliding, full: the type and shape of each layer ("gemma4" style).
      embed_scale: factor on the target embedding of the input token.
      num_centroids, centroid_top_k: the ordered-embeddings head (0: a plain head).
      tensor_parallel: the target's model shards. The assistant's weights are whole on every
        shard; its attention runs per shard over the shard's KV heads of the target pool (and
        the matching query heads), and the target embedding it reads is vocab-parallel.
    """

    style: str = "llama"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    backbone_hidden_size: int
    vocab_size: int
    kv_layers: tuple[int, ...]
    kv_sources: tuple[tuple[str, int], ...] = ()
    window: int | None = None
    head_dim: int = 0
    num_kv_heads: int = 0
    rope: RopeConfig = RopeConfig()
    layer_types: tuple[str, ...] = ()
    sliding: AttentionShape | None = None
    full: AttentionShape | None = None
    embed_scale: float = 1.0
    attention_bias: bool = False  # (the shared Llama layer body reads these two)
    qk_norm: bool = False
    num_centroids: int = 0
    centroid_top_k: int = 0
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.style not in ("llama", "gemma4"):
            raise ConfigError(f"assistant style must be 'llama' or 'gemma4', got {self.style!r}")
        if self.kv_sources and len(self.kv_sources) != len(self.kv_layers):
            raise ConfigError(f"{len(self.kv_sources)} kv_sources for {len(self.kv_layers)} layers")

    @property
    def num_layers(self) -> int:
        return len(self.kv_layers)

    def layer(self, i: int) -> tuple[str, int]:
        """(params group, index in it) of assistant layer ``i``."""
        if self.style == "llama":
            return "layers", i
        t = self.layer_types[i]
        return GROUPS[t], self.layer_types[:i].count(t)

    def query(self, lp: dict, i: int, x: jax.Array, positions: jax.Array) -> jax.Array:  # -> [B, T, Hq, D]
        if self.style == "llama":
            h = rms_norm(x, lp["attn_norm"], self.rms_norm_eps)
            return project_q(lp, self, h, positions, rope_inv_freq(self.rope, self.head_dim))
        shape = self.sliding if self.layer_types[i] == SLIDING else self.full
        inv_freq = rope_inv_freq(shape.rope, shape.head_dim)
        return gemma_query(lp, shape, self.num_heads, self.rms_norm_eps, x, positions, inv_freq)

    def tail(self, lp: dict, x: jax.Array, o: jax.Array) -> jax.Array:
        if self.style == "llama":
            return layer_tail(lp, self, x, o)
        return gemma_layer_tail(lp, self.rms_norm_eps, x, o, self.tensor_parallel)

    def final_norm(self, params: dict, x: jax.Array) -> jax.Array:
        if self.style == "llama":
            return rms_norm(x, params["norm"], self.rms_norm_eps)
        return norm(x, params["norm"], self.rms_norm_eps)

    def sm_scale(self, q: jax.Array) -> float:
        return 1.0 / math.sqrt(q.shape[-1]) if self.style == "llama" else 1.0


def frozen_attention(
    q: jax.Array,  # [B, T, Hq, D] (RoPE applied)
    target_pool,
    source: tuple[str, int],  # ("full" | "window", layer in that part)
    ctx: DraftContext,
    *,
    window: int | None,
    sm_scale: float,
    implementation=None,
    tensor_parallel: int = 1,
) -> jax.Array:  # [B, T, Hq, D]
    """Attention of every row over the target's committed K/V of one layer (module docstring).
    With ``tensor_parallel`` shards each shard attends with its query heads over its KV heads
    of the (head-split) target pool."""
    part_name, layer = source
    part = target_pool.part(part_name)
    table = full_table(ctx.page_table) if part_name == "full" else window_table(ctx.page_table)

    def local(q, part, table, seq_lens):
        B, T = q.shape[:2]
        if part_name == "full":
            nothing = jnp.zeros((B, T, 1), bool)  # no block: only the committed prefix is visible
            return paged_attention(q, part.k, part.v, jnp.int32(layer), table, seq_lens, nothing,
                                   page_size=part.page_size, sm_scale=sm_scale, implementation=implementation)
        k, v, pos = gather_window(part, jnp.int32(layer), table, seq_lens - (window + 1), window + 1)
        visible = jnp.broadcast_to(((pos >= 0) & (pos < seq_lens[:, None]))[:, None, :], (B, T, window + 1))
        return attention_over(q, k, v, visible, sm_scale)

    heads = P(None, None, MODEL, None)
    fn = per_model_shard(local, in_specs=(heads, jax.tree.map(lambda _: heads, part),
                                          jax.tree.map(lambda _: P(), table), P()),
                         out_specs=heads, shards=tensor_parallel)
    return fn(q, part, table, ctx.seq_lens)


def assistant_forward(
    params: dict,
    cfg: AssistantConfig,
    tokens: jax.Array,  # i32[B, T]
    hidden: jax.Array,  # [B, T, Hb] backbone hidden (target's at the seed step, own after)
    ctx: DraftContext,
    *,
    positions: jax.Array | None = None,  # i32[B, T] RoPE positions (default: seq_len - 1)
    implementation=None,
) -> tuple[jax.Array, jax.Array]:  # next hidden [B, T, Hb], normed output [B, T, H]
    B, T = tokens.shape
    emb = embed_lookup(params["embed"], tokens, cfg.tensor_parallel).astype(hidden.dtype)
    emb = emb * jnp.asarray(cfg.embed_scale, hidden.dtype)
    x = jnp.concatenate([emb, hidden], axis=-1) @ params["pre_proj"]  # [B, T, H]
    if positions is None:
        positions = jnp.broadcast_to(jnp.maximum(ctx.seq_lens - 1, 0)[:, None], (B, T))
    for i in range(cfg.num_layers):  # few layers, of up to two shapes: unrolled
        group, index = cfg.layer(i)
        lp = jax.tree.map(lambda a, index=index: a[index], params[group])
        q = cfg.query(lp, i, x, positions)
        o = frozen_attention(q, ctx.target_pool, cfg.kv_sources[i], ctx, window=cfg.window, sm_scale=cfg.sm_scale(q),
                             implementation=implementation, tensor_parallel=cfg.tensor_parallel)
        x = cfg.tail(lp, x, o)
    y = cfg.final_norm(params, x)
    return y @ params["post_proj"], y


def assistant_logits(params: dict, cfg: AssistantConfig, y: jax.Array) -> jax.Array:  # [..., H] -> f32[..., V]
    """The head (module docstring): plain, or ordered embeddings with -inf outside the selected clusters."""
    if cfg.style == "llama":  # the head may be the target's (its padded vocabulary on a mesh)
        return mask_padded_vocab(lm_head(params, y), cfg.vocab_size)
    logits = head_logits(y, params["head"], rows_of_w=True)
    if not cfg.num_centroids:
        return mask_padded_vocab(logits, cfg.vocab_size)
    scores = jnp.einsum("...h,hc->...c", y, params["centroids"], preferred_element_type=jnp.float32)
    _, top = jax.lax.top_k(scores, cfg.centroid_top_k)  # [..., k]
    chosen = jnp.any(top[..., :, None] == jnp.arange(cfg.num_centroids)[None, :], axis=-2)  # [..., C]
    selected = jnp.take(chosen, params["token_cluster"], axis=-1)  # [..., V]
    return mask_padded_vocab(jnp.where(selected, logits[..., : cfg.vocab_size], -jnp.inf), cfg.vocab_size,
                             logits.shape[-1])


@dataclasses.dataclass(frozen=True)
class FrozenKVAssistant(Draft):
    """Frozen-KV MTP assistant as a draft: no pool of its own; its extend keeps the
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

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return zero_pool(page_size, dtype)

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, y = assistant_forward(params, self.model, tokens, hidden, ctx, implementation=implementation)
        return h, y, pool

    def extend(self, params, tokens, features, positions, pool, attn, ctx, *, implementation=None):
        return features, pool  # nothing to extend: the root step reads the target's hidden

    def root(self, params, bonus, seed: DraftSeed, ctx: DraftContext, *, implementation=None):
        h, y, _ = self.forward(params, bonus[:, None], seed.hidden[:, None], None, None, None, ctx,
                               from_target=True, implementation=implementation)
        return h[:, 0], y[:, 0]

    def logits(self, params, logit_in):
        return assistant_logits(params, self.model, logit_in)

    def check_fits(self, target_cfg) -> None:
        check_assistant_fits(self.model, target_cfg)


def assistant_draft(cfg: AssistantConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps frozen-KV assistant params as a draft."""
    return DraftModel(config=FrozenKVAssistant(model=cfg), params=params, path=path)


def _sources(target, kv_layers) -> tuple[tuple[str, int], ...]:
    if any(not 0 <= layer < target.num_layers for layer in kv_layers):
        return ()  # check_assistant_fits names the problem
    return tuple(target.kv_source(layer) for layer in kv_layers)


def assistant_config_for(target: LlamaConfig, *, hidden_size=None, intermediate_size=None, num_heads=None,
                         kv_layers=None) -> AssistantConfig:
    """A "llama"-style assistant shaped for ``target`` (by default: reads the last target layer)."""
    H = hidden_size or target.hidden_size
    kv_layers = tuple(kv_layers) if kv_layers is not None else (target.num_layers - 1,)
    return AssistantConfig(
        hidden_size=H,
        intermediate_size=intermediate_size or 2 * H,
        num_heads=num_heads or target.num_heads,
        head_dim=target.head_dim,
        num_kv_heads=target.num_kv_heads // target.kv_repeat,  # the checkpoint's (copies on a mesh)
        rms_norm_eps=target.rms_norm_eps,
        backbone_hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        kv_layers=kv_layers,
        kv_sources=_sources(target, kv_layers),
        window=target.sliding_window,
        rope=target.rope,
        tensor_parallel=target.tensor_parallel,
    )


def gemma4_assistant_config(target: Gemma4Config, *, hidden_size: int, intermediate_size: int, num_heads: int,
                            layer_types: tuple[str, ...], sliding: AttentionShape, full: AttentionShape,
                            window: int, rms_norm_eps: float = 1e-6, num_centroids: int = 0,
                            centroid_top_k: int = 0) -> AssistantConfig:
    """A "gemma4"-style assistant for ``target``: a layer of type t reads the target's last layer
    of type t."""
    kv_layers = tuple(max(target.layers_of(t), default=-1) for t in layer_types)
    return AssistantConfig(
        style="gemma4", hidden_size=hidden_size, intermediate_size=intermediate_size, num_heads=num_heads,
        rms_norm_eps=rms_norm_eps, backbone_hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        kv_layers=kv_layers, kv_sources=_sources(target, kv_layers), window=window, layer_types=tuple(layer_types),
        sliding=sliding, full=full, embed_scale=math.sqrt(target.hidden_size), num_centroids=num_centroids,
        centroid_top_k=centroid_top_k, tensor_parallel=target.tensor_parallel,
    )


def check_assistant_fits(cfg: AssistantConfig, target, where: str = "assistant") -> None:
    """Raises ``ConfigError`` naming every way ``cfg`` cannot read ``target``'s K/V."""
    problems = []
    if cfg.backbone_hidden_size != target.hidden_size:
        problems.append(f"backbone_hidden_size {cfg.backbone_hidden_size} != target hidden {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab {target.vocab_size}")
    if cfg.style == "gemma4" and not isinstance(target, Gemma4Config):
        problems.append(f"a Gemma 4 assistant reads a Gemma 4 target's K/V, not a {type(target).__name__}'s")
    elif cfg.style == "llama" and not isinstance(target, LlamaConfig):
        problems.append(f"this assistant reads a Llama-family target's K/V, not a {type(target).__name__}'s")
    elif any(not 0 <= layer < target.num_layers for layer in cfg.kv_layers):
        kind = "kv_layer_map" if cfg.style == "llama" else "layer types"
        problems.append(f"{kind} {list(cfg.kv_layers)} is outside the target's {target.num_layers} layers"
                        if cfg.style == "llama" else
                        f"the target has no layer of a type the assistant reads ({kind} {list(cfg.layer_types)})")
    elif cfg.style == "llama":
        kv = _checkpoint_kv_heads(target.num_kv_heads, target.kv_repeat)
        if cfg.head_dim != target.head_dim or cfg.num_kv_heads != kv[0]:
            problems.append(f"attention reads the target KV ({kv[1]} heads x {target.head_dim}), "
                            f"assistant has {cfg.num_kv_heads} x {cfg.head_dim}")
        problems += _head_split_problems(cfg, kv[0], target.tensor_parallel, "")
    else:
        for t in sorted(set(cfg.layer_types)):
            mine, theirs = (cfg.sliding, target.sliding) if t == SLIDING else (cfg.full, target.full)
            kv = _checkpoint_kv_heads(theirs.num_kv_heads, theirs.kv_repeat)
            if (mine.head_dim, mine.num_kv_heads) != (theirs.head_dim, kv[0]):
                problems.append(f"{t} layers read the target KV ({kv[1]} heads x {theirs.head_dim}), "
                                f"assistant has {mine.num_kv_heads} x {mine.head_dim}")
            problems += _head_split_problems(cfg, kv[0], target.tensor_parallel, f"{t} ")
        if SLIDING in cfg.layer_types and cfg.window > target.sliding_window:
            problems.append(f"sliding_window {cfg.window} > the target's {target.sliding_window} (the target keeps "
                            f"only its own window)")
    if problems:
        raise ConfigError(f"{where}: does not fit the target: " + "; ".join(problems))


def _checkpoint_kv_heads(pool_heads: int, repeat: int) -> tuple[int, str]:
    """(the target checkpoint's KV heads, how to name them) from its pool's (copies on a mesh)."""
    kv = pool_heads // repeat
    return kv, str(kv) if repeat == 1 else f"{kv} ({pool_heads} on the mesh)"


def _head_split_problems(cfg: AssistantConfig, kv_heads: int, shards: int, kind: str) -> list[str]:
    """The assistant's query heads must group over the target's KV heads, and split over its shards."""
    out = []
    if cfg.num_heads % kv_heads:
        out.append(f"num_attention_heads {cfg.num_heads} is not a multiple of the target's {kind}KV heads")
    if cfg.num_heads % shards:
        out.append(f"num_attention_heads {cfg.num_heads} is not divisible by the target's tensor_parallel {shards}")
    return out
