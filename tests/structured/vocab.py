"""Small real tokenizers for structured-output tests, and the plain-Python oracle of what a regex
allows (the ``regex`` module's partial matching over the whole vocabulary)."""

from __future__ import annotations

import functools

import regex
from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

from jaxspec.model.checkpoints.tokenizer import Tokenizer, _byte_level_alphabet

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


SP_WORDS = ["the", "ab", "is", "ing", "a\u2581b", "\u2581\u2581"]


@functools.cache
def sentencepiece_tokenizer(style: str = "strip") -> Tokenizer:
    """A SentencePiece-style tokenizer (ids 0-2: ``<unk> <s> </s>``, eos 2): byte-fallback pieces,
    the space marker, letters, digits and words with and without a leading marker. ``style``:
    "strip" decodes as Llama 2's ``tokenizer.json`` does (Replace, ByteFallback, Fuse, Strip one
    leading space); "metaspace" with a ``Metaspace`` decoder (prepend scheme "first": the first
    token loses every marker)."""
    mark = "\u2581"
    pieces = ["<0x0A>", "<0xC3>", "<0xA9>", mark, ".", ",", mark + "."]
    pieces += [c for c in "abcdefghijklmnopqrstuvwxyz0123456789"] + [mark + c for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += SP_WORDS + [mark + w for w in SP_WORDS[:4]]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for p in pieces:
        vocab[p] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    if style == "strip":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(mark), normalizers.Replace(" ", mark)])
        tok.decoder = decoders.Sequence([decoders.Replace(mark, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(tok, eos_token_ids=(2,))


def oracle_allowed(pattern: str, text: str, token_texts: list[str | None]) -> list[bool]:
    """Per token: the text stays a prefix of some full match of ``pattern`` (Python syntax) once the
    token's text is appended (None: a token with no text, never allowed)."""
    compiled = regex.compile(pattern)
    return [t is not None and t != "" and compiled.fullmatch(text + t, partial=True) is not None
            for t in token_texts]


def oracle_final(pattern: str, text: str) -> bool:
    return regex.fullmatch(pattern, text) is not None


def token_texts(tokenizer: Tokenizer, vocab_size: int, first: bool = False) -> list[str | None]:
    """Each id's text (None: special, or bytes that are not UTF-8 on their own); ``first``: as the
    first token of a text (``Tokenizer.first_token_bytes``)."""
    texts = (first and tokenizer.first_token_bytes) or tokenizer.token_bytes
    out = []
    for b in texts[:vocab_size] + (None,) * max(0, vocab_size - len(texts)):
        try:
            out.append(None if b is None else b.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
    return out
