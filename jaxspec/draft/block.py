"""The block draft loop: one draft forward proposes a whole block (DFlash, DFlash 2, DSpark, PARD).

    prefill   the prompt's tokens and the target's features -> the draft's context KV at
              positions [0, len)
    propose   one block forward over [bonus, mask x (Q - 1)] at positions seq_len .. seq_len + Q - 1
              -> the S proposals of a chain, or a tree (the chain plus alternatives per position,
              ``shape.build_block``); chain sampling draws every proposal from its q. Q is the
              draft's ``block_length(S)``: S + 1 when the anchor slot drafts nothing (DFlash), S
              when it drafts too (DSpark's ``sample_from_anchor``, PARD). With
              ``SpecConfig.confidence_threshold`` the draft's confidence head also says how many
              of its proposals each row wants verified (a capped ``VerifyPrefix``)
    extend    the committed tokens (the root, then the accepted drafts) and their target features
              -> context KV at [seq_len, seq_len + accept_len)

The draft's pool holds the context K/V of every committed position (from the target's features
for DFlash / DSpark, from the tokens themselves for a PARD LM). The block's own K/V are written
at the positions the block occupies (``seq_len + j``, the same slots the verify tree uses) and
overwritten by the next extend, so nothing carries between steps but the pool.
Any draft with ``proposer = "block"`` runs here: it implements ``mask_token_id``,
``block_length``, ``block_forward`` (tokens -> hidden), ``proposal_hidden`` (what its proposals
read of the block), ``candidates`` (greedy proposals and alternatives), ``sample_path`` and, with
a confidence head, ``confidence``.

Glossary: B rows, S = num_steps proposals, Q block tokens, k = topk, A = S + 1,
R prefilled rows, T prompt bucket, F target feature width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.draft.plan import KEY_SEED, Plan, StepRows, VerifyPrefix, sub_keys
from jaxspec.draft.shape import shape_for
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.model.sampling import uniforms


class Block:
    """Drives any draft that proposes a block of tokens in one forward."""

    @staticmethod
    def propose(plan: Plan, dparams: dict, rows: StepRows, dpool, ctx: DraftContext):
        """-> (tree, q f32[B, S, V] for chain sampling else None, a capped ``VerifyPrefix`` under a
        confidence threshold else None (the whole block is verified), dpool)."""
        draft, shape = plan.draft, shape_for(plan)
        S = plan.spec.num_steps
        Q = draft.block_length(S)
        B = rows.bonus.shape[0]
        mask = jnp.full((B, Q - 1), draft.mask_token_id, jnp.int32)
        tokens = jnp.concatenate([rows.bonus[:, None], mask], axis=1)  # [B, Q]
        positions = rows.seq_lens[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]
        write = jnp.where(rows.active[:, None], positions, -1)
        attn = AttentionInputs.build(ctx.page_table, rows.seq_lens, write, plan.page_size)
        with jax.named_scope("draft_block"):
            block, dpool = draft.block_forward(dparams, tokens, positions, dpool, attn,
                                               implementation=plan.implementation)  # [B, Q, H]
        hidden = draft.proposal_hidden(block)
        if plan.draft_samples:
            u = uniforms(sub_keys(rows.keys, KEY_SEED), (S,))  # [B, S]
            drafted, q = draft.sample_path(dparams, hidden, rows.bonus, *rows.sampling, u, filtering=plan.filtering,
                                           grammar=rows.grammar)
            tree, path = shape.build_block(rows.bonus, drafted[:, :, None], None, plan), drafted
        else:
            cand, probs = draft.candidates(dparams, hidden, rows.bonus, shape.block_width(plan),
                                           grammar=rows.grammar)  # [B, S, k]
            tree, path, q = shape.build_block(rows.bonus, cand, probs, plan), cand[:, :, 0], None
        prefix = None
        if plan.spec.confidence_threshold is not None:
            prefix = confident_prefix(draft.confidence(dparams, block, rows.bonus, path),
                                      plan.spec.confidence_threshold)
        return tree, q, prefix, dpool

    @staticmethod
    def feature(plan: Plan, out):
        return plan.draft.target_feature(out)

    @staticmethod
    def extend(plan: Plan, dparams: dict, rows: StepRows, predict, feature, accept_lens, dpool, ctx: DraftContext):
        """Context K/V for the A front rows at positions seq_len + i: the root and the accepted
        drafts are the first ``accept_lens``; the rest sit past the new committed length and are
        overwritten before anything reads them.

        predict: i32[B, A] accepted tokens then the bonus; feature: [B, A, F] the target's features at
        those positions. The draft's extend gets both: the token at each position (the root,
        then ``predict``'s) and its feature. Returns (bonus i32[B], seed, dpool)."""
        B, A = predict.shape
        positions = rows.seq_lens[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]
        tokens = jnp.concatenate([rows.bonus[:, None], predict[:, :-1]], axis=1)  # [B, A] the token at each position
        write = jnp.where(rows.active[:, None], positions, -1)
        attn = AttentionInputs.build(ctx.page_table, rows.seq_lens, write, plan.page_size)
        _, dpool = plan.draft.extend(dparams, tokens, feature, positions, dpool, attn, ctx,
                                     implementation=plan.implementation)
        bonus = jnp.take_along_axis(predict, (accept_lens - 1)[:, None], axis=1)[:, 0]
        return bonus, rows.seed, dpool

    @staticmethod
    def prefill(plan: Plan, dparams: dict, tokens, lens, first, out, dpool, ctx: DraftContext, seed: DraftSeed):
        """Context K/V of R new prompts (tokens i32[R, T], lens i32[R]) from the target's
        prefill features; returns (seed, dpool)."""
        R, T = tokens.shape  # from position ctx.seq_lens on (the positions before are in cached pages)
        col = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
        pos = ctx.seq_lens[:, None] + col
        write = jnp.where(col < lens[:, None], pos, -1)
        attn = AttentionInputs.build(ctx.page_table, ctx.seq_lens, write, plan.page_size)
        _, dpool = plan.draft.extend(dparams, tokens, plan.draft.target_feature(out), pos, dpool, attn, ctx,
                                     implementation=plan.implementation)
        return seed, dpool


def verify_sizes(num_steps: int) -> tuple[int, ...]:
    """Verify lengths (root included) compiled for confidence-scheduled chains: the root alone,
    powers of two and the whole chain (a few branches rather than one per length)."""
    sizes, m = {1, num_steps + 1}, 2
    while m < num_steps + 1:
        sizes.add(m)
        m *= 2
    return tuple(sorted(sizes))


def confident_prefix(confidence: jax.Array, threshold: float) -> VerifyPrefix:
    """confidence: f32[B, S] each proposal's predicted acceptance given those before it. A row
    wants its leading proposals whose predicted run (the running product) is >= ``threshold``,
    and accepts nothing past them."""
    run = jnp.cumprod(confidence, axis=1)  # [B, S]: predicted probability that the first j+1 are all accepted
    keep = jnp.sum(run >= threshold, axis=1)  # the run only falls, so this is a leading count
    return VerifyPrefix(wanted=(1 + keep).astype(jnp.int32), sizes=verify_sizes(confidence.shape[1]), cap=True)
