"""Several schedulers behind one gateway, and several gateways on one scheduler (issue 11 item 8)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.client.launcher import Launcher, ServiceProcess, wait_all_healthy
from services.common.channels import insecure_channel
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.scheduler_stream import SCHEDULER_UNAVAILABLE
from tests.support.calls import Answer, greedy_token_answers, stream
from tests.support.suite import STARTUP_TIMEOUT_S, Suite, start_suite
from tests.support.tiny_model import transformers_greedy

VOCAB = 512


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@dataclass
class TwoSchedulers:
    """Two schedulers with one worker each, and a gateway given both addresses."""

    launcher: Launcher
    schedulers: list[ServiceProcess]
    gateway: ServiceProcess

    async def stats(self, index: int) -> scheduler_pb2.SchedulerStats:
        async with insecure_channel(self.schedulers[index].address) as channel:
            stats: scheduler_pb2.SchedulerStats = await scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10
            )
            return stats

    def gateway_logged(self, event: str, index: int) -> int:
        """How often the gateway logged `event` ("scheduler ready", "scheduler not ready") for scheduler `index`."""
        address = self.schedulers[index].address
        records = [json.loads(line) for line in self.gateway.log_path.read_text().splitlines() if line.startswith("{")]
        return sum(r.get("event") == event and r.get("scheduler") == address for r in records)

    async def wait_logged(self, event: str, index: int, more_than: int = 0) -> None:
        for _ in range(600):
            if self.gateway_logged(event, index) > more_than:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the gateway never logged {event!r} for scheduler {index}")


@pytest.fixture
def two_schedulers(tiny_model_dir: Path, tmp_path: Path) -> Iterator[TwoSchedulers]:
    launcher = Launcher(tmp_path, env={"MESHSERVE_LOG_FORMAT": "json", "MESHSERVE_LOG_LEVEL": "debug"})
    host = "127.0.0.1"
    try:
        schedulers, workers = [], []
        for i in range(2):
            port = free_port()
            scheduler = launcher.start(
                f"scheduler-{i}", ["scheduler", "--host", host, "--port", str(port)], f"{host}:{port}"
            )
            worker_port = free_port()
            workers.append(
                launcher.start(
                    f"worker-{i}",
                    [
                        "worker",
                        "--host",
                        host,
                        "--port",
                        str(worker_port),
                        "--scheduler-address",
                        scheduler.address,
                        "--model",
                        str(tiny_model_dir),
                        "--worker-id",
                        f"worker-{i}",
                        "--kv-cache-memory",
                        "16MiB",
                    ],
                    f"{host}:{worker_port}",
                )
            )
            schedulers.append(scheduler)
        gateway_port = free_port()
        gateway = launcher.start(
            "gateway",
            ["gateway", "--host", host, "--port", str(gateway_port), "--model", str(tiny_model_dir),
             "--scheduler-address", ",".join(s.address for s in schedulers)],
            f"{host}:{gateway_port}",
        )  # fmt: skip
        asyncio.run(wait_all_healthy(launcher, [*schedulers, *workers, gateway], STARTUP_TIMEOUT_S))
    except BaseException:
        launcher.stop_all(timeout=10)
        raise
    yield TwoSchedulers(launcher, schedulers, gateway)
    launcher.stop_all(timeout=30)


def test_gateway_spreads_over_schedulers_and_survives_losing_one(
    two_schedulers: TwoSchedulers, tiny_model_dir: Path
) -> None:
    suite = two_schedulers
    address = suite.gateway.address
    # Enough distinct prompts that both schedulers get some (all on one: about 2**-15). The oracle is
    # slow (tens of ms a token), so longer answers are checked by their greedy prefix and by agreeing
    # with each other across the failover.
    prompts = _prompts(16, seed=21)
    expected = [transformers_greedy(tiny_model_dir, p, 12) for p in prompts]
    long_tokens = 160

    async def run() -> None:
        # The gateway serves once one scheduler is ready; this test wants both in its pool.
        for i in range(2):
            await suite.wait_logged("scheduler ready", i)
        answers = await greedy_token_answers(address, prompts, max_tokens=12)
        assert [a.token_ids for a in answers] == expected
        finished = [(await suite.stats(i)).num_finished for i in range(2)]
        assert all(n > 0 for n in finished), finished

        # The same prompts, longer, on both; then scheduler 0 dies with kill -9.
        params = sampling_params(max_tokens=long_tokens, temperature=0.0, ignore_eos=True)
        async with GenerationClient(address) as client:
            tasks = [asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params))) for p in prompts]
            for _ in range(3000):
                if all([(await suite.stats(i)).num_running for i in range(2)]):
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the long requests did not reach both schedulers")
            noticed = suite.gateway_logged("scheduler not ready", 0)
            victim = suite.schedulers[0].process
            victim.kill()
            victim.wait()
            results: list[Answer | BaseException] = await asyncio.gather(*tasks, return_exceptions=True)
        lost = [r for r in results if isinstance(r, BaseException)]
        assert lost, "some requests were running on the killed scheduler"
        for err in lost:
            # They fail at once with UNAVAILABLE, naming no internal address; they never hang.
            assert isinstance(err, grpc.aio.AioRpcError), err
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert err.details() == SCHEDULER_UNAVAILABLE
        survivors = {i: r for i, r in enumerate(results) if isinstance(r, Answer)}
        for i, answer in survivors.items():
            assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
            assert len(answer.token_ids) == long_tokens and answer.token_ids[:12] == expected[i]

        # Once the gateway's poll has noticed, every new request goes to the survivor.
        await suite.wait_logged("scheduler not ready", 0, more_than=noticed)
        before = (await suite.stats(1)).num_finished
        again = await greedy_token_answers(address, prompts, max_tokens=long_tokens)
        assert (await suite.stats(1)).num_finished == before + len(prompts)
        for i, answer in enumerate(again):
            assert answer.token_ids[:12] == expected[i]
            if i in survivors:
                assert answer.token_ids == survivors[i].token_ids

    asyncio.run(run())


def test_two_gateways_on_one_scheduler(tiny_model_dir: Path, tmp_path: Path) -> None:
    suite: Suite = start_suite(tiny_model_dir, tmp_path, worker_args=["--kv-cache-memory", "16MiB"])
    try:
        port = free_port()
        second = suite.launcher.start(
            "gateway-2",
            ["gateway", "--host", "127.0.0.1", "--port", str(port), "--model", str(tiny_model_dir),
             "--scheduler-address", suite.scheduler.address],
            f"127.0.0.1:{port}",
        )  # fmt: skip

        async def run() -> tuple[list[Answer], list[Answer]]:
            await suite.launcher.wait_healthy(second, STARTUP_TIMEOUT_S)
            prompts = _prompts(6, seed=31)
            first, other = await asyncio.gather(
                greedy_token_answers(suite.address, prompts, max_tokens=16),
                greedy_token_answers(second.address, prompts, max_tokens=16),
            )
            return first, other

        first, other = asyncio.run(run())
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    for prompt, a, b in zip(_prompts(6, seed=31), first, other, strict=True):
        expected = transformers_greedy(tiny_model_dir, prompt, 16)
        assert a.token_ids == expected and b.token_ids == expected
    assert stats.num_finished >= 12
