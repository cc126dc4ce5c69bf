"""The gRPC server interceptor: started/handled/handling-time/messages per method and code, one access line."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import structlog
from prometheus_client import CollectorRegistry

from services.common.metrics.grpc_metrics import GrpcServerMetrics
from services.common.rpc_observer import RpcObserver, annotate_call

_IDENTITY = {"request_deserializer": bytes, "response_serializer": bytes}


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"bad":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad: fix it")
    if request == b"boom":
        raise RuntimeError("handler bug")
    annotate_call(request_id="r-1", prompt_tokens=5)
    return request


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for _ in range(int(request)):
        yield b"x"
    if request == b"0":
        await asyncio.sleep(30)  # the client cancels this one


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "test.v1.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(_unary, **_IDENTITY),
            "Count": grpc.unary_stream_rpc_method_handler(_stream, **_IDENTITY),
        },
    )


@pytest.fixture
async def echo() -> AsyncIterator[tuple[grpc.aio.Channel, CollectorRegistry]]:
    registry = CollectorRegistry()
    server = grpc.aio.server(interceptors=[RpcObserver(GrpcServerMetrics(registry))])
    server.add_generic_rpc_handlers((_handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, registry
    await server.stop(0)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"grpc_service": "test.v1.Echo", **labels}) or 0.0


async def test_codes_times_and_messages(echo: tuple[grpc.aio.Channel, Any]) -> None:
    channel, registry = echo
    say = channel.unary_unary("/test.v1.Echo/Say", request_serializer=bytes, response_deserializer=bytes)
    count = channel.unary_stream("/test.v1.Echo/Count", request_serializer=bytes, response_deserializer=bytes)
    with structlog.testing.capture_logs() as logs:
        assert await say(b"hi") == b"hi"
        for request, code in ((b"bad", grpc.StatusCode.INVALID_ARGUMENT), (b"boom", grpc.StatusCode.UNKNOWN)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await say(request)
            assert err.value.code() is code
        assert [m async for m in count(b"3")] == [b"x"] * 3
        call = count(b"0")
        await asyncio.sleep(0.2)
        call.cancel()
        for _ in range(100):  # the server sees the cancellation a moment later
            if _value(registry, "grpc_server_handled_total", grpc_method="Count", grpc_type="server_stream",
                      grpc_code="Canceled"):  # fmt: skip
                break
            await asyncio.sleep(0.05)
    unary = {"grpc_method": "Say", "grpc_type": "unary"}
    assert _value(registry, "grpc_server_started_total", **unary) == 3
    for code in ("OK", "InvalidArgument", "Unknown"):
        assert _value(registry, "grpc_server_handled_total", grpc_code=code, **unary) == 1, code
    assert _value(registry, "grpc_server_handling_seconds_count", **unary) == 3
    assert _value(registry, "grpc_server_msg_sent_total", **unary) == 1
    stream = {"grpc_method": "Count", "grpc_type": "server_stream"}
    assert _value(registry, "grpc_server_handled_total", grpc_code="OK", **stream) == 1
    assert _value(registry, "grpc_server_handled_total", grpc_code="Canceled", **stream) == 1
    assert _value(registry, "grpc_server_msg_sent_total", **stream) == 3
    lines = [line for line in logs if line["event"] == "rpc"]
    assert [line["grpc_code"] for line in lines] == ["OK", "InvalidArgument", "Unknown", "OK", "Canceled"]
    assert lines[0]["request_id"] == "r-1" and lines[0]["prompt_tokens"] == 5
    assert all(line["log_level"] == "info" and line["peer"].startswith("ipv4:") for line in lines)
    assert "request_id" not in lines[1]
