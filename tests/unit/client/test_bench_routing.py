"""scripts/bench_routing.py's own logic: the --routing check, the ratios and the tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings

from services.client.bench.cache_stats import CacheReport, WorkerCounters
from services.client.bench.metrics import summarize
from services.client.bench.records import RequestRecord

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_routing", ROOT / "scripts" / "bench_routing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_routing"] = module
    spec.loader.exec_module(module)
    return module


class NoRouting(BaseSettings):
    max_num_seqs: int = 1


class SomeRouting(BaseSettings):
    routing: Literal["kv", "least-loaded"] = Field("kv")


def test_routing_check_names_what_is_missing() -> None:
    br = _script()
    with pytest.raises(SystemExit, match="the scheduler has no --routing flag"):
        br.check_routing_support(["kv"], NoRouting)
    with pytest.raises(SystemExit, match="takes kv, least-loaded, not round-robin"):
        br.check_routing_support(["kv", "round-robin"], SomeRouting)
    br.check_routing_support(["kv"], SomeRouting)


def test_the_real_scheduler_has_both_modes() -> None:
    # Fails once the scheduler drops a mode the benchmark compares.
    _script().check_routing_support(["kv", "round-robin"])


def _run(br: ModuleType, routing: str, workers: int, ttfts: list[float], tok_s: float) -> Any:
    records = [RequestRecord(prompt_len=100, output_len=2, start=0.0, token_times=[t, t + 0.01]) for t in ttfts]
    summary = summarize(records, 2 * len(records) / tok_s, backend="meshserve")
    cache = CacheReport(100, 60, [WorkerCounters(f"worker-{i}", 3, 50, 30, 9) for i in range(workers)])
    return br.Run(
        f"r-{routing}", br.SuiteSpec(workers, routing, 1, "1GiB", 4096), summary, cache, [ttfts[0] * 1000, None]
    )


def test_ratios_and_tables() -> None:
    br = _script()
    kv = _run(br, "kv", 2, [0.1, 0.1, 0.1], 30.0)
    rr = _run(br, "round-robin", 2, [0.3, 0.3, 0.3], 30.0)
    ratios = br.ttft_ratios(kv, rr)
    assert ratios == pytest.approx({"mean": 3.0, "p50": 3.0, "p99": 3.0})
    one, two = _run(br, "kv", 1, [0.2], 10.0), _run(br, "kv", 2, [0.2], 15.0)
    table = br.chat_table(kv, rr)
    assert "| **round-robin / kv** | **3.00x** | 3.00x | 3.00x | target >= 2x: **PASS** |" in table
    assert "| kv | 100.0 | 100.0 | 100.0 | 60.0% | 0.0% | worker-0 3, worker-1 3 | 30.00 |" in table
    assert br.throughput_ratio(one, two) == pytest.approx(1.5)
    assert "| **2 / 1** | | | **1.50x** |" in br.throughput_table(one, two)
    assert br.by_turn_table(kv, rr).splitlines()[2] == "| kv mean TTFT ms | 100 | n/a |"
    assert kv.to_dict()["suite"] == {
        "num_workers": 2,
        "routing": "kv",
        "worker_threads": 1,
        "kv_cache_memory": "1GiB",
        "max_model_len": 4096,
        "kv_store": False,
        "scheduler_args": (),
    }
    assert br.ratio(1.0, 0.0) == float("inf")
    slower = _run(br, "kv", 2, [0.5], 30.0)
    assert br.median_run([slower, kv, rr], "mean_ttft_ms") is rr
    assert br.median_run([slower, kv], "mean_ttft_ms") is kv
    # A run slowed by other processes is left out while quieter ones exist.
    kv.other_cpu_share = 0.5
    assert br.median_run([slower, kv], "mean_ttft_ms") is slower


def test_workers_split_the_cores() -> None:
    br = _script()
    assert [br.threads_per_worker(2, n) for n in (1, 2, 3)] == [2, 1, 1]
    assert br.threads_per_worker(16, 2) == 8


def test_other_processes_share_of_the_cpus() -> None:
    br = _script()
    a = br.CpuSample(busy=100, total=400, ours=50)
    # 200 jiffies passed, 150 of them busy, 100 of those ours: others used 50 / 200.
    assert br.other_share(a, br.CpuSample(busy=250, total=600, ours=150)) == 0.25
    # Our counters can run ahead of the machine's (sampled a moment apart): never below 0.
    assert br.other_share(a, br.CpuSample(busy=150, total=600, ours=200)) == 0.0
    assert br.other_share(a, a) is None and br.other_share(None, a) is None
    sample = br.cpu_sample([])
    assert sample is None or (sample.total >= sample.busy > 0 and sample.ours > 0)
