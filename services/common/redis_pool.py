"""One way to reach Redis: a bounded connection pool that fails fast (the kvstore's backend, rate limits)."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def bounded_redis(
    url: str, *, max_connections: int, timeout_s: float, pool_timeout_s: float, client_name: str
) -> Redis:
    """A client of at most max_connections connections whose calls each take at most about timeout_s.

    pool_timeout_s bounds the wait for a free connection. The connect timeout is half of timeout_s because
    a failed connect is tried once more: a dead Redis still answers within about timeout_s. That one retry
    is for broken connections only (after Redis restarts every pooled connection is stale and fails once,
    which must not read as Redis being down); timeouts are not retried, or a hung Redis would take twice as
    long to be noticed.
    """
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s / 2,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        client_name=client_name,
    )
    return Redis.from_pool(pool)
