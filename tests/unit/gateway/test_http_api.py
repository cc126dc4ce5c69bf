"""The OpenAI-compatible HTTP front in-process, on a real uvicorn port, in front of fake schedulers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from services.common.proto.meshserve.v1 import scheduler_pb2
from services.gateway.http.app import ClientTooSlow, _Writer, create_app
from services.gateway.http.http_server import HttpServer
from services.gateway.http.openai_convert import FieldNames, chat_job, completion_job
from services.gateway.http.openai_schemas import ChatCompletionRequest, CompletionRequest, load_body
from services.gateway.server import Gateway
from services.gateway.tokenizer import TextTokenizer
from tests.unit.gateway import build_tiny_model_dir
from tests.unit.gateway.fake_scheduler import Behaviour, FakeScheduler, ready_info, running_gateway, tokens

MODEL = "tiny"  # what ready_info() reports


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    return TextTokenizer.from_dir(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def letters(tok: TextTokenizer) -> list[int]:
    """Ids that decode to one ASCII letter each, so every streamed response carries text."""
    ids = [i for i in range(3, 400) if len(tok.decode([i])) == 1 and tok.decode([i]).isascii()]
    return [i for i in ids if tok.decode([i]).isalpha()][:20]


def spelling(ids: list[int], delay: float = 0.0) -> Behaviour:
    """max_tokens (4 when unset; forever from 1000 on) events of one id each from `ids`, with logprobs if asked."""

    async def behaviour(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        sampling = submit.sampling
        n = sampling.max_tokens if sampling.HasField("max_tokens") else 4
        i = 0
        while n >= 1000 or i < n:
            await asyncio.sleep(delay)
            event = tokens(submit.request_id, [ids[i % len(ids)]], final=i == n - 1).tokens
            if sampling.logprobs:
                event.logprobs.append(-0.25 * (i + 1))
            if sampling.top_logprobs:
                alternatives = [ids[(i + k) % len(ids)] for k in range(sampling.top_logprobs)]
                event.top_logprobs.add(
                    token_ids=alternatives, logprobs=[-0.25 * (i + 1) - k for k in range(len(alternatives))]
                )
            if i == 0:
                event.num_cached_tokens = 2
            yield scheduler_pb2.RequestEvent(request_id=submit.request_id, tokens=event)
            i += 1

    return behaviour


@contextlib.asynccontextmanager
async def http_gateway(
    tok: TextTokenizer, fake: FakeScheduler, **settings: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    async with running_gateway(tok, [fake], http_port=0, **settings) as gateway:
        assert gateway.http_port
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=20) as client:
            yield gateway, client


def _openai(gateway: Gateway, **kwargs: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.http_port}/v1", api_key="x", max_retries=0, **kwargs)


def _events(body: str) -> list[Any]:
    """The data of each server-sent event ("[DONE]" kept as is)."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert not block.strip(), block
    return out


async def _until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


async def test_completion_chat_and_models_through_the_openai_client(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters))
    async with http_gateway(tok, fake) as (gateway, _):
        client = _openai(gateway)
        completion = await client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, seed=7)
        assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
        assert completion.model == MODEL
        [choice] = completion.choices
        assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
        assert choice.text == tok.decode(letters[:3])
        prompt_tokens = len(tok.encode("Hello world"))
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 3)
        assert completion.usage.total_tokens == prompt_tokens + 3
        assert completion.usage.prompt_tokens_details is not None
        assert completion.usage.prompt_tokens_details.cached_tokens == 2
        sent = fake.submits[-1]
        assert sent.sampling.max_tokens == 3 and sent.sampling.seed == 7
        assert list(sent.prompt_token_ids) == tok.encode("Hello world")

        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
            ],
            max_completion_tokens=2,
        )
        assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
        [answer] = chat.choices
        assert answer.message.role == "assistant" and answer.message.content == tok.decode(letters[:2])
        assert answer.finish_reason == "length"
        rendered = tok.encode_chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
        )
        assert list(fake.submits[-1].prompt_token_ids) == rendered
        assert fake.submits[-1].sampling.max_tokens == 2

        # No model named: the served one answers, under its name.
        unnamed = await gateway_post(gateway, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
        assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL

        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert models.data[0].owned_by == "meshserve"
        assert models.data[0].model_extra is not None and models.data[0].model_extra["max_model_len"] == 256

        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
        assert info.value.status_code == 404 and "gpt-4" in info.value.message
        assert info.value.type == "NotFoundError"


async def gateway_post(gateway: Gateway, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=20) as client:
        return await client.post(path, json=body, **kwargs)


async def test_streams_with_usage_and_the_chat_role_first(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters))
    async with http_gateway(tok, fake) as (gateway, http):
        client = _openai(gateway)
        stream = await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert all(c.object == "text_completion" for c in chunks)
        *texts, last = chunks
        assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 4
        assert all(c.usage is None for c in texts)
        assert "".join(c.choices[0].text for c in texts) == tok.decode(letters[:4])
        assert [c.choices[0].finish_reason for c in texts] == [None, None, None, "length"]

        response = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "n": 2},
            headers={"x-request-id": "client-7"},
        )
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == "client-7"
        events = _events(response.text)
        assert events[-1] == "[DONE]"
        chunks_ = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-client-7" for c in chunks_)
        assert all("usage" not in c for c in chunks_)  # not asked for
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks_ if c["choices"][0]["index"] == index]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(c["delta"].get("content", "") for c in mine) == tok.decode(letters[:3])
            assert [c["finish_reason"] for c in mine][-1] == "length"
            assert all(c["finish_reason"] is None for c in mine[:-1])


async def test_logprobs_shapes(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters))
    async with http_gateway(tok, fake) as (gateway, _):
        client = _openai(gateway)
        completion = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=2)
        assert fake.submits[-1].sampling.logprobs and fake.submits[-1].sampling.top_logprobs == 2
        lp = completion.choices[0].logprobs
        assert lp is not None
        words = [tok.decode([t]) for t in letters[:3]]
        assert lp.tokens == words
        assert lp.token_logprobs == [-0.25, -0.5, -0.75]
        assert lp.text_offset == [0, 1, 2]
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0] == {words[0]: -0.25, tok.decode([letters[1]]): -1.25}

        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, logprobs=True, top_logprobs=1
        )
        content = chat.choices[0].logprobs
        assert content is not None and content.content is not None
        first = content.content[0]
        assert (first.token, first.logprob, first.bytes) == (words[0], -0.25, list(words[0].encode()))
        assert [(t.token, t.logprob) for t in first.top_logprobs] == [(words[0], -0.25)]
        assert len(content.content) == 2

        plain = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert plain.choices[0].logprobs is None


async def test_n_and_a_list_of_prompts_run_concurrently_and_usage_sums(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters, delay=0.001))
    async with http_gateway(tok, fake) as (gateway, http):
        client = _openai(gateway)
        completion = await client.completions.create(model=MODEL, prompt=["Hello", "Hi there"], max_tokens=3, n=2)
        assert [c.index for c in completion.choices] == [0, 1, 2, 3]
        assert all(c.text == tok.decode(letters[:3]) and c.finish_reason == "length" for c in completion.choices)
        assert len(fake.submits) == 4
        assert completion.usage is not None
        assert completion.usage.prompt_tokens == len(tok.encode("Hello")) + len(tok.encode("Hi there"))
        assert completion.usage.completion_tokens == 12
        assert completion.usage.prompt_tokens_details is not None
        assert completion.usage.prompt_tokens_details.cached_tokens == 4

        response = await http.post(
            "/v1/completions",
            json={"prompt": [[5, 6], [7, 8]], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 1}},
        )
        assert response.status_code == 400 and _error(response)["param"] == "stream_options.include_usage"
        response = await http.post(
            "/v1/completions",
            json={
                "prompt": [[5, 6], [7, 8]],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = _events(response.text)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"]["prompt_tokens"] == 4 and events[-2]["usage"]["completion_tokens"] == 4
        finals = [c["choices"][0]["index"] for c in events[:-2] if c["choices"][0]["finish_reason"]]
        assert sorted(finals) == [0, 1]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "Hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["a"] * 17}, "stop"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["ok", ""]}, "stop[1]"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": ["Hi"] * 257}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", ""]}, "prompt[1]"),
        ("/v1/completions", {"prompt": [[5, 6], [5, 600]]}, "prompt[1][1]"),
        ("/v1/completions", {"prompt": [5, 2**40]}, "prompt[1]"),
        ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 257}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+", "guided_choice": ["a"]},
            "guided_choice",
        ),
    ],
)
async def test_bad_requests_answer_400_naming_the_openai_field(
    tok: TextTokenizer, path: str, body: dict[str, Any], param: str
) -> None:
    fake = FakeScheduler()
    async with http_gateway(tok, fake) as (_, http):
        response = await http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = _error(response)
        assert error["type"] == "BadRequestError" and error["param"] == param, error
        assert error["message"].startswith(f"{param}: "), error
        assert fake.submits == []


async def test_malformed_bodies_and_ids(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with http_gateway(tok, fake) as (_, http):
        for raw in (b"{", b"[1, 2]", b'{"prompt": NaN}', b"\xff\xfe", b"[" * 100_000):
            response = await http.post("/v1/completions", content=raw)
            assert response.status_code == 400, raw[:10]
            assert _error(response)["param"] is None
        response = await http.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-id": "bad id"})
        assert response.status_code == 400 and _error(response)["param"] == "x-request-id"
        assert "x-request-id" not in response.headers
        # Unknown fields are ignored, as vLLM does.
        response = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "frobnicate": 3})
        assert response.status_code == 200
        assert response.headers["x-request-id"] == fake.submits[-1].request_id
        response = await http.get("/v1/nowhere")
        assert response.status_code == 404 and _error(response)["type"] == "NotFoundError"
        response = await http.get("/v1/completions")
        assert response.status_code == 405
        assert fake.submits[-1].sampling.max_tokens == 1 and len(fake.submits) == 1


async def test_grammar_fields_become_sampling_grammar(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with http_gateway(tok, fake) as (_, http):
        messages = [{"role": "user", "content": "x"}]
        cases: list[tuple[dict[str, Any], str | None, Any]] = [
            ({"response_format": {"type": "json_object"}}, "json_object", True),
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
                "json_schema",
                schema,
            ),
            ({"guided_json": schema}, "json_schema", schema),
            ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
            ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
            ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf", 'root ::= "a"'),
            ({"response_format": {"type": "text"}}, None, None),
        ]
        for extra, kind, value in cases:
            response = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra})
            assert response.status_code == 200, response.text
            grammar = fake.submits[-1].sampling.grammar
            assert grammar.WhichOneof("kind") == kind
            if kind == "json_schema":
                assert json.loads(grammar.json_schema) == value
            elif kind == "choice":
                assert list(grammar.choice.choices) == value
            elif kind is not None:
                assert getattr(grammar, kind) == value


async def test_scheduler_errors_keep_their_status_even_when_streaming(tok: TextTokenizer, letters: list[int]) -> None:
    async def refuse(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        if submit.sampling.max_tokens == 7:
            error = scheduler_pb2.RequestError(
                code=3, message="bad", field="sampling.max_tokens", description="does not fit"
            )
        else:
            yield tokens(submit.request_id, [letters[0]])
            error = scheduler_pb2.RequestError(code=14, message="the worker failed; retry", retry_after_seconds=2)
        yield scheduler_pb2.RequestEvent(request_id=submit.request_id, error=error)

    fake = FakeScheduler(behaviour=refuse)
    async with http_gateway(tok, fake) as (_, http):
        messages = [{"role": "user", "content": "x"}]
        for stream in (False, True):
            response = await http.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_completion_tokens": 7, "stream": stream},
            )
            assert response.status_code == 400
            assert _error(response)["param"] == "max_completion_tokens"
            assert _error(response)["message"] == "max_completion_tokens: does not fit"

        # An error after the stream began arrives as an event, then [DONE].
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
        assert response.status_code == 200
        events = _events(response.text)
        assert events[0]["choices"][0]["text"] == tok.decode([letters[0]])
        assert (
            events[-2]["error"]["type"] == "ServiceUnavailableError"
            and "worker failed" in events[-2]["error"]["message"]
        )
        assert events[-1] == "[DONE]"
        # Unstreamed, the same failure is a 503 with Retry-After.
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert response.status_code == 503 and response.headers["retry-after"] == "2"


async def test_admission_refusal_is_429_with_retry_after(tok: TextTokenizer) -> None:
    release = asyncio.Event()

    async def hold(submit: scheduler_pb2.SubmitRequest) -> AsyncIterator[scheduler_pb2.RequestEvent]:
        await release.wait()
        yield tokens(submit.request_id, [7], final=True)

    fake = FakeScheduler(behaviour=hold)
    async with http_gateway(tok, fake, max_concurrent_requests=1, retry_after=2.5) as (gateway, http):
        held = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hi"}))
        await _until(lambda: len(fake.submits) == 1)
        response = await http.post("/v1/completions", json={"prompt": "Hi"})
        assert response.status_code == 429 and response.headers["retry-after"] == "3"
        error = _error(response)
        assert error["type"] == "RateLimitError" and "--max-concurrent-requests" in error["message"]
        with pytest.raises(openai.RateLimitError):
            await _openai(gateway).completions.create(model=MODEL, prompt="Hi")
        release.set()
        assert (await held).status_code == 200


async def test_disconnect_aborts_at_the_scheduler(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters, delay=0.005))
    async with http_gateway(tok, fake) as (gateway, http):
        body = {"prompt": "Hi", "max_tokens": 5000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        await _until(lambda: fake.aborted == [fake.submits[0].request_id])

        # Unstreamed: the client giving up while it waits aborts too.
        waiting = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5000}))
        await _until(lambda: len(fake.submits) == 2)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await _until(lambda: fake.aborted == [s.request_id for s in fake.submits])
        await _until(lambda: gateway.pipeline.admission.in_flight == 0)


async def test_a_good_stream_completes_while_bad_requests_fail(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters, delay=0.002))
    async with http_gateway(tok, fake) as (_, http):
        good = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 100, "stream": True})
        )
        await _until(lambda: len(fake.submits) == 1)
        for _ in range(5):
            bad = await http.post("/v1/completions", json={"prompt": "Hi", "temperature": -1})
            assert bad.status_code == 400
        events = _events((await good).text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) for e in events[:-1]) == 100


async def test_body_caps_answer_413(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake], http_port=0) as gateway:
        # Refused from the Content-Length alone, before any of the body is read.
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.http_port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (4 * 1024 * 1024 + 1)
        )
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 413")
        writer.close()

        # A chunked body is counted as it arrives.
        app = create_app(
            gateway.pipeline,
            gateway._executor,
            write_timeout=5,
            exposition=gateway.service.exposition,
            body_limit=1000,
        )
        server = HttpServer(app, "127.0.0.1", 0)
        port = await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(11):
                writer.write(b"64\r\n" + b" " * 100 + b"\r\n")
            await writer.drain()
            status = await reader.readline()
            assert status.startswith(b"HTTP/1.1 413"), status
            _, _, rest = (await reader.read(10_000)).partition(b"\r\n\r\n")
            assert json.loads(rest)["error"]["type"] == "RequestTooLargeError"
            writer.close()
        finally:
            await server.stop()
        assert fake.submits == []


async def test_health_follows_the_schedulers_and_metrics_are_exposed(tok: TextTokenizer) -> None:
    fake = FakeScheduler(info=ready_info(num_ready_workers=0))
    async with running_gateway(tok, [fake], wait_serving=False, http_port=0, api_key=["sekrit"]) as gateway:
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}", timeout=20)
        async with http:
            response = await http.get("/health")
            assert response.status_code == 503 and _error(response)["type"] == "ServiceUnavailableError"
            fake.info = ready_info()
            await _until(lambda: gateway.pool.healthy)
            assert (await http.get("/health")).status_code == 200

            # API keys guard the API, never /health or /metrics.
            response = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert response.status_code == 401 and _error(response)["type"] == "AuthenticationError"
            assert (await http.get("/v1/models")).status_code == 401
            authorized = {"authorization": "Bearer sekrit"}
            response = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=authorized)
            assert response.status_code == 200

            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
            assert re.search(r'^meshserve:requests_started_total\{model_name="[^"]+"\} 1\.0$', metrics.text, re.M)

            gateway.pipeline.draining = True
            assert (await http.get("/health")).status_code == 503
            response = await http.post("/v1/completions", json={"prompt": "Hi"}, headers=authorized)
            assert response.status_code == 503


def test_field_names_map_back_to_openai_parameters() -> None:
    completion = completion_job(load_body(b'{"prompt": ["a", "b"], "logprobs": 1}', CompletionRequest))
    fields = completion.fields
    assert fields.param("sampling.max_tokens") == "max_tokens"
    assert fields.param("sampling.top_logprobs") == "logprobs"
    assert fields.param("prompt", 1) == "prompt[1]"
    assert fields.param("sampling.logit_bias[5]") == "logit_bias[5]"
    assert fields.param("n") == "n"
    chat = chat_job(
        load_body(
            b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3, "guided_json": "{}"}',
            ChatCompletionRequest,
        )
    )
    assert chat.fields.param("sampling.max_tokens") == "max_completion_tokens"
    assert chat.fields.param("chat.messages[0].role") == "messages[0].role"
    assert chat.fields.param("chat") == "messages"
    assert chat.fields.param("sampling.grammar.json_schema") == "guided_json"
    assert FieldNames("completion", ["prompt"]).param("token_ids.ids[4]") == "prompt[4]"
    assert completion.requests[0].sampling.max_tokens == 16  # OpenAI's default for completions
    assert not chat.requests[0].sampling.logprobs
    assert chat.requests[0].sampling.max_tokens == 3


async def test_a_client_that_stops_reading_is_let_go() -> None:
    async def never(message: Any) -> None:
        await asyncio.Event().wait()

    with pytest.raises(ClientTooSlow):
        await _Writer(never, 0.05)({"type": "http.response.body", "body": b"x", "more_body": True})


async def test_large_bodies_are_parsed_off_the_loop(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters))
    async with http_gateway(tok, fake) as (gateway, http):
        submitted: list[Any] = []
        original = gateway._executor.submit

        def submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
            submitted.append(fn)
            return original(fn, *args, **kwargs)

        gateway._executor.submit = submit  # type: ignore[method-assign,assignment]
        # Token ids: the pipeline itself needs no thread, so any submit is the body's parse.
        big = await http.post("/v1/completions", json={"prompt": [5] * 40_000, "max_tokens": 1})
        assert big.status_code == 400 and _error(big)["param"] == "prompt"  # longer than max_model_len
        assert len(submitted) == 1, "a 200 KB body was parsed on the event loop"
        small = await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
        assert small.status_code == 200 and len(submitted) == 1


async def test_drain_lets_streams_finish_and_refuses_new_requests(tok: TextTokenizer, letters: list[int]) -> None:
    fake = FakeScheduler(behaviour=spelling(letters, delay=0.01))
    async with http_gateway(tok, fake, shutdown_grace_period=20.0) as (gateway, http):
        streaming = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 40, "stream": True})
        )
        await _until(lambda: len(fake.submits) == 1)
        gateway.service.request_stop()
        stopped = asyncio.create_task(gateway.run_until_stopped())
        await _until(lambda: gateway.pipeline.draining)
        refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert refused.status_code == 503 and _error(refused)["code"] == "draining"
        assert (await http.get("/health")).status_code == 503
        events = _events((await streaming).text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        await asyncio.wait_for(stopped, timeout=20)
        assert fake.aborted == []


async def test_slow_uploads_hold_a_bounded_budget_and_small_requests_still_pass(tok: TextTokenizer) -> None:
    fake = FakeScheduler()
    async with running_gateway(tok, [fake], http_port=0) as gateway:
        app = create_app(
            gateway.pipeline,
            gateway._executor,
            write_timeout=5,
            exposition=gateway.service.exposition,
            body_budget=200_000,
        )
        server = HttpServer(app, "127.0.0.1", 0)
        port = await server.start()
        slow: list[asyncio.StreamWriter] = []
        try:
            # Three uploaders announce 1 MB each and send 60 kB, then stall: 180 kB of the 200 kB budget.
            for _ in range(3):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    b"content-length: 1000000\r\n\r\n" + b" " * 60_000
                )
                await writer.drain()
                slow.append(writer)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
                # A body that does not fit what is left is refused at once, with retry advice...
                big = await client.post("/v1/completions", json={"prompt": "x" * 50_000, "max_tokens": 2})
                assert big.status_code == 429 and big.headers["retry-after"] == "1", big.text
                # ...while a small request is served: the stalled uploads hold bytes, not a queue.
                small = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
                assert small.status_code == 200, small.text
            for writer in slow:
                writer.close()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
                again = await client.post("/v1/completions", json={"prompt": "x" * 50_000, "max_tokens": 2})
                # The budget came back when they left: this body is read whole, and judged on its content.
                assert again.status_code == 400 and "--max-model-len" in again.text, again.text
        finally:
            await server.stop()
