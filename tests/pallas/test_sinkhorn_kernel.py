"""Sinkhorn kernel (interpret mode on CPU) against its reference, which is the model's XLA path, on
fresh random logits: V4's 4 streams and the tiny configs' 2, one matrix (decode) to more than one
program's block (masked), one iteration to V4's 20; a matrix normalized alone equals the same matrix
inside a batch bit for bit; and DeepSeek-V4's forward with the kernel equals its XLA path."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.sinkhorn import MATRICES_PER_PROGRAM, sinkhorn, sinkhorn_pallas, sinkhorn_reference

MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]


@dataclasses.dataclass(frozen=True)
class SinkhornCase:
    id: str
    matrices: int
    streams: int = 4
    iters: int = 20
    eps: float = 1e-6
    scale: float = 3.0  # logits' spread: large values test the softmax's max subtraction


CASES = [
    SinkhornCase("decode-b1-v4", 1),
    SinkhornCase("verify-b4-n6-v4", 24),
    SinkhornCase("two-programs-masked", MATRICES_PER_PROGRAM + 5),
    SinkhornCase("tiny-2-streams-4-iters", 7, streams=2, iters=4),
    SinkhornCase("one-iteration", 3, iters=1),
    SinkhornCase("large-logits", 5, scale=60.0),
]


def _logits(case: SinkhornCase):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    return jnp.asarray(rng.standard_normal((case.matrices, case.streams, case.streams)) * case.scale, jnp.float32)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_sinkhorn_matches_reference(case, interpret):
    x = _logits(case)
    got = np.asarray(sinkhorn_pallas(x, iters=case.iters, eps=case.eps, interpret=interpret))
    want = np.asarray(sinkhorn_reference(x, iters=case.iters, eps=case.eps))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)
    # the last normalization is the columns': each sums to total / (total + eps), about 1
    np.testing.assert_allclose(got.sum(axis=-2), 1.0, atol=1e-3)
    # one iteration fewer is a different matrix: the test sees the iteration count
    if case.iters > 1:
        fewer = np.asarray(sinkhorn_reference(x, iters=case.iters - 1, eps=case.eps))
        assert np.abs(fewer - want).max() > 1e-6


def test_a_matrix_alone_equals_itself_in_a_batch():
    case = CASES[2]
    x = _logits(case)
    whole = np.asarray(sinkhorn_pallas(x, iters=case.iters, eps=case.eps, interpret=True))
    for m in (0, 77, case.matrices - 1):
        alone = np.asarray(sinkhorn_pallas(x[m:m + 1], iters=case.iters, eps=case.eps, interpret=True))
        np.testing.assert_array_equal(alone[0], whole[m])


def test_the_dispatcher_keeps_leading_axes_and_the_xla_path_is_the_reference():
    case = CASES[1]
    x = _logits(case).reshape(4, 6, case.streams, case.streams)
    xla = sinkhorn(x, iters=case.iters, eps=case.eps)  # on a CPU: XLA
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(
        sinkhorn_reference(x.reshape(24, 4, 4), iters=case.iters, eps=case.eps)).reshape(x.shape))
    kernel = sinkhorn(x, iters=case.iters, eps=case.eps, implementation="pallas")
    assert kernel.shape == x.shape
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(xla), rtol=2e-6, atol=2e-7)


def test_v4_forward_with_the_kernel_matches_hf_and_its_xla_path():
    """The golden tiny DeepSeek-V4 (2 streams, Sinkhorn in every layer) with the kernel (interpret
    mode): HF's logits at the golden's tolerance, and the XLA path's to f32 rounding."""
    from jaxspec.model.targets import forward_fresh  # noqa: PLC0415
    from tests.model.targets.test_deepseek_v4 import CASE, arrays, golden_model  # noqa: PLC0415

    ref, m = arrays(CASE), golden_model()
    tokens = np.concatenate([ref["prompt_0"], ref["greedy_0"]])[None, :].astype(np.int32)

    def logits(choice):
        return np.asarray(jax.jit(lambda p, t: forward_fresh(m.config, p, t, dtype=np.float32,
                                                             implementation={"sinkhorn": choice})[0])(m.params, tokens))

    kernel, xla = logits("pallas"), logits("xla")
    np.testing.assert_allclose(kernel[0], ref["full_logits_0"], atol=CASE["atol"], rtol=CASE["rtol"])
    np.testing.assert_allclose(kernel, xla, rtol=1e-4, atol=1e-4)
