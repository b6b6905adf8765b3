"""What ``generate()`` and ``Engine`` return: per-request statistics, stream events, the
call's output."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class RequestStats:
    """accept_lens: tokens emitted by each verify step (accepted drafts + 1);
    mean_accept_len: their mean (1.0 for plain decoding); tokens_per_s: over the
    request's time in the batch. finish_reason: "stop" (a stop token or stop string) or "length"
    (``max_new_tokens``); stop_reason: the stop token id or stop string, if one ended it.
    accepted_per_position[i]: verify steps whose i-th draft token was accepted (one entry per
    draft depth; empty for plain decoding). preemptions: how often the engine took the request off
    the batch to free pages and later resumed it (its output is the same either way).
    cached_tokens: prompt tokens whose KV came from the prefix cache (not prefilled again) at its
    first admission. admission_cached_tokens: the context positions found in the prefix cache at
    every admission, the first and each resume after a preemption. prefilled_tokens: positions
    prefilled for it over all its admissions (its contexts less their cached parts).
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
    admission_cached_tokens: list[int] = dataclasses.field(default_factory=list)
    prefilled_tokens: int = 0
    verify_lens: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StreamEvent:
    """What one host round trip committed for one request (``generate_stream``).

    index: the request's position in the prompts; token_ids: its new tokens; text: their new text
    (complete characters only; a tail that could still start a stop string is held back until
    decided; None without a tokenizer); finished: its last event; finish_reason: "stop" or
    "length" on that event. logprobs / top_logprobs: for a request that asked
    (``SamplingParams.logprobs``), the raw log-probability of each new token and a
    ``{token_id: logprob}`` dict of its most likely tokens (None otherwise), as
    ``GenerateOutput`` reports them."""

    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


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


def accepted_per_position(accept_lens: list[int], depth: int) -> list[int]:
    """How often the i-th draft token of a step was accepted, i < depth (a step of accept length a
    accepted its first a - 1 drafts)."""
    lens = np.asarray(accept_lens, np.int64)
    return [int(np.sum(lens - 1 > i)) for i in range(depth)]
