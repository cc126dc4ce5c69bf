"""Per-API-key rate limits: GCRA in process (with a fake clock) and in a real Redis shared by replicas."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from services.gateway.rate_limit import (
    KEY_PREFIX,
    InProcessRateLimiter,
    RateLimits,
    RedisRateLimiter,
    bucket_id,
    make_rate_limiter,
    redis_keys,
)
from tests.support.kvstore import RedisServer

SHARED_REDIS = "redis://127.0.0.1:6379/15"


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key() -> str:
    return f"sk-test-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    """The Redis every engineer's machine runs (DB 15); each test uses its own API keys."""
    client = redis.Redis.from_url(SHARED_REDIS, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis answers at 127.0.0.1:6379")
    finally:
        client.close()
    yield SHARED_REDIS


@pytest.fixture
async def redis_limiters(shared_redis: str) -> AsyncIterator[list[RedisRateLimiter]]:
    """Limiters made by `make`, closed at the end."""
    made: list[RedisRateLimiter] = []
    yield made
    for limiter in made:
        await limiter.close()


# In process.


async def test_in_process_refuses_past_the_rate_until_retry_after() -> None:
    clock = Clock()
    limiter = InProcessRateLimiter(RateLimits(6, None), clock=clock)
    key = _key()
    for _ in range(6):  # a minute's budget at once
        assert (await limiter.admit(key, 10, 10)).allowed
    refused = await limiter.admit(key, 10, 10)
    assert not refused.allowed
    assert refused.retry_after == pytest.approx(10.0)  # 6 per minute: one every 10 s
    assert "6 requests per minute" in refused.message and "--rate-limit-requests-per-minute" in refused.message
    assert "retry in 10.00 s" in refused.message
    clock.now += refused.retry_after - 0.01
    assert not (await limiter.admit(key, 10, 10)).allowed
    clock.now += 0.01
    assert (await limiter.admit(key, 10, 10)).allowed
    assert not (await limiter.admit(key, 10, 10)).allowed, "one refilled, one spent"
    assert (await limiter.admit(_key(), 10, 10)).allowed, "other keys are not affected"
    clock.now += 60
    for _ in range(6):
        assert (await limiter.admit(key, 10, 10)).allowed, "a minute idle refills the whole budget"


async def test_in_process_token_budget_reservation_and_refund() -> None:
    clock = Clock()
    limiter = InProcessRateLimiter(RateLimits(None, 600), clock=clock)  # 10 tokens a second
    key = _key()
    first = await limiter.admit(key, 100, 300)
    assert first.allowed and first.reserved_tokens == 400
    refused = await limiter.admit(key, 100, 200)  # 300 needed, 200 left
    assert not refused.allowed
    assert refused.retry_after == pytest.approx(10.0)  # 100 more tokens at 10 a second
    assert "600 tokens per minute" in refused.message and "--rate-limit-tokens-per-minute" in refused.message
    assert "reserves 300" in refused.message
    # The first request used 100 prompt + 50 completion tokens: 250 of its 400 come back.
    assert first.correction(150) == -250
    await limiter.record(key, first.correction(150))
    second = await limiter.admit(key, 100, 200)
    assert second.allowed
    assert not (await limiter.admit(key, 100, 51)).allowed, "150 left"
    assert (await limiter.admit(key, 100, 50)).allowed


async def test_in_process_refusal_by_one_limit_charges_neither() -> None:
    clock = Clock()
    limiter = InProcessRateLimiter(RateLimits(2, 100), clock=clock)
    key = _key()
    assert (await limiter.admit(key, 50, 40)).allowed
    refused = await limiter.admit(key, 50, 40)  # tokens refuse; the request slot stays free
    assert not refused.allowed and "tokens per minute" in refused.message
    assert "requests per minute" not in refused.message
    assert (await limiter.admit(key, 5, 5)).allowed
    both = await limiter.admit(key, 50, 40)
    assert "requests per minute" in both.message and "tokens per minute" in both.message
    # The longer wait decides: tokens (90 more at 100/60 a second: 54 s) over requests (30 s).
    assert both.retry_after == pytest.approx(54.0)


async def test_in_process_refunds_never_overfill_and_large_requests_run_once_full() -> None:
    clock = Clock()
    limiter = InProcessRateLimiter(RateLimits(None, 600), clock=clock)
    key = _key()
    await limiter.record(key, -10_000)  # a refund to a full bucket gives nothing extra
    big = await limiter.admit(key, 100, 100_000)  # max_tokens above a minute's budget
    assert big.allowed and big.reserved_tokens == 600, "reservation capped at the budget, so it can run"
    await limiter.record(key, big.correction(1200))  # it used 1200: the key is 600 in debt
    refused = await limiter.admit(key, 1, 0)
    assert not refused.allowed and refused.retry_after == pytest.approx(60.1)
    clock.now += refused.retry_after
    assert (await limiter.admit(key, 1, 0)).allowed


async def test_in_process_memory_is_bounded() -> None:
    clock = Clock()
    limiter = InProcessRateLimiter(RateLimits(10, 1000), clock=clock, max_keys=100)
    for i in range(1000):
        await limiter.admit(f"key-{i}", 1, 1)
        assert limiter.tracked_keys <= 100
    assert limiter.tracked_keys == 100
    recent = await limiter.admit("key-999", 1, 1)
    assert recent.allowed, "the most recent keys are kept"
    # Idle past their window (a full bucket again), keys are dropped as later calls pass.
    clock.now += 61
    for _ in range(2):
        await limiter.admit("another", 1, 1)
    assert limiter.tracked_keys == 1
    # A key holds nothing of the API key itself.
    assert all(len(k) == 16 for k in limiter._tats)


def test_factory() -> None:
    assert make_rate_limiter(RateLimits(None, None), None) is None
    assert make_rate_limiter(RateLimits(None, None), SHARED_REDIS) is None
    assert isinstance(make_rate_limiter(RateLimits(5, None), None), InProcessRateLimiter)
    assert isinstance(make_rate_limiter(RateLimits(None, 5), SHARED_REDIS), RedisRateLimiter)
    with pytest.raises(ValueError, match="at least 1"):
        RateLimits(0, None)


# Redis.


async def test_redis_refuses_past_the_rate_until_retry_after(redis_limiters: list[RedisRateLimiter]) -> None:
    limiter = RedisRateLimiter(SHARED_REDIS, RateLimits(60, None))  # one a second, bursts of 60
    redis_limiters.append(limiter)
    key = _key()
    for _ in range(60):
        assert (await limiter.admit(key, 1, 1)).allowed
    refused = await limiter.admit(key, 1, 1)
    assert not refused.allowed and 0 < refused.retry_after <= 1.0
    assert "60 requests per minute (--rate-limit-requests-per-minute)" in refused.message
    await asyncio.sleep(refused.retry_after)
    assert (await limiter.admit(key, 1, 1)).allowed
    assert not (await limiter.admit(key, 1, 1)).allowed
    assert limiter.redis_errors == 0 and not limiter.degraded


async def test_redis_stores_hashed_keys_with_a_ttl(redis_limiters: list[RedisRateLimiter], shared_redis: str) -> None:
    limiter = RedisRateLimiter(SHARED_REDIS, RateLimits(60, 6000))
    redis_limiters.append(limiter)
    key = _key()
    assert (await limiter.admit(key, 100, 200)).allowed
    requests_key, tokens_key = redis_keys(key)
    assert requests_key == f"{KEY_PREFIX}{{{bucket_id(key)}}}:requests"
    client = redis.Redis.from_url(shared_redis)
    try:
        for name in (requests_key, tokens_key):
            assert 0 < client.pttl(name) <= 60_000
        assert not any(key.encode() in name for name in client.scan_iter(f"{KEY_PREFIX}*", count=1000))
    finally:
        client.close()


async def test_two_replicas_hold_the_combined_rate(redis_limiters: list[RedisRateLimiter]) -> None:
    # Two gateway replicas: 6 per minute (one every 10 s) in all, not each.
    replicas = [RedisRateLimiter(SHARED_REDIS, RateLimits(6, None)) for _ in range(2)]
    redis_limiters.extend(replicas)
    key = _key()
    started = time.monotonic()
    admitted = [0, 0]
    for i in range(40):
        if (await replicas[i % 2].admit(key, 1, 1)).allowed:
            admitted[i % 2] += 1
    elapsed = time.monotonic() - started
    assert elapsed < 10, "the refill would blur the count"
    assert sum(admitted) == 6 and min(admitted) == 3


async def test_two_replicas_share_the_token_budget_and_refunds(redis_limiters: list[RedisRateLimiter]) -> None:
    a, b = (RedisRateLimiter(SHARED_REDIS, RateLimits(None, 1000)) for _ in range(2))
    redis_limiters.extend([a, b])
    key = _key()
    first = await a.admit(key, 300, 300)
    assert first.allowed and first.reserved_tokens == 600
    refused = await b.admit(key, 300, 200)  # 500 needed, about 400 left
    assert not refused.allowed and "1000 tokens per minute (--rate-limit-tokens-per-minute)" in refused.message
    assert 5.0 < refused.retry_after <= 6.0  # 100 tokens at 1000/60 a second
    await a.record(key, first.correction(350))  # 250 unused come back, through either replica
    assert (await b.admit(key, 300, 200)).allowed
    assert not (await a.admit(key, 100, 100)).allowed, "about 150 left"


async def test_dead_redis_fails_open_to_local_limits_within_the_timeout(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    errors: list[int] = []
    limiter = RedisRateLimiter(
        server.url, RateLimits(3, None), timeout_s=0.2, retry_interval_s=0.3, on_error=lambda: errors.append(1)
    )
    key = _key()
    try:
        assert (await limiter.admit(key, 1, 1)).allowed and not limiter.degraded
        server.stop()  # killed
        started = time.monotonic()
        decision = await limiter.admit(key, 1, 1)
        assert time.monotonic() - started < 0.5
        assert decision.allowed, "fail open"
        assert limiter.degraded and limiter.redis_errors == 1 and errors == [1]
        # Meanwhile this replica holds the limit by itself (its own full bucket: 3 more).
        assert (await limiter.admit(key, 1, 1)).allowed and (await limiter.admit(key, 1, 1)).allowed
        assert not (await limiter.admit(key, 1, 1)).allowed
        assert limiter.redis_errors == 1, "Redis is not tried again before retry_interval_s"

        # Hung (connections accepted, nothing answers): still within the timeout.
        server.start()
        server.pause(True)
        await asyncio.sleep(0.35)
        started = time.monotonic()
        decision = await limiter.admit(_key(), 1, 1)
        assert time.monotonic() - started < 0.5
        assert decision.allowed and limiter.degraded and limiter.redis_errors == 2

        # Back: after retry_interval_s, the next call probes Redis and decisions are shared again.
        server.pause(False)
        await asyncio.sleep(0.35)
        assert (await limiter.admit(key, 1, 1)).allowed, "Redis restarted empty"
        assert not limiter.degraded and limiter.redis_errors == 2
    finally:
        await limiter.close()
        server.stop()


async def test_redis_record_fails_open_quietly(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    limiter = RedisRateLimiter(server.url, RateLimits(None, 100), timeout_s=0.2)
    try:
        server.stop()
        started = time.monotonic()
        await limiter.record(_key(), -50)  # no exception
        assert time.monotonic() - started < 0.5
        assert limiter.degraded and limiter.redis_errors == 1
    finally:
        await limiter.close()
