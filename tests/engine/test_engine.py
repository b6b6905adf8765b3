"""``jaxspec.Engine``: a persistent engine keeps its pools, page allocators and compiled programs
across calls; ``jaxspec.generate()`` is a throwaway one."""

from __future__ import annotations

import pytest

import jaxspec as js
from jaxspec.engine.programs import compiled_programs
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy

GREEDY = js.SamplingParams(max_new_tokens=MAX_NEW)


def test_calls_reuse_pools_and_programs(tiny_target):
    draft, spec = drafts(tiny_target)["perturbed"], js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
    eng = js.Engine(tiny_target, draft=draft, spec=spec, engine=engine(16, 4, check_pages=True))
    pools = eng.pages.allocators
    first = eng.generate(PROMPTS_4, sampling=GREEDY, progress=False)
    assert first.token_ids == plain_greedy(tiny_target, 16, 4)
    before = compiled_programs()
    second = eng.generate(PROMPTS_4[::-1], sampling=GREEDY, progress=False)  # fewer rows than max_batch: same shapes
    assert second.token_ids == plain_greedy(tiny_target, 16, 4)[::-1]
    assert compiled_programs() == before
    assert eng.generate(PROMPTS_4[:1], sampling=GREEDY, progress=False).token_ids == first.token_ids[:1]
    assert eng.pages.allocators is pools and second.kv_pages_free == second.kv_pages_total


def test_an_engine_smaller_than_the_calls_queues_and_preempts(tiny_target):
    """max_batch 2 and a pool of 9 pages of 4 for four requests: rows are reused and requests preempted
    within a call; the engine is whole after it and serves the next call the same way."""
    eng = js.Engine(tiny_target, engine=engine(4, 2, num_pages=13, check_pages=True))
    for _ in range(2):
        out = eng.generate(PROMPTS_4, sampling=GREEDY, progress=False)
        assert out.token_ids == plain_greedy(tiny_target, 16, 4)
        assert out.kv_pages_free == out.kv_pages_total == 12
    assert sum(s.preemptions for s in out.stats) > 0


def test_a_stream_closed_early_gives_its_pages_back(tiny_target):
    eng = js.Engine(tiny_target, engine=engine(16, 4))
    stream = eng.generate_stream(PROMPTS_4, sampling=GREEDY)
    next(stream)
    with pytest.raises(RuntimeError, match="serving another call"):
        eng.generate(PROMPTS_4, sampling=GREEDY, progress=False)
    stream.close()
    assert eng.pages.allocators[0].num_free == eng.pages.allocators[0].capacity
    out = eng.generate(PROMPTS_4, sampling=GREEDY, progress=False)
    assert out.token_ids == plain_greedy(tiny_target, 16, 4)


def test_engine_checks_its_inputs(tiny_target):
    with pytest.raises(ValueError, match="spec was given without a draft"):
        js.Engine(tiny_target, spec=js.SpecConfig.chain(2))
    eng = js.Engine(tiny_target, engine=engine(16, 2, max_seq_len=32))
    with pytest.raises(ValueError, match="max_seq_len 32"):
        eng.generate([[1] * 20], sampling=js.SamplingParams(max_new_tokens=16))
    with pytest.raises(ValueError, match="seed must be an int"):
        eng.generate([[1]], seed=-1)
