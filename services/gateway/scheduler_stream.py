"""One Scheduler.Stream call shared by all of a gateway's requests to one scheduler, reopened when it breaks."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.errors import Reason
from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger()

# What a public client is told when the scheduler connection fails; the details (which may name
# internal addresses) go to the gateway's log only.
SCHEDULER_UNAVAILABLE = "the scheduler is unavailable; retry"
SHUTTING_DOWN = "the gateway is shutting down; retry on another replica"


def is_final(event: scheduler_pb2.RequestEvent) -> bool:
    """Whether a request's stream ends with this event."""
    return event.HasField("error") or event.tokens.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED


def error_event(
    request_id: str, code: grpc.StatusCode, message: str, field: str = "", description: str = "", reason: str = ""
) -> scheduler_pb2.RequestEvent:
    """A final event failing one request, in the scheduler's own form."""
    error = scheduler_pb2.RequestError(
        code=code.value[0], message=message, field=field, description=description, reason=reason
    )
    return scheduler_pb2.RequestEvent(request_id=request_id, error=error)


class RequestEvents:
    """One request's events on their way from the scheduler stream to its call.

    While the call keeps up, each event waits alone and goes out as its own response. When it falls
    behind (its client reads slowly, or its own event loop is busy), new token events merge into the
    one already waiting, the way vLLM merges a slow client's outputs: a backlog costs its token ids, not a
    message each. Bounded: when more than `limit` tokens wait, put() refuses and the stream aborts the
    request; fail() then replaces whatever waits with the final error.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: deque[scheduler_pb2.RequestEvent] = deque()
        self._waiting_tokens = 0
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, event: scheduler_pb2.RequestEvent) -> bool:
        """Queue an event; False (and nothing queued) when too many tokens would wait.

        A final event is always taken: after it nothing more can arrive, so the bound still holds.
        """
        tokens = len(event.tokens.token_ids) if event.HasField("tokens") else 0
        if self._waiting_tokens + tokens > self.limit and not is_final(event):
            return False
        self._waiting_tokens += tokens
        tail = self._items[-1] if self._items else None
        if tail is not None and tail.HasField("tokens") and event.HasField("tokens") and not is_final(tail):
            _merge(tail.tokens, event.tokens)
        else:
            self._items.append(event)
        self._ready.set()
        return True

    def fail(self, event: scheduler_pb2.RequestEvent) -> None:
        """Drop what waits (the request is over) and queue the final error."""
        self._items.clear()
        self._waiting_tokens = 0
        self._items.append(event)
        self._ready.set()

    async def get(self) -> scheduler_pb2.RequestEvent:
        """The next event, waiting for one if need be."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        event = self._items.popleft()
        self._waiting_tokens -= len(event.tokens.token_ids) if event.HasField("tokens") else 0
        return event


def _merge(into: scheduler_pb2.TokenEvent, later: scheduler_pb2.TokenEvent) -> None:
    """Fold a later event of the same request into one still waiting: tokens appended, the end carried."""
    into.token_ids.extend(later.token_ids)
    into.logprobs.extend(later.logprobs)
    into.top_logprobs.extend(later.top_logprobs)
    into.num_cached_tokens = into.num_cached_tokens or later.num_cached_tokens
    if later.finish_reason:
        into.finish_reason = later.finish_reason
        into.stop_kind = later.stop_kind
        if later.HasField("stop_token_id"):
            into.stop_token_id = later.stop_token_id


@dataclass
class _Connection:
    """One open Stream call: its outgoing queue, the requests it carries, and the task reading it."""

    # Unbounded, but each request puts at most one submit and one abort on it, and the gateway's
    # admission cap bounds the requests.
    outbox: asyncio.Queue[scheduler_pb2.StreamRequest | None] = field(default_factory=asyncio.Queue)
    requests: dict[str, RequestEvents] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None
    broken: bool = False

    async def messages(self) -> AsyncIterator[scheduler_pb2.StreamRequest]:
        while (message := await self.outbox.get()) is not None:
            yield message


class SchedulerStream:
    """Multiplexes requests over one Stream: one message per step for all of them, not one per token each."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, max_buffered_tokens: int) -> None:
        self._stub = stub
        self._max_buffered_tokens = max_buffered_tokens
        self._connection: _Connection | None = None

    @property
    def in_flight(self) -> int:
        """Requests submitted on this stream whose final event has not arrived."""
        conn = self._connection
        return 0 if conn is None or conn.broken else len(conn.requests)

    def submit(self, request: scheduler_pb2.SubmitRequest) -> RequestEvents:
        """Send a request; its events (the last one final) arrive on the returned buffer."""
        events = RequestEvents(self._max_buffered_tokens)
        message = scheduler_pb2.StreamRequest(submit=request)
        size = message.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            # The scheduler would fail the whole shared stream on an oversized message; fail this one alone.
            events.put(
                error_event(
                    request.request_id,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "request too large",
                    "request",
                    f"the tokenized request is {size} bytes; the limit between gateway and scheduler is "
                    f"{MAX_MESSAGE_BYTES}; send a shorter prompt",
                )
            )
            return events
        conn = self._open()
        if request.request_id in conn.requests:
            events.put(
                error_event(
                    request.request_id,
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"request_id {request.request_id!r} is already running",
                )
            )
            return events
        conn.requests[request.request_id] = events
        conn.outbox.put_nowait(message)
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

    def _deliver(self, conn: _Connection, shared: scheduler_pb2.RequestEvent) -> None:
        events = conn.requests.get(shared.request_id)
        if events is None:
            return  # aborted here; the scheduler had sent it already
        # A parsed event lives in its StreamResponse's arena (upb) and keeps the whole step's response,
        # every other request's events included, alive while it waits. Its own copy (0.5 us, ~550
        # bytes) keeps the buffering of a slow request to its own events.
        event = scheduler_pb2.RequestEvent()
        event.CopyFrom(shared)
        if events.put(event):
            if is_final(event):
                del conn.requests[event.request_id]
            return
        # Its client stopped reading: end this request alone, here and at the scheduler.
        self.abort(event.request_id)
        log.warning("slow client aborted", request_id=event.request_id, buffered_tokens=events.limit)
        events.fail(
            error_event(
                event.request_id,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the client reads too slowly: over {events.limit} tokens were waiting to be sent; "
                "read the stream as it arrives",
                reason=Reason.CLIENT_TOO_SLOW,
            )
        )

    async def _read(self, conn: _Connection, call: grpc.aio.StreamStreamCall) -> None:
        message = SCHEDULER_UNAVAILABLE
        try:
            async for response in call:
                for event in response.events:
                    self._deliver(conn, event)
            log.warning("scheduler stream ended")
        except grpc.aio.AioRpcError as err:
            log.warning("scheduler stream failed", code=err.code().name, details=err.details())
        except asyncio.CancelledError:
            message = SHUTTING_DOWN
            call.cancel()
            raise
        finally:
            # Every request still on this call fails; the next submit opens a new one.
            conn.broken = True
            conn.outbox.put_nowait(None)
            for request_id, events in conn.requests.items():
                events.fail(error_event(request_id, grpc.StatusCode.UNAVAILABLE, message))
            conn.requests.clear()
