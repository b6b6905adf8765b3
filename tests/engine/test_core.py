"""The serving core: requests that join a running engine from any thread, each with the output it
would have alone, cancellation, and a bounded set of programs under a mixed load."""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.core import EngineCore, LiveGrammars, QueueFull, collect
from jaxspec.model.config import padded_vocab_size
from jaxspec.structured import compile_constraint
from jaxspec.engine.programs import compiled_programs
from jaxspec.sampling.distributions import RowSampling, target_probs
from jaxspec.structured.automaton import compile_automaton
from jaxspec.structured.regex import compile_dfa
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy

GREEDY = js.SamplingParams(max_new_tokens=MAX_NEW)
SPEC = js.SpecConfig.chain(3)
HOT = js.SamplingParams(temperature=1.0, max_new_tokens=16, seed=7, logprobs=2)
MIXED = [GREEDY, HOT, js.SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.3, logit_bias={5: -3.0}),
         js.SamplingParams(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=12, seed=3)]


@pytest.fixture(scope="module")
def core(tiny_target):
    eng = js.Engine(tiny_target, draft=drafts(tiny_target)["perturbed"], spec=SPEC,
                    engine=engine(16, 4, check_pages=True))
    with EngineCore(eng, max_waiting=6) as c:
        yield c


def test_requests_from_many_threads_equal_each_alone(core, tiny_target):
    """Requests added at once from four threads, and one that joins while they run: greedy output is
    ``generate`` of the request alone, token for token."""
    ref = plain_greedy(tiny_target, 16, 4)  # equal to each prompt alone (tests/test_generate.py)
    handles = [None] * 4

    def add(i):
        handles[i] = core.add(PROMPTS_4[i], GREEDY)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next(iter(handles[0]))  # the batch is running: one more joins it
    late = core.add(PROMPTS_4[3], GREEDY)
    results = [h.result() for h in handles]  # the first event, read above, included
    assert [r.token_ids for r in results] == ref and results[0].token_ids[:len(first.token_ids)] == first.token_ids
    assert late.result().token_ids == ref[3]
    assert all(r.finish_reason == "length" and r.stats.num_tokens == MAX_NEW for r in results)


def test_sampled_requests_keep_their_tokens_beside_anything(core, tiny_target):
    """A seeded sampled request gives the same tokens alone, beside a mixed batch, and as
    ``generate`` of it alone; greedy neighbours with controls keep theirs; streamed logprobs match."""
    alone = core.add(PROMPTS_4[1], HOT).result()
    mixed = core.add_group(list(zip(PROMPTS_4, MIXED))).results()
    assert mixed[1].token_ids == alone.token_ids
    assert mixed[0].token_ids == plain_greedy(tiny_target, 16, 4)[0]
    out = js.generate(tiny_target, [PROMPTS_4[1]], draft=drafts(tiny_target)["perturbed"], spec=SPEC,
                      sampling=HOT, engine=engine(16, 4))
    assert alone.token_ids == out.token_ids[0]
    np.testing.assert_allclose(alone.logprobs, out.logprobs[0], rtol=1e-4, atol=1e-4)
    assert [list(d) for d in alone.top_logprobs] == [list(d) for d in out.top_logprobs[0]]
    controlled = js.generate(tiny_target, [PROMPTS_4[2]], sampling=MIXED[2], engine=engine(16, 4))
    assert mixed[2].token_ids == controlled.token_ids[0]


def test_a_steady_mixed_load_compiles_nothing_new(core):
    """The same mix of greedy, sampled, filtered, controlled and logprob requests, arriving in
    another order: every program it needs was compiled by the first round of it."""
    for order in (MIXED, MIXED[::-1]):  # warm-up: each request also runs alone and in every company
        [h.result() for h in [core.add(p, s) for p, s in zip(PROMPTS_4, order)]]
    before = compiled_programs()
    for order in (MIXED[1:] + MIXED[:1], MIXED):
        [h.result() for h in [core.add(p, s) for p, s in zip(PROMPTS_4[::-1], order)]]
    assert compiled_programs() == before


def test_cancel_frees_pages_after_the_running_call(core):
    idle = core.snapshot()["free_pages"]
    h = core.add(PROMPTS_4[2], js.SamplingParams(max_new_tokens=100))
    stream = iter(h)
    assert next(stream).token_ids
    assert core.snapshot()["free_pages"] < idle
    h.cancel()
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in rest) < 100
    assert core.snapshot()["free_pages"] == idle and core.snapshot()["running"] == 0


def _within(seconds: float, fn):
    """``fn()``, failing the test where it has not returned after ``seconds`` (a read that would
    wait for ever)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still waiting after {seconds} s"
    return out[0]


def test_events_are_read_once_and_their_result_kept(core):
    """A request's events are read once: after its last, iterating again yields nothing and
    ``result()`` returns what they added up to, the same object every call; a group alike."""
    h = core.add(PROMPTS_4[0], GREEDY)
    events = list(h)
    assert _within(30, lambda: list(h)) == []
    r = _within(30, h.result)
    assert r is h.result() and r.token_ids == [t for e in events for t in e.token_ids] and r.finish_reason == "length"
    group = core.add_group([(PROMPTS_4[1], GREEDY), (PROMPTS_4[2], GREEDY)])
    first = next(iter(group))
    results = group.results()
    assert _within(30, group.results) == results and _within(30, lambda: list(group)) == []
    assert results[group.position(first)].token_ids[:len(first.token_ids)] == first.token_ids
    assert [x.token_ids for x in results] == [y.result().token_ids for y in group.handles]
    assert all(x.finish_reason == "length" for x in results)
    # A request of a group: its result read through the group, the others' events kept for theirs.
    group = core.add_group([(PROMPTS_4[1], js.SamplingParams(max_new_tokens=4)), (PROMPTS_4[2], GREEDY)])
    with pytest.raises(RuntimeError, match="added in a group"):
        next(iter(group.handles[1]))
    short = _within(30, group.handles[0].result)
    assert short.token_ids == results[0].token_ids[:4] and short.finish_reason == "length"
    assert _within(30, group.results)[1].token_ids == results[1].token_ids


def test_bad_requests_and_a_full_queue_are_refused_before_the_device(core, tiny_target):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add([1, 500], GREEDY)
    with pytest.raises(ValueError, match="max_seq_len"):
        core.add([1] * 120, GREEDY)
    with pytest.raises(ValueError, match="stop token ids"):
        core.add([1], js.SamplingParams(max_new_tokens=8, stop_token_ids=tuple(range(20))))
    with pytest.raises(QueueFull):
        core.add_group([(PROMPTS_4[0], GREEDY)] * 7)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_group([(PROMPTS_4[0], GREEDY), ([999], GREEDY)])
    assert core.snapshot()["waiting"] == 0  # all or nothing


BYTES = tuple(bytes([b]) for b in range(256))


def test_live_grammars_renumber_kept_automata():
    """A table rebuilt for a new automaton drops the released ones; the kept automaton's states map
    to the same positions of its language."""
    a, b, c = (compile_automaton(compile_dfa(p), BYTES, 256) for p in ("ab+c", "[0-9]{3}", "x(yz)*"))
    g = LiveGrammars(256)
    ia, _ = g.acquire(a)
    ib, renumber = g.acquire(b)
    before = g.walk(ib, b"12")
    assert renumber is not None and g.acquire(a)[1] is None  # held twice: no rebuild
    g.release(ia), g.release(ia)
    ic, (states, index) = g.acquire(c)
    assert index == {ib: 0} and ic == 1
    assert states[before] == g.walk(index[ib], b"12")
    assert g.ended(ic, b"xyz") is False and g.set.final[g.walk(ic, b"xyz")]
    g.release(0), g.release(1)
    assert g.set is None


def test_a_row_without_filters_draws_from_the_same_distribution_in_every_plan():
    """``filtering`` (some row uses top-k / top-p) must not touch the other rows' distributions, or
    a sampled request's tokens would depend on its neighbours."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 96)) * 3
    rows = RowSampling(temperature=jnp.full((4,), 0.7), top_k=jnp.array([0, 5, 0, 0]),
                       top_p=jnp.array([1.0, 1.0, 0.9, 1.0]), min_p=jnp.array([0.0, 0.0, 0.0, 0.1]))
    on, off = (np.asarray(target_probs(logits, rows, filtering=f)) for f in (True, False))
    np.testing.assert_array_equal(on[[0, 3]], off[[0, 3]])


def test_the_cores_plans_are_built_like_the_engines(tiny_target):
    """Every plan of the core (its prefill's, each decode variant's) keeps what the engine's own plan
    carries beside the per-request flags: the exact mode and the XLA options."""
    from jaxspec.engine.core import _CoreLoop

    eng = js.Engine(tiny_target, engine=js.EngineConfig(page_size=16, max_batch=2, max_seq_len=64, exact=True))
    loop = _CoreLoop(eng, 1)
    prefill_plan, decode_plan = loop._round_plans([])
    for plan in (loop.plan, prefill_plan, decode_plan):
        assert plan.exact and plan.compiler_options == eng.plan.compiler_options


REPEATING = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [1, 2, 3, 1, 2, 3, 1, 2, 3], [9, 9, 9, 9, 9, 9], [4, 5, 4, 5, 4]]


@pytest.mark.parametrize("spec", [js.SpecConfig.chain(3), js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)],
                         ids=["chain", "tree"])
def test_a_sampled_ngram_row_keeps_its_tokens_whatever_its_neighbours_verify(tiny_target, spec):
    """N-gram lookup verifies per step the prefix the batch needs; a sampled row accepts only what it
    proposed itself, and a row that proposed nothing draws its token with the uniform a verified
    chain would use, so its tokens for a seed are the same alone, beside rows with long matches, and
    as ``generate`` of it alone (with neither rule the mixed run differs)."""
    hot = js.SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)
    greedy = js.SamplingParams(max_new_tokens=24)
    draft = js.NgramDraft(max_ngram=3)
    with EngineCore(js.Engine(tiny_target, draft=draft, spec=spec, engine=engine(16, 4))) as c:
        alone = c.add(REPEATING[1], hot).result().token_ids
        mixed = c.add_group([(REPEATING[0], greedy), (REPEATING[1], hot), (REPEATING[2], greedy),
                             (REPEATING[3], hot)]).results()
    assert mixed[1].token_ids == alone
    out = js.generate(tiny_target, [REPEATING[1]], draft=draft, spec=spec, sampling=hot, engine=engine(16, 4))
    assert out.token_ids[0] == alone
    assert max(np.concatenate([r.stats.accept_lens for r in mixed])) > 1  # drafts were accepted


def test_a_prompt_is_scored_in_the_thread_that_adds_it(core, monkeypatch):
    """Echo's prompt scoring (a forward over the prompt) runs in the caller's thread, never in the
    core thread between decode calls; its first event carries the scores."""
    from jaxspec.engine import core as core_module

    threads = []

    def scoring(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    real = core_module.prompt_logprobs
    monkeypatch.setattr(core_module, "prompt_logprobs", scoring)
    h = core.add(PROMPTS_4[0], GREEDY, prompt_logprobs=2)
    first = next(iter(h))
    assert threads == [threading.current_thread().name] and first.prompt_logprobs is not None
    values, tops = first.prompt_logprobs
    assert values[0] is None and len(values) == len(PROMPTS_4[0]) and len(tops[1]) == 2
    h.result()


@pytest.fixture(scope="module")
def demo_core():
    """The demo target (it has a tokenizer, for constraints), plain decoding."""
    from jaxspec.demo import DEMO_TARGET

    target = js.load_model(DEMO_TARGET, dtype="float32", progress=False)
    with EngineCore(js.Engine(target, engine=engine(16, 2, max_seq_len=64))) as c:
        yield c


def test_a_constraint_without_room_in_the_table_waits_for_it(demo_core, monkeypatch):
    """Two constraints whose automata fit the grammar table alone but not together: the second waits
    (queued, counted as waiting) until the first request ends, then runs; a waiting one can be
    cancelled; one too large alone is refused when added."""
    from jaxspec.engine import core as core_module
    from jaxspec.structured.automaton import join_automata

    tok, vocab = demo_core.eng.target.tokenizer, padded_vocab_size(demo_core.eng.target.config)
    # Hundreds of states each: the table pads states to powers of two, so two fill more than one.
    a, b, c = (js.SamplingParams(max_new_tokens=6, regex=r) for r in (r"[ab]{2,400}", r"[0-9]{3,400}", r"z[0-9]+"))
    auto = [compile_constraint(tok, vocab, *s.constraint) for s in (a, b)]
    alone = max(join_automata([x], vocab).next_state.size for x in auto)
    assert join_automata(auto, vocab).next_state.size > alone  # the test's premise
    monkeypatch.setattr(core_module, "MAX_TABLE_CELLS", alone)
    prompt = tok.encode("Answer:")
    first, second, third = (demo_core.add(prompt, s) for s in (a, b, c))
    demo_core.cancel(third)  # waits behind the first too
    events = [list(h) for h in (first, second, third)]
    out = [collect(e) for e in events]
    reasons = [r.finish_reason for r in out]
    assert set(reasons[:2]) <= {"stop", "length"}, [(r.finish_reason, r.error) for r in out]
    assert reasons[2] == "cancelled"
    assert events[1][0].time > events[0][-1].time  # it ran after the first had ended
    assert re.fullmatch(r"[ab]+", out[0].text) and re.fullmatch(r"[0-9]+", out[1].text), (out[0].text, out[1].text)
    monkeypatch.setattr(core_module, "MAX_TABLE_CELLS", alone // 4)
    with pytest.raises(ValueError, match="more than the"):
        demo_core.add(prompt, b)
