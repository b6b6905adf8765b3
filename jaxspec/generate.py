"""``generate()``: validation, tokenization, batching, the host loop and statistics."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxspec.config import MAX_LOGPROBS, EngineConfig, SamplingParams, SpecConfig
from jaxspec.draft.plan import Plan
from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.engine.placement import create_pool, create_state, place_rows, place_table, run_context, to_host
from jaxspec.engine.prefill import request_arrays
from jaxspec.engine.programs import decode_program, prefill_program
from jaxspec.engine.scheduler import PagePools, Request, Scheduler
from jaxspec.engine.state import DecodeState
from jaxspec.engine.text import RequestText
from jaxspec.engine.window import window_pages_for
from jaxspec.kvcache.paging import PageTables, WindowTable, pages_needed
from jaxspec.mesh import DATA, axis_size
from jaxspec.model.config import padded_vocab_size
from jaxspec.model.drafts.base import DraftModel, zero_pool
from jaxspec.engine.entries import EntryPages
from jaxspec.model.targets import (Model, create_target_pool, kv_entry_rates, kv_span, kv_window,
                                   uncacheable_reason)
from jaxspec.model.targets.deepseek_v4 import entry_pages_for
from jaxspec.structured import compile_constraints


@dataclasses.dataclass
class RequestStats:
    """accept_lens: tokens emitted by each verify step (accepted drafts + 1);
    mean_accept_len: their mean (1.0 for plain decoding); tokens_per_s: over the
    request's time in the batch. finish_reason: "stop" (a stop token or stop string) or "length"
    (``max_new_tokens``); stop_reason: the stop token id or stop string, if one ended it.
    accepted_per_position[i]: verify steps whose i-th draft token was accepted (one entry per
    draft depth; empty for plain decoding). preemptions: how often the engine took the request off
    the batch to free pages and later resumed it (its output is the same either way).
    cached_tokens: prompt tokens whose KV came from the prefix cache (not prefilled again).
    verify_lens: tokens each verify step verified for the request, the root included (a confidence
    head's per-request count under ``SpecConfig.confidence_threshold``; else the whole tree, or the
    prefix an n-gram lookup's batch needed)."""

    num_tokens: int
    accept_lens: list[int]
    mean_accept_len: float
    tokens_per_s: float
    seconds: float
    finish_reason: str = "length"
    stop_reason: int | str | None = None
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0
    verify_lens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Resume:
    """What a preempted request carries back to its next admission, beside its prompt and tokens
    (``Request.tokens``): what the device held for it."""

    tokens: list[int]  # its output when preempted (progress is measured against it)
    accept_lens: list[int]  # its verify steps' accept lengths so far
    steps: int  # PRNG draws so far (the row's fold_in counter)
    verify_lens: list[int] = dataclasses.field(default_factory=list)  # and their verified lengths
    logprobs: list[float] | None = None  # when it asked for them: one per token so far
    top_ids: list[list[int]] | None = None
    top: list[list[float]] | None = None


@dataclasses.dataclass
class StreamEvent:
    """What one host round trip committed for one request (``generate_stream``).

    index: the request's position in the prompts; token_ids: its new tokens; text: their new text
    (complete characters only; a tail that could still start a stop string is held back until
    decided; None without a tokenizer); finished: its last event; finish_reason: "stop" or
    "length" on that event."""

    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None


@dataclasses.dataclass
class GenerateOutput:
    """token_ids: generated tokens per request (stop token excluded); texts: decoded, when a
    tokenizer is known; stats: per request. logprobs[i]: the raw log-probability of each emitted
    token of request i, top_logprobs[i]: a ``{token_id: logprob}`` dict of its ``logprobs`` most
    likely tokens per emitted token (both None for a request that did not ask)."""

    token_ids: list[list[int]]
    texts: list[str] | None
    stats: list[RequestStats]
    wall_seconds: float
    logprobs: list[list[float] | None] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[dict[int, float]] | None] = dataclasses.field(default_factory=list)
    kv_pages_free: int = 0  # after the call: every page is back (== kv_pages_total); prefix-cache pages count (reclaimable)
    kv_pages_total: int = 0
    # The sliding-window pool (targets with sliding-window layers): free / total pages after the
    # call, and pages returned while their request was still running (they fell behind its window).
    kv_window_pages_free: int = 0
    kv_window_pages_total: int = 0
    kv_window_pages_returned: int = 0
    steps_per_call: list[int] = dataclasses.field(default_factory=list)  # adaptive chains: depth of each call

    @property
    def mean_accept_len(self) -> float:
        lens = [a for s in self.stats for a in s.accept_lens]
        return float(np.mean(lens)) if lens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return sum(s.num_tokens for s in self.stats) / max(self.wall_seconds, 1e-9)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _is_chat(p) -> bool:
    return isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) > 0 and isinstance(p[0], Mapping)


def _tokenize(target: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings, token-id lists or chats (lists of message dicts)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) or _is_chat(p):
            if target.tokenizer is None:
                raise ValueError(
                    f"prompt {i} is a {'string' if isinstance(p, str) else 'chat'} but the target has no tokenizer "
                    f"(no tokenizer.json next to its weights); pass token ids"
                )
            try:  # a chat: rendered with the checkpoint's template, tokenized as HF does (no extra BOS)
                ids = (target.tokenizer.encode(p) if isinstance(p, str) else
                       target.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        else:
            ids = [int(t) for t in np.asarray(p).reshape(-1)] if len(p) else []
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < target.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {target.config.vocab_size})"
            )
        out.append(ids)
    return out


def _sampling_list(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    sampling = list(sampling)
    if len(sampling) != n or not all(isinstance(s, SamplingParams) for s in sampling):
        raise ValueError(f"sampling must be a SamplingParams or a list of {n} SamplingParams")
    return sampling


def _check_sampling_fits(sampling: list[SamplingParams], vocab_size: int) -> None:
    """What ``SamplingParams`` cannot check alone: token ids and counts against the vocabulary."""
    for i, s in enumerate(sampling):
        bad = [t for t, _ in s.logit_bias or () if t >= vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.logit_bias of request {i} names token id {bad[0]} outside the "
                             f"vocabulary [0, {vocab_size})")
        if s.logprobs is not None and s.logprobs > vocab_size:
            raise ValueError(f"SamplingParams.logprobs of request {i} asks for {s.logprobs} top tokens of a "
                             f"vocabulary of {vocab_size}")


@jax.jit
def _keys_for(seed, index, own_seed, has_own):  # -> u32[N, 2]
    derived = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(index)
    own = jax.vmap(jax.random.PRNGKey)(own_seed)
    return jnp.where(has_own[:, None], own, derived)


def _request_keys(seed: int, sampling: list[SamplingParams]) -> np.ndarray:  # u32[N, 2]
    """Request i's key: PRNGKey(its own seed) if it has one, else fold_in(PRNGKey(seed), i)."""
    own = np.asarray([s.seed or 0 for s in sampling], np.uint32)
    has_own = np.asarray([s.seed is not None for s in sampling])
    keys = _keys_for(np.uint32(seed), np.arange(len(sampling), dtype=np.uint32), own, has_own)
    return np.asarray(keys, np.uint32)


def generate(
    target: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[Sequence[dict]],
    *,
    draft: DraftModel | None = None,
    spec: SpecConfig | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    engine: EngineConfig | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> GenerateOutput:
    """Generates continuations for a batch of prompts, speculatively when a draft is given.

    Args:
      target: from ``load_model``.
      prompts: strings (the target needs a tokenizer), token-id lists, or chats (lists of
        ``{"role", "content"}`` dicts, rendered with the checkpoint's chat template and a
        generation prompt, as ``apply_chat_template`` does), ragged lengths, mixed freely.
      draft: from ``load_draft`` (EAGLE, EAGLE-3, MTP, frozen-KV assistant, DFlash, standalone), an ``NgramDraft``
        (model-free) or a ``HybridDraft``; None for plain decoding through the same engine.
      spec: the speculative step shape; required with a draft.
      sampling: one SamplingParams for every prompt or one per prompt.
      engine: page size, batch and length limits, kernels.
      seed: PRNG seed for requests whose SamplingParams has no seed.
      progress: show a progress bar (None: only on a terminal).

    Returns:
      GenerateOutput with ``token_ids`` (stop token excluded; ending with the token that completed
      a stop string), ``texts`` (when a tokenizer is known; cut before a stop string), raw
      ``logprobs`` where asked, and per-request ``stats`` (finish reason, acceptance), in input order.

    Raises:
      ValueError: a bad input (see ``jaxspec.config``), before any device work.
    """
    run = _call(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=engine, seed=seed,
                progress=progress)
    for _ in run.events():
        pass
    return run.output()


def generate_stream(
    target: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]] | Sequence[Sequence[dict]],
    *,
    draft: DraftModel | None = None,
    spec: SpecConfig | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    engine: EngineConfig | None = None,
    seed: int = 0,
    progress: bool | None = False,
) -> Iterator[StreamEvent]:
    """``generate()``'s arguments; yields a ``StreamEvent`` per request and host round trip as its
    tokens are committed (several steps run on the device between round trips). A request's events,
    concatenated, give exactly ``generate()``'s ``token_ids`` and ``texts``; its last event has
    ``finished`` set. Inputs are checked here, before the first event is asked for."""
    run = _call(target, prompts, draft=draft, spec=spec, sampling=sampling, engine=engine, seed=seed,
                progress=progress)
    return run.events()


def _call(target, prompts, *, draft, spec, sampling, engine, seed, progress) -> "_Run":
    """``generate()``'s call: a throwaway ``Engine`` sized for these requests (its batch for their
    number, its page table for the longest), and one run on it."""
    _check_seed(seed)
    _check_models(target, draft, spec)
    ids = _tokenize(target, prompts)
    sampling = _sampling_list(sampling, len(ids))
    _check_requests(target, ids, sampling, engine or EngineConfig())  # constraints compile here (cached)
    longest = max(len(p) + s.max_new_tokens for p, s in zip(ids, sampling))
    eng = Engine(target, draft=draft, spec=spec, engine=engine, _batch=len(ids), _longest=longest)
    return _Run(eng, ids, sampling, seed=seed, progress=progress)


def _check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def _check_requests(target: Model, ids: list[list[int]], sampling: list[SamplingParams], engine: EngineConfig):
    """Everything about the requests that can be refused before any device work; returns the call's
    structured-output automata (compiled here, cached by constraint) and which each request follows."""
    _check_sampling_fits(sampling, target.config.vocab_size)
    grammars = _compile_constraints(target, sampling)
    if target.tokenizer is None and any(s.stop for s in sampling):
        raise ValueError("SamplingParams.stop needs text, but the target has no tokenizer (no tokenizer.json "
                         "next to its weights); use stop_token_ids")
    for i, (p, s) in enumerate(zip(ids, sampling)):
        total = len(p) + s.max_new_tokens
        if total > engine.max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens + max_new_tokens {s.max_new_tokens} = {total} > "
                f"max_seq_len {engine.max_seq_len}"
            )
    return grammars


def _compile_constraints(target: Model, sampling: list[SamplingParams]):
    """(GrammarSet or None, per request the index of its automaton or None), or a ValueError naming
    the request whose constraint cannot be compiled (before any device work)."""
    # Over the logits' width: a vocabulary padded for a mesh has ids no token text reaches.
    return compile_constraints(target.tokenizer, padded_vocab_size(target.config), [s.constraint for s in sampling])


def _check_models(target, draft, spec) -> None:
    if not isinstance(target, Model):
        raise ValueError(f"target must be a Model from jaxspec.load_model, got {type(target).__name__}")
    if draft is not None and spec is None:
        raise ValueError("a draft was given without a SpecConfig: pass spec=jaxspec.SpecConfig(...)")
    if spec is not None and draft is None:
        raise ValueError("spec was given without a draft model")
    if draft is not None:
        if not isinstance(draft, DraftModel):
            raise ValueError(
                f"draft must come from jaxspec.load_draft (or be a jaxspec.NgramDraft / HybridDraft), "
                f"got {type(draft).__name__}"
            )
        draft.config.check_fits(target.config)
        draft.config.check_spec(spec)


class Engine:
    """A serving engine that keeps its KV pools, page allocators, prefix cache and compiled
    programs across calls.

        engine = jaxspec.Engine(target, draft=draft, spec=spec, engine=jaxspec.EngineConfig(max_batch=16))
        out = engine.generate(prompts, sampling=jaxspec.SamplingParams(max_new_tokens=256))
        for event in engine.generate_stream(more_prompts): ...

    Its pools are sized once, for ``engine.max_batch`` requests of ``engine.max_seq_len`` tokens (or
    ``engine.num_pages`` pages); every call reuses them, and calls with the same shapes compile nothing
    new. One call runs at a time. ``jaxspec.generate()`` is a throwaway engine sized for its call.

    Raises:
      ValueError: a draft that does not fit the target or the spec, before any device work.
    """

    def __init__(self, target: Model, draft: DraftModel | None = None, spec: SpecConfig | None = None,
                 engine: EngineConfig | None = None, *, _batch: int | None = None, _longest: int | None = None):
        engine = engine or EngineConfig()
        _check_models(target, draft, spec)
        mesh = target.mesh
        data_shards = axis_size(mesh, DATA)
        # A draft without parameters (NgramDraft) serves any mesh; its per-row state follows the rows.
        if draft is not None and jax.tree_util.tree_leaves(draft.params) and getattr(draft, "mesh", None) is not mesh:
            raise ValueError("the draft is not placed on the target's mesh: load it with load_draft(path, target)")
        adaptive = spec is not None and bool(spec.adaptive_steps)
        # The plan of every call, but for what its requests ask (sampling, controls, logprobs: ``_Run``).
        plan = Plan(
            target=target.config,
            draft=None if draft is None else draft.config,
            spec=spec.with_steps(max(spec.adaptive_steps)) if adaptive else spec,  # buffers: the deepest
            page_size=engine.page_size,
            steps_per_call=engine.steps_per_call,
            implementation=engine.implementation,
            data_shards=data_shards,
        )
        # Sliding-window layers (of the target, or of a standalone draft) keep their K/V in a window pool.
        windows = [w for w in (kv_window(target.config), draft.config.kv_window if draft is not None else None) if w]
        if windows and spec is not None and max(spec.adaptive_steps or (spec.depth,)) >= min(windows):
            raise ValueError(
                f"SpecConfig depth {max(spec.adaptive_steps or (spec.depth,))} must be smaller than the "
                f"sliding window ({min(windows)}): a draft tree's rows attend to their ancestors without a window test"
            )
        # Static buckets: batch rows and page-table width. On a mesh the rows and pages split evenly
        # over its data shards (each with its own scratch page).
        batch = max(next_pow2(min(_batch or engine.max_batch, engine.max_batch)), data_shards)
        batch = data_shards * -(-batch // data_shards)
        longest = min(_longest or engine.max_seq_len, engine.max_seq_len)
        width = next_pow2(pages_needed(longest + plan.lookahead, engine.page_size))
        num_pages = data_shards * (-(-engine.num_pages // data_shards) if engine.num_pages else
                                   (batch // data_shards) * width + 1)
        step_growth = engine.steps_per_call * plan.max_accept
        spans = [s for s in (kv_span(target.config) if windows else None,
                             _draft_span(draft) if draft is not None else None) if s]
        window = window_pages_for(max(windows), batch=batch, width=width, page_size=engine.page_size,
                                  ahead=step_growth + plan.lookahead, data_shards=data_shards,
                                  span=max(spans, default=None)) if windows else None
        window_pages = window.num_pages if window is not None else None
        # Compressed-KV entry pools (DeepSeek-V4): one page table per compression rate, shared by the target
        # and a standalone draft of the same model kind.
        rates = kv_entry_rates(target.config)
        draft_rates = kv_entry_rates(getattr(draft.config, "model", None)) if draft is not None else ()
        if draft_rates and draft_rates != rates:
            raise ValueError(f"a standalone draft with compressed KV at rates {draft_rates} cannot share the "
                             f"target's entry page tables (rates {rates or 'none'})")
        P_ = engine.page_size
        entries = tuple(EntryPages(rate=m, batch=batch, width=pages_needed(width * P_ // m + 2, P_),
                                   pages_per_shard=entry_pages_for(num_pages // data_shards, batch // data_shards, m),
                                   page_size=P_, data_shards=data_shards) for m in rates)
        entry_pages = tuple(e.num_pages for e in entries) or None
        # Why a model's prompts are not cached (None: they are, when the engine caches at all).
        self.uncacheable = (uncacheable_reason(target.config)
                            or (uncacheable_reason(getattr(draft.config, "model", None)) if draft is not None else None)
                            or ("its sliding-window KV pages leave the window" if windows else None))
        if engine.prefix_cache and self.uncacheable:
            raise ValueError(f"EngineConfig(prefix_cache=True): this model's prompts cannot be cached: "
                             f"{self.uncacheable}")
        self.pages = PagePools(batch=batch, width=width, num_pages=num_pages, page_size=engine.page_size,
                               lookahead=plan.lookahead, step_growth=step_growth, data_shards=data_shards,
                               window=window, prefix_cache=engine.prefix_cache is not False and not self.uncacheable,
                               entries=entries)
        dtype = jnp.dtype(target.dtype)
        self.tpool = create_pool(lambda: create_target_pool(target.config, num_pages=num_pages, page_size=P_,
                                                            dtype=dtype, window_pages=window_pages, rows=batch,
                                                            entry_pages=entry_pages),
                                 getattr(target.config, "tensor_parallel", 1) > 1, mesh)
        if draft is None:
            self.dpool = create_pool(lambda: zero_pool(P_, dtype), False, mesh)
        else:
            extra = {"entry_pages": entry_pages} if draft_rates else {}
            self.dpool = create_pool(lambda: draft.config.create_pool(num_pages=num_pages, page_size=P_, dtype=dtype,
                                                                      window_pages=window_pages, rows=batch, **extra),
                                     draft.config.tensor_parallel > 1, mesh)
        self.target, self.draft, self.spec, self.plan, self.config = target, draft, spec, plan, engine
        self.dtype, self.batch, self.width = dtype, batch, width
        self.dparams = None if draft is None else draft.params
        self.busy = False  # a call is running (its stream is open)

    def generate(self, prompts, *, sampling: SamplingParams | Sequence[SamplingParams] | None = None, seed: int = 0,
                 progress: bool | None = None) -> GenerateOutput:
        """``jaxspec.generate()`` on this engine's pools (same prompts, sampling, seed, progress)."""
        run = self._run(prompts, sampling, seed, progress)
        for _ in run.events():
            pass
        return run.output()

    def generate_stream(self, prompts, *, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                        seed: int = 0, progress: bool | None = False) -> Iterator[StreamEvent]:
        """``jaxspec.generate_stream()`` on this engine's pools. Closing the stream early ends the
        call: its requests' pages go back."""
        return self._run(prompts, sampling, seed, progress).events()

    def _run(self, prompts, sampling, seed, progress) -> "_Run":
        _check_seed(seed)
        ids = _tokenize(self.target, prompts)
        return _Run(self, ids, _sampling_list(sampling, len(ids)), seed=seed, progress=progress)


class _Run:
    """One call on an ``Engine``: validated requests, their plan and decode state, the host loop
    (``events``)."""

    def __init__(self, eng: Engine, ids: list[list[int]], sampling: list[SamplingParams], *, seed: int, progress):
        target, spec, engine = eng.target, eng.spec, eng.config
        self.grammars, which = _check_requests(target, ids, sampling, engine)
        plan = dataclasses.replace(
            eng.plan,
            greedy_only=all(s.is_greedy for s in sampling),
            filtering=any(s.filters for s in sampling),
            controls=any(s.uses_penalties for s in sampling),
            logprobs=(min(MAX_LOGPROBS, target.config.vocab_size)
                      if any(s.logprobs is not None for s in sampling) else None),
        )
        adaptive, plans = None, {}  # depth -> Plan, for adaptive chains
        if spec is not None and spec.adaptive_steps:
            adaptive = AdaptiveSteps(candidates=spec.adaptive_steps, steps=spec.num_steps)
            plans = {S: dataclasses.replace(plan, spec=spec.with_steps(S)) for S in spec.adaptive_steps}
        stops = [s.stop_token_ids if s.stop_token_ids is not None else target.eos_token_ids for s in sampling]
        keys = _request_keys(seed, sampling)
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
        self.eng = eng
        self.target, self.draft, self.plan, self.plans, self.adaptive = target, draft, plan, plans, adaptive
        self.dparams = eng.dparams
        self.sampling, self.num_stop, self.engine, self.progress = sampling, num_stop, engine, progress
        self.wall = 0.0

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
        sched, plan, engine, target = self.sched, self.plan, self.engine, self.target
        batch = len(sched.rows)
        bar = tqdm(total=sum(s.max_new_tokens for s in self.sampling), unit="tok", desc="generate", leave=False,
                   disable=None if self.progress is None else not self.progress)
        t0 = time.perf_counter()
        seq_lens = np.zeros(batch, np.int32)
        seen = np.zeros(batch, np.int32)  # tokens of each row handed out so far
        window = 1 + sched.step_growth  # most tokens a row can gain in one round trip (a prefill's first included)
        calls = 0
        while not sched.finished:
            force = bool(engine.preempt_every) and calls > 0 and calls % engine.preempt_every == 0
            victims = sched.to_preempt(seq_lens, force=force)
            if victims:
                self._preempt(victims)
            admitted = sched.admit(seq_lens)
            if admitted:
                self.state, self.tpool, self.dpool = _prefill(plan, target, self.dparams, self.state, self.tpool,
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
            calls += 1
            adaptive = self.adaptive
            call_plan = self.plans[adaptive.steps] if adaptive else plan
            before = to_host(dict(out_lens=self.state.out_lens, nv=self.state.num_verify)) if adaptive else None
            live = max(int(seq_lens[row]) for row, r in enumerate(sched.rows) if r is not None)
            table = _live_tables(sched, live + sched.step_growth + plan.lookahead, engine, target.mesh)
            self.state, self.tpool, self.dpool, _ = decode_program(call_plan, target.params, self.dparams, self.state,
                                                                   self.tpool, self.dpool, table)
            host = to_host(dict(
                seq_lens=self.state.seq_lens, active=self.state.active, out_lens=self.state.out_lens,
                nv=self.state.num_verify, stop_token=self.state.stop_token,
                recent=_recent_tokens(self.state.out_tokens, place_rows(seen, target.mesh), window)))
            if adaptive:
                steps_run = int((host["nv"] - before["nv"]).sum())
                if steps_run:
                    adaptive.update(float((host["out_lens"] - before["out_lens"]).sum()) / steps_run)
            seq_lens = np.array(host["seq_lens"])
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
                    events.append(StreamEvent(index=r.index, token_ids=new, text=text, finished=done,
                                              finish_reason=r.finish_reason if done else None))
            if cut_rows:  # stop strings: these rows end now on the device too
                self.state = _deactivate(self.state, place_rows(_row_mask(batch, cut_rows), target.mesh))
            if finished_rows:
                self._retire(finished_rows)
            if engine.check_pages:
                sched.check()
            bar.update(sum(len(e.token_ids) for e in events))
            yield from events
        self.wall = time.perf_counter() - t0
        bar.close()
        sched.check()

    def _device_rows(self, with_steps: bool = False) -> dict:
        """What the host keeps of a row that leaves the batch: accept log, PRNG position, logprobs."""
        plan = self.plan
        return to_host(dict(log=self.state.accept_log, vlog=self.state.verify_log, nv=self.state.num_verify,
                            steps=self.state.steps if with_steps else None,
                            lp=self.state.logprobs if plan.logprobs is not None else None))

    def _history(self, r: Request, out: dict, row: int) -> _Resume:
        """Request ``r``'s accept lengths, PRNG position and logprobs so far: what earlier stints in
        the batch left (``r.resume``) followed by what row ``row`` of the device holds."""
        before = r.resume
        nv = int(out["nv"][row])
        accept = (before.accept_lens if before else []) + out["log"][row, :nv].tolist()
        verify = (before.verify_lens if before else []) + out["vlog"][row, :nv].tolist()
        res = _Resume(tokens=list(r.tokens), accept_lens=accept, verify_lens=verify,
                      steps=int(out["steps"][row]) if out["steps"] is not None else 0)
        if r.sampling.logprobs is not None:
            k, n, lp = r.sampling.logprobs, len(r.tokens), out["lp"]
            m = len(before.logprobs) if before else 0  # earlier tokens' are the host's (columns < m hold none)
            res.logprobs = (before.logprobs if before else []) + lp.chosen[row, m:n].tolist()
            res.top_ids = (before.top_ids if before else []) + lp.top_ids[row, m:n, :k].tolist()
            res.top = (before.top if before else []) + lp.top[row, m:n, :k].tolist()
        return res

    def _preempt(self, rows: list[int]) -> None:
        """Takes ``rows`` off the batch: the host keeps what their requests need to resume, their
        pages go back, and the device rows stop."""
        out = self._device_rows(with_steps=True)
        for row in rows:
            r = self.sched.rows[row]
            self.sched.preempt(row, self._history(r, out, row))
        self.state = _deactivate(self.state, place_rows(_row_mask(len(self.sched.rows), rows), self.target.mesh))

    def _retire(self, rows: list[int]) -> None:
        """Finished rows: their accept lengths and log-probabilities, then their pages back."""
        out = self._device_rows()
        for row in rows:
            r = self.sched.rows[row]
            h = self._history(r, out, row)
            log = h.accept_lens
            if r.text.stop_reason is not None:  # steps past a stop string's cut produced nothing kept
                log = _steps_behind(log, len(r.tokens))
            r = self.sched.retire(row, r.tokens, log)
            r.verify_lens = h.verify_lens[: len(log)]
            if r.sampling.logprobs is not None:
                n = len(r.tokens)
                r.logprobs = h.logprobs[:n]
                r.top_logprobs = [dict(zip(i, v)) for i, v in zip(h.top_ids[:n], h.top[:n])]

    def output(self) -> GenerateOutput:
        sched, target = self.sched, self.target
        done = sorted(sched.done, key=lambda r: r.index)
        depth = 0 if self.plan.spec is None else self.plan.spec.depth
        stats = []
        for r in done:
            secs = max(r.t_done - r.t_admit, 1e-9)
            stats.append(RequestStats(
                num_tokens=len(r.tokens), accept_lens=r.accept_lens,
                mean_accept_len=float(np.mean(r.accept_lens)) if r.accept_lens else 1.0,
                tokens_per_s=len(r.tokens) / secs, seconds=secs, finish_reason=r.finish_reason,
                stop_reason=r.stop_reason, accepted_per_position=accepted_per_position(r.accept_lens, depth),
                preemptions=r.preemptions, cached_tokens=r.cached_tokens, verify_lens=r.verify_lens,
            ))
        return GenerateOutput(
            token_ids=[r.tokens for r in done], texts=[r.text.text for r in done] if target.tokenizer else None,
            stats=stats, wall_seconds=self.wall,
            logprobs=[r.logprobs for r in done], top_logprobs=[r.top_logprobs for r in done],
            steps_per_call=self.adaptive.history if self.adaptive else [],
            kv_pages_free=sched.num_free, kv_pages_total=sched.capacity,
            **({} if sched.window is None else dict(
                kv_window_pages_free=sched.window.num_free, kv_window_pages_total=sched.window.capacity,
                kv_window_pages_returned=sched.window.returned_early)),
        )


def accepted_per_position(accept_lens: list[int], depth: int) -> list[int]:
    """How often the i-th draft token of a step was accepted, i < depth (a step of accept length a
    accepted its first a - 1 drafts)."""
    lens = np.asarray(accept_lens, np.int64)
    return [int(np.sum(lens - 1 > i)) for i in range(depth)]


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


def _live_tables(sched: Scheduler, positions: int, engine: EngineConfig, mesh):
    """The live page table, with the window pool's ring table (fixed width) and the compressed-KV
    entry tables (cut like the full one, at 1/rate of its positions) when there are (all with their
    rows split over the data shards)."""
    full = _live_table(sched.page_table, positions, engine, mesh)
    if sched.window is None and not sched.entries:
        return full
    w = sched.window
    ring = None if w is None else WindowTable(pages=place_table(w.pages, mesh), first=place_rows(w.first, mesh))
    compressed = tuple(place_table(e.table[:, : min(e.width, next_pow2(e.pages_for(positions)))], mesh)
                       for e in sched.entries)
    return PageTables(full=full, window=ring, compressed=compressed)


def _draft_span(draft) -> int | None:
    """Positions a draft with its own window pool reads behind a request's length (None: none)."""
    return kv_span(getattr(draft.config, "model", None)) if draft.config.kv_window else None


def _prefill(plan, target, dparams, state, tpool, dpool, sched, admitted, num_stop, engine, grammars=None):
    """Prefills the admitted requests. Rows are grouped by data shard: shard ``d`` gets the
    ``d``-th chunk of ``Rs`` rows (shard-local row indices; padding rows point past the shard).
    ``grammars``: the call's structured-output automata (a resumed request restarts from the state
    its output so far, but the last token, leads to)."""
    D = sched.data_shards
    by_shard = [[r for r in admitted if sched.shard_of(r.row) == d] for d in range(D)]
    Rs = next_pow2(max(len(rs) for rs in by_shard))
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
            req["temperature"][i] = r.sampling.temperature
            req["top_k"][i] = r.sampling.top_k
            req["top_p"][i] = r.sampling.top_p
            req["min_p"][i] = r.sampling.min_p
            req["keys"][i] = r.key
            if V:
                for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
                    req[name][i] = getattr(r.sampling, name)
                for t, b in r.sampling.logit_bias or ():
                    req["logit_bias"][i, t] = b
    if hit:
        req["suffix"], req["start"] = suffix, start
    mesh = target.mesh
    return prefill_program(
        plan, target.params, dparams, state, tpool, dpool, _live_tables(sched, T, engine, mesh),
        place_rows(rows, mesh), place_rows(tokens, mesh), place_rows(lens, mesh),
        {k: place_rows(v, mesh) for k, v in req.items()},
    )
