"""The KVBlockStore gRPC service: RPC glue over a backend, the format registry and the staging area.

Bad input ends a call with INVALID_ARGUMENT or OUT_OF_RANGE (a StatusError raised where it is found,
turned into the call's status in _abort); a PutChunk.shared range this store cannot read ends it with
FAILED_PRECONDITION, and the writer sends its bytes instead. Backend trouble never does: Lookup answers
0, Get ends early, Put counts its blocks as dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
import structlog
from grpc_health.v1._async import HealthServicer

from services.common.errors import StatusError
from services.common.kv_store_limits import MAX_CHUNK_BYTES
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.backend import Backend, BackendUnavailable, PutOutcome, ValueParts, block_key
from services.kvstore.block_format import Block, Rejection, checksum, decode, encode_parts
from services.kvstore.formats import FormatRegistry
from services.kvstore.health import MonitoredBackend
from services.kvstore.metrics import KVStoreMetrics, Rpc
from services.kvstore.put_assembly import CompleteSlice, SliceAssembler
from services.kvstore.settings import (
    GET_BATCH_BYTES,
    GET_BATCH_MAX_BLOCKS,
    GET_FIRST_BATCH_BLOCKS,
    PUT_BATCH_BYTES,
    PUT_BATCH_MAX_BLOCKS,
    KVStoreSettings,
)
from services.kvstore.shared_segments import SharedSegments
from services.kvstore.staging import Completed, Held, Refused, ShapeConflict, Staging, Ticket
from services.kvstore.validation import (
    SliceHeader,
    check_block_hashes,
    check_get_heads,
    check_kv_format,
    invalid,
    shape_to_proto,
)

log = structlog.get_logger()


@dataclass
class _PutTally:
    """One Put stream's outcome so far, and the encoded blocks waiting for one backend write."""

    # Values as parts: payloads that came by shared memory are views, copied by the backend's write.
    batch: list[tuple[str, ValueParts]] = field(default_factory=list)
    batch_bytes: int = 0
    stored: int = 0
    existing: int = 0
    dropped: int = 0
    held: list[Ticket] = field(default_factory=list)

    def add(self, key: str, value: ValueParts) -> None:
        self.batch.append((key, value))
        self.batch_bytes += sum(len(p) for p in value)

    def take_batch(self) -> list[tuple[str, ValueParts]]:
        batch, self.batch, self.batch_bytes = self.batch, [], 0
        return batch

    def own_batch(self) -> None:
        """Copy the queued values out of the writer's shared memory, which it reuses once the Put has ended."""
        self.batch = [(key, [b"".join(parts)]) for key, parts in self.batch]


class KVStoreServicer(kvstore_pb2_grpc.KVBlockStoreServicer):
    """Lookup, Put, Get and Stats over one backend."""

    def __init__(
        self, settings: KVStoreSettings, backend: Backend, health: HealthServicer, metrics: KVStoreMetrics
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.store = MonitoredBackend(backend, health, metrics)
        self.formats = FormatRegistry(self.store)
        self.staging = Staging(settings.staging_capacity_bytes, settings.staging_timeout, metrics.staging_dropped)
        self.shared_segments = SharedSegments(settings.shared_memory)
        metrics.pending_slices.set_function(self._pending_slices)
        metrics.bytes_used.set_function(lambda: backend.stats().bytes_used)
        self._probe: asyncio.Task[None] | None = None
        # Writes of streams that ended abruptly (the caller went away), finished in the background.
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Learn whether the backend answers, then keep checking in the background."""
        await self.store.ping()
        self._probe = asyncio.create_task(self.store.probe_forever(self.settings.backend_probe_interval))

    async def close(self) -> None:
        """Stop probing, finish background writes, release the backend (after the server has stopped)."""
        if self._probe is not None:
            self._probe.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        self.shared_segments.close()
        await self.store.backend.close()

    def _pending_slices(self) -> int:
        # Partial blocks expire on the next Put or Stats; a scrape in between must not show them.
        self.staging.expire()
        return self.staging.pending_slices

    async def _abort(self, context: grpc.aio.ServicerContext, rpc: Rpc, err: StatusError) -> NoReturn:
        if err.status.code == grpc.StatusCode.FAILED_PRECONDITION:
            # Not bad input: a writer elsewhere tried shared memory once, and now sends bytes.
            log.info("shared memory unreadable", rpc=rpc, error=err.status.details)
        else:
            self.metrics.bad_request(rpc)
            log.info("bad request", rpc=rpc, code=err.status.code.name, error=err.status.details)
        await context.abort_with_status(err.status)
        raise AssertionError("abort_with_status returned") from err  # pragma: no cover

    # Lookup

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        try:
            check_kv_format(request.kv_format)
            check_block_hashes(request.block_hashes)
        except StatusError as err:
            await self._abort(context, "lookup", err)
        keys = [block_key(request.kv_format, h) for h in request.block_hashes]
        try:
            present = await self.store.exists_prefix(keys)
        except BackendUnavailable:
            present = 0
        self.metrics.found("lookup", present, len(keys) - present)
        return kvstore_pb2.LookupResponse(num_present=present)

    # Put

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutChunk], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        tally = _PutTally()
        assembler = SliceAssembler()
        registered = True  # whether the open slice's shape is its kv_format's (False: the backend cannot say)
        try:
            async for chunk in request_iterator:
                data = self._shared_payload(chunk)
                opened, done = assembler.feed(chunk, data)
                self.metrics.received(len(chunk.data) if data is None else len(data), shared=data is not None)
                if opened is not None:
                    registered = await self.formats.check(opened.kv_format, opened.shape)
                if done is not None:
                    await self._take(done, registered, tally)
            assembler.finish()
        except StatusError as err:
            # Blocks completed before the bad chunk are stored, as the contract promises.
            await self._flush(tally)
            await self._abort(context, "put", err)
        except BaseException:
            # The caller went away (cancelled): its completed blocks are still worth keeping, written after
            # this call has ended, so out of the memory the writer may be reusing now.
            tally.own_batch()
            task = asyncio.create_task(self._flush(tally))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise
        await self._flush(tally)
        return kvstore_pb2.PutResponse(
            num_blocks_stored=tally.stored,
            num_blocks_existing=tally.existing,
            num_slices_pending=sum(self.staging.is_pending(t) for t in tally.held),
            num_blocks_dropped=tally.dropped,
        )

    def _shared_payload(self, chunk: kvstore_pb2.PutChunk) -> memoryview | None:
        """The chunk's payload read from the writer's shared memory, or None when it came in data."""
        if not chunk.HasField("shared"):
            return None
        if chunk.data:
            raise invalid("shared", "is set beside data; a chunk carries its payload in one of them, not both")
        # A view: a whole block is written to the backend (its one copy) before this Put answers, or copied
        # when the Put is cancelled; staging copies a slice.
        return self.shared_segments.read(chunk.shared)

    async def _take(self, done: CompleteSlice, registered: bool, tally: _PutTally) -> None:
        """Queue a complete block for writing, or hold a partial one in staging."""
        header = done.header
        if not registered:
            tally.dropped += 1
            self.metrics.dropped("backend_unavailable")
            return
        if header.whole:
            tally.add(header.key, self._encode(header, done.parts))
        else:
            try:
                staged = self.staging.add(header.key, header.shape, header.head_start, done.payload())
            except ShapeConflict as err:
                raise invalid("header.shape", f"{header.shape} differs: {err}") from err
            if isinstance(staged, Completed):
                tally.add(header.key, self._encode(header, staged.parts))
            elif isinstance(staged, Held):
                tally.held.append(staged.ticket)
            elif isinstance(staged, Refused):
                tally.dropped += 1
                self.metrics.dropped("staging")
        if tally.batch_bytes >= PUT_BATCH_BYTES or len(tally.batch) >= PUT_BATCH_MAX_BLOCKS:
            await self._flush(tally)

    @staticmethod
    def _encode(header: SliceHeader, parts: Sequence[bytes | memoryview]) -> ValueParts:
        return encode_parts(header.kv_format, header.block_hash, header.shape, parts)

    async def _flush(self, tally: _PutTally) -> None:
        """Write the queued blocks in one backend call (SET NX each); none of it is an error to the caller."""
        batch = tally.take_batch()
        if not batch:
            return
        try:
            outcomes = await self.store.put_many_nx(batch)
        except BackendUnavailable:
            tally.dropped += len(batch)
            self.metrics.dropped("backend_unavailable", len(batch))
            return
        stored = outcomes.count(PutOutcome.STORED)
        existing = outcomes.count(PutOutcome.EXISTING)
        refused = len(outcomes) - stored - existing
        tally.stored += stored
        tally.existing += existing
        tally.dropped += refused
        self.metrics.put_outcomes(stored, existing)
        if refused:
            self.metrics.dropped("backend_refused", refused)

    # Get

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetChunk]:
        try:
            check_kv_format(request.kv_format)
            check_block_hashes(request.block_hashes)
            # The shape is known before reading when this replica has seen the format; otherwise the
            # first block says it (and every later block must have the same).
            shape = self.formats.shape_of(request.kv_format)
            heads = None if shape is None else check_get_heads(shape, request.head_start, request.head_count)
        except StatusError as err:
            await self._abort(context, "get", err)
        hashes = list(request.block_hashes)
        sent = 0
        batch = GET_FIRST_BATCH_BLOCKS
        bad_request = False
        try:
            while sent < len(hashes):
                keys = [block_key(request.kv_format, h) for h in hashes[sent : sent + batch]]
                try:
                    values = await self.store.get_many(keys)
                except BackendUnavailable:
                    return
                for key, value in zip(keys, values, strict=True):
                    if value is None:
                        return
                    block = decode(value, request.kv_format, hashes[sent], shape)
                    if isinstance(block, Rejection):
                        await self._reject(key, block)
                        return
                    if heads is None:
                        shape = block.shape
                        try:
                            heads = check_get_heads(shape, request.head_start, request.head_count)
                        except StatusError as err:
                            bad_request = True
                            await self._abort(context, "get", err)
                    for message in self._block_messages(sent, block, heads):
                        yield message
                    sent += 1
                # Hold about GET_BATCH_BYTES of values per read, whatever the block size.
                largest = max(len(v) for v in values if v is not None)
                batch = max(1, min(GET_BATCH_MAX_BLOCKS, GET_BATCH_BYTES // largest))
        finally:
            if not bad_request:
                self.metrics.found("get", sent, len(hashes) - sent)

    def _block_messages(self, index: int, block: Block, heads: tuple[int, int]) -> Iterator[kvstore_pb2.GetChunk]:
        head_start, head_count = heads
        per_head = block.shape.bytes_per_head
        view = block.payload[head_start * per_head : (head_start + head_count) * per_head]
        whole = head_count == block.shape.num_kv_heads
        yield kvstore_pb2.GetChunk(
            header=kvstore_pb2.GetBlockHeader(
                index=index,
                block_hash=block.block_hash,
                shape=shape_to_proto(block.shape),
                head_start=head_start,
                head_count=head_count,
                payload_length=len(view),
                checksum=block.checksum if whole else checksum((view,)),
            )
        )
        for offset in range(0, len(view), MAX_CHUNK_BYTES):
            yield kvstore_pb2.GetChunk(data=bytes(view[offset : offset + MAX_CHUNK_BYTES]))
        self.metrics.sent(len(view))

    async def _reject(self, key: str, rejection: Rejection) -> None:
        """A stored value failed its checks: count it and delete it, so the next writer can store it again."""
        self.metrics.rejected_value(rejection.reason)
        log.warning("rejected a stored block", key=key, reason=rejection.reason, detail=rejection.detail)
        # If the backend is down now, the value is read, rejected and deleted again later.
        with contextlib.suppress(BackendUnavailable):
            await self.store.delete([key])

    # Stats

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StoreStats:
        pending = self._pending_slices()
        backend = self.store.backend.stats()
        metrics = self.metrics
        return kvstore_pb2.StoreStats(
            backend=self.store.backend.name,
            backend_serving=bool(self.store.serving),
            num_blocks=backend.num_blocks,
            bytes_used=backend.bytes_used,
            capacity_bytes=backend.capacity_bytes,
            hits=metrics.hits,
            misses=metrics.misses,
            bytes_in=metrics.bytes_in,
            bytes_out=metrics.bytes_out,
            evictions=metrics.evictions,
            rejected=dict(metrics.rejected),
            blocks_stored=metrics.blocks_stored,
            num_pending_slices=pending,
        )
