"""Fused spec-extras gather (interpret mode on CPU) against the reference.

A gather copies values, so the tolerance is exact equality. Interpret mode starts every
output at NaN / INT_MIN, so an element the kernel forgets to write fails the comparison."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.block_sizes import GatherBlocks
from jaxspec.pallas.gather_extras import gather_spec_extras, gather_spec_extras_pallas, gather_spec_extras_reference
from tests.pallas.triton_lowering import triton_calls

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class GatherCase:
    id: str
    R: int  # rows gathered (batch)
    N: int  # rows to gather from (B * A)
    Hd: int | None  # hidden width, None: no hidden state
    dtype: str = "f32"  # hidden dtype
    K: int = 0  # width of an extra [N, K] array (e.g. top-k probabilities), 0: none
    blocks: GatherBlocks | None = None


CASES = [
    GatherCase("B4-hidden64-f32", 4, 16, 64),
    GatherCase("B4-hidden48-bf16-k2", 4, 20, 48, "bf16", K=2),
    GatherCase("B5-no-hidden", 5, 15, None),
    GatherCase("B1-hidden32-bf16", 1, 6, 32, "bf16"),
    GatherCase("B7-hidden50-f32-k3-small-tiles", 7, 21, 50, K=3, blocks=GatherBlocks(block_rows=2, block_cols=(1, 16, 2))),
    GatherCase("B3-no-hidden-small-tiles", 3, 12, None, blocks=GatherBlocks(block_rows=2, block_cols=(1,))),
]


def random_inputs(case: GatherCase):
    """(index, tokens, hidden | None[, extra]) on fresh random values."""
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    index = jnp.asarray(rng.integers(0, case.N, case.R), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 1000, case.N), jnp.int32)
    hidden = None if case.Hd is None else jnp.asarray(rng.standard_normal((case.N, case.Hd)), DTYPES[case.dtype])
    extra = (jnp.asarray(rng.random((case.N, case.K)), jnp.float32),) if case.K else ()
    return (index, tokens, hidden) + extra


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gather_matches_reference(case, interpret):
    index, *arrays = random_inputs(case)
    blocks = case.blocks
    got = gather_spec_extras_pallas(index, *arrays, interpret=interpret, blocks=blocks)
    want = gather_spec_extras_reference(index, *arrays)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _runs_kernel(fn, *args) -> bool:
    """Whether ``fn`` traces to the gather's pallas_call (the kernel really runs)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return "pallas_call" in text and "name=gather_spec_extras" in text


def test_dispatch_selects_the_kernel():
    """implementation="pallas" runs the kernel (its pallas_call is in the program) and agrees
    with the XLA path; implementation="xla" runs no kernel."""
    index, *arrays = random_inputs(CASES[1])
    pallas = lambda *a: gather_spec_extras(*a, implementation="pallas")  # noqa: E731
    xla = lambda *a: gather_spec_extras(*a, implementation="xla")  # noqa: E731
    assert _runs_kernel(pallas, index, *arrays)
    assert not _runs_kernel(xla, index, *arrays)
    for g, w in zip(pallas(index, *arrays), xla(index, *arrays)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("with_hidden", [True, False], ids=["hidden", "no-hidden"])
def test_one_launch_for_all_arrays(with_hidden):
    index, tokens, hidden, extra = random_inputs(CASES[1])
    args = (index, tokens, hidden if with_hidden else None, extra)
    fn = lambda *a: gather_spec_extras_pallas(*a, interpret=False)  # noqa: E731
    assert triton_calls(fn, *args) == 1
