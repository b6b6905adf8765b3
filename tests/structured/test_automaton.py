"""Regexes and their token-level automata against plain Python.

- Python regexes, compiled to DFAs over bytes and to token automata over a vocabulary of single
  bytes, accept exactly what ``re.fullmatch`` accepts, and allow exactly the continuations the
  ``regex`` module's partial matching allows, on every prefix of many strings;
- over the demo tokenizer's real 4096-token vocabulary, the tokens allowed after a text are exactly
  those whose text keeps it a partial match (``regex`` partial matching over the whole vocabulary),
  and the text is final exactly when it fully matches;
- what a DFA cannot express, and languages the vocabulary cannot spell, are refused by name.
"""

from __future__ import annotations

import functools
import itertools
import random
import re

import numpy as np
import pytest
import regex

from jaxspec.demo import DEMO_TARGET
from jaxspec.model.checkpoints.tokenizer import load_tokenizer
from jaxspec.structured import compile_constraint
from jaxspec.structured.automaton import compile_automaton, join_automata
from jaxspec.structured.regex import compile_dfa
from tests.structured.vocab import oracle_allowed, oracle_final, token_texts

BYTES = tuple(bytes([b]) for b in range(256))  # token id b is byte b


@functools.cache
def byte_automaton(pattern: str):
    return compile_automaton(compile_dfa(pattern), BYTES, 256)


def accepts(automaton, text: str) -> tuple[bool, int]:
    s = automaton.walk(text.encode())
    return s >= 0 and bool(automaton.final[s]), s


# The same languages with greedy quantifiers, for the partial-match oracle (the ``regex`` module's
# partial matching errs on lazy ones: it calls "xxz" a partial match of "x*?y+?z??").
GREEDY = {r"x*?y+?z??": r"x*y+z?"}


# (pattern, alphabet of the random strings tried)
PATTERNS = [
    (r"[a-c]+x?", "abcx"),
    (r"(ab|cd){2,3}", "abcd"),
    (r"a(bc)?", "abc"),  # outlines-core 0.2.14's Index drops the continuation after a possible end
    (r"(ab)+", "ab"),
    (r"\d{3}-\d{2}", "0129-"),
    (r"(?i)hello", "hHeElLoO"),
    (r"[^0-9]{1,4}", "a1 \n"),
    (r"a.b", "ab\n."),
    (r"(?s)a.b", "ab\n"),
    (r"x*?y+?z??", "xyz"),
    (r"^abc$", "abc"),
    (r"\Aab\Z", "ab"),
    (r"a|b|", "ab"),
    (r"[-+]?[0-9]*\.?[0-9]+", "-+0.9"),
    (r"(?a)\w+", "a_9-é"),
    (r"\w\s\W", "a _ !é"),
    (r"[.*+?{}()|\[\]\\^$-]+", ".*+?{}()|[]\\^$-a"),
    (r"(?P<word>[ab]{2})-(?:c|d){1,}", "abcd-"),
    (r"é+", "é e"),
    (r"[^\w\s]", "a !é"),
]


@pytest.mark.parametrize("pattern,alphabet", PATTERNS, ids=[p for p, _ in PATTERNS])
def test_rewritten_regex_matches_as_python_does(pattern, alphabet):
    auto = byte_automaton(pattern)
    rng = random.Random(0)
    strings = {"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7))) for _ in range(300)}
    strings |= {"".join(p) for n in range(4) for p in itertools.product(alphabet[:4], repeat=n)}
    checked = 0
    for text in sorted(strings):
        full, state = accepts(auto, text)
        assert full == (re.fullmatch(pattern, text) is not None), (pattern, text)
        partial = regex.fullmatch(GREEDY.get(pattern, pattern), text, partial=True) is not None
        assert (state >= 0) == partial, (pattern, text)
        checked += 1
    assert checked > 50


REFUSED = [
    ("(?=a)a", "lookahead"),
    ("b(?<=b)", "lookbehind"),
    ("(?!a)b", "lookahead"),
    (r"(a)\1", "backreferences"),
    (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"(a)?(?(1)b|c)", "conditional"),
    ("(?>ab)", "atomic"),
    ("a*+", "possessive"),
    (r"\bfoo", "word boundaries"),
    ("a^b", "anchors"),
    ("a$b", "anchors"),
    ("(", "not a valid Python regular expression"),
]


@pytest.mark.parametrize("pattern,name", REFUSED, ids=[p for p, _ in REFUSED])
def test_what_a_dfa_cannot_express_is_refused_by_name(pattern, name):
    with pytest.raises(ValueError, match=re.escape(name)):
        compile_dfa(pattern)


def test_a_language_the_vocabulary_cannot_spell_is_refused():
    digits = tuple(str(d).encode() for d in range(10))  # ten tokens: "0".."9"
    with pytest.raises(ValueError, match="no string of its language can be spelled"):
        compile_automaton(compile_dfa("[a-z]+"), digits, 10, what="regex '[a-z]+'")
    # Reachable only through a state the vocabulary cannot leave: refused too ("a" then never "b").
    with pytest.raises(ValueError, match="no string of its language can be spelled"):
        compile_automaton(compile_dfa("a*b"), (b"a", b"c"), 2)
    # Tokens leading only into such states are not allowed: "a" can never be followed by "b" here.
    auto = compile_automaton(compile_dfa("(ab)?c"), (b"a", b"c"), 2)
    assert auto.allowed(auto.initial).tolist() == [False, True]


# ----------------------------------------------------------------------------- a real vocabulary


@functools.cache
def demo_tokenizer():
    return load_tokenizer(DEMO_TARGET)


DEMO_CASES = [
    # (pattern, texts: prefixes of matches and of non-matches along the way)
    (r"[0-9]{1,3}(, [0-9]{1,3})*", ["", "1", "12", "123", "123,", "123, 4", "9, 87, 654"]),
    (r"(def|class) [a-z_]+\((self)?\):", ["", "de", "def", "def ", "def foo_bar", "def foo(", "class a(self", "class a(self):"]),
    (r'\{"name": "[a-z ]{0,8}", "n": (true|false)\}', ["", '{"', '{"name": "', '{"name": "ab c', '{"name": "abcdefgh', '{"name": "x", "n": t', '{"name": "x", "n": false}']),
]


@pytest.mark.parametrize("pattern,texts", DEMO_CASES, ids=["numbers", "signature", "record"])
def test_allowed_tokens_equal_partial_matching_over_the_whole_vocabulary(pattern, texts):
    tok = demo_tokenizer()
    V = 4096
    auto = compile_constraint(tok, V, "regex", pattern)
    vocab_text = token_texts(tok, V)
    for text in texts:
        state = auto.walk(tok.encode(text, add_special_tokens=False))
        assert state >= 0, text
        want = oracle_allowed(pattern, text, vocab_text)
        got = auto.allowed(state).tolist()
        diff = [vocab_text[i] for i in range(V) if got[i] != want[i]]
        assert not diff, (text, diff[:10])
        assert bool(auto.final[state]) == oracle_final(pattern, text), text
        assert sum(want) > 0 or oracle_final(pattern, text)
    # Classes compress the vocabulary: far fewer columns than tokens.
    assert auto.next_state.shape[1] < V // 20


def test_joined_table_keeps_each_automaton_and_a_free_state():
    tok = demo_tokenizer()
    a = compile_constraint(tok, 4096, "regex", "[0-9]+")
    b = compile_constraint(tok, 4096, "regex", "(yes|no)")
    joined = join_automata([a, b], 4096)
    for which, auto in enumerate([a, b]):
        for text in ["", "1", "12", "y", "ye", "no"]:
            ids = tok.encode(text, add_special_tokens=False)
            local = auto.walk(ids)
            glob = joined.walk(which, ids)
            if local < 0:
                assert glob == 1  # DEAD
                continue
            row = joined.next_state[glob][joined.token_class]
            assert np.array_equal(row >= 0, auto.allowed(local)), (which, text)
            assert joined.final[glob] == auto.final[local]
    free = joined.next_state[0][joined.token_class]
    assert (free == 0).all() and joined.final[0]
    assert joined.next_state.shape[0] & (joined.next_state.shape[0] - 1) == 0  # a power of two: shared compiles
