"""Prompt-lookup speculative decoding in the planner: the proposer, --speculative-config, and steps that carry
drafts, against the simulated worker (which verifies drafts as the real one does)."""

from collections.abc import Callable

import pydantic
import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.scheduler.request import Request, RequestStatus
from services.scheduler.speculation import SpeculativeConfig, propose_ngram
from services.scheduler.waiting_queue import WaitingQueue
from services.scheduler.worker_scheduler import WorkerScheduler
from tests.support.fake_worker import BS, FakeWorker, default_next_token
from tests.support.planner import make_planner

EOS = 2
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def cyclic(period: int) -> Callable[[list[int]], int]:
    """A model that repeats the token `period` back: its outputs repeat, so prompt lookup predicts them."""
    return lambda tokens: tokens[-period] if len(tokens) >= period else 1000 + len(tokens)


def make_sched(
    spec: SpeculativeConfig | None, max_num_batched_tokens: int = 64, num_blocks: int = 64
) -> tuple[WorkerScheduler, WaitingQueue]:
    waiting = WaitingQueue()
    planner = make_planner(
        waiting, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens, speculation=spec
    )
    return planner, waiting


def make_req(rid: str, prompt: list[int], max_tokens: int, **sampling: object) -> Request:
    params = sampling_pb2.SamplingParams(**(GREEDY | sampling))  # type: ignore[arg-type]
    return Request(rid, prompt, params, eos_token_ids=[EOS], max_tokens=max_tokens)


def run(sched: WorkerScheduler, worker: FakeWorker, max_steps: int = 1000) -> list[worker_pb2.Step]:
    steps: list[worker_pb2.Step] = []
    for _ in range(max_steps):
        step = sched.schedule()
        if step is None:
            return steps
        steps.append(step)
        sched.update(step, worker.execute(step))
    raise AssertionError("scheduler did not go idle")


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


# ---- the proposer and its settings ----------------------------------------------------------------------


def test_the_longest_suffix_match_proposes_what_followed_its_latest_occurrence() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # Suffix [2, 3] last occurred at 6..7, followed by 4, 5, 7.
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 7]
    # A 3-gram [7, 2, 3] has not occurred before; with min 3 nothing is proposed.
    assert propose_ngram(tokens, 3, 3, 3) == []
    # Fewer tokens than asked when the match is near the end.
    assert propose_ngram([5, 6, 5], 4, 1, 2) == [6, 5]
    assert propose_ngram([5], 4, 1, 2) == []


def test_a_byte_match_across_token_boundaries_is_not_a_token_match() -> None:
    # 256 then 0 packs as 00 01 00 00 | 00 00 00 00: the bytes of token 1 occur at offset 1, unaligned.
    assert propose_ngram([256, 0, 5, 1], 2, 1, 1) == []
    assert propose_ngram([256, 0, 1, 5, 1], 2, 1, 1) == [5, 1]


def test_speculative_config_uses_vllms_keys_and_names_what_is_wrong() -> None:
    config = SpeculativeConfig.model_validate_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (config.prompt_lookup_max, config.prompt_lookup_min, config.disable_by_batch_size) == (4, 1, None)
    with pytest.raises(pydantic.ValidationError, match="num_speculative_tokens"):
        SpeculativeConfig.model_validate_json('{"num_speculative_tokens": 17}')
    with pytest.raises(pydantic.ValidationError, match="prompt_lookup_min"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(pydantic.ValidationError, match="draft_model"):
        SpeculativeConfig.model_validate_json('{"num_speculative_tokens": 2, "draft_model": "x"}')
    with pytest.raises(pydantic.ValidationError, match="method"):
        SpeculativeConfig.model_validate_json('{"num_speculative_tokens": 2, "method": "eagle"}')


# ---- planning ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("next_token", [cyclic(3), cyclic(5), default_next_token], ids=["cyclic3", "cyclic5", "mixed"])
def test_output_with_speculation_equals_output_without(next_token: Callable[[list[int]], int]) -> None:
    def outputs(spec: SpeculativeConfig | None) -> tuple[dict[str, list[int]], int]:
        sched, waiting = make_sched(spec)
        worker = FakeWorker(next_token=next_token)
        reqs = [make_req(f"r{i}", [10 + i, 20, 30 + i, 40, 50 + i][: 3 + i % 3], max_tokens=13 + i) for i in range(4)]
        for r in reqs:
            waiting.append(r)
        steps = run(sched, worker)
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
        return {r.request_id: r.output_token_ids for r in reqs}, len(steps)

    plain, plain_steps = outputs(None)
    speculated, spec_steps = outputs(SPEC)
    assert speculated == plain
    assert all(len(v) == 13 + i for i, v in enumerate(plain.values()))
    if next_token is not default_next_token:
        # Repeating output is predicted: far fewer steps.
        assert spec_steps < plain_steps * 0.6


def test_a_step_carries_drafts_within_the_tokens_left_and_counts_what_was_kept() -> None:
    sched, waiting = make_sched(SPEC)
    worker = FakeWorker(next_token=cyclic(3))
    r = make_req("a", [7, 8, 9], max_tokens=6)
    waiting.append(r)
    first = sched.schedule()
    assert first is not None and not first.scheduled  # the prefill: no drafts
    sched.update(first, worker.execute(first))
    assert r.output_token_ids == [7]
    step = sched.schedule()
    assert step is not None
    (s,) = step.scheduled
    # Tokens 7 8 9 7: suffix [9, 7] has no earlier match, [7] has: 8 9 7 follow; 6 tokens max, 1 so far, and the
    # verified step adds one of its own, so 4 drafts at most: 8 9 7 is all lookup offers.
    assert list(s.draft_token_ids) == [8, 9, 7]
    assert s.num_scheduled_tokens == 4 and s.num_computed_tokens == 3
    assert len(sched.kv.block_ids(r)) * BS >= 3 + 4
    # While the drafts are verified nothing is planned on top (their outcome is unknown).
    assert sched.schedule() is None
    sched.update(step, worker.execute(step))
    assert r.output_token_ids == [7, 8, 9, 7, 8]
    assert r.num_computed_tokens == r.num_tokens - 1 and r.num_draft_tokens_in_flight == 0
    assert (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens) == (1, 3, 3)
    last = sched.schedule()
    assert last is not None
    # One token left: no room for drafts.
    assert not last.scheduled[0].draft_token_ids and last.scheduled[0].num_scheduled_tokens == 1
    sched.update(last, worker.execute(last))
    assert r.output_token_ids == [7, 8, 9, 7, 8, 9] and r.status is RequestStatus.FINISHED_LENGTH


def test_a_stop_inside_the_kept_drafts_ends_the_request_there() -> None:
    sched, waiting = make_sched(SPEC)
    worker = FakeWorker(next_token=cyclic(3))
    r = make_req("a", [5, EOS, 6], max_tokens=20, ignore_eos=False)
    waiting.append(r)
    run(sched, worker)
    # 5 EOS 6 | 5 then drafts EOS 6 5 ...: EOS is kept and ends the request; nothing after it is output.
    assert r.output_token_ids == [5, EOS] and r.status is RequestStatus.FINISHED_STOPPED


def test_requests_that_cannot_be_verified_exactly_get_no_drafts_and_keep_async_scheduling() -> None:
    sched, waiting = make_sched(SPEC)
    worker = FakeWorker(next_token=cyclic(3))
    sampled = make_req("t", [7, 8, 9], max_tokens=8, temperature=0.8, seed=1)
    waiting.append(sampled)
    step = sched.schedule()
    assert step is not None
    # Nothing to speculate: the next step is planned before this one answers, as without speculation.
    ahead = sched.schedule()
    assert ahead is not None and not ahead.scheduled[0].draft_token_ids
    sched.update(step, worker.execute(step))
    sched.update(ahead, worker.execute(ahead))
    assert worker.num_verified == 0


def test_speculation_stops_above_disable_by_batch_size() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    sched, waiting = make_sched(spec)
    worker = FakeWorker(next_token=cyclic(2))
    reqs = [make_req(f"r{i}", [7 + i, 8, 7 + i, 8], max_tokens=m) for i, m in enumerate([6, 6, 20])]
    for r in reqs:
        waiting.append(r)
    steps = run(sched, worker)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    for step in steps:
        running = len(step.scheduled) + len(step.new_requests)
        if running > 2:
            assert not any(s.draft_token_ids for s in step.scheduled)
    # Once two have finished the third runs alone, and is speculated.
    assert worker.num_verified > 0 and sched.num_drafts == worker.num_verified
    assert reqs[2].output_token_ids == [9, 8] * 10


def test_a_request_preempted_while_its_drafts_are_verified_drops_them_and_recomputes() -> None:
    sched, waiting = make_sched(SPEC, num_blocks=6)
    worker = FakeWorker(next_token=cyclic(3))
    a = make_req("a", [7, 8, 9], max_tokens=12)
    waiting.append(a)
    prefill = sched.schedule()
    assert prefill is not None
    sched.update(prefill, worker.execute(prefill))
    step = sched.schedule()
    assert step is not None and step.scheduled[0].draft_token_ids
    sched._preempt(a)  # as a later step's allocation would, while this one is in flight
    assert a.num_draft_tokens_in_flight == 0 and a.num_pending_samples == 0
    outputs = sched.update(step, worker.execute(step))
    assert outputs == [] and a.output_token_ids == [7]
    run(sched, worker)
    assert a.output_token_ids == [7, 8, 9] * 4 and a.status is RequestStatus.FINISHED_LENGTH


def test_drafts_never_preempt_another_request_for_their_blocks() -> None:
    sched, waiting = make_sched(SPEC, num_blocks=2)
    worker = FakeWorker(next_token=cyclic(3))
    a, b = make_req("a", [7, 8, 9], max_tokens=4), make_req("b", [1, 2, 3], max_tokens=4)
    waiting.append(a)
    waiting.append(b)
    prefill = sched.schedule()
    assert prefill is not None and len(prefill.new_requests) == 2
    sched.update(prefill, worker.execute(prefill))
    # Each holds its one block; a's drafts (8 9) would need a second, which only preempting b could free.
    step = sched.schedule()
    assert step is not None
    assert [s.request_id for s in step.scheduled] == ["a", "b"]
    assert not any(s.draft_token_ids for s in step.scheduled) and sched.num_preemptions == 0
    sched.update(step, worker.execute(step))
    run(sched, worker)
    assert a.output_token_ids == [7, 8, 9, 7] and b.output_token_ids == [1, 2, 3, 1]
