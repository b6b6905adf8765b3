"""Scoring a prompt: the target's log-probability of each prompt token given the tokens before it
(what an OpenAI ``echo`` with ``logprobs`` reports, and what evaluation harnesses read to score a
text). One forward over the prompt with a fresh KV pool (``forward_fresh``), its length padded to
a power of two (at least 16) so prompts of similar lengths share a compiled program.

Glossary: T padded prompt length, V the logits' width, k top log-probabilities.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.engine.geometry import next_pow2
from jaxspec.engine.programs import Program
from jaxspec.model.targets import forward_fresh
from jaxspec.spec.plan import Plan

MIN_SCORE_BUCKET = 16


def _score(plan: Plan, params, tokens, *, dtype, k: int):  # tokens i32[1, T] -> f32[T-1], i32[T-1, k], f32[T-1, k]
    logits, _, _ = forward_fresh(plan.target, params, tokens, dtype=dtype)  # [1, T, V]
    lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)  # position t predicts token t + 1
    chosen = jnp.take_along_axis(lp, tokens[0, 1:, None], axis=-1)[:, 0]
    top, ids = jax.lax.top_k(lp, max(k, 1))
    return chosen, ids.astype(jnp.int32), top


# Compiled with the engine plan's XLA options, like the engine's other programs.
score_program = Program(_score, static_argnames=("plan", "dtype", "k"))


def prompt_logprobs(target, plan: Plan, ids: list[int],
                    k: int) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """Per prompt token: its raw log-probability given the tokens before it (None for the first,
    which has none) and a ``{token_id: logprob}`` dict of the ``k`` most likely tokens there (None
    for the first). ``plan``: the engine's (its target config and XLA options)."""
    T = max(MIN_SCORE_BUCKET, next_pow2(len(ids)))
    tokens = np.zeros((1, T), np.int32)
    tokens[0, : len(ids)] = ids
    chosen, top_ids, top = jax.device_get(score_program(plan, target.params, tokens,
                                                        dtype=np.dtype(target.dtype).name, k=k))
    n = len(ids) - 1
    values = [None] + chosen[:n].tolist()
    tops = [None] + [dict(zip(i, v)) for i, v in zip(top_ids[:n, :k].tolist(), top[:n, :k].tolist())]
    return values, tops
