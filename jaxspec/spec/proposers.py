"""Draft loops, one per way of proposing, chosen by the draft's declared ``proposer``.

A proposer has four static methods, called by ``jaxspec.spec.step`` and the engine's prefill:
``propose`` (-> verify tree, sampling q, how much of the tree to verify, draft pool), ``feature``
(what it takes from the target's verify forward), ``extend`` (-> next bonus token and draft
seed) and ``prefill``. ``propose`` returns a ``VerifyPrefix`` when its proposals vary in length
(the step then verifies the shortest precompiled prefix of the tree that every active row needs:
the root alone when none drafted), or None when the whole tree is always verified (no branch is
compiled).
"""

from __future__ import annotations

from jaxspec.spec.graft_loop import Hybrid
from jaxspec.spec.lookup_loop import Lookup
from jaxspec.spec.block_loop import Block
from jaxspec.spec.plan import Plan, StepRows
from jaxspec.spec.recurrent_loop import Recurrent
from jaxspec.spec.shape import Root
from jaxspec.model.drafts.base import DraftContext, DraftSeed


class NoDraft:
    """Plain decoding through the same step: the tree is the root alone."""

    @staticmethod
    def propose(plan: Plan, dparams, rows: StepRows, dpool, ctx: DraftContext):
        return Root.build(rows.bonus, None, plan), None, None, dpool

    @staticmethod
    def feature(plan: Plan, out):
        return None

    @staticmethod
    def extend(plan: Plan, dparams, rows: StepRows, predict, feature, accept_lens, dpool, ctx: DraftContext):
        return predict[:, 0], rows.seed, dpool

    @staticmethod
    def prefill(plan: Plan, dparams, tokens, lens, first, out, dpool, ctx: DraftContext, seed: DraftSeed):
        return seed, dpool


PROPOSERS = {"recurrent": Recurrent, "lookup": Lookup, "hybrid": Hybrid, "block": Block}


def proposer_for(plan: Plan):
    """The draft loop of ``plan.draft`` (``NoDraft`` for plain decoding)."""
    if plan.draft is None:
        return NoDraft
    try:
        return PROPOSERS[plan.draft.proposer]
    except KeyError:
        raise ValueError(f"draft kind {plan.draft.kind!r} asks for an unknown proposer {plan.draft.proposer!r}") from None
