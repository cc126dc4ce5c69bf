"""Stop-string matching over streamed text deltas."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds stop strings in streamed text, holding back only what could still become a stop string.

    The match that ends first wins (the longest one if several end together), so the result does not
    depend on how the text was chunked; the text is cut where that match starts.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._stopped: str | None = None

    @property
    def stopped(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stopped

    def _find_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        # The longest suffix of text that is a proper prefix of some stop string.
        for n in range(min(len(text), self._max_len - 1), 0, -1):
            suffix = text[-n:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return n
        return 0

    def feed(self, delta: str, *, may_stop: bool = True) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string that matched or None).

        With may_stop False (before min_tokens) nothing matches; the text is still held back where it
        could begin a stop string, so a match that completes once stopping is allowed is still found.
        """
        if self._stopped is not None:
            return "", None
        if not self._stops:
            return delta, None
        if not may_stop:
            text = self._held + delta
            keep = self._held_suffix_len(text)
            self._held = text[len(text) - keep :]
            return text[: len(text) - keep], None
        text = self._held + delta
        match = self._find_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._stopped = stop
            return text[:start], stop
        keep = self._held_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """Return the held-back text at the end of a request (no stop string matched)."""
        held, self._held = self._held, ""
        return held
