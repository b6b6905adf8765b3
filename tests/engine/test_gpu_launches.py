"""Kernels a step launches on a GPU, counted from the optimized HLO (``benchmarks/gpu_launches.py``).

The counting is checked on a small hand-written program and on the decode program an H200 compiled
(``tests/data/hlo``). Where ``.venv-aot`` exists (``JAXSPEC_AOT=1 scripts/env.sh``: jaxlib's CUDA
plugin), the engine's Llama-3-8B decode program is compiled for an H100 without one and its launches
counted: the small Pallas kernels must leave fewer launches per step than their XLA paths, and the
padded verify rows fewer than XLA's pads and slices around every product. Those programs are compiled
in one background process (``tests/engine/h100_programs.py``) and read here."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from tests.background import ROOT, Job
from tests.conftest import benchmark_module

AOT_PYTHON = Path(ROOT) / ".venv-aot" / "bin" / "python"
AOT_READY = (Path(ROOT) / ".venv-aot" / ".jaxspec-installed").exists()  # written once its install succeeded


def _gpu_launches():
    return benchmark_module("gpu_launches")


# A step loop (no known trip count) around: a cuBLAS call, a layer loop of 3 trips (two fusions and a
# Pallas call a trip; its condition is not launched), a conditional whose larger branch has two
# kernels, and the step loop's condition (one fusion).
PROGRAM = """HloModule m

%fused_add (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %a = s32[] add(%p, %p)
}

%fused_mul (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %m = f32[4] multiply(%p, %p)
}

%fused_lt (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(3)
  ROOT %lt = pred[] compare(%p, %c), direction=LT
}

%layer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %i1 = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_mul
  %z = f32[4]{0} custom-call(%y), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI
  ROOT %r = (s32[], f32[4]{0}) tuple(%i1, %z)
}

%layer_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%small (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_mul
}

%large (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_mul
  ROOT %z = f32[4]{0} copy(%y)
}

%step_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %g = (f32[4]{0}, s8[64]{0}) custom-call(%x), custom_call_target="__cublas$lt$matmul"
  %g0 = f32[4]{0} get-tuple-element(%g), index=0
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %g0)
  %w = (s32[], f32[4]{0}) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
  %wx = f32[4]{0} get-tuple-element(%w), index=1
  %b = s32[] get-tuple-element(%t), index=0
  %k = f32[4]{0} conditional(%b, %wx, %wx), branch_computations={%small, %large}
  ROOT %r = (s32[], f32[4]{0}) tuple(%b, %k)
}

%step_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %c = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

ENTRY %main (a: s32[], x: f32[4]) -> (s32[], f32[4]) {
  %a = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %init = (s32[], f32[4]{0}) tuple(%a, %x)
  ROOT %w = (s32[], f32[4]{0}) while(%init), condition=%step_cond, body=%step_body
}
"""


def test_launches_are_counted_per_step_with_the_layer_loop_times_its_trips():
    n = _gpu_launches().step_launches(PROGRAM)
    assert n.loops == [("w", 3)]
    assert dict(n.per_step) == {
        "cuBLAS": 1,
        "XLA fusion: add": 3, "XLA fusion: multiply": 3 + 1, "Pallas (Triton)": 3,  # the layers; a branch
        "copy": 1, "conditional": 1,  # the larger branch and its dispatch
        "XLA fusion: compare": 1,  # the step loop's condition only
    }
    assert n.total == 14


def test_the_h200_decode_program_launches_its_layer_body_32_times():
    """The 8B decode program as the H200 compiled it: one paged-attention kernel a layer, and every
    layer kind of launch a multiple of 32 apart from the few outside the layer loop."""
    with gzip.open(ROOT + "/tests/data/hlo/h200_llama3_8b_decode_b1.hlo.txt.gz", "rt") as f:
        n = _gpu_launches().step_launches(f.read())
    assert n.loops == [(n.loops[0][0], 32)]
    assert n.per_step["Pallas (Triton)"] == 32
    assert n.per_step["cuBLAS"] >= 32 * 4 + 1  # four products a layer at least, and the head
    assert not any("compare" in k and v >= 32 for k, v in n.per_step.items())  # no layer-loop condition


# Every H100 program these tests read, compiled in one process of .venv-aot (the CUDA plugin loads
# once) started when collection selects this module, beside the rest of the suite (tests/conftest.py).
BACKGROUND_JOB = Job([str(AOT_PYTHON), "-m", "tests.engine.h100_programs", "{tmp}"] if AOT_READY else ["true"],
                     timeout=1500, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))


def _h100(name: str) -> tuple[list[dict], Path]:
    """The rows ``gpu_launches.py`` wrote for the program set ``name`` of ``tests/engine/h100_programs.py``
    (one a batch), and the folder holding their optimized HLO."""
    proc = BACKGROUND_JOB.result()
    out = Path(BACKGROUND_JOB.tmp)
    error = out / f"{name}.error"
    assert not error.exists(), error.read_text()
    assert (out / f"{name}.json").exists(), f"{name} was not compiled (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads((out / f"{name}.json").read_text())["rows"], out / name


needs_aot = pytest.mark.skipif(not AOT_READY, reason="needs .venv-aot (JAXSPEC_AOT=1 scripts/env.sh)")


@needs_aot
def test_the_small_kernels_leave_fewer_launches_in_the_h100_program():
    """Compiled for an H100 without one: the default step (RoPE + K/V write and the norms as Pallas
    kernels) launches fewer kernels than the same step with both ops on XLA, at least the 32 x 3 the
    layer loop saves, and four Pallas kernels a layer (two norms, rope_write, paged attention)."""
    default = _h100("plain")[0][0]
    (xla,), _ = _h100("plain_small_kernels_on_xla")
    assert default["batch"] == xla["batch"] == 1
    assert default["by_kind"]["Pallas (Triton)"] == 4 * 32
    assert xla["kernels_per_step"] - default["kernels_per_step"] >= 3 * 32, (default, xla)


@needs_aot
def test_padded_verify_rows_leave_no_product_padding_in_the_h100_program():
    """An EAGLE-3 chain of 5 at batch 1 verifies 6 rows: padded to 8 once per forward, the layer loop
    runs none of the pads and slices XLA puts around each of its products (at least five a layer),
    and none around paged attention either (the padding rows are attended too)."""
    (padded,), hlo_dir = _h100("eagle3_chain5")
    (unpadded,), _ = _h100("eagle3_chain5_unpadded")
    assert padded["product_rows"] is None and unpadded["product_rows"] == 1
    assert unpadded["kernels_per_step"] - padded["kernels_per_step"] >= 5 * 32, (padded, unpadded)
    n = _gpu_launches().step_launches((hlo_dir / "EAGLE_3_chain_5_b1.hlo.txt").read_text())
    in_layers = {kind: count for kind, count in n.per_step.items() if count >= 32}
    assert not any(kind.split(": ")[-1].startswith(("pad", "slice")) for kind in in_layers), in_layers


@needs_aot
def test_the_hybrid_program_reads_its_weights_where_they_lie_in_the_h100_program():
    """The Qwen3.5-9B-shaped hybrid's decode program compiled for an H100 without one: no layer's
    slice of a stacked weight is copied before its product (the Gated DeltaNet input product's was,
    64 MB a layer, while its output was also kept for the commit), and each layer's two zero-centred
    norms run as the RMSNorm kernel (two a layer, beside the eight attention layers' paged attention)."""
    import jax
    import jax.numpy as jnp

    hlo_copies, st = benchmark_module("hlo_copies"), benchmark_module("step_timing")

    (row,), hlo_dir = _h100("qwen35")
    hlo = (hlo_dir / "plain_b1.hlo.txt").read_text()
    params = jax.eval_shape(lambda: st.random_target(st.qwen35_shape(), jnp.bfloat16).params)
    weights = hlo_copies.stacked_weights(params)
    assert "p0['in_qkv']" in weights and len(weights) >= 8
    assert hlo_copies.find_copies(hlo, weights, {}) == []
    assert row["by_kind"]["Pallas (Triton)"] == 2 * 32 + 8, row


@needs_aot
def test_the_dspark_program_copies_no_draft_weight_in_the_h100_program():
    """DSpark chain 8 at the 8B shape compiled for an H100: its Markov head reads ``w2`` [256, 128256]
    as stored in every slot (its f32 product had XLA:GPU write an f32 copy of it every step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    hlo_copies, st = benchmark_module("hlo_copies"), benchmark_module("step_timing")
    from jaxspec.model.targets import Model

    _, hlo_dir = _h100("dspark_chain8")
    hlo = (hlo_dir / "DSpark_chain_8_b1.hlo.txt").read_text()
    target = Model(config=st.LLAMA3_8B, params=jax.eval_shape(lambda: st.random_target(st.LLAMA3_8B).params),
                   dtype=np.dtype(jnp.bfloat16))
    method = next(m for m in st.METHODS if m.name == "DSpark chain 8")
    draft = jax.eval_shape(lambda: method.make(target, False).params)
    matrices = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(draft)[0]
                if x.ndim == 2 and x.size >= 1 << 20}
    assert "['markov']['w2']" in matrices
    # The draft's matrices as whole arrays (the reading's "pool" kind: any buffer of their shape).
    assert hlo_copies.find_copies(hlo, hlo_copies.stacked_weights(target.params), matrices) == []


@needs_aot
def test_the_v4_program_mixes_its_streams_in_one_kernel_in_the_h100_program():
    """The DeepSeek-V4-Flash-shaped target (10 layers) compiled for an H100 without one: each layer's
    two Sinkhorn normalizations of its hyper-connection matrices run as one kernel each (beside one
    attention kernel a layer; with them on XLA the step launched 2705 kernels at batch 1, 1,560 of
    them their reductions, divisions and loop copies), and the attention products every layer kind
    shares read their weights in place (computed inside the switch over the kinds, wq_b, wo_a and
    wo_b were copied out of the stacked arrays every layer, 192 MB)."""
    import jax
    import jax.numpy as jnp

    hlo_copies, st = benchmark_module("hlo_copies"), benchmark_module("step_timing")

    rows, hlo_dir = _h100("v4")
    row = rows[0]
    assert row["batch"] == 1
    assert row["by_kind"]["Pallas (Triton)"] == 10 + 2 * 10, row
    assert row["kernels_per_step"] < 1300, row
    params = jax.eval_shape(lambda: st.random_target(st.v4_shape(), jnp.bfloat16).params)
    weights = hlo_copies.stacked_weights(params)
    assert {"['wq_b']", "['wo_a']", "['wo_b']"} <= set(weights)
    copied = {c["array"] for c in hlo_copies.find_copies((hlo_dir / "plain_b1.hlo.txt").read_text(), weights, {})}
    assert not copied & {"['wq_b']", "['wo_a']", "['wo_b']"}, copied


@needs_aot
def test_one_row_forwards_over_eight_rows_keep_every_product_on_cublas_in_the_h100_program():
    """Qwen3-0.6B's shape at batch 1, compiled for an H100 without one: on one row XLA:GPU rewrites its
    products (all under 10M elements) as a multiply and a reduction, a few of them written out; its
    one-token forwards over 8 rows (``dispatch.one_row_padded_to``, what the GPU check times) leave
    every product a cuBLAS call and no rewritten one."""
    import re

    rewritten = re.compile(r"multiply\(.*op_name=\"[^\"]*dot_general")
    counts = {}
    for rows in (1, 8):
        (row,), hlo_dir = _h100(f"qwen3_one_row_{rows}")
        assert row["one_row_rows"] == rows
        hlo = (hlo_dir / "plain_b1.hlo.txt").read_text()
        counts[rows] = (row["by_kind"].get("cuBLAS", 0), len(rewritten.findall(hlo)))
    assert counts[1][1] > 0 and counts[1][0] < 28, counts  # a few cuBLAS calls (the head), the rest rewritten
    assert counts[8][1] == 0 and counts[8][0] >= 28 * 4, counts  # q/k/v, o, gate/up, down every layer


@needs_aot
def test_a_decode_of_four_rows_launches_as_few_kernels_as_one_of_eight_in_the_h100_program():
    """The 8B plain step at batch 4 compiled for an H100: each request's token runs over 2 rows, so no
    product has rows to pad (XLA's pad and slice around every product made it 595 kernels a step
    against 370 at batch 8)."""
    rows, _ = _h100("plain")
    four, eight = (next(r for r in rows if r["batch"] == b) for b in (4, 8))
    assert four["kernels_per_step"] <= eight["kernels_per_step"] + 2, (four, eight)


@needs_aot
def test_the_v4_routed_experts_read_their_weights_in_place_in_the_h100_program():
    """The DeepSeek-V4-shaped target at batch 16 compiled for an H100 without one: 96 (token, expert)
    assignments over 32 experts run as the grouped-matmul kernel (gate/up and down, two launches a
    layer) reading the stacked experts' weights where they lie. Handed a layer's slice, the kernel's
    custom call had XLA copy every expert's weights of the layer first (1.6 GB a layer)."""
    import jax
    import jax.numpy as jnp

    hlo_copies, st = benchmark_module("hlo_copies"), benchmark_module("step_timing")

    rows, hlo_dir = _h100("v4")
    row = next(r for r in rows if r["batch"] == 16)
    assert row["by_kind"]["Pallas (Triton)"] == 10 + 2 * 10 + 2 * 10, row  # attention, Sinkhorn x 2, experts x 2
    params = jax.eval_shape(lambda: st.random_target(st.v4_shape(), jnp.bfloat16).params)
    weights = hlo_copies.stacked_weights(params)
    experts = {"['experts_gate']", "['experts_up']", "['experts_down']"}
    assert experts <= set(weights)
    copied = {c["array"] for c in hlo_copies.find_copies((hlo_dir / "plain_b16.hlo.txt").read_text(), weights, {})}
    assert not copied & experts, copied
