"""Turn per-request records into the numbers `vllm bench serve` reports."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.client.bench.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
# What --percentile-metrics may name (vLLM's names); the table shows all four unless told otherwise.
PERCENTILE_METRICS = SLO_METRICS
# --metric-percentiles: vLLM's default, p99.
DEFAULT_PERCENTILES: tuple[float, ...] = (99.0,)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile_label(q: float) -> str:
    """q as vLLM writes it in a key or a row: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if int(q) == q else str(q)


def percentile_key(metric: str, q: float) -> str:
    """The saved-JSON key of one percentile of one metric, as vLLM names it: p90_ttft_ms."""
    return f"p{percentile_label(q)}_{metric}_ms"


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median and p99 of one latency metric, in milliseconds (all 0 without samples, like vLLM)."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        """Stats of samples given in seconds."""
        if not values:
            return cls(0.0, 0.0, 0.0)
        ms = [v * 1000.0 for v in values]
        return cls(sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


@dataclass
class BenchSummary:
    """One benchmark run's results; field names follow vLLM's saved JSON."""

    backend: str
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    # Tokens the completed requests actually received.
    total_output_tokens: int
    # Tokens the completed requests asked for.
    requested_output_tokens: int
    # Completed requests that received a different number of tokens than they asked for.
    output_len_mismatches: int
    total_cached_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p99_itl_ms: float
    mean_e2el_ms: float
    median_e2el_ms: float
    p99_e2el_ms: float
    # Completed requests per second that met every SLO; None when no SLO was given.
    goodput: float | None
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    # Error text -> how many failed requests ended with it.
    errors: dict[str, int] = field(default_factory=dict)
    # --percentile-metrics and --metric-percentiles: what the table shows beyond mean and median.
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    # percentile_key(metric, q) -> ms, for every chosen metric and percentile.
    percentiles_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (an infinite request rate becomes the string "inf", as in vLLM).

        The chosen percentiles appear as vLLM's top-level keys (p90_ttft_ms, ...), not as a nested dict.
        """
        data = asdict(self)
        if math.isinf(self.request_rate):
            data["request_rate"] = "inf"
        data["percentile_metrics"] = list(self.percentile_metrics)
        data["metric_percentiles"] = list(self.metric_percentiles)
        data.update(data.pop("percentiles_ms"))
        return data

    def percentile_ms(self, metric: str, q: float) -> float:
        """One chosen percentile of one chosen metric (KeyError for one that was not chosen)."""
        return self.percentiles_ms[percentile_key(metric, q)]


def _meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    # A request with one token has no TPOT/ITL, so those SLOs cannot fail (vLLM counts its TPOT as 0).
    measured = {
        "ttft": record.ttft,
        "tpot": record.tpot or 0.0,
        "itl": max(record.itls, default=0.0),
        "e2el": record.e2e,
    }
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    goodput_slos: Mapping[str, float] | None = None,
    backend: str,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    metric_percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchSummary:
    """Aggregate records; failed requests (and successes without a token) are left out of every latency.

    goodput_slos maps ttft/tpot/itl/e2el to a limit in ms (itl: the request's largest gap).
    percentile_metrics and metric_percentiles choose the extra percentiles (vLLM's flags of those names);
    mean, median and p99 of every metric are there whatever they say.
    """
    for name in goodput_slos or {}:
        if name not in SLO_METRICS:
            raise ValueError(f"unknown goodput metric {name!r}; expected one of {', '.join(SLO_METRICS)}")
    for name in percentile_metrics:
        if name not in PERCENTILE_METRICS:
            raise ValueError(f"unknown percentile metric {name!r}; expected one of {', '.join(PERCENTILE_METRICS)}")
    for q in metric_percentiles:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile must lie in [0, 100], got {q}")
    if duration_s <= 0 and records:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    done = [r for r in records if r.success and r.num_output_tokens > 0]
    errors = Counter(r.error or "no output tokens received" for r in records if not (r.success and r.num_output_tokens))
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    samples = {
        "ttft": [r.ttft for r in done],
        # TPOT excludes the first token, so single-token requests have none.
        "tpot": [t for r in done if (t := r.tpot) is not None],
        # ITL is pooled over every gap of every request, not averaged per request.
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2e for r in done],
    }
    stats = {name: LatencyStats.of_seconds(values) for name, values in samples.items()}
    # 0 without samples, like vLLM (and like LatencyStats).
    chosen = {
        percentile_key(name, q): percentile([v * 1000.0 for v in samples[name]], q) if samples[name] else 0.0
        for name in dict.fromkeys(percentile_metrics)
        for q in dict.fromkeys(metric_percentiles)
    }
    goodput = None
    if goodput_slos:
        good = sum(1 for r in done if _meets_slos(r, goodput_slos))
        goodput = good / duration_s if duration_s > 0 else 0.0

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    return BenchSummary(
        backend=backend,
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        requested_output_tokens=sum(r.output_len for r in done),
        output_len_mismatches=sum(1 for r in done if r.num_output_tokens != r.output_len),
        total_cached_tokens=sum(r.cached_tokens for r in done),
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        mean_ttft_ms=stats["ttft"].mean,
        median_ttft_ms=stats["ttft"].median,
        p99_ttft_ms=stats["ttft"].p99,
        mean_tpot_ms=stats["tpot"].mean,
        median_tpot_ms=stats["tpot"].median,
        p99_tpot_ms=stats["tpot"].p99,
        mean_itl_ms=stats["itl"].mean,
        median_itl_ms=stats["itl"].median,
        p99_itl_ms=stats["itl"].p99,
        mean_e2el_ms=stats["e2el"].mean,
        median_e2el_ms=stats["e2el"].median,
        p99_e2el_ms=stats["e2el"].p99,
        goodput=goodput,
        goodput_slos_ms=dict(goodput_slos or {}),
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        burstiness=burstiness,
        errors=dict(errors),
        percentile_metrics=tuple(dict.fromkeys(percentile_metrics)),
        metric_percentiles=tuple(dict.fromkeys(float(q) for q in metric_percentiles)),
        percentiles_ms=chosen,
    )


def mean_ttft_by_turn(records: Sequence[RequestRecord], turns: Sequence[int]) -> list[float | None]:
    """Mean TTFT in ms of the completed requests at each turn position (None where none completed).

    With multi-turn conversations this shows how prefill cost grows with the history, and how much of it the
    prefix cache takes away.
    """
    if len(records) != len(turns):
        raise ValueError(f"{len(records)} records but {len(turns)} turn indices")
    by_turn: dict[int, list[float]] = {}
    for record, turn in zip(records, turns, strict=True):
        if record.success and record.num_output_tokens:
            by_turn.setdefault(turn, []).append(record.ttft)
    return [
        LatencyStats.of_seconds(by_turn[k]).mean if k in by_turn else None for k in range(max(turns, default=-1) + 1)
    ]
