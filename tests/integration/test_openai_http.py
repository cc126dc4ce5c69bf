"""The gateway's OpenAI-compatible HTTP front on the whole suite (tiny random Llama), driven by the official
`openai` client: the same greedy answers and usage as the gRPC path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.ports import free_port
from tests.support.suite import Suite, start_suite

MAX_TOKENS = 12
# Greedy and a fixed length: both fronts must give the very same answer.
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http_suite(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Suite, int]]:
    port = free_port()
    suite = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "64MiB"],
        gateway_args=["--http-port", str(port)],
    )
    yield suite, port
    suite.stop()


def _client(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)


async def _model(client: AsyncOpenAI) -> str:
    models = await client.models.list()
    assert len(models.data) == 1 and models.data[0].owned_by == "meshserve"
    return models.data[0].id


async def test_completion_matches_the_grpc_path(http_suite: tuple[Suite, int]) -> None:
    suite, port = http_suite
    client = _client(port)
    model = await _model(client)
    prompt = "The quick brown fox"
    completion = await client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    async with GenerationClient(suite.address) as grpc_client:
        reference = await grpc_client.complete(
            build_request(prompt=prompt, sampling=sampling_params(max_tokens=MAX_TOKENS, **GREEDY)), timeout=120
        )
    [choice] = completion.choices
    assert choice.text == reference.text
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == reference.usage.prompt_tokens
    assert completion.usage.completion_tokens == reference.usage.completion_tokens == MAX_TOKENS
    assert completion.usage.total_tokens == reference.usage.prompt_tokens + MAX_TOKENS

    # Streamed, the same text arrives in pieces, then the usage chunk.
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    *texts, last = chunks
    assert "".join(c.choices[0].text for c in texts) == reference.text
    assert texts[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        reference.usage.prompt_tokens,
        reference.usage.completion_tokens,
    )


async def test_chat_matches_the_grpc_path(http_suite: tuple[Suite, int]) -> None:
    suite, port = http_suite
    client = _client(port)
    messages = [("system", "You are terse."), ("user", "Name a colour.")]
    chat = await client.chat.completions.create(
        model=await _model(client),
        messages=[{"role": role, "content": content} for role, content in messages],  # type: ignore[misc]
        max_completion_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    async with GenerationClient(suite.address) as grpc_client:
        reference = await grpc_client.complete(
            build_request(messages=messages, sampling=sampling_params(max_tokens=MAX_TOKENS, **GREEDY)), timeout=120
        )
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == reference.text
    assert chat.usage is not None
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        reference.usage.prompt_tokens,
        reference.usage.completion_tokens,
    )
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == MAX_TOKENS
    # Greedy: each sampled token is its position's most likely one.
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


async def test_errors_health_and_metrics(http_suite: tuple[Suite, int]) -> None:
    _, port = http_suite
    client = _client(port)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=await _model(client), prompt="x", max_tokens=10**6)
    assert info.value.param == "max_tokens"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        assert (await http.get("/health")).status_code == 200
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and "meshserve:requests_started" in metrics.text


async def test_one_access_line_per_http_request(http_suite: tuple[Suite, int]) -> None:
    suite, port = http_suite
    client = _client(port)
    completion = await client.completions.create(model=await _model(client), prompt="Hello", max_tokens=3)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=await _model(client), prompt="x", max_tokens=10**6)
    lines = [r for r in suite.log_records("gateway") if r.get("event") == "http" and r["path"] == "/v1/completions"]
    ok = [r for r in lines if r["status"] == 200 and r.get("completion_tokens") == 3]
    assert completion.usage is not None
    assert ok and ok[-1]["method"] == "POST" and ok[-1]["prompt_tokens"] == completion.usage.prompt_tokens
    assert ok[-1]["request_id"] and ok[-1]["level"] == "info"
    refused = [r for r in lines if r["status"] == 400]
    assert refused and refused[-1]["request_id"]
