"""One speculative step, as pure functions over immutable pools:

    propose   the draft loop -> a verify tree (a root alone, a chain, or a tree)
    verify    one target forward over the tree's n nodes
    accept    greedy tree walk (exact), or speculative sampling
    compact   the accepted path's KV and outputs to the front (trees only)
    extend    the draft over the accepted rows -> the next bonus token and draft seed

Which draft loop (``proposers``) and which tree shape (``shape``) is decided once per plan;
nothing here asks which draft kind is running. The engine commits the returned tokens.

A draft loop whose proposals vary in length (n-gram lookup, a DSpark block cut by its confidence
head) says how many leading nodes of its tree each row wants verified (``VerifyPrefix``); a
``lax.switch`` verifies the shortest of a few precompiled prefixes that covers every active row,
padded to the full step's output shapes (with ``cap``, each row accepts nothing past its own count). When
no active row drafted, that is the root alone: one token, as plain decoding does. Loops that always
draft the whole tree compile no switch.

Glossary: B rows, S num_steps, n num_draft_tokens, A = S + 1 (more when a grafted n-gram branch
is deeper: ``SpecConfig.max_accept``), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.plan import Plan, StepRows
from jaxspec.spec.proposers import proposer_for
from jaxspec.spec.shape import Root, shape_for
from jaxspec.spec.verify import emitted_tokens
from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.sampling.controls import TokenLogprobs, apply_controls, token_logprobs
from jaxspec.model.drafts.base import DraftContext, DraftSeed
from jaxspec.sampling.grammar_masks import allowed_prefix, node_states
from jaxspec.model.targets import target_commit, target_forward, target_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """emitted: i32[B, A] accepted tokens then the bonus (valid up to accept_lens);
    accept_lens: i32[B] tokens emitted (accepted drafts + 1); bonus: i32[B] the root of the
    next step; seed: the draft's seed for the next step; verified: i32[B] nodes verified for each
    row (root included; its own count when a capped prefix limits it); logprobs: the emitted
    tokens' raw log-probabilities ([B, A], top [B, A, k]) or None when the plan reports none."""

    emitted: jax.Array
    accept_lens: jax.Array
    bonus: jax.Array
    seed: DraftSeed
    verified: jax.Array
    logprobs: TokenLogprobs | None = None


def target_verify(plan: Plan, tparams: dict, rows: StepRows, tree, tpool, page_table: jax.Array, *, shape=None):
    """One target forward over the tree's n nodes; KV written at seq_len + i, RoPE at
    seq_len + depth, attention masked as ``shape`` (default: the plan's) verifies.
    Returns (logits f32[B, n, V], the ``ForwardOutput``, the target pool)."""
    n = tree.tokens.shape[1]
    node = jnp.arange(n, dtype=jnp.int32)[None, :]
    write = jnp.where(rows.active[:, None], rows.seq_lens[:, None] + node, -1)
    shape = shape_for(plan) if shape is None else shape
    attn = AttentionInputs.build(page_table, rows.seq_lens, write, plan.page_size, block_mask=shape.verify_mask(tree),
                                 pending=True)
    positions = rows.seq_lens[:, None] + tree.depth
    out = target_forward(plan.target, tparams, tree.tokens, positions, tpool, attn,
                         aux_layers=plan.aux_layers, implementation=plan.implementation, exact=plan.exact)
    return target_logits(plan.target, tparams, out.hidden, exact=plan.exact), out, out.pool


def verify_and_accept(plan: Plan, shape, tparams, rows: StepRows, tree, q_all, tpool, page_table, feature_of,
                      limit=None):
    """verify -> accept -> compact under ``shape``. Every node is judged by its logits masked by
    its own structured-output state, then processed with the row's controls over its own path;
    ``limit`` (i32[B] or None) caps each row's proposed nodes.
    Returns (accept_lens i32[B], predict i32[B, a] emitted tokens front-compacted, the draft's
    feature [B, a, F] or None, the emitted tokens' raw ``TokenLogprobs`` [B, a] or None, tpool);
    a = 1 for the root alone, else S + 1."""
    logits, out, tpool = target_verify(plan, tparams, rows, tree, tpool, page_table, shape=shape)
    # The grammar mask comes first (as vLLM applies its bitmask): every node with its own state.
    logits = rows.grammar.mask(logits, node_states(rows.grammar, tree.tokens, tree.parent, plan.spec_depth))
    processed = apply_controls(logits, rows.controls, tree.tokens, tree.mask)
    accept_index, accept_lens, predict = shape.accept(plan, rows, tree, processed, q_all, limit)
    # Recurrent state (linear-attention layers): the accepted path's end state, nothing of the rest.
    tpool = target_commit(plan.target, tpool, out.pending, accept_index, accept_lens, rows.active)
    logprobs = None
    if plan.logprobs is not None:  # from the raw (grammar-masked) logits of the nodes each emitted token follows
        node = jnp.maximum(accept_index, 0)  # [B, a]
        logprobs = token_logprobs(jnp.take_along_axis(logits, node[:, :, None], axis=1),
                                  emitted_tokens(predict, accept_index), plan.logprobs, exact=plan.exact)
    tpool, predict, feature = shape.compact(plan, tpool, page_table, rows, accept_index, accept_lens, predict,
                                            feature_of(out))
    return accept_lens, predict, feature, logprobs, tpool


def _pad_rows(x, rows: int):  # every leaf [B, a, ...] -> [B, rows, ...] (None stays None)
    return jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), x)


def spec_step(plan: Plan, tparams, dparams, rows: StepRows, tpool, dpool, page_table: jax.Array):
    """propose -> verify -> accept -> compact -> extend for every row; returns
    (StepOutput, target pool, draft pool)."""
    proposer, shape = proposer_for(plan), shape_for(plan)
    tree, q_all, prefix, dpool = proposer.propose(plan, dparams, rows, dpool,
                                                  DraftContext(page_table, rows.seq_lens, tpool))
    feature_of = functools.partial(proposer.feature, plan)

    def verify_first(m: int, limit, tpool):
        """verify -> accept -> compact over the tree's first m nodes (m = 1: the root alone, as
        plain decoding), each row's acceptance capped at its ``limit`` nodes, outputs padded to
        the full step's shapes."""
        if m == 1:
            sub_shape, sub_tree, sub_q = Root, Root.build(rows.bonus, None, plan), None
        else:
            sub_shape, sub_tree = shape, tree_lib.truncate(tree, m)
            sub_q = None if q_all is None else q_all[:, : m - 1]
        accept_lens, *outs, tpool = verify_and_accept(plan, sub_shape, tparams, rows, sub_tree, sub_q, tpool,
                                                      page_table, feature_of, limit)
        verified = jnp.full_like(accept_lens, m) if limit is None else jnp.minimum(limit, m)
        return accept_lens, verified, *(_pad_rows(x, plan.max_accept) for x in outs), tpool

    if prefix is not None and not plan.verify_branches:  # the longest only (``verify_branches_on``)
        prefix = dataclasses.replace(prefix, sizes=prefix.sizes[-1:])
    if prefix is not None and rows.grammar.enabled:  # nodes the grammar rules out are not worth verifying
        allowed = allowed_prefix(rows.grammar, tree.tokens, tree.parent, plan.spec_depth)
        prefix = dataclasses.replace(prefix, wanted=jnp.minimum(prefix.wanted, allowed))
    if prefix is None:
        accept_lens, predict, feature, logprobs, tpool = verify_and_accept(plan, shape, tparams, rows, tree, q_all,
                                                                           tpool, page_table, feature_of)
        verified = jnp.full_like(accept_lens, tree.tokens.shape[1])
    else:
        need = jnp.max(jnp.where(rows.active, prefix.wanted, 1))
        branch = jnp.sum(jnp.asarray(prefix.sizes[:-1], jnp.int32) < need)  # the smallest size >= need
        branches = [functools.partial(verify_first, m) for m in prefix.sizes]
        limit = prefix.wanted if prefix.cap else None
        if limit is None and not plan.greedy_only:
            # A sampled row accepts only what it proposed for itself: nodes verified for another
            # row would change which of its drafts it tests, so its tokens for a seed would depend
            # on its neighbours. Greedy rows keep them (their output is the argmax path anyway).
            limit = jnp.where(rows.sampling.greedy, prefix.sizes[-1], prefix.wanted)
        accept_lens, verified, predict, feature, logprobs, tpool = jax.lax.switch(branch, branches, limit, tpool)
    bonus, seed, dpool = proposer.extend(plan, dparams, rows, predict, feature, accept_lens, dpool,
                                         DraftContext(page_table, rows.seq_lens, tpool))
    return StepOutput(emitted=predict, accept_lens=accept_lens, bonus=bonus, seed=seed, verified=verified,
                      logprobs=logprobs), tpool, dpool
