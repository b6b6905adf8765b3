"""How large an engine's buffers are: one ``Geometry`` value, built once per ``Engine`` by
``engine_geometry`` from the static plan, the engine config and each model's ``KVLayout``
(``jaxspec.model.targets.kv_layout``, ``Draft.kv_layout``). Everything else (the host page
allocators, the device pools) is sized from it.

Glossary: B batch rows (a power of two, split evenly over D data shards), W page-table width
(pages per request, a power of two), P page size.
"""

from __future__ import annotations

import dataclasses

from jaxspec.config import EngineConfig
from jaxspec.engine.entries import EntryPages
from jaxspec.engine.scheduler import PagePools
from jaxspec.engine.snapshots import StateSnapshots
from jaxspec.engine.window import WindowPages, extra_pages, ring_pages
from jaxspec.kvcache.compressed import entry_pages_for
from jaxspec.kvcache.paging import pages_needed
from jaxspec.model.targets import KVLayout
from jaxspec.spec.plan import Plan


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The static sizes of an engine.

    batch: B rows; width: W pages per request; page_size: P; num_pages: pages of the full KV pool
      over all data shards (each shard's page 0 is its scratch page); data_shards: D.
    lookahead: positions past a row's committed length one step may touch; step_growth: positions
      one decode call may commit per row.
    window: the largest sliding window read (None: no window pool); retain: committed positions a
      window pool keeps behind a request's length (the window, a longer span, + 1).
    entry_rates: compression rates of the compressed-KV pools (one page table each).
    uncacheable: why prompts cannot be prefix-cached (None: they can).
    window_cache: pages per data shard the window pool holds beyond its rings for the prefix cache
      (parked window pages and prefill checkpoints; 0 without a window pool or a prefix cache).
    snapshots: recurrent-state snapshot slots per data shard for the prefix cache (0: none).
    page_budget: KV pages the allocators hand out over all data shards (None: num_pages); the pools
      keep num_pages, so the compiled programs are the unbudgeted engine's.
    """

    batch: int
    width: int
    page_size: int
    num_pages: int
    data_shards: int
    lookahead: int
    step_growth: int
    window: int | None = None
    retain: int = 0
    entry_rates: tuple[int, ...] = ()
    uncacheable: str | None = None
    window_cache: int = 0
    snapshots: int = 0
    page_budget: int | None = None

    @property
    def window_ring(self) -> int:
        """Ring columns per request in the window pool (0 without one)."""
        if self.window is None:
            return 0
        ahead = self.step_growth + self.lookahead
        # With the window pages cached, a ring also keeps the window of its prompt's last full page
        # (up to a page further back: ``WindowPages.advance``).
        retain = self.retain + (self.page_size if self.window_cache else 0)
        return min(self.width, ring_pages(retain=retain, ahead=ahead, page_size=self.page_size))

    @property
    def window_pages(self) -> int | None:
        """Pages of the window pool over all data shards (a ring per row, each shard's scratch page and
        its ``window_cache`` pages)."""
        if self.window is None:
            return None
        return self.data_shards * ((self.batch // self.data_shards) * self.window_ring + 1 + self.window_cache)

    def entry_width(self, rate: int) -> int:
        """Columns of a compressed-KV page table: the entries of W * P positions, + 2 for rounding."""
        return pages_needed(self.width * self.page_size // rate + 2, self.page_size)

    def entry_pages(self) -> tuple[int, ...] | None:
        """Pages of each compressed-KV pool over all data shards (None without compressed KV)."""
        if not self.entry_rates:
            return None
        D = self.data_shards
        return tuple(D * entry_pages_for(self.num_pages // D, self.batch // D, m) for m in self.entry_rates)

    def pool_sizes(self) -> dict:
        """The size arguments of a model's ``create_pool`` (target or draft)."""
        sizes = dict(num_pages=self.num_pages, page_size=self.page_size, window_pages=self.window_pages,
                     rows=self.batch)
        if self.entry_rates:
            sizes["entry_pages"] = self.entry_pages()
        if self.snapshots:  # each shard's slots and its scratch slot
            sizes["snapshot_rows"] = self.data_shards * (self.snapshots + 1)
        return sizes

    def page_pools(self, *, prefix_cache: bool) -> PagePools:
        """Fresh host page accounting for these sizes (allocators, ring and entry tables)."""
        D, B, P = self.data_shards, self.batch, self.page_size
        window = None if self.window is None else WindowPages(
            batch=B, ring=self.window_ring, num_pages=self.window_pages, page_size=P, retain=self.retain,
            data_shards=D, caching=prefix_cache and self.uncacheable is None)
        entries = tuple(EntryPages(rate=m, batch=B, width=self.entry_width(m), page_size=P, data_shards=D,
                                   pages_per_shard=pages // D, caching=prefix_cache and self.uncacheable is None)
                        for m, pages in zip(self.entry_rates, self.entry_pages() or ()))
        caching = prefix_cache and self.uncacheable is None
        snapshots = StateSnapshots(batch=B, slots=self.snapshots, page_size=P, data_shards=D) if (
            caching and self.snapshots) else None
        return PagePools(batch=B, width=self.width, num_pages=self.num_pages, page_size=P, lookahead=self.lookahead,
                         step_growth=self.step_growth, data_shards=D, window=window, entries=entries,
                         prefix_cache=caching, snapshots=snapshots, budget=self.page_budget)


def engine_geometry(plan: Plan, engine: EngineConfig, target: KVLayout, draft: KVLayout | None = None, *,
                    requests: int | None = None, longest: int | None = None) -> Geometry:
    """The sizes of an engine serving ``plan`` under ``engine``: its batch for ``requests`` rows (at
    most ``engine.max_batch``), its page table for ``longest`` positions (at most
    ``engine.max_seq_len``), its pools for ``engine.num_pages`` pages or for every row at full width
    (of which the allocators hand out ``engine.page_budget``).

    Raises:
      ValueError: a draft tree deeper than a sliding window, a standalone draft whose compressed KV
        cannot share the target's entry tables.
    """
    D, P = plan.data_shards, engine.page_size
    layouts = [target] + ([draft] if draft is not None else [])
    windows = [m.window for m in layouts if m.window]
    if windows and plan.spec_depth >= min(windows):
        raise ValueError(
            f"SpecConfig depth {plan.spec_depth} must be smaller than the sliding window ({min(windows)}): a draft "
            f"tree's rows attend to their ancestors without a window test")
    if draft is not None and draft.entry_rates and draft.entry_rates != target.entry_rates:
        raise ValueError(f"a standalone draft with compressed KV at rates {draft.entry_rates} cannot share the "
                         f"target's entry page tables (rates {target.entry_rates or 'none'})")
    # Static buckets: batch rows and page-table width. On a mesh the rows and pages split evenly
    # over its data shards (each with its own scratch page).
    batch = max(next_pow2(min(requests or engine.max_batch, engine.max_batch)), D)
    batch = D * -(-batch // D)
    longest = min(longest or engine.max_seq_len, engine.max_seq_len)
    width = next_pow2(pages_needed(longest + plan.lookahead, P))
    num_pages = D * (-(-engine.num_pages // D) if engine.num_pages else (batch // D) * width + 1)
    page_budget = None if engine.page_budget is None else min(num_pages, D * -(-engine.page_budget // D))
    # A frozen-KV assistant reads the last W + 1 committed positions, hence the + 1.
    retain = max(windows + [m.retained for m in layouts if m.retained]) + 1 if windows else 0
    uncacheable = next((m.uncacheable for m in layouts if m.uncacheable), None)
    window_cache = 0
    if windows and uncacheable is None and engine.prefix_cache is not False:
        # Parked window pages and checkpoints: by default four windows' pages per data shard (the
        # Gemma-4-31B shape, window 1024, page 16: 260 pages, 3.4 GB, beside 32 rings' 27.7 GB).
        window_cache = engine.window_cache_pages
        if window_cache is None:
            window_cache = 4 * extra_pages(retain, P)
        else:
            window_cache = -(-window_cache // D)
    if windows and uncacheable is None and not window_cache:
        uncacheable = "its sliding-window pages are not cached (EngineConfig.window_cache_pages=0, or the cache is off)"
    if draft is not None and draft.recurrent and uncacheable is None:
        uncacheable = "the standalone draft's recurrent state (linear-attention layers) is not snapshotted"
    snapshots = 0
    if target.recurrent and uncacheable is None and engine.prefix_cache is not False:
        # Each slot holds every linear layer's state: 8 per data shard by default (1.2 GB at Qwen3.5-27B).
        snapshots = 8 if engine.snapshot_slots is None else -(-engine.snapshot_slots // D)
        if not snapshots:
            uncacheable = "its recurrent state is not snapshotted (EngineConfig.snapshot_slots=0)"
    return Geometry(batch=batch, width=width, page_size=P, num_pages=num_pages, data_shards=D,
                    lookahead=plan.lookahead, step_growth=engine.steps_per_call * plan.max_accept,
                    window=max(windows) if windows else None, retain=retain, entry_rates=target.entry_rates,
                    uncacheable=uncacheable, window_cache=window_cache, snapshots=snapshots,
                    page_budget=page_budget)
