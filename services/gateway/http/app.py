"""The OpenAI-compatible HTTP routes over the GenerationPipeline (the same one the gRPC servicer adapts).

POST /v1/completions and /v1/chat/completions, GET /v1/models, /health and /metrics. A generation
route reads the body (capped, and timed), parses and converts it (on the executor when it is large),
then answers with a _Run: it iterates the pipeline while it watches for the client's disconnect
(which cancels the run, and so aborts every sample), and sends the status line only once the
pipeline produced its first response, so that errors the scheduler reports first still get a 4xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from services.common.errors import StatusError
from services.common.grpc_server import PUBLIC_MAX_RECEIVE_MESSAGE_BYTES
from services.common.metrics.exposition import CONTENT_TYPE, Exposition
from services.common.proto.meshserve.v1 import generation_pb2
from services.common.request_context import METADATA_KEY, check_request_id, new_request_id
from services.common.sampling_checks import InvalidField
from services.common.tracing import trace_context_from
from services.gateway.admission import client_key
from services.gateway.http.fanout import PromptFailed, merged
from services.gateway.http.http_errors import OpenAIError, from_invalid_field, from_status, internal_error
from services.gateway.http.openai_convert import Job, chat_job, completion_job
from services.gateway.http.openai_responses import DONE, Answer, TokenTexts, sse
from services.gateway.http.openai_schemas import ChatCompletionRequest, CompletionRequest, _Body, load_body
from services.gateway.pipeline import NO_SCHEDULER, Call, GenerationPipeline
from services.gateway.request_ids import RequestIds

log = structlog.get_logger()

# Seconds a client may take to send its whole body (a slow sender otherwise holds a connection forever).
BODY_READ_TIMEOUT_S = 30.0
# Larger bodies are parsed and converted on the executor, so that one huge request never stalls the loop.
INLINE_PARSE_BYTES = 64 * 1024
# Bytes of request bodies the gateway holds at once, summed over every connection. Bodies arrive before a
# request can take an admission slot, so without a budget a flood of slow 4 MiB uploads would hold
# connections x 4 MiB. A body that does not fit is refused at once (429 with Retry-After) rather than
# queued: a queue would let a few slow uploaders stall every small request behind them.
BODY_BUDGET_BYTES = 256 * 1024 * 1024


class BodyBudget:
    """Counts the body bytes held; take() refuses what would pass the budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise OpenAIError(
                429,
                f"the gateway is receiving {self.limit} bytes of request bodies already; retry shortly",
                None,
                "too_many_requests",
                retry_after=1.0,
            )
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


_SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}

B = TypeVar("B", bound=_Body)


class ClientTooSlow(Exception):
    """A response waited longer than the write timeout for the client to read."""


def _peer(request: Request) -> str:
    """Admission's key for the client: its host, spelled as on the gRPC port (ipv4:10.0.0.1)."""
    client = request.client
    if client is None:
        return "unix"
    host = client.host
    return client_key(f"ipv6:[{host}]:{client.port}" if ":" in host else f"ipv4:{host}:{client.port}")


async def read_body(request: Request, limit: int, budget: BodyBudget) -> tuple[bytes, int]:
    """The whole body and the bytes it took from `budget` (the caller gives them back), refused with 413 past
    `limit` bytes: by Content-Length before reading, else while reading."""
    too_large = OpenAIError(
        413, f"the request body is larger than {limit} bytes; send a shorter prompt", None, "request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise OpenAIError(400, "the Content-Length header is not a number", None, "invalid_field")
        if int(length) > limit:
            raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                budget.take(len(chunk))
                chunks.append(chunk)
    except TimeoutError:
        budget.give(sum(len(c) for c in chunks))
        raise OpenAIError(
            408, f"the request body took more than {BODY_READ_TIMEOUT_S:g}s to arrive", None, "request_timeout"
        ) from None
    except BaseException:  # too large, over budget, the client gone: what was taken goes back
        budget.give(sum(len(c) for c in chunks))
        raise
    return b"".join(chunks), size


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body was read before, so nothing else arrives)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Writer:
    """`send` with the write timeout: a client that stops reading is let go."""

    def __init__(self, send: Send, timeout: float) -> None:
        self._send = send
        self._timeout = timeout

    async def __call__(self, message: Message) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._send(message)
        except TimeoutError:
            raise ClientTooSlow(f"a response waited {self._timeout:g}s for the client to read") from None

    async def response(self, response: Response) -> None:
        await self({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await self({"type": "http.response.body", "body": response.body})


class _Run(Response):
    """Runs one job through the pipeline and answers it, whole or streamed, as the client waits."""

    def __init__(self, api: _Api, job: Job, calls: Sequence[Call], answer: Answer, headers: dict[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self._api = api
        self._job = job
        self._calls = calls
        self._answer = answer
        self._reply_headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._run(_Writer(send, self._api.write_timeout)))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.cancelled():
            log.info("HTTP client disconnected; request aborted")
            return
        error = work.exception()
        if isinstance(error, ClientTooSlow):
            log.warning("HTTP client reads too slowly; request aborted", reason=str(error))
        elif error is not None:
            raise error  # a bug: uvicorn logs it

    def _error(self, failed: PromptFailed) -> OpenAIError:
        if isinstance(failed.error, StatusError):
            return from_status(failed.error.status, lambda f: self._job.fields.param(f, failed.index))
        log.error("HTTP request failed", exc_info=failed.error)
        return internal_error()

    async def _run(self, write: _Writer) -> None:
        events = merged(self._api.pipeline, self._job.requests, self._calls)
        async with contextlib.aclosing(events):
            if self._job.stream:
                await self._stream(events, write)
            else:
                await self._whole(events, write)

    async def _whole(
        self, events: AsyncGenerator[tuple[int, generation_pb2.GenerateResponse], None], write: _Writer
    ) -> None:
        try:
            async for prompt_index, response in events:
                self._answer.add(prompt_index, response)
        except PromptFailed as failed:
            await write.response(self._error(failed).response(self._reply_headers))
            return
        await write.response(JSONResponse(self._answer.body(), headers=self._reply_headers))

    async def _stream(
        self, events: AsyncGenerator[tuple[int, generation_pb2.GenerateResponse], None], write: _Writer
    ) -> None:
        answer = self._answer
        try:
            first = await anext(events, None)
        except PromptFailed as failed:
            await write.response(self._error(failed).response(self._reply_headers))
            return
        headers = {**self._reply_headers, **_SSE_HEADERS}
        raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        await write({"type": "http.response.start", "status": 200, "headers": raw_headers})
        chunks = answer.opening()
        if first is not None:
            chunks += answer.chunks(*first)
        await write({"type": "http.response.body", "body": b"".join(map(sse, chunks)), "more_body": True})
        try:
            async for prompt_index, response in events:
                data = b"".join(map(sse, answer.chunks(prompt_index, response)))
                if data:
                    await write({"type": "http.response.body", "body": data, "more_body": True})
        except PromptFailed as failed:
            tail = sse(self._error(failed).body())
        else:
            tail = b"".join(map(sse, answer.closing()))
        await write({"type": "http.response.body", "body": tail + DONE, "more_body": False})


class _Api:
    def __init__(
        self,
        pipeline: GenerationPipeline,
        executor: Executor,
        *,
        write_timeout: float,
        exposition: Exposition,
        body_limit: int,
        body_budget: int,
    ) -> None:
        self.pipeline = pipeline
        self.write_timeout = write_timeout
        self._executor = executor
        self._exposition = exposition
        self._body_limit = body_limit
        self._bodies = BodyBudget(body_budget)
        self._texts = TokenTexts(pipeline.tokenizer)
        self._created = int(time.time())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, completion_job, "cmpl")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat_job, "chatcmpl")

    async def _parse(self, raw: bytes, model: type[B], convert: Callable[[B], Job]) -> Job:
        def parse() -> Job:
            return convert(load_body(raw, model))

        if len(raw) <= INLINE_PARSE_BYTES:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(self._executor, parse)

    async def _generate(
        self, request: Request, model: type[B], convert: Callable[[B], Job], id_prefix: str
    ) -> Response:
        client_id = request.headers.get(METADATA_KEY)
        headers: dict[str, str] = {}
        try:
            self.pipeline.refuse_if_draining()
            authorization = request.headers.get("authorization")
            self.pipeline.authenticate(authorization)
            if client_id is not None:
                check_request_id(client_id, METADATA_KEY)
                headers[METADATA_KEY] = client_id
            raw, held = await read_body(request, self._body_limit, self._bodies)
            try:
                job = await self._parse(raw, model, convert)
            finally:
                del raw
                self._bodies.give(held)
        except InvalidField as err:
            self.pipeline.metrics.requests_rejected.inc()
            return from_invalid_field(err).response(headers)
        except StatusError as err:
            return from_status(err.status).response(headers)
        except OpenAIError as err:
            return err.response(headers)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        ids = [RequestIds(new_request_id(), client_id) for _ in job.requests]
        public = client_id or ids[0].internal
        headers[METADATA_KEY] = public
        peer = _peer(request)
        # Each prompt's generate span is a child of the client's traceparent header (ignored when invalid).
        trace = trace_context_from(request.headers)
        calls = [Call(ids=i, client=peer, authorization=authorization, trace=trace) for i in ids]
        model_name = job.model or next(iter(self.pipeline.model_names()), "")
        answer = Answer(job, self._texts, f"{id_prefix}-{public}", model_name, int(time.time()))
        return _Run(self, job, calls, answer, headers)

    async def models(self, request: Request) -> Response:
        try:
            self.pipeline.authenticate(request.headers.get("authorization"))
        except StatusError as err:
            return from_status(err.status).response()
        limits = self.pipeline.pool.limits()
        data = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "meshserve",
                "root": name,
                "parent": None,
                "max_model_len": limits.max_model_len if limits is not None else None,
            }
            for name in self.pipeline.model_names()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if self.pipeline.draining:
            return OpenAIError(503, "gateway is draining", None, "draining").response()
        if not self.pipeline.pool.healthy:
            return OpenAIError(503, NO_SCHEDULER, None, "no_ready_worker").response()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(self._exposition.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return OpenAIError(exc.status_code, str(exc.detail)).response(dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return internal_error().response()


def create_app(
    pipeline: GenerationPipeline,
    executor: Executor,
    *,
    write_timeout: float,
    exposition: Exposition,
    body_limit: int = PUBLIC_MAX_RECEIVE_MESSAGE_BYTES,
    body_budget: int = BODY_BUDGET_BYTES,
) -> Starlette:
    """The ASGI app of the OpenAI front; `exposition` is what the gateway's metrics port serves too."""
    api = _Api(
        pipeline,
        executor,
        write_timeout=write_timeout,
        exposition=exposition,
        body_limit=body_limit,
        body_budget=body_budget,
    )
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    handlers: dict[Any, Any] = {HTTPException: _http_error, Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers)
