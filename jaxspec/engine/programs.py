"""The compiled programs: prefill (admit requests) and the decode loop (K steps per call).

Both take the static ``Plan`` and donate the state and the KV pools, so the pools are
updated in place. One executable call runs up to ``plan.steps_per_call`` speculative steps
in a ``lax.while_loop`` with no host sync, stopping early when every row is done.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.draft.plan import Plan
from jaxspec.draft.step import spec_step
from jaxspec.engine.prefill import prefill
from jaxspec.engine.state import DecodeState, commit


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state", "tpool", "dpool"))
def prefill_program(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table, rows, tokens, lens, request):
    return prefill(plan, tparams, dparams, state, tpool, dpool, page_table, rows, tokens, lens, request)


def decode_step(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """One speculative step for every row, committed: (state, tpool, dpool)."""
    out, tpool, dpool = spec_step(plan, tparams, dparams, state.step_rows(), tpool, dpool, page_table)
    return commit(state, out), tpool, dpool


def decode_steps(plan: Plan, tparams, dparams, state: DecodeState, tpool, dpool, page_table):
    """Up to ``plan.steps_per_call`` steps in one ``lax.while_loop``; returns
    (state, tpool, dpool, steps_run)."""

    def cond(carry):
        i, st, _, _ = carry
        return (i < plan.steps_per_call) & jnp.any(st.active)

    def body(carry):
        i, st, tp, dp = carry
        return i + 1, *decode_step(plan, tparams, dparams, st, tp, dp, page_table)

    steps, state, tpool, dpool = jax.lax.while_loop(cond, body, (jnp.int32(0), state, tpool, dpool))
    return state, tpool, dpool, steps


decode_program = jax.jit(decode_steps, static_argnames=("plan",), donate_argnames=("state", "tpool", "dpool"))


def compiled_programs() -> dict[str, int]:
    """Number of compiled variants of each program (used to prove steady state)."""
    return {"prefill": prefill_program._cache_size(), "decode": decode_program._cache_size()}
