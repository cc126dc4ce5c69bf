"""The OpenAI request bodies the HTTP front accepts (/v1/completions, /v1/chat/completions), with vLLM's extras.

Types are strict (a "0.5" is not a temperature) and unknown fields are ignored, as vLLM does by default.
load_body parses the JSON, checks the counts of the lists whose size drives later work before anything
walks them, and validates; every failure is an InvalidField naming the OpenAI field ("" for the body as
a whole). Ranges beyond what the protobuf fields can hold are refused here; everything else (n, stop
strings, penalties, grammar caps...) is left to the pipeline's own validation, so both fronts agree.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from services.common.sampling_checks import (
    MAX_CHAT_MESSAGES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    InvalidField,
    check_count,
)

# Prompts in one /v1/completions request: each is a request of its own (times n) on the schedulers.
MAX_PROMPTS = 256

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
NonNegativeInt32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=0, le=2**64 - 1)]


def _one_of(description: str) -> WrapValidator:
    """Collapse a union's per-member errors into one that says what the field may be."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_type", f"must be {description}") from None

    return WrapValidator(validate)


Prompt = Annotated[
    str | list[str] | list[int] | list[list[int]],
    _one_of("a string, a list of strings, a list of token ids or a list of lists of token ids"),
]
Stop = Annotated[str | list[str], _one_of("a string or a list of strings")]
JsonSchemaText = Annotated[str | dict[str, Any], _one_of("a JSON schema, as an object or as JSON text")]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: at most one of these."""

    json_: JsonSchemaText | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Body):
    """What both endpoints share: the model, OpenAI's sampling fields, vLLM's extras and streaming."""

    model: str | None = None
    n: NonNegativeInt32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extras.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int32] | None = None
    ignore_eos: bool = False
    min_tokens: Int32 | None = None
    skip_special_tokens: bool | None = None
    guided_json: JsonSchemaText | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_Sampling):
    prompt: Prompt
    # OpenAI's default for /v1/completions (and vLLM's); null: as many as the model length leaves.
    max_tokens: Int32 | None = 16
    logprobs: NonNegativeInt32 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: NonNegativeInt32 | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


Content = Annotated[str | list[ContentPart], _one_of("a string or a list of content parts")]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: Content | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt32 | None = None
    tools: list[Any] | None = None


B = TypeVar("B", bound=_Body)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _check_counts(body: dict[str, Any]) -> None:
    """Counts of the lists whose size drives later work, before anything walks them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        check_count(len(prompt), MAX_PROMPTS, "prompt", "prompts")
    messages = body.get("messages")
    if isinstance(messages, list):
        check_count(len(messages), MAX_CHAT_MESSAGES, "messages", "chat messages")
    stop = body.get("stop")
    if isinstance(stop, list):
        check_count(len(stop), MAX_STOP_STRINGS, "stop", "stop strings")
    stop_ids = body.get("stop_token_ids")
    if isinstance(stop_ids, list):
        check_count(len(stop_ids), MAX_STOP_TOKEN_IDS, "stop_token_ids", "stop token ids")
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        check_count(len(bias), MAX_LOGIT_BIAS_ENTRIES, "logit_bias", "logit_bias entries")


def field_path(loc: tuple[int | str, ...]) -> str:
    """("messages", 2, "content") -> "messages[2].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# A \uD800-\uDFFF escape: JSON allows it, but alone (not as half of a pair) it is no character, and the text
# cannot be encoded as UTF-8 for the tokenizer or the protobuf messages.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _check_no_lone_surrogates(value: object, path: str) -> None:
    """InvalidField naming the first string holding a lone surrogate (only walked when the body has one)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidField(
                path, "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text; send valid Unicode"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_no_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_no_lone_surrogates(item, f"{path}[{i}]")


def load_body(raw: bytes, model: type[B]) -> B:
    """Parse and validate one request body; InvalidField names the first bad field ("" for the body)."""
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:
        raise InvalidField("", "the body nests too deeply to be a request") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError among them
        raise InvalidField("", f"the body is not valid JSON ({err})") from None
    if not isinstance(body, dict):
        raise InvalidField("", "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        _check_no_lone_surrogates(body, "")
    _check_counts(body)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        field = field_path(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidField(field, message) from None
