"""When each benchmark request is sent: gamma-distributed gaps, as `vllm bench serve` draws them."""

from __future__ import annotations

import math
import random


def inter_arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n gaps in seconds (gap i follows request i); gamma(shape=burstiness, mean 1/rate), zeros when rate is inf.

    burstiness 1 gives a Poisson process; lower is burstier, higher more regular.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if math.isnan(request_rate) or request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    rng = random.Random(seed)
    # Scale 1/(rate*burstiness) keeps the mean gap at 1/rate whatever the shape.
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


def send_offsets(gaps: list[float]) -> list[float]:
    """Send time of each request relative to the first (the first goes at 0)."""
    offsets: list[float] = []
    total = 0.0
    for gap in gaps:
        offsets.append(total)
        total += gap
    return offsets
