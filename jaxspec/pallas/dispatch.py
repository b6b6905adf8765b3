"""Implementation dispatch shared by every op in ``jaxspec.pallas`` (tokamax style).

Public ops take ``implementation="pallas" | "xla" | None``. None means Pallas on a GPU and
the XLA reference elsewhere. Asking for "pallas" off-GPU runs the kernel in interpret mode,
which is how the CPU test suite exercises every kernel.
"""

from __future__ import annotations

import functools

import jax

IMPLEMENTATIONS = ("pallas", "xla")


@functools.cache
def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve(implementation: str | None) -> str:
    """Returns "pallas" or "xla" for a user's choice (None picks by backend)."""
    if implementation is None:
        return "pallas" if on_gpu() else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
    return implementation


def interpret_mode() -> bool:
    """Pallas kernels run natively on GPU and in interpret mode everywhere else."""
    return not on_gpu()
