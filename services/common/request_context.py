"""Carries `x-request-id` from gRPC metadata into structlog's context, across every hop."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
import structlog

from services.common.logs import REQUEST_ID_KEY

METADATA_KEY = "x-request-id"


def new_request_id() -> str:
    """A fresh id for a request that came without one."""
    return uuid.uuid4().hex


def _find_request_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def request_id_from_metadata(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's x-request-id, if it sent one."""
    return _find_request_id(context.invocation_metadata())


def outgoing_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """Metadata for a downstream call that carries the request id on."""
    return ((METADATA_KEY, request_id),)


@contextlib.contextmanager
def bound_request_id(request_id: str | None) -> Iterator[None]:
    """Bind request_id in structlog's contextvars for the duration of a handler."""
    if request_id is None:
        yield
        return
    with structlog.contextvars.bound_contextvars(**{REQUEST_ID_KEY: request_id}):
        yield


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Binds the incoming x-request-id inside each handler's own task, so logs carry it."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        request_id = _find_request_id(handler_call_details.invocation_metadata)
        if handler is None or request_id is None:
            return handler
        return _wrap_handler(handler, request_id)


def _wrap_handler(handler: grpc.RpcMethodHandler, request_id: str) -> grpc.RpcMethodHandler:
    def unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with bound_request_id(request_id):
                return await fn(request, context)

        return wrapped

    def streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with bound_request_id(request_id):
                async for item in fn(request, context):
                    yield item

        return wrapped

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)
