"""Host-side request bookkeeping: admission into batch rows, page grants, preemption, retirement.

Two admission policies (``EngineConfig.admission``):

* ``reserve``: admission reserves each request's worst-case page count (prompt + max_new_tokens +
  the step's lookahead), so a running request never runs out of KV mid-generation.
* ``optimistic``: a request is admitted when the pages of its context and the next call's growth
  fit beside what the running requests need for that call. Before each decode call, when the
  running requests need more pages than are free, the most recently admitted ones are preempted:
  their pages go back, and they return to the front of the queue, to be resumed later by a prefill
  of their prompt and the tokens generated so far (``Request.context``). The oldest running request
  is never preempted (it alone fits the pool: checked up front), so the run always progresses.

Either way pages are granted lazily, a few steps ahead of use, and every granted page returns to the
allocator when its request retires or is preempted. A target with sliding-window layers also has a
window pool (``jaxspec.engine.window``): its pages are granted and returned as each request's window
moves; it holds a ring for every batch row, so it never forces a preemption. A target with compressed
KV (DeepSeek-V4) has one entry pool per compression rate (``jaxspec.engine.entries``), granted as the
request's length grows at 1/rate of the token rate; sized never to run out first, it never forces a
preemption either. A target with recurrent state has, with the prefix cache, snapshot slots
(``jaxspec.engine.snapshots``), held only during a prefill.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import numpy as np

from jaxspec.config import SamplingParams
from jaxspec.engine.allocator import KVCacheExhausted, PageAllocator, check_no_strays, check_table
from jaxspec.engine.entries import EntryPages
from jaxspec.engine.prefix_cache import PrefixCache, cacheable_pages
from jaxspec.engine.snapshots import StateSnapshots
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
    verify_lens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None  # when sampling.logprobs is set: one per token
    top_logprobs: list[dict[int, float]] | None = None
    text: Any = None  # its output text and stop strings (``jaxspec.engine.text.RequestText``), once admitted
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    order: int = 0  # admission sequence number (the latest admitted is preempted first)
    preemptions: int = 0
    stalls: int = 0  # preemptions in a row with no new token between them
    resume: Any = None  # what a preempted request carries back (``jaxspec.engine.host_loop.Resume``)
    start: int = 0  # positions of its context found in the prefix cache at its latest admission
    cached_tokens: int = 0  # prompt positions found in the prefix cache at its first admission
    admission_hits: list[int] = dataclasses.field(default_factory=list)  # ``start`` of every admission
    prefilled: int = 0  # positions prefilled over all its admissions (its context less the cached part)
    page_keys: tuple[int, list[bytes]] | None = None  # (context length, its pages' prefix-cache keys)
    constraint: int | None = None  # which structured-output automaton of the call it follows (None: none)

    @property
    def context(self) -> list[int]:
        """The tokens a (re)admission prefills: the prompt, plus every generated token but the
        last (which becomes the next step's root, as after any step)."""
        return self.prompt + self.tokens[:-1]


MAX_STALLS = 8  # preemptions in a row without progress before a run is declared stuck


class Scheduler:
    """Maps requests onto ``batch`` rows and owns the page table ``[batch, width]``.

    With ``data_shards`` > 1 the rows and the KV pool are split evenly over the data axis of a
    mesh: rows ``[d * B/D, (d + 1) * B/D)`` run on shard ``d`` and hold pages of that shard's own
    range, granted by its own allocator; the page table stores shard-local page ids (page 0 of
    every shard is its scratch page). ``window``: the sliding-window pool's allocators and ring
    table, split over the same data shards."""

    def __init__(self, requests: list[Request], *, batch: int, width: int, num_pages: int, page_size: int,
                 lookahead: int, step_growth: int, data_shards: int = 1, window: WindowPages | None = None,
                 admission: str = "reserve", allocators: list[PageAllocator] | None = None,
                 caches: list[PrefixCache] | None = None, entries: tuple[EntryPages, ...] = (),
                 snapshots: StateSnapshots | None = None):
        if batch % data_shards or num_pages % data_shards:
            raise ValueError(f"batch {batch} and num_pages {num_pages} must split evenly over {data_shards} data shards")
        if window is not None and len(window.allocators) != data_shards:
            raise ValueError(f"the window pool has {len(window.allocators)} data shards, the full pool {data_shards}")
        self.page_size = page_size
        self.lookahead = lookahead
        self.step_growth = step_growth  # positions a decode call may advance a request
        self.data_shards = data_shards
        self.rows_per_shard = batch // data_shards
        self.allocators = allocators or [PageAllocator(num_pages // data_shards) for _ in range(data_shards)]
        self.caches = caches  # one prefix cache per data shard, or None
        self.page_table = np.zeros((batch, width), np.int32)
        self.window = window
        self.entries = entries
        self.snapshots = snapshots
        self.waiting: deque[Request] = deque(requests)
        self.rows: list[Request | None] = [None] * batch
        self.done: list[Request] = []
        self.reserved = [0] * data_shards
        self.reserved_window = [0] * data_shards
        self.optimistic = admission == "optimistic"
        self.admitted = 0  # admissions so far (Request.order)
        self.preempted = 0
        self.prefilled = 0  # positions prefilled so far (contexts less their cached parts)
        for r in requests:
            self.size(r)

    def size(self, r: Request) -> None:
        """Sets ``r``'s worst-case page counts; raises when it could never run here (more pages than
        its page table row or its shard's pool holds)."""
        width, capacity = self.page_table.shape[1], self.allocators[0].capacity
        total = len(r.prompt) + r.sampling.max_new_tokens + self.lookahead
        r.worst_pages = pages_needed(total, self.page_size)
        r.worst_window_pages = self.window.worst_pages(total) if self.window is not None else 0
        if r.worst_pages > width:
            raise ValueError(f"request {r.index} needs {r.worst_pages} pages, the page table has {width}")
        if r.worst_pages > capacity:
            raise KVCacheExhausted(
                f"KV cache too small: request {r.index} needs up to {r.worst_pages} pages of "
                f"{self.page_size} slots but the pool has {capacity}"
                + (" per data shard" if self.data_shards > 1 else "") + f" (raise {self.allocators[0].limit})"
            )

    def enqueue(self, r: Request) -> None:
        """A request that arrives while others run: sized (``size``) and queued behind the waiting ones."""
        self.size(r)
        self.waiting.append(r)

    def drop(self, r: Request) -> int | None:
        """Takes ``r`` out (a cancelled request): off the queue, or off its row with every page back.
        Returns the row it held (its device row must be stopped), or None."""
        if r.row is None or self.rows[r.row] is not r:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
            return None
        row = r.row
        self._free_row(row)
        r.row = None
        return row

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
        """The accounting invariant: every page of every pool is free or owned by exactly one running
        request, and each running row's page table holds exactly its request's pages."""
        for a in self.allocators:
            a.check()
        for c in self.caches or ():
            c.check()
        if self.window is not None:
            for a in self.window.allocators:
                a.check()
            if self.window.caching:
                self.window.check_cache()
        owners = check_table(self.page_table, self.rows, self.allocator_of)
        check_no_strays(self.allocators + (self.window.allocators if self.window is not None else []), owners)
        for e in self.entries:
            e.check(self.rows)
        if self.snapshots is not None:
            self.snapshots.check()

    def _need(self, req: Request, committed: int, growth: int) -> int:
        """Pages ``req`` holds after a grant for ``growth`` positions past ``committed``."""
        return min(req.worst_pages, pages_needed(committed + growth + self.lookahead, self.page_size))

    def admit(self, seq_lens: np.ndarray | None = None) -> list[Request]:
        """Moves waiting requests (the preempted first) into free rows while they fit in the row's
        shard: their worst case (``reserve``), or their context and the next call's growth beside
        what the running requests need for that call (``optimistic``; ``seq_lens`` i32[B] the
        running rows' committed lengths).

        With the prefix cache, a newcomer is matched before its need is counted: under
        ``optimistic`` the cached pages it shares with running requests cost no free page (parked
        ones are counted as free already; ``reserve`` counts a request's worst case whole). A
        newcomer whose first page past its cached ones is a page of a request admitted in this same
        round waits one round (the requests behind it go on): the leader's prefill writes the
        shared pages once, and the follower finds them cached next round."""
        admitted = []
        spare = None
        if self.optimistic:
            spare = [a.num_free for a in self.allocators]
            for row, req in enumerate(self.rows):
                if req is not None:
                    held = len(self.allocator_of(row).pages_of(req.index))
                    spare[self.shard_of(row)] -= max(0, self._need(req, int(seq_lens[row]), self.step_growth) - held)
        leaders: list[dict[bytes, int]] = [{} for _ in self.allocators]  # per shard: page key admitted this round -> row
        for row, occupant in enumerate(self.rows):
            if occupant is not None or not self.waiting:
                continue
            d = self.shard_of(row)
            i, hit, keys, matched = self._next_waiting(d, leaders[d], row)
            if i is None:
                continue
            req = self.waiting[i]
            if spare is not None:
                credit = self.allocators[d].held_by_others(hit)  # shared with running requests: no new page
                need = self._need(req, len(req.context), 1 + self.step_growth) - credit
                if need > spare[d]:
                    continue
                spare[d] -= need
            elif self.reserved[d] + req.worst_pages > self.allocators[d].capacity:
                continue
            if (self.window is not None
                    and self.reserved_window[d] + req.worst_window_pages > self.window.allocators[d].capacity):
                continue
            del self.waiting[i]
            self.reserved[d] += req.worst_pages
            self.reserved_window[d] += req.worst_window_pages
            req.row = row
            self.admitted += 1
            req.order = self.admitted
            if not req.t_admit:
                req.t_admit = time.perf_counter()
            self.rows[row] = req
            req.start = 0
            if hit:
                self.allocator_of(row).share(req.index, hit)
                self.page_table[row, :len(hit)] = hit
                self.caches[d].hits += len(hit)
                req.start = len(hit) * self.page_size
            leaders[d].update(dict.fromkeys(keys[len(hit):], row))  # the pages its prefill writes
            if req.resume is None:
                req.cached_tokens = req.start
            req.admission_hits.append(req.start)
            req.prefilled += len(req.context) - req.start
            self.prefilled += len(req.context) - req.start
            caching_window = self.window is not None and self.window.caching
            if caching_window:
                self.window.share_hit(row, req.index, len(req.context), keys, len(hit))
            if self.snapshots is not None:
                self.snapshots.admit(row, req.index, len(req.context), keys, len(hit), matched)
            for e in self.entries:
                if e.caching:
                    e.share_hit(row, req.index, keys, len(hit), matched)
            self._grant(req, len(req.context), 1)
            if caching_window:
                self.window.checkpoint(row, req.index, keys, matched, len(hit), spare=self._window_spare(d))
            admitted.append(req)
        return admitted

    def _next_waiting(self, d: int, leaders: dict[bytes, int], row: int) -> tuple[int | None, list[int], list[bytes], int]:
        """(the position in ``waiting`` of the first request that does not wait for a leader of
        this round on shard ``d``, the cached pages it would share, its pages' keys, how many of its
        full pages are cached), or None first when every waiting request waits. With a window pool
        the pages shared stop where the cached window does (``WindowPages.hit``), with recurrent
        state at the last snapshot (``StateSnapshots.hit``): never past either."""
        if self.caches is None:
            return 0, [], [], 0
        for i, req in enumerate(self.waiting):
            if req.page_keys is None or req.page_keys[0] != len(req.context):  # its context grows on preemption
                req.page_keys = (len(req.context), self.caches[d].keys(req.context))
            keys = req.page_keys[1]
            hit = self.caches[d].match(req.context, keys)
            matched = len(hit)
            hit = hit[:self._hit_limit(row, keys, matched)]
            if len(hit) < len(keys) and keys[len(hit)] in leaders:
                if self.snapshots is not None:  # the leader also saves the state where their prompts part
                    p = next((j for j in range(len(hit), len(keys)) if keys[j] not in leaders), len(keys))
                    self.snapshots.mark_junction(leaders[keys[p - 1]], keys, p)
                continue  # its next page is being prefilled by a leader this round: next round it hits
            return i, hit, keys, matched
        return None, [], [], 0

    def _hit_limit(self, row: int, keys: list[bytes], k: int) -> int:
        """The most pages ``<= k`` at which every cache beside the full pages' holds what a hit needs
        (windows, entry pages, a snapshot): each gives the most at or below a bound, so lowering the
        bound until all agree finds the most they share."""
        limits = []
        if self.window is not None and self.window.caching:
            limits.append(self.window.hit)
        limits += [e.hit for e in self.entries if e.caching]
        if self.snapshots is not None:
            limits.append(self.snapshots.hit)
        while True:
            low = k
            for limit in limits:
                low = limit(row, keys, low)
            if low == k:
                return k
            k = low

    def _window_spare(self, d: int) -> int:
        """Window pages of shard ``d`` free beyond what its running rings may still grow into."""
        slack = sum(max(0, r.worst_window_pages - self.window.ring_held(r.row)) for r in self.rows
                    if r is not None and self.shard_of(r.row) == d)
        return self.window.allocators[d].num_free - slack

    def cache_prompts(self, admitted: list[Request]) -> None:
        """After their prefill: index the admitted requests' prefilled full pages in the prefix cache."""
        if self.caches is None:
            return
        for req in admitted:
            self.caches[self.shard_of(req.row)].insert(req.context, self.allocator_of(req.row).pages_of(req.index))
            if self.window is not None and self.window.caching:
                self.window.cache_prompt(req.row, req.page_keys[1], cacheable_pages(len(req.context), self.page_size))
            if self.snapshots is not None:
                self.snapshots.cache_prompt(req.row)
            for e in self.entries:
                if e.caching:
                    e.cache_prompt(req.row, req.page_keys[1], cacheable_pages(len(req.context), self.page_size))

    def to_preempt(self, seq_lens: np.ndarray, force: bool = False) -> list[int]:
        """Rows to preempt before the next decode call: per data shard, the most recently admitted
        running requests until what the rest need for the call fits (none under ``reserve``); with
        ``force``, at least the most recently admitted one overall unless it runs alone."""
        out = []
        running = sorted((r for r in self.rows if r is not None), key=lambda r: r.order)
        if force and len(running) > 1:
            out.append(running[-1].row)
        if not self.optimistic:
            return out
        for d, alloc in enumerate(self.allocators):
            mine = [r for r in running if self.shard_of(r.row) == d and r.row not in out]
            short = sum(max(0, self._need(r, int(seq_lens[r.row]), self.step_growth) - len(alloc.pages_of(r.index)))
                        for r in mine) - alloc.num_free
            while short > 0 and len(mine) > 1:
                r = mine.pop()
                short -= len(alloc.pages_of(r.index))
                short -= max(0, self._need(r, int(seq_lens[r.row]), self.step_growth) - len(alloc.pages_of(r.index)))
                out.append(r.row)
        return out

    def preempt(self, row: int, resume: Any) -> Request:
        """Takes ``row``'s request off the batch (every page back) and puts it at the front of the
        queue with ``resume``; raises ``RuntimeError`` when it keeps being preempted without
        progress."""
        req = self.rows[row]
        progressed = req.resume is None or len(req.tokens) > len(req.resume.tokens)
        req.stalls = 0 if progressed else req.stalls + 1
        if req.stalls >= MAX_STALLS:
            raise RuntimeError(
                f"request {req.index} was preempted {req.stalls} times in a row without progress: the KV pool "
                f"({self.capacity} pages of {self.page_size} slots) is too small for the requests running beside "
                f"it (raise {self.allocators[0].limit} or lower max_batch)")
        self._free_row(row)
        req.preemptions += 1
        req.resume = resume
        req.row = None
        self.waiting.appendleft(req)
        self.preempted += 1
        return req

    def grant_ahead(self, seq_lens: np.ndarray) -> None:
        """Before a decode call: pages for every position the next call may touch (and, in the
        window pool, the pages behind each request's window returned, and those held only for a
        prefill)."""
        if self.window is not None:
            self.window.drop_holds()
        for row, req in enumerate(self.rows):
            if req is not None:
                self._grant(req, int(seq_lens[row]), self.step_growth)

    def _grant(self, req: Request, committed: int, growth: int) -> None:
        reach = committed + growth + self.lookahead
        target = self._need(req, committed, growth)
        alloc = self.allocator_of(req.row)
        have = len(alloc.pages_of(req.index))
        new = alloc.grow(req.index, target)
        self.page_table[req.row, have:have + len(new)] = new
        total = len(req.prompt) + req.sampling.max_new_tokens + self.lookahead  # as reserved
        if self.window is not None:
            self.window.advance(req.row, req.index, committed, min(reach, total))
        for e in self.entries:
            e.grant(req.row, req.index, min(reach, total))

    def retire(self, row: int, tokens: list[int], accept_lens: list[int]) -> Request:
        req = self.rows[row]
        req.tokens = tokens
        req.accept_lens = accept_lens
        req.t_done = time.perf_counter()
        self._free_row(row)
        self.done.append(req)
        return req

    def release_all(self) -> None:
        """Every running request's pages back (a call that ends early: its engine's pools stay whole)."""
        for row, req in enumerate(self.rows):
            if req is not None:
                self._free_row(row)

    def _free_row(self, row: int) -> None:
        req = self.rows[row]
        self.allocator_of(row).release(req.index)
        self.reserved[self.shard_of(row)] -= req.worst_pages
        if self.window is not None:
            self.window.release(row, req.index)
            self.reserved_window[self.shard_of(row)] -= req.worst_window_pages
        for e in self.entries:
            e.release(row, req.index)
        if self.snapshots is not None:
            self.snapshots.release(row)
        self.page_table[row] = 0
        self.rows[row] = None


@dataclasses.dataclass
class PagePools:
    """An engine's page accounting, which outlives its calls: the allocators of its KV pools (one per
    data shard) and of its window pool, and the shapes they serve. Each call schedules its requests
    over them (``scheduler``) and gives every page back when it ends."""

    batch: int
    width: int
    num_pages: int
    page_size: int
    lookahead: int
    step_growth: int
    data_shards: int = 1
    window: WindowPages | None = None
    prefix_cache: bool = False
    entries: tuple[EntryPages, ...] = ()
    snapshots: StateSnapshots | None = None
    budget: int | None = None  # pages handed out over all data shards (None: num_pages), EngineConfig.page_budget
    allocators: list[PageAllocator] = dataclasses.field(init=False)
    caches: list[PrefixCache] | None = dataclasses.field(init=False)

    def __post_init__(self):
        if self.num_pages % self.data_shards:
            raise ValueError(f"num_pages {self.num_pages} must split evenly over {self.data_shards} data shards")
        granted, limit = self.num_pages, "EngineConfig.num_pages"
        if self.budget is not None and self.budget < self.num_pages:
            granted, limit = self.budget, "EngineConfig.page_budget"
        self.allocators = [PageAllocator(granted // self.data_shards, limit) for _ in range(self.data_shards)]
        self.caches = [PrefixCache(a, self.page_size) for a in self.allocators] if self.prefix_cache else None
        # A full page evicted: what the other caches keep at or past it can never hit again.
        keepers = ([self.window] if self.window is not None and self.window.caching else []) + [
            e for e in self.entries if e.caching] + ([self.snapshots] if self.snapshots is not None else [])
        for d, cache in enumerate(self.caches or ()):
            for keeper in keepers:
                cache.listeners.append(lambda gone, d=d, keeper=keeper: keeper.drop(d, gone))

    def scheduler(self, requests: list[Request], *, admission: str) -> Scheduler:
        return Scheduler(requests, batch=self.batch, width=self.width, num_pages=self.num_pages,
                         page_size=self.page_size, lookahead=self.lookahead, step_growth=self.step_growth,
                         data_shards=self.data_shards, window=self.window, admission=admission,
                         allocators=self.allocators, caches=self.caches, entries=self.entries,
                         snapshots=self.snapshots)
