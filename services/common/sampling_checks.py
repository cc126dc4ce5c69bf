"""Checks on SamplingParams and token ids that every hop applies the same way."""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.common.proto.meshserve.v1 import sampling_pb2

# Caps on every repeated field of a request. The gateway and the scheduler both check them, so a
# request one accepts is never refused by the other for its size, and no list a client sends grows
# work or memory without bound on any hop.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_EOS_TOKEN_IDS = 64
MAX_CHAT_MESSAGES = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
# OpenAI's and vLLM's caps: top_logprobs up to 20, logit_bias values in [-100, 100], penalties in [-2, 2].
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_OPENAI_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0
# The whole Grammar message, checked by every hop before anything reads it; grammar_check.py (the gateway)
# holds the per-kind caps (64 KiB of schema, regex or EBNF; 256 choices of at most 1024 characters).
MAX_GRAMMAR_MESSAGE_BYTES = 128 * 1024

# Temperatures below this are treated as greedy (vLLM's threshold), avoiding overflow in logits / T.
GREEDY_EPS = 1e-5


def is_greedy(params: sampling_pb2.SamplingParams) -> bool:
    """True when the request picks the argmax (temperature 0): the worker's sampler and the scheduler's
    choice of what may be speculated read this one definition."""
    return params.HasField("temperature") and params.temperature < GREEDY_EPS


class InvalidField(ValueError):
    """A request field is wrong; `field` names it and the message says how to fix it."""

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description


def check_count(count: int, cap: int, field: str, what: str) -> None:
    """Raise InvalidField when a repeated field holds more than `cap` items."""
    if count > cap:
        raise InvalidField(field, f"at most {cap} {what} are allowed; got {count}")


def check_sampling(params: sampling_pb2.SamplingParams, vocab_size: int | None = None) -> None:
    """Raise InvalidField for the first sampling parameter out of range or over its cap."""
    if params.HasField("max_tokens") and params.max_tokens < 1:
        raise InvalidField(
            "sampling.max_tokens", f"max_tokens must be >= 1 (or unset for no limit); got {params.max_tokens}"
        )
    if params.HasField("temperature") and not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise InvalidField(
            "sampling.temperature", f"temperature must be a finite number >= 0 (0 = greedy); got {params.temperature}"
        )
    if params.HasField("top_p") and not (0 < params.top_p <= 1):
        raise InvalidField("sampling.top_p", f"top_p must be in (0, 1]; got {params.top_p:g} (1 = off)")
    if params.HasField("top_k") and params.top_k < -1:
        raise InvalidField("sampling.top_k", f"top_k must be >= -1 (0 or -1 = off); got {params.top_k}")
    check_stop_strings(params.stop)
    check_count(len(params.stop_token_ids), MAX_STOP_TOKEN_IDS, "sampling.stop_token_ids", "stop token ids")
    if vocab_size is not None:
        check_token_ids(params.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    _check_extras(params, vocab_size)


def _finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def _check_extras(params: sampling_pb2.SamplingParams, vocab_size: int | None) -> None:
    """The vLLM / OpenAI extras: penalties, min_p, min_tokens, logit_bias, top_logprobs."""
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidField(
            "sampling.top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]; got {params.top_logprobs}"
        )
    if params.top_logprobs and not params.logprobs:
        raise InvalidField("sampling.top_logprobs", "top_logprobs needs logprobs; set logprobs = true")
    if params.HasField("repetition_penalty") and not (
        params.repetition_penalty > 0 and _finite_in(params.repetition_penalty, 0, MAX_REPETITION_PENALTY)
    ):
        raise InvalidField(
            "sampling.repetition_penalty",
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off); "
            f"got {params.repetition_penalty:g}",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if params.HasField(name):
            value = getattr(params, name)
            if not _finite_in(value, -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY):
                raise InvalidField(
                    f"sampling.{name}",
                    f"{name} must be in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}] (0 = off); got {value:g}",
                )
    if params.HasField("min_p") and not _finite_in(params.min_p, 0, 1):
        raise InvalidField("sampling.min_p", f"min_p must be in [0, 1] (0 = off); got {params.min_p:g}")
    if params.HasField("min_tokens"):
        if params.min_tokens < 0:
            raise InvalidField("sampling.min_tokens", f"min_tokens must be >= 0; got {params.min_tokens}")
        if params.HasField("max_tokens") and params.min_tokens > params.max_tokens:
            raise InvalidField(
                "sampling.min_tokens",
                f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})",
            )
    if params.HasField("grammar"):
        size = params.grammar.ByteSize()
        if size > MAX_GRAMMAR_MESSAGE_BYTES:
            raise InvalidField(
                "sampling.grammar", f"is {size} bytes; a grammar may be at most {MAX_GRAMMAR_MESSAGE_BYTES}, shorten it"
            )
    bias = params.logit_bias
    check_count(len(bias), MAX_LOGIT_BIAS_ENTRIES, "sampling.logit_bias", "logit_bias entries")
    for token, value in bias.items():
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise InvalidField(
                f"sampling.logit_bias[{token}]", f"token id {token} is outside the model's vocabulary [0, {vocab_size})"
            )
        if not _finite_in(value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS):
            raise InvalidField(
                f"sampling.logit_bias[{token}]",
                f"bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; got {value:g}",
            )


def check_stop_strings(stops: Sequence[str]) -> None:
    """At most MAX_STOP_STRINGS non-empty strings of at most MAX_STOP_STRING_CHARS characters each."""
    check_count(len(stops), MAX_STOP_STRINGS, "sampling.stop", "stop strings")
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidField(f"sampling.stop[{i}]", "stop strings must not be empty; remove it")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidField(
                f"sampling.stop[{i}]",
                f"stop string is {len(stop)} characters; the limit is {MAX_STOP_STRING_CHARS}, shorten it",
            )


def check_eos_token_ids(ids: Sequence[int], vocab_size: int | None = None) -> None:
    """The eos ids a caller sends with a submission: at most MAX_EOS_TOKEN_IDS, inside the vocabulary."""
    check_count(len(ids), MAX_EOS_TOKEN_IDS, "eos_token_ids", "eos token ids")
    if vocab_size is not None:
        check_token_ids(ids, vocab_size, "eos_token_ids")


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Raise InvalidField naming the first id outside [0, vocab_size)."""
    for i, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise InvalidField(f"{field}[{i}]", f"token id {tok} is outside the model's vocabulary [0, {vocab_size})")


def check_prompt_length(num_tokens: int, max_model_len: int, field: str) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens == 0:
        raise InvalidField(field, "is empty; send at least one token of input")
    if num_tokens >= max_model_len:
        raise InvalidField(
            field,
            f"prompt is {num_tokens} tokens but --max-model-len is {max_model_len} (prompt + output); "
            "shorten the prompt or raise --max-model-len",
        )


def resolve_max_tokens(params: sampling_pb2.SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """Tokens the request may generate: its max_tokens, or all the room max_model_len leaves when unset.

    A max_tokens that does not fit is refused, as vLLM and OpenAI do, rather than silently clamped: a
    client that asked for 500 tokens and got 40 would not know why its answer stopped.
    """
    room = max_model_len - prompt_len
    if not params.HasField("max_tokens"):
        return room
    if params.max_tokens > room:
        raise InvalidField(
            "sampling.max_tokens",
            f"the prompt is {prompt_len} tokens and max_tokens is {params.max_tokens}: "
            f"{prompt_len + params.max_tokens} tokens, more than --max-model-len {max_model_len}; "
            f"lower max_tokens to at most {room} or shorten the prompt",
        )
    return params.max_tokens
