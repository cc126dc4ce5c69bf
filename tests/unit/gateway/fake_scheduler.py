"""An in-process Scheduler (GetModelInfo and Stream only) whose answers each test scripts, and a gateway on it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import Gateway
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizer import TextTokenizer

Behaviour = Callable[[scheduler_pb2.SubmitRequest], AsyncIterator[scheduler_pb2.RequestEvent]]


def ready_info(**overrides: Any) -> scheduler_pb2.ModelInfo:
    fields: dict[str, Any] = {
        "model_name": "tiny",
        "model_identity": "tiny-1",
        "max_model_len": 256,
        "vocab_size": 512,
        "num_ready_workers": 1,
        "accepting": True,
    }
    fields.update(overrides)
    return scheduler_pb2.ModelInfo(**fields)


def tokens(request_id: str, ids: list[int], final: bool = False) -> scheduler_pb2.RequestEvent:
    event = scheduler_pb2.TokenEvent(token_ids=ids)
    if final:
        event.finish_reason = sampling_pb2.FINISH_REASON_LENGTH
        event.stop_kind = scheduler_pb2.STOP_KIND_LENGTH
    return scheduler_pb2.RequestEvent(request_id=request_id, tokens=event)


async def count_up(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
    """max_tokens events (4 when unset) of one token each, 100, 101, ..., the last one final."""
    n = submit.sampling.max_tokens if submit.sampling.HasField("max_tokens") else 4
    for i in range(n):
        await asyncio.sleep(0)
        yield tokens(submit.request_id, [100 + i % 200], final=i == n - 1)


@dataclass
class FakeScheduler:
    """Answers GetModelInfo with `info` (or fails it with `info_error`) and runs `behaviour` per submit."""

    info: scheduler_pb2.ModelInfo = field(default_factory=ready_info)
    info_error: grpc.StatusCode | None = None
    behaviour: Behaviour = count_up
    submits: list[scheduler_pb2.SubmitRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    address: str = ""
    _server: grpc.aio.Server | None = None

    async def GetModelInfo(
        self, request: scheduler_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ModelInfo:
        if self.info_error is not None:
            await context.abort(self.info_error, "fake scheduler at 10.9.9.9:50052 is down")
        return self.info

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        out: asyncio.Queue[scheduler_pb2.RequestEvent] = asyncio.Queue()
        running: dict[str, asyncio.Task[None]] = {}

        async def run(submit: scheduler_pb2.SubmitRequest) -> None:
            async for event in self.behaviour(submit):
                out.put_nowait(event)

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("abort"):
                    self.aborted.append(message.abort.request_id)
                    task = running.pop(message.abort.request_id, None)
                    if task is not None:
                        task.cancel()
                else:
                    self.submits.append(message.submit)
                    running[message.submit.request_id] = asyncio.create_task(run(message.submit))

        reader = asyncio.create_task(read())
        try:
            while True:
                yield scheduler_pb2.StreamResponse(events=[await out.get()])
        finally:
            reader.cancel()
            for task in running.values():
                task.cancel()

    async def start(self) -> str:
        server = grpc.aio.server()
        handlers = {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.GetModelInfo,
                request_deserializer=scheduler_pb2.GetModelInfoRequest.FromString,
                response_serializer=scheduler_pb2.ModelInfo.SerializeToString,
            ),
            "Stream": grpc.stream_stream_rpc_method_handler(
                self.Stream,
                request_deserializer=scheduler_pb2.StreamRequest.FromString,
                response_serializer=scheduler_pb2.StreamResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("meshserve.v1.Scheduler", handlers),))
        self.address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(self.address)
        await server.start()
        self._server = server
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(None)


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


async def wait_health(address: str, serving: bool, timeout: float = 20.0) -> None:
    want = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    deadline = asyncio.get_running_loop().time() + timeout
    while await health(address) != want:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"gateway health never became {'SERVING' if serving else 'NOT_SERVING'}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_gateway(
    tokenizer: TextTokenizer, schedulers: list[FakeScheduler], wait_serving: bool = True, **settings: Any
) -> AsyncIterator[Gateway]:
    """A gateway on a free port in front of the fake schedulers, polling them every 20 ms."""
    for scheduler in schedulers:
        if not scheduler.address:
            await scheduler.start()
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "scheduler_address": ",".join(s.address for s in schedulers),
        "scheduler_poll_interval": 0.02,
        "shutdown_grace_period": 1.0,
    }
    values.update(settings)
    gateway = Gateway(GatewaySettings(**values), tokenizer, GatewayMetrics(CollectorRegistry()))
    await gateway.start()
    try:
        if wait_serving:
            await wait_health(gateway.address, serving=True)
        yield gateway
    finally:
        await gateway.service.server.stop(None)
        await gateway.close()
        for scheduler in schedulers:
            await scheduler.stop()
