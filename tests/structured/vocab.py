"""Small real tokenizers for structured-output tests, and the plain-Python oracle of what a regex
allows (the ``regex`` module's partial matching over the whole vocabulary)."""

from __future__ import annotations

import functools

import regex
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from jaxspec.model.io.tokenizer import Tokenizer, _byte_level_alphabet

# Printable ASCII: single characters first (space included), then a few multi-character tokens.
CHARS = [chr(c) for c in range(0x20, 0x7F)]
WORDS = ["ab", "ba", "the", "12", "345", "00", ", ", ": ", '{"', '"}', "true", "null", "ing", "  "]


@functools.cache
def char_tokenizer(vocab_size: int, with_words: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` ids: id 0 the special ``<eos>``, then printable
    ASCII characters and (``with_words``) some multi-character tokens, as many as fit."""
    to_char = {b: c for c, b in _byte_level_alphabet().items()}
    pieces = CHARS + (WORDS if with_words else [])
    vocab = {"<eos>": 0}
    for p in pieces[: vocab_size - 1]:
        vocab["".join(to_char[b] for b in p.encode())] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return Tokenizer(tok, eos_token_ids=(0,))


def oracle_allowed(pattern: str, text: str, token_texts: list[str | None]) -> list[bool]:
    """Per token: the text stays a prefix of some full match of ``pattern`` (Python syntax) once the
    token's text is appended (None: a token with no text, never allowed)."""
    compiled = regex.compile(pattern)
    return [t is not None and t != "" and compiled.fullmatch(text + t, partial=True) is not None
            for t in token_texts]


def oracle_final(pattern: str, text: str) -> bool:
    return regex.fullmatch(pattern, text) is not None


def token_texts(tokenizer: Tokenizer, vocab_size: int) -> list[str | None]:
    """Each id's text (None: special, or bytes that are not UTF-8 on their own)."""
    out = []
    for b in tokenizer.token_bytes[:vocab_size] + (None,) * max(0, vocab_size - len(tokenizer.token_bytes)):
        try:
            out.append(None if b is None else b.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
    return out
