"""Where a worker's shared-memory outbox lives and what it is called: the contract of PutChunk.shared.

A worker on the kvstore's host writes the blocks it saves into a POSIX shared-memory segment of its own
and sends the store only (segment, offset, length); the store reads the bytes there. Both sides agree
here on the directory and the name, and nothing else: the worker creates and owns the segment
(services/worker/kv_outbox.py), the store opens it read-only (services/kvstore/shared_segments.py).
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

# POSIX shm_open's namespace on Linux (glibc maps /name to this directory).
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "meshserve-kv-"
# 128 random bits: names never collide between workers, even across containers sharing one /dev/shm.
_SEGMENT_NAME = re.compile(r"meshserve-kv-[0-9a-f]{32}")


def new_segment_name() -> str:
    """A fresh segment name for a new outbox."""
    return SEGMENT_PREFIX + secrets.token_hex(16)


def is_segment_name(name: str) -> bool:
    """Whether name is one a worker would create (so it names no other file, and no path)."""
    return _SEGMENT_NAME.fullmatch(name) is not None
