"""The public entry points: ``generate()`` and ``generate_stream()``, each a call on a throwaway
``Engine`` sized for its requests, and the result types they return."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from jaxspec.config import EngineConfig, SamplingParams, SpecConfig
from jaxspec.engine.engine import Engine
from jaxspec.engine.host_loop import Run
from jaxspec.engine.requests import check_models, check_requests, check_seed, sampling_list, tokenize
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.targets import Model
from jaxspec.results import GenerateOutput, RequestStats, StreamEvent, accepted_per_position

__all__ = ["Engine", "GenerateOutput", "RequestStats", "StreamEvent", "accepted_per_position", "generate",
           "generate_stream"]


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


def _call(target, prompts, *, draft, spec, sampling, engine, seed, progress) -> Run:
    """``generate()``'s call: a throwaway ``Engine`` sized for these requests (its batch for their
    number, its page table for the longest), and one run on it."""
    check_seed(seed)
    check_models(target, draft, spec)
    ids = tokenize(target, prompts)
    sampling = sampling_list(sampling, len(ids))
    check_requests(target, ids, sampling, engine or EngineConfig())  # constraints compile here (cached)
    longest = max(len(p) + s.max_new_tokens for p, s in zip(ids, sampling))
    eng = Engine(target, draft=draft, spec=spec, engine=engine, _batch=len(ids), _longest=longest)
    return Run(eng, ids, sampling, seed=seed, progress=progress)
