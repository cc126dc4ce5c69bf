"""The memory backend keeps the most recently used values within its byte budget."""

from __future__ import annotations

from services.kvstore.backend import PutOutcome
from services.kvstore.memory_backend import MemoryBackend


def _value(size: int, fill: int = 0) -> bytes:
    return bytes([fill]) * size


async def test_put_nx_get_and_existing() -> None:
    backend = MemoryBackend(1000)
    assert await backend.put_many_nx([("a", _value(10, 1)), ("b", _value(20, 2))]) == [PutOutcome.STORED] * 2
    # Not rewritten: the first value stays.
    assert await backend.put_many_nx([("a", _value(10, 9))]) == [PutOutcome.EXISTING]
    assert await backend.get_many(["a", "x", "b"]) == [_value(10, 1), None, _value(20, 2)]
    stats = backend.stats()
    assert (stats.num_blocks, stats.bytes_used, stats.capacity_bytes, stats.evictions) == (2, 30, 1000, 0)


async def test_evicts_least_recently_used_within_the_byte_budget() -> None:
    evicted: list[int] = []
    backend = MemoryBackend(300, on_evict=evicted.append)
    for key in "abc":
        await backend.put_many_nx([(key, _value(100))])
    # A Get hit makes "a" the most recently used, so "b" goes first.
    assert (await backend.get_many(["a"]))[0] is not None
    await backend.put_many_nx([("d", _value(100))])
    assert [v is not None for v in await backend.get_many(["a", "b", "c", "d"])] == [True, False, True, True]
    # One large value evicts as many as it needs.
    await backend.put_many_nx([("e", _value(250))])
    assert [v is not None for v in await backend.get_many(["a", "c", "d", "e"])] == [False, False, False, True]
    stats = backend.stats()
    assert stats.bytes_used == 250 and stats.num_blocks == 1
    assert stats.evictions == 4 and sum(evicted) == 4


async def test_a_value_larger_than_the_budget_is_dropped_without_evicting() -> None:
    backend = MemoryBackend(100)
    await backend.put_many_nx([("a", _value(60))])
    assert await backend.put_many_nx([("big", _value(101))]) == [PutOutcome.DROPPED]
    assert await backend.get_many(["a", "big"]) == [_value(60), None]
    assert backend.stats().evictions == 0


async def test_exists_prefix_does_not_refresh_and_delete_frees_bytes() -> None:
    backend = MemoryBackend(200)
    await backend.put_many_nx([("a", _value(100)), ("b", _value(100))])
    assert await backend.exists_prefix(["a", "b", "c", "a"]) == 2
    assert await backend.exists_prefix(["c", "a"]) == 0
    assert await backend.exists_prefix([]) == 0
    # Lookup is not a use: "a" is still the oldest and is evicted first.
    await backend.put_many_nx([("c", _value(100))])
    assert await backend.exists_prefix(["a"]) == 0
    await backend.delete(["b", "missing"])
    assert backend.stats().bytes_used == 100


async def test_format_registry_keeps_the_first_record() -> None:
    backend = MemoryBackend(100)
    assert await backend.register_format("f", b"one") == b"one"
    assert await backend.register_format("f", b"two") == b"one"
