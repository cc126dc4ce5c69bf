"""OpenAI request bodies into GenerateRequests: one per prompt, all sharing one SamplingParams.

What a request needs beyond the GenerateRequests travels in a Job: how to answer (stream, usage,
logprobs) and FieldNames, which maps the pipeline's field paths ("sampling.max_tokens",
"token_ids.ids[3]") back to the OpenAI parameter the client sent ("max_tokens", "prompt[1][3]").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.sampling_checks import InvalidField
from services.gateway.http.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Sampling,
)

Kind = Literal["completion", "chat"]
_INT32 = range(-(2**31), 2**31)


@dataclass(frozen=True)
class FieldNames:
    """Maps a pipeline field path of one prompt's request back to the OpenAI parameter."""

    kind: Kind
    # Each prompt's own name: "prompt", or "prompt[i]" for a list of prompts; "messages" for chat.
    prompt_names: Sequence[str]
    max_tokens: str = "max_tokens"
    # The OpenAI field the grammar came from (response_format, guided_json, structured_outputs.regex...).
    grammar: str = "response_format"

    def param(self, path: str, prompt_index: int = 0) -> str:
        """The OpenAI name of `path` in the request of prompt `prompt_index`."""
        head, _, rest = path.partition(".")
        prompt = self.prompt_names[prompt_index] if prompt_index < len(self.prompt_names) else "prompt"
        if path == "sampling.max_tokens":
            return self.max_tokens
        if path == "sampling.top_logprobs":
            return "logprobs" if self.kind == "completion" else "top_logprobs"
        if path.startswith("sampling.grammar"):
            return self.grammar
        if head == "sampling" and rest:
            return rest
        if head == "chat":
            return "messages" + path.removeprefix("chat").removeprefix(".messages")
        if path.startswith(("token_ids.ids", "prompt")):
            return prompt + path.removeprefix("token_ids.ids").removeprefix("prompt")
        if path == "input":
            return "messages" if self.kind == "chat" else prompt
        return path


@dataclass(frozen=True)
class Job:
    """One OpenAI request, ready for the pipeline."""

    kind: Kind
    # As the client named it ("" when it did not).
    model: str
    requests: list[generation_pb2.GenerateRequest]
    fields: FieldNames
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    # Token logprobs asked for, and how many alternatives per position.
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def num_choices(self) -> int:
        """Choices in the answer: n per prompt (choice index = prompt index * n + sample index)."""
        return len(self.requests) * self.n


def _grammar(body: _Sampling) -> tuple[str, sampling_pb2.Grammar] | None:
    """The one output constraint of a request, and the OpenAI field that set it."""
    found: list[tuple[str, sampling_pb2.Grammar]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", sampling_pb2.Grammar(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise InvalidField(
                "response_format.json_schema.schema", "a json_schema response format needs json_schema.schema"
            )
        found.append(("response_format", sampling_pb2.Grammar(json_schema=json.dumps(schema))))

    def add(name: str, value: Any, kind: str) -> None:
        if value is None:
            return
        if kind == "json_schema":
            text = value if isinstance(value, str) else json.dumps(value)
            found.append((name, sampling_pb2.Grammar(json_schema=text)))
        elif kind == "choice":
            found.append((name, sampling_pb2.Grammar(choice=sampling_pb2.Choices(choices=value))))
        elif kind == "json_object":
            if value:
                found.append((name, sampling_pb2.Grammar(json_object=True)))
        else:
            found.append((name, sampling_pb2.Grammar(**{kind: value})))

    add("guided_json", body.guided_json, "json_schema")
    add("guided_regex", body.guided_regex, "regex")
    add("guided_choice", body.guided_choice, "choice")
    add("guided_grammar", body.guided_grammar, "ebnf")
    so = body.structured_outputs
    if so is not None:
        add("structured_outputs.json", so.json_, "json_schema")
        add("structured_outputs.regex", so.regex, "regex")
        add("structured_outputs.choice", so.choice, "choice")
        add("structured_outputs.grammar", so.grammar, "ebnf")
        add("structured_outputs.json_object", so.json_object, "json_object")
    if len(found) > 1:
        raise InvalidField(found[1][0], f"give one output constraint; {found[0][0]} already sets one")
    return found[0] if found else None


def _sampling(body: _Sampling, max_tokens: int | None) -> tuple[sampling_pb2.SamplingParams, str]:
    """The request's SamplingParams, and the OpenAI field its grammar came from."""
    sp = sampling_pb2.SamplingParams()
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed", "min_p", "min_tokens"):
        value = getattr(body, name)
        if value is not None:
            setattr(sp, name, value)
    for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(sp, name, value)
    if body.stop is not None:
        sp.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        sp.stop_token_ids.extend(body.stop_token_ids)
    sp.ignore_eos = body.ignore_eos
    if body.skip_special_tokens is not None:
        sp.skip_special_tokens = body.skip_special_tokens
    for key, bias in (body.logit_bias or {}).items():
        # Plain ASCII digits only: int() would also take "5_0", " 5", "+5" and other scripts' digits.
        if not (key.isascii() and key.isdigit()):
            raise InvalidField("logit_bias", f"keys must be token ids (as JSON strings); got {key[:32]!r}")
        token = int(key)
        if token not in _INT32:
            raise InvalidField(f"logit_bias[{key}]", f"token id {token} is outside the model's vocabulary")
        sp.logit_bias[token] = bias
    grammar = _grammar(body)
    if grammar is None:
        return sp, "response_format"
    sp.grammar.CopyFrom(grammar[1])
    return sp, grammar[0]


def _common(body: _Sampling) -> None:
    if body.stream_options is not None and not body.stream:
        raise InvalidField("stream_options", "stream_options needs stream=true")


def _token_ids(ids: list[int], name: str) -> generation_pb2.TokenIds:
    out = generation_pb2.TokenIds()
    try:
        out.ids.extend(ids)
    except ValueError:
        j = next(j for j, t in enumerate(ids) if t not in _INT32)
        raise InvalidField(f"{name}[{j}]", f"token id {ids[j]} is outside the model's vocabulary") from None
    return out


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[list[str | list[int]], list[str]]:
    """Each prompt (text or token ids) and its name for errors."""
    if isinstance(prompt, str):
        return [prompt], ["prompt"]
    if not prompt:
        raise InvalidField("prompt", "prompt is an empty list; send a prompt")
    if isinstance(prompt[0], int):
        return [cast(list[int], prompt)], ["prompt"]  # one prompt of token ids
    return list(cast(list[str | list[int]], prompt)), [f"prompt[{i}]" for i in range(len(prompt))]


def completion_job(body: CompletionRequest) -> Job:
    """A /v1/completions body as one GenerateRequest per prompt."""
    _common(body)
    if body.echo:
        raise InvalidField("echo", "echo is not supported; send echo=false and prepend the prompt yourself")
    if body.suffix:
        raise InvalidField("suffix", "suffix is not supported")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise InvalidField("best_of", "best_of is not supported; leave it unset (or equal to n)")
    sp, grammar = _sampling(body, body.max_tokens)
    if body.logprobs is not None:
        sp.logprobs = True
        sp.top_logprobs = body.logprobs
    prompts, names = _prompts(body.prompt)
    requests = []
    for prompt, name in zip(prompts, names, strict=True):
        request = generation_pb2.GenerateRequest(sampling=sp, model=body.model or "")
        if body.n is not None:
            request.n = body.n
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.token_ids.CopyFrom(_token_ids(prompt, name))
        requests.append(request)
    return Job(
        "completion",
        body.model or "",
        requests,
        FieldNames("completion", names, grammar=grammar),
        n=n,
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        logprobs=sp.logprobs,
        top_logprobs=sp.top_logprobs,
        stop=tuple(sp.stop),
        stop_token_ids=frozenset(sp.stop_token_ids),
    )


def _message(i: int, message: ChatMessage) -> generation_pb2.ChatMessage:
    content = message.content
    if content is None:
        if message.role != "assistant":
            raise InvalidField(f"messages[{i}].content", "content is required (a string or a list of text parts)")
        content = ""
    elif not isinstance(content, str):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise InvalidField(
                    f"messages[{i}].content[{j}].type",
                    f"only text content parts are supported; got {part.type[:32]!r}",
                )
            if part.text is None:
                raise InvalidField(f"messages[{i}].content[{j}].text", "a text part needs its text")
            texts.append(part.text)
        content = "\n".join(texts)
    return generation_pb2.ChatMessage(role=message.role, content=content)


def chat_job(body: ChatCompletionRequest) -> Job:
    """A /v1/chat/completions body as one GenerateRequest."""
    _common(body)
    if body.tools:
        raise InvalidField("tools", "tool calling is not supported")
    max_tokens: int | None = body.max_tokens
    max_tokens_name = "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, max_tokens_name = body.max_completion_tokens, "max_completion_tokens"
    sp, grammar = _sampling(body, max_tokens)
    sp.logprobs = body.logprobs
    if body.top_logprobs is not None:
        sp.top_logprobs = body.top_logprobs
    chat = generation_pb2.Chat(messages=[_message(i, m) for i, m in enumerate(body.messages)])
    request = generation_pb2.GenerateRequest(chat=chat, sampling=sp, model=body.model or "")
    if body.n is not None:
        request.n = body.n
    return Job(
        "chat",
        body.model or "",
        [request],
        FieldNames("chat", ["messages"], max_tokens=max_tokens_name, grammar=grammar),
        n=1 if body.n is None else body.n,
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        logprobs=sp.logprobs,
        top_logprobs=sp.top_logprobs,
        stop=tuple(sp.stop),
        stop_token_ids=frozenset(sp.stop_token_ids),
    )
