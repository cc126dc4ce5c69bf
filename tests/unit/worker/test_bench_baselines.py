"""The benchmark baselines serve every request its exact token count, and the raw runner really computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.client.bench.datasets import BenchRequest, random_dataset
from services.client.bench.records import RequestRecord
from services.worker.benchmarks.raw_runner import run_raw_runner
from services.worker.benchmarks.transformers_baseline import run_transformers_baseline
from tests.support.tiny_model import make_tiny_model, transformers_greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def workload() -> list[BenchRequest]:
    # More requests than the batch, with different lengths, so batches refill and blocks are reused.
    return random_dataset(7, input_len=(3, 40), output_len=(1, 12), vocab_size=512, seed=3)


def _check_records(records: list[RequestRecord], requests: list[BenchRequest], duration: float) -> None:
    assert duration > 0
    assert len(records) == len(requests)
    for record, request in zip(records, requests, strict=True):
        assert record.prompt_len == len(request.prompt_token_ids)
        assert record.output_len == request.output_len
        assert len(record.token_times) == request.output_len
        assert record.token_times == sorted(record.token_times)
        assert record.token_times[0] >= record.start
        assert record.success


def test_transformers_baseline_records(model_dir: Path, workload: list[BenchRequest]) -> None:
    outputs: list[list[int]] = []
    records, duration = run_transformers_baseline(model_dir, workload, batch_size=3, dtype="float32", outputs=outputs)
    _check_records(records, workload, duration)
    assert [len(o) for o in outputs] == [r.output_len for r in workload]
    # A batch's rows share step times; the next batch starts after the previous one's last step.
    assert records[0].token_times[0] == records[1].token_times[0]
    assert records[3].start >= max(r.token_times[-1] for r in records[:3])
    assert duration >= max(r.token_times[-1] for r in records) - records[0].start - 1e-9


def test_raw_runner_matches_transformers_greedy(model_dir: Path, workload: list[BenchRequest]) -> None:
    outputs: list[list[int]] = []
    records, duration = run_raw_runner(model_dir, workload, batch_size=3, dtype="float32", outputs=outputs)
    _check_records(records, workload, duration)
    for request, tokens in zip(workload, outputs, strict=True):
        assert tokens == transformers_greedy(model_dir, request.prompt_token_ids, request.output_len)
    # Requests beyond the batch are admitted only once a slot frees.
    assert records[3].start > records[0].start


def test_raw_runner_bfloat16(model_dir: Path, workload: list[BenchRequest]) -> None:
    records, duration = run_raw_runner(model_dir, workload[:2], batch_size=4, dtype="bfloat16")
    _check_records(records, workload[:2], duration)


def test_bad_batch_size(model_dir: Path, workload: list[BenchRequest]) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        run_raw_runner(model_dir, workload, batch_size=0, dtype="float32")
    with pytest.raises(ValueError, match="batch_size"):
        run_transformers_baseline(model_dir, workload, batch_size=0, dtype="float32")
