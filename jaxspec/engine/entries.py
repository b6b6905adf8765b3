"""Host side of the compressed-KV entry pools (DeepSeek-V4): one page allocator and page table per
compression rate (the device side: ``jaxspec.kvcache.compressed``).

Entry ``e`` of rate ``m`` covers positions ``[e*m, (e+1)*m)``. A request whose next call may touch
positions below ``reach`` can close (and commit) entries below ``reach // m + 1``; its table grows to
cover them, so it advances at ``1/m`` of the token rate, and every page returns when the request
retires or is preempted. The pool is sized so that it never runs out before the full page pool does
(``jaxspec.kvcache.compressed.entry_pages_for``): it never forces a preemption.

With the prefix cache (``caching``), entry pages are cached under the full pages' keys
(``jaxspec.engine.prefix_cache``): an entry depends only on the tokens of its windows. Entry page
``j`` of rate ``m`` holds entries ``[j*P, (j+1)*P)``, i.e. positions ``[j*P*m, (j+1)*P*m)``, the full
pages ``[j*m, (j+1)*m)``: once complete it is keyed by the key of full page ``(j+1)*m - 1`` and shared
as it is. A hit at ``k`` full pages needs the ``E = k*P // m`` entries before it: the complete pages
``j < E // P``, and (when ``E % P``) the page holding the rest, which the newcomer must append to: a
copy of it. So a prefill also keys its partial page at each point the window pool caches (its
prompt end, a checkpoint where its match ended) with that point's key in its ``partial_key`` form, and a
newcomer with a hit there gets a new page that its prefill first fills with a copy of the cached one
(``copy``: the prefill's ``PageTables.entry_copy``). Entries are written once, when their window
closes, so a partial page's first entries stay what they were keyed as while its request appends the
rest. The source page is held for the copy until the prefill ends (``cache_prompt`` lets it go).
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine.allocator import PageAllocator, check_no_strays, check_table
from jaxspec.kvcache.paging import pages_needed


def partial_key(key: bytes) -> bytes:
    """The key of a partial entry page as of the full page keyed ``key`` (module docstring)."""
    return b"partial:" + key


class EntryPages:
    """The allocators (one per data shard) and page table ``[batch, width]`` of one rate's entries;
    with ``caching``, their prefix-cache index and the prefill's copy table ``copy [batch, 2]``
    (source, destination page; 0, 0: none)."""

    def __init__(self, *, rate: int, batch: int, width: int, pages_per_shard: int, page_size: int,
                 data_shards: int = 1, caching: bool = False):
        if batch % data_shards:
            raise ValueError(f"batch {batch} must split evenly over {data_shards} data shards")
        self.rate, self.page_size, self.width = rate, page_size, width
        self.rows_per_shard = batch // data_shards
        self.allocators = [PageAllocator(pages_per_shard) for _ in range(data_shards)]
        self.table = np.zeros((batch, width), np.int32)
        self.caching = caching
        self.copy = np.zeros((batch, 2), np.int32)
        self.page_of: list[dict[bytes, int]] = [{} for _ in range(data_shards)]  # per shard: key -> page
        self.keys_of: list[dict[int, set[bytes]]] = [{} for _ in range(data_shards)]  # page -> its keys
        self.holds: dict[int, tuple[tuple, int]] = {}  # row -> (hold owner, the copy's source page)
        self.matched: dict[int, int] = {}  # row -> full pages its prompt matched at admission
        self.hits = 0  # entry pages shared
        self.copies = 0  # partial entry pages copied
        for d, alloc in enumerate(self.allocators):
            alloc.on_evict = lambda page, d=d: self._forget(d, page)

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
        self._drop_hold(row)
        self.matched.pop(row, None)

    # ------------------------------------------------------------------ prefix cache (module docstring)

    def _shard(self, row: int) -> int:
        return row // self.rows_per_shard

    def needs(self, keys: list[bytes], k: int) -> tuple[list[bytes], bytes | None]:
        """The keys a hit at ``k`` full pages needs: the complete entry pages before it, and the
        partial page's (None when the entries before it fill whole pages)."""
        E, P, m = k * self.page_size // self.rate, self.page_size, self.rate
        return [keys[(j + 1) * m - 1] for j in range(E // P)], (partial_key(keys[k - 1]) if E % P else None)

    def hit(self, row: int, keys: list[bytes], limit: int) -> int:
        """The most pages ``k <= limit`` whose entries are all cached (0: none)."""
        index = self.page_of[self._shard(row)]
        for k in range(limit, 0, -1):
            complete, part = self.needs(keys, k)
            if all(key in index for key in complete) and (part is None or part in index):
                return k
        return 0

    def share_hit(self, row: int, owner: int, keys: list[bytes], k: int, matched: int) -> None:
        """Before a newcomer's first grant, with a hit at ``k`` pages: it holds the complete cached
        entry pages before it and, for the partial one, a new page its prefill fills with a copy."""
        self.copy[row] = 0
        self.matched[row] = matched
        if k == 0:
            return
        d, alloc = self._shard(row), self.allocator_of(row)
        index = self.page_of[d]
        complete, part = self.needs(keys, k)
        pages = [index[key] for key in complete]
        alloc.share(owner, pages)
        self.table[row, :len(pages)] = pages
        self.hits += len(pages)
        if part is not None:
            source = index[part]
            hold = ("copy", owner)
            alloc.share(hold, [source])  # kept from eviction until the prefill has copied it
            self.holds[row] = (hold, source)
            (page,) = alloc.grow(owner, len(pages) + 1)
            self.table[row, len(pages)] = page
            self.copy[row] = source, page
            self.copies += 1

    def cache_prompt(self, row: int, keys: list[bytes], cacheable: int) -> None:
        """After a prefill of a context with ``cacheable`` keyed full pages: index its complete entry
        pages before them, and its partial pages at its prompt end and where its match ended."""
        d, P, m = self._shard(row), self.page_size, self.rate
        alloc = self.allocator_of(row)
        written = {keys[(j + 1) * m - 1]: int(self.table[row, j]) for j in range(cacheable // m)}
        for k in {cacheable, self.matched.pop(row, 0)}:
            E = k * P // m
            if k and E % P:
                written[partial_key(keys[k - 1])] = int(self.table[row, E // P])
        for key, page in written.items():
            if key in self.page_of[d] or not page:
                continue
            self.page_of[d][key] = page
            self.keys_of[d].setdefault(page, set()).add(key)
            if page not in alloc.cached:
                alloc.cache(page)
        self._drop_hold(row)
        self.copy[row] = 0

    def drop(self, d: int, gone: set[bytes]) -> None:
        """Full pages of shard ``d`` left the prefix cache, and with them the keys ``gone``
        (``PrefixCache.listeners``): parked entry pages under those keys (whole or partial) go back."""
        index = self.page_of[d]
        for key in [k for k in gone | {partial_key(k) for k in gone} if k in index]:
            page = index.get(key)
            if page is not None and self.allocators[d].uncache(page):
                for k in self.keys_of[d].pop(page):
                    del index[k]

    def _drop_hold(self, row: int) -> None:
        hold = self.holds.pop(row, None)
        if hold is not None:
            self.allocator_of(row).release(hold[0])

    def _forget(self, d: int, page: int) -> None:
        for key in self.keys_of[d].pop(page):
            del self.page_of[d][key]

    def check(self, rows: list) -> None:
        """Every page free or held by one running request; each running row's table holds exactly
        its request's pages (``rows``: the request of each batch row, or None)."""
        for a in self.allocators:
            a.check()
        owners = check_table(self.table, rows, self.allocator_of, f"rate-{self.rate} entry table")
        check_no_strays(self.allocators, owners, f"rate-{self.rate} entry pages")
        for d, a in enumerate(self.allocators):
            if set(self.keys_of[d]) != a.cached or {k for ks in self.keys_of[d].values() for k in ks} != set(
                    self.page_of[d]):
                raise AssertionError(f"the rate-{self.rate} entry cache index and its allocator disagree")
