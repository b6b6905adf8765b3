"""The shipped demo pair (demo/target + demo/eagle3) decodes losslessly: speculative greedy ==
plain greedy on held-out stdlib prompts of ragged lengths, chain and tree, page sizes 1 and 16."""

import functools
import os

import pytest

import jaxspec as js
from jaxspec.demo import DEMO_DRAFT, DEMO_TARGET
from jaxspec.train.corpus import file_prompts, spread_by_package, stdlib_files

pytestmark = pytest.mark.skipif(
    not os.path.exists(os.path.join(DEMO_DRAFT, "model.safetensors")), reason="demo pair not present"
)
MAX_NEW = 24


@functools.cache
def demo():
    target = js.load_model(DEMO_TARGET, dtype="float32", progress=False)
    draft = js.load_draft(DEMO_DRAFT, target)
    prompts = file_prompts(target.tokenizer, spread_by_package(stdlib_files("heldout")), 3, 48)
    prompts = [p[: 48 - 13 * i] for i, p in enumerate(prompts)]  # ragged: 48, 35, 22 tokens
    return target, draft, prompts


@functools.cache
def plain():
    target, _, prompts = demo()
    return js.generate(target, prompts, sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                       engine=js.EngineConfig(max_batch=4, max_seq_len=128), progress=False).token_ids


@pytest.mark.parametrize(
    "spec,page_size",
    [(js.SpecConfig.chain(5), 16), (js.SpecConfig(num_steps=5, topk=4, num_draft_tokens=16), 1)],
    ids=["chain5-page16", "tree4x16-page1"],
)
def test_demo_pair_is_lossless(spec, page_size):
    target, draft, prompts = demo()
    assert draft.kind == "eagle3" and len(prompts) == 3
    out = js.generate(target, prompts, draft=draft, spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=()),
                      engine=js.EngineConfig(page_size=page_size, max_batch=4, max_seq_len=128), progress=False)
    assert out.token_ids == plain()
    assert out.mean_accept_len > 1.5  # the head was trained for this target: it drafts well

