"""Per-row sampling distributions: ``top_p(top_k(min_p(softmax(logits / T))))``.

Every row carries its own temperature / top_k / top_p / min_p (traced arrays), so one compiled
program serves a batch of mixed requests. Rows with temperature 0 are greedy. (Logit bias and
penalties come before, in ``jaxspec.sampling.controls``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _setting(dtype, default):
    return dataclasses.field(metadata=dict(dtype=dtype, default=default))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings as one pytree, carried from the request arrays through the
    decode state to the step: a new setting is one more field here (named as in
    ``SamplingParams``, with its dtype and neutral value) read where it applies.

    temperature: f32[...] (0: greedy); top_k: i32[...] (0: off); top_p: f32[...] (1: off);
    min_p: f32[...] (0: off).
    """

    temperature: jax.Array = _setting(np.float32, 0.0)
    top_k: jax.Array = _setting(np.int32, 0)
    top_p: jax.Array = _setting(np.float32, 1.0)
    min_p: jax.Array = _setting(np.float32, 0.0)

    @classmethod
    def host(cls, params: Sequence = (), rows: int | None = None) -> "RowSampling":
        """numpy arrays [rows]: row i from ``params[i]`` (a ``SamplingParams`` or None), the neutral
        value in rows without one."""
        rows = len(params) if rows is None else rows
        out = {}
        for f in dataclasses.fields(cls):
            a = np.full(rows, f.metadata["default"], f.metadata["dtype"])
            for i, p in enumerate(params):
                if p is not None:
                    a[i] = getattr(p, f.name)
            out[f.name] = a
        return cls(**out)

    @classmethod
    def empty(cls, rows: int) -> "RowSampling":
        """Device arrays [rows] at the neutral values (greedy)."""
        return jax.tree.map(jnp.asarray, cls.host((), rows))

    @property
    def greedy(self) -> jax.Array:  # bool[...]
        return self.temperature <= 0.0

    def broadcast(self, shape: tuple[int, ...]) -> "RowSampling":
        """Settings [B] broadcast to [B, ...] (one per tree node or draft position)."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(shape) - x.ndim)), shape),
                            self)


def target_probs(
    logits: jax.Array,  # f32[..., V]
    sampling: RowSampling,  # every field [...]
    filtering: bool = True,
    *,
    min_p: bool = True,
) -> jax.Array:  # f32[..., V]
    """The sampling distribution of each row. Greedy rows (T = 0) get a one-hot argmax.

    min_p drops every token whose probability is below min_p times the largest (vLLM's order:
    after temperature, before top-k / top-p; ``min_p=False``, static: not applied, as for the
    draft distributions, which need not match the target's filters); top_k keeps every token
    whose logit is >= the k-th largest (ties at the boundary are kept); top_p then keeps, in
    descending-probability order, each token whose preceding mass is < top_p, and renormalizes.
    ``filtering=False`` (static: no row uses top_k or top_p) skips those two and their sorts; with
    ``filtering=True`` a row that uses neither still gets exactly the unfiltered distribution, so
    a row's distribution never depends on what other rows ask (a request's sampled tokens are the
    same whatever runs beside it).
    """
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    top_k, top_p = sampling.top_k, sampling.top_p
    greedy = sampling.greedy
    t = jnp.where(greedy, 1.0, sampling.temperature)[..., None]
    scaled = logits / t
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    if min_p:
        # p < min_p * p_max  <=>  scaled < max(scaled) + log(min_p): no softmax, no sort (min_p 0: -inf).
        floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(sampling.min_p)[..., None]
        scaled = jnp.where(scaled < floor, -jnp.inf, scaled)
    unfiltered = jax.nn.softmax(scaled, axis=-1)
    if not filtering:
        return jnp.where(greedy[..., None], onehot, unfiltered)
    filters = (top_k > 0) | (top_p < 1.0)  # [...]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [..., V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[..., None], axis=-1)  # [..., 1]
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    # top-p over the sorted probabilities of the top-k-filtered distribution.
    sorted_p = jnp.sort(probs, axis=-1)[..., ::-1]
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each sorted token
    keep_sorted = before < top_p[..., None]
    # Threshold = smallest kept probability; keep every token at or above it.
    threshold = jnp.min(jnp.where(keep_sorted, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return jnp.where(greedy[..., None], onehot, jnp.where(filters[..., None], probs, unfiltered))


def uniforms(keys: jax.Array, shape: tuple[int, ...] = ()) -> jax.Array:  # f32[R, *shape]
    """U[0, 1) draws of ``shape`` from each row's key."""
    return jax.vmap(lambda k: jax.random.uniform(k, shape, jnp.float32))(keys)


def sample_categorical(
    probs: jax.Array,  # f32[R, V]
    keys: jax.Array,  # key[R] one PRNG key per row
) -> jax.Array:  # i32[R]
    """One draw per row by inverse CDF (exact; zero-probability tokens never drawn)."""
    return sample_with_uniform(probs, uniforms(keys))


def sample_with_uniform(probs: jax.Array, u: jax.Array, fallback: jax.Array | None = None) -> jax.Array:
    """Inverse-CDF draw with given uniforms ``u`` in [0, 1): the first index whose cumulative
    mass exceeds ``u * total``. Rows whose mass is 0 (a residual that rounding emptied)
    draw from ``fallback`` instead."""
    if fallback is not None:
        empty = jnp.sum(probs, axis=-1, keepdims=True) <= 0.0
        probs = jnp.where(empty, fallback, probs)
    cdf = jnp.cumsum(probs, axis=-1)
    total = cdf[..., -1:]
    idx = jnp.sum(cdf <= u[..., None] * total, axis=-1)
    # Never land on a zero-probability tail token because of rounding.
    last_nonzero = probs.shape[-1] - 1 - jnp.argmax(probs[..., ::-1] > 0, axis=-1)
    return jnp.minimum(idx, last_nonzero).astype(jnp.int32)


def pick_tokens(
    logits: jax.Array,  # f32[R, V]
    sampling: RowSampling,  # every field [R]
    keys: jax.Array,  # key[R]
    greedy_only: bool,
    filtering: bool = True,
) -> jax.Array:  # i32[R]
    """Next token per row: argmax for greedy rows, a draw from ``target_probs`` otherwise.
    ``greedy_only`` (static) compiles the argmax alone."""
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy_tok
    drawn = sample_categorical(target_probs(logits, sampling, filtering), keys)
    return jnp.where(sampling.greedy, greedy_tok, drawn)
