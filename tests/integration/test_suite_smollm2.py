"""The whole suite on the embedded SmolLM2-135M-Instruct against transformers' generate (fp32)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.ports import free_port
from services.gateway.tokenizer import TextTokenizer
from tests.support.calls import stream
from tests.support.scrape import scrape_metrics
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
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def smol_suite(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory, http_port: int) -> Iterator[Suite]:
    suite = start_suite(
        smollm2_dir,
        tmp_path_factory.mktemp("smol-logs"),
        worker_args=["--kv-cache-memory", "1GiB"],
        gateway_args=["--http-port", str(http_port)],
    )
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


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_the_official_openai_client_on_smollm2(smol_suite: Suite, http_port: int) -> None:
    """Complete, stream, chat, logprobs and a JSON schema through `openai`, equal to the gRPC path."""
    import json

    import jsonschema
    from openai import AsyncOpenAI

    question: Any = [{"role": "user", "content": "What is the capital of France?"}]

    async def run() -> None:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=300)
        model = (await client.models.list()).data[0].id
        async with GenerationClient(smol_suite.address) as grpc_client:
            greedy = sampling_params(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, top_logprobs=5)
            via_grpc = await stream(
                grpc_client, build_request(messages=[("user", question[0]["content"])], sampling=greedy)
            )
            via_grpc_text = await stream(grpc_client, build_request(prompt="The capital of France is", sampling=greedy))
        # Completions: the same greedy text and usage.
        done = await client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=MAX_TOKENS, temperature=0
        )
        assert via_grpc.usage is not None and via_grpc_text.usage is not None
        assert done.choices[0].text == via_grpc_text.text
        assert done.usage is not None and done.usage.completion_tokens == via_grpc_text.usage.completion_tokens
        assert done.usage.prompt_tokens == via_grpc_text.usage.prompt_tokens
        # Chat, streamed, with usage at the end and logprobs.
        chunks = await client.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            top_logprobs=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, logprobs, usage = "", [], None
        async for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.logprobs and choice.logprobs.content:
                    logprobs.extend(choice.logprobs.content)
        assert text == via_grpc.text and "Paris" in text
        assert usage is not None and usage.completion_tokens == via_grpc.usage.completion_tokens
        assert usage.prompt_tokens == via_grpc.usage.prompt_tokens
        assert [round(lp.logprob, 4) for lp in logprobs] == [round(x, 4) for x in via_grpc.logprobs]
        assert all(len(lp.top_logprobs) == 5 for lp in logprobs)
        # A JSON schema: the answer parses and validates.
        answer = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Describe a person who lives in a big city, as JSON."}],
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
        )
        content = answer.choices[0].message.content or ""
        assert answer.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), PERSON_SCHEMA)

    asyncio.run(run())


COPY_TASKS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog near the river bank.",
    "Copy this list as it is: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa, lambda.",
]


def test_speculative_decoding_keeps_greedy_answers(smollm2_dir: Path, tmp_path: Path) -> None:
    """Prompt-lookup drafts verified by SmolLM2 itself: every answer token for token as transformers', and the
    copying prompts (whose answers are in their prompts) really do keep drafts."""
    metrics_port = free_port()
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    suite = start_suite(
        smollm2_dir,
        tmp_path,
        worker_args=["--kv-cache-memory", "1GiB"],
        scheduler_args=["--speculative-config", spec, "--metrics-port", str(metrics_port)],
    )
    try:
        conversations = [[("user", q)] for q in [*QUESTIONS[:4], *COPY_TASKS]]
        answers = asyncio.run(_answers(suite.address, conversations))
        metrics = scrape_metrics(metrics_port)
    finally:
        suite.stop()
    _check(smollm2_dir, conversations, answers)
    accepted = re.search(r"^meshserve:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert accepted is not None and float(accepted.group(1)) > 0
