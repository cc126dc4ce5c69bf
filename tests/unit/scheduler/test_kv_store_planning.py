"""The planner with a kvstore: loads of stored prefixes, write-through and selective saves, aborts and losses
mid-load, swap."""

from __future__ import annotations

import pytest

from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
from services.scheduler import worker_scheduler
from services.scheduler.request import Request, RequestStatus
from services.scheduler.worker_scheduler import KVStoreUse, WorkerScheduler, new_request_bytes
from tests.support.fake_worker import BS, FakeWorker
from tests.support.planner import make_planner

FORMAT = "meshserve-kv1:" + "0" * 64


def make_sched(
    num_blocks: int = 64, swap: bool = False, max_num_batched_tokens: int = 64, save_on_reuse: bool = False
) -> WorkerScheduler:
    return make_planner(
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_store=KVStoreUse(FORMAT, swap=swap, save_on_reuse=save_on_reuse),
    )


def make_req(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(rid, prompt, sampling_pb2.SamplingParams(ignore_eos=True), eos_token_ids=[2], max_tokens=max_tokens)


def run(sched: WorkerScheduler, worker: FakeWorker, max_steps: int = 400) -> list[worker_pb2.Step]:
    steps: list[worker_pb2.Step] = []
    for _ in range(max_steps):
        step = sched.schedule() or sched.poll_step()
        if step is None:
            return steps
        sched.update(step, worker.execute(step))
        steps.append(step)
    raise AssertionError("scheduler did not go idle")


def stored_everywhere(prompt: list[int], max_tokens: int = 6) -> tuple[list[int], set[bytes]]:
    """Run a request on a first worker with a store: its output and what it saved."""
    store: set[bytes] = set()
    sched = make_sched()
    request = make_req("first", prompt, max_tokens)
    sched.waiting.append(request)
    run(sched, FakeWorker(store=store))
    return request.output_token_ids, store


PROMPT = list(range(10, 10 + 8 * BS + 2))


def test_saves_are_the_full_blocks_each_step_completes() -> None:
    out, store = stored_everywhere(PROMPT)
    request = make_req("again", PROMPT)
    # Prompt plus outputs: every full block of the sequence was saved once.
    full = (len(PROMPT) + len(out) - 1) // BS
    assert len(store) == full
    assert set(request.get_block_hashes(BS)[:8]) <= store


def _saves(steps: list[worker_pb2.Step]) -> list[tuple[int, bytes]]:
    return [(b.block_id, b.block_hash) for s in steps for b in s.kv_saves]


def test_selective_saves_a_block_the_first_time_a_request_reuses_it() -> None:
    sched = make_sched(save_on_reuse=True)
    worker = FakeWorker(store=set())
    first = make_req("first", PROMPT)
    sched.waiting.append(first)
    assert _saves(run(sched, worker)) == [], "a prompt seen once costs the store nothing"
    hashes = first.get_block_hashes(BS)[:8]
    cached = [sched.kv.pool.get_cached_block(h) for h in hashes]
    assert all(b is not None for b in cached)

    # Two requests reuse the prefix in one step: its blocks are saved once, by that step, where they lie.
    again = [make_req(f"again{i}", PROMPT) for i in range(2)]
    for request in again:
        sched.waiting.append(request)
    steps = run(sched, worker)
    assert len(steps[0].new_requests) == 2
    assert _saves(steps[:1]) == [(b.block_id, h) for b, h in zip(cached, hashes, strict=True) if b is not None]
    assert _saves(steps[1:]) == []
    assert [r.output_token_ids for r in again] == [first.output_token_ids] * 2

    third = make_req("third", PROMPT)
    sched.waiting.append(third)
    assert _saves(run(sched, worker)) == [], "already in the store"
    assert sched.stats().kv_store_saves == 8


def test_selective_saves_count_against_the_step_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two admissions whose NewRequests fit the step's byte budget, but not with their hits' saves: the second
    waits a step, so a step with saves still fits the worker's message cap."""
    sched = make_sched(save_on_reuse=True)
    worker = FakeWorker(store=set())
    prompts = [PROMPT, [t + 100 for t in PROMPT]]
    for i, prompt in enumerate(prompts):
        sched.waiting.append(make_req(f"warm{i}", prompt))
    run(sched, worker)
    again = [make_req(f"again{i}", prompt) for i, prompt in enumerate(prompts)]
    size = new_request_bytes(again[0])
    monkeypatch.setattr(worker_scheduler, "STEP_NEW_REQUEST_BYTES", 2 * size + 100)
    for request in again:
        sched.waiting.append(request)
    steps = run(sched, worker)
    assert [len(s.new_requests) for s in steps[:2]] == [1, 1]
    assert [len(s.kv_saves) for s in steps[:2]] == [8, 8]


def test_selective_does_not_save_blocks_that_came_from_the_store() -> None:
    _, store = stored_everywhere(PROMPT)
    sched = make_sched(save_on_reuse=True)
    worker = FakeWorker(store=store)
    loaded = make_req("loaded", PROMPT)
    loaded.stored_blocks[FORMAT] = 8
    sched.waiting.append(loaded)
    run(sched, worker)
    assert sched.stats().kv_store_loaded_tokens == 8 * BS
    reuse = make_req("reuse", PROMPT)
    sched.waiting.append(reuse)
    steps = run(sched, worker)
    assert reuse.num_cached_tokens == 8 * BS and _saves(steps) == []


def test_a_block_evicted_and_recomputed_is_saved_again_on_reuse() -> None:
    sched = make_sched(num_blocks=12, save_on_reuse=True)
    worker = FakeWorker(store=set())
    prompt = PROMPT[: 2 * BS + 1]
    for name in ("a", "b"):
        sched.waiting.append(make_req(name, prompt, max_tokens=1))
        run(sched, worker)
    assert sched.stats().kv_store_saves == 2
    # Fill the pool with other prompts: the prefix's blocks are evicted and their flags go with them.
    for i in range(4):
        sched.waiting.append(make_req(f"fill{i}", list(range(300 + 20 * i, 300 + 20 * i + 3 * BS)), max_tokens=1))
        run(sched, worker)
    assert sched.kv.pool.get_cached_block(make_req("x", prompt).get_block_hashes(BS)[0]) is None
    for name in ("c", "d"):
        sched.waiting.append(make_req(name, prompt, max_tokens=1))
        run(sched, worker)
    assert sched.stats().kv_store_saves == 4


@pytest.mark.parametrize("load_delay", [0, 3])
def test_stored_prefix_is_loaded_not_recomputed_and_output_is_unchanged(load_delay: int) -> None:
    expected, store = stored_everywhere(PROMPT)
    sched = make_sched()
    worker = FakeWorker(store=store, load_delay=load_delay)
    request = make_req("b", PROMPT)
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    steps = run(sched, worker)
    first = steps[0]
    assert not first.new_requests and len(first.kv_loads) == 1 and len(first.kv_loads[0].blocks) == 8
    new = next(n for s in steps for n in s.new_requests)
    assert new.num_computed_tokens == 8 * BS and new.num_scheduled_tokens == 2
    assert request.output_token_ids == expected
    assert request.num_cached_tokens == 8 * BS
    stats = sched.stats()
    assert stats.kv_store_loaded_tokens == 8 * BS and stats.kv_store_load_misses == 0
    # Loaded blocks are not saved again; only the blocks the outputs filled are.
    assert not any(b.block_hash in request.get_block_hashes(BS)[:8] for s in steps[1:] for b in s.kv_saves)
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_a_partial_load_recomputes_the_rest() -> None:
    expected, store = stored_everywhere(PROMPT)
    request = make_req("b", PROMPT)
    hashes = request.get_block_hashes(BS)
    store -= set(hashes[5:])  # the store lost blocks 5..: only 5 of the 8 load
    sched = make_sched()
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    steps = run(sched, FakeWorker(store=store))
    new = next(n for s in steps for n in s.new_requests)
    assert new.num_computed_tokens == 5 * BS
    assert request.output_token_ids == expected
    assert sched.stats().kv_store_load_misses == 3


def test_local_prefix_hit_loads_only_the_blocks_beyond_it() -> None:
    expected, store = stored_everywhere(PROMPT)
    sched = make_sched()
    worker = FakeWorker(store=store)
    warm = make_req("warm", PROMPT[: 3 * BS + 1], max_tokens=1)
    sched.waiting.append(warm)
    run(sched, worker)
    request = make_req("b", PROMPT)
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    steps = run(sched, worker)
    assert [len(load.blocks) for s in steps for load in s.kv_loads] == [5]
    assert request.output_token_ids == expected


def test_abort_while_loading_frees_blocks_only_after_the_load_answers() -> None:
    _, store = stored_everywhere(PROMPT)
    sched = make_sched()
    worker = FakeWorker(store=store, load_delay=2)
    request = make_req("b", PROMPT)
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    step = sched.schedule()
    assert step is not None and step.kv_loads
    sched.update(step, worker.execute(step))
    assert sched.abort("b") is request and request.status is RequestStatus.FINISHED_ABORTED
    # The worker is still writing those blocks: none of them may be handed out yet.
    assert sched.kv.pool.num_free_blocks < sched.kv.num_blocks
    run(sched, worker)
    assert not sched.loading and sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert sched.schedule() is None


def test_worker_lost_mid_load_hands_the_request_back() -> None:
    stored_everywhere(PROMPT)
    sched = make_sched()
    request = make_req("b", PROMPT)
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    step = sched.schedule()
    assert step is not None and step.kv_loads
    released = sched.release_all()
    assert released == [request] and request.status is RequestStatus.PREEMPTED
    assert request.num_computed_tokens == 0 and not sched.loading


def test_loads_only_poll_with_empty_steps() -> None:
    _, store = stored_everywhere(PROMPT)
    sched = make_sched()
    request = make_req("b", PROMPT)
    request.stored_blocks[FORMAT] = 8
    sched.waiting.append(request)
    steps = run(sched, FakeWorker(store=store, load_delay=2))
    polls = [s for s in steps if not s.new_requests and not s.scheduled and not s.kv_loads]
    assert len(polls) >= 2


def test_swap_preemption_resumes_from_saved_blocks_with_the_same_output() -> None:
    prompts = [list(range(100 * i, 100 * i + 3 * BS + 1)) for i in range(1, 5)]
    reference = make_sched(num_blocks=64)
    ref_worker = FakeWorker(store=set())
    refs = [make_req(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    for r in refs:
        reference.waiting.append(r)
    run(reference, ref_worker)

    sched = make_sched(num_blocks=12, swap=True)
    worker = FakeWorker(store=set())
    requests = [make_req(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    for r in requests:
        sched.waiting.append(r)
    steps = run(sched, worker)
    stats = sched.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_store_resumed > 0 and stats.kv_store_loaded_tokens > 0
    assert any(s.kv_loads for s in steps)
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in refs]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    # The step planned with a swap-out tells the worker to send its queued saves now; no other step does.
    flushed = sum(s.kv_saves_flush for s in steps)
    assert 0 < flushed <= stats.num_preemptions
    first = next(i for i, s in enumerate(steps) if s.kv_saves_flush)
    assert not any(s.kv_saves_flush for s in steps[:first])


def test_recompute_preemption_does_not_load() -> None:
    prompts = [list(range(100 * i, 100 * i + 3 * BS + 1)) for i in range(1, 5)]
    sched = make_sched(num_blocks=12, swap=False)
    requests = [make_req(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    for r in requests:
        sched.waiting.append(r)
    steps = run(sched, FakeWorker(store=set()))
    assert sched.stats().num_preemptions > 0
    assert not any(s.kv_loads for s in steps)
    assert not any(s.kv_saves_flush for s in steps)  # nothing resumes from the saves
