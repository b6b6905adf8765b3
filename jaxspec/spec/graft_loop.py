"""The hybrid draft loop (``HybridDraft``): the model draft's own loop proposes its tree from
``num_draft_tokens - ngram_tokens`` nodes, and the n-gram continuation of the most recent
longest match (``jaxspec.spec.lookup_loop``) is grafted on as an extra branch from the root; one
target forward verifies both.

Grafting keeps siblings distinct (tree sampling needs it): where the continuation's first
tokens already form a path of the model's tree, its remaining tokens hang below that path, and
the slots of the shared prefix are detached. Branch token i sits at depth i + 1 either way; the
step accepts down to max(num_steps, G), so the branch may reach deeper than the model's tree.

Glossary: B rows, n num_draft_tokens, G ngram_tokens, nb = n - G model-tree nodes (root
included), S num_steps, A = max(S, G) + 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.spec import tree as tree_lib
from jaxspec.spec.lookup_loop import append_emitted, ngram_paths, prefix_for, prompt_history, whole_context
from jaxspec.spec.plan import Plan, StepRows
from jaxspec.spec.recurrent_loop import Recurrent
from jaxspec.model.drafts.base import DraftContext
from jaxspec.model.drafts.ngram import HybridSeed, NgramSeed

# The model-draft loops a hybrid grafts onto (``proposers.PROPOSERS`` imports this module).
MODEL_PROPOSERS = {"recurrent": Recurrent}


def graft(
    tree: tree_lib.Tree,  # the model draft's tree, nb nodes
    branch: jax.Array,  # i32[B, G] n-gram continuation
    found: jax.Array,  # bool[B] the row has one
    max_depth: int,  # the deepest node: max(S, G)
) -> tree_lib.Tree:  # n = nb + G nodes
    """Appends the branch as nodes nb .. nb + G - 1 below the deepest node of ``tree`` on the
    path its first tokens spell (the root when its first token is no child of the root)."""
    B, nb = tree.tokens.shape
    G = branch.shape[1]
    idx = jnp.arange(nb, dtype=jnp.int32)[None, :]
    at = jnp.zeros((B,), jnp.int32)  # the model-tree node the branch hangs from
    shared = jnp.zeros((B,), jnp.int32)  # leading branch tokens already on the model's tree
    on_path = jnp.ones((B,), bool)
    for i in range(G):
        child = (tree.parent == at[:, None]) & (tree.tokens == branch[:, i:i + 1]) & (idx > 0)  # [B, nb]
        on_path = on_path & jnp.any(child, axis=1)
        at = jnp.where(on_path, jnp.argmax(child, axis=1).astype(jnp.int32), at)
        shared = shared + on_path
    # ``at`` is ``shared`` levels deep, so branch token i lands at depth i + 1 <= G.
    i = jnp.arange(G, dtype=jnp.int32)[None, :]
    parent = jnp.where(i == shared[:, None], at[:, None], nb + i - 1)  # [B, G]
    parent = jnp.where(found[:, None] & (i >= shared[:, None]), parent, tree_lib.DETACHED)
    tokens = jnp.concatenate([tree.tokens, branch.astype(jnp.int32)], axis=1)
    return tree_lib.link_tree(tokens, jnp.concatenate([tree.parent, parent], axis=1), max_depth)


def model_plan(plan: Plan) -> Plan:
    """The plan the model draft's own loop runs under: its part of the spec, and top-k drafting
    even at temperature > 0 (a hybrid verifies as a tree, with target-only sampling)."""
    return dataclasses.replace(plan, draft=plan.draft.model, spec=plan.spec.model_spec, greedy_only=True)


def _model_proposer(plan: Plan):
    name = plan.draft.model.proposer
    if name not in MODEL_PROPOSERS:
        raise ValueError(f"a hybrid draft grafts onto a model draft's tree; {plan.draft.model.kind!r} drafts with {name!r}")
    return MODEL_PROPOSERS[name]


def _model_rows(rows: StepRows) -> StepRows:
    return dataclasses.replace(rows, seed=rows.seed.base)


class Hybrid:
    """Drives ``HybridDraft``: the model draft's loop plus one grafted n-gram branch."""

    @staticmethod
    def propose(plan: Plan, dparams, rows: StepRows, dpool, ctx: DraftContext):
        """-> (tree of n nodes, None, VerifyPrefix (the model's tree and as much of the branch as
        its match length asks for; None when not adaptive: all n), dpool)."""
        inner, cfg = model_plan(plan), plan.draft.ngram.model
        tree, _, _, dpool = _model_proposer(plan).propose(inner, dparams, _model_rows(rows), dpool, ctx)
        G = plan.spec.ngram_tokens
        (branch,), match = ngram_paths(cfg, rows.seed.ngram.history, rows.seq_lens + 1, (G,))
        nb = tree.tokens.shape[1]
        prefix = prefix_for(cfg, match[:, 0], nb, G) if cfg.adaptive else None
        return graft(tree, branch, match[:, 0] > 0, plan.spec.depth), None, prefix, dpool

    @staticmethod
    def feature(plan: Plan, out):
        return _model_proposer(plan).feature(model_plan(plan), out)

    @staticmethod
    def extend(plan: Plan, dparams, rows: StepRows, predict, feature, accept_lens, dpool, ctx: DraftContext):
        bonus, base, dpool = _model_proposer(plan).extend(model_plan(plan), dparams, _model_rows(rows), predict,
                                                          feature, accept_lens, dpool, ctx)
        history = append_emitted(rows.seed.ngram.history, rows.seq_lens, predict, accept_lens)
        return bonus, HybridSeed(base=base, ngram=NgramSeed(history)), dpool

    @staticmethod
    def prefill(plan: Plan, dparams, tokens, lens, first, out, dpool, ctx: DraftContext, seed: HybridSeed):
        base, dpool = _model_proposer(plan).prefill(model_plan(plan), dparams, tokens, lens, first, out, dpool, ctx,
                                                    seed.base)
        history = prompt_history(seed.ngram.history, *whole_context(tokens, lens, ctx), first)
        return HybridSeed(base=base, ngram=NgramSeed(history)), dpool
