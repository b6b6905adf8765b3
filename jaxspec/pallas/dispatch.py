"""Implementation dispatch shared by every op in ``jaxspec.pallas`` (tokamax style).

Public ops take ``implementation``:

* ``"pallas"``: the Pallas kernel (natively on a GPU, in interpret mode elsewhere: how the
  CPU test suite exercises every kernel). A shape the kernel cannot take raises
  ``NotImplementedError``.
* ``"xla"``: the lean XLA path (never the f32 reference, which is the tests' oracle).
* ``None``: the Pallas kernel on a GPU where it supports the shape, the XLA path otherwise
  (always XLA on CPU). A GPU falling back says so once per op and reason (a warning that
  names both): a shape the kernel cannot take, or one the block table sends to XLA on this
  GPU kind (``block_table.json``, ``"xla"`` section: kernels known to fail natively, spill or
  lose to XLA there).
* a mapping op name -> one of the above (``{"kv_move": "xla"}``), or the same as sorted
  ``(op, implementation)`` pairs (how ``EngineConfig`` stores it, hashable); ops it does not
  name take ``None``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import jax

from jaxspec.config import KERNEL_OPS, normalize_implementation
from jaxspec.pallas import block_table

IMPLEMENTATIONS = ("pallas", "xla")

_assumed_gpu: list[str] = []  # stack of assume_gpu() kinds
_warned: set[tuple[str, str]] = set()


@functools.cache
def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.cache
def _local_gpu_kind() -> str | None:
    return block_table.gpu_key(jax.devices()[0].device_kind) if on_gpu() else None


def gpu_kind() -> str | None:
    """Block-table key of the GPU the kernels are built for (``"h100"``), None without one."""
    return _assumed_gpu[-1] if _assumed_gpu else _local_gpu_kind()


@contextlib.contextmanager
def assume_gpu(kind: str):
    """Kernels pick the block-table entries of GPU ``kind`` while inside (used when lowering
    for an H100 on a machine without one)."""
    _assumed_gpu.append(kind)
    try:
        yield
    finally:
        _assumed_gpu.pop()


def implementation_for(op: str, implementation) -> str | None:
    """The choice for ``op`` ("pallas", "xla" or None) out of a user's ``implementation``."""
    if op not in KERNEL_OPS:
        raise ValueError(f"unknown op {op!r}; ops are {KERNEL_OPS}")
    value = normalize_implementation(implementation)
    if isinstance(value, tuple):
        return dict(value).get(op)
    return value


def choose(op: str, implementation, *, shape_class: str, unsupported: str | None = None) -> str:
    """"pallas" or "xla" for one call of ``op``.

    Args:
      op: the op's name (one of ``config.KERNEL_OPS``).
      implementation: the user's choice (see the module docstring).
      shape_class: the call's block-table class (``block_table.attention_class``).
      unsupported: why the kernel cannot take this call's shapes, or None.

    Raises:
      NotImplementedError: "pallas" was asked for a shape the kernel cannot take.
    """
    choice = implementation_for(op, implementation)
    if choice == "pallas" and unsupported:
        raise NotImplementedError(f"{op}: {unsupported}")
    if choice is not None:
        return choice
    if not on_gpu():
        return "xla"
    reason = unsupported or block_table.xla_reason(gpu_kind(), shape_class)
    if reason:
        warn_fallback(op, reason)
        return "xla"
    return "pallas"


def warn_fallback(op: str, reason: str) -> None:
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        warnings.warn(f"jaxspec: {op} runs on XLA on this GPU ({gpu_kind()}): {reason}", RuntimeWarning,
                      stacklevel=3)


_assumed_rows: list[int] = []  # stack of rows_padded_to() multiples
_one_row_rows: list[int] = []  # stack of one_row_padded_to() row counts


def product_rows() -> int:
    """The row multiple a forward pads its tokens to (``model.layers.padded_tokens``): 8 on a GPU,
    where XLA pads a bf16 matrix product's rows to a multiple of 8 and slices the result back (two
    small kernels around every product), 1 elsewhere; inside ``rows_padded_to``, its multiple."""
    if _assumed_rows:
        return _assumed_rows[-1]
    return 8 if on_gpu() else 1


@contextlib.contextmanager
def rows_padded_to(multiple: int):
    """Forwards traced while inside pad their tokens to ``multiple`` rows (1: no padding), whatever
    the backend (benchmarks and tests comparing a program with and without the padding).

    The multiple is read while tracing and is not part of a jitted function's cache key, so a
    program traced outside would be reused inside unchanged (and the other way round): JAX's
    caches are cleared on entering and on leaving. (On a machine the multiple never changes.)"""
    with _traced_with(_assumed_rows, multiple):
        yield


@contextlib.contextmanager
def _traced_with(stack: list[int], value: int):
    """``value`` on top of ``stack`` while inside, with JAX's caches cleared on entering and leaving:
    the value is read while tracing and is not part of a jitted function's cache key."""
    jax.clear_caches()
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()
        jax.clear_caches()


def one_row_rows() -> int:
    """The rows a forward of one token at batch 1 runs over (``model.layers.padded_tokens``): 1 (as it
    is) unless inside ``one_row_padded_to``. At one row XLA:GPU rewrites each product whose operands
    hold under 10M elements as an elementwise multiply and a reduction (a small model's or a draft's
    products, DeepSeek-V4's low-rank ones), writing the multiply out where it does not fuse it
    (``benchmarks/RESULTS.md``); eight rows keep every product a cuBLAS call (at two, XLA pads
    them to eight around each product). Whether that is faster is measured by the GPU check, so the
    engine does not pad yet."""
    return _one_row_rows[-1] if _one_row_rows else 1


@contextlib.contextmanager
def one_row_padded_to(rows: int):
    """Forwards of one token at batch 1 traced while inside run over ``rows`` rows (padding rows
    after the token; 1: none). JAX's caches are cleared on entering and leaving, as in
    ``rows_padded_to``."""
    with _traced_with(_one_row_rows, rows):
        yield


def interpret_mode() -> bool:
    """Pallas kernels run natively on GPU and in interpret mode everywhere else."""
    return not on_gpu()
