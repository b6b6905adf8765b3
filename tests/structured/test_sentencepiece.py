"""Structured output with SentencePiece-style tokenizers: the matched text is the decoded output.

Their decoders write the space marker as a space inside a text but drop it at the start of one
(Llama 2's ``Strip`` after ``Fuse``; a ``Metaspace`` decoder's prepend scheme), so a request's first
generated token is matched as the decoder writes a first token (``Tokenizer.first_token_bytes``):

- for random token sequences, the first token's first-token text followed by the others' texts is
  exactly what the HF decoder writes, for both decoder styles;
- the automaton allows, before the first token, exactly the tokens whose first-token text starts a
  match (``regex`` partial matching), and the in-text texts after it;
- on a tiny golden target, a constrained request whose first token is a marked word ("▁the") decodes
  to a text that matches the regex, with and without speculation.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders

import jaxspec as js
from jaxspec.model.checkpoints.tokenizer import Tokenizer
from jaxspec.structured import compile_constraint
from tests.model.drafts import test_golden_heads
from tests.structured.vocab import oracle_allowed, oracle_final, sentencepiece_tokenizer, token_texts

STYLES = ["strip", "metaspace"]
SENTENCE = r"[a-z]{1,5}( [a-z]{1,5}){0,3}\."


@pytest.mark.parametrize("style", STYLES)
def test_first_token_text_then_token_texts_is_the_decoded_text(style):
    tok = sentencepiece_tokenizer(style)
    first, rest = tok.first_token_bytes, tok.token_bytes
    assert first is not None and first != rest
    ids = [i for i, b in enumerate(rest) if b is not None and b.isascii()]
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.choice(ids) for _ in range(rng.randint(1, 5))]
        matched = first[seq[0]] + b"".join(rest[i] for i in seq[1:])
        assert matched.decode() == tok.decode(seq), [tok._tok.id_to_token(i) for i in seq]


@pytest.mark.parametrize("style", STYLES)
def test_first_token_is_matched_as_the_decoder_writes_it(style):
    tok = sentencepiece_tokenizer(style)
    V = tok.vocab_size
    auto = compile_constraint(tok, V, "regex", SENTENCE)
    mark = tok.token_to_id("\u2581the")
    for prefix in ([], [tok.token_to_id("the")], [mark], [mark, tok.token_to_id("\u2581ab")]):
        text = (tok.first_token_bytes[prefix[0]] + b"".join(tok.token_bytes[i] for i in prefix[1:])).decode() \
            if prefix else ""
        texts = token_texts(tok, V, first=not prefix)
        state = auto.walk(prefix)
        assert state >= 0, text
        assert list(auto.allowed(state)) == oracle_allowed(SENTENCE, text, texts), text
        assert bool(auto.final[state]) == oracle_final(SENTENCE, text)
    assert auto.allowed(auto.initial)[mark]  # "▁the" starts the text as "the"
    after = auto.allowed(auto.walk([mark]))  # then "▁the" is " the", and "the" would make "thethe"
    assert after[mark] and not after[tok.token_to_id("the")]


def test_a_strip_that_is_not_after_fuse_is_refused():
    tok = HFTokenizer.from_str(sentencepiece_tokenizer("strip")._tok.to_str())  # a copy
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])  # strips every token
    with pytest.raises(ValueError, match=r"Strip decoder .* \(after a Fuse decoder\)"):
        Tokenizer(tok, eos_token_ids=(2,)).token_bytes


@functools.cache
def sp_target(style: str):
    base = test_golden_heads.target("llama3")
    return dataclasses.replace(base, tokenizer=sentencepiece_tokenizer(style), eos_token_ids=(2,))


@pytest.mark.parametrize("style", STYLES)
def test_generated_text_matches_when_the_first_token_is_a_marked_word(style):
    target = sp_target(style)
    the = target.tokenizer.token_to_id("\u2581the")
    # The bias (applied after the mask) makes "▁the" the first token wherever the mask allows it.
    sampling = [js.SamplingParams(max_new_tokens=16, regex=SENTENCE, logit_bias={the: 30.0}),
                js.SamplingParams(max_new_tokens=16, regex=SENTENCE)]
    prompts = [[40, 41, 42, 43], [50, 60, 61]]
    engine = js.EngineConfig(page_size=16, max_batch=2, max_seq_len=64, steps_per_call=4)
    plain = js.generate(target, prompts, sampling=sampling, engine=engine, progress=False)
    spec = js.generate(target, prompts, sampling=sampling, engine=engine, draft=js.NgramDraft(max_ngram=3),
                       spec=js.SpecConfig.chain(3), progress=False)
    assert spec.token_ids == plain.token_ids
    assert plain.token_ids[0][0] == the and plain.texts[0].startswith("the")
    for text, stats in zip(plain.texts, plain.stats):
        assert stats.finish_reason == "stop" and re.fullmatch(SENTENCE, text), text
