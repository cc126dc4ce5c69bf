"""The public Generation service: admit, validate, tokenize, route, submit, stream back.

Every way a call can fail is a StatusError raised where it is found; _handle turns it into the
call's status in one place, so no code path aborts half-way through a stream by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import grpc
import structlog

from services.common.errors import StatusError, invalid_argument_status, make_status, request_error_status, retry_status
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from services.common.request_context import bound_request_id
from services.gateway.admission import Admission, client_key
from services.gateway.metrics import GatewayMetrics
from services.gateway.output import OutputProcessor
from services.gateway.raw_request import parse_generate_request
from services.gateway.request_ids import RequestIds, request_ids
from services.gateway.scheduler_pool import SchedulerBackend, SchedulerPool
from services.gateway.tokenizer import TextTokenizer
from services.gateway.validation import (
    Limits,
    ResolvedRequest,
    ValidationError,
    check_input,
    encode_input,
    finish,
)

log = structlog.get_logger()
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
NO_SCHEDULER = "no scheduler with a ready worker is available; retry later"

Emit = Callable[[generation_pb2.GenerateResponse], Awaitable[None]]


@dataclass
class _Accumulated:
    """What Complete gathers from the stream."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last: generation_pb2.GenerateResponse | None = None

    async def add(self, response: generation_pb2.GenerateResponse) -> None:
        self.text.append(response.text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.last = response


def _invalid(err: ValidationError) -> StatusError:
    return StatusError(invalid_argument_status(err.field, err.description))


class GenerationServicer:
    """Handlers of meshserve.v1.Generation, registered with raw request bytes (see handlers())."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        pool: SchedulerPool,
        admission: Admission,
        executor: Executor,
        metrics: GatewayMetrics,
        *,
        write_timeout: float,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.draining = False
        # Tokenization and chat templates run here, off the event loop (`tokenizers` releases the GIL).
        self._executor = executor
        self._write_timeout = write_timeout

    async def drain(self, grace: float) -> None:
        """Refuse new calls and wait for in-flight streams (health stays reachable, NOT_SERVING)."""
        self.draining = True
        await self.admission.wait_idle()

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
                    )
                ) from None

        await self._handle(raw, context, write)

    async def complete(self, raw: bytes, context: grpc.aio.ServicerContext) -> generation_pb2.CompleteResponse:
        acc = _Accumulated()
        ids = await self._handle(raw, context, acc.add)
        last = acc.last
        assert last is not None and last.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
        return generation_pb2.CompleteResponse(
            request_id=ids.public,
            text="".join(acc.text),
            token_ids=acc.token_ids,
            logprobs=acc.logprobs,
            finish_reason=last.finish_reason,
            usage=last.usage,
            stop_reason=last.stop_reason,
        )

    async def _handle(self, raw: bytes, context: grpc.aio.ServicerContext, emit: Emit) -> RequestIds:
        """Run one call to its end; any StatusError becomes the call's status."""
        try:
            request, ids = self._accept(raw, context)
            client = client_key(context.peer())
            self._admit(client)
            try:
                client_id = {"client_request_id": ids.client} if ids.client else {}
                with bound_request_id(ids.internal, **client_id):
                    await self._run(request, ids, client, context, emit)
            finally:
                self.admission.release(client)
            return ids
        except StatusError as err:
            await context.abort_with_status(err.status)
            raise AssertionError("abort_with_status returned") from err  # pragma: no cover

    def _accept(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> tuple[generation_pb2.GenerateRequest, RequestIds]:
        """The parsed request and its ids, unless the gateway drains or the bytes or ids are bad."""
        if self.draining:
            self.metrics.requests_refused.labels(reason="draining").inc()
            raise StatusError(make_status(grpc.StatusCode.UNAVAILABLE, "gateway is draining; retry on another replica"))
        try:
            request = parse_generate_request(raw)
            return request, request_ids(request, context)
        except ValidationError as err:
            self.metrics.requests_rejected.inc()
            raise _invalid(err) from err

    def _admit(self, client: str) -> None:
        """Take a concurrency slot (released by _handle), or refuse at once with retry advice."""
        refusal = self.admission.try_acquire(client)
        if refusal is not None:
            self.metrics.requests_refused.labels(reason="concurrency").inc()
            raise StatusError(retry_status(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after))

    def _limits(self) -> Limits:
        model = self.pool.limits()
        if model is None:
            self.metrics.requests_refused.labels(reason="no_scheduler").inc()
            raise StatusError(retry_status(grpc.StatusCode.UNAVAILABLE, NO_SCHEDULER, self.admission.retry_after))
        return Limits(model.max_model_len, model.vocab_size, self.tokenizer.max_token_bytes)

    async def _resolve(self, request: generation_pb2.GenerateRequest, limits: Limits) -> ResolvedRequest:
        try:
            checked = check_input(request, limits)
            if checked.token_ids is not None:
                prompt_ids = checked.token_ids
            else:
                loop = asyncio.get_running_loop()
                prompt_ids = await loop.run_in_executor(self._executor, encode_input, checked, self.tokenizer)
            return finish(request, checked, prompt_ids, limits)
        except ValidationError as err:
            self.metrics.requests_rejected.inc()
            raise _invalid(err) from err

    def _pick(self, prompt_token_ids: Sequence[int]) -> SchedulerBackend:
        backend = self.pool.pick(prompt_token_ids)
        if backend is None:
            self.metrics.requests_refused.labels(reason="no_scheduler").inc()
            raise StatusError(retry_status(grpc.StatusCode.UNAVAILABLE, NO_SCHEDULER, self.admission.retry_after))
        return backend

    def _submission(
        self, ids: RequestIds, resolved: ResolvedRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitRequest:
        submit = scheduler_pb2.SubmitRequest(
            request_id=ids.internal,
            prompt_token_ids=resolved.prompt_token_ids,
            sampling=resolved.sampling,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        # The client's deadline travels on, so the scheduler drops the request once nobody waits for it.
        remaining = context.time_remaining()
        if remaining is not None:
            if remaining <= 0:
                raise StatusError(
                    make_status(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before it was submitted")
                )
            submit.timeout_seconds = remaining
        return submit

    async def _run(
        self,
        request: generation_pb2.GenerateRequest,
        ids: RequestIds,
        client: str,
        context: grpc.aio.ServicerContext,
        emit: Emit,
    ) -> None:
        resolved = await self._resolve(request, self._limits())
        backend = self._pick(resolved.prompt_token_ids)
        submit = self._submission(ids, resolved, context)
        output = OutputProcessor(self.tokenizer, resolved.prompt_token_ids, resolved.sampling.stop)
        log.info(
            "generate",
            input=resolved.input_kind,
            prompt_tokens=len(resolved.prompt_token_ids),
            scheduler=backend.address,
            client=client,
        )
        self.metrics.requests_started.inc()
        events = backend.stream.submit(submit)
        started, first_token_at = time.monotonic(), None
        first, finished = True, False
        try:
            while not finished:
                event = await events.get()
                if event.HasField("error"):
                    raise StatusError(request_error_status(event.error))
                out = output.process(event.tokens)
                if out.stopped_by_string:
                    backend.stream.abort(ids.internal)
                if first:
                    out.response.request_id = ids.public
                    first = False
                if out.response.token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
                    self.metrics.time_to_first_token.observe(first_token_at - started)
                if out.final:
                    finished = True
                    self._finished(out.response, time.monotonic() - started)
                await emit(out.response)
        finally:
            if not finished:
                # The client went away, was too slow, or the request failed: free its slot and KV blocks.
                backend.stream.abort(ids.internal)
                self.metrics.requests_cancelled.inc()

    def _finished(self, response: generation_pb2.GenerateResponse, elapsed: float) -> None:
        self.metrics.observe_finish(response.finish_reason, response.usage)
        self.metrics.e2e_request_latency.observe(elapsed)
        log.info(
            "finished",
            finish_reason=sampling_pb2.FinishReason.Name(response.finish_reason),
            completion_tokens=response.usage.completion_tokens,
            cached_tokens=response.usage.cached_tokens,
        )
