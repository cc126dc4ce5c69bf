"""The gateway in-process in front of fake schedulers: health, limits, ids, admission, errors, deadlines,
slow readers and several schedulers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest

from services.common.errors import StatusError, field_violations, retry_delay
from services.common.proto.meshserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    sampling_pb2,
    scheduler_pb2,
)
from services.gateway.pipeline import Call
from services.gateway.request_ids import RequestIds
from services.gateway.scheduler_stream import SCHEDULER_UNAVAILABLE
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir
from tests.unit.gateway.fake_scheduler import (
    FakeScheduler,
    ready_info,
    running_gateway,
    tokens,
    wait_health,
)

# A client that never reads: with a 1 KiB window and no BDP growth, the gateway's writes block
# after a few dozen responses.
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _req(prompt: str = "Hello world", request_id: str = "", **sampling: Any) -> generation_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 3)
    return generation_pb2.GenerateRequest(
        prompt=prompt, request_id=request_id, sampling=sampling_pb2.SamplingParams(**sampling)
    )


async def _generate(
    address: str,
    request: generation_pb2.GenerateRequest,
    metadata: Sequence[tuple[str, str]] = (),
    timeout: float | None = 30,
) -> list[generation_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=timeout)
        return [r async for r in call]


def _tokens(responses: list[generation_pb2.GenerateResponse]) -> int:
    """Tokens streamed, after checking the stream ended with a finish reason."""
    assert responses[-1].finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
    return sum(len(r.token_ids) for r in responses)


async def _error(address: str, request: generation_pb2.GenerateRequest, **kwargs: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _generate(address, request, **kwargs)
    return info.value


def _assert_no_address(err: grpc.aio.AioRpcError, *addresses: str) -> None:
    details = err.details() or ""
    for needle in ("127.0.0.1", "10.9.9.9", "ipv4:", *addresses):
        assert needle not in details, details


async def _until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


async def test_health_follows_the_scheduler_and_unavailable_names_no_address(tok: TextTokenizer) -> None:
    fake = FakeScheduler(info=ready_info(num_ready_workers=0))
    async with running_gateway(tok, [fake], wait_serving=False) as gateway:
        await wait_health(gateway.address, serving=False)
        err = await _error(gateway.address, _req())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and retry_delay(err) == 1.0
        _assert_no_address(err, fake.address)
        assert fake.submits == []

        fake.info = ready_info()
        await wait_health(gateway.address, serving=True)
        assert _tokens(await _generate(gateway.address, _req())) == 3

        fake.info = ready_info(accepting=False)
        await wait_health(gateway.address, serving=False)
        fake.info = ready_info()
        await wait_health(gateway.address, serving=True)
        fake.info_error = grpc.StatusCode.UNAVAILABLE
        await wait_health(gateway.address, serving=False)
        err = await _error(gateway.address, _req())
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        _assert_no_address(err, fake.address)


async def test_limits_come_from_the_scheduler_and_max_tokens_is_left_to_it(tok: TextTokenizer) -> None:
    fake = FakeScheduler(info=ready_info(max_model_len=8, vocab_size=300))
    async with running_gateway(tok, [fake]) as gateway:
        too_long = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 8))
        err = await _error(gateway.address, too_long)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "8" in (err.details() or "")
        outside = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 300]))
        assert [f for f, _ in field_violations(await _error(gateway.address, outside))] == ["token_ids.ids[1]"]

        request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6]))
        assert _tokens(await _generate(gateway.address, request)) == 4  # the fake's default for unset max_tokens
        sent = fake.submits[-1]
        assert not sent.sampling.HasField("max_tokens")
        assert list(sent.eos_token_ids) == tok.eos_token_ids


async def test_request_ids_are_echoed_once_and_never_the_schedulers_key(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway:
        a, b = await asyncio.gather(
            _generate(gateway.address, _req(request_id="dup")), _generate(gateway.address, _req(request_id="dup"))
        )
        for responses in (a, b):
            assert [r.request_id for r in responses] == ["dup"] + [""] * (len(responses) - 1)
            assert _tokens(responses) == 3
        internal = [s.request_id for s in fake.submits]
        assert len(set(internal)) == 2 and "dup" not in internal

        from_header = await _generate(gateway.address, _req(), metadata=(("x-request-id", "hdr-1"),))
        assert from_header[0].request_id == "hdr-1"
        anonymous = await _generate(gateway.address, _req())
        assert anonymous[0].request_id == fake.submits[-1].request_id

        for request, metadata, field in [
            (_req(request_id="has space"), (), "request_id"),
            (_req(request_id="x" * 129), (), "request_id"),
            (_req(), (("x-request-id", "y" * 129),), "x-request-id"),
            (_req(request_id="fine"), (("x-request-id", "bad/id"),), "x-request-id"),
        ]:
            err = await _error(gateway.address, request, metadata=metadata)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in field_violations(err)] == [field]


async def test_admission_cap_answers_resource_exhausted_with_retry_info(tok: TextTokenizer) -> None:
    release = asyncio.Event()

    async def hold(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        await release.wait()
        yield tokens(submit.request_id, [7], final=True)

    fake = FakeScheduler(behaviour=hold)
    async with running_gateway(tok, [fake], max_concurrent_requests=2, retry_after=2.5) as gateway:
        held = [asyncio.create_task(_generate(gateway.address, _req())) for _ in range(2)]
        await _until(lambda: len(fake.submits) == 2)
        err = await _error(gateway.address, _req())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_delay(err) == 2.5
        assert "--max-concurrent-requests" in (err.details() or "")
        release.set()
        for task in held:
            assert (await task)[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert _tokens(await _generate(gateway.address, _req())) == 1


async def test_per_client_cap(tok: TextTokenizer) -> None:
    release = asyncio.Event()

    async def hold(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        await release.wait()
        yield tokens(submit.request_id, [7], final=True)

    fake = FakeScheduler(behaviour=hold)
    async with running_gateway(tok, [fake], max_concurrent_requests_per_client=1) as gateway:
        held = asyncio.create_task(_generate(gateway.address, _req()))
        await _until(lambda: len(fake.submits) == 1)
        err = await _error(gateway.address, _req())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_delay(err) is not None
        assert "per-client" in (err.details() or "")
        release.set()
        await held


async def test_scheduler_errors_pass_on_with_their_details(tok: TextTokenizer) -> None:
    async def refuse(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        yield tokens(submit.request_id, [5])
        if submit.prompt_token_ids[0] == 1:
            error = scheduler_pb2.RequestError(code=8, message="queue full; retry later", retry_after_seconds=3)
        else:
            error = scheduler_pb2.RequestError(
                code=3, message="bad", field="sampling.max_tokens", description="does not fit"
            )
        yield scheduler_pb2.RequestEvent(request_id=submit.request_id, error=error)

    fake = FakeScheduler(behaviour=refuse)
    async with running_gateway(tok, [fake]) as gateway:
        busy = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2]))
        err = await _error(gateway.address, busy)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and retry_delay(err) == 3.0
        bad = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[2, 2]))
        err = await _error(gateway.address, bad)
        assert field_violations(err) == [("sampling.max_tokens", "does not fit")]


async def test_deadline_travels_as_timeout_seconds(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway:
        await _generate(gateway.address, _req(), timeout=20)
        sent = fake.submits[-1]
        # The client's 20 s, not some default (grpc rounds the grpc-timeout header up a little).
        assert sent.HasField("timeout_seconds") and 0 < sent.timeout_seconds <= 21
        await _generate(gateway.address, _req(), timeout=None)
        assert not fake.submits[-1].HasField("timeout_seconds")


class _Expired:
    """A call context whose deadline has passed (grpc may not deliver such a call at all, so fake one)."""

    def time_remaining(self) -> float:
        return -0.5


async def test_an_expired_deadline_is_never_submitted(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake]) as gateway:
        pipeline = gateway.pipeline
        resolved = await pipeline.resolve(_req())
        expired = Call(RequestIds("x", None), "client", _Expired().time_remaining())
        with pytest.raises(StatusError) as info:
            pipeline._submission("x", resolved, 0, expired, "")
        assert info.value.status.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert fake.submits == []


async def _forever(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
    """One token every 5 ms, like a scheduler's steps: max_tokens of them, or forever from 1000 on."""
    n = submit.sampling.max_tokens
    i = 0
    while n >= 1000 or i < n:
        await asyncio.sleep(0.005)
        i += 1
        yield tokens(submit.request_id, [100 + i % 200], final=i == n)


async def test_cancelled_call_aborts_at_the_scheduler(tok: TextTokenizer) -> None:
    fake = FakeScheduler(behaviour=_forever)
    async with running_gateway(tok, [fake]) as gateway:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(_req(max_tokens=5000))
            await call.read()
            call.cancel()
        await _until(lambda: fake.submits and fake.aborted == [fake.submits[0].request_id])


@pytest.mark.parametrize(("buffer", "write_timeout"), [(8, 60.0), (100_000, 0.3)])
async def test_slow_reader_is_aborted_alone(tok: TextTokenizer, buffer: int, write_timeout: float) -> None:
    # Either bound ends it: the buffer fills first, or (with a huge buffer) the blocked write times out.
    fake = FakeScheduler(behaviour=_forever)
    async with running_gateway(tok, [fake], stream_buffer_tokens=buffer, stream_write_timeout=write_timeout) as gateway:
        async with grpc.aio.insecure_channel(gateway.address, options=SMALL_WINDOW) as slow_channel:
            slow = generation_pb2_grpc.GenerationStub(slow_channel).Generate(_req(max_tokens=10**6))
            await _until(lambda: len(fake.submits) == 1)
            good = await _generate(gateway.address, _req(max_tokens=50))
            assert good[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            await _until(lambda: fake.aborted == [fake.submits[0].request_id])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in slow:
                    pass
        expected = grpc.StatusCode.RESOURCE_EXHAUSTED if buffer == 8 else grpc.StatusCode.DEADLINE_EXCEEDED
        assert info.value.code() in (expected, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "reads too slowly" in (info.value.details() or "")
        assert gateway.pipeline.admission.in_flight == 0


async def test_several_schedulers_sticky_prefix_and_failover(tok: TextTokenizer) -> None:
    a, b = FakeScheduler(behaviour=_forever), FakeScheduler(behaviour=_forever)
    async with running_gateway(tok, [a, b]) as gateway:
        await _until(lambda: all(backend.healthy for backend in gateway.pool.backends))
        # The same prompt prefix always lands on the same scheduler.
        prefix = [11 + i for i in range(64)]
        for tail in range(4):
            request = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[*prefix, tail]),
                sampling=sampling_pb2.SamplingParams(max_tokens=2),
            )
            await _generate(gateway.address, request)
        assert sorted([len(a.submits), len(b.submits)]) == [0, 4]

        # Long requests on both; then one scheduler dies.
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            calls = []
            for i in range(16):
                request = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=[20 + i, 30]),
                    sampling=sampling_pb2.SamplingParams(max_tokens=5000),
                )
                calls.append(stub.Generate(request))
            # Without a client id, the first response carries the id the scheduler got.
            first = [await call.read() for call in calls]
            on_a = {s.request_id for s in a.submits}
            assert all(isinstance(r, generation_pb2.GenerateResponse) for r in first)
            placed = [r.request_id in on_a for r in first]  # type: ignore[union-attr]
            assert any(placed) and not all(placed), "both schedulers should carry some"
            await a.stop()
            for call, was_on_a in zip(calls, placed, strict=True):
                if was_on_a:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        while await asyncio.wait_for(call.read(), timeout=20) is not grpc.aio.EOF:
                            pass
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert info.value.details() == SCHEDULER_UNAVAILABLE
                else:
                    for _ in range(3):  # unharmed: still streaming from b
                        assert isinstance(
                            await asyncio.wait_for(call.read(), timeout=20), generation_pb2.GenerateResponse
                        )
                    call.cancel()
        await _until(lambda: not gateway.pool.backends[0].healthy)
        before = len(b.submits)
        for i in range(6):
            assert _tokens(await _generate(gateway.address, _req(prompt=f"prompt {i}", max_tokens=2))) == 2
        assert len(b.submits) == before + 6
