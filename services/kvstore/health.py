"""Whether the backend answers: every call and a periodic probe keep one health status up to date.

The store's own health (SERVICE_NAME) stays SERVING while the backend is down, because it can still
answer every call (with misses and dropped writes). BACKEND_HEALTH_NAME says whether it answers with
data, for operators and for callers that would rather not bother: it flips to NOT_SERVING on the first
failed call and back to SERVING by itself at the next probe that succeeds.

While the backend is down, calls do not wait on it: they fail at once (a miss, a dropped write) and only
the probe keeps trying. A hung Redis would otherwise cost every Lookup and Get its full timeout, and a
miss, which the caller recomputes, is much cheaper than a stalled load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from services.common.proto.meshserve.v1 import kvstore_pb2
from services.kvstore.backend import Backend, BackendUnavailable, PutOutcome, ValueParts
from services.kvstore.metrics import BackendOp, KVStoreMetrics

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVBlockStore"].full_name
BACKEND_HEALTH_NAME = f"{SERVICE_NAME}.backend"

T = TypeVar("T")
log = structlog.get_logger()


class MonitoredBackend:
    """A backend whose every call is timed and reported to the backend health status."""

    def __init__(self, backend: Backend, health: HealthServicer, metrics: KVStoreMetrics) -> None:
        self.backend = backend
        self._health = health
        self._metrics = metrics
        self.serving: bool | None = None  # unknown until the first call or probe

    async def _call(self, op: BackendOp, call: Callable[[], Awaitable[T]], probe: bool = False) -> T:
        if self.serving is False and not probe:
            raise BackendUnavailable("the backend did not answer the last call; waiting for the probe")
        start = time.perf_counter()
        try:
            result = await call()
        except BackendUnavailable as err:
            self._metrics.backend_latency.labels(op).observe(time.perf_counter() - start)
            await self.mark(False, str(err))
            raise
        self._metrics.backend_latency.labels(op).observe(time.perf_counter() - start)
        await self.mark(True)
        return result

    async def mark(self, serving: bool, reason: str = "") -> None:
        """Record whether the backend answered; the health status changes only when this does."""
        if serving == self.serving:
            return
        self.serving = serving
        self._metrics.backend_serving.set(int(serving))
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(BACKEND_HEALTH_NAME, status)
        if serving:
            log.info("backend serving", backend=self.backend.name)
        else:
            log.warning(
                "backend unavailable: answering misses, dropping writes", backend=self.backend.name, error=reason
            )

    async def probe_forever(self, interval_s: float) -> None:
        """Ping every interval_s, so the status recovers even when no call comes."""
        while True:
            await self.ping()
            await asyncio.sleep(interval_s)

    async def ping(self) -> bool:
        """Whether the backend answers now (and the status updated to say so)."""
        try:
            await self._call("ping", self.backend.ping, probe=True)
        except BackendUnavailable:
            return False
        return True

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """As Backend.get_many."""
        return await self._call("get", lambda: self.backend.get_many(keys))

    async def put_many_nx(self, items: Sequence[tuple[str, ValueParts]]) -> list[PutOutcome]:
        """As Backend.put_many_nx."""
        return await self._call("put", lambda: self.backend.put_many_nx(items))

    async def exists_prefix(self, keys: Sequence[str]) -> int:
        """As Backend.exists_prefix."""
        return await self._call("exists", lambda: self.backend.exists_prefix(keys))

    async def delete(self, keys: Sequence[str]) -> None:
        """As Backend.delete."""
        await self._call("delete", lambda: self.backend.delete(keys))

    async def register_format(self, key: str, record: bytes) -> bytes:
        """As Backend.register_format."""
        return await self._call("register_format", lambda: self.backend.register_format(key, record))
