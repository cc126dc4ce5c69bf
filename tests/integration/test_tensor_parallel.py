"""Tensor parallelism through the real suite: TP=2 (two rank processes) must match TP=1 token for token."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.gateway.tokenizer import TextTokenizer
from tests.support.calls import Answer, greedy_token_answers
from tests.support.devices import device_params
from tests.support.suite import start_suite
from tests.support.tiny_model import make_tiny_model, transformers_greedy
from tests.support.worker_ranks import spawned_ranks, two_node_greedy, worker_startup_error

DEVICES = device_params(min_cuda_devices=2)
# Exact equality across TP sizes needs fp32: the all-reduce sums in a different order than one GEMM.
FP32 = ["--precision", "fp32-fp32-fp32"]


def _device_args(device: str) -> list[str]:
    if device == "cpu":
        return ["--device", "cpu", "--kv-cache-memory", "256MiB"]
    return ["--device", device, "--gpu-memory-utilization", "0.4"]


def _serve(
    model_dir: Path, log_dir: Path, device: str, tp: int, prompts: Sequence[Sequence[int]], max_tokens: int,
    scheduler_args: Sequence[str] = (),
) -> list[Answer]:  # fmt: skip
    args = [*_device_args(device), *FP32, "--tensor-parallel-size", str(tp), "--max-model-len", "512"]
    suite = start_suite(model_dir, log_dir, worker_args=args, scheduler_args=scheduler_args)
    try:
        return asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens))
    finally:
        suite.stop()


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fewer KV heads (1) than ranks (2): the KV head is replicated on both."""
    return make_tiny_model(tmp_path_factory.mktemp("one-kv-head"), num_heads=4, num_kv_heads=1, num_layers=3)


@pytest.mark.parametrize("device", DEVICES)
def test_tp2_matches_tp1_with_fewer_kv_heads_than_ranks(device: str, one_kv_head_model: Path, tmp_path: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90)), [300, 301], list(range(100, 140))]
    tp1 = _serve(one_kv_head_model, tmp_path / "tp1", device, 1, prompts, 16)
    tp2 = _serve(one_kv_head_model, tmp_path / "tp2", device, 2, prompts, 16)
    assert [a.token_ids for a in tp2] == [a.token_ids for a in tp1]
    assert [a.token_ids for a in tp1] == [transformers_greedy(one_kv_head_model, p, 16) for p in prompts]


def test_tp2_ranks_verify_drafts_alike(one_kv_head_model: Path, tmp_path: Path) -> None:
    # Every rank keeps the same drafts (it sees the same sampled rows): the answers are plain greedy decoding's.
    prompts = [[5, 6, 7, 8, 9] * 6, [300, 301, 302] * 8, list(range(20, 60))]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    tp2 = _serve(one_kv_head_model, tmp_path, "cpu", 2, prompts, 24, spec)
    assert [a.token_ids for a in tp2] == [transformers_greedy(one_kv_head_model, p, 24) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_tp2_matches_tp1_on_smollm2(device: str, smollm2_dir: Path, tmp_path: Path) -> None:
    # 9 query heads in 3 KV groups over 2 ranks: an uneven split (6 + 3 heads) that vLLM would refuse.
    tokenizer = TextTokenizer.from_dir(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    tp1 = _serve(smollm2_dir, tmp_path / "tp1", device, 1, prompts, 24)
    tp2 = _serve(smollm2_dir, tmp_path / "tp2", device, 2, prompts, 24)
    assert [a.token_ids for a in tp2] == [a.token_ids for a in tp1]


def test_a_dead_rank_stops_the_worker(one_kv_head_model: Path, tmp_path: Path) -> None:
    suite = start_suite(one_kv_head_model, tmp_path, worker_args=[*_device_args("cpu"), "--tensor-parallel-size", "2"])
    try:
        worker = suite.workers[0]
        ranks = spawned_ranks(worker.process.pid)
        assert len(ranks) == 1, "rank 1 should run as a child process of the worker"
        os.kill(ranks[0], signal.SIGKILL)
        # The worker must not hang in a collective: it exits so an orchestrator restarts it.
        assert worker.process.wait(timeout=30) == 1
        assert "tensor_parallel_rank_died" in worker.log_tail(80)
    finally:
        suite.stop()


def test_tp_size_that_cannot_split_the_model_is_refused(one_kv_head_model: Path) -> None:
    started = time.monotonic()
    err = worker_startup_error(one_kv_head_model, "--device", "cpu", "--tensor-parallel-size", "3")
    assert "--tensor-parallel-size 3 exceeds the model's num_key_value_heads=1" in err
    assert time.monotonic() - started < 100


def test_npu_without_cann_names_the_fix(one_kv_head_model: Path) -> None:
    err = worker_startup_error(one_kv_head_model, "--device", "npu")
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in err
    assert "npu-smi info" in err


def test_kv_cache_too_small_names_the_flags(one_kv_head_model: Path) -> None:
    err = worker_startup_error(one_kv_head_model, "--device", "cpu", "--kv-cache-memory", "64KiB")
    assert "lower --max-model-len, --max-num-seqs or --max-num-batched-tokens" in err


def test_two_nodes_on_loopback_match_one(one_kv_head_model: Path, tmp_path: Path) -> None:
    """--nnodes 2: node 0 attaches and leads, node 1 (a separate worker command) only follows."""
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90))]
    args = [*_device_args("cpu"), "--tensor-parallel-size", "2", *FP32]
    answers = two_node_greedy(one_kv_head_model, tmp_path, args, prompts, 12)
    assert answers == [transformers_greedy(one_kv_head_model, p, 12) for p in prompts]
