"""The scheduler's counters over a benchmark run: deltas, the report, and `meshserve bench --scheduler-address`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.cli import _build_parser
from services.client.bench import command
from services.client.bench.cache_stats import CacheReport, WorkerCounters, fetch_stats, stats_delta
from services.client.bench.report import format_cache_report
from services.common.proto.meshserve.v1 import generation_pb2_grpc, scheduler_pb2
from tests.unit.client.test_bench_runner import FakeGateway


def _worker(worker_id: str, routed: int, queries: int, hits: int, steps: int = 0) -> scheduler_pb2.WorkerPoolStats:
    return scheduler_pb2.WorkerPoolStats(
        worker_id=worker_id, num_routed=routed, prefix_cache_queries=queries, prefix_cache_hits=hits, num_steps=steps
    )


def _stats(*workers: scheduler_pb2.WorkerPoolStats) -> scheduler_pb2.SchedulerStats:
    # The totals are the workers' sums, as the scheduler reports them.
    return scheduler_pb2.SchedulerStats(
        prefix_cache_queries=sum(w.prefix_cache_queries for w in workers),
        prefix_cache_hits=sum(w.prefix_cache_hits for w in workers),
        workers=workers,
    )


def test_delta_is_the_growth_over_the_run() -> None:
    before = _stats(_worker("w1", 3, 100, 10, 7), _worker("w0", 2, 50, 0, 4))
    after = _stats(_worker("w0", 6, 450, 300, 20), _worker("w1", 5, 300, 110, 9))
    report = stats_delta(before, after)
    assert (report.prefix_cache_queries, report.prefix_cache_hits) == (600, 400)
    assert report.hit_rate == pytest.approx(400 / 600)
    assert report.workers == [WorkerCounters("w0", 4, 400, 300, 16), WorkerCounters("w1", 2, 200, 100, 2)]
    assert report.workers[0].hit_rate == 0.75


def test_workers_that_attached_or_restarted_count_from_zero() -> None:
    before = _stats(_worker("w0", 9, 900, 500))
    # w0 re-attached under its id (its counters restarted); w1 attached during the run.
    after = _stats(_worker("w0", 2, 80, 40), _worker("w1", 1, 30, 0))
    report = stats_delta(before, after)
    assert report.workers == [WorkerCounters("w0", 2, 80, 40, 0), WorkerCounters("w1", 1, 30, 0, 0)]
    assert (report.prefix_cache_queries, report.prefix_cache_hits) == (110, 40)


def test_no_queries_has_no_hit_rate_and_the_report_prints() -> None:
    report = stats_delta(_stats(_worker("w0", 1, 0, 0)), _stats(_worker("w0", 1, 0, 0)))
    assert report.hit_rate is None and report.workers[0].hit_rate is None
    assert report.to_dict()["prefix_cache_hit_rate"] is None
    assert "n/a" in format_cache_report(report)
    text = format_cache_report(CacheReport(200, 50, [WorkerCounters("worker-0", 7, 200, 50, 3)]))
    assert "Prefix cache hit rate (%):               25.00" in text
    assert "Requests routed to worker-0:             7" in text
    data = json.loads(json.dumps(CacheReport(200, 50, [WorkerCounters("worker-0", 7, 200, 50, 3)]).to_dict()))
    assert data["workers"] == [
        {
            "worker_id": "worker-0",
            "num_routed": 7,
            "prefix_cache_queries": 200,
            "prefix_cache_hits": 50,
            "num_steps": 3,
            "prefix_cache_hit_rate": 0.25,
        }
    ]


class FakeScheduler:
    """GetStats counting what the fake gateway served: every request on one worker, half of each prompt a hit."""

    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway
        self.calls = 0

    def handler(self) -> grpc.GenericRpcHandler:
        """Serves GetStats only: the benchmark calls nothing else on the scheduler."""
        method = grpc.unary_unary_rpc_method_handler(
            self.GetStats,
            request_deserializer=scheduler_pb2.GetStatsRequest.FromString,
            response_serializer=scheduler_pb2.SchedulerStats.SerializeToString,
        )
        return grpc.method_handlers_generic_handler("meshserve.v1.Scheduler", {"GetStats": method})

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        self.calls += 1
        served = self.gateway.requests
        queries = sum(len(r.token_ids.ids) for r in served)
        hits = sum(len(r.token_ids.ids) // 2 for r in served)
        return _stats(_worker("worker-0", len(served), queries, hits))


@pytest.fixture
async def servers() -> AsyncIterator[tuple[str, FakeGateway, str, FakeScheduler]]:
    server = grpc.aio.server()
    gateway = FakeGateway()
    scheduler = FakeScheduler(gateway)
    generation_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
    server.add_generic_rpc_handlers((scheduler.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # One server plays both parts; they are distinct services, so the addresses may coincide.
    yield f"127.0.0.1:{port}", gateway, f"127.0.0.1:{port}", scheduler
    await server.stop(None)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 400}))
    return path


async def test_fetch_stats_names_the_flag_when_nobody_answers() -> None:
    with pytest.raises(ConnectionError, match=r"--scheduler-address 127\.0\.0\.1:1: GetStats failed \(UNAVAILABLE"):
        await fetch_stats("127.0.0.1:1", timeout=2)


async def test_bench_reports_the_run_without_its_warmups(
    servers: tuple[str, FakeGateway, str, FakeScheduler],
    model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gateway_address, gateway, scheduler_address, scheduler = servers
    out = tmp_path / "r.json"
    args = ["bench", "--address", gateway_address, "--scheduler-address", scheduler_address, "--model",
            str(model_dir), "--dataset", "multi-turn", "--num-conversations", "3", "--num-turns", "2",
            "--turn-input-len", "5", "--turn-output-len", "2", "--num-warmups", "2", "--max-concurrency", "2",
            "--no-progress", "--save-result", str(out)]  # fmt: skip
    assert await command.main(_build_parser().parse_args(args)) == 0
    assert scheduler.calls == 2
    data = json.loads(out.read_text())
    # Turn k's prompt is 5 user tokens per turn and 2 reply tokens per earlier turn: 5, then 12.
    assert data["input_lens"] == [5, 12] * 3
    assert data["turn_indices"] == [0, 1] * 3
    assert len(data["mean_ttft_ms_by_turn"]) == 2
    stats = data["scheduler_stats"]
    # The counters read after the warm-ups: only the 6 timed turns count.
    assert stats["workers"][0]["num_routed"] == 6
    assert stats["prefix_cache_queries"] == 3 * (5 + 12)
    assert stats["prefix_cache_hits"] == 3 * (2 + 6)
    assert (data["num_conversations"], data["num_turns"], data["num_prompts"]) == (3, 2, None)
    printed = capsys.readouterr().out
    assert "Prefix Cache (scheduler, this run)" in printed
    assert "Mean TTFT by turn (ms):" in printed
    assert len(gateway.requests) == 8


async def test_bench_fails_clearly_when_the_scheduler_does_not_answer(
    servers: tuple[str, FakeGateway, str, FakeScheduler], model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gateway_address, _, _, _ = servers
    args = ["bench", "--address", gateway_address, "--scheduler-address", "127.0.0.1:1", "--model", str(model_dir),
            "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2", "--no-progress"]  # fmt: skip
    assert await command.main(_build_parser().parse_args(args)) == 1
    assert "--scheduler-address 127.0.0.1:1" in capsys.readouterr().err
