"""Request validation: check a GenerateRequest, tokenize its input and fill sampling defaults.

Three steps, so that nothing whose cost grows with the input runs on the event loop:
check_input (sizes and counts first, then everything else that is cheap), encode_input
(templating and tokenization, which the servicer runs on a thread), and finish (the token count).
max_tokens is left as the client sent it: the scheduler alone resolves it against its workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.common.sampling_checks import (
    MAX_CHAT_MESSAGES,
    InvalidField,
    check_count,
    check_prompt_length,
    check_sampling,
    check_token_ids,
)
from services.gateway.chat_template import ChatTemplateError
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.tokenizer import NoChatTemplateError, TextTokenizer

CHAT_ROLES = ("system", "user", "assistant")
# Samples per request (OpenAI's n): each is a request of its own on the scheduler, so the cap bounds
# what one call can make the cluster do.
MAX_N = 16

_VLLM_DEFAULTS = SamplingDefaults()

# One error type for every hop, so the gateway and the scheduler word violations alike.
ValidationError = InvalidField


@dataclass(frozen=True)
class Limits:
    """Bounds a request must respect: the model's (from the schedulers) and the tokenizer's longest token."""

    max_model_len: int
    vocab_size: int
    # UTF-8 bytes of the longest vocabulary entry (TextTokenizer.max_token_bytes).
    max_token_bytes: int

    @property
    def max_text_bytes(self) -> int:
        """Text longer than this cannot fit: even if every token were the longest one, it needs more
        than max_model_len tokens. Checked before tokenizing, which would cost time and memory.

        This holds for tokenizers that keep every input byte in some token (byte-level BPE and
        SentencePiece, which generative models use); one whose normalizer drops text could be refused
        text that would fit.
        """
        return self.max_model_len * self.max_token_bytes


@dataclass(frozen=True)
class CheckedInput:
    """A request's input after the cheap checks, before tokenization: exactly one field is set."""

    kind: str
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None


@dataclass
class ResolvedRequest:
    """A validated request: its prompt ids and a copy of its sampling parameters with defaults filled in."""

    prompt_token_ids: list[int]
    sampling: sampling_pb2.SamplingParams
    input_kind: str
    # Independent samples to generate (GenerateRequest.n).
    n: int = 1
    # The model length it was checked against: prompt + output must fit in it.
    max_model_len: int = 0

    @property
    def room(self) -> int:
        """The most tokens one sample may generate."""
        return max(0, self.max_model_len - len(self.prompt_token_ids))

    @property
    def max_new_tokens(self) -> int:
        """What one sample may generate: max_tokens, or what the model length leaves when unset."""
        return self.sampling.max_tokens if self.sampling.HasField("max_tokens") else self.room


def _length_field(kind: str) -> str:
    return {"prompt": "prompt", "chat": "chat.messages", "token_ids": "token_ids.ids"}[kind]


def _check_text_bytes(num_bytes: int, limits: Limits, field: str, what: str) -> None:
    if num_bytes > limits.max_text_bytes:
        raise ValidationError(
            field,
            f"{what} is {num_bytes} bytes of UTF-8, more than can fit in --max-model-len {limits.max_model_len} "
            f"tokens (at most {limits.max_text_bytes} bytes with this tokenizer); shorten it",
        )


def _check_chat(chat: generation_pb2.Chat, limits: Limits) -> list[dict[str, str]]:
    if not chat.messages:
        raise ValidationError("chat.messages", "chat has no messages; send at least one")
    check_count(len(chat.messages), MAX_CHAT_MESSAGES, "chat.messages", "chat messages")
    messages, content_bytes = [], 0
    for i, m in enumerate(chat.messages):
        role, content = m.role, m.content
        if role not in CHAT_ROLES:
            raise ValidationError(
                f"chat.messages[{i}].role", f"role must be one of {', '.join(CHAT_ROLES)}; got {role[:32]!r}"
            )
        # The template only adds text around the contents, so their bytes alone bound the rendered prompt.
        content_bytes += len(content.encode())
        messages.append({"role": role, "content": content})
    _check_text_bytes(content_bytes, limits, "chat.messages", "the chat's content")
    return messages


def check_input(req: generation_pb2.GenerateRequest, limits: Limits) -> CheckedInput:
    """Every check that costs little whatever the input's size; raise ValidationError on the first failure."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValidationError("input", "set exactly one of prompt, chat or token_ids")
    if req.HasField("n") and not 1 <= req.n <= MAX_N:
        raise ValidationError("n", f"n must be in [1, {MAX_N}]; got {req.n}")
    check_sampling(req.sampling, limits.vocab_size)
    if kind == "prompt":
        text = req.prompt  # read once: each read of a string field makes a new copy
        if not text:
            raise ValidationError("prompt", "prompt is empty; send some text")
        _check_text_bytes(len(text.encode()), limits, "prompt", "prompt")
        return CheckedInput(kind, text=text)
    if kind == "chat":
        return CheckedInput(kind, messages=_check_chat(req.chat, limits))
    repeated = req.token_ids.ids
    if not repeated:
        raise ValidationError("token_ids.ids", "token_ids is empty; send at least one id")
    # The count first (free): copying and checking the ids of an over-long prompt would be slow work.
    check_prompt_length(len(repeated), limits.max_model_len, "token_ids.ids")
    ids = list(repeated)
    check_token_ids(ids, limits.vocab_size, "token_ids.ids")
    return CheckedInput(kind, token_ids=ids)


def encode_input(checked: CheckedInput, tokenizer: TextTokenizer) -> list[int]:
    """Render and tokenize the input (the costly step, thread-safe: run it off the event loop)."""
    if checked.token_ids is not None:
        return checked.token_ids
    if checked.text is not None:
        return tokenizer.encode(checked.text)
    assert checked.messages is not None
    try:
        return tokenizer.encode_chat(checked.messages)
    except (NoChatTemplateError, ChatTemplateError) as exc:
        raise ValidationError("chat", str(exc)) from exc


def finish(
    req: generation_pb2.GenerateRequest,
    checked: CheckedInput,
    prompt_ids: list[int],
    limits: Limits,
    defaults: SamplingDefaults = _VLLM_DEFAULTS,
) -> ResolvedRequest:
    """Check the prompt's token count and fill sampling defaults (a max_tokens the client sent stays as
    sent: the scheduler alone resolves it against the model length)."""
    check_prompt_length(len(prompt_ids), limits.max_model_len, _length_field(checked.kind))
    sp = sampling_pb2.SamplingParams()
    sp.CopyFrom(req.sampling)
    defaults.apply(sp)
    n = req.n if req.HasField("n") else 1
    return ResolvedRequest(
        prompt_token_ids=prompt_ids, sampling=sp, input_kind=checked.kind, n=n, max_model_len=limits.max_model_len
    )


def validate_and_resolve(
    req: generation_pb2.GenerateRequest,
    tokenizer: TextTokenizer,
    limits: Limits,
    defaults: SamplingDefaults = _VLLM_DEFAULTS,
) -> ResolvedRequest:
    """All three steps in one call (for tools and tests; the pipeline runs encode_input on a thread)."""
    checked = check_input(req, limits)
    return finish(req, checked, encode_input(checked, tokenizer), limits, defaults)
