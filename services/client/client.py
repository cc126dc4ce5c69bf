"""A small asyncio Python client for meshserve.v1.Generation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from services.common.channels import open_channel
from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.common.tls import Security


def sampling_params(**kwargs: Any) -> sampling_pb2.SamplingParams:
    """SamplingParams from keyword arguments, leaving None values unset."""
    stop = kwargs.pop("stop", None) or []
    stop_ids = kwargs.pop("stop_token_ids", None) or []
    fields = {k: v for k, v in kwargs.items() if v is not None}
    return sampling_pb2.SamplingParams(stop=stop, stop_token_ids=stop_ids, **fields)


def build_request(
    *,
    prompt: str | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    sampling: sampling_pb2.SamplingParams | None = None,
    request_id: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest with exactly one of prompt, chat messages or token ids."""
    request = generation_pb2.GenerateRequest(sampling=sampling, request_id=request_id)
    if prompt is not None:
        request.prompt = prompt
    elif messages is not None:
        request.chat.messages.extend(generation_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


class GenerationClient:
    """Async client: `async with GenerationClient(addr) as c: async for r in c.generate(req): ...`."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        """`security`: TLS (the CA, and a client certificate where the gateway asks for one); None: insecure."""
        self.address = address
        self.security = security
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> GenerationClient:
        self._channel = open_channel(self.address, self.security)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> generation_pb2_grpc.GenerationStub:
        """The generated stub over this client's channel."""
        assert self._channel is not None, "use GenerationClient as an async context manager"
        return generation_pb2_grpc.GenerationStub(self._channel)

    async def generate(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Stream the answer."""
        async for response in self.stub.Generate(request, timeout=timeout):
            yield response

    async def complete(
        self, request: generation_pb2.GenerateRequest, timeout: float | None = None
    ) -> generation_pb2.CompleteResponse:
        """The whole answer at once."""
        response: generation_pb2.CompleteResponse = await self.stub.Complete(request, timeout=timeout)
        return response
