"""Lossless speculative decoding on targets with sliding-window layers (window pool, ring page
table, pages returned mid-run): greedy speculative output == HF's greedy output, which the plain
engine run reproduces token for token (tests/model/targets/test_golden_sliding.py), so speculative ==
plain greedy without a plain run here.

Targets: the HF-made tiny Gemma 4 (tests/data/golden/sliding_window/gemma4_text: layers
[S, S, F] x 2, window 6), its MoE kind (gemma4_moe: [S, F] x 2, 8 experts, top 2), its E2B kind
(gemma4_ple: per-layer inputs, the last 2 layers sharing K/V) and Mistral with a window of 6
(every layer sliding: a zero-layer full part), each with the goldens' ragged batch of 3 prompts
(5, 11, 17 tokens, 16 new: every request runs past the window).

Drafts:
- the HF-layout Gemma 4 assistants (frozen-KV: ordered-embeddings and plain heads; random, so
  rarely accepted) on Gemma 4 and its E2B kind;
- perturbed copies of Mistral and of the MoE and E2B-kind Gemma 4 as standalone drafts with a
  window pool of their own (partial acceptance: the tree compacts scattered nodes in the window
  pools; compaction in both parts of a split pool is checked directly in
  tests/kvcache/test_window_pool.py);
- the E2B-kind checkpoint loaded as a standalone draft for gemma4_text.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.model.sliding_golden import arrays, assistant, case, case_dir, target


def run(name, page, draft=None, spec=None, implementation=None):
    c = case(name)
    return js.generate(target(name), c["prompts"], draft=draft, spec=spec,
                       sampling=js.SamplingParams(max_new_tokens=c["greedy_new_tokens"], stop_token_ids=()),
                       engine=engine(page, max_batch=4, max_seq_len=64, implementation=implementation))


@functools.cache
def standalone(name: str, kind: str):
    model = target(name)
    if kind == "same":
        return js.standalone_draft(model)
    keys = iter(np.asarray(jax.random.split(jax.random.PRNGKey(5), 256)))  # numpy: iterating a jax.Array compiles
    noisy = jax.tree.map(lambda x: x * (1 + 0.02 * jax.random.normal(next(keys), x.shape, x.dtype)), model.params)
    return js.standalone_draft(Model(config=model.config, params=noisy, dtype=model.dtype))


@functools.cache
def small_gemma_draft(name: str) -> js.DraftModel:
    """The E2B-kind checkpoint (gemma4_ple) loaded as a standalone draft for ``name``, as a user
    drafts Gemma 4 31B with E2B."""
    return js.load_draft(case_dir("gemma4_ple"), target(name))


def draft_for(name: str, kind: str):
    if kind == "gemma4_ple":
        return small_gemma_draft(name)
    return assistant(kind) if kind.startswith("gemma4_assistant") else standalone(name, kind)


CASES = [  # (target, spec, page, draft)
    ("gemma4_text", js.SpecConfig.chain(3), 1, "gemma4_assistant"),
    ("gemma4_text", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "gemma4_assistant_plain"),
    ("mistral_swa", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    ("gemma4_moe", js.SpecConfig.chain(3), 1, "perturbed"),
    ("gemma4_moe", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    ("gemma4_ple", js.SpecConfig.chain(3), 1, "perturbed"),
    ("gemma4_ple", js.SpecConfig.chain(3), 16, "gemma4_ple_assistant"),
    ("gemma4_ple", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "perturbed"),
    ("gemma4_text", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), 16, "gemma4_ple"),
]


@pytest.mark.parametrize(
    "name,spec,page,draft", CASES,
    ids=[f"{n}-S{s.num_steps}_k{s.topk}_n{s.num_draft_tokens}-{d}-page{p}" for n, s, p, d in CASES])
def test_speculative_greedy_equals_plain_greedy(name, spec, page, draft):
    out = run(name, page, draft_for(name, draft), spec)
    ref = arrays(name)
    assert out.token_ids == [ref[f"greedy_{i}"].tolist() for i in range(len(case(name)["prompts"]))]
    assert out.kv_pages_free == out.kv_pages_total
    assert out.kv_window_pages_free == out.kv_window_pages_total > 0
    if page == 1:  # requests ran past the window: pages came back while they ran
        assert out.kv_window_pages_returned > 0
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.min() >= 1 and lens.max() <= spec.num_steps + 1
    if draft == "perturbed":
        assert lens.mean() > 1.2 and (lens < spec.num_steps + 1).any(), lens


def test_moe_chain_with_the_grouped_kernel_equals_plain_greedy():
    """Gemma 4 MoE's routed experts (target and draft) through the grouped-matmul kernel: the
    speculative tokens are still HF's greedy tokens, with partial acceptance."""
    spec = js.SpecConfig.chain(3)
    out = run("gemma4_moe", 1, draft_for("gemma4_moe", "perturbed"), spec, implementation={"grouped_matmul": "pallas"})
    ref = arrays("gemma4_moe")
    assert out.token_ids == [ref[f"greedy_{i}"].tolist() for i in range(len(case("gemma4_moe")["prompts"]))]
    lens = np.concatenate([s.accept_lens for s in out.stats])
    assert lens.mean() > 1.2 and (lens < spec.num_steps + 1).any(), lens


def test_tree_depth_must_stay_inside_the_window():
    with pytest.raises(ValueError, match="depth 6 must be smaller than the sliding window \\(6\\)"):
        run("gemma4_text", 16, standalone("gemma4_text", "same"), js.SpecConfig.chain(6))
