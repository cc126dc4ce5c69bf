"""`meshserve bench` against the whole suite on the tiny random Llama."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from services.client.bench.cache_stats import fetch_stats, stats_delta
from services.client.bench.datasets import flatten, multi_turn_dataset, random_dataset
from services.client.bench.metrics import summarize
from services.client.bench.runner import run_benchmark, run_conversations
from tests.support.suite import Suite

VOCAB = 512


@pytest.mark.parametrize(("rate", "burstiness"), [(math.inf, 1.0), (40.0, 0.5)])
async def test_run_benchmark_gets_every_token(tiny_suite: Suite, rate: float, burstiness: float) -> None:
    requests = random_dataset(12, (5, 40), (4, 16), VOCAB, seed=11)
    records, duration = await run_benchmark(
        tiny_suite.address,
        requests,
        request_rate=rate,
        burstiness=burstiness,
        max_concurrency=4,
        seed=5,
        num_warmups=2,
        progress=False,
    )
    assert [r.error for r in records] == [""] * 12
    for record, request in zip(records, requests, strict=True):
        assert record.prompt_len == len(request.prompt_token_ids)
        assert record.num_output_tokens == request.output_len
        assert record.start < record.token_times[0] <= record.token_times[-1]
    summary = summarize(records, duration, goodput_slos={"e2el": 3_600_000}, backend="meshserve", max_concurrency=4)
    assert (summary.completed, summary.failed, summary.output_len_mismatches) == (12, 0, 0)
    assert summary.total_input_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert summary.total_output_tokens == summary.requested_output_tokens == sum(r.output_len for r in requests)
    assert summary.goodput == pytest.approx(summary.request_throughput)
    assert 0 < summary.mean_ttft_ms <= summary.mean_e2el_ms


async def test_multi_turn_conversations_hit_the_prefix_cache(tiny_suite: Suite) -> None:
    # Turns of 40 tokens: each history spans several 16-token blocks, so every later turn can hit the cache.
    conversations = multi_turn_dataset(3, 3, (40, 40), (4, 4), VOCAB, seed=21)
    before = await fetch_stats(tiny_suite.scheduler.address)
    records, _ = await run_conversations(tiny_suite.address, conversations, max_concurrency=2, progress=False)
    report = stats_delta(before, await fetch_stats(tiny_suite.scheduler.address))
    assert [r.error for r in records] == [""] * 9
    assert [r.prompt_len for r in records] == [len(t.prompt_token_ids) for t in flatten(conversations)]
    assert report.prefix_cache_queries >= sum(r.prompt_len for r in records[1:3])
    # Turn k+1 repeats turn k's whole prompt; at least its full blocks are found (one worker, room to spare).
    later_turns = [conversation[k] for conversation in conversations for k in range(2)]
    assert report.prefix_cache_hits >= sum(len(t.prompt_token_ids) // 16 * 16 for t in later_turns)
    assert report.hit_rate is not None and 0 < report.hit_rate < 1
    assert sum(w.num_routed for w in report.workers) == 9
    # Client and scheduler agree on what the cache served.
    assert sum(r.cached_tokens for r in records) == report.prefix_cache_hits


def test_cli_end_to_end(tiny_suite: Suite, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["--address", tiny_suite.address, "--model", str(tiny_model_dir), "--dataset", "random",
            "--num-prompts", "8", "--random-input-len", "5-20", "--random-output-len", "4", "--max-concurrency",
            "3", "--goodput", "ttft:600000", "--save-result", str(out), "--no-progress"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    data = json.loads(out.read_text())
    assert data["backend"] == "meshserve"
    assert (data["completed"], data["failed"], data["output_len_mismatches"]) == (8, 0, 0)
    assert data["total_output_tokens"] == data["requested_output_tokens"] == 32
    assert data["output_lens"] == [4] * 8
    assert all(5 <= n <= 20 for n in data["input_lens"])
    assert data["total_input_tokens"] == sum(data["input_lens"])
    assert data["request_rate"] == "inf"
    assert data["max_concurrency"] == 3
    assert data["goodput"] == pytest.approx(data["request_throughput"])
    assert data["num_prompts"] == 8
    assert data["model"] == str(tiny_model_dir)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert data[f"mean_{key}_ms"] > 0 if key != "itl" else data["mean_itl_ms"] >= 0
        assert data[f"p99_{key}_ms"] >= data[f"median_{key}_ms"]
    assert data["duration_s"] > 0


def test_cli_multi_turn_reports_the_scheduler(tiny_suite: Suite, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "multi.json"
    args = ["--address", tiny_suite.address, "--scheduler-address", tiny_suite.scheduler.address, "--model",
            str(tiny_model_dir), "--dataset", "multi-turn", "--num-conversations", "2", "--num-turns", "3",
            "--turn-input-len", "20-30", "--turn-output-len", "3", "--save-result", str(out),
            "--no-progress"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Prefix Cache (scheduler, this run)" in done.stdout
    data = json.loads(out.read_text())
    assert (data["completed"], data["failed"]) == (6, 0)
    assert data["turn_indices"] == [0, 1, 2] * 2
    assert data["scheduler_stats"]["prefix_cache_hits"] > 0
    assert data["scheduler_stats"]["prefix_cache_hits"] == data["total_cached_tokens"]


def test_cli_bad_flag_exits_2(tiny_model_dir: Path) -> None:
    cli = [sys.executable, "-m", "services.cli", "bench", "--model", str(tiny_model_dir), "--no-progress"]
    bad = subprocess.run([*cli, "--random-input-len", "9-2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--random-input-len" in bad.stderr
