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
