"""A suite whose worker runs --quantization int8: concurrent greedy answers equal the quantised model run
one request at a time in-process (batching, chunked prefill, the int8 kernel and the dequantised GEMM agree).

In fp32: the paths sum in different orders, which bf16's rounding would turn into different greedy
tokens on a random model; the int8 rounding itself is the same everywhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.worker.engine_config import EngineConfig
from services.worker.model_runner import ModelRunner
from tests.support.calls import greedy_token_answers
from tests.support.suite import start_suite

NEW_TOKENS = 12
PROMPTS = [list(range(3, 40)), list(range(60, 66)), [9, 8, 7, 6, 5, 4, 3, 2] * 3]


def _greedy_alone(runner: ModelRunner, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    blocks = list(range(-(-(len(prompt) + NEW_TOKENS) // runner.block_size)))
    computed = 0
    for _ in range(NEW_TOKENS):
        count = len(tokens) - computed
        logits = runner.forward([(tokens, blocks, computed, count)], [count - 1])
        assert logits is not None
        computed = len(tokens)
        tokens.append(int(torch.argmax(logits[0])))
    return tokens[len(prompt) :]


def test_int8_worker_answers_as_the_int8_model_does_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ["--precision", "fp32-fp32-fp32", "--quantization", "int8", "--kv-cache-memory", "32MiB"]
    # A 16-token budget splits the first prompt's prefill into chunks beside the others' decodes.
    suite = start_suite(
        tiny_model_dir, tmp_path, worker_args=[*flags, "--max-num-batched-tokens", "16"],
        scheduler_args=["--max-num-batched-tokens", "16"],
    )  # fmt: skip
    try:
        answers = asyncio.run(greedy_token_answers(suite.address, PROMPTS, NEW_TOKENS))
        (loaded,) = [r for r in suite.log_records("worker-0") if r.get("event") == "model_loaded"]
        assert str(loaded["matmul_weights"]).startswith("int8+")
    finally:
        suite.stop()
    runner = ModelRunner(
        EngineConfig(
            model_path=str(tiny_model_dir),
            precision="fp32-fp32-fp32",
            quantization="int8",
            device="cpu",
            kv_cache_memory_bytes=16 << 20,
            max_model_len=128,
            max_num_batched_tokens=128,
            max_num_seqs=4,
        )
    )
    try:
        expected = [_greedy_alone(runner, p) for p in PROMPTS]
    finally:
        runner.close()
    assert [a.token_ids for a in answers] == expected
