"""The Cluster without gRPC: routing over workers, losing one, parking, draining, deadlines, bounds."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, worker_pb2
from services.scheduler.cluster import Cluster
from services.scheduler.engine import WorkerLoop, WorkerState
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.router import RoutingPolicy
from services.scheduler.settings import SchedulerSettings
from services.scheduler.submissions import Failure, Item
from tests.support.fake_worker import BS, FakeWorker

EOS = 2


class Harness:
    """A cluster, fake workers behind its WorkerLoops, and every event each request received."""

    def __init__(self, **settings: object) -> None:
        self.cluster = Cluster(SchedulerSettings(**settings), SchedulerMetrics(CollectorRegistry()))  # type: ignore[arg-type]
        self.fakes: dict[str, FakeWorker] = {}
        self.events: dict[str, list[Item]] = {}

    def attach(self, worker_id: str, num_blocks: int = 64, max_num_batched_tokens: int = 0) -> WorkerLoop:
        hello = worker_pb2.WorkerHello(
            worker_id=worker_id, block_size=BS, num_blocks=num_blocks, max_model_len=2048, vocab_size=2000,
            model_identity="m", model_name="tiny", max_num_batched_tokens=max_num_batched_tokens,
        )  # fmt: skip
        self.cluster.check_hello(hello)
        worker = self.cluster.attach(hello)
        self.cluster.mark_ready(worker)
        self.fakes[worker_id] = FakeWorker()
        return worker

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 6, **kwargs: object) -> Failure | None:
        sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                          eos_token_ids=[EOS], **kwargs)  # type: ignore[arg-type]  # fmt: skip
        self.events[rid] = []
        out = self.cluster.submit(req, lambda r, item: self.events[r].append(item))
        return out if isinstance(out, Failure) else None

    def step(self, worker_id: str) -> bool:
        """One step planned and answered on one worker; whether there was one."""
        worker = self.cluster.workers[worker_id]
        step = worker.plan(0.0)
        if step is None:
            return False
        self.cluster.dispatch(worker.apply(self.fakes[worker_id].execute(step), 0.0))
        return True

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not any([self.step(w) for w in list(self.cluster.workers)]):
                return
        raise AssertionError("not idle")

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events[rid] if isinstance(e, scheduler_pb2.TokenEvent) for t in e.token_ids]

    def final(self, rid: str) -> Item:
        return self.events[rid][-1]

    def release_finished(self) -> None:
        for rid in list(self.cluster.submissions):
            if self.cluster.submissions[rid].finished:
                self.cluster.release(rid)


def _prompt(seed: int, n: int = 10) -> list[int]:
    return [10 + (seed * 7 + i * 13) % 900 for i in range(n)]


async def test_shared_prefix_sticks_to_its_worker_and_the_rest_spreads() -> None:
    h = Harness()
    h.attach("a")
    h.attach("b")
    prefix = _prompt(99, 40)
    h.submit("p0", [*prefix, 5])
    h.run()
    holder = next(w for w in h.cluster.workers.values() if w.num_routed == 1).worker_id
    for i in range(1, 4):
        h.submit(f"p{i}", [*prefix, 5 + i])
    for i in range(6):
        h.submit(f"u{i}", _prompt(i))
    h.run()
    stats = {w.worker_id: w for w in h.cluster.stats().workers}
    assert stats[holder].num_routed >= 4
    assert all(w.num_routed >= 2 for w in stats.values()), "unrelated requests did not spread"
    assert stats[holder].prefix_cache_hits >= 3 * 40


async def test_a_lost_workers_requests_finish_elsewhere_unchanged() -> None:
    undisturbed = Harness()
    undisturbed.attach("a")
    for i in range(4):
        undisturbed.submit(f"r{i}", _prompt(i), max_tokens=12)
    undisturbed.run()

    h = Harness(routing="round-robin")
    h.attach("a")
    h.attach("b")
    for i in range(4):
        h.submit(f"r{i}", _prompt(i), max_tokens=12)
    for _ in range(4):
        h.step("a")
        h.step("b")
    lost = h.cluster.workers["a"]
    assert lost.planner.num_running > 0
    h.cluster.detach(lost, "stream failed: UNAVAILABLE")
    h.run()
    for i in range(4):
        assert h.tokens(f"r{i}") == undisturbed.tokens(f"r{i}")
        final = h.final(f"r{i}")
        assert isinstance(final, scheduler_pb2.TokenEvent)
        assert final.stop_kind == scheduler_pb2.STOP_KIND_LENGTH
    stats = h.cluster.stats()
    assert stats.num_workers_lost == 1 and stats.num_requeued >= 1
    [b] = stats.workers
    assert b.num_free_blocks == b.num_blocks


async def test_without_workers_new_requests_fail_at_once_and_requeued_ones_wait() -> None:
    h = Harness(worker_wait_timeout=0.2)
    failure = h.submit("early", _prompt(1))
    assert failure is not None and failure.code is grpc.StatusCode.UNAVAILABLE and failure.retry_after > 0
    a = h.attach("a")
    h.submit("kept", _prompt(2), max_tokens=8)
    h.submit("expires", _prompt(3), max_tokens=8)
    h.step("a")
    h.cluster.detach(a, "heartbeat")
    assert len(h.cluster.parked) == 2
    assert h.submit("refused", _prompt(4)) is not None
    # A worker attaching within the wait takes them over.
    h.attach("b")
    h.run()
    assert len(h.tokens("kept")) == 8
    h.release_finished()
    # Lost again, and nothing attaches: they fail with UNAVAILABLE after the wait.
    h.submit("late", _prompt(5), max_tokens=50)
    h.step("b")
    h.cluster.detach(h.cluster.workers["b"], "stream failed")
    await asyncio.sleep(0.4)
    late = h.final("late")
    assert isinstance(late, Failure) and late.code is grpc.StatusCode.UNAVAILABLE


async def test_draining_worker_takes_nothing_new_and_hands_over_its_queue() -> None:
    h = Harness(routing="round-robin", max_num_seqs=1)
    a = h.attach("a")
    h.attach("b")
    for i in range(6):
        h.submit(f"r{i}", _prompt(i))
    h.step("a")
    running = [r.request_id for r in a.planner.running]
    h.cluster.begin_drain(a, "SIGTERM")
    assert a.state is WorkerState.DRAINING and len(a.waiting) == 0
    h.submit("new", _prompt(9))
    assert a.num_routed == 3
    h.run()
    assert all(len(h.tokens(f"r{i}")) == 6 for i in range(6))
    assert a.is_idle and running


async def test_deadline_ends_the_request_and_frees_its_blocks() -> None:
    h = Harness()
    a = h.attach("a")
    h.submit("slow", _prompt(1), max_tokens=100, timeout_seconds=0.05)
    h.step("a")
    await asyncio.sleep(0.1)
    final = h.final("slow")
    assert isinstance(final, Failure) and final.code is grpc.StatusCode.DEADLINE_EXCEEDED
    h.run()
    assert a.planner.kv.pool.num_free_blocks == a.planner.kv.num_blocks
    assert a.is_idle


async def test_queue_bound_refuses_with_retry_advice() -> None:
    h = Harness(max_waiting_requests=3)
    h.attach("a")
    assert all(h.submit(f"r{i}", _prompt(i)) is None for i in range(3))
    failure = h.submit("over", _prompt(4))
    assert failure is not None and failure.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failure.retry_after > 0
    h.run()


async def test_stuck_step_and_silence_are_reasons_to_lose_a_worker() -> None:
    h = Harness()
    a = h.attach("a")
    h.submit("r", _prompt(1))
    a.heard_from(100.0)
    assert a.plan(100.0) is not None
    assert a.stuck_reason(101.0, heartbeat_timeout=10, step_timeout=5) is None
    assert "step" in (a.stuck_reason(106.0, heartbeat_timeout=10, step_timeout=5) or "")
    assert "no message" in (a.stuck_reason(111.0, heartbeat_timeout=10, step_timeout=60) or "")


async def test_model_info_reports_the_tightest_ready_worker() -> None:
    h = Harness(max_model_len=200)
    assert h.cluster.model_info().num_ready_workers == 0
    h.attach("a")
    info = h.cluster.model_info()
    assert (info.model_name, info.max_model_len, info.vocab_size, info.num_ready_workers) == ("tiny", 200, 2000, 1)


@pytest.mark.parametrize(
    ("scheduler_flag", "reported", "planned"),
    [
        (None, 512, 512),  # unset here: the worker's own budget (its platform's)
        (None, 0, 2048),  # a worker from before the field ran the old default
        (1024, 512, 512),  # the smaller of the two
        (256, 512, 256),
        (1024, 0, 1024),
    ],
)
async def test_a_workers_step_budget_is_the_smaller_given(
    scheduler_flag: int | None, reported: int, planned: int
) -> None:
    h = Harness(max_num_batched_tokens=scheduler_flag)
    worker = h.attach("a", max_num_batched_tokens=reported)
    assert worker.planner.max_num_batched_tokens == planned


async def test_a_worker_busy_prefilling_is_not_taken_for_idle() -> None:
    h = Harness(routing="round-robin", max_num_batched_tokens=16)
    a, b = h.attach("a", num_blocks=256), h.attach("b", num_blocks=256)
    h.submit("long", _prompt(1, 400), max_tokens=4)
    h.submit("short", _prompt(2, 4), max_tokens=100)
    for _ in range(3):
        h.step("a")
        h.step("b")
    # One request running on each: a's is 48 tokens into a 400-token prefill, b's is decoding.
    assert [r.request_id for r in a.planner.running] == ["long"]
    assert [r.request_id for r in b.planner.running] == ["short"]
    h.cluster.policy = RoutingPolicy.KV
    h.submit("cold", _prompt(4, 20))
    assert b.num_routed == 2, "the worker with 352 prompt tokens still to compute took the new request"


@pytest.mark.parametrize(
    ("policy", "first_answered"), [("shortest-prefill-first", "short"), ("fcfs", "long")]
)  # fmt: skip
async def test_the_scheduling_policy_orders_each_workers_queue(policy: str, first_answered: str) -> None:
    """A long prompt submitted just before a short one: under shortest-prefill-first the short one's first
    token comes first, under fcfs the long one's."""
    h = Harness(scheduling_policy=policy, scheduling_aging_tokens_per_second=10.0, max_num_batched_tokens=64)
    worker = h.attach("a", num_blocks=256)
    assert worker.waiting.policy == policy
    h.submit("long", _prompt(1, 200), max_tokens=2)
    h.submit("short", _prompt(2, 20), max_tokens=2)
    order: list[str] = []
    while h.step("a"):
        order += [rid for rid in ("long", "short") if h.tokens(rid) and rid not in order]
    assert order[0] == first_answered and set(order) == {"long", "short"}
