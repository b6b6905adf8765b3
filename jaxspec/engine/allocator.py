"""Host page allocator with exact accounting.

Pages 1..num_pages-1 are grantable; page 0 is reserved scratch. A page is free, held by one or more
requests (a prompt page shared through the prefix cache), or parked in the prefix cache with no
holder (kept for reuse, reclaimable: it counts as free and is evicted, least recently used first,
when a grant needs it). Every page a request holds comes back when it is released. Asking for more
pages than are free (or reclaimable) raises ``KVCacheExhausted`` before anything is written, so
memory is never corrupted.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class KVCacheExhausted(ValueError):
    """The KV pool has no room for what was asked."""


class PageAllocator:
    """Pages 1..num_pages-1 of one KV pool (of one data shard). ``limit`` names the setting that
    sized it, for the errors that say what to raise."""

    def __init__(self, num_pages: int, limit: str = "EngineConfig.num_pages"):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.limit = limit
        self._free: deque[int] = deque(range(1, num_pages))
        self._owned: dict[int, list[int]] = {}
        self._holders: dict[int, int] = {}  # page -> how many requests hold it
        self.cached: set[int] = set()  # pages the prefix cache keeps (held or parked)
        self.parked: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently used first
        self.on_evict = None  # called with a page the allocator takes back from the prefix cache
        self.evictions = 0  # parked prefix-cache pages taken back for a grant

    @property
    def num_free(self) -> int:
        """Free pages, parked cache pages included (reclaimable)."""
        return len(self._free) + len(self.parked)

    def held_by_others(self, pages: list[int]) -> int:
        """How many of ``pages`` (cached pages a newcomer would share) some request holds now: they
        are neither free nor parked, and sharing them costs no free page."""
        return sum(1 for page in pages if self._holders.get(page, 0) > 0)

    @property
    def capacity(self) -> int:
        """Grantable pages (all but the scratch page)."""
        return self.num_pages - 1

    def pages_of(self, owner: int) -> list[int]:
        return self._owned.get(owner, [])

    def owners(self) -> list[int]:
        """Owners holding at least one page."""
        return [o for o, pages in self._owned.items() if pages]

    def grow(self, owner: int, total_pages: int) -> list[int]:
        """Makes ``owner`` hold at least ``total_pages`` pages; returns the new ones."""
        owned = self._owned.setdefault(owner, [])
        need = total_pages - len(owned)
        if need <= 0:
            return []
        if need > self.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: request {owner} needs {need} more pages, {self.num_free} of "
                f"{self.capacity} are free (raise {self.limit} or lower max_batch / max_seq_len)"
            )
        while len(self._free) < need:  # reclaim parked prefix-cache pages, least recently used first
            page, _ = self.parked.popitem(last=False)
            self.cached.discard(page)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(page)
            self._free.append(page)
        new = [self._free.popleft() for _ in range(need)]
        for page in new:
            self._holders[page] = 1
        owned.extend(new)
        return new

    def share(self, owner: int, pages: list[int]) -> None:
        """``owner`` (holding nothing yet) also holds ``pages``, cached pages it found in the prefix cache."""
        if self._owned.get(owner):
            raise AssertionError(f"request {owner} already holds pages")
        for page in pages:
            if page not in self.cached:
                raise AssertionError(f"page {page} is not in the prefix cache")
            self.parked.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
        self._owned[owner] = list(pages)

    def cache(self, page: int) -> None:
        """The prefix cache keeps ``page`` (held now) once its holders let it go."""
        if self._holders.get(page, 0) < 1:
            raise AssertionError(f"page {page} is not held")
        self.cached.add(page)

    def uncache(self, page: int) -> bool:
        """Takes a parked ``page`` out of the prefix cache, free again (what it held can no longer be
        reached); returns False, changing nothing, when the page is not parked."""
        if page not in self.parked:
            return False
        del self.parked[page]
        self.cached.discard(page)
        self._free.append(page)
        return True

    def release_pages(self, owner: int, pages: list[int]) -> None:
        """Returns some of ``owner``'s pages (a sliding-window request's pages that fell behind
        its window) while it keeps the rest."""
        owned = self._owned.get(owner, [])
        for page in pages:
            if page not in owned:
                raise AssertionError(f"page {page} is not held by request {owner}")
            owned.remove(page)
            self._drop(page)

    def release(self, owner: int) -> int:
        """Lets go of every page of ``owner`` (free again, or parked in the prefix cache); returns how
        many. Last page first: a parked chain's tail is then older than its head, so eviction
        (least recently used first) takes a prefix's tail pages before its first ones, and what
        stays parked is still reachable from the chain's start."""
        pages = self._owned.pop(owner, [])
        for page in reversed(pages):
            self._drop(page)
        return len(pages)

    def _drop(self, page: int) -> None:
        self._holders[page] -= 1
        if self._holders[page]:
            return
        del self._holders[page]
        if page in self.cached:
            self.parked[page] = None  # most recently used last
        else:
            self._free.append(page)

    def check(self) -> None:
        """Asserts the accounting invariant: every grantable page is free, parked in the prefix cache
        or held, exactly one of those, and each held page's holder count matches its owners."""
        owned = [p for pages in self._owned.values() for p in pages]
        held = set(owned)
        every = list(self._free) + list(self.parked) + sorted(held)
        if sorted(every) != list(range(1, self.num_pages)):
            raise AssertionError(
                f"page accounting broken: {len(self._free)} free + {len(self.parked)} parked + {len(held)} held "
                f"!= {self.capacity}"
            )
        counts: dict[int, int] = {}
        for page in owned:
            counts[page] = counts.get(page, 0) + 1
        if counts != self._holders:
            raise AssertionError("page holder counts do not match the owners' page lists")
        if any(counts[p] > 1 and p not in self.cached for p in counts):
            raise AssertionError("a page outside the prefix cache is held by two requests")
        if not set(self.parked) <= self.cached:
            raise AssertionError("a parked page is not in the prefix cache")


def check_table(table, rows, allocator_of, what: str = "page table") -> set[int]:
    """The accounting of one page table ``[batch, W]``: a free row (``rows[row]`` None) holds no page,
    a running row's table holds exactly its request's pages (``allocator_of(row)``). Returns the
    running requests' indices."""
    owners = set()
    for row, req in enumerate(rows):
        held = table[row]
        if req is None:
            if held.any():
                raise AssertionError(f"row {row} is free but its {what} holds pages {held[held > 0]}")
            continue
        owners.add(req.index)
        owned = allocator_of(row).pages_of(req.index)
        if held[: len(owned)].tolist() != owned or held[len(owned):].any():
            raise AssertionError(f"row {row}: {what} {held.tolist()} != request {req.index}'s pages {owned}")
    return owners


def check_no_strays(allocators, owners: set[int], what: str = "pages") -> None:
    for a in allocators:
        stray = set(a.owners()) - owners
        if stray:
            raise AssertionError(f"{what} held by requests that are not running: {sorted(stray)}")
