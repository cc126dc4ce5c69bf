"""Request ids: the checks on client-chosen ids, and `x-request-id` carried into structlog's context."""

from __future__ import annotations

import contextlib
import inspect
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
import structlog

from services.common.handler_wrapping import RpcKind, rewrap
from services.common.logs import REQUEST_ID_KEY
from services.common.sampling_checks import InvalidField

METADATA_KEY = "x-request-id"
# What generation.proto allows a client-chosen id to be: short, and safe to put in logs and headers.
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = "A-Za-z0-9._:-"
_REQUEST_ID = re.compile(f"[{_REQUEST_ID_CHARS}]+")


def new_request_id() -> str:
    """A fresh id for a request that came without one."""
    return uuid.uuid4().hex


def check_request_id(value: str, field: str) -> None:
    """Raise InvalidField naming `field` unless value is 1-128 characters from [A-Za-z0-9._:-]."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidField(field, f"is {len(value)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if not _REQUEST_ID.fullmatch(value):
        raise InvalidField(field, f"may hold only the characters [{_REQUEST_ID_CHARS}] (1 to {MAX_REQUEST_ID_CHARS})")


def is_valid_request_id(value: str) -> bool:
    """Whether value passes check_request_id."""
    return len(value) <= MAX_REQUEST_ID_CHARS and _REQUEST_ID.fullmatch(value) is not None


def _find_request_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def request_id_from_metadata(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's x-request-id, if it sent one (unchecked: see check_request_id)."""
    return _find_request_id(context.invocation_metadata())


def outgoing_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """Metadata for a downstream call that carries the request id on."""
    return ((METADATA_KEY, request_id),)


@contextlib.contextmanager
def bound_request_id(request_id: str | None, **extra: str) -> Iterator[None]:
    """Bind request_id (and any extra keys) in structlog's contextvars for the duration of a handler."""
    values = dict(extra)
    if request_id is not None:
        values[REQUEST_ID_KEY] = request_id
    with structlog.contextvars.bound_contextvars(**values):
        yield


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Binds the incoming x-request-id inside each handler's own task, so logs carry it.

    An id that fails check_request_id is not bound: a log line never carries a client's arbitrary
    metadata (the gateway refuses such calls itself).
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        request_id = _find_request_id(handler_call_details.invocation_metadata)
        if handler is None or request_id is None or not is_valid_request_id(request_id):
            return handler
        return _wrap_handler(handler, request_id)


def _wrap_handler(handler: grpc.RpcMethodHandler, request_id: str) -> grpc.RpcMethodHandler:
    def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with bound_request_id(request_id):
                return await fn(request, context)

        return wrapped

    def streaming(fn: Callable[..., Any]) -> Callable[..., Any]:
        # A streaming handler either yields its responses or awaits context.write() and returns.
        if not inspect.isasyncgenfunction(fn):
            return unary(fn)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with bound_request_id(request_id):
                async for item in fn(request, context):
                    yield item

        return wrapped

    def wrap(behaviour: Callable[..., Any], kind: RpcKind) -> Callable[..., Any]:
        return unary(behaviour) if kind in ("unary", "client_stream") else streaming(behaviour)

    return rewrap(handler, wrap)
