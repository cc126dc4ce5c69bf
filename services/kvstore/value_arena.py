"""The memory backend's values in one mapping of --capacity bytes, reused as values come and go.

Storing a block in a `bytes` of its own costs more than copying it: the 368 KiB of a SmolLM2 block land on
~90 pages that are new to the process, and each first touch is a page fault (2-10 us apiece under a
hypervisor, ~0.2-0.9 ms a block against ~0.03 ms for the copy), paid on the cores the worker's forward
shares. Here every value is copied into an extent of one anonymous mapping, an evicted value's extent is
reused, and `populate` faults the whole mapping in before the store serves (MADV_POPULATE_WRITE), so a
block stored is a copy and nothing more.

Extents are first fit over the free ones sorted by offset, coalesced with their neighbours when freed;
values of one KV format all have one size, so a freed extent fits the next value exactly.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
from collections.abc import Sequence

import structlog

from services.kvstore.backend import Buffer

log = structlog.get_logger()


# Linux 5.14: fault pages in writable without writing them.
_MADV_POPULATE_WRITE = 23


class ExtentAllocator:
    """Free extents of [0, size): first fit, coalesced on free."""

    def __init__(self, size: int) -> None:
        # Starts of the free extents in order, and each one's length.
        self._starts: list[int] = [0] if size else []
        self._lengths: dict[int, int] = {0: size} if size else {}

    def allocate(self, length: int) -> int | None:
        """The offset of a new extent of length bytes, or None if no free extent is that long."""
        if length == 0:
            return 0  # an empty value takes no extent (and free ignores it)
        for i, start in enumerate(self._starts):
            free = self._lengths[start]
            if free < length:
                continue
            del self._lengths[start]
            if free == length:
                del self._starts[i]
            else:
                self._starts[i] = start + length
                self._lengths[start + length] = free - length
            return start
        return None

    def free(self, start: int, length: int) -> None:
        """Give back the extent allocated at start (its length as allocated)."""
        if length == 0:
            return
        i = bisect.bisect_left(self._starts, start)
        end = start + length
        if i < len(self._starts) and self._starts[i] == end:
            # Joins the free extent after it.
            length += self._lengths.pop(end)
            del self._starts[i]
        if i > 0:
            before = self._starts[i - 1]
            if before + self._lengths[before] == start:
                self._lengths[before] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length

    @property
    def free_extents(self) -> int:
        """How many separate free extents there are (1 when nothing is fragmented)."""
        return len(self._starts)


class ValueArena:
    """Values as extents of one anonymous mapping of capacity bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # mmap refuses a length of 0; a zero-capacity store holds nothing anyway.
        self._mapping = mmap.mmap(-1, max(capacity, 1))
        self._view = memoryview(self._mapping)
        self._extents = ExtentAllocator(capacity)
        self._populated = 0

    def write(self, parts: Sequence[Buffer]) -> int | None:
        """Copy the concatenation of parts into a new extent: its offset, or None if none is free that long."""
        length = sum(len(p) for p in parts)
        offset = self._extents.allocate(length)
        if offset is None:
            return None
        at = offset
        for part in parts:
            self._view[at : at + len(part)] = part
            at += len(part)
        return offset

    def read(self, offset: int, length: int) -> bytes:
        """A copy of the value at offset: its extent may be reused once the caller yields."""
        return bytes(self._view[offset : offset + length])

    def free(self, offset: int, length: int) -> None:
        """The value at offset is gone; its extent takes the next value."""
        self._extents.free(offset, length)

    @property
    def populated_bytes(self) -> int:
        """How much of the mapping has been faulted in ahead of use."""
        return self._populated

    def populate(self) -> bool:
        """Fault the whole mapping in, in one madvise; False where the kernel cannot (before Linux 5.14: pages
        are then faulted in as values arrive).

        Run before the store serves, not beside it: madvise holds the process's mmap lock while it runs, and
        every mmap of the serving thread (Python's and gRPC's allocations) would wait on it, the longer if a
        lower-priority populating thread were preempted while holding it."""
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        anchor = ctypes.c_char.from_buffer(self._mapping)  # an export: the mapping cannot close meanwhile
        base = ctypes.addressof(anchor)
        try:
            if libc.madvise(base, self.capacity, _MADV_POPULATE_WRITE) != 0:
                log.info("kvstore_memory_not_reserved", errno=ctypes.get_errno())
                return False
        finally:
            del anchor
        self._populated = self.capacity
        return True

    def close(self) -> None:
        """Unmap (every value is gone)."""
        self._view.release()
        self._mapping.close()
