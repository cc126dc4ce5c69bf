"""Malformed requests over both public protocols, on the real suite with the tiny model.

CASES is the source of truth for the table of malformed requests in docs/api.md: each case is one row,
in order (test_docs_table_mirrors_the_cases keeps the two in step). Every case asserts exactly what the
running gateway answers: the gRPC code, the BadRequest field and the ErrorInfo reason, or the HTTP status,
the OpenAI error object's `param` and `code`. Then the whole batch is sent at once beside a well-behaved
greedy stream on each protocol, which must finish with the answer it gives alone; afterwards the gateway
still serves and the scheduler is idle.

Cases with `bug` set are answers that are wrong for a hostile client (a 500 for bad input): they are
strict xfails asserting the right answer, left out of the docs table, so that a fix turns them red until
the mark is removed and the row documented.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import build_request, sampling_params
from services.common.channels import insecure_channel
from services.common.errors import error_reason, field_violations, retry_delay
from services.common.grpc_server import PUBLIC_MAX_RECEIVE_MESSAGE_BYTES
from services.common.ports import free_port
from services.common.proto.meshserve.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2
from services.gateway.http.http_errors import ERROR_TYPES
from services.gateway.raw_request import encode_raw_request
from tests.support.suite import Suite, start_suite

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
TABLE_BEGIN = "<!-- malformed-requests:begin -->"
TABLE_END = "<!-- malformed-requests:end -->"

# The tiny model (tests/conftest.py): max_position_embeddings 1024, a 512-token vocabulary.
MAX_MODEL_LEN = 1024
VOCAB = 512
GOOD_KEY = "malformed-suite-key"
# A key of its own for the rate-limit test, so that exhausting it leaves GOOD_KEY's budget alone.
LIMITED_KEY = "malformed-limited-key"
# Requests per minute per key: far above what GOOD_KEY spends in this module (only requests that pass
# validation are charged), low enough that LIMITED_KEY exhausts it in well under a second.
REQUESTS_PER_MINUTE = 30
AUTH = (("authorization", f"Bearer {GOOD_KEY}"),)
HTTP_AUTH = {"authorization": f"Bearer {GOOD_KEY}"}

GOOD_PROMPT = [11, 12, 13, 14, 15]
# Long enough that the good streams are still running when the whole batch has been answered.
GOOD_TOKENS = 400
LONG_PROMPT = [20 + i % 400 for i in range(1000)]
# Over the public message cap once serialized, and over the HTTP body cap.
HUGE_TEXT = "x" * (PUBLIC_MAX_RECEIVE_MESSAGE_BYTES + 16)
# Under both caps, but more UTF-8 bytes than max_model_len tokens can hold: refused before tokenizing.
BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 80_000


def _req(
    *,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
    request_id: str = "",
    n: int | None = None,
    model: str = "",
    **sampling: Any,
) -> bytes:
    request = build_request(
        prompt=prompt,
        token_ids=token_ids,
        messages=messages,
        request_id=request_id,
        sampling=sampling_params(**sampling),
    )
    if n is not None:
        request.n = n
    request.model = model
    return request.SerializeToString()


def _grammar(**kind: Any) -> bytes:
    return generation_pb2.GenerateRequest(
        prompt="hi", sampling=sampling_pb2.SamplingParams(max_tokens=4, grammar=sampling_pb2.Grammar(**kind))
    ).SerializeToString()


@dataclass(frozen=True)
class GrpcCase:
    """One malformed gRPC call and the status the gateway answers it with."""

    name: str
    wrong: str
    request: bytes
    code: grpc.StatusCode
    field: str | None = None
    reason: str | None = "INVALID_FIELD"
    method: str = "Generate"
    metadata: tuple[tuple[str, str], ...] = AUTH
    bug: str | None = None

    def row(self) -> list[str]:
        return [f"gRPC `{self.method}`", self.wrong, f"`{self.code.name}`", _cell(self.field), _cell(self.reason)]


@dataclass(frozen=True)
class HttpCase:
    """One malformed HTTP request and the OpenAI error the gateway answers it with."""

    name: str
    wrong: str
    body: Any
    status: int
    param: str | None = None
    code: str | None = "invalid_field"
    path: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(HTTP_AUTH))
    bug: str | None = None

    def row(self) -> list[str]:
        return [f"HTTP `{self.method} {self.path}`", self.wrong, str(self.status), _cell(self.param), _cell(self.code)]

    def content(self) -> bytes | None:
        if self.body is None or isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


Case = GrpcCase | HttpCase


def _cell(value: str | None) -> str:
    return "—" if value is None else f"`{value}`"


INVALID = grpc.StatusCode.INVALID_ARGUMENT
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

GRPC_CASES = [
    GrpcCase("no-key", "no `authorization` metadata", _req(prompt="hi"), grpc.StatusCode.UNAUTHENTICATED,
             reason="UNAUTHENTICATED", metadata=()),
    GrpcCase("wrong-key", "`authorization: Bearer` with a key the gateway does not know", _req(prompt="hi"),
             grpc.StatusCode.UNAUTHENTICATED, reason="UNAUTHENTICATED",
             metadata=(("authorization", "Bearer not-a-key"),)),
    GrpcCase("not-protobuf", "bytes that are not a protobuf message", b"\xff\xff\xff\xff", INVALID, "request"),
    GrpcCase("no-input", "none of `prompt`, `chat`, `token_ids` set", _req(max_tokens=4), INVALID, "input"),
    GrpcCase("empty-prompt", "`prompt` set to the empty string", _req(prompt=""), INVALID, "prompt"),
    GrpcCase("utf8-prompt", "`prompt` bytes that are not UTF-8", encode_raw_request(prompt=b"caf\xc3"), INVALID,
             "prompt"),
    GrpcCase("utf8-stop", "a stop string whose bytes are not UTF-8",
             encode_raw_request(prompt="hi", sampling={"stop": [b"\xfe\xfe"]}), INVALID, "sampling.stop[0]"),
    GrpcCase("empty-token-ids", "`token_ids` set with no ids", _req(token_ids=[]), INVALID, "token_ids.ids"),
    GrpcCase("token-outside-vocab", f"token id {VOCAB} (the vocabulary is {VOCAB})", _req(token_ids=[1, VOCAB]),
             INVALID, "token_ids.ids[1]"),
    GrpcCase("prompt-too-long", f"{MAX_MODEL_LEN} token ids (max_model_len {MAX_MODEL_LEN})",
             _req(token_ids=[5] * MAX_MODEL_LEN), INVALID, "token_ids.ids"),
    GrpcCase("text-too-long", "a 3.6 MB text prompt (under the message cap, over what max_model_len can hold)",
             _req(prompt=BIG_TEXT, max_tokens=2), INVALID, "prompt"),
    GrpcCase("max-tokens-0", "`max_tokens` 0", _req(prompt="hi", max_tokens=0), INVALID, "sampling.max_tokens"),
    GrpcCase("max-tokens-past-len", f"1000 prompt tokens + `max_tokens` 100 > max_model_len {MAX_MODEL_LEN}",
             _req(token_ids=LONG_PROMPT, max_tokens=100), INVALID, "sampling.max_tokens"),
    GrpcCase("min-tokens-past-len", "`min_tokens` 2000 with `max_tokens` unset (more than fits)",
             _req(prompt="hi", min_tokens=2000), INVALID, "sampling.min_tokens"),
    GrpcCase("temperature", "`temperature` -1", _req(prompt="hi", temperature=-1.0), INVALID,
             "sampling.temperature"),
    GrpcCase("temperature-nan", "`temperature` NaN", _req(prompt="hi", temperature=float("nan")), INVALID,
             "sampling.temperature"),
    GrpcCase("top-p", "`top_p` 0", _req(prompt="hi", top_p=0.0), INVALID, "sampling.top_p"),
    GrpcCase("top-k", "`top_k` -2", _req(prompt="hi", top_k=-2), INVALID, "sampling.top_k"),
    GrpcCase("stop-count", "17 stop strings", _req(prompt="hi", stop=["x"] * 17), INVALID, "sampling.stop"),
    GrpcCase("stop-length", "a 257-character stop string", _req(prompt="hi", stop=["ok", "x" * 257]), INVALID,
             "sampling.stop[1]"),
    GrpcCase("stop-empty", "an empty stop string", _req(prompt="hi", stop=[""]), INVALID, "sampling.stop[0]"),
    GrpcCase("stop-token-count", "65 `stop_token_ids`", _req(prompt="hi", stop_token_ids=[1] * 65), INVALID,
             "sampling.stop_token_ids"),
    GrpcCase("stop-token-vocab", f"stop token id {VOCAB}", _req(prompt="hi", stop_token_ids=[2, VOCAB]), INVALID,
             "sampling.stop_token_ids[1]"),
    GrpcCase("top-logprobs-21", "`top_logprobs` 21 (with `logprobs`)",
             _req(prompt="hi", logprobs=True, top_logprobs=21), INVALID, "sampling.top_logprobs"),
    GrpcCase("top-logprobs-alone", "`top_logprobs` 2 without `logprobs`", _req(prompt="hi", top_logprobs=2),
             INVALID, "sampling.top_logprobs"),
    GrpcCase("repetition-penalty", "`repetition_penalty` 0", _req(prompt="hi", repetition_penalty=0.0), INVALID,
             "sampling.repetition_penalty"),
    GrpcCase("frequency-penalty", "`frequency_penalty` 3", _req(prompt="hi", frequency_penalty=3.0), INVALID,
             "sampling.frequency_penalty"),
    GrpcCase("presence-penalty", "`presence_penalty` -2.5", _req(prompt="hi", presence_penalty=-2.5), INVALID,
             "sampling.presence_penalty"),
    GrpcCase("min-p", "`min_p` 1.5", _req(prompt="hi", min_p=1.5), INVALID, "sampling.min_p"),
    GrpcCase("min-tokens", "`min_tokens` 5 > `max_tokens` 2", _req(prompt="hi", min_tokens=5, max_tokens=2),
             INVALID, "sampling.min_tokens"),
    GrpcCase("logit-bias-vocab", f"`logit_bias` for token id {VOCAB}", _req(prompt="hi", logit_bias={VOCAB: 1.0}),
             INVALID, f"sampling.logit_bias[{VOCAB}]"),
    GrpcCase("logit-bias-value", "`logit_bias` value 101", _req(prompt="hi", logit_bias={5: 101.0}), INVALID,
             "sampling.logit_bias[5]"),
    GrpcCase("logit-bias-count", "1025 `logit_bias` entries",
             _req(prompt="hi", logit_bias={i: 1.0 for i in range(1025)}), INVALID, "sampling.logit_bias"),
    GrpcCase("n-17", "`n` 17", _req(prompt="hi", n=17), INVALID, "n"),
    GrpcCase("n-0", "`n` 0", _req(prompt="hi", n=0), INVALID, "n"),
    GrpcCase("json-schema-text", "`grammar.json_schema` that is not JSON", _grammar(json_schema="{not json"),
             INVALID, "sampling.grammar.json_schema"),
    GrpcCase("json-schema-array", "`grammar.json_schema` a JSON array, not an object", _grammar(json_schema="[1]"),
             INVALID, "sampling.grammar.json_schema"),
    GrpcCase("json-schema-type", 'a JSON schema with `"type": "foo"`', _grammar(json_schema='{"type": "foo"}'),
             INVALID, "sampling.grammar.json_schema"),
    GrpcCase("regex", "`grammar.regex` `(` (unclosed group)", _grammar(regex="("), INVALID,
             "sampling.grammar.regex"),
    GrpcCase("ebnf", "`grammar.ebnf` without a root rule", _grammar(ebnf="start ::= \"a\""), INVALID,
             "sampling.grammar.ebnf"),
    GrpcCase("choices-empty", "`grammar.choice` with no choices", _grammar(choice=sampling_pb2.Choices()), INVALID,
             "sampling.grammar.choice.choices"),
    GrpcCase("json-object-false", "`grammar.json_object` false", _grammar(json_object=False), INVALID,
             "sampling.grammar.json_object"),
    GrpcCase("chat-empty", "`chat` with no messages", generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(), sampling=sampling_pb2.SamplingParams(max_tokens=2)).SerializeToString(),
             INVALID, "chat.messages"),
    GrpcCase("chat-role", 'chat message with role "robot"', _req(messages=[("user", "hi"), ("robot", "beep")]),
             INVALID, "chat.messages[1].role"),
    GrpcCase("chat-count", "257 chat messages", _req(messages=[("user", "hi")] * 257), INVALID, "chat.messages"),
    GrpcCase("request-id", '`request_id` "a b" (a space)', _req(prompt="hi", request_id="a b"), INVALID,
             "request_id"),
    GrpcCase("request-id-long", "`request_id` of 129 characters", _req(prompt="hi", request_id="x" * 129), INVALID,
             "request_id"),
    GrpcCase("x-request-id", '`x-request-id` metadata "no/slash"', _req(prompt="hi"), INVALID, "x-request-id",
             metadata=(*AUTH, ("x-request-id", "no/slash"))),
    GrpcCase("model", '`model` "gpt-4"', _req(prompt="hi", model="gpt-4"), grpc.StatusCode.NOT_FOUND,
             reason="MODEL_NOT_FOUND"),
    GrpcCase("complete-no-input", "`Complete` with none of the inputs set", _req(max_tokens=4), INVALID, "input",
             method="Complete"),
    GrpcCase("complete-top-p", "`Complete` with `top_p` 1.5", _req(prompt="hi", top_p=1.5), INVALID,
             "sampling.top_p", method="Complete"),
    GrpcCase("over-message-cap", "a message over the public 4 MiB cap", _req(prompt=HUGE_TEXT),
             grpc.StatusCode.RESOURCE_EXHAUSTED, reason=None),
    GrpcCase("unknown-method", "an unknown method of meshserve.v1.Generation", _req(prompt="hi"),
             grpc.StatusCode.UNIMPLEMENTED, reason=None, method="Chat"),
]  # fmt: skip

HTTP_CASES = [
    HttpCase("no-key", "no `authorization` header", {"prompt": "hi"}, 401, code="unauthenticated", headers={}),
    HttpCase("wrong-scheme", "`authorization: Basic …` instead of `Bearer`", {"prompt": "hi"}, 401,
             code="unauthenticated", headers={"authorization": "Basic Zm9vOmJhcg=="}),
    HttpCase("models-no-key", "`GET /v1/models` without a key", None, 401, code="unauthenticated",
             path="/v1/models", method="GET", headers={}),
    HttpCase("not-json", "a body that is not JSON", b"{", 400),
    HttpCase("nan", "a body with a bare `NaN`", b'{"prompt": "hi", "temperature": NaN}', 400),
    HttpCase("array-body", "a JSON array as the body", [{"prompt": "hi"}], 400),
    HttpCase("too-deep", "JSON nested 100,000 arrays deep", b"[" * 100_000, 400),
    HttpCase("missing-prompt", "no `prompt`", {"max_tokens": 4}, 400, "prompt"),
    HttpCase("prompt-number", "`prompt` a number", {"prompt": 5}, 400, "prompt"),
    HttpCase("prompt-empty-list", "`prompt` an empty list", {"prompt": []}, 400, "prompt"),
    HttpCase("prompt-token-vocab", f"`prompt` token id {VOCAB}", {"prompt": [1, VOCAB]}, 400, "prompt[1]"),
    HttpCase("prompt-token-int32", "`prompt` token id 2^40", {"prompt": [[1], [2**40]]}, 400, "prompt[1][0]"),
    HttpCase("prompt-no-ids", "`prompt` [[]] (a prompt of no token ids)", {"prompt": [[]]}, 400, "prompt[0]"),
    HttpCase("prompt-count", "257 prompts", {"prompt": ["hi"] * 257}, 400, "prompt"),
    HttpCase("big-text", "a 3.6 MB prompt (under the body cap, over what max_model_len can hold)",
             {"prompt": BIG_TEXT, "max_tokens": 2}, 400, "prompt"),
    HttpCase("max-tokens-string", '`max_tokens` "5" (a string)', {"prompt": "hi", "max_tokens": "5"}, 400,
             "max_tokens"),
    HttpCase("max-tokens-0", "`max_tokens` 0", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    HttpCase("max-tokens-int32", "`max_tokens` 2^31", {"prompt": "hi", "max_tokens": 2**31}, 400, "max_tokens"),
    HttpCase("max-tokens-past-len", f"1000 prompt tokens + `max_tokens` 100 > max_model_len {MAX_MODEL_LEN}",
             {"prompt": LONG_PROMPT, "max_tokens": 100}, 400, "max_tokens"),
    HttpCase("temperature", "`temperature` -1", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    HttpCase("temperature-string", '`temperature` "0.5" (a string)', {"prompt": "hi", "temperature": "0.5"}, 400,
             "temperature"),
    HttpCase("top-p", "`top_p` 1.5", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    HttpCase("seed", "`seed` -1", {"prompt": "hi", "seed": -1}, 400, "seed"),
    HttpCase("n-17", "`n` 17", {"prompt": "hi", "n": 17}, 400, "n"),
    HttpCase("best-of", "`best_of` 3 (not equal to `n`)", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    HttpCase("logprobs-21", "`logprobs` 21", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    HttpCase("stop-count", "17 stop strings", {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop"),
    HttpCase("stop-length", "a 257-character stop string", {"prompt": "hi", "stop": ["x" * 257]}, 400, "stop[0]"),
    HttpCase("stop-token-vocab", f"`stop_token_ids` [{VOCAB}]", {"prompt": "hi", "stop_token_ids": [VOCAB]}, 400,
             "stop_token_ids[0]"),
    HttpCase("logit-bias-key", '`logit_bias` key "abc"', {"prompt": "hi", "logit_bias": {"abc": 1}}, 400,
             "logit_bias"),
    HttpCase("logit-bias-value", "`logit_bias` value 101", {"prompt": "hi", "logit_bias": {"5": 101}}, 400,
             "logit_bias[5]"),
    HttpCase("echo", "`echo` true", {"prompt": "hi", "echo": True}, 400, "echo"),
    HttpCase("suffix", "`suffix` set", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    HttpCase("stream-options", "`stream_options` without `stream`",
             {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    HttpCase("guided-regex", "`guided_regex` `(`", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex"),
    HttpCase("guided-json-text", "`guided_json` text that is not JSON", {"prompt": "hi", "guided_json": "{nope"},
             400, "guided_json"),
    HttpCase("two-constraints", "`guided_json` and `guided_regex` together",
             {"prompt": "hi", "guided_json": {"type": "object"}, "guided_regex": "a+"}, 400, "guided_regex"),
    HttpCase("structured-choice", "`structured_outputs.choice` empty",
             {"prompt": "hi", "structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    HttpCase("model", '`model` "gpt-4"', {"prompt": "hi", "model": "gpt-4"}, 404, code="model_not_found"),
    HttpCase("stream-model", '`model` "gpt-4" with `stream` true', {"prompt": "hi", "model": "gpt-4", "stream": True},
             404, code="model_not_found"),
    HttpCase("chat-messages-empty", "`messages` empty", {"messages": []}, 400, "messages", path=CHAT),
    HttpCase("chat-messages-string", "`messages` a string", {"messages": "hi"}, 400, "messages", path=CHAT),
    HttpCase("chat-role", 'role "robot"', {"messages": [{"role": "robot", "content": "hi"}]}, 400,
             "messages[0].role", path=CHAT),
    HttpCase("chat-content-missing", "a user message without `content`", {"messages": [{"role": "user"}]}, 400,
             "messages[0].content", path=CHAT),
    HttpCase("chat-image", "an `image_url` content part",
             {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
             "messages[0].content[0].type", path=CHAT),
    HttpCase("chat-count", "257 messages", {"messages": USER * 257}, 400, "messages", path=CHAT),
    HttpCase("chat-top-logprobs", "`top_logprobs` 21 (with `logprobs`)",
             {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", path=CHAT),
    HttpCase("chat-top-logprobs-alone", "`top_logprobs` 2 without `logprobs`",
             {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", path=CHAT),
    HttpCase("chat-max-completion", "`max_completion_tokens` 2000 (past max_model_len)",
             {"messages": USER, "max_completion_tokens": 2000}, 400, "max_completion_tokens", path=CHAT),
    HttpCase("chat-tools", "`tools` set", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools",
             path=CHAT),
    HttpCase("chat-schema-not-object", "`response_format` json_schema whose `schema` is a string",
             {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, 400,
             "response_format.json_schema.schema", path=CHAT),
    HttpCase("chat-schema-missing", "`response_format` json_schema without `schema`",
             {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
             "response_format.json_schema.schema", path=CHAT),
    HttpCase("chat-schema-bad", 'a `response_format` schema with `"type": "foo"`',
             {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
             400, "response_format", path=CHAT),
    HttpCase("chat-format-type", '`response_format` type "xml"', {"messages": USER, "response_format": {"type": "xml"}},
             400, "response_format.type", path=CHAT),
    HttpCase("x-request-id", '`x-request-id` header "a b" (a space)', {"prompt": "hi"}, 400, "x-request-id",
             headers={**HTTP_AUTH, "x-request-id": "a b"}),
    HttpCase("body-too-large", "a body over 4 MiB", {"prompt": HUGE_TEXT}, 413, code="request_too_large"),
    HttpCase("get-completions", "`GET /v1/completions`", None, 405, code=None, method="GET"),
    HttpCase("unknown-path", "an unknown path", {"prompt": "hi"}, 404, code=None, path="/v1/embeddings"),
    # A JSON escape of a lone surrogate decodes to a str that protobuf cannot encode.
    HttpCase("surrogate-prompt", "`prompt` with a lone surrogate escape", b'{"prompt": "\\ud800"}', 400, "prompt"),
    HttpCase("surrogate-stop", "a stop string with a lone surrogate escape", b'{"prompt": "hi", "stop": ["\\udfff"]}',
             400, "stop[0]"),
    HttpCase("surrogate-chat", "chat content with a lone surrogate escape",
             b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0].content", path=CHAT),
    HttpCase("logit-bias-loose-key", '`logit_bias` key "5_0" (not plain digits)',
             {"prompt": "hi", "logit_bias": {"5_0": 1}}, 400, "logit_bias"),
]  # fmt: skip

CASES: list[Case] = [*GRPC_CASES, *HTTP_CASES]
DOCUMENTED: list[Case] = [c for c in CASES if c.bug is None]


def _params(cases: Sequence[Case]) -> list[Any]:
    """One pytest param per case; a known-wrong answer is a strict xfail asserting the right one."""
    return [
        pytest.param(c, id=c.name, marks=[pytest.mark.xfail(reason=c.bug, strict=True)] if c.bug else []) for c in cases
    ]


@dataclass
class Endpoints:
    suite: Suite
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def endpoints(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    port = free_port()
    suite = start_suite(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        worker_args=["--kv-cache-memory", "64MiB"],
        gateway_args=[
            "--http-port", str(port),
            "--api-key", GOOD_KEY,
            "--api-key", LIMITED_KEY,
            "--rate-limit-requests-per-minute", str(REQUESTS_PER_MINUTE),
        ],
    )  # fmt: skip
    yield Endpoints(suite, port)
    suite.stop()


# Sending and checking.


async def grpc_error(channel: grpc.aio.Channel, case: GrpcCase) -> grpc.aio.AioRpcError | None:
    """Send the case's bytes as they are; the error it ended with, or None when it was answered."""
    method = f"/meshserve.v1.Generation/{case.method}"
    try:
        if case.method == "Complete":
            complete = channel.unary_unary(
                method,
                request_serializer=lambda b: b,
                response_deserializer=generation_pb2.CompleteResponse.FromString,
            )
            await complete(case.request, metadata=case.metadata, timeout=120)
        else:
            generate = channel.unary_stream(
                method,
                request_serializer=lambda b: b,
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            async for _ in generate(case.request, metadata=case.metadata, timeout=120):
                pass
    except grpc.aio.AioRpcError as err:
        return err
    return None


def check_grpc(case: GrpcCase, err: grpc.aio.AioRpcError | None) -> None:
    assert err is not None, f"{case.name}: the gateway accepted it"
    details = err.details() or ""
    assert err.code() == case.code, f"{case.name}: {err.code().name} {details!r}"
    violations = field_violations(err)
    assert [f for f, _ in violations] == ([case.field] if case.field else []), f"{case.name}: {violations}"
    if case.field is not None:
        assert details.startswith(f"{case.field}: "), f"the message must name the field: {details!r}"
        assert violations[0][1], "the violation must say what is wrong"
    assert error_reason(err) == case.reason, f"{case.name}: reason {error_reason(err)!r}, {details!r}"
    assert details, "every error has a message"


async def http_answer(http: httpx.AsyncClient, case: HttpCase) -> httpx.Response:
    return await http.request(case.method, case.path, content=case.content(), headers=case.headers)


def check_http(case: HttpCase, response: httpx.Response) -> None:
    text = response.text[:300]
    assert response.status_code == case.status, f"{case.name}: {response.status_code} {text}"
    assert response.headers["content-type"] == "application/json", text
    body = response.json()
    assert set(body) == {"error"}, text
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, text
    assert error["type"] == ERROR_TYPES[case.status], text
    assert error["param"] == case.param, f"{case.name}: param {error['param']!r}: {text}"
    assert error["code"] == case.code, f"{case.name}: code {error['code']!r}: {text}"
    assert isinstance(error["message"], str) and error["message"], text
    if case.param is not None:
        assert error["message"].startswith(f"{case.param}: "), f"the message must name the param: {text}"


async def answer(channel: grpc.aio.Channel, http: httpx.AsyncClient, case: Case) -> None:
    """Send one case and check what came back."""
    if isinstance(case, GrpcCase):
        check_grpc(case, await grpc_error(channel, case))
    else:
        check_http(case, await http_answer(http, case))


def _http(endpoints: Endpoints) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=endpoints.base_url, timeout=120)


# The cases one by one.


@pytest.mark.parametrize("case", _params(GRPC_CASES))
async def test_grpc_malformed(endpoints: Endpoints, case: GrpcCase) -> None:
    async with insecure_channel(endpoints.suite.address) as channel:
        check_grpc(case, await grpc_error(channel, case))


@pytest.mark.parametrize("case", _params(HTTP_CASES))
async def test_http_malformed(endpoints: Endpoints, case: HttpCase) -> None:
    async with _http(endpoints) as http:
        check_http(case, await http_answer(http, case))


# The whole batch at once, beside well-behaved streams.


def _good_grpc_request() -> generation_pb2.GenerateRequest:
    params = sampling_params(max_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True)
    return build_request(token_ids=GOOD_PROMPT, sampling=params)


GOOD_HTTP_BODY = {
    "prompt": GOOD_PROMPT,
    "max_tokens": GOOD_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass
class GoodAnswer:
    """What a good stream received, and when it ended (not part of the comparison)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | int | None = None
    completion_tokens: int = 0
    finished_at: float = field(default=0.0, compare=False)


async def good_grpc_stream(channel: grpc.aio.Channel, started: asyncio.Event) -> GoodAnswer:
    out = GoodAnswer()
    call = generation_pb2_grpc.GenerationStub(channel).Generate(_good_grpc_request(), metadata=AUTH, timeout=300)
    async for response in call:
        started.set()
        out.tokens.extend(response.token_ids)
        out.text += response.text
        if response.finish_reason:
            out.finish_reason = response.finish_reason
            out.completion_tokens = response.usage.completion_tokens
    out.finished_at = time.monotonic()
    return out


async def good_http_stream(http: httpx.AsyncClient, started: asyncio.Event) -> GoodAnswer:
    out = GoodAnswer()
    async with http.stream("POST", "/v1/completions", json=GOOD_HTTP_BODY, headers=HTTP_AUTH) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                out.text += choice["text"]
                if choice["finish_reason"] is not None:
                    out.finish_reason = choice["finish_reason"]
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
    out.finished_at = time.monotonic()
    return out


async def test_whole_batch_beside_good_streams(endpoints: Endpoints) -> None:
    suite = endpoints.suite
    async with insecure_channel(suite.address) as channel, _http(endpoints) as http:
        # Alone first: what the good streams answer when nothing else runs.
        alone_grpc = await good_grpc_stream(channel, asyncio.Event())
        alone_http = await good_http_stream(http, asyncio.Event())
        assert len(alone_grpc.tokens) == alone_grpc.completion_tokens == GOOD_TOKENS
        assert alone_grpc.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert alone_http.completion_tokens == GOOD_TOKENS and alone_http.finish_reason == "length"
        assert alone_http.text == alone_grpc.text, "both fronts give the same greedy answer"

        grpc_started, http_started = asyncio.Event(), asyncio.Event()
        good = [
            asyncio.create_task(good_grpc_stream(channel, grpc_started)),
            asyncio.create_task(good_http_stream(http, http_started)),
        ]
        await asyncio.wait_for(asyncio.gather(grpc_started.wait(), http_started.wait()), timeout=60)
        began = time.monotonic()
        # Every case, documented or not, at once; only the documented ones' answers are checked.
        results = await asyncio.gather(*(answer(channel, http, c) for c in CASES), return_exceptions=True)
        batch_done = time.monotonic()
        beside_grpc, beside_http = await asyncio.gather(*good)
    failures = [
        f"{case.name}: {result!r}"
        for case, result in zip(CASES, results, strict=True)
        if case.bug is None and isinstance(result, BaseException)
    ]
    assert not failures, "\n".join(failures)
    print(
        f"{len(CASES)} bad requests answered in {batch_done - began:.2f}s; the good streams ended "
        f"{beside_grpc.finished_at - batch_done:.2f}s (gRPC) and {beside_http.finished_at - batch_done:.2f}s (HTTP) "
        "after the batch"
    )
    assert beside_grpc == alone_grpc, "the bad requests changed the good gRPC stream's answer"
    assert beside_http == alone_http, "the bad requests changed the good HTTP stream's answer"
    # Both good streams were running for the whole batch.
    assert beside_grpc.finished_at > batch_done and beside_http.finished_at > batch_done

    # The gateway still serves, and nothing was left running or waiting.
    stats = await suite.wait_idle(timeout=60)
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)
    async with insecure_channel(suite.address) as channel, _http(endpoints) as http:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        health = await http.get("/health")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        short = sampling_params(max_tokens=4, temperature=0.0, ignore_eos=True)
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply_again = await stub.Complete(build_request(token_ids=GOOD_PROMPT, sampling=short), metadata=AUTH)
        assert list(reply_again.token_ids) == alone_grpc.tokens[:4]
        body = {"prompt": GOOD_PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        again = await http.post("/v1/completions", json=body, headers=HTTP_AUTH)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 4


# Rate limits, per API key, shared by both fronts.


async def test_rate_limit_over_both_fronts(endpoints: Endpoints) -> None:
    metadata = (("authorization", f"Bearer {LIMITED_KEY}"),)
    request = build_request(token_ids=[7, 8], sampling=sampling_params(max_tokens=1, temperature=0.0))
    accepted = 0
    began = time.monotonic()
    async with insecure_channel(endpoints.suite.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            for _ in range(REQUESTS_PER_MINUTE * 3):
                await stub.Complete(request, metadata=metadata, timeout=60)
                accepted += 1
    elapsed = time.monotonic() - began
    # A full bucket is a minute's budget; it refills at REQUESTS_PER_MINUTE / 60 a second.
    assert REQUESTS_PER_MINUTE <= accepted <= REQUESTS_PER_MINUTE + 1 + elapsed * REQUESTS_PER_MINUTE / 60
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert error_reason(err) == "RATE_LIMITED"
    assert field_violations(err) == []
    delay = retry_delay(err)
    assert delay is not None and 0 < delay <= 60 / REQUESTS_PER_MINUTE
    assert "--rate-limit-requests-per-minute" in (err.details() or "")
    async with _http(endpoints) as http:
        refused = await http.post(
            "/v1/completions", json={"prompt": [7, 8], "max_tokens": 1}, headers={"authorization": metadata[0][1]}
        )
        # The other key's budget is its own.
        other = await http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 1}, headers=HTTP_AUTH)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limited"
    assert refused.json()["error"]["type"] == "RateLimitError"
    assert refused.json()["error"]["param"] is None
    assert 1 <= int(refused.headers["retry-after"]) <= 60 / REQUESTS_PER_MINUTE
    assert other.status_code == 200, other.text


# The docs table.


def _render(row: list[str]) -> str:
    return "| " + " | ".join(row) + " |"


def docs_rows() -> list[str]:
    """The rows of docs/api.md's table of malformed requests, numbered as they must appear."""
    return [_render([str(i), *case.row()]) for i, case in enumerate(DOCUMENTED, 1)]


def test_docs_table_mirrors_the_cases() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert TABLE_BEGIN in text and TABLE_END in text, f"{DOC} lost its table markers"
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert rows == docs_rows(), "docs/api.md's table differs from CASES: regenerate it from docs_rows()"
    grpc_rows = sum(isinstance(c, GrpcCase) for c in DOCUMENTED)
    assert grpc_rows >= 15 and len(DOCUMENTED) - grpc_rows >= 15
