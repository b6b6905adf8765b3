"""Host side of the compressed-KV entry pools (DeepSeek-V4): one page allocator and page table per
compression rate (the device side: ``jaxspec.kvcache.compressed``).

Entry ``e`` of rate ``m`` covers positions ``[e*m, (e+1)*m)``. A request whose next call may touch
positions below ``reach`` can close (and commit) entries below ``reach // m + 1``; its table grows to
cover them, so it advances at ``1/m`` of the token rate, and every page returns when the request
retires or is preempted. The pool is sized so that it never runs out before the full page pool does
(``jaxspec.kvcache.compressed.entry_pages_for``): it never forces a preemption.
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine.allocator import PageAllocator, check_no_strays, check_table
from jaxspec.kvcache.paging import pages_needed


class EntryPages:
    """The allocators (one per data shard) and page table ``[batch, width]`` of one rate's entries."""

    def __init__(self, *, rate: int, batch: int, width: int, pages_per_shard: int, page_size: int,
                 data_shards: int = 1):
        if batch % data_shards:
            raise ValueError(f"batch {batch} must split evenly over {data_shards} data shards")
        self.rate, self.page_size, self.width = rate, page_size, width
        self.rows_per_shard = batch // data_shards
        self.allocators = [PageAllocator(pages_per_shard) for _ in range(data_shards)]
        self.table = np.zeros((batch, width), np.int32)

    @property
    def num_pages(self) -> int:
        """Pages of the device pool (each shard's scratch page included)."""
        return sum(a.num_pages for a in self.allocators)

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def allocator_of(self, row: int) -> PageAllocator:
        return self.allocators[row // self.rows_per_shard]

    def pages_for(self, reach: int) -> int:
        """Pages covering the entries a request reaching position ``reach`` may close."""
        return min(self.width, pages_needed(reach // self.rate + 1, self.page_size))

    def grant(self, row: int, owner: int, reach: int) -> None:
        alloc = self.allocator_of(row)
        have = len(alloc.pages_of(owner))
        new = alloc.grow(owner, max(have, self.pages_for(reach)))
        self.table[row, have:have + len(new)] = new

    def release(self, row: int, owner: int) -> None:
        self.allocator_of(row).release(owner)
        self.table[row] = 0

    def check(self, rows: list) -> None:
        """Every page free or held by one running request; each running row's table holds exactly
        its request's pages (``rows``: the request of each batch row, or None)."""
        for a in self.allocators:
            a.check()
        owners = check_table(self.table, rows, self.allocator_of, f"rate-{self.rate} entry table")
        check_no_strays(self.allocators, owners, f"rate-{self.rate} entry pages")
