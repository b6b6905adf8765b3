"""P-EAGLE drafts: an EAGLE-3 head that drafts a whole chain in one forward (checkpoint layout
and config parsing: ``jaxspec.model.checkpoints.peagle``).

The head is EAGLE-3's (``jaxspec.model.drafts.eagle``): a row at position ``p`` reads the target's
features at ``p`` (the residual streams entering ``aux_layers``, concatenated, through ``fc``) and
the token at ``p + 1``, and predicts the token at ``p + 2``; its first layer attends over
``[input_norm(embed(token)), hidden_norm(h)]``, later layers (if any) are plain Llama / Qwen3
layers; ``logits = lm_head(norm(h'))`` over a draft vocabulary mapped to target ids by ``d2t``.

P-EAGLE adds *mask rows*: the embedding of ``mask_token_id`` with the learned ``mask_hidden``
(through ``fc``) in place of a target feature. After the extend, the last accepted row (the one
that consumed the bonus token at ``seq_len``, at position ``seq_len - 1``) predicts draft 1; the
``K - 1`` mask rows at positions ``seq_len .. seq_len + K - 2`` predict drafts 2..K in the same
forward. A mask row attends to the context (the draft's own K/V of every committed position) and
causally to the mask rows before it, as ``speculators``' ``create_peagle_mask_mod`` has the
library train them; no mask row reads a drafted token, so the K positions are drafted
independently (a tree hangs the top-k alternatives of each position off the greedy chain).

It runs through the block proposer (``jaxspec.spec.block_loop``): ``block_length(S) = S - 1`` mask
rows, ``seeded`` (the extend's output at the last accepted row is the seed, which drafts the
first proposal).

Optional variants (``speculators``' EAGLE-3 config): ``norm_before_fc`` (one RMSNorm over the
concatenated features before ``fc``), ``fc_norm`` (one per tap), ``norm_before_residual`` (the
first layer's residual is the normed hidden).

Params (linear weights ``[in, out]``):
    embed [V, H] (its own, trained; padded on a mesh); mask_hidden [1, 1, F]; fc [F, H];
    fc_in_norm [F] (norm_before_fc) or fc_norm/{j} [H] (fc_norm);
    layer0/{input_norm, hidden_norm, wqkv [2H, (Hq + 2 Hkv) * D] (q/k/v joined: ``jaxspec.model.fused``),
            wo, (q_norm, k_norm), mlp_norm, w_gate_up [H, 2I] (joined), w_down};
    layer{i}/ (i >= 1) {attn_norm, wqkv [H, (Hq + 2 Hkv) * D], wo, (q_norm, k_norm), mlp_norm, ...};
    norm [H]; lm_head [H, Vd]; hot_ids i32[Vd] (reduced vocabulary only)

``SpeculatorsEagle3Draft`` runs the same head without mask rows token by token (kind "eagle3", a
chain or tree like any EAGLE-3 head): the ``speculators`` layout's plain EAGLE-3 heads
(``speculators_model_type`` "eagle3"), whose variants above jaxspec's ``drafts.eagle`` head does not
compute.

Glossary: B rows, T rows per request, Q mask rows, S proposals, H width, F = n_aux * H_target
target feature width, V target vocabulary (W its logits width: padded on a mesh), Vd draft
vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.config import RopeConfig, pad_vocab
from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel, DraftSeed, check_block_tree
from jaxspec.model.drafts.dflash import position_candidates, position_samples
from jaxspec.model.drafts.eagle import Eagle3Draft
from jaxspec.model.layers import (embed_lookup, head_logits, layer_tail, mask_padded_vocab, project_and_attend, rms_norm,
                                  rope_inv_freq)
from jaxspec.sampling.grammar_masks import Grammar


@dataclasses.dataclass(frozen=True, kw_only=True)
class PEagleConfig:
    """Static shape of a P-EAGLE head.

    num_layers: the head's layers (the first one EAGLE-3's, 2H wide in).
    aux_layers: target layers whose input residual streams it taps (HF ``hidden_states`` indices).
    draft_vocab_size: Vd (== vocab_size without a ``d2t`` map).
    mask_token_id: the token of every mask row (None: a plain EAGLE-3 head, no mask rows).
    num_speculative_tokens: K, the parallel depths it was trained for (its natural chain).
    norm_before_fc, fc_norm, norm_before_residual: the ``speculators`` EAGLE-3 variants.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int = 1
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    mask_token_id: int | None = None
    num_speculative_tokens: int
    qk_norm: bool = False
    attention_bias: bool = False  # (the shared Llama layer body reads it)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    vocab_parallel: int = 1  # shards the vocabulary axis of the target's logits is padded for

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("P-EAGLE: norm_before_fc and fc_norm are mutually exclusive")
        if self.num_layers < 1 or self.num_speculative_tokens < 1:
            raise ValueError("P-EAGLE needs at least one layer and one speculative token")

    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features (and of ``mask_hidden``)."""
        return len(self.aux_layers) * self.target_hidden_size

    @property
    def own_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


def fc_input(params: dict, cfg: PEagleConfig, x: jax.Array) -> jax.Array:  # [..., F] -> [..., H]
    """Target features (or ``mask_hidden``) through the optional input norms and ``fc``."""
    if cfg.norm_before_fc:
        x = rms_norm(x, params["fc_in_norm"], cfg.rms_norm_eps)
    if cfg.fc_norm:
        parts = jnp.split(x, len(cfg.aux_layers), axis=-1)
        x = jnp.concatenate([rms_norm(p, params["fc_norm"][str(j)], cfg.rms_norm_eps) for j, p in enumerate(parts)],
                            axis=-1)
    return x @ params["fc"]


def peagle_layers(
    params: dict,
    cfg: PEagleConfig,
    emb: jax.Array,  # [B, T, H] token embeddings
    h: jax.Array,  # [B, T, H] fc'd features (or mask_hidden)
    positions: jax.Array,  # i32[B, T]
    pool,
    attn: AttentionInputs,
    *,
    implementation=None,
):  # -> hidden [B, T, H] before the final norm, pool
    """The head's layers over T rows per request, writing each layer's K/V."""
    inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
    lp = params["layer0"]
    hn = rms_norm(h, lp["hidden_norm"], cfg.rms_norm_eps)
    a = jnp.concatenate([rms_norm(emb.astype(h.dtype), lp["input_norm"], cfg.rms_norm_eps), hn], axis=-1)
    o, pool = project_and_attend(lp, cfg, a, pool, jnp.int32(0), attn, positions, inv_freq,
                                 implementation=implementation)
    x = layer_tail(lp, cfg, hn if cfg.norm_before_residual else h, o)
    for i in range(1, cfg.num_layers):
        lp = params[f"layer{i}"]
        o, pool = project_and_attend(lp, cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps), pool, jnp.int32(i),
                                     attn, positions, inv_freq, implementation=implementation)
        x = layer_tail(lp, cfg, x, o)
    return x, pool


def token_rows(params: dict, cfg: PEagleConfig, tokens, feature, positions, pool, attn, *, from_target: bool,
               implementation=None):  # -> hidden [B, T, H] before the final norm, pool
    """EAGLE-3 rows: (token, target features ``feature`` [B, T, F] through ``fc``) when
    ``from_target``, else (token, the head's own output [B, T, H] as it is)."""
    emb = embed_lookup(params["embed"], tokens, cfg.vocab_parallel)
    h = fc_input(params, cfg, feature.astype(params["fc"].dtype)) if from_target else feature
    return peagle_layers(params, cfg, emb, h, positions, pool, attn, implementation=implementation)


def head_output(params: dict, cfg: PEagleConfig, h: jax.Array) -> jax.Array:  # [..., H] -> f32[..., Vd]
    return head_logits(rms_norm(h, params["norm"], cfg.rms_norm_eps), params["lm_head"])


@dataclasses.dataclass(frozen=True)
class PEagleDraft(Draft):
    """A P-EAGLE head (``proposer`` "block": ``jaxspec.spec.block_loop``): the extend is EAGLE-3's
    and seeds draft 1; one forward over S - 1 mask rows drafts the rest."""

    model: PEagleConfig
    kind: ClassVar[str] = "peagle"
    proposer: ClassVar[str] = "block"
    seeded: ClassVar[bool] = True

    @property
    def feature(self) -> str:
        return "aux"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.model.aux_layers

    @property
    def target_hidden_size(self) -> int:
        return self.model.target_hidden_size

    @property
    def mask_token_id(self) -> int:
        return self.model.mask_token_id

    @property
    def block_size(self) -> int:
        """The anchor and its K drafts: ``SpecConfig.chain(block_size - 1)`` is the chain it was
        trained for."""
        return self.model.num_speculative_tokens + 1

    def block_length(self, num_steps: int) -> int:
        """Q: mask rows for S = ``num_steps`` proposals (the first comes from the seed)."""
        return num_steps - 1

    # --------------------------------------------------------------------------- forwards

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        """Extend (``from_target``): rows of (token, target features ``hidden`` [B, T, F]);
        otherwise mask rows (``block_forward``)."""
        cfg = self.model
        if not from_target:
            h, pool = self.block_forward(params, tokens, positions, pool, attn, implementation=implementation)
            return h, h, pool
        h, pool = token_rows(params, cfg, tokens, hidden, positions, pool, attn, from_target=True,
                             implementation=implementation)
        return h, h, pool

    def block_forward(self, params, tokens, positions, pool, attn: AttentionInputs, *, implementation=None):
        """Q mask rows at ``positions`` i32[B, Q] (start = ``attn.prefix_lens`` onwards): each
        sees the context before start and the mask rows before it; their K/V are written at
        ``attn.write_slots`` (the next extend overwrites them). Every row is a mask row, so the
        values of ``tokens`` i32[B, Q] are not read (the block proposer's bonus went into the
        extend's last row, whose output is the seed). Returns (hidden [B, Q, H], pool)."""
        cfg = self.model
        B, Q = tokens.shape
        emb = jnp.broadcast_to(params["embed"][cfg.mask_token_id], (B, Q, cfg.hidden_size))
        mh = jnp.broadcast_to(fc_input(params, cfg, params["mask_hidden"][0, 0]), (B, Q, cfg.hidden_size))
        causal = dataclasses.replace(attn, block_mask=None)
        return peagle_layers(params, cfg, emb, mh, positions, pool, causal, implementation=implementation)

    def proposal_hidden(self, hidden, seed: DraftSeed) -> jax.Array:  # [B, Q, H] (or None) -> [B, S, H]
        """The seed (the last accepted row's output: draft 1) then the mask rows (drafts 2..S)."""
        first = seed.hidden[:, None]
        return first if hidden is None else jnp.concatenate([first.astype(hidden.dtype), hidden], axis=1)

    # --------------------------------------------------------------------------- vocabulary

    def logits(self, params, logit_in):  # [..., H] -> f32[..., Vd]
        return head_output(params, self.model, logit_in)

    def to_target_ids(self, params, index):
        return params["hot_ids"][index] if "hot_ids" in params else index.astype(jnp.int32)

    def target_vocab_logits(self, params, logits):  # f32[..., Vd] -> f32[..., W]
        """Draft logits placed in the target's logits width (-inf where it cannot propose)."""
        cfg = self.model
        width = pad_vocab(cfg.vocab_size, cfg.vocab_parallel)
        if "hot_ids" in params:
            full = jnp.full(logits.shape[:-1] + (width,), -jnp.inf, logits.dtype)
            return full.at[..., params["hot_ids"]].set(logits)
        return mask_padded_vocab(logits, cfg.vocab_size, width)

    # --------------------------------------------------------------------------- proposals

    def candidates(self, params, hidden, anchor, width: int, grammar: Grammar | None = None):
        """At each of the S positions (hidden [B, S, H]) the ``width`` best target tokens by the
        draft's softmax, best first (``dflash.position_candidates``). Returns (tokens
        i32[B, S, k], probs f32[B, S, k])."""
        del anchor
        return position_candidates(self.target_vocab_logits(params, self.logits(params, hidden)), width, grammar)

    def sample_path(self, params, hidden, anchor, sampling, uniform, *, filtering: bool,
                    grammar: Grammar | None = None):
        """Every position drawn from the draft's sampling distribution q over the target's
        vocabulary (``dflash.position_samples``). Returns (tokens i32[B, S], q f32[B, S, W])."""
        del anchor
        logits = self.target_vocab_logits(params, self.logits(params, hidden))
        return position_samples(logits, sampling, uniform, filtering=filtering, grammar=grammar)

    # --------------------------------------------------------------------------- checks

    def check_spec(self, spec) -> None:
        """Any chain depth (mask rows past the trained K still draft, less well); a tree hangs
        ``topk - 1`` alternatives per position off the greedy chain, so n - 1 <= S * topk."""
        super().check_spec(spec)  # no grafted n-gram branch, no confidence head
        check_block_tree("P-EAGLE", spec)

    def check_fits(self, target_cfg) -> None:
        cfg = self.model
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"P-EAGLE draft vocab_size {cfg.vocab_size} does not match the target's "
                             f"{target_cfg.vocab_size}")
        if cfg.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(f"P-EAGLE draft was built for target hidden size {cfg.target_hidden_size}, the target "
                             f"has {target_cfg.hidden_size}")
        if not cfg.aux_layers or not all(1 <= a <= target_cfg.num_layers for a in cfg.aux_layers):
            raise ValueError(f"P-EAGLE draft taps target hidden states {list(cfg.aux_layers)}; the target has "
                             f"{target_cfg.num_layers} layers (taps 1..{target_cfg.num_layers})")
        if not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"P-EAGLE mask_token_id {cfg.mask_token_id} is outside the target's vocabulary of "
                             f"{target_cfg.vocab_size}")
        if cfg.draft_vocab_size > target_cfg.vocab_size:
            raise ValueError(f"P-EAGLE draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary "
                             f"{target_cfg.vocab_size}")


@dataclasses.dataclass(frozen=True)
class SpeculatorsEagle3Draft(Eagle3Draft):
    """A ``speculators`` EAGLE-3 head (``mask_token_id`` None): the P-EAGLE body drafting token by
    token as an EAGLE-3 head (kind "eagle3": its chain and tree proposer, ``d2t`` vocabulary); it
    computes ``norm_before_residual``, ``norm_before_fc`` / ``fc_norm`` and later layers, which the
    plain ``drafts.eagle`` head does not."""

    model: PEagleConfig

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        h, pool = token_rows(params, self.model, tokens, hidden, positions, pool, attn, from_target=from_target,
                             implementation=implementation)
        return h, h, pool

    def logits(self, params, logit_in):  # [..., H] -> f32[..., Vd]
        return head_output(params, self.model, logit_in)


def peagle_draft(cfg: PEagleConfig, params: dict, path: str | None = None) -> DraftModel:
    """Wraps P-EAGLE params (a checkpoint or ``init_peagle_params``) as a draft: a P-EAGLE one, or
    an EAGLE-3 one for a head without a mask token."""
    kind = PEagleDraft if cfg.mask_token_id is not None else SpeculatorsEagle3Draft
    return DraftModel(config=kind(model=cfg), params=params, path=path)
