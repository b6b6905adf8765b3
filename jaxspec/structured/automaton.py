"""Token-level automata: a regular language compiled over a model's vocabulary.

Built once per distinct constraint (cached by its text and the vocabulary), on the host:

1. The regex is compiled into a DFA over bytes (``jaxspec.structured.regex``).
2. Every token is run through that DFA from every state at once, down a trie of the vocabulary's
   texts (numpy, level by level, keeping only the pairs still alive): ``next[s, t]`` is the state
   after token ``t``'s bytes. A token is allowed in ``s`` when its bytes never leave the language.
   For a tokenizer whose decoder writes a text's first token otherwise (SentencePiece drops its
   leading space: ``Tokenizer.first_token_bytes``), the automaton starts in a state of its own whose
   moves follow those first-token texts, so the matched text is the decoded output.
3. States from which no final state can be reached with the vocabulary's tokens are dropped (a
   token leading there is not allowed), so a request can always finish; if the initial state is
   such a state, no string of the language can be spelled and the constraint is refused.
4. Tokens that behave the same in every state share a *class*, so the table is ``[states,
   classes]`` plus a ``[vocab]`` class map, not ``[states, vocab]``: for JSON schemas most of a
   128k vocabulary falls into a handful of classes (every token with no quote, brace, digit, ...).

``GrammarSet`` joins the automata of one call into the device table (``jaxspec.sampling.grammar_masks``):
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

from jaxspec.sampling.grammar_masks import DEAD, FREE, GrammarTable
from jaxspec.structured.regex import ByteDFA

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


@dataclasses.dataclass(frozen=True, eq=False)
class VocabTrie:
    """The vocabulary's token texts as a trie of bytes (regex-independent: built once per
    vocabulary). Nodes are numbered level by level, children of a node contiguous and sorted by
    byte, node 0 the root (the empty prefix).

    child_start: i32[N + 1] node u's children are ``child_start[u] .. child_start[u + 1] - 1``;
    byte: u8[N] the byte leading into each node; token_start: i32[N + 1] and token_ids: i32[T] the
    tokens whose text ends at each node (``token_start[u] .. token_start[u + 1] - 1`` into
    ``token_ids``)."""

    child_start: np.ndarray
    byte: np.ndarray
    token_start: np.ndarray
    token_ids: np.ndarray
    depth: int


def vocab_trie(token_bytes, vocab_size: int) -> VocabTrie:
    """The trie of the non-empty texts of ids ``0 .. vocab_size - 1``."""
    texts = [(b, i) for i, b in enumerate(token_bytes[:vocab_size]) if b]
    depth = max((len(b) for b, _ in texts), default=0)
    prefixes = [set() for _ in range(depth + 1)]
    for b, _ in texts:
        for n in range(1, len(b) + 1):
            prefixes[n].add(b[:n])
    number = {b"": 0}
    parents, bytes_ = [-1], [0]
    for n in range(1, depth + 1):  # level n sorted by (parent's number, last byte): children contiguous
        for p in sorted(prefixes[n], key=lambda x: (number[x[:-1]], x[-1])):
            number[p] = len(parents)
            parents.append(number[p[:-1]])
            bytes_.append(p[-1])
    N = len(parents)
    counts = np.bincount(np.asarray(parents[1:], np.int64), minlength=N)
    child_start = np.concatenate([[1], 1 + np.cumsum(counts)]).astype(np.int32)
    nodes = np.asarray([number[b] for b, _ in texts], np.int64)
    ids = np.asarray([i for _, i in texts], np.int32)
    order = np.argsort(nodes, kind="stable")
    token_start = np.searchsorted(nodes[order], np.arange(N + 1)).astype(np.int32)
    return VocabTrie(child_start=child_start, byte=np.asarray(bytes_, np.uint8), token_start=token_start,
                     token_ids=ids[order], depth=depth)


_TRIES: collections.OrderedDict = collections.OrderedDict()


def _trie_for(token_bytes, vocab_size: int) -> VocabTrie:
    key = (vocab_size, len(token_bytes), hash(token_bytes))
    if key not in _TRIES:
        _TRIES[key] = vocab_trie(token_bytes, vocab_size)
        while len(_TRIES) > 4:
            _TRIES.popitem(last=False)
    return _TRIES[key]


def token_transitions(dfa: np.ndarray, trie: VocabTrie, starts: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (start state, token, end state) whose token's bytes stay alive from the start state:
    a walk down the trie from every state at once (or from ``starts`` i32[Q']), level by level,
    carrying only the (trie node, start state) pairs still alive (most tokens die on their first
    bytes in most states). dfa: i32[Q + 1, 256] with dead = Q. Returns (q, t, s), each i32[E]."""
    start = np.arange(dfa.shape[0] - 1, dtype=np.int32) if starts is None else np.asarray(starts, np.int32)
    Q = dfa.shape[0] - 1
    node = np.zeros(len(start), np.int32)
    cur = start.copy()
    out_q, out_t, out_s = [], [], []
    for _ in range(trie.depth):
        lo = trie.child_start[node]
        count = trie.child_start[node + 1] - lo
        # Each pair repeated once per child of its node; a node's children are contiguous.
        child = np.repeat(lo - (np.cumsum(count) - count), count) + np.arange(int(count.sum()), dtype=np.int32)
        nxt = dfa[np.repeat(cur, count), trie.byte[child]]
        alive = nxt < Q
        node, start, cur = child[alive], np.repeat(start, count)[alive], nxt[alive]
        first = trie.token_start[node]
        ntok = trie.token_start[node + 1] - first
        if ntok.any():
            tok = np.repeat(first - (np.cumsum(ntok) - ntok), ntok) + np.arange(int(ntok.sum()), dtype=np.int32)
            out_q.append(np.repeat(start, ntok))
            out_t.append(trie.token_ids[tok])
            out_s.append(np.repeat(cur, ntok))
        if not len(node):
            break
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)  # noqa: E731
    return cat(out_q), cat(out_t), cat(out_s)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A 64-bit mix of each value (two multiply-xorshift rounds)."""
    z = (x.astype(np.uint64) + np.uint64(salt)) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(29))


def _first_token_moves(dfa: np.ndarray, initial: int, token_bytes, first_bytes, vocab_size: int,
                       q: np.ndarray, t: np.ndarray, s: np.ndarray):
    """The moves of a start state of its own, numbered Q (the byte DFA's dead index, free in
    ``q``, ``t``, ``s``), for a tokenizer whose decoder writes the first token of a text as
    ``first_bytes`` (SentencePiece: without its leading space): the initial state's moves for the
    tokens written alike, the first-token texts' moves from the initial state for the others."""
    Q = dfa.shape[0] - 1
    differ = np.zeros(vocab_size, bool)
    differ[[i for i in range(min(vocab_size, len(first_bytes))) if first_bytes[i] != token_bytes[i]]] = True
    same = (q == initial) & ~differ[t]
    own = tuple(b if differ[i] else None for i, b in enumerate(first_bytes[:vocab_size]))
    _, t1, s1 = token_transitions(dfa, _trie_for(own, vocab_size), np.asarray([initial]))
    t1, s1 = np.concatenate([t[same], t1]), np.concatenate([s[same], s1])
    return np.concatenate([q, np.full(len(t1), Q, np.int32)]), np.concatenate([t, t1]), np.concatenate([s, s1])


def compile_automaton(byte_dfa: ByteDFA, token_bytes, vocab_size: int, *, first_bytes=None,
                      what: str = "constraint") -> Automaton:
    """The token-level automaton of a byte-level DFA over a vocabulary of ``vocab_size`` ids whose
    texts are ``token_bytes`` (None: a token never generated under a constraint). ``first_bytes``:
    the texts of a text's first token where the decoder writes them otherwise
    (``Tokenizer.first_token_bytes``; the automaton then starts in a state of its own). Raises
    ValueError (naming ``what``) when no string of the language can be spelled with the vocabulary."""
    t0 = time.perf_counter()
    dfa, byte_final, byte_initial = byte_dfa.table, byte_dfa.final, byte_dfa.initial
    Q = dfa.shape[0] - 1
    V = vocab_size
    q, t, s = token_transitions(dfa, _trie_for(token_bytes, V))
    if first_bytes is not None:  # state Q: the start, before the first token
        q, t, s = _first_token_moves(dfa, byte_initial, token_bytes, first_bytes, V, q, t, s)
        byte_final, byte_initial, Q = np.append(byte_final, byte_final[byte_initial]), Q, Q + 1
    # States from which the vocabulary can reach a final state (backwards from the finals).
    edges = np.unique(q.astype(np.int64) * (Q + 1) + s)
    predecessors = collections.defaultdict(list)
    for a, b in zip((edges // (Q + 1)).tolist(), (edges % (Q + 1)).tolist()):
        predecessors[b].append(a)
    live = byte_final.copy()
    todo = list(np.flatnonzero(live))
    while todo:
        for a in predecessors[todo.pop()]:
            if not live[a]:
                live[a] = True
                todo.append(a)
    if not live[byte_initial]:
        raise ValueError(f"{what}: no string of its language can be spelled with this model's vocabulary")
    keep = live[q] & live[s]  # a token leading where nothing can finish is not allowed
    q, t, s = q[keep], t[keep], s[keep]
    number = np.full(Q, -1, np.int32)
    number[np.flatnonzero(live)] = np.arange(int(live.sum()), dtype=np.int32)
    q, s = number[q], number[s]
    S = int(live.sum())
    # Token classes: tokens with the same (state -> state) moves everywhere (a 128-bit hash of each
    # token's set of moves; tokens with none share the class nothing allows).
    h1, h2 = np.zeros(V, np.uint64), np.zeros(V, np.uint64)
    pair = q.astype(np.int64) * (S + 1) + s
    np.add.at(h1, t, _mix(pair, 0x9E3779B97F4A7C15))
    np.add.at(h2, t, _mix(pair, 0xC2B2AE3D27D4EB4F))
    _, reps, token_class = np.unique(np.stack([h1, h2], axis=1), axis=0, return_index=True, return_inverse=True)
    token_class = token_class.reshape(-1).astype(np.int32)
    table = np.full((S, len(reps)), -1, np.int32)
    is_rep = reps[token_class[t]] == t
    table[q[is_rep], token_class[t[is_rep]]] = s[is_rep]
    return Automaton(next_state=table, token_class=token_class, final=byte_final[live],
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


def _joint_classes(automata: list[Automaton], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(a token of each joint class, each token's joint class i32[V]): tokens every automaton
    treats alike share a class."""
    if not automata:
        return np.zeros(1, np.int64), np.zeros(vocab_size, np.int32)
    classes = np.stack([a.token_class for a in automata])  # [A, V]
    _, first, joint = np.unique(classes.T, axis=0, return_index=True, return_inverse=True)
    return first, joint.reshape(-1).astype(np.int32)


def _padded_shape(automata: list[Automaton], num_classes: int) -> tuple[int, int]:
    return _pow2(2 + sum(a.num_states for a in automata), MIN_STATES), _pow2(num_classes + 1, MIN_CLASSES)


def table_cells(automata: list[Automaton], vocab_size: int) -> int:
    """Cells of the table ``join_automata`` would build (states x classes, padded), without it."""
    S_pad, C_pad = _padded_shape(automata, len(_joint_classes(automata, vocab_size)[0]))
    return S_pad * C_pad


def join_automata(automata: list[Automaton], vocab_size: int) -> GrammarSet:
    """One table for ``automata`` (all over the same vocabulary of ``vocab_size``)."""
    first, joint = _joint_classes(automata, vocab_size)
    C = len(first)
    S_pad, C_pad = _padded_shape(automata, C)
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
