"""Server-sent events of an OpenAI-compatible /v1/completions stream, parsed by hand (no SDK).

SSEDecoder turns the response's lines into events; parse_event turns one event into a CompletionChunk.
Servers differ in small ways, all handled here: vLLM and OpenAI send `data: {json}` events ending in
`data: [DONE]`, errors mid-stream as `data: {"error": {...}}` (older vLLM: `{"object": "error", ...}`);
llama.cpp sends an error as a line of its own, `error: {json}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its type ("message" unless an `event:` field or a llama.cpp `error:` line says
    otherwise) and its data lines joined by newlines."""

    data: str
    event: str = "message"


class SSEDecoder:
    """Feed it the stream's lines (without their line ends); it returns an event at each blank line.

    Follows the SSE spec's field rules: `data:` lines accumulate, `event:` sets the type, comments (`:`)
    and other fields are ignored, one space after the colon is dropped. A `error:` line (llama.cpp) is an
    error event by itself.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

    def feed(self, line: str) -> SSEEvent | None:
        """The event that this line completes, if any."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "error":
            # llama.cpp's server writes `error: {json}` followed by a blank line; it stands alone.
            self._data, self._event = [], ""
            return SSEEvent(value, "error")
        return None

    def flush(self) -> SSEEvent | None:
        """The event left when the stream ends without its blank line."""
        return self._dispatch()

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent("\n".join(data), event or "message")


@dataclass(frozen=True)
class CompletionChunk:
    """What one event says about the completion."""

    text: str = ""
    # Token ids the chunk lists (vLLM with return_token_ids, llama.cpp's "tokens"); None when it lists none.
    token_ids: list[int] | None = None
    # Whether the chunk holds a choice at all (the final usage chunk of include_usage holds none).
    has_choice: bool = False
    finish_reason: str | None = None
    # From a "usage" object: the server's own counts.
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    done: bool = False


def error_text(error: Any) -> str:
    """The message of an error object as servers send them: {"message": ...}, nested or not, or a string."""
    if isinstance(error, dict):
        inner = error.get("error")
        if inner is not None:
            return error_text(inner)
        message = error.get("message") or error.get("detail")
        if message is not None:
            return message if isinstance(message, str) else json.dumps(message)
        return json.dumps(error)
    return str(error)


def error_body_text(body: str) -> str:
    """The message of a non-200 response's body (JSON error object, or the text itself, shortened)."""
    try:
        return error_text(json.loads(body))
    except json.JSONDecodeError:
        text = body.strip()
        return text[:300] or "(empty body)"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(_int(v) is not None for v in value):
        return value
    return None


def parse_event(event: SSEEvent) -> CompletionChunk:
    """One event of a completions stream as a chunk; unreadable data is an error chunk, never raised."""
    if event.event == "error":
        try:
            return CompletionChunk(error=error_text(json.loads(event.data)))
        except json.JSONDecodeError:
            return CompletionChunk(error=event.data.strip() or "error event")
    data = event.data.strip()
    if data == DONE:
        return CompletionChunk(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return CompletionChunk(error=f"unreadable stream event: {data[:120]!r}")
    if not isinstance(obj, dict):
        return CompletionChunk(error=f"unexpected stream event: {data[:120]!r}")
    if obj.get("error") is not None:
        return CompletionChunk(error=error_text(obj["error"]))
    if obj.get("object") == "error":
        return CompletionChunk(error=error_text(obj))
    text, token_ids, finish_reason, has_choice = "", None, None, False
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        has_choice = True
        delta = choice.get("delta")
        # /v1/completions has "text"; a chat-style "delta.content" is read the same way.
        raw = choice.get("text") if "text" in choice else (delta or {}).get("content")
        text = raw if isinstance(raw, str) else ""
        token_ids = _ids(choice.get("token_ids"))
        if token_ids is None:
            token_ids = _ids(obj.get("tokens"))
        reason = choice.get("finish_reason")
        finish_reason = reason if isinstance(reason, str) and reason else None
    completion_tokens = prompt_tokens = cached_tokens = None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        completion_tokens = _int(usage.get("completion_tokens"))
        prompt_tokens = _int(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached_tokens = _int(details.get("cached_tokens"))
    return CompletionChunk(
        text=text,
        token_ids=token_ids,
        has_choice=has_choice,
        finish_reason=finish_reason,
        completion_tokens=completion_tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
    )
