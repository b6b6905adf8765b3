"""Host side of the sliding-window pool: its own page allocator and ring page table
(the device side, ``WindowTable``, is in ``jaxspec.kvcache.paging``).

A request keeps resident the logical pages covering positions
``[committed - retain, committed + reach)``: ``retain`` committed positions behind it (a
sliding-window query at ``committed`` sees the last ``W - 1``; a frozen-KV assistant the last
``W + 1``, so ``retain = W + 1``) and everything the next decode call may touch ahead (the
step growth of a call plus the step's lookahead). Before every call ``advance`` returns the
pages that fell behind to the allocator and grants the new ones into the ring columns they
freed, so a request holds at most ``ring_pages`` pages however long it runs, and every page
comes back when it retires (``PageAllocator.check``).
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine.allocator import KVCacheExhausted, PageAllocator
from jaxspec.kvcache.paging import pages_needed


def ring_pages(*, retain: int, ahead: int, page_size: int) -> int:
    """Columns R of the ring: a span ``[c - retain, c + ahead)`` starting anywhere in a page
    covers at most ``ceil((P - 1 + retain + ahead) / P)`` logical pages."""
    return pages_needed(page_size - 1 + retain + ahead, page_size)


def window_pages_for(window: int, *, batch: int, width: int, page_size: int, ahead: int) -> "WindowPages":
    """The window pool of a decode: ``window`` the largest sliding window read, ``width`` the
    full page table's width (a request never needs more), ``ahead`` the positions a decode
    call may touch past the committed length (step growth + lookahead); the pool holds a ring
    for every batch row."""
    retain = window + 1  # a frozen-KV assistant reads the last W + 1 committed positions
    ring = min(width, ring_pages(retain=retain, ahead=ahead, page_size=page_size))
    return WindowPages(batch=batch, ring=ring, num_pages=batch * ring + 1, page_size=page_size, retain=retain)


class WindowPages:
    """The window pool's allocator and its ring table ``pages [batch, R]`` + ``first [batch]``."""

    def __init__(self, *, batch: int, ring: int, num_pages: int, page_size: int, retain: int):
        self.allocator = PageAllocator(num_pages)
        self.ring = ring
        self.page_size = page_size
        self.retain = retain
        self.pages = np.zeros((batch, ring), np.int32)
        self.first = np.zeros(batch, np.int32)  # first resident logical page of each row
        self.end = np.zeros(batch, np.int32)  # one past the last granted logical page
        self.returned_early = 0  # pages given back while their request was still running

    def worst_pages(self, total_positions: int) -> int:
        """Most pages one request of ``total_positions`` positions (lookahead included) holds."""
        return min(self.ring, pages_needed(total_positions, self.page_size))

    def advance(self, row: int, owner: int, committed: int, reach: int) -> None:
        """Makes positions ``[committed - retain, reach)`` of ``row`` resident, returning the
        pages before them. Raises ``KVCacheExhausted`` (nothing changed) when the pool is full."""
        P, R = self.page_size, self.ring
        lo = max(0, committed - self.retain) // P
        hi = max(pages_needed(reach, P), int(self.end[row]))
        first, end = int(self.first[row]), int(self.end[row])
        lo = max(lo, first)
        if hi - lo > R:
            raise AssertionError(f"window of row {row} spans {hi - lo} pages, the ring has {R}")
        start = max(end, lo)
        if hi - start > self.allocator.num_free + max(0, min(lo, end) - first):
            raise KVCacheExhausted(
                f"sliding-window KV pool exhausted: request {owner} needs {hi - start} more pages, "
                f"{self.allocator.num_free} of {self.allocator.capacity} are free"
            )
        behind = [int(self.pages[row, j % R]) for j in range(first, min(lo, end))]
        if behind:
            self.allocator.release_pages(owner, behind)
            self.returned_early += len(behind)
            for j in range(first, min(lo, end)):
                self.pages[row, j % R] = 0
        held = len(self.allocator.pages_of(owner))
        new = self.allocator.grow(owner, held + (hi - start))
        for j, page in zip(range(start, hi), new):
            self.pages[row, j % R] = page
        self.first[row], self.end[row] = lo, max(hi, start)

    def release(self, row: int, owner: int) -> None:
        """Every page of a retiring request goes back."""
        self.allocator.release(owner)
        self.pages[row] = 0
        self.first[row] = self.end[row] = 0
