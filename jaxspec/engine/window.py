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


def window_pages_for(window: int, *, batch: int, width: int, page_size: int, ahead: int,
                     data_shards: int = 1, span: int | None = None) -> "WindowPages":
    """The window pool of a decode: ``window`` the largest sliding window read, ``width`` the
    full page table's width (a request never needs more), ``ahead`` the positions a decode
    call may touch past the committed length (step growth + lookahead), ``span`` the committed
    positions a model reads behind its length when more than its window (DeepSeek-V4's open
    compressor windows); the pool holds a ring for every batch row, and each of ``data_shards``
    shards a scratch page of its own."""
    retain = max(window, span or 0) + 1  # a frozen-KV assistant reads the last W + 1 committed positions
    ring = min(width, ring_pages(retain=retain, ahead=ahead, page_size=page_size))
    per_shard = (batch // data_shards) * ring + 1
    return WindowPages(batch=batch, ring=ring, num_pages=data_shards * per_shard, page_size=page_size, retain=retain,
                       data_shards=data_shards)


class WindowPages:
    """The window pool's allocators and its ring table ``pages [batch, R]`` + ``first [batch]``.

    With ``data_shards`` > 1 the rows and the pool's pages split evenly over the data axis, as in
    the full pool: rows ``[d * B/D, (d + 1) * B/D)`` take pages from shard ``d``'s own allocator,
    and the ring table holds shard-local page ids (page 0 of every shard is its scratch page)."""

    def __init__(self, *, batch: int, ring: int, num_pages: int, page_size: int, retain: int, data_shards: int = 1):
        if batch % data_shards or num_pages % data_shards:
            raise ValueError(f"batch {batch} and window pages {num_pages} must split evenly over {data_shards} "
                             f"data shards")
        self.allocators = [PageAllocator(num_pages // data_shards) for _ in range(data_shards)]
        self.rows_per_shard = batch // data_shards
        self.num_pages = num_pages
        self.ring = ring
        self.page_size = page_size
        self.retain = retain
        self.pages = np.zeros((batch, ring), np.int32)
        self.first = np.zeros(batch, np.int32)  # first resident logical page of each row
        self.end = np.zeros(batch, np.int32)  # one past the last granted logical page
        self.returned_early = 0  # pages given back while their request was still running

    @property
    def allocator(self) -> PageAllocator:
        """The allocator of a pool on one data shard."""
        if len(self.allocators) != 1:
            raise AttributeError(f"the window pool has {len(self.allocators)} data shards: use allocator_of(row)")
        return self.allocators[0]

    def allocator_of(self, row: int) -> PageAllocator:
        return self.allocators[row // self.rows_per_shard]

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def worst_pages(self, total_positions: int) -> int:
        """Most pages one request of ``total_positions`` positions (lookahead included) holds."""
        return min(self.ring, pages_needed(total_positions, self.page_size))

    def advance(self, row: int, owner: int, committed: int, reach: int) -> None:
        """Makes positions ``[committed - retain, reach)`` of ``row`` resident, returning the
        pages before them. Raises ``KVCacheExhausted`` (nothing changed) when the pool is full."""
        P, R = self.page_size, self.ring
        alloc = self.allocator_of(row)
        lo = max(0, committed - self.retain) // P
        hi = max(pages_needed(reach, P), int(self.end[row]))
        first, end = int(self.first[row]), int(self.end[row])
        lo = max(lo, first)
        if hi - lo > R:
            raise AssertionError(f"window of row {row} spans {hi - lo} pages, the ring has {R}")
        start = max(end, lo)
        if hi - start > alloc.num_free + max(0, min(lo, end) - first):
            raise KVCacheExhausted(
                f"sliding-window KV pool exhausted: request {owner} needs {hi - start} more pages, "
                f"{alloc.num_free} of {alloc.capacity} are free"
            )
        behind = [int(self.pages[row, j % R]) for j in range(first, min(lo, end))]
        if behind:
            alloc.release_pages(owner, behind)
            self.returned_early += len(behind)
            for j in range(first, min(lo, end)):
                self.pages[row, j % R] = 0
        held = len(alloc.pages_of(owner))
        new = alloc.grow(owner, held + (hi - start))
        for j, page in zip(range(start, hi), new):
            self.pages[row, j % R] = page
        self.first[row], self.end[row] = lo, max(hi, start)

    def release(self, row: int, owner: int) -> None:
        """Every page of a retiring request goes back."""
        self.allocator_of(row).release(owner)
        self.pages[row] = 0
        self.first[row] = self.end[row] = 0
