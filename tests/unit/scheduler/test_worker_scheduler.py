"""WorkerScheduler against a simulated worker that checks the Step protocol."""

from collections.abc import Callable

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.scheduler.request import Request, RequestStatus
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import RequestOutput, WorkerScheduler
from tests.support.fake_worker import FakeWorker, default_next_token
from tests.support.planner import make_planner

EOS = 2


def make_sched(
    waiting: WaitingQueue | None = None,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    caching: bool = True,
) -> WorkerScheduler:
    return make_planner(
        waiting,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        caching=caching,
    )


def make_req(rid: str, prompt: list[int], max_tokens: int = 4, **sampling: object) -> Request:
    params = sampling_pb2.SamplingParams(**sampling)  # type: ignore[arg-type]
    return Request(rid, prompt, params, eos_token_ids=[EOS], max_tokens=max_tokens)


def step_once(sched: WorkerScheduler, worker: FakeWorker) -> tuple[worker_pb2.Step | None, list[RequestOutput]]:
    step = sched.schedule()
    if step is None:
        return None, []
    return step, sched.update(step, worker.execute(step))


def run_to_completion(sched: WorkerScheduler, worker: FakeWorker, max_steps: int = 500) -> list[worker_pb2.Step]:
    steps: list[worker_pb2.Step] = []
    for _ in range(max_steps):
        step, _ = step_once(sched, worker)
        if step is None:
            return steps
        steps.append(step)
    raise AssertionError("scheduler did not go idle")


def test_long_prefill_threshold_chunks_a_long_prompt_and_lets_a_short_one_through() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_batched_tokens=64)
    sched.long_prefill_token_threshold = 12
    worker = FakeWorker()
    long, short = make_req("long", list(range(10, 50)), max_tokens=2), make_req("short", [7, 8, 9], max_tokens=2)
    waiting.append(long)
    waiting.append(short)
    step, _ = step_once(sched, worker)
    assert step is not None
    # Without the threshold the 40-token prompt would take the whole step alone; with it, 12 tokens a step,
    # and the short prompt runs (and gets its first token) in the same step.
    assert {r.request_id: r.num_scheduled_tokens for r in step.new_requests} == {"long": 12, "short": 3}
    assert short.output_token_ids and not long.output_token_ids
    chunks = [12]
    while not long.output_token_ids:
        step, _ = step_once(sched, worker)
        assert step is not None
        chunks += [r.num_scheduled_tokens for r in step.scheduled if r.request_id == "long"]
    assert chunks == [12, 12, 12, 4]
    run_to_completion(sched, worker)
    assert long.output_token_ids[0] == default_next_token(long.prompt_token_ids) and len(long.output_token_ids) == 2


def test_idle_scheduler_returns_none() -> None:
    sched = make_sched()
    assert sched.schedule() is None


def test_chunked_prefill_splits_long_prompt_within_budget() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_batched_tokens=16)
    worker = FakeWorker()
    r = make_req("a", list(range(10, 50)), max_tokens=2)
    waiting.append(r)
    chunks = []
    for _ in range(3):
        step, outs = step_once(sched, worker)
        assert step is not None
        reqs = list(step.new_requests) + list(step.scheduled)
        chunks.append(reqs[0].num_scheduled_tokens)
        assert sum(x.num_scheduled_tokens for x in reqs) <= 16
        if len(chunks) < 3:
            assert outs == []  # mid-prefill: no token yet
    assert chunks == [16, 16, 8]
    assert r.output_token_ids and r.num_computed_tokens == 40
    step, _ = step_once(sched, worker)
    assert step is not None and step.scheduled[0].num_scheduled_tokens == 1
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert step_once(sched, worker)[0] is not None  # carries the removal
    assert sched.schedule() is None


def test_running_first_then_admission_and_mixed_step() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_batched_tokens=10)
    worker = FakeWorker()
    a = make_req("a", [5, 6, 7], max_tokens=10)
    waiting.append(a)
    step_once(sched, worker)
    b = make_req("b", list(range(20, 40)), max_tokens=10)
    waiting.append(b)
    step, _ = step_once(sched, worker)
    assert step is not None
    # a decodes first; b gets the rest of the budget as a prefill chunk.
    assert [s.request_id for s in step.scheduled] == ["a"]
    assert step.scheduled[0].num_scheduled_tokens == 1
    assert step.scheduled[0].num_computed_tokens == 3
    assert [n.request_id for n in step.new_requests] == ["b"]
    assert step.new_requests[0].num_scheduled_tokens == 9
    assert sched.stats().num_mixed_steps == 1
    assert sched.stats().max_batch_size == 2
    # Next step: a decode, b continues its prefill ahead of anything new.
    waiting.append(make_req("c", [1, 1, 1]))
    step, _ = step_once(sched, worker)
    assert step is not None
    assert [s.request_id for s in step.scheduled] == ["a", "b"]
    assert [s.num_scheduled_tokens for s in step.scheduled] == [1, 9]
    assert len(step.new_requests) == 0 and len(waiting) == 1


def test_max_num_seqs_is_respected() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_seqs=2)
    worker = FakeWorker()
    reqs = [make_req(f"r{i}", [7, 8, 9 + i], max_tokens=3) for i in range(5)]
    for r in reqs:
        waiting.append(r)
    steps = run_to_completion(sched, worker)
    assert sched.stats().max_batch_size == 2
    for step in steps:
        assert len(step.new_requests) + len(step.scheduled) <= 2
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == 3 for r in reqs)


def test_stop_conditions_through_the_scheduler() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    script = {"eos": [11, EOS], "ign": [EOS, EOS, 12], "stop": [13, 42, 14]}

    def next_token(tokens: list[int]) -> int:
        rid = {3: "eos", 4: "ign", 5: "stop"}[tokens[0]]
        produced = len(tokens) - 2
        return script[rid][produced]

    worker = FakeWorker(next_token=next_token)
    eos = make_req("eos", [3, 0], max_tokens=10, logprobs=True)
    ign = make_req("ign", [4, 0], max_tokens=3, ignore_eos=True)
    stop = make_req("stop", [5, 0], max_tokens=10, stop_token_ids=[42])
    for r in (eos, ign, stop):
        waiting.append(r)
    finished: dict[str, RequestOutput] = {}
    for _ in range(10):
        _, outs = step_once(sched, worker)
        finished.update({o.request.request_id: o for o in outs if o.finish_reason is not None})
    assert eos.output_token_ids == [11, EOS] and finished["eos"].new_logprobs == [-0.5]
    assert finished["eos"].finish_reason is RequestStatus.FINISHED_STOPPED
    assert ign.output_token_ids == [EOS, EOS, 12]
    assert finished["ign"].finish_reason is RequestStatus.FINISHED_LENGTH
    assert stop.output_token_ids == [13, 42] and stop.stop_token_id == 42
    assert finished["stop"].finish_reason is RequestStatus.FINISHED_STOPPED
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_preempts_newest_and_resumes_with_outputs() -> None:
    waiting = WaitingQueue()
    # 6 blocks of 4: two requests of 8-token prompts fit, but not their growth to 20 tokens each.
    sched = make_sched(waiting, num_blocks=6)
    worker = FakeWorker()
    old = make_req("old", list(range(100, 108)), max_tokens=12, ignore_eos=True)
    new = make_req("new", list(range(200, 208)), max_tokens=12, ignore_eos=True)
    waiting.append(old)
    step_once(sched, worker)
    waiting.append(new)
    preempt_step = None
    for _ in range(20):
        step, _ = step_once(sched, worker)
        assert step is not None
        if "new" in step.removed_request_ids:
            preempt_step = step
            break
    assert preempt_step is not None
    assert new.status is RequestStatus.PREEMPTED and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.output_token_ids
    assert waiting.peek() is new
    assert old.status is RequestStatus.RUNNING
    assert [s.request_id for s in preempt_step.scheduled] == ["old"]
    kept = list(new.output_token_ids)

    resumed = None
    for _ in range(40):
        step, _ = step_once(sched, worker)
        if step is None:
            break
        for n in step.new_requests:
            if n.request_id == "new":
                resumed = n
    assert resumed is not None
    assert list(resumed.output_token_ids) == kept
    assert len(resumed.prompt_token_ids) == 8
    assert sched.stats().num_preemptions >= 1
    # Recompute continues exactly where it left off.
    reference = list(range(200, 208))
    for _ in range(12):
        reference.append(default_next_token(reference))
    assert new.all_token_ids == reference
    assert old.status is new.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 6


def test_self_preemption_stops_the_running_pass() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, num_blocks=2, max_num_batched_tokens=64)
    worker = FakeWorker()
    a = make_req("a", list(range(1, 9)), max_tokens=1)
    b = make_req("b", [50], max_tokens=5, ignore_eos=True)
    waiting.append(a)
    waiting.append(b)
    # a takes both blocks and finishes; b waits, then runs.
    step_once(sched, worker)
    assert a.status is RequestStatus.FINISHED_LENGTH
    run_to_completion(sched, worker)
    assert b.status is RequestStatus.FINISHED_LENGTH
    # Now one request grows past the pool: it preempts itself and waits at the head.
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7], max_tokens=5, ignore_eos=True)
    waiting.append(c)
    for _ in range(5):
        step, _ = step_once(sched, worker)
        assert step is not None
        if c.status is RequestStatus.PREEMPTED:
            assert step.removed_request_ids == ["c"]
            assert len(step.scheduled) == len(step.new_requests) == 0
            break
    assert c.status is RequestStatus.PREEMPTED
    assert waiting.peek() is c


def test_abort_frees_blocks_and_is_removed_next_step() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    worker = FakeWorker()
    a = make_req("a", list(range(10)), max_tokens=10, ignore_eos=True)
    b = make_req("b", list(range(20, 30)), max_tokens=10, ignore_eos=True)
    waiting.append(a)
    waiting.append(b)
    step_once(sched, worker)
    step = sched.schedule()
    assert step is not None
    # Abort while the step is in flight: its tokens are dropped when the result comes.
    assert sched.abort("a") is a
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("a") is None
    outs = sched.update(step, worker.execute(step))
    assert [o.request.request_id for o in outs] == ["b"]
    assert len(a.output_token_ids) == 1
    step = sched.schedule()
    assert step is not None
    assert list(step.removed_request_ids) == ["a"]
    assert [s.request_id for s in step.scheduled] == ["b"]
    sched.update(step, worker.execute(step))
    assert sched.abort("b") is b
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    step = sched.schedule()
    assert step is not None and list(step.removed_request_ids) == ["b"]
    assert sched.schedule() is None


def test_release_all_hands_back_running_work() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    worker = FakeWorker()
    a = make_req("a", list(range(10)), max_tokens=10, ignore_eos=True)
    b = make_req("b", list(range(20, 30)), max_tokens=10, ignore_eos=True)
    waiting.append(a)
    waiting.append(b)
    step_once(sched, worker)
    step_once(sched, worker)
    drained = sched.release_all()
    assert drained == [a, b]
    assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in drained)
    assert all(len(r.output_token_ids) == 2 for r in drained)
    assert sched.num_running == 0
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule() is None
    # Another worker picks them up and continues from prompt + outputs.
    other_queue = WaitingQueue()
    for r in drained:
        other_queue.append(r)
    other = make_sched(other_queue)
    step = other.schedule()
    assert step is not None
    assert [n.request_id for n in step.new_requests] == ["a", "b"]
    assert len(step.new_requests[0].output_token_ids) == 2
    assert step.new_requests[0].num_scheduled_tokens == 12


def test_prefix_cache_hit_across_requests() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    worker = FakeWorker()
    first = make_req("first", list(range(1, 14)), max_tokens=2, ignore_eos=True)
    waiting.append(first)
    run_to_completion(sched, worker)
    second = make_req("second", [*range(1, 13), 77, 78], max_tokens=2, ignore_eos=True)
    waiting.append(second)
    step = sched.schedule()
    assert step is not None
    [n] = step.new_requests
    assert n.num_computed_tokens == 12
    assert n.num_scheduled_tokens == 2
    assert second.num_cached_tokens == 12
    stats = sched.stats()
    assert stats.prefix_cache_queries == 13 + 14
    assert stats.prefix_cache_hits == 12


def test_pool_is_fully_free_after_many_requests() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16)
    worker = FakeWorker()
    reqs = [make_req(f"r{i}", [i % 3 + 3] * (5 + i), max_tokens=6, ignore_eos=True) for i in range(10)]
    for r in reqs:
        waiting.append(r)
    run_to_completion(sched, worker)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    stats = sched.stats()
    assert stats.num_free_blocks == stats.num_blocks == 12
    assert stats.num_running == 0
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert worker.held == {}


def test_failed_step_aborts_its_requests_and_forgets_their_hashes() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    a = make_req("a", list(range(1, 10)), max_tokens=4)
    waiting.append(a)
    step = sched.schedule()
    assert step is not None
    outs = sched.update(step, worker_pb2.StepResult(step_id=step.step_id, error="boom"))
    assert [(o.request, o.finish_reason, o.error) for o in outs] == [(a, RequestStatus.FINISHED_ABORTED, "boom")]
    assert sched.kv.pool.num_cached_blocks == 0
    b = make_req("b", list(range(1, 10)), max_tokens=4)
    waiting.append(b)
    step = sched.schedule()
    assert step is not None
    assert list(step.removed_request_ids) == ["a"]
    assert step.new_requests[0].num_computed_tokens == 0


def test_step_ids_increase_and_mismatched_result_is_rejected() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    waiting.append(make_req("a", [1, 2, 3], max_tokens=5, ignore_eos=True))
    worker = FakeWorker()
    s1, _ = step_once(sched, worker)
    s2 = sched.schedule()
    assert s1 is not None and s2 is not None and s2.step_id > s1.step_id
    with pytest.raises(ValueError):
        sched.update(s2, worker_pb2.StepResult(step_id=s1.step_id))


def test_can_ever_fit() -> None:
    sched = make_sched(num_blocks=4)
    assert sched.can_ever_fit(16)
    assert not sched.can_ever_fit(17)


def test_no_admission_in_a_step_that_preempted() -> None:
    waiting = WaitingQueue()
    # A 1-token budget left after the survivor's decode would let the victim back in as a tiny chunk.
    sched = make_sched(waiting, num_blocks=6, max_num_batched_tokens=2, caching=False)
    worker = FakeWorker()
    old = make_req("old", list(range(100, 108)), max_tokens=30, ignore_eos=True)
    new = make_req("new", list(range(200, 208)), max_tokens=30, ignore_eos=True)
    waiting.append(old)
    waiting.append(new)
    for _ in range(60):
        step, _ = step_once(sched, worker)
        assert step is not None
        if "new" in step.removed_request_ids:
            assert len(step.new_requests) == 0
            assert new.status is RequestStatus.PREEMPTED and waiting.peek() is new
            assert sched.kv.pool.num_free_blocks >= 1
            break
    else:
        raise AssertionError("no preemption happened")
    # The next step takes it back.
    step, _ = step_once(sched, worker)
    assert step is not None and [n.request_id for n in step.new_requests] == ["new"]


def test_token_for_unfinished_prefill_chunk_is_ignored() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_batched_tokens=8)
    r = make_req("a", list(range(1, 20)), max_tokens=4)
    waiting.append(r)
    step = sched.schedule()
    assert step is not None and step.new_requests[0].num_scheduled_tokens == 8
    bogus = worker_pb2.StepResult(step_id=step.step_id)
    bogus.sampled.append(worker_pb2.SampledToken(request_id="a", token_id=9))
    assert sched.update(step, bogus) == []
    assert r.output_token_ids == [] and r.num_computed_tokens == 8


def test_failed_step_forgets_its_hashes_with_a_later_step_in_flight() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    a = make_req("a", list(range(1, 10)), max_tokens=4)
    waiting.append(a)
    first = sched.schedule()
    assert first is not None
    assert sched.kv.pool.num_cached_blocks == 2
    # Planned before the first step answers (async scheduling): a's first decode.
    second = sched.schedule()
    assert second is not None and second.scheduled[0].num_computed_tokens == 9
    outputs = sched.update(first, worker_pb2.StepResult(step_id=first.step_id, error="boom"))
    assert [o.finish_reason for o in outputs] == [RequestStatus.FINISHED_ABORTED]
    assert sched.kv.pool.num_cached_blocks == 0
    # The second step's answer for the aborted request is dropped.
    late = worker_pb2.StepResult(step_id=second.step_id)
    late.sampled.append(worker_pb2.SampledToken(request_id="a", token_id=5))
    assert sched.update(second, late) == []
    b = make_req("b", list(range(1, 10)), max_tokens=4)
    waiting.append(b)
    step = sched.schedule()
    assert step is not None
    assert step.new_requests[0].num_computed_tokens == 0
    assert list(step.removed_request_ids) == ["a"]


def test_not_admitting_runs_the_rest() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    worker = FakeWorker()
    a = make_req("a", [1, 2, 3], max_tokens=3, ignore_eos=True)
    waiting.append(a)
    step_once(sched, worker)
    waiting.append(make_req("b", [4, 5, 6]))
    while (step := sched.schedule(admit=False)) is not None:
        sched.update(step, worker.execute(step))
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert len(waiting) == 1


def run_pipelined(sched: WorkerScheduler, worker: FakeWorker, max_steps: int = 500) -> list[worker_pb2.Step]:
    """Async scheduling as the servicer does it: up to two steps out, answers applied in order."""
    in_flight: list[worker_pb2.Step] = []
    steps: list[worker_pb2.Step] = []
    for _ in range(max_steps):
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            in_flight.append(step)
            steps.append(step)
            continue
        if not in_flight:
            return steps
        # The worker runs steps in order; the answer comes back after the next step was planned.
        done = in_flight.pop(0)
        sched.update(done, worker.execute(done))
    raise AssertionError("scheduler did not go idle")


def _eos_after(n: int) -> Callable[[list[int]], int]:
    """A worker whose requests emit EOS once they hold n tokens (prompt included)."""
    return lambda tokens: EOS if len(tokens) >= n else default_next_token(tokens)


@pytest.mark.parametrize("eos_at", [None, 14, 23])
def test_pipelined_steps_give_the_same_tokens(eos_at: int | None) -> None:
    prompts = {f"r{i}": list(range(10 + i, 19 + 3 * i)) for i in range(6)}
    outputs = []
    for runner in (run_to_completion, run_pipelined):
        waiting = WaitingQueue()
        sched = make_sched(waiting, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
        reqs = [make_req(rid, p, max_tokens=7) for rid, p in prompts.items()]
        for r in reqs:
            waiting.append(r)
        worker = FakeWorker() if eos_at is None else FakeWorker(next_token=_eos_after(eos_at))
        steps = runner(sched, worker)
        assert all(r.is_finished for r in reqs) and not worker.held
        outputs.append(({r.request_id: r.output_token_ids for r in reqs}, len(steps)))
    (serial, serial_steps), (pipelined, pipelined_steps) = outputs
    assert pipelined == serial
    # EOS is seen one step late: the token planned meanwhile is computed and dropped, never sent.
    assert pipelined_steps >= serial_steps


def test_next_decode_is_planned_before_the_answer() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    r = make_req("a", list(range(1, 10)), max_tokens=3)
    waiting.append(r)
    first = sched.schedule()
    second = sched.schedule()
    assert first is not None and second is not None
    # The prefill's token is in flight: the next step computes it at position 9.
    assert (second.scheduled[0].num_computed_tokens, second.scheduled[0].num_scheduled_tokens) == (9, 1)
    assert r.num_pending_samples == 2
    third = sched.schedule()
    assert third is not None and third.scheduled[0].num_computed_tokens == 10
    # max_tokens=3: all three tokens are in flight, nothing more to plan.
    assert sched.schedule() is None
    worker = FakeWorker()
    for step in (first, second, third):
        sched.update(step, worker.execute(step))
    assert r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == 3


def test_eos_drops_the_token_planned_meanwhile() -> None:
    waiting = WaitingQueue()
    sched = make_sched(waiting)
    r = make_req("a", list(range(1, 10)), max_tokens=8)
    waiting.append(r)
    worker = FakeWorker(next_token=lambda tokens: EOS)
    first, second = sched.schedule(), sched.schedule()
    assert first is not None and second is not None
    outs = sched.update(first, worker.execute(first))
    assert outs[0].finish_reason is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS]
    assert sched.update(second, worker.execute(second)) == []
    assert r.output_token_ids == [EOS]
    removal = sched.schedule()
    assert removal is not None and list(removal.removed_request_ids) == ["a"]


def test_new_requests_of_one_step_stay_under_the_message_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.scheduler import worker_scheduler

    waiting = WaitingQueue()
    sched = make_sched(waiting, max_num_batched_tokens=256)
    a, b = make_req("a", list(range(10, 50))), make_req("b", list(range(60, 100)))
    monkeypatch.setattr(worker_scheduler, "STEP_NEW_REQUEST_BYTES", worker_scheduler.new_request_bytes(a) + 10)
    waiting.append(a)
    waiting.append(b)
    first = sched.schedule()
    assert first is not None and [n.request_id for n in first.new_requests] == ["a"]
    second = sched.schedule()
    assert second is not None and [n.request_id for n in second.new_requests] == ["b"]
    assert worker_scheduler.new_request_bytes(a) >= first.new_requests[0].ByteSize()
