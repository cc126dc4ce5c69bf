"""The scheduler's prefix-cache and routing counters over one benchmark run: GetStats before and after it.

The counters are the scheduler's, so they count every client's requests: the figures describe the run only
when the benchmark is the scheduler's sole traffic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import grpc

from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import scheduler_pb2, scheduler_pb2_grpc

STATS_TIMEOUT_S = 10.0


def _rate(hits: int, queries: int) -> float | None:
    return hits / queries if queries else None


def _grown(before: int, after: int) -> int:
    # A counter that went down was restarted (a worker re-attached under its id, or one left the sum), so
    # all of what it holds now was counted during the run.
    return after - before if after >= before else after


@dataclass(frozen=True)
class WorkerCounters:
    """What one worker did during the run."""

    worker_id: str
    # Requests the router placed on it.
    num_routed: int
    # Prompt tokens looked up in its prefix cache, and those found.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int

    @property
    def hit_rate(self) -> float | None:
        """Hits / queries (tokens), None without queries."""
        return _rate(self.prefix_cache_hits, self.prefix_cache_queries)


@dataclass(frozen=True)
class CacheReport:
    """The scheduler's counters over the run: prefix-cache tokens overall and per worker, requests per worker."""

    prefix_cache_queries: int
    prefix_cache_hits: int
    workers: list[WorkerCounters]

    @property
    def hit_rate(self) -> float | None:
        """Hits / queries (tokens) over every worker, None without queries."""
        return _rate(self.prefix_cache_hits, self.prefix_cache_queries)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, hit rates included."""
        return {
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.hit_rate,
            "workers": [{**asdict(w), "prefix_cache_hit_rate": w.hit_rate} for w in self.workers],
        }


def _worker_delta(before: scheduler_pb2.WorkerPoolStats | None, after: scheduler_pb2.WorkerPoolStats) -> WorkerCounters:
    if before is None or after.num_routed < before.num_routed:
        # Attached during the run (or re-attached: its routing count restarted), so everything is new.
        before = scheduler_pb2.WorkerPoolStats()
    return WorkerCounters(
        worker_id=after.worker_id,
        num_routed=_grown(before.num_routed, after.num_routed),
        prefix_cache_queries=_grown(before.prefix_cache_queries, after.prefix_cache_queries),
        prefix_cache_hits=_grown(before.prefix_cache_hits, after.prefix_cache_hits),
        num_steps=_grown(before.num_steps, after.num_steps),
    )


def stats_delta(before: scheduler_pb2.SchedulerStats, after: scheduler_pb2.SchedulerStats) -> CacheReport:
    """The counters' growth from before to after; workers listed after the run, sorted by id."""
    earlier = {w.worker_id: w for w in before.workers}
    return CacheReport(
        prefix_cache_queries=_grown(before.prefix_cache_queries, after.prefix_cache_queries),
        prefix_cache_hits=_grown(before.prefix_cache_hits, after.prefix_cache_hits),
        workers=sorted((_worker_delta(earlier.get(w.worker_id), w) for w in after.workers), key=lambda w: w.worker_id),
    )


async def fetch_stats(address: str, timeout: float = STATS_TIMEOUT_S) -> scheduler_pb2.SchedulerStats:
    """The scheduler's GetStats; ConnectionError naming --scheduler-address when it does not answer."""
    async with insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            stats: scheduler_pb2.SchedulerStats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise ConnectionError(
                f"--scheduler-address {address}: GetStats failed ({err.code().name}: {err.details()})"
            ) from None
    return stats
