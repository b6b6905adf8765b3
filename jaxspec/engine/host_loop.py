"""One call on an ``Engine``: its requests' plan and decode state, and the host loop that
admits, prefills, grants pages, runs a compiled decode call, hands out what it committed,
preempts and resumes under memory pressure, and retires finished requests.

Glossary: B batch rows, T prefill length bucket, R prefilled rows (grouped by data shard).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.config import MAX_LOGPROBS, EngineConfig, SamplingParams
from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.engine.geometry import next_pow2
from jaxspec.engine.placement import create_state, place_rows, place_table, run_context, to_host
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_program, prefill_program
from jaxspec.engine.requests import check_requests, request_keys
from jaxspec.engine.scheduler import Request, Scheduler
from jaxspec.engine.state import DecodeState
from jaxspec.engine.text import RequestText
from jaxspec.kvcache.paging import PageTables, WindowTable, pages_needed
from jaxspec.kvcache.recurrent import SnapshotTable
from jaxspec.model.config import padded_vocab_size
from jaxspec.sampling.controls import TokenLogprobs
from jaxspec.sampling.distributions import RowSampling
from jaxspec.results import GenerateOutput, RequestStats, StreamEvent, accepted_per_position


@dataclasses.dataclass
class Resume:
    """What a preempted request carries back to its next admission, beside its prompt and tokens
    (``Request.tokens``): what the device held for it."""

    tokens: list[int]  # its output when preempted (progress is measured against it)
    accept_lens: list[int]  # its verify steps' accept lengths so far
    steps: int  # PRNG draws so far (the row's fold_in counter)
    verify_lens: list[int] = dataclasses.field(default_factory=list)  # and their verified lengths
    logprobs: list[float] | None = None  # when it asked for them: one per token so far
    top_ids: list[list[int]] | None = None
    top: list[list[float]] | None = None


class HostLoop:
    """The host loop over an engine's pools, a round at a time (``round``): admit, prefill, grant
    pages, run a decode call, hand out what it committed, preempt and resume under memory pressure,
    retire finished requests. A call (``Run``) drives it over a fixed set of requests; the serve
    core (``jaxspec.engine.core``) over requests that arrive while it runs.

    What a subclass sets before the first round: ``eng`` (the Engine), ``plan`` (the layout plan),
    ``spec``, ``adaptive`` (an ``AdaptiveSteps`` or None), ``sched``, ``state``, ``grammars`` (the
    structured-output automata: ``walk`` / ``ended``, or None), ``num_stop``, ``engine`` (the
    EngineConfig); then ``_start_rounds()``."""

    def _start_rounds(self) -> None:
        eng = self.eng
        self.target, self.draft, self.dparams = eng.target, eng.draft, eng.dparams
        batch = len(self.sched.rows)
        self.seq_lens = np.zeros(batch, np.int32)
        self.seen = np.zeros(batch, np.int32)  # tokens of each row handed out so far
        self.window = 1 + self.sched.step_growth  # most tokens a row can gain in one round trip (a prefill's first included)
        self.calls = 0
        self._depth_plans: dict = {}

    @property
    def tpool(self):
        return self.eng.tpool

    @tpool.setter
    def tpool(self, value):
        self.eng.tpool = value

    @property
    def dpool(self):
        return self.eng.dpool

    @dpool.setter
    def dpool(self, value):
        self.eng.dpool = value

    def _round_plans(self, admitted: list[Request]):
        """The plans of this round's prefill and decode call (a call's are its one plan)."""
        return self.plan, self.plan

    def _depth_plan(self, plan):
        """``plan`` at the adaptive chain's current depth (``plan`` itself for a fixed shape)."""
        if not self.adaptive:
            return plan
        key = (plan, self.adaptive.steps)
        if key not in self._depth_plans:
            self._depth_plans[key] = dataclasses.replace(plan, spec=self.spec.with_steps(self.adaptive.steps))
        return self._depth_plans[key]

    def round(self) -> list[StreamEvent]:
        """One round trip: preempt what must leave, admit what fits, prefill it, run one decode call
        and return the events of every request it advanced (the finished ones retired)."""
        sched, engine, target = self.sched, self.engine, self.target
        seq_lens, seen = self.seq_lens, self.seen
        batch = len(sched.rows)
        force = bool(engine.preempt_every) and self.calls > 0 and self.calls % engine.preempt_every == 0
        victims = sched.to_preempt(seq_lens, force=force)
        if victims:
            self._preempt(victims)
        admitted = sched.admit(seq_lens)
        prefill_plan, plan = self._round_plans(admitted)
        if admitted:
            self.state, self.tpool, self.dpool = _prefill(prefill_plan, target, self.dparams, self.state, self.tpool,
                                                          self.dpool, sched, admitted, self.num_stop, engine,
                                                          self.grammars)
            sched.cache_prompts(admitted)
            for r in admitted:
                seq_lens[r.row] = len(r.context)
                seen[r.row] = len(r.tokens)
                if r.text is None:  # a resumed request keeps its text and stop-string state
                    r.text = RequestText(target.tokenizer.decode_stream() if target.tokenizer else None,
                                         r.sampling.stop or ())
        if all(r is None for r in sched.rows):
            raise RuntimeError("scheduler made no progress (no request could be admitted)")
        sched.grant_ahead(seq_lens)
        self.calls += 1
        adaptive = self.adaptive
        call_plan = self._depth_plan(plan)
        before = to_host(dict(out_lens=self.state.out_lens, nv=self.state.num_verify)) if adaptive else None
        live = max(int(seq_lens[row]) for row, r in enumerate(sched.rows) if r is not None)
        table = _live_tables(sched, live + sched.step_growth + plan.lookahead, engine, target.mesh)
        self.state, self.tpool, self.dpool, _ = decode_program(call_plan, target.params, self.dparams, self.state,
                                                               self.tpool, self.dpool, table)
        start = place_rows(seen, target.mesh)
        lp = self.state.logprobs if plan.logprobs is not None else None
        host = to_host(dict(
            seq_lens=self.state.seq_lens, active=self.state.active, out_lens=self.state.out_lens,
            nv=self.state.num_verify, stop_token=self.state.stop_token,
            recent=_recent_tokens(self.state.out_tokens, start, self.window),
            lp=None if lp is None else _recent_logprobs(lp, start, self.window)))
        if adaptive:
            steps_run = int((host["nv"] - before["nv"]).sum())
            if steps_run:
                adaptive.update(float((host["out_lens"] - before["out_lens"]).sum()) / steps_run)
        seq_lens[:] = host["seq_lens"]
        events, finished_rows, cut_rows = [], [], []
        for row, r in enumerate(sched.rows):
            if r is None:
                continue
            new = host["recent"][row, : int(host["out_lens"][row]) - seen[row]].tolist()
            keep = r.text.add(new)
            new = new[:keep]
            seen[row] += len(new)
            r.tokens.extend(new)
            done = not host["active"][row] or r.text.stop_reason is not None
            if r.text.stop_reason is not None and host["active"][row]:
                cut_rows.append(row)
            if done:
                # "stop": a stop string or token, or a structured-output match nothing may extend.
                matched = r.constraint is not None and self.grammars.ended(r.constraint, r.tokens)
                stopped = r.text.stop_reason is not None or host["stop_token"][row] >= 0
                r.finish_reason = "stop" if stopped or matched else "length"
                r.stop_reason = r.text.stop_reason if r.text.stop_reason is not None else (
                    int(host["stop_token"][row]) if host["stop_token"][row] >= 0 else None)
                finished_rows.append(row)
            text = r.text.take(final=done) if target.tokenizer is not None else None
            if new or done or text:
                event = StreamEvent(index=r.index, token_ids=new, text=text, finished=done,
                                    finish_reason=r.finish_reason if done else None)
                if r.sampling.logprobs is not None and host["lp"] is not None:
                    k, n = r.sampling.logprobs, len(new)
                    event.logprobs = host["lp"].chosen[row, :n].tolist()
                    event.top_logprobs = [dict(zip(i, v)) for i, v in zip(host["lp"].top_ids[row, :n, :k].tolist(),
                                                                         host["lp"].top[row, :n, :k].tolist())]
                events.append(event)
        if cut_rows:  # stop strings: these rows end now on the device too
            self.state = _deactivate(self.state, place_rows(_row_mask(batch, cut_rows), target.mesh))
        if finished_rows:
            self._retire(finished_rows)
        if engine.check_pages:
            sched.check()
        return events

    def _device_rows(self, with_steps: bool = False, logprobs: bool = True) -> dict:
        """What the host keeps of a row that leaves the batch: accept log, PRNG position, logprobs."""
        return to_host(dict(log=self.state.accept_log, vlog=self.state.verify_log, nv=self.state.num_verify,
                            steps=self.state.steps if with_steps else None,
                            lp=self.state.logprobs if logprobs and self.plan.logprobs is not None else None))

    def _history(self, r: Request, out: dict, row: int) -> Resume:
        """Request ``r``'s accept lengths, PRNG position and logprobs so far: what earlier stints in
        the batch left (``r.resume``) followed by what row ``row`` of the device holds."""
        before = r.resume
        nv = int(out["nv"][row])
        accept = (before.accept_lens if before else []) + out["log"][row, :nv].tolist()
        verify = (before.verify_lens if before else []) + out["vlog"][row, :nv].tolist()
        res = Resume(tokens=list(r.tokens), accept_lens=accept, verify_lens=verify,
                      steps=int(out["steps"][row]) if out["steps"] is not None else 0)
        if r.sampling.logprobs is not None and out["lp"] is not None:
            k, n, lp = r.sampling.logprobs, len(r.tokens), out["lp"]
            m = len(before.logprobs) if before else 0  # earlier tokens' are the host's (columns < m hold none)
            res.logprobs = (before.logprobs if before else []) + lp.chosen[row, m:n].tolist()
            res.top_ids = (before.top_ids if before else []) + lp.top_ids[row, m:n, :k].tolist()
            res.top = (before.top if before else []) + lp.top[row, m:n, :k].tolist()
        return res

    def _preempt(self, rows: list[int]) -> None:
        """Takes ``rows`` off the batch: the host keeps what their requests need to resume, their
        pages go back, and the device rows stop."""
        out = self._device_rows(with_steps=True, logprobs=self._keeps_logprobs(rows))
        for row in rows:
            r = self.sched.rows[row]
            self.sched.preempt(row, self._history(r, out, row))
        self.state = _deactivate(self.state, place_rows(_row_mask(len(self.sched.rows), rows), self.target.mesh))

    def _keeps_logprobs(self, rows: list[int]) -> bool:
        """Whether the device's log-probabilities of ``rows`` are kept when they leave the batch."""
        return True

    def _retire(self, rows: list[int]) -> None:
        """Finished rows: their accept lengths and log-probabilities, then their pages back."""
        out = self._device_rows(logprobs=self._keeps_logprobs(rows))
        for row in rows:
            r = self.sched.rows[row]
            h = self._history(r, out, row)
            log = h.accept_lens
            if r.text.stop_reason is not None:  # steps past a stop string's cut produced nothing kept
                log = _steps_behind(log, len(r.tokens))
            r = self.sched.retire(row, r.tokens, log)
            r.verify_lens = h.verify_lens[: len(log)]
            if r.sampling.logprobs is not None and h.logprobs is not None:
                n = len(r.tokens)
                r.logprobs = h.logprobs[:n]
                r.top_logprobs = [dict(zip(i, v)) for i, v in zip(h.top_ids[:n], h.top[:n])]


class Run(HostLoop):
    """One call on an ``Engine``: validated requests, their plan and decode state, the host loop
    (``events``)."""

    def __init__(self, eng, ids: list[list[int]], sampling: list[SamplingParams], *, seed: int, progress):
        target, spec, engine = eng.target, eng.spec, eng.config
        self.grammars, which = check_requests(target, ids, sampling, engine)
        plan = dataclasses.replace(
            eng.plan,
            greedy_only=all(s.is_greedy for s in sampling),
            filtering=any(s.filters for s in sampling),
            controls=any(s.uses_penalties for s in sampling),
            logprobs=(min(MAX_LOGPROBS, target.config.vocab_size)
                      if any(s.logprobs is not None for s in sampling) else None),
        )
        self.adaptive = None
        if spec is not None and spec.adaptive_steps:
            self.adaptive = AdaptiveSteps(candidates=spec.adaptive_steps, steps=spec.num_steps)
        stops = [s.stop_token_ids if s.stop_token_ids is not None else target.eos_token_ids for s in sampling]
        keys = request_keys(seed, sampling)
        requests = [Request(i, p, s, tuple(st), keys[i], constraint=w)
                    for i, (p, s, st, w) in enumerate(zip(ids, sampling, stops, which))]
        self.sched = eng.pages.scheduler(requests, admission=engine.admission)
        # Static buckets of the call: output width and stop-id slots.
        out_width = next_pow2(max(s.max_new_tokens for s in sampling) + plan.max_accept)
        num_stop = next_pow2(max(1, max(len(st) for st in stops)))
        batch, dtype, draft = eng.batch, eng.dtype, eng.draft
        draft_seed = None if draft is None else draft.config.empty_seed(batch, dtype=dtype,
                                                                        max_len=eng.width * engine.page_size)
        control_vocab = padded_vocab_size(target.config) if plan.controls else 0  # the logits' width
        grammar_table = None if self.grammars is None else self.grammars.device_table()
        self.state = create_state(lambda: DecodeState.empty(
            batch=batch, out_width=out_width, num_stop=num_stop, seed=draft_seed, hidden_dtype=dtype,
            control_vocab=control_vocab, top_logprobs=plan.logprobs, grammar_table=grammar_table), target.mesh)
        self.eng, self.spec, self.plan = eng, spec, plan
        self.sampling, self.num_stop, self.engine, self.progress = sampling, num_stop, engine, progress
        self.wall = 0.0
        self._start_rounds()

    def events(self) -> Iterator[StreamEvent]:
        """The host loop: admit, prefill, grant pages, run a decode call, hand out what it
        committed, retire finished rows. Yields the events of each round trip."""
        if self.eng.busy:
            raise RuntimeError("this Engine is serving another call (a stream still open?): one call at a time")
        self.eng.busy = True
        try:
            with run_context(self.target.mesh):
                yield from self._loop()
        finally:  # also when a stream is closed early: the engine's pages are whole for the next call
            self.sched.release_all()
            self.eng.busy = False

    def _loop(self) -> Iterator[StreamEvent]:
        bar = tqdm(total=sum(s.max_new_tokens for s in self.sampling), unit="tok", desc="generate", leave=False,
                   disable=None if self.progress is None else not self.progress)
        t0 = time.perf_counter()
        while not self.sched.finished:
            events = self.round()
            bar.update(sum(len(e.token_ids) for e in events))
            yield from events
        self.wall = time.perf_counter() - t0
        bar.close()
        self.sched.check()

    def output(self) -> GenerateOutput:
        sched, target = self.sched, self.target
        done = sorted(sched.done, key=lambda r: r.index)
        depth = 0 if self.plan.spec is None else self.plan.spec.depth
        return GenerateOutput(
            token_ids=[r.tokens for r in done], texts=[r.text.text for r in done] if target.tokenizer else None,
            stats=[request_stats(r, depth) for r in done], wall_seconds=self.wall,
            logprobs=[r.logprobs for r in done], top_logprobs=[r.top_logprobs for r in done],
            steps_per_call=self.adaptive.history if self.adaptive else [],
            kv_pages_free=sched.num_free, kv_pages_total=sched.capacity,
            **({} if sched.window is None else dict(
                kv_window_pages_free=sched.window.num_free, kv_window_pages_total=sched.window.capacity,
                kv_window_pages_returned=sched.window.returned_early)),
        )


def request_stats(r: Request, depth: int) -> RequestStats:
    """A finished request's statistics (``depth``: the speculation's deepest draft position, 0 for
    plain decoding)."""
    secs = max(r.t_done - r.t_admit, 1e-9)
    return RequestStats(
        num_tokens=len(r.tokens), accept_lens=r.accept_lens,
        mean_accept_len=float(np.mean(r.accept_lens)) if r.accept_lens else 1.0,
        tokens_per_s=len(r.tokens) / secs, seconds=secs, finish_reason=r.finish_reason,
        stop_reason=r.stop_reason, accepted_per_position=accepted_per_position(r.accept_lens, depth),
        preemptions=r.preemptions, cached_tokens=r.cached_tokens, verify_lens=r.verify_lens,
        admission_cached_tokens=list(r.admission_hits), prefilled_tokens=r.prefilled,
    )


def _steps_behind(accept_lens: list[int], num_tokens: int) -> list[int]:
    """The verify steps that produced a request's first ``num_tokens`` tokens (the first comes
    from the prefill): steps past a stop-string cut are dropped."""
    out, have = [], 1
    for a in accept_lens:
        if have >= num_tokens:
            break
        out.append(a)
        have += a
    return out


@functools.partial(jax.jit, static_argnums=2)
def _recent_tokens(out_tokens: jax.Array, start: jax.Array, width: int) -> jax.Array:  # i32[B, width]
    """Each row's output tokens from column ``start[b]`` on (what the host has not seen yet)."""
    cols = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], out_tokens.shape[1] - 1)
    return jnp.take_along_axis(out_tokens, cols, axis=1)


@functools.partial(jax.jit, static_argnums=2)
def _recent_logprobs(lp: TokenLogprobs, start: jax.Array, width: int) -> TokenLogprobs:  # [B, width, ...]
    """Each row's log-probabilities from column ``start[b]`` on, beside ``_recent_tokens``."""
    M = lp.chosen.shape[1]
    cols = jnp.minimum(start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :], M - 1)
    return TokenLogprobs(chosen=jnp.take_along_axis(lp.chosen, cols, axis=1),
                         top_ids=jnp.take_along_axis(lp.top_ids, cols[:, :, None], axis=1),
                         top=jnp.take_along_axis(lp.top, cols[:, :, None], axis=1))


@functools.partial(jax.jit, donate_argnums=0)
def _deactivate(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Ends the masked rows (bool[B]) on the device: a stop string was found on the host."""
    return dataclasses.replace(state, active=state.active & ~rows)


def _row_mask(batch: int, rows: list[int]) -> np.ndarray:
    mask = np.zeros(batch, bool)
    mask[rows] = True
    return mask


def _live_table(page_table: np.ndarray, positions: int, engine: EngineConfig, mesh) -> jax.Array:  # i32[B, w]
    """The page table cut to a power-of-two number of pages covering ``positions`` (at least
    ``engine.min_kv_bucket`` positions), so attention reads only the live context and a
    steady-state run compiles one program per bucket."""
    want = max(pages_needed(positions, engine.page_size), pages_needed(engine.min_kv_bucket, engine.page_size))
    return place_table(page_table[:, : min(page_table.shape[1], next_pow2(want))], mesh)


def _live_tables(sched: Scheduler, positions: int, engine: EngineConfig, mesh, prefill: bool = False):
    """The live page table, with the window pool's ring table (fixed width) and the compressed-KV
    entry tables (cut like the full one, at 1/rate of its positions) when there are (all with their
    rows split over the data shards); for a ``prefill`` with the window pool's pages cached, its read
    and checkpoint tables too (``jaxspec.engine.window``), with cached entry pages their copy tables
    (``jaxspec.engine.entries``), and with recurrent-state snapshots its snapshot table
    (``jaxspec.engine.snapshots``)."""
    full = _live_table(sched.page_table, positions, engine, mesh)
    snaps = sched.snapshots if prefill else None
    if sched.window is None and not sched.entries and snaps is None:
        return full
    w = sched.window

    def table(pages, first):
        return WindowTable(pages=place_table(pages, mesh), first=place_rows(first, mesh))

    ring = None if w is None else table(w.pages, w.first)
    # Floored like the full table (``min_kv_bucket``), so its buckets change no more often than that one's.
    reach = max(positions, engine.min_kv_bucket)
    compressed = tuple(place_table(e.table[:, : min(e.width, next_pow2(e.pages_for(reach)))], mesh)
                       for e in sched.entries)
    extra = {}
    if prefill and w is not None and w.caching:
        extra = dict(window_read=table(w.read_pages, w.read_first), window_keep=table(w.keep_pages, w.keep_first))
    if prefill and any(e.caching for e in sched.entries):
        extra["entry_copy"] = tuple(place_table(e.copy, mesh) for e in sched.entries)
    if snaps is not None:
        extra["snapshots"] = SnapshotTable(restore=place_rows(snaps.restore, mesh), at=place_table(snaps.at, mesh),
                                           slots=place_table(snaps.slots, mesh))
    return PageTables(full=full, window=ring, compressed=compressed, **extra)


def _prefill(plan, target, dparams, state, tpool, dpool, sched, admitted, num_stop, engine, grammars=None):
    """Prefills the admitted requests. Rows are grouped by data shard: shard ``d`` gets the
    ``d``-th chunk of ``Rs`` rows (shard-local row indices; padding rows point past the shard).
    ``grammars``: the call's structured-output automata (a resumed request restarts from the state
    its output so far, but the last token, leads to)."""
    D = sched.data_shards
    by_shard = [[r for r in admitted if sched.shard_of(r.row) == d] for d in range(D)]
    Rs = min(sched.rows_per_shard, max(engine.min_prefill_rows, next_pow2(max(len(rs) for rs in by_shard))))
    R = D * Rs
    longest = max(len(r.context) for r in admitted)
    T = max(engine.min_prefill_bucket, next_pow2(longest + 1))
    tokens = np.zeros((R, T), np.int32)
    hit = any(r.start for r in admitted)  # some context starts in cached pages: prefill only the rest
    Ts = max(engine.min_prefill_bucket, next_pow2(max(len(r.context) - r.start for r in admitted) + 1)) if hit else T
    suffix, start = np.zeros((R, Ts), np.int32), np.zeros(R, np.int32)
    lens = np.zeros(R, np.int32)
    rows = np.full(R, sched.rows_per_shard, np.int32)  # padding rows point past the shard's rows (dropped)
    V = padded_vocab_size(target.config) if plan.controls else 0  # the logits' width (a padded vocabulary)
    req = request_arrays(R, num_stop=num_stop, control_vocab=V)
    settings = [None] * R  # each row's SamplingParams (None: a padding row)
    for d, rs in enumerate(by_shard):
        for j, r in enumerate(rs):
            i = d * Rs + j
            context = r.context  # the prompt, or a resumed request's prompt + output but its last token
            tokens[i, : len(context)] = context
            lens[i] = len(context)
            suffix[i, : len(context) - r.start] = context[r.start:]
            start[i] = r.start
            req["prompt_lens"][i] = len(r.prompt)
            if r.resume is not None:
                req["first"][i] = r.tokens[-1]
                req["steps"][i] = r.resume.steps
            if r.constraint is not None:
                req["grammar"][i] = grammars.walk(r.constraint, r.tokens[:-1])
            rows[i] = r.row - d * sched.rows_per_shard
            req["max_new"][i] = r.sampling.max_new_tokens
            req["stop_ids"][i, : len(r.stop_ids)] = r.stop_ids
            settings[i] = r.sampling
            req["keys"][i] = r.key
            if V:
                for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
                    req[name][i] = getattr(r.sampling, name)
                for t, b in r.sampling.logit_bias or ():
                    req["logit_bias"][i, t] = b
    req["sampling"] = RowSampling.host(settings)
    if hit:
        req["suffix"], req["start"] = suffix, start
    mesh = target.mesh
    return prefill_program(
        plan, target.params, dparams, state, tpool, dpool, _live_tables(sched, T, engine, mesh, prefill=True),
        place_rows(rows, mesh), place_rows(tokens, mesh), place_rows(lens, mesh),
        jax.tree.map(lambda v: place_rows(v, mesh), req),
    )
