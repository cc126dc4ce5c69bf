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


_flood_tasks: dict[str, asyncio.Task[Any] | None] = {}


async def _flood(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    """Big messages until the client goes: its cancellation lands while a write waits on flow control."""
    _flood_tasks["started"] = asyncio.current_task()
    try:
        while True:
            yield b"x" * 256 * 1024
    finally:
        _flood_tasks["closed"] = asyncio.current_task()


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "test.v1.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(_unary, **_IDENTITY),
            "Count": grpc.unary_stream_rpc_method_handler(_stream, **_IDENTITY),
            "Flood": grpc.unary_stream_rpc_method_handler(_flood, **_IDENTITY),
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


async def test_cancelled_streams_keep_their_peer_and_the_server(echo: tuple[grpc.aio.Channel, Any]) -> None:
    """The access line of a call the client cancelled is written after grpc's core let go of the call;
    reading the peer then read freed memory and killed the process (seen as a scheduler segfault)."""
    channel, registry = echo
    say = channel.unary_unary("/test.v1.Echo/Say", request_serializer=bytes, response_deserializer=bytes)
    count = channel.unary_stream("/test.v1.Echo/Count", request_serializer=bytes, response_deserializer=bytes)
    cancelled = 40
    with structlog.testing.capture_logs() as logs:
        for _ in range(cancelled):
            call = count(b"0")
            await asyncio.sleep(0.02)
            call.cancel()
        for _ in range(200):
            if _value(registry, "grpc_server_handled_total", grpc_method="Count", grpc_type="server_stream",
                      grpc_code="Canceled") == cancelled:  # fmt: skip
                break
            await asyncio.sleep(0.05)
        assert await say(b"still here") == b"still here"
    lines = [line for line in logs if line["event"] == "rpc" and line["grpc_code"] == "Canceled"]
    assert len(lines) == cancelled
    assert all(line["peer"].startswith("ipv4:127.0.0.1:") for line in lines)


async def test_a_cancelled_stream_is_closed_in_its_own_task(echo: tuple[grpc.aio.Channel, Any]) -> None:
    """grpc leaves a response generator suspended when its client cancels during a write; the handler's
    `finally` (which releases its requests) must still run at once, in the call's task, not whenever
    the garbage collector finalises the generator."""
    channel, registry = echo
    flood = channel.unary_stream("/test.v1.Echo/Flood", request_serializer=bytes, response_deserializer=bytes)
    _flood_tasks.clear()
    call = flood(b"")
    await call.read()
    await asyncio.sleep(0.2)  # the server fills the flow-control window and waits in a write
    call.cancel()
    for _ in range(100):
        if "closed" in _flood_tasks:
            break
        await asyncio.sleep(0.05)
    assert _flood_tasks.get("closed") is not None, "the handler's finally never ran"
    assert _flood_tasks["closed"] is _flood_tasks["started"]
    assert _value(registry, "grpc_server_handled_total", grpc_method="Flood", grpc_type="server_stream",
                  grpc_code="Canceled") == 1  # fmt: skip
