"""Structured output on device: token-level automata as arrays, and the masks they give.

Every request has an automaton state (``i32[B]`` in the decode state); the automata of a call live
in one table shared by all rows (``GrammarTable``, built on the host by ``jaxspec.structured``):
``next_state[s, token_class[t]]`` is the state after token ``t`` in state ``s``, -1 when ``t`` is not
allowed there. State ``FREE`` (unconstrained requests) allows everything and stays FREE; ``DEAD`` is
where a token that was not allowed leads (only draft nodes that cannot be accepted get there), and
allows everything so that no distribution computed for such a node is empty.

A row's stop tokens are allowed exactly where its text is a complete match (``final``); everything
else follows the table. A state with no allowed token (``terminal``: a complete match the language
cannot extend) ends the request.

Inside a verify tree each node's state is its parent's advanced by its token (``node_states``), so
every node's logits are masked as plain decoding would mask them there.

Glossary: B rows, n tree nodes, S states, C token classes, V vocabulary, NS stop ids per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FREE, DEAD = 0, 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTable:
    """next_state: i32[S, C] (-1: not allowed); token_class: i32[V]; final, terminal: bool[S].
    ``S == 0`` when no request of a call is constrained: everything here is then compiled out."""

    next_state: jax.Array
    token_class: jax.Array
    final: jax.Array
    terminal: jax.Array

    @classmethod
    def empty(cls) -> "GrammarTable":
        return cls(next_state=jnp.zeros((0, 1), jnp.int32), token_class=jnp.zeros((0,), jnp.int32),
                   final=jnp.zeros((0,), bool), terminal=jnp.zeros((0,), bool))

    @classmethod
    def from_host(cls, next_state: np.ndarray, token_class: np.ndarray, final: np.ndarray,
                  terminal: np.ndarray) -> "GrammarTable":
        return cls(next_state=jnp.asarray(next_state, jnp.int32), token_class=jnp.asarray(token_class, jnp.int32),
                   final=jnp.asarray(final, bool), terminal=jnp.asarray(terminal, bool))

    @property
    def enabled(self) -> bool:
        return self.next_state.shape[0] > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a step needs to mask and advance: the shared table, each row's current state (after its
    last emitted token, the root of the next tree) and its stop ids."""

    table: GrammarTable
    state: jax.Array  # i32[B]
    stop_ids: jax.Array  # i32[B, NS] (-1 padded)

    @property
    def enabled(self) -> bool:
        return self.table.enabled

    def advance(self, states: jax.Array, tokens: jax.Array) -> jax.Array:  # i32[B, ...] -> i32[B, ...]
        """States after ``tokens``; a token that is not allowed leads to DEAD (DEAD stays DEAD)."""
        if not self.enabled:
            return states
        t = self.table
        nxt = t.next_state[states, t.token_class[tokens]]
        # Materialized: chains of advances (a tree's levels, a path's tokens) would otherwise be fused
        # into their consumers with each earlier level inlined twice (``nxt`` is read twice), so XLA's
        # compile time and memory doubled per level (a depth-15 DFlash chain did not compile).
        return jax.lax.optimization_barrier(jnp.where(nxt >= 0, nxt, DEAD))

    def allowed(self, states: jax.Array, ids: jax.Array | None = None) -> jax.Array:
        """bool[B, ..., V'] the tokens allowed after each state (``ids``: i32[V'] the target id of
        each column, for drafts with vocabularies of their own; None: the target's vocabulary).
        Rows of a state that allows nothing (a terminal state without stop ids) allow everything:
        their request ends, and no distribution there may be empty."""
        t = self.table
        cls = t.token_class if ids is None else t.token_class[ids]  # [V']
        vocab = jnp.arange(t.token_class.shape[0], dtype=jnp.int32) if ids is None else ids
        inner = (1,) * (states.ndim - 1)
        is_stop = jnp.any(vocab[None, :, None] == self.stop_ids[:, None, :], axis=-1)  # [B, V']
        is_stop = is_stop.reshape(is_stop.shape[:1] + inner + is_stop.shape[1:])
        by_table = t.next_state[states][..., cls] >= 0  # [B, ..., V']
        ok = jnp.where(is_stop, t.final[states][..., None], by_table)
        return ok | ~jnp.any(ok, axis=-1, keepdims=True)

    def mask(self, logits: jax.Array, states: jax.Array, ids: jax.Array | None = None) -> jax.Array:
        """``logits`` f32[B, ..., V'] with the tokens each row's state does not allow at -inf."""
        if not self.enabled:
            return logits
        return jnp.where(self.allowed(states, ids), logits, -jnp.inf)

    def terminal(self, states: jax.Array) -> jax.Array:  # bool[B, ...]
        if not self.enabled:
            return jnp.zeros(states.shape, bool)
        return self.table.terminal[states]


def node_states(grammar: Grammar, tokens: jax.Array, parent: jax.Array, depth: int) -> jax.Array:
    """i32[B, n]: each verify node's state, its parent's advanced by its token (node 0, the root,
    has the row's state). tokens, parent: i32[B, n] (-1 for the root); ``depth``: the deepest node
    (static), one gather per level."""
    B, n = tokens.shape
    root = jnp.broadcast_to(grammar.state[:, None], (B, n))
    if not grammar.enabled or n == 1:
        return root
    states = root
    for _ in range(depth):  # after level d, nodes of depth <= d are right
        from_parent = jnp.take_along_axis(states, jnp.maximum(parent, 0), axis=1)
        states = jnp.where(parent >= 0, grammar.advance(from_parent, tokens), root)
    return states


def path_states(grammar: Grammar, tokens: jax.Array) -> jax.Array:
    """i32[B, A]: the state after each of ``tokens`` i32[B, A] emitted in order from the row's state."""
    if not grammar.enabled:
        return jnp.broadcast_to(grammar.state[:, None], tokens.shape)
    out, s = [], grammar.state
    for j in range(tokens.shape[1]):
        s = grammar.advance(s, tokens[:, j])
        out.append(s)
    return jnp.stack(out, axis=1)


def allowed_prefix(grammar: Grammar, tokens: jax.Array, parent: jax.Array, depth: int) -> jax.Array:
    """i32[B]: 1 + the last node whose whole path the grammar allows (node 0, the root, always):
    the nodes after it cannot be accepted, so a proposal of varying length need not verify them."""
    states = node_states(grammar, tokens, parent, depth)
    n = tokens.shape[1]
    node = jnp.arange(n, dtype=jnp.int32)[None, :]
    ok = node == 0
    for _ in range(depth):
        up = jnp.take_along_axis(ok, jnp.maximum(parent, 0), axis=1)
        ok = ok | ((parent >= 0) & up & (states != DEAD))
    return jnp.max(jnp.where(ok, node, 0), axis=1) + 1
