"""The scheduler's only call to the kvstore: how many leading blocks of a request's tokens are stored.

Block data never passes through the scheduler (workers read and write the store directly); this answer
only decides whether a request loads a prefix and which worker it goes to.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import structlog

from services.common.channels import open_channel
from services.common.kv_store_limits import MAX_BLOCK_HASHES
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.common.settings import ServiceSettings
from services.common.tls import Security
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Request

log = structlog.get_logger()


class KVStoreLookup:
    """Asks the kvstore for each KV format in use how much of a request's prefix it holds."""

    def __init__(
        self,
        address: str,
        timeout: float,
        metrics: SchedulerMetrics,
        security: Security | ServiceSettings | None = None,
    ) -> None:
        """`security`: TLS and internal token of the channel (the scheduler's settings; None: insecure)."""
        self.address = address
        self.timeout = timeout
        self._metrics = metrics
        self._channel = open_channel(address, security)
        self._stub = kvstore_pb2_grpc.KVBlockStoreStub(self._channel)
        self.num_lookups = 0
        self.num_errors = 0
        self._errors_logged = 0

    async def lookup(self, request: Request, formats: Iterable[tuple[str, int]]) -> None:
        """Set request.stored_blocks for each (kv_format, block_size); a failed lookup leaves 0 (a miss)."""
        for kv_format, block_size in formats:
            hashes = request.get_block_hashes(block_size)[: request.max_reusable_blocks(block_size)]
            if not hashes:
                continue
            request.stored_blocks[kv_format] = await self._count(kv_format, hashes[:MAX_BLOCK_HASHES])

    async def _count(self, kv_format: str, hashes: list[bytes]) -> int:
        self.num_lookups += 1
        try:
            reply = await self._stub.Lookup(
                kvstore_pb2.LookupRequest(kv_format=kv_format, block_hashes=hashes), timeout=self.timeout
            )
        except grpc.aio.AioRpcError as err:
            # Generation never depends on the store: an unreachable one is a miss.
            self.num_errors += 1
            self._metrics.kv_store_lookups.labels(outcome="error").inc()
            if self._errors_logged < 10 or self.num_errors % 1000 == 0:
                self._errors_logged += 1
                log.warning("kv store lookup failed", address=self.address, error=str(err), errors=self.num_errors)
            return 0
        self._metrics.kv_store_lookups.labels(outcome="hit" if reply.num_present else "miss").inc()
        return min(reply.num_present, len(hashes))

    async def close(self) -> None:
        await self._channel.close()
