"""Request validation: check a GenerateRequest, tokenize its input and fill sampling defaults."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.sampling_checks import (
    InvalidField,
    check_prompt_length,
    check_sampling,
    check_token_ids,
    resolve_max_tokens,
)
from services.gateway.chat_template import ChatTemplateError
from services.gateway.tokenizer import NoChatTemplateError, TextTokenizer

CHAT_ROLES = ("system", "user", "assistant")
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0


# One error type for every hop, so the gateway and the scheduler word violations alike.
ValidationError = InvalidField


@dataclass
class Limits:
    """Server-side bounds a request must respect."""

    max_model_len: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_len: int = 256


@dataclass
class ResolvedRequest:
    """A validated request: its prompt ids and a copy of its sampling parameters with defaults filled in."""

    prompt_token_ids: list[int]
    sampling: sampling_pb2.SamplingParams
    input_kind: str


def _prompt_ids(req: generation_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits) -> list[int]:
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValidationError("input", "set exactly one of prompt, chat or token_ids")
    if kind == "prompt":
        if not req.prompt:
            raise ValidationError("prompt", "prompt is empty; send some text")
        return tokenizer.encode(req.prompt)
    if kind == "chat":
        messages = req.chat.messages
        if not messages:
            raise ValidationError("chat.messages", "chat has no messages; send at least one")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise ValidationError(
                    f"chat.messages[{i}].role", f"role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}"
                )
        try:
            return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in messages])
        except (NoChatTemplateError, ChatTemplateError) as exc:
            raise ValidationError("chat", str(exc)) from exc
    ids = list(req.token_ids.ids)
    if not ids:
        raise ValidationError("token_ids.ids", "token_ids is empty; send at least one id")
    check_token_ids(ids, limits.vocab_size, "token_ids.ids")
    return ids


def _length_field(kind: str) -> str:
    return {"prompt": "prompt", "chat": "chat.messages", "token_ids": "token_ids.ids"}[kind]


def _resolve_sampling(src: sampling_pb2.SamplingParams, prompt_len: int, limits: Limits) -> sampling_pb2.SamplingParams:
    check_sampling(src, limits.vocab_size)
    sp = sampling_pb2.SamplingParams()
    sp.CopyFrom(src)
    sp.max_tokens = resolve_max_tokens(src, prompt_len, limits.max_model_len)
    if not sp.HasField("temperature"):
        sp.temperature = DEFAULT_TEMPERATURE
    if not sp.HasField("top_p"):
        sp.top_p = DEFAULT_TOP_P
    if not sp.HasField("top_k"):
        sp.top_k = DEFAULT_TOP_K
    if len(sp.stop) > limits.max_stop_strings:
        raise ValidationError(
            "sampling.stop", f"at most {limits.max_stop_strings} stop strings are allowed; got {len(sp.stop)}"
        )
    for i, stop in enumerate(sp.stop):
        if not stop:
            raise ValidationError(f"sampling.stop[{i}]", "stop strings must not be empty; remove it")
        if len(stop) > limits.max_stop_len:
            raise ValidationError(
                f"sampling.stop[{i}]",
                f"stop string is {len(stop)} characters; the limit is {limits.max_stop_len}, shorten it",
            )
    return sp


def validate_and_resolve(
    req: generation_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits
) -> ResolvedRequest:
    """Validate `req`, tokenize its input and fill sampling defaults; raise ValidationError on bad input."""
    prompt_ids = _prompt_ids(req, tokenizer, limits)
    kind = str(req.WhichOneof("input"))
    check_prompt_length(len(prompt_ids), limits.max_model_len, _length_field(kind))
    sampling = _resolve_sampling(req.sampling, len(prompt_ids), limits)
    return ResolvedRequest(prompt_token_ids=prompt_ids, sampling=sampling, input_kind=kind)
