"""meshserve.v1.Generation over gRPC: an adapter over the transport-free pipeline (pipeline.py).

It parses the raw request bytes itself (bad bytes become INVALID_ARGUMENT naming the field), times out
slow readers, and turns any StatusError into the call's status in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import grpc

from services.common.errors import Reason, StatusError, make_status
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.tracing import trace_context_from
from services.gateway.admission import client_key
from services.gateway.pipeline import Call, GenerationPipeline, invalid
from services.gateway.raw_request import parse_generate_request
from services.gateway.request_ids import request_ids
from services.gateway.validation import ValidationError

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

Emit = Callable[[generation_pb2.GenerateResponse], Awaitable[None]]


class _Accumulated:
    """What Complete gathers from the stream, per sample."""

    def __init__(self) -> None:
        self.choices: dict[int, generation_pb2.CompleteChoice] = {}
        self.usage = generation_pb2.Usage()

    async def add(self, response: generation_pb2.GenerateResponse) -> None:
        choice = self.choices.get(response.index)
        if choice is None:
            choice = self.choices[response.index] = generation_pb2.CompleteChoice(index=response.index)
        choice.text += response.text
        choice.token_ids.extend(response.token_ids)
        choice.logprobs.extend(response.logprobs)
        choice.top_logprobs.extend(response.top_logprobs)
        if response.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = response.finish_reason
            choice.stop_reason = response.stop_reason
            # The prompt is shared: counted once, as OpenAI does for n > 1.
            self.usage.prompt_tokens = response.usage.prompt_tokens
            self.usage.completion_tokens += response.usage.completion_tokens
            self.usage.cached_tokens = max(self.usage.cached_tokens, response.usage.cached_tokens)

    def response(self, request_id: str) -> generation_pb2.CompleteResponse:
        choices = [self.choices[i] for i in sorted(self.choices)]
        first = choices[0]
        assert all(c.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED for c in choices)
        return generation_pb2.CompleteResponse(
            request_id=request_id,
            text=first.text,
            token_ids=first.token_ids,
            logprobs=first.logprobs,
            top_logprobs=first.top_logprobs,
            finish_reason=first.finish_reason,
            usage=self.usage,
            stop_reason=first.stop_reason,
            choices=choices,
        )


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return None


class GenerationServicer:
    """Handlers of meshserve.v1.Generation, registered with raw request bytes (see handlers())."""

    def __init__(self, pipeline: GenerationPipeline, *, write_timeout: float) -> None:
        self.pipeline = pipeline
        self._write_timeout = write_timeout

    def handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers without a request deserializer, so bad bytes become INVALID_ARGUMENT."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate, response_serializer=generation_pb2.GenerateResponse.SerializeToString
                ),
                "Complete": grpc.unary_unary_rpc_method_handler(
                    self.complete, response_serializer=generation_pb2.CompleteResponse.SerializeToString
                ),
            },
        )

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        """Stream the answer with context.write, so that a client that stops reading can be timed out."""

        async def write(response: generation_pb2.GenerateResponse) -> None:
            try:
                await asyncio.wait_for(context.write(response), timeout=self._write_timeout)
            except TimeoutError:
                raise StatusError(
                    make_status(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the client reads too slowly: a response waited {self._write_timeout:g}s to be sent "
                        "(--stream-write-timeout); read the stream as it arrives",
                        reason=Reason.CLIENT_TOO_SLOW,
                    )
                ) from None

        await self._handle(raw, context, write)

    async def complete(self, raw: bytes, context: grpc.aio.ServicerContext) -> generation_pb2.CompleteResponse:
        acc = _Accumulated()
        public_id = await self._handle(raw, context, acc.add)
        return acc.response(public_id)

    async def _handle(self, raw: bytes, context: grpc.aio.ServicerContext, emit: Emit) -> str:
        """Run one call to its end and return the request's public id; any StatusError becomes its status."""
        try:
            self.pipeline.refuse_if_draining()
            authorization = _authorization(context)
            self.pipeline.authenticate(authorization)
            try:
                request = parse_generate_request(raw)
                ids = request_ids(request, context)
            except ValidationError as err:
                self.pipeline.metrics.requests_rejected.inc()
                raise invalid(err) from err
            # An invalid traceparent is ignored (the request starts its own trace), never refused.
            trace = trace_context_from(context.invocation_metadata())
            call = Call(ids, client_key(context.peer()), context.time_remaining(), authorization, trace)
            async with contextlib.aclosing(self.pipeline.generate(request, call)) as responses:
                async for response in responses:
                    await emit(response)
            return ids.public
        except StatusError as err:
            await context.abort_with_status(err.status)
            raise AssertionError("abort_with_status returned") from err  # pragma: no cover
