"""The store's counters: Prometheus metrics (meshserve:kvstore_*) and the same totals for the Stats RPC.

Every count is made through one method here, so /metrics and StoreStats never disagree.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Literal

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics.names import metric
from services.kvstore.block_format import RejectReason
from services.kvstore.staging import DropReason

Rpc = Literal["lookup", "get", "put"]
BackendOp = Literal["get", "put", "exists", "delete", "register_format", "ping"]
# Why a block given to Put was not stored: the backend did not answer, refused it (out of room),
# or its partial slices were dropped from staging.
DroppedReason = Literal["backend_unavailable", "backend_refused", "staging"]

# Loopback Redis answers in well under a millisecond; a hung one within --redis-timeout (1 s).
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class KVStoreMetrics:
    """All kvstore metrics, created once per process."""

    def __init__(self, registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
        self._hits = Counter(metric("kvstore_hits"), "Blocks found, by RPC", ["rpc"], registry=registry)
        self._misses = Counter(
            metric("kvstore_misses"), "Blocks asked for and not found, by RPC", ["rpc"], registry=registry
        )
        self._bytes_in = Counter(metric("kvstore_bytes_in"), "Payload bytes received by Put", registry=registry)
        self._shared_bytes_in = Counter(
            metric("kvstore_shared_memory_bytes_in"),
            "Payload bytes of Put read from writers' shared memory on this host (part of bytes_in)",
            registry=registry,
        )
        self._bytes_out = Counter(metric("kvstore_bytes_out"), "Payload bytes sent by Get", registry=registry)
        self._evictions = Counter(
            metric("kvstore_evictions"), "Blocks the memory backend evicted to stay in capacity", registry=registry
        )
        self._rejected = Counter(
            metric("kvstore_rejected_blocks"),
            "Stored values that failed a check on read and were deleted, by reason",
            ["reason"],
            registry=registry,
        )
        self._stored = Counter(metric("kvstore_blocks_stored"), "Blocks stored", registry=registry)
        self._existing = Counter(
            metric("kvstore_blocks_existing"), "Blocks put that were stored already", registry=registry
        )
        self._dropped = Counter(
            metric("kvstore_dropped_blocks"), "Blocks put and not stored, by reason", ["reason"], registry=registry
        )
        self._staging_dropped = Counter(
            metric("kvstore_staging_dropped_slices"),
            "Partial-block slices dropped from staging, by reason",
            ["reason"],
            registry=registry,
        )
        self._bad_requests = Counter(
            metric("kvstore_bad_requests"), "Calls ended for bad input, by RPC", ["rpc"], registry=registry
        )
        self.backend_latency = Histogram(
            metric("kvstore_backend_latency_seconds"),
            "Backend call latency, by operation",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.backend_serving = Gauge(
            metric("kvstore_backend_serving"), "1 while the backend answers", registry=registry
        )
        self.pending_slices = Gauge(
            metric("kvstore_pending_slices"), "Slices waiting for their block's other heads", registry=registry
        )
        self.bytes_used = Gauge(
            metric("kvstore_bytes_used"), "Bytes of stored values (memory backend)", registry=registry
        )
        # The totals StoreStats reports.
        self.hits = 0
        self.misses = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.evictions = 0
        self.blocks_stored = 0
        self.rejected: Tally[str] = Tally()

    def found(self, rpc: Rpc, hits: int, misses: int) -> None:
        """A Lookup or Get found `hits` blocks and not `misses`."""
        self._hits.labels(rpc).inc(hits)
        self._misses.labels(rpc).inc(misses)
        self.hits += hits
        self.misses += misses

    def received(self, nbytes: int, shared: bool = False) -> None:
        """Put took nbytes of payload (shared: read from the writer's shared memory, not sent in data)."""
        self._bytes_in.inc(nbytes)
        self.bytes_in += nbytes
        if shared:
            self._shared_bytes_in.inc(nbytes)

    def sent(self, nbytes: int) -> None:
        """Get sent nbytes of payload."""
        self._bytes_out.inc(nbytes)
        self.bytes_out += nbytes

    def evicted(self, blocks: int) -> None:
        """The memory backend evicted blocks."""
        self._evictions.inc(blocks)
        self.evictions += blocks

    def rejected_value(self, reason: RejectReason) -> None:
        """A stored value failed a check and was deleted."""
        self._rejected.labels(reason).inc()
        self.rejected[reason] += 1

    def put_outcomes(self, stored: int, existing: int) -> None:
        """Blocks a write stored, and found stored already."""
        self._stored.inc(stored)
        self._existing.inc(existing)
        self.blocks_stored += stored

    def dropped(self, reason: DroppedReason, blocks: int = 1) -> None:
        """Blocks given to Put and not stored."""
        self._dropped.labels(reason).inc(blocks)

    def staging_dropped(self, reason: DropReason, slices: int) -> None:
        """Staging dropped partial-block slices."""
        self._staging_dropped.labels(reason).inc(slices)

    def bad_request(self, rpc: Rpc) -> None:
        """A call ended with INVALID_ARGUMENT or OUT_OF_RANGE."""
        self._bad_requests.labels(rpc).inc()
