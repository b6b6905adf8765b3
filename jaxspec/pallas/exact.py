"""The exact mode's switch (docs/architecture.md#the-exact-mode): while a forward is traced inside
``exact_mode()``, its products, row reductions and attention go through kernels whose reduction
order is fixed per row (``fixed_matmul``, ``exact_attention``), so a row's bits do not depend on how
many rows are computed beside it. Outside it, the same calls are XLA's ordinary operations.

The switch is read while tracing (a compiled program is traced with it on or off, and the static
``Plan.exact`` keeps the two apart in the jit caches), so a model's code calls ``matmul`` /
``row_sum`` where it would write ``@`` / ``jnp.sum`` and never asks which mode it is in.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxspec.pallas.fixed_matmul import fixed_matmul

_EXACT = contextvars.ContextVar("jaxspec_exact_mode", default=False)


@contextlib.contextmanager
def exact_mode(on: bool = True):
    """Everything traced inside computes each row with fixed reduction orders (``on=False``: a no-op)."""
    token = _EXACT.set(bool(on))
    try:
        yield
    finally:
        _EXACT.reset(token)


def exact_on() -> bool:
    return _EXACT.get()


def matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:  # [..., K] @ [K, N] -> [..., N]
    """``x @ w``: the fixed-tile product in the exact mode. ``out_dtype``: f32 for logits (the
    accumulator unrounded), else ``x``'s dtype."""
    if exact_on():
        dt = jnp.promote_types(x.dtype, w.dtype)  # as ``@`` promotes
        return fixed_matmul(x.astype(dt), w.astype(dt), out_dtype=out_dtype or dt)
    if out_dtype is None:
        return x @ w
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=out_dtype)


def row_sum(x: jax.Array) -> jax.Array:  # f32[..., K] -> f32[...]
    """The sum over the last axis in float32: in the exact mode a product with a column of ones, so
    the reduction order is the fixed-tile kernel's."""
    x = x.astype(jnp.float32)
    if exact_on():
        return fixed_matmul(x, jnp.ones((x.shape[-1], 1), jnp.float32))[..., 0]
    return jnp.sum(x, axis=-1)


def row_mean(x: jax.Array) -> jax.Array:  # f32[..., K] -> f32[..., 1]
    """The mean over the last axis in float32, kept as an axis of 1 (``row_sum``'s order in the
    exact mode)."""
    x = x.astype(jnp.float32)
    if exact_on():
        return (row_sum(x) / x.shape[-1])[..., None]
    return jnp.mean(x, axis=-1, keepdims=True)
