"""The internal token: internal servers require `authorization: Bearer <token>`, our channels send it.

For meshes that terminate TLS in a sidecar (so mTLS does not reach the process), the shared token of
--internal-token-file is what tells a meshserve peer from anyone else who can reach the port. Health
(grpc.health.v1) and reflection stay open: probes and grpcurl need no secret. The token is compared in
constant time and never logged; a refused call gets UNAUTHENTICATED with a message that names no secret.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any

import grpc
import structlog

METADATA_KEY = "authorization"
SCHEME = "Bearer "
# Methods under these prefixes need no token.
OPEN_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)
REFUSED = "this internal API needs the mesh's internal token (authorization: Bearer, see --internal-token-file)"
# Refusals logged one by one before only every LOG_EVERY-th is.
LOG_FIRST = 10
LOG_EVERY = 1000

log = structlog.get_logger()


def authorization_value(token: str) -> str:
    """The metadata value a caller sends."""
    return SCHEME + token


def is_open(method: str) -> bool:
    """Whether a method is served without the token (health, reflection)."""
    return method.startswith(OPEN_PREFIXES)


def _presented(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, bytes) else value.encode("utf-8", errors="replace")
    return None


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection unless it carries the internal token."""

    def __init__(self, token: str) -> None:
        self._expected = authorization_value(token).encode()
        self.num_refused = 0

    def allows(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call's metadata carries the token (constant time in the token's bytes)."""
        presented = _presented(metadata)
        return presented is not None and hmac.compare_digest(presented, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if is_open(method) or self.allows(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        self.num_refused += 1
        if self.num_refused <= LOG_FIRST or self.num_refused % LOG_EVERY == 0:
            # The method only: what the caller sent may be a real token of another mesh.
            log.warning("internal call refused: no valid internal token", method=method, refused=self.num_refused)
        handler = await continuation(handler_call_details)
        return _refusing(handler)


async def _abort(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses before reading any request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _abort(context)
        yield  # pragma: no cover (abort raises)

    if handler is None:
        # An unknown method: refused all the same, so a caller without the token learns nothing of the API.
        return grpc.unary_unary_rpc_method_handler(unary)
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


# ---- client side: every call on a channel carries the token ----


def _with_token_aio(details: grpc.aio.ClientCallDetails, value: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY])
    metadata.add(METADATA_KEY, value)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token_aio(client_call_details, self._value), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token_aio(client_call_details, self._value), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token_aio(client_call_details, self._value), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self._value = value

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token_aio(client_call_details, self._value), request_iterator)


def aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add the token to every call of an asyncio channel (grpc takes one per call kind)."""
    value = authorization_value(token)
    return [_AioUnaryUnary(value), _AioUnaryStream(value), _AioStreamUnary(value), _AioStreamStream(value)]


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, value: str) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = [*((k, v) for k, v in (details.metadata or ()) if k != METADATA_KEY), (METADATA_KEY, value)]
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a synchronous channel (grpc.intercept_channel)."""

    def __init__(self, token: str) -> None:
        self._value = authorization_value(token)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(_SyncCallDetails(client_call_details, self._value), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(_SyncCallDetails(client_call_details, self._value), request)

    def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(_SyncCallDetails(client_call_details, self._value), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(_SyncCallDetails(client_call_details, self._value), request_iterator)
