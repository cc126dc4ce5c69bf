"""One server interceptor that watches every RPC: gRPC server metrics and one access log line per call.

The line says method, peer, status, duration and whatever the handler added with `annotate_call`
(the gateway adds the request id and token counts). Health checks and reflection log at debug: a
Kubernetes probe every few seconds would otherwise drown the lines that matter.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from services.common.handler_wrapping import Behaviour, RpcKind, rewrap
from services.common.metrics.grpc_metrics import GrpcServerMetrics
from services.common.metrics.names import status_code_label

log = structlog.get_logger()

_QUIET_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"}
)


@dataclass
class CallRecord:
    """What the access line of the current RPC will say beyond method, peer, status and duration."""

    fields: dict[str, object] = field(default_factory=dict)


_current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("meshserve_call_record", default=None)


def start_call_record() -> CallRecord:
    """A fresh record for the call this task now handles (an RPC here, an HTTP request in the gateway's
    access log middleware); annotate_call adds to it from anywhere below."""
    record = CallRecord()
    _current.set(record)
    return record


def annotate_call(**fields: object) -> None:
    """Add fields (request_id, prompt_tokens, ...) to the current RPC's access line; a no-op outside one."""
    record = _current.get()
    if record is not None:
        record.fields.update(fields)


@dataclass(frozen=True)
class _Call:
    service: str
    method: str
    kind: str

    @property
    def labels(self) -> tuple[str, str, str]:
        return (self.service, self.method, self.kind)


def _split(full_method: str) -> tuple[str, str]:
    # "/meshserve.v1.Generation/Generate" -> ("meshserve.v1.Generation", "Generate")
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or full_method


class RpcObserver(grpc.aio.ServerInterceptor):
    """Counts, times and logs every call the server takes."""

    def __init__(self, metrics: GrpcServerMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, method = _split(handler_call_details.method)
        return self._wrap(handler, service, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, service: str, method: str) -> grpc.RpcMethodHandler:
        def wrap(behaviour: Behaviour, kind: RpcKind) -> Behaviour:
            call = _Call(service, method, kind)
            client_streams = kind in ("client_stream", "bidi_stream")
            if kind in ("unary", "client_stream"):
                return self._unary(behaviour, call, client_streams)
            return self._streaming(behaviour, call, client_streams)

        return rewrap(handler, wrap)

    def _unary(self, fn: Callable[..., Awaitable[Any]], call: _Call, client_streams: bool) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            record, started, peer = self._start(call, context)
            code = "OK"
            try:
                if client_streams:
                    request = self._count_received(request, call)
                else:
                    self.metrics.msg_received.labels(*call.labels).inc()
                response = await fn(request, context)
                code = _final_code(context)
                self.metrics.msg_sent.labels(*call.labels).inc()
                return response
            except BaseException as err:
                code = _code_of(err, context)
                raise
            finally:
                self._finish(call, record, started, code, peer)

        return wrapped

    def _streaming(self, fn: Callable[..., Any], call: _Call, client_streams: bool) -> Callable[..., Any]:
        if not inspect.isasyncgenfunction(fn):
            # A streaming handler that awaits context.write() and returns: sent messages go uncounted.
            return self._unary(fn, call, client_streams)

        # The generator's responses are written here, by a coroutine, rather than re-yielded: grpc
        # never closes a response generator whose client cancelled while a write was pending, so a
        # wrapper generator (and the handler's own `finally`, which releases its requests) would run
        # only when the garbage collector finalises it, after grpc let go of the call; touching the
        # context then read freed memory (a cygrpc segfault). A coroutine takes the cancellation in
        # its own task, while the call is live, and closes the handler's generator at once.
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> None:
            record, started, peer = self._start(call, context)
            code = "OK"
            sent = self.metrics.msg_sent.labels(*call.labels)
            if client_streams:
                request = self._count_received(request, call)
            else:
                self.metrics.msg_received.labels(*call.labels).inc()
            responses = fn(request, context)
            try:
                try:
                    async for item in responses:
                        try:
                            await context.write(item)
                        except grpc.aio.InternalError as err:
                            # The write failed in grpc's core: the client went away mid-write. That
                            # is a cancellation, not a handler fault for grpc to log as an error.
                            raise asyncio.CancelledError("the client left during a write") from err
                        sent.inc()
                finally:
                    await responses.aclose()
                code = _final_code(context)
            except BaseException as err:
                code = _code_of(err, context)
                raise
            finally:
                self._finish(call, record, started, code, peer)

        return wrapped

    async def _count_received(self, requests: AsyncIterator[Any], call: _Call) -> AsyncIterator[Any]:
        received = self.metrics.msg_received.labels(*call.labels)
        async for item in requests:
            received.inc()
            yield item

    def _start(self, call: _Call, context: grpc.aio.ServicerContext) -> tuple[CallRecord, float, str]:
        self.metrics.started.labels(*call.labels).inc()
        # The peer is read now, while the call is live: once a client cancels, grpc's core frees the
        # call and context.peer() reads freed memory (a segfault in cygrpc, seen under load).
        return start_call_record(), time.monotonic(), context.peer()

    def _finish(self, call: _Call, record: CallRecord, started: float, code: str, peer: str) -> None:
        elapsed = time.monotonic() - started
        label = status_code_label(code)
        self.metrics.handled.labels(*call.labels, label).inc()
        self.metrics.handling_seconds.labels(*call.labels).observe(elapsed)
        emit = log.debug if call.service in _QUIET_SERVICES else log.info
        emit(
            "rpc",
            grpc_method=f"{call.service}/{call.method}",
            peer=peer,
            grpc_code=label,
            duration_ms=round(elapsed * 1000, 3),
            **record.fields,
        )


def _final_code(context: grpc.aio.ServicerContext) -> str:
    """The status a handler that returned normally ends with (set_code, else OK)."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


def _code_of(err: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The status a handler that raised ends with: abort()'s code, CANCELLED, or UNKNOWN as grpc reports."""
    if isinstance(err, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        return code.name
    return "UNKNOWN"
