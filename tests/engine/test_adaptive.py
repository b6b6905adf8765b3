"""Adaptive chain depth: the controller's policy, and that switching depths between calls
stays lossless."""

import pytest

import jaxspec as js
from jaxspec.engine.adaptive import AdaptiveSteps
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy


def test_controller_goes_deeper_when_everything_is_accepted():
    c = AdaptiveSteps(candidates=(1, 3, 7), steps=3)
    for _ in range(3):
        c.update(4.0)  # every draft accepted at depth 3
    assert c.steps == 7


def test_controller_goes_shallower_when_little_is_accepted():
    c = AdaptiveSteps(candidates=(1, 3, 7), steps=7)
    for _ in range(10):
        c.update(1.1)
    assert c.steps == 1


def test_controller_waits_for_warmup_and_resists_noise_downwards():
    c = AdaptiveSteps(candidates=(1, 2, 3, 4), steps=3)
    assert c.update(1.0) == 3  # warm-up call
    # 1.3 accepted drafts: round(1.3) + 1 = 2 would go down, but with the margin
    # round(1.55) + 1 = 3 holds the depth.
    c = AdaptiveSteps(candidates=(1, 2, 3, 4), steps=3, ema=1.3, calls=5)
    assert c.update(2.3) == 3
    c = AdaptiveSteps(candidates=(1, 2, 3, 4), steps=3, ema=0.9, calls=5)
    assert c.update(1.9) == 2


def test_spec_config_validates_adaptive_steps():
    with pytest.raises(ValueError, match="for chains"):
        js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4, adaptive_steps=(1, 3))
    with pytest.raises(ValueError, match="must be one of adaptive_steps"):
        js.SpecConfig.chain(2, adaptive_steps=(1, 3))
    assert js.SpecConfig.chain(3, adaptive_steps=(7, 1, 3)).adaptive_steps == (1, 3, 7)


@pytest.mark.parametrize("draft,direction", [("same", "up"), ("eagle3", "down")])
def test_adaptive_depth_is_lossless_and_moves(tiny_target, draft, direction):
    spec = js.SpecConfig.chain(3, adaptive_steps=(1, 3, 5))
    out = js.generate(tiny_target, PROMPTS_4, draft=drafts(tiny_target)[draft], spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW), engine=engine(16, 4, steps_per_call=1))
    assert out.token_ids == plain_greedy(tiny_target, 16, 4)
    trace = out.steps_per_call
    assert trace[0] == 3
    assert (max(trace) == 5) if direction == "up" else (min(trace) == 1), trace
