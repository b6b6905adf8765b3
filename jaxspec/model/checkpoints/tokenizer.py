"""Tokenizers from ``tokenizer.json`` through the HF ``tokenizers`` library."""

from __future__ import annotations

import functools
import json
import os
import re

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from jaxspec.model.checkpoints.chat_template import read_chat_templates, read_special_tokens, render_chat, select_template
from jaxspec.model.checkpoints.checkpoint import read_eos_ids, read_json


class Tokenizer:
    """A thin wrapper: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, eos ids, and the
    checkpoint's chat template(s) with the special tokens it renders with."""

    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: tuple[int, ...] = (),
                 chat_template: str | dict[str, str] | None = None, special_tokens: dict[str, str] | None = None):
        self._tok = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def token_bytes(self) -> tuple[bytes | None, ...]:
        """Each token id's text as bytes, as the tokenizer's decoder writes that token inside a
        sequence (a byte-level token's bytes, a SentencePiece piece with its space marker as a space
        and ``<0xNN>`` byte-fallback pieces as that byte where a ByteFallback decoder makes them
        one); None for special tokens. What structured output matches the generated text against
        (``jaxspec.structured``; a text's first token: ``first_token_bytes``).

        Raises:
          ValueError: a decoder whose per-token text is not defined here (WordPiece, CTC, ...).
        """
        return vocabulary_bytes(self._tok)

    @functools.cached_property
    def first_token_bytes(self) -> tuple[bytes | None, ...] | None:
        """Each token id's text as the decoder writes it as the FIRST token of a text, where that
        differs from ``token_bytes`` (None: it never does). SentencePiece decoders drop the space
        marker that starts a text: a ``Strip`` decoder after ``Fuse`` (Llama 2, Mistral) removes its
        leading spaces, a ``Metaspace`` decoder with a prepend scheme every marker of the first token.
        Structured output matches this text for a request's first generated token, so the matched
        text is the decoded output (``jaxspec.structured``)."""
        return vocabulary_bytes(self._tok, first=True)

    def decode_stream(self) -> "TextStream":
        """An incremental decoder of this tokenizer's ids (special tokens skipped)."""
        return TextStream(self._tok)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, tools=None, documents=None, **kwargs):
        """The conversation rendered with the checkpoint's template (text), or its token ids
        (``tokenize=True``: the text tokenized without adding special tokens, as HF does)."""
        template = select_template(self.chat_template, chat_template, tools)
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, tools=tools, documents=documents, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class TextStream:
    """Text of a growing token sequence, decoded incrementally (``tokenizers``' ``DecodeStream``,
    special tokens skipped): ``step(id)`` returns the new text, or "" while a character is
    incomplete (a multi-byte character split over tokens)."""

    def __init__(self, tokenizer: _HFTokenizer):
        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, int(token_id)) or ""


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoders(decoder: dict | None) -> list[dict]:
    """A decoder's steps in order (a ``Sequence`` flattened)."""
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _decoders(sub)]
    return [decoder]


def _first_token_rule(steps: list[dict]):
    """What the decoder does to the first token of a text beyond what it does to every token:
    ("strip", n) remove up to n leading spaces, ("markers", marker) remove every space marker, or
    None. Raises ValueError for a ``Strip`` jaxspec cannot give a per-token meaning."""
    kinds = [d.get("type") for d in steps]
    for i, d in enumerate(steps):
        if d.get("type") == "Strip":
            if d.get("content") != " " or d.get("stop", 0) != 0 or "Fuse" not in kinds[:i]:
                raise ValueError(f"the tokenizer's Strip decoder ({d}) is not supported by structured output: only "
                                 f"leading spaces stripped from the whole text (after a Fuse decoder)")
            return ("strip", int(d.get("start", 0))) if d.get("start", 0) else None
        if d.get("type") == "Metaspace":  # older files: add_prefix_space instead of prepend_scheme
            scheme = d.get("prepend_scheme", "always" if d.get("add_prefix_space", True) else "never")
            if scheme != "never":
                return ("markers", d.get("replacement", "\u2581"))
    return None


def vocabulary_bytes(tok: _HFTokenizer, first: bool = False) -> tuple[bytes | None, ...] | None:
    """``Tokenizer.token_bytes`` of a ``tokenizers.Tokenizer``; ``first``: its ``first_token_bytes``
    (None where the decoder writes a first token as any other)."""
    spec = json.loads(tok.to_str())
    steps = _decoders(spec.get("decoder"))
    kinds = {d.get("type") for d in steps}
    unsupported = kinds - {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    if unsupported:
        raise ValueError(f"the tokenizer's decoder ({sorted(unsupported)[0]}) does not give each token a text of "
                         f"its own; structured output supports byte-level BPE and SentencePiece tokenizers")
    rule = _first_token_rule(steps)
    if first and rule is None:
        return None
    byte_level = "ByteLevel" in kinds
    alphabet = _byte_level_alphabet() if byte_level else None
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"]: t["content"] for t in spec.get("added_tokens", [])}
    out: list[bytes | None] = [None] * tok.get_vocab_size(with_added_tokens=True)
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if i in added:  # added tokens hold their text as written (not in the byte-level alphabet)
            out[i] = added[i].encode()
        elif byte_level:
            try:
                out[i] = bytes(alphabet[c] for c in text)
            except KeyError:
                out[i] = None  # not a byte-level token: never generated under a constraint
        else:
            m = _BYTE_FALLBACK.fullmatch(text) if "ByteFallback" in kinds else None
            if m:
                out[i] = bytes([int(m.group(1), 16)])
            elif first and rule[0] == "markers":  # the first token loses every marker, not just a leading one
                out[i] = text.replace(rule[1], "").encode()
            else:
                out[i] = text.replace("\u2581", " ").encode()
        if first and rule[0] == "strip" and out[i] is not None:
            b = out[i]
            out[i] = b[min(rule[1], len(b) - len(b.lstrip(b" "))):]
    return tuple(out)


def load_tokenizer(path: str) -> Tokenizer:
    """Loads ``tokenizer.json`` from a checkpoint directory (or the file itself).

    eos ids come from the directory's config.json / generation_config.json when present,
    else from tokenizer_config.json's ``eos_token``. The chat template(s) and the special tokens
    they render with are read as HF reads them (``jaxspec.model.checkpoints.chat_template``).
    """
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"missing file: {file} (jaxspec reads tokenizer.json)")
    tok = _HFTokenizer.from_file(file)
    directory = os.path.dirname(file)
    eos: tuple[int, ...] = ()
    cfg_path = os.path.join(directory, "config.json")
    if os.path.exists(cfg_path):
        eos = read_eos_ids(directory, read_json(cfg_path))
    tcfg = os.path.join(directory, "tokenizer_config.json")
    special = read_special_tokens(directory)
    if not eos and os.path.exists(tcfg):
        name = special.get("eos_token")
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            eos = (tok.token_to_id(name),)
    return Tokenizer(tok, eos, chat_template=read_chat_templates(directory), special_tokens=special)


def apply_chat_template(target, messages, *, add_generation_prompt: bool = True, tokenize: bool = False,
                        chat_template: str | None = None, tools=None, documents=None, **kwargs):
    """Renders a conversation (a list of ``{"role", "content"}`` dicts) with the checkpoint's own chat
    template, exactly as HF ``transformers``' ``apply_chat_template`` renders it.

    Args:
      target: a model from ``load_model`` (its tokenizer's template) or a ``Tokenizer``.
      messages: the conversation.
      add_generation_prompt: end with the header of the assistant's turn (the template decides
        what that is). Default True: the rendered chat is a prompt to generate the reply from.
      tokenize: return token ids (the text tokenized without adding special tokens, as HF does:
        special-token text written by the template becomes its id) instead of text.
      chat_template: the name of one of the checkpoint's templates, or a template string.
      tools, documents, kwargs: passed to the template as HF passes them.

    Raises:
      ValueError: no template, a malformed conversation, or the template's own ``raise_exception``.
    """
    tokenizer = target if isinstance(target, Tokenizer) else getattr(target, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("the target has no tokenizer (no tokenizer.json next to its weights), so no chat template")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                                         chat_template=chat_template, tools=tools, documents=documents, **kwargs)
