"""Rebuilding a gRPC method handler around a wrapped behaviour: what every server interceptor here does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import grpc

RpcKind = Literal["unary", "server_stream", "client_stream", "bidi_stream"]
Behaviour = Callable[..., Any]


def rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Behaviour, RpcKind], Behaviour]) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour replaced by wrap(behaviour, kind), serializers kept."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, "unary"), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, "server_stream"), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, "client_stream"), **kwargs)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, "bidi_stream"), **kwargs)
