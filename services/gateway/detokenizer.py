"""Incremental detokenization: a growing list of token ids into text deltas (vLLM's offsets technique)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens seed the decode window; enough for SentencePiece/BPE to get leading spaces right.
INITIAL_INCOMING_READ_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decodes output tokens as they arrive, never splitting a multi-byte character across deltas."""

    def __init__(self, tokenizer: _Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window starts inside the prompt so the first output token decodes with its real leading space.
        self._ids: list[int] = list(prompt_token_ids[-(INITIAL_INCOMING_READ_OFFSET + 2) :])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_INCOMING_READ_OFFSET, 0)
        self._output_ids: list[int] = []
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """All output ids added so far."""
        return list(self._output_ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output ids and return the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        self._output_ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        # A trailing U+FFFD means the last bytes are an incomplete character: wait for the rest.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Return text still held back at the end of a request (e.g. a truly invalid byte sequence)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._text += delta
        return delta
