"""Whole speculative steps with ``implementation="pallas"`` lowered for CUDA on a CPU machine:
every kernel call site of the real engine (draft loop, verify, compaction, draft extend,
prefill; MHA, MLA and MLA+indexer pools; EAGLE-3, frozen-KV, MTP and DFlash drafts) gets through the
Pallas-to-Triton lowering with the shapes the engine gives it, and the static topk=1 path has
no KV move. The kernel tests cover each kernel alone; this covers how the engine calls them."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest

import jaxspec as js
from jaxspec.engine.prefill import prefill
from jaxspec.engine.programs import decode_step
from jaxspec.pallas import dispatch
from tests.spec.test_frozen_kv import assistant
from tests.spec.test_lossless import drafts
from tests.spec.test_mla_spec import DSA_PROMPTS, dsa_pair, golden, step_prompts
from tests.spec.test_step import prefill_args, prepared
from tests.pallas.triton_lowering import TRITON_CALL, lower_for_cuda

CHAIN = js.SpecConfig.chain(3)
TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)


def _llama(kind):
    def make(tiny_target):
        draft = assistant(tiny_target) if kind == "frozen_kv" else drafts(tiny_target)[kind]
        return tiny_target, draft, None
    return make


def _dflash(version):
    def make(tiny_target):
        from tests.spec.test_dflash import tiny_dflash

        return tiny_target, tiny_dflash(tiny_target, version), None
    return make


def _mtp(tiny_target):
    case, target, draft, _ = golden("deepseek_v3_dense")
    return target, draft, step_prompts(case)


def _dsa(tiny_target):
    return (*dsa_pair(), DSA_PROMPTS)


# (pair, spec, page size, kernels expected in one spec step). Page sizes and prompts match the
# step tests so the prefill compiles are shared.
CASES = [
    # A Llama-family target layer normalizes in one kernel each (rms_norm), rotates q and k and writes
    # K/V in one (rope_write), then attends.
    ("eagle3-chain", _llama("eagle3"), CHAIN, 4, {"rms_norm", "rope_write", "paged_attention", "gather_spec_extras"}),
    ("eagle3-tree", _llama("eagle3"), TREE, 4,
     {"rms_norm", "rope_write", "paged_attention", "kv_move", "gather_spec_extras"}),
    # Frozen KV: the seed step is folded into the draft loop; extend only gathers the root and the
    # target's hidden at the last accepted row (the same fused gather as every draft).
    ("frozen_kv-tree", _llama("frozen_kv"), TREE, 4,
     {"rms_norm", "rope_write", "paged_attention", "kv_move", "gather_spec_extras"}),
    # DFlash: the block forward's full layer through the paged kernel (its sliding layer reads its
    # window with XLA), the context extend writes only; no fused gather.
    ("dflash-chain", _dflash(1), CHAIN, 4, {"rms_norm", "rope_write", "paged_attention"}),
    ("dflash2-tree", _dflash(2), TREE, 4, {"rms_norm", "rope_write", "paged_attention", "kv_move"}),
    ("mtp_mla-chain", _mtp, js.SpecConfig.chain(2), 4, {"mla_attention", "gather_spec_extras"}),
    ("mtp_mla-tree", _mtp, js.SpecConfig(num_steps=2, topk=2, num_draft_tokens=4), 4,
     {"mla_attention", "kv_move", "gather_spec_extras"}),
    # DeepSeek-V3.2 with MoE layers: the routed experts run as the grouped-matmul kernels (gate/up with
    # the activation, then down).
    ("dsa_indexer-tree", _dsa, js.SpecConfig(num_steps=3, topk=3, num_draft_tokens=8), 1,
     {"mla_attention", "kv_move", "gather_spec_extras", "grouped_gated_matmul", "grouped_matmul"}),
]


def kernel_names(hlo: str) -> list[str]:
    """Names of the Triton kernels launched by a lowered program, in order."""
    return [re.search(r'name = "([^"]*)"', line).group(1) for line in hlo.splitlines() if TRITON_CALL in line]


@pytest.mark.parametrize("make,spec,page,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_spec_step_lowers_to_triton_kernels(tiny_target, monkeypatch, make, spec, page, expected):
    target, draft, prompts = make(tiny_target)
    kw = {} if prompts is None else {"prompts": prompts}
    plan, state, tpool, dpool, table = prepared(target, draft, spec, page, **kw)  # runs on CPU (XLA)
    plan = dataclasses.replace(plan, implementation="pallas")
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)  # native kernels, as on a GPU
    hlo = lower_for_cuda(functools.partial(decode_step, plan), target.params, draft.params, state, tpool,
                         dpool, table)
    assert set(kernel_names(hlo)) == expected


@pytest.mark.parametrize("make,spec,page,expected", [
    (_llama("eagle3"), TREE, 4, {"rms_norm", "rope_write", "paged_attention"}),
    (_mtp, js.SpecConfig.chain(2), 4, {"mla_attention"}),
], ids=["eagle3", "mtp_mla"])
def test_prefill_lowers_to_triton_kernels(tiny_target, monkeypatch, make, spec, page, expected):
    target, draft, prompts = make(tiny_target)
    kw = {} if prompts is None else {"prompts": prompts}
    plan, args = prefill_args(target, draft, spec, page, **kw)
    plan = dataclasses.replace(plan, implementation="pallas")
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    assert set(kernel_names(lower_for_cuda(functools.partial(prefill, plan), *args))) == expected
