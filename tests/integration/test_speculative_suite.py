"""A suite with --speculative-config: greedy answers equal transformers' token for token with drafts verified
beside chunked prefills, prefix hits and preemptions, while a sampled stream beside them (never speculated)
runs to its end; the scheduler's metrics show drafts proposed and kept."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import sampling_pb2
from tests.support.calls import greedy_token_answers, stream
from tests.support.scrape import scrape_metrics
from tests.support.suite import start_suite
from tests.support.tiny_model import transformers_greedy

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
NEW_TOKENS = 40


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(10, 512) for _ in range(40)]
    # Repeating prompts: prompt lookup finds their continuation; random ones: it finds little.
    repeating = [[7, 8, 9, 10, 11] * 8, [300, 301, 302] * 12]
    random_ = [[rng.randrange(10, 512) for _ in range(rng.randint(30, 80))] for _ in range(4)]
    return repeating + random_ + [[*shared, 1, 2, 3], [*shared, 4, 5, 6]]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^meshserve:{name}_total{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_speculated_greedy_answers_equal_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 24 blocks of 16 tokens (fp32, 2 layers, 2 KV heads of 16): fewer than 8 requests need at once, so some are
    # preempted; a 32-token budget chunks every prefill.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    metrics_port = free_port()
    budget = ["--max-num-batched-tokens", "32"]
    suite = start_suite(
        tiny_model_dir,
        tmp_path,
        worker_args=["--kv-cache-memory", str(24 * block_bytes), "--max-model-len", "320", *budget],
        scheduler_args=[*budget, "--speculative-config", json.dumps(SPEC), "--metrics-port", str(metrics_port)],
    )
    prompts = _prompts()

    async def traffic() -> tuple[list, object]:
        sampled = sampling_params(max_tokens=NEW_TOKENS, temperature=0.9, seed=3, ignore_eos=True)
        async with GenerationClient(suite.address) as client:
            beside = asyncio.ensure_future(stream(client, build_request(token_ids=[20, 21, 22, 23], sampling=sampled)))
            answers = await greedy_token_answers(suite.address, prompts, NEW_TOKENS)
            return answers, await beside

    try:
        answers, beside = asyncio.run(traffic())
        stats = asyncio.run(suite.wait_idle())
        metrics = scrape_metrics(metrics_port)
    finally:
        suite.stop()
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.token_ids == transformers_greedy(tiny_model_dir, prompt, NEW_TOKENS)
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert len(beside.token_ids) == NEW_TOKENS  # type: ignore[attr-defined]
    assert stats.num_preemptions > 0, "the KV cache was not small enough to force preemption"
    assert stats.prefix_cache_hits > 0
    drafts, draft_tokens = _metric(metrics, "spec_decode_num_drafts"), _metric(metrics, "spec_decode_num_draft_tokens")
    accepted = _metric(metrics, "spec_decode_num_accepted_tokens")
    assert drafts > 0 and draft_tokens >= drafts and 0 < accepted <= draft_tokens
