"""Partial blocks: head slices from tensor-parallel ranks, held until slices covering every head arrive.

Each rank writes its own heads on its own stream, in no particular order and at its own pace, so the
first slices of a block wait here. The wait is bounded twice: in bytes (the oldest partial block is
dropped to make room) and in time (a block whose other ranks never come is dropped after a timeout).
A dropped partial block is not an error anywhere: its block is simply not stored, and a later Get
misses it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from services.kvstore.block_format import BlockShape

DropReason = Literal["expired", "overflow", "too_large"]


class ShapeConflict(Exception):
    """A slice's block shape differs from the shape of the slices already held for its block."""

    def __init__(self, held: BlockShape) -> None:
        super().__init__(f"slices of this block already held have shape {held}")
        self.held = held


@dataclass
class _Partial:
    id: int
    shape: BlockShape
    created: float
    # Head index -> that head's bytes (a view into the slice that brought it).
    heads: dict[int, memoryview] = field(default_factory=dict)
    nbytes: int = 0
    slices: int = 0


@dataclass(frozen=True)
class Ticket:
    """A held slice, to ask later whether its block is still waiting."""

    key: str
    partial_id: int


@dataclass(frozen=True)
class Completed:
    """The slice completed its block: the whole payload, in head order."""

    parts: list[memoryview]


@dataclass(frozen=True)
class Held:
    """The slice waits for the block's other heads."""

    ticket: Ticket


@dataclass(frozen=True)
class Refused:
    """The slice alone is larger than the whole staging area."""


class Staging:
    """Partial blocks by block key, oldest first."""

    def __init__(
        self,
        capacity_bytes: int,
        timeout_s: float,
        on_drop: Callable[[DropReason, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """on_drop(reason, slices) is told of every slice dropped, for the metrics."""
        self.capacity_bytes = capacity_bytes
        self.timeout_s = timeout_s
        self._on_drop = on_drop
        self._clock = clock
        self._partials: OrderedDict[str, _Partial] = OrderedDict()
        self._ids = itertools.count()
        self.nbytes = 0
        self.pending_slices = 0

    def add(self, key: str, shape: BlockShape, head_start: int, payload: bytes) -> Completed | Held | Refused:
        """Hold one slice (heads head_start.. of the block under key); ShapeConflict if shapes differ."""
        self.expire()
        per_head = shape.bytes_per_head
        partial = self._partials.get(key)
        if partial is not None and partial.shape != shape:
            raise ShapeConflict(partial.shape)
        view = memoryview(payload)
        heads = {head_start + i: view[i * per_head : (i + 1) * per_head] for i in range(len(payload) // per_head)}
        new_heads = [h for h in heads if partial is None or h not in partial.heads]
        held = {} if partial is None else partial.heads
        if len(held) + len(new_heads) == shape.num_kv_heads:
            # This slice completes the block: nothing more is held.
            if partial is not None:
                del self._partials[key]
                self._forget(partial)
            return Completed([heads[h] if h in heads else held[h] for h in range(shape.num_kv_heads)])
        added = len(new_heads) * per_head
        if added > self.capacity_bytes:
            self._dropped("too_large", 1)
            return Refused()
        while self.nbytes + added > self.capacity_bytes:
            _, oldest = self._partials.popitem(last=False)
            self._forget(oldest)
            self._dropped("overflow", oldest.slices)
        partial = self._partials.get(key)  # it may have been the oldest
        if partial is None:
            partial = _Partial(next(self._ids), shape, self._clock())
            self._partials[key] = partial
        for h in new_heads:
            partial.heads[h] = heads[h]
        partial.nbytes += added
        partial.slices += 1
        self.nbytes += added
        self.pending_slices += 1
        return Held(Ticket(key, partial.id))

    def is_pending(self, ticket: Ticket) -> bool:
        """Whether the held slice's block still waits (not completed, expired or dropped)."""
        partial = self._partials.get(ticket.key)
        return partial is not None and partial.id == ticket.partial_id

    def expire(self) -> None:
        """Drop partial blocks older than timeout_s."""
        cutoff = self._clock() - self.timeout_s
        while self._partials:
            key, oldest = next(iter(self._partials.items()))
            if oldest.created > cutoff:
                break
            del self._partials[key]
            self._forget(oldest)
            self._dropped("expired", oldest.slices)

    def _forget(self, partial: _Partial) -> None:
        self.nbytes -= partial.nbytes
        self.pending_slices -= partial.slices

    def _dropped(self, reason: DropReason, slices: int) -> None:
        if self._on_drop is not None and slices:
            self._on_drop(reason, slices)
