"""Device-side decoding state and the static plan that shapes the compiled programs.

Glossary: B batch rows (a power-of-two bucket), M output-buffer width, NS stop ids per row,
K = topk, Hd draft hidden width, S = num_steps, n = num_draft_tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.config import SpecConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything static about a decode: hashable, passed to ``jax.jit`` as a static arg.

    target: the target's model config. draft: the draft's DraftConfig or None (plain
    decoding, a one-node verify per step). greedy_only: no row samples, so the sampling
    machinery is compiled out. filtering: some row uses top_k or top_p (else the sorts are
    compiled out).
    """

    target: Any
    draft: Any = None
    spec: SpecConfig | None = None
    page_size: int = 16
    steps_per_call: int = 8
    greedy_only: bool = True
    filtering: bool = False
    implementation: str | None = None

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
    def draft_samples(self) -> bool:
        """Chains at temperature > 0 draw their draft tokens from the draft distribution q
        and keep q for rejection sampling."""
        return self.spec is not None and not self.greedy_only and self.spec.uses_rejection_sampling

    @property
    def aux_layers(self) -> tuple[int, ...]:
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
class DecodeState:
    """Per-row state carried across steps (and across host round trips).

    Attributes:
      seq_lens: i32[B] committed KV positions (the root token is not yet in the KV).
      bonus: i32[B] root of the next step = last emitted token.
      active: bool[B] row is generating.
      out_tokens: i32[B, M] emitted tokens; out_lens: i32[B] how many.
      max_new: i32[B] per-request token limit.
      stop_ids: i32[B, NS] stop tokens (-1 padded).
      temperature, top_p: f32[B]; top_k: i32[B] sampling parameters.
      keys: u32[B, 2] per-request PRNG key data; steps: i32[B] draws so far (fold_in counter).
      topk_p: f32[B, K], topk_index: i32[B, K], hidden: [B, Hd] the draft's seed for the
        next step (from the last draft-extend or prefill).
      num_verify: i32[B] verify steps run; accept_log: i32[B, M] accept length of each.
      draft_q: f32[B, V] the distribution the next step's first draft token was drawn from
        (chain rejection sampling only; [B, 1] otherwise).
    """

    seq_lens: jax.Array
    bonus: jax.Array
    active: jax.Array
    out_tokens: jax.Array
    out_lens: jax.Array
    max_new: jax.Array
    stop_ids: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array
    steps: jax.Array
    topk_p: jax.Array
    topk_index: jax.Array
    hidden: jax.Array
    num_verify: jax.Array
    accept_log: jax.Array
    draft_q: jax.Array

    @classmethod
    def empty(cls, *, batch: int, out_width: int, num_stop: int, topk: int, hidden_size: int, hidden_dtype,
              draft_q_width: int = 1):
        B = batch
        zeros_i = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
        return cls(
            seq_lens=zeros_i(B),
            bonus=zeros_i(B),
            active=jnp.zeros((B,), bool),
            out_tokens=zeros_i(B, out_width),
            out_lens=zeros_i(B),
            max_new=zeros_i(B),
            stop_ids=jnp.full((B, num_stop), -1, jnp.int32),
            temperature=jnp.zeros((B,), jnp.float32),
            top_k=zeros_i(B),
            top_p=jnp.ones((B,), jnp.float32),
            keys=jnp.zeros((B, 2), jnp.uint32),
            steps=zeros_i(B),
            topk_p=jnp.zeros((B, topk), jnp.float32),
            topk_index=zeros_i(B, topk),
            hidden=jnp.zeros((B, hidden_size), hidden_dtype),
            num_verify=zeros_i(B),
            accept_log=zeros_i(B, out_width),
            draft_q=jnp.zeros((B, draft_q_width), jnp.float32),
        )


def row_keys(state: DecodeState) -> jax.Array:
    """One PRNG key per row for this step: fold_in(request key, steps so far)."""
    keys = jax.random.wrap_key_data(state.keys)
    return jax.vmap(jax.random.fold_in)(keys, state.steps)


# Sub-streams of a step's key, one per use, so draws never share randomness.
KEY_COINS, KEY_FINAL, KEY_SEED, KEY_DRAFT_STEP = 1, 2, 3, 16


def sub_keys(keys: jax.Array, purpose: int) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, purpose)
