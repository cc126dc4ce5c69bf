"""The printed table and the saved JSON."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from services.client.bench.metrics import summarize
from services.client.bench.records import RequestRecord
from services.client.bench.report import (
    format_summary,
    format_ttft_by_turn,
    per_request_details,
    print_summary,
    save_result,
)


def _records() -> list[RequestRecord]:
    return [
        RequestRecord(prompt_len=4, output_len=3, start=0.0, token_times=[0.25, 0.5, 0.75], cached_tokens=2),
        RequestRecord(prompt_len=5, output_len=2, start=0.0, success=False, error="UNAVAILABLE: gone"),
    ]


def test_table_lists_the_vllm_rows() -> None:
    summary = summarize(_records(), 1.0, backend="meshserve", goodput_slos={"ttft": 300}, max_concurrency=2)
    table = format_summary(summary)
    for row in (
        "Successful requests:                     1",
        "Failed requests:                         1",
        "Total input tokens:                      4",
        "Total generated tokens:                  3",
        "Request goodput (req/s):                 1.00",
        "Mean TTFT (ms):                          250.00",
        "Median TPOT (ms):                        250.00",
        "P99 E2EL (ms):                           750.00",
        "Maximum request concurrency:             2",
        "Traffic request rate:                    inf",
    ):
        assert row in table
    out = io.StringIO()
    print_summary(summary, out)
    assert "1 request(s) failed: UNAVAILABLE: gone" in out.getvalue()


def test_goodput_row_only_with_slos() -> None:
    assert "goodput" not in format_summary(summarize(_records(), 1.0, backend="meshserve"))


def test_save_result_writes_summary_and_extra(tmp_path: Path) -> None:
    records = _records()
    summary = summarize(records, 2.0, backend="meshserve", request_rate=math.inf)
    path = tmp_path / "sub" / "out.json"
    save_result(path, summary, {"model": "tiny", **per_request_details(records)})
    data = json.loads(path.read_text())
    assert data["completed"] == 1
    assert data["request_throughput"] == 0.5
    assert data["request_rate"] == "inf"
    assert data["model"] == "tiny"
    assert data["output_lens"] == [3, 0]
    assert data["ttfts"] == [0.25, None]
    assert data["itls"] == [[0.25, 0.25], []]
    assert data["errors"] == ["", "UNAVAILABLE: gone"]
    assert data["cached_tokens"] == [2, 0]


def test_ttft_by_turn_line() -> None:
    assert format_ttft_by_turn([120.0, 35.25, None]) == "Mean TTFT by turn (ms): 120.0, 35.2, n/a"
