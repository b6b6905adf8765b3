"""The chat flows every prefix-cache test of a state kind runs (windows, recurrent state, compressed
KV), each against a reference run that finds nothing cached. ``run(cache, prompt)`` generates one
prompt on a persistent engine with the cache (True), or on a fresh engine of the same sizes whose
cache is still empty (False), and returns its ``GenerateOutput``.

Why a fresh engine and not one with ``prefix_cache=False``: the cache gives an engine more pages
(parked window pages, snapshot slots), so an engine without it has pools of other shapes and
compiles every program again, the most expensive part of these tests; a fresh engine of the same
sizes runs the very programs of the cached one, and its single request cannot hit anything. What
such an engine gives is checked against HF's greedy tokens by the lossless tests (their engines
have the cache on), and an engine without the cache is compared with one with it in the last
scenario of ``tests/engine/test_prefix_cache_recurrent.py`` and in ``scripts/check_prefix_cache.py``."""

from __future__ import annotations


def engine_for(cached_engine, *args, cache: bool):
    """The module's engine with the cache (``cached_engine``, a ``functools.cache`` of its arguments),
    or, for the reference (``cache=False``), a fresh engine of the same sizes with nothing cached yet."""
    return cached_engine(*args) if cache else cached_engine.__wrapped__(*args)


def shared_tokens(prefix_len: int, page: int) -> int:
    """A hit behind a shared prefix: its full pages whose following token is in the prefix too."""
    return (prefix_len - 1) // page * page


def chat_turn_2(run, turn_1: list[int], extra: list[int]):
    """Turn 1, then turn 2 (turn 1's prompt, its answer and ``extra``), outputs equal with the cache
    off; returns turn 2's (cache on, cache off) outputs."""
    first = run(True, turn_1)
    assert first.token_ids == run(False, turn_1).token_ids
    turn_2 = turn_1 + first.token_ids[0] + extra
    on, off = run(True, turn_2), run(False, turn_2)
    assert on.token_ids == off.token_ids
    return on, off


def system_prompt_questions(run, system: list[int], questions: list[list[int]], each=None):
    """Each question behind ``system``, one call each, outputs equal with the cache off; ``each()``
    after every call (a counter to read). Returns the (cache on, cache off) outputs and each's value."""
    outs, seen = [], []
    for q in questions:
        on, off = run(True, system + q), run(False, system + q)
        assert on.token_ids == off.token_ids, q
        outs.append((on, off))
        seen.append(each() if each else None)
    return outs, seen
