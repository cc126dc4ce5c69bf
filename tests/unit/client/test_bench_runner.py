"""run_benchmark and run_conversations against an in-process fake gateway: records, errors, warm-ups, the
concurrency limit and the turn order of conversations."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from services.client.bench import runner
from services.client.bench.arrivals import inter_arrival_times, send_offsets
from services.client.bench.datasets import BenchRequest, flatten, multi_turn_dataset
from services.client.bench.runner import WARMUP_OUTPUT_LEN, WarmupError, run_benchmark, run_conversations, run_warmups
from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

# First prompt token ids that make the fake gateway misbehave.
FAIL_RPC = 1
FAIL_ABORT = 2
SHORT = 3


class FakeGateway(generation_pb2_grpc.GenerationServicer):
    """Streams max_tokens ids two per message; remembers what it was asked, in which order, how many ran at once."""

    def __init__(self) -> None:
        self.requests: list[generation_pb2.GenerateRequest] = []
        # Per arriving request: its id and the ids whose streams had ended by then.
        self.arrivals: list[tuple[str, frozenset[str]]] = []
        self.finished: set[str] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.barrier: asyncio.Barrier | None = None

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self.requests.append(request)
        self.arrivals.append((request.request_id, frozenset(self.finished)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.barrier is not None:
                await asyncio.wait_for(self.barrier.wait(), 5)
            prompt = list(request.token_ids.ids)
            if prompt[0] == FAIL_RPC:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
            n = request.sampling.max_tokens - (1 if prompt[0] == SHORT else 0)
            for i in range(0, n, 2):
                await asyncio.sleep(0.001)
                yield generation_pb2.GenerateResponse(request_id=request.request_id, token_ids=range(i, min(i + 2, n)))
            reason = sampling_pb2.FINISH_REASON_ABORT if prompt[0] == FAIL_ABORT else sampling_pb2.FINISH_REASON_LENGTH
            usage = generation_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=n, cached_tokens=len(prompt) // 2)
            yield generation_pb2.GenerateResponse(request_id=request.request_id, finish_reason=reason, usage=usage)
        finally:
            self.in_flight -= 1
            self.finished.add(request.request_id)

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.CompleteResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the benchmark streams")
        raise AssertionError("abort raises")


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, FakeGateway]]:
    server = grpc.aio.server()
    fake = FakeGateway()
    generation_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", fake
    await server.stop(None)


def _workload(n: int) -> Iterator[BenchRequest]:
    for i in range(n):
        yield BenchRequest([100 + i] * (i + 3), output_len=i % 5 + 1)


async def test_records_in_order_with_a_time_per_token(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    requests = list(_workload(10))
    records, duration = await run_benchmark(address, requests, progress=False)
    assert duration > 0
    assert [r.prompt_len for r in records] == [len(r.prompt_token_ids) for r in requests]
    for record, request in zip(records, requests, strict=True):
        assert record.success, record.error
        assert record.output_len == request.output_len
        assert record.num_output_tokens == request.output_len
        assert record.cached_tokens == len(request.prompt_token_ids) // 2
        # Two tokens per message: each pair shares its message's arrival time.
        for i in range(0, record.num_output_tokens - 1, 2):
            assert record.token_times[i] == record.token_times[i + 1]
        assert record.token_times == sorted(record.token_times)
        assert record.start <= record.token_times[0]
    sent = sorted(fake.requests, key=lambda r: int(r.request_id.removeprefix("bench-")))
    assert [r.request_id for r in sent] == [f"bench-{i}" for i in range(10)]
    for message, request in zip(sent, requests, strict=True):
        assert list(message.token_ids.ids) == request.prompt_token_ids
        assert message.sampling.max_tokens == request.output_len
        assert message.sampling.ignore_eos
        assert message.sampling.HasField("temperature") and message.sampling.temperature == 0.0


async def test_errors_become_failed_records(gateway: tuple[str, FakeGateway]) -> None:
    address, _ = gateway
    requests = [
        BenchRequest([FAIL_RPC, 200], 4),
        BenchRequest([200, 201], 4),
        BenchRequest([FAIL_ABORT, 200], 4),
        BenchRequest([SHORT, 200], 4),
    ]
    records, _ = await run_benchmark(address, requests, progress=False)
    assert not records[0].success and records[0].error == "RESOURCE_EXHAUSTED: queue full"
    assert records[1].success and records[1].num_output_tokens == 4
    assert not records[2].success and "ABORT" in records[2].error
    # A short answer still succeeds; the summary counts it as a length mismatch.
    assert records[3].success and records[3].num_output_tokens == 3


async def test_unreachable_gateway_fails_every_record() -> None:
    records, _ = await run_benchmark("127.0.0.1:1", list(_workload(3)), progress=False)
    assert [r.success for r in records] == [False] * 3
    assert all(r.error.startswith("UNAVAILABLE") for r in records)


async def test_max_concurrency_caps_requests_in_flight(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    records, _ = await run_benchmark(address, list(_workload(12)), max_concurrency=3, progress=False)
    assert all(r.success for r in records)
    assert len(fake.requests) == 12
    assert fake.max_in_flight <= 3


async def test_infinite_rate_without_limit_sends_all_at_once(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    # Every request waits until all 6 are in flight: a runner sending them one by one would time out.
    fake.barrier = asyncio.Barrier(6)
    records, _ = await run_benchmark(address, list(_workload(6)), progress=False)
    assert all(r.success for r in records), [r.error for r in records]
    assert fake.max_in_flight == 6


@pytest.mark.parametrize(("rate", "burstiness"), [(2.0, 0.5), (5.0, 1.0), (math.inf, 1.0)])
async def test_requests_leave_at_their_arrival_times(
    gateway: tuple[str, FakeGateway], monkeypatch: pytest.MonkeyPatch, rate: float, burstiness: float
) -> None:
    address, fake = gateway
    deadlines: list[float] = []

    async def no_sleep(deadline: float) -> None:
        # Record the schedule instead of waiting for it, so the test checks it without timing anything.
        deadlines.append(deadline)

    monkeypatch.setattr(runner, "_sleep_until", no_sleep)
    records, _ = await run_benchmark(address, list(_workload(8)), request_rate=rate, burstiness=burstiness, seed=3)
    assert all(r.success for r in records)
    assert len(fake.requests) == 8
    expected = send_offsets(inter_arrival_times(8, rate, burstiness, seed=3))
    assert [d - deadlines[0] for d in deadlines] == pytest.approx(expected, abs=1e-9)


async def test_warmups_are_sent_first_and_not_recorded(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    requests = [BenchRequest([100 + i] * 4, 5) for i in range(4)]
    records, _ = await run_benchmark(address, requests, num_warmups=3, progress=False)
    assert len(records) == 4 and all(r.num_output_tokens == 5 for r in records)
    warmups = fake.requests[:3]
    assert sorted(r.request_id for r in warmups) == ["bench-warmup-0", "bench-warmup-1", "bench-warmup-2"]
    assert all(r.sampling.max_tokens == WARMUP_OUTPUT_LEN for r in warmups)
    assert sorted(list(r.token_ids.ids) for r in warmups) == [q.prompt_token_ids for q in requests[:3]]
    assert all(r.request_id.startswith("bench-") and "warmup" not in r.request_id for r in fake.requests[3:])


async def test_failed_warmup_stops_the_run(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    with pytest.raises(WarmupError, match="queue full"):
        await run_benchmark(address, [BenchRequest([FAIL_RPC, 5], 3)] * 2, num_warmups=1, progress=False)
    assert len(fake.requests) == 1


async def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        await run_benchmark("127.0.0.1:1", list(_workload(2)), max_concurrency=0)
    with pytest.raises(ValueError):
        await run_benchmark("127.0.0.1:1", list(_workload(2)), request_rate=0.0)


def _conversations(n: int, turns: int) -> list[list[BenchRequest]]:
    return multi_turn_dataset(n, turns, (3, 6), (1, 4), vocab_size=512, seed=9)


def _turn_ids(conversations: list[list[BenchRequest]]) -> list[list[str]]:
    """Each conversation's request ids: turns are numbered in record order."""
    ids, i = [], 0
    for turns in conversations:
        ids.append([f"bench-{i + k}" for k in range(len(turns))])
        i += len(turns)
    return ids


async def test_conversation_turns_wait_for_the_previous_turn(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    conversations = _conversations(4, 3)
    records, _ = await run_conversations(address, conversations, progress=False)
    flat = flatten(conversations)
    assert [r.error for r in records] == [""] * len(flat)
    assert [(r.prompt_len, r.num_output_tokens) for r in records] == [
        (len(t.prompt_token_ids), t.output_len) for t in flat
    ]
    sent = {m.request_id: list(m.token_ids.ids) for m in fake.requests}
    assert [sent[f"bench-{i}"] for i in range(len(flat))] == [t.prompt_token_ids for t in flat]
    done_at_arrival = dict(fake.arrivals)
    for ids in _turn_ids(conversations):
        for previous, turn in itertools.pairwise(ids):
            assert previous in done_at_arrival[turn], f"{turn} was sent before {previous} finished"


async def test_conversations_run_side_by_side(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    # Each turn waits until one turn of every conversation is in flight: conversations sent one after another
    # would time out, and a conversation overlapping its own turns would break the barrier's rounds.
    fake.barrier = asyncio.Barrier(3)
    records, _ = await run_conversations(address, _conversations(3, 4), progress=False)
    assert all(r.success for r in records), [r.error for r in records]
    assert fake.max_in_flight == 3


async def test_a_conversation_keeps_its_slot_until_its_last_turn(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    conversations = _conversations(3, 3)
    records, _ = await run_conversations(address, conversations, max_concurrency=1, progress=False)
    assert all(r.success for r in records)
    # One slot: a conversation runs to its end before the next one starts.
    assert [request_id for request_id, _ in fake.arrivals] == [i for ids in _turn_ids(conversations) for i in ids]
    fake.arrivals.clear()
    fake.max_in_flight = 0
    await run_conversations(address, _conversations(5, 2), max_concurrency=2, progress=False)
    assert fake.max_in_flight <= 2


async def test_conversations_start_at_their_arrival_times(
    gateway: tuple[str, FakeGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, _ = gateway
    deadlines: list[float] = []

    async def no_sleep(deadline: float) -> None:
        deadlines.append(deadline)

    monkeypatch.setattr(runner, "_sleep_until", no_sleep)
    conversations = _conversations(5, 3)
    records, _ = await run_conversations(address, conversations, request_rate=4.0, seed=2, progress=False)
    assert len(records) == 15 and all(r.success for r in records)
    # The rate counts conversation starts; later turns follow their predecessor, not the clock.
    expected = send_offsets(inter_arrival_times(5, 4.0, 1.0, seed=2))
    assert [d - deadlines[0] for d in deadlines] == pytest.approx(expected, abs=1e-9)


async def test_run_warmups_sends_first_turns_only(gateway: tuple[str, FakeGateway]) -> None:
    address, fake = gateway
    conversations = _conversations(2, 3)
    await run_warmups(address, conversations, 3, max_concurrency=2)
    assert sorted(m.request_id for m in fake.requests) == ["bench-warmup-0", "bench-warmup-1", "bench-warmup-2"]
    firsts = [c[0].prompt_token_ids for c in conversations]
    assert sorted(list(m.token_ids.ids) for m in fake.requests) == sorted([firsts[0], firsts[1], firsts[0]])
    assert all(m.sampling.max_tokens <= WARMUP_OUTPUT_LEN for m in fake.requests)
    await run_warmups(address, conversations, 0)
    assert len(fake.requests) == 3
