"""Fused spec-extras gather (interpret mode on CPU) against the reference.

A gather copies values, so the tolerance is exact equality. Interpret mode starts every
output at NaN / INT_MIN, so an element the kernel forgets to write fails the comparison."""

from __future__ import annotations

import dataclasses
import zlib

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
    K: int  # topk
    Hd: int | None  # hidden width, None: no hidden state
    dtype: str = "f32"  # hidden dtype
    blocks: GatherBlocks | None = None


CASES = [
    GatherCase("B4-k4-hidden64-f32", 4, 16, 4, 64),
    GatherCase("B4-k2-hidden48-bf16", 4, 20, 2, 48, "bf16"),
    GatherCase("B5-k3-no-hidden", 5, 15, 3, None),
    GatherCase("B1-k1-hidden32-bf16", 1, 6, 1, 32, "bf16"),
    GatherCase("B7-k3-hidden50-f32-small-tiles", 7, 21, 3, 50, blocks=GatherBlocks(block_rows=2, block_hidden=16)),
    GatherCase("B3-k8-no-hidden-small-tiles", 3, 12, 8, None, blocks=GatherBlocks(block_rows=2, block_hidden=1)),
]


def random_inputs(case: GatherCase):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    index = jnp.asarray(rng.integers(0, case.N, case.R), jnp.int32)
    topk_p = jnp.asarray(rng.random((case.N, case.K)), jnp.float32)
    topk_index = jnp.asarray(rng.integers(0, 1000, (case.N, case.K)), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 1000, case.N), jnp.int32)
    hidden = None if case.Hd is None else jnp.asarray(rng.standard_normal((case.N, case.Hd)), DTYPES[case.dtype])
    return index, topk_p, topk_index, tokens, hidden


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gather_matches_reference(case, interpret):
    args = random_inputs(case)
    got = gather_spec_extras_pallas(*args, interpret=interpret, blocks=case.blocks)
    want = gather_spec_extras_reference(*args)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_dispatch_selects_the_kernel():
    args = random_inputs(CASES[0])
    for g, w in zip(gather_spec_extras(*args, implementation="pallas"), gather_spec_extras(*args, implementation="xla")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("with_hidden", [True, False], ids=["hidden", "no-hidden"])
def test_one_launch_for_all_four_arrays(with_hidden):
    args = list(random_inputs(CASES[0]))
    if not with_hidden:
        args[4] = None
    fn = lambda *a: gather_spec_extras_pallas(*a, interpret=False)  # noqa: E731
    assert triton_calls(fn, *args) == 1
