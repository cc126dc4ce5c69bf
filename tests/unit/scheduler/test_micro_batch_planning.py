"""Micro-batches for a pipeline-parallel worker: up to P steps in flight, no request in two of them, and the
same tokens as planning one step at a time, with preemption and aborts while P steps are out."""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.common.sampling_checks import InvalidField
from services.scheduler.cluster import Cluster
from services.scheduler.engine import MAX_STEP_SLOTS, WorkerLoop
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Request, RequestStatus
from services.scheduler.settings import SchedulerSettings
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import WorkerScheduler
from tests.support.fake_worker import FakeWorker, default_next_token
from tests.support.planner import make_planner

EOS = 2


def _req(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, sampling_pb2.SamplingParams(), eos_token_ids=[EOS], max_tokens=max_tokens)


def _ids(step: worker_pb2.Step) -> set[str]:
    return {n.request_id for n in step.new_requests} | {s.request_id for s in step.scheduled}


def run_micro_batched(
    sched: WorkerScheduler,
    worker: FakeWorker,
    slots: int,
    between: Callable[[int], None] = lambda _: None,
    max_steps: int = 2000,
) -> list[worker_pb2.Step]:
    """Up to `slots` steps out, answered in order (the worker runs them in order, stage after stage); each
    new step must share no request with the ones in flight. between(i) runs before planning round i."""
    in_flight: collections.deque[worker_pb2.Step] = collections.deque()
    steps: list[worker_pb2.Step] = []
    for i in range(max_steps):
        between(i)
        step = sched.schedule() if len(in_flight) < slots else None
        if step is not None:
            for other in in_flight:
                assert not _ids(step) & _ids(other), f"step {step.step_id} shares requests with {other.step_id}"
            in_flight.append(step)
            steps.append(step)
            continue
        if not in_flight:
            return steps
        done = in_flight.popleft()
        sched.update(done, worker.execute(done))
    raise AssertionError("scheduler did not go idle")


def run_serial(sched: WorkerScheduler, worker: FakeWorker) -> None:
    while (step := sched.schedule()) is not None:
        sched.update(step, worker.execute(step))


def _eos_after(n: int) -> Callable[[list[int]], int]:
    return lambda tokens: EOS if len(tokens) >= n else default_next_token(tokens)


def _outputs(micro: bool, slots: int, num_blocks: int, next_token: Callable[[list[int]], int]) -> tuple:
    waiting = WaitingQueue()
    sched = make_planner(waiting, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=24,
                         micro_batches=slots if micro else 1)  # fmt: skip
    reqs = [_req(f"r{i}", list(range(10 + i, 20 + 4 * i)), max_tokens=9) for i in range(8)]
    for r in reqs:
        waiting.append(r)
    worker = FakeWorker(next_token=next_token)
    steps = run_micro_batched(sched, worker, slots) if micro else []
    if not micro:
        run_serial(sched, worker)
    assert all(r.is_finished for r in reqs) and not worker.held
    return {r.request_id: r.output_token_ids for r in reqs}, sched.num_preemptions, steps


@pytest.mark.parametrize("slots", [2, 3, 4])
@pytest.mark.parametrize("eos_at", [None, 17])
@pytest.mark.parametrize("num_blocks", [64, 14])
def test_micro_batches_are_disjoint_and_give_the_serial_tokens(slots: int, eos_at: int | None, num_blocks: int) -> None:
    next_token = default_next_token if eos_at is None else _eos_after(eos_at)
    serial, _, _ = _outputs(False, 1, num_blocks, next_token)
    micro, preemptions, steps = _outputs(True, slots, num_blocks, next_token)
    assert micro == serial
    if num_blocks == 14:
        # 14 blocks of 4 tokens hold far less than six requests of up to 47 tokens: preempted while steps are out.
        assert preemptions > 0
    # The pipeline was kept full: some rounds had every slot busy.
    assert len(steps) > len(serial)


def test_a_request_in_flight_is_not_planned_again_until_it_answers() -> None:
    waiting = WaitingQueue()
    sched = make_planner(waiting, micro_batches=2)
    a, b = _req("a", list(range(1, 10)), 4), _req("b", list(range(20, 26)), 4)
    waiting.append(a)
    first = sched.schedule()
    assert first is not None and _ids(first) == {"a"}
    waiting.append(b)
    # a's prefill is in flight, its sample pending: the next micro-batch takes only b.
    second = sched.schedule()
    assert second is not None and _ids(second) == {"b"}
    assert sched.schedule() is None
    worker = FakeWorker()
    sched.update(first, worker.execute(first))
    third = sched.schedule()
    assert third is not None and _ids(third) == {"a"}
    assert (third.scheduled[0].num_computed_tokens, third.scheduled[0].num_scheduled_tokens) == (9, 1)


def test_without_micro_batches_async_scheduling_plans_on_top() -> None:
    # The contrast: one stage, async scheduling plans a's decode while its prefill is out.
    waiting = WaitingQueue()
    sched = make_planner(waiting)
    waiting.append(_req("a", list(range(1, 10)), 4))
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None and _ids(second) == {"a"}


def test_an_abort_while_steps_are_out_frees_the_request_and_the_rest_finish() -> None:
    serial, _, _ = _outputs(False, 1, 64, default_next_token)
    waiting = WaitingQueue()
    sched = make_planner(waiting, max_num_seqs=6, max_num_batched_tokens=24, micro_batches=3)
    reqs = [_req(f"r{i}", list(range(10 + i, 20 + 4 * i)), max_tokens=9) for i in range(8)]
    for r in reqs:
        waiting.append(r)
    worker = FakeWorker()
    aborted: list[Request] = []

    def abort_r3_in_flight(_: int) -> None:
        r3 = reqs[3]
        if not aborted and r3.in_flight_step and r3.output_token_ids:
            assert sched.abort("r3") is r3
            aborted.append(r3)

    run_micro_batched(sched, worker, 3, between=abort_r3_in_flight)
    assert aborted and reqs[3].status is RequestStatus.FINISHED_ABORTED
    # The worker was told to drop it, and nothing it sampled after the abort reached the request.
    assert not worker.held and len(reqs[3].output_token_ids) < 9
    assert {r.request_id: r.output_token_ids for r in reqs if r is not reqs[3]} == {
        rid: tokens for rid, tokens in serial.items() if rid != "r3"
    }
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


def test_a_failed_step_frees_its_requests_from_flight() -> None:
    waiting = WaitingQueue()
    sched = make_planner(waiting, micro_batches=2)
    a = _req("a", list(range(1, 10)), 4)
    waiting.append(a)
    step = sched.schedule()
    assert step is not None and a.in_flight_step == step.step_id
    outs = sched.update(step, worker_pb2.StepResult(step_id=step.step_id, error="boom"))
    assert a.in_flight_step == 0 and [o.request.request_id for o in outs] == ["a"]


def test_the_workers_step_slots_set_the_depth_and_micro_batching() -> None:
    def loop(slots: int) -> WorkerLoop:
        hello = worker_pb2.WorkerHello(worker_id="w", block_size=4, num_blocks=16, max_model_len=64, vocab_size=100,
                                       step_slots=slots)  # fmt: skip
        return WorkerLoop.create(hello, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                 enable_prefix_caching=True, depth=2)  # fmt: skip

    assert (loop(0).depth, loop(0).planner.micro_batches) == (2, 1)
    assert (loop(1).depth, loop(1).planner.micro_batches) == (2, 1)
    assert (loop(4).depth, loop(4).planner.micro_batches) == (4, 4)


def test_a_worker_asking_for_too_many_step_slots_is_refused() -> None:
    cluster = Cluster(SchedulerSettings(), SchedulerMetrics(CollectorRegistry()))  # type: ignore[call-arg]
    hello = worker_pb2.WorkerHello(worker_id="w", block_size=4, num_blocks=16, max_model_len=64, vocab_size=100,
                                   model_identity="m", step_slots=MAX_STEP_SLOTS + 1)  # fmt: skip
    with pytest.raises(InvalidField) as info:
        cluster.check_hello(hello)
    assert info.value.field == "step_slots"
    hello.step_slots = MAX_STEP_SLOTS
    cluster.check_hello(hello)


def test_each_micro_batch_takes_its_share_of_the_running_requests() -> None:
    waiting = WaitingQueue()
    sched = make_planner(waiting, max_num_seqs=8, max_num_batched_tokens=64, micro_batches=2)
    for i in range(8):
        waiting.append(_req(f"r{i}", [10 + i, 11 + i, 12 + i], max_tokens=12))
    steps = run_micro_batched(sched, FakeWorker(), 2)
    sizes = [len(s.new_requests) + len(s.scheduled) for s in steps]
    # All eight join in one step; from then on the two stages each get half of them, step after step.
    assert sizes[0] == 8
    assert set(sizes[1:-2]) == {4}, sizes
