"""The recurrent draft loop: a draft proposes token by token (EAGLE, EAGLE-3, DeepSeek MTP, the
frozen-KV assistant, standalone LMs), as a chain or as SGLang's dynamic tree.

    prefill   the draft over the prompt with the target's features -> the first seed
    propose   root (the seed, or the root forward of a frozen-KV assistant: iteration 0 of the
              loop), then S - 1 draft forwards on the frontier -> the verify tree
    extend    the draft over the accepted rows -> the next seed (one fused gather of the extras,
              ``jaxspec.pallas.gather_extras``)

Draft scratch KV for branch ``j``, step ``i`` sits at position ``base + j*S + i``
(``jaxspec.kvcache.layout``); the frontier of a tree attends to the prefix and its own
ancestors (an exact ancestor mask, ``jaxspec.spec.shape``).

Glossary: B rows, K topk, S num_steps, A = S + 1, R prefilled rows, T prompt bucket,
Hd draft hidden width, V target vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.plan import KEY_DRAFT_STEP, KEY_SEED, Plan, StepRows, sub_keys
from jaxspec.spec.shape import shape_for
from jaxspec.kvcache.layout import draft_scratch_positions, per_step_draft_locs
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.sampling.controls import Controls, steer
from jaxspec.model.config import padded_vocab_size
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.sampling.grammar_masks import Grammar
from jaxspec.model.layers import mask_padded_vocab
from jaxspec.sampling.distributions import sample_categorical, target_probs
from jaxspec.pallas.gather_extras import gather_spec_extras


def draft_distribution(plan: Plan, dparams: dict, logit_in: jax.Array, rows: StepRows,
                       states: jax.Array) -> jax.Array:
    """q: the draft's sampling distribution over the TARGET vocabulary, f32[B, ..., V], with each
    row's temperature / top_k / top_p (one-hot argmax for greedy rows), over the tokens the
    structured-output ``states`` i32[B, ...] allow."""
    draft = plan.draft
    # As wide as the target's logits (a padded vocabulary on a mesh; -inf beyond the real one).
    logits = mask_padded_vocab(draft.target_vocab_logits(dparams, draft.logits(dparams, logit_in)),
                               plan.target.vocab_size, padded_vocab_size(plan.target))
    logits = steer(rows.grammar.mask(logits, states), rows.controls)
    return target_probs(logits, rows.sampling.broadcast(logits.shape[:-1]), plan.filtering, min_p=False)


def draft_topk(plan: Plan, dparams: dict, logit_in: jax.Array, k: int, controls: Controls | None = None,
               grammar: Grammar | None = None, states: jax.Array | None = None):
    """Top-k of the draft's softmax (over the tokens ``grammar`` allows after ``states`` i32[B, ...],
    steered by the rows' controls, when given): f32[B, ..., k] and i32[B, ..., k] target ids.
    k = 1 uses max/argmax (no top_k primitive)."""
    logits = plan.draft.logits(dparams, logit_in)
    steered = controls is not None and controls.enabled
    masked = grammar is not None and grammar.enabled
    if steered or masked:
        columns = plan.draft.to_target_ids(dparams, jnp.arange(logits.shape[-1], dtype=jnp.int32))
        if masked:
            logits = grammar.mask(logits, states, columns)
        if steered:
            logits = steer(logits, controls, columns)
    probs = jax.nn.softmax(logits, axis=-1)
    if k == 1:
        # The argmax of the logits, not of the softmax: a chain never reads p (its tree is the path),
        # so XLA drops the softmax's two reductions a step (four kernels on a GPU) with p.
        index = jnp.argmax(logits, axis=-1)[..., None]
        p = jnp.take_along_axis(probs, index, axis=-1)
    else:
        p, index = jax.lax.top_k(probs, k)
    return p, plan.draft.to_target_ids(dparams, index)


def _candidates(plan: Plan, dparams, logit_in, rows: StepRows, key_purpose: int, states: jax.Array):
    """The draft's next candidates from its output ``logit_in`` [B, R, *] (R frontier rows, in
    structured-output ``states`` i32[B, R]): greedy drafting takes the top-K; chain sampling draws
    one token x ~ q and keeps q. Returns (topk_p f32[B, R, K], topk_index i32[B, R, K], q f32[B, V]
    or None)."""
    if plan.draft_samples:
        q = draft_distribution(plan, dparams, logit_in[:, 0], rows, states[:, 0])  # [B, V]
        x = sample_categorical(q, sub_keys(rows.keys, key_purpose))
        return jnp.take_along_axis(q, x[:, None], axis=1)[:, :, None], x[:, None, None], q
    topk_p, topk_index = draft_topk(plan, dparams, logit_in, plan.topk, rows.controls, rows.grammar, states)
    return topk_p, topk_index, None


class Recurrent:
    """Drives any draft that proposes one token per forward."""

    @staticmethod
    def propose(plan: Plan, dparams: dict, rows: StepRows, dpool, ctx: DraftContext):
        """S levels of candidates -> (tree, q_all f32[B, S, V] for chain sampling else None, None (the
        whole tree is verified), dpool)."""
        draft, shape, spec = plan.draft, shape_for(plan), plan.spec
        K, S = spec.topk, spec.num_steps
        B = rows.bonus.shape[0]
        base = rows.seq_lens + draft.pos_offset  # [B] first draft-scratch position
        # Branch j, step i writes at base + j*S + i; step i uses row i of the [S, B*K] view.
        scratch = draft_scratch_positions(base, K, S)
        scratch = jnp.where(jnp.repeat(rows.active, K * S), scratch, -1)
        write_per_step = per_step_draft_locs(scratch, B, K, S)  # [S, B*K]

        dpool = draft.open_scratch(dpool, K * S)
        with jax.named_scope("draft_root"):  # a frozen-KV assistant's seed step runs here (iteration 0)
            hidden, logit_in = draft.root(dparams, rows.bonus, rows.seed, ctx, implementation=plan.implementation)
        grammar = rows.grammar
        topk_p, topk_index, q = _candidates(plan, dparams, logit_in[:, None], rows, KEY_SEED, grammar.state[:, None])
        topk_p, topk_index = topk_p[:, 0], topk_index[:, 0]  # [B, K]
        frontier = jnp.broadcast_to(grammar.state[:, None], (B, K))  # structured-output state of each frontier row
        q_levels = [q]  # chain sampling: q_j of each drafted token, [B, V]
        levels: list[tree_lib.DraftLevel] = []
        scores = None
        ancestors = jnp.zeros((B, K, S), jnp.int32)
        for i in range(S):
            ids, rows_hidden, scores, parent_row, level = tree_lib.select_top_k_tokens(
                i, K, topk_p, topk_index, hidden, scores
            )
            levels.append(level)
            if i == S - 1:
                break  # the last level needs no forward
            frontier = grammar.advance(jnp.take_along_axis(frontier, jnp.maximum(parent_row, 0), axis=1), ids)
            mask, ancestors = shape.draft_mask(ancestors, parent_row, i, S)
            attn = AttentionInputs.build(ctx.page_table, base, write_per_step[i].reshape(B, K), plan.page_size,
                                         block_mask=mask)
            positions = jnp.broadcast_to((base + i)[:, None], ids.shape)
            hidden, logit_in, dpool = draft.forward(dparams, ids, rows_hidden, positions, dpool, attn,
                                                    dataclasses.replace(ctx, step=i + 1), from_target=False,
                                                    implementation=plan.implementation)
            topk_p, topk_index, q = _candidates(plan, dparams, logit_in, rows, KEY_DRAFT_STEP + i, frontier)  # [B, K, K]
            q_levels.append(q)
        q_all = jnp.stack(q_levels, axis=1) if plan.draft_samples else None  # [B, S, V]
        return shape.build(rows.bonus, levels, plan), q_all, None, draft.close_scratch(dpool)

    @staticmethod
    def feature(plan: Plan, out):
        return plan.draft.target_feature(out)

    @staticmethod
    def extend(plan: Plan, dparams: dict, rows: StepRows, predict, feature, accept_lens, dpool, ctx: DraftContext):
        """Draft over the A accepted-front rows; row ``accept_len - 1`` seeds the next step.

        predict: i32[B, A] accepted tokens then the bonus, front-compacted; feature: [B, A, F].
        Returns (bonus i32[B], DraftSeed, dpool)."""
        draft = plan.draft
        B, A = predict.shape
        select = jnp.arange(B, dtype=jnp.int32) * A + accept_lens - 1
        base = rows.seq_lens + draft.pos_offset
        positions = base[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]
        # Rows past the accepted ones are not tokens of the request: nothing of theirs is written (a
        # draft with recurrent state must not advance over them; KV there would be rewritten anyway).
        accepted = jnp.arange(A, dtype=jnp.int32)[None, :] < accept_lens[:, None]
        write = jnp.where(rows.active[:, None] & accepted, positions, -1)
        attn = AttentionInputs.build(ctx.page_table, base, write, plan.page_size)
        h, dpool = draft.extend(dparams, predict, feature, positions, dpool, attn, ctx,
                                implementation=plan.implementation)  # [B, A, Hd]
        bonus, hidden = gather_spec_extras(select, predict.reshape(B * A), h.reshape(B * A, -1),
                                           implementation=plan.implementation)
        return bonus, DraftSeed(hidden=hidden.astype(rows.seed.hidden.dtype)), dpool  # [B], [B, Hd]

    @staticmethod
    def prefill(plan: Plan, dparams: dict, tokens, lens, first, out, dpool, ctx: DraftContext, seed: DraftSeed):
        """The draft over R new prompts (tokens i32[R, T] from position ``ctx.seq_lens`` on: the
        positions before are in cached pages; lens i32[R] of them, first token i32[R]) with the
        target's prefill output ``out``; returns (DraftSeed [R, Hd], dpool)."""
        draft = plan.draft
        R, T = tokens.shape
        off = draft.pos_offset  # row p consumes the token at p + 1 - off of prompt + first token
        full = tokens.at[jnp.arange(R), lens].set(first, mode="drop")
        dtok = jnp.pad(full[:, 1 - off:], ((0, 0), (0, 1 - off)))
        col = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (R, T))
        pos = ctx.seq_lens[:, None] + col
        write = jnp.where((col < (lens + off)[:, None]) & (lens > 0)[:, None], pos, -1)
        attn = AttentionInputs.build(ctx.page_table, ctx.seq_lens, write, plan.page_size,
                                     state_rows=ctx.state_rows)
        h, dpool = draft.extend(dparams, dtok, draft.target_feature(out), pos, dpool, attn, ctx,
                                implementation=plan.implementation)  # [R, T, Hd]
        sel = jnp.maximum(lens - 1 + off, 0)
        hidden = jnp.take_along_axis(h, sel[:, None, None], axis=1)[:, 0]
        return DraftSeed(hidden=hidden.astype(seed.hidden.dtype)), dpool
