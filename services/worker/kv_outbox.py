"""A rank's shared-memory outbox: the payloads of one Put, handed to a kvstore on this host by reference.

Sending a block's bytes through gRPC costs each side about as much CPU as the forward pass they share the
cores with can spare least (framing, copies, loopback TCP: ~2 ms a 368 KiB SmolLM2 block on the store
alone). A store on the same host can read them from memory instead: the save thread copies each block of
a Put into a slot here and sends only (segment, offset, length) (PutChunk.shared). The slots are reused
only once that Put has answered, and the save thread is the only writer with one Put in flight, so slot
i is simply the Put's i-th block.

The segment is a file under /dev/shm (services/common/kv_shared_memory.py names it), mode 0600, its
space reserved up front (a full /dev/shm is an error here, not a SIGBUS in the middle of a step), and
unlinked on close. A worker killed outright cannot unlink it, so each owner holds an exclusive flock on
its segment for its life, and every new outbox removes the segments whose lock it can take: their owner
is gone (locks go with their process, whatever its pid namespace).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from pathlib import Path

import structlog

from services.common.kv_shared_memory import SEGMENT_PREFIX, SHM_DIR, is_segment_name, new_segment_name
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.proto.meshserve.v1 import kvstore_pb2

log = structlog.get_logger()

# Most bytes one rank's outbox takes from /dev/shm (a container's is 64 MiB by default): a Put's blocks
# beyond what fits go in data, as without an outbox.
OUTBOX_MAX_BYTES = 32 * 1024 * 1024


class KVOutbox:
    """Slots of slot_nbytes in a shared-memory segment of this process's own."""

    def __init__(self, slot_nbytes: int, max_slots: int, directory: Path = SHM_DIR) -> None:
        """Create the segment (sweeping orphans first); OSError when /dev/shm cannot hold it."""
        if slot_nbytes < 1 or max_slots < 1:
            raise ValueError(f"an outbox needs slots of >= 1 byte, got {max_slots} of {slot_nbytes}")
        self.slot_nbytes = slot_nbytes
        self.num_slots = max(1, min(max_slots, OUTBOX_MAX_BYTES // slot_nbytes))
        sweep_orphans(directory)
        self.name = new_segment_name()
        self.path = directory / self.name
        size = self.num_slots * slot_nbytes
        # Made under a name no sweep matches and renamed once locked, so no other worker's sweep can take
        # it for an orphan in between.
        making = directory / f".{self.name}.new"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Reserves the pages now: tmpfs would otherwise fail a later write with SIGBUS when full.
            os.posix_fallocate(fd, 0, size)
            self._mapping = mmap.mmap(fd, size)
            os.rename(making, self.path)
        except BaseException:
            os.close(fd)
            making.unlink(missing_ok=True)
            raise
        self._fd = fd
        self.closed = False

    def write(self, slot: int, payload: memoryview) -> list[kvstore_pb2.SharedMemoryRange]:
        """Copy payload into the slot; the ranges a Put names for it (at most MAX_CHUNK_BYTES each)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} of an outbox of {self.num_slots}")
        length = payload.nbytes
        if length > self.slot_nbytes:
            raise ValueError(f"a payload of {length} bytes in a slot of {self.slot_nbytes}")
        start = slot * self.slot_nbytes
        self._mapping[start : start + length] = payload.cast("B")
        return [
            kvstore_pb2.SharedMemoryRange(
                segment=self.name, offset=start + at, length=min(MAX_CHUNK_BYTES, length - at)
            )
            for at in range(0, length, MAX_CHUNK_BYTES)
        ]

    def close(self) -> None:
        """Unmap, unlink, release the lock; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._mapping.close()
        self.path.unlink(missing_ok=True)
        os.close(self._fd)


def sweep_orphans(directory: Path = SHM_DIR) -> int:
    """Remove the outbox segments in directory whose owner has died (their lock is free); how many."""
    removed = 0
    with contextlib.suppress(OSError):
        names = [p.name for p in directory.iterdir() if SEGMENT_PREFIX in p.name]
        for name in names:
            if _is_outbox_file(name) and _unlink_if_orphaned(directory / name):
                removed += 1
    if removed:
        log.info("kv_outbox_orphans_removed", segments=removed, directory=str(directory))
    return removed


def _is_outbox_file(name: str) -> bool:
    """A segment, or one still being made (".NAME.new": a worker killed before renaming it leaves that)."""
    if name.startswith(".") and name.endswith(".new"):
        name = name[1 : -len(".new")]
    return is_segment_name(name)


def _unlink_if_orphaned(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)
