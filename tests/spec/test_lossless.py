"""Lossless: greedy speculative output == plain greedy output, token for token.

Covering design (each run compiles its own programs, so the full cross product would not fit
a CPU CI budget): every spec config runs at both page sizes and both batch sizes, and the
three drafts rotate over those slots so each config meets every draft:
  (a) a random EAGLE-3 head (low acceptance),
  (b) a standalone draft equal to the target (every draft token accepted),
  (c) a standalone draft equal to a perturbed target (partial acceptance, so tree
      compaction moves scattered nodes).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.drafts import eagle_draft, standalone_draft
from jaxspec.model.drafts.eagle import eagle3_config_for
from jaxspec.model.checkpoints.eagle import init_eagle_params
from jaxspec.model.targets import Model
from tests.conftest import PROMPTS_1, PROMPTS_4, engine

MAX_NEW = 24
SPECS = [
    js.SpecConfig.chain(1),
    js.SpecConfig.chain(3),
    js.SpecConfig.chain(5),
    js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=4),
    js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8),
    js.SpecConfig(num_steps=4, topk=4, num_draft_tokens=8),
    js.SpecConfig(num_steps=3, topk=4, num_draft_tokens=16),
]
SLOTS = [(1, 4), (16, 1), (16, 4), (1, 1)]  # (page_size, batch)
DRAFTS = ["eagle3", "same", "perturbed"]


def cases():
    out = []
    for i, spec in enumerate(SPECS):
        for j, (page, batch) in enumerate(SLOTS):
            draft = DRAFTS[(i + j) % 3]
            sid = f"S{spec.num_steps}_k{spec.topk}_n{spec.num_draft_tokens}"
            out.append(pytest.param(spec, page, batch, draft, id=f"{sid}-{draft}-page{page}-B{batch}"))
    return out


@functools.cache
def drafts(target: Model) -> dict:
    ecfg = eagle3_config_for(target.config, draft_vocab_size=64)
    eagle = eagle_draft(ecfg, init_eagle_params(ecfg, jax.random.PRNGKey(1), target.params, scale=0.2))
    noise_keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(2), 64)))  # numpy: iterating a jax.Array compiles
    perturbed = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(next(noise_keys), x.shape, x.dtype), target.params)
    return {
        "eagle3": eagle,
        "same": standalone_draft(target),
        "perturbed": standalone_draft(Model(config=target.config, params=perturbed, dtype=target.dtype)),
    }


@functools.cache
def plain_greedy(target: Model, page: int, batch: int):
    prompts = PROMPTS_4 if batch == 4 else PROMPTS_1
    out = js.generate(target, prompts, sampling=js.SamplingParams(max_new_tokens=MAX_NEW), engine=engine(page, batch))
    return out.token_ids


def test_plain_greedy_is_page_size_invariant(tiny_target):
    assert plain_greedy(tiny_target, 1, 4) == plain_greedy(tiny_target, 16, 4)
    assert plain_greedy(tiny_target, 1, 1) == plain_greedy(tiny_target, 16, 1)
    assert all(len(t) == MAX_NEW for t in plain_greedy(tiny_target, 16, 4))  # no eos in the tiny model


@pytest.mark.parametrize("spec,page,batch,draft", cases())
def test_speculative_greedy_equals_plain_greedy(tiny_target, spec, page, batch, draft, implementation="xla"):
    prompts = PROMPTS_4 if batch == 4 else PROMPTS_1
    out = js.generate(
        tiny_target, prompts, draft=drafts(tiny_target)[draft], spec=spec,
        sampling=js.SamplingParams(max_new_tokens=MAX_NEW),
        engine=engine(page, batch, implementation=implementation),
    )
    assert out.token_ids == plain_greedy(tiny_target, page, batch)
    assert out.kv_pages_free == out.kv_pages_total
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.min() >= 1 and lens.max() <= spec.num_steps + 1
    if draft == "same" and spec.topk == 1:
        # The draft is the target: every drafted token is accepted.
        assert (lens == spec.num_steps + 1).all(), lens
    if draft == "same" and spec.topk > 1:
        # The best-scored candidate is the draft's (= target's) argmax, so at least one draft
        # token is always accepted; deeper greedy nodes are kept when their path score ranks.
        assert (lens >= 2).all() and lens.mean() > 2.0, lens
    if draft == "perturbed":
        assert lens.mean() > 1.2 and (lens < spec.num_steps + 1).any(), lens
