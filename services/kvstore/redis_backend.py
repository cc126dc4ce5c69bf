"""Blocks in Redis, shared by every kvstore replica that names the same database.

Reads and writes of many blocks are one round trip each (MGET; a pipeline of SET NX). Redis decides
what to evict (its maxmemory policy); an evicted value is simply a miss. Any failure to reach Redis
is BackendUnavailable, raised within about --redis-timeout, so callers answer misses promptly.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.redis_pool import bounded_redis
from services.kvstore.backend import BackendStats, BackendUnavailable, PutOutcome, ValueParts
from services.kvstore.settings import LOOKUP_BATCH_KEYS, REDIS_POOL_TIMEOUT_S

# Connection trouble: Redis is down, restarting or hung.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
# Anything Redis can raise: for whole calls, any failure (LOADING, READONLY too) means no answer.
_FAILED = (RedisError, OSError)


class RedisBackend:
    """A bounded pool of connections to one Redis database."""

    def __init__(self, url: str, *, max_connections: int, timeout_s: float, ttl_seconds: int) -> None:
        """timeout_s bounds each call; ttl_seconds 0 stores blocks without expiry."""
        self._redis: Redis = bounded_redis(
            url,
            max_connections=max_connections,
            timeout_s=timeout_s,
            pool_timeout_s=REDIS_POOL_TIMEOUT_S,
            client_name="meshserve-kvstore",
        )
        self._ttl = ttl_seconds or None

    @property
    def name(self) -> str:
        """As StoreStats.backend."""
        return "redis"

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """MGET: the values, None where absent (never stored, expired or evicted)."""
        if not keys:
            return []
        try:
            values = await self._redis.mget(keys)
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err
        # decode_responses is off: values are bytes (or None).
        return [v if isinstance(v, bytes) or v is None else v.encode() for v in values]

    async def put_many_nx(self, items: Sequence[tuple[str, ValueParts]]) -> list[PutOutcome]:
        """One pipeline of SET key value NX [EX ttl]; a value Redis refuses (maxmemory) is DROPPED."""
        if not items:
            return []
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, parts in items:
                    # SET takes one value: the parts are joined here, their one copy on this side.
                    pipe.set(key, b"".join(parts), nx=True, ex=self._ttl)
                results = await pipe.execute(raise_on_error=False)
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err
        outcomes = []
        for result in results:
            if isinstance(result, _UNREACHABLE):
                raise BackendUnavailable(str(result))
            if isinstance(result, Exception):
                outcomes.append(PutOutcome.DROPPED)  # e.g. OOM under a noeviction maxmemory policy
            else:
                outcomes.append(PutOutcome.STORED if result else PutOutcome.EXISTING)
        return outcomes

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """Pipelined EXISTS, LOOKUP_BATCH_KEYS at a time, stopping at the first batch with a miss."""
        present = 0
        try:
            for start in range(0, len(keys), LOOKUP_BATCH_KEYS):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key in keys[start : start + LOOKUP_BATCH_KEYS]:
                        pipe.exists(key)
                    found = await pipe.execute()
                for hit in found:
                    if not hit:
                        return present
                    present += 1
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err
        return present

    async def delete(self, keys: Sequence[str]) -> None:
        """DEL."""
        if not keys:
            return
        try:
            await self._redis.delete(*keys)
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err

    async def register_format(self, key: str, record: bytes) -> bytes:
        """SET NX then GET in one round trip: whichever replica wrote first decides the shape."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(key, record, nx=True)
                pipe.get(key)
                _, registered = await pipe.execute()
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err
        # Evicted between the two commands (maxmemory): ours is as good as any.
        return registered if isinstance(registered, bytes) else record

    async def ping(self) -> None:
        """PING."""
        try:
            await self._redis.ping()
        except _FAILED as err:
            raise BackendUnavailable(str(err)) from err

    def stats(self) -> BackendStats:
        """Redis holds the counts; this replica cannot know them without a scan."""
        return BackendStats()

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._redis.aclose()
