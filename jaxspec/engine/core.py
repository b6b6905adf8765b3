"""The serving core: an ``Engine`` run continuously by one thread, taking requests at any time.

    core = EngineCore(jaxspec.Engine(target, draft=draft, spec=spec, engine=config))
    handle = core.add(prompt_ids, jaxspec.SamplingParams(max_new_tokens=64))   # any thread
    for event in handle: ...                      # or ``async for`` with ``add(..., loop=loop)``
    core.cancel(handle)                           # any thread; its pages are free after the running call
    core.close()

The core thread runs the host loop (``jaxspec.engine.host_loop.HostLoop``) a round at a time and,
between rounds, takes in what arrived (``add``) and what was cancelled (``cancel``): new requests
join the running batch at the next admission (continuous batching across callers). Each request's
events (its new tokens, their text and log-probabilities, its finish) go to its own handle.

What a call (``Run``) fixes from its requests, the core keeps in a bounded set of programs and
state that changes only between calls:

* The decode state has one layout for the core's life: the output buffers for ``max_seq_len``
  tokens, ``max_stop_ids`` stop-id slots, the log-probability buffers for ``MAX_LOGPROBS``.
* The plan has the controls and the log-probabilities always on (rows that use neither are exact
  under them: neutral penalties and biases change no logit; measured on a CPU their cost is within
  noise); each decode call samples only when a running row samples, and sorts for top-k / top-p
  only when a running row filters (3 variants: sampling costs 1.5-2x and the sorts 2-3x per token
  on a CPU). The prefill always runs the general plan (its token pick over the admitted rows is
  cheap).
* The structured-output table (``LiveGrammars``) holds the automata of the requests the core
  holds, in power-of-two buckets: a constraint that needs a larger bucket is one more compiled
  variant; automata no request holds are dropped when the table is rebuilt, every running row's
  automaton state renumbered on the host.

A request's output does not depend on what runs beside it: greedy rows take the argmax of logits
their neighbours do not touch, a sampled row draws from its own PRNG key (the request's seed, or
the core's seed folded with the request's id) with its own filters (``target_probs`` gives a row
without top-k / top-p the unfiltered distribution in every plan) and accepts only the drafts it
proposed itself (``jaxspec.spec.step``: an n-gram step verifies what the batch needs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxspec.config import MAX_LOGPROBS, SamplingParams
from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.engine.geometry import next_pow2
from jaxspec.engine.host_loop import HostLoop, _deactivate, _row_mask, request_stats
from jaxspec.engine.placement import create, create_state, place_rows, run_context, to_host
from jaxspec.engine.requests import check_sampling_fits, request_keys
from jaxspec.engine.scheduler import Request
from jaxspec.engine.scoring import prompt_logprobs
from jaxspec.engine.state import DecodeState
from jaxspec.model.config import padded_vocab_size
from jaxspec.results import RequestStats, StreamEvent
from jaxspec.sampling.grammar_masks import DEAD, FREE, GrammarTable
from jaxspec.structured import compile_constraint
from jaxspec.structured.automaton import Automaton, GrammarSet, join_automata, table_cells

# Most cells (states x token classes) of the structured-output table (int32: 64 MiB).
MAX_TABLE_CELLS = 1 << 24
# Adaptive chains: the depths of this many recent calls are kept (a core runs for ever).
ADAPTIVE_HISTORY = 1024


class QueueFull(RuntimeError):
    """The core holds ``max_waiting`` requests that are not running yet."""


@dataclasses.dataclass
class CoreEvent(StreamEvent):
    """A ``StreamEvent`` of a core request, with: ``time`` (``time.perf_counter()`` when the core
    handed it out), ``prompt_logprobs`` (the first event of a request that asked: per prompt
    token its log-probability given the tokens before it, None for the first, and a dict of the
    top ones), ``stats`` (the last event: the request's ``RequestStats``), ``error`` (the last
    event of a request that failed or was cancelled: why; ``finish_reason`` is then "error" or
    "cancelled"), ``cached_tokens`` (every event of a running request: its prompt positions
    found in the prefix cache at its first admission, as its stats will say)."""

    time: float = 0.0
    prompt_logprobs: tuple[list[float | None], list[dict[int, float] | None]] | None = None
    stats: RequestStats | None = None
    error: str | None = None
    cached_tokens: int | None = None


class RequestHandle:
    """One request of a core: its events in order, from a blocking iterator (``for event in
    handle``) or, when added with an asyncio ``loop``, an async one (``async for``). The events are
    read once: iterating again after the last yields nothing, and ``result()`` returns what they
    added up to, however they were read. A request of a group (``add_group``) shares the group's
    queue: its events are read through the group, and its ``result()`` reads the group's events
    until its own last. ``t_added``: when ``add`` took it; ``first_token_time``: when its first
    token was handed out."""

    def __init__(self, core: "EngineCore", id: int, prompt: list[int], sampling: SamplingParams, loop=None,
                 shared=None):
        self.core, self.id, self.prompt, self.sampling = core, id, prompt, sampling
        self.loop = loop
        self._queue = shared if shared is not None else asyncio.Queue() if loop is not None else queue.SimpleQueue()
        self.t_added = time.perf_counter()
        self.first_token_time: float | None = None
        self._read = RequestResult(token_ids=[], text=None, finish_reason=None)  # the events read so far
        self._read_to_end = False  # the consumer's side: a second read would wait for ever
        self._group: RequestGroup | None = None  # set by the group this request was added in

    def _push(self, event: CoreEvent) -> None:  # the core thread
        if event.token_ids and self.first_token_time is None:
            self.first_token_time = event.time
        if self.loop is None:
            self._queue.put(event)
        else:
            try:
                self.loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody listens
                pass

    def _took(self, event: CoreEvent) -> CoreEvent:
        accumulate(self._read, event)
        self._read_to_end = event.finished
        return event

    def _own_queue(self) -> None:
        if self._group is not None and not self._read_to_end:
            raise RuntimeError(f"request {self.id} was added in a group: its events come from the group's "
                               "iterator (for event in group), which reads every request's; result() works on either")

    def __iter__(self):
        self._own_queue()
        while not self._read_to_end:
            yield self._took(self._queue.get())

    async def __aiter__(self):
        self._own_queue()
        while not self._read_to_end:
            yield self._took(await self._queue.get())

    def cancel(self) -> None:
        self.core.cancel(self)

    def result(self) -> "RequestResult":
        """Waits for the request's end (a blocking handle) and returns what it produced (the same
        object on every call, with what earlier reads of the events took)."""
        if self._group is None:
            for _ in self:
                pass
        elif not self._read_to_end:
            for _ in self._group:  # the others' events go to their own results
                if self._read_to_end:
                    break
        return self._read


class RequestGroup:
    """Requests added together (``add_group``): their events in arrival order from one queue,
    until every one has finished (``for event in group`` / ``async for``; ``position(event)``:
    which item it belongs to)."""

    def __init__(self, handles: list[RequestHandle], shared):
        self.handles, self._queue = handles, shared
        self._position = {h.id: i for i, h in enumerate(handles)}
        self._left = len(handles)  # requests whose last event was not read yet
        for h in handles:
            h._group = self

    def position(self, event: CoreEvent) -> int:
        return self._position[event.index]

    def _took(self, event: CoreEvent) -> CoreEvent:
        self.handles[self.position(event)]._took(event)
        self._left -= event.finished
        return event

    def __iter__(self):
        while self._left:
            yield self._took(self._queue.get())

    async def __aiter__(self):
        while self._left:
            yield self._took(await self._queue.get())

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def results(self) -> list["RequestResult"]:
        """Waits for every request (a blocking group); their results in item order (on every call,
        with what earlier reads of the events took)."""
        for _ in self:
            pass
        return [h._read for h in self.handles]


@dataclasses.dataclass
class RequestResult:
    """A finished core request, its events put together."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: tuple | None = None
    stats: RequestStats | None = None
    error: str | None = None


def collect(events) -> RequestResult:
    """A request's events (an iterable ending with its last) put together."""
    out = RequestResult(token_ids=[], text=None, finish_reason=None)
    for e in events:
        accumulate(out, e)
    return out


def accumulate(out: RequestResult, e: CoreEvent) -> None:
    out.token_ids += e.token_ids
    if e.text is not None:
        out.text = (out.text or "") + e.text
    if e.logprobs is not None:
        out.logprobs = (out.logprobs or []) + e.logprobs
        out.top_logprobs = (out.top_logprobs or []) + e.top_logprobs
    if e.prompt_logprobs is not None:
        out.prompt_logprobs = e.prompt_logprobs
    if e.finished:
        out.finish_reason, out.stats, out.error = e.finish_reason, e.stats, e.error
        out.stop_reason = e.stats.stop_reason if e.stats is not None else None


class GrammarTableFull(ValueError):
    """The running requests' automata and a newcomer's do not fit in one table together."""


class LiveGrammars:
    """The structured-output automata of the requests a core holds, joined into one table
    (``GrammarSet``: padded to power-of-two states and classes, so a table that grows within its
    bucket compiles nothing new). ``acquire`` adds a request's automaton (shared by requests with
    the same constraint); ``release`` drops a hold. Adding one that is not held yet rebuilds the
    table without the automata nobody holds, which renumbers states: the caller renumbers its
    rows with the returned maps."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.automata: list[Automaton] = []
        self.holds: list[int] = []
        self.set: GrammarSet | None = None

    def acquire(self, automaton: Automaton) -> tuple[int, tuple[np.ndarray, dict[int, int]] | None]:
        """(the automaton's index, None) when the table has it; else (its index, (state map: old
        global state -> new, index map: old automaton index -> new)) after a rebuild. Raises a
        ``GrammarTableFull`` when the table would pass ``MAX_TABLE_CELLS`` (the caller retries once
        a hold is released: ``EngineCore.check`` refuses an automaton too large alone)."""
        for i, a in enumerate(self.automata):
            if a is automaton:
                self.holds[i] += 1
                return i, None
        keep = [i for i, h in enumerate(self.holds) if h > 0]
        automata = [self.automata[i] for i in keep] + [automaton]
        joined = join_automata(automata, self.vocab_size)
        if joined.next_state.size > MAX_TABLE_CELLS:
            raise GrammarTableFull(f"the structured-output table of the running requests would hold "
                                   f"{joined.next_state.size} cells (at most {MAX_TABLE_CELLS})")
        old = self.set
        states = np.full(1 if old is None else old.next_state.shape[0], FREE, np.int32)
        if old is not None:
            states[DEAD] = DEAD
            for new, i in enumerate(keep):
                n = old.automata[i].num_states
                states[old.offsets[i]:old.offsets[i] + n] = joined.offsets[new] + np.arange(n, dtype=np.int32)
        index = {i: new for new, i in enumerate(keep)}
        self.automata, self.holds, self.set = automata, [self.holds[i] for i in keep] + [1], joined
        return len(automata) - 1, (states, index)

    def release(self, which: int) -> None:
        self.holds[which] -= 1
        if not any(self.holds):  # nothing constrained left: the table goes (the programs compile it out)
            self.automata, self.holds, self.set = [], [], None

    def walk(self, which, tokens) -> int:
        return self.set.walk(which, tokens)

    def ended(self, which, tokens) -> bool:
        return self.set.ended(which, tokens)


class _CoreLoop(HostLoop):
    """The host loop of a core: requests come and go between rounds; each round's plan sets the
    flags its rows need over one decode-state layout."""

    def __init__(self, eng, max_stop_ids: int):
        target = eng.target
        self.eng, self.spec, self.engine = eng, eng.spec, eng.config
        self.k = min(MAX_LOGPROBS, target.config.vocab_size)
        # Controls and log-probabilities always compiled in (their cost is within noise on a CPU, and
        # rows that use neither are exact under them); sampling and the top-k / top-p sorts are per round.
        self.plan = dataclasses.replace(eng.plan, greedy_only=True, filtering=False, controls=True,
                                        logprobs=self.k)
        self.prefill_plan = dataclasses.replace(self.plan, greedy_only=False, filtering=True)
        self.num_stop = next_pow2(max(1, max_stop_ids))
        self.out_width = next_pow2(eng.config.max_seq_len + self.plan.max_accept)
        self.vocab = padded_vocab_size(target.config)  # the logits' width (controls, grammar)
        self.grammars = LiveGrammars(self.vocab)
        self.adaptive = None
        self._plans: dict = {}
        self.reset()

    def reset(self) -> None:
        """A fresh decode state and scheduler over the engine's page pools (after a fault)."""
        eng = self.eng
        if self.spec is not None and self.spec.adaptive_steps:
            self.adaptive = AdaptiveSteps(candidates=self.spec.adaptive_steps, steps=self.spec.num_steps)
        self.sched = eng.pages.scheduler([], admission=eng.config.admission)
        draft_seed = None if eng.draft is None else eng.draft.config.empty_seed(
            eng.batch, dtype=eng.dtype, max_len=eng.width * eng.config.page_size)
        self.state = create_state(lambda: DecodeState.empty(
            batch=eng.batch, out_width=self.out_width, num_stop=self.num_stop, seed=draft_seed,
            hidden_dtype=eng.dtype, control_vocab=self.vocab, top_logprobs=self.k), eng.target.mesh)
        self.grammars = LiveGrammars(self.vocab)
        self._start_rounds()

    @property
    def idle(self) -> bool:
        return self.sched.finished

    def _round_plans(self, admitted):
        """The prefill runs the general plan (its token pick over the admitted rows is cheap); the
        decode call samples and sorts only when a running row needs it."""
        rows = [r.sampling for r in self.sched.rows if r is not None]
        key = (all(s.is_greedy for s in rows), any(s.filters for s in rows))
        if key not in self._plans:
            self._plans[key] = dataclasses.replace(self.plan, greedy_only=key[0], filtering=key[1])
        if self.adaptive and len(self.adaptive.history) > 2 * ADAPTIVE_HISTORY:
            del self.adaptive.history[:-ADAPTIVE_HISTORY]
        return self.prefill_plan, self._plans[key]

    def set_grammar(self, states: np.ndarray | None) -> None:
        """The current table into the state (none: compiled out); ``states`` renumbers the rows'
        automaton states (old global state -> new)."""
        mesh = self.eng.target.mesh
        gs = self.grammars.set
        table = GrammarTable.empty() if gs is None else gs.device_table()
        specs = jax.tree.map(lambda _: P(), jax.eval_shape(lambda: table))
        table = create(lambda: table, specs, mesh) if mesh is not None else table
        grammar = self.state.grammar
        if states is not None:
            old = np.asarray(to_host(grammar))
            grammar = place_rows(states[np.minimum(old, len(states) - 1)].astype(np.int32), mesh)
        self.state = dataclasses.replace(self.state, grammar_table=table, grammar=grammar)

    def _keeps_logprobs(self, rows) -> bool:
        return False  # the events carried them

    def stop_row(self, row: int) -> None:
        self.state = _deactivate(self.state, place_rows(_row_mask(len(self.sched.rows), [row]),
                                                        self.eng.target.mesh))


@dataclasses.dataclass
class _Arrival:
    handle: RequestHandle
    automaton: Automaton | None
    prompt_scores: tuple | None  # ``prompt_logprobs``' result, computed by the thread that added it


class EngineCore:
    """An ``Engine`` served continuously by one thread (this module's docstring).

    Args:
      engine: the engine whose pools and compiled programs the core uses (it serves nothing else
        while the core runs).
      max_waiting: most requests held that are not running yet (``add`` raises ``QueueFull``
        past it); None: no limit.
      max_stop_ids: stop-token slots per request (the model's eos ids or ``stop_token_ids``);
        ``add`` refuses a request with more.
      seed: the PRNG seed of requests without a seed of their own (folded with the request's id).

    The thread starts with the core; ``close()`` ends it (requests still held end with an error
    event).
    """

    def __init__(self, engine, *, max_waiting: int | None = None, max_stop_ids: int = 16, seed: int = 0):
        if engine.busy:
            raise RuntimeError("this Engine is serving a call: a core needs it to itself")
        engine.busy = True
        self.eng, self.max_waiting, self.seed = engine, max_waiting, seed
        self.max_stop_ids = max_stop_ids
        self.depth = 0 if engine.spec is None else engine.spec.depth
        self._loop = _CoreLoop(engine, max_stop_ids)
        self._cv = threading.Condition()
        self._inbox: list[_Arrival] = []
        self._deferred: list[_Arrival] = []  # core thread: constrained arrivals waiting for table room
        self._cancels: list[int] = []
        self._handles: dict[int, RequestHandle] = {}  # core thread: the requests it holds
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._closed = False
        # Counters (read from any thread; written by the core thread).
        self.tokens_in = self.tokens_out = self.finished = self.faults = 0
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine-core", daemon=True)
        self._thread.start()

    # --- any thread ---

    def add(self, prompt: list[int], sampling: SamplingParams | None = None, *, prompt_logprobs: int | None = None,
            loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queues one request (token ids); returns its handle. Raises ValueError for a request the
        engine cannot serve (before any device work) and ``QueueFull`` when ``max_waiting``
        requests wait. ``prompt_logprobs``: also score the prompt, with that many top tokens per
        position (the first event carries them; scored here, in the caller's thread). ``loop``:
        deliver events to this asyncio loop."""
        return self._queue_requests([(prompt, sampling)], [prompt_logprobs], loop, None)[0]

    def add_group(self, items, *, prompt_logprobs=None, loop: asyncio.AbstractEventLoop | None = None) -> RequestGroup:
        """``add`` for several (prompt, sampling) pairs at once: all are queued, or none; their events
        come from one queue (``RequestGroup``). ``prompt_logprobs``: one per item (or None)."""
        shared = asyncio.Queue() if loop is not None else queue.SimpleQueue()
        scores = list(prompt_logprobs) if prompt_logprobs is not None else [None] * len(items)
        return RequestGroup(self._queue_requests(items, scores, loop, shared), shared)

    def score(self, prompt: list[int], k: int) -> tuple:
        """``prompt_logprobs`` of a prompt with ``k`` top tokens: one forward over it, in the
        caller's thread, so the core thread's decode calls never wait for it (an echo's scores)."""
        with run_context(self.eng.target.mesh):
            return prompt_logprobs(self.eng.target, self.eng.plan, prompt, k)

    def _queue_requests(self, items, scores, loop, shared) -> list[RequestHandle]:
        checked = [self.check(p, s) for p, s in items]
        if any(k is not None for k in scores):
            with self._cv:
                self._check_room(len(items))  # a request refused for room does no device work
            scores = [None if k is None else self.score(ids, k) for ((ids, _), _), k in zip(checked, scores)]
        with self._cv:
            self._check_room(len(items))
            handles = []
            for ((p, s), automaton), scored in zip(checked, scores):
                h = RequestHandle(self, next(self._ids), p, s, loop, shared)
                self._inbox.append(_Arrival(h, automaton, scored))
                handles.append(h)
            self._cv.notify()
        return handles

    def _check_room(self, n: int) -> None:  # under self._cv
        if self._closed:
            raise RuntimeError("the engine core is closed")
        if self.max_waiting is not None and self.waiting + n > self.max_waiting:
            raise QueueFull(f"{self.waiting} requests are waiting (at most {self.max_waiting})")

    def check(self, prompt, sampling: SamplingParams | None) -> tuple[tuple[list[int], SamplingParams], Automaton | None]:
        """What ``add`` checks before queuing: ids, lengths, stop ids, page needs, the constraint
        (compiled here, in the caller's thread; cached by its text)."""
        target, config = self.eng.target, self.eng.config
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ValueError(f"the prompt has token id {bad[0]} outside the vocabulary [0, {target.config.vocab_size})")
        check_sampling_fits([sampling], target.config.vocab_size)
        if len(ids) + sampling.max_new_tokens > config.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens + max_new_tokens {sampling.max_new_tokens} = "
                             f"{len(ids) + sampling.max_new_tokens} > max_seq_len {config.max_seq_len}")
        stops = self._stop_ids(sampling)
        if len(stops) > self.max_stop_ids:
            raise ValueError(f"{len(stops)} stop token ids; at most {self.max_stop_ids}")
        if target.tokenizer is None and sampling.stop:
            raise ValueError("stop strings need the target's tokenizer (tokenizer.json next to its weights)")
        self._loop.sched.size(Request(-1, ids, sampling, stops, np.zeros(2, np.uint32)))
        automaton = None
        if sampling.constraint is not None:
            if target.tokenizer is None:
                raise ValueError("structured output (regex / json_schema) needs the target's tokenizer")
            automaton = compile_constraint(target.tokenizer, padded_vocab_size(target.config), *sampling.constraint)
            cells = table_cells([automaton], padded_vocab_size(target.config))
            if cells > MAX_TABLE_CELLS:
                raise ValueError(f"the constraint's automaton needs a table of {cells} cells, more than the "
                                 f"{MAX_TABLE_CELLS} the engine holds for every running request together")
        return (ids, sampling), automaton

    def cancel(self, handle: RequestHandle) -> None:
        """Ends a request (a client went away): it stops before the next call and its pages go
        back; its last event has finish_reason "cancelled". No effect on a finished request."""
        with self._cv:
            self._cancels.append(handle.id)
            self._cv.notify()

    @property
    def waiting(self) -> int:
        """Requests held that are not running yet (just added, queued, or preempted)."""
        return len(self._inbox) + len(self._deferred) + len(self._loop.sched.waiting)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._loop.sched.rows)

    def snapshot(self) -> dict:
        """Gauges and counters for metrics (numbers only; read without stopping the core)."""
        sched = self._loop.sched
        hits = sum(c.hits for c in sched.caches or ()) * sched.page_size
        snaps = sched.snapshots
        # Every cache's evictions: full pages, window pages, entry pages, snapshots.
        caches = sched.allocators + (sched.window.allocators if sched.window is not None else []) + [
            a for e in sched.entries for a in e.allocators] + (snaps.allocators if snaps is not None else [])
        return dict(running=self.running, waiting=self.waiting, free_pages=sched.num_free,
                    total_pages=sched.capacity, preemptions=sched.preempted, prefix_cache_hit_tokens=hits,
                    prefix_cache_evictions=sum(a.evictions for a in caches),
                    prefix_cache_snapshots=0 if snaps is None else snaps.written,
                    prefix_cache_snapshot_hits=0 if snaps is None else snaps.hits,
                    prefilled_tokens=sched.prefilled,
                    tokens_in=self.tokens_in, tokens_out=self.tokens_out, finished=self.finished,
                    faults=self.faults, rounds=self.rounds)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stops the core thread (after the running call) and gives the engine back."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the core thread ---

    def _stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        s = sampling.stop_token_ids
        return tuple(s if s is not None else self.eng.target.eos_token_ids)

    def _run(self) -> None:
        with run_context(self.eng.target.mesh):
            while True:
                with self._cv:
                    while (not self._closed and not self._inbox and not self._cancels and self._loop.idle
                           and not self._deferred):
                        self._cv.wait()
                    if self._closed:
                        break
                    # Deferred arrivals first (they came earlier); one still without room waits again.
                    arrivals, self._inbox, self._deferred = self._deferred + self._inbox, [], []
                    cancels, self._cancels = self._cancels, []
                try:
                    for a in arrivals:
                        self._arrive(a)
                    for rid in cancels:
                        self._cancel(rid)
                    if self._loop.idle:
                        continue
                    events = self._loop.round()
                    self.rounds += 1
                except Exception as e:  # noqa: BLE001  a fault: every request held ends with it, the core goes on
                    self._fail(f"{type(e).__name__}: {e}")
                    continue
                self._deliver(events)
            self._fail("the engine core was closed", closing=True)
            self._loop.sched.release_all()
            self.eng.busy = False

    def _arrive(self, a: _Arrival) -> None:
        h = a.handle
        loop = self._loop
        which = None
        try:
            if a.automaton is not None:
                which, renumber = loop.grammars.acquire(a.automaton)
                if renumber is not None:
                    states, index = renumber
                    for r in self._requests.values():
                        if r.constraint is not None:
                            r.constraint = index[r.constraint]
                    loop.set_grammar(states)
            scores = a.prompt_scores
        except GrammarTableFull as e:
            if any(loop.grammars.holds):
                self._deferred.append(a)  # room comes when a constrained request ends
                return
            h._push(CoreEvent(index=h.id, token_ids=[], text=None, finished=True, finish_reason="error",
                              time=time.perf_counter(), error=str(e)))  # too large even alone
            return
        except ValueError as e:
            if which is not None:
                self._release_grammar(which)
            h._push(CoreEvent(index=h.id, token_ids=[], text=None, finished=True, finish_reason="error",
                              time=time.perf_counter(), error=str(e)))
            return
        key = request_keys(self.seed, [h.sampling], indices=[h.id])[0]
        r = Request(h.id, h.prompt, h.sampling, self._stop_ids(h.sampling), key, constraint=which)
        loop.sched.enqueue(r)
        self._handles[h.id], self._requests[h.id] = h, r
        self.tokens_in += len(h.prompt)
        if scores is not None:
            h._push(CoreEvent(index=h.id, token_ids=[], text=None, finished=False, time=time.perf_counter(),
                              prompt_logprobs=scores))

    def _release_grammar(self, which: int) -> None:
        self._loop.grammars.release(which)
        if self._loop.grammars.set is None:
            self._loop.set_grammar(None)

    def _cancel(self, rid: int) -> None:
        r = self._requests.pop(rid, None)
        if r is None:
            waiting = [a for a in self._deferred if a.handle.id == rid]
            if waiting:  # still waiting for room in the grammar table
                self._deferred.remove(waiting[0])
                waiting[0].handle._push(CoreEvent(index=rid, token_ids=[], text=None, finished=True,
                                                  finish_reason="cancelled", time=time.perf_counter(),
                                                  error="cancelled"))
            return  # finished already (or never accepted)
        h = self._handles.pop(rid)
        row = self._loop.sched.drop(r)
        if row is not None:
            self._loop.stop_row(row)
        if r.constraint is not None:
            self._release_grammar(r.constraint)
        h._push(CoreEvent(index=rid, token_ids=[], text=None, finished=True, finish_reason="cancelled",
                          time=time.perf_counter(), error="cancelled"))

    def _deliver(self, events: list[StreamEvent]) -> None:
        now = time.perf_counter()
        sched = self._loop.sched
        done = {r.index: r for r in sched.done}
        sched.done.clear()
        for e in events:
            h = self._handles.get(e.index)
            if h is None:
                continue
            event = CoreEvent(**{f.name: getattr(e, f.name) for f in dataclasses.fields(StreamEvent)}, time=now,
                              cached_tokens=self._requests[e.index].cached_tokens)
            self.tokens_out += len(e.token_ids)
            if e.finished:
                r = done[e.index]
                event.stats = request_stats(r, self.depth)
                del self._handles[e.index], self._requests[e.index]
                if r.constraint is not None:
                    self._release_grammar(r.constraint)
                self.finished += 1
            h._push(event)

    def _fail(self, why: str, closing: bool = False) -> None:
        """Every request held ends with an error event; after a fault the core starts over on fresh
        state (and fresh pools when the failed call had consumed them)."""
        now = time.perf_counter()
        with self._cv:
            arrivals, self._inbox = self._inbox, []
        arrivals, self._deferred = self._deferred + arrivals, []
        held = [a.handle for a in arrivals] + list(self._handles.values())
        for h in held:
            h._push(CoreEvent(index=h.id, token_ids=[], text=None, finished=True, finish_reason="error", time=now,
                              error=why))
        self._handles.clear()
        self._requests.clear()
        if closing:
            return
        self.faults += 1
        self._loop.sched.release_all()
        if any(x.is_deleted() for x in jax.tree.leaves((self.eng.tpool, self.eng.dpool))):
            self.eng.create_pools()  # donated to the call that failed: the KV (and any cached prefix) is gone
        self._loop.reset()
