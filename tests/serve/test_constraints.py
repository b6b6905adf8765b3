"""The server's constraint processes: compiles that come back equal to the in-process ones, errors as
ValueErrors, and a compile past its time limit stopped with its process (a fresh process starts in its place
at once); a start that fails gives its slots back, nothing starts after ``close``, and ``close``
waits for the starts under way in the background."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

import jaxspec as js
from jaxspec.demo import DEMO_TARGET
from jaxspec.serve import constraints
from jaxspec.serve.constraints import ConstraintCompiler
from jaxspec.structured import build_automaton

SLOW = r"([a-z]{1,40}@){1,60}"  # about a second to compile on a CPU core (0.6 s at 30 repeats)


@pytest.fixture(scope="module")
def compiler():
    tok = js.load_model(DEMO_TARGET, dtype="float32", progress=False).tokenizer
    c = ConstraintCompiler(tok, 4096, processes=1)
    c.start()
    yield tok, c
    c.close()


def test_a_compile_equals_the_in_process_one_and_errors_are_value_errors(compiler):
    tok, c = compiler
    got = c.compile("regex", r"[0-9]{2,5}-[ab]+", timeout=60)
    want = build_automaton(tok.token_bytes, tok.first_token_bytes, 4096, "regex", r"[0-9]{2,5}-[ab]+")
    np.testing.assert_array_equal(got.next_state, want.next_state)
    np.testing.assert_array_equal(got.final, want.final)
    with pytest.raises(ValueError, match="regex"):
        c.compile("regex", r"(unclosed", timeout=60)


def test_a_compile_past_its_limit_ends_its_process(compiler):
    _, c = compiler
    before = c.pids()
    assert len(before) == 1
    t = time.perf_counter()
    with pytest.raises(TimeoutError):
        c.compile("regex", SLOW, timeout=0.2)
    assert time.perf_counter() - t < 5  # it did not wait for the compile
    assert before[0] not in c.pids()  # that process is gone, not compiling on in the background
    until = time.monotonic() + 120  # its replacement starts with no request asking for it
    while not c.pids() and time.monotonic() < until:
        time.sleep(0.05)
    assert len(c.pids()) == 1 and c.pids() != before
    replacement = c.pids()
    assert c.compile("regex", r"[ab]{2,9}", timeout=60).num_states > 0  # and serves the next
    assert c.pids() == replacement


class FakeWorker:
    """A worker process's stand-in (nothing spawned): fails to start while ``fail`` is set, runs
    ``during_start`` (a close arriving while it starts) before it is up."""

    fail, during_start, made = True, None, []

    def __init__(self, context, args):
        if FakeWorker.during_start is not None:
            FakeWorker.during_start()
        if FakeWorker.fail:
            raise RuntimeError("a constraint compiler process did not start")
        self.alive, self.conn = True, types.SimpleNamespace(send=lambda job: None)
        FakeWorker.made.append(self)

    def stop(self):
        self.alive = False


def test_a_failed_start_gives_its_slots_back_and_nothing_starts_after_close(monkeypatch):
    monkeypatch.setattr(constraints, "_Worker", FakeWorker)
    monkeypatch.setattr(FakeWorker, "made", [])
    c = ConstraintCompiler(types.SimpleNamespace(token_bytes=(), first_token_bytes=()), 4096, processes=2)
    with pytest.raises(RuntimeError, match="did not start"):
        c.start()
    assert c._idle.qsize() == 2  # every slot back, empty
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="did not start"):  # a slot at once, not a wait for one that never comes
        c.compile("regex", "[ab]", timeout=3)
    assert time.perf_counter() - t < 1
    monkeypatch.setattr(FakeWorker, "fail", False)
    c.start()
    assert len(FakeWorker.made) == 2 and sorted(map(id, c._workers)) == sorted(map(id, FakeWorker.made))
    c.close()
    assert not any(w.alive for w in FakeWorker.made)
    c.start()  # the slots' workers are stopped: a start after close replaces none
    assert len(FakeWorker.made) == 2 and c._idle.qsize() == 2
    late = ConstraintCompiler(types.SimpleNamespace(token_bytes=(), first_token_bytes=()), 4096, processes=2)
    monkeypatch.setattr(FakeWorker, "during_start", late.close)  # closed while its first worker starts
    with pytest.raises(RuntimeError, match="closed"):
        late.start()
    assert len(FakeWorker.made) == 3 and not FakeWorker.made[-1].alive and not late._workers
    assert late._idle.qsize() == 2


def test_close_waits_for_a_start_under_way_in_the_background(monkeypatch):
    """A server closing while its compiler processes start (``start_soon``): ``close`` returns
    only after that start has ended and stopped the process it was bringing up."""
    monkeypatch.setattr(constraints, "_Worker", FakeWorker)
    monkeypatch.setattr(FakeWorker, "made", [])
    monkeypatch.setattr(FakeWorker, "fail", False)
    starting, gate = threading.Event(), threading.Event()
    monkeypatch.setattr(FakeWorker, "during_start", lambda: (starting.set(), gate.wait(30)))
    c = ConstraintCompiler(types.SimpleNamespace(token_bytes=(), first_token_bytes=()), 4096, processes=1)
    c.start_soon()
    assert starting.wait(30)
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the start, which waits for the gate
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert len(FakeWorker.made) == 1 and not FakeWorker.made[0].alive and not c._workers
