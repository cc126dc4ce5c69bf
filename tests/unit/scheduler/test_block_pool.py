"""BlockPool: ref counts, LRU free list, hash index, eviction."""

import pytest

from services.scheduler.block_pool import BlockPool


def test_allocate_and_free_ref_counts() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1
    assert pool.num_free_blocks == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0


def test_double_free_raises() -> None:
    pool = BlockPool(2, enable_caching=True)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_over_allocation_raises() -> None:
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_lru_order_and_eviction_of_hashes() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache_full_blocks([a, b, c], [b"ha", b"hb", b"hc"], 0, 3)
    # Freed in this order: c is least recently freed and goes first.
    pool.free([c, a, b])
    assert pool.num_cached_free_blocks == 3
    [first] = pool.allocate(1)
    assert first is c
    assert pool.get_cached_block(b"hc") is None
    assert pool.get_cached_block(b"ha") is a
    assert pool.num_cached_free_blocks == 2
    # Touching a cached free block takes it off the free list: it is not evicted next.
    pool.touch([a])
    [second] = pool.allocate(1)
    assert second is b
    assert pool.get_cached_block(b"ha") is a
    assert pool.num_free_blocks == 0


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    assert pool.cache_full_blocks([a], [b"h"], 0, 1) == [a]
    assert pool.cache_full_blocks([b], [b"h"], 0, 1) == []
    assert pool.get_cached_block(b"h") is a
    assert b.block_hash is None


def test_caching_disabled_never_hits() -> None:
    pool = BlockPool(2, enable_caching=False)
    a, _ = pool.allocate(2)
    pool.cache_full_blocks([a], [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is None


def test_uncache_and_reset() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_full_blocks([a, b], [b"ha", b"hb"], 0, 2)
    pool.free([a])
    pool.uncache([a, b])
    assert pool.get_cached_block(b"ha") is None
    assert pool.get_cached_block(b"hb") is None
    assert pool.num_cached_free_blocks == 0
    pool.reset()
    assert pool.num_free_blocks == 2
    assert pool.num_cached_blocks == 0
