"""Pipeline parallelism through the real suite: the layers split into stages (gloo processes, point-to-point
activations) must give plain greedy decoding's tokens, alone, beside TP, across two "nodes" and when a stage dies."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.gateway.tokenizer import TextTokenizer
from tests.support.calls import Answer, greedy_token_answers, stream
from tests.support.suite import start_suite
from tests.support.tiny_model import make_tiny_model, transformers_greedy
from tests.support.worker_ranks import spawned_ranks, two_node_greedy, worker_startup_error

# Exact equality across layouts needs fp32 (a TP all-reduce sums in another order than one GEMM).
FP32 = ["--precision", "fp32-fp32-fp32"]
VOCAB = 512
# One KV block of the tiny model on one stage: 2 of its 4 layers, 2 KV heads of 16, K and V, 16 tokens, fp32.
STAGE_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _prompts(n: int, seed: int, lo: int, hi: int, prefix: Sequence[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [[*prefix, *(rng.randrange(10, VOCAB) for _ in range(rng.randint(lo, hi)))] for _ in range(n)]


@pytest.fixture(scope="module")
def four_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings: the last stage holds its own copy of the embedding as the LM head."""
    return make_tiny_model(tmp_path_factory.mktemp("four-layers"), num_layers=4, tie_word_embeddings=True)


def _pp_args(pp: int, tp: int = 1, kv_cache_memory: str = "64MiB") -> list[str]:
    return ["--device", "cpu", *FP32, "--kv-cache-memory", kv_cache_memory, "--max-model-len", "320",
            "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]  # fmt: skip


@pytest.mark.parametrize("micro_batching", ["--pipeline-micro-batching", "--no-pipeline-micro-batching"])
def test_pp2_matches_greedy_with_chunked_prefill_prefix_caching_and_preemption(
    four_layer_model: Path, tmp_path: Path, micro_batching: str
) -> None:
    # 24 blocks per stage are far fewer than 8 requests of up to 150 tokens need at once: preemption; a
    # 40-token common prefix: prefix-cache hits; steps of 48 tokens: prompts prefilled in chunks.
    suite = start_suite(
        four_layer_model,
        tmp_path,
        worker_args=[*_pp_args(2, kv_cache_memory=str(24 * STAGE_BLOCK_BYTES)), micro_batching],
        scheduler_args=["--max-num-batched-tokens", "48"],
    )
    try:
        prompts = _prompts(8, seed=3, lo=20, hi=70, prefix=list(range(100, 140)))
        answers = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=40))
        stats = asyncio.run(suite.wait_idle())
        log = suite.workers[0].log_tail(400)
        attached = [r for r in suite.log_records("scheduler") if r.get("event") == "worker attached"]
    finally:
        suite.stop()
    # Micro-batched, the worker asks for a step in flight per stage, each of requests no other one holds.
    micro = micro_batching == "--pipeline-micro-batching"
    assert [(r["steps_in_flight"], r["micro_batches"]) for r in attached] == [(2, 2 if micro else 1)]
    assert stats.num_preemptions > 0, "the KV cache was not small enough to force preemption"
    assert stats.prefix_cache_hits > 0, "no prompt reused the common prefix's blocks"
    # Both stages loaded only their own layers.
    assert '"layers": "0-1"' in log and '"layers": "2-3"' in log, log
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.token_ids == transformers_greedy(four_layer_model, prompt, 40)


def test_tp2_pp2_four_ranks_match_greedy(four_layer_model: Path, tmp_path: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90)), [300, 301], list(range(100, 140))]
    suite = start_suite(four_layer_model, tmp_path, worker_args=_pp_args(2, tp=2))
    try:
        answers = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=16))
    finally:
        suite.stop()
    assert [a.token_ids for a in answers] == [transformers_greedy(four_layer_model, p, 16) for p in prompts]


def test_uneven_partition_with_logprobs_and_a_grammar_sampled_on_the_last_stage(
    four_layer_model: Path, tmp_path: Path
) -> None:
    # The sampling rank (the last stage) alone holds the logits and the grammar matchers; logprobs and the
    # constrained request's tokens reach the client through rank 0.
    suite = start_suite(four_layer_model, tmp_path, worker_args=[*_pp_args(2), "--pp-layer-partition", "3,1"])
    prompt = list(range(30, 60))
    pattern = r"[0-9]{3}-[0-9]{4}"
    try:

        async def run() -> tuple[Answer, generation_pb2.CompleteResponse]:
            greedy = sampling_params(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
            constrained = sampling_params(max_tokens=40, temperature=1.0, seed=7)
            constrained.grammar.regex = pattern
            async with GenerationClient(suite.address) as client:
                return await asyncio.gather(
                    stream(client, build_request(token_ids=prompt, sampling=greedy)),
                    client.complete(build_request(prompt="Phone:", sampling=constrained), timeout=300),
                )

        answer, phone = asyncio.run(run())
        log = suite.workers[0].log_tail(400)
    finally:
        suite.stop()
    token_ids, logprobs = answer.token_ids, answer.logprobs
    assert token_ids == transformers_greedy(four_layer_model, prompt, 12)
    assert phone.finish_reason == sampling_pb2.FINISH_REASON_STOP and re.fullmatch(pattern, phone.text), phone.text
    assert len(logprobs) == 12 and all(lp <= 0.0 for lp in logprobs) and any(lp < 0.0 for lp in logprobs)
    assert '"layers": "0-2"' in log and '"layers": "3-3"' in log, log


def test_pp2_verifies_prompt_lookup_drafts_on_the_last_stage(four_layer_model: Path, tmp_path: Path) -> None:
    # Every rank keeps the drafts the sampling rank's rows confirm: the answers are plain greedy decoding's.
    prompts = [[5, 6, 7, 8, 9] * 6, [300, 301, 302] * 8, list(range(20, 60))]
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    suite = start_suite(four_layer_model, tmp_path, worker_args=_pp_args(2), scheduler_args=spec)
    try:
        answers = asyncio.run(greedy_token_answers(suite.address, prompts, max_tokens=24))
    finally:
        suite.stop()
    assert [a.token_ids for a in answers] == [transformers_greedy(four_layer_model, p, 24) for p in prompts]


def test_pp2_across_two_nodes_on_loopback(four_layer_model: Path, tmp_path: Path) -> None:
    """--nnodes 2 with one rank each: node 0 runs stage 0 and attaches, node 1 (its own command) runs stage 1."""
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90))]
    answers = two_node_greedy(four_layer_model, tmp_path, _pp_args(2), prompts, 12)
    assert answers == [transformers_greedy(four_layer_model, p, 12) for p in prompts]


def test_a_killed_stage_rank_stops_its_worker_and_requests_finish_on_another(
    four_layer_model: Path, tmp_path: Path
) -> None:
    suite = start_suite(four_layer_model, tmp_path, num_workers=2, worker_args=_pp_args(2))
    prompts = _prompts(6, seed=11, lo=5, hi=40)
    try:

        async def run() -> list:
            params = sampling_params(max_tokens=200, temperature=0.0, ignore_eos=True)
            async with GenerationClient(suite.address) as client:
                tasks = [
                    asyncio.create_task(stream(client, build_request(token_ids=p, sampling=params))) for p in prompts
                ]
                await suite.wait_running("worker-0")
                worker = suite.workers[0]
                (stage1,) = spawned_ranks(worker.process.pid)
                os.kill(stage1, signal.SIGKILL)
                # The worker must not hang in a pipeline hop: it exits for its supervisor to restart it.
                assert await asyncio.to_thread(worker.process.wait, 60) == 1
                return list(await asyncio.gather(*tasks))

        answers = asyncio.run(run())
        stats = asyncio.run(suite.wait_idle())
        log = suite.workers[0].log_tail(200)
    finally:
        suite.stop()
    assert "tensor_parallel_rank_died" in log
    assert [w.worker_id for w in stats.workers] == ["worker-1"]
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert answer.token_ids == transformers_greedy(four_layer_model, prompt, 200)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline-parallel-size", "5"], "--pipeline-parallel-size 5 exceeds the model's num_hidden_layers=4"),
        (["--pipeline-parallel-size", "2", "--pp-layer-partition", "2,1"], "sums to 3 layers but the model has"),
        (["--pipeline-parallel-size", "2", "--pp-layer-partition", "4"], "names 1 stages but --pipeline-parallel"),
        (["--pipeline-parallel-size", "2", "--kv-store", "127.0.0.1:9"], "--kv-store does not work with"),
    ],
)
def test_a_pipeline_that_cannot_split_the_model_is_refused(
    four_layer_model: Path, args: list[str], message: str
) -> None:
    assert message in worker_startup_error(four_layer_model, "--device", "cpu", *args)


@pytest.mark.slow
def test_pp2_matches_greedy_on_smollm2_with_chunks_prefix_hits_and_preemption(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    tokenizer = TextTokenizer.from_dir(smollm2_dir)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                 "Name a red fruit.", "How many legs has a spider?", "Spell the word cat backwards."]  # fmt: skip
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    # Nine blocks on the 19-layer stage (466,944 fp32 bytes each): six requests of ~37 prompt + 24 tokens need
    # 4 blocks each (one shared), so they preempt; 16-token steps prefill the prompts in chunks; their
    # common system prompt hits the prefix cache; two micro-batches in flight.
    worker_args = [*_pp_args(2, kv_cache_memory=str(9 * 466_944)), "--max-model-len", "96"]
    suite = start_suite(
        smollm2_dir, tmp_path, worker_args=worker_args, scheduler_args=["--max-num-batched-tokens", "16"]
    )
    try:
        answers = [a.token_ids for a in asyncio.run(greedy_token_answers(suite.address, prompts, 24))]
        stats = asyncio.run(suite.wait_idle())
    finally:
        suite.stop()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    # What TP=1 x PP=1 gives too (tests/integration/test_suite_smollm2.py holds it to the same oracle).
    assert answers == [transformers_greedy(smollm2_dir, p, 24) for p in prompts]
