"""Every MoE family's routed experts through the grouped-matmul kernel (interpret mode on CPU) inside
the model: a prefill over the longest golden sequence matches HF's logits, as the XLA path does.
One row per family that routes (DeepSeek-V3, DeepSeek-V4 with its clamped SwiGLU and hashed layers,
Qwen3-Next and Qwen3.5-MoE, Gemma 4's GELU-tanh experts beside its dense MLP). The kernel against
its reference and the layout: ``tests/pallas/test_grouped_matmul_kernel.py``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.model.targets import forward_sequence
from tests.model import sliding_golden
from tests.model.golden import arrays, cases
from tests.model.targets import test_deepseek_v4, test_golden_deepseek, test_golden_hybrid

KERNEL = {"grouped_matmul": "pallas"}


def _deepseek_v3():
    case, model, ref = test_golden_deepseek.load("deepseek_v3_moe")
    return model, case["prompts"][-1], ref[f"logits_{len(case['prompts']) - 1}"], dict(atol=case["atol"], rtol=case["rtol"])


def _deepseek_v4():
    case = next(c for c in cases() if c["name"] == "deepseek_v4")
    ref = arrays(case)
    tokens = np.concatenate([ref["prompt_0"], ref["greedy_0"]])
    return test_deepseek_v4.golden_model(), tokens, ref["full_logits_0"], dict(atol=case["atol"], rtol=case["rtol"])


def _hybrid(name):
    def build():
        g = test_golden_hybrid.golden(name)
        return test_golden_hybrid.target(name), g["prompt_2"], g["logits_2"], test_golden_hybrid.TOL
    return build


def _gemma4_moe():
    c, ref = sliding_golden.case("gemma4_moe"), sliding_golden.arrays("gemma4_moe")
    i = len(c["prompts"]) - 1
    return sliding_golden.target("gemma4_moe"), c["prompts"][i], ref[f"logits_{i}"], dict(atol=c["atol"], rtol=c["rtol"])


FAMILIES = {
    "deepseek_v3_moe": _deepseek_v3,
    "deepseek_v4": _deepseek_v4,
    "qwen3_next": _hybrid("qwen3_next"),
    "qwen3_5_moe_condgen": _hybrid("qwen3_5_moe_condgen"),
    "gemma4_moe": _gemma4_moe,
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_with_the_grouped_kernel_matches_hf(name):
    model, tokens, want, tol = FAMILIES[name]()
    tokens = np.asarray(tokens, np.int32)[None]
    jaxpr = str(jax.make_jaxpr(lambda t: forward_sequence(model, t, implementation=KERNEL)[0])(tokens))
    assert "grouped_gated_matmul" in jaxpr  # the routed experts ran through the kernel
    logits, _, _ = forward_sequence(model, tokens, implementation=KERNEL)
    np.testing.assert_allclose(np.asarray(logits[0]), want, **tol)
