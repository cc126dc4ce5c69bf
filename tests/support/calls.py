"""Client-side helpers for integration tests: run requests concurrently, collect answers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from services.client.client import GenerationClient, build_request, sampling_params
from services.common.errors import field_violations
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2


@dataclass
class Answer:
    """One streamed answer, joined."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: int = sampling_pb2.FINISH_REASON_UNSPECIFIED
    usage: generation_pb2.Usage | None = None
    stop_reason: str = ""
    messages: int = 0


async def stream(client: GenerationClient, request: generation_pb2.GenerateRequest) -> Answer:
    """Consume a Generate stream; exactly the last message must carry the finish reason."""
    answer = Answer()
    async for response in client.generate(request, timeout=300):
        assert answer.finish_reason == sampling_pb2.FINISH_REASON_UNSPECIFIED, "message after the final one"
        answer.messages += 1
        answer.text += response.text
        answer.token_ids.extend(response.token_ids)
        answer.logprobs.extend(response.logprobs)
        if response.finish_reason:
            answer.finish_reason = response.finish_reason
            answer.usage = response.usage
            answer.stop_reason = response.stop_reason
    assert answer.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED, "stream ended without a finish"
    return answer


async def greedy_token_answers(
    address: str, prompts: Sequence[Sequence[int]], max_tokens: int, **sampling: object
) -> list[Answer]:
    """Send all prompts (as token ids) at once, greedy, ignoring EOS; answers in prompt order."""
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    async with GenerationClient(address) as client:
        return list(
            await asyncio.gather(*(stream(client, build_request(token_ids=list(p), sampling=params)) for p in prompts))
        )


async def expect_invalid(client: GenerationClient, request: generation_pb2.GenerateRequest) -> list[str]:
    """Send a bad request; assert INVALID_ARGUMENT and return the violated field names."""
    try:
        await stream(client, request)
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        fields = [f for f, _ in field_violations(err)]
        assert fields, f"no BadRequest detail in {err}"
        for name in fields:
            assert name in (err.details() or ""), "the message must name the field too"
        return fields
    raise AssertionError("request was accepted")
