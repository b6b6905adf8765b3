"""The XLA options of the engine's programs: one table per backend (``jaxspec.xla_options``),
overridden or turned off through ``EngineConfig(compiler_options=...)``, checked by jaxlib when
the config is built, and reaching every compiled program through the plan."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec import xla_options
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import Program, decode_program, prefill_program
from jaxspec.engine.scoring import score_program
from jaxspec.engine.state import DecodeState
from jaxspec.model.drafts.base import zero_pool
from jaxspec.model.targets import create_target_pool
from jaxspec.xla_options import CANDIDATES, REJECTED, TABLE, resolve_options

# Visible in a CPU program's compiled text: XLA:CPU hands its dots to YNNPACK as ``__ynn_fusion``
# custom fusions; an empty list of YNN fusion kinds leaves none.
MARKER = ("xla_cpu_experimental_ynn_fusion_type", "")


def test_overrides_are_stored_as_sorted_pairs_and_hash():
    a = js.EngineConfig(compiler_options={"xla_gpu_enable_cublaslt": True, "xla_gpu_enable_triton_gemm": None})
    b = js.EngineConfig(compiler_options=(("xla_gpu_enable_triton_gemm", None), ("xla_gpu_enable_cublaslt", True)))
    assert a == b and hash(a) == hash(b)
    assert a.compiler_options == (("xla_gpu_enable_cublaslt", True), ("xla_gpu_enable_triton_gemm", None))
    assert a != js.EngineConfig() and hash(js.EngineConfig(compiler_options=False)) == hash(js.EngineConfig(
        compiler_options=False))
    kinds = js.EngineConfig(compiler_options={"xla_gpu_enable_command_buffer": ("FUSION", "WHILE")})
    assert kinds.compiler_options == (("xla_gpu_enable_command_buffer", "FUSION,WHILE"),)
    assert {a, b, kinds} == {a, kinds}


@pytest.mark.parametrize("options,match", [
    ({"xla_gpu_enable_trion_gemm": False}, "'xla_gpu_enable_trion_gemm' is not an XLA option"),
    ({"xla_no_such_option": None}, "'xla_no_such_option' is not an XLA option"),
    ({"xla_gpu_enable_triton_gemm": "false"}, "'xla_gpu_enable_triton_gemm': jaxlib refuses the value 'false'"),
    ({"xla_gpu_graph_min_graph_size": True}, "'xla_gpu_graph_min_graph_size': jaxlib refuses the value True"),
    ({"xla_gpu_enable_command_buffer": "FUSION,LOOPS"}, "'xla_gpu_enable_command_buffer': jaxlib refuses"),
    ({"--xla_gpu_enable_triton_gemm": False}, "without leading dashes"),
    ({"xla_gpu_enable_triton_gemm": [0]}, "values are bools"),
    (True, "True is not a setting"),
    ("none", "must be None, False or a mapping"),
])
def test_unknown_options_are_refused_when_the_config_is_built(options, match):
    with pytest.raises(ValueError, match="EngineConfig.compiler_options: .*" + match):
        js.EngineConfig(compiler_options=options)


def test_the_table_and_the_candidates_are_options_jaxlib_takes():
    for options in [*TABLE.values(), *CANDIDATES.values(), *REJECTED.values()]:
        js.EngineConfig(compiler_options=options)


def test_overrides_merge_over_the_table_or_turn_it_off(monkeypatch):
    monkeypatch.setitem(TABLE, "gpu", {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cublaslt": True})
    table = (("xla_gpu_enable_cublaslt", True), ("xla_gpu_enable_triton_gemm", False))
    assert resolve_options(None, "gpu") == table
    setting = js.EngineConfig(compiler_options={"xla_gpu_enable_cublaslt": None, "xla_gpu_graph_min_graph_size": 1,
                                                "xla_gpu_enable_triton_gemm": True}).compiler_options
    assert resolve_options(setting, "gpu") == (("xla_gpu_enable_triton_gemm", True),
                                               ("xla_gpu_graph_min_graph_size", 1))
    assert resolve_options(js.EngineConfig(compiler_options=False).compiler_options, "gpu") == ()
    assert resolve_options(None, "cpu") == tuple(sorted(TABLE["cpu"].items()))
    assert xla_options.compiler_options("gpu") == dict(table)


def _lowered_programs(plan, target):
    """The prefill and decode programs of a plain-decoding ``plan`` lowered for two rows, and the
    prompt-scoring program (echo) for one prompt (nothing runs)."""
    B, W, page = 2, 8, plan.page_size
    tpool = create_target_pool(target.config, num_pages=B * W + 1, page_size=page, dtype=jnp.float32)
    dpool = zero_pool(page, jnp.float32)
    state = DecodeState.empty(batch=B, out_width=16, num_stop=1, hidden_dtype=jnp.float32)
    table = jnp.asarray(1 + np.arange(B * W, dtype=np.int32).reshape(B, W))
    prefill = prefill_program.lower(plan, target.params, None, state, tpool, dpool, table,
                                    jnp.arange(B, dtype=jnp.int32), jnp.zeros((B, 16), jnp.int32),
                                    jnp.asarray([3, 2]), request_arrays(B, max_new=8))
    decode = decode_program.lower(plan, target.params, None, state, tpool, dpool, table)
    score = score_program.lower(plan, target.params, jnp.zeros((1, 16), jnp.int32), dtype="float32", k=2)  # echo
    return {"prefill": prefill, "decode": decode, "score": score}


def test_every_engine_program_compiles_with_the_table(tiny_target, monkeypatch):
    """An engine's plan carries the table for its backend, and its prefill and decode programs
    compile with it: the option's effect is in each program's compiled text. (A draft's loops run
    inside these two programs, one XLA module each, so they compile with the same options.)"""
    monkeypatch.setitem(TABLE, "cpu", dict([MARKER]))
    engine = js.EngineConfig(page_size=4, max_batch=2, max_seq_len=32, steps_per_call=2)
    plan = js.Engine(tiny_target, engine=engine).plan
    assert plan.compiler_options == (MARKER,)
    for name, lowered in _lowered_programs(plan, tiny_target).items():
        assert "__ynn_fusion" not in lowered.compile().as_text(), name
    # Overridden per engine: with an empty table, the same option given in the config makes the
    # same plan (so the same programs); a value of None drops the table's entry; False all of it.
    monkeypatch.setitem(TABLE, "cpu", {})
    assert js.Engine(tiny_target, engine=dataclasses.replace(engine, compiler_options=dict([MARKER]))).plan == plan
    monkeypatch.setitem(TABLE, "cpu", dict([MARKER]))
    dropped = js.Engine(tiny_target, engine=dataclasses.replace(engine, compiler_options={MARKER[0]: None}))
    assert dropped.plan.compiler_options == ()
    off = js.Engine(tiny_target, engine=dataclasses.replace(engine, compiler_options=False))
    assert off.plan.compiler_options == ()


def test_a_program_keeps_one_jit_per_option_set_and_counts_them_all():
    """``Program`` hands each plan to the jit of its option set and counts compiled variants over
    all of them (what ``compiled_programs`` reports): a second call with a plan compiles nothing."""
    fn = lambda plan, x: x @ x.T  # noqa: E731
    program = Program(fn, static_argnames=("plan",))
    x = jnp.ones((4, 8), jnp.float32)
    plain, marked = Opts(()), Opts((MARKER,))
    program(plain, x), program(marked, x), program(marked, x)
    assert set(program.jits) == {(), (MARKER,)} and program.cache_size() == 2
    assert "__ynn_fusion" in program.lower(plain, x).compile().as_text()
    assert "__ynn_fusion" not in program.lower(marked, x).compile().as_text()


class Opts:
    """The one field of a plan a ``Program`` reads."""

    def __init__(self, compiler_options):
        self.compiler_options = compiler_options

    def __hash__(self):
        return hash(self.compiler_options)

    def __eq__(self, other):
        return isinstance(other, Opts) and other.compiler_options == self.compiler_options
