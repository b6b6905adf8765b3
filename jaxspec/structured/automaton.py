"""Token-level automata: a regular language compiled over a model's vocabulary.

Built once per distinct constraint (cached by its text and the vocabulary), on the host:

1. The regex is compiled into a DFA over bytes (``jaxspec.structured.regex``).
2. Every token is run through that DFA from every state at once (numpy, tokens grouped by their
   byte length): ``next[s, t]`` is the state after token ``t``'s bytes, or dead. A token is allowed
   in ``s`` when its bytes never leave the language.
3. States from which no final state can be reached with the vocabulary's tokens are dropped (a
   token leading there is not allowed), so a request can always finish; if the initial state is
   such a state, no string of the language can be spelled and the constraint is refused.
4. Tokens that behave the same in every state share a *class*, so the table is ``[states,
   classes]`` plus a ``[vocab]`` class map, not ``[states, vocab]``: for JSON schemas most of a
   128k vocabulary falls into a handful of classes (every token with no quote, brace, digit, ...).

``GrammarSet`` joins the automata of one call into the device table (``jaxspec.model.grammar``):
state 0 is FREE (unconstrained requests: everything allowed), 1 is DEAD (reached only by a token that
was not allowed, i.e. by draft nodes that cannot be accepted), then each automaton's states.

Glossary: Q byte-DFA states, V vocabulary, S token-level states, C token classes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from jaxspec.model.grammar import DEAD, FREE, GrammarTable
from jaxspec.structured.regex import ByteDFA

_HASH_A = np.uint64(0x9E3779B97F4A7C15)
_HASH_B = np.uint64(0xC2B2AE3D27D4EB4F)


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
    """One constraint over one vocabulary.

    next_state: i32[S, C] the state after a token of each class (-1: not allowed).
    token_class: i32[V] each token's class (tokens with no text share the class that nothing allows).
    final: bool[S] the text so far is a complete match (stop tokens are allowed).
    initial: the state before any token. build_seconds: host time to build it."""

    next_state: np.ndarray
    token_class: np.ndarray
    final: np.ndarray
    initial: int
    build_seconds: float = 0.0

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    def allowed(self, state: int) -> np.ndarray:  # bool[V]
        return self.next_state[state][self.token_class] >= 0

    def walk(self, tokens, state: int | None = None) -> int:
        """The state after ``tokens`` (-1 once a token is not allowed)."""
        s = self.initial if state is None else state
        for t in tokens:
            if s < 0:
                break
            s = int(self.next_state[s, self.token_class[t]])
        return s

    @property
    def nbytes(self) -> int:
        return self.next_state.nbytes + self.token_class.nbytes + self.final.nbytes


def _token_groups(token_bytes, vocab_size: int):
    """Token ids with a non-empty text, grouped by byte length: {L: (ids i32[n], bytes u8[n, L])}."""
    by_len = collections.defaultdict(list)
    for i, b in enumerate(token_bytes[:vocab_size]):
        if b:
            by_len[len(b)].append(i)
    groups = {}
    for L, ids in by_len.items():
        data = b"".join(token_bytes[i] for i in ids)
        groups[L] = (np.asarray(ids, np.int32), np.frombuffer(data, np.uint8).reshape(len(ids), L))
    return groups


def compile_automaton(byte_dfa: ByteDFA, token_bytes, vocab_size: int, *, what: str = "constraint") -> Automaton:
    """The token-level automaton of a byte-level DFA over a vocabulary of ``vocab_size`` ids whose
    texts are ``token_bytes`` (None: a token never generated under a constraint). Raises ValueError
    (naming ``what``) when no string of the language can be spelled with the vocabulary."""
    t0 = time.perf_counter()
    dfa, byte_final, byte_initial = byte_dfa.table, byte_dfa.final, byte_dfa.initial
    Q = dfa.shape[0] - 1
    V = vocab_size
    groups = _token_groups(token_bytes, V)
    h1 = np.zeros(V, np.uint64)
    h2 = np.zeros(V, np.uint64)
    successors: list[np.ndarray] = []
    chunk = max(1, min(Q, (1 << 22) // max(1, V)))
    for q0 in range(0, Q, chunk):
        qs = np.arange(q0, min(Q, q0 + chunk), dtype=np.int32)
        rows = np.full((len(qs), V), Q, np.int32)  # dead unless a token's bytes stay alive
        for L, (ids, data) in groups.items():
            cur = np.broadcast_to(qs[:, None], (len(qs), len(ids)))
            for p in range(L):
                cur = dfa[cur, data[None, :, p]]
            rows[:, ids] = cur
        for row in rows:
            h1 = h1 * _HASH_A + row.astype(np.uint64) + np.uint64(1)
            h2 = (h2 ^ (row.astype(np.uint64) + np.uint64(0x632BE5AB))) * _HASH_B
            successors.append(np.unique(row[row < Q]))
    # States from which the vocabulary can reach a final state (backwards from the finals).
    predecessors = collections.defaultdict(list)
    for q, succ in enumerate(successors):
        for s in succ.tolist():
            predecessors[s].append(q)
    live = byte_final.copy()
    todo = list(np.flatnonzero(live))
    while todo:
        for q in predecessors[todo.pop()]:
            if not live[q]:
                live[q] = True
                todo.append(q)
    if not live[byte_initial]:
        raise ValueError(f"{what}: no string of its language can be spelled with this model's vocabulary")
    # Token classes: tokens with equal next-state rows (a 128-bit hash of the rows).
    _, first, token_class = np.unique(np.stack([h1, h2], axis=1), axis=0, return_index=True, return_inverse=True)
    token_class = token_class.reshape(-1).astype(np.int32)
    reps = first.astype(np.int32)  # one token of each class
    # The table on representatives only, live states renumbered 0..S-1, everything else -1.
    number = np.full(Q + 1, -1, np.int32)
    number[np.flatnonzero(live)] = np.arange(int(live.sum()), dtype=np.int32)
    rep_next = np.full((Q, len(reps)), Q, np.int32)
    rep_bytes = [token_bytes[i] if i < len(token_bytes) else None for i in reps]
    for c, b in enumerate(rep_bytes):
        if b:
            cur = np.arange(Q, dtype=np.int32)
            for byte in b:
                cur = dfa[cur, byte]
            rep_next[:, c] = cur
    table = number[rep_next[live]]  # [S, C]
    # Classes that differ only in states that were dropped are merged.
    _, keep, merged = np.unique(table.T, axis=0, return_index=True, return_inverse=True)
    table = np.ascontiguousarray(table[:, keep])
    token_class = merged.reshape(-1).astype(np.int32)[token_class]
    return Automaton(next_state=table.astype(np.int32), token_class=token_class, final=byte_final[live],
                     initial=int(number[byte_initial]), build_seconds=time.perf_counter() - t0)


class AutomatonCache:
    """Compiled automata by (constraint text, vocabulary); thread-safe, least recently used
    dropped past ``capacity``."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, build) -> Automaton:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = build()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value


@dataclasses.dataclass(frozen=True, eq=False)
class GrammarSet:
    """The automata of one call joined into one device table.

    table: the host arrays of a ``GrammarTable`` (padded to power-of-two states and classes, so
    calls with similar constraints share a compiled program). offsets[i]: where automaton i's
    states start."""

    automata: tuple[Automaton, ...]
    next_state: np.ndarray  # i32[S_pad, C_pad]
    token_class: np.ndarray  # i32[V]
    final: np.ndarray  # bool[S_pad]
    terminal: np.ndarray  # bool[S_pad]
    offsets: tuple[int, ...]

    def initial(self, which: int | None) -> int:
        """The start state of automaton ``which`` (None: FREE)."""
        return FREE if which is None else self.offsets[which] + self.automata[which].initial

    def walk(self, which: int | None, tokens) -> int:
        """The global state after ``tokens`` from automaton ``which``'s start (FREE stays FREE)."""
        s = self.initial(which)
        for t in tokens:
            s = int(self.next_state[s, self.token_class[t]])
            if s < 0:
                return DEAD
        return s

    def ended(self, which: int, tokens) -> bool:
        """``tokens`` complete a match of automaton ``which`` that its language cannot extend."""
        return bool(self.terminal[self.walk(which, tokens)])

    def device_table(self) -> GrammarTable:
        return GrammarTable.from_host(self.next_state, self.token_class, self.final, self.terminal)

    @property
    def nbytes(self) -> int:
        return self.next_state.nbytes + self.token_class.nbytes + self.final.nbytes + self.terminal.nbytes


# Smallest table bucket: calls whose constraints fit share their compiled programs (512 x 128 int32
# is 256 KiB).
MIN_STATES, MIN_CLASSES = 512, 128


def _pow2(x: int, least: int) -> int:
    return max(least, 1 << max(0, x - 1).bit_length())


def join_automata(automata: list[Automaton], vocab_size: int) -> GrammarSet:
    """One table for ``automata`` (all over the same vocabulary of ``vocab_size``)."""
    V = vocab_size
    if automata:
        classes = np.stack([a.token_class for a in automata])  # [A, V]
        _, first, joint = np.unique(classes.T, axis=0, return_index=True, return_inverse=True)
        joint = joint.reshape(-1).astype(np.int32)
    else:
        first, joint = np.zeros(1, np.int64), np.zeros(V, np.int32)
    C = len(first)
    S = 2 + sum(a.num_states for a in automata)
    S_pad, C_pad = _pow2(S, MIN_STATES), _pow2(C + 1, MIN_CLASSES)
    table = np.full((S_pad, C_pad), DEAD, np.int32)  # padding rows behave as DEAD
    table[FREE, :] = FREE
    final = np.zeros(S_pad, bool)
    final[[FREE, DEAD]] = True
    terminal = np.zeros(S_pad, bool)
    offsets, off = [], 2
    for a in automata:
        cols = a.next_state[:, a.token_class[first]]  # [S_a, C]
        table[off:off + a.num_states, :C] = np.where(cols >= 0, cols + off, -1)
        table[off:off + a.num_states, C:] = -1
        final[off:off + a.num_states] = a.final
        terminal[off:off + a.num_states] = a.final & (cols < 0).all(axis=1)
        offsets.append(off)
        off += a.num_states
    return GrammarSet(automata=tuple(automata), next_state=table, token_class=joint, final=final, terminal=terminal,
                      offsets=tuple(offsets))
