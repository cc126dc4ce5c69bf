"""Per-API-key rate limits: requests per minute and tokens per minute.

Algorithm: GCRA (the generic cell rate algorithm, a token bucket kept as one timestamp). Each key and
limit L per minute has a theoretical arrival time (TAT); a unit costs T = 60 s / L. A request of cost n
at time `now` conforms when max(TAT, now) + n*T - now <= 60 s, and then TAT moves there. So a key may
spend a whole minute's budget at once (a burst of L), and the budget refills continuously at L/60 per
second; over any interval t a key gets at most L + t*L/60. A refused request's wait is exact: it conforms
after `retry_after` seconds (nothing else consuming the key meanwhile). A refused request costs nothing
and a request must conform to both limits, or neither is charged. An absent key is a full bucket, so
state can be dropped (in-process) or expire (Redis TTL) as soon as TAT <= now, without changing any
answer.

Tokens: like vLLM's usage and OpenAI's limits, a request's tokens are prompt + completion. The
completion's length is unknown at admission, so admission reserves prompt_tokens + max_new_tokens (as
OpenAI does with max_tokens), and when the request ends the caller corrects the charge with
`record(key, decision.correction(used_tokens))`, giving back what was not generated. Reserving up front
is what makes the limit hold under concurrency: charging completions only as they finish would let a
key start any number of long requests while its bucket still looks full. The reservation is capped at
one minute's budget (L tokens), so a request whose max_tokens exceeds the limit (max_tokens unset often
means the whole context) still runs once the bucket is full instead of never; its actual usage, charged
by record(), may put the key in debt, which later requests wait out, so the long-run rate still holds.

Redis (shared by gateway replicas): the same algorithm in one Lua script per call, so a check and its
charge are atomic across replicas; time is Redis's (TIME), so replicas with skewed clocks agree. Keys
are `meshserve:ratelimit:{<sha256 of the API key, 32 hex>}:requests|tokens` (the API key is never
stored; the braces are a Redis Cluster hash tag, keeping both keys of a script in one slot), each with
a TTL of its TAT, so idle keys expire.

Failure policy: fail open, to per-replica limits. If Redis does not answer within timeout_s (0.2 s
by default: the whole call, connecting included), the request is decided by an in-process limiter
with the same limits, a warning is logged (once per outage) and the error counted; for a second after a
failure Redis is not tried (then one call probes it), so during an outage only about one call a second
waits, and at most timeout_s. A key may then get up to replicas x its limit, but Redis being down never
refuses or stalls a request. Corrections (record) follow the same rule: while Redis is skipped or fails
they go to the local limiter (a refund Redis misses only makes the key wait a little longer).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from services.common.redis_pool import bounded_redis

log = structlog.get_logger()

WINDOW_S = 60.0
DEFAULT_MAX_KEYS = 100_000
DEFAULT_REDIS_TIMEOUT_S = 0.2
DEFAULT_REDIS_RETRY_INTERVAL_S = 1.0
KEY_PREFIX = "meshserve:ratelimit:"
REQUESTS_FLAG = "--rate-limit-requests-per-minute"
TOKENS_FLAG = "--rate-limit-tokens-per-minute"

# Slack in conformance checks, so that waiting exactly retry_after (rounded up to the millisecond)
# is never refused by float rounding.
_EPS_S = 1e-6
# In-process: expired keys dropped per call at most (amortized: each is dropped once).
_SWEEP_PER_CALL = 64
# Redis stores times in microseconds since this epoch (2023-11-14), to keep doubles' precision.
_EPOCH_S = 1_700_000_000


@dataclass(frozen=True)
class RateLimits:
    """Per-key limits; None is unlimited."""

    requests_per_minute: int | None
    tokens_per_minute: int | None

    def __post_init__(self) -> None:
        for name, value in (("requests", self.requests_per_minute), ("tokens", self.tokens_per_minute)):
            if value is not None and value < 1:
                raise ValueError(f"{name} per minute must be at least 1 (or unset), not {value}")

    @property
    def any(self) -> bool:
        """Whether some limit is set."""
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def reservation(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Tokens admission charges: prompt + max_new, capped at one minute's budget (0 without a token limit)."""
        if self.tokens_per_minute is None:
            return 0
        return min(max(prompt_tokens, 0) + max(max_new_tokens, 0), self.tokens_per_minute)


@dataclass(frozen=True)
class Decision:
    """Whether a request may start now; if not, when to retry and why (a message for the client)."""

    allowed: bool
    retry_after: float = 0.0  # seconds, > 0 when refused
    message: str = ""
    reserved_tokens: int = 0  # charged at admission (when allowed)

    def correction(self, used_tokens: int) -> int:
        """What to pass to record() once the request used used_tokens (prompt + completion): < 0 refunds."""
        return used_tokens - self.reserved_tokens if self.allowed else 0


class RateLimiter(Protocol):
    """Decides whether a key may start a request now, and accounts its tokens."""

    async def admit(self, key: str, prompt_tokens: int, max_new_tokens: int) -> Decision:
        """Charge one request and prompt + max_new tokens if both limits allow it; otherwise charge nothing."""
        ...

    async def record(self, key: str, tokens: int) -> None:
        """Correct the key's token charge by `tokens` (negative: give back unused reserved tokens)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def _round_up(seconds: float) -> float:
    """A wait as retry_after: rounded up to the millisecond, at least 1 ms."""
    return max(math.ceil(seconds * 1000 - 1e-6) / 1000, 0.001)


def _decide(limits: RateLimits, reserved: int, wait_requests: float, wait_tokens: float) -> Decision:
    """The decision from each limit's wait in seconds (<= 0: conforms now)."""
    if wait_requests <= _EPS_S and wait_tokens <= _EPS_S:
        return Decision(True, reserved_tokens=reserved)
    return _refusal(limits, reserved, wait_requests, wait_tokens)


def _refusal(limits: RateLimits, reserved: int, wait_requests: float, wait_tokens: float) -> Decision:
    """A refusal naming the limits that are not met (the one with the longer wait, if none clearly is)."""
    retry_after = _round_up(max(wait_requests, wait_tokens))
    by_requests = wait_requests > _EPS_S or wait_requests >= wait_tokens
    by_tokens = wait_tokens > _EPS_S or not by_requests
    reasons = []
    if by_requests:
        reasons.append(f"{limits.requests_per_minute} requests per minute ({REQUESTS_FLAG})")
    if by_tokens:
        reasons.append(
            f"{limits.tokens_per_minute} tokens per minute ({TOKENS_FLAG}), and this request reserves "
            f"{reserved} (prompt + max_tokens)"
        )
    return Decision(
        False,
        retry_after,
        f"rate limit exceeded: this API key may use {' and '.join(reasons)}; "
        f"retry in {math.ceil(retry_after * 100) / 100:.2f} s",
    )


def _interval(per_minute: int | None) -> float:
    """Seconds one unit costs (0: unlimited)."""
    return WINDOW_S / per_minute if per_minute else 0.0


def bucket_id(key: str) -> str:
    """What identifies an API key in Redis and in memory: a sha256 hex prefix (128 bits), never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class InProcessRateLimiter:
    """GCRA per key in this process's memory, for one gateway (or while Redis is down).

    Memory is bounded: a key whose TATs have passed (a full bucket) is dropped, oldest-used first, a few
    per call, and at most max_keys are tracked, evicting the least recently used (a key evicted while
    not idle starts again with a full bucket).
    """

    def __init__(
        self,
        limits: RateLimits,
        *,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.max_keys = max_keys
        self._clock = clock
        self._request_interval = _interval(limits.requests_per_minute)
        self._token_interval = _interval(limits.tokens_per_minute)
        # id -> [requests TAT, tokens TAT], in order of last use.
        self._tats: OrderedDict[bytes, list[float]] = OrderedDict()

    @property
    def tracked_keys(self) -> int:
        """Keys whose state is held."""
        return len(self._tats)

    def _state(self, key: str, now: float) -> list[float]:
        self._sweep(now)
        kid = hashlib.sha256(key.encode()).digest()[:16]  # a client-sent key may be long: bound its memory
        state = self._tats.get(kid)
        if state is None:
            state = self._tats[kid] = [now, now]
            while len(self._tats) > self.max_keys:
                self._tats.popitem(last=False)
        else:
            self._tats.move_to_end(kid)
        return state

    def _sweep(self, now: float) -> None:
        for _ in range(_SWEEP_PER_CALL):
            oldest = next(iter(self._tats.values()), None)
            if oldest is None or max(oldest) > now:
                return
            self._tats.popitem(last=False)

    async def admit(self, key: str, prompt_tokens: int, max_new_tokens: int) -> Decision:
        """See RateLimiter.admit."""
        now = self._clock()
        state = self._state(key, now)
        reserved = self.limits.reservation(prompt_tokens, max_new_tokens)
        request_tat = max(state[0], now) + self._request_interval
        token_tat = max(state[1], now) + reserved * self._token_interval
        wait_requests = request_tat - WINDOW_S - now if self._request_interval else 0.0
        wait_tokens = token_tat - WINDOW_S - now if self._token_interval else 0.0
        decision = _decide(self.limits, reserved, wait_requests, wait_tokens)
        if decision.allowed:
            state[0], state[1] = request_tat, token_tat
        return decision

    async def record(self, key: str, tokens: int) -> None:
        """See RateLimiter.record. A refund never makes the bucket fuller than full."""
        if not self._token_interval or not tokens:
            return
        now = self._clock()
        state = self._state(key, now)
        state[1] = max(max(state[1], now) + tokens * self._token_interval, now)

    async def close(self) -> None:
        """Nothing to release."""


# KEYS: requests key, tokens key. ARGV: requests interval, tokens interval (microseconds per unit,
# 0: unlimited), tokens to reserve, window (microseconds), epoch (seconds). Returns {allowed (0/1),
# requests wait, tokens wait} (waits in microseconds, as strings: Redis truncates Lua numbers).
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - tonumber(ARGV[5])) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[4])
local function check(key, interval, cost)
  if interval <= 0 then return 0, nil end
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  return new_tat - window - now, new_tat
end
local function store(key, tat)
  if tat and tat > now then
    redis.call('SET', key, string.format('%.17g', tat), 'PX', math.ceil((tat - now) / 1000))
  end
end
local wait_r, tat_r = check(KEYS[1], tonumber(ARGV[1]), 1)
local wait_t, tat_t = check(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]))
local allowed = 0
if wait_r <= 1 and wait_t <= 1 then
  store(KEYS[1], tat_r)
  store(KEYS[2], tat_t)
  allowed = 1
end
return {allowed, string.format('%.17g', wait_r), string.format('%.17g', wait_t)}
"""

# KEYS: tokens key. ARGV: tokens interval (microseconds), tokens to add (negative: refund), epoch.
_RECORD_LUA = """
local t = redis.call('TIME')
local now = (tonumber(t[1]) - tonumber(ARGV[3])) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
tat = tat + tonumber(ARGV[2]) * tonumber(ARGV[1])
if tat > now then
  redis.call('SET', KEYS[1], string.format('%.17g', tat), 'PX', math.ceil((tat - now) / 1000))
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


def redis_keys(key: str) -> tuple[str, str]:
    """The Redis keys of an API key's requests and tokens TATs."""
    prefix = f"{KEY_PREFIX}{{{bucket_id(key)}}}:"
    return prefix + "requests", prefix + "tokens"


class RedisRateLimiter:
    """GCRA in Redis, shared by every gateway replica that names the same database.

    Fails open to an in-process limiter with the same limits when Redis does not answer within
    timeout_s (see the module docstring); `redis_errors` counts the failures, `degraded` says whether
    the last attempt failed, and on_error (e.g. a Prometheus counter's inc) is called on each.
    """

    def __init__(
        self,
        url: str,
        limits: RateLimits,
        *,
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
        retry_interval_s: float = DEFAULT_REDIS_RETRY_INTERVAL_S,
        max_connections: int = 64,
        on_error: Callable[[], object] | None = None,
        fallback: InProcessRateLimiter | None = None,
    ) -> None:
        self.limits = limits
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.fallback = fallback or InProcessRateLimiter(limits)
        self.redis_errors = 0
        self._on_error = on_error
        self._down_since: float | None = None  # monotonic time of the failure that began the outage
        self._retry_at = 0.0  # monotonic: before this, Redis is not tried
        self._probing = False
        self._redis: Redis = bounded_redis(
            url,
            max_connections=max_connections,
            timeout_s=timeout_s,
            pool_timeout_s=timeout_s,
            client_name="meshserve-gateway-ratelimit",
        )
        self._admit_script = self._redis.register_script(_ADMIT_LUA)
        self._record_script = self._redis.register_script(_RECORD_LUA)
        self._args = (
            repr(_interval(limits.requests_per_minute) * 1e6),
            repr(_interval(limits.tokens_per_minute) * 1e6),
        )

    @property
    def degraded(self) -> bool:
        """Whether Redis failed on the last attempt (decisions are per replica until it answers again)."""
        return self._down_since is not None

    def _skip_redis(self) -> bool:
        """During an outage, until retry_at, and while one call probes Redis: decide locally."""
        return self._down_since is not None and (self._probing or time.monotonic() < self._retry_at)

    def _failed(self, err: BaseException) -> None:
        self.redis_errors += 1
        if self._on_error is not None:
            self._on_error()
        now = time.monotonic()
        self._retry_at = now + self.retry_interval_s
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "rate limits are per replica until Redis answers again",
                error=f"{type(err).__name__}: {err}",
                timeout_s=self.timeout_s,
            )

    def _answered(self) -> None:
        if self._down_since is not None:
            outage_s = round(time.monotonic() - self._down_since, 3)
            log.info("rate limits are shared through Redis again", outage_s=outage_s)
            self._down_since = None

    async def _call(self, script: AsyncScript, keys: list[str], args: list[str]) -> Any:
        """Run a script within timeout_s; None (counted and logged) if Redis failed."""
        probing = self._down_since is not None
        self._probing = probing
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await script(keys=keys, args=args)
        except (RedisError, OSError) as err:  # TimeoutError is an OSError
            self._failed(err)
            return None
        finally:
            if probing:
                self._probing = False
        self._answered()
        return result

    async def admit(self, key: str, prompt_tokens: int, max_new_tokens: int) -> Decision:
        """See RateLimiter.admit."""
        if self._skip_redis():
            return await self.fallback.admit(key, prompt_tokens, max_new_tokens)
        reserved = self.limits.reservation(prompt_tokens, max_new_tokens)
        result = await self._call(
            self._admit_script,
            list(redis_keys(key)),
            [*self._args, str(reserved), repr(WINDOW_S * 1e6), str(_EPOCH_S)],
        )
        if result is None:
            return await self.fallback.admit(key, prompt_tokens, max_new_tokens)
        allowed, wait_requests, wait_tokens = result
        if allowed:  # the script's word is final: it has charged the key
            return Decision(True, reserved_tokens=reserved)
        return _refusal(self.limits, reserved, float(wait_requests) / 1e6, float(wait_tokens) / 1e6)

    async def record(self, key: str, tokens: int) -> None:
        """See RateLimiter.record; never raises (a correction Redis fails to take goes to the local limiter)."""
        if self.limits.tokens_per_minute is None or not tokens:
            return
        if self._skip_redis():
            await self.fallback.record(key, tokens)
            return
        args = [self._args[1], str(tokens), str(_EPOCH_S)]
        result = await self._call(self._record_script, [redis_keys(key)[1]], args)
        if result is None:
            await self.fallback.record(key, tokens)

    async def close(self) -> None:
        """Close the pool's connections."""
        await self._redis.aclose()


def make_rate_limiter(
    limits: RateLimits,
    redis_url: str | None,
    *,
    timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
    on_redis_error: Callable[[], object] | None = None,
) -> RateLimiter | None:
    """The limiter for these limits: shared through Redis when redis_url is set; None when no limit is set."""
    if not limits.any:
        return None
    if redis_url:
        return RedisRateLimiter(redis_url, limits, timeout_s=timeout_s, on_error=on_redis_error)
    return InProcessRateLimiter(limits)
