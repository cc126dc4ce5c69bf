"""The kvstore in the engine, over real processes: a prefix computed on one worker loads on another (also
TP=1 -> TP=2), a killed worker's requests resume from stored blocks, swap preemption, a store going away."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from services.common.channels import insecure_channel
from services.common.proto.meshserve.v1 import kvstore_pb2, kvstore_pb2_grpc, sampling_pb2, scheduler_pb2
from services.kvstore.health import BACKEND_HEALTH_NAME, SERVICE_NAME
from tests.support.calls import Answer, greedy_token_answers
from tests.support.kvstore import KVStoreClient, RedisServer, start_kvstore
from tests.support.suite import Suite, start_suite

pytestmark = pytest.mark.slow

VOCAB = 512
KV = ["--kv-cache-memory", "16MiB"]
# The CPU platform's default block size: the whole-block prefix the store can hold.
BLOCK = 16


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _worker(stats: scheduler_pb2.SchedulerStats, worker_id: str) -> scheduler_pb2.WorkerPoolStats:
    return next(w for w in stats.workers if w.worker_id == worker_id)


async def store_stats(address: str) -> kvstore_pb2.StoreStats:
    async with insecure_channel(address) as channel:
        stats: kvstore_pb2.StoreStats = await kvstore_pb2_grpc.KVBlockStoreStub(channel).Stats(
            kvstore_pb2.StatsRequest(), timeout=10
        )
        return stats


async def wait_stored(address: str, num_blocks: int, timeout: float = 60.0) -> kvstore_pb2.StoreStats:
    """Saves run behind the steps (and wait for each other, up to the worker's SAVE_LINGER_S): poll until
    the store has stored at least num_blocks blocks since it started."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = await store_stats(address)
        if stats.blocks_stored >= num_blocks:
            return stats
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"store holds {stats.blocks_stored} blocks, expected {num_blocks}")
        await asyncio.sleep(0.05)


def _store(suite: Suite) -> str:
    assert suite.kv_store is not None
    return suite.kv_store.address


def _prefix_on_one_worker_then_the_other(
    suite: Suite, prompt: list[int], reverse: bool = False
) -> tuple[Answer, Answer]:
    """Round-robin routing over two workers: the prompt runs on one worker, then on the other (worker-0 first
    when the requests routed so far are even, as at the start; reverse: a short filler request goes first)."""

    async def run() -> tuple[Answer, Answer]:
        if reverse:
            await greedy_token_answers(suite.address, [[7, 8, 9]], max_tokens=1)
        stored_before = (await store_stats(_store(suite))).blocks_stored
        (first,) = await greedy_token_answers(suite.address, [prompt], max_tokens=24)
        # The prompt's own blocks, not ones an earlier request stored.
        await wait_stored(_store(suite), stored_before + (len(prompt) - 1) // BLOCK)
        (second,) = await greedy_token_answers(suite.address, [prompt], max_tokens=24)
        return first, second

    return asyncio.run(run())


def test_prefix_computed_on_one_worker_loads_on_the_other(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        num_workers=2,
        worker_args=KV,
        scheduler_args=["--routing", "round-robin"],
        kv_store_args=[],
    )
    try:
        prompt = _prompts(1, seed=3, lo=300, hi=300)[0]
        first, second = _prefix_on_one_worker_then_the_other(suite, prompt)
        stats = asyncio.run(suite.wait_idle())
        kv = asyncio.run(store_stats(_store(suite)))
    finally:
        suite.stop()
    # Loading instead of recomputing changes nothing in the greedy output.
    assert second.token_ids == first.token_ids
    w0, w1 = _worker(stats, "worker-0"), _worker(stats, "worker-1")
    assert w0.num_routed == 1 and w1.num_routed == 1
    num_blocks = (len(prompt) - 1) // BLOCK
    assert w1.kv_store_loaded_tokens == num_blocks * BLOCK and w1.kv_store_load_misses == 0
    assert w1.prefix_cache_hits == 0, "worker-1 never saw the prompt: nothing can be local"
    assert w0.kv_store_saves >= num_blocks and w0.kv_store_saves_dropped == 0
    assert kv.hits >= num_blocks
    # The client is told what it did not wait for.
    assert second.usage is not None and second.usage.cached_tokens == num_blocks * BLOCK
    assert stats.kv_store_enabled and stats.kv_store_lookup_errors == 0


def test_selective_saves_a_prefix_once_it_is_reused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """write-through-selective: a prompt run once is not stored; run again on its worker, its prefix is, and
    then loads on the other worker with the same output."""
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        num_workers=2,
        worker_args=KV,
        scheduler_args=["--routing", "round-robin", "--kv-store-write-policy", "write-through-selective"],
        kv_store_args=[],
    )
    prompt = _prompts(1, seed=5, lo=300, hi=300)[0]
    num_blocks = (len(prompt) - 1) // BLOCK

    async def run() -> tuple[list[Answer], list[scheduler_pb2.SchedulerStats]]:
        stats: list[scheduler_pb2.SchedulerStats] = []
        (first,) = await greedy_token_answers(suite.address, [prompt], max_tokens=24)  # worker-0
        await greedy_token_answers(suite.address, [[7, 8, 9]], max_tokens=1)  # worker-1
        stats.append(await suite.wait_idle())
        (again,) = await greedy_token_answers(suite.address, [prompt], max_tokens=24)  # worker-0: a local hit
        stats.append(await suite.wait_idle())
        await wait_stored(_store(suite), num_blocks)
        (elsewhere,) = await greedy_token_answers(suite.address, [prompt], max_tokens=24)  # worker-1: a load
        stats.append(await suite.wait_idle())
        return [first, again, elsewhere], stats

    try:
        answers, (seen_once, reused, loaded) = asyncio.run(run())
    finally:
        suite.stop()
    assert answers[1].token_ids == answers[0].token_ids and answers[2].token_ids == answers[0].token_ids
    assert [_worker(seen_once, w).kv_store_saves for w in ("worker-0", "worker-1")] == [0, 0]
    assert _worker(reused, "worker-0").kv_store_saves == num_blocks
    assert _worker(reused, "worker-0").prefix_cache_hits == num_blocks * BLOCK
    w1 = _worker(loaded, "worker-1")
    assert w1.kv_store_loaded_tokens == num_blocks * BLOCK and w1.kv_store_load_misses == 0
    assert w1.kv_store_saves == 0, "loaded blocks are in the store already"


def test_tp1_blocks_load_into_a_tp2_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        num_workers=1,
        worker_args=[*KV, "--device", "cpu"],
        scheduler_args=["--routing", "round-robin"],
        kv_store_args=[],
    )
    try:
        suite.add_worker(tiny_model_dir, [*KV, "--device", "cpu", "--tensor-parallel-size", "2"])
        asyncio.run(suite.wait_workers(2))
        prompt = _prompts(1, seed=4, lo=200, hi=200)[0]
        first, second = _prefix_on_one_worker_then_the_other(suite, prompt)
        # And back: blocks written by the TP=2 worker's two ranks load into the TP=1 worker.
        other = _prompts(1, seed=5, lo=150, hi=150)[0]
        third, fourth = _prefix_on_one_worker_then_the_other(suite, other, reverse=True)
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    assert second.token_ids == first.token_ids
    assert fourth.token_ids == third.token_ids
    loaded = {w.worker_id: w.kv_store_loaded_tokens for w in stats.workers}
    assert loaded["worker-1"] == ((len(prompt) - 1) // BLOCK) * BLOCK
    assert loaded["worker-0"] == ((len(other) - 1) // BLOCK) * BLOCK


# Long enough that every request still runs when worker-1 dies (after ~20 saved blocks, ~6 of output).
RESUME_TOKENS = 250


def test_killed_worker_requests_resume_from_stored_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = _prompts(8, seed=6, lo=40, hi=80)
    # The undisturbed run on a suite of its own, without a store: worker-0 below must not hold these
    # sequences in its prefix cache, or the requeued requests would resume from it rather than the store.
    reference = start_suite(tiny_model_dir, tmp_path / "reference", worker_args=KV)
    try:
        undisturbed = asyncio.run(greedy_token_answers(reference.address, prompts, max_tokens=RESUME_TOKENS))
    finally:
        reference.stop()
    suite = start_suite(
        tiny_model_dir,
        tmp_path / "store",
        num_workers=2,
        worker_args=KV,
        scheduler_args=["--routing", "round-robin"],
        kv_store_args=[],
    )
    try:

        async def run() -> list[Answer]:
            task = asyncio.ensure_future(greedy_token_answers(suite.address, prompts, max_tokens=RESUME_TOKENS))
            # Strike once worker-1 has saved its prompts' blocks and a few blocks of output: the scheduler has
            # asked for 20 of its blocks, and the store holds every block asked for by then (a worker gathers
            # a few steps' saves into one Put, so they reach the store a moment after the step).
            while True:
                workers = (await suite.stats()).workers
                if sum(w.kv_store_saves for w in workers if w.worker_id == "worker-1") >= 20:
                    break
                await asyncio.sleep(0.01)
            await wait_stored(_store(suite), sum(w.kv_store_saves for w in workers))
            suite.workers[1].process.kill()
            suite.workers[1].process.wait()
            return await task

        answers = asyncio.run(run())
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    for expected, answer in zip(undisturbed, answers, strict=True):
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert answer.token_ids == expected.token_ids
    assert stats.num_workers_lost == 1 and stats.num_requeued >= 1
    assert stats.kv_store_resumed >= 1, "no requeued request resumed from the store"
    assert stats.kv_store_loaded_tokens > 0


def test_swap_preemption_gives_the_same_outputs(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = _prompts(12, seed=7, lo=60, hi=120)
    reference = start_suite(tiny_model_dir, tmp_path / "reference", worker_args=KV)
    try:
        expected = asyncio.run(greedy_token_answers(reference.address, prompts, max_tokens=120))
    finally:
        reference.stop()
    # 512 KiB of KV (1024 tokens) holds about 4 of these sequences at once: the rest are preempted, swapped
    # out and resumed.
    suite = start_suite(
        tiny_model_dir,
        tmp_path / "swap",
        worker_args=["--kv-cache-memory", "512KiB", "--max-model-len", "512", "--max-num-batched-tokens", "512"],
        scheduler_args=["--preemption-mode", "swap"],
        kv_store_args=[],
    )
    try:
        answers = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=120))
        stats = asyncio.run(suite.wait_idle())
        kv = asyncio.run(store_stats(_store(suite)))
    finally:
        suite.stop()
    assert [a.token_ids for a in answers] == [e.token_ids for e in expected]
    assert stats.num_preemptions > 0
    assert stats.kv_store_resumed > 0 and stats.kv_store_loaded_tokens > 0
    assert kv.blocks_stored > 0 and kv.hits > 0
    assert stats.workers[0].num_free_blocks == stats.workers[0].num_blocks


def test_two_kvstore_replicas_on_one_redis_share_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    suite = None
    try:
        # Replica 1 serves the scheduler and worker-0; replica 2 serves worker-1 alone.
        suite = start_suite(
            tiny_model_dir,
            tmp_path,
            num_workers=1,
            worker_args=KV,
            scheduler_args=["--routing", "round-robin"],
            kv_store_args=["--backend", redis_server.url],
        )
        replica = start_kvstore(suite.launcher, "kvstore-2", backend=redis_server.url)
        suite.add_worker(tiny_model_dir, [*KV, "--kv-store", replica.address])
        asyncio.run(suite.wait_workers(2))
        prompt = _prompts(1, seed=8, lo=250, hi=250)[0]
        first, second = _prefix_on_one_worker_then_the_other(suite, prompt)
        stats = asyncio.run(suite.wait_idle())
        replica_stats = asyncio.run(store_stats(replica.address))
    finally:
        if suite is not None:
            suite.stop()
        redis_server.stop()
    assert second.token_ids == first.token_ids
    num_blocks = (len(prompt) - 1) // BLOCK
    assert _worker(stats, "worker-1").kv_store_loaded_tokens == num_blocks * BLOCK
    # Written through replica 1, read through replica 2.
    assert replica_stats.blocks_stored == 0 and replica_stats.hits >= num_blocks


def test_redis_outage_costs_hits_never_requests(tiny_model_dir: Path, tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    suite = None
    try:
        suite = start_suite(
            tiny_model_dir,
            tmp_path,
            num_workers=2,
            worker_args=KV,
            scheduler_args=["--routing", "round-robin"],
            kv_store_args=["--backend", redis_server.url],
        )
        store = _store(suite)
        first, second = _prefix_on_one_worker_then_the_other(suite, _prompts(1, seed=9, lo=200, hi=200)[0])
        assert second.token_ids == first.token_ids
        loaded_before = asyncio.run(suite.stats()).kv_store_loaded_tokens
        assert loaded_before > 0

        async def during_outage() -> list[Answer]:
            async with KVStoreClient(store) as client:
                prompts = _prompts(8, seed=10, lo=60, hi=200)
                task = asyncio.ensure_future(greedy_token_answers(suite.address, prompts, max_tokens=64))
                await asyncio.sleep(0.3)
                redis_server.stop()
                answers = await task
                await client.wait_health(BACKEND_HEALTH_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
                # The store itself still answers (with misses): only its backend is down.
                assert await client.health_status(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
                # And requests go on while it stays down.
                answers += await greedy_token_answers(suite.address, prompts[:4], max_tokens=16)
                redis_server.start()
                await client.wait_health(BACKEND_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING)
                return answers

        answers = asyncio.run(during_outage())
        assert all(a.finish_reason == sampling_pb2.FINISH_REASON_LENGTH for a in answers)
        # Redis is back (empty: it kept nothing on disk); hits resume without restarting any service.
        third, fourth = _prefix_on_one_worker_then_the_other(suite, _prompts(1, seed=11, lo=200, hi=200)[0])
        stats = asyncio.run(suite.wait_idle())
    finally:
        if suite is not None:
            suite.stop()
        redis_server.stop()
    assert fourth.token_ids == third.token_ids
    assert stats.kv_store_loaded_tokens > loaded_before
