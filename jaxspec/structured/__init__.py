"""Structured output: regular expressions and JSON schemas compiled on the host into token-level
automata that the compiled decode loop follows on device (``jaxspec.sampling.grammar_masks``).

    regex.py       Python regexes -> DFAs over bytes (refusing what a DFA cannot express)
    charsets.py    code point sets, Python's categories and case folding, UTF-8 byte sequences
    schema.py      JSON Schema -> regex (outlines-core), keyword checks, numeric bounds, patterns
    ranges.py      numeric intervals as regular languages
    automaton.py   byte DFA -> token-level automaton over a vocabulary; the automata of a call
                   joined into one device table

``compile_constraints`` is what ``generate()`` calls: one automaton per distinct constraint of a
call, cached by its text and the vocabulary.
"""

from __future__ import annotations

import re

from jaxspec.structured.automaton import Automaton, AutomatonCache, GrammarSet, compile_automaton, join_automata
from jaxspec.structured.regex import ByteDFA, compile_dfa
from jaxspec.structured.schema import schema_regex

__all__ = ["Automaton", "GrammarSet", "build_automaton", "compile_constraint", "compile_constraints",
           "constraint_dfa"]

_CACHE = AutomatonCache()


def constraint_dfa(kind: str, text: str) -> ByteDFA:
    """The byte-level DFA of a constraint: ("regex", Python pattern) or ("json_schema", JSON text)."""
    if kind == "regex":
        return compile_dfa(text)
    regex, splices = schema_regex(text)
    return compile_dfa(regex, re.ASCII, splices)


def build_automaton(token_bytes, first_bytes, vocab_size: int, kind: str, text: str) -> Automaton:
    """The automaton of one constraint over a vocabulary's token bytes (uncached: the work
    ``compile_constraint`` caches, also run in the server's constraint processes)."""
    what = f"{kind} {text!r}" if len(text) < 200 else f"{kind} ({len(text)} characters)"
    return compile_automaton(constraint_dfa(kind, text), token_bytes, vocab_size, first_bytes=first_bytes, what=what)


def compile_constraint(tokenizer, vocab_size: int, kind: str, text: str, build=None) -> Automaton:
    """The automaton of one constraint over ``tokenizer``'s vocabulary (``vocab_size`` ids: the
    model's, which may exceed the tokenizer's), cached. ``build``: how a miss is compiled (default:
    ``build_automaton`` here; the server passes its constraint processes')."""
    token_bytes, first_bytes = tokenizer.token_bytes, tokenizer.first_token_bytes
    key = (kind, text, vocab_size, len(token_bytes), hash(token_bytes), hash(first_bytes))
    return _CACHE.get(key, build or (lambda: build_automaton(token_bytes, first_bytes, vocab_size, kind, text)))


def compile_constraints(tokenizer, vocab_size: int, constraints) -> tuple[GrammarSet | None, list[int | None]]:
    """The call's table and, per request, which of its automata it follows (None: none).
    ``constraints``: per request, None or (kind, text) (``SamplingParams.constraint``). A constraint
    that cannot be compiled raises a ValueError naming the request(s) that carry it (their indices
    in ``constraints``)."""
    requests: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(constraints):
        if c is not None:
            requests.setdefault(c, []).append(i)
    if not requests:
        return None, [None] * len(constraints)
    if tokenizer is None:
        raise ValueError("structured output (regex / json_schema) needs the target's tokenizer (tokenizer.json next "
                         "to its weights): the constraint is on the output text")
    _ = tokenizer.token_bytes  # read first: a tokenizer whose texts cannot be read is no request's fault
    automata = []
    for (kind, text), where in requests.items():
        try:
            automata.append(compile_constraint(tokenizer, vocab_size, kind, text))
        except ValueError as e:
            named = f"request {where[0]}" if len(where) == 1 else f"requests {', '.join(map(str, where))}"
            raise ValueError(f"SamplingParams of {named}: {e}") from None
    which = {c: i for i, c in enumerate(requests)}
    return join_automata(automata, vocab_size), [None if c is None else which[c] for c in constraints]
