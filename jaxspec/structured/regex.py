"""Python regular expressions -> deterministic automata over bytes.

Patterns are parsed by Python's own parser (``re``), so a pattern means what it means in Python;
the parse tree becomes a Thompson NFA over UTF-8 bytes (character sets through
``jaxspec.structured.charsets``), then a DFA by subset construction. The language is exact: a
string is accepted iff ``re.fullmatch`` accepts it (the whole output must match; a leading ``^`` /
``\\A`` and a trailing ``$`` / ``\\Z`` are accepted and mean nothing more). What a DFA cannot express
(lookarounds, backreferences, conditionals, atomic groups, possessive quantifiers, word boundaries,
anchors anywhere but at the very start or end) is refused by name.

(The automaton is built here rather than by ``outlines-core``'s ``Index``: the released 0.2.14 drops
every transition out of a state where a match could already end, e.g. ``a(bc)?`` never continues
after ``a``; the fix is unreleased. ``outlines-core`` still turns JSON schemas into regexes.)

*Splices*: a character of the private-use plane 15 (U+F0000 + i) standing alone in the pattern is
replaced by another parsed pattern (``splices[i]``), optionally in JSON-string mode, where every character the pattern allows appears as JSON
writes it inside a string (``"`` as ``\\"``, ``\\`` as ``\\\\``, controls as ``\\n`` / ``\\t`` /
..., others among U+0000..U+001F never). JSON schemas use them for their ``pattern``s and numeric
bounds.

Glossary: Q DFA states (plus one dead state, index Q).
"""

from __future__ import annotations

import dataclasses
import re
import re._constants as C  # the opcodes of Python's own regex parser
import re._parser as sre_parse

import numpy as np

from jaxspec.structured import charsets as cs

_REFUSED = {
    C.ASSERT: "lookahead / lookbehind assertions ((?=...), (?!...), (?<=...), (?<!...))",
    C.ASSERT_NOT: "lookahead / lookbehind assertions ((?=...), (?!...), (?<=...), (?<!...))",
    C.GROUPREF: "backreferences (\\1, (?P=name))",
    C.GROUPREF_EXISTS: "conditional groups ((?(1)...|...))",
    C.ATOMIC_GROUP: "atomic groups ((?>...))",
    C.POSSESSIVE_REPEAT: "possessive quantifiers (*+, ++, ?+, {m,n}+)",
}
_START = (C.AT_BEGINNING, C.AT_BEGINNING_STRING)
_END = (C.AT_END, C.AT_END_STRING)
_CATEGORIES = {
    C.CATEGORY_DIGIT: ("digit", False), C.CATEGORY_NOT_DIGIT: ("digit", True),
    C.CATEGORY_WORD: ("word", False), C.CATEGORY_NOT_WORD: ("word", True),
    C.CATEGORY_SPACE: ("space", False), C.CATEGORY_NOT_SPACE: ("space", True),
}
# JSON writes these inside a string as two-character escapes; other control characters only as
# \u00XX, which is not generated (they are simply not allowed in JSON-string mode).
_JSON_ESCAPES = {0x22: b'\\"', 0x5C: b"\\\\", 0x0A: b"\\n", 0x09: b"\\t", 0x0D: b"\\r", 0x08: b"\\b", 0x0C: b"\\f"}
_JSON_SPECIAL: cs.Charset = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))

MAX_DFA_STATES = 20_000


SPLICE_BASE = 0xF0000  # splice i stands in the pattern as the character U+F0000 + i


@dataclasses.dataclass(frozen=True)
class Splice:
    """A pattern put in place of its marker character: ``pattern`` (Python syntax) with ``flags``, in
    JSON-string mode or not."""

    pattern: str
    json_string: bool = False
    flags: int = 0


@dataclasses.dataclass(frozen=True)
class ByteDFA:
    """table: i32[Q + 1, 256] the state after a byte (row and value Q: dead); final: bool[Q];
    initial: the start state."""

    table: np.ndarray
    final: np.ndarray
    initial: int

    @property
    def num_states(self) -> int:
        return self.final.shape[0]

    def accepts(self, data: bytes) -> bool:
        s = self.initial
        for b in data:
            s = self.table[s, b]
        return s < self.num_states and bool(self.final[s])


def parse(pattern: str, flags: int = 0):
    """Python's parse of ``pattern``, or a ValueError naming why it is not a Python regex."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    try:
        parsed = sre_parse.parse(pattern, flags)
    except re.error as e:
        raise ValueError(f"regex {pattern!r} is not a valid Python regular expression: {e}") from None
    if parsed.state.flags & re.LOCALE:
        raise ValueError(f"regex {pattern!r}: the LOCALE flag is not supported")
    return parsed


class _NFA:
    """Thompson NFA over bytes: per node, epsilon successors and (lo, hi, target) byte edges."""

    def __init__(self, pattern: str, splices: dict[int, Splice]):
        self.pattern = pattern
        self.splices = splices
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def node(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def refuse(self, what: str):
        raise ValueError(f"regex {self.pattern!r}: {what} cannot be expressed by a finite automaton and are not "
                         f"supported")

    # -------------------------------------------------------------- pieces -> (start, end)

    def byte_string(self, data: bytes):
        start = end = self.node()
        for b in data:
            nxt = self.node()
            self.edges[end].append((b, b, nxt))
            end = nxt
        return start, end

    def charset(self, chars: cs.Charset, json_string: bool):
        start, end = self.node(), self.node()
        if json_string:  # special characters as their JSON escapes, the rest raw
            for cp, esc in _JSON_ESCAPES.items():
                if cs.contains(chars, cp):
                    s, e = self.byte_string(esc)
                    self.eps[start].append(s)
                    self.eps[e].append(end)
            chars = cs.minus(chars, _JSON_SPECIAL)
        for seq in cs.utf8_sequences(chars):
            cur = start
            for i, (lo, hi) in enumerate(seq):
                nxt = end if i == len(seq) - 1 else self.node()
                self.edges[cur].append((lo, hi, nxt))
                cur = nxt
        return start, end

    def seq(self, items, ctx, at_start: bool, at_end: bool):
        start = end = self.node()
        for i, (op, av) in enumerate(items):
            s, e = self.item(op, av, ctx, at_start and i == 0, at_end and i == len(items) - 1)
            self.eps[end].append(s)
            end = e
        return start, end

    def item(self, op, av, ctx, first: bool, last: bool):
        flags, json_string = ctx
        if op in _REFUSED:
            self.refuse(_REFUSED[op])
        if op is C.AT:
            if (av in _START and first) or (av in _END and last):
                n = self.node()
                return n, n
            if av in (C.AT_BOUNDARY, C.AT_NON_BOUNDARY):
                self.refuse("word boundaries (\\b, \\B)")
            raise ValueError(f"regex {self.pattern!r}: anchors (^, $, \\A, \\Z) are only supported at the very start "
                             f"or end of the pattern (the whole output is matched)")
        if op is C.LITERAL:
            if av - SPLICE_BASE in self.splices:
                splice = self.splices[av - SPLICE_BASE]
                parsed = parse(splice.pattern, splice.flags)
                return self.seq(parsed.data, (parsed.state.flags, splice.json_string), True, True)
            return self.charset(self.case(((av, av),), flags), json_string)
        if op is C.NOT_LITERAL:
            return self.charset(cs.complement(self.case(((av, av),), flags)), json_string)
        if op is C.ANY:
            return self.charset(cs.complement(()) if flags & re.DOTALL else cs.complement(((0x0A, 0x0A),)),
                                json_string)
        if op is C.IN:
            return self.charset(self.in_class(av, flags), json_string)
        if op is C.BRANCH:
            start, end = self.node(), self.node()
            for branch in av[1]:
                s, e = self.seq(branch.data, ctx, first, last)
                self.eps[start].append(s)
                self.eps[e].append(end)
            return start, end
        if op is C.SUBPATTERN:
            _, add, remove, sub = av
            return self.seq(sub.data, ((flags | add) & ~remove, json_string), first, last)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # laziness means nothing to a language
            lo, hi, sub = av
            start = end = self.node()
            for _ in range(lo):
                s, e = self.seq(sub.data, ctx, False, False)
                self.eps[end].append(s)
                end = e
            if hi is C.MAXREPEAT:
                s, e = self.seq(sub.data, ctx, False, False)
                self.eps[end].append(s)
                self.eps[e].append(s)  # loop
                tail = self.node()
                self.eps[end].append(tail)
                self.eps[e].append(tail)
                return start, tail
            tail = self.node()
            for _ in range(hi - lo):
                self.eps[end].append(tail)
                s, e = self.seq(sub.data, ctx, False, False)
                self.eps[end].append(s)
                end = e
            self.eps[end].append(tail)
            return start, tail
        raise ValueError(f"regex {self.pattern!r}: the construct {op} is not supported")

    def case(self, chars: cs.Charset, flags: int) -> cs.Charset:
        return cs.ignore_case(chars, bool(flags & re.ASCII)) if flags & re.IGNORECASE else chars

    def in_class(self, items, flags: int) -> cs.Charset:
        negate, parts = False, []
        for op, av in items:
            if op is C.NEGATE:
                negate = True
            elif op is C.LITERAL:
                parts.append(((av, av),))
            elif op is C.RANGE:
                parts.append((av,))
            elif op is C.CATEGORY:
                name, negated = _CATEGORIES[av]
                chars = cs.category(name, bool(flags & re.ASCII))
                parts.append(cs.complement(chars) if negated else chars)
            else:
                raise ValueError(f"regex {self.pattern!r}: the class item {op} is not supported")
        chars = self.case(cs.union(*parts), flags)
        return cs.complement(chars) if negate else chars


def _closure(nfa: _NFA, nodes) -> frozenset:
    seen, todo = set(nodes), list(nodes)
    while todo:
        for n in nfa.eps[todo.pop()]:
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return frozenset(seen)


def compile_dfa(pattern: str, flags: int = 0, splices: dict[int, Splice] | None = None,
                max_states: int = MAX_DFA_STATES) -> ByteDFA:
    """The DFA over bytes of the strings ``re.fullmatch(pattern, s, flags)`` accepts (UTF-8), or a
    ValueError naming what cannot be compiled."""
    parsed = parse(pattern, flags)
    nfa = _NFA(pattern, splices or {})
    start, accept = nfa.seq(parsed.data, (parsed.state.flags, False), True, True)
    # Byte classes: bytes no edge tells apart move together.
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    bounds = sorted(cuts)
    reps = bounds[:-1]  # the first byte of each class
    first = _closure(nfa, [start])
    number = {first: 0}
    order = [first]
    moves: list[list[int]] = []
    i = 0
    while i < len(order):
        current = order[i]
        row = []
        for b in reps:
            targets = [t for n in current for lo, hi, t in nfa.edges[n] if lo <= b <= hi]
            if not targets:
                row.append(-1)
                continue
            nxt = _closure(nfa, targets)
            if nxt not in number:
                if len(order) >= max_states:
                    raise ValueError(f"regex {pattern!r} needs more than {max_states} automaton states "
                                     f"(bounded repetitions that large are not supported)")
                number[nxt] = len(order)
                order.append(nxt)
            row.append(number[nxt])
        moves.append(row)
        i += 1
    Q = len(order)
    classes = np.asarray([[r if r >= 0 else Q for r in row] for row in moves] + [[Q] * len(reps)], np.int32)
    final = np.asarray([accept in s for s in order], bool)
    classes, final, initial = _minimize(classes, final, 0)
    return ByteDFA(table=np.repeat(classes, np.diff(bounds), axis=1), final=final, initial=initial)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    z = (x.astype(np.uint64) + np.uint64(salt)) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(29))


def _minimize(table: np.ndarray, final: np.ndarray, initial: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The minimal DFA (Moore's partition refinement; rows compared by a 128-bit hash of their
    successors' blocks). table: i32[Q + 1, K] over byte classes, row Q the dead state. States
    that cannot reach a final state join the dead one. Returns (table [Q' + 1, K] with dead = Q',
    final [Q'], initial)."""
    Q1, K = table.shape
    is_final = np.append(final, False)
    block = is_final.astype(np.int64)
    count = len(np.unique(block))
    salts = (np.arange(K, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    while True:
        succ = block[table]  # [Q + 1, K]
        h1 = _mix(block, 1) + (_mix(succ, 2) * (salts | np.uint64(1))).sum(axis=1)
        h2 = _mix(block, 3) ^ (_mix(succ, 5) + salts).sum(axis=1)
        _, new = np.unique(np.stack([h1, h2], axis=1), axis=0, return_inverse=True)
        new = new.reshape(-1)
        if new.max() + 1 == count:
            break
        block, count = new, int(new.max()) + 1
    # Renumber: the dead state's block last, the rest in order of first appearance.
    dead = block[Q1 - 1]
    order = [b for b in dict.fromkeys(block.tolist()) if b != dead] + [dead]
    number = np.empty(count, np.int32)
    number[order] = np.arange(count, dtype=np.int32)
    first = np.unique(block, return_index=True)[1]  # a state of each block
    rows = np.empty((count, K), np.int32)
    rows[number[block[first]]] = number[block[table[first]]]
    fin = np.zeros(count, bool)
    fin[number[block[first]]] = is_final[first]
    return rows, fin[:-1], int(number[block[initial]])
