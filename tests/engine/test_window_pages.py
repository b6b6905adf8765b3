"""The sliding-window pool's host side over many requests: pages that fall behind a request's
window return to the allocator while it runs, a request never holds more than the ring, every
position it may touch stays resident at the column the ring math says, and nothing leaks."""

import random

import numpy as np
import pytest

from jaxspec.config import SamplingParams
from jaxspec.engine.scheduler import Request, Scheduler
from jaxspec.engine.window import WindowPages, ring_pages
from jaxspec.kvcache.paging import pages_needed


def test_ring_width_covers_any_alignment():
    for P in (1, 3, 16):
        for retain in (2, 7, 33):
            for ahead in (1, 9, 40):
                R = ring_pages(retain=retain, ahead=ahead, page_size=P)
                widest = max(pages_needed(c + ahead, P) - max(0, c - retain) // P for c in range(200))
                assert widest <= R, (P, retain, ahead)


def test_many_requests_return_pages_while_running_and_leak_none():
    rng = random.Random(0)
    P, retain, ahead, batch = 4, 9, 12, 6
    R = ring_pages(retain=retain, ahead=ahead, page_size=P)
    pool = WindowPages(batch=batch, ring=R, num_pages=batch * R + 1, page_size=P, retain=retain)
    rows: dict[int, tuple[int, int, int]] = {}  # row -> (owner, committed, total)
    owner, finished, held_max = 0, 0, 0
    while finished < 200:
        for row in range(batch):  # admit into free rows
            if row not in rows:
                owner += 1
                total = rng.randint(1, 90)
                prompt = rng.randint(1, total)
                pool.advance(row, owner, prompt, min(prompt + ahead, total))
                rows[row] = (owner, prompt, total)
        for row, (own, committed, total) in list(rows.items()):
            if committed >= total or rng.random() < 0.05:  # retire (done, or stopped early)
                pool.release(row, own)
                assert pool.allocator.pages_of(own) == []
                del rows[row]
                finished += 1
                continue
            committed = min(total, committed + rng.randint(1, 8))
            reach = min(committed + ahead, total)
            pool.advance(row, own, committed, reach)
            rows[row] = (own, committed, total)
            held = pool.allocator.pages_of(own)
            held_max = max(held_max, len(held))
            assert len(held) <= R and len(set(held)) == len(held) and 0 not in held
            # Everything from `retain` behind to `reach` is resident, at the column the ring says.
            first = int(pool.first[row])
            assert first <= max(0, committed - retain) // P and pages_needed(reach, P) <= first + R
            for j in range(max(0, committed - retain) // P, pages_needed(reach, P)):
                assert pool.pages[row, j % R] in held
            assert sorted(int(p) for p in pool.pages[row] if p) == sorted(held)
        pool.allocator.check()
    for row, (own, _, _) in rows.items():
        pool.release(row, own)
    pool.allocator.check()
    assert pool.allocator.num_free == pool.allocator.capacity
    assert pool.returned_early > 100 and held_max == R


@pytest.mark.parametrize("shards", [1, 2])
def test_scheduler_reserves_and_returns_both_pools(shards):
    """Over data shards each row takes window pages from its own shard's allocator (shard-local
    ids, page 0 of each shard its scratch), as the full pool does."""
    P, lookahead, growth, batch = 2, 3, 4, 2 * shards
    shapes = [(3, 40), (25, 5), (9, 30), (2, 2), (30, 30), (7, 20), (12, 12)]
    reqs = [Request(i, [1] * n, SamplingParams(max_new_tokens=m), (), np.zeros(2, np.uint32))
            for i, (n, m) in enumerate(shapes)]
    R = ring_pages(retain=5, ahead=growth + lookahead, page_size=P)
    window = WindowPages(batch=batch, ring=R, num_pages=shards * (2 * R + 1), page_size=P, retain=5,
                         data_shards=shards)
    sched = Scheduler(reqs, batch=batch, width=64, num_pages=80 * shards, page_size=P, lookahead=lookahead,
                      step_growth=growth, data_shards=shards, window=window)
    assert [r.worst_window_pages for r in reqs] == [min(R, pages_needed(n + m + lookahead, P)) for n, m in shapes]
    seq = np.zeros(batch, np.int32)
    used = [set() for _ in range(shards)]
    while not sched.finished:
        for r in sched.admit():
            seq[r.row] = len(r.prompt)
        sched.grant_ahead(seq)
        for row, r in enumerate(sched.rows):
            if r is None:
                continue
            d = sched.shard_of(row)
            held = window.allocators[d].pages_of(r.index)
            assert len(held) <= r.worst_window_pages
            assert sorted(int(p) for p in window.pages[row] if p) == sorted(held)
            assert all(window.allocators[e].pages_of(r.index) == [] for e in range(shards) if e != d)
            used[d].update(held)
            seq[row] += 3  # a decode call
            if seq[row] >= len(r.prompt) + r.sampling.max_new_tokens:
                sched.retire(row, [], [])
        sched.check()
    assert sched.reserved == [0] * shards and sched.reserved_window == [0] * shards
    assert window.num_free == window.capacity and window.returned_early > 0
    assert sched.num_free == sched.capacity
    assert all(used) and max(max(u) for u in used) <= 2 * R  # shard-local ids: within one shard's pages


def test_a_window_pool_too_small_is_refused_without_side_effects():
    pool = WindowPages(batch=1, ring=4, num_pages=3, page_size=2, retain=3)
    pool.advance(0, 7, 2, 4)
    with pytest.raises(Exception, match="sliding-window KV pool exhausted: request 7 needs 2 more pages, 0 of 2"):
        pool.advance(0, 7, 2, 8)
    assert len(pool.allocator.pages_of(7)) == 2
    pool.allocator.check()
