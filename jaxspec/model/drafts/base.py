"""The draft interface: what every draft kind exposes to the speculative step.

A draft is a static, hashable description (a frozen dataclass: it rides in the jit-static
``Plan``) plus a params pytree. The step (``jaxspec.spec``) drives every kind through the
same methods, so it never asks which kind it has:

    create_pool      its own KV pool (a zero-layer pool when it keeps none)
    forward          one draft forward over T rows per request -> (hidden, logit input, pool)
    extend           the forward over the accepted rows with the target's features (draft extend)
    empty_seed       the per-row state carried between steps (``DraftSeed`` by default)
    root             the forward at the root of a new tree, or the seed itself when extend already
                     ran it (a frozen-KV assistant runs its seed step here: iteration 0 of the loop)
    logits           draft-vocabulary logits, and ``to_target_ids`` / ``target_vocab_logits`` for
                     drafts whose vocabulary is a subset of the target's (EAGLE-3 ``d2t``)
    check_fits       a clear error when it cannot serve a target
    check_spec       a clear error when it cannot propose the verify tree a SpecConfig asks for
    proposer         which draft loop drives it: "recurrent" (token by token, chains and trees),
                     "lookup" (n-gram matches in the request's own history, no model),
                     "hybrid" (a model draft's tree with an n-gram branch grafted on) or
                     "block" (a whole block of proposals from one forward: DFlash, DSpark, P-EAGLE, PARD)

Detection and loading from checkpoints live in ``jaxspec.model.checkpoints.draft_formats``.

Position convention: a feature-level head's row ``p`` consumes the token at ``p + 1`` and
writes KV at ``p``; a standalone LM's row consumes the token at ``p`` and writes KV at ``p``.
``pos_offset`` (0 or 1) is the difference, so both share one draft loop.

Glossary: B rows, T rows per request, F target feature width, Hd recurrent hidden width,
Vd draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxspec.kvcache.paging import AttentionInputs
from jaxspec.kvcache.pool import KVPool
from jaxspec.model.targets.base import KVLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftSeed:
    """What a draft carries from one speculative step to the next, per row.

    hidden: [B, Hd] the draft's state at the last accepted token (its output there, or the
      target's feature for drafts that recompute the root).
    """

    hidden: jax.Array

    @classmethod
    def empty(cls, batch: int, width: int, dtype) -> "DraftSeed":
        return cls(hidden=jnp.zeros((batch, width), dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftContext:
    """What a draft forward may read besides its own pool (all read-only).

    page_table: the page tables shared by the target and draft pools (``PageTables``, with the
      window pool's ring table when a model has sliding-window layers, or a bare i32[B, W]).
    seq_lens: i32[B] committed target positions (the root is not yet in the KV).
    target_pool: the target's KV pool as of the last commit.
    state_rows: i32[B] the batch row of each request (a prefill's admitted rows), for drafts with
      per-row state; None: row b is request b.
    step: static, the draft step a forward runs (0: the extend; i + 1: step i of the propose loop).
    context: a prefill's whole contexts (tokens i32[R, T], lens i32[R]) when its forward runs over
      their uncached suffixes only (from ``seq_lens`` on); None elsewhere.
    """

    page_table: Any
    seq_lens: jax.Array
    target_pool: Any
    state_rows: jax.Array | None = None
    context: Any = None
    step: int = dataclasses.field(default=0, metadata=dict(static=True))


def zero_pool(page_size: int, dtype) -> KVPool:
    """A pool with no layers: every pool op on it is a no-op."""
    return KVPool.create(num_layers=0, num_pages=1, page_size=page_size, num_kv_heads=1, head_dim=1, dtype=dtype)


def check_block_tree(kind: str, spec) -> None:
    """A tree built from one block forward hangs at most ``topk - 1`` alternatives off each of the
    ``num_steps`` positions of the greedy chain, so it has at most ``num_steps * topk`` draft nodes."""
    if spec.topk > 1 and spec.num_draft_tokens - 1 > spec.num_steps * spec.topk:
        raise ValueError(
            f"a {kind} tree has at most num_steps * topk = {spec.num_steps * spec.topk} draft nodes (the greedy "
            f"chain and topk - 1 alternatives per position); num_draft_tokens={spec.num_draft_tokens} asks for "
            f"{spec.num_draft_tokens - 1}")


@dataclasses.dataclass(frozen=True)
class Draft(abc.ABC):
    """A draft kind (static). Subclasses are frozen dataclasses holding the model config.

    Attributes (static):
      model: the head's or LM's own config.
      kind: a short name ("eagle3", "mtp", ...), for messages and stats only.
      proposer: the draft loop that drives this kind (``jaxspec.spec.proposers``).
      feature: the target output consumed at draft extend: "final" (normed final hidden),
        "aux" (the residual streams entering ``aux_layers``) or None (tokens only).
      pos_offset: 0 for feature-level heads, 1 for token-level LMs (module docstring).
      hidden_size: Hd, the width of the seed's hidden.
      vocab_size: the target vocabulary it proposes into.
    """

    model: Any
    kind: ClassVar[str] = "draft"
    proposer: ClassVar[str] = "recurrent"
    pos_offset: ClassVar[int] = 0

    @property
    def feature(self) -> str | None:
        return "final"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def num_layers(self) -> int:
        """Layers of the draft's own KV pool."""
        return self.model.num_layers

    @property
    def tensor_parallel(self) -> int:
        """Model-axis shards its weights and KV heads are split over (1: replicated)."""
        return getattr(self.model, "tensor_parallel", 1)

    @property
    def has_confidence_head(self) -> bool:
        """Predicts each proposal's acceptance (``SpecConfig.confidence_threshold`` may use it)."""
        return False

    @property
    def target_hidden_size(self) -> int | None:
        """Width of the target hidden state a feature-level draft was built for (None: any)."""
        return None

    # --------------------------------------------------------------------------- state

    def empty_seed(self, batch: int, *, dtype, max_len: int):
        """The per-row seed carried between steps, zeroed (``max_len``: positions a request
        may reach, for drafts that keep per-row history)."""
        del max_len
        return DraftSeed.empty(batch, self.hidden_size, dtype)

    # --------------------------------------------------------------------------- pool

    @property
    def kv_window(self) -> int | None:
        """The sliding window of the draft's own sliding-window layers (None: it has none)."""
        return None

    @property
    def kv_layout(self) -> KVLayout:
        """What sizing the draft's own pools needs (``KVLayout``): by default its window alone."""
        return KVLayout(window=self.kv_window)

    def create_pool(self, *, num_pages: int, page_size: int, dtype, window_pages: int | None = None, rows: int = 1):
        """The draft's own KV pool (MHA by default; ``window_pages``: pages of the window part
        of a pool with sliding-window layers; ``rows``: batch rows, for drafts with per-row state)."""
        m = self.model
        return KVPool.create(num_layers=self.num_layers, num_pages=num_pages, page_size=page_size,
                             num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=dtype)

    # --------------------------------------------------------------------------- forwards

    @abc.abstractmethod
    def forward(
        self,
        params: dict,
        tokens: jax.Array,  # i32[B, T]
        hidden: jax.Array | None,  # [B, T, F] target features (extend) or [B, T, Hd] own hidden
        positions: jax.Array,  # i32[B, T] KV / RoPE positions
        pool,
        attn: AttentionInputs,
        ctx: DraftContext,
        *,
        from_target: bool,
        implementation=None,
    ) -> tuple[jax.Array, jax.Array, Any]:  # hidden [B, T, Hd], logit input [B, T, *], pool
        """One draft forward over T rows per request, writing its KV (if it keeps any)."""

    def target_feature(self, out) -> jax.Array | None:
        """The target output (``ForwardOutput``) this draft consumes at extend."""
        return {"final": out.hidden, "aux": out.aux, None: None}[self.feature]

    def extend(self, params, tokens, features, positions, pool, attn, ctx, *, implementation=None):
        """Draft extend over the accepted rows: (hidden [B, T, Hd], pool). The seed of the next
        step is the hidden at the last accepted row."""
        hidden, _, pool = self.forward(params, tokens, features, positions, pool, attn, ctx, from_target=True,
                                       implementation=implementation)
        return hidden, pool

    def open_scratch(self, pool, width: int):
        """The pool a propose drafts into, with room for ``width`` draft-scratch nodes besides their
        KV (drafts with recurrent state keep their nodes' pending quantities there); by default the
        pool itself."""
        del width
        return pool

    def close_scratch(self, pool):
        """The pool after a propose (``open_scratch`` undone)."""
        return pool

    def root(self, params, bonus, seed: DraftSeed, ctx: DraftContext, *, implementation=None):
        """(hidden [B, Hd], logit input [B, *]) at the root of the next tree. By default the
        seed already holds the draft's output there (extend ran it)."""
        del params, bonus, ctx, implementation
        return seed.hidden, seed.hidden

    # --------------------------------------------------------------------------- vocabulary

    @abc.abstractmethod
    def logits(self, params: dict, logit_in: jax.Array) -> jax.Array:  # [..., *] -> f32[..., Vd]
        """Logits over the draft's vocabulary."""

    def to_target_ids(self, params: dict, index: jax.Array) -> jax.Array:  # i32[...]
        """Draft-vocabulary ids -> target ids (identity unless the vocabulary is a subset)."""
        del params
        return index.astype(jnp.int32)

    def target_vocab_logits(self, params: dict, logits: jax.Array) -> jax.Array:  # [..., Vd] -> [..., V]
        """Draft logits placed in the target's vocabulary (-inf for tokens it cannot propose)."""
        del params
        return logits

    # --------------------------------------------------------------------------- fit

    def check_fits(self, target_cfg) -> None:
        """Raises a clear ValueError when this draft cannot serve ``target_cfg``."""
        if self.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"draft vocabulary ({self.vocab_size}) does not match the target's ({target_cfg.vocab_size})"
            )
        if self.target_hidden_size is not None and self.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(
                f"draft was built for target hidden size {self.target_hidden_size}, "
                f"the target has {target_cfg.hidden_size}"
            )
        if self.aux_layers and max(self.aux_layers) > target_cfg.num_layers:
            raise ValueError(f"draft taps target layers {self.aux_layers}; the target has {target_cfg.num_layers}")

    def check_spec(self, spec) -> None:
        """Raises a clear ValueError when this draft cannot propose what ``spec`` (a valid
        ``SpecConfig``) asks for. Model drafts build any valid chain or tree, but graft nothing."""
        if spec.ngram_tokens:
            raise ValueError(
                f"SpecConfig.ngram_tokens={spec.ngram_tokens} grafts an n-gram branch onto a model draft's tree: "
                f"pass draft=jaxspec.HybridDraft(draft, jaxspec.NgramDraft(...)), not a {self.kind!r} draft alone"
            )
        if spec.confidence_threshold is not None and not self.has_confidence_head:
            raise ValueError(
                f"SpecConfig.confidence_threshold={spec.confidence_threshold} needs a draft with a confidence head "
                f"(DSpark with enable_confidence_head); this {self.kind!r} draft has none"
            )


@dataclasses.dataclass(eq=False)
class DraftModel:
    """A loaded draft: its static kind description ``config`` (a ``Draft``) plus ``params``
    (which may share arrays with the target)."""

    config: Draft
    params: dict
    path: str | None = None
    mesh: Any = None  # the target's mesh it is placed on (None: one device)

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def block_size(self) -> int:
        """Tokens per block of a block draft (anchor included): ``SpecConfig.chain(block_size - 1)``
        is its natural shape."""
        size = getattr(self.config, "block_size", None)
        if size is None:
            raise AttributeError(f"a {self.kind} draft proposes token by token; it has no block_size")
        return size

    def __repr__(self) -> str:
        return f"DraftModel(kind={self.kind!r}, path={self.path!r})"
