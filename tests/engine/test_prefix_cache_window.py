"""The prefix cache with sliding-window pools (``jaxspec.engine.window``): window pages cached under
the full pages' keys, a hit only where the window before it is cached, prefill checkpoints where a
newcomer's match ended. Targets: the HF-made tiny Gemma 4 (sliding and full layers, window 6), its
E2B kind (K/V-sharing layers) and Mistral with a window of 6 (every layer sliding: its hits come
from windows alone), page 4.

Each scenario runs in successive calls of one ``jaxspec.Engine`` (so the cache holds what earlier
calls wrote) and compares every output with a fresh engine of the same sizes, where nothing is cached
yet (``tests/engine/cache_flows.py``):

* a chat's second turn (turn 1's prompt, its answer and a new question) hits at turn 1's prompt
  end, whose window the ring held when turn 1's prefill ended;
* three questions behind one system prompt: the first caches nothing the second can use (its
  ring holds its own question), the second writes a checkpoint of the window at the system
  prompt's end, the third hits there.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jaxspec as js
from tests.conftest import engine
from tests.engine.cache_flows import chat_turn_2, engine_for, shared_tokens, system_prompt_questions
from tests.model.sliding_golden import assistant, target
from tests.spec.test_sliding_lossless import standalone

PAGE = 4
GREEDY = js.SamplingParams(max_new_tokens=10, stop_token_ids=())
rng = np.random.default_rng(7)
SYSTEM = rng.integers(3, 250, 26).tolist()  # 6 full pages and a half
QUESTIONS = [rng.integers(3, 250, n).tolist() for n in (13, 9, 11)]
TURN_1 = rng.integers(3, 250, 23).tolist()
TURN_2_EXTRA = rng.integers(3, 250, 7).tolist()

CASES = [  # (target, draft, spec)
    ("mistral_swa", None, None),
    ("gemma4_text", None, None),
    ("mistral_swa", "perturbed", js.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)),
    ("gemma4_text", "gemma4_assistant", js.SpecConfig.chain(3)),
    # the E2B kind: its K/V-sharing layers hold no pool layers; the assistant reads the store layers'
    ("gemma4_ple", "gemma4_ple_assistant", js.SpecConfig.chain(3)),
]


def _draft(name, kind):
    if kind is None:
        return None
    return assistant(kind) if kind.startswith("gemma4_assistant") else standalone(name, kind)


@functools.cache
def _engine(name, kind, spec, cache: bool) -> js.Engine:
    return js.Engine(target(name), draft=_draft(name, kind), spec=spec,
                     engine=engine(PAGE, 1, max_seq_len=96, prefix_cache=cache, check_pages=True))


def _run(name, kind, spec, cache, prompt):
    return engine_for(_engine, name, kind, spec, True, cache=cache).generate([prompt], sampling=GREEDY, progress=False)


@pytest.mark.parametrize("name,kind,spec", CASES, ids=[f"{n}-{k or 'plain'}" for n, k, _ in CASES])
def test_window_pages_are_cached_and_hit(name, kind, spec):
    eng = _engine(name, kind, spec, True)
    window = eng.pages.window
    assert window is not None and window.caching and eng.pages.caches is not None
    run = lambda cache, prompt: _run(name, kind, spec, cache, prompt)  # noqa: E731
    second, _ = chat_turn_2(run, TURN_1, TURN_2_EXTRA)  # turn 2 holds turn 1's prompt and answer
    assert second.stats[0].cached_tokens == shared_tokens(len(TURN_1), PAGE)  # at turn 1's prompt end
    # A system prompt, then three questions.
    start = window.checkpoints
    outs, totals = system_prompt_questions(run, SYSTEM, QUESTIONS, each=lambda: window.checkpoints)
    hits = [on.stats[0].cached_tokens for on, _ in outs]
    checkpoints = [b - a for a, b in zip([start] + totals, totals)]
    shared = len(SYSTEM) // PAGE * PAGE  # the system prompt's full pages (the next token is a question's)
    assert hits == [0, 0, shared], hits
    assert checkpoints[0] == 0 and checkpoints[1] > 0 and checkpoints[2] == 0, checkpoints
    assert window.hits > 0
    pools = eng.pages
    assert all(a.num_free == a.capacity for a in pools.allocators + window.allocators)  # all parked or free


def test_a_full_page_hit_stops_where_the_cached_window_does():
    """Hits never pass the cached window: with window_cache_pages=0 the cache is refused by name
    (its full pages would be shared without their windows), and ``WindowPages.hit`` picks the
    most pages whose window is cached."""
    with pytest.raises(ValueError, match="window_cache_pages=0"):
        js.Engine(target("mistral_swa"), engine=engine(PAGE, 1, prefix_cache=True, window_cache_pages=0))
    window = _engine("mistral_swa", None, None, True).pages.window
    from jaxspec.engine.window import WindowPages  # noqa: PLC0415

    w = WindowPages(batch=1, ring=window.ring, num_pages=40, page_size=PAGE, retain=7, caching=True)
    keys = [bytes([j]) * 16 for j in range(10)]
    for j in (3, 4, 5, 7, 8):  # windows cached around pages 3-5 and 7-8 (retain 7: two pages back)
        w.page_of[0][keys[j]] = 10 + j
    assert w.needed_from(6) == 4 and w.needed_from(9) == 7
    assert w.hit(0, keys, 9) == 9  # pages 7, 8 cached
    assert w.hit(0, keys, 8) == 6  # page 6 missing: 8 and 7 fail, 6 needs pages 4, 5
    assert w.hit(0, keys, 3) == 0  # page 1 and 2 missing
