"""Host-side request bookkeeping: admission into batch rows, page grants, retirement.

Admission reserves each request's worst-case page count (prompt + max_new_tokens + the
step's lookahead), so a running request can never run out of KV mid-generation; pages are
still granted lazily, a few steps ahead of use. Every granted page returns to the
allocator when its request retires. A target with sliding-window layers also has a window
pool (``jaxspec.engine.window``): its pages are granted and returned as each request's
window moves, and its worst case (the ring width) is reserved the same way.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import numpy as np

from jaxspec.config import SamplingParams
from jaxspec.engine.allocator import KVCacheExhausted, PageAllocator
from jaxspec.engine.window import WindowPages
from jaxspec.kvcache.paging import pages_needed


@dataclasses.dataclass
class Request:
    index: int  # position in the caller's list
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    key: np.ndarray  # u32[2] PRNG key data
    worst_pages: int = 0
    worst_window_pages: int = 0
    row: int | None = None
    t_admit: float = 0.0
    t_done: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    accept_lens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None  # when sampling.logprobs is set: one per token
    top_logprobs: list[dict[int, float]] | None = None
    text: Any = None  # its output text and stop strings (``jaxspec.engine.text.RequestText``), once admitted
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token or stop string that ended it


class Scheduler:
    """Maps requests onto ``batch`` rows and owns the page table ``[batch, width]``.

    With ``data_shards`` > 1 the rows and the KV pool are split evenly over the data axis of a
    mesh: rows ``[d * B/D, (d + 1) * B/D)`` run on shard ``d`` and hold pages of that shard's own
    range, granted by its own allocator; the page table stores shard-local page ids (page 0 of
    every shard is its scratch page). ``window``: the sliding-window pool's allocators and ring
    table, split over the same data shards."""

    def __init__(self, requests: list[Request], *, batch: int, width: int, num_pages: int, page_size: int,
                 lookahead: int, step_growth: int, data_shards: int = 1, window: WindowPages | None = None):
        if batch % data_shards or num_pages % data_shards:
            raise ValueError(f"batch {batch} and num_pages {num_pages} must split evenly over {data_shards} data shards")
        if window is not None and len(window.allocators) != data_shards:
            raise ValueError(f"the window pool has {len(window.allocators)} data shards, the full pool {data_shards}")
        self.page_size = page_size
        self.lookahead = lookahead
        self.step_growth = step_growth  # positions a decode call may advance a request
        self.data_shards = data_shards
        self.rows_per_shard = batch // data_shards
        self.allocators = [PageAllocator(num_pages // data_shards) for _ in range(data_shards)]
        self.page_table = np.zeros((batch, width), np.int32)
        self.window = window
        self.waiting: deque[Request] = deque(requests)
        self.rows: list[Request | None] = [None] * batch
        self.done: list[Request] = []
        self.reserved = [0] * data_shards
        self.reserved_window = [0] * data_shards
        capacity = self.allocators[0].capacity
        for r in requests:
            total = len(r.prompt) + r.sampling.max_new_tokens + lookahead
            r.worst_pages = pages_needed(total, page_size)
            r.worst_window_pages = window.worst_pages(total) if window is not None else 0
            if r.worst_pages > width:
                raise ValueError(f"request {r.index} needs {r.worst_pages} pages, the page table has {width}")
            if r.worst_pages > capacity:
                raise KVCacheExhausted(
                    f"KV cache too small: request {r.index} needs up to {r.worst_pages} pages of "
                    f"{page_size} slots but the pool has {capacity}"
                    + (f" per data shard" if data_shards > 1 else "") + " (raise EngineConfig.num_pages)"
                )

    @property
    def finished(self) -> bool:
        return not self.waiting and all(r is None for r in self.rows)

    def shard_of(self, row: int) -> int:
        return row // self.rows_per_shard

    def allocator_of(self, row: int) -> PageAllocator:
        return self.allocators[self.shard_of(row)]

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.allocators)

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def check(self) -> None:
        for a in self.allocators:
            a.check()
        if self.window is not None:
            for a in self.window.allocators:
                a.check()

    def admit(self) -> list[Request]:
        """Moves waiting requests into free rows while their worst case fits in the row's shard."""
        admitted = []
        for row, occupant in enumerate(self.rows):
            if occupant is not None or not self.waiting:
                continue
            d = self.shard_of(row)
            req = self.waiting[0]
            if self.reserved[d] + req.worst_pages > self.allocators[d].capacity:
                continue
            if (self.window is not None
                    and self.reserved_window[d] + req.worst_window_pages > self.window.allocators[d].capacity):
                continue
            self.waiting.popleft()
            self.reserved[d] += req.worst_pages
            self.reserved_window[d] += req.worst_window_pages
            req.row = row
            req.t_admit = time.perf_counter()
            self.rows[row] = req
            self._grant(req, len(req.prompt), 1)
            admitted.append(req)
        return admitted

    def grant_ahead(self, seq_lens: np.ndarray) -> None:
        """Before a decode call: pages for every position the next call may touch (and, in the
        window pool, the pages behind each request's window returned)."""
        for row, req in enumerate(self.rows):
            if req is not None:
                self._grant(req, int(seq_lens[row]), self.step_growth)

    def _grant(self, req: Request, committed: int, growth: int) -> None:
        reach = committed + growth + self.lookahead
        target = min(req.worst_pages, pages_needed(reach, self.page_size))
        alloc = self.allocator_of(req.row)
        have = len(alloc.pages_of(req.index))
        new = alloc.grow(req.index, target)
        self.page_table[req.row, have:have + len(new)] = new
        if self.window is not None:
            total = len(req.prompt) + req.sampling.max_new_tokens + self.lookahead  # as reserved
            self.window.advance(req.row, req.index, committed, min(reach, total))

    def retire(self, row: int, tokens: list[int], accept_lens: list[int]) -> Request:
        req = self.rows[row]
        req.tokens = tokens
        req.accept_lens = accept_lens
        req.t_done = time.perf_counter()
        self.allocator_of(row).release(req.index)
        self.reserved[self.shard_of(row)] -= req.worst_pages
        if self.window is not None:
            self.window.release(row, req.index)
            self.reserved_window[self.shard_of(row)] -= req.worst_window_pages
        self.page_table[row] = 0
        self.rows[row] = None
        self.done.append(req)
        return req
