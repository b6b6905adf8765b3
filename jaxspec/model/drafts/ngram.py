"""Model-free drafting: n-gram lookup in the request's own history, alone or grafted onto a
model draft's tree.

* ``NgramDraft(max_ngram, min_ngram)``: the draft is the request itself. Its last k tokens
  (k from ``max_ngram`` down to ``min_ngram``) are looked up in its earlier history (prompt and
  output); what followed the most recent longest match is the proposal (a chain), or the
  continuations of up to ``topk`` matches with distinct next tokens (a tree of paths). No
  parameters and no KV pool; the per-row seed is the token history. The ``lookup`` proposer
  (``jaxspec.spec.lookup_loop``) drives it inside the compiled decode loop.
* ``HybridDraft(draft, ngram)``: a model draft (EAGLE, EAGLE-3, MTP, ...) proposes its tree as
  usual and the n-gram continuation is grafted onto it as an extra branch from the root,
  verified in the same target forward (``SpecConfig.ngram_tokens`` nodes, counted in
  ``num_draft_tokens``). The ``hybrid`` proposer (``jaxspec.spec.graft_loop``) drives it.

Glossary: B rows, M history width (positions a request can reach).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxspec.model.drafts.base import Draft, DraftModel, zero_pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramSeed:
    """history: i32[B, M] the row's tokens by position: prompt, then every emitted token; the
    step's root (the last emitted token) sits at ``seq_len``, so ``seq_len + 1`` are valid."""

    history: jax.Array

    @classmethod
    def empty(cls, batch: int, max_len: int) -> "NgramSeed":
        return cls(history=jnp.zeros((batch, max_len), jnp.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NgramConfig:
    """max_ngram, min_ngram: the longest and shortest suffix of the history looked up.
    adaptive: a match of k tokens drafts ``min(limit, 2**k)`` tokens (``draft_len``), else always
    ``limit`` (a chain's num_steps, a hybrid's ngram_tokens)."""

    max_ngram: int = 4
    min_ngram: int = 1
    adaptive: bool = True

    def draft_len(self, match_len: int, limit: int) -> int:
        """Tokens drafted for a match of ``match_len`` tokens (0: none)."""
        if match_len == 0:
            return 0
        return min(limit, 2**match_len) if self.adaptive else limit

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"NgramDraft.{name} must be a positive int, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"NgramDraft: min_ngram={self.min_ngram} > max_ngram={self.max_ngram}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"NgramDraft.adaptive must be a bool, got {self.adaptive!r}")


@dataclasses.dataclass(frozen=True)
class NgramLookup(Draft):
    """The n-gram draft kind (static): ``model`` is its ``NgramConfig``."""

    model: NgramConfig
    kind: ClassVar[str] = "ngram"
    proposer: ClassVar[str] = "lookup"

    @property
    def feature(self) -> None:
        return None

    @property
    def hidden_size(self) -> int:
        return 0

    @property
    def vocab_size(self) -> None:
        return None  # proposes the target's own tokens

    @property
    def num_layers(self) -> int:
        return 0

    def empty_seed(self, batch: int, *, dtype, max_len: int) -> NgramSeed:
        del dtype
        return NgramSeed.empty(batch, max_len)

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return zero_pool(page_size, dtype)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("an n-gram draft runs no forward: the 'lookup' proposer reads its history")

    def logits(self, params, logit_in):
        raise NotImplementedError("an n-gram draft has no logits: its proposals are one-hot")

    def check_fits(self, target_cfg) -> None:
        """Fits every target: it proposes tokens the target already emitted or was prompted with."""

    def check_spec(self, spec) -> None:
        """A chain takes the continuation of one match; a tree holds ``topk`` paths (one per
        match with a distinct next token) of at most ``num_steps`` tokens each."""
        super().check_spec(spec)
        if spec.topk > 1 and not spec.topk <= spec.num_draft_tokens - 1 <= spec.topk * spec.num_steps:
            raise ValueError(
                f"SpecConfig(num_steps={spec.num_steps}, topk={spec.topk}, num_draft_tokens="
                f"{spec.num_draft_tokens}): an n-gram tree is topk paths from the root, one per match, each "
                f"of 1 to num_steps tokens, so it holds topk..topk*num_steps = {spec.topk}.."
                f"{spec.topk * spec.num_steps} draft tokens; num_draft_tokens - 1 = {spec.num_draft_tokens - 1}"
            )


class NgramDraft(DraftModel):
    """Model-free drafting from the request's own history (prompt lookup), on device.

        draft = jaxspec.NgramDraft(max_ngram=4, min_ngram=1)
        jaxspec.generate(target, prompts, draft=draft, spec=jaxspec.SpecConfig.chain(5))

    Each step matches the request's last k tokens, k from ``max_ngram`` down to ``min_ngram``,
    against its earlier tokens; a chain proposes the ``num_steps`` tokens that followed the most
    recent longest match, a tree (``topk`` > 1) up to ``topk`` such continuations with distinct
    first tokens. A step with no match in any row verifies the root alone.

    Args:
      max_ngram, min_ngram: the longest and shortest suffix looked up.
      adaptive: chains (and a hybrid's n-gram branch) verify ``min(num_steps, 2**k)`` drafted
        tokens after a match of k tokens, since a short match predicts a short run: each step
        verifies the longest any active row asks for, among a few precompiled lengths. False:
        every match is verified to ``num_steps``.

    Raises:
      ValueError: ``max_ngram`` or ``min_ngram`` not a positive int, or ``min_ngram > max_ngram``.
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, adaptive: bool = True):
        cfg = NgramConfig(max_ngram=max_ngram, min_ngram=min_ngram, adaptive=adaptive)
        super().__init__(config=NgramLookup(cfg), params={})

    def __repr__(self) -> str:
        cfg = self.config.model
        return f"NgramDraft(max_ngram={cfg.max_ngram}, min_ngram={cfg.min_ngram}, adaptive={cfg.adaptive})"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridSeed:
    """base: the model draft's own seed; ngram: the row's token history."""

    base: Any
    ngram: NgramSeed


@dataclasses.dataclass(frozen=True)
class Hybrid(Draft):
    """A model draft (``model``, itself a ``Draft``) whose tree gets an n-gram branch
    (``ngram``). The hybrid proposer drives ``model`` directly; what the step and the engine ask
    of a draft (its feature, pool, fit) is the model draft's, and the seed holds both."""

    model: Draft
    ngram: NgramLookup
    proposer: ClassVar[str] = "hybrid"

    @property
    def kind(self) -> str:
        return f"{self.model.kind}+ngram"

    @property
    def pos_offset(self) -> int:
        return self.model.pos_offset

    @property
    def feature(self) -> str | None:
        return self.model.feature

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.model.aux_layers

    @property
    def kv_window(self) -> int | None:
        return self.model.kv_window

    @property
    def kv_layout(self):
        return self.model.kv_layout

    def empty_seed(self, batch: int, *, dtype, max_len: int) -> HybridSeed:
        return HybridSeed(base=self.model.empty_seed(batch, dtype=dtype, max_len=max_len),
                          ngram=self.ngram.empty_seed(batch, dtype=dtype, max_len=max_len))

    def create_pool(self, *, num_pages, page_size, dtype, window_pages=None, rows=1):
        return self.model.create_pool(num_pages=num_pages, page_size=page_size, dtype=dtype,
                                      window_pages=window_pages, rows=rows)

    def open_scratch(self, pool, width: int):
        return self.model.open_scratch(pool, width)

    def close_scratch(self, pool):
        return self.model.close_scratch(pool)

    def forward(self, *args, **kwargs):
        return self.model.forward(*args, **kwargs)

    def logits(self, params, logit_in):
        return self.model.logits(params, logit_in)

    def check_fits(self, target_cfg) -> None:
        self.model.check_fits(target_cfg)

    def check_spec(self, spec) -> None:
        """``spec.ngram_tokens`` (>= 1) nodes go to the n-gram branch; the model draft must be
        able to propose the rest (``spec.model_spec``)."""
        if not spec.ngram_tokens:
            raise ValueError(
                "a HybridDraft grafts SpecConfig.ngram_tokens n-gram tokens onto the model draft's tree; "
                "set ngram_tokens >= 1 (counted in num_draft_tokens), e.g. "
                "SpecConfig(num_steps=3, topk=1, num_draft_tokens=12, ngram_tokens=8)"
            )
        self.model.check_spec(spec.model_spec)


class HybridDraft(DraftModel):
    """A model draft's tree with the n-gram continuation grafted on as an extra branch from
    the root, verified in the same target forward.

        eagle = jaxspec.load_draft("path/to/eagle3", target)
        draft = jaxspec.HybridDraft(eagle, jaxspec.NgramDraft(max_ngram=4))
        spec = jaxspec.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16, ngram_tokens=5)

    ``spec.ngram_tokens`` of the ``num_draft_tokens`` verified nodes hold the n-gram branch
    (where its first tokens already are a path of the model's tree, the rest hangs below that
    path); the model draft proposes ``num_draft_tokens - ngram_tokens`` as it would alone. A
    hybrid is verified as a tree, also over a chain (``topk=1``).

    Raises:
      ValueError: ``draft`` is not a loaded model draft, or ``ngram`` not an ``NgramDraft``.
    """

    def __init__(self, draft: DraftModel, ngram: NgramDraft | None = None):
        if not isinstance(draft, DraftModel) or isinstance(draft.config, (NgramLookup, Hybrid)):
            raise ValueError(f"HybridDraft needs a model draft from jaxspec.load_draft, got {draft!r}")
        ngram = NgramDraft() if ngram is None else ngram
        if not isinstance(ngram, NgramDraft):
            raise ValueError(f"HybridDraft's ngram must be a jaxspec.NgramDraft, got {type(ngram).__name__}")
        super().__init__(config=Hybrid(draft.config, ngram.config), params=draft.params, path=draft.path,
                         mesh=draft.mesh)
        self.base = draft
        self.ngram = ngram

    def __repr__(self) -> str:
        return f"HybridDraft({self.base!r}, {self.ngram!r})"
