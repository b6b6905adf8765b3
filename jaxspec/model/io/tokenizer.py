"""Tokenizers from ``tokenizer.json`` through the HF ``tokenizers`` library."""

from __future__ import annotations

import os

from tokenizers import Tokenizer as _HFTokenizer

from jaxspec.model.io.checkpoint import read_eos_ids, read_json


class Tokenizer:
    """A thin wrapper: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, eos ids."""

    def __init__(self, tokenizer: _HFTokenizer, eos_token_ids: tuple[int, ...] = ()):
        self._tok = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def load_tokenizer(path: str) -> Tokenizer:
    """Loads ``tokenizer.json`` from a checkpoint directory (or the file itself).

    eos ids come from the directory's config.json / generation_config.json when present,
    else from tokenizer_config.json's ``eos_token``.
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
    if not eos and os.path.exists(tcfg):
        name = read_json(tcfg).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            eos = (tok.token_to_id(name),)
    return Tokenizer(tok, eos)
