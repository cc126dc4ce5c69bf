"""`meshserve bench --backend openai`: the workload against any OpenAI-compatible HTTP server.

Requests are streamed POSTs to /v1/completions (vLLM, llama.cpp's server, SGLang, meshserve's own HTTP
front), with the dataset's token ids as the prompt, so that every backend gets the same prompts. The
records are the gRPC runner's: one timestamp per output token, so the same summary and table compare them.

How a stream becomes a record:
- the clock starts just before the request is sent;
- a chunk carries tokens when it lists token ids (that many), has text (one), or, once a token has come,
  is a choice without text that does not finish the stream (vLLM sends those for tokens whose text is held
  back); TTFT is the first such chunk;
- the final usage chunk (stream_options.include_usage) gives the true count; tokens it counts beyond the
  chunks' share the last chunk's time, as tokens of one gRPC message share its time. Without usage, the
  chunks' count stands;
- a non-200 status, an error event, an aborted finish or a stream cut before [DONE] fail the request, with
  the server's message kept; a connection closed before any answer is tried once more (UNANSWERED_RETRIES).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from services.client.bench.datasets import BenchRequest
from services.client.bench.records import RequestRecord
from services.client.bench.runner import Send, connections_needed, drive, warm_up
from services.client.bench.sse import CompletionChunk, SSEDecoder, error_body_text, parse_event

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
CONNECT_TIMEOUT_S = 10.0
# Tries again for a request whose connection closed before any byte of an answer. llama.cpp's server closes
# kept-alive connections now and then as the next request arrives on them (about one request in twenty at
# concurrency 1 in issue 15's peer runs, "Server disconnected without sending a response"); browsers and
# urllib3 retry a request on a reused connection in that case. Once the status line has come, nothing is retried.
UNANSWERED_RETRIES = 1


def api_root(base_url: str) -> str:
    """The server's /v1 root from a base URL with or without /v1 (or /v1/completions); ValueError if not http(s)."""
    url = base_url.strip().rstrip("/")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise ValueError(f"not a URL: {base_url!r} ({err})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {base_url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"expected a URL without a query or fragment, got {base_url!r}")
    url = url.removesuffix("/completions")
    return url if url.endswith("/v1") else f"{url}/v1"


def completions_url(base_url: str) -> str:
    """Where the completions are POSTed."""
    return f"{api_root(base_url)}/completions"


def models_url(base_url: str) -> str:
    """Where the served models are listed."""
    return f"{api_root(base_url)}/models"


def make_client(connections: int) -> httpx.AsyncClient:
    """HTTP/1.1 with keep-alive and a pool of `connections` (as many as requests in flight, so none waits).

    No timeout past the connect: a long prefill under load is a measurement, not a failure (vLLM's bench
    allows hours). trust_env=False: a proxy from the environment would sit between the bench and the server.
    """
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    return httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=timeout, trust_env=False)


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET /v1/models; ConnectionError saying what went wrong otherwise."""
    url = models_url(base_url)
    hint = "(or pass --model-name)"
    try:
        response = await client.get(url, timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise ConnectionError(f"--base-url {base_url}: GET {url} failed: {type(err).__name__}: {err} {hint}") from err
    if response.status_code != 200:
        raise ConnectionError(
            f"--base-url {base_url}: GET {url} answered HTTP {response.status_code}: "
            f"{error_body_text(response.text)} {hint}"
        )
    try:
        models = response.json()["data"]
        name = models[0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConnectionError(f"--base-url {base_url}: GET {url} lists no model {hint}") from None
    if not isinstance(name, str) or not name:
        raise ConnectionError(f"--base-url {base_url}: GET {url} lists a model without an id {hint}")
    return name


def completion_payload(
    prompt: Sequence[int] | str,
    max_tokens: int,
    *,
    model: str,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed completion.

    Token ids go as a list of ints (vLLM and llama.cpp take that as `prompt`). ignore_eos is vLLM's extra
    (llama.cpp has it too; others ignore unknown fields), and min_tokens = max_tokens, which vLLM honours,
    pins the output length on servers that read one and not the other.
    """
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
        payload["min_tokens"] = max_tokens
    if seed is not None:
        payload["seed"] = seed
    return payload


def chunk_tokens(chunk: CompletionChunk, *, after_first: bool) -> int:
    """Output tokens one chunk brings (see the module's notes)."""
    if chunk.token_ids is not None:
        return len(chunk.token_ids)
    if chunk.text:
        return 1
    if chunk.has_choice and chunk.finish_reason is None and after_first:
        return 1
    return 0


def token_times(arrivals: Sequence[tuple[float, int]], completion_tokens: int | None, end: float) -> list[float]:
    """One time per output token from (chunk time, tokens in it), reconciled with the usage count if known.

    Tokens the usage counts beyond the chunks' share the last chunk's time (end's without chunks); with
    fewer, the first and last chunks' times stay, so TTFT and E2EL do not move.
    """
    times = [t for t, n in arrivals for _ in range(n)]
    if completion_tokens is None or completion_tokens == len(times):
        return times
    if completion_tokens <= 0:
        return []
    if completion_tokens < len(times):
        return [*times[: completion_tokens - 1], times[-1]]
    return times + [times[-1] if times else end] * (completion_tokens - len(times))


@dataclass
class _Stream:
    """What has been read of one stream so far."""

    arrivals: list[tuple[float, int]]
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None

    def take(self, chunk: CompletionChunk, now: float) -> None:
        if chunk.error is not None:
            self.error = chunk.error
            return
        if chunk.done:
            self.done = True
            return
        n = chunk_tokens(chunk, after_first=bool(self.arrivals))
        if n:
            self.arrivals.append((now, n))
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.completion_tokens is not None:
            self.completion_tokens = chunk.completion_tokens
        if chunk.prompt_tokens is not None:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens


def _fail(record: RequestRecord, error: str) -> RequestRecord:
    record.success = False
    record.error = error
    return record


async def _send_until_answered(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """The response once its status line has come (its body still to read). A connection closed before that
    (a kept-alive one the server dropped as this request went out) is tried UNANSWERED_RETRIES more times on
    a new one; the caller's clock keeps running from the first try."""
    for _ in range(UNANSWERED_RETRIES):
        try:
            return await client.send(request, stream=True)
        except httpx.RemoteProtocolError:
            pass
    return await client.send(request, stream=True)


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    *,
    prompt_len: int | None,
    output_len: int,
    request_id: str = "",
) -> RequestRecord:
    """POST one streamed completion and record it; errors end up in the record, never raised.

    prompt_len None (a text prompt): the server's usage.prompt_tokens stands in.
    """
    record = RequestRecord(prompt_len=prompt_len or 0, output_len=output_len, start=time.perf_counter())
    stream = _Stream(arrivals=[])
    headers = {"X-Request-Id": request_id} if request_id else {}
    request = client.build_request("POST", url, json=payload, headers=headers)
    try:
        response = await _send_until_answered(client, request)
        try:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                return _fail(record, f"HTTP {response.status_code}: {error_body_text(body)}")
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                if stream.done:
                    # Read on to the body's end (its closing chunk), so that the connection is kept alive.
                    continue
                now = time.perf_counter()
                event = decoder.feed(line)
                if event is not None:
                    stream.take(parse_event(event), now)
                if stream.error is not None:
                    break
            if stream.error is None and not stream.done and (event := decoder.flush()) is not None:
                stream.take(parse_event(event), time.perf_counter())
        finally:
            await response.aclose()
    except httpx.HTTPError as err:
        return _fail(record, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
    except Exception as err:  # one broken request must not end the whole benchmark
        return _fail(record, f"{type(err).__name__}: {err}")
    end = time.perf_counter()
    if prompt_len is None and stream.prompt_tokens is not None:
        record.prompt_len = stream.prompt_tokens
    record.cached_tokens = stream.cached_tokens or 0
    record.token_times = token_times(stream.arrivals, stream.completion_tokens, end)
    if stream.error is not None:
        return _fail(record, f"stream error: {stream.error}")
    if stream.finish_reason == "abort":
        return _fail(record, "ABORT: the server aborted the request")
    if not stream.done and stream.finish_reason is None:
        return _fail(record, "the stream ended before [DONE]")
    if not record.token_times:
        return _fail(record, "no output tokens received")
    return record


@dataclass(frozen=True)
class OpenAITarget:
    """An open connection pool to one server: its Send, the model name it is sent, and the URL."""

    send: Send
    model: str
    url: str


@asynccontextmanager
async def openai_target(
    base_url: str,
    *,
    connections: int,
    model: str | None = None,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
) -> AsyncIterator[OpenAITarget]:
    """A Send to the server at base_url for the block; model None asks GET /v1/models (ConnectionError if
    that fails)."""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    url = completions_url(base_url)
    async with make_client(connections) as client:
        name = model or await served_model(client, base_url)

        async def send(request: BenchRequest, output_len: int, request_id: str) -> RequestRecord:
            payload = completion_payload(
                request.prompt_token_ids,
                output_len,
                model=name,
                ignore_eos=ignore_eos,
                temperature=temperature,
                seed=seed,
            )
            return await send_completion(
                client, url, payload, prompt_len=len(request.prompt_token_ids), output_len=output_len,
                request_id=request_id,
            )  # fmt: skip

        yield OpenAITarget(send, name, url)


async def run_openai_conversations(
    base_url: str,
    conversations: Sequence[Sequence[BenchRequest]],
    *,
    model: str | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    num_warmups: int = 0,
    progress: bool = True,
    ignore_eos: bool = True,
    temperature: float = 0.0,
) -> tuple[list[RequestRecord], float]:
    """run_conversations' schedule against an OpenAI-compatible server: warm-ups, then the timed run."""
    connections = connections_needed(max_concurrency, len(conversations), num_warmups)
    async with openai_target(
        base_url, connections=connections, model=model, ignore_eos=ignore_eos, temperature=temperature, seed=seed
    ) as target:
        await warm_up(target.send, conversations, num_warmups, max_concurrency=max_concurrency)
        return await drive(
            target.send,
            conversations,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            seed=seed,
            progress=progress,
        )
