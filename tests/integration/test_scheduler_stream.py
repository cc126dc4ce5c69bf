"""Scheduler.Stream, the gateway's multiplexed path: one message per step, refusals, aborts, half-close."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.calls import greedy_token_answers, stream
from tests.support.suite import Suite, start_suite
from tests.support.tiny_model import transformers_greedy

EOS = [2]


@pytest.fixture(scope="module")
def suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    """Two running requests at most and two waiting, so refusals are easy to provoke."""
    running = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "64MiB"],
        scheduler_args=["--max-num-seqs", "2", "--max-waiting-requests", "2"],
    )
    yield running
    running.stop()


def _submit(request_id: str, prompt: list[int], max_tokens: int, **sampling: object) -> scheduler_pb2.StreamRequest:
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return scheduler_pb2.StreamRequest(
        submit=scheduler_pb2.SubmitRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=params, eos_token_ids=EOS
        )
    )


def _final(event: scheduler_pb2.RequestEvent) -> bool:
    # ALREADY_EXISTS refuses a second submission of a running id; the running request goes on.
    if event.HasField("error"):
        return event.error.code != grpc.StatusCode.ALREADY_EXISTS.value[0]
    return event.tokens.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED


async def _read_until_final(
    call: grpc.aio.StreamStreamCall, request_ids: set[str]
) -> tuple[dict[str, list[scheduler_pb2.RequestEvent]], list[scheduler_pb2.StreamResponse]]:
    """Read responses until every id in request_ids had its final event."""
    events: dict[str, list[scheduler_pb2.RequestEvent]] = defaultdict(list)
    responses = []
    pending = set(request_ids)
    while pending:
        response = await asyncio.wait_for(call.read(), timeout=60)
        assert response is not grpc.aio.EOF, f"stream ended with {pending} unfinished"
        responses.append(response)
        for event in response.events:
            assert event.request_id in pending, f"an event for {event.request_id} after its final one"
            events[event.request_id].append(event)
            if _final(event):
                pending.discard(event.request_id)
    return events, responses


async def test_one_message_per_step_and_same_tokens_as_generate(suite: Suite) -> None:
    prompts = {"a": list(range(20, 50)), "b": list(range(60, 75))}
    async with insecure_channel(suite.scheduler.address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream()
        for request_id, prompt in prompts.items():
            await call.write(_submit(request_id, prompt, 24))
        events, responses = await _read_until_final(call, set(prompts))
        call.cancel()
    tokens = {rid: [t for e in evs for t in e.tokens.token_ids] for rid, evs in events.items()}
    # While both decode, every step answers both in one message (not one message per request).
    started: set[str] = set()
    finished = False
    shared = 0
    for response in responses:
        names = [e.request_id for e in response.events]
        assert len(names) == len(set(names)), "one event per request per step"
        if started == {"a", "b"} and not finished:
            assert sorted(names) == ["a", "b"]
            shared += 1
        started.update(n for n, e in zip(names, response.events, strict=True) if e.tokens.token_ids)
        finished = finished or any(_final(e) for e in response.events)
    assert shared >= 1
    assert all(events[rid][-1].tokens.finish_reason == sampling_pb2.FINISH_REASON_LENGTH for rid in prompts)
    expected = await greedy_token_answers(suite.address, list(prompts.values()), 24)
    assert [tokens[rid] for rid in prompts] == [a.token_ids for a in expected]


async def test_refusals_are_per_request_and_name_the_field(suite: Suite) -> None:
    async with insecure_channel(suite.scheduler.address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream()
        await call.write(_submit("bad", [5, 6, 7], 4, top_p=0.0))
        await call.write(_submit("ok", [5, 6, 7], 300))  # long enough to still run when its twin comes
        await call.write(_submit("ok", [8, 9], 4))
        errors: dict[str, scheduler_pb2.RequestError] = {}
        ok_tokens = 0
        while len(errors) < 2 or not ok_tokens:
            response = await asyncio.wait_for(call.read(), timeout=60)
            for event in response.events:
                if event.HasField("error"):
                    errors[event.request_id] = event.error
                elif event.request_id == "ok":
                    assert event.tokens.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED
                    ok_tokens += len(event.tokens.token_ids)
        # The refused twin left the running request alone: it still runs until aborted.
        await call.write(scheduler_pb2.StreamRequest(abort=scheduler_pb2.AbortRequest(request_id="ok")))
        await call.done_writing()
        while (response := await asyncio.wait_for(call.read(), timeout=60)) is not grpc.aio.EOF:
            assert all(not _final(e) for e in response.events), "no final event follows an abort"
        assert await call.code() == grpc.StatusCode.OK
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors["bad"].field == "sampling.top_p" and "top_p" in errors["bad"].message
    assert errors["ok"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    stats = await suite.wait_idle()
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)


async def test_abort_and_cancel_free_every_block(suite: Suite) -> None:
    async with insecure_channel(suite.scheduler.address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream()
        await call.write(_submit("long-1", list(range(20, 60)), 400))
        await call.write(_submit("long-2", list(range(30, 70)), 400))
        seen: set[str] = set()
        while seen != {"long-1", "long-2"}:
            response = await asyncio.wait_for(call.read(), timeout=60)
            seen.update(e.request_id for e in response.events if e.tokens.token_ids)
        await call.write(scheduler_pb2.StreamRequest(abort=scheduler_pb2.AbortRequest(request_id="long-1")))
        # Both run in every step until the abort lands; from then on only long-2 advances.
        names: list[str] = []
        for _ in range(400):
            response = await asyncio.wait_for(call.read(), timeout=60)
            names = [e.request_id for e in response.events]
            if "long-1" not in names:
                break
        assert names == ["long-2"], "the abort never took effect"
        for _ in range(5):
            response = await asyncio.wait_for(call.read(), timeout=60)
            assert [e.request_id for e in response.events] == ["long-2"]
        call.cancel()
    stats = await suite.wait_idle()
    assert [(w.num_running, w.num_free_blocks) for w in stats.workers] == [(0, w.num_blocks) for w in stats.workers]


async def test_half_close_ends_the_stream_after_its_requests(suite: Suite) -> None:
    async with insecure_channel(suite.scheduler.address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Stream()
        await call.write(_submit("h-1", [11, 12, 13], 6))
        await call.write(_submit("h-2", [14, 15], 3))
        await call.done_writing()
        counts: dict[str, int] = defaultdict(int)
        while (response := await asyncio.wait_for(call.read(), timeout=60)) is not grpc.aio.EOF:
            for event in response.events:
                counts[event.request_id] += len(event.tokens.token_ids)
        assert await call.code() == grpc.StatusCode.OK
    assert dict(counts) == {"h-1": 6, "h-2": 3}


async def test_gateway_passes_scheduler_refusals_on(suite: Suite) -> None:
    params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        running = [
            client.stub.Generate(build_request(token_ids=list(range(20, 40)), sampling=params, request_id=f"run-{i}"))
            for i in range(2)
        ]
        for call in running:
            await call.read()  # both hold the two --max-num-seqs slots
        waiting = [
            client.stub.Generate(build_request(token_ids=[7, 8, 9], sampling=params, request_id=f"wait-{i}"))
            for i in range(2)
        ]
        for _ in range(300):
            if (await suite.stats()).num_waiting == 2:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await client.stub.Complete(build_request(token_ids=[1, 2], sampling=params))
        for call in (*running, *waiting):
            call.cancel()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-waiting-requests" in (full.value.details() or "")
    stats = await suite.wait_idle()
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)


def test_gateway_survives_a_scheduler_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    restarted = start_suite(tiny_model_dir, tmp_path, worker_args=["--kv-cache-memory", "16MiB"])
    params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
    scheduler_port = restarted.scheduler.address.rsplit(":", 1)[1]

    async def run() -> tuple[grpc.StatusCode, list[int]]:
        async with GenerationClient(restarted.address) as client:
            running = client.stub.Generate(build_request(token_ids=list(range(20, 40)), sampling=params))
            await running.read()
            restarted.scheduler.process.kill()
            restarted.scheduler.process.wait()
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                while True:
                    await asyncio.wait_for(running.read(), timeout=30)
            # The same port, as a restarted pod would have; the worker re-attaches by itself.
            restarted.scheduler = restarted.launcher.start(
                "scheduler-2",
                ["scheduler", "--host", "127.0.0.1", "--port", scheduler_port],
                restarted.scheduler.address,
            )
            await restarted.launcher.wait_healthy(restarted.scheduler, 60)
            # The gateway is SERVING again once its poll finds the new scheduler with a ready worker.
            await restarted.launcher.wait_healthy(restarted.gateway, 60)
            again = sampling_params(max_tokens=5, temperature=0.0, ignore_eos=True)
            answer = await stream(client, build_request(token_ids=[7, 8, 9], sampling=again))
            return lost.value.code(), answer.token_ids

    try:
        code, tokens = asyncio.run(run())
    finally:
        restarted.stop()
    # Stopped before the gateway (it was started last), the scheduler ends the gateway's idle stream
    # and exits cleanly instead of waiting out its grace period and being killed.
    assert restarted.scheduler.process.returncode == 0, restarted.scheduler.log_tail()
    # The request on the lost scheduler fails instead of hanging; the next one opens a new stream.
    assert code == grpc.StatusCode.UNAVAILABLE
    assert tokens == transformers_greedy(tiny_model_dir, [7, 8, 9], 5)
