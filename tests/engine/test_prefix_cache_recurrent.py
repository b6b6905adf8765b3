"""The prefix cache with recurrent state (``jaxspec.engine.snapshots``): the linear-attention state
saved at page points by the prefill, a hit only where the full pages *and* a snapshot are cached,
checkpoints where a newcomer's match ended, junctions for followers of a prefix admitted in the same
round. Target: the HF-made tiny Qwen3.5 (Gated DeltaNet and gated attention layers) with its decay
slowed (``slow_target``), with its MTP layer as draft; prompts longer than one 64-token prefill
chunk, so snapshots fall inside chunks.

Every output is compared with a fresh engine of the same sizes, where nothing is cached yet (float32,
``tests/engine/cache_flows.py``), but the last scenario's, compared with an engine without the cache:

* a chat's second turn hits at turn 1's prompt end (the snapshot its prefill saved there);
* three questions behind one system prompt: the first saves only its own prompt end, the second
  finds the system prompt's full pages but no snapshot and saves one there, the third hits there;
* four questions in one call on two rows, with preemptions, evictions and two snapshot slots: the
  followers wait a round for the leader, which also saves the state where their prompts part, and
  hit it; resumed requests hit again.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.snapshots import StateSnapshots
from jaxspec.model.targets import Model
from tests.conftest import engine
from tests.engine.cache_flows import chat_turn_2, engine_for, shared_tokens, system_prompt_questions
from tests.model.targets.test_golden_hybrid import ROOT, target

NAME = "qwen3_5_dense"
GREEDY = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
# Seed 10: every greedy step of these prompts wins by at least 0.07 logits (with seed 7 one won by
# 0.001, and a TP=2 x DP=2 mesh's float rounding flipped it once in the suite).
rng = np.random.default_rng(10)
SYSTEM = rng.integers(3, 120, 70).tolist()  # past one prefill chunk; not a whole number of pages
QUESTIONS = [rng.integers(3, 120, n).tolist() for n in (13, 19, 11, 6)]
TURN_1 = rng.integers(3, 120, 75).tolist()
TURN_2_EXTRA = rng.integers(3, 120, 7).tolist()

CASES = [(None, None, 1), ("mtp", js.SpecConfig.chain(3), 16)]  # (draft, spec, page)


def slowed(m: Model) -> Model:
    """``m`` with its linear layers' decay slowed (``A_log - 4``). As HF initializes the tiny Qwen3.5,
    its state keeps about a third of itself per token (``e^g``), so it forgets within ten tokens and
    no output would tell a wrong restored state from the right one; slowed, a state carries across a
    whole prompt (a restore from the row's old state instead of the snapshot turns these tests red)."""
    params = {k: {**v, "A_log": v["A_log"] - 4.0} if isinstance(v, dict) and "A_log" in v else v
              for k, v in m.params.items()}
    return Model(config=m.config, params=params, dtype=m.dtype, mesh=m.mesh)


@functools.cache
def slow_target() -> Model:
    return slowed(target(NAME))


@functools.cache
def _engine(kind, spec, page, cache: bool, batch: int = 1, **kw) -> js.Engine:
    draft = js.load_draft(os.path.join(ROOT, NAME), slow_target()) if kind == "mtp" else None
    return js.Engine(slow_target(), draft=draft, spec=spec,
                     engine=engine(page, batch, max_seq_len=192, prefix_cache=cache, check_pages=cache, **kw))


def _run(kind, spec, page, cache, prompt):
    return engine_for(_engine, kind, spec, page, True, cache=cache).generate([prompt], sampling=GREEDY, progress=False)


@pytest.mark.parametrize("kind,spec,page", CASES, ids=[f"{k or 'plain'}-page{p}" for k, _, p in CASES])
def test_recurrent_state_is_snapshotted_and_hit(kind, spec, page):
    eng = _engine(kind, spec, page, True)
    snaps = eng.pages.snapshots
    assert snaps is not None and eng.pages.caches is not None and eng.uncacheable is None
    run = lambda cache, prompt: _run(kind, spec, page, cache, prompt)  # noqa: E731
    second, _ = chat_turn_2(run, TURN_1, TURN_2_EXTRA)  # turn 2 holds turn 1's prompt and answer
    assert second.stats[0].cached_tokens == shared_tokens(len(TURN_1), page)
    # A system prompt, then three questions.
    start = snaps.written
    outs, totals = system_prompt_questions(run, SYSTEM, QUESTIONS[:3], each=lambda: snaps.written)
    for on, off in outs:
        assert [s.accept_lens for s in on.stats] == [s.accept_lens for s in off.stats]
    hits = [on.stats[0].cached_tokens for on, _ in outs]
    written = [b - a for a, b in zip([start] + totals, totals)]
    assert hits == [0, 0, shared_tokens(len(SYSTEM), page)], hits
    assert written == [1, 2, 1], written  # prompt ends; the second also the checkpoint at the system prompt
    assert snaps.hits == 2
    pools = eng.pages
    assert all(a.num_free == a.capacity for a in pools.allocators + pools.snapshots.allocators)  # parked or free
    pools.snapshots.check()


def test_followers_in_one_round_preemption_and_eviction_keep_the_output():
    """Four questions behind one system prompt in one call on 2 rows: the followers of the first wait a
    round while its prefill also saves the state at the system prompt (the junction), then hit it
    (the shared positions are prefilled once); two snapshot slots and a small pool force evictions of
    both, and a preemption every second call; resumed requests hit again."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    eng = _engine(None, None, 16, True, batch=2, num_pages=9, preempt_every=2, snapshot_slots=2)
    out = eng.generate(prompts, sampling=GREEDY, progress=False)
    ref = _engine(None, None, 16, False, batch=2).generate(prompts, sampling=GREEDY, progress=False)
    assert out.token_ids == ref.token_ids
    shared = shared_tokens(len(SYSTEM), 16)
    assert [s.cached_tokens for s in out.stats] == [0] + [shared] * 3
    for p, s in zip(prompts, out.stats):
        if not s.preemptions:
            assert s.prefilled_tokens == len(p) - s.cached_tokens
    resumed = [s.admission_cached_tokens[1:] for s in out.stats if s.preemptions]
    assert resumed and all(h > 0 for hits in resumed for h in hits), resumed
    snaps = eng.pages.snapshots
    assert sum(a.evictions for a in snaps.allocators) > 0
    assert sum(a.evictions for a in eng.pages.allocators) > 0
    snaps.check()


def test_refusals_name_what_is_not_snapshotted():
    with pytest.raises(ValueError, match="snapshot_slots=0"):
        js.Engine(target(NAME), engine=engine(16, 1, prefix_cache=True, snapshot_slots=0))
    with pytest.raises(ValueError, match="standalone draft's recurrent state"):
        from tests.spec.test_hybrid_lossless import perturbed  # noqa: PLC0415

        js.Engine(target(NAME), draft=perturbed(NAME), spec=js.SpecConfig.chain(3),
                  engine=engine(16, 1, prefix_cache=True))
    with pytest.raises(ValueError, match="snapshot_slots must be None or an int >= 0"):
        js.EngineConfig(snapshot_slots=-1)


# ----------------------------------------------------------------------------- the host side alone


def _keys(n, tag=0):
    return [bytes([tag, j]) * 8 for j in range(n)]


def test_a_hit_is_the_last_snapshot_within_the_matched_pages():
    snaps = StateSnapshots(batch=2, slots=3, page_size=4)
    keys = _keys(10)
    snaps.admit(0, owner=0, context_len=30, keys=keys, k=0, matched=5)  # saves at 5 and at the prompt end, 7
    assert sorted(snaps.at[0][snaps.at[0] > 0].tolist()) == [20, 28]
    snaps.cache_prompt(0)
    assert snaps.hit(1, keys, 9) == 7 and snaps.hit(1, keys, 6) == 5 and snaps.hit(1, keys, 4) == 0
    assert snaps.hit(1, _keys(10, tag=1), 9) == 0
    snaps.check()


def test_an_evicted_page_drops_the_snapshots_past_it():
    """The prefix cache's key tree: evicting a full page hands its key and every key below it to the
    listeners, and the snapshots under them go back at once."""
    from jaxspec.engine.allocator import PageAllocator  # noqa: PLC0415
    from jaxspec.engine.prefix_cache import PrefixCache  # noqa: PLC0415

    P = 4
    alloc = PageAllocator(32)
    cache, snaps = PrefixCache(alloc, P), StateSnapshots(batch=1, slots=4, page_size=P)
    cache.listeners.append(lambda gone: snaps.drop(0, gone))
    a = list(range(1, 34))
    b = a[:12] + list(range(50, 71))  # b shares a's first three pages (and the token after them)
    for owner, (tokens, matched) in enumerate(((a, 0), (b, 3))):
        keys = cache.keys(tokens)
        cache.insert(tokens, alloc.grow(owner, len(keys)))
        snaps.admit(0, owner=owner, context_len=len(tokens), keys=keys, k=0, matched=matched)
        snaps.cache_prompt(0)
        alloc.release(owner)
    ka, kb = cache.keys(a), cache.keys(b)
    assert snaps.hit(0, ka, 8) == 8 and snaps.hit(0, kb, 8) == 8 and snaps.hit(0, kb, 3) == 3

    def evict(key):  # as the allocator does when a grant takes a parked page back
        page = cache.page_of[key]
        assert alloc.uncache(page)
        cache._forget(page)  # noqa: SLF001

    evict(kb[4])  # only b's prompt end is past it
    assert snaps.hit(0, kb, 8) == 3 and snaps.hit(0, ka, 8) == 8 and snaps.dropped == 1
    evict(ka[0])  # every snapshot is past the first page
    assert snaps.hit(0, ka, 8) == 0 and snaps.hit(0, kb, 8) == 0 and snaps.dropped == 3
    assert not cache.children and not cache.parent  # the tree lost every key below the first page
    slots = snaps.allocators[0]
    assert slots.num_free == slots.capacity and not slots.cached
    snaps.check()
