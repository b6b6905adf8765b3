"""Feature taps for every target family: tap ``l`` is HF's ``hidden_states[l]`` (the stream
entering layer ``l``), tap ``L`` the final normed state HF returns last (what a DFlash draft
tapping the last target layer reads), in any order."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets import forward_sequence
from jaxspec.model.targets.base import AuxTaps
from tests.model.golden import arrays, case_dir, cases


# DeepSeek-V4's taps are its residual streams, tap L those before hc_head (tests/model/targets/test_deepseek_v4.py).
@pytest.mark.parametrize("case", [c for c in cases("target") if c["model_type"] != "deepseek_v4"],
                         ids=lambda c: c["name"])
def test_last_tap_is_hf_final_hidden_state(case):
    model = js.load_model(case_dir(case), dtype="float32", progress=False)
    L, H = model.config.num_layers, model.config.hidden_size
    ref = arrays(case)
    prompt = np.asarray([case["prompts"][0]])
    _, hidden, aux = forward_sequence(model, prompt, aux_layers=(L, 1))
    np.testing.assert_allclose(np.asarray(aux[0, :, :H]), ref["hidden_final_0"], atol=case["atol"], rtol=case["rtol"])
    _, _, first = forward_sequence(model, prompt, aux_layers=(1,))
    np.testing.assert_array_equal(np.asarray(aux[0, :, H:]), np.asarray(first[0]))  # order kept


def test_repeated_tap_is_recorded_once_and_repeated(tiny_target):
    """EAGLE-3's default taps (2, L//2, L-3) repeat a layer on a 4-layer target: both copies are
    that layer's stream, not zeros."""
    prompt = np.asarray([[3, 1, 4, 1, 5]])
    H = tiny_target.config.hidden_size
    _, _, rep = forward_sequence(tiny_target, prompt, aux_layers=(2, 2, 1))
    _, _, one = forward_sequence(tiny_target, prompt, aux_layers=(2, 1))
    rep, one = np.asarray(rep), np.asarray(one)
    np.testing.assert_array_equal(rep[..., :H], one[..., :H])
    np.testing.assert_array_equal(rep[..., H:], one)
    assert np.abs(one[..., :H]).min() > 0


def test_taps_are_checked():
    with pytest.raises(ValueError, match=r"aux taps \(5,\) must be layers in \[0, 4\]"):
        AuxTaps(4, (5,))
    with pytest.raises(ValueError, match="must be layers"):
        AuxTaps(4, (-1,))
