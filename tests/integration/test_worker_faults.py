"""Many workers over real processes: losing one (kill -9 or stuck), adding one, draining one, routing."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import grpc
import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2
from tests.support.calls import Answer, greedy_token_answers, stream
from tests.support.suite import Suite, rss_mib, start_suite
from tests.support.tiny_model import transformers_greedy

pytestmark = pytest.mark.slow

VOCAB = 512
KV = ["--kv-cache-memory", "16MiB"]


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _routed(stats: scheduler_pb2.SchedulerStats) -> dict[str, int]:
    return {w.worker_id: w.num_routed for w in stats.workers}


async def _streams_with_fault(suite: Suite, prompts: list[list[int]], max_tokens: int, fault: str) -> list[Answer]:
    """Run the prompts at once; kill -9 worker-1 while it generates for some of them (a hang needs nothing)."""
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with GenerationClient(suite.address) as client:
        tasks = [asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params))) for p in prompts]
        if fault == "kill":
            await suite.wait_running("worker-1")
            suite.workers[1].process.kill()
            suite.workers[1].process.wait()
        return list(await asyncio.gather(*tasks))


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_lost_worker_16_streams_finish_unchanged(tiny_model_dir: Path, tmp_path: Path, fault: str) -> None:
    """kill -9, or a model thread that blocks forever while the process (and its heartbeats) live on."""
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        num_workers=1,
        worker_args=KV,
        scheduler_args=["--step-timeout", "3", "--routing", "round-robin"],
    )
    prompts = _prompts(16, seed=21)
    try:
        # The undisturbed run, on worker-0 alone (its greedy output equals transformers', test_suite_tiny).
        undisturbed = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=160))
        # worker-1 is the one the fault hits: its model thread blocks forever after 30 steps for "hang".
        env = {"MESHSERVE_TEST_HANG_AFTER_STEPS": "30"} if fault == "hang" else None
        suite.add_worker(tiny_model_dir, KV, env=env)
        asyncio.run(suite.wait_workers(2))
        answers = asyncio.run(_streams_with_fault(suite, prompts, 160, fault))
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    for expected, answer in zip(undisturbed, answers, strict=True):
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        # Every token exactly once, in order, as the undisturbed run gave them.
        assert answer.token_ids == expected.token_ids
    assert stats.num_workers_lost == 1
    assert stats.num_requeued >= 1, "the fault hit no request"
    assert stats.workers[0].num_free_blocks == stats.workers[0].num_blocks
    assert [w.worker_id for w in stats.workers] == ["worker-0"]


def test_added_worker_takes_load_and_prefixes_stick(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(tiny_model_dir, tmp_path, num_workers=1, worker_args=KV)
    try:

        async def run() -> None:
            params = sampling_params(max_tokens=200, temperature=0.0, ignore_eos=True)
            async with GenerationClient(suite.address) as client:
                load = [
                    asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params)))
                    for p in _prompts(6, seed=31)
                ]
                await asyncio.sleep(0.2)
                suite.add_worker(tiny_model_dir, KV)
                before = _routed(await suite.wait_workers(2))
                # Arrivals after the new worker is ready: it has the lighter load, so it takes some.
                late = [
                    asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params)))
                    for p in _prompts(6, seed=32)
                ]
                await asyncio.gather(*load, *late)
            after = _routed(await suite.wait_idle())
            assert after.get("worker-1", 0) - before.get("worker-1", 0) >= 1, (before, after)

            # Repeated shared-prefix requests, one after another, go to the worker that holds the prefix.
            prefix = _prompts(1, seed=33, lo=200, hi=200)[0]
            start = _routed(await suite.stats())
            for i in range(5):
                await greedy_token_answers(suite.address, [[*prefix, 20 + i, 21 + i]], max_tokens=4)
            shared = {k: v - start.get(k, 0) for k, v in _routed(await suite.stats()).items()}
            assert sorted(shared.values()) == [0, 5], shared
            # Unrelated requests at once spread over both workers.
            start = _routed(await suite.stats())
            await greedy_token_answers(suite.address, _prompts(8, seed=34), max_tokens=16)
            spread = {k: v - start.get(k, 0) for k, v in _routed(await suite.stats()).items()}
            assert min(spread.values()) >= 2, spread

        asyncio.run(run())
    finally:
        suite.stop()


def _multi_turn_hit_rate(model_dir: Path, log_dir: Path, routing: str) -> float:
    suite = start_suite(model_dir, log_dir, num_workers=2, worker_args=KV, scheduler_args=["--routing", routing])
    try:

        async def conversation(seed: int) -> None:
            history = _prompts(1, seed=seed, lo=40, hi=40)[0]
            for turn in range(4):
                [answer] = await greedy_token_answers(suite.address, [history], max_tokens=8)
                history = [*history, *answer.token_ids, *_prompts(1, seed=seed * 10 + turn, lo=24, hi=24)[0]]

        async def run() -> scheduler_pb2.SchedulerStats:
            await asyncio.gather(*(conversation(s) for s in range(4)))
            return await suite.wait_idle()

        stats = asyncio.run(run())
    finally:
        suite.stop()
    return stats.prefix_cache_hits / stats.prefix_cache_queries


def test_kv_routing_hits_the_cache_more_than_round_robin(tiny_model_dir: Path, tmp_path: Path) -> None:
    kv = _multi_turn_hit_rate(tiny_model_dir, tmp_path / "kv", "kv")
    rr = _multi_turn_hit_rate(tiny_model_dir, tmp_path / "rr", "round-robin")
    print(f"prefix-cache hit rate: kv {kv:.3f}, round-robin {rr:.3f}")
    assert kv > rr


def test_cancels_and_deadlines_leave_every_pool_free(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(tiny_model_dir, tmp_path, num_workers=2, worker_args=KV)
    rng = random.Random(41)
    outcomes: dict[str, int] = {}

    async def one(client: GenerationClient, prompt: list[int]) -> None:
        params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
        request = build_request(token_ids=prompt, sampling=params)
        try:
            if rng.random() < 0.5:
                call = client.stub.Generate(request)
                stop_after = rng.randint(0, 20)
                async for _ in call:
                    stop_after -= 1
                    if stop_after <= 0:
                        break
                call.cancel()
                kind = "cancelled"
            else:
                async for _ in client.generate(request, timeout=rng.uniform(0.05, 1.0)):
                    pass
                kind = "finished"
        except grpc.aio.AioRpcError as err:
            kind = err.code().name
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async def run() -> scheduler_pb2.SchedulerStats:
        async with GenerationClient(suite.address) as client:
            prompts = _prompts(200, seed=42, lo=5, hi=60)
            for wave in range(0, 200, 50):
                await asyncio.gather(*(one(client, p) for p in prompts[wave : wave + 50]))
        return await suite.wait_idle(timeout=60)

    try:
        stats = asyncio.run(run())
    finally:
        suite.stop()
    print("outcomes:", outcomes)
    assert sum(outcomes.values()) == 200
    assert outcomes.get("DEADLINE_EXCEEDED", 0) > 0 and outcomes.get("cancelled", 0) > 0
    assert set(outcomes) <= {"cancelled", "finished", "DEADLINE_EXCEEDED"}, outcomes
    assert stats.num_running == 0 and stats.num_waiting == 0
    for worker in stats.workers:
        assert worker.num_free_blocks == worker.num_blocks, worker


def test_flood_past_the_queue_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        worker_args=[*KV, "--max-num-seqs", "2"],
        scheduler_args=["--max-waiting-requests", "8", "--max-num-seqs", "2"],
    )
    codes: list[str] = []

    async def one(client: GenerationClient, prompt: list[int]) -> None:
        params = sampling_params(max_tokens=64, temperature=0.0, ignore_eos=True)
        try:
            answer = await stream(client, build_request(token_ids=prompt, sampling=params))
            assert len(answer.token_ids) == 64
            codes.append("OK")
        except grpc.aio.AioRpcError as err:
            codes.append(err.code().name)

    async def run() -> None:
        async with GenerationClient(suite.address) as client:
            for wave in range(5):
                await asyncio.gather(*(one(client, p) for p in _prompts(100, seed=50 + wave)))

    try:
        before = rss_mib(suite.scheduler.process.pid)
        asyncio.run(run())
        asyncio.run(suite.wait_idle())
        after = rss_mib(suite.scheduler.process.pid)
    finally:
        suite.stop()
    print(f"scheduler RSS before {before:.1f} MiB, after 500 flooded requests {after:.1f} MiB; codes:",
          {c: codes.count(c) for c in set(codes)})  # fmt: skip
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}
    assert codes.count("RESOURCE_EXHAUSTED") > 0 and codes.count("OK") >= 10
    assert after < before + 64, "scheduler memory grew with the flood"


def test_sigterm_on_a_worker_under_load_fails_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(tiny_model_dir, tmp_path, num_workers=2, worker_args=[*KV, "--shutdown-grace-period", "60"])
    prompts = _prompts(12, seed=61)
    try:

        async def run() -> list[Answer]:
            params = sampling_params(max_tokens=200, temperature=0.0, ignore_eos=True)
            async with GenerationClient(suite.address) as client:
                tasks = [
                    asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params))) for p in prompts
                ]
                await suite.wait_running("worker-0")
                os.kill(suite.workers[0].process.pid, signal.SIGTERM)
                return list(await asyncio.gather(*tasks))

        answers = asyncio.run(run())
        assert suite.workers[0].process.wait(90) == 0, suite.workers[0].log_tail()
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, 200)
    assert [w.worker_id for w in stats.workers] == ["worker-1"]


def test_scheduler_kill_and_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(tiny_model_dir, tmp_path, worker_args=KV)
    try:

        async def in_flight_at_kill() -> list[str]:
            params = sampling_params(max_tokens=400, temperature=0.0, ignore_eos=True)
            codes: list[str] = []

            async def one(prompt: list[int]) -> None:
                try:
                    await stream(client, build_request(token_ids=prompt, sampling=params))
                    codes.append("OK")
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code().name)

            async with GenerationClient(suite.address) as client:
                tasks = [asyncio.create_task(one(p)) for p in _prompts(4, seed=71)]
                while (await suite.stats()).num_running == 0:
                    await asyncio.sleep(0.01)
                suite.scheduler.process.kill()
                suite.scheduler.process.wait()
                # Never a hang: every call ends on its own, well before this bound.
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            return codes

        codes = asyncio.run(in_flight_at_kill())
        assert codes and set(codes) == {"UNAVAILABLE"}, codes
        restarted = suite.launcher.start("scheduler-2", suite.scheduler.args, suite.scheduler.address)
        suite.scheduler = restarted

        async def serves_again() -> Answer:
            await suite.wait_workers(1, timeout=60)
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                try:
                    [answer] = await greedy_token_answers(suite.address, [[5, 6, 7]], max_tokens=8)
                    return answer
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.5)

        answer = asyncio.run(serves_again())
        assert answer.token_ids == transformers_greedy(tiny_model_dir, [5, 6, 7], 8)
    finally:
        suite.stop()
