import random

import pytest

from jaxspec.engine.allocator import KVCacheExhausted, PageAllocator


def test_grow_and_release_return_every_page():
    alloc = PageAllocator(33)
    rng = random.Random(0)
    owners = {}
    for step in range(500):
        if owners and rng.random() < 0.4:
            owner = rng.choice(list(owners))
            assert alloc.release(owner) == owners.pop(owner)
        else:
            owner = step
            want = rng.randint(1, 6)
            if want <= alloc.num_free:
                alloc.grow(owner, want)
                owners[owner] = want
        alloc.check()
    for owner in list(owners):
        alloc.release(owner)
    assert alloc.num_free == alloc.capacity == 32
    alloc.check()


def test_scratch_page_is_never_granted():
    alloc = PageAllocator(5)
    pages = alloc.grow(0, 4)
    assert 0 not in pages and sorted(pages) == [1, 2, 3, 4]


def test_exhaustion_raises_without_side_effects():
    alloc = PageAllocator(5)
    alloc.grow(0, 3)
    with pytest.raises(KVCacheExhausted, match="needs 2 more pages, 1 of 4 are free"):
        alloc.grow(1, 2)
    assert alloc.num_free == 1 and alloc.pages_of(1) == []
    alloc.check()
