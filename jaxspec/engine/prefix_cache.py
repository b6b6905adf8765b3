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

The cached keys also form a tree (each key's parent is the key of the page before it). What other
caches keep for a hit at a point (window pages, entry pages, snapshots: ``jaxspec.engine.window``,
``entries``, ``snapshots``) is keyed by a full page's key and needs every full page up to it, so
when a page is evicted its key and every key below it in the tree are handed to ``listeners``,
which drop what they keep under them: nothing can reach it any more.
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
        self.children: dict[bytes, set[bytes]] = {}  # the tree of cached keys (module docstring)
        self.parent: dict[bytes, bytes] = {}
        self.listeners: list = []  # called with the keys an eviction made unreachable
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
        keys = page_keys(tokens, self.page_size, n)
        for key, page in zip(keys, pages[:n]):
            if key in self.page_of or page in self.key_of:
                continue
            self.page_of[key] = page
            self.key_of[page] = key
            self.allocator.cache(page)
        for before, key in zip(keys, keys[1:]):
            if before in self.page_of and key in self.page_of:
                self.children.setdefault(before, set()).add(key)
                self.parent[key] = before

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page)
        del self.page_of[key]
        gone = self._cut(key)
        for listener in self.listeners:
            listener(gone)

    def _cut(self, key: bytes) -> set[bytes]:
        """Takes ``key`` and every key below it out of the tree; returns them."""
        parent = self.parent.pop(key, None)
        if parent is not None:
            self.children[parent].discard(key)
        gone, stack = set(), [key]
        while stack:
            k = stack.pop()
            gone.add(k)
            for child in self.children.pop(k, ()):
                self.parent.pop(child, None)
                stack.append(child)
        return gone

    def check(self) -> None:
        if set(self.key_of) != self.allocator.cached or len(self.page_of) != len(self.key_of):
            raise AssertionError("the prefix cache's index and the allocator's cached pages disagree")
