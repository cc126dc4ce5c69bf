"""Where a submitted request's events go: a Submit call's queue or a Stream's per-step batches."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc

from services.common.errors import abort_with_request_error
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.common.sampling_checks import InvalidField
from services.scheduler.request import Request


@dataclass
class Failure:
    """How a request ends without a finish reason: a gRPC status, with the bad field for INVALID_ARGUMENT."""

    code: grpc.StatusCode
    message: str
    field: str = ""
    description: str = ""
    # For RESOURCE_EXHAUSTED / UNAVAILABLE: when to retry (the caller's google.rpc.RetryInfo).
    retry_after: float = 0.0
    # The ErrorInfo reason (errors.Reason); empty: the default of the code.
    reason: str = ""

    @classmethod
    def invalid(cls, err: InvalidField) -> Failure:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, f"{err.field}: {err.description}", err.field, err.description)

    async def abort(self, context: grpc.aio.ServicerContext) -> NoReturn:
        """End a Submit call with this status."""
        await abort_with_request_error(context, self.to_proto())

    def to_proto(self) -> scheduler_pb2.RequestError:
        return scheduler_pb2.RequestError(
            code=self.code.value[0],
            message=self.message,
            field=self.field,
            description=self.description,
            retry_after_seconds=self.retry_after,
            reason=self.reason,
        )


Item = scheduler_pb2.TokenEvent | Failure
# Where a submission's events go: (request_id, event or failure).
Sink = Callable[[str, Item], None]


def is_final(item: Item) -> bool:
    return isinstance(item, Failure) or item.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class Submission:
    """A request in flight from a Submit call or a Stream: where its token events go."""

    request: Request
    sink: Sink
    first_token_at: float | None = None
    finished: bool = False

    def send(self, item: Item) -> None:
        self.sink(self.request.request_id, item)


# Messages a Stream caller may leave unread before the stream is ended: about one per step, so only a
# caller that stopped reading gets there (a gateway reads continuously), and its memory stays bounded.
STREAM_BUFFER_RESPONSES = 4096


class StreamOut:
    """A Stream's outgoing side: events of one loop iteration (one step's dispatch) go out as one message.

    A caller that leaves max_unread messages unread is cut off: the stream ends (the servicer answers
    RESOURCE_EXHAUSTED) and its requests are released, instead of its queue growing without bound."""

    def __init__(self, release: Callable[[str], None], max_unread: int = STREAM_BUFFER_RESPONSES) -> None:
        self.owned: set[str] = set()
        self.responses: asyncio.Queue[scheduler_pb2.StreamResponse | None] = asyncio.Queue()
        self.closed = False
        # Set once the caller fell max_unread messages behind; nothing more is queued after that.
        self.overflowed = False
        self._max_unread = max_unread
        self._release = release
        self._pending: list[scheduler_pb2.RequestEvent] = []
        self._flush_scheduled = False

    def put(self, request_id: str, item: Item) -> None:
        """An event of one of this stream's requests; the final one releases it."""
        if isinstance(item, Failure):
            self.refuse(request_id, item)
        else:
            self._add(scheduler_pb2.RequestEvent(request_id=request_id, tokens=item))
        if is_final(item) and request_id in self.owned:
            self.owned.discard(request_id)
            self._release(request_id)

    def refuse(self, request_id: str, failure: Failure) -> None:
        """Report a failure without touching a running request of the same id."""
        self._add(scheduler_pb2.RequestEvent(request_id=request_id, error=failure.to_proto()))

    def _add(self, event: scheduler_pb2.RequestEvent) -> None:
        if self.overflowed:
            return
        self._pending.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.overflowed:
            return
        if self.responses.qsize() >= self._max_unread:
            self.overflowed = True
            self._pending = []
            self.responses.put_nowait(None)
            return
        if self._pending:
            self.responses.put_nowait(scheduler_pb2.StreamResponse(events=self._pending))
            self._pending = []
        self.end_if_done()

    def end_if_done(self) -> None:
        """After the caller half-closed, end the stream once its last request has finished."""
        if self.closed and not self.owned and not self._flush_scheduled and not self.overflowed:
            self.responses.put_nowait(None)
