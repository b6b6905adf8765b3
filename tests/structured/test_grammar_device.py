"""The device side of structured output (``jaxspec.sampling.grammar_masks``): following a path of automaton
states compiles in time linear in its length. Chains of ``Grammar.advance`` (a verify tree's levels,
the emitted path) once compiled in time doubling per level (15 s at depth 8, a depth-15 DFlash chain
not at all), because XLA inlined every earlier level twice into each later one."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.sampling.grammar_masks import Grammar, GrammarTable, node_states, path_states


def compile_seconds(depth: int) -> float:
    """Seconds to compile masking the logits of a chain of ``depth`` nodes by their states, and the
    states along the chain's path."""
    B, V, S, C = 2, 64, 16, 8
    rng = np.random.default_rng(depth)
    table = GrammarTable.from_host(rng.integers(-1, S, (S, C)).astype(np.int32), rng.integers(0, C, V).astype(np.int32),
                                   np.zeros(S, bool), np.zeros(S, bool))
    grammar = Grammar(table=table, state=jnp.zeros(B, jnp.int32), stop_ids=jnp.zeros((B, 1), jnp.int32))
    n = depth + 1
    tokens = jnp.zeros((B, n), jnp.int32)
    parent = jnp.broadcast_to(jnp.arange(-1, depth, dtype=jnp.int32), (B, n))

    def f(grammar, tokens, parent, logits):
        return grammar.mask(logits, node_states(grammar, tokens, parent, depth)), path_states(grammar, tokens)

    t = time.perf_counter()
    jax.jit(f).lower(grammar, tokens, parent, jnp.zeros((B, n, V))).compile()
    return time.perf_counter() - t


def test_deep_chains_of_states_compile_in_linear_time():
    compile_seconds(2)  # warm up the compiler
    shallow, deep = compile_seconds(4), compile_seconds(8)
    assert deep < 5 * shallow + 2.0, (shallow, deep)
    assert compile_seconds(16) < 10 * shallow + 4.0
