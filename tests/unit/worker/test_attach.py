"""AttachClient against an in-process fake scheduler: heartbeats, step order, drain, close and a hung step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import pytest

from services.common.ports import free_port
from services.common.proto.meshserve.v1 import worker_pb2
from services.worker.attach import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    HANG_AFTER_STEPS_ENV,
    AttachClient,
    HangAfterSteps,
    ModelThreadHung,
    heartbeat_interval,
    with_test_faults,
)

# Guards against a hang; no test measures time.
WAIT_S = 20.0
BEAT_S = 0.02


class FakeScheduler:
    """Attach as the test scripts it: what the test queues goes to the worker; what the worker sends is kept."""

    def __init__(self) -> None:
        self.to_worker: asyncio.Queue[worker_pb2.SchedulerMessage | None] = asyncio.Queue()
        self.from_worker: asyncio.Queue[worker_pb2.WorkerMessage | None] = asyncio.Queue()
        self.calls = 0
        self.address = ""

    async def Attach(
        self, request_iterator: AsyncIterator[worker_pb2.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SchedulerMessage]:
        self.calls += 1
        reader = asyncio.create_task(self._read(request_iterator))
        try:
            while (message := await self.to_worker.get()) is not None:
                yield message
        finally:
            reader.cancel()

    async def _read(self, request_iterator: AsyncIterator[worker_pb2.WorkerMessage]) -> None:
        async for message in request_iterator:
            self.from_worker.put_nowait(message)
        self.from_worker.put_nowait(None)  # the worker closed its side

    def accept(self, interval: float = BEAT_S) -> None:
        accepted = worker_pb2.AttachAccepted(worker_id="w", heartbeat_interval_seconds=interval)
        self.to_worker.put_nowait(worker_pb2.SchedulerMessage(accepted=accepted))

    def step(self, step_id: int) -> None:
        self.to_worker.put_nowait(worker_pb2.SchedulerMessage(step=worker_pb2.Step(step_id=step_id)))

    def end_stream(self) -> None:
        self.to_worker.put_nowait(None)

    async def next(self, kind: Literal["hello", "result", "drain", "heartbeat"]) -> worker_pb2.WorkerMessage:
        """The next message of this kind, skipping the others (mostly heartbeats)."""
        while True:
            message = await asyncio.wait_for(self.from_worker.get(), WAIT_S)
            assert message is not None, f"the worker closed its side before sending a {kind}"
            if message.HasField(kind):
                return message

    async def until_closed(self) -> list[worker_pb2.WorkerMessage]:
        """Everything the worker sends until it closes its side."""
        seen = []
        while (message := await asyncio.wait_for(self.from_worker.get(), WAIT_S)) is not None:
            seen.append(message)
        return seen


class GatedExecutor:
    """Steps whose id has a gate block until the test opens it; ids in `failing` raise."""

    def __init__(self, gated: tuple[int, ...] = (), failing: tuple[int, ...] = ()) -> None:
        self.gates = {step_id: threading.Event() for step_id in gated}
        self.started = {step_id: threading.Event() for step_id in gated}
        self.failing = failing
        self.resets = 0

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        if step.step_id in self.gates:
            self.started[step.step_id].set()
            self.gates[step.step_id].wait(WAIT_S)
        if step.step_id in self.failing:
            raise ValueError("bad step")
        token = worker_pb2.SampledToken(request_id="r", token_id=step.step_id)
        return worker_pb2.StepResult(step_id=step.step_id, sampled=[token])

    def reset(self) -> None:
        self.resets += 1

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    async def wait_started(self, step_id: int) -> None:
        assert await asyncio.to_thread(self.started[step_id].wait, WAIT_S)


@pytest.fixture
async def scheduler() -> AsyncIterator[FakeScheduler]:
    fake = FakeScheduler()
    handler = grpc.stream_stream_rpc_method_handler(
        fake.Attach,
        request_deserializer=worker_pb2.WorkerMessage.FromString,
        response_serializer=worker_pb2.SchedulerMessage.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("meshserve.v1.Scheduler", {"Attach": handler}),)
    )
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    await server.stop(0)


@pytest.fixture
def model_thread() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
    yield pool
    pool.shutdown(wait=True)


class Attached:
    """A running AttachClient and what it told the health service."""

    def __init__(self, scheduler: FakeScheduler, executor: GatedExecutor, pool: ThreadPoolExecutor) -> None:
        self.executor = executor
        self.serving: list[bool] = []
        self.client = AttachClient(
            scheduler.address,
            worker_pb2.WorkerHello(worker_id="w"),
            executor,
            self._on_attached,
            pool,
            reconnect_interval=0.01,
            hung_step_timeout=0.1,
        )
        self.task = asyncio.create_task(self.client.run())

    async def _on_attached(self, attached: bool) -> None:
        self.serving.append(attached)

    async def stop(self) -> None:
        self.executor.open_all()  # never leave the model thread blocked behind the test
        self.client.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
async def attach(scheduler: FakeScheduler, model_thread: ThreadPoolExecutor) -> AsyncIterator[Attached]:
    attached = Attached(scheduler, GatedExecutor(gated=(1,), failing=(3,)), model_thread)
    await scheduler.next("hello")
    yield attached
    await attached.stop()


def test_heartbeat_interval_defaults_when_the_scheduler_names_none() -> None:
    assert heartbeat_interval(worker_pb2.AttachAccepted()) == DEFAULT_HEARTBEAT_INTERVAL_S
    assert heartbeat_interval(worker_pb2.AttachAccepted(heartbeat_interval_seconds=0.25)) == 0.25


async def test_heartbeats_go_on_while_a_step_is_slow(scheduler: FakeScheduler, attach: Attached) -> None:
    scheduler.accept()
    scheduler.step(1)
    await attach.executor.wait_started(1)
    beats = [(await scheduler.next("heartbeat")).heartbeat for _ in range(3)]
    assert all(beat.num_pending_steps == 1 for beat in beats)
    assert all(beat.running_step_seconds > 0 for beat in beats)
    assert beats[0].running_step_seconds <= beats[1].running_step_seconds <= beats[2].running_step_seconds
    attach.executor.open_all()
    assert (await scheduler.next("result")).result.step_id == 1
    after = (await scheduler.next("heartbeat")).heartbeat
    assert (after.num_pending_steps, after.running_step_seconds) == (0, 0.0)
    assert attach.serving == [True]


async def test_results_keep_step_order_and_a_failed_step_answers(scheduler: FakeScheduler, attach: Attached) -> None:
    scheduler.accept()
    for step_id in range(1, 6):
        scheduler.step(step_id)
    await attach.executor.wait_started(1)
    attach.executor.open_all()
    results = [(await scheduler.next("result")).result for _ in range(5)]
    assert [r.step_id for r in results] == [1, 2, 3, 4, 5]
    assert results[2].error == "ValueError: bad step"
    assert [r.sampled[0].token_id for r in results if not r.error] == [1, 2, 4, 5]


async def test_a_step_that_outlives_its_stream_is_a_hung_model(scheduler: FakeScheduler, attach: Attached) -> None:
    scheduler.accept()
    scheduler.step(1)
    await attach.executor.wait_started(1)
    scheduler.end_stream()  # what the scheduler does when step 1 passes its step timeout
    with pytest.raises(ModelThreadHung, match="step 1"):
        await asyncio.wait_for(attach.task, WAIT_S)
    assert attach.serving == [True, False]
    assert scheduler.calls == 1, "a hung worker must not attach again"


async def test_stream_end_resets_the_batch_and_reattaches(scheduler: FakeScheduler, attach: Attached) -> None:
    scheduler.accept()
    scheduler.step(2)
    assert (await scheduler.next("result")).result.step_id == 2
    scheduler.end_stream()
    await scheduler.next("hello")
    assert attach.executor.resets == 1
    scheduler.accept()
    scheduler.step(4)
    assert (await scheduler.next("result")).result.step_id == 4
    assert attach.serving == [True, False, True]


async def test_drain_keeps_answering_until_the_scheduler_ends_the_stream(
    scheduler: FakeScheduler, attach: Attached
) -> None:
    scheduler.accept()
    await scheduler.next("heartbeat")
    attach.client.drain("SIGTERM")
    assert (await scheduler.next("drain")).drain.reason == "SIGTERM"
    scheduler.step(2)  # the worker's running requests go on after its Drain
    assert (await scheduler.next("result")).result.step_id == 2
    await scheduler.next("heartbeat")
    scheduler.end_stream()
    await asyncio.wait_for(attach.task, WAIT_S)
    assert scheduler.calls == 1
    assert attach.serving == [True, False]


async def test_close_ends_the_worker_side_of_the_stream(scheduler: FakeScheduler, attach: Attached) -> None:
    scheduler.accept()
    scheduler.step(2)
    await scheduler.next("result")
    attach.client.close()
    await scheduler.until_closed()
    scheduler.end_stream()
    await asyncio.wait_for(attach.task, WAIT_S)
    assert scheduler.calls == 1


class CountingExecutor:
    def __init__(self) -> None:
        self.executed: list[int] = []

    def execute(self, step: worker_pb2.Step) -> worker_pb2.StepResult:
        self.executed.append(step.step_id)
        return worker_pb2.StepResult(step_id=step.step_id)

    def reset(self) -> None:
        pass


async def test_hang_after_steps_blocks_the_step_after_n() -> None:
    inner = CountingExecutor()
    faulty = HangAfterSteps(inner, 2)
    faulty.execute(worker_pb2.Step(step_id=1))
    faulty.execute(worker_pb2.Step(step_id=2))
    third = asyncio.create_task(asyncio.to_thread(faulty.execute, worker_pb2.Step(step_id=3)))
    assert await asyncio.to_thread(faulty.hanging.wait, WAIT_S)
    assert inner.executed == [1, 2]
    faulty.release()
    assert (await third).step_id == 3


def test_test_faults_are_armed_only_by_their_variable() -> None:
    inner = CountingExecutor()
    assert with_test_faults(inner, {}) is inner
    assert with_test_faults(inner, {HANG_AFTER_STEPS_ENV: ""}) is inner
    armed = with_test_faults(inner, {HANG_AFTER_STEPS_ENV: "3"})
    assert isinstance(armed, HangAfterSteps)
    assert armed.inner is inner and armed.steps_left == 3
