"""The prefix cache with compressed KV (DeepSeek-V4, ``jaxspec.engine.entries``): the ring's window
pages (K = V rows and the running compressor inputs) cached like any window, complete entry pages
shared, and a hit's partial entry page per rate copied into a page of its own before its prefill
appends to it. Target: the HF golden V4 (CSA / sliding / HCA layers, window 8, rates 2 and 4), with
DeepSeek's DSpark stages (a ring pool of their own) and its MTP layer as drafts.

Every output is compared with a fresh engine of the same sizes, where nothing is cached yet (float32,
``tests/engine/cache_flows.py``): a chat's second turn hits at turn 1's prompt end, and three
questions behind one system prompt hit from the third on. At page 16 the hits (80 positions) fall
inside entry pages of both rates (32 and 64 positions each), so each hit copies one partial page
per rate; at page 1 every entry page is whole.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.entries import EntryPages, partial_key
from jaxspec.engine.programs import compiled_programs
from tests.conftest import engine
from tests.engine.cache_flows import chat_turn_2, engine_for, shared_tokens, system_prompt_questions
from tests.model.golden import GOLDEN
from tests.spec.test_v4_spec import golden

GREEDY = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
rng = np.random.default_rng(7)
SYSTEM = rng.integers(3, 63, 90).tolist()
QUESTIONS = [rng.integers(3, 63, n).tolist() for n in (13, 19, 11)]
TURN_1 = rng.integers(3, 63, 88).tolist()
TURN_2_EXTRA = rng.integers(3, 63, 7).tolist()

CASES = [("dspark", js.SpecConfig.chain(4), 16), ("mtp", js.SpecConfig.chain(2), 1)]  # (draft, spec, page)


@functools.cache
def _engine(kind, spec, page, cache: bool) -> js.Engine:
    target, mtp, _ = golden()
    draft = mtp if kind == "mtp" else js.load_draft(os.path.join(GOLDEN, "deepseek_v4_dspark"), target)
    return js.Engine(target, draft=draft, spec=spec,
                     engine=engine(page, 1, max_seq_len=192, prefix_cache=cache, check_pages=cache))


def _run(kind, spec, page, cache, prompt):
    return engine_for(_engine, kind, spec, page, True, cache=cache).generate([prompt], sampling=GREEDY, progress=False)


@pytest.mark.parametrize("kind,spec,page", CASES, ids=[f"{k}-page{p}" for k, _, p in CASES])
def test_compressed_kv_is_cached_and_hit(kind, spec, page):
    before = compiled_programs()["decode"]
    eng = _engine(kind, spec, page, True)
    pools = eng.pages
    assert eng.uncacheable is None and pools.window.caching and all(e.caching for e in pools.entries)
    run = lambda cache, prompt: _run(kind, spec, page, cache, prompt)  # noqa: E731
    second, off = chat_turn_2(run, TURN_1, TURN_2_EXTRA)  # turn 2 holds turn 1's prompt and answer
    assert [s.accept_lens for s in second.stats] == [s.accept_lens for s in off.stats]  # the drafts' rows are exact
    assert second.stats[0].cached_tokens == shared_tokens(len(TURN_1), page)
    outs, _ = system_prompt_questions(run, SYSTEM, QUESTIONS)
    hits = [on.stats[0].cached_tokens for on, _ in outs]
    assert hits == [0, 0, shared_tokens(len(SYSTEM), page)], hits
    copies = [e.copies for e in pools.entries]
    assert copies == ([2, 2] if page == 16 else [0, 0]), copies  # page 16: the hits at 80 split an entry page
    assert all(e.hits > 0 for e in pools.entries)
    every = pools.allocators + pools.window.allocators + [a for e in pools.entries for a in e.allocators]
    assert all(a.num_free == a.capacity for a in every)  # parked or free: nothing leaked
    # One decode program per engine: the entry tables are floored like the full one (min_kv_bucket),
    # so a context growing from 88 to 120 positions crosses no bucket of theirs either.
    assert compiled_programs()["decode"] - before <= 2


def test_entry_pages_needed_for_a_hit():
    """Rate 4, page 4: an entry page covers 16 positions (4 full pages). A hit at 6 pages (24
    positions, 6 entries) needs the first entry page whole and a copy of the second; at 8 pages two
    whole ones."""
    e = EntryPages(rate=4, batch=1, width=8, pages_per_shard=16, page_size=4, caching=True)
    keys = [bytes([j]) * 16 for j in range(12)]
    assert e.needs(keys, 6) == ([keys[3]], partial_key(keys[5]))
    assert e.needs(keys, 8) == ([keys[3], keys[7]], None)
    assert e.needs(keys, 3) == ([], partial_key(keys[2]))
    e.page_of[0].update({keys[3]: 5, partial_key(keys[5]): 6})
    assert e.hit(0, keys, 11) == 6 and e.hit(0, keys, 5) == 4 and e.hit(0, keys, 3) == 0


def test_window_and_entry_pages_past_an_evicted_page_go_back():
    """``drop`` (a listener of the prefix cache's key tree): parked window and entry pages under the
    keys an eviction made unreachable are freed at once, every key of a page with it; others stay."""
    from jaxspec.engine.window import WindowPages  # noqa: PLC0415

    keys = [bytes([j]) * 16 for j in range(8)]
    e = EntryPages(rate=4, batch=1, width=8, pages_per_shard=8, page_size=4, caching=True)
    w = WindowPages(batch=1, ring=4, num_pages=8, page_size=4, retain=5, caching=True)
    for alloc, index, keys_of, entries in ((e.allocators[0], e.page_of[0], e.keys_of[0], True),
                                           (w.allocators[0], w.page_of[0], w.key_of[0], False)):
        pages = alloc.grow(0, 3)
        named = {keys[3]: pages[0], partial_key(keys[5]): pages[1], keys[6]: pages[2]} if entries else dict(
            zip((keys[3], keys[5], keys[6]), pages))
        for key, page in named.items():
            index[key] = page
            if entries:
                keys_of.setdefault(page, set()).add(key)
            else:
                keys_of[page] = key
            alloc.cache(page)
        alloc.release(0)
        assert alloc.num_free == alloc.capacity and len(alloc.parked) == 3
    e.drop(0, {keys[5], keys[6]})
    w.drop(0, {keys[5], keys[6]})
    assert set(e.page_of[0]) == {keys[3]} and set(w.page_of[0]) == {keys[3]}
    for alloc in (e.allocators[0], w.allocators[0]):
        assert len(alloc.parked) == 1 and len(alloc.cached) == 1
        alloc.check()
