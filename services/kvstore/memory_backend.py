"""Blocks in this process's memory: least recently used goes first when a byte budget is reached.

The values lie in a ValueArena of the budget's size (value_arena.py says why), which the backend populates
before the store serves (--reserve-memory)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import structlog

from services.kvstore.backend import BackendStats, PutOutcome, ValueParts
from services.kvstore.settings import MAX_CACHED_FORMATS
from services.kvstore.value_arena import ValueArena

log = structlog.get_logger()


class MemoryBackend:
    """An LRU of values within capacity_bytes; a Get hit makes a value the most recently used."""

    def __init__(
        self, capacity_bytes: int, on_evict: Callable[[int], None] | None = None, reserve: bool = False
    ) -> None:
        """on_evict(n) is told each time n values are evicted, for the metrics; reserve: populate the whole
        budget now (blocking: before the store serves)."""
        self.capacity_bytes = capacity_bytes
        self.arena = ValueArena(capacity_bytes)
        if reserve:
            started = time.monotonic()
            populated = self.arena.populate()
            log.info(
                "kvstore_memory_reserved",
                bytes=self.arena.populated_bytes,
                complete=populated,
                seconds=round(time.monotonic() - started, 3),
            )
        # Each value's (offset, length) in the arena, least recently used first.
        self._values: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._bytes_used = 0
        self._evictions = 0
        self._on_evict = on_evict
        # Format records, oldest first; bounded like the servicer's cache (see MAX_CACHED_FORMATS).
        self._formats: OrderedDict[str, bytes] = OrderedDict()

    @property
    def name(self) -> str:
        """As StoreStats.backend."""
        return "memory"

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values (None where absent); each hit becomes the most recently used."""
        out: list[bytes | None] = []
        for key in keys:
            extent = self._values.get(key)
            if extent is None:
                out.append(None)
            else:
                self._values.move_to_end(key)
                out.append(self.arena.read(*extent))
        return out

    async def put_many_nx(self, items: Sequence[tuple[str, ValueParts]]) -> list[PutOutcome]:
        """Store the new values, evicting the least recently used until each fits."""
        outcomes = []
        for key, parts in items:
            length = sum(len(p) for p in parts)
            if key in self._values:
                outcomes.append(PutOutcome.EXISTING)
            elif length > self.capacity_bytes:
                # Evicting everything would still not make room.
                outcomes.append(PutOutcome.DROPPED)
            else:
                self._values[key] = (self._write(parts, length), length)
                self._bytes_used += length
                outcomes.append(PutOutcome.STORED)
        return outcomes

    def _write(self, parts: ValueParts, length: int) -> int:
        """The value's offset in the arena, evicting the least recently used until the budget has room for
        it and a free extent is long enough (with one value size, the same thing)."""
        evicted = 0
        while self._bytes_used + length > self.capacity_bytes or (offset := self.arena.write(parts)) is None:
            # An empty arena has one free extent of capacity_bytes >= length, so this ends.
            _, (old_offset, old_length) = self._values.popitem(last=False)
            self.arena.free(old_offset, old_length)
            self._bytes_used -= old_length
            evicted += 1
        self._counted_evictions(evicted)
        return offset

    def _counted_evictions(self, evicted: int) -> None:
        if evicted:
            self._evictions += evicted
            if self._on_evict is not None:
                self._on_evict(evicted)

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """Leading keys present (not a use: LRU order is unchanged)."""
        for i, key in enumerate(keys):
            if key not in self._values:
                return i
        return len(keys)

    async def delete(self, keys: Sequence[str]) -> None:
        """Drop these values."""
        for key in keys:
            extent = self._values.pop(key, None)
            if extent is not None:
                self.arena.free(*extent)
                self._bytes_used -= extent[1]

    async def register_format(self, key: str, record: bytes) -> bytes:
        """The record registered under key, this one if none was."""
        existing = self._formats.get(key)
        if existing is not None:
            return existing
        self._formats[key] = record
        if len(self._formats) > MAX_CACHED_FORMATS:
            # Forgetting a format only loses the early shape-conflict check for it: every value
            # still carries and verifies its own shape.
            self._formats.popitem(last=False)
        return record

    async def ping(self) -> None:
        """Always answers."""

    def stats(self) -> BackendStats:
        """Exact counts."""
        return BackendStats(
            num_blocks=len(self._values),
            bytes_used=self._bytes_used,
            capacity_bytes=self.capacity_bytes,
            evictions=self._evictions,
        )

    async def close(self) -> None:
        """Drop every value and the memory that held them."""
        self._values.clear()
        self._bytes_used = 0
        self.arena.close()
