"""A call's requests, checked before any device work: prompts tokenized (strings, token ids or
chats), sampling settings fitted to the vocabulary, constraints compiled, models and seeds
checked, and each request's PRNG key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import EngineConfig, SamplingParams
from jaxspec.model.config import padded_vocab_size
from jaxspec.model.drafts.base import DraftModel
from jaxspec.model.targets import Model
from jaxspec.structured import compile_constraints


def is_chat(p) -> bool:
    return isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and len(p) > 0 and isinstance(p[0], Mapping)


def tokenize(target: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings, token-id lists or chats (lists of message dicts)")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if is_chat(prompts):
        raise ValueError("prompts is one chat (a list of message dicts); pass a list of chats: [messages]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (Integral, np.integer)):
            raise ValueError(f"prompt {i} is a token id ({int(p)}), not a prompt: prompts is a list of prompts, so one "
                             f"prompt of token ids is [[{int(p)}, ...]]")
        if isinstance(p, str) or is_chat(p):
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


def sampling_list(sampling, n: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    sampling = list(sampling)
    if len(sampling) != n or not all(isinstance(s, SamplingParams) for s in sampling):
        raise ValueError(f"sampling must be a SamplingParams or a list of {n} SamplingParams")
    return sampling


def check_sampling_fits(sampling: list[SamplingParams], vocab_size: int) -> None:
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


def request_keys(seed: int, sampling: list[SamplingParams], indices=None) -> np.ndarray:  # u32[N, 2]
    """Request i's key: PRNGKey(its own seed) if it has one, else fold_in(PRNGKey(seed), i)
    (``indices[i]`` instead of i when given: a serving core's request ids)."""
    own = np.asarray([s.seed or 0 for s in sampling], np.uint32)
    has_own = np.asarray([s.seed is not None for s in sampling])
    index = np.arange(len(sampling), dtype=np.uint32) if indices is None else np.asarray(indices, np.uint32)
    keys = _keys_for(np.uint32(seed), index, own, has_own)
    return np.asarray(keys, np.uint32)


def check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


def check_requests(target: Model, ids: list[list[int]], sampling: list[SamplingParams], engine: EngineConfig):
    """Everything about the requests that can be refused before any device work; returns the call's
    structured-output automata (compiled here, cached by constraint) and which each request follows."""
    check_sampling_fits(sampling, target.config.vocab_size)
    grammars = compile_request_constraints(target, sampling)
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


def compile_request_constraints(target: Model, sampling: list[SamplingParams]):
    """(GrammarSet or None, per request the index of its automaton or None), or a ValueError naming
    the request whose constraint cannot be compiled (before any device work)."""
    # Over the logits' width: a vocabulary padded for a mesh has ids no token text reaches.
    return compile_constraints(target.tokenizer, padded_vocab_size(target.config), [s.constraint for s in sampling])


def check_models(target, draft, spec) -> None:
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
