"""Percentiles and the summary of hand-built request records."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from services.client.bench.metrics import mean_ttft_by_turn, percentile, summarize
from services.client.bench.records import RequestRecord


@pytest.mark.parametrize("q", [0, 1, 25, 50, 75, 90, 99, 99.9, 100])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy(q: float, n: int) -> None:
    rng = random.Random(n)
    values = [rng.uniform(-5, 50) for _ in range(n)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_interpolates_between_ranks() -> None:
    # Unsorted input; p50 of 4 values lies halfway between the 2nd and 3rd.
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([10.0, 20.0], 99) == pytest.approx(19.9)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _rec(start: float, times: list[float], prompt_len: int = 10, output_len: int | None = None) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len,
        output_len=len(times) if output_len is None else output_len,
        start=start,
        token_times=times,
    )


def _records() -> list[RequestRecord]:
    return [
        # ttft 0.1, gaps 0.1 0.1 0.2 -> tpot 0.4/3, e2e 0.5
        _rec(0.0, [0.1, 0.2, 0.3, 0.5], prompt_len=10),
        # ttft 0.3, gap 0.1 -> tpot 0.1, e2e 0.4; 5 cached prompt tokens
        RequestRecord(prompt_len=20, output_len=2, start=1.0, token_times=[1.3, 1.4], cached_tokens=5),
        # one token: ttft 0.2, no tpot, no itl
        _rec(2.0, [2.2], prompt_len=30),
        # failed: must not count anywhere but `failed`
        RequestRecord(prompt_len=99, output_len=7, start=0.0, token_times=[5.0, 9.0], success=False, error="boom"),
    ]


def test_summarize_counts_and_throughputs() -> None:
    s = summarize(_records(), 2.0, backend="meshserve", goodput_slos=None)
    assert (s.completed, s.failed) == (3, 1)
    assert s.total_input_tokens == 60
    assert s.total_output_tokens == 7
    assert s.requested_output_tokens == 7
    assert s.output_len_mismatches == 0
    assert s.total_cached_tokens == 5
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(3.5)
    assert s.total_token_throughput == pytest.approx(33.5)
    assert s.goodput is None
    assert s.errors == {"boom": 1}


def test_summarize_latencies_in_ms() -> None:
    s = summarize(_records(), 2.0, backend="meshserve")
    ttfts = [100.0, 300.0, 200.0]
    assert s.mean_ttft_ms == pytest.approx(200.0)
    assert s.median_ttft_ms == pytest.approx(200.0)
    assert s.p99_ttft_ms == pytest.approx(np.percentile(ttfts, 99))
    # TPOT excludes the first token and skips the single-token request: mean of 400/3 and 100.
    assert s.mean_tpot_ms == pytest.approx((400 / 3 + 100) / 2)
    # ITL pools every gap of every request (not a mean of per-request means).
    itls = [100.0, 100.0, 200.0, 100.0]
    assert s.mean_itl_ms == pytest.approx(np.mean(itls))
    assert s.median_itl_ms == pytest.approx(100.0)
    assert s.p99_itl_ms == pytest.approx(np.percentile(itls, 99))
    assert s.mean_e2el_ms == pytest.approx((500 + 400 + 200) / 3)
    assert s.p99_e2el_ms == pytest.approx(np.percentile([500, 400, 200], 99))


def test_summarize_tokens_in_one_message_share_a_time() -> None:
    # Three tokens in one message then one later: gaps 0, 0, 0.3; TPOT = 0.3 / 3.
    s = summarize([_rec(0.0, [0.1, 0.1, 0.1, 0.4])], 1.0, backend="meshserve")
    assert s.mean_tpot_ms == pytest.approx(100.0)
    assert s.median_itl_ms == pytest.approx(0.0)
    assert s.mean_itl_ms == pytest.approx(100.0)


def test_summarize_counts_output_length_mismatches() -> None:
    records = [_rec(0.0, [0.1, 0.2], output_len=4), _rec(0.0, [0.1, 0.2, 0.3])]
    s = summarize(records, 1.0, backend="meshserve")
    assert s.total_output_tokens == 5
    assert s.requested_output_tokens == 7
    assert s.output_len_mismatches == 1


def test_summarize_success_without_tokens_counts_as_failed() -> None:
    s = summarize([_rec(0.0, [], output_len=3), _rec(0.0, [0.5])], 1.0, backend="meshserve")
    assert (s.completed, s.failed) == (1, 1)
    assert s.mean_ttft_ms == pytest.approx(500.0)


def test_goodput_needs_every_slo() -> None:
    records = _records()
    # ttft <= 250 ms keeps requests 1 and 3 (request 2 has 300 ms).
    assert summarize(records, 2.0, backend="m", goodput_slos={"ttft": 250}).goodput == pytest.approx(1.0)
    # tpot <= 110 ms drops request 1 (133 ms); request 3 has no TPOT and passes.
    assert summarize(records, 2.0, backend="m", goodput_slos={"tpot": 110}).goodput == pytest.approx(1.0)
    # Both: only request 3 remains.
    both = summarize(records, 2.0, backend="m", goodput_slos={"ttft": 250, "tpot": 110})
    assert both.goodput == pytest.approx(0.5)
    assert both.goodput_slos_ms == {"ttft": 250, "tpot": 110}
    # itl is the request's largest gap: request 1 has a 200 ms gap.
    assert summarize(records, 2.0, backend="m", goodput_slos={"itl": 150}).goodput == pytest.approx(1.0)
    assert summarize(records, 2.0, backend="m", goodput_slos={"e2el": 450}).goodput == pytest.approx(1.0)
    assert summarize(records, 2.0, backend="m", goodput_slos={"e2el": 1000}).goodput == pytest.approx(1.5)


def test_goodput_rejects_unknown_metric() -> None:
    with pytest.raises(ValueError, match="latency"):
        summarize(_records(), 1.0, backend="m", goodput_slos={"latency": 1.0})


def test_summary_without_completions_and_to_dict() -> None:
    failed = [RequestRecord(prompt_len=3, output_len=2, start=0.0, success=False, error="UNAVAILABLE: down")]
    s = summarize(failed, 1.0, backend="meshserve", max_concurrency=4, request_rate=math.inf, burstiness=0.5)
    assert s.completed == 0
    assert s.mean_ttft_ms == s.p99_e2el_ms == 0.0
    data = s.to_dict()
    assert data["request_rate"] == "inf"
    assert data["max_concurrency"] == 4
    assert data["burstiness"] == 0.5
    assert data["errors"] == {"UNAVAILABLE: down": 1}
    assert summarize(failed, 1.0, backend="m", request_rate=2.5).to_dict()["request_rate"] == 2.5


def test_mean_ttft_by_turn_leaves_out_failures() -> None:
    def rec(ttft: float, ok: bool = True) -> RequestRecord:
        return RequestRecord(prompt_len=4, output_len=1, start=1.0, token_times=[1.0 + ttft] if ok else [], success=ok)

    records = [rec(0.1), rec(0.3), rec(0.2), rec(0.5, ok=False), rec(0.5, ok=False)]
    # Turn 2 has only a failed request, so it has no mean.
    assert mean_ttft_by_turn(records, [0, 1, 0, 1, 2]) == pytest.approx([150.0, 300.0, None])
    assert mean_ttft_by_turn([], []) == []
    with pytest.raises(ValueError):
        mean_ttft_by_turn(records, [0])
