"""Blocks in this process's memory: least recently used goes first when a byte budget is reached."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from services.kvstore.backend import BackendStats, PutOutcome
from services.kvstore.settings import MAX_CACHED_FORMATS


class MemoryBackend:
    """An LRU of values within capacity_bytes; a Get hit makes a value the most recently used."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[int], None] | None = None) -> None:
        """on_evict(n) is told each time n values are evicted, for the metrics."""
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
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
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            out.append(value)
        return out

    async def put_many_nx(self, items: Sequence[tuple[str, bytes]]) -> list[PutOutcome]:
        """Store the new values, evicting the least recently used until they fit."""
        outcomes = []
        for key, value in items:
            if key in self._values:
                outcomes.append(PutOutcome.EXISTING)
            elif len(value) > self.capacity_bytes:
                # Evicting everything would still not make room.
                outcomes.append(PutOutcome.DROPPED)
            else:
                self._values[key] = value
                self._bytes_used += len(value)
                self._evict_to_fit()
                outcomes.append(PutOutcome.STORED)
        return outcomes

    def _evict_to_fit(self) -> None:
        evicted = 0
        while self._bytes_used > self.capacity_bytes:
            _, old = self._values.popitem(last=False)
            self._bytes_used -= len(old)
            evicted += 1
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
            value = self._values.pop(key, None)
            if value is not None:
                self._bytes_used -= len(value)

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
        """Nothing to release."""
