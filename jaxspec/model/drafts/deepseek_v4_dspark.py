"""DeepSeek's own DSpark draft for DeepSeek-V4 (``mtp.{0..S-1}.*`` of DeepSeek-V4-Flash-DSpark, read by
``jaxspec.model.checkpoints.deepseek_v4_dspark``): DSpark's Markov and confidence heads
(``jaxspec.model.drafts.dspark``) on a backbone of S full V4 blocks instead of Qwen3-style layers.

Context (at extend, for every committed position p, from the target's taps):

    main_x_p = RMSNorm(main_proj(concat_l mean_n streams_l,n(p)), main_norm)    # [H]
    stage s keeps K = V rows  kv_s(p) = RoPE_p(RMSNorm(main_x_p @ wkv_s, kv_norm_s))

in a sliding-window ring pool of its own (one layer per stage), where ``streams_l`` is the output of
target layer ``l`` (the streams entering layer ``l + 1``: tap ``l + 1``) averaged over its N
hyper-connection streams.

Block (one forward per step): ``[anchor, noise x (Q - 1)]`` at positions ``start .. start + Q - 1``
(start = the anchor's position = the committed length), embedded with the target's table and copied
onto the N streams, runs through the S stages: hyper-connections, attention, MoE (``v4_block``).
Every block query attends to the same keys: the stage's context rows of the last W positions
before ``start`` (W = the target's ``sliding_window``) and the block's own K = V rows, bidirectionally,
plus the head's sink. Then ``h = hc_head(streams)`` (the last stage's) and

    logits_k = head(RMSNorm(h_k, norm)) + W2 W1[prev_k]       (the Markov head, ``vanilla``)
    confidence_k = proj([h_k, W1[prev_k]])                    (the pre-norm h_k)

with ``prev_0`` the anchor: every slot drafts (``sample_from_anchor``).

Params (linear weights ``[in, out]``):
    main_proj [n*H, H]; main_norm [H]; norm [H]; hc_head_fn f32[N*H, N], hc_head_base [N], hc_head_scale [1]
    stages/layers/ [S]: the V4 layer arrays of ``jaxspec.model.targets.deepseek_v4`` (no compressor);
    stages/topk/router_bias [S, E]
    markov/w1 [V, r], markov/w2 [r, V]; confidence/w [H + r, 1], confidence/b [1]
    embed [V, H], head [H, V]: the target's

Glossary: B rows, Q block slots, T context rows, S stages, n taps, N streams, H width, D the K = V
head width, W window, r Markov rank, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs, scratch_dropped
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.drafts.dspark import DSparkDraft
from jaxspec.model.layers import embed_lookup, head_logits, mask_padded_vocab
from jaxspec.model.targets.deepseek_v4 import create_v4_pool, hc_head, v4_block
from jaxspec.model.targets.deepseek_v4_attention import (norm, sink_attention, v4_attention_output, v4_kv,
                                                         v4_query)
from jaxspec.model.targets.deepseek_v4_config import SLIDING, DeepseekV4Config

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class V4DSparkConfig:
    """Static shape of a V4 DSpark draft.

    target: the target's config (the stages have its shapes). num_stages: S (``n_mtp_layers``).
    block_size: Q slots per block (``dspark_block_size``). mask_token_id: the noise token
    (``dspark_noise_token_id``). target_layer_ids: the target layers whose outputs form the
    context (``dspark_target_layer_ids``). markov_rank: r. confidence_head: it has one.
    """

    target: DeepseekV4Config
    num_stages: int = 3
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    confidence_head: bool = True

    # What the DSpark heads read (``DSparkConfig``'s fields): DeepSeek's heads are fixed.
    sample_from_anchor = True
    first_draft_slot = 0
    markov_head_type = "vanilla"
    own_vocab = False

    def __post_init__(self):
        if self.num_stages < 1 or self.block_size < 1:
            raise ValueError(f"a DSpark draft needs >= 1 stage and block slot, got {self.num_stages} stages and "
                             f"block_size {self.block_size}")
        if self.markov_rank < 1:
            raise ValueError(f"DeepSeek's DSpark has a Markov head: markov_rank must be >= 1, got {self.markov_rank}")

    @property
    def confidence_with_markov(self) -> bool:
        return self.confidence_head  # [h, W1[prev]]: DeepSeek's head reads both

    @property
    def max_proposals(self) -> int:
        return self.block_size

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size

    @property
    def num_layers(self) -> int:
        return self.num_stages

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def tensor_parallel(self) -> int:
        return self.target.tensor_parallel

    @property
    def window(self) -> int:
        return self.target.sliding_window


def stage_params(params: dict, s: int) -> tuple[dict, jax.Array]:
    """Stage ``s``'s layer arrays and its router bias."""
    st = params["stages"]
    return jax.tree.map(lambda a: a[s], st["layers"]), st["topk"]["router_bias"][s]


def context_rows(params: dict, cfg: V4DSparkConfig, features: jax.Array) -> jax.Array:
    """The target's taps ``[B, T, n*N*H]`` (flattened streams, in ``target_layer_ids`` order) ->
    main_x [B, T, H]: each tap averaged over its streams, concatenated, projected and normed."""
    t = cfg.target
    B, T, _ = features.shape
    n = len(cfg.target_layer_ids)
    mean = jnp.mean(features.reshape(B, T, n, t.hc_mult, t.hidden_size).astype(jnp.float32), axis=3)
    main = jnp.dot(mean.reshape(B, T, n * t.hidden_size).astype(features.dtype), params["main_proj"])
    return norm(main, params["main_norm"], t.rms_norm_eps)


def dspark_attention(lp: dict, cfg: V4DSparkConfig, h: jax.Array, positions: jax.Array, ctx_kv: jax.Array,
                     ctx_ok: jax.Array) -> jax.Array:
    """A stage's attention: ``h [B, Q, H]`` (after the attention norm) at ``positions`` i32[B, Q];
    every query sees the context rows ``ctx_kv [B, W, D]`` where ``ctx_ok`` bool[B, W], every block
    row and the sink. -> [B, Q, H]."""
    t = cfg.target
    B, Q, _ = h.shape
    rope = t.rope_of(SLIDING)
    q, _ = v4_query(lp, t, h, positions, rope)
    kv = v4_kv(lp, t, h, positions, rope)  # [B, Q, D]
    keys = [(ctx_kv[:, None], jnp.broadcast_to(ctx_ok[:, None, :], (B, Q, ctx_kv.shape[1]))),
            (kv[:, None], jnp.ones((B, Q, Q), bool))]
    o = sink_attention(q, keys, lp["sinks"], t.sm_scale)
    return v4_attention_output(lp, t, o.astype(h.dtype), positions, rope)


@dataclasses.dataclass(frozen=True)
class V4DSparkDraft(DSparkDraft):
    """DeepSeek-V4's DSpark draft (``proposer`` "block"): S V4 blocks over the block, context from the
    target's averaged streams in a ring pool of its own, DSpark's Markov and confidence heads."""

    model: V4DSparkConfig

    @property
    def kind(self) -> str:
        return "dspark"

    @property
    def kv_window(self) -> int:
        return self.model.window

    @property
    def target_hidden_size(self) -> int:
        return self.model.target.hc_width  # each tap: the flattened streams

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        """One ring layer per stage (sliding window; no compressed entries)."""
        return create_v4_pool(self.model.target, num_pages=num_pages, page_size=page_size, dtype=dtype,
                              window_pages=window_pages, rows=rows, kinds=(SLIDING,) * self.model.num_stages)

    def check_fits(self, target_cfg) -> None:
        cfg = self.model
        if target_cfg != cfg.target:
            raise ValueError("DeepSeek's DSpark draft serves the checkpoint it came from (its target config differs)")
        bad = [l for l in cfg.target_layer_ids if not 0 <= l < target_cfg.num_layers]
        if bad or not cfg.target_layer_ids:
            raise ValueError(f"DSpark dspark_target_layer_ids {list(cfg.target_layer_ids)} must name layers of the "
                             f"target's {target_cfg.num_layers} (0-based)")
        if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"DSpark dspark_noise_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                             f"of {target_cfg.vocab_size}")

    # --------------------------------------------------------------------------- forwards

    def write_context(self, params, features, positions, pool, attn: AttentionInputs):
        """Context rows of the target's taps ``[B, T, n*N*H]`` at ``positions`` i32[B, T] into every
        stage's ring (at ``attn.write_positions``; negative: not written). Returns (main_x [B, T, H], pool)."""
        cfg, t = self.model, self.model.target
        main_x = context_rows(params, cfg, features)
        B, T = positions.shape
        ring = pool.window
        slots = attn.window.slots(attn.write_positions, ring.page_size).reshape(B * T)
        # A prefill's checkpoint pages for the prefix cache (``jaxspec.engine.window``): written there too.
        targets = [slots] + ([attn.window_keep.slots(attn.write_positions, ring.page_size).reshape(B * T)]
                             if attn.window_keep is not None else [])
        targets = [scratch_dropped(t, ring.page_size, ring.num_slots) for t in targets]  # scratch writes skipped
        kv = ring.kv
        for s in range(cfg.num_stages):
            lp, _ = stage_params(params, s)
            rows = v4_kv(lp, t, main_x, positions, t.rope_of(SLIDING)).reshape(B * T, -1).astype(kv.dtype)
            for where in targets:
                kv = kv.at[s, where].set(rows, mode="drop")
        return main_x, dataclasses.replace(pool, window=dataclasses.replace(ring, kv=kv))

    def block_forward(self, params, tokens, positions, pool, attn: AttentionInputs, *, implementation=None):
        """The S stages over ``tokens`` i32[B, Q] at ``positions`` i32[B, Q] (start = ``attn.prefix_lens``);
        nothing is written. Returns (h [B, Q, H]: ``hc_head`` of the last stage's streams, before the
        final norm, which the confidence head reads; pool)."""
        cfg, t = self.model, self.model.target
        B, Q = tokens.shape
        W, ring = cfg.window, pool.window
        ctx_pos = attn.prefix_lens[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]  # [B, W]
        ctx_slots = attn.window.slots(ctx_pos, ring.page_size)
        e = embed_lookup(params["embed"], tokens, t.tensor_parallel)  # [B, Q, H]
        x = jnp.broadcast_to(e[:, :, None, :], (B, Q, t.hc_mult, t.hidden_size))
        for s in range(cfg.num_stages):
            lp, bias = stage_params(params, s)
            ctx_kv = ring.kv[s, ctx_slots]  # [B, W, D]

            def attend(h, lp=lp, ctx_kv=ctx_kv):
                return dspark_attention(lp, cfg, h, positions, ctx_kv, ctx_pos >= 0), None

            x, _ = v4_block(lp, t, x, tokens, attend, None, bias, jnp.asarray(False), implementation=implementation)
        return hc_head(params, t, x), pool

    # --------------------------------------------------------------------------- logits

    def base_logits(self, params, hidden):  # [..., H] (pre-norm) -> f32[..., V]
        t = self.model.target
        h = norm(hidden, params["norm"], t.rms_norm_eps)
        logits = head_logits(h, params["head"])
        return mask_padded_vocab(logits, t.vocab_size)


def v4_dspark_draft(cfg: V4DSparkConfig, params: dict, path: str | None = None) -> DraftModel:
    return DraftModel(config=V4DSparkDraft(model=cfg), params=params, path=path)
