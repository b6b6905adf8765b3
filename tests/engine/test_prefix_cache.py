"""Prefix caching: full pages of prompt KV shared by later prompts that start the same way, in one
call and across calls of a ``jaxspec.Engine``. Output is identical with the cache on or off, and so
are the drafts' accept lengths (a cached page's draft rows are exact: its key holds the token after
it); cached pages are reclaimed under pressure before anything is preempted."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.allocator import PageAllocator
from jaxspec.engine.prefix_cache import PrefixCache, cacheable_pages
from jaxspec.engine.programs import compiled_programs
from jaxspec.kvcache.paging import pages_needed
from tests.conftest import engine
from tests.spec.test_lossless import drafts

RNG = np.random.default_rng(0)
SHARED = RNG.integers(1, 96, 32).tolist()  # a "system prompt" of whole pages (of 1, 4 and 16)
# Each prompt's next token differs (95 - i): a draft row at the shared part's end reads it.
PROMPTS = [SHARED + [95 - i] + RNG.integers(1, 96, n).tolist() for i, n in enumerate((3, 9, 1, 20, 5, 0))]
GREEDY = js.SamplingParams(max_new_tokens=16)
PRESSURED_PAGES = 30  # 2 rows of page 4: preemptions and evictions, every request still fits alone
TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


def draft_of(target, kind):
    if kind is None:
        return None
    if kind == "ngram":
        return js.NgramDraft(max_ngram=2)
    if kind == "hybrid":
        return js.HybridDraft(drafts(target)["eagle3"], js.NgramDraft(max_ngram=2))
    if kind == "dflash":
        from tests.spec.test_dflash import tiny_dflash  # noqa: PLC0415

        return tiny_dflash(target)
    return drafts(target)[kind]


CASES = [  # (draft, spec, page): max_batch 2, so later prompts are admitted after the first one cached its pages
    (None, None, 4),
    ("eagle3", js.SpecConfig.chain(3), 16),
    ("perturbed", TREE, 4),
    ("ngram", TREE, 16),
    ("hybrid", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, ngram_tokens=3), 4),
    ("dflash", js.SpecConfig.chain(3), 1),
]


@pytest.mark.parametrize("kind,spec,page", CASES, ids=[f"{k}-page{p}" for k, _, p in CASES])
def test_cache_on_equals_cache_off(tiny_target, kind, spec, page):
    draft = draft_of(tiny_target, kind)
    run = lambda cache: js.generate(tiny_target, PROMPTS, draft=draft, spec=spec, sampling=GREEDY,  # noqa: E731
                                    engine=engine(page, 2, prefix_cache=cache, check_pages=True), progress=False)
    on, off = run(None), run(False)
    assert on.token_ids == off.token_ids
    assert [s.accept_lens for s in on.stats] == [s.accept_lens for s in off.stats]  # the drafts' rows are exact
    expect = (len(SHARED) // page - 1) * page  # the shared part's last page is keyed with the token after it
    # The second prompt waits a round for the first one's pages (both would prefill them in one round).
    assert [s.cached_tokens for s in on.stats] == [0] + [expect] * 5
    assert all(s.cached_tokens == 0 for s in off.stats)
    assert on.kv_pages_free == on.kv_pages_total


def test_mla_target_with_mtp_draft():
    from tests.spec.test_mla_spec import golden  # noqa: PLC0415

    case, target, draft, _ = golden("deepseek_v3_dense")
    prompts = [case["prompts"][0] + p[:3] for p in case["prompts"]]
    run = lambda cache: js.generate(target, prompts, draft=draft, spec=TREE,  # noqa: E731
                                    sampling=js.SamplingParams(max_new_tokens=8, stop_token_ids=()),
                                    engine=engine(1, 1, max_seq_len=64, prefix_cache=cache, check_pages=True),
                                    progress=False)
    on, off = run(None), run(False)
    assert on.token_ids == off.token_ids and [s.accept_lens for s in on.stats] == [s.accept_lens for s in off.stats]
    # page 1: every position but the last of the shared prompt (its key holds the token after it, which differs)
    assert all(s.cached_tokens >= len(case["prompts"][0]) - 1 for s in on.stats[1:]), [s.cached_tokens for s in on.stats]


def test_an_engine_reuses_earlier_calls_and_turns(tiny_target):
    """A later call hits what an earlier call cached, a second chat turn its first turn's prompt; hits
    compile nothing new once their prefill shape has been seen."""
    eng = js.Engine(tiny_target, draft=drafts(tiny_target)["eagle3"], spec=js.SpecConfig.chain(3),
                    engine=engine(4, 2, check_pages=True))
    first = eng.generate(PROMPTS[:1], sampling=GREEDY, progress=False)
    assert first.stats[0].cached_tokens == 0
    second = eng.generate(PROMPTS[1:3], sampling=GREEDY, progress=False)
    assert [s.cached_tokens for s in second.stats] == [28, 28]
    turn = PROMPTS[0] + first.token_ids[0] + [7, 8, 9]
    third = eng.generate([turn], sampling=GREEDY, progress=False)
    assert third.stats[0].cached_tokens == cacheable_pages(len(PROMPTS[0]), 4) * 4  # the first turn's prompt pages
    off = js.generate(tiny_target, [turn], draft=drafts(tiny_target)["eagle3"], spec=js.SpecConfig.chain(3),
                      sampling=GREEDY, engine=engine(4, 2, prefix_cache=False), progress=False)
    assert third.token_ids == off.token_ids
    before = compiled_programs()
    again = eng.generate(PROMPTS[4:6], sampling=GREEDY, progress=False)  # the second call's prefill shapes
    assert [s.cached_tokens for s in again.stats] == [28, 28] and compiled_programs() == before


def test_cached_pages_are_evicted_before_anything_is_preempted(tiny_target):
    """A pool of 24 pages of 4: the first call leaves its prompt pages parked in the cache; a call of
    other prompts needs them back, evicting least recently used pages (no preemption), and outputs
    what a cache-off run does."""
    eng = js.Engine(tiny_target, engine=engine(4, 1, num_pages=25, check_pages=True))
    eng.generate(PROMPTS[:2], sampling=GREEDY, progress=False)
    alloc = eng.pages.allocators[0]
    first = set(alloc.parked)
    assert len(first) >= 9 and alloc.num_free == alloc.capacity  # parked pages count as free
    other = [RNG.integers(1, 96, 60).tolist()]
    out = eng.generate(other, sampling=GREEDY, progress=False)
    ref = js.generate(tiny_target, other, sampling=GREEDY, engine=engine(4, 1, prefix_cache=False), progress=False)
    assert out.token_ids == ref.token_ids and out.stats[0].preemptions == 0
    assert first - alloc.cached  # some of the first call's pages were taken back
    eng.pages.caches[0].check()


def test_a_page_is_keyed_by_the_token_after_it():
    alloc = PageAllocator(8)
    cache = PrefixCache(alloc, page_size=2)
    pages = alloc.grow(0, 3)
    cache.insert([1, 2, 3, 4, 5, 6, 7], pages)  # pages [1 2] [3 4] [5 6], each with the token after it
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == pages
    assert cache.match([1, 2, 3, 4, 5, 9, 9]) == pages[:2]
    assert cache.match([1, 2, 3, 9]) == pages[:1]
    assert cache.match([1, 2, 3, 4, 9, 9, 9]) == pages[:1]  # page [3 4] was cached with 5 after it
    assert cache.match([1, 2]) == []  # the last token is always prefilled
    alloc.release(0)
    assert len(alloc.parked) == 3 and alloc.num_free == alloc.capacity
    alloc.check()


def test_a_hybrid_target_is_cached_by_default():
    """Recurrent state is snapshotted (``tests/engine/test_prefix_cache_recurrent.py``): the cache is
    on for Qwen3.5 unless asked off."""
    from tests.model.targets.test_golden_hybrid import target  # noqa: PLC0415

    assert js.Engine(target("qwen3_5_dense")).pages.snapshots is not None
    assert js.Engine(target("qwen3_5_dense"), engine=js.EngineConfig(prefix_cache=False)).pages.caches is None


def test_same_round_sharing_resumed_hits_and_evictions_keep_the_output(tiny_target):
    """Four prompts behind one prefix in one call, 2 rows, a pool that must preempt and evict: the
    followers of the first prompt wait a round and hit its 7 pages (the shared positions are
    prefilled once), a request resumed after a preemption is matched again and hits, parked pages
    are evicted, and every output equals the cache-off run."""
    draft, spec = drafts(tiny_target)["eagle3"], js.SpecConfig.chain(3)
    prompts = PROMPTS[:4]
    eng = js.Engine(tiny_target, draft=draft, spec=spec,
                    engine=engine(4, 2, num_pages=PRESSURED_PAGES, preempt_every=2, check_pages=True))
    out = eng.generate(prompts, sampling=GREEDY, progress=False)
    ref = js.generate(tiny_target, prompts, draft=draft, spec=spec, sampling=GREEDY,
                      engine=engine(4, 2, prefix_cache=False), progress=False)
    assert out.token_ids == ref.token_ids
    assert [s.cached_tokens for s in out.stats] == [0, 28, 28, 28]
    for p, s in zip(prompts, out.stats):
        assert s.admission_cached_tokens[0] == s.cached_tokens
        if not s.preemptions:
            assert s.prefilled_tokens == len(p) - s.cached_tokens
    resumed = [s.admission_cached_tokens[1:] for s in out.stats if s.preemptions]
    assert resumed and all(h > 0 for hits in resumed for h in hits), resumed
    assert eng.pages.allocators[0].evictions > 0


# ----------------------------------------------------------------------------- the scheduler alone


def _requests(prompts, max_new=8):
    from jaxspec.engine.scheduler import Request  # noqa: PLC0415

    return [Request(i, list(p), js.SamplingParams(max_new_tokens=max_new), (), np.zeros(2, np.uint32))
            for i, p in enumerate(prompts)]


def _cached_scheduler(prompts, num_pages, batch=4):
    from jaxspec.engine.scheduler import Scheduler  # noqa: PLC0415

    alloc = PageAllocator(num_pages)
    return Scheduler(_requests(prompts), batch=batch, width=16, num_pages=num_pages, page_size=4, lookahead=0,
                     step_growth=4, admission="optimistic", allocators=[alloc], caches=[PrefixCache(alloc, 4)])


def test_followers_of_a_prefix_admitted_in_one_round_wait_a_round_and_share_it():
    """Four prompts behind one 32-token prefix arrive together: the first is admitted, the three
    that would prefill the same pages wait one round (an unrelated prompt behind them goes on),
    then all three find the leader's 7 pages cached: the shared positions are prefilled once."""
    other = RNG.integers(1, 96, 10).tolist()
    sched = _cached_scheduler(PROMPTS[:4] + [other], num_pages=64, batch=8)
    seq = np.zeros(8, np.int32)
    first = sched.admit(seq)
    assert [r.index for r in first] == [0, 4]
    sched.cache_prompts(first)  # after their prefill
    second = sched.admit(seq)
    assert [r.index for r in second] == [1, 2, 3] and [r.start for r in second] == [28, 28, 28]
    assert sched.prefilled == sum(len(p) for p in PROMPTS[:4]) + len(other) - 3 * 28
    assert [r.admission_hits for r in first + second] == [[0], [0], [28], [28], [28]]
    sched.check()


def test_admission_does_not_count_pages_it_shares_with_running_requests():
    """A newcomer whose 7 first pages a running request holds needs only its other pages free."""
    sched = _cached_scheduler(PROMPTS[:1], num_pages=16, batch=2)
    seq = np.zeros(2, np.int32)
    (leader,) = sched.admit(seq)
    sched.cache_prompts([leader])
    seq[leader.row] = len(PROMPTS[0])
    leader.tokens = [1]
    sched.grant_ahead(seq)
    free = sched.num_free
    follower = _requests([PROMPTS[1]])[0]
    follower.index = 1
    sched.enqueue(follower)
    whole = pages_needed(len(PROMPTS[1]) + 1 + 4, 4)
    assert whole > free >= whole - 7  # it fits only with the shared pages credited
    assert [r.index for r in sched.admit(seq)] == [1] and follower.start == 28
    sched.check()


def test_eviction_takes_a_prefix_tail_before_its_head():
    """Parked pages go least recently used first, and a released request's last page is parked
    first: evicting one page leaves the chain's first pages reachable."""
    alloc = PageAllocator(6)
    cache = PrefixCache(alloc, page_size=2)
    tokens = list(range(1, 10))  # 4 cacheable pages of 2
    pages = alloc.grow(0, 4)
    cache.insert(tokens, pages)
    alloc.release(0)
    alloc.grow(1, 2)  # one free page and one evicted
    assert alloc.evictions == 1
    assert cache.match(tokens) == pages[:3]
    alloc.check()
    cache.check()
