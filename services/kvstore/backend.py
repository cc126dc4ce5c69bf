"""What the store needs from where blocks live: a Protocol both backends implement, and their shared keys.

Backends move opaque values; checking them is block_format's job and deciding what a failure means
to a caller is the servicer's. A backend that cannot be reached raises BackendUnavailable, which the
servicer turns into misses and dropped writes, never into an error status.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview
# A value to store, as the parts it is the concatenation of (a block's header, then views of its payload
# where it arrived): each backend copies them once, to where it keeps the value.
ValueParts: TypeAlias = Sequence[Buffer]

# Every key this store writes starts with this, so one Redis can hold other data too, and a later
# incompatible key scheme (kv2) can live beside this one.
KEY_PREFIX = "meshserve:kv1:"


def block_key(kv_format: str, block_hash: bytes) -> str:
    """The key of one block: meshserve:kv1:<kv_format>:<hash hex>."""
    return f"{KEY_PREFIX}{kv_format}:{block_hash.hex()}"


def format_key(kv_format: str) -> str:
    """The key of a KV format's registered shape: meshserve:kv1:fmt:<kv_format>."""
    return f"{KEY_PREFIX}fmt:{kv_format}"


class BackendUnavailable(Exception):
    """The backend did not answer (connection refused or lost, timeout)."""


class PutOutcome(enum.Enum):
    """What became of one value given to put_many_nx."""

    STORED = "stored"
    # A value was stored under the key already; it was not rewritten.
    EXISTING = "existing"
    # The backend refused it (out of room, a value larger than the whole budget).
    DROPPED = "dropped"


@dataclass(frozen=True)
class BackendStats:
    """What a backend can count about itself; 0 where it cannot know (Redis)."""

    num_blocks: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    evictions: int = 0


class Backend(Protocol):
    """An async key-value store of block values."""

    @property
    def name(self) -> str:
        """ "memory" or "redis", as StoreStats.backend."""
        ...

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key (None where absent), in one round trip."""
        ...

    async def put_many_nx(self, items: Sequence[tuple[str, ValueParts]]) -> list[PutOutcome]:
        """Store each value unless its key holds one already, in one round trip."""
        ...

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys hold a value (counting stops at the first that does not)."""
        ...

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove these keys (absent ones are ignored)."""
        ...

    async def register_format(self, key: str, record: bytes) -> bytes:
        """Store record under key unless one is there; return the record the key holds afterwards."""
        ...

    async def ping(self) -> None:
        """Return when the backend answers; BackendUnavailable when it does not."""
        ...

    def stats(self) -> BackendStats:
        """Counts for StoreStats (no I/O)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
