"""SchedulerStream against an in-process scheduler: routing by id, aborts, bounds, and a broken stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway import scheduler_stream
from services.gateway.scheduler_stream import SCHEDULER_UNAVAILABLE, RequestEvents, SchedulerStream, is_final

StreamHandler = Callable[
    [AsyncIterator[scheduler_pb2.StreamRequest], grpc.aio.ServicerContext], AsyncIterator[scheduler_pb2.StreamResponse]
]


class EchoScheduler:
    """Answers each submit with its prompt as tokens, one message per two submits; "break" kills the call.

    A submit whose first token is 0 instead gets `count` single-token events of which only the last is
    final, all in one message (a request that outruns its reader).
    """

    def __init__(self) -> None:
        self.calls = 0
        self.aborted: list[str] = []
        self.abort_seen = asyncio.Event()

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        self.calls += 1
        batch: list[scheduler_pb2.RequestEvent] = []
        async for message in request_iterator:
            if message.HasField("abort"):
                self.aborted.append(message.abort.request_id)
                self.abort_seen.set()
                continue
            submit = message.submit
            if submit.request_id == "break":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "ipv4:10.1.2.3:50052: connection reset")
            if submit.prompt_token_ids[0] == 0:
                count = submit.prompt_token_ids[1]
                events = [
                    scheduler_pb2.RequestEvent(
                        request_id=submit.request_id,
                        tokens=scheduler_pb2.TokenEvent(
                            token_ids=[i],
                            finish_reason=(
                                sampling_pb2.FINISH_REASON_LENGTH
                                if i == count - 1
                                else sampling_pb2.FINISH_REASON_UNSPECIFIED
                            ),
                        ),
                    )
                    for i in range(count)
                ]
                yield scheduler_pb2.StreamResponse(events=events)
                continue
            tokens = scheduler_pb2.TokenEvent(
                token_ids=submit.prompt_token_ids, finish_reason=sampling_pb2.FINISH_REASON_LENGTH
            )
            batch.append(scheduler_pb2.RequestEvent(request_id=submit.request_id, tokens=tokens))
            if len(batch) == 2:
                yield scheduler_pb2.StreamResponse(events=batch)
                batch = []


async def _serve(stream: StreamHandler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        stream,
        request_deserializer=scheduler_pb2.StreamRequest.FromString,
        response_serializer=scheduler_pb2.StreamResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("meshserve.v1.Scheduler", {"Stream": handler}),)
    )
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _submit(request_id: str, *tokens: int) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=tokens)


async def _next(events: RequestEvents) -> scheduler_pb2.RequestEvent:
    return await asyncio.wait_for(events.get(), timeout=10)


async def _expect_echo(stream: SchedulerStream) -> None:
    """Two plain requests (the fake answers them in pairs) come back whole."""
    a, b = stream.submit(_submit("echo-a", 5)), stream.submit(_submit("echo-b", 6))
    assert list((await _next(a)).tokens.token_ids) == [5]
    assert list((await _next(b)).tokens.token_ids) == [6]


async def test_routes_a_shared_message_and_reopens_after_a_break() -> None:
    fake = EchoScheduler()
    server, address = await _serve(fake.Stream)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = SchedulerStream(scheduler_pb2_grpc.SchedulerStub(channel), max_buffered_tokens=8)
            first, second = stream.submit(_submit("r1", 1, 2)), stream.submit(_submit("r2", 3))
            assert stream.in_flight == 2
            got1, got2 = await _next(first), await _next(second)
            assert (got1.request_id, list(got1.tokens.token_ids)) == ("r1", [1, 2])
            assert (got2.request_id, list(got2.tokens.token_ids)) == ("r2", [3])
            assert is_final(got1) and is_final(got2)
            assert stream.in_flight == 0

            waiting = stream.submit(_submit("r3", 4))
            duplicate = stream.submit(_submit("r3", 5))
            refused = await _next(duplicate)
            assert refused.error.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
            stream.abort("r3")
            broken = stream.submit(_submit("break"))
            failed = await _next(broken)
            assert failed.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
            # What the scheduler said (an internal address here) stays in the gateway's log.
            assert failed.error.message == SCHEDULER_UNAVAILABLE
            assert len(waiting) == 0, "an aborted request gets no more events"

            again, other = stream.submit(_submit("r4", 7)), stream.submit(_submit("r5", 8))
            assert list((await _next(again)).tokens.token_ids) == [7]
            assert list((await _next(other)).tokens.token_ids) == [8]
            assert fake.calls == 2 and fake.aborted == ["r3"]
            await stream.close()
    finally:
        await server.stop(None)


async def test_a_request_that_outruns_its_reader_is_aborted_alone() -> None:
    fake = EchoScheduler()
    server, address = await _serve(fake.Stream)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = SchedulerStream(scheduler_pb2_grpc.SchedulerStub(channel), max_buffered_tokens=4)
            # 4 tokens fit exactly, merged into one waiting event as they arrive unread; 10 do not.
            fits = stream.submit(_submit("fits", 0, 4))
            merged = await _next(fits)
            assert list(merged.tokens.token_ids) == [0, 1, 2, 3] and is_final(merged)

            slow = stream.submit(_submit("slow", 0, 10))
            failed = await _next(slow)
            assert failed.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "reads too slowly" in failed.error.message
            await asyncio.wait_for(fake.abort_seen.wait(), timeout=10)
            assert fake.aborted == ["slow"]

            # The shared stream is unharmed.
            await _expect_echo(stream)
            assert fake.calls == 1
            await stream.close()
    finally:
        await server.stop(None)


async def test_an_oversized_submission_fails_alone_without_touching_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The real limit is 64 MiB; a small one makes the same point without building a huge prompt.
    limit = 1000
    monkeypatch.setattr(scheduler_stream, "MAX_MESSAGE_BYTES", limit)
    fake = EchoScheduler()
    server, address = await _serve(fake.Stream)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = SchedulerStream(scheduler_pb2_grpc.SchedulerStub(channel), max_buffered_tokens=4)
            failed = await _next(stream.submit(_submit("huge", *range(1, limit))))
            assert failed.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert failed.error.field == "request" and str(limit) in failed.error.description
            assert fake.calls == 0, "nothing was sent"
            await _expect_echo(stream)
            await stream.close()
    finally:
        await server.stop(None)


@pytest.mark.parametrize("final", [False, True])
async def test_request_events_bound(final: bool) -> None:
    events = RequestEvents(limit=2)

    def tokens(
        *ids: int, finish: sampling_pb2.FinishReason.ValueType = sampling_pb2.FINISH_REASON_UNSPECIFIED
    ) -> scheduler_pb2.RequestEvent:
        event = scheduler_pb2.TokenEvent(token_ids=ids, finish_reason=finish)
        return scheduler_pb2.RequestEvent(request_id="r", tokens=event)

    assert events.put(tokens(1)) and events.put(tokens(2))
    last = tokens(3, finish=sampling_pb2.FINISH_REASON_STOP if final else sampling_pb2.FINISH_REASON_UNSPECIFIED)
    assert events.put(last) is final  # only a final event may pass the bound
    merged = await events.get()
    assert list(merged.tokens.token_ids) == ([1, 2, 3] if final else [1, 2])
    assert events.put(tokens(4))
    events.fail(scheduler_pb2.RequestEvent(request_id="r", error=scheduler_pb2.RequestError(code=8)))
    assert len(events) == 1 and (await events.get()).HasField("error"), "fail() replaces what waits"


def test_events_merge_while_the_call_is_behind() -> None:
    events = RequestEvents(limit=100)

    def ev(*ids: int, final: bool = False) -> scheduler_pb2.RequestEvent:
        tokens = scheduler_pb2.TokenEvent(token_ids=ids, logprobs=[-0.5] * len(ids))
        if final:
            tokens.finish_reason = sampling_pb2.FINISH_REASON_STOP
            tokens.stop_kind = scheduler_pb2.STOP_KIND_STOP_TOKEN
            tokens.stop_token_id = ids[-1]
        return scheduler_pb2.RequestEvent(request_id="r", tokens=tokens)

    first = ev(1)
    first.tokens.num_cached_tokens = 16
    for event in (first, ev(2), ev(3, 4), ev(9, final=True)):
        assert events.put(event)
    assert len(events) == 1
    [merged] = [events._items[0]]
    assert list(merged.tokens.token_ids) == [1, 2, 3, 4, 9]
    assert len(merged.tokens.logprobs) == 5 and merged.tokens.num_cached_tokens == 16
    assert merged.tokens.stop_kind == scheduler_pb2.STOP_KIND_STOP_TOKEN and merged.tokens.stop_token_id == 9
    assert is_final(merged)
