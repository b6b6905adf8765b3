"""RMSNorm kernel (interpret mode on CPU) against its reference and the model's XLA path, on fresh
random rows: padded widths, the layer's weights picked out of the stacked ones, the dtype of the
result, Llama's and the zero-centred (Qwen3-Next) arithmetic, a row normalized alone equal bit
for bit to the same row inside a batch, and the rows recorded into their layer's slot of an aux-tap
buffer by the same launch."""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.layers import stacked_rms_norm
from jaxspec.pallas.rms_norm import record_reference, rms_norm_pallas, rms_norm_reference
from tests.pallas.triton_lowering import triton_calls

MODES = [pytest.param(True, id="interpret"), pytest.param(False, id="native", marks=pytest.mark.gpu)]
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class NormCase:
    id: str
    rows: int
    width: int
    dtype: str = "f32"
    weight_dtype: str | None = None  # None: as x
    layers: int = 4
    eps: float = 1e-6
    centred: bool = False  # zero-centred weights: x_hat * (1 + w) in f32 (Qwen3-Next / Qwen3.5)

    def tolerance(self) -> float:
        return 2e-6 if self.dtype == "f32" else 1e-2  # bf16: the mean summed in another order, one rounding


CASES = [
    NormCase("decode-h4096-bf16", 1, 4096, "bf16"),
    NormCase("rows7-h40-f32", 7, 40),  # width padded to 64, masked
    NormCase("rows5-h3584-bf16-eps1e-5", 5, 3584, "bf16", eps=1e-5),
    NormCase("rows3-h48-bf16-f32-weights", 3, 48, "bf16", "f32"),  # the product promotes to f32
    NormCase("centred-decode-h4096-bf16", 1, 4096, "bf16", centred=True),
    NormCase("centred-rows7-h40-f32", 7, 40, centred=True),
    NormCase("centred-rows3-h48-bf16-f32-weights", 3, 48, "bf16", "f32", centred=True),  # x's dtype out
]


def _inputs(case: NormCase):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    x = jnp.asarray(rng.standard_normal((case.rows, case.width)) * 3.0, DTYPES[case.dtype])
    w = jnp.asarray(1.0 + rng.standard_normal((case.layers, case.width)) * 0.2, DTYPES[case.weight_dtype or case.dtype])
    return x, w, jnp.int32(case.layers - 2)


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rms_norm_matches_reference(case, interpret):
    x, w, layer = _inputs(case)
    got = rms_norm_pallas(x, w, layer, case.eps, interpret=interpret, centred=case.centred)
    want = rms_norm_reference(x, w, layer, case.eps, case.centred)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.dtype == (x.dtype if case.centred else jnp.result_type(w.dtype, x.dtype))
    _close(got, want, case.tolerance())
    # Another layer's weights give another result: the kernel reads the right row of the stack.
    assert not np.allclose(np.asarray(got, np.float32),
                           np.asarray(rms_norm_reference(x, w, layer + 1, case.eps, case.centred), np.float32),
                           atol=1e-2)
    # And the other arithmetic gives another result: the kernel applies the one asked for.
    assert not np.allclose(np.asarray(got, np.float32),
                           np.asarray(rms_norm_reference(x, w, layer, case.eps, not case.centred), np.float32),
                           atol=1e-2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_row_alone_equals_the_row_in_a_batch(case):
    """Verify and decode normalize a token identically: a row's result does not depend on its batch."""
    x, w, layer = _inputs(case)
    whole = np.asarray(rms_norm_pallas(x, w, layer, case.eps, interpret=True, centred=case.centred))
    for r in range(case.rows):
        alone = np.asarray(rms_norm_pallas(x[r:r + 1], w, layer, case.eps, interpret=True, centred=case.centred))
        np.testing.assert_array_equal(alone[0], whole[r])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernel_path_matches_the_xla_path(case):
    x, w, layer = _inputs(case)
    x3 = x[None]  # [B, T, H], as the layer calls it
    got = stacked_rms_norm(x3, w, layer, eps=case.eps, implementation="pallas", centred=case.centred)
    want = stacked_rms_norm(x3, w, layer, eps=case.eps, implementation="xla", centred=case.centred)
    assert got.shape == want.shape and got.dtype == want.dtype
    _close(got, want, case.tolerance())


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=lambda c: c.id)
def test_recording_writes_the_rows_into_their_layers_slot(case, interpret):
    """``record``: the normalized rows as without it, and the input rows stored unchanged in the
    layer's slot of the buffer (``slots[layer]``), every other slot kept; on both paths."""
    x, w, layer = _inputs(case)
    rng = np.random.default_rng(5)
    buffer = jnp.asarray(rng.standard_normal((3, case.rows, case.width)), x.dtype)  # two taps + the dummy slot
    slots = jnp.asarray([2, 2, 1, 0, 2], jnp.int32)  # layer 2 (``_inputs``) -> slot 1
    got, recorded = rms_norm_pallas(x, w, layer, case.eps, interpret=interpret, record=(buffer, slots))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rms_norm_pallas(x, w, layer, case.eps,
                                                                              interpret=interpret)))
    want = record_reference(buffer, slots, layer, x)
    np.testing.assert_array_equal(np.asarray(recorded), np.asarray(want))
    assert not np.array_equal(np.asarray(want), np.asarray(buffer))  # the record changed the buffer
    x3, buffer4 = x[None], buffer[:, None]  # [B, T, H], [S, B, T, H]: as the layer calls it
    _, via_xla = stacked_rms_norm(x3, w, layer, eps=case.eps, implementation="xla", record=(buffer4, slots))
    np.testing.assert_array_equal(np.asarray(via_xla[:, 0]), np.asarray(want))
    with pytest.raises(ValueError, match="record buffer"):
        rms_norm_pallas(x, w, layer, case.eps, interpret=interpret, record=(buffer[:, :1], slots))


def test_rms_norm_is_one_kernel_per_call():
    x, w, layer = _inputs(CASES[0])
    assert triton_calls(lambda x, w, l: rms_norm_pallas(x, w, l, 1e-6, interpret=False), x, w, layer) == 1
    buffer, slots = jnp.zeros((4,) + x.shape, x.dtype), jnp.arange(5, dtype=jnp.int32) % 4
    assert triton_calls(lambda x, w, l, b, s: rms_norm_pallas(x, w, l, 1e-6, interpret=False, record=(b, s)),
                        x, w, layer, buffer, slots) == 1


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="stacked weights"):
        rms_norm_pallas(jnp.zeros((2, 8)), jnp.zeros((8,)), 0, 1e-6, interpret=True)
