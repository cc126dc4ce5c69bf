"""Print a benchmark summary as vLLM does and save it as JSON."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from services.client.bench.metrics import BenchSummary, percentile_key, percentile_label
from services.client.bench.records import RequestRecord

if TYPE_CHECKING:
    # Only for annotations, so that importing the report does not import grpc.
    from services.client.bench.cache_stats import CacheReport

WIDTH = 50
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: object) -> str:
    return f"{label:<40} {value:<10}"


def format_summary(summary: BenchSummary) -> str:
    """The summary as vLLM's result table."""
    s = summary
    rate = "inf" if math.isinf(s.request_rate) else f"{s.request_rate:g}"
    lines = [
        " Serving Benchmark Result ".center(WIDTH, "="),
        _row("Backend:", s.backend),
        _row("Traffic request rate:", rate),
        _row("Burstiness factor:", f"{s.burstiness:g}"),
        _row("Maximum request concurrency:", s.max_concurrency if s.max_concurrency is not None else "none"),
        _row("Successful requests:", s.completed),
        _row("Failed requests:", s.failed),
        _row("Benchmark duration (s):", f"{s.duration_s:.2f}"),
        _row("Total input tokens:", s.total_input_tokens),
        _row("Total generated tokens:", s.total_output_tokens),
    ]
    if s.output_len_mismatches:
        lines.append(_row("Requests with wrong output length:", s.output_len_mismatches))
    if s.total_cached_tokens:
        lines.append(_row("Cached prompt tokens:", s.total_cached_tokens))
    lines.append(_row("Request throughput (req/s):", f"{s.request_throughput:.2f}"))
    if s.goodput is not None:
        lines.append(_row("Request goodput (req/s):", f"{s.goodput:.2f}"))
    lines += [
        _row("Output token throughput (tok/s):", f"{s.output_throughput:.2f}"),
        _row("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}"),
    ]
    # The metrics of --percentile-metrics, each with its mean, median and the --metric-percentiles, as vLLM.
    for key, short, title in _SECTIONS:
        if key not in s.percentile_metrics:
            continue
        lines.append(title.center(WIDTH, "-"))
        lines.append(_row(f"Mean {short} (ms):", f"{getattr(s, f'mean_{key}_ms'):.2f}"))
        lines.append(_row(f"Median {short} (ms):", f"{getattr(s, f'median_{key}_ms'):.2f}"))
        for q in s.metric_percentiles:
            lines.append(_row(f"P{percentile_label(q)} {short} (ms):", f"{_percentile_ms(s, key, q):.2f}"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _percentile_ms(summary: BenchSummary, metric: str, q: float) -> float:
    # A summary built by hand may lack the chosen percentiles; p99 is always a field of its own.
    value = summary.percentiles_ms.get(percentile_key(metric, q))
    if value is None:
        return float(getattr(summary, f"p99_{metric}_ms")) if q == 99 else math.nan
    return value


def print_summary(summary: BenchSummary, file: TextIO | None = None) -> None:
    """Print the table, then the distinct errors of failed requests."""
    out = file or sys.stdout
    print(format_summary(summary), file=out)
    for error, count in summary.errors.items():
        print(f"{count} request(s) failed: {error}", file=out)
    if summary.output_len_mismatches:
        print(
            f"warning: {summary.output_len_mismatches} request(s) received a different number of tokens "
            f"({summary.total_output_tokens} received, {summary.requested_output_tokens} requested)",
            file=out,
        )


def _percent(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate * 100:.2f}"


def format_cache_report(report: CacheReport) -> str:
    """The scheduler's prefix-cache counters over the run, in the summary's layout."""
    lines = [
        "Prefix Cache (scheduler, this run)".center(WIDTH, "-"),
        _row("Prompt tokens looked up:", report.prefix_cache_queries),
        _row("Prompt tokens found:", report.prefix_cache_hits),
        _row("Prefix cache hit rate (%):", _percent(report.hit_rate)),
    ]
    for w in report.workers:
        lines.append(_row(f"Requests routed to {w.worker_id}:", w.num_routed))
        lines.append(_row(f"Hit rate on {w.worker_id} (%):", _percent(w.hit_rate)))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_ttft_by_turn(means_ms: Sequence[float | None]) -> str:
    """One line: mean TTFT of each turn position of the conversations."""
    values = ", ".join("n/a" if m is None else f"{m:.1f}" for m in means_ms)
    return f"Mean TTFT by turn (ms): {values}"


def per_request_details(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """Per-request arrays for the saved JSON (latencies in seconds, as vLLM saves them)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.num_output_tokens for r in records],
        "requested_output_lens": [r.output_len for r in records],
        "cached_tokens": [r.cached_tokens for r in records],
        "ttfts": [r.ttft if r.token_times else None for r in records],
        "itls": [r.itls for r in records],
        "errors": [r.error for r in records],
    }


def save_result(path: Path, summary: BenchSummary, extra: Mapping[str, Any]) -> None:
    """Write the summary's fields, then extra, as one JSON object."""
    data = {**summary.to_dict(), **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a stray inf/NaN must fail here, not in whoever reads the file later.
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
