"""Lossless speculative decoding on targets with sliding-window layers (window pool, ring page
table, pages returned mid-run): greedy speculative output == plain greedy output.

Target: the HF-checked tiny Gemma 4 (tests/data/golden/sliding_window/gemma4_text: layers
[S, S, F] x 2, window 6) with a ragged batch whose prompts run past the window (one of 60
tokens, so at page size 16 too the window pool returns pages while requests run). Drafts: the
HF-layout Gemma 4 assistants (frozen-KV: ordered-embeddings and plain heads; random, so they are
rarely accepted), and standalone drafts with window pools of their own: the target itself
(every chain draft accepted) and a perturbed copy (partial acceptance: trees compact scattered
nodes in both pools). Mistral with a window (every layer sliding: a zero-layer full part) runs
the same way. Each spec runs once, at a (page size, batch) slot, against a shared plain run.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.model.sliding_golden import assistant, target

MAX_NEW = 24
PROMPTS_4 = [[5, 17, 33, 2, 9, 41, 7, 3, 8, 99, 120], [60, 3, 14], [(7 * i + 3) % 256 for i in range(60)], [88]]
PROMPTS_1 = [[11, 22, 33, 44, 55, 66, 77, 88, 99]]


def run(model, page, batch, draft=None, spec=None):
    return js.generate(model, PROMPTS_4 if batch == 4 else PROMPTS_1, draft=draft, spec=spec,
                       sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                       engine=engine(page, batch))


@functools.cache
def plain(name: str, page: int, batch: int):
    out = run(target(name), page, batch)
    assert out.kv_window_pages_free == out.kv_window_pages_total
    return out


@functools.cache
def standalone(name: str, kind: str):
    model = target(name)
    if kind == "same":
        return js.standalone_draft(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 256))
    noisy = jax.tree.map(lambda x: x * (1 + 0.02 * jax.random.normal(next(keys), x.shape, x.dtype)), model.params)
    return js.standalone_draft(Model(config=model.config, params=noisy, dtype=model.dtype))


def draft_for(name: str, kind: str):
    return assistant(kind) if kind.startswith("gemma4_assistant") else standalone(name, kind)


CASES = [  # (target, spec, page, batch, draft)
    ("gemma4_text", js.SpecConfig.chain(3), 1, 4, "gemma4_assistant"),
    ("gemma4_text", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, 4, "gemma4_assistant_plain"),
    ("gemma4_text", js.SpecConfig.chain(4), 16, 4, "perturbed"),
    ("gemma4_text", js.SpecConfig(num_steps=2, topk=4, num_draft_tokens=8), 1, 4, "perturbed"),
    ("gemma4_text", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5), 1, 1, "same"),
    ("gemma4_text", js.SpecConfig.chain(5), 16, 1, "gemma4_assistant"),
    ("mistral_swa", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 1, 4, "perturbed"),
    ("mistral_swa", js.SpecConfig.chain(4), 16, 4, "same"),
]


@pytest.mark.parametrize(
    "name,spec,page,batch,draft", CASES,
    ids=[f"{n}-S{s.num_steps}_k{s.topk}_n{s.num_draft_tokens}-{d}-page{p}-B{b}" for n, s, p, b, d in CASES])
def test_speculative_greedy_equals_plain_greedy(name, spec, page, batch, draft):
    out = run(target(name), page, batch, draft_for(name, draft), spec)
    base = plain(name, page, batch)
    assert out.token_ids == base.token_ids
    assert out.kv_pages_free == out.kv_pages_total
    assert out.kv_window_pages_free == out.kv_window_pages_total > 0
    if batch == 4:  # the 60-token prompt runs far past the window: pages came back while it ran
        assert out.kv_window_pages_returned > 0 and base.kv_window_pages_returned > 0
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.min() >= 1 and lens.max() <= spec.num_steps + 1
    if draft == "same" and spec.topk == 1:
        assert (lens == spec.num_steps + 1).all(), lens
    if draft == "perturbed":
        assert lens.mean() > 1.2 and (lens < spec.num_steps + 1).any(), lens


def test_tree_depth_must_stay_inside_the_window():
    with pytest.raises(ValueError, match="num_steps=6 must be smaller than the sliding window \\(6\\)"):
        run(target(), 16, 1, standalone("gemma4_text", "same"), js.SpecConfig.chain(6))
