"""The block draft loop: one draft forward proposes a whole block (DFlash, DFlash 2, DSpark,
P-EAGLE, PARD).

    prefill   the prompt's tokens and the target's features -> the draft's context KV at
              positions [0, len)
    propose   one block forward over [bonus, mask x (Q - 1)] at positions seq_len .. seq_len + Q - 1
              -> the S proposals of a chain, or a tree (the chain plus alternatives per position,
              ``shape.build_block``); chain sampling draws every proposal from its q. Q is the
              draft's ``block_length(S)``: S + 1 when the anchor slot drafts nothing (DFlash), S
              when it drafts too (DSpark's ``sample_from_anchor``, PARD), S - 1 when the first proposal
              comes from the seed (P-EAGLE: its block is mask rows only, none when S = 1). With
              ``SpecConfig.confidence_threshold`` the draft's confidence head also says how many
              of its proposals each row wants verified (a capped ``VerifyPrefix``)
    extend    the accepted rows (row j: the target's features at seq_len + j, and a token: the one
              after it for a feature-level draft, its own for a token-level LM, ``pos_offset``)
              -> context KV at [seq_len, seq_len + accept_len), and for a ``seeded`` draft the
              seed: its output at the last accepted row (the one that consumed the bonus)

The draft's pool holds the context K/V of every committed position (from the target's features
for DFlash / DSpark / P-EAGLE, from the tokens themselves for a PARD LM). The block's own K/V
are written at the positions the block occupies (``seq_len + j``, the same slots the verify tree
uses) and overwritten by the next extend, so nothing carries between steps but the pool (and a
seeded draft's seed). Any draft with ``proposer = "block"`` runs here: it implements
``mask_token_id``, ``block_length``, ``block_forward`` (tokens -> hidden), ``seeded``,
``proposal_hidden`` (what its proposals read of the block and the seed), ``candidates`` (greedy
proposals and alternatives), ``sample_path`` and, with a confidence head, ``confidence``.

Glossary: B rows, S = num_steps proposals, Q block tokens, k = topk, A = S + 1,
R prefilled rows, T prompt bucket, F target feature width, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.spec.plan import KEY_SEED, Plan, StepRows, VerifyPrefix, sub_keys
from jaxspec.spec.shape import shape_for
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.sampling.distributions import uniforms


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
        block = None  # Q = 0: every proposal comes from the seed
        if Q:
            mask = jnp.full((B, Q - 1), draft.mask_token_id, jnp.int32)
            tokens = jnp.concatenate([rows.bonus[:, None], mask], axis=1)  # [B, Q]
            positions = rows.seq_lens[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]
            write = jnp.where(rows.active[:, None], positions, -1)
            attn = AttentionInputs.build(ctx.page_table, rows.seq_lens, write, plan.page_size)
            with jax.named_scope("draft_block"):
                block, dpool = draft.block_forward(dparams, tokens, positions, dpool, attn,
                                                   implementation=plan.implementation)  # [B, Q, H]
        hidden = draft.proposal_hidden(block, rows.seed)  # [B, S (or Q), H]
        if plan.draft_samples:
            u = uniforms(sub_keys(rows.keys, KEY_SEED), (S,))  # [B, S]
            drafted, q = draft.sample_path(dparams, hidden, rows.bonus, rows.sampling, u, filtering=plan.filtering,
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
        """Context K/V for the A front rows at positions seq_len + j (the root and the accepted
        drafts are the first ``accept_lens``; the rest sit past the new committed length and are
        overwritten before anything reads them).

        predict: i32[B, A] accepted tokens then the bonus; feature: [B, A, F] the target's features at
        those positions. Row j's token is the one after it (``predict``) for a feature-level draft,
        its own (the root, then ``predict``'s) for a token-level LM. Returns (bonus i32[B], seed, dpool)."""
        B, A = predict.shape
        positions = rows.seq_lens[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]
        if plan.draft.pos_offset:
            predict_in = jnp.concatenate([rows.bonus[:, None], predict[:, :-1]], axis=1)  # [B, A]
        else:
            predict_in = predict
        write = jnp.where(rows.active[:, None], positions, -1)
        attn = AttentionInputs.build(ctx.page_table, rows.seq_lens, write, plan.page_size)
        h, dpool = plan.draft.extend(dparams, predict_in, feature, positions, dpool, attn, ctx,
                                     implementation=plan.implementation)  # [B, A, H]
        bonus = jnp.take_along_axis(predict, (accept_lens - 1)[:, None], axis=1)[:, 0]
        return bonus, next_seed(plan.draft, rows.seed, h, accept_lens - 1), dpool

    @staticmethod
    def prefill(plan: Plan, dparams: dict, tokens, lens, first, out, dpool, ctx: DraftContext, seed: DraftSeed):
        """Context K/V of R new prompts (tokens i32[R, T], lens i32[R], the first generated token
        first i32[R]) from the target's prefill features; returns (seed, dpool). Row p reads the
        token at p + 1 (the last one reads ``first``) or, for a token-level LM, its own, as the
        extend's rows do."""
        R, T = tokens.shape  # from position ctx.seq_lens on (the positions before are in cached pages)
        after = tokens if plan.draft.pos_offset else jnp.pad(
            tokens.at[jnp.arange(R), lens].set(first, mode="drop")[:, 1:], ((0, 0), (0, 1)))
        col = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
        pos = ctx.seq_lens[:, None] + col
        write = jnp.where(col < lens[:, None], pos, -1)
        attn = AttentionInputs.build(ctx.page_table, ctx.seq_lens, write, plan.page_size)
        h, dpool = plan.draft.extend(dparams, after, plan.draft.target_feature(out), pos, dpool, attn, ctx,
                                     implementation=plan.implementation)  # [R, T, H]
        return next_seed(plan.draft, seed, h, jnp.maximum(lens - 1, 0)), dpool


def next_seed(draft, seed: DraftSeed, hidden: jax.Array, last: jax.Array) -> DraftSeed:
    """The seed of the next block: a ``seeded`` draft's extend output ``hidden`` [B, T, H] at each
    row's last real row ``last`` i32[B] (P-EAGLE's first proposal reads it); any other draft's
    seed as it is (DFlash's context lives in its pool)."""
    if not draft.seeded:
        return seed
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return DraftSeed(hidden=h.astype(seed.hidden.dtype))


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
