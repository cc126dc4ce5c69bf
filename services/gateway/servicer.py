"""The public Generation service: validate, tokenize, submit, detokenize, stop strings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.errors import abort_invalid_argument, abort_with_request_error
from services.common.proto.meshserve.v1 import (
    generation_pb2,
    sampling_pb2,
    scheduler_pb2,
)
from services.common.request_context import (
    bound_request_id,
    new_request_id,
    request_id_from_metadata,
)
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.metrics import GatewayMetrics
from services.gateway.raw_request import parse_generate_request
from services.gateway.scheduler_stream import SchedulerStream
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import TextTokenizer
from services.gateway.validation import Limits, ResolvedRequest, ValidationError, validate_and_resolve

log = structlog.get_logger()
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class _Accumulated:
    """What Complete gathers from the stream."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class GenerationServicer:
    """Handlers of meshserve.v1.Generation, registered with raw request bytes (see handlers())."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        scheduler: SchedulerStream,
        limits: Limits,
        metrics: GatewayMetrics,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.limits = limits
        self.metrics = metrics
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, grace: float) -> None:
        """Refuse new calls and wait for in-flight streams (health stays reachable, NOT_SERVING)."""
        self.draining = True
        await self._idle.wait()

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

    async def _prepare(self, raw: bytes, context: grpc.aio.ServicerContext) -> tuple[str, ResolvedRequest]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is draining; retry on another replica")
        try:
            request = parse_generate_request(raw)
            resolved = validate_and_resolve(request, self.tokenizer, self.limits)
        except ValidationError as err:
            self.metrics.requests_rejected.inc()
            await abort_invalid_argument(context, err.field, err.description)
        request_id = request.request_id or request_id_from_metadata(context) or new_request_id()
        return request_id, resolved

    async def generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        request_id, resolved = await self._prepare(raw, context)
        with bound_request_id(request_id):
            async for response in self._stream(request_id, resolved, context):
                yield response

    async def complete(self, raw: bytes, context: grpc.aio.ServicerContext) -> generation_pb2.CompleteResponse:
        request_id, resolved = await self._prepare(raw, context)
        acc = _Accumulated()
        with bound_request_id(request_id):
            async for response in self._stream(request_id, resolved, context):
                acc.text.append(response.text)
                acc.token_ids.extend(response.token_ids)
                acc.logprobs.extend(response.logprobs)
                if response.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
                    return generation_pb2.CompleteResponse(
                        request_id=request_id,
                        text="".join(acc.text),
                        token_ids=acc.token_ids,
                        logprobs=acc.logprobs,
                        finish_reason=response.finish_reason,
                        usage=response.usage,
                        stop_reason=response.stop_reason,
                    )
        await context.abort(grpc.StatusCode.INTERNAL, "the scheduler ended the stream without a finish reason")
        raise AssertionError("unreachable")

    def _is_stop_token(self, token_id: int, event: scheduler_pb2.TokenEvent, ignore_eos: bool) -> bool:
        if event.HasField("stop_token_id"):
            return token_id == event.stop_token_id
        return not ignore_eos and token_id in self.tokenizer.eos_token_ids

    async def _stream(
        self, request_id: str, resolved: ResolvedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        sampling = resolved.sampling
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=resolved.prompt_token_ids,
            sampling=sampling,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        detok = IncrementalDetokenizer(self.tokenizer, resolved.prompt_token_ids)
        stops = StopStringMatcher(list(sampling.stop))
        usage = generation_pb2.Usage(prompt_tokens=len(resolved.prompt_token_ids))
        self.metrics.requests_started.inc()
        self._in_flight += 1
        self._idle.clear()
        log.info("generate", input=resolved.input_kind, prompt_tokens=usage.prompt_tokens)
        events = self.scheduler.submit(submit)
        finished = False
        started, first_token_at = time.monotonic(), None
        try:
            while True:
                item = await events.get()
                if item.HasField("error"):
                    # Pass the scheduler's verdict on, with the field for INVALID_ARGUMENT.
                    finished = True
                    await abort_with_request_error(context, item.error)
                event = item.tokens
                ids = list(event.token_ids)
                usage.completion_tokens += len(ids)
                usage.cached_tokens = max(usage.cached_tokens, event.num_cached_tokens)
                final = event.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
                text_ids, stop_reason = ids, ""
                if (
                    final
                    and event.finish_reason == sampling_pb2.FINISH_REASON_STOP
                    and ids
                    and self._is_stop_token(ids[-1], event, sampling.ignore_eos)
                ):
                    # A stop or EOS token ends the answer; its text is not part of it.
                    text_ids = ids[:-1]
                    if event.HasField("stop_token_id"):
                        stop_reason = str(event.stop_token_id)
                delta = detok.add(text_ids)
                if final:
                    # Text held back for an unfinished multi-byte character is due now.
                    delta += detok.flush()
                emit, matched = stops.feed(delta)
                response = generation_pb2.GenerateResponse(
                    request_id=request_id, text=emit, token_ids=ids, logprobs=event.logprobs
                )
                if matched is not None:
                    # Ends the request at the scheduler too.
                    self.scheduler.abort(request_id)
                    response.finish_reason = sampling_pb2.FINISH_REASON_STOP
                    response.stop_reason = matched
                    final = True
                elif final:
                    response.text += stops.flush()
                    response.finish_reason = event.finish_reason
                    response.stop_reason = stop_reason
                if final:
                    response.usage.CopyFrom(usage)
                    finished = True
                    self.metrics.observe_finish(response.finish_reason, usage)
                    log.info(
                        "finished",
                        finish_reason=sampling_pb2.FinishReason.Name(response.finish_reason),
                        completion_tokens=usage.completion_tokens,
                        cached_tokens=usage.cached_tokens,
                    )
                if ids and first_token_at is None:
                    first_token_at = time.monotonic()
                    self.metrics.time_to_first_token.observe(first_token_at - started)
                yield response
                if final:
                    self.metrics.e2e_request_latency.observe(time.monotonic() - started)
                    return
        finally:
            if not finished:
                # The client went away: free the request's slot and KV blocks at the scheduler.
                self.scheduler.abort(request_id)
                self.metrics.requests_cancelled.inc()
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
