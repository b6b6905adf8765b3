"""What the compiled step copies: each program's optimized HLO read for buffers that only hold a
layer's slice of a stacked weight, a whole stacked weight or a whole KV-pool array
(``benchmarks/hlo_copies.py``, which the GPU check runs on the 8B shape).

On a GPU, XLA hands each layer's slice to cuBLAS where it lies (a ``dynamic-slice-fusion``): the
program the H200 compiled (kept in ``tests/data/hlo``) copies nothing. XLA's CPU backend has no such
fusion, so the CPU program copies each weight matrix's slice once per layer iteration, and nothing
more: one copy per matrix in plain decode, chain and tree steps, no whole weight, no whole pool."""

from __future__ import annotations

import functools
import gzip

import jax
import jax.numpy as jnp
import pytest

import jaxspec as js
from jaxspec.engine.programs import decode_steps
from tests.background import ROOT
from tests.conftest import benchmark_module

MATRICES = ["['w_down']", "['w_gate_up']", "['wo']", "['wqkv']"]


@functools.cache
def _tools():
    return benchmark_module("step_timing"), benchmark_module("hlo_copies")


CASES = [  # name, dtype, page size, spec
    ("plain", jnp.bfloat16, 16, None),
    ("eagle3-chain", jnp.float32, 1, js.SpecConfig.chain(3)),
    ("eagle3-tree", jnp.bfloat16, 16, js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)),
]


@pytest.mark.parametrize("name,dtype,page,spec", CASES, ids=[c[0] for c in CASES])
def test_the_cpu_step_copies_one_slice_per_weight_matrix_and_no_whole_array(name, dtype, page, spec):
    st, hc = _tools()
    target = st.random_target(st.TINY, dtype)
    draft = None if spec is None else st.eagle3_for(target)
    stepper = st.Stepper(target, draft, spec, batch=2, context=40, steps=2, repeats=1, page_size=page)
    try:
        _, copies = hc.decode_copies(stepper, target)
    finally:
        stepper.close()
    assert hc.summarize(copies) == {f"layer slice: {m}": 1 for m in MATRICES}, copies


def test_a_program_that_copies_its_pool_is_caught():
    """The negative control: the same decode program compiled without donating its pools must copy
    them into fresh output buffers, and the reading says so."""
    st, hc = _tools()
    target = st.random_target(st.TINY, jnp.float32)
    stepper = st.Stepper(target, None, None, batch=2, context=40, steps=2, repeats=1)
    try:
        kept = jax.jit(decode_steps, static_argnames=("plan",))  # no donation
        hlo = kept.lower(stepper.plan, target.params, None, stepper.state, stepper.tpool, stepper.dpool,
                         stepper.table).compile().as_text()
    finally:
        stepper.close()
    kinds = {c["kind"] for c in hc.find_copies(hlo, hc.stacked_weights(target.params), hc.pool_arrays(stepper.tpool))}
    assert "whole pool" in kinds, kinds


def test_the_h200_decode_program_reads_every_weight_where_it_lies():
    """The Llama-3-8B-shaped decode program (batch 1) as XLA compiled it on an NVIDIA H200 (jax 0.11.2,
    the engine's options table), saved by ``gpu_check.py --items copies``: each of the four products
    per layer is a dynamic-slice fusion around a cuBLAS-LT matmul, and nothing is copied."""
    _, hc = _tools()
    with gzip.open(ROOT + "/tests/data/hlo/h200_llama3_8b_decode_b1.hlo.txt.gz", "rt") as f:
        hlo = f.read()
    L, D, F = 32, 4096, 14336
    weights = {"['wqkv']": (L, D, 6144), "['wo']": (L, D, D), "['w_gate_up']": (L, D, 2 * F), "['w_down']": (L, F, D)}
    pools = {".k": (L, 2064, 8, 128), ".v": (L, 2064, 8, 128)}
    assert hc.find_copies(hlo, weights, pools) == []
    comps = hc.computations(hlo)
    in_place = [c for c in comps if c.startswith("dynamic-slice-fusion")]
    assert len(in_place) == 4 and all(any("__cublas$lt$matmul" in line for line in comps[c]) for c in in_place)
