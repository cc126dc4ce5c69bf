"""The value arena: extents first fit and coalesced, values copied in and out, memory populated ahead."""

from __future__ import annotations

import resource

import pytest

from services.kvstore.value_arena import ExtentAllocator, ValueArena

PAGE = 4096


def test_first_fit_and_coalescing_on_both_sides() -> None:
    extents = ExtentAllocator(1000)
    assert [extents.allocate(100) for _ in range(10)] == list(range(0, 1000, 100))
    assert extents.allocate(1) is None
    for start in (100, 300):
        extents.free(start, 100)
    assert extents.free_extents == 2
    # 200 fits in neither hole.
    assert extents.allocate(200) is None
    # Freeing 200 joins both neighbours into [100, 400).
    extents.free(200, 100)
    assert extents.free_extents == 1
    assert extents.allocate(300) == 100
    # First fit: the lowest hole that is long enough, split.
    extents.free(500, 100)
    extents.free(800, 200)
    assert extents.allocate(150) == 800
    assert extents.allocate(50) == 500
    assert extents.allocate(50) == 550
    assert extents.allocate(50) == 950
    assert extents.allocate(1) is None


def test_freeing_everything_leaves_one_extent_and_empty_values_take_none() -> None:
    extents = ExtentAllocator(64)
    starts = [extents.allocate(8) for _ in range(8)]
    for start in reversed(starts[::2]):
        assert start is not None
        extents.free(start, 8)
    for start in starts[1::2]:
        assert start is not None
        extents.free(start, 8)
    assert extents.free_extents == 1
    assert extents.allocate(64) == 0
    # A full allocator still gives an empty value a place, and freeing it changes nothing.
    assert extents.allocate(0) == 0
    extents.free(0, 0)
    assert extents.allocate(1) is None


def test_values_are_copied_in_from_parts_and_out_whole() -> None:
    arena = ValueArena(1024)
    try:
        source = bytearray(b"abcdef")
        offset = arena.write([b"head:", memoryview(source)[1:4], b"!"])
        assert offset == 0
        # The arena holds a copy: changing the source after the write changes nothing stored.
        source[:] = b"zzzzzz"
        assert arena.read(0, 9) == b"head:bcd!"
        second = arena.write([bytes(range(256)) * 3])
        assert second == 9
        assert arena.write([b"x" * 300]) is None
        # A freed extent takes the next value of its size.
        arena.free(0, 9)
        assert arena.write([b"123456789"]) == 0
        assert arena.read(9, 768) == bytes(range(256)) * 3
    finally:
        arena.close()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _write_pages(arena: ValueArena, value: bytes) -> list[int]:
    offsets = []
    while (offset := arena.write([value])) is not None:
        offsets.append(offset)
    return offsets


@pytest.mark.parametrize("populate", [False, True])
def test_populating_faults_the_memory_in_ahead_without_changing_a_byte(populate: bool) -> None:
    capacity = 16 * 1024 * 1024
    arena = ValueArena(capacity)
    try:
        early = arena.write([b"written before populating"])
        if populate:
            assert arena.populate()
            assert arena.populated_bytes == capacity
        value = b"v" * (64 * PAGE)
        before = _faults()
        offsets = _write_pages(arena, value)
        faults = _faults() - before
        pages = capacity // PAGE
        if populate:
            # Writing into populated memory takes no page of its own (a handful of faults elsewhere).
            assert faults < pages // 20
        else:
            assert faults > pages // 2
        assert early is not None and arena.read(early, 25) == b"written before populating"
        assert all(arena.read(o, len(value)) == value for o in offsets)
    finally:
        arena.close()
