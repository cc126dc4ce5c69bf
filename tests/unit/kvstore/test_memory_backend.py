"""The memory backend keeps the most recently used values within its byte budget."""

from __future__ import annotations

from services.kvstore.backend import PutOutcome
from services.kvstore.memory_backend import MemoryBackend


def _value(size: int, fill: int = 0) -> bytes:
    return bytes([fill]) * size


def _parts(size: int, fill: int = 0) -> list[bytes]:
    """A value of size bytes as two parts, as the servicer hands over a header and a payload."""
    value = _value(size, fill)
    return [value[: size // 3], value[size // 3 :]]


async def test_put_nx_get_and_existing() -> None:
    backend = MemoryBackend(1000)
    assert await backend.put_many_nx([("a", _parts(10, 1)), ("b", _parts(20, 2))]) == [PutOutcome.STORED] * 2
    # Not rewritten: the first value stays.
    assert await backend.put_many_nx([("a", _parts(10, 9))]) == [PutOutcome.EXISTING]
    assert await backend.get_many(["a", "x", "b"]) == [_value(10, 1), None, _value(20, 2)]
    stats = backend.stats()
    assert (stats.num_blocks, stats.bytes_used, stats.capacity_bytes, stats.evictions) == (2, 30, 1000, 0)


async def test_evicts_least_recently_used_within_the_byte_budget() -> None:
    evicted: list[int] = []
    backend = MemoryBackend(300, on_evict=evicted.append)
    for key in "abc":
        await backend.put_many_nx([(key, _parts(100))])
    # A Get hit makes "a" the most recently used, so "b" goes first.
    assert (await backend.get_many(["a"]))[0] is not None
    await backend.put_many_nx([("d", _parts(100))])
    assert [v is not None for v in await backend.get_many(["a", "b", "c", "d"])] == [True, False, True, True]
    # One large value evicts as many as it needs.
    await backend.put_many_nx([("e", _parts(250))])
    assert [v is not None for v in await backend.get_many(["a", "c", "d", "e"])] == [False, False, False, True]
    stats = backend.stats()
    assert stats.bytes_used == 250 and stats.num_blocks == 1
    assert stats.evictions == 4 and sum(evicted) == 4


async def test_a_value_larger_than_the_budget_is_dropped_without_evicting() -> None:
    backend = MemoryBackend(100)
    await backend.put_many_nx([("a", _parts(60))])
    assert await backend.put_many_nx([("big", _parts(101))]) == [PutOutcome.DROPPED]
    assert await backend.get_many(["a", "big"]) == [_value(60), None]
    assert backend.stats().evictions == 0


async def test_exists_prefix_does_not_refresh_and_delete_frees_bytes() -> None:
    backend = MemoryBackend(200)
    await backend.put_many_nx([("a", _parts(100)), ("b", _parts(100))])
    assert await backend.exists_prefix(["a", "b", "c", "a"]) == 2
    assert await backend.exists_prefix(["c", "a"]) == 0
    assert await backend.exists_prefix([]) == 0
    # Lookup is not a use: "a" is still the oldest and is evicted first.
    await backend.put_many_nx([("c", _parts(100))])
    assert await backend.exists_prefix(["a"]) == 0
    await backend.delete(["b", "missing"])
    assert backend.stats().bytes_used == 100


async def test_format_registry_keeps_the_first_record() -> None:
    backend = MemoryBackend(100)
    assert await backend.register_format("f", b"one") == b"one"
    assert await backend.register_format("f", b"two") == b"one"


async def test_evicts_until_one_free_extent_is_long_enough() -> None:
    backend = MemoryBackend(300)
    try:
        await backend.put_many_nx([("a", _parts(100, 1)), ("b", _parts(100, 2)), ("c", _parts(100, 3))])
        await backend.delete(["a", "c"])
        # 100 + 150 is within the budget, but the free 200 bytes are two holes of 100: the least recently
        # used value between them goes, and the new one takes the joined extent.
        assert await backend.put_many_nx([("d", _parts(150, 4))]) == [PutOutcome.STORED]
        assert await backend.get_many(["b", "d"]) == [None, _value(150, 4)]
        stats = backend.stats()
        assert (stats.num_blocks, stats.bytes_used, stats.evictions) == (1, 150, 1)
        # Values round-trip whatever their sizes and the holes between them.
        await backend.put_many_nx([("e", _parts(90, 5)), ("f", _parts(60, 6))])
        assert await backend.get_many(["d", "e", "f"]) == [_value(150, 4), _value(90, 5), _value(60, 6)]
    finally:
        await backend.close()


async def test_a_reserved_backend_stores_and_reads_back_its_values() -> None:
    backend = MemoryBackend(8 * 1024 * 1024, reserve=True)
    try:
        values = [(f"k{i}", _parts(300_000, i)) for i in range(20)]
        assert await backend.put_many_nx(values) == [PutOutcome.STORED] * 20
        assert await backend.get_many([k for k, _ in values]) == [_value(300_000, i) for i in range(20)]
    finally:
        await backend.close()
