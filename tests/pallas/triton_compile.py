"""Lower, verify and compile Pallas-Triton kernels for an H100 on a machine without a GPU.

What a GPU user would meet first, checked on CPU:

1. ``jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`` runs the Pallas-to-Triton
   lowering of every ``pallas_call`` in ``fn`` (no array is allocated; ``args`` may be
   ``jax.ShapeDtypeStruct``). The lowering asks for the local GPU; it is pointed at JAX's own
   H100 description, and each Triton module is captured as it is built, with the launch
   parameters (``num_warps``, ``num_stages``) the kernel would be compiled with.
2. Each module goes through the MLIR verifier (the plain ``lower()`` does not verify: a loop
   bound of type i1 lowers cleanly and only fails on the GPU).
3. The verified Triton IR is compiled for ``sm_90a`` by the ``triton`` package (a close proxy
   of the Triton that XLA bundles), and ``ptxas -v`` reports registers and spills.
4. The PTX is read for how global memory is read: 16-byte vector loads, scalar loads,
   16-byte ``cp.async`` (what ``num_stages`` pipelining needs), ``wgmma`` / ``mma.sync``.

This touches private JAX modules (``jax._src.pallas.triton``) on purpose: it is a check of
what those modules produce. ``triton`` is imported only when compiling (it is a test extra).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile
import warnings
from typing import Any, Callable

import jax

# Compute capability 9.0 (H100 / H200) with the architecture-specific features (wgmma, TMA).
SM_ARCH = "sm_90a"


@dataclasses.dataclass
class TritonModule:
    """One ``pallas_call`` as the GPU would receive it."""

    name: str
    asm: str  # Triton IR (generic MLIR form)
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]
    verify_error: str | None  # the MLIR verifier's message, None when the module verifies


@dataclasses.dataclass
class KernelReport:
    """What compiling one Triton module for ``sm_90a`` produced.

    Attributes:
      error: the verifier or compiler error (first lines), None when it compiled.
      registers, spill_stores, spill_loads: ``ptxas -v`` per thread (bytes for spills).
      shared: static shared memory of the kernel in bytes.
      loads: global loads by width in bytes (``{2: 12, 16: 40}``), vector or not.
      scalar_loads: global loads by element width that are not vector loads.
      cp_async: ``cp.async`` copies by size in bytes (global to shared, pipelined loads).
      wgmma, mma: Hopper warp-group MMAs and ``mma.sync`` instructions in the PTX.
    """

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]
    error: str | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    loads: dict[int, int] = dataclasses.field(default_factory=dict)
    scalar_loads: dict[int, int] = dataclasses.field(default_factory=dict)
    cp_async: dict[int, int] = dataclasses.field(default_factory=dict)
    wgmma: int = 0
    mma: int = 0

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def wide_loads(self) -> int:
        """16-byte (or wider) global vector loads."""
        return sum(n for width, n in self.loads.items() if width >= 16)

    @property
    def wide_copies(self) -> int:
        """16-byte ``cp.async`` copies."""
        return sum(n for width, n in self.cp_async.items() if width >= 16)


# --------------------------------------------------------------------------- capture


@contextlib.contextmanager
def as_if_h100():
    """Pallas-Triton lowering targets an H100 while inside (JAX's own description of it), and
    the kernels take their block sizes from the H100 entries of the block table."""
    from jax._src.pallas.triton import gpu_info

    from jaxspec.pallas import dispatch

    saved = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
    try:
        with warnings.catch_warnings(), dispatch.assume_gpu("h100"):
            warnings.simplefilter("ignore", DeprecationWarning)  # JAX >= 0.11: the Triton backend is deprecated
            yield
    finally:
        gpu_info.get_gpu_info = saved


def _first_lines(text: str, n: int = 6) -> str:
    return "\n".join(str(text).strip().splitlines()[:n])


def _verify_message(error: Exception) -> str:
    """The verifier's complaint on one line, with the kernel source line it points at:
    ``paged_attention.py:205: 'scf.for' op failed to verify that ...``."""
    for line in str(error).splitlines():
        if line.strip().startswith("error:"):
            where = re.findall(r"([\w.]+\.py)\":(\d+)", line)
            what = line.rsplit("): ", 1)[-1].removeprefix("error: ").strip()
            return f"{where[-1][0]}:{where[-1][1]}: {what}" if where else what
    return _first_lines(error, 1)


@contextlib.contextmanager
def _capturing(out: list[TritonModule]):
    from jax._src.pallas.triton import pallas_call_registration as registration

    lowering = registration.lowering  # the module object the registration calls through
    original = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx=None):
        result = original(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx=mlir_ctx)
        # The launch parameters are locals of the caller (the pallas_call lowering rule).
        caller = inspect.currentframe().f_back.f_locals
        if "num_warps" not in caller or "num_stages" not in caller:
            raise RuntimeError("this JAX version's Pallas-Triton lowering no longer has num_warps / num_stages "
                               "where triton_compile expects them; update tests/pallas/triton_compile.py")
        op = result.module.operation
        try:
            op.verify()
            error = None
        except Exception as e:  # MLIRError: the message lists the failing ops
            error = f"verifier: {_verify_message(e)}"
        out.append(TritonModule(name=str(caller.get("name", "kernel")), asm=op.get_asm(),
                                num_warps=int(caller["num_warps"]), num_stages=int(caller["num_stages"]),
                                grid=tuple(int(g) for g in result.grid), verify_error=error))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def capture_triton_modules(fn: Callable, *args: Any) -> list[TritonModule]:
    """The Triton modules of every ``pallas_call`` in ``jax.jit(fn)(*args)``, lowered for an H100.

    ``args`` may be ``jax.ShapeDtypeStruct``: nothing is allocated or run. Pass a fresh
    ``fn`` per call (a new closure): JAX caches lowerings by function.
    """
    modules: list[TritonModule] = []
    with as_if_h100(), _capturing(modules):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    if not modules:
        raise ValueError("no Pallas-Triton kernel was lowered (a cached lowering, or no pallas_call in fn)")
    return modules


# --------------------------------------------------------------------------- compile


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


# `ld.global[.qualifiers][.vN].type` ; qualifiers such as .nc, .L1::evict_last, .L2::cache_hint.
_LOAD = re.compile(r"\bld\.global((?:\.[\w:]+)*?)(?:\.v(\d))?\.([bsuf])(\d+)\s")
# `cp.async.{ca,cg}.shared.global [dst], [src], size[, src_size];`
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")


def ptx_memory_ops(ptx: str) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """(global loads by total width, scalar global loads by width, cp.async by size), in bytes."""
    loads: collections.Counter = collections.Counter()
    scalar: collections.Counter = collections.Counter()
    for m in _LOAD.finditer(ptx):
        lanes = int(m.group(2) or 1)
        width = lanes * int(m.group(4)) // 8
        loads[width] += 1
        if lanes == 1:
            scalar[width] += 1
    copies = collections.Counter(int(m.group(1), 0) for m in _CP_ASYNC.finditer(ptx))
    return dict(loads), dict(scalar), dict(copies)


def compile_module(module: TritonModule) -> KernelReport:
    """Compiles one captured module for ``sm_90a`` and reads ``ptxas -v`` and the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    report = KernelReport(name=module.name, num_warps=module.num_warps, num_stages=module.num_stages,
                          grid=module.grid, error=module.verify_error)
    if report.error is not None:
        return report
    with tempfile.TemporaryDirectory() as tmp:
        ttir = os.path.join(tmp, f"{module.name}.ttir")
        with open(ttir, "w") as f:
            f.write(module.asm)
        try:
            compiled = triton.compile(ttir, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=module.num_warps, num_stages=module.num_stages))
        except Exception as e:  # triton raises its own CompilationError / RuntimeError types
            report.error = f"triton.compile: {_first_lines(e)}"
            return report
        ptx = compiled.asm["ptx"]
        ptx_path = os.path.join(tmp, f"{module.name}.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        run = subprocess.run([_ptxas(), f"-arch={SM_ARCH}", "-v", ptx_path, "-o", os.devnull],
                             capture_output=True, text=True)
    if run.returncode:
        report.error = f"ptxas: {_first_lines(run.stderr)}"
        return report

    def stat(pattern: str) -> int | None:
        m = re.search(pattern, run.stderr)
        return None if m is None else int(m.group(1))

    report.registers = stat(r"Used (\d+) registers")
    report.spill_stores = stat(r"(\d+) bytes spill stores")
    report.spill_loads = stat(r"(\d+) bytes spill loads")
    report.shared = int(compiled.metadata.shared)
    report.loads, report.scalar_loads, report.cp_async = ptx_memory_ops(ptx)
    report.wgmma = len(re.findall(r"\bwgmma\.mma_async", ptx))
    report.mma = len(re.findall(r"\bmma\.sync", ptx))
    return report


def compile_for_h100(fn: Callable, *args: Any) -> list[KernelReport]:
    """Every Pallas kernel of ``jax.jit(fn)(*args)``, verified and compiled for ``sm_90a``."""
    return [compile_module(m) for m in capture_triton_modules(fn, *args)]
