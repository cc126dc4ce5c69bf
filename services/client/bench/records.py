"""What a benchmark records per request, whatever backend served it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Timestamps (time.perf_counter seconds) of one request's life."""

    prompt_len: int
    # Tokens the request asked for (EOS ignored).
    output_len: int
    # When the request was sent (or its batch started).
    start: float
    # One timestamp per received output token, in order.
    token_times: list[float] = field(default_factory=list)
    # Cached prompt tokens reported by the server (0 where unknown).
    cached_tokens: int = 0
    success: bool = True
    error: str = ""

    @property
    def num_output_tokens(self) -> int:
        """Tokens received."""
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        """Time to first token."""
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        """Start to last token."""
        return self.token_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive tokens."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None
