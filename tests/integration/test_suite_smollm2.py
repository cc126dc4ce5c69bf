"""The whole suite on the embedded SmolLM2-135M-Instruct against transformers' generate (fp32)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.gateway.tokenizer import TextTokenizer
from tests.support.calls import stream
from tests.support.suite import Suite, start_suite
from tests.support.tiny_model import transformers_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, as if to a child who keeps asking why.",
    "List the planets of the solar system in order from the sun, with one fact about each of them.",
    "Translate 'good morning, how are you today?' into French and Spanish.",
    "You are reviewing a pull request that adds a cache in front of a database. The author claims "
    "it cuts latency in half. What three questions would you ask before approving it, and why?",
]
SYSTEM = (
    "You are a meticulous assistant for an engineering team that runs large language model inference "
    "services on clusters of accelerators. Always answer precisely, name your assumptions, prefer short "
    "sentences, and when a question is ambiguous say which reading you chose. The team cares about "
    "latency, throughput, memory use and correctness, in that order during incidents and in the reverse "
    "order during design reviews. Never invent numbers; say when you do not know. "
) * 3
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smol_suite(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    suite = start_suite(smollm2_dir, tmp_path_factory.mktemp("smol-logs"), worker_args=["--kv-cache-memory", "1GiB"])
    yield suite
    suite.stop()


async def _answers(address: str, conversations: list[list[tuple[str, str]]]) -> list:
    params = sampling_params(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with GenerationClient(address) as client:
        return list(
            await asyncio.gather(*(stream(client, build_request(messages=m, sampling=params)) for m in conversations))
        )


def _check(smollm2_dir: Path, conversations: list[list[tuple[str, str]]], answers: list) -> None:
    tokenizer = TextTokenizer.from_dir(smollm2_dir)
    for messages, answer in zip(conversations, answers, strict=True):
        prompt = tokenizer.encode_chat([{"role": r, "content": c} for r, c in messages])
        assert answer.usage.prompt_tokens == len(prompt)
        assert answer.token_ids == transformers_greedy(smollm2_dir, prompt, MAX_TOKENS), messages[-1][1]
        assert answer.text == tokenizer.decode(answer.token_ids)


def test_concurrent_chat_matches_transformers(smol_suite: Suite, smollm2_dir: Path) -> None:
    conversations = [[("user", q)] for q in QUESTIONS]
    answers = asyncio.run(_answers(smol_suite.address, conversations))
    _check(smollm2_dir, conversations, answers)
    assert "Paris" in answers[1].text


def test_shared_prefix_with_prefix_caching_matches(smol_suite: Suite, smollm2_dir: Path) -> None:
    conversations = [[("system", SYSTEM), ("user", q)] for q in QUESTIONS]
    warm = asyncio.run(_answers(smol_suite.address, conversations[:1]))
    answers = warm + asyncio.run(_answers(smol_suite.address, conversations[1:]))
    _check(smollm2_dir, conversations, answers)
    assert all(a.usage.cached_tokens >= 256 for a in answers[1:])
