"""The Scheduler gRPC service: RPC glue over the Cluster (Submit, Stream, Abort, stats, Attach)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.common.errors import Reason, abort_invalid_argument
from services.common.proto.meshserve.v1 import (
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from services.common.sampling_checks import InvalidField
from services.common.tracing import Tracing
from services.scheduler.cluster import Cluster
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.settings import SchedulerSettings
from services.scheduler.submissions import STREAM_BUFFER_RESPONSES, Failure, Item, StreamOut, is_final
from services.scheduler.worker_stream import WorkerStream

# Events a Submit caller may leave unread before its request is ended: one per step, so this is a
# generous bound that only a caller that stopped reading reaches.
SUBMIT_BUFFER_EVENTS = 4096


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Turns RPCs into Cluster calls and the Cluster's events into stream messages."""

    def __init__(
        self,
        settings: SchedulerSettings,
        metrics: SchedulerMetrics,
        on_ready_change: Callable[[bool], Awaitable[None]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.cluster = Cluster(settings, metrics, on_ready_change, tracing)
        # Open Stream calls (one per gateway), ended by drain() once their requests are done.
        self.streams: set[StreamOut] = set()

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        events: asyncio.Queue[Item] = asyncio.Queue()

        def sink(request_id: str, item: Item) -> None:
            if events.qsize() >= SUBMIT_BUFFER_EVENTS and not isinstance(item, Failure):
                self.cluster.fail(
                    request_id,
                    Failure(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "the caller is not reading its stream; aborted",
                        reason=Reason.CLIENT_TOO_SLOW,
                    ),
                )
                return
            events.put_nowait(item)

        admitted = self.cluster.submit(request, sink)
        if isinstance(admitted, Failure):
            await admitted.abort(context)
        try:
            while True:
                item = await events.get()
                if isinstance(item, Failure):
                    await item.abort(context)
                yield item
                if is_final(item):
                    return
        finally:
            self.cluster.release(request.request_id)

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        out = StreamOut(self.cluster.release)
        self.streams.add(out)
        reader = asyncio.create_task(self._read_stream(request_iterator, out))
        try:
            while (response := await out.responses.get()) is not None:
                yield response
            if out.overflowed:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the caller left {STREAM_BUFFER_RESPONSES} messages unread; its requests were aborted",
                )
        finally:
            self.streams.discard(out)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            for request_id in list(out.owned):
                self.cluster.release(request_id)

    async def _read_stream(self, requests: AsyncIterator[scheduler_pb2.StreamRequest], out: StreamOut) -> None:
        try:
            async for message in requests:
                if message.HasField("submit"):
                    submit = message.submit
                    # A refusal (ALREADY_EXISTS included) must not release a running request of that id.
                    admitted = self.cluster.submit(submit, out.put)
                    if isinstance(admitted, Failure):
                        out.refuse(submit.request_id, admitted)
                    else:
                        out.owned.add(submit.request_id)
                elif message.HasField("abort") and message.abort.request_id in out.owned:
                    out.owned.discard(message.abort.request_id)
                    self.cluster.release(message.abort.request_id)
        except grpc.aio.AioRpcError:
            pass
        out.closed = True
        out.end_if_done()

    async def Abort(
        self, request: scheduler_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortResponse:
        sub = self.cluster.submissions.get(request.request_id)
        found = self.cluster.abort(request.request_id)
        if sub is not None:
            sub.send(
                scheduler_pb2.TokenEvent(
                    finish_reason=sampling_pb2.FINISH_REASON_ABORT, stop_kind=scheduler_pb2.STOP_KIND_ABORT
                )
            )
        return scheduler_pb2.AbortResponse(found=found)

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return self.cluster.stats()

    async def GetModelInfo(
        self, request: scheduler_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ModelInfo:
        return self.cluster.model_info()

    async def Attach(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        messages = request_iterator.__aiter__()
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            return
        if not first.HasField("hello"):
            await abort_invalid_argument(context, "hello", "the first message on Attach must be a WorkerHello")
        try:
            self.cluster.check_hello(first.hello)
        except InvalidField as err:
            await abort_invalid_argument(context, f"hello.{err.field}", err.description)
        worker = self.cluster.attach(first.hello)
        stream = WorkerStream(self.cluster, worker)
        reader = asyncio.create_task(stream.read(messages))
        try:
            yield worker_pb2.SchedulerMessage(
                accepted=worker_pb2.AttachAccepted(
                    worker_id=worker.worker_id,
                    heartbeat_interval_seconds=self.cluster.settings.worker_heartbeat_interval,
                )
            )
            self.cluster.mark_ready(worker)
            await self.cluster.publish_readiness()
            async for message in stream.steps():
                yield message
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.cluster.detach(worker, stream.loss())
            await self.cluster.publish_readiness()

    async def drain(self, grace: float) -> None:
        """Scheduler shutdown: refuse new work, let running requests finish, end gateway streams and workers."""
        await self.cluster.shutdown(grace)
        # A gateway's stream never ends by itself; the server's graceful stop would wait out the grace on it.
        for out in list(self.streams):
            out.closed = True
            out.end_if_done()
