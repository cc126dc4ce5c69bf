"""The store's side of PutChunk.shared: payload bytes read from a writer's shared-memory segment.

A worker on this host writes the blocks it saves into a segment of its own (services/worker/kv_outbox.py)
and sends only their ranges; here each range is checked and handed to the rest of Put as a view, as if
it had come in `data`: the stored value is its one copy. What cannot be read (shared memory off, a segment that is not
on this host or not this user's) ends the Put with FAILED_PRECONDITION, and the writer sends the bytes
instead; a range outside the segment is OUT_OF_RANGE, a name that is not a segment's INVALID_ARGUMENT.

Segments stay mapped (read-only) while they are in use, the least recently used unmapped beyond
MAX_OPEN_SEGMENTS. Only segments owned by this process's user are opened: a writer has to be able to
create files this process could be made to map, and the writer's segment never shrinks while it lives,
so a mapped read cannot run past its end (each read also checks the size again).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from services.common.kv_shared_memory import SHM_DIR, is_segment_name
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.validation import invalid, out_of_range, unreadable_shared_memory

# Writers' segments kept mapped at once: one per worker rank on this host, in any real deployment.
MAX_OPEN_SEGMENTS = 64


@dataclass
class _Segment:
    fd: int
    mapping: mmap.mmap


class SharedSegments:
    """Reads PutChunk.shared ranges; raises StatusError for what it cannot read."""

    def __init__(self, enabled: bool, directory: Path = SHM_DIR, max_open: int = MAX_OPEN_SEGMENTS) -> None:
        self.enabled = enabled
        self.directory = directory
        self.max_open = max_open
        self._open: OrderedDict[str, _Segment] = OrderedDict()
        self.bytes_read = 0

    def read(self, shared: kvstore_pb2.SharedMemoryRange) -> memoryview:
        """A view of the range, valid until the Put answers (the writer then reuses it): copy what outlives it."""
        if not self.enabled:
            raise unreadable_shared_memory(
                "shared", "this kvstore reads no shared memory (--no-shared-memory); send the payload in data"
            )
        if not is_segment_name(shared.segment):
            raise invalid(
                "shared.segment",
                f"{shared.segment[:100]!r} is not a segment name; it must be 'meshserve-kv-' followed by 32 "
                "lowercase hex digits (a name under /dev/shm, no path)",
            )
        if not 1 <= shared.length <= MAX_CHUNK_BYTES:
            raise out_of_range(
                "shared.length",
                f"{shared.length} bytes; a chunk's range is 1 to {MAX_CHUNK_BYTES} (split the payload)",
            )
        segment = self._segment(shared.segment)
        size = os.fstat(segment.fd).st_size
        if shared.offset + shared.length > min(size, len(segment.mapping)):
            raise out_of_range(
                "shared.offset",
                f"bytes {shared.offset}..{shared.offset + shared.length} lie outside segment {shared.segment} "
                f"({size} bytes)",
            )
        self.bytes_read += shared.length
        return memoryview(segment.mapping)[shared.offset : shared.offset + shared.length]

    def close(self) -> None:
        """Unmap every segment."""
        while self._open:
            _, segment = self._open.popitem()
            _release(segment)

    def _segment(self, name: str) -> _Segment:
        segment = self._open.get(name)
        if segment is not None:
            self._open.move_to_end(name)
            return segment
        segment = self._map(name)
        self._open[name] = segment
        while len(self._open) > self.max_open:
            _, oldest = self._open.popitem(last=False)
            _release(oldest)
        return segment

    def _map(self, name: str) -> _Segment:
        path = self.directory / name
        try:
            # O_NONBLOCK: a FIFO under the name must not hang the event loop in open(); fstat then refuses it.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            raise unreadable_shared_memory(
                "shared.segment",
                f"segment {name} cannot be opened on this kvstore's host ({err.strerror}): a writer on another "
                "host or in another /dev/shm sends the payload in data",
            ) from err
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise unreadable_shared_memory(
                    "shared.segment",
                    f"segment {name} is not a file of this kvstore's user (uid {os.getuid()}); send the payload "
                    "in data",
                )
            if info.st_size == 0:
                raise out_of_range("shared.segment", f"segment {name} is empty")
            mapping = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return _Segment(fd, mapping)


def _release(segment: _Segment) -> None:
    # BufferError: a Put still holds a view of it, and the mapping goes when the view does.
    with contextlib.suppress(BufferError):
        segment.mapping.close()
    os.close(segment.fd)
