"""KV-block store settings (flags and MESHSERVE_* variables), and every limit the store decides itself.

The caps shared with workers and the scheduler (hash count, chunk and block sizes) live in
services/common/kv_store_limits.py; what is here only concerns how this process holds and moves bytes.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator

from services.common.byte_sizes import parse_size
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.settings import ServiceSettings

DEFAULT_PORT = 50054
MEMORY_BACKEND = "memory"
REDIS_SCHEMES = ("redis", "rediss", "unix")

# One PutChunk is at most MAX_CHUNK_BYTES of data plus a small header, and no other request comes
# near that, so nothing bigger is ever accepted. Above MAX_CHUNK_BYTES and below this, the store
# answers OUT_OF_RANGE naming the field; beyond it, grpc refuses the message unparsed.
MAX_RECEIVE_MESSAGE_BYTES = 4 * MAX_CHUNK_BYTES
# Stored values a Get holds in memory at once per stream (one backend read), and the most blocks
# one read asks for. The first read asks for few blocks, to learn their size before asking for more.
# A read must arrive within --redis-timeout even on a busy event loop, so batches stay a few MiB: a
# loopback round trip per 8 MiB costs nothing next to moving the bytes.
GET_BATCH_BYTES = 8 * 1024 * 1024
GET_BATCH_MAX_BLOCKS = 64
GET_FIRST_BATCH_BLOCKS = 4
# Encoded blocks a Put stream collects before one pipelined backend write (a Redis round trip per
# batch, not per block), and the most blocks in one write.
PUT_BATCH_BYTES = 8 * 1024 * 1024
PUT_BATCH_MAX_BLOCKS = 64
# Keys in one pipelined existence check of Lookup (it stops at the first batch with a miss).
LOOKUP_BATCH_KEYS = 256
# KV formats whose registered shape is remembered here (a cluster uses a handful; the cap keeps a
# client that invents formats from growing the process without bound).
MAX_CACHED_FORMATS = 4096
# A connection-pool wait longer than this is a dropped write or a miss, not a hung call.
REDIS_POOL_TIMEOUT_S = 5.0


class KVStoreSettings(ServiceSettings):
    """Where blocks are kept, how much of them, and how partial slices wait for their other heads."""

    port: int = Field(DEFAULT_PORT, description="gRPC port", ge=0, le=65535)
    backend: str = Field(
        MEMORY_BACKEND,
        description="where blocks live: memory (this process, LRU within --capacity) or redis://host:port/db",
    )
    capacity: str = Field("4GiB", description="byte budget of the memory backend (e.g. 512MiB, 4GiB)")
    reserve_memory: bool = Field(
        True,
        description="the memory backend takes its whole --capacity at start, before it serves, so that storing "
        "a block copies it into memory the process has rather than faulting in ~90 new pages a block on the "
        "cores the workers use; off: memory is taken as blocks arrive",
    )
    redis_max_connections: int = Field(16, description="connections in the Redis pool", ge=1)
    ttl_seconds: int = Field(0, description="expiry of blocks written to Redis (0: none)", ge=0)
    redis_timeout: float = Field(
        1.0, description="seconds a Redis call may take before Redis counts as unreachable", gt=0
    )
    backend_probe_interval: float = Field(
        1.0, description="seconds between checks that the backend answers (its health flips by itself)", gt=0
    )
    staging_capacity: str = Field(
        "256MiB", description="bytes of tensor-parallel slices held until their block's other heads arrive"
    )
    shared_memory: bool = Field(
        True,
        description="read Put payloads that workers on this host hand over in shared memory (their segments "
        "under /dev/shm, this user's only); off: such Puts are refused and the workers send the bytes instead",
    )
    staging_timeout: float = Field(
        30.0, description="seconds a partial block waits for its other heads before it is dropped", gt=0
    )

    @field_validator("backend")
    @classmethod
    def _valid_backend(cls, value: str) -> str:
        if value == MEMORY_BACKEND:
            return value
        url = urlparse(value)
        if url.scheme not in REDIS_SCHEMES or not (url.hostname or url.path):
            raise ValueError(f"{value!r} is not a backend; use memory or redis://host:port/db")
        return value

    @field_validator("capacity", "staging_capacity")
    @classmethod
    def _valid_size(cls, value: str) -> str:
        if parse_size(value) <= 0:
            raise ValueError(f"{value!r} must be more than 0 bytes")
        return value

    @property
    def backend_kind(self) -> Literal["memory", "redis"]:
        """Which backend class --backend selects."""
        return "memory" if self.backend == MEMORY_BACKEND else "redis"

    @property
    def capacity_bytes(self) -> int:
        """--capacity in bytes."""
        return parse_size(self.capacity)

    @property
    def staging_capacity_bytes(self) -> int:
        """--staging-capacity in bytes."""
        return parse_size(self.staging_capacity)
