"""One Scheduler.Stream call shared by all of a gateway's requests, reopened when it breaks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger()


def is_final(event: scheduler_pb2.RequestEvent) -> bool:
    """Whether a request's stream ends with this event."""
    return event.HasField("error") or event.tokens.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED


def _error_event(request_id: str, code: grpc.StatusCode, message: str) -> scheduler_pb2.RequestEvent:
    return scheduler_pb2.RequestEvent(
        request_id=request_id, error=scheduler_pb2.RequestError(code=code.value[0], message=message)
    )


@dataclass
class _Connection:
    """One open Stream call: its outgoing queue, the requests it carries, and the task reading it."""

    outbox: asyncio.Queue[scheduler_pb2.StreamRequest | None] = field(default_factory=asyncio.Queue)
    requests: dict[str, asyncio.Queue[scheduler_pb2.RequestEvent]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    broken: bool = False

    async def messages(self) -> AsyncIterator[scheduler_pb2.StreamRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message


class SchedulerStream:
    """Multiplexes requests over one Stream: one message per step for all of them, not one per token each."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._connection: _Connection | None = None

    def submit(self, request: scheduler_pb2.SubmitRequest) -> asyncio.Queue[scheduler_pb2.RequestEvent]:
        """Send a request; its events (the last one final) arrive on the returned queue."""
        conn = self._open()
        events: asyncio.Queue[scheduler_pb2.RequestEvent] = asyncio.Queue()
        if request.request_id in conn.requests:
            events.put_nowait(
                _error_event(
                    request.request_id,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {request.request_id!r} is already running",
                )
            )
            return events
        conn.requests[request.request_id] = events
        conn.outbox.put_nowait(scheduler_pb2.StreamRequest(submit=request))
        return events

    def abort(self, request_id: str) -> None:
        """Stop a request this gateway no longer wants; no more events come for it."""
        conn = self._connection
        if conn is not None and conn.requests.pop(request_id, None) is not None and not conn.broken:
            conn.outbox.put_nowait(scheduler_pb2.StreamRequest(abort=scheduler_pb2.AbortRequest(request_id=request_id)))

    async def close(self) -> None:
        """Cancel the call (its requests fail with UNAVAILABLE) and wait for the reader to end."""
        conn, self._connection = self._connection, None
        if conn is not None and conn.reader is not None:
            conn.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await conn.reader

    def _open(self) -> _Connection:
        if self._connection is not None and not self._connection.broken:
            return self._connection
        conn = _Connection()
        call = self._stub.Stream(conn.messages())
        conn.reader = asyncio.create_task(self._read(conn, call))
        self._connection = conn
        return conn

    async def _read(self, conn: _Connection, call: grpc.aio.StreamStreamCall) -> None:
        code, message = grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream"
        try:
            async for response in call:
                for event in response.events:
                    events = conn.requests.get(event.request_id)
                    if events is None:
                        continue  # aborted here; the scheduler had sent it already
                    events.put_nowait(event)
                    if is_final(event):
                        del conn.requests[event.request_id]
        except grpc.aio.AioRpcError as err:
            code, message = err.code(), f"the scheduler stream failed: {err.details()}"
            log.warning("scheduler stream failed", code=code.name, details=err.details())
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down"
            call.cancel()
            raise
        finally:
            # Every request still on this call fails; the next submit opens a new one.
            conn.broken = True
            conn.outbox.put_nowait(None)
            for request_id, events in conn.requests.items():
                events.put_nowait(_error_event(request_id, code, message))
            conn.requests.clear()
