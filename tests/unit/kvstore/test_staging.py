"""Partial blocks wait for their other heads, within a byte budget and a timeout."""

from __future__ import annotations

import pytest

from services.kvstore.block_format import BlockShape
from services.kvstore.staging import Completed, Held, Refused, ShapeConflict, Staging

SHAPE = BlockShape(num_kv_heads=4, num_layers=1, block_size=1, head_dim=2, dtype="float32")  # 16 bytes a head
PER_HEAD = SHAPE.bytes_per_head


def _heads(first: int, count: int) -> bytes:
    return b"".join(bytes([h]) * PER_HEAD for h in range(first, first + count))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_slices_in_any_order_complete_the_block_in_head_order() -> None:
    staging = Staging(1000, 30)
    first = staging.add("k", SHAPE, 2, _heads(2, 2))
    assert isinstance(first, Held)
    assert staging.pending_slices == 1 and staging.nbytes == 2 * PER_HEAD
    # A repeated slice (a retried rank) adds nothing.
    assert isinstance(staging.add("k", SHAPE, 2, _heads(2, 2)), Held)
    assert staging.nbytes == 2 * PER_HEAD
    done = staging.add("k", SHAPE, 0, _heads(0, 2))
    assert isinstance(done, Completed)
    assert b"".join(done.parts) == _heads(0, 4)
    assert staging.pending_slices == 0 and staging.nbytes == 0
    assert not staging.is_pending(first.ticket)


def test_overlapping_slices_of_different_tp_sizes() -> None:
    staging = Staging(1000, 30)
    assert isinstance(staging.add("k", SHAPE, 0, _heads(0, 3)), Held)
    done = staging.add("k", SHAPE, 2, _heads(2, 2))
    assert isinstance(done, Completed) and b"".join(done.parts) == _heads(0, 4)


def test_a_different_shape_for_the_same_block_conflicts() -> None:
    staging = Staging(1000, 30)
    staging.add("k", SHAPE, 0, _heads(0, 1))
    other = BlockShape(num_kv_heads=2, num_layers=2, block_size=1, head_dim=2, dtype="float32")
    with pytest.raises(ShapeConflict):
        staging.add("k", other, 1, bytes(other.bytes_per_head))


def test_overflow_drops_the_oldest_partial_block() -> None:
    drops: list[tuple[str, int]] = []
    staging = Staging(3 * PER_HEAD, 30, on_drop=lambda reason, n: drops.append((reason, n)))
    old = staging.add("old", SHAPE, 0, _heads(0, 2))
    new = staging.add("new", SHAPE, 0, _heads(0, 2))
    assert isinstance(old, Held) and isinstance(new, Held)
    assert not staging.is_pending(old.ticket) and staging.is_pending(new.ticket)
    assert drops == [("overflow", 1)]
    assert staging.nbytes == 2 * PER_HEAD and staging.pending_slices == 1
    # A slice that fills the whole area pushes out everything else.
    assert isinstance(staging.add("full", SHAPE, 0, _heads(0, 3)), Held)
    assert drops == [("overflow", 1), ("overflow", 1)] and staging.nbytes == 3 * PER_HEAD
    # One larger than the whole area is refused, and nothing is dropped for it.
    assert isinstance(staging.add("huge", SHAPE, 0, _heads(0, 4)), Completed)  # whole: nothing to hold
    small = Staging(2 * PER_HEAD, 30, on_drop=lambda reason, n: drops.append((reason, n)))
    assert isinstance(small.add("k", SHAPE, 0, _heads(0, 3)), Refused)
    assert drops[-1] == ("too_large", 1) and small.nbytes == 0


def test_partial_blocks_expire() -> None:
    clock = Clock()
    drops: list[tuple[str, int]] = []
    staging = Staging(1000, 30, on_drop=lambda reason, n: drops.append((reason, n)), clock=clock)
    held = staging.add("k", SHAPE, 0, _heads(0, 1))
    assert isinstance(held, Held)
    clock.now = 29.0
    staging.expire()
    assert staging.is_pending(held.ticket)
    clock.now = 31.0
    staging.expire()
    assert not staging.is_pending(held.ticket)
    assert drops == [("expired", 1)] and staging.pending_slices == 0 and staging.nbytes == 0
    # The block starts over: the expired heads are gone.
    assert isinstance(staging.add("k", SHAPE, 1, _heads(1, 3)), Held)
