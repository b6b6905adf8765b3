"""One speculative step, as pure functions over immutable pools:

    propose   the draft loop -> a verify tree (a root alone, a chain, or a tree)
    verify    one target forward over the tree's n nodes
    accept    greedy tree walk (exact), or speculative sampling
    compact   the accepted path's KV and outputs to the front (trees only)
    extend    the draft over the accepted rows -> the next bonus token and draft seed

Which draft loop (``proposers``) and which tree shape (``shape``) is decided once per plan;
nothing here asks which draft kind is running. The engine commits the returned tokens.

Glossary: B rows, S num_steps, n num_draft_tokens, A = S + 1, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.draft.plan import Plan, StepRows
from jaxspec.draft.proposers import proposer_for
from jaxspec.draft.shape import shape_for
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.model.targets import target_forward, target_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """emitted: i32[B, A] accepted tokens then the bonus (valid up to accept_lens);
    accept_lens: i32[B] tokens emitted (accepted drafts + 1); bonus: i32[B] the root of the
    next step; seed: the draft's seed for the next step."""

    emitted: jax.Array
    accept_lens: jax.Array
    bonus: jax.Array
    seed: DraftSeed


def target_verify(plan: Plan, tparams: dict, rows: StepRows, tree, tpool, page_table: jax.Array):
    """One target forward over the tree; KV written at seq_len + i, RoPE at seq_len + depth.
    Returns (logits f32[B, n, V], the ``ForwardOutput``, the target pool)."""
    n = plan.num_verify
    node = jnp.arange(n, dtype=jnp.int32)[None, :]
    write = jnp.where(rows.active[:, None], rows.seq_lens[:, None] + node, -1)
    attn = AttentionInputs.build(page_table, rows.seq_lens, write, plan.page_size,
                                 block_mask=shape_for(plan).verify_mask(tree))
    positions = rows.seq_lens[:, None] + tree.depth
    out = target_forward(plan.target, tparams, tree.tokens, positions, tpool, attn,
                         aux_layers=plan.aux_layers, implementation=plan.implementation)
    return target_logits(plan.target, tparams, out.hidden), out, out.pool


def spec_step(plan: Plan, tparams, dparams, rows: StepRows, tpool, dpool, page_table: jax.Array):
    """propose -> verify -> accept -> compact -> extend for every row; returns
    (StepOutput, target pool, draft pool)."""
    proposer, shape = proposer_for(plan), shape_for(plan)
    tree, q_all, dpool = proposer.propose(plan, dparams, rows, dpool, DraftContext(page_table, rows.seq_lens, tpool))
    logits, out, tpool = target_verify(plan, tparams, rows, tree, tpool, page_table)
    accept_index, accept_lens, predict = shape.accept(plan, rows, tree, logits, q_all)
    tpool, predict, feature = shape.compact(plan, tpool, page_table, rows, accept_index, accept_lens, predict,
                                            proposer.feature(plan, out))
    bonus, seed, dpool = proposer.extend(plan, dparams, rows, predict, feature, accept_lens, dpool,
                                         DraftContext(page_table, rows.seq_lens, tpool))
    return StepOutput(emitted=predict, accept_lens=accept_lens, bonus=bonus, seed=seed), tpool, dpool
