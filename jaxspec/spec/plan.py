"""What one speculative step is given: the static ``Plan`` (jit-static, hashable) and the
per-row ``StepRows`` (arrays), plus the PRNG sub-streams a step draws from.

Glossary: B batch rows, K = topk, S = num_steps, n = num_draft_tokens, Hd draft hidden width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxspec.config import SpecConfig
from jaxspec.sampling.controls import Controls
from jaxspec.sampling.distributions import RowSampling
from jaxspec.model.drafts.base import DraftSeed
from jaxspec.sampling.grammar_masks import Grammar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about a decode: hashable, passed to ``jax.jit`` as a static arg.

    target: the target's model config. draft: the draft kind (a ``Draft``) or None (plain
    decoding, a one-node verify per step). greedy_only: no row samples, so the sampling
    machinery is compiled out. filtering: some sampled row uses top_k or top_p (else their
    sorts are compiled out). controls: some row uses a logit bias or a penalty (else the
    processing is compiled out). logprobs: top log-probabilities computed per emitted token
    (0: none are reported). implementation: kernels ("pallas" | "xla" | None | a per-op
    mapping). data_shards: shards of a mesh's data axis the rows and pool slots are split over.
    compiler_options: the XLA options the engine's programs compile with, resolved for their
    backend: sorted (name, value) pairs (``jaxspec.xla_options``; empty: XLA's defaults). exact: the
    target's rows computed with fixed reduction orders (``EngineConfig.exact``). verify_branches: a
    draft loop whose proposals vary in length (n-gram, hybrid, confidence-scheduled chains: a
    ``VerifyPrefix``) compiles one verify per size and switches among them at run time; False: it
    verifies the longest every step (``verify_branches_on`` decides per backend).
    """

    target: Any
    draft: Any = None
    spec: SpecConfig | None = None
    page_size: int = 16
    steps_per_call: int = 8
    greedy_only: bool = True
    filtering: bool = False
    controls: bool = False
    logprobs: int | None = None
    implementation: Any = None
    data_shards: int = 1
    compiler_options: tuple[tuple[str, Any], ...] = ()
    exact: bool = False
    verify_branches: bool = True

    def __post_init__(self):
        if (self.draft is None) != (self.spec is None):
            raise ValueError("a draft needs a SpecConfig and a SpecConfig needs a draft")

    @property
    def num_verify(self) -> int:
        """n: tokens verified per step (1 for plain decoding)."""
        return 1 if self.spec is None else self.spec.num_draft_tokens

    @property
    def topk(self) -> int:
        return 1 if self.spec is None else self.spec.topk

    @property
    def max_accept(self) -> int:
        return 1 if self.spec is None else self.spec.max_accept

    @property
    def spec_depth(self) -> int:
        """The deepest verify node (0 for plain decoding: the root alone)."""
        return 0 if self.spec is None else self.spec.depth

    @property
    def draft_samples(self) -> bool:
        """Chains at temperature > 0 draw their draft tokens from the draft distribution q
        and keep q for rejection sampling."""
        return self.spec is not None and not self.greedy_only and self.spec.uses_rejection_sampling

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose input residual streams the draft consumes (EAGLE-3 taps)."""
        return self.draft.aux_layers if self.draft is not None and self.draft.feature == "aux" else ()

    @property
    def lookahead(self) -> int:
        """Positions past the committed length a step may touch (verify block, draft
        scratch, extend rows)."""
        if self.spec is None:
            return 1
        off = self.draft.pos_offset
        return max(self.spec.num_draft_tokens + off, off + self.spec.topk * self.spec.num_steps) + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepRows:
    """The per-row inputs of one speculative step.

    seq_lens: i32[B] committed KV positions (the root token is not yet in the KV).
    bonus: i32[B] root of this step's tree = the last emitted token.
    active: bool[B] rows that generate.
    sampling: each row's sampling settings (``RowSampling``, every field [B]).
    controls: logit bias, penalties and the token counts they read (``Controls``).
    keys: key[B] this step's PRNG key of each row (split further with ``sub_keys``).
    seed: the draft's seed from the previous step's extend (or the prefill).
    grammar: each row's structured-output automaton state (after the root), the call's automata
      and the rows' stop ids (``Grammar``; disabled when no request is constrained).
    """

    seq_lens: jax.Array
    bonus: jax.Array
    active: jax.Array
    sampling: RowSampling
    controls: Controls
    keys: jax.Array
    seed: DraftSeed
    grammar: Grammar


@dataclasses.dataclass(frozen=True)
class VerifyPrefix:
    """How much of its tree a proposal needs verified, for draft loops whose proposals vary in
    length (n-gram lookup): the step verifies the first ``m`` nodes, ``m`` the smallest of
    ``sizes`` covering ``wanted`` of every active row (tree nodes are numbered so that parents
    come before children, so a prefix is a tree).

    wanted: i32[B] leading nodes each row wants verified (1: the root alone, it drafted nothing).
    sizes: static, ascending, at most n, the largest covering every ``wanted``; each size is its
      own compiled branch.
    cap: static; True: a row accepts nothing past its ``wanted`` nodes even when the step verifies
      more for another row (its length is a per-request decision: DSpark's confidence head);
      False: nodes past it are still proposals and a greedy row may accept them (an n-gram branch
      continues past the length its match earned); a sampled row stops at its ``wanted`` either
      way, so its tokens for a seed do not depend on its neighbours.
    """

    wanted: jax.Array
    sizes: tuple[int, ...]
    cap: bool = False


def verify_branches_on(backend: str) -> bool:
    """Whether variable-length proposals switch among verify sizes on ``backend`` ("cpu", "gpu", ...).

    On a CPU the verify's cost grows with its rows, so a step whose rows matched nothing verifies
    the root alone (``benchmarks/ngram_no_match.py``). On a GPU the step reads its weights whatever
    its rows, and the switch passes the KV pool through a conditional, which XLA copies: measured on
    an H200 (Llama-3-8B shape, context 1024, ``benchmarks/gpu_check.py --items profile``), n-gram
    chain 5 at batch 16 spent 6.86 of its 12.62 ms a step copying pools (2.33x a plain step, where
    EAGLE-3 chain 5 verifying as many nodes took 1.47x). So a GPU verifies the longest size:
    the branch the switch takes whenever one row wants it, with the same acceptance rules."""
    return backend != "gpu"


# Sub-streams of a step's key, one per use, so draws never share randomness.
KEY_COINS, KEY_FINAL, KEY_SEED, KEY_DRAFT_STEP = 1, 2, 3, 16


def sub_keys(keys: jax.Array, purpose: int) -> jax.Array:  # key[R] -> key[R]
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, purpose)
