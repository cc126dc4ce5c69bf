"""The gateway against hostile or careless clients (issue 11 item 9), on the real suite with the tiny model.

Each abuse runs beside a well-behaved greedy stream that must complete with the right tokens, and the
gateway's resident memory is logged before and after and must stay within RSS_GROWTH_BOUND_MIB.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import GenerationClient, build_request, sampling_params
from services.client.launcher import Launcher
from services.common.channels import insecure_channel
from services.common.errors import field_violations, retry_delay
from services.common.grpc_server import PUBLIC_MAX_RECEIVE_MESSAGE_BYTES
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.common.sampling_checks import (
    MAX_CHAT_MESSAGES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from tests.support.calls import expect_invalid, stream
from tests.support.suite import Suite, rss_mib, start_suite
from tests.support.tiny_model import transformers_greedy

log = logging.getLogger(__name__)

MAX_CONCURRENT = 16
# Tokens a request may buffer for a slow client: well above the well-behaved stream's whole answer.
BUFFER_TOKENS = 256
WRITE_TIMEOUT_S = 5
# A few MiB of request bytes pass through per test; 64 MiB of growth would mean something is kept.
RSS_GROWTH_BOUND_MIB = 64.0
GOOD_PROMPT = [11, 12, 13, 14, 15]
GOOD_TOKENS = 120
# A client that stops reading: with a 1 KiB window and no BDP growth the gateway's writes block after
# a few dozen responses, instead of after megabytes.
SMALL_WINDOW = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))


@pytest.fixture(scope="module")
def suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    running = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "64MiB"],
        scheduler_args=["--max-num-batched-tokens", "256"],
        gateway_args=[
            "--max-concurrent-requests", str(MAX_CONCURRENT),
            "--stream-buffer-tokens", str(BUFFER_TOKENS),
            "--stream-write-timeout", str(WRITE_TIMEOUT_S),
        ],
    )  # fmt: skip
    yield running
    running.stop()


@pytest.fixture(scope="module")
def good_tokens(tiny_model_dir: Path) -> list[int]:
    return transformers_greedy(tiny_model_dir, GOOD_PROMPT, GOOD_TOKENS)


@contextlib.asynccontextmanager
async def good_stream_and_bounded_rss(suite: Suite, expected: list[int], label: str) -> AsyncIterator[None]:
    """A greedy stream that has started before the body runs and must finish right after it; RSS checked."""
    pid = suite.gateway.process.pid
    before = rss_mib(pid)
    params = sampling_params(max_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        call = client.stub.Generate(build_request(token_ids=GOOD_PROMPT, sampling=params), timeout=300)
        first = await call.read()
        assert isinstance(first, generation_pb2.GenerateResponse)

        async def read_rest() -> list[generation_pb2.GenerateResponse]:
            # Read as it arrives, as a well-behaved client does, while the body misbehaves beside it.
            rest = []
            while (response := await call.read()) is not grpc.aio.EOF:
                assert isinstance(response, generation_pb2.GenerateResponse)
                rest.append(response)
            return rest

        reader = asyncio.create_task(read_rest())
        yield
        responses = [first, *await reader]
    assert [t for r in responses for t in r.token_ids] == expected, "the well-behaved stream was harmed"
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    after = rss_mib(pid)
    message = f"{label}: gateway RSS {before:.1f} -> {after:.1f} MiB (bound +{RSS_GROWTH_BOUND_MIB:.0f})"
    log.info(message)
    print(message)
    assert after - before < RSS_GROWTH_BOUND_MIB, message


async def test_every_repeated_field_is_capped(suite: Suite, good_tokens: list[int]) -> None:
    async with good_stream_and_bounded_rss(suite, good_tokens, "caps"), GenerationClient(suite.address) as client:
        cases = [
            (sampling_params(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "sampling.stop_token_ids"),
            (sampling_params(stop=["x"] * (MAX_STOP_STRINGS + 1)), "sampling.stop"),
            (sampling_params(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "sampling.stop[0]"),
        ]
        for sampling, field in cases:
            assert await expect_invalid(client, build_request(prompt="hi", sampling=sampling)) == [field]
        chat = build_request(messages=[("user", "hi")] * (MAX_CHAT_MESSAGES + 1), sampling=sampling_params())
        assert await expect_invalid(client, chat) == ["chat.messages"]
        # Past the public port's limit grpc itself refuses the message, before anything parses it.
        huge = build_request(prompt="x" * (PUBLIC_MAX_RECEIVE_MESSAGE_BYTES + 1), sampling=sampling_params())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stream(client, huge)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_huge_prompt_is_refused_before_tokenizing(suite: Suite, good_tokens: list[int]) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB, under the 4 MiB port limit
    async with good_stream_and_bounded_rss(suite, good_tokens, "3.5 MB prompt"), GenerationClient(suite.address) as c:
        for request, field in [
            (build_request(prompt=text, sampling=sampling_params(max_tokens=2)), "prompt"),
            (build_request(messages=[("user", text)], sampling=sampling_params(max_tokens=2)), "chat.messages"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stream(c, request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            ((got, description),) = field_violations(info.value)
            # Refused on its byte length, which needs no tokenization.
            assert got == field and "bytes of UTF-8" in description, description


async def test_request_ids_checked_echoed_once_and_not_keys(suite: Suite, good_tokens: list[int]) -> None:
    params = sampling_params(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with good_stream_and_bounded_rss(suite, good_tokens, "request ids"), GenerationClient(suite.address) as c:
        assert await expect_invalid(c, build_request(prompt="hi", sampling=params, request_id="x" * 129)) == [
            "request_id"
        ]
        assert await expect_invalid(c, build_request(prompt="hi", sampling=params, request_id="a b")) == ["request_id"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in c.stub.Generate(
                build_request(prompt="hi", sampling=params), metadata=(("x-request-id", "no/slashes"),)
            ):
                pass
        assert [f for f, _ in field_violations(info.value)] == ["x-request-id"]

        async def same_id() -> list[generation_pb2.GenerateResponse]:
            call = c.stub.Generate(build_request(token_ids=[5, 6, 7], sampling=params, request_id="shared-id"))
            return [r async for r in call]

        both = await asyncio.gather(same_id(), same_id())
    for responses in both:
        assert responses[0].request_id == "shared-id"
        assert all(r.request_id == "" for r in responses[1:])
        assert sum(len(r.token_ids) for r in responses) == 6
    tagged = [r for r in suite.log_records("gateway") if r.get("client_request_id") == "shared-id"]
    internal = {r["request_id"] for r in tagged}
    assert len(internal) == 2 and "shared-id" not in internal, "each gets its own scheduler id"
    scheduler_ids = {r.get("request_id") for r in suite.log_records("scheduler")}
    assert internal <= scheduler_ids


# Past grpc's own default of 3,000 waiting calls, which it cancelled with a bare CANCELLED (MAX_PENDING_RPCS).
BURST = 5000


async def test_burst_over_the_cap_is_answered_with_retry_info(suite: Suite, good_tokens: list[int]) -> None:
    params = sampling_params(max_tokens=2, temperature=0.0, ignore_eos=True)
    outcomes: list[str] = []

    async def one(client: GenerationClient, i: int) -> None:
        try:
            answer = await stream(client, build_request(token_ids=[20 + i % 400, 7], sampling=params))
            assert len(answer.token_ids) == 2
            outcomes.append("ok")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert retry_delay(err) is not None, "a refusal must say when to retry"
            outcomes.append("refused")

    async with good_stream_and_bounded_rss(suite, good_tokens, "burst"), GenerationClient(suite.address) as client:
        await asyncio.gather(*(one(client, i) for i in range(BURST)))
    log.info("burst of %d over a cap of %d: %d completed, %d refused", BURST, MAX_CONCURRENT, *_counts(outcomes))
    assert len(outcomes) == BURST
    assert "ok" in outcomes and "refused" in outcomes
    await suite.wait_idle()


def _counts(outcomes: list[str]) -> tuple[int, int]:
    return outcomes.count("ok"), outcomes.count("refused")


async def test_slow_readers_are_aborted_alone(suite: Suite, good_tokens: list[int]) -> None:
    params = sampling_params(max_tokens=900, temperature=0.0, ignore_eos=True)
    # A raw channel of its own with a tiny receive window; its calls are not read until the end.
    slow_channel = grpc.aio.insecure_channel(suite.address, options=SMALL_WINDOW)
    async with good_stream_and_bounded_rss(suite, good_tokens, "slow readers"), insecure_channel(suite.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(slow_channel)
        slow = [stub.Generate(build_request(token_ids=[30 + i, 31, 32], sampling=params)) for i in range(4)]
        # Meanwhile more well-behaved traffic on another channel.
        good = generation_pb2_grpc.GenerationStub(ch)
        short = sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            responses = [r async for r in good.Generate(build_request(token_ids=[40, 41], sampling=short))]
            assert sum(len(r.token_ids) for r in responses) == 8
    # Their requests were aborted at the scheduler: it goes idle with every block free.
    stats = await suite.wait_idle(timeout=120)
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)
    for call in slow:
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                received += len(response.token_ids)
        assert info.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "reads too slowly" in (info.value.details() or "")
        assert received < 900
    await slow_channel.close()


async def test_deadline_ends_the_request_everywhere(suite: Suite, good_tokens: list[int]) -> None:
    # 1000 tokens take this model seconds on two cores; the client gives up after half a second.
    params = sampling_params(max_tokens=1000, temperature=0.0, ignore_eos=True)
    async with good_stream_and_bounded_rss(suite, good_tokens, "deadline"), GenerationClient(suite.address) as c:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in c.stub.Generate(build_request(token_ids=[9, 10, 11], sampling=params), timeout=0.5):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = await suite.wait_idle(timeout=120)
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)


async def test_no_scheduler_means_not_serving_and_unavailable_without_addresses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    dead_port, port = free_port(), free_port()
    launcher = Launcher(tmp_path, env={"MESHSERVE_LOG_FORMAT": "json"})
    address = f"127.0.0.1:{port}"
    launcher.start(
        "gateway",
        ["gateway", "--host", "127.0.0.1", "--port", str(port), "--scheduler-address", f"127.0.0.1:{dead_port}",
         "--model", str(tiny_model_dir)],
        address,
    )  # fmt: skip
    try:
        async with insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(600):
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the gateway never answered its health check")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                call = generation_pb2_grpc.GenerationStub(channel).Generate(
                    build_request(prompt="hi", sampling=sampling_params(max_tokens=2)), timeout=30
                )
                async for _ in call:
                    pass
    finally:
        launcher.stop_all(timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    details = info.value.details() or ""
    assert str(dead_port) not in details and "127.0.0.1" not in details, details
    assert retry_delay(info.value) is not None
