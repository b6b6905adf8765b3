"""Lower a function for CUDA on a machine without a GPU, to check that its Pallas kernels get
through the Triton lowering (power-of-two tiles, supported primitives, dot shapes).

This runs JAX's Pallas-to-Triton-IR lowering only; compiling that IR to PTX needs a GPU and
is covered by the ``@pytest.mark.gpu`` twins of the kernel tests. The lowering asks for the
local GPU's compute capability, so it is pointed at an H100 description for the duration.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import pytest

TRITON_CALL = "__gpu$xla.gpu.triton"


@contextlib.contextmanager
def _as_if_h100():
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # pragma: no cover - depends on the JAX build
        pytest.skip("this JAX build has no Pallas Triton lowering")
    saved = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
    try:
        with warnings.catch_warnings():  # JAX >= 0.11 flags the Triton backend as deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        gpu_info.get_gpu_info = saved


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of ``jax.jit(fn)(*args)`` lowered for CUDA (Triton kernels inlined as IR)."""
    with _as_if_h100():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def triton_calls(fn, *args) -> int:
    """How many Triton kernel launches ``fn`` lowers to."""
    return lower_for_cuda(fn, *args).count(TRITON_CALL)
