"""User-facing configuration: what to speculate, how to sample, how to size the engine.

All three are frozen, keyword-only dataclasses. They validate in ``__post_init__`` (a bad
value raises ``ValueError`` naming the field before any device work) and are hashable, so
the parts that shape compiled programs can be passed to ``jax.jit`` as static arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Literal

from jaxspec.xla_options import normalize_options

# Ops of ``jaxspec.pallas`` that take an ``implementation`` (each resolves its own entry).
KERNEL_OPS = ("paged_attention", "mla_attention", "mla_sparse_attention", "dsa_indexer", "kv_move", "gather_spec_extras",
              "rope_write", "rms_norm", "sinkhorn", "grouped_matmul")
# "pallas" | "xla" | None for every op, or per op: {op: "pallas" | "xla" | None}, stored as
# sorted (op, choice) pairs so configs stay hashable.
Implementation = Literal["pallas", "xla"] | None | Mapping[str, Literal["pallas", "xla"] | None] | tuple


def normalize_implementation(value) -> str | None | tuple[tuple[str, str | None], ...]:
    """Validates an implementation choice; a mapping becomes sorted (op, choice) pairs."""
    choices = ("pallas", "xla", None)
    pairs_given = isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value)
    if isinstance(value, Mapping) or pairs_given:
        pairs = tuple(sorted(dict(value).items()))
        for op, choice in pairs:
            if op not in KERNEL_OPS:
                raise ValueError(f"implementation names an unknown op {op!r}; ops are {KERNEL_OPS}")
            if choice not in choices:
                raise ValueError(f"implementation for {op} must be 'pallas', 'xla' or None, got {choice!r}")
        return pairs
    if isinstance(value, str) or value is None:
        if value not in choices:
            raise ValueError(f"implementation must be 'pallas', 'xla', None or a mapping op -> those, got {value!r}")
        return value
    raise ValueError(f"implementation must be 'pallas', 'xla', None or a mapping op -> those, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """Shape of one speculative step (SGLang's ``--speculative-*`` flags).

    Attributes:
      num_steps: S, the draft depth. The draft runs S-1 forwards per step (the first
        level of candidates comes from the previous draft-extend).
      topk: branching factor of the draft tree. ``topk == 1`` is a chain and takes a
        static fast path with no top_k/sort/gather.
      num_draft_tokens: n, tokens verified per step including the root (the last
        verified token). Chains need ``n == S + 1``; trees need
        ``n - 1 <= topk + (S - 1) * topk**2`` (the number of candidates drafted).
      accept_threshold_single, accept_threshold_acc: SGLang's tree-sampling thresholds
        (temperature > 0). At 1.0 (default) sampling is exact; below 1 more drafts are
        accepted and the output distribution is NO LONGER the target's (lossy).
      adaptive_steps: chains only: candidate depths to switch among between executable
        calls, following the observed accept length (``num_steps`` is where it starts; each
        depth has its own compiled program). Empty: fixed depth.
      ngram_tokens: G, hybrid drafting only (``jaxspec.HybridDraft``): tokens of an n-gram
        continuation grafted onto the model draft's tree as an extra branch from the root,
        counted in ``num_draft_tokens`` (the model draft proposes the other n - 1 - G with its
        usual depth ``num_steps``; the branch may be deeper). A chain with grafted tokens is
        verified as a tree, so ``topk=1`` then needs ``num_draft_tokens == num_steps + 1 +
        ngram_tokens``.
      confidence_threshold: block drafts with a confidence head only (DSpark), chains: per
        request, verify only the leading draft tokens whose predicted acceptance (the running
        product of the head's per-slot probabilities) is at least this, in [0, 1]. The step
        verifies the longest of the batch (one of a few precompiled lengths) and caps each
        row's acceptance at its own; output is unchanged, only the tokens verified. None
        (default): the whole block, as vLLM does.
    """

    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 8
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    adaptive_steps: tuple[int, ...] = ()
    ngram_tokens: int = 0
    confidence_threshold: float | None = None

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SpecConfig.{name} must be a positive int, got {value!r}")
        if self.num_draft_tokens < 2:
            raise ValueError(
                f"SpecConfig.num_draft_tokens must be >= 2 (root + at least one draft token), "
                f"got {self.num_draft_tokens}"
            )
        G = self.ngram_tokens
        if not isinstance(G, int) or isinstance(G, bool) or G < 0:
            raise ValueError(f"SpecConfig.ngram_tokens must be an int >= 0, got {G!r}")
        if self.topk == 1 and self.num_draft_tokens != self.num_steps + 1 + G:
            what, got = ("num_steps + 1 + ngram_tokens", f", ngram_tokens={G}") if G else ("num_steps + 1", "")
            raise ValueError(
                f"SpecConfig: a chain (topk=1) verifies exactly {what} tokens; got num_steps={self.num_steps}"
                f"{got}, num_draft_tokens={self.num_draft_tokens} (use num_draft_tokens={self.num_steps + 1 + G})"
            )
        for name in ("accept_threshold_single", "accept_threshold_acc"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ValueError(f"SpecConfig.{name} must be in (0, 1], got {value!r}")
        if self.adaptive_steps:
            steps = tuple(self.adaptive_steps)
            if any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in steps):
                raise ValueError(f"SpecConfig.adaptive_steps must be positive ints, got {steps!r}")
            if self.topk != 1 or G:
                raise ValueError("SpecConfig.adaptive_steps is for chains (topk=1, no ngram_tokens) only")
            if self.num_steps not in steps:
                raise ValueError(f"SpecConfig.num_steps={self.num_steps} must be one of adaptive_steps {steps}")
            object.__setattr__(self, "adaptive_steps", tuple(sorted(set(steps))))
        if self.num_draft_tokens - 1 - G > self.num_candidates:
            minus = " - ngram_tokens" if G else ""
            raise ValueError(
                f"SpecConfig: num_draft_tokens - 1{minus} = {self.num_draft_tokens - 1 - G} exceeds the "
                f"{self.num_candidates} candidates drafted by topk={self.topk}, "
                f"num_steps={self.num_steps} (topk + (num_steps - 1) * topk**2)"
            )
        c = self.confidence_threshold
        if c is not None:
            if not isinstance(c, (int, float)) or isinstance(c, bool) or not 0.0 <= c <= 1.0:
                raise ValueError(f"SpecConfig.confidence_threshold must be None or in [0, 1], got {c!r}")
            if not self.is_chain or self.adaptive_steps:
                raise ValueError("SpecConfig.confidence_threshold schedules a chain's verify length: it needs "
                                 "topk=1, no ngram_tokens and no adaptive_steps")
            object.__setattr__(self, "confidence_threshold", float(c))
        if G and self.num_draft_tokens - 1 - G < 1:
            raise ValueError(
                f"SpecConfig: num_draft_tokens={self.num_draft_tokens} leaves no node for the model draft "
                f"next to ngram_tokens={G} (need num_draft_tokens >= ngram_tokens + 2)"
            )

    @classmethod
    def chain(cls, num_steps: int, adaptive_steps: tuple[int, ...] = (),
              confidence_threshold: float | None = None) -> "SpecConfig":
        """A topk=1 chain of ``num_steps`` draft tokens (optionally adaptive, or verified as far
        as a DSpark confidence head predicts acceptance)."""
        return cls(num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1, adaptive_steps=adaptive_steps,
                   confidence_threshold=confidence_threshold)

    def with_steps(self, num_steps: int) -> "SpecConfig":
        """The fixed-depth chain this adaptive config runs at ``num_steps``."""
        return SpecConfig(
            num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1,
            accept_threshold_single=self.accept_threshold_single, accept_threshold_acc=self.accept_threshold_acc,
        )

    @property
    def num_candidates(self) -> int:
        """Draft candidates recorded over S steps: topk + (S - 1) * topk**2."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def is_chain(self) -> bool:
        """Verified as a chain: topk 1 and nothing grafted (a chain with grafts is a tree)."""
        return self.topk == 1 and self.ngram_tokens == 0

    @property
    def model_spec(self) -> "SpecConfig":
        """The part a hybrid's model draft proposes: this config without the grafted tokens."""
        return dataclasses.replace(self, num_draft_tokens=self.num_draft_tokens - self.ngram_tokens, ngram_tokens=0)

    @property
    def depth(self) -> int:
        """The deepest verify node: S, or a deeper grafted n-gram branch."""
        return max(self.num_steps, self.ngram_tokens)

    @property
    def max_accept(self) -> int:
        """Most tokens one step can emit: ``depth`` accepted drafts + 1 bonus token."""
        return self.depth + 1

    @property
    def exact_sampling(self) -> bool:
        """Thresholds at 1.0: sampling at temperature > 0 is lossless."""
        return self.accept_threshold_single == 1.0 and self.accept_threshold_acc == 1.0

    @property
    def uses_rejection_sampling(self) -> bool:
        """Chains at exact thresholds verify with the draft's probabilities (rejection
        sampling); everything else uses target-only tree sampling."""
        return self.is_chain and self.exact_sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens for one request (or for every request of a call).

    vLLM's names, meanings and order: the target's logits get the logit bias, then the
    repetition / presence / frequency penalties; greedy (``temperature == 0``) takes their
    argmax, sampling draws from ``top_p(top_k(min_p(softmax(logits / temperature))))``. Every
    control holds exactly under speculation, for chains and trees (each tree node is judged with
    the token counts of its own path).

    Attributes:
      temperature: 0 for greedy, else > 0.
      top_k: keep the k most likely tokens; 0 disables.
      top_p: keep the smallest prefix of the sorted distribution with mass >= top_p;
        in (0, 1], 1 disables.
      min_p: in [0, 1]: drop tokens whose probability is below ``min_p`` times the most likely
        one's (after temperature, before top-k / top-p); 0 disables.
      repetition_penalty: > 0, 1 disables. Over prompt and output tokens: a positive logit is
        divided by it, any other multiplied.
      presence_penalty, frequency_penalty: in [-2, 2], 0 disables. Over output tokens: the logit
        loses ``presence * (count > 0) + frequency * count``.
      logit_bias: token id -> value added to its logit (a mapping, or (id, value) pairs; stored
        as sorted pairs so the params stay hashable).
      logprobs: None (off), 0 (the log-probability of each emitted token), or 1..20 (also the
        ``logprobs`` most likely tokens'), under the target's raw distribution (log-softmax of
        its logits before any control, vLLM's default).
      max_new_tokens: most tokens generated (stop token excluded).
      stop_token_ids: tokens that end the request (not emitted). None: the model's eos ids.
      stop: strings that end the request when its output text contains one (a str or a tuple
        of them): the text stops before it, the token ids end with the token that completed it.
      seed: per-request PRNG seed; None derives one from ``generate(seed=...)`` and the
        request's index.
      regex: structured output: the output text must match this regular expression (Python
        syntax, as a whole; what a finite automaton cannot express is refused). At every position
        only tokens that keep the text a prefix of some match are allowed, and the stop tokens only
        where it is a complete match; the grammar's mask comes before every other control.
      json_schema: structured output: the output must be a JSON text the schema allows (a dict or
        its JSON text; stored as JSON text). At most one of ``regex`` / ``json_schema``.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    logprobs: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] | None = None
    stop: str | tuple[str, ...] | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | Mapping | None = None

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"SamplingParams.temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 disables), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be a positive int, got {self.max_new_tokens!r}"
            )
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {ids!r}")
            object.__setattr__(self, "stop_token_ids", ids)
        if self.stop is not None:
            stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
            if any(not isinstance(x, str) for x in stops):
                raise ValueError(f"SamplingParams.stop must be a string or a sequence of strings, got {self.stop!r}")
            if any(x == "" for x in stops):
                raise ValueError("SamplingParams.stop holds an empty string (it would end every request at once)")
            object.__setattr__(self, "stop", tuple(dict.fromkeys(stops)) or None)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"SamplingParams.seed must be an int in [0, 2**32) or None, got {self.seed!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0, got "
                             f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value!r}")
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("SamplingParams: give at most one of regex and json_schema")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"SamplingParams.regex must be a string, got {type(self.regex).__name__}")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", _schema_text(self.json_schema))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Logit bias or a repetition / presence / frequency penalty is on (the logits are
        processed with the row's token counts)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @property
    def constraint(self) -> tuple[str, str] | None:
        """("regex", pattern), ("json_schema", schema JSON text) or None."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        return None

    @property
    def filters(self) -> bool:
        """Sampling sorts the distribution (top-k or top-p; min-p needs no sort)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


# Most top log-probabilities a request may ask for (vLLM's default cap).
MAX_LOGPROBS = 20


def _schema_text(schema) -> str:
    """A JSON schema (a mapping or its JSON text) as JSON text, its key order kept (properties are
    written in that order)."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"SamplingParams.json_schema is not valid JSON: {e}") from None
        return schema
    if isinstance(schema, (Mapping, bool)):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"SamplingParams.json_schema cannot be written as JSON: {e}") from None
    raise ValueError(f"SamplingParams.json_schema must be a dict or its JSON text, got {type(schema).__name__}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _normalize_logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """A mapping or (id, value) pairs -> sorted (int id, float value) pairs (None when empty)."""
    if value is None:
        return None
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers, got {value!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"SamplingParams.logit_bias must map token ids to numbers, got the entry {pair!r}")
        token, bias = pair
        if isinstance(token, str) and token.strip().isdigit():  # JSON objects key by strings
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not _finite(bias):
            raise ValueError(f"SamplingParams.logit_bias[{token}] must be a finite number, got {bias!r}")
        out[int(token)] = float(bias)
    return tuple(sorted(out.items())) or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Sizes of the serving engine.

    Attributes:
      page_size: KV slots per page (any positive int; 1, 16 and 64 are tested).
      max_batch: most requests decoded together; the batch is padded to a power of two.
      max_seq_len: most tokens of one request (prompt + generated).
      num_pages: KV pages in each pool, page 0 included (reserved scratch). None sizes
        the pool for ``max_batch`` requests of ``max_seq_len`` tokens.
      page_budget: pages of the KV pools the scheduler may hand out, page 0 included (counted as
        ``num_pages`` counts them, over all data shards); None: every page. The pools keep their
        size, so an engine under a budget runs the same compiled programs as without one, and
        admits, preempts and evicts as an engine whose pools have this many pages: memory pressure
        studied (or tested) on one set of programs, whatever the budget. The sliding-window and
        compressed-entry pools keep all their pages.
      steps_per_call: decode (or speculative) steps run on device per host round trip.
      implementation: kernels to use: "pallas", "xla", or None (Pallas on GPU where the kernel
        supports the shape, XLA elsewhere); or a mapping op name -> one of those (ops in
        ``KERNEL_OPS``; unnamed ops take None), stored as sorted (op, choice) pairs.
      min_prefill_bucket: smallest prefill length bucket (buckets double from here).
      min_prefill_rows: smallest number of rows a prefill runs (per data shard; the requests
        admitted together, padded to a power of two, never less than this nor more than the
        shard's rows). Larger: fewer compiled prefill variants, more padding rows computed.
      min_kv_bucket: smallest KV length (positions) attention reads; the page table handed to
        each compiled call covers the live context rounded up to a power of two of pages,
        never less than this (smaller: less read per step, more compiled variants).
      admission: "optimistic" (admit a request when its prompt and the next call's growth fit;
        when running requests need pages that are not free, preempt the most recently admitted
        ones and resume them later with identical output) or "reserve" (admit only when the
        request's worst case, prompt + max_new_tokens + the step's lookahead, stays reserved
        for its whole life: never preempts, runs fewer requests at once).
      preempt_every: testing hook: every this many decode calls, preempt the most recently
        admitted running request (never the only one) even when pages are free (0: never).
      check_pages: after every decode call, check that every page is owned by exactly one
        running request or free, and that the page tables hold exactly the owned pages (tests).
      prefix_cache: keep full pages of prompt KV (target and draft) after their requests end,
        indexed by the tokens they hold and the one after them, and reuse them for later prompts
        that start the same way (in the call, and in later calls of a ``jaxspec.Engine``); cached
        pages count as free (evicted, least recently used first, when pages are needed). None:
        on where the model allows it; True: on, or a ValueError naming why not (a standalone draft
        with recurrent state of its own is not cached yet); False: off.
        Sliding-window pools cache their pages too (``window_cache_pages``), targets with recurrent
        state snapshots of it (``snapshot_slots``), DeepSeek-V4 its entry pages.
      window_cache_pages: pages the sliding-window pool keeps beyond its rings for the prefix
        cache (window pages parked after their requests, and the checkpoints a prefill writes where
        another prompt's match ended; ``jaxspec.engine.window``), over all data shards. None: four
        windows' worth per data shard; 0: window pages are not cached (nor, then, prompts with them).
      snapshot_slots: recurrent-state snapshots the prefix cache keeps for a target with
        linear-attention layers (Qwen3.5 / Qwen3-Next; ``jaxspec.engine.snapshots``), over all data
        shards: each holds every linear layer's state (144 MiB at Qwen3.5-27B's shapes). None: 8 per
        data shard; 0: states are not cached (nor, then, prompts of such a target).
      compiler_options: the XLA options every compiled program of the engine (prefill, the decode
        loop and the draft loops in it) is compiled with, per program (``XLA_FLAGS`` is never set).
        None: jaxspec's table for the backend the programs run on (``jaxspec.xla_options.TABLE``,
        each entry with what it was measured to do; on GPUs cuBLAS instead of Triton for the
        products); a mapping XLA option name -> value (names without leading dashes, values bools,
        ints, floats or strings; (name, value) pairs too): merged over that table, a value of None
        dropping the table's entry; False: no options at all, XLA's defaults. A name jaxlib does
        not know, or a value it refuses, raises a ValueError naming it here (checked by compiling a
        one-op program once per new option). Stored as sorted (name, value) pairs, so
        ``EngineConfig(compiler_options={"xla_gpu_enable_command_buffer": ""})`` is hashable.
      exact: every row of the target computed with reductions in a fixed order (products through a
        fixed-tile kernel, attention over fixed KV tiles from position 0), so a row's logits are bit
        for bit the same in a decode step, in any row of a verify, in a prefill, in a batch of any
        size and order: greedy speculative output equals plain greedy output bit for bit in bf16
        too, tokens and log-probabilities. Off by default (it costs time; see
        docs/architecture.md#the-exact-mode). Refused, naming why, for a mesh and for targets whose
        layers the mode does not cover yet.
    """

    page_size: int = 16
    max_batch: int = 32
    max_seq_len: int = 4096
    num_pages: int | None = None
    page_budget: int | None = None
    steps_per_call: int = 8
    implementation: Implementation = None
    min_prefill_bucket: int = 16
    min_prefill_rows: int = 1
    min_kv_bucket: int = 1024
    admission: str = "optimistic"
    preempt_every: int = 0
    check_pages: bool = False
    prefix_cache: bool | None = None
    window_cache_pages: int | None = None
    snapshot_slots: int | None = None
    compiler_options: Mapping[str, bool | int | float | str | None] | tuple | bool | None = None
    exact: bool = False

    def __post_init__(self):
        for name in ("page_size", "max_batch", "max_seq_len", "steps_per_call", "min_prefill_bucket", "min_prefill_rows",
                     "min_kv_bucket"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.admission not in ("optimistic", "reserve"):
            raise ValueError(f"EngineConfig.admission must be 'optimistic' or 'reserve', got {self.admission!r}")
        if not isinstance(self.preempt_every, int) or isinstance(self.preempt_every, bool) or self.preempt_every < 0:
            raise ValueError(f"EngineConfig.preempt_every must be an int >= 0, got {self.preempt_every!r}")
        if not isinstance(self.check_pages, bool):
            raise ValueError(f"EngineConfig.check_pages must be a bool, got {self.check_pages!r}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"EngineConfig.exact must be a bool, got {self.exact!r}")
        if self.prefix_cache is not None and not isinstance(self.prefix_cache, bool):
            raise ValueError(f"EngineConfig.prefix_cache must be None, True or False, got {self.prefix_cache!r}")
        for name in ("window_cache_pages", "snapshot_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"EngineConfig.{name} must be None or an int >= 0, got {value!r}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(
                f"EngineConfig.num_pages must be >= 2 (page 0 is reserved scratch), got {self.num_pages!r}"
            )
        budget = self.page_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 2):
            raise ValueError(
                f"EngineConfig.page_budget must be None or >= 2 (page 0 is reserved scratch), got {self.page_budget!r}")
        try:
            implementation = normalize_implementation(self.implementation)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None
        object.__setattr__(self, "implementation", implementation)  # a mapping -> hashable pairs
        try:
            compiler_options = normalize_options(self.compiler_options)
        except ValueError as e:
            raise ValueError(f"EngineConfig.compiler_options: {e}") from None
        object.__setattr__(self, "compiler_options", compiler_options)  # a mapping -> hashable pairs

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.page_size)
