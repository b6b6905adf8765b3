"""Host page allocator with exact accounting.

Pages 1..num_pages-1 are grantable; page 0 is reserved scratch. Every page granted to a
request comes back when the request is released. Asking for more pages than are free
raises ``KVCacheExhausted`` before anything is written, so memory is never corrupted.
"""

from __future__ import annotations

from collections import deque


class KVCacheExhausted(ValueError):
    """The KV pool has no room for what was asked."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._owned: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

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
        if need > len(self._free):
            raise KVCacheExhausted(
                f"KV cache exhausted: request {owner} needs {need} more pages, {len(self._free)} of "
                f"{self.capacity} are free (raise EngineConfig.num_pages or lower max_batch / max_seq_len)"
            )
        new = [self._free.popleft() for _ in range(need)]
        owned.extend(new)
        return new

    def release_pages(self, owner: int, pages: list[int]) -> None:
        """Returns some of ``owner``'s pages (a sliding-window request's pages that fell behind
        its window) while it keeps the rest."""
        owned = self._owned.get(owner, [])
        for page in pages:
            if page not in owned:
                raise AssertionError(f"page {page} is not held by request {owner}")
            owned.remove(page)
            self._free.append(page)

    def release(self, owner: int) -> int:
        """Returns every page of ``owner`` to the free list; returns how many."""
        pages = self._owned.pop(owner, [])
        self._free.extend(pages)
        return len(pages)

    def check(self) -> None:
        """Asserts the accounting invariant: free + owned = every grantable page, no duplicates."""
        owned = [p for pages in self._owned.values() for p in pages]
        every = list(self._free) + owned
        if sorted(every) != list(range(1, self.num_pages)):
            raise AssertionError(
                f"page accounting broken: {len(self._free)} free + {len(owned)} owned != {self.capacity}"
            )
