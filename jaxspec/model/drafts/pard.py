"""PARD drafts (PARallel Draft models): a small Llama-family LM with the target's vocabulary,
adapted so that one forward over ``[context..., bonus, mask x (K - 1)]`` proposes K tokens
(checkpoint detection and loading: ``jaxspec.model.checkpoints.draft_formats``).

The LM keeps its own KV pool over the committed tokens, exactly as a standalone draft does
(row ``p`` consumes the token at ``p``). Each step is one causal forward over a block at
positions ``seq_len .. seq_len + K - 1``: the bonus (the last emitted token, the root of the
verify tree) followed by K - 1 copies of the checkpoint's mask token (``pard_token``). The bonus
row predicts draft 1, the mask row at ``seq_len + i`` draft ``i + 1``; every row attends to the
committed context and the block rows before it. Positions are drafted independently (the mask
rows see masks, not the tokens drafted before them), so a tree hangs alternatives off the
greedy chain at each position as DFlash's does, and chain sampling draws each position from its
own q.

It runs under the block draft loop (``jaxspec.spec.block_loop``, ``proposer = "block"``): the block
forward writes the K/V of its rows; the bonus row's is already the committed token's, the mask
rows' are overwritten by the extend, which runs the LM over the committed tokens (the root and
the accepted drafts) at their positions.

Glossary: B rows, Q = K block rows (S = K proposals: every row drafts), H the LM's width,
V vocabulary (W its logits width: padded on a mesh).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from jaxspec.model.drafts.base import Draft, DraftContext, DraftModel, DraftSeed, check_block_tree
from jaxspec.model.drafts.dflash import position_candidates, position_samples
from jaxspec.sampling.grammar_masks import Grammar
from jaxspec.model.layers import mask_padded_vocab
from jaxspec.model.targets import Model, create_target_pool, target_forward, target_logits
from jaxspec.model.targets.llama_config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class PardDraft(Draft):
    """A PARD draft (``proposer`` "block").

    Attributes (static):
      model: the LM's config (a ``LlamaConfig`` without a sliding window).
      mask_token_id: the token filling the block after the bonus (the checkpoint's ``pard_token``).
      logits_width: W, the width of the target's logits its own are widened to (None: its own);
        they differ on a mesh where the target's vocabulary is padded and the draft is replicated.
    """

    model: Any
    mask_token_id: int
    logits_width: int | None = None
    kind: ClassVar[str] = "pard"
    proposer: ClassVar[str] = "block"

    def __post_init__(self):
        if not isinstance(self.model, LlamaConfig) or self.model.sliding_window is not None:
            what = (f"a {self.model.arch} LM with a sliding window of {self.model.sliding_window}"
                    if isinstance(self.model, LlamaConfig) else f"a {type(self.model).__name__} LM")
            raise ValueError(f"a PARD draft must be a Llama-family LM (Llama, Mistral, Qwen2, Qwen3) with full "
                             f"attention; this is {what}")

    @property
    def feature(self) -> None:
        return None

    def block_length(self, num_steps: int) -> int:
        """Q: block rows for S = ``num_steps`` proposals (the bonus row drafts too)."""
        return num_steps

    seeded: ClassVar[bool] = False  # nothing carried between blocks: the context lives in the pool
    pos_offset: ClassVar[int] = 1  # a token-level LM: row p reads the token at p (the extend passes those)

    def proposal_hidden(self, hidden: jax.Array, seed: DraftSeed) -> jax.Array:  # [B, Q, H] -> [B, S, H]
        return hidden  # every row proposes

    def empty_seed(self, batch: int, *, dtype, max_len: int):
        del max_len
        return DraftSeed.empty(batch, 1, dtype)  # nothing is carried: the context lives in the pool

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return create_target_pool(self.model, num_pages=num_pages, page_size=page_size, dtype=dtype, rows=rows)

    # --------------------------------------------------------------------------- forwards

    def forward(self, params, tokens, hidden, positions, pool, attn, ctx: DraftContext, *, from_target,
                implementation=None):
        """The LM over ``tokens`` i32[B, T] at ``positions`` (the token at each position), causal
        over the T rows after ``attn.prefix_lens``, writing their K/V. Returns (normed hidden
        [B, T, H] twice, pool)."""
        del hidden, ctx, from_target
        out = target_forward(self.model, params, tokens, positions, pool, attn, implementation=implementation)
        return out.hidden, out.hidden, out.pool

    def block_forward(self, params, tokens, positions, pool, attn, *, implementation=None):
        """One block forward over [bonus, mask, ...] (i32[B, Q] at ``positions``). Returns (normed
        hidden [B, Q, H], pool)."""
        out = target_forward(self.model, params, tokens, positions, pool, attn, implementation=implementation)
        return out.hidden, out.pool

    def logits(self, params, logit_in):  # [..., H] -> f32[..., W]
        return mask_padded_vocab(target_logits(self.model, params, logit_in), self.model.vocab_size,
                                 self.logits_width)

    # --------------------------------------------------------------------------- proposals

    def candidates(self, params, hidden, anchor, width: int, grammar: Grammar | None = None):
        """The ``width`` best tokens of every block row, best first (``position_candidates``).
        hidden: [B, S, H]. Returns (tokens i32[B, S, k], probs f32[B, S, k])."""
        del anchor
        return position_candidates(self.logits(params, hidden), width, grammar)

    def sample_path(self, params, hidden, anchor, sampling, uniform, *, filtering: bool,
                    grammar: Grammar | None = None):
        """Every row's proposal drawn from its own q (``position_samples``). hidden: [B, S, H];
        uniform: f32[B, S]. Returns (tokens i32[B, S], q f32[B, S, W])."""
        del anchor
        return position_samples(self.logits(params, hidden), sampling, uniform, filtering=filtering, grammar=grammar)

    # --------------------------------------------------------------------------- fit

    def check_fits(self, target_cfg) -> None:
        if self.model.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"PARD draft vocab_size {self.model.vocab_size} does not match the target's "
                             f"{target_cfg.vocab_size} (it proposes the target's token ids)")
        if not 0 <= self.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"PARD draft mask token (pard_token) {self.mask_token_id} is outside the vocabulary "
                             f"of {target_cfg.vocab_size} tokens")

    def check_spec(self, spec) -> None:
        """Any chain (a block of S rows for S proposals); a tree hangs at most ``topk`` candidates
        per position off the greedy chain, so n - 1 <= S * topk."""
        super().check_spec(spec)  # no grafted n-gram branch, no confidence head
        check_block_tree("PARD", spec)


def pard_draft(model: Model, mask_token_id: int) -> DraftModel:
    """Uses an already-loaded Llama-family LM as a PARD draft whose mask token is
    ``mask_token_id`` (``load_draft`` reads it from a PARD checkpoint's ``pard_token``)."""
    return DraftModel(config=PardDraft(model=model.config, mask_token_id=int(mask_token_id)), params=model.params,
                      path=model.path, mesh=model.mesh)
