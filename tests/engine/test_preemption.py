"""The engine under memory pressure: optimistic admission, preemption and resume.

A request's output does not depend on whether, when or how often it was preempted: every case runs
under a page budget far smaller than its requests' worst case (natural exhaustion; the pools keep
their full size, so the pressured run compiles nothing the unpressured one has not) and, where
marked, a hook that preempts the most recently admitted request every few calls, then compares with
an unpressured run (or with HF's greedy tokens, which the unpressured engine reproduces). Every pool kind (paged MHA,
MLA latent, sliding-window, recurrent state), chain and tree, every draft loop, pages 1 and 16; the
page accounting is checked after every call (``EngineConfig(check_pages=True)``).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec as js
from jaxspec.engine.allocator import KVCacheExhausted
from jaxspec.engine.programs import compiled_programs
from jaxspec.engine.scheduler import MAX_STALLS, Request, Scheduler
from jaxspec.kvcache.paging import pages_needed
from tests.conftest import PROMPTS_4, engine
from tests.spec.test_lossless import MAX_NEW, drafts, plain_greedy

TREE = js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)


def tight(prompts, max_new: int, page: int, *, slack: int = 40, share: float = 1.5) -> int:
    """A pool of ``share`` times one request's worst case (the largest request alone always fits):
    a fraction of the batch's worst case."""
    one = pages_needed(max(len(p) for p in prompts) + max_new + slack, page)
    return int(share * one) + 1


def pressured(page: int, prompts, max_new: int, *, every: int = 0, **kw) -> js.EngineConfig:
    """The tests' engine (full-size pools, so its programs are the unpressured runs') under a page
    budget of ``tight``."""
    return engine(page, 4, page_budget=tight(prompts, max_new, page), preempt_every=every, check_pages=True, **kw)


def check_run(out, ref, min_preemptions: int = 1):
    assert out.token_ids == ref
    assert out.kv_pages_free == out.kv_pages_total
    assert sum(s.preemptions for s in out.stats) >= min_preemptions, [s.preemptions for s in out.stats]


# ----------------------------------------------------------------------------- tiny Llama target

LLAMA_CASES = [  # (draft, spec, page, forced every)
    (None, None, 1, 0),
    ("eagle3", js.SpecConfig.chain(3), 16, 2),
    ("perturbed", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8), 1, 3),  # test_lossless's size
    ("ngram", js.SpecConfig.chain(4), 16, 2),
    ("hybrid", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=8, ngram_tokens=3), 16, 1),
    ("dflash", js.SpecConfig.chain(3), 1, 2),
]


def llama_draft(target, kind):
    if kind in ("eagle3", "same", "perturbed"):
        return drafts(target)[kind]
    if kind == "ngram":
        return js.NgramDraft(max_ngram=2)
    if kind == "hybrid":
        return js.HybridDraft(drafts(target)["perturbed"], js.NgramDraft(max_ngram=2))
    from tests.spec.test_dflash import tiny_dflash  # noqa: PLC0415  (its fixtures build the draft)
    return tiny_dflash(target)


@pytest.mark.parametrize("kind,spec,page,every", LLAMA_CASES,
                         ids=[f"{k}-{'plain' if s is None else f'S{s.num_steps}k{s.topk}n{s.num_draft_tokens}'}-page{p}"
                              f"-every{e}" for k, s, p, e in LLAMA_CASES])
def test_preempted_output_equals_unpressured(tiny_target, kind, spec, page, every):
    draft = None if kind is None else llama_draft(tiny_target, kind)
    out = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=js.SamplingParams(max_new_tokens=MAX_NEW),
                      engine=pressured(page, PROMPTS_4, MAX_NEW, every=every), progress=False)
    check_run(out, plain_greedy(tiny_target, page, 4))


def test_a_page_budget_behaves_as_a_pool_of_its_size(tiny_target):
    """Natural exhaustion only: a pool of ``tight`` pages and a full-size pool under a budget of
    ``tight`` admit and preempt the same requests at the same calls."""
    sampling, pages = js.SamplingParams(max_new_tokens=MAX_NEW), tight(PROMPTS_4, MAX_NEW, 1)
    small = js.generate(tiny_target, PROMPTS_4, sampling=sampling, engine=engine(1, 4, num_pages=pages), progress=False)
    budget = js.generate(tiny_target, PROMPTS_4, sampling=sampling, engine=engine(1, 4, page_budget=pages),
                         progress=False)
    check_run(small, plain_greedy(tiny_target, 1, 4))
    assert budget.token_ids == small.token_ids
    assert budget.kv_pages_total == small.kv_pages_total == pages - 1
    assert [s.preemptions for s in budget.stats] == [s.preemptions for s in small.stats]
    assert [s.admission_cached_tokens for s in budget.stats] == [s.admission_cached_tokens for s in small.stats]


def test_reserve_admission_never_preempts(tiny_target):
    eng = engine(1, 4, page_budget=tight(PROMPTS_4, MAX_NEW, 1), admission="reserve", check_pages=True)
    out = js.generate(tiny_target, PROMPTS_4, sampling=js.SamplingParams(max_new_tokens=MAX_NEW), engine=eng,
                      progress=False)
    assert out.token_ids == plain_greedy(tiny_target, 1, 4)
    assert all(s.preemptions == 0 for s in out.stats)


def test_sampled_resume_continues_the_prng_controls_logprobs_and_stream(tiny_target):
    """A sampled request with penalties, a logit bias and logprobs, preempted several times: its
    tokens, logprobs and accept statistics are an unpressured run's, and its stream hands out every
    token once."""
    sampling = js.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, top_k=30, repetition_penalty=1.3,
                                 frequency_penalty=0.4, presence_penalty=0.2, logit_bias={5: 2.0}, logprobs=3)
    draft, spec = drafts(tiny_target)["perturbed"], js.SpecConfig.chain(3)
    ref = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=engine(16, 4),
                      seed=7, progress=False)
    eng = pressured(16, PROMPTS_4, MAX_NEW, every=1)
    out = js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=eng, seed=7,
                      progress=False)
    check_run(out, ref.token_ids, min_preemptions=2)
    for a, b in zip(out.logprobs, ref.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)
    assert [list(d) for t in out.top_logprobs for d in t] == [list(d) for t in ref.top_logprobs for d in t]
    assert [s.accept_lens for s in out.stats] == [s.accept_lens for s in ref.stats]
    streamed = [[] for _ in PROMPTS_4]
    for event in js.generate_stream(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=eng,
                                    seed=7):
        streamed[event.index] += event.token_ids
    assert streamed == ref.token_ids


@pytest.mark.parametrize("requests,min_preemptions", [
    pytest.param(12, 3, id="12-requests"),
    pytest.param(32, 8, id="32-requests", marks=pytest.mark.exhaustive),
])
def test_stress_wide_tree_many_requests_small_pool(tiny_target, requests, min_preemptions):
    """SGLang's stress shape: trees of topk 16 and 64 draft tokens (a lookahead of 66 positions),
    ragged requests (32 in the exhaustive run), a pool of two requests' worst case, forced
    preemption every 3 calls on top of natural exhaustion."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 96, size=int(n)).tolist() for n in rng.integers(1, 24, size=32)][:requests]
    sampling = js.SamplingParams(max_new_tokens=48)
    spec = js.SpecConfig(num_steps=4, topk=16, num_draft_tokens=64)
    base = dict(max_seq_len=128, steps_per_call=2)
    ref = js.generate(tiny_target, prompts, sampling=sampling, engine=engine(16, 8, **base), progress=False)
    worst = pages_needed(max(len(p) for p in prompts) + 48 + 66, 16)
    eng = engine(16, 8, page_budget=2 * worst + 1, preempt_every=3, check_pages=True, **base)
    out = js.generate(tiny_target, prompts, draft=drafts(tiny_target)["perturbed"], spec=spec, sampling=sampling,
                      engine=eng, progress=False)
    check_run(out, ref.token_ids, min_preemptions=min_preemptions)


def test_preemption_compiles_nothing_new_in_steady_state(tiny_target):
    draft, spec = drafts(tiny_target)["perturbed"], js.SpecConfig.chain(3)
    eng = pressured(16, PROMPTS_4, MAX_NEW, every=2)
    sampling = js.SamplingParams(max_new_tokens=MAX_NEW)
    js.generate(tiny_target, PROMPTS_4, draft=draft, spec=spec, sampling=sampling, engine=eng, progress=False)
    before = compiled_programs()
    other = [[(t + 3) % 96 for t in p] for p in PROMPTS_4]
    out = js.generate(tiny_target, other, draft=draft, spec=spec, sampling=sampling, engine=eng, progress=False)
    assert sum(s.preemptions for s in out.stats) > 0
    assert compiled_programs() == before


# ----------------------------------------------------------------------------- other pool kinds


def test_mla_pool_with_mtp_draft():
    from tests.spec.test_mla_spec import golden  # noqa: PLC0415

    case, target, draft, ref = golden("deepseek_v3_dense")
    n, prompts = case["greedy_new_tokens"], case["prompts"]
    out = js.generate(target, prompts, draft=draft, spec=TREE, sampling=js.SamplingParams(max_new_tokens=n,
                                                                                          stop_token_ids=()),
                      engine=pressured(1, prompts, n, every=3, max_seq_len=64), progress=False)
    check_run(out, [ref[f"greedy_{i}"].tolist() for i in range(len(prompts))])


@pytest.mark.parametrize("name,draft,spec,page", [
    ("mistral_swa", "perturbed", TREE, 16),
    ("gemma4_text", "gemma4_assistant", js.SpecConfig.chain(3), 1),
])
def test_sliding_window_pools(name, draft, spec, page):
    from tests.spec.test_sliding_lossless import draft_for  # noqa: PLC0415
    from tests.model.sliding_golden import arrays, case, target  # noqa: PLC0415

    c = case(name)
    n, prompts = c["greedy_new_tokens"], c["prompts"]
    out = js.generate(target(name), prompts, draft=draft_for(name, draft), spec=spec,
                      sampling=js.SamplingParams(max_new_tokens=n, stop_token_ids=()),
                      engine=pressured(page, prompts, n, every=2, max_seq_len=64, steps_per_call=1), progress=False)
    check_run(out, [arrays(name)[f"greedy_{i}"].tolist() for i in range(len(prompts))])
    assert out.kv_window_pages_free == out.kv_window_pages_total
    # a resumed request finds its own pages, windows included, in the prefix cache
    assert any(hit > 0 for s in out.stats for hit in s.admission_cached_tokens[1:]), out.stats


def test_recurrent_state_with_mtp_draft():
    from tests.spec.test_hybrid_lossless import MAX_NEW as HYBRID_NEW, draft_of, plain, prompts  # noqa: PLC0415
    from tests.model.targets.test_golden_hybrid import target  # noqa: PLC0415

    name = "qwen3_5_dense"
    out = js.generate(target(name), prompts(name), draft=draft_of(name, "mtp"), spec=TREE,
                      sampling=js.SamplingParams(max_new_tokens=HYBRID_NEW, stop_token_ids=()),
                      engine=pressured(16, prompts(name), HYBRID_NEW, every=2, max_seq_len=256), progress=False)
    check_run(out, plain(name, 16))


# ----------------------------------------------------------------------------- the scheduler alone


def requests(lens, max_new=8):
    return [Request(i, list(range(1, n + 1)), js.SamplingParams(max_new_tokens=max_new), (), np.zeros(2, np.uint32))
            for i, n in enumerate(lens)]


def test_the_latest_admitted_is_preempted_and_resumes_first():
    sched = Scheduler(requests([8, 8, 8, 8], max_new=16), batch=4, width=8, num_pages=13, page_size=4, lookahead=0,
                      step_growth=4, admission="optimistic")
    seq = np.zeros(4, np.int32)
    first = sched.admit(seq)
    assert [r.index for r in first] == [0, 1, 2]  # 12 pages: 4 each for the prompt and one call's growth
    for r in first:
        seq[r.row] = 8
        r.tokens = [1]
    sched.grant_ahead(seq)
    assert sched.to_preempt(seq) == [] and sched.admit(seq) == []
    seq[:3] = 14  # each now needs 5 pages for the next call: 15 > 12
    victims = sched.to_preempt(seq)
    assert victims == [2]
    sched.preempt(2, resume=None)
    sched.check()
    assert [r.index for r in sched.waiting] == [2, 3] and sched.rows[2] is None
    sched.grant_ahead(seq)
    sched.check()


def test_the_accounting_check_catches_a_page_in_two_rows():
    sched = Scheduler(requests([4, 4]), batch=2, width=4, num_pages=9, page_size=4, lookahead=0, step_growth=4,
                      admission="optimistic")
    sched.admit(np.zeros(2, np.int32))
    sched.check()
    sched.page_table[1, 0] = sched.page_table[0, 0]
    with pytest.raises(AssertionError, match="page table"):
        sched.check()


def test_preemption_without_progress_is_an_error_naming_the_pool():
    sched = Scheduler(requests([4, 4]), batch=2, width=4, num_pages=9, page_size=4, lookahead=0, step_growth=4,
                      admission="optimistic")
    seq = np.zeros(2, np.int32)
    with pytest.raises(RuntimeError, match=r"preempted 8 times in a row without progress: the KV pool \(8 pages"):
        for _ in range(MAX_STALLS + 1):
            for r in sched.admit(seq):
                r.tokens = [1]
            victim = sched.rows[1]
            sched.preempt(1, resume=type("R", (), {"tokens": list(victim.tokens)})())


@pytest.mark.parametrize("field", ["num_pages", "page_budget"])
def test_a_request_that_cannot_fit_alone_is_refused_with_its_numbers(tiny_target, field):
    with pytest.raises(KVCacheExhausted, match=r"request 2 needs up to \d+ pages of 16 slots but the pool has 2 "
                                               rf"\(raise EngineConfig.{field}\)"):
        js.generate(tiny_target, PROMPTS_4, sampling=js.SamplingParams(max_new_tokens=MAX_NEW),
                    engine=engine(16, 4, **{field: 3}), progress=False)


@pytest.mark.parametrize("field,value,message", [
    ("admission", "lazy", "admission must be 'optimistic' or 'reserve'"),
    ("preempt_every", -1, "preempt_every must be an int >= 0"),
    ("check_pages", 1, "check_pages must be a bool"),
    ("page_budget", 1, "page_budget must be None or >= 2"),
])
def test_engine_config_checks_the_new_fields(field, value, message):
    with pytest.raises(ValueError, match=message):
        js.EngineConfig(**{field: value})


def test_mla_indexer_pool_with_prefix_cache_and_preemption():
    """DeepSeek-V3.2 (MLA latent + indexer keys, contexts past ``index_topk``): prompts behind a shared
    prefix, MTP tree drafting with its own indexer, a small pool with forced preemption and the prefix
    cache: the output is an unpressured, uncached plain run's."""
    from tests.spec.test_dsa_spec import PROMPTS as DSA_PROMPTS, dsa_target_and_mtp  # noqa: PLC0415

    target, mtp = dsa_target_and_mtp()
    prompts = [list(range(40, 57)) + p for p in DSA_PROMPTS]
    sampling = js.SamplingParams(max_new_tokens=12, stop_token_ids=())
    ref = js.generate(target, prompts, sampling=sampling, engine=engine(1, 2, max_seq_len=80, prefix_cache=False),
                      progress=False)
    out = js.generate(target, prompts, draft=mtp, spec=TREE, sampling=sampling,
                      engine=pressured(1, prompts, 12, every=2, max_seq_len=80), progress=False)
    check_run(out, ref.token_ids)
    assert sum(s.cached_tokens for s in out.stats) >= 16
