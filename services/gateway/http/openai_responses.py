"""GenerateResponses into OpenAI's answers: a whole text_completion / chat.completion, or stream chunks.

A request's choices are numbered prompt_index * n + sample_index. Usage counts each prompt once (its n
samples share it, as OpenAI counts), sums completion tokens over every choice, and takes each
prompt's largest cached count. The text of a token in logprobs is the tokenizer's decode of that
single id, special tokens included.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from services.common.proto.meshserve.v1 import generation_pb2, sampling_pb2
from services.gateway.http.openai_convert import Job
from services.gateway.tokenizer import TextTokenizer

FINISH_REASONS = {
    sampling_pb2.FINISH_REASON_STOP: "stop",
    sampling_pb2.FINISH_REASON_LENGTH: "length",
    sampling_pb2.FINISH_REASON_ABORT: "abort",
}
# JSON has no -Infinity; vLLM clamps a logprob the same way.
MIN_LOGPROB = -9999.0
DONE = b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode() + b"\n\n"


def _logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


class TokenTexts:
    """Each token id's own text (its decode alone, special tokens kept), cached."""

    def __init__(self, tokenizer: TextTokenizer, capacity: int = 1 << 16) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if len(self._cache) >= self._capacity:
                self._cache.clear()
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass
class _Choice:
    """What a whole answer gathers for one choice."""

    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Completions: the next token's offset in the choice's text, and the logprobs lists so far.
    text_offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)
    # Chat: the logprobs content entries so far.
    content: list[dict[str, Any]] = field(default_factory=list)


class _Usage:
    def __init__(self, prompts: int) -> None:
        self.prompt_tokens = [0] * prompts
        self.cached_tokens = [0] * prompts
        self.completion_tokens = 0

    def add(self, prompt_index: int, usage: generation_pb2.Usage) -> None:
        self.prompt_tokens[prompt_index] = usage.prompt_tokens
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], usage.cached_tokens)
        self.completion_tokens += usage.completion_tokens

    def json(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }


class Answer:
    """One OpenAI request's answer, built whole (add, then body) or as stream chunks (opening, chunks, closing)."""

    def __init__(self, job: Job, texts: TokenTexts, response_id: str, model: str, created: int) -> None:
        self.job = job
        self._texts = texts
        self._id = response_id
        self._model = model
        self._created = created
        self._choices = [_Choice() for _ in range(job.num_choices)]
        self._usage = _Usage(len(job.requests))
        self._chat = job.kind == "chat"

    # Shared.

    def _observe(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> tuple[int, _Choice]:
        index = prompt_index * self.job.n + response.index
        choice = self._choices[index]
        if response.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = FINISH_REASONS.get(response.finish_reason, "stop")
            choice.stop_reason = self._stop_reason(response.stop_reason)
            self._usage.add(prompt_index, response.usage)
        return index, choice

    def _stop_reason(self, text: str) -> str | int | None:
        """vLLM's stop_reason: the stop string, the stop token id (a number), or None for EOS and length."""
        if not text:
            return None
        if text.isascii() and text.isdigit() and text not in self.job.stop:
            return int(text)
        return text

    def _completion_logprobs(self, choice: _Choice, response: generation_pb2.GenerateResponse) -> dict[str, Any]:
        tokens = [self._texts(t) for t in response.token_ids]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        top: list[dict[str, float]] = []
        for i, token in enumerate(tokens):
            entry: dict[str, float] = {}
            if i < len(response.top_logprobs):
                alternatives = response.top_logprobs[i]
                for tid, lp in zip(alternatives.token_ids, alternatives.logprobs, strict=False):
                    entry.setdefault(self._texts(tid), _logprob(lp))
            if i < len(response.logprobs):
                # As vLLM does: the sampled token is always among its position's entries.
                entry.setdefault(token, _logprob(response.logprobs[i]))
            top.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(lp) for lp in response.logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._texts(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    def _chat_logprobs(self, response: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        content = []
        for i, (token_id, lp) in enumerate(zip(response.token_ids, response.logprobs, strict=False)):
            entry = self._entry(token_id, lp)
            alternatives = response.top_logprobs[i] if i < len(response.top_logprobs) else None
            entry["top_logprobs"] = (
                [self._entry(t, a) for t, a in zip(alternatives.token_ids, alternatives.logprobs, strict=False)]
                if alternatives is not None
                else []
            )
            content.append(entry)
        return content

    def usage(self) -> dict[str, Any]:
        """Usage so far (complete once every choice finished)."""
        return self._usage.json()

    # A whole answer.

    def add(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> None:
        """Gather one response of prompt `prompt_index`."""
        _, choice = self._observe(prompt_index, response)
        choice.text.append(response.text)
        if not self.job.logprobs:
            return
        if self._chat:
            choice.content.extend(self._chat_logprobs(response))
            return
        lp = self._completion_logprobs(choice, response)
        choice.tokens.extend(lp["tokens"])
        choice.token_logprobs.extend(lp["token_logprobs"])
        choice.top_logprobs.extend(lp["top_logprobs"])
        choice.text_offsets.extend(lp["text_offset"])

    def body(self) -> dict[str, Any]:
        """The whole answer (object text_completion or chat.completion)."""
        choices = []
        for index, choice in enumerate(self._choices):
            text = "".join(choice.text)
            out: dict[str, Any] = {"index": index}
            if self._chat:
                out["message"] = {"role": "assistant", "content": text}
                out["logprobs"] = {"content": choice.content} if self.job.logprobs else None
            else:
                out["text"] = text
                out["logprobs"] = (
                    {
                        "tokens": choice.tokens,
                        "token_logprobs": choice.token_logprobs,
                        "top_logprobs": choice.top_logprobs,
                        "text_offset": choice.text_offsets,
                    }
                    if self.job.logprobs
                    else None
                )
            out["finish_reason"] = choice.finish_reason
            out["stop_reason"] = choice.stop_reason
            choices.append(out)
        return {
            "id": self._id,
            "object": "chat.completion" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
            "usage": self._usage.json(),
        }

    # A stream.

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict[str, Any]]:
        """Chunks before any text: for chat, each choice's role."""
        if not self._chat:
            return []
        return [
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.job.num_choices)
        ]

    def chunks(self, prompt_index: int, response: generation_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The chunks for one response (none for a response with nothing to tell)."""
        index, choice = self._observe(prompt_index, response)
        final = response.finish_reason != sampling_pb2.FINISH_REASON_UNSPECIFIED
        with_logprobs = self.job.logprobs and len(response.token_ids) > 0
        if not response.text and not final and not with_logprobs:
            return []
        out: dict[str, Any] = {"index": index}
        if self._chat:
            out["delta"] = {"content": response.text} if response.text else {}
            out["logprobs"] = {"content": self._chat_logprobs(response)} if self.job.logprobs else None
        else:
            out["text"] = response.text
            out["logprobs"] = self._completion_logprobs(choice, response) if self.job.logprobs else None
        out["finish_reason"] = choice.finish_reason if final else None
        out["stop_reason"] = choice.stop_reason if final else None
        return [self._chunk([out])]

    def closing(self) -> list[dict[str, Any]]:
        """Chunks after every choice finished: the usage chunk, when the client asked for it."""
        if not self.job.include_usage:
            return []
        return [{**self._chunk([]), "usage": self._usage.json()}]
