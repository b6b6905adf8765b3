"""Prefix caching: full pages of prompt KV kept after their requests end and shared by later
requests whose prompt starts with the same tokens (in the same call, or a later call of the same
``jaxspec.Engine``).

A page is indexed by a hash chain: page j's key covers the tokens of pages 0..j *and the token
after page j*. The target's KV of a page depends only on the tokens up to its end, but a draft's
does not quite: an EAGLE / MTP draft's row p reads the token at p + 1, so the draft rows of a page
(which live in the draft pool's page of the same id) are exact only for requests whose next token
matches too. With that token in the key, every cached page is exact for the target and the draft
alike, and nothing is recomputed at page boundaries; the price is that a prompt reuses only the
pages whose following token it also holds (``cacheable_pages``), and that two prompts differing
only in the token after a page share nothing of it.

Only pages written by a prefill are cached (decode writes the positions past the prompt). The
pages themselves stay in the allocator (``PageAllocator.cache``): held by any number of requests,
or parked with no holder (reclaimable, evicted least recently used first when a grant needs pages,
before any running request is preempted).
"""

from __future__ import annotations

import hashlib

import numpy as np

from jaxspec.engine.allocator import PageAllocator


def cacheable_pages(num_tokens: int, page_size: int) -> int:
    """Full pages of a ``num_tokens``-token context whose following token is in the context, and that
    leave at least one token to prefill (the last token's logits start the output)."""
    return max(0, (num_tokens - 1) // page_size)


def page_keys(tokens, page_size: int, num_pages: int) -> list[bytes]:
    """The hash chain of the first ``num_pages`` pages of ``tokens`` (each key covers the tokens
    before the page, the page's and the one after it)."""
    ids = np.asarray(tokens, np.int64)
    keys, h = [], b""
    for j in range(num_pages):
        h = hashlib.blake2b(h + ids[j * page_size:(j + 1) * page_size + 1].tobytes(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixCache:
    """The index of one allocator's cached pages: key -> page."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.hits = 0  # pages reused
        self.on_forget = None  # called with the key of an evicted page (what depends on it goes too)
        allocator.on_evict = self._forget

    def keys(self, tokens) -> list[bytes]:
        """The keys of every cacheable page of ``tokens``."""
        return page_keys(tokens, self.page_size, cacheable_pages(len(tokens), self.page_size))

    def match(self, tokens, keys: list[bytes] | None = None) -> list[int]:
        """The cached pages that begin ``tokens`` (the longest chain of cached keys; ``keys``: its
        ``keys(tokens)`` when already computed)."""
        pages = []
        for key in self.keys(tokens) if keys is None else keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, tokens, pages: list[int]) -> None:
        """Indexes the prefilled pages ``pages`` (a request's first pages, in order) of ``tokens``; a
        key already cached keeps its page."""
        n = min(len(pages), cacheable_pages(len(tokens), self.page_size))
        for key, page in zip(page_keys(tokens, self.page_size, n), pages[:n]):
            if key in self.page_of or page in self.key_of:
                continue
            self.page_of[key] = page
            self.key_of[page] = key
            self.allocator.cache(page)

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page)
        del self.page_of[key]
        if self.on_forget is not None:
            self.on_forget(key)

    def check(self) -> None:
        if set(self.key_of) != self.allocator.cached or len(self.page_of) != len(self.key_of):
            raise AssertionError("the prefix cache's index and the allocator's cached pages disagree")
