"""Every Pallas kernel lowered for an H100 at realistic shapes (``compile_cases.CASES``), run
through the MLIR verifier, compiled to PTX for sm_90a by ``triton`` and read with ``ptxas -v``,
on a machine without a GPU (``tests/pallas/triton_compile.py``).

A case fails on a verifier or compiler error, a register spill where the case forbids one,
or KV read without 16-byte vector loads or 16-byte cp.async (or with scalar bf16 loads).
Report rows (``must_pass=False``: wide heads of Gemma-like models) may fail those criteria,
but then the dispatch must send their shape class to XLA on an H100, with a reason.

The checks of the checker at the end build kernels with each defect on purpose (an i1 loop
bound, a clamped column index) and show they are caught.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import block_table
from tests.pallas import compile_cases, triton_compile

pytest.importorskip("triton", reason="compiling to PTX needs the triton package (the test extra)")


@pytest.mark.parametrize("case", compile_cases.CASES, ids=lambda c: c.id)
def test_kernel_compiles_for_h100(case):
    fn, args = case.build()
    reports = triton_compile.compile_for_h100(fn, *args)
    assert reports, "no kernel was lowered"
    for report in reports:
        found = compile_cases.problems(case, report)
        if case.must_pass:
            assert not found, f"{case.id} ({report.name}): " + "; ".join(found)
        elif found:
            reason = block_table.xla_reason("h100", case.shape_class())
            assert reason, (f"{case.id} fails ({'; '.join(found)}) but the block table does not send "
                            f"{case.shape_class()} to XLA on an H100")


# --------------------------------------------------------------------------- the checker itself


def _copy_kernel(x_ref, o_ref, *, clamp_columns: bool, weak_bound: bool):
    """Copies a [16, 128] bf16 tile through a loop; optionally with the defects the test guards."""
    rows = jnp.arange(16, dtype=jnp.int32)
    cols = jnp.arange(128, dtype=jnp.int32)
    if clamp_columns:
        cols = jnp.where(cols < 128, cols, 0)  # what hid the contiguity of every KV load
    n = 2
    if weak_bound:  # what made the split-KV loop bound i1
        n = jnp.where(pl.program_id(0) == 0, n, 0)

    def body(j, acc):
        return acc + plgpu.load(x_ref.at[(rows + 16 * j)[:, None], cols[None, :]]).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, n, body, jnp.zeros((16, 128), jnp.float32))
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype))


def _copy(clamp_columns=False, weak_bound=False):
    def fn(x):  # [32, 128] -> [16, 128]
        return pl.pallas_call(
            functools.partial(_copy_kernel, clamp_columns=clamp_columns, weak_bound=weak_bound),
            grid=(2,), out_shape=jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), name="copy",
        )(x)
    return triton_compile.compile_for_h100(fn, jax.ShapeDtypeStruct((32, 128), jnp.bfloat16))[0]


def test_checker_passes_a_clean_kernel():
    r = _copy()
    assert r.error is None and r.registers and r.spills == 0
    assert r.wide_loads + r.wide_copies > 0 and not r.scalar_loads.get(2)


def test_checker_catches_an_i1_loop_bound():
    r = _copy(weak_bound=True)
    assert r.error and "scf.for" in r.error and "test_triton_compile.py" in r.error


def test_checker_catches_a_clamped_column_index():
    r = _copy(clamp_columns=True)
    assert r.error is None and r.wide_loads + r.wide_copies == 0 and r.scalar_loads.get(2)


def test_ptx_memory_ops_are_counted_by_width():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];
    @%p2 ld.global.b16 { %rs1 }, [ %rd3 + 0 ];
    ld.global.nc.b32 %r7, [ %rd4 ];
    cp.async.cg.shared.global [ %r8 + 0 ], [ %rd5 + 0 ], 0x10, %r9;
    cp.async.ca.shared.global [ %r10 + 0 ], [ %rd6 + 0 ], 4;
    """
    loads, scalar, copies = triton_compile.ptx_memory_ops(ptx)
    assert loads == {16: 1, 8: 1, 2: 1, 4: 1}
    assert scalar == {2: 1, 4: 1}
    assert copies == {16: 1, 4: 1}
