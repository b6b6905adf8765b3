"""Host side of the recurrent-state snapshots: the prefix cache of a hybrid target's linear-attention
layers (Qwen3.5 / Qwen3-Next), whose state is one per request and not paged by position (the device
side is ``HybridPool.snapshots``, ``jaxspec.kvcache.recurrent``).

A snapshot at ``k`` pages is every linear layer's state (and conv state) after positions
``[0, k * P)``, kept in a slot of the snapshot pool under the key of page ``k - 1``
(``jaxspec.engine.prefix_cache``: the key covers the tokens up to the page's end and the token after
it). A prompt hits at ``k`` pages only where its first ``k`` full pages are cached *and* a snapshot at
``k`` is: the prefill then restores the slot into the request's row and computes positions from
``k * P`` on. The hit point is the minimum of the two, never a page further.

Snapshots are taken at page points by the prefill itself (``SnapshotTable``: the state after any
position of the chunked prompt, ``jaxspec.model.gated_delta.delta_chain``), at most three per request:

* its prompt end: after the last full page whose following token the prompt holds
  (``cacheable_pages``), so turn 2 of a chat, which holds turn 1's prompt, hits there;
* a checkpoint where its match ended: a newcomer whose prompt matched cached full pages further
  than any snapshot (a shared system prompt followed by another question) also saves the state at
  that point, so the next such prompt hits there;
* a junction for a follower: a prompt waiting a round because its next page is being prefilled by a
  leader admitted in the same round (``Scheduler.admit``) asks the leader to save the state where
  their prompts part, so the follower hits there next round and the shared positions are prefilled
  once (``mark_junction``).

A slot is held only while its prefill reads or writes it; then it is parked, and parked slots are
evicted least recently used first when a prefill needs a slot (``PageAllocator``). A snapshot
depends on every full page before it: when one of those pages is evicted, the snapshots past it
can never hit again, and go back at once (``drop``, a listener of the prefix cache). With
``data_shards`` > 1 each shard has its own slots, index and allocator (slot 0 of each shard is its
scratch slot).
"""

from __future__ import annotations

import numpy as np

from jaxspec.engine.allocator import PageAllocator
from jaxspec.engine.prefix_cache import cacheable_pages

MARKS = 3  # snapshots one prefill may write per request: its prompt end, a checkpoint, a junction


class StateSnapshots:
    """The snapshot slots' allocators, index and the prefill's ``SnapshotTable`` rows:
    ``restore [batch]`` (the slot a request with a hit starts from), ``at [batch, MARKS]`` (positions
    after which the state is saved; 0: none) and ``slots [batch, MARKS]`` (where)."""

    def __init__(self, *, batch: int, slots: int, page_size: int, data_shards: int = 1):
        if batch % data_shards:
            raise ValueError(f"batch {batch} must split evenly over {data_shards} data shards")
        self.allocators = [PageAllocator(slots + 1) for _ in range(data_shards)]
        self.page_size = page_size
        self.rows_per_shard = batch // data_shards
        self.slot_of: list[dict[bytes, int]] = [{} for _ in range(data_shards)]  # per shard: key -> slot
        self.key_of: list[dict[int, bytes]] = [{} for _ in range(data_shards)]
        self.restore = np.zeros(batch, np.int32)
        self.at = np.zeros((batch, MARKS), np.int32)
        self.slots = np.zeros((batch, MARKS), np.int32)
        self.pending: dict[int, list[tuple[bytes, int]]] = {}  # row -> (key, slot) saved by its prefill
        self.owners: dict[int, int] = {}  # row -> the request holding slots for its prefill
        self.starts: dict[int, int] = {}  # row -> pages of its hit (its prefill saves only past them)
        self.hits = 0  # snapshots restored
        self.written = 0  # snapshots saved
        self.dropped = 0  # snapshots let go because a page before them was evicted
        for d, alloc in enumerate(self.allocators):
            alloc.on_evict = lambda slot, d=d: self._forget(d, self.key_of[d][slot])

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def _shard(self, row: int) -> int:
        return row // self.rows_per_shard

    def hit(self, row: int, keys: list[bytes], limit: int) -> int:
        """The most pages ``k <= limit`` of a prompt with page keys ``keys`` with a snapshot at ``k``
        (0: none)."""
        index = self.slot_of[self._shard(row)]
        return next((k for k in range(limit, 0, -1) if keys[k - 1] in index), 0)

    def admit(self, row: int, owner: int, context_len: int, keys: list[bytes], k: int, matched: int) -> None:
        """Before a newcomer's prefill: it holds the snapshot of its hit at ``k`` pages (restored into
        its row) and new slots for the states its prefill saves: at its prompt end, and at the
        ``matched`` full pages the cache holds when no snapshot is there. A save that finds no slot
        (every slot held) is skipped."""
        d, P = self._shard(row), self.page_size
        alloc, index = self.allocators[d], self.slot_of[d]
        self.restore[row], self.at[row], self.slots[row] = 0, 0, 0
        alloc.share(owner, [index[keys[k - 1]]] if k else [])
        if k:
            self.restore[row] = index[keys[k - 1]]
            self.hits += 1
        self.owners[row], self.starts[row] = owner, k
        self.pending[row] = []
        for p in sorted({cacheable_pages(context_len, P), matched}):
            self._save(row, keys, p)

    def mark_junction(self, row: int, keys: list[bytes], p: int) -> None:
        """A follower whose first ``p`` pages are cached or being prefilled by the leader in ``row``
        (admitted this round) waits a round: the leader's prefill also saves the state at ``p``."""
        self._save(row, keys, p)

    def _save(self, row: int, keys: list[bytes], p: int) -> None:
        """Row's prefill saves the state at ``p`` pages into a new slot, unless it starts at or past
        ``p``, a snapshot there exists or is being saved, its marks are used up or no slot is free."""
        d = self._shard(row)
        alloc, pending = self.allocators[d], self.pending.get(row)
        if (pending is None or p <= self.starts[row] or keys[p - 1] in self.slot_of[d] or len(pending) == MARKS
                or any(key == keys[p - 1] for key, _ in pending) or alloc.num_free == 0):
            return
        owner = self.owners[row]
        (slot,) = alloc.grow(owner, len(alloc.pages_of(owner)) + 1)
        m = len(pending)
        self.at[row, m], self.slots[row, m] = p * self.page_size, slot
        pending.append((keys[p - 1], slot))

    def cache_prompt(self, row: int) -> None:
        """After a prefill: index the states it saved, then let go of every slot the row held (parked:
        cached)."""
        d = self._shard(row)
        alloc = self.allocators[d]
        for key, slot in self.pending.pop(row, []):
            if key in self.slot_of[d]:
                continue  # another row of the same round saved it first: this slot goes back free
            self.slot_of[d][key] = slot
            self.key_of[d][slot] = key
            alloc.cache(slot)
            self.written += 1
        self.starts.pop(row, None)
        owner = self.owners.pop(row, None)
        if owner is not None:
            alloc.release(owner)
        self.restore[row], self.at[row], self.slots[row] = 0, 0, 0

    def release(self, row: int) -> None:
        """A row's slots go back (its prefill never ran: a call that ends early)."""
        owner = self.owners.pop(row, None)
        self.pending.pop(row, None)
        self.starts.pop(row, None)
        self.restore[row], self.at[row], self.slots[row] = 0, 0, 0
        if owner is not None:
            self.allocators[self._shard(row)].release(owner)

    def drop(self, d: int, gone: set[bytes]) -> None:
        """Full pages of shard ``d`` left the prefix cache, and with them the keys ``gone``
        (``PrefixCache.listeners``): parked snapshots under those keys go back at once (a held one
        stays until its prefill ends, then waits for eviction)."""
        for key in gone & self.slot_of[d].keys():
            if self.allocators[d].uncache(self.slot_of[d][key]):
                self._forget(d, key)
                self.dropped += 1

    def _forget(self, d: int, key: bytes) -> None:
        del self.key_of[d][self.slot_of[d].pop(key)]

    def check(self) -> None:
        for d, alloc in enumerate(self.allocators):
            alloc.check()
            if set(self.key_of[d]) != alloc.cached or len(self.slot_of[d]) != len(self.key_of[d]):
                raise AssertionError("the snapshot index and its allocator's cached slots disagree")
