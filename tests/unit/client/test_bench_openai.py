"""`meshserve bench --backend openai` and vLLM's bench flags: SSE parsing, records from a fake OpenAI-compatible
server (a few lines of asyncio HTTP/1.1 with chunked SSE bodies, written here), flag aliases, percentiles and
--random-range-ratio."""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.client.bench import command
from services.client.bench.datasets import BenchRequest, random_dataset, ratio_range, single_turns
from services.client.bench.metrics import summarize
from services.client.bench.openai_backend import (
    api_root,
    chunk_tokens,
    completion_payload,
    completions_url,
    make_client,
    models_url,
    run_openai_conversations,
    send_completion,
    token_times,
)
from services.client.bench.records import RequestRecord
from services.client.bench.report import format_summary, print_summary
from services.client.bench.runner import WarmupError
from services.client.bench.sse import CompletionChunk, SSEDecoder, SSEEvent, error_body_text, parse_event
from tests.unit.client.bench_cli import bench_parse_error, parse_bench, tiny_model_config

# First prompt token ids that make the fake server misbehave (or behave like a particular server).
FAIL_HTTP = 1
FAIL_STREAM = 2
NO_USAGE = 3
TWO_PER_CHUNK = 4
EMPTY_DELTAS = 5
CUT = 6
NO_DONE = 7
LLAMA_ERROR = 8
ABORT = 9
# The connection closes without an answer: when the request came on a kept-alive connection, or always.
DROP_REUSED = 10
DROP_ALWAYS = 11
MODEL = "fake/model-1"


# --- the fake server --------------------------------------------------------------------------------------


@dataclass
class FakeOpenAI:
    """/v1/models and streamed /v1/completions over keep-alive HTTP/1.1; remembers what it was sent."""

    delay: float = 0.002
    first_delay: float = 0.0
    models: list[str] = field(default_factory=lambda: [MODEL])
    payloads: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    connections: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    # Connection handlers still running, for the fixture to end.
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        served = 0
        try:
            while line := await reader.readline():
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = raw.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if not await self._respond(method, path, headers, body, writer, reused=served > 0):
                    break
                served += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.handlers.discard(task)
            writer.close()

    async def _respond(
        self, method: str, path: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter, reused: bool
    ) -> bool:
        if method == "GET" and path == "/v1/models":
            _write_json(writer, 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})
            await writer.drain()
            return True
        if method != "POST" or path != "/v1/completions":
            _write_json(writer, 404, {"detail": "Not Found"})
            await writer.drain()
            return True
        payload = json.loads(body)
        self.payloads.append(payload)
        self.headers.append(headers)
        kind = payload["prompt"][0] if isinstance(payload["prompt"], list) else 0
        if kind == DROP_ALWAYS or (kind == DROP_REUSED and reused):
            return False
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(payload, writer)
        finally:
            self.in_flight -= 1

    async def _stream(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        prompt = payload["prompt"]
        kind = prompt[0] if isinstance(prompt, list) else 0
        n = payload["max_tokens"]
        if kind == FAIL_HTTP:
            _write_json(writer, 400, {"error": {"message": "prompt too long", "type": "BadRequestError"}})
            await writer.drain()
            return True
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: keep-alive\r\n\r\n"
        )
        await asyncio.sleep(self.first_delay)

        async def event(data: str, field_name: str = "data") -> None:
            _write_chunk(writer, f"{field_name}: {data}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(self.delay)

        def choice(text: str, finish: str | None = None) -> str:
            return json.dumps({"object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                         "finish_reason": finish}]})  # fmt: skip

        _write_chunk(writer, b": keep-alive comment\n\n")
        if kind == TWO_PER_CHUNK:
            for i in range(0, n, 2):
                await event(choice(f"ab{i}", "length" if i + 2 >= n else None))
        elif kind == EMPTY_DELTAS:
            await event(choice("x"))
            for _ in range(n - 1):
                await event(choice(""))
            await event(choice("", "length"))
        else:
            for i in range(n):
                if kind == FAIL_STREAM and i == 2:
                    await event(json.dumps({"error": {"message": "engine died", "code": 500}}))
                    break
                if kind == LLAMA_ERROR and i == 1:
                    await event(json.dumps({"code": 500, "message": "slot unavailable"}), "error")
                    break
                if kind == CUT and i == 2:
                    # Close mid-body: no terminating chunk.
                    return False
                last = i == n - 1
                finish = None if not last or kind == NO_DONE else ("abort" if kind == ABORT else "length")
                await event(choice(f" t{i}", finish))
        if kind not in (NO_USAGE, NO_DONE, FAIL_STREAM, LLAMA_ERROR):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}  # fmt: skip
            await event(json.dumps({"object": "text_completion", "choices": [], "usage": usage}))
        if kind != NO_DONE:
            await event("[DONE]")
        _write_chunk(writer, b"")
        await writer.drain()
        return True


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


def _write_json(writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
    )


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, FakeOpenAI]]:
    fake = FakeOpenAI()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", fake
    srv.close()
    for task in list(fake.handlers):
        task.cancel()
    await asyncio.gather(*fake.handlers, return_exceptions=True)
    await srv.wait_closed()


def _requests(*kinds: int, n: int = 4) -> list[BenchRequest]:
    return [BenchRequest([kind, 200, 201, 202], n) for kind in kinds]


async def _run(base_url: str, requests: list[BenchRequest], **kwargs: Any) -> list[RequestRecord]:
    records, duration = await run_openai_conversations(base_url, single_turns(requests), progress=False, **kwargs)
    assert duration > 0
    return records


# --- SSE parsing ------------------------------------------------------------------------------------------


def _events(lines: list[str]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = [e for line in lines if (e := decoder.feed(line)) is not None]
    if (last := decoder.flush()) is not None:
        events.append(last)
    return events


def test_sse_decoder_follows_the_field_rules() -> None:
    lines = [": comment", "data: {\"a\": 1}", "", "", "data:no-space", "id: 7", "retry: 10", "", "event: error",
             "data: line1", "data:  line2", "", "error: {\"message\": \"x\"}", "", "data: [DONE]"]  # fmt: skip
    assert _events(lines) == [
        SSEEvent('{"a": 1}'),
        SSEEvent("no-space"),
        SSEEvent("line1\n line2", "error"),
        SSEEvent('{"message": "x"}', "error"),
        # The stream ended without a blank line: flush still hands the last event over.
        SSEEvent("[DONE]"),
    ]


def test_parse_text_usage_and_done_chunks() -> None:
    text = parse_event(SSEEvent(json.dumps({"choices": [{"index": 0, "text": "Hi", "finish_reason": None}]})))
    assert (text.text, text.has_choice, text.finish_reason, text.token_ids) == ("Hi", True, None, None)
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 3}}
    final = parse_event(SSEEvent(json.dumps({"choices": [], "usage": usage})))
    assert (final.has_choice, final.completion_tokens, final.prompt_tokens, final.cached_tokens) == (False, 9, 5, 3)
    # vLLM with return_token_ids lists each chunk's ids; chat-style deltas are read too.
    ids = parse_event(SSEEvent(json.dumps({"choices": [{"text": "", "token_ids": [4, 5], "finish_reason": "stop"}]})))
    assert (ids.token_ids, ids.finish_reason) == ([4, 5], "stop")
    assert parse_event(SSEEvent(json.dumps({"choices": [{"delta": {"content": "yo"}}]}))).text == "yo"
    assert parse_event(SSEEvent("[DONE]")).done
    assert parse_event(SSEEvent(json.dumps({"choices": [{"text": None}], "usage": None}))) == CompletionChunk(
        has_choice=True
    )


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (SSEEvent(json.dumps({"error": {"message": "engine died", "code": 500}})), "engine died"),
        (SSEEvent(json.dumps({"object": "error", "message": "old vLLM", "type": "x"})), "old vLLM"),
        (SSEEvent(json.dumps({"error": "plain"})), "plain"),
        (SSEEvent(json.dumps({"code": 500, "message": "slot unavailable"}), "error"), "slot unavailable"),
        (SSEEvent("not json", "error"), "not json"),
        (SSEEvent("{oops"), "unreadable stream event"),
        (SSEEvent("[1, 2]"), "unexpected stream event"),
    ],
)
def test_error_events_keep_the_message(event: SSEEvent, message: str) -> None:
    chunk = parse_event(event)
    assert chunk.error is not None and message in chunk.error


def test_error_bodies() -> None:
    assert error_body_text(json.dumps({"error": {"message": "too long"}})) == "too long"
    assert error_body_text(json.dumps({"detail": "Not Found"})) == "Not Found"
    assert error_body_text("<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert error_body_text("") == "(empty body)"


def test_chunk_token_counts() -> None:
    assert chunk_tokens(CompletionChunk(text="a", has_choice=True), after_first=False) == 1
    assert chunk_tokens(CompletionChunk(token_ids=[1, 2, 3], has_choice=True), after_first=False) == 3
    # An empty choice before any token (a prefill heartbeat) or one that finishes the stream brings none...
    assert chunk_tokens(CompletionChunk(has_choice=True), after_first=False) == 0
    assert chunk_tokens(CompletionChunk(has_choice=True, finish_reason="length"), after_first=True) == 0
    # ...but after the first token, an empty one is a token whose text the server holds back (vLLM).
    assert chunk_tokens(CompletionChunk(has_choice=True), after_first=True) == 1
    assert chunk_tokens(CompletionChunk(completion_tokens=5), after_first=True) == 0


def test_token_times_reconcile_with_usage() -> None:
    arrivals = [(1.0, 1), (2.0, 2), (3.0, 1)]
    assert token_times(arrivals, None, 9.0) == [1.0, 2.0, 2.0, 3.0]
    assert token_times(arrivals, 4, 9.0) == [1.0, 2.0, 2.0, 3.0]
    # More tokens than the chunks showed share the last chunk's time; TTFT and E2EL stay.
    assert token_times(arrivals, 6, 9.0) == [1.0, 2.0, 2.0, 3.0, 3.0, 3.0]
    assert token_times(arrivals, 2, 9.0) == [1.0, 3.0]
    assert token_times(arrivals, 1, 9.0) == [3.0]
    assert token_times(arrivals, 0, 9.0) == []
    assert token_times([], 2, 9.0) == [9.0, 9.0]


# --- URLs and payloads ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base",
    ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", "http://h:8000/v1/completions"],
)
def test_base_urls_with_or_without_v1(base: str) -> None:
    assert api_root(base) == "http://h:8000/v1"
    assert completions_url(base) == "http://h:8000/v1/completions"
    assert models_url(base) == "http://h:8000/v1/models"


def test_base_url_under_a_path_prefix() -> None:
    assert completions_url("https://proxy/llm") == "https://proxy/llm/v1/completions"


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://h/", "http://", "http://h:8000/?x=1", ""])
def test_bad_base_urls(bad: str) -> None:
    with pytest.raises(ValueError):
        api_root(bad)


def test_payload_asks_for_a_fixed_streamed_length() -> None:
    payload = completion_payload([5, 6, 7], 12, model="m", ignore_eos=True, temperature=0.0, seed=3)
    assert payload == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 12,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "min_tokens": 12,
        "seed": 3,
    }
    loose = completion_payload("Hello", 4, model="m", ignore_eos=False)
    assert loose["prompt"] == "Hello"
    assert not {"ignore_eos", "min_tokens", "seed"} & loose.keys()


# --- records from the fake server -------------------------------------------------------------------------


async def test_records_like_the_grpc_backend(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    fake.first_delay, fake.delay = 0.05, 0.01
    requests = [BenchRequest([100 + i] * (i + 3), i % 3 + 2) for i in range(5)]
    records = await _run(base_url, requests, seed=4)
    for record, request in zip(records, requests, strict=True):
        assert record.success, record.error
        assert record.prompt_len == len(request.prompt_token_ids)
        assert record.output_len == record.num_output_tokens == request.output_len
        assert record.cached_tokens == len(request.prompt_token_ids) // 2
        assert record.ttft >= 0.05
        assert all(gap >= 0.009 for gap in record.itls)
        assert record.token_times == sorted(record.token_times)
    # The model came from GET /v1/models; every request asked for a fixed streamed length with token ids.
    by_id = sorted(zip(fake.headers, fake.payloads, strict=True), key=lambda hp: int(hp[0]["x-request-id"][6:]))
    assert [h["x-request-id"] for h, _ in by_id] == [f"bench-{i}" for i in range(5)]
    for (_, payload), request in zip(by_id, requests, strict=True):
        assert payload["model"] == MODEL
        assert payload["prompt"] == request.prompt_token_ids
        assert payload["max_tokens"] == payload["min_tokens"] == request.output_len
        assert payload["ignore_eos"] is True and payload["stream"] is True
        assert payload["stream_options"] == {"include_usage": True}
        assert (payload["seed"], payload["temperature"]) == (4, 0.0)
    summary = summarize(records, 1.0, backend="openai")
    assert (summary.completed, summary.failed, summary.output_len_mismatches) == (5, 0, 0)
    assert summary.mean_ttft_ms >= 50


async def test_connections_are_kept_alive_and_capped(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    records = await _run(base_url, [BenchRequest([100, 101], 3)] * 12, max_concurrency=3, model="given")
    assert all(r.success for r in records)
    assert fake.max_in_flight <= 3
    # A pool as large as the concurrency, reused across the 12 requests.
    assert fake.connections <= 3
    assert {p["model"] for p in fake.payloads} == {"given"}


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        (FAIL_HTTP, "HTTP 400: prompt too long"),
        (FAIL_STREAM, "stream error: engine died"),
        (LLAMA_ERROR, "stream error: slot unavailable"),
        (ABORT, "ABORT: the server aborted the request"),
        (NO_DONE, "the stream ended before [DONE]"),
        (CUT, "RemoteProtocolError"),
    ],
)
async def test_errors_become_failed_records(server: tuple[str, FakeOpenAI], kind: int, error: str) -> None:
    base_url, _ = server
    bad, good = await _run(base_url, _requests(kind, 100))
    assert not bad.success and error in bad.error
    assert good.success and good.num_output_tokens == 4
    summary = summarize([bad, good], 1.0, backend="openai")
    assert summary.failed == 1 and any(error in e for e in summary.errors)


async def test_a_connection_closed_before_any_answer_is_tried_once_more(server: tuple[str, FakeOpenAI]) -> None:
    """The second request goes out on the first one's kept-alive connection, which the server drops unanswered
    (as llama.cpp's server sometimes does): it is sent again on a new connection and succeeds. A server that
    never answers gets two tries, and a stream cut after its status line (CUT above) none."""
    base_url, fake = server
    first, dropped = await _run(base_url, _requests(100, DROP_REUSED), max_concurrency=1)
    assert first.success and dropped.success and dropped.num_output_tokens == 4
    assert fake.connections == 2 and len(fake.payloads) == 3
    assert dropped.token_times[0] > dropped.start
    never, after = await _run(base_url, _requests(DROP_ALWAYS, 100), max_concurrency=1)
    assert not never.success and "RemoteProtocolError: Server disconnected without sending a response" in never.error
    assert after.success
    assert [p["prompt"][0] for p in fake.payloads[3:]] == [DROP_ALWAYS, DROP_ALWAYS, 100]


async def test_without_usage_the_chunks_count(server: tuple[str, FakeOpenAI]) -> None:
    base_url, _ = server
    plain, empty_deltas = await _run(base_url, _requests(NO_USAGE, EMPTY_DELTAS, n=5))
    assert plain.success and plain.num_output_tokens == 5 and plain.cached_tokens == 0
    # vLLM's empty-text chunks after the first are tokens; the closing finish chunk is not.
    assert empty_deltas.success and empty_deltas.num_output_tokens == 5


async def test_usage_corrects_multi_token_chunks(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    fake.delay = 0.01
    (record,) = await _run(base_url, _requests(TWO_PER_CHUNK, n=6))
    # Three text chunks, six tokens by the usage chunk: the extra ones share the last chunk's time.
    assert record.success and record.num_output_tokens == 6
    assert len(set(record.token_times)) == 3
    assert record.token_times[-4:] == [record.token_times[-1]] * 4


async def test_text_prompts_take_the_servers_prompt_length(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    payload = completion_payload("Hello there", 3, model=MODEL)
    async with make_client(1) as client:
        record = await send_completion(client, completions_url(base_url), payload, prompt_len=None, output_len=3)
    assert record.success and record.num_output_tokens == 3
    assert record.prompt_len == len("Hello there")
    assert fake.payloads[0]["prompt"] == "Hello there"


async def test_unreachable_server_and_missing_models(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    # No answer on /v1/models: the run cannot name a model and says so.
    with pytest.raises(ConnectionError, match="--model-name"):
        await _run("http://127.0.0.1:1", _requests(100))
    fake.models = []
    with pytest.raises(ConnectionError, match="lists no model"):
        await _run(base_url, _requests(100))
    # With a model name, every request fails on its own instead.
    records = await _run("http://127.0.0.1:1", _requests(100, 100), model="m")
    assert [r.success for r in records] == [False, False]
    assert all(r.error.startswith("ConnectError") for r in records)


async def test_warmups_go_first_and_a_failed_one_stops_the_run(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    records = await _run(base_url, _requests(100, 100), num_warmups=2)
    assert len(records) == 2 and len(fake.payloads) == 4
    assert sorted(h["x-request-id"] for h in fake.headers[:2]) == ["bench-warmup-0", "bench-warmup-1"]
    assert all(p["max_tokens"] == 2 for p in fake.payloads[:2])
    with pytest.raises(WarmupError, match="prompt too long"):
        await _run(base_url, _requests(FAIL_HTTP), num_warmups=1)


async def test_multi_turn_conversations_run_in_order(server: tuple[str, FakeOpenAI]) -> None:
    base_url, fake = server
    conversations = [[BenchRequest([100 + c] * (k + 2), 2) for k in range(3)] for c in range(2)]
    records, _ = await run_openai_conversations(base_url, conversations, progress=False)
    assert [r.prompt_len for r in records] == [2, 3, 4] * 2
    # Within a conversation, turn k+1 is sent after turn k.
    for c in range(2):
        sent = [len(p["prompt"]) for p in fake.payloads if p["prompt"][0] == 100 + c]
        assert sent == [2, 3, 4]


# --- the command ------------------------------------------------------------------------------------------


_parse = parse_bench
_parse_error = bench_parse_error


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_model_config(tmp_path)


async def test_cli_against_the_fake_server(
    server: tuple[str, FakeOpenAI], model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, fake = server
    out = tmp_path / "r.json"
    args = ["--backend", "openai", "--base-url", base_url + "/v1", "--model", str(model_dir), "--dataset-name",
            "random", "--num-prompts", "6", "--random-input-len", "10", "--random-output-len", "4",
            "--random-range-ratio", "0.5", "--max-concurrency", "2", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,90,99.9", "--num-warmups", "1", "--no-progress", "--save-result",
            str(out)]  # fmt: skip
    assert await command.main(_parse(*args)) == 0
    table = capsys.readouterr().out
    assert "Backend:                                 openai" in table
    for row in ("Mean TTFT (ms):", "Median TTFT (ms):", "P50 TTFT (ms):", "P90 TTFT (ms):", "P99.9 E2EL (ms):"):
        assert row in table
    assert "TPOT" not in table and "ITL" not in table and "P99 TTFT" not in table
    data = json.loads(out.read_text())
    assert (data["backend"], data["completed"], data["failed"]) == ("openai", 6, 0)
    assert data["output_len_mismatches"] == 0
    assert all(5 <= n <= 15 for n in data["input_lens"]) and all(2 <= n <= 6 for n in data["output_lens"])
    assert data["model_name"] == MODEL and data["base_url"] == base_url + "/v1"
    assert data["url"] == base_url + "/v1/completions"
    assert data["max_concurrency"] == 2 and data["random_range_ratio"] == 0.5
    assert data["percentile_metrics"] == ["ttft", "e2el"] and data["metric_percentiles"] == [50, 90, 99.9]
    assert data["p50_ttft_ms"] == data["median_ttft_ms"]
    assert 0 < data["p90_ttft_ms"] <= data["p99.9_ttft_ms"]
    assert "p90_e2el_ms" in data and "p90_tpot_ms" not in data
    # The timed requests carry the prompts the flags describe (the warm-up went first).
    assert fake.headers[0]["x-request-id"] == "bench-warmup-0"
    timed = {h["x-request-id"]: p for h, p in zip(fake.headers[1:], fake.payloads[1:], strict=True)}
    expected = random_dataset(6, ratio_range(10, 0.5), ratio_range(4, 0.5), 300, seed=0)
    assert [timed[f"bench-{i}"]["prompt"] for i in range(6)] == [r.prompt_token_ids for r in expected]
    assert [timed[f"bench-{i}"]["max_tokens"] for i in range(6)] == [r.output_len for r in expected]


async def test_cli_no_ignore_eos_reaches_the_payload(
    server: tuple[str, FakeOpenAI], model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_url, fake = server
    args = ["--backend", "openai", "--base-url", base_url, "--served-model-name", "x", "--model", str(model_dir),
            "--num-prompts", "2", "--random-input-len", "3", "--random-output-len", "2", "--no-ignore-eos",
            "--no-progress"]  # fmt: skip
    assert await command.main(_parse(*args)) == 0
    assert all("ignore_eos" not in p and "min_tokens" not in p and p["model"] == "x" for p in fake.payloads)


async def test_cli_unreachable_server_exits_1(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--backend", "openai", "--base-url", "http://127.0.0.1:1", "--model", str(model_dir), "--num-prompts",
            "1", "--random-input-len", "3", "--random-output-len", "2", "--no-progress"]  # fmt: skip
    assert await command.main(_parse(*args)) == 1
    assert "GET http://127.0.0.1:1/v1/models failed" in capsys.readouterr().err


def test_vllm_flag_aliases() -> None:
    ns = _parse("--dataset-name", "random", "--served-model-name", "m", "--custom-output-len", "7")
    assert (ns.dataset, ns.model_name, ns.jsonl_output_len) == ("random", "m", 7)
    assert _parse("--dataset-name", "custom").dataset == "jsonl"
    assert _parse("--dataset", "Shared-Prefix").dataset == "shared-prefix"
    assert _parse("--backend", "grpc").backend == "meshserve"
    assert _parse("--backend", "openai", "--model-name", "a").model_name == "a"
    ns = _parse("--num-prompts", "5", "--max-concurrency", "3", "--request-rate", "2", "--seed", "9")
    assert (ns.num_prompts, ns.max_concurrency, ns.request_rate, ns.seed) == (5, 3, 2.0, 9)
    defaults = _parse()
    assert defaults.ignore_eos is True and defaults.random_range_ratio == 0.0
    assert (defaults.base_url, defaults.model_name) == (None, None)
    assert defaults.percentile_metrics == ("ttft", "tpot", "itl", "e2el")
    assert defaults.metric_percentiles == (99.0,)
    assert _parse("--ignore-eos").ignore_eos is True
    assert _parse("--no-ignore-eos").ignore_eos is False


@pytest.mark.parametrize(
    ("name", "hint"),
    [("sharegpt", "--dataset jsonl"), ("prefix_repetition", "shared-prefix"), ("sonnet", "it has random")],
)
def test_other_vllm_datasets_are_refused_clearly(capsys: pytest.CaptureFixture[str], name: str, hint: str) -> None:
    err = _parse_error(capsys, "--dataset-name", name)
    assert "--dataset-name" in err and "is not a dataset of meshserve bench" in err and hint in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--backend", "vllm"), ("--random-range-ratio", "1"), ("--random-range-ratio", "-0.1"),
     ("--random-range-ratio", "x"), ("--percentile-metrics", "ttft,latency"), ("--percentile-metrics", ","),
     ("--metric-percentiles", "50,101"), ("--metric-percentiles", "p99"), ("--metric-percentiles", "nan")],
)  # fmt: skip
def test_bad_vllm_flag_values_name_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert flag in _parse_error(capsys, f"{flag}={value}")


def test_percentile_flags_parse() -> None:
    ns = _parse("--percentile-metrics", "TTFT, itl,ttft", "--metric-percentiles", "50, 90,99,99.9,50")
    assert ns.percentile_metrics == ("ttft", "itl")
    assert ns.metric_percentiles == (50.0, 90.0, 99.0, 99.9)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--base-url", "http://h:1"], "--base-url needs --backend openai"),
        (["--model-name", "m", "--backend", "grpc"], "--model-name needs --backend openai"),
        (["--backend", "openai", "--base-url", "h:1"], "--base-url: expected an http:// or https:// URL"),
        (["--random-range-ratio", "0.2", "--random-input-len", "5-9"], "--random-input-len 5-9 is already a range"),
        (["--random-range-ratio", "0.2", "--dataset", "shared-prefix"], "applies to --dataset random"),
        (["--dataset", "multi-turn", "--backend", "raw-runner"], "needs --backend meshserve or openai"),
    ],
)
async def test_bad_combinations_exit_2(
    capsys: pytest.CaptureFixture[str], model_dir: Path, args: list[str], message: str
) -> None:
    assert await command.main(_parse("--model", str(model_dir), "--no-progress", *args)) == 2
    assert message in capsys.readouterr().err


# --- range ratio and percentiles --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "ratio", "bounds"),
    [(100, 0.0, (100, 100)), (100, 0.1, (90, 110)), (1024, 0.25, (768, 1280)), (10, 0.55, (4, 16)),
     (7, 0.3, (4, 10)), (1, 0.9, (1, 2)), (3, 0.99, (1, 6))],
)  # fmt: skip
def test_ratio_range_bounds(length: int, ratio: float, bounds: tuple[int, int]) -> None:
    assert ratio_range(length, ratio) == bounds


def test_ratio_range_rejects_bad_values() -> None:
    for length, ratio in ((0, 0.1), (10, 1.0), (10, -0.1), (10, math.nan)):
        with pytest.raises(ValueError):
            ratio_range(length, ratio)


def test_range_ratio_draws_lengths_within_vllms_bounds(model_dir: Path) -> None:
    ns = _parse("--model", str(model_dir), "--num-prompts", "400", "--random-input-len", "20",
                "--random-output-len", "10", "--random-range-ratio", "0.5")  # fmt: skip
    requests = command.build_workload(ns, model_dir)
    inputs = {len(r.prompt_token_ids) for r in requests}
    outputs = {r.output_len for r in requests}
    # Uniform over the whole inclusive range: both ends are drawn, nothing outside.
    assert inputs == set(range(10, 31)) and outputs == set(range(5, 16))
    ns = _parse("--model", str(model_dir), "--num-prompts", "5", "--random-input-len", "20")
    assert {len(r.prompt_token_ids) for r in command.build_workload(ns, model_dir)} == {20}


def _records() -> list[RequestRecord]:
    # TTFTs 0.1 .. 1.0 s; two tokens each, 0.1 s apart.
    return [RequestRecord(4, 2, 0.0, [0.1 * i, 0.1 * i + 0.1]) for i in range(1, 11)]


def test_summary_holds_the_chosen_percentiles() -> None:
    s = summarize(_records(), 1.0, backend="openai", percentile_metrics=("ttft", "tpot"), metric_percentiles=(50, 90))
    assert s.percentile_ms("ttft", 50) == pytest.approx(s.median_ttft_ms)
    assert s.percentile_ms("ttft", 90) == pytest.approx(910.0)
    assert s.percentile_ms("tpot", 90) == pytest.approx(100.0)
    with pytest.raises(KeyError):
        s.percentile_ms("e2el", 90)
    data = s.to_dict()
    assert data["p90_ttft_ms"] == pytest.approx(910.0) and "p90_e2el_ms" not in data
    assert "percentiles_ms" not in data
    # The fixed mean/median/p99 fields stay whatever was chosen.
    assert data["p99_e2el_ms"] == pytest.approx(1091.0)
    table = format_summary(s)
    assert "P90 TTFT (ms):                           910.00" in table
    assert "P50 TPOT (ms):" in table and "E2EL" not in table and "P99" not in table
    out = io.StringIO()
    print_summary(s, out)
    assert "Inter-token Latency" not in out.getvalue()


def test_summary_percentiles_without_samples_are_zero() -> None:
    s = summarize([], 0.0, backend="openai", metric_percentiles=(90,))
    assert s.percentile_ms("itl", 90) == 0.0


def test_summary_rejects_unknown_percentile_choices() -> None:
    with pytest.raises(ValueError):
        summarize(_records(), 1.0, backend="m", percentile_metrics=("latency",))
    with pytest.raises(ValueError):
        summarize(_records(), 1.0, backend="m", metric_percentiles=(120,))
