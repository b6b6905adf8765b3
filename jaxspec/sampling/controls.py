"""Per-request generation controls on device: logit bias and the repetition / presence /
frequency penalties (vLLM's names, meanings and order), and the raw log-probabilities reported
for emitted tokens.

The controls are arrays of the decode state (one row per request), not static arguments, so one
compiled program serves any mix of requests. A verify tree judges every node with the counts
plain decoding would have there: the row's committed counts plus the tokens on the node's own
path. The dense pass below applies the committed counts to every node; the few (node, token)
pairs whose count the path changes are then recomputed and written over (at most n * n per row),
so nothing of size [B, n, V] beyond the logits themselves is built.

Glossary: B rows, n nodes per row (a verify tree; 1 for a prefill's first token), V vocabulary,
k top log-probabilities kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.pallas.exact import exact_mode, row_sum


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Controls:
    """The logit-processing state of each row.

    repetition, presence, frequency: f32[B] penalties (1, 0, 0: off).
    bias: f32[B, V] logit bias. in_prompt: bool[B, V] the token occurs in the prompt.
    counts: i32[B, V] output tokens emitted so far (the root of the next tree included).

    When no row of a call uses any control the [B, V] arrays are [B, 0] and ``enabled`` is False
    (static: it is a shape), and nothing is computed.
    """

    repetition: jax.Array
    presence: jax.Array
    frequency: jax.Array
    bias: jax.Array
    in_prompt: jax.Array
    counts: jax.Array

    @classmethod
    def empty(cls, batch: int, vocab: int) -> "Controls":
        """Controls off for ``batch`` rows; ``vocab`` 0 compiles the processing out."""
        B = batch
        return cls(repetition=jnp.ones((B,), jnp.float32), presence=jnp.zeros((B,), jnp.float32),
                   frequency=jnp.zeros((B,), jnp.float32), bias=jnp.zeros((B, vocab), jnp.float32),
                   in_prompt=jnp.zeros((B, vocab), bool), counts=jnp.zeros((B, vocab), jnp.int32))

    @property
    def enabled(self) -> bool:
        return self.bias.shape[-1] > 0

    @classmethod
    def for_prompts(cls, tokens: jax.Array, lens: jax.Array, request: dict, vocab: int) -> "Controls":
        """Rows starting a request: its parameters, the prompt's tokens marked, no output counted.
        tokens: i32[R, T] prompts, right-padded; lens: i32[R]; request: repetition_penalty,
        presence_penalty, frequency_penalty f32[R] and logit_bias f32[R, V] (V = ``vocab``, 0: off)."""
        R, T = tokens.shape
        empty = cls.empty(R, vocab)
        if not empty.enabled:
            return empty
        valid = jnp.arange(T)[None, :] < lens[:, None]
        in_prompt = empty.in_prompt.at[jnp.arange(R)[:, None], tokens].max(valid)
        return cls(repetition=request["repetition_penalty"], presence=request["presence_penalty"],
                   frequency=request["frequency_penalty"], bias=request["logit_bias"], in_prompt=in_prompt,
                   counts=empty.counts)

    def count(self, tokens: jax.Array, keep: jax.Array) -> "Controls":
        """Adds ``tokens[b, j]`` (i32[B, A]) to row b's output counts where ``keep`` (bool[B, A])."""
        if not self.enabled:
            return self
        B = tokens.shape[0]
        counts = self.counts.at[jnp.arange(B)[:, None], tokens].add(keep.astype(jnp.int32), mode="drop")
        return dataclasses.replace(self, counts=counts)


def penalize(
    logit: jax.Array,  # f32[...]
    bias: jax.Array,  # f32[...]
    count: jax.Array,  # i32[...] output occurrences of the token
    in_prompt: jax.Array,  # bool[...]
    repetition: jax.Array,  # f32[...] (broadcast)
    presence: jax.Array,
    frequency: jax.Array,
) -> jax.Array:  # f32[...]
    """vLLM v1's order, elementwise: bias, then the repetition penalty (over prompt and output
    tokens: a positive logit divided, any other multiplied), then frequency and presence."""
    x = logit + bias
    seen = in_prompt | (count > 0)
    x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * count - presence * (count > 0)


def apply_controls(
    logits: jax.Array,  # f32[B, n, V] raw target logits after each node
    controls: Controls,
    tokens: jax.Array | None,  # i32[B, n] node tokens (node 0, the root, is already counted)
    path: jax.Array | None,  # bool[B, n, n] node i's path holds node j (root, ancestors, itself: a tree's mask)
) -> jax.Array:  # f32[B, n, V]
    """The logits plain decoding would process at every node: committed counts plus each node's
    own path (its ancestors below the root and itself). With n = 1 (a root alone, a prefill's
    first token) ``tokens`` and ``path`` are not read."""
    if not controls.enabled:
        return logits
    B, n, V = logits.shape
    c = controls
    row = lambda x: x[:, None, None]  # noqa: E731  [B] -> [B, 1, 1]
    dense = penalize(logits, c.bias[:, None], c.counts[:, None], c.in_prompt[:, None], row(c.repetition),
                     row(c.presence), row(c.frequency))
    if n == 1:
        return dense
    # Pairs (node i, path node j >= 1): the token t = tokens[j] is counted once more per path
    # node holding it; recompute logits[i, t] with that count and write it over the dense value.
    on_path = path & (jnp.arange(n) > 0)[None, None, :]  # [B, i, j]
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, j, j']
    extra = jnp.einsum("bij,bjk->bik", on_path.astype(jnp.int32), same.astype(jnp.int32))  # [B, i, j]
    t = jnp.broadcast_to(tokens[:, None, :], (B, n, n))  # token of pair (i, j)
    b_idx = jnp.arange(B)[:, None, None]
    i_idx = jnp.arange(n)[None, :, None]
    raw = logits[b_idx, i_idx, t]  # [B, i, j]
    at = lambda x: jnp.take_along_axis(x, tokens, axis=1)[:, None, :]  # noqa: E731  [B, V] -> [B, 1, j]
    fixed = penalize(raw, at(c.bias), at(c.counts) + extra, at(c.in_prompt), row(c.repetition), row(c.presence),
                     row(c.frequency))
    t = jnp.where(on_path, t, V)  # pairs off the path are dropped
    return dense.at[b_idx, i_idx, t].set(fixed, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Raw log-probabilities of emitted tokens.

    chosen: f32[B, A] the emitted token's; top_ids: i32[B, A, k], top: f32[B, A, k] the k most
    likely tokens' (best first)."""

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def token_logprobs(
    logits: jax.Array,  # f32[B, A, V] raw logits each emitted token was chosen from
    tokens: jax.Array,  # i32[B, A] the emitted tokens
    k: int,
    *,
    exact: bool = False,
) -> TokenLogprobs:
    """log-softmax of the raw logits (temperature 1, before any control): the emitted token's
    value and the top ``k``. ``exact``: the softmax's sum in the exact mode's fixed order."""
    lp = _exact_log_softmax(logits) if exact else jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(lp, k)
    return TokenLogprobs(chosen=chosen, top_ids=top_ids.astype(jnp.int32), top=top)


def _exact_log_softmax(logits: jax.Array) -> jax.Array:  # f32[..., V]
    """``x - max - log(sum(exp(x - max)))`` row by row, the sum in the fixed-tile kernel (the max and
    the elementwise parts are exact whatever the rows beside)."""
    x = logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    with exact_mode():
        total = row_sum(jnp.exp(x - m))
    return x - m - jnp.log(total)[..., None]


def steer(
    logits: jax.Array,  # f32[B, ..., Vd] a draft's logits
    controls: Controls,
    ids: jax.Array | None = None,  # i32[Vd] the target id of each column (None: the target's vocabulary)
) -> jax.Array:  # f32[B, ..., Vd]
    """A draft's logits processed with its rows' bias and penalties over the committed counts (not
    a tree path's): drafts then propose what the processed target is likely to accept. Lossless
    either way; chain sampling draws from, and accepts with, the processed q."""
    if not controls.enabled:
        return logits
    c = controls
    inner = (1,) * (logits.ndim - 2)
    cols = (lambda x: x) if ids is None else (lambda x: jnp.take(x, ids, axis=-1))  # noqa: E731
    at = lambda x: cols(x).reshape(x.shape[:1] + inner + (-1,))  # noqa: E731  [B, V] -> [B, 1.., Vd]
    row = lambda x: x.reshape(x.shape + inner + (1,))  # noqa: E731
    return penalize(logits, at(c.bias), at(c.counts), at(c.in_prompt), row(c.repetition), row(c.presence),
                    row(c.frequency))
