"""Lower a function for CUDA on a machine without a GPU, to check that its Pallas kernels get
through the Triton lowering (power-of-two tiles, supported primitives, dot shapes).

This runs JAX's Pallas-to-Triton-IR lowering only (the lowering is pointed at an H100 for the
duration); ``test_triton_compile.py`` goes on to verify the Triton modules and compile them
to PTX at realistic shapes.
"""

from __future__ import annotations

import jax

from tests.pallas.triton_compile import as_if_h100

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of ``jax.jit(fn)(*args)`` lowered for CUDA (Triton kernels inlined as IR)."""
    with as_if_h100():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_calls(fn, *args) -> int:
    """How many Triton kernel launches ``fn`` lowers to."""
    return lower_for_cuda(fn, *args).count(TRITON_CALL)
