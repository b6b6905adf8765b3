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

With the prefix cache (``caching``), window pages are cached like full ones, under the same page
keys (``jaxspec.engine.prefix_cache``): a sliding-window layer's K/V at a position depends only on
the tokens up to it, so a window page is as reusable as a full page. A hit at ``k`` pages needs the
window pages of the ``retain`` positions before ``k * P`` (``hit``). They come to exist in two ways:

* a prompt's own tail: after its prefill, the ring's full prompt pages are indexed, and a page
  leaving the ring (or its request retiring) is parked instead of freed, so turn 2 of a chat finds
  the window at turn 1's prompt end;
* a checkpoint: a newcomer whose prompt matched cached full pages further than any cached window
  (a shared system prompt followed by another question) also writes, during its prefill, the window
  pages before the point its match ended (``checkpoint``, the prefill's ``window_keep`` table), so
  the next such prompt hits there.

A newcomer with a hit shares the cached pages of ``[k * P - retain, k * P)``: those its ring covers
sit in the ring, and the prefill reads the ones before its cached prefix ends through its
``window_read`` table; pages it holds only for that read go back before the next decode call
(``drop_holds``). The pool is sized with ``EngineConfig.window_cache_pages`` pages beyond the rings
for parked pages and checkpoints (``jaxspec.engine.geometry``); parked pages count as free and are
evicted least recently used first, like the full pool's.
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine.allocator import KVCacheExhausted, PageAllocator
from jaxspec.kvcache.paging import pages_needed


def ring_pages(*, retain: int, ahead: int, page_size: int) -> int:
    """Columns R of the ring: a span ``[c - retain, c + ahead)`` starting anywhere in a page
    covers at most ``ceil((P - 1 + retain + ahead) / P)`` logical pages."""
    return pages_needed(page_size - 1 + retain + ahead, page_size)


def extra_pages(retain: int, page_size: int) -> int:
    """Columns of a prefill's read and checkpoint tables: the pages ``retain`` positions ending at a
    page boundary cover."""
    return pages_needed(page_size - 1 + retain, page_size)


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

    def __init__(self, *, batch: int, ring: int, num_pages: int, page_size: int, retain: int, data_shards: int = 1,
                 caching: bool = False):
        if batch % data_shards or num_pages % data_shards:
            raise ValueError(f"batch {batch} and window pages {num_pages} must split evenly over {data_shards} "
                             f"data shards")
        self.allocators = [PageAllocator(num_pages // data_shards) for _ in range(data_shards)]
        self.caching = caching
        X = extra_pages(retain, page_size)
        # The prefill's read and checkpoint tables (module docstring): [batch, X] + first [batch] each.
        self.read_pages, self.read_first = np.zeros((batch, X), np.int32), np.zeros(batch, np.int32)
        self.keep_pages, self.keep_first = np.zeros((batch, X), np.int32), np.zeros(batch, np.int32)
        self.holds: dict[int, tuple[int, list[int]]] = {}  # row -> (owner, pages held only for its prefill)
        self.pending: dict[int, dict[int, int]] = {}  # row -> {logical page: checkpoint page} to index
        self.page_of: list[dict[bytes, int]] = [{} for _ in range(data_shards)]  # per shard: key -> page
        self.key_of: list[dict[int, bytes]] = [{} for _ in range(data_shards)]
        self.hits = 0  # window pages shared from the cache
        self.checkpoints = 0  # checkpoint pages written
        for d, alloc in enumerate(self.allocators):
            alloc.on_evict = lambda page, d=d: self.page_of[d].pop(self.key_of[d].pop(page))
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
        lo = self._ring_from(committed)
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
        """Every page of a retiring request goes back (parked where cached)."""
        self.allocator_of(row).release(owner)
        self.pages[row] = 0
        self.first[row] = self.end[row] = 0
        self.holds.pop(row, None)
        self.pending.pop(row, None)

    # ------------------------------------------------------------------ prefix cache (module docstring)

    def _shard(self, row: int) -> int:
        return row // self.rows_per_shard

    def _ring_from(self, committed: int) -> int:
        """First logical page a ring keeps at ``committed`` positions: the window behind them, and with
        the cache the window of the last full page before them (a cacheable point: its prompt's end)."""
        if self.caching:
            return self.needed_from(max(0, committed - 1) // self.page_size)
        return max(0, committed - self.retain) // self.page_size

    def needed_from(self, k: int) -> int:
        """First logical page a hit at ``k`` pages needs: the pages of ``[k * P - retain, k * P)``."""
        return max(0, k * self.page_size - self.retain) // self.page_size

    def hit(self, row: int, keys: list[bytes], limit: int) -> int:
        """The most pages ``k <= limit`` of a prompt with page keys ``keys`` whose window is cached
        (every page of ``[needed_from(k), k)``); 0: none."""
        index = self.page_of[self._shard(row)]
        missing = -1  # the last page before k whose window page is not cached
        best = 0
        for k in range(1, limit + 1):
            if keys[k - 1] not in index:
                missing = k - 1
            if missing < self.needed_from(k):
                best = k
        return best

    def share_hit(self, row: int, owner: int, committed: int, keys: list[bytes], k: int) -> None:
        """Before the first grant of a newcomer with a hit at ``k`` pages (``committed`` its context):
        it holds the cached pages ``[needed_from(k), k)``, the ring's share in its columns, and its
        prefill reads them all through the read table."""
        self.read_pages[row], self.read_first[row] = 0, 0
        if k == 0:
            return
        R, X = self.ring, self.read_pages.shape[1]
        index, lo = self.page_of[self._shard(row)], self.needed_from(k)
        pages = {j: index[keys[j]] for j in range(lo, k)}
        self.allocator_of(row).share(owner, list(pages.values()))
        self.hits += len(pages)
        self.read_first[row] = lo
        for j, page in pages.items():
            self.read_pages[row, j % X] = page
        lo_ring = self._ring_from(committed)
        ring = [j for j in pages if j >= lo_ring]
        for j in ring:
            self.pages[row, j % R] = pages[j]
        if ring:
            self.first[row], self.end[row] = ring[0], k
        held = [pages[j] for j in pages if j < lo_ring]
        if held:
            self.holds[row] = (owner, held)

    def checkpoint(self, row: int, owner: int, keys: list[bytes], m: int, k: int, spare: int) -> None:
        """After a newcomer's first grant: when its prompt matched ``m`` cached full pages but its
        window only ``k < m``, its prefill also writes the window pages of ``[needed_from(m), m)``
        that the cache lacks and its ring does not hold, into new pages (at most ``spare`` of them,
        else nothing), indexed after the prefill."""
        self.keep_pages[row], self.keep_first[row] = 0, 0
        if m <= k:
            return
        index, X = self.page_of[self._shard(row)], self.keep_pages.shape[1]
        first, end = int(self.first[row]), int(self.end[row])
        want = [j for j in range(max(k, self.needed_from(m)), m)
                if keys[j] not in index and not first <= j < end]
        if not want or len(want) > spare:
            return
        alloc = self.allocator_of(row)
        new = alloc.grow(owner, len(alloc.pages_of(owner)) + len(want))
        self.keep_first[row] = self.needed_from(m)
        for j, page in zip(want, new):
            self.keep_pages[row, j % X] = page
        self.pending[row] = dict(zip(want, new))
        self.holds[row] = (owner, self.holds.get(row, (owner, []))[1] + new)
        self.checkpoints += len(new)

    def ring_held(self, row: int) -> int:
        """Pages the ring of ``row`` holds now."""
        return int(self.end[row]) - int(self.first[row])

    def cache_prompt(self, row: int, keys: list[bytes], cacheable: int) -> None:
        """After a prefill: index the ring's full prompt pages (the first ``cacheable`` pages of the
        prompt, keys ``keys``) and the row's checkpoint pages."""
        d, R = self._shard(row), self.ring
        written = {j: int(self.pages[row, j % R]) for j in range(int(self.first[row]), min(int(self.end[row]), cacheable))}
        written.update(self.pending.pop(row, {}))
        alloc = self.allocator_of(row)
        for j, page in written.items():
            if keys[j] in self.page_of[d] or page in self.key_of[d]:
                continue
            self.page_of[d][keys[j]] = page
            self.key_of[d][page] = keys[j]
            alloc.cache(page)

    def drop(self, d: int, gone: set[bytes]) -> None:
        """Full pages of shard ``d`` left the prefix cache, and with them the keys ``gone``
        (``PrefixCache.listeners``): parked window pages under those keys go back at once."""
        index = self.page_of[d]
        for key in gone & index.keys():
            page = index[key]
            if self.allocators[d].uncache(page):
                del index[key], self.key_of[d][page]

    def drop_holds(self) -> None:
        """The pages rows held only for their prefill go back (parked: they are cached)."""
        for row, (owner, pages) in self.holds.items():
            self.allocator_of(row).release_pages(owner, pages)
        self.holds.clear()

    def check_cache(self) -> None:
        for d, alloc in enumerate(self.allocators):
            if set(self.key_of[d]) != alloc.cached or len(self.page_of[d]) != len(self.key_of[d]):
                raise AssertionError("the window pool's cache index and its allocator's cached pages disagree")
