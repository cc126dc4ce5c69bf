"""The gateway's one request pipeline, free of any transport: a GenerateRequest in, responses out.

Admission, model-name check, validation, tokenization (on threads), sampling defaults, the choice of
scheduler, submission of the n samples, detokenization, stop strings and usage all happen here, once.
The gRPC servicer and the OpenAI HTTP front are adapters: they turn their wire format into a
GenerateRequest and a Call, iterate `generate`, and map a StatusError to their own error form. Every
failure is a StatusError raised before or between responses; nothing here aborts a call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
import structlog

from services.common.errors import (
    Reason,
    StatusError,
    invalid_argument_status,
    make_status,
    request_error_status,
    retry_status,
)
from services.common.grammar_check import check_grammar, is_constrained
from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from services.common.request_context import bound_request_id
from services.common.rpc_observer import annotate_call
from services.common.tracing import RequestSpan, TraceContext, Tracing
from services.gateway.admission import Admission
from services.gateway.api_keys import ApiKeys
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.gateway.output import OutputProcessor
from services.gateway.rate_limit import Decision, RateLimiter
from services.gateway.request_ids import RequestIds
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.scheduler_pool import SchedulerBackend, SchedulerPool
from services.gateway.scheduler_stream import RequestEvents
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
NO_SCHEDULER = "no scheduler with a ready worker is available; retry later"
_SEED_MODULUS = 2**64


@dataclass(frozen=True)
class Call:
    """What the transport knows about one call."""

    ids: RequestIds
    # Admission key: the client's host (admission.client_key of the peer).
    client: str
    # Seconds before the caller's deadline, or None without one.
    time_remaining: float | None = None
    # The `authorization` metadata or header as sent (checked by ApiKeys; never logged).
    authorization: str | None = None
    # The caller's span, from its `traceparent` (and `tracestate`); None: the request starts a trace.
    trace: TraceContext | None = None


def _client_id(call: Call) -> dict[str, str]:
    """The client's own request id as a log field, when it sent one."""
    return {"client_request_id": call.ids.client} if call.ids.client else {}


def invalid(err: ValidationError) -> StatusError:
    """INVALID_ARGUMENT naming the field."""
    return StatusError(invalid_argument_status(err.field, err.description))


@dataclass
class _Sample:
    """One of a request's n samples on its scheduler."""

    index: int
    request_id: str
    events: RequestEvents
    output: OutputProcessor
    done: bool = False


class GenerationPipeline:
    """Runs requests from any front; one instance per gateway."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        pool: SchedulerPool,
        admission: Admission,
        executor: Executor,
        metrics: GatewayMetrics,
        *,
        defaults: SamplingDefaults | None = None,
        served_model_names: Sequence[str] = (),
        api_keys: ApiKeys | None = None,
        rate_limiter: RateLimiter | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.defaults = defaults or SamplingDefaults()
        self._served_names = tuple(served_model_names)
        self.api_keys = api_keys or ApiKeys(())
        self.rate_limiter = rate_limiter
        # Each request's "generate" span (recorded only with --otlp-endpoint; its context always travels on).
        self.tracing = tracing or Tracing("gateway")
        self.draining = False
        # Tokenization and chat templates run here, off the event loop (`tokenizers` releases the GIL).
        self._executor = executor

    async def drain(self, grace: float) -> None:
        """Refuse new calls and wait for in-flight ones (health stays reachable, NOT_SERVING)."""
        self.draining = True
        await self.admission.wait_idle()

    def model_names(self) -> list[str]:
        """The names a request may give as its model: --served-model-name, else what the workers serve."""
        if self._served_names:
            return list(self._served_names)
        limits = self.pool.limits()
        return [limits.model_name] if limits is not None and limits.model_name else []

    def check_model(self, model: str) -> None:
        """NOT_FOUND unless `model` is empty or one of the served names (vLLM answers 404 the same way)."""
        if not model:
            return
        names = self.model_names()
        if model not in names:
            served = ", ".join(repr(n) for n in names) or "none yet (no worker attached)"
            raise StatusError(
                make_status(
                    grpc.StatusCode.NOT_FOUND,
                    f"the model {model[:128]!r} does not exist; this server serves {served}",
                    reason=Reason.MODEL_NOT_FOUND,
                )
            )

    def authenticate(self, authorization: str | None) -> str | None:
        """The caller's key id (None when keys are off), or UNAUTHENTICATED. Fronts call it before parsing
        anything, so an unauthenticated caller learns nothing about the API from its errors."""
        try:
            return self.api_keys.check(authorization)
        except StatusError:
            self.metrics.requests_refused.labels(reason="unauthenticated").inc()
            raise

    def refuse_if_draining(self) -> None:
        """UNAVAILABLE while the gateway drains (a front calls this before it parses anything)."""
        if self.draining:
            self.metrics.requests_refused.labels(reason="draining").inc()
            raise StatusError(
                make_status(
                    grpc.StatusCode.UNAVAILABLE, "gateway is draining; retry on another replica", reason=Reason.DRAINING
                )
            )

    async def generate(
        self, request: generation_pb2.GenerateRequest, call: Call
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Responses of every sample in arrival order; each sample ends with one carrying finish_reason.

        Iterate it with contextlib.aclosing: closing it early aborts the samples still running.
        """
        # The span starts first, so that a refusal too is logged (and traced) with the request's trace id.
        span = self.tracing.start_server_span("generate", call.trace)
        annotate_call(request_id=call.ids.internal, trace_id=span.trace_id)
        if span.recording:
            span.set_attributes(self._span_attributes(request, call))
        code = grpc.StatusCode.OK
        try:
            try:
                self.refuse_if_draining()
                caller = self.authenticate(call.authorization) or call.client
                self.check_model(request.model)
                refusal = self.admission.try_acquire(call.client)
                if refusal is not None:
                    self.metrics.requests_refused.labels(reason="concurrency").inc()
                    raise StatusError(
                        retry_status(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            refusal.message,
                            refusal.retry_after,
                            Reason.TOO_MANY_REQUESTS,
                        )
                    )
            except StatusError as err:
                code = err.status.code
                self._failed("request refused", call, span, err)
                raise
            try:
                client_id = _client_id(call)
                with bound_request_id(call.ids.internal, trace_id=span.trace_id, **client_id):
                    # Closed here, inside the binding, so that its last lines (a cancel) carry the ids too.
                    async with contextlib.aclosing(self._run(request, call, caller, span)) as responses:
                        async for response in responses:
                            yield response
            except StatusError as err:
                code = err.status.code
                self._failed("request failed", call, span, err)
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED  # the client went away, or read too slowly
                raise
            finally:
                self.admission.release(call.client)
        finally:
            if span.recording:
                span.set_attributes({"rpc.grpc.status_code": code.value[0]})
            span.end()

    def _failed(self, event: str, call: Call, span: RequestSpan, err: StatusError) -> None:
        """Count, log and trace a request that ends with an error status (refused before it started, or later)."""
        code = err.status.code
        self.metrics.errored(code)
        # Outside the request's contextvars binding (a refusal comes before it): every id named here.
        client_id = _client_id(call)
        log.info(
            event,
            request_id=call.ids.internal,
            trace_id=span.trace_id,
            code=code.name,
            error=err.status.details,
            **client_id,
        )
        if span.recording:
            span.set_attributes({"error.type": code.name})
            span.set_error(f"{code.name}: {err.status.details}")

    def _span_attributes(self, request: generation_pb2.GenerateRequest, call: Call) -> dict[str, str]:
        """What the generate span knows before the request is read further (only built when recording)."""
        attributes = {
            "meshserve.request_id": call.ids.internal,
            "gen_ai.request.model": request.model or next(iter(self.model_names()), ""),
        }
        if call.ids.client:
            attributes["meshserve.client_request_id"] = call.ids.client
        return attributes

    def _limits(self) -> Limits:
        model = self.pool.limits()
        if model is None:
            self.metrics.requests_refused.labels(reason="no_scheduler").inc()
            raise StatusError(
                retry_status(
                    grpc.StatusCode.UNAVAILABLE, NO_SCHEDULER, self.admission.retry_after, Reason.NO_READY_WORKER
                )
            )
        return Limits(model.max_model_len, model.vocab_size, self.tokenizer.max_token_bytes)

    async def resolve(self, request: generation_pb2.GenerateRequest) -> ResolvedRequest:
        """Validate and tokenize (off the event loop) a request against the schedulers' limits."""
        limits = self._limits()
        try:
            checked = check_input(request, limits)
            loop = asyncio.get_running_loop()
            if is_constrained(request.sampling):
                # Compiling-to-validate grows with the grammar (up to ~10 ms for a 64 KiB schema): a thread's job.
                await loop.run_in_executor(self._executor, check_grammar, request.sampling.grammar)
            if checked.token_ids is not None:
                prompt_ids = checked.token_ids
            else:
                prompt_ids = await loop.run_in_executor(self._executor, encode_input, checked, self.tokenizer)
            return finish(request, checked, prompt_ids, limits, self.defaults)
        except ValidationError as err:
            self.metrics.requests_rejected.inc()
            raise invalid(err) from err

    def _pick(self, prompt_token_ids: Sequence[int]) -> SchedulerBackend:
        backend = self.pool.pick(prompt_token_ids)
        if backend is None:
            self.metrics.requests_refused.labels(reason="no_scheduler").inc()
            raise StatusError(
                retry_status(
                    grpc.StatusCode.UNAVAILABLE, NO_SCHEDULER, self.admission.retry_after, Reason.NO_READY_WORKER
                )
            )
        return backend

    def _submission(
        self, request_id: str, resolved: ResolvedRequest, index: int, call: Call, traceparent: str
    ) -> scheduler_pb2.SubmitRequest:
        sampling = resolved.sampling
        if index and sampling.HasField("seed"):
            # Sample i of a seeded request draws from seed + i (vLLM's rule), so each is reproducible alone.
            sampling = sampling_pb2.SamplingParams()
            sampling.CopyFrom(resolved.sampling)
            sampling.seed = (resolved.sampling.seed + index) % _SEED_MODULUS
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=resolved.prompt_token_ids,
            sampling=sampling,
            eos_token_ids=self.tokenizer.eos_token_ids,
            traceparent=traceparent,
        )
        # The client's deadline travels on, so the scheduler drops the request once nobody waits for it.
        if call.time_remaining is not None:
            if call.time_remaining <= 0:
                raise StatusError(
                    make_status(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before it was submitted")
                )
            submit.timeout_seconds = call.time_remaining
        return submit

    async def _rate_limit(self, caller: str, resolved: ResolvedRequest) -> Decision | None:
        """Charge the caller's rate limits (RESOURCE_EXHAUSTED with RetryInfo when over); None without limits."""
        if self.rate_limiter is None:
            return None
        # Unset max_tokens reserves what the model length leaves; the limiter caps a reservation at one
        # minute's budget and record() settles the difference once the request ends.
        decision = await self.rate_limiter.admit(
            caller, len(resolved.prompt_token_ids), resolved.n * resolved.max_new_tokens
        )
        if not decision.allowed:
            self.metrics.requests_refused.labels(reason="rate_limit").inc()
            raise StatusError(
                retry_status(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, decision.message, decision.retry_after, Reason.RATE_LIMITED
                )
            )
        return decision

    async def _run(
        self, request: generation_pb2.GenerateRequest, call: Call, caller: str, span: RequestSpan
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        resolved = await self.resolve(request)
        backend = self._pick(resolved.prompt_token_ids)
        charged = await self._rate_limit(caller, resolved)
        used = len(resolved.prompt_token_ids)
        ids = call.ids
        request_ids = [ids.internal] if resolved.n == 1 else [f"{ids.internal}.{i}" for i in range(resolved.n)]
        # Every sample's scheduler spans are children of this request's generate span.
        traceparent = span.context.traceparent
        submissions = [self._submission(rid, resolved, i, call, traceparent) for i, rid in enumerate(request_ids)]
        log.info(
            "generate",
            input=resolved.input_kind,
            prompt_tokens=len(resolved.prompt_token_ids),
            n=resolved.n,
            scheduler=backend.address,
            client=call.client,
        )
        timer = self.metrics.request(resolved.n, resolved.max_new_tokens, len(resolved.prompt_token_ids))
        annotate_call(request_id=ids.internal, prompt_tokens=len(resolved.prompt_token_ids))
        samples = [
            _Sample(i, s.request_id, backend.stream.submit(s), self._output(resolved, i))
            for i, s in enumerate(submissions)
        ]
        first, failed = True, False
        finish_reasons: list[str] = []
        try:
            async with contextlib.aclosing(_events(samples)) as events:
                async for sample, event in events:
                    if event.HasField("error"):
                        failed = True
                        raise StatusError(request_error_status(event.error))
                    out = sample.output.process(event.tokens)
                    if out.stopped_by_string:
                        backend.stream.abort(sample.request_id)
                    if first:
                        out.response.request_id = ids.public
                        first = False
                    timer.tokens_sent(sample.index, len(out.response.token_ids))
                    used += len(out.response.token_ids)
                    if out.final:
                        sample.done = True
                        finish_reasons.append(self._finished(timer, out.response))
                    yield out.response
            timer.finished()
        finally:
            completion_tokens = used - len(resolved.prompt_token_ids)
            annotate_call(completion_tokens=completion_tokens)
            unfinished = [s for s in samples if not s.done]
            for sample in unfinished:
                # The client went away, was too slow, or the request failed: free its slot and KV blocks.
                backend.stream.abort(sample.request_id)
            cancelled = bool(unfinished) and not failed
            if cancelled:
                self.metrics.requests_cancelled.inc()
                log.info("request cancelled", unfinished_samples=len(unfinished))
            if span.recording:
                span.set_attributes(
                    {
                        "meshserve.n": resolved.n,
                        "gen_ai.usage.input_tokens": len(resolved.prompt_token_ids),
                        "gen_ai.usage.output_tokens": completion_tokens,
                        "gen_ai.response.finish_reasons": finish_reasons,
                        "meshserve.cancelled": cancelled,
                    }
                )
            if charged is not None and self.rate_limiter is not None:
                await self.rate_limiter.record(caller, charged.correction(used))

    def _output(self, resolved: ResolvedRequest, index: int) -> OutputProcessor:
        return OutputProcessor(self.tokenizer, resolved.prompt_token_ids, resolved.sampling, index)

    def _finished(self, timer: RequestTimer, response: generation_pb2.GenerateResponse) -> str:
        """Count and log one sample's end; returns its finish reason's name."""
        timer.sample_finished(response.index, response.finish_reason, response.usage)
        reason = sampling_pb2.FinishReason.Name(response.finish_reason)
        log.info(
            "finished",
            index=response.index,
            finish_reason=reason,
            completion_tokens=response.usage.completion_tokens,
            cached_tokens=response.usage.cached_tokens,
        )
        return reason


async def _events(samples: list[_Sample]) -> AsyncGenerator[tuple[_Sample, scheduler_pb2.RequestEvent], None]:
    """Each sample's events until it ends, merged in arrival order (one sample: plain awaits, no tasks)."""
    if len(samples) == 1:
        sample = samples[0]
        while not sample.done:
            yield sample, await sample.events.get()
        return
    pending: dict[asyncio.Future[scheduler_pb2.RequestEvent], _Sample] = {
        asyncio.ensure_future(s.events.get()): s for s in samples
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index):
                sample = pending.pop(future)
                yield sample, future.result()
                if not sample.done:
                    pending[asyncio.ensure_future(sample.events.get())] = sample
    finally:
        for future in pending:
            future.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)
