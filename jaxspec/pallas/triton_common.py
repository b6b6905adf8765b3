"""Helpers shared by the Pallas (Triton backend) kernels.

All kernels here see their operands whole (one block = the full array) and index them with
explicit integer tensors: paged KV is a gather by construction, masked rows and columns are
common, and Triton lowers an integer-tensor index to the same pointer arithmetic it would
use for a block. Conventions:

* loads use in-range indices (clamped) plus a mask and ``other=0``;
* stores send masked elements to an out-of-range index as well as masking them, so interpret
  mode (which scatters, dropping out-of-range indices) never writes them either;
* every tile edge is a power of two (Triton); block sizes come from ``block_sizes``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# JAX imports its Pallas interpreters lazily, on the first interpret-mode lowering, and that
# import registers a config option (through ``pallas.fuser``). The changed tracing context
# makes the first program traced before it miss the jit cache and compile a second time.
# Importing it up front keeps the context stable.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401


def whole(x: jax.ShapeDtypeStruct | jax.Array) -> pl.BlockSpec:
    """A BlockSpec giving every program the whole array (any grid rank)."""
    ndim = len(x.shape)
    return pl.BlockSpec(x.shape, lambda *_: (0,) * ndim)


def split_out_shapes(num_splits: int, rows: int, width: int, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Outputs of an attention kernel over ``rows`` query rows of ``width``: the result itself,
    or, with the KV split over ``num_splits`` programs, each split's unnormalized output, its
    running max and its softmax denominator (f32), merged by :func:`merge_splits`."""
    if num_splits == 1:
        return (jax.ShapeDtypeStruct((rows, width), dtype),)
    return (
        jax.ShapeDtypeStruct((num_splits * rows, width), jnp.float32),  # unnormalized partial outputs
        jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),  # running max
        jax.ShapeDtypeStruct((num_splits * rows,), jnp.float32),  # softmax denominator
    )


def merge_splits(out: tuple[jax.Array, ...], shape: tuple[int, ...], dtype) -> jax.Array:
    """Flash-decoding merge: rescales each split to the common max and normalizes.
    ``shape`` is the output shape [..., width]; ``out`` comes from ``split_out_shapes``."""
    if len(out) == 1:
        return out[0].reshape(shape)
    rows = shape[:-1]
    o_part = out[0].reshape((-1,) + tuple(shape))  # [S, ..., width]
    m_part, l_part = (x.reshape((-1,) + tuple(rows)) for x in out[1:])
    m_all = jnp.max(m_part, axis=0)
    scale = jnp.exp(m_part - m_all[None])
    l_all = jnp.sum(scale * l_part, axis=0)
    o = jnp.sum(scale[..., None] * o_part, axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return o.astype(dtype)
