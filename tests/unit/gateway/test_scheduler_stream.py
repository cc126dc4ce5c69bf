"""SchedulerStream against an in-process scheduler: routing by id, aborts, and a broken stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.scheduler_stream import SchedulerStream, is_final


class EchoScheduler:
    """Answers each submit with its prompt as tokens, one message per two submits; "break" kills the call."""

    def __init__(self) -> None:
        self.calls = 0
        self.aborted: list[str] = []

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        self.calls += 1
        batch: list[scheduler_pb2.RequestEvent] = []
        async for message in request_iterator:
            if message.HasField("abort"):
                self.aborted.append(message.abort.request_id)
                continue
            submit = message.submit
            if submit.request_id == "break":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
            tokens = scheduler_pb2.TokenEvent(
                token_ids=submit.prompt_token_ids, finish_reason=sampling_pb2.FINISH_REASON_LENGTH
            )
            batch.append(scheduler_pb2.RequestEvent(request_id=submit.request_id, tokens=tokens))
            if len(batch) == 2:
                yield scheduler_pb2.StreamResponse(events=batch)
                batch = []


def _submit(request_id: str, *tokens: int) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=tokens)


async def _next(events: asyncio.Queue[scheduler_pb2.RequestEvent]) -> scheduler_pb2.RequestEvent:
    return await asyncio.wait_for(events.get(), timeout=10)


async def test_routes_a_shared_message_and_reopens_after_a_break() -> None:
    fake = EchoScheduler()
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        fake.Stream,
        request_deserializer=scheduler_pb2.StreamRequest.FromString,
        response_serializer=scheduler_pb2.StreamResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("meshserve.v1.Scheduler", {"Stream": handler}),)
    )
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = SchedulerStream(scheduler_pb2_grpc.SchedulerStub(channel))
            first, second = stream.submit(_submit("r1", 1, 2)), stream.submit(_submit("r2", 3))
            got1, got2 = await _next(first), await _next(second)
            assert (got1.request_id, list(got1.tokens.token_ids)) == ("r1", [1, 2])
            assert (got2.request_id, list(got2.tokens.token_ids)) == ("r2", [3])
            assert is_final(got1) and is_final(got2)

            waiting = stream.submit(_submit("r3", 4))
            duplicate = stream.submit(_submit("r3", 5))
            refused = await _next(duplicate)
            assert refused.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            stream.abort("r3")
            broken = stream.submit(_submit("break"))
            failed = await _next(broken)
            assert failed.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "scheduler restarting" in failed.error.message
            assert waiting.empty(), "an aborted request gets no more events"

            again, other = stream.submit(_submit("r4", 7)), stream.submit(_submit("r5", 8))
            assert list((await _next(again)).tokens.token_ids) == [7]
            assert list((await _next(other)).tokens.token_ids) == [8]
            assert fake.calls == 2 and fake.aborted == ["r3"]
            await stream.close()
    finally:
        await server.stop(None)
